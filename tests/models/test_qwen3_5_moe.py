"""Qwen3.5's other checkpoints against transformers: the image-text checkpoint's text decoder and
a tiny random ``Qwen3_5MoeForCausalLM`` (4 routed experts, 2 per token, and a gated shared
expert on every layer) through `token_logprobs`, a PEFT adapter on its experts, shared expert and
mixers in a LoRA engine, and its router's experts through ``enable_return_routed_experts``
(replayed through `token_logprobs`). The dense checkpoint's engines are in
tests/models/test_qwen3_5.py, whose model sizes, prompts and engine sizes these share.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from hf_reference import hf_greedy, hf_prompt_logprobs, random_peft_adapter
from step_shapes import one_shape
from test_qwen3_5 import (
  ENGINE,
  MAX_TOKENS,
  PROMPTS,
  TEXT,
  _greedy_with_prompt_logprobs,
  _padded,
  _randomise,
  _write,
)

import jaxengine as je
from jaxengine.models import token_logprobs
from jaxengine.models.qwen3_5 import Qwen3_5
from jaxengine.models.safetensors_loader import load_safetensors

pytestmark = pytest.mark.bitwise  # compares bits between programs: tests/conftest.py


def test_image_text_checkpoint_text_decoder_matches_transformers(tmp_path):
  hf_model = _write(tmp_path, multimodal=True)
  model, config = load_safetensors(tmp_path)
  assert isinstance(model, Qwen3_5) and config.checkpoint_prefix == "model.language_model."
  assert config.rotary_dim == 8 and config.rope_theta == 1000.0
  prompt = PROMPTS[0]
  got = np.asarray(token_logprobs(model, jnp.asarray([prompt], jnp.int32)))[0]
  np.testing.assert_allclose(got, hf_prompt_logprobs(hf_model, prompt), atol=1e-4)


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
  fields = {k: v for k, v in TEXT.items() if k != "intermediate_size"}
  config = transformers.Qwen3_5MoeTextConfig(
    **fields,
    moe_intermediate_size=24,
    shared_expert_intermediate_size=40,
    num_experts=4,
    num_experts_per_tok=2,
  )
  torch.manual_seed(0)
  hf_model = transformers.Qwen3_5MoeForCausalLM(config).eval()
  _randomise(hf_model, 0)
  directory = tmp_path_factory.mktemp("qwen3_5_moe")
  hf_model.save_pretrained(directory)
  return directory, hf_model


@pytest.fixture(scope="module")
def moe_llm(moe_checkpoint):
  """One MoE engine (chunks of 8 tokens, a LoRA slot, the routed experts returned) for the
  adapter and routing tests, its steps in one shape (`one_shape`)."""
  return one_shape(je.LLM(moe_checkpoint[0], enable_return_routed_experts=True, **ENGINE))


def test_moe_checkpoint_matches_transformers(moe_checkpoint):
  """``Qwen3_5MoeForCausalLM``: 4 routed experts (2 per token, renormalised) and a gated shared
  expert on every layer, per-expert checkpoint tensors; transformers' logprobs."""
  directory, hf_model = moe_checkpoint
  model, loaded = load_safetensors(directory)
  assert loaded.num_experts == 4 and loaded.shared_expert_intermediate_size == 40
  rows = np.asarray(token_logprobs(model, _padded(PROMPTS[:2])))  # one compile
  for prompt, got in zip(PROMPTS[:2], rows):
    want = hf_prompt_logprobs(hf_model, prompt)
    np.testing.assert_allclose(got[: len(want)], want, atol=1e-4)


def test_moe_peft_adapter_on_experts_shared_expert_and_mixers(moe_checkpoint, moe_llm, tmp_path):
  """A rank-4 PEFT adapter on the routed experts (``target_parameters``), the shared expert
  (``gate_proj`` ... under ``mlp.shared_expert``) and both mixers: transformers + peft's greedy
  tokens and prompt logprobs within 1e-4."""
  import peft

  directory, hf_model = moe_checkpoint
  base = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
  config = peft.LoraConfig(
    r=4, lora_alpha=8, lora_dropout=0.0,
    target_modules=["q_proj", "o_proj", "in_proj_qkv", "gate_proj", "up_proj", "down_proj"],
    target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
  )  # fmt: skip
  adapted = random_peft_adapter(base, config, tmp_path / "adapter", seed=2)
  llm = moe_llm
  request = je.LoRARequest("moe", 1, str(tmp_path / "adapter"))
  manager = llm.llm_engine.runner.lora
  pairs = manager.load(request).weights
  assert {(0, "experts.down_proj"), (0, "shared_expert.up_proj")} <= set(pairs)
  ((tokens, logprobs),) = _greedy_with_prompt_logprobs(llm, PROMPTS[:1], lora_request=request)
  assert tokens == hf_greedy(adapted, PROMPTS[0], MAX_TOKENS)
  want = hf_prompt_logprobs(adapted, PROMPTS[0])
  np.testing.assert_allclose(logprobs, want, atol=1e-4)
  assert np.abs(want - hf_prompt_logprobs(hf_model, PROMPTS[0])).max() > 0.1


def test_moe_routed_experts_are_transformers_router_top_k_and_replay(moe_checkpoint, moe_llm):
  """``enable_return_routed_experts`` on the MoE hybrid (chunked prefill): each completion's
  ``[T - 1, 4 layers, 2]`` experts are transformers' router top-2 at every fed position, and
  replaying them through `token_logprobs` gives the logprobs of routing afresh."""
  directory, hf_model = moe_checkpoint
  engine = moe_llm
  params = je.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
  model = load_safetensors(directory)[0]
  sequences, routed = [], []
  for prompt, out in zip(PROMPTS[:2], engine.generate(PROMPTS[:2], params, use_tqdm=False)):
    completion = out.outputs[0]
    fed = prompt + list(completion.token_ids[:-1])
    with torch.no_grad():
      logits = hf_model(torch.tensor([fed]), output_router_logits=True).router_logits
    want = np.stack([torch.topk(x.double(), 2, dim=-1).indices.numpy() for x in logits], axis=1)
    assert completion.routed_experts.shape == (len(fed), 4, 2)
    np.testing.assert_array_equal(completion.routed_experts, want)
    sequences.append(fed + [completion.token_ids[-1]])
    routed.append(completion.routed_experts)
  ids = _padded(sequences)  # both sequences in one call per form (the padding's experts: 0)
  experts = np.zeros((len(sequences), ids.shape[1] - 1, 4, 2), np.int32)
  for row, chosen in zip(experts, routed):
    row[: len(chosen)] = chosen
  replayed = np.asarray(token_logprobs(model, ids, routed_experts=experts))
  afresh = np.asarray(token_logprobs(model, ids))
  other = np.asarray(token_logprobs(model, ids, routed_experts=(experts + 1) % 4))
  for i, chosen in enumerate(routed):
    n = len(chosen)  # each sequence's own positions
    np.testing.assert_allclose(replayed[i, :n], afresh[i, :n], atol=1e-6)
    assert np.abs(other[i, :n] - replayed[i, :n]).max() > 1e-3
