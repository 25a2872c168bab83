"""How Qwen3.5 Hugging Face checkpoints map onto `jaxengine.models.qwen3_5.Qwen3_5`.

- ``config.json`` -> `Qwen3_5Config` (`config_from_hf`; family ``"qwen3_5"`` for
  ``Qwen3_5ForCausalLM``, ``"qwen3_5_multimodal"`` for the text decoder of a
  ``Qwen3_5ForConditionalGeneration`` checkpoint, read from its ``text_config``, and
  ``"qwen3_5_moe"`` / ``"qwen3_5_moe_multimodal"`` for the mixture-of-experts variants:
  ``Qwen3_5MoeForCausalLM`` / ``Qwen3_5MoeForConditionalGeneration``).
- tensor names -> leaves (`hf_weight_specs`): ``model.layers.0.linear_attn.in_proj_qkv.weight``
  -> ``layers/0/mixer/w_qkv``; the image-text checkpoint holds the same names under
  ``model.language_model.`` (its ``lm_head.weight`` stays at the top) and its vision tower
  (``model.visual.``) is left unread (`IGNORED_PREFIXES`).

Every matrix keeps the checkpoint's ``(out, in)`` layout; the decoder's RMSNorm weights are the
``w`` of ``(1 + w)``, the gated norm's the plain ``w``, both taken as stored; the depthwise
convolution's ``[C, 1, K]`` weight becomes ``[C, K]``; the rows of those two and of
``in_proj_qkv`` are regrouped by key head (`KeyHeadGroups`, so that a tensor-parallel split of
them is a split by heads).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, cast

import jax.numpy as jnp
import numpy as np

from jaxengine.models.gated_deltanet import key_head_order
from jaxengine.models.hf_config_fields import (
  config_bool,
  config_float,
  config_int,
  config_token_id,
)
from jaxengine.models.kv_cache import KVCacheSpec
from jaxengine.models.layer_scan import stacked_weight_specs
from jaxengine.models.weights import LeafPath, WeightSpec

#: Families `config_from_hf` reads.
FAMILIES = ("qwen3_5", "qwen3_5_multimodal", "qwen3_5_moe", "qwen3_5_moe_multimodal")
#: The two kinds of layer in ``layer_types``.
LINEAR, FULL = "linear_attention", "full_attention"
#: Tensors of a ``Qwen3_5ForConditionalGeneration`` checkpoint that are not the text decoder's
#: (the vision tower), and the multi-token-prediction head some checkpoints carry.
IGNORED_PREFIXES = ("model.visual.", "mtp.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen3_5Config:
  """Hyper-parameters of a Qwen3.5 text decoder (the names of transformers'
  ``Qwen3_5TextConfig``).

  Attributes:
    layer_types: per layer, `LINEAR` (a Gated DeltaNet layer) or `FULL` (gated attention).
    linear_conv_kernel_dim: width ``K`` of the causal depthwise convolution over q, k, v.
    linear_key_head_dim, linear_value_head_dim: ``Dk``, ``Dv`` of a linear layer's heads.
    linear_num_key_heads, linear_num_value_heads: ``Hk``, ``Hv`` (``Hv % Hk == 0``; each key
      head serves ``Hv / Hk`` value heads).
    partial_rotary_factor: the share of a full-attention head's features that rotate.
    checkpoint_prefix: the text decoder's name prefix in the checkpoint (``model.`` or
      ``model.language_model.``).
    num_experts: ``X`` routed experts of every layer's sparse block (the MoE variants), 0 for
      a dense MLP.
    num_experts_per_tok: ``k`` experts per token; their routing weights are renormalised.
    moe_intermediate_size: an expert's intermediate features.
    shared_expert_intermediate_size: the shared expert's (gated by ``sigmoid(w x)``).
    scan_layers: the layers of each kind are stacked (every parameter ``[Ll, ...]`` for the
      linear layers, ``[La, ...]`` for the full ones) and run as one `jax.lax.scan` over the
      repeating group of `layer_types` (`layer_period` layers an iteration, the layers after
      the last whole group unrolled: `jaxengine.models.qwen3_5_scan`), with stacked pages and
      a stacked state pool; False: one module per layer.
  """

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_hidden_layers: int
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int
  layer_types: tuple[str, ...]
  linear_conv_kernel_dim: int = 4
  linear_key_head_dim: int = 128
  linear_value_head_dim: int = 128
  linear_num_key_heads: int = 16
  linear_num_value_heads: int = 32
  rope_theta: float = 10000.0
  partial_rotary_factor: float = 0.25
  rms_norm_eps: float = 1e-6
  tie_word_embeddings: bool = False
  max_position_embeddings: int = 32768
  bos_token_id: int | None = None
  eos_token_id: int | None = None
  checkpoint_prefix: str = "model."
  num_experts: int = 0
  num_experts_per_tok: int = 0
  moe_intermediate_size: int = 0
  shared_expert_intermediate_size: int = 0
  #: The routed weights are renormalised to sum to one (`jaxengine.models.moe.route`).
  norm_topk_prob: bool = True
  scan_layers: bool = False

  def __post_init__(self):
    if not isinstance(self.scan_layers, bool):
      raise ValueError(f"scan_layers must be a bool, got {self.scan_layers!r}")

  @property
  def layer_period(self) -> int:
    """``P``, the length of the repeating group of `layer_types` (4 for Qwen3.5's three linear
    layers and one full one; ``L`` when nothing repeats): layer ``i`` is of layer ``i % P``'s
    kind."""
    types = self.layer_types
    return next((p for p in range(1, len(types) + 1) if types[p:] == types[: len(types) - p]), 1)

  @property
  def linear_layers(self) -> tuple[int, ...]:
    """The Gated DeltaNet layers, in order (their index is their recurrent state's)."""
    return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

  @property
  def moe_layers(self) -> tuple[int, ...]:
    """The layers with routed experts: every layer of the MoE variants, none of a dense one."""
    return tuple(range(self.num_hidden_layers)) if self.num_experts else ()

  @property
  def attention_layers(self) -> tuple[int, ...]:
    """The full-attention layers, in order (their index is their KV cache layer's)."""
    return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

  @property
  def layer_rows(self) -> tuple[tuple[tuple[str], int], ...]:
    """Per layer, where a scanned model (`scan_layers`) keeps its weights: ``(("linear",), j)``
    for the ``j``-th linear layer (row ``j`` of ``layers/linear``'s ``[Ll, ...]`` leaves) or
    ``(("full",), j)`` for the ``j``-th full one
    (`jaxengine.models.layer_scan.stacked_weight_specs`)."""
    linear, full = self.linear_layers, self.attention_layers
    return tuple(
      (("linear",), linear.index(i)) if kind == LINEAR else (("full",), full.index(i))
      for i, kind in enumerate(self.layer_types)
    )

  @property
  def conv_dim(self) -> int:
    """``C``: the convolution's channels, q, k and v together (``2 Hk Dk + Hv Dv``)."""
    key_dim = self.linear_num_key_heads * self.linear_key_head_dim
    return 2 * key_dim + self.linear_num_value_heads * self.linear_value_head_dim

  @property
  def rotary_dim(self) -> int:
    """Features of a full-attention head that rotate (the first ones)."""
    return int(self.head_dim * self.partial_rotary_factor)

  def inv_freq(self) -> np.ndarray:
    """``[rotary_dim / 2] float32`` angles per position of the rotating pairs."""
    dim = self.rotary_dim
    return (1.0 / self.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)).astype(
      np.float32
    )

  def kv_cache_spec(self, dtype=jnp.float32) -> KVCacheSpec:
    """The paged cache of the full-attention layers only (the linear layers keep a recurrent
    state instead, `jaxengine.models.gated_deltanet.RecurrentStateSpec`)."""
    return KVCacheSpec(
      num_layers=len(self.attention_layers),
      num_kv_heads=self.num_key_value_heads,
      head_dim=self.head_dim,
      dtype=dtype,
      stacked=self.scan_layers,
    )


@dataclasses.dataclass(frozen=True)
class KeyHeadGroups(WeightSpec):
  """A `WeightSpec` whose rows (``in_proj_qkv``'s ``[q | k | v]``, the convolution's channels)
  are kept grouped by key head (`jaxengine.models.gated_deltanet`'s "Channel order").

  Attributes:
    sections: the rows of q, k and v in the checkpoint (``Hk Dk, Hk Dk, Hv Dv``).
    groups: ``Hk``; each section's rows are ``groups`` equal runs, one per key head.
  """

  sections: tuple[int, ...] = ()
  groups: int = 1

  def _order(self) -> np.ndarray:
    hk = self.groups
    q, _, v = self.sections
    return key_head_order(hk, q // hk, hk, v // hk)

  def to_param(self, tensor, param_shape: tuple[int, ...]):
    """``[q | k | v]`` rows -> key head ``g``'s q, k and v rows together, for each ``g``."""
    rows = tensor.reshape(sum(self.sections), -1)
    return super().to_param(rows[self._order()], param_shape)

  def from_param(self, value):
    """The inverse of `to_param`: grouped rows back to the checkpoint's ``[q | k | v]``."""
    rows = value.reshape(sum(self.sections), -1)
    return super().from_param(rows[np.argsort(self._order())])


def config_from_hf(hf: Mapping[str, Any], family: str) -> Qwen3_5Config:
  """Translates a Qwen3.5 ``config.json`` (a ``Qwen3_5ForConditionalGeneration``'s
  ``text_config``).

  Reads the sizes, ``layer_types`` (or ``full_attention_interval``: every ``n``-th layer full),
  the linear layers' ``linear_*`` fields, ``rope_parameters`` (``rope_theta``,
  ``partial_rotary_factor``; a text-only decoder's multimodal rotary sections rotate as one),
  ``rms_norm_eps``, ``tie_word_embeddings``, ``max_position_embeddings`` and the BOS/EOS ids.

  Raises:
    ValueError: naming the field and value: an unknown family, a missing ``text_config``, a
      rope type other than ``default``, ``attention_bias``, an activation other than SiLU, an
      unknown layer type, ``layer_types`` of the wrong length, or heads that do not divide.
  """
  if family not in FAMILIES:
    raise ValueError(f"unknown Qwen3.5 family {family!r}; known: {', '.join(FAMILIES)}")
  prefix = "model."
  moe = family.startswith("qwen3_5_moe")
  if family.endswith("_multimodal"):
    text = hf.get("text_config")
    if not isinstance(text, Mapping):
      raise ValueError("a Qwen3_5ForConditionalGeneration config.json needs a 'text_config' object")
    top = {k: hf[k] for k in ("eos_token_id", "tie_word_embeddings") if hf.get(k) is not None}
    hf = {**top, **text}
    prefix = "model.language_model."
  experts: dict[str, Any] = {}
  if moe:
    experts = dict(
      num_experts=config_int(hf, "num_experts"),
      num_experts_per_tok=config_int(hf, "num_experts_per_tok"),
      moe_intermediate_size=config_int(hf, "moe_intermediate_size"),
      shared_expert_intermediate_size=config_int(hf, "shared_expert_intermediate_size"),
    )
    if not 1 <= experts["num_experts_per_tok"] <= experts["num_experts"]:
      raise ValueError(
        f"num_experts_per_tok={experts['num_experts_per_tok']} must be in "
        f"[1, num_experts={experts['num_experts']}]"
      )
  if config_bool(hf, "attention_bias", False):
    raise ValueError("attention_bias=True is not supported for Qwen3.5")
  if hf.get("hidden_act", "silu") != "silu":
    raise ValueError(f"hidden_act {hf.get('hidden_act')!r} is not supported for Qwen3.5 (silu)")
  rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  if not isinstance(rope, Mapping):
    raise ValueError(f"rope_parameters must be an object, got {rope!r}")
  rope_type = rope.get("rope_type", rope.get("type")) or "default"
  if rope_type != "default":
    raise ValueError(f"unsupported rope type {rope_type!r} for Qwen3.5; supported: default")
  num_layers = config_int(hf, "num_hidden_layers")
  types = hf.get("layer_types")
  if not types:
    interval = config_int(hf, "full_attention_interval", 4)
    types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(num_layers)]
  if len(types) != num_layers or any(t not in (LINEAR, FULL) for t in types):
    raise ValueError(
      f"layer_types must be {num_layers} of {LINEAR!r} / {FULL!r}, got {list(types)!r}"
    )
  config = Qwen3_5Config(
    vocab_size=config_int(hf, "vocab_size"),
    hidden_size=config_int(hf, "hidden_size"),
    intermediate_size=config_int(hf, "intermediate_size", 0 if moe else None),
    num_hidden_layers=num_layers,
    num_attention_heads=config_int(hf, "num_attention_heads"),
    num_key_value_heads=config_int(hf, "num_key_value_heads"),
    head_dim=config_int(hf, "head_dim", 256),
    layer_types=tuple(types),
    linear_conv_kernel_dim=config_int(hf, "linear_conv_kernel_dim", 4),
    linear_key_head_dim=config_int(hf, "linear_key_head_dim", 128),
    linear_value_head_dim=config_int(hf, "linear_value_head_dim", 128),
    linear_num_key_heads=config_int(hf, "linear_num_key_heads", 16),
    linear_num_value_heads=config_int(hf, "linear_num_value_heads", 32),
    rope_theta=config_float(rope, "rope_theta", config_float(hf, "rope_theta", 10000.0)),
    partial_rotary_factor=config_float(
      rope, "partial_rotary_factor", config_float(hf, "partial_rotary_factor", 0.25)
    ),
    rms_norm_eps=config_float(hf, "rms_norm_eps", 1e-6),
    tie_word_embeddings=config_bool(hf, "tie_word_embeddings", False),
    max_position_embeddings=config_int(hf, "max_position_embeddings", 32768),
    bos_token_id=config_token_id(hf, "bos_token_id"),
    eos_token_id=config_token_id(hf, "eos_token_id"),
    checkpoint_prefix=prefix,
    **experts,
  )
  for heads, kv, what in (
    (config.num_attention_heads, config.num_key_value_heads, "num_attention_heads"),
    (config.linear_num_value_heads, config.linear_num_key_heads, "linear_num_value_heads"),
  ):
    if kv < 1 or heads % kv:
      raise ValueError(f"{what}={heads} must be a multiple of its key heads ({kv})")
  return config


def hf_weight_specs(cfg: Qwen3_5Config) -> list[WeightSpec]:
  """Every parameter under its Hugging Face checkpoint name (one spec per layer and tensor).

  Names (``p`` the `Qwen3_5Config.checkpoint_prefix`): ``{p}embed_tokens.weight``,
  ``{p}norm.weight``, ``lm_head.weight`` (accepted and ignored when the embeddings are tied),
  and per layer ``i`` under ``{p}layers.{i}.``: ``input_layernorm``,
  ``post_attention_layernorm``, ``mlp.{gate,up,down}_proj`` (each ``.weight``; the MoE
  variants' sparse block instead, `_moe_specs`), then a linear
  layer's ``linear_attn.{in_proj_qkv,in_proj_z,in_proj_b,in_proj_a,out_proj,norm}.weight``,
  ``linear_attn.conv1d.weight``, ``linear_attn.A_log``, ``linear_attn.dt_bias``, or a full
  layer's ``self_attn.{q,k,v,o}_proj.weight`` and ``self_attn.{q,k}_norm.weight``. With
  ``scan_layers`` the per-layer specs name rows of the stacked leaves (`Qwen3_5Config.
  layer_rows`).
  """
  e, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
  h, k, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
  hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
  c, width = cfg.conv_dim, cfg.linear_conv_kernel_dim
  p = cfg.checkpoint_prefix
  specs = [
    WeightSpec(f"{p}embed_tokens.weight", ("embed",), None, (v, e)),
    WeightSpec(f"{p}norm.weight", ("final_norm", "scale"), None, (e,)),
    WeightSpec("lm_head.weight", None if cfg.tie_word_embeddings else ("lm_head",), None, (v, e)),
  ]
  common: list[tuple[str, tuple[str, ...], tuple[int, ...]]] = [
    ("input_layernorm.weight", ("input_norm", "scale"), (e,)),
    ("post_attention_layernorm.weight", ("post_attention_norm", "scale"), (e,)),
    ("mlp.gate_proj.weight", ("mlp", "w_gate"), (f, e)),
    ("mlp.up_proj.weight", ("mlp", "w_up"), (f, e)),
    ("mlp.down_proj.weight", ("mlp", "w_down"), (e, f)),
  ]
  linear: list[tuple[str, tuple[str, ...], tuple[int, ...]]] = [
    ("linear_attn.in_proj_qkv.weight", ("mixer", "w_qkv"), (c, e)),
    ("linear_attn.in_proj_z.weight", ("mixer", "w_z"), (hv * dv, e)),
    ("linear_attn.in_proj_b.weight", ("mixer", "w_b"), (hv, e)),
    ("linear_attn.in_proj_a.weight", ("mixer", "w_a"), (hv, e)),
    ("linear_attn.conv1d.weight", ("mixer", "conv"), (c, 1, width)),
    ("linear_attn.A_log", ("mixer", "a_log"), (hv,)),
    ("linear_attn.dt_bias", ("mixer", "dt_bias"), (hv,)),
    ("linear_attn.norm.weight", ("mixer", "norm", "scale"), (dv,)),
    ("linear_attn.out_proj.weight", ("mixer", "w_out"), (e, hv * dv)),
  ]
  full: list[tuple[str, tuple[str, ...], tuple[int, ...]]] = [
    ("self_attn.q_proj.weight", ("mixer", "wq"), (2 * h * d, e)),
    ("self_attn.k_proj.weight", ("mixer", "wk"), (k * d, e)),
    ("self_attn.v_proj.weight", ("mixer", "wv"), (k * d, e)),
    ("self_attn.o_proj.weight", ("mixer", "wo"), (e, h * d)),
    ("self_attn.q_norm.weight", ("mixer", "q_norm", "scale"), (d,)),
    ("self_attn.k_norm.weight", ("mixer", "k_norm", "scale"), (d,)),
  ]
  if cfg.num_experts:
    common = common[:2]
  key_dim = cfg.linear_num_key_heads * cfg.linear_key_head_dim
  sections, groups = (key_dim, key_dim, hv * dv), cfg.linear_num_key_heads
  for i, kind in enumerate(cfg.layer_types):
    for suffix, path, shape in common + (linear if kind == LINEAR else full):
      name, leaf = f"{p}layers.{i}.{suffix}", cast(LeafPath, ("layers", i, *path))
      if path[-1] in ("w_qkv", "conv"):
        specs.append(KeyHeadGroups(name, leaf, None, shape, sections=sections, groups=groups))
      else:
        specs.append(WeightSpec(name, leaf, None, shape))
    if cfg.num_experts:
      specs += _moe_specs(cfg, i)
  if cfg.scan_layers:  # rows of the stacked [Ll, ...] and [La, ...] leaves
    return stacked_weight_specs(specs, cfg.layer_rows)
  return specs


def _moe_specs(cfg: Qwen3_5Config, layer: int) -> list[WeightSpec]:
  """Layer `layer`'s sparse block: the router ``mlp.gate.weight`` ``(X, E)``, each expert
  ``j``'s ``mlp.experts.{j}.{gate,up,down}_proj.weight`` (row ``j`` of the ``[X, in, out]``
  stacks of `jaxengine.models.moe.SparseMoeBlock`, transposed), the shared expert's
  ``mlp.shared_expert.{gate,up,down}_proj.weight`` and its gate ``mlp.shared_expert_gate.weight``
  ``(1, E)``."""
  e, f, s = cfg.hidden_size, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
  name = f"{cfg.checkpoint_prefix}layers.{layer}.mlp"
  path = ("layers", layer, "mlp")
  specs = [
    WeightSpec(f"{name}.gate.weight", (*path, "experts", "router"), None, (cfg.num_experts, e)),
    WeightSpec(f"{name}.shared_expert.gate_proj.weight", (*path, "shared", "w_gate"), None, (s, e)),
    WeightSpec(f"{name}.shared_expert.up_proj.weight", (*path, "shared", "w_up"), None, (s, e)),
    WeightSpec(f"{name}.shared_expert.down_proj.weight", (*path, "shared", "w_down"), None, (e, s)),
    WeightSpec(f"{name}.shared_expert_gate.weight", (*path, "shared_gate"), None, (1, e)),
  ]
  for j in range(cfg.num_experts):
    expert = f"{name}.experts.{j}"
    specs += [
      WeightSpec(f"{expert}.gate_proj.weight", (*path, "experts", "expert_gate"), j, (f, e), True),
      WeightSpec(f"{expert}.up_proj.weight", (*path, "experts", "expert_up"), j, (f, e), True),
      WeightSpec(f"{expert}.down_proj.weight", (*path, "experts", "expert_down"), j, (e, f), True),
    ]
  return specs
