"""Helpers for tests, benchmarks and notebooks: a compile counter, tiny hermetic models.

  count_compiles()       counts XLA compiles while active (`with count_compiles() as compiles:`)
  tiny_llama_config()    a Llama config small enough to compile and run in well under a second
  tiny_llama()           a randomly initialised tiny `Llama`
  TargetOnly             an example `LogitsProcessor`: extra_args["target_token"] is all a row emits

The model helpers import flax and the model code on first use, so the compile counter stays a
light import.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import TYPE_CHECKING, Any

import jax.monitoring
import jax.numpy as jnp
import numpy as np

from jaxengine.sample.custom import LogitsProcessor

if TYPE_CHECKING:
  from jaxengine.models.llama import Llama, LlamaConfig

#: The event `jax.monitoring` records, with its duration, for every XLA backend compile.
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileCounter:
  """Counts XLA backend compiles (in the whole process) while it is active.

  A context manager (`with count_compiles() as compiles: ...`), or `start()` / `stop()` where a
  `with` block does not fit (a notebook's cells).

  Attributes:
    count: compiles seen while active.
    seconds: their total backend compile time.
    compiled: each of them as `(function name, thread name)` (e.g. ``("jit(sample_produced)",
      "MainThread")``), in the order they ended.
  """

  def __init__(self) -> None:
    self.count = 0
    self.seconds = 0.0
    self.compiled: list[tuple[str, str]] = []
    self._active = False

  def _listen(self, event: str, duration_secs: float, **kwargs: str | int) -> None:
    if self._active and event == BACKEND_COMPILE_EVENT:
      self.count += 1
      self.seconds += duration_secs
      name = str(kwargs.get("fun_name", ""))  # JAX names the jitted function
      self.compiled.append((name, threading.current_thread().name))

  def start(self) -> CompileCounter:
    """Starts counting (registers a `jax.monitoring` listener); returns self."""
    if not self._active:
      self._active = True
      jax.monitoring.register_event_duration_secs_listener(self._listen)
    return self

  def stop(self) -> None:
    """Stops counting (unregisters the listener); the count is kept."""
    if self._active:
      self._active = False
      jax.monitoring.unregister_event_duration_listener(self._listen)

  def reset(self) -> None:
    """Sets the count and time back to zero and forgets the compiles seen."""
    self.count, self.seconds = 0, 0.0
    self.compiled.clear()

  def __enter__(self) -> CompileCounter:
    return self.start()

  def __exit__(self, *exc_info) -> None:
    self.stop()


def count_compiles() -> CompileCounter:
  """A new `CompileCounter`, to use as `with count_compiles() as compiles: ...; compiles.count`.

  JAX records `BACKEND_COMPILE_EVENT` through `jax.monitoring` for every executable it builds,
  compiled by XLA or read back from the persistent compilation cache (calls served by a jitted
  function's in-memory cache record nothing), so a count does not depend on what an earlier
  process left on disk, and after warm-up a steady-state loop should leave it at zero.
  """
  return CompileCounter()


def tiny_llama_config(vocab_size: int = 256, **overrides) -> LlamaConfig:
  """A Llama config small enough to compile and run in well under a second on CPU.

  Defaults: 2 layers, hidden 64, 4 query heads over 2 key/value heads of width 16 (so grouped
  query attention is exercised), MLP width 128, rope_theta 10000, tied input/output embeddings
  (like SmolLM2), BOS 1, EOS 2.

  Args:
    vocab_size: vocabulary size.
    **overrides: any other `LlamaConfig` field.

  Returns:
    The `LlamaConfig`.
  """
  fields: dict[str, Any] = dict(
    vocab_size=vocab_size,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
  )
  from jaxengine.models.llama import LlamaConfig

  unknown = set(overrides) - {f.name for f in dataclasses.fields(LlamaConfig)}
  if unknown:
    raise TypeError(f"unknown LlamaConfig fields: {sorted(unknown)}")
  fields.update(overrides)
  return LlamaConfig(**fields)


def tiny_llama(
  seed: int = 0,
  config: LlamaConfig | None = None,
  *,
  dtype=jnp.float32,
  **config_overrides,
) -> tuple[Llama, LlamaConfig]:
  """A randomly initialised tiny `Llama`.

  Args:
    seed: initialisation seed.
    config: a full config; defaults to `tiny_llama_config(**config_overrides)`.
    dtype: model dtype.
    **config_overrides: passed to `tiny_llama_config` when ``config`` is None.

  Returns:
    ``(model, config)``.
  """
  from flax import nnx

  from jaxengine.models.llama import Llama

  if config is None:
    config = tiny_llama_config(**config_overrides)
  elif config_overrides:
    raise TypeError("pass either config or config overrides, not both")
  return Llama(config, dtype=dtype, rngs=nnx.Rngs(seed)), config


class TargetOnly(LogitsProcessor):
  """Example processor (README, "Structured outputs and your own logits processors").

  A request with `extra_args={"target_token": t}` emits only `t`; other requests are untouched.
  Refuses a target outside the vocabulary.
  """

  def init_state(self, max_num_reqs: int, vocab_size: int) -> dict:
    self.vocab_size = vocab_size
    return {"target": jnp.zeros((max_num_reqs,), jnp.int32)}

  def row_state(self, params, prompt_token_ids) -> dict | None:
    target = (params.extra_args or {}).get("target_token")
    if target is None:
      return None
    if not isinstance(target, int) or not 0 <= target < self.vocab_size:
      raise ValueError(f"extra_args['target_token'] must be a token id, got {target!r}")
    return {"target": np.int32(target)}

  def apply(self, state, active, logits):
    keep = jnp.arange(logits.shape[-1]) == state["target"][:, None]
    return jnp.where(active[:, None] & ~keep, -jnp.inf, logits)
