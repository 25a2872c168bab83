"""The attention seam on its own, against a float64 NumPy reference of its contract.

The reference keeps a ``[num_slots, S, K, D]`` cache per layer, writes each token's key and value
at ``(slot, position)`` unless ``position >= S``, then lets each query at position ``p`` attend to
its slot's positions ``s <= p`` (``p - W < s`` with a sliding window). Cases: prefill, decode,
continuation after a prefix already in the cache, padding rows and tokens, grouped queries
(both CPU formulations: ``K <= 4`` flat and more key/value heads), a sliding window and a short
``attention_len``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxengine.models.attention import AttentionMetadata, attention
from jaxengine.models.kv_cache import KVCache, KVCacheSpec

NUM_SLOTS, MAX_LEN, LAYERS, LAYER = 4, 16, 2, 1


def reference(q, k, v, key, value, slots, positions, scale, window=None, attention_len=None):
  """Float64 NumPy attention of one layer; returns ``(out [B, T, H, D], key, value)``."""
  key, value = key.copy(), value.copy()
  b, t, h, d = q.shape
  kv = k.shape[2]
  for i in range(b):
    for j in range(t):
      if positions[i, j] < MAX_LEN:
        key[slots[i], positions[i, j]] = k[i, j]
        value[slots[i], positions[i, j]] = v[i, j]
  out = np.zeros((b, t, h, d))
  length = attention_len or MAX_LEN
  for i in range(b):
    for j in range(t):
      p = positions[i, j]
      seen = [s for s in range(length) if s <= p and (window is None or s > p - window)]
      for head in range(h):
        group = head // (h // kv)
        scores = scale * key[slots[i], seen, group] @ q[i, j, head]
        weights = np.exp(scores - scores.max())
        out[i, j, head] = (weights / weights.sum()) @ value[slots[i], seen, group]
  return out, key, value


def random_cache(rng, kv, d):
  shape = (LAYERS, NUM_SLOTS, MAX_LEN, kv, d)
  return rng.normal(size=shape), rng.normal(size=shape)


def run_both(rng, slots, positions, *, h, kv, d=8, window=None, attention_len=None, cache=None):
  """The seam and the reference on random inputs; checks outputs of real tokens and the cache."""
  slots, positions = np.asarray(slots, np.int32), np.asarray(positions, np.int32)
  b, t = positions.shape
  q, k, v = (rng.normal(size=(b, t, n, d)) for n in (h, kv, kv))
  key, value = random_cache(rng, kv, d) if cache is None else cache
  metadata = AttentionMetadata(
    cache_slots=jnp.asarray(slots), positions=jnp.asarray(positions), attention_len=attention_len
  )
  kv_cache = KVCache(key=jnp.asarray(key, jnp.float32), value=jnp.asarray(value, jnp.float32))
  f32 = lambda a: jnp.asarray(a, jnp.float32)
  got = jax.jit(attention, static_argnames=("layer", "scale", "sliding_window"))(
    f32(q), f32(k), f32(v), kv_cache, layer=LAYER, metadata=metadata, scale=d**-0.5,
    sliding_window=window,
  )  # fmt: skip
  want, want_key, want_value = reference(
    q, k, v, key[LAYER], value[LAYER], slots, positions, d**-0.5, window, attention_len
  )
  real = positions < MAX_LEN
  assert got.output.shape == (b, t, h, d) and got.output.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got.output)[real], want[real], rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(np.asarray(got.kv_cache.key[LAYER]), want_key, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(
    np.asarray(got.kv_cache.value[LAYER]), want_value, rtol=1e-6, atol=1e-6
  )
  # Other layers are untouched.
  np.testing.assert_array_equal(np.asarray(got.kv_cache.key[0]), np.float32(key[0]))
  return got, want


@pytest.mark.parametrize(("h", "kv"), [(4, 2), (6, 1), (12, 6), (4, 4)])
def test_prefill_then_decode_match_the_reference(h, kv):
  rng = np.random.default_rng(0)
  run_both(rng, [2, 0], [range(6), range(6)], h=h, kv=kv)  # prefill
  run_both(rng, [2, 0, 3], [[6], [3], [15]], h=h, kv=kv)  # decode (T = 1): both formulations


def test_continuation_attends_to_the_cached_prefix():
  rng = np.random.default_rng(1)
  cache = random_cache(rng, 2, 8)  # positions 0..4 of slot 1 hold a cached prefix
  got, _ = run_both(rng, [1], [[5, 6, 7]], h=4, kv=2, cache=cache)
  # The prefix matters: the same queries over another prefix give other outputs.
  rng = np.random.default_rng(1)
  random_cache(rng, 2, 8)
  other = (cache[0] + 1.0, cache[1] - 1.0)
  got_other, _ = run_both(rng, [1], [[5, 6, 7]], h=4, kv=2, cache=other)
  assert not np.allclose(np.asarray(got.output), np.asarray(got_other.output))


def test_padding_rows_and_tokens_write_nothing_and_disturb_no_real_token():
  rng = np.random.default_rng(2)
  key, value = random_cache(rng, 2, 8)
  # Row 0: 3 real tokens then 2 padding tokens after them; row 1: a padding row (positions S).
  positions = [[0, 1, 2, 3, 4], [MAX_LEN] * 5]
  got, _ = run_both(rng, [0, 3], positions, h=4, kv=2, cache=(key, value))
  np.testing.assert_array_equal(np.asarray(got.kv_cache.key[LAYER, 3]), np.float32(key[LAYER, 3]))
  # The real tokens' outputs are those of a call without the padding.
  rng_a, rng_b = np.random.default_rng(3), np.random.default_rng(3)
  padded, _ = run_both(rng_a, [0], [[0, 1, 2, 3]], h=4, kv=2, cache=(key, value))
  alone, _ = run_both(rng_b, [0], [[0, 1, 2, 9]], h=4, kv=2, cache=(key, value))
  np.testing.assert_array_equal(np.asarray(padded.output)[0, :3], np.asarray(alone.output)[0, :3])


def test_sliding_window_and_short_attention_len():
  rng = np.random.default_rng(4)
  run_both(rng, [0, 1], [range(8), range(4, 12)], h=4, kv=2, window=3)
  run_both(rng, [0, 1], [[9], [2]], h=4, kv=2, window=4)  # decode under a window
  run_both(rng, [0, 1], [range(6), range(2, 8)], h=4, kv=2, attention_len=8)


def test_bfloat16_cache_and_queries_keep_their_dtypes():
  spec = KVCacheSpec(num_layers=1, num_kv_heads=2, head_dim=8, dtype=jnp.bfloat16)
  cache = KVCache.create(spec, NUM_SLOTS, MAX_LEN)
  q = jnp.ones((1, 2, 4, 8), jnp.bfloat16)
  k = jnp.ones((1, 2, 2, 8), jnp.float32)
  metadata = AttentionMetadata(
    cache_slots=jnp.array([1], jnp.int32), positions=jnp.array([[0, 1]], jnp.int32)
  )
  out, new = attention(q, k, k, cache, 0, metadata, scale=1.0)
  assert out.dtype == jnp.bfloat16 and new.key.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.float32(new.key[0, 1, :2]), 1.0)
  np.testing.assert_array_equal(np.float32(out), 1.0)


def test_metadata_is_a_pytree_with_a_static_attention_len():
  metadata = AttentionMetadata(
    cache_slots=jnp.zeros((2,), jnp.int32), positions=jnp.zeros((2, 1), jnp.int32), attention_len=8
  )
  leaves, treedef = jax.tree.flatten(metadata)
  assert len(leaves) == 2
  assert jax.tree.unflatten(treedef, leaves).attention_len == 8
  other = AttentionMetadata(cache_slots=leaves[0], positions=leaves[1], attention_len=16)
  assert jax.tree.structure(other) != treedef  # a new attention_len is a new executable
