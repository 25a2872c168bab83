"""The runner's pool of recurrent state slots for a hybrid model, and what such a model refuses.

A hybrid model (`jaxengine.models.qwen3_5.Qwen3_5`: Gated DeltaNet layers beside attention)
declares a ``recurrent_state_spec`` (`jaxengine.models.gated_deltanet.RecurrentStateSpec`). The
runner then keeps `max_num_reqs` slots of that state and the null slot 0 in the KV cache's
``recurrent`` field, donated and updated in place with the pages; the scheduler hands one slot to
each running completion (`jaxengine.core.state_slots`). The pool's bytes come out of the KV
cache's budget (`kv_cache_memory_bytes`; on an accelerator the default budget, measured after
the pool is allocated, leaves them out too).

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
from typing import Any

from jaxengine.core.kv_cache_groups import KVCacheGroups
from jaxengine.engine_config import EngineConfig
from jaxengine.models.gated_deltanet import RecurrentState, RecurrentStateSpec
from jaxengine.models.kv_pages import PagedKVCache
from jaxengine.worker.kv_cache_pool import create_kv_cache
from jaxengine.worker.placement import MeshPlacement

__all__ = [
  "check_hybrid_config",
  "num_snapshots",
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
  a ``speculative_config`` (rejected drafts would have advanced the state),
  ``num_decode_steps`` > 1 (the device loop's metadata has no state slots), ``scan_layers=True``,
  ``enable_lora``, ``quantization``, ``batch_invariant``, and a mesh (``tensor_parallel_size``
  > 1 or a `mesh`: the pool and the linear layers' weights are not split). Nothing happens for
  a model without recurrent state.
  """
  if recurrent_state_spec(model) is None:
    return
  name = type(model).__name__
  refused = [
    ("speculative_config", config.speculative_config, config.speculative_config is not None),
    ("num_decode_steps", config.num_decode_steps, config.num_decode_steps > 1),
    ("scan_layers", config.scan_layers, config.scan_layers is True),
    ("enable_lora", config.enable_lora, config.enable_lora),
    ("quantization", config.quantization, config.quantization is not None),
    ("batch_invariant", config.batch_invariant, config.batch_invariant),
    ("tensor_parallel_size", config.tensor_parallel_size, config.tensor_parallel_size > 1),
    ("mesh", config.mesh, config.mesh is not None),
  ]
  for field, value, is_refused in refused:
    if is_refused:
      raise ValueError(
        f"{field}={value!r} is not supported with the hybrid model {name} (Gated DeltaNet "
        "layers keep a recurrent state per running request, which this feature does not carry "
        "yet)"
      )


def num_snapshots(config: EngineConfig) -> int:
  """Snapshot slots of a hybrid model's pool: ``max_num_reqs`` with ``enable_prefix_caching=True``
  (module docstring), else 0."""
  return config.max_num_reqs if config.enable_prefix_caching is True else 0


def state_pool(spec: RecurrentStateSpec, config: EngineConfig) -> RecurrentState:
  """A zero pool: the null slot 0 of padding tokens, ``max_num_reqs`` slots of running requests,
  then `num_snapshots` snapshot slots."""
  return spec.create(1 + config.max_num_reqs + num_snapshots(config))


def without_pool_bytes(config: EngineConfig, pool: RecurrentState) -> EngineConfig:
  """`config` with the pool's bytes taken out of ``kv_cache_memory_bytes`` (when given).

  Raises:
    ValueError: ``kv_cache_memory_bytes`` no larger than the pool, naming both.
  """
  if config.kv_cache_memory_bytes is None:
    return config
  pool_bytes = sum(a.nbytes for a in (*pool.conv, *pool.delta))
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
  pool = None if state_spec is None else state_pool(state_spec, config)
  pool_config = config if pool is None else without_pool_bytes(config, pool)
  kv_cache, num_blocks = create_kv_cache(
    model.kv_cache_spec, pool_config, groups, placement, max_model_len
  )
  if pool is None:
    return RunnerCache(kv_cache, num_blocks, 0)
  kv_cache = dataclasses.replace(kv_cache, recurrent=pool)
  return RunnerCache(kv_cache, num_blocks, config.max_num_reqs, num_snapshots(config))
