"""Hyper-parameters of Gemma 2 and Gemma 3 (text) and the rotary frequencies of their layers.

`GemmaConfig` describes both generations: Gemma 3 adds q/k norms and a second rotary base for
its local layers, Gemma 2 soft-caps its attention logits; both alternate local (sliding-window)
and global attention layers (`layer_types`) and may soft-cap the final logits.
`jaxengine.models.gemma` builds the decoder from it; `jaxengine.models.gemma_checkpoints` reads
it from a Hugging Face ``config.json``.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxengine.models.kv_cache import KVCacheSpec

#: A layer with a sliding window (Hugging Face's ``layer_types`` name).
SLIDING = "sliding_attention"
#: A layer attending to every earlier position.
FULL = "full_attention"
#: ``hidden_activation`` -> whether the GELU is the tanh approximation (True) or exact.
ACTIVATIONS = {"gelu_pytorch_tanh": True, "gelu_new": True, "gelu_fast": True, "gelu": False}


@dataclasses.dataclass(frozen=True, kw_only=True)
class GemmaRope:
  """The rotary embedding of one kind of layer.

  Attributes:
    theta: rotary base; frequency ``i`` is ``theta ** (-2 i / D) / factor``.
    factor: linear position interpolation (``rope_type: "linear"``): every frequency divided
      by it; 1.0 for plain RoPE.
  """

  theta: float = 10000.0
  factor: float = 1.0

  def __post_init__(self):
    if not self.theta > 0 or not self.factor > 0:
      raise ValueError(
        f"rope theta and factor must be positive, got theta={self.theta}, factor={self.factor}"
      )

  def frequencies(self, head_dim: int) -> np.ndarray:
    """``[D/2] float64`` rotary angle per position of each feature pair (a host constant)."""
    return (
      1.0 / self.theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim) / self.factor
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class GemmaConfig:
  """Hyper-parameters of a Gemma 2 or Gemma 3 text model.

  Hashable, so it can be a static argument or live in an NNX graph definition.

  Attributes:
    vocab_size: rows of the embedding (and of the output projection).
    hidden_size: width ``E`` of the residual stream.
    intermediate_size: width ``F`` of the GeGLU MLP.
    num_hidden_layers: decoder layers ``L``.
    num_attention_heads: query heads ``H``.
    num_key_value_heads: key/value heads ``K``; must divide ``H``.
    head_dim: per-head width ``D`` (even).
    layer_types: ``L`` entries, `SLIDING` (local: a window of `sliding_window` positions) or
      `FULL` (global).
    sliding_window: the local layers' window ``W`` (a query sees itself and ``W - 1`` earlier
      positions); required when a layer is local.
    rope_global: rotary embedding of the global layers (Gemma 3: ``rope_theta``, and linear
      scaling from ``rope_scaling`` on 4B and larger).
    rope_local: rotary embedding of the local layers (Gemma 3: ``rope_local_base_freq``;
      Gemma 2: the same as the global layers).
    query_pre_attn_scalar: the attention scale is ``query_pre_attn_scalar ** -0.5``.
    attn_logit_softcapping: scaled attention scores ``s`` become ``c * tanh(s / c)`` (Gemma 2),
      or None.
    final_logit_softcapping: logits ``z`` become ``c * tanh(z / c)``, or None.
    qk_norm: an RMSNorm over every query and key head before the rotary embedding (Gemma 3).
    post_norms: RMSNorms on the attention and MLP outputs before the residual sums (Gemma 2
      and 3; Gemma 1, served through Tunix, has neither).
    hidden_activation: the MLP's GELU, a key of `ACTIVATIONS`.
    rms_norm_eps: epsilon of every RMSNorm (all ``(1 + w)`` norms, in float32).
    tie_word_embeddings: the output projection reuses the embedding matrix.
    max_position_embeddings: the trained context length (informational).
    bos_token_id: beginning-of-sequence id, or None.
    eos_token_id: end-of-sequence id, or None.
    checkpoint_prefix: prefix of every tensor name in the checkpoint (``""``; a
      ``Gemma3ForConditionalGeneration`` checkpoint keeps its text model under
      ``"language_model."``).
    scan_layers: the decoder layers are stacked (every parameter ``[L, ...]``) and run as one
      `jax.lax.scan` over the repeating group of `layer_types` (`layer_period` layers an
      iteration, the layers after the last whole group unrolled:
      `jaxengine.models.layer_scan.scan_layer_groups`), with a stacked KV cache; False: one
      module per layer.
  """

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_hidden_layers: int
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int
  layer_types: tuple[str, ...]
  sliding_window: int | None = None
  rope_global: GemmaRope = GemmaRope()
  rope_local: GemmaRope = GemmaRope()
  query_pre_attn_scalar: float = 256.0
  attn_logit_softcapping: float | None = None
  final_logit_softcapping: float | None = None
  qk_norm: bool = False
  post_norms: bool = True
  hidden_activation: str = "gelu_pytorch_tanh"
  rms_norm_eps: float = 1e-6
  tie_word_embeddings: bool = True
  max_position_embeddings: int = 8192
  bos_token_id: int | None = 2
  eos_token_id: int | None = 1
  checkpoint_prefix: str = ""
  scan_layers: bool = False

  def __post_init__(self):
    if not isinstance(self.scan_layers, bool):
      raise ValueError(f"scan_layers must be a bool, got {self.scan_layers!r}")
    if self.num_attention_heads % self.num_key_value_heads:
      raise ValueError(
        f"num_attention_heads={self.num_attention_heads} is not a multiple of "
        f"num_key_value_heads={self.num_key_value_heads}"
      )
    if self.head_dim % 2:
      raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
    if len(self.layer_types) != self.num_hidden_layers:
      raise ValueError(
        f"layer_types has {len(self.layer_types)} entries for num_hidden_layers="
        f"{self.num_hidden_layers}"
      )
    unknown = sorted(set(self.layer_types) - {SLIDING, FULL})
    if unknown:
      raise ValueError(f"layer_types {unknown} are not supported ({SLIDING!r}, {FULL!r})")
    if SLIDING in self.layer_types and not (self.sliding_window and self.sliding_window > 0):
      raise ValueError(
        f"sliding_window must be a positive int with {SLIDING!r} layers, got {self.sliding_window}"
      )
    if self.hidden_activation not in ACTIVATIONS:
      raise ValueError(
        f"unsupported hidden_activation {self.hidden_activation!r}; supported: "
        f"{', '.join(ACTIVATIONS)}"
      )
    if not self.query_pre_attn_scalar > 0:
      raise ValueError(f"query_pre_attn_scalar must be positive, got {self.query_pre_attn_scalar}")
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
      cap = getattr(self, name)
      if cap is not None and not cap > 0:
        raise ValueError(f"{name} must be positive or null, got {cap}")

  def is_sliding(self, layer: int) -> bool:
    """Whether `layer` is a local (sliding-window) layer."""
    return self.layer_types[layer] == SLIDING

  def window(self, layer: int) -> int | None:
    """The sliding window of `layer`, or None for a global layer."""
    return self.sliding_window if self.is_sliding(layer) else None

  def rope(self, layer: int) -> GemmaRope:
    """The rotary embedding of `layer`'s kind."""
    return self.rope_local if self.is_sliding(layer) else self.rope_global

  @property
  def layer_period(self) -> int:
    """``P``, the length of the repeating group of `layer_types`: the smallest ``P`` with
    ``layer_types[i] == layer_types[i - P]`` for every ``i >= P`` (2 for Gemma 2's alternating
    layers, 6 for Gemma 3's five local and one global; ``L`` when nothing repeats). Layer ``i``
    is of the kind of layer ``i % P``."""
    types = self.layer_types
    return next((p for p in range(1, len(types) + 1) if types[p:] == types[: len(types) - p]), 1)

  def kv_cache_spec(self, dtype=jnp.float32) -> KVCacheSpec:
    """The `KVCacheSpec` of a model with this config storing keys and values in `dtype`: the
    local layers' window (and which layers they are) and the attention soft cap."""
    local = tuple(i for i in range(self.num_hidden_layers) if self.is_sliding(i))
    return KVCacheSpec(
      num_layers=self.num_hidden_layers,
      num_kv_heads=self.num_key_value_heads,
      head_dim=self.head_dim,
      dtype=dtype,
      sliding_window=self.sliding_window if local else None,
      sliding_window_layers=local or None,
      soft_cap=self.attn_logit_softcapping,
      stacked=self.scan_layers,
    )
