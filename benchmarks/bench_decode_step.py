"""One decode step at batch B, jaxengine against vLLM's CPU engine, from whole generations.

B prompts of 64 tokens generate 1 token and then 65 tokens (greedy, ignore_eos), each engine in
turn (vLLM in its own interpreter, benchmarks/vllm_baseline.py); best of `--repeats`. A decode
step is (t65 - t1) / 64: the prefill and the first token cancel out, and what is left is the 64
steps every request decodes, host work included. SmolLM2-135M float32 from a Hugging Face
directory (written by benchmarks/export_hf.py when missing); prefix caching off in both.

Usage:
  python benchmarks/bench_decode_step.py --vllm-python /path/to/vllm-venv/bin/python [--batch-size 8]
"""

from __future__ import annotations

import argparse
import time

from bench_generate import BaselineProcess

import jaxengine as je


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--vllm-python", required=True)
  parser.add_argument("--model", default="/tmp/jaxengine-bench-hf", help="Hugging Face directory")
  parser.add_argument("--batch-size", type=int, default=8)
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args()
  b = args.batch_size
  prompts = [[(17 * i + 3 * j) % 40000 + 100 for j in range(64)] for i in range(b)]
  vllm = BaselineProcess(args.vllm_python, "vllm_baseline.py", args.model, [])
  llm = je.LLM(args.model, max_num_reqs=32, max_model_len=256, enable_prefix_caching=False)

  def jaxengine_seconds(n: int) -> float:
    params = je.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start

  engines = {
    "jaxengine": jaxengine_seconds,
    "vLLM": lambda n: vllm.generate(prompts, n)["seconds"],
  }
  for run in engines.values():  # warm-up: compiles, first-touch allocations
    run(1), run(65)
  times: dict[str, dict[int, list[float]]] = {name: {1: [], 65: []} for name in engines}
  for _ in range(args.repeats):
    for name, run in engines.items():
      for n in (1, 65):
        times[name][n].append(run(n))
  vllm.close()
  for name, by_n in times.items():
    t1, t65 = min(by_n[1]), min(by_n[65])
    print(
      f"{name}: B={b} prefill + 1 token {t1 * 1e3:.1f} ms, 65 tokens {t65 * 1e3:.1f} ms, "
      f"decode step {(t65 - t1) / 64 * 1e3:.2f} ms"
    )


if __name__ == "__main__":
  main()
