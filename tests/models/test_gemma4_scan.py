"""Gemma 4's layers under `jax.lax.scan` (``scan_layers=True``, `jaxengine/models/gemma4_scan.py`):
a stack per kind of layer (local, global with wider heads and values from the keys, and the
KV-shared ones with double-wide MLPs), the layers with keys and values scanned over their
repeating group, the KV-shared ones a scan of their own, per-layer inputs read by index. The
scanned model computes the unrolled one's logprobs (bit for bit in batch-invariant mode; within
1e-5 otherwise: XLA:CPU fuses the sums across the loop boundary differently); a batch-invariant
engine gives the unrolled model's tokens and logprob bits (`token_logprobs`) through chunked
prefill and freed window pages, and compiles nothing after warm-up; it serves LoRA adapters as
the unrolled engine does (each layer reads its row of the stacked adapters); its weights load
under their per-layer names and from an unrolled module. Models are built here (no checkpoint,
no transformers)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from step_shapes import one_shape
from weight_checks import assert_load_weights_fill_the_stacks

import jaxengine as je
from jaxengine.models import sequence_logits, token_logprobs
from jaxengine.models.batch_invariant import batch_invariant_model
from jaxengine.models.gemma4 import Gemma4
from jaxengine.models.gemma4_config import Gemma4Config, Gemma4Rope
from jaxengine.models.gemma4_scan import Gemma4Stacks
from jaxengine.models.layer_scan import scan_config, scanned_model
from jaxengine.models.quantization import quantize_model
from jaxengine.models.weights import named_weights, state_leaves
from jaxengine.testing import count_compiles

pytestmark = pytest.mark.bitwise  # compares bits between programs: tests/conftest.py

SLIDING, FULL = "sliding_attention", "full_attention"
#: Every feature of tests/models/test_gemma4.py's "all" checkpoint, over 10 layers of two local
#: and one global: 7 with keys and values (two groups scanned, one layer after them), the last
#: 3 KV-shared (local, global, local: one group of two scanned, one after it).
CONFIG = Gemma4Config(
  vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=10,
  num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
  num_global_key_value_heads=1, attention_k_eq_v=True, max_position_embeddings=64,
  sliding_window=4, layer_types=((SLIDING, SLIDING, FULL) * 4)[:10],
  vocab_size_per_layer_input=96, hidden_size_per_layer_input=8, num_kv_shared_layers=3,
  enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16,
  use_double_wide_mlp=True, final_logit_softcapping=3.0, rope_local=Gemma4Rope(theta=50.0),
  rope_global=Gemma4Rope(theta=500.0, partial_rotary_factor=0.25),
)  # fmt: skip
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 96, (2, 13)), jnp.int32)


def _model(seed: int = 0) -> Gemma4:
  """`CONFIG`'s model, its layer scalars away from 1 (as a checkpoint's are)."""
  model = Gemma4(CONFIG, rngs=nnx.Rngs(seed))
  for i, layer in enumerate(model.layers):
    layer.layer_scalar[...] = jnp.full((1,), 0.5 + 0.1 * i, jnp.float32)
  return model


def test_scanned_layers_compute_the_unrolled_models_logprobs():
  """The four stacks hold 5 local, 2 global, 2 KV-shared local and 1 KV-shared global layers;
  the logprobs are the unrolled model's within 1e-5 and its bits in batch-invariant mode;
  `named_weights` gives the same checkpoint tensors; int8 keeps the layer axis in the scales."""
  unrolled = _model()
  scanned = scanned_model(unrolled, True)
  assert isinstance(scanned.layers, Gemma4Stacks) and scanned.stacked_paths == ("layers",)
  leaves = state_leaves(nnx.state(scanned))
  assert leaves[("layers", "sliding", "attn", "wq")].shape == (5, 4, 16, 32)
  assert leaves[("layers", "full", "attn", "wq")].shape == (2, 4, 32, 32)
  assert ("layers", "full", "attn", "wv") not in leaves  # values from the keys
  assert leaves[("layers", "shared_sliding", "mlp", "w_up")].shape == (2, 96, 32)
  assert leaves[("layers", "shared_full", "attn", "wq")].shape == (1, 4, 32, 32)
  assert scanned.kv_cache_spec.stacked
  want = np.asarray(token_logprobs(unrolled, TOKENS))
  np.testing.assert_allclose(np.asarray(token_logprobs(scanned, TOKENS)), want, atol=1e-5)
  fixed = batch_invariant_model(unrolled)
  want_bits = np.asarray(sequence_logits(fixed, TOKENS))
  got_bits = np.asarray(sequence_logits(scanned_model(fixed, True), TOKENS))
  np.testing.assert_array_equal(got_bits, want_bits)
  got, expected = dict(named_weights(scanned)), dict(named_weights(unrolled))
  assert got.keys() == expected.keys()
  for name, tensor in expected.items():
    np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(tensor), err_msg=name)
  quantized = state_leaves(nnx.state(quantize_model(scanned, "int8").model))
  assert quantized[("layers", "sliding", "attn", "scales", "wq")].shape == (5, 4, 16)
  assert quantized[("layers", "shared_full", "attn", "wq")].dtype == jnp.int8


def test_scanned_engine_gives_the_unrolled_models_bits():
  """``LLM(model, scan_layers=True, batch_invariant=True)``: two prompts of 21 tokens in
  chunks of 8 (the window's pages freed as they slide out) give the tokens and the prompt and
  sampled logprob bits of `token_logprobs` over the unrolled batch-invariant model; after
  warm-up nothing compiles; `load_weights` of named tensors and of an unrolled module fill the
  stacks."""
  model = _model()
  prompts = [[(5 * i + 2) % 96 for i in range(21)], [(7 * i + 5) % 96 for i in range(21)]]
  params = je.SamplingParams(
    temperature=0, max_tokens=6, ignore_eos=True, logprobs=0, prompt_logprobs=0
  )
  llm = je.LLM(model, scan_layers=True, max_num_reqs=2, max_model_len=48, block_size=4,
               max_num_batched_tokens=8, batch_invariant=True)  # fmt: skip
  runner = one_shape(llm).llm_engine.runner  # the steps in their largest shape only
  assert runner.kv_cache.stacked_layers is not None and runner.model.config.scan_layers
  outputs = llm.generate(prompts, params, use_tqdm=False)
  sequences = jnp.asarray([p + list(out.outputs[0].token_ids) for p, out in zip(prompts, outputs)])
  want = np.asarray(token_logprobs(batch_invariant_model(model), sequences, block_size=4))
  for out, prompt, row in zip(outputs, prompts, want):
    sample = out.outputs[0]
    sampled = [d[t].logprob for d, t in zip(sample.logprobs, sample.token_ids)]
    prompt_logprobs = [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], prompt[1:])]
    np.testing.assert_array_equal(np.float32(prompt_logprobs + sampled), row)
  with count_compiles() as compiles:
    llm.generate(prompts, params, use_tqdm=False)
  assert compiles.count == 0
  other = _model(seed=7)
  assert_load_weights_fill_the_stacks(llm, other, _model(seed=3))  # a trainer's unrolled module
  broken = nnx.state(other)
  broken["layers"][8]["attn"]["wq"] = nnx.Param(jnp.zeros((4, 16, 32)))  # KV-shared global
  with pytest.raises(ValueError, match=r"layers\.8\.attn\.wq: expected shape \(4, 32, 32\)"):
    llm.load_weights(broken)


def test_the_platform_default():
  assert scan_config(CONFIG, None, platform="tpu").scan_layers
  assert not scan_config(CONFIG, None, platform="cpu").scan_layers
  with pytest.raises(ValueError, match="scan_layers must be a bool, got 1"):
    dataclasses.replace(CONFIG, scan_layers=1)


def test_scanned_engine_serves_lora_adapters_as_the_unrolled_one():
  """A random adapter on every layer's ``q_proj``, ``o_proj`` and ``down_proj`` (each layer's
  own width: `Gemma4.lora_layer_shapes`) gives the scanned engine the unrolled engine's tokens
  and logprobs (within 1e-5), and moves them away from the base model's."""
  from jaxengine.lora import lora_adapter_from_arrays

  model = _model()
  rng = np.random.default_rng(2)
  pairs = {
    (layer, target): (
      rng.standard_normal((shape[0], 4)).astype(np.float32) * 0.3,
      rng.standard_normal((4, shape[1])).astype(np.float32) * 0.3,
    )
    for (layer, target), shape in model.lora_layer_shapes().items()
    if target in ("q_proj", "o_proj", "down_proj")
  }
  adapter = lora_adapter_from_arrays(1, pairs)
  lora = je.LoRARequest("trainer", 1, "in memory")
  prompt = [(5 * i + 2) % 96 for i in range(13)]
  params = je.SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=0)
  results = {}
  for scan in (True, False):
    llm = one_shape(  # the prefill and the decode steps in one shape: one compile per engine
      je.LLM(model, scan_layers=scan, max_num_reqs=1, max_model_len=32, block_size=4,
             enable_lora=True, max_loras=1, max_lora_rank=4)
    )  # fmt: skip
    llm.load_lora_weights(lora, adapter)
    for request in (lora, None):
      (out,) = llm.generate([prompt], params, lora_request=request, use_tqdm=False)
      sample = out.outputs[0]
      logprobs = [d[t].logprob for d, t in zip(sample.logprobs, sample.token_ids)]
      results[scan, request is None] = (list(sample.token_ids), np.float32(logprobs))
  for base in (True, False):
    assert results[True, base][0] == results[False, base][0]
    np.testing.assert_allclose(results[True, base][1], results[False, base][1], atol=1e-5)
  assert not np.allclose(results[True, True][1], results[True, False][1], atol=1e-3)
