"""`AsyncLLM`: an `LLMEngine` stepping in a background thread, its outputs streamed to asyncio.

One engine thread owns the `LLMEngine` (the engine is not thread-safe, so nothing else touches
it). Callers on any event loop talk to it through a command queue: `generate` queues an add,
`abort` an abort, and `sleep` / `wake_up` / `is_sleeping` and the weight-sync methods
(`async_weight_sync.py`) an engine call; the thread applies the queued commands between steps, so
requests join and leave at step boundaries while the compiled step keeps running. After each step
the thread posts every advanced request's cumulative `RequestOutput` to that request's mailbox on
its own event loop (`loop.call_soon_threadsafe`, one call per loop and step). The step runs XLA
code that releases the GIL, so the event loop keeps serving while the device works.

A request's output kind (vLLM's `RequestOutputKind`) chooses what `generate` yields: the whole
output so far (CUMULATIVE), only what is new since the last yield (DELTA), or the final output
alone (FINAL_ONLY); the request's mailbox (`output_mailbox.py`) turns each step's snapshot into
what the kind shows. Each step's `IterationStats` (`stats.py`) go to the stat loggers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from typing import TYPE_CHECKING, Any

from jaxengine.entrypoints.async_weight_sync import AsyncWeightSync, WhenIdle
from jaxengine.entrypoints.output_mailbox import Mailbox, OutputView, post_outputs
from jaxengine.entrypoints.stats import FinishedRequestStats, IterationStats, StatLogger
from jaxengine.outputs import CompletionOutput, RequestOutput
from jaxengine.params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
  from jaxengine.entrypoints.background_compile import ServeCompile

__all__ = [
  "AsyncLLM",
  "EngineDeadError",
  "FinishedRequestStats",
  "IterationStats",
  "RequestOutputKind",
  "StatLogger",
]

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
  """The engine thread has stopped (`shutdown`, or it failed); no request can be served."""


@dataclasses.dataclass
class _Add:
  request_id: str
  prompt: Any
  params: SamplingParams
  mailbox: Mailbox
  arrival_time: float
  lora_request: Any = None


@dataclasses.dataclass
class _Abort:
  request_id: str


@dataclasses.dataclass(frozen=True)
class _Call:
  """An engine method to run on the engine thread between steps, its result for `future`."""

  fn: Callable[[], Any]
  loop: asyncio.AbstractEventLoop
  future: asyncio.Future


@dataclasses.dataclass
class _Tracked:
  """The engine thread's record of a request it serves."""

  mailbox: Mailbox
  arrival_time: float
  n: int = 1
  num_prompt_tokens: int = 0
  num_tokens: int = 0
  last_token_time: float = 0.0
  last_output: RequestOutput | None = None


_STOP = object()


class AsyncLLM(AsyncWeightSync):
  """An `LLMEngine` driven by a background thread, for asyncio servers (vLLM's `AsyncLLM`).

  Args:
    model: what `jaxengine.LLM` takes (None: the default SmolLM2 model); or a built `LLM`,
      whose engine this then drives (do not call the `LLM`'s own methods while it does).
    stat_loggers: callables given each step's `IterationStats` on the engine thread (the
      server's Prometheus metrics are one).
    **llm_kwargs: the `LLM` constructor's options (`max_num_reqs`, `max_model_len`, ...).

  Attributes:
    llm: the `LLM` whose `llm_engine` the thread drives.
    num_requests_running: completions holding a batch row after the latest step.
    num_requests_waiting: completions waiting for a row after the latest step.
    num_aborted: requests aborted so far (by `abort` or by callers that stopped reading).
    vocab_size: the model's vocabulary size `V` (token ids are in ``[0, V)``).
    background_compile: the executables `jaxengine serve` compiles beside the engine
      (`entrypoints/background_compile.py`'s `ServeCompile`, stopped by `shutdown`), or None.

  Raises:
    As `jaxengine.LLM`.
  """

  def __init__(self, model=None, *, stat_loggers: list[StatLogger] | None = None, **llm_kwargs):
    from jaxengine.entrypoints.llm import (
      LLM,  # the model and engine load only when an AsyncLLM is built
    )

    self.llm = model if isinstance(model, LLM) else LLM(model, **llm_kwargs)
    self.engine = self.llm.llm_engine
    self.tokenizer = self.engine.tokenizer
    self.max_model_len: int = self.engine.max_model_len
    self.vocab_size: int = self.engine.output_processor.vocab_size
    self.stat_loggers = list(stat_loggers or [])
    self.num_requests_running = 0
    self.num_requests_waiting = 0
    self.num_aborted = 0
    self.error: BaseException | None = None  # why the engine thread stopped, if it failed
    self.background_compile: ServeCompile | None = None
    self._commands: queue.SimpleQueue = queue.SimpleQueue()
    self._tracked: dict[str, _Tracked] = {}
    self._idle_waiters: list[WhenIdle] = []
    self._thread = threading.Thread(target=self._run, name="jaxengine-engine", daemon=True)
    self._thread.start()

  @classmethod
  def from_engine_args(
    cls,
    engine_args,
    start_engine_loop: bool = True,
    usage_context: object = None,
    stat_loggers: list[StatLogger] | None = None,
  ) -> AsyncLLM:
    """An `AsyncLLM` for vLLM's `AsyncEngineArgs` (or `EngineArgs`): their `model` with the
    engine config of the other arguments (`jaxengine.engine.arg_utils`). `start_engine_loop`
    and `usage_context` are vLLM's, ignored (the engine thread always starts).

    Raises:
      As `jaxengine.LLM`.
    """
    del start_engine_loop, usage_context
    config = engine_args.create_engine_config()
    return cls(engine_args.model, stat_loggers=stat_loggers, config=config)

  # --- the asyncio side -----------------------------------------------------------------------

  @property
  def is_running(self) -> bool:
    """Whether the engine thread is alive and accepting requests."""
    return self._thread.is_alive()

  async def generate(
    self,
    prompt,
    sampling_params: SamplingParams | None = None,
    request_id: str | None = None,
    *,
    output_kind: RequestOutputKind | None = None,
    lora_request=None,
  ) -> AsyncGenerator[RequestOutput, None]:
    """Queues a request and yields its outputs as tokens come.

    Args:
      prompt: text, token ids or vLLM's prompt dict, as `LLM.generate` takes.
      sampling_params: default `SamplingParams()`; the request runs with a copy taken here
        (`SamplingParams.validated_copy`: values assigned after construction are checked).
      request_id: unique among running requests; default a random hex id.
      output_kind: CUMULATIVE, DELTA or FINAL_ONLY (`output_mailbox.py`); None (default):
        `sampling_params.output_kind` (vLLM's way: ``SamplingParams(output_kind=DELTA)``).
      lora_request: the request's `jaxengine.LoRARequest` (an engine with `enable_lora`), or
        None for the base model.

    Yields:
      `RequestOutput`s; the last has `finished` True.

    Raises:
      ValueError: (from the first iteration) anything `LLMEngine.add_request` refuses, or a
        request id already running, or invalid `sampling_params` values.
      EngineDeadError: the engine thread has stopped.
      Exception: the error of a step that failed while the request ran (the request is gone).

    A caller that stops iterating before the last output (a `break`, a cancelled task, a
    closed generator) aborts the request: its row is freed at the next step boundary.
    """
    if not self.is_running:
      raise EngineDeadError(f"the engine thread has stopped: {self.error or 'shut down'}")
    request_id = uuid.uuid4().hex if request_id is None else str(request_id)
    given = sampling_params or SamplingParams()
    kind = given.output_kind if output_kind is None else output_kind
    # The engine's copy is cumulative: the mailbox's view makes what `kind` shows of it.
    params = given.replace(output_kind=RequestOutputKind.CUMULATIVE)
    mailbox = Mailbox(asyncio.get_running_loop(), OutputView(params, kind))
    self._commands.put(_Add(request_id, prompt, params, mailbox, time.monotonic(), lora_request))
    try:
      while True:
        output = await mailbox.get()
        yield output
        if output.finished:
          return
    finally:
      if not mailbox.done:  # the caller left early
        self._commands.put(_Abort(request_id))

  async def abort(self, request_id: str) -> None:
    """Aborts a request (waiting or running; unknown ids are ignored): its row is freed at the
    next step boundary and its `generate` ends with an output whose unfinished completions
    have finish_reason "abort"."""
    self._commands.put(_Abort(str(request_id)))

  async def sleep(self, level: int = 1) -> None:
    """Frees the engine's device memory between steps (vLLM's name): see `LLMEngine.sleep`.
    Requests queued while it sleeps fail with RuntimeError.

    Raises:
      ValueError: a level other than 1 or 2.
      RuntimeError: requests still running or waiting (nothing changes).
      EngineDeadError: the engine thread has stopped.
    """
    await self._call(lambda: self.engine.sleep(level))

  async def wake_up(self, tags: list[str] | None = None) -> None:
    """Puts back what `sleep` freed (vLLM's name): see `LLMEngine.wake_up`.

    Raises:
      ValueError: an unknown tag.
      EngineDeadError: the engine thread has stopped.
    """
    await self._call(lambda: self.engine.wake_up(tags))

  async def is_sleeping(self) -> bool:
    """Whether the engine sleeps (`LLMEngine.is_sleeping`), asked between steps."""
    return await self._call(self.engine.is_sleeping)

  async def reset_prefix_cache(self) -> bool:
    """Forgets every prefix hash between steps (`LLMEngine.reset_prefix_cache`, vLLM's name):
    running requests keep their pages; returns True."""
    return await self._call(self.engine.reset_prefix_cache)

  async def _call(self, fn: Callable[[], Any]) -> Any:
    """Runs `fn` on the engine thread at the next step boundary; returns its result or raises
    its error here."""
    if not self.is_running:
      raise EngineDeadError(f"the engine thread has stopped: {self.error or 'shut down'}")
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    self._commands.put(_Call(fn, loop, future))
    return await future

  def shutdown(self, timeout: float = 30.0) -> None:
    """Stops the engine thread after the current step; running requests fail with
    `EngineDeadError`. Safe to call twice."""
    if self.background_compile is not None:
      self.background_compile.stop()
      self.background_compile.wait(timeout)
    if self._thread.is_alive():
      self._commands.put(_STOP)
      self._thread.join(timeout)

  # --- the engine thread ----------------------------------------------------------------------

  def _run(self) -> None:
    try:
      while self._apply_commands(block=not self._can_step()):
        if self._can_step():
          self._step()
        if self._idle_waiters and not self.engine.has_unfinished_requests():
          self._settle_idle_waiters(lambda: None)
    except BaseException as error:  # a bug in this loop: fail everyone rather than hang them
      logger.exception("the engine thread failed")
      self.error = error
    finally:
      reason = self.error or "the engine was shut down"
      self._fail_all(EngineDeadError(f"the engine thread has stopped: {reason}"))

  def _apply_commands(self, block: bool) -> bool:
    """Applies every queued command (waiting for one when `block`); False on shutdown."""
    command = self._commands.get() if block else self._next_command()
    while command is not None:
      if command is _STOP:
        return False
      if isinstance(command, _Add):
        self._add(command)
      elif isinstance(command, _Abort):
        self._abort(command.request_id)
      elif isinstance(command, _Call):
        _settle(command, command.fn)
      elif isinstance(command, WhenIdle):
        self._idle_waiters.append(command)
      command = self._next_command()
    return True

  def _can_step(self) -> bool:
    """Whether a step would advance a request (unfinished ones, generation not frozen)."""
    return self.engine.has_unfinished_requests() and not self.engine.is_generation_frozen()

  def _next_command(self):
    try:
      return self._commands.get_nowait()
    except queue.Empty:
      return None

  def _add(self, command: _Add) -> None:
    mailbox = command.mailbox
    try:
      if command.request_id in self._tracked:
        raise ValueError(f"request_id {command.request_id!r} is already running")
      self.engine.add_request(
        command.request_id, command.prompt, command.params, lora_request=command.lora_request
      )
    except Exception as error:  # ValueError for bad input; anything else fails it alone too
      post_outputs(mailbox.loop, [(mailbox, error)])
      return
    self._tracked[command.request_id] = _Tracked(mailbox, command.arrival_time, command.params.n)

  def _abort(self, request_id: str) -> None:
    tracked = self._tracked.pop(request_id, None)
    if tracked is None:
      return
    self.engine.abort_request(request_id)
    self.num_aborted += 1
    stats = self._new_stats()
    output = tracked.last_output or RequestOutput(
      request_id, None, [], None, [CompletionOutput(j, "", [], None, None) for j in range(tracked.n)],
      finished=False,
    )  # fmt: skip
    post_outputs(tracked.mailbox.loop, [(tracked.mailbox, _aborted(output))])
    stats.finished.append(
      FinishedRequestStats(
        "abort", time.monotonic() - tracked.arrival_time, tracked.num_prompt_tokens,
        tracked.num_tokens,
      )
    )  # fmt: skip
    self._log(stats)

  def _step(self) -> None:
    try:
      self._publish(self.engine.step())
    except Exception as error:  # the step's requests fail; the engine goes on serving
      logger.exception("an engine step failed; its requests are aborted")
      self._fail_step(error)

  def _publish(self, step_outputs: list[RequestOutput]) -> None:
    """Posts a step's outputs (and any finished request `step` did not return) to their
    requests' mailboxes, with the step's `IterationStats`."""
    outputs = {o.request_id: o for o in step_outputs}
    outputs.update((o.request_id, o) for o in self.engine.pop_finished())
    now = time.monotonic()
    stats = self._new_stats()
    posts: dict[asyncio.AbstractEventLoop, list] = {}
    for request_id, output in outputs.items():
      tracked = self._tracked.get(request_id)
      if tracked is None:
        continue
      self._account(tracked, output, now, stats)
      posts.setdefault(tracked.mailbox.loop, []).append((tracked.mailbox, output))
      if output.finished:
        del self._tracked[request_id]
    for loop, items in posts.items():
      post_outputs(loop, items)
    self._log(stats)

  def _account(self, tracked: _Tracked, output: RequestOutput, now: float, stats) -> None:
    """Updates a request's token counts and times and the step's `IterationStats`."""
    num_tokens = sum(len(c.token_ids) for c in output.outputs)
    num_new = num_tokens - tracked.num_tokens
    if num_new > 0:
      if tracked.num_tokens == 0:
        tracked.num_prompt_tokens = len(output.prompt_token_ids)
        stats.num_prompt_tokens += tracked.num_prompt_tokens
        stats.time_to_first_tokens_s.append(now - tracked.arrival_time)
        num_new_after_first = num_new - 1
      else:
        num_new_after_first = num_new
      interval = (now - tracked.last_token_time) / max(num_new, 1)
      stats.time_per_output_tokens_s.extend([interval] * num_new_after_first)
      stats.num_generation_tokens += num_new
      tracked.num_tokens, tracked.last_token_time = num_tokens, now
    tracked.last_output = output
    if output.finished:
      reason = next((c.finish_reason for c in output.outputs if c.finish_reason), "stop")
      stats.finished.append(
        FinishedRequestStats(
          reason, now - tracked.arrival_time, tracked.num_prompt_tokens, num_tokens
        )
      )

  def _new_stats(self) -> IterationStats:
    schedulers = [core.scheduler for core in self.engine.cores]
    self.num_requests_running = sum(len(s.running) for s in schedulers)
    self.num_requests_waiting = sum(len(s.waiting) for s in schedulers)
    return IterationStats(num_running=self.num_requests_running,
                          num_waiting=self.num_requests_waiting)  # fmt: skip

  def _log(self, stats: IterationStats) -> None:
    for stat_logger in self.stat_loggers:
      try:
        stat_logger(stats)
      except Exception:  # metrics never stop the engine
        logger.exception("a stat logger failed")

  def _fail_step(self, error: Exception) -> None:
    tracked, self._tracked = self._tracked, {}
    try:
      self.engine.abort_request(list(tracked))
    except Exception:
      logger.exception("aborting the failed step's requests failed too")
    posts: dict[asyncio.AbstractEventLoop, list] = {}
    for record in tracked.values():
      posts.setdefault(record.mailbox.loop, []).append((record.mailbox, error))
    for loop, items in posts.items():
      post_outputs(loop, items)
    self._log(self._new_stats())

  def _settle_idle_waiters(self, fn: Callable[[], Any]) -> None:
    waiters, self._idle_waiters = self._idle_waiters, []
    for waiter in waiters:
      _settle(_Call(fn, waiter.loop, waiter.future), fn)

  def _fail_all(self, error: BaseException) -> None:
    self._fail_step(error)  # type: ignore[arg-type]
    self._settle_idle_waiters(lambda: _raise(error))
    while (command := self._next_command()) is not None:  # adds that came too late
      if isinstance(command, _Add):
        post_outputs(command.mailbox.loop, [(command.mailbox, error)])
      elif isinstance(command, _Call):
        _settle(command, lambda: _raise(error))
      elif isinstance(command, WhenIdle):
        _settle(_Call(lambda: None, command.loop, command.future), lambda: _raise(error))


def _settle(command: _Call, fn: Callable[[], Any]) -> None:
  """Runs `fn` (on the engine thread) and hands its result or error to `command`'s future."""
  try:
    result, error = fn(), None
  except Exception as raised:
    result, error = None, raised

  def deliver() -> None:
    if command.future.done():  # the caller was cancelled
      return
    if error is not None:
      command.future.set_exception(error)
    else:
      command.future.set_result(result)

  try:
    command.loop.call_soon_threadsafe(deliver)
  except RuntimeError:  # the loop is closed: nobody is waiting
    pass


def _raise(error: BaseException):
  raise error


def _aborted(output: RequestOutput) -> RequestOutput:
  """`output` finished, its unfinished completions with finish_reason "abort"."""
  completions = [
    c if c.finish_reason else dataclasses.replace(c, finish_reason="abort") for c in output.outputs
  ]
  return dataclasses.replace(output, outputs=completions, finished=True)
