"""The OpenAI-compatible server's outputs, through the official `openai` client: completions and
chat equal `LLM.generate` / `LLM.chat`, echo, logprobs and prompt logprobs, token ids, streaming
(one token a chunk, 64 clients at once), vLLM's extra fields, tool calls and reasoning. The
server: tests/helpers/serve_server.py (a module fixture of tests/entrypoints/conftest.py); its
control routes and failures: test_serve_control.py.
"""

from __future__ import annotations

import asyncio
import json
import re

import openai
import pytest
from byte_tokenizer import chatml_byte_tokenizer
from serve_server import (
  GREEDY,
  MESSAGES,
  MODEL,
  NUM_CLIENTS,
  PROMPTS,
  SEEDED,
  STREAM_PARAMS,
  TOKEN_IDS,
  chat_through,
  client_prompt,
  response_message,
  streamed_message,
)

import jaxengine as je
from jaxengine.entrypoints.async_llm import AsyncLLM, RequestOutputKind
from jaxengine.entrypoints.openai_server import build_app
from jaxengine.entrypoints.protocol import ChatCompletionRequest, CompletionRequest


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
@pytest.mark.parametrize("stream", [False, True])
def test_completions_equal_llm_generate(server, client, kind, stream):
  kwargs = GREEDY if kind == "greedy" else SEEDED
  extra = {"seed": kwargs.get("seed")} if "seed" in kwargs else {}
  rest = {k: v for k, v in kwargs.items() if k != "seed"}
  for prompt, ref in zip(PROMPTS, server["refs"][kind]):
    if not stream:
      response = client.completions.create(model=MODEL, prompt=prompt, **rest, **extra)
      choice = response.choices[0]
      assert (choice.text, choice.finish_reason) == (ref.text, ref.finish_reason)
      assert response.usage.completion_tokens == len(ref.token_ids)
      continue
    chunks = list(
      client.completions.create(
        model=MODEL, prompt=prompt, stream=True, stream_options={"include_usage": True},
        **rest, **extra,
      )
    )  # fmt: skip
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.finish_reason
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)


def test_a_batch_of_prompts_and_n_samples(server, client):
  """A list of prompts streams as choices `prompt index * n + sample index`, each as alone."""
  texts = {0: "", 1: ""}
  for chunk in client.completions.create(model=MODEL, prompt=PROMPTS, stream=True, **GREEDY):
    for choice in chunk.choices:
      texts[choice.index] += choice.text
  assert [texts[0], texts[1]] == [ref.text for ref in server["refs"]["greedy"]]
  response = client.completions.create(
    model=MODEL, prompt=PROMPTS, n=2, seed=3, temperature=1.0, max_tokens=4
  )
  assert sorted(c.index for c in response.choices) == [0, 1, 2, 3]
  assert 4 <= response.usage.completion_tokens <= 16  # 4 samples of 1 to 4 tokens


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_chat_equals_llm_chat(server, client, kind):
  ref = server["refs"]["chat-" + kind]
  kwargs = GREEDY if kind == "greedy" else SEEDED
  response = client.chat.completions.create(model=MODEL, messages=MESSAGES, **kwargs)
  assert response.choices[0].message.content == ref.text
  assert response.choices[0].finish_reason == ref.finish_reason
  stream = client.chat.completions.create(
    model=MODEL, messages=MESSAGES, stream=True, stream_options={"include_usage": True}, **kwargs
  )
  chunks = list(stream)
  assert chunks[0].choices[0].delta.role == "assistant"
  assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
  assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)


def test_chat_logprobs_and_structured_outputs(client):
  response = client.chat.completions.create(
    model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3,
    extra_body={"ignore_eos": True},
  )  # fmt: skip
  content = response.choices[0].logprobs.content
  assert len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content)
  assert all(t.logprob == t.top_logprobs[0].logprob for t in content)  # greedy: the top token
  choice = client.chat.completions.create(
    model=MODEL,
    messages=MESSAGES,
    max_tokens=10,
    extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
  )
  assert choice.choices[0].message.content in ("yes", "no")
  schema = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"],
            "additionalProperties": False}  # fmt: skip
  structured = client.chat.completions.create(
    model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0,
    response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
  )  # fmt: skip
  assert json.loads(structured.choices[0].message.content)["a"] in ("x", "y")


def _prompt_reference(engine: AsyncLLM, prompt, k: int) -> je.RequestOutput:
  """`prompt`'s final output from the engine itself, with `prompt_logprobs=k`."""
  params = je.SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=k)

  async def main():
    return [
      o async for o in engine.generate(prompt, params, output_kind=RequestOutputKind.FINAL_ONLY)
    ]

  return asyncio.run(main())[-1]


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_covers_the_prompt_then_the_completion(server, client, stream):
  """vLLM's echo: the prompt's tokens first (the first without a logprob), then the completion's,
  their text offsets into the echoed text."""
  prompt = PROMPTS[0]
  ref = _prompt_reference(server["engine"], prompt, 2)
  num_prompt = len(ref.prompt_token_ids)
  kwargs = {"model": MODEL, "prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": 3,
            "temperature": 0, "extra_body": {"ignore_eos": True}}  # fmt: skip
  if stream:
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kwargs) if c.choices]
  else:
    chunks = client.completions.create(**kwargs).choices
  text = "".join(c.text for c in chunks)
  tokens = [t for c in chunks for t in c.logprobs.tokens]
  values = [v for c in chunks for v in c.logprobs.token_logprobs]
  tops = [top for c in chunks for top in c.logprobs.top_logprobs]
  offsets = [o for c in chunks for o in c.logprobs.text_offset]
  assert text.startswith(prompt) and len(text) > len(prompt)
  assert len(tokens) == len(values) == len(tops) == len(offsets) == num_prompt + 3
  assert "".join(tokens) == text  # one byte per token: the tokens spell the echoed text
  assert values[0] is None and tops[0] is None  # nothing predicts the first prompt token
  expected = [e[t].logprob for t, e in zip(ref.prompt_token_ids[1:], ref.prompt_logprobs[1:])]
  assert values[1:num_prompt] == pytest.approx(expected, abs=1e-5)
  assert all(2 <= len(top) <= 3 for top in tops[1:])  # the top 2 and the token itself
  assert offsets[:num_prompt] == [sum(map(len, tokens[:i])) for i in range(num_prompt)]
  assert offsets[num_prompt] == len(prompt)


@pytest.mark.parametrize("stream", [False, True])
def test_echo_text_offsets_of_characters_split_over_tokens(client, stream):
  """One token per byte: the tokens of a multi-byte character all start where it starts, the
  completion's tokens after the prompt's; offsets never decrease nor pass the text."""
  prompt = "é東🎉 is"  # 2-, 3- and 4-byte characters
  kwargs = {"model": MODEL, "prompt": prompt, "echo": True, "logprobs": 0, "max_tokens": 4,
            "temperature": 0, "extra_body": {"ignore_eos": True}}  # fmt: skip
  if stream:
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kwargs) if c.choices]
  else:
    chunks = client.completions.create(**kwargs).choices
  text = "".join(c.text for c in chunks)
  offsets = [o for c in chunks for o in c.logprobs.text_offset]
  data = prompt.encode()
  assert offsets[: len(data)] == [len(data[:i].decode(errors="ignore")) for i in range(len(data))]
  assert offsets[len(data)] == len(prompt) and len(offsets) == len(data) + 4
  assert offsets == sorted(offsets) and offsets[-1] <= len(text)


def test_text_offsets_of_a_text_prompt_the_tokenizer_added_a_bos_to():
  """The echoed text has no BOS: the BOS and the first character start at 0; a prompt that
  spells its special tokens counts them."""
  from jaxengine.entrypoints.text_offsets import TextOffsets

  tokenizer = chatml_byte_tokenizer()
  bos = tokenizer.encode("<|endoftext|>")
  ids = [*bos, *tokenizer.encode("hi")]
  assert TextOffsets(tokenizer, [], True).prompt_offsets(ids, "hi") == [0, 0, 1]
  spelled = tokenizer.decode(ids, skip_special_tokens=False)
  assert TextOffsets(tokenizer, [], True).prompt_offsets(ids, spelled) == [0, 13, 14]


def test_echo_of_a_token_id_prompt_is_its_text(server, client):
  ids = server["engine"].tokenizer.encode("hello")
  response = client.completions.create(model=MODEL, prompt=ids, echo=True, max_tokens=1, logprobs=0)
  choice = response.choices[0]
  assert choice.text.startswith("hello") and choice.logprobs.tokens[:5] == list("hello")


def test_return_token_ids_and_token_id_prompts(server, client):
  """vLLM's `return_token_ids`: each choice's `token_ids` are the engine's own greedy tokens and
  its `prompt_token_ids` the tokenizer's (on the choice for completions, at the top for chat),
  streamed as each chunk's ids with the prompt's once; a token-id prompt (alone or in a batch)
  completes as its text does; absent without the field; an id outside the vocabulary is a 400
  naming `prompt` and the id, before any engine request starts, and serving goes on."""
  engine, refs = server["engine"], server["refs"]
  prompt_ids = [engine.tokenizer.encode(p) for p in PROMPTS]
  for prompt in (PROMPTS, prompt_ids):  # text, then a batch of token-id prompts
    response = client.completions.create(model=MODEL, prompt=prompt, **GREEDY, **TOKEN_IDS)
    for choice, ids, ref in zip(response.choices, prompt_ids, refs["greedy"], strict=True):
      assert choice.text == ref.text
      assert (choice.token_ids, choice.prompt_token_ids) == (ref.token_ids, ids)
  single = client.completions.create(model=MODEL, prompt=prompt_ids[1], **GREEDY, **TOKEN_IDS)
  assert (single.choices[0].text, single.choices[0].token_ids) == (
    refs["greedy"][1].text, refs["greedy"][1].token_ids
  )  # fmt: skip
  chunks = [
    c.choices[0]
    for c in client.completions.create(
      model=MODEL, prompt=PROMPTS[0], stream=True, **GREEDY, **TOKEN_IDS
    )
  ]
  assert [len(c.token_ids) for c in chunks] == [1] * len(chunks)  # one token per step
  assert [t for c in chunks for t in c.token_ids] == refs["greedy"][0].token_ids
  assert chunks[0].prompt_token_ids == prompt_ids[0]
  assert all("prompt_token_ids" not in c.model_extra for c in chunks[1:])
  plain = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=1)
  assert not {"token_ids", "prompt_token_ids"} & set(plain.choices[0].model_extra)
  # chat: the prompt's ids (the chat template's) at the top, on each role chunk when streamed
  chat_ids = engine.tokenizer.apply_chat_template(
    MESSAGES, add_generation_prompt=True, tokenize=True
  )
  ref = refs["chat-greedy"]
  response = client.chat.completions.create(model=MODEL, messages=MESSAGES, **GREEDY, **TOKEN_IDS)
  assert response.prompt_token_ids == chat_ids and response.choices[0].token_ids == ref.token_ids
  chunks = list(
    client.chat.completions.create(
      model=MODEL, messages=MESSAGES, stream=True, **GREEDY, **TOKEN_IDS
    )
  )
  assert chunks[0].prompt_token_ids == chat_ids
  assert all("prompt_token_ids" not in c.model_extra for c in chunks[1:])
  assert [t for c in chunks[1:] for t in c.choices[0].token_ids] == ref.token_ids
  plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
  assert "prompt_token_ids" not in plain.model_extra
  # ids outside the vocabulary: refused before any engine request starts
  aborted = engine.num_aborted
  vocab_size = engine.vocab_size
  for prompt, where in (
    ([1, vocab_size], f"prompt[1] = {vocab_size} "),
    ([[1, 2], [3, -1]], "prompt[1][1] = -1 "),
  ):
    with pytest.raises(openai.BadRequestError, match=re.escape(where)) as error:
      client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert error.value.body["param"] == "prompt"
  assert engine.num_aborted == aborted
  again = client.completions.create(model=MODEL, prompt=prompt_ids[0], **GREEDY)
  assert again.choices[0].text == refs["greedy"][0].text


def test_prompt_logprobs_are_returned(server, client):
  """`prompt_logprobs`: per choice (completions) or for the response (chat), one entry per prompt
  token, the first null, the others `{token id: {logprob, rank, decoded_token}}`."""
  response = client.completions.create(
    model=MODEL, prompt=PROMPTS, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 2}
  )
  choices = sorted(response.choices, key=lambda c: c.index)
  for choice, prompt in zip(choices, PROMPTS, strict=True):
    ref = _prompt_reference(server["engine"], prompt, 2)
    got = choice.model_extra["prompt_logprobs"]
    assert len(got) == len(ref.prompt_token_ids) and got[0] is None
    for token, entry, ref_entry in zip(ref.prompt_token_ids[1:], got[1:], ref.prompt_logprobs[1:]):
      assert str(token) in entry and set(entry) == {str(t) for t in ref_entry}
      for t, logprob in ref_entry.items():
        assert entry[str(t)]["logprob"] == pytest.approx(logprob.logprob, abs=1e-5)
        assert (entry[str(t)]["rank"], entry[str(t)]["decoded_token"]) == (
          logprob.rank, logprob.decoded_token
        )  # fmt: skip
  plain = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=1)
  assert plain.choices[0].model_extra["prompt_logprobs"] is None
  chat = client.chat.completions.create(
    model=MODEL, messages=MESSAGES, max_tokens=2, extra_body={"prompt_logprobs": 0}
  )
  got = chat.model_extra["prompt_logprobs"]
  assert len(got) == chat.usage.prompt_tokens and got[0] is None
  assert all(len(entry) == 1 and entry[next(iter(entry))]["rank"] >= 1 for entry in got[1:])


def test_concurrent_streaming_clients(server):
  """64 clients stream at once (4 rows): every one gets all its tokens, in order, one chunk per
  token (the last two tokens used to come in one chunk)."""

  async def one(client, i: int) -> tuple[str, int]:
    stream = await client.completions.create(
      model=MODEL, prompt=client_prompt(i), stream=True, seed=i,
      stream_options={"include_usage": True}, temperature=1.0, max_tokens=8,
      extra_body={"ignore_eos": True},
    )  # fmt: skip
    parts, usage = [], None
    async for chunk in stream:
      parts += [c.text for c in chunk.choices]
      usage = chunk.usage or usage
    assert len(parts) == usage.completion_tokens, parts
    return "".join(parts), usage.completion_tokens

  async def main():
    async with openai.AsyncOpenAI(
      base_url=server["url"] + "/v1", api_key="unused", max_retries=0
    ) as client:  # fmt: skip
      return await asyncio.gather(*(one(client, i) for i in range(NUM_CLIENTS)))

  results = asyncio.run(main())
  assert [text for text, _ in results] == server["refs"]["streams"]
  assert all(n == STREAM_PARAMS["max_tokens"] for _, n in results)


def test_each_token_streams_as_its_own_chunk(server, client):
  """AsyncLLM's DELTA outputs and the chat SSE stream carry one token each, the last too, and
  their text adds up to the final text (a token that ends inside a character streams with empty
  text: one token per byte here, random bytes from a random model)."""
  engine = server["engine"]
  num_streams, max_tokens = 3, STREAM_PARAMS["max_tokens"]

  async def deltas(i: int) -> list[je.RequestOutput]:
    params = je.SamplingParams(seed=i, **STREAM_PARAMS)
    stream = engine.generate(client_prompt(i), params, output_kind=RequestOutputKind.DELTA)
    return [o async for o in stream]

  async def main():
    return await asyncio.gather(*(deltas(i) for i in range(num_streams)))

  for i, outputs in enumerate(asyncio.run(main())):
    assert [len(o.outputs[0].token_ids) for o in outputs] == [1] * max_tokens
    assert "".join(o.outputs[0].text for o in outputs) == server["refs"]["streams"][i]
  kwargs = {"model": MODEL, "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0,
            "logprobs": True, "extra_body": {"ignore_eos": True}}  # fmt: skip
  content = client.chat.completions.create(**kwargs).choices[0].message.content
  chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **kwargs)]
  assert chunks[0].delta.role == "assistant" and not chunks[0].delta.content
  assert [len(c.logprobs.content) for c in chunks[1:]] == [1] * max_tokens
  assert "".join(c.delta.content for c in chunks[1:]) == content


def test_vllm_fields_are_applied_and_unknown_ones_warned_about(server, client, caplog):
  """guided_* are structured outputs; truncate_prompt_tokens keeps the prompt's last tokens;
  chat echo starts the reply with the last message; tools with tool_choice "none", an empty
  suffix and use_beam_search false change nothing; unknown fields get one warning."""
  guided = client.completions.create(
    model=MODEL, prompt="hi", max_tokens=8, extra_body={"guided_choice": ["yes", "no"]}
  )
  assert guided.choices[0].text in ("yes", "no")
  truncated = client.completions.create(
    model=MODEL, prompt=PROMPTS[0], max_tokens=1, echo=True,
    extra_body={"truncate_prompt_tokens": 3},
  )  # fmt: skip
  assert truncated.usage.prompt_tokens == 3 and truncated.choices[0].text.startswith("fox")
  start = [*MESSAGES, {"role": "assistant", "content": "Hi th"}]
  for stream in (False, True):
    reply = client.chat.completions.create(
      model=MODEL, messages=start, max_tokens=2, stream=stream,
      extra_body={"echo": True, "add_generation_prompt": False, "continue_final_message": True,
                  "ignore_eos": True},
      **({"stream_options": {"include_usage": True}} if stream else {}),
    )  # fmt: skip
    if stream:
      chunks = list(reply)
      content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
      usage = chunks[-1].usage
    else:
      content, usage = reply.choices[0].message.content, reply.usage
    # the echo, then 2 generated tokens (a random byte-level model's may end inside a character
    # and add no text)
    assert content.startswith("Hi th") and usage.completion_tokens == 2, stream
  plain = {"model": MODEL, "max_tokens": 4, "temperature": 0}
  ref = client.chat.completions.create(messages=MESSAGES, **plain).choices[0].message.content
  tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
  same = client.chat.completions.create(messages=MESSAGES, tools=tools, tool_choice="none", **plain)
  assert same.choices[0].message.content == ref
  with caplog.at_level("WARNING", logger="jaxengine.entrypoints.openai_server"):
    response = client.completions.create(
      prompt="hi", suffix="",
      extra_body={"use_beam_search": False, "frobnicate": 1, "zap": 2, "max_staleness": 1},
      **plain,
    )  # fmt: skip
  assert response.choices[0].finish_reason is not None
  warnings = [r.getMessage() for r in caplog.records if "unknown fields" in r.getMessage()]
  assert warnings == ["/v1/completions: ignoring unknown fields ['frobnicate', 'zap']"]


def test_max_staleness_is_a_sampling_field_of_both_endpoints():
  """`max_staleness` in a body reaches `SamplingParams` (null: no bound), as the Python API's."""
  for body in (CompletionRequest(prompt="hi"), ChatCompletionRequest(messages=MESSAGES)):
    assert body.sampling_params().max_staleness is None
    given = body.model_copy(update={"max_staleness": 2})
    assert given.sampling_params().max_staleness == 2 and given.unknown_fields() == []
  body = ChatCompletionRequest.model_validate({"messages": MESSAGES, "max_staleness": 0})
  assert body.sampling_params().max_staleness == 0 and body.unknown_fields() == []


#: A tool whose one parameter takes two values (short constrained outputs for the tiny model).
TOOL = {"type": "function", "function": {"name": "w", "parameters": {
  "type": "object", "properties": {"c": {"enum": ["P", "L"]}}, "required": ["c"],
  "additionalProperties": False}}}  # fmt: skip
#: The model constrained to reason, say "ok" and call TOOL in the hermes format.
THINK_AND_CALL = (
  r'<think>[a-z]{1,4}</think>ok<tool_call>\{"name":"w","arguments":\{"c":"(P|L)"\}\}</tool_call>'
)


def test_a_tool_call_and_reasoning_parsed_from_text_the_model_was_constrained_to_write(server):
  """A second app on the module's engine, with vLLM's --enable-auto-tool-choice
  --tool-call-parser hermes --reasoning-parser qwen3: the model is constrained (a regex) to
  write a reasoning block, content and a hermes call; the openai client reads them as
  reasoning_content, content and tool_calls, streamed and not."""
  app = build_app(server["engine"], MODEL, enable_auto_tool_choice=True,
                  tool_call_parser="hermes", reasoning_parser="qwen3")  # fmt: skip
  request = {"messages": MESSAGES, "tools": [TOOL], "max_tokens": 90, "temperature": 0,
             "extra_body": {"structured_outputs": {"regex": THINK_AND_CALL}}}  # fmt: skip
  plain = {"messages": MESSAGES, "max_tokens": 6, "temperature": 0}
  (response, chunks), (plain_response, plain_chunks) = chat_through(app, [request, plain])
  content, reasoning, calls, finish = response_message(response)
  assert re.fullmatch("[a-z]{1,4}", reasoning) and content == "ok"
  assert [name for name, _ in calls] == ["w"] and json.loads(calls[0][1])["c"] in ("P", "L")
  assert response.choices[0].message.tool_calls[0].id.startswith("chatcmpl-tool-")
  assert finish == ["tool_calls"]
  assert streamed_message(chunks) == (content, reasoning, calls, finish)
  fragments = [c for c in chunks if c.choices and c.choices[0].delta.tool_calls]
  assert fragments[0].choices[0].delta.tool_calls[0].function.arguments == ""
  assert len(fragments) > 5  # the arguments came in pieces after the name
  # without a think block: all content, no reasoning (qwen3)
  assert response_message(plain_response)[1] is None
  assert streamed_message(plain_chunks)[:2] == response_message(plain_response)[:2]


def test_tool_choice_required_and_named_force_valid_calls(server):
  """No tool parser needed: the output is constrained to the call(s)' JSON schema."""
  app = build_app(server["engine"], MODEL)
  named = {"type": "function", "function": {"name": "w"}}
  base = {"messages": MESSAGES, "tools": [TOOL], "max_tokens": 90, "temperature": 0}
  (required, required_chunks), (forced, forced_chunks) = chat_through(
    app, [{**base, "tool_choice": "required"}, {**base, "tool_choice": named}]
  )
  content, _, calls, finish = response_message(required)
  assert content is None and finish == ["tool_calls"] and calls
  assert all(name == "w" and json.loads(args)["c"] in ("P", "L") for name, args in calls)
  assert streamed_message(required_chunks)[2:] == (calls, finish)
  content, _, calls, finish = response_message(forced)
  assert content is None and [name for name, _ in calls] == ["w"]
  assert json.loads(calls[0][1])["c"] in ("P", "L") and finish == ["stop"]  # OpenAI's
  assert streamed_message(forced_chunks)[2:] == (calls, finish)


def test_tools_and_tool_messages_reach_the_chat_template(server, client):
  """The prompt (one token per byte) holds what the request's template writes of the tools
  and of an assistant's call and its tool result; "none" leaves the tools out."""
  template = (
    "{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}"
    "{% for m in messages %}{{ m.role }}:{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<{{ c.function.name }} {{ c.function.arguments.c }}>"
    "{% endfor %}|{% endfor %}"
  )
  messages = [
    *MESSAGES,
    {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function",
     "function": {"name": "w", "arguments": '{"c": "P"}'}}]},
    {"role": "tool", "tool_call_id": "1", "content": "sunny"},
  ]  # fmt: skip
  expected = "[w]user:Say hi.|assistant:<w P>|tool:sunny|"
  for choice, prompt in (({"type": "function", "function": {"name": "w"}}, expected),
                         ("none", expected.removeprefix("[w]"))):  # fmt: skip
    response = client.chat.completions.create(
      model=MODEL, messages=messages, tools=[TOOL], tool_choice=choice, max_tokens=12,
      temperature=0, extra_body={"chat_template": template},
    )  # fmt: skip
    assert response.usage.prompt_tokens == len(prompt)
