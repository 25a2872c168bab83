"""`jaxengine serve [MODEL]`: its flags and its run (the server modules load only when it runs).

vLLM's command shape: `jaxengine serve MODEL --host 127.0.0.1 --port 8000 [--api-key KEY]` plus
the engine flags of `jaxengine generate` (`--max-num-reqs`, `--max-model-len`, ...).
"""

from __future__ import annotations

import argparse
import os

#: The name `/v1/models` lists for the default model (what `LLM()` loads).
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
  """Adds MODEL (positional, optional; the same as --model) and the server's flags."""
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
    "--uvicorn-log-level",
    default="info",
    choices=["critical", "error", "warning", "info", "debug", "trace"],
    help="uvicorn's log level",
  )


def run_server(args: argparse.Namespace) -> int:
  """Loads the model, then serves it until interrupted; returns the exit status (1: the model
  file is missing, 2: bad engine settings)."""
  import uvicorn

  from jaxengine.cli_engine_flags import engine_flag_options
  from jaxengine.entrypoints.async_llm import AsyncLLM
  from jaxengine.entrypoints.openai_server import build_app

  model = args.model_tag or args.model
  try:
    engine = AsyncLLM(model, **engine_flag_options(args))
  except FileNotFoundError as error:
    print(f"jaxengine: {error}")
    return 1
  except ValueError as error:
    print(f"jaxengine: {error}")
    return 2
  name = args.served_model_name or (str(model) if model is not None else DEFAULT_MODEL_NAME)
  api_key = args.api_key or os.environ.get("JAXENGINE_API_KEY") or None
  try:
    uvicorn.run(
      build_app(engine, name, api_key), host=args.host, port=args.port,
      log_level=args.uvicorn_log_level,
    )  # fmt: skip
  finally:
    engine.shutdown()
  return 0
