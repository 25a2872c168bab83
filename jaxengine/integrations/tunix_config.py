"""Tunix's Llama 3, Qwen2, Qwen3 (dense, MoE), Gemma and Gemma 3 modules as engine configs: the
`LlamaConfig` or `GemmaConfig` whose engine model computes what the Tunix module computes
(`config_from_tunix`), and that model's class (`engine_module`). Their weights are mapped by
`jaxengine.integrations.tunix_weights`.

Rotary base: Tunix 0.1.7's Llama 3 and Qwen3 attention call their `apply_rope` without the
config's ``rope_theta``, so they rotate with that function's default base (1,000,000) whatever the
config says; Qwen2 passes its ``rope_theta``. The engine model uses the base the Tunix module
actually computes with (`effective_rope_theta`), so both give the same logits.

Tunix's Gemma rotates with base 10,000 on every layer and scales queries by
``head_dim ** -0.5`` (whatever a Gemma 2 checkpoint's ``query_pre_attn_scalar``); Gemma 3 by its
config's `query_pre_attn_norm`, with its local and global bases and scale factors.
"""

from __future__ import annotations

import inspect
import itertools
from typing import Any

from jaxengine.integrations import missing_extra

try:
  from tunix.models.gemma import model as tunix_gemma
  from tunix.models.gemma3 import model as tunix_gemma3
  from tunix.models.llama3 import model as tunix_llama3
  from tunix.models.qwen2 import model as tunix_qwen2
  from tunix.models.qwen3 import model as tunix_qwen3
except ModuleNotFoundError as error:  # the extra is not installed: say how to install it
  raise missing_extra(error, __name__) from error

from jaxengine.models.gemma import Gemma
from jaxengine.models.gemma_config import FULL, SLIDING, GemmaConfig, GemmaRope
from jaxengine.models.llama import Llama
from jaxengine.models.llama_config import LlamaConfig

__all__ = [
  "GEMMA_MODELS",
  "LLAMA_MODELS",
  "SUPPORTED_MODELS",
  "EngineConfig",
  "check_not_hybrid",
  "config_from_tunix",
  "effective_rope_theta",
  "engine_module",
  "gemma_config_from_tunix",
  "llama_config_from_tunix",
]

#: The Tunix decoder classes the rollout serves through `jaxengine.models.Llama`.
LLAMA_MODELS = (tunix_llama3.Llama3, tunix_qwen2.Qwen2, tunix_qwen3.Qwen3)
#: ... and through `jaxengine.models.gemma.Gemma`.
GEMMA_MODELS = (tunix_gemma.Gemma, tunix_gemma3.Gemma3)
#: The Tunix decoder classes the rollout serves.
SUPPORTED_MODELS = (*LLAMA_MODELS, *GEMMA_MODELS)
#: The engine config of either family.
EngineConfig = LlamaConfig | GemmaConfig


def effective_rope_theta(model: Any) -> float:
  """The rotary base the Tunix module computes with (see the module docstring).

  Llama 3 and Qwen3 use their `apply_rope`'s default base unless their attention passes
  ``rope_theta`` (checked on the source, so a Tunix release that passes it is followed).
  """
  if isinstance(model, tunix_qwen2.Qwen2):
    return float(model.config.rope_theta)
  module = tunix_llama3 if isinstance(model, tunix_llama3.Llama3) else tunix_qwen3
  try:
    passes_theta = "rope_theta" in inspect.getsource(module.Attention.block)
  except (OSError, TypeError):  # no source: Tunix 0.1.7's behaviour
    passes_theta = False
  if passes_theta:
    return float(model.config.rope_theta)
  return float(inspect.signature(module.apply_rope).parameters["rope_theta"].default)


def llama_config_from_tunix(
  model: Any,
  *,
  max_position_embeddings: int,
  bos_token_id: int | None,
  eos_token_id: int | None,
) -> LlamaConfig:
  """The `LlamaConfig` of an engine model computing what the Tunix `model` computes.

  Args:
    model: a Tunix `Llama3`, `Qwen2` or `Qwen3` (a Qwen3 with ``num_experts`` gets a
      mixture-of-experts block on every layer, its top-k weights renormalised, as Tunix's
      `MoELayer` computes).
    max_position_embeddings: longest sequence the engine will run (its `max_model_len` bound).
    bos_token_id, eos_token_id: the tokenizer's ids (informational for the engine model).

  Returns:
    The config; `tie_word_embeddings` follows the Tunix model's weight tying.

  Raises:
    ValueError: another model class.
  """
  if not isinstance(model, LLAMA_MODELS):
    raise ValueError(
      f"rollout_actor must be a Tunix Llama3, Qwen2 or Qwen3 model, got {type(model).__name__}"
    )
  cfg = model.config
  experts = getattr(cfg, "num_experts", None) or 0
  moe = dict(
    num_experts=experts,
    num_experts_per_tok=getattr(cfg, "num_experts_per_tok", None) or 0,
    moe_intermediate_size=cfg.hidden_dim,
    norm_topk_prob=True,
    moe_layers=tuple(range(cfg.num_layers)),
  )
  tied = cfg.weight_tying if isinstance(model, tunix_llama3.Llama3) else cfg.use_tied_embedding
  return LlamaConfig(
    vocab_size=cfg.vocab_size,
    hidden_size=cfg.embed_dim,
    intermediate_size=cfg.hidden_dim,
    num_hidden_layers=cfg.num_layers,
    num_attention_heads=cfg.num_heads,
    num_key_value_heads=cfg.num_kv_heads,
    head_dim=cfg.head_dim,
    rope_theta=effective_rope_theta(model),
    rms_norm_eps=cfg.norm_eps,
    tie_word_embeddings=bool(tied),
    max_position_embeddings=max_position_embeddings,
    bos_token_id=bos_token_id,
    eos_token_id=eos_token_id,
    attention_bias=isinstance(model, tunix_qwen2.Qwen2),
    qk_norm=isinstance(model, tunix_qwen3.Qwen3),
    **(moe if experts else {}),
  )


def gemma_config_from_tunix(
  model: Any,
  *,
  max_position_embeddings: int,
  bos_token_id: int | None,
  eos_token_id: int | None,
) -> GemmaConfig:
  """The `GemmaConfig` of an engine model computing what the Tunix `model` computes.

  Args:
    model: a Tunix `Gemma` (Gemma 1 or 2) or `Gemma3` (its text model).
    max_position_embeddings, bos_token_id, eos_token_id: as `llama_config_from_tunix`.

  Raises:
    ValueError: another model class, or a Gemma with one post norm and not the other.
  """
  if not isinstance(model, GEMMA_MODELS):
    raise ValueError(f"expected a Tunix Gemma or Gemma3 model, got {type(model).__name__}")
  cfg = model.config
  gemma3 = isinstance(model, tunix_gemma3.Gemma3)
  if gemma3:
    kinds = itertools.cycle(tunix_gemma3.GEMMA3_ATTENTION_PATTERN)
    local_kind = tunix_gemma3.AttentionType.LOCAL_SLIDING
    by_head_dim = tunix_gemma3.QueryPreAttentionNormalisation.BY_ONE_OVER_SQRT_HEAD_DIM
    scalar = (
      cfg.head_dim if cfg.query_pre_attn_norm == by_head_dim else cfg.embed_dim // cfg.num_heads
    )
    rope_local = GemmaRope(theta=cfg.local_base_frequency, factor=cfg.local_scale_factor)
    rope_global = GemmaRope(theta=cfg.global_base_frequency, factor=cfg.global_scale_factor)
    caps: tuple[float | None, float | None] = (None, None)
  else:
    if cfg.use_post_attn_norm != cfg.use_post_ffw_norm:
      raise ValueError(
        f"use_post_attn_norm={cfg.use_post_attn_norm} with use_post_ffw_norm="
        f"{cfg.use_post_ffw_norm} is not supported (both or neither)"
      )
    kinds, local_kind = iter(cfg.attention_types), tunix_gemma.AttentionType.LOCAL_SLIDING
    scalar = cfg.head_dim
    rope_local = rope_global = GemmaRope(theta=10_000.0)
    caps = (cfg.attn_logits_soft_cap, cfg.final_logit_softcap)
  layer_types = tuple(
    SLIDING if kind == local_kind else FULL for _, kind in zip(range(cfg.num_layers), kinds)
  )
  return GemmaConfig(
    vocab_size=cfg.num_embed,
    hidden_size=cfg.embed_dim,
    intermediate_size=cfg.hidden_dim,
    num_hidden_layers=cfg.num_layers,
    num_attention_heads=cfg.num_heads,
    num_key_value_heads=cfg.num_kv_heads,
    head_dim=cfg.head_dim,
    layer_types=layer_types,
    sliding_window=cfg.sliding_window_size if SLIDING in layer_types else None,
    rope_global=rope_global,
    rope_local=rope_local,
    query_pre_attn_scalar=float(scalar),
    attn_logit_softcapping=caps[0],
    final_logit_softcapping=caps[1],
    qk_norm=gemma3,
    post_norms=gemma3 or bool(cfg.use_post_attn_norm),
    rms_norm_eps=1e-6,  # Tunix's RMSNorm
    tie_word_embeddings=True,
    max_position_embeddings=max_position_embeddings,
    bos_token_id=bos_token_id,
    eos_token_id=eos_token_id,
  )


def check_not_hybrid(model: Any) -> None:
  """Refuses a Qwen3.5 hybrid (Gated DeltaNet layers beside attention) as the rollout actor.

  Tunix (google-tunix 0.1.7, the version this integration is built on) has no Qwen3.5 model class,
  so no trainer module exists to map weights from; jaxengine's own `Qwen3_5` (any module with a
  ``recurrent_state_spec``) is served by `jaxengine.LLM`, not by the rollout, which maps a Tunix
  module's parameters.

  Raises:
    ValueError: such a model, naming its class and the installed google-tunix version.
  """
  if not hasattr(model, "recurrent_state_spec"):
    return
  from importlib import metadata

  try:
    version = metadata.version("google-tunix")
  except metadata.PackageNotFoundError:  # Tunix imported from a source tree
    version = "(installed)"
  raise ValueError(
    f"rollout_actor {type(model).__name__} is a Qwen3.5 hybrid model: google-tunix {version} "
    "has no Qwen3.5 model class, so JaxEngineRollout cannot serve it (serve a Qwen3.5 "
    "checkpoint with jaxengine.LLM)"
  )


def config_from_tunix(model: Any, **fields: Any) -> EngineConfig:
  """`llama_config_from_tunix` or `gemma_config_from_tunix`, by the model's class.

  Raises:
    ValueError: a Qwen3.5 hybrid (`check_not_hybrid`), or another class outside
      `SUPPORTED_MODELS` (the supported ones named).
  """
  check_not_hybrid(model)
  if isinstance(model, GEMMA_MODELS):
    return gemma_config_from_tunix(model, **fields)
  if not isinstance(model, LLAMA_MODELS):
    raise ValueError(
      "rollout_actor must be a Tunix Llama3, Qwen2, Qwen3, Gemma or Gemma3 model, got "
      f"{type(model).__name__}"
    )
  return llama_config_from_tunix(model, **fields)


def engine_module(config: EngineConfig) -> type:
  """The engine's NNX class for `config`: `Gemma` or `Llama`."""
  return Gemma if isinstance(config, GemmaConfig) else Llama
