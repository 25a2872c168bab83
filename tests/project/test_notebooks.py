"""Every notebook in notebooks/ runs top to bottom without an error.

Each notebook is executed with nbclient in a fresh `python3` kernel (the interpreter running the
tests, so the installed jaxengine), with notebooks/ as the working directory and matplotlib's
non-interactive Agg backend. Notebooks assert their own claims (seeds reproduce, zero compiles in
steady state, exact distributions), so a wrong claim fails here too. The notebooks stored in the
repository carry no outputs; this test never writes them back.
"""

from __future__ import annotations

import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
kernelspec = pytest.importorskip("jupyter_client.kernelspec")

NOTEBOOKS_DIR = pathlib.Path(__file__).resolve().parents[2] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
KERNEL_NAME = "python3"
CELL_TIMEOUT_S = 300


@pytest.fixture
def kernel_name(tmp_path, monkeypatch) -> str:
  """`python3`, from the environment's kernelspecs or, failing that, a spec written for the test.

  ipykernel installs the `python3` spec into the environment (and jupyter_client falls back to
  ipykernel's native kernel when it is importable), so the fallback is only for unusual setups.
  jupyter_client runs a spec whose command is `python` with `sys.executable`, i.e. this interpreter.
  """
  if KERNEL_NAME not in kernelspec.KernelSpecManager().find_kernel_specs():
    from ipykernel.kernelspec import write_kernel_spec

    write_kernel_spec(tmp_path / "kernels" / KERNEL_NAME)
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
  return KERNEL_NAME


def test_notebooks_exist():
  assert NOTEBOOKS, f"no notebooks in {NOTEBOOKS_DIR}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebook_is_stored_without_outputs(path):
  notebook = nbformat.read(path, as_version=4)
  for cell in notebook.cells:
    if cell.cell_type == "code":
      assert not cell.outputs and cell.execution_count is None, (
        f"{path.name}: clear outputs and execution counts before committing"
      )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebook_runs(path, kernel_name, monkeypatch):
  monkeypatch.setenv("MPLBACKEND", "Agg")  # the kernel inherits the environment
  notebook = nbformat.read(path, as_version=4)
  client = nbclient.NotebookClient(
    notebook,
    kernel_name=kernel_name,
    timeout=CELL_TIMEOUT_S,
    resources={"metadata": {"path": str(NOTEBOOKS_DIR)}},  # cwd of the kernel
  )
  client.execute()
