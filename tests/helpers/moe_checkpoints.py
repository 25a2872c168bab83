"""Tiny mixture-of-experts models of transformers (Qwen3-MoE, Mixtral) for the tests.

The transformers model classes are the reference; weights are redrawn with standard deviation
``fan_in ** -0.5`` so that routing matters. The Qwen3-MoE model mixes sparse and dense layers
(``mlp_only_layers``); Mixtral is sparse on every layer. Used by ``tests/models/test_moe.py`` and
``tests/models/test_quantization.py``.
"""

from __future__ import annotations

import torch
import transformers

VOCAB = 96
COMMON = dict(
  vocab_size=VOCAB,
  hidden_size=32,
  num_attention_heads=4,
  num_key_value_heads=2,
  head_dim=8,
  max_position_embeddings=128,
  rms_norm_eps=1e-6,
  tie_word_embeddings=False,
)
CASES = {
  # layers 0 and 2 sparse, layer 1 dense (mlp_only_layers); weights not renormalised
  "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
    **COMMON,
    num_hidden_layers=3,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_experts=8,
    num_experts_per_tok=2,
    decoder_sparse_step=1,
    mlp_only_layers=[1],
    norm_topk_prob=False,
  ),
  "mixtral": lambda: transformers.MixtralConfig(
    **COMMON, num_hidden_layers=2, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2
  ),
}
MODEL_CLASSES = {
  "qwen3_moe": transformers.Qwen3MoeForCausalLM,
  "mixtral": transformers.MixtralForCausalLM,
}


def hf_moe_model(case: str, seed: int = 0):
  """A transformers model of `case` with weights of std ``fan_in ** -0.5``, norms near 1."""
  torch.manual_seed(seed)
  model = MODEL_CLASSES[case](CASES[case]()).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
      else:  # [..., out, in] matrices (fused experts included) and the [V, E] embedding
        p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
  return model
