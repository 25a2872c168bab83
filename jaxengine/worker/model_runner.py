"""The model runner: the model's weights over a pool of KV-cache pages, one ragged step at a time.

`ModelRunner` holds the model, the KV cache's pages, the persistent batch and the jitted steps,
and turns a `SchedulerOutput` into a `StepOutput`: `execute(scheduler_output)` runs one step over
the tokens the `Scheduler` chose (decode tokens and prefill chunks together, the model once over
all of them, then the sampler on the rows whose last known token was computed). The pages are a
`PagedKVCache` of `num_blocks` pages of `block_size` positions shared by every request (the
scheduler's `KVCacheManager` hands them out; each `SchedulerOutput` carries the tables that
changed, which the batch's `BlockTable` keeps for the rows: the step's inputs read it).

Each job around the step lives in a module of its own, which the runner wires together (in
`worker/`): the served module and `load_weights` (`weight_loader.py`), the LoRA manager
(`lora_loader.py`), the pool's backend and size (`kv_cache_pool.py`), the jitted steps
(`device_steps.py`: pure functions of structure, shapes and shardings), each step's inputs
(`step_inputs.py`, `multi_step.py`, `verify_step.py`), prompt logprobs (`prompt_logprobs.py`),
routed experts (`routed_experts.py`), precompiling (`precompile.py`), a new sampler compiled
beside the model (`compile_beside.py`), the buckets (`buckets.py`) and sleep (`sleep_mode.py`:
buffers freed and put back with the same shapes, shardings and commitment: waking compiles none).

Compiles are bounded by the buckets (`worker/buckets.py`): a model step per (token bucket, row
bucket) reached (and one with prompt logprobs), a sampler per row bucket of 8 rows or more, a
verify step per (token, row) bucket with `speculative_config`, a k-step loop per row bucket with
`num_decode_steps` > 1; `worker/precompile.py` runs them all. On a mesh, weights, pages and
batch state are placed once (`worker/placement.py`) with the shardings every step declares.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import cast

import jax
import numpy as np
from flax import nnx

from jaxengine import parallel
from jaxengine.batch import InputBatch
from jaxengine.batch.block_table import BlockTable
from jaxengine.batch.host_output import PendingStep
from jaxengine.batch.step_loop import HostMultiStepOutput, fetch_steps, run_steps
from jaxengine.core.request import Completion
from jaxengine.core.scheduler import SchedulerOutput
from jaxengine.engine_config import EngineConfig
from jaxengine.lora import LoRAAdapter, LoRARequest
from jaxengine.models.interface import Model
from jaxengine.models.kv_pages import PagedKVCache
from jaxengine.worker import buckets as step_buckets
from jaxengine.worker import recurrent_state, sleep_mode
from jaxengine.worker.buckets import PROMOTE_AFTER, StepShape, StepShapes, bucket, buckets
from jaxengine.worker.compile_beside import SamplerBeside
from jaxengine.worker.device_steps import placed_device_steps, ragged_verify_step
from jaxengine.worker.kv_cache_pool import cache_groups
from jaxengine.worker.lora_loader import lora_manager
from jaxengine.worker.multi_step import DeviceStopRules, decode_steps_inputs
from jaxengine.worker.outputs import InFlightStep, StepOutput
from jaxengine.worker.placement import MeshPlacement, placed_step
from jaxengine.worker.prompt_logprobs import PromptLogprobs
from jaxengine.worker.ragged_step import RaggedInputs
from jaxengine.worker.routed_experts import RoutedExpertsStore, check_pages_kept
from jaxengine.worker.step_inputs import produced_rows, query_starts, ragged_inputs
from jaxengine.worker.verify_step import RaggedDrafts, ragged_drafts
from jaxengine.worker.weight_loader import WeightLoader, Weights, prepare_model


class ModelRunner:
  """Owns a model's weights, its pool of KV-cache pages, the persistent batch and the jitted
  steps (see the module).

  Args:
    model: a `jaxengine.models.Model` (an `nnx.Module`), weights loaded. The runner keeps its
      own references to the arrays: changing the module afterwards does not change the engine
      (use `load_weights`).
    input_batch: the persistent batch the runner samples into, built with the config's
      `max_num_reqs`, `max_model_len` and `max_num_blocks_per_req` (its `block_table`).
    config: the engine's `EngineConfig` (validated): `mesh` (None: one device), the pool's
      size and backend (`worker/kv_cache_pool.py`), `batch_invariant`, `quantization`,
      `max_num_batched_tokens`, `num_speculative_tokens`, the LoRA slots with `enable_lora`.

  Raises:
    ValueError: a model the batch or mesh cannot serve (`prepare_model`); a memory that holds
      fewer than 2 pages.
  """

  def __init__(self, model: Model, input_batch: InputBatch, config: EngineConfig) -> None:
    recurrent_state.check_hybrid_config(model, config)  # before any device work
    prepared = prepare_model(model, input_batch, config)
    self.input_batch = input_batch
    self.max_num_reqs = input_batch.max_num_reqs
    self.max_model_len = input_batch.max_model_len
    self.block_size = config.block_size
    self.max_num_blocks_per_req = config.max_num_blocks_per_req
    self.block_table: BlockTable = cast(BlockTable, input_batch.block_table)  # checked above
    self.mesh = config.mesh
    mesh = None if self.mesh is None else parallel.check_mesh(self.mesh)
    model = prepared.model
    #: The float model's checkpoint tensors by name (`load_weights` takes them), and the
    #: quantized matrices (`EngineConfig.quantization`) by leaf path (empty without).
    self.weight_specs, self.quantized = prepared.weight_specs, prepared.quantized
    self._weight_loader = WeightLoader(self.weight_specs, self.quantized, prepared.layer_rows)
    self._graphdef, weights = nnx.split(model)
    # The engine's own variables around the same arrays (no copy): later in-place updates of
    # `model` (an optimizer step) do not reach the engine; `load_weights` does.
    self.weights = jax.tree.map(lambda a: a, weights)
    #: The weights', pages' and batch's shardings on a mesh (`worker/placement.py`), else None.
    self.placement: MeshPlacement | None = None
    if mesh is not None:
      self.placement = MeshPlacement(model, self.weights, input_batch, mesh,
                                     expert_parallel=config.enable_expert_parallel,
                                     batch_invariant=config.batch_invariant)  # fmt: skip
      self.weights = jax.device_put(self.weights, self.placement.weights)
      input_batch.place_state(self.placement.state)
    #: The KV cache groups: one for a model without windows (`core/kv_cache_groups.py`).
    self.kv_cache_groups = cache_groups(model.kv_cache_spec, config)
    if self.kv_cache_groups.num_groups > 1:  # one table per group and row
      input_batch.block_table = self.block_table = BlockTable(
        self.max_num_reqs, self.max_num_blocks_per_req, self.kv_cache_groups.num_groups
      )
    check_pages_kept(config, self.kv_cache_groups.frees_pages)  # before the pages are allocated
    #: The pages (the null page 0 included) and, for a hybrid model, its recurrent state pool
    #: (`worker/kv_cache_pool.py`, `worker/recurrent_state.py`).
    cache = recurrent_state.create_runner_cache(
      model, config, self.kv_cache_groups, self.placement, self.max_model_len
    )
    self.kv_cache, self.num_blocks = cache.kv_cache, cache.num_blocks
    #: Recurrent state slots given to rows, snapshot slots (`core/state_snapshots.py`), and `k`
    #: with speculative decoding (`core/state_slots.py`), or 0.
    self.num_state_slots, self.num_state_snapshots = cache.num_state_slots, cache.num_snapshots
    self.num_draft_states = cache.num_draft_states
    #: The routed experts of every slot (`worker/routed_experts.py`); None without
    #: `enable_return_routed_experts`.
    self.routed_experts = RoutedExpertsStore.create(config, model, self.num_blocks, self.block_size)
    self._sleep = sleep_mode.SleepState()
    self._stop_rules = DeviceStopRules(input_batch, self.max_model_len)
    rows = self.placement.rows if self.placement else 1
    self.row_buckets = step_buckets.row_buckets(self.max_num_reqs, rows, config.batch_invariant)
    self.token_buckets = buckets(cast(int, config.max_num_batched_tokens), 1)  # never None
    #: The step shapes compiled so far; a short job runs in them (`worker/buckets.py`).
    self.compiled_shapes = StepShapes(PROMOTE_AFTER if config.reuse_compiled_shapes else 0)
    self._prompt_logprobs = PromptLogprobs()
    #: The LoRA adapters' host copies and device slots, None without `enable_lora` (made before
    #: the steps: on a mesh they declare the slots' shardings).
    self.lora = lora_manager(model, config, self.placement) if config.enable_lora else None
    steps = placed_device_steps(self._graphdef, self.mesh, self.placement, model.vocab_size)
    #: The jitted steps (`DeviceSteps`' fields).
    self.ragged_forward, self.sample_produced = steps.ragged_forward, steps.sample_produced
    self.verify_forward, self.decode_steps = steps.verify_forward, steps.decode_steps
    self.rejection_sample_produced = steps.rejection_sample_produced
    #: Where the step's host inputs go: replicated on a mesh, else None (the default device).
    self.input_sharding = self.placement.replicated if self.placement is not None else None
    self._beside = SamplerBeside.of(model.vocab_size, self.placement)
    self.num_speculative_tokens = config.num_speculative_tokens  # draft slots per row

  @property
  def model(self) -> Model:
    """The model with the runner's current weights (a new module sharing the weight arrays)."""
    return nnx.merge(self._graphdef, self.weights)

  # --- weights ----------------------------------------------------------------------------------

  def load_weights(self, weights: Weights) -> None:
    """Replaces some or all of the model's weights (the forms, casts and checks of
    `WeightLoader.load`; every weight after sleep level 2); the compiled steps are reused.
    Running requests continue with the new weights (their cached keys and values stay as the old
    weights wrote them, as in vLLM).

    Raises:
      ValueError: a tensor or state `WeightLoader.load` refuses (nothing changes).
      RuntimeError: while the weights sleep (`sleep`; nothing changes).
    """
    self._sleep.check_loadable()
    complete = self._sleep.weights_discarded
    self.weights = self._weight_loader.load(self.weights, weights, complete=complete)
    self._sleep.weights_discarded = False

  def load_lora_weights(self, lora_request: LoRARequest, adapter: LoRAAdapter) -> None:
    """Gives LoRA adapter `lora_request` the values `adapter` (`LoRAManager.set_adapter`).

    Raises:
      ValueError: (nothing changes) without `enable_lora`, or an adapter the manager refuses.
    """
    if self.lora is None:
      raise ValueError("load_lora_weights needs an engine built with enable_lora=True")
    self.lora.set_adapter(lora_request, adapter)

  # --- sleep and wake ---------------------------------------------------------------------------

  def sleep(self, level: int = 1) -> None:
    """Frees this runner's device memory for another program (a trainer) until `wake_up`: the
    KV cache's pages, and the weights moved to pinned host memory (level 1) or discarded (level
    2; `load_weights` after `wake_up`), as `sleep_mode.SleepState.sleep` says.

    Raises:
      ValueError: a level other than 1 or 2 (nothing changes).
      RuntimeError: a batch that still holds requests (nothing changes).
    """
    level = sleep_mode.check_level(level)
    sleep_mode.check_empty_batch(self.input_batch.num_reqs, "sleep")
    self.weights = self._sleep.sleep(level, self.weights, self.kv_cache)
    self.kv_cache = cast(PagedKVCache, None)

  def free_kv_cache(self) -> int:
    """Frees the KV cache's pages alone until ``wake_up(tags=["kv_cache"])`` (the memory a
    weight sync can use); returns the device bytes freed (0 when already freed).

    Raises:
      RuntimeError: a batch that still holds requests (nothing changes).
    """
    sleep_mode.check_empty_batch(self.input_batch.num_reqs, "free_kv_cache")
    freed = self._sleep.free_kv_cache(self.kv_cache)
    self.kv_cache = cast(PagedKVCache, None)
    return freed

  def wake_up(self, tags: Sequence[str] | None = None) -> None:
    """Puts back the parts `tags` names (``["weights", "kv_cache"]``, None: both) that `sleep`
    freed (`sleep_mode.SleepState.wake_up`); nothing compiles. ValueError for an unknown tag."""
    self.weights, kv_cache = self._sleep.wake_up(tags, self.weights, self.kv_cache)
    self.kv_cache = cast(PagedKVCache, kv_cache)

  def is_sleeping(self) -> bool:
    """Whether some part (weights or KV cache) is asleep (`sleep`, not woken by `wake_up`)."""
    return bool(self._sleep.asleep)

  @property
  def weights_on_host(self) -> bool:
    """Whether sleep level 1 holds the weights in host memory (until `wake_up` of the weights)."""
    return self._sleep.host_weights is not None

  @property
  def weights_discarded(self) -> bool:
    """Whether sleep level 2 discarded the weights and `load_weights` has not refilled them."""
    return self._sleep.weights_discarded

  def check_awake(self) -> None:
    """Refuses to run steps while asleep or without weights (RuntimeError, on the host)."""
    self._sleep.check_awake()

  # --- the batch and the step ------------------------------------------------------------------

  def add(self, completion: Completion) -> None:
    """Gives a completion a row (`Completion.encoded`, else encoded now: one built elsewhere),
    its LoRA slot and prompt logprobs (`PromptLogprobs.add`)."""
    request, batch, params = completion.request, self.input_batch, completion.params
    if self.lora is not None:  # first: a failure leaves the batch as it was
      self.lora.acquire(completion.seq_id, request.lora_request)
    encoded = completion.encoded or batch.validate_request(request.prompt_token_ids, params)
    batch.add_encoded_request(completion.seq_id, encoded, completion)  # its tokens' ledger
    completion.encoded = None  # the batch's row holds it now
    self._prompt_logprobs.add(completion)

  def read_routed_experts(self, completion: Completion, num_unstored: int = 0) -> np.ndarray | None:
    """``[n, M, k] int32`` a finishing completion's routed experts, its `num_readable_positions`
    (`num_unstored`: of its computed tokens, those of a step in flight, not stored yet) read
    through its row's pages; None without `enable_return_routed_experts` or a row."""
    index = self.input_batch.req_id_to_index.get(completion.seq_id)
    if self.routed_experts is None or index is None:
      return None
    num_tokens, num_computed = completion.num_tokens, completion.num_computed_tokens
    row = self.block_table.row(index)
    return self.routed_experts.read_finishing(row, num_tokens, num_computed, num_unstored)

  def remove(self, seq_id: str) -> None:
    """Frees a completion's row (the scheduler frees its pages)."""
    self.input_batch.remove_request(seq_id)
    if self.lora is not None:
      self.lora.release(seq_id)
    self._prompt_logprobs.remove(seq_id)

  def execute(
    self,
    scheduled: SchedulerOutput,
    grammar_bitmask: Callable[[Sequence[str | None]], np.ndarray | None] | None = None,
  ) -> StepOutput:
    """Runs one ragged step (`dispatch`, then `collect`): the scheduled tokens through the
    model, then the sampler. Call after `add` for the step's admitted completions.

    Args:
      scheduled: the scheduler's plan for this step.
      grammar_bitmask: called with the condensed batch's `req_ids`; returns the packed
        `[R, ceil(V / 32)] int32` allowed tokens of rows with structured outputs, or None (the
        step then leaves the bitmask as it is and reads it nowhere).

    Returns:
      `StepOutput`: each row's sampled token (`num_sampled` 0 for rows that only prefilled or
      were not scheduled), the prompt logprobs of prompts completed this step.
    """
    return self.collect(self.dispatch(scheduled, grammar_bitmask))

  def dispatch(
    self,
    scheduled: SchedulerOutput,
    grammar_bitmask: Callable[[Sequence[str | None]], np.ndarray | None] | None = None,
  ) -> InFlightStep:
    """Dispatches one ragged step (as `execute`), its tokens unread. Without drafts each row's
    count is known now (`InFlightStep.num_new_tokens`): the next step may go before `collect`."""
    self.check_awake()
    batch = self.input_batch
    self._update_block_table(scheduled)
    if grammar_bitmask is not None and (bitmask := grammar_bitmask(batch.req_ids)) is not None:
      batch.set_grammar_bitmask(bitmask)
    wanted = self._prompt_logprobs.wanted(scheduled)
    columns = batch.state.num_top_logprobs + 1 if wanted else 0
    num_tokens, num_rows = self.step_buckets(
      scheduled.total_num_scheduled_tokens, batch.num_reqs, prompt_logprobs=bool(wanted)
    )
    variant = (bool(wanted), drafted := bool(scheduled.spec_token_ids))
    shape = self.compiled_shapes.choose(StepShape(num_tokens, num_rows, variant))
    num_tokens, num_rows = shape.num_tokens, shape.num_rows
    produces = produced_rows(batch, scheduled)
    inputs, verify = self.step_inputs(scheduled, num_tokens, num_rows, produces, drafted)
    counts = None if verify is not None else [int(p) for p in produces]
    pending = self.run_step(inputs, columns, verify, counts)
    return InFlightStep(
      scheduled=scheduled,
      pending=pending,
      num_new_tokens=None if counts is None else dict(zip(batch.req_ids, counts)),
      prompt_logprobs_wanted=wanted,
      query_starts=query_starts(batch, scheduled) if wanted else {},
    )

  def _update_block_table(self, scheduled: SchedulerOutput) -> None:
    """Condenses the batch, gives each row whose pages changed its tables from the plan
    (`SchedulerOutput.block_ids`); a preempted prompt restarts its prompt logprobs."""
    self.input_batch.condense()
    index = self.input_batch.req_id_to_index
    for seq_id in scheduled.preempted:
      self._prompt_logprobs.restart(seq_id)
    for seq_id, tables in scheduled.block_ids.items():
      self.block_table.set_row(index[seq_id], tables)

  def collect(self, step: InFlightStep) -> StepOutput:
    """Reads a dispatched step's tokens (waiting for the device) and appends them to the batch
    (`InputBatch.resolve`); returns its `StepOutput` (`req_ids`: the rows at dispatch)."""
    output = self.input_batch.resolve(step.pending)
    if self.routed_experts is not None:
      self.routed_experts.write(step.pending.extra[2])
    prompt_logprobs = {}
    token_logprobs = step.pending.extra[1]
    if token_logprobs is not None:  # computed when prompt logprobs were wanted
      prompt_logprobs = self._prompt_logprobs.collect(
        step.scheduled, step.prompt_logprobs_wanted, step.query_starts, token_logprobs
      )
    return StepOutput([req_id for req_id, _ in step.pending.rows], output, prompt_logprobs)

  def step_buckets(
    self, num_tokens: int, num_reqs: int, prompt_logprobs: bool = False
  ) -> tuple[int, int]:
    """`(token bucket, row bucket)` of a step (`worker/buckets.py`: `step_buckets`)."""
    return step_buckets.step_buckets(
      num_tokens, num_reqs, self.row_buckets, self.token_buckets, prompt_logprobs
    )

  def row_bucket(self, num_reqs: int) -> int:
    """The row bucket a step over `num_reqs` live rows computes."""
    return bucket(num_reqs, self.row_buckets)

  def token_bucket(self, num_tokens: int, num_rows: int) -> int:
    """The token bucket of a step of `num_tokens` tokens over `num_rows` (a row bucket)."""
    return step_buckets.token_bucket(num_tokens, num_rows, self.token_buckets)

  def run_step(
    self,
    inputs: RaggedInputs,
    prompt_logprobs: int,
    drafts: RaggedDrafts | None = None,
    num_new_tokens: list[int] | None = None,
  ) -> PendingStep[HostMultiStepOutput]:
    """Dispatches the ragged step (the verify step with `drafts`) through
    `InputBatch.dispatch_step`, the one call site of `dispatch` and `worker/precompile.py`; keeps
    the new cache. The pending step's `extra` is `(kv_cache, prompt LogprobsTensors or None)`."""
    # The runner's attributes, read now: a test may wrap one (`tests/test_engine.py`).
    step = self._beside.ragged_step(self.ragged_forward, self.sample_produced)
    if drafts is not None:
      step = functools.partial(
        ragged_verify_step, self.verify_forward, self.rejection_sample_produced
      )
    extra_args = () if drafts is None else (drafts,)
    pending = self.input_batch.dispatch_step(
      placed_step(self.placement, step),
      self.weights,
      self.kv_cache,
      inputs,
      *extra_args,
      fetch=fetch_steps,
      num_new_tokens=num_new_tokens,
      num_rows=int(inputs.produces.shape[0]),  # the sampler's rows (`sample_rows`)
      prompt_logprobs=prompt_logprobs,
    )
    self.kv_cache = cast(PagedKVCache, pending.extra[0])
    return pending

  def step_inputs(
    self,
    scheduled: SchedulerOutput,
    num_tokens: int,
    num_rows: int,
    produces: Sequence[bool] = (),
    drafted: bool = False,
  ) -> tuple[RaggedInputs, RaggedDrafts | None]:
    """The step's `RaggedInputs` (`worker/step_inputs.py`; `produces`: `produced_rows`) and,
    when `drafted`, its drafts laid out for the verify step (`worker/verify_step.py`)."""
    batch, sharding = self.input_batch, self.input_sharding
    inputs = ragged_inputs(
      batch,
      self.block_table,
      scheduled,
      num_tokens,
      num_rows,
      produces,
      block_size=self.block_size,
      num_sample_rows=None if drafted else step_buckets.sample_rows(num_rows, self.row_buckets),
      lora=self.lora,
      sharding=sharding,
      state_slots=scheduled.state_slots if self.num_state_slots else None,
      state_routes=scheduled.state_routes  # prefix caching's snapshots, drafts' states
      if self.num_state_snapshots or (drafted and self.num_draft_states)
      else None,
      num_draft_states=self.num_draft_states if drafted else 0,
    )
    if not drafted:
      return inputs, None
    rows = {seq_id: batch.req_id_to_index[seq_id] for seq_id in scheduled.num_scheduled_tokens}
    starts, k = query_starts(batch, scheduled), self.num_speculative_tokens
    return inputs, ragged_drafts(scheduled, rows, starts, num_tokens, num_rows, k, sharding)

  def step_shapes(self, prompt_logprobs: bool = False) -> list[tuple[int, int]]:
    """The `(token bucket, row bucket)` pairs a ragged step can reach (`step_buckets`)."""
    return step_buckets.step_shapes(self.row_buckets, self.token_buckets, prompt_logprobs)

  # --- the k-step decode ------------------------------------------------------------------------

  def execute_decode_steps(
    self,
    scheduled: SchedulerOutput,
    num_steps: int,
    running: Mapping[str, Completion],
    end_on_first_finish: bool = False,
  ) -> StepOutput:
    """Runs up to `num_steps` ragged decode steps in one device loop (`worker/multi_step.py`)
    over the rows `scheduled.num_decode_steps` names (`Scheduler.schedule_decode_steps`), each
    at most that many tokens; appends every valid token to the batch.

    Args:
      scheduled: the step's plan, with `num_decode_steps`.
      num_steps: `k` (static: one executable per row bucket and value).
      running: each live row's completion by `seq_id` (its params: the stop rules).
      end_on_first_finish: end the loop once some row stops by a stop rule (requests wait).

    Returns:
      `StepOutput`: up to `k` tokens per row (`sampled.num_sampled`), no prompt logprobs.
    """
    self.check_awake()
    self._update_block_table(scheduled)
    num_rows = bucket(self.input_batch.num_reqs, self.row_buckets)
    output = self.run_decode_steps(scheduled, running, num_rows, num_steps, end_on_first_finish)
    return StepOutput(req_ids=self.input_batch.req_ids, sampled=output, prompt_logprobs={})

  def run_decode_steps(
    self,
    scheduled: SchedulerOutput,
    running: Mapping[str, Completion],
    num_rows: int,
    num_steps: int,
    end_on_first_finish: bool,
  ) -> HostMultiStepOutput:
    """The jitted k-step loop through `run_steps` (also `worker/precompile.py`'s); keeps the new
    cache."""
    inputs = decode_steps_inputs(
      self.input_batch,
      self.block_table,
      scheduled.num_decode_steps,
      num_rows,
      self._stop_rules,
      running,
      end_on_first_finish,
      lora=self.lora,
      sharding=self.input_sharding,
      state_slots=scheduled.state_slots if self.num_state_slots else None,
    )
    output, kv_cache = run_steps(
      self.input_batch,
      placed_step(self.placement, self.decode_steps),
      self.weights,
      self.kv_cache,
      inputs,
      num_rows=num_rows,
      num_steps=num_steps,
    )
    kv_cache, routed = cast(tuple, kv_cache)
    if self.routed_experts is not None:  # stored by `store_loop_routed_experts`
      self.routed_experts.hold(routed)
    self.kv_cache = cast(PagedKVCache, kv_cache)
    return output

  def store_loop_routed_experts(self) -> None:
    """Stores the last k-step loop's routed experts (`RoutedExpertsStore.write_held`): call once
    the step that was in flight when the loop was dispatched is collected, and before the loop's
    tokens are applied (a completion finishing with them reads them)."""
    if self.routed_experts is not None:
      self.routed_experts.write_held()
