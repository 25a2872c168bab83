"""`InputBatch`: the host side of the persistent batch (vLLM V1's class of the same name).

`BatchComposition` (its base, `jaxengine.batch.composition`) keeps which request occupies which
row and updates the device-side `BatchState` at each composition change; `InputBatch` builds the
batch from vLLM-style keywords and runs the steps over it: `sample` (the sampler alone),
`rejection_sample` (draft verification), and `run` / `run_step` / `dispatch_step` for a jitted
step of one's own (a model's forward pass fused with sampling), each replacing the device state
and appending the tokens it emitted.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from jaxengine.batch.block_table import BlockTable
from jaxengine.batch.composition import BatchComposition
from jaxengine.batch.draft_verification import (
  HostRejectionOutput,
  check_spec_inputs,
  run_rejection,
  sample_drafts,
)
from jaxengine.batch.host_output import (
  Fetch,
  HostOutput,
  HostSamplerOutput,
  PendingSamplerOutput,
  PendingStep,
  fetch_sampled,
)
from jaxengine.batch.ledger import BatchLedger
from jaxengine.batch.logits_input import check_logits, pad_device_rows, sample_logits
from jaxengine.batch.logits_processors import resolve_logits_processors
from jaxengine.config import (
  DEFAULT_DEEP_CANDIDATE_BUDGETS,
  DEFAULT_MAX_SPEC_LEN,
  DEFAULT_NUM_TOPK_CANDIDATES,
  BatchConfig,
)
from jaxengine.sample import SamplingMetadata


class InputBatch(BatchComposition):
  """A fixed-capacity batch of running requests with per-request sampling parameters.

  Args:
    max_num_reqs, max_model_len, vocab_size, max_num_logprobs, logprobs_mode,
    max_num_stop_token_ids, max_num_logit_bias, max_num_bad_words, max_bad_word_len,
    num_topk_candidates, deep_candidate_budgets, max_spec_len: the `BatchConfig` fields (see there);
      `InputBatch.from_config` takes a built config instead.
    eos_token_ids: EOS ids added to every request's min_tokens stop set (as vLLM's engine does,
      even with `ignore_eos`).
    seed: seed of the batch key from which unseeded requests' keys are derived.
    logits_processors: your `jaxengine.LogitsProcessor`s: classes (built with no arguments),
      instances or `"module:Class"` strings (see `jaxengine.sample.custom`).
    max_num_blocks_per_req: with a paged KV cache, the pages a row can hold: the batch then keeps
      a `BlockTable` (`block_table`) that moves with the rows; 0 (default): no block table.
    batch_invariant: `BatchConfig.batch_invariant` (logprobs normalised in a fixed order).

  The batch samples; it does not decide when a request ends. Engine-level `SamplingParams` fields
  (`n`, `max_tokens`, `stop`, `bad_words` strings, `ignore_eos`, `include_stop_str_in_output`,
  `skip_special_tokens`, `prompt_logprobs` values, the grammar of `structured_outputs`: see
  `set_grammar_bitmask`) are left to `LLMEngine`. A request samples until removed or full.

  Raises:
    ValueError: naming the field and value, for a bad `BatchConfig` field or EOS ids outside
      the vocabulary.
  """

  def __init__(
    self,
    max_num_reqs: int,
    max_model_len: int,
    vocab_size: int,
    max_num_logprobs: int = 20,
    logprobs_mode: str = "raw_logprobs",
    *,
    eos_token_ids: Sequence[int] | int | None = (),
    max_num_stop_token_ids: int = 32,
    max_num_logit_bias: int = 128,
    max_num_bad_words: int = 32,
    max_bad_word_len: int = 16,
    num_topk_candidates: int = DEFAULT_NUM_TOPK_CANDIDATES,
    deep_candidate_budgets: Sequence[int] = DEFAULT_DEEP_CANDIDATE_BUDGETS,
    max_spec_len: int = DEFAULT_MAX_SPEC_LEN,
    seed: int = 0,
    logits_processors: Sequence | None = None,
    max_num_blocks_per_req: int = 0,
    batch_invariant: bool = False,
  ):
    config = BatchConfig(
      max_num_reqs=max_num_reqs,
      max_model_len=max_model_len,
      vocab_size=vocab_size,
      max_num_logprobs=max_num_logprobs,
      logprobs_mode=logprobs_mode,
      max_num_stop_token_ids=max_num_stop_token_ids,
      max_num_logit_bias=max_num_logit_bias,
      max_num_bad_words=max_num_bad_words,
      max_bad_word_len=max_bad_word_len,
      num_topk_candidates=num_topk_candidates,
      deep_candidate_budgets=tuple(deep_candidate_budgets),
      max_spec_len=max_spec_len,
      logits_processors=resolve_logits_processors(logits_processors),
      batch_invariant=batch_invariant,
    )
    super().__init__(config, eos_token_ids, seed)
    if max_num_blocks_per_req:
      self.block_table = BlockTable(max_num_reqs, max_num_blocks_per_req)

  @classmethod
  def from_config(
    cls, config: BatchConfig, *, eos_token_ids: Sequence[int] | int | None = (), seed: int = 0
  ) -> InputBatch:
    """An empty batch of the given configuration (for an engine that builds the config once).

    Raises:
      ValueError: for EOS ids outside the vocabulary, or a `config` that is not a BatchConfig.
    """
    if not isinstance(config, BatchConfig):
      raise ValueError(f"config must be a BatchConfig, got {type(config)}")
    batch = cls.__new__(cls)
    BatchComposition.__init__(batch, config, eos_token_ids, seed)
    return batch

  # --- sampling ------------------------------------------------------------------------------

  def sample(self, logits) -> PendingSamplerOutput:
    """Samples one token per request; the token joins the request's outputs when read.

    Returns as soon as the step is dispatched (the sampled tokens stay on the device): reading
    the result's `sampled_token_ids` or `logprobs`, or the batch's `output_token_ids` /
    `req_output_token_ids`, brings every step sampled so far to the host, in order, and
    appends its tokens. Counts (`num_tokens`, the `max_model_len` check) include the tokens not
    read yet. `result.device` holds the tokens on the device, to feed a model without a host
    round trip.

    Condenses first if removals left holes; logits rows follow the condensed `req_ids`, so call
    `condense()` yourself before computing logits after a removal.

    Args:
      logits: `[max_num_reqs, vocab_size]` (rows `>= num_reqs` ignored; never recompiles) or
        `[num_reqs, vocab_size]` (padded on device; compiles once per distinct `num_reqs`), any
        float dtype, rows in `req_ids` order.

    Returns:
      A `PendingSamplerOutput`: read it as a `HostSamplerOutput` of NumPy arrays,
      `sampled_token_ids [num_reqs] int32` and `logprobs` (None unless a request asked; else
      `[num_reqs, k + 1]` with k the largest requested count).

    Raises:
      ValueError: for logits of another shape or a non-float dtype, or a request already at
        `max_model_len` tokens (its token would have nowhere to go). Nothing is changed then.
    """
    rows = (self.max_num_reqs, self.num_reqs)
    check_logits("logits", logits, rows, {"vocab_size": self.vocab_size})
    if logits.shape[0] != self.max_num_reqs:
      logits = pad_device_rows(logits, self.max_num_reqs)  # NumPy goes straight in: one compile
    pending = self.dispatch_step(
      sample_logits, logits, fetch=fetch_sampled, num_new_tokens=[1] * self.num_reqs
    )
    return PendingSamplerOutput(pending.output, functools.partial(self.resolve, pending))

  def rejection_sample(
    self, target_logits, draft_token_ids, draft_probs=None
  ) -> HostRejectionOutput:
    """Speculative decoding: verifies each request's drafts (vLLM V1's rejection sampler) and
    appends the emitted tokens. `target_logits [max_num_reqs or num_reqs, max_spec_len + 1, V]`,
    `draft_token_ids` a list per request (condensed `req_ids` order) of at most `max_spec_len`
    ids, `draft_probs` None (point-mass drafts) or `[.., max_spec_len, V]`. Returns a
    `HostRejectionOutput` (`sampled_token_ids [num_reqs, max_spec_len + 1]`, -1 after the last
    emitted token); raises ValueError, nothing changed, for bad arguments (see
    `jaxengine.batch.draft_verification`) or a full request. Engines fusing the target model's
    forward pass with the sampler call `jaxengine.batch.draft_verification.run_rejection`
    instead."""
    inputs = check_spec_inputs(
      self.config, self.num_reqs, target_logits, draft_token_ids, draft_probs
    )
    return run_rejection(self, sample_drafts, inputs)[0]

  def run(self, step_fn, *args) -> tuple[HostSamplerOutput, object]:
    """Runs a jitted step that samples from the batch, then does the host bookkeeping.

    This is how an engine fuses its model's forward pass with sampling into one executable:
    `step_fn(state, metadata, *args) -> (state, SamplerOutput, extra)` must be jitted, donate
    `state`, and sample with `jaxengine.sample.sample` inside.

    Checks and condenses first (`prepare_step`, whose ValueError it raises). `*args` are the
    step's other arguments (weights, KV cache, ...). Returns `(HostSamplerOutput over the live
    rows, extra)`.
    """
    return self.run_step(step_fn, *args, fetch=fetch_sampled)

  def run_step(
    self, step_fn, *args, fetch: Fetch[HostOutput], **kwargs
  ) -> tuple[HostOutput, object]:
    """Runs any jitted step over the batch's state and appends the tokens it emitted.

    `dispatch_step`, then `resolve` at once: `step_fn(state, metadata, *args, **kwargs) ->
    (state, device_output, extra)` must donate `state` and keep its structure, shapes and
    shardings; `fetch(device_output, num_reqs, max_requested_logprobs)` (a
    `jaxengine.batch.host_output.Fetch`) brings the live rows to the host, and the batch
    appends each row's emitted tokens to its request's outputs. `run` (one token per row),
    `jaxengine.batch.step_loop.run_steps` (a k-step loop) and
    `jaxengine.batch.draft_verification.run_rejection` (draft verification) are its uses.

    Returns:
      `(fetch's host output over the live rows, extra)`.

    Raises:
      ValueError: if a request already holds `max_model_len` tokens. Nothing is changed then.
    """
    pending = self.dispatch_step(step_fn, *args, fetch=fetch, **kwargs)
    return self.resolve(pending), pending.extra

  def dispatch_step(
    self,
    step_fn,
    *args,
    fetch: Fetch[HostOutput],
    num_new_tokens: Sequence[int] | None = None,
    **kwargs,
  ) -> PendingStep[HostOutput]:
    """Runs a jitted step as `run_step` does, leaving its output on the device.

    The one way a step replaces the device state: `prepare_step` (checks, condense), then
    `step_fn`. Its tokens join the requests' outputs when `resolve` brings them to the host
    (steps resolve in dispatch order; a request removed meanwhile drops its tokens). The next
    step can be dispatched first when `num_new_tokens` says how many tokens each live row
    gets: they count in `num_tokens` until read (in each row's `num_output_placeholders`: the
    batch counts them in its own `BatchLedger`s; a row added with its owner's ledger, an
    engine's `Completion`, is counted by its owner).

    Args:
      step_fn, *args, **kwargs: as `run_step`.
      fetch: as `run_step`.
      num_new_tokens: `[num_reqs]` tokens the step appends to each live row (`req_ids`
        order), or None when only the output tells (then the next `prepare_step` resolves it).

    Returns:
      The `PendingStep` (its `output` and `extra` are device values).

    Raises:
      ValueError: if a request already holds `max_model_len` tokens. Nothing is changed then.
    """
    metadata = self.prepare_step()
    self._state, output, extra = step_fn(self._state, metadata, *args, **kwargs)
    rows = [
      (req_id, ledger)
      for req_id, ledger in zip(self._req_ids, self._ledgers)
      if req_id is not None and ledger is not None
    ]
    if num_new_tokens is not None:  # counted until read
      for (_, ledger), count in zip(rows, num_new_tokens):
        if isinstance(ledger, BatchLedger):
          ledger.num_output_placeholders += count
    pending = PendingStep(
      output=output,
      extra=extra,
      fetch=fetch,
      num_logprobs=self.max_requested_logprobs,
      rows=rows,
      num_new_tokens=None if num_new_tokens is None else list(num_new_tokens),
    )
    if self._steps.push(pending):  # keep a bounded backlog: read the oldest
      self.resolve(self._steps.oldest())
    return pending

  def prepare_step(self) -> SamplingMetadata:
    """Checks that every row has room for a token, condenses, and returns the metadata. Raises:
    ValueError: if a request already holds `max_model_len` tokens. Nothing is changed then.
    """
    if self._steps.last_counts_unknown():
      self.resolve_all()  # the last step's counts are known only from its output
    full = [rid for rid in self.req_id_to_index if self.num_tokens(rid) >= self.max_model_len]
    if full:
      raise ValueError(
        f"requests {full} already hold max_model_len={self.max_model_len} tokens; "
        "remove them before sampling"
      )
    self.condense()  # a no-op without holes
    return self.sampling_metadata
