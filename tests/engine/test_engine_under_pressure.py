"""The engine's paged KV cache under pressure: same outputs with forced preemption and chunked
prefill, shared prefix and fork blocks, the compile bound, refusals.

One mixed workload (every sampling parameter, `n > 1`, stop ids and strings, a logits processor)
runs once on a plain engine (a pool for every row at full length, a budget above every prompt,
no prefix caching, synchronous steps), whose outputs are checked against an engine-free forward
pass (`tests/helpers/cacheless.py`: greedy tokens are its argmax, every logprob its value), and on engines
that force preemption (a pool smaller than two running requests), chunked prefill (a token budget
below the longer prompts), with prefix caching on and off, at block sizes 4 and 16. Tokens, text,
finish reasons and logprob ranks must equal the plain run's, logprob values to 1e-5. Engines are
built once per module (each compiles its own steps) and every test leaves them empty.
"""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest
from cacheless import assert_greedy_is_argmax, assert_logprobs_match
from step_shapes import one_shape
from test_rollout import assert_same_outputs, run_engine

import jaxengine as je
from jaxengine.core.scheduler import Scheduler, SchedulerOutput
from jaxengine.engine import LLMEngine
from jaxengine.engine_config import EngineConfig
from jaxengine.testing import TargetOnly, count_compiles, tiny_llama
from jaxengine.tokenizer import Tokenizer
from jaxengine.worker import device_steps
from jaxengine.worker.buckets import sample_rows

VOCAB = 512
#: The GGUF tokenizer's size: structured outputs need a model vocabulary that holds it.
TOKENIZER_VOCAB = 49152
COMMON = {"max_num_reqs": 2, "max_model_len": 32, "logits_processors": [TargetOnly]}
#: The plain engine the others are compared with: nothing shared, preempted, split or overlapped.
PLAIN = {"enable_prefix_caching": False, "async_scheduling": False}
PAGED = {
  # 6 usable blocks of 4 (24 tokens): two running requests of 12+ tokens preempt; budget 8
  # splits every prompt above 8 tokens.
  "b4_prefix": {"block_size": 4, "num_kv_blocks": 7, "max_num_batched_tokens": 8},
  "b4_no_prefix": {
    "block_size": 4, "num_kv_blocks": 7, "max_num_batched_tokens": 8,
    "enable_prefix_caching": False,
  },
  # 2 usable blocks of 16: a second request past 16 tokens preempts; precompiled.
  "b16_prefix": {"block_size": 16, "num_kv_blocks": 3, "max_num_batched_tokens": 16},
}  # fmt: skip
PRECOMPILED = "b16_prefix"
CHOICES = ["yes", "no", "maybe"]

RNG = np.random.default_rng(1)
PREFIX = RNG.integers(4, 500, 17).tolist()  # a full block of 16, four of 4


def _rand(n: int) -> list[int]:
  return RNG.integers(4, 500, n).tolist()


SP = je.SamplingParams
#: `(prompt, params)`: prompt + max_tokens <= 24 (the b4 pools' 6 blocks of 4).
REQUESTS = [
  (PREFIX + [10, 11], SP(temperature=0, max_tokens=4, logprobs=2)),
  ([5, 6, 7, 8, 9], SP(temperature=0.8, top_k=VOCAB, top_p=0.9, seed=1, max_tokens=12, logprobs=1)),
  (PREFIX + [12], SP(temperature=1.0, seed=5, n=3, min_p=0.05, max_tokens=5, logprobs=0)),
  (_rand(14), SP(
    temperature=0.7, seed=3, presence_penalty=0.5, frequency_penalty=0.4, repetition_penalty=1.3,
    max_tokens=9,
  )),
  ([40, 41], SP(
    temperature=1.0, seed=7, logit_bias={11: 3.0, 40: -2.0}, bad_words_token_ids=[[11], [40, 41]],
    max_tokens=16,
  )),
  (_rand(6), SP(
    temperature=0.9, seed=2, allowed_token_ids=list(range(20, 60)), min_tokens=4,
    stop_token_ids=[25, 30, 35], max_tokens=12,
  )),
  (PREFIX[:8], SP(temperature=0, ignore_eos=True, max_tokens=14)),
  (_rand(9), SP(temperature=1.0, seed=9, stop=["e"], max_tokens=14)),
  (_rand(4), SP(temperature=0.5, seed=6, max_tokens=5, extra_args={"target_token": 17})),
  (_rand(7), SP(temperature=0.3, seed=12, n=2, max_tokens=8, logprobs=3)),
  (PREFIX + [10, 11, 77], SP(temperature=1.2, seed=8, top_k=5, max_tokens=4)),
]  # fmt: skip


@functools.cache
def _model_and_tokenizer():
  model = tiny_llama(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1)[0]
  return model, Tokenizer.from_gguf()


_PRECOMPILE: dict[str, int] = {}


@functools.cache
def _engine(name: str) -> LLMEngine:
  """The engine `name`; all but the precompiled one run their steps in one shape (`one_shape`):
  paging, preemption and chunks are the point here, and the precompiled engine, in every bucket,
  still compares with the plain one."""
  model, tokenizer = _model_and_tokenizer()
  if name == "plain":
    return one_shape(LLMEngine(model, tokenizer, **COMMON, **PLAIN))
  if name != PRECOMPILED:
    return one_shape(LLMEngine(model, tokenizer, **COMMON, **PAGED[name]))
  device_steps.clear()  # its executables alone: no other engine of this module shares them
  engine = LLMEngine(model, tokenizer, **COMMON, **PAGED[name])
  with count_compiles() as compiles:
    _PRECOMPILE["shapes"] = engine.precompile(use_tqdm=False)
  _PRECOMPILE["compiles"] = compiles.count
  return engine


class _Recorder:
  """Wraps a `Scheduler.schedule` to keep every step's plan and whether it split a prompt."""

  def __init__(self, scheduler: Scheduler) -> None:
    self.scheduler = scheduler
    self.steps: list[SchedulerOutput] = []
    self.num_partial = 0  # steps that left some scheduled completion short of its tokens
    self._schedule = scheduler.schedule
    scheduler.schedule = self._record  # type: ignore[method-assign]

  def _record(self, draft_token_ids=None) -> SchedulerOutput:
    out = self._schedule(draft_token_ids)
    running = self.scheduler.running
    self.num_partial += any(
      out.num_computed_tokens[s] + n < running[s].num_tokens
      for s, n in out.num_scheduled_tokens.items()
    )
    self.steps.append(out)
    return out

  def close(self) -> None:
    del self.scheduler.schedule  # back to the class's method


def _run(engine: LLMEngine, requests=REQUESTS):
  prompts = [p for p, _ in requests]
  return run_engine(engine, prompts, [s for _, s in requests], arrive_while_running=True)


@pytest.fixture(scope="module")
def plain_outputs():
  return _run(_engine("plain"))


def test_the_plain_run_agrees_with_an_engine_free_forward_pass(plain_outputs):
  model = _model_and_tokenizer()[0]
  greedy = [o for o, (_, params) in zip(plain_outputs, REQUESTS) if params.temperature == 0]
  assert assert_greedy_is_argmax(model, greedy, COMMON["max_model_len"]) >= 14  # ignore_eos
  assert assert_logprobs_match(model, plain_outputs, COMMON["max_model_len"]) > 50
  stats = _engine("plain").kv_cache_stats
  assert stats.num_preemptions == 0 and stats.prefix_cache_hits == 0


@pytest.mark.parametrize("name", list(PAGED))
def test_paged_outputs_equal_the_plain_engine(plain_outputs, name):
  engine = _engine(name)
  options = PAGED[name]
  engine.reset_kv_cache_stats()
  recorder = _Recorder(engine.scheduler)
  try:
    with count_compiles() as compiles:
      outputs = _run(engine)
  finally:
    recorder.close()
  assert_same_outputs(outputs, plain_outputs)
  stats = engine.kv_cache_stats
  assert stats is not None and stats.num_used_blocks == 0 and stats.num_running_reqs == 0
  assert stats.num_blocks == options["num_kv_blocks"] - 1
  assert stats.peak_used_blocks <= stats.num_blocks and stats.peak_running_reqs == 2
  budget = options["max_num_batched_tokens"]
  assert all(0 < s.total_num_scheduled_tokens <= budget for s in recorder.steps)
  assert stats.num_preemptions > 0 and recorder.num_partial > 0  # both forced
  if options.get("enable_prefix_caching", True):
    assert stats.prefix_cache_hits > 0 and stats.num_cached_blocks > 0
  else:
    assert stats.prefix_cache_hits == stats.num_cached_blocks == 0
  if name == PRECOMPILED:  # nothing compiles after precompile, the batch's row writes neither
    assert engine.runner.ragged_forward._cache_size() == _PRECOMPILE["shapes"]
    assert compiles.count == 0


def test_precompile_covers_every_shape_and_a_second_run_compiles_nothing(plain_outputs):
  engine = _engine(PRECOMPILED)
  runner = engine.runner
  token_buckets, row_buckets = runner.token_buckets, runner.row_buckets
  assert (token_buckets, row_buckets) == ([1, 2, 4, 8, 16], [1, 2])
  # One row: every token bucket; two rows: from 2 tokens (`token_bucket`'s floor).
  assert [runner.token_bucket(1, r) for r in row_buckets] == [1, 2]
  # And with prompt logprobs: the largest row bucket only (`step_buckets`).
  assert runner.step_shapes(prompt_logprobs=True) == [(2, 2), (4, 2), (8, 2), (16, 2)]
  assert _PRECOMPILE["shapes"] == 5 + 4 + 4
  assert _PRECOMPILE["compiles"] >= _PRECOMPILE["shapes"]
  with count_compiles() as compiles:
    outputs = _run(engine)
  assert compiles.count == 0  # a second run: not even the batch's own helpers
  assert runner.ragged_forward._cache_size() == _PRECOMPILE["shapes"]
  # The sampler: per row bucket of at least MIN_SAMPLE_ROWS rows (here 2: one for both buckets).
  assert (
    runner.sample_produced._cache_size()
    == len({sample_rows(r, row_buckets) for r in row_buckets})
    == 1
  )
  assert_same_outputs(outputs, plain_outputs)
  with pytest.raises(ValueError, match="precompile needs an empty batch"):
    engine.add_request("busy", [5, 6, 7], SP(max_tokens=2))
    engine.step()
    engine.precompile(use_tqdm=False)
  engine.abort_request("busy")
  assert not engine.has_unfinished_requests()
  assert engine.kv_cache_stats.num_used_blocks == 0


def test_a_request_that_never_fits_is_refused_and_the_engine_goes_on(plain_outputs):
  engine = _engine("b4_prefix")
  message = (
    r"a request of up to 30 tokens needs 8 KV cache blocks of 4 tokens, but the pool has 6; "
    r"raise kv_cache_memory_bytes / num_kv_blocks or lower max_tokens"
  )
  with pytest.raises(ValueError, match=message):
    engine.add_request("big", _rand(20), SP(max_tokens=10))
  with pytest.raises(ValueError, match=r"request 1 \(of 2\): a request of up to 32 tokens"):
    engine.add_requests([("ok", [5, 6], SP()), ("big", _rand(25), SP(max_tokens=10))])
  assert not engine.has_unfinished_requests()  # nothing of either call was queued
  # At the limit it runs (alone in the pool), and the engine goes on as before.
  prompt, params = REQUESTS[0]
  engine.add_request("fits", _rand(20), SP(temperature=0, max_tokens=4, ignore_eos=True))
  (expected,) = [o for o in plain_outputs if o.request_id == "0"]
  engine.add_request("0", prompt, params)
  outputs = {}
  while engine.has_unfinished_requests():
    outputs.update({o.request_id: o for o in engine.step() if o.finished})
  assert len(outputs["fits"].outputs[0].token_ids) == 4
  assert_same_outputs([outputs["0"]], [expected])
  assert engine.kv_cache_stats.num_used_blocks == 0


def test_abort_frees_the_pages_of_running_and_waiting_requests():
  engine = _engine("b4_no_prefix")
  params = SP(temperature=1.0, seed=1, n=3, max_tokens=12)  # forks: shared prompt blocks
  engine.add_request("a", PREFIX[:9], params)
  engine.add_request("b", [7, 8, 9], SP(max_tokens=12))
  for _ in range(3):
    engine.step()
  assert engine.kv_cache_stats.num_used_blocks > 0
  engine.abort_request(["a", "b"])
  assert not engine.has_unfinished_requests()
  stats = engine.kv_cache_stats
  assert stats.num_used_blocks == 0 and stats.num_running_reqs == 0
  assert engine.pop_finished() == []  # aborted requests are forgotten


def test_structured_outputs_and_a_logits_processor_hold_under_preemption_and_chunks():
  """A choice, a regex and `TargetOnly` on small pages that preempt and a budget that chunks,
  as on a plain engine; the model's vocabulary holds the tokenizer's."""
  model = tiny_llama(vocab_size=TOKENIZER_VOCAB, hidden_size=32, num_hidden_layers=1)[0]
  tokenizer = _model_and_tokenizer()[1]
  options = {"max_num_reqs": 1, "max_model_len": 16, "logits_processors": [TargetOnly]}
  so = je.StructuredOutputsParams
  requests = [
    ([5, 6, 7], SP(temperature=1.0, seed=4, max_tokens=8, structured_outputs=so(choice=CHOICES))),
    ([8, 9], SP(temperature=0.9, seed=2, max_tokens=8, structured_outputs=so(regex="[ab]{2,5}"))),
    ([10, 11, 12], SP(temperature=0.5, seed=6, max_tokens=4, extra_args={"target_token": 17})),
  ]
  plain = one_shape(LLMEngine(model, tokenizer, **options, **PLAIN))
  paged = one_shape(
    LLMEngine(model, tokenizer, **options, block_size=4, num_kv_blocks=5, max_num_batched_tokens=8)
  )
  expected = _run(plain, requests)
  assert expected[0].outputs[0].text in CHOICES
  assert re.fullmatch("[ab]{2,5}", expected[1].outputs[0].text)
  assert expected[2].outputs[0].token_ids == [17] * 4
  assert_same_outputs(_run(paged, requests), expected)
  assert paged.kv_cache_stats.num_used_blocks == 0


def test_kv_cache_memory_bytes_sizes_the_pool_through_llm():
  """`LLM(model, kv_cache_memory_bytes=...)` builds the paged engine: a page of the tiny model
  costs 2 (keys, values) x L x block_size x K x D x 4 bytes; the null page is not usable."""
  model, _ = _model_and_tokenizer()
  spec = model.kv_cache_spec
  per_block = 2 * spec.num_layers * 4 * spec.num_kv_heads * spec.head_dim * 4
  llm = je.LLM(model, max_num_reqs=2, max_model_len=32, block_size=4,
               kv_cache_memory_bytes=per_block * 10 + per_block // 2)  # fmt: skip
  stats = llm.llm_engine.kv_cache_stats
  assert stats is not None and (stats.num_blocks, stats.num_used_blocks) == (9, 0)
  assert (stats.peak_used_blocks, stats.num_preemptions, stats.peak_running_reqs) == (0, 0, 0)


def test_the_default_token_budget_fits_the_engine():
  """Unset, `max_num_batched_tokens` is 2048, at least `max_model_len` without chunked prefill
  (a whole prompt in one step) and at most `max_num_reqs * max_model_len` (the most one step can
  compute), so precompile compiles no token bucket a step can never reach."""

  def budget(**options) -> int | None:
    return EngineConfig(num_kv_blocks=8, **options).max_num_batched_tokens

  assert budget(max_num_reqs=8, max_model_len=4096) == 2048
  assert budget(max_num_reqs=8, max_model_len=4096, enable_chunked_prefill=False) == 4096
  assert budget(max_num_reqs=2, max_model_len=32) == 64
  assert budget(max_num_reqs=2, max_model_len=32, enable_chunked_prefill=False) == 64
  assert budget(max_num_reqs=4096, max_model_len=8) == 4096
  assert budget(max_num_reqs=2, max_model_len=32, max_num_batched_tokens=16) == 16  # as given


@pytest.mark.parametrize(
  ("options", "match"),
  [
    ({"num_kv_blocks": 1}, r"num_kv_blocks must be an int >= 2, got 1"),
    ({"num_kv_blocks": 8, "block_size": 0}, r"block_size must be an int >= 1, got 0"),
    ({"kv_cache_memory_bytes": 0}, r"kv_cache_memory_bytes must be an int >= 1, got 0"),
    ({"kv_cache_memory_bytes": 1 << 20, "num_kv_blocks": 8}, "not both"),
    ({"kv_cache_memory_bytes": 1000}, r"kv_cache_memory_bytes=1000 holds 0 KV cache blocks"),
    ({"num_kv_blocks": 8, "max_num_batched_tokens": 1}, r"max_num_batched_tokens=1 must be >="),
    ({"num_kv_blocks": 8, "max_num_batched_tokens": 0}, r"max_num_batched_tokens must be a pos"),
    (
      {"num_kv_blocks": 8, "max_num_batched_tokens": 16, "enable_chunked_prefill": False},
      r"max_num_batched_tokens=16 must be >= max_model_len=32 with enable_chunked_prefill=False",
    ),
    ({"num_kv_blocks": 8, "enable_chunked_prefill": "yes"}, "enable_chunked_prefill must be a"),
    ({"num_kv_blocks": 8, "attention_backend": "flash"}, r"attention_backend must be one of"),
  ],
)
def test_bad_paged_options_are_refused_naming_the_field(options, match):
  model, _ = _model_and_tokenizer()
  with pytest.raises(ValueError, match=match):
    LLMEngine(model, max_num_reqs=2, max_model_len=32, **options)


def test_sliding_window_on_pages_equals_an_engine_free_forward_pass():
  """A Mistral-style window of 8 over prompts longer than it: greedy tokens are the argmax and
  logprobs within 1e-4 of an engine-free forward pass over the whole sequence (its window applied
  by the model's own attention), with chunked prefill (budget 8), pages of 4 and preemption; the
  GPU Pallas backend (no window) is refused at construction."""
  model = tiny_llama(vocab_size=64, hidden_size=32, sliding_window=8)[0]
  assert model.kv_cache_spec.sliding_window == 8
  rng = np.random.default_rng(3)
  prompts = [rng.integers(4, 64, n).tolist() for n in (13, 19, 10)]
  params = SP(temperature=0, ignore_eos=True, max_tokens=6, logprobs=2)
  options = {"max_num_reqs": 2, "max_model_len": 32}
  paged = one_shape(
    LLMEngine(model, **options, block_size=4, num_kv_blocks=8, max_num_batched_tokens=8)
  )
  got = run_engine(paged, prompts, [params], arrive_while_running=True)
  assert [len(o.outputs[0].token_ids) for o in got] == [6, 6, 6]
  assert assert_greedy_is_argmax(model, got, 32) == 18
  assert assert_logprobs_match(model, got, 32) == 18 * 2  # the top 2, the greedy token first
  stats = paged.kv_cache_stats
  assert stats.num_preemptions > 0 and stats.num_used_blocks == 0
  with pytest.raises(ValueError, match="'pallas_gpu' has no sliding-window attention, got sli"):
    LLMEngine(model, **options, num_kv_blocks=8, attention_backend="pallas_gpu")
