"""Running a Python script in a fresh interpreter, for tests that must set the host device count
(``XLA_FLAGS=--xla_force_host_platform_device_count=N``) before JAX starts."""

from __future__ import annotations

import os
import subprocess
import sys

#: The tests' shared helpers (this folder): on a subprocess's PYTHONPATH (`child_env`), so its
#: script imports them by name (`from step_shapes import one_shape`), as the tests do.
HELPERS_DIR = os.path.dirname(os.path.abspath(__file__))


def child_env() -> dict[str, str]:
  """The environment of a test's subprocess: this process's, on the CPU backend, with
  `HELPERS_DIR` first on its PYTHONPATH."""
  path = os.environ.get("PYTHONPATH")
  return dict(
    os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(filter(None, [HELPERS_DIR, path]))
  )


def run_python(script: str, *args: str, timeout: float = 600) -> str:
  """Runs ``python -c script *args`` on the CPU backend and returns its stdout.

  Fails the calling test with the end of stderr when the script exits non-zero.
  """
  result = subprocess.run(
    [sys.executable, "-c", script, *args],
    capture_output=True,
    text=True,
    timeout=timeout,
    env=child_env(),
  )
  assert result.returncode == 0, result.stderr[-3000:]
  return result.stdout
