"""The cost of a pause-load-resume cycle (issue 52): SmolLM2-135M-Instruct with 64 requests in
flight, the weight sync of an asynchronous RL loop.

64 requests (32-token prompts, 64 tokens each, ignore_eos; half greedy, half seeded at temperature
1) run for a few steps; then `pause_generation("keep")`, `load_weights` of the engine's own
weights with a new `weight_version`, `resume_generation`, and the rest of the run. Reports each
part's wall time and the executables compiled during the cycle (`count_compiles`), and checks the
outputs equal an uninterrupted run's (same weights) and the versions stamped on the tokens.

Usage:
  python benchmarks/bench_pause.py            # ~2 min on 2 cores
"""

from __future__ import annotations

import time

import jax

import jaxengine as je
from jaxengine.testing import count_compiles

NUM_REQUESTS = 64


def _requests() -> list[tuple[str, je.SamplingParams]]:
  requests = []
  for i in range(NUM_REQUESTS):
    prompt = " ".join(["word"] * 30) + f" {i}"
    seeded = {"temperature": 1.0, "seed": i} if i % 2 else {"temperature": 0.0}
    requests.append((prompt, je.SamplingParams(max_tokens=64, ignore_eos=True, **seeded)))
  return requests


def _finish(engine, done: dict) -> None:
  while engine.has_unfinished_requests():
    done.update((o.request_id, o) for o in engine.step() if o.finished)


def main() -> None:
  llm = je.LLM(max_num_reqs=NUM_REQUESTS, max_model_len=128)
  engine = llm.llm_engine
  want: dict = {}
  engine.add_requests([(f"w{i}", p, sp) for i, (p, sp) in enumerate(_requests())])
  _finish(engine, want)  # warm-up and the uninterrupted reference
  engine.reset_prefix_cache()
  weights = engine.runner.weights
  done: dict = {}
  engine.add_requests([(f"w{i}", p, sp) for i, (p, sp) in enumerate(_requests())])
  for _ in range(8):
    engine.step()
  in_flight = len(engine.scheduler.running)
  with count_compiles() as compiles:
    start = time.perf_counter()
    done.update((o.request_id, o) for o in engine.pause_generation("keep") if o.finished)
    paused = time.perf_counter()
    engine.load_weights(weights, weight_version=1)
    loaded = time.perf_counter()
    engine.resume_generation()
    resumed = time.perf_counter()
    engine.step()
    first_step = time.perf_counter()
  _finish(engine, done)
  same = all(done[k].outputs[0].token_ids == want[k].outputs[0].token_ids for k in want)
  versions = {tuple(sorted(set(o.outputs[0].weight_versions))) for o in done.values()}
  print(f"{in_flight} requests running at the pause; backend {jax.default_backend()}")

  print(f"pause_generation('keep'): {paused - start:.3f} s (reads the step in flight)")
  print(f"load_weights(weight_version=1): {loaded - paused:.3f} s")
  print(
    f"resume_generation: {resumed - loaded:.4f} s; first step after it: {first_step - resumed:.3f} s"
  )
  print(
    f"cycle (pause + load + resume): {resumed - start:.3f} s; "
    f"compiles during it and the step after: {compiles.count}"
  )
  print(f"outputs equal to the uninterrupted run: {same}; weight versions seen: {sorted(versions)}")


if __name__ == "__main__":
  main()
