"""The gated delta rule's two forms (`jaxengine.models.delta_rule`) against a per-request NumPy
recurrence, over ragged rows: requests of many tokens, one, none, and several saved states
mid-step (in one chunk and across chunks, as a prefix-cache snapshot and a verify step's draft
states are)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxengine.models import delta_rule

H, DK, DV, CONV, K = 3, 8, 6, 5, 4
LENGTHS = np.array([13, 1, 0, 21], np.int32)
STARTS = np.array([0, 13, 14, 14], np.int32)
NUM_TOKENS = 40  # 5 padding tokens after the requests'
#: Per request, the tokens after which states are saved (0: none).
SAVE_LENS = np.array([[8, 1, 3], [1, 0, 1], [0, 0, 0], [16, 2, 21]], np.int32)


def _inputs(seed: int):
  rng = np.random.default_rng(seed)
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  q = unit(rng.normal(size=(NUM_TOKENS, H, DK))) * DK**-0.5
  k = unit(rng.normal(size=(NUM_TOKENS, H, DK)))
  v = rng.normal(size=(NUM_TOKENS, H, DV))
  g = -rng.uniform(0.01, 1.0, size=(NUM_TOKENS, H))
  beta = rng.uniform(0, 1, size=(NUM_TOKENS, H))
  state = rng.normal(size=(len(LENGTHS), H, DK, DV))
  return [jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta, state)]


def _reference(q, k, v, g, beta, state):
  """Each request token by token in float64: outputs, final and saved states."""
  out, final = np.zeros(v.shape), state.astype(np.float64).copy()
  saved = np.repeat(state.astype(np.float64)[:, None], SAVE_LENS.shape[1], axis=1)
  for r, (start, length) in enumerate(zip(STARTS, LENGTHS)):
    s = final[r]
    for t in range(start, start + length):
      s = s * np.exp(g[t])[:, None, None]
      write = (v[t] - np.einsum("hk,hkv->hv", k[t], s)) * beta[t][:, None]
      s = s + k[t][:, :, None] * write[:, None, :]
      out[t] = np.einsum("hk,hkv->hv", q[t], s)
      saved[r, t - start + 1 == SAVE_LENS[r]] = s
    final[r] = s
  return out, final, saved


ROWS = delta_rule.Rows(jnp.asarray(STARTS), jnp.asarray(LENGTHS), jnp.asarray(LENGTHS.max()))


@pytest.mark.parametrize("chunk", [None, 1, 4, 16, 32])
def test_both_forms_follow_the_recurrence(chunk):
  q, k, v, g, beta, state = _inputs(0)
  want = _reference(*(np.asarray(x) for x in (q, k, v, g, beta, state)))
  args = (q, k, v, g, beta, state, ROWS, jnp.asarray(SAVE_LENS))
  got = delta_rule.by_token(*args) if chunk is None else delta_rule.by_chunk(*args, chunk)
  for name, have, expected in zip(("out", "state", "saved"), got, want):
    np.testing.assert_allclose(np.asarray(have), expected, atol=2e-5, err_msg=name)
  assert not np.asarray(got.out)[STARTS[-1] + LENGTHS[-1] :].any()  # padding tokens: zero


def test_the_convolution_and_windows_follow_each_requests_inputs():
  rng = np.random.default_rng(1)
  mixed = jnp.asarray(rng.normal(size=(NUM_TOKENS, CONV)), jnp.float32)
  windows = jnp.asarray(rng.normal(size=(len(LENGTHS), K - 1, CONV)), jnp.float32)
  taps = jnp.asarray(rng.normal(size=(K, CONV)), jnp.float32)
  token_rows = np.zeros(NUM_TOKENS, np.int32)
  for r, (start, length) in enumerate(zip(STARTS, LENGTHS)):
    token_rows[start : start + length] = r
  conv = np.asarray(delta_rule.causal_conv(mixed, windows, taps, ROWS, jnp.asarray(token_rows)))
  ends = np.array([[13, 2], [1, 0], [0, 0], [5, 21]], np.int32)
  after = np.asarray(delta_rule.conv_windows(mixed, windows, ROWS, jnp.asarray(ends)))
  for r, (start, length) in enumerate(zip(STARTS, LENGTHS)):
    inputs = np.concatenate([np.asarray(windows)[r], np.asarray(mixed)[start : start + length]])
    for p in range(length):
      want = (inputs[p : p + K] * np.asarray(taps)).sum(0)
      np.testing.assert_allclose(conv[start + p], want, atol=1e-5)
    for m, end in enumerate(ends[r]):
      np.testing.assert_array_equal(after[r, m], inputs[end : end + K - 1])
