"""The model interface: what a decoder must offer for the engine to serve it.

The engine knows nothing of a model's architecture, and the model nothing of sampling. A model is
a Flax NNX module with the methods and properties of `Model`; the runner splits it once
(`nnx.split`) and jits pure functions of `(graphdef, weights, ...)`, so its weights can be
replaced without recompiling. `jaxengine.models.Llama` implements it; so can your own module:

    class MyModel(nnx.Module):          # vocab_size, eos_token_id, max_position_embeddings,
      ...                               # kv_cache_spec, __call__, compute_logits as below
    llm = jaxengine.LLM(MyModel(...), tokenizer=jaxengine.tokenizer.Tokenizer.from_pretrained(d))

The cache is yours to use as the model likes (it is a `[L, num_slots, S, K, D]` key and value
buffer); the engine only allocates it from `kv_cache_spec`, donates it and points each row at its
slot. With prefix caching (on by default) it also copies positions between slots and its block
pool, so what a model writes at `(slot, position)` must depend only on the tokens up to that
position, and a call whose first position is `p > 0` must attend to the slot's cached positions
below `p` (the prefill of a prompt's remainder after a cached prefix starts there).

Optional: a `weight_specs()` method returning `jaxengine.models.WeightSpec`s names the
parameters for `LLM.load_weights` (checkpoint names and layouts); without it the names are the
dotted NNX paths of the model's state (``"layers.0.attn.wq"``) and tensors are taken whole.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax

from jaxengine.models.kv_cache import KVCache, KVCacheSpec

__all__ = ["KVCacheSpec", "Model", "check_model"]


@runtime_checkable
class Model(Protocol):
  """What the engine needs from a decoder-only language model (an `nnx.Module`).

  Shapes follow the package legend: `B` rows of one call, `T` tokens per row, `E` hidden size,
  `V` vocabulary.
  """

  @property
  def vocab_size(self) -> int:
    """Width of the logits `V`."""
    ...

  @property
  def eos_token_id(self) -> int | None:
    """The model's end-of-sequence id (the tokenizer's, when it has one, takes precedence)."""
    ...

  @property
  def max_position_embeddings(self) -> int:
    """Longest sequence the model supports; the engine's `max_model_len` may not exceed it."""
    ...

  @property
  def kv_cache_spec(self) -> KVCacheSpec:
    """Layers, key/value heads, head dim and dtype of the cache the model reads and writes."""
    ...

  def __call__(
    self,
    token_ids: jax.Array,
    positions: jax.Array,
    kv_cache: KVCache,
    cache_slots: jax.Array,
    *,
    attention_len: int | None = None,
  ) -> tuple[jax.Array, KVCache]:
    """Runs the decoder, writing each token's keys and values at `(cache_slots[b], positions[b, t])`.

    Args:
      token_ids: `[B, T] int32`.
      positions: `[B, T] int32` absolute positions; positions `>= max_model_len` write nothing
        (padding rows).
      kv_cache: the cache (the runner donates it).
      cache_slots: `[B] int32` the cache slot of each row.
      attention_len: static; cache positions `0..attention_len-1` are attended to (None: all).

    Returns:
      `(hidden [B, T, E], updated KVCache)`.
    """
    ...

  def compute_logits(self, hidden: jax.Array) -> jax.Array:
    """`[..., E]` hidden states -> `[..., V] float32` logits."""
    ...


def check_model(model: Any) -> None:
  """Raises `ValueError` naming what is missing when `model` does not implement `Model`."""
  missing = [
    name
    for name in ("vocab_size", "eos_token_id", "max_position_embeddings", "kv_cache_spec")
    if not hasattr(model, name)
  ]
  missing += [name for name in ("__call__", "compute_logits") if not callable(getattr(model, name))]
  if missing:
    raise ValueError(
      f"{type(model).__name__} does not implement jaxengine.models.Model: missing {missing}"
    )
  spec = model.kv_cache_spec
  if not isinstance(spec, KVCacheSpec):
    raise ValueError(f"kv_cache_spec must be a KVCacheSpec, got {spec!r}")
