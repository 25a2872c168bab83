"""Gemma 4's text decoder in Flax NNX, attending through the same seam as Llama and Gemma 2/3.

What the model computes (transformers' ``Gemma4TextModel``; every norm a plain RMSNorm
``x / rms(x) * w`` in float32, not Gemma 2/3's ``(1 + w)``):

- ``x = embed[ids] * sqrt(E)`` (the factor rounded to the model dtype);
- per-layer inputs (``hidden_size_per_layer_input`` ``P > 0``): ``ple[ids] * sqrt(P)`` from a
  packed ``[V', L * P]`` table, plus ``norm(proj(x) * E ** -0.5)``, the sum times ``2 ** -0.5``:
  ``[..., L, P]``, slice ``i`` for layer ``i``;
- per layer ``i``: ``x += post_attn_norm(attn(input_norm(x)))``; then the MLP part: ``h =
  mlp(pre_ffw_norm(x))`` (GeGLU), with ``enable_moe_block`` ``h = post_ffw_norm_1(h) +
  post_ffw_norm_2(moe(x, pre_ffw_norm_2(x)))`` (`jaxengine.models.gemma4_moe`), ``x +=
  post_ffw_norm(h)``; then with per-layer inputs ``x += post_ple_norm(ple_proj(gelu(ple_gate(x))
  * ple_i))``; finally ``x *= layer_scalar`` (a stored per-layer constant);
- attention: grouped-query, ``q_norm`` and ``k_norm`` (scaled) and ``v_norm`` (unscaled) over each
  head, the rotary embedding of the layer's kind after the norms (global layers: "proportional"
  rope, only a fraction of the feature pairs rotate), scale 1, a window on local layers; global
  layers may have wider heads (``global_head_dim``) and, with ``attention_k_eq_v``, take their
  values from the key projection (before ``k_norm`` and the rotation) with
  ``num_global_key_value_heads`` heads; the last ``num_kv_shared_layers`` layers compute queries
  only and read the keys and values the last earlier layer of their kind wrote (the seam's read
  without a write), so they own no pages;
- logits: ``final_norm(x) @ embed.T``, soft-capped (``final_logit_softcapping``).

The pages' one shape and how narrower layers fit it: `jaxengine.models.gemma4_config`. With
``scan_layers`` the layers are a stack per kind run under `jax.lax.scan`
(`jaxengine.models.gemma4_scan`); the embedding's scale sits behind an optimization barrier in
both layouts, so that XLA folds it into neither.

Shape letters as in `jaxengine.models.llama`; ``P`` the per-layer input width.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar, cast

import jax
import jax.numpy as jnp
from flax import nnx

from jaxengine.models import gemma4_lora
from jaxengine.models.attention import PagedAttentionMetadata, PagedKVCache, attention
from jaxengine.models.gemma import GemmaMLP
from jaxengine.models.gemma4_checkpoints import hf_weight_specs
from jaxengine.models.gemma4_config import Gemma4Config
from jaxengine.models.gemma4_moe import Gemma4MoeBlock, UnscaledRMSNorm
from jaxengine.models.gemma4_scan import Gemma4Stacks, scan_gemma4_layers, stack_gemma4_layers
from jaxengine.models.gemma_config import ACTIVATIONS
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
from jaxengine.models.lora import LayerLoRA, LoRAInputs, add_lora
from jaxengine.models.weights import WeightSpec

__all__ = ["Gemma4", "Gemma4Attention", "Gemma4Config", "Gemma4DecoderLayer"]


def _norm(config: Gemma4Config, dim: int) -> RMSNorm:
  return RMSNorm(dim, eps=config.rms_norm_eps)


def _to_page(x: jax.Array, heads: int, width: int) -> jax.Array:
  """``[..., K, D]`` keys or values (or ``[..., H, D]`` queries with ``heads = H``) in the
  pages' shape: each head repeated ``heads / K`` times, features zero-padded to `width`."""
  if x.shape[-2] != heads:
    x = jnp.repeat(x, heads // x.shape[-2], axis=-2)
  if x.shape[-1] != width:
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])
  return x


class Gemma4Attention(nnx.Module):
  """Attention of one layer (module docstring).

  Attributes:
    wq, wo: ``[H, D, E]`` and ``[E, H, D]`` projections (``[out, in]`` layout).
    wk, wv: ``[K, D, E]`` projections; None on a KV-shared layer (both) and ``wv`` with
      ``attention_k_eq_v`` on a global layer.
    q_norm, k_norm: scaled RMSNorms over ``D`` (``k_norm`` None on a KV-shared layer).
    v_norm: the values' unscaled RMSNorm.
    layer: this layer's index (static); None in a stacked module
      (`jaxengine.models.gemma4_scan`), whose calls name a layer of its kind.
    scales: row scales of the quantized projections (`jaxengine.models.llama.Attention`).
    batch_invariant: projections computed a fixed number of rows at a time.
  """

  #: The projections `quantize_model` may quantize, with their input axes (those a layer lacks,
  #: None, are skipped).
  QUANTIZABLE: ClassVar[dict[str, tuple[int, ...]]] = {
    "wq": (2,),
    "wk": (2,),
    "wv": (2,),
    "wo": (1, 2),
  }

  def __init__(self, config: Gemma4Config, layer: int, *, dtype, rngs: nnx.Rngs):
    e, h = config.hidden_size, config.num_attention_heads
    k, d = config.kv_heads(layer), config.layer_head_dim(layer)
    shared = config.is_kv_shared(layer)
    self.config = config
    self.layer = layer
    self.wq = nnx.Param(normal_out_in(rngs, (h, d), (e,), dtype))
    self.wk = None if shared else nnx.Param(normal_out_in(rngs, (k, d), (e,), dtype))
    self.wv = (
      None
      if shared or config.k_eq_v(layer)
      else nnx.Param(normal_out_in(rngs, (k, d), (e,), dtype))
    )
    self.wo = nnx.Param(normal_out_in(rngs, (e,), (h, d), dtype))
    self.q_norm = _norm(config, d)
    self.k_norm = None if shared else _norm(config, d)
    self.v_norm = UnscaledRMSNorm(config.rms_norm_eps)
    self.scales: nnx.Dict[nnx.Param] = nnx.Dict()
    self.batch_invariant = False

  def __call__(
    self, x, positions, kv_cache, layer, metadata, lora: LayerLoRA | None = None, kind=None
  ):
    """``[..., E]`` normalised hidden states -> ``([..., E] output, updated cache)``; the
    arguments as `jaxengine.models.llama.Attention.__call__` (`layer`: the cache layer this
    layer reads, its own or, KV-shared, its source's; ``[] int32`` in a scan; `lora`: this
    layer's adapters, its ``k_proj`` update also the values' with ``attention_k_eq_v``, as
    transformers' values are the key projection's output), and `kind` (static): a layer whose
    head width, rotary embedding and window this call takes, None for this module's own (a
    stacked module has none and must be given one)."""
    cfg = self.config
    kind = self.layer if kind is None else kind
    if kind is None:
      raise ValueError("a stacked Gemma 4 layer needs the kind of layer it runs (kind=...)")
    lead = x.shape[:-1]
    e, h = x.shape[-1], cfg.num_attention_heads
    kv, d = cfg.kv_heads(kind), cfg.layer_head_dim(kind)
    page_heads, page_width = cfg.page_kv_heads, cfg.page_head_dim
    inv_freq = cfg.rope(kind).frequencies(d)  # [D/2] host constant
    fixed = self.batch_invariant
    q = add_lora(project(self, "wq", x, (h * d, e)), x, lora, "q_proj", fixed)
    q = self.q_norm(q.reshape(*lead, h, d))
    q = _to_page(rotary_embedding(q, positions, inv_freq), h, page_width)
    k = v = None
    if self.k_norm is not None:  # a layer with keys and values of its own
      k = add_lora(project(self, "wk", x, (kv * d, e)), x, lora, "k_proj", fixed)
      k = k.reshape(*lead, kv, d)
      if self.wv is None:
        v = k
      else:
        v = add_lora(project(self, "wv", x, (kv * d, e)), x, lora, "v_proj", fixed)
        v = v.reshape(*lead, kv, d)
      k = rotary_embedding(self.k_norm(k), positions, inv_freq)
      k, v = _to_page(k, page_heads, page_width), _to_page(self.v_norm(v), page_heads, page_width)
    out, kv_cache = attention(
      q, k, v, kv_cache, layer, metadata, scale=1.0, sliding_window=cfg.window(kind)
    )
    out = out[..., :d].reshape(*lead, h * d)
    return add_lora(project(self, "wo", out, (e, h * d)), out, lora, "o_proj", fixed), kv_cache


class Gemma4DecoderLayer(nnx.Module):
  """One layer (module docstring): attention, the dense MLP (with the MoE block beside it),
  the per-layer input, ``layer_scalar``.

  Attributes:
    layer_scalar: ``[1]`` the layer's output multiplier (a checkpoint constant).
    ple_gate, ple_projection: ``[P, E]`` and ``[E, P]`` per-layer input projections, or None.
    moe: the `Gemma4MoeBlock`, or None.
  """

  def __init__(self, config: Gemma4Config, layer: int, *, dtype, rngs: nnx.Rngs):
    e, p = config.hidden_size, config.hidden_size_per_layer_input
    self.input_norm = _norm(config, e)
    self.attn = Gemma4Attention(config, layer, dtype=dtype, rngs=rngs)
    self.post_attention_norm = _norm(config, e)
    self.pre_feedforward_norm = _norm(config, e)
    self.mlp = GemmaMLP(config, dtype=dtype, rngs=rngs, intermediate_size=config.mlp_size(layer))
    self.post_feedforward_norm = _norm(config, e)
    moe = config.enable_moe_block
    self.moe = Gemma4MoeBlock(config, dtype=dtype, rngs=rngs) if moe else None
    self.post_feedforward_norm_1 = _norm(config, e) if moe else None
    self.pre_feedforward_norm_2 = _norm(config, e) if moe else None
    self.post_feedforward_norm_2 = _norm(config, e) if moe else None
    self.ple_gate = nnx.Param(normal_out_in(rngs, (p,), (e,), dtype)) if p else None
    self.ple_projection = nnx.Param(normal_out_in(rngs, (e,), (p,), dtype)) if p else None
    self.post_ple_norm = _norm(config, e) if p else None
    self.approximate = ACTIVATIONS[config.hidden_activation]
    self.layer_scalar = nnx.Param(jnp.ones((1,), dtype))
    self.scales: nnx.Dict[nnx.Param] = nnx.Dict()
    self.batch_invariant = False

  def __call__(
    self, x, positions, kv_cache, layer, metadata, per_layer_input=None, lora=None, kind=None
  ):
    """Same arguments as `Gemma4Attention.__call__`, ``x`` the residual stream ``[..., E]``,
    this layer's ``[..., P]`` per-layer input (None without) and its LoRA adapters (None
    without; the attention's, the dense MLP's and the experts')."""
    h, kv_cache = self.attn(
      self.input_norm(x), positions, kv_cache, layer, metadata, lora=lora, kind=kind
    )
    x = x + self.post_attention_norm(h)
    h = self.mlp(self.pre_feedforward_norm(x), lora)
    norms = (
      self.post_feedforward_norm_1,
      self.pre_feedforward_norm_2,
      self.post_feedforward_norm_2,
    )
    if self.moe is not None and all(norm is not None for norm in norms):
      dense_norm, experts_in_norm, experts_norm = cast(tuple[RMSNorm, RMSNorm, RMSNorm], norms)
      h = dense_norm(h) + experts_norm(self.moe(x, experts_in_norm(x), lora))
    x = x + self.post_feedforward_norm(h)
    if per_layer_input is not None and self.post_ple_norm is not None:
      gate = jax.nn.gelu(project(self, "ple_gate", x), approximate=self.approximate)
      x = x + self.post_ple_norm(project(self, "ple_projection", gate * per_layer_input))
    return x * self.layer_scalar[...], kv_cache


class Gemma4(ConfiguredDecoder, nnx.Module):
  """Gemma 4 text decoder over a `PagedKVCache`; implements `jaxengine.models.Model` (the
  attributes of `jaxengine.models.Gemma`, plus the per-layer input tables).

  Attributes:
    ple_embed: ``[V', L * P]`` per-layer input table, or None.
    ple_model_projection: ``[L * P, E]`` projection of the embedding onto the per-layer inputs.
    ple_norm: RMSNorm over ``P`` of that projection.
  """

  def __init__(self, config: Gemma4Config, *, dtype=jnp.float32, rngs: nnx.Rngs):
    """Builds a model with random weights (Gaussian, std ``fan_in ** -0.5``; norm scales 1).

    Args:
      config: hyper-parameters.
      dtype: parameter and compute dtype (norms, softmax and logits stay float32).
      rngs: random streams for initialisation.
    """
    self.config = config
    self.dtype = dtype
    e, v, p = config.hidden_size, config.vocab_size, config.hidden_size_per_layer_input
    num_layers = config.num_hidden_layers
    self.embed = nnx.Param(normal_init(rngs, (v, e), e, dtype))
    self.ple_embed = (
      nnx.Param(normal_init(rngs, (config.vocab_size_per_layer_input, num_layers * p), p, dtype))
      if p
      else None
    )
    self.ple_model_projection = (
      nnx.Param(normal_out_in(rngs, (num_layers * p,), (e,), dtype)) if p else None
    )
    self.ple_norm = _norm(config, p) if p else None
    layers = [Gemma4DecoderLayer(config, i, dtype=dtype, rngs=rngs) for i in range(num_layers)]
    self.layers: nnx.List | Gemma4Stacks = (
      self.stack_decoder_layers(layers) if config.scan_layers else nnx.List(layers)
    )
    self.final_norm = _norm(config, e)
    self.lm_head = (
      None if config.tie_word_embeddings else nnx.Param(normal_init(rngs, (v, e), e, dtype))
    )
    self.scales: nnx.Dict[nnx.Param] = nnx.Dict()
    self.batch_invariant = False

  def __call__(
    self,
    token_ids: jax.Array,
    positions: jax.Array,
    kv_cache: PagedKVCache,
    attn_metadata: PagedAttentionMetadata,
    *,
    lora: LoRAInputs | None = None,
  ) -> tuple[jax.Array, PagedKVCache]:
    """Runs the decoder, updating the cache; arguments and results as
    `jaxengine.models.Llama.__call__` (``[..., E]`` hidden states after the final norm;
    `lora`: the step's adapters, `lora_target_shapes`)."""
    cfg = self.config
    x = jnp.take(self.embed[...], token_ids, axis=0, mode="clip")
    x = x * jnp.asarray(math.sqrt(cfg.hidden_size), x.dtype)
    # Unrolled, XLA would fold the constant factor into the first layer's norm (reassociating
    # its multiplies), which a scan's loop boundary prevents: the barrier makes both one sum.
    x = jax.lax.optimization_barrier(x)
    per_layer = self._per_layer_inputs(token_ids, x)  # [..., L, P] or None
    if cfg.scan_layers:
      layers = cast(Gemma4Stacks, self.layers)
      x, kv_cache = scan_gemma4_layers(
        layers, x, positions, kv_cache, attn_metadata, per_layer, cfg, lora
      )
      return self.final_norm(x), kv_cache
    x, kv_cache = apply_layers(
      cast(nnx.List, self.layers),
      x,
      positions,
      kv_cache,
      attn_metadata,
      lambda i: (
        None if per_layer is None else per_layer[..., i, :],
        None if lora is None else lora.layer(i),
      ),
      cache_layer=cfg.kv_source,
    )
    return self.final_norm(x), kv_cache

  def _per_layer_inputs(self, token_ids: jax.Array, x: jax.Array) -> jax.Array | None:
    """``[..., L, P]`` every layer's per-layer input (module docstring), or None without."""
    cfg = self.config
    p = cfg.hidden_size_per_layer_input
    if self.ple_embed is None or self.ple_norm is None or self.ple_model_projection is None:
      return None
    lead = token_ids.shape
    table = jnp.take(self.ple_embed[...], token_ids, axis=0, mode="clip")
    table = (table * jnp.asarray(math.sqrt(p), x.dtype)).reshape(*lead, cfg.num_hidden_layers, p)
    projected = project(self, "ple_model_projection", x) * jnp.asarray(
      cfg.hidden_size**-0.5, x.dtype
    )
    projected = self.ple_norm(projected.reshape(*lead, cfg.num_hidden_layers, p))
    return (projected + table) * jnp.asarray(2.0**-0.5, x.dtype)

  def lora_target_shapes(self) -> dict[str, tuple[int, ...]]:
    """The ``(in, out)`` features of each projection a LoRA adapter may target, by its PEFT
    module name, the widest layer's (global layers' heads may be wider, KV-shared layers' MLPs
    double-wide: `gemma4_lora.layer_shapes` gives each layer's); the experts' as ``(X, in,
    out)`` with ``enable_moe_block``."""
    return gemma4_lora.target_shapes(self.config)

  def lora_target_layers(self) -> dict[str, tuple[int, ...]]:
    """The layers of ``k_proj`` (not the KV-shared ones) and ``v_proj`` (nor the global
    layers of ``attention_k_eq_v``)."""
    return gemma4_lora.target_layers(self.config)

  def lora_layer_shapes(self) -> dict[tuple[int, str], tuple[int, ...]]:
    """Each layer's ``(in, out)`` of each target it has (`jaxengine.lora.LoRAManager`'s
    ``layer_shapes``)."""
    return gemma4_lora.layer_shapes(self.config)

  def stack_decoder_layers(self, layers: Sequence[Gemma4DecoderLayer]) -> Gemma4Stacks:
    """The layers as one stack per kind (`jaxengine.models.gemma4_scan.stack_gemma4_layers`;
    each layer's own index dropped, in place)."""
    return stack_gemma4_layers(layers, self.config)

  @property
  def num_layers(self) -> int:
    """``L``, the decoder layers."""
    return self.config.num_hidden_layers

  @property
  def stacked_paths(self) -> tuple[str, ...]:
    """The state paths whose leaves have a leading layer axis (``("layers",)`` with
    ``scan_layers``: every kind's stack; quantization and the mesh shardings skip that axis)."""
    return ("layers",) if self.config.scan_layers else ()

  def weight_specs(self) -> list[WeightSpec]:
    """Every parameter under its Hugging Face checkpoint name
    (`jaxengine.models.gemma4_checkpoints.hf_weight_specs`)."""
    return hf_weight_specs(self.config)

  def compute_logits(self, hidden: jax.Array) -> jax.Array:
    """``[..., E]`` hidden states -> ``[..., V] float32`` logits, soft-capped when the config
    says so (``final_logit_softcapping``)."""
    w = self.embed[...] if self.lm_head is None else self.lm_head[...]
    return vocab_logits(
      hidden, w, batch_invariant=self.batch_invariant, soft_cap=self.config.final_logit_softcapping
    )
