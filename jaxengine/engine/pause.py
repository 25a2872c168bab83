"""Pausing generation for a weight sync (asynchronous RL): `LLMEngine`'s `pause_generation`,
`resume_generation` and `is_paused` (vLLM's names), and the weight version stamped on each token.

A pause has two parts. From `pause_generation` on, new requests are held by the engine (checked
and registered as usual, but given to no core) until `resume_generation` hands them to the cores.
Then every `EngineCore` is frozen (`EngineCore.paused`): its `step` schedules nothing and only
reads the step it left on the device (asynchronous scheduling's step in flight; a k-step loop, a
verify step and a prefill chunk are read when they are dispatched or by the next call), so a step
already dispatched is collected, never lost. The modes differ in what happens to the requests
already in the engine:

  - "keep": they stay where they are: running rows keep their batch row, their pages (keys and
    values) and their sampler state, waiting ones their place in the queue; after
    `resume_generation` they go on as if nothing happened. A seeded row's random stream depends
    on its seed and position alone, so with unchanged weights the tokens of greedy and seeded
    requests equal those of an uninterrupted run.
  - "wait": the engine steps until they have all finished, then freezes.
  - "abort": they end now, finish reason "abort", with the tokens and logprobs they had
    (`EngineCore.abort`, the one finish path).

`load_weights` may run while paused (nothing compiles); each core stamps the tokens of a step
with the weight version of its dispatch (`CompletionOutput.weight_versions`).

The staleness bound of asynchronous GRPO (`SamplingParams.max_staleness`, K): whenever the version
changes (`load_weights`) and at `resume_generation`, a request whose oldest generated token (read,
or still on the device in the step in flight) is more than K versions behind the engine's current
version is aborted, on the host: finish reason "abort", with the tokens and logprobs it had (a
completion of the request that had finished keeps its own finish reason). The engine forgets it;
its final output comes out of the next `step` (`AsyncLLM` streams it at once). A request with no
token yet is never stale: its first token will carry the current version.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from jaxengine.params import is_int

if TYPE_CHECKING:  # light at import: `AsyncLLM` checks a mode before the engine loads
  from jaxengine.core.request import Completion, Request
  from jaxengine.engine.engine_core import EngineCore
  from jaxengine.outputs import RequestOutput

#: vLLM's pause modes.
PAUSE_MODES = ("keep", "wait", "abort")


def check_pause_mode(mode: object) -> str:
  """`mode` if it is one of `PAUSE_MODES`.

  Raises:
    ValueError: any other value (named).
  """
  if not isinstance(mode, str) or mode not in PAUSE_MODES:
    raise ValueError(f"mode must be one of {', '.join(map(repr, PAUSE_MODES))}, got {mode!r}")
  return mode


def check_weight_version(weight_version: object) -> int:
  """`weight_version` as an int if it is a non-negative integer (bools refused).

  Raises:
    ValueError: a negative or non-integer value (named).
  """
  if not is_int(weight_version) or int(weight_version) < 0:  # type: ignore[call-overload]
    raise ValueError(f"weight_version must be a non-negative int, got {weight_version!r}")
  return int(weight_version)  # type: ignore[call-overload]


@dataclasses.dataclass
class PauseState:
  """An engine's pause: whether new requests are held, and those held so far (arrival order);
  and the final outputs of the requests the staleness bound dropped, for the next `step`."""

  holding: bool = False
  held: list[Request] = dataclasses.field(default_factory=list)
  dropped: list[RequestOutput] = dataclasses.field(default_factory=list)


class PausableEngine:
  """The pause methods of `LLMEngine` (a mixin: the engine supplies `cores`, `_requests`,
  `_pause`, `step`, `has_unfinished_requests`)."""

  cores: list[EngineCore]
  _requests: dict[str, Request]
  _pause: PauseState

  if TYPE_CHECKING:  # the engine's

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished_requests(self) -> bool: ...

  def _admit(self, request: Request) -> None:
    """Gives a registered request to the core with the fewest unfinished completions, or holds
    it while paused."""
    if self._pause.holding:
      self._pause.held.append(request)
    else:
      min(self.cores, key=lambda core: core.num_unfinished).add_request(request)

  def hold_new_requests(self) -> None:
    """The first half of a pause: requests added from now wait for `resume_generation`; the
    requests in the engine go on (`AsyncLLM` steps them to the end for a "wait" pause)."""
    self._pause.holding = True

  def pause_generation(self, mode: str = "keep") -> list[RequestOutput]:
    """Pauses generation (vLLM's name): new requests wait for `resume_generation`, and the
    requests in the engine are kept, finished or aborted (see the module).

    Args:
      mode: "keep" (default): running rows freeze with their pages and continue after
        `resume_generation`; "wait": steps until every request in the engine has finished, then
        pauses; "abort": every request in the engine ends now with finish reason "abort" and the
        tokens and logprobs it had. Pausing while paused changes nothing, except that "abort"
        aborts the kept requests (not the held ones).

    Returns:
      The outputs of what the pause read (as `step` returns them): the step left in flight,
      the steps "wait" ran, and each aborted request's final output (which the engine forgets).

    Raises:
      ValueError: a mode other than "keep", "wait" or "abort" (nothing changes).
    """
    from jaxengine.engine.engine_core import latest_outputs

    check_pause_mode(mode)
    outputs: list[RequestOutput] = []
    if not self.is_generation_frozen():
      self.hold_new_requests()
      while mode == "wait" and self.has_unfinished_requests():
        outputs += self.step()
      for core in self.cores:
        core.paused = True
      outputs += self.step()  # a paused core's step reads only what it left in flight
    if mode == "abort":
      outputs += self._abort_all()
    return latest_outputs(outputs)

  def _abort_all(self) -> list[RequestOutput]:
    """Aborts every request in the cores (not the held ones); their final outputs."""
    held = {r.request_id for r in self._pause.held}
    return self._abort_requests(
      [r for r in self._requests.values() if r.request_id not in held and not r.finished]
    )

  def _abort_requests(self, requests: list[Request]) -> list[RequestOutput]:
    """Aborts `requests` and forgets them: every completion not finished ends with finish reason
    "abort" (a running one through `EngineCore.abort`, a waiting one taken off its queue);
    their final outputs."""
    ids = {r.request_id for r in requests}
    for core in self.cores:
      core.abort(ids)
    for request in requests:
      for completion in request.completions:
        completion.finish_reason = completion.finish_reason or "abort"
      del self._requests[request.request_id]
    return [r.output() for r in requests]

  def _drop_stale(self) -> None:
    """Aborts every request past its `max_staleness` (see the module); their final outputs
    wait for `take_dropped`."""
    current = self.weight_version
    in_flight = [v for core in self.cores if (v := core.in_flight_weight_version) is not None]
    stale = [r for r in self._requests.values() if _is_stale(r, current, in_flight)]
    if stale:
      self._pause.dropped += self._abort_requests(stale)

  def take_dropped(self) -> list[RequestOutput]:
    """The final outputs of the requests the staleness bound dropped since the last call (each
    finished, finish reason "abort"); `step` returns them first."""
    dropped, self._pause.dropped = self._pause.dropped, []
    return dropped

  def resume_generation(self) -> None:
    """Ends a pause (vLLM's name): the kept requests go on (those past their `max_staleness`
    aborted first, their outputs for the next `step`) and the held ones (those not aborted
    meanwhile) are queued, in the order they came. Harmless when not paused."""
    self._pause.holding = False
    for core in self.cores:
      core.paused = False
    self._drop_stale()
    held, self._pause.held = self._pause.held, []
    for request in held:
      if self._requests.get(request.request_id) is request:  # not aborted while held
        self._admit(request)

  def is_paused(self) -> bool:
    """Whether generation is paused (new requests are held), vLLM's name."""
    return self._pause.holding

  def is_generation_frozen(self) -> bool:
    """Whether the cores are frozen: `step` then advances nothing (a pause has completed)."""
    return any(core.paused for core in self.cores)

  def set_weight_version(self, weight_version: int) -> None:
    """Stamps the tokens of steps dispatched from now with `weight_version` (every core), then
    aborts the requests it leaves past their `max_staleness` (their outputs: `take_dropped`)."""
    for core in self.cores:
      core.weight_version = weight_version
    self._drop_stale()

  @property
  def weight_version(self) -> int:
    """The version of the weights in use: 0 until `load_weights` gives one."""
    return self.cores[0].weight_version

  def next_weight_version(self, weight_version: object) -> int:
    """The checked version a `load_weights` gives (None: the current version + 1). Versions
    never go back (the staleness bound counts versions behind the current one): the current
    version again is allowed (the same weights synced twice), a lower one is not.

    Raises:
      ValueError: a negative or non-integer `weight_version`, or one below the current version
        (named).
    """
    current = self.weight_version
    version = check_weight_version(current + 1 if weight_version is None else weight_version)
    if version < current:
      raise ValueError(
        f"weight_version must not go back: got {version}, the engine is at version {current}"
      )
    return version


def _is_stale(request: Request, current: int, in_flight: list[int]) -> bool:
  """Whether `request` has a `max_staleness` K and an unfinished completion whose oldest token
  is more than K versions behind `current`."""
  bound = request.params.max_staleness
  if bound is None:
    return False
  oldest = [_oldest_version(c, in_flight) for c in request.completions]
  return any(version is not None and current - version > bound for version in oldest)


def _oldest_version(completion: Completion, in_flight: list[int]) -> int | None:
  """The weight version of an unfinished completion's first token: read, or (none read yet) in
  the step in flight; None when it has none (or has finished)."""
  if completion.finish_reason is not None:
    return None
  if completion.weight_versions:
    return completion.weight_versions[0]
  return min(in_flight) if completion.num_output_placeholders and in_flight else None
