"""Mixture-of-experts checkpoints (Qwen3-MoE, Mixtral) against transformers' own models.

Tiny random checkpoints are made with transformers' model classes (float32, weights redrawn with
standard deviation ``fan_in ** -0.5`` so that routing matters) and written with
``save_pretrained``, which stores every expert under its own name as Hub checkpoints do
(``model.layers.0.mlp.experts.3.up_proj.weight``). The transformers model in memory is the
reference: greedy tokens, prompt logprobs, the trainer's `token_logprobs`. The Qwen3-MoE model
mixes sparse and dense layers (``mlp_only_layers``); Mixtral is sparse on every layer. Nothing here
touches the network.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch
from moe_checkpoints import CASES, VOCAB, hf_moe_model
from step_shapes import one_shape
from subprocess_utils import run_python

import jaxengine as je
from jaxengine.engine import EngineConfig
from jaxengine.models import load_safetensors, token_logprobs
from jaxengine.parallel import check_experts

pytestmark = pytest.mark.bitwise  # compares bits between programs: tests/conftest.py

PROMPT = [5, 17, 90, 3, 64, 21, 8, 77, 33, 7, 41, 12, 60, 2, 19, 44, 81, 9, 26]  # 19 tokens
GREEDY = je.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=0)


def _hf_log_softmax(model, token_ids) -> np.ndarray:
  """``[T, V]`` float64 log-softmax of one full forward pass (no cache)."""
  with torch.no_grad():
    logits = model(torch.tensor([token_ids])).logits[0].double()
  return torch.log_softmax(logits, -1).numpy()


def _hf_greedy(model, prompt, num_tokens) -> list[int]:
  tokens = list(prompt)
  for _ in range(num_tokens):
    tokens.append(int(_hf_log_softmax(model, tokens)[-1].argmax()))
  return tokens[len(prompt) :]


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
  """``(case, transformers model, directory, engine)``: one engine per architecture, returning
  its routed experts (the tests of its tokens and logprobs check that the flag changes none),
  its steps in one shape (`one_shape`: compared with transformers, buckets are not the point),
  in the size of the module's other engines (2 rows, 64 positions: one sampler compile)."""
  case = request.param
  model = hf_moe_model(case)
  directory = tmp_path_factory.mktemp(case)
  model.save_pretrained(directory)
  llm = je.LLM(directory, max_num_reqs=2, max_model_len=64, enable_return_routed_experts=True)
  return case, model, directory, one_shape(llm)


def _prompt_logprobs(output, prompt) -> list[float]:
  return [entries[t].logprob for entries, t in zip(output.prompt_logprobs[1:], prompt[1:])]


def test_checkpoint_names_are_per_expert_as_on_the_hub(checkpoint):
  case, _, directory, _ = checkpoint
  names = set(safetensors.numpy.load_file(Path(directory) / "model.safetensors"))
  block, down = ("mlp", "down_proj") if case == "qwen3_moe" else ("block_sparse_moe", "w2")
  assert f"model.layers.0.{block}.experts.1.{down}.weight" in names
  assert f"model.layers.0.{block}.gate.weight" in names
  _, config = load_safetensors(directory)
  if case == "qwen3_moe":
    assert config.moe_layers == (0, 2) and config.num_experts == 8
    assert not config.norm_topk_prob and "model.layers.1.mlp.gate_proj.weight" in names
  else:
    assert config.moe_layers == (0, 1) and config.num_experts == 4 and config.norm_topk_prob


def test_greedy_tokens_and_prompt_logprobs_match_transformers(checkpoint):
  case, model, _, llm = checkpoint
  (out,) = llm.generate(PROMPT, GREEDY, use_tqdm=False)
  assert out.outputs[0].token_ids == _hf_greedy(model, PROMPT, GREEDY.max_tokens)
  reference = _hf_log_softmax(model, PROMPT)
  want = [reference[t, token] for t, token in enumerate(PROMPT[1:])]
  np.testing.assert_allclose(_prompt_logprobs(out, PROMPT), want, atol=1e-4, rtol=0)
  if case == "qwen3_moe":  # the routing weights matter: renormalising them moves the logprobs
    routers = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    for router in routers:
      router.norm_topk_prob = True
    flipped = _hf_log_softmax(model, PROMPT)
    for router in routers:
      router.norm_topk_prob = False
    assert np.abs(flipped - reference).max() > 1e-2


def test_trainer_token_logprobs_match_transformers(checkpoint):
  _, model, directory, _ = checkpoint
  module, _ = load_safetensors(directory)
  sequences = [PROMPT, PROMPT[::-1]]
  got = np.asarray(token_logprobs(module, jnp.asarray(sequences, jnp.int32)))
  for row, sequence in zip(got, sequences):
    reference = _hf_log_softmax(model, sequence)
    want = [reference[t, token] for t, token in enumerate(sequence[1:])]
    np.testing.assert_allclose(row, want, atol=1e-4, rtol=0)


def test_load_weights_by_checkpoint_names_compiles_nothing(checkpoint, compile_counter):
  case, _, directory, llm = checkpoint
  tensors = safetensors.numpy.load_file(Path(directory) / "model.safetensors")
  (baseline,) = llm.generate(PROMPT, GREEDY, use_tqdm=False)
  block, up = ("mlp", "up_proj") if case == "qwen3_moe" else ("block_sparse_moe", "w3")
  router = f"model.layers.0.{block}.gate.weight"
  changed = dict(tensors)
  changed[router] = -tensors[router]  # every token routed to other experts
  for j in range(2):  # and two experts' up projections zeroed
    name = f"model.layers.0.{block}.experts.{j}.{up}.weight"
    changed[name] = np.zeros_like(tensors[name])
  compile_counter.reset()
  llm.load_weights(changed)
  (other,) = llm.generate(PROMPT, GREEDY, use_tqdm=False)
  assert _prompt_logprobs(other, PROMPT) != _prompt_logprobs(baseline, PROMPT)
  llm.load_weights(tensors)
  (again,) = llm.generate(PROMPT, GREEDY, use_tqdm=False)
  assert again.outputs[0].token_ids == baseline.outputs[0].token_ids
  assert _prompt_logprobs(again, PROMPT) == _prompt_logprobs(baseline, PROMPT)
  assert compile_counter.count == 0


def test_batch_invariant_mode_keeps_a_tokens_bits_among_others(tmp_path):
  """The grouped products run ``ROW_TILE`` sorted rows at a time: a request's logprobs are the
  same bits alone and beside others (whose tokens land in the same tiles and experts), and the
  trainer's `token_logprobs` equals them (Qwen3-MoE: sparse and dense layers)."""
  hf_moe_model("qwen3_moe", seed=2).save_pretrained(tmp_path)
  module, _ = load_safetensors(tmp_path)
  llm = je.LLM(module, max_num_reqs=8, max_model_len=64, batch_invariant=True)
  params = je.SamplingParams(temperature=0, max_tokens=5, logprobs=0, prompt_logprobs=0)
  (alone,) = llm.generate(PROMPT, params, use_tqdm=False)
  rng = np.random.default_rng(3)
  others = [rng.integers(0, VOCAB, size=int(n)).tolist() for n in rng.integers(3, 30, size=5)]
  crowd = llm.generate([PROMPT, *others], params, use_tqdm=False)
  assert crowd[0].outputs[0].token_ids == alone.outputs[0].token_ids
  bits = lambda values: np.asarray(values, np.float32).view(np.int32)
  sample = lambda out: [
    d[t].logprob for d, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)
  ]
  np.testing.assert_array_equal(bits(sample(crowd[0])), bits(sample(alone)))
  np.testing.assert_array_equal(
    bits(_prompt_logprobs(crowd[0], PROMPT)), bits(_prompt_logprobs(alone, PROMPT))
  )
  sequence = jnp.asarray([PROMPT + list(alone.outputs[0].token_ids)], jnp.int32)
  trainer = np.asarray(token_logprobs(module, sequence))[0]
  np.testing.assert_array_equal(
    bits(trainer[: len(PROMPT) - 1]), bits(_prompt_logprobs(alone, PROMPT))
  )
  np.testing.assert_array_equal(bits(trainer[len(PROMPT) - 1 :]), bits(sample(alone)))


# --------------------------------------------------------------------------- mesh

# The model's forward pass on the mesh, not the engine's steps: on 2 host devices of a 2-core
# machine the engine's sampler step can hang in XLA:CPU's collectives (dense models too, on this
# branch's base); the forward pass's only collectives are its all-reduces. The engine is still
# built on the mesh, to check where it puts the experts.
MESH_SCRIPT = """
import os, sys
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
import jaxengine as je
from jaxengine import parallel
from jaxengine.models import load_safetensors, sequence_logits
from jaxengine.models.registry import sharding_rules
from jaxengine.models.attention_backends import XlaAttentionBackend
from jaxengine.models.sequence_logprobs import scratch_step
directory, prompt = sys.argv[1], [int(t) for t in sys.argv[2].split(",")]
model, _ = load_safetensors(directory)
graphdef, state = nnx.split(model)
n = len(prompt)
def logits(state):
  return sequence_logits(nnx.merge(graphdef, state), np.asarray([prompt], np.int32))[0]
@jax.jit
def routing(state):  # [T, M, k] the routed experts the engine's step returns
  m = nnx.merge(graphdef, state)
  m.set_attributes(return_routed_experts=True)
  metadata, cache = scratch_step(m, 1, n, 16, XlaAttentionBackend(max_context=n))
  ids, positions = jnp.asarray([prompt], jnp.int32), jnp.arange(n, dtype=jnp.int32)[None]
  return m(ids, positions, cache, metadata)[2][0]
one = np.asarray(logits(state))
one_routing = np.asarray(routing(state))
mesh = parallel.make_mesh(2)
for expert_parallel in (False, True):
  shardings = parallel.weight_shardings(state, mesh, sharding_rules(model), expert_parallel=expert_parallel)
  got = np.asarray(logits(jax.device_put(state, shardings)))
  assert (got.argmax(-1) == one.argmax(-1)).all(), expert_parallel
  print(expert_parallel, "max diff", float(np.abs(got - one).max()))
  got_routing = np.asarray(routing(jax.device_put(state, shardings)))
  print(expert_parallel, "routing", got_routing.shape, bool((got_routing == one_routing).all()))
  llm = je.LLM(directory, max_num_reqs=2, max_model_len=64, tensor_parallel_size=2,
               enable_expert_parallel=expert_parallel, enable_return_routed_experts=True)
  layer = llm.llm_engine.runner.weights["layers"][0]["mlp"]
  names = ("expert_up", "expert_down", "router")
  print(expert_parallel, "specs", [tuple(layer[n][...].sharding.spec) for n in names])
  dense = llm.llm_engine.runner.weights["layers"][1]["mlp"]["w_up"][...]
  print(expert_parallel, "dense", tuple(dense.sharding.spec))
"""


def test_tensor_and_expert_parallel_match_one_device(tmp_path):
  """Qwen3-MoE on 2 host devices: each expert split on its intermediate features (default), or
  whole experts per device (``enable_expert_parallel``): the logits of one device within 1e-5
  (the same argmax at every position) and its routed experts, the engine's weights placed so
  (an engine returning routed experts)."""
  hf_moe_model("qwen3_moe", seed=1).save_pretrained(tmp_path)
  out = run_python(MESH_SCRIPT, os.fspath(tmp_path), ",".join(map(str, PROMPT)), timeout=900)
  diffs = [float(line.split()[-1]) for line in out.splitlines() if "max diff" in line]
  assert len(diffs) == 2 and max(diffs) < 1e-5, out
  n = len(PROMPT)  # routed experts on the mesh: those of one device
  assert f"False routing ({n}, 2, 2) True" in out and f"True routing ({n}, 2, 2) True" in out
  assert "False specs [(None, None, 'model'), (None, 'model', None), ()]" in out
  assert "True specs [('model', None, None), ('model', None, None), ()]" in out
  assert "False dense ('model', None)" in out and "True dense ('model', None)" in out


def test_expert_parallel_needs_the_devices_to_divide_the_experts():
  check_experts(8, 2)
  with pytest.raises(ValueError, match=r"tensor_parallel_size=3 must divide .* num_experts=8"):
    check_experts(8, 3)
  with pytest.raises(ValueError, match="enable_expert_parallel must be a bool, got 'yes'"):
    EngineConfig(enable_expert_parallel="yes")


# --------------------------------------------------------------------------- routed experts


def _hf_routed_experts(model, token_ids, top_k: int = 2) -> np.ndarray:
  """``[T, M, k]`` transformers' router top-k (``output_router_logits``) at every position."""
  with torch.no_grad():
    out = model(torch.tensor([token_ids]), output_router_logits=True)
  probs = [torch.softmax(logits.double(), -1) for logits in out.router_logits]  # M of [T, X]
  return np.stack([torch.topk(p, top_k, dim=-1).indices.numpy() for p in probs], axis=1)


def _check_routing(model, prompt, completion) -> None:
  """A completion's routed experts are transformers' router top-k over its fed positions."""
  routed = completion.routed_experts
  assert routed.dtype == np.int32 and routed.shape[0] == len(prompt) + len(completion.token_ids) - 1
  np.testing.assert_array_equal(
    routed, _hf_routed_experts(model, prompt + completion.token_ids[:-1])
  )


def test_routed_experts_equal_transformers_router_top_k(checkpoint):
  """Prompt and generated positions, greedy and seeded n = 2 samples, and a request aborted by
  a pause (its positions so far)."""
  _, model, _, llm = checkpoint
  prompts = [PROMPT, PROMPT[5:] + PROMPT[:3]]
  seeded = je.SamplingParams(max_tokens=5, n=2, seed=3, ignore_eos=True)
  outs = llm.generate(prompts, [GREEDY, seeded], use_tqdm=False)
  num_moe_layers = 2  # qwen3_moe: layers 0 and 2 of 3; mixtral: both layers
  assert outs[0].outputs[0].routed_experts.shape == (len(PROMPT) + 5, num_moe_layers, 2)
  for prompt, out in zip(prompts, outs):
    for completion in out.outputs:
      _check_routing(model, prompt, completion)
  engine = llm.llm_engine
  engine.add_request("partial", PROMPT, je.SamplingParams(temperature=0, max_tokens=20))
  generated = 0
  while generated < 2:  # a few tokens in, likely with a step in flight
    generated = max([len(o.outputs[0].token_ids) for o in engine.step()] or [generated])
  engine.step()
  (aborted,) = engine.pause_generation(mode="abort")
  engine.resume_generation()
  completion = aborted.outputs[0]
  assert completion.finish_reason == "abort" and 1 <= len(completion.token_ids) < 20
  _check_routing(model, PROMPT, completion)


def _forced_routers(model, experts: np.ndarray):
  """Patches each transformers router to route to ``experts [T, M, k]`` (weights from its own
  softmax, renormalised as it does); returns a function that undoes it."""
  routers = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
  routers = routers or [layer.mlp.gate for layer in model.model.layers]
  saved = [router.forward for router in routers]
  for j, router in enumerate(routers):

    def forward(hidden, router=router, j=j):
      logits = torch.nn.functional.linear(hidden.reshape(-1, router.hidden_dim), router.weight)
      probs = torch.softmax(logits.float(), dim=-1)
      index = torch.as_tensor(experts[:, j], dtype=torch.long)
      weights = torch.gather(probs, 1, index)
      if getattr(router, "norm_topk_prob", True):  # Mixtral always renormalises
        weights = weights / weights.sum(-1, keepdim=True)
      return logits, weights.to(logits.dtype), index

    router.forward = forward

  def undo():
    for router, original in zip(routers, saved):
      router.forward = original

  return undo


def test_token_logprobs_replays_the_rollouts_routing(checkpoint):
  """With the rollout's weights replay changes no bit; with a perturbed router the replayed
  logprobs are those of a forward routed as the rollout was (transformers with its routers
  forced), not the new router's."""
  _, model, directory, llm = checkpoint
  (out,) = llm.generate(PROMPT, GREEDY, use_tqdm=False)
  completion = out.outputs[0]
  sequence = PROMPT + completion.token_ids
  routed = completion.routed_experts[None]  # [1, T - 1, M, k]
  module, _ = load_safetensors(directory)
  ids = jnp.asarray([sequence], jnp.int32)
  plain = np.asarray(token_logprobs(module, ids))
  np.testing.assert_array_equal(
    np.asarray(token_logprobs(module, ids, routed_experts=routed)), plain
  )
  router = module.layers[0].mlp.router
  rng = np.random.default_rng(0)
  router[...] = router[...] + jnp.asarray(rng.normal(0, 0.5, router.shape), router.dtype)
  perturbed = {name: p.detach().clone() for name, p in model.named_parameters()}
  hf_router = next(
    n for n in perturbed if n.startswith("model.layers.0.") and n.endswith("gate.weight")
  )
  with torch.no_grad():
    model.get_parameter(hf_router).copy_(torch.tensor(np.asarray(router[...])))
  try:
    assert (_hf_routed_experts(model, sequence[:-1]) != completion.routed_experts).any()
    replayed = np.asarray(token_logprobs(module, ids, routed_experts=routed))[0]
    new_routing = np.asarray(token_logprobs(module, ids))[0]
    last = completion.routed_experts[-1:]  # the last position predicts nothing: any routing
    undo = _forced_routers(model, np.concatenate([completion.routed_experts, last]))
    try:
      reference = _hf_log_softmax(model, sequence)
    finally:
      undo()
  finally:
    with torch.no_grad():
      model.get_parameter(hf_router).copy_(perturbed[hf_router])
  want = [reference[t, token] for t, token in enumerate(sequence[1:])]
  np.testing.assert_allclose(replayed, want, atol=1e-4, rtol=0)
  assert np.abs(new_routing - replayed).max() > 1e-3
  with pytest.raises(ValueError, match="routed_experts must be"):
    token_logprobs(module, ids, routed_experts=routed[:, :-1])
  with pytest.raises(ValueError, match=r"routed_experts must be expert ids in \[0, "):
    token_logprobs(module, ids, routed_experts=routed + 100)


def test_routed_experts_through_chunks_prefix_hits_preemption_drafts_and_loops(tmp_path):
  """One engine with every path a position's routing may take: prefill chunks of 8 tokens, a
  prefix cached by an earlier request (not recomputed), preemption (recomputed), n-gram drafts
  (only accepted tokens' routing), the 2-step decode loop, asynchronous scheduling and n = 2
  samples: every completion's routed experts equal transformers' router top-k."""
  model = hf_moe_model("qwen3_moe", seed=4)
  model.save_pretrained(tmp_path)
  llm = je.LLM(
    tmp_path,
    max_num_reqs=2,
    max_model_len=64,
    max_num_batched_tokens=8,
    block_size=4,
    num_kv_blocks=14,
    num_decode_steps=2,
    reuse_compiled_shapes=True,  # fewer executables: steps run in larger compiled shapes
    speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1},
    enable_return_routed_experts=True,
  )
  one_shape(llm)  # the paths a position's routing takes, not the buckets, are the point
  engine = llm.llm_engine
  engine.cores[0].spec_crossover_tokens = 10**9  # verify whenever a row has drafts
  loops = []
  execute = engine.runner.execute_decode_steps
  engine.runner.execute_decode_steps = lambda *a, **k: loops.append(1) or execute(*a, **k)
  first = PROMPT[:10] * 2  # repeats: n-gram drafts
  (out,) = llm.generate(first, je.SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
  _check_routing(model, first, out.outputs[0])
  prompts = [first[:16] + [3, 1, 4], [7, 7, 8] * 5]
  params = [
    je.SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
    je.SamplingParams(max_tokens=16, n=2, seed=1, ignore_eos=True),
  ]
  outs = llm.generate(prompts, params, use_tqdm=False)
  for prompt, out in zip(prompts, outs):
    for completion in out.outputs:
      _check_routing(model, prompt, completion)
  stats = engine.kv_cache_stats
  assert stats.prefix_cache_hits >= 16 and stats.num_preemptions > 0, stats
  spec = engine.spec_decode_stats  # drafts accepted and drafts rejected
  assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens and loops


def test_routed_experts_of_a_dense_model_are_refused_before_loading(monkeypatch):
  from jaxengine.engine import model_loader
  from jaxengine.engine.arg_utils import EngineArgs
  from jaxengine.testing import tiny_llama

  def no_weights(*args, **kwargs):
    raise AssertionError("weights read")

  monkeypatch.setattr(model_loader, "load_resolved", no_weights)
  with pytest.raises(ValueError, match="enable_return_routed_experts=True needs a mixture-of"):
    je.LLM(enable_return_routed_experts=True)  # the default GGUF file: SmolLM2, dense
  with pytest.raises(ValueError, match="enable_return_routed_experts=True needs a mixture-of"):
    je.LLM(tiny_llama()[0], enable_return_routed_experts=True)
  with pytest.raises(ValueError, match="enable_return_routed_experts must be a bool, got 1"):
    EngineConfig(enable_return_routed_experts=1)
  parser = EngineArgs.add_cli_args(__import__("argparse").ArgumentParser())
  args = EngineArgs.from_cli_args(parser.parse_args(["--enable-return-routed-experts"]))
  assert args.enable_return_routed_experts is True


def test_routed_experts_store_takes_steps_in_dispatch_order_and_reads_what_it_holds():
  """The store's host bookkeeping without a model: a k-step loop's experts are held until
  `write_held` (the step dispatched before the loop is stored first: a later write wins a slot),
  None writes nothing, a completion reads the positions computed and stored (none after a
  preemption: an empty array, not None), and it exists only with the flag."""
  from jaxengine.worker.routed_experts import (
    RoutedExperts,
    RoutedExpertsStore,
    check_pages_kept,
    num_readable_positions,
  )

  store = RoutedExpertsStore(num_slots=12, num_moe_layers=2, top_k=1, block_size=4)

  def routed(value, slots):
    return RoutedExperts(experts=jnp.full((len(slots), 2, 1), value), slots=jnp.asarray(slots))

  store.hold(routed(7, [4, 5]))  # the loop, dispatched after the step in flight
  store.write(routed(3, [5, 6]))  # the step in flight, collected after the loop's dispatch
  assert store.read([1], 3)[:, 0, 0].tolist() == [0, 3, 3]  # the loop's: not stored yet
  store.write_held()
  store.write_held()  # nothing held: nothing written
  store.write(None)
  assert store.read([1], 3)[:, 0, 0].tolist() == [7, 7, 3]
  assert store.read([1], 5) is None  # position 4 is on a page the sequence does not hold
  assert store.read([1], 0).shape == (0, 2, 1)  # nothing computed since a preemption
  assert num_readable_positions(num_tokens=9, num_computed_tokens=9, num_unstored=0) == 8
  assert num_readable_positions(num_tokens=9, num_computed_tokens=6, num_unstored=2) == 4
  assert num_readable_positions(num_tokens=9, num_computed_tokens=0, num_unstored=0) == 0
  assert RoutedExpertsStore.create(EngineConfig(), None, num_blocks=3, block_size=4) is None
  on = EngineConfig(enable_return_routed_experts=True)
  check_pages_kept(EngineConfig(), frees_pages=True)
  with pytest.raises(ValueError, match="not supported with sliding-window layers"):
    check_pages_kept(on, frees_pages=True)
