"""JAX's persistent compilation cache, on by default for the engine.

A fresh process otherwise compiles every prefill and decode bucket again (seconds each for a real
model); with the cache, a second start reads the executables back from disk.

Where it goes, first match wins:

  1. a cache directory the user already gave JAX (`jax.config.update("jax_compilation_cache_dir",
     ...)` or the `JAX_COMPILATION_CACHE_DIR` environment variable): left exactly as it is;
  2. the `LLM(compilation_cache=...)` argument: a path, or False to leave the cache off;
  3. the `JAXENGINE_COMPILATION_CACHE` environment variable: a path, or `0` / `off` / `false`
     to leave the cache off;
  4. `$XDG_CACHE_HOME/jaxengine/xla`, else `~/.cache/jaxengine/xla`.

When jaxengine turns the cache on itself it also stores every executable, however quickly it
compiled (`jax_persistent_cache_min_compile_time_secs = 0`): the engine's small steps (row
writes, metadata refresh) add up at start-up too.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache as _jax_cache

#: Environment variable naming the cache directory, or `0` / `off` / `false` to disable it.
ENV_VAR = "JAXENGINE_COMPILATION_CACHE"
_OFF = ("", "0", "off", "false", "no")


def default_cache_dir() -> Path:
  """`$XDG_CACHE_HOME/jaxengine/xla`, or `~/.cache/jaxengine/xla` when that is unset."""
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return Path(base) / "jaxengine" / "xla"


def resolve_cache_dir(compilation_cache: bool | str | os.PathLike = True) -> Path | None:
  """The directory jaxengine would use, or None for no cache (ignores what JAX already has).

  Args:
    compilation_cache: True (the environment variable, else the default directory), False
      (no cache), or a directory.

  Raises:
    ValueError: naming `compilation_cache` and its value, for anything else (an empty path
      included).
  """
  if compilation_cache is False:
    return None
  if compilation_cache is True:
    value = os.environ.get(ENV_VAR)
    if value is None:
      return default_cache_dir()
    if value.strip().lower() in _OFF:
      return None
    return Path(value).expanduser()
  if isinstance(compilation_cache, (str, os.PathLike)) and os.fspath(compilation_cache):
    return Path(compilation_cache).expanduser()
  raise ValueError(
    f"compilation_cache must be True, False or a directory path, got {compilation_cache!r}"
  )


def enable_compilation_cache(compilation_cache: bool | str | os.PathLike = True) -> Path | None:
  """Turns on JAX's persistent compilation cache unless it is already configured.

  Safe to call many times (every `LLM` does): a directory already set, by the user or by an
  earlier call, is never replaced.

  Args:
    compilation_cache: as `resolve_cache_dir`.

  Returns:
    The cache directory in use (the user's own if one was configured), or None when no cache is.

  Raises:
    ValueError: as `resolve_cache_dir`.
  """
  wanted = resolve_cache_dir(compilation_cache)
  configured = jax.config.jax_compilation_cache_dir  # type: ignore[attr-defined]
  if configured:
    return Path(configured)
  if wanted is None:
    return None
  wanted.mkdir(parents=True, exist_ok=True)
  # JAX decides once per process whether a cache is in use (at the first compile): forget that
  # decision so that a process which compiled something before still gets the cache.
  _jax_cache.reset_cache()
  jax.config.update("jax_compilation_cache_dir", os.fspath(wanted))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  return wanted
