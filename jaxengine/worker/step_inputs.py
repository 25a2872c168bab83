"""A ragged step's host-side inputs: positions, slots and the attention metadata, padded to buckets.

Given the requests the scheduler picked for a step (their block tables, tokens already computed
and tokens scheduled now), this builds in NumPy what vLLM V1's model runner prepares before the
forward pass: each query token's position (for rotary embeddings) and cache slot, the padded block
tables, `query_start_loc`, `seq_lens`, and the index of each request's last query token (the row
whose logits are sampled). Shapes are padded to the step's buckets `T` (tokens), `R` (requests)
and `P` (pages per request) so one executable serves every step of a bucket.

`build_step_inputs` is host NumPy only (`StepInputs.metadata()` moves the attention part to the
device); `ragged_inputs` lays out a runner's step from its batch and the scheduler's plan and puts
every input on the device in one transfer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, cast

import jax
import numpy as np

from jaxengine.batch import InputBatch
from jaxengine.batch.block_table import BlockTable
from jaxengine.core.scheduler import SchedulerOutput
from jaxengine.core.state_snapshots import StateRoute
from jaxengine.lora import LoRAManager
from jaxengine.models.paged_attention import NULL_SLOT, PagedAttentionMetadata
from jaxengine.worker.ragged_step import RaggedInputs


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
  block_ids: Sequence[Sequence[int] | np.ndarray],
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
    block_ids: each scheduled request's block table (`KVCacheManager.get_block_ids`, or a
      view of a `BlockTable` row), already grown for this step.
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


def query_starts(batch: InputBatch, scheduled: SchedulerOutput) -> dict[str, int]:
  """Each scheduled completion's first flat token index in the step (rows in batch order)."""
  index = batch.req_id_to_index
  order = sorted(scheduled.num_scheduled_tokens, key=index.__getitem__)
  counts = [scheduled.num_scheduled_tokens[s] for s in order]
  return dict(zip(order, np.cumsum([0, *counts[:-1]]).tolist()))


def produced_rows(batch: InputBatch, scheduled: SchedulerOutput) -> list[bool]:
  """Whether the step computes each batch row's last known token (so samples its next one)."""
  produced = []
  for seq_id in batch.req_ids:
    count = scheduled.num_scheduled_tokens.get(seq_id)
    if count is None:
      produced.append(False)
      continue
    drafts = len(scheduled.spec_token_ids.get(seq_id, ()))
    done = scheduled.num_computed_tokens[seq_id]
    produced.append(done + count - drafts == batch.num_tokens(seq_id))
  return produced


def ragged_inputs(
  batch: InputBatch,
  block_table: BlockTable,
  scheduled: SchedulerOutput,
  num_tokens: int,
  num_rows: int,
  produces: Sequence[bool] = (),
  *,
  block_size: int,
  num_sample_rows: int | None = None,
  lora: LoRAManager | None = None,
  sharding: jax.sharding.Sharding | None = None,
  state_slots: Mapping[str, int] | None = None,
  state_routes: Mapping[str, StateRoute] | None = None,
  num_draft_states: int = 0,
) -> RaggedInputs:
  """A runner's step as `RaggedInputs`: the scheduled rows in row order, padded to the buckets.

  Args:
    batch: the persistent batch (condensed), whose rows the step computes.
    block_table: its rows' pages (`[G, rows, P]` with several KV cache groups).
    scheduled: the scheduler's plan.
    num_tokens: `T`, the token bucket.
    num_rows: `R`, the row bucket.
    produces: which live rows sample, by row (none when empty).
    block_size: positions per page.
    num_sample_rows: `S >= R`, the rows of the sampler's `logits_indices` and `produces`
      (`worker/buckets.py`'s `sample_rows`; rows past `R` are padding that samples nothing), or
      None for `R`.
    lora: the runner's adapters: each token's slot is an input (None: no LoRA).
    sharding: where the inputs go (one transfer), None: the default device.
    state_slots: None (a model without recurrent state), or each scheduled completion's
      recurrent state slot (`SchedulerOutput.state_slots`): the metadata's ``[R] int32``
      ``state_slots`` (0, the null slot, for padding rows).
    state_routes: None, or with a hybrid model's prefix caching or speculative decoding each
      scheduled completion's `StateRoute` (`SchedulerOutput.state_routes`): the metadata's
      ``state_slots`` is then ``[R, 4 + num_draft_states] int32``, per row its slot, source,
      snapshot slot and snapshot length, then its draft slots (0 past its drafts;
      `jaxengine.models.gated_deltanet.StepRows`).
    num_draft_states: `k` in a verify step of a hybrid model (`core/state_slots.py`), else 0.
  """
  rows = sorted(batch.req_id_to_index[seq_id] for seq_id in scheduled.num_scheduled_tokens)
  seq_ids = [batch.req_ids[row] for row in rows]
  computed = [scheduled.num_computed_tokens[s] for s in seq_ids]
  counts = [scheduled.num_scheduled_tokens[s] for s in seq_ids]
  grouped = block_table.num_groups > 1
  tables = block_table.group_rows if grouped else block_table.row
  layout = build_step_inputs(
    [tables(row) for row in rows],  # views of the batch's table: the one host copy
    computed,
    counts,
    block_size=block_size,
    num_tokens=num_tokens,
    num_reqs=num_rows,
    max_blocks_per_req=block_table.max_num_blocks_per_req,
    num_groups=block_table.num_groups if grouped else None,
  )
  token_rows = np.zeros(num_tokens, np.int32)
  token_rows[: layout.num_tokens] = np.repeat(rows, counts)
  sample_rows = num_rows if num_sample_rows is None else num_sample_rows
  logits_indices = np.zeros(sample_rows, np.int32)
  logits_indices[rows] = layout.logits_indices[: len(rows)]
  produced = np.zeros(sample_rows, bool)
  produced[: len(produces)] = produces
  host: tuple[Any, ...] = (
    token_rows,
    layout.positions,
    layout.slot_mapping,
    layout.block_tables,
    layout.query_start_loc,
    layout.seq_lens,
    np.int32(layout.num_reqs),
    logits_indices,
    produced,
  )
  if state_slots is not None:  # each row's recurrent state slot, only for a hybrid model
    own = [state_slots[s] for s in seq_ids]
    if state_routes is None:
      row_slots = np.zeros(num_rows, np.int32)
      row_slots[: len(seq_ids)] = own
    else:  # [R, 4 + k]: slot, source, snapshot slot, snapshot length, draft slots
      row_slots = np.zeros((num_rows, 4 + num_draft_states), np.int32)
      for i, (slot, seq_id) in enumerate(zip(own, seq_ids)):
        route = state_routes[seq_id]
        row_slots[i, :4] = (slot, route.source, route.snapshot, route.snapshot_len)
        row_slots[i, 4 : 4 + len(route.drafts)] = route.drafts
    host += (row_slots,)
  if lora is not None:  # each token's adapter slot, only for a LoRA engine
    host += (lora.token_slots(seq_ids, counts, num_tokens),)
  device = jax.device_put(host, sharding)  # one transfer for the step's inputs
  return RaggedInputs(
    token_rows=device[0],
    positions=device[1],
    attention=PagedAttentionMetadata(
      slot_mapping=device[2],
      block_tables=device[3],
      query_start_loc=device[4],
      seq_lens=device[5],
      num_reqs=device[6],
      state_slots=None if state_slots is None else device[9],
    ),
    logits_indices=device[7],
    produces=device[8],
    lora=None if lora is None else lora.inputs(device[-1]),
  )
