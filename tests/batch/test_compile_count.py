"""After warm-up, steady-state batch operations and sampling with [max_num_reqs, vocab_size] logits
compile nothing, whatever the mix of per-request parameters (README, "Design overview")."""

from __future__ import annotations

import numpy as np
import pytest
from batch_utils import MML, PROCESSED, RAW, SMALL_BUDGETS, R, V, make_batch

import jaxengine as je


def _random_params(rng):
  kw = {}
  kw["temperature"] = float(rng.choice([0.0, 0.0, 0.5, 1.0, 1.7]))
  if rng.random() < 0.3:
    kw["seed"] = int(rng.integers(0, 2**31 - 1))
  if rng.random() < 0.3:
    kw["top_k"] = int(rng.integers(-1, V + 3))
  if rng.random() < 0.3:
    kw["top_p"] = float(rng.uniform(0.05, 1.0))
  if rng.random() < 0.3:
    kw["min_p"] = float(rng.uniform(0.0, 0.5))
  if rng.random() < 0.3:
    kw["presence_penalty"] = float(rng.uniform(-2, 2))
    kw["frequency_penalty"] = float(rng.uniform(-2, 2))
    kw["repetition_penalty"] = float(rng.uniform(0.5, 2))
  if rng.random() < 0.3:
    kw["logit_bias"] = {
      int(t): float(rng.uniform(-2, 2)) for t in rng.integers(0, V, size=rng.integers(1, 6))
    }
  if rng.random() < 0.2:
    kw["allowed_token_ids"] = sorted(set(rng.integers(0, V, size=rng.integers(1, V)).tolist()))
  if rng.random() < 0.3:
    kw["bad_words_token_ids"] = [
      rng.integers(0, V, size=rng.integers(1, 4)).tolist() for _ in range(rng.integers(1, 5))
    ]
  if rng.random() < 0.3:
    kw["min_tokens"] = int(rng.integers(0, 8))
    kw["stop_token_ids"] = rng.integers(0, V, size=rng.integers(0, 5)).tolist()
  if rng.random() < 0.5:
    kw["logprobs"] = int(rng.integers(0, 21))
  return je.SamplingParams(**kw)


def _add_random(b, rng, rid):
  prompt = rng.integers(0, V, size=int(rng.integers(1, 8))).tolist()
  outputs = rng.integers(0, V, size=int(rng.integers(0, 4))).tolist()
  return b.add_request(rid, prompt, _random_params(rng), output_token_ids=outputs)


@pytest.mark.parametrize(
  "config",
  [RAW, {**PROCESSED, **SMALL_BUDGETS}],  # the standard executables of tests/helpers/batch_utils
  ids=["default budgets", "small budgets: every candidate level and the bisection"],
)
def test_steady_state_compiles_nothing(compile_counter, config):
  rng = np.random.default_rng(0)
  b = make_batch(**config)
  serial = 0

  def add():
    nonlocal serial
    rid = f"r{serial}"
    serial += 1
    _add_random(b, rng, rid)

  def logits():
    return rng.normal(0, 2, size=(R, V)).astype(np.float32)

  # Warm-up: every operation once, sampling with and without logprobs / all-greedy and mixed.
  b.add_request("w-greedy", [1], je.SamplingParams(temperature=0.0))
  b.sample(logits())
  b.add_request(
    "w-random",
    [1],
    je.SamplingParams(
      temperature=1.0,
      logprobs=5,
      top_k=3,
      top_p=0.5,
      min_p=0.1,
      presence_penalty=1.0,
      logit_bias={1: 1.0},
      allowed_token_ids=[1, 2],
      bad_words_token_ids=[[1, 2]],
      min_tokens=3,
      stop_token_ids=[2],
      seed=3,
    ),
  )
  add()
  b.sample(logits())
  b.swap_states(0, 1)
  b.remove_request("w-greedy")
  b.condense()
  b.sample(logits())
  b.remove_request("w-random")
  add()
  b.sample(logits())
  _ = b.sampling_metadata
  for rid in list(b.req_ids):
    b.remove_request(rid)
  b.condense()

  compile_counter.reset()
  steps = 300
  for _step in range(steps):
    op = rng.random()
    if b.num_reqs < R and (op < 0.35 or b.num_reqs == 0):
      for _ in range(int(rng.integers(1, R - b.num_reqs + 1))):
        add()
    elif op < 0.55 and b.num_reqs > 0:
      for rid in rng.choice(b.req_ids, size=int(rng.integers(1, b.num_reqs + 1)), replace=False):
        b.remove_request(str(rid))
      if rng.random() < 0.5 and b.num_reqs < R:
        add()  # fills a hole before the condense
      if rng.random() < 0.5:
        b.condense()
    elif op < 0.65 and b.num_reqs >= 2:
      b.condense()
      i, j = rng.choice(b.num_reqs, size=2, replace=False)
      b.swap_states(int(i), int(j))
    if b.num_reqs == 0:
      add()
    # retire requests that would overflow max_model_len
    b.condense()
    for rid, outs in zip(list(b.req_ids), [list(o) for o in b.req_output_token_ids]):
      if len(outs) + 8 >= MML:
        b.remove_request(rid)
    if b.num_reqs == 0:
      add()
    b.sample(logits())
  assert compile_counter.count == 0, (
    f"{compile_counter.count} compiles in {steps} steady-state steps"
  )


def test_compile_counter_sees_compiles(compile_counter):
  import jax
  import jax.numpy as jnp

  compile_counter.reset()
  jax.jit(lambda x: x * 3 + 1)(jnp.arange(7.0))
  assert compile_counter.count >= 1


def test_count_compiles_counts_only_while_active():
  import jax
  import jax.numpy as jnp

  from jaxengine.testing import count_compiles

  x, x_int = jnp.arange(5.0), jnp.arange(5)
  jax.block_until_ready((x, x_int))
  with count_compiles() as compiles:
    jax.jit(lambda x: x * 5 - 2)(x)
    jax.jit(lambda x: x * 5 - 2)(x_int)
  assert compiles.count == 2 and compiles.seconds > 0
  jax.jit(lambda x: x * 7 - 2)(x)
  assert compiles.count == 2
  compiles.reset()
  compiles.start()
  jax.jit(lambda x: x * 9 - 2)(x)
  compiles.stop()
  assert compiles.count == 1
