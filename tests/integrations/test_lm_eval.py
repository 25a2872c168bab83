"""jaxengine as an lm-evaluation-harness model (`jaxengine.integrations.lm_eval`).

A tiny random Llama checkpoint with its own small BPE tokenizer (BOS added, as Llama's) runs three
local-file tasks (tests/fixtures/lm_eval: multiple choice with one- and multi-token answers,
greedy generation with stop strings, rolling perplexity over documents longer than a window)
through lm-eval's `simple_evaluate`, once on jaxengine and once on an independent reference: an
lm-eval model scoring with the float64 NumPy forward of tests/helpers/hf_checkpoints.py through
transformers' tokenizer, following the conventions of lm-eval's ``hf`` model (the sequence cut
from the left to ``max_length + 1`` tokens, greedy = per-token argmax, rolling windows from the
prefix token). Where torch is importable, lm-eval's own ``hf`` model on the same checkpoint is a
second reference. Per request, loglikelihoods agree to 1e-4 and is-greedy flags, generated texts
and task metrics are identical.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import lm_eval
import numpy as np
import pytest
import tokenizers
import transformers
from hf_checkpoints import (
  config_dict,
  hf_config,
  random_tensors,
  reference_logits,
  write_checkpoint,
)
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import get_model
from lm_eval.tasks import TaskManager
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from subprocess_utils import run_python

import jaxengine.cli.main as cli
import jaxengine.integrations.lm_eval as lm_eval_module
from jaxengine.integrations.lm_eval import JaxEngineLM

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "lm_eval"
TASKS = ["jaxengine_tiny_mc", "jaxengine_tiny_gen", "jaxengine_tiny_text"]
MAX_MODEL_LEN = 32  # windows of 32 tokens: the text task's documents need several
BOS, EOS = "<s>", "</s>"


def write_tokenizer(directory: Path) -> transformers.PreTrainedTokenizerFast:
  """A byte-level BPE trained on the fixture texts (320 ids), adding BOS like Llama's."""
  corpus = [line for f in sorted(FIXTURES.glob("*.jsonl")) for line in f.read_text().splitlines()]
  corpus += [f"Answer: {letter}" for letter in "ABCD"] * 10  # one-token letter answers
  backend = tokenizers.Tokenizer(tokenizers.models.BPE())
  backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  backend.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
    vocab_size=320,
    special_tokens=[BOS, EOS],
    initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  backend.train_from_iterator(corpus, trainer)
  backend.post_processor = tokenizers.processors.TemplateProcessing(
    single=f"{BOS} $A", special_tokens=[(BOS, backend.token_to_id(BOS))]
  )
  tokenizer = transformers.PreTrainedTokenizerFast(
    tokenizer_object=backend, bos_token=BOS, eos_token=EOS
  )
  tokenizer.save_pretrained(directory)
  return tokenizer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  """(directory, config dict, float32 tensors) of the tiny checkpoint and its tokenizer."""
  directory = tmp_path_factory.mktemp("tiny_lm_eval")
  tokenizer = write_tokenizer(directory)
  config = hf_config(
    "LlamaForCausalLM",
    vocab_size=len(tokenizer),
    bos_token_id=tokenizer.bos_token_id,
    eos_token_id=tokenizer.eos_token_id,
    tie_word_embeddings=False,
  )
  c = config_dict(config)
  tensors = random_tensors(c, seed=3)
  write_checkpoint(directory, config, tensors)
  return directory, c, tensors


@pytest.fixture(scope="module")
def jax_lm(checkpoint):
  return JaxEngineLM(pretrained=str(checkpoint[0]), max_model_len=MAX_MODEL_LEN, max_num_reqs=4)


class ReferenceLM(TemplateLM):
  """lm-eval's ``hf`` conventions over the float64 NumPy forward (see the module docstring)."""

  def __init__(self, directory: Path, c: dict, tensors: dict, max_length: int):
    super().__init__()
    self.tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    self.c, self.tensors, self.max_length = c, tensors, max_length

  @property
  def eot_token_id(self) -> int:
    return self.tokenizer.eos_token_id

  @property
  def prefix_token_id(self) -> int:
    return self.tokenizer.bos_token_id

  def tok_encode(self, string, add_special_tokens=None, left_truncate_len=None, **kwargs):
    if add_special_tokens is None:
      add_special_tokens = not string.startswith(BOS)
    ids = self.tokenizer.encode(string, add_special_tokens=add_special_tokens)
    return ids[-left_truncate_len:] if left_truncate_len else ids

  def _log_probs(self, ids) -> np.ndarray:
    logits = reference_logits(self.c, self.tensors, ids)
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))

  def _loglikelihood_tokens(self, requests, disable_tqdm=False, **kwargs):
    results = []
    for _, context, continuation in requests:
      sequence = (context + continuation)[-(self.max_length + 1) :]
      rows = self._log_probs(sequence[:-1])[-len(continuation) :]
      picked = rows[np.arange(len(continuation)), continuation]
      results.append((float(picked.sum()), bool((rows.argmax(-1) == continuation).all())))
    return results

  def loglikelihood_rolling(self, requests, disable_tqdm=False):
    totals = []
    for (string,) in (r.args for r in requests):
      windows = get_rolling_token_windows(
        self.tok_encode(string), self.prefix_token_id, self.max_length, 1
      )
      pairs = [(None, *make_disjoint_window(w)) for w in windows]
      totals.append(sum(ll for ll, _ in self._loglikelihood_tokens(pairs)))
    return totals

  def generate_until(self, requests, disable_tqdm=False):
    texts = []
    for context, kwargs in (r.args for r in requests):
      ids = self.tok_encode(context, left_truncate_len=self.max_length - kwargs["max_gen_toks"])
      generated = []
      for _ in range(kwargs["max_gen_toks"]):
        generated.append(int(self._log_probs(ids + generated)[-1].argmax()))
        if generated[-1] == self.eot_token_id:
          break
      text = self.tokenizer.decode(generated, skip_special_tokens=True)
      for stop in kwargs["until"]:
        text = text.split(stop)[0]
      texts.append(text)
    return texts


def evaluate(model, model_args=None, tasks=TASKS, monkeypatch=None) -> dict:
  """lm-eval's `simple_evaluate` on the fixture tasks, from the repository root (their data
  paths are relative to it)."""
  with pytest.MonkeyPatch.context() as patch:
    patch.chdir(REPO)
    return lm_eval.simple_evaluate(
      model=model,
      model_args=model_args,
      tasks=tasks,
      task_manager=TaskManager(include_path=str(FIXTURES), include_defaults=False),
      log_samples=True,
      num_fewshot=0,
      random_seed=0,
      bootstrap_iters=0,
    )


def assert_same_results(got: dict, want: dict, label: str) -> None:
  """Per request: loglikelihoods within 1e-4, is-greedy flags and texts equal; metrics equal."""
  for task in TASKS:
    samples_got = sorted(got["samples"][task], key=lambda s: s["doc_id"])
    samples_want = sorted(want["samples"][task], key=lambda s: s["doc_id"])
    assert len(samples_got) == len(samples_want) > 0
    for s_got, s_want in zip(samples_got, samples_want):
      assert s_got["arguments"] == s_want["arguments"]
      for r_got, r_want in zip(s_got["resps"], s_want["resps"], strict=True):
        (value_got,), (value_want,) = r_got, r_want
        where = f"{label}: {task} doc {s_got['doc_id']}"
        if isinstance(value_want, str):
          assert value_got == value_want, where
        elif isinstance(value_want, (tuple, list)):  # (loglikelihood, is_greedy)
          assert value_got[0] == pytest.approx(value_want[0], abs=1e-4), where
          assert bool(value_got[1]) == bool(value_want[1]), where
        else:  # a rolling loglikelihood
          assert value_got == pytest.approx(value_want, abs=1e-4), where
    metrics_got = {k: v for k, v in got["results"][task].items() if k.endswith(",none")}
    metrics_want = {k: v for k, v in want["results"][task].items() if k.endswith(",none")}
    assert metrics_got.keys() == metrics_want.keys() and metrics_got
    for name, value in metrics_want.items():  # stderrs are "N/A" without bootstrap
      want_value = value if isinstance(value, str) else pytest.approx(value, rel=1e-6, abs=1e-9)
      assert metrics_got[name] == want_value, f"{label}: {name}"


def test_tasks_match_the_references(checkpoint, jax_lm):
  directory, c, tensors = checkpoint
  ours = evaluate(jax_lm)
  # One-token answers ask for no prompt logprobs: their questions come from the prefix cache.
  assert jax_lm.llm.llm_engine.kv_cache_stats.prefix_cache_hits > 0
  # The fixtures exercise what they claim: one- and multi-token answers, several windows.
  mc = [s["arguments"] for s in ours["samples"]["jaxengine_tiny_mc"]]
  lengths = {len(jax_lm.tok_encode(a[1], add_special_tokens=False)) for doc in mc for a in doc}
  assert 1 in lengths and max(lengths) > 1
  text = [d["text"] for d in map(json.loads, (FIXTURES / "text.jsonl").read_text().splitlines())]
  assert max(len(jax_lm.tok_encode(t)) for t in text) > 2 * MAX_MODEL_LEN
  references = {"numpy": ReferenceLM(directory, c, tensors, max_length=MAX_MODEL_LEN - 1)}
  if importlib.util.find_spec("torch") is not None:  # lm-eval's own hf model, when installed
    references["hf"] = (
      f"pretrained={directory},dtype=float32,max_length={MAX_MODEL_LEN - 1},batch_size=4,device=cpu"
    )
  for label, reference in references.items():
    if isinstance(reference, str):
      assert_same_results(ours, evaluate("hf", reference), label)
    else:
      assert_same_results(ours, evaluate(reference), label)
  # A run where the metrics could differ from the references' (not all answers agree).
  assert 0 < ours["results"]["jaxengine_tiny_mc"]["acc,none"] < 1 or any(
    s["resps"][0][0][1] for s in ours["samples"]["jaxengine_tiny_mc"]
  )


def test_registered_next_to_lm_evals_own_models():
  keys = run_python(
    "import jaxengine.integrations.lm_eval\n"
    "from lm_eval.api.registry import get_model, model_registry\n"
    "assert get_model('jaxengine').__name__ == 'JaxEngineLM'\n"
    "print(' '.join(sorted(model_registry.keys())))"
  ).split()
  assert {"jaxengine", "hf", "vllm", "dummy"} <= set(keys)
  assert get_model("jaxengine") is JaxEngineLM


def test_model_args_string_and_bad_values(checkpoint, jax_lm):
  lm = JaxEngineLM.create_from_arg_string(
    f"pretrained={checkpoint[0]},max_model_len=24,max_num_reqs=2",
    {"batch_size": 1, "max_batch_size": None, "device": "cpu"},  # what lm-eval's command passes
  )
  assert lm.max_length == 23 and lm.llm.config.max_num_reqs == 2
  with pytest.raises(TypeError, match="max_model_lenn"):
    JaxEngineLM(pretrained=str(checkpoint[0]), max_model_lenn=24)
  with pytest.raises(ValueError, match="logprobs_mode"):
    JaxEngineLM(pretrained=str(checkpoint[0]), logprobs_mode="processed_logprobs")
  with pytest.raises(ValueError, match="'num_beams'"):
    jax_lm.sampling_params({"until": ["\n"], "num_beams": 4})
  sampled = jax_lm.sampling_params(
    {"until": "\n\n", "max_new_tokens": 5, "temperature": 0.7, "top_p": 0.9, "seed": 1}
  )
  assert (sampled.stop, sampled.max_tokens, sampled.temperature, sampled.top_p, sampled.seed) == (
    ("\n\n",),
    5,
    0.7,
    0.9,
    1,
  )
  greedy = jax_lm.sampling_params({"until": [], "do_sample": False, "temperature": 0.7})
  assert greedy.temperature == 0 and greedy.stop is None and greedy.max_tokens == 256


def test_eval_command_forwards_to_lm_eval(checkpoint, jax_lm, tmp_path, monkeypatch, capsys):
  # The command builds the model from --model_args; hand it the fixture's engine (already
  # compiled) and check what it was asked for.
  built = []

  def build_llm(pretrained, **options):
    built.append((pretrained, options))
    return jax_lm.llm

  monkeypatch.setattr(lm_eval_module, "LLM", build_llm)
  # lm-eval's command indexes its thousands of built-in task files first (half a minute here);
  # the fixture tasks need none of them.
  index_tasks = TaskManager.__init__
  monkeypatch.setattr(
    TaskManager,
    "__init__",
    lambda self, *args, **kwargs: index_tasks(self, *args, **{**kwargs, "include_defaults": False}),
  )
  monkeypatch.chdir(REPO)
  output = tmp_path / "out"
  status = cli.main(
    [
      "eval",
      "--model_args",
      f"pretrained={checkpoint[0]},max_model_len={MAX_MODEL_LEN},dtype=float32",
      "--tasks",
      "jaxengine_tiny_mc",
      "--include_path",
      str(FIXTURES),
      "--limit",
      "2",
      "--output_path",
      str(output),
    ]
  )
  assert status == 0
  options = {"max_model_len": MAX_MODEL_LEN, "dtype": "float32", "reuse_compiled_shapes": True}
  assert built == [(str(checkpoint[0]), options)]
  assert "jaxengine_tiny_mc" in capsys.readouterr().out
  (result_file,) = output.rglob("results_*.json")
  results = json.loads(result_file.read_text())
  assert results["config"]["model"] == "jaxengine"
  assert results["n-samples"]["jaxengine_tiny_mc"]["effective"] == 2


def test_eval_help_is_lm_evals(capsys):
  with pytest.raises(SystemExit) as exit_info:
    cli.main(["eval", "--help"])
  assert exit_info.value.code == 0
  assert "lm-eval run --model hf" in capsys.readouterr().out  # lm-eval's own quick start
  with pytest.raises(SystemExit):
    cli.main(["--help"])
  assert "eval" in capsys.readouterr().out
