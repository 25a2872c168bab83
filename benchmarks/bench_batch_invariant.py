"""The cost of ``batch_invariant=True``: tokens/s against the default engine, same run.

For each batch size B, B prompts of `--prompt-len` random tokens generate exactly `--max-tokens`
tokens each (an RL rollout's sampling: temperature 1, a seed per request, the sampled token's
logprob), all submitted at once, on SmolLM2-135M-Instruct (float32, the paged cache,
`max_num_reqs=32`, prefix caching off). Both engines are built and warmed up on the same
workload first (compiles excluded), then timed interleaved, `--repeats` rounds, the best run
counting; tokens/s is generated tokens over wall time including prefill. The last line times
`jaxengine.models.token_logprobs` (the trainer's side) on the batch-8 sequences against a plain
forward pass of the same module (`jaxengine.models.sequence_logits`: the same scratch pool of
pages, the default arithmetic, then a log-softmax), compiled first, best of `--repeats`.

Usage:
  python benchmarks/bench_batch_invariant.py                      # B = 1, 8, 32
  python benchmarks/bench_batch_invariant.py --batch-sizes 8 --max-tokens 32
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxengine as je
from jaxengine.models import load, sequence_logits, token_logprobs


def _workload(batch: int, prompt_len: int, max_tokens: int, vocab: int):
  rng = np.random.default_rng(batch)
  prompts = [
    {"prompt_token_ids": rng.integers(3, vocab, prompt_len).tolist()} for _ in range(batch)
  ]
  params = [
    je.SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, logprobs=0, ignore_eos=True)
    for i in range(batch)
  ]
  return prompts, params


def _tokens_per_second(llm: je.LLM, prompts, params) -> float:
  start = time.perf_counter()
  outputs = llm.generate(prompts, params, use_tqdm=False)
  elapsed = time.perf_counter() - start
  return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def _trainer_times(model, sequences: jax.Array, repeats: int) -> tuple[float, float]:
  """Best seconds of `token_logprobs` and of a plain forward pass plus logits."""

  @nnx.jit
  def plain(module, ids):
    return jax.nn.log_softmax(sequence_logits(module, ids), axis=-1)

  def best(fn) -> float:
    jax.block_until_ready(fn(sequences))  # compile
    times = []
    for _ in range(repeats):
      start = time.perf_counter()
      jax.block_until_ready(fn(sequences))
      times.append(time.perf_counter() - start)
    return min(times)

  return best(lambda s: token_logprobs(model, s)), best(lambda s: plain(model, s))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
  parser.add_argument("--prompt-len", type=int, default=64)
  parser.add_argument("--max-tokens", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=2)
  args = parser.parse_args()
  model = load()
  engines = {
    name: je.LLM(
      model,
      max_num_reqs=32,
      max_model_len=256,
      enable_prefix_caching=False,
      batch_invariant=invariant,
    )
    for name, invariant in (("default", False), ("batch_invariant", True))
  }
  print(f"jax {jax.__version__}, {jax.devices()[0].platform}, SmolLM2-135M float32")
  print(f"{'B':>3} {'default tok/s':>14} {'invariant tok/s':>16} {'cost':>6}")
  for batch in args.batch_sizes:
    prompts, params = _workload(batch, args.prompt_len, args.max_tokens, model.vocab_size)
    for llm in engines.values():
      _tokens_per_second(llm, prompts, params)  # warm-up: compiles this batch's shapes
    best = dict.fromkeys(engines, 0.0)
    for _ in range(args.repeats):
      for name, llm in engines.items():
        best[name] = max(best[name], _tokens_per_second(llm, prompts, params))
    cost = best["default"] / best["batch_invariant"]
    print(f"{batch:>3} {best['default']:>14.1f} {best['batch_invariant']:>16.1f} {cost:>5.2f}x")
  rng = np.random.default_rng(0)
  sequences = jnp.asarray(rng.integers(3, model.vocab_size, (8, 128)), jnp.int32)
  trainer, plain = _trainer_times(model, sequences, args.repeats)
  print(
    f"token_logprobs [8, 128]: {trainer * 1e3:.0f} ms, plain forward + log-softmax "
    f"{plain * 1e3:.0f} ms ({trainer / plain:.2f}x)"
  )


if __name__ == "__main__":
  main()
