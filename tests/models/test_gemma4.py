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


def _hf_prompt_logprobs(model, prompt) -> np.ndarray:
  """``[T - 1]`` transformers' log-probability of each prompt token after the first."""
  with torch.no_grad():
    logits = model(torch.tensor([prompt])).logits[0].double()
  logprobs = torch.log_softmax(logits, -1)
  return logprobs[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])].numpy()


def _hf_greedy(model, prompt, max_tokens: int = MAX_TOKENS) -> list[int]:
  with torch.no_grad():
    out = model.generate(
      torch.tensor([prompt]),
      attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
      max_new_tokens=max_tokens,
      do_sample=False,
      eos_token_id=None,
      pad_token_id=0,
    )
  return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
  directory = tmp_path_factory.mktemp(request.param)
  return request.param, directory, _write(directory, request.param)


def test_llm_matches_transformers_greedy_and_prompt_logprobs(checkpoint):
  _, directory, hf_model = checkpoint
  llm = je.LLM(directory, max_num_reqs=2, max_model_len=32, block_size=4)
  params = je.SamplingParams(
    temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, prompt_logprobs=0
  )
  outputs = llm.generate(PROMPTS, params, use_tqdm=False)
  worst = 0.0
  for prompt, output in zip(PROMPTS, outputs):
    assert list(output.outputs[0].token_ids) == _hf_greedy(hf_model, prompt)
    got = [entry[token].logprob for entry, token in zip(output.prompt_logprobs[1:], prompt[1:])]
    want = _hf_prompt_logprobs(hf_model, prompt)
    worst = max(worst, float(np.abs(np.asarray(got) - want).max()))
  assert worst < 1e-4, worst
