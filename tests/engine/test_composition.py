"""Every engine feature composes: asynchronous scheduling, speculative decoding (n-gram drafts;
suffix drafts in the full combination) and the k-step decode loop, each on or off, with prefix
caching, over one mixed workload (greedy rows whose prompts repeat n-grams, seeded sampled rows
with logprobs, `n > 1`, prompt logprobs, stop strings and stop ids, a grammar, a logits
processor, a page pool small enough to preempt and a token budget small enough to chunk
prompts). Each combination must give the plain engine's tokens (asynchronous scheduling off, no
drafts, one token per step) and its logprobs to float32 rounding, and must really have done
what it was asked: drafts accepted, k-step loops run, steps overlapped. After `precompile`, the
full combination compiles no step more."""

from __future__ import annotations

import itertools

import pytest
from byte_tokenizer import byte_tokenizer
from step_shapes import one_shape
from test_async_scheduling import _assert_same as assert_same_outputs
from test_async_scheduling import _generate

import jaxengine as je
from jaxengine.engine import EngineConfig, LLMEngine
from jaxengine.testing import TargetOnly, tiny_llama

SPEC = {"method": "ngram", "num_speculative_tokens": 3}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 3}

#: A pool of 14 pages of 4 tokens for 2 rows of up to 96 tokens, and 4 tokens a step: the rows
#: preempt one another and prompts are computed in chunks. The precompile test's sizes too: the
#: one-shape engines' steps (2 rows, 4 tokens) are among those it compiles.
SMALL = {
  "max_num_reqs": 2,
  "max_model_len": 96,
  "block_size": 4,
  "num_kv_blocks": 14,
  "max_num_batched_tokens": 4,
  "enable_prefix_caching": True,
}


@pytest.fixture(scope="module")
def tokenizer():
  return byte_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
  return tiny_llama(vocab_size=tokenizer.vocab_size, max_position_embeddings=128)[0]


def _workload(tokenizer) -> list[tuple[str, je.SamplingParams]]:
  """Greedy rows whose prompts repeat n-grams (drafts get accepted), seeded sampled rows with
  logprobs and `n = 2`, prompt logprobs, a stop string and a stop id, a grammar and a logits
  processor's row."""
  stop_id = tokenizer.encode("q")[-1]
  regex = je.StructuredOutputsParams(regex=r"[a-c]{3}-\d{2}")
  return [
    ("ab ab ab ab ab ab ab", je.SamplingParams(temperature=0, max_tokens=24)),
    ("cd cd cd cd", je.SamplingParams(temperature=0.8, seed=4, max_tokens=16, logprobs=1, n=2)),
    ("The fox. The fox. The fox.", je.SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=1)),
    ("xyz xyz xyz", je.SamplingParams(temperature=0, max_tokens=20, stop=["zz"], logprobs=2)),
    ("pq pq pq pq", je.SamplingParams(temperature=1.0, seed=9, max_tokens=18, stop_token_ids=[stop_id])),
    ("grammar: ", je.SamplingParams(temperature=0.7, seed=2, structured_outputs=regex)),
    ("aaaa", je.SamplingParams(temperature=0, max_tokens=10, extra_args={"target_token": 97})),
  ]  # fmt: skip


class _Counts:
  """Wraps an engine's k-step loop and overlap decision to count what its steps did."""

  def __init__(self, engine: LLMEngine) -> None:
    self.loops_over_one_token = 0  # k-step loops in which some row sampled more than one token
    self.overlapped = 0  # steps left in flight while the next was scheduled
    runner, execute = engine.runner, engine.runner.execute_decode_steps
    core = engine.cores[0]
    overlaps = core._overlaps

    def counted_execute(*args, **kwargs):
      output = execute(*args, **kwargs)
      self.loops_over_one_token += int(output.sampled.num_sampled.max(initial=0) > 1)
      return output

    def counted_overlaps(step):
      result = overlaps(step)
      self.overlapped += int(result)
      return result

    runner.execute_decode_steps = counted_execute
    core._overlaps = counted_overlaps


def _engine(model, tokenizer, **options) -> LLMEngine:
  """An engine over SMALL whose steps run in one shape (2 rows, 4 tokens): the features'
  composition is the point here, and the engines compared pad alike (`one_shape`)."""
  engine = LLMEngine(model, tokenizer, **SMALL, logits_processors=[TargetOnly], **options)
  engine.spec_crossover_tokens = 10**9  # verify whenever a row has a draft
  return one_shape(engine)


def _assert_same(got: dict[str, je.RequestOutput], want: dict[str, je.RequestOutput]) -> None:
  """The reference's tokens, text and reasons; logprobs within 1e-4 (other executables)."""
  assert_same_outputs(got, want, atol=1e-4)


@pytest.fixture(scope="module")
def reference(model, tokenizer):
  """The plain engine's outputs: synchronous steps, no drafts, one token per step."""
  engine = _engine(model, tokenizer, async_scheduling=False)
  outputs = _generate(engine, _workload(tokenizer))
  assert engine.kv_cache_stats.num_preemptions > 0  # the pool really is too small
  return outputs


COMBINATIONS = [
  combination
  for combination in itertools.product([False, True], [None, SPEC], [1, 4])
  if combination != (False, None, 1)  # the reference itself
] + [(True, SUFFIX, 4)]  # suffix drafts: the full combination only (the suite's budget)


@pytest.mark.parametrize(
  "async_scheduling, speculative_config, num_decode_steps",
  COMBINATIONS,
  ids=[
    f"async_{'on' if a else 'off'}-{s['method'] + '3' if s else 'nospec'}-k{k}"
    for a, s, k in COMBINATIONS
  ],
)
def test_every_combination_gives_the_plain_engines_outputs(
  model, tokenizer, reference, async_scheduling, speculative_config, num_decode_steps
):
  engine = _engine(
    model,
    tokenizer,
    async_scheduling=async_scheduling,
    speculative_config=speculative_config,
    num_decode_steps=num_decode_steps,
  )
  assert engine.config.scheduling_overlaps == async_scheduling
  counts = _Counts(engine)
  _assert_same(_generate(engine, _workload(tokenizer)), reference)
  assert engine.kv_cache_stats.num_preemptions > 0
  if speculative_config is not None:
    assert engine.spec_decode_stats.num_accepted_tokens > 0
  if num_decode_steps > 1:
    assert counts.loops_over_one_token > 0
  if async_scheduling and speculative_config is None:
    assert counts.overlapped > 0


def test_async_scheduling_defaults_to_on_with_every_setting():
  """None means on, drafts and k-step loops included (True is accepted); False turns it off."""
  settings = [{"num_decode_steps": 4}, {"speculative_config": SPEC}]
  settings.append({**settings[0], **settings[1]})
  for options in settings:
    assert EngineConfig(**options).scheduling_overlaps
    assert EngineConfig(**options, async_scheduling=True).scheduling_overlaps
    assert not EngineConfig(**options, async_scheduling=False).scheduling_overlaps


def test_the_full_combination_compiles_nothing_after_precompile(model, tokenizer):
  """Asynchronous scheduling, drafts and the k-step loop at once (two rows, 4 tokens a step:
  few shapes): after `precompile`, a mixed workload adds no executable of the plain step, the
  verify step or the k-step loop."""
  engine = LLMEngine(
    model,
    tokenizer,
    **SMALL,
    logits_processors=[TargetOnly],
    async_scheduling=True,
    speculative_config=SPEC,
    num_decode_steps=4,
  )
  engine.spec_crossover_tokens = 10**9
  assert engine.precompile(use_tqdm=False)
  runner = engine.runner
  steps = (
    runner.ragged_forward,
    runner.sample_produced,
    runner.verify_forward,
    runner.rejection_sample_produced,
    runner.decode_steps,
  )
  before = [step._cache_size() for step in steps]
  counts = _Counts(engine)
  workload = _workload(tokenizer)
  _generate(engine, [workload[i] for i in (0, 1, 2, 5)])
  assert [step._cache_size() for step in steps] == before
  assert engine.spec_decode_stats.num_accepted_tokens > 0 and counts.loops_over_one_token > 0


def test_scanned_layers_give_the_plain_engines_outputs(model, tokenizer, reference):
  """Every feature at once on decoder layers under `jax.lax.scan` (``scan_layers=True``, a
  stacked KV cache): chunked prefill, prefix caching, preemption, asynchronous scheduling, drafts
  and the k-step loop give the unrolled plain engine's outputs."""
  engine = _engine(
    model,
    tokenizer,
    async_scheduling=True,
    speculative_config=SPEC,
    num_decode_steps=4,
    scan_layers=True,
  )
  assert engine.runner.kv_cache.stacked_layers == 2 and model.config.scan_layers is False
  counts = _Counts(engine)
  _assert_same(_generate(engine, _workload(tokenizer)), reference)
  assert engine.kv_cache_stats.num_preemptions > 0 and counts.loops_over_one_token > 0
  assert engine.spec_decode_stats.num_accepted_tokens > 0
