"""`EngineConfig`: the one validated configuration of an engine, shared by `LLM`, `LLMEngine` and
the `jaxengine` command.

`LLM(model, **options)` and `LLMEngine(model, tokenizer, **options)` take the fields below as
keywords (vLLM's names) and build one `EngineConfig`; the command builds the same config from its
flags. Every value is checked once, here, on the host and before any model loads: a bad one is a
`ValueError` naming the field and the value. Adding an option is one field (and, if it needs one,
one check in `__post_init__`, or in `engine_config_checks` with its group of fields); the runner
and the engine read it from the config they are given.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import jax
import numpy as np

from jaxengine import parallel
from jaxengine.batch.logits_processors import resolve_logits_processors
from jaxengine.compilation_cache import resolve_cache_dir
from jaxengine.config import BatchConfig
from jaxengine.engine_config_checks import (
  DEFAULT_MAX_NUM_BATCHED_TOKENS as DEFAULT_MAX_NUM_BATCHED_TOKENS,
)
from jaxengine.engine_config_checks import DTYPES as DTYPES
from jaxengine.engine_config_checks import (
  check_batch_invariant,
  check_decoding,
  check_dtype,
  check_kv_cache,
  check_lora,
  check_parallel,
)
from jaxengine.engine_config_checks import check_max_model_len as check_max_model_len
from jaxengine.models.layer_scan import check_scan_layers
from jaxengine.models.quantization import check_quantization
from jaxengine.params import SEED_MAX, SEED_MIN, is_int, validate_logprobs_mode
from jaxengine.spec_decode.config import SpeculativeConfig
from jaxengine.vllm_names import resolve_vllm_names


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
  """The settings of an engine, validated once (defaults are `LLM`'s).

  Attributes:
    max_num_reqs: rows of the persistent batch (sequences decoded at once), a positive int.
    max_model_len: longest prompt plus output, in tokens (vLLM's name). None (default): the
      model's own limit, its `max_position_embeddings` (`for_model` resolves it when the engine
      is built; until then the fields that derive from it are unset); a value above that limit
      is refused when the model is known.
    dtype: weights and KV cache of a loaded checkpoint: "auto" (default: float32 on CPU, the
      checkpoint's dtype on accelerators, bfloat16 for a float16 one; a GGUF file is float32),
      "float32", "bfloat16", "float16" (vLLM's "half" and "float" too) or such a JAX dtype;
      stored as "auto" or the JAX dtype. Norms, softmax and logits are float32 whatever it is.
      A built model keeps its own.
    seed: engine seed for unseeded requests, an int in `[-2**63, 2**63)`.
    max_num_logprobs: largest logprobs / prompt_logprobs per request (vLLM's `max_logprobs`);
      `-1`: the whole vocabulary.
    logprobs_mode: "raw_logprobs" (default), "raw_logits", "processed_logprobs",
      "processed_logits".
    revision: hub branch, tag or commit of a hub id (default `main`).
    download_dir: hub cache directory instead of `HF_HUB_CACHE`.
    tensor_parallel_size: devices splitting each layer; with a `mesh`, its "model" axis size.
    data_parallel_size: data-parallel groups (it must divide `max_num_reqs`); with a `mesh`,
      its "data" axis size. Each group is an `EngineCore` on its own `tensor_parallel_size`
      devices with `max_num_reqs / data_parallel_size` rows, its own pool of KV-cache pages
      (`kv_cache_memory_bytes`, `num_kv_blocks` and `max_num_batched_tokens` are each group's),
      scheduler and prefix cache, and a copy of the weights; each request runs in the group
      with the fewest unfinished sequences (`data_parallel_groups`, `LLMEngine`).
    enable_expert_parallel: split the experts of a mixture-of-experts model (Qwen3-MoE,
      Mixtral) over the "model" axis, each device holding whole experts (vLLM's name), instead
      of splitting every expert's matrices (default False; attention stays tensor parallel).
      The model axis must divide the model's number of experts. No effect on one device.
    mesh: None (one device), or a `jax.sharding.Mesh` with the axes ``("data", "model")``;
      built from the two sizes when either exceeds 1 (sizes that differ from a given mesh's are
      refused). The pages split over key/value heads on the "model" axis
      (`jaxengine.models.sharded_attention`), the step's block tables replicated.
    compilation_cache: JAX's persistent compilation cache: True (default: the
      `JAXENGINE_COMPILATION_CACHE` directory, else `~/.cache/jaxengine/xla`), a directory, or
      False or an "off" spelling (`"off"`, stored as False; see `jaxengine.compilation_cache`).
    precompile: compile every prefill and decode bucket when the `LLM` is built.
    num_decode_steps: `k`, the most decode-and-sample steps per device dispatch (see
      `LLMEngine`; in steps that only decode); on a mesh too.
    logits_processors: `jaxengine.LogitsProcessor` classes, instances or `"module:Class"`
      strings; stored as a tuple of instances.
    speculative_config: None, or vLLM's n-gram or suffix dict (see `LLMEngine`); stored as a
      `SpeculativeConfig`. `num_speculative_tokens` must be below `max_model_len`; with
      `num_decode_steps` k > 1 each step verifies drafts when they pay, else a step that only
      decodes runs the k-step loop; on a mesh too (its verify step gathers the logits whole on every device:
      `worker/verify_step.py`).
    enable_prefix_caching: share the pages of full `block_size`-token prompt blocks between
      requests that start alike; None (default) or True: on; False: off. See `prefix_caching`.
      A hybrid model (Qwen3.5) caches prefixes only with True, with snapshot slots of its state
      (`jaxengine/core/state_snapshots.py`).
    kv_cache_memory_bytes: bytes of the paged KV cache (vLLM's name): keys and values of all
      layers (on a mesh: per device, whose share of each page is its key/value heads). None
      (default): `num_kv_blocks` if given, else `jaxengine.worker.kv_cache_size`'s default:
      `gpu_memory_utilization` of an accelerator's memory (on CPU 1 GiB, or one request of
      `max_model_len` tokens if more), at most room for `max_num_reqs` requests of
      `max_model_len` tokens and a quarter more for cached prefixes, and at least one request of
      `max_model_len` tokens (else refused).
    num_kv_blocks: the paged cache's size in pages, the null page included (an int >= 2), instead
      of `kv_cache_memory_bytes` (give at most one of the two).
    gpu_memory_utilization: the fraction of each accelerator's memory (as JAX's allocator
      reports it, `Device.memory_stats()["bytes_limit"]`) the engine may hold, weights included,
      when it sizes the default paged cache (vLLM's name; a float in (0, 1], default 0.9).
      Unused on CPU and when `kv_cache_memory_bytes` or `num_kv_blocks` is given.
    block_size: token positions per page of the paged cache (vLLM's name; default 16).
    max_num_batched_tokens: the paged engine's token budget per step (vLLM's name): decode tokens
      first, then prefill chunks, at most this many query tokens in one model call. None
      (default; set with `max_model_len`): 2048, at least `max_num_reqs` (`max_model_len`
      without chunked prefill), at most `max_num_reqs * max_model_len` (the most one step can
      hold); must be `>= max_num_reqs` (every running request decodes each step), and
      `>= max_model_len` without chunked prefill. With data parallelism each group's budget, and
      `max_num_reqs` here means one group's rows (`max_num_reqs / data_parallel_size`).
    enable_chunked_prefill: the paged engine may split a prompt over several steps, so long
      prompts share steps with the running requests' decodes (default True; vLLM's name).
    attention_backend: the paged cache's attention: "xla", "pallas_tpu", "pallas_gpu", or None
      (default: the TPU ragged paged kernel on TPU, the Pallas decode kernel on GPU, XLA
      elsewhere; `jaxengine.models.attention_backends`).
    kv_cache_dtype: the pages' storage dtype (vLLM's name): "auto" (default: the model's
      dtype) or "fp8" (alias "fp8_e4m3"): float8_e4m3fn pages on every attention backend,
      about a quarter of float32's bytes (half of bfloat16's), so the same
      `kv_cache_memory_bytes` holds about 4x (2x) the pages. "xla" and "pallas_tpu" store
      `x / scale` clipped to +-448 with a per-tensor scale (the backends' `k_scale` /
      `v_scale`, 1.0 as vLLM without calibrated scales); "pallas_gpu" stores a float32 scale
      ``max|x| / 448`` per position and head beside each page (`(D + 4) / (4 D)` of float32's
      bytes), refused on a GPU below CUDA compute capability 8.9 (Triton's float8_e4m3fn; None
      then picks "xla"). Read back in the model's dtype (`jaxengine.models.attention_backends`).
    batch_invariant: make every request's tokens and logprobs independent of the other requests
      of its steps, bit for bit, and equal to `jaxengine.models.token_logprobs` (a trainer's
      forward pass) on the same weights (default False). The model's projections and logits run
      `ROW_TILE` rows at a time and the paged attention in a fixed order
      (`jaxengine.models.batch_invariant`); a model declares that it can with a
      ``batch_invariant`` attribute (`jaxengine.models.Llama` does). Needs the "xla" attention
      on the CPU backend (other backends are refused, not approximated). With
      `tensor_parallel_size` > 1 no matrix's input axis is split (the row-parallel weights are
      split on their output instead, `jaxengine.parallel`), so no sum crosses devices: the bits
      are the same alone and batched, and `token_logprobs` of the engine's own mesh-placed
      weights (``llm.llm_engine.runner.model``) equals them (a one-device engine's bits may
      differ in the last place). With `data_parallel_size` > 1 each group gives one group's
      bits, so a request's bits do not depend on its group either. Composes with
      `enable_lora` (the adapters' products are row-tiled too). Costs time:
      docs/reproducibility.md has the table.
    async_scheduling: schedule and dispatch step t + 1 while step t's sampled tokens are still
      on the device, and do step t's host work (reading tokens, logprobs, text, stop rules)
      while t + 1 runs (vLLM's name). None (default) or True: on, with every other setting
      (a step whose inputs depend on the unread tokens reads them first: drafting with a
      `speculative_config`, a grammar; a verify step or a k-step loop is read before the next
      step is scheduled, its token counts being known only from its output); False: every
      step synchronous. Outputs are those of synchronous steps (see `LLMEngine`);
      `scheduling_overlaps` says whether it is on.
    reuse_compiled_shapes: let a step whose (token bucket, row bucket) has not compiled yet run
      in a larger compiled shape for its first 8 uses before compiling its own
      (`jaxengine.worker.buckets.StepShapes`; default False: every step runs in its own bucket).
      A short job then compiles fewer shapes (a batch whose requests finish one by one does not
      compile every smaller row bucket on the way down); the price is reproducibility within a
      process: the same requests run again later may run in another shape, and without
      `batch_invariant` their logprobs can then differ in the last bits. The lm-eval
      integration turns it on (evals are short jobs); `precompile` makes it moot.
    disable_hybrid_kv_cache_manager: vLLM's switch for the KV cache groups of a model with
      sliding-window layers (Gemma 2 and 3, Mistral; `jaxengine/core/kv_cache_groups.py`).
      False (default): a window layer's pages that slid out of every window are freed while
      its request runs, so a long request holds about `W + chunk` positions of those layers'
      keys and values, not its whole length. True: one block table for every layer, every
      page held for the request's life (the cache before groups). No effect on a model
      without windows.
    enforce_eager: vLLM's switch that turns off CUDA graphs and torch.compile; accepted (a
      bool) and without effect here: every step is a jitted XLA executable, compiled on first
      use per shape bucket (or all at once with `precompile`), and there is no eager mode to
      fall back to, nor graph capture to skip.
    enable_lora: serve LoRA adapters (PEFT directories) on the base model, chosen per request
      with `jaxengine.LoRARequest` (vLLM's name; default False). Adapters stay unmerged: the
      base weights are untouched and each token adds its own adapter's ``scale * B (A x)``
      (`jaxengine.models.lora`), so one step mixes base and adapter requests. Needs a model
      with ``lora_target_shapes`` (every built-in family, mixtures of experts' experts too);
      composes with `num_decode_steps` > 1, `speculative_config`, `batch_invariant` and a mesh
      (`tensor_parallel_size` > 1: the adapters' slots split as their base projections,
      `jaxengine.parallel.lora_specs`; `data_parallel_size` > 1: slots in every group).
    max_loras: adapters one step may mix, each in a device slot (vLLM's name; default 1); the
      requests of other adapters wait.
    max_lora_rank: the largest adapter rank, the slots' rank (vLLM's name; default 16);
      smaller ranks are zero-padded, larger ones refused.
    max_cpu_loras: adapters whose host copies are kept (least recently used dropped first);
      None (default): `max_loras`; at least `max_loras`.
    quantization: weight-only quantization of the decoder's projection matrices (vLLM's name):
      None (default: the model dtype), "int8" (symmetric, one float32 scale per output row,
      ``max|w| / 127``) or "fp8" (float8_e4m3fn, scale ``max|w| / 448``); the activations,
      embedding, output head and norms stay in the model dtype
      (`jaxengine.models.quantization`). A mixture of experts' expert matrices get one scale
      per expert and output row; its router stays in the model dtype. `load_weights`
      re-quantizes float weights on the way in. Needs a model whose modules declare
      ``QUANTIZABLE`` projections (Llama, Gemma, Qwen3.5 with its Gated DeltaNet projections,
      their mixture-of-experts blocks). With a mesh each device quantizes its own shard of the
      placed float weights: the values keep the float weight's sharding, the scales are split
      like its output axes or replicated (`jaxengine.parallel`).
    scan_layers: the decoder layers as one `jax.lax.scan` over stacked weights and a stacked KV
      cache, compile time flat with depth (`jaxengine.models.layer_scan`: a stack per kind of
      layer; not a Llama mixing dense and MoE layers). None: on TPU and GPU, not on CPU.
    enable_return_routed_experts: give each finished completion the experts a
      mixture-of-experts model's router chose at every position (vLLM's name;
      `CompletionOutput.routed_experts`, `jaxengine/worker/routed_experts.py`), for RL
      routing replay (`jaxengine.models.token_logprobs`); default False. A model without MoE
      layers is refused (ValueError) before its weights are read.
    trust_remote_code: vLLM's (and transformers') permission to run Python code shipped with a
      checkpoint; accepted (a bool) and without effect: jaxengine never runs code from a
      checkpoint or the hub (its architectures are built in; any other is refused either way).

  Raises:
    ValueError: naming the field and value, for any value above that is out of range or of the
      wrong type, or settings that do not go together (a mesh and different sizes, a
      `data_parallel_size` that does not divide `max_num_reqs`, `batch_invariant` with a
      Pallas attention backend or a non-CPU platform); more devices than there are.
  """

  max_num_reqs: int = 16
  max_model_len: int | None = None
  dtype: Any = "auto"
  seed: int = 0
  max_num_logprobs: int = 20
  logprobs_mode: str = "raw_logprobs"
  revision: str | None = None
  download_dir: str | None = None
  tensor_parallel_size: int = 1
  data_parallel_size: int = 1
  enable_expert_parallel: bool = False
  mesh: jax.sharding.Mesh | None = None
  compilation_cache: bool | str | os.PathLike = True
  precompile: bool = False
  num_decode_steps: int = 1
  logits_processors: Sequence | None = None
  speculative_config: SpeculativeConfig | Mapping | None = None
  enable_prefix_caching: bool | None = None
  kv_cache_memory_bytes: int | None = None
  num_kv_blocks: int | None = None
  gpu_memory_utilization: float = 0.9
  block_size: int = 16
  max_num_batched_tokens: int | None = None
  enable_chunked_prefill: bool = True
  attention_backend: str | None = None
  kv_cache_dtype: str = "auto"
  batch_invariant: bool = False
  async_scheduling: bool | None = None
  reuse_compiled_shapes: bool = False
  disable_hybrid_kv_cache_manager: bool = False
  enforce_eager: bool = False
  trust_remote_code: bool = False
  enable_lora: bool = False
  max_loras: int = 1
  max_lora_rank: int = 16
  max_cpu_loras: int | None = None
  quantization: str | None = None
  enable_return_routed_experts: bool = False
  scan_layers: bool | None = None

  def __post_init__(self) -> None:
    for name in ("max_num_reqs", "max_model_len"):
      value = getattr(self, name)
      if name == "max_model_len" and value is None:  # the model's limit, set by `for_model`
        continue
      if not is_int(value) or value < 1:
        what = "a positive int or None" if name == "max_model_len" else "a positive int"
        raise ValueError(f"{name} must be {what}, got {value!r}")
      self._set(name, int(value))
    self._set("dtype", check_dtype(self.dtype))
    if not is_int(self.seed) or not SEED_MIN <= self.seed < SEED_MAX:  # as the batch's key
      raise ValueError(f"seed must be an int in [-2**63, 2**63), got {self.seed!r}")
    self._set("seed", int(self.seed))
    # The batch's own checks, with placeholder sizes (the vocabulary is the model's).
    BatchConfig(
      max_num_reqs=self.max_num_reqs,
      max_model_len=self.max_model_len or 1,
      vocab_size=1,
      max_num_logprobs=self.max_num_logprobs,
      logprobs_mode=validate_logprobs_mode(self.logprobs_mode),
    )
    self._set("max_num_logprobs", int(self.max_num_logprobs))
    if self.revision is not None and not isinstance(self.revision, str):
      raise ValueError(f"revision must be a str, got {self.revision!r}")
    if self.download_dir is not None:
      if not isinstance(self.download_dir, (str, os.PathLike)):
        raise ValueError(f"download_dir must be a path, got {self.download_dir!r}")
      self._set("download_dir", os.fspath(self.download_dir))
    self._set_fields(
      check_parallel(
        tensor_parallel_size=self.tensor_parallel_size,
        data_parallel_size=self.data_parallel_size,
        mesh=self.mesh,
        max_num_reqs=self.max_num_reqs,
      )
    )
    off = resolve_cache_dir(self.compilation_cache) is None  # refuses all but a bool or a path
    if off and not isinstance(self.compilation_cache, bool):
      self._set("compilation_cache", False)  # an "off" spelling is stored as False
    for name in (
      "precompile",
      "enable_chunked_prefill",
      "batch_invariant",
      "enable_expert_parallel",
      "reuse_compiled_shapes",
      "disable_hybrid_kv_cache_manager",
      "enforce_eager",
      "trust_remote_code",
      "enable_lora",
      "enable_return_routed_experts",
    ):
      value = getattr(self, name)
      if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be a bool, got {value!r}")
      self._set(name, bool(value))
    self._set("logits_processors", resolve_logits_processors(self.logits_processors))
    if self.batch_invariant:
      check_batch_invariant(attention_backend=self.attention_backend)
    self._set_fields(
      check_kv_cache(
        gpu_memory_utilization=self.gpu_memory_utilization,
        kv_cache_memory_bytes=self.kv_cache_memory_bytes,
        num_kv_blocks=self.num_kv_blocks,
        block_size=self.block_size,
        max_num_batched_tokens=self.max_num_batched_tokens,
        attention_backend=self.attention_backend,
        kv_cache_dtype=self.kv_cache_dtype,
        max_num_reqs=self.max_num_reqs,
        data_parallel_size=self.data_parallel_size,
        max_model_len=self.max_model_len,
        enable_chunked_prefill=self.enable_chunked_prefill,
      )
    )
    self._set_fields(
      check_decoding(self.speculative_config, self.num_decode_steps, self.max_model_len)
    )
    self._check_prefix_caching()
    self._check_async_scheduling()
    self._set_fields(
      check_lora(
        max_loras=self.max_loras,
        max_lora_rank=self.max_lora_rank,
        max_cpu_loras=self.max_cpu_loras,
      )
    )
    check_quantization(self.quantization)
    check_scan_layers(self.scan_layers)

  def _check_async_scheduling(self) -> None:
    wanted = self.async_scheduling
    if wanted is not None and not isinstance(wanted, (bool, np.bool_)):
      raise ValueError(f"async_scheduling must be a bool or None, got {wanted!r}")
    self._set("async_scheduling", None if wanted is None else bool(wanted))

  @property
  def scheduling_overlaps(self) -> bool:
    """Whether steps are scheduled asynchronously: `async_scheduling`, None meaning on (with
    every other setting: steps whose inputs depend on unread tokens read them first, see
    `LLMEngine`)."""
    return self.async_scheduling is not False

  def _set(self, name: str, value: Any) -> None:
    object.__setattr__(self, name, value)  # normalising a field of the frozen config

  def _set_fields(self, fields: Mapping[str, Any]) -> None:
    for name, value in fields.items():
      self._set(name, value)

  def _check_prefix_caching(self) -> None:
    enable = self.enable_prefix_caching
    if enable is not None and not isinstance(enable, bool):
      raise ValueError(f"enable_prefix_caching must be a bool or None, got {enable!r}")

  def for_model(self, max_position_embeddings: int) -> EngineConfig:
    """This config for a model whose longest sequence is `max_position_embeddings`: with
    `max_model_len` None, a copy with that limit as `max_model_len` (and the fields derived from
    it), else this config once its `max_model_len` is checked against the limit.

    Raises:
      ValueError: a `max_model_len` above `max_position_embeddings`, naming both; or anything
        `EngineConfig` refuses with the limit as `max_model_len` (e.g. `max_num_batched_tokens`
        below it with `enable_chunked_prefill=False`).
    """
    limit = int(max_position_embeddings)
    if self.max_model_len is None:
      return self.replace(max_model_len=limit)
    check_max_model_len(self.max_model_len, limit)
    return self

  @property
  def max_num_blocks_per_req(self) -> int:
    """Pages a request of `max_model_len` tokens holds in the paged cache.

    Raises:
      ValueError: while `max_model_len` is None (see `for_model`).
    """
    return -(-self.resolved_max_model_len // self.block_size)

  @property
  def resolved_max_model_len(self) -> int:
    """`max_model_len` once set (by the user or `for_model`).

    Raises:
      ValueError: while it is None (the model's limit, not known yet).
    """
    if self.max_model_len is None:
      raise ValueError(
        "max_model_len is None (the model's max_position_embeddings): call "
        "config.for_model(max_position_embeddings) first"
      )
    return self.max_model_len

  @property
  def prefix_caching(self) -> bool:
    """Whether prefix caching is on: `enable_prefix_caching`, None meaning on."""
    return self.enable_prefix_caching is not False

  @property
  def speculative(self) -> SpeculativeConfig | None:
    """`speculative_config` as the `SpeculativeConfig` it was validated into."""
    return cast(SpeculativeConfig | None, self.speculative_config)

  @property
  def num_speculative_tokens(self) -> int:
    """`k` of the speculative config, 0 without one."""
    spec = self.speculative
    return 0 if spec is None else spec.num_speculative_tokens

  def replace(self, **changes: Any) -> EngineConfig:
    """A copy with `changes` applied (validated again)."""
    return dataclasses.replace(self, **changes)

  def data_parallel_groups(self) -> list[EngineConfig]:
    """The config of each data-parallel group's `EngineCore` (`engine/engine_core.py`): this one
    when `data_parallel_size` is 1; else, for group `g`, the mesh's devices at index `g` of the
    "data" axis (a mesh of data size 1, `jaxengine.parallel.data_groups`), `max_num_reqs /
    data_parallel_size` rows, and the seed `seed + g` (wrapped into `[-2**63, 2**63)`), so
    unseeded requests of different groups draw from different streams. Every other field (the
    pool's size, the token budget) is each group's own."""
    d = self.data_parallel_size
    if d == 1:
      return [self]
    return [
      self.replace(
        mesh=group_mesh,
        tensor_parallel_size=1,  # the group's mesh gives the sizes
        data_parallel_size=1,
        max_num_reqs=self.max_num_reqs // d,
        seed=(self.seed + g - SEED_MIN) % (SEED_MAX - SEED_MIN) + SEED_MIN,
      )
      for g, group_mesh in enumerate(parallel.data_groups(cast(Any, self.mesh)))
    ]


def engine_config(
  config: EngineConfig | None, options: Mapping[str, Any], caller: str
) -> EngineConfig:
  """The config of an `LLM` or `LLMEngine` call: `config` with `options` applied, or one built
  from `options`. vLLM's `max_num_seqs` and `max_logprobs` are accepted for `max_num_reqs` and
  `max_num_logprobs` (`jaxengine.vllm_names`).

  Raises:
    TypeError: for an option that is not an `EngineConfig` field, as for any unknown keyword
      (naming `caller` and the option, and the field it may stand for: a close spelling).
    ValueError: as `EngineConfig`; a vLLM name and its field given with different values.
  """
  options = resolve_vllm_names(options)
  names = [field.name for field in dataclasses.fields(EngineConfig)]
  unknown = [name for name in options if name not in names]
  if unknown:
    raise TypeError(
      f"{caller}() got an unexpected keyword argument {unknown[0]!r}"
      + _did_you_mean(unknown[0], names)
    )
  if config is None:
    return EngineConfig(**options)
  if not isinstance(config, EngineConfig):
    raise ValueError(f"config must be an EngineConfig, got {type(config).__name__}")
  return config.replace(**options) if options else config


def _did_you_mean(name: str, names: Sequence[str]) -> str:
  """A hint for an unknown option: the closest field name."""
  close = difflib.get_close_matches(name, names, 1)
  return f"; did you mean {close[0]!r}?" if close else ""


def with_engine_options(function: Callable) -> Callable:
  """Gives `function` (an `__init__` taking `**options` for `engine_config`) a signature that
  lists every `EngineConfig` field as a keyword with its default, for `help()` and notebooks."""
  signature = inspect.signature(function)
  own = [p for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD]
  options = [
    inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
    for f in dataclasses.fields(EngineConfig)
  ]
  function.__signature__ = signature.replace(parameters=[*own, *options])  # type: ignore[attr-defined]
  return function
