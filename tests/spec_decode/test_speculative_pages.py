"""N-gram speculative decoding on the paged engine: drafts are query tokens of the ragged step.

Greedy and seeded outputs equal a plain engine's (no drafts, synchronous steps; the rejection
sampler draws each output token with the key of its index), whose greedy run is checked against an
engine-free forward pass (`tests/helpers/cacheless.py`), under forced preemption and chunked prefill, with
prefix caching over pages that held drafts; the scheduler never hashes a draft; precompile covers
the plain and the verify step.
Every engine verifies whenever a row has a draft (`spec_crossover_tokens` high) and has one
row bucket (and token bucket, but for the precompiled one) so that few shapes compile.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from cacheless import assert_greedy_is_argmax, assert_logprobs_match
from output_utils import step_to_end

import jaxengine as je
from jaxengine.core.kv_cache_manager import KVCacheManager
from jaxengine.core.request import Completion, Request
from jaxengine.core.scheduler import Scheduler
from jaxengine.engine import LLMEngine
from jaxengine.testing import count_compiles, tiny_llama
from jaxengine.tokenizer import Tokenizer
from jaxengine.worker import device_steps

VOCAB = 512
COMMON = {"max_num_reqs": 4, "max_model_len": 64}
PAGED = {"block_size": 4, "num_kv_blocks": 64, "max_num_batched_tokens": 32}
SP = je.SamplingParams


def _spec(k: int) -> dict:
  return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3}


ENGINES = {
  "paged": {**COMMON, **PAGED, "async_scheduling": False},  # the plain reference
  "paged_spec3": {**COMMON, **PAGED, "speculative_config": _spec(3)},
  "paged_spec4": {**COMMON, **PAGED, "speculative_config": _spec(4)},  # precompiled
  # 15 usable pages of 4 (60 tokens) for 4 rows of up to 54, a budget of 8: preempts, chunks.
  "paged_spec2_tight": {
    **COMMON, "block_size": 4, "num_kv_blocks": 16, "max_num_batched_tokens": 8,
    "speculative_config": _spec(2),
  },
}  # fmt: skip
PRECOMPILED = "paged_spec4"
# Repetitive prompts: prompt lookup finds drafts in them and in the loops greedy decoding of a
# random model falls into.
PROMPTS = [
  [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6],
  [3, 4, 3, 4, 3],
  list(range(20, 40)),
  [11, 12, 13, 11, 12, 13, 11, 12, 13, 11],
]
_PRECOMPILE: dict = {}


@functools.cache
def _model_and_tokenizer():
  model = tiny_llama(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1)[0]
  return model, Tokenizer.from_gguf()


@functools.cache
def _engine(name: str) -> LLMEngine:
  if name == PRECOMPILED:
    device_steps.clear()  # count its executables alone (test_precompile_covers_...)
  engine = LLMEngine(*_model_and_tokenizer(), **ENGINES[name])
  engine.spec_crossover_tokens = 10**9  # verify whenever a row has a draft
  runner = engine.runner
  runner.row_buckets = [4]
  if name == PRECOMPILED:
    runner.token_buckets = [16, 32]
    with count_compiles() as compiles:
      _PRECOMPILE["shapes"] = engine.precompile(use_tqdm=False)
    _PRECOMPILE["compiles"] = compiles.count
    _PRECOMPILE["sizes"] = (
      runner.ragged_forward._cache_size(),
      runner.verify_forward._cache_size(),
    )
  else:
    runner.token_buckets = [runner.token_buckets[-1]]
  return engine


def _run(engine: LLMEngine, params, prompts=PROMPTS):
  """Queues the prompts (one step after each, so they arrive while others run), runs to the
  end; outputs in prompt order."""
  params = params if isinstance(params, list) else [params] * len(prompts)
  finished = []
  for i, (prompt, p) in enumerate(zip(prompts, params)):
    engine.add_request(str(i), prompt, p)
    finished += [o for o in engine.step() if o.finished]
  return sorted(finished + step_to_end(engine), key=lambda o: int(o.request_id))


def _assert_same(got, expected):
  """Tokens, text, finish and stop reasons equal; logprob values to float rounding."""
  assert len(got) == len(expected)
  for a, b in zip(got, expected):
    for ca, cb in zip(a.outputs, b.outputs, strict=True):
      fields = ("index", "text", "token_ids", "finish_reason", "stop_reason")
      assert [getattr(ca, f) for f in fields] == [getattr(cb, f) for f in fields]
      assert (ca.logprobs is None) == (cb.logprobs is None)
      for da, db in zip(ca.logprobs or [], cb.logprobs or [], strict=True):
        assert da.keys() == db.keys()
        np.testing.assert_allclose(
          [v.logprob for v in da.values()], [v.logprob for v in db.values()], atol=1e-4
        )


def _stats_delta(engine: LLMEngine, before):
  stats = engine.spec_decode_stats
  return {
    "accepted": stats.num_accepted_tokens - before[0],
    "drafts": stats.num_draft_tokens - before[1],
    "spec_steps": stats.num_spec_steps - before[2],
  }


def _stats(engine: LLMEngine):
  stats = engine.spec_decode_stats
  return stats.num_accepted_tokens, stats.num_draft_tokens, stats.num_spec_steps


GREEDY = SP(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def greedy_reference():
  return _run(_engine("paged"), GREEDY)


def test_the_plain_greedy_run_agrees_with_an_engine_free_forward_pass(greedy_reference):
  model = _model_and_tokenizer()[0]
  assert assert_greedy_is_argmax(model, greedy_reference, 64) == 40 * len(PROMPTS)
  assert assert_logprobs_match(model, greedy_reference, 64) == 2 * 40 * len(PROMPTS)


@pytest.mark.parametrize("name", ["paged_spec3", "paged_spec4", "paged_spec2_tight"])
def test_greedy_outputs_equal_paged_decoding_and_drafts_are_accepted(greedy_reference, name):
  engine = _engine(name)
  engine.reset_kv_cache_stats()
  before = _stats(engine)
  _assert_same(_run(engine, GREEDY), greedy_reference)
  delta = _stats_delta(engine, before)
  assert delta["accepted"] > 10 and delta["drafts"] >= delta["accepted"] > 0
  stats = engine.spec_decode_stats
  assert sum(stats.num_accepted_tokens_per_pos) == stats.num_accepted_tokens
  assert (
    len(stats.num_accepted_tokens_per_pos)
    <= ENGINES[name]["speculative_config"]["num_speculative_tokens"]
  )
  assert stats.num_spec_steps < stats.num_steps and stats.num_declined_steps == 0
  kv = engine.kv_cache_stats
  assert kv.num_used_blocks == 0 and kv.num_running_reqs == 0  # no page leaks
  if name == "paged_spec2_tight":  # both forced, drafts verified meanwhile
    assert kv.num_preemptions > 0 and delta["spec_steps"] > 0


MIXED = [
  SP(temperature=0.8, seed=7, n=2, max_tokens=24, ignore_eos=True, logprobs=1),
  SP(temperature=1.0, seed=3, top_p=0.9, top_k=50, max_tokens=20, ignore_eos=True),
  SP(temperature=0.6, seed=5, presence_penalty=0.5, repetition_penalty=1.2, max_tokens=18),
  SP(temperature=0, max_tokens=30, min_tokens=3, stop=["e"], ignore_eos=True),
]


@pytest.fixture(scope="module")
def plain_mixed():
  return _run(_engine("paged"), MIXED)


@pytest.mark.parametrize("name", ["paged_spec3", "paged_spec2_tight"])
def test_seeded_outputs_equal_plain_decoding_with_speculation(plain_mixed, name):
  engine = _engine(name)
  before = _stats(engine)
  _assert_same(_run(engine, MIXED), plain_mixed)
  assert _stats_delta(engine, before)["accepted"] > 0
  assert engine.kv_cache_stats.num_used_blocks == 0


def test_max_tokens_and_stops_inside_a_run_of_accepted_drafts(greedy_reference):
  engine, plain = _engine("paged_spec3"), _engine("paged")
  reference = [o.outputs[0].token_ids for o in greedy_reference]
  for max_tokens in (1, 2, 7):
    params = SP(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in _run(engine, params)]
    assert got == [r[:max_tokens] for r in reference]
  # Stop at a token that appears early (inside a run of accepted drafts), not before min_tokens.
  stop = reference[0][3]
  params = SP(temperature=0, max_tokens=30, stop_token_ids=[stop], min_tokens=5)
  expected = _run(plain, params, PROMPTS[:1])
  got = _run(engine, params, PROMPTS[:1])
  _assert_same(got, expected)
  assert got[0].outputs[0].token_ids[-1] == stop and len(got[0].outputs[0].token_ids) > 5


def test_prefix_caching_reuses_pages_that_held_drafts(greedy_reference):
  """A prompt extending an earlier prompt and its output hits pages whose tokens were accepted
  drafts; the same prompt again hits them too. Outputs equal the engine without drafts."""
  engine, plain = _engine("paged_spec3"), _engine("paged")
  first = greedy_reference[0].outputs[0].token_ids
  extended = PROMPTS[0] + first[:26]  # 40 tokens: 10 full pages, 3 beyond the prompt's
  params = SP(temperature=0, max_tokens=16, ignore_eos=True)
  _run(engine, GREEDY, PROMPTS[:1])  # the drafted run whose pages are cached
  engine.reset_kv_cache_stats()
  before = _stats(engine)
  got = _run(engine, params, [extended, extended])
  assert engine.kv_cache_stats.prefix_cache_hits >= 2 * 36
  assert _stats_delta(engine, before)["accepted"] > 0
  assert got[0].outputs[0].token_ids == got[1].outputs[0].token_ids
  _assert_same(got, _run(plain, params, [extended, extended]))


def test_a_draft_is_never_hashed_and_rejected_drafts_are_not_computed():
  manager = KVCacheManager(num_blocks=16, block_size=4)
  scheduler = Scheduler(2, manager, max_num_batched_tokens=16)
  params = SP(max_tokens=8)
  request = Request("r", None, [1, 2, 3, 4, 5, 6, 7], params)
  completion = Completion("r", request, 0, params, None)
  request.completions.append(completion)
  scheduler.add_request(request)
  first = scheduler.schedule({"r": [1, 2]})  # a prefill takes no drafts
  assert first.num_scheduled_tokens == {"r": 7} and first.spec_token_ids == {}
  scheduler.update_after_step(first)
  completion.token_ids.append(8)  # the sampled token: 8 known, 7 computed
  step = scheduler.schedule({"r": [9, 10, 11]})
  assert step.num_scheduled_tokens == {"r": 4} and step.spec_token_ids == {"r": [9, 10, 11]}
  assert len(manager.get_block_ids("r")) == 3  # positions 7..10: a third page
  # Only the two pages of known tokens are registered, never the one holding drafts.
  assert manager.block_pool.num_cached_blocks == 2
  scheduler.update_after_step(step, {"r": 1})  # one draft accepted, two rejected
  assert completion.num_computed_tokens == 9
  # Drafts that do not fit the budget are cut; a step never preempts for them.
  completion.token_ids.extend([9, 5])
  small = Scheduler(2, manager, max_num_batched_tokens=2)
  small.running = scheduler.running
  cut = small.schedule({"r": [6, 7, 8]})
  assert cut.num_scheduled_tokens == {"r": 2} and cut.spec_token_ids == {"r": [6]}
  assert not cut.preempted


def test_precompile_covers_plain_and_verify_steps_and_a_mixed_run_compiles_nothing():
  engine = _engine(PRECOMPILED)
  runner = engine.runner
  # Plain and verify steps, each with and without prompt logprobs (one row bucket).
  assert _PRECOMPILE["shapes"] == 4 * len(runner.token_buckets) * len(runner.row_buckets) == 8
  assert _PRECOMPILE["compiles"] >= _PRECOMPILE["shapes"]
  assert _PRECOMPILE["sizes"] == (4, 4)  # what precompile compiled, before other engines ran
  sizes = (runner.ragged_forward._cache_size(), runner.verify_forward._cache_size())
  before = _stats(engine)
  params = [*MIXED[:2], SP(temperature=0, max_tokens=12), GREEDY]
  _run(engine, params)  # the batch's own small helpers compile once
  with count_compiles() as compiles:
    _run(engine, params[::-1], PROMPTS[::-1])
  assert compiles.count == 0
  assert _stats_delta(engine, before)["spec_steps"] > 0
  assert (runner.ragged_forward._cache_size(), runner.verify_forward._cache_size()) == sizes
