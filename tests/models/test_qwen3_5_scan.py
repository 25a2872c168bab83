"""Qwen3.5's layers under `jax.lax.scan` (``scan_layers=True``, `jaxengine/models/qwen3_5_scan.py`):
a stack per kind of layer, the scan over the repeating group (three Gated DeltaNet layers, one
full-attention layer), the layers after the last whole group unrolled, stacked pages and a
stacked recurrent state pool. The scanned model computes the unrolled one's bits (dense and MoE,
prefills in chunks of the delta rule); a batch-invariant engine gives the unrolled model's
tokens and logprob bits (`token_logprobs`) through chunked prefill and prefix-cache hits, with a
LoRA adapter beside, and compiles nothing after warm-up; its weights load under their per-layer
names and from an unrolled module; its compiled step does not grow with depth; `jaxengine
compile`'s engine lowers it. Models are built here (no checkpoint, no transformers)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from weight_checks import assert_load_weights_fill_the_stacks

import jaxengine as je
from jaxengine.models import sequence_logits, token_logprobs
from jaxengine.models.attention_backends import XlaAttentionBackend
from jaxengine.models.batch_invariant import batch_invariant_model
from jaxengine.models.layer_scan import scan_config, scanned_model
from jaxengine.models.quantization import quantize_model
from jaxengine.models.qwen3_5 import Qwen3_5
from jaxengine.models.qwen3_5_checkpoints import FULL, LINEAR, Qwen3_5Config
from jaxengine.models.qwen3_5_scan import HybridStacks
from jaxengine.models.sequence_logprobs import scratch_step
from jaxengine.models.weights import named_weights, state_leaves
from jaxengine.testing import count_compiles

pytestmark = pytest.mark.bitwise  # compares bits between programs: tests/conftest.py

#: Three linear layers and a full one, repeated: 10 layers are two scanned groups and two linear
#: layers unrolled after them.
GROUP = (LINEAR, LINEAR, LINEAR, FULL)
CONFIG = dict(
  vocab_size=96, hidden_size=32, intermediate_size=48, num_attention_heads=4,
  num_key_value_heads=2, head_dim=16, max_position_embeddings=64, linear_key_head_dim=8,
  linear_value_head_dim=12, linear_num_key_heads=2, linear_num_value_heads=4,
  partial_rotary_factor=0.5, rope_theta=1000.0,
)  # fmt: skip
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
           shared_expert_intermediate_size=40)  # fmt: skip
#: 40 tokens a row: longer than a chunk of the delta rule on CPU (32), so prefills run by chunk.
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 96, (2, 40)), jnp.int32)


def _config(num_layers: int, **fields) -> Qwen3_5Config:
  types = (GROUP * (num_layers // 4 + 1))[:num_layers]
  return Qwen3_5Config(num_hidden_layers=num_layers, layer_types=types, **CONFIG, **fields)


def _model(num_layers: int = 10, seed: int = 0, **fields) -> Qwen3_5:
  return Qwen3_5(_config(num_layers, **fields), rngs=nnx.Rngs(seed))


def _bits(values) -> np.ndarray:
  return np.asarray(values, np.float32).view(np.uint32)


@pytest.mark.parametrize("num_layers, fields", [(10, {}), (6, MOE)], ids=["dense", "moe"])
def test_scanned_layers_give_the_unrolled_bits(num_layers, fields):
  """10 layers (two groups of four scanned, two linear layers after them): the stacks hold 8
  linear and 2 full layers; logits over 40-token sequences (the delta rule by chunk) are the
  unrolled model's bits; int8 keeps the layer axis in the scales (``[Ll, ...]``);
  `named_weights` gives the same checkpoint tensors; a model built stacked has its config's
  stacked pages and state pool. MoE
  (6 layers: one group, two after it): each layer's experts (``[..., L, k]``) and their replay
  are the unrolled loop's."""
  unrolled = _model(num_layers, **fields)
  scanned = scanned_model(unrolled, True)
  assert isinstance(scanned.layers, HybridStacks) and scanned.config.layer_period == 4
  leaves = state_leaves(nnx.state(scanned))
  linear, full = (num_layers * 3 + 3) // 4, num_layers // 4
  assert leaves[("layers", "linear", "mixer", "w_qkv")].shape == (linear, 80, 32)
  assert leaves[("layers", "full", "mixer", "wq")].shape == (full, 128, 32)
  if fields:
    _check_routed_experts(unrolled, scanned)
    return
  want = np.asarray(sequence_logits(unrolled, TOKENS))
  np.testing.assert_array_equal(np.asarray(sequence_logits(scanned, TOKENS)), want)
  got, expected = dict(named_weights(scanned)), dict(named_weights(unrolled))
  assert got.keys() == expected.keys()
  for name in (
    "model.layers.9.linear_attn.in_proj_qkv.weight",
    "model.layers.7.self_attn.q_proj.weight",
  ):
    np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(expected[name]), err_msg=name)
  quantized = state_leaves(nnx.state(quantize_model(scanned, "int8").model))
  assert quantized[("layers", "linear", "mixer", "scales", "w_qkv")].shape == (8, 80)  # [Ll, C]
  assert quantized[("layers", "full", "mixer", "wq")].dtype == jnp.int8
  built = Qwen3_5(dataclasses.replace(unrolled.config, scan_layers=True), rngs=nnx.Rngs(0))
  assert built.kv_cache_spec.stacked and built.recurrent_state_spec.stacked
  pool = built.recurrent_state_spec.create(3)
  assert pool.is_stacked and pool.num_slots == 3 and pool.delta[0].shape == (8, 3, 4, 8, 12)


def _check_routed_experts(unrolled: Qwen3_5, scanned: Qwen3_5) -> None:
  """Each layer's experts over a 13-token prompt, and logprobs replaying given experts, are
  the unrolled model's bits."""
  experts = []
  step = nnx.jit(lambda model, *args: model(*args)[2])  # one compile, not one per operation
  for model in (unrolled, scanned):
    copy = nnx.merge(*nnx.split(model))
    copy.set_attributes(return_routed_experts=True)
    metadata, cache = scratch_step(copy, 1, 13, 4, XlaAttentionBackend())
    positions = jnp.arange(13, dtype=jnp.int32)[None]
    experts.append(np.asarray(step(copy, TOKENS[:1, :13], positions, cache, metadata)))
  assert experts[0].shape == (1, 13, 6, 2)
  np.testing.assert_array_equal(experts[1], experts[0])
  replay = jnp.asarray(np.random.default_rng(3).integers(0, 4, (2, 12, 6, 2)), jnp.int32)
  want = token_logprobs(unrolled, TOKENS[:, :13], routed_experts=replay)
  got = token_logprobs(scanned, TOKENS[:, :13], routed_experts=replay)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _compiled_instructions(num_layers: int) -> int:
  """HLO instructions of one compiled forward step of a tiny scanned model."""
  model = _model(num_layers, scan_layers=True)
  metadata, cache = scratch_step(model, 2, 8, 4, XlaAttentionBackend())
  ids = TOKENS[:, :8].reshape(1, -1)
  positions = jnp.tile(jnp.arange(8, dtype=jnp.int32), 2)[None]
  step = nnx.jit(lambda model, *args: model(*args))
  compiled = step.lower(model, ids, positions, cache, metadata).compile()
  return sum(" = " in line for line in compiled.as_text().splitlines())


def test_the_scanned_step_does_not_grow_with_the_groups():
  """8 and 16 scanned layers (two and four groups, no remainder) compile as many HLO
  instructions, give or take a constant (one body per position of the group; unrolled, 16
  layers would be twice 8's)."""
  assert abs(_compiled_instructions(16) - _compiled_instructions(8)) <= 10


def _adapter(model):
  """A random rank-4 adapter on a linear layer's, the full layer's and the MLP's projections,
  each on the layers that have it (`Qwen3_5.lora_target_layers`), made in memory."""
  from jaxengine.lora import lora_adapter_from_arrays

  rng = np.random.default_rng(1)
  shapes = {
    "in_proj_qkv": (32, 80), "out_proj": (48, 32), "q_proj": (32, 128), "down_proj": (48, 32),
  }  # fmt: skip
  layers = {**model.lora_target_layers(), "down_proj": tuple(range(10))}
  pairs = {
    (layer, target): (
      rng.standard_normal((n_in, 4)).astype(np.float32) * 0.3,
      rng.standard_normal((4, n_out)).astype(np.float32) * 0.3,
    )
    for target, (n_in, n_out) in shapes.items()
    for layer in layers[target]
  }
  return lora_adapter_from_arrays(1, pairs)


#: Batch invariance (the delta rule by token), chunks of 16 tokens, prefix caching (states
#: saved at block boundaries), a LoRA slot.
ENGINE = dict(
  max_num_reqs=2, max_model_len=64, block_size=4, max_num_batched_tokens=16,
  enable_prefix_caching=True, batch_invariant=True, enable_lora=True, max_loras=1,
  max_lora_rank=4,
)  # fmt: skip


def test_scanned_engine_gives_the_unrolled_models_bits():
  """``LLM(model, scan_layers=True, batch_invariant=True)`` with prefix caching, chunked prefill
  and a LoRA slot: a 37-token prompt, the same prompt again (a prefix-cache hit, its state read
  from a snapshot slot of the stacked pool) and a sibling sharing its first 32 tokens give the
  tokens and the prompt and sampled logprob bits of `token_logprobs` over the unrolled
  batch-invariant model; the sibling with an adapter, twice, moves the bits and then hits the
  adapter's own prefix; after warm-up nothing compiles; `load_weights` of named tensors and of an unrolled
  module fill the stacks (checked per layer: a wrong shape is refused by its unrolled name)."""
  model = _model()
  prompt = [(7 * i + 3) % 96 for i in range(37)]
  sibling = [*prompt[:32], 1, 2, 3, 4, 5]
  params = je.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
  scored = dataclasses.replace(params, prompt_logprobs=0)  # (a request that is never a hit)
  lora = je.LoRARequest("trainer", 1, "in memory")
  llm = je.LLM(model, scan_layers=True, **ENGINE)
  llm.load_lora_weights(lora, _adapter(model))
  runner = llm.llm_engine.runner
  assert runner.kv_cache.stacked_layers == 2 and runner.kv_cache.recurrent.is_stacked
  # the steps in their largest shape only: one step to compile per mode
  runner.row_buckets, runner.token_buckets = runner.row_buckets[-1:], runner.token_buckets[-1:]
  got = []
  requests = [(prompt, scored, None), (prompt, params, None), (sibling, params, None),
              (sibling, scored, lora), (sibling, params, lora)]  # fmt: skip
  for tokens, sampling, request in requests:
    before = llm.llm_engine.kv_cache_stats.prefix_cache_hits
    (out,) = llm.generate([tokens], sampling, lora_request=request, use_tqdm=False)
    sample = out.outputs[0]
    got.append((
      list(sample.token_ids),
      _bits([d[t].logprob for d, t in zip(sample.logprobs, sample.token_ids)]),
      _bits([d[t].logprob for d, t in zip((out.prompt_logprobs or [])[1:], tokens[1:])]),
      llm.llm_engine.kv_cache_stats.prefix_cache_hits - before,
    ))  # fmt: skip
  assert [r[3] for r in got] == [0, 36, 32, 0, 36], [r[3] for r in got]
  assert got[3][1].tolist() != got[2][1].tolist()  # the adapter moved the bits
  assert got[4][0] == got[3][0] and got[4][1].tolist() == got[3][1].tolist()
  sequences = [p + r[0] for p, r in zip((prompt, prompt, sibling), got)]
  want = token_logprobs(batch_invariant_model(model), jnp.asarray(sequences), block_size=4)
  want = _bits(want)  # [3, 42]: every token's after the first
  np.testing.assert_array_equal(np.concatenate([got[0][2], got[0][1]]), want[0])
  for i in (1, 2):
    np.testing.assert_array_equal(got[i][1], want[i][-6:])
  with count_compiles() as compiles:
    llm.generate([sibling], params, lora_request=lora, use_tqdm=False)
  assert compiles.count == 0
  other = _model(seed=7)
  assert_load_weights_fill_the_stacks(llm, other, _model(seed=3))  # a trainer's unrolled module
  broken = nnx.state(other)
  broken["layers"][5]["mixer"]["w_qkv"] = nnx.Param(jnp.zeros((80, 16)))
  with pytest.raises(ValueError, match=r"layers\.5\.mixer\.w_qkv: expected shape \(80, 32\)"):
    llm.load_weights(broken)


def test_ahead_of_time_compilation_lowers_the_scanned_steps(tmp_path):
  """`jaxengine compile`'s engine with ``scan_layers`` (the default it takes for a TPU): the
  stacked pages and the stacked state pool (``[Ll, S, ...]``, snapshot slots with prefix
  caching) beside them; the ragged step and the k-step loop lower with the rows' state slots
  (`StepRows` offsets per linear layer)."""
  import json

  from jaxengine.aot.executables import abstract_engine, engine_executables
  from jaxengine.engine_config import EngineConfig

  hf = dict(
    CONFIG, architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text",
    num_hidden_layers=10, layer_types=list(_config(10).layer_types),
    rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5},
  )  # fmt: skip
  del hf["rope_theta"], hf["partial_rotary_factor"]
  (tmp_path / "config.json").write_text(json.dumps(hf))
  config = EngineConfig(max_num_reqs=2, max_num_batched_tokens=8, num_decode_steps=2,
                        enable_prefix_caching=True, scan_layers=True)  # fmt: skip
  engine = abstract_engine(str(tmp_path), config, jax.devices(), jnp.float32, "cpu")
  engine.set_num_blocks(8)
  assert engine.kv_cache.stacked_layers == 2
  assert engine.kv_cache.recurrent.delta[0].shape == (8, 5, 4, 8, 12)  # 1 + 2 + 2 snapshots
  executables = {e.name: e for e in engine_executables(engine)}
  for name in ("ragged_step", "decode_steps"):
    executables[name].lower()


def test_the_platform_default_and_refusals():
  """Qwen3.5 scans by default on accelerators (unrolled on CPU); a non-bool ``scan_layers`` is
  refused by the config."""
  config = _config(4)
  assert scan_config(config, None, platform="tpu").scan_layers
  assert not scan_config(config, None, platform="cpu").scan_layers
  assert scanned_model(_model(4), None, platform="tpu").config.scan_layers
  with pytest.raises(ValueError, match="scan_layers must be a bool, got 1"):
    dataclasses.replace(config, scan_layers=1)
  assert jax.default_backend() == "cpu"
