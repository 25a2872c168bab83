"""What the engine returns: vLLM's offline output classes, by the same names and fields.

`LLM.generate` / `LLM.chat` return one `RequestOutput` per prompt; each holds `n`
`CompletionOutput`s, whose optional per-token logprobs are dicts of `Logprob`. Everything here is
plain host data (Python ints, floats and strings, and NumPy's routed experts), never device
arrays.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
  from jaxengine.lora.request import LoRARequest


@dataclasses.dataclass(frozen=True)
class Logprob:
  """One token's log-probability as reported to the user (vLLM `Logprob`).

  Attributes:
    logprob: Python float, in nats, in the engine's `logprobs_mode`: by default
      ("raw_logprobs") the log-softmax of the model's unmodified logits, so it ignores temperature,
      filters and penalties; "processed_logprobs" gives the log-probability under the distribution
      the token was drawn from (`-inf` for a filtered token); the two `*_logits` modes report the
      logit itself, not a log-probability. Prompt logprobs are always raw log-softmax values.
    rank: 1-based rank of the token among the whole vocabulary by that value: 1 is the best, and
      tokens tied with it count against it (vLLM's rule). The sampled (or prompt) token carries
      its true rank; the top-k entries carry `1..k` in order. None if unknown.
    decoded_token: the token's text on its own (special tokens included), or None when the engine
      has no tokenizer.
  """

  logprob: float
  rank: int | None = None
  decoded_token: str | None = None


#: Per generated token, `{token_id: Logprob}`: the sampled token plus the top k, so k + 1 entries,
#: or k when the sampled token is itself among the top k (it then keeps its top-k entry).
SampleLogprobs = list[dict[int, Logprob]]
#: Per prompt token, the same kind of dict for the prompt token and the top k; the first entry is
#: None (nothing predicts the first token).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclasses.dataclass
class CompletionOutput:
  """One completion of a request (vLLM `CompletionOutput`).

  Attributes:
    index: which of the request's `n` completions this is, `0..n-1`. Completion `j` of a seeded
      request was sampled with seed `seed + j`.
    text: generated text (a matched stop string is left out unless include_stop_str_in_output;
      special tokens such as EOS are left out when skip_special_tokens, the default).
    token_ids: generated token ids (a stop token id or EOS that ended generation is kept, and so
      is the token that completed a stop string, even though `text` is cut before it).
    cumulative_logprob: sum of the sampled tokens' `Logprob.logprob` values (nats, in the engine's
      logprobs mode), or None when the request did not ask for `logprobs`.
    logprobs: `SampleLogprobs`, one dict per generated token holding the sampled token and the top
      `logprobs` tokens (the whole vocabulary for `logprobs=-1`); None without `logprobs`.
    finish_reason: "stop" (EOS, a stop token id, a stop string or a finished structured-outputs
      grammar), "length" (max_tokens or max_model_len), "abort" (aborted: `abort_request`, a
      pause with mode "abort", or the sampler could only produce a token the request's grammar
      rejects, which is dropped), or None while running.
    stop_reason: the stop string (str) or stop token id (int) that ended generation; None for EOS,
      for "length", and while running.
    weight_versions: one per token of `token_ids`, the version of the weights that produced it
      (`LLMEngine.load_weights(..., weight_version=)`; 0 before any load).
    routed_experts: with ``enable_return_routed_experts`` (a mixture-of-experts model), the
      experts the router chose for every position fed through the model, ``[num_prompt_tokens
      + len(token_ids) - 1, num_moe_layers, top_k] int32`` (a NumPy array; the last token has
      not been fed): row ``p`` holds position ``p``'s ``num_experts_per_tok`` experts at each
      MoE layer in order, largest router weight first (the router's top-k, as transformers
      computes it). Prompt positions are included, those of a cached prefix too. Set once the
      completion finishes (an aborted one: its positions computed so far, after a preemption
      those recomputed); None while it runs, without the flag, or when it was aborted before it
      was admitted (`jaxengine/worker/routed_experts.py`).
      Replay them with `jaxengine.models.token_logprobs(..., routed_experts=)`.
  """

  index: int
  text: str
  token_ids: list[int]
  cumulative_logprob: float | None
  logprobs: SampleLogprobs | None
  finish_reason: str | None = None
  stop_reason: int | str | None = None
  weight_versions: list[int] = dataclasses.field(default_factory=list)
  routed_experts: np.ndarray | None = dataclasses.field(default=None, repr=False)

  def finished(self) -> bool:
    """True once the completion has a `finish_reason`."""
    return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
  """Everything generated for one prompt (vLLM `RequestOutput`).

  Attributes:
    request_id: the request's id (the engine numbers requests "0", "1", ... unless given one).
    prompt: the prompt text: the text given to `LLM.generate`, or for `LLM.chat` the
      conversation rendered by the chat template; None when the prompt was given as token ids
      only.
    prompt_token_ids: the prompt's token ids, as fed to the model (BOS included if the tokenizer
      adds one).
    prompt_logprobs: with `prompt_logprobs=k`, a `PromptLogprobs` list with one entry per prompt
      token (the first None), each a dict holding the prompt token and the top k, as raw
      log-softmax values whatever the engine's logprobs mode; else None.
    outputs: the `n` completions, by index.
    finished: whether every completion has finished.
    lora_request: the `LoRARequest` it ran with, None for the base model.
  """

  request_id: str
  prompt: str | None
  prompt_token_ids: list[int]
  prompt_logprobs: PromptLogprobs | None
  outputs: list[CompletionOutput]
  finished: bool
  lora_request: LoRARequest | None = None
