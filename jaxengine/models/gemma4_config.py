"""Hyper-parameters of Gemma 4's text decoder, and what each layer derives from them.

`Gemma4Config` holds a ``Gemma4TextConfig``'s fields (read by
`jaxengine.models.gemma4_checkpoints.config_from_hf`); its methods answer the per-layer questions
`jaxengine.models.gemma4` asks: a layer's kind (local or global), head width, key/value heads,
rotary frequencies, whether it shares an earlier layer's keys and values (and whose), and the
cache layer it reads.

The cache (`kv_cache_spec`): only the layers that compute their own keys and values have pages
(the first ``L - num_kv_shared_layers``); a KV-shared layer reads the pages of the last earlier
layer of its kind. Local and global layers may differ in head width (``head_dim`` against
``global_head_dim``) and key/value heads (``num_global_key_value_heads`` with
``attention_k_eq_v``), while every page of the pool has one shape: pages are as wide as the
widest layer (``D_page``, the larger head width) with as many heads as the layer with the most
(``K_page``); a narrower layer stores its keys, values and queries zero-padded to ``D_page``
(zeros add nothing to a dot product; the padded output columns are dropped) and repeats each of
its ``K`` key/value heads ``K_page / K`` times (query head ``h`` then still reads head
``h // (H / K)`` of its own). Exact, and no change to the pages or the backends; the cost is
memory: a narrower layer's pages hold ``K_page * D_page / (K * D)`` times its own bytes.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxengine.models.gemma_config import ACTIVATIONS, FULL, SLIDING
from jaxengine.models.kv_cache import KVCacheSpec

#: The kinds of layer a scanned model stacks apart (`Gemma4Config.layer_kind`).
KINDS = ("sliding", "full", "shared_sliding", "shared_full")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Gemma4Rope:
  """The rotary embedding of one kind of layer.

  Attributes:
    theta: rotary base.
    factor: every frequency divided by it (``rope_parameters``' ``factor``; 1.0 by default).
    partial_rotary_factor: ``"proportional"`` rope: the fraction ``p`` of the feature pairs
      that rotate; the other ``D/2 - floor(p * D / 2)`` pairs get frequency 0 (kept as they
      are). 1.0: every pair rotates (``"default"``).
  """

  theta: float = 10000.0
  factor: float = 1.0
  partial_rotary_factor: float = 1.0

  def __post_init__(self):
    if not self.theta > 0 or not self.factor > 0:
      raise ValueError(
        f"rope theta and factor must be positive, got theta={self.theta}, factor={self.factor}"
      )
    if not 0.0 <= self.partial_rotary_factor <= 1.0:
      raise ValueError(f"partial_rotary_factor must be in [0, 1], got {self.partial_rotary_factor}")

  def frequencies(self, head_dim: int) -> np.ndarray:
    """``[D/2] float64`` rotary angle per position of each feature pair (a host constant):
    ``theta ** (-2 i / D) / factor`` for the first ``floor(p * D / 2)`` pairs, 0 after."""
    rotated = int(self.partial_rotary_factor * head_dim // 2)
    freqs = np.zeros(head_dim // 2, np.float64)
    freqs[:rotated] = 1.0 / self.theta ** (np.arange(0, 2 * rotated, 2) / head_dim)
    return freqs / self.factor


@dataclasses.dataclass(frozen=True, kw_only=True)
class Gemma4Config:
  """Hyper-parameters of a Gemma 4 text decoder (``Gemma4TextConfig``'s names).

  Hashable, so it can be a static argument or live in an NNX graph definition.

  Attributes:
    vocab_size: rows of the embedding ``V``.
    hidden_size: residual width ``E``.
    intermediate_size: dense MLP width ``F`` (twice that on KV-shared layers with
      `use_double_wide_mlp`).
    num_hidden_layers: decoder layers ``L``.
    num_attention_heads: query heads ``H``.
    num_key_value_heads: key/value heads of the local layers (and of the global ones without
      `attention_k_eq_v`).
    head_dim: local layers' head width.
    global_head_dim: global layers' head width (0: `head_dim`).
    num_global_key_value_heads: global layers' key/value heads with `attention_k_eq_v`.
    layer_types: ``L`` entries, `SLIDING` or `FULL`.
    sliding_window: the local layers' window ``W``.
    rope_local, rope_global: rotary embeddings of the local and global layers.
    final_logit_softcapping: logits ``z`` become ``c * tanh(z / c)``, or None.
    hidden_activation: the GELU of the MLPs and of the per-layer inputs (`ACTIVATIONS`).
    rms_norm_eps: epsilon of every RMSNorm.
    tie_word_embeddings: the output projection is the embedding.
    max_position_embeddings: the trained context length.
    bos_token_id, eos_token_id: special ids, or None.
    vocab_size_per_layer_input: rows of the per-layer embedding table.
    hidden_size_per_layer_input: per-layer input width ``P`` (0: no per-layer inputs).
    attention_k_eq_v: global layers use their key projection for the values too.
    num_kv_shared_layers: the last layers that read an earlier layer's keys and values.
    enable_moe_block: every layer adds a mixture of experts to its dense MLP.
    num_experts, top_k_experts, moe_intermediate_size: the experts ``X``, experts per token
      ``k``, and each expert's width.
    use_double_wide_mlp: KV-shared layers' dense MLP is ``2 F`` wide.
    checkpoint_prefix: prefix of every tensor name (``"model.language_model."`` in a
      ``Gemma4ForConditionalGeneration`` checkpoint, ``"model."`` otherwise).
    scan_layers: the layers of each kind (`layer_kind`) are stacked (every parameter ``[n,
      ...]``) and run as a `jax.lax.scan` over the repeating group of `layer_types`, the
      KV-shared layers a scan of their own (`jaxengine.models.gemma4_scan`), with stacked
      pages; False: one module per layer.
  """

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_hidden_layers: int
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int
  global_head_dim: int = 0
  num_global_key_value_heads: int | None = None
  layer_types: tuple[str, ...]
  sliding_window: int | None = None
  rope_local: Gemma4Rope = Gemma4Rope()
  rope_global: Gemma4Rope = Gemma4Rope(theta=1_000_000.0, partial_rotary_factor=0.25)
  final_logit_softcapping: float | None = None
  hidden_activation: str = "gelu_pytorch_tanh"
  rms_norm_eps: float = 1e-6
  tie_word_embeddings: bool = True
  max_position_embeddings: int = 131072
  bos_token_id: int | None = 2
  eos_token_id: int | None = 1
  vocab_size_per_layer_input: int = 0
  hidden_size_per_layer_input: int = 0
  attention_k_eq_v: bool = False
  num_kv_shared_layers: int = 0
  enable_moe_block: bool = False
  num_experts: int = 0
  top_k_experts: int = 0
  moe_intermediate_size: int = 0
  use_double_wide_mlp: bool = False
  checkpoint_prefix: str = "model."
  scan_layers: bool = False

  def __post_init__(self):
    if not isinstance(self.scan_layers, bool):
      raise ValueError(f"scan_layers must be a bool, got {self.scan_layers!r}")
    num_layers = self.num_hidden_layers
    if len(self.layer_types) != num_layers:
      raise ValueError(
        f"layer_types has {len(self.layer_types)} entries for num_hidden_layers={num_layers}"
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
    if not 0 <= self.num_kv_shared_layers < num_layers:
      raise ValueError(
        f"num_kv_shared_layers must be in [0, num_hidden_layers={num_layers}), got "
        f"{self.num_kv_shared_layers}"
      )
    for layer in range(num_layers):
      heads, width = self.kv_heads(layer), self.layer_head_dim(layer)
      if width % 2:
        raise ValueError(f"head widths must be even for rotary embeddings, got {width}")
      if not heads or self.num_attention_heads % heads:
        raise ValueError(
          f"num_attention_heads={self.num_attention_heads} is not a multiple of layer {layer}'s "
          f"{heads} key/value heads"
        )
      if self.is_kv_shared(layer):
        self.kv_source(layer)  # raises when no earlier layer of its kind computes keys
    if any(self.page_kv_heads % self.kv_heads(i) for i in range(num_layers)):
      raise ValueError(
        f"the layers' key/value heads {sorted({self.kv_heads(i) for i in range(num_layers)})} "
        "must each divide the largest (one page shape serves every layer)"
      )
    if self.enable_moe_block:
      sizes = dict(
        num_experts=self.num_experts,
        top_k_experts=self.top_k_experts,
        moe_intermediate_size=self.moe_intermediate_size,
      )
      for name, value in sizes.items():
        if value < 1:
          raise ValueError(f"enable_moe_block=True needs a positive {name}, got {value}")
      if self.top_k_experts > self.num_experts:
        raise ValueError(
          f"top_k_experts={self.top_k_experts} exceeds num_experts={self.num_experts}"
        )
    if self.hidden_size_per_layer_input and self.vocab_size_per_layer_input < 1:
      raise ValueError(
        "hidden_size_per_layer_input needs a positive vocab_size_per_layer_input, got "
        f"{self.vocab_size_per_layer_input}"
      )
    cap = self.final_logit_softcapping
    if cap is not None and not cap > 0:
      raise ValueError(f"final_logit_softcapping must be positive or null, got {cap}")

  def is_sliding(self, layer: int) -> bool:
    """Whether `layer` is a local (sliding-window) layer."""
    return self.layer_types[layer] == SLIDING

  def window(self, layer: int) -> int | None:
    """`layer`'s sliding window, or None for a global layer."""
    return self.sliding_window if self.is_sliding(layer) else None

  def rope(self, layer: int) -> Gemma4Rope:
    """The rotary embedding of `layer`'s kind."""
    return self.rope_local if self.is_sliding(layer) else self.rope_global

  def layer_head_dim(self, layer: int) -> int:
    """``D`` of `layer`: `global_head_dim` on a global layer (when set), else `head_dim`."""
    if self.is_sliding(layer) or not self.global_head_dim:
      return self.head_dim
    return self.global_head_dim

  def k_eq_v(self, layer: int) -> bool:
    """Whether `layer` takes its values from its key projection (global layers with
    `attention_k_eq_v`)."""
    return self.attention_k_eq_v and not self.is_sliding(layer)

  def kv_heads(self, layer: int) -> int:
    """``K`` of `layer`: `num_global_key_value_heads` where `k_eq_v`, else
    `num_key_value_heads`."""
    if self.k_eq_v(layer) and self.num_global_key_value_heads:
      return self.num_global_key_value_heads
    return self.num_key_value_heads

  @property
  def num_cache_layers(self) -> int:
    """Layers that compute their own keys and values: the first ``L - num_kv_shared_layers``."""
    return self.num_hidden_layers - self.num_kv_shared_layers

  def is_kv_shared(self, layer: int) -> bool:
    """Whether `layer` reads an earlier layer's keys and values instead of its own."""
    return layer >= self.num_cache_layers

  def kv_source(self, layer: int) -> int:
    """The cache layer `layer` reads: itself, or for a KV-shared layer the last layer of its kind
    before the shared ones.

    Raises:
      ValueError: a KV-shared layer whose kind has no earlier layer with keys and values.
    """
    if not self.is_kv_shared(layer):
      return layer
    kind = self.layer_types[layer]
    earlier = [i for i in range(self.num_cache_layers) if self.layer_types[i] == kind]
    if not earlier:
      raise ValueError(
        f"KV-shared layer {layer} ({kind}) has no earlier {kind} layer to share keys and "
        f"values with (num_kv_shared_layers={self.num_kv_shared_layers})"
      )
    return earlier[-1]

  def layer_kind(self, layer: int) -> str:
    """`layer`'s structure, one of `KINDS`: ``"sliding"`` or ``"full"``, prefixed ``"shared_"``
    for a KV-shared layer (a scanned model stacks each kind apart)."""
    kind = "sliding" if self.is_sliding(layer) else "full"
    return f"shared_{kind}" if self.is_kv_shared(layer) else kind

  @property
  def layer_rows(self) -> tuple[tuple[tuple[str], int], ...]:
    """Per layer, where a scanned model (`scan_layers`) keeps its weights: ``((kind,), j)``,
    row ``j`` of ``layers/{kind}``'s leaves for the ``j``-th layer of its `layer_kind`
    (`jaxengine.models.layer_scan.stacked_weight_specs`)."""
    kinds = [self.layer_kind(i) for i in range(self.num_hidden_layers)]
    return tuple(((kind,), kinds[:i].count(kind)) for i, kind in enumerate(kinds))

  def mlp_size(self, layer: int) -> int:
    """The dense MLP's width on `layer` (doubled on KV-shared layers with
    `use_double_wide_mlp`)."""
    wide = self.use_double_wide_mlp and self.is_kv_shared(layer)
    return self.intermediate_size * (2 if wide else 1)

  @property
  def page_kv_heads(self) -> int:
    """``K_page``: the most key/value heads of any layer (module docstring)."""
    return max(self.kv_heads(i) for i in range(self.num_hidden_layers))

  @property
  def page_head_dim(self) -> int:
    """``D_page``: the widest head of any layer (module docstring)."""
    return max(self.layer_head_dim(i) for i in range(self.num_hidden_layers))

  def kv_cache_spec(self, dtype=jnp.float32) -> KVCacheSpec:
    """The cache of the layers with keys and values (`num_cache_layers`), pages of
    ``K_page`` heads of ``D_page`` (module docstring), the local layers' window."""
    local = tuple(i for i in range(self.num_cache_layers) if self.is_sliding(i))
    return KVCacheSpec(
      num_layers=self.num_cache_layers,
      num_kv_heads=self.page_kv_heads,
      head_dim=self.page_head_dim,
      dtype=dtype,
      sliding_window=self.sliding_window if local else None,
      sliding_window_layers=local or None,
      stacked=self.scan_layers,
    )
