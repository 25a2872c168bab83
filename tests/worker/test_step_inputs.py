"""The paged foundation end to end, without a model: `KVCacheManager` hands out blocks (prefix
hits, preemption under a tiny pool, chunked prefill under a token budget), `build_step_inputs`
lays out each ragged step, the XLA backend writes and attends, and every query's output equals
dense attention over its request's whole history. Keys and values are a pure function of the
token prefix (as a model's are), so shared prefix blocks must hold exactly the right data."""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_utils import ToyScheduler

from jaxengine.core.kv_cache_manager import KVCacheManager
from jaxengine.models.attention_backends import XlaAttentionBackend
from jaxengine.testing import count_compiles
from jaxengine.worker.step_inputs import build_step_inputs

H, K, D, B = 4, 2, 8, 4
T, R, P = 16, 4, 8  # buckets: tokens, requests, pages per request
SCALE = D**-0.5
BACKEND = XlaAttentionBackend()


def _kv(prefix: list[int]) -> np.ndarray:
  """`[2, K, D]` key and value of the last token of `prefix`, a function of the whole prefix."""
  rng = np.random.default_rng(zlib.crc32(np.asarray(prefix, np.int32).tobytes()))
  return rng.standard_normal((2, K, D)).astype(np.float32)


def _dense(q: np.ndarray, tokens: list[int], position: int) -> np.ndarray:
  kv = np.stack([_kv(tokens[: p + 1]) for p in range(position + 1)]).astype(np.float64)
  keys, values = np.repeat(kv[:, 0], H // K, axis=1), np.repeat(kv[:, 1], H // K, axis=1)
  scores = np.einsum("hd,shd->hs", q, keys) * SCALE
  probs = np.exp(scores - scores.max(-1, keepdims=True))
  return np.einsum("hs,shd->hd", probs / probs.sum(-1, keepdims=True), values)


@functools.partial(jax.jit, donate_argnums=1)
def _step(q, pages, new_kv, md):
  pages = BACKEND.write_kv(pages, new_kv[:, 0], new_kv[:, 1], md.slot_mapping)
  return BACKEND.attention(q, pages, md, scale=SCALE), pages


class _Sim(ToyScheduler):
  """The toy scheduler's steps over random queries and keys and values that are a function of
  each token's prefix, checked against dense attention."""

  def __init__(self, prompts: list[list[int]], num_blocks: int, max_new: int) -> None:
    super().__init__(prompts, KVCacheManager(num_blocks, block_size=B), T, R)
    self.pages = BACKEND.init_pages(num_blocks, B, K, D)
    self.max_new = max_new
    self.rng = np.random.default_rng(0)

  def run_step(self, picked: dict[str, int]) -> None:
    ids = list(picked)
    inputs = build_step_inputs(
      [self.manager.get_block_ids(r) for r in ids], [self.computed[r] for r in ids],
      [picked[r] for r in ids], block_size=B, num_tokens=T, num_reqs=R, max_blocks_per_req=P,
    )  # fmt: skip
    new_kv = np.zeros((T, 2, K, D), np.float32)
    owner = [r for r in ids for _ in range(picked[r])]
    for t, req_id in enumerate(owner):
      new_kv[t] = _kv(self.tokens[req_id][: inputs.positions[t] + 1])
    q = self.rng.standard_normal((T, H, D)).astype(np.float32)
    out, self.pages = _step(q, self.pages, new_kv, inputs.metadata())
    out = np.asarray(out)
    for t, req_id in enumerate(owner):
      expected = _dense(q[t].astype(np.float64), self.tokens[req_id], int(inputs.positions[t]))
      np.testing.assert_allclose(out[t], expected, rtol=2e-5, atol=2e-5)
    assert not out[len(owner) :].any()
    for req_id in ids:
      self.computed[req_id] += picked[req_id]
      tokens = self.tokens[req_id]
      if self.computed[req_id] == len(tokens):  # its last token's logits: sample one more
        if len(tokens) - self.prompt_len[req_id] == self.max_new:
          self.running.remove(req_id)
          self.manager.free(req_id)
        else:
          tokens.append(int(self.rng.integers(0, 3)))


@pytest.mark.parametrize("num_blocks", [40, 9])  # 9: 8 usable blocks force preemptions
def test_chunked_prefill_prefix_hits_and_preemption_attend_like_dense(num_blocks):
  prefix = [1, 2, 0, 1, 2, 2, 1, 0, 1]
  prompts = [prefix + [0, 1], prefix + [2], [2, 2, 2, 2, 2, 1, 0, 0, 1, 2, 2, 0, 1, 0, 2, 1, 0, 0,
             1, 2], prefix[:5], prefix + [0, 1, 1]]  # fmt: skip
  sim = _Sim(prompts, num_blocks, max_new=6)
  with count_compiles() as compiles:
    for _ in range(60):
      picked = sim.schedule()
      if not picked:
        break
      sim.run_step(picked)
  assert not sim.running and not sim.waiting
  assert compiles.count == 1  # one executable serves every step of the bucket
  stats = sim.manager.stats
  assert stats.num_used_blocks == 0 and stats.prefix_cache_hits > 0
  assert (stats.num_preemptions > 0) == (num_blocks == 9)
  assert all(len(sim.tokens[r]) == len(p) + 6 for r, p in zip(sim.tokens, prompts))


def test_build_paged_step_inputs_layout_and_refusals():
  inputs = build_step_inputs(
    [[3, 5], [7]], [5, 0], [2, 3], block_size=4, num_tokens=8, num_reqs=3, max_blocks_per_req=3
  )
  np.testing.assert_array_equal(inputs.positions, [5, 6, 0, 1, 2, 0, 0, 0])
  np.testing.assert_array_equal(inputs.slot_mapping, [21, 22, 28, 29, 30, 0, 0, 0])
  np.testing.assert_array_equal(inputs.block_tables, [[3, 5, 0], [7, 0, 0], [0, 0, 0]])
  np.testing.assert_array_equal(inputs.query_start_loc, [0, 2, 5, 5])
  np.testing.assert_array_equal(inputs.seq_lens, [7, 3, 0])
  np.testing.assert_array_equal(inputs.logits_indices, [1, 4, 0])
  assert (inputs.num_reqs, inputs.num_tokens) == (2, 5)
  kwargs = dict(block_size=4, num_tokens=8, num_reqs=3, max_blocks_per_req=3)
  with pytest.raises(ValueError, match="request 0 holds 1 blocks; its 7 tokens need 2"):
    build_step_inputs([[3]], [5], [2], **kwargs)
  with pytest.raises(ValueError, match="9 scheduled tokens exceed the bucket num_tokens=8"):
    build_step_inputs([[1, 2, 3]], [0], [9], **kwargs)
  with pytest.raises(ValueError, match="num_scheduled_tokens >= 1"):
    build_step_inputs([[1]], [0], [0], **kwargs)
  with pytest.raises(ValueError, match="4 requests exceed the bucket num_reqs=3"):
    build_step_inputs([[1]] * 4, [0] * 4, [1] * 4, **kwargs)
  with pytest.raises(ValueError, match="lengths 1, 2, 1"):
    build_step_inputs([[1]], [0, 0], [1], **kwargs)
  assert inputs.metadata().num_reqs.dtype == jnp.int32
