"""The gated delta rule over a ragged step's requests: token by token, or in chunks.

`jaxengine.models.gated_deltanet` runs, for each request of a step, the recurrence

  ``S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T``,  ``o_t = S_t^T q_t``

(per value head: ``S [Dk, Dv]``, decay ``a_t = exp(g_t)``, ``b_t`` the write strength), from each
request's state before the step. Two exact forms, over the step's flat tokens (``T``) and its
requests (``R``, each a contiguous run of tokens: `Rows`):

- `by_token`: iteration ``j`` computes the ``j``-th token of every request (as many iterations
  as the longest request has tokens); the form of decode steps.
- `by_chunk`: iteration ``j`` computes the ``j``-th chunk of ``C`` tokens of every request with
  matrix products, as many iterations as the longest request has chunks. Unrolling the
  recurrence over a chunk from its first state ``S_0`` (``G_t`` the chunk's cumulative log decay
  up to token ``t``) gives the write of each token, ``d_t = b_t (v_t - e^{G_t} S_0^T k_t -
  sum_{i<t} e^{G_t - G_i} (k_t . k_i) d_i)``: a unit lower-triangular system ``(I + A) D =
  B (V - e^G K S_0)`` solved at once; then ``o_t = e^{G_t} S_0^T q_t + sum_{i<=t} e^{G_t -
  G_i} (q_t . k_i) d_i`` and ``S_C = e^{G_C} S_0 + sum_i e^{G_C - G_i} k_i d_i^T``. The
  sequential work of a prefill of ``n`` tokens drops from ``n`` steps to ``n / C``, each a few
  ``[C, C]`` and ``[C, Dk] x [Dk, Dv]`` products (the form of Yang et al., 2024, for the delta
  rule, with the gates of Yang et al., 2025). It rounds differently from `by_token` (float32
  sums in another order) and its chunks start where the step starts, so a batch-invariant
  engine keeps `by_token`.

Both also return each request's states after chosen numbers of its tokens (`save_lens`, several
per request: the state a hybrid model's prefix caching saves, `jaxengine.core.state_snapshots`,
and the states after each draft token of a verify step, of which the one after the accepted
drafts is kept, `jaxengine.core.state_slots`).

References:
  Yang, Wang, Zhang, Shen, Kim, "Parallelizing Linear Transformers with the Delta Rule over
  Sequence Length", 2024. Yang, Kautz, Hatamizadeh, "Gated Delta Networks: Improving Mamba2
  with Delta Rule", 2025.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = [
  "CHUNK_SIZES",
  "DeltaRuleResult",
  "Rows",
  "by_chunk",
  "by_token",
  "causal_conv",
  "chunk_size",
  "conv_windows",
  "unit_lower_inverse",
]


#: Tokens per chunk of `by_chunk`, by platform: 64 on accelerators (a chunk's ``[C, C]``
#: products fill a TPU's matrix unit); on XLA:CPU 32, where the per-chunk products cost more
#: than a token's step saves (measured on 2 cores: a prefill of 512 tokens, 8 heads of 64 x 64,
#: 17.6 ms by token, 7.9 ms in chunks of 32, 11.6 ms in chunks of 64; at 64 tokens no gain).
CHUNK_SIZES = {"cpu": 32}


def chunk_size(platform: str | None = None) -> int:
  """`by_chunk`'s chunk on `platform` (default `jax.default_backend()`): `CHUNK_SIZES`, else 64."""
  return CHUNK_SIZES.get(platform or jax.default_backend(), 64)


class Rows(NamedTuple):
  """The requests of a step (``R``) over its flat tokens (``T``).

  Attributes:
    starts: ``[R] int32`` each request's first flat token.
    lengths: ``[R] int32`` its tokens this step (0: none).
    max_length: ``[] int32`` the most tokens of any request.
  """

  starts: jax.Array
  lengths: jax.Array
  max_length: jax.Array


class DeltaRuleResult(NamedTuple):
  """What either form returns.

  Attributes:
    out: ``[T, Hv, Dv] float32`` each token's output (zero on tokens of no request).
    state: ``[R, Hv, Dk, Dv] float32`` each request's state after its last token.
    saved: ``[R, M, Hv, Dk, Dv] float32`` its states after ``save_lens [R, M]`` tokens (its
      state before the step where a length is 0).
  """

  out: jax.Array
  state: jax.Array
  saved: jax.Array


#: ``x [R, Hv, Dk]`` times ``state [R, Hv, Dk, Dv]`` -> ``[R, Hv, Dv]``: an einsum, or a sum in a
#: fixed order for a batch-invariant engine.
TimesState = Callable[[jax.Array, jax.Array], jax.Array]


def _einsum_times_state(x: jax.Array, state: jax.Array) -> jax.Array:
  return jnp.einsum("rhk,rhkv->rhv", x, state)


def _window_index(rows: Rows, offsets: jax.Array, width: int, num_tokens: int) -> jax.Array:
  """Indices into ``concat([windows [R * (K - 1), C], mixed [T, C]])`` of the inputs at the
  given ``[R, ...]`` offsets from each request's first token (a negative offset: its window,
  ``-1`` the newest input before the step)."""
  row = jnp.arange(rows.starts.shape[0]).reshape(-1, *([1] * (offsets.ndim - 1)))
  from_window = row * width + width + offsets
  from_step = rows.starts.reshape(row.shape) + offsets + rows.starts.shape[0] * width
  index = jnp.where(offsets < 0, from_window, from_step)
  return jnp.clip(index, 0, rows.starts.shape[0] * width + num_tokens - 1)


def causal_conv(
  mixed: jax.Array,
  windows: jax.Array,
  taps: jax.Array,
  rows: Rows,
  token_rows: jax.Array,
  total: Callable[..., jax.Array] = jnp.sum,
) -> jax.Array:
  """Each token's causal depthwise convolution over its request's last ``K`` inputs.

  Args:
    mixed: ``[T, C]`` the step's inputs.
    windows: ``[R, K - 1, C]`` each request's inputs before the step, oldest first.
    taps: ``[K, C] float32``, oldest input first.
    rows: the step's `Rows`.
    token_rows: ``[T] int32`` each token's request (any for tokens of none).
    total: the sum over the taps (`jnp.sum`, or a fixed-order sum).

  Returns:
    ``[T, C] float32`` the convolution (before its activation).
  """
  width, num_tokens = windows.shape[1], mixed.shape[0]
  flat = jnp.arange(num_tokens)
  back = jnp.arange(-width, 1)  # [K]: oldest input first
  offsets = (flat - rows.starts[token_rows])[:, None] + back  # [T, K] from the request's start
  index = jnp.where(
    offsets < 0,
    token_rows[:, None] * width + width + offsets,  # in its window
    windows.shape[0] * width + flat[:, None] + back,  # a token of the step
  )
  inputs = jnp.concatenate([windows.reshape(-1, windows.shape[-1]), mixed.astype(windows.dtype)])
  index = jnp.clip(index, 0, inputs.shape[0] - 1)
  return total(inputs[index].astype(jnp.float32) * taps, axis=1)


def conv_windows(mixed: jax.Array, windows: jax.Array, rows: Rows, ends: jax.Array) -> jax.Array:
  """``[R, ..., K - 1, C]`` each request's last ``K - 1`` inputs before its token ``ends [R,
  ...]`` (its window after ``ends`` tokens of the step; ``ends = 0``: the window before it)."""
  width = windows.shape[1]
  offsets = ends[..., None] + jnp.arange(-width, 0)  # [R, ..., K - 1]
  inputs = jnp.concatenate([windows.reshape(-1, windows.shape[-1]), mixed.astype(windows.dtype)])
  return inputs[_window_index(rows, offsets, width, mixed.shape[0])]


def unit_lower_inverse(strict: jax.Array) -> jax.Array:
  """``(I + A)^-1`` of strictly lower-triangular ``A [..., n, n]`` (``n`` a power of two), by
  halves: ``[[L11, 0], [L21, L22]]^-1 = [[X11, 0], [-X22 L21 X11, X22]]`` with both halves'
  inverses in one call, so ``log2(n)`` levels of matrix products (XLA:CPU's triangular solve
  runs row by row, and a series in powers of ``A`` loses precision)."""
  n = strict.shape[-1]
  if n & (n - 1):
    raise ValueError(f"the chunk must be a power of two, got {n}")
  if n == 1:
    return jnp.ones_like(strict)
  h = n // 2
  halves = unit_lower_inverse(jnp.stack([strict[..., :h, :h], strict[..., h:, h:]]))
  upper, lower = halves[0], halves[1]
  corner = -lower @ strict[..., h:, :h] @ upper
  top = jnp.concatenate([upper, jnp.zeros_like(upper)], axis=-1)
  return jnp.concatenate([top, jnp.concatenate([corner, lower], axis=-1)], axis=-2)


def by_token(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  g: jax.Array,
  beta: jax.Array,
  state: jax.Array,
  rows: Rows,
  save_lens: jax.Array,
  times_state: TimesState = _einsum_times_state,
) -> DeltaRuleResult:
  """The recurrence token by token, the step's requests side by side (module docstring).

  Args:
    q, k: ``[T, Hv, Dk] float32`` (per value head; ``q`` scaled, both L2-normalised).
    v: ``[T, Hv, Dv] float32``.
    g: ``[T, Hv] float32`` log decays (``<= 0``); beta: ``[T, Hv] float32``.
    state: ``[R, Hv, Dk, Dv] float32`` each request's state before the step.
    rows: the step's `Rows`.
    save_lens: ``[R, M] int32`` tokens after which each of `DeltaRuleResult.saved` is taken,
      at most the request's tokens (0: none, the entry is its state before the step).
    times_state: the state's product with a key or query.
  """
  num_tokens = q.shape[0]
  out = jnp.zeros((num_tokens + 1, *v.shape[1:]), jnp.float32)  # row T: inactive rows' writes

  def token_j(j, carry):
    state, saved, out = carry
    active = j < rows.lengths  # [R]
    index = jnp.minimum(rows.starts + j, num_tokens - 1)
    decayed = state * jnp.exp(g[index])[:, :, None, None]
    write = (v[index] - times_state(k[index], decayed)) * beta[index][:, :, None]
    new = decayed + k[index][..., None] * write[..., None, :]
    state = jnp.where(active[:, None, None, None], new, state)
    saves = j + 1 == save_lens  # [R, M]
    saved = jax.lax.cond(  # most tokens save nothing: skip the [R, M] states' select
      jnp.any(saves),
      lambda: jnp.where(saves[..., None, None, None], state[:, None], saved),
      lambda: saved,
    )
    out = out.at[jnp.where(active, index, num_tokens)].set(times_state(q[index], new))
    return state, saved, out

  saved = jnp.broadcast_to(state[:, None], (*save_lens.shape, *state.shape[1:]))
  state, saved, out = jax.lax.fori_loop(0, rows.max_length, token_j, (state, saved, out))
  return DeltaRuleResult(out[:num_tokens], state, saved)


def by_chunk(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  g: jax.Array,
  beta: jax.Array,
  state: jax.Array,
  rows: Rows,
  save_lens: jax.Array,
  chunk: int,
) -> DeltaRuleResult:
  """The recurrence `chunk` tokens at a time, the step's requests side by side (module
  docstring; arguments as `by_token`)."""
  num_tokens = q.shape[0]
  out = jnp.zeros((num_tokens + 1, *v.shape[1:]), jnp.float32)
  within = jnp.arange(chunk)
  lower = within[:, None] > within[None, :]  # [C, C] strictly lower: i < t
  causal = within[:, None] >= within[None, :]

  def chunk_j(j, carry):
    state, saved, out = carry
    position = j * chunk + within  # [C] within each request
    valid = position[None, :] < rows.lengths[:, None]  # [R, C]
    index = jnp.minimum(rows.starts[:, None] + position, num_tokens - 1)  # [R, C]
    mask = valid[..., None]
    qc = jnp.where(mask[..., None], q[index], 0.0)  # [R, C, Hv, Dk]
    kc = jnp.where(mask[..., None], k[index], 0.0)
    vc = jnp.where(mask[..., None], v[index], 0.0)
    bc = jnp.where(mask, beta[index], 0.0)  # [R, C, Hv]
    logs = jnp.cumsum(jnp.where(mask, g[index], 0.0), axis=1)  # [R, C, Hv]: G_t
    logs = jnp.moveaxis(logs, 1, 2)  # [R, Hv, C]
    gaps = logs[..., :, None] - logs[..., None, :]  # [R, Hv, C, C]: G_t - G_i
    decays = jnp.exp(jnp.where(causal, gaps, -jnp.inf))  # zero above the diagonal
    keys = jnp.einsum("rthk,rihk->rhti", kc, kc)
    system = jnp.where(lower, jnp.moveaxis(bc, 1, 2)[..., :, None] * decays * keys, 0.0)
    start = jnp.exp(logs)[..., None] * jnp.einsum("rthk,rhkv->rhtv", kc, state)  # e^G K S_0
    rhs = jnp.moveaxis(bc, 1, 2)[..., None] * (jnp.moveaxis(vc, 1, 2) - start)  # [R, Hv, C, Dv]
    writes = unit_lower_inverse(system) @ rhs  # (I + A)^-1 B (V - e^G K S_0)
    scores = jnp.einsum("rthk,rihk->rhti", qc, kc) * decays  # causal, decayed
    first = jnp.exp(logs)[..., None] * jnp.einsum("rthk,rhkv->rhtv", qc, state)
    outputs = first + jnp.einsum("rhti,rhiv->rhtv", scores, writes)  # [R, Hv, C, Dv]

    def state_after(t):  # [R] last token index within the chunk -> [R, Hv, Dk, Dv]
      last = jnp.take_along_axis(logs, t[:, None, None], axis=2)  # [R, Hv, 1]: G_t
      weights = jnp.where(within <= t[:, None, None], jnp.exp(last - logs), 0.0)  # [R, Hv, C]
      grown = jnp.einsum("rihk,rhiv->rhkv", kc, weights[..., None] * writes)
      return jnp.exp(last)[..., None] * state + grown

    offset = save_lens - j * chunk  # [R, M]: the saved states' tokens into this chunk
    in_chunk = (offset >= 1) & (offset <= chunk)
    saved = jax.lax.cond(  # most chunks save nothing: skip the [R, M] states
      jnp.any(in_chunk),
      lambda: jnp.where(
        in_chunk[..., None, None, None],
        jax.vmap(state_after, in_axes=1, out_axes=1)(jnp.clip(offset - 1, 0, chunk - 1)),
        saved,
      ),
      lambda: saved,
    )
    state = state_after(jnp.full(state.shape[:1], chunk - 1))  # padding tokens change nothing
    flat_out = jnp.moveaxis(outputs, 1, 2)  # [R, C, Hv, Dv]
    out = out.at[jnp.where(valid, index, num_tokens)].set(flat_out)
    return state, saved, out

  num_chunks = (rows.max_length + chunk - 1) // chunk
  saved = jnp.broadcast_to(state[:, None], (*save_lens.shape, *state.shape[1:]))
  state, saved, out = jax.lax.fori_loop(0, num_chunks, chunk_j, (state, saved, out))
  return DeltaRuleResult(out[:num_tokens], state, saved)
