"""The model interface: what a decoder must offer for the engine to serve it.

The engine knows nothing of a model's architecture, and the model nothing of sampling. A model is
a Flax NNX module with the methods and properties of `Model`; the runner splits it once
(`nnx.split`) and jits pure functions of `(graphdef, weights, ...)`, so its weights can be
replaced without recompiling. `jaxengine.models.Llama` implements it; so can your own module:

    class MyModel(nnx.Module):          # vocab_size, eos_token_id, max_position_embeddings,
      ...                               # kv_cache_spec, __call__, compute_logits as below
    llm = jaxengine.LLM(MyModel(...), tokenizer=jaxengine.tokenizer.Tokenizer.from_pretrained(d))

Attention goes through one seam, `jaxengine.models.attention.attention`: each layer computes its
queries, keys and values (``[1, T, H, D]``, ``[1, T, K, D]``) and hands them, with the cache,
its layer index and the `PagedAttentionMetadata` the engine passed to ``__call__``, to that
function, which stores the keys and values and returns the causal attention output and the
updated cache.
The model never indexes the cache nor builds a mask, so it stays unchanged when the cache layout
does (the metadata's fields and the seam's body change together; treat the metadata as opaque
and the tokens' leading dimensions as ``[...]``):

    def __call__(self, token_ids, positions, kv_cache, attn_metadata):
      x = self.embed(token_ids)
      for i, layer in enumerate(self.layers):
        q, k, v = layer.qkv(x, positions)   # your projections, rotary embedding, ...
        out, kv_cache = attention(q, k, v, kv_cache, i, attn_metadata, scale=d**-0.5)
        x = layer.rest(x, out)
      return self.norm(x), kv_cache

The seam's contract (its docstring) is what the engine relies on: what a token writes for its
position depends only on the tokens up to it, and a call whose first position is ``p > 0`` (the
prefill of a prompt's remainder after a cached prefix) attends to the positions below ``p``
already cached.

The cache is a `PagedKVCache` (a pool of pages per layer, laid out by the chosen attention
backend) and the metadata a `PagedAttentionMetadata` (each token's cache slot, each request's
block table, where its tokens start, its context length); the tokens of all scheduled requests
(prefill chunks, decodes, draft tokens) come as one flat ragged batch, ``token_ids`` and
``positions`` ``[1, T]``. A model that goes through the seam, treats the leading dimensions as
opaque (no ``B``/``T`` split, no per-row logic) and computes positions only from ``positions``
runs unchanged. What it must not do: index or reshape the cache itself, build its own mask, or
assume a row is one sequence. Outside the engine, a whole-sequence forward builds one such step
over a scratch pool of pages (`jaxengine.models.sequence_logprobs.scratch_step`,
`jaxengine.models.sequence_logits`). A sliding window and an attention
logit soft cap (the seam's ``sliding_window`` and ``soft_cap``, per layer if need be) work over
pages with the XLA and TPU backends; declare them in the model's `KVCacheSpec` (``sliding_window``,
``sliding_window_layers``, ``soft_cap``) so that the engine refuses, before any device work, a
backend without them (``"pallas_gpu"``), or, with ``attention_backend=None``, uses XLA instead.

Optional: a ``sharding_rules`` attribute mapping parameter names (the last name of a leaf's
path, ``"wq"``) to roles (`jaxengine.models.registry`: column-parallel, row-parallel,
vocab-parallel, replicated) places the weights on a mesh; without it (and outside the registry)
every weight is replicated.

Optional: a mixture-of-experts model (a ``config`` with ``moe_layers`` and
``num_experts_per_tok``) with a ``return_routed_experts`` attribute serves
``enable_return_routed_experts``: set on the engine's copy, its ``__call__`` returns a third
value, the ``[1, T, M, k] int32`` experts each token went to at its ``M`` MoE layers
(`jaxengine.models.Llama`; `jaxengine/worker/routed_experts.py`).

Optional: a `weight_specs()` method returning `jaxengine.models.WeightSpec`s names the
parameters for `LLM.load_weights` (checkpoint names and layouts); without it the names are the
dotted NNX paths of the model's state (``"layers.0.attn.wq"``) and tensors are taken whole.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax

from jaxengine.models.attention import PagedAttentionMetadata, PagedKVCache
from jaxengine.models.kv_cache import KVCacheSpec

__all__ = [
  "KVCacheSpec",
  "Model",
  "PagedAttentionMetadata",
  "PagedKVCache",
  "check_model",
]


@runtime_checkable
class Model(Protocol):
  """What the engine needs from a decoder-only language model (an `nnx.Module`).

  Shapes follow the package legend: `T` tokens of one call, `E` hidden size, `V` vocabulary.
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
    kv_cache: PagedKVCache,
    attn_metadata: PagedAttentionMetadata,
  ) -> tuple[jax.Array, PagedKVCache]:
    """Runs the decoder; every layer's attention goes through `jaxengine.models.attention`.

    Args:
      token_ids: `[1, T] int32` flat ragged tokens; ids outside the vocabulary may appear on
        padding tokens.
      positions: same shape, `int32` absolute positions (for the model's position encoding).
      kv_cache: the `PagedKVCache` (the runner donates it); pass it to the seam, do not index it.
      attn_metadata: this step's `PagedAttentionMetadata`; pass it to the seam untouched.

    Returns:
      `(hidden [1, T, E], updated cache)`.
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
  missing += [
    name for name in ("__call__", "compute_logits") if not callable(getattr(model, name, None))
  ]
  if missing:
    raise ValueError(
      f"{type(model).__name__} does not implement jaxengine.models.Model: missing {missing}"
    )
  spec = model.kv_cache_spec
  if not isinstance(spec, KVCacheSpec):
    raise ValueError(f"kv_cache_spec must be a KVCacheSpec, got {spec!r}")
