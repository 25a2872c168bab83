"""An engine-free reference for engine outputs: the model run once over whole sequences.

`sequence_logits` feeds each sequence (prompt then output) to the model in one call over a scratch
pool of pages (`jaxengine.models.sequence_logprobs.scratch_step`: no engine, no block manager, no
scheduler, no sampler): the logits of every position.
Tests compare what an engine reported with them:

- `assert_greedy_is_argmax`: each greedy token is the argmax of the logits before it (or within
  `tie` of the maximum, where float rounding may pick either);
- `assert_logprobs_match`: each reported raw logprob (vLLM's default `raw_logprobs`: the model's
  log-softmax, before any sampling parameter) and each prompt logprob equals the reference's.

Sequences are padded to one length and run in one batch, so a test compiles the forward once.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxengine.models.attention_backends import XlaAttentionBackend
from jaxengine.models.sequence_logprobs import scratch_step


@functools.partial(jax.jit, static_argnums=0)
def _log_softmax(graphdef, weights, token_ids):
  """`[B, T, V] float32` log-softmax of the logits of every position of `token_ids` `[B, T]`."""
  model = nnx.merge(graphdef, weights)
  rows, width = token_ids.shape
  metadata, cache = scratch_step(model, rows, width, 16, XlaAttentionBackend())
  positions = jnp.tile(jnp.arange(width, dtype=jnp.int32), rows)[None]  # [1, B * T]
  hidden, _ = model(token_ids.reshape(1, rows * width), positions, cache, metadata)
  logits = model.compute_logits(hidden.reshape(rows * width, -1)).astype(jnp.float32)
  return jax.nn.log_softmax(logits, axis=-1).reshape(rows, width, -1)


def sequence_logprobs(model, sequences: Sequence[Sequence[int]], width: int) -> list[np.ndarray]:
  """The reference's `[len(seq), V]` log-softmax for each sequence (row `t` predicts token
  `t + 1`); `width` (at least the longest sequence) fixes the one compiled shape."""
  token_ids = np.zeros((len(sequences), width), np.int32)
  for i, seq in enumerate(sequences):
    token_ids[i, : len(seq)] = seq  # padding after a sequence never reaches it (causal)
  graphdef, weights = nnx.split(model)
  out = np.asarray(_log_softmax(graphdef, weights, jnp.asarray(token_ids)))
  return [out[i, : len(seq)] for i, seq in enumerate(sequences)]


def _completions(outputs):
  for output in outputs:
    for completion in output.outputs:
      yield output, completion


def assert_greedy_is_argmax(model, outputs, width: int, tie: float = 1e-4) -> int:
  """Asserts every token of the completions in `outputs` (`RequestOutput`s of greedy requests
  without penalties, biases or processors) is the reference's argmax; returns tokens checked."""
  pairs = list(_completions(outputs))
  seqs = [[*o.prompt_token_ids, *c.token_ids] for o, c in pairs]
  checked = 0
  for (output, completion), logprobs in zip(pairs, sequence_logprobs(model, seqs, width)):
    start = len(output.prompt_token_ids) - 1
    for i, token in enumerate(completion.token_ids):
      row = logprobs[start + i]
      assert row[token] >= row.max() - tie, (output.request_id, i, token, int(row.argmax()))
      checked += 1
  return checked


def assert_logprobs_match(model, outputs, width: int, atol: float = 1e-4) -> int:
  """Asserts every raw logprob in `outputs` (sampled tokens' and their top alternatives', and
  prompt logprobs) equals the reference's to `atol`; returns the values checked."""
  pairs = list(_completions(outputs))
  seqs = [[*o.prompt_token_ids, *c.token_ids] for o, c in pairs]
  checked = 0
  for (output, completion), logprobs in zip(pairs, sequence_logprobs(model, seqs, width)):
    start = len(output.prompt_token_ids) - 1
    for i, entries in enumerate(completion.logprobs or ()):
      for token, value in entries.items():
        np.testing.assert_allclose(value.logprob, logprobs[start + i, token], atol=atol)
        checked += 1
    if completion.index == 0 and output.prompt_logprobs:
      for t, entries in enumerate(output.prompt_logprobs):
        for token, value in (entries or {}).items():
          np.testing.assert_allclose(value.logprob, logprobs[t - 1, token], atol=atol)
          checked += 1
  return checked
