"""Qwen3.5's layers, configs and refusals: the Gated DeltaNet's batch-invariant rows, the k-step
loop's null state slot, quantized projections against their dequantized copies, the checkpoint
names `named_weights` gives back, the state pool's bytes, ahead-of-time lowering with the pool,
and the configs refused by name. The engines against transformers are in
tests/models/test_qwen3_5.py, whose tiny checkpoint these share.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from flax import nnx
from test_qwen3_5 import PROMPTS, TEXT, _bits, _dequantized, _write

import jaxengine as je
from jaxengine.models import token_logprobs
from jaxengine.models.quantization import quantize_model
from jaxengine.models.qwen3_5 import Qwen3_5
from jaxengine.models.qwen3_5_checkpoints import config_from_hf
from jaxengine.models.safetensors_loader import load_safetensors

pytestmark = pytest.mark.bitwise  # compares bits between programs: tests/conftest.py


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  directory = tmp_path_factory.mktemp("qwen3_5")
  return directory, _write(directory)


def test_gated_deltanet_row_bits_do_not_depend_on_the_number_of_rows():
  """In batch-invariant mode a request's output and new state in a decode step are the same bits
  among 64 requests as alone, with 128-wide key heads (where a plain sum along the last axis
  of 64 rows differs in the last bits from one row's on XLA:CPU: the L2 norms)."""
  from jaxengine.models.gated_deltanet import GatedDeltaNet, StepRows

  hf = dict(TEXT, linear_key_head_dim=128, linear_num_key_heads=1, linear_num_value_heads=2)
  layer = GatedDeltaNet(config_from_hf(hf, "qwen3_5"), dtype=jnp.float32, rngs=nnx.Rngs(3))
  layer.set_attributes(batch_invariant=True)
  rng = np.random.default_rng(0)
  x = rng.standard_normal((64, 32)).astype(np.float32)
  conv = rng.standard_normal((65, 3, layer.w_qkv.shape[0])).astype(np.float32)
  delta = rng.standard_normal((65, 2, 128, 12)).astype(np.float32) * 0.1

  @nnx.jit
  def step(layer, x, conv, delta):
    r = x.shape[0]
    rows = StepRows(
      starts=jnp.arange(r), lengths=jnp.ones(r, jnp.int32), slots=jnp.arange(1, r + 1),
      fresh=jnp.zeros(r, bool), max_length=jnp.int32(1),
    )  # fmt: skip
    out, conv, delta = layer(x, conv, delta, rows)
    return out[0], conv[1], delta[1]

  alone = step(layer, x[:1], conv[:2], delta[:2])
  among = step(layer, x, conv, delta)
  for a, b in zip(alone, among):
    np.testing.assert_array_equal(_bits(a), _bits(b))


def test_k_step_loop_gives_a_row_that_stopped_the_null_state_slot():
  """A row that stops inside the k-step loop (its lookahead pages used up) while others go on
  computes into the null slot 0 from then on, so its state stays that of its last sampled
  token for the step after the loop."""
  from jaxengine.worker.multi_step import DecodeStepsInputs, _decode_metadata

  inputs = DecodeStepsInputs(
    block_tables=jnp.ones((3, 4), jnp.int32), num_reqs=jnp.int32(3),
    max_num_steps=jnp.asarray([4, 1, 0]), max_output_tokens=jnp.full(3, 9),
    stop_ids=jnp.full((3, 1), -1), end_on_first_finish=jnp.bool_(False),
    state_slots=jnp.asarray([2, 3, 1], jnp.int32),
  )  # fmt: skip
  running = jnp.asarray([True, False, False])
  metadata = _decode_metadata(inputs, jnp.asarray([5, 6, 7]), running, block_size=4)
  assert metadata.state_slots.tolist() == [2, 0, 0]


def test_quantized_projections_and_what_stays_float(checkpoint):
  """``quantization``: every layer's projections (a linear layer's five, the gated attention's
  four, the MLP's three) are quantized; the convolution taps, decay parameters, norms,
  embedding and output head stay float32. Through `token_logprobs`, int8 and fp8 models equal
  their dequantized float copies within 1e-4."""
  model, _ = load_safetensors(checkpoint[0])
  quantized = quantize_model(model, "int8")
  names = {".".join(map(str, path[2:])) for path in quantized.leaves if path[1] in (0, 3)}
  assert names == {
    *(f"mixer.{w}" for w in ("w_qkv", "w_z", "w_b", "w_a", "w_out", "wq", "wk", "wv", "wo")),
    *(f"mlp.{w}" for w in ("w_gate", "w_up", "w_down")),
  }
  assert len(quantized.leaves) == 3 * 8 + 7
  prompt = jnp.asarray([PROMPTS[0]], jnp.int32)
  for fmt in ("int8", "fp8"):
    got = token_logprobs(quantize_model(model, fmt).model, prompt)
    np.testing.assert_allclose(got, token_logprobs(_dequantized(model, fmt), prompt), atol=1e-4)


def _module(**fields) -> Qwen3_5:
  hf = transformers.Qwen3_5TextConfig(**{**TEXT, **fields}).to_dict()
  return Qwen3_5(config_from_hf(hf, "qwen3_5"), rngs=nnx.Rngs(0))


def test_a_hybrid_without_attention_layers_is_refused_by_name():
  """Pages hold the attention layers' keys and values: a model of linear layers only is refused
  naming its ``layer_types``."""
  model = _module(num_hidden_layers=3, layer_types=["linear_attention"] * 3)
  with pytest.raises(ValueError, match=r"layer_types=.*needs at least one full-attention layer"):
    je.LLM(model, max_num_reqs=2, max_model_len=32, block_size=4)


def test_a_memory_too_small_for_the_state_pool_names_its_slots():
  """With prefix caching and drafts, the pool's slots (the null slot, ``k + 1`` a request, the
  snapshots) are named where the memory is too small for them."""
  spec = {"method": "ngram", "num_speculative_tokens": 3}
  with pytest.raises(
    ValueError,
    match=r"\(21 slots with the null slot: 4 a request .*"
    r"speculative decoding's draft states\), 4 prefix-cache snapshots; ",
  ):
    je.LLM(_module(), max_num_reqs=4, max_model_len=32, block_size=4, kv_cache_memory_bytes=4096,
           enable_prefix_caching=True, speculative_config=spec)  # fmt: skip


def test_routed_experts_of_a_dense_hybrid_are_refused():
  """A dense Qwen3.5 has no MoE layers whose experts `enable_return_routed_experts` could
  return: refused by name."""
  with pytest.raises(ValueError, match=r"enable_return_routed_experts=.*Qwen3_5"):
    je.LLM(_module(), max_num_reqs=2, max_model_len=32, enable_return_routed_experts=True)


def test_named_weights_give_back_the_checkpoint_tensors(checkpoint):
  """`named_weights` (what `LLM.load_weights` takes) returns every tensor in the checkpoint's
  layout: ``in_proj_qkv``'s and ``conv1d``'s rows back in ``[q | k | v]`` order from the
  model's key-head groups (which differ from it: 2 key heads)."""
  import safetensors.numpy
  from weight_checks import assert_named_weights_are_the_checkpoint

  model, _ = load_safetensors(checkpoint[0])
  assert_named_weights_are_the_checkpoint(model, checkpoint[0])
  tensors = safetensors.numpy.load_file(checkpoint[0] / "model.safetensors")
  stored = np.asarray(model.layers[0].mixer.w_qkv[...])
  assert not np.array_equal(stored, tensors["model.layers.0.linear_attn.in_proj_qkv.weight"])


def test_a_model_axis_that_does_not_divide_the_key_heads_is_refused():
  """The Gated DeltaNet layers split by key head: 4 devices for 2 key heads are refused before
  anything is built (the config's other fields as the engine's defaults)."""
  import types

  from jaxengine.worker.recurrent_state import check_hybrid_config

  config = types.SimpleNamespace(
    enable_prefix_caching=None, speculative_config=None, scan_layers=False,
    tensor_parallel_size=4, mesh=None,
  )  # fmt: skip
  with pytest.raises(ValueError, match=r"tensor_parallel_size=4 .* linear_num_key_heads=2"):
    check_hybrid_config(_module(), config)


def test_config_defaults_and_refusals():
  hf = dict(TEXT, layer_types=None, num_hidden_layers=8, rope_parameters=None)
  config = config_from_hf(hf, "qwen3_5")
  assert config.attention_layers == (3, 7) and config.linear_layers == (0, 1, 2, 4, 5, 6)
  assert config.partial_rotary_factor == 0.25 and config.rope_theta == 10000.0
  assert config.kv_cache_spec().num_layers == 2
  with pytest.raises(ValueError, match="attention_bias"):
    config_from_hf(dict(TEXT, attention_bias=True), "qwen3_5")
  with pytest.raises(ValueError, match="rope type 'yarn'"):
    config_from_hf(dict(TEXT, rope_parameters={"rope_type": "yarn"}), "qwen3_5")
  with pytest.raises(ValueError, match="layer_types"):
    config_from_hf(dict(TEXT, layer_types=["mamba"] * 4), "qwen3_5")


def test_state_pool_comes_out_of_kv_cache_memory_bytes():
  """``max_num_reqs + 1`` state slots beside the pages; their bytes leave the pages the rest of
  ``kv_cache_memory_bytes`` (a page: 4 positions of 2 heads of 16, keys and values, float32, one
  attention layer), and a budget that holds no page beside them is refused."""
  model = _module()
  pool_bytes = 3 * model.recurrent_state_spec.bytes_per_slot
  page_bytes = 4 * 2 * 16 * 2 * 4
  kw = dict(max_num_reqs=2, max_model_len=32, block_size=4)
  llm = je.LLM(model, kv_cache_memory_bytes=pool_bytes + 20 * page_bytes, **kw)
  runner = llm.llm_engine.cores[0].runner
  assert runner.num_blocks == 20 and runner.kv_cache.recurrent.num_slots == 3
  with pytest.raises(ValueError, match=r"kv_cache_memory_bytes=.*recurrent state"):
    je.LLM(model, kv_cache_memory_bytes=pool_bytes, **kw)


def test_ahead_of_time_compilation_lowers_the_steps_with_the_state_pool(checkpoint):
  """`jaxengine compile`'s engine (`abstract_engine`, here for this CPU): the state pool beside
  the pages (its bytes in the memory plan), the ragged step and the k-step loop lowered with the
  rows' state slots; with speculative decoding ``k + 1`` slots per row and the verify step
  lowered with the rows' routes (draft slots)."""
  from jaxengine.aot.executables import abstract_engine, engine_executables
  from jaxengine.aot.memory_plan import memory_plan
  from jaxengine.engine_config import EngineConfig

  config = EngineConfig(max_num_reqs=2, max_num_batched_tokens=8, num_decode_steps=2)
  engine = abstract_engine(str(checkpoint[0]), config, jax.devices(), jnp.float32, "cpu")
  pool_bytes = 3 * load_safetensors(checkpoint[0])[0].recurrent_state_spec.bytes_per_slot
  with_pool = memory_plan(engine, 2**30).other
  engine.recurrent_pool = lambda: None  # the same engine's plan without a pool
  assert with_pool == memory_plan(engine, 2**30).other + pool_bytes
  del engine.recurrent_pool
  engine.set_num_blocks(8)
  assert engine.kv_cache.recurrent.delta[0].shape == (3, 4, 8, 12)
  executables = {e.name: e for e in engine_executables(engine)}
  for name in ("ragged_step", "decode_steps"):
    executables[name].lower()  # the model's state slots traced: StepRows needs them
  spec = {"method": "ngram", "num_speculative_tokens": 2}
  engine = abstract_engine(
    str(checkpoint[0]), config.replace(speculative_config=spec), jax.devices(), jnp.float32, "cpu"
  )
  engine.set_num_blocks(8)
  assert engine.kv_cache.recurrent.delta[0].shape == (7, 4, 8, 12)  # 1 + 2 rows x 3 slots
  verify = next(e for e in engine_executables(engine) if e.name == "verify_step")
  verify.lower()
