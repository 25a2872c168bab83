"""Asynchronous scheduling and the host cost of a sampler call (issue 26), measured in one run.

Two tables:

- ``sampler``: 8 rows x 256 vocabulary, greedy and chat mixes. The host time of one
  `InputBatch.sample(logits)` call (until it returns; its tokens stay on the device until read)
  against the same jitted sampler called bare (`sample_logits(state, metadata, logits)`, what a
  JAX user's own loop pays), and the round trip (the call, then reading the tokens) against the
  bare call followed by `jax.device_get`; also a trivial jitted call (`argmax` of the logits)
  for scale. Medians of interleaved calls, every call waited for before the next.
- ``engine``: tokens/s of an RL-style rollout, synchronous (``async_scheduling=False``) against
  asynchronous scheduling (the default), on `jaxengine.testing.tiny_llama` (host-bound: its
  model step is tiny) and on SmolLM2-135M-Instruct, at batch 1, 8 and 32: 32-token prompts, 64
  tokens each (ignore_eos), half greedy, half seeded at temperature 1 with the sampled token's
  logprob, all submitted at once. Best of ``--repeats`` interleaved runs after a warm-up run;
  checks that both produce the same tokens. Also the host's share of a step: the step's wall
  time minus the time spent in `jax.device_get` (waiting for and copying the step's output),
  over the wall time.

``--models`` also takes ``qwen2.5-0.5b``: a randomly initialised model of Qwen2.5-0.5B's shape
(24 layers, hidden 896, 14 query heads over 2 key/value heads, MLP 4864, vocabulary 151,936, q/k/v
biases, tied embeddings), no download needed: the accelerator run's engine model
(`benchmarks/accelerator.sh`). ``--dtype bfloat16`` runs the model in bfloat16.

Usage:
  python benchmarks/bench_async.py                          # both tables (~10 min on 2 cores)
  python benchmarks/bench_async.py --tables engine --models tiny --batch-sizes 8
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxengine as je
from jaxengine.batch.logits_input import sample_logits
from jaxengine.engine import LLMEngine
from jaxengine.testing import count_compiles, tiny_llama

PROMPT_LEN = 32
MAX_TOKENS = 64


class _DeviceGetTimer:
  """Wraps `jax.device_get` to add up the seconds spent in it (waiting for the device and
  copying its output): the part of a step that is not host work."""

  def __init__(self) -> None:
    self.seconds = 0.0
    self._original = jax.device_get

  def __enter__(self) -> _DeviceGetTimer:
    def timed(tree):
      start = time.perf_counter()
      try:
        return self._original(tree)
      finally:
        self.seconds += time.perf_counter() - start

    jax.device_get = timed
    return self

  def __exit__(self, *exc) -> None:
    jax.device_get = self._original


# --- the sampler call ------------------------------------------------------------------------


def _mix(name: str, i: int) -> je.SamplingParams:
  if name == "greedy":
    return je.SamplingParams(temperature=0.0)
  return je.SamplingParams(temperature=0.7, top_k=50, top_p=0.9, seed=i)  # chat


def _filled_batch(rows: int, vocab: int, mix: str) -> je.InputBatch:
  batch = je.InputBatch(rows, 1 << 16, vocab)
  rng = np.random.default_rng(0)
  for i in range(rows):
    batch.add_request(str(i), rng.integers(0, vocab, 8).tolist(), _mix(mix, i))
  return batch


def _host_us(fns: dict[str, Callable[[], Any]], repeats: int) -> tuple[dict[str, float], int]:
  """Median microseconds until each call returns, calls interleaved, each waited for after;
  and the compiles during the timed calls (must be 0)."""
  samples: dict[str, list[float]] = {name: [] for name in fns}
  for fn in fns.values():
    for _ in range(20):
      jax.block_until_ready(fn())
  with count_compiles() as compiles:
    for _ in range(repeats):
      for name, fn in fns.items():
        start = time.perf_counter()
        result = fn()
        samples[name].append(time.perf_counter() - start)
        jax.block_until_ready(result)
  medians = {name: statistics.median(values) * 1e6 for name, values in samples.items()}
  return medians, compiles.count


def sampler_table(repeats: int, rows: int = 8, vocab: int = 256) -> None:
  print(
    f"\n## sampler call, {rows} rows x {vocab} vocabulary (median microseconds, host time until "
    "the call returns; round trip: the tokens read)\n\n"
    "| mix | sample | bare jitted sampler | ratio | sample + read | bare + device_get | ratio "
    "| trivial jit |\n|---|---:|---:|---:|---:|---:|---:|---:|"
  )
  for mix in ("greedy", "chat"):
    batch, own = (_filled_batch(rows, vocab, mix) for _ in range(2))
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(rows, vocab)).astype(np.float32))
    metadata = own.sampling_metadata
    state = [own.state]  # the bare loop's own batch state, replaced by each call

    def bare():
      state[0], output, _ = sample_logits(state[0], metadata, logits)
      return output

    argmax = jax.jit(lambda x: jnp.argmax(x, -1))
    times, num_compiles = _host_us(
      {
        "sample": lambda: batch.sample(logits).device,
        "bare": bare,
        "sample_read": lambda: batch.sample(logits).sampled_token_ids,
        "bare_read": lambda: jax.device_get(bare().sampled_token_ids),
        "trivial": lambda: argmax(logits),
      },
      repeats,
    )
    print(
      f"| {mix} | {times['sample']:.1f} | {times['bare']:.1f} | "
      f"{times['sample'] / times['bare']:.2f}x | {times['sample_read']:.1f} | "
      f"{times['bare_read']:.1f} | {times['sample_read'] / times['bare_read']:.2f}x | "
      f"{times['trivial']:.1f} |" + (f" ({num_compiles} compiles)" if num_compiles else ""),
      flush=True,
    )


# --- the engine --------------------------------------------------------------------------------


def _requests(size: int, vocab: int) -> list[tuple[list[int], je.SamplingParams]]:
  rng = np.random.default_rng(size)
  requests = []
  for i in range(size):
    prompt = rng.integers(3, vocab, PROMPT_LEN).tolist()
    if i % 2:
      params = je.SamplingParams(
        temperature=1.0, seed=i, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0
      )
    else:
      params = je.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    requests.append((prompt, params))
  return requests


def _rollout(engine: LLMEngine, requests) -> tuple[float, float, int, list[list[int]]]:
  """Runs every request to the end: (seconds, seconds in device_get, steps, token ids)."""
  for i, (prompt, params) in enumerate(requests):
    engine.add_request(f"r{i}", prompt, params)
  outputs = {}
  steps = 0
  with _DeviceGetTimer() as timer:
    start = time.perf_counter()
    while engine.has_unfinished_requests():
      for output in engine.step():
        outputs[output.request_id] = output
      steps += 1
    seconds = time.perf_counter() - start
  engine.pop_finished()
  tokens = [outputs[f"r{i}"].outputs[0].token_ids for i in range(len(requests))]
  return seconds, timer.seconds, steps, tokens


#: Qwen2.5-0.5B's shape (its config.json), for a random model of the same cost.
QWEN2_5_0_5B = dict(
  vocab_size=151936,
  hidden_size=896,
  intermediate_size=4864,
  num_hidden_layers=24,
  num_attention_heads=14,
  num_key_value_heads=2,
  head_dim=64,
  rope_theta=1000000.0,
  rms_norm_eps=1e-6,
  tie_word_embeddings=True,
  attention_bias=True,
  max_position_embeddings=32768,
  bos_token_id=None,
  eos_token_id=151643,
)


def _model(name: str, dtype):
  """The engine table's model by name: `tiny`, `smollm2` (the default checkpoint) or
  `qwen2.5-0.5b` (random weights, that checkpoint's shape)."""
  if name == "tiny":
    return tiny_llama(max_position_embeddings=256, dtype=dtype)[0]
  if name == "qwen2.5-0.5b":
    return tiny_llama(dtype=dtype, **QWEN2_5_0_5B)[0]
  if name == "smollm2":
    dtype_name = "bfloat16" if dtype == jnp.bfloat16 else "float32"
    return je.LLM(max_num_reqs=1, max_model_len=256, dtype=dtype_name).llm_engine.runner.model
  raise ValueError(f"--models: unknown model {name!r} (tiny, smollm2, qwen2.5-0.5b)")


def engine_table(
  models: list[str], batch_sizes: list[int], repeats: int, dtype=jnp.float32
) -> None:
  print(
    f"\n## engine: {PROMPT_LEN}-token prompts, {MAX_TOKENS} tokens each, half greedy, half "
    "seeded with logprobs (tokens/s; host share: step wall time outside device_get)\n\n"
    "| model | batch | sync tok/s | async tok/s | async / sync | sync host share "
    "| async host share | same tokens |\n|---|---:|---:|---:|---:|---:|---:|---|"
  )
  for name in models:
    model = _model(name, dtype)
    for size in batch_sizes:
      engines = {
        mode: LLMEngine(
          model, None, max_num_reqs=size, max_model_len=256, async_scheduling=mode == "async"
        )
        for mode in ("sync", "async")
      }
      requests = _requests(size, model.vocab_size)
      tokens = {mode: _rollout(engine, requests)[3] for mode, engine in engines.items()}
      best: dict[str, tuple[float, float]] = {}
      for _ in range(repeats):
        for mode, engine in engines.items():
          seconds, waiting, _, _ = _rollout(engine, requests)
          if seconds < best.get(mode, (float("inf"), 0.0))[0]:
            best[mode] = (seconds, waiting)
      rate = {mode: size * MAX_TOKENS / seconds for mode, (seconds, _) in best.items()}
      share = {mode: 1 - waiting / seconds for mode, (seconds, waiting) in best.items()}
      same = tokens["sync"] == tokens["async"]
      print(
        f"| {name} | {size} | {rate['sync']:.1f} | {rate['async']:.1f} | "
        f"{rate['async'] / rate['sync']:.2f}x | {share['sync']:.0%} | {share['async']:.0%} | "
        f"{'yes' if same else 'NO'} |",
        flush=True,
      )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--tables", nargs="+", default=["sampler", "engine"])
  parser.add_argument("--models", nargs="+", default=["tiny", "smollm2"])
  parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--sampler-repeats", type=int, default=2000)
  parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  args = parser.parse_args()
  print(
    f"# {platform.processor() or platform.machine()}, jax {jax.__version__}, "
    f"{jax.default_backend()} ({jax.devices()[0].device_kind}), {time.strftime('%Y-%m-%d %H:%M')}"
  )
  if "sampler" in args.tables:
    sampler_table(args.sampler_repeats)
  if "engine" in args.tables:
    engine_table(args.models, args.batch_sizes, args.repeats, jnp.dtype(args.dtype))


if __name__ == "__main__":
  main()
