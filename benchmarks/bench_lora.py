"""LoRA adapters end to end: tokens per second of the base model and of unmerged adapters.

  python benchmarks/bench_lora.py [--batch-sizes 1 8 32] [--max-tokens 32] [--repeats 2]

SmolLM2-135M-Instruct (float32), ``B`` prompts of ``--prompt-len`` tokens each generating
``--max-tokens`` tokens greedily (ignore_eos), all submitted at once; tokens/s is generated
tokens over wall time (prefill included). Adapters are random PEFT directories written here
(every one of the seven projections targeted, ``lora_alpha = 2 r``), so nothing is downloaded.
Five columns, each an engine warmed up on the same shapes, then timed taking turns with the
others (`--repeats` rounds, the best run counts):

- ``base``: `LLM` without `enable_lora`;
- ``lora on, base reqs``: `enable_lora=True` (``max_lora_rank=8``), every request on the base;
- ``r8``: the same engine, every request with one rank-8 adapter;
- ``r64``: ``max_lora_rank=64``, every request with one rank-64 adapter;
- ``4 x r8 mixed``: ``max_loras=4``, the requests spread over four rank-8 adapters.

Checks at each batch size: every rerun gives its column's warm-up tokens, base requests give
the same tokens with and without `enable_lora`, and the rank-8 adapter changes the first
sampled token's logprob.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

import jaxengine as je
from jaxengine.models.lora import LORA_TARGETS

PROMPT_TEXT = (
  "The history of science is the study of the development of science and scientific "
  "knowledge, including both the natural and social sciences. "
) * 8


def write_adapter(
  path: Path, shapes: dict[str, tuple[int, int]], layers: int, rank: int, seed: int
):
  """A random PEFT adapter directory of `rank` over every target of `shapes` (``(in, out)``)."""
  rng = np.random.default_rng(seed)
  tensors = {}
  for layer in range(layers):
    for target, (n_in, n_out) in shapes.items():
      part = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
      name = f"base_model.model.model.layers.{layer}.{part}.{target}"
      tensors[f"{name}.lora_A.weight"] = rng.normal(0, n_in**-0.5, (rank, n_in)).astype(np.float32)
      tensors[f"{name}.lora_B.weight"] = rng.normal(0, 0.1 * rank**-0.5, (n_out, rank)).astype(
        np.float32
      )
  path.mkdir(parents=True)
  save_file(tensors, str(path / "adapter_model.safetensors"))
  config = {
    "r": rank,
    "lora_alpha": 2 * rank,
    "target_modules": sorted(shapes),
    "peft_type": "LORA",
  }
  (path / "adapter_config.json").write_text(json.dumps(config))


def _engine(**options) -> je.LLM:
  common = dict(max_num_reqs=32, max_model_len=256, kv_cache_memory_bytes=128 * 2**20)
  return je.LLM(**common, enable_prefix_caching=False, **options)


def _run(llm: je.LLM, prompts, params, loras) -> tuple[float, list[list[int]], float]:
  """(seconds, greedy tokens, the first row's first logprob) of one generation."""
  start = time.perf_counter()
  outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
  seconds = time.perf_counter() - start
  first = outs[0].outputs[0]
  logprob = first.logprobs[0][first.token_ids[0]].logprob
  return seconds, [list(o.outputs[0].token_ids) for o in outs], logprob


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
  parser.add_argument("--prompt-len", type=int, default=64)
  parser.add_argument("--max-tokens", type=int, default=32)
  parser.add_argument("--repeats", type=int, default=2)
  args = parser.parse_args()
  base = _engine()
  tokenizer = base.get_tokenizer()
  model = base.llm_engine.runner.model
  shapes = {t: s for t, s in model.lora_target_shapes().items() if t in LORA_TARGETS}
  layers = model.config.num_hidden_layers
  root = Path(tempfile.mkdtemp(prefix="bench_lora_"))
  adapters = {}
  for name, rank, seed in [("r8-0", 8, 0), ("r8-1", 8, 1), ("r8-2", 8, 2), ("r8-3", 8, 3)]:
    write_adapter(root / name, shapes, layers, rank, seed)
    adapters[name] = je.LoRARequest(name, seed + 1, str(root / name))
  write_adapter(root / "r64", shapes, layers, 64, 9)
  adapters["r64"] = je.LoRARequest("r64", 10, str(root / "r64"))
  r8 = _engine(enable_lora=True, max_lora_rank=8)
  r64 = _engine(enable_lora=True, max_lora_rank=64)
  mixed = _engine(enable_lora=True, max_loras=4, max_lora_rank=8)
  four = [adapters[f"r8-{i}"] for i in range(4)]
  columns = {
    "base": (base, lambda b: None),
    "lora on, base reqs": (r8, lambda b: None),
    "r8": (r8, lambda b: adapters["r8-0"]),
    "r64": (r64, lambda b: adapters["r64"]),
    "4 x r8 mixed": (mixed, lambda b: [four[i % 4] for i in range(b)]),
  }
  params = je.SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=0)
  ids = tokenizer.encode(PROMPT_TEXT)
  print(f"tokens/s; SmolLM2-135M float32, prompts of {args.prompt_len}, {args.max_tokens} new")
  print(f"{'B':>4}" + "".join(f"{name:>20}" for name in columns))
  for batch in args.batch_sizes:
    prompts = [ids[i % 7 : i % 7 + args.prompt_len] for i in range(batch)]
    best = {name: float("inf") for name in columns}
    tokens, logprob = {}, {}
    for name, (llm, lora) in columns.items():  # warm-up: every shape compiled
      _, tokens[name], logprob[name] = _run(llm, prompts, params, lora(batch))
    for _ in range(args.repeats):
      for name, (llm, lora) in columns.items():
        seconds, got, _ = _run(llm, prompts, params, lora(batch))
        assert got == tokens[name], f"{name}: a rerun changed the greedy tokens"
        best[name] = min(best[name], seconds)
    assert tokens["lora on, base reqs"] == tokens["base"], "base requests differ with enable_lora"
    assert abs(logprob["r8"] - logprob["base"]) > 1e-3, "the rank-8 adapter changed nothing"
    rate = {name: batch * args.max_tokens / best[name] for name in columns}
    print(f"{batch:>4}" + "".join(f"{rate[name]:>20.1f}" for name in columns))


if __name__ == "__main__":
  main()
