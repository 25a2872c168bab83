"""The model runner: the model's weights, the KV cache, the persistent batch and the jitted steps.

Everything that runs on the device for the engine goes through here:

- `prefill(completions)`: writes the KV cache of new prompts (all tokens but the last), padded to
  a (row bucket, length bucket) shape, and returns prompt logprobs for requests that asked;
- `decode()`: one fused executable over a power-of-two bucket of rows holding every live row:
  the model on each row's last token, then the sampler (`jaxengine.sample.sample`), which
  appends the token on device;
- `add` / `remove`: composition changes of the `InputBatch`;
- `load_weights`: new weights for the same executables (nothing recompiles).

The model is split once (`nnx.split`); the steps are pure functions of `(graphdef, weights, ...)`
jitted with the cache and batch state donated. Compiles are bounded by the buckets: one decode
per (row bucket, length bucket) reached, one prefill per (row bucket, length bucket) used with and
without prompt logprobs, plus the batch's row write, row move and metadata refresh.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxengine.batch import HostSamplerOutput, InputBatch, LogprobsArrays
from jaxengine.engine.requests import Completion
from jaxengine.models.interface import Model, check_model
from jaxengine.models.kv_cache import KVCache
from jaxengine.models.weights import (
  assemble_leaf,
  collect_named_weights,
  collect_state,
  model_weight_specs,
  put,
  replace_leaves,
  state_leaves,
)
from jaxengine.sample import SamplingMetadata, gather_logprobs, sample

#: Smallest prefill length bucket, in tokens.
MIN_LENGTH_BUCKET = 16
#: Smallest decode attention bucket, in cache positions. Attending to 128 positions costs little
#: next to reading the weights, and it spares most short generations a second decode compile.
MIN_ATTENTION_BUCKET = 128


def buckets(limit: int, start: int) -> list[int]:
  """Powers of two from `start`, the last one clipped to `limit`."""
  sizes = [start]
  while sizes[-1] < limit:
    sizes.append(sizes[-1] * 2)
  sizes[-1] = min(sizes[-1], limit)
  return sizes


def bucket(n: int, sizes: list[int]) -> int:
  """The smallest of `sizes` holding `n`."""
  return next(b for b in sizes if b >= n)


@dataclasses.dataclass(frozen=True)
class DecodeOutput:
  """One decode step on the host.

  Attributes:
    req_ids: the batch's row ids (`num_reqs`), the order of the arrays below.
    sampled: the sampler's host output over those rows.
  """

  req_ids: list[str]
  sampled: HostSamplerOutput


# --- pure device functions ---------------------------------------------------------------------


def _leading_rows(metadata: SamplingMetadata, num_rows: int) -> SamplingMetadata:
  """Metadata of the first `num_rows` rows (the batch-wide `any_*` flags kept)."""
  rows = jax.tree.map(lambda a: a[:num_rows] if a.ndim else a, metadata)
  return dataclasses.replace(rows, any_logits_processor=metadata.any_logits_processor)


def _decode_and_sample(graphdef, state, metadata, weights, kv_cache, attention_len, num_rows):
  """Model forward on each live row's last token, then the sampler: one executable per step.

  Only the first `num_rows` rows (static, a bucket above `num_reqs`; the batch is condensed, so
  every live row is among them) are computed, so one request costs about what it costs alone
  whatever `max_num_reqs` is. `attention_len` (static) is a bucket of cache positions above every
  live row's length, so a step costs what the longest sequence needs rather than `max_model_len`.
  """
  rows_state = state.leading_rows(num_rows)
  rows_metadata = _leading_rows(metadata, num_rows)
  last = jnp.maximum(rows_state.num_tokens - 1, 0)
  token_ids = rows_state.token_ids[jnp.arange(num_rows), last]
  # Rows without a request write nothing: positions >= max_model_len are dropped by the cache.
  positions = jnp.where(rows_metadata.is_live, last, state.max_model_len)
  model = nnx.merge(graphdef, weights)
  hidden, kv_cache = model(
    token_ids[:, None],
    positions[:, None],
    kv_cache,
    rows_state.cache_slot,
    attention_len=attention_len,
  )
  rows_state, output = sample(rows_state, rows_metadata, model.compute_logits(hidden[:, 0]))
  return state.with_leading_rows(rows_state), output, kv_cache


def _prefill(graphdef, weights, kv_cache, token_ids, positions, cache_slots):
  model = nnx.merge(graphdef, weights)
  _, kv_cache = model(token_ids, positions, kv_cache, cache_slots, attention_len=token_ids.shape[1])
  return kv_cache


def _prefill_with_prompt_logprobs(
  graphdef, num_logprobs, weights, kv_cache, token_ids, positions, cache_slots, next_token_ids
):
  """Prefill that also returns the raw log-softmax logprobs of each next prompt token
  (`LogprobsTensors` of `[B, T, num_logprobs + 1]`)."""
  model = nnx.merge(graphdef, weights)
  hidden, kv_cache = model(
    token_ids, positions, kv_cache, cache_slots, attention_len=token_ids.shape[1]
  )
  logits = model.compute_logits(hidden)  # [B, T, V]
  rows, length, vocab = logits.shape
  logprobs = gather_logprobs(
    logits.reshape(rows * length, vocab), next_token_ids.reshape(-1), num_logprobs
  )
  return kv_cache, jax.tree.map(lambda a: a.reshape(rows, length, *a.shape[1:]), logprobs)


# --- the runner --------------------------------------------------------------------------------


class ModelRunner:
  """Owns a model's weights, its KV cache, the persistent batch and the jitted steps.

  Args:
    model: a `jaxengine.models.Model` (an `nnx.Module`), weights loaded. The runner keeps its
      own references to the arrays: changing the module afterwards does not change the engine
      (use `load_weights`).
    input_batch: the persistent batch the runner samples into (its `max_num_reqs` rows each hold
      a KV-cache slot).

  Raises:
    ValueError: a model that does not implement `Model`, a vocabulary that differs from the
      batch's, or a `max_model_len` above the model's `max_position_embeddings`.
  """

  def __init__(self, model: Model, input_batch: InputBatch) -> None:
    check_model(model)
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
    self._graphdef, weights = nnx.split(model)
    # The engine's own variables around the same arrays (no copy): later in-place updates of
    # `model` (an optimizer step) do not reach the engine; `load_weights` does.
    self.weights = jax.tree.map(lambda a: a, weights)
    self.weight_specs = {spec.name: spec for spec in model_weight_specs(model, self.weights)}
    self.kv_cache = KVCache.create(model.kv_cache_spec, self.max_num_reqs, self.max_model_len)
    self._decode = jax.jit(
      functools.partial(_decode_and_sample, self._graphdef),
      static_argnames=("attention_len", "num_rows"),
      donate_argnames=("state", "kv_cache"),
    )
    self._prefill = jax.jit(
      functools.partial(_prefill, self._graphdef), donate_argnames=("kv_cache",)
    )
    self._prefill_logprobs = jax.jit(
      functools.partial(
        _prefill_with_prompt_logprobs, self._graphdef, input_batch.state.max_num_logprobs
      ),
      donate_argnames=("kv_cache",),
    )
    self.length_buckets = buckets(self.max_model_len, min(MIN_LENGTH_BUCKET, self.max_model_len))
    self.attention_buckets = buckets(
      self.max_model_len, min(MIN_ATTENTION_BUCKET, self.max_model_len)
    )
    self.row_buckets = buckets(self.max_num_reqs, 1)

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
    old weights wrote them, as in vLLM).

    Raises:
      ValueError: naming the first unknown or repeated name, missing or extra state leaf, or
        tensor of the wrong type, shape or dtype. Everything is checked on the host before any
        conversion, and the weights change all at once at the end: after an error the model is
        exactly as it was.
    """
    leaves = state_leaves(self.weights)
    is_pure_dict = isinstance(weights, Mapping) and any(
      isinstance(v, Mapping) for v in weights.values()
    )
    if isinstance(weights, (nnx.State, nnx.Module)) or is_pure_dict:
      given = collect_state(weights, leaves)
      new = {path: put(given[path], leaves[path]) for path in leaves}
    else:
      grouped = collect_named_weights(weights, self.weight_specs, leaves)
      new = {path: assemble_leaf(leaves[path], parts) for path, parts in grouped.items()}
    self.weights = replace_leaves(self.weights, new)

  # --- composition ------------------------------------------------------------------------------

  def add(self, completion: Completion) -> None:
    """Gives a completion a row of the batch (and its KV-cache slot)."""
    request = completion.request
    self.input_batch.add_request(completion.seq_id, request.prompt_token_ids, completion.params)

  def remove(self, seq_id: str) -> None:
    """Frees a completion's row; the next step condenses the batch."""
    self.input_batch.remove_request(seq_id)

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
      length = len(completion.request.prompt_token_ids) - 1
      wants_logprobs = completion.index == 0 and completion.params.prompt_logprobs is not None
      if length > 0:
        groups[bucket(length, self.length_buckets), wants_logprobs].append(completion)
      elif wants_logprobs:
        prompt_logprobs[completion.request.request_id] = None
    for (length, wants_logprobs), group in sorted(groups.items(), key=lambda item: item[0]):
      for start in range(0, len(group), self.max_num_reqs):
        chunk = group[start : start + self.max_num_reqs]
        prompt_logprobs.update(self._prefill_group(chunk, length, wants_logprobs))
    return {k: v for k, v in prompt_logprobs.items() if v is not None}

  def _prefill_group(
    self, group: list[Completion], length: int, wants_logprobs: bool
  ) -> dict[str, LogprobsArrays]:
    size = bucket(len(group), self.row_buckets)
    token_ids = np.zeros((size, length), np.int32)
    next_token_ids = np.zeros((size, length), np.int32)
    # Padding rows and padding positions go past the prompt (nothing real reads them); whole
    # padding rows use max_model_len, where the cache drops writes.
    positions = np.full((size, length), self.max_model_len, np.int32)
    slots = np.zeros((size,), np.int32)
    for i, completion in enumerate(group):
      prompt = completion.request.prompt_token_ids
      n = len(prompt) - 1
      token_ids[i, :n] = prompt[:-1]
      next_token_ids[i, :n] = prompt[1:]
      positions[i] = np.arange(length)
      slots[i] = self.input_batch.cache_slot(completion.seq_id)
    if not wants_logprobs:
      self.kv_cache = self._prefill(self.weights, self.kv_cache, token_ids, positions, slots)
      return {}
    self.kv_cache, logprobs = self._prefill_logprobs(
      self.weights, self.kv_cache, token_ids, positions, slots, next_token_ids
    )
    logprobs = jax.device_get(logprobs)
    out = {}
    for i, completion in enumerate(group):
      n = len(completion.request.prompt_token_ids) - 1
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
    sampled, kv_cache = batch.run(
      self._decode, self.weights, self.kv_cache, attention_len, num_rows
    )
    self.kv_cache = cast(KVCache, kv_cache)
    return DecodeOutput(req_ids=batch.req_ids, sampled=sampled)
