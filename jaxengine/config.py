"""`BatchConfig`: the one validated configuration of the persistent batch and its sampler.

Every value here is a compile-time constant: an array extent, a list capacity or a static sampler
setting. It is built (and checked) once, frozen and hashable, so it can ride in `BatchState` as a
static pytree field; `InputBatch` builds it from its arguments, and an engine can build it once and
hand it to `InputBatch.from_config`. Per-request values never live here: they are traced arrays.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxengine.params import validate_logprobs_mode

#: Candidate budget of the sorting-free top-k / top-p path (see `jaxengine.sample.filters`).
DEFAULT_NUM_TOPK_CANDIDATES = 64
#: Larger budgets for rows whose top_k exceeds it (see `jaxengine.sample.budgets`).
DEFAULT_DEEP_CANDIDATE_BUDGETS = (256, 1024)
#: Draft tokens per row `InputBatch.rejection_sample` verifies at most (speculative decoding).
DEFAULT_MAX_SPEC_LEN = 4
#: Largest `max_spec_len` (vLLM's bound on speculative tokens per step).
MAX_SPEC_LEN_LIMIT = 128


def _is_positive_int(value) -> bool:
  return bool(isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchConfig:
  """Capacities and static settings of a persistent batch (`R`, `S`, `V` of the shape legend).

  Attributes:
    max_num_reqs: `R`, rows (requests that can run at once).
    max_model_len: `S`, maximum prompt plus output tokens of a request.
    vocab_size: `V`, width of the logits.
    max_num_logprobs: largest `logprobs` / `prompt_logprobs` a request may ask for (vLLM's
      `max_logprobs`); `-1` (or any value >= `V`) allows the whole vocabulary, which makes
      every step with logprobs a full sort of each row: keep it for small vocabularies or
      analysis.
    logprobs_mode: what logprobs report: "raw_logprobs" (log-softmax of the model's logits),
      "raw_logits", "processed_logprobs" or "processed_logits" (after every processor,
      temperature and filter: the distribution the token was drawn from; masked tokens -inf).
    max_num_stop_token_ids: capacity of a request's min_tokens stop set (its stop_token_ids plus
      the batch's EOS ids).
    max_num_logit_bias: capacity of a request's logit_bias entries.
    max_num_bad_words: capacity of a request's bad_words_token_ids sequences.
    max_bad_word_len: longest banned sequence, in tokens.
    num_topk_candidates: `C`, per-row candidate budget of the sorting-free top-k / top-p path
      (the shallow list, computed whenever some row filters). At most `V` in effect (see
      `num_candidates`).
    deep_candidate_budgets: larger budgets for rows whose top_k exceeds `num_topk_candidates`:
      such a row reads its cut off the smallest budget that holds its top_k, and a step pays for
      the largest budget its rows need (`candidate_budgets` has the budgets in effect). A top_k
      beyond all of them is found by an exact bisection over the row (about 32 masked passes).
      `()` turns the deep lists off.
    max_spec_len: `P`, draft tokens per row `InputBatch.rejection_sample` verifies at most
      (speculative decoding; vLLM's `num_speculative_tokens`), an int in `[0, 128]`. Its target
      logits are `[R, P + 1, V]`: one executable per `(max_num_reqs, max_spec_len)`. Only the
      rejection sampler reads it.
    batch_invariant: normalise logprobs with `jaxengine.reductions.fixed_logsumexp`, whose order
      does not depend on the number of rows (the engine's ``batch_invariant=True``; it also runs
      the sampler at one row count). Default False: `jax.nn.logsumexp`.
    logits_processors: the batch's `jaxengine.LogitsProcessor` instances, in order (static: the
      processors' code is part of the compiled step; their per-row values are traced state).

  Raises:
    ValueError: naming the field and value, for a capacity that is not a positive int (bools
      refused), `max_num_logprobs` below -1, `max_spec_len` outside `[0, 128]`, or an unknown
      `logprobs_mode`.
  """

  max_num_reqs: int
  max_model_len: int
  vocab_size: int
  max_num_logprobs: int = 20
  logprobs_mode: str = "raw_logprobs"
  max_num_stop_token_ids: int = 32
  max_num_logit_bias: int = 128
  max_num_bad_words: int = 32
  max_bad_word_len: int = 16
  num_topk_candidates: int = DEFAULT_NUM_TOPK_CANDIDATES
  deep_candidate_budgets: tuple[int, ...] = DEFAULT_DEEP_CANDIDATE_BUDGETS
  max_spec_len: int = DEFAULT_MAX_SPEC_LEN
  logits_processors: tuple = ()
  batch_invariant: bool = False

  def __post_init__(self):
    for field in dataclasses.fields(self):
      if field.name in (
        "max_num_logprobs",
        "logprobs_mode",
        "deep_candidate_budgets",
        "max_spec_len",
        "logits_processors",
        "batch_invariant",
      ):
        continue
      value = getattr(self, field.name)
      if not _is_positive_int(value):
        raise ValueError(f"{field.name} must be a positive int, got {value!r}")
      object.__setattr__(self, field.name, int(value))  # NumPy ints hash and print as ints
    logprobs = self.max_num_logprobs
    if isinstance(logprobs, bool) or not isinstance(logprobs, (int, np.integer)) or logprobs < -1:
      raise ValueError(f"max_num_logprobs must be >= 0 or -1 (whole vocabulary), got {logprobs!r}")
    object.__setattr__(self, "max_num_logprobs", int(logprobs))
    validate_logprobs_mode(self.logprobs_mode)
    spec = self.max_spec_len
    is_count = isinstance(spec, (int, np.integer)) and not isinstance(spec, bool)
    if not is_count or not 0 <= spec <= MAX_SPEC_LEN_LIMIT:
      raise ValueError(f"max_spec_len must be an int in [0, {MAX_SPEC_LEN_LIMIT}], got {spec!r}")
    object.__setattr__(self, "max_spec_len", int(spec))
    budgets = self.deep_candidate_budgets
    if isinstance(budgets, (str, bytes)) or not isinstance(budgets, (tuple, list)):
      raise ValueError(f"deep_candidate_budgets must be a tuple of positive ints, got {budgets!r}")
    if not all(_is_positive_int(budget) for budget in budgets):
      raise ValueError(f"deep_candidate_budgets must be a tuple of positive ints, got {budgets!r}")
    object.__setattr__(self, "deep_candidate_budgets", tuple(int(b) for b in budgets))
    object.__setattr__(self, "logits_processors", tuple(self.logits_processors))
    if not isinstance(self.batch_invariant, (bool, np.bool_)):
      raise ValueError(f"batch_invariant must be a bool, got {self.batch_invariant!r}")
    object.__setattr__(self, "batch_invariant", bool(self.batch_invariant))

  @property
  def num_top_logprobs(self) -> int:
    """Top entries the sampler computes per row when some row wants logprobs (static): the
    largest request allowed, `V` for the whole vocabulary."""
    if self.max_num_logprobs == -1:
      return self.vocab_size
    return min(self.max_num_logprobs, self.vocab_size)

  @property
  def num_candidates(self) -> int:
    """`C`, the candidate budget in effect: `num_topk_candidates`, at most `V`."""
    return min(self.num_topk_candidates, self.vocab_size)

  @property
  def candidate_budgets(self) -> tuple[int, ...]:
    """The budgets in effect, ascending: `num_candidates`, then each deep budget above it (each
    at most `V`, duplicates dropped). A row's candidate level indexes this tuple."""
    shallow = self.num_candidates
    deep = {min(budget, self.vocab_size) for budget in self.deep_candidate_budgets}
    return (shallow, *sorted(budget for budget in deep if budget > shallow))

  def replace(self, **changes) -> BatchConfig:
    """A copy with `changes` applied (validated again)."""
    return dataclasses.replace(self, **changes)
