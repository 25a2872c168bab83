"""Float64 NumPy reference of the per-row sampling pipeline (docs/sampling.md §1.1: order and math).

Written from the specification only. One row at a time, no vectorisation tricks, so that it can be
read against the spec line by line:

    allowed mask -> bad words -> min_tokens -> logit_bias -> repetition -> frequency -> presence
    -> greedy argmax -> temperature -> min_p -> top-k -> top-p -> (draw)

Documented choices the tests rely on (docs/sampling.md, the README):

* top-k keeps every token whose value is >= the k-th largest value (all ties at the cut are kept).
* top-p keeps token t iff the probability mass of the tokens whose value is *strictly greater* than
  t's value is < p (smallest descending prefix with mass >= p, plus every token tied with the last
  kept one).
* processed_* modes report the final filtered logits (masked entries -inf); for greedy rows that is
  the post-penalty logits (no temperature, no min_p/top-k/top-p).

Because the implementation runs in float32, a decision that sits within a hair of a threshold may go
either way there. The reference therefore also reports `ambiguous` reasons (non-empty => a test
should not insist on exact masks for that row) and, for greedy rows, the set of near-maximal tokens.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

EPS = 1e-5  # sampling epsilon: temperature < EPS means greedy
MIN_TEMPERATURE = 0.01  # 0 < T < 0.01 is raised to 0.01 (docs/sampling.md §2.1)
# Relative/absolute distance to a threshold under which float32 vs float64 may disagree.
THRESHOLD_TOL = 1e-4
# Tokens whose reference log-probability is below this may underflow to probability 0 in float32;
# tests treat them as "don't care" for the -inf mask comparison.
UNDERFLOW_LOGPROB = -80.0


@dataclasses.dataclass
class RowResult:
  """Everything a test may want to compare for one row.

  Attributes:
    penalized: [V] float64 logits after allowed/bad-words/min_tokens/bias/penalties (-inf = masked).
    final: [V] float64 the values the random draw uses: penalized / T, then min_p, top-k, top-p
      masks. For greedy rows this equals `penalized` (processed modes report it).
    probs: [V] float64 the final sampling distribution (greedy: one-hot on `greedy_token`).
    is_greedy: temperature (after normalisation) < EPS.
    greedy_token: first maximal index of `penalized` (None if the row is fully masked).
    greedy_candidates: tokens within tolerance of the maximum of `penalized`.
    greedy_ties_genuine: all greedy candidates are exact ties produced by identical inputs (then the
      first index must win).
    all_masked: every entry of `penalized` is -inf.
    ambiguous: reasons why float32 may legitimately differ on some mask decision.
  """

  penalized: np.ndarray
  final: np.ndarray
  probs: np.ndarray
  is_greedy: bool
  greedy_token: int | None
  greedy_candidates: frozenset
  greedy_ties_genuine: bool
  all_masked: bool
  ambiguous: list

  @property
  def processed_logprobs(self) -> np.ndarray:
    return log_softmax(self.final)

  @property
  def processed_logits(self) -> np.ndarray:
    return self.final


def log_softmax(v: np.ndarray) -> np.ndarray:
  """log_softmax in float64 with -inf entries kept at -inf; all -inf -> all nan."""
  v = np.asarray(v, dtype=np.float64)
  finite = np.isfinite(v)
  if not finite.any():
    return np.full_like(v, np.nan)
  m = v[finite].max()
  lse = m + math.log(np.exp(v[finite] - m).sum())
  return v - lse


def softmax(v: np.ndarray) -> np.ndarray:
  lp = log_softmax(v)
  return np.where(np.isfinite(lp), np.exp(lp), 0.0)


def normalize_temperature(t: float) -> float:
  """SamplingParams rule: 0 < T < 0.01 -> 0.01."""
  if 0.0 < t < MIN_TEMPERATURE:
    return MIN_TEMPERATURE
  return float(t)


def _clusters(values: np.ndarray, tol: float) -> list[list[int]]:
  """Groups finite entries whose values are chained within `tol` (relative to magnitude)."""
  idx = [int(i) for i in np.argsort(-values, kind="stable") if np.isfinite(values[i])]
  groups: list[list[int]] = []
  for i in idx:
    if groups:
      j = groups[-1][-1]
      if abs(values[j] - values[i]) <= tol * max(1.0, abs(values[i])):
        groups[-1].append(i)
        continue
    groups.append([i])
  return groups


def reference_row(
  logits: Sequence[float],
  *,
  prompt: Sequence[int] = (),
  outputs: Sequence[int] = (),
  eos_token_ids: Iterable[int] = (),
  temperature: float = 1.0,
  top_p: float = 1.0,
  top_k: int = 0,
  min_p: float = 0.0,
  presence_penalty: float = 0.0,
  frequency_penalty: float = 0.0,
  repetition_penalty: float = 1.0,
  logit_bias: Mapping[int, float] | None = None,
  allowed_token_ids: Sequence[int] | None = None,
  bad_words_token_ids: Sequence[Sequence[int]] | None = None,
  min_tokens: int = 0,
  stop_token_ids: Sequence[int] | None = None,
  **_ignored: Any,
) -> RowResult:
  """Runs one row through the HEAD pipeline in float64 (docs/sampling.md §1.1).

  Args are the user-facing SamplingParams values (before any normalisation) plus the row's prompt
  and generated-so-far output tokens. Unknown keyword arguments (seed, logprobs, max_tokens, ...)
  are ignored because they do not change the distribution.
  """
  x = np.asarray(logits, dtype=np.float32).astype(np.float64)  # the model gives float32
  V = x.shape[0]
  outputs = [int(t) for t in outputs]
  prompt = [int(t) for t in prompt]
  bias = dict(logit_bias or {})

  # Normalisation done by SamplingParams (docs/sampling.md §2.1).
  temperature = normalize_temperature(temperature)
  is_greedy = temperature < EPS
  if is_greedy:
    top_p, top_k, min_p = 1.0, 0, 0.0

  # (a) allowed_token_ids
  if allowed_token_ids is not None:
    allowed = np.zeros(V, dtype=bool)
    allowed[list(allowed_token_ids)] = True
    x[~allowed] = -np.inf
  # (b) bad words: output tokens only.
  for word in bad_words_token_ids or ():
    word = list(word)
    prefix = word[:-1]
    if len(prefix) <= len(outputs) and (
      not prefix or outputs[len(outputs) - len(prefix) :] == prefix
    ):
      x[word[-1]] = -np.inf
  # (c) min_tokens: stop ids U eos ids while too few outputs.
  if len(outputs) < min_tokens:
    for s in set(stop_token_ids or ()) | set(eos_token_ids):
      x[s] = -np.inf
  # (d) logit bias (adding to -inf stays -inf).
  for t, b in bias.items():
    x[t] += b
  # (e) repetition over prompt U outputs, then frequency and presence over outputs.
  counts = np.bincount(np.asarray(outputs, dtype=np.int64), minlength=V).astype(np.float64)
  seen = np.zeros(V, dtype=bool)
  seen[prompt] = True
  seen[outputs] = True
  r = float(repetition_penalty)
  if r != 1.0:
    pos = x > 0
    x = np.where(seen & pos, x / r, np.where(seen, x * r, x))
  x = x - float(frequency_penalty) * counts - float(presence_penalty) * (counts > 0)
  penalized = x.copy()

  # Signature of how each token's value was produced: equal signatures => exact float32 ties too.
  raw = np.asarray(logits, dtype=np.float32)
  sig = [
    (
      float(raw[t]),
      bias.get(t, 0.0),
      bool(seen[t]) if r != 1.0 else False,
      counts[t] if frequency_penalty != 0.0 else 0,
      counts[t] > 0 if presence_penalty != 0.0 else False,
    )
    for t in range(V)
  ]

  ambiguous: list[str] = []
  all_masked = not np.isfinite(penalized).any()

  # Greedy argmax (first maximal index).
  if all_masked:
    greedy_token, cands, genuine = None, frozenset(), True
  else:
    mx = penalized[np.isfinite(penalized)].max()
    greedy_token = int(np.argmax(penalized))
    tol = THRESHOLD_TOL * max(1.0, abs(mx))
    cands = frozenset(int(t) for t in np.nonzero(penalized >= mx - tol)[0])
    genuine = len({sig[t] for t in cands}) == 1

  if is_greedy or all_masked:
    final = penalized.copy()
    probs = np.zeros(V)
    if greedy_token is not None:
      probs[greedy_token] = 1.0
    return RowResult(
      penalized, final, probs, is_greedy, greedy_token, cands, genuine, all_masked, ambiguous
    )

  # Temperature.
  y = penalized / temperature
  # min_p: mask p_t < min_p * max(p)  <=>  y_t - y_max < ln(min_p).
  if min_p > 0.0:
    ymax = y[np.isfinite(y)].max()
    cut = math.log(min_p)
    d = y - ymax
    for t in np.nonzero(np.isfinite(y))[0]:
      if abs(d[t] - cut) <= THRESHOLD_TOL * max(1.0, abs(cut)) and d[t] != 0.0:
        ambiguous.append(f"min_p boundary at token {t}")
    y = np.where(np.isfinite(y) & (d < cut), -np.inf, y)
  # top-k: keep y >= k-th largest (ties kept).
  if 0 < top_k < V:
    kth = np.sort(y)[::-1][top_k - 1]
    if np.isfinite(kth):
      for group in _clusters(y, THRESHOLD_TOL):
        vals = [y[t] for t in group]
        if (
          min(vals) - THRESHOLD_TOL * max(1.0, abs(kth))
          <= kth
          <= max(vals) + THRESHOLD_TOL * max(1.0, abs(kth))
        ) and len({sig[t] for t in group}) > 1:
          ambiguous.append(f"top-k near-tie at the cut: tokens {group}")
      y = np.where(y < kth, -np.inf, y)
  # top-p: keep t iff mass of strictly larger values < p.
  if top_p < 1.0:
    q = softmax(y)
    finite = np.isfinite(y)
    above = np.array([q[y > y[t]].sum() if finite[t] else 1.0 for t in range(V)])
    for t in np.nonzero(finite)[0]:
      if abs(above[t] - top_p) <= THRESHOLD_TOL:
        ambiguous.append(f"top-p boundary at token {t}")
    for group in _clusters(y, THRESHOLD_TOL):
      if len({sig[t] for t in group}) > 1:
        lo = min(above[t] for t in group)
        hi = lo + sum(q[t] for t in group)
        if lo - THRESHOLD_TOL < top_p < hi + THRESHOLD_TOL:
          ambiguous.append(f"top-p near-tie at the cut: tokens {group}")
    y = np.where(finite & (above >= top_p), -np.inf, y)

  final = y
  probs = softmax(final)
  return RowResult(
    penalized, final, probs, is_greedy, greedy_token, cands, genuine, all_masked, ambiguous
  )


# --------------------------------------------------------------------------------------------------
# Helpers for reading the implementation's logprob output.


def full_row_from_logprobs(
  token_ids: np.ndarray, values: np.ndarray, vocab_size: int
) -> np.ndarray:
  """Rebuilds a row's whole-vocabulary vector from columns 1..V of a logprobs output row.

  Asserts the columns are a permutation of the vocabulary in non-increasing value order.
  """
  ids = np.asarray(token_ids[1:], dtype=np.int64)
  vals = np.asarray(values[1:], dtype=np.float64)
  assert ids.shape == (vocab_size,), f"expected {vocab_size} top-k columns, got {ids.shape}"
  assert sorted(ids.tolist()) == list(range(vocab_size)), f"top-V ids are not a permutation: {ids}"
  if np.isnan(vals).all():  # a fully masked row in a processed mode: log_softmax of all -inf
    return np.full(vocab_size, np.nan)
  fin = np.where(np.isneginf(vals), -np.inf, vals)
  assert np.all(fin[:-1] >= fin[1:]), f"top-k values not descending: {vals}"
  vec = np.empty(vocab_size)
  vec[ids] = vals
  return vec


def assert_rows_match(got: np.ndarray, want: np.ndarray, *, atol: float = 1e-4, context: str = ""):
  """Same -inf mask (ignoring tokens that may underflow in float32) and values within atol."""
  got = np.asarray(got, dtype=np.float64)
  want = np.asarray(want, dtype=np.float64)
  assert not np.isnan(got).any(), f"{context}: NaN in implementation row {got}"
  dont_care = np.isfinite(want) & (
    want - np.nanmax(np.where(np.isfinite(want), want, np.nan)) < UNDERFLOW_LOGPROB
  )
  mask_g = np.isneginf(got) & ~dont_care
  mask_w = np.isneginf(want) & ~dont_care
  assert np.array_equal(mask_g, mask_w), (
    f"{context}: -inf masks differ at tokens {np.nonzero(mask_g != mask_w)[0].tolist()}\n"
    f"got  {got}\nwant {want}"
  )
  both = np.isfinite(got) & np.isfinite(want)
  np.testing.assert_allclose(got[both], want[both], atol=atol, rtol=1e-5, err_msg=context)


def rank_of(values: np.ndarray, token: int) -> int:
  """Number of entries whose value is >= the token's value (ties count against the token)."""
  values = np.asarray(values, dtype=np.float64)
  return int(np.sum(values >= values[token]))
