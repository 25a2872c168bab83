"""Gemma 2 and Gemma 3 (text) checkpoints against transformers' own models.

Tiny random checkpoints are built and saved by transformers (`Gemma2ForCausalLM`,
`Gemma3ForCausalLM`, `Gemma3ForConditionalGeneration`), float32, with a window of 4 positions on
the local layers and prompts of 11 tokens, so the window, the two rotary bases and (where set) both
soft caps change the result. `LLM(dir)` must give transformers' greedy tokens and its prompt
logprobs within 1e-4, and `token_logprobs` the same logprobs. Nothing here touches the network.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers
from flax import nnx
from hf_reference import hf_greedy, hf_prompt_logprobs, random_peft_adapter
from paged_utils import slot_step
from step_shapes import one_shape
from subprocess_utils import HELPERS_DIR, run_python

import jaxengine as je
from jaxengine.models import PagedKVCache, safetensors_loader, sequence_logits, token_logprobs
from jaxengine.models.attention_backends import XlaAttentionBackend
from jaxengine.models.gemma import Gemma, GemmaDecoderLayer
from jaxengine.models.gemma_checkpoints import config_from_hf
from jaxengine.models.gemma_config import FULL, SLIDING, GemmaConfig, GemmaRope
from jaxengine.models.layer_scan import scan_config, scanned_model
from jaxengine.models.quantization import quantize_model
from jaxengine.models.safetensors_loader import load_safetensors
from jaxengine.models.sequence_logprobs import scratch_step
from jaxengine.models.weights import named_weights, state_leaves

pytestmark = pytest.mark.bitwise  # compares bits between programs: tests/conftest.py

TEXT = dict(
  vocab_size=96,
  hidden_size=32,
  intermediate_size=48,
  num_hidden_layers=3,
  num_attention_heads=4,
  num_key_value_heads=2,
  head_dim=16,
  max_position_embeddings=64,
  sliding_window=4,
  query_pre_attn_scalar=24,
  layer_types=["sliding_attention", "full_attention", "sliding_attention"],
)
CASES = {
  # Small caps so that capping changes the scores and logits of random weights.
  "gemma2": lambda: transformers.Gemma2Config(
    **TEXT, attn_logit_softcapping=2.0, final_logit_softcapping=3.0
  ),
  "gemma3": lambda: transformers.Gemma3TextConfig(
    **TEXT,
    rope_theta=500.0,
    rope_local_base_freq=50.0,
    rope_scaling={"rope_type": "linear", "factor": 2.0},
    final_logit_softcapping=3.0,
  ),
  "gemma3_multimodal": lambda: transformers.Gemma3Config(
    text_config=transformers.Gemma3TextConfig(**TEXT, rope_local_base_freq=50.0).to_dict(),
    vision_config=dict(
      hidden_size=16,
      intermediate_size=32,
      num_hidden_layers=1,
      num_attention_heads=2,
      image_size=28,
      patch_size=14,
    ),
    mm_tokens_per_image=4,
  ),
}
MODEL_CLASSES = {
  "gemma2": transformers.Gemma2ForCausalLM,
  "gemma3": transformers.Gemma3ForCausalLM,
  "gemma3_multimodal": transformers.Gemma3ForConditionalGeneration,
}
PROMPTS = [[5, 17, 90, 3, 64, 21, 8, 77, 33, 7, 41], [2, 9, 60, 11, 4, 4, 31, 85, 12]]
MAX_TOKENS = 6


def _randomise(model: torch.nn.Module, seed: int) -> None:
  """Weights of std ``fan_in ** -0.5`` and norm offsets of std 0.3, so that every tensor shows."""
  generator = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for param in model.parameters():
      noise = torch.randn(param.shape, generator=generator)
      scale = 0.3 if param.ndim == 1 else param.shape[-1] ** -0.5
      param.copy_(noise * scale)


def _write(directory: Path, case: str, seed: int = 0) -> torch.nn.Module:
  config = CASES[case]()
  torch.manual_seed(seed)
  model = MODEL_CLASSES[case](config).eval()
  # transformers' SDPA path drops the attention soft cap: eager is its reference for Gemma 2.
  model.set_attn_implementation("eager")
  _randomise(model, seed)
  model.save_pretrained(directory)
  return model


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
  directory = tmp_path_factory.mktemp(request.param)
  return request.param, directory, _write(directory, request.param)


def test_llm_matches_transformers_greedy_and_prompt_logprobs(checkpoint):
  _, directory, hf_model = checkpoint
  llm = one_shape(je.LLM(directory, max_num_reqs=2, max_model_len=32, block_size=4))
  params = je.SamplingParams(
    temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, prompt_logprobs=0
  )
  outputs = llm.generate(PROMPTS, params, use_tqdm=False)
  worst = 0.0
  for prompt, output in zip(PROMPTS, outputs):
    assert list(output.outputs[0].token_ids) == hf_greedy(hf_model, prompt, MAX_TOKENS)
    got = [entry[token].logprob for entry, token in zip(output.prompt_logprobs[1:], prompt[1:])]
    want = hf_prompt_logprobs(hf_model, prompt)
    worst = max(worst, float(np.abs(np.asarray(got) - want).max()))
  assert worst < 1e-4, worst


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _write_adapter(case: str, directory: Path, out: Path) -> torch.nn.Module:
  """A PEFT adapter (rank 4, rsLoRA, all seven projections, random non-zero ``lora_B``) of the
  checkpoint in `directory`, saved to `out`; returns the adapted transformers model."""
  import peft

  torch.manual_seed(5)
  model = MODEL_CLASSES[case].from_pretrained(directory, attn_implementation="eager")
  config = peft.LoraConfig(
    r=4, lora_alpha=6, target_modules=LORA_TARGETS, use_rslora=True, lora_dropout=0.0
  )
  return random_peft_adapter(model, config, out)


def test_lora_adapter_matches_transformers_with_peft(checkpoint, tmp_path):
  """A PEFT adapter on all seven projections (rank 4, rsLoRA; random non-zero ``lora_B``),
  unmerged in a LoRA engine: transformers + peft's greedy tokens and prompt logprobs within
  1e-4, for the adapter's request and the base model's in one step. The multimodal checkpoint's
  adapter wraps its vision tower's ``q_proj`` ... too: those tensors are left out (the engine
  runs text only)."""
  case, directory, hf_model = checkpoint
  adapted = _write_adapter(case, directory, tmp_path / "adapter")
  llm = je.LLM(
    directory, max_num_reqs=2, max_model_len=32, block_size=4, enable_lora=True, max_lora_rank=8
  )
  one_shape(llm)
  params = je.SamplingParams(
    temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, prompt_logprobs=0
  )
  lora = je.LoRARequest("adapter", 1, str(tmp_path / "adapter"))
  outputs = llm.generate(PROMPTS, params, lora_request=[lora, None], use_tqdm=False)
  worst = 0.0
  for model, prompt, output in zip((adapted, hf_model), PROMPTS, outputs):
    assert list(output.outputs[0].token_ids) == hf_greedy(model, prompt, MAX_TOKENS)
    got = [entry[token].logprob for entry, token in zip(output.prompt_logprobs[1:], prompt[1:])]
    worst = max(worst, float(np.abs(np.asarray(got) - hf_prompt_logprobs(model, prompt)).max()))
  assert worst < 1e-4, worst
  # The adapter changes the model (else the comparison above would prove nothing).
  base = hf_prompt_logprobs(hf_model, PROMPTS[0])
  assert np.abs(hf_prompt_logprobs(adapted, PROMPTS[0]) - base).max() > 1e-2


def test_token_logprobs_match_transformers(checkpoint):
  _, directory, hf_model = checkpoint
  model, _ = load_safetensors(directory)
  assert isinstance(model, Gemma)
  ids = jnp.asarray([PROMPTS[0]], jnp.int32)
  got = np.asarray(token_logprobs(model, ids))[0]
  np.testing.assert_allclose(got, hf_prompt_logprobs(hf_model, PROMPTS[0]), atol=1e-4)


def test_load_weights_by_checkpoint_names_compiles_nothing(tmp_path, compile_counter):
  """A Gemma3ForConditionalGeneration's text tensors under its own names
  (``language_model.model.layers.0...``) replace the weights of a scanned engine (rows of its
  ``[L, ...]`` stacks): the other checkpoint's logprobs, no compile; a whole unrolled module
  (a trainer's) loads into the stacks too."""
  _write(tmp_path / "a", "gemma3_multimodal", seed=0)
  other = _write(tmp_path / "b", "gemma3_multimodal", seed=1)
  llm = je.LLM(tmp_path / "a", max_num_reqs=1, max_model_len=32, block_size=4, scan_layers=True)
  params = je.SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
  prompt = PROMPTS[0]

  def prompt_logprobs():
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    return np.asarray([e[t].logprob for e, t in zip(out.prompt_logprobs[1:], prompt[1:])])

  before = prompt_logprobs()
  tensors = safetensors.numpy.load_file(tmp_path / "b" / "model.safetensors")
  text = {n: t for n, t in tensors.items() if n.startswith("language_model.")}
  assert text and len(text) < len(tensors)  # the vision tower's are left out
  compile_counter.reset()
  llm.load_weights(text)
  after = prompt_logprobs()
  assert compile_counter.count == 0
  np.testing.assert_allclose(after, hf_prompt_logprobs(other, prompt), atol=1e-4)
  assert np.abs(after - before).max() > 1e-2
  unrolled, _ = load_safetensors(tmp_path / "a")
  llm.load_weights(unrolled)  # checked per layer, then stacked
  np.testing.assert_array_equal(prompt_logprobs(), before)
  got = dict(named_weights(llm.llm_engine.runner.model))
  for name, tensor in named_weights(unrolled):
    np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(tensor), err_msg=name)


def test_batch_invariant_engine_equals_token_logprobs_bit_for_bit(checkpoint):
  """``LLM(..., batch_invariant=True)``'s prompt logprobs are `token_logprobs`' bits (windows
  and soft caps in the fixed-order XLA path too)."""
  _, directory, _ = checkpoint
  llm = je.LLM(directory, max_num_reqs=2, max_model_len=32, batch_invariant=True)
  params = je.SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
  outputs = llm.generate(PROMPTS, params, use_tqdm=False)
  model, _ = load_safetensors(directory)
  for prompt, output in zip(PROMPTS, outputs):
    want = np.asarray(token_logprobs(model, jnp.asarray([prompt], jnp.int32)))[0]
    got = [e[t].logprob for e, t in zip(output.prompt_logprobs[1:], prompt[1:])]
    np.testing.assert_array_equal(np.asarray(got, np.float32), want)


def test_prefix_cache_and_ngram_drafts_keep_transformers_tokens(tmp_path):
  """A repeated prompt (a prefix-cache hit, the rest prefilled past the window) and n-gram
  drafts verified over windowed, soft-capped layers: transformers' greedy tokens."""
  hf_model = _write(tmp_path, "gemma2")
  llm = je.LLM(
    tmp_path,
    max_num_reqs=2,
    max_model_len=48,
    block_size=4,
    enable_prefix_caching=True,
    speculative_config={"method": "ngram", "num_speculative_tokens": 3},
  )
  one_shape(llm)
  repeating = [5, 17, 90, 3, 64, 5, 17, 90, 3, 64, 5, 17, 90]  # n-grams the drafter proposes
  params = je.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
  for _ in range(2):  # the second run reads the first's cached pages
    (out,) = llm.generate([repeating], params, use_tqdm=False)
    with torch.no_grad():
      want = hf_model.generate(
        torch.tensor([repeating]), max_new_tokens=12, do_sample=False, eos_token_id=None
      )[0, len(repeating) :].tolist()
    assert list(out.outputs[0].token_ids) == want
  assert llm.llm_engine.kv_cache_stats.prefix_cache_hits > 0
  assert llm.llm_engine.spec_decode_stats.num_draft_tokens > 0


def test_window_layers_free_their_pages_with_prefix_hits_and_preemption(tmp_path):
  """Gemma 3's window layers (KV cache groups, on by default) free the pages that slid out of
  the window: a 51-token request's window groups hold at most ``ceil((W + chunk) / B) + 1``
  pages at every step (2 once decoding), the full group all of them; tokens stay
  transformers' through a prefix hit and through preemptions in a pool too small for two."""
  hf_model = _write(tmp_path, "gemma3")
  chunk, window, block = 8, 4, 4
  llm = je.LLM(
    tmp_path, max_num_reqs=2, max_model_len=64, block_size=block, num_kv_blocks=22,
    max_num_batched_tokens=chunk,
  )  # fmt: skip
  one_shape(llm)
  engine = llm.llm_engine
  runner = engine.cores[0].runner
  manager = engine.cores[0].kv_cache_manager
  assert manager.windows == (None, window, window)  # layer 1 full; layers 0 and 2 windowed
  assert runner.kv_cache.layer_groups == ((1, 0), (0, 0), (2, 0)) and runner.num_blocks == 22
  params = je.SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
  with torch.no_grad():
    want = [
      hf_model.generate(torch.tensor([p]), max_new_tokens=40, do_sample=False, eos_token_id=None)[
        0, len(p) :
      ].tolist()
      for p in PROMPTS
    ]
  engine.add_request("long", PROMPTS[0], params)
  held = []
  while engine.has_unfinished_requests():
    held.append([manager.num_held_blocks("long", g) for g in range(3)])
    engine.step()
  bound = -(-(window + chunk) // block) + 1
  assert max(max(h[1:]) for h in held) <= bound and held[-1] == [13, 2, 2]
  outputs = llm.generate(PROMPTS, params, use_tqdm=False)  # a prefix hit, then preemptions
  assert [list(o.outputs[0].token_ids) for o in outputs] == want
  stats = engine.kv_cache_stats
  assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0 and stats.num_used_blocks == 0


def test_pages_prefill_and_decode_match_transformers(checkpoint):
  """Over pages outside the engine: a prefill, then one decode step (one token), each step's
  own metadata (`paged_utils.slot_step`)."""
  _, directory, hf_model = checkpoint
  model, _ = load_safetensors(directory)
  prompt = np.asarray(PROMPTS[0], np.int32)
  n, block = len(prompt), 4
  pages = -(-n // block)
  cache = PagedKVCache.create(model.kv_cache_spec, XlaAttentionBackend(), 1 + pages, block)
  ids, positions, md = slot_step([(0, prompt[:-1], 0)], pages_per_slot=pages, block_size=block)
  hidden, cache = model(ids, positions, cache, md)
  ids, positions, md = slot_step([(0, prompt[-1:], n - 1)], pages_per_slot=pages, block_size=block)
  last, _ = model(ids, positions, cache, md)
  logits = np.asarray(model.compute_logits(jnp.concatenate([hidden, last], axis=1)))[0]
  with torch.no_grad():
    want = hf_model(torch.tensor([PROMPTS[0]])).logits[0].numpy()
  np.testing.assert_allclose(logits, want, atol=1e-4)


def test_config_switches_read_from_each_checkpoint(checkpoint):
  case, directory, _ = checkpoint
  _, config = load_safetensors(directory)
  assert safetensors_loader.checkpoint_dtype(directory) == "F32"  # under language_model. too
  assert config.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
  assert config.sliding_window == 4 and config.query_pre_attn_scalar == 24
  spec = config.kv_cache_spec()
  assert spec.sliding_window == 4 and spec.sliding_window_layers == (0, 2)
  if case == "gemma2":
    assert config.attn_logit_softcapping == 2.0 and config.final_logit_softcapping == 3.0
    assert not config.qk_norm and config.rope_local == config.rope_global
    assert spec.soft_cap == 2.0
  else:
    assert config.qk_norm and config.attn_logit_softcapping is None and spec.soft_cap is None
    assert config.rope_local.theta == 50.0 and config.rope_local.factor == 1.0
  if case == "gemma3":
    assert config.rope_global.theta == 500.0 and config.rope_global.factor == 2.0
  if case == "gemma3_multimodal":
    assert config.checkpoint_prefix == "language_model."
    assert config.rope_global.theta == 1e6  # transformers' default for Gemma 3


def _released_gemma3_4b_style(hf: dict) -> dict:
  """A transformers 4 ``config.json`` as the Gemma 3 checkpoints were released: a sparse
  ``text_config`` (defaults omitted), ``rope_theta``/``rope_local_base_freq``/``rope_scaling``
  and ``sliding_window_pattern`` instead of ``rope_parameters`` and ``layer_types``."""
  return {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "model_type": "gemma3",
    "eos_token_id": [1, 106],
    "text_config": {
      "model_type": "gemma3_text",
      "hidden_size": 2560,
      "intermediate_size": 10240,
      "num_hidden_layers": 34,
      "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
      "sliding_window": 1024,
    },
    "vision_config": hf.get("vision_config", {}),
  }


def test_released_config_style_takes_transformers_defaults():
  config = config_from_hf(_released_gemma3_4b_style({}), "gemma3_multimodal")
  assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (8, 4, 256)
  assert config.vocab_size == 262208 and config.query_pre_attn_scalar == 256
  assert config.layer_types[:6] == ("sliding_attention",) * 5 + ("full_attention",)
  assert config.layer_types.count("full_attention") == 5  # layers 5, 11, 17, 23, 29
  assert config.rope_global.theta == 1e6 and config.rope_global.factor == 8.0
  assert config.rope_local.theta == 10000.0 and config.rope_local.factor == 1.0
  assert config.eos_token_id == 1 and config.hidden_activation == "gelu_pytorch_tanh"
  gemma2 = config_from_hf({"model_type": "gemma2", "num_hidden_layers": 4}, "gemma2")
  assert gemma2.layer_types == ("sliding_attention", "full_attention") * 2
  assert gemma2.attn_logit_softcapping == 50.0 and gemma2.final_logit_softcapping == 30.0


@pytest.mark.parametrize(
  "fields, message",
  [
    (dict(hidden_activation="relu"), "hidden_activation 'relu'"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 2.0}), "rope type 'yarn'"),
    (dict(rope_parameters={"rope_type": "linear"}), "'linear' needs 'factor'"),
    (dict(layer_types=["chunked_attention"] * 3), "layer_types"),
    (dict(layer_types=["full_attention"]), "layer_types has 1 entries"),
    (dict(sliding_window=None), "sliding_window"),
    (dict(attn_logit_softcapping=-1.0), "attn_logit_softcapping"),
    (dict(query_pre_attn_scalar=0), "query_pre_attn_scalar"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
  ],
)
def test_bad_configs_are_refused_naming_the_field(tmp_path, fields, message):
  config = json.loads(CASES["gemma2"]().to_json_string())
  config.update(architectures=["Gemma2ForCausalLM"], **fields)
  (tmp_path / "config.json").write_text(json.dumps(config))  # and no weights at all
  with pytest.raises(ValueError, match=message):
    je.LLM(tmp_path)


def test_model_types_without_architectures_pick_the_gemma_entries():
  from jaxengine.models.registry import hf_architecture

  for model_type, name in [
    ("gemma2", "Gemma2ForCausalLM"),
    ("gemma3_text", "Gemma3ForCausalLM"),
    ("gemma3", "Gemma3ForConditionalGeneration"),
  ]:
    assert hf_architecture({"model_type": model_type}).name == name


def test_gpu_backend_refuses_the_soft_cap_before_device_work(tmp_path):
  config = json.loads(CASES["gemma2"]().to_json_string())
  config.update(architectures=["Gemma2ForCausalLM"], layer_types=["full_attention"] * 3)
  model = Gemma(config_from_hf(config, "gemma2"), rngs=nnx.Rngs(0))  # global layers only
  assert model.kv_cache_spec.sliding_window is None and model.kv_cache_spec.soft_cap == 2.0
  with pytest.raises(ValueError, match="'pallas_gpu' has no attention logit soft-capping"):
    je.LLM(model, attention_backend="pallas_gpu", max_model_len=32)


def test_platform_default_without_a_window_gives_way_to_xla(monkeypatch):
  """With ``attention_backend=None`` a platform default that lacks the model's window and soft cap
  (GPU's Pallas decode kernel) is replaced by XLA; named explicitly, it is refused (above)."""
  from jaxengine.models import attention_backends

  monkeypatch.setitem(attention_backends.DEFAULT_BACKEND, "cpu", "pallas_gpu")
  assert attention_backends.attention_backend(None).name == "pallas_gpu"
  config = json.loads(CASES["gemma2"]().to_json_string())
  model = Gemma(config_from_hf(config, "gemma2"), rngs=nnx.Rngs(0))
  llm = one_shape(je.LLM(model, max_num_reqs=1, max_model_len=16))
  assert llm.llm_engine.runner.kv_cache.backend.name == "xla"
  (out,) = llm.generate([[1, 2, 3]], je.SamplingParams(max_tokens=2), use_tqdm=False)
  assert len(out.outputs[0].token_ids) == 2


MESH_SCRIPT = """
import os, sys
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
import jaxengine as je
params = je.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=0)
prompts = [[5, 17, 90, 3, 64, 21, 8, 77, 33, 7, 41], [2, 9, 60, 11, 4, 4, 31, 85, 12]]
kw = dict(max_num_reqs=2, max_model_len=32, block_size=4, enable_lora=True, max_lora_rank=8)
loras = [je.LoRARequest("adapter", 1, sys.argv[2]), None]  # a LoRA request and the base's
sys.path.insert(0, sys.argv[3])  # the tests' helpers
from step_shapes import one_shape  # the steps in their largest shape: the mesh is the point

one = one_shape(je.LLM(sys.argv[1], **kw)).generate(
  prompts, params, lora_request=loras, use_tqdm=False)
two = one_shape(je.LLM(sys.argv[1], tensor_parallel_size=2, scan_layers=True, **kw)).generate(
  prompts, params, lora_request=loras, use_tqdm=False)
worst = 0.0
for a, b, prompt in zip(one, two, prompts):
  assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
  for x, y, token in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], prompt[1:]):
    worst = max(worst, abs(x[token].logprob - y[token].logprob))
assert worst < 1e-4, worst
print("ok", worst)
"""


def test_two_device_mesh_gives_the_same_tokens(tmp_path):
  """With ``tensor_parallel_size=2`` and the layers scanned (``[L, ...]`` stacks, the layer axis
  unsplit) one unrolled device's tokens and prompt logprobs, for a LoRA adapter's request (its
  slots split as their base projections) and the base model's."""
  _write(tmp_path, "gemma2")  # soft caps, windows; K = 2 heads split over the 2 devices
  _write_adapter("gemma2", tmp_path, tmp_path / "adapter")
  out = run_python(
    MESH_SCRIPT, os.fspath(tmp_path), os.fspath(tmp_path / "adapter"), HELPERS_DIR, timeout=900
  )
  assert out.strip().splitlines()[-1].startswith("ok")


#: Gemma 3's layer pattern (five local, one global), its remainder after 8 layers two local.
GEMMA3_TYPES = ((SLIDING,) * 5 + (FULL,)) * 4


def _tiny(num_layers: int, scan: bool = False, **fields) -> Gemma:
  """A tiny Gemma 3-shaped model of random weights (norm offsets random too), the same weights
  for the same fields whatever `scan` (stacked when it is)."""
  config = GemmaConfig(**{
    **dict(
      vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=num_layers,
      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
      layer_types=GEMMA3_TYPES[:num_layers], sliding_window=3, qk_norm=True,
      rope_local=GemmaRope(theta=50.0), rope_global=GemmaRope(theta=500.0, factor=2.0),
      final_logit_softcapping=3.0, max_position_embeddings=64,
    ),
    **fields,
  })  # fmt: skip
  model = Gemma(config, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(1)
  scales = {}
  for path, leaf in nnx.to_flat_state(nnx.state(model)):
    if path[-1] == "scale":
      scales[path] = rng.standard_normal(leaf.shape).astype(np.float32) * 0.3
      leaf.set_value(jnp.asarray(scales[path]))
  if not scan:
    return model
  scanned = Gemma(dataclasses.replace(config, scan_layers=True), rngs=nnx.Rngs(0))
  for path, leaf in nnx.to_flat_state(nnx.state(scanned)):
    if path[-1] == "scale" and path[0] == "layers":
      rows = [scales[("layers", i, *path[1:])] for i in range(num_layers)]
      leaf.set_value(jnp.asarray(np.stack(rows)))
    elif path[-1] == "scale":
      leaf.set_value(jnp.asarray(scales[path]))
  return scanned


SCAN_TOKENS = jnp.asarray(np.random.default_rng(0).integers(3, 64, (2, 13)), jnp.int32)


@pytest.mark.parametrize(
  "layers, fields",
  [(8, {}), (5, dict(layer_types=(SLIDING, FULL) * 2 + (SLIDING,), attn_logit_softcapping=2.0))],
  ids=["gemma3_pattern_6", "gemma2_pattern_2"],
)
def test_scanned_layers_give_the_unrolled_bits(layers, fields):
  """``scan_layers=True``: the 8-layer Gemma 3 pattern (one group of 6 scanned, 2 local layers
  after it) and a 5-layer Gemma 2 pattern (two groups of 2, one layer after): the unrolled
  model's logits bit for bit, also converted from the unrolled module (`scanned_model`, which
  leaves the caller's module unrolled), in batch-invariant mode, and int8-quantized (the
  scales keep the layer axis)."""
  unrolled, scanned = _tiny(layers, **fields), _tiny(layers, scan=True, **fields)
  config = scanned.config
  assert config.layer_period == (6 if layers == 8 else 2) and scanned.stacked_paths == ("layers",)
  wq = state_leaves(nnx.state(scanned))[("layers", "attn", "wq")]
  assert wq.shape == (layers, 4, 16, 32) and scanned.kv_cache_spec.stacked
  want = np.asarray(sequence_logits(unrolled, SCAN_TOKENS))
  np.testing.assert_array_equal(np.asarray(sequence_logits(scanned, SCAN_TOKENS)), want)
  converted = scanned_model(unrolled, True)
  np.testing.assert_array_equal(np.asarray(sequence_logits(converted, SCAN_TOKENS)), want)
  assert isinstance(unrolled.layers, nnx.List) and unrolled.layers[1].attn.layer == 1
  assert isinstance(converted.layers, GemmaDecoderLayer) and converted.layers.attn.layer is None
  copies = [nnx.merge(*nnx.split(model)) for model in (unrolled, scanned)]
  for copy in copies:
    copy.set_attributes(batch_invariant=True)
  want = np.asarray(token_logprobs(copies[0], SCAN_TOKENS))
  np.testing.assert_array_equal(np.asarray(token_logprobs(copies[1], SCAN_TOKENS)), want)
  done = quantize_model(scanned, "int8")
  leaves = state_leaves(nnx.state(done.model))
  assert leaves[("layers", "attn", "scales", "wq")].shape == (layers, 4, 16)
  want = np.asarray(sequence_logits(quantize_model(unrolled, "int8").model, SCAN_TOKENS))
  np.testing.assert_array_equal(np.asarray(sequence_logits(done.model, SCAN_TOKENS)), want)


def _compiled_instructions(num_layers: int) -> int:
  """HLO instructions of one compiled forward step of a tiny scanned model."""
  model = _tiny(num_layers, scan=True)
  metadata, cache = scratch_step(model, 2, 8, 4, XlaAttentionBackend())
  ids, positions = SCAN_TOKENS[:, :8].reshape(1, -1), jnp.tile(jnp.arange(8), 2)[None]
  step = jax.jit(lambda m, *args: m(*args))
  compiled = step.lower(model, ids, positions.astype(jnp.int32), cache, metadata).compile()
  return sum(" = " in line for line in compiled.as_text().splitlines())


def test_the_scanned_step_does_not_grow_with_the_groups():
  """14 and 20 layers of Gemma 3's pattern (two and three groups, two layers after them)
  compile the same number of HLO instructions (a scan of one group is inlined)."""
  assert _compiled_instructions(20) == _compiled_instructions(14)


def test_the_engine_scans_by_default_on_accelerators_only():
  config = _tiny(2).config
  assert scan_config(config, None, platform="tpu").scan_layers
  assert not scan_config(config, None, platform="cpu").scan_layers
  assert scanned_model(_tiny(2), None, platform="tpu").config.scan_layers
  with pytest.raises(ValueError, match="scan_layers must be a bool, got 1"):
    dataclasses.replace(config, scan_layers=1)


@pytest.mark.parametrize("case", ["gemma2", "gemma3"])
def test_scanned_engine_gives_the_unrolled_outputs(case, tmp_path):
  """``LLM(dir, scan_layers=True, batch_invariant=True)`` with LoRA, prefill in chunks of 8
  tokens and the window layers' pages freed as they slide out: the base request's greedy
  tokens are transformers' and its prompt logprobs the unrolled model's `token_logprobs` bit
  for bit; the adapter's request in the same steps gives transformers + peft's within 1e-4."""
  hf_model = _write(tmp_path, case)
  adapted = _write_adapter(case, tmp_path, tmp_path / "adapter")
  llm = je.LLM(
    tmp_path, scan_layers=True, batch_invariant=True, max_num_reqs=2, max_model_len=32,
    block_size=4, max_num_batched_tokens=8, enable_lora=True, max_lora_rank=8,
  )  # fmt: skip
  one_shape(llm)  # its bits are compared with the trainer's, not across buckets
  engine = llm.llm_engine
  runner, manager = engine.cores[0].runner, engine.cores[0].kv_cache_manager
  assert runner.kv_cache.stacked_layers is not None and runner.model.config.scan_layers
  params = je.SamplingParams(
    temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, prompt_logprobs=0
  )
  lora = je.LoRARequest("adapter", 1, str(tmp_path / "adapter"))
  engine.add_request("base", PROMPTS[0], params)
  engine.add_request("adapter", PROMPTS[1], params, lora_request=lora)
  held, outputs = [], {}
  while engine.has_unfinished_requests():
    held.append([manager.num_held_blocks("base", g) for g in range(3)])
    outputs.update((out.request_id, out) for out in engine.step() if out.finished)
  assert any(0 < h[1] < h[0] for h in held)  # the window's pages that slid out were freed
  base = outputs["base"]
  assert list(base.outputs[0].token_ids) == hf_greedy(hf_model, PROMPTS[0], MAX_TOKENS)
  model, _ = load_safetensors(tmp_path)
  want = np.asarray(token_logprobs(model, jnp.asarray([PROMPTS[0]], jnp.int32)))[0]
  got = [e[t].logprob for e, t in zip(base.prompt_logprobs[1:], PROMPTS[0][1:])]
  np.testing.assert_array_equal(np.asarray(got, np.float32), want)
  other = outputs["adapter"]
  assert list(other.outputs[0].token_ids) == hf_greedy(adapted, PROMPTS[1], MAX_TOKENS)
  got = [e[t].logprob for e, t in zip(other.prompt_logprobs[1:], PROMPTS[1][1:])]
  np.testing.assert_allclose(got, hf_prompt_logprobs(adapted, PROMPTS[1]), atol=1e-4)
