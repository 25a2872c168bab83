"""JAX's persistent compilation cache, on by default for the engine.

A fresh process otherwise compiles every prefill and decode bucket again (seconds each for a real
model); with the cache, a second start reads the executables back from disk.

Where it goes, first match wins:

  1. a cache directory the user already gave JAX (`jax.config.update("jax_compilation_cache_dir",
     ...)` or the `JAX_COMPILATION_CACHE_DIR` environment variable): left exactly as it is;
  2. the `LLM(compilation_cache=...)` argument (the CLI's `--compilation-cache`): a path, or
     False to leave the cache off;
  3. the `JAXENGINE_COMPILATION_CACHE` environment variable: a path;
  4. `$XDG_CACHE_HOME/jaxengine/xla`, else `~/.cache/jaxengine/xla`.

The argument, the flag and the variable spell "off" alike: `off`, `false`, `no`, `0` or an empty
string, in any case (so `LLM(compilation_cache="off")` leaves the cache off, it does not create a
directory named `off`).

JAX reads its cache directory once per process, so the first engine's choice holds for the
process: a later engine that explicitly asks for another cache (another path, or off; the
argument or the variable) gets a `UserWarning` naming both, and runs with the cache in use.

When jaxengine turns the cache on itself it also stores every executable, however quickly it
compiled (`jax_persistent_cache_min_compile_time_secs = 0`): the engine's small steps (row
writes, metadata refresh) add up at start-up too.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache as _jax_cache

#: Environment variable naming the cache directory, or an `OFF` spelling to disable it.
ENV_VAR = "JAXENGINE_COMPILATION_CACHE"
#: Spellings of "no cache" in the argument, the CLI flag and the variable (compared lower-cased,
#: stripped).
OFF = ("", "0", "off", "false", "no")


def is_off(value: str | os.PathLike) -> bool:
  """Whether a string (or path) spells "no cache"."""
  return os.fspath(value).strip().lower() in OFF


def default_cache_dir() -> Path:
  """`$XDG_CACHE_HOME/jaxengine/xla`, or `~/.cache/jaxengine/xla` when that is unset."""
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return Path(base) / "jaxengine" / "xla"


def resolve_cache_dir(compilation_cache: bool | str | os.PathLike = True) -> Path | None:
  """The directory jaxengine would use, or None for no cache (ignores what JAX already has).

  Args:
    compilation_cache: True (the environment variable, else the default directory), False or
      an `OFF` spelling (no cache), or a directory.

  Raises:
    ValueError: naming `compilation_cache` and its value, for anything else.
  """
  if compilation_cache is False:
    return None
  if compilation_cache is True:
    value = os.environ.get(ENV_VAR)
    if value is None:
      return default_cache_dir()
    return None if is_off(value) else Path(value).expanduser()
  if isinstance(compilation_cache, (str, os.PathLike)):
    return None if is_off(compilation_cache) else Path(compilation_cache).expanduser()
  raise ValueError(
    f"compilation_cache must be True, False or a directory path, got {compilation_cache!r}"
  )


def enable_compilation_cache(compilation_cache: bool | str | os.PathLike = True) -> Path | None:
  """Turns on JAX's persistent compilation cache unless it is already configured.

  Safe to call many times (every `LLM` does): a directory already set, by the user or by an
  earlier call, is never replaced, and a cache once on stays on. An explicit request for
  something else (a `compilation_cache` other than True, or `ENV_VAR` set) warns then.

  Args:
    compilation_cache: as `resolve_cache_dir`.

  Returns:
    The cache directory in use (the user's own if one was configured), or None when no cache is.

  Raises:
    ValueError: as `resolve_cache_dir`.

  Warns:
    UserWarning: when an explicit request differs from the directory this process uses.
  """
  wanted = resolve_cache_dir(compilation_cache)
  configured = jax.config.jax_compilation_cache_dir  # type: ignore[attr-defined]
  if configured:
    explicit = compilation_cache is not True or ENV_VAR in os.environ
    if explicit and wanted != Path(configured).expanduser():
      asked = "no cache" if wanted is None else f"the cache {os.fspath(wanted)!r}"
      warnings.warn(
        f"compilation_cache={compilation_cache!r} (asking for {asked}) has no effect: this "
        f"process already uses the persistent compilation cache {configured!r} (JAX's "
        "jax_compilation_cache_dir, set once per process by the first engine or by you)",
        UserWarning,
        stacklevel=3,
      )
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
