"""Engines share their jitted steps by model structure (`jaxengine/worker/device_steps.py`)."""

from __future__ import annotations

import jaxengine as je
from jaxengine.engine import LLMEngine
from jaxengine.testing import TargetOnly, count_compiles, tiny_llama
from jaxengine.worker import device_steps

PARAMS = [
  je.SamplingParams(temperature=0, max_tokens=6),
  je.SamplingParams(temperature=1.0, seed=3, max_tokens=6, logprobs=1),
  je.SamplingParams(temperature=0, max_tokens=4, extra_args={"target_token": 9}),
]
PROMPTS = [[5, 6, 7], [8, 9, 10, 11], [12]]


def _engine(model, **options) -> LLMEngine:
  return LLMEngine(
    model, None, max_num_reqs=2, max_model_len=32, logits_processors=[TargetOnly], **options
  )


def _run(engine: LLMEngine) -> list[tuple[list[int], list | None]]:
  for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS)):
    engine.add_request(f"r{i}", prompt, params)
  while engine.has_unfinished_requests():
    engine.step()
  outputs = sorted(engine.pop_finished(), key=lambda o: o.request_id)
  return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


def test_a_second_engine_of_the_same_structure_compiles_nothing_and_keeps_its_own_weights():
  """Another model of the same config (other weights), another engine with other scheduling
  features and a new processor instance: 0 compiles, and the tokens of its own weights (those
  of an engine that compiled its steps alone)."""
  device_steps.clear()
  model_a, model_b = tiny_llama(seed=0, vocab_size=64)[0], tiny_llama(seed=1, vocab_size=64)[0]
  first = _run(_engine(model_a))
  with count_compiles() as compiles:
    second = _run(_engine(model_b, async_scheduling=False, enable_prefix_caching=False))
  assert compiles.count == 0
  device_steps.clear()
  alone = _run(_engine(model_b))
  assert second == alone and second != first


def test_processors_of_one_class_with_equal_attributes_are_equal():
  class Scaled(TargetOnly):
    def __init__(self, scale):
      self.scale = scale

  assert TargetOnly() == TargetOnly() and hash(TargetOnly()) == hash(TargetOnly())
  assert Scaled(2) == Scaled(2) and Scaled(2) != Scaled(3) and Scaled(2) != TargetOnly()
