"""Shared fixtures for the core (batch + sampler) tests, and how pytest-xdist shares the tests out."""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import shutil
import tempfile
import time

# The test extra installs libtpu (for tests/aot's compiles for TPU topologies): without this,
# every test process would try to start a TPU backend first. Set before any backend starts (the
# imports below start none); a run that wants a TPU sets JAX_PLATFORMS itself.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The run's two workers keep both cores busy: a sampler compiled on a thread beside the model's
# compile would only contend with it (`jaxengine/worker/compile_beside.py`; its own tests turn it
# on). Measured with it on: the same compiles, module for module, the engine modules 10-40%
# slower.
os.environ.setdefault("JAXENGINE_COMPILE_BESIDE", "off")

import jax
import pytest
from jax._src import compiler as jax_compiler

from jaxengine.compilation_cache import is_off
from jaxengine.models import gguf_loader
from jaxengine.testing import count_compiles
from jaxengine.worker import device_steps

#: Added to XLA_FLAGS for the whole run (workers and subprocesses inherit it; the mesh scripts add
#: their device counts to it): XLA:CPU's LLVM backend at optimization level 0, and its elemental
#: emitters instead of the default fusion emitters. The tests compile far more than they compute
#: (small models, many step shapes), and the matrix products run in XLA's runtime library whatever
#: the level; tests/engine/test_engine.py took 88 s instead of 102 s at level 0, and the elemental
#: emitters halve a sampler's compile at level 0 (the 255 kernels of SmolLM2's vocabulary: 2.7 ->
#: 1.2 CPU s; measured 2026-12-07: six engine modules 302 -> 248 CPU s, the sampler paths and MoE
#: modules 145 -> 83). Numerics stay IEEE (no fast math at any level): the fixtures and recorded
#: runs still match. The last bits are not the default's, though (SmolLM2's logits up to 1e-4 apart
#: at one row, 1e-2 at eight: level 2 contracts multiplies and adds; and the elemental emitters
#: kept a mixture of experts' batch-invariant decode step 1 ulp away from the trainer's forward
#: pass, which the fusion emitters keep bit for bit). So the modules that compare bits between
#: differently compiled programs (batch invariance, trainer parity, scanned against unrolled layers)
#: carry `pytestmark = pytest.mark.bitwise`: their programs, and their subprocesses', compile with
#: the fusion emitters users get (`_bitwise_modules_compile_as_users_do`), at level 0. Rerun at the
#: default level (2026-12-07): the batch-invariant Llama tests (tests/models/test_batch_invariant.py)
#: and the Qwen3.5 and MoE scan and invariance tests keep their bits; four do not
#: (docs/reproducibility.md, "At XLA:CPU's default level").
LEVEL_FLAG = "--xla_backend_optimization_level=0"
EMITTERS_FLAG = "--xla_cpu_use_fusion_emitters=false"
#: Whether a module's compiles can be switched back to the fusion emitters: through the compile
#: options JAX builds for every executable (`jax._src.compiler.get_compile_options`, wrapped below).
#: Without that function (another JAX) the whole run keeps the fusion emitters: slower, as correct.
EMITTERS_SWITCHABLE = callable(getattr(jax_compiler, "get_compile_options", None))
TEST_XLA_FLAGS = f"{LEVEL_FLAG} {EMITTERS_FLAG}" if EMITTERS_SWITCHABLE else LEVEL_FLAG
# JAX reads XLA_FLAGS when its backend starts (at the first array or device query), not at import:
# the imports above start none.
for _flag in TEST_XLA_FLAGS.split():
  if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()
# libtpu (the `tpu` extra, which the test extra installs) takes a lockfile when a process loads
# it, and a second process then fails ("Internal error when accessing libtpu multi-process
# lockfile"). The tests only compile for TPU topologies without a TPU (`jax.experimental.
# topologies`), several at once on the xdist workers and their subprocesses: no process owns a
# chip, so they share the library.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

#: Unset: the run's cache is a new temporary directory, removed at the end. `off` (or another
#: spelling of jaxengine's "no cache"): no persistent cache at all. A path: that directory, kept
#: (to carry compiles from one local run to the next; CI leaves this unset).
RUN_CACHE_SWITCH = "JAXENGINE_TEST_COMPILATION_CACHE"
#: Whether this process made the run's cache directory (and so removes it at the end).
_OWN_RUN_CACHE = False


def _share_a_compilation_cache_for_the_run() -> None:
  """Points JAX's persistent compilation cache at a directory of the run's own (RUN_CACHE_SWITCH).

  Tests never touch the user's cache (nor the user's GGUF indexes: the run keeps its own beside
  its executables), yet the same engine steps (the same tiny and SmolLM2 engines, in many
  modules, on both xdist workers, and in the subprocesses of the docs pages, notebooks and mesh
  tests) compile once per run: later builds read them back. A read-back still
  counts as a compile in `jaxengine.testing.count_compiles`, so compile counts do not change.
  The process that starts the run (the xdist controller, or a run without xdist) makes the
  directory; the variables reach the workers and every subprocess, which JAX reads at import.
  The tests of the cache itself give it directories of their own. (A shared cache once saw a
  worker crash inside `put_executable_and_time`: that worker had reached `vm.max_map_count`,
  which `_release_compiled_code` now prevents.)
  """
  global _OWN_RUN_CACHE
  if os.environ.get("PYTEST_XDIST_WORKER"):  # a worker: the controller's variables hold
    return
  os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)  # never the user's own
  switch = os.environ.get(RUN_CACHE_SWITCH)
  if switch is not None and is_off(switch):
    os.environ["JAXENGINE_COMPILATION_CACHE"] = "off"
    os.environ[gguf_loader.INDEX_DIR_ENV] = "off"
    return
  if switch:
    cache = os.path.abspath(os.path.expanduser(switch))
    os.makedirs(cache, exist_ok=True)
  else:
    cache = tempfile.mkdtemp(prefix="jaxengine-test-xla-")
    _OWN_RUN_CACHE = True
  os.environ["JAX_COMPILATION_CACHE_DIR"] = cache
  # Also a process that drops JAX's variables (the tests of the cache) stays off the user's.
  os.environ["JAXENGINE_COMPILATION_CACHE"] = cache
  # The GGUF indexes (`jaxengine.models.gguf_loader`) of the run, beside its executables.
  os.environ[gguf_loader.INDEX_DIR_ENV] = os.path.join(cache, "gguf")
  # Every executable, however quick its compile: the tests' steps are small, and many.
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  # JAX reads the variables at import, and this process may have imported it already.
  jax.config.update("jax_compilation_cache_dir", cache)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


_share_a_compilation_cache_for_the_run()

# Under pytest-xdist (`-n 2`): the tests of a module share its engines (module-scoped fixtures,
# cached builders), whose compiles are most of their time, so a module runs on one worker instead
# of compiling the same engines on both. The tests of the modules in INDEPENDENT build their own
# engines (or processes) and are handed out one by one. Units go heaviest first, so that no worker
# is left alone with a long one at the end.

#: Modules whose tests share nothing costly: each test is a unit of its own.
INDEPENDENT = frozenset({"test_golden_run.py", "test_notebooks.py"})

#: Rough seconds of the heaviest units under `-n 2` (a module file, or one test of an INDEPENDENT
#: module by its name); only their order matters, units not named come after them as collected.
WEIGHTS = {
  "test_docs.py": 230,
  "test_notebook_runs[06_structured_outputs]": 115,
  "test_notebook_runs[01_quickstart]": 110,
  "test_batch_invariant.py": 90,
  "test_tunix.py": 90,
  "test_gemma4_scan.py": 70,
  "test_notebook_runs[03_sampling_distributions]": 65,
  "test_qwen3_5.py": 65,
  "test_gemma.py": 65,
  "test_structured_outputs.py": 60,
  "test_qwen3_5_scan.py": 55,
  "test_engine.py": 50,
  "test_precompile.py": 50,
  "test_data_parallel.py": 50,
  "test_checkpoints.py": 45,
  "test_mesh.py": 30,
  "test_moe.py": 40,
  "test_tunix_lora.py": 40,
  "test_compile.py": 35,
  "test_lora.py": 35,
  "test_sleep.py": 30,
  "test_engine_mesh.py": 30,
  "test_layer_scan.py": 30,
  "test_speculative_hybrid.py": 30,
  "test_async_scheduling.py": 30,
  "test_gemma_scan.py": 30,
  "test_rollout.py": 30,
  "test_model.py": 30,
  "test_composition.py": 25,
  "test_cli.py": 25,
  "test_kv_cache_dtype.py": 25,
  "test_gemma4.py": 25,
  "test_engine_under_pressure.py": 25,
  "test_sampler_paths.py": 25,
  "test_quantization.py": 20,
  "test_sharded_sampler.py": 20,
  "test_multi_step.py": 20,
  "test_qwen3_5_moe.py": 20,
  "test_speculative_pages.py": 20,
  "test_stop_rules.py": 20,
  "test_serve.py": 15,
  "test_serve_control.py": 15,
  "test_outputs_match_the_recorded_run[smollm2_paged]": 13,
  "test_outputs_match_the_recorded_run[tiny_paged]": 9,
  "test_outputs_match_the_recorded_run[tiny_speculative]": 6,
  "test_outputs_match_the_recorded_run[tiny_paged_no_prefix_cache]": 4,
  "test_outputs_match_the_recorded_run[tiny_multi_step]": 3,
}


def _weight(item: pytest.Item) -> int:
  if item.path.name in INDEPENDENT:
    return WEIGHTS.get(item.name, 0)
  return WEIGHTS.get(item.path.name, 0)


def pytest_configure(config):
  """Registers the `bitwise` marker; removes the run's compilation cache when the run ends (in the
  process that made it)."""
  config.addinivalue_line(
    "markers",
    "bitwise: the module compares bits between differently compiled programs; they compile with "
    "XLA:CPU's fusion emitters, as users' do (tests/conftest.py, TEST_XLA_FLAGS)",
  )
  cache = os.environ.get("JAX_COMPILATION_CACHE_DIR")
  if _OWN_RUN_CACHE and cache:
    config.add_cleanup(lambda: shutil.rmtree(cache, ignore_errors=True))


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


#: Set to a file path: each worker appends a JSON line per module (wall seconds from its first
#: test's setup to its last teardown, XLA compiles and their seconds, and per jitted function its
#: compiles, seconds and persistent-cache hits), to see where the suite's time goes:
#: `JAXENGINE_TEST_PROFILE=/tmp/profile.jsonl python -m pytest -n 2 tests`.
PROFILE_SWITCH = "JAXENGINE_TEST_PROFILE"


class _CompileLog(logging.Filter):
  """Reads JAX's debug records of each compile (its function, seconds, and whether the persistent
  cache served it) and drops them, so they reach no handler; other records pass."""

  LOGGERS = ("jax._src.dispatch", "jax._src.compiler")

  def __init__(self):
    super().__init__()
    self.functions: dict[str, list[float]] = {}  # name -> [compiles, seconds, cache hits]
    self._hit = False

  def filter(self, record: logging.LogRecord) -> bool:
    message = record.getMessage()
    if message.startswith("Persistent compilation cache hit"):
      self._hit = True
    elif message.startswith("Finished XLA compilation of "):
      name, _, seconds = message.removeprefix("Finished XLA compilation of ").partition(" in ")
      entry = self.functions.setdefault(name, [0, 0.0, 0])
      entry[0] += 1
      entry[1] += float(seconds.split()[0])
      entry[2] += self._hit
      self._hit = False
    return record.levelno >= logging.WARNING

  @contextlib.contextmanager
  def attached(self):
    loggers = [logging.getLogger(name) for name in self.LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
      logger.addFilter(self)
      logger.setLevel(logging.DEBUG)
    try:
      yield self
    finally:
      for logger, level in zip(loggers, levels, strict=True):
        logger.removeFilter(self)
        logger.setLevel(level)


@pytest.fixture(scope="module", autouse=True)
def _profile_module(request):
  """Appends the module's wall time and compiles to the PROFILE_SWITCH file, when it is set."""
  path = os.environ.get(PROFILE_SWITCH)
  if not path:
    yield
    return
  start = time.perf_counter()
  compiles = count_compiles().start()
  with _CompileLog().attached() as log:
    yield
  with contextlib.suppress(AssertionError):  # a module (Tunix's) may clear JAX's listeners
    compiles.stop()
  record = {
    "module": request.module.__name__,
    "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
    "seconds": round(time.perf_counter() - start, 1),
    "compiles": compiles.count,
    "compile_seconds": round(compiles.seconds, 1),
    "functions": {k: [n, round(s, 2), h] for k, (n, s, h) in log.functions.items()},
  }
  with open(path, "a") as f:
    f.write(json.dumps(record) + "\n")


#: True while a `bitwise` module runs: the executables it compiles use XLA:CPU's fusion emitters.
_fusion_emitters = False


def _compile_options(*args, **kwargs):
  """JAX's compile options for an executable, with the fusion emitters switched back on while a
  `bitwise` module runs (an override that JAX's persistent cache keys on: the two kinds of
  executable never serve each other)."""
  options = _jax_compile_options(*args, **kwargs)
  if _fusion_emitters:
    options.env_option_overrides = [
      *options.env_option_overrides,
      ("xla_cpu_use_fusion_emitters", True),
    ]
  return options


if EMITTERS_SWITCHABLE:
  _jax_compile_options = jax_compiler.get_compile_options
  jax_compiler.get_compile_options = _compile_options


def _forget_compiled_code() -> None:
  device_steps.clear()
  jax.clear_caches()


@pytest.fixture(scope="module", autouse=True)
def _bitwise_modules_compile_as_users_do(request):
  """In a module marked `bitwise`, every executable compiles with XLA:CPU's fusion emitters, its
  own and its subprocesses' (TEST_XLA_FLAGS' emitter flag is dropped from their XLA_FLAGS); what
  was compiled before, with the other emitters, is forgotten first and after."""
  global _fusion_emitters
  if not EMITTERS_SWITCHABLE or request.node.get_closest_marker("bitwise") is None:
    yield
    return
  flags = os.environ.get("XLA_FLAGS", "")
  os.environ["XLA_FLAGS"] = " ".join(flag for flag in flags.split() if flag != EMITTERS_FLAG)
  _fusion_emitters = True
  _forget_compiled_code()
  try:
    yield
  finally:
    _forget_compiled_code()
    _fusion_emitters = False
    os.environ["XLA_FLAGS"] = flags


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
  _forget_compiled_code()
  gc.collect()
