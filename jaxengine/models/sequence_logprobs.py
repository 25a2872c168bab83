"""A trainer's side of bitwise reproducibility: the log-probabilities of whole sequences, equal
to the engine's bit for bit (the module itself: `jaxengine.models.hub.load`).

``LLM(model, batch_invariant=True)`` computes every token with arithmetic that does not depend
on the rest of its step (`jaxengine.models.batch_invariant`, and the paged attention's
``fixed_order``). `token_logprobs` runs the same module over whole sequences with the same
arithmetic: the sequences are one ragged step of a scratch paged cache, every token writes its
key and value and attends in the same fixed order as in the engine, and the log-softmax is the
sampler's in that mode (`jaxengine.sample.logprobs.gather_logprobs` with ``fixed_order``: the
token's logit minus the row's `jaxengine.reductions.fixed_logsumexp`). So the value it gives for
token ``t + 1`` equals the raw logprob the engine reported when it sampled (or was prompted
with) that token, on the same weights, whatever the engine's batch, prefix cache hits or
prefill chunks were.

It is a pure function of the module's parameters: jit it, differentiate it (``nnx.grad``), use
it in a policy-gradient loss.

`sequence_logits` is the plain whole-sequence forward over the same kind of scratch step (the
model's own arithmetic, the XLA backend's default attention order): the logits of every
position, for scoring, inspecting a model or as a test's reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxengine.models.attention_backends import AttentionBackend, XlaAttentionBackend
from jaxengine.models.batch_invariant import batch_invariant_model
from jaxengine.models.interface import Model
from jaxengine.models.kv_pages import PagedKVCache
from jaxengine.models.paged_attention import PagedAttentionMetadata
from jaxengine.reductions import fixed_logsumexp

__all__ = ["scratch_step", "sequence_logits", "token_logprobs"]


def token_logprobs(
  model: nnx.Module,
  token_ids: jax.Array,
  *,
  block_size: int = 16,
  routed_experts: jax.Array | np.ndarray | None = None,
) -> jax.Array:
  """``log p(token_ids[b, t + 1] | token_ids[b, :t + 1])`` under the module's current weights.

  Equal bit for bit to the raw logprobs ``LLM(model, batch_invariant=True)`` reports for the
  same tokens (sampled ones in ``CompletionOutput.logprobs``, prompt ones in
  ``prompt_logprobs``), with the engine's default ``block_size``; computed with the same
  batch-invariant arithmetic (module docstring), so it runs at about the engine's speed for a
  prefill of ``B * T`` tokens, not at a plain forward pass's.

  Args:
    model: a module implementing `jaxengine.models.Model` whose modules declare a
      ``batch_invariant`` attribute (`jaxengine.models.Llama`); it is not modified.
    token_ids: ``[B, T] int32`` whole sequences (prompt then completion), ``T >= 2``, at most
      the model's ``max_position_embeddings``; every sequence is ``T`` long (pad the shorter
      ones at the end with any id of the vocabulary and ignore their tail: a token only sees
      the tokens before it).
    block_size: the engine's ``block_size`` (positions per page; the attention's chunk of 64
      positions is the same for any block size up to 64).
    routed_experts: None (default: each MoE layer's router picks its top ``k``), or routing
      replay (R3) for a mixture-of-experts model: ``[B, T - 1, M, k]`` (or ``[B, T, M, k]``)
      integer experts, ``M`` MoE layers, ``k`` ``num_experts_per_tok``: the experts each
      position is routed to instead, e.g. the rollout's ``CompletionOutput.routed_experts``
      (``LLM(..., enable_return_routed_experts=True)``) stacked per sequence. The router's
      softmax, under the current weights, still weights the given experts (renormalised as the
      model does). The last position's routing, which predicts nothing here, may be left out.

  Returns:
    ``[B, T - 1] float32``: entry ``[b, t]`` is the log-probability of token ``t + 1`` of
    sequence ``b`` (the log-softmax of the model's float32 logits, no temperature or other
    processing: vLLM's ``raw_logprobs``). Differentiable in the model's parameters. A request
    with ``structured_outputs`` is the exception: the engine's raw logprobs of its sampled
    tokens are taken after the grammar's mask (vLLM's rule), so they differ from these
    unmasked ones; its prompt logprobs still match.

  Raises:
    ValueError: ``token_ids`` not ``[B, T]`` integers with ``B >= 1`` and ``T >= 2``, ids outside
      the vocabulary (checked when the ids are concrete, not under a trace), ``T``
      above ``max_position_embeddings``, a model without the ``batch_invariant`` attribute,
      ``block_size`` not a positive int, or ``routed_experts`` of another shape, not integers,
      ids outside ``[0, num_experts)`` (checked when concrete), or given for a model without
      MoE layers.
  """
  token_ids = _checked_token_ids(model, token_ids, min_length=2)
  if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
    raise ValueError(f"block_size must be a positive int, got {block_size!r}")
  routed = None if routed_experts is None else _checked_routing(model, token_ids, routed_experts)
  graphdef, weights = nnx.split(batch_invariant_model(model))
  return _token_logprobs(graphdef, weights, token_ids.astype(jnp.int32), block_size, routed)


def _checked_routing(model, token_ids: jax.Array, routed_experts) -> jax.Array:
  """``routed_experts`` as ``[B, T, M, k] int32`` (a missing last position padded with expert
  0: its output predicts nothing), after `token_logprobs`' checks."""
  config = getattr(model, "config", None)
  num_moe_layers = len(getattr(config, "moe_layers", ()) or ())
  top_k = getattr(config, "num_experts_per_tok", 0)
  if not num_moe_layers:
    raise ValueError(f"routed_experts needs a mixture-of-experts model; {type(model).__name__} "
                     "has no MoE layers")  # fmt: skip
  routed = jnp.asarray(routed_experts)
  batch, length = token_ids.shape
  shapes = [(batch, n, num_moe_layers, top_k) for n in (length - 1, length)]
  if routed.shape not in shapes or not jnp.issubdtype(routed.dtype, jnp.integer):
    raise ValueError(
      f"routed_experts must be [B, T - 1, M, k] or [B, T, M, k] integers ({shapes[0]} or "
      f"{shapes[1]}), got {routed.dtype} {routed.shape}"
    )
  num_experts = getattr(config, "num_experts", 0)
  if not isinstance(routed, jax.core.Tracer) and routed.size and num_experts:
    low, high = int(routed.min()), int(routed.max())
    if low < 0 or high >= num_experts:
      raise ValueError(
        f"routed_experts must be expert ids in [0, {num_experts}), got ids from {low} to {high}"
      )
  routed = routed.astype(jnp.int32)
  if routed.shape[1] == length - 1:
    routed = jnp.pad(routed, ((0, 0), (0, 1), (0, 0), (0, 0)))
  return routed


@functools.partial(jax.jit, static_argnums=(0, 3))
def _token_logprobs(
  graphdef, weights, token_ids: jax.Array, block_size: int, routed_experts: jax.Array | None
) -> jax.Array:
  """`token_logprobs` of the module ``nnx.merge(graphdef, weights)``, always compiled: XLA:CPU
  contracts a multiply and an add into one rounding inside its fusions, so the op-by-op results
  of an eager call would differ from the engine's compiled step in the last bits."""
  invariant = nnx.merge(graphdef, weights)
  batch, length = token_ids.shape
  backend = XlaAttentionBackend(fixed_order=True, max_context=length)
  metadata, cache = scratch_step(invariant, batch, length, block_size, backend)
  flat_ids = token_ids.reshape(1, batch * length)
  positions = jnp.tile(jnp.arange(length, dtype=jnp.int32), batch)[None]
  replay = {}
  if routed_experts is not None:  # [B, T, M, k] -> the flat tokens' [1, B * T, M, k]
    replay["routed_experts"] = routed_experts.reshape(1, batch * length, *routed_experts.shape[2:])
  hidden, *_ = invariant(flat_ids, positions, cache, metadata, **replay)  # [1, B * T, E]
  hidden = hidden.reshape(batch, length, -1)[:, :-1]  # [B, T - 1, E]: each predicts the next
  logits = invariant.compute_logits(hidden.reshape(batch * (length - 1), -1))  # [B(T-1), V]
  scores = logits.astype(jnp.float32)
  following = token_ids[:, 1:].reshape(-1, 1)
  values = jnp.take_along_axis(scores, following, axis=1)
  values = values - fixed_logsumexp(scores, keepdims=True)
  return values.reshape(batch, length - 1)


def sequence_logits(model: Model, token_ids: jax.Array, *, block_size: int = 16) -> jax.Array:
  """The ``[B, T, V] float32`` logits of every position of whole sequences, in one compiled
  call of the model over a scratch pool of pages (`scratch_step`, XLA attention backend).
  Differentiable in the model's parameters (the attention's loop has a static length).

  Entry ``[b, t]`` scores the token that follows ``token_ids[b, :t + 1]``. The model's own
  arithmetic: with ``batch_invariant`` off, the values match the engine's to float32 rounding,
  not bit for bit (`token_logprobs` is the bitwise one).

  Args:
    model: a module implementing `jaxengine.models.Model`; it is not modified.
    token_ids: ``[B, T]`` integer ids, ``B, T >= 1``, ``T`` at most the model's
      ``max_position_embeddings``; pad shorter sequences at the end with any id of the
      vocabulary (a token only sees the tokens before it).
    block_size: positions per page of the scratch pool.

  Returns:
    ``[B, T, V] float32`` logits (the model's ``compute_logits``).

  Raises:
    ValueError: ``token_ids`` not ``[B, T]`` integers with ``B, T >= 1``, ids outside the
      vocabulary (checked when concrete), ``T`` above ``max_position_embeddings``, or
      ``block_size`` not a positive int.
  """
  token_ids = _checked_token_ids(model, token_ids, min_length=1)
  if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
    raise ValueError(f"block_size must be a positive int, got {block_size!r}")
  graphdef, weights = nnx.split(model)
  return _sequence_logits(graphdef, weights, token_ids.astype(jnp.int32), block_size)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _sequence_logits(graphdef, weights, token_ids: jax.Array, block_size: int) -> jax.Array:
  """`sequence_logits` of the module ``nnx.merge(graphdef, weights)``."""
  model = nnx.merge(graphdef, weights)
  batch, length = token_ids.shape
  backend = XlaAttentionBackend(max_context=length)  # a static loop: differentiable
  metadata, cache = scratch_step(model, batch, length, block_size, backend)
  positions = jnp.tile(jnp.arange(length, dtype=jnp.int32), batch)[None]  # [1, B * T]
  hidden, *_ = model(token_ids.reshape(1, batch * length), positions, cache, metadata)
  logits = model.compute_logits(hidden.reshape(batch * length, -1))  # [B * T, V]
  return logits.astype(jnp.float32).reshape(batch, length, -1)


def _checked_token_ids(model, token_ids, *, min_length: int) -> jax.Array:
  """``token_ids`` as an array, after the checks `token_ids` and `sequence_logits` share."""
  token_ids = jnp.asarray(token_ids)
  if token_ids.ndim != 2 or not jnp.issubdtype(token_ids.dtype, jnp.integer):
    raise ValueError(f"token_ids must be [B, T] integers, got {token_ids.dtype} {token_ids.shape}")
  batch, length = token_ids.shape
  if batch < 1 or length < min_length:
    raise ValueError(
      f"token_ids must be [B, T] with B >= 1 and T >= {min_length}, got {token_ids.shape}"
    )
  limit = getattr(model, "max_position_embeddings", None)
  if isinstance(limit, int) and length > limit:
    raise ValueError(f"token_ids has T={length} tokens, above max_position_embeddings={limit}")
  vocab_size = getattr(model, "vocab_size", None)
  if isinstance(vocab_size, int) and not isinstance(token_ids, jax.core.Tracer):
    ids = np.asarray(token_ids)
    outside = np.unique(ids[(ids < 0) | (ids >= vocab_size)])
    if outside.size:
      raise ValueError(
        f"token_ids holds ids outside [0, {vocab_size}): {outside[:8].tolist()} (pad with an id "
        "of the vocabulary, e.g. the EOS id, and mask the padding's logprobs yourself)"
      )
  return token_ids


def scratch_step(
  model: Model, batch: int, length: int, block_size: int, backend: AttentionBackend
) -> tuple[PagedAttentionMetadata, PagedKVCache]:
  """One ragged step holding ``batch`` whole sequences of ``length`` tokens, each in pages of
  its own (page 0 is the null page), and the empty scratch pool of pages it writes to: how a
  whole-sequence forward (a trainer's logprobs, a scorer) calls the model outside the engine.

  Args:
    model: the `Model` (its ``kv_cache_spec`` shapes the pages).
    batch: sequences ``B``; their tokens go to the model flat, ``[1, B * length]``, sequence by
      sequence, at positions ``0..length-1`` each.
    length: tokens per sequence.
    block_size: positions per page.
    backend: the pages' attention backend (e.g. `XlaAttentionBackend`).

  Returns:
    The step's `PagedAttentionMetadata` and the zero `PagedKVCache` of ``1 + B * ceil(length /
    block_size)`` pages.
  """
  pages_per_seq = -(-length // block_size)
  block_tables = 1 + np.arange(batch * pages_per_seq, dtype=np.int32).reshape(batch, -1)
  position = np.arange(length, dtype=np.int32)
  slots = block_tables[:, position // block_size] * block_size + position % block_size  # [B, T]
  metadata = PagedAttentionMetadata(
    slot_mapping=jnp.asarray(slots.reshape(-1)),
    block_tables=jnp.asarray(block_tables),
    query_start_loc=jnp.asarray(np.arange(batch + 1, dtype=np.int32) * length),
    seq_lens=jnp.full((batch,), length, jnp.int32),
    num_reqs=jnp.asarray(batch, jnp.int32),
  )
  cache = PagedKVCache.create(
    model.kv_cache_spec,
    backend,
    num_blocks=1 + batch * pages_per_seq,
    block_size=block_size,
  )
  return metadata, cache
