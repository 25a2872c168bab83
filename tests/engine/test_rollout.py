"""Rollout throughput: several decode steps per dispatch, precompile, the persistent compile cache.

Every feature must leave the outputs exactly as they are without it (tokens, logprobs, text,
finish and stop reasons), so each test runs the same requests with the feature on and off.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest
from cacheless import assert_logprobs_match
from step_shapes import one_shape

import jaxengine as je
from jaxengine.compilation_cache import ENV_VAR, resolve_cache_dir
from jaxengine.engine import LLMEngine
from jaxengine.testing import tiny_llama
from jaxengine.tokenizer import Tokenizer
from jaxengine.worker import device_steps

EOS = 3
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14], [4], [20, 21, 22, 23], [30] * 17, [40, 41]]
MIXES = [
  je.SamplingParams(temperature=0, max_tokens=13),
  je.SamplingParams(temperature=0.8, top_k=5, seed=1, max_tokens=16, logprobs=2),
  je.SamplingParams(
    temperature=1.0, top_p=0.5, seed=3, presence_penalty=1.0, max_tokens=24, stop_token_ids=[7, 9]
  ),
  je.SamplingParams(
    temperature=0.5, seed=4, max_tokens=12, min_tokens=5, prompt_logprobs=1,
    stop_token_ids=[1, 2, 4, 5, 6],
  ),
  je.SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=40, logprobs=0),
  je.SamplingParams(temperature=1.0, seed=6, max_tokens=30, ignore_eos=True, min_tokens=2),
]  # fmt: skip


def assert_same_outputs(got, expected):
  """Equal in every field; logprob values equal up to float32 rounding (1e-5 relative).

  A row's logits and logprobs come from executables compiled for its row bucket; the bucket
  around a given step can differ between k = 1 (finished rows leave at once) and k > 1 (they
  leave at the end of the dispatch), and between a prefill of 1 or of n rows, and XLA may
  round a reduction differently in another executable (as with other batch mates at k = 1).
  Tokens, ranks, text and finish reasons must be exactly equal.
  """
  assert len(got) == len(expected)
  for a, b in zip(got, expected):
    assert dataclasses.replace(a, outputs=[]) == dataclasses.replace(b, outputs=[])
    for ca, cb in zip(a.outputs, b.outputs, strict=True):
      fields = ("index", "text", "token_ids", "finish_reason", "stop_reason")
      assert [getattr(ca, f) for f in fields] == [getattr(cb, f) for f in fields]
      assert (ca.logprobs is None) == (cb.logprobs is None)
      if ca.logprobs is None:
        assert ca.cumulative_logprob == cb.cumulative_logprob
        continue
      np.testing.assert_allclose(ca.cumulative_logprob, cb.cumulative_logprob, rtol=1e-5)
      for da, db in zip(ca.logprobs, cb.logprobs, strict=True):
        assert [(t, v.rank, v.decoded_token) for t, v in da.items()] == [
          (t, v.rank, v.decoded_token) for t, v in db.items()
        ]
        np.testing.assert_allclose(
          [v.logprob for v in da.values()], [v.logprob for v in db.values()], rtol=1e-5
        )


def run_engine(engine: LLMEngine, prompts=PROMPTS, mixes=MIXES, arrive_while_running=False):
  """Queues `prompts` (each with the next of `mixes`, stepping after each one if
  `arrive_while_running`), runs them to the end, returns the outputs in prompt order."""
  finished = []
  for i, prompt in enumerate(prompts):
    engine.add_request(str(i), prompt, mixes[i % len(mixes)])
    if arrive_while_running:
      finished += [o for o in engine.step() if o.finished]
  while engine.has_unfinished_requests():
    finished += [o for o in engine.step() if o.finished]
  return sorted(finished, key=lambda o: int(o.request_id))


@pytest.fixture(scope="module")
def tiny_model():
  return tiny_llama(vocab_size=64)[0]


def test_several_decode_steps_per_dispatch_give_identical_outputs(tiny_model, compile_counter):
  # Two rows for ten completions, arriving while others run: requests wait, rows stop at EOS,
  # stop ids, max_tokens and max_model_len (ignore_eos reaches 32) at different steps.
  def engine(k, **options):
    return LLMEngine(
      tiny_model, max_num_reqs=2, max_model_len=32, eos_token_id=EOS, num_decode_steps=k,
      **options,
    )  # fmt: skip

  single, multi = engine(1, async_scheduling=False), engine(4)
  expected = run_engine(single, arrive_while_running=True)
  compile_counter.reset()
  assert_same_outputs(run_engine(multi, arrive_while_running=True), expected)
  reasons = {(c.finish_reason, c.stop_reason) for o in expected for c in o.outputs}
  assert {("length", None), ("stop", None)} <= reasons and any(
    isinstance(r, int) for _, r in reasons
  )
  # The k-step loop compiles once per row bucket (beside the ragged steps of prefills).
  runner = multi.runner
  assert runner.decode_steps._cache_size() <= len(runner.row_buckets) == 2
  # Steady: once all-at-once arrival has been seen too (other prefill shapes), the same
  # arrivals and finishes compile nothing and give the same outputs.
  assert_same_outputs(run_engine(multi), expected)
  compile_counter.reset()
  assert_same_outputs(run_engine(multi, arrive_while_running=True), expected)
  assert_same_outputs(run_engine(multi), expected)
  assert compile_counter.count == 0


def test_stop_strings_and_min_tokens_are_checked_on_the_host_after_the_loop():
  # The real tokenizer on a tiny random model of its first 512 ids (bytes and short pieces such
  # as "e", "th", " a"): text full of short pieces for stop strings to hit.
  tokenizer = Tokenizer.from_gguf()
  model = tiny_llama(vocab_size=512, hidden_size=32, num_hidden_layers=1)[0]
  mixes = [
    je.SamplingParams(temperature=1.0, seed=s, max_tokens=16, stop=stop, min_tokens=m, **extra)
    for s, (stop, m, extra) in enumerate(
      [
        (["e"], 0, {}),
        (["a", "th"], 3, {"include_stop_str_in_output": True, "n": 2}),
        (["o", "i", " "], 6, {"logprobs": 1}),
      ]
    )
  ]
  prompts = [[100, 200, 300], [400, 401], [50, 60, 70, 80]]
  # Both engines' steps in their largest shape (they pad alike): the loop, not bucket choice.
  outputs = [
    run_engine(
      one_shape(LLMEngine(model, tokenizer, max_num_reqs=2, max_model_len=32, num_decode_steps=k)),
      prompts,
      mixes,
    )
    for k in (1, 5)
  ]
  assert_same_outputs(outputs[1], outputs[0])
  assert any(isinstance(c.stop_reason, str) for o in outputs[0] for c in o.outputs)


def test_the_samples_of_a_request_share_one_prefill_of_its_prompt(tiny_model):
  """`n > 1` samples admitted together compute the prompt once: the others take its pages (a
  prefix-cache hit, or a fork of the first sample's pages with prefix caching off). Their
  tokens, logprobs and prompt logprobs are those of an engine-free forward pass."""
  mixes = [
    je.SamplingParams(temperature=1.0, seed=7, n=4, max_tokens=6, logprobs=1, prompt_logprobs=2),
    je.SamplingParams(temperature=0.5, seed=1, n=2, max_tokens=5, logprobs=0),
    je.SamplingParams(temperature=0.9, n=3, max_tokens=7, top_k=8),  # unseeded: engine key
  ]
  prompts = [list(range(5, 25)), [8, 9, 10], [11, 12, 13, 14]]
  engine = one_shape(
    LLMEngine(tiny_model, max_num_reqs=4, max_model_len=32, enable_prefix_caching=False)
  )  # checked against a forward pass: its steps in one shape
  scheduled: list[int] = []
  schedule = engine.scheduler.schedule

  def record(draft_token_ids=None):
    out = schedule(draft_token_ids)
    scheduled.append(out.total_num_scheduled_tokens)
    return out

  engine.scheduler.schedule = record  # type: ignore[method-assign]
  outputs = run_engine(engine, prompts, mixes)
  decoded = sum(len(c.token_ids) for o in outputs for c in o.outputs)
  # Rows 4 + 2 + 3 (+ the rest as rows free up): a sample computes its prompt only when it is the
  # first of its request admitted (the others share its pages and compute only their own tokens).
  prompt_tokens = sum(scheduled) - (decoded - sum(len(o.outputs) for o in outputs))
  assert prompt_tokens < sum(len(p) * m.n for p, m in zip(prompts, mixes))
  assert assert_logprobs_match(tiny_model, outputs, 32) > 4 * 6 + 19 * 3
  assert len({tuple(c.token_ids) for c in outputs[0].outputs}) > 1  # seeds seed + j


def test_precompile_leaves_nothing_to_compile_for_plain_requests(tiny_model, compile_counter):
  # The first test's k-step engine, its executables jitted afresh (`device_steps.clear`): only
  # `precompile` can have compiled what the requests below run (the shapes that engine compiled
  # too are read back from the run's persistent cache, not compiled again).
  device_steps.clear()
  engine = LLMEngine(
    tiny_model, max_num_reqs=2, max_model_len=32, eos_token_id=EOS, num_decode_steps=4
  )
  # The ragged step per reachable (token bucket, row bucket): token buckets 1..64, from 2 tokens
  # with 2 rows (13); its prompt-logprobs variant in the largest row bucket (6); the 4-step loop
  # per row bucket (2).
  assert engine.precompile(use_tqdm=False) == 13 + 6 + 2
  compile_counter.reset()
  prompts = [*PROMPTS[:5], [30] * 17, [30] * 16 + [5, 6], [30] * 16 + [7]]
  run_engine(engine, prompts, [je.SamplingParams(temperature=0.7, seed=1, max_tokens=5)])
  assert compile_counter.count == 0  # the batch's row updates are precompiled too
  engine.add_request("x", [1, 2], je.SamplingParams(max_tokens=50))
  engine.step()
  with pytest.raises(ValueError, match="precompile needs an empty batch, it holds 1 requests"):
    engine.precompile(use_tqdm=False)


def test_bad_options_are_refused_by_name(tiny_model):
  with pytest.raises(ValueError, match="num_decode_steps must be an int >= 1, got 0"):
    LLMEngine(tiny_model, num_decode_steps=0)
  with pytest.raises(ValueError, match="compilation_cache must be True, False or a directory"):
    je.LLM(tiny_model, compilation_cache=3)


def test_cache_directory_resolution(monkeypatch, tmp_path):
  monkeypatch.delenv(ENV_VAR, raising=False)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  assert resolve_cache_dir() == tmp_path / "jaxengine" / "xla"
  assert resolve_cache_dir(False) is None
  assert resolve_cache_dir(tmp_path / "mine") == tmp_path / "mine"
  monkeypatch.setenv(ENV_VAR, "off")
  assert resolve_cache_dir() is None
  monkeypatch.setenv(ENV_VAR, str(tmp_path / "env"))
  assert resolve_cache_dir() == tmp_path / "env"


def test_cache_off_spellings_agree_for_the_argument_the_flag_and_the_variable(
  monkeypatch, tmp_path
):
  """ "off" (any case), "false", "no", "0" and "" mean no cache whichever way they come; a path
  is a path. `LLM(compilation_cache="off")` used to create a directory named off."""
  from jaxengine.compilation_cache import enable_compilation_cache
  from jaxengine.engine.engine_flags import compilation_cache as cli_flag

  monkeypatch.chdir(tmp_path)
  monkeypatch.delenv(ENV_VAR, raising=False)
  for spelling in ("off", "OFF", " Off ", "false", "no", "0", ""):
    assert resolve_cache_dir(spelling) is None, spelling
    assert resolve_cache_dir(cli_flag(spelling)) is None, spelling
    monkeypatch.setenv(ENV_VAR, spelling)
    assert resolve_cache_dir() is None, spelling
    monkeypatch.delenv(ENV_VAR)
  assert resolve_cache_dir(cli_flag("mine")) == Path("mine")
  assert resolve_cache_dir(Path("off") / "xla") == Path("off") / "xla"  # a path, not a spelling
  # In a process with no cache, "off" turns none on. The run's cache (conftest.py) is set aside
  # meanwhile: nothing compiles in between.
  run_cache = jax.config.jax_compilation_cache_dir
  jax.config.update("jax_compilation_cache_dir", None)
  try:
    assert enable_compilation_cache("off") is None
    assert not jax.config.jax_compilation_cache_dir
  finally:
    jax.config.update("jax_compilation_cache_dir", run_cache)
  assert not (tmp_path / "off").exists()


_LATER_ENGINE_CHILD = textwrap.dedent(
  """
  import json, os, sys, warnings
  from jaxengine.compilation_cache import ENV_VAR, enable_compilation_cache
  first, other = sys.argv[1], sys.argv[2]
  results = {"first": str(enable_compilation_cache(first))}
  for name, value, env in [("same", first, None), ("default", True, None), ("off", False, None),
                           ("off_text", "off", None), ("other", other, None),
                           ("env_other", True, other)]:
    if env is not None:
      os.environ[ENV_VAR] = env
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      used = enable_compilation_cache(value)
    results[name] = [str(used), [str(w.message) for w in caught]]
  print(json.dumps(results))
  """
)


def test_a_later_engine_asking_for_another_cache_is_warned(tmp_path):
  """JAX reads its cache directory once per process: a later explicit request for another cache
  (a path, off, or the variable) is warned about, naming both; the default and the same path are
  not. Run in a child process: the test process's JAX config stays untouched."""
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
  env.pop(ENV_VAR, None)
  env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
  first, other = tmp_path / "first", tmp_path / "other"
  done = subprocess.run(
    [sys.executable, "-c", _LATER_ENGINE_CHILD, str(first), str(other)],
    env=env,
    capture_output=True,
    text=True,
  )
  assert done.returncode == 0, done.stderr
  results = json.loads(done.stdout.strip().splitlines()[-1])
  assert results["first"] == str(first)
  for name in ("same", "default", "off", "off_text", "other", "env_other"):
    used, messages = results[name]
    assert used == str(first), name  # the process keeps its cache
    assert len(messages) == (name not in ("same", "default")), (name, messages)
    for message in messages:
      assert str(first) in message and "has no effect" in message
  assert str(other) in results["other"][1][0] and "no cache" in results["off"][1][0]
  assert not other.exists()


_CHILD = textwrap.dedent(
  """
  import json, sys
  import jax
  hits = []
  jax.monitoring.register_event_listener(
    lambda event, **kw: hits.append(1) if event == "/jax/compilation_cache/cache_hits" else None
  )
  import jaxengine as je
  from jaxengine.testing import tiny_llama
  llm = je.LLM(tiny_llama(vocab_size=64)[0], max_num_reqs=2, max_model_len=32,
               compilation_cache=sys.argv[1])
  out = llm.generate([[5, 6, 7]], je.SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
  print(json.dumps({"dir": str(llm.compilation_cache_dir), "hits": len(hits),
                    "tokens": out[0].outputs[0].token_ids}))
  """
)


def test_the_persistent_cache_is_used_on_a_second_process_start(tmp_path):
  cache = tmp_path / "xla"
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
  env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
  runs = []
  for _ in range(2):
    done = subprocess.run(
      [sys.executable, "-c", _CHILD, str(cache)], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
  assert runs[0]["dir"] == runs[1]["dir"] == str(cache)
  assert runs[0]["hits"] == 0 and any(cache.iterdir())
  assert runs[1]["hits"] >= 3  # prefill, decode, the batch's steps: read back, not compiled
  assert runs[0]["tokens"] == runs[1]["tokens"]
