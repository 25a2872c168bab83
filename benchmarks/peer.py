"""A Python process driven one JSON object a line each way, shared by the benchmark scripts that
run another engine (vLLM, HF `generate`) or another checkout's jaxengine in its own interpreter."""

from __future__ import annotations

import io
import json
import os
import subprocess
import tarfile
from collections.abc import Mapping, Sequence


class JsonLinePeer:
  """Starts `command` and talks to it: a request as one JSON line on its stdin, the answer as one
  JSON line on its stdout. Its first line (read by `__init__`) is its greeting.

  Raises:
    SystemExit: when the process exits instead of answering.
  """

  def __init__(self, command: Sequence[str], env: Mapping[str, str] | None = None) -> None:
    self.process = subprocess.Popen(
      list(command),
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      text=True,
      env=dict(env) if env is not None else None,
    )
    self.greeting = self.read()

  def read(self) -> dict:
    """The next answer."""
    assert self.process.stdout is not None
    line = self.process.stdout.readline()
    if not line:
      raise SystemExit(f"{self.process.args[1]} exited with status {self.process.wait()}")
    return json.loads(line)

  def ask(self, **request) -> dict:
    """Sends one request and returns its answer."""
    assert self.process.stdin is not None
    self.process.stdin.write(json.dumps(request) + "\n")
    self.process.stdin.flush()
    return self.read()

  def close(self) -> None:
    """Ends its input and waits for it to exit (at most two minutes)."""
    if self.process.stdin is not None:
      self.process.stdin.close()
    self.process.wait(120)


def checkout(rev: str, into: str) -> str:
  """The top directory of `rev`'s jaxengine: `rev` itself when it is a directory holding a
  `jaxengine` package, else the package of git revision `rev` of this repository, extracted
  under `into`."""
  if os.path.isfile(os.path.join(rev, "jaxengine", "__init__.py")):
    return rev
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  archive = subprocess.run(
    ["git", "-C", repo, "archive", "--format=tar", rev, "jaxengine"], capture_output=True
  )
  if archive.returncode:
    raise SystemExit(f"{rev}: {archive.stderr.decode().strip()}")
  with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
    tar.extractall(into, filter="data")
  return into
