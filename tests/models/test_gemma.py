"""Gemma 2 and Gemma 3 (text) checkpoints against transformers' own models.

Tiny random checkpoints are built and saved by transformers (`Gemma2ForCausalLM`,
`Gemma3ForCausalLM`, `Gemma3ForConditionalGeneration`), float32, with a window of 4 positions on
the local layers and prompts of 11 tokens, so the window, the two rotary bases and (where set) both
soft caps change the result. `LLM(dir)` must give transformers' greedy tokens and its prompt
logprobs within 1e-4, and `token_logprobs` the same logprobs. Nothing here touches the network.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

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
from subprocess_utils import run_python

import jaxengine as je
from jaxengine.models import PagedKVCache, safetensors_loader, token_logprobs
from jaxengine.models.attention_backends import XlaAttentionBackend
from jaxengine.models.gemma import Gemma
from jaxengine.models.gemma_checkpoints import config_from_hf
from jaxengine.models.safetensors_loader import load_safetensors
from jaxengine.models.weights import named_weights

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
#: The engines' sizes (the prefix-cache and window tests' 51 tokens fit): engines of one model
#: share their steps' executables, and every engine the sampler's.
ENGINE = dict(max_num_reqs=2, max_model_len=64, block_size=4)


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


def _greedy_and_prompt_logprobs(outputs) -> list[tuple[list[int], list[float]]]:
  """Each output's greedy tokens and its prompt tokens' logprobs (after the first)."""
  return [
    (list(out.outputs[0].token_ids), [e[t].logprob for e, t in zip(out.prompt_logprobs[1:], p[1:])])
    for p, out in zip(PROMPTS, outputs)
  ]


class Shared:
  """Each case's checkpoint (seed 0), PEFT adapter, trainer-side logprobs and LoRA engine
  outputs, made on first use and shared by the module's tests: one write, one transformers
  load and one compile each."""

  def __init__(self, root: Path):
    self.root, self._made = root, {}

  def _once(self, key: tuple, make):
    if key not in self._made:
      self._made[key] = make()
    return self._made[key]

  def checkpoint(self, case: str) -> tuple[Path, torch.nn.Module]:
    """The checkpoint's directory and transformers' model of it."""
    return self._once(
      ("checkpoint", case), lambda: (self.root / case, _write(self.root / case, case))
    )

  def adapter(self, case: str) -> tuple[Path, torch.nn.Module]:
    """The adapter's directory and transformers + peft's model with it."""
    out = self.root / f"{case}_adapter"
    return self._once(
      ("adapter", case), lambda: (out, _write_adapter(case, self.checkpoint(case)[0], out))
    )

  def trainer_logprobs(self, case: str) -> list[np.ndarray]:
    """`token_logprobs` of each prompt over the checkpoint: one ``[2, 11]`` call (the shorter
    prompt padded at the end, its tail left out), one compile per model."""

    def make():
      model, _ = load_safetensors(self.checkpoint(case)[0])
      length = max(map(len, PROMPTS))
      ids = jnp.asarray([p + [0] * (length - len(p)) for p in PROMPTS], jnp.int32)
      rows = np.asarray(token_logprobs(model, ids))
      return [row[: len(p) - 1] for row, p in zip(rows, PROMPTS)]

    return self._once(("trainer", case), make)

  def lora_outputs(self, case: str) -> list[tuple[list[int], list[float]]]:
    """A LoRA engine's greedy tokens and prompt logprobs (`_greedy_and_prompt_logprobs`) of the
    adapter's request (the first prompt) and the base model's in one step."""

    def make():
      llm = one_shape(je.LLM(self.checkpoint(case)[0], enable_lora=True, max_lora_rank=8, **ENGINE))
      params = je.SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, prompt_logprobs=0
      )
      lora = je.LoRARequest("adapter", 1, str(self.adapter(case)[0]))
      return _greedy_and_prompt_logprobs(
        llm.generate(PROMPTS, params, lora_request=[lora, None], use_tqdm=False)
      )

    return self._once(("lora", case), make)


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
  return Shared(tmp_path_factory.mktemp("gemma"))


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, shared):
  return request.param, *shared.checkpoint(request.param)


def test_llm_matches_transformers_greedy_and_prompt_logprobs(checkpoint):
  _, directory, hf_model = checkpoint
  llm = one_shape(je.LLM(directory, **ENGINE))
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


def test_lora_adapter_matches_transformers_with_peft(checkpoint, shared):
  """A PEFT adapter on all seven projections (rank 4, rsLoRA; random non-zero ``lora_B``),
  unmerged in a LoRA engine: transformers + peft's greedy tokens and prompt logprobs within
  1e-4, for the adapter's request and the base model's in one step. The multimodal checkpoint's
  adapter wraps its vision tower's ``q_proj`` ... too: those tensors are left out (the engine
  runs text only)."""
  case, _, hf_model = checkpoint
  adapted = shared.adapter(case)[1]
  worst = 0.0
  for model, prompt, (tokens, got) in zip((adapted, hf_model), PROMPTS, shared.lora_outputs(case)):
    assert tokens == hf_greedy(model, prompt, MAX_TOKENS)
    worst = max(worst, float(np.abs(np.asarray(got) - hf_prompt_logprobs(model, prompt)).max()))
  assert worst < 1e-4, worst
  # The adapter changes the model (else the comparison above would prove nothing).
  base = hf_prompt_logprobs(hf_model, PROMPTS[0])
  assert np.abs(hf_prompt_logprobs(adapted, PROMPTS[0]) - base).max() > 1e-2


def test_token_logprobs_match_transformers(checkpoint, shared):
  case, directory, hf_model = checkpoint
  model, _ = load_safetensors(directory)
  assert isinstance(model, Gemma)
  for prompt, got in zip(PROMPTS, shared.trainer_logprobs(case)):
    np.testing.assert_allclose(got, hf_prompt_logprobs(hf_model, prompt), atol=1e-4)


def test_load_weights_by_checkpoint_names_compiles_nothing(tmp_path, shared, compile_counter):
  """A Gemma3ForConditionalGeneration's text tensors under its own names
  (``language_model.model.layers.0...``) replace the weights of a scanned engine (rows of its
  ``[L, ...]`` stacks): the other checkpoint's logprobs, no compile; a whole unrolled module
  (a trainer's) loads into the stacks too."""
  directory = shared.checkpoint("gemma3_multimodal")[0]  # seed 0
  other = _write(tmp_path / "b", "gemma3_multimodal", seed=1)
  llm = je.LLM(directory, scan_layers=True, **ENGINE)
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
  unrolled, _ = load_safetensors(directory)
  llm.load_weights(unrolled)  # checked per layer, then stacked
  np.testing.assert_array_equal(prompt_logprobs(), before)
  got = dict(named_weights(llm.llm_engine.runner.model))
  for name, tensor in named_weights(unrolled):
    np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(tensor), err_msg=name)


def test_batch_invariant_engine_equals_token_logprobs_bit_for_bit(checkpoint, shared):
  """``LLM(..., batch_invariant=True)``'s prompt logprobs are `token_logprobs`' bits (windows
  and soft caps in the fixed-order XLA path too)."""
  case, directory, _ = checkpoint
  sizes = {**ENGINE, "block_size": 16}  # the engine's default, as `token_logprobs`' own
  llm = je.LLM(directory, batch_invariant=True, **sizes)
  params = je.SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
  outputs = llm.generate(PROMPTS, params, use_tqdm=False)
  for prompt, output, want in zip(PROMPTS, outputs, shared.trainer_logprobs(case)):
    got = [e[t].logprob for e, t in zip(output.prompt_logprobs[1:], prompt[1:])]
    np.testing.assert_array_equal(np.asarray(got, np.float32), want)


def test_prefix_cache_and_ngram_drafts_keep_transformers_tokens(shared):
  """A repeated prompt (a prefix-cache hit, the rest prefilled past the window) and n-gram
  drafts verified over windowed, soft-capped layers: transformers' greedy tokens."""
  directory, hf_model = shared.checkpoint("gemma2")
  llm = je.LLM(
    directory,
    enable_prefix_caching=True,
    speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    **ENGINE,
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


def test_window_layers_free_their_pages_with_prefix_hits_and_preemption(shared):
  """Gemma 3's window layers (KV cache groups, on by default) free the pages that slid out of
  the window: a 51-token request's window groups hold at most ``ceil((W + chunk) / B) + 1``
  pages at every step (2 once decoding), the full group all of them; tokens stay
  transformers' through a prefix hit and through preemptions in a pool too small for two."""
  directory, hf_model = shared.checkpoint("gemma3")
  chunk, window, block = 8, 4, ENGINE["block_size"]
  llm = je.LLM(directory, num_kv_blocks=22, max_num_batched_tokens=chunk, **ENGINE)
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


def test_platform_default_without_a_window_gives_way_to_xla(monkeypatch):
  """With ``attention_backend=None`` a platform default that lacks the model's window and soft cap
  (GPU's Pallas decode kernel) is replaced by XLA; named explicitly, it is refused (above)."""
  from jaxengine.models import attention_backends

  monkeypatch.setitem(attention_backends.DEFAULT_BACKEND, "cpu", "pallas_gpu")
  assert attention_backends.attention_backend(None).name == "pallas_gpu"
  config = json.loads(CASES["gemma2"]().to_json_string())
  model = Gemma(config_from_hf(config, "gemma2"), rngs=nnx.Rngs(0))
  llm = one_shape(je.LLM(model, **ENGINE))  # gemma2's engine sizes: its steps
  assert llm.llm_engine.runner.kv_cache.backend.name == "xla"
  (out,) = llm.generate([[1, 2, 3]], je.SamplingParams(max_tokens=2), use_tqdm=False)
  assert len(out.outputs[0].token_ids) == 2


MESH_SCRIPT = """
import json, os, sys
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
import jaxengine as je
prompts, engine = json.loads(sys.argv[3])
params = je.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=0)
loras = [je.LoRARequest("adapter", 1, sys.argv[2]), None]  # a LoRA request and the base's
from step_shapes import one_shape  # the steps in their largest shape: the mesh is the point

llm = je.LLM(sys.argv[1], tensor_parallel_size=2, scan_layers=True, enable_lora=True,
             max_lora_rank=8, **engine)
two = one_shape(llm).generate(prompts, params, lora_request=loras, use_tqdm=False)
print(json.dumps([
  (list(out.outputs[0].token_ids), [e[t].logprob for e, t in zip(out.prompt_logprobs[1:], p[1:])])
  for p, out in zip(prompts, two)
]))
"""


def test_two_device_mesh_gives_the_same_tokens(shared):
  """With ``tensor_parallel_size=2`` and the layers scanned (``[L, ...]`` stacks, the layer axis
  unsplit) one unrolled device's tokens and prompt logprobs (the LoRA engine of
  `test_lora_adapter_matches_transformers_with_peft`), for a LoRA adapter's request (its
  slots split as their base projections) and the base model's."""
  directory = shared.checkpoint("gemma2")[0]  # soft caps, windows; K = 2 heads over 2 devices
  adapter = shared.adapter("gemma2")[0]
  args = json.dumps([PROMPTS, ENGINE])
  out = run_python(MESH_SCRIPT, os.fspath(directory), os.fspath(adapter), args, timeout=900)
  two, one = json.loads(out.strip().splitlines()[-1]), shared.lora_outputs("gemma2")
  assert len(two) == len(one) == len(PROMPTS)
  worst = 0.0
  for (tokens, logprobs), (want_tokens, want) in zip(two, one):
    assert tokens == want_tokens
    worst = max(worst, float(np.abs(np.asarray(logprobs) - np.asarray(want)).max()))
  assert worst < 1e-4, worst


@pytest.mark.parametrize("case", ["gemma2", "gemma3"])
def test_scanned_engine_gives_the_unrolled_outputs(case, shared):
  """``LLM(dir, scan_layers=True, batch_invariant=True)`` with LoRA, prefill in chunks of 8
  tokens and the window layers' pages freed as they slide out: the base request's greedy
  tokens are transformers' and its prompt logprobs the unrolled model's `token_logprobs` bit
  for bit; the adapter's request in the same steps gives transformers + peft's within 1e-4."""
  (directory, hf_model), (adapter, adapted) = shared.checkpoint(case), shared.adapter(case)
  llm = je.LLM(
    directory, scan_layers=True, batch_invariant=True, max_num_batched_tokens=8,
    enable_lora=True, max_lora_rank=8, **ENGINE,
  )  # fmt: skip
  one_shape(llm)  # its bits are compared with the trainer's, not across buckets
  engine = llm.llm_engine
  runner, manager = engine.cores[0].runner, engine.cores[0].kv_cache_manager
  assert runner.kv_cache.stacked_layers is not None and runner.model.config.scan_layers
  params = je.SamplingParams(
    temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, prompt_logprobs=0
  )
  lora = je.LoRARequest("adapter", 1, str(adapter))
  engine.add_request("base", PROMPTS[0], params)
  engine.add_request("adapter", PROMPTS[1], params, lora_request=lora)
  held, outputs = [], {}
  while engine.has_unfinished_requests():
    held.append([manager.num_held_blocks("base", g) for g in range(3)])
    outputs.update((out.request_id, out) for out in engine.step() if out.finished)
  assert any(0 < h[1] < h[0] for h in held)  # the window's pages that slid out were freed
  base = outputs["base"]
  assert list(base.outputs[0].token_ids) == hf_greedy(hf_model, PROMPTS[0], MAX_TOKENS)
  want = shared.trainer_logprobs(case)[0]  # the unrolled model's
  got = [e[t].logprob for e, t in zip(base.prompt_logprobs[1:], PROMPTS[0][1:])]
  np.testing.assert_array_equal(np.asarray(got, np.float32), want)
  other = outputs["adapter"]
  assert list(other.outputs[0].token_ids) == hf_greedy(adapted, PROMPTS[1], MAX_TOKENS)
  got = [e[t].logprob for e, t in zip(other.prompt_logprobs[1:], PROMPTS[1][1:])]
  np.testing.assert_allclose(got, hf_prompt_logprobs(adapted, PROMPTS[1]), atol=1e-4)
