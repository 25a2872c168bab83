"""The runner's pool of recurrent state slots for a hybrid model, and what such a model refuses.

A hybrid model (`jaxengine.models.qwen3_5.Qwen3_5`: Gated DeltaNet layers beside attention)
declares a ``recurrent_state_spec`` (`jaxengine.models.gated_deltanet.RecurrentStateSpec`). The
runner then keeps `max_num_reqs` slots of that state and the null slot 0 in the KV cache's
``recurrent`` field, donated and updated in place with the pages; the scheduler hands one slot to
each running completion (`jaxengine.core.state_slots`). The pool's bytes come out of the KV
cache's budget (`kv_cache_memory_bytes`; on an accelerator the default budget, measured after
the pool is allocated, leaves them out too). On a tensor-parallel mesh the pool is split by heads
as the Gated DeltaNet layers' weights are (`pool_shardings`), so each device updates the state of
its own heads.

With ``enable_prefix_caching=True`` the pool also holds ``max_num_reqs`` snapshot slots after
the running requests' (`num_snapshots`), where states are saved at block boundaries so that a
prefix-cache hit can start from one (`jaxengine.core.state_snapshots`); left at None, prefix
caching stays off for a hybrid model (the snapshots double the pool's bytes).

The state is otherwise kept only for a running request's own sequence, so the engine features that
would need it elsewhere are refused when the engine is built (`check_hybrid_config`), each with a
`ValueError` naming the feature and the model.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxengine.core.kv_cache_groups import KVCacheGroups
from jaxengine.engine_config import EngineConfig
from jaxengine.models.gated_deltanet import RecurrentState, RecurrentStateSpec
from jaxengine.models.kv_pages import PagedKVCache
from jaxengine.parallel import MODEL, axis_size
from jaxengine.worker.kv_cache_pool import create_kv_cache
from jaxengine.worker.placement import MeshPlacement

__all__ = [
  "check_hybrid_config",
  "num_snapshots",
  "pool_shardings",
  "recurrent_state_spec",
  "state_pool",
  "without_pool_bytes",
]


def recurrent_state_spec(model: Any) -> RecurrentStateSpec | None:
  """The model's `RecurrentStateSpec`, or None for a model without recurrent state."""
  spec = getattr(model, "recurrent_state_spec", None)
  return spec if isinstance(spec, RecurrentStateSpec) else None


def check_hybrid_config(model: Any, config: EngineConfig) -> None:
  """Refuses the engine features a hybrid model's recurrent state does not carry yet.

  Refused (each a `ValueError` naming the feature, its value and the model's class):
  a ``speculative_config`` (rejected drafts would have advanced the state); on a mesh, a model
  axis that does not divide the linear layers' ``linear_num_key_heads`` (their heads, the
  pool's too, are split by key head: `pool_shardings`). Nothing happens for a model without
  recurrent state. ``scan_layers`` is carried: a scanned hybrid's pool is stacked per linear
  layer (`jaxengine.models.qwen3_5_scan`).
  """
  if recurrent_state_spec(model) is None:
    return
  name = type(model).__name__
  refused = [
    ("speculative_config", config.speculative_config, config.speculative_config is not None),
  ]
  for field, value, is_refused in refused:
    if is_refused:
      raise ValueError(
        f"{field}={value!r} is not supported with the hybrid model {name} (Gated DeltaNet "
        "layers keep a recurrent state per running request, which this feature does not carry "
        "yet)"
      )
  t = config.tensor_parallel_size if config.mesh is None else axis_size(config.mesh, MODEL)
  key_heads = model.config.linear_num_key_heads
  if key_heads % t:
    raise ValueError(
      f"tensor_parallel_size={t} must divide the linear layers' linear_num_key_heads="
      f"{key_heads} of the hybrid model {name} (its Gated DeltaNet heads are split by key head)"
    )


def num_snapshots(config: EngineConfig) -> int:
  """Snapshot slots of a hybrid model's pool: ``max_num_reqs`` with ``enable_prefix_caching=True``
  (module docstring), else 0."""
  return config.max_num_reqs if config.enable_prefix_caching is True else 0


def pool_shardings(pool: RecurrentState, mesh: Mesh) -> RecurrentState:
  """The pool's `NamedSharding`s on `mesh`, split by heads as the layers' weights are: each
  convolution window ``[S, K - 1, C]`` on its channels (grouped by key head,
  `jaxengine.models.gated_deltanet`), each delta-rule state ``[S, Hv, Dk, Dv]`` on its value
  heads; the slots (and a stacked pool's layers) whole on every device (`check_hybrid_config`
  has checked the model axis divides the heads)."""
  lead = (None,) if pool.is_stacked else ()  # a stacked pool's [Ll, ...] layer axis
  conv = NamedSharding(mesh, P(*lead, None, None, MODEL))
  delta = NamedSharding(mesh, P(*lead, None, MODEL))
  shardings: Any = ((conv,) * len(pool.conv), (delta,) * len(pool.delta))  # the pool's tree
  return RecurrentState(conv=shardings[0], delta=shardings[1])


def state_pool(
  spec: RecurrentStateSpec, config: EngineConfig, placement: MeshPlacement | None = None
) -> RecurrentState:
  """A zero pool: the null slot 0 of padding tokens, ``max_num_reqs`` slots of running requests,
  then `num_snapshots` snapshot slots; on a mesh allocated in its shards (`pool_shardings`)."""
  create = functools.partial(spec.create, 1 + config.max_num_reqs + num_snapshots(config))
  if placement is None:
    return create()
  shardings = pool_shardings(jax.eval_shape(create), placement.mesh)
  return jax.jit(create, out_shardings=shardings)()


def without_pool_bytes(config: EngineConfig, pool: RecurrentState) -> EngineConfig:
  """`config` with the pool's bytes on one device (its shard on a mesh, where
  ``kv_cache_memory_bytes`` is per device) taken out of ``kv_cache_memory_bytes`` (when given).

  Raises:
    ValueError: ``kv_cache_memory_bytes`` no larger than the pool, naming both.
  """
  if config.kv_cache_memory_bytes is None:
    return config
  pool_bytes = sum(a.addressable_shards[0].data.nbytes for a in (*pool.conv, *pool.delta))
  left = config.kv_cache_memory_bytes - pool_bytes
  if left <= 0:
    raise ValueError(
      f"kv_cache_memory_bytes={config.kv_cache_memory_bytes} does not hold the recurrent state "
      f"of max_num_reqs={config.max_num_reqs} requests ({pool_bytes} bytes) and any page"
    )
  return dataclasses.replace(config, kv_cache_memory_bytes=left)


@dataclasses.dataclass(frozen=True)
class RunnerCache:
  """A runner's device cache: the pages, with a hybrid model's state pool in `recurrent`.

  Attributes:
    kv_cache: the `PagedKVCache` (`recurrent` set for a hybrid model).
    num_blocks: its pages, the null page 0 included.
    num_state_slots: recurrent-state slots the scheduler hands out (one per row), 0 without.
    num_snapshots: snapshot slots after them (`num_snapshots`), 0 without.
  """

  kv_cache: PagedKVCache
  num_blocks: int
  num_state_slots: int
  num_snapshots: int = 0


def create_runner_cache(
  model: Any,
  config: EngineConfig,
  groups: KVCacheGroups,
  placement: MeshPlacement | None,
  max_model_len: int,
) -> RunnerCache:
  """The pages (`worker/kv_cache_pool.py`'s `create_kv_cache`) and, for a hybrid model, its
  state pool, allocated first so that the pages' budget leaves it out (`without_pool_bytes`);
  the pool travels (and is donated) with the pages.

  Raises:
    ValueError: as `create_kv_cache` and `without_pool_bytes`.
  """
  state_spec = recurrent_state_spec(model)
  pool = None if state_spec is None else state_pool(state_spec, config, placement)
  pool_config = config if pool is None else without_pool_bytes(config, pool)
  kv_cache, num_blocks = create_kv_cache(
    model.kv_cache_spec, pool_config, groups, placement, max_model_len
  )
  if pool is None:
    return RunnerCache(kv_cache, num_blocks, 0)
  if placement is not None:  # the steps declare the pool's shardings with the pages'
    shardings = pool_shardings(pool, placement.mesh)
    placement.kv_pages = dataclasses.replace(placement.kv_pages, recurrent=shardings)
  kv_cache = dataclasses.replace(kv_cache, recurrent=pool)
  return RunnerCache(kv_cache, num_blocks, config.max_num_reqs, num_snapshots(config))
