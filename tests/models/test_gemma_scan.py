"""Gemma's scanned layers (``scan_layers=True``) on tiny random models built in JAX: the unrolled
model's bits (Gemma 3's and Gemma 2's layer patterns, converted modules, batch-invariant mode,
int8), a compiled step that does not grow with the groups, and the platform default. The scanned
engine against transformers is in tests/models/test_gemma.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxengine.models import sequence_logits, token_logprobs
from jaxengine.models.attention_backends import XlaAttentionBackend
from jaxengine.models.gemma import Gemma, GemmaDecoderLayer
from jaxengine.models.gemma_config import FULL, SLIDING, GemmaConfig, GemmaRope
from jaxengine.models.layer_scan import scan_config, scanned_model
from jaxengine.models.quantization import quantize_model
from jaxengine.models.sequence_logprobs import scratch_step
from jaxengine.models.weights import state_leaves

pytestmark = pytest.mark.bitwise  # compares bits between programs: tests/conftest.py

#: Gemma 3's layer pattern (five local, one global), its remainder after 8 layers two local.
GEMMA3_TYPES = ((SLIDING,) * 5 + (FULL,)) * 4


def _tiny(num_layers: int, scan: bool = False, **fields) -> Gemma:
  """A tiny Gemma 3-shaped model of random weights (norm offsets random too), the same weights
  for the same fields whatever `scan` (stacked when it is)."""
  config = GemmaConfig(**{
    **dict(
      vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=num_layers,
      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
      layer_types=GEMMA3_TYPES[:num_layers], sliding_window=3, qk_norm=True,
      rope_local=GemmaRope(theta=50.0), rope_global=GemmaRope(theta=500.0, factor=2.0),
      final_logit_softcapping=3.0, max_position_embeddings=64,
    ),
    **fields,
  })  # fmt: skip
  model = Gemma(config, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(1)
  scales = {}
  for path, leaf in nnx.to_flat_state(nnx.state(model)):
    if path[-1] == "scale":
      scales[path] = rng.standard_normal(leaf.shape).astype(np.float32) * 0.3
      leaf.set_value(jnp.asarray(scales[path]))
  if not scan:
    return model
  scanned = Gemma(dataclasses.replace(config, scan_layers=True), rngs=nnx.Rngs(0))
  for path, leaf in nnx.to_flat_state(nnx.state(scanned)):
    if path[-1] == "scale" and path[0] == "layers":
      rows = [scales[("layers", i, *path[1:])] for i in range(num_layers)]
      leaf.set_value(jnp.asarray(np.stack(rows)))
    elif path[-1] == "scale":
      leaf.set_value(jnp.asarray(scales[path]))
  return scanned


SCAN_TOKENS = jnp.asarray(np.random.default_rng(0).integers(3, 64, (2, 13)), jnp.int32)


@pytest.mark.parametrize(
  "layers, fields",
  [(8, {}), (5, dict(layer_types=(SLIDING, FULL) * 2 + (SLIDING,), attn_logit_softcapping=2.0))],
  ids=["gemma3_pattern_6", "gemma2_pattern_2"],
)
def test_scanned_layers_give_the_unrolled_bits(layers, fields):
  """``scan_layers=True``: the 8-layer Gemma 3 pattern (one group of 6 scanned, 2 local layers
  after it) and a 5-layer Gemma 2 pattern (two groups of 2, one layer after): the unrolled
  model's logits bit for bit, also converted from the unrolled module (`scanned_model`, which
  leaves the caller's module unrolled), in batch-invariant mode, and int8-quantized (the
  scales keep the layer axis)."""
  unrolled, scanned = _tiny(layers, **fields), _tiny(layers, scan=True, **fields)
  config = scanned.config
  assert config.layer_period == (6 if layers == 8 else 2) and scanned.stacked_paths == ("layers",)
  wq = state_leaves(nnx.state(scanned))[("layers", "attn", "wq")]
  assert wq.shape == (layers, 4, 16, 32) and scanned.kv_cache_spec.stacked
  want = np.asarray(sequence_logits(unrolled, SCAN_TOKENS))
  np.testing.assert_array_equal(np.asarray(sequence_logits(scanned, SCAN_TOKENS)), want)
  converted = scanned_model(unrolled, True)
  np.testing.assert_array_equal(np.asarray(sequence_logits(converted, SCAN_TOKENS)), want)
  assert isinstance(unrolled.layers, nnx.List) and unrolled.layers[1].attn.layer == 1
  assert isinstance(converted.layers, GemmaDecoderLayer) and converted.layers.attn.layer is None
  copies = [nnx.merge(*nnx.split(model)) for model in (unrolled, scanned)]
  for copy in copies:
    copy.set_attributes(batch_invariant=True)
  want = np.asarray(token_logprobs(copies[0], SCAN_TOKENS))
  np.testing.assert_array_equal(np.asarray(token_logprobs(copies[1], SCAN_TOKENS)), want)
  done = quantize_model(scanned, "int8")
  leaves = state_leaves(nnx.state(done.model))
  assert leaves[("layers", "attn", "scales", "wq")].shape == (layers, 4, 16)
  want = np.asarray(sequence_logits(quantize_model(unrolled, "int8").model, SCAN_TOKENS))
  np.testing.assert_array_equal(np.asarray(sequence_logits(done.model, SCAN_TOKENS)), want)


def _compiled_instructions(num_layers: int) -> int:
  """HLO instructions of one compiled forward step of a tiny scanned model."""
  model = _tiny(num_layers, scan=True)
  metadata, cache = scratch_step(model, 2, 8, 4, XlaAttentionBackend())
  ids, positions = SCAN_TOKENS[:, :8].reshape(1, -1), jnp.tile(jnp.arange(8), 2)[None]
  step = jax.jit(lambda m, *args: m(*args))
  compiled = step.lower(model, ids, positions.astype(jnp.int32), cache, metadata).compile()
  return sum(" = " in line for line in compiled.as_text().splitlines())


def test_the_scanned_step_does_not_grow_with_the_groups():
  """14 and 20 layers of Gemma 3's pattern (two and three groups, two layers after them)
  compile the same number of HLO instructions (a scan of one group is inlined)."""
  assert _compiled_instructions(20) == _compiled_instructions(14)


def test_the_engine_scans_by_default_on_accelerators_only():
  config = _tiny(2).config
  assert scan_config(config, None, platform="tpu").scan_layers
  assert not scan_config(config, None, platform="cpu").scan_layers
  assert scanned_model(_tiny(2), None, platform="tpu").config.scan_layers
  with pytest.raises(ValueError, match="scan_layers must be a bool, got 1"):
    dataclasses.replace(config, scan_layers=1)
