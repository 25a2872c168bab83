"""The paged KV cache's default size: pages for every row at full length and a quarter more,
within the device memory the engine may take (`jaxengine/worker/kv_cache_size.py`)."""

from __future__ import annotations

import dataclasses
import os

import jax
import pytest
from output_utils import step_to_end

import jaxengine as je
from jaxengine.engine import LLMEngine
from jaxengine.models.attention_backends import attention_backend
from jaxengine.params import SamplingParams
from jaxengine.testing import tiny_llama
from jaxengine.worker.kv_cache_size import (
  DEFAULT_CPU_KV_CACHE_BYTES,
  check_kv_cache_fits,
  default_num_kv_blocks,
  memory_limit,
)


@dataclasses.dataclass
class FakeAccelerator:
  """A device reporting memory statistics as GPU and TPU devices do."""

  bytes_limit: int
  bytes_in_use: int

  def memory_stats(self) -> dict[str, int]:
    return {"bytes_limit": self.bytes_limit, "bytes_in_use": self.bytes_in_use}


def test_the_default_pool_holds_every_row_at_full_length_and_a_quarter_more():
  model, _ = tiny_llama(vocab_size=32)
  engine = LLMEngine(model, max_num_reqs=4, max_model_len=40, block_size=8)
  stats = engine.kv_cache_stats
  # 4 rows x ceil(40 / 8) = 20 pages, a quarter more: 25 usable (the null page aside).
  assert stats.num_blocks == 25
  assert engine.config.prefix_caching is True


def test_the_memory_limit_is_the_tightest_device_share_or_the_cpu_default():
  devices = [FakeAccelerator(1000, 100), FakeAccelerator(2000, 0)]
  assert memory_limit(devices, 0.5) == min(500 - 100, 1000 - 0)
  assert memory_limit(jax.devices()[:1], 0.9) == DEFAULT_CPU_KV_CACHE_BYTES  # CPU: no stats


def test_the_default_pool_stays_within_the_memory_limit_and_names_it_when_too_small():
  model, _ = tiny_llama(vocab_size=32)
  spec, backend = model.kv_cache_spec, attention_backend("xla")
  per_page = 2 * spec.num_layers * 8 * spec.num_kv_heads * spec.head_dim * 4  # float32 k and v
  sizes = dict(max_num_reqs=4, max_num_blocks_per_req=5, block_size=8, gpu_memory_utilization=1.0)
  roomy = [FakeAccelerator(10**9, 0)]
  assert default_num_kv_blocks(spec, backend, devices=roomy, **sizes) == 26
  tight = [FakeAccelerator(10 * per_page + 100, 100)]  # ten pages free after the weights
  assert default_num_kv_blocks(spec, backend, devices=tight, **sizes) == 10
  full = [FakeAccelerator(per_page, per_page)]
  with pytest.raises(ValueError, match=r"gpu_memory_utilization=1.0 .* give kv_cache_memory_bytes"):
    default_num_kv_blocks(spec, backend, devices=full, **sizes)


def test_a_cache_larger_than_memory_is_refused_before_allocation():
  model, _ = tiny_llama(vocab_size=32)
  with pytest.raises(ValueError, match=r"kv_cache_memory_bytes=1125899906842624 \(.*the mach"):
    LLMEngine(model, max_num_reqs=2, max_model_len=32, kv_cache_memory_bytes=2**50)
  # A pool of pages is checked the same way (not a RESOURCE_EXHAUSTED from the allocator).
  with pytest.raises(ValueError, match=r"num_kv_blocks=1000000000000 \(.*the machine's physical"):
    LLMEngine(model, max_num_reqs=2, max_model_len=32, num_kv_blocks=10**12)
  accelerator = [FakeAccelerator(bytes_limit=1000, bytes_in_use=100)]
  with pytest.raises(ValueError, match=r"x=1 \(1000 bytes per device\) exceeds free on .* \(900"):
    check_kv_cache_fits(1000, accelerator, asked="x=1")
  check_kv_cache_fits(900, accelerator, asked="x=1")
  # CPU devices share the machine's memory: their pools add up.
  physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  check_kv_cache_fits(physical // 2, jax.devices()[:1], asked="x=1")
  with pytest.raises(ValueError, match=r"x 3 CPU devices\) exceeds the machine's physical memory"):
    check_kv_cache_fits(physical // 2, jax.devices()[:1] * 3, asked="x=1")


@pytest.mark.parametrize("name, platforms", [("pallas_tpu", "tpu"), ("pallas_gpu", "gpu")])
def test_a_pallas_backend_off_its_platform_is_refused_when_the_engine_is_built(name, platforms):
  model, _ = tiny_llama(vocab_size=32)
  with pytest.raises(ValueError, match=rf"attention_backend='{name}' runs on {platforms}"):
    LLMEngine(model, max_num_reqs=2, max_model_len=32, attention_backend=name)


@pytest.mark.parametrize("name", ["pallas_tpu", "pallas_gpu"])
def test_a_pallas_backend_off_its_platform_is_refused_before_a_model_loads(name, monkeypatch):
  import jaxengine.engine.model_loader as model_loader

  def no_load(*args, **kwargs):
    raise AssertionError("the weights were loaded")

  monkeypatch.setattr(model_loader, "load_resolved", no_load)
  with pytest.raises(ValueError, match=rf"attention_backend='{name}' runs on"):
    je.LLM(attention_backend=name, kv_cache_dtype="fp8")


def _per_page(spec, block_size: int = 16) -> int:
  return 2 * spec.num_layers * block_size * spec.num_kv_heads * spec.head_dim * 4  # f32 k and v


def test_a_32k_model_starts_on_cpu_in_the_default_budget_with_its_own_limit():
  """The default `max_model_len` is the model's 32768 positions: the pool is the CPU budget's at
  most (not `max_num_reqs` requests of 32k tokens whatever they cost), at least one full
  request; the block table is `ceil(32768 / 16)` pages wide and a request runs."""
  model, _ = tiny_llama(vocab_size=32, max_position_embeddings=32768)
  engine = LLMEngine(model, max_num_reqs=4)
  assert engine.max_model_len == 32768
  stats = engine.kv_cache_stats
  assert stats is not None
  assert stats.num_blocks >= 32768 // 16
  assert (stats.num_blocks + 1) * _per_page(model.kv_cache_spec) <= DEFAULT_CPU_KV_CACHE_BYTES
  assert engine.runner.block_table.max_num_blocks_per_req == 2048
  engine.add_request("long", list(range(3, 30)) * 40, SamplingParams(max_tokens=3))
  (output,) = step_to_end(engine)
  assert len(output.outputs[0].token_ids) == 3


def test_the_default_pool_holds_one_full_request_or_is_refused():
  """vLLM's rule: the budget need not hold every row at full length, but one request of
  `max_model_len` tokens must fit. On CPU the 1 GiB default grows to one such request (bounded by
  the physical memory); on an accelerator a budget below one is refused, naming max_model_len."""
  model, _ = tiny_llama(vocab_size=32)
  spec, backend = model.kv_cache_spec, attention_backend("xla")
  per_page = _per_page(spec)
  pages = DEFAULT_CPU_KV_CACHE_BYTES // per_page + 10  # one request: more than the CPU default
  sizes = dict(max_num_reqs=4, block_size=16, gpu_memory_utilization=1.0)
  cpu = jax.devices()[:1]
  assert default_num_kv_blocks(
    spec, backend, devices=cpu, max_num_blocks_per_req=pages, **sizes
  ) == (1 + pages)
  roomy = default_num_kv_blocks(spec, backend, devices=cpu, max_num_blocks_per_req=100, **sizes)
  assert roomy == 1 + 4 * 100 * 1.25  # every row and a quarter more fit in the budget
  with pytest.raises(ValueError, match="more than the machine's physical memory"):
    default_num_kv_blocks(spec, backend, devices=cpu, max_num_blocks_per_req=2**40, **sizes)
  ten_pages = [FakeAccelerator(10 * per_page, 0)]
  assert default_num_kv_blocks(spec, backend, devices=ten_pages, max_num_blocks_per_req=9, **sizes)
  with pytest.raises(ValueError, match=r"10 KV cache blocks .* fewer than one request of max_mod"):
    default_num_kv_blocks(spec, backend, devices=ten_pages, max_num_blocks_per_req=10, **sizes)
