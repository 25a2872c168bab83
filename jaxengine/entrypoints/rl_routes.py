"""The server's routes for RL weight syncs (vLLM's paths and parameters), each one call of an
`AsyncLLM` method run on the engine thread between steps:

  POST /pause                 `{"mode": "keep"|"wait"|"abort"}` (or `?mode=`; default "keep"):
                              `pause_generation`, answered once paused: `{"is_paused": true}`
  POST /resume                `resume_generation`: `{"is_paused": false}`
  GET  /is_paused             `{"is_paused": bool}`
  POST /sleep?level=1|2       `sleep` (default level 1): `{"is_sleeping": true}`
  POST /wake_up?tags=weights&tags=kv_cache
                              `wake_up` (no tags: every part): `{"is_sleeping": bool}` (true
                              while a part is still asleep)
  GET  /is_sleeping           `{"is_sleeping": bool}`
  POST /reset_prefix_cache    `reset_prefix_cache`: `{"success": true}`

Errors are OpenAI's error body: a bad `mode`, `level` or tag is a 400 naming it (nothing
changes); `/sleep` while requests are unfinished (running, waiting, or kept by a "keep" pause)
is a 409 (the engine frees their pages only once they are done: finish them, or pause with
"wait" or "abort", first), the engine unchanged and serving on. While asleep, a generation
request is a 503 (the engine's message naming `wake_up`), the engine serving on after the wake.
"""

from __future__ import annotations

from fastapi import FastAPI, Request

from jaxengine.entrypoints.async_llm import AsyncLLM, EngineDeadError
from jaxengine.entrypoints.protocol import RequestError


def add_rl_routes(app: FastAPI, engine: AsyncLLM) -> None:
  """Adds the pause, sleep and prefix-cache routes (the module's table) to `app`.

  Args:
    app: the server's FastAPI app (its handlers answer a `RequestError` with its status).
    engine: the running `AsyncLLM` the routes call.
  """

  @app.post("/pause")
  async def pause(request: Request) -> dict:
    mode = request.query_params.get("mode")
    if mode is None and await request.body():
      body = await request.json()
      if not isinstance(body, dict):
        raise RequestError(f"the body must be a JSON object, got {body!r}")
      mode = body.get("mode")
    try:
      await engine.pause_generation("keep" if mode is None else mode)
    except ValueError as error:
      raise RequestError(str(error), "mode") from None
    return {"is_paused": True}

  @app.post("/resume")
  async def resume() -> dict:
    await engine.resume_generation()
    return {"is_paused": False}

  @app.get("/is_paused")
  async def is_paused() -> dict:
    return {"is_paused": await engine.is_paused()}

  @app.post("/sleep")
  async def sleep(request: Request) -> dict:
    given = request.query_params.get("level", "1")
    try:
      level = int(given)
    except ValueError:
      raise RequestError(f"sleep level must be 1 or 2, got {given!r}", "level") from None
    try:
      await engine.sleep(level)
    except ValueError as error:  # a level other than 1 or 2: nothing changed
      raise RequestError(str(error), "level") from None
    except EngineDeadError:
      raise
    except RuntimeError as error:  # unfinished requests: nothing changed
      raise RequestError(str(error), None, 409) from None
    return {"is_sleeping": True}

  @app.post("/wake_up")
  async def wake_up(request: Request) -> dict:
    tags = request.query_params.getlist("tags") or None  # none given: every part
    try:
      await engine.wake_up(tags)
    except ValueError as error:
      raise RequestError(str(error), "tags") from None
    return {"is_sleeping": await engine.is_sleeping()}

  @app.get("/is_sleeping")
  async def is_sleeping() -> dict:
    return {"is_sleeping": await engine.is_sleeping()}

  @app.post("/reset_prefix_cache")
  async def reset_prefix_cache() -> dict:
    return {"success": await engine.reset_prefix_cache()}
