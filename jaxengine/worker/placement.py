"""Where a `ModelRunner` on a `jax.sharding.Mesh` puts everything, fixed once at start-up.

The specs themselves are `jaxengine.parallel`'s; this module turns them into the concrete
`NamedSharding` trees of one runner (weights, KV-cache pages, batch state, sampling metadata) and the
`in_shardings` / `out_shardings` of its jitted steps. Declaring both sides on every step is what
keeps warm-up and serving on the same executables: an argument whose sharding drifted would be
refused by `jax.jit` rather than silently recompiled.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, cast

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxengine import parallel
from jaxengine.batch import InputBatch
from jaxengine.models.attention_backends import AttentionBackend
from jaxengine.models.interface import Model
from jaxengine.models.kv_cache import KVCacheSpec
from jaxengine.models.kv_pages import PagedKVCache
from jaxengine.models.lora import LoRAInputs
from jaxengine.models.registry import sharding_rules
from jaxengine.models.sharded_attention import HeadShardedBackend
from jaxengine.worker.multi_step import DecodeStepsInputs
from jaxengine.worker.ragged_step import RaggedForward, RaggedInputs


def num_attention_heads(model: Any) -> int | None:
  """The model's query heads (from its `config`), or None when it does not say."""
  config = getattr(model, "config", None)
  heads = getattr(config, "num_attention_heads", None)
  return heads if isinstance(heads, int) else None


def stacked_paths(model: Model) -> tuple[str, ...]:
  """The state paths whose leaves have a leading layer axis (a scanned model's ``layers``,
  `jaxengine.models.layer_scan`), left unsplit on a mesh; none for any other model."""
  return tuple(getattr(model, "stacked_paths", ()))


def placed_copy(
  model: Model, mesh: Mesh, *, expert_parallel: bool = False, batch_invariant: bool = False
) -> Model:
  """A copy of `model` whose weights lie in the shardings `MeshPlacement` gives them.

  For quantization on a mesh (`jaxengine.models.quantization.quantize_model` quantizes each
  matrix where it is): each device then quantizes its own shard, and the values come out in
  the float weight's sharding, the one `MeshPlacement` gives them too (the same role and
  shape). `ModelRunner.load_weights` puts new float weights there before quantizing them, so
  both calls of the jitted quantization see one argument placement: nothing compiles again.
  """
  graphdef, state = nnx.split(cast(nnx.Module, model))
  shardings = parallel.weight_shardings(
    state,
    mesh,
    sharding_rules(model),
    expert_parallel=expert_parallel,
    stacked_paths=stacked_paths(model),
    batch_invariant=batch_invariant,
  )
  return cast(Model, nnx.merge(graphdef, jax.device_put(state, shardings)))


def placed_step(placement: MeshPlacement | None, step: Callable[..., Any]) -> Callable[..., Any]:
  """A jitted step as `InputBatch.run_step` calls it: `step` itself off a mesh (`placement`
  None); on one, state and metadata first put on their declared shardings (a no-op when the
  batch's own updates kept them) and the static keyword arguments passed by position, in the
  order given (`jax.jit` takes no keywords with `in_shardings`)."""
  if placement is None:
    return step

  def placed(state, metadata, *args, **static):
    state = jax.device_put(state, placement.state)
    metadata = jax.device_put(metadata, placement.metadata)
    return step(state, metadata, *args, *static.values())

  return placed


class MeshPlacement:
  """The shardings of one runner on `mesh` (axes ``("data", "model")``).

  Args:
    model: the runner's model (its query heads are checked against the model axis).
    weights: its `nnx.State` (as `nnx.split` returns it).
    input_batch: the runner's batch (`max_num_reqs` must be a multiple of the data axis).
    mesh: the mesh.
    expert_parallel: split a mixture-of-experts model's experts over the model axis
      (`EngineConfig.enable_expert_parallel`; the axis must divide its ``num_experts``).
    batch_invariant: keep every matrix's input axis whole (`EngineConfig.batch_invariant`;
      `jaxengine.parallel.weight_spec`).

  Attributes:
    mesh: the mesh.
    rows: the data-parallel size `d`: the smallest row bucket (buckets are multiples of it).
    weights: `NamedSharding` tree of the model's `nnx.State` (`parallel.weight_shardings` by
      the roles of `jaxengine.models.registry.sharding_rules`).
    state: `BatchState` tree of `NamedSharding` (rows over ``"data"``).
    metadata: `SamplingMetadata` tree of `NamedSharding` (rows over ``"data"``).
    kv_pages: `PagedKVCache` tree of `NamedSharding` (set by `create_kv_pages`).
    lora: the LoRA slots' `NamedSharding`s (set by `lora_shardings`), None without LoRA.

  Raises:
    ValueError: the model axis does not divide the query heads (both numbers named), or the
      experts with `expert_parallel`, or the data axis does not divide `max_num_reqs`.
  """

  @staticmethod
  def check(model: Model, input_batch: InputBatch, mesh: Mesh, *, expert_parallel: bool) -> None:
    """The checks of `__init__` alone (host side, before any weight moves: a model axis that
    does not divide the heads would otherwise reach XLA, whose collectives then wait forever).

    Raises:
      ValueError: as `__init__`.
    """
    t = parallel.axis_size(mesh, parallel.MODEL)
    d = parallel.axis_size(mesh, parallel.DATA)
    heads = num_attention_heads(model)
    if heads is not None:
      parallel.check_heads(heads, t)
    experts = getattr(getattr(model, "config", None), "num_experts", 0)
    if expert_parallel and isinstance(experts, int) and experts > 0:
      parallel.check_experts(experts, t)
    if input_batch.max_num_reqs % d:
      raise ValueError(
        f"data_parallel_size={d} must divide max_num_reqs={input_batch.max_num_reqs} (each "
        "data shard holds the same number of rows)"
      )

  def __init__(
    self,
    model: Model,
    weights: Any,
    input_batch: InputBatch,
    mesh: Mesh,
    *,
    expert_parallel: bool = False,
    batch_invariant: bool = False,
  ) -> None:
    self.check(model, input_batch, mesh, expert_parallel=expert_parallel)
    self.batch_invariant = batch_invariant
    num_rows = input_batch.max_num_reqs
    d = parallel.axis_size(mesh, parallel.DATA)
    self.mesh = mesh
    self.rows = d
    self.weights = parallel.weight_shardings(
      weights,
      mesh,
      sharding_rules(model),
      expert_parallel=expert_parallel,
      stacked_paths=stacked_paths(model),
      batch_invariant=batch_invariant,
    )
    self.state = parallel.row_shardings(input_batch.state, num_rows, mesh)
    self.metadata = parallel.row_shardings(input_batch.sampling_metadata, num_rows, mesh)
    self._replicated = NamedSharding(mesh, P())
    self.lora: Any = None

  def lora_shardings(
    self, target_shapes: dict[str, tuple[int, ...]], num_layers: int
  ) -> tuple[dict[str, tuple[NamedSharding, NamedSharding]], ...]:
    """The LoRA slots' shardings, per layer target -> ``(A's, B's)``, split as the targets'
    base projections (`jaxengine.parallel.lora_specs`); sets `lora`, which the steps then
    declare for their inputs' adapters."""
    t = parallel.axis_size(self.mesh, parallel.MODEL)
    specs = parallel.lora_specs(target_shapes, t, batch_invariant=self.batch_invariant)
    named = {k: (NamedSharding(self.mesh, a), NamedSharding(self.mesh, b)) for k, (a, b) in
             specs.items()}  # fmt: skip
    self.lora = tuple(dict(named) for _ in range(num_layers))
    return self.lora

  def step_inputs_shardings(self, inputs_type: type = RaggedInputs) -> Any:
    """The shardings of a step's `RaggedInputs` (or `DecodeStepsInputs`): replicated, but for
    the LoRA slots (`lora`) when set."""
    rep: Any = self._replicated  # a tree of shardings in the inputs' shape (a prefix)
    if self.lora is None:
      return rep
    fields = [f.name for f in dataclasses.fields(inputs_type) if f.name != "lora"]
    return inputs_type(**dict.fromkeys(fields, rep), lora=LoRAInputs(slots=rep, layers=self.lora))

  def create_kv_pages(
    self,
    spec: KVCacheSpec,
    backend: AttentionBackend,
    num_blocks: int,
    block_size: int,
    layer_groups: tuple[tuple[int, int], ...] | None = None,
  ) -> PagedKVCache:
    """A zero paged cache allocated directly in its shards; sets `kv_pages`.

    Pages are split over key/value heads when `backend` is a `HeadShardedBackend`
    (`jaxengine.models.sharded_attention.shard_backend`), replicated otherwise.
    """
    create = functools.partial(
      PagedKVCache.create, spec, backend, num_blocks, block_size, layer_groups
    )
    self.kv_pages = self.kv_pages_shardings(jax.eval_shape(create), backend)
    return jax.jit(create, out_shardings=self.kv_pages)()

  def kv_pages_shardings(self, pages: Any, backend: AttentionBackend) -> Any:
    """The `NamedSharding` tree of a paged cache `pages` (arrays or `jax.ShapeDtypeStruct`s) of
    `backend`: split over key/value heads for a `HeadShardedBackend`, else replicated."""
    spec = backend.page_specs(1)[0] if isinstance(backend, HeadShardedBackend) else P()
    return jax.tree.map(lambda _: NamedSharding(self.mesh, spec), pages)

  def ragged_forward_shardings(self, vocab_size: int) -> dict[str, Any]:
    """`in_shardings` / `out_shardings` of the paged runner's model step
    (`jaxengine.worker.ragged_step.ragged_forward`, after `create_kv_pages`): ``(state,
    weights, kv_cache, RaggedInputs) -> RaggedForward(logits, kv_cache, prompt logprobs)``; the
    logits as `logits_sharding`, the step's inputs and prompt logprobs replicated."""
    rep, cache = self._replicated, self.kv_pages
    return {
      "in_shardings": (self.state, self.weights, cache, self.step_inputs_shardings()),
      "out_shardings": RaggedForward(  # a tree of shardings in the output's shape
        logits=cast(Any, self.logits_sharding(vocab_size)),
        kv_cache=cache,
        prompt_logprobs=cast(Any, rep),
        routed_experts=cast(Any, rep),
      ),
    }

  def sample_produced_shardings(self, vocab_size: int) -> dict[str, Any]:
    """`in_shardings` / `out_shardings` of the paged runner's sampler step
    (`jaxengine.worker.ragged_step.sample_produced`): ``(state, metadata, logits, produces) ->
    (state, MultiStepOutput)``; the output (it goes to the host) replicated."""
    rep = self._replicated
    return {
      "in_shardings": (self.state, self.metadata, self.logits_sharding(vocab_size), rep),
      "out_shardings": (self.state, rep),
    }

  def logits_sharding(self, vocab_size: int) -> NamedSharding:
    """`[R, V]` logits between the model and the sampler: the vocabulary over the model axis
    when it divides `V` (where the LM head leaves them, and how the sampler reads them),
    else replicated."""
    t = parallel.axis_size(self.mesh, parallel.MODEL)
    return NamedSharding(self.mesh, P(None, parallel.MODEL) if vocab_size % t == 0 else P())

  def verify_forward_shardings(self) -> dict[str, Any]:
    """`in_shardings` / `out_shardings` of the verify step's model part
    (`jaxengine.worker.verify_step.verify_forward`): as `ragged_forward_shardings` with one
    more replicated input (``RaggedDrafts``), and the logits whole on every device (the
    rejection sampler reads them so)."""
    rep, cache = self._replicated, self.kv_pages
    return {
      "in_shardings": (self.state, self.weights, cache, self.step_inputs_shardings(), rep),
      "out_shardings": RaggedForward(  # a tree of shardings in the output's shape
        logits=cast(Any, rep),
        kv_cache=cache,
        prompt_logprobs=cast(Any, rep),
        routed_experts=cast(Any, rep),
      ),
    }

  def rejection_sample_produced_shardings(self) -> dict[str, Any]:
    """`in_shardings` / `out_shardings` of the verify step's sampler part
    (`jaxengine.worker.verify_step.rejection_sample_produced`): ``(state, metadata, logits,
    RaggedDrafts, produces) -> (state, MultiStepOutput)``, all but the batch replicated."""
    rep = self._replicated
    return {
      "in_shardings": (self.state, self.metadata, rep, rep, rep),
      "out_shardings": (self.state, rep),
    }

  def decode_steps_shardings(self) -> dict[str, Any]:
    """`in_shardings` / `out_shardings` of the paged k-step loop: ``(state, metadata, weights,
    kv_cache, DecodeStepsInputs) -> (state, MultiStepOutput, (kv_cache, RoutedExperts or
    None))``; the loop's inputs and its outputs replicated, the cache as created."""
    rep, cache = self._replicated, self.kv_pages
    return {
      "in_shardings": (
        self.state,
        self.metadata,
        self.weights,
        cache,
        self.step_inputs_shardings(DecodeStepsInputs),
      ),
      "out_shardings": (self.state, rep, (cache, rep)),
    }

  @property
  def replicated(self) -> NamedSharding:
    """The mesh's replicated sharding (host inputs of a step)."""
    return self._replicated
