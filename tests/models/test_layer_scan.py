"""Decoder layers under `jax.lax.scan` (`LlamaConfig.scan_layers`, `EngineConfig.scan_layers`,
`jaxengine/models/layer_scan.py`): the scanned model computes what the unrolled one does, its
weights load into the stack under their per-layer names, quantization keeps the layer axis, its
compiled step does not grow with depth, and what cannot scan is refused."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxengine as je
import jaxengine.cli.main as cli
from jaxengine.engine import EngineConfig
from jaxengine.engine.engine_flags import engine_options
from jaxengine.models import sequence_logits, token_logprobs
from jaxengine.models.attention_backends import XlaAttentionBackend
from jaxengine.models.gemma import Gemma
from jaxengine.models.gemma_config import GemmaConfig
from jaxengine.models.gguf_loader import load_gguf
from jaxengine.models.layer_scan import scan_config, scanned_model
from jaxengine.models.llama import DecoderLayer, forward
from jaxengine.models.quantization import quantize_model
from jaxengine.models.sequence_logprobs import scratch_step
from jaxengine.models.weights import named_weights, state_leaves
from jaxengine.testing import tiny_llama, tiny_llama_config

pytestmark = pytest.mark.bitwise  # compares bits between programs: tests/conftest.py

TOKENS = jnp.asarray(np.random.default_rng(0).integers(3, 256, (2, 13)), jnp.int32)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, moe_layers=(0, 1))

#: Llama relatives whose layers all share one structure: plain, Qwen3-style (q/k norms, biases,
#: wider heads than E / H), Mistral's window, a mixture of experts on every layer (Mixtral).
CASES = {
  "llama": dict(num_hidden_layers=3),
  "qwen": dict(qk_norm=True, attention_bias=True, head_dim=24, tie_word_embeddings=False),
  "mistral": dict(sliding_window=5),
  "moe": MOE,
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_scanned_model_computes_the_unrolled_models_logits(case):
  """Same seed, same draws: the scanned model holds the unrolled one's weights, stacked, and
  its logits are the same bits on XLA:CPU."""
  unrolled, _ = tiny_llama(1, **CASES[case])
  scanned, config = tiny_llama(1, scan_layers=True, **CASES[case])
  wq = state_leaves(nnx.state(scanned))[("layers", "attn", "wq")]
  assert wq.shape == (config.num_hidden_layers, 4, config.head_dim, 64)
  want = np.asarray(sequence_logits(unrolled, TOKENS))
  np.testing.assert_array_equal(np.asarray(sequence_logits(scanned, TOKENS)), want)
  converted = scanned_model(unrolled, True)  # a copy of the caller's module, stacked
  np.testing.assert_array_equal(np.asarray(sequence_logits(converted, TOKENS)), want)
  assert not unrolled.config.scan_layers and isinstance(unrolled.layers, nnx.List)


def test_routed_experts_and_their_replay_through_the_scan():
  """A mixture of experts on every layer: the scan returns each layer's experts as the unrolled
  loop does (``[..., L, k]``), and replaying given experts gives the same logprobs."""
  unrolled, _ = tiny_llama(1, **MOE)
  scanned = scanned_model(unrolled, True)
  experts = []
  for model in (unrolled, scanned):
    copy = nnx.merge(*nnx.split(model))
    copy.set_attributes(return_routed_experts=True)
    metadata, cache = scratch_step(copy, 1, 13, 4, XlaAttentionBackend())
    positions = jnp.arange(13, dtype=jnp.int32)[None]
    experts.append(np.asarray(copy(TOKENS[:1], positions, cache, metadata)[2]))
  assert experts[0].shape == (1, 13, 2, 2)
  np.testing.assert_array_equal(experts[1], experts[0])
  replay = jnp.asarray(np.random.default_rng(3).integers(0, 4, (2, 12, 2, 2)), jnp.int32)
  want = token_logprobs(unrolled, TOKENS, routed_experts=replay)
  got = token_logprobs(scanned, TOKENS, routed_experts=replay)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert not np.array_equal(np.asarray(token_logprobs(scanned, TOKENS)), np.asarray(got))


def test_the_kv_cache_of_a_scanned_model_is_one_stacked_buffer():
  model, config = tiny_llama(0, scan_layers=True)
  _, cache = scratch_step(model, 2, 9, 4, XlaAttentionBackend())
  assert model.kv_cache_spec.stacked and cache.stacked_layers == config.num_hidden_layers
  (keys, values) = cache.pages[0]
  assert len(cache.pages) == 1 and keys.shape == (2 * cache.blocks_per_layer, 4, 2, 16)
  assert values.shape == keys.shape


def test_named_weights_load_into_the_stack(tmp_path):
  """`LLM.load_weights` of per-layer Hugging Face names fills the stacked leaves (an expert of
  a stacked layer included), a subset leaving the other rows as they were; `named_weights` of
  the scanned engine's model gives back the per-layer names and tensors."""
  for fields in ({}, MOE):
    llm = je.LLM(
      tiny_llama(0, max_position_embeddings=64, **fields)[0],
      scan_layers=True,
      max_num_reqs=2,
      max_model_len=64,
    )
    runner = llm.llm_engine.runner
    other, _ = tiny_llama(7, max_position_embeddings=64, **fields)
    new = {name: np.asarray(a) for name, a in named_weights(other)}
    llm.load_weights(new)
    got = dict(named_weights(runner.model))
    assert got.keys() == new.keys()
    for name, tensor in new.items():
      np.testing.assert_array_equal(np.asarray(got[name]), tensor, err_msg=name)
    one = "model.layers.1.self_attn.q_proj.weight"
    llm.load_weights({one: np.zeros_like(new[one])})
    wq = np.asarray(state_leaves(runner.weights)[("layers", "attn", "wq")])
    first = new["model.layers.0.self_attn.q_proj.weight"].reshape(wq[0].shape)
    assert not wq[1].any() and np.array_equal(wq[0], first)
    llm.load_weights(other)  # a trainer's own unrolled module: checked per layer, then stacked
    got = dict(named_weights(runner.model))
    for name, tensor in new.items():
      np.testing.assert_array_equal(np.asarray(got[name]), tensor, err_msg=name)
    broken = nnx.state(other)
    broken["layers"][1]["attn"]["wq"] = nnx.Param(jnp.zeros((4, 16, 32)))
    with pytest.raises(ValueError, match=r"layers\.1\.attn\.wq: expected shape \(4, 16, 64\)"):
      llm.load_weights(broken)


def test_a_checkpoint_loads_straight_into_the_stack():
  """``scan_layers=True`` builds the loaded model stacked (no unrolled copy first): SmolLM2's
  GGUF file gives the unrolled load's tensors under the same names."""
  unrolled, _ = load_gguf()
  scanned, config = load_gguf(scan_layers=True)
  assert config.scan_layers and isinstance(scanned.layers, DecoderLayer)
  want = dict(named_weights(unrolled))
  got = dict(named_weights(scanned))
  assert got.keys() == want.keys()
  for name in ("model.layers.29.mlp.down_proj.weight", "model.layers.0.self_attn.q_proj.weight"):
    np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]), err_msg=name)


def test_fp8_pages_and_fp8_weights_give_the_unrolled_engines_outputs():
  """The stacked cache in fp8 (bytes on XLA) and fp8 weights with their ``[L, ...]`` scales: the
  unrolled engine's greedy tokens and logprobs."""
  model, _ = tiny_llama(4, max_position_embeddings=64)
  params = je.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
  prompts = [[5, 17, 99, 3, 64, 21, 8], [2, 9, 77]]
  outputs = []
  for scan in (False, True):
    llm = je.LLM(
      model,
      scan_layers=scan,
      kv_cache_dtype="fp8",
      quantization="fp8",
      max_num_reqs=2,
      max_model_len=64,
      num_kv_blocks=16,
      block_size=8,
    )
    runner = llm.llm_engine.runner
    assert (runner.kv_cache.stacked_layers is not None) == scan
    # the steps in their largest shape only: one sampler and one step to compile per engine
    runner.row_buckets, runner.token_buckets = runner.row_buckets[-1:], runner.token_buckets[-1:]
    outputs.append(llm.generate(prompts, params, use_tqdm=False))
  for a, b in zip(*outputs, strict=True):
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    want = [d[t].logprob for d, t in zip(a.outputs[0].logprobs, a.outputs[0].token_ids)]
    got = [d[t].logprob for d, t in zip(b.outputs[0].logprobs, b.outputs[0].token_ids)]
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_quantization_keeps_the_layer_axis():
  unrolled, _ = tiny_llama(2)
  scanned = scanned_model(unrolled, True)
  done = quantize_model(scanned, "int8")
  leaves = state_leaves(nnx.state(done.model))
  assert leaves[("layers", "attn", "wq")].dtype == jnp.int8
  assert leaves[("layers", "attn", "scales", "wq")].shape == (2, 4, 16)  # [L, H, D]
  assert leaves[("layers", "mlp", "scales", "w_down")].shape == (2, 64)  # [L, E]
  want = sequence_logits(quantize_model(unrolled, "int8").model, TOKENS)
  np.testing.assert_array_equal(np.asarray(sequence_logits(done.model, TOKENS)), np.asarray(want))


def _compiled_instructions(num_layers: int, scan: bool) -> int:
  """HLO instructions of one compiled forward step of a tiny model of `num_layers`."""
  model, _ = tiny_llama(0, num_hidden_layers=num_layers, scan_layers=scan)
  metadata, cache = scratch_step(model, 2, 8, 4, XlaAttentionBackend())
  graphdef, weights = nnx.split(model)
  ids = TOKENS[:, :8].reshape(1, -1)
  positions = jnp.tile(jnp.arange(8, dtype=jnp.int32), 2)[None]
  step = jax.jit(forward, static_argnums=0)
  compiled = step.lower(graphdef, weights, ids, positions, cache, metadata).compile()
  return sum(" = " in line for line in compiled.as_text().splitlines())


def test_the_compiled_step_does_not_grow_with_depth():
  """2 and 8 scanned layers compile the same number of HLO instructions (one layer body);
  unrolled, 8 layers compile many more."""
  assert _compiled_instructions(8, scan=True) == _compiled_instructions(2, scan=True)
  assert _compiled_instructions(8, scan=False) > 2 * _compiled_instructions(2, scan=False)


def test_the_engine_default_and_the_refusals():
  model, config = tiny_llama(0)
  assert EngineConfig().scan_layers is None
  assert scanned_model(model, None, platform="cpu") is model  # unrolled on CPU
  assert scanned_model(model, None, platform="tpu").config.scan_layers  # scanned on TPU
  with pytest.raises(ValueError, match="scan_layers must be None, True or False, got 'yes'"):
    EngineConfig(scan_layers="yes")
  with pytest.raises(ValueError, match=r"scan_layers=True needs layers of one structure"):
    dataclasses.replace(config, scan_layers=True, **{**MOE, "moe_layers": (1,)})
  mixed, _ = tiny_llama(0, **{**MOE, "moe_layers": (1,)})
  assert scanned_model(mixed, None, platform="tpu") is mixed  # the default leaves it unrolled
  with pytest.raises(ValueError, match=r"scan_layers=True needs layers of one structure"):
    scanned_model(mixed, True)
  scanned, _ = tiny_llama(0, scan_layers=True)
  with pytest.raises(ValueError, match="scan_layers=False, but the model's layers are stacked"):
    je.LLM(scanned, scan_layers=False, max_num_reqs=2, max_model_len=64)
  gemma_config = GemmaConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    layer_types=("sliding_attention", "full_attention"),
    sliding_window=4,
    max_position_embeddings=64,
  )
  assert scan_config(gemma_config, True).scan_layers  # Gemma scans over its layer pattern
  assert scan_config(gemma_config, None, platform="tpu").scan_layers
  assert scan_config(config, None, platform="tpu").scan_layers
  assert not scan_config(config, None, platform="cpu").scan_layers
  gemma = Gemma(gemma_config, rngs=nnx.Rngs(0))
  assert scanned_model(gemma, None, platform="tpu").config.scan_layers
  assert scanned_model(gemma, None, platform="cpu") is gemma

  class OtherConfig:  # a family without ``scan_layers``
    pass

  with pytest.raises(ValueError, match="scan_layers=True: Other models cannot run their layers"):
    scan_config(OtherConfig(), True)  # a checkpoint's config: refused before any tensor loads
  assert tiny_llama_config().scan_layers is False
  flags = [(["--scan-layers"], True), (["--no-scan-layers"], False), ([], None)]
  for flag, value in flags:
    options = engine_options(cli.build_parser().parse_args(["generate", "Hi", *flag]))
    assert options.get("scan_layers") is value, flag
