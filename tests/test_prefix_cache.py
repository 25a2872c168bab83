"""Prefix caching (`enable_prefix_caching`): the same outputs with the cache on and off, hits and
LRU evictions counted, the cache emptied by `load_weights`, and a bounded number of compiles."""

from __future__ import annotations

import numpy as np
import pytest
from test_rollout import assert_same_outputs

import jaxengine as je
from jaxengine.engine import LLMEngine
from jaxengine.engine.prefix_cache import PrefixCache, block_hashes
from jaxengine.testing import tiny_llama
from jaxengine.tokenizer import Tokenizer

RNG = np.random.default_rng(0)
PREFIX = RNG.integers(4, 500, 40).tolist()  # two full blocks and 8 tokens
OWN = [RNG.integers(4, 500, k).tolist() for k in (3, 24, 8, 0, 17, 9)]
PROMPTS = [
  PREFIX + OWN[0],
  PREFIX + OWN[1],  # 64 tokens: exactly 4 blocks
  PREFIX[:32],  # exactly the two blocks the others start with: entirely a cached prefix
  PREFIX + OWN[2],  # 48 tokens: exactly 3 blocks
  PREFIX + OWN[3],
  PREFIX[:32] + OWN[4],
  PREFIX + OWN[5],
  OWN[1],  # no shared prefix
]
MIXES = [
  je.SamplingParams(temperature=0, max_tokens=9),
  je.SamplingParams(temperature=0.8, top_k=20, seed=1, max_tokens=12, logprobs=2, stop=["e"]),
  je.SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=10, logprobs=0),
  je.SamplingParams(temperature=0.5, seed=4, max_tokens=8, min_tokens=5, stop=["a", " "]),
  je.SamplingParams(temperature=1.0, seed=6, max_tokens=6, prompt_logprobs=1, n=2),
  je.SamplingParams(temperature=1.0, top_p=0.5, seed=3, max_tokens=11, stop_token_ids=[7, 9]),
]


@pytest.fixture(scope="module")
def model():
  return tiny_llama(vocab_size=512, hidden_size=32, num_hidden_layers=1)[0]


@pytest.fixture(scope="module")
def tokenizer():
  return Tokenizer.from_gguf()  # real text for stop strings (the model uses its first 512 ids)


def _engine(model, tokenizer=None, **kwargs):
  kwargs = {"max_num_reqs": 4, "max_model_len": 96, "num_prefix_cache_blocks": 32, **kwargs}
  return LLMEngine(model, tokenizer, **kwargs)


def _run(engine, prompts=PROMPTS, mixes=MIXES, arrive_while_running=True):
  for i, prompt in enumerate(prompts):
    engine.add_request(str(i), prompt, mixes[i % len(mixes)])
    if arrive_while_running:
      engine.step()
  while engine.has_unfinished_requests():
    engine.step()
  return sorted(engine.pop_finished(), key=lambda o: int(o.request_id))


def test_block_hashes_chain_over_full_blocks():
  tokens = list(range(40))
  hashes = block_hashes(tokens)
  assert len(hashes) == 2 and block_hashes(tokens[:32]) == hashes
  assert block_hashes(tokens[:15]) == []
  # A block's hash covers every block before it: equal second blocks, different first ones.
  other = block_hashes([99] + tokens[1:32])
  assert other[0] != hashes[0] and other[1] != hashes[1]


def test_identical_outputs_with_prefix_caching_on_and_off(model, tokenizer):
  off = _run(_engine(model, tokenizer, enable_prefix_caching=False))
  engine = _engine(model, tokenizer)  # on by default
  assert engine.prefix_cache_stats is not None
  assert_same_outputs(_run(engine), off)
  stats = engine.prefix_cache_stats
  assert stats.hits > 0 and stats.evictions == 0
  assert any(isinstance(c.stop_reason, str) for o in off for c in o.outputs)
  # Again, everything but the last prompt now starts with a cached block; all at once this time
  # (prompts sharing uncached blocks in one step are prefilled in waves).
  engine.reset_prefix_cache()
  assert_same_outputs(_run(engine, arrive_while_running=False), off)
  assert_same_outputs(_run(engine), off)
  assert engine.prefix_cache_stats.resets == 1


def test_hits_are_counted_in_tokens_and_a_whole_cached_prompt_is_not_prefilled(model):
  engine = _engine(model)
  prefilled = []  # (first position, end) of every prompt prefilled
  prefill_group = engine.runner._prefill_group
  engine.runner._prefill_group = lambda group, *args: (
    prefilled.extend((start, end) for _, start, end in group) or prefill_group(group, *args)
  )
  greedy = je.SamplingParams(temperature=0, max_tokens=3)
  first = _run(engine, [PREFIX + OWN[2]], [greedy])  # 48 tokens: all three blocks stored
  stats = engine.prefix_cache_stats
  assert (stats.requests, stats.queries, stats.hits, stats.stored_blocks) == (1, 48, 0, 3)
  assert prefilled == [(0, 48)]  # through the last block (decode writes position 47 again)
  _run(engine, [PREFIX[:32] + [7, 8, 9]], [greedy])
  assert (engine.prefix_cache_stats.queries, engine.prefix_cache_stats.hits) == (48 + 35, 32)
  assert prefilled[-1] == (32, 34)  # the remainder only; the last token is decode's
  again = _run(engine, [PREFIX + OWN[2]], [greedy])
  assert engine.prefix_cache_stats.hits == 32 + 48 and len(prefilled) == 2  # nothing to prefill
  assert_same_outputs(again, first)
  # Prompt logprobs need every position: no lookup, but the blocks are stored.
  _run(engine, [PREFIX + OWN[1]], [je.SamplingParams(max_tokens=2, prompt_logprobs=0)])
  assert engine.prefix_cache_stats.requests == 3 and prefilled[-1] == (0, 63)
  # One new block (its fourth ends at position 63, which the decode step writes).
  assert engine.prefix_cache_stats.stored_blocks == 3 + 1


def test_least_recently_used_blocks_are_evicted_last_blocks_first(model):
  cache = PrefixCache(num_blocks=4)
  a, b, c = (block_hashes(RNG.integers(0, 500, n).tolist()) for n in (48, 32, 32))
  assert [i for i, _ in cache.store(a)] == [0, 1, 2]
  cache.store(b)  # one free block, then the least recently used: a's last block
  assert len(cache.match(a, 48)) == 2 and cache.stats.evictions == 1
  cache.store(c)  # b is now the oldest chain: its last block goes, then its first
  assert len(cache.match(b, 32)) == 0 and len(cache.match(a, 48)) == 2
  assert cache.stats.evictions == 3
  assert len(cache.store(block_hashes(RNG.integers(0, 500, 96).tolist()))) == 4  # room cut
  # Through the engine: a pool of 3 blocks holds one 48-token prompt's blocks at a time.
  engine = _engine(model, num_prefix_cache_blocks=3)
  greedy = je.SamplingParams(temperature=0, max_tokens=2)
  x = PREFIX + OWN[2]
  y = x[::-1]
  expected = _run(_engine(model, enable_prefix_caching=False), [x, y, x], [greedy])
  assert_same_outputs(_run(engine, [x, y, x], [greedy]), expected)
  stats = engine.prefix_cache_stats
  assert (stats.hits, stats.evictions, stats.stored_blocks) == (0, 6, 3)


def test_load_weights_empties_the_cache(model):
  engine = _engine(model)
  prompts, greedy = (
    [PREFIX + OWN[0], PREFIX + OWN[5]],
    je.SamplingParams(temperature=0, max_tokens=8),
  )
  before = _run(engine, prompts, [greedy])
  assert engine.prefix_cache_stats.hits == 32
  embed = np.asarray(model.embed[...])
  new = {"model.embed_tokens.weight": RNG.standard_normal(embed.shape).astype(np.float32)}
  engine.load_weights(new)
  after = _run(engine, prompts, [greedy])
  fresh = _engine(model, enable_prefix_caching=False)
  fresh.load_weights(new)
  assert_same_outputs(after, _run(fresh, prompts, [greedy]))
  assert after[0].outputs[0].token_ids != before[0].outputs[0].token_ids
  stats = engine.prefix_cache_stats
  assert stats.resets == 1 and stats.hits == 32 + 32  # the second prompt hit the first's only


def test_compiles_are_bounded_and_steady(model, tokenizer, compile_counter):
  engine = _engine(model, tokenizer, max_model_len=64)
  runner = engine.runner
  assert (runner.row_buckets, runner.length_buckets) == ([1, 2, 4], [16, 32, 64])
  assert runner.prefix_cache is not None and runner.prefix_cache.copy_buckets == [8, 16]
  prompts = [p[:60] for p in PROMPTS]
  mixes = MIXES
  compile_counter.reset()
  expected = _run(engine, prompts, mixes)
  _run(engine, prompts, mixes, arrive_while_running=False)
  # Prefill per row bucket: a (length, attention >= length) pair of {16, 32, 64}: 6, and 3 with
  # prompt logprobs (from position 0); decode per row bucket (attention {64}); block loads and
  # stores per copy bucket; the batch's row write, row move and metadata refresh.
  assert compile_counter.count <= 3 * (6 + 3) + 3 + 2 * 2 + 3
  compile_counter.reset()
  for arrive in (True, False, True):
    engine.reset_prefix_cache()
    assert_same_outputs(_run(engine, prompts, mixes, arrive_while_running=arrive), expected)
  assert compile_counter.count == 0


def test_bad_options_are_refused_by_name(model):
  with pytest.raises(ValueError, match="num_prefix_cache_blocks must be an int >= 1, got 0"):
    _engine(model, num_prefix_cache_blocks=0)
  off = _engine(model, enable_prefix_caching=False)
  assert off.prefix_cache_stats is None and off.reset_prefix_cache()
