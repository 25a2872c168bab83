"""Gemma 2 and Gemma 3 configs: the released checkpoints' sparse ``config.json`` read with
transformers' defaults, fields the engine does not implement refused by name, the registry's
entries by ``model_type`` and a GPU backend that lacks the soft cap refused before device work.
The checkpoints against transformers are in tests/models/test_gemma.py.
"""

from __future__ import annotations

import json

import pytest
from flax import nnx
from test_gemma import CASES

import jaxengine as je
from jaxengine.models.gemma import Gemma
from jaxengine.models.gemma_checkpoints import config_from_hf


def _released_gemma3_4b_style(hf: dict) -> dict:
  """A transformers 4 ``config.json`` as the Gemma 3 checkpoints were released: a sparse
  ``text_config`` (defaults omitted), ``rope_theta``/``rope_local_base_freq``/``rope_scaling``
  and ``sliding_window_pattern`` instead of ``rope_parameters`` and ``layer_types``."""
  return {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "model_type": "gemma3",
    "eos_token_id": [1, 106],
    "text_config": {
      "model_type": "gemma3_text",
      "hidden_size": 2560,
      "intermediate_size": 10240,
      "num_hidden_layers": 34,
      "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
      "sliding_window": 1024,
    },
    "vision_config": hf.get("vision_config", {}),
  }


def test_released_config_style_takes_transformers_defaults():
  config = config_from_hf(_released_gemma3_4b_style({}), "gemma3_multimodal")
  assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (8, 4, 256)
  assert config.vocab_size == 262208 and config.query_pre_attn_scalar == 256
  assert config.layer_types[:6] == ("sliding_attention",) * 5 + ("full_attention",)
  assert config.layer_types.count("full_attention") == 5  # layers 5, 11, 17, 23, 29
  assert config.rope_global.theta == 1e6 and config.rope_global.factor == 8.0
  assert config.rope_local.theta == 10000.0 and config.rope_local.factor == 1.0
  assert config.eos_token_id == 1 and config.hidden_activation == "gelu_pytorch_tanh"
  gemma2 = config_from_hf({"model_type": "gemma2", "num_hidden_layers": 4}, "gemma2")
  assert gemma2.layer_types == ("sliding_attention", "full_attention") * 2
  assert gemma2.attn_logit_softcapping == 50.0 and gemma2.final_logit_softcapping == 30.0


@pytest.mark.parametrize(
  "fields, message",
  [
    (dict(hidden_activation="relu"), "hidden_activation 'relu'"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 2.0}), "rope type 'yarn'"),
    (dict(rope_parameters={"rope_type": "linear"}), "'linear' needs 'factor'"),
    (dict(layer_types=["chunked_attention"] * 3), "layer_types"),
    (dict(layer_types=["full_attention"]), "layer_types has 1 entries"),
    (dict(sliding_window=None), "sliding_window"),
    (dict(attn_logit_softcapping=-1.0), "attn_logit_softcapping"),
    (dict(query_pre_attn_scalar=0), "query_pre_attn_scalar"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
  ],
)
def test_bad_configs_are_refused_naming_the_field(tmp_path, fields, message):
  config = json.loads(CASES["gemma2"]().to_json_string())
  config.update(architectures=["Gemma2ForCausalLM"], **fields)
  (tmp_path / "config.json").write_text(json.dumps(config))  # and no weights at all
  with pytest.raises(ValueError, match=message):
    je.LLM(tmp_path)


def test_model_types_without_architectures_pick_the_gemma_entries():
  from jaxengine.models.registry import hf_architecture

  for model_type, name in [
    ("gemma2", "Gemma2ForCausalLM"),
    ("gemma3_text", "Gemma3ForCausalLM"),
    ("gemma3", "Gemma3ForConditionalGeneration"),
  ]:
    assert hf_architecture({"model_type": model_type}).name == name


def test_gpu_backend_refuses_the_soft_cap_before_device_work(tmp_path):
  config = json.loads(CASES["gemma2"]().to_json_string())
  config.update(architectures=["Gemma2ForCausalLM"], layer_types=["full_attention"] * 3)
  model = Gemma(config_from_hf(config, "gemma2"), rngs=nnx.Rngs(0))  # global layers only
  assert model.kv_cache_spec.sliding_window is None and model.kv_cache_spec.soft_cap == 2.0
  with pytest.raises(ValueError, match="'pallas_gpu' has no attention logit soft-capping"):
    je.LLM(model, attention_backend="pallas_gpu", max_model_len=32)
