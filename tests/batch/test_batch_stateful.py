"""Stateful property test: InputBatch against a plain-Python model of the persistent batch.

Every request carries a *target* token that identifies it through sampling:
* "allow" requests have `allowed_token_ids=[target]` plus a random mix of every other parameter
  (temperature, seed, top-k/p, min-p, penalties, bias, bad words on other tokens, min_tokens with
  stop ids that exclude the target, logprobs), so whatever else happens the row must emit `target`;
* "greedy" requests have temperature 0 and no allowlist; the test gives their row logits whose
  argmax is `target` (other parameters only touch other tokens), so a row that inherited a stale
  allowlist / bad word / bias from a previous occupant, or whose parameters stayed behind on a
  condense or swap, emits the wrong token.

The model tracks rows (with holes), the lowest-hole-first add rule, the condense rule and swaps, and
each request's output tokens (sampled tokens appended to the right request).
"""

from __future__ import annotations

import numpy as np
from batch_utils import MML, R, V, expected_condense, make_batch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import jaxengine as je

TARGETS = st.integers(0, V - 2)  # never the EOS id (V - 1)
other_token = st.integers(0, V - 1)


class BatchMachine(RuleBasedStateMachine):
  def __init__(self):
    super().__init__()
    self.b = make_batch(logprobs_mode="raw_logprobs", max_num_logprobs=20)
    self.rows: list = []  # row -> req_id or None (hole)
    self.reqs: dict = {}  # req_id -> dict(kind, target, prompt, outputs, logprobs)
    self.serial = 0
    self.rng = np.random.default_rng(0)

  # ---------------------------------------------------------------------------------- helpers
  def live(self):
    return [r for r in self.rows if r is not None]

  def has_holes(self):
    return any(r is None for r in self.rows)

  def _params(self, data, kind, target):
    kw: dict = {}
    avoid = lambda t: t != target
    if data.draw(st.booleans()):
      kw["logprobs"] = data.draw(st.integers(0, 5))
    if data.draw(st.booleans()):
      kw["bad_words_token_ids"] = [
        [t] for t in data.draw(st.lists(other_token.filter(avoid), max_size=3))
      ]
    if data.draw(st.booleans()):
      kw["logit_bias"] = data.draw(
        st.dictionaries(other_token.filter(avoid), st.floats(-3, 3), max_size=3)
      )
    if data.draw(st.booleans()):
      kw["min_tokens"] = data.draw(st.integers(0, 6))
      kw["stop_token_ids"] = data.draw(st.lists(other_token.filter(avoid), max_size=3))
    if kind == "greedy":
      kw["temperature"] = 0.0
      return kw
    kw["allowed_token_ids"] = [target]
    kw["temperature"] = data.draw(st.sampled_from([0.0, 0.5, 1.0, 2.0]))
    if data.draw(st.booleans()):
      kw["seed"] = data.draw(st.integers(0, 1000))
    if data.draw(st.booleans()):
      kw.update(
        top_k=data.draw(st.integers(-1, V + 1)),
        top_p=data.draw(st.floats(0.05, 1.0)),
        min_p=data.draw(st.floats(0.0, 1.0)),
      )
    if data.draw(st.booleans()):
      kw.update(
        presence_penalty=data.draw(st.floats(-2, 2)),
        frequency_penalty=data.draw(st.floats(-2, 2)),
        repetition_penalty=data.draw(st.floats(0.2, 2.0)),
      )
    return kw

  # ---------------------------------------------------------------------------------- rules
  @precondition(lambda self: len(self.live()) < R)
  @rule(data=st.data(), kind=st.sampled_from(["allow", "greedy"]), target_token=TARGETS)
  def add(self, data, kind, target_token):
    target = target_token
    rid = f"req-{self.serial}"
    self.serial += 1
    prompt = data.draw(st.lists(other_token, min_size=1, max_size=4))
    outputs = data.draw(st.lists(other_token, max_size=3))
    kw = self._params(data, kind, target)
    row = self.b.add_request(rid, prompt, je.SamplingParams(**kw), output_token_ids=outputs)
    holes = [i for i, r in enumerate(self.rows) if r is None]
    want = holes[0] if holes else len(self.rows)
    assert row == want, f"add placed {rid} in row {row}, expected lowest hole / append {want}"
    if want == len(self.rows):
      self.rows.append(rid)
    else:
      self.rows[want] = rid
    self.reqs[rid] = dict(
      kind=kind, target=target, prompt=prompt, outputs=list(outputs), logprobs=kw.get("logprobs")
    )

  @precondition(lambda self: len(self.live()) > 0)
  @rule(data=st.data())
  def remove(self, data):
    rid = data.draw(st.sampled_from(sorted(self.live())))
    row = self.b.remove_request(rid)
    assert row == self.rows.index(rid)
    self.rows[row] = None
    del self.reqs[rid]

  @rule()
  def remove_unknown(self):
    assert self.b.remove_request("never-added") is None

  @rule()
  def condense(self):
    self.b.condense()
    self.rows = expected_condense(self.rows)
    assert self.b.req_ids == self.rows

  @precondition(lambda self: len(self.live()) >= 1)
  @rule(data=st.data())
  def swap(self, data):
    self.b.condense()
    self.rows = expected_condense(self.rows)
    n = len(self.rows)
    i = data.draw(st.integers(0, n - 1))
    j = data.draw(st.integers(0, n - 1))
    self.b.swap_states(i, j)
    self.rows[i], self.rows[j] = self.rows[j], self.rows[i]
    assert self.b.req_ids == self.rows

  @precondition(lambda self: len(self.live()) > 0)
  @rule()
  def sample(self):
    for rid in self.live():  # keep within max_model_len
      r = self.reqs[rid]
      if len(r["prompt"]) + len(r["outputs"]) >= MML:
        self.b.remove_request(rid)
        self.rows[self.rows.index(rid)] = None
        del self.reqs[rid]
    if not self.live():
      return
    order = expected_condense(self.rows)
    logits = self.rng.uniform(-1.0, 1.0, size=(R, V)).astype(np.float32)
    for i, rid in enumerate(order):
      if self.reqs[rid]["kind"] == "greedy":
        logits[i, self.reqs[rid]["target"]] = 10.0
    out = self.b.sample(logits)
    self.rows = order
    assert self.b.req_ids == order
    toks = out.sampled_token_ids.tolist()
    want = [self.reqs[rid]["target"] for rid in order]
    assert toks == want, (
      f"rows {order} sampled {toks}, expected targets {want} "
      f"(kinds {[self.reqs[r]['kind'] for r in order]})"
    )
    for rid, t in zip(order, toks):
      self.reqs[rid]["outputs"].append(t)
    ks = [self.reqs[rid]["logprobs"] for rid in order if self.reqs[rid]["logprobs"] is not None]
    if not ks:
      assert out.logprobs is None
    else:
      assert out.logprobs.token_ids.shape == (len(order), max(ks) + 1)
      assert out.logprobs.token_ids[:, 0].tolist() == toks

  # ---------------------------------------------------------------------------------- invariants
  @invariant()
  def bookkeeping_matches(self):
    live = {rid: i for i, rid in enumerate(self.rows) if rid is not None}
    assert self.b.num_reqs == len(live)
    assert self.b.req_id_to_index == live
    if not self.has_holes():
      assert self.b.req_ids == self.rows
      assert [list(o) for o in self.b.req_output_token_ids] == [
        self.reqs[r]["outputs"] for r in self.rows
      ]


BatchMachine.TestCase.settings = settings(
  max_examples=40,
  stateful_step_count=30,
  deadline=None,
  suppress_health_check=[
    HealthCheck.too_slow,
    HealthCheck.data_too_large,
    HealthCheck.filter_too_much,
  ],
)
TestBatchStateMachine = BatchMachine.TestCase
