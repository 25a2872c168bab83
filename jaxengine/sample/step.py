"""The per-step sampler: vLLM V1's pipeline as one compiled function for every batch mix.

`sample_step(state, metadata, logits)` runs, per row (vLLM HEAD order, `docs/sampling.md` §1.1):

  0. the grammar bitmask of rows with structured outputs (`custom.py`);
  1. cast the logits to float32; these masked logits are the raw_* logprobs source, as in vLLM
     V1, which applies the bitmask before its sampler (a NaN logit counts as -inf, see
     `sample_step`);
  2. allowed_token_ids: every other token -> -inf;                            (processors.py)
  3. bad words: the last token of each banned sequence whose prefix ends the output -> -inf;
  4. min_tokens: stop ids -> -inf while fewer than min_tokens tokens were generated;
  5. logit_bias: added; then your `LogitsProcessor`s with `argmax_invariant = False`;
  6. penalties: repetition (prompt + output tokens), then frequency and presence (output tokens);
  7. greedy argmax (first maximal index) for greedy rows;                      (blocked.py)
  8. temperature (greedy rows divide by 1);
  9. min_p (your argmax-invariant processors first, random rows only), 10. top-k, 11. top-p:
     each keeps the tokens at or above a per-row threshold, so the three combine into one
     threshold; masked tokens are -inf in the processed_* logprobs;
                                                       (budgets.py, filters.py, thresholds.py)
  12. random draw: inverse CDF of the kept distribution with one uniform per row, drawn from
     `fold_in(request_key, num_output_tokens)` (a top-p rejection retry `a` draws from
     `fold_in(that key, a)`);                                                   (draw.py)
  13. logprobs: the sampled token's value and rank plus the top `num_top_logprobs` values from
     the mode's source.                                                         (logprobs.py)

Stages 2-6 run as one fused pass (plus small scatters) only when some live row uses one of them;
greedy, random and logprobs work each sit behind `lax.cond` on a traced flag of
`SamplingMetadata`. So one executable serves every mix without recompiling, and a batch pays only
for what its rows use. A batch that needs no stage 0-6 and holds no NaN draws from the logits
where they are (logits of more than `ALWAYS_COPIED_LOGITS` elements): stages 7-12 are compiled
twice, once on the logits in place and once on `drawable_logits` (the processed logits, NaN read
as -inf), chosen by one `lax.cond` (`needs_drawable_copy`), because a branch that returned the
logits unchanged as an `[R, V]` array would copy them every step (measured: a greedy step tripled
at 256 x 49,152 on the CPU). Stage 13 in the raw_* modes reads only the model's logits and is
compiled once, after the draw; every `lax.cond` inside the draw returns `[R]`- or `[R, k]`-sized
results.

No full-vocabulary sort. Top-k and top-p come from `C` candidates per row (a static budget,
`BatchConfig.num_topk_candidates`, found in two stages: block maxima, then the best blocks). A
top-k deeper than that is read off a deep list (`BatchConfig.deep_candidate_budgets`, 256 and 1024
by default; one `lax.top_k` list per level, over that level's rows only: budgets.py), and one
deeper than every budget is found exactly by a 32-step bisection over the float32 bit pattern
(each step one masked reduction), as the TPU samplers do. A top-p nucleus deeper than the
shallow list is sampled exactly by rejection: draw from the distribution kept so far and accept
when the mass strictly above the token is below top_p (bisection again only for rows that keep
refusing, and for the processed_* logprobs modes, which need the cut itself). The draw needs one
exponential pass over the vocabulary (blocked inverse CDF) or, when the kept set lies inside the
candidates, none.

On a mesh (`sample(..., mesh=)`, logits sharded over the vocabulary) the same pipeline runs with
its whole-row operations (argmax, top-k, values at token ids, scatters, the chosen block of the
draw) done per shard under `jax.shard_map` (`sharded.py`): only per-row summaries cross devices.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh

from jaxengine.sample import sharded
from jaxengine.sample.blocked import blocked_argmax
from jaxengine.sample.budgets import cut_and_draw
from jaxengine.sample.custom import (
  apply_invariant_processors,
  has_processors,
  update_processor_states,
)
from jaxengine.sample.draw import draw_from_vocab
from jaxengine.sample.logprobs import LogprobsTensors, gather_logprobs, logprobs_scores
from jaxengine.sample.metadata import SamplingMetadata, inverse_temperature
from jaxengine.sample.processors import (
  NEG_INF,
  any_processing,
  apply_logits_processors,
  is_allowed,
  nan_as_neg_inf,
)
from jaxengine.sample.state import BatchState
from jaxengine.sample.thresholds import top_p_threshold

#: Logits of at most this many elements (`R * V`; 2 MiB of float32: 8 rows of a 64k vocabulary)
#: are always drawn from `drawable_logits`: compiling stages 7-12 a second time, on the logits in
#: place, costs about a second of XLA:CPU compile per executable, and below this size the copy it
#: saves costs less than that body's conditionals (benchmarks/README.md: no mix slower at 1 and 8
#: rows of 49,152 on the CPU; the copy tripled a greedy step at 256 x 49,152).
ALWAYS_COPIED_LOGITS = 1 << 19


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplerOutput:
  """What one `sample_step` returns: device arrays over all `R` rows (rows that hold no request
  carry garbage). `InputBatch.sample` turns it into a `HostSamplerOutput` over the live rows.

  Attributes:
    sampled_token_ids: `[R] int32`.
    logprobs: `LogprobsTensors` with `num_top_logprobs + 1` columns (zeros when no live row asked
      for logprobs).
    is_appended: `[R] bool` True where the token was appended to the row (a live row below
      `max_model_len`). A live row with False was already full: its token was drawn but dropped.
  """

  sampled_token_ids: jax.Array
  logprobs: LogprobsTensors
  is_appended: jax.Array


def row_step_keys(state: BatchState) -> tuple[jax.Array, jax.Array]:
  """Each row's key for this step `[R]` and its uniform draw `[R] float32` in [0, 1).

  The t-th output token of a request uses `fold_in(request_key, t)`: its stream depends on
  nothing but the request's seed (or serial) and how many tokens it has generated.
  """
  keys = jax.random.wrap_key_data(state.key_data)
  step_keys = jax.vmap(jax.random.fold_in)(keys, state.num_output_tokens.astype(jnp.uint32))
  return step_keys, jax.vmap(lambda key: jax.random.uniform(key, (), jnp.float32))(step_keys)


def sample_random_rows(
  x, md: SamplingMetadata, step_keys, u, budgets: tuple[int, ...], exact_top_p
):
  """Stages 8-12 for every row.

  A row keeps the tokens whose temperature-scaled logit `y = x / T` is `>=` its threshold. With
  `exact_top_p` (processed logprobs modes) every row's exact threshold is computed; otherwise
  top-p rows whose cut lies beyond the candidates are drawn by rejection and report their
  threshold before top-p. `y` is recomputed inside each branch that needs it, never passed
  between them, so it is not written out as one more `[R, V]` array.

  Returns:
    tokens `[R] int32`, the kept threshold `[R] float32` and each row's largest scaled logit
    `[R] float32` (`+inf` flags a row whose distribution is undefined; see `sample_step`).
  """
  rows = x.shape[0]
  inv_temperature = inverse_temperature(md)
  row_max = x.max(-1) * inv_temperature  # == max(y): scaling by a positive number is monotone
  # min_p (vLLM): drop p < min_p * max(p), i.e. y < max(y) + log(min_p).
  threshold = jnp.where(md.min_p > 0, row_max + jnp.log(md.min_p), NEG_INF)
  nothing = jnp.zeros((rows,), bool)
  cut, candidate_tokens = cut_and_draw(x, md, row_max, threshold, u, budgets)
  # Every filter keeps the most likely token; the clamp guards that against rounding.
  threshold, unresolved = jnp.minimum(cut.threshold, row_max), cut.top_p_unresolved
  if exact_top_p:
    y_fn = lambda: x * inv_temperature[:, None]
    threshold = lax.cond(
      unresolved.any(),
      lambda: jnp.where(
        unresolved, top_p_threshold(y_fn(), row_max, threshold, md.top_p), threshold
      ),
      lambda: threshold,
    )
    unresolved = nothing
  from_vocab = md.is_live & ~md.is_greedy & ~cut.in_candidates
  vocab_tokens = lax.cond(
    from_vocab.any(),
    lambda: draw_from_vocab(
      x, inv_temperature, row_max, threshold, u, md.top_p, unresolved, step_keys
    ),
    lambda: jnp.zeros((rows,), jnp.int32),
  )
  tokens = jnp.where(cut.in_candidates, candidate_tokens, vocab_tokens)
  return tokens.astype(jnp.int32), threshold, row_max


def draw_tokens(x, state: BatchState, md: SamplingMetadata):
  """Stages 7-12 on `drawable_logits` `x` (no NaN): `(tokens [R] int32, threshold [R], row_max [R])`."""
  rows = state.max_num_reqs
  greedy_tokens = lax.cond(
    md.any_greedy, lambda: blocked_argmax(x), lambda: jnp.zeros((rows,), jnp.int32)
  )
  random_tokens, threshold, row_max = lax.cond(
    md.any_random,
    lambda: sample_random_rows(
      x,
      md,
      *row_step_keys(state),
      state.config.candidate_budgets,
      exact_top_p=state.config.logprobs_mode.startswith("processed"),
    ),
    lambda: (jnp.zeros((rows,), jnp.int32), jnp.full((rows,), NEG_INF), jnp.zeros((rows,))),
  )
  return jnp.where(md.is_greedy, greedy_tokens, random_tokens), threshold, row_max


def _fallback_for_masked_rows(logits, state: BatchState) -> jax.Array:
  """`[R] int32` for rows whose every token was masked: the best allowed token by raw logit.

  `InputBatch` refuses requests whose constraints ban everything whatever they generate, so this
  happens only when a multi-token bad word completes the ban after some outputs (or when the
  model's logits are all -inf or NaN). The constraints cannot all be met then; allowed_token_ids
  still holds: the token is never outside the row's allowed set.
  """
  x = logits.astype(jnp.float32)
  finite = jnp.where(jnp.isneginf(x) | jnp.isnan(x), jnp.finfo(jnp.float32).min, x)
  return blocked_argmax(jnp.where(is_allowed(state), finite, NEG_INF))


def repair_degenerate_rows(logits, x, tokens, row_max, state: BatchState, md: SamplingMetadata):
  """Replaces the tokens of rows whose distribution is undefined (see `sample_step`).

  Args:
    logits: `[R, V]` the model's logits.
    x: `[R, V] float32` `drawable_logits` (no NaN).
    tokens: `[R] int32` the greedy or random draw of each row.
    row_max: `[R] float32` each random row's largest temperature-scaled logit.
    state, md: the batch state and metadata.

  Returns:
    `[R] int32` tokens, each in `[0, V)` and inside its row's allowed set: a row whose token is
    out of range or masked (`-inf`) gets `_fallback_for_masked_rows`; a random row whose largest
    scaled logit is `+inf` gets its first maximal processed token, as a greedy row would.
  """
  vocab = state.vocab_size
  value = sharded.take_along_vocab(x, jnp.clip(tokens, 0, vocab - 1)[:, None])[:, 0]
  unsampleable = md.is_live & ((tokens < 0) | (tokens >= vocab) | ~(value > NEG_INF))
  infinite = md.is_live & ~md.is_greedy & jnp.isposinf(row_max)

  def repair():
    fallback = jnp.where(unsampleable, _fallback_for_masked_rows(logits, state), tokens)
    return jnp.where(infinite, blocked_argmax(x), fallback)

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


def drawable_logits(logits, state: BatchState, md: SamplingMetadata) -> jax.Array:
  """Stages 1-6: `[R, V] float32` the processed logits, NaN read as `-inf`.

  One `lax.cond` on `any_processing`: the fused processing pass when a live row needs it, else a
  float32 copy of `logits` with NaN cleaned (for a step whose logits hold a NaN; `sample` reads
  the logits in place when `needs_drawable_copy` is False, and the speculative verifier always
  reads this).
  """
  return lax.cond(
    any_processing(md, state.config),
    lambda: apply_logits_processors(logits, state, md),  # NaN-free already
    lambda: nan_as_neg_inf(logits.astype(jnp.float32)),
  )


def needs_drawable_copy(logits, state: BatchState, md: SamplingMetadata) -> jax.Array:
  """`[] bool` whether the draw must read `drawable_logits` rather than `logits` in place.

  True when some live row uses stages 0-6 (`any_processing`) or a live row holds a NaN. The NaN
  test is one sum per row, run only when nothing is processed: a sum carries a NaN wherever it
  sits, while XLA:CPU's vectorised max reductions can drop a NaN together with the values before
  it in its lane, so a max (or argmax) over raw logits cannot be trusted to reveal one. A row
  holding both `+inf` and `-inf` also sums to NaN and takes the copy; that changes no token.
  """
  processing = any_processing(md, state.config)

  def any_nan_row():
    row_sums = logits.astype(jnp.float32).sum(-1)
    return (md.is_live & jnp.isnan(row_sums)).any()

  return lax.cond(processing, lambda: jnp.bool_(True), any_nan_row)


def _tokens_and_logprobs(logits, x, state: BatchState, md: SamplingMetadata, with_logprobs: bool):
  """Stages 7-12 (and 13 if `with_logprobs`) on `x`: `(tokens [R] int32, LogprobsTensors or
  None)`.

  Args:
    logits: `[R, V]` the model's logits.
    x: `[R, V] float32` without NaN: `drawable_logits`, or `logits` itself when
      `needs_drawable_copy` is False.
    state, md: the batch state and metadata.
    with_logprobs: static; False leaves stage 13 to the caller (`_logprobs`), which it may run
      outside this function when the logprobs mode does not read `x`.

  Every `lax.cond` here returns only `[R]`-sized or `[R, k]`-sized results: a branch that
  returned an `[R, V]` array unchanged would cost a copy.
  """
  if has_processors(state.config, argmax_invariant=True):
    # Greedy rows keep `x` bit for bit; random rows draw from, and processed_* logprobs report,
    # the values after these processors (vLLM applies them before its top-k / top-p sampler).
    x = nan_as_neg_inf(apply_invariant_processors(x, state, md, inverse_temperature(md)))
  tokens, threshold, row_max = draw_tokens(x, state, md)
  tokens = repair_degenerate_rows(logits, x, tokens, row_max, state, md)
  if not with_logprobs:
    return tokens, None
  return tokens, _logprobs(logits, x, threshold, tokens, state, md)


def _logprobs(logits, x, threshold, tokens, state: BatchState, md: SamplingMetadata):
  """Stage 13: `LogprobsTensors` (zeros unless a live row asked for logprobs).

  Args:
    logits: `[R, V]` the model's logits (the raw_* source).
    x: `[R, V] float32` the logits the draw read, or None in the raw_* modes (which never read it).
    threshold: `[R] float32` each row's kept threshold (None in the raw_* modes).
    tokens: `[R] int32` the sampled tokens.
    state, md: the batch state and metadata.
  """
  config = state.config

  def logprobs_branch():
    mode = config.logprobs_mode
    scores = logprobs_scores(logits, x, state, md, threshold, mode)
    return gather_logprobs(
      scores,
      tokens,
      config.num_top_logprobs,
      normalize=mode.endswith("logprobs"),
      fixed_order=config.batch_invariant,
    )

  no_logprobs = lambda: LogprobsTensors.zeros(state.max_num_reqs, config.num_top_logprobs)
  return lax.cond(md.any_logprobs, logprobs_branch, no_logprobs)


def sample(
  state: BatchState, metadata: SamplingMetadata, logits: jax.Array, mesh: Mesh | None = None
) -> tuple[BatchState, SamplerOutput]:
  """The body of `sample_step`, not jitted (for callers composing their own transformations).

  Same arguments, results and errors as `sample_step`, plus `mesh` (static): the
  ``("data", "model")`` mesh of logits sharded ``P("data", "model")`` (rows over ``data``, the
  vocabulary over ``model``). With a model axis above 1 that divides `V`, the vocabulary
  reductions run per shard and only per-row summaries cross devices
  (`jaxengine.sample.sharded`): the same tokens as one device, logprobs equal up to the
  rounding of their normaliser.
  """
  rows, vocab = state.max_num_reqs, state.vocab_size
  if logits.shape != (rows, vocab):
    raise ValueError(
      f"logits must have shape [max_num_reqs, vocab_size] = {(rows, vocab)}, got {logits.shape}"
    )
  with sharded.vocab_sharded(mesh, rows, vocab):
    return _sample(state, metadata, logits)


def _sample(state: BatchState, md: SamplingMetadata, logits: jax.Array):
  """`sample`'s pipeline (under `vocab_sharded` when on a mesh)."""
  config = state.config
  # processed_* logprobs read the logits the draw read; raw_* ones only `logits`, so they are
  # computed once, after the draw, whichever logits it read.
  inside = config.logprobs_mode.startswith("processed")
  copied = lambda: _tokens_and_logprobs(
    logits, drawable_logits(logits, state, md), state, md, inside
  )
  # Those processors write a new `[R, V]` array every step anyway; a copy this small costs less
  # than compiling stages 7-12 twice.
  if has_processors(config, argmax_invariant=True) or logits.size <= ALWAYS_COPIED_LOGITS:
    tokens, logprobs = copied()
  else:
    in_place = lambda: _tokens_and_logprobs(logits, logits.astype(jnp.float32), state, md, inside)
    tokens, logprobs = lax.cond(needs_drawable_copy(logits, state, md), copied, in_place)
  if logprobs is None:
    logprobs = _logprobs(logits, None, None, tokens, state, md)
  state, is_appended = _append_tokens(state, md, tokens)
  if state.config.logits_processors:
    states = update_processor_states(state, md, tokens, is_appended)
    state = dataclasses.replace(state, logits_processor_states=states)
  return state, SamplerOutput(sampled_token_ids=tokens, logprobs=logprobs, is_appended=is_appended)


@functools.partial(jax.jit, donate_argnames=("state",))
def sample_step(
  state: BatchState, metadata: SamplingMetadata, logits: jax.Array
) -> tuple[BatchState, SamplerOutput]:
  """Samples one token per row and appends it to the batch state (jitted, donates `state`).

  The pure function under `InputBatch.sample`, usable inside a caller's own `jax.jit` or
  `lax.scan` (e.g. an RL rollout loop that keeps `state` in its carry). It compiles once per
  `BatchConfig`; no per-request value or feature flag causes a recompile.

  Args:
    state: the batch state (donated: do not read it after the call).
    metadata: `SamplingMetadata` from `refresh_metadata(state, is_live)`; it depends only on the
      batch composition, so a loop without adds or removals reuses it for every step.
    logits: `[R, V]` float logits (any float dtype; computed in float32). Rows that hold no
      request are ignored.

  Returns:
    `(new_state, SamplerOutput)`: the state with each live row's sampled token appended (and
    counted for penalties), and device arrays over all rows: `sampled_token_ids [R] int32`,
    `logprobs` (`LogprobsTensors` with `num_top_logprobs + 1` columns; zeros when no live row
    asked for logprobs) and `is_appended [R] bool`.

  Full rows: a live row that already holds `max_model_len` tokens has nowhere to put a token.
  It is still sampled (from an unchanged key, as its output count does not grow), but nothing is
  appended: its `new_state.num_tokens` stays `max_model_len` and `is_appended` is False. A caller
  looping in `lax.scan` sees such rows by either sign and should mask them out (or end them);
  `InputBatch.sample` refuses to sample with such a row instead.

  Non-finite logits (the defined result; every token lies in `[0, V)` and in the row's allowed
  set whatever the logits hold):
    - a NaN logit counts as `-inf`: it is never sampled while the row has another token left
      (and the rows without NaN keep exactly the tokens they would have drawn);
    - a row whose largest (processed, temperature-scaled) logit is `+inf` takes its first `+inf`
      token, greedy or not;
    - a row with nothing left (every token `-inf`, NaN or masked) takes the best allowed token by
      raw logit (NaN and `-inf` as the lowest float), i.e. its first allowed token when none is
      finite.
  raw_* logprobs report the values as they are (a NaN logit gives NaN raw logprobs); the
  processed_* modes read a NaN as the `-inf` the draw saw.

  raw_* logprobs (the default mode) are the log-softmax of `logits` after one stage only: a live
  grammar row's bitmask, so a token the row's structured-output grammar forbids has logprob
  `-inf` and the distribution is renormalised over the allowed tokens (vLLM V1's order). A
  trainer recomputing them from its own forward pass must mask the same tokens (the grammar's
  allowed set at each position) before the log-softmax, and apply nothing else (no penalties,
  temperature, top-k/top-p, allowed_token_ids or logit_bias: those come after raw logprobs).

  Raises:
    ValueError: at trace time, if `logits` does not have shape `[R, V]`.
  """
  return sample(state, metadata, logits)
