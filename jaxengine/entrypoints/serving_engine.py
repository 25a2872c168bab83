"""`OpenAIServing`: what the endpoints share (vLLM's name): the model a request names, its
prompt tokenized, truncated (`truncate_prompt_tokens`) and checked against the context, chat
messages rendered with the chat template, the prompt's text for an echo, and the warning naming
a request's unknown fields."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from jaxengine.entrypoints.async_llm import AsyncLLM
from jaxengine.entrypoints.chat_messages import as_conversations, render_prompts
from jaxengine.entrypoints.protocol import (
  ChatCompletionRequest,
  CompletionRequest,
  DetokenizeRequest,
  RequestError,
  TokenizeRequest,
)
from jaxengine.entrypoints.serving_models import OpenAIServingModels
from jaxengine.lora import LoRARequest
from jaxengine.outputs import RequestOutput

logger = logging.getLogger(__name__)


class OpenAIServing:
  """The endpoints' shared work on the host (each endpoint's class derives from it).

  Args:
    engine: the `AsyncLLM`.
    models: the served models (`check_model`).
  """

  def __init__(self, engine: AsyncLLM, models: OpenAIServingModels) -> None:
    self.engine = engine
    self.models = models
    self.model_name = models.model_name

  def check_model(self, model: str | None) -> LoRARequest | None:
    """The adapter a request's `model` names (None: the base model); 404 for another name."""
    return self.models.check_model(model)

  def tokenized(self, prompt: str | list[int]) -> dict | list[int] | str:
    """A text prompt as a prompt dict with its token ids (as the engine would tokenize it, so
    that it is not tokenized twice); token ids, or text without a tokenizer, as they are."""
    tokenizer = self.engine.tokenizer
    if isinstance(prompt, str) and tokenizer is not None:
      return {"prompt": prompt, "prompt_token_ids": tokenizer.encode(prompt)}
    return prompt

  def truncated(self, prompt: dict | list[int] | str, keep: int | None) -> dict | list[int] | str:
    """`prompt` cut to its last `keep` tokens (vLLM's `truncate_prompt_tokens`; -1 keeps
    `max_model_len`); its text is dropped then, so that an echo shows the tokens kept.

    Raises:
      RequestError: naming `truncate_prompt_tokens`, for a `keep` above `max_model_len` or a
        text prompt without a tokenizer.
    """
    if keep is None:
      return prompt
    max_model_len = self.engine.max_model_len
    if keep > max_model_len:
      raise RequestError(
        f"truncate_prompt_tokens={keep} is more than max_model_len={max_model_len}",
        "truncate_prompt_tokens",
      )
    if isinstance(prompt, str):
      raise RequestError(
        "truncate_prompt_tokens needs a tokenizer for text prompts", "truncate_prompt_tokens"
      )
    ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt
    return {"prompt_token_ids": list(ids[-(max_model_len if keep == -1 else keep) :])}

  def check_context(self, prompts: Sequence, max_tokens: int | None, field: str) -> None:
    """Refuses (vLLM's 400) a request whose prompt plus `max_tokens` exceeds `max_model_len`.

    A prompt that alone leaves no room is left to the engine, whose error says so; prompts
    given as text without a tokenizer are not counted here.

    Raises:
      RequestError: naming `field` (the request's max_tokens field), the context length and
        the tokens requested.
    """
    if max_tokens is None:
      return
    max_model_len = self.engine.max_model_len
    for prompt in prompts:
      num_prompt = num_prompt_tokens(prompt)
      if num_prompt is None or num_prompt >= max_model_len:
        continue
      if num_prompt + max_tokens > max_model_len:
        raise RequestError(
          f"This model's maximum context length is {max_model_len} tokens. However, you "
          f"requested {num_prompt + max_tokens} tokens ({num_prompt} in the messages, "
          f"{max_tokens} in the completion). Shorten the prompt or lower {field}.",
          field,
        )

  def prompt_text(self, output: RequestOutput) -> str:
    """The prompt as echoed: its text, or its token ids decoded (special tokens kept)."""
    if output.prompt is not None:
      return output.prompt
    return self.decode(*output.prompt_token_ids)

  def decode(self, *token_ids: int) -> str:
    """Token ids' text (special tokens kept), or "" without a tokenizer."""
    tokenizer = self.engine.tokenizer
    return "" if tokenizer is None else tokenizer.decode(token_ids, skip_special_tokens=False)

  def render_chat(self, body: ChatCompletionRequest) -> dict:
    """The request's messages rendered with the chat template, its `tools` too (unless
    `tool_choice` is "none"): a prompt dict with its token ids.

    Raises:
      RequestError: naming `messages`, for a model without a tokenizer, no messages, or messages
        the template refuses.
    """
    tokenizer = self.engine.tokenizer
    if tokenizer is None:
      raise RequestError("this model has no tokenizer: chat is not available", "messages")
    if not body.messages:
      raise RequestError("messages must not be empty", "messages")
    try:
      return render_prompts(
        tokenizer,
        as_conversations(body.messages),
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        chat_template=body.chat_template,
        chat_template_kwargs=body.chat_template_kwargs,
        tools=None if body.effective_tool_choice() == "none" else body.tools,
      )[0]
    except ValueError as error:
      raise RequestError(str(error), "messages") from None


def warn_unknown(body: TokenizeRequest | DetokenizeRequest | CompletionRequest
                 | ChatCompletionRequest, path: str) -> None:  # fmt: skip
  """One warning naming the fields of a request that this server does not know (and ignores,
  as vLLM does)."""
  unknown = body.unknown_fields()
  if unknown:
    logger.warning("%s: ignoring unknown fields %s", path, unknown)


def num_prompt_tokens(prompt) -> int | None:
  """A prompt's token count, or None for text (the engine tokenizes it)."""
  if isinstance(prompt, dict):
    return len(prompt["prompt_token_ids"])
  return None if isinstance(prompt, str) else len(prompt)
