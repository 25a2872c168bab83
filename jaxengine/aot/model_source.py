"""Where `compile_for_topology` reads a model's ``config.json``: a model directory, the
``config.json`` file itself, or a Hugging Face hub id (as ``LLM`` takes), of which only
``config.json`` is fetched (no weights, no tokenizer).
"""

from __future__ import annotations

import os

from jaxengine.models.hub import HUB_ID

CONFIG_FILE = "config.json"


def config_directory(model: str | os.PathLike, *, revision: str | None = None) -> str:
  """The local directory holding `model`'s ``config.json``.

  Args:
    model: a directory with ``config.json``, that ``config.json`` file, or a hub id
      ``owner/name`` that is not a local path (its ``config.json`` alone is fetched with
      `huggingface_hub.hf_hub_download`, or read from the local hub cache offline).
    revision: the hub branch, tag or commit of a hub id (default ``main``).

  Returns:
    The directory (the hub cache's snapshot directory for a hub id).

  Raises:
    FileNotFoundError: no such directory or file and not a hub id; a directory without
      ``config.json``; a file that is not named ``config.json``; a hub id whose ``config.json``
      is neither cached nor downloadable (offline, unknown, gated: the message says to pass a
      local directory with ``config.json``).
  """
  path = os.fspath(model)
  if os.path.isdir(path):
    if not os.path.isfile(os.path.join(path, CONFIG_FILE)):
      raise FileNotFoundError(f"the model directory {path!r} has no {CONFIG_FILE}")
    return path
  if os.path.isfile(path):
    if os.path.basename(path) != CONFIG_FILE:
      raise FileNotFoundError(
        f"{path!r} is a file, not a model directory or its {CONFIG_FILE}: pass the directory "
        f"that holds {CONFIG_FILE}"
      )
    return os.path.dirname(os.path.abspath(path))
  if not HUB_ID.fullmatch(path):
    raise FileNotFoundError(f"the model directory {path!r} does not exist")
  from huggingface_hub import hf_hub_download

  try:
    return os.path.dirname(hf_hub_download(path, CONFIG_FILE, revision=revision))
  except Exception as error:  # offline without a cached copy, not found, gated, network down
    raise FileNotFoundError(
      f"{path!r} is not a local directory, and its {CONFIG_FILE} could not be fetched from the "
      f"Hugging Face hub ({type(error).__name__}: {_first_line(error)}); pass a local directory "
      f"that holds the model's {CONFIG_FILE}"
    ) from error


def _first_line(error: BaseException) -> str:
  text = str(error).strip()
  return text.splitlines()[0] if text else ""
