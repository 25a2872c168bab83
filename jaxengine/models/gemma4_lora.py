"""Gemma 4's LoRA targets: which layers have each projection and how wide it is there.

Gemma 4's layers differ (`jaxengine.models.gemma4`): global layers may have wider heads
(``global_head_dim``) and fewer key/value heads, KV-shared layers have no key and value
projections and may have double-wide MLPs, and with ``attention_k_eq_v`` the global layers'
values are their keys (no ``v_proj``). The LoRA slots of a target are as wide as its widest
layer (`target_shapes`); each layer's pair is the first rows of ``A`` and columns of ``B``
(`layer_shapes`, `jaxengine.models.lora.add_lora`). Targets a layer lacks are refused there
(`target_layers`). The per-layer input projections take no adapter (PEFT's names for them,
``per_layer_input_gate`` ..., are none of `jaxengine.models.lora.LORA_TARGETS`).
"""

from __future__ import annotations

from jaxengine.models.gemma4_config import Gemma4Config
from jaxengine.models.moe_lora import expert_lora_shapes

__all__ = ["layer_shapes", "target_layers", "target_shapes"]


def layer_shapes(config: Gemma4Config) -> dict[tuple[int, str], tuple[int, ...]]:
  """``(layer, target)`` -> that layer's ``(in, out)`` (``(X, in, out)`` for an expert target),
  for every target the layer has."""
  e, h = config.hidden_size, config.num_attention_heads
  shapes: dict[tuple[int, str], tuple[int, ...]] = {}
  for layer in range(config.num_hidden_layers):
    d, f = config.layer_head_dim(layer), config.mlp_size(layer)
    own = {"q_proj": (e, h * d), "o_proj": (h * d, e)}
    if not config.is_kv_shared(layer):
      kv = config.kv_heads(layer) * d
      own["k_proj"] = (e, kv)
      if not config.k_eq_v(layer):
        own["v_proj"] = (e, kv)
    own.update(gate_proj=(e, f), up_proj=(e, f), down_proj=(f, e))
    if config.enable_moe_block:
      own.update(expert_lora_shapes(config.num_experts, e, config.moe_intermediate_size))
    shapes.update({(layer, target): shape for target, shape in own.items()})
  return shapes


def target_shapes(config: Gemma4Config) -> dict[str, tuple[int, ...]]:
  """Each target's shape in its widest layer (the slots' shape)."""
  widest: dict[str, tuple[int, ...]] = {}
  for (_, target), shape in layer_shapes(config).items():
    old = widest.get(target, shape)
    widest[target] = tuple(max(a, b) for a, b in zip(old, shape))
  return widest


def target_layers(config: Gemma4Config) -> dict[str, tuple[int, ...]]:
  """``k_proj``'s and ``v_proj``'s layers (every other target is in every layer)."""
  layers: dict[str, list[int]] = {"k_proj": [], "v_proj": []}
  for layer, target in layer_shapes(config):
    if target in layers:
      layers[target].append(layer)
  return {target: tuple(found) for target, found in layers.items()}
