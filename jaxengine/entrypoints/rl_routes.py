"""The server's routes for RL weight syncs (vLLM's paths and parameters), each one call of an
`AsyncLLM` method run on the engine thread between steps:

  POST /pause                 `{"mode": "keep"|"wait"|"abort"}` (or `?mode=`; default "keep"):
                              `pause_generation`, answered once paused: `{"is_paused": true}`
  POST /resume                `resume_generation`: `{"is_paused": false}`
  GET  /is_paused             `{"is_paused": bool}`
  POST /sleep?level=1|2&mode=wait|abort
                              `sleep` (default level 1): `{"is_sleeping": true}`; with vLLM's
                              `mode`, `pause_generation(mode)` first (see below). Level 2
                              discards the weights: no route loads new ones (only Python's
                              `AsyncLLM.load_weights`), so until then every generation request
                              is a 503. Level 2 while level 1 holds the weights in host memory
                              is a 409 (it would discard them silently): `/wake_up` first
  POST /wake_up?tags=weights&tags=kv_cache
                              `wake_up` (no tags: every part): `{"is_sleeping": bool}` (true
                              while a part is still asleep); once all is awake, it resumes
                              generation if `/sleep?mode=` paused it
  GET  /is_sleeping           `{"is_sleeping": bool}`
  POST /reset_prefix_cache    `reset_prefix_cache`: `{"success": true}`

The engine sleeps only when no request is in it (its pages are freed): `/sleep` without `mode`
while requests are unfinished (running, waiting, or kept by a "keep" pause) is a 409 and changes
nothing. With `mode` (vLLM's parameter) the requests in the engine are dealt with first, as
`/pause` does: "wait" lets them finish, "abort" ends them with finish reason "abort"; "keep" is
a 400 (kept requests hold the pages sleep frees). Generation then stays paused until `/wake_up`
has woken every part: requests sent between the pause and the sleep wait and start after the
wake (a pause the client made itself before stays until its `/resume`). While asleep, a
generation request is a 503 (the engine's message naming `wake_up`).

Errors are OpenAI's error body: a bad `mode`, `level` or tag is a 400 naming it, a body that is
not a JSON object (malformed JSON included) a 400 naming the body (nothing changes); the engine
serves on after every error. `/pause` alone reads a body; the others take query parameters.
"""

from __future__ import annotations

from fastapi import FastAPI, Request

from jaxengine.engine.pause import check_pause_mode
from jaxengine.entrypoints.async_llm import AsyncLLM, EngineDeadError
from jaxengine.entrypoints.protocol import RequestError
from jaxengine.worker.sleep_mode import UnfinishedRequestsError, check_level, unfinished


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
      try:
        body = await request.json()
      except ValueError as error:  # malformed JSON or not UTF-8: nothing changes
        raise RequestError(f"the body must be a JSON object, malformed JSON: {error}") from None
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

  paused_by_sleep = False  # a `/sleep?mode=` paused generation: `/wake_up` resumes it

  @app.post("/sleep")
  async def sleep(request: Request) -> dict:
    nonlocal paused_by_sleep
    level, mode = _sleep_level(request), _sleep_mode(request)
    if level == 2 and await engine.weights_on_host():
      raise RequestError(
        "sleep level 2 would discard the weights that sleep level 1 holds in host memory, and "
        "no route loads weights (load_weights is Python's: AsyncLLM.load_weights): POST "
        "/wake_up first, then /sleep?level=2 if they are to be replaced",
        "level",
        409,
      )
    pausing = False
    if mode is not None:  # vLLM's: the requests in the engine are dealt with first
      pausing = not await engine.is_paused()  # a pause of the client's own stays its own
      if pausing or mode == "abort":  # "abort" also ends the requests a "keep" pause kept
        await engine.pause_generation(mode)
    try:
      await engine.sleep(level)
    except EngineDeadError:
      raise
    except UnfinishedRequestsError as error:  # nothing changed
      if pausing:
        await engine.resume_generation()
      raise RequestError(await _unfinished_message(engine, error), None, 409) from None
    paused_by_sleep = paused_by_sleep or pausing
    return {"is_sleeping": True}

  @app.post("/wake_up")
  async def wake_up(request: Request) -> dict:
    nonlocal paused_by_sleep
    tags = request.query_params.getlist("tags") or None  # none given: every part
    try:
      await engine.wake_up(tags)
    except ValueError as error:
      raise RequestError(str(error), "tags") from None
    is_sleeping = await engine.is_sleeping()
    if paused_by_sleep and not is_sleeping:
      paused_by_sleep = False
      await engine.resume_generation()
    return {"is_sleeping": is_sleeping}

  @app.get("/is_sleeping")
  async def is_sleeping() -> dict:
    return {"is_sleeping": await engine.is_sleeping()}

  @app.post("/reset_prefix_cache")
  async def reset_prefix_cache() -> dict:
    return {"success": await engine.reset_prefix_cache()}


async def _unfinished_message(engine: AsyncLLM, error: UnfinishedRequestsError) -> str:
  """`/sleep`'s 409: the unfinished requests and the routes that deal with them."""
  if await engine.is_paused():  # kept by a "keep" pause: "wait" cannot finish them
    advice = (
      "generation is paused: POST /sleep?mode=abort ends them, or /resume lets them go on "
      "(then /sleep?mode=wait)"
    )
  else:
    advice = "POST /sleep?mode=wait lets them finish first, /sleep?mode=abort ends them"
  return f"sleep needs no unfinished requests: {unfinished(error.num_unfinished)} ({advice})"


def _sleep_level(request: Request) -> int:
  """`/sleep`'s `level` query parameter (default 1), checked before anything changes.

  Raises:
    RequestError: a 400 naming `level`, for a value other than 1 or 2.
  """
  given = request.query_params.get("level", "1")
  try:
    return check_level(int(given))
  except ValueError:
    raise RequestError(f"sleep level must be 1 or 2, got {given!r}", "level") from None


def _sleep_mode(request: Request) -> str | None:
  """`/sleep`'s `mode` query parameter (vLLM's): "wait", "abort", or None (not given).

  Raises:
    RequestError: a 400 naming `mode`, for another value ("keep" included: kept requests hold
      the pages sleep frees).
  """
  mode = request.query_params.get("mode")
  if mode is None:
    return None
  try:
    check_pause_mode(mode)
  except ValueError as error:
    raise RequestError(str(error), "mode") from None
  if mode == "keep":
    raise RequestError(
      'mode="keep" cannot sleep: kept requests hold the pages sleep frees; use "wait" or '
      '"abort", or leave mode out',
      "mode",
    )
  return mode
