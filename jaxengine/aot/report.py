"""The compile report (design: `jaxengine compile --json`), the decode estimates in it, and the
message for a model that does not fit.

Decode estimates, per batch `b` of `DECODE_BATCHES` at a context of `DECODE_CONTEXT` tokens,
capped by fit: at most `max_num_reqs`, and at most the requests whose KV the chip holds (a capped
batch runs in the bucket above it):

- ``memory_floor_s``: (weight bytes + b x context x KV bytes per token) / HBM bandwidth, per
  device: what one decode step must read at least. The weight bytes are those a step reads: an
  input embedding table with its own output projection (untied) is read by its `b` rows only,
  not whole (Llama-3.1-8B: 1.05 GB of its 16.06 GB), so it is left out of the floor
  (``floor_weight_bytes`` says what was counted).
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

from jaxengine.aot.memory_plan import MemoryPlan, bytes_per_device
from jaxengine.aot.topologies import Topology, larger_topology
from jaxengine.worker import buckets as step_buckets

GIB = float(1 << 30)
#: The decode estimates' context length and batches.
DECODE_CONTEXT = 2048
DECODE_BATCHES = (1, 64, 256)


def describe_backend(engine: Any) -> str:
  """What the chip will run for attention: the backend's `describe` (the kernel and the padding
  it needs, or the XLA path and why; the head split on a mesh)."""
  heads = getattr(getattr(engine.model, "config", None), "num_attention_heads", 0)
  return str(engine.backend.describe(engine.model.kv_cache_spec, heads))


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
  capped = [min(b, config.max_num_reqs, plan.max_tokens // context) for b in DECODE_BATCHES]
  for batch in sorted(set(capped)):
    if batch < 1:
      continue
    tokens, num_rows = step_buckets.step_buckets(batch, batch, row_buckets, token_buckets)
    step = by_shape.get(("ragged_step", f"tokens={tokens} rows={num_rows}"))
    sample = by_shape.get(("sample", f"rows={num_rows}"))
    if step is None or sample is None:
      continue
    kv_bytes = batch * context * plan.bytes_per_token
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
) -> dict[str, Any]:
  """The report's dict (design section 10; `compile_for_topology` documents the fields)."""
  devices = engine.mesh.devices.size if engine.mesh is not None else 1
  return {
    "topology": spec.name,
    "device_kind": spec.chip.device_kind,
    "num_devices": devices,
    "hbm_bytes_per_device": spec.chip.hbm_bytes,
    "fits": plan.fits and error is None,
    "error": error,
    "attention_backend": attention_backend,
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
      "bytes_per_token": plan.bytes_per_token,
      "max_tokens": plan.max_tokens,
    },
    "executables": results,
    "decode": decode_estimates(engine, spec, plan, results) if error is None else [],
  }


def not_fitting_message(engine: Any, plan: MemoryPlan, spec: Topology, used_chips: int) -> str:
  """Why the engine does not fit one chip and what would: the GiB it needs per chip, the
  capacity, and the changes that fit (more chips, int8 weights, fp8 pages, a shorter context)."""
  config, name, chip = engine.config, spec.name, spec.chip
  budget = plan.utilization * plan.hbm
  request = plan.needed_blocks * plan.per_block
  fixed = plan.other + plan.temp
  text = (
    f"does not fit {name}: needs {plan.needed / GIB:.2f} GiB per chip (weights "
    f"{plan.weights / GIB:.2f} GiB, one request of max_model_len={config.resolved_max_model_len} "
    f"tokens {request / GIB:.2f} GiB of KV pages, batch state and temporaries "
    f"{fixed / GIB:.2f} GiB); a {plan.hbm / GIB:.0f} GiB chip at gpu_memory_utilization="
    f"{plan.utilization} holds {budget / GIB:.2f} GiB"
  )
  fits = []
  for t in (2, 4, 8):
    larger = larger_topology(chip, t)
    if t > used_chips and larger and (plan.weights + request) / t * used_chips + fixed <= budget:
      fits.append(f"--tensor-parallel-size {t} on {larger}")
      break
  quantized = config.quantization is not None
  if not quantized and plan.weights / 2 + request + fixed <= budget:
    fits.append("int8 or fp8 weights (--quantization int8, about half the weight bytes)")
  if config.kv_cache_dtype != "fp8" and plan.weights + request / 2 + fixed <= budget:
    fits.append("fp8 KV pages (--kv-cache-dtype fp8, half the KV bytes)")
  room = budget - plan.weights - fixed - plan.per_block
  tokens = int(room // max(plan.bytes_per_token, 1)) // plan.block_size * plan.block_size
  if tokens >= plan.block_size:
    fits.append(f"a shorter context (--max-model-len {tokens} or less)")
  if not fits:
    fits.append(f"nothing on {name} ({spec.num_chips} chips): a larger topology")
  return text + ". Would fit: " + "; ".join(fits) + "."
