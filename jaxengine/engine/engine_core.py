"""`EngineCore`: one data-parallel group's scheduler, model runner and step loop (vLLM V1's
`EngineCore`).

A core owns a `Scheduler`, a `ModelRunner` (its persistent batch, KV-cache pages and weights on
its own devices), its grammar matchers and its n-gram drafter. One `step()`:

  1. the scheduler chooses the step's tokens within its budget and the free pages: running
     completions' decodes and prefill chunks first, then waiting completions admitted into
     free rows (`core/scheduler.py`);
  2. the runner adds the admitted ones to the persistent batch and runs one ragged step: the
     model once over every scheduled token, then the sampler on the rows whose last known token
     was computed; with a `speculative_config`, when some row has n-gram drafts and
     `SpeculativePolicy` expects them to pay, the drafts are more query tokens of their rows and
     the rejection sampler keeps one to k + 1 tokens per row (`worker/verify_step.py`); with
     `num_decode_steps` k > 1, a step that only decodes runs up to k steps in one device loop
     (`worker/multi_step.py`);
  3. `_update_from_output`, the one place a step's tokens reach the requests, appends them
     (grammar checks, logprob dicts, text, stop rules), and `_finish`, the one finish path
     (also taken by `abort` and by a token its grammar rejects), takes finished completions out
     of the scheduler, the batch and the grammar matchers (the next step condenses and admits
     more).

With asynchronous scheduling (the default, `async_scheduling`) `step()` dispatches step t + 1
(stages 1-2) while step t's tokens are still on the device, then reads step t (stage 3).

`LLMEngine` holds one core per data-parallel group and routes each request to one of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import cast

import jax

from jaxengine.batch import HostSamplerOutput, InputBatch
from jaxengine.core.kv_cache_manager import KVCacheManager
from jaxengine.core.request import Completion, Request
from jaxengine.core.scheduler import Scheduler, SchedulerOutput
from jaxengine.engine.output_processor import OutputProcessor
from jaxengine.engine.structured import StructuredOutputs, abort_rejected
from jaxengine.engine_config import EngineConfig
from jaxengine.models.interface import Model
from jaxengine.outputs import RequestOutput
from jaxengine.spec_decode.ngram_proposer import (
  CROSSOVER_TOKENS,
  DEFAULT_CROSSOVER_TOKENS,
  SpecDecodingStats,
)
from jaxengine.spec_decode.policy import SpeculativePolicy
from jaxengine.spec_decode.speculation import Speculation
from jaxengine.tokenizer import Tokenizer
from jaxengine.worker.model_runner import ModelRunner
from jaxengine.worker.outputs import InFlightStep


class EngineCore:
  """One data-parallel group: a scheduler and a model runner over its own rows and pages.

  Args:
    model: the `Model`, weights loaded (the runner keeps its own copy, placed on `config.mesh`).
    config: the group's `EngineConfig`, resolved for the model (`EngineConfig.for_model`): its
      `max_num_reqs` rows, its `mesh` (None: the default device), its pool's size.
    tokenizer: the engine's `Tokenizer` or None (no grammars then).
    eos_token_ids: the EOS id first, then the other ids that end generation.
    output_processor: the engine's `OutputProcessor` (shared by every core: it holds no
      per-request state).
    spec_decode_stats: the engine's speculative-decoding counters (shared by every core).
  """

  def __init__(
    self,
    model: Model,
    config: EngineConfig,
    tokenizer: Tokenizer | None,
    eos_token_ids: Sequence[int],
    output_processor: OutputProcessor,
    spec_decode_stats: SpecDecodingStats,
  ) -> None:
    self.config = config
    self.num_decode_steps = config.num_decode_steps
    batch = config_input_batch(config, model.vocab_size, eos_token_ids)
    self.runner = ModelRunner(model, batch, config)
    self.max_model_len = batch.max_model_len
    self.structured: StructuredOutputs | None = None
    if tokenizer is not None:
      eos = eos_token_ids[0] if eos_token_ids else None
      self.structured = StructuredOutputs(tokenizer, model.vocab_size, eos, batch.max_num_reqs)
    #: The pages' owner (vLLM's scheduler side): the scheduler allocates through it and sends
    #: the changed block tables to the runner in each `SchedulerOutput`.
    # A hybrid model caches prefixes only with its snapshot slots, which an explicit
    # enable_prefix_caching=True asks for (`worker/recurrent_state.py`, `core/state_snapshots.py`).
    hybrid = self.runner.num_state_slots > 0
    self.kv_cache_manager = KVCacheManager(
      self.runner.num_blocks,
      config.block_size,
      enable_caching=config.prefix_caching and (not hybrid or self.runner.num_state_snapshots > 0),
      groups=self.runner.kv_cache_groups,
      max_num_batched_tokens=config.max_num_batched_tokens,
    )
    self.scheduler = Scheduler(
      batch.max_num_reqs,
      self.kv_cache_manager,
      cast(int, config.max_num_batched_tokens),  # validated: never None
      config.enable_chunked_prefill,
      config.max_loras,
      num_state_slots=self.runner.num_state_slots,
      num_state_snapshots=self.runner.num_state_snapshots,
    )
    self.output_processor = output_processor
    #: The verify decision's cost model (`spec_decode/ngram_proposer.py`): set it high to verify
    #: whenever some row has a draft.
    self.spec_crossover_tokens = CROSSOVER_TOKENS.get(
      jax.default_backend(), DEFAULT_CROSSOVER_TOKENS
    )
    self._speculation: Speculation | None = None
    if config.speculative is not None:
      policy = SpeculativePolicy(config.speculative, self.max_model_len, spec_decode_stats)
      self._speculation = Speculation(policy)
    self._async_scheduling = config.scheduling_overlaps
    #: The step dispatched by the last `step()` and not read yet (asynchronous scheduling).
    self._in_flight: _Dispatched | None = None
    #: Frozen by a pause (`engine/pause.py`): `step` schedules nothing, reads what is in flight.
    self.paused = False
    #: Stamped on the tokens of each step dispatched (`CompletionOutput.weight_versions`).
    self.weight_version = 0

  # --- requests -------------------------------------------------------------------------------

  def add_request(self, request: Request) -> None:
    """Queues every completion of a validated `request`."""
    self.scheduler.add_request(request)

  def check_fits(self, request: Request) -> None:
    """Refuses a request that could never fit in the pool of pages (ValueError)."""
    max_tokens = request.params.max_tokens
    generated = self.max_model_len if max_tokens is None else max_tokens
    longest = len(request.prompt_token_ids) + generated
    self.kv_cache_manager.check_fits(min(longest, self.max_model_len))

  @property
  def num_unfinished(self) -> int:
    """Completions waiting or running here (the load `LLMEngine` balances)."""
    return len(self.scheduler.waiting) + len(self.scheduler.running)

  @property
  def in_flight_weight_version(self) -> int | None:
    """The weight version of the step in flight (asynchronous scheduling); None when none is."""
    return self._in_flight.weight_version if self._in_flight else None

  def has_unfinished(self) -> bool:
    """Whether any completion is waiting or running here."""
    return self.scheduler.has_unfinished()

  def abort(self, request_ids: set[str]) -> None:
    """Drops these requests' completions, waiting or running (unknown ids are ignored); a
    running one leaves through `_finish` with finish reason "abort"."""
    for completion in self.scheduler.abort(request_ids):
      completion.finish_reason = completion.finish_reason or "abort"
      self._finish(completion)

  def drain(self) -> None:
    """Reads and drops the step left in flight, if any (asynchronous scheduling leaves one for
    rows that finished since its dispatch), so that no step of this core is on the device."""
    self._collect_in_flight()

  # --- weights and memory: the runner's device side, the prefix cache's host side -------------

  def load_weights(self, weights) -> None:
    """`ModelRunner.load_weights`, then the prefix cache emptied: later prompts compute their
    keys and values with the new weights (running requests keep theirs, as in vLLM)."""
    self.runner.load_weights(weights)
    self.scheduler.reset_prefix_cache()

  def load_lora_weights(self, lora_request, adapter) -> None:
    """`ModelRunner.load_lora_weights`, then the prefix cache emptied (its pages were computed
    with the old values)."""
    self.runner.load_lora_weights(lora_request, adapter)
    self.scheduler.reset_prefix_cache()

  def sleep(self, level: int) -> None:
    """`ModelRunner.sleep`, then the prefix cache emptied (its pages are gone)."""
    self.runner.sleep(level)
    self.scheduler.reset_prefix_cache()

  def free_kv_cache(self) -> int:
    """`ModelRunner.free_kv_cache` (the device bytes freed), the prefix cache emptied."""
    freed = self.runner.free_kv_cache()
    self.scheduler.reset_prefix_cache()
    return freed

  def reset_prefix_cache(self) -> bool:
    """Forgets every prefix hash (pages in use stay with their requests); returns True."""
    self.scheduler.reset_prefix_cache()
    return True

  # --- the step -------------------------------------------------------------------------------

  def step(self) -> list[RequestOutput]:
    """One ragged step: the scheduler's decodes, prefill chunks and admissions, the model once
    over all their tokens, the sampler on the rows that finish; then the stop rules.

    With asynchronous scheduling the step is dispatched first and the previous step (left on the
    device by the last call) is read while it runs; a step is left in flight only when its
    outcome does not change what the next one schedules (`_overlaps`). A step that does not
    overlap is read at once, unless this call read the step before it: then it is read first
    thing in the next call, before anything is scheduled, so that each call reports one step's
    tokens (a stream then gets one chunk per token, the last too).

    Returns:
      A `RequestOutput` (cumulative so far) for every request that advanced in the steps read.
    """
    scheduler, runner = self.scheduler, self.runner
    if self.paused:
      return latest_outputs(self._collect_in_flight())
    outputs = []
    in_flight = self._in_flight
    if in_flight is not None and (in_flight.read_first or self._speculation is not None):
      outputs = self._collect_in_flight()  # drafts are looked up in the rows' last tokens
      if not self.has_unfinished():  # it finished every completion: nothing to schedule
        return latest_outputs(outputs)
    current = None
    scheduled = self._schedule()
    if scheduled is not None:
      bitmask = self._bitmask()
      if self.num_decode_steps > 1 and bitmask is None:
        steps = scheduler.schedule_decode_steps(
          scheduled, self.num_decode_steps, self.max_model_len
        )
        if steps is not None:
          return latest_outputs(outputs + self._decode_steps(steps))
      step = runner.dispatch(scheduled, bitmask)
      current = _Dispatched(step, dict(scheduler.running), self.weight_version)
      if current.step.num_new_tokens is not None:  # known now: plan the next step with them
        self._add_placeholders(current.step.num_new_tokens)
        scheduler.update_after_step(scheduled)
    outputs += self._collect_in_flight()
    if current is None:
      return latest_outputs(outputs)
    if self._overlaps(current.step):
      self._in_flight = current
      return latest_outputs(outputs)
    if outputs and self._async_scheduling:  # one step's tokens a call: read it first next time
      self._in_flight = dataclasses.replace(current, read_first=True)
      return latest_outputs(outputs)
    return latest_outputs(outputs + self._collect(current))

  def _collect_in_flight(self) -> list[RequestOutput]:
    """Reads the step the last `step()` left on the device, if any (`_collect`)."""
    previous, self._in_flight = self._in_flight, None
    return [] if previous is None else self._collect(previous)

  def _add_to_batch(self, admitted: Sequence[Completion]) -> None:
    """Gives admitted completions their rows and their grammars' matchers."""
    structured = self.structured
    for completion in admitted:
      self.runner.add(completion)
      if structured is not None and completion.request.grammar is not None:
        structured.add(completion.seq_id, completion.request.grammar)

  def _schedule(self) -> SchedulerOutput | None:
    """The scheduler's plan for the next step (drafts proposed first), its admitted completions
    added to the batch; None when it schedules no token."""
    scheduler, structured = self.scheduler, self.structured
    drafts = {}
    if self._speculation is not None and not (structured is not None and len(structured)):
      num_rows = self.runner.row_bucket(len(scheduler.running))
      drafts = self._speculation.propose(scheduler, num_rows, self.spec_crossover_tokens)
    scheduled = scheduler.schedule(drafts)
    self._add_to_batch(scheduled.admitted)
    return scheduled if scheduled.num_scheduled_tokens else None

  def _bitmask(self):
    """The grammar-bitmask builder of the running structured-output rows, or None."""
    structured = self.structured
    return structured.bitmask if structured is not None and len(structured) else None

  def _add_placeholders(self, num_new_tokens: dict[str, int]) -> None:
    """Counts a dispatched step's tokens on their completions until they are read."""
    running = self.scheduler.running
    for seq_id, count in num_new_tokens.items():
      if count:
        running[seq_id].num_output_placeholders += count

  def _overlaps(self, step: InFlightStep) -> bool:
    """Whether the next step may be dispatched before `step` is read: asynchronous scheduling
    is on and nothing the next step schedules depends on `step`'s tokens. It falls back (reads
    `step` at once) when its token counts are known only from its output (drafts), when
    grammars must advance before the next bitmask (structured outputs), when it completes
    prompt logprobs, and when some row reaches its length limit with it (the row must not be
    scheduled again)."""
    if not self._async_scheduling or step.num_new_tokens is None or self._bitmask() is not None:
      return False
    if step.prompt_logprobs_wanted:
      return False
    running = self.scheduler.running
    for seq_id, count in step.num_new_tokens.items():
      completion = running.get(seq_id)  # None: finished since the dispatch
      if count and completion is not None and self._reaches_length_limit(completion):
        return False
    return True

  def _reaches_length_limit(self, completion: Completion) -> bool:
    """Whether `completion`'s tokens, read and in flight, reach `max_tokens` or
    `max_model_len`."""
    max_tokens = completion.params.max_tokens or self.max_model_len
    num_output = len(completion.token_ids) + completion.num_output_placeholders
    return num_output >= max_tokens or completion.num_tokens_with_placeholders >= self.max_model_len

  def _collect(self, dispatched: _Dispatched) -> list[RequestOutput]:
    """Reads a dispatched step and applies its tokens (`_update_from_output`); rows whose
    completion finished or was aborted since the dispatch drop theirs (a request id used again
    meanwhile names another completion, which the step's tokens never reach)."""
    scheduler, step = self.scheduler, dispatched.step
    decoded = self.runner.collect(step)
    num_sampled = decoded.sampled.num_sampled.tolist()
    running = {
      seq_id: completion
      for seq_id, completion in dispatched.running.items()
      if scheduler.running.get(seq_id) is completion
    }
    if step.num_new_tokens is None:  # drafts: the computed counts are known only now
      num_accepted = {}
      if self._speculation is not None:
        num_accepted = self._speculation.record(
          step.scheduled, decoded.req_ids, decoded.sampled.num_sampled
        )
      scheduler.update_after_step(step.scheduled, num_accepted)
    else:
      for seq_id, count in step.num_new_tokens.items():
        if count and seq_id in running:
          running[seq_id].num_output_placeholders -= count
    for seq_id, produced in zip(decoded.req_ids, num_sampled):
      completion = running.get(seq_id)
      if produced and completion is not None and completion.request.prompt_logprobs is None:
        self._set_prompt_logprobs(completion, decoded.prompt_logprobs)  # its prompt just ended
    completions = [running.get(seq_id) for seq_id in decoded.req_ids]
    return self._update_from_output(
      decoded.req_ids, decoded.sampled.steps, num_sampled, completions, dispatched.weight_version
    )

  def _decode_steps(self, scheduled: SchedulerOutput) -> list[RequestOutput]:
    """A k-step decode (`worker/multi_step.py`): each row's computed tokens advance by the
    tokens it sampled. The loop ends at the first finish while requests wait for a row or pages
    (waiting, or running without pages after a preemption).

    With a step still in flight (asynchronous scheduling) the loop is dispatched first (it reads
    each row's last token from the batch's device state), then that step is read and applied,
    then the loop's tokens; a row the step before finished drops the loop's tokens. The loop's
    own token counts are known only from its output, so it is read at once.

    Returns:
      The outputs of the step before (if one was in flight) and of the loop, one per request.
    """
    scheduler, weight_version = self.scheduler, self.weight_version
    waiting = bool(scheduler.waiting) or len(scheduled.num_decode_steps) < len(scheduler.running)
    running = dict(scheduler.running)
    decoded = self.runner.execute_decode_steps(scheduled, self.num_decode_steps, running, waiting)
    outputs = self._collect_in_flight()
    self.runner.store_loop_routed_experts()  # after the step before it, before its finishes
    num_sampled = decoded.sampled.num_sampled.tolist()
    computed = dict(zip(decoded.req_ids, num_sampled))
    counts = {seq_id: computed[seq_id] for seq_id in scheduled.num_decode_steps}
    scheduler.update_after_step(dataclasses.replace(scheduled, num_scheduled_tokens=counts))
    completions = [_still_running(scheduler.running, running.get(s)) for s in decoded.req_ids]
    return outputs + self._update_from_output(
      decoded.req_ids, decoded.sampled.steps, num_sampled, completions, weight_version
    )

  # --- the lifecycle ----------------------------------------------------------------------------

  def _update_from_output(
    self,
    req_ids: Sequence[str],
    steps: Sequence[HostSamplerOutput],
    num_sampled: Sequence[int],
    completions: Sequence[Completion | None] | None = None,
    weight_version: int = 0,
  ) -> list[RequestOutput]:
    """Applies a step's tokens to the running completions, then finishes those that stopped
    (vLLM's `update_from_output`): the one place outputs of decode, the k-step loop and
    verification reach the requests.

    Args:
      req_ids: the step's rows (`seq_id`s), in the order of the arrays below.
      steps: the sampler's host output, position by position (one for a decode step).
      num_sampled: valid positions of each row (`steps[j]` holds a token of row `i` for
        `j < num_sampled[i]`).
      completions: each row's completion, None for one that finished since the step's
        dispatch; default: the running completions of `req_ids`.
      weight_version: the weights' version at the step's dispatch, stamped on its tokens.

    Returns:
      A `RequestOutput` for every request with a completion among `req_ids` still running
      (asynchronous scheduling reads a step after the next one is dispatched: a completion that
      finished in between drops the step's token), row order.
    """
    if completions is None:
      completions = [self.scheduler.running[seq_id] for seq_id in req_ids]
    for j, sampled in enumerate(steps):
      for row, completion in enumerate(completions):
        if j < num_sampled[row] and completion is not None and completion.finish_reason is None:
          self._append_token(completion, row, sampled, weight_version)
    advanced: dict[str, Request] = {}
    for row, completion in enumerate(completions):
      if completion is None:
        continue
      if num_sampled[row] or completion.finish_reason is not None:
        advanced[completion.request.request_id] = completion.request
      if completion.finish_reason is not None:
        self._finish(completion)
    return [r.output() for r in advanced.values()]

  def _append_token(
    self, completion: Completion, row: int, sampled: HostSamplerOutput, weight_version: int
  ) -> None:
    """Appends row `row`'s token of `sampled` to `completion` (stop rules, its grammar), stamped
    with `weight_version`; a token its grammar rejects is dropped and the completion aborted."""
    structured = self.structured
    token = int(sampled.sampled_token_ids[row])
    if structured is not None and not structured.accepts(completion.seq_id, token):
      if structured.is_finished(completion.seq_id):  # another constraint masked its EOS
        completion.finish_reason = "stop"  # end without it
      else:
        abort_rejected(completion, token)  # never emit what the grammar forbids
      return
    self.output_processor.append(completion, row, sampled)
    completion.weight_versions.append(weight_version)
    if structured is not None and structured.advance(completion.seq_id, token):
      completion.finish_reason = completion.finish_reason or "stop"

  def _finish(self, completion: Completion) -> None:
    """The one way a running completion leaves, once it has a finish reason (a stop rule, its
    grammar, or an abort): out of the scheduler, its row freed, its grammar matcher dropped.
    Its request reports it in the step's outputs or `pop_finished`. Its routed experts are read
    first, while its pages hold them (`ModelRunner.read_routed_experts`)."""
    if self.config.enable_return_routed_experts:  # the step in flight's are not stored yet
      in_flight = self._in_flight.step if self._in_flight is not None else None
      unstored = in_flight.num_counted_tokens(completion.seq_id) if in_flight is not None else 0
      completion.routed_experts = self.runner.read_routed_experts(completion, unstored)
    self.scheduler.finish(completion)
    self.runner.remove(completion.seq_id)
    if self.structured is not None:
      self.structured.remove(completion.seq_id)

  def _set_prompt_logprobs(self, completion, prompt_logprobs) -> None:
    request = completion.request
    if completion.index != 0 or completion.params.prompt_logprobs is None:
      return
    if request.request_id in prompt_logprobs:
      self.output_processor.prompt_logprobs(completion, prompt_logprobs[request.request_id])
    else:  # a one-token prompt: nothing predicts its only token
      request.prompt_logprobs = [None]


def config_input_batch(config: EngineConfig, vocab_size: int, eos_token_ids) -> InputBatch:
  """The persistent batch of an engine core with `config` (its rows, lengths, logprobs, seed,
  processors, block-table width and batch invariance) over a `vocab_size` vocabulary."""
  return InputBatch(
    config.max_num_reqs,
    config.resolved_max_model_len,
    vocab_size,
    max_num_logprobs=config.max_num_logprobs,
    logprobs_mode=config.logprobs_mode,
    eos_token_ids=eos_token_ids,
    seed=config.seed,
    logits_processors=config.logits_processors,
    max_num_blocks_per_req=config.max_num_blocks_per_req,
    batch_invariant=config.batch_invariant,
  )


@dataclasses.dataclass(frozen=True)
class _Dispatched:
  """A step on the device, the running completions when it was dispatched, and whether the
  next `step()` must read it before it schedules (`_overlaps` was False)."""

  step: InFlightStep
  running: dict[str, Completion]
  weight_version: int  # the weights' version at the dispatch, stamped on its tokens
  read_first: bool = False  # read before the next step is scheduled (it does not overlap)


def _still_running(
  running: dict[str, Completion], completion: Completion | None
) -> Completion | None:
  """`completion` if it still runs (not finished or aborted since a dispatch), else None."""
  if completion is None or running.get(completion.seq_id) is not completion:
    return None
  return completion


def latest_outputs(outputs: list[RequestOutput]) -> list[RequestOutput]:
  """One output per request, its latest (two steps read in one call may both report it)."""
  return list({output.request_id: output for output in outputs}.values())
