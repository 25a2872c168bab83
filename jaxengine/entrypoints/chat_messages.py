"""`LLM.chat`'s input: conversations checked and rendered with the chat template (host only).

A conversation is a list of ``{"role": str, "content": ...}`` dicts; `LLM.chat` takes one or a
list of them. Content is a string or a list of OpenAI content parts, of which only text parts
(``{"type": "text", "text": ...}``) are supported: their texts are joined with newlines, as vLLM
does. Anything else is a `ValueError` naming the conversation and message, before any request is
queued.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from jaxengine.tokenizer import Tokenizer

#: Names `apply_chat_template` takes itself: chat_template_kwargs may not set them.
_RESERVED_KWARGS = frozenset(
  {
    "conversation",
    "tools",
    "documents",
    "chat_template",
    "add_generation_prompt",
    "continue_final_message",
    "tokenize",
    "return_dict",
    "messages",
  }
)
_SHAPE = (
  "messages must be a list of {'role': ..., 'content': ...} dicts (one conversation) or a list of "
  "such lists"
)


def as_conversations(messages: Any) -> list[list[dict[str, Any]]]:
  """One conversation or a list of them, as checked lists of message dicts (content as text).

  Raises:
    ValueError: naming the conversation (for a list of them) and message index and what is
      missing or wrong; an empty `messages`, or an empty conversation in a list of them (vLLM's
      `LLM.chat` returns `[]` for `[]`: nothing to reply to is more likely a mistake).
  """
  if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
    raise ValueError(f"{_SHAPE}, got {messages!r:.80}")
  if not messages:
    raise ValueError(f"messages must not be empty: {_SHAPE}, got []")
  if all(isinstance(m, Mapping) for m in messages):
    return [_conversation(messages, "")]
  out = []
  for index, conversation in enumerate(messages):
    where = f"conversation {index}: "
    if isinstance(conversation, (str, bytes, Mapping)) or not isinstance(conversation, Sequence):
      raise ValueError(f"{where}{_SHAPE}, got {conversation!r:.80}")
    out.append(_conversation(conversation, where))
  return out


def _conversation(messages: Sequence, where: str) -> list[dict[str, Any]]:
  if not messages:
    raise ValueError(f"messages: {where}the conversation is empty (it needs a message)")
  return [_message(message, f"{where}message {i}") for i, message in enumerate(messages)]


def _message(message: Any, where: str) -> dict[str, Any]:
  if not isinstance(message, Mapping):
    raise ValueError(f"{where}: {_SHAPE}, got {message!r:.80}")
  role = message.get("role")
  if not isinstance(role, str) or not role:
    raise ValueError(f"{where}: needs a 'role' string, got {role!r}")
  if message.get("tool_calls"):  # an assistant's calls: its content may be null or absent
    return {
      **message,
      "content": _content_text(message.get("content") or "", where),
      "tool_calls": _tool_calls(message["tool_calls"], where),
    }
  if "content" not in message:
    raise ValueError(f"{where}: needs 'content' (a string or a list of text parts)")
  return {**message, "content": _content_text(message["content"], where)}


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
  """An assistant message's `tool_calls` for the chat template: each call's `arguments`, a JSON
  string in OpenAI's messages, as the object it encodes (chat templates such as Qwen's and
  Llama's write ``arguments | tojson`` or iterate its items; vLLM does the same)."""
  if isinstance(calls, (str, bytes, Mapping)) or not isinstance(calls, Sequence):
    raise ValueError(f"{where}: tool_calls must be a list of calls, got {calls!r:.80}")
  out = []
  for index, call in enumerate(calls):
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
      raise ValueError(
        f"{where}: tool_calls[{index}] must be {{'type': 'function', 'function': {{'name': str, "
        f"'arguments': str}}}}, got {call!r:.80}"
      )
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
      try:
        arguments = json.loads(arguments) if arguments.strip() else {}
      except json.JSONDecodeError as error:
        raise ValueError(
          f"{where}: tool_calls[{index}].function.arguments is not JSON ({error.msg}): "
          f"{arguments!r:.80}"
        ) from None
    out.append({**call, "function": {**function, "arguments": arguments}})
  return out


def _content_text(content: Any, where: str) -> str:
  if isinstance(content, str):
    return content
  if isinstance(content, (bytes, Mapping)) or not isinstance(content, Sequence):
    raise ValueError(
      f"{where}: content must be a string or a list of text parts, got {content!r:.80}"
    )
  texts = []
  for index, part in enumerate(content):
    kind = part.get("type") if isinstance(part, Mapping) else None
    if kind != "text" or not isinstance(part.get("text"), str):
      raise ValueError(
        f"{where}: content part {index} must be {{'type': 'text', 'text': str}} (only text "
        f"parts are supported), got {part!r:.80}"
      )
    texts.append(part["text"])
  return "\n".join(texts)


def render_prompts(
  tokenizer: Tokenizer,
  conversations: Sequence[Sequence[Mapping[str, Any]]],
  *,
  add_generation_prompt: bool = True,
  continue_final_message: bool = False,
  chat_template: str | None = None,
  chat_template_kwargs: Mapping[str, Any] | None = None,
  tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[dict[str, Any]]:
  """vLLM prompt dicts (text and token ids) of checked conversations.

  `tools` (OpenAI's ``{"type": "function", "function": {...}}`` list) are passed to the
  template, which writes them into the prompt as the model was trained to read them (a template
  that ignores `tools` leaves them out).

  Raises:
    ValueError: for both `add_generation_prompt` and `continue_final_message`, reserved or
      non-string `chat_template_kwargs` keys, or a template that fails on a conversation (named).
  """
  if add_generation_prompt and continue_final_message:
    raise ValueError(
      "add_generation_prompt and continue_final_message cannot both be True (pass "
      "add_generation_prompt=False to continue the last message)"
    )
  kwargs = dict(chat_template_kwargs or {})
  bad = [k for k in kwargs if not isinstance(k, str) or k in _RESERVED_KWARGS]
  if bad:
    raise ValueError(f"chat_template_kwargs may not set {bad} (use the arguments of their name)")
  prompts = []
  for index, conversation in enumerate(conversations):
    try:
      text = tokenizer.apply_chat_template(
        conversation,
        add_generation_prompt,
        chat_template=chat_template,
        continue_final_message=continue_final_message,
        tools=tools or None,
        **kwargs,
      )
    except Exception as error:  # jinja2's errors and the template's own raise_exception
      raise ValueError(
        f"conversation {index}: the chat template failed: {type(error).__name__}: {error}"
      ) from error
    # The template writes its own special tokens: encode without adding more.
    prompts.append(
      {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
    )
  return prompts
