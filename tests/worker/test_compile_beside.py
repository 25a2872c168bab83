"""A new row bucket's sampler compiles beside the model part of its step
(`jaxengine/worker/compile_beside.py`): once, on the compiling thread, and the sampler's own call
then compiles nothing; a compile that fails there is left to the call; the tokens are the same;
``JAXENGINE_COMPILE_BESIDE=off`` compiles on the engine's thread.

A tiny Llama with a vocabulary no other module's sampler has, so every sampler compile here is
this module's own (JAX's in-memory caches are per process).
"""

from __future__ import annotations

import jax
import pytest
from output_utils import step_to_end

import jaxengine as je
from jaxengine.engine import LLMEngine
from jaxengine.testing import CompileCounter, count_compiles, tiny_llama
from jaxengine.worker import compile_beside
from jaxengine.worker.buckets import MIN_SAMPLE_ROWS

VOCAB = 203
BESIDE = "beside"  # the compiling thread (`ThreadPoolExecutor` names it "jaxengine-beside_0")


def _threads(compiles: CompileCounter, fun_name: str) -> list[str]:
  """The threads that compiled `fun_name`, in the order the compiles ended (the compiling
  thread as `BESIDE`)."""
  return [
    BESIDE if thread.startswith("jaxengine-beside") else thread
    for name, thread in compiles.compiled
    if name == fun_name
  ]


def _run(engine: LLMEngine, num_requests: int, first: int = 0) -> list[list[int]]:
  params = je.SamplingParams(temperature=0.8, seed=7, max_tokens=3, ignore_eos=True)
  for i in range(first, first + num_requests):
    engine.add_request(f"r{i}", [5 + i, 6, 7], params)
  return [list(o.outputs[0].token_ids) for o in sorted(step_to_end(engine), key=_index)]


def _index(output) -> int:
  return int(output.request_id[1:])


@pytest.fixture(autouse=True)
def _beside(monkeypatch):
  """On for this module (the suite turns it off: `tests/conftest.py`)."""
  monkeypatch.setenv(compile_beside.ENV_VAR, "on")


def _engine(max_model_len: int) -> LLMEngine:
  model, _ = tiny_llama(vocab_size=VOCAB)
  return LLMEngine(model, None, max_num_reqs=16, max_model_len=max_model_len)


def test_each_new_sampler_bucket_compiles_once_on_the_compiling_thread():
  engine = _engine(max_model_len=64)
  with count_compiles() as compiles:
    _run(engine, 1)  # the first sampler bucket (MIN_SAMPLE_ROWS rows)
    assert _threads(compiles, "jit(sample_produced)") == [BESIDE]
    assert BESIDE not in _threads(compiles, "jit(ragged_forward)")  # the model: the engine's thread
    _run(engine, 1, first=1)  # the same bucket: nothing more
    assert _threads(compiles, "jit(sample_produced)") == [BESIDE]
    _run(engine, MIN_SAMPLE_ROWS + 1, first=2)  # a larger bucket: its own, once
    assert _threads(compiles, "jit(sample_produced)") == [BESIDE, BESIDE]
  # The calls found what the thread compiled: one entry in the jitted sampler's cache a bucket.
  assert engine.runner.sample_produced._cache_size() == 2


def test_a_compile_that_fails_on_the_thread_is_left_to_the_call(monkeypatch):
  expected = _run(_engine(max_model_len=96), MIN_SAMPLE_ROWS + 2)

  def fail(jitted, *args):
    raise RuntimeError("the compiling thread failed")

  monkeypatch.setattr(compile_beside, "_compile", fail)
  jax.clear_caches()  # the sampler compiles again, now on the engine's thread
  engine = _engine(max_model_len=96)
  with count_compiles() as compiles:
    assert _run(engine, MIN_SAMPLE_ROWS + 2) == expected
  assert _threads(compiles, "jit(sample_produced)") == ["MainThread"]


def test_the_switch_off_compiles_the_sampler_on_the_engine_thread(monkeypatch):
  monkeypatch.setenv(compile_beside.ENV_VAR, "off")
  engine = _engine(max_model_len=80)
  with count_compiles() as compiles:
    _run(engine, 1)
  assert _threads(compiles, "jit(sample_produced)") == ["MainThread"]


@pytest.mark.parametrize("rows", [1, MIN_SAMPLE_ROWS + 1])
def test_the_tokens_are_those_of_a_sampler_compiled_on_the_engine_thread(monkeypatch, rows):
  beside = _run(_engine(max_model_len=128), rows)
  monkeypatch.setattr(compile_beside.SamplerBeside, "_started", lambda self, sample, *a: sample)
  jax.clear_caches()
  assert _run(_engine(max_model_len=128), rows) == beside
