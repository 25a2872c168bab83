"""The runner's jitted device steps, built once per runner and typed as one `RunnerSteps`.

Each step is a pure function of `(graphdef, weights, ...)` (`engine/prefill.py`,
`engine/decode.py`, `engine/multi_step.py`, `engine/verify.py`) with the model's graph definition
bound, jitted with the state it replaces donated. The runner calls them; so do the modules that
drive the same executables for it (`engine/precompile.py`), through this typed set rather than
the runner's attributes.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax

from jaxengine.engine.decode import decode_and_sample
from jaxengine.engine.multi_step import decode_steps
from jaxengine.engine.prefill import prefill_step, prefill_with_prompt_logprobs
from jaxengine.engine.verify import verify_and_sample


@dataclasses.dataclass(frozen=True)
class RunnerSteps:
  """The jitted steps of one runner (graph definition bound; weights passed per call).

  Attributes:
    decode: `decode_and_sample`: ``(state, metadata, weights, kv_cache, attention_len,
      num_rows) -> (state, SamplerOutput, kv_cache)``; state and cache donated.
    prefill: `prefill_step`: ``(weights, kv_cache, token_ids, positions, cache_slots) ->
      kv_cache``; cache donated.
    prefill_logprobs: `prefill_with_prompt_logprobs`: ``(weights, kv_cache, token_ids,
      positions, cache_slots, next_token_ids) -> (kv_cache, LogprobsTensors)``; cache donated.
    decode_steps: `decode_steps` (the k-step loop): ``(state, metadata, weights, kv_cache,
      max_output_tokens, stop_ids, end_on_first_finish, attention_len, num_rows, num_steps)
      -> (state, MultiStepOutput, kv_cache)``; state and cache donated.
    verify: `verify_and_sample`: ``(state, metadata, weights, kv_cache, draft_token_ids,
      num_draft_tokens, attention_len, num_rows) -> (state, MultiStepOutput, kv_cache)``;
      state and cache donated.
  """

  decode: Callable[..., Any]
  prefill: Callable[..., Any]
  prefill_logprobs: Callable[..., Any]
  decode_steps: Callable[..., Any]
  verify: Callable[..., Any]


def jit_steps(
  graphdef: Any,
  num_top_logprobs: int,
  mesh: jax.sharding.Mesh | None = None,
  shardings: dict[str, dict[str, Any]] | None = None,
) -> RunnerSteps:
  """Jits a model's steps once.

  Args:
    graphdef: the model's NNX graph definition (`nnx.split`).
    num_top_logprobs: the batch state's top-logprob count (static in prompt logprobs).
    mesh: None (one device) or the runner's mesh (the decode step's sampler reduces sharded
      logits on it).
    shardings: per step name ("decode", "prefill", "prefill_logprobs", "decode_steps"), the
      `in_shardings` / `out_shardings` keyword arguments of `jax.jit`
      (`MeshPlacement.jit_shardings`); None on one device.

  Returns:
    The `RunnerSteps`.
  """
  shardings = shardings or {}
  return RunnerSteps(
    decode=jax.jit(
      functools.partial(decode_and_sample, graphdef, mesh=mesh),
      static_argnames=("attention_len", "num_rows"),
      donate_argnames=("state", "kv_cache"),
      **shardings.get("decode", {}),
    ),
    prefill=jax.jit(
      functools.partial(prefill_step, graphdef),
      donate_argnames=("kv_cache",),
      **shardings.get("prefill", {}),
    ),
    prefill_logprobs=jax.jit(
      functools.partial(prefill_with_prompt_logprobs, graphdef, num_top_logprobs),
      donate_argnames=("kv_cache",),
      **shardings.get("prefill_logprobs", {}),
    ),
    decode_steps=_jit_decode_steps(graphdef, mesh, shardings.get("decode_steps")),
    verify=jax.jit(
      functools.partial(verify_and_sample, graphdef),
      static_argnames=("attention_len", "num_rows"),
      donate_argnames=("state", "kv_cache"),
    ),
  )


def _jit_decode_steps(
  graphdef: Any, mesh: jax.sharding.Mesh | None, shardings: dict[str, Any] | None
) -> Callable[..., Any]:
  """The k-step loop jitted; on a mesh with its declared shardings, behind a function that keeps
  the one-device call form (`jax.jit` takes no keyword arguments with `in_shardings`, so the
  static ones go by position) and first puts state and metadata on their shardings (a no-op
  when the batch's own updates kept them)."""
  statics = ("attention_len", "num_rows", "num_steps")
  fn = functools.partial(decode_steps, graphdef, mesh=mesh)
  if shardings is None:
    return jax.jit(fn, static_argnames=statics, donate_argnames=("state", "kv_cache"))
  jitted = jax.jit(fn, static_argnums=(7, 8, 9), donate_argnums=(0, 3), **shardings)
  state_sharding, metadata_sharding = shardings["in_shardings"][:2]

  def placed(state, metadata, *args, attention_len, num_rows, num_steps):
    state = jax.device_put(state, state_sharding)
    metadata = jax.device_put(metadata, metadata_sharding)
    return jitted(state, metadata, *args, attention_len, num_rows, num_steps)

  return placed
