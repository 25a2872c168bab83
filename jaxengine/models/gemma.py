"""Gemma 2 and Gemma 3 (text) decoders in Flax NNX, attending through the same seam as Llama.

A module of its own rather than switches on `jaxengine.models.llama.Llama`: a Gemma layer differs
from a Llama layer in most of its parts (four ``(1 + w)`` RMSNorms around attention and MLP
instead of two plain ones, a GeGLU MLP, a per-layer window and rotary base, soft-capped scores,
``query_pre_attn_scalar``, an embedding scaled by ``sqrt(E)``), so switches would have touched
every Llama class. It shares Llama's building blocks (`jaxengine.models.layers`: the ``[out, in]``
projection, rotary embedding, RMSNorm) and the attention seam
(`jaxengine.models.attention.attention`), so the pages, every attention backend that has a
window and a soft cap, meshes, ``batch_invariant`` and `jaxengine.models.token_logprobs` serve it
unchanged.

What the model computes (Gemma Team, 2024 and 2025):

- ``x = embed[ids] * sqrt(E)``, the factor rounded to the model dtype first (as transformers);
- per layer ``i``: ``x += post_attn_norm(attn(input_norm(x)))`` and
  ``x += post_ffw_norm(mlp(pre_ffw_norm(x)))``, every norm ``x / rms(x) * (1 + w)`` in float32;
- attention: grouped-query, rotary embedding with the base of the layer's kind (local or
  global; Gemma 3 scales the global one linearly on 4B and larger), q/k RMSNorms before it
  (Gemma 3), scale ``query_pre_attn_scalar ** -0.5``, scores soft-capped (Gemma 2), a sliding
  window of ``sliding_window`` positions on local layers (``layer_types``);
- MLP: ``down(gelu_tanh(gate(x)) * up(x))``;
- logits: ``final_norm(x) @ embed.T`` (tied), soft-capped (``final_logit_softcapping``).

With ``scan_layers`` (`GemmaConfig.scan_layers`) the layers are one module whose every parameter
is ``[L, ...]``, run as a `jax.lax.scan` over the repeating group of local and global layers
(`jaxengine.models.layer_scan.scan_layer_groups`): a layer's kind (its window and rotary base)
is then the call's ``kind``, static, not the module's own index.

LoRA adapters (`jaxengine.models.lora`) may target the seven projections by their PEFT names
(``q_proj`` ... ``down_proj``, `Gemma.lora_target_shapes`); each update is added to its
projection's output, before the q/k norms, as PEFT wraps the ``nn.Linear``.

Shape letters as in `jaxengine.models.llama`.

References:
  Gemma Team, "Gemma 2: Improving Open Language Models at a Practical Size", 2024.
  Gemma Team, "Gemma 3 Technical Report", 2025.
  Shazeer, "GLU Variants Improve Transformer", 2020 (GeGLU).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar, cast

import jax
import jax.numpy as jnp
from flax import nnx

from jaxengine.models.attention import PagedAttentionMetadata, PagedKVCache, attention
from jaxengine.models.gemma_checkpoints import hf_weight_specs
from jaxengine.models.gemma_config import ACTIVATIONS, GemmaConfig
from jaxengine.models.layer_scan import scan_layer_groups, stack_layers
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

__all__ = ["Gemma", "GemmaAttention", "GemmaConfig", "GemmaDecoderLayer", "GemmaMLP"]


def _norm(config: GemmaConfig, dim: int) -> RMSNorm:
  return RMSNorm(dim, eps=config.rms_norm_eps, unit_offset=True)


class GemmaAttention(nnx.Module):
  """Grouped-query attention of one layer, local or global.

  Attributes:
    wq, wk, wv, wo: ``[H, D, E]``, ``[K, D, E]``, ``[K, D, E]``, ``[E, H, D]`` projections
      (PyTorch ``[out, in]`` layout).
    q_norm, k_norm: per-head ``(1 + w)`` RMSNorms over ``D`` (Gemma 3), or None.
    layer: this layer's index (static): its kind picks the window and the rotary base; None
      in a stacked module (`Gemma.stack_decoder_layers`), whose calls name the kind.
    scales: row scales of the quantized projections (`jaxengine.models.llama.Attention`).
    batch_invariant: projections computed a fixed number of rows at a time (`Gemma`).
  """

  #: The projections `quantize_model` may quantize, with their input axes (`quantize_rows`).
  QUANTIZABLE: ClassVar[dict[str, tuple[int, ...]]] = {
    "wq": (2,),
    "wk": (2,),
    "wv": (2,),
    "wo": (1, 2),
  }

  def __init__(self, config: GemmaConfig, layer: int | None, *, dtype, rngs: nnx.Rngs):
    e, h, k, d = (
      config.hidden_size,
      config.num_attention_heads,
      config.num_key_value_heads,
      config.head_dim,
    )
    self.config = config
    self.layer = layer
    self.wq = nnx.Param(normal_out_in(rngs, (h, d), (e,), dtype))
    self.wk = nnx.Param(normal_out_in(rngs, (k, d), (e,), dtype))
    self.wv = nnx.Param(normal_out_in(rngs, (k, d), (e,), dtype))
    self.wo = nnx.Param(normal_out_in(rngs, (e,), (h, d), dtype))
    self.q_norm = _norm(config, d) if config.qk_norm else None
    self.k_norm = _norm(config, d) if config.qk_norm else None
    self.scales: nnx.Dict[nnx.Param] = nnx.Dict()
    self.batch_invariant = False

  def __call__(
    self,
    x,
    positions,
    kv_cache,
    layer,
    metadata,
    lora: LayerLoRA | None = None,
    kind: int | None = None,
  ):
    """``[..., E]`` normalised hidden states -> ``([..., E] output, updated cache)``; the
    arguments as `jaxengine.models.llama.Attention.__call__` (LoRA updates added to the
    projections' outputs, before the q/k norms, as PEFT wraps ``q_proj`` ...), and `kind`
    (static): a layer whose window and rotary base this call takes, None for this module's
    own (`layer` the attribute; a stacked module has none and must be given one)."""
    cfg = self.config
    kind = self.layer if kind is None else kind
    if kind is None:
      raise ValueError("a stacked Gemma layer needs the kind of layer it runs (kind=...)")
    lead = x.shape[:-1]
    e, h, kv, d = x.shape[-1], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    fixed = self.batch_invariant
    q = add_lora(project(self, "wq", x, (h * d, e)), x, lora, "q_proj", fixed)
    k = add_lora(project(self, "wk", x, (kv * d, e)), x, lora, "k_proj", fixed)
    v = add_lora(project(self, "wv", x, (kv * d, e)), x, lora, "v_proj", fixed)
    q, k, v = q.reshape(*lead, h, d), k.reshape(*lead, kv, d), v.reshape(*lead, kv, d)
    if self.q_norm is not None and self.k_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    inv_freq = cfg.rope(kind).frequencies(d)  # [D/2] host constant
    q = rotary_embedding(q, positions, inv_freq)
    k = rotary_embedding(k, positions, inv_freq)
    out, kv_cache = attention(
      q,
      k,
      v,
      kv_cache,
      layer,
      metadata,
      scale=float(cfg.query_pre_attn_scalar) ** -0.5,
      sliding_window=cfg.window(kind),
      soft_cap=cfg.attn_logit_softcapping,
    )
    out = out.reshape(*lead, h * d)
    out = add_lora(project(self, "wo", out, (e, h * d)), out, lora, "o_proj", fixed)
    return out, kv_cache


class GemmaMLP(nnx.Module):
  """GeGLU feed-forward block: ``down(gelu(gate(x)) * up(x))``, the GELU of
  ``hidden_activation`` (the tanh approximation for every released Gemma 2 and 3).

  Attributes:
    w_gate, w_up: ``[F, E]``; w_down: ``[E, F]`` (``[out, in]`` layout).
    scales: row scales of the quantized projections (`jaxengine.models.llama.Attention`).
    batch_invariant: projections computed a fixed number of rows at a time (`Gemma`).
  """

  #: The projections `quantize_model` may quantize, with their input axes (`quantize_rows`).
  QUANTIZABLE: ClassVar[dict[str, tuple[int, ...]]] = dict.fromkeys(
    ("w_gate", "w_up", "w_down"), (1,)
  )

  def __init__(self, config: Any, *, dtype, rngs: nnx.Rngs, intermediate_size: int | None = None):
    """Args: config: a config with ``hidden_size``, ``intermediate_size`` and
    ``hidden_activation`` (`GemmaConfig`, `jaxengine.models.gemma4_config.Gemma4Config`).
    intermediate_size: ``F`` when not the config's (Gemma 4's double-wide layers)."""
    e, f = config.hidden_size, intermediate_size or config.intermediate_size
    self.approximate = ACTIVATIONS[config.hidden_activation]
    self.w_gate = nnx.Param(normal_out_in(rngs, (f,), (e,), dtype))
    self.w_up = nnx.Param(normal_out_in(rngs, (f,), (e,), dtype))
    self.w_down = nnx.Param(normal_out_in(rngs, (e,), (f,), dtype))
    self.scales: nnx.Dict[nnx.Param] = nnx.Dict()
    self.batch_invariant = False

  def __call__(self, x: jax.Array, lora: LayerLoRA | None = None) -> jax.Array:
    """Maps ``[..., E]`` to ``[..., E]`` in the model dtype (with this layer's LoRA adapters,
    `jaxengine.models.lora`, when given)."""
    fixed = self.batch_invariant
    gate = add_lora(project(self, "w_gate", x), x, lora, "gate_proj", fixed)
    up = add_lora(project(self, "w_up", x), x, lora, "up_proj", fixed)
    hidden = jax.nn.gelu(gate, approximate=self.approximate) * up
    return add_lora(project(self, "w_down", hidden), hidden, lora, "down_proj", fixed)


class GemmaDecoderLayer(nnx.Module):
  """``x += post_attn_norm(attn(input_norm(x))); x += post_ffw_norm(mlp(pre_ffw_norm(x)))``
  (without the two post norms when ``config.post_norms`` is False)."""

  def __init__(self, config: GemmaConfig, layer: int | None, *, dtype, rngs: nnx.Rngs):
    e = config.hidden_size
    self.input_norm = _norm(config, e)
    self.attn = GemmaAttention(config, layer, dtype=dtype, rngs=rngs)
    self.post_attention_norm = _norm(config, e) if config.post_norms else None
    self.pre_feedforward_norm = _norm(config, e)
    self.mlp = GemmaMLP(config, dtype=dtype, rngs=rngs)
    self.post_feedforward_norm = _norm(config, e) if config.post_norms else None

  def __call__(
    self,
    x,
    positions,
    kv_cache,
    layer,
    metadata,
    lora: LayerLoRA | None = None,
    kind: int | None = None,
  ):
    """Same arguments as `GemmaAttention.__call__`, ``x`` the residual stream ``[..., E]``."""
    h, kv_cache = self.attn(self.input_norm(x), positions, kv_cache, layer, metadata, lora, kind)
    if self.post_attention_norm is not None:
      h = self.post_attention_norm(h)
    x = x + h
    h = self.mlp(self.pre_feedforward_norm(x), lora)
    if self.post_feedforward_norm is not None:
      h = self.post_feedforward_norm(h)
    return x + h, kv_cache


class Gemma(ConfiguredDecoder, nnx.Module):
  """Gemma 2 / Gemma 3 text decoder over a `PagedKVCache`;
  implements `jaxengine.models.Model` (the same interface and attributes as
  `jaxengine.models.Llama`: ``config``, ``dtype``, ``embed``, ``layers``, ``final_norm``,
  ``lm_head``, ``batch_invariant``). ``layers`` holds ``L`` `GemmaDecoderLayer` modules (an
  `nnx.List`), or with the config's ``scan_layers`` one stacked `GemmaDecoderLayer` (every leaf
  ``[L, ...]``, `stack_decoder_layers`).
  """

  def __init__(self, config: GemmaConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
    """Builds a model with random weights (Gaussian, std ``fan_in ** -0.5``; norm offsets 0).

    Args:
      config: hyper-parameters.
      dtype: parameter and compute dtype (norms, softmax and logits stay float32).
      rngs: random streams for initialisation.
    """
    self.config = config
    self.dtype = dtype
    e, v = config.hidden_size, config.vocab_size
    self.embed = nnx.Param(normal_init(rngs, (v, e), e, dtype))
    layers = [
      GemmaDecoderLayer(config, i, dtype=dtype, rngs=rngs) for i in range(config.num_hidden_layers)
    ]
    self.layers: nnx.List | GemmaDecoderLayer = (
      self.stack_decoder_layers(layers) if config.scan_layers else nnx.List(layers)
    )
    self.final_norm = _norm(config, e)
    self.lm_head = (
      None if config.tie_word_embeddings else nnx.Param(normal_init(rngs, (v, e), e, dtype))
    )
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
    """Runs the decoder, updating the cache; arguments (`lora`: the step's LoRA adapters with
    each flat token's slot, or None) and results as `jaxengine.models.Llama.__call__`
    (``[..., E]`` hidden states after the final norm)."""
    x = jnp.take(self.embed[...], token_ids, axis=0, mode="clip")
    x = x * jnp.asarray(math.sqrt(self.config.hidden_size), x.dtype)
    # Unrolled, XLA would fold the constant factor into the first layer's norm (reassociating
    # its multiplies), which a scan's loop boundary prevents: the barrier makes both one sum.
    x = jax.lax.optimization_barrier(x)
    cfg = self.config
    if cfg.scan_layers:
      x, kv_cache = scan_layer_groups(
        self.layers,
        x,
        positions,
        kv_cache,
        attn_metadata,
        num_layers=cfg.num_hidden_layers,
        period=cfg.layer_period,
        lora=lora,
      )
      return self.final_norm(x), kv_cache
    layer_args = lambda index: () if lora is None else (lora.layer(index),)
    layers = cast(nnx.List, self.layers)
    x, kv_cache = apply_layers(layers, x, positions, kv_cache, attn_metadata, layer_args)
    return self.final_norm(x), kv_cache

  @staticmethod
  def stack_decoder_layers(layers: Sequence[GemmaDecoderLayer]) -> GemmaDecoderLayer:
    """One `GemmaDecoderLayer` whose every leaf stacks `layers`' on a leading ``[L]`` axis
    (`jaxengine.models.layer_scan.stack_layers`). Each layer's own index (which makes a local
    and a global layer differ in structure) is dropped first, in place: the scan names each
    call's kind (`scan_layer_groups`)."""
    for layer in layers:
      layer.attn.layer = None
    return cast(GemmaDecoderLayer, stack_layers(layers))

  @property
  def num_layers(self) -> int:
    """``L``, the decoder layers."""
    return self.config.num_hidden_layers

  @property
  def stacked_paths(self) -> tuple[str, ...]:
    """The state paths whose leaves have a leading layer axis (``("layers",)`` with
    ``scan_layers``; quantization and the mesh shardings skip that axis)."""
    return ("layers",) if self.config.scan_layers else ()

  def lora_target_shapes(self) -> dict[str, tuple[int, int]]:
    """The ``(in, out)`` features of each projection a LoRA adapter may target, by its PEFT
    module name (the same in every layer; `jaxengine.models.lora.LORA_TARGETS`)."""
    cfg = self.config
    e, f = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return {
      "q_proj": (e, q), "k_proj": (e, kv), "v_proj": (e, kv), "o_proj": (q, e),
      "gate_proj": (e, f), "up_proj": (e, f), "down_proj": (f, e),
    }  # fmt: skip

  def weight_specs(self) -> list[WeightSpec]:
    """Every parameter under its Hugging Face checkpoint name
    (`jaxengine.models.gemma_checkpoints.hf_weight_specs`)."""
    return hf_weight_specs(self.config)

  def compute_logits(self, hidden: jax.Array) -> jax.Array:
    """``[..., E]`` hidden states -> ``[..., V] float32`` logits, soft-capped when the config
    says so (``final_logit_softcapping``)."""
    w = self.embed[...] if self.lm_head is None else self.lm_head[...]
    return vocab_logits(
      hidden, w, batch_invariant=self.batch_invariant, soft_cap=self.config.final_logit_softcapping
    )
