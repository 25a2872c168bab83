"""The OpenAI-compatible server and `AsyncLLM`, through the official `openai` client.

One uvicorn server per module on 127.0.0.1 (an ephemeral port, in a thread) serves a random tiny
Llama with a byte-level ChatML tokenizer; 4 rows and max_model_len 128, every step in one shape
(4 rows, 16 tokens: `one_shape`), so that few executables compile. The reference outputs come
from `LLM.generate` / `LLM.chat` on the same `LLM` before the server takes its engine over.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import httpx
import openai
import pytest
import uvicorn
from byte_tokenizer import chatml_byte_tokenizer
from prometheus_client.parser import text_string_to_metric_families
from step_shapes import one_shape

import jaxengine as je
from jaxengine.entrypoints.async_llm import AsyncLLM, EngineDeadError, RequestOutputKind
from jaxengine.entrypoints.openai_server import build_app
from jaxengine.entrypoints.protocol import ChatCompletionRequest, CompletionRequest
from jaxengine.testing import tiny_llama

MODEL = "tiny"
PROMPTS = ["The quick fox", "Once upon"]  # prompts of one length bucket: fewer compiles
MESSAGES = [{"role": "user", "content": "Say hi."}]
GREEDY = {"temperature": 0.0, "max_tokens": 12}
SEEDED = {"temperature": 0.9, "top_p": 0.95, "seed": 7, "max_tokens": 12}
NUM_CLIENTS = 64
STREAM_PARAMS = {"temperature": 1.0, "max_tokens": 8, "ignore_eos": True}


def _client_prompt(i: int) -> str:
  return f"client {i}"


@pytest.fixture(scope="module")
def server():
  """The running server: its base URL, `AsyncLLM` and the reference outputs."""
  tokenizer = chatml_byte_tokenizer()
  model, _ = tiny_llama(vocab_size=tokenizer.vocab_size)
  llm = je.LLM(
    model, tokenizer=tokenizer, max_num_reqs=4, max_model_len=128, max_num_batched_tokens=16
  )
  one_shape(llm)  # the server's behaviour, not bucket choice, is the point here
  refs = {}
  for name, kwargs in (("greedy", GREEDY), ("seeded", SEEDED)):
    params = je.SamplingParams(**kwargs)
    refs[name] = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    refs["chat-" + name] = llm.chat(MESSAGES, params, use_tqdm=False)[0].outputs[0]
  streams = llm.generate(
    [_client_prompt(i) for i in range(NUM_CLIENTS)],
    [je.SamplingParams(seed=i, **STREAM_PARAMS) for i in range(NUM_CLIENTS)],
    use_tqdm=False,
  )
  refs["streams"] = [o.outputs[0].text for o in streams]
  engine = AsyncLLM(llm)
  uv = uvicorn.Server(
    uvicorn.Config(build_app(engine, MODEL), host="127.0.0.1", port=0, log_level="warning")
  )
  thread = threading.Thread(target=uv.run, daemon=True)
  thread.start()
  deadline = time.monotonic() + 60
  while not uv.started:
    assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
    time.sleep(0.05)
  port = uv.servers[0].sockets[0].getsockname()[1]
  yield {"url": f"http://127.0.0.1:{port}", "engine": engine, "refs": refs}
  uv.should_exit = True
  thread.join(30)
  engine.shutdown()
  assert not engine.is_running
  with pytest.raises(EngineDeadError):
    asyncio.run(anext(engine.generate("hi")))


@pytest.fixture(scope="module")
def client(server):
  return openai.OpenAI(base_url=server["url"] + "/v1", api_key="unused", max_retries=0)


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


TOKEN_IDS = {"extra_body": {"return_token_ids": True}}


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
      model=MODEL, prompt=_client_prompt(i), stream=True, seed=i,
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
    stream = engine.generate(_client_prompt(i), params, output_kind=RequestOutputKind.DELTA)
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


def _wait_idle(engine: AsyncLLM, seconds: float = 30.0) -> None:
  deadline = time.monotonic() + seconds
  while engine.num_requests_running or engine.num_requests_waiting:
    assert time.monotonic() < deadline, "the aborted request still holds its row"
    time.sleep(0.02)


def test_disconnect_frees_the_row(server):
  engine = server["engine"]
  aborted = engine.num_aborted
  body = {"model": MODEL, "prompt": "abc", "max_tokens": 120, "ignore_eos": True, "stream": True}
  with httpx.Client(base_url=server["url"], timeout=30) as http:
    with http.stream("POST", "/v1/completions", json=body) as response:
      lines = response.iter_lines()
      assert next(line for line in lines if line.startswith("data:"))
      assert engine.num_requests_running == 1
    _wait_idle(engine)
    assert engine.num_aborted == aborted + 1
    # not streamed: a client that gives up (a read timeout) aborts its request too (120 steps
    # take far longer than the timeout)
    with pytest.raises(httpx.ReadTimeout):
      http.post("/v1/completions", json={**body, "stream": False}, timeout=0.02)
    deadline = time.monotonic() + 30  # the server may not have added it yet when the client left
    while engine.num_aborted < aborted + 2:
      assert time.monotonic() < deadline, "the abandoned request was not aborted"
      time.sleep(0.02)
    _wait_idle(engine)
    assert engine.num_aborted == aborted + 2
    metrics = http.get("/metrics").text
  assert 'jaxengine:request_success_total{finished_reason="abort",model_name="tiny"} 2.0' in metrics


def test_sleep_wake_up_and_reset_prefix_cache_routes(server, client):
  """POST /sleep?level=&mode=, /wake_up?tags=, /reset_prefix_cache, GET /is_sleeping: a sleep
  while a request runs is a 409 changing nothing, or with mode "abort" ends the request first
  and stays paused until the wake; a bad level, mode or tag is a 400 naming it; a request while
  asleep a 503; after a sleep and a wake (one tag at a time) greedy outputs equal those
  before."""
  engine, ref = server["engine"], server["refs"]["greedy"][0]

  async def sleep_while_running():
    async with httpx.AsyncClient(base_url=server["url"], timeout=60) as http:
      stream = engine.generate(PROMPTS[0], je.SamplingParams(max_tokens=100, ignore_eos=True))
      await anext(stream)
      busy = await http.post("/sleep")
      awake = (await http.get("/is_sleeping")).json()
      keep = await http.post("/sleep", params={"mode": "keep"})
      aborting = await http.post("/sleep", params={"mode": "abort"})
      return busy, awake, keep, aborting, await _last(stream)

  with httpx.Client(base_url=server["url"], timeout=60) as http:
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}
    assert http.post("/reset_prefix_cache").json() == {"success": True}
    busy, awake, keep, aborting, aborted = asyncio.run(sleep_while_running())
    message = busy.json()["error"]["message"]
    assert busy.status_code == 409 and "1 completion is waiting" in message, message
    assert "/sleep?mode=wait" in message and "/sleep?mode=abort" in message, message
    assert awake == {"is_sleeping": False}
    assert (keep.status_code, keep.json()["error"]["param"]) == (400, "mode")
    assert aborting.json() == {"is_sleeping": True}
    assert aborted.outputs[0].finish_reason == "abort"
    assert 0 < len(aborted.outputs[0].token_ids) < 100
    assert http.get("/is_paused").json() == {"is_paused": True}  # until the wake
    assert http.post("/wake_up").json() == {"is_sleeping": False}
    assert http.get("/is_paused").json() == {"is_paused": False}
    # a pause of the client's own outlives a sleep and a wake
    assert http.post("/pause").json() == {"is_paused": True}
    assert http.post("/sleep", params={"mode": "wait"}).json() == {"is_sleeping": True}
    assert http.post("/wake_up").json() == {"is_sleeping": False}
    assert http.get("/is_paused").json() == {"is_paused": True}
    assert http.post("/resume").json() == {"is_paused": False}
    for level, words in (("3", "got '3'"), ("deep", "got 'deep'")):
      response = http.post("/sleep", params={"level": level})
      assert (response.status_code, response.json()["error"]["param"]) == (400, "level")
      assert words in response.json()["error"]["message"]
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}
    assert http.post("/sleep", params={"level": 1}).json() == {"is_sleeping": True}
    assert http.get("/is_sleeping").json() == {"is_sleeping": True}
    # level 2 would discard the host copy and no route loads weights: refused, the copy kept
    deep = http.post("/sleep", params={"level": 2})
    assert (deep.status_code, deep.json()["error"]["param"]) == (409, "level")
    assert "/wake_up first" in deep.json()["error"]["message"]
    asleep = http.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 2})
    assert asleep.status_code == 503 and "wake_up" in asleep.json()["error"]["message"]
    bad = http.post("/wake_up", params={"tags": "everything"})
    assert (bad.status_code, bad.json()["error"]["param"]) == (400, "tags")
    assert http.post("/wake_up", params={"tags": "weights"}).json() == {"is_sleeping": True}
    assert http.post("/wake_up", params={"tags": "kv_cache"}).json() == {"is_sleeping": False}
  response = client.completions.create(model=MODEL, prompt=PROMPTS[0], **GREEDY, **TOKEN_IDS)
  assert (response.choices[0].text, response.choices[0].token_ids) == (ref.text, ref.token_ids)


BAD_INPUTS = [  # (path, body, status, param, words in the message)
  # an RL route's body: malformed JSON is a 400 (not a 500), the connection kept, nothing paused
  ("/pause", b"{bad", 400, None, "malformed JSON"),
  ("/pause", [1], 400, None, "JSON object"),
  ("/v1/completions", b'{"prompt": "hi", ', 400, None, "malformed JSON"),
  ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature", "temperature"),
  ("/v1/completions", {"prompt": "hi", "top_p": 2}, 400, "top_p", "top_p"),
  ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens", "integer"),
  ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n", "n must be"),
  ("/v1/completions", {"prompt": "x" * 300}, 400, "prompt", "max_model_len"),
  ("/v1/completions", {"prompt": [[1, 2], []]}, 400, "prompt", "empty"),
  ("/v1/completions", {"prompt": "hi", "logit_bias": {"a": 1}}, 400, "logit_bias", "token ids"),
  ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model", "gpt-4"),
  ("/v1/completions", {"temperature": 0}, 400, "prompt", "Field required"),
  ("/v1/chat/completions", {"messages": [{"content": "x"}]}, 400, "messages", "role"),
  ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, 400, "top_logprobs", ""),
  ("/v1/chat/completions", {"messages": MESSAGES, "stream": True, "max_tokens": 0}, 400,
   "max_tokens", "max_tokens"),
  ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 300}], "stream": True},
   400, "messages", "max_model_len"),
  ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_schema"}}, 400,
   "response_format", "schema"),
  ("/v1/chat/completions", {"messages": MESSAGES, "structured_outputs": {"regex": "("}}, 400,
   "structured_outputs", "structured_outputs"),
  ("/detokenize", {"tokens": [10**6]}, 400, "tokens", "tokens"),
  # prompt + max_tokens past max_model_len (128) is refused, not clipped (vLLM's 400)
  ("/v1/completions", {"prompt": "hi", "max_tokens": 100000}, 400, "max_tokens",
   "maximum context length is 128 tokens. However, you requested 100002 tokens (2 in the "
   "messages, 100000 in the completion)"),
  ("/v1/completions", {"prompt": ["hi", "x" * 120], "max_tokens": 9}, 400, "max_tokens",
   "you requested 129 tokens (120 in the messages, 9 in the completion)"),
  ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 100000}, 400,
   "max_completion_tokens", "maximum context length is 128 tokens"),
  ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 100000, "stream": True}, 400,
   "max_tokens", "100000 in the completion"),
  # stream_options without stream, best_of, prompt_logprobs while streaming: refused
  ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400,
   "stream_options", "stream"),
  ("/v1/chat/completions", {"messages": MESSAGES, "stream_options": {"include_usage": True}},
   400, "stream_options", "stream"),
  ("/v1/completions", {"prompt": "hi", "best_of": 2}, 400, "best_of", "best_of=2"),
  ("/v1/completions", {"prompt": "hi", "n": 2, "best_of": 3}, 400, "best_of", "best_of=3"),
  ("/v1/completions", {"prompt": "hi", "stream": True, "prompt_logprobs": 1}, 400,
   "prompt_logprobs", "stream"),
  ("/v1/chat/completions", {"messages": MESSAGES, "stream": True, "prompt_logprobs": -1}, 400,
   "prompt_logprobs", "stream"),
  # an invalid constraint names the field it was sent in
  ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_schema",
   "json_schema": {"name": "s", "schema": {"type": "nonsense-type"}}}}, 400, "response_format",
   "response_format.json_schema.schema is invalid"),
  ("/v1/completions", {"prompt": "hi", "guided_regex": "("}, 400, "guided_regex",
   "guided_regex is invalid"),
  ("/v1/completions", {"prompt": "hi", "guided_choice": []}, 400, "guided_choice",
   "guided_choice: choice must be a non-empty list"),
  ("/v1/completions", {"prompt": "hi", "structured_outputs": {"regex": "a"},
   "guided_choice": ["a"]}, 400, "structured_outputs", "not several"),
  # fields vLLM or OpenAI give a meaning this server does not implement
  ("/v1/completions", {"prompt": "hi", "use_beam_search": True}, 400, "use_beam_search",
   "beam search"),
  ("/v1/completions", {"prompt": "hi", "suffix": "end"}, 400, "suffix", "suffix"),
  # tools: "auto" (their default) needs --enable-auto-tool-choice; a call forced needs its tool
  ("/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "function", "function":
   {"name": "f"}}]}, 400, "tool_choice", '"auto" tool choice requires --enable-auto-tool-choice'),
  ("/v1/chat/completions", {"messages": MESSAGES, "tool_choice": "required"}, 400, "tool_choice",
   "needs tools"),
  ("/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "function", "function":
   {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400,
   "tool_choice", "'g', which is not one of the tools ['f']"),
  ("/v1/chat/completions", {"messages": MESSAGES, "functions": [{"name": "f"}]}, 400, "functions",
   "function calling"),
  ("/v1/completions", {"prompt": "hi", "truncate_prompt_tokens": 0}, 400,
   "truncate_prompt_tokens", "-1"),
  ("/v1/completions", {"prompt": "hi", "truncate_prompt_tokens": 129}, 400,
   "truncate_prompt_tokens", "max_model_len=128"),
  # strict types: a JSON boolean is no count, nor 1 or "yes" a boolean (the Python API agrees)
  ("/v1/completions", {"prompt": "hi", "logprobs": False}, 400, "logprobs", "valid integer"),
  ("/v1/completions", {"prompt": "hi", "prompt_logprobs": False}, 400, "prompt_logprobs",
   "valid integer"),
  ("/v1/completions", {"prompt": "hi", "max_tokens": True}, 400, "max_tokens", "valid integer"),
  ("/v1/completions", {"prompt": "hi", "top_k": True}, 400, "top_k", "valid integer"),
  ("/v1/completions", {"prompt": "hi", "n": True}, 400, "n", "valid integer"),
  ("/v1/completions", {"prompt": "hi", "seed": True}, 400, "seed", "valid integer"),
  ("/v1/completions", {"prompt": "hi", "stop_token_ids": [True]}, 400, "stop_token_ids",
   "valid integer"),
  ("/v1/completions", {"prompt": [True, False]}, 400, "prompt", "prompt[0] must be a token id"),
  # a bad element of a token-id prompt or a batch is named with its position
  ("/v1/completions", {"prompt": [1, True, 3]}, 400, "prompt", "prompt[1] must be a token id (a "
   "JSON integer), got true"),
  ("/v1/completions", {"prompt": [1, 2.0, 3]}, 400, "prompt", "prompt[1] must be a token id"),
  ("/v1/completions", {"prompt": [[1, 2, 3], "Hello"]}, 400, "prompt", 'prompt[1] must be a list '
   'of token ids (the batch\'s first element is one), got "Hello"'),
  ("/v1/completions", {"prompt": [[1, 2], [3, False]]}, 400, "prompt", "prompt[1][1] must be"),
  ("/v1/completions", {"prompt": "hi", "temperature": True}, 400, "temperature", "valid number"),
  ("/v1/completions", {"prompt": "hi", "ignore_eos": "yes"}, 400, "ignore_eos", "valid boolean"),
  ("/v1/completions", {"prompt": "hi", "echo": 1}, 400, "echo", "valid boolean"),
  ("/v1/completions", {"prompt": "hi", "stream": "true"}, 400, "stream", "valid boolean"),
  ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": 1}, 400, "logprobs",
   "valid boolean"),
  ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": True}, 400,
   "top_logprobs", "valid integer"),
  ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": False}, 400,
   "max_completion_tokens", "valid integer"),
  # jaxengine's max_staleness: an int >= 0 or null
  ("/v1/completions", {"prompt": "hi", "max_staleness": -1}, 400, "max_staleness",
   "max_staleness must be None or an int >= 0, got -1"),
  ("/v1/chat/completions", {"messages": MESSAGES, "max_staleness": "2"}, 400, "max_staleness",
   "valid integer"),
  ("/v1/chat/completions", {"messages": MESSAGES, "max_staleness": True}, 400, "max_staleness",
   "valid integer"),
]  # fmt: skip


def test_bad_input_is_a_400_and_the_server_goes_on(server, client):
  with httpx.Client(base_url=server["url"], timeout=60) as http:
    for path, body, status, param, words in BAD_INPUTS:
      if isinstance(body, bytes):
        response = http.post(path, content=body, headers={"content-type": "application/json"})
      else:
        response = http.post(path, json=body)
      error = response.json()["error"]
      assert (response.status_code, error["param"]) == (status, param), (body, error)
      assert words in error["message"] and error["code"] == status
      assert http.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2}).status_code == 200
  with httpx.Client(base_url=server["url"], timeout=60) as http:
    fits = {"prompt": "x" * 120, "max_tokens": 8, "ignore_eos": True, "best_of": 1}
    response = http.post("/v1/completions", json=fits)  # 120 + 8 = max_model_len: it fits
    assert response.status_code == 200, response.json()
    assert response.json()["usage"]["completion_tokens"] == 8
    response = http.post("/v1/completions", json={"prompt": "ok", "n": 2, "best_of": 2})
    assert response.status_code == 200 and len(response.json()["choices"]) == 2
  with pytest.raises(openai.BadRequestError, match="top_p"):
    client.completions.create(model=MODEL, prompt="hi", top_p=3.0)
  with pytest.raises(openai.NotFoundError):
    client.chat.completions.create(model="other", messages=MESSAGES)
  assert server["engine"].num_requests_running == 0


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


def _chat_through(app, requests):
  """Each of `requests` (keyword dicts) sent to `app` in-process by the async openai client:
  its non-streamed response and its streamed chunks."""

  async def main():
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test/v1") as http:
      client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http)
      out = []
      for kwargs in requests:
        response = await client.chat.completions.create(model=MODEL, **kwargs)
        stream = await client.chat.completions.create(model=MODEL, stream=True, **kwargs)
        out.append((response, [chunk async for chunk in stream]))
      return out

  return asyncio.run(main())


def _streamed_message(chunks):
  """The streamed choice's message (content, reasoning_content, tool calls by index) and its
  finish_reason, as a client accumulates them."""
  content, reasoning, calls = "", "", {}
  for chunk in chunks:
    delta = chunk.choices[0].delta
    content += delta.content or ""
    reasoning += getattr(delta, "reasoning_content", None) or ""
    for call in delta.tool_calls or ():
      if call.index not in calls:  # the first delta of a call: its id and name
        assert call.id.startswith("chatcmpl-tool-") and call.function.name
        calls[call.index] = [call.function.name, call.function.arguments]
      else:
        assert call.id is None and call.function.name is None
        calls[call.index][1] += call.function.arguments
  return (
    content or None,
    reasoning or None,
    [calls[i] for i in sorted(calls)],
    [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason],
  )


def _message(response):
  message = response.choices[0].message
  calls = [[c.function.name, c.function.arguments] for c in message.tool_calls or ()]
  reasoning = getattr(message, "reasoning_content", None)
  return message.content, reasoning, calls, [response.choices[0].finish_reason]


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
  (response, chunks), (plain_response, plain_chunks) = _chat_through(app, [request, plain])
  content, reasoning, calls, finish = _message(response)
  assert re.fullmatch("[a-z]{1,4}", reasoning) and content == "ok"
  assert [name for name, _ in calls] == ["w"] and json.loads(calls[0][1])["c"] in ("P", "L")
  assert response.choices[0].message.tool_calls[0].id.startswith("chatcmpl-tool-")
  assert finish == ["tool_calls"]
  assert _streamed_message(chunks) == (content, reasoning, calls, finish)
  fragments = [c for c in chunks if c.choices and c.choices[0].delta.tool_calls]
  assert fragments[0].choices[0].delta.tool_calls[0].function.arguments == ""
  assert len(fragments) > 5  # the arguments came in pieces after the name
  # without a think block: all content, no reasoning (qwen3)
  assert _message(plain_response)[1] is None
  assert _streamed_message(plain_chunks)[:2] == _message(plain_response)[:2]


def test_tool_choice_required_and_named_force_valid_calls(server):
  """No tool parser needed: the output is constrained to the call(s)' JSON schema."""
  app = build_app(server["engine"], MODEL)
  named = {"type": "function", "function": {"name": "w"}}
  base = {"messages": MESSAGES, "tools": [TOOL], "max_tokens": 90, "temperature": 0}
  (required, required_chunks), (forced, forced_chunks) = _chat_through(
    app, [{**base, "tool_choice": "required"}, {**base, "tool_choice": named}]
  )
  content, _, calls, finish = _message(required)
  assert content is None and finish == ["tool_calls"] and calls
  assert all(name == "w" and json.loads(args)["c"] in ("P", "L") for name, args in calls)
  assert _streamed_message(required_chunks)[2:] == (calls, finish)
  content, _, calls, finish = _message(forced)
  assert content is None and [name for name, _ in calls] == ["w"]
  assert json.loads(calls[0][1])["c"] in ("P", "L") and finish == ["stop"]  # OpenAI's
  assert _streamed_message(forced_chunks)[2:] == (calls, finish)


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


def test_an_error_in_one_request_fails_it_alone(server, monkeypatch):
  serving = None

  def choice(self, index, output, c, *args):
    if output.prompt == "poison":
      raise RuntimeError("formatting failed")
    return real(self, index, output, c, *args)

  from jaxengine.entrypoints import serving_completion

  real = serving_completion.OpenAIServingCompletion.completion_choice
  monkeypatch.setattr(serving_completion.OpenAIServingCompletion, "completion_choice", choice)

  async def main():
    async with httpx.AsyncClient(base_url=server["url"], timeout=60) as http:
      return await asyncio.gather(
        *(http.post("/v1/completions", json={"prompt": p, "max_tokens": 6})
          for p in ["fine", "poison", "also fine"])
      )  # fmt: skip

  ok, bad, ok2 = asyncio.run(main())
  assert (ok.status_code, bad.status_code, ok2.status_code) == (200, 500, 200), serving
  assert "formatting failed" in bad.json()["error"]["message"]


def test_metrics_tokenize_models_health(server, client):
  with httpx.Client(base_url=server["url"]) as http:
    assert http.get("/health").status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    tokens = http.post("/tokenize", json={"prompt": "hello"}).json()
    text = http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
  for name in ("num_requests_running", "num_requests_waiting", "prompt_tokens",
               "generation_tokens", "time_to_first_token_seconds",
               "time_per_output_token_seconds", "prefix_cache_queries", "prefix_cache_hits"):  # fmt: skip
    assert "jaxengine:" + name in families, name
  generated = families["jaxengine:generation_tokens"].samples[0].value
  assert generated > 0
  ttft = {s.name: s.value for s in families["jaxengine:time_to_first_token_seconds"].samples}
  assert ttft["jaxengine:time_to_first_token_seconds_count"] > 0
  assert tokens["count"] == 5 and text == "hello"
  assert [m.id for m in client.models.list().data] == [MODEL]


def test_api_key():
  """A second app with an API key, served in-process (httpx's ASGI transport)."""
  tokenizer = chatml_byte_tokenizer()
  model, _ = tiny_llama(vocab_size=tokenizer.vocab_size, num_hidden_layers=1)
  engine = AsyncLLM(je.LLM(model, tokenizer=tokenizer, max_num_reqs=2, max_model_len=32))
  app = build_app(engine, MODEL, api_key="sesame")

  async def main():
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
      no_key = await http.get("/v1/models")
      wrong = await http.get("/v1/models", headers={"Authorization": "Bearer nope"})
      right = await http.get("/v1/models", headers={"Authorization": "Bearer sesame"})
      health = await http.get("/health")
      return no_key, wrong, right, health

  try:
    no_key, wrong, right, health = asyncio.run(main())
  finally:
    engine.shutdown()
  assert (no_key.status_code, wrong.status_code, right.status_code) == (401, 401, 200)
  assert no_key.json()["error"]["type"] == "AuthenticationError"
  assert health.status_code == 200


def test_async_llm_deltas_abort_and_shutdown(server):
  """Deltas add up to the final output; an abort ends a request with "abort"."""
  engine = server["engine"]
  params = je.SamplingParams(temperature=0, max_tokens=12, stop=["ab"])

  async def collect(kind):
    return [o async for o in engine.generate(PROMPTS[0], params, output_kind=kind)]

  async def main():
    deltas = await collect(RequestOutputKind.DELTA)
    cumulative = await collect(RequestOutputKind.CUMULATIVE)
    final = await collect(RequestOutputKind.FINAL_ONLY)
    long = engine.generate("x", je.SamplingParams(max_tokens=120, ignore_eos=True), "long")
    first = await anext(long)
    await engine.abort("long")
    rest = [o async for o in long]
    return deltas, cumulative, final, first, rest

  deltas, cumulative, final, first, rest = asyncio.run(main())
  assert "".join(d.outputs[0].text for d in deltas if d.outputs) == final[0].outputs[0].text
  tokens = [t for d in deltas if d.outputs for t in d.outputs[0].token_ids]
  assert tokens == final[0].outputs[0].token_ids
  assert len(final) == 1 and cumulative[-1].outputs == final[0].outputs
  assert not first.finished and rest[-1].outputs[0].finish_reason == "abort"
  assert len(rest[-1].outputs[0].token_ids) < 120


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(server, monkeypatch):
  engine = server["engine"]
  real_step = engine.engine.step
  failures = []

  def step():
    if not failures:
      failures.append(True)
      raise RuntimeError("injected step failure")
    return real_step()

  monkeypatch.setattr(engine.engine, "step", step)
  params = je.SamplingParams(max_tokens=3, ignore_eos=True)

  async def main():
    with pytest.raises(RuntimeError, match="injected step failure"):
      async for _ in engine.generate("hi", params):
        pass
    return [o async for o in engine.generate("hi", params)]

  outputs = asyncio.run(main())
  assert failures and outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 3
  assert engine.is_running and engine.num_requests_running == 0


def test_metrics_of_a_paged_engine_report_cache_usage_preemptions_and_prefix_hits():
  from jaxengine.engine import LLMEngine
  from jaxengine.entrypoints.metrics import ServerMetrics

  # The server's model and rows (its sampler's executable), a pool of its own, one step shape.
  model, _ = tiny_llama(vocab_size=chatml_byte_tokenizer().vocab_size)
  engine = one_shape(
    LLMEngine(model, max_num_reqs=4, max_model_len=128, num_kv_blocks=12, block_size=4)
  )
  prompt = {"prompt_token_ids": list(range(3, 15))}
  params = je.SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
  engine.add_requests([(None, prompt, params) for _ in range(3)])
  while engine.has_unfinished_requests():
    engine.step()
  text = ServerMetrics("tiny", engine).registry
  from prometheus_client import generate_latest

  samples = {
    s.name: s.value
    for family in text_string_to_metric_families(generate_latest(text).decode())
    for s in family.samples
  }
  stats = engine.kv_cache_stats
  assert stats is not None and stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
  assert samples["jaxengine:num_preemptions_total"] == stats.num_preemptions
  assert samples["jaxengine:prefix_cache_hits_total"] == stats.prefix_cache_hits
  assert samples["jaxengine:kv_cache_usage_perc"] == 0.0  # every request finished


async def _last(stream) -> je.RequestOutput:
  return [output async for output in stream][-1]


def test_pause_routes_keep_wait_abort_and_weight_versions(server):
  """Through POST /pause, GET /is_paused and POST /resume, and `AsyncLLM`: a "keep" pause (with
  a load of the same weights while paused) leaves greedy and seeded outputs as uninterrupted,
  tokens before it stamped version 0 and after it the loaded version; a request sent while
  paused waits and starts after resume; "wait" returns with the requests finished; "abort" ends
  them with their partial tokens; a bad mode is a 400 naming it, nothing paused."""
  engine = server["engine"]
  long = {"max_tokens": 100, "ignore_eos": True}
  params = [je.SamplingParams(temperature=0, **long), je.SamplingParams(seed=3, **long)]

  async def main():
    want = [await _last(engine.generate(PROMPTS[0], p)) for p in params]
    async with httpx.AsyncClient(base_url=server["url"], timeout=60) as http:
      bad = await http.post("/pause", json={"mode": "later"})
      assert bad.status_code == 400 and "mode must be one of" in bad.json()["error"]["message"]
      assert (await http.get("/is_paused")).json() == {"is_paused": False}
      streams = [engine.generate(PROMPTS[0], p) for p in params]
      for stream in streams:
        await anext(stream)
      assert (await http.post("/pause", json={"mode": "keep"})).json() == {"is_paused": True}
      assert (await http.get("/is_paused")).json() == {"is_paused": True}
      held = asyncio.ensure_future(_last(engine.generate(PROMPTS[0], params[0])))
      await engine.load_weights(engine.engine.runner.weights, weight_version=3)
      await asyncio.sleep(0.2)
      assert not held.done()
      # sleep refuses the kept requests, pointing at what frees them (HTTP and Python)
      frozen = await http.post("/sleep")
      message = frozen.json()["error"]["message"]
      assert frozen.status_code == 409 and "2 completions are" in message, message
      assert "/sleep?mode=abort" in message and "/resume" in message, message
      with pytest.raises(RuntimeError, match=r"resume_generation, or pause_generation\(mode="):
        await engine.sleep()
      # "wait" after "keep" returns at once, the kept requests still frozen (docs/serving.md)
      assert (await http.post("/pause", json={"mode": "wait"})).json() == {"is_paused": True}
      assert (await http.post("/sleep")).status_code == 409
      assert (await http.post("/resume")).json() == {"is_paused": False}
      kept = [await _last(stream) for stream in streams]
      held_output = await held
      # "wait", then "abort"
      streams = [engine.generate(p, params[0]) for p in PROMPTS]
      for stream in streams:  # sent before the pause (a generator sends at its first step)
        await anext(stream)
      await engine.pause_generation("wait")
      waited = [await _last(stream) for stream in streams]
      assert await engine.is_paused()
      await engine.resume_generation()
      streams = [engine.generate(p, params[0]) for p in PROMPTS]
      for stream in streams:
        await anext(stream)
      await engine.pause_generation("abort")
      aborted = [await _last(stream) for stream in streams]
      await engine.resume_generation()
    return want, kept, held_output, waited, aborted

  try:
    want, kept, held, waited, aborted = asyncio.run(main())
  finally:
    asyncio.run(engine.resume_generation())
  for got, reference in zip(kept, want, strict=True):
    completion = got.outputs[0]
    assert completion.token_ids == reference.outputs[0].token_ids
    assert reference.outputs[0].weight_versions == [0] * 100
    num_before = completion.weight_versions.count(0)
    assert 0 < num_before < 100 and completion.weight_versions[num_before:] == [3] * (
      100 - num_before
    )
  assert held.outputs[0].token_ids == want[0].outputs[0].token_ids
  assert held.outputs[0].weight_versions == [3] * 100
  assert [o.outputs[0].finish_reason for o in waited] == ["length", "length"]
  for output in aborted:
    assert output.finished and output.outputs[0].finish_reason == "abort"
    assert 0 < len(output.outputs[0].token_ids) < 100
