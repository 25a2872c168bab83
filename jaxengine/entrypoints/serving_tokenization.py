"""`OpenAIServingTokenization`: `/tokenize` and `/detokenize` (vLLM's name): a prompt or chat
messages to token ids as the engine would see them, and token ids back to text."""

from __future__ import annotations

from jaxengine.entrypoints.protocol import (
  ChatCompletionRequest,
  DetokenizeRequest,
  RequestError,
  TokenizeRequest,
)
from jaxengine.entrypoints.serving_engine import OpenAIServing, warn_unknown


class OpenAIServingTokenization(OpenAIServing):
  """The tokenizer endpoints' work (`OpenAIServing`'s arguments)."""

  def tokenize(self, body: TokenizeRequest) -> dict:
    self.check_model(body.model)
    warn_unknown(body, "/tokenize")
    tokenizer = self.engine.tokenizer
    if tokenizer is None:
      raise RequestError("this model has no tokenizer", None)
    if (body.prompt is None) == (body.messages is None):
      raise RequestError("give exactly one of prompt and messages", "prompt")
    if body.prompt is not None:
      tokens = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    else:
      chat = ChatCompletionRequest(
        messages=body.messages or [], add_generation_prompt=body.add_generation_prompt
      )
      tokens = self.render_chat(chat)["prompt_token_ids"]
    return {"count": len(tokens), "max_model_len": self.engine.max_model_len, "tokens": tokens}

  def detokenize(self, body: DetokenizeRequest) -> dict:
    self.check_model(body.model)
    warn_unknown(body, "/detokenize")
    tokenizer = self.engine.tokenizer
    if tokenizer is None:
      raise RequestError("this model has no tokenizer", None)
    bad = [t for t in body.tokens if not 0 <= t < tokenizer.vocab_size]
    if bad:
      raise RequestError(
        f"tokens must be ids in [0, {tokenizer.vocab_size}), got {bad[:5]}", "tokens"
      )
    return {"prompt": tokenizer.decode(body.tokens)}
