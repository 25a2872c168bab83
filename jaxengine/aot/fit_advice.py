"""The message for an engine that does not fit its topology's chips: what does not fit, and the
changes that would (design: `jaxengine compile` exits 1 with it).

Each change is checked against the plan's own numbers (`aot/memory_plan.py`): more chips by
tensor parallelism only at sizes the model's query heads divide (the engine refuses the others:
`parallel.check_heads`) and a named topology has; int8 weights at about half the weight bytes;
fp8 pages at half the KV bytes; a shorter ``--max-model-len`` only when one fits, found by the
engine's own page count (sliding-window groups hold their window only), never beyond the
model's ``max_position_embeddings``. A fixed pool (``--num-kv-blocks``,
``--kv-cache-memory-bytes``) that is what does not fit is named as the cause, with the largest
pool that fits. Before anything is compiled the temporaries are not known: the bytes needed are
then a lower bound, and the message says so.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxengine.aot.memory_plan import MemoryPlan
from jaxengine.aot.topologies import TOPOLOGIES, CudaTarget, Topology, larger_topology

GIB = float(1 << 30)


def not_fitting_message(
  engine: Any,
  plan: MemoryPlan,
  spec: Topology,
  tensor_parallel_size: int,
  data_parallel_size: int = 1,
) -> str:
  """Why the engine does not fit `spec`'s chips and what would (see the module).

  Args:
    engine: the `AbstractEngine` (`aot/executables.py`) planned.
    plan: its plan (not fitting).
    spec: the topology.
    tensor_parallel_size, data_parallel_size: the engine's mesh.
  """
  sizes = (tensor_parallel_size, data_parallel_size)
  if plan.fixed_pool is not None:
    return _fixed_pool_message(engine, plan, spec, sizes)
  budget = plan.utilization * plan.hbm
  request = plan.needed_blocks * plan.per_block
  text = (
    f"does not fit {spec.name}: needs {_at_least(plan)}{plan.needed / GIB:.2f} GiB per chip "
    f"(weights {plan.weights / GIB:.2f} GiB, one request of max_model_len="
    f"{plan.max_model_len} tokens {request / GIB:.2f} GiB of KV pages, batch state "
    f"{plan.other / GIB:.2f} GiB, temporaries {_temporaries(plan)}); a {plan.hbm / GIB:.0f} GiB "
    f"chip at gpu_memory_utilization={plan.utilization} holds {budget / GIB:.2f} GiB"
  )
  return text + _would_fit(_changes(engine, plan, spec, sizes), spec)


def _changes(engine: Any, plan: MemoryPlan, spec: Topology, sizes: tuple[int, int]) -> list[str]:
  """The changes that fit a default-sized pool (see the module)."""
  config = engine.config
  budget = plan.utilization * plan.hbm
  request = plan.needed_blocks * plan.per_block
  held = plan.other + plan.temp
  fits = _tensor_parallel(engine, plan, spec.chip, sizes, request, budget)
  if config.quantization is None and plan.weights / 2 + request + held <= budget:
    fits.append("int8 or fp8 weights (--quantization int8, about half the weight bytes)")
  if config.kv_cache_dtype != "fp8" and plan.weights + request / 2 + held <= budget:
    fits.append("fp8 KV pages (--kv-cache-dtype fp8, half the KV bytes)")
  longest = plan.longest_fitting
  if 0 < longest < plan.max_model_len:
    fits.append(f"a shorter context (--max-model-len {longest} or less)")
  return fits


def _fixed_pool_message(
  engine: Any, plan: MemoryPlan, spec: Topology, sizes: tuple[int, int]
) -> str:
  """The message when the user fixed the pool's size: the pool is too large for the chip, or
  too small for one request of `max_model_len`."""
  pool = f"the KV pool {plan.fixed_pool} ({plan.num_blocks} pages of {plan.per_block} bytes)"
  largest = max(plan.pool_bytes_budget(), 0) // plan.per_block
  fits = []
  if plan.num_blocks < plan.needed_blocks:
    text = (
      f"does not fit {spec.name}: {pool} holds fewer pages than one request of max_model_len="
      f"{plan.max_model_len} tokens needs ({plan.needed_blocks - 1} and the null page)"
    )
    if largest >= plan.needed_blocks:
      fits.append(f"a pool of {plan.needed_blocks} pages or more (--num-kv-blocks)")
    longest = plan.longest_fitting
    if longest > 0:
      fits.append(f"a shorter context (--max-model-len {longest} or less)")
    return text + _would_fit(fits, spec)
  text = (
    f"does not fit {spec.name}: {pool} takes {plan.kv_cache / GIB:.2f} GiB per chip; with the "
    f"weights {plan.weights / GIB:.2f} GiB, batch state {plan.other / GIB:.2f} GiB and "
    f"temporaries {_temporaries(plan)} it needs {_at_least(plan)}{plan.total / GIB:.2f} GiB, "
    f"more than the chip's {plan.hbm / GIB:.2f} GiB"
  )
  if largest >= plan.needed_blocks:
    fits.append(
      f"a pool of at most {largest} pages (--num-kv-blocks {largest}, or "
      f"--kv-cache-memory-bytes {largest * plan.per_block})"
    )
  default = _default_pool(plan)
  if default.fit_blocks >= plan.needed_blocks:
    fits.append("the default pool (neither --num-kv-blocks nor --kv-cache-memory-bytes)")
  if not fits:  # the weights and one request alone do not fit: what would without the pool
    fits = _changes(engine, default, spec, sizes)
  return text + _would_fit(fits, spec)


def _default_pool(plan: MemoryPlan) -> MemoryPlan:
  """`plan` with the default pool's budget in place of the fixed pool (the pages it holds)."""
  budget = int(plan.utilization * plan.hbm) - plan.weights - plan.other - plan.temp
  blocks = max(budget, 0) // plan.per_block
  return dataclasses.replace(plan, fixed_pool=None, fit_blocks=blocks, num_blocks=blocks)


def _tensor_parallel(
  engine: Any,
  plan: MemoryPlan,
  chip: Any,
  sizes: tuple[int, int],
  request: int,
  budget: float,
) -> list[str]:
  """The smallest tensor-parallel size above the engine's that the model's query heads (and with
  expert parallelism its experts) divide, a named topology of `chip` has (with the
  data-parallel groups), and that fits: its advice (the weights split evenly, as all but the
  norms are)."""
  used_chips, data = sizes
  model_config = getattr(engine.model, "config", None)
  heads = getattr(model_config, "num_attention_heads", None)
  kv_heads = engine.model.kv_cache_spec.num_kv_heads
  if isinstance(chip, CudaTarget):
    most = 8
  else:
    most = max((s.num_chips for s in TOPOLOGIES.values() if s.chip == chip), default=1)
  # The pool is split over the model axis when it divides the KV heads, else replicated.
  whole_request = request * used_chips if used_chips > 1 and kv_heads % used_chips == 0 else request
  experts = getattr(model_config, "num_experts", 0) if engine.config.enable_expert_parallel else 0
  heads = heads if isinstance(heads, int) else 0  # unknown: the engine checks none
  experts = experts if isinstance(experts, int) and experts > 0 else 1
  for t in range(used_chips + 1, most // data + 1):
    if heads % t or (experts > 1 and experts % t):
      continue  # the engine refuses it (`MeshPlacement.check`)
    larger = larger_topology(chip, t * data)
    if larger is None:
      continue
    kv = whole_request / t if kv_heads % t == 0 else whole_request
    if plan.weights * used_chips / t + kv + plan.other + plan.temp <= budget:
      flags = f"--tensor-parallel-size {t}" + (f" --data-parallel-size {data}" if data > 1 else "")
      return [f"{flags} on {larger} (about {plan.weights * used_chips / t / GIB:.2f} GiB of "
              "weights per chip)"]  # fmt: skip
  return []


def _at_least(plan: MemoryPlan) -> str:
  return "at least " if plan.temp == 0 else ""


def _temporaries(plan: MemoryPlan) -> str:
  if plan.temp == 0:
    return "not known (nothing compiled)"
  return f"{plan.temp / GIB:.2f} GiB"


def _would_fit(fits: list[str], spec: Topology) -> str:
  if not fits:
    fits = [f"nothing on {spec.name} ({spec.num_chips} chips): a larger topology"]
  return ". Would fit: " + "; ".join(fits) + "."
