"""`JaxEngineRollout`'s weight sync for Tunix's pipelines, synchronous and asynchronous:
`update_params` (with a weight version), `pause_generation`, `resume_generation`, `is_paused`
(vLLM's names; `pause` and `resume` are the names of Tunix's vLLM driver), over `LLMEngine`'s
(`jaxengine/engine/pause.py`).

Tunix's agentic learner calls `generate` from several threads at once (its trajectory workers)
and `update_params` from the trainer's (`RLCluster.sync_weights`). The engine is not
thread-safe, so the rollout drives it itself: each `generate` adds its requests and steps the
engine one step at a time under one lock (`between_steps`), whichever thread steps keeping the
finished outputs of every caller for its owner; a weight sync or a pause takes the lock between
two steps, ahead of the stepping threads. While generation is paused the callers wait (their
requests kept, or held if sent while paused) and go on after `resume_generation`: "keep" with a
sync in between is asynchronous RL's in-flight weight update, each token stamped with the version
that produced it (`CompletionOutput.weight_versions`). `max_staleness` (None: off) is the
`SamplingParams.max_staleness` of every request: a sync that leaves a request's oldest token more
than that many versions behind ends it, and its `generate` returns the tokens it had (Tunix's
agentic learner bounds staleness per batch with `off_policy_steps`; this bounds it per request).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, cast

import jax
from flax import nnx

from jaxengine.integrations.tunix_lora import split_lora_leaves
from jaxengine.integrations.tunix_weights import (
  check_tunix_params,
  engine_leaves,
  tunix_param_leaves,
)
from jaxengine.lora import LoRARequest
from jaxengine.models.weights import replace_leaves, state_leaves
from jaxengine.outputs import RequestOutput
from jaxengine.params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
  from jaxengine.entrypoints.llm import LLM
  from jaxengine.lora import LoRAAdapter


class TunixWeightSync:
  """The mixin (`JaxEngineRollout` supplies `llm`, `config`, `dtype`, `device`,
  `lora_request`, `reshard_chunk_bytes`, `free_kv_cache_during_sync`, `kv_cache_bytes_freed`,
  `_float_weights` and `_lora_adapter`, and calls `_init_weight_sync`)."""

  llm: LLM
  config: Any
  dtype: Any
  device: Any
  lora_request: LoRARequest | None
  reshard_chunk_bytes: int | None
  free_kv_cache_during_sync: bool
  kv_cache_bytes_freed: int
  _float_weights: nnx.State

  if TYPE_CHECKING:  # `JaxEngineRollout`'s

    def _lora_adapter(self, lora: dict[str, Any]) -> LoRAAdapter: ...

  def _init_weight_sync(self) -> None:
    #: `SamplingParams.max_staleness` of every request `generate` sends (None: no bound).
    self.max_staleness: int | None = None
    self._lock = threading.Condition()
    self._num_between_steps = 0  # control calls waiting for the lock: the steppers yield
    self._count_lock = threading.Lock()
    self._finished: dict[str, RequestOutput] = {}

  # --- generation, one step at a time under the lock ------------------------------------------

  def generate_outputs(
    self, prompts: Sequence[Any], params: Sequence[SamplingParams]
  ) -> list[RequestOutput]:
    """Each prompt's final `RequestOutput` (with `lora_request`), stepping the engine one step
    at a time with the other threads' calls; waits while generation is paused. A request's own
    `max_staleness` wins over the rollout's.

    Raises:
      ValueError: a request the engine refuses, or a `max_staleness` that is not None or an
        int >= 0 (nothing runs then).
    """
    engine = self.llm.llm_engine
    final = RequestOutputKind.FINAL_ONLY
    specs = [
      (None, prompt, p.replace(output_kind=final, max_staleness=_bound(p, self.max_staleness)),
       self.lora_request)
      for prompt, p in zip(prompts, params, strict=True)
    ]  # fmt: skip
    with self._lock:
      ids = engine.add_requests(specs)
    try:
      while True:
        with self._lock:
          if all(i in self._finished for i in ids):
            return [self._finished.pop(i) for i in ids]
          if self._num_between_steps or engine.is_generation_frozen():
            self._lock.wait(timeout=1.0)  # a sync or a pause goes first; resume notifies
            continue
          self._keep_finished(engine.step() + engine.pop_finished())
    except BaseException:  # an error or an interrupt: the requests must not run on
      with self._lock:
        engine.abort_request(ids)
        for i in ids:
          self._finished.pop(i, None)
      raise

  def _keep_finished(self, outputs: list[RequestOutput]) -> None:
    """Keeps the finished outputs for their callers and wakes them (under the lock)."""
    self._finished.update((o.request_id, o) for o in outputs if o.finished)
    self._lock.notify_all()

  @contextlib.contextmanager
  def between_steps(self) -> Iterator[None]:
    """Holds the engine between two steps of the generating threads, ahead of them."""
    with self._count_lock:
      self._num_between_steps += 1
    try:
      with self._lock:
        yield
    finally:
      with self._count_lock:
        self._num_between_steps -= 1
      with self._lock:
        self._lock.notify_all()

  # --- pause and resume (vLLM's names; Tunix's vLLM driver says `pause` and `resume`) ----------

  def pause_generation(self, mode: str = "keep") -> None:
    """Pauses generation between two steps (`LLMEngine.pause_generation`): "keep" (default)
    freezes the running requests with their pages until `resume_generation`; "wait" finishes
    them first; "abort" ends them now (finish reason "abort": their `generate` returns the
    tokens they had). `generate` calls wait meanwhile; requests sent while paused start after
    resume. Pausing twice is harmless.

    Raises:
      ValueError: a mode other than "keep", "wait" or "abort" (nothing changes).
    """
    with self.between_steps():
      self._keep_finished(self.llm.llm_engine.pause_generation(mode))

  def resume_generation(self) -> None:
    """Ends a pause (`LLMEngine.resume_generation`): the waiting `generate` calls go on (the
    requests past `max_staleness` end first). Harmless when not paused."""
    with self.between_steps():
      engine = self.llm.llm_engine
      engine.resume_generation()
      self._keep_finished(engine.take_dropped())

  def is_paused(self) -> bool:
    """Whether generation is paused."""
    with self.between_steps():
      return self.llm.llm_engine.is_paused()

  def pause(self, mode: str = "keep") -> None:
    """`pause_generation` (the name of Tunix's vLLM driver)."""
    self.pause_generation(mode)

  def resume(self) -> None:
    """`resume_generation` (the name of Tunix's vLLM driver)."""
    self.resume_generation()

  @property
  def weight_version(self) -> int:
    """The version of the engine's weights: 0 until `update_params` gives one."""
    return self.llm.llm_engine.weight_version

  # --- the weight sync ---------------------------------------------------------------------------

  def update_params(
    self,
    params: Any,
    filter_types: tuple[Any, ...] | None = None,
    weight_version: int | None = None,
  ) -> None:
    """Loads the trainer's weights into the engine; nothing recompiles. Between two steps of
    the generations running in other threads (also while paused): the tokens they generate
    after it carry `weight_version` (`CompletionOutput.weight_versions`), and those past
    `max_staleness` end now with the tokens they had.

    Args:
      params: the Tunix model's parameter state: ``nnx.state(actor, nnx.Param)`` (every weight;
        on a qwix LoRA actor its `nnx.LoRAParam` leaves too, a subclass of `nnx.Param`), or
        ``nnx.state(actor, nnx.LoRAParam)`` (the LoRA leaves alone: Tunix's sync after each step
        of a LoRA actor, which replaces the adapter's values in place, read from memory); or
        the engine model's own float state (as `model()` gives it; Tunix passes that when it
        offloads). JAX arrays are converted where they live and placed as the engine's weights
        are (LoRA pairs, small, are copied through the host). With `quantization` the float
        weights are re-quantized on the way in (`LLM.load_weights`).
      filter_types: Tunix's filter: ``(nnx.Param,)``, ``(nnx.LoRAParam,)`` or None.
      weight_version: the version of these weights (Tunix's policy version, e.g. its global
        step); None (default): the current version + 1. A LoRA-only sync counts as a version.

    Raises:
      ValueError: (nothing changes) a negative or non-integer `weight_version`, another filter
        type, LoRA parameters for a rollout built without LoRA or of an unsupported name or
        shape (named), parameters that do not match the model, or a quantized engine's own
        state (its values and scales).
    """
    lora_only = filter_types is not None and all(t is nnx.LoRAParam for t in filter_types)
    if filter_types is not None and not lora_only and any(t is not nnx.Param for t in filter_types):
      raise ValueError(f"filter_types={filter_types}: only nnx.Param or nnx.LoRAParam")
    with self.between_steps():
      engine = self.llm.llm_engine
      version = engine.next_weight_version(weight_version)  # checked before anything changes
      self._load(params, lora_only, filter_types, version)
      engine.set_weight_version(version)  # a LoRA-only sync too; the stale requests end
      self._keep_finished(engine.take_dropped())

  def _load(self, params: Any, lora_only: bool, filter_types, version: int) -> None:
    """`update_params`' conversion and load (the engine held between steps)."""
    if isinstance(params, nnx.State) and self._is_engine_state(params):
      with self._kv_cache_freed():
        self.llm.load_weights(params, version)
      return
    if lora_only and self.lora_request is None:
      raise ValueError(f"filter_types={filter_types}: this rollout was built without LoRA")
    base, lora = split_lora_leaves(tunix_param_leaves(params))
    if lora and self.lora_request is None:
      raise ValueError(
        f"LoRA parameter {next(iter(lora))!r}: this rollout was built from an actor without "
        "LoRA (build it from the qwix LoRA model)"
      )
    if lora_only and base:
      raise ValueError(
        f"filter_types=(nnx.LoRAParam,) with a non-LoRA parameter {next(iter(base))!r}"
      )
    adapter = self._lora_adapter(lora) if lora else None  # checked before anything changes
    if not lora_only:
      check_tunix_params(base, self.config)  # on the host, before the KV cache is freed
      with self._kv_cache_freed():
        leaves = engine_leaves(
          base,
          self.config,
          self.dtype,
          self.device,
          shardings=self._weight_shardings(),
          chunk_bytes=self.reshard_chunk_bytes,
        )
        self.llm.load_weights(replace_leaves(self._float_weights, leaves), version)
    if adapter is not None:
      self.llm.load_lora_weights(cast(LoRARequest, self.lora_request), adapter)

  def _is_engine_state(self, params: nnx.State) -> bool:
    """Whether `params` is a state of the engine model's float layout (as `model()` gives it
    without `quantization`), which `LLM.load_weights` takes as it is.

    Raises:
      ValueError: the state of a quantized engine's own layout (its int8 / float8 values and
        scales: the runner re-quantizes float weights only).
    """
    paths = set(state_leaves(params))
    if paths == set(state_leaves(self._float_weights)):
      return True
    runner = self.llm.llm_engine.runner
    if runner.quantized and paths == set(state_leaves(runner.weights)):
      raise ValueError(
        f"update_params got the quantized engine's own state (quantization="
        f"{self.llm.config.quantization!r}); pass the trainer's float parameters"
      )
    return False

  @contextlib.contextmanager
  def _kv_cache_freed(self) -> Iterator[None]:
    """With `free_kv_cache_during_sync`, the engine's KV cache is freed inside (its bytes in
    `kv_cache_bytes_freed`) and a fresh one of the same pages made after, even on an error
    (`LLMEngine.free_kv_cache`, ``wake_up(tags=["kv_cache"])``: nothing compiles)."""
    engine = self.llm.llm_engine
    if not self.free_kv_cache_during_sync or engine.is_sleeping():
      yield
      return
    self.kv_cache_bytes_freed = engine.free_kv_cache()
    try:
      yield
    finally:
      engine.wake_up(["kv_cache"])

  def _weight_shardings(self) -> dict[Any, jax.sharding.Sharding] | None:
    """The engine's weight shardings by leaf path (where a sync puts each converted leaf,
    chunk by chunk), or None when the weights are not committed to a placement (an engine
    without a mesh)."""
    leaves = state_leaves(self.llm.llm_engine.runner.weights)
    if not all(getattr(leaf, "committed", False) for leaf in leaves.values()):
      return None
    return {path: leaf.sharding for path, leaf in leaves.items()}


def _bound(params: SamplingParams, default: int | None) -> int | None:
  """A request's staleness bound: its own `max_staleness`, else the rollout's."""
  return default if params.max_staleness is None else params.max_staleness
