"""A new row bucket's sampler compiled beside the model part of its step.

A plain step is two executables dispatched back to back (`worker/device_steps.py`'s
`ragged_step`): the model over a (token bucket, row bucket), then the sampler over the step's
`sample_rows`. The first step of a new shape compiles both on the engine's thread, one after the
other, and in a fresh process most of the first `generate` is those compiles (SmolLM2-135M on a
2-core CPU host: about 2.5 s of XLA for each model shape and 3 s for the sampler). XLA compiles
one executable on few of a host's cores (about 1.4 of a 2-core VM's), so `SamplerBeside` compiles
a row bucket's sampler on a thread of its own while the engine's thread compiles the model:

- the sampler's compile starts when the step is called, lowered from the very arguments the
  sampler gets (`abstract`: shapes, dtypes, weak types, shardings; the logits as the model part
  returns them), so it is the executable the sampler's own call then finds in JAX's in-memory
  cache (that call traces, and compiles nothing);
- the sampler's call waits for that compile (a compile that failed is left to the call, which
  compiles on the engine's thread and raises there, as without this module);
- each row bucket's sampler is started once per runner: the same executables compile as
  without it, as many times, only on another thread.

Every step with a new sampler bucket takes this path (`worker/precompile.py`'s too). With the
persistent compilation cache warm, the two are each a trace and a cache read, side by side too.

It pays where a core is idle while XLA compiles: a fresh process's first `generate` on a quiet
2-core CPU host took about a second less (`docs/performance.md`, "The sampler beside the model").
Where every core is already busy (several engine processes on a small host, as the test suite's
two workers on two cores) the two compiles only contend, each slower: set
``JAXENGINE_COMPILE_BESIDE=off`` (read when a runner is built) to compile the sampler on the
engine's thread, as before.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.compilation_cache import is_off
from jaxengine.worker.device_steps import ragged_step
from jaxengine.worker.placement import MeshPlacement

#: The environment variable that turns compiling beside off (``off``, ``0``, ``false``, ``no``).
ENV_VAR = "JAXENGINE_COMPILE_BESIDE"

_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _compile_pool() -> concurrent.futures.ThreadPoolExecutor:
  """The process's one compiling thread (started on first use; idle, it costs nothing)."""
  global _pool
  with _pool_lock:
    if _pool is None:
      _pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxengine-beside")
    return _pool


def abstract(tree: Any, input_sharding: Any = None) -> Any:
  """`tree`'s arrays as a jitted call receives them, as `jax.ShapeDtypeStruct`s to lower with: a
  committed device array in its own sharding, an uncommitted one (a host value put on the
  default device) and a NumPy array in `input_sharding` (None: unspecified, as JAX places an
  argument that names no device); other leaves as they are."""

  def spec(x: Any) -> Any:
    if isinstance(x, jax.Array):
      sharding = x.sharding if x.committed else input_sharding
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding, weak_type=x.weak_type)
    if isinstance(x, np.ndarray) and input_sharding is not None:
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=input_sharding)
    return x

  return jax.tree.map(spec, tree)


def _compile(jitted: Callable[..., Any], *args: Any) -> None:
  jitted.lower(*args).compile()  # type: ignore[attr-defined]


@dataclasses.dataclass
class SamplerBeside:
  """One runner's row buckets whose sampler has been started (see the module).

  Attributes:
    vocab_size: the logits' last axis (`V`).
    logits_sharding: the model part's logits' sharding on a mesh, else None (one device).
    input_sharding: where the runner's host inputs go (replicated on a mesh, else None).
    enabled: False: every sampler compiles on the engine's thread, when its call meets it.
  """

  vocab_size: int
  logits_sharding: Any = None
  input_sharding: Any = None
  enabled: bool = True
  _rows: set[int] = dataclasses.field(default_factory=set)

  @classmethod
  def of(cls, vocab_size: int, placement: MeshPlacement | None) -> SamplerBeside:
    """A runner's, on `placement`'s mesh (None: one device); off where `ENV_VAR` says so."""
    enabled = not is_off(os.environ.get(ENV_VAR, "on"))
    if placement is None:
      return cls(vocab_size, enabled=enabled)
    return cls(vocab_size, placement.logits_sharding(vocab_size), placement.replicated, enabled)

  def ragged_step(self, forward: Callable[..., Any], sample: Callable[..., Any]) -> Callable:
    """`device_steps.ragged_step` with `forward` and `sample` bound, whose sampler, on a new
    row bucket, compiles beside `forward`'s compile."""
    return functools.partial(self._step, forward, sample)

  def _step(
    self, forward, sample, state, metadata, weights, kv_cache, inputs, num_rows, prompt_logprobs
  ):
    if self.enabled and num_rows not in self._rows and hasattr(sample, "lower"):  # jitted
      self._rows.add(num_rows)
      sample = self._started(sample, state, metadata, inputs.produces, num_rows)
    return ragged_step(
      forward, sample, state, metadata, weights, kv_cache, inputs, num_rows, prompt_logprobs
    )

  def _started(self, sample, state, metadata, produces, num_rows: int) -> Callable[..., Any]:
    """Starts `sample`'s compile for `num_rows` rows on the compiling thread; returns `sample`
    waiting for it first."""
    logits = jax.ShapeDtypeStruct(
      (num_rows, self.vocab_size), jnp.float32, sharding=self.logits_sharding
    )
    state, metadata, produces = abstract((state, metadata, produces), self.input_sharding)
    future = _compile_pool().submit(_compile, sample, state, metadata, logits, produces, num_rows)

    def sample_after_compile(*args: Any) -> Any:
      concurrent.futures.wait([future])  # a failed compile: this call compiles and raises
      return sample(*args)

    return sample_after_compile
