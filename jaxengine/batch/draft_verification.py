"""The host side of `InputBatch.rejection_sample`: checking speculative-decoding inputs, and the
NumPy result (shape legend: `R` rows, `N` live rows, `P = max_spec_len`, `V` vocabulary).

The device work is `jaxengine.sample.rejection_sample_step` (vLLM V1's rejection sampler,
`docs/sampling.md` §1.4). Everything here runs on the host before it (validate-then-mutate: a bad
input raises `ValueError` and leaves the batch unchanged) or after it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.batch.host_output import FetchedStep, LogprobsArrays
from jaxengine.batch.logits_input import check_logits, pad_device_rows
from jaxengine.config import BatchConfig
from jaxengine.params import is_int
from jaxengine.sample import RejectionOutput, rejection_sample_step

#: How far a draft distribution's sum may be from 1 (float32 softmax outputs pass; a lower
#: precision dtype allows its own epsilon, e.g. 2**-7 for bfloat16).
PROBABILITY_SUM_TOLERANCE = 1e-3


@dataclasses.dataclass(frozen=True)
class HostRejectionOutput:
  """What `InputBatch.rejection_sample` returns: NumPy over the live rows, in `req_ids` order.

  Attributes:
    sampled_token_ids: `[N, P + 1] int32` per request its accepted drafts, then one recovered or
      bonus token, then `-1` (vLLM's layout); already appended to each request's outputs.
    num_sampled: `[N] int32` tokens emitted per request (the entries before the first `-1`).
    logprobs: `LogprobsArrays` per emitted position (`token_ids` and `logprobs`
      `[N, P + 1, k + 1]`, `ranks` `[N, P + 1]`; entries past `num_sampled` are meaningless), or
      None when no request asked for logprobs.
  """

  sampled_token_ids: np.ndarray
  num_sampled: np.ndarray
  logprobs: LogprobsArrays | None


@dataclasses.dataclass(frozen=True)
class SpecInputs:
  """Checked inputs of `rejection_sample_step`, padded to all `R` rows.

  Attributes:
    target_logits: `[R, P + 1, V]` float (device or NumPy).
    draft_token_ids: `[R, P] int32` (zero padding).
    num_draft_tokens: `[R] int32`.
    draft_probs: None or `[R, P, V]` float.
  """

  target_logits: object
  draft_token_ids: np.ndarray
  num_draft_tokens: np.ndarray
  draft_probs: object | None


def _check_drafts(config: BatchConfig, num_reqs: int, drafts) -> tuple[np.ndarray, np.ndarray]:
  """`(draft_token_ids [R, P] int32, num_draft_tokens [R] int32)` from the per-request lists."""
  if isinstance(drafts, (str, bytes)) or not isinstance(drafts, (Sequence, np.ndarray)):
    raise ValueError(f"draft_token_ids must be a list of lists of token ids, got {drafts!r}")
  if len(drafts) != num_reqs:
    raise ValueError(
      f"draft_token_ids must have one list per request (num_reqs={num_reqs}), got {len(drafts)}"
    )
  limit, vocab = config.max_spec_len, config.vocab_size
  ids = np.zeros((config.max_num_reqs, limit), np.int32)
  num = np.zeros((config.max_num_reqs,), np.int32)
  for i, row in enumerate(drafts):
    if isinstance(row, (str, bytes)) or not isinstance(row, (Sequence, np.ndarray)):
      raise ValueError(f"draft_token_ids[{i}] must be a list of token ids, got {row!r}")
    if len(row) > limit:
      raise ValueError(
        f"draft_token_ids[{i}] has {len(row)} tokens, more than max_spec_len={limit}"
      )
    for j, token in enumerate(row):
      if not is_int(token) or not 0 <= token < vocab:
        raise ValueError(f"draft_token_ids[{i}][{j}] must be an int in [0, {vocab}), got {token!r}")
    ids[i, : len(row)] = np.asarray(row, np.int64)
    num[i] = len(row)
  return ids, num


def _check_draft_probs(config: BatchConfig, num_reqs: int, probs, num: np.ndarray) -> None:
  """Raises ValueError unless every real draft position of `probs` is a distribution."""
  rows = (config.max_num_reqs, num_reqs)
  trailing = {"max_spec_len": config.max_spec_len, "vocab_size": config.vocab_size}
  check_logits("draft_probs", probs, rows, trailing)
  tolerance = max(PROBABILITY_SUM_TOLERANCE, float(jnp.finfo(probs.dtype).eps))
  values = np.asarray(jax.device_get(probs), np.float64)[:num_reqs]
  for i in range(num_reqs):
    row = values[i, : num[i]]
    if not np.isfinite(row).all() or (row < 0).any() or (row > 1 + tolerance).any():
      raise ValueError(f"draft_probs[{i}] must hold probabilities in [0, 1], got {row.tolist()}")
    sums = row.sum(-1)
    bad = np.abs(sums - 1) > tolerance
    if bad.any():
      j = int(np.argmax(bad))
      raise ValueError(f"draft_probs[{i}][{j}] must sum to 1, sums to {sums[j]}")


def check_spec_inputs(
  config: BatchConfig, num_reqs: int, target_logits, draft_token_ids, draft_probs
) -> SpecInputs:
  """Checks `InputBatch.rejection_sample`'s arguments and pads them to `R` rows.

  Args:
    config: the batch's configuration (`R`, `V`, `P = max_spec_len`).
    num_reqs: `N`, the live requests.
    target_logits: `[R or N, P + 1, V]` float.
    draft_token_ids: `N` lists (in `req_ids` order) of at most `P` ids in `[0, V)`.
    draft_probs: None, or `[R or N, P, V]` float where each real draft position holds a
      distribution (entries in `[0, 1]`, summing to 1 within 1e-3 or the dtype's epsilon;
      fetched to the host to check).

  Raises:
    ValueError: naming the argument and value, for any other shape, dtype or value.
  """
  rows = (config.max_num_reqs, num_reqs)
  trailing = {"max_spec_len + 1": config.max_spec_len + 1, "vocab_size": config.vocab_size}
  check_logits("target_logits", target_logits, rows, trailing)
  ids, num = _check_drafts(config, num_reqs, draft_token_ids)
  if draft_probs is not None:
    _check_draft_probs(config, num_reqs, draft_probs, num)
  pad = lambda a: (
    a if a.shape[0] == config.max_num_reqs else pad_device_rows(a, config.max_num_reqs)
  )
  return SpecInputs(
    target_logits=pad(target_logits),
    draft_token_ids=ids,
    num_draft_tokens=num,
    draft_probs=None if draft_probs is None else pad(draft_probs),
  )


def fetch_verified(
  output: RejectionOutput, num_reqs: int, num_logprobs: int | None
) -> FetchedStep[HostRejectionOutput]:
  """Fetches the live rows of a device `RejectionOutput`: each request's emitted tokens (a
  `jaxengine.batch.host_output.Fetch`).

  Args:
    output: `rejection_sample_step`'s output over all `R` rows.
    num_reqs: `N`, the live rows (the first `N` after condense).
    num_logprobs: `k`, the largest logprobs count a live request asked for, or None (logprobs
      are then not fetched).
  """
  logprobs = None if num_logprobs is None else output.logprobs
  tokens, num, fetched = jax.device_get((output.sampled_token_ids, output.num_sampled, logprobs))
  tokens, num = np.asarray(tokens)[:num_reqs], np.asarray(num)[:num_reqs]
  host_logprobs = None
  if fetched is not None and num_logprobs is not None:
    columns = num_logprobs + 1
    host_logprobs = LogprobsArrays(
      token_ids=fetched.token_ids[:num_reqs, :, :columns],
      logprobs=fetched.logprobs[:num_reqs, :, :columns],
      ranks=fetched.ranks[:num_reqs],
    )
  return FetchedStep(
    output=HostRejectionOutput(sampled_token_ids=tokens, num_sampled=num, logprobs=host_logprobs),
    new_token_ids=[tokens[row, :count].tolist() for row, count in enumerate(num.tolist())],
  )


def run_rejection(batch, step_fn, *args, **kwargs) -> tuple[HostRejectionOutput, object]:
  """Runs a step that verifies drafts on `batch`, then appends the emitted tokens on the host.

  How an engine fuses its target model's forward pass over `P + 1` positions with the rejection
  sampler into one executable (as `InputBatch.run` does for `sample`): `step_fn(state, metadata,
  *args, **kwargs) -> (state, RejectionOutput, extra)` must donate `state` and call
  `jaxengine.sample.rejection_sample` inside its own `jax.jit`. `batch` is an `InputBatch`
  (not imported here: the batch imports this module).

  Checks and condenses first (`InputBatch.prepare_step`, through `InputBatch.run_step`). Returns
  `(HostRejectionOutput over the live rows, extra)`.

  Raises:
    ValueError: if a request already holds `max_model_len` tokens. Nothing is changed then.
  """
  return batch.run_step(step_fn, *args, fetch=fetch_verified, **kwargs)


def sample_drafts(state, metadata, inputs: SpecInputs):
  """`InputBatch.rejection_sample`'s step: `rejection_sample_step` as `run_rejection` calls a
  step (`(state, RejectionOutput, None)`)."""
  arrays = (inputs.target_logits, inputs.draft_token_ids, inputs.num_draft_tokens)
  state, output = rejection_sample_step(state, metadata, *arrays, inputs.draft_probs)
  return state, output, None
