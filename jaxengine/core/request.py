"""Host records of the requests an engine is working on: a `Request` and its `Completion`s."""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxengine.batch.rows import EncodedRequest
from jaxengine.lora.request import LoRARequest
from jaxengine.outputs import CompletionOutput, PromptLogprobs, RequestOutput, SampleLogprobs
from jaxengine.params import SamplingParams
from jaxengine.tokenizer import IncrementalDetokenizer


@dataclasses.dataclass
class Completion:
  """One of a request's `n` completions: a row of the batch while it runs.

  Attributes:
    seq_id: the row's id in the batch (the request id, or `"{request_id}#{index}"` for n > 1).
    request: the request it belongs to.
    index: `0..n-1`.
    params: its sampling parameters (child `j` of a seeded request has seed `seed + j`).
    detokenizer: turns its tokens into text; None without a tokenizer.
    token_ids: generated tokens read so far (their one host record: the persistent
      batch reads its row's tokens here, `jaxengine/batch/ledger.py`).
    weight_versions: the weight version that produced each token of `token_ids`.
    routed_experts: with ``enable_return_routed_experts``, `CompletionOutput.routed_experts`,
      read when it finishes (`EngineCore._finish`); None before.
    logprobs: per-token logprob dicts, or None when the request did not ask for logprobs.
    cumulative_logprob: sum of the sampled tokens' logprobs, or None.
    text: generated text so far (cut at a matched stop string).
    finish_reason: "stop", "length", "abort" (a token its grammar rejects), or None while running.
    stop_reason: the stop string or stop token id that ended it, else None.
    stop_search_start: first character of `text` a stop string may start at: the end of the
      text of the first `min_tokens` tokens.
    num_output_placeholders: tokens sampled on the device and not read yet (asynchronous
      scheduling dispatches a step before reading the last one; vLLM's name): the engine counts
      them at dispatch and takes them off when it reads them; the scheduler and the batch read
      them here.
    num_computed_tokens: tokens whose keys and values are in its pages (the scheduler's count,
      vLLM's name; 0 while waiting and after a preemption).
    encoded: its prompt and `params` encoded as a batch row where it came in
      (`engine/input_processor.py`: the one encoding of a request), until admission hands it to
      the batch (`ModelRunner.add`); None after, or for a completion built elsewhere (then the
      batch encodes it at admission).
  """

  seq_id: str
  request: Request
  index: int
  params: SamplingParams
  detokenizer: IncrementalDetokenizer | None
  token_ids: list[int] = dataclasses.field(default_factory=list)
  weight_versions: list[int] = dataclasses.field(default_factory=list)
  routed_experts: np.ndarray | None = dataclasses.field(default=None, repr=False)
  logprobs: SampleLogprobs | None = None
  cumulative_logprob: float | None = None
  text: str = ""
  finish_reason: str | None = None
  stop_reason: int | str | None = None
  stop_search_start: int = 0
  num_output_placeholders: int = 0
  num_computed_tokens: int = 0
  encoded: EncodedRequest | None = dataclasses.field(default=None, repr=False, compare=False)

  @property
  def num_tokens(self) -> int:
    """Prompt plus generated tokens read so far."""
    return len(self.request.prompt_token_ids) + len(self.token_ids)

  @property
  def num_tokens_with_placeholders(self) -> int:
    """`num_tokens` and the tokens sampled on the device not read yet: what the scheduler
    plans with."""
    return self.num_tokens + self.num_output_placeholders

  @property
  def all_token_ids(self) -> list[int]:
    """Its known tokens: the prompt, then its output so far (vLLM's name)."""
    return [*self.request.prompt_token_ids, *self.token_ids]

  @property
  def lora_id(self) -> int:
    """The `lora_int_id` of its request's adapter, 0 for the base model."""
    lora = self.request.lora_request
    return 0 if lora is None else int(lora.lora_int_id)

  @property
  def cache_key(self) -> bytes:
    """The prefix-cache key of its pages: its LoRA adapter's (`b""`: the base model's)."""
    return f"lora:{self.lora_id}".encode() if self.lora_id else b""

  @property
  def wants_prompt_logprobs(self) -> bool:
    """Whether it computes its request's prompt logprobs (the first sample of a request asking
    for them): its prompt is computed from position 0, never taken from shared pages."""
    return self.index == 0 and self.params.prompt_logprobs is not None

  def output(self) -> CompletionOutput:
    """A snapshot as vLLM's `CompletionOutput`."""
    return CompletionOutput(
      index=self.index,
      text=self.text,
      token_ids=list(self.token_ids),
      cumulative_logprob=self.cumulative_logprob,
      logprobs=None if self.logprobs is None else list(self.logprobs),
      finish_reason=self.finish_reason,
      stop_reason=self.stop_reason,
      weight_versions=list(self.weight_versions),
      routed_experts=self.routed_experts,
    )


@dataclasses.dataclass
class Request:
  """A prompt and its sampling parameters, validated, with its completions.

  Attributes:
    request_id: unique within the engine.
    prompt: the prompt text, or None for a token-id prompt.
    prompt_token_ids: the prompt as fed to the model.
    params: the request's sampling parameters (bad_words already tokenized).
    completions: its `n` completions.
    prompt_logprobs: filled by prefill when the request asked for `prompt_logprobs`.
    grammar: the compiled llguidance grammar of its `structured_outputs`, else None.
    lora_request: the LoRA adapter it runs with (`jaxengine.LoRARequest`), None for the base.
  """

  request_id: str
  prompt: str | None
  prompt_token_ids: list[int]
  params: SamplingParams
  completions: list[Completion] = dataclasses.field(default_factory=list)
  prompt_logprobs: PromptLogprobs | None = None
  grammar: str | None = None
  lora_request: LoRARequest | None = None

  @property
  def finished(self) -> bool:
    """Whether every completion has finished."""
    return all(c.finish_reason is not None for c in self.completions)

  def output(self) -> RequestOutput:
    """A snapshot as vLLM's `RequestOutput`."""
    return RequestOutput(
      request_id=self.request_id,
      prompt=self.prompt,
      prompt_token_ids=list(self.prompt_token_ids),
      prompt_logprobs=self.prompt_logprobs,
      outputs=[c.output() for c in self.completions],
      finished=self.finished,
      lora_request=self.lora_request,
    )
