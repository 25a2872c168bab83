"""Shared fixtures for the core (batch + sampler) tests, and how pytest-xdist shares the tests out."""

from __future__ import annotations

import os

import pytest

# Tests are hermetic: no engine writes to the user's persistent compilation cache (the tests of
# the cache give it a temporary directory). Not a cache shared by the run either: with jax 0.10.2
# on CPU, writing a `lax.scan` executable to it crashed a worker (a segmentation fault in
# `compilation_cache.put_executable_and_time`).
os.environ.setdefault("JAXENGINE_COMPILATION_CACHE", "off")

import gc

import jax

from jaxengine.testing import count_compiles
from jaxengine.worker import device_steps

# Under pytest-xdist (`-n 2`): the tests of a module share its engines (module-scoped fixtures,
# cached builders), whose compiles are most of their time, so a module runs on one worker instead
# of compiling the same engines on both. The tests of the modules in INDEPENDENT build their own
# engines (or processes) and are handed out one by one. Units go heaviest first, so that no worker
# is left alone with a long one at the end.

#: Modules whose tests share nothing costly: each test is a unit of its own.
INDEPENDENT = frozenset({"test_golden_run.py", "test_notebooks.py", "test_mesh.py", "test_docs.py"})

#: Rough seconds of the heaviest units under `-n 2` (a module file, or one test of an INDEPENDENT
#: module by its name); only their order matters, units not named come after them as collected.
WEIGHTS = {
  "test_engine.py": 410,
  "test_structured_outputs.py": 300,
  "test_paged_engine.py": 300,
  "test_checkpoints.py": 250,
  "test_paged_speculative.py": 250,
  "test_paged_multi_step.py": 220,
  "test_paged_mesh.py": 150,
  "test_engine_lifecycle.py": 245,
  "test_async_scheduling.py": 240,
  "test_cli.py": 200,
  "test_rollout.py": 180,
  "test_composition.py": 170,
  "test_precompile.py": 120,
  "test_serve.py": 160,
  "test_tunix.py": 140,
  "test_lm_eval.py": 120,
  "test_sharded_sampler.py": 110,
  "test_speculative.py": 100,
  "test_multihost.py": 80,
  "test_outputs_match_the_recorded_run[smollm2_paged]": 200,
  "test_outputs_match_the_recorded_run[tiny_paged]": 150,
  "test_outputs_match_the_recorded_run[tiny_speculative]": 90,
  "test_outputs_match_the_recorded_run[tiny_paged_no_prefix_cache]": 60,
  "test_outputs_match_the_recorded_run[tiny_multi_step]": 55,
  "test_engine_on_a_mesh_matches_one_device_and_compiles_nothing_after_warm_up": 150,
  "test_sample_step_under_a_mesh_matches_one_device": 80,
  "test_notebook_runs[06_structured_outputs]": 145,
  "test_page_snippets_run_as_written[README.md]": 120,
  "test_page_snippets_run_as_written[serving.md]": 120,
  "test_page_snippets_run_as_written[integrations.md]": 100,
  "test_page_snippets_run_as_written[engine.md]": 100,
  "test_notebook_runs[01_quickstart]": 140,
  "test_notebook_runs[03_sampling_distributions]": 85,
}


def _weight(item: pytest.Item) -> int:
  if item.path.name in INDEPENDENT:
    return WEIGHTS.get(item.name, 0)
  return WEIGHTS.get(item.path.name, 0)


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: unknown without it
def pytest_xdist_make_scheduler(config, log):
  """A module per unit of work (a test per unit in INDEPENDENT modules), in collection order."""
  from xdist.scheduler import LoadScopeScheduling

  class ModuleScheduling(LoadScopeScheduling):
    def _split_scope(self, nodeid: str) -> str:
      module = nodeid.split("::", 1)[0]
      return nodeid if module.rsplit("/", 1)[-1] in INDEPENDENT else module

  config.option.loadscopereorder = False  # keep the heaviest-first order of the collection
  return ModuleScheduling(config, log)


def pytest_collection_modifyitems(config, items):
  if hasattr(config, "workerinput"):  # an xdist worker: each collects, in the same order
    # Stable: a module's tests stay together and in order (its module fixtures are built once).
    items.sort(key=lambda item: -_weight(item))


@pytest.fixture
def compile_counter():
  """Yields a running `jaxengine.testing.CompileCounter`; `.count` is the compiles seen so far."""
  with count_compiles() as counter:
    yield counter


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_code(request):
  """Frees a module's compiled code once its tests are done: its cached builders (engines kept by
  `functools.cache`), the engines' shared steps and JAX's caches. Each XLA:CPU executable holds a
  few memory mappings, and a worker that kept every module's executables reached Linux's
  `vm.max_map_count` (65,530; 23k after four engine modules) and crashed inside an XLA compile."""
  yield
  for value in vars(request.module).values():
    if callable(getattr(value, "cache_clear", None)):
      value.cache_clear()
  device_steps.clear()
  jax.clear_caches()
  gc.collect()
