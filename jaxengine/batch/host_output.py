"""Sampler results on the host: NumPy arrays over the live rows of an `InputBatch`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import jax
import numpy as np

from jaxengine.sample import SamplerOutput

HostOutput = TypeVar("HostOutput")


@dataclasses.dataclass(frozen=True)
class LogprobsArrays:
  """Logprobs of the live rows, on the host (`N` live rows, `k` the largest requested count).

  Attributes:
    token_ids: `[N, k + 1] int32`; column 0 the sampled token, then the top k by value.
    logprobs: `[N, k + 1] float32` their values in the batch's logprobs mode.
    ranks: `[N] int32` the sampled token's rank (1 is best; ties count against it).
  """

  token_ids: np.ndarray
  logprobs: np.ndarray
  ranks: np.ndarray


@dataclasses.dataclass(frozen=True)
class HostSamplerOutput:
  """What `InputBatch.sample` and `InputBatch.run` return: NumPy over the live rows, in
  `req_ids` order.

  Attributes:
    sampled_token_ids: `[N] int32`, already appended to each request's outputs.
    logprobs: `LogprobsArrays`, or None when no request asked for logprobs.
  """

  sampled_token_ids: np.ndarray
  logprobs: LogprobsArrays | None


@dataclasses.dataclass(frozen=True)
class FetchedStep(Generic[HostOutput]):
  """A step's device output fetched to the host, and the tokens it appends (see
  `InputBatch.run_step`, which appends them to its own records).

  Attributes:
    output: the host result over the live rows (`HostSamplerOutput`, `HostRejectionOutput`, ...).
    new_token_ids: `N` lists, in `req_ids` order: the tokens each live row's request emitted.
  """

  output: HostOutput
  new_token_ids: list[list[int]]


#: What `InputBatch.run_step` calls on a step's device output: `fetch(output, num_reqs,
#: num_logprobs) -> FetchedStep`, with `num_reqs` the live rows (the first `N` after condense) and
#: `num_logprobs` the largest logprobs count a live request asked for, or None (then logprobs need
#: not be fetched at all).
Fetch = Callable[[Any, int, int | None], FetchedStep[HostOutput]]


def fetch_sampled(
  output: SamplerOutput, num_reqs: int, num_logprobs: int | None
) -> FetchedStep[HostSamplerOutput]:
  """Fetches the live rows of a `sample_step` output: one token per row (a `Fetch`).

  Args:
    output: `sample_step`'s device output over all `R` rows.
    num_reqs: `N`, the live rows (the first `N` rows, after condense).
    num_logprobs: `k`, the largest logprobs count a live request asked for, or None (then the
      logprobs are not fetched at all).

  Returns:
    A `FetchedStep` of a `HostSamplerOutput`.
  """
  device_logprobs = None if num_logprobs is None else output.logprobs
  tokens, fetched = jax.device_get((output.sampled_token_ids, device_logprobs))
  logprobs: LogprobsArrays | None = None
  if fetched is not None and num_logprobs is not None:
    columns = num_logprobs + 1
    logprobs = LogprobsArrays(
      token_ids=fetched.token_ids[:num_reqs, :columns],
      logprobs=fetched.logprobs[:num_reqs, :columns],
      ranks=fetched.ranks[:num_reqs],
    )
  tokens = np.asarray(tokens)[:num_reqs]
  return FetchedStep(
    output=HostSamplerOutput(sampled_token_ids=tokens, logprobs=logprobs),
    new_token_ids=[[token] for token in tokens.tolist()],
  )
