"""Stage 13 of the sampler: logprobs of the sampled token and of each row's top tokens.

vLLM's four logprobs modes: raw_* report the model's logits after the structured-output grammar
bitmask only (a token the row's grammar forbids is `-inf`; raw_logprobs normalised by a
log-softmax), processed_* the values the token was drawn from (after every processor, temperature
and filter; filtered tokens `-inf`). Ranks and the top entries are found on the scores directly
and only the gathered values are normalised, so the `[R, V]` log-softmax is never written out.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxengine.reductions import fixed_logsumexp
from jaxengine.sample import sharded
from jaxengine.sample.blocked import blocked_top_k
from jaxengine.sample.custom import apply_grammar_bitmask
from jaxengine.sample.metadata import SamplingMetadata, inverse_temperature
from jaxengine.sample.state import BatchState

NEG_INF = float("-inf")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class LogprobsTensors:
  """Log-probabilities of the sampled token and the top tokens of each row (device arrays).

  Attributes:
    token_ids: `[R, k + 1] int32`; column 0 is the sampled token, columns 1..k the top k
      tokens by value, best first.
    logprobs: `[R, k + 1] float32` the values of those tokens in the batch's logprobs mode
      (raw log-softmax of the model's logits by default).
    ranks: `[R] int32` the sampled token's rank: how many tokens have a value `>=` its own
      (1 is best; ties count against it), as in vLLM.
  """

  token_ids: jax.Array
  logprobs: jax.Array
  ranks: jax.Array

  @classmethod
  def zeros(cls, rows: int, num_logprobs: int) -> LogprobsTensors:
    """All-zero tensors (what a step in which no row asked for logprobs returns)."""
    return cls(
      token_ids=jnp.zeros((rows, num_logprobs + 1), jnp.int32),
      logprobs=jnp.zeros((rows, num_logprobs + 1), jnp.float32),
      ranks=jnp.zeros((rows,), jnp.int32),
    )


def logprobs_scores(
  logits, x, state: BatchState, md: SamplingMetadata, threshold, mode: str
) -> jax.Array:
  """`[R, V] float32` the values logprobs report, before normalisation.

  Args:
    logits: `[R, V]` the model's logits (the raw_* source).
    x: `[R, V] float32` processed logits.
    state: the batch state (`has_grammar`, `grammar_bitmask`).
    md: the metadata (live rows, temperatures).
    threshold: `[R] float32` each row's kept threshold on `y = x / T`.
    mode: static logprobs mode. processed_*: the values the token was drawn from
      (temperature-scaled, filtered tokens `-inf`); for greedy rows the post-penalty logits.
      raw_*: the logits with the grammar bitmask of live grammar rows applied (forbidden tokens
      `-inf`) and nothing else, as vLLM V1 masks the logits before its sampler reads them.
  """
  if mode.startswith("raw"):
    # One elementwise select, fused into the passes that read the scores; rows without a
    # grammar keep the model's logits bit for bit.
    return apply_grammar_bitmask(logits.astype(jnp.float32), state, md.is_live)
  y = x * inverse_temperature(md)[:, None]
  return jnp.where(y >= threshold[:, None], y, NEG_INF)


def gather_logprobs(
  scores: jax.Array,
  token_ids: jax.Array,
  num_logprobs: int,
  *,
  normalize: bool = True,
  fixed_order: bool = False,
) -> LogprobsTensors:
  """The given token's value and rank plus the top `num_logprobs` values of each row.

  Args:
    scores: `[R, V] float32` logits (or any scores).
    token_ids: `[R] int32` the sampled (or, for prompt logprobs, the actual next) tokens.
    num_logprobs: static number of top entries. `V` means a full sort of each row.
    normalize: report log-probabilities `scores - logsumexp(scores)` (True) or the scores.
    fixed_order: normalise with `jaxengine.reductions.fixed_logsumexp` (batch-invariant mode:
      a row's value does not depend on the number of rows; single device only).

  Returns:
    `LogprobsTensors`: `token_ids` and `logprobs` `[R, num_logprobs + 1]` (column 0 the given
    token, then the top entries by value, best first) and `ranks` `[R] int32` (entries `>=` the
    given token's value; 1 is best, ties count against it).
  """
  token_score = sharded.take_along_vocab(scores, token_ids[:, None])  # [R, 1]
  ranks = (scores >= token_score).sum(-1).astype(jnp.int32)
  top_scores, top_ids = blocked_top_k(scores, num_logprobs)
  values = jnp.concatenate([token_score, top_scores], 1)
  if normalize:
    if fixed_order:
      values = values - fixed_logsumexp(scores, keepdims=True)
    else:
      values = values - jax.nn.logsumexp(scores, axis=-1, keepdims=True)
  return LogprobsTensors(
    token_ids=jnp.concatenate([token_ids[:, None], top_ids], 1).astype(jnp.int32),
    logprobs=values,
    ranks=ranks,
  )
