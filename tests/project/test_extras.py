"""The package's extras and the integrations without their framework installed.

pip 23.2 (the one Python 3.11 ships) looks an extra up exactly as it is typed, while setuptools
writes the package's extras in their normalised form (PEP 685): an extra is found by every pip
only when it is declared, and documented, normalised (``lm-eval``, not ``lm_eval``). Without
its framework an integration says which extra to install.
"""

from __future__ import annotations

import importlib
import re
import sys
import tomllib
from pathlib import Path

import pytest

import jaxengine.cli.main as cli
from jaxengine.integrations import EXTRAS, MissingExtraError, install_command

REPO = Path(__file__).resolve().parents[2]
#: Where install commands are written for users.
DOCUMENTED = [
  "README.md",
  "docs/**/*.md",
  "examples/**/*.py",
  "notebooks/*.ipynb",
  "jaxengine/**/*.py",
]
#: `jaxengine[x,y]` or `".[x]"` (a checkout), as pip reads them.
EXTRAS_IN_TEXT = re.compile(r"""(?:jaxengine|["']\.)\[([A-Za-z0-9_.,\- ]+)\]""")


def declared_extras() -> dict[str, list[str]]:
  with open(REPO / "pyproject.toml", "rb") as f:
    return tomllib.load(f)["project"]["optional-dependencies"]


def normalised(name: str) -> str:
  return re.sub(r"[-_.]+", "-", name).lower()


def test_extras_are_declared_in_normalised_form():
  extras = declared_extras()
  assert {"lm-eval", "eval", "tunix"} <= set(extras)
  for name, requirements in extras.items():
    assert name == normalised(name), f"extra {name!r} is found by pip 23.2 only as {name!r}"
    for requirement in requirements:  # an extra that includes another, `jaxengine[lm-eval]`
      for included in EXTRAS_IN_TEXT.findall(requirement):
        assert set(included.replace(" ", "").split(",")) <= set(extras), requirement


def test_install_commands_name_declared_extras():
  """Every `jaxengine[...]` / `".[...]"` in the README, docs, examples, notebooks and messages,
  and the commands the integrations print, name declared extras exactly as declared."""
  extras = set(declared_extras())
  texts = {
    str(path.relative_to(REPO)): path.read_text()
    for pattern in DOCUMENTED
    for path in REPO.glob(pattern)
  }
  texts |= {f"install_command({e!r})": install_command(e) for e in EXTRAS.values()}
  found = {
    (where, name)
    for where, text in texts.items()
    for match in EXTRAS_IN_TEXT.findall(text)
    for name in match.replace(" ", "").split(",")
  }
  assert {name for _, name in found} >= {"lm-eval", "tunix"}
  assert sorted((where, name) for where, name in found if name not in extras) == []


@pytest.fixture
def hide(monkeypatch):
  """`hide(package)`: imports of the package (and its submodules) fail, as when not installed;
  the integrations are imported afresh."""

  def hide_package(package: str) -> None:
    for name in [n for n in sys.modules if n == package or n.startswith(package + ".")]:
      monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, package, None)
    for name in [n for n in sys.modules if n.startswith("jaxengine.integrations.")]:
      monkeypatch.delitem(sys.modules, name)

  return hide_package


def test_eval_without_lm_eval_prints_the_install_command(hide, capsys):
  hide("lm_eval")
  assert cli.main(["eval", "--tasks", "hellaswag"]) == 2
  err = capsys.readouterr().err
  assert "lm-evaluation-harness" in err and 'pip install "jaxengine[lm-eval]"' in err
  with pytest.raises(ModuleNotFoundError, match=re.escape('pip install "jaxengine[lm-eval]"')):
    importlib.import_module("jaxengine.integrations.lm_eval")


@pytest.mark.parametrize(
  "module",
  ["tunix", "tunix_config", "tunix_weights", "tunix_placement", "tunix_sampling", "tunix_logprobs"],
)
def test_tunix_integration_without_tunix_names_the_extra(hide, module):
  hide("tunix")
  with pytest.raises(MissingExtraError, match=re.escape('pip install "jaxengine[tunix]"')):
    importlib.import_module(f"jaxengine.integrations.{module}")


def test_a_dependency_missing_inside_a_framework_is_reported_as_it_is():
  from jaxengine.integrations import missing_extra

  error = ModuleNotFoundError("No module named 'datasets'", name="datasets")
  assert missing_extra(error, "jaxengine.integrations.lm_eval") is error
