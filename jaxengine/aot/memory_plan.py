"""The memory of one chip: weights, KV-cache pages, the largest temporary, against its HBM.

The pool is sized by the engine's own rule (`worker/kv_cache_size.py`'s
`default_num_kv_blocks`): `gpu_memory_utilization` of the chip less what is held, at most room
for `max_num_reqs` requests of `max_model_len` tokens and a quarter more, at least one such
request. A topology's devices report no memory statistics, so the capacity is the chip's HBM
(`aot/topologies.py`) and what is held is counted from the shapes: the weights' shards, the
batch's state, the LoRA slots, and the largest temporary buffer of any compiled executable
(XLA's `memory_analysis().temp_size_in_bytes`), which the engine needs on top while a step runs.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

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
    other: the batch's state and sampling metadata.
    temp: the largest temporary of the compiled executables.
    per_block: one page of all layers (this device's share).
    num_blocks: the pages the engine allocates (the null page included).
    fit_blocks: the pages the budget holds (uncapped).
    needed_blocks: the fewest the engine accepts: one request of `max_model_len` and the null page.
    block_size, num_groups: positions per page; KV cache groups (a token holds a page slot in
      each).
    hbm: the chip's capacity.
    utilization: `gpu_memory_utilization`.

  With `num_kv_blocks` or `kv_cache_memory_bytes` the pool is the user's size (`fit_blocks`
  too), and fits when everything held fits the chip.
  """

  weights: int
  other: int
  temp: int
  per_block: int
  num_blocks: int
  fit_blocks: int
  needed_blocks: int
  block_size: int
  num_groups: int
  hbm: int
  utilization: float

  @property
  def fits(self) -> bool:
    """One request of `max_model_len` fits, and everything held fits the chip's HBM."""
    return self.fit_blocks >= self.needed_blocks and self.total <= self.hbm

  @property
  def kv_cache(self) -> int:
    return self.num_blocks * self.per_block

  @property
  def total(self) -> int:
    return self.weights + self.other + self.temp + self.kv_cache

  @property
  def bytes_per_token(self) -> int:
    """KV bytes of one token over all layers on this device."""
    return self.per_block * self.num_groups // self.block_size

  @property
  def max_tokens(self) -> int:
    """Tokens the budget's pages hold (the null page left out)."""
    return max(self.fit_blocks - 1, 0) * self.block_size // self.num_groups

  @property
  def needed(self) -> int:
    """Bytes per device the engine needs at least (one request of `max_model_len`)."""
    return self.weights + self.other + self.temp + self.needed_blocks * self.per_block


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
  budget = int(config.gpu_memory_utilization * hbm) - weights - other - temp
  fit_blocks = max(budget, 0) // per_block
  per_req = engine.num_blocks_per_req
  wanted = int(1 + config.max_num_reqs * per_req * (1 + PREFIX_CACHE_SHARE))
  needed = 1 + per_req
  # `layer_groups` holds each layer's (group, index in the group): the groups are its first fields.
  groups = 1 if engine.layer_groups is None else len({g for g, _ in engine.layer_groups})
  num_blocks = max(min(wanted, fit_blocks), needed)
  if config.num_kv_blocks is not None:  # the user's size, as the engine takes it
    num_blocks = fit_blocks = config.num_kv_blocks
  elif config.kv_cache_memory_bytes is not None:
    num_blocks = fit_blocks = config.kv_cache_memory_bytes // per_block
  return MemoryPlan(
    weights=weights,
    other=other,
    temp=temp,
    per_block=per_block,
    num_blocks=num_blocks,
    fit_blocks=fit_blocks,
    needed_blocks=needed,
    block_size=config.block_size,
    num_groups=groups,
    hbm=hbm,
    utilization=config.gpu_memory_utilization,
  )
