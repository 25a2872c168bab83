"""Sampler benchmark: `InputBatch.sample` against a max pass and a log_softmax pass, same run.

For each batch size B, vocabulary size V and parameter mix, prints the median wall time of one
`InputBatch.sample(logits)` call (host round trip included: dispatch, the jitted step, copying the
sampled tokens and logprobs back), its ratio to one jitted max-reduction and to one jitted
`jax.nn.log_softmax` over the same `[B, V]` float32 logits measured in the same run, and the
number of XLA compiles during the timed calls (must be 0; `jaxengine.testing.count_compiles`
counts them). Mixes `top_k_50` and `top_k_1024` compare a shallow and a deep top-k row, and
`everything_deep` is `everything` with each top-k drawn from 20..1024. Then the cost of a composition change
(remove + add + condense + metadata refresh) against a step, and the host overhead of a tiny step
against a bare jitted identity call.

`--against REV` is the regression guard: the sampler of this checkout and of another (a git
revision, or a directory holding a `jaxengine` package) each run in their own interpreter (this
script with `--worker`), driven call by call in alternation from this one, so both see the same
machine at the same moments; it prints each mix's medians, the ratio of this checkout to the other
and each one's ratio to a max pass and to a log_softmax pass (each pooled over both sides' calls),
plus the small call (B=8, V=256, greedy). Run it before a change to the sampler, the batch or the
step lands; `--max-ratio` makes it fail (exit status 1) when a mix is slower than that.

Usage:
  python benchmarks/bench_sampler.py                    # full table (several minutes on 2 cores)
  python benchmarks/bench_sampler.py --quick            # B=256, V=49152 only
  python benchmarks/bench_sampler.py --batch-sizes 8 --vocab-sizes 49152 --mixes chat greedy
  python benchmarks/bench_sampler.py --against main      # this checkout vs main, B=256 x 49152
  python benchmarks/bench_sampler.py --against d495889 --mixes greedy chat --max-ratio 1.2
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from peer import JsonLinePeer, checkout
from timing import interleaved_ms, warm

import jaxengine as je
from jaxengine.testing import CompileCounter, count_compiles


def _deep_top_k(i: int) -> int:
  """Row i's top_k in the deep mixes: drawn from 20..1024, the same for every run."""
  return int(np.random.default_rng(i).integers(20, 1025))


def _mix_params(name: str, i: int, vocab: int) -> je.SamplingParams:
  """Row i's parameters under mix `name`."""
  if name == "greedy":
    return je.SamplingParams(temperature=0.0)
  if name == "temperature":
    return je.SamplingParams(temperature=0.8)
  if name == "chat":
    return je.SamplingParams(temperature=0.7, top_k=50, top_p=0.9)
  if name == "top_p":
    return je.SamplingParams(top_p=0.95)
  if name == "min_p":
    return je.SamplingParams(min_p=0.05)
  if name == "penalties":
    return je.SamplingParams(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1)
  if name == "top_k_50":
    return je.SamplingParams(temperature=0.8, top_k=50)
  if name == "top_k_1024":
    return je.SamplingParams(temperature=0.8, top_k=1024)
  if name in ("everything", "everything_deep"):
    return _everything_params(i, vocab, deep=name == "everything_deep")
  raise ValueError(f"unknown mix {name!r}")


def _everything_params(i: int, vocab: int, deep: bool) -> je.SamplingParams:
  """Every stage in use somewhere; half the rows seeded; 5 logprobs. `deep`: every row that
  takes a top-k draws it from 20..1024, and the top-p and min-p rows take one too."""
  kind = i % 8
  seed = i if i % 2 == 0 else None
  common = dict(seed=seed, logprobs=5)
  top_k = (lambda shallow: _deep_top_k(i)) if deep else (lambda shallow: shallow)
  if kind == 0:
    return je.SamplingParams(temperature=0.0, logprobs=5)
  if kind == 1:
    return je.SamplingParams(temperature=0.7, top_k=top_k(50), top_p=0.9, **common)
  if kind == 2:
    return je.SamplingParams(temperature=1.0, top_p=0.95, top_k=top_k(0), **common)
  if kind == 3:
    return je.SamplingParams(temperature=0.9, min_p=0.05, top_k=top_k(0), **common)
  if kind == 4:
    penalties = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2)
    return je.SamplingParams(temperature=0.8, **penalties, top_k=top_k(0), **common)
  if kind == 5:
    return je.SamplingParams(
      temperature=0.8,
      min_tokens=4,
      stop_token_ids=[7, 8, 9],
      logit_bias={11: 2.0, 12: -3.0},
      top_k=top_k(0),
      **common,
    )
  if kind == 6:
    return je.SamplingParams(temperature=0.8, allowed_token_ids=list(range(0, vocab, 3)), **common)
  return je.SamplingParams(
    temperature=0.8, top_k=top_k(20), bad_words_token_ids=[[5], [6, 7], [8, 9, 10]], **common
  )


MIXES = [
  "greedy",
  "temperature",
  "chat",
  "top_p",
  "min_p",
  "penalties",
  "top_k_50",
  "top_k_1024",
  "everything",
  "everything_deep",
]


def _measure(fns, repeats: int, compiles: CompileCounter) -> tuple[list[float], int]:
  """Warms up (compiles) every function, then returns their interleaved medians in ms and the
  number of compiles seen while timing them."""
  warm(fns, times=2)
  before = compiles.count
  times = interleaved_ms(dict(enumerate(fns)), repeats, warmup=0)
  return list(times.values()), compiles.count - before


def _fill(batch: je.InputBatch, mix: str, rng: np.random.Generator) -> None:
  for i in range(batch.max_num_reqs):
    prompt = rng.integers(0, batch.vocab_size, size=16).tolist()
    outputs = rng.integers(0, batch.vocab_size, size=8).tolist()
    batch.add_request(f"r{i}", prompt, _mix_params(mix, i, batch.vocab_size), outputs)


def bench_table(batch_sizes, vocab_sizes, mixes, repeats, compiles: CompileCounter) -> list[dict]:
  rows = []
  max_pass = jax.jit(lambda x: x.max(-1))
  log_softmax = jax.jit(lambda x: jax.nn.log_softmax(x, axis=-1))
  for vocab in vocab_sizes:
    for size in batch_sizes:
      rng = np.random.default_rng(0)
      logits = jnp.asarray(rng.standard_normal((size, vocab), dtype=np.float32) * 4.0)
      for mix in mixes:
        batch = je.InputBatch(size, 4096, vocab)
        _fill(batch, mix, rng)
        (max_ms, softmax_ms, ms), num_compiles = _measure(
          [
            lambda: max_pass(logits),
            lambda: log_softmax(logits),
            lambda: batch.sample(logits).result(),
          ],
          repeats,
          compiles,
        )
        row = dict(
          B=size,
          V=vocab,
          mix=mix,
          ms=ms,
          x_max=ms / max_ms,
          x_log_softmax=ms / softmax_ms,
          compiles=num_compiles,
          max_ms=max_ms,
          log_softmax_ms=softmax_ms,
        )
        rows.append(row)
        print(
          f"B={size:4d} V={vocab:6d} {mix:15s} {ms:9.2f} ms  {row['x_max']:7.1f}x max "
          f"({max_ms:.2f} ms)  {row['x_log_softmax']:5.2f}x log_softmax ({softmax_ms:.1f} ms)"
          f"  compiles={row['compiles']}",
          flush=True,
        )
  return rows


def _full_batch(size: int, vocab: int, mix: str, seed: int):
  """`(rng, [size, vocab] logits, an InputBatch filled with `mix` requests)`."""
  rng = np.random.default_rng(seed)
  logits = jnp.asarray(rng.standard_normal((size, vocab), dtype=np.float32))
  batch = je.InputBatch(size, 4096, vocab)
  _fill(batch, mix, rng)
  return rng, logits, batch


def bench_composition(repeats: int, compiles: CompileCounter, size=256, vocab=49152) -> dict:
  """A composition change (remove two, condense, add two, metadata refresh) against a step."""
  rng, logits, batch = _full_batch(size, vocab, "chat", seed=1)
  counter = iter(range(10**9))
  params = _mix_params("chat", 0, vocab)

  def change():
    for victim in rng.choice(batch.req_ids, size=2, replace=False):
      batch.remove_request(str(victim))
    batch.condense()
    batch.add_request(f"n{next(counter)}", [1, 2, 3], params)
    batch.add_request(f"n{next(counter)}", [4, 5], params)
    return batch.sampling_metadata

  def step():
    return batch.sample(logits).result()

  (change_ms, step_ms), num_compiles = _measure([change, step], repeats, compiles)
  result = dict(change_ms=change_ms, step_ms=step_ms, compiles=num_compiles)
  print(
    f"composition change (2 removes + condense + 2 adds + refresh) at B={size} V={vocab}: "
    f"{change_ms:.2f} ms vs chat step {step_ms:.2f} ms ({change_ms / step_ms:.2f}x); "
    f"compiles={result['compiles']}",
    flush=True,
  )
  return result


def bench_host_overhead(repeats: int, compiles: CompileCounter, size=8, vocab=256) -> dict:
  """A tiny greedy step against a bare jitted identity call (dispatch + copy back)."""
  _, logits, batch = _full_batch(size, vocab, "greedy", seed=2)
  identity = jax.jit(lambda x: x)
  (bare_ms, step_ms), num_compiles = _measure(
    [lambda: np.asarray(identity(logits)), lambda: batch.sample(logits).result()],
    repeats * 20,
    compiles,
  )
  result = dict(step_ms=step_ms, bare_ms=bare_ms, compiles=num_compiles)
  print(
    f"host overhead B={size} V={vocab}: step {step_ms:.3f} ms vs bare jitted identity "
    f"{bare_ms:.3f} ms ({step_ms / bare_ms:.2f}x); compiles={result['compiles']}",
    flush=True,
  )
  return result


# --- `--against`: two checkouts' samplers in one run ---------------------------------------------

#: The mixes `--against` compares by default, then the small call.
AGAINST_MIXES = ["greedy", "temperature", "chat", "top_p", "everything"]
#: The small call: `(B, V, mix)`, a tiny greedy step where the host's share dominates.
SMALL_CALL = (8, 256, "greedy")


def _call_sample(batch: je.InputBatch, logits) -> object:
  """One `InputBatch.sample` round trip, for checkouts whose `sample` returns the host result and
  for those whose result is read lazily."""
  result = batch.sample(logits)
  return result.result() if hasattr(result, "result") else result


def worker(stdin=sys.stdin) -> None:
  """`--worker`: serves one checkout's sampler, one JSON command a line on stdin, one JSON answer
  a line on the original stdout (stray output of the libraries goes to stderr).

  Commands: `{"op": "setup", "size", "vocab", "mix"}` builds the batch and the logits (the same
  seeds in every checkout) and compiles its calls; `{"op": "time", "fn": "sample" | "max" |
  "log_softmax"}` times
  one call in ms; the answer to every command carries `compiles`, the XLA compiles so far.
  """
  out = os.fdopen(os.dup(1), "w")
  os.dup2(2, 1)
  max_pass = jax.jit(lambda x: x.max(-1))
  log_softmax = jax.jit(lambda x: jax.nn.log_softmax(x, axis=-1))
  cells: dict[str, Callable[[], object]] = {}
  with count_compiles() as compiles:

    def reply(**fields) -> None:
      out.write(json.dumps({**fields, "compiles": compiles.count}) + "\n")
      out.flush()

    reply(jaxengine=os.path.dirname(os.path.abspath(je.__file__)), version=je.__version__)
    for line in stdin:
      command = json.loads(line)
      if command["op"] == "setup":
        size, vocab, mix = command["size"], command["vocab"], command["mix"]
        rng = np.random.default_rng(0)
        logits = jnp.asarray(rng.standard_normal((size, vocab), dtype=np.float32) * 4.0)
        batch = je.InputBatch(size, 4096, vocab)
        _fill(batch, mix, rng)
        cells = {
          "sample": lambda batch=batch, logits=logits: _call_sample(batch, logits),
          "max": lambda logits=logits: max_pass(logits),
          "log_softmax": lambda logits=logits: log_softmax(logits),
        }
        warm(cells.values(), times=2)
        reply()
      else:
        fn = cells[command["fn"]]
        start = time.perf_counter()
        jax.block_until_ready(fn())
        reply(ms=(time.perf_counter() - start) * 1e3)


class SamplerWorker(JsonLinePeer):
  """A `--worker` interpreter importing jaxengine from `root` (a checkout's top directory)."""

  def __init__(self, root: str) -> None:
    env = dict(
      os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    )
    super().__init__([sys.executable, os.path.abspath(__file__), "--worker"], env)
    package = os.path.join(os.path.abspath(root), "jaxengine")
    if os.path.realpath(self.greeting["jaxengine"]) != os.path.realpath(package):
      self.close()
      raise SystemExit(
        f"the worker for {root} imported jaxengine from {self.greeting['jaxengine']}"
      )
    self.version = self.greeting["version"]


def bench_against(args) -> list[dict]:
  """This checkout's sampler against `args.against`'s, call by call in alternation.

  Returns one row a cell: medians in ms of each side's `InputBatch.sample` and of a max pass over
  the same logits (both sides' calls pooled), the ratio of this checkout's sample time to the
  other's, and the compiles each side saw while timed (must be 0).
  """
  here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  scratch = tempfile.mkdtemp(prefix="bench_sampler_")
  workers: dict[str, SamplerWorker] = {}
  try:
    workers["this"] = SamplerWorker(here)
    workers["other"] = SamplerWorker(checkout(args.against, scratch))
    print(
      f"# this checkout ({here}, jaxengine {workers['this'].version}) against {args.against} "
      f"(jaxengine {workers['other'].version}); {args.repeats} alternated calls a cell, medians",
      flush=True,
    )
    cells = [(b, v, m) for v in args.vocab_sizes for b in args.batch_sizes for m in args.mixes]
    cells += [SMALL_CALL] * (SMALL_CALL not in cells)
    print(
      "| B | V | mix | other ms | this ms | this / other | max pass ms | other x max | this x max "
      "| log_softmax ms | other x log_softmax | this x log_softmax | compiles |\n"
      "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
      flush=True,
    )
    return [_against_cell(workers, cell, args.repeats) for cell in cells]
  finally:
    for w in workers.values():
      w.close()
    shutil.rmtree(scratch, ignore_errors=True)


def _against_cell(workers: dict[str, SamplerWorker], cell, repeats: int) -> dict:
  size, vocab, mix = cell
  before = {name: w.ask(op="setup", size=size, vocab=vocab, mix=mix) for name, w in workers.items()}
  samples: dict[tuple[str, str], list[float]] = {
    (n, f): [] for n in workers for f in ("sample", "max", "log_softmax")
  }
  last = {}
  for r in range(repeats):
    order = list(workers) if r % 2 == 0 else list(workers)[::-1]  # neither always goes first
    for fn in ("sample", "max", "log_softmax"):
      for name in order:
        answer = workers[name].ask(op="time", fn=fn)
        samples[name, fn].append(answer["ms"])
        last[name] = answer["compiles"]
  ms = {key: statistics.median(values) for key, values in samples.items()}
  # One max pass for both sides (the same jitted reduction in each): the median of all its calls.
  max_ms = statistics.median(samples["this", "max"] + samples["other", "max"])
  softmax_ms = statistics.median(samples["this", "log_softmax"] + samples["other", "log_softmax"])
  row = dict(
    B=size,
    V=vocab,
    mix="small call" if cell == SMALL_CALL else mix,
    other_ms=ms["other", "sample"],
    this_ms=ms["this", "sample"],
    ratio=ms["this", "sample"] / ms["other", "sample"],
    max_ms=max_ms,
    other_x_max=ms["other", "sample"] / max_ms,
    this_x_max=ms["this", "sample"] / max_ms,
    log_softmax_ms=softmax_ms,
    other_x_log_softmax=ms["other", "sample"] / softmax_ms,
    this_x_log_softmax=ms["this", "sample"] / softmax_ms,
    compiles={name: last[name] - before[name]["compiles"] for name in workers},
  )
  print(
    f"| {size} | {vocab} | {row['mix']} | {row['other_ms']:.2f} | {row['this_ms']:.2f} | "
    f"{row['ratio']:.2f}x | {row['max_ms']:.2f} | {row['other_x_max']:.2f} | "
    f"{row['this_x_max']:.2f} | {softmax_ms:.2f} | {row['other_x_log_softmax']:.2f} | "
    f"{row['this_x_log_softmax']:.2f} | {row['compiles']['other']} / {row['compiles']['this']} |",
    flush=True,
  )
  return row


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument(
    "--batch-sizes", type=int, nargs="+", help="default 8 64 256 (--against: 256)"
  )
  parser.add_argument(
    "--vocab-sizes", type=int, nargs="+", help="default 49152 128256 (--against: 49152)"
  )
  parser.add_argument("--mixes", nargs="+", choices=MIXES, help="default all (--against: a few)")
  parser.add_argument("--repeats", type=int, default=15, help="timed calls per cell (median)")
  parser.add_argument("--quick", action="store_true", help="only B=256, V=49152")
  parser.add_argument(
    "--against",
    metavar="REV",
    help="compare with this git revision or checkout directory (B=256, V=49152 unless given)",
  )
  parser.add_argument(
    "--max-ratio",
    type=float,
    help="with --against: exit with status 1 if a mix takes more than this times the other's",
  )
  parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.worker:
    worker()
    return
  if args.quick:
    args.batch_sizes, args.vocab_sizes = [256], [49152]
  against = args.against is not None
  args.batch_sizes = args.batch_sizes or ([256] if against else [8, 64, 256])
  args.vocab_sizes = args.vocab_sizes or ([49152] if against else [49152, 128256])
  args.mixes = args.mixes or (AGAINST_MIXES if against else MIXES)
  print(
    f"# jax {jax.__version__}, backend {jax.default_backend()} "
    f"({jax.devices()[0].device_kind}), {platform.processor() or platform.machine()}, "
    f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}, {datetime.date.today()}",
    flush=True,
  )
  if against:
    rows = bench_against(args)
    slower = [r for r in rows if args.max_ratio is not None and r["ratio"] > args.max_ratio]
    for r in slower:
      print(f"REGRESSION: {r['mix']} at B={r['B']} V={r['V']} takes {r['ratio']:.2f}x the other's")
    sys.exit(1 if slower else 0)
  print(f"# jaxengine {je.__version__}", flush=True)
  with count_compiles() as compiles:
    bench_table(args.batch_sizes, args.vocab_sizes, args.mixes, args.repeats, compiles)
    bench_composition(args.repeats, compiles)
    bench_host_overhead(args.repeats, compiles)


if __name__ == "__main__":
  main()
