"""`BatchComposition`: which request occupies which row of the persistent batch, and the device
update of each composition change (the base of `InputBatch`, which adds the steps).

The host keeps the bookkeeping a scheduler talks to (`req_ids`, `req_id_to_index`, free rows and
cache slots, each row's `RequestLedger`: the request's record of its output tokens, its own
`Completion` in an engine, `jaxengine/batch/ledger.py`) and turns every composition change into one
call of a jitted, donating update of the device-side `BatchState`:

  add_request      -> `write_rows` (every per-row field overwritten: no stale state is inherited;
                      the rows admitted since the state was last read, in one call per 8;
                      `add_encoded_request` takes a request `validate_request` encoded already)
  remove_request   -> host only (the row becomes a hole; its stale values are never read)
  condense         -> `move_rows` (highest live rows into the lowest holes; order not preserved)
  swap_states      -> `move_rows`

`SamplingMetadata` is rebuilt by one jitted call when first needed after such a change (else the
same object is reused). Dispatched steps are read here too (`resolve`), in dispatch order; the
tokens of a request added without its own ledger land in the `BatchLedger` the batch keeps for it.
Every check of user input happens on the host before any device work.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import cast

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.batch.block_table import BlockTable
from jaxengine.batch.host_output import FetchedStep, HostOutput, PendingStep
from jaxengine.batch.ledger import BatchLedger, RequestLedger
from jaxengine.batch.rows import EncodedRequest, encode_request, eos_tuple
from jaxengine.batch.step_queue import StepQueue
from jaxengine.config import BatchConfig
from jaxengine.params import SamplingParams, is_int
from jaxengine.sample import (
  WRITE_CHUNK,
  BatchState,
  RowUpdate,
  SamplingMetadata,
  batch_key_data,
  move_plan,
  move_rows,
  refresh_metadata,
  write_rows,
)


class BatchComposition:
  """The rows of a fixed-capacity batch: requests in, out, moved, and their tokens landing.

  `InputBatch` is the class to use (its keywords build the `BatchConfig`; it runs the steps).

  Args:
    config: the batch's `BatchConfig`.
    eos_token_ids: EOS ids added to every request's min_tokens stop set.
    seed: seed of the batch key from which unseeded requests' keys are derived.
  """

  #: Each row's pages of a paged KV cache, or None (see `InputBatch`'s `max_num_blocks_per_req`).
  block_table: BlockTable | None

  def __init__(
    self, config: BatchConfig, eos_token_ids: Sequence[int] | int | None = (), seed: int = 0
  ) -> None:
    """An empty batch of `config` (`InputBatch` builds the config from its keywords).

    Raises:
      ValueError: for EOS ids outside the vocabulary.
    """
    self.eos_token_ids = eos_tuple(eos_token_ids, config.vocab_size)
    self.config = config
    self._state = BatchState.create(config)
    # Rows admitted but not yet written to the device state: written together (`write_rows`,
    # `WRITE_CHUNK` at a time) the next time the state is read, one device call per chunk
    # rather than one per request.
    self._pending_rows: list[tuple[int, RowUpdate]] = []
    self._batch_key_data = batch_key_data(seed)
    self._serials = itertools.count()
    # Row-indexed host bookkeeping; None marks a hole (a removed request not yet condensed).
    self._req_ids: list[str | None] = []
    self._ledgers: list[RequestLedger | None] = []  # each row's record of its tokens
    self.req_id_to_index: dict[str, int] = {}
    # Request-keyed bookkeeping (follows the request through moves without re-keying).
    self._num_logprobs: dict[str, int] = {}
    self._cache_slots: dict[str, int] = {}
    self._free_cache_slots = list(range(config.max_num_reqs))
    self._metadata: SamplingMetadata | None = None
    self.block_table = None
    #: Steps dispatched and not yet read (oldest first).
    self._steps = StepQueue()

  # --- views ------------------------------------------------------------------------------------

  @property
  def max_num_reqs(self) -> int:
    """`R`, rows of the batch."""
    return self.config.max_num_reqs

  @property
  def max_model_len(self) -> int:
    """`S`, maximum prompt plus output tokens of a request."""
    return self.config.max_model_len

  @property
  def vocab_size(self) -> int:
    """`V`, width of the logits."""
    return self.config.vocab_size

  @property
  def max_num_logprobs(self) -> int:
    """Largest logprobs a request may ask for (`-1`: the whole vocabulary)."""
    return self.config.max_num_logprobs

  @property
  def logprobs_mode(self) -> str:
    """What logprobs report (see `BatchConfig`)."""
    return self.config.logprobs_mode

  @property
  def num_reqs(self) -> int:
    """Number of requests in the batch."""
    return len(self.req_id_to_index)

  @property
  def req_ids(self) -> list[str]:
    """Request ids by row. After `condense` its length is `num_reqs`; before, holes are None."""
    return cast(list[str], list(self._req_ids))  # holes only between a removal and condense

  @property
  def req_output_token_ids(self) -> list[list[int] | None]:
    """Each row's output tokens so far (its ledger's live list; resolves dispatched steps
    first)."""
    self.resolve_all()
    return [None if ledger is None else ledger.token_ids for ledger in self._ledgers]

  @property
  def max_requested_logprobs(self) -> int | None:
    """`k`, the largest logprobs count a live request asked for (`V` for `-1`), or None when no
    live request asked: how many logprobs columns a step's output needs on the host."""
    return max(self._num_logprobs.values(), default=None)

  @property
  def _state(self) -> BatchState:
    """The device state, with the admitted rows written first (`_write_pending_rows`)."""
    if self._pending_rows:
      self._write_pending_rows()
    return self._state_value

  @_state.setter
  def _state(self, value: BatchState) -> None:
    self._state_value = value

  def _write_pending_rows(self) -> None:
    """Writes the admitted rows, `WRITE_CHUNK` per device call (a chunk padded with copies of its
    last write, which write the same values again), in admission order."""
    pending, self._pending_rows = self._pending_rows, []
    state = self._state_value
    for start in range(0, len(pending), WRITE_CHUNK):
      chunk = pending[start : start + WRITE_CHUNK]
      chunk += [chunk[-1]] * (WRITE_CHUNK - len(chunk))
      indices = np.array([row for row, _ in chunk], np.int32)
      rows = jax.tree.map(lambda *xs: np.stack(xs), *[update for _, update in chunk])
      state = write_rows(state, indices, rows, self._batch_key_data)
    self._state_value = state

  @property
  def state(self) -> BatchState:
    """The device-side state (read it, do not keep it: the next update donates its buffers)."""
    return self._state

  @property
  def sampling_metadata(self) -> SamplingMetadata:
    """Metadata for the current composition; the same object until the composition changes."""
    if self._metadata is None:
      self._metadata = refresh_metadata(self._state, jnp.asarray(self._is_live()))
    return self._metadata

  def place_state(self, shardings) -> None:
    """Puts the device state on `shardings` (a `BatchState` tree: an engine on a mesh, once at
    start-up; the batch's own updates keep that placement)."""
    self._state, self._metadata = jax.device_put(self._state, shardings), None

  def cache_slot(self, req_id: str) -> int:
    """The KV-cache slot held by `req_id` (stable for the request's lifetime in the batch).

    Raises:
      KeyError: for an id not in the batch (as do `num_tokens` and `output_token_ids`).
    """
    return self._cache_slots[req_id]

  def num_tokens(self, req_id: str) -> int:
    """Prompt plus output tokens of `req_id` so far (those of steps not resolved included), as
    its ledger counts them."""
    return self._ledger(req_id).num_tokens_with_placeholders

  def output_token_ids(self, req_id: str) -> list[int]:
    """The output tokens of `req_id` so far (its ledger's live list; resolves dispatched
    steps)."""
    self.resolve_all()
    return self._ledger(req_id).token_ids

  def _ledger(self, req_id: str) -> RequestLedger:
    ledger = self._ledgers[self.req_id_to_index[req_id]]
    assert ledger is not None  # a live request's row is never a hole
    return ledger

  def _is_live(self) -> np.ndarray:
    return np.isin(np.arange(self.max_num_reqs), list(self.req_id_to_index.values()))

  def _composition_changed(self) -> None:
    self._metadata = None

  # --- composition changes ------------------------------------------------------------------------

  def add_request(
    self,
    req_id: str,
    prompt_token_ids: Sequence[int],
    sampling_params: SamplingParams,
    output_token_ids: Sequence[int] = (),
  ) -> int:
    """Adds a request in the lowest free row and returns that row.

    Args:
      req_id: unique id of the request.
      prompt_token_ids: the prompt, at least one id, ids in `[0, vocab_size)` (an empty prompt
        is refused, as `LLMEngine` refuses it: the first token would have nothing to follow).
      sampling_params: the request's `SamplingParams`.
      output_token_ids: tokens already generated (a resumed request); they count for penalties,
        bad words and min_tokens, and the request's key continues from their number.

    Returns:
      The row the request occupies.

    Raises:
      ValueError: (the batch is left unchanged) for a `req_id` that is not a str or is already
        present, a full batch, an empty prompt, token ids that are not ints in `[0, vocab_size)` in
        any field, more than `max_model_len` tokens, lists longer than the batch's capacities,
        logprobs above `max_num_logprobs`, or constraints that ban every token whatever the output
        (an allowlist covered by single-token bad words, or by them plus the stop set under
        min_tokens).
    """
    self._check_room(req_id)
    request = self.validate_request(prompt_token_ids, sampling_params, output_token_ids)
    return self.add_encoded_request(req_id, request)

  def add_encoded_request(
    self, req_id: str, request: EncodedRequest, ledger: RequestLedger | None = None
  ) -> int:
    """`add_request` of a request `validate_request` encoded already (an engine encodes each
    request once, when it arrives); returns its row.

    Args:
      req_id: unique id of the request.
      request: the request encoded as a row.
      ledger: the request's own record of its tokens (an engine's `Completion`, holding
        `request.output_token_ids`), which its owner writes: it appends the tokens of each step
        it reads and counts those of each step it dispatches in `num_output_placeholders`; the
        batch only reads it. None: the batch keeps a `BatchLedger` and writes it itself.

    Raises:
      ValueError: (the batch is left unchanged) for a `req_id` that is not a str or is already
        present, or a full batch.
    """
    self._check_room(req_id)
    # Validated: from here on nothing can fail on bad input.
    row = next((i for i, rid in enumerate(self._req_ids) if rid is None), len(self._req_ids))
    cache_slot = self._free_cache_slots.pop(0)
    serial = next(self._serials) % 2**32
    update = request.row_update(self.max_model_len, cache_slot, serial)
    self._pending_rows.append((row, update))  # written when the state is next read
    if ledger is None:
      outputs = list(request.output_token_ids.tolist())
      ledger = BatchLedger(len(request.prompt_token_ids), outputs)
    if row == len(self._req_ids):
      self._req_ids.append(req_id)
      self._ledgers.append(ledger)
    else:
      self._req_ids[row] = req_id
      self._ledgers[row] = ledger
    self.req_id_to_index[req_id] = row
    if self.block_table is not None:
      self.block_table.clear_row(row)
    self._cache_slots[req_id] = cache_slot
    if request.row.num_logprobs >= 0:
      self._num_logprobs[req_id] = int(request.row.num_logprobs)
    self._composition_changed()
    return row

  def _check_room(self, req_id: str) -> None:
    """Refuses (ValueError) an id that is not a str or is in the batch, or a full batch."""
    if not isinstance(req_id, str):
      raise ValueError(f"req_id must be a str, got {req_id!r}")
    if req_id in self.req_id_to_index:
      raise ValueError(f"req_id {req_id!r} is already in the batch")
    if self.num_reqs >= self.max_num_reqs:
      raise ValueError(
        f"the batch is full (max_num_reqs={self.max_num_reqs}); cannot add {req_id!r}"
      )

  def validate_request(
    self,
    prompt_token_ids: Sequence[int],
    sampling_params: SamplingParams,
    output_token_ids: Sequence[int] = (),
  ) -> EncodedRequest:
    """Runs every check of `add_request` that does not depend on the batch's occupancy.

    Returns the request encoded as a row. Raises `ValueError` as `add_request` would.
    """
    args = (prompt_token_ids, sampling_params, output_token_ids)
    # Shapes and dtypes only: the rows not yet written do not matter (nor are they written).
    return encode_request(
      self.config, self.eos_token_ids, *args, self._state_value.logits_processor_states
    )

  def remove_request(self, req_id: str) -> int | None:
    """Removes a request, leaving a hole; returns its row, or None for an unknown id.

    Call `condense` before sampling (`sample` does it if you do not).
    """
    row = self.req_id_to_index.pop(req_id, None)
    if row is None:
      return None
    self._req_ids[row] = None
    self._ledgers[row] = None  # its tokens in unread steps are dropped when read
    self._num_logprobs.pop(req_id, None)
    self._free_cache_slots.append(self._cache_slots.pop(req_id))
    self._free_cache_slots.sort()
    self._composition_changed()
    return row

  def condense(self) -> list[tuple[int, int]]:
    """Moves the highest live rows into the lowest holes until rows `[0, num_reqs)` are dense.

    Order is not preserved (vLLM's rule): `[A, B, C, D, E]` minus B and D becomes `[A, E, C]`.

    Returns:
      The `(from_row, to_row)` moves made.
    """
    moves = []
    holes = [i for i, rid in enumerate(self._req_ids) if rid is None]
    live_rows = [i for i, rid in enumerate(self._req_ids) if rid is not None]
    while holes and live_rows and holes[0] < live_rows[-1]:
      src, dst = live_rows.pop(), holes.pop(0)
      moves.append((src, dst))
      req_id = self._req_ids[src]
      assert req_id is not None  # src is a live row
      self._req_ids[dst], self._req_ids[src] = req_id, None
      self._ledgers[dst], self._ledgers[src] = self._ledgers[src], None
      self.req_id_to_index[req_id] = dst
      if self.block_table is not None:
        self.block_table.move_row(src, dst)
    del self._req_ids[self.num_reqs :]
    del self._ledgers[self.num_reqs :]
    if moves:
      self._move_device_rows(moves)
      self._composition_changed()
    return moves

  def swap_states(self, i1: int, i2: int) -> None:
    """Exchanges the requests in rows `i1` and `i2` (every per-row field).

    Raises:
      ValueError: naming the argument, if `i1` or `i2` is not an int (bools are refused) in
        `[0, len(req_ids))`. Nothing is changed then.
    """
    for name, row in (("i1", i1), ("i2", i2)):
      if not is_int(row) or not 0 <= row < len(self._req_ids):
        raise ValueError(
          f"swap_states {name} must be an int row in [0, {len(self._req_ids)}), got {row!r}"
        )
    i1, i2 = int(i1), int(i2)
    if i1 == i2:
      return
    ids, ledgers = self._req_ids, self._ledgers
    ids[i1], ids[i2] = ids[i2], ids[i1]
    ledgers[i1], ledgers[i2] = ledgers[i2], ledgers[i1]
    if self.block_table is not None:
      self.block_table.swap_rows(i1, i2)
    for row in (i1, i2):
      req_id = ids[row]
      if req_id is not None:
        self.req_id_to_index[req_id] = row
    self._move_device_rows([(i1, i2), (i2, i1)])
    self._composition_changed()

  def precompile_updates(self) -> None:
    """Compiles the device updates of composition changes (`write_rows`, `move_rows`) and of
    `set_grammar_bitmask` now, on an empty batch, so that the first request does not wait for
    them. The batch is left as it was: row 0 of the state is written (a free row, overwritten
    whole by the next `add_request`), no row moves, no request is counted.

    Raises:
      ValueError: if the batch holds requests.
    """
    if self.num_reqs:
      raise ValueError(f"precompile needs an empty batch, it holds {self.num_reqs} requests")
    request = self.validate_request([0], SamplingParams())
    self._pending_rows.append((0, request.row_update(self.max_model_len, 0, 0)))
    self._write_pending_rows()
    self._move_device_rows([])  # only padding: every move dropped
    self.set_grammar_bitmask(np.full(self._state.grammar_bitmask.shape, -1, np.int32))

  def _move_device_rows(self, moves: list[tuple[int, int]]) -> None:
    self._state = move_rows(self._state, *move_plan(moves, self.max_num_reqs))

  def set_grammar_bitmask(self, bitmask) -> None:
    """`[R, ceil(V / 32)] int32` packed allowed tokens by row for the next steps (copied), read
    only in rows with `structured_outputs`. Raises ValueError for another shape."""
    if np.shape(bitmask) != (shape := self._state.grammar_bitmask.shape):
      raise ValueError(f"bitmask must have shape {shape}, got {np.shape(bitmask)}")
    # A host copy on the device: no conversion to compile, the caller's buffer is free. Where the
    # state was placed (`place_state`: on a mesh), it keeps that placement, so the steps see the
    # sharding they were compiled for.
    current = self._state.grammar_bitmask
    placement = current.sharding if current.committed else None
    grammar_bitmask = jax.device_put(np.array(bitmask, np.int32), placement)
    self._state = dataclasses.replace(self._state, grammar_bitmask=grammar_bitmask)

  # --- landing the tokens of dispatched steps --------------------------------------------------

  def resolve(self, pending: PendingStep[HostOutput]) -> HostOutput:
    """Brings `pending` (and every step dispatched before it) to the host and appends their
    tokens to the requests still in the batch that have a `BatchLedger` (an engine appends its
    completions' tokens itself); returns `fetch`'s host output over the step's live rows. A step
    already resolved returns the same output again."""
    while self._steps and pending.fetched is None:
      self._resolve_oldest()
    assert pending.fetched is not None  # every dispatched step is pending until resolved
    return pending.fetched.output

  def resolve_all(self) -> None:
    """Resolves every dispatched step (`resolve`)."""
    while self._steps:
      self._resolve_oldest()

  def _resolve_oldest(self) -> None:
    step = self._steps.pop_oldest()
    fetched = cast(FetchedStep, step.fetched)
    counts = step.num_new_tokens or [0] * len(step.rows)
    for (req_id, ledger), new_token_ids, count in zip(step.rows, fetched.new_token_ids, counts):
      row = self.req_id_to_index.get(req_id)
      if row is None or self._ledgers[row] is not ledger:
        continue  # removed since the dispatch: its tokens are dropped
      if isinstance(ledger, BatchLedger):  # else its owner appends them
        ledger.token_ids.extend(new_token_ids)
        ledger.num_output_placeholders -= count
