"""The package's layout keeps its dependencies pointing one way, with no import cycle, and no
module reaches into another's private state.

Checked on the source (every `import` statement, type-only ones included), so a violation fails
here before it becomes a circular-import error at run time. A module that needs something another
keeps private asks for a public accessor instead (`InputBatch.run_step`, not `batch._state`): that
is what keeps a module's invariants its own business, whatever its length.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "jaxengine"

# What each layer may not import: the core never reaches up to the model, engine or front ends,
# and the model knows nothing of sampling or the engine.
FORBIDDEN = {
  "jaxengine.params": ("jaxengine.batch", "jaxengine.sample", "jaxengine.engine",
                       "jaxengine.models", "jaxengine.entrypoints", "jaxengine.cli"),
  "jaxengine.reductions": ("jaxengine.batch", "jaxengine.sample", "jaxengine.engine",
                           "jaxengine.models", "jaxengine.entrypoints", "jaxengine.cli"),
  "jaxengine.config": ("jaxengine.batch", "jaxengine.sample", "jaxengine.engine",
                       "jaxengine.models", "jaxengine.entrypoints", "jaxengine.cli"),
  "jaxengine.sample": ("jaxengine.batch", "jaxengine.engine", "jaxengine.models",
                       "jaxengine.entrypoints", "jaxengine.cli"),
  "jaxengine.batch": ("jaxengine.engine", "jaxengine.models", "jaxengine.entrypoints", "jaxengine.cli"),
  "jaxengine.models": ("jaxengine.sample", "jaxengine.batch", "jaxengine.engine",
                       "jaxengine.entrypoints", "jaxengine.cli"),
  # The engine's rooms, in the order their dependencies point: core (host bookkeeping), then
  # spec_decode (drafts), then worker (the device steps), then engine (the lifecycle).
  "jaxengine.core": ("jaxengine.spec_decode", "jaxengine.worker", "jaxengine.engine",
                     "jaxengine.engine_config", "jaxengine.models", "jaxengine.sample",
                     "jaxengine.entrypoints", "jaxengine.cli"),
  "jaxengine.spec_decode": ("jaxengine.worker", "jaxengine.engine", "jaxengine.engine_config",
                            "jaxengine.models", "jaxengine.entrypoints", "jaxengine.cli"),
  "jaxengine.engine_config": ("jaxengine.core", "jaxengine.worker", "jaxengine.engine",
                              "jaxengine.entrypoints", "jaxengine.cli"),
  "jaxengine.worker": ("jaxengine.engine", "jaxengine.spec_decode.policy",
                       "jaxengine.spec_decode.speculation", "jaxengine.entrypoints", "jaxengine.cli"),
  "jaxengine.engine": ("jaxengine.entrypoints", "jaxengine.cli"),
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


def _index(package: str) -> list[str]:
  """The modules a package's `__init__` docstring lists (lines starting `name.py`), in order."""
  init = PACKAGE / package / "__init__.py"
  docstring = ast.get_docstring(ast.parse(init.read_text())) or ""
  words = [line.split()[0] for line in docstring.splitlines() if line.strip()]
  return [word for word in words if word.endswith(".py")]


@pytest.mark.parametrize(
  "package", ["batch", "core", "engine", "integrations", "sample", "spec_decode", "worker"]
)
def test_each_package_index_lists_every_module_once(package):
  modules = sorted(p.name for p in (PACKAGE / package).glob("*.py") if p.name != "__init__.py")
  assert sorted(_index(package)) == modules


def test_the_sample_index_is_in_dependency_order():
  order = [f"jaxengine.sample.{name.removesuffix('.py')}" for name in _index("sample")]
  graph = _graph()
  for position, module in enumerate(order):
    later = set(order[position + 1 :])
    assert not graph[module] & later, f"{module} imports {sorted(graph[module] & later)}"


def _is_private(name: str) -> bool:
  """`_name` or `__name` (Python's private conventions), but not a dunder like `__init__`."""
  return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _class_private_names(cls: ast.ClassDef) -> set[str]:
  """The private names a class defines: its methods, class-level assignments and every
  `self._name = ...` / `cls._name = ...` in its body."""
  names = set()
  for node in ast.walk(cls):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      names.add(node.name)
    elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
      names.add(node.id)
    elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
      names.add(node.target.id)
    elif (
      isinstance(node, ast.Attribute)
      and isinstance(node.ctx, ast.Store)
      and isinstance(node.value, ast.Name)
      and node.value.id in ("self", "cls")
    ):
      names.add(node.attr)
  return {name for name in names if _is_private(name)}


class _PrivateAccesses(ast.NodeVisitor):
  """Collects reads and writes of another module's private names (see `private_accesses`)."""

  def __init__(self, source: str) -> None:
    self.lines = source.splitlines()
    self.owned: list[set[str]] = []  # private names of each enclosing class, innermost last
    self.found: list[tuple[int, str]] = []

  def report(self, node: ast.AST, what: str) -> None:
    line = self.lines[node.lineno - 1].strip() if node.lineno <= len(self.lines) else ""
    self.found.append((node.lineno, f"{what}: {line}"))

  def visit_ClassDef(self, node: ast.ClassDef) -> None:
    self.owned.append(_class_private_names(node))
    self.generic_visit(node)
    self.owned.pop()

  def visit_Attribute(self, node: ast.Attribute) -> None:
    if _is_private(node.attr):
      is_own = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
      # Another instance of the class that defines the name (`other._x` in `__eq__`, `batch._init`
      # in a classmethod) is the class's own business.
      is_peer = any(node.attr in names for names in self.owned)
      if not (is_own or is_peer):
        access = "writes" if isinstance(node.ctx, ast.Store) else "reads"
        self.report(node, f"{access} .{node.attr}")
    self.generic_visit(node)

  def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
    module = node.module or ""
    if any(_is_private(part) for part in module.split(".")):
      self.report(node, f"imports from the private module {module}")
    for alias in node.names:
      if _is_private(alias.name):
        self.report(node, f"imports the private name {alias.name}")
    self.generic_visit(node)

  def visit_Import(self, node: ast.Import) -> None:
    for alias in node.names:
      if any(_is_private(part) for part in alias.name.split(".")):
        self.report(node, f"imports the private module {alias.name}")
    self.generic_visit(node)

  def visit_Call(self, node: ast.Call) -> None:
    # getattr(obj, "_name") / setattr / hasattr / delattr: the same access spelled as a string.
    is_attr_call = isinstance(node.func, ast.Name) and node.func.id in (
      "getattr",
      "setattr",
      "hasattr",
      "delattr",
    )
    if is_attr_call and len(node.args) >= 2:
      name = node.args[1]
      if isinstance(name, ast.Constant) and isinstance(name.value, str):
        target = node.args[0]
        is_own = isinstance(target, ast.Name) and target.id in ("self", "cls")
        if _is_private(name.value) and not is_own:
          self.report(node, f"{node.func.id} {name.value!r}")
    self.generic_visit(node)


def private_accesses(source: str) -> list[tuple[int, str]]:
  """`(line, what)` for each place `source` reaches into another module's private state.

  A name is private when it starts with `_` (dunders excepted). Flagged: `obj._name` read or
  written where `obj` is not `self`/`cls` and no enclosing class defines `_name`; the same
  through `getattr`/`setattr`/`hasattr`/`delattr` with a constant name; `from x import _name`;
  and importing a private module (`jax._src`, `pkg._impl`).
  """
  visitor = _PrivateAccesses(source)
  visitor.visit(ast.parse(source))
  return visitor.found


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: _module_name(p))
def test_no_module_reaches_into_another_modules_private_state(path):
  violations = [f"{path.name}:{line}: {what}" for line, what in private_accesses(path.read_text())]
  assert not violations, "\n".join(["private access across modules:", *violations])


PLANTED = """
from jaxengine.batch.input_batch import _helper


class Friend:
  def __init__(self):
    self._mine = 0

  def __eq__(self, other):
    return self._mine == other._mine  # another instance of this class: allowed


def run(batch, step_fn):
  batch._state, output = step_fn(batch._state)
  return getattr(batch, "_metadata"), output
"""


def test_the_private_access_check_catches_a_planted_access():
  found = private_accesses(PLANTED)
  assert [line for line, _ in found] == [2, 14, 14, 15], found
  whats = [what for _, what in found]
  assert whats[0].startswith("imports the private name _helper")
  assert whats[1].startswith("writes ._state: batch._state, output")
  assert whats[2].startswith("reads ._state")
  assert whats[3].startswith("getattr '_metadata'")
  # Removing the planted accesses leaves nothing to report.
  clean = PLANTED.replace("batch._state", "batch.state").replace('"_metadata"', '"metadata"')
  assert private_accesses(clean.replace("import _helper", "import helper")) == []


def _doc_section(page: str, title: str) -> str:
  """The `## title` section of `docs/page`."""
  text = (Path(__file__).resolve().parents[2] / "docs" / page).read_text()
  start = text.index(f"\n## {title}\n")
  end = text.find("\n## ", start + 1)
  return text[start:end]


def test_docs_state_the_top_p_tie_rule_and_what_runs_on_a_mesh():
  """Documented differences a new user hit: top-p keeps every token tied at the cut (vLLM's sort
  keeps fewer); the parallelism page says prefix caching, speculative decoding and several
  decode steps per dispatch run on a mesh, and that each data-parallel group has its own pool of
  pages."""
  docs = PACKAGE.parent / "docs"
  differences = " ".join((docs / "differences_from_vllm.md").read_text().split())
  assert "Top-p keeps ties" in differences and "top_p=0.5" in differences
  mesh = " ".join((docs / "parallelism.md").read_text().split())
  assert "Prefix caching, speculative decoding and `num_decode_steps > 1` run on a mesh" in mesh
  assert "Data parallelism: one engine core per group" in mesh
  assert "its own pool of KV-cache pages" in mesh


def test_docs_cite_only_files_in_this_repository():
  """The package, tests, README, docs and notebooks point users at files a clone has
  (`docs/sampling.md`, README sections), never at the project's private spec folder."""
  root = PACKAGE.parent
  texts = [*PACKAGE.rglob("*.py"), *(root / "tests").glob("*.py"), root / "README.md"]
  texts += [*(root / "docs").glob("*.md"), *(root / "notebooks").glob("*.ipynb")]
  outside = ("shared/spec", "behaviour.md", "design.md", "style.md", "shared/fixtures")
  this_test = Path(__file__).resolve()
  found = [
    f"{path.relative_to(root)} mentions {name}"
    for path in texts
    if path.resolve() != this_test
    for name in outside
    if name in path.read_text()
  ]
  assert not found, found


def test_readme_layout_table_names_every_module():
  """Every module of the package has a row in the layout table of docs/architecture.md (renamed and new
  modules included), and the table names no module that is gone."""
  section = _doc_section(
    "architecture.md", "Layout: one module per job, dependencies pointing one way"
  )
  rows = [line for line in section.splitlines() if line.startswith("| `")]
  named = {name for row in rows for name in re.findall(r"`([\w/]+\.py)`", row.split(" | ")[0])}
  modules = {
    str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py") if path.name != "__init__.py"
  }
  assert sorted(modules - named) == [], "missing from the layout table of docs/architecture.md"
  assert sorted(named - modules) == [], (
    "in the layout table of docs/architecture.md but not in the package"
  )
