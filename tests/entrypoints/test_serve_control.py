"""The OpenAI-compatible server's control routes and failures: disconnects, sleep and wake,
pause and resume, bad input (a 400, and serving goes on), an error in one request or one step,
metrics, tokenize, health, an API key, and `AsyncLLM`'s deltas, aborts and shutdown. The server:
tests/helpers/serve_server.py (a module fixture of tests/entrypoints/conftest.py); its outputs:
test_serve.py.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from byte_tokenizer import chatml_byte_tokenizer
from prometheus_client.parser import text_string_to_metric_families
from serve_server import GREEDY, MESSAGES, MODEL, PROMPTS, TOKEN_IDS
from step_shapes import one_shape

import jaxengine as je
from jaxengine.entrypoints.async_llm import AsyncLLM, RequestOutputKind
from jaxengine.entrypoints.openai_server import build_app
from jaxengine.testing import tiny_llama


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
