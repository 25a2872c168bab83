"""The engine's executables as shapes: what `worker/precompile.py` compiles, built from a
model's ``config.json`` alone and placed on devices that need hold no array (a TPU topology's).

`abstract_engine` builds what a runner holds, abstractly: the model from its config under
`nnx.eval_shape` (batch-invariant and quantized as the engine would serve it), its weights as
`jax.ShapeDtypeStruct`s in the runner's shardings (`worker/placement.py` on a mesh of the given
devices; the one device otherwise), the persistent batch (host arrays, whose shapes the steps
take), and the pool of KV-cache pages as shapes. `engine_executables` then yields each jitted step
of `worker/device_steps.py` with the arguments of one precompiled shape, the same set
`worker/precompile.py` runs: the ragged step's model part per (token bucket, row bucket) with
and without prompt logprobs, its sampler per row bucket of at least 8 rows (`sample_rows`), the
verify step's two parts with speculative decoding, and the k-step decode loop per row bucket with
`num_decode_steps` > 1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, cast

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding

from jaxengine.batch import InputBatch
from jaxengine.batch.block_table import BlockTable
from jaxengine.core.scheduler import SchedulerOutput
from jaxengine.engine.engine_core import config_input_batch
from jaxengine.engine_config import EngineConfig
from jaxengine.lora import LoRAManager
from jaxengine.models.attention_backends import AttentionBackend
from jaxengine.models.batch_invariant import batch_invariant_model
from jaxengine.models.interface import Model
from jaxengine.models.kv_cache import KVCacheSpec
from jaxengine.models.kv_pages import PagedKVCache
from jaxengine.models.layer_scan import scan_config
from jaxengine.models.quantization import quantize_model
from jaxengine.models.registry import hf_architecture
from jaxengine.models.safetensors_loader import eos_token_ids, read_hf_config
from jaxengine.models.weights import abstract_module
from jaxengine.worker import buckets as step_buckets
from jaxengine.worker.buckets import StepShape
from jaxengine.worker.device_steps import DeviceSteps, placed_device_steps
from jaxengine.worker.kv_cache_pool import cache_groups, choose_backend, pool_layout
from jaxengine.worker.lora_loader import lora_manager
from jaxengine.worker.multi_step import DecodeStepsInputs, DeviceStopRules, decode_steps_inputs
from jaxengine.worker.placement import MeshPlacement
from jaxengine.worker.ragged_step import RaggedInputs
from jaxengine.worker.recurrent_state import (
  check_hybrid_config,
  num_draft_states,
  num_snapshots,
  pool_shardings,
  recurrent_state_spec,
  state_pool,
)
from jaxengine.worker.step_inputs import ragged_inputs
from jaxengine.worker.verify_step import ragged_drafts


@dataclasses.dataclass(frozen=True)
class Executable:
  """One executable the engine compiles, ready to lower: ``jitted.lower(*args, **kwargs)``.

  Attributes:
    name: the step: ``"ragged_step"`` (the model over a token bucket), ``"sample"`` (the
      sampler over a row bucket), ``"verify_step"`` and ``"rejection_sample"`` (speculative
      decoding's two parts), ``"decode_steps"`` (the k-step decode loop).
    shape: its bucket, e.g. ``"tokens=256 rows=64"``.
    jitted: the `jax.jit` wrapper the engine calls (`worker/device_steps.py`).
    args: pytrees of `jax.ShapeDtypeStruct` with the engine's shardings, then the static
      arguments where the runner passes them by position (a step's parts; every step on a mesh,
      where ``jax.jit`` takes no keywords with `in_shardings`: `placed_step`).
    kwargs: the static keyword arguments of the k-step loop off a mesh, else empty.
    step: the runner's `StepShape` of a ``"ragged_step"`` or ``"verify_step"`` (its variant:
      prompt logprobs, drafts), None for the others.
  """

  name: str
  shape: str
  jitted: Callable[..., Any]
  args: tuple
  kwargs: dict
  step: StepShape | None = None

  def lower(self) -> Any:
    """``jitted.lower(*args, **kwargs)``: the `jax.stages.Lowered`, to ``.compile()``."""
    return cast(Any, self.jitted).lower(*self.args, **self.kwargs)


class StepSource(Protocol):
  """What `engine_executables` reads: an `AbstractEngine`, or a live runner's parts
  (`entrypoints/background_compile.py`)."""

  config: EngineConfig
  batch: InputBatch
  steps: DeviceSteps | None
  placement: MeshPlacement | None
  weights: Any
  kv_cache: Any
  lora: LoRAManager | None

  @property
  def vocab_size(self) -> int: ...

  def sharded(self, tree: Any, shardings: Any = None) -> Any: ...

  def inputs_shardings(self, inputs_type: type) -> Any: ...


@dataclasses.dataclass
class AbstractEngine:
  """What a `ModelRunner` holds, as shapes (see the module; built by `abstract_engine`).

  Attributes:
    config: the engine config of one data-parallel group, resolved for the model.
    model: the served module (abstract: `jax.ShapeDtypeStruct` leaves).
    weights: its `nnx.State` as `jax.ShapeDtypeStruct`s with their shardings.
    placement: the runner's `MeshPlacement` on `config.mesh`, None on one device.
    device: the device of a one-device engine (the mesh's first otherwise).
    batch: the persistent batch (host arrays on the default device, used for their shapes).
    backend: the pool's attention backend.
    page_spec: the `KVCacheSpec` of one page (its layers and dtype).
    layer_groups: the KV cache groups' layers (None for one group).
    num_blocks_per_req: pages one request of `max_model_len` tokens holds.
    graphdef: the served module's structure.
    steps: the jitted steps (`worker/device_steps.py`); set by `set_num_blocks` (on a mesh
      their shardings name the pool's).
    num_blocks: pages of the pool (the null page included); set by `set_num_blocks`.
    kv_cache: the pool as shapes with their shardings (a hybrid model's recurrent state
      pool in its ``recurrent``, `worker/recurrent_state.py`); set by `set_num_blocks`.
    lora: the LoRA slots with `enable_lora`, else None.
  """

  config: EngineConfig
  model: Model
  weights: Any
  placement: MeshPlacement | None
  device: Any
  batch: InputBatch
  backend: AttentionBackend
  page_spec: KVCacheSpec
  layer_groups: tuple[tuple[int, int], ...] | None
  num_blocks_per_req: int
  graphdef: Any
  steps: DeviceSteps | None = None
  num_blocks: int = 0
  kv_cache: Any = None
  lora: LoRAManager | None = None

  @property
  def mesh(self) -> Mesh | None:
    return self.config.mesh

  @property
  def vocab_size(self) -> int:
    return self.model.vocab_size

  def sharded(self, tree: Any, shardings: Any = None) -> Any:
    """`tree`'s arrays as `jax.ShapeDtypeStruct`s in `shardings` (a tree of them, or one for
    every leaf; None: replicated on a mesh, else the engine's device)."""
    if shardings is None:
      one = self.placement.replicated if self.placement is not None else None
      shardings = one or SingleDeviceSharding(self.device)
    if not isinstance(shardings, jax.sharding.Sharding):  # a tree, or a prefix of `tree`
      return jax.tree.map(lambda s, sub: self.sharded(sub, s), shardings, tree)
    return jax.tree.map(lambda x: _spec(x, shardings), tree)

  def inputs_shardings(self, inputs_type: type) -> Any:
    """A step's inputs' shardings (None: as `sharded`'s default), the LoRA slots' on a mesh."""
    return None if self.placement is None else self.placement.step_inputs_shardings(inputs_type)

  def recurrent_pool(self) -> Any:
    """A hybrid model's recurrent state pool (`worker/recurrent_state.py`) as shapes with the
    runner's shardings, None for a model without recurrent state."""
    spec = recurrent_state_spec(self.model)
    if spec is None:
      return None
    pool = jax.eval_shape(lambda: state_pool(spec, self.config))  # the runner's slots
    mesh = self.placement.mesh if self.placement is not None else None
    return self.sharded(pool, None if mesh is None else pool_shardings(pool, mesh))

  def set_num_blocks(self, num_blocks: int) -> None:
    """Sizes the pool: `num_blocks` pages (the null page included), as shapes, and a hybrid
    model's recurrent state pool beside them."""
    cfg = self.config
    cache = jax.eval_shape(
      lambda: PagedKVCache.create(
        self.page_spec, self.backend, num_blocks, cfg.block_size, self.layer_groups
      )
    )
    pool = self.recurrent_pool()
    shardings = None
    if self.placement is not None:
      shardings = self.placement.kv_pages_shardings(cache, self.backend)
      if pool is not None:
        shardings = dataclasses.replace(shardings, recurrent=jax.tree.map(_sharding, pool))
      self.placement.kv_pages = shardings
    if pool is not None:
      cache = dataclasses.replace(cache, recurrent=pool)
    self.num_blocks, self.kv_cache = num_blocks, self.sharded(cache, shardings)
    self.steps = placed_device_steps(
      self.graphdef, self.mesh, self.placement, self.model.vocab_size
    )


def _executable(
  engine: StepSource, name: str, shape: str, jitted: Callable[..., Any], args: tuple,
  static: dict[str, Any], step: StepShape | None = None,
) -> Executable:  # fmt: skip
  """An `Executable` whose static arguments go as the runner passes them (see `Executable`): by
  position after the others for the parts of a step (`worker/device_steps.py`'s `ragged_step`
  and `ragged_verify_step` call them so) and on a mesh, else (the k-step loop) by keyword."""
  if engine.placement is not None or name != "decode_steps":
    return Executable(name, shape, jitted, (*args, *static.values()), {}, step)
  return Executable(name, shape, jitted, args, static, step)


def _sharding(x: jax.ShapeDtypeStruct) -> Any:
  return x.sharding


def _spec(x: Any, sharding: Any) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def abstract_engine(
  model_dir: str,
  config: EngineConfig,
  devices: Sequence[Any],
  dtype: Any,
  platform: str = "tpu",
) -> AbstractEngine:
  """Builds a runner's parts for the model of `model_dir`'s ``config.json`` (see the module).

  Args:
    model_dir: a Hugging Face directory; only ``config.json`` (and ``generation_config.json``
      for the EOS ids, when there) is read.
    config: the engine's config, its `mesh` (when tensor or data parallel) over `devices`; one
      data-parallel group's is built (every group compiles the same executables).
    devices: the devices to compile for (a topology's).
    dtype: the weights' JAX dtype.
    platform: the platform the steps compile for (the attention backend's default).

  Raises:
    ValueError: a config the engine would refuse for this model (as `EngineConfig.for_model`,
      `MeshPlacement.check`, the attention backend's checks), or an unsupported architecture.
  """
  hf = read_hf_config(model_dir)
  architecture = hf_architecture(hf)
  # Stacked layers on the target platform's default (or as `scan_layers` asks), as the runner
  # would load them (`jaxengine.models.layer_scan.scan_config`).
  model_config = scan_config(architecture.read_config(hf), config.scan_layers, platform)
  config = config.for_model(model_config.max_position_embeddings).data_parallel_groups()[0]
  model = cast(Model, abstract_module(architecture.module, model_config, dtype))
  check_hybrid_config(model, config)  # what a hybrid model refuses, as the runner does
  eos = eos_token_ids(model_dir) or [0]
  batch = config_input_batch(config, model.vocab_size, eos)
  mesh = config.mesh
  if mesh is not None:
    MeshPlacement.check(model, batch, mesh, expert_parallel=config.enable_expert_parallel)
  if config.batch_invariant or config.quantization is not None:
    model = cast(Model, nnx.eval_shape(lambda: _served(model, config)))
  graphdef, weights = nnx.split(cast(nnx.Module, model))
  placement = None
  if mesh is not None:
    placement = MeshPlacement(
      model,
      weights,
      batch,
      mesh,
      expert_parallel=config.enable_expert_parallel,
      batch_invariant=config.batch_invariant,
    )
  spec = model.kv_cache_spec
  groups = cache_groups(spec, config)
  if groups.num_groups > 1:  # one table per group and row, as the runner's
    batch.block_table = BlockTable(
      config.max_num_reqs, config.max_num_blocks_per_req, groups.num_groups
    )
  page_spec, layer_groups, per_req = pool_layout(
    spec, config, groups, config.resolved_max_model_len
  )
  backend = choose_backend(config, page_spec, mesh, list(devices), platform=platform)
  engine = AbstractEngine(
    config=config,
    model=model,
    weights=weights,
    placement=placement,
    device=devices[0] if mesh is None else mesh.devices.flat[0],
    batch=batch,
    backend=backend,
    page_spec=page_spec,
    layer_groups=layer_groups,
    num_blocks_per_req=per_req,
    graphdef=graphdef,
  )
  engine.weights = engine.sharded(weights, placement.weights if placement else None)
  if config.enable_lora:
    engine.lora = lora = lora_manager(model, config)  # host shapes; on a mesh, the steps'
    if placement is not None:  # shardings name the slots' (`MeshPlacement.lora_shardings`)
      placement.lora_shardings(lora.target_shapes, lora.num_layers)
  return engine


def _served(model: Model, config: EngineConfig) -> Model:
  """The module the runner serves (`worker/weight_loader.py`'s `prepare_model`, for shapes; under
  `nnx.eval_shape`, where the abstract weights become traced zeros for the quantizer to read)."""
  graphdef, state = nnx.split(cast(nnx.Module, model))
  state = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), state)
  model = cast(Model, nnx.merge(graphdef, state))
  if config.batch_invariant:
    model = batch_invariant_model(model)
  if config.quantization is not None:
    model = cast(Model, quantize_model(model, config.quantization).model)
  return model


def engine_executables(engine: StepSource) -> Iterator[Executable]:
  """The executables `worker/precompile.py` compiles for `engine` (see the module), each
  once: the sampler's per `sample_rows` bucket, the others (the rejection sampler too: its
  drafts hold the step's token ids) per shape; a step's sampler comes right after the first
  step that needs it.

  An `AbstractEngine`'s `set_num_blocks` must have sized the pool first.
  """
  if engine.kv_cache is None or engine.steps is None:
    raise ValueError("engine_executables needs the pool's size: call set_num_blocks first")
  config, batch, steps, placement = engine.config, engine.batch, engine.steps, engine.placement
  rows_per_shard = placement.rows if placement is not None else 1
  row_buckets = step_buckets.row_buckets(
    config.max_num_reqs, rows_per_shard, config.batch_invariant
  )
  token_buckets = step_buckets.buckets(cast(int, config.max_num_batched_tokens), 1)
  state = engine.sharded(batch.state, placement.state if placement else None)
  metadata = engine.sharded(batch.sampling_metadata, placement.metadata if placement else None)
  vocab = engine.vocab_size
  logits_sharding = placement.logits_sharding(vocab) if placement else None
  empty = SchedulerOutput([], {}, {}, {}, [])
  block_table = cast(BlockTable, batch.block_table)
  # A hybrid model's steps take each row's state slot (`worker/recurrent_state.py`).
  state_slots: dict[str, int] | None = (
    {} if getattr(engine.kv_cache, "recurrent", None) is not None else None
  )
  k = config.num_speculative_tokens
  columns = batch.state.num_top_logprobs + 1  # `precompile`'s prompt logprobs
  sampled: set[tuple] = set()
  for prompt_logprobs in (False, True):
    for num_tokens, num_rows in step_buckets.step_shapes(
      row_buckets, token_buckets, prompt_logprobs
    ):
      extra = f" prompt_logprobs={columns}" if prompt_logprobs else ""
      shape = f"tokens={num_tokens} rows={num_rows}"

      def step_inputs(sample_rows: int, drafted: bool = False) -> Any:
        # With its prefix caching, or in a verify step, also where each row reads and saves
        # state (`core/state_snapshots.py`, `core/state_slots.py`).
        drafts = num_draft_states(config) if drafted else 0
        routes = state_slots is not None and bool(num_snapshots(config) or drafts)
        return engine.sharded(ragged_inputs(batch, block_table, empty, num_tokens, num_rows,
                                            block_size=config.block_size, lora=engine.lora,
                                            num_sample_rows=sample_rows,
                                            state_slots=state_slots,
                                            state_routes={} if routes else None,
                                            num_draft_states=drafts),
                              engine.inputs_shardings(RaggedInputs))  # fmt: skip

      sample_rows = step_buckets.sample_rows(num_rows, row_buckets)
      plain = step_inputs(sample_rows)
      pl = columns if prompt_logprobs else 0
      args = (state, engine.weights, engine.kv_cache, plain)
      yield _executable(engine, "ragged_step", shape + extra, steps.ragged_forward, args,
                        {"prompt_logprobs": pl},
                        StepShape(num_tokens, num_rows, (prompt_logprobs, False)))  # fmt: skip
      if ("sample", sample_rows) not in sampled:
        sampled.add(("sample", sample_rows))
        logits = engine.sharded(
          jax.ShapeDtypeStruct((sample_rows, vocab), jnp.float32), logits_sharding
        )
        yield _executable(engine, "sample", f"rows={sample_rows}", steps.sample_produced,
                          (state, metadata, logits, plain.produces),
                          {"num_rows": sample_rows})  # fmt: skip
      if not k:
        continue
      inputs = step_inputs(num_rows, drafted=True)  # the verify step: its own rows, unpadded
      produces = inputs.produces
      drafts = engine.sharded(ragged_drafts(empty, {}, {}, num_tokens, num_rows, k))
      verify_args = (state, engine.weights, engine.kv_cache, inputs, drafts)
      yield _executable(engine, "verify_step", f"{shape} drafts={k}{extra}",
                        steps.verify_forward, verify_args, {"prompt_logprobs": pl},
                        StepShape(num_tokens, num_rows, (prompt_logprobs, True)))  # fmt: skip
      # Per verify shape: its drafts' `[T]` token ids are an argument of the rejection sampler.
      if ("rejection_sample", num_tokens, num_rows) not in sampled:
        sampled.add(("rejection_sample", num_tokens, num_rows))
        logits = engine.sharded(jax.ShapeDtypeStruct((num_rows, k + 1, vocab), jnp.float32))
        yield _executable(engine, "rejection_sample", f"{shape} drafts={k}",
                          steps.rejection_sample_produced,
                          (state, metadata, logits, drafts, produces), {"num_rows": num_rows})  # fmt: skip
  if config.num_decode_steps > 1:
    stop_rules = DeviceStopRules(batch, config.resolved_max_model_len)
    for num_rows in row_buckets:
      inputs = engine.sharded(decode_steps_inputs(
        batch, block_table, {}, num_rows, stop_rules, {}, False, lora=engine.lora,
        state_slots=state_slots,
      ), engine.inputs_shardings(DecodeStepsInputs))  # fmt: skip
      yield _executable(
        engine,
        "decode_steps",
        f"rows={num_rows} steps={config.num_decode_steps}",
        steps.decode_steps,
        (state, metadata, engine.weights, engine.kv_cache, inputs),
        {"num_rows": num_rows, "num_steps": config.num_decode_steps},
      )
