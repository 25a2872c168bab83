"""Ragged paged-attention steps for tests: random pages, metadata, a float64 NumPy reference, and a
toy scheduler over a `KVCacheManager`."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxengine.core.kv_cache_manager import KVCacheManager
from jaxengine.models.paged_attention import NULL_SLOT, PagedAttentionMetadata


@dataclasses.dataclass
class RaggedStep:
  """One step: per-request dense keys/values (the truth) and their paged, flat encoding."""

  q: np.ndarray  # [T, H, D]
  keys: list[np.ndarray]  # per request [seq_len, K, D]
  values: list[np.ndarray]
  query_lens: list[int]
  md: PagedAttentionMetadata
  slots: np.ndarray  # [sum seq_len] slots of every context token, request-major
  num_blocks: int
  block_size: int


def make_step(
  rng: np.random.Generator,
  requests: list[tuple[int, int]],
  *,
  num_tokens: int,
  num_reqs: int,
  max_blocks: int,
  num_heads: int = 4,
  num_kv_heads: int = 2,
  head_dim: int = 8,
  block_size: int = 4,
) -> RaggedStep:
  """A step of `(num_computed_tokens, num_new_tokens)` requests, padded to the buckets.

  Pages are a random permutation of blocks `1 ..` (block 0 is the null block).
  """
  num_blocks = 1 + sum(-(-(c + n) // block_size) for c, n in requests) + 3
  free = list(rng.permutation(np.arange(1, num_blocks)))
  tables = np.zeros((num_reqs, max_blocks), np.int32)
  start_loc = np.zeros(num_reqs + 1, np.int32)
  seq_lens = np.zeros(num_reqs, np.int32)
  slot_mapping = np.full(num_tokens, NULL_SLOT, np.int32)
  keys, values, slots = [], [], []
  total = 0
  for r, (computed, new) in enumerate(requests):
    seq_len = computed + new
    blocks = [free.pop() for _ in range(-(-seq_len // block_size))]
    tables[r, : len(blocks)] = blocks
    pos = np.arange(seq_len)
    req_slots = np.asarray(blocks, np.int32)[pos // block_size] * block_size + pos % block_size
    slot_mapping[total : total + new] = req_slots[computed:]
    slots.append(req_slots)
    keys.append(rng.standard_normal((seq_len, num_kv_heads, head_dim)).astype(np.float32))
    values.append(rng.standard_normal((seq_len, num_kv_heads, head_dim)).astype(np.float32))
    seq_lens[r] = seq_len
    total += new
    start_loc[r + 1] = total
  start_loc[len(requests) + 1 :] = total
  q = rng.standard_normal((num_tokens, num_heads, head_dim)).astype(np.float32)
  md = _metadata(slot_mapping, tables, start_loc, seq_lens, len(requests))
  return RaggedStep(
    q=q,
    keys=keys,
    values=values,
    query_lens=[n for _, n in requests],
    md=md,
    slots=np.concatenate(slots) if slots else np.zeros(0, np.int32),
    num_blocks=num_blocks,
    block_size=block_size,
  )


def dense_pages(step: RaggedStep, which: str) -> np.ndarray:
  """`[N, B, K, D]` pages holding every context token's key (`which="keys"`) or value."""
  rows = np.concatenate(getattr(step, which))
  pages = np.zeros((step.num_blocks * step.block_size, *rows.shape[1:]), np.float32)
  pages[step.slots] = rows
  return pages.reshape(step.num_blocks, step.block_size, *rows.shape[1:])


def reference_attention(
  step: RaggedStep, scale: float, sliding_window: int | None = None, soft_cap: float | None = None
) -> np.ndarray:
  """`[T, H, D]` float64 causal grouped-query attention per request (a query at position `p`
  sees `s <= p`, and `s > p - sliding_window` with a window; scaled scores `x` become
  `soft_cap * tanh(x / soft_cap)` with a cap); padding rows 0."""
  out = np.zeros(step.q.shape, np.float64)
  start = 0
  num_heads = step.q.shape[1]
  for keys, values, new in zip(step.keys, step.values, step.query_lens):
    seq_len = keys.shape[0]
    group = num_heads // keys.shape[1]
    k = np.repeat(keys.astype(np.float64), group, axis=1)  # [S, H, D]
    v = np.repeat(values.astype(np.float64), group, axis=1)
    q = step.q[start : start + new].astype(np.float64)  # [q, H, D]
    scores = np.einsum("qhd,shd->hqs", q, k) * scale
    if soft_cap is not None:
      scores = soft_cap * np.tanh(scores / soft_cap)
    position = seq_len - new + np.arange(new)
    key_position = np.arange(seq_len)[None, None]
    visible = key_position <= position[None, :, None]
    if sliding_window is not None:
      visible &= key_position > position[None, :, None] - sliding_window
    scores = np.where(visible, scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out[start : start + new] = np.einsum("hqs,shd->qhd", probs, v)
    start += new
  return out


class ToyScheduler:
  """A minimal scheduler: decodes first, then prefill chunks within the token budget; preempts
  the most recently admitted request when the pool runs out (it waits again, first in line).

  Subclasses run the steps: after one, they advance `computed` and append sampled tokens.

  Attributes:
    manager: the pages.
    tokens: every known token of each request (`"r{i}"` for prompt `i`).
    prompt_len: each request's prompt length.
    computed: tokens of each request whose keys and values are in its pages.
    waiting: requests not admitted (or preempted), in order.
    running: admitted requests, in admission order.
  """

  def __init__(
    self, prompts: list[list[int]], manager: KVCacheManager, budget: int, max_num_reqs: int
  ) -> None:
    self.manager = manager
    self.budget = budget
    self.max_num_reqs = max_num_reqs
    self.tokens = {f"r{i}": list(p) for i, p in enumerate(prompts)}
    self.prompt_len = {r: len(p) for r, p in self.tokens.items()}
    self.computed = dict.fromkeys(self.tokens, 0)
    self.waiting = list(self.tokens)
    self.running: list[str] = []

  def schedule(self) -> dict[str, int]:
    """This step's query tokens by request, in scheduling order."""
    budget, picked = self.budget, {}
    for req_id in list(self.running):
      if budget == 0:
        break
      if req_id not in self.running:  # preempted for an earlier one this step
        continue
      num_new = min(budget, len(self.tokens[req_id]) - self.computed[req_id])
      while self._allocate(req_id, num_new) is None:
        victim = self.running.pop()  # the most recently admitted
        self.manager.preempt(victim)
        self.computed[victim] = 0
        budget += picked.pop(victim, 0)
        self.waiting.insert(0, victim)
        if victim == req_id:
          break
      else:
        picked[req_id] = num_new
        budget -= num_new
    while self.waiting and budget and len(picked) < self.max_num_reqs:
      req_id = self.waiting[0]
      hit = self.manager.get_computed_blocks(self.tokens[req_id])
      num_new = min(budget, len(self.tokens[req_id]) - hit.num_computed_tokens)
      if self._allocate(req_id, num_new, hit) is None:
        break
      self.computed[req_id] = hit.num_computed_tokens
      self.running.append(self.waiting.pop(0))
      picked[req_id] = num_new
      budget -= num_new
    return picked

  def _allocate(self, req_id, num_new, hit=None):
    return self.manager.allocate_slots(
      req_id, num_new, num_computed_tokens=self.computed[req_id], token_ids=self.tokens[req_id],
      new_computed_blocks=hit,
    )  # fmt: skip


def slot_step(
  requests: list[tuple[int, np.ndarray, int]],
  *,
  pages_per_slot: int,
  block_size: int,
  num_tokens: int | None = None,
  num_reqs: int | None = None,
) -> tuple[jnp.ndarray, jnp.ndarray, PagedAttentionMetadata]:
  """One ragged model step of `(slot, token_ids, start)` requests over fixed pages per "slot":
  slot `s` owns pages `1 + s * pages_per_slot ...` (page 0 is the null page), and the request's
  tokens sit at positions `start, start + 1, ...` of its sequence (earlier positions already in
  its pages). Tokens past the real ones (up to `num_tokens`) are padding: id 0 at position 0,
  written to the null slot. Returns the `[1, T]` ids and positions and the step's metadata."""
  total = sum(len(ids) for _, ids, _ in requests)
  num_tokens = total if num_tokens is None else num_tokens
  num_reqs = len(requests) if num_reqs is None else num_reqs
  ids = np.zeros(num_tokens, np.int32)
  positions = np.zeros(num_tokens, np.int32)
  slot_mapping = np.full(num_tokens, NULL_SLOT, np.int32)
  tables = np.zeros((num_reqs, pages_per_slot), np.int32)
  start_loc = np.zeros(num_reqs + 1, np.int32)
  seq_lens = np.zeros(num_reqs, np.int32)
  at = 0
  for r, (slot, token_ids, start) in enumerate(requests):
    n = len(token_ids)
    tables[r] = 1 + slot * pages_per_slot + np.arange(pages_per_slot)
    pos = start + np.arange(n)
    ids[at : at + n] = token_ids
    positions[at : at + n] = pos
    slot_mapping[at : at + n] = tables[r, pos // block_size] * block_size + pos % block_size
    at += n
    start_loc[r + 1] = at
    seq_lens[r] = start + n
  start_loc[len(requests) + 1 :] = at
  md = _metadata(slot_mapping, tables, start_loc, seq_lens, len(requests))
  return jnp.asarray(ids)[None], jnp.asarray(positions)[None], md


def _metadata(slot_mapping, tables, start_loc, seq_lens, num_reqs: int) -> PagedAttentionMetadata:
  """A step's `PagedAttentionMetadata` from its host arrays, as device arrays."""
  return PagedAttentionMetadata(
    slot_mapping=jnp.asarray(slot_mapping),
    block_tables=jnp.asarray(tables),
    query_start_loc=jnp.asarray(start_loc),
    seq_lens=jnp.asarray(seq_lens),
    num_reqs=jnp.asarray(num_reqs, jnp.int32),
  )
