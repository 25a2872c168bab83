"""The engine's steps export for CUDA with the Pallas GPU kernel, on this CPU machine, and
compile for an H100 through `jaxengine compile --topology h100` where the CUDA plugin is
installed (`jaxengine/aot/cuda.py`, `jaxengine/aot/compile.py`)."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import io
import json

import jax
import jax.numpy as jnp
import pytest

from jaxengine.aot.cuda import (
  CUDA_TARGETS,
  TRITON_CUSTOM_CALL,
  cuda_topology,
  export_for_cuda,
  is_cuda_topology,
  parse_cuda_topology,
)
from jaxengine.aot.executables import Executable, abstract_engine, engine_executables
from jaxengine.aot.topologies import larger_topology, topology
from jaxengine.cli.main import main
from jaxengine.engine_config import EngineConfig
from jaxengine.worker import device_steps

#: A tiny Llama (the sizes of tests/aot/test_compile.py's).
TINY_LLAMA = dict(
  architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128, hidden_size=64,
  intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
  max_position_embeddings=64, rms_norm_eps=1e-6,
)  # fmt: skip
#: The smallest engine with every step: two rows, a verify step of one draft, a 4-step loop.
SMALL = dict(max_num_reqs=2, max_model_len=32, max_num_batched_tokens=4)
EVERY_STEP = dict(SMALL, num_decode_steps=4,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 1})  # fmt: skip
#: The steps that read the KV cache (the attention backend's kernels).
WITH_ATTENTION = ("ragged_step", "verify_step", "decode_steps")


def _cuda_plugin() -> bool:
  return importlib.util.find_spec("jax_plugins") is not None and (
    importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
  )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
  root = tmp_path_factory.mktemp("tiny_llama")
  (root / "config.json").write_text(json.dumps(TINY_LLAMA))
  return str(root)


def _executables(model_dir, backend="pallas_gpu", kv_dtype="auto", device=None) -> list[Executable]:
  """The first executable of each step `worker/precompile.py` compiles for the tiny Llama
  (`aot/executables.py`: the plain and the verify step's model part and sampler, the decode
  loop), bfloat16, from abstract shapes alone, on `device` (default: the CPU's)."""
  device = jax.devices("cpu")[0] if device is None else device
  config = EngineConfig(attention_backend=backend, kv_cache_dtype=kv_dtype, **EVERY_STEP)
  engine = abstract_engine(model_dir, config, [device], jnp.bfloat16, platform="gpu")
  engine.set_num_blocks(8)
  first: dict[str, Executable] = {}
  for executable in engine_executables(engine):
    first.setdefault(executable.name, executable)
  return list(first.values())


def _attention_steps(model_dir, backend, kv_dtype="auto") -> list[Executable]:
  return [e for e in _executables(model_dir, backend, kv_dtype) if e.name in WITH_ATTENTION]


def test_every_step_exports_for_cuda_with_the_pallas_kernel_lowered_to_triton(model_dir):
  """The steps of the "pallas_gpu" backend that read the cache (plain, verify, decode loop)
  carry the Pallas paged decode kernel as a Triton custom call (bfloat16 pages and fp8 pages
  with their scales); the samplers have none, and the XLA backend's steps none: the kernel
  comes from the backend."""
  reports = export_for_cuda(_executables(model_dir))
  by_name = {r.name: r for r in reports}
  assert len(reports) == len(by_name) == len(dataclasses.fields(device_steps.DeviceSteps))
  for r in reports:
    if r.name in WITH_ATTENTION:
      assert TRITON_CUSTOM_CALL in r.custom_calls
      (kernel,) = r.triton_kernels
      assert kernel.startswith("paged_attention")
    else:
      assert r.triton_kernels == ()
  assert all(r.module_bytes > 1000 and r.seconds > 0 for r in reports)

  fp8 = export_for_cuda(_attention_steps(model_dir, "pallas_gpu", "fp8"))
  assert all(r.triton_kernels == by_name[r.name].triton_kernels for r in fp8)
  # the fp8 pages are other arguments (float8 pages, float32 scales): another module
  assert all(r.module_bytes != by_name[r.name].module_bytes for r in fp8)

  xla = export_for_cuda(_attention_steps(model_dir, "xla"))
  assert all(TRITON_CUSTOM_CALL not in r.custom_calls and not r.triton_kernels for r in xla)


def test_a_lowering_error_names_the_executable():
  broken = Executable("broken", "rows=1", jax.jit(lambda x: x @ x), (jax.ShapeDtypeStruct(
    (2, 3), jnp.float32),), {})  # fmt: skip
  with pytest.raises(TypeError) as error:
    export_for_cuda([broken])
  assert "exporting broken (rows=1) for cuda" in error.value.__notes__


@pytest.mark.parametrize(
  "topology, match",
  [("v100", "unknown GPU 'v100'.*'h100'"), ("h100:0", "positive"), ("h100:x", "positive")],
)
def test_a_cuda_topology_is_refused_by_name_before_any_plugin(topology, match):
  with pytest.raises(ValueError, match=match):
    cuda_topology(topology)


def test_cuda_topologies_parse():
  """A GPU count is the topology's chips, and a GPU is a chip of the one table the memory plan
  reads (`aot/topologies.py`): its memory and bandwidth, and a larger topology of it."""
  assert parse_cuda_topology("H100")[0].compute_capability == (9, 0)
  assert parse_cuda_topology("a100:8")[1] == 8
  assert is_cuda_topology("h100:4") and not is_cuda_topology("v5e:2x2")
  spec = topology("h100:4")
  assert spec.num_chips == 4 and spec.chip is CUDA_TARGETS["h100"]
  assert spec.chip.hbm_bytes > 79 * 2**30 and spec.chip.hbm_bandwidth == 3.35e12
  assert larger_topology(spec.chip, 8) == "h100:8" and larger_topology(spec.chip, 16) is None
  assert larger_topology(topology("v5e:1x1").chip, 4) == "v5e:2x2"
  with pytest.raises(ValueError, match=r"unknown topology 'v9:1x1'.*h100\[:N\]"):
    topology("v9:1x1")


def test_a_deviceless_cuda_compile_or_the_plugin_it_needs(model_dir):
  """With the CUDA plugin installed the steps compile for an H100 without one (XLA:GPU, Triton
  to PTX, ptxas); without it the topology is refused naming the wheels."""
  if not _cuda_plugin():
    with pytest.raises(RuntimeError, match=r"jax-cuda12-plugin==.*nvidia-cuda-nvcc-cu12"):
      cuda_topology("h100")
    return
  (device,) = cuda_topology("h100").devices
  assert device.device_kind == "NVIDIA H100 80GB HBM3"
  (ragged,) = [e for e in _executables(model_dir, device=device) if e.name == "ragged_step"]
  compiled = ragged.jitted.lower(*ragged.args, **ragged.kwargs).compile()
  assert compiled.as_text().count(f'custom_call_target="{TRITON_CUSTOM_CALL}"') >= 1
  assert compiled.memory_analysis().argument_size_in_bytes > 0


def _compile_cli(argv: list[str]) -> tuple[int, str, str]:
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
    code = main(["compile", *argv])
  return code, out.getvalue(), err.getvalue()


def test_jaxengine_compile_for_an_h100_or_the_wheels_it_needs(model_dir):
  """``jaxengine compile MODEL --topology h100``: without the CUDA plugin, exit 2 naming the
  wheels; with it, the tiny Llama's precompile set (one row, one token: the ragged step with
  and without prompt logprobs, the sampler) compiles for an H100 with the Pallas GPU kernel,
  its memory planned on 80 GB and its decode estimated from bytes (no cost analysis)."""
  code, out, err = _compile_cli(
    [model_dir, "--topology", "h100", "--json", "--max-num-reqs", "1", "--max-model-len", "16",
     "--max-num-batched-tokens", "1"]
  )  # fmt: skip
  if not _cuda_plugin():
    assert code == 2 and out == ""
    assert "topology='h100' needs the CUDA PJRT plugin" in err
    assert f"jax-cuda12-plugin=={jax.__version__}" in err and "nvidia-cuda-nvcc-cu12" in err
    return
  assert code == 0, err
  report = json.loads(out)
  assert report["error"] is None and report["fits"]
  assert report["device_kind"] == "NVIDIA H100 80GB HBM3" and report["num_devices"] == 1
  assert report["hbm_bytes_per_device"] == CUDA_TARGETS["h100"].hbm_bytes
  assert report["attention_backend"].startswith("pallas GPU paged decode kernel")
  assert [(e["name"], e["shape"]) for e in report["executables"]] == [
    ("ragged_step", "tokens=1 rows=1"),
    ("sample", "rows=1"),
    ("ragged_step", "tokens=1 rows=1 prompt_logprobs=21"),
  ]
  for e in report["executables"]:
    assert e["compile_s"] > 0 and e["flops"] is None and e["estimated_s"] is None
    assert e["estimate_source"].startswith("none")
  (decode,) = report["decode"]
  assert decode["estimated_step_s"] == decode["memory_floor_s"] > 0
  assert decode["flops_floor_s"] is None and decode["method"].startswith("memory floor")


def test_jaxengine_compile_export_only_needs_no_plugin(model_dir):
  """``--export-only`` exports the same executables for CUDA on this CPU (plugin or not): the
  ragged step carries the Pallas kernel as Triton, the sampler none; a TPU topology is refused."""
  small = ["--max-num-reqs", "1", "--max-model-len", "16", "--max-num-batched-tokens", "1"]
  code, out, err = _compile_cli(
    [model_dir, "--topology", "h100", "--export-only", "--json", *small]
  )
  assert code == 0, err
  report = json.loads(out)
  assert report["fits"] and report["per_device_bytes"]["temp"] == 0
  kernels = {(e["name"], e["shape"]): e["triton_kernels"] for e in report["executables"]}
  assert kernels.keys() == {("ragged_step", "tokens=1 rows=1"), ("sample", "rows=1"),
                            ("ragged_step", "tokens=1 rows=1 prompt_logprobs=21")}  # fmt: skip
  assert kernels[("sample", "rows=1")] == []
  assert kernels[("ragged_step", "tokens=1 rows=1")][0].startswith("paged_attention")
  assert "exported ragged_step tokens=1 rows=1 in" in err
  code, _, err = _compile_cli([model_dir, "--topology", "v5e:1x1", "--export-only", *small])
  assert code == 2 and "topology='v5e:1x1' is not a GPU" in err
