"""`FlexibleArgumentParser`: vLLM's argument parser for scripts that add `EngineArgs`' flags.

vLLM scripts build their command line as ``parser = FlexibleArgumentParser();
EngineArgs.add_cli_args(parser)`` (`jaxengine.engine.arg_utils`), and import the parser from
`vllm.utils` or `vllm.utils.argparse_utils`: both paths exist here too.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any


class FlexibleArgumentParser(argparse.ArgumentParser):
  """An `argparse.ArgumentParser` that, as vLLM's, reads an option spelled with underscores as
  the dashed one (``--max_model_len 64`` is ``--max-model-len 64``, ``--max_num_seqs=4`` too),
  and names what an unrecognized option is not: a script option or an engine argument
  jaxengine has.

  Not supported (vLLM's): ``--config`` YAML files and ``-O`` compilation levels; they are
  unrecognized arguments here.
  """

  def parse_known_args(  # type: ignore[override]
    self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
  ) -> tuple[argparse.Namespace, list[str]]:
    """`argparse.ArgumentParser.parse_known_args` of the arguments with underscores in option
    names turned into dashes (values are left as they are)."""
    args = sys.argv[1:] if args is None else args
    return super().parse_known_args([_dashed(arg) for arg in args], namespace)

  def parse_args(  # type: ignore[override]
    self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
  ) -> argparse.Namespace:
    """Parses the command line; an unrecognized argument is a usage error (exit status 2)
    that says it is neither an option of the script nor an engine argument jaxengine has."""
    parsed, unknown = self.parse_known_args(args, namespace)
    if unknown:
      self.error(
        f"unrecognized arguments: {' '.join(unknown)} (neither an option of this script nor "
        "an engine argument jaxengine has; `EngineArgs.add_cli_args` adds jaxengine's, and "
        "docs/differences_from_vllm.md lists what vLLM has beyond them)"
      )
    return parsed


def _dashed(arg: Any) -> Any:
  """``--max_model_len=64`` -> ``--max-model-len=64``; anything else as it is."""
  if not isinstance(arg, str) or not arg.startswith("--") or arg == "--":
    return arg
  name, sep, value = arg.partition("=")
  return name.replace("_", "-") + sep + value
