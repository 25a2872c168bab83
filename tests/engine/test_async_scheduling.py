"""Asynchronous scheduling: the engine dispatches step t + 1 before it reads step t. Its outputs
must be those of synchronous steps across the feature matrix, no request may be lost or
duplicated as requests come and go, and the batch's lazily read `sample` must append exactly
what an eager one did."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from batch_utils import MML, RAW, R, V, make_batch
from byte_tokenizer import byte_tokenizer
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from step_shapes import one_shape

import jaxengine as je
from jaxengine.batch.step_queue import MAX_PENDING_STEPS
from jaxengine.engine import EngineConfig, LLMEngine
from jaxengine.testing import tiny_llama

MAX_MODEL_LEN = 96


@pytest.fixture(scope="module")
def tokenizer():
  return byte_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
  return tiny_llama(vocab_size=tokenizer.vocab_size, max_position_embeddings=128)[0]


def _engine(model, tokenizer, async_scheduling, **options) -> LLMEngine:
  return LLMEngine(
    model,
    tokenizer,
    max_num_reqs=4,
    max_model_len=MAX_MODEL_LEN,
    async_scheduling=async_scheduling,
    **options,
  )


def _mix() -> list[tuple[str, je.SamplingParams]]:
  """Every per-request feature at once: greedy and seeded rows, logprobs and prompt logprobs,
  `n > 1`, stop ids and strings, min_tokens, length limits of every size, a grammar, prompts
  that share their first pages."""
  shared = "The quick brown fox jumps over the lazy dog. " * 2
  regex = je.StructuredOutputsParams(regex=r"[a-c]{3}-\d{2}")
  return [
    (shared + "One", je.SamplingParams(temperature=0, max_tokens=20, logprobs=2)),
    (shared + "Two", je.SamplingParams(temperature=1.0, seed=7, max_tokens=17, n=3, logprobs=0)),
    ("hello", je.SamplingParams(temperature=0.9, seed=3, max_tokens=30, stop=["e", "a"])),
    ("abc", je.SamplingParams(temperature=1.0, seed=5, top_k=20, stop_token_ids=[101, 102])),
    (shared, je.SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)),
    ("x", je.SamplingParams(temperature=1.2, seed=11, min_tokens=5, max_tokens=9)),
    ("grammar: ", je.SamplingParams(temperature=0.8, seed=2, structured_outputs=regex)),
    (shared + "Three", je.SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)),
    ("q", je.SamplingParams(temperature=0.7, seed=9, top_p=0.9, max_tokens=25, logprobs=1)),
  ]


def _generate(engine: LLMEngine, requests) -> dict[str, je.RequestOutput]:
  """Adds every request at once and steps to the end; each request's final output (checked to be
  reported finished exactly once)."""
  for index, (prompt, params) in enumerate(requests):
    engine.add_request(str(index), prompt, params)
  finished: dict[str, je.RequestOutput] = {}
  while engine.has_unfinished_requests():
    for output in engine.step():
      if output.finished:
        assert output.request_id not in finished, output.request_id
        finished[output.request_id] = output
  assert engine.pop_finished() == []  # every request reported through step(), and forgotten
  return finished


def _assert_same(
  got: dict[str, je.RequestOutput], want: dict[str, je.RequestOutput], atol: float = 1e-5
) -> None:
  """Same requests, tokens, text and finish and stop reasons; logprobs as `_assert_same_logprobs`."""
  assert got.keys() == want.keys()
  for request_id, output in want.items():
    other = got[request_id]
    _assert_same_logprobs(other.prompt_logprobs, output.prompt_logprobs, atol)
    for a, b in zip(other.outputs, output.outputs, strict=True):
      assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == (
        b.token_ids,
        b.text,
        b.finish_reason,
        b.stop_reason,
      ), request_id
      _assert_same_logprobs(a.logprobs, b.logprobs, atol)


def _assert_same_logprobs(got, want, atol: float = 1e-5) -> None:
  """Same positions, tokens and ranks; values within `atol` (float32 rounding: steps may run in
  other row buckets or executables)."""
  assert (got is None) == (want is None)
  for a, b in zip(got or [], want or [], strict=True):
    assert (a is None) == (b is None)
    if a is not None:
      assert {t: lp.rank for t, lp in a.items()} == {t: lp.rank for t, lp in b.items()}
      for token, value in a.items():
        assert value.logprob == pytest.approx(b[token].logprob, abs=atol)


@pytest.mark.parametrize(
  "options",
  [
    {},
    {"num_kv_blocks": 8, "max_num_batched_tokens": 16},  # preemption, chunked prefill
  ],
  ids=["every_feature", "preemption_and_chunks"],
)
def test_async_outputs_equal_synchronous_outputs(model, tokenizer, options):
  """Greedy and seeded requests with every per-request feature produce the same tokens, text,
  finish reasons and logprobs whether steps overlap or not."""
  # Both in one step shape: overlap, not bucket choice, is the point (they pad alike).
  synchronous = one_shape(_engine(model, tokenizer, False, **options))
  overlapped = one_shape(_engine(model, tokenizer, None, **options))
  assert overlapped.config.scheduling_overlaps and not synchronous.config.scheduling_overlaps
  requests = _mix()
  want = _generate(synchronous, requests)
  got = _generate(overlapped, requests)
  _assert_same(got, want)
  if "num_kv_blocks" in options:
    stats = overlapped.kv_cache_stats
    assert stats is not None and stats.num_preemptions > 0  # the pool really was too small


def test_speculative_decoding_reads_the_step_in_flight_before_drafting(model, tokenizer):
  """Drafts need each row's last token on the host: with a speculative_config asynchronous
  scheduling is on by default and each step reads the one in flight before drafting; the
  outputs are the plain engine's and drafts are accepted."""
  spec = {"method": "ngram", "num_speculative_tokens": 3}
  engine = one_shape(_engine(model, tokenizer, None, speculative_config=spec))
  assert engine.config.scheduling_overlaps
  engine.spec_crossover_tokens = 10**9  # verify whenever a row has a draft
  requests = [
    ("ab ab ab ab ab ab", je.SamplingParams(temperature=0, max_tokens=24)),
    ("cd cd cd cd", je.SamplingParams(temperature=0.8, seed=4, max_tokens=16, logprobs=1)),
  ]
  plain = one_shape(_engine(model, tokenizer, None))
  _assert_same(_generate(engine, requests), _generate(plain, requests))
  assert engine.spec_decode_stats.num_accepted_tokens > 0


def test_a_step_is_read_while_the_next_runs(model, tokenizer):
  """The first `step()` dispatches the prefill and returns nothing; each later call returns the
  token of the step before. The step that reaches the length limit is read before anything more
  is scheduled (the request never runs a step past it), in the next call rather than with the
  step before it: one token per call, so that a stream gets one chunk per token, the last too."""
  engine = one_shape(_engine(model, tokenizer, None))
  engine.add_request("a", "hi", je.SamplingParams(temperature=0, max_tokens=3))
  assert engine.step() == []
  assert engine.has_unfinished_requests()
  # One record of the request's tokens: the batch counts the unread token in the completion's
  # placeholders and reads its tokens from the completion (no list of its own).
  batch, completion = engine.runner.input_batch, engine.cores[0].scheduler.running["a"]
  assert completion.num_output_placeholders == 1
  assert batch.num_tokens("a") == completion.num_tokens_with_placeholders
  assert batch.output_token_ids("a") is completion.token_ids
  counts = []
  while engine.has_unfinished_requests():
    counts.extend(len(o.outputs[0].token_ids) for o in engine.step())
  assert counts == [1, 2, 3]
  assert engine.runner.input_batch.num_reqs == 0


@pytest.mark.parametrize(
  "options",
  [
    {"num_decode_steps": 4},
    {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
  ],
)
def test_async_scheduling_composes_with_every_setting(options):
  """What used to be refused (True with k > 1 or drafts) is accepted, and None means on."""
  assert EngineConfig(**{"async_scheduling": True, **options}).scheduling_overlaps
  assert EngineConfig(**options).scheduling_overlaps


def test_a_bad_async_scheduling_is_refused():
  with pytest.raises(ValueError, match="async_scheduling must be a bool or None"):
    EngineConfig(async_scheduling="yes")


def test_precompiled_async_engine_compiles_no_step_more(model, tokenizer):
  """The compile bound is unchanged: after `precompile`, a mixed workload adds no executable of
  the model or sampler steps (prompt logprobs, whose variant precompile does not build, left
  out)."""
  engine = _engine(model, tokenizer, None, max_num_batched_tokens=16)
  assert engine.precompile(use_tqdm=False)
  runner = engine.runner
  steps = (runner.ragged_forward, runner.sample_produced)
  before = [step._cache_size() for step in steps]
  _generate(engine, [r for r in _mix() if r[1].prompt_logprobs is None])
  assert [step._cache_size() for step in steps] == before


# --- the batch's lazily read sample ------------------------------------------------------------


def _batch(seed_offset: int = 0) -> je.InputBatch:
  batch = make_batch(**RAW)  # a standard sampler executable (tests/helpers/batch_utils)
  for i in range(3):
    params = je.SamplingParams(temperature=1.0, seed=seed_offset + i, logprobs=i)
    batch.add_request(str(i), [1 + i, 2, 3], params)
  return batch


def test_lazy_sample_appends_what_an_eager_read_does():
  """Tokens join the outputs when read (in order, however many steps were left unread); counts
  include the unread ones; a request removed meanwhile drops its unread tokens."""
  rng = np.random.default_rng(0)
  logits = [rng.normal(size=(R, V)).astype(np.float32) for _ in range(MAX_PENDING_STEPS + 3)]
  eager, lazy = _batch(), _batch()
  eager_tokens = [eager.sample(step).sampled_token_ids for step in logits[:2]]
  results = [lazy.sample(step) for step in logits[:2]]
  assert lazy.num_tokens("0") == 3 + 2  # counted before being read
  assert isinstance(results[0].device.sampled_token_ids, jax.Array)
  np.testing.assert_array_equal(results[1].sampled_token_ids, eager_tokens[1])
  np.testing.assert_array_equal(results[0].sampled_token_ids, eager_tokens[0])
  assert lazy.req_output_token_ids == eager.req_output_token_ids
  for step in logits[2:]:  # a longer backlog than the batch keeps unread
    want = eager.sample(step).result()
    last = lazy.sample(step)
  assert lazy.num_tokens("1") == eager.num_tokens("1")
  assert lazy.output_token_ids("2") == eager.output_token_ids("2")
  assert last.logprobs is not None and want.logprobs is not None
  np.testing.assert_array_equal(last.logprobs.logprobs, want.logprobs.logprobs)
  pending = lazy.sample(logits[0])
  lazy.remove_request("1")
  lazy.condense()
  assert pending.sampled_token_ids.shape == (3,)  # the step's rows at dispatch
  assert lazy.req_ids == ["0", "2"] and lazy.num_tokens("2") == eager.num_tokens("2") + 1


def test_lazy_sample_still_refuses_a_full_request_before_any_device_work():
  batch = make_batch(**RAW)
  batch.add_request("a", [1] * (MML - 2), je.SamplingParams(temperature=0))
  logits = np.zeros((R, V), np.float32)
  batch.sample(logits)
  batch.sample(logits)  # unread: max_model_len tokens counted
  with pytest.raises(ValueError, match="max_model_len"):
    batch.sample(logits)
  assert len(batch.output_token_ids("a")) == 2


# --- requests coming and going -----------------------------------------------------------------


PROMPTS = st.lists(st.integers(3, 60), min_size=1, max_size=12)


class AsyncEngineMachine(RuleBasedStateMachine):
  """Requests are added and aborted between steps of an asynchronous engine. Invariants: the
  batch's rows are exactly the running completions; reported outputs only grow; no request is
  reported finished twice; at the end every request not aborted has finished once, with the
  tokens a synchronous engine gives it."""

  engines: tuple[LLMEngine, LLMEngine] | None = None

  def __init__(self) -> None:
    super().__init__()
    model = tiny_llama(vocab_size=64, max_position_embeddings=64)[0]
    if AsyncEngineMachine.engines is None:  # in one step shape each: they pad alike
      AsyncEngineMachine.engines = (
        one_shape(
          LLMEngine(model, None, max_num_reqs=3, max_model_len=40, num_kv_blocks=10, block_size=4)
        ),
        one_shape(LLMEngine(model, None, max_num_reqs=3, max_model_len=40, async_scheduling=False)),
      )
    self.engine, self.reference = AsyncEngineMachine.engines
    self.requests: dict[str, tuple[list[int], je.SamplingParams]] = {}
    self.aborted: set[str] = set()
    self.finished: dict[str, je.RequestOutput] = {}
    self.seen: dict[str, list[list[int]]] = {}
    self.count = 0

  @rule(prompt=PROMPTS, greedy=st.booleans(), max_tokens=st.integers(1, 10), n=st.integers(1, 2))
  def add(self, prompt, greedy, max_tokens, n):
    request_id = f"r{self.count}"
    self.count += 1
    params = je.SamplingParams(
      temperature=0 if greedy else 1.0,
      seed=None if greedy else self.count,
      max_tokens=max_tokens,
      n=1 if greedy else n,
      stop_token_ids=[5],
    )
    self.engine.add_request(request_id, prompt, params)
    self.requests[request_id] = (prompt, params)

  @precondition(lambda self: self.requests.keys() - self.finished.keys() - self.aborted)
  @rule(data=st.data())
  def abort(self, data):
    live = sorted(self.requests.keys() - self.finished.keys() - self.aborted)
    request_id = data.draw(st.sampled_from(live))
    self.engine.abort_request(request_id)
    self.aborted.add(request_id)

  @rule()
  def step(self):
    for output in self.engine.step():
      self._record(output)

  def _record(self, output: je.RequestOutput) -> None:
    request_id = output.request_id
    assert request_id not in self.aborted and request_id not in self.finished
    tokens = [c.token_ids for c in output.outputs]
    for before, now in zip(self.seen.get(request_id, []), tokens):
      assert now[: len(before)] == before  # outputs only grow
    self.seen[request_id] = tokens
    if output.finished:
      self.finished[request_id] = output

  @invariant()
  def rows_are_the_running_completions(self):
    batch = self.engine.runner.input_batch
    rows = sorted(r for r in batch.req_ids if r is not None)
    assert rows == sorted(self.engine.scheduler.running)
    for completion in self.engine.scheduler.running.values():
      assert 0 <= completion.num_output_placeholders <= 1

  def teardown(self):
    while self.engine.has_unfinished_requests():
      for output in self.engine.step():
        self._record(output)
    assert self.engine.pop_finished() == []  # each reported finished through step(), forgotten
    expected = self.requests.keys() - self.aborted
    stats = self.engine.kv_cache_stats  # everything freed: pages, rows, placeholders
    assert stats is not None and stats.num_used_blocks == 0
    assert self.engine.runner.input_batch.num_reqs == 0 and not self.engine.scheduler.running
    assert self.finished.keys() == expected
    if expected:
      reference = _generate_ids(self.reference, {r: self.requests[r] for r in sorted(expected)})
      for request_id in expected:
        got = [c.token_ids for c in self.finished[request_id].outputs]
        assert got == reference[request_id], request_id


def _generate_ids(engine: LLMEngine, requests) -> dict[str, list[list[int]]]:
  for request_id, (prompt, params) in requests.items():
    engine.add_request(request_id, prompt, params)
  done = {}
  while engine.has_unfinished_requests():
    for output in engine.step():
      if output.finished:
        done[output.request_id] = [c.token_ids for c in output.outputs]
  return done


AsyncEngineMachine.TestCase.settings = settings(
  max_examples=12,
  stateful_step_count=25,
  deadline=None,
  suppress_health_check=[HealthCheck.too_slow],
)
TestAsyncEngine = AsyncEngineMachine.TestCase


# --- pausing for a weight sync (asynchronous RL, `jaxengine/engine/pause.py`) ---------------------

_PAUSED_MIX = [
  ("ab ab ab ab ab ab", je.SamplingParams(temperature=0, max_tokens=20, logprobs=1)),
  ("cd cd cd cd", je.SamplingParams(temperature=0.9, seed=4, max_tokens=18, logprobs=0)),
  ("hello", je.SamplingParams(temperature=1.0, seed=3, top_k=20, max_tokens=16, n=2)),
]


def _run_with_pause(engine: LLMEngine, requests, steps_before: int) -> dict[str, je.RequestOutput]:
  """`_generate` with a "keep" pause after `steps_before` steps: while paused, `step` advances
  nothing and a request added then is held; after `resume_generation` it all goes on."""
  for index, (prompt, params) in enumerate(requests):
    engine.add_request(str(index), prompt, params)
  finished: dict[str, je.RequestOutput] = {}

  def take(outputs) -> None:
    for output in outputs:
      if output.finished:
        assert output.request_id not in finished, output.request_id
        finished[output.request_id] = output

  for _ in range(steps_before):
    take(engine.step())
  take(engine.pause_generation("keep"))
  assert engine.is_paused() and engine.is_generation_frozen()
  assert engine.pause_generation("keep") == []  # pausing twice is harmless
  tokens = {c.seq_id: len(c.token_ids) for c in engine.scheduler.running.values()}
  assert any(tokens.values())  # rows are kept mid-generation (some mid-prefill)
  engine.add_request("held", *requests[0])
  for _ in range(3):
    assert engine.step() == []
  assert tokens == {c.seq_id: len(c.token_ids) for c in engine.scheduler.running.values()}
  assert all(not c.num_output_placeholders for c in engine.scheduler.running.values())
  assert "held" not in {c.request.request_id for c in engine.scheduler.waiting}
  engine.resume_generation()
  engine.resume_generation()  # resuming when not paused is harmless
  assert not engine.is_paused()
  take(engine.step())
  while engine.has_unfinished_requests():
    take(engine.step())
  assert engine.pop_finished() == []
  return finished


@pytest.mark.parametrize(
  "options",
  [
    {},
    {"num_decode_steps": 4},
    {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
    {"speculative_config": {"method": "suffix", "num_speculative_tokens": 3}},
  ],
  ids=["async", "multi_step", "drafts", "suffix_drafts"],
)
def test_a_kept_pause_equals_an_uninterrupted_run(model, tokenizer, options):
  """A "keep" pause at any point (a step in flight, a k-step loop, a verify step, a prefill
  chunk) loses nothing: greedy and seeded outputs (tokens, text, logprobs) are those of an
  uninterrupted run on the same engine, and a request added while paused starts after resume
  with the output it gets on its own."""
  engine = one_shape(_engine(model, tokenizer, None, max_num_batched_tokens=16, **options))
  engine.spec_crossover_tokens = 10**9  # verify whenever a row has a draft
  want = _generate(engine, _PAUSED_MIX)
  want_held = _generate(engine, _PAUSED_MIX[:1])["0"]
  for steps_before in (2, 5):
    engine.reset_prefix_cache()
    got = _run_with_pause(engine, _PAUSED_MIX, steps_before)
    _assert_same({k: v for k, v in got.items() if k != "held"}, want)
    _assert_same({"0": got["held"]}, {"0": want_held})
  if "speculative_config" in options:
    assert engine.spec_decode_stats.num_accepted_tokens > 0


def test_wait_and_abort_pauses_and_bad_modes(model, tokenizer):
  """ "wait" returns once the requests in the engine have finished (their outputs returned);
  "abort" ends them now with finish reason "abort" and the tokens and logprobs they had, freeing
  their rows and pages; a bad mode is refused and changes nothing."""
  engine = one_shape(_engine(model, tokenizer, None))
  for bad in ("stop", None, 1):
    with pytest.raises(
      ValueError, match=f"mode must be one of 'keep', 'wait', 'abort', got {bad!r}"
    ):
      engine.pause_generation(bad)  # type: ignore[arg-type]
    assert not engine.is_paused()
  requests = _PAUSED_MIX[:2]
  for index, (prompt, params) in enumerate(requests):
    engine.add_request(str(index), prompt, params)
  engine.step()
  engine.step()
  waited = {o.request_id: o for o in engine.pause_generation("wait")}
  assert engine.is_paused() and not engine.has_unfinished_requests()
  assert sorted(waited) == ["0", "1"] and all(o.finished for o in waited.values())
  assert [len(o.outputs[0].token_ids) for o in waited.values()] == [20, 18]
  engine.resume_generation()
  for index, (prompt, params) in enumerate(_PAUSED_MIX):
    engine.add_request(str(index), prompt, params)
  for _ in range(4):
    engine.step()
  aborted = {o.request_id: o for o in engine.pause_generation("abort")}
  assert sorted(aborted) == ["0", "1", "2"]
  for request_id, output in aborted.items():
    assert output.finished
    for completion in output.outputs:
      assert completion.finish_reason == "abort"
      assert 0 < len(completion.token_ids) < 16
      if request_id != "2":  # those asked for logprobs: one per token they had
        assert len(completion.logprobs or []) == len(completion.token_ids)
  assert not engine.has_unfinished_requests() and engine.pop_finished() == []
  assert engine.kv_cache_stats.num_used_blocks == 0 and engine.runner.input_batch.num_reqs == 0
  engine.add_request("held", *requests[0])
  engine.abort_request("held")  # aborted while held: never runs
  engine.resume_generation()
  assert not engine.has_unfinished_requests()
  assert (
    _generate(engine, requests[:1])["0"].outputs[0].token_ids == waited["0"].outputs[0].token_ids
  )


def test_weight_versions_are_stamped_across_a_load_while_paused(model, tokenizer):
  """Each token carries the version of the weights that produced it: 0 before any load, then
  the version a load while paused gave (the load compiles nothing); a bad version is refused
  and changes nothing."""
  from flax import nnx

  from jaxengine.testing import count_compiles

  engine = one_shape(_engine(model, tokenizer, None))
  weights = nnx.state(model)
  engine.add_request("a", "ab ab ab", je.SamplingParams(temperature=0, max_tokens=12))
  engine.add_request("b", "cd", je.SamplingParams(temperature=0.8, seed=1, max_tokens=12, n=2))
  for _ in range(4):
    engine.step()
  engine.pause_generation("keep")
  before = {c.seq_id: len(c.token_ids) for c in engine.scheduler.running.values()}
  for bad in (-1, 1.5, True, "7"):
    with pytest.raises(ValueError, match=f"weight_version must be a non-negative int, got {bad!r}"):
      engine.load_weights(weights, weight_version=bad)  # type: ignore[arg-type]
  assert engine.weight_version == 0
  with count_compiles() as compiles:
    engine.load_weights(weights, weight_version=7)
  assert compiles.count == 0
  engine.resume_generation()
  done = _generate(engine, [])
  while engine.has_unfinished_requests():
    done.update((o.request_id, o) for o in engine.step() if o.finished)
  for request_id in ("a", "b"):
    for completion in done[request_id].outputs:
      seq_id = request_id if request_id == "a" else f"b#{completion.index}"
      k = before[seq_id]
      assert completion.weight_versions == [0] * k + [7] * (12 - k), seq_id
  engine.load_weights(weights)  # no version given: the next one
  assert engine.weight_version == 8
