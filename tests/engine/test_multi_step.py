"""The paged engine's k-step decode (`num_decode_steps` k > 1 with pages) against k = 1.

The mixed workload of `test_engine_under_pressure` (every sampling parameter, `n > 1`, stop ids and
strings, `min_tokens`, logprobs, a logits processor; requests arriving while others run, so some
wait) plus a request ending on a stop id runs at k = 1 and at k = 4 on a pool small enough to
force preemption and lookahead that the pool cannot always serve, and at k = 8 on a roomy pool:
tokens, text and finish reasons must be equal, logprob values to 1e-5 relative. A
structured-output request runs beside plain ones (steps go one at a time while it runs), and the
compile bound holds: precompile covers the k-step loop of every row bucket and a run after it
compiles no step.
"""

from __future__ import annotations

import pytest
from step_shapes import one_shape
from test_engine_under_pressure import REQUESTS, SP, VOCAB, _model_and_tokenizer, _run
from test_rollout import assert_same_outputs

import jaxengine as je
from jaxengine.core.kv_cache_manager import KVCacheManager
from jaxengine.core.request import Completion, Request
from jaxengine.core.scheduler import Scheduler, SchedulerOutput
from jaxengine.engine import LLMEngine
from jaxengine.testing import TargetOnly, count_compiles, tiny_llama
from jaxengine.worker import device_steps
from jaxengine.worker.multi_step import DeviceStopRules

#: 6 usable pages of 4 tokens for 2 rows of up to 24 tokens: preemption and short lookahead.
TIGHT = {
  "max_num_reqs": 2, "max_model_len": 32, "logits_processors": [TargetOnly], "block_size": 4,
  "num_kv_blocks": 7, "max_num_batched_tokens": 8,
}  # fmt: skip
#: Roomy pages (lookahead always served), precompiled.
ROOMY = {**TIGHT, "num_kv_blocks": 40}
#: The shared workload and a request that ends on a stop id after `min_tokens`.
WORKLOAD = [
  *REQUESTS,
  ([50, 51, 52], SP(
    temperature=1.0, seed=4, allowed_token_ids=list(range(20, 40)), min_tokens=3,
    stop_token_ids=list(range(20, 30)), max_tokens=10, logprobs=1,
  )),
]  # fmt: skip


def _engine(options: dict, k: int) -> LLMEngine:
  model, tokenizer = _model_and_tokenizer()
  return LLMEngine(model, tokenizer, **options, num_decode_steps=k)


def _one_shape_engine(options: dict, k: int) -> LLMEngine:
  """`_engine` with its steps in one shape (`one_shape`): k = 1 against k > 1 is the point."""
  return one_shape(_engine(options, k))


class _StepCounter:
  """Counts the k-step dispatches, the most tokens a row was granted, and dispatches where the
  pool served some row less than its limits allowed (wraps the scheduler)."""

  def __init__(self, scheduler: Scheduler) -> None:
    self.scheduler = scheduler
    self.num_multi = 0
    self.most_steps = 0
    self.partial_lookahead = 0
    self._plan = scheduler.schedule_decode_steps
    scheduler.schedule_decode_steps = self._record  # type: ignore[method-assign]

  def _record(self, scheduled, num_steps, max_model_len) -> SchedulerOutput | None:
    out = self._plan(scheduled, num_steps, max_model_len)
    if out is not None:
      self.num_multi += 1
      self.most_steps = max(self.most_steps, *out.num_decode_steps.values())
      wanted = self.scheduler._decode_steps_wanted
      self.partial_lookahead += any(
        n < wanted(s, num_steps, max_model_len) for s, n in out.num_decode_steps.items()
      )
    return out


def _scheduler(num_blocks: int, prompts: list[list[int]], max_tokens: list[int]) -> Scheduler:
  """A scheduler over pages of 4 tokens that has admitted `prompts` and sampled one token each
  (host only: what the engine does around the model)."""
  scheduler = Scheduler(2, KVCacheManager(num_blocks, 4, enable_caching=False), 8)
  for index, (prompt, limit) in enumerate(zip(prompts, max_tokens)):
    params = SP(max_tokens=limit)
    request = Request(str(index), None, prompt, params)
    request.completions.append(Completion(str(index), request, 0, params, None))
    scheduler.add_request(request)
  first = scheduler.schedule()
  assert len(first.admitted) == len(prompts)
  assert scheduler.schedule_decode_steps(first, 8, 16) is None  # admits: not decode-only
  scheduler.update_after_step(first)
  for completion in scheduler.running.values():
    completion.token_ids.append(7)
  return scheduler


def test_lookahead_reserves_pages_up_to_each_rows_limits():
  scheduler = _scheduler(1 + 5, [[1, 2, 3], [4, 5, 6]], [10, 2])
  step = scheduler.schedule()
  plan = scheduler.schedule_decode_steps(step, 8, 16)
  assert plan is not None
  # "0": 8 tokens from position 3 need positions 3..10: 3 pages (2 new). "1": max_tokens=2 left
  # it one token, which its page holds.
  assert plan.num_decode_steps == {"0": 8, "1": 1}
  # Only "0"'s table changed: it travels whole; "1" keeps its one page and sends none.
  assert {s: len(t) for s, (t,) in plan.block_ids.items()} == {"0": 3}
  assert step.block_ids == {}
  assert len(scheduler.manager.get_block_ids("0")) == 3
  assert plan.num_scheduled_tokens == step.num_scheduled_tokens == {"0": 1, "1": 1}
  # A long prompt or max_model_len bounds it too.
  assert scheduler._decode_steps_wanted("0", 8, 6) == 2


def test_lookahead_never_preempts_and_falls_back_to_the_room_in_a_rows_pages():
  scheduler = _scheduler(1 + 3, [[1, 2], [4, 5, 6]], [10, 10])  # one page free
  tables = {s: scheduler.manager.get_block_ids(s) for s in ("0", "1")}
  plan = scheduler.schedule_decode_steps(scheduler.schedule(), 8, 16)
  assert plan is not None
  # "0" (position 2) wants 8 positions, 2 more pages; the pool has 1: the last slot of its own
  # page and the free page's 4 give it 6. "1" (position 3, its page full) is left its one token.
  assert plan.num_decode_steps == {"0": 6, "1": 1}
  assert scheduler.manager.get_block_ids("0")[:1] == tables["0"]
  assert scheduler.manager.get_block_ids("1") == tables["1"]
  assert scheduler.manager.block_pool.num_free_blocks == 0
  assert scheduler.manager.stats.num_preemptions == 0 and not plan.preempted


def test_a_step_where_no_row_can_take_a_second_token_is_not_a_k_step_decode():
  scheduler = _scheduler(1 + 5, [[1, 2, 3], [4, 5, 6]], [2, 2])
  assert scheduler.schedule_decode_steps(scheduler.schedule(), 8, 16) is None


@pytest.fixture(scope="module")
def expected():
  """The workload on the tight pool at k = 1 (the paged engine's outputs do not depend on the
  pool, the budget or the rows: `test_engine_under_pressure`)."""
  return _run(_one_shape_engine(TIGHT, 1), WORKLOAD)


def test_the_workload_stops_every_way(expected):
  """The compared outputs exercise what the device loop must stop on (else the equalities below
  would prove little): a stop id after min_tokens, a stop string, max_tokens, n > 1."""
  reasons = {(c.finish_reason, c.stop_reason) for o in expected for c in o.outputs}
  assert ("length", None) in reasons and ("stop", "e") in reasons
  stop_id = expected[-1].outputs[0]
  assert stop_id.finish_reason == "stop" and stop_id.stop_reason in range(20, 30)
  assert 3 <= len(stop_id.token_ids) < 10 and not set(stop_id.token_ids[:2]) & set(range(20, 30))
  assert len(expected[2].outputs) == 3


def test_k_step_decode_with_preemption_and_waiting_requests_equals_one_step(expected):
  engine = _one_shape_engine(TIGHT, 4)
  counter = _StepCounter(engine.scheduler)
  assert_same_outputs(_run(engine, WORKLOAD), expected)
  assert counter.num_multi > 0 and counter.most_steps == 4  # k-step loops ran
  stats = engine.kv_cache_stats
  assert stats.num_used_blocks == 0 and stats.num_running_reqs == 0  # no page leaked
  assert stats.num_preemptions > 0 and counter.partial_lookahead > 0  # the pool ran short


def test_precompile_covers_the_k_step_loop_and_a_run_compiles_no_step(expected):
  device_steps.clear()  # this engine's executables alone
  engine = _engine(ROOMY, 8)
  runner = engine.runner
  with count_compiles() as compiles:
    shapes = engine.precompile(use_tqdm=False)
  # Token buckets start at min(rows, 8) (`ModelRunner.token_bucket`); with prompt logprobs
  # the largest row bucket only (`step_buckets`).
  reachable = runner.step_shapes() + runner.step_shapes(prompt_logprobs=True)
  assert runner.row_buckets == [1, 2] and len(reachable) > len(runner.row_buckets)
  assert shapes == len(reachable) + 2 and compiles.count >= shapes
  counter = _StepCounter(engine.scheduler)
  with count_compiles() as compiles:
    outputs = _run(engine, WORKLOAD)
  assert compiles.count == 0  # nothing compiles after precompile
  assert runner.decode_steps._cache_size() == 2  # one loop per row bucket
  assert runner.ragged_forward._cache_size() == len(reachable)
  assert_same_outputs(outputs, expected)
  assert counter.most_steps == 8 and counter.partial_lookahead == 0
  assert engine.kv_cache_stats.num_used_blocks == 0


def test_a_structured_output_request_runs_one_step_at_a_time_beside_k_step_rows():
  """With a grammar row running, steps go one at a time (its matcher advances on the host after
  every token); every output equals k = 1's."""
  model = tiny_llama(vocab_size=49152, hidden_size=32, num_hidden_layers=1)[0]
  tokenizer = _model_and_tokenizer()[1]
  options = {"max_num_reqs": 2, "max_model_len": 24}
  requests = [
    ([5, 6, 7], SP(temperature=0, max_tokens=10, ignore_eos=True)),
    ([8, 9], SP(temperature=0.9, seed=2, max_tokens=8,
                structured_outputs=je.StructuredOutputsParams(choice=["yes", "no"]))),
    ([10, 11, 12], SP(temperature=0.5, seed=6, max_tokens=12, logprobs=2)),
    ([13, 14], SP(temperature=0, max_tokens=9, min_tokens=3)),
  ]  # fmt: skip
  paged = {"block_size": 4, "num_kv_blocks": 16}
  single = _run(one_shape(LLMEngine(model, tokenizer, **options, **paged)), requests)
  engine = one_shape(LLMEngine(model, tokenizer, **options, **paged, num_decode_steps=4))
  counter = _StepCounter(engine.scheduler)
  outputs = _run(engine, requests)
  assert outputs[1].outputs[0].text in ("yes", "no")
  assert_same_outputs(outputs, single)
  assert counter.num_multi > 0  # k-step loops ran once the grammar row had finished


def test_num_decode_steps_is_accepted_with_pages_and_still_validated():
  model, _ = _model_and_tokenizer()
  engine = LLMEngine(model, max_num_reqs=2, max_model_len=32, num_kv_blocks=8, num_decode_steps=3)
  assert engine.num_decode_steps == 3 and engine.config.scheduling_overlaps  # they compose
  with pytest.raises(ValueError, match=r"num_decode_steps must be an int >= 1, got 0"):
    LLMEngine(model, max_num_reqs=2, max_model_len=32, num_kv_blocks=8, num_decode_steps=0)
  assert model.vocab_size == VOCAB


def test_the_loops_stop_rules_are_read_from_each_completions_params():
  """The k-step loop's stop rules come from each row's `SamplingParams` when the loop is laid
  out (the runner keeps no copy of them): `max_tokens` (else `max_model_len`), the EOS ids unless
  `ignore_eos`, then the stop ids, each once."""
  rules = DeviceStopRules(je.InputBatch(2, 32, VOCAB, eos_token_ids=[2]), max_model_len=32)
  got = rules.rows([SP(max_tokens=5, stop_token_ids=[7, 2]), SP(max_tokens=None, ignore_eos=True)])
  assert got == [(5, (2, 7)), (32, ())]
