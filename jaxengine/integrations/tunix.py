"""jaxengine as a Tunix rollout engine: `JaxEngineRollout`, a `BaseRollout` Tunix builds itself.

Tunix (`pip install "jaxengine[tunix]"`; without it, importing this module raises
`jaxengine.integrations.MissingExtraError` with that command) runs GRPO and PPO through
`RLCluster`, whose rollout engine is chosen by `ClusterConfig.rollout_engine`. Pass this class
there, or a `functools.partial` of it carrying engine options, and Tunix constructs it with
``rollout_actor=``, ``tokenizer=``, ``mesh=`` and ``rollout_config=``::

    cluster_config = rl_cluster_lib.ClusterConfig(
      rollout_engine=functools.partial(JaxEngineRollout, max_num_reqs=32),
      role_to_mesh={Role.ACTOR: mesh, Role.REFERENCE: mesh, Role.ROLLOUT: mesh},
      rollout_config=base_rollout.RolloutConfig(max_tokens_to_generate=64, temperature=0.9),
      training_config=...,
    )

The rollout serves the actor (a Tunix `Llama3`, `Qwen2`, `Qwen3` (dense or MoE), `Gemma` or
`Gemma3`) as a `jaxengine.LLM` over a `jaxengine.models.Llama` (or, for Gemma,
`jaxengine.models.gemma.Gemma`) holding the same weights (`jaxengine.integrations.tunix_weights`
maps the
names and layouts, on the devices where the arrays are). It runs in the trainer's process, on its
devices, with per-request seeds and no recompiles when the weights change: after each training
step Tunix calls `update_params` with the trainer's `nnx.Param` state, which goes through
`LLM.load_weights` (which re-quantizes it for an engine built with ``quantization="int8"`` or
``"fp8"``). `model()` is the engine's module, never the trainer's, so Tunix syncs the
weights after every step whether the rollout has its own mesh or shares the trainer's.

Logprobs follow Tunix's convention: the log-softmax of the logits divided by the rollout
temperature (raw logits for greedy decoding), of the whole vocabulary (top-k and top-p do not
renormalise them), which is what its trainer recomputes (`compute_per_token_logps`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxengine.integrations import missing_extra

try:
  from tunix.generate import tokenizer_adapter
  from tunix.generate import utils as tunix_utils
  from tunix.rl.rollout import base_rollout
except ModuleNotFoundError as error:  # the extra is not installed: say how to install it
  raise missing_extra(error, __name__) from error

from jaxengine.entrypoints.llm import LLM
from jaxengine.integrations.tunix_lora import (
  LORA_MARK,
  lora_adapter_from_tunix,
  lora_scales,
  split_lora_leaves,
)
from jaxengine.integrations.tunix_weights import (
  EngineConfig,
  check_chunk_bytes,
  check_tunix_params,
  config_from_tunix,
  engine_leaves,
  engine_module,
  tunix_param_leaves,
)
from jaxengine.lora import LoRAAdapter, LoRARequest
from jaxengine.models.attention_backends import XlaAttentionBackend
from jaxengine.models.lora import LoRAInputs
from jaxengine.models.quantization import check_quantization
from jaxengine.models.sequence_logprobs import scratch_step
from jaxengine.models.weights import abstract_module, replace_leaves, state_leaves
from jaxengine.parallel import make_mesh
from jaxengine.params import SamplingParams

__all__ = ["JaxEngineRollout", "PaddedPrompts", "sampling_params", "tokenize_prompts"]


#: The engine's `num_decode_steps` unless given: decode steps per device dispatch. A rollout
#: decodes its whole batch to the end, so a device loop of up to 16 steps (which ends early once
#: every row has stopped) pays the host round trip once per 16 tokens instead of every token:
#: on the tiny model of `examples/tunix_grpo.py` the rollout's steady step went from 0.09 s to
#: 0.02-0.04 s on a 2-core CPU.
DEFAULT_NUM_DECODE_STEPS = 16

#: `RolloutConfig`'s parallelism fields -> the engine option of the same meaning.
PARALLEL_FIELDS = ("tensor_parallel_size", "data_parallel_size")


def _rollout_sizes(config: base_rollout.RolloutConfig) -> dict[str, int]:
  """`RolloutConfig`'s tensor- and data-parallel sizes (-1: inferred from the rollout mesh).

  Raises:
    ValueError: a size that is neither -1 nor a positive int, naming the field and value.
  """
  sizes = {}
  for name in PARALLEL_FIELDS:
    value = getattr(config, name, -1)
    bad = isinstance(value, bool) or not isinstance(value, (int, np.integer))
    if bad or value == 0 or value < -1:
      raise ValueError(f"RolloutConfig.{name} must be -1 or a positive int, got {value!r}")
    sizes[name] = int(value)
  return sizes


def _engine_sizes(engine_options: dict[str, Any]) -> dict[str, int] | None:
  """The parallel sizes the engine options fix (a `mesh`'s axes, or the sizes given), or None
  when they place nothing."""
  mesh = engine_options.get("mesh")
  if mesh is not None:
    return {
      "tensor_parallel_size": int(mesh.shape.get("model", 1)),
      "data_parallel_size": int(mesh.shape.get("data", 1)),
    }
  given = {k: engine_options.get(k) for k in PARALLEL_FIELDS}
  if all(v is None for v in given.values()):
    return None
  return {k: 1 if v is None else int(v) for k, v in given.items()}


def engine_placement(
  config: base_rollout.RolloutConfig,
  mesh: jax.sharding.Mesh | None,
  device: jax.Device,
  engine_options: dict[str, Any],
  *,
  lora: bool,
) -> None:
  """Places the engine from `RolloutConfig`'s parallel sizes and the rollout mesh, in
  `engine_options` (its ``mesh``), unless the options place it themselves.

  The sizes resolve as Tunix's own vLLM rollout resolves them: -1 for both: every device of the
  rollout mesh splits each layer (`tensor_parallel_size` = the mesh's device count, one
  data-parallel group); -1 for one: the devices left by the other. A resolved ``t x d`` of 1
  is a one-device engine mesh on `device`: the trainer's weights are committed to their device,
  and an engine without a mesh would compile every step twice (once per placement); on a mesh
  everything is placed from the start. Otherwise a ``(data, model)`` mesh of the rollout
  mesh's first ``d * t`` devices. Engine options that place the engine (`mesh`,
  `tensor_parallel_size`, `data_parallel_size`) win, and a size `RolloutConfig` sets
  explicitly (not -1) must equal theirs. A LoRA rollout stays on one device (the engine's LoRA
  is not on a mesh yet): sizes above 1 are refused, -1 resolves to 1.

  Args:
    config: the rollout's `RolloutConfig`.
    mesh: the rollout mesh (None or empty: `device` alone).
    device: the engine's first device (`_engine_device`).
    engine_options: `EngineConfig` fields; ``mesh`` is set here when they place nothing.
    lora: whether the rollout serves a LoRA actor.

  Raises:
    ValueError: (before any device work) a size that is neither -1 nor positive; a set size
      that differs from the engine options' (both named); sizes needing more devices than the
      rollout mesh has; sizes above 1 for a LoRA actor.
  """
  sizes = _rollout_sizes(config)
  given = _engine_sizes(engine_options)
  if given is not None:
    for name, value in sizes.items():
      if value != -1 and value != given[name]:
        raise ValueError(
          f"RolloutConfig.{name}={value} conflicts with the engine options' {name}="
          f"{given[name]} (give one, or the same)"
        )
    if engine_options.get("mesh") is not None or given != dict.fromkeys(PARALLEL_FIELDS, 1):
      return
    sizes = dict.fromkeys(PARALLEL_FIELDS, 1)  # one device, as the options say
    for name in PARALLEL_FIELDS:
      engine_options.pop(name, None)
  if lora:
    for name, value in sizes.items():
      if value > 1:
        raise ValueError(
          f"RolloutConfig.{name}={value}: a LoRA rollout runs on one device (leave it -1 or 1)"
        )
    return
  devices = list(mesh.devices.flat) if mesh is not None and not mesh.empty else [device]
  t, d = sizes["tensor_parallel_size"], sizes["data_parallel_size"]
  n = len(devices)
  if t == -1 and d == -1:
    t, d = n, 1
  elif t == -1:
    t = max(n // d, 1)
  elif d == -1:
    d = max(n // t, 1)
  if t * d > n:
    raise ValueError(
      f"RolloutConfig.tensor_parallel_size={t} x data_parallel_size={d} needs {t * d} devices, "
      f"the rollout mesh has {n}"
    )
  if t * d == 1:
    devices = [device]
  engine_options["mesh"] = make_mesh(t, d, devices)


def _memory_fraction(
  engine_options: dict[str, Any], config: base_rollout.RolloutConfig
) -> tuple[float, str]:
  """The engine's memory fraction and where it came from: the `gpu_memory_utilization` engine
  option, else `RolloutConfig.rollout_vllm_hbm_utilization` (Tunix's rollout memory fraction).

  Raises:
    ValueError: a fraction outside (0, 1], naming its source and value.
  """
  if engine_options.get("gpu_memory_utilization") is not None:
    value, source = engine_options["gpu_memory_utilization"], "gpu_memory_utilization"
  else:
    value = getattr(config, "rollout_vllm_hbm_utilization", 0.9)
    source = "RolloutConfig.rollout_vllm_hbm_utilization"
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
    raise ValueError(f"{source} must be a float in (0, 1], got {value!r}")
  return float(value), source


def process_memory_fraction(fraction: float, devices: Sequence[jax.Device]) -> float:
  """The engine's `gpu_memory_utilization` (a fraction of each device's memory for everything
  the process holds) that leaves the engine `fraction` of the memory for itself.

  Called before the engine places anything: what the devices hold then (a colocated trainer's
  parameters and optimizer state) is added on top of `fraction`, so the engine's weights and
  KV cache together take at most ``fraction * bytes_limit`` (vLLM's meaning: this engine's
  share), whatever the trainer holds. Devices without memory statistics (CPU): `fraction`
  itself (unused there).

  Args:
    fraction: the engine's share of each device's memory, in (0, 1].
    devices: the engine's devices.

  Returns:
    ``min(1, fraction + max over devices of bytes_in_use / bytes_limit)``.
  """
  shares = []
  for device in devices:
    stats = device.memory_stats()
    if not stats or "bytes_limit" not in stats:
      return fraction
    shares.append(int(stats.get("bytes_in_use", 0)) / int(stats["bytes_limit"]))
  return min(1.0, fraction + max(shares, default=0.0))


class PaddedPrompts(NamedTuple):
  """Prompts tokenized and left-padded as Tunix's vanilla sampler does.

  Attributes:
    token_ids: one `[num_prompt_tokens] int32` array per prompt (BOS first, once).
    left_padded: `[num_prompts, max_prompt_length] int32`, pad ids on the left.
  """

  token_ids: list[np.ndarray]
  left_padded: np.ndarray


def tokenize_prompts(
  tokenizer: tokenizer_adapter.TokenizerAdapter, prompts: Sequence[str], max_prompt_length: int
) -> PaddedPrompts:
  """Tokenizes like Tunix's sampler: encode, prepend BOS (when the tokenizer has a non-zero one)
  without doubling it, left-pad to `max_prompt_length` (or, if a prompt is longer, to the next
  power of two above the longest: prompts are never truncated)."""
  bos = tokenizer.bos_id()
  token_ids = [
    np.asarray(
      tokenizer.dedup_bos_ids(([bos] if bos else []) + list(tokenizer.encode(p))), np.int32
    )
    for p in prompts
  ]
  longest = max(len(t) for t in token_ids)
  width = (
    max_prompt_length if longest <= max_prompt_length else tunix_utils.next_power_of_2(longest)
  )
  left_padded = np.full((len(prompts), width), tokenizer.pad_id(), np.int32)
  for row, ids in enumerate(token_ids):
    left_padded[row, width - len(ids) :] = ids
  return PaddedPrompts(token_ids, left_padded)


def _engine_device(mesh: jax.sharding.Mesh | None, embedding: Any) -> jax.Device:
  """The device the engine's weights live on: the rollout mesh's first, else the actor's."""
  if mesh is not None and not mesh.empty:
    return mesh.devices.flat[0]
  devices = getattr(embedding, "devices", None)
  return min(devices(), key=lambda d: d.id) if devices else jax.devices()[0]


def _is_greedy(config: base_rollout.RolloutConfig) -> bool:
  """Tunix's greedy: no top_p (its sampler's greedy mode), top_k 1, or temperature 0."""
  return config.top_p is None or config.top_k == 1 or config.temperature == 0


def _request_seeds(seed: Any, num_prompts: int) -> list[int | None]:
  """One engine seed per prompt from `RolloutConfig.seed` (an int or a JAX key; None: unseeded).

  Tunix's sampler draws a whole batch from one key; the engine seeds each request, so the
  batch's seed is spread into distinct per-prompt seeds (the same seed gives the same draws).
  """
  if seed is None:
    return [None] * num_prompts
  if isinstance(seed, jax.Array) and jnp.issubdtype(seed.dtype, jax.dtypes.prng_key):
    seed = jax.random.key_data(seed)
  entropy = [int(x) for x in np.asarray(seed, np.uint64).reshape(-1)] or [0]
  states = np.random.SeedSequence(entropy).generate_state(2 * num_prompts, np.uint32)
  return [int(states[2 * i]) << 31 | int(states[2 * i + 1]) >> 1 for i in range(num_prompts)]


def _actor_lora_scales(
  actor: nnx.Module, lora: dict[str, Any], lora_alpha: float | None
) -> dict[tuple[int, str], float]:
  """``lora_alpha / rank`` per LoRA pair (qwix's scale). qwix keeps its `LoraRule`s private to
  its provider, so the alpha is given (ValueError when it is not a positive number)."""
  del actor
  if lora_alpha is None:
    raise ValueError(
      "the rollout actor has LoRA parameters: pass lora_alpha= (its qwix LoraProvider's alpha; "
      "the scale is lora_alpha / rank)"
    )
  if isinstance(lora_alpha, bool) or not isinstance(lora_alpha, (int, float)) or lora_alpha <= 0:
    raise ValueError(f"lora_alpha must be a positive number, got {lora_alpha!r}")
  return lora_scales(lora, [(".*", _lora_rank(lora), float(lora_alpha))])


def _lora_rank(lora: dict[str, Any]) -> int:
  """The rank of qwix LoRA leaves (the last axis of every ``*_lora_a``; ValueError if they
  differ)."""
  ranks = {int(v.shape[-1]) for n, v in lora.items() if n.endswith(f"{LORA_MARK}a")}
  if len(ranks) != 1:
    raise ValueError(f"the actor's LoRA ranks are {sorted(ranks)}: one rank is supported")
  return ranks.pop()


def _lora_engine_options(engine_options: dict[str, Any], lora: dict[str, Any]) -> None:
  """`enable_lora` and a `max_lora_rank` holding the actor's rank (ValueError if one given
  is smaller, or LoRA is switched off)."""
  rank = _lora_rank(lora)
  if engine_options.get("enable_lora") is False:
    raise ValueError("enable_lora=False, but the rollout actor has LoRA parameters")
  engine_options["enable_lora"] = True
  given = engine_options.setdefault("max_lora_rank", rank)
  if isinstance(given, int) and given < rank:
    raise ValueError(f"max_lora_rank={given} is below the actor's LoRA rank {rank}")


def sampling_params(
  config: base_rollout.RolloutConfig, eos_ids: Sequence[int], seed: int | None
) -> SamplingParams:
  """The `SamplingParams` of one prompt under a Tunix `RolloutConfig`.

  Greedy (`_is_greedy`) becomes temperature 0; otherwise temperature, top_p (None: 1) and top_k
  (None or <= 0: off) as given. Generation stops at the first of `eos_ids` (the tokenizer's own
  EOS only when it is among them, as in Tunix) or after `max_tokens_to_generate` tokens.
  """
  greedy = _is_greedy(config)
  return SamplingParams(
    temperature=0.0 if greedy else float(config.temperature),
    top_p=1.0 if greedy or config.top_p is None else float(config.top_p),
    top_k=0 if greedy or not config.top_k or config.top_k <= 0 else int(config.top_k),
    seed=seed,
    max_tokens=int(config.max_tokens_to_generate),
    ignore_eos=True,
    stop_token_ids=tuple(int(t) for t in eos_ids),
    logprobs=0 if config.return_logprobs else None,
  )


@functools.partial(jax.jit, static_argnames=("graphdef", "pad_id", "num_completion_tokens"))
def completion_logprobs(
  graphdef: nnx.GraphDef,
  weights: nnx.State,
  token_ids: jax.Array,
  inverse_temperature: jax.Array,
  lora: LoRAInputs | None = None,
  *,
  pad_id: int,
  num_completion_tokens: int,
) -> jax.Array:
  """Teacher-forced logprobs of the completion tokens, Tunix's convention.

  The engine model runs once over every `[prompt, completion]` row, as one ragged step over a
  scratch pool of pages (`jaxengine.models.sequence_logprobs.scratch_step`): each row's real
  tokens moved to its front, at positions `0..`, its pad tokens after them (where no real token
  attends to them).

  Args:
    graphdef: the engine model's graph (static).
    weights: its weights.
    token_ids: `[B, T] int32`, left-padded prompt then right-padded completion.
    inverse_temperature: `[] float32`, 1 / temperature (1 for greedy or temperature 1).
    lora: the LoRA adapter slots with ``[B * T] int32`` token slots (a LoRA rollout), or None.
    pad_id: the pad token (static).
    num_completion_tokens: `C`, the completion's width (static).

  Returns:
    `[B, C] float32` `log_softmax(logits * inverse_temperature)` of each completion token given
    the tokens before it; 0 at pad positions.
  """
  model = nnx.merge(graphdef, weights)
  rows, width = token_ids.shape
  is_real = token_ids != pad_id  # [B, T]
  order = jnp.argsort(~is_real, axis=1, stable=True)  # [B, T] real tokens first, in order
  packed = jnp.take_along_axis(token_ids, order, axis=1)  # [B, T]
  block_size = 16  # the engine's default; any size computes the same attention
  metadata, kv_cache = scratch_step(model, rows, width, block_size, XlaAttentionBackend())
  positions = jnp.tile(jnp.arange(width, dtype=jnp.int32), rows)[None]  # [1, B * T]
  adapters = {}  # only Llama-family modules take LoRA
  if lora is not None:  # each token's slot moves with the token
    slots = jnp.take_along_axis(lora.slots.reshape(rows, width), order, axis=1)
    adapters["lora"] = dataclasses.replace(lora, slots=slots.reshape(-1))
  flat = packed.reshape(1, rows * width)
  hidden, _ = model(flat, positions, kv_cache, metadata, **adapters)  # [1, B * T, E]
  hidden = hidden.reshape(rows, width, -1)
  start = width - num_completion_tokens
  targets = token_ids[:, start:]  # [B, C]
  # A real target's predictor is the real token before it: packed index (its position - 1).
  target_positions = jnp.cumsum(is_real, axis=1)[:, start:] - 1  # [B, C]
  before = jnp.clip(target_positions - 1, 0, width - 1)
  predictors = jnp.take_along_axis(hidden, before[..., None], axis=1)  # [B, C, E]
  logits = model.compute_logits(predictors) * inverse_temperature  # [B, C, V]
  picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  logps = picked - jax.nn.logsumexp(logits, axis=-1)
  return jnp.where(targets != pad_id, logps, 0.0)


class JaxEngineRollout(base_rollout.BaseRollout):
  """Tunix rollout engine serving the actor through `jaxengine.LLM`.

  `RolloutConfig` fields used: `max_tokens_to_generate` (`max_tokens`), `temperature`, `top_p`,
  `top_k` (greedy when top_p is None, top_k is 1 or temperature 0, as Tunix's sampler),
  `seed` (spread into one seed per prompt; None: the engine's own stream, new draws every call),
  `eos_tokens` (the stop tokens; default the tokenizer's EOS), `max_prompt_length` (left-padding
  width of `left_padded_prompt_tokens`; longer prompts are padded to the next power of two, never
  truncated, as Tunix's sampler does), `kv_cache_size` (the default `max_model_len`),
  `data_type` (the engine model's dtype; default the actor's), `return_logprobs`,
  `tensor_parallel_size` and `data_parallel_size` (the engine's placement on the rollout mesh,
  `engine_placement`) and `rollout_vllm_hbm_utilization` (the engine's memory fraction unless
  `gpu_memory_utilization` is given). Ignored: `rollout_mapping_config`,
  `expert_parallel_size` (give `enable_expert_parallel`) and the other `rollout_vllm_*` /
  `rollout_sglang_jax_*` fields. `RolloutOutput.logits` is empty.

  Args:
    rollout_actor: the Tunix `Llama3`, `Qwen2`, `Qwen3`, `Gemma` or `Gemma3` module to serve (its weights are
      copied into the engine's layout; later changes reach the engine through `update_params`).
    tokenizer: a Tunix `TokenizerAdapter` or anything it wraps (HF, SentencePiece, or an object
      with encode/decode/bos_id/eos_id/pad_id).
    mesh: the rollout mesh Tunix assigns. The engine goes on its devices as `RolloutConfig`'s
      `tensor_parallel_size` and `data_parallel_size` say (-1, their default: inferred as
      Tunix's vLLM rollout does, every device splitting each layer), on the first device alone
      (the actor's first device without a mesh) when they resolve to one, unless
      `engine_options` place the engine (`mesh=`, `tensor_parallel_size=`,
      `data_parallel_size=`; see `engine_placement`). The trainer's arrays reach the engine
      device to device.
    rollout_config: the TRAIN `RolloutConfig`; its temperature is the one
      `get_per_token_logps` divides by.
    lora_alpha: the LoRA alpha of a qwix LoRA actor (scale ``lora_alpha / rank``), required
      for one (qwix keeps its rules private to its provider). A LoRA actor (one with `nnx.LoRAParam`
      leaves) is served as its base weights plus one adapter (`enable_lora`, `max_lora_rank`
      defaulting to its rank, no engine mesh) that every rollout runs with and that
      `update_params` replaces in memory (`jaxengine.integrations.tunix_lora`).
    free_kv_cache_during_sync: `update_params` frees the engine's KV cache while it moves and
      converts the weights and makes a fresh, empty one after (`LLMEngine.free_kv_cache`; the
      bytes freed in `kv_cache_bytes_freed`; nothing compiles, and later rollouts are those of
      an engine that kept its cache: the prefix cache is emptied by a sync anyway). Default
      False (vLLM's sleep level 1 without moving the weights).
    reshard_chunk_bytes: move and convert the trainer's weights in chunks of about this many
      parameter bytes (whole layers; at least one layer per chunk), waiting for each chunk
      before the next, so a sync holds one extra copy of the model and a chunk in flight rather
      than two extra copies (`tunix_weights.engine_leaves`; Tunix's vLLM rollout counts its
      `rollout_vllm_reshard_chunk_size` in tensors instead). None (default): all at once. The
      weights are equal either way.
    **engine_options: `jaxengine.EngineConfig` fields (`max_num_reqs`, `max_model_len`, `seed`,
      ...). `logprobs_mode` is fixed ("processed_logprobs") and may not be given;
      `compilation_cache` defaults to False here (JAX's persistent cache is process-wide: on,
      it would hold the trainer's executables too), `num_decode_steps` to
      `DEFAULT_NUM_DECODE_STEPS` (16). `gpu_memory_utilization` (default:
      `RolloutConfig.rollout_vllm_hbm_utilization`, Tunix's 0.2) is the engine's own share of
      each device's memory, its weights and KV cache together (vLLM's meaning, whatever a
      colocated trainer holds: `process_memory_fraction`); it bounds the default KV cache,
      which is at most room for `max_num_reqs` requests of `max_model_len` tokens
      (`jaxengine.worker.kv_cache_size`). `quantization` ("int8" or "fp8"; a LoRA actor's
      adapter stays float) stores the projections as narrow values with per-row scales: each
      `update_params` converts the trainer's float weights into the engine's float layout and
      `LLM.load_weights` re-quantizes them (nothing compiles after the first sync, whole or in
      chunks), and `model()` is None.

  Raises:
    ValueError: an unsupported model, a `mesh` that is not a `jax.sharding.Mesh`, `logprobs_mode`
      among the options, invalid options (an unknown `quantization`, a memory fraction outside
      (0, 1], a `reshard_chunk_bytes` that is not a positive int, parallel sizes that conflict
      or do not fit the rollout mesh: `engine_placement`), or a LoRA actor whose LoRA is
      unsupported (named), whose scale is unknown, or whose rank exceeds a given
      `max_lora_rank`.
  """

  def __init__(
    self,
    *,
    rollout_actor: nnx.Module,
    tokenizer: Any,
    mesh: jax.sharding.Mesh | None = None,
    rollout_config: base_rollout.RolloutConfig | None = None,
    lora_alpha: float | None = None,
    free_kv_cache_during_sync: bool = False,
    reshard_chunk_bytes: int | None = None,
    **engine_options: Any,
  ):
    if mesh is not None and not isinstance(mesh, jax.sharding.Mesh):
      raise ValueError(f"mesh must be a jax.sharding.Mesh or None, got {type(mesh).__name__}")
    if not isinstance(free_kv_cache_during_sync, bool):
      raise ValueError(
        f"free_kv_cache_during_sync must be a bool, got {free_kv_cache_during_sync!r}"
      )
    check_chunk_bytes(reshard_chunk_bytes, "reshard_chunk_bytes")
    #: Whether `update_params` frees the KV cache while it moves the weights.
    self.free_kv_cache_during_sync = free_kv_cache_during_sync
    #: Parameter bytes per chunk of a weight sync (`tunix_weights.engine_leaves`); None: at once.
    self.reshard_chunk_bytes = reshard_chunk_bytes
    #: Device bytes of KV cache the last `update_params` freed while it ran (0: none).
    self.kv_cache_bytes_freed = 0
    if "logprobs_mode" in engine_options:
      raise ValueError("logprobs_mode is fixed by JaxEngineRollout (Tunix's convention)")
    check_quantization(engine_options.get("quantization"))  # before any weight moves
    self.rollout_config = rollout_config or base_rollout.RolloutConfig()
    self.tokenizer = (
      tokenizer
      if isinstance(tokenizer, tokenizer_adapter.TokenizerAdapter)
      else tokenizer_adapter.TokenizerAdapter(tokenizer)
    )
    self.rollout_mesh = mesh
    fraction, _ = _memory_fraction(engine_options, self.rollout_config)
    max_model_len = int(engine_options.pop("max_model_len", self.rollout_config.kv_cache_size))
    self.config: EngineConfig = config_from_tunix(
      rollout_actor,
      max_position_embeddings=max_model_len,
      bos_token_id=self.tokenizer.bos_id(),
      eos_token_id=self.tokenizer.eos_id(),
    )
    params, lora = split_lora_leaves(tunix_param_leaves(rollout_actor))
    self.dtype = jnp.dtype(
      self.rollout_config.data_type or params["embedder.input_embedding"].dtype
    )
    module = engine_module(self.config)
    abstract = abstract_module(module, self.config, self.dtype)
    graphdef, abstract_weights = nnx.split(abstract)
    self.device = _engine_device(mesh, params["embedder.input_embedding"])
    #: The adapter every rollout runs with (a qwix LoRA actor), else None.
    self.lora_request: LoRARequest | None = None
    self._lora_scales: dict[tuple[int, str], float] = {}
    if lora:
      self._lora_scales = _actor_lora_scales(rollout_actor, lora, lora_alpha)
      _lora_engine_options(engine_options, lora)
    elif lora_alpha is not None:
      raise ValueError(f"lora_alpha={lora_alpha!r} given, but the rollout actor has no LoRA")
    engine_placement(self.rollout_config, mesh, self.device, engine_options, lora=bool(lora))
    engine_mesh = engine_options.get("mesh")
    devices = list(engine_mesh.devices.flat) if engine_mesh is not None else [self.device]
    engine_options["gpu_memory_utilization"] = process_memory_fraction(fraction, devices)
    leaves = engine_leaves(
      params, self.config, self.dtype, self.device, chunk_bytes=reshard_chunk_bytes
    )
    weights = replace_leaves(abstract_weights, leaves)
    engine_options.setdefault("compilation_cache", False)
    engine_options.setdefault("num_decode_steps", DEFAULT_NUM_DECODE_STEPS)
    self.llm = LLM(
      nnx.merge(graphdef, weights),
      max_model_len=max_model_len,
      logprobs_mode="processed_logprobs",
      **engine_options,
    )
    #: The engine model's float layout (abstract): a sync's converted leaves fill it, and
    #: `LLM.load_weights` casts them and, with `quantization`, re-quantizes them.
    self._float_weights = abstract_weights
    # The runner's own module structure (with `quantization`, its int8 / float8 values and
    # scales): what `completion_logprobs` merges the runner's weights into.
    self._graphdef = nnx.graphdef(self.llm.llm_engine.runner.model)
    if lora:
      self.lora_request = LoRARequest("tunix_actor", 1, "<tunix rollout actor, in memory>")
      self.llm.load_lora_weights(self.lora_request, self._lora_adapter(lora))

  # --- BaseRollout --------------------------------------------------------------------------

  def generate(
    self, prompts: list[str], rollout_config: base_rollout.RolloutConfig, **kwargs
  ) -> base_rollout.RolloutOutput:
    """Samples a completion of each prompt with the engine.

    Args:
      prompts: prompt strings (tokenized as `tokenize_prompts` does).
      rollout_config: this call's `RolloutConfig` (see the class docstring for the fields used).
      **kwargs: ignored (Tunix's engines accept extra keywords).

    Returns:
      `RolloutOutput`: `text`, `tokens` (one `int32` array per prompt, without the stop token),
      `left_padded_prompt_tokens` (`[num_prompts, width] int32`), `logprobs` (one `float32`
      array per prompt when `return_logprobs`, Tunix's convention), `logits` empty.

    Raises:
      ValueError: no prompts, or a prompt plus `max_tokens_to_generate` longer than the
        engine's `max_model_len` (nothing runs then).
    """
    del kwargs
    if not prompts:
      raise ValueError("prompts is empty")
    padded = tokenize_prompts(self.tokenizer, prompts, rollout_config.max_prompt_length)
    needed = padded.left_padded.shape[1] + rollout_config.max_tokens_to_generate
    max_model_len = self.llm.config.max_model_len
    if needed > max_model_len:
      raise ValueError(
        f"max_prompt_length (padded: {padded.left_padded.shape[1]}) + max_tokens_to_generate "
        f"({rollout_config.max_tokens_to_generate}) = {needed} exceeds the engine's "
        f"max_model_len={max_model_len} (pass max_model_len= or raise kv_cache_size)"
      )
    eos_ids = list(rollout_config.eos_tokens or [self.tokenizer.eos_id()])
    seeds = _request_seeds(rollout_config.seed, len(prompts))
    params = [sampling_params(rollout_config, eos_ids, s) for s in seeds]
    outputs = self.llm.generate(
      [{"prompt_token_ids": ids.tolist()} for ids in padded.token_ids],
      params,
      use_tqdm=False,
      lora_request=self.lora_request,
    )
    tokens, logprobs = [], []
    for out in outputs:
      completion = out.outputs[0]
      ids = list(completion.token_ids)
      if ids and ids[-1] in eos_ids and completion.finish_reason == "stop":
        ids = ids[:-1]  # Tunix's tokens stop before the EOS
      tokens.append(np.asarray(ids, np.int32))
      if completion.logprobs is not None:
        values = [step[t].logprob for step, t in zip(completion.logprobs, ids)]
        logprobs.append(np.asarray(values, np.float32))
    if rollout_config.return_logprobs and self._needs_recompute(rollout_config):
      logprobs = self._recomputed_logprobs(padded.left_padded, tokens, rollout_config)
    return base_rollout.RolloutOutput(
      text=[self.tokenizer.decode(t.tolist()) for t in tokens],
      logits=[],
      tokens=tokens,
      left_padded_prompt_tokens=padded.left_padded,
      logprobs=logprobs if rollout_config.return_logprobs else None,
    )

  def get_per_token_logps(
    self, prompt_tokens: jax.Array, completion_tokens: jax.Array
  ) -> jax.Array:
    """The engine model's teacher-forced logprobs of the completions (Tunix's convention).

    Args:
      prompt_tokens: `[B, P] int32` left-padded prompts (as `generate` returned them).
      completion_tokens: `[B, C] int32` completions, right-padded with the pad id.

    Returns:
      `[B, C] float32` log-softmax of the logits divided by the TRAIN rollout temperature (none
      for temperature 0 or 1, as Tunix's `compute_per_token_logps`); 0 at pad positions.
    """
    token_ids = np.concatenate([np.asarray(prompt_tokens), np.asarray(completion_tokens)], axis=1)
    temperature = float(self.rollout_config.temperature)
    return self._logprobs(token_ids.astype(np.int32), completion_tokens.shape[1], temperature)

  def update_params(self, params: Any, filter_types: tuple[Any, ...] | None = None) -> None:
    """Loads the trainer's weights into the engine; nothing recompiles.

    Args:
      params: the Tunix model's parameter state: ``nnx.state(actor, nnx.Param)`` (every weight;
        on a qwix LoRA actor its `nnx.LoRAParam` leaves too, a subclass of `nnx.Param`), or
        ``nnx.state(actor, nnx.LoRAParam)`` (the LoRA leaves alone: Tunix's sync after each step
        of a LoRA actor, which replaces the adapter's values in place, read from memory); or
        the engine model's own float state (as `model()` gives it; Tunix passes that when it
        offloads). JAX arrays are converted where they live and placed as the engine's weights
        are (LoRA pairs, small, are copied through the host). With `quantization` the float
        weights are re-quantized on the way in (`LLM.load_weights`).
      filter_types: Tunix's filter: ``(nnx.Param,)``, ``(nnx.LoRAParam,)`` or None.

    Raises:
      ValueError: (nothing changes) another filter type, LoRA parameters for a rollout built
        without LoRA or of an unsupported name or shape (named), parameters that do not
        match the model, or a quantized engine's own state (its values and scales).
    """
    lora_only = filter_types is not None and all(t is nnx.LoRAParam for t in filter_types)
    if filter_types is not None and not lora_only and any(t is not nnx.Param for t in filter_types):
      raise ValueError(f"filter_types={filter_types}: only nnx.Param or nnx.LoRAParam")
    if isinstance(params, nnx.State) and self._is_engine_state(params):
      with self._kv_cache_freed():
        self.llm.load_weights(params)
      return
    if lora_only and self.lora_request is None:
      raise ValueError(f"filter_types={filter_types}: this rollout was built without LoRA")
    base, lora = split_lora_leaves(tunix_param_leaves(params))
    if lora and self.lora_request is None:
      raise ValueError(
        f"LoRA parameter {next(iter(lora))!r}: this rollout was built from an actor without "
        "LoRA (build it from the qwix LoRA model)"
      )
    if lora_only and base:
      raise ValueError(
        f"filter_types=(nnx.LoRAParam,) with a non-LoRA parameter {next(iter(base))!r}"
      )
    adapter = self._lora_adapter(lora) if lora else None  # checked before anything changes
    if not lora_only:
      check_tunix_params(base, self.config)  # on the host, before the KV cache is freed
      with self._kv_cache_freed():
        leaves = engine_leaves(
          base,
          self.config,
          self.dtype,
          self.device,
          shardings=self._weight_shardings(),
          chunk_bytes=self.reshard_chunk_bytes,
        )
        self.llm.load_weights(replace_leaves(self._float_weights, leaves))
    if adapter is not None:
      self.llm.load_lora_weights(cast(LoRARequest, self.lora_request), adapter)

  def _is_engine_state(self, params: nnx.State) -> bool:
    """Whether `params` is a state of the engine model's float layout (as `model()` gives it
    without `quantization`), which `LLM.load_weights` takes as it is.

    Raises:
      ValueError: the state of a quantized engine's own layout (its int8 / float8 values and
        scales: the runner re-quantizes float weights only).
    """
    paths = set(state_leaves(params))
    if paths == set(state_leaves(self._float_weights)):
      return True
    runner = self.llm.llm_engine.runner
    if runner.quantized and paths == set(state_leaves(runner.weights)):
      raise ValueError(
        f"update_params got the quantized engine's own state (quantization="
        f"{self.llm.config.quantization!r}); pass the trainer's float parameters"
      )
    return False

  @contextlib.contextmanager
  def _kv_cache_freed(self) -> Iterator[None]:
    """With `free_kv_cache_during_sync`, the engine's KV cache is freed inside (its bytes in
    `kv_cache_bytes_freed`) and a fresh one of the same pages made after, even on an error
    (`LLMEngine.free_kv_cache`, ``wake_up(tags=["kv_cache"])``: nothing compiles)."""
    engine = self.llm.llm_engine
    if not self.free_kv_cache_during_sync or engine.is_sleeping():
      yield
      return
    self.kv_cache_bytes_freed = engine.free_kv_cache()
    try:
      yield
    finally:
      engine.wake_up(["kv_cache"])

  def _weight_shardings(self) -> dict[Any, jax.sharding.Sharding] | None:
    """The engine's weight shardings by leaf path (where a sync puts each converted leaf,
    chunk by chunk), or None when the weights are not committed to a placement (an engine
    without a mesh)."""
    leaves = state_leaves(self.llm.llm_engine.runner.weights)
    if not all(getattr(leaf, "committed", False) for leaf in leaves.values()):
      return None
    return {path: leaf.sharding for path, leaf in leaves.items()}

  def _lora_adapter(self, lora: dict[str, Any]) -> LoRAAdapter:
    """The engine adapter of qwix LoRA leaves, checked against the engine's slots (ValueError,
    naming the leaf or pair, otherwise)."""
    manager = self.llm.llm_engine.runner.lora
    if manager is None:
      raise ValueError("the engine was built without enable_lora")
    adapter = lora_adapter_from_tunix(
      lora,
      lora_int_id=1,
      num_layers=self.config.num_hidden_layers,
      scales=self._lora_scales,
      targets=manager.target_shapes,
    )
    manager.check_adapter(adapter)
    return adapter

  def pad_id(self) -> int:
    """The tokenizer's pad id."""
    return self.tokenizer.pad_id()

  def eos_id(self) -> int:
    """The tokenizer's EOS id."""
    return self.tokenizer.eos_id()

  def model(self) -> nnx.Module | None:
    """The engine's model (a `jaxengine.models.Llama` or `jaxengine.models.gemma.Gemma` over the
    engine's current weights), or None for a LoRA actor's rollout and a quantized one.

    Tunix reads it to decide whether the rollout shares the actor's weights (comparing the two
    modules' leaves one by one, which fails outright when their counts differ: a LoRA actor
    has its adapter's leaves besides the base's, a quantized module its scales besides the
    weights) and, with ``offload_to_cpu``, to move it to host memory between phases. A LoRA or
    quantized rollout answers None, as Tunix's own `RolloutEngineGroup` does for LoRA: Tunix
    then syncs the weights every step and cannot offload the engine (`LLM.sleep` frees its
    memory instead).
    """
    if self.lora_request is not None or self.llm.llm_engine.runner.quantized:
      return None
    return cast(nnx.Module, self.llm.llm_engine.runner.model)

  # --- logprobs ------------------------------------------------------------------------------

  @staticmethod
  def _needs_recompute(config: base_rollout.RolloutConfig) -> bool:
    """The engine's processed logprobs renormalise over the top-k/top-p cut; Tunix's do not."""
    if _is_greedy(config):
      return False
    top_p_on = config.top_p is not None and config.top_p < 1.0
    return top_p_on or bool(config.top_k and config.top_k > 0)

  def _logprobs(
    self, token_ids: np.ndarray, num_completion_tokens: int, temperature: float
  ) -> jax.Array:
    """`completion_logprobs` with the engine's current weights; Tunix divides the logits by the
    temperature unless it is 0 or 1."""
    inverse = 1.0 if temperature in (0.0, 1.0) else 1.0 / temperature
    return completion_logprobs(
      self._graphdef,
      self.llm.llm_engine.runner.weights,
      token_ids,
      np.float32(inverse),
      self._lora_inputs(token_ids.size),
      pad_id=int(self.pad_id()),
      num_completion_tokens=int(num_completion_tokens),
    )

  def _lora_inputs(self, num_tokens: int) -> LoRAInputs | None:
    """The engine's LoRA slots with every one of `num_tokens` tokens in the actor adapter's
    slot (placed there first if no rollout has yet), or None without LoRA."""
    manager = self.llm.llm_engine.runner.lora
    if self.lora_request is None or manager is None:
      return None
    manager.acquire("tunix-teacher-forcing", self.lora_request)  # places it when needed
    slot = manager.slot("tunix-teacher-forcing")
    manager.release("tunix-teacher-forcing")
    return manager.inputs(jnp.full((num_tokens,), slot, jnp.int32))

  def _recomputed_logprobs(
    self,
    left_padded: np.ndarray,
    tokens: list[np.ndarray],
    config: base_rollout.RolloutConfig,
  ) -> list[np.ndarray]:
    width = int(config.max_tokens_to_generate)
    completions = np.full((len(tokens), width), self.pad_id(), np.int32)
    for row, ids in enumerate(tokens):
      completions[row, : len(ids)] = ids
    token_ids = np.concatenate([left_padded, completions], axis=1)
    values = np.asarray(self._logprobs(token_ids, width, float(config.temperature)))
    return [values[row, : len(ids)] for row, ids in enumerate(tokens)]
