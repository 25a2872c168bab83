"""Gemma 4's text decoder against transformers' own models.

Two tiny random checkpoints saved by transformers, float32:

- ``"all"``, a ``Gemma4ForCausalLM`` with every feature on: local layers (window 4, heads of 16,
  two key/value heads) and global ones (heads of 32, one key/value head shared by keys and values,
  ``attention_k_eq_v``, proportional rope rotating a quarter of the pairs), per-layer inputs, the
  last two layers KV-shared (one local, one global) with double-wide MLPs, the MoE block beside
  every dense MLP, soft-capped logits;
- ``"multimodal"``, a ``Gemma4ForConditionalGeneration`` (a vision tower whose tensors are left
  unread) whose text model has none of those: equal head widths, its own keys and values on
  every layer, no per-layer inputs, no experts.

Prompts of 11 and 9 tokens, so the window, both ropes and the shared layers change the result.
`LLM(dir)` must give transformers' greedy tokens and its prompt logprobs within 1e-4.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from hf_reference import hf_greedy, hf_prompt_logprobs, random_peft_adapter
from step_shapes import one_shape
from subprocess_utils import run_python

import jaxengine as je
from jaxengine.models.gemma4 import Gemma4
from jaxengine.models.gemma4_checkpoints import config_from_hf
from jaxengine.models.safetensors_loader import load_safetensors

SLIDING, FULL = "sliding_attention", "full_attention"
ALL = dict(
  vocab_size=96,
  hidden_size=32,
  intermediate_size=48,
  num_hidden_layers=5,
  num_attention_heads=4,
  num_key_value_heads=2,
  head_dim=16,
  global_head_dim=32,
  num_global_key_value_heads=1,
  attention_k_eq_v=True,
  max_position_embeddings=64,
  sliding_window=4,
  layer_types=[SLIDING, FULL, SLIDING, SLIDING, FULL],
  vocab_size_per_layer_input=96,
  hidden_size_per_layer_input=8,
  num_kv_shared_layers=2,
  enable_moe_block=True,
  num_experts=4,
  top_k_experts=2,
  moe_intermediate_size=16,
  use_double_wide_mlp=True,
  final_logit_softcapping=3.0,
  rope_parameters={
    SLIDING: {"rope_type": "default", "rope_theta": 50.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 500.0},
  },
)
PLAIN = dict(
  ALL,
  global_head_dim=16,
  num_global_key_value_heads=None,
  attention_k_eq_v=False,
  num_hidden_layers=3,
  layer_types=[SLIDING, FULL, FULL],
  hidden_size_per_layer_input=0,
  num_kv_shared_layers=0,
  enable_moe_block=False,
  use_double_wide_mlp=False,
  final_logit_softcapping=None,
)
VISION = dict(
  hidden_size=16,
  intermediate_size=32,
  num_hidden_layers=1,
  num_attention_heads=2,
  num_key_value_heads=2,
  head_dim=8,
  patch_size=4,
  position_embedding_size=64,
)
CASES = {
  "all": lambda: transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**ALL)),
  "multimodal": lambda: transformers.Gemma4ForConditionalGeneration(
    transformers.Gemma4Config(text_config=dict(PLAIN), vision_config=VISION)
  ),
}
PROMPTS = [[5, 17, 90, 3, 64, 21, 8, 77, 33, 7, 41], [2, 9, 60, 11, 4, 4, 31, 85, 12]]
MAX_TOKENS = 6


def _randomise(model: torch.nn.Module, seed: int) -> None:
  """Matrices of std ``fan_in ** -0.5``; norm weights, scales and ``layer_scalar`` (a buffer)
  ``1 + 0.3 n``, so that every tensor shows."""
  generator = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    tensors = [p for _, p in model.named_parameters()]
    tensors += [b for name, b in model.named_buffers() if name.endswith("layer_scalar")]
    for tensor in tensors:
      noise = torch.randn(tensor.shape, generator=generator)
      tensor.copy_(1.0 + 0.3 * noise if tensor.ndim == 1 else noise * tensor.shape[-1] ** -0.5)


def _write(directory: Path, case: str, seed: int = 0) -> torch.nn.Module:
  torch.manual_seed(seed)
  model = CASES[case]().eval()
  model.set_attn_implementation("eager")
  _randomise(model, seed)
  model.save_pretrained(directory)
  return model


@pytest.fixture(scope="module")
def all_checkpoint(tmp_path_factory):
  directory = tmp_path_factory.mktemp("all")
  return "all", directory, _write(directory, "all")


@pytest.fixture(scope="module")
def multimodal_checkpoint(tmp_path_factory):
  directory = tmp_path_factory.mktemp("multimodal")
  return "multimodal", directory, _write(directory, "multimodal")


@pytest.fixture(params=list(CASES))
def checkpoint(request):
  return request.getfixturevalue(f"{request.param}_checkpoint")


@pytest.fixture(scope="module")
def hf_outputs():
  """transformers' greedy tokens and prompt logprobs of each prompt, computed once per model
  (keyed by the checkpoint's case): `hf_outputs(checkpoint)` gives a list, per prompt, of
  ``(tokens, logprobs)``."""
  done = {}

  def outputs(checkpoint):
    case, _, model = checkpoint
    if case not in done:
      done[case] = [
        (hf_greedy(model, prompt, MAX_TOKENS), hf_prompt_logprobs(model, prompt))
        for prompt in PROMPTS
      ]
    return done[case]

  return outputs


def test_llm_matches_transformers_greedy_and_prompt_logprobs(checkpoint, hf_outputs):
  """Chunked prefill (8 tokens a step: the 11-token prompt in two chunks, the KV-shared layers
  reading the first chunk's pages in the second) and decode over KV cache groups whose window
  group frees its pages: transformers' greedy tokens and prompt logprobs. The steps run in their
  largest shape (`one_shape`: what they compute against transformers is the point here)."""
  _, directory, _ = checkpoint
  llm = one_shape(
    je.LLM(directory, max_num_reqs=2, max_model_len=32, block_size=4, max_num_batched_tokens=8)
  )
  params = je.SamplingParams(
    temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, prompt_logprobs=0
  )
  outputs = llm.generate(PROMPTS, params, use_tqdm=False)
  worst = 0.0
  for prompt, output, (tokens, want) in zip(PROMPTS, outputs, hf_outputs(checkpoint)):
    assert list(output.outputs[0].token_ids) == tokens
    got = [entry[token].logprob for entry, token in zip(output.prompt_logprobs[1:], prompt[1:])]
    worst = max(worst, float(np.abs(np.asarray(got) - want).max()))
  assert worst < 1e-4, worst


def _read_config(directory: Path, family: str):
  return config_from_hf(json.loads((directory / "config.json").read_text()), family)


def test_config_and_cache_layout_read_from_each_checkpoint(all_checkpoint, multimodal_checkpoint):
  """Every switch of the "all" checkpoint is read; only its first three layers own pages
  (layer 3 reads layer 2's, layer 4 layer 1's), pages of 2 heads of 32 (the widest layer's
  width, the most heads); the multimodal one's text model sits under its prefix."""
  cfg = _read_config(all_checkpoint[1], "gemma4_text")
  assert [cfg.layer_head_dim(i) for i in range(5)] == [16, 32, 16, 16, 32]
  assert [cfg.kv_heads(i) for i in range(5)] == [2, 1, 2, 2, 1]
  assert [cfg.kv_source(i) for i in range(5)] == [0, 1, 2, 2, 1]
  assert [cfg.mlp_size(i) for i in range(5)] == [48, 48, 48, 96, 96]
  assert cfg.rope_global.partial_rotary_factor == 0.25 and cfg.rope_global.theta == 500.0
  assert cfg.rope_local.theta == 50.0 and cfg.rope_local.partial_rotary_factor == 1.0
  assert cfg.enable_moe_block and (cfg.num_experts, cfg.top_k_experts) == (4, 2)
  assert cfg.hidden_size_per_layer_input == 8 and cfg.final_logit_softcapping == 3.0
  assert cfg.checkpoint_prefix == "model."
  spec = cfg.kv_cache_spec()
  assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (3, 2, 32)
  assert spec.sliding_window == 4 and spec.sliding_window_layers == (0, 2)
  freqs = cfg.rope_global.frequencies(32)  # 4 of 16 pairs rotate
  assert np.count_nonzero(freqs) == 4 and freqs[0] == 1.0
  text = _read_config(multimodal_checkpoint[1], "gemma4_multimodal")
  assert text.checkpoint_prefix == "model.language_model."
  assert text.num_cache_layers == 3 and not text.enable_moe_block
  assert text.kv_cache_spec().head_dim == 16 and text.kv_cache_spec().num_kv_heads == 2


@pytest.mark.parametrize(
  "option, message",
  [
    (dict(enable_return_routed_experts=True), "enable_return_routed_experts=True needs"),
  ],
)
def test_unsupported_engine_options_are_refused(all_checkpoint, option, message):
  with pytest.raises(ValueError, match=message):
    je.LLM(all_checkpoint[1], max_num_reqs=1, max_model_len=16, **option)


@pytest.mark.parametrize(
  "fields, message",
  [
    (dict(use_bidirectional_attention="all"), "use_bidirectional_attention='all'"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(rope_parameters={FULL: {"rope_type": "yarn"}}), "rope type 'yarn'"),
    (dict(num_kv_shared_layers=5), "num_kv_shared_layers"),
    (dict(layer_types=[SLIDING, FULL, "chunked_attention", SLIDING, FULL]), "layer_types"),
    (dict(num_global_key_value_heads=3), "key/value heads"),
    (dict(top_k_experts=5), "top_k_experts=5 exceeds"),
  ],
)
def test_bad_configs_are_refused_naming_the_field(tmp_path, fields, message):
  config = json.loads(transformers.Gemma4TextConfig(**ALL).to_json_string())
  config.update(architectures=["Gemma4ForCausalLM"], **fields)
  (tmp_path / "config.json").write_text(json.dumps(config))  # and no weights at all
  with pytest.raises(ValueError, match=message):
    je.LLM(tmp_path)


def test_model_types_without_architectures_pick_the_gemma4_entries():
  from jaxengine.models.registry import hf_architecture

  assert hf_architecture({"model_type": "gemma4_text"}).name == "Gemma4ForCausalLM"
  assert hf_architecture({"model_type": "gemma4"}).name == "Gemma4ForConditionalGeneration"


def test_quantization_skips_the_projections_a_layer_lacks(all_checkpoint):
  """int8: every attention projection a layer has (not a KV-shared layer's keys and values,
  nor a global k_eq_v layer's values) and the dense MLPs are quantized."""
  from jaxengine.models.quantization import quantize_model

  model, _ = load_safetensors(all_checkpoint[1])
  assert isinstance(model, Gemma4)
  quantized = {".".join(map(str, path)) for path in quantize_model(model, "int8").leaves}
  assert {"layers.0.attn.wk", "layers.0.attn.wv", "layers.1.attn.wk", "layers.4.attn.wq"} <= (
    quantized
  )
  assert "layers.4.mlp.w_down" in quantized
  assert not {"layers.1.attn.wv", "layers.3.attn.wk", "layers.3.attn.wv"} & quantized


MESH_SCRIPT = """
import os, sys
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
import jaxengine as je
from step_shapes import one_shape
params = je.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=0)
prompts = [[5, 17, 90, 3, 64, 21, 8, 77, 33, 7, 41], [2, 9, 60, 11, 4, 4, 31, 85, 12]]
kw = dict(max_num_reqs=2, max_model_len=32, block_size=4, max_num_batched_tokens=8)
two = one_shape(je.LLM(sys.argv[1], tensor_parallel_size=2, scan_layers=True, **kw))
two = two.generate(prompts, params, use_tqdm=False)
for out in two:
  print(list(out.outputs[0].token_ids))
"""


def test_two_device_mesh_gives_transformers_tokens(all_checkpoint, hf_outputs):
  """Tensor parallelism over 2 devices (the pages' 2 heads split, the experts split per
  expert) with the layers scanned (``scan_layers=True``: a stack per kind, the layer axis
  unsplit), the steps in their largest shape: transformers' greedy tokens."""
  directory = all_checkpoint[1]
  out = run_python(MESH_SCRIPT, os.fspath(directory), timeout=900)
  got = [json.loads(line) for line in out.strip().splitlines()[-2:]]
  assert got == [tokens for tokens, _ in hf_outputs(all_checkpoint)]


def test_named_weights_give_back_the_checkpoint_tensors(all_checkpoint):
  """`named_weights` (what `LLM.load_weights` takes) returns every tensor the model read in the
  checkpoint's layout: the experts' ``(X, 2F, E)`` / ``(X, E, F)`` stacks transposed back."""
  from weight_checks import assert_named_weights_are_the_checkpoint

  model, _ = load_safetensors(all_checkpoint[1])
  assert_named_weights_are_the_checkpoint(model, all_checkpoint[1])


def test_lora_adapter_matches_transformers_with_peft(all_checkpoint, hf_outputs, tmp_path):
  """A PEFT adapter (rank 4; random non-zero ``lora_B``) on the seven projections of every
  layer that has them (wider global heads, ``attention_k_eq_v``'s missing ``v_proj``, the
  KV-shared layers' query and output only, the double-wide MLPs) and on the experts' fused
  ``gate_up_proj`` / ``down_proj``: transformers + peft's greedy tokens and prompt logprobs
  within 1e-4 for the adapter's request, transformers' for the base request of the same step
  (the steps in their largest shape)."""
  import peft

  from jaxengine.lora import load_peft_adapter

  directory = all_checkpoint[1]
  model = transformers.Gemma4ForCausalLM.from_pretrained(directory, attn_implementation="eager")
  config = peft.LoraConfig(
    r=4, lora_alpha=6, target_modules=list(LORA_TARGETS), lora_dropout=0.0,
    target_parameters=["experts.gate_up_proj", "experts.down_proj"],
  )  # fmt: skip
  adapted = random_peft_adapter(model, config, tmp_path / "adapter", seed=5)
  llm = one_shape(
    je.LLM(
      directory, max_num_reqs=2, max_model_len=32, block_size=4, enable_lora=True, max_lora_rank=4
    )
  )
  params = je.SamplingParams(
    temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, prompt_logprobs=0
  )
  lora = je.LoRARequest("adapter", 1, str(tmp_path / "adapter"))
  outputs = llm.generate(PROMPTS, params, lora_request=[lora, None], use_tqdm=False)
  base = hf_outputs(all_checkpoint)
  wants = [(hf_greedy(adapted, PROMPTS[0], MAX_TOKENS), hf_prompt_logprobs(adapted, PROMPTS[0]))]
  wants.append(base[1])
  for (tokens, logprobs), prompt, output in zip(wants, PROMPTS, outputs):
    assert list(output.outputs[0].token_ids) == tokens
    got = [entry[token].logprob for entry, token in zip(output.prompt_logprobs[1:], prompt[1:])]
    np.testing.assert_allclose(got, logprobs, atol=1e-4, rtol=0)
  assert np.abs(wants[0][1] - base[0][1]).max() > 1e-2
  manager = llm.llm_engine.runner.lora
  shapes = dict(max_lora_rank=4, num_layers=5, target_shapes=manager.target_shapes)
  pairs = load_peft_adapter(tmp_path / "adapter", 1, **shapes, layer_shapes=manager.layer_shapes)
  assert (1, "v_proj") not in pairs.weights and (4, "k_proj") not in pairs.weights
  assert pairs.weights[1, "q_proj"][1].shape == (4, 4 * 32)
  assert manager.target_shapes["q_proj"] == (32, 4 * 32)
  assert pairs.weights[0, "q_proj"][1].shape == (4, 4 * 16)
  assert pairs.weights[0, "experts.gate_proj"][0].shape == (4, 32, 4)


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
