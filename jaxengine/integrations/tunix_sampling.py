"""A Tunix `RolloutConfig` and prompts as the engine's requests: Tunix's sampler's conventions.

`JaxEngineRollout.generate` (`jaxengine.integrations.tunix`) builds its requests here:
`tokenize_prompts` tokenizes and left-pads the prompts as Tunix's vanilla sampler does,
`sampling_params` maps the `RolloutConfig` (greedy as `is_greedy` says) to one prompt's
`SamplingParams`, and `request_seeds` spreads the config's one seed into a seed per prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.integrations import missing_extra

try:
  from tunix.generate import tokenizer_adapter
  from tunix.generate import utils as tunix_utils
  from tunix.rl.rollout import base_rollout
except ModuleNotFoundError as error:  # the extra is not installed: say how to install it
  raise missing_extra(error, __name__) from error

from jaxengine.params import SamplingParams

__all__ = ["PaddedPrompts", "is_greedy", "request_seeds", "sampling_params", "tokenize_prompts"]


class PaddedPrompts(NamedTuple):
  """Prompts tokenized and left-padded as Tunix's vanilla sampler does.

  Attributes:
    token_ids: one `[num_prompt_tokens] int32` array per prompt (BOS first, once).
    left_padded: `[num_prompts, max_prompt_length] int32`, pad ids on the left.
  """

  token_ids: list[np.ndarray]
  left_padded: np.ndarray


def tokenize_prompts(
  tokenizer: tokenizer_adapter.TokenizerAdapter, prompts: Sequence[str], max_prompt_length: int
) -> PaddedPrompts:
  """Tokenizes like Tunix's sampler: encode, prepend BOS (when the tokenizer has a non-zero one)
  without doubling it, left-pad to `max_prompt_length` (or, if a prompt is longer, to the next
  power of two above the longest: prompts are never truncated)."""
  bos = tokenizer.bos_id()
  token_ids = [
    np.asarray(
      tokenizer.dedup_bos_ids(([bos] if bos else []) + list(tokenizer.encode(p))), np.int32
    )
    for p in prompts
  ]
  longest = max(len(t) for t in token_ids)
  width = (
    max_prompt_length if longest <= max_prompt_length else tunix_utils.next_power_of_2(longest)
  )
  left_padded = np.full((len(prompts), width), tokenizer.pad_id(), np.int32)
  for row, ids in enumerate(token_ids):
    left_padded[row, width - len(ids) :] = ids
  return PaddedPrompts(token_ids, left_padded)


def is_greedy(config: base_rollout.RolloutConfig) -> bool:
  """Tunix's greedy: no top_p (its sampler's greedy mode), top_k 1, or temperature 0."""
  return config.top_p is None or config.top_k == 1 or config.temperature == 0


def request_seeds(seed: Any, num_prompts: int) -> list[int | None]:
  """One engine seed per prompt from `RolloutConfig.seed` (an int or a JAX key; None: unseeded).

  Tunix's sampler draws a whole batch from one key; the engine seeds each request, so the
  batch's seed is spread into distinct per-prompt seeds (the same seed gives the same draws).
  """
  if seed is None:
    return [None] * num_prompts
  if isinstance(seed, jax.Array) and jnp.issubdtype(seed.dtype, jax.dtypes.prng_key):
    seed = jax.random.key_data(seed)
  entropy = [int(x) for x in np.asarray(seed, np.uint64).reshape(-1)] or [0]
  states = np.random.SeedSequence(entropy).generate_state(2 * num_prompts, np.uint32)
  return [int(states[2 * i]) << 31 | int(states[2 * i + 1]) >> 1 for i in range(num_prompts)]


def sampling_params(
  config: base_rollout.RolloutConfig, eos_ids: Sequence[int], seed: int | None
) -> SamplingParams:
  """The `SamplingParams` of one prompt under a Tunix `RolloutConfig`.

  Greedy (`is_greedy`) becomes temperature 0; otherwise temperature, top_p (None: 1) and top_k
  (None or <= 0: off) as given. Generation stops at the first of `eos_ids` (the tokenizer's own
  EOS only when it is among them, as in Tunix) or after `max_tokens_to_generate` tokens.
  """
  greedy = is_greedy(config)
  return SamplingParams(
    temperature=0.0 if greedy else float(config.temperature),
    top_p=1.0 if greedy or config.top_p is None else float(config.top_p),
    top_k=0 if greedy or not config.top_k or config.top_k <= 0 else int(config.top_k),
    seed=seed,
    max_tokens=int(config.max_tokens_to_generate),
    ignore_eos=True,
    stop_token_ids=tuple(int(t) for t in eos_ids),
    logprobs=0 if config.return_logprobs else None,
  )
