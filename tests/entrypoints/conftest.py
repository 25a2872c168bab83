"""The serve tests' module fixtures: a running OpenAI-compatible server (tests/helpers/
serve_server.py) per module, and an `openai` client of it."""

from __future__ import annotations

import openai
import pytest
from serve_server import running_server


@pytest.fixture(scope="module")
def server():
  """The running server: its base URL, `AsyncLLM` and the reference outputs."""
  yield from running_server()


@pytest.fixture(scope="module")
def client(server):
  return openai.OpenAI(base_url=server["url"] + "/v1", api_key="unused", max_retries=0)
