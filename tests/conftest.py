"""Shared fixtures for the core (batch + sampler) tests."""

from __future__ import annotations

import pytest

from jaxengine.testing import count_compiles


@pytest.fixture
def compile_counter():
  """Yields a running `jaxengine.testing.CompileCounter`; `.count` is the compiles seen so far."""
  with count_compiles() as counter:
    yield counter
