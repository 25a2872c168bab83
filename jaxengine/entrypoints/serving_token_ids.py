"""Token in, token out (vLLM's fields, for RL and multi-turn agents that need the exact ids):

- ``"return_token_ids": true`` adds the generated ids to each choice (`token_ids`) and the
  prompt's ids (`prompt_token_ids`: on each choice of `/v1/completions`, at the top of a
  `/v1/chat/completions` response, where vLLM puts them). Streamed, each chunk's `token_ids` are
  the ids of its text; `prompt_token_ids` comes once: on a completion choice's first chunk, on
  each choice's role chunk of a chat stream. Without the field (or with it false) neither key
  appears.
- A completions `prompt` of token ids (a list of ints, or a list of such lists: a batch) is
  checked against the model's vocabulary before any engine request starts: an id outside it is
  a 400 naming `prompt`, the id and its position.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxengine.entrypoints.protocol import RequestError
from jaxengine.outputs import CompletionOutput, RequestOutput


def check_prompt_token_ids(prompt: str | Sequence, vocab_size: int) -> None:
  """Refuses a completions `prompt` holding token ids outside ``[0, vocab_size)``.

  Args:
    prompt: the request's `prompt` as sent: text, token ids, or a list of either (texts are
      not checked here: the tokenizer makes their ids).
    vocab_size: the model's vocabulary size `V` (its logits' width).

  Raises:
    RequestError: a 400 naming `prompt`, the first bad id and where it is (``prompt[3]``, or
      ``prompt[1][3]`` in a batch).
  """
  if isinstance(prompt, str):
    return
  batch: list[tuple[str, Sequence]] = [
    (f"prompt[{i}]", ids) for i, ids in enumerate(prompt) if isinstance(ids, list)
  ]
  for where, ids in batch or [("prompt", prompt)]:
    for j, token_id in enumerate(ids):
      if isinstance(token_id, int) and not 0 <= token_id < vocab_size:
        raise RequestError(
          f"{where}[{j}] = {token_id} is not a token id of this model's vocabulary "
          f"[0, {vocab_size})",
          "prompt",
        )


def token_ids_field(asked: bool | None, completion: CompletionOutput) -> dict:
  """``{"token_ids": [...]}``, a choice's generated ids (a chunk's: those of its text), when
  `return_token_ids` is set; else ``{}``."""
  return {"token_ids": list(completion.token_ids)} if asked else {}


def prompt_token_ids_field(asked: bool | None, output: RequestOutput) -> dict:
  """``{"prompt_token_ids": [...]}``, the ids the engine ran the prompt as (a text prompt
  tokenized, a chat's messages rendered), when `return_token_ids` is set; else ``{}``."""
  return {"prompt_token_ids": list(output.prompt_token_ids)} if asked else {}
