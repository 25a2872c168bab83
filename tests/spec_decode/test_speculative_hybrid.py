"""Speculative decoding on a hybrid model (Qwen3.5: Gated DeltaNet layers beside attention).

A verify step writes a row's recurrent state after each of its tokens into its group of ``k + 1``
state slots, and the slot after the accepted drafts becomes the row's current one
(`jaxengine.core.state_slots`). A tiny random Qwen3.5 whose greedy and temperature-1 outputs
fall into loops (so drafts are both accepted and rejected) gives, with n-gram and with suffix
drafts, a plain engine's tokens (greedy with its logprobs, seeded ``n = 2`` samples) through
chunked prefill, and with the k-step decode loop between verify steps and ``batch_invariant``
(then the chunked prompt's greedy logprobs are `token_logprobs`' bits: the verify step's states
are those of a forward pass); a rerun compiles nothing; every slot is free at the end. Each
engine has one row bucket and one token bucket, so that few shapes compile (the n-gram and
suffix engines share their executables). The scheduler's routes of a drafted row are checked
alone, beside a prefix-cache snapshot.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxengine as je
from jaxengine.models import token_logprobs
from jaxengine.models.qwen3_5 import Qwen3_5
from jaxengine.models.qwen3_5_checkpoints import config_from_hf
from jaxengine.testing import count_compiles

pytestmark = pytest.mark.bitwise  # compares bits between programs: tests/conftest.py

#: tests/models/test_qwen3_5.py's layers: three Gated DeltaNet layers, then an attention layer.
TEXT = dict(
  vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
  linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=12,
  linear_num_key_heads=2, linear_num_value_heads=4,
  layer_types=["linear_attention"] * 3 + ["full_attention"],
)  # fmt: skip
K = 3
SPECS = {
  "ngram": {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3},
  "suffix": {"method": "suffix", "num_speculative_tokens": K},
}
#: The last is above the token budget of 16 (chunked prefill).
PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6], [3, 4, 3, 4, 3], list(range(20, 45))]
GREEDY = je.SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=1)
SEEDED = je.SamplingParams(temperature=1.0, max_tokens=20, seed=11, n=2, ignore_eos=True)
ROWS = 4


@pytest.fixture(scope="module")
def model():
  """A random tiny Qwen3.5 whose embedding outweighs the layers' updates (x4) and whose head is
  sharp (x6): its tokens fall into loops that drafts copy, while the recurrent state still moves
  every logprob (a state advanced by rejected drafts changes the tokens)."""
  model = Qwen3_5(config_from_hf(TEXT, "qwen3_5"), rngs=nnx.Rngs(0))
  model.embed[...] = model.embed[...] * 4
  model.lm_head[...] = model.lm_head[...] * 6
  return model


def _llm(model, **kwargs):
  llm = je.LLM(model, max_num_reqs=ROWS, max_model_len=64, block_size=4,
               max_num_batched_tokens=16, **kwargs)  # fmt: skip
  runner = llm.llm_engine.runner
  runner.row_buckets, runner.token_buckets = [ROWS], [16]  # one shape per step kind
  llm.llm_engine.spec_crossover_tokens = 10**9  # verify whenever a row has a draft
  return llm


@pytest.fixture(scope="module")
def plain(model):
  return _llm(model)


def _run(llm, params):
  outputs = llm.generate(PROMPTS, params, use_tqdm=False)
  tokens = [[list(c.token_ids) for c in out.outputs] for out in outputs]
  logprobs = [
    [entry[t].logprob for entry, t in zip(c.logprobs, c.token_ids)]
    for out in outputs
    for c in out.outputs
    if c.logprobs is not None
  ]
  return tokens, logprobs


@pytest.mark.parametrize(
  "method, options",
  [
    ("ngram", {}),
    ("suffix", {}),
    ("ngram", {"num_decode_steps": 2, "batch_invariant": True, "scan_layers": True}),
  ],
  ids=["ngram", "suffix", "ngram-k-step-loop-batch-invariant-scanned"],
)
def test_outputs_equal_plain_decoding_with_drafts_accepted_and_rejected(
  model, plain, method, options
):
  llm = _llm(model, speculative_config=SPECS[method], **options)
  runner, scheduler = llm.llm_engine.runner, llm.llm_engine.cores[0].scheduler
  assert runner.kv_cache.recurrent.num_slots == 1 + ROWS * (K + 1)  # k + 1 slots per row
  assert runner.model.config.scan_layers == options.get("scan_layers", False)
  loops = []
  execute = runner.execute_decode_steps
  runner.execute_decode_steps = lambda *a, **k: loops.append(1) or execute(*a, **k)
  stats = llm.llm_engine.spec_decode_stats
  for params in (GREEDY, SEEDED):
    want_tokens, want_logprobs = _run(plain, params)
    got_tokens, got_logprobs = _run(llm, params)
    assert got_tokens == want_tokens
    atol = 1e-3 if options.get("batch_invariant") else 1e-4  # sums in another order
    for got, want in zip(got_logprobs, want_logprobs):
      np.testing.assert_allclose(got, want, atol=atol)
    if options.get("batch_invariant") and params is GREEDY:  # the forward pass's bits
      prompt, [tokens], got = PROMPTS[-1], got_tokens[-1], got_logprobs[-1]  # chunked, looping
      ids = jnp.asarray([prompt + tokens], jnp.int32)
      want = np.asarray(token_logprobs(runner.model, ids, block_size=4))[0, len(prompt) - 1 :]
      np.testing.assert_array_equal(_bits(got), _bits(want))
  assert stats.num_accepted_tokens > 0  # drafts accepted ...
  assert stats.num_draft_tokens > stats.num_accepted_tokens  # ... and rejected
  assert bool(loops) == ("num_decode_steps" in options)
  accepted = stats.num_accepted_tokens
  with count_compiles() as compiles:
    again = _run(llm, GREEDY)
  assert compiles.count == 0 and again[0] == _run(plain, GREEDY)[0]
  assert stats.num_accepted_tokens > accepted
  assert scheduler.state_slots.num_free == ROWS


def _bits(values) -> np.ndarray:
  return np.asarray(values, np.float32).view(np.uint32)


def test_draft_states_are_routed_to_the_verify_step():
  """The scheduler's plan for a drafted decode: it reads its current slot, writes its state after
  all its tokens into its group's ``d``-th slot and after ``j + 1`` tokens into the ``j``-th;
  after ``a`` accepted drafts the ``a``-th slot is current (`jaxengine.core.state_slots`)."""
  from jaxengine.core.kv_cache_manager import KVCacheManager
  from jaxengine.core.request import Completion, Request
  from jaxengine.core.scheduler import Scheduler

  manager = KVCacheManager(32, 4, enable_caching=True)
  scheduler = Scheduler(2, manager, 16, num_state_slots=2 * (K + 1), num_state_snapshots=2,
                        num_draft_states=K)  # fmt: skip
  params = je.SamplingParams(max_tokens=8)
  request = Request("a", None, [1, 2, 3, 4, 5], params)
  completion = Completion("a", request, 0, params, None)
  request.completions.append(completion)
  scheduler.add_request(request)
  first = scheduler.schedule()  # the prompt: a snapshot after its first block, in slot 9
  assert first.state_slots == {"a": 1} and first.state_routes["a"] == (1, 9, 4, ())
  scheduler.update_after_step(first)
  completion.token_ids.append(7)  # the prompt's sampled token: a decode next
  verify = scheduler.schedule({"a": [4, 5]})
  assert verify.spec_token_ids == {"a": [4, 5]}
  assert verify.state_slots == {"a": 3}
  route = verify.state_routes["a"]
  assert route == (1, 0, 0, (1, 2))  # reads slot 1, saves after 1 and 2 tokens
  scheduler.update_after_step(verify, {"a": 1})
  assert scheduler.state_slots.slot("a") == 2
  assert completion.num_computed_tokens == 5 + 1 + 1
