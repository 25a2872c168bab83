"""Batch-invariant mode: a request's tokens and logprobs do not depend on its neighbours, and
`jaxengine.models.token_logprobs` (a trainer's forward pass) equals them bit for bit.

Float results are compared as bits (`np.float32.view(np.uint32)`), never with a tolerance.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from invariance import mixed_bits, random_adapter

import jaxengine as je
from jaxengine.models import token_logprobs
from jaxengine.models.batch_invariant import ROW_TILE, batch_invariant_model, row_tiled_dot
from jaxengine.models.paged_attention import PagedAttentionMetadata, ragged_paged_attention_xla
from jaxengine.reductions import fixed_logsumexp, fixed_sum
from jaxengine.testing import tiny_llama
from jaxengine.worker import device_steps

pytestmark = pytest.mark.bitwise  # compares bits between programs: tests/conftest.py

VOCAB = 256


def bits(values) -> np.ndarray:
  return np.asarray(values, np.float32).view(np.uint32)


# --- the arithmetic ------------------------------------------------------------------------------

_tiled = jax.jit(row_tiled_dot)
_fixed_sum = jax.jit(fixed_sum)


@settings(max_examples=15, deadline=None)
@given(
  rows=st.integers(1, 3 * ROW_TILE + 3), start=st.integers(0, 2 * ROW_TILE), seed=st.integers(0, 9)
)
def test_a_row_of_a_tiled_product_depends_on_that_row_only(rows, start, seed):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((start + rows + 5, 96), dtype=np.float32)
  w = jnp.asarray(rng.standard_normal((40, 96), dtype=np.float32))
  whole = np.asarray(_tiled(jnp.asarray(x), w))
  part = np.asarray(_tiled(jnp.asarray(x[start : start + rows]), w))
  np.testing.assert_array_equal(bits(part), bits(whole[start : start + rows]))
  np.testing.assert_allclose(part, x[start : start + rows] @ np.asarray(w).T, rtol=1e-4, atol=1e-4)


def test_a_tiled_product_keeps_leading_dims_and_the_requested_dtype():
  x = jnp.ones((2, 3, 8), jnp.bfloat16)
  w = jnp.ones((5, 8), jnp.bfloat16)
  out = row_tiled_dot(x, w, preferred_element_type=jnp.float32)
  chex.assert_shape(out, (2, 3, 5))
  assert out.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(out), 8.0)


def test_a_tokens_lora_update_depends_on_that_token_only():
  """`add_lora` in batch-invariant mode: a token's update (its own slot's ``B (A x)``) has the
  same bits in a call of 1, 4 or 40 tokens as in one of 300 (SmolLM2's width, 3 slots of rank
  8: XLA:CPU's plain einsums give other bits there), and the plain form's values."""
  from jaxengine.models.lora import LayerLoRA, add_lora

  rng = np.random.default_rng(0)
  n, width, rank, num_tokens = 3, 576, 8, 300
  a = jnp.asarray(rng.standard_normal((n + 1, width, rank), np.float32))
  b = jnp.asarray(rng.standard_normal((n + 1, rank, width), np.float32))
  x = jnp.asarray(rng.standard_normal((num_tokens, width), np.float32))
  y = jnp.asarray(rng.standard_normal((num_tokens, width), np.float32))
  slots = jnp.asarray(rng.integers(0, n + 1, num_tokens), jnp.int32)

  @functools.partial(jax.jit, static_argnums=3)
  def update(y, x, slots, fixed):
    return add_lora(y, x, LayerLoRA(slots, {"q_proj": (a, b)}), "q_proj", fixed)

  whole = np.asarray(update(y, x, slots, True))
  for lo, hi in ((0, 1), (5, 9), (40, 80)):
    part = update(y[lo:hi], x[lo:hi], slots[lo:hi], True)
    np.testing.assert_array_equal(bits(part), bits(whole[lo:hi]))
  np.testing.assert_allclose(whole, np.asarray(update(y, x, slots, False)), rtol=1e-4, atol=1e-3)


@settings(max_examples=15, deadline=None)
@given(width=st.integers(1, 300), rows=st.integers(1, 40), seed=st.integers(0, 9))
def test_a_fixed_sum_depends_on_the_row_alone(width, rows, seed):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((rows + 60, width), dtype=np.float32)
  whole = np.asarray(_fixed_sum(jnp.asarray(x)))
  part = np.asarray(_fixed_sum(jnp.asarray(x[3 : 3 + rows])))
  np.testing.assert_array_equal(bits(part), bits(whole[3 : 3 + rows]))
  np.testing.assert_allclose(part, x[3 : 3 + rows].sum(-1), rtol=1e-4, atol=1e-4)


def test_fixed_sum_axes_and_empty_rows():
  x = jnp.arange(24.0).reshape(2, 3, 4)
  np.testing.assert_array_equal(np.asarray(fixed_sum(x, axis=1)), np.asarray(x).sum(1))
  chex.assert_shape(fixed_sum(x, axis=0, keepdims=True), (1, 3, 4))
  np.testing.assert_array_equal(np.asarray(fixed_sum(jnp.zeros((3, 0)))), 0.0)


def test_fixed_logsumexp_matches_logsumexp_and_its_edge_cases():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((4, 1000), dtype=np.float32) * 10)
  np.testing.assert_allclose(
    np.asarray(fixed_logsumexp(x)), np.asarray(jax.nn.logsumexp(x, axis=-1)), rtol=1e-6
  )
  edge = jnp.array([[-jnp.inf, -jnp.inf], [0.0, jnp.inf], [0.0, jnp.nan]])
  out = np.asarray(fixed_logsumexp(edge))
  assert out[0] == -np.inf and out[1] == np.inf and np.isnan(out[2])
  chex.assert_shape(fixed_logsumexp(x, keepdims=True), (4, 1))


def _metadata(query_lens, seq_lens, tables) -> PagedAttentionMetadata:
  width = max(len(t) for t in tables)
  table = np.zeros((len(tables), width), np.int32)
  for row, pages in enumerate(tables):
    table[row, : len(pages)] = pages
  starts = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
  return PagedAttentionMetadata(
    slot_mapping=jnp.zeros(int(starts[-1]), jnp.int32),
    block_tables=jnp.asarray(table),
    query_start_loc=jnp.asarray(starts),
    seq_lens=jnp.asarray(seq_lens, jnp.int32),
    num_reqs=jnp.asarray(len(tables), jnp.int32),
  )


_attention = jax.jit(
  ragged_paged_attention_xla,
  static_argnames=("scale", "query_tile", "pages_per_chunk", "fixed_order", "sliding_window"),
)


@pytest.mark.parametrize("sliding_window", [None, 24])
def test_fixed_order_attention_of_a_request_ignores_the_rest_of_the_step(sliding_window):
  rng = np.random.default_rng(1)
  pages = [jnp.asarray(rng.standard_normal((24, 16, 2, 16), dtype=np.float32)) for _ in range(2)]
  q = jnp.asarray(rng.standard_normal((200, 4, 16), dtype=np.float32))
  kwargs = dict(scale=0.25, pages_per_chunk=4, fixed_order=True, sliding_window=sliding_window)
  # Request A: 30 query tokens ending a 100-token context in pages 1..7.
  alone = _attention(
    q[:30], *pages, _metadata([30], [100], [[1, 2, 3, 4, 5, 6, 7]]), query_tile=16, **kwargs
  )
  # The same request between two others, per-token work items, a longer neighbour.
  mixed_q = jnp.concatenate([q[100:103], q[:30], q[150:190]])
  md = _metadata([3, 30, 40], [3, 100, 200], [[8], [1, 2, 3, 4, 5, 6, 7], list(range(9, 22))])
  mixed = _attention(mixed_q, *pages, md, query_tile=1, **kwargs)
  np.testing.assert_array_equal(bits(mixed[3:33]), bits(alone))
  default = _attention(
    q[:30],
    *pages,
    _metadata([30], [100], [[1, 2, 3, 4, 5, 6, 7]]),
    query_tile=16,
    **{**kwargs, "fixed_order": False},
  )
  np.testing.assert_allclose(np.asarray(alone), np.asarray(default), rtol=1e-5, atol=1e-5)


# --- the engine ---------------------------------------------------------------------------------


#: The engines' size where a test needs no other (the crowded one has 32 rows): their steps and
#: sampler (`max_num_reqs` rows, `max_model_len` tokens of history) compile once for all of them.
ENGINE = dict(max_num_reqs=8, max_model_len=256, batch_invariant=True)


@pytest.fixture(scope="module")
def model():
  return tiny_llama(3, vocab_size=VOCAB)[0]


def _targets():
  rng = np.random.default_rng(5)
  prompts = [rng.integers(3, VOCAB, size=n).tolist() for n in (4, 37, 70, 150)]
  params = [
    je.SamplingParams(temperature=0, max_tokens=10, logprobs=2, ignore_eos=True),
    je.SamplingParams(temperature=1.0, seed=11, max_tokens=10, logprobs=0, ignore_eos=True),
    je.SamplingParams(
      temperature=0.7,
      top_k=30,
      top_p=0.9,
      seed=4,
      max_tokens=10,
      logprobs=1,
      prompt_logprobs=0,
      ignore_eos=True,
    ),
    je.SamplingParams(
      temperature=1.2,
      min_p=0.05,
      presence_penalty=0.5,
      seed=9,
      n=2,
      max_tokens=10,
      logprobs=0,
      ignore_eos=True,
    ),
  ]
  return prompts, params


def _others(count: int, seed: int):
  rng = np.random.default_rng(seed)
  prompts = [rng.integers(3, VOCAB, size=int(rng.integers(1, 120))).tolist() for _ in range(count)]
  params = [
    je.SamplingParams(
      temperature=float(rng.choice([0.0, 0.5, 1.0, 1.5])),
      top_k=int(rng.integers(0, 40)),
      max_tokens=int(rng.integers(1, 16)),
      logprobs=int(rng.integers(0, 3)),
    )
    for _ in range(count)
  ]
  return prompts, params


def _completions(llm, prompts, params, order, num_targets=4):
  """`{(target, sample): (token ids, [sampled logprobs], [prompt logprobs] or None)}` for the
  first `num_targets` requests, all submitted in `order`."""
  outputs = llm.generate(
    [{"prompt_token_ids": prompts[i]} for i in order], [params[i] for i in order], use_tqdm=False
  )
  by_index = dict(zip(order, outputs))
  result = {}
  for target in range(num_targets):
    out = by_index[target]
    prompt_values = None
    if out.prompt_logprobs is not None:
      prompt_values = [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], prompts[target][1:])]
    for sample in out.outputs:
      values = [d[t].logprob for d, t in zip(sample.logprobs, sample.token_ids)]
      result[target, sample.index] = (list(sample.token_ids), values, prompt_values)
  return result


def _assert_same_bits(expected, actual):
  assert expected.keys() == actual.keys()
  for key, (tokens, values, prompt_values) in expected.items():
    assert actual[key][0] == tokens, key
    np.testing.assert_array_equal(bits(actual[key][1]), bits(values), err_msg=str(key))
    if prompt_values is not None:
      np.testing.assert_array_equal(bits(actual[key][2]), bits(prompt_values), err_msg=str(key))


@pytest.fixture(scope="module")
def alone(model):
  """The targets, one at a time, on an engine without prefix caching or chunked prefill."""
  llm = je.LLM(model, **ENGINE, enable_prefix_caching=False)
  prompts, params = _targets()
  result = {}
  for i in range(len(prompts)):
    one = _completions(llm, [prompts[i]], [params[i]], [0], num_targets=1)
    result.update({(i, sample): value for (_, sample), value in one.items()})
  return result


@pytest.fixture(scope="module")
def crowded_llm(model):
  """Prefix caching on and a 40-token budget: long prompts are prefilled in chunks."""
  return je.LLM(
    model,
    max_num_reqs=32,
    max_model_len=256,
    batch_invariant=True,
    max_num_batched_tokens=40,
    enable_prefix_caching=True,
  )


@pytest.mark.parametrize("num_others, shuffle", [(7, False), (31, True)])
def test_tokens_and_logprob_bits_do_not_depend_on_the_other_requests(
  alone, crowded_llm, num_others, shuffle
):
  prompts, params = _targets()
  other_prompts, other_params = _others(num_others, seed=num_others)
  prompts, params = prompts + other_prompts, params + other_params
  order = list(range(len(prompts)))
  if shuffle:
    np.random.default_rng(0).shuffle(order)
  _assert_same_bits(alone, _completions(crowded_llm, prompts, params, order))
  # The second run of the same prompts hits the prefix cache for every full block.
  hits = crowded_llm.llm_engine.kv_cache_stats.prefix_cache_hits
  _assert_same_bits(alone, _completions(crowded_llm, prompts, params, order))
  assert crowded_llm.llm_engine.kv_cache_stats.prefix_cache_hits > hits


@pytest.mark.parametrize(
  "options",
  [
    dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3}),
    dict(num_decode_steps=4),
  ],
  ids=["speculative", "multi_step"],
)
def test_speculative_and_multi_step_decoding_keep_the_bits(model, alone, options):
  """Draft tokens are query tokens like any other, and a device loop of decode steps runs the
  same per-token arithmetic: the targets' tokens and logprobs stay those of plain decoding."""
  llm = je.LLM(model, **ENGINE, **options)
  prompts, params = _targets()
  other_prompts, other_params = _others(3, seed=5)
  order = list(range(len(prompts) + 3))
  _assert_same_bits(alone, _completions(llm, prompts + other_prompts, params + other_params, order))


def test_scanned_layers_keep_the_bits(model, alone):
  """``scan_layers=True``: the same tokens and logprob bits as the unrolled engine alone, and the
  trainer's `token_logprobs` of the engine's scanned model equal them bit for bit too."""
  llm = je.LLM(model, **ENGINE, scan_layers=True)
  assert llm.llm_engine.runner.kv_cache.stacked_layers is not None
  prompts, params = _targets()
  other_prompts, other_params = _others(3, seed=6)
  order = list(range(len(prompts) + 3))[::-1]
  _assert_same_bits(alone, _completions(llm, prompts + other_prompts, params + other_params, order))
  scanned = llm.llm_engine.runner.model
  (target, _), (tokens, values, _) = next(iter(alone.items()))
  sequence = jnp.asarray([prompts[target] + tokens], jnp.int32)
  trainer = np.asarray(token_logprobs(scanned, sequence))[0]
  np.testing.assert_array_equal(bits(trainer[len(prompts[target]) - 1 :]), bits(values))


def test_the_trainer_logprobs_equal_the_engines_bit_for_bit(model, alone):
  prompts, _ = _targets()
  for (target, _), (tokens, values, prompt_values) in alone.items():
    sequence = jnp.asarray([prompts[target] + tokens], jnp.int32)
    trainer = np.asarray(token_logprobs(model, sequence))[0]
    chex.assert_shape(trainer, (len(prompts[target]) + len(tokens) - 1,))
    completion = trainer[len(prompts[target]) - 1 :]
    np.testing.assert_array_equal(bits(completion), bits(values))
    if prompt_values is not None:
      np.testing.assert_array_equal(bits(trainer[: len(prompts[target]) - 1]), bits(prompt_values))


def test_trainer_parity_holds_after_load_weights_and_under_grad(model):
  """A policy update: the trainer's module changes, `load_weights` gives the engine the same
  weights; the engine's logprobs equal the trainer's (inside its jitted gradient) again."""
  trainer_model = tiny_llama(3, vocab_size=VOCAB)[0]
  llm = je.LLM(trainer_model, **ENGINE)
  # 40 tokens: the 64-token step the `alone` engine's 37-token prompt compiled
  prompt = np.random.default_rng(2).integers(3, VOCAB, size=40).tolist()
  params = je.SamplingParams(temperature=1.0, seed=1, max_tokens=12, logprobs=0, ignore_eos=True)

  @nnx.jit
  def loss_and_logprobs(module, sequence):
    def loss(m):
      lp = token_logprobs(m, sequence)
      return -lp.sum(), lp

    return nnx.value_and_grad(loss, has_aux=True)(module)

  before = None
  for _ in range(2):
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    values = [d[t].logprob for d, t in zip(out.logprobs, out.token_ids)]
    sequence = jnp.asarray([prompt + list(out.token_ids)], jnp.int32)
    (_, lp), grads = loss_and_logprobs(trainer_model, sequence)
    np.testing.assert_array_equal(bits(np.asarray(lp)[0, len(prompt) - 1 :]), bits(values))
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
    if before is not None:
      assert values != before  # the update changed the policy
    before = values
    # One SGD step on the trainer's module, then the same weights into the engine.
    nnx.update(
      trainer_model,
      jax.tree.map(lambda p, g: p - 0.5 * g, nnx.state(trainer_model, nnx.Param), grads),
    )
    llm.load_weights(trainer_model)


def test_batch_invariant_model_is_a_copy_sharing_weights(model):
  copy = batch_invariant_model(model)
  assert copy.batch_invariant and not model.batch_invariant
  assert copy.layers[0].attn.batch_invariant and copy.final_norm.batch_invariant
  assert copy.embed[...] is model.embed[...]


def test_one_row_bucket_and_no_step_compiles_after_precompile(model):
  """The sampler's shape is fixed in this mode (one row bucket), so `precompile` compiles one
  model step per token bucket (with and without prompt logprobs) and one sampler, and a mix of
  requests adds none."""
  device_steps.clear()  # this engine's executables alone
  llm = je.LLM(model, **ENGINE, max_num_batched_tokens=64, precompile=True)
  runner = llm.llm_engine.runner
  assert runner.row_buckets == [8] and runner.token_buckets[-1] == 64
  steps = [runner.ragged_forward, runner.sample_produced]
  sizes = [step._cache_size() for step in steps]
  assert sizes[1] == 1 and 1 <= sizes[0] <= 2 * len(runner.token_buckets)
  prompts, params = _others(9, seed=4)
  llm.generate([{"prompt_token_ids": p[:40]} for p in prompts], params, use_tqdm=False)
  assert [step._cache_size() for step in steps] == sizes


# --- LoRA and tensor parallelism ----------------------------------------------------------------


def test_lora_adapters_keep_the_bits_alone_and_in_a_batch(model):
  """``batch_invariant=True`` with ``enable_lora``: the adapters' products are row-tiled too
  (`jaxengine.models.lora.add_lora`), so an adapter's request and the base's have the same bits
  alone and in a shuffled batch mixing both; the adapter changes them."""
  llm = je.LLM(model, **ENGINE, max_num_batched_tokens=48, enable_lora=True, max_lora_rank=4)
  lora = je.LoRARequest("trainer", 1, "in memory")
  llm.load_lora_weights(lora, random_adapter(1))
  _, adapted = mixed_bits(llm, lora)
  _, plain = mixed_bits(llm)
  assert adapted[0][2].tolist() != plain[0][2].tolist()  # target 0 ran with the adapter
  assert np.array_equal(adapted[1][2], plain[1][2])  # target 1 without


# On 2 host devices (set before JAX starts): with tensor_parallel_size=2 a target's bits alone
# and in a shuffled batch, equal to `token_logprobs` of the engine's own (mesh-placed) weights;
# with LoRA too, the same bits alone and in a batch.
MESH_SCRIPT = """
import os, sys
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
import jax.numpy as jnp, numpy as np
from invariance import bits, mixed_bits, random_adapter
import jaxengine as je
from jaxengine.models import token_logprobs
from jaxengine.testing import tiny_llama

model, _ = tiny_llama(3, vocab_size=256)
kw = dict(tensor_parallel_size=2, max_num_reqs=8, max_model_len=128, batch_invariant=True,
          max_num_batched_tokens=48)
llm = je.LLM(model, **kw)
targets, alone = mixed_bits(llm)
served = llm.llm_engine.runner.model  # the engine's weights, on its mesh
wo = llm.llm_engine.runner.weights["layers"][0]["attn"]["wo"][...]
assert wo.sharding.spec[0] == "model", wo.sharding  # its output split, its input whole
for prompt, (tokens, sampled, prompt_bits) in zip(targets, alone):
  values = np.asarray(token_logprobs(served, jnp.asarray([prompt + tokens], jnp.int32)))[0]
  np.testing.assert_array_equal(bits(values[: len(prompt) - 1]), prompt_bits)
  np.testing.assert_array_equal(bits(values[len(prompt) - 1 :]), sampled)
print("tensor parallel ok")
llm = je.LLM(model, enable_lora=True, max_lora_rank=4, **kw)
lora = je.LoRARequest("trainer", 1, "in memory")
llm.load_lora_weights(lora, random_adapter(1))
mixed_bits(llm, lora)
print("ok")
"""


def test_tensor_parallel_bits_equal_token_logprobs_on_the_mesh():
  from subprocess_utils import run_python

  out = run_python(MESH_SCRIPT, timeout=900)
  assert out.strip().splitlines()[-2:] == ["tensor parallel ok", "ok"], out


# --- refusals -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
  "options, named",
  [
    (dict(attention_backend="pallas_gpu"), "attention_backend='pallas_gpu'"),
    (dict(batch_invariant="yes"), "batch_invariant must be a bool"),
  ],
)
def test_unsupported_settings_are_refused_by_name(model, options, named):
  with pytest.raises(ValueError, match=named):
    je.LLM(model, max_num_reqs=2, max_model_len=64, **{"batch_invariant": True, **options})


def test_a_model_without_the_attribute_is_refused():
  class Bare(nnx.Module):
    def __init__(self):
      self.inner = tiny_llama(0, vocab_size=VOCAB)[0].embed

  with pytest.raises(ValueError, match="Bare has none"):
    batch_invariant_model(Bare())


@pytest.mark.parametrize(
  "token_ids, named",
  [
    (jnp.zeros((3,), jnp.int32), r"\[B, T\]"),
    (jnp.zeros((1, 1), jnp.int32), "T >= 2"),
    (jnp.zeros((1, 4), jnp.float32), "integers"),
    (jnp.zeros((1, 300), jnp.int32), "max_position_embeddings=256"),
    (jnp.asarray([[5, 6, 300, 7]]), r"outside \[0, 256\): \[300\]"),
    (jnp.asarray([[5, -100, 7]]), r"outside \[0, 256\): \[-100\]"),
  ],
)
def test_token_logprobs_refuses_bad_input(model, token_ids, named):
  with pytest.raises(ValueError, match=named):
    token_logprobs(model, token_ids)
