"""The Gated DeltaNet layer of Qwen3.5 and the per-request recurrent state it keeps.

A linear-attention layer keeps no keys and values per position: each sequence carries a fixed-size
state instead, updated token by token (Yang et al., 2025). For one token with input ``x``:

- ``qkv = conv(in_proj_qkv(x))``: a causal depthwise convolution of width ``K`` over the last
  ``K`` inputs of the sequence (``C = 2 Hk Dk + Hv Dv`` channels), then SiLU; split into
  ``q [Hk, Dk]``, ``k [Hk, Dk]``, ``v [Hv, Dv]``; ``q`` and ``k`` L2-normalised, each key head
  repeated for the ``Hv / Hk`` value heads it serves, ``q`` scaled by ``Dk ** -0.5``;
- ``g = -exp(A_log) * softplus(in_proj_a(x) + dt_bias)`` (a log decay per value head) and
  ``beta = sigmoid(in_proj_b(x))``;
- the gated delta rule on the head's state ``S [Dk, Dv]``: ``S *= exp(g)``,
  ``S += k (beta (v - k S))^T``, output ``o = q S``;
- ``out_proj(rmsnorm(o) * w * silu(in_proj_z(x)))`` (the gated RMSNorm, a plain ``w``).

Channel order: a checkpoint's ``in_proj_qkv`` and ``conv1d`` rows are ``[q | k | v]``; the model
keeps them grouped by key head instead (`jaxengine.models.qwen3_5_checkpoints.KeyHeadGroups`
reorders them on load and back on export): key head ``g``'s group is its ``Dk`` query channels,
its ``Dk`` key channels, then the ``Hv / Hk`` value heads it serves. So on a tensor-parallel mesh
an even split of the ``C`` channels (the projection's rows, the taps, the convolution windows) is a
split by heads, with each key head beside its own value heads: ``t`` must divide ``Hk``.

The state of a sequence is therefore ``K - 1`` convolution inputs (``[K - 1, C]``) and the delta
rule's ``[Hv, Dk, Dv]`` float32 matrices, per linear layer (`RecurrentStateSpec`). The engine keeps
them in a pool of slots (`RecurrentState`, beside the pages of the full-attention layers in
`jaxengine.models.kv_pages.PagedKVCache`'s ``recurrent``), one slot per running request
(`PagedAttentionMetadata.state_slots`); slot 0 is the null slot padding tokens write to. A token
at position 0 starts from a zero state, so a new request (or one recomputed after preemption)
needs no host-side reset, and a later prefill chunk or decode reads what the earlier one wrote.

The step's requests run side by side (`StepRows`): each request's state is gathered from its
slot once, the convolution of every token is computed at once (its inputs gathered from the
request's earlier tokens or its window), and the delta rule runs in `jaxengine.models.delta_rule`:
token by token (iteration ``j`` computes the ``j``-th token of every request; a step of decodes
is one iteration, and a batch-invariant engine always runs this form), or, when the longest
request of the step has more tokens than a chunk, a chunk of ``C`` tokens of every request per
iteration (``n / C`` iterations for a prefill of ``n``); the states are scattered back to their
slots at the end.

References:
  Yang, Kautz, Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta Rule", 2025.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxengine.models import delta_rule
from jaxengine.models.layers import normal_out_in, project
from jaxengine.models.lora import LayerLoRA, add_lora
from jaxengine.models.paged_attention import PagedAttentionMetadata
from jaxengine.reductions import fixed_sum

__all__ = [
  "GatedDeltaNet",
  "GatedRMSNorm",
  "RecurrentState",
  "RecurrentStateSpec",
  "StepRows",
  "key_head_order",
]

#: The state slot padding tokens read and write; no request owns it.
NULL_STATE_SLOT = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class RecurrentStateSpec:
  """What a hybrid model keeps per request and linear layer (its state's shapes, no arrays).

  Attributes:
    num_layers: linear layers (each has its own state).
    conv_dim: ``C``, the convolution's channels.
    conv_width: ``K - 1``, the convolution inputs kept.
    num_heads: ``Hv``, value heads.
    key_dim: ``Dk``.
    value_dim: ``Dv``.
    dtype: the convolution window's dtype (the model's); the delta rule's state is float32.
    stacked: the pool keeps every linear layer's slots in one array per part, ``[num_layers,
      S, ...]`` (a model whose layers run under `jax.lax.scan`:
      `jaxengine.models.qwen3_5_scan`); False: an array per layer.
  """

  num_layers: int
  conv_dim: int
  conv_width: int
  num_heads: int
  key_dim: int
  value_dim: int
  dtype: Any = jnp.float32
  stacked: bool = False

  @property
  def bytes_per_slot(self) -> int:
    """Device bytes of one request's state, every linear layer together."""
    conv = self.conv_width * self.conv_dim * jnp.dtype(self.dtype).itemsize
    delta = self.num_heads * self.key_dim * self.value_dim * 4
    return self.num_layers * (conv + delta)

  def create(self, num_slots: int) -> RecurrentState:
    """A zero pool of `num_slots` slots (the null slot 0 included); each array its own buffer.

    Raises:
      ValueError: `num_slots < 2`.
    """
    if num_slots < 2:
      raise ValueError(f"num_slots must be >= 2 (the null slot and one more), got {num_slots}")
    conv = (num_slots, self.conv_width, self.conv_dim)
    delta = (num_slots, self.num_heads, self.key_dim, self.value_dim)
    if self.stacked:  # one array per part, the layers on a leading axis
      layers = (self.num_layers,)
      return RecurrentState(
        conv=(jnp.zeros(layers + conv, self.dtype),),
        delta=(jnp.zeros(layers + delta, jnp.float32),),
      )
    return RecurrentState(
      conv=tuple(jnp.zeros(conv, self.dtype) for _ in range(self.num_layers)),
      delta=tuple(jnp.zeros(delta, jnp.float32) for _ in range(self.num_layers)),
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class RecurrentState:
  """The pool of recurrent state slots of every linear layer (``S`` slots, slot 0 the null one).

  Attributes:
    conv: per linear layer, ``[S, K - 1, C]`` the last convolution inputs of each slot's sequence
      (a stacked pool, `RecurrentStateSpec.stacked`: one ``[Ll, S, K - 1, C]`` array for the
      ``Ll`` linear layers).
    delta: per linear layer, ``[S, Hv, Dk, Dv] float32`` each slot's delta-rule state (stacked:
      one ``[Ll, S, Hv, Dk, Dv]``).
  """

  conv: tuple[jax.Array, ...]
  delta: tuple[jax.Array, ...]

  @property
  def num_slots(self) -> int:
    """``S``, the null slot included (each layer's, in a stacked pool too)."""
    return int(self.delta[0].shape[-4]) if self.delta else 0

  @property
  def is_stacked(self) -> bool:
    """Whether the layers' slots are stacked on a leading axis (`RecurrentStateSpec.stacked`)."""
    return bool(self.delta) and self.delta[0].ndim == 5


class StepRows(NamedTuple):
  """Where each request of a ragged step has its tokens and its state (``R`` requests).

  Attributes:
    starts: ``[R] int32`` the flat index of each request's first token.
    lengths: ``[R] int32`` its tokens this step (0 for padding requests).
    slots: ``[R] int32`` its state slot (`NULL_STATE_SLOT` for padding requests).
    fresh: ``[R] bool`` its first token is at position 0: it starts from a zero state.
    max_length: ``[] int32`` the most tokens of any request (the loop's iterations).
    sources: None (`slots`), or ``[R] int32`` the slot its state is read from (its slot, or
      after a prefix-cache hit the hit's snapshot slot: `jaxengine.core.state_snapshots`; in a
      verify step the slot that holds its state after its accepted tokens,
      `jaxengine.core.state_slots`).
    snapshots: None (nothing saved), or ``[R, M] int32`` slots its state is also saved into,
      each after as many tokens as `snapshot_lens` says (`NULL_STATE_SLOT`: none): a prefix
      cache snapshot, then a verify step's state after each of its tokens but the last.
    snapshot_lens: None, or ``[R, M] int32`` (0: none saved).
  """

  starts: jax.Array
  lengths: jax.Array
  slots: jax.Array
  fresh: jax.Array
  max_length: jax.Array
  sources: jax.Array | None = None
  snapshots: jax.Array | None = None
  snapshot_lens: jax.Array | None = None

  @classmethod
  def of(cls, metadata: PagedAttentionMetadata, positions: jax.Array) -> StepRows:
    """The rows of a step from its metadata (``state_slots`` set) and ``[..., T]`` positions.

    ``state_slots`` is ``[R]`` (each row's slot) or, with prefix caching or in a verify step,
    ``[R, 4 + k]`` (`jaxengine.worker.step_inputs`): its slot, source, snapshot slot and
    snapshot length, then ``k`` draft slots (none outside a verify step), the ``j``-th saving
    its state after ``j + 1`` tokens of the step (0: none).

    Raises:
      ValueError: (at trace time) metadata without ``state_slots``.
    """
    if metadata.state_slots is None:
      raise ValueError("a hybrid model's step needs PagedAttentionMetadata.state_slots")
    flat = positions.reshape(-1)
    starts = metadata.query_start_loc[:-1]
    lengths = metadata.query_lens
    is_real = jnp.arange(starts.shape[0]) < metadata.num_reqs
    routes = metadata.state_slots.astype(jnp.int32)
    routes = routes[:, None] if routes.ndim == 1 else routes
    own = jnp.where(is_real, routes[:, 0], NULL_STATE_SLOT)
    rows = cls(
      starts=starts,
      lengths=lengths,
      slots=own,
      fresh=flat[jnp.minimum(starts, flat.shape[0] - 1)] == 0,
      max_length=jnp.max(lengths),
      sources=own,
    )
    if routes.shape[1] == 1:
      return rows
    drafts = routes[:, 4:]  # [R, k]: the j-th saves the state after j + 1 tokens
    after = jnp.where(drafts != NULL_STATE_SLOT, jnp.arange(1, drafts.shape[1] + 1), 0)
    snapshots = jnp.concatenate([routes[:, 2:3], drafts], axis=1)  # [R, 1 + k]
    lens = jnp.concatenate([routes[:, 3:4], after], axis=1)
    return cls(
      *rows[:5],
      sources=jnp.where(is_real, routes[:, 1], NULL_STATE_SLOT),
      snapshots=jnp.where(is_real[:, None], snapshots, NULL_STATE_SLOT),
      snapshot_lens=jnp.where(is_real[:, None], lens, 0),
    )

  def offset(self, first_slot: jax.Array | int) -> StepRows:
    """These rows with every slot (own, source, snapshot) moved by `first_slot`: the slots of
    one layer of a stacked pool seen as ``[Ll S, ...]`` (layer ``l``'s slots start at ``l S``;
    its null slot ``l S`` takes the padding rows)."""
    move = lambda slots: None if slots is None else slots + first_slot
    return self._replace(
      slots=self.slots + first_slot, sources=move(self.sources), snapshots=move(self.snapshots)
    )


class GatedRMSNorm(nnx.Module):
  """``rmsnorm(x) * w * silu(z)`` over a value head's ``Dv`` features (the normalisation in
  float32, ``w`` plain, initialised to 1)."""

  def __init__(self, dim: int, *, eps: float):
    self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))
    self.eps = eps
    #: The mean square summed in a fixed order (`jaxengine.reductions.fixed_sum`).
    self.batch_invariant = False

  def __call__(self, x: jax.Array, z: jax.Array) -> jax.Array:
    """``[..., Dv]`` `x` and gate `z` -> ``[..., Dv]`` in `x`'s dtype."""
    x32 = x.astype(jnp.float32)
    squares = jnp.square(x32)
    if self.batch_invariant:
      mean_square = fixed_sum(squares, keepdims=True) / x32.shape[-1]
    else:
      mean_square = jnp.mean(squares, axis=-1, keepdims=True)
    normed = x32 * jax.lax.rsqrt(mean_square + self.eps)
    y = self.scale[...] * normed.astype(x.dtype).astype(jnp.float32)
    return (y * jax.nn.silu(z.astype(jnp.float32))).astype(x.dtype)


def key_head_order(
  num_key_heads: int, key_dim: int, num_value_heads: int, value_dim: int
) -> np.ndarray:
  """``[C] int`` the checkpoint channel (``[q | k | v]``) of each of the model's channels,
  grouped by key head (the module docstring's "Channel order")."""
  hk = num_key_heads
  q = np.arange(hk * key_dim).reshape(hk, key_dim)
  k = q + hk * key_dim
  v = 2 * hk * key_dim + np.arange(num_value_heads * value_dim).reshape(hk, -1)
  return np.concatenate([q, k, v], axis=1).reshape(-1)


def _l2_normalize(x: jax.Array, total=jnp.sum, eps: float = 1e-6) -> jax.Array:
  return x * jax.lax.rsqrt(total(x * x, axis=-1, keepdims=True) + eps)


def _fixed_times_state(x: jax.Array, state: jax.Array) -> jax.Array:
  """``[R, Hv, Dk]`` times ``[R, Hv, Dk, Dv]``, summed over ``Dk`` in a fixed order."""
  return fixed_sum(x[..., None] * state, axis=-2)


class GatedDeltaNet(nnx.Module):
  """One Gated DeltaNet layer (module docstring) over the step's flat tokens.

  Attributes:
    w_qkv: ``[C, E]`` (channels grouped by key head: module docstring); w_z: ``[Hv Dv, E]``;
      w_b, w_a: ``[Hv, E]``; w_out: ``[E, Hv Dv]``
      (``[out, in]`` layout).
    conv: ``[C, K]`` the depthwise convolution's taps (grouped as ``w_qkv``), oldest input first.
    a_log, dt_bias: ``[Hv] float32`` the decay's parameters.
    norm: the `GatedRMSNorm`.
    scales: row scales of the quantized projections (`jaxengine.models.quantization`).
    batch_invariant: projections a fixed number of rows at a time and every sum of the
      recurrence in a fixed order (`jaxengine.reductions.fixed_sum`: the convolution, the
      L2 norms, the state's products with keys and queries), so a token's bits do not depend on
      the other requests of the step nor on their number.
  """

  #: The five projections (``[out, in]``: scales per output channel); the convolution's taps,
  #: the decay parameters and the norm stay in the model dtype.
  QUANTIZABLE: ClassVar[dict[str, tuple[int, ...]]] = dict.fromkeys(
    ("w_qkv", "w_z", "w_b", "w_a", "w_out"), (1,)
  )

  def __init__(self, config: Any, *, dtype, rngs: nnx.Rngs):
    e, c = config.hidden_size, config.conv_dim
    hv, dv = config.linear_num_value_heads, config.linear_value_head_dim
    self.num_key_heads = config.linear_num_key_heads
    self.num_value_heads = hv
    self.key_dim = config.linear_key_head_dim
    self.value_dim = dv
    self.w_qkv = nnx.Param(normal_out_in(rngs, (c,), (e,), dtype))
    self.w_z = nnx.Param(normal_out_in(rngs, (hv * dv,), (e,), dtype))
    self.w_b = nnx.Param(normal_out_in(rngs, (hv,), (e,), dtype))
    self.w_a = nnx.Param(normal_out_in(rngs, (hv,), (e,), dtype))
    width = config.linear_conv_kernel_dim
    self.conv = nnx.Param(normal_out_in(rngs, (c,), (width,), dtype))
    decay = jax.random.uniform(rngs.params(), (hv,), jnp.float32, 1.0, 16.0)
    self.a_log = nnx.Param(jnp.log(decay))
    self.dt_bias = nnx.Param(jnp.ones((hv,), jnp.float32))
    self.norm = GatedRMSNorm(dv, eps=config.rms_norm_eps)
    self.w_out = nnx.Param(normal_out_in(rngs, (e,), (hv * dv,), dtype))
    self.scales: nnx.Dict[nnx.Param] = nnx.Dict()
    self.batch_invariant = False

  def split_qkv(self, qkv: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``[R, C]`` channels in the grouped order -> ``q [R, Hk, Dk]``, ``k [R, Hk, Dk]``,
    ``v [R, Hv, Dv]`` (key head ``g``'s group: its query, its key, then its ``Hv / Hk`` value
    heads ``g Hv / Hk ...``; the module docstring's "Channel order")."""
    hk, dk, dv = self.num_key_heads, self.key_dim, self.value_dim
    grouped = qkv.reshape(-1, hk, 2 * dk + self.num_value_heads // hk * dv)
    v = grouped[..., 2 * dk :].reshape(-1, self.num_value_heads, dv)
    return grouped[..., :dk], grouped[..., dk : 2 * dk], v

  def _qkv(self, x: jax.Array, lora: LayerLoRA | None) -> jax.Array:
    """``[T, E]`` -> ``[T, C]`` the projection to q, k and v in the grouped channel order; a
    LoRA update of ``in_proj_qkv`` (its ``B`` in the checkpoint's ``[q | k | v]`` order, as
    PEFT saves it) is computed whole and reordered (`key_head_order`)."""
    mixed = project(self, "w_qkv", x)
    if lora is None or "in_proj_qkv" not in lora.weights:
      return mixed
    update = add_lora(jnp.zeros_like(mixed), x, lora, "in_proj_qkv", self.batch_invariant)
    order = key_head_order(self.num_key_heads, self.key_dim, self.num_value_heads, self.value_dim)
    return mixed + update[..., order]

  def __call__(
    self,
    x: jax.Array,
    conv_state: jax.Array,
    delta_state: jax.Array,
    rows: StepRows,
    lora: LayerLoRA | None = None,
  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Runs the layer over the step's requests side by side, each on its own state slot.

    Args:
      x: ``[..., E]`` normalised hidden states of the ``T`` flat tokens.
      conv_state: ``[S, K - 1, C]`` this layer's convolution windows (`RecurrentState.conv`).
      delta_state: ``[S, Hv, Dk, Dv] float32`` its delta-rule states.
      rows: the step's `StepRows`.
      lora: this layer's LoRA adapters (`jaxengine.models.lora`; PEFT's names ``in_proj_qkv``,
        ``in_proj_z``, ``in_proj_b``, ``in_proj_a``, ``out_proj``), or None.

    Returns:
      ``([..., E] output, conv_state, delta_state)`` with each request's slot holding its
      state after its last token of the step (zero outputs on padding tokens).
    """
    lead, e = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, e)  # [T, E]
    num_tokens = flat.shape[0]
    hk, hv, dk, dv = self.num_key_heads, self.num_value_heads, self.key_dim, self.value_dim
    fixed = self.batch_invariant
    mixed = self._qkv(flat, lora)  # [T, C], grouped by key head (`split_qkv`)
    z = add_lora(project(self, "w_z", flat), flat, lora, "in_proj_z", fixed).reshape(-1, hv, dv)
    b = add_lora(project(self, "w_b", flat), flat, lora, "in_proj_b", fixed)
    beta = jax.nn.sigmoid(b).astype(jnp.float32)  # [T, Hv]
    a = add_lora(project(self, "w_a", flat), flat, lora, "in_proj_a", fixed).astype(jnp.float32)
    g = -jnp.exp(self.a_log[...]) * jax.nn.softplus(a + self.dt_bias[...])  # [T, Hv]
    taps = self.conv[...].T.astype(jnp.float32)  # [K, C]
    total = fixed_sum if fixed else jnp.sum
    fresh, sources = rows.fresh[:, None, None], rows.slots if rows.sources is None else rows.sources
    windows = jnp.where(fresh, 0, conv_state[sources])  # [R, K - 1, C]
    state = jnp.where(fresh[..., None], 0.0, delta_state[sources])  # [R, Hv, Dk, Dv]
    steps = delta_rule.Rows(rows.starts, rows.lengths, rows.max_length)
    token_rows = jnp.searchsorted(rows.starts, jnp.arange(num_tokens), side="right") - 1
    conv = delta_rule.causal_conv(mixed, windows, taps, steps, token_rows, total)
    q, k, v = self.split_qkv(jax.nn.silu(conv).astype(x.dtype).astype(jnp.float32))
    q, k = _l2_normalize(q, total), _l2_normalize(k, total)
    q = jnp.repeat(q, hv // hk, axis=1) * dk**-0.5  # [T, Hv, Dk]
    k = jnp.repeat(k, hv // hk, axis=1)
    save_lens = rows.snapshot_lens
    if save_lens is None:  # nothing saved: one length 0
      save_lens = jnp.zeros_like(rows.lengths)[:, None]
    args = (q, k, v, g, beta, state, steps, save_lens)
    if fixed:  # the same order of sums whatever the step holds: token by token
      result = delta_rule.by_token(*args, times_state=_fixed_times_state)
    else:  # chunks for prefills longer than a chunk (module docstring of `delta_rule`)
      chunk = delta_rule.chunk_size()
      result = jax.lax.cond(
        rows.max_length > chunk,
        lambda: delta_rule.by_chunk(*args, chunk),
        lambda: delta_rule.by_token(*args),
      )
    conv_state = conv_state.at[rows.slots].set(
      delta_rule.conv_windows(mixed, windows, steps, rows.lengths)
    )
    delta_state = delta_state.at[rows.slots].set(result.state)
    if rows.snapshots is not None:  # rows saving nothing write the null slot
      saved = delta_rule.conv_windows(mixed, windows, steps, save_lens)  # [R, M, K - 1, C]
      into = rows.snapshots.reshape(-1)
      conv_state = conv_state.at[into].set(saved.reshape(-1, *saved.shape[2:]))
      delta_state = delta_state.at[into].set(result.saved.reshape(-1, *result.saved.shape[2:]))
    out = result.out
    out = self.norm(out[:num_tokens].astype(x.dtype), z).reshape(-1, hv * dv)
    out = add_lora(project(self, "w_out", out), out, lora, "out_proj", fixed)
    return out.reshape(*lead, e), conv_state, delta_state


def state_spec(config: Any, dtype) -> RecurrentStateSpec:
  """The `RecurrentStateSpec` of a Qwen3.5 config's linear layers in the model `dtype`."""
  return RecurrentStateSpec(
    num_layers=len(config.linear_layers),
    conv_dim=config.conv_dim,
    conv_width=config.linear_conv_kernel_dim - 1,
    num_heads=config.linear_num_value_heads,
    key_dim=config.linear_key_head_dim,
    value_dim=config.linear_value_head_dim,
    dtype=jnp.dtype(dtype),
    stacked=bool(getattr(config, "scan_layers", False)),
  )
