"""The attention seam on its own over pages, against a float64 NumPy reference of its contract.

Each case is one ragged step (`paged_utils.make_step`): the pages of one layer of a
`PagedKVCache` hold every request's earlier context, the seam writes the step's new keys and
values at their slots and lets each query at position ``p`` attend to its own request's
positions ``s <= p`` (``p - W < s`` with a sliding window; scores soft-capped with a cap).
Cases: prefill, decode, continuation after a cached prefix, padding tokens and requests, grouped
queries, a sliding window, a soft cap, bfloat16.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_utils import dense_pages, make_step, reference_attention

from jaxengine.models.attention import attention
from jaxengine.models.attention_backends import XlaAttentionBackend
from jaxengine.models.kv_cache import KVCacheSpec
from jaxengine.models.kv_pages import PagedKVCache

LAYERS, LAYER, BLOCK = 2, 1, 4


def run_seam(rng, requests, *, h, kv, d=8, num_tokens=None, num_reqs=None, **options):
  """The seam and the reference on a random step; checks real tokens' outputs, zero outputs of
  padding tokens, and the pages (the new rows written, nothing else but the null page touched,
  the other layer untouched). Returns the step and the seam's output."""
  total = sum(n for _, n in requests)
  num_tokens = total if num_tokens is None else num_tokens
  num_reqs = len(requests) if num_reqs is None else num_reqs
  step = make_step(
    rng, requests, num_tokens=num_tokens, num_reqs=num_reqs, max_blocks=8, num_heads=h,
    num_kv_heads=kv, head_dim=d, block_size=BLOCK,
  )  # fmt: skip
  keys, values = dense_pages(step, "keys"), dense_pages(step, "values")
  new_slots = np.asarray(step.md.slot_mapping)[:total]
  new_k, new_v = np.zeros((2, num_tokens, kv, d), np.float32)
  new_k[:total] = keys.reshape(-1, kv, d)[new_slots]
  new_v[:total] = values.reshape(-1, kv, d)[new_slots]
  before_k, before_v = keys.copy(), values.copy()
  before_k.reshape(-1, kv, d)[new_slots] = 0  # the step's own rows: not in the pages before
  before_v.reshape(-1, kv, d)[new_slots] = 0
  spec = KVCacheSpec(num_layers=LAYERS, num_kv_heads=kv, head_dim=d)
  cache = PagedKVCache.create(spec, XlaAttentionBackend(), step.num_blocks, BLOCK)
  other = (jnp.asarray(rng.normal(size=keys.shape), jnp.float32),) * 2
  pages = (other, (jnp.asarray(before_k), jnp.asarray(before_v)))
  cache = dataclasses.replace(cache, pages=pages)
  got = jax.jit(attention, static_argnames=("layer", "scale", "sliding_window", "soft_cap"))(
    jnp.asarray(step.q), jnp.asarray(new_k), jnp.asarray(new_v), cache, layer=LAYER,
    metadata=step.md, scale=d**-0.5, **options,
  )  # fmt: skip
  want = reference_attention(step, d**-0.5, options.get("sliding_window"), options.get("soft_cap"))
  assert got.output.shape == (num_tokens, h, d) and got.output.dtype == jnp.float32
  out = np.asarray(got.output)
  np.testing.assert_allclose(out[:total], want[:total], rtol=2e-5, atol=2e-5)
  np.testing.assert_array_equal(out[total:], 0.0)  # padding tokens: zero outputs
  written_k, written_v = (np.asarray(a) for a in got.kv_cache.pages[LAYER])
  np.testing.assert_array_equal(written_k[1:], keys[1:])  # page 0: the null page
  np.testing.assert_array_equal(written_v[1:], values[1:])
  np.testing.assert_array_equal(np.asarray(got.kv_cache.pages[0][0]), np.asarray(other[0]))
  return step, out


@pytest.mark.parametrize(("h", "kv"), [(4, 2), (6, 1), (12, 6), (4, 4)])
def test_prefill_then_decode_match_the_reference(h, kv):
  rng = np.random.default_rng(0)
  run_seam(rng, [(0, 6), (0, 6)], h=h, kv=kv)  # prefill
  run_seam(rng, [(6, 1), (3, 1), (15, 1)], h=h, kv=kv)  # decode (one token per request)


def test_continuation_attends_to_the_cached_prefix():
  rng = np.random.default_rng(1)
  step, out = run_seam(rng, [(5, 3)], h=4, kv=2)  # positions 0..4 already in the pages
  # The prefix matters: the reference without it (the same queries, keys of the new tokens
  # only) gives other outputs.
  alone = dataclasses.replace(step, keys=[step.keys[0][5:]], values=[step.values[0][5:]])
  assert not np.allclose(out, reference_attention(alone, 8**-0.5), atol=1e-3)


def test_padding_tokens_and_requests_write_only_the_null_page():
  rng = np.random.default_rng(2)
  # Seven real tokens of three requests in a bucket of 12 tokens and 5 requests.
  run_seam(rng, [(6, 3), (0, 3), (11, 1)], h=4, kv=2, num_tokens=12, num_reqs=5)


def test_sliding_window_and_soft_cap():
  rng = np.random.default_rng(4)
  run_seam(rng, [(0, 8), (4, 8)], h=4, kv=2, sliding_window=3)
  run_seam(rng, [(9, 1), (2, 1)], h=4, kv=2, sliding_window=4)  # decode under a window
  run_seam(rng, [(3, 5), (0, 2)], h=4, kv=2, soft_cap=0.5)
  run_seam(rng, [(3, 5), (0, 2)], h=4, kv=2, soft_cap=0.5, sliding_window=2)


def test_bfloat16_pages_and_queries_keep_their_dtypes():
  spec = KVCacheSpec(num_layers=1, num_kv_heads=2, head_dim=8, dtype=jnp.bfloat16)
  cache = PagedKVCache.create(spec, XlaAttentionBackend(), 3, BLOCK)
  step = make_step(np.random.default_rng(5), [(0, 2)], num_tokens=2, num_reqs=1, max_blocks=2)
  q = jnp.ones((2, 4, 8), jnp.bfloat16)
  k = jnp.ones((2, 2, 8), jnp.float32)
  out, new = attention(q, k, k, cache, 0, step.md, scale=1.0)
  assert out.dtype == jnp.bfloat16 and new.pages[0][0].dtype == jnp.bfloat16
  slots = np.asarray(step.md.slot_mapping)
  np.testing.assert_array_equal(np.float32(new.pages[0][0]).reshape(-1, 2, 8)[slots], 1.0)
  np.testing.assert_array_equal(np.float32(out), 1.0)
