"""What the engine returns: vLLM's offline output classes, by the same names and fields."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Logprob:
  """One token's log-probability as reported to the user (vLLM `Logprob`).

  Attributes:
    logprob: the value in the engine's logprobs mode (raw log-softmax of the model's logits by
      default), a float.
    rank: 1-based rank among the vocabulary (ties count against the token), or None.
    decoded_token: the token's text, or None.
  """

  logprob: float
  rank: int | None = None
  decoded_token: str | None = None


#: Per-position logprobs: token id -> Logprob (the chosen token plus the top k).
SampleLogprobs = list[dict[int, Logprob]]
#: Per-prompt-position logprobs; the first entry is None (no context predicts it).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclasses.dataclass
class CompletionOutput:
  """One completion of a request (vLLM `CompletionOutput`).

  Attributes:
    index: which of the request's `n` completions this is.
    text: generated text (a matched stop string is left out unless include_stop_str_in_output;
      EOS and other special tokens are not shown).
    token_ids: generated token ids (a stop token id or EOS that ended generation is kept).
    cumulative_logprob: sum of the sampled tokens' logprobs, or None without `logprobs`.
    logprobs: per generated token, `{token_id: Logprob}` holding the sampled token and the top
      `logprobs` tokens; None without `logprobs`.
    finish_reason: "stop" (EOS, a stop token id or a stop string), "length" (max_tokens or
      max_model_len), or None while running.
    stop_reason: the stop string or stop token id that ended generation; None for EOS or length.
  """

  index: int
  text: str
  token_ids: list[int]
  cumulative_logprob: float | None
  logprobs: SampleLogprobs | None
  finish_reason: str | None = None
  stop_reason: int | str | None = None

  def finished(self) -> bool:
    return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
  """Everything generated for one prompt (vLLM `RequestOutput`).

  Attributes:
    request_id: the request's id.
    prompt: the prompt text (None when the prompt was given as token ids).
    prompt_token_ids: the prompt's token ids.
    prompt_logprobs: with `prompt_logprobs=k`, one entry per prompt token, the first None, each a
      dict holding the prompt token and the top k; else None.
    outputs: the `n` completions, by index.
    finished: whether every completion has finished.
  """

  request_id: str
  prompt: str | None
  prompt_token_ids: list[int]
  prompt_logprobs: PromptLogprobs | None
  outputs: list[CompletionOutput]
  finished: bool
