"""End-to-end benchmark: SmolLM2-135M-Instruct tokens per second at several batch sizes.

With `--compare-hf`: the peer comparison instead. For each batch size, B prompts of
`--prompt-len` tokens generate exactly `--max-tokens` tokens each, greedily, all submitted at once,
timed as wall time including prefill, back to back: jaxengine `LLM(max_num_reqs=32)` (what a user
batching up to 32 would set, whatever B is) against Hugging Face transformers `generate` (PyTorch
CPU, float32, the same weights; needs `pip install torch`, see benchmarks/hf_baseline.py). Each
system runs the workload once to warm up, then `--repeats` times; the best run counts.

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
  runner = engine.runner
  run_prefill = runner.prefill  # the runner's public prefill step, timed on its own

  def timed_prefill(completions):
    start = time.perf_counter()
    result = run_prefill(completions)
    jax.block_until_ready(runner.kv_cache)
    prefill[0] += time.perf_counter() - start
    return result

  runner.prefill = timed_prefill
  engine.add_requests([(None, p, params) for p in prompts])
  start = time.perf_counter()
  steps = 0
  while engine.has_unfinished_requests():
    engine.step()
    steps += 1
  total = time.perf_counter() - start
  runner.prefill = run_prefill
  engine.pop_finished()
  return prefill[0], total - prefill[0], steps


def _sampler_share(engine, repeats: int = 5) -> tuple[float, float]:
  """(sampler ms, fused decode step ms) over the engine's current (full) batch."""
  batch = engine.runner.input_batch
  rng = np.random.default_rng(0)
  logits = jnp.asarray(
    rng.standard_normal((batch.max_num_reqs, batch.vocab_size), dtype=np.float32)
  )
  state = jax.tree.map(jnp.copy, batch.state)
  metadata = batch.sampling_metadata

  def sampler():
    nonlocal state
    state, out = je.sample_step(state, metadata, logits)
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


def compare_hf(args) -> None:
  """jaxengine vs HF `generate`, back to back, greedy, tokens/s including prefill."""
  import hf_baseline

  llm = je.LLM(max_num_reqs=32, max_model_len=args.max_model_len, dtype=args.dtype)
  hf = hf_baseline.hf_model(llm)
  greedy = je.SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
  print(
    "| batch | jaxengine tok/s | HF generate tok/s | ratio |\n|---:|---:|---:|---:|", flush=True
  )
  for size in args.batch_sizes:
    prompts = _prompts(llm.get_tokenizer(), size, args.prompt_len)
    tokens = size * args.max_tokens

    def ours(prompts=prompts):
      start = time.perf_counter()
      outputs = llm.generate(prompts, greedy, use_tqdm=False)
      assert all(len(o.outputs[0].token_ids) == args.max_tokens for o in outputs)
      return time.perf_counter() - start

    def theirs(prompts=prompts):
      return hf_baseline.hf_generate_seconds(hf, prompts, args.max_tokens)

    best: dict[str, float] = {}
    for run in (ours, theirs):
      run()  # warm-up (compiles)
    for _ in range(args.repeats):  # interleaved, so drifts in machine speed touch both alike
      for name, run in (("ours", ours), ("theirs", theirs)):
        best[name] = min(best.get(name, float("inf")), run())
    ours_tps, theirs_tps = tokens / best["ours"], tokens / best["theirs"]
    print(
      f"| {size} | {ours_tps:.1f} | {theirs_tps:.1f} | {ours_tps / theirs_tps:.2f}x |", flush=True
    )


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
  parser.add_argument("--prompt-len", type=int, default=64)
  parser.add_argument("--max-tokens", type=int, default=64)
  parser.add_argument("--max-model-len", type=int, default=256)
  parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  parser.add_argument("--compare-hf", action="store_true", help="jaxengine vs HF generate")
  parser.add_argument("--repeats", type=int, default=2, help="timed runs per system (--compare-hf)")
  args = parser.parse_args(argv)
  print(
    f"# jaxengine {je.__version__}, jax {jax.__version__}, backend {jax.default_backend()}, "
    f"SmolLM2-135M-Instruct {args.dtype}, prompt {args.prompt_len} tokens, "
    f"{args.max_tokens} new tokens per request",
    flush=True,
  )
  if args.compare_hf:
    compare_hf(args)
    return
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
