"""Teacher-forced logprobs of a Tunix rollout's completions under the engine's weights.

Tunix's convention (what its trainer recomputes, `compute_per_token_logps`): the log-softmax of
the logits divided by the rollout temperature (raw logits for greedy decoding, and for
temperature 1), of the whole vocabulary. `completion_logprobs` runs the engine model once over
every ``[prompt, completion]`` row; `engine_logprobs` does that with the engine's current weights
(and a LoRA rollout's adapter), for `JaxEngineRollout.get_per_token_logps`
(`jaxengine.integrations.tunix`); `recomputed_logprobs` gives `generate` the logprobs of its
sampled tokens when the engine's own differ from Tunix's (`needs_recompute`: under top-k or
top-p, which renormalise the engine's).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxengine.integrations import missing_extra

try:
  from tunix.rl.rollout import base_rollout
except ModuleNotFoundError as error:  # the extra is not installed: say how to install it
  raise missing_extra(error, __name__) from error

from jaxengine.entrypoints.llm import LLM
from jaxengine.integrations.tunix_sampling import is_greedy
from jaxengine.lora import LoRARequest
from jaxengine.models.attention_backends import XlaAttentionBackend
from jaxengine.models.lora import LoRAInputs
from jaxengine.models.sequence_logprobs import scratch_step

__all__ = ["completion_logprobs", "engine_logprobs", "needs_recompute", "recomputed_logprobs"]


@functools.partial(jax.jit, static_argnames=("graphdef", "pad_id", "num_completion_tokens"))
def completion_logprobs(
  graphdef: nnx.GraphDef,
  weights: nnx.State,
  token_ids: jax.Array,
  inverse_temperature: jax.Array,
  lora: LoRAInputs | None = None,
  *,
  pad_id: int,
  num_completion_tokens: int,
) -> jax.Array:
  """Teacher-forced logprobs of the completion tokens, Tunix's convention.

  The engine model runs once over every `[prompt, completion]` row, as one ragged step over a
  scratch pool of pages (`jaxengine.models.sequence_logprobs.scratch_step`): each row's real
  tokens moved to its front, at positions `0..`, its pad tokens after them (where no real token
  attends to them).

  Args:
    graphdef: the engine model's graph (static).
    weights: its weights.
    token_ids: `[B, T] int32`, left-padded prompt then right-padded completion.
    inverse_temperature: `[] float32`, 1 / temperature (1 for greedy or temperature 1).
    lora: the LoRA adapter slots with ``[B * T] int32`` token slots (a LoRA rollout), or None.
    pad_id: the pad token (static).
    num_completion_tokens: `C`, the completion's width (static).

  Returns:
    `[B, C] float32` `log_softmax(logits * inverse_temperature)` of each completion token given
    the tokens before it; 0 at pad positions.
  """
  model = nnx.merge(graphdef, weights)
  rows, width = token_ids.shape
  is_real = token_ids != pad_id  # [B, T]
  order = jnp.argsort(~is_real, axis=1, stable=True)  # [B, T] real tokens first, in order
  packed = jnp.take_along_axis(token_ids, order, axis=1)  # [B, T]
  block_size = 16  # the engine's default; any size computes the same attention
  metadata, kv_cache = scratch_step(model, rows, width, block_size, XlaAttentionBackend())
  positions = jnp.tile(jnp.arange(width, dtype=jnp.int32), rows)[None]  # [1, B * T]
  adapters = {}  # only Llama-family modules take LoRA
  if lora is not None:  # each token's slot moves with the token
    slots = jnp.take_along_axis(lora.slots.reshape(rows, width), order, axis=1)
    adapters["lora"] = dataclasses.replace(lora, slots=slots.reshape(-1))
  flat = packed.reshape(1, rows * width)
  hidden, _ = model(flat, positions, kv_cache, metadata, **adapters)  # [1, B * T, E]
  hidden = hidden.reshape(rows, width, -1)
  start = width - num_completion_tokens
  targets = token_ids[:, start:]  # [B, C]
  # A real target's predictor is the real token before it: packed index (its position - 1).
  target_positions = jnp.cumsum(is_real, axis=1)[:, start:] - 1  # [B, C]
  before = jnp.clip(target_positions - 1, 0, width - 1)
  predictors = jnp.take_along_axis(hidden, before[..., None], axis=1)  # [B, C, E]
  logits = model.compute_logits(predictors) * inverse_temperature  # [B, C, V]
  picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  logps = picked - jax.nn.logsumexp(logits, axis=-1)
  return jnp.where(targets != pad_id, logps, 0.0)


def needs_recompute(config: base_rollout.RolloutConfig) -> bool:
  """Whether `generate` recomputes its logprobs: the engine's processed logprobs renormalise
  over the top-k/top-p cut; Tunix's do not."""
  if is_greedy(config):
    return False
  top_p_on = config.top_p is not None and config.top_p < 1.0
  return top_p_on or bool(config.top_k and config.top_k > 0)


def engine_logprobs(
  llm: LLM,
  graphdef: nnx.GraphDef,
  token_ids: np.ndarray,
  num_completion_tokens: int,
  temperature: float,
  *,
  pad_id: int,
  lora_request: LoRARequest | None,
) -> jax.Array:
  """`completion_logprobs` with the engine's current weights; Tunix divides the logits by the
  temperature unless it is 0 or 1.

  Args:
    llm: the rollout's engine.
    graphdef: the engine runner's module structure (with `quantization`, its int8 / float8
      values and scales), which its weights are merged into.
    token_ids: `[B, T] int32`, left-padded prompt then right-padded completion.
    num_completion_tokens: `C`, the completion's width.
    temperature: the rollout temperature.
    pad_id: the pad token.
    lora_request: the adapter every token runs with (a LoRA rollout's actor), or None.

  Returns:
    `[B, C] float32`, as `completion_logprobs`.
  """
  inverse = 1.0 if temperature in (0.0, 1.0) else 1.0 / temperature
  return completion_logprobs(
    graphdef,
    llm.llm_engine.runner.weights,
    token_ids,
    np.float32(inverse),
    _lora_inputs(llm, lora_request, token_ids.size),
    pad_id=int(pad_id),
    num_completion_tokens=int(num_completion_tokens),
  )


def _lora_inputs(llm: LLM, lora_request: LoRARequest | None, num_tokens: int) -> LoRAInputs | None:
  """The engine's LoRA slots with every one of `num_tokens` tokens in `lora_request`'s slot
  (placed there first if no rollout has yet), or None without LoRA."""
  manager = llm.llm_engine.runner.lora
  if lora_request is None or manager is None:
    return None
  manager.acquire("tunix-teacher-forcing", lora_request)  # places it when needed
  slot = manager.slot("tunix-teacher-forcing")
  manager.release("tunix-teacher-forcing")
  return manager.inputs(jnp.full((num_tokens,), slot, jnp.int32))


def recomputed_logprobs(
  llm: LLM,
  graphdef: nnx.GraphDef,
  left_padded: np.ndarray,
  tokens: list[np.ndarray],
  config: base_rollout.RolloutConfig,
  *,
  pad_id: int,
  lora_request: LoRARequest | None,
) -> list[np.ndarray]:
  """Tunix's logprobs of sampled completions (`engine_logprobs` at the config's temperature).

  Args:
    llm, graphdef, pad_id, lora_request: as `engine_logprobs`.
    left_padded: `[B, P] int32` left-padded prompts.
    tokens: one `int32` array of completion tokens per prompt (at most
      `max_tokens_to_generate`).
    config: the call's `RolloutConfig`.

  Returns:
    One `float32` array per prompt, the length of its completion.
  """
  width = int(config.max_tokens_to_generate)
  completions = np.full((len(tokens), width), pad_id, np.int32)
  for row, ids in enumerate(tokens):
    completions[row, : len(ids)] = ids
  token_ids = np.concatenate([left_padded, completions], axis=1)
  scored = engine_logprobs(
    llm,
    graphdef,
    token_ids,
    width,
    float(config.temperature),
    pad_id=pad_id,
    lora_request=lora_request,
  )
  values = np.asarray(scored)
  return [values[row, : len(ids)] for row, ids in enumerate(tokens)]
