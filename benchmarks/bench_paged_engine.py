"""The engine's paged KV cache end to end on SmolLM2-135M-Instruct (issue 22; the slot cache it was
first measured against is gone, see benchmarks/README.md for those tables).

Tables, every engine built on the same loaded model and timed in the same run:

- ``capacity``: at one KV-cache memory (``--memory-mb``), ``--num-requests`` requests with prompts
  of 16 to 512 tokens and outputs of 16 to 256 (uniform, seeded; ignore_eos, temperature 0.8,
  top-k 50), all submitted at once, 64 rows over a pool of those bytes. Reports the peak number of
  requests running at once and tokens/s (generated tokens / wall time).
- ``arrival``: 8 requests decode (32-token prompts, greedy, 160 tokens); after 24 steps a
  ``--long-prompt``-token prompt arrives. For the 8 running requests: the largest gap between two
  of their tokens against their median gap, with chunked prefill (``--chunk`` tokens per step)
  and without it (the whole prompt in one step).
- ``rollout``: an RL rollout, the issue's "done when": ``--rollout-prompts`` prompts (64 to 128
  tokens, a shared 48-token system prefix) times ``--n`` seeded samples each (temperature 1,
  64 tokens, the sampled token's logprob), all submitted at once, one row per sample over a pool
  of ``--rollout-memory-mb``. Reports the peak number of samples running at once, preemptions
  and tokens/s.
- ``e2e``: batch 1, 8, 32 of 64-token prompts, 64 greedy tokens each (ignore_eos), all at once,
  wall time including prefill, best of ``--repeats``.
- ``speculative`` (only when asked): n-gram speculation (``--speculative`` k) against plain
  decoding, bench_generate.py's "repetitive" prompts, greedy, ``--spec-max-tokens`` tokens,
  interleaved, best of ``--repeats``.
- ``multistep`` (not in the default set): batch 8 of the same requests, decode tokens/s after
  every request's first token, ``num_decode_steps`` 1 and 8.

Usage:
  python benchmarks/bench_paged_engine.py --tables capacity arrival e2e   # ~10 min on 2 cores
  python benchmarks/bench_paged_engine.py --tables rollout
  python benchmarks/bench_paged_engine.py --tables e2e --batch-sizes 8
  python benchmarks/bench_paged_engine.py --tables speculative --batch-sizes 1 8 --repeats 1
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import jax
import numpy as np

import jaxengine as je
from jaxengine.engine import LLMEngine

BYTES_PER_FLOAT = 4


def _text_ids(tokenizer, length: int, offset: int = 0) -> list[int]:
  text = (
    "The history of science is the study of the development of science and scientific "
    "knowledge, including both the natural and social sciences. Astronomy, medicine and "
    "mathematics grew together over many centuries in many places. "
  ) * (length // 20 + 8)
  ids = tokenizer.encode(text)
  return ids[offset : offset + length]


def _run(engine, requests) -> tuple[float, dict[str, list[int]]]:
  """Runs `(prompt, params)` requests submitted at once; (seconds, tokens by request id). The
  prefix cache is emptied first, so every run computes the same shapes as its warm-up."""
  engine.reset_prefix_cache()
  start = time.perf_counter()
  ids = engine.add_requests([(None, {"prompt_token_ids": p}, params) for p, params in requests])
  outputs = {}
  while engine.has_unfinished_requests():
    outputs.update((o.request_id, o) for o in engine.step() if o.finished)
  seconds = time.perf_counter() - start
  return seconds, {i: outputs[i].outputs[0].token_ids for i in ids}


def capacity(model, tokenizer, args) -> None:
  rng = np.random.default_rng(0)
  max_model_len = 768
  memory = args.memory_mb * 2**20
  requests = []
  for i in range(args.num_requests):
    prompt_len, output_len = int(rng.integers(16, 513)), int(rng.integers(16, 257))
    params = je.SamplingParams(
      temperature=0.8, top_k=50, seed=i, max_tokens=output_len, ignore_eos=True
    )
    requests.append((_text_ids(tokenizer, prompt_len, i % 13), params))
  engines = {
    "paged (64 rows)": LLMEngine(
      model,
      tokenizer,
      max_num_reqs=64,
      max_model_len=max_model_len,
      kv_cache_memory_bytes=memory,
      max_num_batched_tokens=args.chunk,
    ),
  }
  generated = sum(params.max_tokens for _, params in requests)
  print(
    f"\n## capacity: {args.num_requests} requests, prompts 16-512, outputs 16-256 "
    f"({generated} tokens), KV cache {args.memory_mb} MiB\n"
  )
  print("| engine | peak running requests | tokens/s |\n|---|---:|---:|")
  for name, engine in engines.items():
    _run(engine, requests)  # warm-up: compiles the shapes the run reaches
    engine.reset_kv_cache_stats()
    seconds, _ = _run(engine, requests)
    peak = engine.kv_cache_stats.peak_running_reqs
    print(f"| {name} | {peak} | {generated / seconds:.1f} |", flush=True)


def _gaps(engine, running, long_prompt, arrive_after: int) -> tuple[float, float]:
  """(largest, median) seconds between two tokens of the running requests."""
  greedy = je.SamplingParams(temperature=0, max_tokens=160, ignore_eos=True)
  ids = engine.add_requests([(None, {"prompt_token_ids": p}, greedy) for p in running])
  last: dict[str, float] = {}
  gaps: list[float] = []
  step = 0
  while engine.has_unfinished_requests():
    if step == arrive_after:
      one = je.SamplingParams(temperature=0, max_tokens=1)
      engine.add_request(None, {"prompt_token_ids": long_prompt}, one)
    outputs = engine.step()
    now = time.perf_counter()
    for output in outputs:
      if output.request_id in ids:
        if output.request_id in last:
          gaps.append(now - last[output.request_id])
        last[output.request_id] = now
    step += 1
  engine.pop_finished()
  return max(gaps), statistics.median(gaps)


def arrival(model, tokenizer, args) -> None:
  max_model_len = args.long_prompt + 64
  running = [_text_ids(tokenizer, 32, i) for i in range(8)]
  long_prompt = _text_ids(tokenizer, args.long_prompt, 3)
  blocks = 8 * -(-(32 + 160) // 16) + -(-args.long_prompt // 16) + 16
  # Prefix caching off: the timed run must compute what its warm-up computed (same shapes).
  common = dict(max_model_len=max_model_len, max_num_reqs=16, enable_prefix_caching=False)
  paged = dict(num_kv_blocks=blocks + 1, **common)
  engines = {
    f"paged, chunked prefill ({args.chunk} tokens/step)": LLMEngine(
      model, tokenizer, max_num_batched_tokens=args.chunk, **paged
    ),
    "paged, no chunked prefill": LLMEngine(
      model,
      tokenizer,
      enable_chunked_prefill=False,
      max_num_batched_tokens=max_model_len,
      **paged,
    ),
  }
  print(
    f"\n## latency under arrival: 8 requests decoding, a {args.long_prompt}-token prompt "
    "arrives after 24 steps\n"
  )
  print("| engine | largest gap ms | median gap ms | ratio |\n|---|---:|---:|---:|")
  for name, engine in engines.items():
    _gaps(engine, running, long_prompt, 24)  # warm-up: compiles every shape used
    largest, median = _gaps(engine, running, long_prompt, 24)
    print(
      f"| {name} | {largest * 1e3:.0f} | {median * 1e3:.1f} | {largest / median:.1f}x |",
      flush=True,
    )


def _run_samples(engine, requests) -> tuple[float, list[list[int]], list[list[float]]]:
  """Runs `(prompt, params)` requests at once; (seconds, tokens and sampled-token logprobs of
  every sample, request by request)."""
  engine.reset_prefix_cache()
  start = time.perf_counter()
  ids = engine.add_requests([(None, {"prompt_token_ids": p}, params) for p, params in requests])
  outputs = {}
  while engine.has_unfinished_requests():
    outputs.update((o.request_id, o) for o in engine.step() if o.finished)
  seconds = time.perf_counter() - start
  samples = [s for i in ids for s in outputs[i].outputs]
  logprobs = [[d[t].logprob for d, t in zip(s.logprobs, s.token_ids)] for s in samples]
  return seconds, [list(s.token_ids) for s in samples], logprobs


def rollout(model, tokenizer, args) -> None:
  rng = np.random.default_rng(0)
  max_model_len = 256
  memory = args.rollout_memory_mb * 2**20
  system = _text_ids(tokenizer, 48, 5)
  requests = []
  for i in range(args.rollout_prompts):
    question = _text_ids(tokenizer, int(rng.integers(16, 81)), i % 11)
    params = je.SamplingParams(
      n=args.n, temperature=1.0, seed=i, max_tokens=64, ignore_eos=True, logprobs=0
    )
    requests.append(([*system, *question], params))
  num_samples = args.rollout_prompts * args.n
  engines = {
    f"paged ({num_samples} rows)": LLMEngine(
      model,
      tokenizer,
      max_num_reqs=num_samples,
      max_model_len=max_model_len,
      kv_cache_memory_bytes=memory,
    ),
  }
  print(
    f"\n## rollout: {args.rollout_prompts} prompts x n={args.n} = {num_samples} samples, "
    f"64 tokens each, KV cache {args.rollout_memory_mb} MiB\n"
  )
  print("| engine | peak running samples | preemptions | tokens/s |\n|---|---:|---:|---:|")
  for name, engine in engines.items():
    _run_samples(engine, requests)  # warm-up: compiles the shapes the run reaches
    engine.reset_kv_cache_stats()
    seconds, _, _ = _run_samples(engine, requests)
    stats = engine.kv_cache_stats
    rate = num_samples * 64 / seconds
    print(
      f"| {name} | {stats.peak_running_reqs} | {stats.num_preemptions} | {rate:.1f} |", flush=True
    )


def e2e(model, tokenizer, args) -> None:
  greedy = je.SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
  blocks = 32 * -(-128 // 16) + 1
  engines = {
    "paged": LLMEngine(model, tokenizer, max_num_reqs=32, max_model_len=256, num_kv_blocks=blocks),
  }
  print(
    "\n## end to end: 64-token prompts, 64 greedy tokens, all at once (tokens/s)\n\n"
    "| batch | paged |\n|---:|---:|"
  )
  for size in args.batch_sizes:
    requests = [(_text_ids(tokenizer, 64, i % 7), greedy) for i in range(size)]
    best = {}
    for engine in engines.values():
      _run(engine, requests)  # warm-up
    for _ in range(args.repeats):
      for name, engine in engines.items():
        seconds, _ = _run(engine, requests)
        best[name] = min(best.get(name, float("inf")), seconds)
    print(f"| {size} | {size * 64 / best['paged']:.1f} |", flush=True)


def speculative(model, tokenizer, args) -> None:
  """Tokens/s of n-gram speculation (k = `--speculative`) against plain decoding, on
  bench_generate.py's "repetitive" workload (greedy)."""
  from bench_generate import _PARAGRAPHS, _chat_prompts

  config = {"method": "ngram", "num_speculative_tokens": args.speculative}
  rows, max_model_len = max(args.batch_sizes), 512
  paged = {"num_kv_blocks": rows * max_model_len // 16 + 1, "max_num_batched_tokens": 1024}
  common = {"max_num_reqs": rows, "max_model_len": max_model_len, "enable_prefix_caching": False}
  engines = {
    "paged plain": LLMEngine(model, tokenizer, **common, **paged),
    "paged spec": LLMEngine(model, tokenizer, **common, **paged, speculative_config=config),
  }
  greedy = je.SamplingParams(temperature=0, max_tokens=args.spec_max_tokens)
  texts = [f"Repeat this text exactly, and nothing else:\n\n{p}" for p in _PARAGRAPHS]
  print(
    f"\n## n-gram speculation k={args.speculative}, repetitive prompts, greedy, "
    f"{args.spec_max_tokens} tokens (tokens/s, best of {args.repeats})\n\n"
    "| batch | paged plain | paged spec | paged spec / paged plain | acceptance |\n"
    "|---:|---:|---:|---:|---:|"
  )
  for size in args.batch_sizes:
    requests = [(p, greedy) for p in _chat_prompts(tokenizer, texts, size)]
    outputs = {name: _run(engine, requests)[1] for name, engine in engines.items()}  # warm-up
    stats = engines["paged spec"].spec_decode_stats
    drafted, accepted = stats.num_draft_tokens, stats.num_accepted_tokens
    rate: dict[str, float] = {}
    for _ in range(args.repeats):
      for name, engine in engines.items():
        seconds, tokens = _run(engine, requests)
        rate[name] = max(rate.get(name, 0.0), sum(map(len, tokens.values())) / seconds)
    acceptance = (stats.num_accepted_tokens - accepted) / max(stats.num_draft_tokens - drafted, 1)
    same = len({tuple(map(tuple, o.values())) for o in outputs.values()}) == 1
    print(
      f"| {size} | {rate['paged plain']:.1f} | {rate['paged spec']:.1f} "
      f"| {rate['paged spec'] / rate['paged plain']:.2f}x | {acceptance:.2f}"
      f"{'' if same else ' (outputs differ)'} |",
      flush=True,
    )


def _decode_rate(engine, requests) -> tuple[float, dict[str, list[int]]]:
  """Runs requests submitted at once; (decode tokens/s after every request has its first token,
  tokens by request id)."""
  engine.reset_prefix_cache()
  ids = engine.add_requests([(None, {"prompt_token_ids": p}, params) for p, params in requests])
  started: set[str] = set()
  outputs: dict[str, list[int]] = {}
  while len(started) < len(ids):  # prefill: every request's first token
    for o in engine.step():
      if o.outputs[0].token_ids:
        started.add(o.request_id)
      if o.finished:
        outputs[o.request_id] = o.outputs[0].token_ids
  jax.effects_barrier()
  start = time.perf_counter()
  while engine.has_unfinished_requests():
    outputs.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
  seconds = time.perf_counter() - start
  decoded = sum(len(t) - 1 for t in outputs.values())
  return decoded / seconds, {i: outputs[i] for i in ids}


def multistep(model, tokenizer, args) -> None:
  """Decode tokens/s of `num_decode_steps` k = 8 against k = 1: batch 8, 64-token prompts, 64
  greedy tokens (ignore_eos), the runs interleaved."""
  greedy = je.SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
  common = {"max_num_reqs": 8, "max_model_len": 256}
  blocks = 8 * -(-128 // 16) + 1
  engines = {
    "paged k=1": LLMEngine(model, tokenizer, **common, num_kv_blocks=blocks),
    "paged k=8": LLMEngine(model, tokenizer, **common, num_kv_blocks=blocks, num_decode_steps=8),
  }
  requests = [(_text_ids(tokenizer, 64, i % 7), greedy) for i in range(8)]
  outputs, best = {}, {}
  for name, engine in engines.items():
    _, outputs[name] = _decode_rate(engine, requests)  # warm-up
  for _ in range(args.repeats):
    for name, engine in engines.items():
      rate, _ = _decode_rate(engine, requests)
      best[name] = max(best.get(name, 0.0), rate)
  print("\n## k-step decode: batch 8, 64 greedy tokens (decode tokens/s, best of repeats)\n")
  print("| engine | decode tokens/s | same tokens as paged k=1 |\n|---|---:|---|")
  for name in engines:
    same = outputs[name] == outputs["paged k=1"]
    print(f"| {name} | {best[name]:.1f} | {same} |", flush=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--tables", nargs="+", default=["capacity", "arrival", "rollout", "e2e"])
  parser.add_argument("--memory-mb", type=int, default=288)
  parser.add_argument("--num-requests", type=int, default=32)
  parser.add_argument("--long-prompt", type=int, default=2000)
  parser.add_argument("--chunk", type=int, default=256, help="paged token budget per step")
  parser.add_argument("--rollout-prompts", type=int, default=32)
  parser.add_argument("--n", type=int, default=8)
  parser.add_argument("--rollout-memory-mb", type=int, default=1200)
  parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--speculative", type=int, default=4, help="k of the speculative table")
  parser.add_argument("--spec-max-tokens", type=int, default=64)
  args = parser.parse_args()
  print(
    f"# {platform.processor() or platform.machine()}, jax {jax.__version__}, "
    f"{jax.default_backend()}, {time.strftime('%Y-%m-%d %H:%M')}"
  )
  llm = je.LLM(max_num_reqs=1, max_model_len=256, enable_prefix_caching=False)
  model, tokenizer = llm.llm_engine.runner.model, llm.get_tokenizer()
  tables = {
    "capacity": capacity,
    "arrival": arrival,
    "rollout": rollout,
    "e2e": e2e,
    "speculative": speculative,
    "multistep": multistep,
  }
  for name in args.tables:
    tables[name](model, tokenizer, args)


if __name__ == "__main__":
  main()
