"""Compiling the decode step a prompt leads to while the prompt's own step compiles and runs.

An engine that was not precompiled compiles each step shape when a step first needs it, one after
the other on the engine's thread: a first prompt compiles its prefill shape and the sampler, and
the next step, the prompt's first decode (other token and row buckets), compiles the model again.
Each is seconds on a CPU (SmolLM2-135M: about 4 s of a quiet 2-core VM's), and XLA compiles one
executable mostly on one core. So when a step carries prompt tokens and one of its requests will
decode afterwards, `CompileAhead.start` compiles the shape of the decode step that follows (every
row of the batch decoding one token: `ModelRunner.step_buckets`) on a thread of its own, beside the
engine's own compile of the prompt's shape and the sampler; the decode step waits for it
(`CompileAhead.wait`) rather than compile it a second time.

Outputs do not change: the decode step runs in its own bucket as before, only compiled earlier
(the executable is lowered from the shapes and shardings the runner passes, `aot/executables.py`'s
`engine_executables` over the live runner, so the runner's call finds it in JAX's in-memory cache).
A compile that fails is logged and the decode step compiles its shape itself. Not used with
speculative decoding or a k-step decode (`num_decode_steps > 1`), whose decodes run other
executables, and pointless after `precompile` or beside `jaxengine serve`'s compile, which know
every shape already (`StepShapes.knows`).
"""

from __future__ import annotations

import concurrent.futures
import logging
from typing import TYPE_CHECKING

from jaxengine.worker.buckets import StepShape

if TYPE_CHECKING:
  from jaxengine.core.request import Completion
  from jaxengine.core.scheduler import SchedulerOutput
  from jaxengine.engine.engine_core import EngineCore

logger = logging.getLogger(__name__)

#: The variant of a plain step (no prompt logprobs, no drafts): `ModelRunner.dispatch`'s.
PLAIN = (False, False)


class CompileAhead:
  """One engine core's compiles ahead of its steps (see the module)."""

  def __init__(self, core: EngineCore) -> None:
    self._core = core
    self._pending: dict[StepShape, concurrent.futures.Future] = {}
    self._pool: concurrent.futures.ThreadPoolExecutor | None = None

  def decode_shape(self, num_reqs: int) -> StepShape:
    """The shape of a step decoding one token in each of `num_reqs` rows."""
    num_tokens, num_rows = self._core.runner.step_buckets(num_reqs, num_reqs)
    return StepShape(num_tokens, num_rows, PLAIN)

  def start(self, scheduled: SchedulerOutput, running: dict[str, Completion]) -> bool:
    """Before `scheduled` is dispatched: compiles, on the thread, the decode shape of the batch
    after it, if the step carries prompt tokens, some scheduled request will sample more than
    one token, and the shape is neither the step's own nor known (compiled, or expected from
    another thread). Returns whether a compile started."""
    runner = self._core.runner
    if runner.is_sleeping():
      return False
    num_reqs = runner.input_batch.num_reqs
    num_scheduled = len(scheduled.num_scheduled_tokens)
    if scheduled.total_num_scheduled_tokens <= num_scheduled or scheduled.spec_token_ids:
      return False  # decodes only: their shape is this step's
    if not any(
      seq_id in running and running[seq_id].params.max_tokens != 1
      for seq_id in scheduled.num_scheduled_tokens
    ):
      return False
    shape = self.decode_shape(num_reqs)
    own = StepShape(*runner.step_buckets(scheduled.total_num_scheduled_tokens, num_reqs), PLAIN)
    if shape == own or shape in self._pending or runner.compiled_shapes.knows(shape):
      return False
    executable = self._executable(shape)
    if executable is None:
      return False
    if self._pool is None:
      self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="compile-ahead")
    self._pending[shape] = self._pool.submit(self._compile, executable, shape)
    return True

  def wait(self, shape: StepShape) -> None:
    """Before a step of `shape` runs: waits for its compile if one is under way."""
    future = self._pending.pop(shape, None)
    if future is not None:
      future.result()

  def _executable(self, shape: StepShape):
    """The runner's ragged step of `shape`, ready to lower (`engine_executables`)."""
    from jaxengine.aot.executables import engine_executables
    from jaxengine.entrypoints.background_compile import RunnerParts

    for executable in engine_executables(RunnerParts.of(self._core)):
      if executable.name == "ragged_step" and executable.step == shape:
        return executable
    return None

  def _compile(self, executable, shape: StepShape) -> None:
    try:
      executable.lower().compile()
    except Exception:  # the step then compiles its own shape, as without compiling ahead
      logger.exception("compiling %s ahead failed; its first step compiles it", executable.shape)
      return
    self._core.runner.compiled_shapes.mark_compiled(shape)
