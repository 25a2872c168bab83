"""The tiny Llama over pages through the attention seam, against whole-sequence forwards.

A minimal scheduler (decodes first, then prefill chunks under a token budget, preempting the most
recently admitted request when the pool runs out) drives `KVCacheManager` and
`build_step_inputs`; each ragged step runs the unchanged model once over the flat tokens of
all scheduled requests (`PagedAttentionMetadata` + `PagedKVCache`), and every token it samples
greedily must come with the same logits (float32, tight tolerance) and be the same token as the
cacheless oracle's greedy choice (`jaxengine.models.sequence_logits`: each request's whole
sequence so far in one call over a scratch pool of pages, no prefix cache, no chunks, no
preemption). One executable per (tokens, requests) bucket.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from paged_utils import ToyScheduler

from jaxengine.core.kv_cache_manager import KVCacheManager
from jaxengine.models import sequence_logits
from jaxengine.models.attention import attention
from jaxengine.models.attention_backends import (
  AttentionBackend,
  PallasGpuAttentionBackend,
  XlaAttentionBackend,
)
from jaxengine.models.kv_pages import PagedKVCache
from jaxengine.models.llama import compute_logits, forward
from jaxengine.models.paged_attention import PagedAttentionMetadata
from jaxengine.testing import count_compiles, tiny_llama
from jaxengine.worker.step_inputs import StepInputs, build_step_inputs

BLOCK = 4
P = 8  # block-table bucket: 32 positions per request
TOKEN_BUCKETS = (4, 8, 16)  # the last is the step's token budget
REQ_BUCKETS = (2, 4)
MAX_NEW = 6
ORACLE_LEN = 32  # the oracle's one padded width (prompt and outputs fit)
PREFIX = [5, 17, 9, 33, 42, 71, 8, 100, 64]
PROMPTS = [
  PREFIX + [10, 11],  # 11 tokens
  PREFIX + [12],  # shares PREFIX's two full blocks with the first
  [3, 99, 4, 120, 7, 7, 200, 13, 55, 60, 61, 62, 90, 91, 92, 93, 94, 95, 30, 31],  # 20: chunked
  PREFIX[:5],
  PREFIX + [10, 11, 77],  # shares three full blocks with the first
]


@functools.cache
def _model():
  return nnx.split(tiny_llama()[0])


@functools.partial(jax.jit, static_argnums=0, donate_argnums=4)
def _paged_step(graphdef, weights, token_ids, positions, cache, md, logits_indices):
  """`[R, V]` logits of each request's last query token, and the updated pages."""
  hidden, cache = forward(graphdef, weights, token_ids[None], positions[None], cache, md)
  return compute_logits(graphdef, weights, hidden[0, logits_indices]), cache


def _oracle_greedy(prompt: list[int]) -> tuple[list[int], dict[int, np.ndarray]]:
  """The oracle: greedy decoding by whole-sequence forwards (the sequence so far, padded to
  `ORACLE_LEN`, one compiled shape).

  Returns the sampled tokens and the logits each came from, by the position they were read at.
  """
  model = nnx.merge(*_model())
  tokens, by_position = list(prompt), {}
  for _ in range(MAX_NEW):
    ids = np.zeros((1, ORACLE_LEN), np.int32)
    ids[0, : len(tokens)] = tokens
    row = np.asarray(sequence_logits(model, ids, block_size=BLOCK)[0, len(tokens) - 1])
    by_position[len(tokens) - 1] = row
    tokens.append(int(row.argmax()))
  return tokens[len(prompt) :], by_position


def _spec():
  """The tiny model's `KVCacheSpec`."""
  graphdef, weights = _model()
  return nnx.merge(graphdef, weights).kv_cache_spec


def _bucket(value: int, buckets: tuple[int, ...]) -> int:
  return next(b for b in buckets if b >= value)


class _PagedRun(ToyScheduler):
  """Requests over a `KVCacheManager` and a `PagedKVCache`, one ragged model step at a time."""

  def __init__(self, num_blocks: int, backend: AttentionBackend) -> None:
    manager = KVCacheManager(num_blocks, block_size=BLOCK)
    super().__init__(PROMPTS, manager, TOKEN_BUCKETS[-1], REQ_BUCKETS[-1])
    self.cache = PagedKVCache.create(_spec(), backend, num_blocks, BLOCK)
    self.logits: dict[str, dict[int, np.ndarray]] = {r: {} for r in self.tokens}
    self.buckets: list[tuple[int, int]] = []
    self.decode_only_steps = 0

  def inputs(self, picked: dict[str, int]) -> tuple[StepInputs, np.ndarray]:
    ids = list(picked)
    total = sum(picked.values())
    num_tokens, num_reqs = _bucket(total, TOKEN_BUCKETS), _bucket(len(ids), REQ_BUCKETS)
    self.buckets.append((num_tokens, num_reqs))
    inputs = build_step_inputs(
      [self.manager.get_block_ids(r) for r in ids], [self.computed[r] for r in ids],
      [picked[r] for r in ids], block_size=BLOCK, num_tokens=num_tokens, num_reqs=num_reqs,
      max_blocks_per_req=P,
    )  # fmt: skip
    token_ids = np.zeros(num_tokens, np.int32)
    owner = [r for r in ids for _ in range(picked[r])]
    for t, req_id in enumerate(owner):
      token_ids[t] = self.tokens[req_id][inputs.positions[t]]
    return inputs, token_ids

  def run_step(self, picked: dict[str, int]) -> None:
    graphdef, weights = _model()
    inputs, token_ids = self.inputs(picked)
    self.decode_only_steps += all(n == 1 for n in picked.values())
    logits, self.cache = _paged_step(
      graphdef, weights, token_ids, inputs.positions, self.cache, inputs.metadata(),
      inputs.logits_indices,
    )  # fmt: skip
    logits = np.asarray(logits)
    for index, req_id in enumerate(picked):
      self.computed[req_id] += picked[req_id]
      tokens = self.tokens[req_id]
      if self.computed[req_id] < len(tokens):  # a prefill chunk short of the prompt's end
        continue
      self.logits[req_id][len(tokens) - 1] = logits[index]
      tokens.append(int(logits[index].argmax()))
      if len(tokens) - self.prompt_len[req_id] == MAX_NEW:
        self.running.remove(req_id)
        self.manager.free(req_id)

  def run(self) -> None:
    for _ in range(80):
      picked = self.schedule()
      if not picked:
        break
      self.run_step(picked)
    assert not self.running and not self.waiting


@functools.cache
def _oracle() -> dict[str, tuple[list[int], dict[int, np.ndarray]]]:
  return {f"r{i}": _oracle_greedy(p) for i, p in enumerate(PROMPTS)}


def _check_against_oracle(run: _PagedRun) -> None:
  for req_id, (tokens, logits) in _oracle().items():
    assert run.tokens[req_id][run.prompt_len[req_id] :] == tokens, req_id
    assert sorted(run.logits[req_id]) == sorted(logits), req_id
    for position, row in logits.items():
      np.testing.assert_allclose(run.logits[req_id][position], row, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_blocks", [40, 9])  # 9: 8 usable blocks force preemptions
def test_paged_model_matches_the_oracle(num_blocks):
  _oracle()  # compiled outside the count
  run = _PagedRun(num_blocks, XlaAttentionBackend())
  with count_compiles() as compiles:
    run.run()
  _check_against_oracle(run)
  assert compiles.count == len(set(run.buckets))  # one executable per (tokens, requests) bucket
  assert len(set(run.buckets)) >= 3 and run.decode_only_steps > 0
  stats = run.manager.stats
  assert stats.num_used_blocks == 0 and stats.prefix_cache_hits >= 2 * BLOCK
  assert (stats.num_preemptions > 0) == (num_blocks == 9)


def test_paged_model_gpu_pallas_interpret_matches_the_oracle():
  """Decode-only steps take the GPU Pallas kernel (interpret mode), mixed steps the XLA path."""
  run = _PagedRun(40, PallasGpuAttentionBackend(interpret=True))
  run.run()
  assert run.decode_only_steps > 0
  _check_against_oracle(run)


def test_paged_seam_refusals():
  spec = _spec()
  backend = XlaAttentionBackend()
  cache = PagedKVCache.create(spec, backend, 4, BLOCK)
  assert (cache.num_layers, len(cache.pages[0])) == (spec.num_layers, 2)
  assert cache.pages[0][0].shape == (4, BLOCK, spec.num_kv_heads, spec.head_dim)
  md = PagedAttentionMetadata(
    slot_mapping=jnp.zeros(3, jnp.int32), block_tables=jnp.zeros((1, 2), jnp.int32),
    query_start_loc=jnp.array([0, 3], jnp.int32), seq_lens=jnp.array([3], jnp.int32),
    num_reqs=jnp.array(1, jnp.int32),
  )  # fmt: skip
  q = jnp.zeros((3, 4, spec.head_dim))
  kv = jnp.zeros((3, spec.num_kv_heads, spec.head_dim))
  assert attention(q, kv, kv, cache, 0, md, scale=1.0).output.shape == q.shape
  windowed = attention(q, kv, kv, cache, 0, md, scale=1.0, sliding_window=8)
  assert windowed.output.shape == q.shape
  gpu_cache = PagedKVCache.create(spec, PallasGpuAttentionBackend(interpret=True), 4, BLOCK)
  with pytest.raises(ValueError, match="'pallas_gpu' has no sliding-window attention, got slid"):
    attention(q, kv, kv, gpu_cache, 0, md, scale=1.0, sliding_window=8)
  with pytest.raises(ValueError, match=r"queries .* hold 2 tokens, slot_mapping 3"):
    attention(q[:2], kv[:2], kv[:2], cache, 0, md, scale=1.0)
  with pytest.raises(ValueError, match="attention needs a PagedKVCache, got <class 'tuple'>"):
    attention(q, kv, kv, cache.pages, 0, md, scale=1.0)
  with pytest.raises(ValueError, match="num_blocks must be an int >= 2"):
    PagedKVCache.create(spec, backend, 1, BLOCK)
  with pytest.raises(ValueError, match="block_size must be an int >= 1"):
    PagedKVCache.create(spec, backend, 4, 0)
