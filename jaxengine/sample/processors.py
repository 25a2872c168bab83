"""Stages 0-6 of the sampler: the grammar bitmask, float32 logits, then the logits processors
in vLLM HEAD's order.

allowed_token_ids -> bad words -> min_tokens -> logit_bias -> penalties (repetition, frequency,
presence), computed as one fused elementwise pass over `[R, V]` plus three small scatters (the
grammar bitmask fused into it). When a live row uses one of your non-argmax-invariant
`LogitsProcessor`s, the stages run one after another instead, with yours before the penalties.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxengine.sample import sharded
from jaxengine.sample.custom import (
  any_custom,
  apply_custom_processors,
  apply_grammar_bitmask,
  has_processors,
)
from jaxengine.sample.metadata import SamplingMetadata
from jaxengine.sample.state import BatchState

NEG_INF = float("-inf")


def nan_as_neg_inf(x: jax.Array) -> jax.Array:
  """`x` with every NaN replaced by `-inf` (the sampler's reading of a NaN logit)."""
  return jnp.where(jnp.isnan(x), NEG_INF, x)


def _penalize(x, counts, in_prompt, md: SamplingMetadata) -> jax.Array:
  """Repetition, then frequency, then presence penalties on `x` (any trailing shape per row).

  Repetition (CTRL, Keskar et al. 2019, as vLLM applies it): for tokens in the prompt or the
  output, `x / r` where `x > 0` else `x * r`. Frequency and presence (OpenAI's definition):
  `x - f * count - p * (count > 0)`, counting output tokens only. Neutral values (1, 0, 0) leave
  `x` bit-for-bit unchanged, and `-inf` stays `-inf`.

  Args:
    x: `[R, ...] float32` logits.
    counts: `[R, ...] int32` output occurrences of each of those tokens.
    in_prompt: `[R, ...] bool` whether each token is in the prompt.
    md: the metadata (effective penalty values).
  """
  in_output = counts > 0
  r = md.repetition_penalty[:, None]
  x = jnp.where(in_prompt | in_output, jnp.where(x > 0, x / r, x * r), x)
  return (
    x
    - md.frequency_penalty[:, None] * counts.astype(jnp.float32)
    - md.presence_penalty[:, None] * in_output.astype(jnp.float32)
  )


def is_allowed(state: BatchState, token_ids: jax.Array | None = None) -> jax.Array:
  """`[R, V] bool` (or `[R, n]` at `token_ids [R, n]`) where a row's allowed_token_ids permit the
  token; all True for rows without a list."""
  mask = state.allowed_token_mask
  if token_ids is not None:
    mask = jnp.take_along_axis(mask, jnp.minimum(token_ids, state.vocab_size - 1), 1)
  return mask | ~state.has_allowed_token_ids[:, None]


def _bad_word_bans(state: BatchState, md: SamplingMetadata) -> jax.Array:
  """`[R, max_num_bad_words] int32` tokens banned now (`V` where nothing is banned).

  A banned sequence bans its last token when its prefix equals the end of the row's output
  tokens. Only output tokens count (a prefix spanning the prompt/output boundary is not detected,
  as in vLLM); single-token sequences are always banned.
  """
  prefix = state.bad_words_prefix  # [R, max_num_bad_words, prefix_len], -1 = any token
  prefix_len = prefix.shape[-1]
  positions = state.num_tokens[:, None] + jnp.arange(-prefix_len, 0)  # [R, prefix_len]
  tail = jnp.take_along_axis(state.token_ids, jnp.clip(positions, 0, state.max_model_len - 1), 1)
  tail = jnp.where(positions >= state.num_prompt_tokens[:, None], tail, -1)  # -1: no output token
  matches = ((prefix < 0) | (prefix == tail[:, None, :])).all(-1)  # [R, max_num_bad_words]
  return jnp.where(matches & md.is_live[:, None], state.bad_words_last, state.vocab_size)


def _min_tokens_bans(state: BatchState, md: SamplingMetadata) -> jax.Array:
  """`[R, max_num_stop_token_ids] int32` the stop set of rows below min_tokens (`V` elsewhere)."""
  active = md.is_live & (state.num_output_tokens < state.min_tokens)
  return jnp.where(active[:, None], state.stop_token_ids, state.vocab_size)


def apply_logits_processors(logits, state: BatchState, md: SamplingMetadata) -> jax.Array:
  """Stages 0-6: the grammar bitmask (rows with structured outputs), then stages 2-6 with the
  custom non-argmax-invariant processors between logit_bias and the penalties.

  Each addition sits behind a traced flag: without a live grammar row the bitmask is not read,
  and without a live row using a custom processor the fused pass runs as before.
  A row with a grammar bans what its bitmask forbids; rows without one are unchanged.

  Args:
    logits: `[R, V]` model logits, any float dtype.
    state, md: the batch state and metadata.

  Returns:
    `[R, V] float32` processed logits, no NaN (a NaN logit reads as `-inf`).
  """
  # The bitmask costs one read of `[R, V / 32]` fused into the pass below; without a live
  # grammar row (and no other processing) the whole branch is skipped by the caller.
  x = apply_grammar_bitmask(logits.astype(jnp.float32), state, md.is_live)
  if not has_processors(state.config, argmax_invariant=False):
    return _fused_processors(x, state, md)
  return lax.cond(
    any_custom(md, state.config, argmax_invariant=False),
    lambda: _processors_with_custom(x, state, md),
    lambda: _fused_processors(x, state, md),
  )


def _processors_with_custom(x, state: BatchState, md: SamplingMetadata) -> jax.Array:
  """Stages 2-6 one after another, with the custom processors before the penalties (vLLM's
  order: allowed, bad words, min_tokens, logit_bias, custom, penalties). `x` may hold the grammar
  mask already (applying it twice, or the grammar before the other masks, is the same)."""
  vocab = state.vocab_size
  x = jnp.where(is_allowed(state), nan_as_neg_inf(x), NEG_INF)
  x = sharded.scatter_vocab(x, _bad_word_bans(state, md), NEG_INF)
  x = sharded.scatter_vocab(x, _min_tokens_bans(state, md), NEG_INF)
  bias_ids = jnp.where(md.is_live[:, None], state.logit_bias_token_ids, vocab)
  x = sharded.scatter_vocab(x, bias_ids, state.logit_bias, add=True)
  x = apply_custom_processors(x, state, md, argmax_invariant=False)
  # A custom processor may write NaN; the fused pass cannot (see `_fused_processors`).
  return nan_as_neg_inf(_penalize(x, state.output_token_counts, state.prompt_token_mask, md))


def _fused_processors(logits, state: BatchState, md: SamplingMetadata) -> jax.Array:
  """Stages 2-6: `[R, V]` logits -> processed `[R, V] float32` logits (vLLM HEAD semantics).

  Computed as one fused elementwise pass plus three small scatters, in an order that gives
  exactly HEAD's result (allowed mask -> bad words -> min_tokens -> logit_bias -> penalties):
  masks set `-inf`, which every later stage keeps, so they commute with the rest; a biased
  token's penalised value is recomputed from its biased logit and scattered over the pass.

  Args:
    logits: `[R, V]` model logits, any float dtype.
    state: the batch state (allowed masks, bad words, stop sets, biases, token counts).
    md: the metadata (live rows and effective penalty values).

  Returns:
    `[R, V] float32` processed logits; masked tokens and NaN logits are `-inf`. No NaN comes
    out: the logits are cleaned first, and finite penalties (`[-2, 2]`, repetition `> 0`) and
    finite biases turn no `+-inf` or finite value into NaN, so the caller needs no second pass.
  """
  vocab = state.vocab_size
  counts, in_prompt = state.output_token_counts, state.prompt_token_mask
  x = nan_as_neg_inf(logits.astype(jnp.float32))
  processed = jnp.where(is_allowed(state), _penalize(x, counts, in_prompt, md), NEG_INF)
  # logit_bias: penalties apply to the biased logit.
  bias_ids = jnp.where(md.is_live[:, None], state.logit_bias_token_ids, vocab)
  safe_ids = jnp.minimum(bias_ids, vocab - 1)  # [R, max_num_logit_bias]
  take = lambda a: jnp.take_along_axis(a, safe_ids, 1)  # counts and prompt: whole rows
  biased = _penalize(
    sharded.take_along_vocab(x, safe_ids) + state.logit_bias, take(counts), take(in_prompt), md
  )
  biased = jnp.where(is_allowed(state, bias_ids), biased, NEG_INF)
  processed = sharded.scatter_vocab(processed, bias_ids, biased)
  processed = sharded.scatter_vocab(processed, _bad_word_bans(state, md), NEG_INF)
  return sharded.scatter_vocab(processed, _min_tokens_bans(state, md), NEG_INF)


def any_processing(md: SamplingMetadata, config=None) -> jax.Array:
  """`[] bool` whether some live row uses the grammar bitmask, a stage 2-6 processor or (with the
  batch's `config`) a custom non-argmax-invariant processor."""
  custom = any_custom(md, config, argmax_invariant=False) if config is not None else False
  return (
    md.any_grammar
    | custom
    | md.any_allowed_token_ids
    | md.any_bad_words
    | md.any_min_tokens
    | md.any_logit_bias
    | md.any_penalties
  )
