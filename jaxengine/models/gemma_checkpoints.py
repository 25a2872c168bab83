"""How Gemma 2 / Gemma 3 Hugging Face checkpoints map onto `jaxengine.models.gemma.Gemma`.

- ``config.json`` -> `GemmaConfig` (`config_from_hf`, one family per registry entry:
  ``"gemma2"``, ``"gemma3"`` for ``Gemma3ForCausalLM``, ``"gemma3_multimodal"`` for the text model
  of a ``Gemma3ForConditionalGeneration`` checkpoint, read from its ``text_config``). Fields a
  ``config.json`` leaves out take transformers' defaults for the family (released configs omit
  many: a Gemma 3 4B ``text_config`` names little more than its sizes and window).
- tensor names -> leaves (`hf_weight_specs`): ``model.layers.0.self_attn.q_proj.weight`` ->
  ``layers/0/attn/wq``; a ``Gemma3ForConditionalGeneration`` checkpoint holds the same names under
  ``language_model.`` (its vision tower and projector are left unread, `IGNORED_PREFIXES`).

Every matrix keeps the checkpoint's ``(out, in)`` layout; norm weights are the ``w`` of
``(1 + w)``, taken as stored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxengine.models.gemma_config import FULL, SLIDING, GemmaConfig, GemmaRope
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

#: Families `config_from_hf` reads.
FAMILIES = ("gemma2", "gemma3", "gemma3_multimodal")
#: Rope types implemented (``rope_type`` or the older ``type``).
SUPPORTED_ROPE_TYPES = ("default", "linear")
#: Tensors of a ``Gemma3ForConditionalGeneration`` checkpoint that are not the text model's.
IGNORED_PREFIXES = ("vision_tower.", "multi_modal_projector.")

#: transformers' defaults of each family's config class, for fields a ``config.json`` omits.
_DEFAULTS: dict[str, dict[str, Any]] = {
  "gemma2": dict(
    vocab_size=256000,
    max_position_embeddings=8192,
    sliding_window_pattern=2,
    rope_theta=10000.0,
    attn_logit_softcapping=50.0,
    final_logit_softcapping=30.0,
  ),
  "gemma3": dict(
    vocab_size=262208,
    max_position_embeddings=131072,
    sliding_window_pattern=6,
    rope_theta=1_000_000.0,
    rope_local_base_freq=10000.0,
    attn_logit_softcapping=None,
    final_logit_softcapping=None,
  ),
}
_COMMON_DEFAULTS: dict[str, Any] = dict(
  hidden_size=2304,
  intermediate_size=9216,
  num_hidden_layers=26,
  num_attention_heads=8,
  num_key_value_heads=4,
  head_dim=256,
  hidden_activation="gelu_pytorch_tanh",
  rms_norm_eps=1e-6,
  query_pre_attn_scalar=256,
  sliding_window=4096,
  tie_word_embeddings=True,
  bos_token_id=2,
  eos_token_id=1,
)


def _rope(params: Mapping[str, Any] | None, theta: float, where: str) -> GemmaRope:
  """One layer kind's rope from a ``rope_parameters`` / ``rope_scaling`` dict (or None)."""
  params = params or {}
  rope_type = params.get("rope_type", params.get("type")) or "default"
  if rope_type not in SUPPORTED_ROPE_TYPES:
    raise ValueError(
      f"unsupported rope type {rope_type!r} ({where}); supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )
  theta = config_float(params, "rope_theta", theta)
  if rope_type == "default":
    return GemmaRope(theta=theta)
  if "factor" not in params:
    raise ValueError(f"rope type 'linear' needs 'factor' in {where}")
  return GemmaRope(theta=theta, factor=config_float(params, "factor"))


def _ropes(hf: Mapping[str, Any], family: str, get: _Fields) -> tuple[GemmaRope, GemmaRope]:
  """``(global, local)`` ropes from either config style (transformers 5's per-layer-type
  ``rope_parameters``, or ``rope_theta`` / ``rope_local_base_freq`` / ``rope_scaling``)."""
  params = hf.get("rope_parameters")
  if isinstance(params, Mapping) and (FULL in params or SLIDING in params):
    full = _rope(params.get(FULL), get.number("rope_theta"), f"rope_parameters[{FULL!r}]")
    local_theta = get.number("rope_local_base_freq" if family != "gemma2" else "rope_theta")
    local = _rope(params.get(SLIDING), local_theta, f"rope_parameters[{SLIDING!r}]")
    return full, local
  where = "rope_parameters" if params else "rope_scaling"
  full = _rope(params or hf.get("rope_scaling"), get.number("rope_theta"), where)
  if family == "gemma2":  # one rope for every layer
    return full, full
  return full, GemmaRope(theta=get.number("rope_local_base_freq"))


def _layer_types(hf: Mapping[str, Any], num_layers: int, get: _Fields) -> tuple[str, ...]:
  """``layer_types``, else the older ``sliding_window_pattern``: every ``n``-th layer global."""
  types = hf.get("layer_types")
  if types:
    return tuple(types)
  pattern = get.integer("sliding_window_pattern")
  if pattern < 1:
    raise ValueError(f"sliding_window_pattern must be >= 1, got {pattern}")
  return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(num_layers))


def config_from_hf(hf: Mapping[str, Any], family: str) -> GemmaConfig:
  """Translates a Gemma 2 / Gemma 3 ``config.json`` (a ``Gemma3ForConditionalGeneration``'s
  ``text_config``).

  Reads the sizes (``vocab_size``, ``hidden_size``, ``intermediate_size``,
  ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``),
  ``layer_types`` (or ``sliding_window_pattern``), ``sliding_window``, the rotary bases and
  scaling (``rope_parameters``, or ``rope_theta``, ``rope_local_base_freq`` and ``rope_scaling``
  of type ``linear``), ``query_pre_attn_scalar``, ``attn_logit_softcapping``,
  ``final_logit_softcapping``, ``hidden_activation``, ``rms_norm_eps``, ``tie_word_embeddings``,
  ``max_position_embeddings`` and the BOS/EOS ids, each with transformers' default for the family
  when absent.

  Args:
    hf: the parsed ``config.json``.
    family: one of `FAMILIES` (the registry entry's).

  Raises:
    ValueError: naming the field and value: an unknown family, an unsupported rope type,
      ``hidden_activation``, ``attention_bias``, ``use_bidirectional_attention`` or layer type, a
      missing ``text_config``, or values the model cannot take.
  """
  if family not in FAMILIES:
    raise ValueError(f"unknown Gemma family {family!r}; known: {', '.join(FAMILIES)}")
  prefix = ""
  if family == "gemma3_multimodal":
    text = hf.get("text_config")
    if not isinstance(text, Mapping):
      raise ValueError("a Gemma3ForConditionalGeneration config.json needs a 'text_config' object")
    top_eos = hf.get("eos_token_id")  # the text config's own, when it has one, wins
    hf = {**({} if top_eos is None else {"eos_token_id": top_eos}), **text}
    family, prefix = "gemma3", "language_model."
  defaults = {**_COMMON_DEFAULTS, **_DEFAULTS[family]}
  get = _Fields(hf, defaults)
  if config_bool(hf, "attention_bias", False):
    raise ValueError("attention_bias=True is not supported for Gemma")
  if config_bool(hf, "use_bidirectional_attention", False):
    raise ValueError("use_bidirectional_attention=True is not supported (causal decoding only)")
  num_layers = get.integer("num_hidden_layers")
  rope_global, rope_local = _ropes(hf, family, get)
  return GemmaConfig(
    vocab_size=get.integer("vocab_size"),
    hidden_size=get.integer("hidden_size"),
    intermediate_size=get.integer("intermediate_size"),
    num_hidden_layers=num_layers,
    num_attention_heads=get.integer("num_attention_heads"),
    num_key_value_heads=get.integer("num_key_value_heads"),
    head_dim=get.integer("head_dim"),
    layer_types=_layer_types(hf, num_layers, get),
    sliding_window=get.optional_integer("sliding_window"),
    rope_global=rope_global,
    rope_local=rope_local,
    query_pre_attn_scalar=get.number("query_pre_attn_scalar"),
    attn_logit_softcapping=get.optional_number("attn_logit_softcapping"),
    final_logit_softcapping=get.optional_number("final_logit_softcapping"),
    qk_norm=family == "gemma3",
    hidden_activation=str(get.value("hidden_activation")),
    rms_norm_eps=get.number("rms_norm_eps"),
    tie_word_embeddings=get.flag("tie_word_embeddings"),
    max_position_embeddings=get.integer("max_position_embeddings"),
    bos_token_id=get.token_id("bos_token_id"),
    eos_token_id=get.token_id("eos_token_id"),
    checkpoint_prefix=prefix,
  )


class _Fields:
  """Typed reads of a Gemma ``config.json``'s fields, an absent one read from `defaults` (the
  family's; a field written as ``null`` stays None: Gemma 3's softcappings).

  Raises (each read):
    ValueError: naming the field and value, for a value of the wrong JSON type.
  """

  def __init__(self, hf: Mapping[str, Any], defaults: Mapping[str, Any]):
    self.merged = {**defaults, **hf}

  def value(self, key: str) -> Any:
    return self.merged.get(key)

  def integer(self, key: str) -> int:
    return config_int(self.merged, key)

  def optional_integer(self, key: str) -> int | None:
    return config_optional_int(self.merged, key)

  def number(self, key: str) -> float:
    return config_float(self.merged, key)

  def optional_number(self, key: str) -> float | None:
    return config_optional_float(self.merged, key)

  def flag(self, key: str) -> bool:
    return config_bool(self.merged, key, False)

  def token_id(self, key: str) -> int | None:
    return config_token_id(self.merged, key)


def hf_weight_specs(cfg: GemmaConfig) -> list[WeightSpec]:
  """Every parameter under its Hugging Face checkpoint name (one spec per layer and tensor).

  Names (each after ``cfg.checkpoint_prefix``): ``model.embed_tokens.weight``,
  ``model.norm.weight``, ``lm_head.weight`` (accepted and ignored when the embeddings are tied),
  and per layer ``i`` under ``model.layers.{i}.``: ``input_layernorm``,
  ``post_attention_layernorm``, ``pre_feedforward_layernorm``, ``post_feedforward_layernorm``,
  ``self_attn.{q,k,v,o}_proj``, ``self_attn.{q,k}_norm`` (Gemma 3), ``mlp.{gate,up,down}_proj``,
  each ``.weight``. With ``scan_layers`` the per-layer specs name rows of the stacked
  ``[L, ...]`` leaves (`jaxengine.models.layer_scan.stacked_weight_specs`).
  """
  e, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
  h, k, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
  p = cfg.checkpoint_prefix
  specs = [
    WeightSpec(f"{p}model.embed_tokens.weight", ("embed",), None, (v, e)),
    WeightSpec(f"{p}model.norm.weight", ("final_norm", "scale"), None, (e,)),
    WeightSpec(
      f"{p}lm_head.weight", None if cfg.tie_word_embeddings else ("lm_head",), None, (v, e)
    ),
  ]
  per_layer: list[tuple[str, tuple[str, ...], tuple[int, ...]]] = [
    ("input_layernorm.weight", ("input_norm", "scale"), (e,)),
    ("self_attn.q_proj.weight", ("attn", "wq"), (h * d, e)),
    ("self_attn.k_proj.weight", ("attn", "wk"), (k * d, e)),
    ("self_attn.v_proj.weight", ("attn", "wv"), (k * d, e)),
    ("self_attn.o_proj.weight", ("attn", "wo"), (e, h * d)),
    ("post_attention_layernorm.weight", ("post_attention_norm", "scale"), (e,)),
    ("pre_feedforward_layernorm.weight", ("pre_feedforward_norm", "scale"), (e,)),
    ("mlp.gate_proj.weight", ("mlp", "w_gate"), (f, e)),
    ("mlp.up_proj.weight", ("mlp", "w_up"), (f, e)),
    ("mlp.down_proj.weight", ("mlp", "w_down"), (e, f)),
    ("post_feedforward_layernorm.weight", ("post_feedforward_norm", "scale"), (e,)),
  ]
  if not cfg.post_norms:  # Gemma 1's layout (only through Tunix: no Hugging Face entry)
    post = {"post_attention_layernorm.weight", "post_feedforward_layernorm.weight"}
    per_layer = [entry for entry in per_layer if entry[0] not in post]
  if cfg.qk_norm:
    per_layer += [
      ("self_attn.q_norm.weight", ("attn", "q_norm", "scale"), (d,)),
      ("self_attn.k_norm.weight", ("attn", "k_norm", "scale"), (d,)),
    ]
  for i in range(cfg.num_hidden_layers):
    specs += [
      WeightSpec(f"{p}model.layers.{i}.{suffix}", ("layers", i, *path), None, shape)
      for suffix, path, shape in per_layer
    ]
  return stacked_weight_specs(specs) if cfg.scan_layers else specs  # rows of [L, ...] leaves
