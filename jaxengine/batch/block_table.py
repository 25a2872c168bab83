"""`BlockTable`: each row's pages of a paged KV cache, kept with the persistent batch.

With a paged KV cache a request's keys and values live in pages (blocks) the engine hands out as
its sequence grows; the block table lists them by row, as vLLM V1's `InputBatch.block_table`
does. It is host NumPy, changed one way only: `set_row` with a row's whole tables, as each
`SchedulerOutput.block_ids` carries them for the rows whose pages changed (the runner sends the
scheduled rows' tables with each step), and it moves with the rows: `InputBatch.condense` and
`swap_states` move a row's table as they move every other per-row field, so row `i`'s table
always belongs to `req_ids[i]`.

With several KV cache groups (`jaxengine/core/kv_cache_groups.py`: a model with sliding-window
layers) each row has one table per group, `[G, R, P]`; `block_ids` is the first group's.

Shape legend: `R` rows (`max_num_reqs`), `P` pages per row (`max_num_blocks_per_req`), `G` KV
cache groups.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class BlockTable:
  """The pages of each row, `[R, P] int32`, and how many each row holds.

  Args:
    max_num_reqs: rows `R`.
    max_num_blocks_per_req: pages a row can hold `P` (`ceil(max_model_len / block_size)`).
    num_groups: KV cache groups `G` (tables per row).

  Raises:
    ValueError: a size below 1.
  """

  def __init__(self, max_num_reqs: int, max_num_blocks_per_req: int, num_groups: int = 1) -> None:
    if max_num_reqs < 1 or max_num_blocks_per_req < 1 or num_groups < 1:
      raise ValueError(
        f"max_num_reqs, max_num_blocks_per_req and num_groups must be >= 1, got {max_num_reqs}, "
        f"{max_num_blocks_per_req} and {num_groups}"
      )
    #: `[G, R, P] int32` block ids by group and row; entries past `num_blocks[row]` are 0 (the
    #: null page), as are pages a window group freed.
    self.group_block_ids = np.zeros((num_groups, max_num_reqs, max_num_blocks_per_req), np.int32)
    #: `[R] int32` table entries of each row (the same in every group).
    self.num_blocks = np.zeros(max_num_reqs, np.int32)

  @property
  def block_ids(self) -> np.ndarray:
    """`[R, P] int32` the first group's tables (a view)."""
    return self.group_block_ids[0]

  @property
  def num_groups(self) -> int:
    """`G`, tables per row."""
    return self.group_block_ids.shape[0]

  @property
  def max_num_blocks_per_req(self) -> int:
    """`P`, the most pages a row holds."""
    return self.block_ids.shape[1]

  def row(self, row: int) -> np.ndarray:
    """Row `row`'s pages (a view of its first `num_blocks[row]` entries)."""
    return self.block_ids[row, : self.num_blocks[row]]

  def group_rows(self, row: int) -> np.ndarray:
    """`[G, num_blocks[row]]` row `row`'s pages in every group (a view)."""
    return self.group_block_ids[:, row, : self.num_blocks[row]]

  def set_row(self, row: int, group_block_ids: Sequence[Sequence[int]]) -> None:
    """Replaces row `row`'s tables with every group's (equally long; freed pages 0).

    Raises:
      ValueError: not `G` tables, tables of different lengths or longer than `P`.
    """
    lengths = {len(table) for table in group_block_ids}
    if len(group_block_ids) != self.num_groups or len(lengths) != 1:
      raise ValueError(f"row {row} needs {self.num_groups} equally long tables, got {lengths}")
    (length,) = lengths
    if length > self.max_num_blocks_per_req:
      raise ValueError(
        f"row {row} would hold {length} blocks; a row holds at most {self.max_num_blocks_per_req}"
      )
    self.group_block_ids[:, row] = 0
    if length:  # empty tables (a preempted row): nothing to copy
      tables = np.asarray(group_block_ids, np.int32).reshape(-1, length)
      self.group_block_ids[:, row, :length] = tables
    self.num_blocks[row] = length

  def clear_row(self, row: int) -> None:
    """Empties row `row` (a new request there, or its pages freed by preemption)."""
    self.group_block_ids[:, row] = 0
    self.num_blocks[row] = 0

  def move_row(self, src: int, dst: int) -> None:
    """Moves row `src`'s table to row `dst` (condense); `src` is left empty."""
    self.group_block_ids[:, dst] = self.group_block_ids[:, src]
    self.num_blocks[dst] = self.num_blocks[src]
    self.clear_row(src)

  def swap_rows(self, i1: int, i2: int) -> None:
    """Exchanges two rows' tables."""
    self.group_block_ids[:, [i1, i2]] = self.group_block_ids[:, [i2, i1]]
    self.num_blocks[[i1, i2]] = self.num_blocks[[i2, i1]]
