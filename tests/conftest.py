"""Shared fixtures for the core (batch + sampler) tests."""

from __future__ import annotations

import os

import pytest

# Tests are hermetic: no engine writes to the user's persistent compilation cache (the tests of
# the cache give it a temporary directory).
os.environ.setdefault("JAXENGINE_COMPILATION_CACHE", "off")

from jaxengine.testing import count_compiles


@pytest.fixture
def compile_counter():
  """Yields a running `jaxengine.testing.CompileCounter`; `.count` is the compiles seen so far."""
  with count_compiles() as counter:
    yield counter
