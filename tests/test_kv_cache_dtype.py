"""`kv_cache_dtype="fp8"`: float8_e4m3fn pages, four times the pages of float32 in the same bytes.

SmolLM2-135M (float32) with float32 pages against fp8 pages, the same 16 MiB pool. The bounds are
those measured on four short prompts (prompt logprobs at most 0.67 apart, 0.09 on the first
prompt, whose 24 greedy tokens were equal), with room for another machine's float sums.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jaxengine as je
from jaxengine.models.paged_attention import (
  FP8_KV_DTYPE,
  FP8_KV_MAX,
  FP8_KV_STORAGE,
  write_kv_pages,
)

PROMPTS = [
  "The capital of France is",
  "def fibonacci(n):",
  "Once upon a time, in a small village,",
  "The three primary colors are",
]
PARAMS = je.SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=0)


def _engine(kv_cache_dtype: str) -> je.LLM:
  return je.LLM(
    max_model_len=128,
    max_num_reqs=4,
    kv_cache_memory_bytes=16 * 2**20,
    kv_cache_dtype=kv_cache_dtype,
  )


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
    (dict(kv_cache_dtype="fp8", attention_backend="pallas_gpu"), "only 'xla'"),
    (dict(kv_cache_dtype="fp8", attention_backend="pallas_tpu"), "only 'xla'"),
  ],
)
def test_bad_kv_cache_dtypes_are_refused_by_name(options, message):
  with pytest.raises(ValueError, match=message):
    je.EngineConfig(**options)


def test_fp8_e4m3_is_fp8():
  assert je.EngineConfig(kv_cache_dtype="fp8_e4m3").kv_cache_dtype == "fp8"
  assert je.EngineConfig().kv_cache_dtype == "auto"


def test_writes_clip_to_the_fp8_range_instead_of_overflowing_to_nan():
  import jax.numpy as jnp

  pages = jnp.zeros((2, 4, 1, 2), FP8_KV_STORAGE)
  new = jnp.array([[[1e6, -1e6]], [[0.5, 3.0]]], jnp.float32)
  written = write_kv_pages(pages, new, jnp.array([4, 5], jnp.int32))
  out = jax.lax.bitcast_convert_type(written, FP8_KV_DTYPE).astype(jnp.float32)
  np.testing.assert_array_equal(out[1, 0, 0], [FP8_KV_MAX, -FP8_KV_MAX])
  np.testing.assert_array_equal(out[1, 1, 0], [0.5, 3.0])
