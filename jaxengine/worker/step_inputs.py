"""A ragged step's host-side inputs: positions, slots and the attention metadata, padded to buckets.

Given the requests the scheduler picked for a step (their block tables, tokens already computed
and tokens scheduled now), this builds in NumPy what vLLM V1's model runner prepares before the
forward pass: each query token's position (for rotary embeddings) and cache slot, the padded block
tables, `query_start_loc`, `seq_lens`, and the index of each request's last query token (the row
whose logits are sampled). Shapes are padded to the step's buckets `T` (tokens), `R` (requests)
and `P` (pages per request) so one executable serves every step of a bucket.

Host NumPy only; `StepInputs.metadata()` moves the attention part to the device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import cast

import jax
import numpy as np

from jaxengine.models.paged_attention import NULL_SLOT, PagedAttentionMetadata


@dataclasses.dataclass(frozen=True)
class StepInputs:
  """One step's padded inputs (NumPy, int32).

  Attributes:
    positions: `[T]` context position of each query token (0 for padding tokens).
    slot_mapping: `[T]` cache slot of each query token, `NULL_SLOT` for padding (`[G, T]`, one
      per KV cache group, with `num_groups`).
    block_tables: `[R, P]` pages of each request, 0 (the null page) past its own (`[G, R, P]`
      with `num_groups`).
    query_start_loc: `[R + 1]` cumulative query tokens (padding requests repeat the total).
    seq_lens: `[R]` context tokens after this step (0 for padding requests).
    logits_indices: `[R]` flat index of each request's last query token (0 for padding).
    num_reqs: real requests.
    num_tokens: real query tokens.
  """

  positions: np.ndarray
  slot_mapping: np.ndarray
  block_tables: np.ndarray
  query_start_loc: np.ndarray
  seq_lens: np.ndarray
  logits_indices: np.ndarray
  num_reqs: int
  num_tokens: int

  def metadata(self) -> PagedAttentionMetadata:
    """The attention metadata as device arrays (`jax.device_put`: a transfer, no compile)."""
    host = (self.slot_mapping, self.block_tables, self.query_start_loc, self.seq_lens)
    slot_mapping, block_tables, query_start_loc, seq_lens, num_reqs = jax.device_put(
      (*host, np.int32(self.num_reqs))
    )
    return PagedAttentionMetadata(
      slot_mapping=slot_mapping,
      block_tables=block_tables,
      query_start_loc=query_start_loc,
      seq_lens=seq_lens,
      num_reqs=num_reqs,
    )


def build_step_inputs(
  block_ids: Sequence[Sequence[int]],
  num_computed_tokens: Sequence[int],
  num_scheduled_tokens: Sequence[int],
  *,
  block_size: int,
  num_tokens: int,
  num_reqs: int,
  max_blocks_per_req: int,
  num_groups: int | None = None,
) -> StepInputs:
  """Lays out a ragged step: the requests' tokens back to back, padded to the buckets.

  Args:
    block_ids: each scheduled request's block table (`KVCacheManager.get_block_ids`), already
      grown for this step.
    num_computed_tokens: tokens of each request already in its blocks.
    num_scheduled_tokens: tokens of each request computed this step (`>= 1`).
    block_size: positions per page `B`.
    num_tokens: the token bucket `T` (`>=` the scheduled tokens).
    num_reqs: the request bucket `R` (`>=` the scheduled requests).
    max_blocks_per_req: the block-table bucket `P` (`>=` every request's pages after this step).
    num_groups: None: `block_ids[i]` is request `i`'s one table. `G`: `block_ids[i]` holds its
      `G` tables (KV cache groups, `KVCacheManager.get_group_block_ids`) and the slots and
      tables get a leading group axis.

  Returns:
    The step's `StepInputs`.

  Raises:
    ValueError: lengths that disagree, a request with no scheduled token or a negative count,
      tokens or requests beyond their bucket, or a block table too short for its tokens or too
      long for `P` (naming the request's index and the numbers).
  """
  count = len(block_ids)
  if not len(num_computed_tokens) == len(num_scheduled_tokens) == count:
    raise ValueError(
      f"block_ids, num_computed_tokens, num_scheduled_tokens have lengths {count}, "
      f"{len(num_computed_tokens)}, {len(num_scheduled_tokens)}; they must agree"
    )
  computed = np.asarray(num_computed_tokens, np.int64).reshape(count)
  scheduled = np.asarray(num_scheduled_tokens, np.int64).reshape(count)
  _check_counts(computed, scheduled, num_tokens, num_reqs)
  seq_lens = computed + scheduled
  grouped = [[blocks] for blocks in block_ids] if num_groups is None else block_ids
  tables = np.zeros((num_groups or 1, num_reqs, max_blocks_per_req), np.int32)
  for index, groups in enumerate(grouped):
    needed = -(-int(seq_lens[index]) // block_size)
    for group, blocks in enumerate(cast(Sequence[Sequence[int]], groups)):
      if not needed <= len(blocks) <= max_blocks_per_req:
        raise ValueError(
          f"request {index} holds {len(blocks)} blocks; its {seq_lens[index]} tokens need "
          f"{needed} and the bucket max_blocks_per_req={max_blocks_per_req} allows at most "
          "that many"
        )
      tables[group, index, : len(blocks)] = blocks
  total = int(scheduled.sum())
  start_loc = np.zeros(num_reqs + 1, np.int64)
  start_loc[1 : count + 1] = np.cumsum(scheduled)
  start_loc[count + 1 :] = total
  req = np.repeat(np.arange(count), scheduled)  # [total] request of each token
  positions = np.zeros(num_tokens, np.int64)
  positions[:total] = computed[req] + np.arange(total) - start_loc[req]
  slots = np.full((len(tables), num_tokens), NULL_SLOT, np.int64)
  pos = positions[:total]
  slots[:, :total] = tables[:, req, pos // block_size].astype(np.int64) * block_size
  slots[:, :total] += pos % block_size
  if num_groups is None:  # one table: no group axis
    slots, tables = slots[0], tables[0]
  logits_indices = np.zeros(num_reqs, np.int64)
  logits_indices[:count] = start_loc[1 : count + 1] - 1
  padded_seq_lens = np.zeros(num_reqs, np.int64)
  padded_seq_lens[:count] = seq_lens
  return StepInputs(
    positions=positions.astype(np.int32),
    slot_mapping=slots.astype(np.int32),
    block_tables=tables,
    query_start_loc=start_loc.astype(np.int32),
    seq_lens=padded_seq_lens.astype(np.int32),
    logits_indices=logits_indices.astype(np.int32),
    num_reqs=count,
    num_tokens=total,
  )


def _check_counts(computed: np.ndarray, scheduled: np.ndarray, num_tokens: int, num_reqs: int):
  if computed.size and (computed.min() < 0 or scheduled.min() < 1):
    raise ValueError(
      "num_computed_tokens must be >= 0 and num_scheduled_tokens >= 1 for every request, got "
      f"{computed.tolist()} and {scheduled.tolist()}"
    )
  if computed.size > num_reqs:
    raise ValueError(f"{computed.size} requests exceed the bucket num_reqs={num_reqs}")
  if scheduled.sum() > num_tokens:
    raise ValueError(
      f"{scheduled.sum()} scheduled tokens exceed the bucket num_tokens={num_tokens}"
    )
