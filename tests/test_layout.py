"""The package's layout keeps its dependencies pointing one way, with no import cycle.

Checked on the source (every `import` statement, type-only ones included), so a violation fails
here before it becomes a circular-import error at run time.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "jaxengine"

# What each layer may not import: the core never reaches up to the model, engine or front ends,
# and the model knows nothing of sampling or the engine.
FORBIDDEN = {
  "jaxengine.params": ("jaxengine.batch", "jaxengine.sample", "jaxengine.engine",
                       "jaxengine.models", "jaxengine.llm", "jaxengine.cli"),
  "jaxengine.config": ("jaxengine.batch", "jaxengine.sample", "jaxengine.engine",
                       "jaxengine.models", "jaxengine.llm", "jaxengine.cli"),
  "jaxengine.sample": ("jaxengine.batch", "jaxengine.engine", "jaxengine.models",
                       "jaxengine.llm", "jaxengine.cli"),
  "jaxengine.batch": ("jaxengine.engine", "jaxengine.models", "jaxengine.llm", "jaxengine.cli"),
  "jaxengine.models": ("jaxengine.sample", "jaxengine.batch", "jaxengine.engine",
                       "jaxengine.llm", "jaxengine.cli"),
  "jaxengine.engine": ("jaxengine.llm", "jaxengine.cli"),
}  # fmt: skip


def _module_name(path: Path) -> str:
  parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
  """Every jaxengine module `path` imports (absolute names)."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      found.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      found.add(node.module)
      found.update(f"{node.module}.{alias.name}" for alias in node.names)
  return {name for name in found if name.startswith("jaxengine")}


def _graph() -> dict[str, set[str]]:
  modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
  graph = {}
  for name, path in modules.items():
    # `from pkg import name` may name a submodule or an attribute: keep what is a module.
    graph[name] = {m for m in _imports(path) if m in modules and m != name}
  return graph


def _layer(name: str) -> str | None:
  return next((layer for layer in FORBIDDEN if name == layer or name.startswith(layer + ".")), None)


def test_no_module_imports_upward():
  violations = []
  for name, imported in _graph().items():
    layer = _layer(name)
    if layer is None:
      continue
    for target in imported:
      if any(target == bad or target.startswith(bad + ".") for bad in FORBIDDEN[layer]):
        violations.append(f"{name} imports {target}")
  assert not violations, violations


def test_no_import_cycles():
  graph = _graph()
  # A package's __init__ re-exports its modules; importing a sibling through it is not a cycle of
  # the modules themselves, so edges into a package __init__ from inside the package are dropped.
  for name, imported in graph.items():
    graph[name] = {t for t in imported if not name.startswith(t + ".")}
  state: dict[str, int] = {}
  cycles = []

  def visit(node: str, stack: list[str]) -> None:
    state[node] = 1
    for target in sorted(graph[node]):
      if state.get(target) == 1:
        cycles.append(stack[stack.index(target) :] + [target])
      elif target not in state:
        visit(target, [*stack, target])
    state[node] = 2

  for node in sorted(graph):
    if node not in state:
      visit(node, [node])
  assert not cycles, cycles


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: _module_name(p))
def test_modules_stay_short(path):
  assert len(path.read_text().splitlines()) <= 500, f"{path.name}: split it by job"


CORE_MODULES = sorted((PACKAGE / "sample").glob("*.py")) + sorted((PACKAGE / "batch").glob("*.py"))


@pytest.mark.parametrize("path", [*CORE_MODULES, PACKAGE / "config.py"], ids=lambda p: p.name)
def test_no_core_module_is_longer_than_about_450_lines(path):
  assert len(path.read_text().splitlines()) <= 460


def _readme_section(title: str) -> str:
  text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
  start = text.index(f"\n## {title}\n")
  end = text.find("\n## ", start + 1)
  return text[start:end]


def test_readme_states_the_top_p_tie_rule_and_the_mesh_limits():
  """Documented differences a new user hit: top-p keeps every token tied at the cut (vLLM's sort
  keeps fewer), and which features refuse a mesh (num_decode_steps > 1, prefix caching,
  speculative decoding), where each is described and under the mesh section."""
  differences = " ".join(_readme_section("Differences from vLLM").split())
  assert "Top-p keeps ties" in differences and "top_p=0.5" in differences
  throughput = " ".join(_readme_section("Rollout throughput and start-up").split())
  multi_step = throughput[throughput.index("Several decode steps per dispatch") :]
  assert "Not on a mesh yet: with `mesh=`" in multi_step.split("- **")[0]
  mesh = " ".join(_readme_section("Many devices: tensor and data parallelism").split())
  limits = mesh[mesh.index("Not on a mesh yet") :].split("Known limits")[0]
  for feature in ("`num_decode_steps > 1`", "prefix caching", "speculative decoding"):
    assert feature in limits, feature
