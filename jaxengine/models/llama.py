"""A Llama-family decoder in Flax NNX whose attention reaches the KV cache through one seam.

One module covers the Llama family of Hugging Face checkpoints: token embedding, a stack of
pre-norm decoder layers (RMSNorm, grouped-query attention with rotary embeddings, SwiGLU MLP), a
final RMSNorm, and an output projection that may be tied to the embedding. Config switches add
what the relatives differ by:

- Llama 3.1 / 3.2: ``rope_scaling`` (`Llama3RopeScaling`), rescaled rotary frequencies;
- Mistral: ``sliding_window``, each query sees only the last ``sliding_window`` positions;
- Qwen2 / Qwen2.5: ``attention_bias``, biases on the query, key and value projections;
- Qwen3: ``qk_norm``, an RMSNorm over each query and key head before the rotary embedding, and an
  explicit ``head_dim`` (``H * D`` need not equal ``E``);
- Qwen3-MoE, Mixtral: ``moe_layers``, layers whose MLP is a sparse mixture of experts
  (`jaxengine.models.moe.SparseMoeBlock`: top-k routing, grouped matmuls over the experts).

Its building blocks (the ``[out, in]`` projection, RMSNorm, rotary embedding, initialisation)
live in `jaxengine.models.layers`; how checkpoints map onto it (configs, tensor names) in
`jaxengine.models.llama_checkpoints`, which `jaxengine.models.registry` routes the loaders to.
`Llama.weight_specs` names every parameter as Hugging Face checkpoints do
(``model.layers.0.self_attn.q_proj.weight``, ...): the mapping the safetensors loader and
`LLM.load_weights` share.

One call serves both prefill and decode. The model computes each token's query, key and value
and hands them, with the step's `PagedAttentionMetadata`, to `jaxengine.models.attention.attention`,
which stores the keys/values and attends causally over each sequence's cached positions: the
model itself never indexes the cache nor builds a mask.

Every projection matrix keeps PyTorch's ``nn.Linear`` layout, ``[out, in]`` (``wq`` is
``[H, D, E]``, ``w_down`` is ``[E, F]``), and is applied by contracting its last (minor)
dimension, as Hugging Face and GGUF files store it. XLA:CPU runs such matmuls faster at batch > 1:
measured on a 2-core Xeon, XLA:CPU, the seven projections of all 30 layers of SmolLM2-135M on
``[B, 1, E]`` took 22.0 / 35.8 / 48.0 ms at B = 1 / 8 / 32, against 21.4 / 38.8 / 60.9 ms with
``[in, out]`` weights.

Shape letters used in comments: ``B`` batch rows, ``T`` tokens per row in this call (the engine's
ragged step passes one flat row, ``[1, T]``), ``H`` query heads, ``K`` key/value heads,
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

from typing import ClassVar, cast

import jax
import jax.numpy as jnp
from flax import nnx

from jaxengine.models.attention import PagedAttentionMetadata, PagedKVCache, attention
from jaxengine.models.layer_scan import scan_layers, stack_layers
from jaxengine.models.layer_stack import apply_layers
from jaxengine.models.layers import (
  ConfiguredDecoder,
  RMSNorm,
  normal_init,
  normal_out_in,
  project,
  rotary_embedding,
  vocab_logits,
)
from jaxengine.models.llama_checkpoints import hf_weight_specs
from jaxengine.models.llama_config import Llama3RopeScaling, LlamaConfig, rope_frequencies
from jaxengine.models.lora import EXPERT_LORA_TARGETS, LayerLoRA, LoRAInputs, add_lora
from jaxengine.models.moe import SparseMoeBlock
from jaxengine.models.moe_lora import expert_lora_shapes
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
  """Grouped-query self-attention: projections, biases, q/k norms and rotary embedding here, the
  cache and the mask behind `jaxengine.models.attention.attention`.

  Attributes:
    wq: ``[H, D, E]`` query projection (PyTorch ``[out, in]`` layout, as every matrix here).
    wk: ``[K, D, E]`` key projection.
    wv: ``[K, D, E]`` value projection.
    wo: ``[E, H, D]`` output projection.
    bq, bk, bv: ``[H, D]``, ``[K, D]``, ``[K, D]`` projection biases (``attention_bias``), or
      None.
    bo: ``[E]`` output bias (``attention_output_bias``), or None.
    q_norm, k_norm: per-head RMSNorms over ``D`` (``qk_norm``), or None.
    scales: ``{name: [*out] float32}`` row scales of the quantized projections (empty unless
      `jaxengine.models.quantization.quantize_model` made int8 / float8 values of them).
    batch_invariant: projections computed a fixed number of rows at a time (`Llama`).
  """

  #: The projections `quantize_model` may quantize, with their input axes (`quantize_rows`).
  QUANTIZABLE: ClassVar[dict[str, tuple[int, ...]]] = {
    "wq": (2,),
    "wk": (2,),
    "wv": (2,),
    "wo": (1, 2),
  }

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
    self.scales: nnx.Dict[nnx.Param] = nnx.Dict()
    self.batch_invariant = False

  def __call__(
    self,
    x: jax.Array,
    positions: jax.Array,
    kv_cache: PagedKVCache,
    layer: int,
    metadata: PagedAttentionMetadata,
    lora: LayerLoRA | None = None,
  ) -> tuple[jax.Array, PagedKVCache]:
    """Projects this call's queries, keys and values and attends through the seam.

    Args:
      x: ``[B, T, E]`` normalised hidden states, model dtype (the leading dimensions are opaque).
      positions: ``[B, T] int32`` absolute position of each token (for the rotary embedding).
      kv_cache: the whole cache, handed to `jaxengine.models.attention.attention`.
      layer: index of this layer in the cache (static).
      metadata: this step's `PagedAttentionMetadata`, passed on untouched.
      lora: this layer's LoRA adapters and token slots (`jaxengine.models.lora`), or None.

    Returns:
      ``([B, T, E] attention output in model dtype, updated PagedKVCache)``.
    """
    cfg = self.config
    lead = x.shape[:-1]
    # Projections as plain 2-D matmuls over row-major `[out, in]` weights (the reshapes are free):
    # written as einsums over (h, d), XLA:CPU transposed `wo` into a new buffer on every call.
    e, h, kv, d = x.shape[-1], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q = project(self, "wq", x, (h * d, e))
    k = project(self, "wk", x, (kv * d, e))
    v = project(self, "wv", x, (kv * d, e))
    q = add_lora(q, x, lora, "q_proj", self.batch_invariant).reshape(*lead, h, d)
    k = add_lora(k, x, lora, "k_proj", self.batch_invariant).reshape(*lead, kv, d)
    v = add_lora(v, x, lora, "v_proj", self.batch_invariant).reshape(*lead, kv, d)
    if self.bq is not None and self.bk is not None and self.bv is not None:
      q, k, v = q + self.bq[...], k + self.bk[...], v + self.bv[...]
    if self.q_norm is not None and self.k_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    inv_freq = rope_frequencies(cfg)  # [D/2] host constant, computed at trace time
    q = rotary_embedding(q, positions, inv_freq)
    k = rotary_embedding(k, positions, inv_freq)
    out, kv_cache = attention(
      q, k, v, kv_cache, layer, metadata, scale=d**-0.5, sliding_window=cfg.sliding_window
    )
    out = out.reshape(*lead, h * d)
    out = add_lora(project(self, "wo", out, (e, h * d)), out, lora, "o_proj", self.batch_invariant)
    if self.bo is not None:
      out = out + self.bo[...]
    return out, kv_cache


class MLP(nnx.Module):
  """SwiGLU feed-forward block: ``down(silu(gate(x)) * up(x))`` (Shazeer, 2020).

  Attributes:
    w_gate: ``[F, E]`` gate projection (PyTorch ``[out, in]`` layout, see `Attention`).
    w_up: ``[F, E]`` up projection.
    w_down: ``[E, F]`` down projection.
    scales: row scales of the quantized projections (see `Attention`).
    batch_invariant: projections computed a fixed number of rows at a time (`Llama`).
  """

  #: The projections `quantize_model` may quantize, with their input axes (`quantize_rows`).
  QUANTIZABLE: ClassVar[dict[str, tuple[int, ...]]] = dict.fromkeys(
    ("w_gate", "w_up", "w_down"), (1,)
  )

  def __init__(self, config: LlamaConfig, *, dtype, rngs: nnx.Rngs):
    e, f = config.hidden_size, config.intermediate_size
    self.w_gate = nnx.Param(normal_out_in(rngs, (f,), (e,), dtype))  # [F, E]
    self.w_up = nnx.Param(normal_out_in(rngs, (f,), (e,), dtype))  # [F, E]
    self.w_down = nnx.Param(normal_out_in(rngs, (e,), (f,), dtype))  # [E, F]
    self.scales: nnx.Dict[nnx.Param] = nnx.Dict()
    self.batch_invariant = False

  def __call__(self, x: jax.Array, lora: LayerLoRA | None = None) -> jax.Array:
    """Maps ``[B, T, E]`` to ``[B, T, E]`` in the model dtype (with this layer's LoRA
    adapters, `jaxengine.models.lora`, when given)."""
    gate = add_lora(project(self, "w_gate", x), x, lora, "gate_proj", self.batch_invariant)
    up = add_lora(project(self, "w_up", x), x, lora, "up_proj", self.batch_invariant)
    hidden = jax.nn.silu(gate) * up  # [B, T, F]
    down = project(self, "w_down", hidden)  # [B, T, E]
    return add_lora(down, hidden, lora, "down_proj", self.batch_invariant)


class DecoderLayer(nnx.Module):
  """One pre-norm transformer layer: ``x += attn(norm(x)); x += mlp(norm(x))``.

  ``mlp`` is the dense `MLP`, or a `jaxengine.models.moe.SparseMoeBlock` on the layers listed in
  the config's ``moe_layers``.
  """

  def __init__(self, config: LlamaConfig, *, dtype, rngs: nnx.Rngs, index: int = 0):
    self.input_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
    self.attn = Attention(config, dtype=dtype, rngs=rngs)
    self.post_attention_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
    sparse = index in config.moe_layers
    self.mlp = (SparseMoeBlock if sparse else MLP)(config, dtype=dtype, rngs=rngs)
    self.return_routed_experts = False  # see `Llama`

  def __call__(self, x, positions, kv_cache, layer, metadata, lora=None, routed_experts=None):
    """Same arguments as `Attention.__call__`, with ``x`` the residual stream ``[B, T, E]``,
    and a MoE layer's replayed experts ``[B, T, k]`` (`SparseMoeBlock.routed`; None: its
    router's). Returns ``(x, kv_cache)``, and a MoE layer's ``[B, T, k] int32`` experts third
    with ``return_routed_experts``."""
    h, kv_cache = self.attn(self.input_norm(x), positions, kv_cache, layer, metadata, lora)
    x = x + h
    mlp, mlp_in = self.mlp, self.post_attention_norm(x)
    if isinstance(mlp, SparseMoeBlock):
      out, experts = mlp.routed(mlp_in, routed_experts, lora)
      if self.return_routed_experts:
        return x + out, kv_cache, experts
      return x + out, kv_cache
    return x + mlp(mlp_in, lora), kv_cache


class Llama(ConfiguredDecoder, nnx.Module):
  """Llama-family decoder reading and writing a `PagedKVCache`; implements
  `jaxengine.models.Model`.

  The decoder layers are stored one by one (``layers[i]`` owns its arrays) and applied in an
  unrolled loop (`jaxengine.models.layer_stack.apply_layers`: layers of one structure are traced
  once), or, with the config's ``scan_layers``, stacked (``layers`` one `DecoderLayer` whose
  every parameter is ``[L, ...]``) and run under `jax.lax.scan`
  (`jaxengine.models.layer_scan`): one compiled layer body whatever the depth, while on XLA:CPU
  each layer's weights are copied out of the stack before its matmuls (a dynamic slice is not
  fused into a dot), so unrolled stays CPU's default and XLA's compile time grows with depth.

  Attributes:
    config: the model's `LlamaConfig` (static).
    dtype: compute and parameter dtype of the matrices (norm scales stay float32).
    embed: ``[V, E]`` token embedding.
    layers: ``L`` `DecoderLayer` modules (an `nnx.List`), or with ``scan_layers`` one stacked
      `DecoderLayer` (every leaf ``[L, ...]``).
    final_norm: RMSNorm applied to the last layer's output.
    lm_head: ``[V, E]`` output projection, or None when tied to ``embed``.
    batch_invariant: False (default), or True to compute every projection and the logits
      ``ROW_TILE`` rows at a time (`jaxengine.models.batch_invariant`), so that a token's hidden
      states and logits are the same bits whatever else the call holds. Set it on the whole
      module with ``model.set_attributes(batch_invariant=True)`` (what ``LLM(...,
      batch_invariant=True)`` does to its own copy, with the paged cache's fixed-order
      attention); the attention's own order comes from the cache's backend.
    return_routed_experts: False (default), or True (set with ``model.set_attributes(
      return_routed_experts=True)``, what ``LLM(..., enable_return_routed_experts=True)`` does
      to its own copy) to return the experts each token went to at every MoE layer as a third
      result of `__call__`.
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

    layers = [
      DecoderLayer(config, dtype=dtype, rngs=rngs, index=i) for i in range(config.num_hidden_layers)
    ]
    self.layers: nnx.List | DecoderLayer = (
      cast(DecoderLayer, stack_layers(layers)) if config.scan_layers else nnx.List(layers)
    )
    self.final_norm = RMSNorm(e, eps=config.rms_norm_eps)
    self.lm_head = (
      None if config.tie_word_embeddings else nnx.Param(normal_init(rngs, (v, e), e, dtype))
    )
    self.batch_invariant = False
    self.return_routed_experts = False

  def __call__(
    self,
    token_ids: jax.Array,
    positions: jax.Array,
    kv_cache: PagedKVCache,
    attn_metadata: PagedAttentionMetadata,
    *,
    lora: LoRAInputs | None = None,
    routed_experts: jax.Array | None = None,
  ) -> tuple[jax.Array, PagedKVCache] | tuple[jax.Array, PagedKVCache, jax.Array]:
    """Runs the decoder over the call's tokens, updating the KV cache.

    Every layer hands its queries, keys and values to `jaxengine.models.attention.attention`,
    which writes each token's key and value for its position and lets it attend to the earlier
    positions of its sequence (that function's docstring is the contract). Token ids outside
    ``[0, vocab_size)`` are clipped (padding may use any id).

    The engine calls it once per ragged step with a `PagedAttentionMetadata`, a `PagedKVCache`
    and the step's tokens flat, ``[1, T]``: decode tokens and prefill chunks of many requests
    together, each request's tokens at its own positions and pages
    (`jaxengine.worker.ragged_step`); a whole-sequence forward outside the engine builds such a
    step over a scratch pool of pages (`jaxengine.models.sequence_logprobs.scratch_step`;
    `jaxengine.models.sequence_logits` returns the logits of whole sequences).

    Args:
      token_ids: ``[1, T] int32`` input tokens, flat (``[T]`` works too).
      positions: the same shape, ``int32`` absolute position of each token in its sequence.
      kv_cache: the cache to read and update (donate it under jit).
      attn_metadata: this step's `PagedAttentionMetadata`.
      lora: None (default), or the step's LoRA adapters with each flat token's slot
        (`jaxengine.models.lora.LoRAInputs`, one per token).
      routed_experts: None (default: each MoE layer's router picks), or ``[..., M, k]``
        integer experts (the tokens' shape, ``M`` MoE layers in order, ``k``
        ``num_experts_per_tok``) each token is routed to instead (routing replay: the
        router's softmax still weights them; `jaxengine.models.moe.route`).

    Returns:
      ``(hidden, kv_cache)``: ``[..., E]`` hidden states (the tokens' shape) after the final
      RMSNorm, in the model dtype (feed them to `compute_logits`), and the updated cache; with
      ``return_routed_experts``, third, the ``[..., M, k] int32`` experts each token went to at
      each MoE layer (largest router weight first, or the replayed ones).
    """
    x = jnp.take(self.embed[...], token_ids, axis=0, mode="clip")  # [1, T, E]
    if self.config.scan_layers:
      x, kv_cache, experts = scan_layers(
        self.layers,
        x,
        positions,
        kv_cache,
        attn_metadata,
        num_layers=self.config.num_hidden_layers,
        lora=lora,
        routed_experts=routed_experts,
        return_routed=self.return_routed_experts,
      )
      if self.return_routed_experts:
        return self.final_norm(x), kv_cache, cast(jax.Array, experts)
      return self.final_norm(x), kv_cache
    moe_index = {layer: j for j, layer in enumerate(self.config.moe_layers)}

    def layer_args(index: int) -> tuple:
      layer_lora = None if lora is None else lora.layer(index)
      if routed_experts is not None and index in moe_index:  # only when replaying
        return (layer_lora, routed_experts[..., moe_index[index], :])
      return (layer_lora,)

    routed: list[jax.Array] = []
    x, kv_cache = apply_layers(
      cast(nnx.List, self.layers), x, positions, kv_cache, attn_metadata, layer_args, routed
    )
    if self.return_routed_experts:
      return self.final_norm(x), kv_cache, jnp.stack(routed, axis=-2)  # [..., M, k]
    return self.final_norm(x), kv_cache

  @property
  def num_layers(self) -> int:
    """``L``, the decoder layers."""
    return self.config.num_hidden_layers

  @property
  def stacked_paths(self) -> tuple[str, ...]:
    """The state paths whose leaves have a leading layer axis (``("layers",)`` with
    ``scan_layers``; quantization and the mesh shardings skip that axis)."""
    return ("layers",) if self.config.scan_layers else ()

  @property
  def num_moe_layers(self) -> int:
    """``M``, the layers whose MLP is a mixture of experts (0 for a dense model)."""
    return len(self.config.moe_layers)

  def lora_target_shapes(self) -> dict[str, tuple[int, ...]]:
    """The ``(in, out)`` features of each projection a LoRA adapter may target, by its PEFT
    module name (the same in every layer; `jaxengine.models.lora.LORA_TARGETS`). A mixture of
    experts offers its routed experts as ``(X, in, out)``
    (`jaxengine.models.lora.EXPERT_LORA_TARGETS`), and the dense MLP's projections only when
    some layer is dense (Qwen3-MoE's ``mlp_only_layers``)."""
    cfg = self.config
    e, f = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    targets: dict[str, tuple[int, ...]] = {
      "q_proj": (e, q), "k_proj": (e, kv), "v_proj": (e, kv), "o_proj": (q, e),
    }  # fmt: skip
    if len(cfg.moe_layers) < cfg.num_hidden_layers:
      targets.update(gate_proj=(e, f), up_proj=(e, f), down_proj=(f, e))
    if cfg.moe_layers:
      targets.update(expert_lora_shapes(cfg.num_experts, e, cfg.moe_intermediate_size))
    return targets

  def lora_target_layers(self) -> dict[str, tuple[int, ...]]:
    """The layers of each LoRA target found only in some (a mixture of experts' dense MLP and
    expert targets; `jaxengine.lora.LoRAManager`'s ``target_layers``)."""
    cfg = self.config
    if not cfg.moe_layers:
      return {}
    sparse = tuple(cfg.moe_layers)
    dense = tuple(i for i in range(cfg.num_hidden_layers) if i not in sparse)
    return {
      **dict.fromkeys(("gate_proj", "up_proj", "down_proj"), dense),
      **dict.fromkeys(EXPERT_LORA_TARGETS, sparse),
    }

  def weight_specs(self) -> list[WeightSpec]:
    """Every parameter under its Hugging Face checkpoint name (one spec per layer and matrix).

    `jaxengine.models.llama_checkpoints.hf_weight_specs` of the config: names such as
    ``model.layers.0.self_attn.q_proj.weight``, tensors in their ``(out, in)`` layout, reshaped
    per head; ``lm_head.weight`` is accepted and ignored when the embeddings are tied.

    Returns:
      The `WeightSpec`s used by the safetensors loader and by `LLM.load_weights`.
    """
    return hf_weight_specs(self.config)

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
    return vocab_logits(hidden, w, batch_invariant=self.batch_invariant)


def forward(
  graphdef: nnx.GraphDef,
  weights: nnx.State,
  token_ids: jax.Array,
  positions: jax.Array,
  kv_cache: PagedKVCache,
  attn_metadata: PagedAttentionMetadata,
) -> tuple[jax.Array, PagedKVCache]:
  """Pure form of `Llama.__call__` for the split/merge pattern.

  Jit it once with the graph definition static and the cache donated, e.g.
  ``jax.jit(forward, static_argnums=0, donate_argnames="kv_cache")``, where
  ``graphdef, weights = nnx.split(model)``. For the logits of whole sequences without building
  the step yourself, see `jaxengine.models.sequence_logits`.

  Args:
    graphdef: static structure from `nnx.split`.
    weights: the model's parameter state from `nnx.split`.
    token_ids: ``[1, T] int32`` the step's flat tokens.
    positions: ``[1, T] int32``.
    kv_cache: the `PagedKVCache`, consumed.
    attn_metadata: the step's `PagedAttentionMetadata` (see `Llama.__call__`).

  Returns:
    ``(hidden [1, T, E], updated PagedKVCache)``, as `Llama.__call__`.
  """
  model = nnx.merge(graphdef, weights)
  return model(token_ids, positions, kv_cache, attn_metadata)


def compute_logits(graphdef: nnx.GraphDef, weights: nnx.State, hidden: jax.Array) -> jax.Array:
  """Pure form of `Llama.compute_logits`: ``[..., E]`` hidden -> ``[..., V] float32`` logits."""
  return nnx.merge(graphdef, weights).compute_logits(hidden)
