"""The interactive chat of the `jaxengine chat` command: reading lines, keeping the history in the
model's context (the oldest turns leave first)."""

from __future__ import annotations

import sys
from typing import NamedTuple


class ChatPrompt(NamedTuple):
  """A conversation cut to fit, and its prompt.

  Attributes:
    messages: the messages kept (a new list).
    text: the prompt text, from the chat template.
    prompt_token_ids: its token ids.
    num_dropped: how many of the oldest turns were left out.
  """

  messages: list[dict]
  text: str
  prompt_token_ids: list[int]
  num_dropped: int


def chat_prompt(tokenizer, messages: list[dict], max_model_len: int, room: int) -> ChatPrompt:
  """Leaves out the oldest turns of a chat until its prompt leaves room to generate.

  A turn is a user message and the assistant's reply; a leading system message is always kept,
  and so is the last message. Turns are left out while the prompt plus `room` tokens (capped at
  half of `max_model_len`, so a large `--max-tokens` cannot empty the history) exceeds
  `max_model_len`. Once only the last message is left its prompt may still be too long: the
  caller checks `len(prompt_token_ids) < max_model_len`, as the engine requires.

  Args:
    tokenizer: the model's `Tokenizer` (chat template and encoding).
    messages: the conversation, ending with the new user message (not modified).
    max_model_len: the engine's limit on prompt plus output tokens.
    room: tokens wanted for the reply (`max_tokens`).

  Returns:
    A `ChatPrompt`.
  """
  room = min(room, max_model_len // 2)
  first = 1 if messages and messages[0]["role"] == "system" else 0
  messages = list(messages)
  num_dropped = 0
  while True:
    text = tokenizer.apply_chat_template(messages)
    # The template writes its own special tokens: encode without adding more.
    prompt_token_ids = tokenizer.encode(text, add_special_tokens=False)
    if len(prompt_token_ids) + room <= max_model_len or len(messages) - first <= 1:
      return ChatPrompt(messages, text, prompt_token_ids, num_dropped)
    del messages[first : first + 2]
    num_dropped += 1


def read_message() -> str | None:
  """The next interactive chat line, or None on end of input, `/exit` or `/quit`.

  Blank lines send nothing: they are skipped. The `>>> ` prompt is shown only when stdin is a
  terminal (piped input prints just the replies).
  """
  prompt = ">>> " if sys.stdin.isatty() else ""
  while True:
    try:
      line = input(prompt)
    except EOFError:
      return None
    if line.strip() in ("/exit", "/quit"):
      return None
    if line.strip():
      return line
