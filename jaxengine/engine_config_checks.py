"""The checks of `EngineConfig`'s groups of fields: dtype and `max_model_len`, parallelism, the
paged KV cache and its token budget, decoding (speculative, multi-step), the settings that do
not go together with `batch_invariant`, and LoRA's sizes.

Each check is a function of the group's values, run on the host before any model loads: it
returns the group's normalised values by field name (`EngineConfig.__post_init__` stores them)
or raises a `ValueError` naming the field and the value.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine import parallel
from jaxengine.models.attention_backends import BACKEND_NAMES
from jaxengine.params import is_int
from jaxengine.spec_decode.config import SpeculativeConfig

#: The paged engine's token budget per step when `max_num_batched_tokens` is None.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048

#: The weight dtypes `dtype` may name ("auto" picks one per backend and checkpoint), with vLLM's
#: aliases "half" and "float".
DTYPES = {
  "float32": jnp.float32,
  "bfloat16": jnp.bfloat16,
  "float16": jnp.float16,
  "half": jnp.float16,
  "float": jnp.float32,
}

#: `kv_cache_dtype`'s accepted names and what each is stored as ("fp8_e4m3" is "fp8").
KV_CACHE_DTYPES = {"auto": "auto", "fp8": "fp8", "fp8_e4m3": "fp8"}


def check_dtype(dtype: Any) -> Any:
  """ "auto", or the JAX dtype `dtype` names.

  Raises:
    ValueError: a name not in `DTYPES` (nor "auto"), or a dtype other than float32, bfloat16
      or float16.
  """
  if isinstance(dtype, str):
    if dtype not in (*DTYPES, "auto"):
      raise ValueError(f"dtype must be one of {[*DTYPES, 'auto']}, got {dtype!r}")
    return DTYPES.get(dtype, dtype)
  try:
    supported = jnp.dtype(dtype) in {jnp.dtype(d) for d in DTYPES.values()}
  except TypeError:
    supported = False
  if not supported:
    raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
  return dtype


def check_parallel(
  *,
  tensor_parallel_size: Any,
  data_parallel_size: Any,
  mesh: Any,
  max_num_reqs: int,
) -> dict[str, Any]:
  """The sizes and the mesh: a given mesh's axis sizes (sizes other than 1 must match them), or
  a mesh built from sizes above 1.

  Returns:
    `tensor_parallel_size`, `data_parallel_size` (ints) and `mesh` (None for one device).

  Raises:
    ValueError: a bad size or mesh, a mesh and different sizes, or a data-parallel size that
      does not divide `max_num_reqs`.
  """
  t, d = parallel.check_sizes(tensor_parallel_size, data_parallel_size)
  if mesh is not None:
    mesh = parallel.check_mesh(mesh)
    axes = parallel.axis_size(mesh, parallel.MODEL), parallel.axis_size(mesh, parallel.DATA)
    if (t, d) not in ((1, 1), axes):
      raise ValueError(
        f"give either mesh or tensor_parallel_size/data_parallel_size, got mesh and "
        f"tensor_parallel_size={t}, data_parallel_size={d}"
      )
    t, d = axes
  if max_num_reqs % d:
    raise ValueError(
      f"data_parallel_size={d} must divide max_num_reqs={max_num_reqs} (each "
      "data-parallel group holds the same number of rows)"
    )
  if mesh is None and (t, d) != (1, 1):
    mesh = parallel.make_mesh(t, d)
  return {"tensor_parallel_size": t, "data_parallel_size": d, "mesh": mesh}


def check_batch_invariant(*, attention_backend: str | None) -> None:
  """Refuses what `batch_invariant=True` cannot keep exact (tensor parallelism it keeps: no
  matrix's input axis is split then, `jaxengine.parallel`).

  Raises:
    ValueError: a Pallas attention backend, or a platform other than CPU.
  """
  platform = jax.default_backend()
  refused = {
    f"attention_backend={attention_backend!r} (only 'xla' has a fixed order)": (
      attention_backend not in (None, "xla")
    ),
    f"the {platform!r} platform (exactness is built and tested on 'cpu' only)": (platform != "cpu"),
  }
  for what, given in refused.items():
    if given:
      raise ValueError(f"batch_invariant=True is not supported with {what}")


def check_lora(
  *,
  max_loras: Any,
  max_lora_rank: Any,
  max_cpu_loras: Any,
) -> dict[str, int]:
  """The LoRA sizes (`max_cpu_loras` None: `max_loras`).

  Returns:
    `max_loras`, `max_lora_rank`, `max_cpu_loras` as ints.

  Raises:
    ValueError: a size that is not a positive int, or `max_cpu_loras` below `max_loras`.
  """
  sizes: dict[str, int] = {}
  for name, value in (
    ("max_loras", max_loras),
    ("max_lora_rank", max_lora_rank),
    ("max_cpu_loras", max_cpu_loras),
  ):
    if name == "max_cpu_loras" and value is None:
      value = sizes["max_loras"]
    if not is_int(value) or value < 1:
      raise ValueError(f"{name} must be a positive int, got {value!r}")
    sizes[name] = int(value)
  if sizes["max_cpu_loras"] < sizes["max_loras"]:
    raise ValueError(
      f"max_cpu_loras={sizes['max_cpu_loras']} must be >= max_loras={sizes['max_loras']}"
    )
  return sizes


def check_kv_cache(
  *,
  gpu_memory_utilization: Any,
  kv_cache_memory_bytes: Any,
  num_kv_blocks: Any,
  block_size: Any,
  max_num_batched_tokens: Any,
  attention_backend: Any,
  kv_cache_dtype: Any,
  max_num_reqs: int,
  data_parallel_size: int,
  max_model_len: int | None,
  enable_chunked_prefill: bool,
) -> dict[str, Any]:
  """The paged KV cache's size, layout and dtype, and the token budget per step.

  Returns:
    `gpu_memory_utilization` (float), `kv_cache_memory_bytes`, `num_kv_blocks`, `block_size`
    (ints or None), `max_num_batched_tokens` (`check_token_budget`) and `kv_cache_dtype`
    ("auto" or "fp8").

  Raises:
    ValueError: a bad value of any of them (naming it), both `kv_cache_memory_bytes` and
      `num_kv_blocks`, or an unknown `attention_backend`.
  """
  utilization = gpu_memory_utilization
  number = isinstance(utilization, (int, float, np.floating)) and not isinstance(utilization, bool)
  if not number or not 0 < utilization <= 1:
    raise ValueError(f"gpu_memory_utilization must be a float in (0, 1], got {utilization!r}")
  fields: dict[str, Any] = {"gpu_memory_utilization": float(utilization)}
  sizes = (
    ("kv_cache_memory_bytes", kv_cache_memory_bytes, 1, True),
    ("num_kv_blocks", num_kv_blocks, 2, True),
    ("block_size", block_size, 1, False),
  )
  for name, value, least, optional in sizes:
    if (value is not None or not optional) and (not is_int(value) or value < least):
      raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    fields[name] = None if value is None else int(value)
  if fields["kv_cache_memory_bytes"] is not None and fields["num_kv_blocks"] is not None:
    raise ValueError(
      f"give kv_cache_memory_bytes or num_kv_blocks, not both (got "
      f"{fields['kv_cache_memory_bytes']} and {fields['num_kv_blocks']})"
    )
  fields["max_num_batched_tokens"] = check_token_budget(
    max_num_batched_tokens,
    max_num_reqs=max_num_reqs,
    data_parallel_size=data_parallel_size,
    max_model_len=max_model_len,
    enable_chunked_prefill=enable_chunked_prefill,
  )
  if attention_backend is not None and attention_backend not in BACKEND_NAMES:
    raise ValueError(
      f"attention_backend must be one of {list(BACKEND_NAMES)} or None, got {attention_backend!r}"
    )
  if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in KV_CACHE_DTYPES:
    raise ValueError(
      f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}"
    )
  fields["kv_cache_dtype"] = KV_CACHE_DTYPES[kv_cache_dtype]
  return fields


def check_token_budget(
  budget: Any,
  *,
  max_num_reqs: int,
  data_parallel_size: int,
  max_model_len: int | None,
  enable_chunked_prefill: bool,
) -> int | None:
  """`max_num_batched_tokens` checked, its default set once `max_model_len` is known.

  Returns:
    The budget as an int; None while both it and `max_model_len` are None (`for_model` derives
    it from the model's limit).

  Raises:
    ValueError: a budget that is not a positive int, below one group's rows, or (without
      chunked prefill) below `max_model_len`.
  """
  rows = max_num_reqs // data_parallel_size  # one group's (each has its budget)
  if budget is not None and (not is_int(budget) or budget < 1):
    raise ValueError(f"max_num_batched_tokens must be a positive int, got {budget!r}")
  if budget is None:  # at most what one step can hold: larger token buckets are never reached
    if max_model_len is None:
      return None  # derived from the model's limit by `for_model`
    least = rows if enable_chunked_prefill else max_model_len
    budget = min(max(DEFAULT_MAX_NUM_BATCHED_TOKENS, least), rows * max_model_len)
  if budget < rows:
    group = f" / data_parallel_size={data_parallel_size}" if rows < max_num_reqs else ""
    raise ValueError(
      f"max_num_batched_tokens={budget} must be >= max_num_reqs={max_num_reqs}{group} "
      "(every running request of a group decodes one token per step)"
    )
  if not enable_chunked_prefill and max_model_len is not None and budget < max_model_len:
    raise ValueError(
      f"max_num_batched_tokens={budget} must be >= max_model_len={max_model_len} with "
      "enable_chunked_prefill=False (a whole prompt is computed in one step)"
    )
  return int(budget)


def check_max_model_len(max_model_len: int | None, max_position_embeddings: int) -> None:
  """Refuses a `max_model_len` above the model's `max_position_embeddings` (None passes: it
  means the model's limit).

  Raises:
    ValueError: naming both numbers.
  """
  if max_model_len is not None and max_model_len > max_position_embeddings:
    raise ValueError(
      f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
      f"{max_position_embeddings} (leave max_model_len unset to use the model's limit)"
    )


def check_decoding(
  speculative_config: Any, num_decode_steps: Any, max_model_len: int | None
) -> dict[str, Any]:
  """`speculative_config` built (`SpeculativeConfig.build`) and `num_decode_steps` checked.

  Returns:
    `speculative_config` (a `SpeculativeConfig` or None) and `num_decode_steps` (an int).

  Raises:
    ValueError: a bad speculative config, `num_speculative_tokens` not below `max_model_len`
      (None: checked again by `for_model`), or `num_decode_steps` not an int >= 1.
  """
  spec = SpeculativeConfig.build(speculative_config)
  steps = num_decode_steps
  k = None if spec is None else spec.num_speculative_tokens
  if k is not None and max_model_len is not None and k >= max_model_len:  # never verifiable,
    raise ValueError(  # and each step would allocate and compute k + 1 positions per row
      f"speculative_config: num_speculative_tokens={k} must be below max_model_len={max_model_len}"
    )
  if not is_int(steps) or steps < 1:
    raise ValueError(f"num_decode_steps must be an int >= 1, got {steps!r}")
  return {"speculative_config": spec, "num_decode_steps": int(steps)}
