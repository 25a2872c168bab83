"""The compile report (design: `jaxengine compile --json`), the decode estimates in it, and the
message for a model that does not fit.

Decode estimates, per batch `b` of `DECODE_BATCHES` at a context of `DECODE_CONTEXT` tokens,
capped by fit: at most `max_num_reqs`, and at most the requests whose KV the chip holds (a capped
batch runs in the bucket above it):

- ``memory_floor_s``: (weight bytes read + b x the context's KV bytes) / HBM bandwidth,
  per device: what one decode step must read at least (a sliding-window layer reads its
  window's only). The weight bytes are those a step reads: an input embedding table with its
  own output projection (untied) is read by its `b` rows only, not whole (Llama-3.1-8B: 1.05 GB
  of its 16.06 GB), so it is left out of the floor (``floor_weight_bytes`` says what was
  counted).
- ``flops_floor_s``: the compiled step's flops (XLA's count, attention's excluded) / the chip's
  peak bfloat16 rate.
- ``estimated_step_s``: the decode step's model part (the ragged step at its bucket) and the
  sampler at its row bucket, each max(HBM bytes / bandwidth, flops / peak), plus the context's
  KV bytes at HBM bandwidth: the compiled step holds no context (the lengths are runtime values)
  and the Pallas attention kernel is opaque to XLA's cost model. The HBM bytes are
  `aot/hbm_bytes.py`'s model of each compiled executable, not XLA's ``bytes accessed``, which
  counts the weights' copies in on-core VMEM (four times for a prefetched weight) and every
  branch of a ``lax.cond``: the model counts HBM operands and results only, a fusion's operand
  by the part it reads, and a conditional as its costliest branch (an upper bound where a
  cheaper branch runs). ``method`` says which was used.

  Without a cost analysis (a GPU's executables: XLA:GPU's deviceless compile gives none)
  ``estimated_step_s`` is the memory floor, ``flops_floor_s`` None, and ``method`` says so.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from jaxengine.aot.memory_plan import MemoryPlan, bytes_per_device
from jaxengine.aot.topologies import Topology
from jaxengine.worker import buckets as step_buckets

GIB = float(1 << 30)
#: The decode estimates' context length and batches.
DECODE_CONTEXT = 2048
DECODE_BATCHES = (1, 64, 256)


def describe_backend(engine: Any) -> str:
  """What the chip will run for attention: the backend's `describe` (the kernel and the padding
  it needs, or the XLA path and why; the head split on a mesh)."""
  heads = getattr(getattr(engine.model, "config", None), "num_attention_heads", 0)
  # The pool's page spec: its dtype is the pages' (float8 with `kv_cache_dtype="fp8"`).
  text = str(engine.backend.describe(engine.page_spec, heads))
  if " pages" not in text:  # a backend that does not name its pages' dtype
    fp8 = "fp8 " if engine.config.kv_cache_dtype == "fp8" else ""
    text += f"; {fp8}{jnp.dtype(engine.page_spec.dtype).name} pages"
  return text


def decode_estimates(
  engine: Any, spec: Topology, plan: MemoryPlan, results: list[dict[str, Any]]
) -> list[dict[str, Any]]:
  """The report's ``decode`` rows (see the module); batches whose executables did not compile
  (or were not selected) are left out."""
  config = engine.config
  by_shape = {(r["name"], r["shape"]): r for r in results}
  rows_per_shard = engine.placement.rows if engine.placement is not None else 1
  row_buckets = step_buckets.row_buckets(
    config.max_num_reqs, rows_per_shard, config.batch_invariant
  )
  token_buckets = step_buckets.buckets(config.max_num_batched_tokens, 1)
  context = min(DECODE_CONTEXT, config.resolved_max_model_len)
  weights_read = plan.weights - untied_embedding_bytes(engine)
  bandwidth, peak = spec.chip.hbm_bandwidth, spec.chip.peak_flops
  rows = []
  capped = [min(b, config.max_num_reqs, plan.requests_fit(context)) for b in DECODE_BATCHES]
  for batch in sorted(set(capped)):
    if batch < 1:
      continue
    tokens, num_rows = step_buckets.step_buckets(batch, batch, row_buckets, token_buckets)
    step = by_shape.get(("ragged_step", f"tokens={tokens} rows={num_rows}"))
    sample = by_shape.get(("sample", f"rows={num_rows}"))
    if step is None or sample is None:
      continue
    kv_bytes = batch * plan.context_bytes(context)
    floor = (weights_read + kv_bytes) / bandwidth
    if step["flops"] is None or sample["flops"] is None:  # no cost analysis: bytes alone
      estimated, flops_floor = floor, None
      method = (f"memory floor: the weights and the context's KV bytes at HBM bandwidth "
                f"(the executables' estimate_source: {step['estimate_source']})")  # fmt: skip
    else:
      model_s, sample_s = (_part_seconds(r, bandwidth, peak) for r in (step, sample))
      estimated, flops_floor = model_s + sample_s + kv_bytes / bandwidth, step["flops"] / peak
      sources = {step["estimate_source"], sample["estimate_source"]}
      method = (f"model and sampler: {' / '.join(sorted(sources))}; attention: the context's "
                "KV bytes at HBM bandwidth (the Pallas kernel is opaque to the cost model)")  # fmt: skip
    rows.append({
      "batch": batch,
      "context": context,
      "estimated_step_s": estimated,
      "memory_floor_s": floor,
      "floor_weight_bytes": weights_read,
      "flops_floor_s": flops_floor,
      "tokens_per_s": batch / estimated,
      "method": method,
    })  # fmt: skip
  return rows


def _part_seconds(result: dict[str, Any], bandwidth: float, peak: float) -> float:
  return max(result["hbm_bytes"] / bandwidth, result["flops"] / peak)


def untied_embedding_bytes(engine: Any) -> int:
  """Bytes per device of the input embedding table when the model has its own output projection
  (``lm_head``): a decode step reads only its batch's rows of it (0 when tied or absent)."""
  weights = engine.weights
  if getattr(engine.model, "lm_head", None) is None or "embed" not in weights:
    return 0
  return bytes_per_device(weights["embed"])


def build_report(
  engine: Any,
  spec: Topology,
  plan: MemoryPlan,
  results: list[dict[str, Any]],
  error: str | None,
  attention_backend: str,
  num_chips_used: int = 1,
) -> dict[str, Any]:
  """The report's dict (design section 10; `compile_for_topology` documents the fields);
  `num_chips_used` is the mesh's ``tensor_parallel_size x data_parallel_size``."""
  return {
    "topology": spec.name,
    "device_kind": spec.chip.device_kind,
    "num_devices": num_chips_used,
    "topology_chips": spec.num_chips,
    "hbm_bytes_per_device": spec.chip.hbm_bytes,
    "fits": plan.fits and error is None,
    "memory_fits": plan.fits,
    "error": error,
    "attention_backend": attention_backend,
    # An exported executable (`export_only`) has no memory analysis: its temp is not known.
    "temp_known": bool(results) and not any("triton_kernels" in r for r in results),
    "per_device_bytes": {
      "weights": plan.weights,
      "kv_cache": plan.kv_cache,
      "temp": plan.temp,
      "other": plan.other,
      "total": plan.total,
    },
    "kv_cache": {
      "num_blocks": plan.num_blocks,
      "block_size": plan.block_size,
      "block_bytes": plan.per_block,
      "num_groups": plan.num_groups,
      "bytes_per_token": plan.bytes_per_token,
      "max_tokens": plan.max_tokens,
      "budget_blocks": plan.fit_blocks,
      "budget_tokens": plan.budget_tokens,
      "max_model_len": plan.max_model_len,
      "max_model_len_fit": plan.longest_fitting,
      "fixed_pool": plan.fixed_pool,
    },
    "executables": results,
    "decode": decode_estimates(engine, spec, plan, results) if error is None else [],
  }


def memory_lines(report: dict[str, Any]) -> list[str]:
  """The report's memory per chip and KV pages as text lines (`jaxengine compile`'s output):
  what the pages hold in tokens, what the budget would hold, the longest `max_model_len` that
  fits, and whether the temporaries are known (nothing compiled: the total is a lower bound)."""
  memory, kv = report["per_device_bytes"], report["kv_cache"]
  parts = [f"{k} {v / GIB:.2f} GiB" for k, v in memory.items() if k not in ("temp", "total")]
  if report.get("temp_known", True):
    parts.insert(2, f"temp {memory['temp'] / GIB:.2f} GiB")
    parts.append(f"total {memory['total'] / GIB:.2f} GiB")
  else:
    parts.insert(2, "temp not known (nothing compiled)")
    parts.append(f"total at least {memory['total'] / GIB:.2f} GiB")
  groups = kv["num_groups"]
  layout = f"{kv['block_size']} tokens of {'every layer' if groups == 1 else 'some layers'}"
  lines = ["per chip: " + ", ".join(parts)]
  pages = (
    f"{kv['num_blocks']} pages ({layout}) x {kv['block_bytes']} bytes = "
    f"{kv['num_blocks'] * kv['block_bytes'] / GIB:.2f} GiB; {kv['bytes_per_token']} bytes per "
    "token in every layer"
  )
  if groups > 1:
    pages += f" ({groups} KV cache groups: a token takes a page slot in each)"
  if kv["fixed_pool"] is not None and not report["memory_fits"]:
    lines.append(f"KV cache ({kv['fixed_pool']}, does not fit): {pages}")
  elif not report["memory_fits"]:
    lines.append(f"KV cache (does not fit): one request of max_model_len needs {pages}")
  else:
    held = "" if groups == 1 else " of every layer (a request past a window takes fewer)"
    lines.append(f"KV cache: {pages}; the pages hold {kv['max_tokens']} tokens{held}")
  if kv["fixed_pool"] is None and kv["budget_blocks"] > kv["num_blocks"]:
    lines.append(
      f"  the budget (gpu_memory_utilization) holds {kv['budget_blocks']} pages "
      f"({kv['budget_tokens']} tokens); the default pool takes what max_num_reqs requests of "
      "max_model_len need, and a quarter more"
    )
  windows = " (sliding-window layers keep their window's pages only)" if groups > 1 else ""
  lines.append(
    f"  longest --max-model-len that fits: {kv['max_model_len_fit']}{windows}; "
    f"this engine's: {kv['max_model_len']}"
  )
  return lines
