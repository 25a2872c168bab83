"""Output processing: sampled tokens -> text, logprob dicts and finish reasons, as vLLM reports them.

Per completion and step (vLLM's order): the length limits (`max_tokens`, `max_model_len`), then
EOS (unless `ignore_eos`) and `stop_token_ids` (never before `min_tokens`; the token is kept in
`token_ids`, and in the text only with `include_stop_str_in_output`), then stop strings in the
new text (only once more than `min_tokens` tokens exist, never in the text of the first
`min_tokens` tokens; the earliest-ending match wins).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from jaxengine.batch import HostSamplerOutput, LogprobsArrays
from jaxengine.core.request import Completion
from jaxengine.outputs import Logprob
from jaxengine.tokenizer import Tokenizer


class StopMatch(NamedTuple):
  """Where a stop string occurs in a completion's text: `text[start:end] == stop`."""

  stop: str
  start: int
  end: int


def find_stop_string(
  text: str, num_new_chars: int, stops: Sequence[str], search_start: int = 0
) -> StopMatch | None:
  """The stop string that the last `num_new_chars` characters of `text` complete, if any.

  Each stop string is looked for only where it would end inside the new characters (its own
  length back from them, not the longest stop string's), and never before `search_start` (the
  text of the first min_tokens tokens). When several complete on the same token, the one that
  ends first in the text wins, then the earliest in `stops` (vLLM's rule, `docs/sampling.md` §2.7).

  Args:
    text: the output text so far, new characters included.
    num_new_chars: characters the latest token added.
    stops: the request's stop strings.
    search_start: first character a match may start at.

  Returns:
    The `StopMatch`, or None.
  """
  best = None
  for stop in stops:
    start = text.find(stop, max(search_start, len(text) - num_new_chars - len(stop) + 1))
    if start >= 0 and (best is None or start + len(stop) < best.end):
      best = StopMatch(stop, start, start + len(stop))
  return best


class OutputProcessor:
  """Applies sampled tokens to completions: logprob dicts, detokenized text, stop rules.

  Args:
    tokenizer: the model's tokenizer, or None (no text, no decoded tokens in logprobs).
    eos_token_id: the EOS id, or None.
    max_model_len: a completion whose prompt plus output reaches it finishes with "length".
    vocab_size: what `logprobs=-1` (the whole vocabulary) resolves to.
    extra_eos_token_ids: more ids that end generation like EOS (unless `ignore_eos`, never
      before `min_tokens`) but report themselves as `stop_reason`, as vLLM treats the EOS ids
      of a checkpoint's generation config.
  """

  def __init__(
    self,
    tokenizer: Tokenizer | None,
    eos_token_id: int | None,
    max_model_len: int,
    vocab_size: int,
    extra_eos_token_ids: Sequence[int] = (),
  ) -> None:
    self.tokenizer = tokenizer
    self.eos_token_id = eos_token_id
    self.extra_eos_token_ids = frozenset(extra_eos_token_ids) - {eos_token_id}
    self.max_model_len = max_model_len
    self.vocab_size = vocab_size
    self._decoded_tokens: dict[int, str] = {}

  def prompt_logprobs(self, completion: Completion, logprobs: LogprobsArrays) -> None:
    """Sets the request's `prompt_logprobs` (vLLM's list: None, then one dict per token)."""
    k = self._resolve_k(completion.params.prompt_logprobs or 0)
    completion.request.prompt_logprobs = [None] + [
      self._logprob_dict(logprobs.token_ids[t], logprobs.logprobs[t], int(logprobs.ranks[t]), k)
      for t in range(len(logprobs.ranks))
    ]

  def append(self, completion: Completion, row: int, sampled: HostSamplerOutput) -> None:
    """Appends row `row`'s sampled token to `completion` and applies the stop rules."""
    token = int(sampled.sampled_token_ids[row])
    params = completion.params
    completion.token_ids.append(token)
    if completion.logprobs is not None and sampled.logprobs is not None:
      lp = sampled.logprobs
      k = self._resolve_k(params.logprobs or 0)
      completion.logprobs.append(
        self._logprob_dict(lp.token_ids[row], lp.logprobs[row], int(lp.ranks[row]), k)
      )
      completion.cumulative_logprob = (completion.cumulative_logprob or 0.0) + float(
        lp.logprobs[row, 0]
      )
    stop_token = self._check_length_and_stop_tokens(completion, token)
    if completion.detokenizer is None or (stop_token and not params.include_stop_str_in_output):
      return
    delta = completion.detokenizer.add_tokens([token])
    completion.text += delta
    num_output = len(completion.token_ids)
    if num_output == params.min_tokens:
      completion.stop_search_start = len(completion.text)
    if params.stop and delta and not stop_token and num_output > params.min_tokens:
      self._check_stop_strings(completion, len(delta))

  def _check_length_and_stop_tokens(self, completion: Completion, token: int) -> bool:
    """Sets the finish reason for the length limits, EOS and stop ids; True for a stop token."""
    params = completion.params
    num_output = len(completion.token_ids)
    may_stop = num_output >= params.min_tokens
    max_tokens = params.max_tokens or self.max_model_len
    if num_output >= max_tokens or completion.num_tokens >= self.max_model_len:
      completion.finish_reason = "length"
    elif may_stop and not params.ignore_eos and token == self.eos_token_id:
      completion.finish_reason = "stop"
      return True
    elif may_stop and (
      (params.stop_token_ids and token in params.stop_token_ids)
      or (not params.ignore_eos and token in self.extra_eos_token_ids)
    ):
      completion.finish_reason, completion.stop_reason = "stop", token
      return True
    return False

  def _check_stop_strings(self, completion: Completion, num_new_chars: int) -> None:
    params = completion.params
    match = find_stop_string(
      completion.text, num_new_chars, params.stop or (), completion.stop_search_start
    )
    if match is not None:
      end = match.end if params.include_stop_str_in_output else match.start
      completion.text = completion.text[:end]
      completion.finish_reason, completion.stop_reason = "stop", match.stop

  def _resolve_k(self, k: int) -> int:
    return self.vocab_size if k == -1 else k

  def _logprob_dict(self, token_ids, values, rank: int, k: int) -> dict[int, Logprob]:
    """vLLM's per-position dict: the chosen token with its rank, then the top k by position
    (a chosen token inside the top k keeps its top-k entry)."""
    ids = [int(t) for t in token_ids[: k + 1]]
    ranks = [rank, *range(1, k + 1)]
    return {
      token_id: Logprob(float(value), r, self._decoded(token_id))
      for token_id, value, r in zip(ids, values[: k + 1], ranks)
    }

  def _decoded(self, token_id: int) -> str | None:
    """A token's text for `Logprob.decoded_token` (memoised: top-k entries repeat a lot)."""
    if self.tokenizer is None:
      return None
    text = self._decoded_tokens.get(token_id)
    if text is None:
      text = self.tokenizer.decode([token_id], skip_special_tokens=False)
      self._decoded_tokens[token_id] = text
    return text
