"""Your own logits processors in the persistent batch (tiny vocabularies, no model)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxengine as je
from jaxengine.testing import TargetOnly, count_compiles

V, R, S = 40, 8, 64  # V above 32: a grammar bitmask of two words
P_SPEC = 4  # the batch's default max_spec_len


class Countdown(je.LogitsProcessor):
  """Emits `start, start + 1, ...` (mod V): exercises `update_state` moving with its row."""

  def init_state(self, max_num_reqs, vocab_size):
    return {"next": jnp.zeros((max_num_reqs,), jnp.int32)}

  def row_state(self, params, prompt_token_ids):
    start = (params.extra_args or {}).get("start")
    return None if start is None else {"next": start}

  def apply(self, state, active, logits):
    keep = jnp.arange(logits.shape[-1]) == state["next"][:, None]
    return jnp.where(active[:, None] & ~keep, -jnp.inf, logits)

  def update_state(self, state, sampled_token_ids, active):
    return {"next": jnp.where(active, (sampled_token_ids + 1) % V, state["next"])}


class KeepTop1(je.LogitsProcessor):
  """Argmax invariant: keeps only the largest logit (so a random row samples its argmax)."""

  argmax_invariant = True

  def init_state(self, max_num_reqs, vocab_size):
    return {}

  def row_state(self, params, prompt_token_ids):
    return {} if (params.extra_args or {}).get("top1") else None

  def apply(self, state, active, logits):
    keep = logits >= logits.max(-1, keepdims=True)
    return jnp.where(active[:, None] & ~keep, -jnp.inf, logits)


def _targets() -> list:
  """`TargetOnly` as a class, an instance and a spec string: equal processors, so one executable
  for every batch built with them (and applying it three times is applying it once)."""
  return [TargetOnly, TargetOnly(), "jaxengine.testing:TargetOnly"]


#: The module's other batch with processors (processed_logprobs: its logprobs see `KeepTop1`, an
#: argmax-invariant processor). With the plain batch `je.InputBatch(R, S, V)` and `_targets()`,
#: the module's three sampler executables.
COUNTDOWN = dict(logprobs_mode="processed_logprobs", logits_processors=[Countdown, KeepTop1])


def _logits(step: int) -> np.ndarray:
  return np.random.default_rng(step).normal(size=(R, V)).astype(np.float32) * 3


def _params(i: int, target: bool) -> je.SamplingParams:
  extra = {"target_token": (7 * i) % V} if target else None
  if i % 3 == 0:
    return je.SamplingParams(temperature=0, extra_args=extra)
  return je.SamplingParams(seed=100 + i, top_k=5 if i % 2 else 0, extra_args=extra)


def test_target_rows_emit_their_target_and_other_rows_are_unchanged():
  with_lp = je.InputBatch(R, S, V, logits_processors=_targets())
  without = je.InputBatch(R, S, V)
  for i in range(6):
    with_lp.add_request(f"r{i}", [1, 2, 3], _params(i, target=i % 2 == 0))
    without.add_request(f"r{i}", [1, 2, 3], _params(i, target=False))
  for step in range(4):
    a = with_lp.sample(_logits(step)).sampled_token_ids
    b = without.sample(_logits(step)).sampled_token_ids
    for i in range(6):
      if i % 2 == 0:
        assert a[i] == (7 * i) % V
      else:
        assert a[i] == b[i]


def test_processor_state_follows_requests_through_add_remove_condense_swap():
  batch = je.InputBatch(R, S, V, logits_processors=_targets())
  rng = np.random.default_rng(0)
  targets: dict[str, int | None] = {}
  greedy_plain: set[str] = set()
  serial = 0
  compiles = None
  for step in range(24):
    if step == 6:
      compiles = count_compiles().start()  # everything below has been compiled once
    if batch.num_reqs < R and (rng.random() < 0.6 or batch.num_reqs == 0):
      rid, serial = f"q{serial}", serial + 1
      target = int(rng.integers(V)) if rng.random() < 0.5 else None
      params = je.SamplingParams(
        temperature=0 if target is None else 1.0,
        extra_args=None if target is None else {"target_token": target},
      )
      batch.add_request(rid, [int(rng.integers(V))], params)
      targets[rid] = target
      if target is None:
        greedy_plain.add(rid)
    if batch.num_reqs > 1 and rng.random() < 0.3:
      batch.remove_request(list(batch.req_id_to_index)[int(rng.integers(batch.num_reqs))])
    batch.condense()
    if batch.num_reqs > 1 and rng.random() < 0.5:
      batch.swap_states(0, batch.num_reqs - 1)
    logits = _logits(step)
    out = batch.sample(logits).sampled_token_ids
    for row, rid in enumerate(batch.req_ids):
      if targets[rid] is not None:
        assert out[row] == targets[rid], (step, rid)
      else:
        assert out[row] == int(np.argmax(logits[row])), (step, rid)
  assert compiles is not None
  compiles.stop()
  assert compiles.count == 0


def test_update_state_moves_with_its_row_and_one_executable_serves_every_mix():
  batch = je.InputBatch(R, S, V, **COUNTDOWN)
  batch.add_request("a", [1], je.SamplingParams(extra_args={"start": 5}))
  batch.add_request("plain", [1], je.SamplingParams(temperature=0))
  batch.add_request("b", [1], je.SamplingParams(extra_args={"start": 30}))
  batch.sample(_logits(0))
  batch.swap_states(0, 2)
  with count_compiles() as compiles:
    for step in range(1, 4):
      batch.sample(_logits(step))
    batch.add_request("top1", [2], je.SamplingParams(seed=1, extra_args={"top1": True}))
    batch.remove_request("plain")
    batch.condense()
    logits = _logits(9)
    out = batch.sample(logits).sampled_token_ids
  assert compiles.count == 0  # adds, removes and moves after warm-up compile nothing
  assert batch.output_token_ids("a") == [5, 6, 7, 8, 9]
  assert batch.output_token_ids("b") == [30, 31, 32, 33, 34]
  row = batch.req_id_to_index["top1"]
  assert out[row] == int(np.argmax(logits[row]))


def test_refused_request_leaves_the_batch_unchanged():
  batch = je.InputBatch(R, S, V, logits_processors=_targets())
  batch.add_request("a", [1], je.SamplingParams(extra_args={"target_token": 3}))
  before = jax.tree.map(np.asarray, batch.state)
  with pytest.raises(ValueError, match="target_token"):
    batch.add_request("bad", [1], je.SamplingParams(extra_args={"target_token": V}))
  assert batch.req_ids == ["a"] and batch.num_reqs == 1
  jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, batch.state))
  assert batch.sample(_logits(0)).sampled_token_ids.tolist() == [3]


@pytest.mark.parametrize("spec", ["no_such_module:X", "jaxengine.testing:nothing", 3, object])
def test_bad_processor_specs_are_refused(spec):
  with pytest.raises(ValueError, match="logits_processors"):
    je.InputBatch(R, S, V, logits_processors=[spec])


def test_grammar_bitmask_masks_only_grammar_rows():
  batch = je.InputBatch(R, S, V)
  so = je.StructuredOutputsParams(regex="a")
  batch.add_request("g", [1], je.SamplingParams(temperature=0, structured_outputs=so))
  batch.add_request("p", [1], je.SamplingParams(temperature=0))
  bitmask = np.zeros((R, -(-V // 32)), np.int32)
  bitmask[0, 33 // 32] = 1 << (33 % 32)  # only token 33 for the grammar row
  bitmask[1] = 0  # read nowhere: the plain row has no grammar
  batch.set_grammar_bitmask(bitmask)
  logits = _logits(3)
  out = batch.sample(logits).sampled_token_ids
  assert out.tolist() == [33, int(np.argmax(logits[1]))]


def _log_softmax(x: np.ndarray) -> np.ndarray:
  x = x.astype(np.float64)
  return x - np.logaddexp.reduce(x, axis=-1, keepdims=True)


@pytest.mark.parametrize("speculative", [False, True])
def test_raw_logprobs_see_the_grammar_bitmask_and_nothing_else(speculative):
  """vLLM V1 masks the logits with the grammar bitmask before its sampler reads raw logprobs:
  a forbidden token is -inf, the greedy allowed token has rank 1, and the values are the
  log-softmax over the allowed tokens of the model's logits (penalties, temperature and
  logit_bias come after). Plain rows keep the model's log-softmax. Same in the rejection
  sampler (where grammar rows ignore their drafts)."""
  batch = je.InputBatch(R, S, V)  # requests ask for 3 logprobs, within the default limit (20)
  allowed = [5, 33, 38]
  so = je.StructuredOutputsParams(regex="a")
  extra = dict(logprobs=3, logit_bias={33: 4.0})
  batch.add_request("g", [1], je.SamplingParams(temperature=0, structured_outputs=so, **extra))
  batch.add_request("p", [1], je.SamplingParams(temperature=0.7, seed=3, **extra))
  bitmask = np.zeros((R, -(-V // 32)), np.int32)
  for t in allowed:
    bitmask[0, t // 32] |= 1 << (t % 32)
  batch.set_grammar_bitmask(bitmask)
  logits = _logits(5)
  logits[0, 0] = logits[0].max() + 10  # the model's favourite is forbidden
  logits[0, allowed] = [2.0, 1.0, -1.0]  # 33 is second by raw logit, first after its bias
  if speculative:
    out = batch.rejection_sample(np.repeat(logits[:, None], P_SPEC + 1, 1), [[7], [7]])
    token_ids, lp = out.sampled_token_ids[:, 0], out.logprobs
    lp_ids, lp_values, ranks = lp.token_ids[:, 0], lp.logprobs[:, 0], lp.ranks[:, 0]
  else:
    out = batch.sample(logits)
    token_ids, lp = out.sampled_token_ids, out.logprobs
    lp_ids, lp_values, ranks = lp.token_ids, lp.logprobs, lp.ranks
  masked = np.full(V, -np.inf)
  masked[allowed] = logits[0, allowed]
  expected = _log_softmax(masked)
  assert token_ids[0] == 33  # the logit bias decides the draw, not the raw logprobs
  assert int(ranks[0]) == 2
  np.testing.assert_allclose(lp_values[0], expected[lp_ids[0]], rtol=1e-5)
  assert list(lp_ids[0, 1:]) == sorted(allowed, key=lambda t: -expected[t])
  assert np.isneginf(expected[0]) and 0 not in lp_ids[0]
  plain = _log_softmax(logits[1])
  np.testing.assert_allclose(lp_values[1], plain[lp_ids[1]], rtol=1e-5)
  assert int(ranks[1]) == int((plain >= plain[token_ids[1]]).sum())


def test_extra_args_and_structured_outputs_are_validated():
  with pytest.raises(ValueError, match="extra_args"):
    je.SamplingParams(extra_args=[1])
  with pytest.raises(ValueError, match="exactly one"):
    je.StructuredOutputsParams(regex="a", choice=["b"])
  with pytest.raises(ValueError, match="exactly one"):
    je.StructuredOutputsParams()
  with pytest.raises(ValueError, match="choice"):
    je.StructuredOutputsParams(choice=[])
  with pytest.raises(ValueError, match="structured_outputs"):
    je.SamplingParams(structured_outputs={"regex": "a"})


def test_processed_logprobs_include_argmax_invariant_processors():
  """vLLM applies argmax-invariant processors before its top-k / top-p sampler, so processed_*
  logprobs see them: a random row that keeps only its top token has logprob 0 for it, and every
  other token is -inf; a greedy row is untouched by them."""
  batch = je.InputBatch(R, S, V, **COUNTDOWN)  # Countdown leaves rows without "start" alone
  batch.add_request("random", [1, 2], je.SamplingParams(seed=1, logprobs=3, extra_args={"top1": 1}))
  batch.add_request("greedy", [1, 2], je.SamplingParams(temperature=0, logprobs=3))
  logits = _logits(0)
  out = batch.sample(logits)
  assert out.logprobs is not None
  row = batch.req_id_to_index["random"]
  assert out.sampled_token_ids[row] == int(np.argmax(logits[row]))
  np.testing.assert_array_equal(out.logprobs.logprobs[row, :2], [0.0, 0.0])
  assert np.all(np.isneginf(out.logprobs.logprobs[row, 2:]))
  greedy = batch.req_id_to_index["greedy"]
  expected = jax.nn.log_softmax(jnp.asarray(logits[greedy]))
  np.testing.assert_allclose(
    out.logprobs.logprobs[greedy, 0], expected[out.sampled_token_ids[greedy]], rtol=1e-5
  )
  assert np.all(np.isfinite(out.logprobs.logprobs[greedy]))


class _WrongWidth(TargetOnly):
  def apply(self, state, active, logits):
    return logits[:, :5]


class _IntLogits(TargetOnly):
  def apply(self, state, active, logits):
    return logits.astype(jnp.int32)


class _NoRowAxis(TargetOnly):
  def init_state(self, max_num_reqs, vocab_size):
    return {"target": jnp.zeros((), jnp.int32)}


class _BadUpdate(TargetOnly):
  def update_state(self, state, sampled_token_ids, active):
    return {"target": state["target"][:1]}


class _Raises(TargetOnly):
  def apply(self, state, active, logits):
    return logits + state["missing"]


@pytest.mark.parametrize(
  "processor, message",
  [
    (_WrongWidth, r"_WrongWidth: apply must return float logits of shape \(8, 40\)"),
    (_IntLogits, "_IntLogits: apply must return float logits"),
    (_NoRowAxis, "_NoRowAxis: init_state leaves need the leading axis max_num_reqs=8"),
    (_BadUpdate, "_BadUpdate: update_state must return"),
    (_Raises, "_Raises: tracing it failed"),
  ],
)
def test_a_processor_of_the_wrong_shape_is_refused_when_the_batch_is_built(processor, message):
  with pytest.raises(ValueError, match=message):
    je.InputBatch(R, S, V, logits_processors=[processor])
