"""`jaxengine compile MODEL_DIR --topology T`: the engine compiled ahead of time for a Cloud TPU
topology or NVIDIA GPUs (``h100``, ``h100:4``) from this machine
(`jaxengine.aot.compile_for_topology`), with its memory per chip.

Exit status: 0 when every executable compiled and the engine fits, 1 when it does not fit (or a
step does not compile: the message says which), 2 for bad arguments (an unknown topology names
the known ones), a model directory that cannot be read, or a compiler that is not installed
(libtpu, or the CUDA plugin: the message names the wheels).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from jaxengine.engine.engine_flags import ENGINE_FLAGS, engine_flag_options, positive_int

#: Engine flags that mean nothing for a compile from config.json.
_SKIPPED = {"--model", "--engine-seed", "--precompile", "--compilation-cache"}


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
  parser.add_argument("model_dir", metavar="MODEL_DIR", help="Hugging Face model directory")
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
  try:
    options = engine_flag_options(args)
    options.pop("seed", None)
    options.pop("precompile", None)
    options.pop("compilation_cache", None)
    dtype = options.pop("dtype", "bfloat16")
    if dtype in ("half", "float16"):
      dtype = "float16"
    elif dtype in ("float", "float32"):
      dtype = "float32"
    elif dtype == "auto":
      dtype = "bfloat16"
    if args.enable_expert_parallel:
      options["enable_expert_parallel"] = True
    from jaxengine.aot import compile_for_topology  # imported late: `--help` stays fast

    report = compile_for_topology(
      args.model_dir,
      args.topology,
      tensor_parallel_size=args.tensor_parallel_size,
      data_parallel_size=args.data_parallel_size,
      dtype=dtype,
      progress=_print_progress,
      export_only=args.export_only,
      **options,
    )
  except (ValueError, FileNotFoundError, ImportError, RuntimeError) as error:
    print(f"jaxengine compile: {error}", file=sys.stderr)
    return 2
  if args.json:
    print(json.dumps(report), file=out)
  else:
    print(format_report(report), file=out)
  if not report["fits"]:
    print(f"jaxengine compile: {report['error']}", file=sys.stderr)
    return 1
  return 0


def _print_progress(entry: dict[str, Any]) -> None:
  done = "exported" if "triton_kernels" in entry else "compiled"
  print(f"{done} {entry['name']} {entry['shape']} in {entry['compile_s']:.1f} s", file=sys.stderr)


def _scaled(value: float | None, unit: float, digits: int = 2) -> str:
  return "-" if value is None else f"{value / unit:.{digits}f}"


def format_report(report: dict[str, Any]) -> str:
  """The report as text: the chip, the memory per chip, each executable and the estimates."""
  gib = float(1 << 30)
  memory = report["per_device_bytes"]
  kv = report["kv_cache"]
  lines = [
    f"{report['topology']}: {report['num_devices']} x {report['device_kind']}, "
    f"{report['hbm_bytes_per_device'] / gib:.0f} GiB HBM each; attention: "
    f"{report['attention_backend']}",
    "per chip: " + ", ".join(f"{k} {v / gib:.2f} GiB" for k, v in memory.items()),
    f"KV cache: {kv['num_blocks']} pages of {kv['block_size']} tokens, {kv['bytes_per_token']} "
    f"bytes per token, {kv['max_tokens']} tokens fit",
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
