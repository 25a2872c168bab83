"""The jitted device steps of a model runner, shared by every runner of the same model structure.

A runner's steps are pure functions of `(graphdef, weights, ...)`: the weights are arguments, so
two engines over models of the same architecture and config (the same `nnx.GraphDef`), on the same
mesh with the same shardings, run the very same executables. `device_steps` hands them one set of
`jax.jit` wrappers, so JAX's caches (traces and compiled executables, keyed by the wrapper and the
argument shapes) serve both: a second engine, or an engine rebuilt after a weight update, compiles
only the shapes no earlier engine ran. The set is kept for the `MAX_CACHED` most recently used
structures (each holds its executables' memory).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
from collections.abc import Callable, Mapping
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from jaxengine.worker.multi_step import decode_steps
from jaxengine.worker.placement import MeshPlacement
from jaxengine.worker.ragged_step import ragged_forward, sample_produced
from jaxengine.worker.verify_step import rejection_sample_produced, verify_forward

#: Structures (graphdef, mesh, shardings) whose steps stay cached.
MAX_CACHED = 16


@dataclasses.dataclass(frozen=True)
class DeviceSteps:
  """The jitted steps of one model structure on one placement.

  Attributes:
    ragged_forward: the model's part of a plain step: one executable per (token bucket, row
      bucket) and prompt-logprobs variant (`worker/ragged_step.py`).
    sample_produced: the sampler's part: one executable per row bucket of at least 8 rows
      (`worker/buckets.py`'s `sample_rows`).
    verify_forward: the verify step's model part (`worker/verify_step.py`).
    rejection_sample_produced: the verify step's rejection sampler, per row bucket.
    decode_steps: the k-step decode loop, per row bucket and k (`worker/multi_step.py`).
  """

  ragged_forward: Callable[..., Any]
  sample_produced: Callable[..., Any]
  verify_forward: Callable[..., Any]
  rejection_sample_produced: Callable[..., Any]
  decode_steps: Callable[..., Any]


def ragged_step(
  forward, sample, state, metadata, weights, kv_cache, inputs, num_rows, prompt_logprobs
):
  """One plain step as `InputBatch.run_step` calls it (`forward` and `sample` bound first: a
  runner's `ragged_forward` and `sample_produced`): the model, then the sampler on its logits
  (dispatched back to back, no host round trip).

  Returns:
    `(state, MultiStepOutput, (kv_cache, prompt LogprobsTensors or None, RoutedExperts or
    None))`.
  """
  out = forward(state, weights, kv_cache, inputs, prompt_logprobs)
  state, output = sample(state, metadata, out.logits, inputs.produces, num_rows)
  return state, output, (out.kv_cache, out.prompt_logprobs, out.routed_experts)


def ragged_verify_step(
  verify, reject, state, metadata, weights, kv_cache, inputs, drafts, num_rows, prompt_logprobs
):
  """`ragged_step` with drafts (`verify` and `reject` bound first: a runner's `verify_forward`
  and `rejection_sample_produced`, `worker/verify_step.py`). Returns as `ragged_step`; the output
  holds `k + 1` positions."""
  out = verify(state, weights, kv_cache, inputs, drafts, prompt_logprobs)
  state, output = reject(state, metadata, out.logits, drafts, inputs.produces, num_rows)
  return state, output, (out.kv_cache, out.prompt_logprobs, out.routed_experts)


_cache: collections.OrderedDict[Any, DeviceSteps] = collections.OrderedDict()
_lock = threading.Lock()  # engines may be built from several threads


def device_steps(
  graphdef: nnx.GraphDef, mesh: Mesh | None, shardings: Mapping[str, Mapping[str, Any]]
) -> DeviceSteps:
  """The steps of `graphdef` on `mesh` with these shardings, jitted once per distinct triple.

  Args:
    graphdef: the model's structure (`nnx.split(model)[0]`; equal for models of one config).
    mesh: the engine's mesh, or None for one device.
    shardings: each step's `jax.jit` sharding arguments by step name (`DeviceSteps` fields; an
      empty mapping, or a step missing, for none), from `worker/placement.py` on a mesh.
  """
  key = (graphdef, mesh, _hashable(shardings))
  with _lock:
    steps = _cache.get(key)
    if steps is None:
      steps = _cache[key] = _jit(graphdef, mesh, shardings)
    _cache.move_to_end(key)
    while len(_cache) > MAX_CACHED:
      _cache.popitem(last=False)
    return steps


def placed_device_steps(
  graphdef: nnx.GraphDef, mesh: Mesh | None, placement: MeshPlacement | None, vocab_size: int
) -> DeviceSteps:
  """`device_steps` with every step's shardings from `placement` (None off a mesh). Needs no
  device array: `graphdef` may come from an abstract model (`nnx.eval_shape`), and the jitted
  steps take `jax.ShapeDtypeStruct` arguments in `.lower(...)`, to compile ahead of time."""
  shardings = {}
  if placement is not None:
    shardings = {
      "ragged_forward": placement.ragged_forward_shardings(vocab_size),
      "sample_produced": placement.sample_produced_shardings(vocab_size),
      "verify_forward": placement.verify_forward_shardings(),
      "rejection_sample_produced": placement.rejection_sample_produced_shardings(),
      "decode_steps": placement.decode_steps_shardings(),
    }
  return device_steps(graphdef, mesh, shardings)


def _hashable(shardings: Mapping[str, Mapping[str, Any]]) -> Any:
  """The shardings as a hashable key (their leaves are `jax.sharding.Sharding`s)."""
  leaves, treedef = jax.tree.flatten(dict(shardings))
  return treedef, tuple(leaves)


def _jit(graphdef, mesh, shardings) -> DeviceSteps:
  def of(name: str) -> dict[str, Any]:
    return dict(shardings.get(name, {}))

  return DeviceSteps(
    ragged_forward=jax.jit(
      functools.partial(ragged_forward, graphdef),
      static_argnames=("prompt_logprobs",),
      donate_argnames=("kv_cache",),
      **of("ragged_forward"),
    ),
    sample_produced=jax.jit(
      functools.partial(sample_produced, mesh=mesh),
      static_argnames=("num_rows",),
      donate_argnames=("state",),
      **of("sample_produced"),
    ),
    verify_forward=jax.jit(
      functools.partial(verify_forward, graphdef),
      static_argnames=("prompt_logprobs",),
      donate_argnames=("kv_cache",),
      **of("verify_forward"),
    ),
    rejection_sample_produced=jax.jit(
      functools.partial(rejection_sample_produced, mesh=mesh),
      static_argnames=("num_rows",),
      donate_argnames=("state",),
      **of("rejection_sample_produced"),
    ),
    decode_steps=jax.jit(
      functools.partial(decode_steps, graphdef, mesh=mesh),
      static_argnames=("num_rows", "num_steps"),
      donate_argnames=("state", "kv_cache"),
      **of("decode_steps"),
    ),
  )


def clear() -> None:
  """Forgets every cached set: the next runner jits its steps afresh (to count one engine's own
  executables, as the tests of compile bounds do)."""
  _cache.clear()
