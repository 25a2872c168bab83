"""Several sample steps per host round trip: the host bookkeeping of a k-step dispatch.

`InputBatch.run` handles a step that samples one token per row. An engine that loops k
decode-and-sample steps on the device (`lax.while_loop` over the fused step) returns up to k
tokens per row, the rows having stopped at different steps; `run_steps` calls such a step and
appends each row's valid tokens to the batch's host records, as `InputBatch.run` appends one.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxengine.batch.host_output import FetchedStep, HostSamplerOutput, LogprobsArrays
from jaxengine.batch.input_batch import InputBatch
from jaxengine.sample import LogprobsTensors


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class MultiStepOutput:
  """What a k-step device loop returns (shape legend: `k` steps, `R` rows).

  Attributes:
    sampled_token_ids: `[k, R] int32` the token of each step (garbage past `num_sampled`).
    logprobs: `LogprobsTensors` with a leading `k` axis (`[k, R, c]`, ranks `[k, R]`).
    num_sampled: `[R] int32` how many steps appended a token to each row (a row stops on the
      device at its stop ids, length limits, ...; later steps leave it unchanged).
  """

  sampled_token_ids: jax.Array
  logprobs: LogprobsTensors
  num_sampled: jax.Array


@dataclasses.dataclass(frozen=True)
class HostMultiStepOutput:
  """A k-step dispatch on the host, over the live rows in `req_ids` order.

  Attributes:
    steps: one `HostSamplerOutput` per step the loop ran (a row's entry in step `j` is valid
      only for `j < num_sampled[row]`).
    num_sampled: `[N] int32` valid steps of each row; those tokens are already appended to the
      batch's records.
  """

  steps: list[HostSamplerOutput]
  num_sampled: np.ndarray


def run_steps(batch: InputBatch, step_fn, *args, **kwargs) -> tuple[HostMultiStepOutput, object]:
  """Runs a jitted k-step loop on `batch`, then appends each row's valid tokens on the host.

  `step_fn(state, metadata, *args) -> (state, MultiStepOutput, extra)` must be jitted and
  donate `state`. Checks and condenses as `InputBatch.run` does (through `InputBatch.run_step`).

  Args:
    batch: the persistent batch.
    step_fn: the jitted loop.
    *args, **kwargs: its other arguments.

  Returns:
    `(HostMultiStepOutput over the live rows, extra)`.

  Raises:
    ValueError: if a request already holds `max_model_len` tokens. Nothing is changed then.
  """
  return batch.run_step(step_fn, *args, fetch=fetch_steps, **kwargs)


def fetch_steps(
  output: MultiStepOutput, num_reqs: int, num_logprobs: int | None
) -> FetchedStep[HostMultiStepOutput]:
  """Fetches the live rows of a k-step loop's output: up to k tokens per row (a `Fetch`)."""
  logprobs = None if num_logprobs is None else output.logprobs
  tokens, counts, fetched = jax.device_get((output.sampled_token_ids, output.num_sampled, logprobs))
  tokens, counts = np.asarray(tokens)[:, :num_reqs], np.asarray(counts)[:num_reqs]
  num_steps = int(counts.max(initial=0))
  steps = []
  for j in range(num_steps):
    step_logprobs = None
    if fetched is not None and num_logprobs is not None:
      columns = num_logprobs + 1
      step_logprobs = LogprobsArrays(
        token_ids=fetched.token_ids[j, :num_reqs, :columns],
        logprobs=fetched.logprobs[j, :num_reqs, :columns],
        ranks=fetched.ranks[j, :num_reqs],
      )
    steps.append(HostSamplerOutput(sampled_token_ids=tokens[j], logprobs=step_logprobs))
  new_token_ids = [tokens[:count, row].tolist() for row, count in enumerate(counts.tolist())]
  return FetchedStep(
    output=HostMultiStepOutput(steps=steps, num_sampled=counts), new_token_ids=new_token_ids
  )
