"""Running a Python script in a fresh interpreter, for tests that must set the host device count
(``XLA_FLAGS=--xla_force_host_platform_device_count=N``) before JAX starts."""

from __future__ import annotations

import os
import subprocess
import sys

#: The tests' shared helpers (this folder): a script run by `run_python` that imports them
#: puts it on `sys.path` (its first argument).
HELPERS_DIR = os.path.dirname(os.path.abspath(__file__))


def run_python(script: str, *args: str, timeout: float = 600) -> str:
  """Runs ``python -c script *args`` on the CPU backend and returns its stdout.

  Fails the calling test with the end of stderr when the script exits non-zero.
  """
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  result = subprocess.run(
    [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=timeout, env=env
  )
  assert result.returncode == 0, result.stderr[-3000:]
  return result.stdout
