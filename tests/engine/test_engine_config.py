"""`EngineConfig`: one validated config for `LLM`, `LLMEngine` and the command's flags."""

from __future__ import annotations

import dataclasses
import functools
import inspect

import hf_checkpoints
import jax.numpy as jnp
import pytest

import jaxengine as je
from jaxengine.cli.main import build_parser
from jaxengine.engine import EngineConfig, LLMEngine
from jaxengine.engine.engine_flags import ENGINE_FLAGS, engine_flag_options, engine_options
from jaxengine.engine_config import engine_config
from jaxengine.spec_decode.config import SpeculativeConfig
from jaxengine.testing import TargetOnly, tiny_llama
from jaxengine.vllm_names import VLLM_NAMES

SPEC = {"method": "ngram", "num_speculative_tokens": 2}


@pytest.mark.parametrize(
  "options, message",
  [
    ({"max_num_reqs": 0}, "max_num_reqs must be a positive int, got 0"),
    ({"max_model_len": "64"}, "max_model_len must be a positive int or None, got '64'"),
    ({"max_model_len": True}, "max_model_len must be a positive int or None, got True"),
    ({"dtype": "float8"}, "dtype must be one of .*, got 'float8'"),
    ({"dtype": jnp.int8}, "dtype must be float32, bfloat16 or float16"),
    ({"seed": 2**63}, r"seed must be an int in \[-2\*\*63, 2\*\*63\)"),
    ({"max_num_logprobs": -2}, "max_num_logprobs must be >= 0 or -1"),
    ({"logprobs_mode": "logits"}, "logprobs_mode must be one of .*, got 'logits'"),
    ({"revision": 3}, "revision must be a str, got 3"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size must be a positive int, got 0"),
    ({"data_parallel_size": 1.5}, "data_parallel_size must be a positive int, got 1.5"),
    ({"mesh": "mesh"}, "mesh must be a jax.sharding.Mesh, got str"),
    ({"compilation_cache": 3}, "compilation_cache must be True, False or a directory"),
    ({"precompile": "yes"}, "precompile must be a bool, got 'yes'"),
    ({"num_decode_steps": 0}, "num_decode_steps must be an int >= 1, got 0"),
    ({"block_size": None}, "block_size must be an int >= 1, got None"),
    ({"batch_invariant": 1}, "batch_invariant must be a bool, got 1"),
    ({"enforce_eager": "yes"}, "enforce_eager must be a bool, got 'yes'"),
    ({"trust_remote_code": None}, "trust_remote_code must be a bool, got None"),
    ({"logits_processors": [42]}, "logits_processors entries must be"),
    ({"speculative_config": {"method": "eagle"}}, "speculative_config: method must be"),
    (
      {"speculative_config": {**SPEC, "num_speculative_tokens": 64}, "max_model_len": 64},
      "num_speculative_tokens=64 must be below max_model_len=64",
    ),
    ({"enable_prefix_caching": "yes"}, "enable_prefix_caching must be a bool or None, got 'yes'"),
    ({"gpu_memory_utilization": 0}, r"gpu_memory_utilization must be a float in \(0, 1\], got 0"),
    ({"gpu_memory_utilization": True}, "gpu_memory_utilization must be a float"),
  ],
)
def test_each_bad_option_is_refused_by_name_before_any_model_loads(options, message, tmp_path):
  with pytest.raises(ValueError, match=message):
    EngineConfig(**options)
  # The same refusal from LLM, before it looks for the (missing) model file.
  with pytest.raises(ValueError, match=message):
    je.LLM(tmp_path / "missing.gguf", **options)


def test_mesh_settings_that_do_not_go_together_are_refused():
  mesh = je.make_mesh(1, 1)
  with pytest.raises(ValueError, match="give either mesh or tensor_parallel_size"):
    EngineConfig(mesh=mesh, tensor_parallel_size=2)
  with pytest.raises(ValueError, match="needs 64 devices"):
    EngineConfig(tensor_parallel_size=64)
  both = EngineConfig(mesh=mesh, speculative_config=SPEC, num_kv_blocks=8, num_decode_steps=2)
  assert both.speculative is not None and both.num_decode_steps == 2  # they compose
  config = EngineConfig(mesh=mesh)
  assert EngineConfig(mesh=mesh, num_decode_steps=2).num_decode_steps == 2  # runs on a mesh
  assert (config.tensor_parallel_size, config.data_parallel_size) == (1, 1)
  assert config.prefix_caching  # on by default, on a mesh too
  for enable in (None, True):
    paged = EngineConfig(mesh=mesh, num_kv_blocks=8, enable_prefix_caching=enable)
    assert paged.prefix_caching and paged.mesh is mesh
  paged = EngineConfig(mesh=mesh, num_kv_blocks=8, speculative_config=SPEC)  # verified on a mesh
  assert paged.num_speculative_tokens == 2 and paged.mesh is mesh
  assert config.replace(max_num_reqs=4).mesh is mesh  # a replaced config keeps its mesh


def test_values_are_normalised_once_and_the_config_is_frozen():
  config = EngineConfig(
    dtype="bfloat16", speculative_config=SPEC, logits_processors=[TargetOnly], seed=-3
  )
  assert config.dtype is jnp.bfloat16
  assert config.speculative_config == SpeculativeConfig("ngram", 2, 4, 2)
  assert config.num_speculative_tokens == 2
  (processor,) = config.logits_processors
  assert isinstance(processor, TargetOnly)
  assert config.prefix_caching and EngineConfig().num_speculative_tokens == 0
  with pytest.raises(dataclasses.FrozenInstanceError):
    config.max_num_reqs = 4  # type: ignore[misc]
  with pytest.raises(ValueError, match="max_num_reqs must be a positive int, got -1"):
    config.replace(max_num_reqs=-1)  # validated again


def test_llm_and_engine_take_every_field_as_a_keyword_with_the_config_defaults():
  fields = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
  for init in (je.LLM.__init__, LLMEngine.__init__):
    parameters = inspect.signature(init).parameters
    assert {name: parameters[name].default for name in fields} == fields
    assert parameters["config"].default is None
  model, _ = tiny_llama(vocab_size=32)
  with pytest.raises(
    TypeError, match="LLMEngine\\(\\) got an unexpected keyword argument 'max_num_sequences'"
  ):
    LLMEngine(model, max_num_sequences=4)
  with pytest.raises(TypeError, match="LLM\\(\\) got an unexpected keyword argument 'swap_space'"):
    je.LLM(model, swap_space=4)


def test_vllm_keywords_enforce_eager_trust_remote_code_and_float16_are_accepted():
  """vLLM's `LLM(..., enforce_eager=True, trust_remote_code=True, dtype="float16")` works here:
  the first two are bools without effect, float16 (vLLM's "half") is a weight dtype."""
  config = EngineConfig(enforce_eager=True, trust_remote_code=True, dtype="float16")
  assert config.enforce_eager is True and config.trust_remote_code is True
  assert config.dtype is jnp.float16
  assert EngineConfig(dtype="half").dtype is jnp.float16
  assert EngineConfig(dtype="float").dtype is jnp.float32
  assert EngineConfig(dtype=jnp.float16).dtype is jnp.float16
  model, _ = tiny_llama(vocab_size=32)
  llm = je.LLM(model, enforce_eager=True, trust_remote_code=True, max_model_len=16)
  assert llm.config.enforce_eager and llm.config.trust_remote_code


def test_vllm_names_max_num_seqs_and_max_logprobs_set_their_fields():
  """vLLM's `LLM(max_num_seqs=N, max_logprobs=K)` and `--max-num-seqs` / `--max-logprobs` set
  `max_num_reqs` / `max_num_logprobs`; a vLLM name and the field with different values is a
  ValueError naming both (equal values are fine)."""
  model, _ = tiny_llama(vocab_size=32)
  llm = je.LLM(model, max_num_seqs=2, max_logprobs=5, max_model_len=16)
  assert (llm.config.max_num_reqs, llm.config.max_num_logprobs) == (2, 5)
  assert engine_config(None, {"max_num_seqs": 3, "max_num_reqs": 3}, "LLM").max_num_reqs == 3
  base = EngineConfig(max_num_reqs=8)
  assert engine_config(base, {"max_num_seqs": 4}, "LLMEngine").max_num_reqs == 4
  with pytest.raises(ValueError, match=r"max_num_seqs=4 .* max_num_reqs=8 disagree"):
    engine_config(None, {"max_num_seqs": 4, "max_num_reqs": 8}, "LLM")
  with pytest.raises(ValueError, match=r"max_logprobs=5 .* max_num_logprobs=7 disagree"):
    je.LLM(model, max_logprobs=5, max_num_logprobs=7)
  parse = build_parser().parse_args
  args = parse(["generate", "Hi", "--max-num-seqs", "4", "--max-logprobs", "7"])
  config = EngineConfig(**engine_options(args))
  assert (config.max_num_reqs, config.max_num_logprobs) == (4, 7)
  args = parse(["serve", "--max-num-seqs", "4", "--max-num-reqs", "4"])
  assert engine_flag_options(args)["max_num_reqs"] == 4
  with pytest.raises(ValueError, match=r"max_num_seqs=4 .* disagree"):
    engine_options(parse(["generate", "Hi", "--max-num-seqs", "4", "--max-num-reqs", "2"]))


def test_keywords_replace_fields_of_a_given_config():
  model, _ = tiny_llama(vocab_size=32)
  base = EngineConfig(max_num_reqs=2, max_model_len=32, block_size=4)
  engine = LLMEngine(model, config=base, max_model_len=16)
  assert engine.config == base.replace(max_model_len=16)
  assert (engine.max_num_reqs, engine.max_model_len) == (2, 16)
  assert engine.runner.max_num_blocks_per_req == 4  # 16 positions in pages of 4
  with pytest.raises(ValueError, match="config must be an EngineConfig, got dict"):
    LLMEngine(model, config={"max_num_reqs": 2})  # type: ignore[arg-type]


def test_the_command_builds_the_same_config_from_its_flag_table():
  parse = build_parser().parse_args
  fields = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
  defaults = parse(["generate", "Hi"])
  for entry in ENGINE_FLAGS:  # unset flags mean the config's own defaults
    default = getattr(defaults, entry.dest)
    field = VLLM_NAMES.get(entry.field, entry.field)
    assert default is None or default == fields[field], entry.flag
  assert EngineConfig(**engine_options(defaults)) == EngineConfig()
  args = parse(
    ["generate", "Hi", "--max-num-reqs", "4", "--max-model-len", "256", "--dtype", "bfloat16"]
    + ["--engine-seed", "7", "--no-enable-prefix-caching"]
    + ["--compilation-cache", "off", "--precompile", "--logprobs", "30", "--seed", "1"]
    + ["--num-kv-blocks", "64", "--block-size", "8", "--max-num-batched-tokens", "256"]
    + ["--no-enable-chunked-prefill", "--attention-backend", "xla"]
  )
  assert EngineConfig(**engine_options(args)) == EngineConfig(
    max_num_reqs=4,
    max_model_len=256,
    dtype="bfloat16",
    seed=7,
    enable_prefix_caching=False,
    compilation_cache=False,
    precompile=True,
    max_num_logprobs=30,
    num_kv_blocks=64,
    block_size=8,
    max_num_batched_tokens=256,
    enable_chunked_prefill=False,
    attention_backend="xla",
  )


@pytest.mark.parametrize("option", ["paged_kv_cache", "prefill_once_per_request"])
def test_the_removed_slot_cache_options_are_unknown_keywords(option):
  """Pages are the only KV layout: the slot cache's options are refused as any unknown one."""
  model, _ = tiny_llama(vocab_size=32)
  for call in (EngineConfig, functools.partial(je.LLM, model), functools.partial(LLMEngine, model)):
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{option}'"):
      call(**{option: False})
  with pytest.raises(TypeError, match=f"unexpected keyword argument '{option}'"):
    engine_config(None, {option: False}, "LLM")


@pytest.mark.parametrize(
  ("option", "hint"),
  [
    ("max_num_seq", "max_num_reqs"),
    ("max_num_logprob", "max_num_logprobs"),
    ("max_modl_len", "max_model_len"),
  ],
)
def test_an_unknown_option_names_the_field_it_may_stand_for(option, hint):
  """A misspelled option is a TypeError that suggests the field."""
  with pytest.raises(
    TypeError, match=rf"unexpected keyword argument '{option}'; did you mean '{hint}'\?"
  ):
    engine_config(None, {option: 4}, "LLM")
  with pytest.raises(TypeError, match=r"argument 'no_such_thing'$"):
    engine_config(None, {"no_such_thing": 4}, "LLM")


# --- max_model_len: the model's own limit by default ------------------------------------------


def test_max_model_len_defaults_to_the_checkpoints_limit_and_refuses_more(tmp_path):
  """vLLM's default: without `max_model_len` an engine takes the checkpoint's
  `max_position_embeddings` (256 here, below the 1024 that used to be fixed and refused this
  checkpoint), and the fields derived from it follow; more than the limit is refused naming
  both numbers, for a checkpoint and a built model alike."""
  config = hf_checkpoints.hf_config("LlamaForCausalLM", max_position_embeddings=256)
  tensors = hf_checkpoints.random_tensors(hf_checkpoints.config_dict(config))
  hf_checkpoints.write_checkpoint(tmp_path, config, tensors)
  unset = EngineConfig(max_num_reqs=2)
  assert unset.max_model_len is None and unset.max_num_batched_tokens is None
  llm = je.LLM(str(tmp_path), max_num_reqs=2)
  assert llm.llm_engine.max_model_len == llm.config.max_model_len == 256
  assert llm.config == unset.for_model(256) == unset.replace(max_model_len=256)
  assert llm.config.max_num_batched_tokens == 2 * 256  # the most one step can hold
  assert llm.llm_engine.runner.block_table.max_num_blocks_per_req == 256 // 16
  (output,) = llm.generate([[5] * 250], je.SamplingParams(max_tokens=20, ignore_eos=True))
  assert len(output.outputs[0].token_ids) == 6 and output.outputs[0].finish_reason == "length"
  with pytest.raises(ValueError, match="max_model_len=257 exceeds the model's max_position_emb"):
    je.LLM(str(tmp_path), max_model_len=257)
  model, _ = tiny_llama(vocab_size=32, max_position_embeddings=64)
  assert LLMEngine(model, max_num_reqs=2).max_model_len == 64
  with pytest.raises(ValueError, match=r"max_model_len=65 exceeds .*max_position_embeddings=64"):
    LLMEngine(model, max_num_reqs=2, max_model_len=65)
  assert build_parser().parse_args(["serve"]).max_model_len is None  # the command's default too
