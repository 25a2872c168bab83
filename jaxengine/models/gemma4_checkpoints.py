"""How Gemma 4 Hugging Face checkpoints map onto `jaxengine.models.gemma4.Gemma4`.

- ``config.json`` -> `Gemma4Config` (`config_from_hf`): a ``Gemma4ForCausalLM``'s own fields
  (``model_type`` ``"gemma4_text"``), or a ``Gemma4ForConditionalGeneration``'s ``text_config``;
  absent fields take ``Gemma4TextConfig``'s defaults.
- tensor names -> leaves (`hf_weight_specs`): ``model.layers.0.self_attn.q_proj.weight`` ->
  ``layers/0/attn/wq``; a ``Gemma4ForConditionalGeneration`` checkpoint holds its text model under
  ``model.language_model.`` (its vision and audio towers and their projections are left unread,
  `IGNORED_PREFIXES`). The experts' ``(X, 2F, E)`` / ``(X, E, F)`` stacks are transposed to
  ``[X, in, out]`` (`jaxengine.models.weights.WeightSpec.transpose`); a KV-shared layer's key
  and value tensors, if a checkpoint has them, are accepted and ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxengine.models.gemma4_config import Gemma4Config, Gemma4Rope
from jaxengine.models.gemma_config import FULL, SLIDING
from jaxengine.models.hf_config_fields import (
  config_bool,
  config_float,
  config_int,
  config_optional_float,
  config_optional_int,
  config_token_id,
)
from jaxengine.models.layer_scan import stacked_weight_specs
from jaxengine.models.weights import WeightSpec

#: Families `config_from_hf` reads (one per registry entry).
FAMILIES = ("gemma4_text", "gemma4_multimodal")
#: Rope types implemented (``rope_parameters[kind]["rope_type"]``).
SUPPORTED_ROPE_TYPES = ("default", "proportional")
#: Tensors of a ``Gemma4ForConditionalGeneration`` checkpoint that are not the text model's.
IGNORED_PREFIXES = (
  "model.vision_tower.",
  "model.embed_vision.",
  "model.audio_tower.",
  "model.embed_audio.",
)

#: ``Gemma4TextConfig``'s defaults, for fields a ``config.json`` omits.
_DEFAULTS: dict[str, Any] = dict(
  vocab_size=262_144,
  hidden_size=2304,
  intermediate_size=9216,
  num_hidden_layers=30,
  num_attention_heads=8,
  num_key_value_heads=4,
  head_dim=256,
  global_head_dim=512,
  hidden_activation="gelu_pytorch_tanh",
  max_position_embeddings=131_072,
  rms_norm_eps=1e-6,
  sliding_window=512,
  tie_word_embeddings=True,
  bos_token_id=2,
  eos_token_id=1,
  vocab_size_per_layer_input=262_144,
  hidden_size_per_layer_input=256,
  num_kv_shared_layers=0,
)
_DEFAULT_ROPES = {
  SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
  FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}


def _rope(params: Any, kind: str) -> Gemma4Rope:
  """One layer kind's rope from its ``rope_parameters`` entry."""
  where = f"rope_parameters[{kind!r}]"
  if not isinstance(params, Mapping):
    raise ValueError(f"{where} must be an object, got {params!r}")
  rope_type = params.get("rope_type", params.get("type")) or "default"
  if rope_type not in SUPPORTED_ROPE_TYPES:
    raise ValueError(
      f"unsupported rope type {rope_type!r} ({where}); supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )
  theta = config_float(params, "rope_theta", 10_000.0)
  if rope_type == "default":
    return Gemma4Rope(theta=theta)
  return Gemma4Rope(
    theta=theta,
    factor=config_float(params, "factor", 1.0),
    partial_rotary_factor=config_float(params, "partial_rotary_factor", 1.0),
  )


def _layer_types(hf: Mapping[str, Any], num_layers: int) -> tuple[str, ...]:
  """``layer_types`` (default: every 6th layer global), the last layer global as transformers
  forces it."""
  types = list(hf.get("layer_types") or [])
  if not types:
    types = [SLIDING if (i + 1) % 6 else FULL for i in range(num_layers)]
  if types:
    types[-1] = FULL
  return tuple(types)


def config_from_hf(hf: Mapping[str, Any], family: str) -> Gemma4Config:
  """Translates a ``Gemma4TextConfig`` ``config.json`` (a ``Gemma4ForConditionalGeneration``'s
  ``text_config``), each absent field taking transformers' default.

  Args:
    hf: the parsed ``config.json``.
    family: one of `FAMILIES` (the registry entry's).

  Raises:
    ValueError: naming the field and value: an unknown family, a missing ``text_config``, an
      unsupported rope type, ``attention_bias=True``, ``use_bidirectional_attention="all"``, or
      values the model cannot take (`Gemma4Config`).
  """
  if family not in FAMILIES:
    raise ValueError(f"unknown Gemma 4 family {family!r}; known: {', '.join(FAMILIES)}")
  prefix = "model."
  if family == "gemma4_multimodal":
    text = hf.get("text_config")
    if not isinstance(text, Mapping):
      raise ValueError("a Gemma4ForConditionalGeneration config.json needs a 'text_config' object")
    top_eos = hf.get("eos_token_id")  # the text config's own, when it has one, wins
    hf = {**({} if top_eos is None else {"eos_token_id": top_eos}), **text}
    prefix = "model.language_model."
  merged = {**_DEFAULTS, **hf}
  if config_bool(hf, "attention_bias", False):
    raise ValueError("attention_bias=True is not supported for Gemma 4")
  bidirectional = hf.get("use_bidirectional_attention")
  if bidirectional not in (None, "vision"):  # "vision": bidirectional over images only
    raise ValueError(
      f"use_bidirectional_attention={bidirectional!r} is not supported (causal decoding only)"
    )
  ropes = hf.get("rope_parameters") or _DEFAULT_ROPES
  if not isinstance(ropes, Mapping):
    raise ValueError(f"rope_parameters must be an object, got {ropes!r}")
  num_layers = config_int(merged, "num_hidden_layers")
  moe = config_bool(hf, "enable_moe_block", False)
  return Gemma4Config(
    vocab_size=config_int(merged, "vocab_size"),
    hidden_size=config_int(merged, "hidden_size"),
    intermediate_size=config_int(merged, "intermediate_size"),
    num_hidden_layers=num_layers,
    num_attention_heads=config_int(merged, "num_attention_heads"),
    num_key_value_heads=config_int(merged, "num_key_value_heads"),
    head_dim=config_int(merged, "head_dim"),
    global_head_dim=config_int(merged, "global_head_dim", 0),
    num_global_key_value_heads=config_optional_int(merged, "num_global_key_value_heads"),
    layer_types=_layer_types(hf, num_layers),
    sliding_window=config_optional_int(merged, "sliding_window"),
    rope_local=_rope(ropes.get(SLIDING, _DEFAULT_ROPES[SLIDING]), SLIDING),
    rope_global=_rope(ropes.get(FULL, _DEFAULT_ROPES[FULL]), FULL),
    final_logit_softcapping=config_optional_float(merged, "final_logit_softcapping"),
    hidden_activation=str(merged.get("hidden_activation")),
    rms_norm_eps=config_float(merged, "rms_norm_eps"),
    tie_word_embeddings=config_bool(merged, "tie_word_embeddings", True),
    max_position_embeddings=config_int(merged, "max_position_embeddings"),
    bos_token_id=config_token_id(merged, "bos_token_id"),
    eos_token_id=config_token_id(merged, "eos_token_id"),
    vocab_size_per_layer_input=config_int(merged, "vocab_size_per_layer_input", 0),
    hidden_size_per_layer_input=config_int(merged, "hidden_size_per_layer_input", 0),
    attention_k_eq_v=config_bool(hf, "attention_k_eq_v", False),
    num_kv_shared_layers=config_int(merged, "num_kv_shared_layers", 0),
    enable_moe_block=moe,
    num_experts=config_int(hf, "num_experts", 0) if moe else 0,
    top_k_experts=config_int(hf, "top_k_experts", 0) if moe else 0,
    moe_intermediate_size=config_int(hf, "moe_intermediate_size", 0) if moe else 0,
    use_double_wide_mlp=config_bool(hf, "use_double_wide_mlp", False),
    checkpoint_prefix=prefix,
  )


def hf_weight_specs(cfg: Gemma4Config) -> list[WeightSpec]:
  """Every parameter under its Hugging Face checkpoint name (one spec per layer and tensor).

  Names after ``cfg.checkpoint_prefix``: ``embed_tokens.weight``, ``norm.weight``, with
  per-layer inputs ``embed_tokens_per_layer.weight``, ``per_layer_model_projection.weight`` and
  ``per_layer_projection_norm.weight``; per layer under ``layers.{i}.``: the four
  ``*_layernorm.weight``, ``layer_scalar``, ``self_attn.{q,k,v,o}_proj.weight`` and
  ``self_attn.{q,k}_norm.weight`` (no ``k``/``v`` on a KV-shared layer, no ``v_proj`` on a
  global layer with ``attention_k_eq_v``), ``mlp.{gate,up,down}_proj.weight``, with the MoE
  block ``router.{proj.weight,scale,per_expert_scale}``, ``experts.{gate_up,down}_proj`` and
  ``{post_feedforward_layernorm_1,pre_feedforward_layernorm_2,post_feedforward_layernorm_2}
  .weight``, with per-layer inputs ``per_layer_input_gate.weight``,
  ``per_layer_projection.weight`` and ``post_per_layer_input_norm.weight``. ``lm_head.weight``
  (no prefix) is accepted and ignored when the embeddings are tied.
  """
  e, v, h = cfg.hidden_size, cfg.vocab_size, cfg.num_attention_heads
  p, num_layers = cfg.hidden_size_per_layer_input, cfg.num_hidden_layers
  pre = cfg.checkpoint_prefix
  specs = [
    WeightSpec(f"{pre}embed_tokens.weight", ("embed",), None, (v, e)),
    WeightSpec(f"{pre}norm.weight", ("final_norm", "scale"), None, (e,)),
    WeightSpec("lm_head.weight", None if cfg.tie_word_embeddings else ("lm_head",), None, (v, e)),
  ]
  if p:
    specs += [
      WeightSpec(
        f"{pre}embed_tokens_per_layer.weight",
        ("ple_embed",),
        None,
        (cfg.vocab_size_per_layer_input, num_layers * p),
      ),
      WeightSpec(
        f"{pre}per_layer_model_projection.weight",
        ("ple_model_projection",),
        None,
        (num_layers * p, e),
      ),
      WeightSpec(f"{pre}per_layer_projection_norm.weight", ("ple_norm", "scale"), None, (p,)),
    ]
  for i in range(num_layers):
    k, d, f = cfg.kv_heads(i), cfg.layer_head_dim(i), cfg.mlp_size(i)
    shared = cfg.is_kv_shared(i)
    entries: list[tuple[str, tuple[str, ...] | None, tuple[int, ...], bool]] = [
      ("input_layernorm.weight", ("input_norm", "scale"), (e,), False),
      ("post_attention_layernorm.weight", ("post_attention_norm", "scale"), (e,), False),
      ("pre_feedforward_layernorm.weight", ("pre_feedforward_norm", "scale"), (e,), False),
      ("post_feedforward_layernorm.weight", ("post_feedforward_norm", "scale"), (e,), False),
      ("layer_scalar", ("layer_scalar",), (1,), False),
      ("self_attn.q_proj.weight", ("attn", "wq"), (h * d, e), False),
      ("self_attn.o_proj.weight", ("attn", "wo"), (e, h * d), False),
      ("self_attn.q_norm.weight", ("attn", "q_norm", "scale"), (d,), False),
      ("self_attn.k_proj.weight", None if shared else ("attn", "wk"), (k * d, e), False),
      ("self_attn.k_norm.weight", None if shared else ("attn", "k_norm", "scale"), (d,), False),
      ("mlp.gate_proj.weight", ("mlp", "w_gate"), (f, e), False),
      ("mlp.up_proj.weight", ("mlp", "w_up"), (f, e), False),
      ("mlp.down_proj.weight", ("mlp", "w_down"), (e, f), False),
    ]
    if shared or not cfg.k_eq_v(i):
      entries.append(
        ("self_attn.v_proj.weight", None if shared else ("attn", "wv"), (k * d, e), False)
      )
    if cfg.enable_moe_block:
      x, fm = cfg.num_experts, cfg.moe_intermediate_size
      entries += [
        ("router.proj.weight", ("moe", "router"), (x, e), False),
        ("router.scale", ("moe", "router_scale"), (e,), False),
        ("router.per_expert_scale", ("moe", "per_expert_scale"), (x,), False),
        ("experts.gate_up_proj", ("moe", "expert_gate_up"), (x, 2 * fm, e), True),
        ("experts.down_proj", ("moe", "expert_down"), (x, e, fm), True),
        ("post_feedforward_layernorm_1.weight", ("post_feedforward_norm_1", "scale"), (e,), False),
        ("pre_feedforward_layernorm_2.weight", ("pre_feedforward_norm_2", "scale"), (e,), False),
        ("post_feedforward_layernorm_2.weight", ("post_feedforward_norm_2", "scale"), (e,), False),
      ]
    if p:
      entries += [
        ("per_layer_input_gate.weight", ("ple_gate",), (p, e), False),
        ("per_layer_projection.weight", ("ple_projection",), (e, p), False),
        ("post_per_layer_input_norm.weight", ("post_ple_norm", "scale"), (e,), False),
      ]
    specs += [
      WeightSpec(
        f"{pre}layers.{i}.{suffix}",
        None if path is None else ("layers", i, *path),
        None,
        shape,
        transpose=transpose,
      )
      for suffix, path, shape, transpose in entries
    ]
  if cfg.scan_layers:  # rows of the stacked leaves of each kind
    return stacked_weight_specs(specs, cfg.layer_rows)
  return specs
