"""Another checkout's jaxengine as a baseline, driven one job per line over stdin, as
benchmarks/vllm_baseline.py drives vLLM: `bench_generate.py --compare-hf --against REV` starts it
with the package of git revision REV (or a checkout directory) first on `PYTHONPATH`, and times it
in turn with this checkout, HF `generate` and vLLM, so a before/after table comes from one run.

Protocol: the same as benchmarks/vllm_baseline.py: ``{"prompts": [[token ids], ...],
"max_tokens": N}`` in, ``{"seconds", "token_ids"}`` of one greedy `LLM.generate` of every prompt
at once (ignore_eos) out; the first line out is ``{"ready": true, "jaxengine": package directory,
"version": version}``. The model is a Hugging Face directory (benchmarks/export_hf.py writes the
default model as one); prefix caching is off, as in the other engines.
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
  parser.add_argument("--dtype", default="float32")
  args = parser.parse_args()
  out = os.fdopen(os.dup(1), "w")
  os.dup2(2, 1)  # the libraries' output to stderr; stdout carries the answers alone

  import jaxengine as je

  llm = je.LLM(
    args.model,
    dtype=args.dtype,
    max_num_reqs=args.max_num_seqs,
    max_model_len=args.max_model_len,
    enable_prefix_caching=False,
  )
  package = os.path.dirname(os.path.abspath(je.__file__))
  ready = {"ready": True, "jaxengine": package, "version": je.__version__}
  print(json.dumps(ready), file=out, flush=True)
  for line in sys.stdin:
    if not line.strip():
      continue
    job = json.loads(line)
    params = je.SamplingParams(temperature=0, max_tokens=job["max_tokens"], ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(job["prompts"], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    print(json.dumps({"seconds": seconds, "token_ids": token_ids}), file=out, flush=True)


if __name__ == "__main__":
  main()
