"""Malformed input found by trying the library as a new user: each is a clear ValueError naming the
field, raised before anything changes."""

from __future__ import annotations

import re

import numpy as np
import pytest
from batch_utils import RAW, R, V, make_batch

import jaxengine as je
from jaxengine.testing import tiny_llama


@pytest.fixture
def batch():
  b = make_batch(**RAW, eos_token_ids=[2])  # a standard sampler executable (batch_utils)
  b.add_request("a", [1, 2], je.SamplingParams())
  return b


@pytest.mark.parametrize(
  "req_id, prompt, params, field",
  [
    (None, [1], je.SamplingParams(), "req_id"),
    (7, [1], je.SamplingParams(), "req_id"),
    ("x", [1.9, 2.2], je.SamplingParams(), "prompt_token_ids"),
    ("x", [[1, 2], [3, 4]], je.SamplingParams(), "prompt_token_ids"),
    ("x", [True, False], je.SamplingParams(), "prompt_token_ids"),
    ("x", 5, je.SamplingParams(), "prompt_token_ids"),
    ("x", [], je.SamplingParams(), "prompt_token_ids"),
    ("x", np.zeros((0,), np.int32), je.SamplingParams(), "prompt_token_ids"),
    (
      "x",
      [1],
      je.SamplingParams(allowed_token_ids=[5, 6], bad_words_token_ids=[[5], [6]]),
      "bad_words_token_ids",
    ),
    (
      "x",
      [1],
      je.SamplingParams(bad_words_token_ids=[[t] for t in range(V)]),
      "bad_words_token_ids",
    ),
    (
      "x",
      [1],
      je.SamplingParams(allowed_token_ids=[2, 5], bad_words_token_ids=[[5]], min_tokens=1),
      "min_tokens",
    ),
  ],
)
def test_add_request_rejects_and_changes_nothing(batch, req_id, prompt, params, field):
  before = (batch.req_ids, dict(batch.req_id_to_index), batch.sampling_metadata)
  with pytest.raises(ValueError, match=field):
    batch.add_request(req_id, prompt, params)
  assert (batch.req_ids, batch.req_id_to_index) == before[:2]
  assert batch.sampling_metadata is before[2]


def test_validate_request_refuses_an_empty_prompt(batch):
  with pytest.raises(ValueError, match="prompt_token_ids"):
    batch.validate_request([], je.SamplingParams(), output_token_ids=[1, 2])


@pytest.mark.parametrize(
  "i1, i2, name",
  [
    ("0", 0, "i1"),
    (0, "1", "i2"),
    (True, 0, "i1"),
    (0, np.bool_(False), "i2"),
    (0.0, 0, "i1"),
    (None, 0, "i1"),
    (0, -1, "i2"),
    (1, 0, "i1"),
    (0, [0], "i2"),
  ],
)
def test_swap_states_refuses_bad_rows_with_a_value_error(batch, i1, i2, name):
  before = (batch.req_ids, dict(batch.req_id_to_index), batch.sampling_metadata)
  bad = i1 if name == "i1" else i2
  with pytest.raises(ValueError, match=rf"swap_states {name} .*got {re.escape(repr(bad))}"):
    batch.swap_states(i1, i2)
  assert (batch.req_ids, batch.req_id_to_index) == before[:2]
  assert batch.sampling_metadata is before[2]


def test_swap_states_accepts_numpy_ints(batch):
  batch.add_request("b", [3], je.SamplingParams())
  batch.swap_states(np.int64(0), np.int32(1))
  assert batch.req_ids == ["b", "a"]


def test_satisfiable_allowlists_are_accepted(batch):
  # A multi-token bad word bans its last token only after its prefix: the allowlist stays usable.
  batch.add_request(
    "b", [1], je.SamplingParams(allowed_token_ids=[5], bad_words_token_ids=[[4, 5]])
  )
  batch.add_request("c", [1], je.SamplingParams(allowed_token_ids=[2, 5], min_tokens=1))
  assert batch.sample(np.zeros((R, V), np.float32)).sampled_token_ids.tolist()[1:] == [5, 5]


@pytest.mark.parametrize(
  "kwargs, field",
  [
    (dict(logit_bias={5: float("-inf")}), "logit_bias"),
    (dict(logit_bias={5: float("nan")}), "logit_bias"),
    # Infinities are refused as NaN is: temperature=inf would sample uniform noise.
    (dict(temperature=float("inf")), "temperature must be a finite number, got inf"),
    (dict(temperature=np.float32("inf")), "temperature must be a finite number"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty must be a finite number"),
    (dict(top_p=float("inf")), "top_p must be a finite number"),
    (dict(min_p=float("-inf")), "min_p must be a finite number"),
    (dict(presence_penalty=float("inf")), "presence_penalty must be a finite number"),
    (dict(frequency_penalty=float("-inf")), "frequency_penalty must be a finite number"),
    (dict(logit_bias={5: float("inf")}), r"logit_bias\[5\] must be finite"),
    (dict(stop_token_ids=5), "stop_token_ids"),
    (dict(allowed_token_ids=[1.5]), "allowed_token_ids"),
    (dict(bad_words_token_ids=5), "bad_words_token_ids"),
    # Seeds outside the 64-bit range would share a random stream with one inside it.
    (dict(seed=2**64 + 1), r"seed must be in \[-2\*\*63, 2\*\*63\)"),
    (dict(seed=2**63), "seed"),
    (dict(seed=-(2**63) - 1), "seed"),
    # Bools are refused wherever a count or a token id is expected (vLLM's logprobs=True -> 1
    # stays; False is ambiguous between None and 0).
    (dict(logprobs=False), "logprobs"),
    (dict(prompt_logprobs=False), "prompt_logprobs"),
    (dict(logit_bias={True: 1.0}), "logit_bias"),
    (dict(logit_bias={5.5: 1.0}), "logit_bias"),
    (dict(stop_token_ids=[True]), "stop_token_ids"),
    (dict(allowed_token_ids=[np.bool_(True)]), "allowed_token_ids"),
    (dict(n=True), "n"),
    # A finished grammar ends the request, so min_tokens could never hold.
    (
      dict(min_tokens=2, structured_outputs=je.StructuredOutputsParams(choice=["a"])),
      "min_tokens=2 cannot be combined with structured_outputs",
    ),
  ],
)
def test_sampling_params_rejects_malformed_values(kwargs, field):
  with pytest.raises(ValueError, match=field):
    je.SamplingParams(**kwargs)


def test_seed_range_ends_and_string_logit_bias_keys_are_accepted():
  assert je.SamplingParams(seed=2**63 - 1).seed == 2**63 - 1
  assert je.SamplingParams(seed=-(2**63)).seed == -(2**63)
  assert je.SamplingParams(logit_bias={"5": 1.0, np.int64(6): 2.0}).logit_bias == {5: 1.0, 6: 2.0}
  assert je.SamplingParams(logprobs=True).logprobs == 1


@pytest.mark.parametrize("seed", ["x", 1.0, True, 2**63])
def test_engine_seed_must_be_a_64_bit_int(seed):
  with pytest.raises(ValueError, match=r"seed must be an int in \[-2\*\*63, 2\*\*63\)"):
    je.InputBatch(2, 8, 10, seed=seed)
  with pytest.raises(ValueError, match="seed must be an int"):
    je.LLM(tiny_llama(vocab_size=16)[0], seed=seed)


def test_engine_seeds_past_32_bits_give_distinct_keys():
  a, b = (make_batch(**RAW, seed=s) for s in (5, 5 + 2**32))
  for batch in (a, b):
    batch.add_request("r", [1], je.SamplingParams())
  logits = np.zeros((R, V), np.float32)
  draws = [[x.sample(logits).sampled_token_ids[0] for _ in range(8)] for x in (a, b)]
  assert draws[0] != draws[1]


def test_integer_logits_are_rejected(batch):
  with pytest.raises(ValueError, match="float"):
    batch.sample(np.zeros((R, V), np.int32))
  assert batch.req_output_token_ids == [[]]


@pytest.fixture(scope="module")
def tiny_llm():
  model, _ = tiny_llama(vocab_size=64)
  return je.LLM(model, max_num_reqs=2, max_model_len=32)


def test_generate_accepts_vllm_prompt_dicts(tiny_llm):
  greedy = je.SamplingParams(temperature=0, max_tokens=3)
  (from_dict,) = tiny_llm.generate(
    {"prompt_token_ids": [5, 6, 7], "prompt": "five six seven"}, greedy, use_tqdm=False
  )
  (from_ids,) = tiny_llm.generate([5, 6, 7], greedy, use_tqdm=False)
  assert from_dict.prompt == "five six seven" and from_dict.prompt_token_ids == [5, 6, 7]
  assert from_dict.outputs[0].token_ids == from_ids.outputs[0].token_ids


@pytest.mark.parametrize(
  "call, message",
  [
    (lambda llm: llm.generate([5, 6], {"temperature": 0}), "sampling_params"),
    (lambda llm: llm.generate(5), "prompts"),
    (lambda llm: llm.generate(None), "prompts"),
    (lambda llm: llm.generate({"foo": [1]}), "prompt dict"),
    (lambda llm: llm.generate([[5, 6], [1] * 40]), r"request 1 \(of 2\): .*max_model_len"),
    (lambda llm: llm.generate("text without a tokenizer"), "tokenizer"),
  ],
)
def test_generate_rejects_bad_arguments_before_running(tiny_llm, call, message):
  with pytest.raises(ValueError, match=message):
    call(tiny_llm)
  assert not tiny_llm.llm_engine.has_unfinished_requests()


def test_a_request_is_encoded_once_where_it_comes_in(tiny_llm, monkeypatch):
  """The input processor's encoding rides on each completion to admission
  (`Completion.encoded`): an unseeded request's samples share it, a seeded request's later
  samples get their own (seed + j), and the batch encodes nothing again when it admits them."""
  import jaxengine.batch.composition as composition

  encode, seeds = composition.encode_request, []

  def counted(config, eos_token_ids, prompt_token_ids, params, *rest):
    seeds.append(params.seed)
    return encode(config, eos_token_ids, prompt_token_ids, params, *rest)

  monkeypatch.setattr(composition, "encode_request", counted)
  seeded = je.SamplingParams(n=2, seed=3, max_tokens=2)
  params = [je.SamplingParams(n=2, max_tokens=2), seeded]
  outputs = tiny_llm.generate([[5, 6, 7], [8, 9]], params, use_tqdm=False)
  assert seeds == [None, 3, seeded.for_sample(1).seed]  # the door only: none at admission
  assert [len(c.token_ids) for o in outputs for c in o.outputs] == [2, 2, 2, 2]


def test_generate_of_no_prompts_returns_no_outputs_as_vllms(tiny_llm):
  """An empty list of prompts runs nothing and returns [] (vLLM's `LLM.generate` does too);
  `LLM.chat([])` is refused instead (`test_chat_rejects_malformed_messages_naming_where`)."""
  assert tiny_llm.generate([], use_tqdm=False) == []
  assert not tiny_llm.llm_engine.has_unfinished_requests()


def test_llm_rejects_unsupported_dtype():
  model, _ = tiny_llama(vocab_size=64)
  with pytest.raises(ValueError, match="dtype"):
    je.LLM(model, dtype="int8")


def test_condense_with_many_moves_keeps_every_request_with_its_row():
  """More moves than `move_rows` handles per chunk: every field follows its request."""
  batch = je.InputBatch(32, 16, 64)
  for i in range(32):  # request i may only sample token i, and was seeded i
    batch.add_request(f"r{i}", [1], je.SamplingParams(allowed_token_ids=[i], seed=i))
  for i in list(range(0, 32, 2)) + list(range(1, 12, 2)):
    batch.remove_request(f"r{i}")
  moves = batch.condense()
  assert len(moves) > 8 and batch.num_reqs == 10
  tokens = batch.sample(np.zeros((32, 64), np.float32)).sampled_token_ids
  assert [f"r{t}" for t in tokens.tolist()] == batch.req_ids
  batch.swap_states(0, 9)
  tokens = batch.sample(np.zeros((32, 64), np.float32)).sampled_token_ids
  assert [f"r{t}" for t in tokens.tolist()] == batch.req_ids


@pytest.fixture(scope="module")
def chat_llm():
  from byte_tokenizer import chatml_byte_tokenizer

  tokenizer = chatml_byte_tokenizer()
  model, _ = tiny_llama(vocab_size=tokenizer.vocab_size)
  return je.LLM(model, tokenizer=tokenizer, max_num_reqs=2, max_model_len=96)


@pytest.mark.parametrize(
  "messages, message",
  [
    ("Hi", "messages must be a list of {'role': ..., 'content': ...} dicts"),
    ({"role": "user", "content": "Hi"}, "messages must be a list"),
    ([{"role": "user"}], "message 0: needs 'content'"),
    ([{"content": "Hi"}], "message 0: needs a 'role' string"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], "content part 0 must be .* text"),
    ([{"role": "user", "content": None}], "message 0: content must be a string"),
    ([[{"role": "user", "content": "a"}], [{"role": "user", "content": 3}]], "conversation 1"),
    ([[]], "messages: conversation 0: the conversation is empty"),
    ([[{"role": "user", "content": "a"}], []], "messages: conversation 1: .* is empty"),
    ([], "messages must not be empty"),
  ],
)
def test_chat_rejects_malformed_messages_naming_where(chat_llm, messages, message):
  with pytest.raises(ValueError, match=message):
    chat_llm.chat(messages, use_tqdm=False)
  assert not chat_llm.llm_engine.has_unfinished_requests()


def test_chat_takes_text_parts_and_template_options(chat_llm):
  sp = je.SamplingParams(temperature=0, max_tokens=1)
  chat = lambda messages, **kw: chat_llm.chat(messages, sp, use_tqdm=False, **kw)[0].prompt
  parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]
  assert chat([{"role": "user", "content": parts}]) == chat(
    [{"role": "user", "content": "Hi\nthere"}]
  )
  template = "{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}{{ tail }}"
  user = {"role": "user", "content": "Hi"}
  assert chat([user], chat_template=template, chat_template_kwargs={"tail": "!"}) == "[user:Hi]!"
  opened = [user, {"role": "assistant", "content": "Hel"}]
  kept_open = chat(opened, add_generation_prompt=False, continue_final_message=True)
  assert kept_open.endswith("<|im_start|>assistant\nHel")
  with pytest.raises(ValueError, match="cannot both be True"):
    chat(opened, continue_final_message=True)
  with pytest.raises(ValueError, match="chat_template_kwargs may not set"):
    chat([user], chat_template_kwargs={"tokenize": True})
  with pytest.raises(ValueError, match="conversation 0: the chat template failed"):
    chat([user], chat_template="{{ raise_exception('roles must alternate') }}")
  tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
  listed = "{% for t in tools %}{{ t.function.name }};{% endfor %}" + template
  assert chat([user], chat_template=listed, tools=tools) == "get_weather;[user:Hi]"


def test_clone_is_a_deep_copy_as_vllms():
  so = je.StructuredOutputsParams(json={"type": "object", "required": ["a"]})
  params = je.SamplingParams(
    n=2, temperature=0.7, seed=5, stop=["x"], extra_args={"k": {"deep": [1]}}, structured_outputs=so
  )
  clone = params.clone()
  assert clone == params and clone is not params
  assert clone.extra_args is not params.extra_args
  assert clone.structured_outputs is not params.structured_outputs
  clone.extra_args["k"]["deep"].append(2)
  clone.structured_outputs.json["required"].append("b")
  assert params.extra_args == {"k": {"deep": [1]}}
  assert params.structured_outputs.json == {"type": "object", "required": ["a"]}
  assert clone.for_sample(1).seed == params.for_sample(1).seed == 6
  assert je.SamplingParams().clone() == je.SamplingParams()
