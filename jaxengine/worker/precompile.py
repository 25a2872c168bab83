"""Precompiling a model runner: every executable its steps can reach, run once on an empty batch
before serving, so that serving compiles nothing (`LLMEngine.precompile`, `jaxengine serve`).

The executables (`worker/model_runner.py`'s module docstring): the ragged step for every
`ModelRunner.step_shapes` pair (token bucket, row bucket), with and without prompt logprobs, and
with `num_speculative_tokens` > 0 the verify step beside each; with `num_decode_steps` k > 1 the
k-step decode loop per row bucket; the batch's own updates and the LoRA slots' writes. Each step
runs over padding only (no row), through the runner's own `step_inputs`, `run_step` and
`run_decode_steps`, so it compiles exactly what `dispatch` and `execute_decode_steps` later call.
`aot/executables.py` lists the same executables as shapes.
"""

from __future__ import annotations

from typing import Any, cast

import jax
from tqdm import tqdm

from jaxengine.core.scheduler import SchedulerOutput
from jaxengine.worker.buckets import StepShape
from jaxengine.worker.model_runner import ModelRunner


def precompile(
  runner: ModelRunner,
  num_decode_steps: int = 1,
  use_tqdm: bool = True,
  num_speculative_tokens: int = 0,
) -> int:
  """Compiles every executable a step of `runner` can reach (see the module).

  Args:
    runner: the `ModelRunner`, awake, its batch empty.
    num_decode_steps: `k`; above 1 the k-step loop is compiled per row bucket.
    use_tqdm: show a progress bar over the step shapes.
    num_speculative_tokens: above 0 the verify step is compiled beside each ragged step.

  Returns:
    The number of step shapes run (ragged and verify steps, then k-step loops).

  Raises:
    ValueError: if the batch holds requests.
    RuntimeError: while asleep or without weights (`ModelRunner.check_awake`).
  """
  runner.check_awake()
  batch = runner.input_batch
  if batch.num_reqs:
    raise ValueError(f"precompile needs an empty batch, it holds {batch.num_reqs} requests")
  batch.precompile_updates()
  if runner.lora is not None:
    runner.lora.precompile()
  empty = SchedulerOutput([], {}, {}, {}, [])
  columns = batch.state.num_top_logprobs + 1  # `dispatch`'s prompt logprobs
  variants = [
    (num_tokens, num_rows, drafted, columns if prompt_logprobs else 0)
    for prompt_logprobs in (False, True)
    for num_tokens, num_rows in runner.step_shapes(prompt_logprobs)
    for drafted in ([False, True] if num_speculative_tokens else [False])
  ]
  for num_tokens, num_rows, drafted, columns in tqdm(
    variants, desc="Compiling", disable=not use_tqdm
  ):
    variant = (bool(columns), drafted)
    runner.compiled_shapes.mark_compiled(StepShape(num_tokens, num_rows, variant))
    inputs, drafts = runner.step_inputs(empty, num_tokens, num_rows, drafted=drafted)
    batch.resolve(runner.run_step(inputs, columns, drafts))
  if num_decode_steps > 1:  # the k-step loop: one executable per row bucket
    for num_rows in runner.row_buckets:
      runner.run_decode_steps(empty, {}, num_rows, num_decode_steps, end_on_first_finish=False)
  jax.block_until_ready(cast(Any, runner.kv_cache))
  return len(variants) + (len(runner.row_buckets) if num_decode_steps > 1 else 0)
