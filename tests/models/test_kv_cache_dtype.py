"""`kv_cache_dtype="fp8"`: float8_e4m3fn pages, four times the pages of float32 in the same bytes.

SmolLM2-135M (float32) with float32 pages against fp8 pages (XLA), the same 45 MiB pool (64 float32
pages of 16 tokens: the float32 engine is tests/engine/test_golden_run.py's SmolLM2 engine, whose
executables the run's compilation cache then serves). The bounds are those measured on four short
prompts (prompt logprobs at most 0.67 apart, 0.09 on the first prompt, whose 24 greedy tokens were
equal), with room for another machine's float sums.

A tiny Llama in an engine with fp8 pages on each backend (XLA; the GPU kernel in interpret mode;
the TPU layout with a traceable stand-in for its kernel) against float32 pages: the same greedy
tokens, logprobs within `TINY_LOGPROB_BOUND`. The backends' own fp8 tests are in
`tests/models/test_attention_backends.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from output_utils import step_to_end
from step_shapes import one_shape

import jaxengine as je
from jaxengine.engine import LLMEngine
from jaxengine.models.attention_backends import (
  BACKEND_NAMES,
  PallasGpuAttentionBackend,
  PallasTpuAttentionBackend,
  XlaAttentionBackend,
)
from jaxengine.models.paged_attention import (
  FP8_KV_DTYPE,
  FP8_KV_MAX,
  FP8_KV_STORAGE,
  PagedAttentionMetadata,
  ragged_paged_attention_xla,
  write_kv_pages,
)
from jaxengine.testing import tiny_llama
from jaxengine.worker import kv_cache_pool

PROMPTS = [
  "The capital of France is",
  "def fibonacci(n):",
  "Once upon a time, in a small village,",
  "The three primary colors are",
]
PARAMS = je.SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=0)


#: The float32 pool's pages: those of tests/engine/test_golden_run.py's SmolLM2 engine.
NUM_FLOAT32_PAGES = 64


def _engine(kv_cache_dtype: str) -> je.LLM:
  """SmolLM2 in test_golden_run.py's sizes (4 rows, 16 tokens a step, each step in that one
  shape: `one_shape`), its pool `NUM_FLOAT32_PAGES` float32 pages of 16 tokens."""
  llm = je.LLM(
    max_model_len=128,
    max_num_reqs=4,
    max_num_batched_tokens=16,
    kv_cache_memory_bytes=45 * 2**20,
    kv_cache_dtype=kv_cache_dtype,
  )
  return one_shape(llm)


@pytest.fixture(scope="module")
def engines() -> dict[str, je.LLM]:
  return {name: _engine(name) for name in ("auto", "fp8")}


def _pages(llm: je.LLM) -> list[jax.Array]:
  return [page for layer in llm.llm_engine.runner.kv_cache.pages for page in layer]


def _prompt_logprobs(output) -> np.ndarray:
  ids = output.prompt_token_ids[1:]
  return np.array([entry[t].logprob for entry, t in zip(output.prompt_logprobs[1:], ids)])


def test_fp8_pages_hold_four_times_the_blocks_in_the_same_bytes(engines):
  auto, fp8 = (engines[name].llm_engine.runner for name in ("auto", "fp8"))
  assert {p.dtype for p in _pages(engines["fp8"])} == {
    np.dtype(FP8_KV_STORAGE)
  }  # float8_e4m3fn bits
  assert {p.dtype for p in _pages(engines["auto"])} == {np.dtype(np.float32)}
  bytes_per_block = {
    name: sum(p.nbytes for p in _pages(engines[name])) / engines[name].llm_engine.runner.num_blocks
    for name in engines
  }
  assert bytes_per_block["auto"] == 4 * bytes_per_block["fp8"]
  assert auto.num_blocks == NUM_FLOAT32_PAGES
  assert fp8.num_blocks - 1 >= 4 * (auto.num_blocks - 1)  # page 0 is the null page


def test_fp8_pages_stay_close_to_float32_pages(engines):
  want = engines["auto"].generate(PROMPTS, PARAMS, use_tqdm=False)
  got = engines["fp8"].generate(PROMPTS, PARAMS, use_tqdm=False)
  gaps = np.concatenate(
    [np.abs(_prompt_logprobs(a) - _prompt_logprobs(b)) for a, b in zip(want, got)]
  )
  assert 0 < gaps.max() < 1.0  # fp8 rounds: some difference, none large
  assert gaps.mean() < 0.2
  assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids  # " Paris. ..."
  assert all(o.outputs[0].token_ids for o in got)


@pytest.mark.parametrize(
  "options, message",
  [
    (dict(kv_cache_dtype="fp8_e5m2"), "kv_cache_dtype"),
    (dict(kv_cache_dtype="float8"), "kv_cache_dtype"),
  ],
)
def test_bad_kv_cache_dtypes_are_refused_by_name(options, message):
  with pytest.raises(ValueError, match=message):
    je.EngineConfig(**options)


def test_fp8_e4m3_is_fp8_and_every_backend_takes_it():
  assert je.EngineConfig(kv_cache_dtype="fp8_e4m3").kv_cache_dtype == "fp8"
  assert je.EngineConfig().kv_cache_dtype == "auto"
  for name in (None, *BACKEND_NAMES):
    assert je.EngineConfig(kv_cache_dtype="fp8", attention_backend=name).kv_cache_dtype == "fp8"


def test_writes_clip_to_the_fp8_range_instead_of_overflowing_to_nan():
  pages = jnp.zeros((2, 4, 1, 2), FP8_KV_STORAGE)
  new = jnp.array([[[1e6, -1e6]], [[0.5, 3.0]]], jnp.float32)
  written = write_kv_pages(pages, new, jnp.array([4, 5], jnp.int32))
  out = jax.lax.bitcast_convert_type(written, FP8_KV_DTYPE).astype(jnp.float32)
  np.testing.assert_array_equal(out[1, 0, 0], [FP8_KV_MAX, -FP8_KV_MAX])
  np.testing.assert_array_equal(out[1, 1, 0], [0.5, 3.0])


# --- every backend in an engine: a tiny model ------------------------------------------------


def tpu_layout_kernel(
  q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale, sliding_window=None,
  k_scale=None, v_scale=None, num_kv_pages_per_block, num_queries_per_block,
):  # fmt: skip
  """The TPU kernel's signature over its combined `[N, B, 2K', D']` pages (fp8 read with
  `k_scale` / `v_scale`), computed by the XLA path: a jitted engine step cannot trace the
  kernel's reference function (a Python loop over `num_seqs`). The block sizes only tile."""
  del num_kv_pages_per_block, num_queries_per_block
  md = PagedAttentionMetadata(
    slot_mapping=jnp.zeros(q.shape[0], jnp.int32), block_tables=page_indices,
    query_start_loc=cu_q_lens, seq_lens=kv_lens, num_reqs=num_seqs[0],
  )  # fmt: skip
  return ragged_paged_attention_xla(
    q, kv_pages[:, :, 0::2], kv_pages[:, :, 1::2], md, scale=sm_scale,
    sliding_window=sliding_window, k_scale=k_scale or 1.0, v_scale=v_scale or 1.0,
  )  # fmt: skip


#: The backend each engine gets (the engine builds backends by name: the tests swap in the GPU
#: kernel's interpret mode and a traceable TPU stand-in), and its fp8 pages' dtypes.
TINY_BACKENDS = {
  "xla": (XlaAttentionBackend(), ["uint8"] * 2),
  "pallas_gpu": (
    PallasGpuAttentionBackend(interpret=True),
    ["float8_e4m3fn"] * 2 + ["float32"] * 2,
  ),
  "pallas_tpu": (PallasTpuAttentionBackend(kernel=tpu_layout_kernel), ["float8_e4m3fn"]),
}
TINY_PARAMS = je.SamplingParams(
  temperature=0, ignore_eos=True, max_tokens=5, prompt_logprobs=0, logprobs=0
)
#: Teacher-forced prompt logprobs and the generated tokens' logprobs, fp8 pages against float32
#: pages. Measured: per-tensor scales (XLA, TPU) 0.109 prompt / 0.042 generated, the GPU layout
#: 0.052 / 0.069; the greedy tokens were all equal.
TINY_LOGPROB_BOUND = 0.2


def _run_tiny(model, monkeypatch, name: str, kv_cache_dtype: str) -> tuple[list, list]:
  backend, _ = TINY_BACKENDS[name]
  monkeypatch.setattr(kv_cache_pool, "attention_backend", lambda *args, **kwargs: backend)
  engine = LLMEngine(
    model, max_num_reqs=2, max_model_len=16, block_size=4, num_kv_blocks=12,
    kv_cache_dtype=kv_cache_dtype, attention_backend=name,
  )  # fmt: skip
  rng = np.random.default_rng(0)
  for i, n in enumerate((9, 6)):
    engine.add_request(str(i), rng.integers(4, 64, n).tolist(), TINY_PARAMS)
  finished = step_to_end(engine)
  pages = [str(p.dtype) for p in engine.runner.kv_cache.pages[0]]
  return sorted(finished, key=lambda o: int(o.request_id)), pages


@pytest.fixture(scope="module")
def tiny_model():
  return tiny_llama(vocab_size=64)[0]


@pytest.fixture(scope="module")
def tiny_float32_outputs(tiny_model):
  with pytest.MonkeyPatch.context() as monkeypatch:
    return _run_tiny(tiny_model, monkeypatch, "xla", "auto")[0]


@pytest.mark.parametrize("name", list(TINY_BACKENDS))
def test_fp8_pages_on_every_backend_stay_close_to_float32_pages(
  tiny_model, tiny_float32_outputs, monkeypatch, name
):
  """An engine with fp8 pages on each backend (decode steps take the GPU kernel, prefill steps
  its XLA path): the same greedy tokens as float32 pages, every logprob within
  `TINY_LOGPROB_BOUND`."""
  got, pages = _run_tiny(tiny_model, monkeypatch, name, "fp8")
  assert pages == TINY_BACKENDS[name][1]
  for want, out in zip(tiny_float32_outputs, got):
    assert out.outputs[0].token_ids == want.outputs[0].token_ids
    gaps = np.abs(_prompt_logprobs(out) - _prompt_logprobs(want))
    generated = [_generated_logprobs(o) for o in (out, want)]
    gaps = np.concatenate([gaps, np.abs(generated[0] - generated[1])])
    assert 0 < gaps.max() < TINY_LOGPROB_BOUND, gaps.max()


def _generated_logprobs(output) -> np.ndarray:
  completion = output.outputs[0]
  return np.array([e[t].logprob for e, t in zip(completion.logprobs, completion.token_ids)])
