"""Every Python snippet of README.md and docs/*.md runs as written.

The snippets of one page run top to bottom as one script, from the repository root (a later
snippet may use what an earlier one on the same page defined, as a reader going down the page
would), in a namespace of its own: nothing one page defines is visible to another. A page states
what its snippets need around them in HTML comments, which a reader does not see:

- ``<!-- docs-test: env NAME=VALUE -->`` sets an environment variable (e.g. host devices);
- ``<!-- docs-test: serve ARGS -->`` runs ``jaxengine serve ARGS`` while the page runs (its
  snippets then talk to it as a user's client would).

A page with such a directive runs in an interpreter of its own. The pages without one run one
after another in one shared interpreter (`SHARED_RUNNER`), as a user's notebook or session going
through the docs would: each still imports what it uses, but JAX, the model's file and the
compiled steps are loaded once (a fresh interpreter per page cost about 4 s of imports and
the compiled steps' tracing again for every page).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
SHELL_FENCE = re.compile(r"^```bash\n(.*?)^```", re.S | re.M)
#: A command line of a page's bash block that `test_page_commands_pass_their_checks_as_written`
#: checks, and a line it runs first because it writes a file that the commands after it read.
CLI_COMMAND = re.compile(r"^jaxengine (generate|chat) ")
WRITES_FILE = re.compile(r"^(echo|printf) .* > [\w./-]+$")
DIRECTIVE = re.compile(r"<!-- docs-test: (\w+) (.*?) -->")

#: The front door stays short (the manual lives in docs/).
README_MAX_LINES = 250


def page_script(page: Path) -> str:
  """The page's Python snippets, in order, as one script."""
  return "\n\n".join(FENCE.findall(page.read_text()))


def directives(page: Path) -> list[tuple[str, str]]:
  return DIRECTIVE.findall(page.read_text())


PAGES_WITH_CODE = [p for p in PAGES if page_script(p)]
#: Pages with no directive: run together in one interpreter (`shared_page_errors`).
PLAIN_PAGES = [p for p in PAGES_WITH_CODE if not directives(p)]

#: Runs each page script named on its command line in a fresh `__main__` namespace, in order,
#: and writes `{script: traceback or null}` as JSON to the first argument after a page fails or
#: all have run (a page's failure does not stop the next).
SHARED_RUNNER = """
import json, sys, traceback
out, scripts = sys.argv[1], sys.argv[2:]
errors = {}
for script in scripts:
  try:
    with open(script) as f:
      code = compile(f.read(), script, "exec")
    exec(code, {"__name__": "__main__", "__file__": script})
  except BaseException:
    errors[script] = traceback.format_exc()[-4000:]
  else:
    errors[script] = None
  with open(out, "w") as f:
    json.dump(errors, f)
"""


def _wait_for_health(url: str, server: subprocess.Popen, timeout: float) -> None:
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    assert server.poll() is None, server.stderr.read() if server.stderr else "server exited"
    try:
      if httpx.get(f"{url}/health", timeout=2).status_code == 200:
        return
    except httpx.HTTPError:
      pass
    time.sleep(1)
  raise AssertionError(f"jaxengine serve did not become ready within {timeout} s")


def _page_env() -> dict[str, str]:
  return dict(os.environ, JAX_PLATFORMS="cpu")


@pytest.fixture(scope="module")
def shared_page_errors(tmp_path_factory) -> dict[str, str | None]:
  """`{page name: traceback, or None when it ran}` for `PLAIN_PAGES`, run in one interpreter; a
  page missing from it was never reached (the interpreter died: its stderr is the value)."""
  folder = tmp_path_factory.mktemp("docs")
  scripts = {}
  for page in PLAIN_PAGES:
    scripts[page.name] = folder / f"{page.stem}.py"
    scripts[page.name].write_text(page_script(page))
  out = folder / "errors.json"
  result = subprocess.run(
    [sys.executable, "-c", SHARED_RUNNER, str(out), *map(str, scripts.values())],
    cwd=ROOT,
    env=_page_env(),
    capture_output=True,
    text=True,
    timeout=1800,
  )
  reached = json.loads(out.read_text()) if out.exists() else {}
  died = f"the shared interpreter exited with {result.returncode}:\n{result.stderr[-4000:]}"
  return {name: reached.get(str(script), died) for name, script in scripts.items()}


@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=lambda p: p.name)
def test_page_snippets_run_as_written(page: Path, request, tmp_path_factory):
  if page in PLAIN_PAGES:
    error = request.getfixturevalue("shared_page_errors")[page.name]
    assert error is None, f"{page.name}:\n{error}"
    return
  env = _page_env()
  server = None
  for kind, value in directives(page):
    if kind == "env":
      name, _, val = value.partition("=")
      # XLA_FLAGS adds to the run's own (tests/conftest.py), other variables are set.
      env[name] = f"{env.get(name, '')} {val}".strip() if name == "XLA_FLAGS" else val
    elif kind == "serve":
      args = shlex.split(value)
      server = subprocess.Popen(
        [sys.executable, "-m", "jaxengine", "serve", *args],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
      )
      port = args[args.index("--port") + 1]
      _wait_for_health(f"http://127.0.0.1:{port}", server, timeout=600)
    else:
      raise AssertionError(f"{page.name}: unknown docs-test directive {kind!r}")
  script = tmp_path_factory.mktemp("docs") / f"{page.stem}.py"
  script.write_text(page_script(page))
  try:
    result = subprocess.run(
      [sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
  finally:
    if server is not None:
      server.terminate()
      server.wait(timeout=60)
  assert result.returncode == 0, f"{page.name}:\n{result.stderr[-4000:]}"


def cli_blocks(page: Path) -> list[list[str]]:
  """The lines of the page's bash blocks that run `jaxengine generate` or `jaxengine chat`."""
  blocks = [block.splitlines() for block in SHELL_FENCE.findall(page.read_text())]
  return [lines for lines in blocks if any(CLI_COMMAND.match(line) for line in lines)]


class _ModelLoad(Exception):
  """Raised where a command would load its model: every check before that passed."""


@pytest.mark.parametrize("page", [p for p in PAGES if cli_blocks(p)], ids=lambda p: p.name)
def test_page_commands_pass_their_checks_as_written(page, tmp_path, monkeypatch, capsys):
  """Each `jaxengine generate` / `jaxengine chat` line of a page's bash blocks, run as written in
  an empty folder after the block's lines before it that write a file (`echo ... > FILE`), gets
  past every check made before the model loads: its flags, the files it names, its constraint
  (the model is not loaded: the page's Python snippets run the engine)."""
  import jaxengine.cli.main as cli
  import jaxengine.entrypoints.llm as llm

  def load_model(*args, **kwargs):
    raise _ModelLoad

  monkeypatch.setattr(llm, "LLM", load_model)
  monkeypatch.chdir(tmp_path)
  for lines in cli_blocks(page):
    for line in lines:
      if WRITES_FILE.match(line):
        subprocess.run(["bash", "-c", line], cwd=tmp_path, check=True)
      elif CLI_COMMAND.match(line):
        try:
          status = cli.main(shlex.split(line, comments=True)[1:])
        except _ModelLoad:
          continue
        pytest.fail(f"{page.name}: `{line}` exited with {status}: {capsys.readouterr().err}")


def test_the_readme_is_a_front_door():
  """The README starts with the two commands and stays short; every docs page is linked from it."""
  readme = (ROOT / "README.md").read_text()
  assert len(readme.splitlines()) <= README_MAX_LINES
  first_two = re.findall(r"^```bash\n(.*?)\n```", readme, re.S | re.M)[:2]
  assert "jaxengine generate" in first_two[0] and "pytest" in first_two[1]
  for page in sorted((ROOT / "docs").glob("*.md")):
    assert f"docs/{page.name}" in readme, f"docs/{page.name} is not linked from the README"


def test_the_snippet_reader_finds_every_python_fence(tmp_path):
  """The extraction the test above relies on: two fences in order, other languages left out."""
  page = tmp_path / "page.md"
  page.write_text("x\n```python\na = 1\n```\n```bash\nls\n```\n```python\nprint(a)\n```\n")
  assert page_script(page) == "a = 1\n\n\nprint(a)\n"


def test_the_configuration_page_documents_every_option_and_flag():
  """docs/configuration.md has a row for every `EngineConfig` field and names every engine
  flag of the command, and no row for an option that is gone."""
  import dataclasses

  from jaxengine.engine.engine_flags import ENGINE_FLAGS
  from jaxengine.engine_config import EngineConfig

  text = (ROOT / "docs" / "configuration.md").read_text()
  rows = {m for m in re.findall(r"^\| `(\w+)` \|", text, re.M)}
  fields = {f.name for f in dataclasses.fields(EngineConfig)}
  assert rows == fields, (sorted(fields - rows), sorted(rows - fields))
  flags = {flag.flag.removeprefix("--") for flag in ENGINE_FLAGS}
  missing = [f for f in flags if f"--{f}" not in text and f"--[no-]{f}" not in text]
  assert missing == []
