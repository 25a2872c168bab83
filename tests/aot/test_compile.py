"""`jaxengine compile` / `jaxengine.aot.compile_for_topology`: the engine compiled for Cloud TPU
v5e topologies with libtpu (no TPU), from config.json alone, and its memory per chip.

One subprocess (libtpu's compiles, kept out of the test process) compiles SmolLM2's config and a
tiny config of every family (the sizes of tests/helpers/hf_checkpoints.py and
tests/helpers/moe_checkpoints.py) for one v5e chip and for four with tensor parallelism, the
whole precompile set of one tiny engine, plans memory without compiling (tensor and data
parallelism, fp8 pages, a sliding-window model's longest context, fixed pools, the advice for a
model that does not fit) and runs the CLI's failing cases; the tests read its reports.
"""

from __future__ import annotations

import json
import os

import pytest
from subprocess_utils import run_python

from jaxengine.aot.topologies import topology

_TINY = dict(
  vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
)  # fmt: skip
_MOE = dict(
  vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
  max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False,
)  # fmt: skip
FAMILIES = {
  "llama": dict(_TINY, architectures=["LlamaForCausalLM"], model_type="llama"),
  "qwen2": dict(_TINY, architectures=["Qwen2ForCausalLM"], model_type="qwen2"),
  "qwen3": dict(_TINY, architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=16),
  "gemma2": dict(
    _TINY, architectures=["Gemma2ForCausalLM"], model_type="gemma2", head_dim=16,
    num_hidden_layers=4,  # two KV cache groups (window, full) of two layers each
    query_pre_attn_scalar=16, sliding_window=16, attn_logit_softcapping=50.0,
    final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh",
  ),
  "qwen3_moe": dict(
    _MOE, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_hidden_layers=3,
    intermediate_size=48, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
    decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=False,
  ),
  "mixtral": dict(
    _MOE, architectures=["MixtralForCausalLM"], model_type="mixtral", num_hidden_layers=2,
    intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
  ),
  "gemma4": dict(  # every switch: tests/models/test_gemma4.py's "all" layout
    _TINY, architectures=["Gemma4ForCausalLM"], model_type="gemma4_text", num_hidden_layers=5,
    head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
    sliding_window=16, layer_types=["sliding_attention", "full_attention", "sliding_attention",
    "sliding_attention", "full_attention"], vocab_size_per_layer_input=128,
    hidden_size_per_layer_input=8, num_kv_shared_layers=2, enable_moe_block=True, num_experts=4,
    top_k_experts=2, moe_intermediate_size=16, use_double_wide_mlp=True,
    final_logit_softcapping=30.0,
  ),
  "qwen3_5": dict(  # the hybrid, 6 layers: one group of three linear and one full, two after
    _TINY, architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", num_hidden_layers=6,
    head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=4,
    linear_num_value_heads=4, full_attention_interval=4,
  ),
}  # fmt: skip
#: A tiny model at a head size every TPU kernel tiles (128): its whole precompile set compiles.
WHOLE_SET = dict(_TINY, architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=128)
#: Llama-3.1-8B's sizes (bfloat16 weights: 15 GiB): the CLI's refusal on one 16 GiB chip, and
#: the plans over four.
LLAMA_8B = dict(
  architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
  intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
  max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
)  # fmt: skip

SCRIPT = r"""
import contextlib, io, json, os, sys
from jaxengine.cli.compile_command import quiet_libtpu_environ
quiet_libtpu_environ("v5e:1x1", os.environ)  # libtpu's harmless host-bounds and hostname errors
from jaxengine.aot import compile_for_topology
from jaxengine.cli.main import main

root, = sys.argv[1:]
small = dict(max_num_reqs=1, max_model_len=16, max_num_batched_tokens=2)
decode = lambda e: e.name == "ragged_step" and e.shape == "tokens=1 rows=1"
reports = {}
for name in sorted(os.listdir(root)):
  path = os.path.join(root, name)
  if name in ("whole_set", "llama_8b", "moe_128", "gemma2_long"):
    continue
  reports[name + "/v5e:1x1"] = compile_for_topology(path, "v5e:1x1", select=decode, **small)
  tp = 3 if name == "smollm2" else 4  # SmolLM2's 9 heads split over 3 of the 4 chips
  reports[name + "/v5e:2x2"] = compile_for_topology(
    path, "v5e:2x2", tensor_parallel_size=tp, select=decode, **small)
reports["whole_set"] = compile_for_topology(os.path.join(root, "whole_set"), "v5e:1x1", **small)
from jaxengine.aot.compile import target_device
from jaxengine.aot.topologies import topology_devices
from jaxengine.aot.executables import abstract_engine, engine_executables
from jaxengine.engine_config import EngineConfig
import jax.numpy as jnp
device = topology_devices("v5e:1x1")[0]
moe = abstract_engine(os.path.join(root, "moe_128"), EngineConfig(**small), [device], jnp.bfloat16)
moe.set_num_blocks(4)
step = next(engine_executables(moe))
with target_device(device):
  reports["moe_hlo"] = step.jitted.lower(*step.args, **step.kwargs).as_text()
plan = dict(select=lambda e: False, max_num_reqs=4, max_model_len=4096)
llama, smollm2 = os.path.join(root, "llama_8b"), os.path.join(root, "smollm2")
reports["plan/tp1"] = compile_for_topology(llama, "v5e:2x2", **plan)
plan.update(tensor_parallel_size=4)
reports["plan/tp4"] = compile_for_topology(llama, "v5e:2x2", **plan)
reports["plan/fp8"] = compile_for_topology(llama, "v5e:2x2", kv_cache_dtype="fp8", **plan)
# Plans alone (nothing compiled): a sliding-window model's longest context, fixed pools, the
# advice's tensor-parallel sizes, data parallelism's chips.
window = os.path.join(root, "gemma2_long")
plan = dict(select=lambda e: False, max_num_reqs=1, gpu_memory_utilization=0.001)
reports["window/long"] = long = compile_for_topology(window, "v5e:1x1", **plan)
fit = long["kv_cache"]["max_model_len_fit"]
for name, length in (("fit", fit), ("next", fit + 16)):
  reports["window/" + name] = compile_for_topology(window, "v5e:1x1", max_model_len=length, **plan)
plan = dict(select=lambda e: False, max_num_reqs=1, max_model_len=512)
reports["pool/huge"] = compile_for_topology(smollm2, "v5e:1x1", num_kv_blocks=10**7, **plan)
reports["pool/bytes"] = compile_for_topology(
  smollm2, "v5e:1x1", kv_cache_memory_bytes=1 << 36, **plan)
most = int(reports["pool/huge"]["error"].split("--num-kv-blocks ")[1].split(",")[0])
reports["pool/most"] = compile_for_topology(smollm2, "v5e:1x1", num_kv_blocks=most, **plan)
reports["pool/small"] = compile_for_topology(
  smollm2, "v5e:1x1", **dict(plan, max_model_len=4096, num_kv_blocks=3))
reports["heads/9"] = compile_for_topology(
  smollm2, "v5e:1x1", **dict(plan, max_model_len=None, gpu_memory_utilization=0.02))
reports["plan/tp2dp2"] = compile_for_topology(
  os.path.join(root, "llama"), "v5e:2x2", tensor_parallel_size=2, data_parallel_size=2,
  **dict(plan, max_num_reqs=2, max_model_len=64))
for case, argv in {
  "too_big": [os.path.join(root, "llama_8b"), "--topology", "v5e:1x1", "--max-model-len", "4096"],
  "unknown": [smollm2, "--topology", "v9:1x1"],
}.items():
  err = io.StringIO()
  with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
    try:
      code = main(["compile", *argv])
    except SystemExit as exit:
      code = exit.code
  reports["cli/" + case] = {"code": code, "stderr": err.getvalue()}
print(json.dumps(reports))
"""


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict:
  root = tmp_path_factory.mktemp("configs")
  with open(os.path.join(os.path.dirname(__file__), "..", "fixtures", "smollm2_config.json")) as f:
    smollm2 = json.load(f)
  moe_128 = dict(FAMILIES["mixtral"], head_dim=128)
  # Gemma 2's layout with a long limit: a long request's window layers hold their window only.
  gemma2_long = dict(FAMILIES["gemma2"], max_position_embeddings=1 << 17)
  configs = {**FAMILIES, "smollm2": smollm2, "whole_set": WHOLE_SET, "llama_8b": LLAMA_8B,
             "moe_128": moe_128, "gemma2_long": gemma2_long}  # fmt: skip
  for name, config in configs.items():
    (root / name).mkdir()
    (root / name / "config.json").write_text(json.dumps(config))
  return json.loads(run_python(SCRIPT, str(root)).strip().splitlines()[-1])


@pytest.mark.parametrize("topology", ["v5e:1x1", "v5e:2x2"])
@pytest.mark.parametrize("name", [*FAMILIES, "smollm2"])
def test_every_family_compiles_for_v5e_with_the_tpu_kernels(reports, name, topology):
  """The decode step of each family's tiny config and SmolLM2's (head sizes 8, 16, 64) compiles
  for one v5e chip and for four with tensor parallelism (SmolLM2's 9 heads over three), with the
  Pallas attention kernel; the layers scanned, the default on TPU (Gemma 4 and the Qwen3.5 hybrid
  with a stack per kind of layer, the hybrid's state pool stacked too)."""
  report = reports[f"{name}/{topology}"]
  assert report["error"] is None, report["error"]
  assert report["fits"] and report["device_kind"] == "TPU v5 lite"
  assert report["num_devices"] == {"v5e:1x1": 1, "v5e:2x2": 3 if name == "smollm2" else 4}[topology]
  assert "pallas" in report["attention_backend"] or name == "gemma2"
  if name == "gemma2" and topology == "v5e:1x1":  # a token's KV bytes: each layer's once
    import jax.numpy as jnp

    from jaxengine.models.attention_backends import PallasTpuAttentionBackend

    kv = report["kv_cache"]
    layers = PallasTpuAttentionBackend().bytes_per_block(
      num_layers=4, block_size=kv["block_size"], num_kv_heads=2, head_dim=16, dtype=jnp.bfloat16
    )
    assert kv["bytes_per_token"] == layers // kv["block_size"]
  (step,) = report["executables"]
  assert (step["name"], step["shape"]) == ("ragged_step", "tokens=1 rows=1")
  assert step["flops"] > 0 and step["bytes_accessed"] > 0 and step["compile_s"] > 0
  assert step["hbm_bytes"] > 0 and step["top_ops"][0]["bytes"] > 0  # aot/hbm_bytes.py's model


def test_the_whole_precompile_set_compiles_and_is_planned(reports):
  """With one row and a budget of 2 tokens the engine precompiles the ragged step at 1 and 2
  tokens, with and without prompt logprobs, and the sampler at one row: all compile for TPU,
  and the plan counts the largest temporary and the pages that fit the chip."""
  report = reports["whole_set"]
  assert report["error"] is None and report["fits"]
  assert [(e["name"], e["shape"]) for e in report["executables"]] == [
    ("ragged_step", "tokens=1 rows=1"),
    ("sample", "rows=1"),
    ("ragged_step", "tokens=2 rows=1"),
    ("ragged_step", "tokens=1 rows=1 prompt_logprobs=21"),
    ("ragged_step", "tokens=2 rows=1 prompt_logprobs=21"),
  ]
  memory, kv = report["per_device_bytes"], report["kv_cache"]
  assert memory["temp"] == max(e["temp_bytes"] for e in report["executables"]) > 0
  assert memory["total"] == sum(memory[k] for k in ("weights", "kv_cache", "temp", "other"))
  assert kv["max_tokens"] * kv["bytes_per_token"] <= 0.9 * report["hbm_bytes_per_device"]
  assert [d["batch"] for d in report["decode"]] == [1]
  decode = report["decode"][0]
  assert decode["estimated_step_s"] > decode["memory_floor_s"] > 0
  chip = topology("v5e:1x1").chip  # the estimate reads the HBM bytes, not XLA's count
  step, sample = report["executables"][:2]
  parts = sum(max(e["hbm_bytes"] / chip.hbm_bandwidth, e["flops"] / chip.peak_flops)
              for e in (step, sample))  # fmt: skip
  attention = decode["context"] * kv["bytes_per_token"] / chip.hbm_bandwidth
  assert decode["estimated_step_s"] == pytest.approx(parts + attention)


def test_tensor_parallelism_quarters_the_weights_and_fp8_pages_double_the_tokens(reports):
  """The plan alone (nothing compiled) of Llama-3.1-8B's config: it does not fit one v5e chip;
  over four each holds a quarter of the weights and it fits; the budget holds twice the tokens
  in float8 pages as in bfloat16 ones."""
  tp1, tp4, fp8 = reports["plan/tp1"], reports["plan/tp4"], reports["plan/fp8"]
  weights1, weights4 = tp1["per_device_bytes"]["weights"], tp4["per_device_bytes"]["weights"]
  assert weights1 > 14 * 2**30 and not tp1["fits"] and tp4["fits"]
  assert 0.25 <= weights4 / weights1 < 0.2501  # the norms stay whole on every chip
  assert tp4["num_devices"] == 4 and tp1["num_devices"] == 1
  tokens, fp8_tokens = tp4["kv_cache"]["budget_tokens"], fp8["kv_cache"]["budget_tokens"]
  assert fp8["kv_cache"]["bytes_per_token"] * 2 == tp4["kv_cache"]["bytes_per_token"]
  assert 1.95 < fp8_tokens / tokens < 2.05


def test_the_cli_refuses_a_model_that_does_not_fit_and_an_unknown_topology(reports):
  too_big, unknown = reports["cli/too_big"], reports["cli/unknown"]
  assert too_big["code"] == 1
  message = too_big["stderr"]
  for part in ("needs at least 15.", "GiB per chip", "a 16 GiB chip", "--tensor-parallel-size 2",
               "--quantization int8"):  # fmt: skip
    assert part in message, message
  assert unknown["code"] == 2
  assert "unknown topology 'v9:1x1'" in unknown["stderr"] and "v6e:2x4" in unknown["stderr"]


def test_experts_lower_to_a_grouped_matmul_for_tpu(reports):
  """Lowered for TPU from this CPU-only process, a mixture of experts multiplies each token by
  its own experts (XLA's ragged dot), not the CPU path's product with every expert."""
  hlo = reports["moe_hlo"]
  assert "ragged_dot" in hlo, hlo[:2000]


def _advised_lengths(message: str) -> list[int]:
  return [int(part.split()[0]) for part in message.split("--max-model-len ")[1:]]


def test_a_sliding_window_models_pages_and_longest_context_agree(reports):
  """Gemma 2's layout (a full and a window group) on a small budget: the report's KV bytes are
  its pages' bytes, a token's bytes times the tokens the pages hold stay within them, and the
  advised --max-model-len (longer than the pages hold in every layer: the window layers keep
  their window only) fits while one page more does not."""
  long, fit, next_ = (reports[f"window/{k}"] for k in ("long", "fit", "next"))
  kv = fit["kv_cache"]
  assert fit["per_device_bytes"]["kv_cache"] == kv["num_blocks"] * kv["block_bytes"]
  assert kv["bytes_per_token"] == kv["block_bytes"] * kv["num_groups"] // kv["block_size"]
  assert kv["num_groups"] == 2
  assert kv["max_tokens"] * kv["bytes_per_token"] <= fit["per_device_bytes"]["kv_cache"]
  length = long["kv_cache"]["max_model_len_fit"]
  assert not long["fits"] and _advised_lengths(long["error"]) == [length]
  assert length > long["kv_cache"]["budget_tokens"]  # the windows' pages are not every token's
  assert fit["fits"] and fit["kv_cache"]["max_model_len"] == length, fit["error"]
  assert not next_["fits"] and next_["kv_cache"]["max_model_len_fit"] == length


def test_a_fixed_pool_that_does_not_fit_is_named_with_the_largest_that_does(reports):
  """--num-kv-blocks / --kv-cache-memory-bytes too large for a v5e chip: the message names the
  pool and its GiB (not the bytes one request needs), and the largest pool it advises fits; a
  pool too small for one request of max_model_len says so."""
  for case, given in (("pool/huge", "num_kv_blocks=10000000"),
                      ("pool/bytes", f"kv_cache_memory_bytes={1 << 36}")):  # fmt: skip
    report = reports[case]
    message = report["error"]
    assert not report["fits"] and given in message and "--num-kv-blocks" in message, message
    assert report["per_device_bytes"]["total"] > report["hbm_bytes_per_device"]
    assert "more than the chip's 16.00 GiB" in message
    assert report["kv_cache"]["max_model_len_fit"] == 0  # nothing fits beside this pool
  assert reports["pool/most"]["fits"], reports["pool/most"]["error"]
  small = reports["pool/small"]["error"]
  assert "num_kv_blocks=3" in small and "max_model_len=4096" in small, small
  assert _advised_lengths(small) == [32]  # 2 pages of 16 beside the null page


def test_the_advice_keeps_to_what_the_engine_and_the_model_take(reports):
  """SmolLM2 (9 query heads, 8192 positions) on a small budget: the tensor-parallel size
  advised divides the heads (3, not 2) on a topology that has the chips, and no advised
  --max-model-len passes the model's limit (none at all with a fixed pool too large)."""
  message = reports["heads/9"]["error"]
  assert "--tensor-parallel-size 3 on v5e:2x2" in message, message
  assert "--tensor-parallel-size 2" not in message
  for case in ("heads/9", "pool/huge", "pool/bytes", "pool/small"):
    assert all(n <= 8192 for n in _advised_lengths(reports[case]["error"]))
  assert _advised_lengths(reports["pool/huge"]["error"]) == []
  assert 0 < _advised_lengths(message)[0] < 8192


def test_the_report_counts_every_chip_used_and_labels_fp8_pages(reports):
  """Tensor x data parallel 2 x 2 uses all four chips of v5e:2x2 (not one group's two);
  fp8 KV pages are labelled fp8 (the bytes were halved already)."""
  report = reports["plan/tp2dp2"]
  assert (report["num_devices"], report["topology_chips"]) == (4, 4), report["error"]
  assert reports["smollm2/v5e:2x2"]["topology_chips"] == 4
  assert "fp8 float8_e4m3fn pages" in reports["plan/fp8"]["attention_backend"]
  assert "bfloat16 pages" in reports["plan/tp4"]["attention_backend"]


def test_the_text_says_what_is_known(reports):
  """The text report: nothing compiled, the temporaries are not known and the total is a lower
  bound; compiled, the largest temporary; the tokens the pages hold are theirs."""
  from jaxengine.aot.report import memory_lines

  planned = "\n".join(memory_lines(reports["window/fit"]))
  assert "temp not known (nothing compiled)" in planned and "total at least" in planned
  kv = reports["window/fit"]["kv_cache"]
  assert f"the pages hold {kv['max_tokens']} tokens" in planned
  assert kv["max_tokens"] == (kv["num_blocks"] - 1) // 2 * kv["block_size"]
  assert "does not fit" in "\n".join(memory_lines(reports["window/long"]))
  compiled = "\n".join(memory_lines(reports["whole_set"]))
  assert "temp 0.0" in compiled and "not known" not in compiled and "total at least" not in compiled


def test_a_temporary_read_as_zero_is_read_from_the_peak():
  """libtpu's memory analysis of a Qwen2.5-0.5B int8 ragged step (2 tokens, prompt logprobs)
  gave temp_size_in_bytes 0 beside a peak 22 MB above its arguments (its neighbours: about
  33 MB of temporaries): the step's temporary is read from the peak."""
  from types import SimpleNamespace

  from jaxengine.aot.compile import step_temp_bytes

  zero = SimpleNamespace(
    temp_size_in_bytes=0, peak_memory_in_bytes=662304256, argument_size_in_bytes=640107520
  )
  assert step_temp_bytes(zero) == 662304256 - 640107520
  usual = SimpleNamespace(
    temp_size_in_bytes=34836480, peak_memory_in_bytes=660748288, argument_size_in_bytes=640107520
  )
  assert step_temp_bytes(usual) == 34836480
  assert step_temp_bytes(None) == 0
