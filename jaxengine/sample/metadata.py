"""`SamplingMetadata`: what the sampler needs beyond `BatchState`, rebuilt only on composition change.

`refresh_metadata` is one jitted function of the batch state and the live-row mask. `InputBatch`
calls it after a step's adds, removes, condense or swaps, and on a step without such a change hands
the sampler the very same object (vLLM PR #13244's rule). The sampler never mutates it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxengine.params import SAMPLING_EPS
from jaxengine.sample.row_params import RowParams, effective_row_params
from jaxengine.sample.state import BatchState


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingMetadata(RowParams[jax.Array]):
  """Effective per-row sampling values and the batch-wide "is any row using X" flags.

  Per-row values are already resolved for the sampler: each `RowParams` field (`temperature`,
  `top_k`, ..., `min_tokens`) holds the row's value where the row uses it and the parameter's
  "off" value elsewhere (greedy and free rows get temperature 1, so the division is a no-op, and
  neutral filters; free rows neutral penalties; see `RowParam.used_by`), so the sampler needs no
  per-row branching. The flags are traced `[] bool` arrays that drive `lax.cond`, so one compiled
  step serves every mix of requests.

  Attributes:
    is_live: `[R] bool` rows that hold a request.
    is_greedy: `[R] bool` live rows sampling greedily.
    candidate_level: `[R] int32` which candidate list a row's top-k is read from: `l >= 1` for
      the deep budget `config.candidate_budgets[l]` (the smallest holding its top_k), 0 for the
      shallow list, no top-k, or a top_k beyond every budget (found by bisection).
    max_candidate_level: `[] int32` the largest `candidate_level`: the deep list a step builds.
    any_greedy, any_random, any_top_k, any_top_p, any_min_p, any_penalties, any_logit_bias,
    any_allowed_token_ids, any_bad_words, any_min_tokens, any_logprobs: `[] bool` whether some
    live row uses the feature.
    any_top_k_beyond_candidates: `[] bool` whether some live row's top_k exceeds every budget.
    any_logits_processor: `[P] bool` whether some live row uses processor `p`.
    any_grammar: `[] bool` whether some live row has structured outputs.
  """

  is_live: jax.Array
  is_greedy: jax.Array
  candidate_level: jax.Array
  max_candidate_level: jax.Array
  any_greedy: jax.Array
  any_random: jax.Array
  any_top_k: jax.Array
  any_top_k_beyond_candidates: jax.Array
  any_top_p: jax.Array
  any_min_p: jax.Array
  any_penalties: jax.Array
  any_logit_bias: jax.Array
  any_allowed_token_ids: jax.Array
  any_bad_words: jax.Array
  any_min_tokens: jax.Array
  any_logprobs: jax.Array
  any_logits_processor: jax.Array

  def leading_rows(self, num_rows: int) -> SamplingMetadata:
    """Metadata of the first `num_rows` rows (see `BatchState.leading_rows`); the batch-wide
    flags (`any_*`, including the per-processor `[P]` ones) are kept whole."""
    rows = jax.tree.map(lambda a: a[:num_rows] if a.ndim else a, self)
    return dataclasses.replace(rows, any_logits_processor=self.any_logits_processor)

  any_grammar: jax.Array


def inverse_temperature(md: SamplingMetadata) -> jax.Array:
  """`[R] float32` 1 / temperature (1 for greedy and free rows).

  Every place computes the scaled logits `y = x * (1 / T)` in this one form so that `y` rounds
  identically wherever it is recomputed (XLA would rewrite `x / T` so anyway).
  """
  return 1.0 / md.temperature


def candidate_level(top_k: jax.Array, budgets: tuple[int, ...], vocab_size: int) -> jax.Array:
  """`[R] int32` each row's candidate level (see `SamplingMetadata.candidate_level`).

  Args:
    top_k: `[R] int32` effective top_k (`V` when disabled).
    budgets: static `BatchConfig.candidate_budgets`.
    vocab_size: static `V`.
  """
  deep = (top_k < vocab_size) & (top_k > budgets[0]) & (top_k <= budgets[-1])
  level = sum((top_k > budget).astype(jnp.int32) for budget in budgets[:-1])
  return jnp.where(deep, level, 0).astype(jnp.int32)


@jax.jit
def refresh_metadata(state: BatchState, is_live: jax.Array) -> SamplingMetadata:
  """Derives `SamplingMetadata` from the batch state.

  Args:
    state: the batch state.
    is_live: `[R] bool` rows that hold a request (holes and free rows are False).

  Returns:
    New metadata whose arrays own their buffers (no leaf aliases the state).
  """
  V = state.vocab_size
  is_greedy = is_live & (state.temperature < SAMPLING_EPS)
  is_random = is_live & ~is_greedy
  # top_k is stored in [1, V] (V when off), so `top_k < V` is "filters by top-k".
  effective = effective_row_params(state, state.config, is_live, is_random)
  top_k, top_p, min_p = effective["top_k"], effective["top_p"], effective["min_p"]
  presence = effective["presence_penalty"]
  frequency = effective["frequency_penalty"]
  repetition = effective["repetition_penalty"]
  has_bias = (state.logit_bias_token_ids < V).any(axis=1)
  has_bad_words = (state.bad_words_last < V).any(axis=1)
  has_min_tokens = (effective["min_tokens"] > 0) & (state.stop_token_ids < V).any(axis=1)
  budgets = state.config.candidate_budgets
  level = candidate_level(top_k, budgets, V)
  return SamplingMetadata(
    **effective,
    is_live=is_live,
    is_greedy=is_greedy,
    candidate_level=level,
    max_candidate_level=level.max(),
    any_greedy=is_greedy.any(),
    any_random=is_random.any(),
    any_top_k=(top_k < V).any(),
    any_top_k_beyond_candidates=((top_k < V) & (top_k > budgets[-1])).any(),
    any_top_p=(top_p < 1.0).any(),
    any_min_p=(min_p > 0.0).any(),
    any_penalties=((presence != 0) | (frequency != 0) | (repetition != 1)).any(),
    any_logit_bias=(is_live & has_bias).any(),
    any_allowed_token_ids=(is_live & state.has_allowed_token_ids).any(),
    any_bad_words=(is_live & has_bad_words).any(),
    any_min_tokens=has_min_tokens.any(),
    any_logprobs=(effective["num_logprobs"] >= 0).any(),
    any_logits_processor=(is_live[:, None] & state.logits_processor_active).any(axis=0),
    any_grammar=(is_live & state.has_grammar).any(),
  )
