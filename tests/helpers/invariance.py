"""Batch-invariance checks shared by tests/models/test_batch_invariant.py's own engines and its
subprocess on 2 host devices: a request's bits alone and inside a shuffled batch."""

from __future__ import annotations

import numpy as np

import jaxengine as je

#: `random_adapter`'s targets on `jaxengine.testing.tiny_llama` (hidden 64, MLP 128), ``(in,
#: out)`` each: attention and MLP, column- and row-parallel.
LORA_SHAPES = {"q_proj": (64, 64), "o_proj": (64, 64), "up_proj": (64, 128), "down_proj": (128, 64)}


def bits(values) -> np.ndarray:
  """float32 values as their bit patterns (compared exactly)."""
  return np.asarray(values, np.float32).view(np.uint32)


def random_adapter(lora_int_id: int):
  """A random rank-4 adapter of `tiny_llama`'s two layers (`LORA_SHAPES`), made in memory as a
  trainer hands one over (`jaxengine.lora.lora_adapter_from_arrays`)."""
  from jaxengine.lora import lora_adapter_from_arrays

  rng = np.random.default_rng(lora_int_id)
  pairs = {
    (layer, target): (
      rng.standard_normal((n_in, 4)).astype(np.float32) * 0.3,
      rng.standard_normal((4, n_out)).astype(np.float32) * 0.3,
    )
    for layer in range(2)
    for target, (n_in, n_out) in LORA_SHAPES.items()
  }
  return lora_adapter_from_arrays(lora_int_id, pairs)


def mixed_bits(llm, lora=None):
  """Three target prompts (4, 37 and 70 tokens of a 256-token vocabulary), greedy, each alone and
  then inside a shuffled batch of six others (every other target and every third other with
  `lora` when given): asserts the same tokens and the same bits of the sampled and prompt
  logprobs. Returns ``(targets, [(tokens, sampled bits, prompt bits)] alone)``."""
  rng = np.random.default_rng(5)
  targets = [rng.integers(3, 256, size=n).tolist() for n in (4, 37, 70)]
  others = [rng.integers(3, 256, size=int(rng.integers(1, 60))).tolist() for _ in range(6)]
  params = je.SamplingParams(
    temperature=0, max_tokens=6, logprobs=0, prompt_logprobs=0, ignore_eos=True
  )

  def result(out, prompt):
    sample = out.outputs[0]
    return (
      list(sample.token_ids),
      bits([d[t].logprob for d, t in zip(sample.logprobs, sample.token_ids)]),
      bits([d[t].logprob for d, t in zip(out.prompt_logprobs[1:], prompt[1:])]),
    )

  loras = [lora if i % 2 == 0 else None for i in range(len(targets))]
  loras += [lora if i % 3 == 0 else None for i in range(len(others))]
  prompts = targets + others
  alone = [
    result(llm.generate([p], params, lora_request=r, use_tqdm=False)[0], p)
    for p, r in zip(targets, loras)
  ]
  order = np.random.default_rng(1).permutation(len(prompts)).tolist()
  outputs = llm.generate(
    [prompts[i] for i in order], params, lora_request=[loras[i] for i in order], use_tqdm=False
  )
  mixed = dict(zip(order, outputs))
  for i, (tokens, sampled, prompt_bits) in enumerate(alone):
    got = result(mixed[i], targets[i])
    assert got[0] == tokens, (i, got[0], tokens)
    np.testing.assert_array_equal(got[1], sampled)
    np.testing.assert_array_equal(got[2], prompt_bits)
  return targets, alone
