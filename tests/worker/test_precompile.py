"""After `precompile` nothing compiles while serving: offline (`LLMEngine.precompile`) for any mix
of prompt lengths and per-request features, and `jaxengine serve`, which compiles before it
listens.

A random tiny Llama (128 positions) with a byte-level tokenizer; 2 rows and 16 tokens per step,
so that the buckets are few: rows 1 and 2, tokens 1 to 16.
"""

from __future__ import annotations

import re
import threading
import time

import httpx
import pytest
import uvicorn
from byte_tokenizer import chatml_byte_tokenizer
from subprocess_utils import run_python

import jaxengine as je
import jaxengine.entrypoints.llm as llm_module
from jaxengine.cli.main import build_parser
from jaxengine.entrypoints import serve
from jaxengine.entrypoints.background_compile import ServeCompile
from jaxengine.testing import count_compiles, tiny_llama
from jaxengine.worker import device_steps

#: The engine's settings: its step shapes are (tokens, rows) 1-16 x 1 and 2-16 x 2, and with
#: prompt logprobs 2-16 x 2 (the largest row bucket only).
OPTIONS = dict(max_num_reqs=2, max_num_batched_tokens=16)
NUM_STEP_SHAPES = 5 + 4 + 4
MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def tokenizer():
  return chatml_byte_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
  model, _ = tiny_llama(vocab_size=tokenizer.vocab_size, max_position_embeddings=MAX_MODEL_LEN)
  return model


def _requests() -> list[tuple[list[int], je.SamplingParams]]:
  """Prompts of 1 to 126 tokens (one step, several chunks, near `max_model_len`), each with
  another per-request feature."""
  features = [
    dict(temperature=0.0),
    dict(n=2, temperature=1.0, seed=1),
    dict(logprobs=3, temperature=0.8, top_k=5, top_p=0.9, min_p=0.05),
    dict(prompt_logprobs=2),
    dict(prompt_logprobs=0, logprobs=1, n=2, seed=2, temperature=1.0),
    dict(stop=["ab", "q"], presence_penalty=0.5, repetition_penalty=1.2, min_tokens=1),
    dict(allowed_token_ids=[60, 61, 62], logit_bias={61: 2.0}, bad_words=["x"]),
  ]
  requests = []
  for i, length in enumerate([1, 2, 3, 5, 9, 15, 16, 17, 31, 33, 50, 64, 100, 125, 126]):
    prompt = [3 + (7 * i + j) % 200 for j in range(length)]
    max_tokens = min(4, MAX_MODEL_LEN - length)
    requests.append((prompt, je.SamplingParams(max_tokens=max_tokens, **features[i % 7])))
  return requests


def test_after_precompile_no_request_compiles_whatever_its_length_or_features(model, tokenizer):
  """`precompile` covers every (token bucket, row bucket) a step reaches, with and without prompt
  logprobs, and the batch's own updates: then prompts of every length with n > 1, logprobs, prompt logprobs,
  stop strings, penalties, allowed tokens, bad words and structured outputs compile nothing."""
  device_steps.clear()  # this engine's executables alone
  llm = je.LLM(model, tokenizer=tokenizer, **OPTIONS)
  engine = llm.llm_engine
  assert engine.max_model_len == MAX_MODEL_LEN  # the model's limit (no max_model_len given)
  with count_compiles() as compiles:
    shapes = engine.precompile(use_tqdm=False)
  assert shapes == NUM_STEP_SHAPES
  assert compiles.count >= shapes
  requests = _requests()
  with count_compiles() as compiles:
    outputs = llm.generate([{"prompt_token_ids": p} for p, _ in requests], [s for _, s in requests])
    structured = je.SamplingParams(
      max_tokens=8, structured_outputs=je.StructuredOutputsParams(choice=["yes", "no"])
    )
    (chosen,) = llm.generate(["Answer:"], structured)
  assert compiles.count == 0
  for (prompt, params), output in zip(requests, outputs):
    assert len(output.outputs) == params.n
    if params.prompt_logprobs is not None:
      assert output.prompt_logprobs is not None and len(output.prompt_logprobs) == len(prompt)
  assert chosen.outputs[0].text in ("yes", "no")
  assert engine.runner.ragged_forward._cache_size() == shapes  # no new step shape


def test_before_the_background_compile_plain_steps_run_in_the_first_set_and_compile_nothing(
  model, tokenizer
):
  """`jaxengine serve`'s first set (`entrypoints/background_compile.py`): the largest and the
  smallest plain shape with their samplers, compiled from the live runner's argument shapes.
  Before the background thread compiles anything, plain requests of every length run in those
  two shapes and compile nothing; once it is done (every other step shape, the prompt-logprobs
  ones too), the whole mix of `_requests` compiles nothing either, as after `precompile`."""
  device_steps.clear()
  llm = je.LLM(model, tokenizer=tokenizer, **OPTIONS)
  staged = ServeCompile(llm.llm_engine)
  # (16, 2), (1, 1) and their samplers (8-row sampler for both: max_num_reqs 2 < 8 rows).
  assert (staged.num_first, staged.num_rest) == (3, NUM_STEP_SHAPES - 2)
  staged.compile_first()
  shapes = llm.llm_engine.runner.compiled_shapes
  assert shapes.num_expected == NUM_STEP_SHAPES - 2
  plain = [(p, je.SamplingParams(max_tokens=s.max_tokens)) for p, s in _requests()]
  with count_compiles() as compiles:
    llm.generate([{"prompt_token_ids": p} for p, _ in plain], [s for _, s in plain])
  assert compiles.count == 0
  staged.start()
  assert staged.wait(timeout=600) and staged.error is None
  assert (staged.num_done, shapes.num_expected) == (NUM_STEP_SHAPES - 2, 0)
  requests = _requests()
  with count_compiles() as compiles:
    llm.generate([{"prompt_token_ids": p} for p, _ in requests], [s for _, s in requests])
  assert compiles.count == 0


def test_the_background_compile_covers_the_verify_steps_and_their_rejection_samplers(
  model, tokenizer
):
  """With drafts the first set holds the verify step's shapes and their rejection samplers (one
  per verify shape: its drafts carry the step's token ids); once the background is done,
  drafted and prompt-logprobs requests compile nothing (the k-step loops, one per row bucket,
  are all in the first set)."""
  speculative = {"method": "ngram", "num_speculative_tokens": 2}
  llm = je.LLM(model, tokenizer=tokenizer, max_num_reqs=2, max_num_batched_tokens=8,
               speculative_config=speculative)  # fmt: skip
  staged = ServeCompile(llm.llm_engine)
  staged.compile_first()
  staged.start()
  assert staged.wait(timeout=600) and staged.error is None
  prompts = [[3, 4, 5] * 4, [3, 4, 5, 3, 4], list(range(3, 30)), [7]]
  with count_compiles() as compiles:
    for params in (
      je.SamplingParams(max_tokens=12),
      je.SamplingParams(max_tokens=3, prompt_logprobs=1),
    ):
      llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
  assert compiles.count == 0


#: Run with 2 host devices: each engine's background compile finished, a mix of requests compiles
#: nothing. Prints one line per engine.
MESH_SCRIPT = """
import os, sys
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
from byte_tokenizer import chatml_byte_tokenizer
import jaxengine as je
from jaxengine.entrypoints.background_compile import ServeCompile
from jaxengine.testing import count_compiles, tiny_llama

tokenizer = chatml_byte_tokenizer()
model, _ = tiny_llama(vocab_size=tokenizer.vocab_size, max_position_embeddings=128)
drafts = {"method": "ngram", "num_speculative_tokens": 2}
for options in (dict(tensor_parallel_size=2, speculative_config=drafts),):
  llm = je.LLM(model, tokenizer=tokenizer, max_num_reqs=2, max_num_batched_tokens=8, **options)
  staged = ServeCompile(llm.llm_engine)
  staged.compile_first()
  staged.start()
  assert staged.wait(600) and staged.error is None, staged.error
  prompts = [[3, 4, 5] * 4, [3, 4, 5, 3, 4], list(range(3, 30)), [7]]
  sampled = je.SamplingParams(max_tokens=3, prompt_logprobs=1, n=2, seed=1, temperature=1.0)
  with count_compiles() as compiles:
    for params in (je.SamplingParams(max_tokens=6), sampled):
      llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
  print(sorted(options), compiles.count)
"""


def test_the_background_compile_on_a_mesh_leaves_nothing_to_compile():
  """On 2 host devices (tensor parallel, with drafts) the background compile's executables carry
  the runner's shardings (its weights', pages' and batch's own, host inputs replicated, logits as
  the steps declare them), so serving after it compiles nothing (before the shardings were
  mirrored: 8 compiles without drafts; data parallelism, checked by hand, 14, now 0)."""
  out = run_python(MESH_SCRIPT, timeout=900)
  assert out.splitlines() == ["['speculative_config', 'tensor_parallel_size'] 0"]


@pytest.mark.parametrize("background", [True, False], ids=["background", "all_first"])
def test_serve_compiles_before_it_listens_and_its_first_requests_compile_nothing(
  monkeypatch, capsys, model, tokenizer, background
):
  """`jaxengine serve` compiles by default. With `--precompile-in-background` (the default) it
  listens once the first set is compiled and compiles the rest beside the engine; with
  `--no-precompile-in-background` every step shape is compiled before it listens (`/health` is
  never up before). Either way, once the compile is done, the requests (prompt logprobs
  included) compile nothing. On stderr, in order: a line saying what it compiles and where the
  server will listen, (a progress bar counting the step shapes,) a line when they are done, and
  one once it listens (its port). `--no-precompile` skips it."""
  real_llm = llm_module.LLM

  class TinyLLM(real_llm):  # what `serve` loads: the tiny model
    def __init__(self, name, **options):
      assert name is None
      super().__init__(model, tokenizer=tokenizer, **options)

  monkeypatch.setattr(llm_module, "LLM", TinyLLM)
  device_steps.clear()  # the server engine's executables alone
  seen = {}

  def run(app, host, port, log_level):  # as `serve_app`: check the engine, serve a few requests
    engine = app.state.serving.engine
    staged = engine.background_compile
    if background:
      assert staged.wait(timeout=600) and staged.error is None
      seen["compiled"] = staged.num_first + staged.num_done
    else:
      assert staged is None
      seen["compiled"] = engine.engine.runner.ragged_forward._cache_size()
    assert (host, port) == ("127.0.0.1", 8000)  # the defaults
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None)  # keeps capsys
    server = serve.announcing_server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    with count_compiles() as compiles:
      thread.start()
      deadline = time.monotonic() + 60
      while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
      url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
      seen["url"] = url
      seen["health"] = httpx.get(f"{url}/health").status_code
      for body in (
        {"prompt": "Once upon a time", "max_tokens": 3},
        {"prompt": "x" * 40, "max_tokens": 2, "logprobs": 2, "n": 2, "temperature": 1.0},
        {"prompt": "The quick brown fox", "max_tokens": 2, "prompt_logprobs": 1},
      ):
        response = httpx.post(f"{url}/v1/completions", json={"model": "tiny", **body}, timeout=60)
        assert response.status_code == 200, response.text
    seen["compiles"] = compiles.count
    server.should_exit = True
    thread.join(30)

  monkeypatch.setattr(serve, "serve_app", run)
  flags = ["--max-num-reqs", "2", "--max-num-batched-tokens", "16", "--served-model-name", "tiny"]
  if not background:
    flags.append("--no-precompile-in-background")
  assert serve.run_server(build_parser().parse_args(["serve", *flags])) == 0
  url = seen.pop("url")
  # In the background: every step shape and the two samplers (1 + NUM_STEP_SHAPES executables).
  compiled = NUM_STEP_SHAPES + 1 if background else NUM_STEP_SHAPES
  assert seen == {"compiled": compiled, "health": 200, "compiles": 0}
  err = capsys.readouterr().err
  if background:
    before = err.index("jaxengine: compiling the 3 executables the first requests need")
    assert "the server listens on http://127.0.0.1:8000 once they are done" in err[before:]
    after = err.index("jaxengine: compiled 3 executables in ")
    assert before < after
  else:
    before = err.index("jaxengine: precompiling the step executables of every bucket")
    assert "the server listens on http://127.0.0.1:8000 once they are done" in err[before:]
    bar = re.search(rf"Compiling: 100%.* {NUM_STEP_SHAPES}/{NUM_STEP_SHAPES} ", err)
    after = err.index(f"jaxengine: precompiled {NUM_STEP_SHAPES} step shapes")
    assert bar is not None and before < bar.start() < after
  assert err.index(f"jaxengine: listening on {url}\n") > after
  if background:
    return
  device_steps.clear()
  engine = serve.load_engine(build_parser().parse_args(["serve", *flags, "--no-precompile"]))
  try:
    assert engine.background_compile is None
    assert engine.engine.runner.ragged_forward._cache_size() == 0
  finally:
    engine.shutdown()
