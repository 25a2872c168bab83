"""Prefix caching (`enable_prefix_caching`): the same outputs with the cache on and off, hits and
LRU evictions counted, the cache emptied by `load_weights`, and a bounded number of compiles."""

from __future__ import annotations

import numpy as np
import pytest
from test_rollout import assert_same_outputs, run_engine

import jaxengine as je
from jaxengine.engine import LLMEngine
from jaxengine.engine.prefix_cache import PrefixCache, block_hashes
from jaxengine.testing import tiny_llama
from jaxengine.tokenizer import Tokenizer

RNG = np.random.default_rng(0)
PREFIX = RNG.integers(4, 500, 40).tolist()  # two full blocks and 8 tokens
OWN = [RNG.integers(4, 500, k).tolist() for k in (3, 8, 2, 0, 17, 9)]
PROMPTS = [
  PREFIX + OWN[0],
  PREFIX + OWN[1],  # 48 tokens: exactly 3 blocks
  PREFIX[:32],  # exactly the two blocks the others start with: entirely a cached prefix
  PREFIX + OWN[2],
  PREFIX + OWN[3],
  PREFIX[:32] + OWN[4],
  PREFIX + OWN[5],
  OWN[4],  # no shared prefix
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
def engines(model):
  """Two engines shared by the tests (each engine compiles its own steps): prefix caching off,
  and on with a pool of 6 blocks. Two rows: later samples of n > 1 and later prompts find the
  blocks of earlier ones. Tests leave the weights as they found them and look at differences of
  the cumulative counters."""
  tokenizer = Tokenizer.from_gguf()  # real text for stop strings (the model uses 512 ids)
  kwargs = {"max_num_reqs": 2, "max_model_len": 64}
  return {
    "off": LLMEngine(model, tokenizer, enable_prefix_caching=False, **kwargs),
    "on": LLMEngine(model, tokenizer, num_prefix_cache_blocks=6, **kwargs),  # on by default
  }


def _run(engine, prompts=PROMPTS, mixes=MIXES, arrive_while_running=True):
  return run_engine(engine, prompts, mixes, arrive_while_running)


def _counts(engine, before=None):
  """(requests, queries, hits, evictions, resets) since `before`."""
  stats = engine.prefix_cache_stats
  now = (stats.requests, stats.queries, stats.hits, stats.evictions, stats.resets)
  return now if before is None else tuple(a - b for a, b in zip(now, before))


def test_block_hashes_chain_over_full_blocks():
  tokens = list(range(40))
  hashes = block_hashes(tokens)
  assert len(hashes) == 2 and block_hashes(tokens[:32]) == hashes
  assert block_hashes(tokens[:15]) == []
  # A block's hash covers every block before it: equal second blocks, different first ones.
  other = block_hashes([99] + tokens[1:32])
  assert other[0] != hashes[0] and other[1] != hashes[1]


def test_identical_outputs_with_prefix_caching_on_and_off(engines, compile_counter):
  off, on = engines["off"], engines["on"]
  expected = _run(off)
  assert any(isinstance(c.stop_reason, str) for o in expected for c in o.outputs)
  on.reset_prefix_cache()
  before = _counts(on)
  assert_same_outputs(_run(on), expected)
  assert _counts(on, before)[2] > 0  # hits
  # Again with the pool holding the last prompts' blocks, then all at once (prompts sharing
  # uncached blocks in one step are prefilled in waves: the first stores them, the others load).
  assert_same_outputs(_run(on), expected)
  on.reset_prefix_cache()
  assert_same_outputs(_run(on, arrive_while_running=False), expected)
  assert _counts(on, before)[4] == 1  # resets
  # Compile bound (per row bucket {1, 2}: a prefill per pair (length, attention >= length) of
  # {16, 32, 64}: 6, and 3 with prompt logprobs, which start at 0; a decode per attention
  # bucket {64}); block loads and stores once per copy bucket {8}.
  runner = on.runner
  assert (runner.row_buckets, runner.length_buckets) == ([1, 2], [16, 32, 64])
  assert runner.prefix_cache is not None and runner.prefix_cache.copy_buckets == [8]
  steps = runner.steps
  assert steps.prefill._cache_size() <= 2 * 6 and steps.prefill_logprobs._cache_size() <= 6
  assert steps.decode._cache_size() <= 2
  # Steady: the same arrivals compile nothing more.
  compile_counter.reset()
  for arrive in (True, False):
    on.reset_prefix_cache()
    assert_same_outputs(_run(on, arrive_while_running=arrive), expected)
  assert compile_counter.count == 0


def test_hits_are_counted_in_tokens_and_a_whole_cached_prompt_is_not_prefilled(engines):
  engine = engines["on"]
  engine.reset_prefix_cache()
  prefilled = []  # (first position, end) of every prompt prefilled
  runner = engine.runner
  prefill_group = runner._prefill_group
  runner._prefill_group = lambda group, *args: (
    prefilled.extend((start, end) for _, start, end in group) or prefill_group(group, *args)
  )
  try:
    greedy = je.SamplingParams(temperature=0, max_tokens=3)
    before = _counts(engine)
    first = _run(engine, [PREFIX + OWN[1]], [greedy])  # 48 tokens: all three blocks stored
    assert _counts(engine, before)[:3] == (1, 48, 0)
    assert engine.prefix_cache_stats.stored_blocks == 3
    assert prefilled == [(0, 48)]  # through the last block (decode writes position 47 again)
    _run(engine, [PREFIX[:32] + [7, 8, 9]], [greedy])
    assert _counts(engine, before)[:3] == (2, 48 + 35, 32)
    assert prefilled[-1] == (32, 34)  # the remainder only; the last token is decode's
    again = _run(engine, [PREFIX + OWN[1]], [greedy])
    assert _counts(engine, before)[2] == 32 + 48 and len(prefilled) == 2  # nothing prefilled
    assert_same_outputs(again, first)
    # Prompt logprobs need every position: no lookup, but the blocks are stored.
    _run(engine, [PREFIX + OWN[4]], [je.SamplingParams(max_tokens=2, prompt_logprobs=0)])
    assert _counts(engine, before)[0] == 3 and prefilled[-1] == (0, 56)
    assert engine.prefix_cache_stats.stored_blocks == 3 + 1  # the first two were held
  finally:
    del runner._prefill_group


def test_least_recently_used_blocks_are_evicted_last_blocks_first(engines):
  cache = PrefixCache(num_blocks=4)
  a, b, c = (block_hashes(RNG.integers(0, 500, n).tolist()) for n in (48, 32, 32))
  assert [i for i, _ in cache.store(a)] == [0, 1, 2]
  cache.store(b)  # one free block, then the least recently used: a's last block
  assert len(cache.match(a, 48)) == 2 and cache.stats.evictions == 1
  cache.store(c)  # b is now the oldest chain: its last block goes, then its first
  assert len(cache.match(b, 32)) == 0 and len(cache.match(a, 48)) == 2
  assert cache.stats.evictions == 3
  assert len(cache.store(block_hashes(RNG.integers(0, 500, 96).tolist()))) == 4  # room cut
  # Through the engine: its pool of 6 blocks holds two 48-token prompts' blocks.
  engine = engines["on"]
  engine.reset_prefix_cache()
  greedy = je.SamplingParams(temperature=0, max_tokens=2)
  x = PREFIX + OWN[1]
  prompts = [x, x[::-1], x[1:] + x[:1], x, x[::-1]]
  expected = _run(engines["off"], prompts, [greedy])
  before = _counts(engine)
  assert_same_outputs(_run(engine, prompts, [greedy]), expected)
  # The third evicts the first's blocks (least recently used), the first then the second's, the
  # second the third's.
  assert _counts(engine, before)[2:4] == (0, 9)


def test_load_weights_empties_the_cache(model, engines):
  off, on = engines["off"], engines["on"]
  prompts = [PREFIX + OWN[0], PREFIX + OWN[5]]
  greedy = je.SamplingParams(temperature=0, max_tokens=8)
  on.reset_prefix_cache()
  before = _counts(on)
  old = _run(on, prompts, [greedy])
  assert _counts(on, before)[2] == 32
  embed = np.asarray(model.embed[...])
  new = RNG.standard_normal(embed.shape).astype(np.float32)
  try:
    for engine in (on, off):
      engine.load_weights({"model.embed_tokens.weight": new})
    got = _run(on, prompts, [greedy])
    assert_same_outputs(got, _run(off, prompts, [greedy]))
    assert got[0].outputs[0].token_ids != old[0].outputs[0].token_ids
    # Emptied: the second prompt hit only the first's blocks again.
    assert _counts(on, before)[2:] == (32 + 32, 0, 1)
  finally:
    for engine in (on, off):
      engine.load_weights({"model.embed_tokens.weight": embed})


def test_bad_options_are_refused_by_name(model):
  with pytest.raises(ValueError, match="num_prefix_cache_blocks must be an int >= 1, got 0"):
    LLMEngine(model, num_prefix_cache_blocks=0)
  with pytest.raises(ValueError, match="enable_prefix_caching must be a bool or None, got 'yes'"):
    LLMEngine(model, enable_prefix_caching="yes")  # type: ignore[arg-type]
  off = LLMEngine(model, max_num_reqs=1, max_model_len=16, enable_prefix_caching=False)
  assert off.prefix_cache_stats is None and off.reset_prefix_cache()


def test_a_pool_too_large_for_the_device_fails_before_the_host_index(model, monkeypatch):
  # A huge num_prefix_cache_blocks must fail on the device allocation (a clear error), not
  # build a host free list of that many blocks first (10**9 blocks: the process was killed).
  from jaxengine.engine import prefix_prefill

  built = []
  monkeypatch.setattr(prefix_prefill, "PrefixCache", lambda n: built.append(n))

  def create_pool(spec, num_blocks):
    raise MemoryError(f"{num_blocks} blocks")

  monkeypatch.setattr(prefix_prefill, "create_pool", create_pool)
  with pytest.raises(MemoryError, match="1000000000 blocks"):
    LLMEngine(model, max_num_reqs=1, max_model_len=16, num_prefix_cache_blocks=10**9)
  assert built == []


def test_mesh_and_cli_options(model):
  mesh = je.make_mesh(1, 1)
  with pytest.raises(ValueError, match="enable_prefix_caching=True is not supported on a mesh"):
    LLMEngine(model, max_num_reqs=1, max_model_len=16, mesh=mesh, enable_prefix_caching=True)
  from jaxengine import cli

  parse = cli.build_parser().parse_args
  assert parse(["generate", "Hi"]).enable_prefix_caching is None  # the engine's default: on
  assert parse(["generate", "--no-enable-prefix-caching", "Hi"]).enable_prefix_caching is False
