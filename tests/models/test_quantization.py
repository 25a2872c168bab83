"""``quantization="int8"`` / ``"fp8"``: weight-only, per-output-row quantization of the projections.

- `quantize_rows`: int8 values in ``[-127, 127]`` with each row's largest magnitude at 127, the
  error of a value at most half its row's scale; fp8 within float8_e4m3fn's relative rounding; a
  zero row; one compile per shape.
- Engines on the tiny Llama: int8 and fp8 agree with the float32 engine within the measured
  bounds (prompt logprobs, greedy tokens); the projections' device bytes are under 0.3x float32's.
- `load_weights` of float weights (named tensors or a whole state) re-quantizes them with nothing
  compiled, and the engine then matches a fresh quantized engine built from those weights exactly;
  sleep and wake (level 1, level 2 then `load_weights`) compile nothing and change nothing.
- ``quantization="int4"`` is refused before anything is built.
- Gemma's projections are quantized too.
- A mixture of experts' expert matrices are quantized per expert and output row (the router stays
  float): `grouped_linear` with scales equals the product by the dequantized experts; tiny
  Qwen3-MoE and Mixtral engines (`moe_checkpoints`) agree with their float32 engine within the
  measured bounds, their expert bytes under 0.3x float32's; `load_weights` re-quantizes a whole
  set of experts with nothing compiled, and a part of one keeps the other experts bit for bit.
- On a mesh: `test_quantization_mesh.py`.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import transformers
from flax import nnx
from moe_checkpoints import hf_moe_model
from step_shapes import one_shape

import jaxengine as je
from jaxengine.engine.engine_flags import add_engine_flags, engine_flag_options
from jaxengine.engine_config import EngineConfig
from jaxengine.models import grouped_matmul, token_logprobs
from jaxengine.models.gemma import Gemma
from jaxengine.models.gemma_checkpoints import config_from_hf
from jaxengine.models.quantization import FORMATS, dequantize_rows, quantize_model, quantize_rows
from jaxengine.models.weights import named_weights, state_leaves
from jaxengine.testing import count_compiles, tiny_llama

OPTIONS = dict(max_num_reqs=4, max_model_len=64, num_kv_blocks=32, block_size=8)
PROMPTS = [[1, 5, 9, 33, 70, 100, 3, 4], [7, 8, 9, 10], [200, 100, 50, 25, 12, 6, 90, 17, 41]]
GREEDY = je.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)

#: Measured max |prompt logprob difference| against the float32 engine on the tiny Llama
#: (`PROMPTS`, 2-core CPU): int8 0.019, fp8 0.23 (3 mantissa bits); the bounds leave ~2x room.
LOGPROB_BOUNDS = {"int8": 0.05, "fp8": 0.5}


def _model(seed: int = 0):
  return tiny_llama(seed, max_position_embeddings=64)[0]


def _run(llm) -> list:
  return llm.generate(PROMPTS, GREEDY, use_tqdm=False)


def _prompt_logprobs(outputs) -> np.ndarray:
  values = [
    entry[token].logprob
    for out in outputs
    for entry, token in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])
  ]
  return np.asarray(values)


def _tokens(outputs) -> list[list[int]]:
  return [list(out.outputs[0].token_ids) for out in outputs]


def _nbytes(runner, paths) -> int:
  leaves = state_leaves(runner.weights)
  return sum(leaves[path].nbytes for path in paths)


@pytest.fixture(scope="module")
def float_outputs():
  return _run(je.LLM(_model(), **OPTIONS))


# --- quantize_rows --------------------------------------------------------------------------------


def test_int8_rows_reach_127_and_round_to_half_a_scale():
  w = jax.random.normal(jax.random.key(0), (6, 4, 32), jnp.float32)
  rows = quantize_rows(w, quantization="int8", in_axes=(2,))
  assert rows.values.dtype == jnp.int8 and rows.values.shape == (6, 4, 32)
  assert rows.scale.dtype == jnp.float32 and rows.scale.shape == (6, 4)
  np.testing.assert_array_equal(np.abs(np.asarray(rows.values, np.int32)).max(-1), 127)
  np.testing.assert_allclose(rows.scale, np.abs(w).max(-1) / 127, rtol=1e-6)
  error = np.abs(np.asarray(dequantize_rows(rows)) - np.asarray(w))
  assert (error <= np.asarray(rows.scale)[..., None] / 2 * (1 + 1e-5)).all()


def test_fp8_rows_within_e4m3_rounding():
  w = jax.random.normal(jax.random.key(1), (8, 48), jnp.float32)
  rows = quantize_rows(w, quantization="fp8", in_axes=(1,))
  assert rows.values.dtype == jnp.float8_e4m3fn
  np.testing.assert_allclose(rows.scale, np.abs(w).max(-1) / 448, rtol=1e-6)
  np.testing.assert_array_equal(np.abs(np.asarray(rows.values, np.float32)).max(-1), 448)
  # 3 mantissa bits: relative rounding error 2**-4, plus subnormals below 2**-6 * scale.
  w, back = np.asarray(w), np.asarray(dequantize_rows(rows))
  bound = np.abs(w) * 2**-4 + np.asarray(rows.scale)[:, None] * 2**-9
  assert (np.abs(back - w) <= bound).all()


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_a_zero_row_has_scale_zero_and_zero_values(quantization):
  w = jnp.zeros((3, 16)).at[1].set(jnp.arange(16.0) - 8)
  rows = quantize_rows(w, quantization=quantization, in_axes=(1,))
  assert float(rows.scale[0]) == 0.0 and float(rows.scale[2]) == 0.0
  assert not np.asarray(rows.values[0], np.float32).any()
  np.testing.assert_allclose(dequantize_rows(rows)[1], w[1], rtol=0.07)


def test_quantize_rows_compiles_once_per_shape():
  w, other = jnp.ones((5, 7, 9)), jnp.full((5, 7, 9), 2.0, jnp.float32)
  quantize_rows(w, quantization="int8", in_axes=(1, 2))
  with count_compiles() as compiles:
    quantize_rows(other, quantization="int8", in_axes=(1, 2))
    quantize_rows(np.full((5, 7, 9), 3.0, np.float32), quantization="int8", in_axes=(1, 2))
  assert compiles.count == 0


# --- engines ----------------------------------------------------------------------------------


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_quantized_engine_agrees_with_float32(quantization, float_outputs):
  llm = je.LLM(_model(), quantization=quantization, **OPTIONS)
  outputs = _run(llm)
  diff = np.abs(_prompt_logprobs(outputs) - _prompt_logprobs(float_outputs))
  assert 0 < diff.max() < LOGPROB_BOUNDS[quantization]
  # Greedy continuations: the first token of every prompt agrees (measured: int8 all 24 tokens;
  # fp8 15 of 24, a random tiny model's logits being nearly flat).
  float_tokens, tokens = _tokens(float_outputs), _tokens(outputs)
  assert [t[0] for t in tokens] == [t[0] for t in float_tokens]
  if quantization == "int8":
    assert tokens == float_tokens


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_projection_bytes_under_0_3x_float32(quantization):
  float_llm = je.LLM(_model(), **OPTIONS)
  llm = je.LLM(_model(), quantization=quantization, **OPTIONS)
  runner = llm.llm_engine.runner
  paths = list(runner.quantized)
  assert len(paths) == 2 * 7  # q, k, v, o, gate, up, down in each of the 2 layers
  float_bytes = _nbytes(float_llm.llm_engine.runner, paths)
  quantized_bytes = _nbytes(runner, paths) + _nbytes(
    runner, [q.scale_path for q in runner.quantized.values()]
  )
  # [out, in] one byte each plus 4 bytes per output row, against 4 bytes each: measured 0.264x
  # here (77,824 of 294,912 bytes; in = 64 or 128 wide, so the scales weigh more than on a real
  # model: SmolLM2-135M's 576-wide rows give 0.252x).
  assert quantized_bytes < 0.3 * float_bytes
  leaves = state_leaves(runner.weights)
  assert leaves[("embed",)].dtype == jnp.float32  # the embedding (tied head) stays float


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_load_weights_requantizes_without_compiling(quantization):
  llm = je.LLM(_model(0), quantization=quantization, **OPTIONS)
  before = _run(llm)
  new_model = _model(1)
  named = {name: np.array(a, copy=True) for name, a in named_weights(new_model)}
  with count_compiles() as compiles:
    llm.load_weights(named)
    loaded = _run(llm)
  assert compiles.count == 0
  fresh = _run(je.LLM(_model(1), quantization=quantization, **OPTIONS))
  assert _tokens(loaded) != _tokens(before)
  np.testing.assert_array_equal(_prompt_logprobs(loaded), _prompt_logprobs(fresh))
  assert _tokens(loaded) == _tokens(fresh)
  # A whole float state (a trainer's module): the same, still without compiling.
  llm.load_weights(nnx.state(_model(0)))
  with count_compiles() as compiles:
    llm.load_weights(nnx.state(new_model))
    again = _run(llm)
  assert compiles.count == 0
  np.testing.assert_array_equal(_prompt_logprobs(again), _prompt_logprobs(fresh))


@pytest.mark.parametrize("level", [1, 2])
def test_a_quantized_engine_sleeps_and_wakes_without_compiling(level):
  """Level 1 keeps the int8 values and scales in host memory; level 2 discards them and
  `load_weights` of float tensors re-quantizes them. Nothing compiles; the same outputs."""
  llm = je.LLM(_model(), quantization="int8", **OPTIONS)
  before = _run(llm)
  named = {name: np.array(a, copy=True) for name, a in named_weights(_model())}
  where = [(a.sharding, a.dtype) for a in jax.tree.leaves(llm.llm_engine.runner.weights)]
  llm.sleep(level=level)
  with count_compiles() as compiles:
    llm.wake_up(tags=["weights"])
    if level == 2:
      llm.load_weights(named)
    llm.wake_up(tags=["kv_cache"])
    after = _run(llm)
  assert compiles.count == 0
  assert _tokens(after) == _tokens(before)
  np.testing.assert_array_equal(_prompt_logprobs(after), _prompt_logprobs(before))
  assert [(a.sharding, a.dtype) for a in jax.tree.leaves(llm.llm_engine.runner.weights)] == where


def test_load_weights_refuses_a_bad_tensor_of_a_quantized_matrix():
  llm = je.LLM(_model(), quantization="int8", **OPTIONS)
  name = "model.layers.0.self_attn.q_proj.weight"
  shape = dict(named_weights(_model()))[name].shape
  with pytest.raises(ValueError, match="q_proj"):
    llm.load_weights({name: np.full(shape, np.nan, np.float32)})
  with pytest.raises(ValueError, match="q_proj"):
    llm.load_weights({name: np.zeros(shape, np.int8)})  # float tensors only
  own = llm.llm_engine.runner.weights  # the quantized layout: values and their scales
  for state in (own, nnx.to_pure_dict(own)):
    with pytest.raises(ValueError, match=r"float model's weights .* 'layers\.0\.attn\.scales"):
      llm.load_weights(state)


def test_int4_is_refused_before_anything_is_built():
  with pytest.raises(ValueError, match=r"quantization must be None or one of .*'int4'"):
    EngineConfig(quantization="int4")
  model = _model()
  with count_compiles() as compiles, pytest.raises(ValueError, match="'int4'"):
    je.LLM(model, quantization="int4", **OPTIONS)
  assert compiles.count == 0


def test_a_model_without_quantizable_projections_is_refused():
  class Plain(nnx.Module):
    def __init__(self):
      self.w = nnx.Param(jnp.ones((2, 2)))

  with pytest.raises(ValueError, match="Plain has none"):
    quantize_model(Plain(), "int8")


# --- other architectures ----------------------------------------------------------------------


def test_gemma_projections_are_quantized():
  config = transformers.Gemma2Config(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
    query_pre_attn_scalar=16,
    layer_types=["full_attention", "full_attention"],
  ).to_dict()
  model = Gemma(config_from_hf(config, "gemma2"), rngs=nnx.Rngs(0))
  quantized = quantize_model(model, "int8")
  assert len(quantized.leaves) == 2 * 7
  ids = jnp.asarray([[1, 5, 9, 33, 70, 10, 3, 4]])
  diff = np.abs(token_logprobs(quantized.model, ids) - token_logprobs(model, ids))
  assert 0 < diff.max() < 0.05  # measured 0.021 (fp8: 0.16)


# --- mixture of experts -----------------------------------------------------------------------


@pytest.mark.parametrize("product", ["cpu", "ragged"])
@pytest.mark.parametrize("batch_invariant", [False, True])
@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_grouped_linear_with_scales_equals_the_dequantized_product(
  quantization, batch_invariant, product, monkeypatch
):
  """Each row's result scaled by its own expert's ``[out]`` scales: the product by the
  dequantized experts, in either grouped product (the GPU/TPU ragged dot, lowered densely on
  CPU, or the CPU form), rows past the groups zero."""
  if product == "ragged":
    monkeypatch.setattr(grouped_matmul, "_every_group_then_pick", grouped_matmul._ragged)
  rng = np.random.default_rng(0)
  sizes = jnp.asarray([3, 0, 6, 4], jnp.int32)  # an empty expert; 13 + 2 rows past the groups
  x = jnp.asarray(rng.standard_normal((15, 24)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((4, 24, 16)), jnp.float32)  # [X, in, out]
  rows = quantize_rows(w, quantization=quantization, in_axes=(1,))
  assert rows.scale.shape == (4, 16)
  np.testing.assert_allclose(
    rows.scale, np.abs(np.asarray(w)).max(1) / FORMATS[quantization].max_value, rtol=1e-6
  )
  grouped = grouped_matmul.grouped_linear
  got = grouped(x, rows.values, sizes, scale=rows.scale, batch_invariant=batch_invariant)
  want = grouped(x, dequantize_rows(rows), sizes, batch_invariant=batch_invariant)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  assert not np.asarray(got[13:]).any()


def test_moe_experts_are_quantized_per_expert_and_row_and_the_router_is_not():
  model, _ = tiny_llama(
    max_position_embeddings=64,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    moe_layers=(0,),
  )
  quantized = quantize_model(model, "int8")
  leaves = state_leaves(nnx.state(quantized.model))
  assert leaves[("layers", 0, "mlp", "expert_up")].dtype == jnp.int8
  assert leaves[("layers", 0, "mlp", "scales", "expert_up")].shape == (4, 32)  # [X, F]
  assert leaves[("layers", 0, "mlp", "scales", "expert_down")].shape == (4, 64)  # [X, E]
  assert leaves[("layers", 0, "mlp", "router")].dtype == jnp.float32
  assert leaves[("layers", 1, "mlp", "w_up")].dtype == jnp.int8  # the dense layer
  assert len(quantized.leaves) == 2 * 4 + 3 + 3  # attention, the dense MLP, the experts


MOE_OPTIONS = dict(max_num_reqs=4, max_model_len=64)
MOE_PROMPTS = [
  [1, 5, 9, 33, 70, 90, 3, 4],
  [5, 17, 90, 3, 64, 21, 8, 77, 33, 7, 41, 12, 60, 2, 19, 44],
  [50, 60, 70],
]
#: Top 2 logprobs of each generated token: the float engine's margin between its first two.
MOE_GREEDY = je.SamplingParams(
  temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=0, logprobs=2
)
#: Measured max |prompt logprob difference| against the float32 engine (`MOE_PROMPTS`, 2-core
#: CPU): int8 0.034 (Qwen3-MoE) / 0.040 (Mixtral), fp8 0.47 / 0.55 (every matrix of these
#: 32-wide models at 3 mantissa bits); the bounds leave ~2x room.
MOE_LOGPROB_BOUNDS = {"int8": 0.1, "fp8": 1.0}


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def moe_runs(request, tmp_path_factory):
  """``{quantization or None: (outputs, runner)}`` of one tiny checkpoint's engines, each step
  in one shape (`one_shape`: they pad alike). The float engine is tests/models/test_moe.py's
  engine of the checkpoint (its routed experts returned, which change no output), whose
  executables the run's compilation cache then serves."""
  directory = tmp_path_factory.mktemp(request.param)
  hf_moe_model(request.param).save_pretrained(directory)
  runs = {}
  for quantization in (None, "int8", "fp8"):
    options = {"quantization": quantization, "enable_return_routed_experts": not quantization}
    llm = one_shape(je.LLM(directory, **options, **MOE_OPTIONS))
    runs[quantization] = (llm.generate(MOE_PROMPTS, MOE_GREEDY, use_tqdm=False), llm)
  return runs


def _top2_margins(output) -> list[float]:
  """The gap between the two largest logprobs at each generated token."""
  tops = [sorted((e.logprob for e in entries.values()), reverse=True) for entries in output]
  return [top[0] - top[1] for top in tops]


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_quantized_moe_engines_agree_with_float32(quantization, moe_runs):
  """Prompt logprobs within the bound; greedy tokens the same up to the first position where the
  float engine's two best tokens are less than twice the bound apart (a shift of each logprob
  by less than the bound cannot swap two tokens further apart). Measured, tokens before the
  first difference of the 18: int8 14 (Qwen3-MoE; the flip at a float margin of 0.026) and 12
  (Mixtral; at 0.016), fp8 4 (at 0.038, 0.07, 0.21) and 12."""
  bound = MOE_LOGPROB_BOUNDS[quantization]
  float_outputs, outputs = moe_runs[None][0], moe_runs[quantization][0]
  diff = np.abs(_prompt_logprobs(outputs) - _prompt_logprobs(float_outputs))
  assert 0 < diff.max() < bound
  for want, got in zip(float_outputs, outputs):
    margins = _top2_margins(want.outputs[0].logprobs)
    for token, other, margin in zip(want.outputs[0].token_ids, got.outputs[0].token_ids, margins):
      if token != other:
        assert margin < 2 * bound, (token, other, margin)
        break


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_quantized_moe_expert_bytes_under_0_3x_float32(quantization, moe_runs):
  float_leaves = state_leaves(moe_runs[None][1].llm_engine.runner.weights)
  runner = moe_runs[quantization][1].llm_engine.runner
  leaves = state_leaves(runner.weights)
  experts = [path for path in runner.quantized if path[-1].startswith("expert_")]
  assert len(experts) == 3 * 2  # gate, up and down of the 2 sparse layers
  float_bytes = sum(float_leaves[path].nbytes for path in experts)
  quantized_bytes = sum(
    leaves[path].nbytes + leaves[runner.quantized[path].scale_path].nbytes for path in experts
  )
  # [X, out, in] one byte each plus 4 per expert and output row, against 4 bytes each: measured
  # 0.292x (Qwen3-MoE 28,672 of 98,304 bytes, Mixtral 14,336 of 49,152; 16 or 32 wide rows).
  assert quantized_bytes < 0.3 * float_bytes
  routers = [path for path in leaves if path[-1] == "router"]
  assert routers and all(leaves[path].dtype == jnp.float32 for path in routers)


def test_load_weights_requantizes_moe_experts_whole_or_in_part(tmp_path):
  """Every tensor (negated, then back): nothing compiled, and the first outputs again exactly.
  One expert's tensor: that expert re-quantized, the others kept bit for bit (this compiles, as
  a partial update of a float stack does)."""
  hf_moe_model("mixtral").save_pretrained(tmp_path)
  tensors = safetensors.numpy.load_file(tmp_path / "model.safetensors")
  llm = one_shape(je.LLM(tmp_path, quantization="int8", **MOE_OPTIONS))  # as `moe_runs`' engine
  runner = llm.llm_engine.runner
  before = llm.generate(MOE_PROMPTS, GREEDY, use_tqdm=False)
  up = "model.layers.0.block_sparse_moe.experts.{}.w3.weight"
  path = ("layers", 0, "mlp", "expert_up")
  scale_path = runner.quantized[path].scale_path
  changed = {name: -t for name, t in tensors.items()}
  with count_compiles() as compiles:
    llm.load_weights(changed)
    negated = llm.generate(MOE_PROMPTS, GREEDY, use_tqdm=False)
    llm.load_weights(tensors)
    again = llm.generate(MOE_PROMPTS, GREEDY, use_tqdm=False)
  assert compiles.count == 0
  assert _prompt_logprobs(negated).tolist() != _prompt_logprobs(before).tolist()
  np.testing.assert_array_equal(_prompt_logprobs(again), _prompt_logprobs(before))
  old = state_leaves(runner.weights)
  llm.load_weights({up.format(2): tensors[up.format(2)] * 3})
  new = state_leaves(runner.weights)
  given = jnp.asarray(tensors[up.format(2)].T * 3)  # the (F, E) tensor as the stack's [E, F]
  rows = quantize_rows(given, quantization="int8", in_axes=(0,))
  np.testing.assert_array_equal(new[path][2], rows.values)
  np.testing.assert_array_equal(new[scale_path][2], rows.scale)
  others = np.asarray([0, 1, 3])
  np.testing.assert_array_equal(new[path][others], old[path][others])
  np.testing.assert_array_equal(new[scale_path][others], old[scale_path][others])


def test_the_quantization_flag_sets_the_field():
  parser = argparse.ArgumentParser()
  add_engine_flags(parser)
  assert engine_flag_options(parser.parse_args(["--quantization", "fp8"]))["quantization"] == "fp8"
  assert "quantization" not in engine_flag_options(parser.parse_args([]))
  with pytest.raises(SystemExit):
    parser.parse_args(["--quantization", "int4"])
