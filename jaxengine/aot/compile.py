"""`compile_for_topology`: the engine compiled ahead of time for a Cloud TPU topology or NVIDIA
GPUs, from a model's ``config.json`` alone, with its memory planned per chip (design:
`jaxengine compile`).

libtpu compiles for a topology's devices without a TPU (`aot/topologies.py`), the CUDA plugin
for a GPU's without a GPU (`aot/cuda.py`: XLA:GPU's whole pipeline to a cubin, autotuning
skipped). The executables are the engine's own (`aot/executables.py`: `worker/precompile.py`'s
set, with the runner's shardings); each is lowered with the topology's first device as JAX's
default device (Mosaic, the Pallas TPU compiler, reads the target chip from it) and compiled by
XLA:TPU, which reports its flops, bytes and memory, or by XLA:GPU, which reports the memory only
(a GPU's executables have no cost estimate, and its decode estimates are the bytes one step
reads at the GPU's bandwidth). The memory plan is `aot/memory_plan.py`'s, the decode estimates
and the report's other fields `aot/report.py`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxengine import parallel
from jaxengine.aot.cuda import export_for_cuda
from jaxengine.aot.executables import Executable, abstract_engine, engine_executables
from jaxengine.aot.fit_advice import not_fitting_message
from jaxengine.aot.hbm_bytes import hbm_bytes
from jaxengine.aot.memory_plan import memory_plan
from jaxengine.aot.model_source import config_directory
from jaxengine.aot.report import build_report, describe_backend
from jaxengine.aot.topologies import CudaTarget, topology, topology_devices
from jaxengine.engine_config import engine_config
from jaxengine.models.registry import hf_architecture
from jaxengine.models.safetensors_loader import read_hf_config

#: The ``estimate_source`` of an executable XLA gives no cost analysis (a GPU's deviceless compile).
NO_COST_ANALYSIS = "none (no XLA cost analysis for this platform)"
#: The ``estimate_source`` of a TPU executable: `aot/hbm_bytes.py`'s model of its HBM traffic.
HBM_BYTES_SOURCE = "max(HBM bytes of the compiled HLO (aot/hbm_bytes.py) / bandwidth, flops / peak)"
#: Instructions of an executable the report names (its costliest in HBM bytes).
TOP_OPS = 5
_DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.bfloat16}
#: vLLM's other spellings of the dtypes (as `LLM` takes them).
_DTYPE_ALIASES = {"half": "float16", "float": "float32"}


def compile_for_topology(
  model: str | os.PathLike,
  topology_name: str = "v6e:1x1",
  *,
  tensor_parallel_size: int = 1,
  data_parallel_size: int = 1,
  dtype: str = "bfloat16",
  select: Callable[[Executable], bool] | None = None,
  progress: Callable[[dict[str, Any]], None] | None = None,
  before_compile: Callable[[Sequence[Executable]], None] | None = None,
  export_only: bool = False,
  **engine_options: Any,
) -> dict[str, Any]:
  """Compiles every executable the engine precompiles for `topology_name` and plans its memory.

  Args:
    model: a Hugging Face model directory, its ``config.json`` file, or a hub id
      (``"Qwen/Qwen2.5-0.5B"``: its ``config.json`` alone is fetched, `aot/model_source.py`);
      only ``config.json`` is read.
    topology_name: one of `aot.topologies.TOPOLOGIES` (``"v5e:1x1"``, ``"v6e:2x2"``, ...), or
      GPUs of `aot.topologies.CUDA_TARGETS` on one host (``"h100"``, ``"h100:4"``, ...;
      needs the CUDA plugin: `aot/cuda.py`).
    tensor_parallel_size, data_parallel_size: the engine's mesh over the topology's first
      ``d * t`` chips (the engine's data-parallel groups compile the same executables).
    dtype: the weights' dtype, ``"bfloat16"`` (default), ``"float32"`` (vLLM's ``"float"``),
      ``"float16"`` (``"half"``: served as bfloat16, as on TPU) or ``"auto"`` (as `LLM` on an
      accelerator: float32 for a float32 checkpoint, by ``config.json``'s ``torch_dtype`` or
      ``dtype``, else bfloat16).
    select: compile only the executables it accepts (default: all); the memory plan's
      temporary and the decode estimates then see only those.
    progress: called with each executable's report entry as it compiles.
    before_compile: called once with the executables about to compile (after `select`), before
      the first compiles; not called when the model does not fit.
    export_only: with a GPU topology, export each executable for CUDA (`aot/cuda.py`'s
      `export_for_cuda`, on this machine's CPU devices: no plugin needed) instead of compiling
      it: the Pallas kernel's lowering to Triton is checked, not Triton's compile or XLA:GPU's;
      ``compile_s`` is then the export's seconds, ``temp_bytes`` 0, and each entry adds
      ``triton_kernels``.
    **engine_options: `EngineConfig` fields (vLLM's `max_num_seqs` and `max_logprobs` too, as
      `LLM` takes them: `jaxengine.vllm_names`): `max_num_reqs`, `max_model_len`,
      `quantization`, `kv_cache_dtype`, `gpu_memory_utilization`, `enable_lora`,
      `max_lora_rank`, `speculative_config`, `num_decode_steps`, `batch_invariant` and the rest.
      `attention_backend` None (default) is the platform's engine's: the Pallas kernel
      ("pallas_tpu", or "pallas_gpu" on a GPU), or XLA where it cannot serve the model
      (`worker/kv_cache_pool.py`'s `choose_backend` for ``"tpu"`` or ``"gpu"``).

  Returns:
    The report (docs/parallelism.md, "Compiling for a TPU before renting one"):
    ``topology``, ``device_kind``, ``num_devices`` (the chips
    the engine uses: ``tensor_parallel_size x data_parallel_size``), ``topology_chips`` (the
    topology's; the engine takes the first ``num_devices``), ``hbm_bytes_per_device``,
    ``fits``, ``memory_fits`` (the plan alone), ``error`` (None, or why it does not fit or
    compile), ``attention_backend`` (with the pages' dtype), ``temp_known`` (False when nothing
    compiled: ``temp`` is then 0 and ``total`` a lower bound), ``per_device_bytes``
    (``weights``, ``kv_cache``, ``temp``, ``other``, ``total``), ``kv_cache`` (``num_blocks``,
    ``block_size``, ``block_bytes`` (``kv_cache == num_blocks x block_bytes``),
    ``num_groups`` (KV cache groups: a token takes a page slot in each), ``bytes_per_token``
    (``block_bytes x num_groups / block_size``), ``max_tokens`` (the allocated pages' tokens,
    the null page left out), ``budget_blocks`` and ``budget_tokens`` (what
    ``gpu_memory_utilization`` would hold), ``max_model_len``, ``max_model_len_fit`` (the
    longest that fits, sliding-window groups holding their window only; at most the model's
    ``max_position_embeddings``), ``fixed_pool`` (``"num_kv_blocks=N"``, ... or None)),
    ``executables`` (``name``, ``shape``, ``compile_s``, ``flops``, ``bytes_accessed``,
    ``hbm_bytes``, ``estimated_s``, ``estimate_source``, ``temp_bytes``: `step_temp_bytes`,
    ``top_ops``: `compile_executable`), ``decode`` (per batch: ``estimated_step_s``,
    ``memory_floor_s``, ``floor_weight_bytes``, ``flops_floor_s``, ``tokens_per_s``,
    ``method``: `aot/report.py`). A model that does not fit is not compiled (``executables`` empty). On a GPU
    XLA gives no cost analysis: ``flops``, ``bytes_accessed``, ``hbm_bytes``, ``estimated_s`` and
    ``flops_floor_s`` are None, ``estimate_source`` says so, and a decode step's estimate is
    its memory floor.

  Raises:
    ValueError: an unknown topology (naming the known ones), a dtype outside those above,
      a mesh larger than the topology, `export_only` with a TPU topology or a mesh larger than
      this machine's CPU devices, a ``config.json`` field of the wrong type (naming it), or any
      setting the engine refuses for this model.
    TypeError: an engine option that is not an `EngineConfig` field (naming it).
    FileNotFoundError: `model` is no directory with ``config.json``, no ``config.json`` file,
      and no hub id whose ``config.json`` can be fetched.
    ImportError: libtpu is not installed (a TPU topology).
    RuntimeError: the CUDA plugin is not installed (a GPU; the message names the wheels).
  """
  spec = topology(topology_name)
  model_dir = config_directory(model)
  hf = read_hf_config(model_dir)
  hf_architecture(hf).read_config(hf)  # a bad config.json is refused before libtpu starts
  weights_dtype = _weights_dtype(dtype, hf)
  t, d = parallel.check_sizes(tensor_parallel_size, data_parallel_size)
  if t * d > spec.num_chips:
    raise ValueError(
      f"tensor_parallel_size={t} x data_parallel_size={d} needs {t * d} chips; "
      f"{topology_name} has {spec.num_chips}"
    )
  # JAX's persistent cache cannot read back a deviceless TPU executable (it needs a TPU client):
  # each compile here is done afresh (`target_device` turns the cache off around it).
  options: dict[str, Any] = {"compilation_cache": False, **engine_options}
  config = engine_config(None, options, "compile_for_topology")  # before libtpu starts
  devices = (
    _export_devices(topology_name, t * d) if export_only else topology_devices(topology_name)
  )
  if t * d > 1:
    config = config.replace(mesh=parallel.make_mesh(t, d, devices), tensor_parallel_size=t,
                            data_parallel_size=d)  # fmt: skip
  platform = "gpu" if isinstance(spec.chip, CudaTarget) else "tpu"
  engine = abstract_engine(model_dir, config, devices, weights_dtype, platform)
  backend_text = describe_backend(engine)
  hbm = spec.chip.hbm_bytes
  plan = memory_plan(engine, hbm)
  results: list[dict[str, Any]] = []
  error = None
  if plan.fits:
    engine.set_num_blocks(plan.num_blocks)
    executables = [e for e in engine_executables(engine) if select is None or select(e)]
    if before_compile is not None:
      before_compile(executables)
    for executable in executables:
      try:
        if export_only:
          results.append(export_executable(executable))
        else:
          results.append(compile_executable(
            executable, engine.device, spec.chip.hbm_bandwidth, spec.chip.peak_flops
          ))  # fmt: skip
        if progress is not None:
          progress(results[-1])
      except Exception as failure:  # a kernel or lowering the TPU refuses: reported, not raised
        error = f"{executable.name} {executable.shape} does not compile for {topology_name}: "
        error += f"{type(failure).__name__}: {_first_lines(str(failure))}{_where(failure)}"
        break
    temp = max((r["temp_bytes"] for r in results), default=0)
    plan = memory_plan(engine, hbm, temp)
  if not plan.fits:
    error = not_fitting_message(engine, plan, spec, t, d)
  return build_report(engine, spec, plan, results, error, backend_text, t * d)


def _weights_dtype(dtype: str, hf: dict[str, Any]) -> Any:
  """The JAX dtype of `dtype` (see `compile_for_topology`), ``"auto"`` by `hf`'s checkpoint dtype.

  Raises:
    ValueError: a dtype outside `_DTYPES`, its aliases and ``"auto"``.
  """
  name = _DTYPE_ALIASES.get(dtype, dtype)
  if name == "auto":
    written = hf.get("torch_dtype") or hf.get("dtype")
    return jnp.float32 if written in ("float32", "float64") else jnp.bfloat16
  if name not in _DTYPES:
    known = sorted([*_DTYPES, *_DTYPE_ALIASES, "auto"])
    raise ValueError(f"dtype must be one of {known}, got {dtype!r}")
  return _DTYPES[name]


def _export_devices(topology_name: str, count: int) -> tuple[Any, ...]:
  """This machine's first `count` CPU devices, for `export_only` (the export keeps the mesh's
  shape, not its devices).

  Raises:
    ValueError: a TPU topology, or fewer CPU devices than `count`.
  """
  if not isinstance(topology(topology_name).chip, CudaTarget):
    raise ValueError(f"export_only=True exports for CUDA: topology={topology_name!r} is not a GPU")
  devices = tuple(jax.devices("cpu")[:count])
  if len(devices) < count:
    raise ValueError(
      f"export_only=True with {count} GPUs needs {count} CPU devices, this process has "
      f"{len(devices)}: set XLA_FLAGS=--xla_force_host_platform_device_count={count}"
    )
  return devices


def export_executable(executable: Executable) -> dict[str, Any]:
  """Exports one executable for CUDA (`export_for_cuda`); its report entry (no cost analysis)."""
  (exported,) = export_for_cuda([executable])
  return {
    "name": executable.name,
    "shape": executable.shape,
    "compile_s": round(exported.seconds, 3),
    "flops": None,
    "bytes_accessed": None,
    "hbm_bytes": None,
    "estimated_s": None,
    "estimate_source": NO_COST_ANALYSIS,
    "temp_bytes": 0,
    "top_ops": [],
    "triton_kernels": list(exported.triton_kernels),
  }


def compile_executable(
  executable: Executable, device: Any, bandwidth: float, peak_flops: float
) -> dict[str, Any]:
  """Lowers and compiles one executable for `device`'s chip; its report entry.

  With XLA's cost analysis (a TPU's compile): ``flops`` and ``bytes_accessed`` are XLA's,
  ``hbm_bytes`` the bytes the executable moves in HBM by `aot/hbm_bytes.py`'s model of the
  compiled HLO (XLA's count includes on-core VMEM copies and every branch of a conditional),
  ``estimated_s`` max(``hbm_bytes`` / `bandwidth`, flops / `peak_flops`), ``top_ops`` the
  instructions moving the most HBM bytes (``name``, ``opcode``, ``op_name``, ``bytes``).
  Without one (XLA:GPU's deviceless compile) those are None (``top_ops`` empty).
  """
  start = time.perf_counter()
  with target_device(device):
    compiled = executable.lower().compile()
  seconds = time.perf_counter() - start
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):  # older JAX: one dict per program
    cost = cost[0] if cost else {}
  memory = compiled.memory_analysis()
  entry: dict[str, Any] = {
    "name": executable.name,
    "shape": executable.shape,
    "compile_s": round(seconds, 3),
    "flops": None,
    "bytes_accessed": None,
    "hbm_bytes": None,
    "estimated_s": None,
    "estimate_source": NO_COST_ANALYSIS,
    "temp_bytes": step_temp_bytes(memory),
    "top_ops": [],
  }
  if not cost:
    return entry
  cost = dict(cost)
  flops = float(cost.get("flops", 0.0))
  hbm = hbm_bytes(compiled.as_text())
  entry.update(
    flops=flops,
    bytes_accessed=float(cost.get("bytes accessed", 0.0)),
    hbm_bytes=hbm.total,
    estimated_s=max(hbm.total / bandwidth, flops / peak_flops),
    estimate_source=HBM_BYTES_SOURCE,
    top_ops=[dataclasses.asdict(op) for op in hbm.ops[:TOP_OPS]],
  )
  return entry


def step_temp_bytes(memory: Any) -> int:
  """Bytes an executable needs beyond its arguments while it runs, from XLA's
  `memory_analysis()`: its temporaries (``temp_size_in_bytes``), or its peak less its arguments
  (``peak_memory_in_bytes - argument_size_in_bytes``: outputs and temporaries live at the
  peak) where that is more. libtpu reports ``temp_size_in_bytes`` 0 for some executables whose
  peak is as far above their arguments as their neighbours' (a ragged step with prompt logprobs
  at one token bucket, for one): the peak keeps the plan from reading no temporary there."""
  if memory is None:
    return 0
  temp = int(getattr(memory, "temp_size_in_bytes", 0) or 0)
  peak = int(getattr(memory, "peak_memory_in_bytes", 0) or 0)
  arguments = int(getattr(memory, "argument_size_in_bytes", 0) or 0)
  return max(temp, peak - arguments if peak else 0)


@contextlib.contextmanager
def target_device(device: Any) -> Iterator[None]:
  """Lowering for `device`'s chip from a machine without it: JAX's default device (Mosaic, and
  the backends' choices of kernel and block sizes, read the target chip from it:
  `jaxengine.models.target_device`), with JAX's persistent compilation cache off (it cannot
  load a deviceless executable back)."""
  cache_was_on = getattr(jax.config, "jax_enable_compilation_cache", True)
  jax.config.update("jax_enable_compilation_cache", False)
  try:
    with jax.default_device(device):
      yield
  finally:
    jax.config.update("jax_enable_compilation_cache", cache_was_on)


def _where(failure: BaseException) -> str:
  """`` (at file:line)`` of the innermost frame that raised `failure` (an assertion says no more)."""
  frames = traceback.extract_tb(failure.__traceback__)
  return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def _first_lines(text: str, count: int = 3) -> str:
  return " ".join(text.strip().splitlines()[:count])
