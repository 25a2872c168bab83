"""Data parallelism on pages: one `EngineCore` per data-parallel group, on 4 host CPU devices.

One subprocess (the device count must be set before JAX starts) checks, for `d = 2` groups with
one device each and with two (`t = 2`, pages split over key/value heads):

- every group holds its own rows, pool of pages and weights on its own devices, and requests are
  spread over the groups;
- with a pool and token budget small enough to force chunked prefill and preemption in each group,
  and prompts sharing full blocks (prefix caching on), greedy and seeded tokens and logprob ranks
  equal one device's engine of one group's size, logprob values within 1e-4; both pools report
  preemptions and prefix-cache hits;
- a second run compiles nothing; with one device a group, `load_weights` from `(name, array)`
  pairs (read once, applied to every group) compiles nothing and keeps the tokens, and an aborted
  request leaves both groups clean (new weights on groups of several devices:
  tests/parallel/test_mesh.py);
- `batch_invariant=True` on the groups gives one device's bits;
- every feature at once on the groups (asynchronous scheduling, n-gram speculative decoding and
  `num_decode_steps=2`): the plain engine's tokens.

It also checks that the token budget is each group's (checked and defaulted as for one group's
rows). Every engine there runs its steps in its largest shape only (bucket choice:
tests/worker/test_step_shapes.py), for half the compile time. The in-process tests check the
divisibility rule, named, and that one group is the config itself.
"""

from __future__ import annotations

import pytest
from subprocess_utils import run_python

import jaxengine as je

pytestmark = pytest.mark.bitwise  # compares bits between programs: tests/conftest.py

SCRIPT = """
import os, sys
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
import jax, numpy as np
import jaxengine as je
from jaxengine.models.weights import named_weights
from output_utils import assert_same_generations, generations
from step_shapes import one_shape
from jaxengine.testing import count_compiles, tiny_llama


SP = je.SamplingParams
# The token budget is each group's: checked and defaulted against one group's rows.
try:
  je.EngineConfig(max_num_reqs=8, data_parallel_size=4, max_num_batched_tokens=1)
except ValueError as e:
  assert "max_num_reqs=8 / data_parallel_size=4" in str(e), e
else:
  raise AssertionError("a budget below a group's rows accepted")
assert je.EngineConfig(max_num_reqs=8, data_parallel_size=4, max_num_batched_tokens=2)
grouped = je.EngineConfig(max_num_reqs=4, data_parallel_size=2, max_model_len=256)
alone = je.EngineConfig(max_num_reqs=2, max_model_len=256)
assert grouped.max_num_batched_tokens == alone.max_num_batched_tokens == 512, grouped
model, _ = tiny_llama(vocab_size=256)  # 4 query heads over 2 kv heads
rng = np.random.default_rng(0)
prefix = rng.integers(4, 250, 9).tolist()  # two full blocks of 4 shared by four prompts
prompts = [prefix + [10, 11], [5, 6, 7], prefix + [12], rng.integers(4, 250, 13).tolist(),
           [8, 9], prefix + [10, 11], prefix + [7, 7, 7], [3, 4, 5, 3, 4, 5, 3, 4]]
params = [
  SP(temperature=0, max_tokens=12, logprobs=2),
  SP(temperature=0.8, top_k=20, top_p=0.9, seed=1, max_tokens=8, logprobs=2),
  SP(temperature=1.0, seed=2, n=2, min_p=0.05, presence_penalty=0.5, max_tokens=5, logprobs=1),
  SP(temperature=0, max_tokens=7, logprobs=0),
  SP(temperature=0.7, seed=3, repetition_penalty=1.2, max_tokens=9),
  SP(temperature=1.0, seed=4, top_k=5, max_tokens=4, logprobs=3),
  SP(temperature=0, max_tokens=8, prompt_logprobs=2),
  SP(temperature=0, max_tokens=10),
]
# Per group: 2 rows, 6 usable blocks of 4 (24 tokens) for requests of up to 24: preemption; a
# budget of 8 tokens splits every prompt above 6 tokens: chunked prefill.
group = dict(max_model_len=24, block_size=4, num_kv_blocks=7, max_num_batched_tokens=8)

def run(llm):
  return generations(llm, prompts, params)

# `one_shape`: each group's steps in its largest shape only (its rows, its token budget): groups,
# not bucket choice, are the point here (buckets: tests/worker/test_step_shapes.py), and the
# engines compared pad alike, so their tokens compare as with every bucket (half the compile time).
check_same = assert_same_generations

one = one_shape(je.LLM(model, max_num_reqs=2, **group))
want = run(one)
for t in (1, 2):
  llm = one_shape(
    je.LLM(model, data_parallel_size=2, tensor_parallel_size=t, max_num_reqs=4, **group))
  engine = llm.llm_engine
  cores = engine.cores
  assert len(cores) == 2 and [c.runner.max_num_reqs for c in cores] == [2, 2]
  devices = [c.runner.kv_cache.pages[0][0].sharding.device_set for c in cores]
  weights = [c.runner.weights["embed"][...].sharding.device_set for c in cores]
  assert devices == weights and len(devices[0] | devices[1]) == 2 * t, devices
  assert not devices[0] & devices[1], devices  # each group on its own devices
  got = run(llm)
  check_same(got, want)
  stats = [c.kv_cache_manager.stats for c in cores]
  assert all(s.peak_running_reqs > 0 for s in stats), stats  # both groups ran requests
  assert all(s.num_preemptions > 0 and s.prefix_cache_hits > 0 for s in stats), stats
  total = engine.kv_cache_stats
  assert total.num_blocks == 2 * stats[0].num_blocks and total.num_used_blocks == 0, total
  assert total.num_preemptions == sum(s.num_preemptions for s in stats)
  with count_compiles() as compiles:
    check_same(run(llm), want)
  assert compiles.count == 0, (t, compiles.count)
  print("groups", t, stats)
  if t == 2:  # new weights and aborts on groups of two devices: tests/parallel/test_mesh.py (t = 4, d = 2)
    continue
  llm.load_weights((name, np.asarray(w)) for name, w in named_weights(model))
  with count_compiles() as compiles:
    check_same(run(llm), want)
  assert compiles.count == 0, (t, "after load_weights", compiles.count)
  for i, prompt in enumerate(prompts[:4]):
    engine.add_request(f"gone-{i}", prompt, SP(max_tokens=20))
  engine.step()
  engine.abort_request([f"gone-{i}" for i in range(4)])
  assert not engine.has_unfinished_requests()
  assert all(c.runner.input_batch.num_reqs == 0 for c in cores)
  engine.step()  # reads and drops a step left in flight
  assert all(c.kv_cache_manager.stats.num_used_blocks == 0 for c in cores)

# batch_invariant on the groups (one device each): one device's bits, whichever group ran a
# request (tensor parallelism with it: tests/models/test_batch_invariant.py).
exact = dict(batch_invariant=True, max_model_len=32)
alone_bits = run(one_shape(je.LLM(model, max_num_reqs=2, **exact)))
groups_bits = run(one_shape(je.LLM(model, data_parallel_size=2, max_num_reqs=4, **exact)))
check_same(groups_bits, alone_bits, atol=0)

# Every feature at once on the groups: the plain engine's tokens.
spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1}
composed = one_shape(je.LLM(model, data_parallel_size=2, max_num_reqs=4, speculative_config=spec,
                            num_decode_steps=2, **group))
composed.llm_engine.spec_crossover_tokens = 10**6  # verify whenever a row has drafts
got = run(composed)
assert [g[0] for g in got] == [w[0] for w in want]
assert composed.llm_engine.spec_decode_stats.num_drafts > 0
print("ok")
"""


def test_data_parallel_groups_match_one_device():
  out = run_python(SCRIPT, timeout=1200)
  assert out.strip().endswith("ok")
  assert out.count("groups") == 2


def test_data_parallel_size_must_divide_max_num_reqs():
  with pytest.raises(ValueError, match=r"data_parallel_size=2 must divide max_num_reqs=3"):
    je.EngineConfig(max_num_reqs=3, data_parallel_size=2)


def test_one_group_is_the_config_itself():
  config = je.EngineConfig(max_num_reqs=4)
  assert config.data_parallel_groups() == [config]
