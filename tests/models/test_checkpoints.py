"""Hugging Face checkpoints, hub ids, your own NNX model, weight updates, trustworthy logprobs.

Tiny random checkpoints of each supported architecture are written by the tests
(`hf_checkpoints`, with transformers' config classes) and compared with an independent float64
NumPy forward that reads the checkpoint's tensors by their Hugging Face names. SmolLM2 is written
out as a safetensors directory from the installed GGUF file and must give the reference tokens of
`tests/fixtures`. Nothing here touches the network.
"""

from __future__ import annotations

import json
import math
import socket
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import transformers
from byte_tokenizer import chatml_byte_tokenizer
from flax import nnx
from hf_checkpoints import (
  config_dict,
  hf_config,
  random_tensors,
  reference_greedy,
  reference_inv_freq,
  reference_logits,
  write_checkpoint,
)
from step_shapes import one_shape

import jaxengine as je
from jaxengine.models import (
  KVCacheSpec,
  WeightSpec,
  config_from_hf,
  gguf_loader,
  load_safetensors,
  named_weights,
  safetensors_loader,
  sequence_logits,
)
from jaxengine.models import weights as weights_module
from jaxengine.models.attention import attention
from jaxengine.models.llama import rope_frequencies
from jaxengine.models.weights import unpermute_rotary_rows
from jaxengine.testing import count_compiles, tiny_llama
from jaxengine.tokenizer import Tokenizer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
LLAMA3_ROPE = {
  "rope_type": "llama3",
  "factor": 8.0,
  "low_freq_factor": 1.0,
  "high_freq_factor": 4.0,
  "original_max_position_embeddings": 32,
}
# One of each architecture, each with the switch that sets it apart.
CASES = {
  "llama": dict(architecture="LlamaForCausalLM", tie_word_embeddings=False),
  "llama3_rope_bias_tied": dict(
    architecture="LlamaForCausalLM",
    tie_word_embeddings=True,
    rope_scaling=LLAMA3_ROPE,
    attention_bias=True,
  ),
  "mistral_sliding_window": dict(architecture="MistralForCausalLM", sliding_window=4, head_dim=16),
  "qwen2_tied": dict(architecture="Qwen2ForCausalLM", tie_word_embeddings=True),
  "qwen3_head_dim": dict(architecture="Qwen3ForCausalLM", head_dim=32, tie_word_embeddings=False),
}
GREEDY = je.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = [5, 17, 99, 3, 64, 21, 8, 120, 33, 7, 41]  # 11 tokens: past the sliding window of 4


def _checkpoint(directory: Path, case: str, *, seed: int = 0, **write_options):
  fields = dict(CASES[case])
  config = hf_config(fields.pop("architecture"), **fields)
  c = config_dict(config)
  tensors = random_tensors(c, seed)
  write_checkpoint(directory, config, tensors, **write_options)
  return c, tensors


def _forward_logits(model, token_ids) -> np.ndarray:
  """``[T, V]`` logits of one sequence by a loaded model (one whole-sequence forward)."""
  return np.asarray(sequence_logits(model, np.asarray([token_ids], np.int32)))[0]


def _tokens(output, index=0):
  return output.outputs[index].token_ids


# --------------------------------------------------------------------------- architectures


@pytest.mark.parametrize("case", list(CASES))
def test_checkpoint_matches_float64_reference(tmp_path, case):
  c, tensors = _checkpoint(tmp_path, case, num_shards=2 if case.startswith("qwen3") else 1)
  model, config = load_safetensors(tmp_path)
  logits = _forward_logits(model, PROMPT)
  reference = reference_logits(c, tensors, PROMPT)
  rel = np.abs(logits[-1] - reference[-1]).max() / np.abs(reference[-1]).max()
  assert rel < 1e-4
  np.testing.assert_allclose(logits, reference, rtol=1e-4, atol=1e-4 * np.abs(reference).max())

  llm = one_shape(je.LLM(tmp_path, max_num_reqs=2, max_model_len=32))
  (out,) = llm.generate(PROMPT, GREEDY, use_tqdm=False)
  assert _tokens(out) == reference_greedy(c, tensors, PROMPT, GREEDY.max_tokens)
  assert llm.get_tokenizer() is None  # no tokenizer.json: token-id prompts

  # Each case's switch changes the result, so the comparison above could fail.
  if case.startswith("mistral"):
    assert config.sliding_window == 4
    plain = reference_logits({**c, "sliding_window": None}, tensors, PROMPT)
    assert np.abs(plain[-1] - reference[-1]).max() > 1e-2
  if case.startswith("llama3"):
    assert config.rope_scaling is not None and config.attention_output_bias
    plain = reference_logits({**c, "rope_parameters": {"rope_theta": 10000.0}}, tensors, PROMPT)
    assert np.abs(plain[-1] - reference[-1]).max() > 1e-2
  if case.startswith("qwen2"):
    assert config.attention_bias and not config.attention_output_bias
  if case.startswith("qwen3"):
    assert config.qk_norm and config.head_dim * config.num_attention_heads != config.hidden_size


def test_llama3_rope_frequencies_cover_the_three_regimes():
  config = config_from_hf(config_dict(hf_config("LlamaForCausalLM", rope_scaling=LLAMA3_ROPE)))
  d, theta = config.head_dim, config.rope_theta
  scaled = rope_frequencies(config)
  plain = theta ** -(np.arange(0, d, 2) / d)
  np.testing.assert_allclose(scaled, reference_inv_freq(d, theta, LLAMA3_ROPE), rtol=1e-12)
  kept, divided = np.isclose(scaled, plain), np.isclose(scaled, plain / 8)
  assert kept.any() and divided.any() and (~kept & ~divided).any()


def test_bfloat16_sharded_checkpoint_loads_as_float32_or_bfloat16(tmp_path):
  fields = dict(CASES["qwen2_tied"])
  config = hf_config(fields.pop("architecture"), **fields)
  c = config_dict(config)
  tensors = random_tensors(c, 3)
  bf16 = {name: t.astype(jnp.bfloat16) for name, t in tensors.items()}
  write_checkpoint(tmp_path, config, bf16, num_shards=3)
  assert safetensors_loader.checkpoint_dtype(tmp_path) == "BF16"
  assert safetensors_loader.auto_dtype(tmp_path) == jnp.float32  # CPU: float32
  model, _ = load_safetensors(tmp_path)
  assert model.embed[...].dtype == jnp.float32
  reference = reference_logits(c, {n: t.astype(np.float32) for n, t in bf16.items()}, PROMPT)
  np.testing.assert_allclose(_forward_logits(model, PROMPT)[-1], reference[-1], atol=1e-4)

  model16, _ = load_safetensors(tmp_path, dtype=jnp.bfloat16)
  assert model16.layers[0].attn.bq[...].dtype == jnp.bfloat16
  assert model16.final_norm.scale[...].dtype == jnp.float32  # norms stay float32
  logits16 = _forward_logits(model16, PROMPT)[-1]
  assert np.abs(logits16 - reference[-1]).max() < 0.1 * np.abs(reference[-1]).max()


@pytest.mark.parametrize(
  "fields, message",
  [
    (dict(architectures=["GPT2LMHeadModel"]), "unsupported architecture 'GPT2LMHeadModel'"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "unsupported rope type 'yarn'"),
    (dict(rope_scaling={"type": "linear", "factor": 2.0}), "unsupported rope type 'linear'"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "low_freq_factor"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(architectures=["Qwen2ForCausalLM"], use_sliding_window=True), "use_sliding_window"),
  ],
)
def test_unsupported_configs_are_refused_before_reading_weights(tmp_path, fields, message):
  config = {**config_dict(hf_config("LlamaForCausalLM")), **fields}
  config.pop("rope_parameters")
  (tmp_path / "config.json").write_text(json.dumps(config))  # and no weights at all
  with pytest.raises(ValueError, match=message):
    je.LLM(tmp_path)


def test_transformers_4_config_style_reads_the_same():
  c = config_dict(hf_config("LlamaForCausalLM", rope_scaling={**LLAMA3_ROPE, "rope_theta": 5e5}))
  assert c["rope_parameters"]["rope_theta"] == 5e5
  old_style = {k: v for k, v in c.items() if k != "rope_parameters"}
  rope = {k: v for k, v in c["rope_parameters"].items() if k != "rope_theta"}
  old_style.update(rope_theta=5e5, rope_scaling=rope, eos_token_id=[2, 7], torch_dtype="bfloat16")
  config = config_from_hf(old_style)
  assert config == config_from_hf(c)
  assert config.rope_theta == 5e5 and config.eos_token_id == 2
  assert config.rope_scaling.original_max_position_embeddings == 32


def test_checkpoint_problems_name_the_tensor(tmp_path):
  fields = dict(CASES["llama"])
  config = hf_config(fields.pop("architecture"), **fields)
  tensors = random_tensors(config_dict(config))
  bad = "model.layers.1.mlp.up_proj.weight"
  cases = {
    "missing": ({n: t for n, t in tensors.items() if n != bad}, f"lacks '{bad}'"),
    "extra": ({**tensors, "model.layers.0.mlp.extra": tensors[bad]}, "model.layers.0.mlp.extra"),
    "shape": ({**tensors, bad: tensors[bad][:, :-1]}, rf"{bad} in .*: expected shape"),
    "dtype": ({**tensors, bad: tensors[bad].astype(np.int32)}, rf"{bad} in .*: dtype I32"),
  }
  for name, (checkpoint, message) in cases.items():
    write_checkpoint(tmp_path / name, config, checkpoint)
    with pytest.raises(ValueError, match=message):
      load_safetensors(tmp_path / name)


def test_corrupt_checkpoint_files_are_named(tmp_path):
  """A truncated shard, a corrupt single file, an index or config.json that does not parse:
  ValueErrors naming the file (and the line and column of the JSON), raised while the files are
  read, before any tensor is moved (safetensors' own error names no file)."""
  fields = dict(CASES["llama"])
  config = hf_config(fields.pop("architecture"), **fields)
  tensors = random_tensors(config_dict(config))
  sharded = write_checkpoint(tmp_path / "sharded", config, tensors, num_shards=2)
  shard = sharded / "model-00002-of-00002.safetensors"
  shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # an interrupted download
  with pytest.raises(ValueError, match=rf"{shard} is not a valid safetensors file \(corrupt or tr"):
    load_safetensors(sharded)
  single = write_checkpoint(tmp_path / "single", config, tensors)
  (single / "model.safetensors").write_bytes(b"\x00" * 64)
  with pytest.raises(ValueError, match=r"single/model.safetensors is not a valid safetensors"):
    load_safetensors(single)
  (sharded / "model.safetensors.index.json").write_text('{"weight_map": {"a": ')
  with pytest.raises(ValueError, match=r"index.json is not valid JSON \(.* at line 1 column 22\)"):
    load_safetensors(sharded)
  (single / "config.json").write_text('{\n  "architectures": ["LlamaForCausalLM"],,\n}')
  with pytest.raises(ValueError, match=r"single/config.json is not valid JSON \(.* line 2 col"):
    load_safetensors(single)


def test_a_tokenizer_path_and_bad_tokenizer_or_config_files(tmp_path):
  """vLLM's `LLM(model, tokenizer=PATH)` reads the directory's tokenizer; anything but a path or
  a `Tokenizer` is a TypeError. A corrupt tokenizer.json, a size field that is not an integer
  and a config.json without an architecture are ValueErrors saying so (they were transformers'
  bare JSON error, `int()`'s and "unsupported architecture 'model_type=None'")."""
  config = hf_config("LlamaForCausalLM", vocab_size=320)  # room for the byte tokenizer's 259
  model_dir = write_checkpoint(tmp_path / "model", config, random_tensors(config_dict(config)))
  tokenizer_dir = tmp_path / "tokenizer"
  chatml_byte_tokenizer().hf_tokenizer.save_pretrained(tokenizer_dir)
  llm = one_shape(je.LLM(model_dir, tokenizer=str(tokenizer_dir), max_num_reqs=1, max_model_len=32))
  assert llm.get_tokenizer().vocab_size == chatml_byte_tokenizer().vocab_size
  (out,) = llm.generate("Hi", je.SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
  assert out.prompt_token_ids == llm.get_tokenizer().encode("Hi") and out.outputs[0].text
  with pytest.raises(TypeError, match=r"tokenizer must be a jaxengine\.Tokenizer or a tokenizer"):
    je.LLM(model_dir, tokenizer=3, max_model_len=32)
  (model_dir / "tokenizer.json").write_text("{oops")
  with pytest.raises(ValueError, match=r"tokenizer files in .*model' could not be read"):
    je.LLM(model_dir, max_model_len=32)
  (model_dir / "tokenizer.json").unlink()
  fields = config_dict(config)
  (model_dir / "config.json").write_text(json.dumps({**fields, "hidden_size": "abc"}))
  with pytest.raises(ValueError, match=r"config.json: hidden_size must be an integer, got 'abc'"):
    je.LLM(model_dir, max_model_len=32)
  del fields["architectures"], fields["model_type"]
  (model_dir / "config.json").write_text(json.dumps(fields))
  with pytest.raises(ValueError, match="has neither 'architectures' nor 'model_type'"):
    je.LLM(model_dir, max_model_len=32)


def test_paths_that_are_not_models_are_refused(tmp_path):
  with pytest.raises(FileNotFoundError, match="no file or directory"):
    je.LLM(tmp_path / "nope" / "model.gguf")
  with pytest.raises(FileNotFoundError, match=r"has no config\.json"):
    je.LLM(tmp_path)
  (tmp_path / "weights.bin").write_bytes(b"not a model")
  with pytest.raises(ValueError, match="is not a valid GGUF file"):
    je.LLM(tmp_path / "weights.bin")
  (tmp_path / "config.json").write_text(json.dumps(config_dict(hf_config("LlamaForCausalLM"))))
  with pytest.raises(FileNotFoundError, match=r"no model.safetensors or model.safetensors.index"):
    je.LLM(tmp_path)
  with pytest.raises(ValueError, match="dtype must be one of"):
    je.LLM(tmp_path, dtype="float8")


def test_float16_weights_load_and_generate_on_cpu(tmp_path):
  """vLLM's dtype="float16": weights and KV cache in float16, computed on the CPU too; the
  greedy tokens are the float64 reference's on the float16-rounded weights."""
  c, tensors = _checkpoint(tmp_path, "qwen2_tied")
  llm = one_shape(je.LLM(tmp_path, dtype="float16", max_num_reqs=2, max_model_len=32))
  model = llm.llm_engine.runner.model
  assert model.layers[0].attn.wq[...].dtype == jnp.float16
  assert model.final_norm.scale[...].dtype == jnp.float32  # norms stay float32
  pages = [x for x in jax.tree.leaves(llm.llm_engine.runner.kv_cache) if x.dtype.kind == "f"]
  assert pages and all(x.dtype == jnp.float16 for x in pages)
  params = je.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
  (out,) = llm.generate(PROMPT, params, use_tqdm=False)
  rounded = {name: t.astype(np.float16).astype(np.float32) for name, t in tensors.items()}
  assert _tokens(out) == reference_greedy(c, rounded, PROMPT, 6)
  assert all(math.isfinite(e.logprob) for step in out.outputs[0].logprobs for e in step.values())
  # A finite float32 value beyond float16's range would load as inf: refused, nothing changed,
  # by checkpoint name (and NNX path) and in a whole state alike.
  runner = llm.llm_engine.runner
  before = jax.tree.leaves(runner.weights)
  name = "model.layers.0.mlp.up_proj.weight"
  big = np.full_like(tensors[name], 1e5)
  with pytest.raises(ValueError, match=r"model.layers.0.mlp.up_proj.weight .*overflows"):
    llm.load_weights([(name, big)])
  state = nnx.state(model)
  state["layers"][0]["mlp"]["w_up"] = nnx.Param(jnp.full(big.shape, 1e5, jnp.float32))
  with pytest.raises(ValueError, match=r"\(layers.0.mlp.w_up\) overflows the engine's weight"):
    llm.load_weights(state)
  assert all(a is b for a, b in zip(jax.tree.leaves(runner.weights), before))
  assert (
    llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids == out.outputs[0].token_ids
  )


def test_generation_config_eos_ids_stop_like_vllm(tmp_path):
  c, tensors = _checkpoint(tmp_path / "plain", "qwen2_tied")
  expected = reference_greedy(c, tensors, PROMPT, 6)
  stop = expected[2]
  assert stop not in expected[:2]
  fields = dict(CASES["qwen2_tied"])
  config = hf_config(fields.pop("architecture"), **fields)
  write_checkpoint(tmp_path / "eos", config, tensors, generation_eos=[127, stop])
  llm = one_shape(je.LLM(tmp_path / "eos", max_num_reqs=2, max_model_len=32))
  params = je.SamplingParams(temperature=0, max_tokens=6)
  stopped, ignored, deferred = llm.generate(
    [PROMPT] * 3,
    [params, params.replace(ignore_eos=True), params.replace(min_tokens=4)],
    use_tqdm=False,
  )
  assert _tokens(stopped) == expected[:3]
  assert (stopped.outputs[0].finish_reason, stopped.outputs[0].stop_reason) == ("stop", stop)
  assert _tokens(ignored) == expected
  assert len(_tokens(deferred)) > 3  # never before min_tokens


# --------------------------------------------------------------------------- hub ids


@pytest.fixture
def no_network(monkeypatch):
  """Hub offline mode on, and any socket connection attempt recorded and refused."""
  import huggingface_hub.constants

  monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  attempts = []

  def refuse(self, address):
    attempts.append(address)
    raise OSError("network access in a test")

  monkeypatch.setattr(socket.socket, "connect", refuse)
  yield attempts
  assert attempts == []


def test_hub_id_resolves_from_the_local_cache_offline(tmp_path, no_network):
  commit = "0123456789abcdef0123456789abcdef01234567"
  repo = tmp_path / "hub" / "models--tiny-org--tiny-qwen3"
  c, tensors = _checkpoint(repo / "snapshots" / commit, "qwen3_head_dim")
  (repo / "refs").mkdir()
  (repo / "refs" / "main").write_text(commit)

  # the engine of test_checkpoint_matches_float64_reference[qwen3_head_dim]: its compiles again
  hub = str(tmp_path / "hub")
  llm = one_shape(je.LLM("tiny-org/tiny-qwen3", download_dir=hub, max_num_reqs=2, max_model_len=32))
  (out,) = llm.generate(PROMPT, GREEDY, use_tqdm=False)
  assert _tokens(out) == reference_greedy(c, tensors, PROMPT, GREEDY.max_tokens)
  with pytest.raises(FileNotFoundError, match=r"'tiny-org/absent'.*neither in the local cache"):
    je.LLM("tiny-org/absent", download_dir=hub)


# --------------------------------------------------------------------------- load_weights


@pytest.fixture(scope="module")
def qwen2_llm(tmp_path_factory):
  directory = tmp_path_factory.mktemp("qwen2")
  _, tensors = _checkpoint(directory, "qwen2_tied", seed=5)
  # test_checkpoint_matches_float64_reference[qwen2_tied]'s engine: its compiles again
  llm = one_shape(je.LLM(directory, max_num_reqs=2, max_model_len=32))
  return llm, directory, tensors


LOGPROBS = je.SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True)


def _run(llm):
  (out,) = llm.generate(PROMPT, LOGPROBS, use_tqdm=False)
  return _tokens(out), [e[t].logprob for t, e in zip(_tokens(out), out.outputs[0].logprobs)]


def test_load_weights_changes_outputs_and_restores_them_without_compiling(
  qwen2_llm, compile_counter
):
  llm, _, tensors = qwen2_llm
  baseline = _run(llm)  # compiles the model's steps
  compile_counter.reset()
  llm.load_weights(tensors)  # the whole checkpoint, NumPy: converted on the host
  assert _run(llm) == baseline
  assert compile_counter.count == 0

  name = "model.layers.0.mlp.down_proj.weight"
  bias = "model.layers.1.self_attn.k_proj.bias"
  zeros = np.zeros_like(tensors[name])
  bias_bf16 = jnp.asarray(tensors[bias], jnp.bfloat16)  # a JAX array of another dtype
  bias_zeros = jnp.zeros_like(bias_bf16)
  # Updating some layers of a stacked leaf runs one small scatter, compiled once per leaf shape.
  llm.load_weights([(name, tensors[name]), (bias, bias_bf16)])
  llm.load_weights(tensors)  # bias_bf16 was rounded: the exact checkpoint again
  compile_counter.reset()
  llm.load_weights({name: zeros})
  changed = _run(llm)
  assert changed[1] != baseline[1]
  llm.load_weights([(name, tensors[name])])
  assert _run(llm) == baseline  # exactly
  llm.load_weights({bias: bias_zeros})
  assert _run(llm)[1] != baseline[1]
  llm.load_weights(tensors)
  assert _run(llm) == baseline
  assert compile_counter.count == 0


def test_load_weights_refuses_bad_input_and_changes_nothing(qwen2_llm):
  llm, _, tensors = qwen2_llm
  runner = llm.llm_engine.runner
  before = jax.tree.leaves(runner.weights)
  baseline = _run(llm)
  name = "model.layers.1.self_attn.q_proj.weight"
  zeros = np.zeros_like(tensors[name])
  bad = [
    ({"model.layers.7.self_attn.q_proj.weight": zeros}, "unknown weight name 'model.layers.7"),
    ({"layers.0.attn.wq": zeros}, "unknown weight name 'layers.0.attn.wq'"),
    ([(name, zeros), (name, zeros)], f"weight '{name}' is given twice"),
    ({name: zeros[:, :10]}, rf"{name}: expected shape \(64, 64\), got \(64, 10\)"),
    ({name: zeros.astype(np.int8)}, f"{name}: expected a floating-point array, got dtype int8"),
    ({name: zeros.tolist()}, f"{name}: expected a NumPy or JAX array, got list"),
    ([("model.norm.weight",)], "pairs or a mapping"),
  ]
  for weights, message in bad:
    # A valid tensor first: it must not be applied when a later one is refused.
    valid = [("model.embed_tokens.weight", np.zeros_like(tensors["model.embed_tokens.weight"]))]
    items = list(weights.items()) if isinstance(weights, dict) else weights
    with pytest.raises(ValueError, match=message):
      llm.load_weights(valid + items)
    assert all(a is b for a, b in zip(jax.tree.leaves(runner.weights), before))
  for not_weights in (5, None, "model.norm.weight"):
    with pytest.raises(ValueError, match="weights must be a mapping or an iterable"):
      llm.load_weights(not_weights)  # type: ignore[arg-type]
  assert _run(llm) == baseline


def test_load_weights_refuses_nonfinite_weights_and_changes_nothing(qwen2_llm, compile_counter):
  """A diverged optimizer step (NaN or inf weights) is refused, naming the tensor by its
  checkpoint name, before anything is written: the model is exactly as it was."""
  llm, directory, tensors = qwen2_llm
  runner = llm.llm_engine.runner
  baseline = _run(llm)
  before = jax.tree.leaves(runner.weights)
  name = "model.layers.1.mlp.down_proj.weight"
  nan = tensors[name].copy()
  nan[3, 5] = np.nan
  inf = jnp.asarray(tensors[name]).at[0, 0].set(-jnp.inf)
  valid = [("model.embed_tokens.weight", np.zeros_like(tensors["model.embed_tokens.weight"]))]
  embed = np.full_like(tensors["model.embed_tokens.weight"], np.inf)
  # A whole state (a trainer's module) names the leaf by its checkpoint name and its NNX path.
  state = nnx.state(load_safetensors(directory)[0])
  state["layers"][0]["mlp"]["w_up"] = nnx.Param(jnp.full((96, 64), jnp.nan))
  compile_counter.reset()
  for bad in (nan, inf, nan.astype(np.float16)):
    with pytest.raises(ValueError, match=rf"weight {name} holds NaN or infinite values, as after"):
      llm.load_weights([*valid, (name, bad)])
    assert all(a is b for a, b in zip(jax.tree.leaves(runner.weights), before))
  with pytest.raises(ValueError, match=r"model.embed_tokens.weight holds .*\(and 1 more tensors\)"):
    llm.load_weights({**tensors, "model.embed_tokens.weight": embed, name: nan})
  with pytest.raises(
    ValueError, match=r"weight model.layers.0.mlp.up_proj.weight \(layers.0.mlp.w_up\) holds NaN"
  ):
    llm.load_weights(state)
  assert all(a is b for a, b in zip(jax.tree.leaves(runner.weights), before))
  assert compile_counter.count == 0  # on CPU the check reads the arrays on the host
  assert _run(llm) == baseline


def test_nonfinite_check_on_accelerator_arrays_compiles_once_per_shape(monkeypatch):
  """Off the CPU the check runs where the arrays are (forced here): one small reduction per
  shape, reused on every later call; only bools come to the host, even under a transfer guard."""
  monkeypatch.setattr(weights_module, "_on_host", lambda tensor: isinstance(tensor, np.ndarray))
  arrays = [("a", jnp.ones((7, 3))), ("b", jnp.ones((7, 3)).at[2, 1].set(jnp.nan))]
  arrays += [("c", np.full(4, np.inf, np.float32)), ("d", jnp.arange(5)), ("e", jnp.ones(11))]
  assert weights_module.nonfinite_tensors(arrays) == ["b", "c"]
  with count_compiles() as compiles, jax.transfer_guard("disallow_explicit"):
    assert weights_module.nonfinite_tensors(arrays[::-1]) == ["c", "b"]
  assert compiles.count == 0


def test_load_weights_takes_a_whole_nnx_state(qwen2_llm):
  llm, directory, tensors = qwen2_llm
  baseline = _run(llm)
  trainer_model, _ = load_safetensors(directory)  # the trainer's copy of the same module
  for layer in trainer_model.layers:
    layer.mlp.w_up[...] = layer.mlp.w_up[...] * 0.5
  llm.load_weights(nnx.state(trainer_model))
  halved = _run(llm)
  assert halved[1] != baseline[1]
  assert halved[0] == _tokens(
    one_shape(je.LLM(trainer_model, max_num_reqs=2, max_model_len=32)).generate(  # qwen2_llm's
      PROMPT, LOGPROBS, use_tqdm=False
    )[0]
  )
  # Named tensors from the module (the inverse mapping) give the checkpoint back exactly.
  restored, _ = load_safetensors(directory)
  exported = {name: np.asarray(a) for name, a in named_weights(restored)}
  assert exported.keys() == tensors.keys() - {"lm_head.weight"}
  for name, array in exported.items():
    np.testing.assert_array_equal(array, tensors[name], err_msg=name)
  llm.load_weights(trainer_model)  # a module works as its state
  assert _run(llm) == halved
  llm.load_weights(nnx.to_pure_dict(nnx.state(restored)))  # and so does its pure dict
  assert _run(llm) == baseline

  wrong = nnx.state(restored)
  wrong["layers"][1]["mlp"]["w_up"] = nnx.Param(jnp.zeros((64, 7)))
  with pytest.raises(ValueError, match=r"layers\.1\.mlp\.w_up: expected shape \(96, 64\)"):
    llm.load_weights(wrong)
  partial = nnx.state(restored)
  del partial["layers"][1]["mlp"]
  with pytest.raises(
    ValueError, match=r"the given weights are missing leaf 'layers\.1\.mlp\.w_down'"
  ):
    llm.load_weights(partial)
  assert _run(llm) == baseline


# --------------------------------------------------------------------------- your own model


class MeanOfEmbeddings(nnx.Module):
  """A toy model of one's own: logits from the mean embedding of every token so far.

  Its one layer hands each token's embedding to the attention seam as key and value with a zero
  query, so every visible position scores alike and the output is the mean of the embeddings up
  to each position: a model of one's own with no cache code, enough to exercise the interface.
  """

  def __init__(self, vocab_size: int, dim: int, *, rngs: nnx.Rngs):
    self.embed = nnx.Param(jax.random.normal(rngs.params(), (vocab_size, dim)))
    self.out = nnx.Param(jax.random.normal(rngs.params(), (dim, vocab_size)))

  vocab_size = property(lambda self: self.out.shape[1])
  eos_token_id = None
  max_position_embeddings = 64
  kv_cache_spec = property(lambda self: KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8))

  def __call__(self, token_ids, positions, kv_cache, attn_metadata):
    x = jnp.take(self.embed[...], token_ids, axis=0, mode="clip")[..., None, :]  # [1, T, 1, 8]
    mean, kv_cache = attention(jnp.zeros_like(x), x, x, kv_cache, 0, attn_metadata, scale=1.0)
    return mean[..., 0, :], kv_cache

  def compute_logits(self, hidden):
    return hidden @ self.out[...]


def test_your_own_nnx_model_generates_and_takes_weights():
  model = MeanOfEmbeddings(32, 8, rngs=nnx.Rngs(0))
  embed, out = np.asarray(model.embed[...]), np.asarray(model.out[...])
  prompt = [3, 9, 27, 1]
  expected = list(prompt)
  for _ in range(6):
    expected.append(int(np.argmax(embed[expected].mean(0) @ out)))
  llm = one_shape(je.LLM(model, max_num_reqs=2, max_model_len=16))
  params = je.SamplingParams(temperature=0, max_tokens=6)
  first, second = llm.generate([prompt, [5, 5]], params, use_tqdm=False)
  assert _tokens(first) == expected[len(prompt) :]

  # The engine holds its own references: changing the module does not reach it by itself.
  model.out[...] = jnp.zeros_like(model.out[...])
  assert _tokens(llm.generate(prompt, params, use_tqdm=False)[0]) == _tokens(first)
  model.out[...] = jnp.asarray(out)
  # Without weight_specs, names are the model's dotted NNX paths.
  llm.load_weights({"out": np.zeros_like(out)})
  assert _tokens(llm.generate(prompt, params, use_tqdm=False)[0]) == [0] * 6  # all ties: id 0
  with pytest.raises(ValueError, match=r"unknown weight name 'lm_head\.weight'"):
    llm.load_weights({"lm_head.weight": out})
  llm.load_weights(nnx.state(model))
  again, again_second = llm.generate([prompt, [5, 5]], params, use_tqdm=False)
  assert (_tokens(again), _tokens(again_second)) == (_tokens(first), _tokens(second))


def test_numpy_weights_of_new_shapes_compile_nothing(compile_counter):
  # Shapes no other test uses, so no staging executable of an earlier test hides a compile.
  model, other = (MeanOfEmbeddings(37, 8, rngs=nnx.Rngs(seed)) for seed in (0, 1))
  llm = one_shape(je.LLM(model, max_num_reqs=2, max_model_len=16))
  params = je.SamplingParams(temperature=0, max_tokens=4)
  generate = lambda: _tokens(llm.generate([3, 9, 27], params, use_tqdm=False)[0])
  before = generate()
  compile_counter.reset()
  llm.load_weights({"embed": np.asarray(other.embed[...]), "out": np.asarray(other.out[...])})
  generate()
  llm.load_weights(nnx.to_pure_dict(nnx.state(jax.tree.map(np.asarray, nnx.state(model)))))
  assert generate() == before
  assert compile_counter.count == 0


class MixedMeanOfEmbeddings(MeanOfEmbeddings):
  """The toy model with two mixing matrices stacked in one ``[2, 8, 8]`` leaf, as a model that
  scans over its layers holds them, and checkpoint-style names for its weights."""

  def __init__(self, vocab_size: int, dim: int, *, rngs: nnx.Rngs):
    super().__init__(vocab_size, dim, rngs=rngs)
    self.mix = nnx.Param(jax.random.normal(rngs.params(), (2, dim, dim)) * dim**-0.5)

  def compute_logits(self, hidden):
    mix = self.mix[...]
    return hidden @ mix[0] @ mix[1] @ self.out[...]

  def weight_specs(self):
    dim, vocab_size = self.out.shape
    return [
      WeightSpec("embed.weight", ("embed",), None, (vocab_size, dim)),
      WeightSpec("head.weight", ("out",), None, (vocab_size, dim), transpose=True),
      *(WeightSpec(f"mix.{i}.weight", ("mix",), i, (dim, dim), transpose=True) for i in (0, 1)),
    ]


def _mixed_greedy(model, prompt, num_tokens):
  embed, out = np.asarray(model.embed[...]), np.asarray(model.out[...])
  mix = np.asarray(model.mix[...])
  ids = list(prompt)
  for _ in range(num_tokens):
    ids.append(int(np.argmax(embed[ids].mean(0) @ mix[0] @ mix[1] @ out)))
  return ids[len(prompt) :]


def test_your_own_weight_specs_fill_layers_of_a_stacked_leaf():
  model = MixedMeanOfEmbeddings(32, 8, rngs=nnx.Rngs(1))
  other = MixedMeanOfEmbeddings(32, 8, rngs=nnx.Rngs(2))
  prompt, params = [3, 9, 27, 1], je.SamplingParams(temperature=0, max_tokens=6)
  llm = one_shape(je.LLM(model, max_num_reqs=2, max_model_len=16))
  generate = lambda: _tokens(llm.generate(prompt, params, use_tqdm=False)[0])
  assert generate() == _mixed_greedy(model, prompt, 6)

  exported = dict(named_weights(model))  # checkpoint layout: mix.i.weight is mix[i] transposed
  np.testing.assert_array_equal(exported["mix.1.weight"], np.asarray(model.mix[...][1]).T)
  np.testing.assert_array_equal(exported["head.weight"], np.asarray(model.out[...]).T)

  # One layer of the stacked leaf, from NumPy: the other layer keeps its values.
  new_mix = np.asarray(other.mix[...][1])
  llm.load_weights({"mix.1.weight": new_mix.T})
  model.mix[...] = model.mix[...].at[1].set(new_mix)
  assert generate() == _mixed_greedy(model, prompt, 6)
  # Every tensor of another model, as JAX arrays in checkpoint layout.
  llm.load_weights(named_weights(other))
  assert generate() == _mixed_greedy(other, prompt, 6)
  with pytest.raises(ValueError, match=r"mix\.0\.weight: expected shape \(8, 8\), got \(8, 4\)"):
    llm.load_weights({"mix.0.weight": np.zeros((8, 4), np.float32)})


# --------------------------------------------------------------------------- logprobs


def _teacher_forced_log_softmax(model, token_ids) -> np.ndarray:
  """``[T, V]`` float64 log-softmax of one prefill of `token_ids` by the same model."""
  logits = _forward_logits(model, token_ids).astype(np.float64)
  shifted = logits - logits.max(-1, keepdims=True)
  return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def test_raw_logprobs_equal_teacher_forced_log_softmax():
  model, _ = tiny_llama(seed=4, vocab_size=96)
  llm = one_shape(je.LLM(model, max_num_reqs=4, max_model_len=32))
  prompt = [11, 5, 42, 7, 60]
  params = je.SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=8, logprobs=0)
  (out,) = llm.generate(prompt, params, use_tqdm=False)
  assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # four different samples
  for completion in out.outputs:
    tokens = completion.token_ids
    log_probs = _teacher_forced_log_softmax(model, prompt + tokens[:-1])
    forced = [log_probs[len(prompt) - 1 + t, token] for t, token in enumerate(tokens)]
    engine = [entries[token].logprob for token, entries in zip(tokens, completion.logprobs)]
    np.testing.assert_allclose(engine, forced, atol=1e-4, rtol=0)
    assert completion.cumulative_logprob == pytest.approx(sum(forced), abs=1e-3)


def test_processed_logprobs_are_those_of_the_distribution_sampled_from():
  model, _ = tiny_llama(seed=4, vocab_size=96)
  llm = one_shape(
    je.LLM(model, max_num_reqs=4, max_model_len=32, logprobs_mode="processed_logprobs")
  )
  prompt, temperature, top_k = [11, 5, 42, 7, 60], 0.7, 5
  params = je.SamplingParams(
    n=2, temperature=temperature, top_k=top_k, seed=9, max_tokens=6, logprobs=top_k
  )
  (out,) = llm.generate(prompt, params, use_tqdm=False)
  for completion in out.outputs:
    tokens = completion.token_ids
    logits = _forward_logits(model, prompt + tokens[:-1]).astype(np.float64)
    for t, (token, entries) in enumerate(zip(tokens, completion.logprobs)):
      scaled = logits[len(prompt) - 1 + t] / temperature
      kept = scaled >= np.sort(scaled)[-top_k]
      log_z = math.log(np.exp(scaled[kept]).sum())
      assert entries[token].logprob == pytest.approx(scaled[token] - log_z, abs=1e-4)
      # The top 5 entries are exactly the kept tokens, and their probabilities sum to one.
      assert set(entries) == set(np.flatnonzero(kept).tolist())
      assert sum(math.exp(e.logprob) for e in entries.values()) == pytest.approx(1.0, abs=1e-4)


# --------------------------------------------------------------------------- SmolLM2


def _smollm2_as_hf_directory(directory: Path) -> None:
  """Writes the installed SmolLM2 GGUF file as a Hugging Face directory (float32, 2 shards).

  GGUF matrices are already ``(out, in)``; the query and key rows are put back from GGUF's
  interleaved rotary order into Hugging Face's half-split order.
  """
  path = gguf_loader.default_model_path()
  reader = gguf_loader.open_gguf(path)
  cfg = gguf_loader.read_config(reader)
  by_name = {t.name: t for t in reader.tensors}

  def get(name):
    return gguf_loader._dequantize(by_name[name])

  tensors = {"model.embed_tokens.weight": get("token_embd.weight")}
  tensors["model.norm.weight"] = get("output_norm.weight")
  hf_names = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
  }
  for i in range(cfg.num_hidden_layers):
    for gguf_name, hf_name in hf_names.items():
      tensors[f"model.layers.{i}.{hf_name}.weight"] = get(f"blk.{i}.{gguf_name}.weight")
    for gguf_name, hf_name, heads in (
      ("attn_q", "q_proj", cfg.num_attention_heads),
      ("attn_k", "k_proj", cfg.num_key_value_heads),
    ):
      weight = unpermute_rotary_rows(get(f"blk.{i}.{gguf_name}.weight"), heads)
      tensors[f"model.layers.{i}.self_attn.{hf_name}.weight"] = weight
  config = transformers.LlamaConfig(
    vocab_size=cfg.vocab_size,
    hidden_size=cfg.hidden_size,
    intermediate_size=cfg.intermediate_size,
    num_hidden_layers=cfg.num_hidden_layers,
    num_attention_heads=cfg.num_attention_heads,
    num_key_value_heads=cfg.num_key_value_heads,
    head_dim=cfg.head_dim,
    rope_theta=cfg.rope_theta,
    rms_norm_eps=cfg.rms_norm_eps,
    max_position_embeddings=cfg.max_position_embeddings,
    tie_word_embeddings=True,
    bos_token_id=cfg.bos_token_id,
    eos_token_id=cfg.eos_token_id,
  )
  config.architectures = ["LlamaForCausalLM"]
  write_checkpoint(directory, config, tensors, num_shards=2, generation_eos=[cfg.eos_token_id])
  Tokenizer.from_gguf(path).hf_tokenizer.save_pretrained(directory)


@jax.default_matmul_precision("highest")
def test_smollm2_from_safetensors_gives_the_reference_tokens(tmp_path):
  _smollm2_as_hf_directory(tmp_path)
  assert (tmp_path / "model.safetensors.index.json").is_file()
  assert (tmp_path / "chat_template.jinja").is_file()
  fixture = json.loads((FIXTURES / "smollm2_greedy.json").read_text())
  llm = je.LLM(tmp_path, max_num_reqs=2, max_model_len=64)
  params = je.SamplingParams(temperature=0, max_tokens=20)
  (out,) = llm.generate(fixture["prompt"], params, use_tqdm=False)
  assert out.prompt_token_ids == fixture["prompt_ids"]
  assert _tokens(out) == fixture["new_ids"]
  assert out.prompt + out.outputs[0].text == fixture["text"]
  tokenizer = llm.get_tokenizer()
  assert tokenizer.eos_token_id == 2 and "<|im_start|>" in tokenizer.chat_template
  (reply,) = llm.chat([{"role": "user", "content": "Hi"}], params, use_tqdm=False)
  assert reply.prompt.startswith("<|im_start|>")

  # The whole model handed over by name (as a trainer would) changes nothing.
  llm.load_weights(safetensors.numpy.load_file(tmp_path / "model-00001-of-00002.safetensors"))
  assert _tokens(llm.generate(fixture["prompt"], params, use_tqdm=False)[0]) == fixture["new_ids"]
