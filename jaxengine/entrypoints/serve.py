"""`jaxengine serve [MODEL]`: its flags and its run (the server modules load only when it runs).

vLLM's command shape: `jaxengine serve MODEL --host 127.0.0.1 --port 8000 [--api-key KEY]` plus
the engine flags of `jaxengine generate` (`--max-num-reqs`, `--max-model-len`, ...).

Before it listens the server compiles the step executables the first requests need and, once
it listens, the others on a background thread (`entrypoints/background_compile.py`;
`--no-precompile-in-background`: every one before it listens; `--no-precompile`: none), so no
request waits for a compile the plan holds; JAX's persistent compilation cache (on by default:
`--compilation-cache DIR`, `--compilation-cache off`) makes the next start read them back from
disk instead. On stderr: a line saying what it compiles and where it will listen, a line when
they are done (with everything first: a progress bar over the step shapes before it), one once
it listens, and one when the background is done.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
  import uvicorn

  from jaxengine.entrypoints.async_llm import AsyncLLM
  from jaxengine.entrypoints.background_compile import ServeCompile
  from jaxengine.entrypoints.llm import LLM
  from jaxengine.lora import LoRAModulePath

#: The name `/v1/models` lists for the default model (what `LLM()` loads).
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
  """Adds MODEL (positional, optional; the same as --model) and the server's flags."""
  from jaxengine.entrypoints.reasoning_parsers import REASONING_PARSERS  # plain Python modules
  from jaxengine.entrypoints.tool_parsers import TOOL_PARSERS

  parser.add_argument(
    "model_tag", nargs="?", metavar="MODEL", default=None, help="as --model (vLLM's positional)"
  )
  group = parser.add_argument_group("server")
  group.add_argument("--host", default="127.0.0.1", help="address to listen on")
  group.add_argument("--port", type=int, default=8000, help="port to listen on")
  group.add_argument(
    "--api-key",
    default=None,
    help="require 'Authorization: Bearer KEY' on /v1/* (default: $JAXENGINE_API_KEY, else none)",
  )
  group.add_argument(
    "--served-model-name",
    default=None,
    help="the model name clients send (default: MODEL as given, or SmolLM2-135M-Instruct)",
  )
  group.add_argument(
    "--lora-modules",
    nargs="+",
    metavar="NAME=PATH|JSON",
    type=lora_module,
    default=None,
    help="LoRA adapters (PEFT directories) served as models NAME (needs --enable-lora): "
    'NAME=PATH, or vLLM\'s JSON \'{"name": NAME, "path": PATH, "base_model_name": BASE}\' '
    "(base_model_name optional: the adapter's parent in /v1/models)",
  )
  tools = parser.add_argument_group("tool calling and reasoning (vLLM's flags)")
  tools.add_argument(
    "--enable-auto-tool-choice",
    action="store_true",
    help='allow tool_choice "auto" (the default with tools): the model may call tools, read '
    "from its output by --tool-call-parser",
  )
  tools.add_argument(
    "--tool-call-parser",
    default=None,
    choices=sorted(TOOL_PARSERS),
    help="the format the model writes tool calls in",
  )
  tools.add_argument(
    "--reasoning-parser",
    default=None,
    choices=sorted(REASONING_PARSERS),
    help="the format of the model's reasoning, returned as message.reasoning_content",
  )
  group.add_argument(
    "--precompile-in-background",
    action=argparse.BooleanOptionalAction,
    default=None,
    help="with precompile (the default): listen once the shapes the first requests need are "
    "compiled and compile the others on a background thread while serving (their steps run in "
    "a larger compiled shape meanwhile, and the thread shares the host's cores); "
    "--no-precompile-in-background compiles every shape before listening (default: on)",
  )
  group.add_argument(
    "--uvicorn-log-level",
    default="info",
    choices=["critical", "error", "warning", "info", "debug", "trace"],
    help="uvicorn's log level",
  )


def run_server(args: argparse.Namespace) -> int:
  """Loads the model and compiles its steps (`load_engine`), then serves it until interrupted;
  returns the exit status (1: the model file is missing, 2: bad engine settings, 130: Ctrl-C)."""
  from jaxengine.entrypoints.chat_output import ChatParserOptions
  from jaxengine.entrypoints.openai_server import build_app

  model = args.model_tag or args.model
  parsers = (args.enable_auto_tool_choice, args.tool_call_parser, args.reasoning_parser)
  try:
    ChatParserOptions.from_names(*parsers)  # refused before the model loads
    _check_compile_flags(args)
  except ValueError as error:
    print(f"jaxengine: {error}")
    return 2
  try:
    engine = load_engine(args)
  except KeyboardInterrupt:  # Ctrl-C while loading or compiling: no traceback
    print("jaxengine: interrupted", file=sys.stderr)
    return 130
  except FileNotFoundError as error:
    print(f"jaxengine: {error}")
    return 1
  except ValueError as error:
    print(f"jaxengine: {error}")
    return 2
  name = args.served_model_name or (str(model) if model is not None else DEFAULT_MODEL_NAME)
  api_key = args.api_key or os.environ.get("JAXENGINE_API_KEY") or None
  try:
    try:
      app = build_app(engine, name, api_key, args.lora_modules or (),
                      enable_auto_tool_choice=parsers[0], tool_call_parser=parsers[1],
                      reasoning_parser=parsers[2])  # fmt: skip
    except ValueError as error:
      print(f"jaxengine: --lora-modules: {error}")
      return 2
    serve_app(app, args.host, args.port, args.uvicorn_log_level)
  except KeyboardInterrupt:  # Ctrl-C: uvicorn has closed the server; no traceback
    print("jaxengine: interrupted", file=sys.stderr)
    return 130
  finally:
    engine.shutdown()
  return 0


def lora_module(text: str) -> LoRAModulePath:
  """A ``--lora-modules`` entry as a `LoRAModulePath` (argparse type): ``NAME=PATH`` (split at
  the first ``=``), or vLLM's JSON object ``{"name", "path"[, "base_model_name"]}`` (an entry
  that starts with ``{``).

  Raises:
    argparse.ArgumentTypeError: (argparse reports it and exits with status 2) no ``=`` or an
      empty side; JSON that does not parse (with its column), is not an object, lacks ``name``
      or ``path``, has another field, or a value that is not a string (``base_model_name``:
      a string or null).
  """
  from jaxengine.lora import LoRAModulePath

  if not text.lstrip().startswith("{"):
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
      raise argparse.ArgumentTypeError(f"expected NAME=PATH or a JSON object, got {text!r}")
    return LoRAModulePath(name, path)
  try:
    fields = json.loads(text)
  except json.JSONDecodeError as error:
    raise argparse.ArgumentTypeError(
      f"{text!r} is not valid JSON ({error.msg} at column {error.colno})"
    ) from None
  if not isinstance(fields, dict):
    raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object")
  known = tuple(LoRAModulePath.__annotations__)  # its field names, in order
  for key in fields:
    if key not in known:
      raise argparse.ArgumentTypeError(f"{text!r}: unknown field {key!r} (fields: {known})")
  for key in ("name", "path"):
    if key not in fields:
      raise argparse.ArgumentTypeError(f"{text!r} lacks {key!r}: {known[:2]} are required")
    if not isinstance(fields[key], str) or not fields[key]:
      what = "an empty string" if fields[key] == "" else "not a string"
      raise argparse.ArgumentTypeError(f"{text!r}: {key}={fields[key]!r} is {what}")
  base = fields.get("base_model_name")
  if base is not None and not isinstance(base, str):
    raise argparse.ArgumentTypeError(f"{text!r}: base_model_name must be a string or null")
  return LoRAModulePath(fields["name"], fields["path"], base)


def serve_app(app, host: str, port: int, log_level: str) -> None:
  """Serves `app` with uvicorn until interrupted (`announcing_server`)."""
  import uvicorn

  announcing_server(uvicorn.Config(app, host=host, port=port, log_level=log_level)).run()


def announcing_server(config: uvicorn.Config) -> uvicorn.Server:
  """A uvicorn server that prints ``jaxengine: listening on http://HOST:PORT`` on stderr once
  its socket is bound (whatever uvicorn's own log level), the port it got included."""
  import uvicorn

  class AnnouncingServer(uvicorn.Server):
    async def startup(self, sockets=None) -> None:
      await super().startup(sockets)
      if self.started:
        host, port = self.servers[0].sockets[0].getsockname()[:2]
        print(f"jaxengine: listening on http://{host}:{port}", file=sys.stderr, flush=True)

  return AnnouncingServer(config)


def _check_compile_flags(args: argparse.Namespace) -> None:
  """Refuses `--precompile-in-background` beside `--no-precompile` (a background compile of
  nothing); either flag alone, or neither, is fine.

  Raises:
    ValueError: naming both flags.
  """
  if getattr(args, "precompile_in_background", None) and getattr(args, "precompile", None) is False:
    raise ValueError(
      "--precompile-in-background compiles in the background what --no-precompile skips: "
      "give one of them"
    )


def load_engine(args: argparse.Namespace) -> AsyncLLM:
  """The server's engine: the model loaded with the engine flags, then, unless
  `--no-precompile`, its step executables compiled (read back from the persistent compilation
  cache when an earlier start left them there): with `--precompile-in-background` (the default)
  those the first requests need before it returns and the others on a background thread while
  it serves (`entrypoints/background_compile.py`), else all of them before it returns
  (`LLMEngine.precompile`). Either way no request waits for a compile of a shape the plan
  holds. Logs the compile's progress on stderr.

  Raises:
    FileNotFoundError, ValueError: as `jaxengine.LLM`.
  """
  from jaxengine.engine.engine_flags import engine_flag_options
  from jaxengine.entrypoints.async_llm import AsyncLLM
  from jaxengine.entrypoints.llm import LLM

  options = engine_flag_options(args)
  precompile = options.pop("precompile", True)  # on unless --no-precompile
  llm = LLM(args.model_tag or args.model, **options)
  url = f"http://{args.host}:{args.port}"
  staged = None
  if precompile and getattr(args, "precompile_in_background", None) is not False:
    staged = _compile_first(llm, url)
  elif precompile:
    _precompile(llm, url)
  engine = AsyncLLM(llm)
  if staged is not None:
    engine.background_compile = staged
    staged.start(on_done=_announce_background_done)
  return engine


def _cache_where(llm: LLM) -> str:
  cache = llm.compilation_cache_dir
  return f"persistent cache {os.fspath(cache)}" if cache is not None else "no persistent cache"


def _compile_first(llm: LLM, url: str) -> ServeCompile:
  """Plans `llm`'s staged compile and compiles what the first requests need, with a line on
  stderr before and one after."""
  from jaxengine.entrypoints.background_compile import ServeCompile

  staged = ServeCompile(llm.llm_engine)
  print(
    f"jaxengine: compiling the {staged.num_first} executables the first requests need "
    f"({_cache_where(llm)}); the server listens on {url} once they are done and compiles the "
    f"other {staged.num_rest} in the background",
    file=sys.stderr,
    flush=True,
  )
  start = time.perf_counter()
  staged.compile_first()
  print(
    f"jaxengine: compiled {staged.num_first} executables in {time.perf_counter() - start:.1f} s",
    file=sys.stderr,
    flush=True,
  )
  return staged


def _announce_background_done(staged: ServeCompile, seconds: float) -> None:
  print(
    f"jaxengine: compiled the other {staged.num_done} executables in the background in "
    f"{seconds:.1f} s: serving compiles nothing more",
    file=sys.stderr,
    flush=True,
  )


def _precompile(llm: LLM, url: str) -> None:
  """`llm`'s `LLMEngine.precompile` (its progress bar counts the step shapes), with a line on
  stderr before, saying that the server listens at `url` once it is done, and one after."""
  from jaxengine.testing import count_compiles

  print(
    f"jaxengine: precompiling the step executables of every bucket ({_cache_where(llm)}); the "
    f"server listens on {url} once they are done (minutes the first time; --no-precompile "
    "skips it)",
    file=sys.stderr,
    flush=True,
  )
  start = time.perf_counter()
  with count_compiles() as compiles:
    shapes = llm.llm_engine.precompile()
  print(
    f"jaxengine: precompiled {shapes} step shapes ({compiles.count} executables compiled or "
    f"read from the cache) in {time.perf_counter() - start:.1f} s",
    file=sys.stderr,
    flush=True,
  )
