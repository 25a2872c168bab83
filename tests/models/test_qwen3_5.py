"""Qwen3.5 hybrid checkpoints (Gated DeltaNet and gated attention) against transformers.

A tiny random ``Qwen3_5ForCausalLM`` (layers linear, linear, linear, full; 2 key and 4 value heads
in the linear layers, a partial rotary embedding) is built and saved by transformers, float32,
every tensor randomised (norm offsets too). One engine with a small token budget (chunked
prefill) and a pool of pages too small for its requests at once (preemption) must give
transformers' greedy tokens and prompt logprobs within 1e-4; seeded ``n > 1`` requests the same
samples together as one by one; every recurrent state slot free at the end.
``tensor_parallel_size=2`` (a subprocess on 2 host devices, its layers scanned) equals the
one-device engine (with a LoRA adapter too); a PEFT adapter on every projection gives
transformers + peft's tokens and logprobs; ``batch_invariant=True`` with the k-step loop gives a
request the same bits alone, in a shuffled batch and in `token_logprobs`; prefix-cache hits start
from saved states; int8 engines compute their dequantized weights, fp8 pages stay close; a "keep"
pause with `load_weights` keeps each request's state as its pages; sleep and wake rebuild the
pool. The MoE and image-text checkpoints: tests/models/test_qwen3_5_moe.py; layers, configs and
refusals: test_qwen3_5_units.py; scanned layers: test_qwen3_5_scan.py; speculative decoding:
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
from jaxengine.models.quantization import dequantize_rows, quantize_rows
from jaxengine.models.safetensors_loader import load_safetensors
from jaxengine.testing import count_compiles

pytestmark = pytest.mark.bitwise  # compares bits between programs: tests/conftest.py

TEXT = dict(
  vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
  linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=12,
  linear_num_key_heads=2, linear_num_value_heads=4,
  layer_types=["linear_attention"] * 3 + ["full_attention"],
  rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5},
)  # fmt: skip
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
#: LoRA slot (base requests add nothing from it). Every engine here has its 3 rows and 64
#: positions (the prefix-cache test's 53 tokens fit): they share the sampler's executable.
ENGINE = dict(
  max_num_reqs=3, max_model_len=64, block_size=4, num_kv_blocks=14, max_num_batched_tokens=8,
  enable_lora=True, max_loras=1, max_lora_rank=4,
)  # fmt: skip
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
    (list(out.outputs[0].token_ids), [e[t].logprob for e, t in zip(out.prompt_logprobs[1:], p[1:])])
    for p, out in zip(prompts, outputs)
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


def _padded(sequences) -> jax.Array:
  """``[B, T]`` ids, the shorter sequences padded at the end with id 0: one `token_logprobs`
  call (one compile) for them all, each row's values up to its length its own."""
  length = max(map(len, sequences))
  return jnp.asarray([[*s, *[0] * (length - len(s))] for s in sequences], jnp.int32)


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


def test_prefix_cache_hits_start_from_saved_states_and_give_transformers_tokens(checkpoint):
  """With ``enable_prefix_caching=True`` states are saved at the last block boundary each prefill
  chunk reaches (a budget of 40 tokens, blocks of 4). A prompt of 45 tokens, its first chunk of
  40 run in chunks of the delta rule (`jaxengine.models.delta_rule.by_chunk`), gives
  transformers' prompt logprobs and greedy tokens; repeated, it hits 44 tokens (its last full
  block); a prompt sharing its first 40 (the first chunk's end) hits 40; each gives transformers'
  tokens and the logprobs computed from scratch. After `reset_prefix_cache` nothing hits."""
  hf_model = checkpoint[1]
  sizes = {k: ENGINE[k] for k in ("max_num_reqs", "max_model_len", "block_size")}
  llm = je.LLM(checkpoint[0], max_num_batched_tokens=40, enable_prefix_caching=True, **sizes)
  runner = llm.llm_engine.cores[0].runner  # the steps in the budget's shape or a decode's
  runner.token_buckets = [runner.token_buckets[0], runner.token_buckets[-1]]
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
  assert _free_state_slots(llm) == 3
  # The background compile's executables take the steps' inputs as the engine passes them:
  # lowering the one-row decode step it ran compiles nothing.
  from jaxengine.aot.executables import engine_executables
  from jaxengine.entrypoints.background_compile import RunnerParts

  parts = RunnerParts.of(llm.llm_engine.cores[0])
  (decode,) = [e for e in engine_executables(parts) if e.shape == "tokens=1 rows=1"]
  with count_compiles() as compiles:
    decode.lower().compile()
  assert compiles.count == 0


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
  sequences = [prompt + list(out.outputs[0].token_ids) for prompt, out in zip(PROMPTS, outputs)]
  wants = np.asarray(token_logprobs(reference, _padded(sequences)))  # one call, one compile
  floats = _greedy_with_prompt_logprobs(llm)
  for prompt, out, want, (_, float_logprobs) in zip(PROMPTS, outputs, wants, floats):
    tokens = list(out.outputs[0].token_ids)
    got = [e[t].logprob for e, t in zip(out.prompt_logprobs[1:], prompt[1:])]
    got += [e[t].logprob for e, t in zip(out.outputs[0].logprobs, tokens)]
    np.testing.assert_allclose(got, want[: len(got)], atol=1e-4)
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
