"""A short lm-eval job from a cold interpreter: where a user waits, jaxengine against lm-eval's `hf`.

The job a new user runs to try the integration: 20 multiple-choice questions (4 choices each),
10 greedy generations (stop at a newline, up to 16 tokens) and 4 documents scored by rolling
loglikelihood, written as local lm-eval tasks into a temporary directory, on SmolLM2-135M
(float32) from a Hugging Face directory (`--model DIR`, written by benchmarks/export_hf.py when
missing). Each system runs in its own fresh interpreter, one after the other, so imports,
checkpoint loading and compiles all count, as they do for the user:

- jaxengine: `lm_eval.simple_evaluate(model="jaxengine", ...)` with `max_model_len=512`;
  reports the wall time of each phase (building the `LLM`; lm-eval's loglikelihood, rolling and
  generation calls) and the XLA compiles in each (`jaxengine.testing.count_compiles`), with the
  persistent compilation cache off (`--cache off`, a first run on a machine) or in a fresh
  directory filled by one untimed run first (`--cache warm`, every later run);
- `hf`: lm-eval's own transformers model (torch, float32, batch size 8; needs `accelerate`).

Usage:
  python benchmarks/bench_lm_eval.py                      # both systems, cache off and warm
  python benchmarks/bench_lm_eval.py --systems jaxengine --cache off
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TASKS = ("bench_mc", "bench_gen", "bench_text")
SENTENCE = (
  "the river runs past an old mill where children play in summer and farmers bring grain "
  "to be ground into flour before the long winter comes over the hills and the valley"
)


def write_tasks(directory: Path) -> None:
  """Writes the three tasks' data and YAML files (named as `TASKS`)."""
  countries = [f"Country{i}" for i in range(20)]
  mc = [
    {
      "question": f"What is the capital of {c}?",
      "choices": [f"City{i}{j}" for j in "ABCD"],
      "answer": i % 4,
    }
    for i, c in enumerate(countries)
  ]
  gen = [{"country": c} for c in countries[:10]]
  words = SENTENCE.split()
  text = [
    {"text": " ".join(words[(i * 7 + j) % len(words)] for j in range(120 + 60 * i))}
    for i in range(4)
  ]
  for name, rows in (("mc", mc), ("gen", gen), ("text", text)):
    (directory / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  common = "dataset_path: json\ntest_split: test\n"
  data = lambda name: f"dataset_kwargs:\n  data_files:\n    test: {directory / name}.jsonl\n"
  (directory / "bench_mc.yaml").write_text(
    f"task: bench_mc\n{common}{data('mc')}output_type: multiple_choice\n"
    'doc_to_text: "Question: {{question}}\\nAnswer:"\ndoc_to_choice: "{{choices}}"\n'
    'doc_to_target: "{{answer}}"\nmetric_list:\n  - metric: acc\n'
  )
  (directory / "bench_gen.yaml").write_text(
    f"task: bench_gen\n{common}{data('gen')}output_type: generate_until\n"
    'doc_to_text: "Q: What is the capital of {{country}}?\\nA:"\ndoc_to_target: " x"\n'
    'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 16\n  do_sample: false\n'
    "metric_list:\n  - metric: exact_match\n"
  )
  (directory / "bench_text.yaml").write_text(
    f"task: bench_text\n{common}{data('text')}output_type: loglikelihood_rolling\n"
    'doc_to_text: ""\ndoc_to_target: "{{text}}"\nmetric_list:\n  - metric: word_perplexity\n'
  )


def run_job(system: str, model: str, tasks_dir: str) -> dict:
  """Runs the job in this interpreter; returns the phases' seconds (and compiles)."""
  start = time.perf_counter()
  import lm_eval
  from lm_eval.tasks import TaskManager

  phases: dict[str, list[float]] = {}

  def timed(name, fn, counter=None):
    def wrapper(*args, **kwargs):
      before = counter.count if counter is not None else 0
      t0 = time.perf_counter()
      result = fn(*args, **kwargs)
      entry = phases.setdefault(name, [0.0, 0])
      entry[0] += time.perf_counter() - t0
      entry[1] += (counter.count - before) if counter is not None else 0
      return result

    return wrapper

  if system == "jaxengine":
    import jaxengine.integrations.lm_eval as je_lm_eval
    from jaxengine.testing import count_compiles

    counter = count_compiles().start()
    t0 = time.perf_counter()
    lm = je_lm_eval.JaxEngineLM(pretrained=model, max_model_len=512, dtype="float32")
    phases["build"] = [time.perf_counter() - t0, counter.count]
  else:
    from lm_eval.models.huggingface import HFLM

    counter = None
    t0 = time.perf_counter()
    lm = HFLM(pretrained=model, dtype="float32", batch_size=8, device="cpu")
    phases["build"] = [time.perf_counter() - t0, 0]
  for method in ("loglikelihood", "loglikelihood_rolling", "generate_until"):
    setattr(lm, method, timed(method, getattr(lm, method), counter))
  lm_eval.simple_evaluate(
    model=lm,
    tasks=list(TASKS),
    task_manager=TaskManager(include_path=tasks_dir, include_defaults=False),
    num_fewshot=0,
    random_seed=0,
    bootstrap_iters=0,
  )
  total = time.perf_counter() - start
  return {"total": total, "phases": {k: tuple(v) for k, v in phases.items()}}


def run_fresh(system: str, model: str, tasks_dir: str, cache: str | None) -> dict:
  """The job in a fresh interpreter (optionally with a persistent compilation cache dir)."""
  env = dict(os.environ)
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  env["JAXENGINE_COMPILATION_CACHE"] = cache or "off"
  cmd = [sys.executable, __file__, "--worker", system, "--model", model, "--tasks-dir", tasks_dir]
  start = time.perf_counter()
  out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
  result = json.loads(out.strip().splitlines()[-1])
  result["wall"] = time.perf_counter() - start
  return result


def report(label: str, result: dict) -> None:
  phases = "  ".join(
    f"{name} {seconds:.1f}s ({compiles} compiles)"
    for name, (seconds, compiles) in result["phases"].items()
  )
  print(
    f"{label:<24} wall {result['wall']:6.1f}s  in-process {result['total']:6.1f}s  {phases}",
    flush=True,
  )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="/work/smollm2-hf", help="Hugging Face directory")
  parser.add_argument("--systems", default="jaxengine,hf")
  parser.add_argument("--cache", default="off,warm", help="jaxengine's compilation cache runs")
  parser.add_argument("--worker", help=argparse.SUPPRESS)
  parser.add_argument("--tasks-dir", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.worker:
    print(json.dumps(run_job(args.worker, args.model, args.tasks_dir)))
    return
  if not Path(args.model, "config.json").exists():
    subprocess.run([sys.executable, str(HERE / "export_hf.py"), args.model], check=True)
  with tempfile.TemporaryDirectory() as tmp:
    tasks_dir = Path(tmp, "tasks")
    tasks_dir.mkdir()
    write_tasks(tasks_dir)
    for system in args.systems.split(","):
      if system != "jaxengine":
        report(system, run_fresh(system, args.model, str(tasks_dir), None))
        continue
      for mode in args.cache.split(","):
        cache = None
        if mode == "warm":
          cache = str(Path(tmp, "xla-cache"))
          run_fresh(system, args.model, str(tasks_dir), cache)  # fills the cache, untimed
        report(f"jaxengine (cache {mode})", run_fresh(system, args.model, str(tasks_dir), cache))


if __name__ == "__main__":
  main()
