"""A request's mailbox: where `AsyncLLM`'s engine thread posts the request's outputs and its
`generate` reads them, on the request's event loop.

A request's output kind (vLLM's `RequestOutputKind`) chooses what `generate` yields: the whole
output so far (CUMULATIVE), only what is new since the last yield (DELTA), or the final output
alone (FINAL_ONLY). The mailbox turns each step's snapshot into what the kind shows as it
arrives. DELTA outputs queue up, one per step that advanced the request: a stream gets one
output per token (one token a step), never two tokens merged, however late it reads (a token
whose characters are incomplete comes with empty text, its id in `token_ids`). A CUMULATIVE
output holds every earlier one, so a mailbox keeps only the latest (as vLLM does): a reader that
falls behind catches up in one read. While a request with stop strings runs, the last
`len(longest stop) - 1` characters of its text are held back, so text that a stop string later
removes is never shown.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses

from jaxengine.outputs import CompletionOutput, RequestOutput
from jaxengine.params import RequestOutputKind, SamplingParams


class Mailbox:
  """A request's outputs to yield, as its output kind shows them, or its error; used on its
  event loop (module docstring)."""

  def __init__(self, loop: asyncio.AbstractEventLoop, view: OutputView) -> None:
    self.loop = loop
    self.view = view
    self.event = asyncio.Event()
    self.pending: collections.deque[RequestOutput] = collections.deque()
    self.error: BaseException | None = None
    self.done = False  # the engine thread has let go of the request (finished or failed)

  def put(self, output: RequestOutput) -> None:
    self.done = self.done or output.finished
    shown = self.view.present(output)
    if shown is None:
      return
    if self.view.kind is not RequestOutputKind.DELTA:
      self.pending.clear()  # the latest holds everything an unread one does
    self.pending.append(shown)
    self.event.set()

  def fail(self, error: BaseException) -> None:
    self.error, self.done = error, True
    self.event.set()

  async def get(self) -> RequestOutput:
    while self.error is None and not self.pending:
      self.event.clear()
      await self.event.wait()
    if self.error is not None:
      raise self.error
    return self.pending.popleft()


class OutputView:
  """Turns a request's cumulative snapshots into what its output kind shows (module docstring)."""

  def __init__(self, params: SamplingParams, kind: RequestOutputKind) -> None:
    self.kind = kind
    self.hold = max((len(s) for s in params.stop or ()), default=1) - 1
    self.sent: dict[int, tuple[int, int]] = {}  # completion index -> (characters, tokens) shown
    self.finished_sent: set[int] = set()

  def present(self, output: RequestOutput) -> RequestOutput | None:
    if self.kind is RequestOutputKind.FINAL_ONLY:
      return output if output.finished else None
    completions = []
    for completion in output.outputs:
      shown = self._completion(completion)
      if shown is not None:
        completions.append(shown)
    if self.kind is RequestOutputKind.DELTA and not completions and not output.finished:
      return None
    return dataclasses.replace(output, outputs=completions)

  def _completion(self, completion: CompletionOutput) -> CompletionOutput | None:
    text = completion.text
    if completion.finish_reason is None and self.hold:
      text = text[: max(len(text) - self.hold, 0)]
    num_chars, num_tokens = self.sent.get(completion.index, (0, 0))
    num_chars = min(num_chars, len(text))
    self.sent[completion.index] = (max(num_chars, len(text)), len(completion.token_ids))
    if self.kind is RequestOutputKind.CUMULATIVE:
      return dataclasses.replace(completion, text=text)
    finished_now = (
      completion.finish_reason is not None and completion.index not in self.finished_sent
    )
    if finished_now:
      self.finished_sent.add(completion.index)
    if len(text) == num_chars and len(completion.token_ids) == num_tokens and not finished_now:
      return None
    logprobs = completion.logprobs
    return dataclasses.replace(
      completion,
      text=text[num_chars:],
      token_ids=completion.token_ids[num_tokens:],
      logprobs=None if logprobs is None else logprobs[num_tokens:],
    )


def post_outputs(loop: asyncio.AbstractEventLoop, items: list) -> None:
  """Hands `(mailbox, output or error)` pairs to their event loop in one call."""

  def deliver() -> None:
    for mailbox, item in items:
      if isinstance(item, BaseException):
        mailbox.fail(item)
      else:
        mailbox.put(item)

  try:
    loop.call_soon_threadsafe(deliver)
  except RuntimeError:  # the loop is closed: nobody is reading
    pass
