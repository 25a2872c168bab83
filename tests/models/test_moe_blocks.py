"""The mixture-of-experts building blocks: the grouped products (the GPU/TPU form and the CPU
form, whole or by chunks; batch-invariant row tiles), the router's float32 top-k, and the configs
refused by name (transformers' and GGUF's). The checkpoints against transformers are in
tests/models/test_moe.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from moe_checkpoints import CASES

import jaxengine as je
from jaxengine.models import grouped_matmul
from jaxengine.models.batch_invariant import ROW_TILE
from jaxengine.models.grouped_matmul import grouped_linear
from jaxengine.models.llama_checkpoints import config_from_gguf
from jaxengine.models.moe import route

pytestmark = pytest.mark.bitwise  # compares bits between programs: tests/conftest.py


def _grouped_reference(x, w, sizes):
  group = np.repeat(np.arange(len(sizes)), sizes)
  rest = np.zeros((len(x) - len(group), w.shape[2]))
  return np.concatenate([np.einsum("mi,mio->mo", x[: len(group)], w[group]), rest])


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_grouped_linear_multiplies_each_row_by_its_groups_matrix(batch_invariant):
  rng = np.random.default_rng(0)
  sizes = np.array([3, 0, ROW_TILE + 2, 1, 0, 9], np.int32)  # empty groups, groups across tiles
  rows = int(sizes.sum()) + 2  # two rows past the groups
  x = rng.standard_normal((rows, 12)).astype(np.float32)
  w = rng.standard_normal((len(sizes), 12, 5)).astype(np.float32)  # [X, in, out]
  args = jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes)
  got = np.asarray(grouped_linear(*args, batch_invariant=batch_invariant))
  np.testing.assert_allclose(got, _grouped_reference(x, w, sizes), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("product", ["_ragged", "_every_group_then_pick", "chunked"])
def test_both_grouped_products_agree(product, monkeypatch):
  """The GPU/TPU form (`ragged_dot_general`, lowered densely on CPU) and the CPU form, whole or
  8 rows at a time (19 rows here: three chunks, the last one padded)."""
  if product == "chunked":
    monkeypatch.setattr(grouped_matmul, "CPU_PRODUCT_BYTES", 1)
    product = "_every_group_then_pick"
  rng = np.random.default_rng(1)
  sizes = np.array([0, 4, 1, 0, 7, 2], np.int32)
  x = rng.standard_normal((19, 12)).astype(np.float32)
  w = rng.standard_normal((len(sizes), 12, 5)).astype(np.float32)
  got = np.asarray(jax.jit(getattr(grouped_matmul, product))(x, w, sizes))
  np.testing.assert_allclose(got, _grouped_reference(x, w, sizes), rtol=1e-5, atol=1e-5)


def test_batch_invariant_grouped_linear_gives_a_row_the_same_bits_alone_and_among_others():
  """On XLA:CPU the plain ragged product of these shapes gives some rows other bits alone than
  among 40 or 100 rows (measured: 6 of 6 and 15 of 15 checked rows); row tiles fix them."""
  rng = np.random.default_rng(0)
  num_experts, width = 8, 256
  w = jnp.asarray(rng.standard_normal((num_experts, width, 192)).astype(np.float32))
  product = jax.jit(lambda x, sizes: grouped_linear(x, w, sizes, batch_invariant=True))
  for rows in (40, 100):
    x = rng.standard_normal((rows, width)).astype(np.float32)
    experts = np.sort(rng.integers(0, num_experts, rows))
    sizes = np.bincount(experts, minlength=num_experts).astype(np.int32)
    together = np.asarray(product(jnp.asarray(x), jnp.asarray(sizes)))
    for r in range(0, rows, 7):
      alone = np.asarray(
        product(
          jnp.asarray(x[r : r + 1]), jnp.asarray(np.eye(num_experts, dtype=np.int32)[experts[r]])
        )
      )
      np.testing.assert_array_equal(alone[0].view(np.int32), together[r].view(np.int32))


def test_route_takes_the_top_k_of_a_float32_softmax():
  logits = jnp.asarray([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 2.5]], jnp.bfloat16)
  plain = route(logits, 2, normalize=False)
  probs = np.asarray(jax.nn.softmax(logits.astype(jnp.float32)))
  top = np.array([[1, 2], [0, 3]])
  np.testing.assert_array_equal(np.asarray(plain.experts), top)
  np.testing.assert_allclose(np.asarray(plain.weights), np.take_along_axis(probs, top, 1))
  assert plain.weights.dtype == jnp.float32
  normalized = route(logits, 2, normalize=True, batch_invariant=True)
  np.testing.assert_allclose(np.asarray(normalized.weights).sum(-1), 1.0, rtol=1e-6)


@pytest.mark.parametrize(
  "fields, message",
  [
    (dict(num_experts_per_tok=9), r"num_experts_per_tok=9 must lie in \[1, num_experts=8\]"),
    (dict(moe_intermediate_size=None), "lacks 'moe_intermediate_size'"),
    (dict(decoder_sparse_step=0), "decoder_sparse_step must be >= 1, got 0"),
  ],
)
def test_bad_moe_configs_are_refused_naming_the_field(fields, message):
  config = CASES["qwen3_moe"]().to_dict()
  config.update(architectures=["Qwen3MoeForCausalLM"], **fields)
  config = {k: v for k, v in config.items() if v is not None}
  with pytest.raises(ValueError, match=message):
    je.models.config_from_hf(config)


def test_gguf_mixture_of_experts_is_refused_by_name():
  metadata = {"llama.expert_count": 8, "llama.embedding_length": 64}
  with pytest.raises(ValueError, match=r"llama\.expert_count=8\) are not supported"):
    config_from_gguf(metadata, {"token_embd.weight": (128, 64)})
