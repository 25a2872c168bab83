"""The model registry: an architecture name -> how to read, build, load and shard that model.

An entry (`ModelArchitecture`) holds everything the loaders and `jaxengine.parallel` need:

- ``read_config``: the checkpoint's configuration -> the module's config (a Hugging Face
  ``config.json`` dict; or, for GGUF, the metadata values and the tensors' shapes);
- ``module``: the Flax NNX class, built as ``module(config, dtype=..., rngs=...)``;
- ``weight_specs``: the config -> the checkpoint's tensor names, each with the module leaf it
  fills and its layout (`jaxengine.models.weights.WeightSpec`);
- ``sharding_rules``: parameter name (the last name of a leaf's path) -> sharding role. Roles say
  what a matrix does, not what it is called: `COLUMN_PARALLEL` (its output features are split:
  the first dimension of an ``[out, ...]`` matrix, and of its bias), `ROW_PARALLEL` (its input
  features are split: the dimension after a single output dimension; the partial results are
  summed), `VOCAB_PARALLEL` (the rows of a ``[V, E]`` embedding or output projection),
  `REPLICATED` (the default for any name not listed), and for the ``[X, in, out]`` stacks of a
  mixture-of-experts block `EXPERT_COLUMN_PARALLEL` / `EXPERT_ROW_PARALLEL` (each expert split
  on its ``out`` / ``in`` features; all on the experts axis with expert parallelism).
  `jaxengine.parallel` turns roles into partition specs.

Hugging Face names are ``config.json``'s ``architectures[0]`` (``LlamaForCausalLM``); GGUF names
are ``general.architecture`` (``llama``). Adding a model family is one module (its NNX class and
its checkpoint maps) and one entry per architecture name in `HF_ARCHITECTURES` /
`GGUF_ARCHITECTURES`; nothing in the loaders, `parallel` or the engine changes.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jaxengine.models import (
  gemma4_checkpoints,
  gemma_checkpoints,
  llama_checkpoints,
  qwen3_5_checkpoints,
)
from jaxengine.models.gemma import Gemma
from jaxengine.models.gemma4 import Gemma4
from jaxengine.models.llama import Llama
from jaxengine.models.qwen3_5 import Qwen3_5
from jaxengine.models.weights import WeightSpec

__all__ = [
  "COLUMN_PARALLEL",
  "EXPERT_COLUMN_PARALLEL",
  "EXPERT_ROW_PARALLEL",
  "GGUF_ARCHITECTURES",
  "HF_ARCHITECTURES",
  "REPLICATED",
  "ROLES",
  "ROW_PARALLEL",
  "VOCAB_PARALLEL",
  "ModelArchitecture",
  "gguf_architecture",
  "hf_architecture",
  "sharding_rules",
]

#: Output features split over the model axis (query/key/value projections, MLP gate and up).
COLUMN_PARALLEL = "column-parallel"
#: Input features split (attention output projection, MLP down projection).
ROW_PARALLEL = "row-parallel"
#: Vocabulary rows split (token embedding, output projection).
VOCAB_PARALLEL = "vocab-parallel"
#: Whole on every device (norms, output biases, anything not listed).
REPLICATED = "replicated"
#: ``[X, in, out]`` stacked experts, each split on its output features (expert gate and up).
EXPERT_COLUMN_PARALLEL = "expert-column-parallel"
#: ``[X, in, out]`` stacked experts, each split on its input features (expert down).
EXPERT_ROW_PARALLEL = "expert-row-parallel"
ROLES = (
  COLUMN_PARALLEL,
  ROW_PARALLEL,
  VOCAB_PARALLEL,
  REPLICATED,
  EXPERT_COLUMN_PARALLEL,
  EXPERT_ROW_PARALLEL,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelArchitecture:
  """One architecture the loaders can build (see the module docstring for each field).

  Attributes:
    name: the architecture's name in its checkpoint format.
    module: the NNX class, called as ``module(config, dtype=dtype, rngs=rngs)``.
    read_config: Hugging Face: ``config.json`` dict -> config; GGUF: ``(metadata values by key,
      tensor shapes by name in NumPy order)`` -> config. Raises `ValueError` for what the module
      does not implement.
    weight_specs: config -> `WeightSpec`s, checkpoint tensor name -> leaf path and layout.
    sharding_rules: parameter name -> role (one of `ROLES`).
    ignored_prefixes: checkpoint tensors whose names start with one of these are left unread
      (a multimodal checkpoint's vision tower, when only its language model is built).
  """

  name: str
  module: type
  read_config: Callable[..., Any]
  weight_specs: Callable[[Any], Sequence[WeightSpec]]
  sharding_rules: Mapping[str, str]
  ignored_prefixes: tuple[str, ...] = ()


#: Megatron-style tensor parallelism of the Llama family (Shoeybi et al., 2019); experts of the
#: mixture-of-experts layers split within each expert, the router replicated.
LLAMA_SHARDING_RULES: Mapping[str, str] = {
  **dict.fromkeys(("wq", "wk", "wv", "bq", "bk", "bv", "w_gate", "w_up"), COLUMN_PARALLEL),
  **dict.fromkeys(("wo", "w_down"), ROW_PARALLEL),
  **dict.fromkeys(("embed", "lm_head"), VOCAB_PARALLEL),
  **dict.fromkeys(("expert_gate", "expert_up"), EXPERT_COLUMN_PARALLEL),
  "expert_down": EXPERT_ROW_PARALLEL,
}


def _llama_hf(name: str, family: str) -> ModelArchitecture:
  return ModelArchitecture(
    name=name,
    module=Llama,
    read_config=functools.partial(llama_checkpoints.config_from_hf, family=family),
    weight_specs=llama_checkpoints.hf_weight_specs,
    sharding_rules=LLAMA_SHARDING_RULES,
  )


#: Gemma's parameters carry Llama's names (its extra norms and q/k norms are replicated).
GEMMA_SHARDING_RULES = LLAMA_SHARDING_RULES


def _gemma_hf(name: str, family: str) -> ModelArchitecture:
  return ModelArchitecture(
    name=name,
    module=Gemma,
    read_config=functools.partial(gemma_checkpoints.config_from_hf, family=family),
    weight_specs=gemma_checkpoints.hf_weight_specs,
    sharding_rules=GEMMA_SHARDING_RULES,
    ignored_prefixes=gemma_checkpoints.IGNORED_PREFIXES if family == "gemma3_multimodal" else (),
  )


#: Gemma 4: Gemma's names, and its fused expert gate/up stack split per expert like Llama's
#: experts (the per-layer input tables and projections are replicated).
GEMMA4_SHARDING_RULES: Mapping[str, str] = {
  **GEMMA_SHARDING_RULES,
  "expert_gate_up": EXPERT_COLUMN_PARALLEL,
}


def _gemma4_hf(name: str, family: str) -> ModelArchitecture:
  multimodal = family == "gemma4_multimodal"
  return ModelArchitecture(
    name=name,
    module=Gemma4,
    read_config=functools.partial(gemma4_checkpoints.config_from_hf, family=family),
    weight_specs=gemma4_checkpoints.hf_weight_specs,
    sharding_rules=GEMMA4_SHARDING_RULES,
    ignored_prefixes=gemma4_checkpoints.IGNORED_PREFIXES if multimodal else (),
  )


#: Qwen3.5: Llama's names for the gated attention and the MLPs (the query projection's rows are
#: ``[H, 2D]``, each head's query and gate together, so a row split is a head split); a Gated
#: DeltaNet layer split by heads: its input projections, convolution taps and per-head decay
#: parameters column-parallel (``w_qkv`` and ``conv``'s channels grouped by key head,
#: `jaxengine.models.gated_deltanet`), ``w_out`` row-parallel. The shared expert's gate, the
#: router and the norms are replicated.
QWEN3_5_SHARDING_RULES: Mapping[str, str] = {
  **LLAMA_SHARDING_RULES,
  **dict.fromkeys(("w_qkv", "w_z", "w_b", "w_a", "conv", "a_log", "dt_bias"), COLUMN_PARALLEL),
  "w_out": ROW_PARALLEL,
}


def _qwen3_5_hf(name: str, family: str) -> ModelArchitecture:
  return ModelArchitecture(
    name=name,
    module=Qwen3_5,
    read_config=functools.partial(qwen3_5_checkpoints.config_from_hf, family=family),
    weight_specs=qwen3_5_checkpoints.hf_weight_specs,
    sharding_rules=QWEN3_5_SHARDING_RULES,
    ignored_prefixes=qwen3_5_checkpoints.IGNORED_PREFIXES,
  )


#: ``config.json`` ``architectures[0]`` -> entry. The Llama relatives, mixture-of-experts ones
#: included, share one module; their config readers differ by family switches (see
#: `jaxengine.models.llama`). Gemma 2 and 3 share
#: `jaxengine.models.gemma.Gemma` (a ``Gemma3ForConditionalGeneration`` checkpoint loads its
#: language model; the vision tower is not read).
HF_ARCHITECTURES: Mapping[str, ModelArchitecture] = {
  "LlamaForCausalLM": _llama_hf("LlamaForCausalLM", "llama"),
  "MistralForCausalLM": _llama_hf("MistralForCausalLM", "mistral"),
  "Qwen2ForCausalLM": _llama_hf("Qwen2ForCausalLM", "qwen2"),
  "Qwen3ForCausalLM": _llama_hf("Qwen3ForCausalLM", "qwen3"),
  "Qwen3MoeForCausalLM": _llama_hf("Qwen3MoeForCausalLM", "qwen3_moe"),
  "MixtralForCausalLM": _llama_hf("MixtralForCausalLM", "mixtral"),
  "Gemma2ForCausalLM": _gemma_hf("Gemma2ForCausalLM", "gemma2"),
  "Gemma3ForCausalLM": _gemma_hf("Gemma3ForCausalLM", "gemma3"),
  "Gemma3ForConditionalGeneration": _gemma_hf(
    "Gemma3ForConditionalGeneration", "gemma3_multimodal"
  ),
  # Gemma 4 (`jaxengine.models.gemma4`): the text decoder; a ForConditionalGeneration
  # checkpoint's vision and audio towers are not read.
  "Gemma4ForCausalLM": _gemma4_hf("Gemma4ForCausalLM", "gemma4_text"),
  "Gemma4ForConditionalGeneration": _gemma4_hf(
    "Gemma4ForConditionalGeneration", "gemma4_multimodal"
  ),
  # Qwen3.5 hybrids (Gated DeltaNet and gated attention, `jaxengine.models.qwen3_5`); the
  # image-text checkpoint loads its text decoder (the vision tower is not read).
  "Qwen3_5ForCausalLM": _qwen3_5_hf("Qwen3_5ForCausalLM", "qwen3_5"),
  "Qwen3_5ForConditionalGeneration": _qwen3_5_hf(
    "Qwen3_5ForConditionalGeneration", "qwen3_5_multimodal"
  ),
  "Qwen3_5MoeForCausalLM": _qwen3_5_hf("Qwen3_5MoeForCausalLM", "qwen3_5_moe"),
  "Qwen3_5MoeForConditionalGeneration": _qwen3_5_hf(
    "Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe_multimodal"
  ),
}

#: GGUF ``general.architecture`` -> entry.
GGUF_ARCHITECTURES: Mapping[str, ModelArchitecture] = {
  "llama": ModelArchitecture(
    name="llama",
    module=Llama,
    read_config=llama_checkpoints.config_from_gguf,
    weight_specs=llama_checkpoints.gguf_weight_specs,
    sharding_rules=LLAMA_SHARDING_RULES,
  ),
}

#: A Hugging Face config without ``architectures`` is known by its ``model_type``.
_HF_MODEL_TYPES = {
  "llama": "LlamaForCausalLM",
  "mistral": "MistralForCausalLM",
  "qwen2": "Qwen2ForCausalLM",
  "qwen3": "Qwen3ForCausalLM",
  "qwen3_moe": "Qwen3MoeForCausalLM",
  "mixtral": "MixtralForCausalLM",
  "gemma2": "Gemma2ForCausalLM",
  "gemma3_text": "Gemma3ForCausalLM",
  "gemma3": "Gemma3ForConditionalGeneration",
  "gemma4_text": "Gemma4ForCausalLM",
  "gemma4": "Gemma4ForConditionalGeneration",
  "qwen3_5_text": "Qwen3_5ForCausalLM",
  "qwen3_5": "Qwen3_5ForConditionalGeneration",
  "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
  "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
}


def _lookup(table: Mapping[str, ModelArchitecture], name: Any, what: str) -> ModelArchitecture:
  entry = table.get(name) if isinstance(name, str) else None
  if entry is None:
    raise ValueError(f"unsupported {what} {name!r}; supported: {', '.join(table)}")
  return entry


def hf_architecture(hf_config: Mapping[str, Any]) -> ModelArchitecture:
  """The entry of a Hugging Face ``config.json``: its ``architectures[0]``, else ``model_type``.

  Raises:
    ValueError: an architecture the registry does not know, naming the ones it knows.
  """
  architectures = hf_config.get("architectures") or []
  if architectures:
    return _lookup(HF_ARCHITECTURES, architectures[0], "architecture")
  model_type = hf_config.get("model_type")
  if model_type is None:
    raise ValueError(
      "config.json has neither 'architectures' nor 'model_type', so its architecture is "
      f"unknown; supported architectures: {', '.join(HF_ARCHITECTURES)}"
    )
  name = _HF_MODEL_TYPES.get(model_type) if isinstance(model_type, str) else None
  if name is None:
    return _lookup(HF_ARCHITECTURES, f"model_type={model_type!r}", "architecture")
  return HF_ARCHITECTURES[name]


def gguf_architecture(name: Any) -> ModelArchitecture:
  """The entry of a GGUF ``general.architecture``.

  Raises:
    ValueError: an architecture the registry does not know, naming the ones it knows.
  """
  return _lookup(GGUF_ARCHITECTURES, name, "GGUF architecture")


def sharding_rules(model: Any) -> Mapping[str, str]:
  """The parameter-name -> role rules of `model` on a mesh.

  The model's own ``sharding_rules`` attribute when it has one, else the rules of the registry
  entry whose module is the model's class, else none (every weight replicated).

  Raises:
    ValueError: a rule names a role outside `ROLES` (the parameter and role named).
  """
  rules = getattr(model, "sharding_rules", None)
  if rules is None:
    entries = (*HF_ARCHITECTURES.values(), *GGUF_ARCHITECTURES.values())
    rules = next((e.sharding_rules for e in entries if type(model) is e.module), {})
  for name, role in rules.items():
    if role not in ROLES:
      raise ValueError(f"sharding rule for {name!r}: role {role!r} is not one of {ROLES}")
  return rules
