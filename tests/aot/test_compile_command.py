"""`jaxengine compile`'s handling of what a user gives it, on paths that stop before any compile
(no libtpu in this process): config.json fields of the wrong type, the model argument (a
directory, its config.json, a hub id offline), vLLM's option names and ``dtype="auto"``, the
progress lines, ``--list``, Ctrl-C, and the environment that quiets a deviceless libtpu.

GPU topologies with ``--export-only`` build the engine on this machine's CPU devices, so the
executables are listed (and, with the export replaced, "compiled") without a plugin or libtpu.
"""

from __future__ import annotations

import contextlib
import io
import json
import socket

import jax.numpy as jnp
import pytest

from jaxengine.aot import compile as aot_compile
from jaxengine.aot import compile_for_topology
from jaxengine.aot.model_source import config_directory
from jaxengine.cli.compile_command import quiet_libtpu_environ
from jaxengine.cli.main import main
from jaxengine.models.registry import hf_architecture

#: A tiny Llama (the sizes of tests/aot/test_compile.py's).
TINY_LLAMA = dict(
  architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128, hidden_size=64,
  intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
  max_position_embeddings=64, rms_norm_eps=1e-6,
)  # fmt: skip
#: A tiny Gemma 2 (the sizes of tests/aot/test_compile.py's).
TINY_GEMMA = dict(
  TINY_LLAMA, architectures=["Gemma2ForCausalLM"], model_type="gemma2", head_dim=16,
  query_pre_attn_scalar=16, sliding_window=16, hidden_activation="gelu_pytorch_tanh",
)  # fmt: skip
#: One row, one token: the ragged step with and without prompt logprobs, and the sampler.
SMALL = ["--max-num-reqs", "1", "--max-model-len", "16", "--max-num-batched-tokens", "1"]
ON_CPU = ["--topology", "h100", "--export-only"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
  root = tmp_path_factory.mktemp("tiny_llama")
  (root / "config.json").write_text(json.dumps(TINY_LLAMA))
  return root


@pytest.fixture(autouse=True)
def tpu_environ(monkeypatch):
  """The variables `quiet_libtpu_environ` sets, as the user left them (restored afterwards)."""
  monkeypatch.delenv("TPU_WORKER_HOSTNAMES", raising=False)
  monkeypatch.delenv("TPU_ACCELERATOR_TYPE", raising=False)


def _compile_cli(argv) -> tuple[int, str, str]:
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
    code = main(["compile", *argv])
  return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize(
  "config, field, value",
  [
    (TINY_LLAMA, "num_hidden_layers", None),
    (TINY_LLAMA, "num_hidden_layers", "thirty"),
    (TINY_LLAMA, "hidden_size", "576"),
    (TINY_LLAMA, "tie_word_embeddings", "yes"),
    (TINY_LLAMA, "rms_norm_eps", "1e-6"),
    (TINY_GEMMA, "num_hidden_layers", None),
    (TINY_GEMMA, "sliding_window", "16"),
  ],
)
def test_a_config_field_of_the_wrong_type_is_refused_naming_it(tmp_path, config, field, value):
  """Both readers of config.json (`LLM`'s loading, through the registry, and the compile) refuse
  a field of the wrong JSON type with a ValueError naming the field and value; the command
  exits 2 (bad input), not 1 ("does not fit"), with one line and no traceback."""
  hf = dict(config, **{field: value})
  message = f"config.json field {field!r} must be"
  with pytest.raises(ValueError, match=message) as raised:
    hf_architecture(hf).read_config(hf)
  assert repr(value) in str(raised.value)
  (tmp_path / "config.json").write_text(json.dumps(hf))
  code, out, err = _compile_cli([str(tmp_path), "--topology", "v5e:1x1"])
  assert (code, out) == (2, "")
  assert err == f"jaxengine compile: {raised.value}\n"


def test_the_model_argument_a_missing_directory_or_the_config_file(model_dir, tmp_path):
  """A missing directory is said not to exist; config.json itself stands for its directory; a
  directory without config.json, or another file, is named."""
  code, _, err = _compile_cli(["nonexistent_dir", "--topology", "v5e:1x1"])
  assert code == 2 and "the model directory 'nonexistent_dir' does not exist" in err
  assert config_directory(model_dir / "config.json") == str(model_dir)
  with pytest.raises(FileNotFoundError, match=r"has no config\.json"):
    config_directory(tmp_path)
  (tmp_path / "model.safetensors").write_text("")
  with pytest.raises(FileNotFoundError, match=r"pass the directory that holds config\.json"):
    config_directory(tmp_path / "model.safetensors")
  code, out, err = _compile_cli([str(model_dir / "config.json"), *ON_CPU, "--list", *SMALL])
  assert code == 0, err
  assert out.startswith("3 executables for h100 (none compiled):")


def test_a_hub_id_offline_says_to_pass_a_local_directory(tmp_path, monkeypatch):
  """A hub id is fetched as its config.json alone; offline and not cached, the message names
  the id and says to pass a local directory with config.json (and no connection is tried)."""
  import huggingface_hub.constants

  monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
  monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  attempts = []
  monkeypatch.setattr(socket.socket, "connect", lambda self, address: attempts.append(address))
  monkeypatch.chdir(tmp_path)
  code, out, err = _compile_cli(["Qwen/Qwen2.5-0.5B", "--topology", "v5e:1x1"])
  assert (code, out, attempts) == (2, "", [])
  assert "'Qwen/Qwen2.5-0.5B' is not a local directory" in err
  assert "pass a local directory that holds the model's config.json" in err


def test_vllm_option_names_and_dtype_auto_as_llm_takes_them(model_dir):
  """`compile_for_topology` takes vLLM's `max_logprobs` (the prompt-logprobs step is sized by
  it) and `max_num_seqs`, and ``dtype="auto"`` and ``"half"`` as `LLM` does; an unknown keyword
  is a TypeError naming it, raised before any device is described."""
  shapes = []

  def record(executable) -> bool:
    shapes.append(f"{executable.name} {executable.shape}")
    return False

  report = compile_for_topology(
    model_dir, "h100", export_only=True, dtype="auto", max_logprobs=5, max_num_seqs=1,
    max_model_len=16, max_num_batched_tokens=1, select=record,
  )  # fmt: skip
  assert report["fits"] and report["executables"] == []
  assert shapes[-1] == "ragged_step tokens=1 rows=1 prompt_logprobs=6", shapes
  assert shapes[0] == "ragged_step tokens=1 rows=1"
  assert aot_compile._weights_dtype("half", {}) == aot_compile._weights_dtype("auto", {})
  assert aot_compile._weights_dtype("auto", {"torch_dtype": "float32"}) == jnp.float32
  with pytest.raises(TypeError, match="unexpected keyword argument 'max_num_seq'"):
    compile_for_topology(model_dir, "v5e:1x1", max_num_seq=4)
  with pytest.raises(ValueError, match=r"dtype must be one of .*'auto'.*got 'int8'"):
    compile_for_topology(model_dir, "v5e:1x1", dtype="int8")


def test_progress_counts_the_executables_and_ctrl_c_exits_130(model_dir, monkeypatch):
  """The count comes first, then ``[k/N]`` per executable; Ctrl-C during the second exits 130
  with one line saying how many compiled, no traceback. (The export is replaced: the test is of
  the command's bookkeeping, not of a compile.)"""
  calls = []

  def export(executable):
    calls.append(executable)
    if len(calls) == 2:
      raise KeyboardInterrupt
    return dict(name=executable.name, shape=executable.shape, compile_s=1.25, triton_kernels=[])

  monkeypatch.setattr(aot_compile, "export_executable", export)
  code, out, err = _compile_cli([str(model_dir), *ON_CPU, *SMALL])
  assert (code, out) == (130, "")
  assert err.splitlines() == [
    "compiling 3 executables for h100 ...",
    "[1/3] exported ragged_step tokens=1 rows=1 in 1.2 s",
    "jaxengine compile: interrupted after 1 of 3 executables",
  ]


def test_list_prints_every_executable_and_compiles_none(model_dir, monkeypatch):
  """``--list`` names each executable, the prompt-logprobs variants included, compiling none."""
  monkeypatch.setattr(aot_compile, "export_executable", pytest.fail)
  code, out, err = _compile_cli([str(model_dir), *ON_CPU, "--list", *SMALL])
  assert code == 0, err
  assert out.splitlines() == [
    "3 executables for h100 (none compiled):",
    "  ragged_step tokens=1 rows=1",
    "  sample rows=1",
    "  ragged_step tokens=1 rows=1 prompt_logprobs=21",
  ]


def test_quiet_libtpu_environ_fills_only_what_the_user_left_unset():
  """A TPU topology gets libtpu's worker hostname and accelerator type (its chips, or cores on
  v4 and v5p), a value the user set is kept, and a GPU topology changes nothing."""
  environ = {"TPU_WORKER_HOSTNAMES": "10.0.0.2"}
  quiet_libtpu_environ("v6e:2x2", environ)
  assert environ == {"TPU_WORKER_HOSTNAMES": "10.0.0.2", "TPU_ACCELERATOR_TYPE": "v6e-4"}
  environ = {}
  quiet_libtpu_environ("v5p:2x2x1", environ)
  assert environ == {"TPU_WORKER_HOSTNAMES": "localhost", "TPU_ACCELERATOR_TYPE": "v5p-8"}
  environ = {}
  quiet_libtpu_environ("h100:4", environ)
  assert environ == {}
