"""The per-step sampler: vLLM V1's pipeline as one compiled function for every batch mix.

`sample_step(state, metadata, logits)` runs, per row (vLLM HEAD order, `shared/spec/behaviour.md` §1.4):

  1. cast the logits to float32 (the input itself is the raw_* logprobs source; a NaN logit counts
     as -inf, see `sample_step`);
  2. allowed_token_ids: every other token -> -inf;
  3. bad words: the last token of each banned sequence whose prefix ends the output -> -inf;
  4. min_tokens: stop ids -> -inf while fewer than min_tokens tokens were generated;
  5. logit_bias: added;
  6. penalties: repetition (prompt + output tokens), then frequency and presence (output tokens);
  7. greedy argmax (first maximal index) for greedy rows;
  8. temperature (greedy rows divide by 1);
  9. min_p, 10. top-k, 11. top-p: each keeps the tokens at or above a per-row threshold, so the
     three combine into one threshold; masked tokens are -inf in the processed_* logprobs;
  12. random draw: inverse CDF of the kept distribution with one uniform per row, drawn from
     `fold_in(request_key, num_output_tokens)` (a top-p rejection retry `a` draws from
     `fold_in(that key, a)`);
  13. logprobs: the sampled token's value and rank plus the top `max_num_logprobs` values from the
     mode's source.

Stages 2-6 run as one fused pass (plus small scatters) only when some live row uses one of them;
greedy, random and logprobs work each sit behind `lax.cond` on a traced flag of
`SamplingMetadata`. So one executable serves every mix without recompiling, and a batch pays only
for what its rows use. No branch returns a `[R, V]` array (an untaken branch would pay a copy).

No full-vocabulary sort. Top-k and top-p come from `top_k` candidates (a static budget per row,
`BatchState.num_topk_candidates`, found in two stages: block maxima, then the best blocks). A
top-k cut deeper than the budget is found exactly by a 32-step bisection over the float32 bit
pattern (each step one masked reduction), as the TPU samplers do. A top-p nucleus deeper than the
budget is sampled exactly by rejection: draw from the distribution kept so far and accept when
the mass strictly above the token is below top_p (bisection again only for rows that keep
refusing, and for the processed_* logprobs modes, which need the cut itself). The draw needs one
exponential pass over the vocabulary (blocked inverse CDF) or, when the kept set lies inside the
candidates, none.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxengine.metadata import SamplingMetadata
from jaxengine.state import BatchState

_NEG_INF = float("-inf")
# Block width of the blocked inverse-CDF draw: the vocabulary is summed in blocks of this many
# tokens, then only the chosen block is scanned. 256 divides 49152 and 128256.
_DRAW_BLOCK = 256


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class LogprobsTensors:
  """Log-probabilities of the sampled token and the top tokens of each row.

  Attributes:
    token_ids: `[num_rows, k + 1] int32`; column 0 is the sampled token, columns 1..k the top k
      tokens by value, best first.
    logprobs: `[num_rows, k + 1] float32` the values of those tokens in the batch's logprobs mode
      (raw log-softmax of the model's logits by default).
    ranks: `[num_rows] int32` the sampled token's rank: how many tokens have a value `>=` its own
      (1 is best; ties count against it), as in vLLM.
  """

  token_ids: jax.Array
  logprobs: jax.Array
  ranks: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplerOutput:
  """What one sample step returns.

  From `sample_step` the arrays are device arrays over all `max_num_reqs` rows (rows that hold no
  request carry garbage) and `logprobs` is always present (zeros when no row asked). From
  `InputBatch.sample` they are NumPy arrays over the `num_reqs` live rows in `req_ids` order, and
  `logprobs` is None when no request asked for logprobs.

  Attributes:
    sampled_token_ids: `[num_rows] int32`.
    logprobs: `LogprobsTensors` or None.
    is_appended: `[num_rows] bool` from `sample_step`: True where the token was appended to the
      row (a live row below `max_model_len`). A live row with False was already full: its token
      was drawn but dropped. None from `InputBatch.sample`, which refuses full rows.
  """

  sampled_token_ids: jax.Array
  logprobs: LogprobsTensors | None
  is_appended: jax.Array | None = None


# --- stages 2-6: logits processors ------------------------------------------------------------


def as_float32(logits: jax.Array) -> jax.Array:
  """`[R, V]` logits as float32 with NaN as `-inf`: a NaN logit is never sampled (stage 1)."""
  x = logits.astype(jnp.float32)
  return jnp.where(jnp.isnan(x), _NEG_INF, x)


def _row_index(x: jax.Array) -> jax.Array:
  return jnp.arange(x.shape[0])[:, None]


def _penalize(x, counts, in_prompt, md: SamplingMetadata):
  """Repetition, then frequency, then presence penalties on `x` (any trailing shape per row).

  Repetition (CTRL, Keskar et al. 2019, as vLLM applies it): for tokens in the prompt or the
  output, `x / r` where `x > 0` else `x * r`. Frequency and presence (OpenAI's definition):
  `x - f * count - p * (count > 0)`, counting output tokens only. Neutral values (1, 0, 0) leave
  `x` bit-for-bit unchanged, and `-inf` stays `-inf`.
  """
  in_output = counts > 0
  r = md.repetition_penalty[:, None]
  x = jnp.where(in_prompt | in_output, jnp.where(x > 0, x / r, x * r), x)
  return (
    x
    - md.frequency_penalty[:, None] * counts.astype(jnp.float32)
    - md.presence_penalty[:, None] * in_output.astype(jnp.float32)
  )


def _is_allowed(state: BatchState, token_ids=None) -> jax.Array:
  """`[R, V]` (or `[R, n]` at `token_ids`) True where a row's allowed_token_ids permit the token."""
  mask = state.allowed_token_mask
  if token_ids is not None:
    mask = jnp.take_along_axis(mask, jnp.minimum(token_ids, state.vocab_size - 1), 1)
  return mask | ~state.has_allowed_token_ids[:, None]


def _bad_word_bans(state: BatchState, md: SamplingMetadata) -> jax.Array:
  """`[R, max_num_bad_words]` tokens banned now (`V` where nothing is banned).

  A banned sequence bans its last token when its prefix equals the end of the row's output
  tokens. Only output tokens count (a prefix spanning the prompt/output boundary is not detected,
  as in vLLM); single-token sequences are always banned.
  """
  num_prefix = state.bad_words_prefix.shape[-1]
  positions = state.num_tokens[:, None] + jnp.arange(-num_prefix, 0)  # [R, P]
  tail = jnp.take_along_axis(state.token_ids, jnp.clip(positions, 0, state.max_model_len - 1), 1)
  tail = jnp.where(positions >= state.num_prompt_tokens[:, None], tail, -1)  # -1: no output token
  prefix = state.bad_words_prefix  # [R, W, P], -1 = no constraint at this position
  matches = ((prefix < 0) | (prefix == tail[:, None, :])).all(-1)  # [R, W]
  return jnp.where(matches & md.is_live[:, None], state.bad_words_last, state.vocab_size)


def _min_tokens_bans(state: BatchState, md: SamplingMetadata) -> jax.Array:
  """`[R, max_num_stop_token_ids]` the stop set of rows below min_tokens (`V` elsewhere)."""
  active = md.is_live & (state.num_output_tokens < state.min_tokens)
  return jnp.where(active[:, None], state.stop_token_ids, state.vocab_size)


def apply_logits_processors(logits, state: BatchState, md: SamplingMetadata) -> jax.Array:
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
    `[R, V] float32` processed logits; masked tokens are `-inf`.
  """
  rows = _row_index(logits)
  vocab = state.vocab_size
  counts, in_prompt = state.output_token_counts, state.prompt_token_mask
  x = as_float32(logits)
  processed = jnp.where(_is_allowed(state), _penalize(x, counts, in_prompt, md), _NEG_INF)
  # logit_bias: penalties apply to the biased logit.
  bias_ids = jnp.where(md.is_live[:, None], state.logit_bias_token_ids, vocab)  # [R, NB]
  safe_ids = jnp.minimum(bias_ids, vocab - 1)
  take = lambda a: jnp.take_along_axis(a, safe_ids, 1)
  biased = _penalize(take(x) + state.logit_bias, take(counts), take(in_prompt), md)
  biased = jnp.where(_is_allowed(state, bias_ids), biased, _NEG_INF)
  processed = processed.at[rows, bias_ids].set(biased, mode="drop")
  processed = processed.at[rows, _bad_word_bans(state, md)].set(_NEG_INF, mode="drop")
  return processed.at[rows, _min_tokens_bans(state, md)].set(_NEG_INF, mode="drop")


def _block_width(vocab: int, widest: int = _DRAW_BLOCK) -> int:
  """The widest power of two `<= widest` dividing `vocab` (so rows reshape into blocks without a
  padded copy), or `widest` when only small ones do (then the row is padded)."""
  width = widest
  while width > 16 and vocab % width:
    width //= 2
  return width if vocab % width == 0 else widest


def _blocks(x: jax.Array, width: int, fill: float) -> jax.Array:
  """`[R, V]` -> `[R, ceil(V / width), width]`, padding the last block with `fill`."""
  pad = -x.shape[1] % width
  if pad:
    x = jnp.pad(x, ((0, 0), (0, pad)), constant_values=fill)
  return x.reshape(x.shape[0], -1, width)


def argmax(x: jax.Array) -> jax.Array:
  """`[R] int32` first index of each row's maximum, as `jnp.argmax`, in about one max's time.

  XLA's CPU argmax (a two-operand reduction) is far slower than a max. So the row is cut into
  blocks; the first block holding the maximum is found on the `[R, V / block]`
  block maxima, and only that block is searched.
  """
  _rows, vocab = x.shape
  width = _block_width(vocab)
  blocks = _blocks(x, width, _NEG_INF)
  best_block = jnp.argmax(blocks.max(-1), axis=-1)  # a small argmax: [R, V / block]
  chosen = jnp.take_along_axis(blocks, best_block[:, None, None], 1)[:, 0]
  return (best_block * width + jnp.argmax(chosen, axis=-1)).astype(jnp.int32)


# Block width of `top_k`'s first stage.
_TOP_K_BLOCK = 32


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """`lax.top_k` over the last axis of `[R, V]` in two stages: the same values, a third the time.

  The k blocks of `_TOP_K_BLOCK` tokens with the largest maxima hold k values at least as large as
  any token outside them (each of those blocks has a maximum at least that large), so the top k of
  their `k * _TOP_K_BLOCK` tokens are the top k of the row (among equal values, which ids are
  reported may differ from `lax.top_k`). XLA's CPU top-k costs about the same whatever k, per
  element scanned, so scanning `[R, V / block]` maxima and then `[R, k * block]` tokens is the
  cheaper way. Falls back to `lax.top_k` when the blocks would not save anything.

  Returns:
    `(values [R, k], indices [R, k] int32)`, values descending.
  """
  rows, vocab = x.shape
  if k == 0 or vocab % _TOP_K_BLOCK or 4 * k * _TOP_K_BLOCK > vocab:
    return lax.top_k(x, k)
  blocks = x.reshape(rows, -1, _TOP_K_BLOCK)
  _, best_blocks = lax.top_k(blocks.max(-1), k)  # [R, k]
  gathered = jnp.take_along_axis(blocks, best_blocks[:, :, None], 1)  # [R, k, block]
  values, index = lax.top_k(gathered.reshape(rows, k * _TOP_K_BLOCK), k)
  block = jnp.take_along_axis(best_blocks, index // _TOP_K_BLOCK, 1)
  return values, (block * _TOP_K_BLOCK + index % _TOP_K_BLOCK).astype(jnp.int32)


# --- exact thresholds without sorting ---------------------------------------------------------


def _ordered_bits(y: jax.Array) -> jax.Array:
  """float32 -> uint32 with the same order (for -0.0 == +0.0 too)."""
  bits = lax.bitcast_convert_type(jnp.where(y == 0, 0.0, y), jnp.uint32)
  return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _from_ordered_bits(key: jax.Array) -> jax.Array:
  bits = jnp.where(key >> 31 == 1, key & jnp.uint32(0x7FFFFFFF), ~key)
  return lax.bitcast_convert_type(bits, jnp.float32)


def _largest_threshold(y: jax.Array, reaches) -> jax.Array:
  """The largest value `t` of each row of `y` with `reaches(y >= t)` true, by bisection.

  `reaches(kept_mask [R, V] bool) -> [R] bool` must be monotone (true for every smaller t) and true
  for the whole row. 32 halvings of the uint32 order-preserving bit pattern land exactly on a value
  of the row, so the result is exact with no sort: each step is one masked reduction.
  """
  keys = _ordered_bits(y)
  rows = y.shape[0]

  def halve(_, bounds):
    lo, hi = bounds  # invariant: reaches(lo); the answer lies in [lo, hi]
    gap = hi - lo
    mid = lo + gap // 2 + (gap & 1)
    ok = reaches(keys >= mid[:, None])
    return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

  lo = jnp.zeros((rows,), jnp.uint32)
  hi = jnp.full((rows,), 0xFFFFFFFF, jnp.uint32)
  lo, _ = lax.fori_loop(0, 32, halve, (lo, hi))
  return _from_ordered_bits(lo)


def kth_largest(y: jax.Array, k: jax.Array) -> jax.Array:
  """`[R] float32` the k-th largest value of each row of `y` (ties counted), exact, no sort.

  Args:
    y: `[R, V] float32`.
    k: `[R] int32`, each in `[1, V]`.
  """
  return _largest_threshold(y, lambda kept: kept.sum(-1) >= k)


def top_p_threshold(y, row_max, threshold, top_p) -> jax.Array:
  """`[R]` the smallest value kept by top-p among the tokens with `y >= threshold`, exact, no sort.

  A token is kept when the probability mass of the tokens strictly above its value is below
  `top_p` (vLLM's rule; tokens tied with the last one kept are kept too), so the cut is the largest
  `t` whose mass of `y >= t` reaches `top_p` of the total.

  Args:
    y: `[R, V] float32` temperature-scaled logits.
    row_max: `[R] float32` the maximum of each row of `y`.
    threshold: `[R] float32` the cut before top-p (min-p, top-k; `-inf` for none).
    top_p: `[R] float32` in `(0, 1]`.
  """
  weights = jnp.where(y >= threshold[:, None], jnp.exp(y - row_max[:, None]), 0.0)
  target = top_p * weights.sum(-1)
  return _largest_threshold(y, lambda kept: jnp.where(kept, weights, 0.0).sum(-1) >= target)


# --- stages 9-12: filters and the draw --------------------------------------------------------


def _last_positive(weights: jax.Array) -> jax.Array:
  """`[R]` index of the last positive entry of each row (0 if none)."""
  n = weights.shape[-1]
  return n - 1 - jnp.argmax(weights[:, ::-1] > 0, axis=-1)


def _inverse_cdf(weights: jax.Array, target: jax.Array) -> jax.Array:
  """`[R]` first index whose inclusive cumulative weight exceeds `target`, never a zero weight."""
  cumulative = jnp.cumsum(weights, axis=-1)
  index = (cumulative <= target[:, None]).sum(-1)
  return jnp.minimum(index, _last_positive(weights))


def _draw_from_candidates(values, ids, row_max, threshold, u):
  weights = jnp.where(values >= threshold[:, None], jnp.exp(values - row_max[:, None]), 0.0)
  index = _inverse_cdf(weights, u * weights.sum(-1))
  return jnp.take_along_axis(ids, index[:, None], 1)[:, 0]


def _weigh(values, row_max, threshold):
  """Unnormalised probabilities `exp(v - max)` of the kept values (`v >= threshold`), else 0."""
  shape = (values.shape[0],) + (1,) * (values.ndim - 1)
  return jnp.where(
    values >= threshold.reshape(shape), jnp.exp(values - row_max.reshape(shape)), 0.0
  )


class _VocabSampler:
  """Blocked inverse CDF over the whole vocabulary.

  The kept tokens' weights are written once (`[R, V]`, one exp pass) and summed per block of up
  to `_DRAW_BLOCK` tokens; a draw then finds its block on the `[R, num_blocks]` cumulative masses and
  scans that one block.
  """

  def __init__(self, y, row_max, threshold):
    self.weights = _weigh(y, row_max, threshold)  # [R, V]
    self.width = _block_width(y.shape[1])
    self.blocks = _blocks(self.weights, self.width, 0.0)  # [R, num_blocks, width]
    self.block_mass = self.blocks.sum(-1)  # [R, num_blocks]
    self.block_cumulative = jnp.cumsum(self.block_mass, axis=-1)
    self.total = self.block_cumulative[:, -1]

  def draw(self, u: jax.Array) -> jax.Array:
    """`[R] int32` the token whose cumulative mass first exceeds `u * total`."""
    target = u * self.total
    block = jnp.minimum(
      (self.block_cumulative <= target[:, None]).sum(-1), _last_positive(self.block_mass)
    )
    before = jnp.take_along_axis(self.block_cumulative, jnp.maximum(block - 1, 0)[:, None], 1)
    before = jnp.where(block > 0, before[:, 0], 0.0)
    chosen = jnp.take_along_axis(self.blocks, block[:, None, None], 1)[:, 0]  # [R, block]
    index = _inverse_cdf(chosen, target - before)
    return (block * self.width + index).astype(jnp.int32)


# Attempts of the top-p rejection draw before the remaining rows take the exact bisection.
_MAX_REJECTION_ATTEMPTS = 16


def _draw_from_vocab(x, inv_temperature, row_max, threshold, u, top_p, rejecting, step_keys):
  """Draws every row from its kept distribution (`y >= threshold`), and exact top-p for the
  `rejecting` rows, whose nucleus lies beyond the candidates, without finding their cut.

  Drawing from the distribution kept so far and accepting the token only if the mass strictly
  above it is below `top_p` (vLLM's keep rule) samples exactly the top-p distribution.
  Acceptance has probability at least `top_p`, so a few attempts suffice; each costs one masked
  reduction over the weights already written (the comparison is on weights, which order tokens as
  their logits do). Attempt `a > 0` of a row draws `uniform(fold_in(step_key, a))`, so rows stay
  independent of their neighbours. Rows still unaccepted after `_MAX_REJECTION_ATTEMPTS` use the
  exact bisection cut and a fresh uniform, `fold_in(step_key, _MAX_REJECTION_ATTEMPTS)`.
  """
  sampler = _VocabSampler(x * inv_temperature[:, None], row_max, threshold)
  tokens = sampler.draw(u)
  target = top_p * sampler.total

  def accepted(drawn):
    weight = jnp.take_along_axis(sampler.weights, drawn[:, None], 1)
    return jnp.where(sampler.weights > weight, sampler.weights, 0.0).sum(-1) < target

  def attempt(carry):
    a, tokens, done = carry
    retry_u = jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, a), ()))(step_keys)
    drawn = sampler.draw(retry_u)
    ok = accepted(drawn)
    return a + 1, jnp.where(~done & ok, drawn, tokens), done | ok

  def pending(carry):
    a, _, done = carry
    return (a < _MAX_REJECTION_ATTEMPTS) & (~done).any()

  def reject():
    done = ~rejecting | accepted(tokens)
    _, drawn, done = lax.while_loop(pending, attempt, (jnp.int32(1), tokens, done))
    stuck = ~done

    def exact():
      y = x * inv_temperature[:, None]  # recomputed here rather than kept as a branch operand
      cut = jnp.where(stuck, top_p_threshold(y, row_max, threshold, top_p), threshold)
      # A fresh uniform: the row's earlier ones are known to have landed outside the nucleus, so
      # reusing any of them would bias the draw.
      fresh_u = jax.vmap(
        lambda key: jax.random.uniform(jax.random.fold_in(key, _MAX_REJECTION_ATTEMPTS), ())
      )(step_keys)
      return jnp.where(stuck, _VocabSampler(y, row_max, cut).draw(fresh_u), drawn)

    return lax.cond(stuck.any(), exact, lambda: drawn)

  return lax.cond(rejecting.any(), reject, lambda: tokens)


def _candidate_filters(x, row_max, threshold, md: SamplingMetadata, num_candidates: int, u):
  """Top-k then top-p thresholds from `lax.top_k` candidates.

  Top-k is always resolved exactly (by bisection when k exceeds the candidates). Top-p is
  resolved from the candidates when they hold the needed mass; rows where they do not are
  reported as unresolved, with their threshold before top-p.

  A token outside the candidates is never above the last candidate, so a row's kept set
  `y >= threshold` lies inside its candidates when the threshold is above the last candidate,
  may not when it is below, and is decided by counting the whole row only when the two are equal
  (ties): that count runs under `lax.cond`, so a typical step never reads the vocabulary again.

  Returns:
    threshold `[R]`, from_candidates `[R] bool` (the kept set lies inside the candidates, so the
    row is drawn from them), that draw `[R] int32`, and top_p_unresolved `[R] bool`.
  """
  vocab = x.shape[-1]
  inv_temperature = _inverse_temperature(md)
  top_logits, ids = top_k(x, num_candidates)  # [R, K]; same order as y = x * (1 / T)
  values = top_logits * inv_temperature[:, None]  # the top K values of y, best first
  last = values[:, -1]
  filtered = (md.top_k < vocab) | (md.top_p < 1.0)

  def num_outside(threshold):
    """`[R]` tokens with `y >= threshold` that are not candidates (exact where it matters)."""
    at_edge = filtered & (last == threshold)

    def count():
      y = x * inv_temperature[:, None]
      outside = (y >= threshold[:, None]).sum(-1) - (values >= threshold[:, None]).sum(-1)
      return jnp.where(at_edge, outside, 0)

    beyond = jnp.where(last > threshold, vocab, 0)  # unknown, and possibly many
    return beyond + lax.cond(at_edge.any(), count, lambda: jnp.zeros_like(beyond))

  # Top-k: keep everything at or above the k-th largest value (all ties kept).
  k = md.top_k
  kth = jnp.take_along_axis(values, jnp.clip(k - 1, 0, num_candidates - 1)[:, None], 1)[:, 0]
  top_k_cut = jnp.where(k < vocab, kth, _NEG_INF)
  beyond = (k < vocab) & (k > num_candidates)
  top_k_cut = lax.cond(
    md.any_top_k_beyond_candidates,
    lambda: jnp.where(beyond, kth_largest(x * inv_temperature[:, None], k), top_k_cut),
    lambda: top_k_cut,
  )
  threshold = jnp.maximum(threshold, top_k_cut)

  def apply_top_p(threshold):
    # The mass of the kept set is known from the candidates when every kept token is a candidate
    # or ties with the last candidate (then the missing tokens all weigh exp(threshold - max)).
    kept = values >= threshold[:, None]
    weights = jnp.where(kept, jnp.exp(values - row_max[:, None]), 0.0)
    ties_last = last == threshold
    known = last <= threshold
    missing = jnp.where(ties_last, num_outside(threshold), 0)
    total = weights.sum(-1) + missing * jnp.exp(threshold - row_max)
    reached = jnp.cumsum(weights, -1) >= (md.top_p * total)[:, None]
    cut = jnp.where(
      reached.any(-1),
      jnp.take_along_axis(values, jnp.argmax(reached, -1)[:, None], 1)[:, 0],
      threshold,
    )  # not reached inside: the cut is the tied tail, `threshold` itself
    active = md.top_p < 1.0
    resolved = jnp.where(known, jnp.maximum(threshold, cut), threshold)
    return jnp.where(active, resolved, threshold), active & ~known

  threshold, unresolved = lax.cond(
    md.any_top_p, apply_top_p, lambda t: (t, jnp.zeros(t.shape, bool)), threshold
  )
  # Rows filtered by top-k or top-p are drawn from their candidates when the kept set fits; the
  # choice depends on the row alone, so a seeded row's token never depends on its neighbours.
  fits = num_outside(threshold) == 0
  from_candidates = filtered & fits & ~unresolved
  tokens = _draw_from_candidates(values, ids, row_max, threshold, u)
  return threshold, from_candidates, tokens, unresolved


def _inverse_temperature(md: SamplingMetadata) -> jax.Array:
  """`[R]` 1 / temperature. Every place computes `y = x * (1 / T)` in this one form so that `y`
  rounds identically wherever it is recomputed (XLA would rewrite `x / T` so anyway)."""
  return 1.0 / md.temperature


def _sample_random(
  x, md: SamplingMetadata, step_keys, u, num_candidates: int, needs_threshold: bool
):
  """Stages 8-12 for every row.

  Returns:
    tokens `[R] int32`, the kept threshold `[R] float32` and each row's largest scaled logit
    `[R] float32` (`+inf` flags a row whose distribution is undefined; see `sample_step`).


  A row keeps the tokens whose temperature-scaled logit `y = x / T` is `>=` its threshold. With
  `needs_threshold` (processed logprobs modes) every row's exact threshold is computed; otherwise
  top-p rows whose cut lies beyond the candidates are drawn by rejection and report their
  threshold before top-p. `y` is recomputed inside each branch that needs it, never passed
  between them, so it is not written out as one more `[R, V]` array.
  """
  rows, _vocab = x.shape
  inv_temperature = _inverse_temperature(md)
  row_max = x.max(-1) * inv_temperature  # == max(y): scaling by a positive number is monotone
  # min_p (vLLM): drop p < min_p * max(p), i.e. y < max(y) + log(min_p).
  threshold = jnp.where(md.min_p > 0, row_max + jnp.log(md.min_p), _NEG_INF)
  nothing = jnp.zeros((rows,), bool)
  threshold, from_candidates, candidate_tokens, unresolved = lax.cond(
    md.any_top_k | md.any_top_p,
    lambda t: _candidate_filters(x, row_max, t, md, num_candidates, u),
    lambda t: (t, nothing, jnp.zeros((rows,), jnp.int32), nothing),
    threshold,
  )
  # Every filter keeps the most likely token; the clamp guards that against rounding.
  threshold = jnp.minimum(threshold, row_max)
  if needs_threshold:
    threshold = lax.cond(
      unresolved.any(),
      lambda: jnp.where(
        unresolved,
        top_p_threshold(x * inv_temperature[:, None], row_max, threshold, md.top_p),
        threshold,
      ),
      lambda: threshold,
    )
    unresolved = nothing
  from_vocab = md.is_live & ~md.is_greedy & ~from_candidates
  vocab_tokens = lax.cond(
    from_vocab.any(),
    lambda: _draw_from_vocab(
      x, inv_temperature, row_max, threshold, u, md.top_p, unresolved, step_keys
    ),
    lambda: jnp.zeros((rows,), jnp.int32),
  )
  tokens = jnp.where(from_candidates, candidate_tokens, vocab_tokens)
  return tokens.astype(jnp.int32), threshold, row_max


def _step_keys(state: BatchState) -> tuple[jax.Array, jax.Array]:
  """Each row's key for this step and its uniform draw `[R] float32` in [0, 1).

  The t-th output token of a request uses `fold_in(request_key, t)`: its stream depends on
  nothing but the request's seed (or serial) and how many tokens it has generated.
  """
  keys = jax.random.wrap_key_data(state.key_data)
  step_keys = jax.vmap(jax.random.fold_in)(keys, state.num_output_tokens.astype(jnp.uint32))
  return step_keys, jax.vmap(lambda key: jax.random.uniform(key, (), jnp.float32))(step_keys)


# --- stage 13: logprobs ------------------------------------------------------------------------


def _logprobs_scores(logits, x, md: SamplingMetadata, threshold, mode: str) -> jax.Array:
  """`[R, V]` the values logprobs report, before normalisation (vLLM's logprobs modes).

  raw_*: the model's logits. processed_*: the values the token was drawn from (temperature-scaled,
  filtered tokens -inf); for greedy rows the post-penalty logits.
  """
  if mode.startswith("raw"):
    return logits.astype(jnp.float32)
  y = x * _inverse_temperature(md)[:, None]
  return jnp.where(y >= threshold[:, None], y, _NEG_INF)


def gather_logprobs(
  scores: jax.Array, token_ids: jax.Array, num_logprobs: int, *, normalize: bool = True
) -> LogprobsTensors:
  """The given token's value and rank plus the top `num_logprobs` values of each row.

  Ranks and the top entries are found on `scores` directly and only the gathered values are
  normalised, so the `[R, V]` log-softmax is never written out.

  Args:
    scores: `[R, V] float32` logits (or any scores).
    token_ids: `[R] int32` the sampled (or, for prompt logprobs, the actual next) tokens.
    num_logprobs: static number of top entries. `V` means a full sort of each row.
    normalize: report log-probabilities `scores - logsumexp(scores)` (True) or the scores.

  Returns:
    `LogprobsTensors`: `token_ids` and `logprobs` `[R, num_logprobs + 1]` (column 0 the given
    token, then the top entries by value, best first) and `ranks` `[R] int32` (entries `>=` the
    given token's value; 1 is best, ties count against it).
  """
  token_score = jnp.take_along_axis(scores, token_ids[:, None], 1)  # [R, 1]
  ranks = (scores >= token_score).sum(-1).astype(jnp.int32)
  top_scores, top_ids = top_k(scores, num_logprobs)
  values = jnp.concatenate([token_score, top_scores], 1)
  if normalize:
    values = values - jax.nn.logsumexp(scores, axis=-1, keepdims=True)
  return LogprobsTensors(
    token_ids=jnp.concatenate([token_ids[:, None], top_ids], 1).astype(jnp.int32),
    logprobs=values,
    ranks=ranks,
  )


# --- the step ----------------------------------------------------------------------------------


def _fallback_for_masked_rows(logits, state: BatchState) -> jax.Array:
  """Rows whose every token was masked: the best token of the allowed set by raw logit.

  `InputBatch` refuses requests whose constraints ban everything whatever they generate, so this
  happens only when a multi-token bad word completes the ban after some outputs (or when the
  model's logits are all -inf or NaN). The constraints cannot all be met then; allowed_token_ids
  still holds: the token is never outside the row's allowed set.
  """
  x = logits.astype(jnp.float32)
  allowed = state.allowed_token_mask | ~state.has_allowed_token_ids[:, None]
  finite = jnp.where(jnp.isneginf(x) | jnp.isnan(x), jnp.finfo(jnp.float32).min, x)
  return argmax(jnp.where(allowed, finite, _NEG_INF))


def _repair_degenerate_rows(logits, x, tokens, row_max, state: BatchState, md: SamplingMetadata):
  """Replaces the tokens of rows whose distribution is undefined (see `sample_step`).

  Args:
    logits: `[R, V]` the model's logits.
    x: `[R, V] float32` processed logits.
    tokens: `[R] int32` the greedy or random draw of each row.
    row_max: `[R] float32` each random row's largest temperature-scaled logit.
    state, md: the batch state and metadata.

  Returns:
    `[R] int32` tokens, each in `[0, V)` and inside its row's allowed set: a row whose token is
    out of range or masked (`-inf`) gets `_fallback_for_masked_rows`; a random row whose largest
    scaled logit is `+inf` gets its first maximal processed token, as a greedy row would.
  """
  vocab = state.vocab_size
  value = jnp.take_along_axis(x, jnp.clip(tokens, 0, vocab - 1)[:, None], 1)[:, 0]
  unsampleable = md.is_live & ((tokens < 0) | (tokens >= vocab) | ~(value > _NEG_INF))
  infinite = md.is_live & ~md.is_greedy & jnp.isposinf(row_max)

  def repair():
    fallback = jnp.where(unsampleable, _fallback_for_masked_rows(logits, state), tokens)
    return jnp.where(infinite, argmax(jnp.where(jnp.isnan(x), _NEG_INF, x)), fallback)

  return lax.cond((unsampleable | infinite).any(), repair, lambda: tokens)


def _append_tokens(state: BatchState, md: SamplingMetadata, tokens: jax.Array):
  """Appends each live row's token and counts it for the penalties (one scatter each).

  Returns:
    `(state, is_appended [R] bool)`: rows that are not live, or already hold `max_model_len`
    tokens, are left unchanged.
  """
  rows = jnp.arange(state.max_num_reqs)
  appended = md.is_live & (state.num_tokens < state.max_model_len)
  position = jnp.where(appended, state.num_tokens, state.max_model_len)
  state = dataclasses.replace(
    state,
    token_ids=state.token_ids.at[rows, position].set(tokens, mode="drop"),
    num_tokens=state.num_tokens + appended.astype(jnp.int32),
    output_token_counts=state.output_token_counts.at[rows, tokens].add(appended.astype(jnp.int32)),
  )
  return state, appended


def _draw_tokens(x, state: BatchState, md: SamplingMetadata):
  """Stages 7-12 on processed logits `x`: `(tokens [R] int32, threshold [R], row_max [R])`."""
  rows = state.max_num_reqs
  greedy_tokens = lax.cond(md.any_greedy, lambda: argmax(x), lambda: jnp.zeros((rows,), jnp.int32))
  random_tokens, threshold, row_max = lax.cond(
    md.any_random,
    lambda: _sample_random(
      x,
      md,
      *_step_keys(state),
      state.num_topk_candidates,
      needs_threshold=state.logprobs_mode.startswith("processed"),
    ),
    lambda: (jnp.zeros((rows,), jnp.int32), jnp.full((rows,), _NEG_INF), jnp.zeros((rows,))),
  )
  return jnp.where(md.is_greedy, greedy_tokens, random_tokens), threshold, row_max


def _draw_tokens_nan_as_neg_inf(x, state: BatchState, md: SamplingMetadata):
  """`_draw_tokens`, redone with NaN as `-inf` for the rows a NaN logit touched.

  The common path never pays for the NaN check over `[R, V]`: a NaN shows itself in the result
  (the row maximum, or the token's own value, is NaN, or the token is out of range), and only
  then are the tokens drawn again from the cleaned logits. A row's draw depends on the row alone,
  so the rows without NaN keep their tokens.
  """
  drawn = _draw_tokens(x, state, md)
  tokens, _, row_max = drawn
  vocab = state.vocab_size
  value = jnp.take_along_axis(x, jnp.clip(tokens, 0, vocab - 1)[:, None], 1)[:, 0]
  touched = md.is_live & (jnp.isnan(value) | jnp.isnan(row_max) | (tokens < 0) | (tokens >= vocab))

  def redraw():
    clean = _draw_tokens(jnp.where(jnp.isnan(x), _NEG_INF, x), state, md)
    return jax.tree.map(lambda a, b: jnp.where(touched, a, b), clean, drawn)

  return lax.cond(touched.any(), redraw, lambda: drawn)


def _tokens_and_logprobs(logits, x, state: BatchState, md: SamplingMetadata):
  """Stages 7-13 on processed logits `x`. Every `lax.cond` here returns only `[R]`-sized or
  `[R, k]`-sized results: a branch that returned an `[R, V]` array unchanged would cost a copy."""
  rows = state.max_num_reqs
  tokens, threshold, row_max = _draw_tokens_nan_as_neg_inf(x, state, md)
  tokens = _repair_degenerate_rows(logits, x, tokens, row_max, state, md)
  num_logprobs = state.max_num_logprobs

  def logprobs_branch():
    mode = state.logprobs_mode
    scores = _logprobs_scores(logits, x, md, threshold, mode)
    return gather_logprobs(scores, tokens, num_logprobs, normalize=mode.endswith("logprobs"))

  def no_logprobs():
    return LogprobsTensors(
      token_ids=jnp.zeros((rows, num_logprobs + 1), jnp.int32),
      logprobs=jnp.zeros((rows, num_logprobs + 1), jnp.float32),
      ranks=jnp.zeros((rows,), jnp.int32),
    )

  return tokens, lax.cond(md.any_logprobs, logprobs_branch, no_logprobs)


def sample(state: BatchState, metadata: SamplingMetadata, logits: jax.Array):
  """The body of `sample_step`, not jitted (for callers composing their own transformations).

  Same arguments, results and errors as `sample_step`.
  """
  rows, vocab = state.max_num_reqs, state.vocab_size
  if logits.shape != (rows, vocab):
    raise ValueError(
      f"logits must have shape [max_num_reqs, vocab_size] = {(rows, vocab)}, got {logits.shape}"
    )
  md = metadata
  any_processing = (
    md.any_allowed_token_ids
    | md.any_bad_words
    | md.any_min_tokens
    | md.any_logit_bias
    | md.any_penalties
  )
  # Two copies of stages 7-13, so a batch that needs no logits processing reads the logits as
  # they are instead of paying for a processed copy.
  tokens, logprobs = lax.cond(
    any_processing,
    lambda: _tokens_and_logprobs(logits, apply_logits_processors(logits, state, md), state, md),
    lambda: _tokens_and_logprobs(logits, logits.astype(jnp.float32), state, md),
  )
  state, is_appended = _append_tokens(state, md, tokens)
  return state, SamplerOutput(sampled_token_ids=tokens, logprobs=logprobs, is_appended=is_appended)


@functools.partial(jax.jit, donate_argnames=("state",))
def sample_step(state: BatchState, metadata: SamplingMetadata, logits: jax.Array):
  """Samples one token per row and appends it to the batch state (jitted, donates `state`).

  The pure function under `InputBatch.sample`, usable inside a caller's own `jax.jit` or
  `lax.scan` (e.g. an RL rollout loop that keeps `state` in its carry). It compiles once per
  `BatchState` capacity; no per-request value or feature flag causes a recompile.

  Args:
    state: the batch state (donated: do not read it after the call).
    metadata: `SamplingMetadata` from `refresh_metadata(state, is_live)`; it depends only on the
      batch composition, so a loop without adds or removals reuses it for every step.
    logits: `[max_num_reqs, vocab_size]` float logits (any float dtype; computed in float32).
      Rows that hold no request are ignored.

  Returns:
    `(new_state, SamplerOutput)`: the state with each live row's sampled token appended (and
    counted for penalties), and device arrays over all rows: `sampled_token_ids [max_num_reqs]
    int32`, `logprobs` (`LogprobsTensors` with `max_num_logprobs + 1` columns; zeros when no
    live row asked for logprobs) and `is_appended [max_num_reqs] bool`.

  Full rows: a live row that already holds `max_model_len` tokens has nowhere to put a token.
  It is still sampled (from an unchanged key, as its output count does not grow), but nothing is
  appended: its `new_state.num_tokens` stays `max_model_len` and `is_appended` is False. A caller
  looping in `lax.scan` sees such rows by either sign and should mask them out (or end them);
  `InputBatch.sample` refuses to sample with such a row instead.

  Non-finite logits (the defined result; every token lies in `[0, vocab_size)` and in the row's
  allowed set whatever the logits hold):
    - a NaN logit counts as `-inf`: it is never sampled while the row has another token left
      (and the rows without NaN keep exactly the tokens they would have drawn);
    - a row whose largest (processed, temperature-scaled) logit is `+inf` takes its first `+inf`
      token, greedy or not;
    - a row with nothing left (every token `-inf`, NaN or masked) takes the best allowed token by
      raw logit (NaN and `-inf` as the lowest float), i.e. its first allowed token when none is
      finite.
  Logprobs report the values as they are (a NaN logit gives NaN raw logprobs).

  Raises:
    ValueError: at trace time, if `logits` does not have shape `[max_num_reqs, vocab_size]`.
  """
  return sample(state, metadata, logits)
