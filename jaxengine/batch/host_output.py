"""Sampler results on the host: NumPy arrays over the live rows of an `InputBatch`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import jax
import numpy as np

from jaxengine.batch.ledger import RequestLedger
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


@dataclasses.dataclass(eq=False)
class PendingStep(Generic[HostOutput]):
  """A step `InputBatch.dispatch_step` dispatched, its output still on the device until
  `InputBatch.resolve` fetches it.

  Attributes:
    output: the step's device output (`SamplerOutput`, `MultiStepOutput`, ...).
    extra: the step's other device results (the new KV cache, ...).
    fetch: how to bring `output` to the host (a `Fetch`).
    num_logprobs: the largest logprobs count a live row asked for at dispatch, or None.
    rows: `(req_id, its RequestLedger)` of each live row at dispatch, `req_ids` order (a row
      whose ledger is another by the time the step is read was removed meanwhile).
    num_new_tokens: tokens the step appends to each of `rows`, when known at dispatch.
    fetched: the host result once resolved, else None.
  """

  output: Any
  extra: Any
  fetch: Fetch[HostOutput]
  num_logprobs: int | None
  rows: list[tuple[str, RequestLedger]]
  num_new_tokens: list[int] | None
  fetched: FetchedStep[HostOutput] | None = None


class PendingSamplerOutput:
  """What `InputBatch.sample` returns: the step is dispatched and its tokens stay on the device
  until read. Reading `sampled_token_ids` or `logprobs` (or calling `result`) fetches them, and
  every step the batch dispatched before, and appends them to the requests' outputs.

  Attributes:
    device: the sampler's `SamplerOutput` on the device over all `R` rows
      (`device.sampled_token_ids [R] int32`; rows `>= num_reqs` are padding): feed it to the next
      model step without a host round trip.
  """

  __slots__ = ("_resolve", "device")

  def __init__(self, device: SamplerOutput, resolve: Callable[[], HostSamplerOutput]):
    self.device = device
    self._resolve = resolve

  def result(self) -> HostSamplerOutput:
    """The step's `HostSamplerOutput` over the live rows at dispatch (waits for the device)."""
    return self._resolve()

  @property
  def sampled_token_ids(self) -> np.ndarray:
    """`[num_reqs] int32` the sampled tokens, `req_ids` order at dispatch."""
    return self.result().sampled_token_ids

  @property
  def logprobs(self) -> LogprobsArrays | None:
    """`LogprobsArrays`, or None when no request asked for logprobs."""
    return self.result().logprobs


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
