"""A Llama-family decoder in Flax NNX that reads and writes a slot-addressed KV cache.

One module covers the Llama family of Hugging Face checkpoints: token embedding, a stack of
pre-norm decoder layers (RMSNorm, grouped-query attention with rotary embeddings, SwiGLU MLP), a
final RMSNorm, and an output projection that may be tied to the embedding. Config switches add
what the relatives differ by:

- Llama 3.1 / 3.2: ``rope_scaling`` (`Llama3RopeScaling`), rescaled rotary frequencies;
- Mistral: ``sliding_window``, each query sees only the last ``sliding_window`` positions;
- Qwen2 / Qwen2.5: ``attention_bias``, biases on the query, key and value projections;
- Qwen3: ``qk_norm``, an RMSNorm over each query and key head before the rotary embedding, and an
  explicit ``head_dim`` (``H * D`` need not equal ``E``).

Its building blocks (the ``[out, in]`` projection, RMSNorm, rotary embedding, initialisation)
live in `jaxengine.models.layers`. `Llama.weight_specs` names every parameter as Hugging Face
checkpoints do (``model.layers.0.self_attn.q_proj.weight``, ...): the one mapping used by the
safetensors loader and by `LLM.load_weights`.

One call serves both prefill and decode. Each row of the batch names a cache slot and gives the
absolute position of each of its tokens; the call writes the new keys/values at
``(slot, position)`` and every query attends to the cached positions of its own slot up to and
including its own position. Padding (prefill length buckets) is handled by positions alone: see
`Llama.__call__`.

Every projection matrix keeps PyTorch's ``nn.Linear`` layout, ``[out, in]`` (``wq`` is
``[H, D, E]``, ``w_down`` is ``[E, F]``), and is applied by contracting its last (minor)
dimension, as Hugging Face and GGUF files store it. XLA:CPU runs such matmuls faster at batch > 1:
measured on a 2-core Xeon, XLA:CPU, the seven projections of all 30 layers of SmolLM2-135M on
``[B, 1, E]`` took 22.0 / 35.8 / 48.0 ms at B = 1 / 8 / 32, against 21.4 / 38.8 / 60.9 ms with
``[in, out]`` weights.

Shape letters used in comments: ``B`` batch rows, ``T`` tokens per row in this call, ``S``
``max_model_len`` (cache positions per slot), ``H`` query heads, ``K`` key/value heads,
``G = H // K`` query heads sharing one key/value head, ``D`` head_dim, ``E`` hidden_size,
``F`` intermediate_size, ``V`` vocab_size, ``L`` layers.

References:
  Touvron et al., "Llama 2: Open Foundation and Fine-Tuned Chat Models", 2023.
  Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding", 2021.
  Meta, "The Llama 3 Herd of Models", 2024 (rope scaling: `Llama3RopeScaling`).
  Jiang et al., "Mistral 7B", 2023 (sliding-window attention).
  Qwen Team, "Qwen2 Technical Report", 2024 and "Qwen3 Technical Report", 2025.
  Ainslie et al., "GQA: Training Generalized Multi-Query Transformer Models", 2023.
  Shazeer, "GLU Variants Improve Transformer", 2020.
  Zhang & Sennrich, "Root Mean Square Layer Normalization", 2019.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxengine.models.kv_cache import KVCache, KVCacheSpec
from jaxengine.models.layers import (
  RMSNorm,
  grouped_query_attention,
  linear,
  normal_init,
  normal_out_in,
  rotary_embedding,
)
from jaxengine.models.llama_config import Llama3RopeScaling, LlamaConfig, rope_frequencies
from jaxengine.models.weights import WeightSpec

__all__ = [
  "MLP",
  "Attention",
  "DecoderLayer",
  "Llama",
  "Llama3RopeScaling",
  "LlamaConfig",
  "RMSNorm",
  "compute_logits",
  "forward",
  "rope_frequencies",
  "rotary_embedding",
]


class Attention(nnx.Module):
  """Grouped-query self-attention over a slot-addressed KV cache.

  Attributes:
    wq: ``[H, D, E]`` query projection (PyTorch ``[out, in]`` layout, as every matrix here).
    wk: ``[K, D, E]`` key projection.
    wv: ``[K, D, E]`` value projection.
    wo: ``[E, H, D]`` output projection.
    bq, bk, bv: ``[H, D]``, ``[K, D]``, ``[K, D]`` projection biases (``attention_bias``), or
      None.
    bo: ``[E]`` output bias (``attention_output_bias``), or None.
    q_norm, k_norm: per-head RMSNorms over ``D`` (``qk_norm``), or None.
  """

  def __init__(self, config: LlamaConfig, *, dtype, rngs: nnx.Rngs):
    e, h, k, d = (
      config.hidden_size,
      config.num_attention_heads,
      config.num_key_value_heads,
      config.head_dim,
    )
    self.config = config
    self.dtype = dtype
    self.wq = nnx.Param(normal_out_in(rngs, (h, d), (e,), dtype))  # [H, D, E]
    self.wk = nnx.Param(normal_out_in(rngs, (k, d), (e,), dtype))  # [K, D, E]
    self.wv = nnx.Param(normal_out_in(rngs, (k, d), (e,), dtype))  # [K, D, E]
    self.wo = nnx.Param(normal_out_in(rngs, (e,), (h, d), dtype))  # [E, H, D]
    bias = lambda *shape: nnx.Param(jnp.zeros(shape, dtype))
    has_bias = config.attention_bias
    self.bq = bias(h, d) if has_bias else None
    self.bk = bias(k, d) if has_bias else None
    self.bv = bias(k, d) if has_bias else None
    self.bo = bias(e) if config.attention_output_bias else None
    self.q_norm = RMSNorm(d, eps=config.rms_norm_eps) if config.qk_norm else None
    self.k_norm = RMSNorm(d, eps=config.rms_norm_eps) if config.qk_norm else None

  def __call__(
    self,
    x: jax.Array,
    positions: jax.Array,
    cache_slots: jax.Array,
    key_cache: jax.Array,
    value_cache: jax.Array,
    layer: int,
    attention_len: int | None = None,
  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Writes this call's keys/values into the cache, then attends causally over the slot.

    Args:
      x: ``[B, T, E]`` normalised hidden states, model dtype.
      positions: ``[B, T] int32`` absolute position of each token.
      cache_slots: ``[B] int32`` cache slot of each row.
      key_cache: ``[L, num_slots, S, K, D]`` keys of every layer.
      value_cache: ``[L, num_slots, S, K, D]`` values of every layer.
      layer: index of this layer in the cache (static).
      attention_len: static; read only the first ``attention_len`` positions of each slot
        (``S`` if None). See `Llama.__call__`.

    Returns:
      ``([B, T, E] attention output in model dtype, updated key_cache, updated value_cache)``.
    """
    cfg = self.config
    b, t, _ = x.shape
    # Projections as plain 2-D matmuls over row-major `[out, in]` weights (the reshapes are free):
    # written as einsums over (h, d), XLA:CPU transposed `wo` into a new buffer on every call.
    e, h, kv, d = x.shape[-1], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q = linear(x, self.wq[...].reshape(h * d, e)).reshape(b, t, h, d)  # [B, T, H, D]
    k = linear(x, self.wk[...].reshape(kv * d, e)).reshape(b, t, kv, d)  # [B, T, K, D]
    v = linear(x, self.wv[...].reshape(kv * d, e)).reshape(b, t, kv, d)  # [B, T, K, D]
    if self.bq is not None and self.bk is not None and self.bv is not None:
      q, k, v = q + self.bq[...], k + self.bk[...], v + self.bv[...]
    if self.q_norm is not None and self.k_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    inv_freq = rope_frequencies(cfg)  # [D/2] host constant, computed at trace time
    q = rotary_embedding(q, positions, inv_freq)
    k = rotary_embedding(k, positions, inv_freq)

    # Scatter the new keys/values to (layer, slot, position). Index arrays broadcast to [B, T].
    # Positions >= S are dropped, so a row can be made write-free with position S.
    slots = cache_slots[:, None]  # [B, 1]
    key_cache = key_cache.at[layer, slots, positions].set(k.astype(key_cache.dtype), mode="drop")
    value_cache = value_cache.at[layer, slots, positions].set(
      v.astype(value_cache.dtype), mode="drop"
    )

    # Gather each row's slot, [B, S', K, D] with S' = attention_len or S. Reading after writing
    # lets the tokens of one prefill chunk attend to each other.
    keys = key_cache[layer, cache_slots, :attention_len].astype(self.dtype)
    values = value_cache[layer, cache_slots, :attention_len].astype(self.dtype)
    s = keys.shape[1]

    q = q.reshape(b, t, cfg.num_key_value_heads, cfg.num_queries_per_kv, cfg.head_dim)
    # Causal over absolute positions: key position s is visible to a query at position p iff
    # s <= p (and, with a sliding window W, p - s < W).
    key_positions = jnp.arange(s, dtype=jnp.int32)[None, None, :]  # [1, 1, S]
    visible = key_positions <= positions[:, :, None]  # [B, T, S]
    if cfg.sliding_window is not None:
      visible &= key_positions > positions[:, :, None] - cfg.sliding_window
    out = grouped_query_attention(q, keys, values, visible, scale=cfg.head_dim**-0.5)
    out = linear(out.reshape(b, t, h * d), self.wo[...].reshape(e, h * d))  # [B, T, E]
    if self.bo is not None:
      out = out + self.bo[...]
    return out, key_cache, value_cache


class MLP(nnx.Module):
  """SwiGLU feed-forward block: ``down(silu(gate(x)) * up(x))`` (Shazeer, 2020).

  Attributes:
    w_gate: ``[F, E]`` gate projection (PyTorch ``[out, in]`` layout, see `Attention`).
    w_up: ``[F, E]`` up projection.
    w_down: ``[E, F]`` down projection.
  """

  def __init__(self, config: LlamaConfig, *, dtype, rngs: nnx.Rngs):
    e, f = config.hidden_size, config.intermediate_size
    self.w_gate = nnx.Param(normal_out_in(rngs, (f,), (e,), dtype))  # [F, E]
    self.w_up = nnx.Param(normal_out_in(rngs, (f,), (e,), dtype))  # [F, E]
    self.w_down = nnx.Param(normal_out_in(rngs, (e,), (f,), dtype))  # [E, F]

  def __call__(self, x: jax.Array) -> jax.Array:
    """Maps ``[B, T, E]`` to ``[B, T, E]`` in the model dtype."""
    gate = linear(x, self.w_gate[...])  # [B, T, F]
    up = linear(x, self.w_up[...])  # [B, T, F]
    return linear(jax.nn.silu(gate) * up, self.w_down[...])  # [B, T, E]


class DecoderLayer(nnx.Module):
  """One pre-norm transformer layer: ``x += attn(norm(x)); x += mlp(norm(x))``."""

  def __init__(self, config: LlamaConfig, *, dtype, rngs: nnx.Rngs):
    self.input_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
    self.attn = Attention(config, dtype=dtype, rngs=rngs)
    self.post_attention_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
    self.mlp = MLP(config, dtype=dtype, rngs=rngs)

  def __call__(self, x, positions, cache_slots, key_cache, value_cache, layer, attention_len=None):
    """Same arguments as `Attention.__call__`, with ``x`` the residual stream ``[B, T, E]``."""
    h, key_cache, value_cache = self.attn(
      self.input_norm(x), positions, cache_slots, key_cache, value_cache, layer, attention_len
    )
    x = x + h
    x = x + self.mlp(self.post_attention_norm(x))
    return x, key_cache, value_cache


class Llama(nnx.Module):
  """Llama-family decoder reading and writing a `KVCache`; implements `jaxengine.models.Model`.

  The decoder layers are stored one by one (``layers[i]`` owns its arrays) and applied by an
  unrolled Python loop. A `lax.scan` over stacked ``[L, ...]`` weights compiles one layer body,
  but XLA then copies each layer's weights out of the stack before its matmuls (a dynamic slice
  is not fused into a dot): at batch 1 that doubled the weight traffic of a decode step, measured
  2x slower on CPU for the MLP weights of SmolLM2. Compile time grows with depth instead.

  Attributes:
    config: the model's `LlamaConfig` (static).
    dtype: compute and parameter dtype of the matrices (norm scales stay float32).
    embed: ``[V, E]`` token embedding.
    layers: ``L`` `DecoderLayer` modules (an `nnx.List`).
    final_norm: RMSNorm applied to the last layer's output.
    lm_head: ``[V, E]`` output projection, or None when tied to ``embed``.
  """

  def __init__(self, config: LlamaConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
    """Builds a model with random weights (Gaussian, std ``fan_in ** -0.5``; norm scales 1).

    Args:
      config: hyper-parameters.
      dtype: parameter and compute dtype, ``jnp.float32`` (default) or ``jnp.bfloat16``. Norms,
        softmax and logits are computed in float32 either way. bfloat16 is meant for
        accelerators: XLA's CPU backend runs bfloat16 matmuls about 10x slower than float32.
      rngs: random streams for initialisation (``params``, falling back to ``default``).
    """
    self.config = config
    self.dtype = dtype
    e, v = config.hidden_size, config.vocab_size
    self.embed = nnx.Param(normal_init(rngs, (v, e), e, dtype))

    self.layers = nnx.List(
      [DecoderLayer(config, dtype=dtype, rngs=rngs) for _ in range(config.num_hidden_layers)]
    )
    self.final_norm = RMSNorm(e, eps=config.rms_norm_eps)
    self.lm_head = (
      None if config.tie_word_embeddings else nnx.Param(normal_init(rngs, (v, e), e, dtype))
    )

  @property
  def vocab_size(self) -> int:
    """Width of the logits."""
    return self.config.vocab_size

  @property
  def eos_token_id(self) -> int | None:
    """The config's end-of-sequence id."""
    return self.config.eos_token_id

  @property
  def max_position_embeddings(self) -> int:
    """Context length the model was trained for."""
    return self.config.max_position_embeddings

  @property
  def kv_cache_spec(self) -> KVCacheSpec:
    """Layers, key/value heads and head dim of the config, in the model's dtype."""
    return self.config.kv_cache_spec(self.dtype)

  def __call__(
    self,
    token_ids: jax.Array,
    positions: jax.Array,
    kv_cache: KVCache,
    cache_slots: jax.Array,
    *,
    attention_len: int | None = None,
  ) -> tuple[jax.Array, KVCache]:
    """Runs the decoder over a batch of token rows, updating the KV cache.

    Each token's key/value is written at ``(cache_slots[b], positions[b, t])`` in every layer,
    then each token attends to the positions ``<= positions[b, t]`` of its row's slot. So a
    prefill is a call with a row's prompt at positions ``0..n-1`` and a decode step is a call with
    ``T = 1`` at position ``n``; chunked prefill works the same way.

    Contract for the caller (the engine):

    * Every row must point at a valid slot ``0 <= slot < kv_cache.num_slots``, and two rows must
      not share a slot unless their positions never collide (rows in the same slot overwrite each
      other). Inactive decode rows should either point at a scratch slot (allocate one extra
      slot) or use position ``kv_cache.max_model_len``: positions ``>= max_model_len`` write
      nothing (out-of-range updates are dropped) and their outputs are meaningless.
    * Positions must be non-negative. Padding tokens (prefill length buckets) should take the
      positions after the prompt (``n, n+1, ...``): they write garbage there, which no real token
      reads, because a real token only sees positions ``<=`` its own and the next decode step
      overwrites position ``n`` before attending to it. Padding at positions *before* a real
      token would corrupt it.
    * Token ids outside ``[0, vocab_size)`` are clipped (padding may use any id); the cache must
      stay finite since masked positions still enter the attention matmul with weight 0.
    * Attention reads ``attention_len`` positions of every row's slot (all ``max_model_len`` by
      default), so its cost grows with that length, not with the tokens actually cached. To pay
      only for what is used, pass a bucketed ``attention_len`` greater than every real token's
      position (e.g. the next power of two above the longest live sequence). It is a
      compile-time constant: each distinct value compiles once.

    Args:
      token_ids: ``[B, T] int32`` input tokens.
      positions: ``[B, T] int32`` absolute position of each token in its sequence.
      kv_cache: the cache to read and update (donate it under jit).
      cache_slots: ``[B] int32`` cache slot of each row.
      attention_len: static; positions ``0..attention_len-1`` of each slot are attended to
        (None: all of them). Must exceed the position of every token whose output is used.

    Returns:
      ``(hidden, kv_cache)``: ``[B, T, E]`` hidden states after the final RMSNorm, in the model
      dtype (feed them to `compute_logits`), and the updated cache.
    """
    x = jnp.take(self.embed[...], token_ids, axis=0, mode="clip")  # [B, T, E]
    key_cache, value_cache = kv_cache.key, kv_cache.value
    for index, layer in enumerate(self.layers):
      x, key_cache, value_cache = layer(
        x, positions, cache_slots, key_cache, value_cache, index, attention_len
      )
    hidden = self.final_norm(x)
    return hidden, dataclasses.replace(kv_cache, key=key_cache, value=value_cache)

  def weight_specs(self) -> list[WeightSpec]:
    """Every parameter under its Hugging Face checkpoint name (one spec per layer and matrix).

    PyTorch ``nn.Linear`` weights are ``(out, in)``, this model's layout too: they are taken
    as they are, the query/key/value/output matrices reshaped per head. Names:
    ``model.embed_tokens.weight``, ``model.norm.weight``, ``lm_head.weight`` (accepted and
    ignored when the embeddings are tied, as Hugging Face does), and per layer ``i`` under
    ``model.layers.{i}.``: ``input_layernorm.weight``, ``post_attention_layernorm.weight``,
    ``self_attn.{q,k,v,o}_proj.weight`` (and ``.bias`` with ``attention_bias`` /
    ``attention_output_bias``), ``self_attn.{q,k}_norm.weight`` (``qk_norm``), and
    ``mlp.{gate,up,down}_proj.weight``.

    Returns:
      The `WeightSpec`s used by the safetensors loader and by `LLM.load_weights`.
    """
    cfg = self.config
    e, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    h, k, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    specs = [
      WeightSpec("model.embed_tokens.weight", ("embed",), None, (v, e)),
      WeightSpec("model.norm.weight", ("final_norm", "scale"), None, (e,)),
      WeightSpec("lm_head.weight", None if cfg.tie_word_embeddings else ("lm_head",), None, (v, e)),
    ]
    # (checkpoint suffix, leaf path under `layers`, checkpoint shape); nothing is transposed
    per_layer: list[tuple[str, tuple[str, ...], tuple[int, ...]]] = [
      ("input_layernorm.weight", ("input_norm", "scale"), (e,)),
      ("self_attn.q_proj.weight", ("attn", "wq"), (h * d, e)),
      ("self_attn.k_proj.weight", ("attn", "wk"), (k * d, e)),
      ("self_attn.v_proj.weight", ("attn", "wv"), (k * d, e)),
      ("self_attn.o_proj.weight", ("attn", "wo"), (e, h * d)),
      ("post_attention_layernorm.weight", ("post_attention_norm", "scale"), (e,)),
      ("mlp.gate_proj.weight", ("mlp", "w_gate"), (f, e)),
      ("mlp.up_proj.weight", ("mlp", "w_up"), (f, e)),
      ("mlp.down_proj.weight", ("mlp", "w_down"), (e, f)),
    ]
    if cfg.attention_bias:
      per_layer += [
        ("self_attn.q_proj.bias", ("attn", "bq"), (h * d,)),
        ("self_attn.k_proj.bias", ("attn", "bk"), (k * d,)),
        ("self_attn.v_proj.bias", ("attn", "bv"), (k * d,)),
      ]
    if cfg.attention_output_bias:
      per_layer.append(("self_attn.o_proj.bias", ("attn", "bo"), (e,)))
    if cfg.qk_norm:
      per_layer += [
        ("self_attn.q_norm.weight", ("attn", "q_norm", "scale"), (d,)),
        ("self_attn.k_norm.weight", ("attn", "k_norm", "scale"), (d,)),
      ]
    for i in range(cfg.num_hidden_layers):
      specs += [
        WeightSpec(f"model.layers.{i}.{suffix}", ("layers", i, *path), None, shape)
        for suffix, path, shape in per_layer
      ]
    return specs

  def compute_logits(self, hidden: jax.Array) -> jax.Array:
    """Projects hidden states onto the vocabulary.

    Kept apart from `__call__` so prefill can project only the positions it needs (the last
    one, or all of them when prompt logprobs are requested).

    Args:
      hidden: ``[..., E]`` hidden states returned by `__call__`.

    Returns:
      ``[..., V] float32`` logits (float32 accumulation even for a bfloat16 model).
    """
    w = self.embed[...] if self.lm_head is None else self.lm_head[...]  # [V, E]
    return jnp.einsum("...e,ve->...v", hidden, w, preferred_element_type=jnp.float32)


def forward(
  graphdef: nnx.GraphDef,
  weights: nnx.State,
  token_ids: jax.Array,
  positions: jax.Array,
  kv_cache: KVCache,
  cache_slots: jax.Array,
  *,
  attention_len: int | None = None,
) -> tuple[jax.Array, KVCache]:
  """Pure form of `Llama.__call__` for the split/merge pattern.

  Jit it once with the graph definition static and the cache donated, e.g.
  ``jax.jit(forward, static_argnums=0, static_argnames="attention_len",
  donate_argnames="kv_cache")``, where ``graphdef, weights = nnx.split(model)``.

  Args:
    graphdef: static structure from `nnx.split`.
    weights: the model's parameter state from `nnx.split`.
    token_ids: ``[B, T] int32``.
    positions: ``[B, T] int32``.
    kv_cache: `KVCache`, consumed.
    cache_slots: ``[B] int32``.
    attention_len: static; cache positions read per slot (None: all). See `Llama.__call__`.

  Returns:
    ``(hidden [B, T, E], updated KVCache)``, as `Llama.__call__`.
  """
  model = nnx.merge(graphdef, weights)
  return model(token_ids, positions, kv_cache, cache_slots, attention_len=attention_len)


def compute_logits(graphdef: nnx.GraphDef, weights: nnx.State, hidden: jax.Array) -> jax.Array:
  """Pure form of `Llama.compute_logits`: ``[..., E]`` hidden -> ``[..., V] float32`` logits."""
  return nnx.merge(graphdef, weights).compute_logits(hidden)
