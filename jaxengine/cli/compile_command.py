"""`jaxengine compile MODEL_DIR --topology T`: the engine compiled ahead of time for a Cloud TPU
topology or NVIDIA GPUs (``h100``, ``h100:4``) from this machine
(`jaxengine.aot.compile_for_topology`), with its memory per chip.

Exit status: 0 when every executable compiled and the engine fits, 1 when it does not fit (or a
step does not compile: the message says which), 2 for bad arguments (an unknown topology names
the known ones), a model directory that cannot be read (or a ``config.json`` field of the wrong
type, named), or a compiler that is not installed (libtpu, or the CUDA plugin: the message names
the wheels), 130 when interrupted (Ctrl-C: one line says how many executables compiled).

Progress goes to stderr: the number of executables first, then one line per executable as it
compiles (``[3/45] compiled ragged_step tokens=64 rows=1 in 91.7 s``); ``--list`` prints the
executables without compiling any.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from collections.abc import MutableMapping, Sequence
from typing import Any

from jaxengine.engine.engine_flags import ENGINE_FLAGS, engine_flag_options, positive_int

#: Engine flags that mean nothing for a compile from config.json.
_SKIPPED = {"--model", "--engine-seed", "--precompile", "--compilation-cache"}
#: The Cloud TPU accelerator type of one host of each chip's topologies, by chips (libtpu reads
#: it, and the workers' hostnames, from the environment when it starts; v4 and v5p count cores).
_ACCELERATOR_TYPES = {"v5e": "v5litepod-{}", "v6e": "v6e-{}", "v5p": "v5p-{}", "v4": "v4-{}"}
_CORES_PER_CHIP = {"v5p": 2, "v4": 2}


def _topology_name(text: str) -> str:
  from jaxengine.aot.topologies import topology  # no JAX import

  try:
    topology(text)
  except ValueError as error:
    raise argparse.ArgumentTypeError(str(error)) from None
  return text


def add_compile_parser(commands: Any, formatter_class: Any = None) -> argparse.ArgumentParser:
  """Adds the ``compile`` subcommand to `commands` (an argparse subparsers object)."""
  parser = commands.add_parser(
    "compile",
    help="compile for a Cloud TPU topology or GPUs from config.json alone, and plan its memory",
    description=(
      "Compile every executable the engine precompiles for a TPU topology (libtpu's deviceless "
      "compile: pip install 'jaxengine[tpu]') or NVIDIA GPUs (the CUDA plugin's: pip install "
      "jax-cuda12-plugin jax-cuda12-pjrt nvidia-cuda-nvcc-cu12), from MODEL_DIR's config.json "
      "alone (no weights, no tokenizer), and report per chip the weights, KV pages, "
      "temporaries and HBM, per executable the compile seconds and XLA's flops and bytes (TPU), "
      "and decode estimates. Exit 1 when the model does not fit (the message says what would)."
    ),
    **({"formatter_class": formatter_class} if formatter_class else {}),
  )
  parser.add_argument(
    "model_dir", metavar="MODEL_DIR",
    help="Hugging Face model directory (or its config.json, or a hub id: its config.json alone "
    "is fetched)",
  )  # fmt: skip
  parser.add_argument(
    "--topology", required=True, type=_topology_name, metavar="T",
    help="v5e:1x1, v5e:2x2, v5e:2x4, v6e:1x1, v6e:2x2, v6e:2x4, v5p:2x2x1, v4:2x2x1, or GPUs "
    "on one host: h100, h200, a100, l4, with :N for N of them (h100:4)",
  )  # fmt: skip
  parser.add_argument("--tensor-parallel-size", type=positive_int, default=1, metavar="N")
  parser.add_argument("--data-parallel-size", type=positive_int, default=1, metavar="N")
  parser.add_argument("--enable-expert-parallel", action="store_true",
                      help="split a mixture-of-experts model's experts over the chips")  # fmt: skip
  parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
  parser.add_argument(
    "--list", action="store_true",
    help="print the executables the engine would compile (their number first), compile none",
  )  # fmt: skip
  parser.add_argument(
    "--export-only", action="store_true",
    help="with a GPU topology: export each executable for CUDA (jax.export, no plugin needed: "
    "checks the Pallas kernel's lowering to Triton, not its compile) instead of compiling it",
  )  # fmt: skip
  group = parser.add_argument_group("engine")
  for entry in ENGINE_FLAGS:
    if entry.flag not in _SKIPPED:
      group.add_argument(entry.flag, **entry.options)
  parser.set_defaults(dtype="bfloat16", model=None, engine_seed=None, precompile=None,
                      compilation_cache=None)  # fmt: skip
  return parser


def run_compile(args: argparse.Namespace, out: Any = None) -> int:
  """Runs a parsed ``compile`` command; returns the exit status (see the module)."""
  out = sys.stdout if out is None else out
  quiet_libtpu_environ(args.topology, os.environ)
  progress = _Progress(args.topology)
  try:
    options = engine_flag_options(args)
    options.pop("seed", None)
    options.pop("precompile", None)
    options.pop("compilation_cache", None)
    dtype = options.pop("dtype", "bfloat16")
    if args.enable_expert_parallel:
      options["enable_expert_parallel"] = True
    if args.list:
      options["select"] = progress.listed
    from jaxengine.aot import compile_for_topology  # imported late: `--help` stays fast

    report = compile_for_topology(
      args.model_dir,
      args.topology,
      tensor_parallel_size=args.tensor_parallel_size,
      data_parallel_size=args.data_parallel_size,
      dtype=dtype,
      progress=progress.compiled,
      before_compile=None if args.list else progress.start,
      export_only=args.export_only,
      **options,
    )
  except (ValueError, FileNotFoundError, ImportError, RuntimeError) as error:
    print(f"jaxengine compile: {error}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print(f"jaxengine compile: {progress.interrupted()}", file=sys.stderr)
    return 130
  if args.list and report["fits"]:
    print(progress.listing(), file=out)
  elif args.list:
    pass  # nothing would compile: the message below says why
  elif args.json:
    print(json.dumps(report), file=out)
  else:
    print(format_report(report), file=out)
  if not report["fits"]:
    print(f"jaxengine compile: {report['error']}", file=sys.stderr)
    return 1
  return 0


def quiet_libtpu_environ(topology_name: str, environ: MutableMapping[str, str]) -> None:
  """Sets what libtpu reads from a Cloud TPU VM's environment when it starts, for a TPU
  topology, where the user has not: without ``TPU_WORKER_HOSTNAMES`` and
  ``TPU_ACCELERATOR_TYPE`` a deviceless libtpu prints "Failed to find host bounds" and an
  ``E0000 ... unexpected worker hostname`` error with a source trace that are harmless (the
  topology's devices are described all the same). Call it before libtpu loads (JAX's first TPU
  topology); a GPU topology, an unknown name, or a machine with TPU chips (``/dev/accel*`` or
  ``/dev/vfio/N``: libtpu must describe its own chips there) changes nothing.

  Args:
    topology_name: the ``--topology`` argument.
    environ: the environment to update (`os.environ`).
  """
  from jaxengine.aot.topologies import TOPOLOGIES  # no JAX import

  spec = TOPOLOGIES.get(topology_name)
  if spec is None or glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
    return
  cores = spec.num_chips * _CORES_PER_CHIP.get(spec.chip.name, 1)
  environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  environ.setdefault("TPU_ACCELERATOR_TYPE", _ACCELERATOR_TYPES[spec.chip.name].format(cores))


class _Progress:
  """The command's progress on stderr, and the executables `--list` collects."""

  def __init__(self, topology_name: str):
    self.topology_name = topology_name
    self.count: int | None = None
    self.done = 0
    self.names: list[str] = []

  def start(self, executables: Sequence[Any]) -> None:
    self.count = len(executables)
    print(f"compiling {self.count} executables for {self.topology_name} ...", file=sys.stderr)

  def compiled(self, entry: dict[str, Any]) -> None:
    self.done += 1
    done = "exported" if "triton_kernels" in entry else "compiled"
    print(
      f"[{self.done}/{self.count}] {done} {entry['name']} {entry['shape']} in "
      f"{entry['compile_s']:.1f} s",
      file=sys.stderr,
    )

  def listed(self, executable: Any) -> bool:
    self.names.append(f"{executable.name} {executable.shape}")
    return False

  def listing(self) -> str:
    lines = [f"{len(self.names)} executables for {self.topology_name} (none compiled):"]
    return "\n".join([*lines, *(f"  {name}" for name in self.names)])

  def interrupted(self) -> str:
    if self.count is None:
      return "interrupted before compiling"
    return f"interrupted after {self.done} of {self.count} executables"


def _scaled(value: float | None, unit: float, digits: int = 2) -> str:
  return "-" if value is None else f"{value / unit:.{digits}f}"


def format_report(report: dict[str, Any]) -> str:
  """The report as text: the chip, the memory per chip, each executable and the estimates."""
  from jaxengine.aot.report import memory_lines

  gib = float(1 << 30)
  lines = [
    f"{report['topology']}: {report['num_devices']} of its {report['topology_chips']} "
    f"{report['device_kind']} chips used, {report['hbm_bytes_per_device'] / gib:.0f} GiB HBM "
    f"each; attention: {report['attention_backend']}",
    *memory_lines(report),
    f"{'executable':<18} {'shape':<40} {'compile s':>9} {'GFLOP':>10} {'XLA GB':>9} "
    f"{'HBM GB':>9} {'est. ms':>9}",
  ]
  for e in report["executables"]:
    lines.append(
      f"{e['name']:<18} {e['shape']:<40} {e['compile_s']:>9.1f} {_scaled(e['flops'], 1e9):>10} "
      f"{_scaled(e['bytes_accessed'], 1e9, 3):>9} {_scaled(e.get('hbm_bytes'), 1e9, 3):>9} "
      f"{_scaled(e['estimated_s'], 1e-3, 3):>9}"
    )
  sources = {e["estimate_source"] for e in report["executables"]}
  if sources and all(e["flops"] is None for e in report["executables"]):
    lines.append(f"(no flops, bytes or estimates per executable: {', '.join(sorted(sources))})")
  for d in report["decode"]:
    lines.append(
      f"decode batch {d['batch']} at {d['context']} tokens: estimated "
      f"{d['estimated_step_s'] * 1e3:.2f} ms/step ({d['tokens_per_s']:.0f} tokens/s), memory "
      f"floor {d['memory_floor_s'] * 1e3:.2f} ms"
    )
  lines.append("fits" if report["fits"] else "does not fit (see the message)")
  return "\n".join(lines)
