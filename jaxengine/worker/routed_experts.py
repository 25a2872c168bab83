"""Routed experts (``enable_return_routed_experts``): the experts a mixture-of-experts model's
router chose for every token, kept per KV-cache slot and read back when a completion finishes.

RL trainers replay the rollout's routing (R3: the policy gradient sees the experts that produced
the tokens); `CompletionOutput.routed_experts` gives them, `[num_prompt_tokens + len(token_ids) -
1, M, k] int32` (``M`` MoE layers, ``k`` ``num_experts_per_tok``), and
`jaxengine.models.token_logprobs` replays them.

Every step's model call (`worker/ragged_step.py`, the verify step, the k-step decode loop) returns
the ``[T, M, k]`` experts of its tokens with the cache slots their keys and values went to
(`RoutedExperts`), moved to the host with the step's tokens. `RoutedExpertsStore` writes them to a
host array with one entry per slot of the pool of pages, exactly where the cache holds the
tokens' keys and values: the store is a mirror of the cache, so a position's experts are where its
keys and values are. That makes every way a position reaches the cache right at once:

- a prefix-cache hit: the cached pages' positions were not computed again, and their experts are
  still in the store, beside the keys and values the request reuses (computed with the same
  weights: loading weights empties the prefix cache);
- chunked prefill, the k-step decode loop, n > 1 samples sharing the prompt's pages;
- speculative decoding: a rejected draft's slot is written over when the token that replaced it
  is computed, and a completion's positions past its last accepted token are never read;
- preemption: the recomputed positions write the same experts (the same weights and tokens) to
  the new pages.

A completion's experts are read when it finishes (`EngineCore._finish`: stopped, or aborted, by
`abort_request` or a pause with mode "abort"), through its block table: positions ``0 .. n - 1``,
``n`` its `num_readable_positions` (``num_tokens - 1`` when it stops: its last token has not been
fed through the model; when it is aborted, the positions computed and stored so far). A
completion aborted while waiting to be recomputed after a preemption reports the positions
recomputed so far, an empty ``[0, M, k]`` array when none (as one aborted before any of its
prompt was computed or found in the prefix cache); one aborted before it was admitted (no row)
reports None.

Memory: ``num_blocks * block_size * M * k * 4`` bytes of host memory (Qwen3-30B-A3B, 48 layers of
8 experts: 1.5 KiB per cached token, against its 96 KiB of bfloat16 keys and values), nothing on
the device beyond a step's ``[T, M, k]``. Models whose sliding windows free pages (a position's
page may be gone before the request finishes) are refused.

With the flag off nothing here runs, and every executable is the one compiled without it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, TypeVar, cast

import jax
import numpy as np
from flax import nnx

from jaxengine.engine_config import EngineConfig

M = TypeVar("M")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class RoutedExperts:
  """A step's routed experts on the device (shape legend: `N` computed positions, `M` MoE
  layers, `k` experts per token).

  Attributes:
    experts: `[..., M, k] int32` each computed position's experts at each MoE layer (`[T, M, k]`
      in a ragged step, `[steps, R, M, k]` in the k-step loop).
    slots: `[...] int32` the cache slot each position's keys and values went to (the step's
      `slot_mapping`; padding and stopped rows write `NULL_SLOT`, in the null page no request
      reads).
  """

  experts: jax.Array
  slots: jax.Array


def moe_shape(model: Any) -> tuple[int, int]:
  """`(M, k)`: the MoE layers and experts per token of a model (or its config) with routed
  experts.

  Raises:
    ValueError: naming ``enable_return_routed_experts``, for a model without mixture-of-experts
      layers or whose modules cannot return their routing.
  """
  config = getattr(model, "config", model)
  moe_layers = tuple(getattr(config, "moe_layers", ()) or ())
  k = getattr(config, "num_experts_per_tok", 0)
  if not moe_layers or not k:
    raise ValueError(
      f"enable_return_routed_experts=True needs a mixture-of-experts model (Qwen3-MoE, "
      f"Mixtral, Qwen3.5-MoE); the model ({type(model).__name__}) has no MoE layers"
    )
  return len(moe_layers), int(k)


def routed_experts_model(model: M) -> M:
  """A copy of `model` that returns its routing (``return_routed_experts=True`` on every
  module declaring it, `jaxengine.models.Llama`), sharing its weight arrays.

  Raises:
    ValueError: as `moe_shape`; a model without the ``return_routed_experts`` attribute.
  """
  moe_shape(model)
  if not hasattr(model, "return_routed_experts"):
    raise ValueError(
      f"enable_return_routed_experts=True needs a model with a return_routed_experts "
      f"attribute (jaxengine.models.Llama); {type(model).__name__} has none"
    )
  graphdef, state = nnx.split(cast(nnx.Module, model))
  copy = cast(nnx.Module, nnx.merge(graphdef, state))
  copy.set_attributes(return_routed_experts=True)
  return cast(M, copy)


def check_pages_kept(config: EngineConfig, frees_pages: bool) -> None:
  """Refuses (ValueError) ``enable_return_routed_experts`` with sliding windows that free pages
  (`KVCacheGroups.frees_pages`); call before the pool of pages is allocated."""
  if config.enable_return_routed_experts and frees_pages:
    raise ValueError(
      "enable_return_routed_experts=True is not supported with sliding-window layers that "
      "free pages (a position's experts are kept with its page)"
    )


def num_readable_positions(num_tokens: int, num_computed_tokens: int, num_unstored: int) -> int:
  """The positions ``0 .. n - 1`` of a finishing completion whose experts the store holds.

  Args:
    num_tokens: its prompt and output tokens; the last one has not been fed through the model.
    num_computed_tokens: its positions counted as computed (0 after a preemption, until they
      are recomputed).
    num_unstored: of those, the ones counted at the dispatch of a step not collected yet
      (their experts are not stored).

  Returns:
    ``min(num_tokens - 1, num_computed_tokens - num_unstored)``, at least 0.
  """
  return max(0, min(num_tokens - 1, num_computed_tokens - num_unstored))


class RoutedExpertsStore:
  """The host mirror of the pool of pages: each slot's experts (see the module).

  Args:
    num_slots: ``num_blocks * block_size``, the pool's slots (the null page's included).
    num_moe_layers: `M`.
    top_k: `k`.
    block_size: positions per page.
  """

  def __init__(self, num_slots: int, num_moe_layers: int, top_k: int, block_size: int) -> None:
    self.experts = np.zeros((num_slots, num_moe_layers, top_k), np.int32)
    self.block_size = block_size
    #: The last k-step loop's experts, held until the step dispatched before it is stored
    #: (`hold`, `write_held`).
    self.held: RoutedExperts | None = None

  @classmethod
  def create(
    cls, config: EngineConfig, model: Any, num_blocks: int, block_size: int
  ) -> RoutedExpertsStore | None:
    """The store of a pool of `num_blocks` pages of `block_size` slots for `model` (`moe_shape`)
    with ``enable_return_routed_experts``; None without it.

    Raises:
      ValueError: as `moe_shape`.
    """
    if not config.enable_return_routed_experts:
      return None
    num_moe_layers, top_k = moe_shape(model)
    return cls(num_blocks * block_size, num_moe_layers, top_k, block_size)

  def write(self, routed: RoutedExperts | None) -> None:
    """Stores a step's experts at its slots (waits for the step; padding writes the null
    page); None (a step of a model that returns no routing) stores nothing."""
    if routed is None:
      return
    experts, slots = jax.device_get((routed.experts, routed.slots))
    experts = np.asarray(experts)
    self.experts[np.asarray(slots).reshape(-1)] = experts.reshape(-1, *experts.shape[-2:])

  def hold(self, routed: RoutedExperts | None) -> None:
    """Keeps a k-step loop's experts until `write_held`: the store takes steps in dispatch
    order, and the step in flight when the loop was dispatched is stored first."""
    self.held = routed

  def write_held(self) -> None:
    """Stores the experts `hold` kept, if any (`write`), and forgets them."""
    routed, self.held = self.held, None
    self.write(routed)

  def read_finishing(
    self, block_ids: Sequence[int] | np.ndarray, num_tokens: int, num_computed: int,
    num_unstored: int,
  ) -> np.ndarray | None:  # fmt: skip
    """`read` of a finishing completion's `num_readable_positions` (its arguments)."""
    return self.read(block_ids, num_readable_positions(num_tokens, num_computed, num_unstored))

  def read(self, block_ids: Sequence[int] | np.ndarray, num_positions: int) -> np.ndarray | None:
    """``[num_positions, M, k] int32`` the experts of positions ``0 ..`` of a sequence whose
    pages are `block_ids`; None when the pages do not hold them all."""
    block_ids = np.asarray(block_ids, np.int64)
    positions = np.arange(num_positions)
    pages = positions // self.block_size
    if num_positions and (pages[-1] >= len(block_ids) or (block_ids[: pages[-1] + 1] <= 0).any()):
      return None
    return self.experts[block_ids[pages] * self.block_size + positions % self.block_size].copy()
