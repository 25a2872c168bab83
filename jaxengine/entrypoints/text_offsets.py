"""`TextOffsets`: where each token of a completion choice starts in its text (the completions
API's `text_offset`, echoed prompt included)."""

from __future__ import annotations

from collections.abc import Sequence

from jaxengine.tokenizer import IncrementalDetokenizer, Tokenizer


class TextOffsets:
  """Where each token of one completion choice starts in the choice's text (`text_offset`).

  A token's offset is the length of the text its part's earlier tokens decode to, decoded
  incrementally (`IncrementalDetokenizer`, which holds back a character until its last byte
  arrives): the tokens of one multi-byte character all get the offset where it starts, and the
  offsets never decrease. The echoed prompt decodes on its own with special tokens kept; the
  completion decodes after the prompt as the engine decoded it. Offsets are clipped to the text
  sent so far (a stop string cut from the text ends it before its tokens do). Kept across a
  stream's chunks.

  Args:
    tokenizer: the engine's tokenizer, or None (every offset is then the text's length so far).
    prompt_token_ids: the completion's decoding context.
    skip_special_tokens: the request's setting, as the engine decoded the completion with.
  """

  def __init__(self, tokenizer: Tokenizer | None, prompt_token_ids: Sequence[int],
               skip_special_tokens: bool) -> None:  # fmt: skip
    self.tokenizer = tokenizer
    self.prompt_token_ids = prompt_token_ids
    self.skip_special_tokens = skip_special_tokens
    self.text_length = 0  # characters of the choice's text sent so far
    self._decoded = 0  # where the current part's next token starts
    self._detokenizer: IncrementalDetokenizer | None = None
    self._pending: list[int] = []
    self._skip = skip_special_tokens
    self._in_completion = False

  def prompt_offsets(self, token_ids: Sequence[int], text: str) -> list[int]:
    """The echoed prompt's offsets (`text`: the prompt as echoed, before any completion text).
    Special tokens count as their text, unless only without them the tokens spell `text` (a
    BOS the tokenizer added to a text prompt starts where the text does)."""
    tokenizer = self.tokenizer
    skip = (
      tokenizer is not None
      and tokenizer.decode(token_ids, skip_special_tokens=False) != text
      and tokenizer.decode(token_ids, skip_special_tokens=True) == text
    )
    self._start_part((), skip)
    offsets = self._offsets(token_ids, text)
    self._in_completion = False
    return offsets

  def completion_offsets(self, token_ids: Sequence[int], text: str) -> list[int]:
    """The offsets of the completion's next tokens, which add `text` to the choice."""
    if not self._in_completion:
      self._start_part(self.prompt_token_ids, self.skip_special_tokens)
      self._in_completion = True
    return self._offsets(token_ids, text)

  def _start_part(self, context: Sequence[int], skip_special_tokens: bool) -> None:
    self._decoded = self.text_length
    self._pending = []  # tokens decoded to no text yet (a character's first bytes)
    self._skip = skip_special_tokens
    self._detokenizer = None
    if self.tokenizer is not None:
      self._detokenizer = IncrementalDetokenizer(
        self.tokenizer, context, skip_special_tokens=skip_special_tokens
      )

  def _offsets(self, token_ids: Sequence[int], text: str) -> list[int]:
    self.text_length += len(text)
    offsets: list[int] = []
    held = 0  # how many of the last `offsets` are pending (set again once their text comes)
    for token_id in token_ids:
      offsets.append(self._decoded)
      if self._detokenizer is None:
        continue
      chunk = self._detokenizer.add_tokens([token_id])
      if not chunk:
        self._pending.append(token_id)
        held += 1
        continue
      starts = self._starts_in(chunk)
      offsets[len(offsets) - held - 1 :] = starts[-held - 1 :]
      self._decoded += len(chunk)
      self._pending, held = [], 0
    return [min(offset, self.text_length) for offset in offsets]

  def _starts_in(self, chunk: str) -> list[int]:
    """Where the pending tokens and the one that ended them start in `chunk`, their text: how
    far the text of the tokens before each agrees with it (an incomplete character shows as
    U+FFFD, which a complete one replaces; invalid bytes stay U+FFFD in `chunk` too)."""
    assert self.tokenizer is not None
    starts = [self._decoded]
    for i in range(1, len(self._pending) + 1):
      before = self.tokenizer.decode(self._pending[:i], skip_special_tokens=self._skip)
      starts.append(self._decoded + _common_prefix_length(before, chunk))
    return starts


def _common_prefix_length(a: str, b: str) -> int:
  return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
