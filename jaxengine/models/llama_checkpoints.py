"""How Llama-family checkpoints map onto `jaxengine.models.Llama`: configs and tensor names.

For both sources the loaders read (`jaxengine.models.registry` routes them here):

- a Hugging Face ``config.json`` -> `LlamaConfig` (`config_from_hf`, one switch per family:
  ``"llama"``, ``"mistral"``, ``"qwen2"``, ``"qwen3"``, and the mixture-of-experts
  ``"qwen3_moe"`` and ``"mixtral"``), and its tensor names -> the model's leaves
  (`hf_weight_specs`: ``model.layers.0.self_attn.q_proj.weight`` -> ``layers/0/attn/wq``; an
  expert's ``model.layers.0.mlp.experts.3.up_proj.weight`` -> row 3 of ``layers/0/mlp/expert_up``);
- GGUF metadata (``llama.*`` keys) -> `LlamaConfig` (`config_from_gguf`), and GGUF tensor names ->
  leaves (`gguf_weight_specs`: ``blk.0.attn_q.weight`` -> ``layers/0/attn/wq``, rows of the query
  and key projections put back from GGUF's interleaved rotary pairs).

Every dense matrix keeps the checkpoint's ``(out, in)`` layout: tensors are only reshaped per
head. A mixture of experts' per-expert matrices are transposed to its ``[X, in, out]`` stacks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jaxengine.models.hf_config_fields import (
  config_bool,
  config_float,
  config_int,
  config_optional_int,
  config_token_id,
)
from jaxengine.models.layer_scan import stacked_weight_specs
from jaxengine.models.llama_config import Llama3RopeScaling, LlamaConfig
from jaxengine.models.weights import WeightSpec

#: Rope types implemented (``rope_type`` or the older ``type`` key); None means default.
SUPPORTED_ROPE_TYPES = ("default", "llama3")


def _rope(hf: Mapping[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
  """``(rope_theta, scaling)`` from either config style; ValueError for other rope types."""
  params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  theta = config_float(params, "rope_theta", config_float(hf, "rope_theta", 10000.0))
  rope_type = params.get("rope_type", params.get("type")) or "default"
  if rope_type not in SUPPORTED_ROPE_TYPES:
    raise ValueError(
      f"unsupported rope type {rope_type!r} (rope_scaling / rope_parameters); supported: "
      f"{', '.join(SUPPORTED_ROPE_TYPES)}"
    )
  if rope_type == "default":
    return theta, None
  for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
    if params.get(key) is None:
      raise ValueError(f"rope type 'llama3' needs {key!r} in rope_scaling")
  scaling = Llama3RopeScaling(
    factor=config_float(params, "factor"),
    low_freq_factor=config_float(params, "low_freq_factor"),
    high_freq_factor=config_float(params, "high_freq_factor"),
    original_max_position_embeddings=config_int(params, "original_max_position_embeddings"),
  )
  return theta, scaling


#: Mixture-of-experts families -> the dense family whose attention they share.
MOE_BASE_FAMILIES = {"qwen3_moe": "qwen3", "mixtral": "mistral"}


def config_from_hf(hf: Mapping[str, Any], family: str) -> LlamaConfig:
  """Translates a Hugging Face ``config.json`` of one Llama-family architecture.

  Reads ``vocab_size``, ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``,
  ``num_attention_heads``, ``num_key_value_heads`` (default: the attention heads), ``head_dim``
  (default ``hidden_size / num_attention_heads``), ``rms_norm_eps``, ``rope_theta`` or
  ``rope_parameters``, ``rope_scaling`` (type ``llama3``), ``max_position_embeddings``,
  ``tie_word_embeddings`` (default False, as transformers' classes of these families),
  ``bos_token_id``/``eos_token_id`` (the first of a list), and per family: ``attention_bias``
  (Llama, Qwen3), q/k/v biases (Qwen2), q/k norms (Qwen3), ``sliding_window`` (Mistral).

  The mixture-of-experts families read their base family's fields (``"qwen3_moe"``: Qwen3's,
  ``"mixtral"``: Mistral's) and `moe_fields_from_hf`.

  Args:
    hf: the parsed ``config.json``.
    family: ``"llama"``, ``"mistral"``, ``"qwen2"``, ``"qwen3"``, ``"qwen3_moe"`` or
      ``"mixtral"`` (the registry entry's).

  Raises:
    ValueError: naming the field and value for an unsupported rope type, activation, MLP bias,
      partial rotary embedding or per-layer sliding window, a missing required field (or
      mixture-of-experts field, see `moe_fields_from_hf`), or a field of the wrong JSON type
      (``"hidden_size": "576"``, ``"num_hidden_layers": null``: `models/hf_config_fields.py`).
  """
  if family in MOE_BASE_FAMILIES:
    dense = config_from_hf(hf, MOE_BASE_FAMILIES[family])
    return dataclasses.replace(dense, **moe_fields_from_hf(hf, family, dense.num_hidden_layers))
  activation = hf.get("hidden_act", "silu")
  if activation != "silu":
    raise ValueError(f"unsupported hidden_act {activation!r}; only 'silu' (SwiGLU) is implemented")
  if hf.get("mlp_bias"):
    raise ValueError("mlp_bias=True is not supported")
  if hf.get("partial_rotary_factor", 1.0) != 1.0:
    raise ValueError(f"partial_rotary_factor={hf['partial_rotary_factor']} is not supported")
  if family in ("qwen2", "qwen3") and hf.get("use_sliding_window"):
    raise ValueError(
      f"use_sliding_window=True (sliding-window attention on some layers of {family}) is "
      "not supported"
    )
  layer_types = hf.get("layer_types") or []
  if any(t != "full_attention" for t in layer_types):
    raise ValueError(f"layer_types {sorted(set(layer_types))} are not supported (full_attention)")
  rope_theta, rope_scaling = _rope(hf)
  hidden_size = config_int(hf, "hidden_size")
  num_heads = config_int(hf, "num_attention_heads")
  if num_heads <= 0:
    raise ValueError(f"config.json field 'num_attention_heads' must be positive, got {num_heads}")
  attention_bias = config_bool(hf, "attention_bias", False)
  sliding_window = config_optional_int(hf, "sliding_window") if family == "mistral" else None
  return LlamaConfig(
    vocab_size=config_int(hf, "vocab_size"),
    hidden_size=hidden_size,
    intermediate_size=config_int(hf, "intermediate_size"),
    num_hidden_layers=config_int(hf, "num_hidden_layers"),
    num_attention_heads=num_heads,
    num_key_value_heads=config_int(hf, "num_key_value_heads", num_heads),
    head_dim=config_int(hf, "head_dim", hidden_size // num_heads),
    rope_theta=rope_theta,
    rope_scaling=rope_scaling,
    rms_norm_eps=config_float(hf, "rms_norm_eps", 1e-6),
    tie_word_embeddings=config_bool(hf, "tie_word_embeddings", False),
    max_position_embeddings=config_int(hf, "max_position_embeddings", 2048),
    bos_token_id=config_token_id(hf, "bos_token_id"),
    eos_token_id=config_token_id(hf, "eos_token_id"),
    # Qwen2 always has q/k/v biases and no output bias; Llama and Qwen3 use one switch for all.
    attention_bias=family == "qwen2" or (family != "mistral" and attention_bias),
    attention_output_bias=family in ("llama", "qwen3") and attention_bias,
    qk_norm=family == "qwen3",
    sliding_window=sliding_window or None,
  )


def moe_fields_from_hf(hf: Mapping[str, Any], family: str, num_layers: int) -> dict[str, Any]:
  """The `LlamaConfig` mixture-of-experts fields of a Qwen3-MoE or Mixtral ``config.json``.

  Qwen3-MoE: ``num_experts`` (transformers 5 writes ``num_local_experts``),
  ``num_experts_per_tok``, ``moe_intermediate_size``, ``norm_topk_prob`` (default False), and
  which layers are sparse: layer ``i`` unless it is in ``mlp_only_layers`` or ``(i + 1)`` is not
  a multiple of ``decoder_sparse_step`` (default 1). Mixtral: ``num_local_experts``,
  ``num_experts_per_tok``, every layer sparse with experts of ``intermediate_size``, weights
  always renormalised.

  Raises:
    ValueError: a missing field or one of the wrong type, or a ``decoder_sparse_step`` below 1
      (named).
  """
  experts_key = "num_experts" if hf.get("num_experts") else "num_local_experts"
  fields: dict[str, Any] = dict(
    num_experts=config_int(hf, experts_key),
    num_experts_per_tok=config_int(hf, "num_experts_per_tok"),
  )
  if family == "mixtral":
    fields.update(
      moe_intermediate_size=config_int(hf, "intermediate_size"),
      norm_topk_prob=True,
      moe_layers=tuple(range(num_layers)),
      moe_checkpoint_names="mixtral",
    )
    return fields
  fields["moe_intermediate_size"] = config_int(hf, "moe_intermediate_size")
  step = config_int(hf, "decoder_sparse_step", 1)
  if step < 1:
    raise ValueError(f"decoder_sparse_step must be >= 1, got {step}")
  dense_only = {int(i) for i in hf.get("mlp_only_layers") or []}
  sparse = [i for i in range(num_layers) if i not in dense_only and (i + 1) % step == 0]
  fields.update(
    norm_topk_prob=config_bool(hf, "norm_topk_prob", False),
    moe_layers=tuple(sparse) if fields["num_experts"] > 0 else (),
    moe_checkpoint_names="qwen3_moe",
  )
  return fields


#: Checkpoint names of a sparse block by ``moe_checkpoint_names``: (block prefix, expert gate,
#: up and down projection names).
_MOE_NAMES = {
  "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
  "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
}


def moe_weight_specs(cfg: LlamaConfig, layer: int) -> list[WeightSpec]:
  """The specs of layer `layer`'s `jaxengine.models.moe.SparseMoeBlock`.

  The router ``{block}.gate.weight`` ``(X, E)`` fills ``mlp/router``; each expert ``j``'s
  ``{block}.experts.{j}.{gate}.weight`` ``(F, E)``, ``{up}`` ``(F, E)`` and ``{down}``
  ``(E, F)`` fill row ``j`` (`WeightSpec.layer`) of the stacked ``mlp/expert_gate``,
  ``expert_up`` and ``expert_down`` leaves, transposed (`WeightSpec.transpose`) into their
  ``[X, in, out]`` layout, the one the grouped matmul reads in place. Qwen3-MoE names the
  block ``mlp`` and the projections ``gate_proj``/``up_proj``/``down_proj``; Mixtral
  ``block_sparse_moe`` and ``w1``/``w3``/``w2``.
  """
  e, f = cfg.hidden_size, cfg.moe_intermediate_size
  block, gate, up, down = _MOE_NAMES[cfg.moe_checkpoint_names]
  prefix, path = f"model.layers.{layer}.{block}", ("layers", layer, "mlp")
  specs = [WeightSpec(f"{prefix}.gate.weight", (*path, "router"), None, (cfg.num_experts, e))]
  for j in range(cfg.num_experts):
    specs += [
      WeightSpec(f"{prefix}.experts.{j}.{gate}.weight", (*path, "expert_gate"), j, (f, e), True),
      WeightSpec(f"{prefix}.experts.{j}.{up}.weight", (*path, "expert_up"), j, (f, e), True),
      WeightSpec(f"{prefix}.experts.{j}.{down}.weight", (*path, "expert_down"), j, (e, f), True),
    ]
  return specs


def hf_weight_specs(cfg: LlamaConfig) -> list[WeightSpec]:
  """Every parameter under its Hugging Face checkpoint name (one spec per layer and matrix).

  PyTorch ``nn.Linear`` weights are ``(out, in)``, the model's layout too: they are taken as
  they are, the query/key/value/output matrices reshaped per head. Names:
  ``model.embed_tokens.weight``, ``model.norm.weight``, ``lm_head.weight`` (accepted and ignored
  when the embeddings are tied, as Hugging Face does), and per layer ``i`` under
  ``model.layers.{i}.``: ``input_layernorm.weight``, ``post_attention_layernorm.weight``,
  ``self_attn.{q,k,v,o}_proj.weight`` (and ``.bias`` with ``attention_bias`` /
  ``attention_output_bias``), ``self_attn.{q,k}_norm.weight`` (``qk_norm``), and
  ``mlp.{gate,up,down}_proj.weight`` (on the layers of ``moe_layers``: the sparse block's names,
  `moe_weight_specs`).
  """
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
  ]
  dense_mlp: list[tuple[str, tuple[str, ...], tuple[int, ...]]] = [
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
    sparse = i in cfg.moe_layers
    specs += [
      WeightSpec(f"model.layers.{i}.{suffix}", ("layers", i, *path), None, shape)
      for suffix, path, shape in per_layer + ([] if sparse else dense_mlp)
    ]
    if sparse:
      specs += moe_weight_specs(cfg, i)
  return stacked_weight_specs(specs) if cfg.scan_layers else specs  # rows of [L, ...] leaves


def config_from_gguf(
  metadata: Mapping[str, Any], tensor_shapes: Mapping[str, tuple[int, ...]]
) -> LlamaConfig:
  """Reads a `LlamaConfig` from the metadata of a ``general.architecture == "llama"`` GGUF file.

  Uses ``llama.*`` keys (block_count, embedding_length, feed_forward_length, attention.head_count,
  attention.head_count_kv, attention.key_length, rope.freq_base, attention.layer_norm_rms_epsilon,
  context_length), the tokenizer's BOS/EOS ids, the embedding's row count as the vocabulary size
  and the presence of ``output.weight`` for untied output projections.

  Args:
    metadata: the file's metadata values by key.
    tensor_shapes: each tensor's shape in NumPy (slowest-first) order, by name.

  Raises:
    ValueError: features this model lacks (rope scaling, a rotary dimension other than
      head_dim, mixture-of-experts layers: ``llama.expert_count``).
  """
  experts = metadata.get("llama.expert_count")
  if experts:
    raise ValueError(
      f"GGUF mixture-of-experts models (llama.expert_count={experts}) are not supported; load "
      "the Hugging Face checkpoint (MixtralForCausalLM) instead"
    )
  if "rope_freqs.weight" in tensor_shapes or metadata.get("llama.rope.scaling.type") not in (
    None,
    "none",
  ):
    raise ValueError("GGUF rope scaling (Llama 3.1 style) is not implemented")
  hidden_size = int(metadata["llama.embedding_length"])
  num_heads = int(metadata["llama.attention.head_count"])
  head_dim = int(metadata.get("llama.attention.key_length", hidden_size // num_heads))
  rope_dim = int(metadata.get("llama.rope.dimension_count", head_dim))
  if rope_dim != head_dim:
    raise ValueError(f"partial rotary embeddings (rope dim {rope_dim} != head_dim {head_dim})")
  return LlamaConfig(
    vocab_size=int(tensor_shapes["token_embd.weight"][0]),
    hidden_size=hidden_size,
    intermediate_size=int(metadata["llama.feed_forward_length"]),
    num_hidden_layers=int(metadata["llama.block_count"]),
    num_attention_heads=num_heads,
    num_key_value_heads=int(metadata.get("llama.attention.head_count_kv", num_heads)),
    head_dim=head_dim,
    rope_theta=float(metadata.get("llama.rope.freq_base", 10000.0)),
    rms_norm_eps=float(metadata.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
    tie_word_embeddings="output.weight" not in tensor_shapes,
    max_position_embeddings=int(metadata.get("llama.context_length", 2048)),
    bos_token_id=int(metadata.get("tokenizer.ggml.bos_token_id", 1)),
    eos_token_id=int(metadata.get("tokenizer.ggml.eos_token_id", 2)),
  )


def gguf_weight_specs(cfg: LlamaConfig) -> list[WeightSpec]:
  """Every parameter under its GGUF tensor name, shapes in NumPy (slowest-first) order.

  GGUF matrices are ``(out, in)`` like the model's; ``attn_q`` and ``attn_k`` store each head's
  rows with rotary pairs interleaved (``rotary_heads``), which the loader puts back.
  """
  e, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
  h, k, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
  specs = [
    WeightSpec("token_embd.weight", ("embed",), None, (v, e)),
    WeightSpec("output_norm.weight", ("final_norm", "scale"), None, (e,)),
  ]
  if not cfg.tie_word_embeddings:
    specs.append(WeightSpec("output.weight", ("lm_head",), None, (v, e)))
  per_layer: list[tuple[str, tuple[str, ...], tuple[int, ...], int | None]] = [
    ("attn_norm.weight", ("input_norm", "scale"), (e,), None),
    ("attn_q.weight", ("attn", "wq"), (h * d, e), h),
    ("attn_k.weight", ("attn", "wk"), (k * d, e), k),
    ("attn_v.weight", ("attn", "wv"), (k * d, e), None),
    ("attn_output.weight", ("attn", "wo"), (e, h * d), None),
    ("ffn_norm.weight", ("post_attention_norm", "scale"), (e,), None),
    ("ffn_gate.weight", ("mlp", "w_gate"), (f, e), None),
    ("ffn_up.weight", ("mlp", "w_up"), (f, e), None),
    ("ffn_down.weight", ("mlp", "w_down"), (e, f), None),
  ]
  for i in range(cfg.num_hidden_layers):
    specs += [
      WeightSpec(f"blk.{i}.{suffix}", ("layers", i, *path), None, shape, rotary_heads=heads)
      for suffix, path, shape, heads in per_layer
    ]
  return stacked_weight_specs(specs) if cfg.scan_layers else specs  # rows of [L, ...] leaves
