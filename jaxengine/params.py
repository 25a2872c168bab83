"""Per-request sampling parameters, validated on the host.

`SamplingParams` mirrors vLLM V1's class of the same name (field names, defaults, sentinels and
validation rules as of vLLM HEAD, early 2026; see `docs/sampling.md` §2). Construction
normalises and validates every field and raises `ValueError` naming the field and the offending
value. As vLLM's, its fields may be assigned afterwards (``sp.max_tokens = 20``); an assignment
is not checked then, but the engine takes a copy of the parameters when a request is added
(`SamplingParams.validated_copy`), normalised and validated again as at construction, so a bad
value is a `ValueError` there, before any device work, and a later assignment never reaches a
request already added. Checks that need the batch (token ids against the vocabulary, lists
against the batch's capacities) happen in `InputBatch.add_request`.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import math
import warnings
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

#: Temperatures below this are greedy (vLLM's sampling epsilon).
SAMPLING_EPS = 1e-5
#: Positive temperatures below this are raised to it, with a warning (vLLM behaviour).
MIN_TEMPERATURE = 1e-2

#: Seeds are taken as 64-bit integers: `[SEED_MIN, SEED_MAX)` maps one-to-one onto the key words.
SEED_MIN, SEED_MAX = -(2**63), 2**63

_LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


class RequestOutputKind(enum.Enum):
  """What a request's outputs hold while it runs (vLLM's `RequestOutputKind`, in
  `SamplingParams.output_kind`).

  CUMULATIVE: every output holds everything so far (the default). DELTA: only the text, token
  ids and logprobs added since the previous output (`AsyncLLM.generate` streams these;
  `LLMEngine.add_request` refuses it, its `step` returning cumulative outputs). FINAL_ONLY: one
  output, once the request has finished (`LLMEngine.step` leaves the request out until then;
  `LLM.generate` always returns final outputs, whatever the kind, as vLLM's).
  """

  CUMULATIVE = 0
  DELTA = 1
  FINAL_ONLY = 2


def is_int(value) -> bool:
  """True for Python and NumPy integers, False for bools and everything else."""
  return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _as_int_tuple(field: str, values: Sequence[int] | None) -> tuple[int, ...] | None:
  if values is None:
    return None
  if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
    raise ValueError(f"{field} must be a sequence of ints, got {values!r}")
  values = tuple(values)
  for value in values:
    if not is_int(value):
      raise ValueError(f"{field} must contain ints, got {value!r}")
  return tuple(int(v) for v in values)


def _as_str_tuple(field: str, values: str | Sequence[str] | None) -> tuple[str, ...] | None:
  """One string or an iterable of them as a tuple (the items are checked by `_validate`).

  Raises:
    ValueError: naming `field`, for a value that is neither a string nor iterable (`stop=5`).
  """
  if values is None:
    return None
  if isinstance(values, str):
    return (values,)
  if isinstance(values, bytes) or not isinstance(values, Iterable):
    raise ValueError(f"{field} must be a string or a list of strings, got {values!r}")
  return tuple(values)


def child_seed(seed: int, index: int) -> int:
  """The seed of sample `index` of a seeded request with `n > 1`: `seed + index`, wrapped into
  `[-2**63, 2**63)` (two's complement), so it is always a valid seed.

  The key uses a seed modulo 2**64, so the wrapped seed draws exactly the stream `seed + index`
  would; `seed=2**63 - 1, n=2` gives samples seeded `2**63 - 1` and `-2**63`.
  """
  return (seed + index - SEED_MIN) % 2**64 + SEED_MIN


@dataclasses.dataclass(kw_only=True)
class SamplingParams:
  """Sampling parameters of one request (vLLM V1 names, defaults and sentinels).

  Construction normalises and validates every field. Fields may be assigned afterwards, as in
  vLLM (``sp = llm.get_default_sampling_params(); sp.max_tokens = 20``); an assigned value is
  checked when a request is added with these parameters: the engine (`LLMEngine.add_request`,
  `LLM.generate`, `AsyncLLM.generate`) takes its own copy, normalised and validated as a new
  `SamplingParams` would be (`validated_copy`), so a bad value is a `ValueError` naming the
  field there, before any device work, and changing the parameters later never changes a
  request already added. Not hashable (mutable, as vLLM's).

  Attributes:
    n: Number of completions to return for the prompt (engine level). Child `j` of a seeded
      request gets the seed `seed + j` (as vLLM), wrapped into `[-2**63, 2**63)`: see
      `child_seed`. Must be 1 for greedy requests.
    temperature: Softmax temperature, `>= 0` and finite. `0` means greedy; a positive value
      below 0.01 is raised to 0.01 with a warning (vLLM does the same), so 1e-6 samples at 0.01,
      not greedily.
    top_p: Nucleus mass in `(0, 1]`; `1.0` disables. Keeps the smallest set of most likely tokens
      whose probability mass reaches `top_p`, plus every token tied with the last one kept.
    top_k: Keep the tokens whose logit is at least the k-th largest (ties kept); `0` or `-1`
      disables, as does any value `>= vocab_size`.
    min_p: In `[0, 1]`; drops tokens whose probability is below `min_p * max_probability`;
      `0` disables.
    presence_penalty: In `[-2, 2]`; subtracted once from the logit of every token present in the
      output so far. `0` disables.
    frequency_penalty: In `[-2, 2]`; subtracted per occurrence of a token in the output so far.
      `0` disables.
    repetition_penalty: `> 0` and finite; logits of tokens seen in the prompt or output are
      divided by it when positive and multiplied by it otherwise. `1` disables.
    seed: Per-request random seed, an int in `[-2**63, 2**63)` (`-1` means None; distinct seeds
      in that range give distinct random streams, so anything outside it is refused). A seeded
      request's tokens depend only on the seed, its logits and how many tokens it has generated,
      never on its batch slot or neighbours.
    max_tokens: Maximum number of generated tokens, `>= 1`, or None for "until max_model_len".
    min_tokens: Generate at least this many tokens before EOS / stop ids may be produced; `>= 0`
      and `<= max_tokens`. Must be 0 with `structured_outputs` (a finished grammar allows only
      EOS, which min_tokens would forbid).
    stop: Stop strings (engine level, matched on detokenized text). Must not contain "".
    stop_token_ids: Token ids that end generation (kept in the output), masked while fewer than
      `min_tokens` tokens have been generated.
    bad_words: Words that must never be generated (engine level: tokenized by the engine into
      `bad_words_token_ids`).
    bad_words_token_ids: Token-id sequences that must never appear in the output: when the last
      `len(seq) - 1` output tokens equal `seq[:-1]`, token `seq[-1]` is masked.
    include_stop_str_in_output: Keep a matched stop string in the returned text.
    ignore_eos: Do not stop at EOS (engine level). A finished `structured_outputs` constraint
      still ends the request on its EOS (finish_reason "stop"): the grammar allows nothing more.
    skip_special_tokens: Drop special tokens when detokenizing (engine level).
    logprobs: Number of top log-probabilities to return per generated token besides the sampled
      token's own: None (off), `0` (sampled token only), `0 < k <= V`, or `-1` (the whole
      vocabulary, counted as `V` against the batch's `max_num_logprobs`, as in vLLM: allowed
      when that is -1 or at least `V`). `True` means 1 (as in vLLM); `False` is refused
      (ambiguous: pass None or 0).
    prompt_logprobs: Same, for each prompt token (engine level; computed from the prefill logits,
      always the raw log-softmax whatever the logprobs mode, as in vLLM).
    logit_bias: `{token_id: bias}` added to the logits before penalties; biases must be finite.
    allowed_token_ids: If not None, every other token is masked. Must not be empty.
    extra_args: Free-form options for your own logits processors (a dict, read by their
      `row_state`), as vLLM's `extra_args`.
    structured_outputs: A `StructuredOutputsParams`: constrain the output to a JSON schema, a
      regex, a choice or a grammar (engine level; needs a tokenizer). Cannot be combined with
      `min_tokens > 0`; a sampled token the grammar rejects (another constraint such as
      `allowed_token_ids` or a logits processor left nothing the grammar allows) is dropped and
      ends the request with finish_reason "abort", with a warning.
    output_kind: a `RequestOutputKind`: what the request's outputs hold while it runs
      (CUMULATIVE, the default; DELTA; FINAL_ONLY). `AsyncLLM.generate` streams accordingly;
      `LLMEngine.step` honours CUMULATIVE and FINAL_ONLY and `LLMEngine.add_request` refuses
      DELTA; `LLM.generate` returns final outputs whatever the kind (as vLLM).
    max_staleness: asynchronous RL's staleness bound (no vLLM field): None (default) disables
      it; K >= 0 aborts the request (finish_reason "abort", with the tokens it had) when a
      weight load or `resume_generation` finds its oldest generated token K + 1 or more weight
      versions behind the engine's (`jaxengine/engine/pause.py`).

  Raises:
    ValueError: On construction (and when the engine takes its copy), for any out-of-range
      value (every float field refuses NaN and infinities); the message names the field.
  """

  n: int = 1
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  min_p: float = 0.0
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  repetition_penalty: float = 1.0
  seed: int | None = None
  max_tokens: int | None = 16
  min_tokens: int = 0
  stop: tuple[str, ...] | None = None
  stop_token_ids: tuple[int, ...] | None = None
  bad_words: tuple[str, ...] | None = None
  bad_words_token_ids: tuple[tuple[int, ...], ...] | None = None
  include_stop_str_in_output: bool = False
  ignore_eos: bool = False
  skip_special_tokens: bool = True
  logprobs: int | None = None
  prompt_logprobs: int | None = None
  logit_bias: Mapping[int, float] | None = None
  allowed_token_ids: tuple[int, ...] | None = None
  extra_args: dict | None = None
  structured_outputs: StructuredOutputsParams | None = None
  output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
  max_staleness: int | None = None

  def __post_init__(self):
    set_ = lambda name, value: setattr(self, name, value)
    # vLLM's order: clamp tiny temperature, seed -1 -> None, normalise lists, True -> 1,
    # validate, then reset the knobs greedy sampling ignores.
    _check_number("temperature", self.temperature)
    if 0 < self.temperature < MIN_TEMPERATURE:
      warnings.warn(
        f"temperature {self.temperature} is below {MIN_TEMPERATURE}; using {MIN_TEMPERATURE}",
        stacklevel=3,
      )
      set_("temperature", MIN_TEMPERATURE)
    if self.seed == -1:
      set_("seed", None)
    set_("stop", _as_str_tuple("stop", self.stop))
    set_("bad_words", _as_str_tuple("bad_words", self.bad_words))
    set_("stop_token_ids", _as_int_tuple("stop_token_ids", self.stop_token_ids))
    set_("allowed_token_ids", _as_int_tuple("allowed_token_ids", self.allowed_token_ids))
    if self.bad_words_token_ids is not None:
      if isinstance(self.bad_words_token_ids, (str, bytes)) or not isinstance(
        self.bad_words_token_ids, Iterable
      ):
        raise ValueError(
          f"bad_words_token_ids must be a list of token-id sequences, got "
          f"{self.bad_words_token_ids!r}"
        )
      set_(
        "bad_words_token_ids",
        tuple(_as_int_tuple("bad_words_token_ids", seq) for seq in self.bad_words_token_ids),
      )
    if self.logit_bias is not None:
      set_("logit_bias", _normalise_logit_bias(self.logit_bias))
    for name in ("logprobs", "prompt_logprobs"):  # vLLM's True -> 1; False is ambiguous
      if getattr(self, name) is True:
        set_(name, 1)
      elif getattr(self, name) is False:
        raise ValueError(f"{name} must be None (off) or an int (0: sampled token only), got False")
    self._validate()
    if self.temperature < SAMPLING_EPS:
      set_("top_p", 1.0)
      set_("top_k", 0)
      set_("min_p", 0.0)

  def _validate(self):
    _check_int("n", self.n)
    if self.n < 1:
      raise ValueError(f"n must be at least 1, got {self.n}")
    if self.temperature < 0:
      raise ValueError(f"temperature must be non-negative, got {self.temperature}")
    _check_number("top_p", self.top_p)
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
    _check_int("top_k", self.top_k)
    if self.top_k < -1:
      raise ValueError(f"top_k must be -1 (disable), 0 (disable), or at least 1, got {self.top_k}")
    _check_number("min_p", self.min_p)
    if not 0.0 <= self.min_p <= 1.0:
      raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
    for name in ("presence_penalty", "frequency_penalty"):
      value = getattr(self, name)
      _check_number(name, value)
      if not -2.0 <= value <= 2.0:
        raise ValueError(f"{name} must be in [-2, 2], got {value}")
    _check_number("repetition_penalty", self.repetition_penalty)
    if not self.repetition_penalty > 0.0:
      raise ValueError(
        f"repetition_penalty must be greater than zero, got {self.repetition_penalty}"
      )
    if self.seed is not None:
      _check_int("seed", self.seed)
      if not SEED_MIN <= self.seed < SEED_MAX:
        raise ValueError(
          f"seed must be in [-2**63, 2**63) (distinct seeds there give distinct random "
          f"streams), got {self.seed}"
        )
    if self.max_tokens is not None:
      _check_int("max_tokens", self.max_tokens)
      if self.max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
    _check_int("min_tokens", self.min_tokens)
    if self.min_tokens < 0:
      raise ValueError(f"min_tokens must be greater than or equal to 0, got {self.min_tokens}")
    if self.max_tokens is not None and self.min_tokens > self.max_tokens:
      raise ValueError(
        f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
        f"got {self.min_tokens}"
      )
    for name in ("logprobs", "prompt_logprobs"):
      value = getattr(self, name)
      if value is not None:
        _check_int(name, value)
        if value < -1:
          raise ValueError(f"{name} must be non-negative or -1 (whole vocabulary), got {value}")
    if self.stop is not None:
      for s in self.stop:
        if not isinstance(s, str) or not s:
          raise ValueError(
            f"stop cannot contain an empty string or a non-string, got {self.stop!r}"
          )
    if self.bad_words is not None:
      for word in self.bad_words:
        if not isinstance(word, str) or not word.strip():
          raise ValueError(
            f"bad_words must be non-empty strings (not only whitespace), got {word!r}"
          )
    if self.bad_words_token_ids is not None:
      for seq in self.bad_words_token_ids:
        if not seq:
          raise ValueError(
            f"bad_words_token_ids cannot contain an empty sequence, got "
            f"{self.bad_words_token_ids!r}"
          )
    if self.allowed_token_ids is not None and not self.allowed_token_ids:
      raise ValueError("allowed_token_ids is not None and empty!")
    if self.temperature < SAMPLING_EPS and self.n > 1:
      raise ValueError(f"n must be 1 when using greedy sampling (temperature 0), got n={self.n}")
    if self.extra_args is not None and not isinstance(self.extra_args, Mapping):
      raise ValueError(f"extra_args must be a dict or None, got {self.extra_args!r}")
    so = self.structured_outputs
    if so is not None and not isinstance(so, StructuredOutputsParams):
      raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got {so!r}")
    if not isinstance(self.output_kind, RequestOutputKind):
      raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
    staleness = self.max_staleness
    if staleness is not None and (not is_int(staleness) or staleness < 0):
      raise ValueError(f"max_staleness must be None or an int >= 0, got {staleness!r}")
    if so is not None and self.min_tokens > 0:
      raise ValueError(
        f"min_tokens={self.min_tokens} cannot be combined with structured_outputs: a finished "
        "grammar allows only EOS, which min_tokens forbids (use min_tokens=0)"
      )

  @property
  def is_greedy(self) -> bool:
    """True when the request samples greedily (temperature below 1e-5)."""
    return self.temperature < SAMPLING_EPS

  def for_sample(self, index: int) -> SamplingParams:
    """The parameters of sample `index` (`0 <= index < n`) of this request: the same, with
    seed `child_seed(seed, index)` when seeded (vLLM's parallel sampling). A derived seed of -1
    stays a seed (it is not the "no seed" sentinel here)."""
    if self.seed is None or index == 0:
      return self
    child = copy.copy(self)
    child.seed = child_seed(self.seed, index)
    return child

  def validated_copy(self) -> SamplingParams:
    """A copy normalised and validated as a new `SamplingParams` with these values would be:
    what the engine takes when a request is added, so values assigned after construction are
    checked then, and later assignments do not reach the request. `structured_outputs` is
    copied (and checked) too; `extra_args` is shared, as in `replace`.

    Raises:
      ValueError: naming the field, for any value the constructor refuses.
    """
    so = self.structured_outputs
    if isinstance(so, StructuredOutputsParams):
      so = dataclasses.replace(so)
    return dataclasses.replace(self, structured_outputs=so)

  def clone(self) -> SamplingParams:
    """A deep copy (vLLM's `clone`, which its RL code calls before changing a request's
    parameters): `extra_args` and a `structured_outputs` JSON schema given as a dict are copied
    too, so nothing the copy holds is shared with this one (the other fields are immutable:
    numbers, strings and tuples). Objects `copy.deepcopy` keeps as they are (functions,
    classes) stay shared, as vLLM shares its logits processors.

    Raises:
      TypeError: from `copy.deepcopy`, for an `extra_args` value that cannot be copied.
    """
    return copy.deepcopy(self)

  def replace(self, **changes) -> SamplingParams:
    """Returns a copy with `changes` applied (validated again).

    Raises:
      ValueError: if a changed value is out of range.
    """
    return dataclasses.replace(self, **changes)


@dataclasses.dataclass(kw_only=True)
class StructuredOutputsParams:
  """Constrains a request's output to a format (vLLM's `StructuredOutputsParams` names).

  Exactly one constraint must be given. The engine compiles it with llguidance when the request
  is added; an invalid schema, pattern or grammar is a `ValueError` then, before anything is
  queued. EOS is allowed only where the constraint may end; a finished constraint allows only
  EOS, which the request emits (in `token_ids` and logprobs, as vLLM reports it) and stops on
  with finish_reason "stop", even with `ignore_eos` (the grammar allows nothing more). Raw
  logprobs are taken after the grammar mask (vLLM V1's order): forbidden tokens are `-inf`.
  `min_tokens` must be 0 with a constraint. If another constraint (`allowed_token_ids`, a logits
  processor) leaves the sampler only tokens the grammar rejects, the rejected token is dropped
  and the request ends with finish_reason "abort" (a warning says why). Fields may be assigned
  after construction, as in vLLM; the engine checks them again in the copy it takes
  (`SamplingParams.validated_copy`).

  Attributes:
    json: a JSON schema, as a dict or a JSON string.
    regex: a regular expression the whole output must match (llguidance's syntax, Rust's
      `regex`), with `\\d` meaning `[0-9]` and `\\w` `[0-9A-Za-z_]` (their negations too, also
      inside `[...]`), as in a JSON schema's `pattern` and vLLM; `\\s` and `.` are Unicode.
    choice: a non-empty list of strings; the output is exactly one of them.
    grammar: a Lark grammar (llguidance's dialect; a GBNF grammar is converted when it has a
      `root ::=` rule).
    json_object: True for any JSON object.

  Raises:
    ValueError: naming the field, when no constraint or several are given, or one has the
      wrong type.
  """

  json: str | dict | None = None
  regex: str | None = None
  choice: tuple[str, ...] | None = None
  grammar: str | None = None
  json_object: bool | None = None

  def __post_init__(self):
    if self.choice is not None:
      if isinstance(self.choice, str) or not isinstance(self.choice, Iterable):
        raise ValueError(f"choice must be a list of strings, got {self.choice!r}")
      self.choice = tuple(self.choice)
      if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
        raise ValueError(
          f"choice must be a non-empty list of non-empty strings, got {self.choice!r}"
        )
    for name in ("regex", "grammar"):
      value = getattr(self, name)
      if value is not None and not isinstance(value, str):
        raise ValueError(f"{name} must be a str, got {value!r}")
    if self.json is not None and not isinstance(self.json, (str, dict)):
      raise ValueError(f"json must be a dict or a JSON string, got {self.json!r}")
    if self.json_object not in (None, True, False):
      raise ValueError(f"json_object must be a bool, got {self.json_object!r}")
    given = [n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None]
    given += ["json_object"] if self.json_object else []
    if len(given) != 1:
      raise ValueError(
        "structured_outputs needs exactly one of json, regex, choice, grammar, json_object; "
        f"got {given or 'none'}"
      )

  @property
  def kind(self) -> str:
    """Which constraint is set: "json", "regex", "choice", "grammar" or "json_object"."""
    for name in ("json", "regex", "choice", "grammar"):
      if getattr(self, name) is not None:
        return name
    return "json_object"


def _check_int(field: str, value) -> None:
  if not is_int(value):
    raise ValueError(f"{field} must be an int, got {value!r}")


def _check_number(field: str, value, *, finite: bool = True) -> None:
  """ValueError naming `field` unless `value` is a real number (finite unless `finite=False`:
  an infinite temperature or penalty would turn the logits into NaN or noise)."""
  if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
    raise ValueError(f"{field} must be a number, got {value!r}")
  if finite and not math.isfinite(float(value)):
    raise ValueError(f"{field} must be a finite number, got {value!r}")


def _normalise_logit_bias(bias: Mapping[int, float]) -> dict[int, float]:
  if not isinstance(bias, Mapping):
    raise ValueError(f"logit_bias must be a dict of token id -> bias, got {bias!r}")
  out: dict[int, float] = {}
  for token, value in bias.items():
    token_id = None
    if is_int(token):
      token_id = int(token)
    elif isinstance(token, str):  # the OpenAI front end sends string keys
      try:
        token_id = int(token)
      except ValueError:
        pass
    if token_id is None:
      raise ValueError(f"logit_bias keys must be token ids (ints), got {token!r}")
    _check_number(f"logit_bias[{token_id}]", value, finite=False)
    if not math.isfinite(float(value)):
      raise ValueError(
        f"logit_bias[{token_id}] must be finite (use allowed_token_ids or "
        f"bad_words_token_ids to forbid or force tokens), got {value!r}"
      )
    out[token_id] = float(value)
  return out


def validate_logprobs_mode(mode: str) -> str:
  """Returns `mode` if it is one of vLLM's four logprobs modes, else raises ValueError."""
  if mode not in _LOGPROBS_MODES:
    raise ValueError(f"logprobs_mode must be one of {_LOGPROBS_MODES}, got {mode!r}")
  return mode
