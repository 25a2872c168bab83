"""A hybrid model's prefix caching on the host: which states are saved, where hits start, LRU."""

from __future__ import annotations

from jaxengine.core.kv_cache_manager import KVCacheManager
from jaxengine.core.request import Completion, Request
from jaxengine.core.scheduler import Scheduler
from jaxengine.core.state_snapshots import StateRoute
from jaxengine.params import SamplingParams

BLOCK = 4


def _completion(request_id: str, prompt: list[int]) -> Completion:
  params = SamplingParams(max_tokens=2)
  request = Request(request_id, None, prompt, params)
  completion = Completion(request_id, request, 0, params, None)
  request.completions.append(completion)
  return completion


def _scheduler(num_snapshots: int) -> Scheduler:
  manager = KVCacheManager(64, BLOCK, enable_caching=True)
  return Scheduler(2, manager, 8, num_state_slots=2, num_state_snapshots=num_snapshots)


def _run_prompt(scheduler: Scheduler, completion: Completion) -> list[StateRoute]:
  """Schedules `completion` until its prompt is computed; its routes, step by step."""
  scheduler.add_request(completion.request)
  routes = []
  while completion.num_computed_tokens < len(completion.request.prompt_token_ids):
    output = scheduler.schedule()
    routes.append(output.state_routes[completion.seq_id])
    scheduler.update_after_step(output)
  scheduler.finish(completion)
  return routes


def test_states_are_saved_at_each_chunks_last_boundary_and_hits_start_from_them():
  scheduler = _scheduler(num_snapshots=4)
  prompt = list(range(1, 22))  # 21 tokens: chunks of 8, 8 and 5
  routes = _run_prompt(scheduler, _completion("a", prompt))
  own = 1  # the first running slot (slot 0 is the null slot)
  assert routes == [StateRoute(own, 3, 8), StateRoute(own, 4, 8), StateRoute(own, 5, 4)]
  again = _completion("b", prompt)
  scheduler.add_request(again.request)
  output = scheduler.schedule()  # hits 20 tokens: starts from the state saved after block 5
  assert output.num_computed_tokens["b"] == 20
  assert output.state_routes["b"] == StateRoute(5, 0, 0)
  scheduler.update_after_step(output)
  scheduler.finish(again)
  partial = _completion("c", [*prompt[:16], 90, 91, 92, 93, 94])
  scheduler.add_request(partial.request)
  output = scheduler.schedule()  # 16 shared tokens end a chunk: their state was saved
  assert output.num_computed_tokens["c"] == 16
  assert output.state_routes["c"].source == 4


def test_the_least_recently_used_state_is_evicted_and_a_reset_forgets_all():
  scheduler = _scheduler(num_snapshots=2)
  first, second = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10]
  _run_prompt(scheduler, _completion("a", first))
  _run_prompt(scheduler, _completion("b", second))
  assert scheduler.state_snapshots is not None and scheduler.state_snapshots.num_saved == 2
  _run_prompt(scheduler, _completion("a2", first))  # a hit: "a"'s state is used most recently
  _run_prompt(scheduler, _completion("c", [11, 12, 13, 14, 15]))  # evicts "b"'s
  hit = scheduler._cached_prefix(_completion("b2", second))
  assert hit.num_computed_tokens == 0
  assert scheduler._cached_prefix(_completion("a3", first)).num_computed_tokens == 4
  scheduler.reset_prefix_cache()
  assert scheduler.state_snapshots.num_saved == 0
  assert scheduler._cached_prefix(_completion("a4", first)).num_computed_tokens == 0
