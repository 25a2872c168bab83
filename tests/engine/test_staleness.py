"""The staleness bound of asynchronous RL (`SamplingParams.max_staleness`,
`jaxengine/engine/pause.py`): a request whose oldest token is more than K weight versions behind
the engine's ends with finish reason "abort" and the tokens it had, on `LLMEngine` and on
`AsyncLLM`; and an "abort" pause ends the requests still waiting for a row as well.

One tiny Llama `LLM` (byte tokenizer, 4 rows) serves the module: its engine for the synchronous
tests, then an `AsyncLLM` over it (the last test)."""

from __future__ import annotations

import asyncio

import pytest
from byte_tokenizer import byte_tokenizer
from flax import nnx

import jaxengine as je
from jaxengine.testing import tiny_llama

LONG = {"max_tokens": 40, "ignore_eos": True}


@pytest.fixture(scope="module")
def llm():
  tokenizer = byte_tokenizer()
  model, _ = tiny_llama(vocab_size=tokenizer.vocab_size, max_position_embeddings=128)
  return je.LLM(model, tokenizer=tokenizer, max_num_reqs=4, max_model_len=96)


def _step_to_end(engine, finished: dict[str, je.RequestOutput]) -> None:
  while engine.has_unfinished_requests():  # a dropped request's output counts as unfinished
    finished.update((o.request_id, o) for o in engine.step() if o.finished)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_a_bad_max_staleness_is_a_value_error_naming_it(llm, bad):
  engine = llm.llm_engine
  message = f"max_staleness must be None or an int >= 0, got {bad!r}"
  with pytest.raises(ValueError, match=message):
    je.SamplingParams(max_staleness=bad)
  params = je.SamplingParams()
  params.max_staleness = bad  # assigned after construction: refused where the engine copies it
  with pytest.raises(ValueError, match=message):
    engine.add_request("bad", "ab", params)
  assert not engine.has_unfinished_requests() and engine.pop_finished() == []


def test_requests_past_their_staleness_bound_end_at_a_load_with_their_tokens(llm):
  """A keep-mode pause, then loads of versions 1 and 2: a request with K = 0 ends at the first
  load (finish reason "abort", every token it had, all of version 0, a prefix of its
  uninterrupted run), one with K = 1 at the second (its oldest token is then 2 versions behind),
  while one without a bound, one whose tokens are all recent enough, and one held by the pause
  (no token until resume) run to the end; the dropped ones' outputs come out of `step`."""
  engine = llm.llm_engine
  weights = nnx.state(engine.runner.model)
  greedy = je.SamplingParams(temperature=0, **LONG)
  want = llm.generate(["ab ab ab"], greedy, use_tqdm=False)[0].outputs[0].token_ids
  requests = {"k0": 0, "k1": 1, "none": None}
  for request_id, bound in requests.items():
    engine.add_request(request_id, "ab ab ab", greedy.replace(max_staleness=bound))
  finished: dict[str, je.RequestOutput] = {}
  for _ in range(4):
    finished.update((o.request_id, o) for o in engine.step() if o.finished)
  engine.pause_generation("keep")
  engine.add_request("held", "ab ab ab", greedy.replace(max_staleness=1))
  engine.load_weights(weights, weight_version=1)
  assert "k0" not in {c.request.request_id for c in engine.scheduler.running.values()}
  dropped = {o.request_id: o for o in engine.step()}  # while paused: the dropped one alone
  assert list(dropped) == ["k0"] and dropped["k0"].finished
  k0 = dropped["k0"].outputs[0]
  assert k0.finish_reason == "abort" and 0 < len(k0.token_ids) < 40
  assert k0.token_ids == want[: len(k0.token_ids)]
  assert k0.weight_versions == [0] * len(k0.token_ids)
  engine.resume_generation()
  for _ in range(3):
    finished.update((o.request_id, o) for o in engine.step() if o.finished)
  engine.pause_generation("keep")
  engine.load_weights(weights, weight_version=2)
  engine.resume_generation()
  _step_to_end(engine, finished)
  assert sorted(finished) == ["held", "k1", "none"]
  k1 = finished["k1"].outputs[0]
  assert k1.finish_reason == "abort" and len(k0.token_ids) < len(k1.token_ids) < 40
  assert k1.weight_versions[0] == 0 and k1.weight_versions[-1] == 1
  for request_id in ("held", "none"):  # unchanged weights: the uninterrupted tokens
    completion = finished[request_id].outputs[0]
    assert completion.finish_reason == "length" and completion.token_ids == want, request_id
  assert finished["held"].outputs[0].weight_versions[0] == 1
  assert engine.kv_cache_stats.num_used_blocks == 0 and engine.runner.input_batch.num_reqs == 0


def test_a_vllm_style_loop_gets_a_dropped_requests_output_and_versions_never_go_back(llm):
  """vLLM's `while has_unfinished_requests(): step()` loop: a request dropped at resume (its
  only request) still counts as unfinished until `step` has returned its final output. A load
  may repeat the current version, never go below it (ValueError naming it, nothing changed)."""
  engine = llm.llm_engine
  weights = nnx.state(engine.runner.model)
  engine.add_request("only", "ef ef", je.SamplingParams(temperature=0, max_staleness=0, **LONG))
  for _ in range(3):
    engine.step()
  engine.pause_generation("keep")
  version = engine.weight_version
  engine.load_weights(weights, weight_version=version)  # the same version again: not stale
  with pytest.raises(ValueError, match=f"weight_version must not go back: got {version - 1}"):
    engine.load_weights(weights, weight_version=version - 1)
  assert engine.weight_version == version and not engine.take_dropped()
  engine.load_weights(weights, weight_version=version + 1)
  engine.resume_generation()
  outputs = []
  while engine.has_unfinished_requests():
    outputs += engine.step()
  assert [o.request_id for o in outputs if o.finished] == ["only"]
  assert outputs[-1].outputs[0].finish_reason == "abort"


def test_a_first_token_still_on_the_device_counts_as_the_oldest(llm):
  """With asynchronous scheduling a load between steps may find a request whose first token is
  in the step in flight: that token carries the old version, so K = 0 drops the request (no
  token read), while a request that has read nothing and has nothing in flight never is."""
  engine = llm.llm_engine
  weights = nnx.state(engine.runner.model)
  version = engine.weight_version
  engine.add_request("first", "cd cd", je.SamplingParams(temperature=0, max_staleness=0, **LONG))
  engine.step()  # dispatches the prefill; its token is read by the next step
  [completion] = engine.scheduler.running.values()
  assert completion.token_ids == [] and completion.num_output_placeholders == 1
  engine.add_request("queued", "cd cd", je.SamplingParams(temperature=0, max_staleness=0, **LONG))
  engine.load_weights(weights)  # no version given: the current one + 1
  assert engine.weight_version == version + 1
  outputs = {o.request_id: o for o in engine.step()}
  first = outputs["first"].outputs[0]
  assert outputs["first"].finished and first.finish_reason == "abort" and first.token_ids == []
  finished: dict[str, je.RequestOutput] = {}
  _step_to_end(engine, finished)
  queued = finished["queued"].outputs[0]
  assert queued.finish_reason == "length" and set(queued.weight_versions) == {version + 1}


def test_an_abort_pause_ends_the_requests_waiting_for_a_row_too(llm):
  """Six requests on four rows: "abort" ends the running ones and the waiting ones, every output
  finished with finish reason "abort" (the waiting ones with no token), none left behind."""
  engine = llm.llm_engine
  params = je.SamplingParams(temperature=0, **LONG)
  for index in range(6):
    engine.add_request(f"r{index}", f"prompt {index}", params)
  engine.step()
  engine.step()
  aborted = {o.request_id: o for o in engine.pause_generation("abort")}
  engine.resume_generation()
  assert sorted(aborted) == [f"r{index}" for index in range(6)]
  assert all(o.finished and o.outputs[0].finish_reason == "abort" for o in aborted.values())
  assert sum(not o.outputs[0].token_ids for o in aborted.values()) == 2
  assert not engine.has_unfinished_requests() and engine.pop_finished() == []


def test_async_llm_streams_a_dropped_request_at_the_load_while_paused(llm):
  """`AsyncLLM`: a stream with K = 0 ends at a load while paused, before resume (its last output
  finished, finish reason "abort"); one without a bound goes on after resume; a bad
  `weight_version` is refused and changes nothing; pausing twice and resuming when not paused
  are harmless, a "wait" pause over a "keep" one too."""
  engine = je.AsyncLLM(llm)
  weights = nnx.state(llm.llm_engine.runner.model)
  params = je.SamplingParams(temperature=0, **LONG)

  async def main():
    await engine.resume_generation()  # not paused: harmless
    stale = engine.generate("ab ab", params.replace(max_staleness=0))
    kept = engine.generate("ab ab", params)
    await anext(stale)
    await anext(kept)
    await engine.pause_generation("keep")
    await engine.pause_generation("keep")  # twice: harmless
    # "wait" over a "keep" pause returns at once: the kept requests cannot finish while frozen.
    await asyncio.wait_for(engine.pause_generation("wait"), timeout=30)
    version = llm.llm_engine.weight_version
    for bad in (-2, 2.0):
      with pytest.raises(ValueError, match=f"weight_version must be a non-negative int, got {bad}"):
        await engine.load_weights(weights, weight_version=bad)
    assert llm.llm_engine.weight_version == version
    await engine.load_weights(weights, weight_version=version + 1)
    last = [o async for o in stale][-1]  # streamed while still paused
    assert await engine.is_paused()
    await engine.resume_generation()
    kept_last = [o async for o in kept][-1]
    # A resume while a "wait" pause waits calls that pause off: nothing stays paused after it.
    slow = engine.generate("ab ab", params)
    await anext(slow)
    waiting = asyncio.create_task(engine.pause_generation("wait"))
    await asyncio.sleep(0.05)
    await engine.resume_generation()
    await asyncio.wait_for(waiting, timeout=60)
    assert not await engine.is_paused()
    fresh = [o async for o in engine.generate("cd", params.replace(max_tokens=2))][-1]
    assert fresh.finished and [o async for o in slow][-1].finished
    return last, kept_last

  try:
    last, kept = asyncio.run(asyncio.wait_for(main(), timeout=120))
  finally:
    engine.shutdown()
  assert last.finished and last.outputs[0].finish_reason == "abort"
  assert 0 < len(last.outputs[0].token_ids) < 40
  assert kept.outputs[0].finish_reason == "length" and len(kept.outputs[0].token_ids) == 40
