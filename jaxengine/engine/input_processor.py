"""Input processing: a user's prompt and `SamplingParams` -> a validated `Request`.

Parses the prompt forms vLLM accepts (text, token ids, `{"prompt": ...}` /
`{"prompt_token_ids": ...}` dicts), tokenizes text and `bad_words`, checks everything the batch
would refuse, and creates the request's `n` completions (child `j` of a seeded request gets seed
`seed + j` wrapped into the int64 range, as vLLM's parallel sampling). Nothing here touches the device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from jaxengine.batch.rows import EncodedRequest
from jaxengine.core.request import Completion, Request
from jaxengine.params import RequestOutputKind, SamplingParams, StructuredOutputsParams, is_int
from jaxengine.tokenizer import IncrementalDetokenizer, Tokenizer

#: Checks a request against the batch's capacities and encodes it as a row:
#: `(prompt_token_ids, params)`; raises ValueError.
RequestValidator = Callable[[Sequence[int], SamplingParams], EncodedRequest]
#: Compiles `(structured_outputs, allowed_token_ids)` to a grammar; raises ValueError.
GrammarCompiler = Callable[[StructuredOutputsParams, Sequence[int] | None], str]


class InputProcessor:
  """Turns prompts into `Request`s, raising `ValueError` for anything the engine would refuse.

  Args:
    tokenizer: the model's tokenizer, or None (then prompts must be token ids and stop strings /
      bad_words are refused).
    max_model_len: prompts must be shorter (room for one generated token).
    validate: the batch's check of a request's token ids, lists and logprobs, which encodes it
      as a row (`InputBatch.validate_request`): each completion carries its encoding to
      admission (`Completion.encoded`), so a request is encoded once.
    compile_grammar: compiles a request's `structured_outputs`, given its `allowed_token_ids`
      (raises ValueError when invalid); None refuses structured outputs (an engine without a
      tokenizer).
  """

  def __init__(
    self,
    tokenizer: Tokenizer | None,
    max_model_len: int,
    validate: RequestValidator,
    compile_grammar: GrammarCompiler | None = None,
  ) -> None:
    self.tokenizer = tokenizer
    self._compile_grammar = compile_grammar
    self.max_model_len = max_model_len
    self._validate = validate

  def process(self, request_id: str, prompt, params: SamplingParams) -> Request:
    """A validated `Request` with its completions. The request holds its own copy of `params`
    (`SamplingParams.validated_copy`): values assigned to `params` after construction are
    checked here, and later assignments do not reach the request.

    Raises:
      ValueError: for parameters that are not a `SamplingParams` or whose values (assigned
        after construction) the constructor would refuse, `output_kind` DELTA (`LLMEngine.step`
        returns cumulative outputs), an empty prompt, a prompt of
        `max_model_len` tokens or more, token ids outside the vocabulary, text, stop strings or
        bad_words without a tokenizer, parameters the batch cannot hold, or invalid
        `structured_outputs` (or structured outputs without a tokenizer).
    """
    if not isinstance(params, SamplingParams):
      raise ValueError(f"sampling_params must be a SamplingParams, got {params!r}")
    params = params.validated_copy()  # the request's own, checked again
    if params.output_kind is RequestOutputKind.DELTA:
      raise ValueError(
        "output_kind=RequestOutputKind.DELTA is not supported by LLMEngine.step, which returns "
        "cumulative outputs (use CUMULATIVE or FINAL_ONLY; AsyncLLM.generate streams deltas)"
      )
    text, prompt_token_ids = self._prompt_text_and_ids(prompt)
    if not prompt_token_ids:
      raise ValueError("the prompt is empty")
    if len(prompt_token_ids) >= self.max_model_len:
      raise ValueError(
        f"the prompt has {len(prompt_token_ids)} tokens; it must have fewer than "
        f"max_model_len={self.max_model_len} (room for at least one generated token)"
      )
    if (params.stop or params.bad_words) and self.tokenizer is None:
      raise ValueError("stop strings and bad_words need a tokenizer")
    params = self._with_bad_words(params)
    encoded = self._validate(prompt_token_ids, params)
    grammar = None
    if params.structured_outputs is not None:
      if self._compile_grammar is None:
        raise ValueError("structured_outputs need a tokenizer")
      grammar = self._compile_grammar(params.structured_outputs, params.allowed_token_ids)
    request = Request(request_id, text, prompt_token_ids, params, grammar=grammar)
    request.completions = [self._completion(request, j, encoded) for j in range(params.n)]
    return request

  def _completion(self, request: Request, j: int, encoded: EncodedRequest) -> Completion:
    params = request.params
    # vLLM's parallel sampling: child j of a seeded request uses seed + j (wrapped into range).
    child = params.for_sample(j)
    if child is not params:  # its own seed: its own row (the request's passed every check)
      encoded = self._validate(request.prompt_token_ids, child)
    detokenizer = None
    if self.tokenizer is not None:
      detokenizer = IncrementalDetokenizer(
        self.tokenizer, request.prompt_token_ids, skip_special_tokens=params.skip_special_tokens
      )
    return Completion(
      seq_id=request.request_id if params.n == 1 else f"{request.request_id}#{j}",
      request=request,
      index=j,
      params=child,
      detokenizer=detokenizer,
      logprobs=None if params.logprobs is None else [],
      cumulative_logprob=None if params.logprobs is None else 0.0,
      encoded=encoded,
    )

  def _prompt_text_and_ids(self, prompt) -> tuple[str | None, list[int]]:
    """A prompt as (text or None, token ids): a string, a token-id sequence, or vLLM's prompt
    dicts `{"prompt": text}` and `{"prompt_token_ids": ids}` (optionally with `"prompt"` for the
    outputs)."""
    if isinstance(prompt, dict):
      unknown = set(prompt) - {"prompt", "prompt_token_ids"}
      if unknown or not prompt:
        raise ValueError(
          f"a prompt dict takes the keys 'prompt' and/or 'prompt_token_ids', got "
          f"{sorted(map(str, prompt))}"
        )
      if "prompt_token_ids" in prompt:
        return prompt.get("prompt"), _token_ids(prompt["prompt_token_ids"])
      prompt = prompt["prompt"]
    if isinstance(prompt, str):
      if self.tokenizer is None:
        raise ValueError("text prompts need a tokenizer; pass token ids")
      return prompt, self.tokenizer.encode(prompt)
    return None, _token_ids(prompt)

  def _with_bad_words(self, params: SamplingParams) -> SamplingParams:
    """Turns `bad_words` strings into token-id sequences (vLLM's rule: the word without leading
    space, plus its leading-space variant when that tokenizes to as many tokens differently)."""
    if not params.bad_words or self.tokenizer is None:
      return params
    sequences = list(params.bad_words_token_ids or ())
    for word in params.bad_words:
      plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
      spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
      sequences.append(tuple(plain))
      if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
        sequences.append(tuple(spaced))
    return params.replace(bad_words_token_ids=tuple(sequences))


def _token_ids(token_ids) -> list[int]:
  if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Iterable):
    raise ValueError(f"a prompt must be a string or a sequence of token ids, got {token_ids!r}")
  token_ids = list(token_ids)
  if not all(is_int(t) for t in token_ids):
    raise ValueError(f"prompt_token_ids must hold only ints, got {token_ids[:8]!r}")
  return [int(t) for t in token_ids]
