"""Checks of the `jaxengine` command's flags made before the model loads, and its output labels."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def read_json_schema(value: str) -> str:
  """`--json-schema`: the text of the file it names, else the value itself, which must be JSON.

  Raises:
    ValueError: for a value that is neither an existing file nor valid JSON.
  """
  if not value.lstrip().startswith("{") and os.path.isfile(value):
    return Path(value).read_text()
  try:
    json.loads(value)
  except json.JSONDecodeError as error:
    if value.lstrip().startswith("{"):
      raise ValueError(f"--json-schema is not valid JSON: {error}") from None
    raise ValueError(f"--json-schema: no file {value!r}, and not valid JSON: {error}") from None
  return value


#: Flags that only shape random sampling, with their "off" values.
_SAMPLING_ONLY = (("--top-k", "top_k", 0), ("--top-p", "top_p", 1.0), ("--min-p", "min_p", 0.0))


def check_greedy_default(args: argparse.Namespace) -> None:
  """Refuses sampling-only flags when --temperature was not given (the default 0 is greedy;
  `--n` > 1 is already refused by `SamplingParams` for greedy requests)."""
  if args.temperature is not None:
    return
  given = [flag for flag, name, off in _SAMPLING_ONLY if getattr(args, name) != off]
  given += ["--seed"] if args.seed is not None else []
  if given:
    raise ValueError(
      f"{given[0]} has no effect with greedy sampling (--temperature defaults to 0): pass "
      "--temperature"
    )


def completion_header(output, completion, n: int, label_prompts: bool) -> str:
  """The line printed above one of several completions."""
  if not label_prompts:
    return f"--- sample {completion.index + 1} of {n}\n"
  header = output.prompt if output.prompt is not None else output.prompt_token_ids
  header = str(header).replace("\n", " ")
  header = header if len(header) <= 60 else "..." + header[-57:]
  return f"--- [{output.request_id}.{completion.index}] {header}\n"


def token_id_list(text: str) -> list[int]:
  """argparse type of `--stop-token-ids`: comma-separated token ids, e.g. "2" or "2,3"."""
  try:
    ids = [int(part) for part in text.split(",")]
  except ValueError:
    ids = None
  if not ids or any(i < 0 for i in ids):
    raise argparse.ArgumentTypeError(
      f"must be comma-separated non-negative token ids (e.g. 2,3), got {text!r}"
    )
  return ids
