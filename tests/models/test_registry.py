"""The model registry: architecture names -> config reader, module, tensor names, sharding roles.

The loaders and `jaxengine.parallel` go through it: an unknown architecture is refused naming the
known ones, the Llama relatives are routed to the one `Llama` module with their family switches,
and weights are placed by role. A family added by one module and one entry loads and serves
without touching a loader.
"""

from __future__ import annotations

import json

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxengine as je
from jaxengine import parallel
from jaxengine.models import gguf_loader, load_safetensors, registry
from jaxengine.models.attention import attention
from jaxengine.models.kv_cache import KVCacheSpec
from jaxengine.models.llama import Llama
from jaxengine.models.weights import WeightSpec
from jaxengine.testing import tiny_llama

HF_NAMES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
BASE = dict(
  vocab_size=64,
  hidden_size=16,
  intermediate_size=32,
  num_hidden_layers=1,
  num_attention_heads=4,
  num_key_value_heads=2,
  sliding_window=8,
  attention_bias=True,
)


def test_unknown_architectures_are_refused_naming_the_known_ones(tmp_path):
  with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'") as error:
    registry.hf_architecture({"architectures": ["GPT2LMHeadModel"]})
  assert all(name in str(error.value) for name in HF_NAMES)
  with pytest.raises(ValueError, match=r"model_type='gpt2'.*LlamaForCausalLM"):
    registry.hf_architecture({"model_type": "gpt2"})
  with pytest.raises(ValueError, match="unsupported GGUF architecture 'falcon'; supported: llama"):
    registry.gguf_architecture("falcon")
  # Through the loaders, before any tensor is read.
  (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
  with pytest.raises(ValueError, match="supported: LlamaForCausalLM, MistralForCausalLM"):
    load_safetensors(tmp_path)
  writer = gguf.GGUFWriter(tmp_path / "falcon.gguf", "falcon")
  writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  with pytest.raises(ValueError, match="unsupported GGUF architecture 'falcon'; supported: llama"):
    gguf_loader.load_gguf(tmp_path / "falcon.gguf")


@pytest.mark.parametrize("name", HF_NAMES)
def test_llama_relatives_are_routed_to_the_llama_module_with_their_switches(name):
  entry = registry.hf_architecture({"architectures": [name]})
  assert entry.name == name and entry.module is Llama
  config = entry.read_config({**BASE, "architectures": [name]})
  assert config.sliding_window == (8 if name == "MistralForCausalLM" else None)
  assert config.attention_bias == (name != "MistralForCausalLM")
  assert config.attention_output_bias == (name in ("LlamaForCausalLM", "Qwen3ForCausalLM"))
  assert config.qk_norm == (name == "Qwen3ForCausalLM")
  names = {spec.name for spec in entry.weight_specs(config)}
  assert ("model.layers.0.self_attn.q_norm.weight" in names) == config.qk_norm
  assert ("model.layers.0.self_attn.o_proj.bias" in names) == config.attention_output_bias
  # Without `architectures`, the model_type names the entry.
  model_type = name.removesuffix("ForCausalLM").lower()
  assert registry.hf_architecture({"model_type": model_type}) is entry


def test_sharding_rules_are_roles_and_parallel_places_by_role():
  model, _ = tiny_llama()
  rules = registry.sharding_rules(model)
  assert rules["wq"] == rules["w_up"] == registry.COLUMN_PARALLEL
  assert rules["wo"] == rules["w_down"] == registry.ROW_PARALLEL
  assert rules["embed"] == registry.VOCAB_PARALLEL and "scale" not in rules
  spec = parallel.weight_spec
  assert spec(registry.COLUMN_PARALLEL, (4, 8, 16), 2) == P("model", None, None)
  assert spec(registry.COLUMN_PARALLEL, (3, 8, 16), 2) == P()  # t does not divide the heads
  assert spec(registry.ROW_PARALLEL, (16, 4, 8), 2) == P(None, "model", None)
  assert spec(registry.VOCAB_PARALLEL, (64, 16), 4) == P("model", None)
  assert spec(registry.REPLICATED, (64, 16), 4) == P()
  assert spec(registry.COLUMN_PARALLEL, (4, 8, 16), 1) == P()
  # [X, in, out] experts split on out (gate, up) or in (down); their [X, out] scales on out only
  assert spec(registry.EXPERT_COLUMN_PARALLEL, (8, 16, 32), 2) == P(None, None, "model")
  assert spec(registry.EXPERT_ROW_PARALLEL, (8, 32, 16), 2) == P(None, "model", None)
  assert spec(registry.EXPERT_COLUMN_PARALLEL, (8, 32), 2, scale=True) == P(None, "model")
  assert spec(registry.EXPERT_ROW_PARALLEL, (8, 16), 2, scale=True) == P()
  assert spec(registry.ROW_PARALLEL, (16,), 2, scale=True) == P()
  assert spec(registry.EXPERT_ROW_PARALLEL, (8, 16), 2, expert_parallel=True, scale=True) == P(
    "model", None
  )

  class Own:
    def __init__(self, role):
      self.sharding_rules = {"mix": role}

  assert registry.sharding_rules(Own(registry.ROW_PARALLEL)) == {"mix": registry.ROW_PARALLEL}
  assert registry.sharding_rules(object()) == {}  # a model outside the registry: replicated
  with pytest.raises(ValueError, match="'mix': role 'diagonal' is not one of"):
    registry.sharding_rules(Own("diagonal"))


class Toy(nnx.Module):
  """A second family: one attention layer over embeddings, through the seam, no cache code."""

  def __init__(self, config: dict, *, dtype, rngs: nnx.Rngs):
    v, e = config["vocab_size"], config["hidden_size"]
    self.embed = nnx.Param(jax_normal(rngs, (v, e), dtype))
    self.wq = nnx.Param(jax_normal(rngs, (e, e), dtype))
    self.vocab_size, self.eos_token_id, self.max_position_embeddings = v, None, 64
    self.kv_cache_spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=e)

  def __call__(self, token_ids, positions, kv_cache, attn_metadata):
    x = jnp.take(self.embed[...], token_ids, axis=0, mode="clip")[..., None, :]  # [B, T, 1, E]
    q = x @ self.wq[...].T
    out, kv_cache = attention(q, x, x, kv_cache, 0, attn_metadata, scale=1.0)
    return out[..., 0, :], kv_cache

  def compute_logits(self, hidden):
    return hidden @ self.embed[...].T


def jax_normal(rngs, shape, dtype):
  return (np.float32(0.5) * nnx.initializers.normal(1.0)(rngs.params(), shape)).astype(dtype)


def test_a_family_added_by_one_module_and_one_entry_loads_and_generates(tmp_path, monkeypatch):
  entry = registry.ModelArchitecture(
    name="ToyForCausalLM",
    module=Toy,
    read_config=lambda hf: {"vocab_size": hf["vocab_size"], "hidden_size": hf["hidden_size"]},
    weight_specs=lambda c: [
      WeightSpec("embed.weight", ("embed",), None, (c["vocab_size"], c["hidden_size"])),
      WeightSpec("q.weight", ("wq",), None, (c["hidden_size"],) * 2),
    ],
    sharding_rules={"wq": registry.COLUMN_PARALLEL},
  )
  monkeypatch.setattr(
    registry, "HF_ARCHITECTURES", {**registry.HF_ARCHITECTURES, entry.name: entry}
  )
  rng = np.random.default_rng(0)
  tensors = {"embed.weight": rng.normal(size=(32, 8)), "q.weight": rng.normal(size=(8, 8))}
  tensors = {name: t.astype(np.float32) for name, t in tensors.items()}
  (tmp_path / "config.json").write_text(
    json.dumps({"architectures": ["ToyForCausalLM"], "vocab_size": 32, "hidden_size": 8})
  )
  safetensors.numpy.save_file(tensors, str(tmp_path / "model.safetensors"))
  model, config = load_safetensors(tmp_path)
  assert isinstance(model, Toy) and config == {"vocab_size": 32, "hidden_size": 8}
  np.testing.assert_array_equal(np.asarray(model.wq[...]), tensors["q.weight"])
  assert registry.sharding_rules(model) == {"wq": registry.COLUMN_PARALLEL}
  # Greedy tokens against NumPy: each step attends over every token so far.
  embed, wq = tensors["embed.weight"].astype(np.float64), tensors["q.weight"].astype(np.float64)
  tokens = [3, 7, 1]
  for _ in range(4):
    x = embed[tokens]
    scores = x @ (x[-1] @ wq.T)
    weights = np.exp(scores - scores.max())
    tokens.append(int(np.argmax((weights / weights.sum()) @ x @ embed.T)))
  llm = je.LLM(model, max_num_reqs=2, max_model_len=16, enable_prefix_caching=False)
  params = je.SamplingParams(temperature=0, max_tokens=4)
  out = llm.generate([{"prompt_token_ids": [3, 7, 1]}], params, use_tqdm=False)
  assert list(out[0].outputs[0].token_ids) == tokens[3:]
