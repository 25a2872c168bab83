"""End-to-end benchmark: SmolLM2-135M-Instruct tokens per second at several batch sizes.

For each batch size B, B prompts of `--prompt-len` tokens generate `--max-tokens` tokens each
(ignore_eos, chat-style sampling: temperature 0.7, top-k 50, top-p 0.9). Reports prefill tokens
per second (prompt tokens / prefill time), decode tokens per second (generated tokens / decode
time), and the share of one decode step spent in the sampler (a jitted sampler step alone on
`[max_num_reqs, vocab]` logits over the same batch, against the fused forward + sample step).
A warm-up generation of the same shapes runs first, so compile time is excluded.

Usage:
  python benchmarks/bench_generate.py                         # B = 1, 8, 32
  python benchmarks/bench_generate.py --batch-sizes 8 --max-tokens 32
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxengine as je
from jaxengine.sample import sample_step

PARAMS = dict(temperature=0.7, top_k=50, top_p=0.9, ignore_eos=True)


def _prompts(tokenizer, batch: int, length: int) -> list[list[int]]:
  text = (
    "The history of science is the study of the development of science and scientific "
    "knowledge, including both the natural and social sciences. "
  ) * 8
  ids = tokenizer.encode(text)
  return [ids[i % 7 : i % 7 + length] for i in range(batch)]


def _generate(engine, prompts, params):
  """Runs one generation; returns (prefill seconds, decode seconds, decode steps)."""
  prefill = [0.0]
  run_prefill = engine._prefill_sequences

  def timed_prefill(sequences):
    start = time.perf_counter()
    run_prefill(sequences)
    jax.block_until_ready(engine._kv_cache)
    prefill[0] += time.perf_counter() - start

  engine._prefill_sequences = timed_prefill
  engine.add_requests([(None, p, params) for p in prompts])
  start = time.perf_counter()
  steps = 0
  while engine.has_unfinished_requests():
    engine.step()
    steps += 1
  total = time.perf_counter() - start
  engine._prefill_sequences = run_prefill
  engine.pop_finished()
  return prefill[0], total - prefill[0], steps


def _sampler_share(engine, repeats: int = 5) -> tuple[float, float]:
  """(sampler ms, fused decode step ms) over the engine's current (full) batch."""
  batch = engine.batch
  rng = np.random.default_rng(0)
  logits = jnp.asarray(
    rng.standard_normal((batch.max_num_reqs, batch.vocab_size), dtype=np.float32)
  )
  state = jax.tree.map(jnp.copy, batch.state)
  metadata = batch.sampling_metadata

  def sampler():
    nonlocal state
    state, out = sample_step(state, metadata, logits)
    return out.sampled_token_ids

  def step():
    engine.step()

  times = {}
  for name, fn in (("sampler", sampler), ("step", step)):
    fn()
    samples = []
    for _ in range(repeats):
      start = time.perf_counter()
      jax.block_until_ready(fn())
      samples.append(time.perf_counter() - start)
    times[name] = statistics.median(samples) * 1e3
  return times["sampler"], times["step"]


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
  parser.add_argument("--prompt-len", type=int, default=64)
  parser.add_argument("--max-tokens", type=int, default=64)
  parser.add_argument("--max-model-len", type=int, default=256)
  parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  args = parser.parse_args(argv)
  print(
    f"# jaxengine {je.__version__}, jax {jax.__version__}, backend {jax.default_backend()}, "
    f"SmolLM2-135M-Instruct {args.dtype}, prompt {args.prompt_len} tokens, "
    f"{args.max_tokens} new tokens per request",
    flush=True,
  )
  params = je.SamplingParams(max_tokens=args.max_tokens, **PARAMS)
  for size in args.batch_sizes:
    llm = je.LLM(max_num_reqs=size, max_model_len=args.max_model_len, dtype=args.dtype)
    engine = llm.llm_engine
    prompts = _prompts(llm.get_tokenizer(), size, args.prompt_len)
    _generate(engine, prompts, params)  # warm-up: compiles every shape used below
    prefill_s, decode_s, steps = _generate(engine, prompts, params)
    prefill_tps = size * (args.prompt_len - 1) / prefill_s
    decode_tps = size * args.max_tokens / decode_s
    # Keep the batch full for the sampler-share measurement.
    engine.add_requests([(None, p, params.replace(max_tokens=10**4 // 2)) for p in prompts])
    engine.step()
    sampler_ms, step_ms = _sampler_share(engine)
    print(
      f"B={size:3d}  prefill {prefill_tps:9.1f} tok/s ({prefill_s * 1e3:7.1f} ms)   "
      f"decode {decode_tps:8.1f} tok/s ({decode_s / steps * 1e3:6.1f} ms/step)   "
      f"sampler {sampler_ms:6.2f} ms of a {step_ms:6.1f} ms step "
      f"({100 * sampler_ms / step_ms:4.1f}%)",
      flush=True,
    )


if __name__ == "__main__":
  main()
