"""A short job runs in the step shapes it has already compiled (`jaxengine.worker.buckets.StepShapes`):
the policy on its own (a property over random request streams), and an engine whose batch shrinks
as its requests finish, which compiles fewer executables for the same tokens as a precompiled
engine (whose steps all run in their exact buckets).
"""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
from hypothesis import given, settings

import jaxengine as je
from jaxengine.testing import count_compiles, tiny_llama
from jaxengine.worker import device_steps
from jaxengine.worker.buckets import (
  MAX_PADDING_FACTOR,
  MIN_SAMPLE_ROWS,
  PROMOTE_AFTER,
  SMALL_STEP_TOKENS,
  StepShape,
  StepShapes,
  buckets,
  sample_rows,
)

POWERS = [2**i for i in range(12)]
shapes = st.builds(
  StepShape,
  num_tokens=st.sampled_from(POWERS),
  num_rows=st.sampled_from(POWERS[:6]),
  variant=st.sampled_from([(False, False), (True, False), (False, True)]),
)


@given(st.integers(1, 512), st.integers(1, 4))
def test_the_sampler_runs_over_a_row_bucket_holding_the_rows_and_min_sample_rows(max_reqs, shard):
  """`sample_rows` is a row bucket (a whole number of rows per data-parallel shard), holds the
  model's rows, and at least MIN_SAMPLE_ROWS where the batch has that many: the rows 1 to 8
  share one sampler."""
  row_buckets = buckets(max_reqs * shard, shard)
  for num_rows in row_buckets:
    rows = sample_rows(num_rows, row_buckets)
    assert rows in row_buckets and rows >= num_rows
    least = min(MIN_SAMPLE_ROWS, row_buckets[-1])
    assert rows >= least
    assert rows == num_rows or rows == min(b for b in row_buckets if b >= least)


@settings(max_examples=60, deadline=None)
@given(st.lists(shapes, min_size=1, max_size=60))
def test_a_chosen_shape_holds_the_step_and_was_compiled_or_compiles_now(stream):
  policy = StepShapes()
  compiled: set[StepShape] = set()
  wanted_count: dict[StepShape, int] = {}
  for wanted in stream:
    chosen = policy.choose(wanted)
    wanted_count[wanted] = wanted_count.get(wanted, 0) + 1
    assert chosen.holds(wanted)
    if chosen != wanted:  # a larger compiled shape within the padding bound, before promotion
      assert chosen in compiled
      assert chosen.num_tokens <= max(SMALL_STEP_TOKENS, MAX_PADDING_FACTOR * wanted.num_tokens)
      assert wanted_count[wanted] <= PROMOTE_AFTER
    compiled.add(chosen)
  # Every shape wanted more than PROMOTE_AFTER times has its own executable by now.
  for wanted, count in wanted_count.items():
    if count > PROMOTE_AFTER:
      assert policy.choose(wanted) == wanted


def test_the_smallest_holding_shape_serves_until_promotion():
  policy = StepShapes()
  big, bigger = StepShape(16, 16), StepShape(32, 32)
  assert policy.choose(bigger) == bigger  # nothing holds it: compiles
  assert policy.choose(big) == bigger  # held by `bigger` (within 64 tokens): no compile
  policy.mark_compiled(big)  # e.g. precompile
  small = StepShape(1, 1)
  chosen = [policy.choose(small) for _ in range(PROMOTE_AFTER + 2)]
  assert chosen == [big] * PROMOTE_AFTER + [small, small]
  # Another variant is another executable; a shape far larger than the step is not used.
  assert policy.choose(StepShape(1, 1, (True, False))) == StepShape(1, 1, (True, False))
  policy.choose(StepShape(1024, 16))
  assert policy.choose(StepShape(256, 16)) == StepShape(256, 16)
  assert policy.choose(StepShape(512, 16)) == StepShape(1024, 16)


def test_an_expected_shape_runs_in_any_compiled_host_until_marked_compiled():
  """A shape another thread compiles (`StepShapes.expect`) is never compiled by `choose` while
  some compiled shape holds it, whatever the padding or the uses; once marked it runs as itself.
  A variant nothing holds still compiles at once, and `cancel_expected` restores promotion."""
  policy = StepShapes(promote_after=0)  # a precompiling engine: no hosting of its own
  largest, smallest = StepShape(2048, 16), StepShape(1, 1)
  policy.mark_compiled(largest)
  policy.mark_compiled(smallest)
  decode, prompt = StepShape(8, 8), StepShape(32, 1)
  policy.expect([decode, prompt, largest])  # `largest` is compiled already: not expected
  assert policy.num_expected == 2
  assert [policy.choose(decode) for _ in range(3 * PROMOTE_AFTER)] == [largest] * 3 * PROMOTE_AFTER
  assert policy.choose(smallest) == smallest
  policy.mark_compiled(decode)
  assert policy.choose(decode) == decode and policy.num_expected == 1
  logprobs = StepShape(16, 16, (True, False))
  assert policy.choose(logprobs) == logprobs  # no compiled shape holds it: compiles
  policy.cancel_expected()
  assert policy.choose(prompt) == prompt  # promote_after=0: compiles when first wanted


def _shrinking_batch() -> list[tuple[list[int], je.SamplingParams]]:
  """Eight requests finishing one after another: the batch walks down every row bucket."""
  return [
    (
      [5 + i, 9, 13 + i, 2],
      je.SamplingParams(max_tokens=2 + 3 * i, temperature=0.0, ignore_eos=True),
    )
    for i in range(8)
  ]


def test_a_shrinking_batch_compiles_fewer_steps_and_gives_the_exact_buckets_tokens():
  model, _ = tiny_llama(vocab_size=64, max_position_embeddings=64)
  options = dict(max_num_reqs=8, max_model_len=64, max_num_batched_tokens=32)
  requests = _shrinking_batch()

  def run(llm):
    prompts = [{"prompt_token_ids": p} for p, _ in requests]
    outputs = llm.generate(prompts, [s for _, s in requests], use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]

  device_steps.clear()
  exact = je.LLM(model, precompile=True, **options)
  want = run(exact)
  device_steps.clear()
  with count_compiles() as compiles:
    llm = je.LLM(model, reuse_compiled_shapes=True, **options)
    got = run(llm)
  np.testing.assert_array_equal(np.concatenate(got), np.concatenate(want))
  runner = llm.llm_engine.runner
  # Rows 8 -> 4 -> 2 -> 1 run in the 8-row decode shape: one forward and one sampler executable
  # for decoding, one forward for the prefill.
  sampler_sizes = runner.sample_produced._cache_size()
  forward_sizes = runner.ragged_forward._cache_size()
  assert (forward_sizes, sampler_sizes) == (2, 1), compiles.count
