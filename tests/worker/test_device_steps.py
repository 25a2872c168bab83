"""Engines share their jitted steps by model structure (`jaxengine/worker/device_steps.py`)."""

from __future__ import annotations

import jax
import numpy as np
from output_utils import step_to_end

import jaxengine as je
from jaxengine.engine import LLMEngine
from jaxengine.testing import TargetOnly, count_compiles, tiny_llama
from jaxengine.worker import device_steps
from jaxengine.worker.ragged_step import RaggedInputs

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
  outputs = sorted(step_to_end(engine), key=lambda o: o.request_id)
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


def test_steps_lower_from_abstract_shapes_without_device_arrays():
  """The steps are pure functions of (model structure, shapes, shardings): built from an
  abstract model (`nnx.eval_shape`), the ragged step lowers from `jax.ShapeDtypeStruct`s alone,
  as an ahead-of-time compile for another platform would."""
  from flax import nnx

  from jaxengine.batch import InputBatch
  from jaxengine.models.attention_backends import XlaAttentionBackend
  from jaxengine.models.kv_pages import PagedKVCache
  from jaxengine.models.paged_attention import PagedAttentionMetadata
  from jaxengine.worker.step_inputs import build_step_inputs

  model, _ = tiny_llama(vocab_size=64)
  abstract = nnx.eval_shape(lambda: model)
  graphdef, weights = nnx.split(abstract)
  leaves = jax.tree.leaves(weights)
  assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
  steps = device_steps.placed_device_steps(graphdef, None, None, model.vocab_size)

  def spec(tree):  # host arrays as shapes
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)

  state = jax.eval_shape(lambda: InputBatch(2, 32, 64, max_num_blocks_per_req=4).state)
  cache = jax.eval_shape(
    lambda: PagedKVCache.create(model.kv_cache_spec, XlaAttentionBackend(), 8, 8)
  )
  layout = build_step_inputs([[1]], [0], [3], block_size=8, num_tokens=4, num_reqs=2,
                             max_blocks_per_req=4)  # fmt: skip
  attention = PagedAttentionMetadata(
    slot_mapping=layout.slot_mapping, block_tables=layout.block_tables,
    query_start_loc=layout.query_start_loc, seq_lens=layout.seq_lens,
    num_reqs=np.int32(layout.num_reqs),
  )  # fmt: skip
  inputs = spec(RaggedInputs(
    token_rows=np.zeros(4, np.int32), positions=layout.positions, attention=attention,
    logits_indices=np.zeros(2, np.int32), produces=np.zeros(2, bool),
  ))  # fmt: skip
  text = steps.ragged_forward.lower(state, weights, cache, inputs, prompt_logprobs=0).as_text()
  assert "func" in text


def test_the_sampler_on_a_row_bucket_writes_back_only_the_leaves_it_changed():
  """The sampler at one row of four writes back the token ids, lengths and output counts; the
  leaves it leaves alone (the allowed-token and prompt masks, `[R, V]`, ...) are the input's,
  not a copy of their first rows over themselves (which XLA:TPU relaid out and copied whole per
  step: `aot/hbm_bytes.py`)."""
  from jaxengine.batch import InputBatch
  from jaxengine.worker.ragged_step import sample_produced

  batch = InputBatch(4, 16, 64)
  state, metadata = batch.state, batch.sampling_metadata
  logits = jax.ShapeDtypeStruct((1, 64), np.float32)
  produces = jax.ShapeDtypeStruct((1,), np.bool_)
  jaxpr = jax.make_jaxpr(sample_produced, static_argnums=4)(state, metadata, logits, produces, 1)
  names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
  inputs = jaxpr.jaxpr.invars[: len(names)]
  outputs = jaxpr.jaxpr.outvars[: len(names)]
  written = {name for name, i, o in zip(names, inputs, outputs, strict=True) if i is not o}
  assert written == {".token_ids", ".num_tokens", ".output_token_counts"}, written
