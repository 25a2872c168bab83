"""The key/value cache: one fixed-size buffer of slots that requests are pointed into.

The cache is addressed by ``(layer, slot, position)``. A slot is a row of the cache owned by one
request for its lifetime; the batch state stores each request's slot index, so reordering or
condensing batch rows moves a few integers and never the cached keys and values themselves.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

if TYPE_CHECKING:
  from jaxengine.models.llama import LlamaConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class KVCache:
  """Per-layer keys and values for every slot and position.

  Rotary embeddings are already applied to the cached keys. A position of a slot holds meaningful
  data only once the request owning that slot has written it; the model never reads a position
  beyond the query's own, so stale data from a previous owner of the slot is harmless.

  Attributes:
    key: ``[num_layers, num_slots, max_model_len, num_kv_heads, head_dim]`` keys after rotary
      embedding, in the cache dtype.
    value: ``[num_layers, num_slots, max_model_len, num_kv_heads, head_dim]`` values, same dtype.
  """

  key: jax.Array
  value: jax.Array

  @classmethod
  def create(
    cls,
    config: LlamaConfig,
    num_slots: int,
    max_model_len: int,
    dtype: jnp.dtype = jnp.float32,
  ) -> KVCache:
    """Allocates a zero-filled cache.

    Args:
      config: model hyper-parameters; uses ``num_hidden_layers``, ``num_key_value_heads`` and
        ``head_dim``.
      num_slots: number of requests the cache can hold at once (usually ``max_num_reqs``, plus one
        if the caller wants a scratch slot for inactive rows).
      max_model_len: positions per slot (prompt plus generated tokens).
      dtype: storage dtype, normally the model's compute dtype.

    Returns:
      A ``KVCache`` whose two leaves are separate buffers (so both can be donated).
    """
    shape = (
      config.num_hidden_layers,
      num_slots,
      max_model_len,
      config.num_key_value_heads,
      config.head_dim,
    )
    # Two separate allocations: aliased leaves would break buffer donation.
    return cls(key=jnp.zeros(shape, dtype), value=jnp.zeros(shape, dtype))

  @property
  def num_layers(self) -> int:
    """Decoder layers."""
    return self.key.shape[0]

  @property
  def num_slots(self) -> int:
    """Requests the cache can hold at once."""
    return self.key.shape[1]

  @property
  def max_model_len(self) -> int:
    """Positions per slot."""
    return self.key.shape[2]

  @property
  def dtype(self) -> jnp.dtype:
    """Storage dtype."""
    return self.key.dtype
