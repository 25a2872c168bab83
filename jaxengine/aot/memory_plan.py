"""The memory of one chip: weights, KV-cache pages, the largest temporary, against its HBM.

The pool is sized by the engine's own rule (`worker/kv_cache_size.py`'s
`default_num_kv_blocks`): `gpu_memory_utilization` of the chip less what is held, at most room
for `max_num_reqs` requests of `max_model_len` tokens and a quarter more, at least one such
request. A topology's devices report no memory statistics, so the capacity is the chip's HBM
(`aot/topologies.py`) and what is held is counted from the shapes: the weights' shards, the
batch's state, the LoRA slots, and the largest temporary buffer of any compiled executable
(XLA's `memory_analysis().temp_size_in_bytes`), which the engine needs on top while a step runs.

Pages are counted as the engine counts them (`core/kv_cache_groups.py`): a page holds one
`block_size`-token slice of `group_size` layers, and a request holds pages in each KV cache
group: every position's in a full-attention group, at most its window's (and one step's chunk)
in a sliding-window group. So a model with sliding-window layers (Gemma 2, Gemma 3) holds a
long request in fewer pages than its layers' count suggests, and `MemoryPlan.request_blocks`
(not the bytes per token) says how long a request fits.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from jaxengine.core.kv_cache_groups import max_group_blocks
from jaxengine.worker.kv_cache_pool import cache_groups
from jaxengine.worker.kv_cache_size import PREFIX_CACHE_SHARE, bytes_per_block


def bytes_per_device(tree: Any) -> int:
  """Bytes one device holds of `tree`'s `jax.ShapeDtypeStruct`s (each leaf's shard, by its
  sharding; a leaf without one counts whole)."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    shape = leaf.shape
    sharding = getattr(leaf, "sharding", None)
    if sharding is not None:
      shape = sharding.shard_shape(shape)
    total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
  return int(total)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
  """One chip's memory (bytes per device).

  Attributes:
    weights: the model's weights (its shard on a mesh), LoRA slots included.
    other: the batch's state and sampling metadata, and a hybrid model's recurrent state pool.
    temp: the largest temporary of the compiled executables (0: none compiled, not known).
    per_block: one page (`group_size` layers of `block_size` positions; this device's share).
    num_blocks: the pages the engine allocates (the null page included).
    fit_blocks: the pages the budget holds (uncapped; the user's size with a fixed pool).
    needed_blocks: the fewest the engine accepts: one request of `max_model_len` and the null page.
    block_size: positions per page.
    group_windows: each KV cache group's sliding window, None for full attention (a token of a
      request holds a page slot in each group while it is in that group's window).
    max_num_batched_tokens: the step's token budget (a window group also keeps one chunk's pages).
    max_model_len: the engine's `max_model_len`.
    max_position_embeddings: the model's limit (the longest `max_model_len` the engine takes).
    state_bytes_per_token: the batch state's bytes per `max_model_len` token (its token ids).
    hbm: the chip's capacity.
    utilization: `gpu_memory_utilization`.
    fixed_pool: the user's pool size as given (``"num_kv_blocks=..."`` or
      ``"kv_cache_memory_bytes=..."``), or None for the default size.

  With a fixed pool, `num_blocks` and `fit_blocks` are the user's size, and the engine fits when
  the pool holds one request of `max_model_len` and everything held fits the chip.
  """

  weights: int
  other: int
  temp: int
  per_block: int
  num_blocks: int
  fit_blocks: int
  needed_blocks: int
  block_size: int
  group_windows: tuple[int | None, ...]
  max_num_batched_tokens: int | None
  max_model_len: int
  max_position_embeddings: int
  state_bytes_per_token: int
  hbm: int
  utilization: float
  fixed_pool: str | None = None

  @property
  def fits(self) -> bool:
    """One request of `max_model_len` fits, and everything held fits the chip's HBM."""
    return self.fit_blocks >= self.needed_blocks and self.total <= self.hbm

  @property
  def num_groups(self) -> int:
    """KV cache groups (one for a model without sliding windows)."""
    return len(self.group_windows)

  @property
  def kv_cache(self) -> int:
    """Bytes of the allocated pool: `num_blocks * per_block`."""
    return self.num_blocks * self.per_block

  @property
  def total(self) -> int:
    return self.weights + self.other + self.temp + self.kv_cache

  @property
  def bytes_per_token(self) -> int:
    """KV bytes one token of a request takes while every group holds it (each group's page
    slot: every layer's keys and values, and any slots a last group leaves unused)."""
    return self.per_block * self.num_groups // self.block_size

  @property
  def max_tokens(self) -> int:
    """Tokens the allocated pages hold (the null page left out) with each held by every group:
    ``max_tokens * bytes_per_token <= kv_cache``."""
    return self.tokens_in(self.num_blocks)

  @property
  def budget_tokens(self) -> int:
    """As `max_tokens`, for the pages the budget holds (`fit_blocks`)."""
    return self.tokens_in(self.fit_blocks)

  def tokens_in(self, blocks: int) -> int:
    """Tokens `blocks` pages (the null page among them) hold, each held by every group."""
    return max(blocks - 1, 0) // self.num_groups * self.block_size

  @property
  def needed(self) -> int:
    """Bytes per device the engine needs at least (one request of `max_model_len`)."""
    return self.weights + self.other + self.temp + self.needed_blocks * self.per_block

  def request_blocks(self, tokens: int) -> int:
    """Pages one request of `tokens` tokens holds at most, over every group (a window group's
    bounded by its window and one step's chunk), as the engine counts them."""
    return sum(
      max_group_blocks(window, tokens, self.block_size, self.max_num_batched_tokens)
      for window in self.group_windows
    )

  def longest_request(self, blocks: int) -> int:
    """The longest `max_model_len` (at most `max_position_embeddings`) whose request fits in
    `blocks` pages beside the null page: 0 when not even one token does."""
    return self._longest(lambda tokens: 1 + self.request_blocks(tokens) <= blocks)

  @property
  def longest_fitting(self) -> int:
    """The longest `max_model_len` that fits this chip with everything else unchanged (the
    batch state's token ids grow with it): one request of it in the pages the budget holds
    then, or with a fixed pool, in that pool while everything fits the chip (0: none does)."""

    def fits(tokens: int) -> bool:
      other = self.other + self.state_bytes_per_token * (tokens - self.max_model_len)
      held = self.weights + other + self.temp
      if self.fixed_pool is not None:
        blocks = self.num_blocks if held + self.kv_cache <= self.hbm else 0
      else:
        blocks = max(int(self.utilization * self.hbm) - held, 0) // self.per_block
      return 1 + self.request_blocks(tokens) <= blocks

    return self._longest(fits)

  def _longest(self, fits: Any) -> int:
    """The largest `tokens` in ``[1, max_position_embeddings]`` that `fits` (monotone: true up
    to some length), 0 when none."""
    low, high = 0, self.max_position_embeddings
    while low < high:
      mid = (low + high + 1) // 2
      if fits(mid):
        low = mid
      else:
        high = mid - 1
    return low

  def context_bytes(self, tokens: int) -> int:
    """KV bytes a step reads for one request at a context of `tokens`: every full group's
    positions, a window group's last `W` (this device's share)."""
    positions = sum(tokens if w is None else min(tokens, w) for w in self.group_windows)
    return positions * self.per_block // self.block_size

  def requests_fit(self, tokens: int) -> int:
    """Requests of `tokens` tokens the allocated pages hold at once."""
    return max(self.num_blocks - 1, 0) // max(self.request_blocks(tokens), 1)

  def pool_bytes_budget(self) -> int:
    """Bytes per device left for the pool: the chip's HBM at `gpu_memory_utilization` (the
    whole HBM with a fixed pool, as the engine checks it) less everything else held."""
    limit = self.hbm if self.fixed_pool else int(self.utilization * self.hbm)
    return limit - self.weights - self.other - self.temp


def memory_plan(engine: Any, hbm: int, temp: int = 0) -> MemoryPlan:
  """The plan of an `AbstractEngine` (`aot/executables.py`) on a chip of `hbm` bytes, with the
  largest temporary `temp` (0 before anything compiled)."""
  config = engine.config
  per_block = bytes_per_block(engine.page_spec, engine.backend, config.block_size)
  weights = bytes_per_device(engine.weights)
  if engine.lora is not None:
    weights += bytes_per_device(engine.sharded(engine.lora.buffers))
  placement = engine.placement
  other = bytes_per_device(
    engine.sharded(engine.batch.state, placement.state if placement else None)
  )
  other += bytes_per_device(
    engine.sharded(engine.batch.sampling_metadata, placement.metadata if placement else None)
  )
  pool = getattr(engine, "recurrent_pool", lambda: None)()  # a hybrid model's state slots
  pool_bytes = 0 if pool is None else bytes_per_device(pool)
  other += pool_bytes
  budget = int(config.gpu_memory_utilization * hbm) - weights - other - temp
  fit_blocks = max(budget, 0) // per_block
  per_req = engine.num_blocks_per_req
  wanted = int(1 + config.max_num_reqs * per_req * (1 + PREFIX_CACHE_SHARE))
  needed = 1 + per_req
  num_blocks = max(min(wanted, fit_blocks), needed)
  fixed_pool = None
  if config.num_kv_blocks is not None:  # the user's size, as the engine takes it
    num_blocks = fit_blocks = config.num_kv_blocks
    fixed_pool = f"num_kv_blocks={config.num_kv_blocks}"
  elif config.kv_cache_memory_bytes is not None:
    num_blocks = fit_blocks = (config.kv_cache_memory_bytes - pool_bytes) // per_block
    fixed_pool = f"kv_cache_memory_bytes={config.kv_cache_memory_bytes}"
  max_model_len = config.resolved_max_model_len
  token_ids = getattr(engine.batch.state, "token_ids", None)  # [R, max_model_len]
  per_token = 0
  if token_ids is not None:
    shardings = placement.state.token_ids if placement else None
    per_token = bytes_per_device(engine.sharded(token_ids, shardings)) // max_model_len
  limit = getattr(getattr(engine.model, "config", None), "max_position_embeddings", None)
  return MemoryPlan(
    weights=weights,
    other=other,
    temp=temp,
    per_block=per_block,
    num_blocks=num_blocks,
    fit_blocks=fit_blocks,
    needed_blocks=needed,
    block_size=config.block_size,
    group_windows=cache_groups(engine.model.kv_cache_spec, config).group_windows,
    max_num_batched_tokens=config.max_num_batched_tokens,
    max_model_len=max_model_len,
    max_position_embeddings=limit if isinstance(limit, int) else max_model_len,
    state_bytes_per_token=per_token,
    hbm=hbm,
    utilization=config.gpu_memory_utilization,
    fixed_pool=fixed_pool,
  )
