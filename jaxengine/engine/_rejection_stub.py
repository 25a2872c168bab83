"""TEMPORARY stand-in for jaxengine.sample.rejection_sample until spec-sampler merges."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxengine.sample import LogprobsTensors, sample


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RejectionOutput:
  sampled_token_ids: jax.Array
  num_sampled: jax.Array
  logprobs: LogprobsTensors


def rejection_sample(state, metadata, target_logits, draft_token_ids, num_draft_tokens):
  num_positions = target_logits.shape[1]
  running = metadata.is_live
  tokens, logprobs, counts = [], [], jnp.zeros_like(num_draft_tokens)
  for j in range(num_positions):
    md = dataclasses.replace(metadata, is_live=running)
    state, out = sample(state, md, target_logits[:, j])
    emitted = running & out.is_appended
    tokens.append(jnp.where(emitted, out.sampled_token_ids, -1))
    logprobs.append(out.logprobs)
    counts = counts + emitted.astype(jnp.int32)
    if j < num_positions - 1:
      running = emitted & (j < num_draft_tokens) & (out.sampled_token_ids == draft_token_ids[:, j])
  lp = jax.tree.map(lambda *a: jnp.stack(a, axis=1), *logprobs)
  return state, RejectionOutput(jnp.stack(tokens, axis=1), counts, lp)
