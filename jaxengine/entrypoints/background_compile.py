"""`jaxengine serve`'s compile: what the first requests need before the server listens, every other
executable on a thread of its own while it serves.

`LLMEngine.precompile` runs every step shape once on the empty batch before anything is served:
about 40 executables for the default model, minutes on a CPU the first time. The server instead
(`ServeCompile`):

1. compiles the batch's own updates and LoRA's slot writes (as `precompile` does), then the
   *first set* (`first_set`): for each step variant a request needs without asking for it (the
   plain step; with `speculative_config` the verify step too) its smallest shape (one request's
   decode), a shape of 128 tokens over every row (a chat's prompt, a batch's decodes) and its
   largest, which holds any step of that variant, with their samplers; with `num_decode_steps`
   > 1 the k-step loops (no larger loop runs a smaller one);
2. listens (`/health` answers);
3. compiles the rest on a background thread, in the order a growing batch reaches them (row
   bucket, then token bucket; the prompt-logprobs variants last).

Every executable is lowered and compiled from the shapes and shardings the engine's own call
passes (`aot/executables.py`'s `engine_executables` over the live runner's parts,
`RunnerParts`), so the engine's first call of a shape finds it in JAX's in-memory cache: it
traces once and compiles nothing. Until a shape is compiled, its steps run in the smallest
compiled shape that holds it (`worker/buckets.py`, `StepShapes.expect`): more padding, the same
outputs up to the model's floating-point reassociation (bit for bit with `batch_invariant`). A
step that no compiled shape holds (prompt logprobs asked before the thread reached them)
compiles its own shape on the engine's thread, as without precompile. Once the thread is done,
serving compiles nothing, as after `precompile`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax

from jaxengine.aot.executables import Executable, engine_executables
from jaxengine.batch import InputBatch
from jaxengine.engine.engine_core import EngineCore
from jaxengine.engine.llm_engine import LLMEngine
from jaxengine.engine_config import EngineConfig
from jaxengine.lora import LoRAManager
from jaxengine.worker.buckets import FULL_ROWS_MIN_TOKENS, StepShape, StepShapes, sample_rows
from jaxengine.worker.compile_beside import abstract
from jaxengine.worker.device_steps import DeviceSteps
from jaxengine.worker.placement import MeshPlacement

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class RunnerParts:
  """A live runner's parts as `engine_executables` reads them (its `StepSource`): the jitted steps
  the runner calls, its arrays as `jax.ShapeDtypeStruct`s in their own shardings (taken on the
  engine's thread: a donated array may be gone by the time the compiling thread reads it), and
  host arrays (NumPy, or uncommitted on the default device) as the runner passes them: without a
  sharding off a mesh, replicated on one.
  """

  config: EngineConfig
  batch: InputBatch
  steps: DeviceSteps | None
  placement: MeshPlacement | None
  weights: Any
  kv_cache: Any
  lora: LoRAManager | None
  vocab_size: int
  input_sharding: Any

  @classmethod
  def of(cls, core: EngineCore) -> RunnerParts:
    runner = core.runner
    steps = DeviceSteps(
      runner.ragged_forward,
      runner.sample_produced,
      runner.verify_forward,
      runner.rejection_sample_produced,
      runner.decode_steps,
    )
    parts = cls(
      core.config, runner.input_batch, steps, runner.placement, None, None, runner.lora,
      runner.input_batch.vocab_size, runner.input_sharding,
    )  # fmt: skip
    parts.weights, parts.kv_cache = parts.sharded(runner.weights), parts.sharded(runner.kv_cache)
    return parts

  def sharded(self, tree: Any, shardings: Any = None) -> Any:
    """`tree`'s leaves as the runner's call passes them, abstract: a device array in its own
    sharding, a host array as `input_sharding`, a `jax.ShapeDtypeStruct` (an output of an earlier
    part of the step: logits) in `shardings` when that is one `Sharding`, else as
    `input_sharding` (as `AbstractEngine.sharded`'s default)."""
    one = shardings if isinstance(shardings, jax.sharding.Sharding) else self.input_sharding
    return jax.tree.map(lambda x: self._spec(x, one), tree)

  def inputs_shardings(self, inputs_type: type) -> Any:
    """As `AbstractEngine.inputs_shardings` (`sharded` ignores it: the host arrays go as the
    runner passes them, replicated on a mesh)."""
    return None if self.placement is None else self.placement.step_inputs_shardings(inputs_type)

  def _spec(self, x: Any, shape_sharding: Any) -> Any:
    if isinstance(x, jax.ShapeDtypeStruct) and x.sharding is None and shape_sharding is not None:
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shape_sharding)
    return abstract(x, self.input_sharding)  # an array as the runner passes it


def _sample_rows_of(executable: Executable) -> int | None:
  """The rows of a plain sampler executable (its logits' leading axis), None for another."""
  return executable.args[2].shape[0] if executable.name == "sample" else None


#: Token bucket of the first set's middle shape (at the largest row bucket): it holds a chat's
#: prompt and any batch's decode, at a small fraction of the largest shape's cost (a padded token
#: costs about what a real one does: SmolLM2's 2,048-token step takes seconds on a CPU).
PROMPT_TOKENS = FULL_ROWS_MIN_TOKENS


def first_set(executables: Sequence[Executable], row_buckets: Sequence[int]) -> list[int]:
  """Indices into `executables` of what the first requests need (see the module): per variant
  without prompt logprobs its smallest step shape (one request's decode), the largest row
  bucket's at `PROMPT_TOKENS` (prompts and batches of decodes) and its largest (any step), their
  samplers (a plain step's per `sample_rows`; a verify step's rejection sampler, which
  `engine_executables` yields right after it), and every k-step loop; in their order."""
  steps = [e.step for e in executables if e.step is not None]
  chosen: set[StepShape] = set()
  for variant in {s.variant for s in steps if not cast(tuple, s.variant)[0]}:
    of_variant = [s for s in steps if s.variant == variant]
    largest = max(of_variant, key=_size)
    prompts = [
      s for s in of_variant if s.num_rows == largest.num_rows and s.num_tokens >= PROMPT_TOKENS
    ]
    chosen |= {min(of_variant, key=_size), min(prompts, key=_size, default=largest), largest}
  plain_rows = {
    sample_rows(s.num_rows, list(row_buckets)) for s in chosen if not cast(tuple, s.variant)[1]
  }
  first, previous = [], None
  for i, e in enumerate(executables):
    if (
      e.step in chosen
      or e.name == "decode_steps"
      or _sample_rows_of(e) in plain_rows
      or (e.name == "rejection_sample" and previous in chosen)
    ):
      first.append(i)
    previous = e.step if e.step is not None else previous
  return first


def _size(step: StepShape) -> tuple[int, int]:
  return step.num_tokens, step.num_rows


@dataclasses.dataclass
class _CorePlan:
  """One core's executables: `first` compiled before listening, `rest` in the background."""

  shapes: StepShapes
  first: list[Executable]
  rest: list[Executable]


def _compile(executable: Executable) -> None:
  executable.lower().compile()


def _compile_threads(num_executables: int) -> int:
  """Threads compiling the first set: one per core (XLA:CPU and libtpu compile an executable
  mostly on one), at most one per executable."""
  return max(1, min(num_executables, os.cpu_count() or 1))


class ServeCompile:
  """The server's staged compile of an engine's executables (see the module).

  Use: `compile_first()` on the engine's thread before serving (the batch empty), then `start()`
  once the engine serves; `wait()` blocks until the background is done (tests, benchmarks).

  Attributes:
    num_first: executables compiled by `compile_first` (the batch's updates not counted).
    num_rest: executables left to the background thread.
    num_done: of those, compiled so far.
    error: the exception that stopped the background thread, or None.
  """

  def __init__(self, engine: LLMEngine) -> None:
    """Plans every core's executables (host work only; the batch must be empty).

    Raises:
      ValueError: if requests are running.
    """
    self._engine = engine
    self._plans = []
    for core in engine.cores:
      executables = list(engine_executables(RunnerParts.of(core)))
      first = set(first_set(executables, core.runner.row_buckets))
      self._plans.append(
        _CorePlan(
          core.runner.compiled_shapes,
          [e for i, e in enumerate(executables) if i in first],
          [e for i, e in enumerate(executables) if i not in first],
        )
      )
    self.num_first = sum(len(p.first) for p in self._plans)
    self.num_rest = sum(len(p.rest) for p in self._plans)
    self.num_done = 0
    self.error: BaseException | None = None
    self._thread: threading.Thread | None = None
    self._stop = threading.Event()

  def compile_first(self) -> None:
    """Compiles the batch's updates, LoRA's slot writes and every core's first set (its
    executables side by side, a thread per core of the host); marks the first set's shapes
    compiled and the rest expected (`StepShapes.expect`)."""
    for core, plan in zip(self._engine.cores, self._plans):
      runner = core.runner
      runner.check_awake()
      if runner.input_batch.num_reqs:
        raise ValueError("the server's compile needs an empty batch")
      runner.input_batch.precompile_updates()
      if runner.lora is not None:
        runner.lora.precompile()
      with concurrent.futures.ThreadPoolExecutor(_compile_threads(len(plan.first))) as pool:
        list(pool.map(_compile, plan.first))  # XLA compiles one executable on one core
      for executable in plan.first:
        if executable.step is not None:
          plan.shapes.mark_compiled(executable.step)
      plan.shapes.expect(e.step for e in plan.rest if e.step is not None)

  def start(self, on_done: Callable[[ServeCompile, float], None] | None = None) -> None:
    """Starts the background thread over every core's rest; `on_done(self, seconds)` runs on it
    at the end (not after an error or `stop`)."""
    self._thread = threading.Thread(
      target=self._run, args=(on_done,), name="jaxengine-compile", daemon=True
    )
    self._thread.start()

  def wait(self, timeout: float | None = None) -> bool:
    """Waits for the background thread; whether it has ended."""
    if self._thread is not None:
      self._thread.join(timeout)
    return self._thread is None or not self._thread.is_alive()

  def stop(self) -> None:
    """Asks the background thread to end after the executable it is compiling."""
    self._stop.set()

  def _run(self, on_done: Callable[[ServeCompile, float], None] | None) -> None:
    start = time.perf_counter()
    try:
      for plan in self._plans:
        self._compile_rest(plan)
        if self._stop.is_set():
          return
    except BaseException as error:  # the engine then compiles what it meets, as without precompile
      logger.exception("the background compile failed; shapes left compile when first used")
      self.error = error
      for plan in self._plans:
        plan.shapes.cancel_expected()
      return
    if on_done is not None:
      on_done(self, time.perf_counter() - start)

  def _compile_rest(self, plan: _CorePlan) -> None:
    """Compiles `plan.rest` in order; a step's shape is marked compiled once its sampler is too
    (which `engine_executables` puts before the step or right after it)."""
    pending: StepShape | None = None
    for executable in plan.rest:
      if self._stop.is_set():
        plan.shapes.cancel_expected()
        return
      if executable.step is not None and pending is not None:
        plan.shapes.mark_compiled(pending)
      _compile(executable)
      self.num_done += 1
      pending = executable.step or pending
    if pending is not None:
      plan.shapes.mark_compiled(pending)
