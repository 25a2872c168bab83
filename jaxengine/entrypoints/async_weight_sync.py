"""`AsyncLLM`'s weight-sync methods for asynchronous RL (vLLM's names): `pause_generation`,
`resume_generation`, `is_paused` and `load_weights`, each run on the engine thread between steps
(`LLMEngine`'s, `jaxengine/engine/pause.py`), the outputs a pause reads streamed as a step's are.
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
  from jaxengine.engine import LLMEngine
  from jaxengine.outputs import RequestOutput


@dataclasses.dataclass(frozen=True)
class WhenIdle:
  """A command for the engine thread: settle `future` (None) once no request is waiting or
  running in the engine (a "wait" pause); with the thread's error if it stops first."""

  loop: asyncio.AbstractEventLoop
  future: asyncio.Future


class AsyncWeightSync:
  """The mixin: `AsyncLLM` supplies `engine`, `_commands`, `_call` and `_publish`."""

  engine: LLMEngine
  _commands: queue.SimpleQueue
  #: `resume_generation` calls so far: a "wait" pause resumed while it waited does not freeze.
  _num_resumes: int = 0

  if TYPE_CHECKING:  # `AsyncLLM`'s

    async def _call(self, fn: Callable[[], Any]) -> Any: ...

    def _publish(self, step_outputs: list[RequestOutput]) -> None: ...

  async def pause_generation(self, mode: str = "keep") -> None:
    """Pauses generation between steps (vLLM's name; `LLMEngine.pause_generation`, module
    `jaxengine/engine/pause.py`): requests sent while paused wait for `resume_generation`.
    "keep" (default): running requests freeze, keeping their pages, and continue after
    `resume_generation` (their streams just stall); "wait": returns once the requests in the
    engine have finished (their streams go on meanwhile; at once over a "keep" pause, whose
    frozen requests cannot finish; a `resume_generation` while it waits calls the pause off);
    "abort": they end now, their streams' last output finished with finish reason "abort" and
    the tokens and logprobs they had (requests sent while paused are held, not aborted). A step
    already dispatched is read first, its tokens streamed.

    Raises:
      ValueError: a mode other than "keep", "wait" or "abort" (nothing changes).
      EngineDeadError: the engine thread has stopped.
    """
    from jaxengine.engine.pause import check_pause_mode  # the engine's package loads with it

    check_pause_mode(mode)
    resumes = self._num_resumes
    # Already frozen (a "keep" pause): kept requests cannot finish, and pausing again is harmless.
    if mode == "wait" and not await self._call(self.engine.is_generation_frozen):
      await self._call(self.engine.hold_new_requests)
      future = asyncio.get_running_loop().create_future()
      self._commands.put(WhenIdle(asyncio.get_running_loop(), future))
      await future  # the engine thread steps the requests in the engine to their end
      if self._num_resumes != resumes:
        return  # a resume_generation while it waited called the pause off
    await self._call(lambda: self._publish(self.engine.pause_generation(mode)))

  async def resume_generation(self) -> None:
    """Ends a pause (vLLM's name): kept requests go on (those past their
    `SamplingParams.max_staleness` end first, their streams' last output finished with finish
    reason "abort"), held ones start. Harmless when not paused.

    Raises:
      EngineDeadError: the engine thread has stopped.
    """
    self._num_resumes += 1
    await self._call(lambda: self._publish_dropped(self.engine.resume_generation))

  async def is_paused(self) -> bool:
    """Whether generation is paused (`LLMEngine.is_paused`), asked between steps."""
    return await self._call(self.engine.is_paused)

  async def weights_on_host(self) -> bool:
    """Whether sleep level 1 holds the weights in host memory (`ModelRunner.weights_on_host`),
    asked between steps: a level-2 sleep now would discard that copy."""
    return await self._call(lambda: self.engine.runner.weights_on_host)

  async def load_weights(self, weights, weight_version: int | None = None) -> None:
    """New weights between steps, nothing compiled (`LLM.load_weights`); also while paused.
    Tokens generated with them carry `weight_version` (default: the current version + 1) in
    `CompletionOutput.weight_versions`; requests it leaves past their
    `SamplingParams.max_staleness` end now (finish reason "abort", with the tokens they had).

    Raises:
      ValueError: as `LLM.load_weights` (nothing changes).
      EngineDeadError: the engine thread has stopped.
    """
    await self._call(
      lambda: self._publish_dropped(lambda: self.engine.load_weights(weights, weight_version))
    )

  def _publish_dropped(self, fn: Callable[[], None]) -> None:
    """Runs `fn` on the engine thread, then streams the final outputs of the requests the
    staleness bound dropped (`LLMEngine.take_dropped`), even while paused."""
    fn()
    self._publish(self.engine.take_dropped())
