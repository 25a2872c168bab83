"""`LLMEngine`: continuous batching, wiring the input processor, scheduler, runner and output
processor together.

One `step()`:

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
     (also taken by `abort_request` and by a token its grammar rejects), takes finished
     completions out of the scheduler, the batch and the grammar matchers (the next step
     condenses and admits more).

With asynchronous scheduling (the default) steps 1-2 of the next step run before step 3 of the
last one: `step()` dispatches step t + 1 while step t's tokens are still on
the device, then reads step t (see `LLMEngine`, `async_scheduling`).

The engine's options come in one validated `EngineConfig` (`engine_config.py`).
"""

from __future__ import annotations

import dataclasses
import itertools
import warnings
from collections.abc import Sequence
from typing import Any, cast

import jax

from jaxengine.batch import HostSamplerOutput, InputBatch
from jaxengine.core.kv_cache_manager import KVCacheStats
from jaxengine.core.request import Completion, Request
from jaxengine.core.scheduler import Scheduler, SchedulerOutput
from jaxengine.engine.input_processor import InputProcessor
from jaxengine.engine.output_processor import OutputProcessor
from jaxengine.engine.structured import StructuredOutputs
from jaxengine.engine_config import EngineConfig, engine_config, with_engine_options
from jaxengine.models.interface import Model, check_model
from jaxengine.outputs import RequestOutput
from jaxengine.params import SamplingParams
from jaxengine.spec_decode.ngram_proposer import (
  CROSSOVER_TOKENS,
  DEFAULT_CROSSOVER_TOKENS,
  SpecDecodingStats,
)
from jaxengine.spec_decode.policy import SpeculativePolicy
from jaxengine.spec_decode.speculation import Speculation
from jaxengine.tokenizer import Tokenizer
from jaxengine.worker.model_runner import InFlightStep, ModelRunner

#: One request for `LLMEngine.add_requests`: `(request_id or None, prompt, params or None)`.
RequestSpec = tuple[str | None, object, SamplingParams | None]


class LLMEngine:
  """Continuous batching over a persistent `InputBatch` and a paged KV cache.

  Args:
    model: a `jaxengine.models.Model` (e.g. `jaxengine.models.Llama`), weights loaded.
    tokenizer: its `Tokenizer`, or None (then prompts must be token ids, no text is produced and
      stop strings / bad_words strings are rejected).
    eos_token_id: overrides the tokenizer's / model's EOS id; a list gives the EOS id first and
      more ids that also end generation (a checkpoint's `generation_config.json` lists several):
      like vLLM, those finish with `stop_reason` set to the id, unless `ignore_eos`.
    config: an `EngineConfig`; keywords given as well replace its fields.
    **options: `EngineConfig` fields as keywords (vLLM's names: `max_num_reqs`,
      `max_model_len`, `max_num_logprobs`, `logprobs_mode`, `seed`, `mesh`, ...; a loader-only
      field such as `dtype` has no effect on a built model). Those the engine reads:
    max_num_reqs: rows of the batch (sequences decoded at once).
    max_model_len: longest prompt plus output, in tokens; None (default): the model's
      `max_position_embeddings` (`config` then holds the resolved value).
    mesh: None (one device) or a `jax.sharding.Mesh` with axes ``("data", "model")``, or
      `tensor_parallel_size` to build one: see `ModelRunner` and `jaxengine.parallel`. The
      pages split over key/value heads; `data_parallel_size` must be 1 for now.
    kv_cache_memory_bytes, num_kv_blocks, gpu_memory_utilization, block_size,
      max_num_batched_tokens, enable_chunked_prefill, attention_backend: the paged cache and
      its scheduler; see `EngineConfig` and `worker/model_runner.py`.
    num_decode_steps: `k`, the most decode-and-sample steps one `step()` runs in a single device
      loop (default 1: one token per step). Larger values pay the host round trip once per `k`
      tokens. Tokens, text and finish reasons are those of k = 1 (rows stop on the device at
      EOS, stop ids and the length limits, never before `min_tokens`; stop strings are checked
      on the host afterwards and what follows a match is discarded); logprob values agree to
      float32 rounding (a finished row leaves the row bucket at the end of the dispatch).
      While requests wait for a row, a dispatch ends as soon as some row finishes, so a freed
      row is refilled at once; a request added while the batch runs waits at most one
      dispatch of `k` steps. While a row with structured outputs runs, steps go one at a time
      (its grammar advances on the host after every token). On a mesh too (the loop declares
      its shardings and samples vocabulary-sharded logits). Only a step that only decodes
      loops; it reserves pages for up to k tokens per row (never preempting for them) and
      loops over pages (`worker/multi_step.py`).
    logits_processors: your `jaxengine.LogitsProcessor`s: classes (built with no arguments),
      instances or `"module:Class"` strings.
    speculative_config: None, or vLLM's dict ``{"method": "ngram", "num_speculative_tokens": k,
      "prompt_lookup_max": 4, "prompt_lookup_min": 2}`` (`spec_decode/ngram_proposer.py`): each step
      drafts up to k tokens per running completion from its own prompt and output, verifies
      them in one model pass over k + 1 positions and keeps what the rejection sampler accepts
      (one to k + 1 tokens per row and step; the output distribution is unchanged, greedy
      output is that of plain decoding up to float rounding). A step decodes one token per row
      as usual when no row has a draft, when a cost model expects the rows' drafts (weighed by
      each row's acceptance so far) to emit too few extra tokens to pay for the wider pass
      (`worth_verifying`, `spec_crossover_tokens`), and while a row with structured outputs
      runs; k must be below `max_model_len`. With `num_decode_steps` > 1 too: each step
      verifies when drafts pay, else runs the k-step loop when it only decodes, else a plain
      ragged step.
      Counters: `spec_decode_stats`. The drafts are query tokens of the ragged step
      (`worker/verify_step.py`), scheduled within the token budget and the free pages (never
      preempting for them).
    enable_prefix_caching: later prompts that start as an earlier one did (running or
      finished) share its full `block_size`-token pages instead of computing them again (vLLM's
      option and hash chain; `core/kv_cache_manager.py`). None (default): on. Requests asking for
      `prompt_logprobs` skip the lookup. The cache is emptied by `load_weights` and
      `reset_prefix_cache`; `kv_cache_stats` counts its queries, hits and evictions. Same
      outputs (logprob values to float32 rounding: the cached prefix was computed in another
      executable).
    async_scheduling: None (default) or True: on, with every other setting; False: off
      (vLLM's name).
      Each `step()` schedules and dispatches a step before it reads the one the last call
      dispatched (the scheduler counts that step's tokens as placeholders; the model reads
      each row's last token from the batch's device state), so the host's work on step t
      (logprob dicts, text, stop rules, freeing rows) runs while step t + 1 computes, and
      `step()` reports a step's tokens one call later. A completion found finished one step
      late has its extra token dropped: tokens, text, finish reasons and logprobs (to float32
      rounding) are those of synchronous steps for greedy and seeded requests. A step is read
      before the next one is scheduled when the next depends on its tokens: a running grammar
      (structured outputs), prompt logprobs it completes, a row reaching `max_tokens` or
      `max_model_len` with it; with a `speculative_config` every step first reads the one in
      flight (drafts are looked up in the rows' last tokens). A k-step loop
      (`num_decode_steps`) is dispatched while the step before is in flight (it reads each
      row's last token on the device); it and a verify step are read before the next step is
      scheduled: how many tokens each row got is known only from their output.
      `has_unfinished_requests` is False once every request has finished, even with a step
      left in flight for rows that finished since (the next `step` reads and drops it).

  Raises:
    TypeError: a keyword that is not an `EngineConfig` field.
    ValueError: anything `EngineConfig` refuses (naming the field and value), a model that does
      not implement `Model`, or `max_model_len` above the model's `max_position_embeddings`.
  """

  @with_engine_options
  def __init__(
    self,
    model: Model,
    tokenizer: Tokenizer | None = None,
    *,
    eos_token_id: int | Sequence[int] | None = None,
    config: EngineConfig | None = None,
    **options: Any,
  ):
    check_model(model)
    config = engine_config(config, options, "LLMEngine")
    self.config = config = config.for_model(model.max_position_embeddings)
    self.speculative_config = config.speculative
    self.num_decode_steps = config.num_decode_steps
    if eos_token_id is None:
      eos_token_id = tokenizer.eos_token_id if tokenizer is not None else model.eos_token_id
    if isinstance(eos_token_id, Sequence):
      eos_token_ids = list(dict.fromkeys(int(t) for t in eos_token_id))
    else:
      eos_token_ids = [] if eos_token_id is None else [int(eos_token_id)]
    self.tokenizer = tokenizer
    self.eos_token_id: int | None = eos_token_ids[0] if eos_token_ids else None
    batch = InputBatch(
      config.max_num_reqs,
      config.resolved_max_model_len,
      model.vocab_size,
      max_num_logprobs=config.max_num_logprobs,
      logprobs_mode=config.logprobs_mode,
      eos_token_ids=eos_token_ids,
      seed=config.seed,
      logits_processors=config.logits_processors,
      max_num_blocks_per_req=config.max_num_blocks_per_req,
      batch_invariant=config.batch_invariant,
    )
    self.runner = ModelRunner(model, batch, config)
    self.max_num_reqs = batch.max_num_reqs
    self.max_model_len = batch.max_model_len
    self.structured: StructuredOutputs | None = None
    if tokenizer is not None:
      self.structured = StructuredOutputs(
        tokenizer, model.vocab_size, self.eos_token_id, self.max_num_reqs
      )
    self.input_processor = InputProcessor(
      tokenizer,
      self.max_model_len,
      batch.validate_request,
      None if self.structured is None else self.structured.compile,
    )
    self.scheduler = Scheduler(
      self.max_num_reqs,
      self.runner.kv_cache_manager,
      cast(int, config.max_num_batched_tokens),  # validated: never None
      config.enable_chunked_prefill,
    )
    self.output_processor = OutputProcessor(
      tokenizer, self.eos_token_id, self.max_model_len, model.vocab_size, eos_token_ids[1:]
    )
    self._requests: dict[str, Request] = {}
    self._ids = itertools.count()
    self.spec_decode_stats = SpecDecodingStats()
    #: The verify decision's cost model (`spec_decode/ngram_proposer.py`): set it high to verify
    #: whenever some row has a draft.
    self.spec_crossover_tokens = CROSSOVER_TOKENS.get(
      jax.default_backend(), DEFAULT_CROSSOVER_TOKENS
    )
    self._speculation: Speculation | None = None
    if self.speculative_config is not None:
      policy = SpeculativePolicy(
        self.speculative_config, self.max_model_len, self.spec_decode_stats
      )
      self._speculation = Speculation(policy)
    self._async_scheduling = config.scheduling_overlaps
    #: The step dispatched by the last `step()` and not read yet (asynchronous scheduling).
    self._in_flight: _Dispatched | None = None

  # --- requests -------------------------------------------------------------------------------

  def add_request(
    self, request_id: str | None, prompt, params: SamplingParams | None = None
  ) -> str:
    """Queues a prompt (text, token ids or a vLLM prompt dict); returns its request id.

    Raises:
      ValueError: (nothing queued) for a duplicate id or anything `InputProcessor.process`
        refuses (an empty or too long prompt, ids outside the vocabulary, text without a
        tokenizer, parameters the batch cannot hold).
    """
    return self.add_requests([(request_id, prompt, params)])[0]

  def add_requests(self, requests: Sequence[RequestSpec]) -> list[str]:
    """Validates every `(request_id, prompt, params)` first, then queues them all.

    Raises:
      ValueError: as `add_request`; if any request is invalid, none is queued. With several
        requests the message starts with the failing one's position.
    """
    made: list[Request] = []
    for index, (request_id, prompt, params) in enumerate(requests):
      request_id = str(next(self._ids)) if request_id is None else str(request_id)
      try:
        if request_id in self._requests or any(r.request_id == request_id for r in made):
          raise ValueError(
            f"request_id {request_id!r} is already in the engine (a finished request stays "
            "until pop_finished() returns it)"
          )
        request = self.input_processor.process(request_id, prompt, params or SamplingParams())
        self._check_fits(request)
        made.append(request)
      except ValueError as error:
        if len(requests) == 1:
          raise
        raise ValueError(f"request {index} (of {len(requests)}): {error}") from None
    for request in made:
      self._requests[request.request_id] = request
      self.scheduler.add_request(request)
    return [r.request_id for r in made]

  def _check_fits(self, request: Request) -> None:
    """Refuses a request that could never fit in the pool of pages (ValueError)."""
    max_tokens = request.params.max_tokens
    longest = len(request.prompt_token_ids) + (
      self.max_model_len if max_tokens is None else max_tokens
    )
    self.runner.kv_cache_manager.check_fits(min(longest, self.max_model_len))

  @property
  def kv_cache_stats(self) -> KVCacheStats:
    """Occupancy of the paged KV cache (`num_blocks`, `num_used_blocks`, `peak_used_blocks`,
    `peak_running_reqs`, `num_preemptions`, prefix-cache counters; peaks and counters since
    the start or the last `reset_kv_cache_stats`)."""
    return self.runner.kv_cache_manager.stats

  def reset_kv_cache_stats(self) -> None:
    """Restarts `kv_cache_stats`' peaks at the current occupancy and its counters at zero."""
    self.runner.kv_cache_manager.reset_stats()

  def has_unfinished_requests(self) -> bool:
    """Whether any request is waiting or running. (A step left in flight whose completions
    have all finished or been aborted since holds nothing to report: the next `step` reads and
    drops it.)"""
    return self.scheduler.has_unfinished()

  def abort_request(self, request_ids: str | Sequence[str]) -> None:
    """Drops requests, waiting or running, and forgets them (vLLM's name); unknown ids are
    ignored. A running completion leaves through the same finish path as one that stops
    (`_finish`, finish reason "abort"). `LLM.generate` aborts its own requests when a step
    raises or it is interrupted, so that later calls do not run them again."""
    ids = {request_ids} if isinstance(request_ids, str) else set(request_ids)
    for completion in self.scheduler.abort(ids):
      completion.finish_reason = completion.finish_reason or "abort"
      self._finish(completion)
    for request_id in ids:
      self._requests.pop(request_id, None)

  def pop_finished(self) -> list[RequestOutput]:
    """Returns and forgets every finished request."""
    done = [r for r in self._requests.values() if r.finished]
    for request in done:
      del self._requests[request.request_id]
    return [r.output() for r in done]

  def load_weights(self, weights) -> None:
    """New model weights, no recompilation: see `ModelRunner.load_weights`.

    Raises:
      ValueError: (nothing changed) an unknown name, or a tensor of the wrong shape or dtype.
    """
    self.runner.load_weights(weights)

  def reset_prefix_cache(self) -> bool:
    """Forgets every prefix hash (running requests keep their pages); returns True."""
    return self.runner.reset_prefix_cache()

  def precompile(self, use_tqdm: bool = True) -> int:
    """Compiles every step shape (see `ModelRunner.precompile`); returns how many step
    shapes ran.

    Raises:
      ValueError: if requests are running (precompile before adding any).
    """
    return self.runner.precompile(
      self.num_decode_steps,
      use_tqdm=use_tqdm,
      num_speculative_tokens=self.config.num_speculative_tokens,
    )

  # --- the step -------------------------------------------------------------------------------

  def step(self) -> list[RequestOutput]:
    """One ragged step: the scheduler's decodes, prefill chunks and admissions, the model once
    over all their tokens, the sampler on the rows that finish; then the stop rules.

    With asynchronous scheduling the step is dispatched first and the previous step (left on the
    device by the last call) is read while it runs; a step is left in flight only when its
    outcome does not change what the next one schedules (`_overlaps`).

    Returns:
      A `RequestOutput` (cumulative so far) for every request that advanced in the steps read.
    """
    scheduler, runner = self.scheduler, self.runner
    outputs = []
    if self._in_flight is not None and self._speculation is not None:
      outputs = self._collect_in_flight()  # drafts are looked up in the rows' last tokens
    current = None
    scheduled = self._schedule()
    if scheduled is not None:
      bitmask = self._bitmask()
      if self.num_decode_steps > 1 and bitmask is None:
        steps = scheduler.schedule_decode_steps(
          scheduled, self.num_decode_steps, self.max_model_len
        )
        if steps is not None:
          return _latest(outputs + self._decode_steps(steps))
      current = _Dispatched(runner.dispatch(scheduled, bitmask), dict(scheduler.running))
      if current.step.num_new_tokens is not None:  # known now: plan the next step with them
        self._add_placeholders(current.step.num_new_tokens)
        scheduler.update_after_step(scheduled)
    outputs += self._collect_in_flight()
    if current is None:
      return _latest(outputs)
    if self._overlaps(current.step):
      self._in_flight = current
      return _latest(outputs)
    return _latest(outputs + self._collect(current))

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
      decoded.req_ids, decoded.sampled.steps, num_sampled, completions
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
    scheduler = self.scheduler
    waiting = bool(scheduler.waiting) or len(scheduled.num_decode_steps) < len(scheduler.running)
    running = dict(scheduler.running)
    decoded = self.runner.execute_decode_steps(scheduled, self.num_decode_steps, waiting)
    outputs = self._collect_in_flight()
    num_sampled = decoded.sampled.num_sampled.tolist()
    computed = dict(zip(decoded.req_ids, num_sampled))
    counts = {seq_id: computed[seq_id] for seq_id in scheduled.num_decode_steps}
    scheduler.update_after_step(dataclasses.replace(scheduled, num_scheduled_tokens=counts))
    completions = [_still_running(scheduler.running, running.get(s)) for s in decoded.req_ids]
    return outputs + self._update_from_output(
      decoded.req_ids, decoded.sampled.steps, num_sampled, completions
    )

  # --- the lifecycle ----------------------------------------------------------------------------

  def _update_from_output(
    self,
    req_ids: Sequence[str],
    steps: Sequence[HostSamplerOutput],
    num_sampled: Sequence[int],
    completions: Sequence[Completion | None] | None = None,
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
          self._append_token(completion, row, sampled)
    advanced: dict[str, Request] = {}
    for row, completion in enumerate(completions):
      if completion is None:
        continue
      if num_sampled[row] or completion.finish_reason is not None:
        advanced[completion.request.request_id] = completion.request
      if completion.finish_reason is not None:
        self._finish(completion)
    return [r.output() for r in advanced.values()]

  def _append_token(self, completion: Completion, row: int, sampled: HostSamplerOutput) -> None:
    """Appends row `row`'s token of `sampled` to `completion` (stop rules, its grammar); a token
    its grammar rejects is dropped and the completion aborted instead."""
    structured = self.structured
    token = int(sampled.sampled_token_ids[row])
    if structured is not None and not structured.accepts(completion.seq_id, token):
      if structured.is_finished(completion.seq_id):  # another constraint masked its EOS
        completion.finish_reason = "stop"  # end without it
      else:
        _abort_rejected(completion, token)  # never emit what the grammar forbids
      return
    self.output_processor.append(completion, row, sampled)
    if structured is not None and structured.advance(completion.seq_id, token):
      completion.finish_reason = completion.finish_reason or "stop"

  def _finish(self, completion: Completion) -> None:
    """The one way a running completion leaves, once it has a finish reason (a stop rule, its
    grammar, or an abort): out of the scheduler, its row freed, its grammar matcher dropped.
    Its request reports it in the step's outputs or `pop_finished`."""
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


@dataclasses.dataclass(frozen=True)
class _Dispatched:
  """A step on the device and the running completions when it was dispatched."""

  step: InFlightStep
  running: dict[str, Completion]


def _still_running(
  running: dict[str, Completion], completion: Completion | None
) -> Completion | None:
  """`completion` if it still runs (not finished or aborted since a dispatch), else None."""
  if completion is None or running.get(completion.seq_id) is not completion:
    return None
  return completion


def _latest(outputs: list[RequestOutput]) -> list[RequestOutput]:
  """One output per request, its latest (two steps read in one call may both report it)."""
  return list({output.request_id: output for output in outputs}.values())


def _abort_rejected(completion, token: int) -> None:
  """Ends a completion whose sampled token its grammar rejects: the token is dropped and the
  finish reason is "abort" (vLLM's name for an aborted request), with a warning."""
  completion.finish_reason = "abort"
  warnings.warn(
    f"request {completion.request.request_id!r}: sampled token {token}, which its "
    f"structured_outputs grammar does not allow (another constraint, such as "
    f"allowed_token_ids or a logits processor, masked every token the grammar allows); the "
    f"token is dropped and the request aborted",
    RuntimeWarning,
    stacklevel=5,  # the caller of `LLMEngine.step`
  )
