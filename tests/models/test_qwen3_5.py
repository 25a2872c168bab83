"""Qwen3.5 hybrid checkpoints (Gated DeltaNet and gated attention) against transformers.

A tiny random ``Qwen3_5ForCausalLM`` (layers linear, linear, linear, full; 2 key and 4 value heads
in the linear layers, a partial rotary embedding) is built and saved by transformers, float32,
every tensor randomised (norm offsets too). One engine with a small token budget (chunked
prefill) and a pool of pages too small for its requests at once (preemption) must give
transformers' greedy tokens and prompt logprobs within 1e-4; seeded ``n > 1`` requests the same
samples together as one by one; every recurrent state slot free at the end. The image-text
checkpoint's text decoder and a ``Qwen3_5MoeForCausalLM`` give transformers' logprobs through
`token_logprobs`, the MoE one its router's experts through ``enable_return_routed_experts``.
``tensor_parallel_size=2`` (a subprocess on 2 host devices) equals the one-device engine (with a
LoRA adapter too); int8 and fp8 models compute their dequantized weights; a PEFT adapter on every
projection gives transformers + peft's tokens and logprobs; ``batch_invariant=True`` with the
k-step loop gives a request the same bits alone, in a shuffled batch and in `token_logprobs`;
fp8 pages beside the float32 state pool stay close to float32 pages; a "keep" pause with
`load_weights` keeps each request's state as its pages (transformers' continuation of the old
weights' cache through the new ones); sleep and wake free and rebuild the pool, same tokens.
The tensor-parallel engine runs its layers scanned (`jaxengine.models.qwen3_5_scan`; more in
tests/models/test_qwen3_5_scan.py); speculative decoding is checked in
tests/spec_decode/test_speculative_hybrid.py. Nothing here touches the network (transformers
takes its PyTorch fallbacks of the linear layers' kernels).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from hf_reference import hf_greedy, hf_prompt_logprobs, random_peft_adapter
from step_shapes import one_shape
from subprocess_utils import run_python

import jaxengine as je
from jaxengine.models import named_weights, token_logprobs
from jaxengine.models.quantization import dequantize_rows, quantize_model, quantize_rows
from jaxengine.models.qwen3_5 import Qwen3_5
from jaxengine.models.qwen3_5_checkpoints import config_from_hf
from jaxengine.models.safetensors_loader import load_safetensors
from jaxengine.testing import count_compiles

pytestmark = pytest.mark.bitwise  # compares bits between programs: tests/conftest.py

TEXT = dict(
  vocab_size=96,
  hidden_size=32,
  intermediate_size=48,
  num_hidden_layers=4,
  num_attention_heads=4,
  num_key_value_heads=2,
  head_dim=16,
  max_position_embeddings=64,
  linear_conv_kernel_dim=4,
  linear_key_head_dim=8,
  linear_value_head_dim=12,
  linear_num_key_heads=2,
  linear_num_value_heads=4,
  layer_types=["linear_attention"] * 3 + ["full_attention"],
  rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5},
)
#: The longest is above the engine's token budget (chunked prefill).
PROMPTS = [[3, 17, 45, 8, 90, 22, 5, 61, 33, 2, 7, 70, 12], [5, 6, 7, 81], list(range(9, 30))]
MAX_TOKENS = 8


def _randomise(model: torch.nn.Module, seed: int) -> None:
  """Matrices of std ``fan_in ** -0.5``, vectors (norms, decay parameters) of std 0.3."""
  generator = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for param in model.parameters():
      noise = torch.randn(param.shape, generator=generator)
      param.copy_(noise * (0.3 if param.ndim == 1 else param.shape[-1] ** -0.5))


def _write(directory: Path, multimodal: bool = False) -> torch.nn.Module:
  torch.manual_seed(0)
  text = transformers.Qwen3_5TextConfig(**TEXT)
  if multimodal:
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32)
    config = transformers.Qwen3_5Config(text_config=text.to_dict(), vision_config=vision)
    model = transformers.Qwen3_5ForConditionalGeneration(config).eval()
  else:
    model = transformers.Qwen3_5ForCausalLM(text).eval()
  _randomise(model, 0)
  model.save_pretrained(directory)
  return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  directory = tmp_path_factory.mktemp("qwen3_5")
  return directory, _write(directory)


#: Chunks of 8 tokens; 13 usable pages of 4 positions for 3 requests needing 18 together; a
#: LoRA slot (base requests add nothing from it).
ENGINE = dict(
  max_num_reqs=3,
  max_model_len=48,
  block_size=4,
  num_kv_blocks=14,
  max_num_batched_tokens=8,
  enable_lora=True,
  max_loras=1,
  max_lora_rank=4,
)
#: PEFT's names of every projection of Qwen3.5 (the Gated DeltaNet's five, the gated
#: attention's four, the MLP's three).
LORA_TARGETS = [
  *("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"),
  *("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
]


@pytest.fixture(scope="module")
def llm(checkpoint):
  """The engine most tests share, its steps in one shape (`one_shape`): chunks, preemption and
  the comparisons against transformers and other engines are the point here, not buckets."""
  return one_shape(je.LLM(checkpoint[0], **ENGINE))


@pytest.fixture(scope="module")
def adapter(checkpoint, tmp_path_factory):
  """A rank-4 PEFT adapter on every projection (random ``lora_B`` too: PEFT starts it at zero)
  and transformers' model with it applied."""
  import peft

  directory = tmp_path_factory.mktemp("qwen3_5_lora")
  torch.manual_seed(1)
  base = transformers.AutoModelForCausalLM.from_pretrained(checkpoint[0], dtype=torch.float32)
  config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, lora_dropout=0.0)
  model = random_peft_adapter(base, config, directory)
  return je.LoRARequest("all", 1, str(directory)), model.base_model.model


def _greedy_with_prompt_logprobs(llm, prompts=PROMPTS, lora_request=None):
  """Each prompt's greedy tokens and its prompt tokens' logprobs (after the first)."""
  params = je.SamplingParams(
    temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, prompt_logprobs=0
  )
  outputs = llm.generate(prompts, params, lora_request=lora_request, use_tqdm=False)
  return [
    (
      list(out.outputs[0].token_ids),
      [entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], prompt[1:])],
    )
    for prompt, out in zip(prompts, outputs)
  ]


def _free_state_slots(llm) -> int:
  slots = llm.llm_engine.cores[0].scheduler.state_slots
  return slots.num_free


def test_greedy_and_prompt_logprobs_match_transformers_chunked_and_preempted(checkpoint, llm):
  _, hf_model = checkpoint
  worst = 0.0
  for prompt, (tokens, got) in zip(PROMPTS, _greedy_with_prompt_logprobs(llm)):
    assert tokens == hf_greedy(hf_model, prompt, MAX_TOKENS)
    worst = max(worst, float(np.abs(np.asarray(got) - hf_prompt_logprobs(hf_model, prompt)).max()))
  assert worst < 1e-4, worst
  stats = llm.llm_engine.kv_cache_stats
  assert stats.num_preemptions > 0 and stats.num_used_blocks == 0
  assert _free_state_slots(llm) == 3


def test_seeded_samples_together_equal_one_by_one(checkpoint, llm):
  """Two ``n=2`` seeded requests in one batch (each sample prefilling its own state) give the
  samples each gives alone; both greedy samples (``top_k=1``) of an ``n=2`` request are transformers' tokens
  (the second computes its own prompt: a page forked from the first would hold no state); the
  slots are all free afterwards."""
  greedy = je.SamplingParams(top_k=1, max_tokens=MAX_TOKENS, n=2, ignore_eos=True)  # argmax
  (both,) = llm.generate([PROMPTS[0]], greedy, use_tqdm=False)
  want = hf_greedy(checkpoint[1], PROMPTS[0], MAX_TOKENS)
  assert [list(c.token_ids) for c in both.outputs] == [want, want]
  params = je.SamplingParams(temperature=1.0, max_tokens=6, n=2, seed=11, ignore_eos=True)
  prompts = PROMPTS[:2]
  together = llm.generate(prompts, params, use_tqdm=False)
  alone = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
  for a, b in zip(together, alone):
    samples = [list(c.token_ids) for c in a.outputs]
    assert samples == [list(c.token_ids) for c in b.outputs]
    assert len(samples) == 2 and all(len(s) == 6 for s in samples)
  assert _free_state_slots(llm) == 3


MESH_SCRIPT = """
import json, os, sys
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
import jaxengine as je
prompts, engine, max_tokens, adapter = json.loads(sys.argv[2])
llm = je.LLM(sys.argv[1], tensor_parallel_size=2, scan_layers=True, **engine)
runner = llm.llm_engine.cores[0].runner  # one step shape, as the engine it is compared with
runner.row_buckets, runner.token_buckets = runner.row_buckets[-1:], runner.token_buckets[-1:]
params = je.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=0)
lora = je.LoRARequest("all", 1, adapter)
outputs = [
  (list(out.outputs[0].token_ids), [e[t].logprob for e, t in zip(out.prompt_logprobs[1:], p[1:])])
  for request in (None, lora)
  for p, out in zip(prompts, llm.generate(prompts, params, lora_request=request, use_tqdm=False))
]
shard = lambda a: list(a.addressable_shards[0].data.shape)
mixer = runner.weights["layers"]["linear"]["mixer"]  # scanned: [Ll, ...] stacks
pool = runner.kv_cache.recurrent
print(json.dumps(dict(
  w_qkv=shard(mixer["w_qkv"][...]), w_out=shard(mixer["w_out"][...]),
  conv=shard(pool.conv[0]), delta=shard(pool.delta[0]),
  outputs=outputs,
  preempted=llm.llm_engine.kv_cache_stats.num_preemptions > 0,
)))
"""


def test_two_device_mesh_equals_one_device(checkpoint, llm, adapter):
  """``tensor_parallel_size=2`` with the layers scanned (``scan_layers=True``: a stack per kind,
  the state pool ``[Ll, S, ...]``, their layer axis unsplit): the Gated DeltaNet layers split by
  heads (``w_qkv``'s 80 channels, ``w_out``'s 48 inputs and the state pool's windows and value
  heads in halves), the gated attention and the MLP as Llama's; chunked prefill and preemption
  as in the one-device (unrolled) engine: its greedy tokens, and its prompt logprobs within
  1e-4, without and with the LoRA adapter (its slots split as their base projections)."""
  args = json.dumps([PROMPTS, ENGINE, MAX_TOKENS, adapter[0].lora_path])
  out = json.loads(run_python(MESH_SCRIPT, os.fspath(checkpoint[0]), args).splitlines()[-1])
  assert out["w_qkv"] == [3, 40, 32] and out["w_out"] == [3, 32, 24]
  assert out["conv"] == [3, 4, 3, 40] and out["delta"] == [3, 4, 2, 8, 12]
  assert out["preempted"]
  one_device = _greedy_with_prompt_logprobs(llm)
  one_device += _greedy_with_prompt_logprobs(llm, lora_request=adapter[0])
  assert len(out["outputs"]) == len(one_device) == 2 * len(PROMPTS)
  for (tokens, logprobs), (want_tokens, want) in zip(out["outputs"], one_device):
    assert tokens == want_tokens
    np.testing.assert_allclose(logprobs, want, atol=1e-4)


def test_peft_adapter_on_every_projection_matches_transformers_with_peft(checkpoint, llm, adapter):
  """A PEFT adapter on all twelve projections (``in_proj_qkv``'s update reordered into the
  model's key-head groups): transformers + peft's greedy tokens and prompt logprobs within 1e-4,
  through chunked prefill; the adapter moves the logprobs (else this would prove nothing)."""
  request, hf_lora = adapter
  got = _greedy_with_prompt_logprobs(llm, PROMPTS[:2], lora_request=request)
  for prompt, (tokens, logprobs) in zip(PROMPTS[:2], got):
    assert tokens == hf_greedy(hf_lora, prompt, MAX_TOKENS)
    want = hf_prompt_logprobs(hf_lora, prompt)
    np.testing.assert_allclose(logprobs, want, atol=1e-4)
    assert np.abs(want - hf_prompt_logprobs(checkpoint[1], prompt)).max() > 0.1


def _bits(values) -> np.ndarray:
  return np.asarray(values, np.float32).view(np.uint32)


def test_batch_invariant_bits_alone_in_a_shuffled_batch_and_in_token_logprobs(checkpoint, adapter):
  """``batch_invariant=True`` (chunks of 8 tokens, 3 rows) with the k-step decode loop
  (``num_decode_steps=4``, each row's state slot carried through it): three target prompts,
  each alone and then in a shuffled batch of eight (every other request with the LoRA adapter),
  give the same tokens and the same bits of sampled and prompt logprobs; a base target's are
  `token_logprobs`' over the engine's weights, bit for bit (so the loop's tokens continued the
  right states)."""
  engine = je.LLM(checkpoint[0], batch_invariant=True, num_decode_steps=4, **ENGINE)
  runner, loops = engine.llm_engine.runner, []
  execute = runner.execute_decode_steps
  runner.execute_decode_steps = lambda *a, **k: loops.append(1) or execute(*a, **k)
  params = je.SamplingParams(
    temperature=0, max_tokens=5, logprobs=0, prompt_logprobs=0, ignore_eos=True
  )
  rng = np.random.default_rng(5)
  prompts = [
    p.tolist() for p in (rng.integers(0, 96, size=n) for n in (3, 12, 21, 1, 9, 17, 6, 14))
  ]
  loras = [adapter[0] if i % 2 else None for i in range(len(prompts))]

  def result(out, prompt):
    sample = out.outputs[0]
    sampled = [d[t].logprob for d, t in zip(sample.logprobs, sample.token_ids)]
    prompt_values = [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], prompt[1:])]
    return list(sample.token_ids), _bits(sampled), _bits(prompt_values)

  alone = [
    result(engine.generate([p], params, lora_request=r, use_tqdm=False)[0], p)
    for p, r in zip(prompts[:3], loras)
  ]
  order = np.random.default_rng(1).permutation(len(prompts)).tolist()
  outputs = engine.generate(
    [prompts[i] for i in order], params, lora_request=[loras[i] for i in order], use_tqdm=False
  )
  mixed = dict(zip(order, outputs))
  for i, (tokens, sampled, prompt_bits) in enumerate(alone):
    got = result(mixed[i], prompts[i])
    assert got[0] == tokens
    np.testing.assert_array_equal(got[1], sampled)
    np.testing.assert_array_equal(got[2], prompt_bits)
  assert loops
  served = runner.model
  for i in (0, 2):  # the base requests
    tokens, sampled, prompt_bits = alone[i]
    trainer = token_logprobs(served, jnp.asarray([prompts[i] + tokens], jnp.int32), block_size=4)
    np.testing.assert_array_equal(_bits(trainer[0]), np.concatenate([prompt_bits, sampled]))


def test_gated_deltanet_row_bits_do_not_depend_on_the_number_of_rows():
  """In batch-invariant mode a request's output and new state in a decode step are the same bits
  among 64 requests as alone, with 128-wide key heads (where a plain sum along the last axis
  of 64 rows differs in the last bits from one row's on XLA:CPU: the L2 norms)."""
  from jaxengine.models.gated_deltanet import GatedDeltaNet, StepRows

  hf = dict(TEXT, linear_key_head_dim=128, linear_num_key_heads=1, linear_num_value_heads=2)
  layer = GatedDeltaNet(config_from_hf(hf, "qwen3_5"), dtype=jnp.float32, rngs=nnx.Rngs(3))
  layer.set_attributes(batch_invariant=True)
  rng = np.random.default_rng(0)
  x = rng.standard_normal((64, 32)).astype(np.float32)
  conv = rng.standard_normal((65, 3, layer.w_qkv.shape[0])).astype(np.float32)
  delta = rng.standard_normal((65, 2, 128, 12)).astype(np.float32) * 0.1

  @nnx.jit
  def step(layer, x, conv, delta):
    r = x.shape[0]
    rows = StepRows(
      starts=jnp.arange(r), lengths=jnp.ones(r, jnp.int32), slots=jnp.arange(1, r + 1),
      fresh=jnp.zeros(r, bool), max_length=jnp.int32(1),
    )  # fmt: skip
    out, conv, delta = layer(x, conv, delta, rows)
    return out[0], conv[1], delta[1]

  alone = step(layer, x[:1], conv[:2], delta[:2])
  among = step(layer, x, conv, delta)
  for a, b in zip(alone, among):
    np.testing.assert_array_equal(_bits(a), _bits(b))


def test_k_step_loop_gives_a_row_that_stopped_the_null_state_slot():
  """A row that stops inside the k-step loop (its lookahead pages used up) while others go on
  computes into the null slot 0 from then on, so its state stays that of its last sampled
  token for the step after the loop."""
  from jaxengine.worker.multi_step import DecodeStepsInputs, _decode_metadata

  inputs = DecodeStepsInputs(
    block_tables=jnp.ones((3, 4), jnp.int32), num_reqs=jnp.int32(3),
    max_num_steps=jnp.asarray([4, 1, 0]), max_output_tokens=jnp.full(3, 9),
    stop_ids=jnp.full((3, 1), -1), end_on_first_finish=jnp.bool_(False),
    state_slots=jnp.asarray([2, 3, 1], jnp.int32),
  )  # fmt: skip
  running = jnp.asarray([True, False, False])
  metadata = _decode_metadata(inputs, jnp.asarray([5, 6, 7]), running, block_size=4)
  assert metadata.state_slots.tolist() == [2, 0, 0]


def test_image_text_checkpoint_text_decoder_matches_transformers(tmp_path):
  hf_model = _write(tmp_path, multimodal=True)
  model, config = load_safetensors(tmp_path)
  assert isinstance(model, Qwen3_5) and config.checkpoint_prefix == "model.language_model."
  assert config.rotary_dim == 8 and config.rope_theta == 1000.0
  prompt = PROMPTS[0]
  got = np.asarray(token_logprobs(model, jnp.asarray([prompt], jnp.int32)))[0]
  np.testing.assert_allclose(got, hf_prompt_logprobs(hf_model, prompt), atol=1e-4)


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
  fields = {k: v for k, v in TEXT.items() if k != "intermediate_size"}
  config = transformers.Qwen3_5MoeTextConfig(
    **fields,
    moe_intermediate_size=24,
    shared_expert_intermediate_size=40,
    num_experts=4,
    num_experts_per_tok=2,
  )
  torch.manual_seed(0)
  hf_model = transformers.Qwen3_5MoeForCausalLM(config).eval()
  _randomise(hf_model, 0)
  directory = tmp_path_factory.mktemp("qwen3_5_moe")
  hf_model.save_pretrained(directory)
  return directory, hf_model


@pytest.fixture(scope="module")
def moe_llm(moe_checkpoint):
  """One MoE engine (chunks of 8 tokens, a LoRA slot, the routed experts returned) for the
  adapter and routing tests, its steps in one shape (`one_shape`)."""
  options = {**ENGINE, "max_num_reqs": 2}
  return one_shape(je.LLM(moe_checkpoint[0], enable_return_routed_experts=True, **options))


def test_moe_checkpoint_matches_transformers(moe_checkpoint):
  """``Qwen3_5MoeForCausalLM``: 4 routed experts (2 per token, renormalised) and a gated shared
  expert on every layer, per-expert checkpoint tensors; transformers' logprobs."""
  directory, hf_model = moe_checkpoint
  model, loaded = load_safetensors(directory)
  assert loaded.num_experts == 4 and loaded.shared_expert_intermediate_size == 40
  for prompt in PROMPTS[:2]:
    got = np.asarray(token_logprobs(model, jnp.asarray([prompt], jnp.int32)))[0]
    np.testing.assert_allclose(got, hf_prompt_logprobs(hf_model, prompt), atol=1e-4)


def test_moe_peft_adapter_on_experts_shared_expert_and_mixers(moe_checkpoint, moe_llm, tmp_path):
  """A rank-4 PEFT adapter on the routed experts (``target_parameters``), the shared expert
  (``gate_proj`` ... under ``mlp.shared_expert``) and both mixers: transformers + peft's greedy
  tokens and prompt logprobs within 1e-4."""
  import peft

  directory, hf_model = moe_checkpoint
  base = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
  config = peft.LoraConfig(
    r=4, lora_alpha=8, lora_dropout=0.0,
    target_modules=["q_proj", "o_proj", "in_proj_qkv", "gate_proj", "up_proj", "down_proj"],
    target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
  )  # fmt: skip
  adapted = random_peft_adapter(base, config, tmp_path / "adapter", seed=2)
  llm = moe_llm
  request = je.LoRARequest("moe", 1, str(tmp_path / "adapter"))
  manager = llm.llm_engine.runner.lora
  pairs = manager.load(request).weights
  assert {(0, "experts.down_proj"), (0, "shared_expert.up_proj")} <= set(pairs)
  ((tokens, logprobs),) = _greedy_with_prompt_logprobs(llm, PROMPTS[:1], lora_request=request)
  assert tokens == hf_greedy(adapted, PROMPTS[0], MAX_TOKENS)
  want = hf_prompt_logprobs(adapted, PROMPTS[0])
  np.testing.assert_allclose(logprobs, want, atol=1e-4)
  assert np.abs(want - hf_prompt_logprobs(hf_model, PROMPTS[0])).max() > 0.1


def test_prefix_cache_hits_start_from_saved_states_and_give_transformers_tokens(checkpoint):
  """With ``enable_prefix_caching=True`` states are saved at the last block boundary each prefill
  chunk reaches (a budget of 40 tokens, blocks of 4). A prompt of 45 tokens, its first chunk of
  40 run in chunks of the delta rule (`jaxengine.models.delta_rule.by_chunk`), gives
  transformers' prompt logprobs and greedy tokens; repeated, it hits 44 tokens (its last full
  block); a prompt sharing its first 40 (the first chunk's end) hits 40; each gives transformers'
  tokens and the logprobs computed from scratch. After `reset_prefix_cache` nothing hits."""
  hf_model = checkpoint[1]
  llm = je.LLM(checkpoint[0], max_num_reqs=2, max_model_len=64, block_size=4,
               max_num_batched_tokens=40, enable_prefix_caching=True)  # fmt: skip
  prompt = [(7 * i + 3) % TEXT["vocab_size"] for i in range(45)]
  sibling = [*prompt[:40], 40, 41, 42, 43, 44]

  def run(tokens, prompt_logprobs=None):
    params = je.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1,
                               prompt_logprobs=prompt_logprobs)  # fmt: skip
    before = llm.llm_engine.kv_cache_stats.prefix_cache_hits
    (out,) = llm.generate([tokens], params, use_tqdm=False)
    ids = list(out.outputs[0].token_ids)
    logprobs = [entry[t].logprob for entry, t in zip(out.outputs[0].logprobs, ids)]
    hits = llm.llm_engine.kv_cache_stats.prefix_cache_hits - before
    return out, ids, np.asarray(logprobs), hits

  out, first, first_logprobs, hits = run(prompt, prompt_logprobs=0)
  assert hits == 0 and first == hf_greedy(hf_model, prompt, MAX_TOKENS)
  got = [entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], prompt[1:])]
  np.testing.assert_allclose(got, hf_prompt_logprobs(hf_model, prompt), atol=1e-4)
  _, again, again_logprobs, hits = run(prompt)
  assert hits == 44 and again == first
  np.testing.assert_allclose(again_logprobs, first_logprobs, atol=1e-5)
  _, shared, _, hits = run(sibling)
  assert hits == 40 and shared == hf_greedy(hf_model, sibling, MAX_TOKENS)
  llm.reset_prefix_cache()
  _, after_reset, _, hits = run(prompt)
  assert hits == 0 and after_reset == first
  assert _free_state_slots(llm) == 2
  # The background compile's executables take the steps' inputs as the engine passes them:
  # lowering the one-row decode step it ran compiles nothing.
  from jaxengine.aot.executables import engine_executables
  from jaxengine.entrypoints.background_compile import RunnerParts

  parts = RunnerParts.of(llm.llm_engine.cores[0])
  (decode,) = [e for e in engine_executables(parts) if e.shape == "tokens=1 rows=1"]
  with count_compiles() as compiles:
    decode.lower().compile()
  assert compiles.count == 0


def test_moe_routed_experts_are_transformers_router_top_k_and_replay(moe_checkpoint, moe_llm):
  """``enable_return_routed_experts`` on the MoE hybrid (chunked prefill): each completion's
  ``[T - 1, 4 layers, 2]`` experts are transformers' router top-2 at every fed position, and
  replaying them through `token_logprobs` gives the logprobs of routing afresh."""
  directory, hf_model = moe_checkpoint
  engine = moe_llm
  params = je.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
  model = load_safetensors(directory)[0]
  for prompt, out in zip(PROMPTS[:2], engine.generate(PROMPTS[:2], params, use_tqdm=False)):
    completion = out.outputs[0]
    fed = prompt + list(completion.token_ids[:-1])
    with torch.no_grad():
      logits = hf_model(torch.tensor([fed]), output_router_logits=True).router_logits
    want = np.stack([torch.topk(x.double(), 2, dim=-1).indices.numpy() for x in logits], axis=1)
    assert completion.routed_experts.shape == (len(fed), 4, 2)
    np.testing.assert_array_equal(completion.routed_experts, want)
    ids = jnp.asarray([fed + [completion.token_ids[-1]]], jnp.int32)
    replayed = token_logprobs(model, ids, routed_experts=completion.routed_experts[None])
    np.testing.assert_allclose(replayed, token_logprobs(model, ids), atol=1e-6)
    other = (completion.routed_experts[None] + 1) % 4
    assert np.abs(token_logprobs(model, ids, routed_experts=other) - replayed).max() > 1e-3


def _dequantized(model, quantization: str):
  """A float copy of `model` whose ``QUANTIZABLE`` projections are their quantized values times
  their scales: what a quantized engine computes, in float."""
  graphdef, state = nnx.split(model)
  copy = nnx.merge(graphdef, jax.tree.map(lambda a: a, state))
  for _, module in nnx.iter_modules(copy):
    for name, axes in getattr(type(module), "QUANTIZABLE", {}).items():
      w = getattr(module, name)[...]
      rows = quantize_rows(w, quantization=quantization, in_axes=axes)
      setattr(module, name, nnx.Param(dequantize_rows(rows).astype(w.dtype)))
  return copy


def test_quantized_projections_and_what_stays_float(checkpoint):
  """``quantization``: every layer's projections (a linear layer's five, the gated attention's
  four, the MLP's three) are quantized; the convolution taps, decay parameters, norms,
  embedding and output head stay float32. Through `token_logprobs`, int8 and fp8 models equal
  their dequantized float copies within 1e-4."""
  model, _ = load_safetensors(checkpoint[0])
  quantized = quantize_model(model, "int8")
  names = {".".join(map(str, path[2:])) for path in quantized.leaves if path[1] in (0, 3)}
  assert names == {
    *(f"mixer.{w}" for w in ("w_qkv", "w_z", "w_b", "w_a", "w_out", "wq", "wk", "wv", "wo")),
    *(f"mlp.{w}" for w in ("w_gate", "w_up", "w_down")),
  }
  assert len(quantized.leaves) == 3 * 8 + 7
  prompt = jnp.asarray([PROMPTS[0]], jnp.int32)
  for fmt in ("int8", "fp8"):
    got = token_logprobs(quantize_model(model, fmt).model, prompt)
    np.testing.assert_allclose(got, token_logprobs(_dequantized(model, fmt), prompt), atol=1e-4)


def test_int8_engine_computes_its_dequantized_weights(checkpoint, llm):
  """An int8 engine (chunked prefill, preemption): its prompt logprobs and its greedy tokens'
  logprobs are those of the dequantized float model (`token_logprobs` over prompt and
  completion) within 1e-4; against the float engine its prompt logprobs stay within 0.5
  (measured 0.26: this random model is sensitive to its weights' rounding, each MLP matrix alone
  moving logprobs by 0.05-0.08 where the tiny Llama's whole int8 model moves them by 0.02)."""
  engine = one_shape(je.LLM(checkpoint[0], quantization="int8", **ENGINE))
  params = je.SamplingParams(
    temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, prompt_logprobs=0, logprobs=0
  )
  reference = _dequantized(load_safetensors(checkpoint[0])[0], "int8")
  outputs = engine.generate(PROMPTS, params, use_tqdm=False)
  for prompt, out, (_, float_logprobs) in zip(PROMPTS, outputs, _greedy_with_prompt_logprobs(llm)):
    tokens = list(out.outputs[0].token_ids)
    got = [e[t].logprob for e, t in zip(out.prompt_logprobs[1:], prompt[1:])]
    got += [e[t].logprob for e, t in zip(out.outputs[0].logprobs, tokens)]
    want = token_logprobs(reference, jnp.asarray([prompt + tokens], jnp.int32))[0]
    np.testing.assert_allclose(got, want, atol=1e-4)
    assert np.abs(np.asarray(got[: len(prompt) - 1]) - float_logprobs).max() < 0.5
  assert engine.llm_engine.kv_cache_stats.num_preemptions > 0


def test_fp8_pages_beside_a_float32_state_pool_stay_close(checkpoint, llm):
  """``kv_cache_dtype="fp8"``: the attention layer's pages are float8 (stored as bytes), the
  state pool stays float32; chunked prefill and preemption give the float32 pages' greedy tokens
  and prompt logprobs within the tiny models' fp8 bound (0.2, `tests/models/test_kv_cache_dtype.py`;
  measured 0.02). `jaxengine compile`'s memory plan counts both: a page a quarter of float32's,
  the pool's bytes unchanged."""
  from jaxengine.aot.executables import abstract_engine
  from jaxengine.aot.memory_plan import memory_plan
  from jaxengine.engine_config import EngineConfig
  from jaxengine.models.paged_attention import FP8_KV_STORAGE

  no_lora = {k: v for k, v in ENGINE.items() if "lora" not in k}
  engine = one_shape(je.LLM(checkpoint[0], kv_cache_dtype="fp8", **no_lora))
  cache = engine.llm_engine.cores[0].runner.kv_cache
  assert {page.dtype for layer in cache.pages for page in layer} == {np.dtype(FP8_KV_STORAGE)}
  pool = (*cache.recurrent.conv, *cache.recurrent.delta)
  assert {a.dtype for a in pool} == {np.dtype(np.float32)}
  gaps = []
  for (tokens, got), (want_tokens, want) in zip(
    _greedy_with_prompt_logprobs(engine), _greedy_with_prompt_logprobs(llm)
  ):
    assert tokens == want_tokens
    gaps.append(np.abs(np.asarray(got) - np.asarray(want)).max())
  assert 0 < max(gaps) < 0.2, gaps
  assert engine.llm_engine.kv_cache_stats.num_preemptions > 0 and _free_state_slots(engine) == 3
  plans = {}
  for dtype in ("auto", "fp8"):
    config = EngineConfig(max_num_reqs=2, kv_cache_dtype=dtype)
    abstract = abstract_engine(str(checkpoint[0]), config, jax.devices(), jnp.float32, "cpu")
    plans[dtype] = memory_plan(abstract, 2**30)
  assert plans["auto"].per_block == 4 * plans["fp8"].per_block
  assert plans["auto"].other == plans["fp8"].other  # the batch's state and the state pool


def _step_to_end(engine, outputs: dict) -> None:
  while engine.has_unfinished_requests():
    outputs.update((o.request_id, o) for o in engine.step())


def _hf_continue(old, new, fed: list[int], pending: list[int], n: int) -> list[int]:
  """transformers' `n` greedy tokens from a cache `old` wrote for `fed`, `new` feeding `pending`
  (the tokens not fed yet) one by one and then its own tokens."""
  if not fed:
    return hf_greedy(new, pending, n)
  pending, out = list(pending), []
  with torch.no_grad():
    cache = old(torch.tensor([fed]), use_cache=True).past_key_values
    for _ in range(len(pending) + n - 1):
      token = pending.pop(0) if pending else out[-1]
      logits = new(torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits
      if not pending:
        out.append(int(logits[0, -1].argmax()))
  return out


def test_pause_load_weights_resume_keeps_each_request_state(checkpoint, llm):
  """A "keep" pause with requests in flight (one decoding, one in a chunked prefill; pages for
  both: no preemption), `load_weights` while paused (nothing compiles), resume. Each request's
  state slot is kept as its pages are: the tokens after the pause are transformers' greedy
  continuation through the new weights of the cache the old weights wrote for the tokens fed
  before it (the same weights: transformers' tokens, as if never paused; other random weights:
  that mixed continuation, which a state recomputed or reset would miss). A request preempted
  after the pause would recompute its pages and state through the new weights."""
  engine = llm.llm_engine
  params = je.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
  weights = {name: np.asarray(value) for name, value in named_weights(engine.cores[0].runner.model)}
  other = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**TEXT)).eval()
  _randomise(other, 1)
  other_weights = {name: value.numpy() for name, value in other.state_dict().items()}
  prompts, preemptions = PROMPTS[1:], engine.kv_cache_stats.num_preemptions
  try:
    for run, (new_weights, hf_new) in enumerate([(weights, checkpoint[1]), (other_weights, other)]):
      outputs: dict = {}
      ids = [f"pause{run}-{i}" for i in range(len(prompts))]
      for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
      while ids[0] not in outputs:  # the short prompt's first token: pause
        outputs.update((o.request_id, o) for o in engine.step())
      outputs.update((o.request_id, o) for o in engine.pause_generation("keep"))
      read = {i: list(outputs[i].outputs[0].token_ids) if i in outputs else [] for i in ids}
      fed = {i: engine._requests[i].completions[0].num_computed_tokens for i in ids}
      with count_compiles() as compiles:
        engine.load_weights(new_weights)
      assert compiles.count == 0
      engine.resume_generation()
      _step_to_end(engine, outputs)
      for request_id, prompt in zip(ids, prompts):
        tokens, kept = list(outputs[request_id].outputs[0].token_ids), len(read[request_id])
        assert tokens[:kept] == read[request_id]
        seq, c = prompt + read[request_id], fed[request_id]
        want = _hf_continue(checkpoint[1], hf_new, seq[:c], seq[c:], MAX_TOKENS - kept)
        assert tokens[kept:] == want, (run, request_id, kept, c)
        if run:  # a state recomputed through the new weights would give other tokens
          assert want != _hf_continue(hf_new, hf_new, seq[:c], seq[c:], MAX_TOKENS - kept)
      kinds = sorted((len(read[i]) > 0) + (fed[i] > 0) for i in ids)  # 2: decoding, 1: prefilling
      assert kinds == [1, 2], (read, fed)
    assert engine.kv_cache_stats.num_preemptions == preemptions and _free_state_slots(llm) == 3
  finally:
    engine.load_weights(weights)


def test_sleep_frees_the_state_pool_and_wake_up_gives_the_same_tokens(llm):
  """``sleep(level=1)`` and ``sleep(level=2)`` (then `load_weights`): the state pool's buffers are
  freed with the pages, `wake_up` rebuilds it (zero, the same shapes) and nothing compiles; the
  greedy tokens and prompt logprobs are those of before the sleep, every slot free."""
  runner = llm.llm_engine.cores[0].runner
  weights = [(name, np.asarray(value)) for name, value in named_weights(runner.model)]
  want = _greedy_with_prompt_logprobs(llm, PROMPTS[:2])
  for level in (1, 2):
    pool = runner.kv_cache.recurrent
    shapes = [a.shape for a in (*pool.conv, *pool.delta)]
    assert any(np.abs(np.asarray(a)).max() > 0 for a in pool.delta)  # the requests' states
    llm.sleep(level=level)
    assert all(a.is_deleted() for a in (*pool.conv, *pool.delta))
    with count_compiles() as compiles:
      llm.wake_up()
      if level == 2:
        llm.load_weights(weights)
      woken = runner.kv_cache.recurrent
      assert [a.shape for a in (*woken.conv, *woken.delta)] == shapes
      assert not any(np.asarray(a).any() for a in (*woken.conv, *woken.delta))
      assert _greedy_with_prompt_logprobs(llm, PROMPTS[:2]) == want
    assert compiles.count == 0, level
  assert _free_state_slots(llm) == 3


def _module(**fields) -> Qwen3_5:
  hf = transformers.Qwen3_5TextConfig(**{**TEXT, **fields}).to_dict()
  return Qwen3_5(config_from_hf(hf, "qwen3_5"), rngs=nnx.Rngs(0))


def test_a_hybrid_without_attention_layers_is_refused_by_name():
  """Pages hold the attention layers' keys and values: a model of linear layers only is refused
  naming its ``layer_types``."""
  model = _module(num_hidden_layers=3, layer_types=["linear_attention"] * 3)
  with pytest.raises(ValueError, match=r"layer_types=.*needs at least one full-attention layer"):
    je.LLM(model, max_num_reqs=2, max_model_len=32, block_size=4)


def test_a_memory_too_small_for_the_state_pool_names_its_slots():
  """With prefix caching and drafts, the pool's slots (the null slot, ``k + 1`` a request, the
  snapshots) are named where the memory is too small for them."""
  spec = {"method": "ngram", "num_speculative_tokens": 3}
  with pytest.raises(
    ValueError,
    match=r"\(21 slots with the null slot: 4 a request .*"
    r"speculative decoding's draft states\), 4 prefix-cache snapshots; ",
  ):
    je.LLM(_module(), max_num_reqs=4, max_model_len=32, block_size=4, kv_cache_memory_bytes=4096,
           enable_prefix_caching=True, speculative_config=spec)  # fmt: skip


def test_routed_experts_of_a_dense_hybrid_are_refused():
  """A dense Qwen3.5 has no MoE layers whose experts `enable_return_routed_experts` could
  return: refused by name."""
  with pytest.raises(ValueError, match=r"enable_return_routed_experts=.*Qwen3_5"):
    je.LLM(_module(), max_num_reqs=2, max_model_len=32, enable_return_routed_experts=True)


def test_named_weights_give_back_the_checkpoint_tensors(checkpoint):
  """`named_weights` (what `LLM.load_weights` takes) returns every tensor in the checkpoint's
  layout: ``in_proj_qkv``'s and ``conv1d``'s rows back in ``[q | k | v]`` order from the
  model's key-head groups (which differ from it: 2 key heads)."""
  import safetensors.numpy

  from jaxengine.models import named_weights

  model, _ = load_safetensors(checkpoint[0])
  tensors = safetensors.numpy.load_file(checkpoint[0] / "model.safetensors")
  named = {name: np.asarray(value) for name, value in named_weights(model)}
  assert named.keys() == tensors.keys()
  for name, value in named.items():
    np.testing.assert_array_equal(value, tensors[name], err_msg=name)
  stored = np.asarray(model.layers[0].mixer.w_qkv[...])
  assert not np.array_equal(stored, tensors["model.layers.0.linear_attn.in_proj_qkv.weight"])


def test_a_model_axis_that_does_not_divide_the_key_heads_is_refused():
  """The Gated DeltaNet layers split by key head: 4 devices for 2 key heads are refused before
  anything is built (the config's other fields as the engine's defaults)."""
  import types

  from jaxengine.worker.recurrent_state import check_hybrid_config

  config = types.SimpleNamespace(
    enable_prefix_caching=None, speculative_config=None, scan_layers=False,
    tensor_parallel_size=4, mesh=None,
  )  # fmt: skip
  with pytest.raises(ValueError, match=r"tensor_parallel_size=4 .* linear_num_key_heads=2"):
    check_hybrid_config(_module(), config)


def test_config_defaults_and_refusals():
  hf = dict(TEXT, layer_types=None, num_hidden_layers=8, rope_parameters=None)
  config = config_from_hf(hf, "qwen3_5")
  assert config.attention_layers == (3, 7) and config.linear_layers == (0, 1, 2, 4, 5, 6)
  assert config.partial_rotary_factor == 0.25 and config.rope_theta == 10000.0
  assert config.kv_cache_spec().num_layers == 2
  with pytest.raises(ValueError, match="attention_bias"):
    config_from_hf(dict(TEXT, attention_bias=True), "qwen3_5")
  with pytest.raises(ValueError, match="rope type 'yarn'"):
    config_from_hf(dict(TEXT, rope_parameters={"rope_type": "yarn"}), "qwen3_5")
  with pytest.raises(ValueError, match="layer_types"):
    config_from_hf(dict(TEXT, layer_types=["mamba"] * 4), "qwen3_5")


def test_state_pool_comes_out_of_kv_cache_memory_bytes():
  """``max_num_reqs + 1`` state slots beside the pages; their bytes leave the pages the rest of
  ``kv_cache_memory_bytes`` (a page: 4 positions of 2 heads of 16, keys and values, float32, one
  attention layer), and a budget that holds no page beside them is refused."""
  model = _module()
  pool_bytes = 3 * model.recurrent_state_spec.bytes_per_slot
  page_bytes = 4 * 2 * 16 * 2 * 4
  kw = dict(max_num_reqs=2, max_model_len=32, block_size=4)
  llm = je.LLM(model, kv_cache_memory_bytes=pool_bytes + 20 * page_bytes, **kw)
  runner = llm.llm_engine.cores[0].runner
  assert runner.num_blocks == 20 and runner.kv_cache.recurrent.num_slots == 3
  with pytest.raises(ValueError, match=r"kv_cache_memory_bytes=.*recurrent state"):
    je.LLM(model, kv_cache_memory_bytes=pool_bytes, **kw)


def test_ahead_of_time_compilation_lowers_the_steps_with_the_state_pool(checkpoint):
  """`jaxengine compile`'s engine (`abstract_engine`, here for this CPU): the state pool beside
  the pages (its bytes in the memory plan), the ragged step and the k-step loop lowered with the
  rows' state slots; with speculative decoding ``k + 1`` slots per row and the verify step
  lowered with the rows' routes (draft slots)."""
  from jaxengine.aot.executables import abstract_engine, engine_executables
  from jaxengine.aot.memory_plan import memory_plan
  from jaxengine.engine_config import EngineConfig

  config = EngineConfig(max_num_reqs=2, max_num_batched_tokens=8, num_decode_steps=2)
  engine = abstract_engine(str(checkpoint[0]), config, jax.devices(), jnp.float32, "cpu")
  pool_bytes = 3 * load_safetensors(checkpoint[0])[0].recurrent_state_spec.bytes_per_slot
  with_pool = memory_plan(engine, 2**30).other
  engine.recurrent_pool = lambda: None  # the same engine's plan without a pool
  assert with_pool == memory_plan(engine, 2**30).other + pool_bytes
  del engine.recurrent_pool
  engine.set_num_blocks(8)
  assert engine.kv_cache.recurrent.delta[0].shape == (3, 4, 8, 12)
  executables = {e.name: e for e in engine_executables(engine)}
  for name in ("ragged_step", "decode_steps"):
    executables[name].lower()  # the model's state slots traced: StepRows needs them
  spec = {"method": "ngram", "num_speculative_tokens": 2}
  engine = abstract_engine(
    str(checkpoint[0]), config.replace(speculative_config=spec), jax.devices(), jnp.float32, "cpu"
  )
  engine.set_num_blocks(8)
  assert engine.kv_cache.recurrent.delta[0].shape == (7, 4, 8, 12)  # 1 + 2 rows x 3 slots
  verify = next(e for e in engine_executables(engine) if e.name == "verify_step")
  verify.lower()
