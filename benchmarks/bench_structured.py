"""Structured outputs: what the grammar bitmask costs per decode step.

Host: the time llguidance takes to fill the packed `[R, ceil(V / 32)] int32` bitmask of 8 and 64
rows with a JSON-schema grammar (SmolLM2's vocabulary, V = 49152), as `StructuredOutputs.bitmask`
does before each step, advanced a few tokens into the document so the masks are not trivial.

Device: one jitted `sample_step` over `[64, 49152]` logits, greedy rows, against the same step
with every row holding a grammar (the bitmask unpacked and applied in the processing pass), and
the bitmask's host-to-device copy. Warm-up first; the median of `--repeats` runs counts.

Built-in stages against the same stage as a `LogitsProcessor` (issue 12: should the built-in
stages go through the plug-in interface?): one jitted `sample` step over `[64, 49152]` random
(seeded, temperature 1) rows, every row using min_p 0.1 (argmax invariant) or a logit bias on one
token (not invariant), built in versus a processor doing the same, timed interleaved.

Usage:
  python benchmarks/bench_structured.py [--repeats 20]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from timing import median_ms

import jaxengine as je
from jaxengine.engine.structured import StructuredOutputs
from jaxengine.sample import sample
from jaxengine.tokenizer import Tokenizer

SCHEMA = {
  "type": "object",
  "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
  "required": ["name", "age"],
}
R, V = 64, 49152


def host_fill(repeats: int) -> dict[int, float]:
  tokenizer = Tokenizer.from_gguf()
  so = StructuredOutputs(tokenizer, V, tokenizer.eos_token_id, R)
  grammar = so.compile(je.StructuredOutputsParams(json=SCHEMA))
  prefix = tokenizer.encode('{"name":"Al', add_special_tokens=False)
  letter = tokenizer.encode("ab", add_special_tokens=False)[0]  # stays inside the string
  results = {}
  for rows in (8, 64):
    ids = [f"r{i}" for i in range(rows)]
    for rid in ids:
      so.add(rid, grammar)
      for token in prefix:
        so.advance(rid, token)
    times = []
    for _ in range(repeats + 1):  # each fill after a new token: llguidance caches a mask per state
      for rid in ids:
        so.advance(rid, letter)
      start = time.perf_counter()
      mask = so.bitmask(ids)
      times.append(time.perf_counter() - start)
      assert mask is not None and np.unpackbits(mask[0].view(np.uint8)).sum() > 1000
    results[rows] = 1000 * statistics.median(times[1:])
    for rid in ids:
      so.remove(rid)
  return results


def device_cost(repeats: int) -> tuple[float, float, float]:
  logits = jax.device_put(np.random.default_rng(0).normal(size=(R, V)).astype(np.float32))
  bitmask = np.random.default_rng(1).integers(-(2**31), 2**31, (R, V // 32), dtype=np.int64)
  bitmask = bitmask.astype(np.int32)

  def step_ms(structured: bool, penalty: float = 0.0) -> float:
    batch = je.InputBatch(R, repeats + 8, V)
    so = je.StructuredOutputsParams(regex="x") if structured else None
    params = je.SamplingParams(temperature=0, structured_outputs=so, presence_penalty=penalty)
    for i in range(R):
      batch.add_request(f"r{i}", [1, 2], params)
    if structured:
      batch.set_grammar_bitmask(bitmask)

    return median_ms(lambda: batch.run(_step, logits), repeats)  # to_host waits for the step

  plain, masked = step_ms(False), step_ms(True)
  penalized, both = step_ms(False, 0.5), step_ms(True, 0.5)
  copy = median_ms(lambda: jax.device_put(bitmask).block_until_ready(), repeats)
  return plain, masked, penalized, both, copy


class MinP(je.LogitsProcessor):
  """min_p as a plug-in: keeps `y >= max(y) + log(min_p)` on temperature-scaled logits."""

  argmax_invariant = True

  def init_state(self, max_num_reqs, vocab_size):
    return {"min_p": np.zeros((max_num_reqs,), np.float32)}

  def row_state(self, params, prompt_token_ids):
    value = (params.extra_args or {}).get("min_p")
    return None if value is None else {"min_p": np.float32(value)}

  def apply(self, state, active, logits):
    cut = logits.max(-1) + jnp.log(jnp.maximum(state["min_p"], 1e-30))
    return jnp.where(active[:, None] & (logits < cut[:, None]), -jnp.inf, logits)


class OneBias(je.LogitsProcessor):
  """A logit bias on one token as a plug-in (not argmax invariant)."""

  def init_state(self, max_num_reqs, vocab_size):
    return {
      "id": np.zeros((max_num_reqs,), np.int32),
      "bias": np.zeros((max_num_reqs,), np.float32),
    }

  def row_state(self, params, prompt_token_ids):
    bias = (params.extra_args or {}).get("bias")
    return None if bias is None else {"id": np.int32(bias[0]), "bias": np.float32(bias[1])}

  def apply(self, state, active, logits):
    rows = jnp.arange(logits.shape[0])
    return logits.at[rows, state["id"]].add(jnp.where(active, state["bias"], 0.0))


def builtin_vs_processor(repeats: int) -> dict[str, tuple[float, float]]:
  """`{stage: (built-in ms, processor ms)}`, each pair timed interleaved."""
  logits = jax.device_put(np.random.default_rng(0).normal(size=(R, V)).astype(np.float32))
  variants = {
    "min_p 0.1": (dict(min_p=0.1), MinP, {"min_p": 0.1}),
    "logit_bias": (dict(logit_bias={7: 2.0}), OneBias, {"bias": (7, 2.0)}),
  }
  results = {}
  for name, (builtin, processor, extra) in variants.items():
    batches = []
    for kwargs, processors in ((builtin, ()), ({"extra_args": extra}, (processor,))):
      batch = je.InputBatch(R, 2 * repeats + 8, V, logits_processors=processors)
      for i in range(R):
        batch.add_request(f"r{i}", [1, 2], je.SamplingParams(seed=i, **kwargs))
      batches.append(batch)
    times: list[list[float]] = [[], []]
    for round_ in range(repeats + 1):
      for index, batch in enumerate(batches):
        start = time.perf_counter()
        batch.run(_step, logits)
        if round_:
          times[index].append(1000 * (time.perf_counter() - start))
    results[name] = (statistics.median(times[0]), statistics.median(times[1]))
  return results


@functools.partial(jax.jit, donate_argnames=("state",))
def _step(state, metadata, logits):
  return *sample(state, metadata, logits), None


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=20)
  args = parser.parse_args()
  print(f"backend: {jax.default_backend()}")
  for rows, ms in host_fill(args.repeats).items():
    print(f"host: fill the bitmask of {rows} JSON-schema rows: {ms:.3f} ms")
  plain, masked, penalized, both, copy = device_cost(args.repeats)
  print(f"device: sample step [{R}, {V}] greedy: plain {plain:.3f} ms, masked {masked:.3f} ms")
  print(f"device: with a presence penalty: plain {penalized:.3f} ms, masked {both:.3f} ms")
  print(f"device: bitmask host->device copy {copy:.3f} ms")
  for name, (builtin, plugin) in builtin_vs_processor(args.repeats).items():
    print(
      f"device: {name}: built in {builtin:.2f} ms, as a LogitsProcessor {plugin:.2f} ms "
      f"({plugin / builtin:.2f}x)"
    )


if __name__ == "__main__":
  main()
