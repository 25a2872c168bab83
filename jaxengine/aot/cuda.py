"""CUDA from a CPU machine: the engine's steps exported for CUDA, and compiled for a named GPU.

Two checks, both without a GPU:

* **Export** (`export_for_cuda`, needs nothing beyond the CPU jaxlib): `jax.export` lowers each
  executable for ``platforms=["cuda"]``. Lowering for CUDA runs JAX's Pallas GPU lowering, so the
  paged decode kernel of ``attention_backend="pallas_gpu"`` is traced into Triton IR and embedded
  as a ``__gpu$xla.gpu.triton`` custom call (`TRITON_CUSTOM_CALL`) with the kernel's name: a
  block shape or dtype the Pallas Triton lowering refuses fails here, as it would on the GPU.
  fp8 pages (float8_e4m3fn with float32 scales) lower the same way. What export cannot check is
  Triton's own compile of that IR to PTX (that runs in XLA:GPU). The Triton custom call has no
  export compatibility guarantee, so it is allowed explicitly (`jax.export.DisabledSafetyCheck`);
  an export is for checking the lowering and for running with the same jax version, not for
  archiving. The report's module size is the serialized StableHLO
  (`Exported.mlir_module_serialized`); `Exported.serialize()` would also need the
  `flatbuffers` package.
* **Deviceless compile** (`cuda_topology`, through `aot/compile.py`'s
  `compile_for_topology`): the CUDA PJRT plugin compiles for a GPU it does not have when
  given the GPU's description (XLA's
  ``GpuTargetConfigProto``, text format) as the topology's ``target_config`` option:
  ``jax.experimental.topologies.get_topology_desc("h100", platform="cuda",
  target_config=..., topology="1x1x<gpus>")`` gives compile-only devices, and ``jax.jit(f).lower(
  *ShapeDtypeStructs on those devices).compile()`` runs XLA:GPU's whole pipeline (fusion, Triton
  kernels to PTX for ``sm_90a``, ``ptxas`` to a cubin; the plugin logs "Performing a deviceless
  compilation"). Autotuning needs a GPU and is skipped (XLA's default configs), and a sort
  (the sampler's) takes XLA's fallback rather than CUB's, whose scratch sizes are measured on a
  GPU. `CUDA_TARGETS` (`aot/topologies.py`, with the TPUs' chips) holds the descriptions of a
  few GPUs from their published specifications (SMs, memory, bandwidth, shared memory, compute
  capability). It needs the CUDA plugin and ``ptxas``, about 225 MB of wheels, none of the CUDA
  runtime libraries (no driver is loaded)::

    pip install jax-cuda12-plugin==<jax version> jax-cuda12-pjrt==<jax version> \\
      nvidia-cuda-nvcc-cu12

  (the plugin finds ``ptxas`` in ``nvidia/cuda_nvcc/bin``, else on ``PATH``; the engine's
  steps need no cuDNN, cuBLAS or CUDA runtime library). Tried with jax 0.10.2 and
  ``nvidia-cuda-nvcc-cu12`` 12.9.86 on a 2-core machine without a GPU or driver: SmolLM2-135M's
  ragged step (256 tokens, 64 rows), sampler and 8-step decode loop with the Pallas GPU kernel
  compile for an H100 in 27 s, 40 s and 68 s (bfloat16 pages; fp8 pages about the same), and a
  topology of several GPUs (``"h100:4"``) compiles sharded code with its all-reduces. Without
  the plugin the topology is refused (`cuda_topology` raises RuntimeError naming the wheels).
  The compiled executable's ``cost_analysis()`` is None on this path; ``memory_analysis()``
  gives its argument, output and temporary bytes per GPU.

The paged decode kernel at the engine's shapes (64 rows, 16-position pages, 2048 positions, so
8 pages per compute block) compiles for an H100 at every head size and group the model families
use (64 with 3 or 7 query heads per KV head, 128 with 4 or 8, 256 with 2), bfloat16 and fp8
pages. On an ``"l4"`` (99 KiB of shared memory a block) head size 256 with bfloat16 pages is
refused: "RESOURCE_EXHAUSTED: Shared memory size limit exceeded: requested 143360, available:
101376" (fp8 pages fit). Export alone does not see that: shared memory is Triton's compile.

fp8 pages on a GPU before compute capability 8.9 (``"a100"``) are refused on the host by
`PallasGpuAttentionBackend.check_kv_cache_dtype` (the compile-only devices report their
``compute_capability``); compiled anyway, Triton aborts the whole process ("Conversion from/to
f8e4m3nv is only supported on compute capability >= 89", an LLVM fatal error, not an
exception), so the check must run before any compile.

Pallas Mosaic GPU kernels (``jax.experimental.pallas.mosaic_gpu``; the engine has none) lower
for export only with the CUDA plugin installed: their lowering asks the plugin for the CUDA
version.

The executables come from the ahead-of-time builder (`aot/executables.py`'s
`engine_executables`), or any objects with the fields of `ExecutableLike` (a name, a shape
label, the `jax.jit` wrapper, its abstract arguments and its static keyword arguments). A
``--topology`` that `is_cuda_topology` accepts (``"h100"``, ``"h100:4"``) takes its devices from
`cuda_topology` where a TPU topology takes them from libtpu, a GPU engine's attention backend
(platform "gpu": "pallas_gpu", or XLA where it cannot serve the model), and the memory and
bandwidth per GPU from `CUDA_TARGETS` (`aot/compile.py`'s `compile_for_topology`; ``jaxengine
compile MODEL --topology h100:4``)::

  devices = cuda_topology("h100:4").devices  # 4 compile-only H100s: the mesh's devices
  report = compile_for_topology(model_dir, "h100:4", tensor_parallel_size=4)
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from jax import export

from jaxengine.aot.topologies import (  # the GPUs' table is `aot/topologies.py`'s
  CUDA_TARGETS,
  CudaTarget,
  cuda_topology,
  is_cuda_topology,
  parse_cuda_topology,
)

__all__ = [
  "CUDA_TARGETS",
  "TRITON_CUSTOM_CALL",
  "CudaExport",
  "CudaTarget",
  "ExecutableLike",
  "cuda_topology",
  "export_for_cuda",
  "is_cuda_topology",
  "parse_cuda_topology",
  "triton_kernels",
]

#: The custom call target of a Triton kernel (Pallas GPU's lowering) in CUDA StableHLO.
TRITON_CUSTOM_CALL = "__gpu$xla.gpu.triton"

_CUSTOM_CALL = re.compile(r"stablehlo\.custom_call @([\w$.\-]+)")
_TRITON_NAME = re.compile(r'\bname = "([^"]+)"')


class ExecutableLike(Protocol):
  """One executable the engine precompiles: ``jitted(*args, **kwargs)`` (the ahead-of-time
  builder's `Executable`): its name, shape label, `jax.jit` wrapper, `jax.ShapeDtypeStruct`
  arguments and static keyword arguments."""

  @property
  def name(self) -> str: ...

  @property
  def shape(self) -> str: ...

  @property
  def jitted(self) -> Any: ...

  @property
  def args(self) -> tuple[Any, ...]: ...

  @property
  def kwargs(self) -> Mapping[str, Any]: ...


@dataclasses.dataclass(frozen=True)
class CudaExport:
  """One executable exported for CUDA.

  Attributes:
    name: the executable ("ragged_forward", "decode_steps", ...).
    shape: its shape label ("tokens=256 rows=64").
    seconds: trace, lowering and export time.
    module_bytes: the serialized StableHLO module's size.
    custom_calls: the distinct custom call targets in the module, sorted.
    triton_kernels: the distinct names of its Triton kernels (Pallas GPU), sorted.
  """

  name: str
  shape: str
  seconds: float
  module_bytes: int
  custom_calls: tuple[str, ...]
  triton_kernels: tuple[str, ...]


def export_for_cuda(executables: Iterable[ExecutableLike]) -> list[CudaExport]:
  """Exports each executable for CUDA (`jax.export`, ``platforms=["cuda"]``) on any machine.

  Args:
    executables: the executables, built with a CUDA attention backend ("pallas_gpu", or
      "xla"): a "pallas_tpu" kernel does not lower for CUDA. Their arguments are
      `jax.ShapeDtypeStruct` pytrees, with shardings or without (an export keeps the shardings
      and the device count, not the devices: a TPU topology's mesh exports too).

  Returns:
    One `CudaExport` per executable, in order.

  Raises:
    Whatever the lowering raises (a Pallas kernel refused by the Triton lowering, say), with
    the executable's name and shape added as a note.
  """
  checks = [export.DisabledSafetyCheck.custom_call(TRITON_CUSTOM_CALL)]
  reports = []
  for executable in executables:
    start = time.perf_counter()
    try:
      exported = export.export(executable.jitted, platforms=["cuda"], disabled_checks=checks)(
        *executable.args, **executable.kwargs
      )
    except Exception as error:
      error.add_note(f"exporting {executable.name} ({executable.shape}) for cuda")
      raise
    seconds = time.perf_counter() - start
    text = exported.mlir_module()
    reports.append(
      CudaExport(
        name=executable.name,
        shape=executable.shape,
        seconds=seconds,
        module_bytes=len(exported.mlir_module_serialized),
        custom_calls=tuple(sorted(set(_CUSTOM_CALL.findall(text)))),
        triton_kernels=triton_kernels(text),
      )
    )
  return reports


def triton_kernels(module_text: str) -> tuple[str, ...]:
  """The distinct names of the Triton kernels called in a StableHLO module's text, sorted (the
  ``name`` attribute of each `TRITON_CUSTOM_CALL`; its Triton IR is escaped bytes, with no
  bare quote)."""
  names = set()
  for line in module_text.splitlines():
    if f"@{TRITON_CUSTOM_CALL}(" in line:
      names.update(_TRITON_NAME.findall(line))
  return tuple(sorted(names))
