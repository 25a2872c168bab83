"""`LLM.sleep(level=1|2)` / `LLM.wake_up(tags)` (vLLM's names) on the tiny Llama.

- A hypothesis state machine over generate / sleep(1) / sleep(2) / wake_up (whole or by tag) /
  load_weights (whole or a subset): while asleep the engine's weights and KV cache hold no device
  bytes (level 1: the weights in pinned host memory instead) and the process holds at most its
  awake bytes less those; generating while asleep, or after level 2 before `load_weights`, is a
  RuntimeError that queues nothing; `load_weights` while the weights sleep is refused, and after
  level 2 a subset is refused (naming a missing weight); every run ends with the engine awake,
  its outputs (greedy and seeded) those of before, the same device bytes, and nothing compiled.
- Scripted: the measured bytes of level 1; the prefix cache emptied; sleeping with requests in
  flight refused and the engine left as it was; a step left in flight by asynchronous scheduling
  read before the pages go; bad levels and tags.
- `AsyncLLM.sleep` / `wake_up` / `is_sleeping` run on the engine thread between steps; a request
  sent while it sleeps fails with the RuntimeError.
- On 2 host devices (a subprocess): tensor- and data-parallel engines sleep and wake every core,
  their weights and pages come back with the same shardings, the same outputs, nothing compiled.
"""

from __future__ import annotations

import asyncio
import gc

import jax
import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test
from output_utils import step_to_end
from subprocess_utils import run_python

import jaxengine as je
from jaxengine.entrypoints.async_llm import AsyncLLM
from jaxengine.models.weights import named_weights
from jaxengine.testing import count_compiles, tiny_llama
from jaxengine.worker import sleep_mode

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9]]
PARAMS = [
  je.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
  je.SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True),
]
OPTIONS = dict(max_num_reqs=4, max_model_len=64, num_kv_blocks=32, block_size=8)


def _tokens(llm) -> list[list[int]]:
  return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def _engine_bytes(llm) -> int:
  """Device bytes of the engine's weights and KV cache (every core)."""
  runners = [core.runner for core in llm.llm_engine.cores]
  return sum(sleep_mode.device_bytes((r.weights, r.kv_cache)) for r in runners)


def _live_bytes() -> int:
  gc.collect()
  return sleep_mode.live_device_bytes()


class _Warm:
  """One engine over a module nothing else holds (so the engine's weights are its alone and
  `sleep` frees them), warmed up: every step shape the machine's generate reaches compiled, its
  outputs and bytes recorded."""

  def __init__(self) -> None:
    model, _ = tiny_llama(max_position_embeddings=64)
    #: The weights by checkpoint name, copied to NumPy before the engine shares the arrays.
    self.weights = {name: np.array(a, copy=True) for name, a in named_weights(model)}
    self.llm = je.LLM(model, **OPTIONS)
    del model  # the engine's arrays are now its own
    self.reference = _tokens(self.llm)
    assert _tokens(self.llm) == self.reference  # a second run: every shape compiled
    runner = self.llm.llm_engine.runner
    self.weight_bytes = sleep_mode.device_bytes(runner.weights)
    self.kv_cache_bytes = sleep_mode.device_bytes(runner.kv_cache)
    self.awake_bytes = _live_bytes()


@pytest.fixture(scope="module")
def warm() -> _Warm:
  return _Warm()


@pytest.fixture(autouse=True)
def _left_awake(request):
  """Every test leaves the shared engine awake with its weights (even one that fails)."""
  yield
  if "warm" not in request.fixturenames:
    return
  warm = request.getfixturevalue("warm")
  warm.llm.wake_up()
  if warm.llm.llm_engine.runner.weights_discarded:
    warm.llm.load_weights(warm.weights)


@pytest.mark.parametrize("level", [1, 2])
def test_a_trainers_module_shared_with_the_engine_survives_sleep(level):
  """Colocated RL: the trainer keeps the module the engine was built from; sleeping the engine
  lets go of the shared weights without deleting them, and frees the KV cache."""
  model, _ = tiny_llama(max_position_embeddings=64)
  llm = je.LLM(model, **OPTIONS)
  reference = _tokens(llm)
  runner = llm.llm_engine.runner
  kv_cache = runner.kv_cache
  llm.sleep(level=level)
  assert all(not a.is_deleted() for a in jax.tree.leaves(nnx.state(model)))
  assert all(a.is_deleted() for a in jax.tree.leaves(kv_cache))
  assert np.isfinite(float(model.embed[...].sum()))  # the trainer can still read its weights
  llm.wake_up()
  if level == 2:
    llm.load_weights(nnx.state(model))
  assert _tokens(llm) == reference


class SleepMachine(RuleBasedStateMachine):
  """The engine against a model of its sleep state: the parts asleep, the last level, whether
  the weights were discarded."""

  warm: _Warm

  def __init__(self) -> None:
    super().__init__()
    self.llm = self.warm.llm
    self.asleep: set[str] = set()
    self.level = 0
    self.discarded = False

  @rule()
  def generate(self) -> None:
    engine = self.llm.llm_engine
    if self.asleep or self.discarded:
      match = "wake_up" if self.asleep else "load_weights"
      with pytest.raises(RuntimeError, match=match):
        self.llm.generate(PROMPTS, PARAMS, use_tqdm=False)
      assert not engine.has_unfinished_requests() and not engine._requests
    else:
      assert _tokens(self.llm) == self.warm.reference

  @rule(level=st.sampled_from([1, 2]))
  def sleep(self, level: int) -> None:
    self.llm.sleep(level=level)
    if level == 2:
      self.discarded = True
    self.asleep = {"weights", "kv_cache"}
    self.level = max(self.level, level)
    assert _engine_bytes(self.llm) == 0
    warm = self.warm
    assert _live_bytes() <= warm.awake_bytes - (warm.weight_bytes + warm.kv_cache_bytes)
    host = self.llm.llm_engine.runner._sleep.host_weights
    if self.discarded:
      assert host is None
    else:  # level 1: every weight in pinned host memory, the same bytes
      leaves = jax.tree.leaves(host)
      assert {a.sharding.memory_kind for a in leaves} == {"pinned_host"}
      assert sum(a.nbytes for a in leaves) == warm.weight_bytes

  @rule(tags=st.sampled_from([None, ["weights"], ["kv_cache"], ["kv_cache", "weights"]]))
  def wake_up(self, tags) -> None:
    self.llm.wake_up(tags=tags)
    woken = self.asleep & set(tags or sleep_mode.SLEEP_TAGS)
    self.asleep -= woken
    runner = self.llm.llm_engine.runner
    if "weights" not in self.asleep and not self.discarded:
      assert sleep_mode.device_bytes(runner.weights) == self.warm.weight_bytes
    if "kv_cache" not in self.asleep:
      assert sleep_mode.device_bytes(runner.kv_cache) == self.warm.kv_cache_bytes
    if "kv_cache" in woken:  # a fresh pool: no page, no prefix left
      stats = self.llm.llm_engine.cores[0].kv_cache_manager.stats
      assert stats.num_cached_blocks == stats.num_used_blocks == 0

  @rule(whole=st.booleans())
  def load_weights(self, whole: bool) -> None:
    weights = self.warm.weights
    given = weights if whole else {"model.norm.weight": weights["model.norm.weight"]}
    if "weights" in self.asleep:
      with pytest.raises(RuntimeError, match="wake_up"):
        self.llm.load_weights(given)
    elif self.discarded and not whole:
      with pytest.raises(ValueError, match=r"every weight.*missing 'model\.embed_tokens\.weight'"):
        self.llm.load_weights(given)
    else:
      self.llm.load_weights(given)
      self.discarded = False

  @invariant()
  def sleeping_as_modelled(self) -> None:
    assert self.llm.is_sleeping() == bool(self.asleep)
    assert self.llm.llm_engine.is_sleeping() == bool(self.asleep)

  def teardown(self) -> None:
    self.llm.wake_up()
    if self.discarded:
      self.llm.load_weights(self.warm.weights)
    assert not self.llm.is_sleeping()
    assert _tokens(self.llm) == self.warm.reference
    assert _engine_bytes(self.llm) == self.warm.weight_bytes + self.warm.kv_cache_bytes
    assert _live_bytes() == self.warm.awake_bytes


def test_sleep_and_wake_in_any_order_free_everything_and_restore_it_without_compiling(warm):
  SleepMachine.warm = warm
  with count_compiles() as compiles:
    run_state_machine_as_test(
      SleepMachine,
      settings=settings(
        max_examples=8,
        stateful_step_count=6,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow],
      ),
    )
  assert compiles.count == 0


def test_level_1_moves_the_weights_to_host_and_frees_the_pages(warm):
  llm, runner = warm.llm, warm.llm.llm_engine.runner
  placements = [(a.sharding, a.committed) for a in jax.tree.leaves(runner.weights)]
  assert warm.weight_bytes > 0 and warm.kv_cache_bytes > 0
  llm.sleep(level=1)
  asleep = _live_bytes()
  assert asleep <= warm.awake_bytes - (warm.weight_bytes + warm.kv_cache_bytes)
  assert runner.kv_cache is None
  with count_compiles() as compiles:
    llm.wake_up()
    assert _tokens(llm) == warm.reference
  assert compiles.count == 0
  assert [(a.sharding, a.committed) for a in jax.tree.leaves(runner.weights)] == placements
  assert _live_bytes() == warm.awake_bytes


def test_level_2_takes_back_a_whole_state_of_the_same_structure(warm):
  llm = warm.llm
  llm.sleep(level=2)
  llm.wake_up()
  same, _ = tiny_llama(max_position_embeddings=64)  # seed 0: the warm model's weights
  with count_compiles() as compiles:
    llm.load_weights(same)
    assert _tokens(llm) == warm.reference
  assert compiles.count == 0
  assert _engine_bytes(llm) == warm.weight_bytes + warm.kv_cache_bytes


def test_prefix_cache_is_emptied_by_sleep(warm):
  llm = warm.llm
  long = list(range(10, 30))  # 20 tokens: two full pages of 8
  params = je.SamplingParams(temperature=0, max_tokens=2)
  llm.generate([long], params, use_tqdm=False)
  assert llm.llm_engine.kv_cache_stats.num_cached_blocks >= 2
  llm.sleep(level=1)
  assert llm.llm_engine.kv_cache_stats.num_cached_blocks == 0
  llm.wake_up()
  llm.llm_engine.reset_kv_cache_stats()
  llm.generate([long], params, use_tqdm=False)
  assert llm.llm_engine.kv_cache_stats.prefix_cache_hits == 0  # nothing left to hit


def test_sleep_with_unfinished_requests_is_refused_and_changes_nothing(warm):
  engine = warm.llm.llm_engine
  engine.add_request("waiting", PROMPTS[0], PARAMS[0])
  with pytest.raises(RuntimeError, match="unfinished requests"):
    engine.sleep(level=1)
  assert not engine.is_sleeping()
  (done,) = step_to_end(engine)
  assert list(done.outputs[0].token_ids) == warm.reference[0]


def test_sleep_reads_a_step_left_in_flight_first(warm):
  engine = warm.llm.llm_engine
  stop = warm.reference[0][1]  # the second greedy token ends the request, on the host
  assert stop != warm.reference[0][0]
  params = je.SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop])
  engine.add_request("stops", PROMPTS[0], params)
  (done,) = step_to_end(engine)
  core = engine.cores[0]
  assert core._in_flight is not None  # the step after the stop, dispatched before it was read
  engine.sleep(level=1)
  assert core._in_flight is None
  engine.wake_up()
  assert engine.pop_finished() == []  # the stop's output was step()'s, the step after it none
  assert list(done.outputs[0].token_ids) == warm.reference[0][:2]
  assert _tokens(warm.llm) == warm.reference


def test_bad_level_and_tags_are_refused_before_anything_changes(warm):
  llm = warm.llm
  for level in (0, 3, True, "1", 1.0):
    with pytest.raises(ValueError, match="sleep level must be 1 or 2"):
      llm.sleep(level=level)
  assert not llm.is_sleeping()
  llm.sleep(level=1)
  for tags in (["weight"], "weights", [1], []):  # [] would wake nothing
    with pytest.raises(ValueError, match="tags"):
      llm.wake_up(tags=tags)
  assert llm.is_sleeping()
  with pytest.raises(RuntimeError, match="wake_up"):
    llm.llm_engine.precompile(use_tqdm=False)
  llm.wake_up()
  assert _tokens(llm) == warm.reference


def test_async_llm_sleeps_and_wakes_at_a_step_boundary(warm):
  engine = AsyncLLM(warm.llm)

  async def tokens(prompt, params) -> list[int]:
    final = None
    async for output in engine.generate(prompt, params):
      final = output
    assert final is not None
    return list(final.outputs[0].token_ids)

  async def main():
    await engine.sleep(level=1)
    assert await engine.is_sleeping()
    with pytest.raises(RuntimeError, match="wake_up"):
      await tokens(PROMPTS[0], PARAMS[0])
    with pytest.raises(ValueError, match="sleep level"):
      await engine.sleep(level=5)
    await engine.wake_up()
    assert not await engine.is_sleeping()
    return await asyncio.gather(*(tokens(p, sp) for p, sp in zip(PROMPTS, PARAMS)))

  try:
    assert asyncio.run(main()) == warm.reference
  finally:
    engine.shutdown()


MESH_SCRIPT = """
import os, sys
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
import jax
import numpy as np
import jaxengine as je
from step_shapes import one_shape
from jaxengine.models.weights import named_weights
from jaxengine.testing import count_compiles, tiny_llama
from jaxengine.worker import sleep_mode

prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [4, 4, 4]]
params = [je.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
          je.SamplingParams(temperature=1.0, seed=5, max_tokens=6, ignore_eos=True),
          je.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)]
def tokens(llm):
  return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
def placements(llm):
  return [(a.sharding, a.committed) for core in llm.llm_engine.cores
          for a in jax.tree.leaves((core.runner.weights, core.runner.kv_cache))]
def held(llm):
  return sum(sleep_mode.device_bytes((c.runner.weights, c.runner.kv_cache))
             for c in llm.llm_engine.cores)

for sizes in (dict(tensor_parallel_size=2), dict(data_parallel_size=2)):
  model, _ = tiny_llama(max_position_embeddings=64)
  weights = {name: np.array(a, copy=True) for name, a in named_weights(model)}
  # Each step in its largest shape: the engine is compared with itself across sleep and wake.
  llm = one_shape(
    je.LLM(model, max_num_reqs=4, max_model_len=64, num_kv_blocks=32, block_size=8, **sizes)
  )
  before = tokens(llm)
  assert tokens(llm) == before
  where, awake = placements(llm), held(llm)
  assert all(s.memory_kind == "device" for s, _ in where) and awake > 0
  for level in (1, 2):
    llm.sleep(level=level)
    assert held(llm) == 0 and all(c.runner.is_sleeping() for c in llm.llm_engine.cores)
    with count_compiles() as compiles:
      llm.wake_up(tags=["weights"])
      if level == 2:  # vLLM's RL sync: weights first, the KV cache once they are in
        llm.load_weights(weights)
      llm.wake_up(tags=["kv_cache"])
      assert tokens(llm) == before
    assert compiles.count == 0, (sizes, level, compiles.count)
    assert placements(llm) == where and held(llm) == awake
  print(sizes, "ok")
print("ok")
"""


def test_mesh_engines_sleep_and_wake_every_core_in_place():
  out = run_python(MESH_SCRIPT, timeout=900)
  assert out.strip().endswith("ok")
  assert out.count("ok") == 3
