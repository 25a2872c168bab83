"""Sampler results on the host: NumPy arrays over the live rows of an `InputBatch`."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxengine.sample import SamplerOutput


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


def to_host(output: SamplerOutput, outputs: list, num_logprobs: int | None) -> HostSamplerOutput:
  """Fetches the live rows of a device `SamplerOutput` and appends each row's token to its list
  in `outputs`.

  Args:
    output: `sample_step`'s device output over all `R` rows.
    outputs: the batch's output token lists by row; its length is `N`, the live rows (the first
      `N` rows, after condense).
    num_logprobs: `k`, the largest logprobs count a live request asked for, or None (then the
      logprobs are not fetched at all).
  """
  num_reqs = len(outputs)
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
  for row, token in enumerate(tokens.tolist()):
    outputs[row].append(token)
  return HostSamplerOutput(sampled_token_ids=tokens, logprobs=logprobs)
