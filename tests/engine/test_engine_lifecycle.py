"""The engine's one lifecycle: every way a running completion ends (its stop rules, an abort, a
token its grammar rejects) goes through the same finish path and leaves the same state."""

from __future__ import annotations

import pytest
from byte_tokenizer import byte_tokenizer
from output_utils import step_to_end

import jaxengine as je
from jaxengine.engine import LLMEngine
from jaxengine.testing import TargetOnly, tiny_llama


@pytest.fixture(scope="module")
def tokenizer():
  return byte_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
  return tiny_llama(vocab_size=tokenizer.vocab_size)[0]


def _engine(model, tokenizer) -> LLMEngine:
  return LLMEngine(
    model, tokenizer, max_num_reqs=2, max_model_len=64, logits_processors=[TargetOnly]
  )


def _state(engine: LLMEngine) -> dict:
  """What a finished completion must leave behind: nothing of it in the scheduler, the batch or
  the grammar matchers."""
  batch = engine.runner.input_batch
  assert engine.structured is not None
  return {
    "running": sorted(engine.scheduler.running),
    "waiting": [c.seq_id for c in engine.scheduler.waiting],
    "rows": sorted(seq_id for seq_id in batch.req_ids if seq_id is not None),
    "num_reqs": batch.num_reqs,
    "matchers": len(engine.structured),
    "unfinished": engine.has_unfinished_requests(),
  }


@pytest.mark.parametrize("ending", ["abort", "length", "grammar"])
def test_every_ending_leaves_the_same_state(model, tokenizer, ending):
  """A grammar request "go" ends after its first token beside a plain request "keep": aborted,
  by its length limit, or by a token its grammar rejects. Each leaves the state a step over
  "keep" alone has, and "keep" goes on with the same tokens."""
  choice = je.StructuredOutputsParams(choice=["abc", "xyz"])
  greedy = je.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
  (z,) = tokenizer.encode("z", add_special_tokens=False)  # no choice starts with it
  go = je.SamplingParams(
    temperature=0,
    max_tokens=1 if ending == "length" else 6,
    structured_outputs=choice,
    extra_args={"target_token": z} if ending == "grammar" else None,
  )
  engine = _engine(model, tokenizer)
  engine.add_request("keep", [5, 6, 7], greedy)
  engine.add_request("go", [8, 9], go)
  if ending == "grammar":
    with pytest.warns(RuntimeWarning, match="does not allow"):
      outputs = engine.step()
  else:
    outputs = engine.step()
  if ending == "abort":
    assert len(engine.structured or ()) == 1  # "go" is running, with its matcher
    engine.abort_request("go")
  finished = {o.request_id: o.outputs[0] for o in outputs if o.finished}
  if ending == "abort":
    assert finished == {}  # an aborted request is forgotten
  else:
    assert list(finished) == ["go"]
    assert finished["go"].finish_reason == ("length" if ending == "length" else "abort")
    assert len(finished["go"].token_ids) == (1 if ending == "length" else 0)

  alone = _engine(model, tokenizer)
  alone.add_request("keep", [5, 6, 7], greedy)
  alone.step()
  assert (
    _state(engine)
    == _state(alone)
    == {
      "running": ["keep"],
      "waiting": [],
      "rows": ["keep"],
      "num_reqs": 1,
      "matchers": 0,
      "unfinished": True,
    }
  )
  (kept,), (kept_alone,) = step_to_end(engine), step_to_end(alone)
  assert kept.outputs[0].token_ids == kept_alone.outputs[0].token_ids
  assert len(kept.outputs[0].token_ids) == 6
  assert _state(engine) == _state(alone)
  assert engine.runner.input_batch.num_reqs == 0


def test_aborting_waiting_and_unknown_requests(model, tokenizer):
  engine = _engine(model, tokenizer)
  greedy = je.SamplingParams(temperature=0, max_tokens=2)
  for request_id in ("a", "b", "c"):
    engine.add_request(request_id, [5, 6], greedy)
  engine.step()  # "a" and "b" run, "c" waits
  engine.abort_request(["c", "unknown"])
  assert [c.seq_id for c in engine.scheduler.waiting] == []
  assert sorted(engine.scheduler.running) == ["a", "b"]
  engine.abort_request("a")
  assert sorted(engine.scheduler.running) == ["b"]
  assert [o.request_id for o in step_to_end(engine)] == ["b"]
  assert engine.runner.input_batch.num_reqs == 0
