"""The model runner: the model's weights over a pool of KV-cache pages, one ragged step at a time.

`ModelRunner` owns the model's weights (`load_weights` replaces them without recompiling), the
KV cache, the persistent batch and the jitted steps: the cache is a `PagedKVCache` of `num_blocks`
pages of `block_size` positions shared by every request (`KVCacheManager` hands them out; the
batch's `BlockTable` lists each row's), and `execute(scheduler_output)` runs one step over the
tokens the `Scheduler` chose: decode tokens and prefill chunks together, the model once over
all of them, then the sampler on the rows whose last known token was computed.

Compiles are bounded by the buckets: one model step (`ragged_forward`) per (token bucket, row
bucket) reached: powers of two up to `max_num_reqs` rows, and powers of two up to
`max_num_batched_tokens` tokens from `min(rows, MIN_TOKEN_BUCKET)` (`token_bucket`), steps of
`FULL_ROWS_MIN_TOKENS` tokens or more and steps with prompt logprobs in the largest row bucket
only (`step_buckets`; the prompt-logprobs variant is another executable), and one sampler step
(`sample_produced`) per row bucket; with `speculative_config` also one verify step
(the model and the rejection sampler, `worker/verify_step.py`) per (token bucket, row bucket); with
`num_decode_steps` k > 1 one k-step decode loop per row bucket (`execute_decode_steps`,
`worker/multi_step.py`); `precompile` runs them all. With `reuse_compiled_shapes`, a step whose bucket
has not compiled yet runs in a larger compiled one for its first few uses (`StepShapes`), so a
short job compiles few shapes. The block-table width is fixed at
`ceil(max_model_len / block_size)` pages (the XLA attention loops only over the pages the step's
longest context needs, so the width costs nothing there).

The model is split once (`nnx.split`); the steps are pure functions of `(graphdef, weights, ...)`
jitted with the cache and batch state donated. On a mesh (`EngineConfig.mesh`) weights, pages and
batch state are placed once (`worker/placement.py`) and every step declares those shardings for
its inputs and outputs, so serving compiles nothing warm-up did not.

`sleep` frees the device buffers of the pages and the weights (level 1: the weights to pinned
host memory; level 2: discarded until `load_weights`), and `wake_up` puts them back with the same
shapes, shardings and commitment, so the steps compile nothing (`worker/sleep_mode.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from jaxengine import parallel
from jaxengine.batch import InputBatch
from jaxengine.batch.block_table import BlockTable
from jaxengine.batch.host_output import LogprobsArrays, PendingStep
from jaxengine.batch.step_loop import HostMultiStepOutput, fetch_steps, run_steps
from jaxengine.core.kv_cache_groups import kv_cache_groups, max_group_blocks
from jaxengine.core.kv_cache_manager import KVCacheManager
from jaxengine.core.request import Completion
from jaxengine.core.scheduler import SchedulerOutput, wants_prompt_logprobs
from jaxengine.engine_config import EngineConfig
from jaxengine.lora import LoRAAdapter, LoRAManager, LoRARequest
from jaxengine.models.attention_backends import (
  AttentionBackend,
  XlaAttentionBackend,
  attention_backend,
)
from jaxengine.models.batch_invariant import batch_invariant_model
from jaxengine.models.interface import Model, check_model
from jaxengine.models.kv_cache import KVCacheSpec
from jaxengine.models.kv_pages import PagedKVCache
from jaxengine.models.paged_attention import FP8_KV_DTYPE, PagedAttentionMetadata
from jaxengine.models.quantization import QuantizedLeaf, quantize_model
from jaxengine.models.sharded_attention import shard_backend
from jaxengine.models.weights import (
  LeafPath,
  assemble_leaf,
  check_finite,
  collect_named_weights,
  collect_state,
  dotted,
  model_weight_specs,
  put,
  replace_leaves,
  state_leaves,
)
from jaxengine.sample import LogprobsTensors
from jaxengine.worker import sleep_mode
from jaxengine.worker.buckets import PROMOTE_AFTER, StepShape, StepShapes, bucket, buckets
from jaxengine.worker.device_steps import device_steps
from jaxengine.worker.kv_cache_size import (
  bytes_per_block,
  check_kv_cache_fits,
  default_num_kv_blocks,
)
from jaxengine.worker.multi_step import (
  DecodeStepsInputs,
  device_stop_rules,
  stop_rule_arrays,
)
from jaxengine.worker.placement import MeshPlacement, placed_copy
from jaxengine.worker.ragged_step import RaggedInputs
from jaxengine.worker.step_inputs import build_step_inputs
from jaxengine.worker.verify_step import (
  RaggedDrafts,
  ragged_drafts,
)

#: Smallest token bucket of a ragged step with 8 rows or more; fewer rows start at their row
#: bucket, so one request's decode runs the model on 1 token, not 8 (XLA:CPU takes about 1.8x as
#: long over 8 rows of SmolLM2-135M as over 1), at the price of a few more shapes.
MIN_TOKEN_BUCKET = 8

#: Token bucket from which a step runs in the largest row bucket (`ModelRunner.step_buckets`):
#: the logits of `max_num_reqs` rows cost little next to the model over this many tokens (under 3%
#: for SmolLM2-135M at 16 rows), and fewer (token, row) shapes compile.
FULL_ROWS_MIN_TOKENS = 128


@dataclasses.dataclass(frozen=True)
class StepOutput:
  """One ragged step on the host.

  Attributes:
    req_ids: the batch's row ids (`num_reqs`), the order of `sampled`'s arrays.
    sampled: the sampled token of each row (`num_sampled` 1 for rows that produced one).
    prompt_logprobs: by request id, `LogprobsArrays` of `[num_prompt_tokens - 1, k + 1]` (the
      logprobs of prompt tokens `1..`) of each prompt whose last prediction was in this step.
  """

  req_ids: list[str]
  sampled: HostMultiStepOutput
  prompt_logprobs: dict[str, LogprobsArrays]


@dataclasses.dataclass(frozen=True)
class InFlightStep:
  """A ragged step `ModelRunner.dispatch` sent to the device, not read yet.

  Attributes:
    scheduled: the scheduler's plan it runs.
    pending: the batch's record of it (`InputBatch.dispatch_step`).
    num_new_tokens: tokens it appends to each row (`seq_id` -> 0 or 1), or None with drafts
      (then only its output tells, and it must be collected before the next dispatch).
    prompt_logprobs_wanted: completions whose prompt logprobs it computes.
    query_starts: their first flat token index in the step.
  """

  scheduled: SchedulerOutput
  pending: PendingStep[HostMultiStepOutput]
  num_new_tokens: dict[str, int] | None
  prompt_logprobs_wanted: list[str]
  query_starts: dict[str, int]


@dataclasses.dataclass
class _SleepState:
  """What `ModelRunner.sleep` freed and how to put it back.

  Attributes:
    asleep: the parts asleep (`sleep_mode.SLEEP_TAGS` names), empty when awake.
    level: the level of the last `sleep` (0: never slept).
    host_weights: the weights in pinned host memory (level 1), None otherwise.
    weight_slots: the weights' `sleep_mode.Slot`s while they are on the host.
    weights_discarded: level 2 dropped the weights; the runner's `weights` hold `sleep_mode.Slot`s
      until `load_weights` fills every one.
    kv_cache_slots: the KV cache's `sleep_mode.Slot`s while it is freed.
  """

  asleep: set[str] = dataclasses.field(default_factory=set)
  level: int = 0
  host_weights: Any = None
  weight_slots: Any = None
  weights_discarded: bool = False
  kv_cache_slots: Any = None


@dataclasses.dataclass
class _PendingPromptLogprobs:
  """A prompt's logprobs gathered chunk by chunk until its last prediction."""

  request_id: str
  num_prompt_tokens: int
  parts: list[LogprobsArrays] = dataclasses.field(default_factory=list)


class ModelRunner:
  """Owns a model's weights, its pool of KV-cache pages, the persistent batch and the jitted
  steps (see the module).

  Args:
    model: a `jaxengine.models.Model` (an `nnx.Module`), weights loaded. The runner keeps its
      own references to the arrays: changing the module afterwards does not change the engine
      (use `load_weights`).
    input_batch: the persistent batch the runner samples into, built with the config's
      `max_num_reqs`, `max_model_len` and `max_num_blocks_per_req` (its `block_table`).
    config: the engine's `EngineConfig` (validated); the runner reads `mesh` (None: one
      device; else weights, pages and batch state are placed on it once, `worker/placement.py`,
      the experts as `enable_expert_parallel` says), `batch_invariant`, `kv_cache_memory_bytes`,
      `num_kv_blocks`, `gpu_memory_utilization` (`worker/kv_cache_size.py`), `block_size`,
      `max_num_batched_tokens`, `attention_backend`, `prefix_caching`,
      `num_speculative_tokens` and, with `enable_lora`, `max_loras`, `max_lora_rank` and
      `max_cpu_loras` (`jaxengine.lora.LoRAManager`: adapters in device slots, each token's
      slot an input of the ragged step).

  Raises:
    ValueError: a model that does not implement `Model`, a vocabulary or sizes that differ from
      the batch's, a `max_model_len` above the model's `max_position_embeddings`, a batch
      without a block table of the right width; on a mesh, a tensor-parallel size that does not
      divide the query heads; a memory that holds fewer than 2 pages.
  """

  def __init__(self, model: Model, input_batch: InputBatch, config: EngineConfig) -> None:
    check_model(model)
    _check_sizes(model, input_batch, config)
    self.input_batch = input_batch
    self.max_num_reqs = input_batch.max_num_reqs
    self.max_model_len = input_batch.max_model_len
    self.block_size = config.block_size
    self.max_num_blocks_per_req = config.max_num_blocks_per_req
    self.block_table: BlockTable = cast(BlockTable, input_batch.block_table)  # checked above
    if config.batch_invariant:
      model = batch_invariant_model(model)  # a copy: the caller's module keeps its mode
    # Named by the float model: `load_weights` takes float tensors of the quantized matrices too.
    self.weight_specs = {spec.name: spec for spec in model_weight_specs(model, nnx.state(model))}
    self.mesh = config.mesh
    mesh = None if self.mesh is None else parallel.check_mesh(self.mesh)
    if mesh is not None:
      MeshPlacement.check(model, input_batch, mesh, expert_parallel=config.enable_expert_parallel)
    if mesh is not None and config.quantization is not None:
      model = placed_copy(model, mesh, expert_parallel=config.enable_expert_parallel)
    #: The quantized matrices (`EngineConfig.quantization`), by leaf path; empty without.
    self.quantized: Mapping[LeafPath, QuantizedLeaf] = {}
    if config.quantization is not None:
      quantized = quantize_model(model, config.quantization)  # a copy, as above
      model, self.quantized = quantized.model, quantized.leaves
    self._graphdef, weights = nnx.split(model)
    # The engine's own variables around the same arrays (no copy): later in-place updates of
    # `model` (an optimizer step) do not reach the engine; `load_weights` does.
    self.weights = jax.tree.map(lambda a: a, weights)
    self._placement: MeshPlacement | None = None
    if mesh is not None:
      self._placement = MeshPlacement(
        model, self.weights, input_batch, mesh, expert_parallel=config.enable_expert_parallel
      )
      self.weights = jax.device_put(self.weights, self._placement.weights)
      input_batch.place_state(self._placement.state)
    spec = model.kv_cache_spec
    #: The KV cache groups: one for a model without windows (`core/kv_cache_groups.py`).
    self.kv_cache_groups = kv_cache_groups(
      spec.num_layers,
      spec.sliding_window,
      spec.sliding_window_layers,
      enabled=not config.disable_hybrid_kv_cache_manager,
    )
    if self.kv_cache_groups.num_groups > 1:  # one table per group and row
      input_batch.block_table = self.block_table = BlockTable(
        self.max_num_reqs, self.max_num_blocks_per_req, self.kv_cache_groups.num_groups
      )
    self.kv_cache = self._create_kv_cache(model, config)
    self._sleep = _SleepState()
    self._stop_rules: dict[str, tuple[int, tuple[int, ...]]] = {}
    self.max_num_device_stop_ids = input_batch.config.max_num_stop_token_ids + len(
      input_batch.eos_token_ids
    )
    # On a mesh every row bucket is a multiple of the data-parallel size (whole rows per shard).
    # With batch_invariant, one: the sampler's reductions (top-p masses, the draw's cumulative
    # sums) take their order from the whole `[rows, V]` shape, so one row count keeps a
    # request's draw independent of the batch (the model's arithmetic is per token,
    # `jaxengine.models.batch_invariant`).
    self.row_buckets = (
      [self.max_num_reqs]
      if config.batch_invariant
      else buckets(self.max_num_reqs, self._placement.rows if self._placement else 1)
    )
    #: The pages' owners: the scheduler allocates through it, the runner only reads tables.
    self.kv_cache_manager = KVCacheManager(
      self.num_blocks,
      self.block_size,
      enable_caching=config.prefix_caching,
      groups=self.kv_cache_groups,
      max_num_batched_tokens=config.max_num_batched_tokens,
    )
    budget = cast(int, config.max_num_batched_tokens)  # validated: never None
    self.token_buckets = buckets(budget, 1)
    #: The step shapes compiled so far; a short job runs in them (`worker/buckets.py`).
    self.compiled_shapes = StepShapes(PROMOTE_AFTER if config.reuse_compiled_shapes else 0)
    self._prompt_logprobs: dict[str, _PendingPromptLogprobs] = {}
    #: The LoRA adapters' host copies and device slots; None without `enable_lora`.
    self.lora: LoRAManager | None = _lora_manager(model, config) if config.enable_lora else None
    self._jit_steps(model.vocab_size, config.num_speculative_tokens)

  def _jit_steps(self, vocab_size: int, num_speculative_tokens: int) -> None:
    """The device steps, jitted once per model structure and placement (`worker/device_steps.py`:
    another engine over the same architecture reuses their executables)."""
    placement = self._placement
    shardings = {}
    if placement is not None:
      shardings = {
        "ragged_forward": placement.ragged_forward_shardings(vocab_size),
        "sample_produced": placement.sample_produced_shardings(vocab_size),
        "verify_forward": placement.verify_forward_shardings(),
        "rejection_sample_produced": placement.rejection_sample_produced_shardings(),
        "decode_steps": placement.decode_steps_shardings(),
      }
    steps = device_steps(self._graphdef, self.mesh, shardings)
    #: The model's part of a plain step: one executable per (token bucket, row bucket).
    self.ragged_forward = steps.ragged_forward
    #: The sampler's part: one executable per row bucket.
    self.sample_produced = steps.sample_produced
    #: The verify step's model part (per token and row bucket) and rejection sampler (per row
    #: bucket), `worker/verify_step.py`.
    self.verify_forward = steps.verify_forward
    self.rejection_sample_produced = steps.rejection_sample_produced
    #: The k-step decode loop (`worker/multi_step.py`).
    self.decode_steps = steps.decode_steps
    #: Where the step's host inputs go: replicated on a mesh, else the default device.
    self._input_sharding = placement.replicated if placement is not None else None
    #: Draft slots per row of the verify step (0: no speculative decoding).
    self.num_speculative_tokens = num_speculative_tokens

  def _create_kv_cache(self, model: Model, config: EngineConfig) -> PagedKVCache:
    """The pool of pages; on a mesh split over key/value heads when the model axis divides
    them (`jaxengine.models.sharded_attention`), else replicated, and sized per device.

    Raises:
      ValueError: the model's `sliding_window`, `soft_cap` or the cache dtype with a backend
        that has none (host side, `_choose_backend`).
    """
    spec = model.kv_cache_spec
    groups = self.kv_cache_groups
    # Per request, every full group's pages and a window group's bounded share (what the
    # default pool's size counts); a page holds `group_size` layers.
    num_blocks_per_req = sum(
      min(
        self.max_num_blocks_per_req,
        max_group_blocks(
          window, self.max_model_len, self.block_size, config.max_num_batched_tokens
        ),
      )
      for window in groups.group_windows
    )
    spec = dataclasses.replace(spec, num_layers=groups.group_size)
    layer_groups = groups.layer_groups if groups.num_groups > 1 else None
    if config.kv_cache_dtype == "fp8":
      spec = dataclasses.replace(spec, dtype=FP8_KV_DTYPE)  # each backend stores it its own way
    # This process's devices: another process's cannot report their memory (multi-host meshes).
    devices = (
      [d for d in self.mesh.devices.flat if d.process_index == jax.process_index()]
      if self.mesh is not None
      else jax.local_devices()[:1]
    )
    backend = _choose_backend(config, spec, self.mesh, devices)
    num_blocks = config.num_kv_blocks
    if num_blocks is None and config.kv_cache_memory_bytes is None:
      num_blocks = default_num_kv_blocks(
        spec,
        backend,
        max_num_reqs=self.max_num_reqs,
        max_num_blocks_per_req=num_blocks_per_req,
        block_size=self.block_size,
        devices=devices,
        gpu_memory_utilization=config.gpu_memory_utilization,
      )
    elif num_blocks is None:
      memory = cast(int, config.kv_cache_memory_bytes)  # the branch above took None
      check_kv_cache_fits(memory, devices, asked=f"kv_cache_memory_bytes={memory}")
      num_blocks = backend.num_blocks_for_memory(
        memory,
        num_layers=spec.num_layers,
        block_size=config.block_size,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        dtype=spec.dtype,
      )
    else:
      per_block = bytes_per_block(spec, backend, self.block_size)
      check_kv_cache_fits(num_blocks * per_block, devices, asked=f"num_kv_blocks={num_blocks}")
    #: Pages of the pool, the null page 0 included.
    self.num_blocks = int(num_blocks)
    if self._placement is not None:
      return self._placement.create_kv_pages(
        spec, backend, self.num_blocks, self.block_size, layer_groups
      )
    return PagedKVCache.create(spec, backend, self.num_blocks, self.block_size, layer_groups)

  @property
  def model(self) -> Model:
    """The model with the runner's current weights (a new module sharing the weight arrays)."""
    return nnx.merge(self._graphdef, self.weights)

  # --- weights ----------------------------------------------------------------------------------

  def load_weights(
    self, weights: Mapping[str, Any] | Iterable[tuple[str, Any]] | nnx.State | nnx.Module
  ) -> None:
    """Replaces some or all of the model's weights; the compiled steps are reused as they are.

    Two forms:

    - named tensors, ``{name: array}`` or ``(name, array)`` pairs, names and layouts as in the
      checkpoint (for `jaxengine.models.Llama` the Hugging Face names, vLLM's `load_weights`
      convention; for a model without `weight_specs`, its dotted NNX paths such as
      ``"layers.0.attn.wq"``). Tensors may be a subset: the rest stay as they are.
    - a whole `nnx.State` (``nnx.state(module)``), its nested pure dict
      (``nnx.to_pure_dict``) or the module itself, of the same structure as the engine's model:
      for trainers that hold the same NNX module.

    Arrays may be NumPy (converted on the host, then put on the device) or JAX arrays (converted
    on their devices, then placed as the engine's weights are: no round trip through the host).
    Any floating dtype is cast to the parameter's dtype. A JAX array that already has the
    parameter's layout, dtype and placement is used as it is, not copied: do not delete or donate
    it afterwards (copy it first if your training step donates its parameters). Nothing
    recompiles as long as the arrays are placed as the engine's weights are (on one device:
    uncommitted, as arrays made by `jnp` and by jitted functions of such arrays are; see
    `jaxengine.models.weights.put`).

    Running requests continue with the new weights (their cached keys and values stay as the
    old weights wrote them, as in vLLM). The prefix cache is emptied: later prompts compute
    their keys and values with the new weights.

    After `sleep(level=2)` and `wake_up` every weight must be given (named tensors covering every
    leaf, or a whole state): the old ones were discarded. While the weights sleep it is refused
    (the host copy of level 1 is not updated in place: wake up first).

    Raises:
      ValueError: naming the first unknown or repeated name, missing or extra state leaf, or
        tensor of the wrong type, shape or dtype, or holding a NaN or an infinity (by its
        checkpoint name; see `jaxengine.models.weights.nonfinite_tensors` for what that check
        reads and costs). Everything is checked before any conversion, and the weights change
        all at once at the end: after an error the model is exactly as it was. After sleep
        level 2, a weight missing (named).
      RuntimeError: while the weights sleep (`sleep`; nothing changes).
    """
    self._check_loadable()
    engine_leaves = state_leaves(self.weights)
    leaves = self._float_leaves(engine_leaves)
    is_pure_dict = isinstance(weights, Mapping) and any(
      isinstance(v, Mapping) for v in weights.values()
    )
    partial: dict[LeafPath, np.ndarray] = {}
    if isinstance(weights, (nnx.State, nnx.Module)) or is_pure_dict:
      self._refuse_quantized_state(weights)
      given = collect_state(weights, leaves)
      check_finite(given.items(), self._leaf_name)
      new = {path: put(given[path], leaves[path]) for path in leaves}
      narrowed = [path for path in new if _narrows(given[path], leaves[path])]
    else:
      grouped = collect_named_weights(weights, self.weight_specs, leaves)
      if self._sleep.weights_discarded:
        self._check_complete(grouped, leaves)
      check_finite((spec.name, t) for parts in grouped.values() for spec, t in parts.values())
      partial = self._partial_stacks(grouped)
      # A quantized stack given in part: its other experts are kept from the engine's values
      # (`_requantized`); here they are zeros (rows are quantized one by one).
      base = {path: sleep_mode.zeros(leaves[path]) for path in partial}
      with np.errstate(over="ignore"):  # an overflow to inf is refused just below, by name
        new = {
          path: assemble_leaf(base.get(path, leaves[path]), parts)
          for path, parts in grouped.items()
        }
      narrowed = [
        path
        for path, parts in grouped.items()
        if any(_narrows(t, leaves[path]) for _, t in parts.values())
      ]
    # A finite value can overflow the engine's narrower dtype (1e5 in float16): checked again
    # after the cast, where that can happen, before anything is replaced.
    check_finite(((path, new[path]) for path in narrowed), self._leaf_name, after_cast=True)
    self.weights = replace_leaves(self.weights, self._requantized(new, engine_leaves, partial))
    self._sleep.weights_discarded = False
    self.reset_prefix_cache()

  def load_lora_weights(self, lora_request: LoRARequest, adapter: LoRAAdapter) -> None:
    """Gives LoRA adapter `lora_request` the in-memory values `adapter`
    (`LoRAManager.set_adapter`: its host copy and, when placed, its slot; nothing recompiles)
    and empties the prefix cache (its pages were computed with the old values).

    Raises:
      ValueError: (nothing changes) an engine without `enable_lora`, or an adapter the
        manager refuses.
    """
    if self.lora is None:
      raise ValueError("load_lora_weights needs an engine built with enable_lora=True")
    self.lora.set_adapter(lora_request, adapter)
    self.reset_prefix_cache()

  def _float_leaves(self, leaves: Mapping[LeafPath, Any]) -> dict[LeafPath, Any]:
    """The leaves `load_weights` takes: the engine's, with each quantized matrix as the float
    weight it was (a `sleep_mode.Slot` of its shape and model dtype, placed as its values are)
    and without the scales (`requantized` derives them)."""
    scale_paths = {q.scale_path for q in self.quantized.values()}
    floats = {}
    for path, leaf in leaves.items():
      q = self.quantized.get(path)
      if q is not None:
        leaf = sleep_mode.Slot(q.float_shape, q.float_dtype, leaf.sharding, bool(leaf.committed))
      if path not in scale_paths:
        floats[path] = leaf
    return floats

  def _partial_stacks(self, grouped: Mapping[LeafPath, Any]) -> dict[LeafPath, np.ndarray]:
    """The quantized stacked leaves (a mixture of experts' ``[X, out, in]``) that named tensors
    fill only in part: the indices given, by leaf path."""
    partial = {}
    for path, parts in grouped.items():
      q = self.quantized.get(path)
      if q is not None and None not in parts and len(parts) < q.float_shape[0]:
        partial[path] = np.asarray(sorted(parts))
    return partial

  def _requantized(
    self,
    new: Mapping[LeafPath, Any],
    leaves: Mapping[LeafPath, Any],
    partial: Mapping[LeafPath, np.ndarray],
  ) -> dict[LeafPath, Any]:
    """`new` leaves with each float quantized matrix replaced by its values and scales (the
    jitted `quantize_rows`, compiled when the engine was built), placed as `leaves` are. A
    stack in `partial` takes the new values and scales of its given indices only, the others
    kept bit for bit (that update compiles, as a partial update of a float stack does)."""
    out = dict(new)
    for path, value in new.items():
      q = self.quantized.get(path)
      if q is None:
        continue
      rows = q.quantize(value)
      values, scale = rows.values, rows.scale
      if path in partial:
        given = partial[path]
        values = leaves[path].at[given].set(values[given])
        scale = leaves[q.scale_path].at[given].set(scale[given])
      out[path] = put(values, leaves[path])
      out[q.scale_path] = put(scale, leaves[q.scale_path])
    return out

  def _refuse_quantized_state(self, weights) -> None:
    """A quantized engine takes the float model's state (it quantizes it); a state holding the
    quantized layout (values and their ``scales``, e.g. the engine's own) is refused by name."""
    if not self.quantized:
      return
    state = nnx.state(weights) if isinstance(weights, nnx.Module) else weights
    scales = {q.scale_path for q in self.quantized.values()}
    found = next((path for path in state_leaves(state) if path in scales), None)
    if found is not None:
      raise ValueError(
        f"load_weights takes the float model's weights (the engine quantizes them), got a "
        f"quantized state: its leaf {dotted(found)!r} is a quantization scale"
      )

  def _check_loadable(self) -> None:
    """Refuses `load_weights` while the weights sleep (RuntimeError: wake them first)."""
    state = self._sleep
    if "weights" in state.asleep:
      where = (
        "discarded the weights" if state.weights_discarded else "moved the weights to host memory"
      )
      raise RuntimeError(
        f"load_weights while asleep: sleep(level={state.level}) {where}; call wake_up() (or "
        "wake_up(tags=['weights'])) first"
      )

  def _check_complete(
    self, grouped: Mapping[LeafPath, Any], leaves: Mapping[LeafPath, Any]
  ) -> None:
    """After sleep level 2 every leaf must be given whole (ValueError naming the first missing
    checkpoint tensor): there are no old values to keep."""
    for path, leaf in leaves.items():
      parts = grouped.get(path, {})
      if None in parts:
        continue
      specs = [s for s in self.weight_specs.values() if s.path == path]
      layers = {s.layer for s in specs}
      if specs and None not in layers and set(range(leaf.shape[0])) <= set(parts):
        continue
      missing = [s.name for s in specs if s.layer not in parts] or [dotted(path)]
      raise ValueError(
        f"load_weights after sleep(level=2) needs every weight (the old ones were discarded), "
        f"missing {missing[0]!r}" + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
      )

  def _leaf_name(self, path: LeafPath) -> str:
    """A leaf by its checkpoint name and NNX path (``"model.norm.weight" (final_norm.scale)``),
    or by its path alone when no single checkpoint tensor fills it."""
    names = [s.name for s in self.weight_specs.values() if s.path == path and s.layer is None]
    return f"{names[0]} ({dotted(path)})" if names else dotted(path)

  def reset_prefix_cache(self) -> bool:
    """Forgets every prefix hash (pages in use stay with their requests); returns True."""
    self.kv_cache_manager.reset_prefix_cache()
    return True

  # --- sleep and wake ---------------------------------------------------------------------------

  def sleep(self, level: int = 1) -> None:
    """Frees this runner's device memory for another program (a trainer) until `wake_up`.

    Level 1 frees the KV cache's pages and moves the weights to pinned host memory (same
    shardings, memory kind "pinned_host"); level 2 frees the KV cache and discards the weights
    (`load_weights` after `wake_up` brings new ones). The KV cache's buffers are deleted; the
    weights are only let go of (freed when nothing else holds them: a module given to the
    engine or arrays `load_weights` used without a copy are the caller's and stay intact). The
    prefix cache is emptied (its pages are gone). Sleeping again frees what
    is still held (level 2 after level 1 drops the host copy).

    Raises:
      ValueError: a level other than 1 or 2 (nothing changes).
      RuntimeError: a batch that still holds requests (nothing changes).
    """
    level = sleep_mode.check_level(level)
    self._check_empty_batch("sleep")
    state = self._sleep
    on_device = "weights" not in state.asleep and not state.weights_discarded
    # The host copy first: should it fail (host memory), nothing is freed yet.
    host = sleep_mode.to_host(self.weights) if on_device and level == 1 else None
    self._release_kv_cache()
    if on_device:
      state.weight_slots = sleep_mode.slots(self.weights)
      state.host_weights = host
      self.weights = state.weight_slots  # let go, not deleted: a trainer may share the arrays
    if level == 2:
      state.host_weights = None  # asleep at level 1 before: the host copy goes too
      state.weights_discarded = True
    state.asleep.update(sleep_mode.SLEEP_TAGS)
    state.level = max(state.level, level)

  def free_kv_cache(self) -> int:
    """Frees the KV cache's pages alone (the weights stay where they are) until
    ``wake_up(tags=["kv_cache"])``: the memory a weight sync can use (`sleep` at level 1 without
    moving the weights). The prefix cache is emptied.

    Returns:
      The device bytes freed (every device's share of the pages; 0 when already freed).

    Raises:
      RuntimeError: a batch that still holds requests (nothing changes).
    """
    self._check_empty_batch("free_kv_cache")
    freed = self._release_kv_cache()
    self._sleep.asleep.add("kv_cache")
    self._sleep.level = max(self._sleep.level, 1)
    return freed

  def _check_empty_batch(self, action: str) -> None:
    """Raises `RuntimeError` naming `action` when the batch still holds requests."""
    if self.input_batch.num_reqs:
      raise RuntimeError(
        f"{action} needs an empty batch, it holds {self.input_batch.num_reqs} requests (finish "
        "or abort them first)"
      )

  def _release_kv_cache(self) -> int:
    """Deletes the KV cache's pages (their slots kept for `wake_up`) and empties the prefix
    cache; returns the device bytes freed (0 when already freed)."""
    freed = 0
    if self.kv_cache is not None:
      freed = sleep_mode.device_bytes(self.kv_cache)
      self._sleep.kv_cache_slots = sleep_mode.slots(self.kv_cache)
      sleep_mode.delete(self.kv_cache)
      self.kv_cache = cast(PagedKVCache, None)
    self.reset_prefix_cache()
    return freed

  def wake_up(self, tags: Sequence[str] | None = None) -> None:
    """Puts back what `sleep` freed: the weights on the device as they were placed (level 1; at
    level 2 they stay discarded until `load_weights`) and a fresh, empty KV cache of the same
    pages and shardings. Nothing compiles: the steps see the same argument signature.

    Args:
      tags: the parts to wake, of ``["weights", "kv_cache"]`` (vLLM's tags); None: both. A part
        already awake is left as it is.

    Raises:
      ValueError: an unknown tag (nothing changes).
    """
    tags = sleep_mode.check_tags(tags)
    state = self._sleep
    if "weights" in tags and "weights" in state.asleep:
      if state.host_weights is not None:
        self.weights = sleep_mode.to_device(state.host_weights, state.weight_slots)
        state.host_weights = None
      state.asleep.discard("weights")
    if "kv_cache" in tags and "kv_cache" in state.asleep:
      self.kv_cache = cast(PagedKVCache, sleep_mode.zeros(state.kv_cache_slots))
      state.kv_cache_slots = None
      state.asleep.discard("kv_cache")
    if not state.asleep:
      state.level = 0

  def is_sleeping(self) -> bool:
    """Whether some part (weights or KV cache) is asleep (`sleep`, not woken by `wake_up`)."""
    return bool(self._sleep.asleep)

  @property
  def weights_discarded(self) -> bool:
    """Whether sleep level 2 discarded the weights and `load_weights` has not refilled them."""
    return self._sleep.weights_discarded

  def check_awake(self) -> None:
    """Refuses to run steps while asleep or without weights (RuntimeError, on the host)."""
    state = self._sleep
    if state.asleep:
      parts = " and ".join(p for p in sleep_mode.SLEEP_TAGS if p in state.asleep)
      raise RuntimeError(
        f"the engine is asleep (sleep(level={state.level}) freed its {parts}); call wake_up() first"
      )
    if state.weights_discarded:
      raise RuntimeError(
        "the engine has no weights: sleep(level=2) discarded them; call load_weights with every "
        "weight of the model after wake_up()"
      )

  # --- composition --------------------------------------------------------------------------------

  def add(self, completion: Completion) -> None:
    """Gives a completion a row (its block table starts empty) and its device stop rules; notes
    a prompt whose logprobs it computes (the first sample of a request asking for
    `prompt_logprobs`)."""
    request = completion.request
    if self.lora is not None:  # first: a failure leaves the batch as it was
      self.lora.acquire(completion.seq_id, request.lora_request)
    self.input_batch.add_request(completion.seq_id, request.prompt_token_ids, completion.params)
    self._stop_rules[completion.seq_id] = device_stop_rules(
      completion.params, self.input_batch.eos_token_ids, self.max_model_len
    )
    if wants_prompt_logprobs(completion):
      self._prompt_logprobs[completion.seq_id] = _PendingPromptLogprobs(
        request.request_id, len(request.prompt_token_ids)
      )

  def remove(self, seq_id: str) -> None:
    """Frees a completion's row (the scheduler frees its pages); the next step condenses the
    batch."""
    self.input_batch.remove_request(seq_id)
    if self.lora is not None:
      self.lora.release(seq_id)
    self._stop_rules.pop(seq_id, None)
    self._prompt_logprobs.pop(seq_id, None)

  def row_bucket(self, num_reqs: int) -> int:
    """The row bucket a step over `num_reqs` live rows computes."""
    return bucket(num_reqs, self.row_buckets)

  # --- the step ---------------------------------------------------------------------------------

  def execute(
    self,
    scheduled: SchedulerOutput,
    grammar_bitmask: Callable[[Sequence[str | None]], np.ndarray | None] | None = None,
  ) -> StepOutput:
    """Runs one ragged step: the scheduled tokens through the model, then the sampler
    (`dispatch`, then `collect`).

    Call after `add` for the step's admitted completions. Updates the block table (pages freed by
    preemption, pages appended), builds the step's inputs and runs `ragged_step`.

    Args:
      scheduled: the scheduler's plan for this step.
      grammar_bitmask: called with the condensed batch's `req_ids`; returns the packed
        `[R, ceil(V / 32)] int32` allowed tokens of rows with structured outputs, or None (the
        step then leaves the bitmask as it is and reads it nowhere).

    Returns:
      `StepOutput`: the sampled tokens of the batch's rows (`req_ids` order; `num_sampled`
      is 1 for rows that produced a token, 0 for rows that only prefilled or were not
      scheduled), and the prompt logprobs of prompts completed this step.
    """
    return self.collect(self.dispatch(scheduled, grammar_bitmask))

  def dispatch(
    self,
    scheduled: SchedulerOutput,
    grammar_bitmask: Callable[[Sequence[str | None]], np.ndarray | None] | None = None,
  ) -> InFlightStep:
    """Dispatches one ragged step (as `execute`) and returns before its tokens are read.

    Without drafts each row's token count is known now (`InFlightStep.num_new_tokens`), so the
    next step can be scheduled and dispatched before `collect` reads this one (asynchronous
    scheduling: the model reads each row's last token from the batch's device state).
    """
    self.check_awake()
    batch = self.input_batch
    self._update_block_table(scheduled)
    if grammar_bitmask is not None and (bitmask := grammar_bitmask(batch.req_ids)) is not None:
      batch.set_grammar_bitmask(bitmask)
    wanted = [s for s in scheduled.num_scheduled_tokens if s in self._prompt_logprobs]
    columns = batch.state.num_top_logprobs + 1 if wanted else 0
    num_tokens, num_rows = self.step_buckets(
      scheduled.total_num_scheduled_tokens, batch.num_reqs, prompt_logprobs=bool(wanted)
    )
    variant = (bool(wanted), bool(scheduled.spec_token_ids))
    shape = self.compiled_shapes.choose(StepShape(num_tokens, num_rows, variant))
    num_tokens, num_rows = shape.num_tokens, shape.num_rows
    produces = [self._produces(scheduled, seq_id) for seq_id in batch.req_ids]
    inputs = self._ragged_inputs(scheduled, num_tokens, num_rows, produces)
    verify = (
      self._verify_inputs(scheduled, num_tokens, num_rows) if scheduled.spec_token_ids else None
    )
    counts = None if verify is not None else [int(p) for p in produces]
    pending = self._run_step(inputs, num_rows, columns, verify, counts)
    return InFlightStep(
      scheduled=scheduled,
      pending=pending,
      num_new_tokens=None if counts is None else dict(zip(batch.req_ids, counts)),
      prompt_logprobs_wanted=wanted,
      query_starts=self._query_starts(scheduled) if wanted else {},
    )

  def _update_block_table(self, scheduled: SchedulerOutput) -> None:
    """Condenses the batch and applies a step's page changes to the block table: preempted rows
    emptied (a prompt whose logprobs were being gathered starts them again: it is recomputed
    from the start), new pages appended."""
    self.input_batch.condense()
    index = self.input_batch.req_id_to_index
    for seq_id in scheduled.preempted:
      self.block_table.clear_row(index[seq_id])
      if seq_id in self._prompt_logprobs:
        self._prompt_logprobs[seq_id].parts.clear()
    if self.kv_cache_manager.frees_pages:  # groups, freed pages: the manager's tables
      for seq_id in scheduled.new_block_ids:
        tables = self.kv_cache_manager.get_group_block_ids(seq_id)
        self.block_table.set_row(index[seq_id], tables)
      return
    for seq_id, block_ids in scheduled.new_block_ids.items():
      self.block_table.append_row(index[seq_id], block_ids)

  def collect(self, step: InFlightStep) -> StepOutput:
    """Reads a dispatched step's tokens (waiting for the device) and appends them to the batch
    (`InputBatch.resolve`); returns its `StepOutput` (`req_ids`: the rows at dispatch)."""
    output = self.input_batch.resolve(step.pending)
    prompt_logprobs = {}
    token_logprobs = step.pending.extra[1]
    if token_logprobs is not None:  # computed when prompt logprobs were wanted
      prompt_logprobs = self._collect_prompt_logprobs(step, token_logprobs)
    req_ids = [req_id for req_id, _ in step.pending.rows]
    return StepOutput(req_ids=req_ids, sampled=output, prompt_logprobs=prompt_logprobs)

  def step_buckets(
    self, num_tokens: int, num_reqs: int, prompt_logprobs: bool = False
  ) -> tuple[int, int]:
    """`(token bucket, row bucket)` of a step of `num_tokens` scheduled tokens over the batch's
    `num_reqs` rows: the row bucket holding them, and `token_bucket`; the largest row bucket
    (`max_num_reqs`) for a step of `FULL_ROWS_MIN_TOKENS` tokens or more and for a step that
    computes prompt logprobs. Those steps cost far more than the logits of a few more rows
    (`[T, V]` logits with prompt logprobs), and so `precompile` compiles fewer shapes.
    """
    num_rows = bucket(max(num_reqs, 1), self.row_buckets)
    tokens = self.token_bucket(num_tokens, num_rows)
    if prompt_logprobs or tokens >= FULL_ROWS_MIN_TOKENS:
      num_rows = self.row_buckets[-1]
      tokens = self.token_bucket(num_tokens, num_rows)
    return tokens, num_rows

  def token_bucket(self, num_tokens: int, num_rows: int) -> int:
    """The token bucket of a step of `num_tokens` scheduled tokens over `num_rows` (a row
    bucket): the smallest of `token_buckets` holding them and `min(num_rows, MIN_TOKEN_BUCKET)`."""
    return bucket(max(1, num_tokens, min(num_rows, MIN_TOKEN_BUCKET)), self.token_buckets)

  def _run_step(
    self,
    inputs: RaggedInputs,
    num_rows: int,
    prompt_logprobs: int,
    drafts: RaggedDrafts | None = None,
    num_new_tokens: list[int] | None = None,
  ) -> PendingStep[HostMultiStepOutput]:
    """Dispatches the jitted ragged step through `InputBatch.dispatch_step` (the one call site,
    so `dispatch` and `precompile` reach the same jit cache entries), the verify step when
    `drafts` are given; keeps the new cache. The pending step's `extra` is `(kv_cache, prompt
    LogprobsTensors or None)`."""
    step = self.ragged_step if drafts is None else self.ragged_verify_step
    extra_args = () if drafts is None else (drafts,)
    pending = self.input_batch.dispatch_step(
      self._placed(step),
      self.weights,
      self.kv_cache,
      inputs,
      *extra_args,
      fetch=fetch_steps,
      num_new_tokens=num_new_tokens,
      num_rows=num_rows,
      prompt_logprobs=prompt_logprobs,
    )
    self.kv_cache = cast(PagedKVCache, pending.extra[0])
    return pending

  def ragged_step(
    self, state, metadata, weights, kv_cache, inputs: RaggedInputs, num_rows, prompt_logprobs
  ):
    """One plain step as `InputBatch.run_step` calls it: `ragged_forward`, then
    `sample_produced` on its logits (dispatched back to back, no host round trip).

    Returns:
      `(state, MultiStepOutput, (kv_cache, prompt LogprobsTensors or None))`.
    """
    forward = self.ragged_forward(state, weights, kv_cache, inputs, prompt_logprobs)
    state, output = self.sample_produced(state, metadata, forward.logits, inputs.produces, num_rows)
    return state, output, (forward.kv_cache, forward.prompt_logprobs)

  def ragged_verify_step(
    self,
    state,
    metadata,
    weights,
    kv_cache,
    inputs: RaggedInputs,
    drafts: RaggedDrafts,
    num_rows,
    prompt_logprobs,
  ):
    """`ragged_step` with drafts: `verify_forward`, then `rejection_sample_produced` (see
    `worker/verify_step.py`). Returns as `ragged_step`; the output holds `k + 1` positions."""
    forward = self.verify_forward(state, weights, kv_cache, inputs, drafts, prompt_logprobs)
    state, output = self.rejection_sample_produced(
      state, metadata, forward.logits, drafts, inputs.produces, num_rows
    )
    return state, output, (forward.kv_cache, forward.prompt_logprobs)

  def _placed(self, step: Callable[..., Any]) -> Callable[..., Any]:
    """A jitted step as `InputBatch.run_step` calls it: `step` itself off a mesh; on one, state
    and metadata first put on their declared shardings (a no-op when the batch's own updates
    kept them) and the static keyword arguments passed by position, in the order given
    (`jax.jit` takes no keywords with `in_shardings`)."""
    placement = self._placement
    if placement is None:
      return step

    def placed(state, metadata, *args, **static):
      state = jax.device_put(state, placement.state)
      metadata = jax.device_put(metadata, placement.metadata)
      return step(state, metadata, *args, *static.values())

    return placed

  def _collect_prompt_logprobs(
    self, step: InFlightStep, token_logprobs: LogprobsTensors
  ) -> dict[str, LogprobsArrays]:
    """Keeps the logprobs of the prompt tokens predicted in a step; returns, by request id,
    those of the prompts whose last prediction was in it."""
    host = jax.device_get(token_logprobs)
    scheduled, starts = step.scheduled, step.query_starts
    done = {}
    for seq_id in step.prompt_logprobs_wanted:
      pending = self._prompt_logprobs.get(seq_id)
      if pending is None:  # finished or aborted since the dispatch
        continue
      computed = scheduled.num_computed_tokens[seq_id]
      scheduled_count = scheduled.num_scheduled_tokens[seq_id]
      count = min(scheduled_count, pending.num_prompt_tokens - 1 - computed)
      if count > 0:
        rows = slice(starts[seq_id], starts[seq_id] + count)
        pending.parts.append(
          LogprobsArrays(host.token_ids[rows], host.logprobs[rows], host.ranks[rows])
        )
      if computed + scheduled_count >= pending.num_prompt_tokens:
        del self._prompt_logprobs[seq_id]
        parts = pending.parts
        if not parts:  # a one-token prompt: nothing predicts its only token
          continue
        done[pending.request_id] = LogprobsArrays(
          token_ids=np.concatenate([p.token_ids for p in parts]),
          logprobs=np.concatenate([p.logprobs for p in parts]),
          ranks=np.concatenate([p.ranks for p in parts]),
        )
    return done

  def _verify_inputs(
    self, scheduled: SchedulerOutput, num_tokens: int, num_rows: int
  ) -> RaggedDrafts:
    """The step's drafts laid out for `ragged_verify_step` (none: a verify step of no drafts,
    which precompile runs)."""
    index = self.input_batch.req_id_to_index
    rows = {seq_id: index[seq_id] for seq_id in scheduled.num_scheduled_tokens}
    starts = self._query_starts(scheduled)
    k = self.num_speculative_tokens
    return ragged_drafts(scheduled, rows, starts, num_tokens, num_rows, k, self._input_sharding)

  def _query_starts(self, scheduled: SchedulerOutput) -> dict[str, int]:
    """Each scheduled completion's first flat token index (rows in batch order)."""
    index = self.input_batch.req_id_to_index
    order = sorted(scheduled.num_scheduled_tokens, key=index.__getitem__)
    counts = [scheduled.num_scheduled_tokens[s] for s in order]
    return dict(zip(order, np.cumsum([0, *counts[:-1]]).tolist()))

  def _produces(self, scheduled: SchedulerOutput, seq_id: str) -> bool:
    """Whether the step computes `seq_id`'s last known token (so samples its next one)."""
    count = scheduled.num_scheduled_tokens.get(seq_id)
    if count is None:
      return False
    drafts = len(scheduled.spec_token_ids.get(seq_id, ()))
    done = scheduled.num_computed_tokens[seq_id]
    return done + count - drafts == self.input_batch.num_tokens(seq_id)

  def _ragged_inputs(
    self,
    scheduled: SchedulerOutput,
    num_tokens: int,
    num_rows: int,
    produces: Sequence[bool] = (),
  ) -> RaggedInputs:
    """The step's `RaggedInputs`: scheduled rows in row order, padded to the buckets;
    `produces` says which live rows sample (`_produces`, by row; none when empty)."""
    batch = self.input_batch
    rows = sorted(batch.req_id_to_index[seq_id] for seq_id in scheduled.num_scheduled_tokens)
    seq_ids = [batch.req_ids[row] for row in rows]
    computed = [scheduled.num_computed_tokens[s] for s in seq_ids]
    counts = [scheduled.num_scheduled_tokens[s] for s in seq_ids]
    grouped = self.block_table.num_groups > 1
    tables = self.block_table.group_rows if grouped else self.block_table.row
    layout = build_step_inputs(
      [tables(row).tolist() for row in rows],
      computed,
      counts,
      block_size=self.block_size,
      num_tokens=num_tokens,
      num_reqs=num_rows,
      max_blocks_per_req=self.max_num_blocks_per_req,
      num_groups=self.block_table.num_groups if grouped else None,
    )
    token_rows = np.zeros(num_tokens, np.int32)
    token_rows[: layout.num_tokens] = np.repeat(rows, counts)
    logits_indices = np.zeros(num_rows, np.int32)
    logits_indices[rows] = layout.logits_indices[: len(rows)]
    produced = np.zeros(num_rows, bool)
    produced[: len(produces)] = produces
    host: tuple[Any, ...] = (
      token_rows,
      layout.positions,
      layout.slot_mapping,
      layout.block_tables,
      layout.query_start_loc,
      layout.seq_lens,
      np.int32(layout.num_reqs),
      logits_indices,
      produced,
    )
    if self.lora is not None:  # each token's adapter slot, only for a LoRA engine
      host += (self.lora.token_slots(seq_ids, counts, num_tokens),)
    device = jax.device_put(host, self._input_sharding)  # one transfer for the step's inputs
    return RaggedInputs(
      token_rows=device[0],
      positions=device[1],
      attention=PagedAttentionMetadata(
        slot_mapping=device[2],
        block_tables=device[3],
        query_start_loc=device[4],
        seq_lens=device[5],
        num_reqs=device[6],
      ),
      logits_indices=device[7],
      produces=device[8],
      lora=None if self.lora is None else self.lora.inputs(device[-1]),
    )

  def precompile(
    self, num_decode_steps: int = 1, use_tqdm: bool = True, num_speculative_tokens: int = 0
  ) -> int:
    """Compiles every executable a step can reach now, so that serving compiles nothing: the
    ragged step for every (token bucket, row bucket) (an empty step each: every token is
    padding, writing only the null page), with and without prompt logprobs, its verify step too
    when `num_speculative_tokens` > 0 and, for `num_decode_steps` k > 1, the k-step decode loop
    for every row bucket (no row runs); and the batch's own updates
    (`InputBatch.precompile_updates`). Returns the number of step shapes: the (token bucket,
    row bucket) pairs a step can reach (`step_shapes`; with prompt logprobs only the largest
    row bucket), twice with speculative decoding, plus `len(row_buckets)` when k > 1.

    Raises:
      ValueError: if the batch holds requests.
      RuntimeError: while asleep or without weights (`check_awake`).
    """
    self.check_awake()
    batch = self.input_batch
    if batch.num_reqs:
      raise ValueError(f"precompile needs an empty batch, it holds {batch.num_reqs} requests")
    batch.precompile_updates()
    if self.lora is not None:
      self.lora.precompile()
    empty = SchedulerOutput([], {}, {}, {}, [])
    columns = batch.state.num_top_logprobs + 1  # `dispatch`'s prompt logprobs
    variants = [
      (num_tokens, num_rows, drafted, columns if prompt_logprobs else 0)
      for prompt_logprobs in (False, True)
      for num_tokens, num_rows in self.step_shapes(prompt_logprobs)
      for drafted in ([False, True] if num_speculative_tokens else [False])
    ]
    for num_tokens, num_rows, drafted, columns in tqdm(
      variants, desc="Compiling", disable=not use_tqdm
    ):
      variant = (bool(columns), drafted)
      self.compiled_shapes.mark_compiled(StepShape(num_tokens, num_rows, variant))
      drafts = self._verify_inputs(empty, num_tokens, num_rows) if drafted else None
      inputs = self._ragged_inputs(empty, num_tokens, num_rows)
      batch.resolve(self._run_step(inputs, num_rows, columns, drafts))
    if num_decode_steps > 1:  # the k-step loop: one executable per row bucket
      for num_rows in self.row_buckets:
        self._run_decode_steps(empty, num_rows, num_decode_steps, end_on_first_finish=False)
    jax.block_until_ready(cast(Any, self.kv_cache))
    return len(variants) + (len(self.row_buckets) if num_decode_steps > 1 else 0)

  def step_shapes(self, prompt_logprobs: bool = False) -> list[tuple[int, int]]:
    """The `(token bucket, row bucket)` pairs a ragged step can reach (`step_buckets`), with or
    without prompt logprobs."""
    shapes = {
      self.step_buckets(t, r, prompt_logprobs) for r in self.row_buckets for t in self.token_buckets
    }
    return sorted(shapes, key=lambda shape: shape[::-1])

  # --- the k-step decode ------------------------------------------------------------------------

  def execute_decode_steps(
    self, scheduled: SchedulerOutput, num_steps: int, end_on_first_finish: bool = False
  ) -> StepOutput:
    """Runs a k-step decode (`worker/multi_step.py`): up to `num_steps` ragged decode
    steps in one device loop over the rows `scheduled.num_decode_steps` names (each at most
    that many tokens; the other rows wait).

    Call with the output of `Scheduler.schedule_decode_steps`. Updates the block table
    (pages freed by preemption, pages appended, lookahead included) and appends every valid
    token to the batch.

    Args:
      scheduled: the step's plan, with `num_decode_steps`.
      num_steps: `k` (static: one executable per row bucket and value).
      end_on_first_finish: end the loop once some row stops by a stop rule (requests wait).

    Returns:
      `StepOutput`: up to `k` tokens per row (`sampled.num_sampled`, which is also the
      positions each row computed), no prompt logprobs.
    """
    self.check_awake()
    batch = self.input_batch
    self._update_block_table(scheduled)
    num_rows = bucket(batch.num_reqs, self.row_buckets)
    output = self._run_decode_steps(scheduled, num_rows, num_steps, end_on_first_finish)
    return StepOutput(req_ids=batch.req_ids, sampled=output, prompt_logprobs={})

  def _run_decode_steps(
    self,
    scheduled: SchedulerOutput,
    num_rows: int,
    num_steps: int,
    end_on_first_finish: bool,
  ) -> HostMultiStepOutput:
    """The jitted k-step loop through `run_steps` (the one call site, shared with
    `precompile`); keeps the new cache."""
    batch = self.input_batch
    max_num_steps = np.zeros(num_rows, np.int32)
    for seq_id, steps in scheduled.num_decode_steps.items():
      max_num_steps[batch.req_id_to_index[seq_id]] = steps
    rules = [self._stop_rules[seq_id] for seq_id in batch.req_ids]
    max_output_tokens, stop_ids = stop_rule_arrays(rules, num_rows, self.max_num_device_stop_ids)
    host: tuple[Any, ...] = (
      self.block_table.group_block_ids[:, :num_rows]
      if self.block_table.num_groups > 1
      else self.block_table.block_ids[:num_rows],
      np.int32(batch.num_reqs),
      max_num_steps,
      max_output_tokens,
      stop_ids,
      np.bool_(end_on_first_finish),
    )
    if self.lora is not None:  # row r's token is flat token r: one slot per row
      host += (self.lora.token_slots(batch.req_ids, 1, num_rows),)
    device = jax.device_put(host, self._input_sharding)  # one transfer for the loop's inputs
    inputs = DecodeStepsInputs(
      block_tables=device[0],
      num_reqs=device[1],
      max_num_steps=device[2],
      max_output_tokens=device[3],
      stop_ids=device[4],
      end_on_first_finish=device[5],
      lora=None if self.lora is None else self.lora.inputs(device[-1]),
    )
    output, kv_cache = run_steps(
      batch,
      self._placed(self.decode_steps),
      self.weights,
      self.kv_cache,
      inputs,
      num_rows=num_rows,
      num_steps=num_steps,
    )
    self.kv_cache = cast(PagedKVCache, kv_cache)
    return output


def _lora_manager(model: Model, config: EngineConfig) -> LoRAManager:
  """The runner's `LoRAManager` with `enable_lora` (ValueError for a model without LoRA)."""
  shapes = getattr(model, "lora_target_shapes", None)
  if shapes is None:
    raise ValueError(f"enable_lora=True: {type(model).__name__} models do not support LoRA")
  return LoRAManager(
    max_loras=config.max_loras,
    max_lora_rank=config.max_lora_rank,
    max_cpu_loras=cast(int, config.max_cpu_loras),  # validated: never None
    num_layers=len(cast(Any, model).layers),
    target_shapes=shapes(),
    dtype=cast(Any, model).dtype,
    device=_committed_device(model),
  )


def _committed_device(model: Model) -> jax.Device | None:
  """The one device the model's weights are committed to (a trainer's arrays), else None."""
  leaf = jax.tree.leaves(nnx.state(cast(Any, model)))[0]
  if isinstance(leaf, jax.Array) and getattr(leaf, "committed", False):
    return next(iter(leaf.devices()))
  return None


def _check_sizes(model: Model, input_batch: InputBatch, config: EngineConfig) -> None:
  """Refuses a batch, config and model that do not go together (ValueError, naming both)."""
  sizes = (config.max_num_reqs, config.max_model_len)
  if sizes != (input_batch.max_num_reqs, input_batch.max_model_len):
    raise ValueError(
      f"the config's max_num_reqs, max_model_len={sizes} differ from the batch's "
      f"{(input_batch.max_num_reqs, input_batch.max_model_len)}"
    )
  if model.vocab_size != input_batch.vocab_size:
    raise ValueError(
      f"the model's vocab_size={model.vocab_size} differs from the batch's "
      f"vocab_size={input_batch.vocab_size}"
    )
  if input_batch.max_model_len > model.max_position_embeddings:
    raise ValueError(
      f"max_model_len={input_batch.max_model_len} exceeds the model's "
      f"max_position_embeddings={model.max_position_embeddings}"
    )
  table = input_batch.block_table
  if table is None or table.max_num_blocks_per_req != config.max_num_blocks_per_req:
    raise ValueError(
      f"the runner needs a batch built with max_num_blocks_per_req="
      f"{config.max_num_blocks_per_req} (ceil(max_model_len / block_size))"
    )


def _narrows(tensor, leaf: jax.Array) -> bool:
  """Whether casting floating `tensor` to `leaf`'s dtype can overflow (a narrower float)."""
  dtype = np.dtype(getattr(tensor, "dtype", np.float64))
  if not jnp.issubdtype(dtype, jnp.floating):
    return False
  return float(jnp.finfo(dtype).max) > float(jnp.finfo(leaf.dtype).max)


def _choose_backend(
  config: EngineConfig, spec: KVCacheSpec, mesh: jax.sharding.Mesh | None, devices: Sequence[Any]
) -> AttentionBackend:
  """The paged cache's attention backend for `config.attention_backend`, checked against the
  `KVCacheSpec` and the devices (host side). With ``attention_backend=None`` the platform's
  default gives way to XLA where it cannot serve the spec (a Gemma or Mistral model on GPU, whose
  Pallas decode kernel has no window or cap; fp8 pages on a GPU without Triton's fp8).

  Raises:
    ValueError: the model's `sliding_window`, `soft_cap` or the cache dtype with an explicit
      backend that has none, or a backend that does not run on the platform.
  """
  chosen = attention_backend(config.attention_backend)
  if config.attention_backend is None and not _serves(chosen, spec, devices):
    chosen = XlaAttentionBackend()
  if config.batch_invariant:  # the config allows only "xla" (or None on CPU) with it
    chosen = XlaAttentionBackend(fixed_order=True)
  backend = shard_backend(chosen, mesh, spec.num_kv_heads)
  backend.check_sliding_window(spec.sliding_window)
  backend.check_soft_cap(spec.soft_cap)
  backend.check_kv_cache_dtype(spec.dtype, devices)
  backend.check_platform(jax.default_backend())
  return backend


def _serves(backend: AttentionBackend, spec: KVCacheSpec, devices: Sequence[Any]) -> bool:
  """Whether `backend` has the sliding window, soft cap and cache dtype the `KVCacheSpec` asks
  for on `devices`."""
  try:
    backend.check_kv_cache_dtype(spec.dtype, devices)
  except ValueError:
    return False
  return (spec.sliding_window is None or backend.supports_sliding_window) and (
    spec.soft_cap is None or backend.supports_soft_cap
  )
