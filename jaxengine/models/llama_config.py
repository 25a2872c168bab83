"""Hyper-parameters of the Llama family (Llama 2/3/3.1, SmolLM, Mistral, Qwen2, Qwen3, and the
mixture-of-experts Qwen3-MoE and Mixtral) and the rotary frequencies they imply.

`LlamaConfig` switches the family's variants on and off (rope scaling, attention biases, q/k norm,
sliding window); `jaxengine.models.llama` builds the decoder from it and the loaders read it from
GGUF metadata or a Hugging Face `config.json`.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from jaxengine.models.kv_cache import KVCacheSpec


@dataclasses.dataclass(frozen=True, kw_only=True)
class Llama3RopeScaling:
  """Llama 3.1's rescaling of rotary frequencies for long contexts (``rope_type: "llama3"``).

  Attributes:
    factor: how much longer the new context is than the original (Llama 3.1: 8, Llama 3.2: 32).
    low_freq_factor: wavelengths above ``original_max_position_embeddings / low_freq_factor``
      are divided by ``factor`` (Llama 3.1: 1).
    high_freq_factor: wavelengths below ``original_max_position_embeddings / high_freq_factor``
      are kept (Llama 3.1: 4); those in between are interpolated.
    original_max_position_embeddings: the context length before scaling (Llama 3.1: 8192).
  """

  factor: float
  low_freq_factor: float
  high_freq_factor: float
  original_max_position_embeddings: int

  def __post_init__(self):
    if not self.factor > 0 or not 0 < self.low_freq_factor < self.high_freq_factor:
      raise ValueError(
        f"llama3 rope scaling needs factor > 0 and 0 < low_freq_factor < high_freq_factor, got "
        f"factor={self.factor}, low_freq_factor={self.low_freq_factor}, "
        f"high_freq_factor={self.high_freq_factor}"
      )
    if self.original_max_position_embeddings <= 0:
      raise ValueError(
        f"original_max_position_embeddings must be positive, got "
        f"{self.original_max_position_embeddings}"
      )


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig:
  """Hyper-parameters of a Llama-family model.

  Hashable, so it can be a static argument or live in an NNX graph definition.

  Attributes:
    vocab_size: rows of the embedding (and of the output projection).
    hidden_size: width ``E`` of the residual stream.
    intermediate_size: width ``F`` of the SwiGLU MLP.
    num_hidden_layers: number of decoder layers ``L``.
    num_attention_heads: query heads ``H``.
    num_key_value_heads: key/value heads ``K``; must divide ``H`` (grouped-query attention).
    head_dim: per-head width ``D``; must be even (rotary embedding rotates pairs).
    rope_theta: rotary base; frequency ``i`` is ``rope_theta ** (-2 i / D)``.
    rms_norm_eps: epsilon added to the mean square in every RMSNorm.
    tie_word_embeddings: if True the output projection reuses the embedding matrix.
    max_position_embeddings: context length the model was trained for (informational; the
      cache's ``max_model_len`` is what bounds positions at run time).
    bos_token_id: beginning-of-sequence token id, or None.
    eos_token_id: end-of-sequence token id, or None.
    rope_scaling: Llama 3.1 rotary frequency scaling, or None (plain RoPE).
    attention_bias: biases on the query, key and value projections (Qwen2).
    attention_output_bias: a bias on the attention output projection (Hugging Face Llama's
      ``attention_bias`` sets both this and ``attention_bias``).
    qk_norm: RMSNorm (a learned ``[D]`` scale shared by the heads) over every query and key head
      before the rotary embedding (Qwen3).
    sliding_window: each query attends to itself and the ``sliding_window - 1`` positions before
      it (Mistral), or None: every earlier position.
    num_experts: experts ``X`` of each sparse mixture-of-experts block (Qwen3-MoE's
      ``num_experts``, Mixtral's ``num_local_experts``); 0 for a dense model.
    num_experts_per_tok: experts ``k`` each token is routed to.
    moe_intermediate_size: width ``F`` of each expert's SwiGLU MLP.
    norm_topk_prob: renormalise each token's ``k`` routing weights to sum to one (Mixtral
      always; Qwen3-MoE's ``norm_topk_prob``).
    moe_layers: indices of the layers whose feed-forward block is a
      `jaxengine.models.moe.SparseMoeBlock` (the others keep the dense ``intermediate_size``
      MLP); empty for a dense model.
    moe_checkpoint_names: how checkpoints name the expert tensors: ``"qwen3_moe"``
      (``mlp.gate``, ``mlp.experts.{j}.{gate,up,down}_proj``) or ``"mixtral"``
      (``block_sparse_moe.gate``, ``block_sparse_moe.experts.{j}.w1/w3/w2``).
    scan_layers: the decoder layers are stacked (every parameter ``[L, ...]``) and run under
      `jax.lax.scan` (`jaxengine.models.layer_scan`), with a stacked KV cache; False: one
      module per layer, unrolled. Needs layers of one structure (``moe_layers`` empty or every
      layer).
  """

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_hidden_layers: int
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int
  rope_theta: float = 10000.0
  rms_norm_eps: float = 1e-5
  tie_word_embeddings: bool = True
  max_position_embeddings: int = 2048
  bos_token_id: int | None = 1
  eos_token_id: int | None = 2
  rope_scaling: Llama3RopeScaling | None = None
  attention_bias: bool = False
  attention_output_bias: bool = False
  qk_norm: bool = False
  sliding_window: int | None = None
  num_experts: int = 0
  num_experts_per_tok: int = 0
  moe_intermediate_size: int = 0
  norm_topk_prob: bool = True
  moe_layers: tuple[int, ...] = ()
  moe_checkpoint_names: str = "qwen3_moe"
  scan_layers: bool = False

  def __post_init__(self):
    if not isinstance(self.scan_layers, bool):
      raise ValueError(f"scan_layers must be a bool, got {self.scan_layers!r}")
    mixed = set(self.moe_layers) not in (set(), set(range(self.num_hidden_layers)))
    if self.scan_layers and mixed:
      raise ValueError(
        f"scan_layers=True needs layers of one structure, got moe_layers={self.moe_layers} of "
        f"{self.num_hidden_layers} layers (dense and mixture-of-experts layers mixed)"
      )
    if self.num_attention_heads % self.num_key_value_heads:
      raise ValueError(
        f"num_attention_heads={self.num_attention_heads} is not a multiple of "
        f"num_key_value_heads={self.num_key_value_heads}"
      )
    if self.head_dim % 2:
      raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
    if self.sliding_window is not None and self.sliding_window <= 0:
      raise ValueError(f"sliding_window must be positive or None, got {self.sliding_window}")
    self._check_moe()

  def _check_moe(self) -> None:
    """ValueError naming the field unless the mixture-of-experts fields fit together."""
    if not self.moe_layers:
      return
    if any(not 0 <= i < self.num_hidden_layers for i in self.moe_layers):
      raise ValueError(
        f"moe_layers={self.moe_layers} must lie in [0, num_hidden_layers={self.num_hidden_layers})"
      )
    if self.num_experts < 1 or self.moe_intermediate_size < 1:
      raise ValueError(
        f"a model with moe_layers needs num_experts >= 1 and moe_intermediate_size >= 1, got "
        f"num_experts={self.num_experts}, moe_intermediate_size={self.moe_intermediate_size}"
      )
    if not 1 <= self.num_experts_per_tok <= self.num_experts:
      raise ValueError(
        f"num_experts_per_tok={self.num_experts_per_tok} must lie in [1, num_experts="
        f"{self.num_experts}]"
      )
    if self.moe_checkpoint_names not in ("qwen3_moe", "mixtral"):
      raise ValueError(
        f"moe_checkpoint_names={self.moe_checkpoint_names!r} is not 'qwen3_moe' or 'mixtral'"
      )

  @property
  def num_queries_per_kv(self) -> int:
    """``G``: query heads that share one key/value head."""
    return self.num_attention_heads // self.num_key_value_heads

  def kv_cache_spec(self, dtype=jnp.float32) -> KVCacheSpec:
    """The `KVCacheSpec` of a model with this config storing keys and values in `dtype`."""
    return KVCacheSpec(
      num_layers=self.num_hidden_layers,
      num_kv_heads=self.num_key_value_heads,
      head_dim=self.head_dim,
      dtype=dtype,
      sliding_window=self.sliding_window,
      stacked=self.scan_layers,
    )


def rope_frequencies(config: LlamaConfig) -> np.ndarray:
  """The rotary angle per position of each feature pair, ``[D/2] float64`` (a host constant).

  Plain RoPE (Su et al., 2021): pair ``i`` turns by ``rope_theta ** (-2 i / D)`` radians per
  position. With `Llama3RopeScaling` each frequency ``f`` (wavelength ``w = 2 pi / f``) becomes,
  following Meta's reference ``apply_scaling`` (Llama 3.1 release, "The Llama 3 Herd of
  Models", 2024), with ``n = original_max_position_embeddings``:

  - ``f`` if ``w < n / high_freq_factor`` (high frequencies, short wavelengths, are kept);
  - ``f / factor`` if ``w > n / low_freq_factor`` (low frequencies are interpolated);
  - otherwise ``(1 - s) f / factor + s f`` with ``s = (n / w - low_freq_factor) /
    (high_freq_factor - low_freq_factor)``, a smooth blend of the two.

  The attention scale is unchanged by this scaling.
  """
  d = config.head_dim
  inv_freq = 1.0 / config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d)  # [D/2]
  scaling = config.rope_scaling
  if scaling is None:
    return inv_freq
  n = scaling.original_max_position_embeddings
  wavelength = 2 * math.pi / inv_freq
  smooth = (n / wavelength - scaling.low_freq_factor) / (
    scaling.high_freq_factor - scaling.low_freq_factor
  )
  blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
  return np.where(
    wavelength < n / scaling.high_freq_factor,
    inv_freq,
    np.where(wavelength > n / scaling.low_freq_factor, inv_freq / scaling.factor, blended),
  )
