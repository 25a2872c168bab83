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
`jaxengine.models.gemma.Gemma`) holding the same weights (`tunix_weights` maps the names and
layouts, on the devices where the arrays are). It runs in the trainer's process, on its devices,
with per-request seeds and no recompiles when the weights change: after each training step Tunix
calls `update_params` with the trainer's `nnx.Param` state, which goes through `LLM.load_weights`
(which re-quantizes it for an engine built with ``quantization="int8"`` or ``"fp8"``). `model()`
is the engine's module, never the trainer's, so Tunix syncs the weights after every step whether
the rollout has its own mesh or shares the trainer's.

Logprobs follow Tunix's convention: the log-softmax of the logits divided by the rollout
temperature (raw logits for greedy decoding), of the whole vocabulary (top-k and top-p do not
renormalise them), which is what its trainer recomputes (`compute_per_token_logps`).

The class drives its siblings in `jaxengine.integrations`: `tunix_placement` (the engine's mesh
and memory share), `tunix_sampling` (prompts and `RolloutConfig` as requests), `tunix_weights`
(weight conversion), `tunix_weight_sync` (`update_params`, and the pause, update, resume of an
asynchronous pipeline, with `generate` safe to call from several threads), `tunix_lora` (a LoRA
actor) and `tunix_logprobs` (teacher-forced logprobs).
"""

from __future__ import annotations

from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxengine.integrations import missing_extra

try:
  from tunix.generate import tokenizer_adapter
  from tunix.rl.rollout import base_rollout
except ModuleNotFoundError as error:  # the extra is not installed: say how to install it
  raise missing_extra(error, __name__) from error

from jaxengine.entrypoints.llm import LLM
from jaxengine.integrations.tunix_logprobs import (
  completion_logprobs,
  engine_logprobs,
  needs_recompute,
  recomputed_logprobs,
)
from jaxengine.integrations.tunix_lora import (
  actor_lora_scales,
  lora_adapter_from_tunix,
  lora_engine_options,
  split_lora_leaves,
)
from jaxengine.integrations.tunix_placement import (
  PARALLEL_FIELDS,
  engine_device,
  engine_placement,
  process_memory_fraction,
  rollout_memory_fraction,
)
from jaxengine.integrations.tunix_sampling import (
  PaddedPrompts,
  request_seeds,
  sampling_params,
  tokenize_prompts,
)
from jaxengine.integrations.tunix_weight_sync import TunixWeightSync
from jaxengine.integrations.tunix_weights import (
  EngineConfig,
  check_chunk_bytes,
  config_from_tunix,
  engine_leaves,
  engine_module,
  tunix_param_leaves,
)
from jaxengine.lora import LoRAAdapter, LoRARequest
from jaxengine.models.quantization import check_quantization
from jaxengine.models.weights import abstract_module, replace_leaves

__all__ = [
  "DEFAULT_NUM_DECODE_STEPS",
  "PARALLEL_FIELDS",
  "JaxEngineRollout",
  "PaddedPrompts",
  "completion_logprobs",
  "engine_placement",
  "process_memory_fraction",
  "sampling_params",
  "tokenize_prompts",
]


#: The engine's `num_decode_steps` unless given: decode steps per device dispatch. A rollout
#: decodes its whole batch to the end, so a device loop of up to 16 steps (which ends early once
#: every row has stopped) pays the host round trip once per 16 tokens instead of every token:
#: on the tiny model of `examples/tunix_grpo.py` the rollout's steady step went from 0.09 s to
#: 0.02-0.04 s on a 2-core CPU.
DEFAULT_NUM_DECODE_STEPS = 16


class JaxEngineRollout(TunixWeightSync, base_rollout.BaseRollout):
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
      Tunix has no Qwen3.5 class: a Qwen3.5 hybrid is refused (`tunix_config.check_not_hybrid`).
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
    ValueError: an unsupported model (a Qwen3.5 hybrid named as such), a `mesh` that is not a
      `jax.sharding.Mesh`, `logprobs_mode` among the options, invalid options (an unknown
      `quantization`, a memory fraction outside (0, 1], a `reshard_chunk_bytes` that is not a
      positive int, parallel sizes that conflict or do not fit the rollout mesh:
      `engine_placement`), or a LoRA actor whose LoRA is unsupported (named), whose scale is
      unknown, or whose rank exceeds a given `max_lora_rank`.
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
    if engine_options.get("scan_layers") not in (None, False):
      raise ValueError(
        f"scan_layers={engine_options['scan_layers']!r}: JaxEngineRollout's weight sync maps "
        "the trainer's per-layer parameters onto unrolled layers (stacked layers, issue 54, are "
        "not synced yet); use scan_layers=False or leave it out"
      )
    engine_options["scan_layers"] = False  # not the platform's default: see above
    self.rollout_config = rollout_config or base_rollout.RolloutConfig()
    self.tokenizer = (
      tokenizer
      if isinstance(tokenizer, tokenizer_adapter.TokenizerAdapter)
      else tokenizer_adapter.TokenizerAdapter(tokenizer)
    )
    self.rollout_mesh = mesh
    fraction, _ = rollout_memory_fraction(engine_options, self.rollout_config)
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
    self.device = engine_device(mesh, params["embedder.input_embedding"])
    #: The adapter every rollout runs with (a qwix LoRA actor), else None.
    self.lora_request: LoRARequest | None = None
    self._lora_scales: dict[tuple[int, str], float] = {}
    if lora:
      self._lora_scales = actor_lora_scales(lora, lora_alpha)
      lora_engine_options(engine_options, lora)
    elif lora_alpha is not None:
      raise ValueError(f"lora_alpha={lora_alpha!r} given, but the rollout actor has no LoRA")
    engine_placement(self.rollout_config, mesh, self.device, engine_options)
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
    self._init_weight_sync()
    if lora:
      self.lora_request = LoRARequest("tunix_actor", 1, "<tunix rollout actor, in memory>")
      self.llm.load_lora_weights(self.lora_request, self._lora_adapter(lora))

  # --- BaseRollout --------------------------------------------------------------------------

  def generate(
    self, prompts: list[str], rollout_config: base_rollout.RolloutConfig, **kwargs
  ) -> base_rollout.RolloutOutput:
    """Samples a completion of each prompt with the engine (from any thread: calls share the
    engine step by step; while generation is paused the call waits, `tunix_weight_sync`).

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
    seeds = request_seeds(rollout_config.seed, len(prompts))
    params = [sampling_params(rollout_config, eos_ids, s) for s in seeds]
    outputs = self.generate_outputs(
      [{"prompt_token_ids": ids.tolist()} for ids in padded.token_ids], params
    )  # one step at a time with the other threads' calls, waiting while paused
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
    if rollout_config.return_logprobs and needs_recompute(rollout_config):
      logprobs = recomputed_logprobs(
        self.llm,
        self._graphdef,
        padded.left_padded,
        tokens,
        rollout_config,
        pad_id=int(self.pad_id()),
        lora_request=self.lora_request,
      )
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
    return engine_logprobs(
      self.llm,
      self._graphdef,
      token_ids.astype(np.int32),
      completion_tokens.shape[1],
      float(self.rollout_config.temperature),
      pad_id=int(self.pad_id()),
      lora_request=self.lora_request,
    )

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
