"""LoRA on mixtures of experts (issue 53): PEFT adapters on the routed experts and attention.

The tiny Qwen3-MoE (sparse layers 0 and 2, dense layer 1) and Mixtral of
``tests/helpers/moe_checkpoints.py`` get a PEFT adapter on their fused experts
(``target_parameters``, as PEFT makes them for transformers 5) and attention projections, with
random non-zero ``lora_B``; transformers + peft computing the same prompt is the reference.
Nothing touches the network.
"""

from __future__ import annotations

import json

import numpy as np
import peft
import pytest
import safetensors.numpy
import torch
from hf_reference import random_peft_adapter
from moe_checkpoints import hf_moe_model

import jaxengine as je
from jaxengine.lora import load_peft_adapter

PROMPT = [5, 17, 90, 3, 64, 21, 8, 77, 33, 7, 41, 12, 60, 2, 19, 44, 81, 9, 26]
GREEDY = je.SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, prompt_logprobs=0)
#: Per case: target modules, target parameters. Qwen3-MoE's ``gate_proj`` / ``up_proj`` are
#: turned by PEFT into its fused experts' ``gate_up_proj`` of twice the rank (``rank_pattern``,
#: ``alpha_pattern``); Mixtral's adapter names the fused parameters itself.
TARGETS = {
  "qwen3_moe": (["q_proj", "o_proj", "gate_proj", "up_proj"], []),
  "mixtral": (["v_proj"], ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
}


def _adapter(model, directory, targets, parameters, seed: int) -> None:
  """A PEFT adapter of rank 4 with random non-zero factors (PEFT starts ``lora_B`` at 0)."""
  config = peft.LoraConfig(
    r=4,
    lora_alpha=8,
    target_modules=targets,
    target_parameters=parameters or None,
    lora_dropout=0.0,
  )
  random_peft_adapter(model, config, directory, seed)


@pytest.fixture(scope="module", params=list(TARGETS))
def moe_lora(request, tmp_path_factory):
  """``(case, directory, adapter directory, reference model with the adapter, engine)``."""
  case = request.param
  root = tmp_path_factory.mktemp(f"moe_lora_{case}")
  hf_moe_model(case).save_pretrained(root / "base")
  _adapter(hf_moe_model(case), root / "adapter", *TARGETS[case], seed=1)
  reference = peft.PeftModel.from_pretrained(hf_moe_model(case), root / "adapter").eval()
  llm = je.LLM(
    root / "base", enable_lora=True, max_loras=1, max_lora_rank=8, max_num_reqs=2,
    max_model_len=64, num_kv_blocks=48, block_size=4,
  )  # fmt: skip
  return case, root, reference, llm


def _log_softmax(model, tokens) -> np.ndarray:
  with torch.no_grad():
    return torch.log_softmax(model(torch.tensor([tokens])).logits[0].double(), -1).numpy()


def _prompt_logprobs(output) -> np.ndarray:
  prompt = output.prompt_token_ids
  return np.array([e[t].logprob for e, t in zip(output.prompt_logprobs[1:], prompt[1:])])


def test_expert_and_attention_adapters_equal_transformers_with_peft(moe_lora):
  """Greedy tokens and prompt logprobs within 1e-4 of transformers + peft; the adapter moves
  the logprobs by far more, and its experts' part alone does too."""
  case, root, reference, llm = moe_lora
  lora = je.LoRARequest("experts", 1, str(root / "adapter"))
  (out,) = llm.generate([PROMPT], GREEDY, lora_request=lora, use_tqdm=False)
  tokens = list(PROMPT)
  for _ in range(GREEDY.max_tokens):
    tokens.append(int(_log_softmax(reference, tokens)[-1].argmax()))
  assert list(out.outputs[0].token_ids) == tokens[len(PROMPT) :]
  want = _log_softmax(reference, PROMPT)
  want = np.array([want[i, t] for i, t in enumerate(PROMPT[1:])])
  np.testing.assert_allclose(_prompt_logprobs(out), want, atol=1e-4, rtol=0)
  (plain,) = llm.generate([PROMPT], GREEDY, use_tqdm=False)
  assert np.abs(_prompt_logprobs(plain) - want).max() > 1e-2
  with reference.disable_adapter():  # transformers' base model: the engine's without adapter
    base = _log_softmax(reference, PROMPT)
  np.testing.assert_allclose(
    _prompt_logprobs(plain), [base[i, t] for i, t in enumerate(PROMPT[1:])], atol=1e-4, rtol=0
  )
  adapter = load_peft_adapter(root / "adapter", 1, **_shapes(llm))
  experts = {k for k in adapter.weights if k[1].startswith("experts.")}
  layers = (0, 2) if case == "qwen3_moe" else (0, 1)
  targets = ("experts.gate_proj", "experts.up_proj", "experts.down_proj")
  if case == "qwen3_moe":
    targets = targets[:2]
  assert experts == {(layer, t) for layer in layers for t in targets}


def _shapes(llm) -> dict:
  manager = llm.llm_engine.runner.lora
  return dict(
    max_lora_rank=manager.max_lora_rank,
    num_layers=manager.num_layers,
    target_shapes=manager.target_shapes,
  )


def test_per_expert_adapter_files_read_as_the_fused_ones(moe_lora, tmp_path):
  """PEFT's earlier per-expert form (``mlp.experts.{e}.gate_proj``; Mixtral's
  ``block_sparse_moe.experts.{e}.w1``) of the same factors gives the same pairs (their rank and
  alpha from ``rank_pattern`` / ``alpha_pattern``)."""
  case, root, _, llm = moe_lora
  shapes = _shapes(llm)
  fused = load_peft_adapter(root / "adapter", 1, **shapes)
  config = json.loads((root / "adapter" / "adapter_config.json").read_text())
  tensors = {
    k: v
    for k, v in safetensors.numpy.load_file(root / "adapter" / "adapter_model.safetensors").items()
    if ".experts." not in k
  }
  names = {"experts.gate_proj": "gate_proj", "experts.up_proj": "up_proj"}
  names["experts.down_proj"] = "down_proj"
  block = "mlp"
  if case == "mixtral":
    names = {"experts.gate_proj": "w1", "experts.up_proj": "w3", "experts.down_proj": "w2"}
    block = "block_sparse_moe"
  ranks = {}
  for (layer, target), (a, b) in fused.weights.items():
    if target not in names:
      continue
    scale = fused.scale
    for e in range(a.shape[0]):
      prefix = f"base_model.model.model.layers.{layer}.{block}.experts.{e}.{names[target]}"
      tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a[e].T)
      tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b[e].T / scale)
    ranks[target] = a.shape[-1]
  (rank,) = set(ranks.values())  # the expert pairs' (padded) rank: a pattern gives it them
  pattern = r"experts\.\d+\.\w+"
  config.update(
    target_modules=config["target_modules"] + sorted(set(names.values())),
    target_parameters=None, rank_pattern={pattern: rank},
    alpha_pattern={pattern: rank * fused.scale},
  )  # fmt: skip
  (tmp_path / "adapter_config.json").write_text(json.dumps(config))
  safetensors.numpy.save_file(tensors, tmp_path / "adapter_model.safetensors")
  per_expert = load_peft_adapter(tmp_path, 2, **shapes)
  assert set(per_expert.weights) == set(fused.weights)
  for key, (a, b) in fused.weights.items():
    got_a, got_b = per_expert.weights[key]
    np.testing.assert_allclose(got_a @ got_b, a @ b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
  "change, message",
  [
    (dict(target_parameters=["mlp.gate.weight"]), "target_parameters entry 'mlp.gate.weight'"),
    (dict(target_modules=["q_proj", "w9"]), "unknown target module 'w9'"),
  ],
)
def test_unsupported_expert_settings_are_named(moe_lora, tmp_path, change, message):
  import shutil

  _, root, _, llm = moe_lora
  shutil.copytree(root / "adapter", tmp_path / "a")
  config_file = tmp_path / "a" / "adapter_config.json"
  config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **change}))
  with pytest.raises(ValueError, match=message):
    load_peft_adapter(tmp_path / "a", 1, **_shapes(llm))


def test_expert_targets_on_a_dense_model_are_refused():
  from jaxengine.lora.peft_experts import parameter_targets

  with pytest.raises(ValueError, match="this model has no routed experts"):
    parameter_targets(["gate_up_proj"], "x", {"q_proj": (4, 4)})
