"""The `jaxengine` command on the real default model."""

from __future__ import annotations

import subprocess
import sys

from jaxengine import cli


def test_generate_streams_a_continuation_naming_paris(capsys):
  assert (
    cli.main(
      [
        "generate",
        "The capital of France is",
        "--max-tokens",
        "8",
        "--max-model-len",
        "64",
        "--max-num-reqs",
        "2",
      ]
    )
    == 0
  )
  out = capsys.readouterr().out
  assert out.startswith("The capital of France is Paris")


def test_generate_several_prompts_with_logprobs(capsys):
  assert (
    cli.main(
      [
        "generate",
        "The capital of France is",
        "Water boils at",
        "--max-tokens",
        "4",
        "--temperature",
        "0.7",
        "--top-p",
        "0.9",
        "--seed",
        "1",
        "--logprobs",
        "2",
        "--max-model-len",
        "64",
        "--max-num-reqs",
        "2",
      ]
    )
    == 0
  )
  out = capsys.readouterr().out
  assert out.count("--- [") == 2 and out.count("logprobs of [") == 2


def test_refused_request_and_bad_flag_exit_with_status_2(capsys):
  assert cli.main(["generate", "word " * 100, "--max-model-len", "32", "--max-num-reqs", "1"]) == 2
  assert "max_model_len" in capsys.readouterr().err
  assert cli.main(["generate", "hi", "--top-p", "1.5"]) == 2
  assert "top_p" in capsys.readouterr().err


def test_python_dash_m_help_is_fast_and_lists_sampling_flags():
  result = subprocess.run(
    [sys.executable, "-m", "jaxengine", "generate", "--help"],
    capture_output=True,
    text=True,
    check=True,
    timeout=60,
  )
  for flag in (
    "--temperature",
    "--top-p",
    "--top-k",
    "--min-p",
    "--max-tokens",
    "--seed",
    "--logprobs",
    "--n",
  ):
    assert flag in result.stdout
