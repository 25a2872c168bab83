"""Stateful property test: `Scheduler` over a `KVCacheManager`, host only (no model).

Each step the machine runs `schedule()`, writes the scheduled tokens into simulated pages through
the block tables, appends a fake token to every completion whose last known token was computed,
and calls `update_after_step`, as the engine does; rules add requests (`n` up to 3, prompts over a
3-token alphabet so prefixes collide), step, finish a running completion early (a stop) and abort
a request. Pools, budgets and rows are small, so preemption, chunked prefill, prefix hits and
forks are common.

Invariants: the token budget and the rows hold; every scheduled completion's block table covers its
tokens; the tables the runner rebuilds from the scheduler's outputs (`block_ids`)
equal the manager's; every running completion reads back exactly its own tokens from its pages (so
a block shared by two requests holds what both expect, and none is reused while held); reference
counts equal the number of tables listing each block; outputs only grow; and at the end, every
request run to completion, every block is free.
"""

from __future__ import annotations

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jaxengine.core.kv_cache_manager import KVCacheManager
from jaxengine.core.request import Completion, Request
from jaxengine.core.scheduler import Scheduler
from jaxengine.params import SamplingParams

MAX_MODEL_LEN = 16
PROMPTS = st.lists(st.integers(0, 2), min_size=1, max_size=10)


class PagedSchedulerMachine(RuleBasedStateMachine):
  def __init__(self) -> None:
    super().__init__()
    self.pages: dict[int, list[int | None]] = {}
    self.tables: dict[str, list[int]] = {}  # what the runner's BlockTable holds, by seq_id
    self.completions: dict[str, Completion] = {}
    self.outputs: dict[str, list[int]] = {}  # each completion's tokens as last seen
    self.requests: dict[str, Request] = {}
    self.finished: set[str] = set()
    self.count = 0

  @initialize(
    block_size=st.sampled_from([2, 4]),
    extra_blocks=st.integers(0, 3),
    caching=st.booleans(),
    chunked=st.booleans(),
    max_num_reqs=st.integers(2, 3),
    extra_budget=st.integers(0, 12),
  )
  def build(self, block_size, extra_blocks, caching, chunked, max_num_reqs, extra_budget):
    # The pool holds one request of MAX_MODEL_LEN tokens at least (`check_fits`).
    num_blocks = 1 + -(-MAX_MODEL_LEN // block_size) + extra_blocks
    budget = max_num_reqs + extra_budget
    if not chunked:
      budget = max(budget, MAX_MODEL_LEN)
    self.block_size = block_size
    self.budget = budget
    self.manager = KVCacheManager(num_blocks, block_size, enable_caching=caching)
    self.scheduler = Scheduler(max_num_reqs, self.manager, budget, chunked)

  # --- rules ------------------------------------------------------------------------------------

  @rule(prompt=PROMPTS, n=st.integers(1, 3), max_tokens=st.integers(1, 8))
  def add(self, prompt, n, max_tokens):
    self.count += 1
    request_id = f"r{self.count}"
    params = SamplingParams(temperature=1.0, n=n, max_tokens=max_tokens)
    request = Request(request_id, None, list(prompt), params)
    for index in range(n):
      seq_id = request_id if n == 1 else f"{request_id}#{index}"
      completion = Completion(seq_id, request, index, params, None)
      request.completions.append(completion)
      self.completions[seq_id] = completion
      self.outputs[seq_id] = []
    self.manager.check_fits(min(len(prompt) + max_tokens, MAX_MODEL_LEN))
    self.requests[request_id] = request
    self.scheduler.add_request(request)

  @rule(num_steps=st.integers(1, 4))
  def step(self, num_steps):
    for _ in range(num_steps):
      self._step()

  @precondition(lambda self: self.scheduler.running)
  @rule(data=st.data())
  def finish_early(self, data):
    """A stop rule ends a running completion."""
    seq_id = data.draw(st.sampled_from(sorted(self.scheduler.running)))
    self._finish(self.scheduler.running[seq_id])

  @precondition(lambda self: self.requests)
  @rule(data=st.data())
  def abort(self, data):
    request = self.requests.pop(data.draw(st.sampled_from(sorted(self.requests))))
    for completion in self.scheduler.abort({request.request_id}):
      self._finish(completion)
    for completion in request.completions:
      self.finished.add(completion.seq_id)

  # --- one step, as the engine runs it ------------------------------------------------------------

  def _step(self) -> None:
    scheduler = self.scheduler
    unfinished = scheduler.has_unfinished()
    out = scheduler.schedule()
    assert out.total_num_scheduled_tokens <= self.budget
    assert (out.total_num_scheduled_tokens > 0) == unfinished, "a step with work schedules some"
    assert len(scheduler.running) <= scheduler.max_num_reqs
    for completion in out.admitted:
      assert completion.seq_id in scheduler.running
      self.tables[completion.seq_id] = []
    for seq_id in out.preempted:  # the engine's runner applies these only in a step it runs
      assert self.manager.get_block_ids(seq_id) == () and out.num_scheduled_tokens
      assert out.block_ids[seq_id] == ((),)
    for seq_id, (block_ids,) in out.block_ids.items():
      self.tables[seq_id] = list(block_ids)
    for seq_id in scheduler.running:
      assert tuple(self.tables[seq_id]) == self.manager.get_block_ids(seq_id), seq_id
    for seq_id, count in out.num_scheduled_tokens.items():
      completion = scheduler.running[seq_id]
      start = out.num_computed_tokens[seq_id]
      assert count >= 1 and start + count <= completion.num_tokens
      assert len(self.tables[seq_id]) * self.block_size >= start + count
      self._check_pages(seq_id, start)
      self._write(seq_id, start, start + count)
    scheduler.update_after_step(out)
    event("preempted" if out.preempted else "no preemption")
    for seq_id, count in out.num_scheduled_tokens.items():
      if 1 < count < scheduler.running[seq_id].num_tokens - out.num_computed_tokens[seq_id] + 1:
        event("a chunk")
      if out.num_computed_tokens[seq_id] and seq_id in {c.seq_id for c in out.admitted}:
        event("admitted after a prefix hit or fork")
    for seq_id, count in out.num_scheduled_tokens.items():
      completion = scheduler.running[seq_id]
      if out.num_computed_tokens[seq_id] + count == completion.num_tokens:
        completion.token_ids.append(completion.num_tokens % 3)  # a fake sampled token
        full = completion.num_tokens >= MAX_MODEL_LEN
        if full or len(completion.token_ids) >= completion.params.max_tokens:
          self._finish(completion)

  def _finish(self, completion: Completion) -> None:
    self.scheduler.finish(completion)
    self.tables.pop(completion.seq_id, None)
    self.finished.add(completion.seq_id)
    request = completion.request
    if all(c.seq_id in self.finished for c in request.completions):
      self.requests.pop(request.request_id, None)

  def _tokens(self, seq_id: str) -> list[int]:
    completion = self.completions[seq_id]
    return [*completion.request.prompt_token_ids, *completion.token_ids]

  def _write(self, seq_id: str, start: int, stop: int) -> None:
    table, tokens = self.tables[seq_id], self._tokens(seq_id)
    for pos in range(start, stop):
      page = self.pages.setdefault(table[pos // self.block_size], [None] * self.block_size)
      page[pos % self.block_size] = tokens[pos]

  def _check_pages(self, seq_id: str, num_computed: int) -> None:
    """The completion's first `num_computed` tokens are in its pages."""
    table, tokens = self.manager.get_block_ids(seq_id), self._tokens(seq_id)
    assert len(table) * self.block_size >= num_computed
    for pos in range(num_computed):
      page = self.pages.get(table[pos // self.block_size])
      assert page is not None and page[pos % self.block_size] == tokens[pos], (seq_id, pos)

  # --- invariants --------------------------------------------------------------------------------

  @invariant()
  def running_completions_read_their_own_tokens(self):
    if not hasattr(self, "scheduler"):
      return
    for seq_id, completion in self.scheduler.running.items():
      assert completion.num_computed_tokens <= completion.num_tokens
      self._check_pages(seq_id, completion.num_computed_tokens)

  @invariant()
  def refcounts_match_the_block_tables(self):
    if not hasattr(self, "scheduler"):
      return
    pool = self.manager.block_pool
    expected = [0] * pool.num_blocks
    for seq_id in self.scheduler.running:
      for block in self.manager.get_block_ids(seq_id):
        expected[block] += 1
    assert pool.ref_cnt == expected
    assert sorted(pool.free_block_ids()) == [
      b for b in range(1, pool.num_blocks) if not expected[b]
    ]
    holding = {s for s in self.scheduler.running if self.manager.get_block_ids(s)}
    assert self.manager.stats.num_running_reqs == len(holding)

  @invariant()
  def completions_are_waiting_running_or_finished_and_never_lose_tokens(self):
    if not hasattr(self, "scheduler"):
      return
    waiting = [c.seq_id for c in self.scheduler.waiting]
    running = list(self.scheduler.running)
    assert len(set(waiting)) == len(waiting) and not set(waiting) & set(running)
    assert not (set(waiting) | set(running)) & self.finished
    assert set(waiting) | set(running) | self.finished == set(self.completions)
    for seq_id, completion in self.completions.items():
      seen = self.outputs[seq_id]
      assert completion.token_ids[: len(seen)] == seen
      self.outputs[seq_id] = list(completion.token_ids)

  def teardown(self):
    if not hasattr(self, "scheduler"):
      return
    for _ in range(500):
      if not self.scheduler.has_unfinished():
        break
      self._step()
    assert not self.scheduler.has_unfinished(), "requests left after 500 steps"
    assert self.manager.stats.num_used_blocks == 0
    assert self.manager.block_pool.ref_cnt == [0] * self.manager.block_pool.num_blocks


PagedSchedulerMachine.TestCase.settings = settings(
  max_examples=150, stateful_step_count=40, deadline=None,
  suppress_health_check=[HealthCheck.too_slow],
)  # fmt: skip
test_paged_scheduler = PagedSchedulerMachine.TestCase
