"""LoRA adapters (issue 38): PEFT directories served unmerged next to the base model.

The adapters are made here with `peft` on a tiny Llama checkpoint (random non-zero ``lora_B``:
PEFT starts it at zero), and the reference is transformers + peft computing the same prompts.
Nothing touches the network. Every engine runs its steps in its largest shape only (`one_shape`):
the tests compare engines with the reference and with one another (all limited alike), not bucket
choice (tests/worker/test_step_shapes.py).
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import numpy as np
import peft
import pytest
import torch
import transformers
from hf_checkpoints import config_dict, hf_config, random_tensors, write_checkpoint
from hf_reference import random_peft_adapter
from step_shapes import one_shape

import jaxengine as je
from jaxengine.testing import count_compiles

PROMPTS = [
  [5, 17, 99, 3, 64, 21, 8, 120, 33, 7, 41],
  [2, 9, 77, 31, 4, 100, 62],
  [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28],
]
GREEDY = je.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=0)
#: (rank, alpha, target modules, use_rslora) of the three adapters.
ADAPTERS = {
  1: (4, 8, ["q_proj", "v_proj"], False),
  2: (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], True),
  3: (2, 3, ["o_proj", "gate_proj", "down_proj"], False),
}
MAX_LORA_RANK = 8


def _base_model(directory) -> transformers.PreTrainedModel:
  return transformers.AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.float32)


def _write_adapter(base_dir, out_dir, seed: int, rank, alpha, targets, rslora) -> None:
  torch.manual_seed(seed)
  config = peft.LoraConfig(
    r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, lora_dropout=0.0
  )
  random_peft_adapter(_base_model(base_dir), config, out_dir)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """The base directory and `LoRARequest`s of the three adapters."""
  root = tmp_path_factory.mktemp("lora")
  config = hf_config("LlamaForCausalLM", tie_word_embeddings=False)
  base = write_checkpoint(root / "base", config, random_tensors(config_dict(config), 3))
  requests = {}
  for lora_id, (rank, alpha, targets, rslora) in ADAPTERS.items():
    path = root / f"adapter{lora_id}"
    _write_adapter(base, path, lora_id, rank, alpha, targets, rslora)
    requests[lora_id] = je.LoRARequest(f"adapter{lora_id}", lora_id, str(path))
  return base, requests


#: The LoRA engine of these tests (`llm`), and of its scanned twin.
ENGINE_OPTIONS = dict(
  enable_lora=True,
  max_loras=2,
  max_lora_rank=MAX_LORA_RANK,
  max_num_reqs=4,
  max_model_len=64,
  num_kv_blocks=64,
  block_size=4,
)


@pytest.fixture(scope="module")
def llm(checkpoints):
  base, _ = checkpoints
  return one_shape(je.LLM(base, **ENGINE_OPTIONS))


def _reference(base_dir, lora: je.LoRARequest | None, prompt: list[int]):
  """Greedy tokens and prompt logprobs by transformers (+ peft), float32."""
  model = _base_model(base_dir)
  if lora is not None:
    model = peft.PeftModel.from_pretrained(model, lora.lora_path)
  model.eval()
  tokens = list(prompt)
  with torch.no_grad():
    logits = model(torch.tensor([tokens])).logits[0]
    logprobs = torch.log_softmax(logits.double(), -1)
    prompt_logprobs = [float(logprobs[i, t]) for i, t in enumerate(tokens[1:])]
    for _ in range(GREEDY.max_tokens):
      tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
  return tokens[len(prompt) :], prompt_logprobs


def _result(output):
  tokens = list(output.outputs[0].token_ids)
  prompt = output.prompt_token_ids
  logprobs = [entry[t].logprob for entry, t in zip(output.prompt_logprobs[1:], prompt[1:])]
  return tokens, logprobs


def test_adapters_equal_transformers_with_peft(llm, checkpoints):
  base, requests = checkpoints
  worst = 0.0
  for lora in [None, *requests.values()]:
    for prompt in PROMPTS[:2]:
      (out,) = llm.generate([prompt], GREEDY, lora_request=lora, use_tqdm=False)
      tokens, logprobs = _result(out)
      want_tokens, want_logprobs = _reference(base, lora, prompt)
      assert tokens == want_tokens, lora
      worst = max(worst, float(np.max(np.abs(np.subtract(logprobs, want_logprobs)))))
  assert worst < 1e-4
  # The adapters change the model (else the comparison above would prove nothing).
  (plain,) = llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)
  for lora in requests.values():
    (adapted,) = llm.generate([PROMPTS[0]], GREEDY, lora_request=lora, use_tqdm=False)
    assert np.max(np.abs(np.subtract(_result(adapted)[1], _result(plain)[1]))) > 1e-2


def test_a_scanned_engine_serves_the_same_adapters(llm, checkpoints):
  """``scan_layers=True`` (stacked layers, each step's adapters stacked per layer): the unrolled
  engine's tokens and prompt logprobs with every adapter, one step mixing two of them."""
  base, requests = checkpoints
  scanned = one_shape(je.LLM(base, **ENGINE_OPTIONS, scan_layers=True))
  assert scanned.llm_engine.runner.kv_cache.stacked_layers is not None
  loras = [None, requests[1], requests[2]]
  prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2]]
  want = llm.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False)
  got = scanned.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False)
  for a, b in zip(got, want, strict=True):
    assert _result(a)[0] == _result(b)[0]
    np.testing.assert_allclose(_result(a)[1], _result(b)[1], atol=1e-5)


def test_shuffled_batch_of_adapters_equals_each_request_alone(llm, checkpoints):
  _, requests = checkpoints
  jobs = [(p, lora) for p in PROMPTS for lora in [None, *requests.values()]]
  random.Random(0).shuffle(jobs)
  alone = [llm.generate([p], GREEDY, lora_request=lora, use_tqdm=False)[0] for p, lora in jobs]
  together = llm.generate(
    [p for p, _ in jobs], GREEDY, lora_request=[lora for _, lora in jobs], use_tqdm=False
  )
  for one, mixed in zip(alone, together):
    want, got = _result(one), _result(mixed)
    assert got[0] == want[0]
    np.testing.assert_allclose(got[1], want[1], atol=1e-4)  # float32 sums of other shapes
  manager = llm.llm_engine.runner.lora
  assert len([i for i in manager.slot_ids if i]) <= 2


@pytest.mark.parametrize(
  "options",
  [
    dict(num_decode_steps=4),
    dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3}),
    dict(num_decode_steps=4, speculative_config={"method": "ngram", "num_speculative_tokens": 3}),
  ],
  ids=["k_steps", "ngram", "both"],
)
def test_adapters_compose_with_k_steps_and_ngram_drafts(llm, checkpoints, options):
  """The device loop and the verify step run each row's adapter: the plain engine's tokens."""
  base, requests = checkpoints
  other = one_shape(je.LLM(base, **ENGINE_OPTIONS, **options))
  repetitive = [7, 8, 9, 10, 7, 8, 9, 10, 7, 8, 9, 10, 7, 8]  # n-gram drafts find matches
  params = je.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
  prompts = [repetitive, PROMPTS[0], repetitive, PROMPTS[1]]
  loras = [requests[1], requests[2], None, requests[3]]
  want = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
  got = other.generate(prompts, params, lora_request=loras, use_tqdm=False)
  assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
  if "num_decode_steps" not in options:  # with k steps too, the cost model may prefer the loop
    assert other.llm_engine.spec_decode_stats.num_draft_tokens > 0


def test_switching_adapters_compiles_nothing(llm, checkpoints):
  _, requests = checkpoints
  order = [requests[1], None, requests[2], requests[3], requests[1], None]
  for lora in order:  # warm-up: every adapter placed once, the step shapes compiled
    llm.generate([PROMPTS[1]], GREEDY, lora_request=lora, use_tqdm=False)
  llm.generate(PROMPTS[:2], GREEDY, lora_request=[requests[1], None], use_tqdm=False)
  with count_compiles() as counter:
    for lora in reversed(order):
      llm.generate([PROMPTS[1]], GREEDY, lora_request=lora, use_tqdm=False)
    llm.generate(PROMPTS[:2], GREEDY, lora_request=[requests[3], requests[2]], use_tqdm=False)
  assert counter.count == 0


def test_prefix_cache_keeps_adapters_apart(llm, checkpoints):
  base, requests = checkpoints
  params = je.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
  prompt = PROMPTS[2]  # 18 tokens: four full pages of 4 to share
  engine = llm.llm_engine
  llm.reset_prefix_cache()
  llm.generate([prompt], params, use_tqdm=False)
  hits = engine.kv_cache_stats.prefix_cache_hits
  (adapted,) = llm.generate([prompt], params, lora_request=requests[2], use_tqdm=False)
  assert engine.kv_cache_stats.prefix_cache_hits == hits  # the base's pages are not the adapter's
  want, _ = _reference(base, requests[2], prompt)
  assert list(adapted.outputs[0].token_ids) == want[: params.max_tokens]
  (again,) = llm.generate([prompt], params, lora_request=requests[2], use_tqdm=False)
  assert engine.kv_cache_stats.prefix_cache_hits == hits + 16  # its own pages are shared
  assert list(again.outputs[0].token_ids) == want[: params.max_tokens]
  (other,) = llm.generate([prompt], params, lora_request=requests[1], use_tqdm=False)
  assert engine.kv_cache_stats.prefix_cache_hits == hits + 16
  assert list(other.outputs[0].token_ids) == _reference(base, requests[1], prompt)[0][:4]


@pytest.mark.parametrize(
  "case, message",
  [
    ("no_config", "adapter_config.json"),
    ("rank", "max_lora_rank"),
    ("target", "unknown target module"),
    ("int_id", "lora_int_id"),
  ],
)
def test_bad_adapters_are_refused_and_the_engine_goes_on(llm, checkpoints, tmp_path, case, message):
  import shutil

  base, requests = checkpoints
  good = requests[1]
  path = tmp_path / "adapter"
  shutil.copytree(good.lora_path, path)
  config_file = path / "adapter_config.json"
  config = json.loads(config_file.read_text())
  lora_id = 50
  if case == "no_config":
    config_file.unlink()
  elif case == "rank":
    config["r"] = MAX_LORA_RANK * 2
  elif case == "target":
    config["target_modules"] = ["q_proj", "lm_head"]
  else:
    lora_id = 0
  if config_file.exists():
    config_file.write_text(json.dumps(config))
  bad = je.LoRARequest("bad", lora_id, str(path))
  cached = list(llm.llm_engine.runner.lora.cached_ids)
  with pytest.raises(ValueError, match=message):
    llm.generate([PROMPTS[0], PROMPTS[1]], GREEDY, lora_request=[good, bad], use_tqdm=False)
  assert not llm.llm_engine.has_unfinished_requests()
  assert 50 not in llm.llm_engine.runner.lora.cached_ids
  assert set(cached) >= set(llm.llm_engine.runner.lora.cached_ids) - {good.lora_int_id}
  (out,) = llm.generate([PROMPTS[0]], GREEDY, lora_request=good, use_tqdm=False)
  assert _result(out)[0] == _reference(base, good, PROMPTS[0])[0]


def test_corrupt_adapter_files_are_named_and_change_nothing(llm, checkpoints, tmp_path):
  """A truncated ``adapter_model.safetensors`` and an ``adapter_config.json`` that does not
  parse: ValueErrors naming the file (the JSON's line and column), raised while reading, so the
  engine's adapters are as they were (issue 49)."""
  import shutil

  _, requests = checkpoints
  manager = llm.llm_engine.runner.lora
  cached, slots = list(manager.cached_ids), list(manager.slot_ids)
  path = tmp_path / "adapter"
  shutil.copytree(requests[1].lora_path, path)
  weights, config = path / "adapter_model.safetensors", path / "adapter_config.json"
  weights.write_bytes(weights.read_bytes()[:100])  # an interrupted copy
  with pytest.raises(
    ValueError, match=rf"{re.escape(str(weights))} is not a valid safetensors file \(corrupt"
  ):
    manager.load(je.LoRARequest("bad", 60, str(path)))
  config.write_text('{\n  "r": 4,\n  "lora_alpha": 8\n  "target_modules": []\n}')
  with pytest.raises(
    ValueError, match=rf"{re.escape(str(config))} is not valid JSON \(.* at line 4 column 3\)"
  ):
    manager.load(je.LoRARequest("bad", 61, str(path)))
  assert (manager.cached_ids, manager.slot_ids) == (cached, slots)


def test_an_adapter_of_another_base_model_says_so(checkpoints, tmp_path):
  """An adapter for a model of more layers, other sizes or another architecture names what it
  has against what this model has, and its base_model_name_or_path (not "unexpected tensor")."""
  import shutil

  from jaxengine.lora import load_peft_adapter

  _, requests = checkpoints
  source = requests[1].lora_path  # q_proj, v_proj on 2 layers of hidden size 64
  base = json.loads(Path(source, "adapter_config.json").read_text())["base_model_name_or_path"]
  targets = {"q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "o_proj": (64, 64)}
  load = lambda path, **shapes: load_peft_adapter(
    path, 1, **{"max_lora_rank": 8, "num_layers": 2, "target_shapes": targets, **shapes}
  )
  other = (
    rf"made for a different base model \({re.escape(repr(base))}, its base_model_name_or_path\)"
  )
  with pytest.raises(ValueError, match=rf"{other}: tensor '.*layers\.1\..*' is for layer 1, this "):
    load(source, num_layers=1)
  with pytest.raises(ValueError, match=rf"{other}: its layer 0 q_proj maps 64 -> 64 features .*"
                     r"this model's q_proj 48 -> 48"):  # fmt: skip
    load(source, target_shapes={**targets, "q_proj": (48, 48)})
  gpt2 = tmp_path / "gpt2"
  shutil.copytree(source, gpt2)
  config = json.loads((gpt2 / "adapter_config.json").read_text())
  config.update(target_modules=["c_attn", "c_proj"], base_model_name_or_path="gpt2")
  (gpt2 / "adapter_config.json").write_text(json.dumps(config))
  with pytest.raises(
    ValueError, match=r"different base model \('gpt2', .*\): none of its target_m"
  ):
    load(gpt2)


def test_lora_request_needs_enable_lora_and_options_are_checked(checkpoints):
  base, requests = checkpoints
  # The LoRA engine's sizes without LoRA: its sampler's executable, read back from the cache.
  sizes = dict(max_num_reqs=4, max_model_len=64, num_kv_blocks=64, block_size=4)
  plain = one_shape(je.LLM(base, **sizes))
  with pytest.raises(ValueError, match="enable_lora=True"):
    plain.generate([PROMPTS[0]], GREEDY, lora_request=requests[1], use_tqdm=False)
  (out,) = plain.generate([PROMPTS[0]], GREEDY, use_tqdm=False)
  assert _result(out)[0] == _reference(base, None, PROMPTS[0])[0]
  for options, message in [
    (dict(max_loras=0), "max_loras"),
    (dict(max_lora_rank=-1), "max_lora_rank"),
    (dict(max_loras=3, max_cpu_loras=2), "max_cpu_loras"),
    (dict(enable_lora="yes"), "enable_lora"),
  ]:
    with pytest.raises(ValueError, match=message):
      je.EngineConfig(**options)


def test_lora_command_flags_set_the_config():
  import jaxengine.cli.main as cli
  from jaxengine.engine.engine_flags import engine_options

  parser = cli.build_parser()
  flags = ["--enable-lora", "--max-loras", "3", "--max-lora-rank", "64", "--max-cpu-loras", "5"]
  config = je.EngineConfig(**engine_options(parser.parse_args(["generate", "Hi", *flags])))
  assert (config.enable_lora, config.max_loras, config.max_lora_rank, config.max_cpu_loras) == (
    True,
    3,
    64,
    5,
  )
  defaults = je.EngineConfig(**engine_options(parser.parse_args(["generate", "Hi"])))
  assert (defaults.enable_lora, defaults.max_loras, defaults.max_lora_rank) == (False, 1, 16)
  assert defaults.max_cpu_loras == 1
  with pytest.raises(SystemExit):
    parser.parse_args(["generate", "Hi", "--max-loras", "0"])


def test_llm_engine_add_request_takes_a_lora_request(llm, checkpoints):
  base, requests = checkpoints
  engine = llm.llm_engine
  engine.add_request("lora-a", PROMPTS[1], GREEDY, lora_request=requests[3])
  engine.add_request("base-a", PROMPTS[1], GREEDY)
  done = {}
  while engine.has_unfinished_requests():
    done.update({o.request_id: o for o in engine.step() if o.finished})
  assert done["lora-a"].lora_request == requests[3] and done["base-a"].lora_request is None
  assert _result(done["lora-a"])[0] == _reference(base, requests[3], PROMPTS[1])[0]
  assert _result(done["base-a"])[0] == _reference(base, None, PROMPTS[1])[0]
  # An id names one adapter: the same id with another directory is refused.
  moved = je.LoRARequest("other", requests[3].lora_int_id, requests[1].lora_path)
  with pytest.raises(ValueError, match="lora_int_id=3"):
    engine.add_request("lora-b", PROMPTS[1], GREEDY, lora_request=moved)
  assert not engine.has_unfinished_requests()


# --------------------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
  """A server of a tiny Llama (the byte tokenizer's vocabulary) with adapter "a" from the start;
  adapter "b" is loaded by the tests. References from `LLM.generate` before the server starts."""
  from byte_tokenizer import chatml_byte_tokenizer
  from serve_server import served

  from jaxengine.entrypoints.async_llm import AsyncLLM
  from jaxengine.entrypoints.openai_server import build_app

  root = tmp_path_factory.mktemp("lora-server")
  tokenizer = chatml_byte_tokenizer()
  config = hf_config("LlamaForCausalLM", vocab_size=tokenizer.vocab_size)
  base = write_checkpoint(root / "base", config, random_tensors(config_dict(config), 4))
  paths = {}
  for name, (lora_id, targets) in {"a": (1, ["q_proj", "v_proj"]), "b": (2, ["up_proj"])}.items():
    paths[name] = str(root / name)
    _write_adapter(base, paths[name], 10 + lora_id, 4, 8, targets, False)
  llm = one_shape(
    je.LLM(
      base, tokenizer=tokenizer, enable_lora=True, max_loras=1, max_num_reqs=4, max_model_len=64
    )
  )
  params = je.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
  refs = {
    name: llm.generate(
      ["Hello there"], params, lora_request=lora and je.LoRARequest(name, lora, paths[name]),
      use_tqdm=False,
    )[0].outputs[0].text
    for name, lora in (("base", None), ("a", 1), ("b", 2))
  }  # fmt: skip
  assert len(set(refs.values())) == 3
  chat = [{"role": "user", "content": "Hi!"}]
  for name, lora in (("base", None), ("a", je.LoRARequest("a", 1, paths["a"]))):
    refs["chat-" + name] = llm.chat(chat, params, lora_request=lora, use_tqdm=False)[0]
    refs["chat-" + name] = refs["chat-" + name].outputs[0].text
  assert refs["chat-a"] != refs["chat-base"]
  engine = AsyncLLM(llm)
  with served(build_app(engine, "base", lora_modules={"a": paths["a"]})) as url:
    yield {"url": url, "refs": refs, "paths": paths, "root": root, "engine": engine}
  engine.shutdown()


def _complete(url: str, model: str):
  import httpx

  body = {"model": model, "prompt": "Hello there", "temperature": 0, "max_tokens": 8}
  return httpx.post(url + "/v1/completions", json={**body, "ignore_eos": True}, timeout=120)


def test_server_serves_adapters_by_model_name_and_loads_and_unloads_them(lora_server):
  import httpx

  url, refs, paths = lora_server["url"], lora_server["refs"], lora_server["paths"]
  models = httpx.get(url + "/v1/models").json()["data"]
  assert [m["id"] for m in models] == ["base", "a"] and models[1]["parent"] == "base"
  for name in ("base", "a"):
    response = _complete(url, name)
    assert response.status_code == 200 and response.json()["model"] == name
    assert response.json()["choices"][0]["text"] == refs[name]
  assert _complete(url, "b").status_code == 404
  body = {"messages": [{"role": "user", "content": "Hi!"}], "temperature": 0, "max_tokens": 8}
  for name in ("base", "a"):
    reply = httpx.post(
      url + "/v1/chat/completions", json={**body, "model": name, "ignore_eos": True}
    )
    assert reply.json()["choices"][0]["message"]["content"] == refs["chat-" + name]
  load = url + "/v1/load_lora_adapter"
  assert httpx.post(load, json={"lora_name": "b", "lora_path": paths["b"]}).status_code == 200
  assert _complete(url, "b").json()["choices"][0]["text"] == refs["b"]
  assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == ["base", "a", "b"]
  # Refused: a name already served, a directory that is no adapter; serving goes on.
  again = httpx.post(load, json={"lora_name": "b", "lora_path": paths["a"]})
  assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
  missing = httpx.post(load, json={"lora_name": "c", "lora_path": str(lora_server["root"])})
  assert missing.status_code == 400 and "adapter_config.json" in missing.json()["error"]["message"]
  unload = url + "/v1/unload_lora_adapter"
  assert httpx.post(unload, json={"lora_name": "b"}).status_code == 200
  assert httpx.post(unload, json={"lora_name": "b"}).status_code == 404
  assert _complete(url, "b").status_code == 404
  assert _complete(url, "a").json()["choices"][0]["text"] == refs["a"]


def test_server_refuses_corrupt_adapters_with_400(lora_server, tmp_path):
  """docs/serving.md: a directory the engine cannot read as an adapter is a 400 naming the
  file, not a 500; the adapters served stay as they were (issue 49)."""
  import shutil

  import httpx

  url = lora_server["url"]
  served = httpx.get(url + "/v1/models").json()["data"]
  for name, corrupt in [
    ("adapter_model.safetensors", b"\x00" * 16),
    ("adapter_config.json", b'{"r": 4,'),
  ]:
    path = tmp_path / name
    shutil.copytree(lora_server["paths"]["b"], path)
    (path / name).write_bytes(corrupt)
    reply = httpx.post(
      url + "/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(path)}
    )
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "lora_path" and str(path / name) in error["message"], error
  assert httpx.get(url + "/v1/models").json()["data"] == served
  assert _complete(url, "a").json()["choices"][0]["text"] == lora_server["refs"]["a"]


def test_serve_lora_modules_flag(capsys):
  """``NAME=PATH`` and vLLM's JSON form, several of each; a clear parser error (exit status 2)
  for malformed JSON or a missing field (issue 49)."""
  import jaxengine.cli.main as cli
  from jaxengine.lora import LoRAModulePath

  parser = cli.build_parser()
  entries = ["x=/a", "y=/b=c", '{"name": "z", "path": "/d", "base_model_name": "org/base"}',
             '{"name": "w", "path": "/e=f"}']  # fmt: skip
  args = parser.parse_args(["serve", "m", "--enable-lora", "--lora-modules", *entries])
  assert args.lora_modules == [
    LoRAModulePath("x", "/a"),
    LoRAModulePath("y", "/b=c"),
    LoRAModulePath("z", "/d", "org/base"),
    LoRAModulePath("w", "/e=f"),
  ]
  for entry, message in [
    ("nopath", "expected NAME=PATH or a JSON object, got 'nopath'"),
    ('{"name": "a", "path": ', "is not valid JSON (Expecting value at column 23)"),
    ('{"name": "a"}', "lacks 'path'"),
    ('{"name": "a", "path": 3}', "path=3 is not a string"),
    ('{"name": "", "path": "/p"}', "name='' is an empty string"),
    ('{"name": "a", "path": "/p", "lora_path": "/q"}', "unknown field 'lora_path'"),
  ]:
    with pytest.raises(SystemExit) as exit_info:
      parser.parse_args(["serve", "m", "--lora-modules", "x=/a", entry])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_lora_modules_base_model_name_is_the_adapters_parent(lora_server):
  from fastapi.testclient import TestClient

  from jaxengine.entrypoints.openai_server import build_app
  from jaxengine.entrypoints.serve import lora_module

  engine, path = lora_server["engine"], lora_server["paths"]["b"]
  modules = [lora_module(f'{{"name": "c", "path": "{path}", "base_model_name": "org/base"}}'),
             lora_module(f"d={path}")]  # fmt: skip
  app = build_app(engine, "base", lora_modules=modules)
  try:
    cards = TestClient(app).get("/v1/models").json()["data"]
  finally:
    engine.stat_loggers.remove(app.state.serving.metrics.record)
  assert [(c["id"], c.get("parent"), c["root"]) for c in cards] == [
    ("base", None, "base"), ("c", "org/base", path), ("d", "base", path)
  ]  # fmt: skip


def test_slot_update_compiles_once_in_precompile_and_keeps_slot_zero_empty(llm, checkpoints):
  from jaxengine.lora import LoRAManager

  _, requests = checkpoints
  shapes = llm.llm_engine.runner.lora.target_shapes
  manager = LoRAManager(
    max_loras=2,
    max_lora_rank=5,
    max_cpu_loras=2,
    num_layers=2,
    target_shapes=shapes,
    dtype=np.float32,
  )  # fmt: skip  (rank 5: buffers of shapes no other test compiled for)
  with count_compiles() as counter:
    manager.precompile()
  assert counter.count >= 1
  with count_compiles() as counter:
    assert manager.acquire("r1", requests[1]) == 1
    assert manager.acquire("r2", je.LoRARequest("x", 3, requests[3].lora_path)) == 2
  assert counter.count == 0
  a, b = manager.buffers[0]["q_proj"]
  assert not np.any(np.asarray(a[0])) and not np.any(np.asarray(b[0]))
  assert np.any(np.asarray(a[1])) and not np.any(np.asarray(a[2]))  # adapter 3 skips q_proj
  fourth = je.LoRARequest("y", 4, requests[1].lora_path)
  with pytest.raises(RuntimeError, match="max_loras=2"):
    manager.acquire("r3", fourth)
  manager.release("r1")
  assert manager.acquire("r3", fourth) == 1  # the free slot, its adapter replaced
  assert manager.slot_ids == [4, 3]


def test_bfloat16_adapter_files_load_as_their_float32_values(checkpoints, tmp_path):
  import shutil

  import safetensors.torch

  from jaxengine.lora import load_peft_adapter

  _, requests = checkpoints
  source = requests[2].lora_path
  shutil.copytree(source, tmp_path / "bf16")
  file = tmp_path / "bf16" / "adapter_model.safetensors"
  tensors = safetensors.torch.load_file(file)
  safetensors.torch.save_file({k: v.bfloat16() for k, v in tensors.items()}, file)
  shapes = dict(
    max_lora_rank=8,
    num_layers=2,
    target_shapes={"q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "o_proj": (64, 64),
                   "gate_proj": (64, 96), "up_proj": (64, 96), "down_proj": (96, 64)},
  )  # fmt: skip
  want = load_peft_adapter(source, 2, **shapes)
  got = load_peft_adapter(tmp_path / "bf16", 2, **shapes)
  assert got.scale == want.scale == 16 / np.sqrt(8)  # use_rslora
  assert set(got.weights) == set(want.weights) and len(want.weights) == 14
  for key, (a, b) in want.weights.items():
    np.testing.assert_allclose(got.weights[key][0], a, rtol=1e-2, atol=1e-3)
    np.testing.assert_allclose(got.weights[key][1], b, rtol=1e-2, atol=1e-3)
    assert not np.array_equal(got.weights[key][0], a)  # rounded: the file was bfloat16


def test_models_without_lora_support_are_refused_by_enable_lora():
  """A model class without ``lora_target_shapes`` (Llama and Gemma have them) is named."""
  from flax import nnx

  from jaxengine.models.llama import Llama
  from jaxengine.testing import tiny_llama_config

  class NoTargets(Llama):
    lora_target_shapes = None

  model = NoTargets(tiny_llama_config(vocab_size=96), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="NoTargets models do not support LoRA"):
    je.LLM(model, enable_lora=True, max_model_len=32)


def test_a_mixture_of_experts_refuses_a_dense_mlp_pair_on_its_sparse_layer(checkpoints):
  """Layer 0 dense, layer 1 sparse: the dense MLP targets are layer 0's only, so adapter 2 (a
  Llama adapter on every projection of both layers) is refused, not half applied; adapter 1
  (attention only) loads."""
  from flax import nnx

  from jaxengine.lora import LoRAManager
  from jaxengine.models.llama import Llama
  from jaxengine.models.llama_config import LlamaConfig

  config = LlamaConfig(
    vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
    num_experts_per_tok=2, moe_intermediate_size=32, moe_layers=(1,),
  )  # fmt: skip
  model = Llama(config, rngs=nnx.Rngs(0))
  shapes = model.lora_target_shapes()
  assert shapes["experts.gate_proj"] == (4, 64, 32) and shapes["gate_proj"] == (64, 96)
  manager = LoRAManager(
    max_loras=1, max_lora_rank=8, max_cpu_loras=2, num_layers=2, target_shapes=shapes,
    dtype=np.float32, target_layers=model.lora_target_layers(),
  )  # fmt: skip
  _, requests = checkpoints
  with pytest.raises(ValueError, match=r"layer 1 has no (gate|up|down)_proj"):
    manager.load(requests[2])
  assert manager.load(requests[1]).weights and manager.cached_ids == [1]


def test_load_lora_weights_gives_an_adapter_new_values_from_memory(llm, checkpoints):
  """An adapter's arrays handed over in memory run as its PEFT directory does; new values
  (a trainer's step) take effect without a compile; a rank above the slots' is refused."""
  from jaxengine.lora import load_peft_adapter, lora_adapter_from_arrays

  _, requests = checkpoints
  manager = llm.llm_engine.runner.lora
  shapes = dict(max_lora_rank=MAX_LORA_RANK, num_layers=2, target_shapes=manager.target_shapes)
  from_file = load_peft_adapter(requests[2].lora_path, 2, **shapes)
  in_memory = je.LoRARequest("trainer", 40, "in memory")
  llm.load_lora_weights(in_memory, lora_adapter_from_arrays(40, from_file.weights))
  (want,) = llm.generate([PROMPTS[0]], GREEDY, lora_request=requests[2], use_tqdm=False)
  (got,) = llm.generate([PROMPTS[0]], GREEDY, lora_request=in_memory, use_tqdm=False)
  assert _result(got)[0] == _result(want)[0]
  np.testing.assert_allclose(_result(got)[1], _result(want)[1], atol=1e-6)
  zero_b = {key: (a, np.zeros_like(b)) for key, (a, b) in from_file.weights.items()}
  with count_compiles() as counter:
    llm.load_lora_weights(in_memory, lora_adapter_from_arrays(40, zero_b))
    (zeroed,) = llm.generate([PROMPTS[0]], GREEDY, lora_request=in_memory, use_tqdm=False)
  assert counter.count == 0
  (plain,) = llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)
  assert _result(zeroed)[0] == _result(plain)[0]
  np.testing.assert_allclose(_result(zeroed)[1], _result(plain)[1], atol=1e-6)
  too_wide = {(0, "q_proj"): (np.ones((64, 16), np.float32), np.ones((16, 64), np.float32))}
  with pytest.raises(ValueError, match="max_lora_rank"):
    llm.load_lora_weights(in_memory, lora_adapter_from_arrays(40, too_wide))
  diverged = dict(zero_b)
  key = next(iter(diverged))
  diverged[key] = (diverged[key][0], np.full_like(diverged[key][1], np.nan))
  with pytest.raises(ValueError, match="NaN or infinite"):
    llm.load_lora_weights(in_memory, lora_adapter_from_arrays(40, diverged))
  (still,) = llm.generate([PROMPTS[0]], GREEDY, lora_request=in_memory, use_tqdm=False)
  assert _result(still)[0] == _result(plain)[0]


# One subprocess on 2 host devices (the count is set before JAX starts):
# - a trainer's LoRA pairs committed to device 0 (on a mesh with explicit axes, as Tunix's actor
#   holds them) written into slots on device 1 (issue 49): the pairs are moved to the slots'
#   device and relabelled as plain arrays; the slot then holds what the host path writes;
# - the LoRA engine with tensor_parallel_size=2 (slots split as their base projections; k = 3
#   decode steps per dispatch) and with data_parallel_size=2: the one-device engine's tokens and
#   prompt logprobs (within 1e-4) for a step mixing two adapters and the base; on the tensor-
#   parallel engine a trainer's arrays (device arrays, `load_lora_weights`) run as the file.
TWO_DEVICE_SCRIPT = """
import os, sys
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
import jax, numpy as np
from jax.sharding import PartitionSpec as P
import jaxengine as je
from step_shapes import one_shape
from jaxengine.lora import LoRAManager, LoRARequest, load_peft_adapter, lora_adapter_from_arrays

devices = jax.devices()
shapes = {"q_proj": (8, 8), "down_proj": (12, 8)}
options = dict(max_loras=1, max_lora_rank=4, max_cpu_loras=2, num_layers=2, target_shapes=shapes)
rng = np.random.default_rng(0)
pairs = {(1, t): (rng.standard_normal((i, 2), np.float32), rng.standard_normal((2, o), np.float32))
         for t, (i, o) in shapes.items()}
trainer = jax.make_mesh((1,), ("fsdp",), devices=devices[:1])  # explicit axes: jax's default
on_trainer = jax.device_put(pairs, jax.sharding.NamedSharding(trainer, jax.sharding.PartitionSpec()))
request = LoRARequest("trainer", 1, "in memory")
manager = LoRAManager(**options, dtype=np.float32, device=devices[1])
manager.set_adapter(request, lora_adapter_from_arrays(1, on_trainer, scale=2.0))
assert manager.acquire("seq", request) == 1
host = LoRAManager(**options, dtype=np.float32, device=devices[1])
host.set_adapter(request, lora_adapter_from_arrays(1, pairs, scale=2.0))
host.acquire("seq", request)
for got, want in zip(jax.tree.leaves(manager.buffers), jax.tree.leaves(host.buffers)):
  assert got.devices() == {devices[1]}, got.devices()
  assert not isinstance(got.sharding, jax.sharding.NamedSharding), got.sharding
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
assert np.any(np.asarray(manager.buffers[1]["q_proj"][1][1]))
print("other device ok")

base, paths = sys.argv[1], sys.argv[2:]
requests = [LoRARequest(f"adapter{i + 1}", i + 1, path) for i, path in enumerate(paths)]
kw = dict(enable_lora=True, max_loras=2, max_lora_rank=8, max_num_reqs=4, max_model_len=64,
          num_kv_blocks=64, block_size=4)
params = je.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=0)
prompts = [[5, 17, 99, 3, 64, 21, 8, 120, 33, 7, 41], [2, 9, 77, 31, 4, 100, 62], [11, 12, 13, 14]]
loras = [requests[1], None, requests[0]]
def run(llm, loras=loras, prompts=prompts):
  outputs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
  return [(list(o.outputs[0].token_ids),
           [e[t].logprob for e, t in zip(o.prompt_logprobs[1:], p[1:])])
          for o, p in zip(outputs, prompts)]
def check_same(got, want, what):
  for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want, strict=True):
    assert tokens == want_tokens, (what, tokens, want_tokens)
    assert np.abs(np.subtract(logprobs, want_logprobs)).max() < 1e-4, what
want = run(one_shape(je.LLM(base, **kw)))
tp = one_shape(je.LLM(base, tensor_parallel_size=2, num_decode_steps=3, **kw))
check_same(run(tp), want, "tensor_parallel_size=2")
runner = tp.llm_engine.runner
assert runner.decode_steps._cache_size() > 0  # the k-step loop ran the adapters too
slots = runner.lora.buffers[1]
assert [s.sharding.spec for s in slots["q_proj"]] == [P(), P(None, None, "model")]
assert [s.sharding.spec for s in slots["down_proj"]] == [P(None, "model", None), P()]
from_file = load_peft_adapter(paths[1], 2, max_lora_rank=8, num_layers=2,
                              target_shapes=runner.lora.target_shapes)
in_memory = LoRARequest("trainer", 9, "in memory")
on_device = jax.device_put({k: (a, b) for k, (a, b) in from_file.weights.items()}, devices[0])
tp.load_lora_weights(in_memory, lora_adapter_from_arrays(9, on_device))
check_same(run(tp, [in_memory], prompts[:1]), want[:1], "in memory")
assert runner.lora.buffers[1]["q_proj"][1].sharding.spec == P(None, None, "model")
print("tensor parallel ok")
check_same(run(one_shape(je.LLM(base, data_parallel_size=2, **kw))), want, "data_parallel_size=2")
print("ok")
"""


def test_lora_on_two_devices(checkpoints):
  from subprocess_utils import run_python

  base, requests = checkpoints
  paths = [requests[1].lora_path, requests[2].lora_path]
  out = run_python(TWO_DEVICE_SCRIPT, str(base), *paths, timeout=900)
  assert out.strip().splitlines()[-1] == "ok", out
