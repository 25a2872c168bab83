"""Structured outputs on the host: llguidance grammars, one matcher per completion, the bitmask.

A request's `StructuredOutputsParams` is compiled to an llguidance grammar when the request is
added (`compile`, a `ValueError` before anything is queued). When its completion enters the
batch it gets a matcher (`add`); before each decode step `bitmask` packs each grammar row's
allowed tokens as `[R, ceil(V / 32)] int32` (filled by llguidance's thread pool), which
`InputBatch.set_grammar_bitmask` hands to the compiled step; after the step `advance` feeds each
grammar row its token. The grammar allows EOS only where it may end; once it is finished (it will
accept nothing more) its bitmask allows only EOS, so the next step samples EOS, which ends the
completion with finish_reason "stop" (EOS is in its `token_ids` and logprobs, as in vLLM, even
with `ignore_eos`). A sampled token the matcher rejects (another constraint, such as
allowed_token_ids or a logits processor, left only tokens the grammar forbids) is never emitted:
`accepts` lets the engine drop it and abort the completion instead, or end it with "stop" when the
grammar was already finished (its EOS was masked by that other constraint).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from typing import Any

import llguidance
import llguidance.gbnf_to_lark
import llguidance.numpy
import numpy as np

from jaxengine.params import StructuredOutputsParams
from jaxengine.tokenizer import Tokenizer

#: Which of a regex constraint's class escapes mean ASCII only (llguidance's `regex_to_lark`):
#: ``\d`` is ``[0-9]`` and ``\w`` ``[0-9A-Za-z_]`` (their negations likewise, inside ``[...]``
#: too), as in a JSON schema's ``pattern`` (ECMA-262) and vLLM's default grammar backend; left
#: alone, llguidance's regexes (Rust's) would let ``\d`` match any Unicode decimal digit
#: (``"🯱"``, ``"٣"``). ``\s`` and ``.`` stay Unicode, as in ECMA-262.
REGEX_ASCII_CLASSES = "dw"

#: JSON compile options: compact separators, no free whitespace between tokens (small models
#: otherwise tend to fill a document with whitespace until max_tokens). A schema's `x-guidance`
#: overrides them.
JSON_OPTIONS: Any = {"whitespace_flexible": False}


def grammar_source(so: StructuredOutputsParams) -> str:
  """The llguidance grammar (a JSON string) for one constraint, not yet validated.

  Raises:
    ValueError: for a `json` schema string that is not JSON.
  """
  kind = so.kind
  if kind == "json":
    schema: Any = so.json
    if isinstance(schema, str):
      try:
        schema = json.loads(schema)
      except json.JSONDecodeError as error:
        raise ValueError(f"structured_outputs.json is not valid JSON: {error}") from None
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
  if kind == "json_object":
    return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
  if kind == "regex":
    pattern = llguidance.regex_to_lark(so.regex or "", REGEX_ASCII_CLASSES)
    return llguidance.LLMatcher.grammar_from_lark(f"start: /{pattern}/")
  if kind == "choice":
    # Lark string literals take JSON escapes, so each choice is matched literally.
    return llguidance.LLMatcher.grammar_from_lark(
      "start: " + " | ".join(json.dumps(c) for c in so.choice or ())
    )
  grammar = so.grammar or ""
  if "::=" in grammar:  # GBNF (llama.cpp) -> Lark
    try:
      grammar = llguidance.gbnf_to_lark.gbnf_to_lark(grammar)
    except Exception as error:  # GbnfToLarkError and the parser's own errors
      raise ValueError(f"structured_outputs.grammar is not valid GBNF: {error}") from None
  return llguidance.LLMatcher.grammar_from_lark(grammar)


def checked_grammar(
  so: StructuredOutputsParams, ll_tokenizer: llguidance.LLTokenizer | None = None
) -> str:
  """The llguidance grammar of a constraint, validated (against a vocabulary when given; without
  one, as the CLI does before the model loads, the schema, pattern or grammar itself).

  Raises:
    ValueError: naming the constraint and llguidance's message, for an invalid schema,
      pattern or grammar.
  """
  grammar = grammar_source(so)
  is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, ll_tokenizer)
  if is_error:
    raise ValueError(f"structured_outputs.{so.kind} is invalid: {messages[0]}")
  return grammar


class StructuredOutputs:
  """The matchers of the completions with structured outputs, and the bitmask they make.

  Args:
    tokenizer: the model's tokenizer (its vocabulary, extended to `vocab_size`).
    vocab_size: `V`, the model's logits width (the bitmask covers it: ids past the tokenizer's
      vocabulary are never allowed).
    eos_token_id: the EOS id the grammar allows where it may end.
    max_num_reqs: `R`, rows of the bitmask.
  """

  def __init__(
    self, tokenizer: Tokenizer, vocab_size: int, eos_token_id: int | None, max_num_reqs: int
  ) -> None:
    self.vocab_size, self.max_num_reqs = vocab_size, max_num_reqs
    self._tokenizer, self._eos_token_id = tokenizer, eos_token_id
    self._ll_tokenizer: llguidance.LLTokenizer | None = None
    self._executor = llguidance.LLExecutor()
    self._matchers: dict[str, llguidance.LLMatcher] = {}
    self._bitmask = llguidance.numpy.allocate_token_bitmask(max_num_reqs, vocab_size)

  @property
  def ll_tokenizer(self) -> llguidance.LLTokenizer:
    """llguidance's view of the vocabulary, built on the first structured request (it takes a
    moment, and engines without structured requests never need it).

    Raises:
      ValueError: if the tokenizer has more tokens than the model's logits (`vocab_size`).
    """
    if self._ll_tokenizer is None:
      import llguidance.hf  # imports transformers: only where a grammar is used

      try:
        self._ll_tokenizer = llguidance.hf.from_tokenizer(
          self._tokenizer.hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos_token_id
        )
      except ValueError as error:
        raise ValueError(
          f"structured_outputs need a tokenizer that fits the model's vocab_size="
          f"{self.vocab_size}: {error}"
        ) from None
    return self._ll_tokenizer

  def compile(
    self, so: StructuredOutputsParams, allowed_token_ids: Sequence[int] | None = None
  ) -> str:
    """The validated grammar of a request.

    Args:
      so: the request's constraint.
      allowed_token_ids: the request's `allowed_token_ids`, if any: at least one must be a
        token the grammar allows first.

    Raises:
      ValueError: naming the constraint and llguidance's message, for an invalid schema,
        pattern or grammar; or when no allowed_token_ids can start the grammar's output.
    """
    grammar = checked_grammar(so, self.ll_tokenizer)
    if allowed_token_ids is not None:
      self._check_first_token(so, grammar, allowed_token_ids)
    return grammar

  def _check_first_token(
    self, so: StructuredOutputsParams, grammar: str, allowed_token_ids: Sequence[int]
  ) -> None:
    """Raises ValueError when none of `allowed_token_ids` may start the grammar's output."""
    words = np.frombuffer(
      llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0).compute_bitmask(), np.uint32
    )
    ids = np.asarray(allowed_token_ids, np.int64)
    ids = ids[(ids >= 0) & (ids < 32 * len(words))]
    if not np.any((words[ids >> 5] >> (ids & 31).astype(np.uint32)) & 1):
      raise ValueError(
        f"allowed_token_ids {list(allowed_token_ids)[:8]} and structured_outputs.{so.kind} "
        "leave nothing to sample: the grammar allows none of these ids as its first token"
      )

  def add(self, seq_id: str, grammar: str) -> None:
    """A fresh matcher for a completion entering the batch."""
    matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
    if matcher.is_error():
      raise ValueError(f"structured_outputs: {matcher.get_error()}")
    self._matchers[seq_id] = matcher

  def remove(self, seq_id: str) -> None:
    """Forgets a completion's matcher (no-op without one)."""
    self._matchers.pop(seq_id, None)

  def __contains__(self, seq_id: str) -> bool:
    return seq_id in self._matchers

  def __len__(self) -> int:
    return len(self._matchers)

  def bitmask(self, req_ids: Sequence[str | None]) -> np.ndarray | None:
    """`[R, ceil(V / 32)] int32` each grammar row's allowed tokens (rows in `req_ids` order), or
    None when no row has a grammar (the step then skips the mask). Other rows are left as they
    are: the step reads only grammar rows."""
    rows = [(self._matchers[rid], row) for row, rid in enumerate(req_ids) if rid in self._matchers]
    if not rows:
      return None
    llguidance.numpy.fill_next_token_bitmask_par(self._executor, rows, self._bitmask)
    return self._bitmask

  def accepts(self, seq_id: str, token: int) -> bool:
    """Whether a completion's matcher accepts `token` next (True without a matcher; a finished
    grammar accepts EOS only). A completion's sampled token can be rejected only when another
    constraint (allowed_token_ids, a logits processor) masked every token the grammar allows."""
    matcher = self._matchers.get(seq_id)
    if matcher is None:
      return True
    if matcher.is_stopped():  # llguidance's validate_tokens refuses even EOS here
      return int(token) == self._eos_token_id
    return matcher.validate_tokens([int(token)]) == 1

  def is_finished(self, seq_id: str) -> bool:
    """Whether a completion's grammar is finished: it allows nothing but EOS next (False
    without a matcher)."""
    matcher = self._matchers.get(seq_id)
    return matcher is not None and matcher.is_stopped()

  def advance(self, seq_id: str, token: int) -> bool:
    """Feeds a completion's sampled token to its matcher; True when the completion ends here:
    the token is the EOS that finishes its grammar (or the grammar finished and there is no EOS
    id to emit). A grammar finished by any other token returns False: the next step's bitmask
    allows only EOS. False without a matcher."""
    matcher = self._matchers.get(seq_id)
    if matcher is None:
      return False
    matcher.consume_token(int(token))
    is_eos = self._eos_token_id is None or int(token) == self._eos_token_id
    return matcher.is_stopped() and is_eos


def abort_rejected(completion, token: int) -> None:
  """Ends a completion whose sampled token its grammar rejects: the token is dropped and the
  finish reason is "abort" (vLLM's name for an aborted request), with a warning."""
  completion.finish_reason = "abort"
  warnings.warn(
    f"request {completion.request.request_id!r}: sampled token {token}, which its "
    f"structured_outputs grammar does not allow (another constraint, such as "
    f"allowed_token_ids or a logits processor, masked every token the grammar allows); the "
    f"token is dropped and the request aborted",
    RuntimeWarning,
    stacklevel=6,  # `LLMEngine.step`, which called the core's step
  )
