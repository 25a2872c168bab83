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

With a ``speculative_config`` each running request holds ``k + 1`` slots (``k`` the
``num_speculative_tokens``, `num_draft_states`): a verify step writes the row's state after each
of its tokens into one of them, and the one after the accepted drafts becomes the request's
current slot (`jaxengine.core.state_slots`), so a rejected draft never advances the state the
next step reads. The pool's running slots grow ``k + 1``-fold, out of the pages' budget as above.

The pool is part of the KV cache for the engine's other features too: a "keep" pause keeps
each request's slot as it keeps its pages, and `load_weights` while paused leaves both as the old
weights wrote them (later tokens are fed through the new weights; a request preempted afterwards
recomputes its pages and its state through them); `sleep` frees the pool's buffers with the
pages and `wake_up` puts back a zero pool of the same shapes and shardings (a slot's state is
written from position 0 on, so a zero pool needs no reset); fp8 pages
(``kv_cache_dtype="fp8"``) leave the pool in the model's dtype.

Every engine feature carries the state; a mesh whose model axis does not divide the linear
layers' key heads is refused when the engine is built (`check_hybrid_config`).
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
  "num_draft_states",
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
  """Refuses a hybrid model without attention layers, and a mesh its recurrent state cannot be
  split over.

  Refused (a `ValueError` naming the field and the model's class): ``layer_types`` without a
  full-attention layer (the engine needs pages); a model axis that does not divide the linear
  layers' ``linear_num_key_heads`` (their heads, the pool's too, are split by
  key head: `pool_shardings`). Nothing happens for a model without recurrent state. Every other
  engine feature carries the state: every ``speculative_config`` method (``"ngram"``,
  ``"suffix"``: both draft without a model; the state after the accepted drafts is kept, module
  docstring) and ``scan_layers`` (a scanned hybrid's pool is stacked per linear layer,
  `jaxengine.models.qwen3_5_scan`).
  """
  if recurrent_state_spec(model) is None:
    return
  name = type(model).__name__
  if not model.config.attention_layers:
    raise ValueError(
      f"layer_types={list(model.config.layer_types)!r}: the hybrid model {name} needs at least "
      "one full-attention layer (the engine keeps its tokens' keys and values in pages)"
    )
  t = config.tensor_parallel_size if config.mesh is None else axis_size(config.mesh, MODEL)
  key_heads = model.config.linear_num_key_heads
  if key_heads % t:
    raise ValueError(
      f"tensor_parallel_size={t} must divide the linear layers' linear_num_key_heads="
      f"{key_heads} of the hybrid model {name} (its Gated DeltaNet heads are split by key head)"
    )


def num_draft_states(config: EngineConfig) -> int:
  """Slots each running request of a hybrid model holds beside its own for its states after a
  verify step's drafts: ``num_speculative_tokens`` with a ``speculative_config`` (module
  docstring), else 0."""
  return config.num_speculative_tokens


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
  """A zero pool: the null slot 0 of padding tokens, ``1 + num_draft_states`` slots per running
  request (``max_num_reqs``), then `num_snapshots` snapshot slots; on a mesh allocated in its
  shards (`pool_shardings`)."""
  running = config.max_num_reqs * (1 + num_draft_states(config))
  create = functools.partial(spec.create, 1 + running + num_snapshots(config))
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
    drafts, snapshots = num_draft_states(config), num_snapshots(config)
    parts = [f"{1 + drafts} a request (speculative decoding's draft states)"] if drafts else []
    parts += [f"{snapshots} prefix-cache snapshots"] if snapshots else []
    raise ValueError(
      f"kv_cache_memory_bytes={config.kv_cache_memory_bytes} does not hold the recurrent state "
      f"pool of max_num_reqs={config.max_num_reqs} requests ({pool.num_slots} slots with the "
      f"null slot{': ' + ', '.join(parts) if parts else ''}; {pool_bytes} bytes) and any page"
    )
  return dataclasses.replace(config, kv_cache_memory_bytes=left)


@dataclasses.dataclass(frozen=True)
class RunnerCache:
  """A runner's device cache: the pages, with a hybrid model's state pool in `recurrent`.

  Attributes:
    kv_cache: the `PagedKVCache` (`recurrent` set for a hybrid model).
    num_blocks: its pages, the null page 0 included.
    num_state_slots: recurrent-state slots the scheduler hands out (``1 + num_draft_states``
      per row), 0 without.
    num_snapshots: snapshot slots after them (`num_snapshots`), 0 without.
    num_draft_states: the slots of each row's group beside its own (`num_draft_states`).
  """

  kv_cache: PagedKVCache
  num_blocks: int
  num_state_slots: int
  num_snapshots: int = 0
  num_draft_states: int = 0


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
  drafts = num_draft_states(config)
  num_slots = config.max_num_reqs * (1 + drafts)
  return RunnerCache(kv_cache, num_blocks, num_slots, num_snapshots(config), drafts)
