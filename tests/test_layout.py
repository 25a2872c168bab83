"""The package layout keeps its dependencies pointing one way (style.md, "Layout")."""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "jaxengine"
HOST_AND_ENGINE = ("jaxengine.batch", "jaxengine.engine", "jaxengine.models", "jaxengine.llm")


def _imports(path: pathlib.Path) -> set[str]:
  names = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      names.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      names.add(node.module)
      names.update(f"{node.module}.{alias.name}" for alias in node.names)
  return names


@pytest.mark.parametrize("path", sorted((PACKAGE / "sample").glob("*.py")), ids=lambda p: p.name)
def test_the_device_core_imports_no_host_batch_engine_or_model(path):
  bad = {name for name in _imports(path) if name.startswith(HOST_AND_ENGINE + ("jaxengine.cli",))}
  assert not bad, f"{path.name} imports {sorted(bad)}"


@pytest.mark.parametrize(
  "path", sorted((PACKAGE / "batch").glob("*.py")) + [PACKAGE / "config.py"], ids=lambda p: p.name
)
def test_the_batch_and_config_import_no_engine_or_model(path):
  bad = {name for name in _imports(path) if name.startswith(HOST_AND_ENGINE[1:])}
  assert not bad, f"{path.name} imports {sorted(bad)}"


CORE_MODULES = sorted((PACKAGE / "sample").glob("*.py")) + sorted((PACKAGE / "batch").glob("*.py"))


@pytest.mark.parametrize("path", CORE_MODULES + [PACKAGE / "config.py"], ids=lambda p: p.name)
def test_no_core_module_is_longer_than_about_450_lines(path):
  assert len(path.read_text().splitlines()) <= 460
