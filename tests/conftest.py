"""Shared fixtures for the core (batch + sampler) tests."""

from __future__ import annotations

import os
import sys

import jax
import jax.monitoring
import pytest

# Make `import reference` work from every test module in this folder.
sys.path.insert(0, os.path.dirname(__file__))

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileCounter:
  """Counts XLA backend compiles reported through jax.monitoring while `active`."""

  def __init__(self) -> None:
    self.count = 0
    self.active = True

  def _listener(self, event: str, duration_secs: float, **kwargs) -> None:
    if self.active and event == BACKEND_COMPILE_EVENT:
      self.count += 1

  def reset(self) -> None:
    self.count = 0


@pytest.fixture
def compile_counter():
  """Yields a CompileCounter; `counter.count` is the number of backend compiles seen so far."""
  counter = CompileCounter()
  jax.monitoring.register_event_duration_secs_listener(counter._listener)
  try:
    yield counter
  finally:
    counter.active = False  # in case unregistering is unavailable
    unregister = getattr(jax.monitoring, "unregister_event_duration_listener", None)
    if unregister is not None:
      try:
        unregister(counter._listener)
      except Exception:  # pragma: no cover - best effort
        pass
