"""The model runner: the model's weights, the KV cache, the persistent batch and the jitted steps.

Everything that runs on the device for the engine goes through here:

- `prefill(completions)`: writes the KV cache of new prompts (all tokens but the last), padded
  to a bucketed shape;
- `decode()`: one fused executable over a power-of-two bucket of rows holding every live row:
  the model on each row's last token, then the sampler (`jaxengine.sample.sample`), which
  appends the token on device;
- `add` / `remove`: composition changes of the `InputBatch`;
- `load_weights`: new weights for the same executables (nothing recompiles).

The model is split once (`nnx.split`); the steps are pure functions of `(graphdef, weights, ...)`
jitted with the cache and batch state donated. Compiles are bounded by the buckets: one decode
per (row bucket, attention bucket) reached (and with speculation one verify per such pair), one
prefill per (row bucket, length bucket) and with prompt logprobs per (row, length) bucket, plus
the batch's row write, row move and metadata refresh.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, cast

import jax
import numpy as np
from flax import nnx

from jaxengine import parallel
from jaxengine.batch import InputBatch, LogprobsArrays
from jaxengine.batch.step_loop import run_steps
from jaxengine.engine.buckets import MIN_ATTENTION_BUCKET, MIN_LENGTH_BUCKET, bucket, buckets
from jaxengine.engine.decode import DecodeOutput, MultiStepOutput
from jaxengine.engine.engine_config import EngineConfig
from jaxengine.engine.multi_step import device_stop_rules, stop_rule_arrays
from jaxengine.engine.placement import MeshPlacement
from jaxengine.engine.precompile import precompile_buckets
from jaxengine.engine.requests import Completion
from jaxengine.engine.shared_prefill import copy_plan_arrays, copy_slots, plan_shared_prefill
from jaxengine.engine.steps import RunnerSteps, jit_steps
from jaxengine.engine.verify import pad_drafts
from jaxengine.models.batch_invariant import batch_invariant_model
from jaxengine.models.interface import Model, check_model
from jaxengine.models.kv_cache import KVCache
from jaxengine.models.weights import (
  LeafPath,
  assemble_leaf,
  check_finite,
  collect_named_weights,
  collect_state,
  dotted,
  model_weight_specs,
  put,
  replace_leaves,
  state_leaves,
)

# --- the runner --------------------------------------------------------------------------------


class ModelRunner:
  """Owns a model's weights, its KV cache, the persistent batch and the jitted steps.

  Args:
    model: a `jaxengine.models.Model` (an `nnx.Module`), weights loaded. The runner keeps its
      own references to the arrays: changing the module afterwards does not change the engine
      (use `load_weights`).
    input_batch: the persistent batch the runner samples into (its `max_num_reqs` rows each hold
      a KV-cache slot).
    config: the engine's `EngineConfig` (validated); the runner reads:

      - `mesh`: None (one device), or a `jax.sharding.Mesh` with the axes
        ``("data", "model")`` (`jaxengine.parallel.make_mesh`): weights, KV cache and batch
        state are placed on it once here with `jaxengine.parallel`'s partition specs, and every
        jitted step declares those shardings for its inputs and outputs (so serving compiles
        nothing warm-up did not);
      Prefix caching needs the paged cache (`engine/paged_runner.py`), whose requests share
      pages; the slot cache has none.

      Default: `EngineConfig` with the batch's sizes and the slot cache.

  Raises:
    ValueError: a model that does not implement `Model`, a vocabulary or sizes that differ from
      the batch's, a `max_model_len` above the model's `max_position_embeddings`; on a mesh, a
      tensor-parallel size that does not divide the query heads, or a data-parallel size that
      does not divide `max_num_reqs`.
  """

  def __init__(
    self,
    model: Model,
    input_batch: InputBatch,
    config: EngineConfig | None = None,
  ) -> None:
    check_model(model)
    if config is None:
      config = EngineConfig(
        max_num_reqs=input_batch.max_num_reqs,
        max_model_len=input_batch.max_model_len,
        paged_kv_cache=False,
      )
    sizes = (config.max_num_reqs, config.max_model_len)
    if sizes != (input_batch.max_num_reqs, input_batch.max_model_len):
      raise ValueError(
        f"the config's max_num_reqs, max_model_len={sizes} differ from the batch's "
        f"{(input_batch.max_num_reqs, input_batch.max_model_len)}"
      )
    mesh = config.mesh
    if model.vocab_size != input_batch.vocab_size:
      raise ValueError(
        f"the model's vocab_size={model.vocab_size} differs from the batch's "
        f"vocab_size={input_batch.vocab_size}"
      )
    if input_batch.max_model_len > model.max_position_embeddings:
      raise ValueError(
        f"max_model_len={input_batch.max_model_len} exceeds the model's "
        f"max_position_embeddings={model.max_position_embeddings}"
      )
    self.input_batch = input_batch
    self.max_num_reqs = input_batch.max_num_reqs
    self.max_model_len = input_batch.max_model_len
    if config.batch_invariant:
      model = batch_invariant_model(model)  # a copy: the caller's module keeps its mode
    self._graphdef, weights = nnx.split(model)
    # The engine's own variables around the same arrays (no copy): later in-place updates of
    # `model` (an optimizer step) do not reach the engine; `load_weights` does.
    self.weights = jax.tree.map(lambda a: a, weights)
    self.weight_specs = {spec.name: spec for spec in model_weight_specs(model, self.weights)}
    self.mesh = mesh
    self._placement: MeshPlacement | None = None
    shardings = None
    if mesh is None:
      self.kv_cache = self._create_kv_cache(model, config)
    else:
      self._placement = MeshPlacement(model, self.weights, input_batch, parallel.check_mesh(mesh))
      self.weights = jax.device_put(self.weights, self._placement.weights)
      self.kv_cache = self._create_kv_cache(model, config)
      input_batch.place_state(self._placement.state)
      shardings = self._placement.jit_shardings()
    #: The jitted device steps (`engine/steps.py`).
    self.steps: RunnerSteps = jit_steps(
      self._graphdef, input_batch.state.num_top_logprobs, mesh, shardings
    )
    self._stop_rules: dict[str, tuple[int, tuple[int, ...]]] = {}
    self.max_num_device_stop_ids = input_batch.config.max_num_stop_token_ids + len(
      input_batch.eos_token_ids
    )
    self.length_buckets = buckets(self.max_model_len, min(MIN_LENGTH_BUCKET, self.max_model_len))
    self.attention_buckets = buckets(
      self.max_model_len, min(MIN_ATTENTION_BUCKET, self.max_model_len)
    )
    # On a mesh every row bucket is a multiple of the data-parallel size (whole rows per shard).
    # With batch_invariant, one: the sampler's reductions (top-p masses, the draw's cumulative
    # sums) take their order from the whole `[rows, V]` shape, so one row count keeps a
    # request's draw independent of the batch (the model's arithmetic is per token,
    # `jaxengine.models.batch_invariant`).
    self.row_buckets = (
      [self.max_num_reqs]
      if config.batch_invariant
      else buckets(self.max_num_reqs, self._placement.rows if self._placement else 1)
    )

  def _create_kv_cache(self, model: Model, config: EngineConfig) -> Any:
    """The KV cache: `max_num_reqs` slots of `max_model_len` positions, on one device or in its
    shards on the mesh (the paged runner, `engine/paged_runner.py`, makes a pool of pages
    instead). Called once, after the placement is set."""
    if self._placement is not None:
      return self._placement.create_kv_cache(model.kv_cache_spec)
    return KVCache.create(model.kv_cache_spec, self.max_num_reqs, self.max_model_len)

  @property
  def model(self) -> Model:
    """The model with the runner's current weights (a new module sharing the weight arrays)."""
    return nnx.merge(self._graphdef, self.weights)

  # --- weights ----------------------------------------------------------------------------------

  def load_weights(
    self, weights: Mapping[str, Any] | Iterable[tuple[str, Any]] | nnx.State | nnx.Module
  ) -> None:
    """Replaces some or all of the model's weights; the compiled steps are reused as they are.

    Two forms:

    - named tensors, ``{name: array}`` or ``(name, array)`` pairs, names and layouts as in the
      checkpoint (for `jaxengine.models.Llama` the Hugging Face names, vLLM's `load_weights`
      convention; for a model without `weight_specs`, its dotted NNX paths such as
      ``"layers.0.attn.wq"``). Tensors may be a subset: the rest stay as they are.
    - a whole `nnx.State` (``nnx.state(module)``), its nested pure dict
      (``nnx.to_pure_dict``) or the module itself, of the same structure as the engine's model:
      for trainers that hold the same NNX module.

    Arrays may be NumPy (converted on the host, then put on the device) or JAX arrays (converted
    on their devices, then placed as the engine's weights are: no round trip through the host).
    Any floating dtype is cast to the parameter's dtype. A JAX array that already has the
    parameter's layout, dtype and placement is used as it is, not copied: do not delete or donate
    it afterwards (copy it first if your training step donates its parameters). Nothing
    recompiles as long as the arrays are placed as the engine's weights are (on one device:
    uncommitted, as arrays made by `jnp` and by jitted functions of such arrays are; see
    `jaxengine.models.weights.put`).

    Running requests continue with the new weights (their cached keys and values stay as the
    old weights wrote them, as in vLLM). The prefix cache is emptied: later prompts compute
    their keys and values with the new weights.

    Raises:
      ValueError: naming the first unknown or repeated name, missing or extra state leaf, or
        tensor of the wrong type, shape or dtype, or holding a NaN or an infinity (by its
        checkpoint name; see `jaxengine.models.weights.nonfinite_tensors` for what that check
        reads and costs). Everything is checked before any conversion, and the weights change
        all at once at the end: after an error the model is exactly as it was.
    """
    leaves = state_leaves(self.weights)
    is_pure_dict = isinstance(weights, Mapping) and any(
      isinstance(v, Mapping) for v in weights.values()
    )
    if isinstance(weights, (nnx.State, nnx.Module)) or is_pure_dict:
      given = collect_state(weights, leaves)
      check_finite(given.items(), self._leaf_name)
      new = {path: put(given[path], leaves[path]) for path in leaves}
    else:
      grouped = collect_named_weights(weights, self.weight_specs, leaves)
      check_finite((spec.name, t) for parts in grouped.values() for spec, t in parts.values())
      new = {path: assemble_leaf(leaves[path], parts) for path, parts in grouped.items()}
    self.weights = replace_leaves(self.weights, new)
    self.reset_prefix_cache()

  def _leaf_name(self, path: LeafPath) -> str:
    """A leaf by its checkpoint name and NNX path (``"model.norm.weight" (final_norm.scale)``),
    or by its path alone when no single checkpoint tensor fills it."""
    names = [s.name for s in self.weight_specs.values() if s.path == path and s.layer is None]
    return f"{names[0]} ({dotted(path)})" if names else dotted(path)

  def reset_prefix_cache(self) -> bool:
    """Forgets the prefix cache's entries; True (the slot cache has none: a no-op)."""
    return True

  def set_kv_cache(self, kv_cache: KVCache) -> None:
    """Keeps `kv_cache` as the runner's KV cache: the result of a step that took (and donated)
    the current one, as the precompile loop returns it."""
    self.kv_cache = kv_cache

  # --- composition ------------------------------------------------------------------------------

  def add(self, completion: Completion) -> None:
    """Gives a completion a row of the batch (and its KV-cache slot)."""
    request = completion.request
    self.input_batch.add_request(completion.seq_id, request.prompt_token_ids, completion.params)
    self._stop_rules[completion.seq_id] = device_stop_rules(
      completion.params, self.input_batch.eos_token_ids, self.max_model_len
    )

  def remove(self, seq_id: str) -> None:
    """Frees a completion's row; the next step condenses the batch."""
    self.input_batch.remove_request(seq_id)
    self._stop_rules.pop(seq_id, None)

  def live_req_ids(self) -> list[str]:
    """Condenses the batch; returns its live rows' ids in row order, the order of the next
    step's outputs."""
    self.input_batch.condense()
    return cast(list[str], list(self.input_batch.req_ids))

  def row_bucket(self, num_reqs: int) -> int:
    """The row bucket a step over `num_reqs` live rows computes."""
    return bucket(num_reqs, self.row_buckets)

  # --- device steps -----------------------------------------------------------------------------

  def prefill(self, completions: Sequence[Completion]) -> dict[str, LogprobsArrays]:
    """Writes the KV cache of every prompt token but the last (the decode step feeds that one).

    Args:
      completions: newly added completions (each already holds a row).

    Returns:
      For each request that asked for `prompt_logprobs` (prefilled once, by its first
      completion), `LogprobsArrays` of `[num_prompt_tokens - 1, max_num_logprobs + 1]`:
      the logprobs of prompt tokens `1..`, keyed by request id.
    """
    groups = collections.defaultdict(list)
    prompt_logprobs: dict[str, LogprobsArrays | None] = {}
    for completion in completions:
      end = len(completion.request.prompt_token_ids) - 1
      wants_logprobs = completion.index == 0 and completion.params.prompt_logprobs is not None
      if end > 0:
        groups[bucket(end, self.length_buckets), wants_logprobs].append((completion, end))
      elif wants_logprobs:
        prompt_logprobs[completion.request.request_id] = None
    for (length, wants_logprobs), group in sorted(groups.items(), key=lambda i: i[0]):
      for first in range(0, len(group), self.max_num_reqs):
        chunk = group[first : first + self.max_num_reqs]
        prompt_logprobs.update(self._prefill_group(chunk, length, wants_logprobs))
    return {k: v for k, v in prompt_logprobs.items() if v is not None}

  def prefill_once_per_request(
    self, completions: Sequence[Completion]
  ) -> dict[str, LogprobsArrays]:
    """`prefill`, once per request: the other samples of a request admitted together take a
    copy of its cached prompt (`engine/shared_prefill.py`). Same arguments and result."""
    prefilled, copies = plan_shared_prefill(completions)
    prompt_logprobs = self.prefill(prefilled)
    if copies:
      slot = self.input_batch.cache_slot
      pairs = [(slot(source.seq_id), slot(target.seq_id)) for source, target in copies]
      src, dst = copy_plan_arrays(pairs, self.max_num_reqs, self.kv_cache.num_slots)
      self.kv_cache = copy_slots(self.kv_cache, src, dst)
    return prompt_logprobs

  def _prefill_group(
    self, group: list[tuple[Completion, int]], length: int, wants_logprobs: bool
  ) -> dict[str, LogprobsArrays]:
    """One prefill call: `(completion, end)` rows, prompt tokens `0 .. end - 1` of each."""
    size = bucket(len(group), self.row_buckets)
    token_ids = np.zeros((size, length), np.int32)
    next_token_ids = np.zeros((size, length), np.int32)
    # Padding rows and padding positions go past the prompt (nothing real reads them); whole
    # padding rows use max_model_len, where the cache drops writes.
    positions = np.full((size, length), self.max_model_len, np.int32)
    slots = np.zeros((size,), np.int32)
    for i, (completion, end) in enumerate(group):
      prompt = completion.request.prompt_token_ids
      token_ids[i, :end] = prompt[:end]
      next_token_ids[i, :end] = prompt[1 : end + 1]  # read with prompt logprobs
      positions[i] = np.arange(length)
      slots[i] = self.input_batch.cache_slot(completion.seq_id)
    if not wants_logprobs:
      self.kv_cache = self.steps.prefill(self.weights, self.kv_cache, token_ids, positions, slots)
      return {}
    self.kv_cache, logprobs = self.steps.prefill_logprobs(
      self.weights, self.kv_cache, token_ids, positions, slots, next_token_ids
    )
    logprobs = jax.device_get(logprobs)
    out = {}
    for i, (completion, n) in enumerate(group):
      out[completion.request.request_id] = LogprobsArrays(
        token_ids=logprobs.token_ids[i, :n],
        logprobs=logprobs.logprobs[i, :n],
        ranks=logprobs.ranks[i, :n],
      )
    return out

  def decode(
    self, grammar_bitmask: Callable[[Sequence[str | None]], np.ndarray | None] | None = None
  ) -> DecodeOutput:
    """One decode-and-sample step over every live row; the tokens are appended to the batch.

    Args:
      grammar_bitmask: called with the condensed batch's `req_ids`; returns the packed
        `[R, ceil(V / 32)] int32` allowed tokens of rows with structured outputs, or None (the
        step then leaves the bitmask as it is and reads it nowhere).

    Raises:
      ValueError: if a row already holds `max_model_len` tokens (nothing changes then).
    """
    batch = self.input_batch
    batch.condense()
    if grammar_bitmask is not None and (bitmask := grammar_bitmask(batch.req_ids)) is not None:
      batch.set_grammar_bitmask(bitmask)
    longest = max(batch.num_tokens(req_id) for req_id in batch.req_id_to_index)
    attention_len = bucket(longest, self.attention_buckets)
    num_rows = bucket(batch.num_reqs, self.row_buckets)
    step = self.steps.decode if self._placement is None else self._placed_decode
    sampled, kv_cache = batch.run(step, self.weights, self.kv_cache, attention_len, num_rows)
    self.kv_cache = cast(KVCache, kv_cache)
    return DecodeOutput(req_ids=batch.req_ids, sampled=sampled)

  def _placed_decode(self, state, metadata, *args):
    """The decode step on a mesh, state and metadata first put on their declared shardings (a
    no-op when the batch's own updates kept them, as they do)."""
    assert self._placement is not None
    state = jax.device_put(state, self._placement.state)
    metadata = jax.device_put(metadata, self._placement.metadata)
    return self.steps.decode(state, metadata, *args)

  def decode_steps(self, num_steps: int, end_on_first_finish: bool = False) -> MultiStepOutput:
    """Up to `num_steps` decode-and-sample steps in one device loop (`engine/multi_step.py`).

    Rows stop on the device at their length limits, EOS and stop ids (never before
    `min_tokens`); every valid token is appended to the batch.

    Args:
      num_steps: `k`, the most steps (static: one executable per value).
      end_on_first_finish: end the loop once some row stops (requests are waiting for a row).

    Raises:
      ValueError: if a row already holds `max_model_len` tokens (nothing changes then).
    """
    batch = self.input_batch
    longest = max(batch.num_tokens(req_id) for req_id in batch.req_id_to_index)
    # The last step feeds position longest + k - 2 and attends to every position up to it.
    attention_len = bucket(min(longest + num_steps - 1, self.max_model_len), self.attention_buckets)
    num_rows = bucket(batch.num_reqs, self.row_buckets)
    if any(rid is None for rid in batch.req_ids):
      batch.condense()
    rules = [self._stop_rules[seq_id] for seq_id in batch.req_ids]
    max_output_tokens, stop_ids = stop_rule_arrays(rules, num_rows, self.max_num_device_stop_ids)
    output, kv_cache = run_steps(
      batch,
      self.steps.decode_steps,
      self.weights,
      self.kv_cache,
      max_output_tokens,
      stop_ids,
      np.bool_(end_on_first_finish),
      attention_len=attention_len,
      num_rows=num_rows,
      num_steps=num_steps,
    )
    self.kv_cache = cast(KVCache, kv_cache)
    return MultiStepOutput(req_ids=batch.req_ids, sampled=output)

  def verify(self, draft_token_ids: np.ndarray, num_draft_tokens: np.ndarray) -> MultiStepOutput:
    """Verifies the live rows' drafts (`[num_reqs, k]`, counts `[num_reqs]`, `req_ids` order,
    `n + count < max_model_len`) in one pass (`engine/verify.py`); appends the emitted tokens."""
    batch = self.input_batch
    longest = max(batch.num_tokens(req_id) for req_id in batch.req_id_to_index)
    k = draft_token_ids.shape[1]
    attention_len = bucket(min(longest + k, self.max_model_len), self.attention_buckets)
    num_rows = bucket(batch.num_reqs, self.row_buckets)
    drafts, counts = pad_drafts(draft_token_ids, num_rows), pad_drafts(num_draft_tokens, num_rows)
    output, kv_cache = run_steps(
      batch, self.steps.verify, self.weights, self.kv_cache, drafts, counts,
      attention_len=attention_len, num_rows=num_rows,
    )  # fmt: skip
    self.kv_cache = cast(KVCache, kv_cache)
    return MultiStepOutput(req_ids=batch.req_ids, sampled=output)

  def precompile(
    self, num_decode_steps: int = 1, use_tqdm: bool = True, num_speculative_tokens: int = 0
  ) -> int:
    """Compiles every prefill and decode bucket now, so no request waits for a compile later.

    Runs each step once on an empty batch (prefill writes go past `max_model_len`, where the
    cache drops them; decode has no live row), which also fills JAX's persistent compilation
    cache when it is on. Left to compile when first needed: prefill with prompt logprobs, and
    the batch's small row updates (`write_row` when a request joins, `move_rows` when rows
    condense, the copy of a prompt's cache slot to the other samples of an ``n > 1`` request),
    since running them here would need dummy requests.

    Args:
      num_decode_steps: the engine's `k`: the one-step decode for 1, else the `k`-step loop.
      use_tqdm: show a progress bar.
      num_speculative_tokens: also the verify step of that many drafts (0: none).

    Returns:
      The number of step shapes run.

    Raises:
      ValueError: if the batch holds requests (precompile before adding any).
    """
    return precompile_buckets(self, num_decode_steps, use_tqdm, num_speculative_tokens)
