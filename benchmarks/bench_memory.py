"""Memory for colocated RL: int8 / fp8 weights and an fp8 KV cache against float32, in one run.

  python benchmarks/bench_memory.py [--batch-sizes 1 8 32] [--max-tokens 32] [--repeats 2]

SmolLM2-135M-Instruct, five engines: ``float32`` (weights and pages), ``int8`` and ``fp8``
(`quantization=`, weight-only), ``fp8 KV`` (`kv_cache_dtype="fp8"`, float32 weights) and
``int8 + fp8 KV``. For each:

- device bytes of the weights (every weight array's ``nbytes``: the quantized projections, their
  float32 row scales, and the float embedding, head and norms), bytes per KV page, and the pages
  a 64 MiB pool holds;
- the logprob error against the float32 engine, teacher-forced: the prompt logprobs of the
  shared fixture's prompt and PyTorch greedy continuation (tests/fixtures/smollm2_greedy.json)
  and of three paragraphs, max and mean |difference| over every predicted token;
- tokens/s at each batch size: ``B`` prompts of 64 tokens, ``--max-tokens`` greedy tokens each
  (ignore_eos), all at once; every engine warmed up on the shapes, then timed taking turns
  (`--repeats` rounds, the best run counts).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import numpy as np

import jaxengine as je

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "smollm2_greedy.json"
PARAGRAPHS = [
  "The history of science is the study of the development of science and scientific knowledge, "
  "including both the natural and social sciences.",
  "def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n    pivot = xs[0]\n"
  "    return quicksort([x for x in xs[1:] if x < pivot]) + [pivot]",
  "Photosynthesis converts light energy into chemical energy stored in glucose, releasing "
  "oxygen as a by-product.",
]
ENGINES = {
  "float32": {},
  "int8": dict(quantization="int8"),
  "fp8": dict(quantization="fp8"),
  "fp8 KV": dict(kv_cache_dtype="fp8"),
  "int8 + fp8 KV": dict(quantization="int8", kv_cache_dtype="fp8"),
}
POOL_BYTES = 64 * 2**20


def _engine(options: dict) -> je.LLM:
  return je.LLM(
    max_num_reqs=32,
    max_model_len=256,
    kv_cache_memory_bytes=POOL_BYTES,
    enable_prefix_caching=False,
    **options,
  )


def _weight_bytes(llm: je.LLM) -> int:
  return sum(leaf.nbytes for leaf in jax.tree.leaves(llm.llm_engine.runner.weights))


def _page_bytes(llm: je.LLM) -> float:
  runner = llm.llm_engine.runner
  pages = [p for layer in runner.kv_cache.pages for p in layer]
  return sum(p.nbytes for p in pages) / runner.num_blocks


def _teacher_forced(llm: je.LLM, sequences: list[list[int]]) -> np.ndarray:
  """Every predicted token's logprob under `llm`, the sequences concatenated."""
  params = je.SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
  outs = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
  return np.concatenate(
    [
      [entry[t].logprob for entry, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])]
      for o in outs
    ]
  )


def _tokens_per_second(engines, prompts, params, repeats: int) -> dict[str, float]:
  for llm in engines.values():  # warm-up: every shape compiled
    llm.generate(prompts, params, use_tqdm=False)
  best = {name: float("inf") for name in engines}
  for _ in range(repeats):
    for name, llm in engines.items():
      start = time.perf_counter()
      llm.generate(prompts, params, use_tqdm=False)
      best[name] = min(best[name], time.perf_counter() - start)
  return {name: len(prompts) * params.max_tokens / best[name] for name in engines}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
  parser.add_argument("--max-tokens", type=int, default=32)
  parser.add_argument("--repeats", type=int, default=2)
  args = parser.parse_args()
  engines = {name: _engine(options) for name, options in ENGINES.items()}
  tokenizer = engines["float32"].get_tokenizer()
  fixture = json.loads(FIXTURE.read_text())
  sequences = [fixture["prompt_ids"] + fixture["new_ids"]]
  sequences += [tokenizer.encode(text) for text in PARAGRAPHS]
  reference = _teacher_forced(engines["float32"], sequences)
  width = 16
  print(f"SmolLM2-135M, {jax.default_backend()}; pool of {POOL_BYTES // 2**20} MiB")
  print(f"{'':<28}" + "".join(f"{name:>{width}}" for name in engines))
  rows: dict[str, list[str]] = {"weight bytes (MB)": [], "KV bytes per page": [], "pages": []}
  rows |= {"logprob error max": [], "logprob error mean": []}
  for llm in engines.values():
    gap = np.abs(_teacher_forced(llm, sequences) - reference)
    rows["weight bytes (MB)"].append(f"{_weight_bytes(llm) / 1e6:.1f}")
    rows["KV bytes per page"].append(f"{_page_bytes(llm):,.0f}")
    rows["pages"].append(str(llm.llm_engine.runner.num_blocks))
    rows["logprob error max"].append(f"{gap.max():.4f}")
    rows["logprob error mean"].append(f"{gap.mean():.4f}")
  for label, values in rows.items():
    print(f"{label:<28}" + "".join(f"{v:>{width}}" for v in values))
  ids = tokenizer.encode(PARAGRAPHS[0] * 4)
  params = je.SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
  for batch in args.batch_sizes:
    prompts = [{"prompt_token_ids": ids[i % 7 : i % 7 + 64]} for i in range(batch)]
    rate = _tokens_per_second(engines, prompts, params, args.repeats)
    print(f"{f'tokens/s B={batch}':<28}" + "".join(f"{rate[n]:>{width}.1f}" for n in engines))


if __name__ == "__main__":
  main()
