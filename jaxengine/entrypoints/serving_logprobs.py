"""Logprobs as the OpenAI APIs show them (vLLM's formats), for completions and chat.

`prompt_logprobs=k` adds `prompt_logprobs` to each completion choice (to the chat response
itself), one entry per prompt token, the first null, the others
`{str(token id): {"logprob", "rank", "decoded_token"}}`. The completions API's `logprobs` are the
legacy lists (tokens, token_logprobs, top_logprobs, text_offset); the chat API's are per token its
text, logprob, UTF-8 bytes and top entries. JSON has no infinities: a logprob below `MIN_LOGPROB`
is reported as it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from jaxengine.outputs import CompletionOutput, Logprob, RequestOutput

#: Logprobs below this (including -inf) are reported as it: JSON has no infinities (vLLM's value).
MIN_LOGPROB = -9999.0


def finite(value: float) -> float:
  return MIN_LOGPROB if math.isnan(value) or value < MIN_LOGPROB else value


def top_entries(entries: dict[int, Logprob], k: int | None) -> dict[int, Logprob]:
  """A position's entries cut to its token (the first) and the top `k` (-1 or None: all)."""
  if k is None or k == -1:
    return entries
  return {
    token_id: e
    for i, (token_id, e) in enumerate(entries.items())
    if i == 0 or (e.rank is not None and e.rank <= k)
  }  # fmt: skip


def completion_logprobs(token_ids: Sequence[int], steps: Sequence, offsets: Sequence[int],
                        k: int | None, decode: Callable[[int], str]) -> dict:  # fmt: skip
  """The legacy completions API's logprobs: tokens, their logprobs, top dicts, text offsets.

  Args:
    token_ids: the tokens.
    steps: per token its `{token_id: Logprob}` dict, or None (a prompt's first token: its text
      comes from `decode`, its logprob and top dict are null).
    offsets: per token where it starts in the choice's text (characters; `TextOffsets`).
    k: the top entries shown besides the token itself (-1 or None: all there are).
    decode: a token id's text.
  """
  tokens, values, tops = [], [], []
  for token_id, entries in zip(token_ids, steps):
    if entries is None:
      text, value, top = decode(token_id), None, None
    else:
      chosen = entries[token_id]
      text, value = chosen.decoded_token or "", finite(chosen.logprob)
      top = {(e.decoded_token or ""): finite(e.logprob) for e in top_entries(entries, k).values()}
    tokens.append(text)
    values.append(value)
    tops.append(top)
  return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
          "text_offset": list(offsets)}  # fmt: skip


def prompt_logprobs_field(output: RequestOutput, k: int | None) -> list | None:
  """vLLM's `prompt_logprobs` field: per prompt token null (the first) or `{str(token id):
  {"logprob", "rank", "decoded_token"}}` holding the token and the top `k`; None when not asked."""
  if output.prompt_logprobs is None:
    return None
  return [
    None if entries is None else {
      str(token_id): {"logprob": finite(e.logprob), "rank": e.rank,
                      "decoded_token": e.decoded_token}
      for token_id, e in top_entries(entries, k).items()
    }
    for entries in output.prompt_logprobs
  ]  # fmt: skip


def chat_logprobs(c: CompletionOutput, num_logprobs: int | None) -> dict | None:
  """The chat API's logprobs: per token its text, logprob, UTF-8 bytes and the top k."""
  if c.logprobs is None:
    return None
  k = num_logprobs or 0

  def entry(logprob) -> dict[str, Any]:
    text = logprob.decoded_token or ""
    return {"token": text, "logprob": finite(logprob.logprob), "bytes": list(text.encode())}

  content = []
  for token_id, entries in zip(c.token_ids, c.logprobs):
    top = sorted(
      (e for e in entries.values() if e.rank is not None and e.rank <= k),
      key=lambda e: e.rank or 0,
    )
    content.append({**entry(entries[token_id]), "top_logprobs": [entry(e) for e in top]})
  return {"content": content}
