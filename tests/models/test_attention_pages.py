"""Paged attention (`models/paged_attention.py`, `models/attention_backends.py`): the XLA path
against a float64 NumPy reference on decode, prefill and mixed ragged steps; the write op; the
kernels that ship with jax (GPU Pallas in interpret mode, the TPU kernel's reference function)
against the XLA path; the backend choice; one compile per shape bucket."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_utils import dense_pages, make_step, reference_attention

from jaxengine.models.paged_attention import (
  NULL_SLOT,
  num_work_items,
  ragged_paged_attention_xla,
  write_kv_pages,
)
from jaxengine.testing import count_compiles

SCALE = 8**-0.5

# (num_computed_tokens, num_new_tokens) per request, with the T / R buckets they are padded to.
STEPS = {
  "decode": ([(5, 1), (0, 1), (12, 1), (3, 1)], 4, 4),
  "decode_padded": ([(5, 1), (17, 1)], 4, 4),
  "prefill": ([(0, 7), (0, 13)], 24, 4),
  "mixed_chunks": ([(9, 1), (4, 6), (0, 3), (21, 5), (15, 1)], 20, 8),
  "one_long_chunk": ([(8, 16)], 16, 2),
}


@functools.partial(jax.jit, static_argnames=("query_tile", "pages_per_chunk"))
def _xla(q, keys, values, md, query_tile, pages_per_chunk):
  return ragged_paged_attention_xla(
    q, keys, values, md, scale=SCALE, query_tile=query_tile, pages_per_chunk=pages_per_chunk
  )


@pytest.mark.parametrize(("query_tile", "pages_per_chunk"), [(1, 1), (5, 3)])
@pytest.mark.parametrize("name", list(STEPS))
def test_xla_matches_the_float64_reference(name, query_tile, pages_per_chunk):
  requests, num_tokens, num_reqs = STEPS[name]
  step = make_step(
    np.random.default_rng(len(name)), requests, num_tokens=num_tokens, num_reqs=num_reqs,
    max_blocks=8, num_heads=6, num_kv_heads=2,
  )  # fmt: skip
  keys, values = dense_pages(step, "keys"), dense_pages(step, "values")
  out = _xla(step.q, keys, values, step.md, query_tile, pages_per_chunk)
  expected = reference_attention(step, SCALE)
  np.testing.assert_allclose(np.asarray(out), expected, rtol=2e-5, atol=2e-5)
  assert not np.any(np.asarray(out)[sum(step.query_lens) :])  # padding tokens stay 0


@pytest.mark.parametrize(
  ("window", "query_tile", "pages_per_chunk"), [(1, 1, 1), (5, 1, 2), (8, 5, 1), (8, 16, 2)]
)
def test_sliding_window_matches_the_float64_reference(window, query_tile, pages_per_chunk):
  # Decodes and prefill chunks, some contexts many chunks past the window, shuffled pages.
  requests = [(30, 1), (0, 11), (21, 9), (2, 1), (40, 4), (6, 1)]
  step = make_step(
    np.random.default_rng(window), requests, num_tokens=32, num_reqs=8, max_blocks=12,
    num_heads=6, num_kv_heads=2,
  )  # fmt: skip
  keys, values = dense_pages(step, "keys"), dense_pages(step, "values")
  # Pages wholly before a request's first window are skipped: NaN there would reach the output.
  tables, chunk_len = np.asarray(step.md.block_tables), 4 * pages_per_chunk
  for r, (computed, _) in enumerate(requests):
    first_page = max(computed - window + 1, 0) // chunk_len * pages_per_chunk
    keys[tables[r, :first_page]] = values[tables[r, :first_page]] = np.nan
  assert np.isnan(keys).any()
  run = jax.jit(
    functools.partial(
      ragged_paged_attention_xla, scale=SCALE, query_tile=query_tile,
      pages_per_chunk=pages_per_chunk, sliding_window=window,
    )
  )  # fmt: skip
  out = np.asarray(run(step.q, keys, values, step.md))
  np.testing.assert_allclose(out, reference_attention(step, SCALE, window), rtol=2e-5, atol=2e-5)
  assert not np.any(out[sum(step.query_lens) :])  # padding tokens stay 0
  full = reference_attention(step, SCALE)
  assert np.abs(out - full)[: sum(step.query_lens)].max() > 1e-2  # the window changed outputs


def test_write_kv_pages_scatters_to_slots_and_padding_to_the_null_slot():
  rng = np.random.default_rng(1)
  requests = [(3, 2), (0, 5)]
  step = make_step(rng, requests, num_tokens=9, num_reqs=3, max_blocks=4)
  new_rows = rng.standard_normal((9, 2, 8)).astype(np.float32)
  pages = jnp.zeros((step.num_blocks, step.block_size, 2, 8))
  written = np.asarray(write_kv_pages(pages, new_rows, step.md.slot_mapping))
  flat = written.reshape(-1, 2, 8)
  slots = np.asarray(step.md.slot_mapping)
  np.testing.assert_array_equal(flat[slots[:7]], new_rows[:7])
  untouched = np.setdiff1d(np.arange(flat.shape[0]), slots)
  assert not flat[untouched].any()
  assert (slots[7:] == NULL_SLOT).all()
  stacked = jnp.zeros((3, *pages.shape))  # a leading layer axis
  written = np.asarray(write_kv_pages(stacked, new_rows, step.md.slot_mapping, layer=1))
  np.testing.assert_array_equal(written[1].reshape(-1, 2, 8)[slots[:7]], new_rows[:7])
  assert not written[0].any() and not written[2].any()


def test_write_then_attend_equals_the_reference():
  """The new tokens' keys and values reach attention through the write op in the same step."""
  rng = np.random.default_rng(2)
  step = make_step(rng, [(6, 3), (0, 4), (11, 1)], num_tokens=8, num_reqs=4, max_blocks=4)
  keys, values = dense_pages(step, "keys"), dense_pages(step, "values")
  new_slots = np.asarray(step.md.slot_mapping)[:8]
  flat_k, flat_v = keys.reshape(-1, 2, 8), values.reshape(-1, 2, 8)
  new_k, new_v = flat_k[new_slots].copy(), flat_v[new_slots].copy()
  flat_k[new_slots[:8]] = 0  # the step's own rows are not in the cache before the write
  flat_v[new_slots[:8]] = 0

  @jax.jit
  def step_fn(q, keys, values, new_k, new_v, md):
    keys = write_kv_pages(keys, new_k, md.slot_mapping)
    values = write_kv_pages(values, new_v, md.slot_mapping)
    return ragged_paged_attention_xla(q, keys, values, md, scale=SCALE, query_tile=2)

  out = step_fn(step.q, keys, values, new_k, new_v, step.md)
  np.testing.assert_allclose(np.asarray(out), reference_attention(step, SCALE), atol=2e-5)


def test_num_work_items_bounds_every_step():
  rng = np.random.default_rng(0)
  for _ in range(3000):
    num_tokens, num_reqs, tile = rng.integers(1, 40), rng.integers(1, 10), rng.integers(1, 9)
    ends = np.sort(rng.integers(0, num_tokens + 1, num_reqs))  # any split of <= T tokens
    query_lens = np.diff(ends, prepend=0)
    assert np.sum(-(-query_lens // tile)) <= num_work_items(num_tokens, num_reqs, tile)
  assert num_work_items(32, 32, 1) == 32 and num_work_items(512, 8, 64) == 15


def test_one_compile_per_shape_bucket():
  rng = np.random.default_rng(3)
  fn = jax.jit(functools.partial(ragged_paged_attention_xla, scale=SCALE, query_tile=4))
  pages = jnp.zeros((40, 4, 2, 8))
  with count_compiles() as compiles:
    for requests in ([(3, 1), (0, 5)], [(7, 2)], [(0, 1), (1, 1), (2, 1), (9, 3)]):
      step = make_step(rng, requests, num_tokens=12, num_reqs=4, max_blocks=4)
      fn(step.q, pages, pages, step.md).block_until_ready()
    first = compiles.count
    step = make_step(rng, [(3, 1)], num_tokens=16, num_reqs=4, max_blocks=4)  # a new T bucket
    fn(step.q, pages, pages, step.md).block_until_ready()
  assert first >= 1 and compiles.count - first >= 1
  with count_compiles() as compiles:
    for requests in ([(1, 1)], [(2, 9), (0, 3)]):
      step = make_step(rng, requests, num_tokens=12, num_reqs=4, max_blocks=4)
      fn(step.q, pages, pages, step.md).block_until_ready()
  assert compiles.count == 0


def test_bfloat16_pages_and_queries_stay_close_to_the_reference():
  requests, num_tokens, num_reqs = STEPS["mixed_chunks"]
  step = make_step(
    np.random.default_rng(4), requests, num_tokens=num_tokens, num_reqs=num_reqs, max_blocks=8,
    num_heads=6, num_kv_heads=2,
  )  # fmt: skip
  keys, values = (jnp.asarray(dense_pages(step, w), jnp.bfloat16) for w in ("keys", "values"))
  out = _xla(jnp.asarray(step.q, jnp.bfloat16), keys, values, step.md, 4, 2)
  assert out.dtype == jnp.bfloat16
  expected = reference_attention(step, SCALE)
  np.testing.assert_allclose(np.asarray(out, np.float32), expected, rtol=0, atol=3e-2)


def test_bad_static_arguments_are_refused():
  step = make_step(np.random.default_rng(5), [(1, 1)], num_tokens=1, num_reqs=1, max_blocks=1)
  pages = jnp.zeros((step.num_blocks, 4, 2, 8))
  with pytest.raises(ValueError, match="query_tile and pages_per_chunk must be >= 1, got 0 and 4"):
    ragged_paged_attention_xla(step.q, pages, pages, step.md, scale=SCALE, query_tile=0)
  with pytest.raises(ValueError, match="3 query heads are not a multiple of 2 kv heads"):
    ragged_paged_attention_xla(step.q[:, :3], pages, pages, step.md, scale=SCALE)
  with pytest.raises(ValueError, match="sliding_window must be >= 1 or None, got 0"):
    ragged_paged_attention_xla(step.q, pages, pages, step.md, scale=SCALE, sliding_window=0)
