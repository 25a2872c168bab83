"""Tunix's Llama 3, Qwen2, Qwen3 (dense, MoE), Gemma and Gemma 3 modules as engine models: config
and weights.

Tunix (`google-tunix`) keeps its own NNX decoders, with their own parameter names and layouts; the
engine serves `jaxengine.models.Llama` (Llama 3, Qwen2, Qwen3) and `jaxengine.models.gemma.Gemma`
(Gemma 1 and 2, Gemma 3). This module maps one onto the other:

- `config_from_tunix` (`jaxengine.integrations.tunix_config`, re-exported here): the
  `LlamaConfig` or `GemmaConfig` that computes what the Tunix module computes, `engine_module`
  its class;
- `engine_leaves`: the Tunix module's `nnx.Param` state as the engine model's leaves: each array
  moved device to device onto the engine's device (`on_device`), then one jitted function of all
  the weights changes the layouts there, so a repeated update with the same shapes and
  placements compiles nothing and nothing passes through the host.

Names and layouts (``L`` layers, ``E`` hidden, ``F`` MLP width, ``H``/``K`` query/key-value
heads, ``D`` head dim, ``V`` vocabulary), Tunix -> engine:

    embedder.input_embedding        [V, E]      -> embed                     [V, E]
    lm_head.w                       [E, V]      -> lm_head                   [V, E]   (transposed)
    final_norm.w                    [E]         -> final_norm.scale
    layers.i.input_layernorm.w      [E]         -> layers.i.input_norm.scale
    layers.i.post_attention_layernorm.w         -> layers.i.post_attention_norm.scale
    layers.i.attn.q_proj.w          [E, H, D]   -> layers.i.attn.wq          [H, D, E]
    layers.i.attn.k_proj.w, v_proj.w [E, K, D]  -> layers.i.attn.wk, wv      [K, D, E]
    layers.i.attn.o_proj.w          [H, D, E]   -> layers.i.attn.wo          [E, H, D]
    layers.i.attn.{q,k,v}_bias      [H*D]       -> layers.i.attn.b{q,k,v}    [H, D]   (Qwen2)
    layers.i.attn.{q,k}_norm.w      [D]         -> layers.i.attn.{q,k}_norm.scale     (Qwen3)
    layers.i.mlp.{gate,up}_proj.kernel [E, F]   -> layers.i.mlp.w_{gate,up}  [F, E]
    layers.i.mlp.down_proj.kernel   [F, E]      -> layers.i.mlp.w_down       [E, F]

Qwen3 with ``num_experts`` (``X`` experts of width ``F = hidden_dim``, a `MoELayer` on every
layer, top-``num_experts_per_tok`` weights renormalised):

    layers.i.mlp.router.kernel      [E, X]      -> layers.i.mlp.router       [X, E]
    layers.i.mlp.{gate,up}_proj     [X, E, F]   -> layers.i.mlp.expert_{gate,up} [X, E, F]
    layers.i.mlp.down_proj          [X, F, E]   -> layers.i.mlp.expert_down  [X, F, E]

(the experts as they are: both keep them ``[X, in, out]``).

Gemma (``tunix.models.gemma``: Gemma 1 and 2) and Gemma 3 (``tunix.models.gemma3``), Tunix ->
`jaxengine.models.gemma.Gemma` (``N`` query heads; the einsum weights carry ``[..., E, D]``):

    embedder.input_embedding        [V, E]        -> embed (tied: Tunix decodes with it)
    final_norm.scale                [E]           -> final_norm.scale          (both 1 + w)
    layers.i.pre_attention_norm.scale             -> layers.i.input_norm.scale
    layers.i.post_attn_norm.scale (Gemma), post_attention_norm.scale (Gemma 3)
                                                  -> layers.i.post_attention_norm.scale
    layers.i.pre_ffw_norm.scale, post_ffw_norm.scale
                                  -> layers.i.pre_feedforward_norm.scale, post_feedforward_norm.scale
    layers.i.attn.q_einsum.w        [N, E, D]     -> layers.i.attn.wq          [N, D, E]
    layers.i.attn.kv_einsum.w       [2, K, E, D]  -> layers.i.attn.wk, wv      [K, D, E]
    layers.i.attn.qkv_einsum.w      [3, N, E, D]  -> wq, wk, wv  (when N == K)
    layers.i.attn.attn_vec_einsum.w [N, D, E]     -> layers.i.attn.wo          [E, N, D]
    layers.i.attn._query_norm.scale, _key_norm.scale (Gemma 3) -> layers.i.attn.{q,k}_norm.scale
    layers.i.mlp.*_proj.kernel                    -> as for Llama (transposed)

Tunix Gemma 3's vision encoder and projector (``vision_encoder.*``, ``embedder.mm_*``) are left
unread.

A qwix LoRA actor's LoRA leaves (``..._lora_a``, ``..._lora_b``, on every family here, Gemma's
einsum projections included) are not base weights: `JaxEngineRollout` splits them off
(`jaxengine.integrations.tunix_lora.split_lora_leaves`) and maps them onto the engine's LoRA slots
unmerged (`jaxengine.integrations.tunix_lora.lora_adapter_from_tunix`); given here they are
refused by name, pointing there.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding

from jaxengine.integrations import missing_extra

try:
  import tunix  # noqa: F401  (the extra; `tunix_config` reads its models)
except ModuleNotFoundError as error:  # the extra is not installed: say how to install it
  raise missing_extra(error, __name__) from error

from jaxengine.integrations.tunix_config import (
  GEMMA_MODELS,
  LLAMA_MODELS,
  SUPPORTED_MODELS,
  EngineConfig,
  config_from_tunix,
  effective_rope_theta,
  engine_module,
  gemma_config_from_tunix,
  llama_config_from_tunix,
)
from jaxengine.models.gemma_config import GemmaConfig
from jaxengine.models.llama_config import LlamaConfig
from jaxengine.models.weights import LeafPath, dotted, leaf_path

__all__ = [
  "GEMMA_MODELS",
  "LLAMA_MODELS",
  "SUPPORTED_MODELS",
  "EngineConfig",
  "check_chunk_bytes",
  "check_tunix_params",
  "config_from_tunix",
  "effective_rope_theta",
  "engine_leaves",
  "engine_module",
  "gemma_config_from_tunix",
  "llama_config_from_tunix",
  "on_device",
  "tunix_param_leaves",
]

#: Tunix parameters the engine model has no use for (Gemma 3's vision encoder and projector).
IGNORED_PREFIXES = ("vision_encoder.", "embedder.mm_")


def tunix_param_leaves(params: Any) -> dict[str, jax.Array]:
  """A Tunix model's parameters (``nnx.state(model, nnx.Param)``, or the module) by dotted path
  (``"layers.0.attn.q_proj.w"``)."""
  if isinstance(params, nnx.Module):
    params = nnx.state(params, nnx.Param)
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  return {dotted(leaf_path(path)): leaf for path, leaf in flat}


def _layer_rules(config: LlamaConfig, sparse: bool) -> dict[str, tuple[str, Any]]:
  """Per layer (`sparse`: one with a mixture of experts): Tunix suffix -> (engine suffix, layout
  change)."""
  h, k, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
  rules: dict[str, tuple[str, Any]] = {
    "input_layernorm.w": ("input_norm.scale", None),
    "post_attention_layernorm.w": ("post_attention_norm.scale", None),
    "attn.q_proj.w": ("attn.wq", lambda w: w.transpose(1, 2, 0)),  # [E, H, D] -> [H, D, E]
    "attn.k_proj.w": ("attn.wk", lambda w: w.transpose(1, 2, 0)),
    "attn.v_proj.w": ("attn.wv", lambda w: w.transpose(1, 2, 0)),
    "attn.o_proj.w": ("attn.wo", lambda w: w.transpose(2, 0, 1)),  # [H, D, E] -> [E, H, D]
    "mlp.gate_proj.kernel": ("mlp.w_gate", lambda w: w.T),  # [E, F] -> [F, E]
    "mlp.up_proj.kernel": ("mlp.w_up", lambda w: w.T),
    "mlp.down_proj.kernel": ("mlp.w_down", lambda w: w.T),  # [F, E] -> [E, F]
  }
  if sparse:
    for name in ("gate_proj", "up_proj", "down_proj"):
      del rules[f"mlp.{name}.kernel"]
    rules["mlp.router.kernel"] = ("mlp.router", lambda w: w.T)  # [E, X] -> [X, E]
    rules["mlp.gate_proj"] = ("mlp.expert_gate", None)  # [X, in, out] both
    rules["mlp.up_proj"] = ("mlp.expert_up", None)
    rules["mlp.down_proj"] = ("mlp.expert_down", None)
  if config.attention_bias:
    rules["attn.q_bias"] = ("attn.bq", lambda b: b.reshape(h, d))
    rules["attn.k_bias"] = ("attn.bk", lambda b: b.reshape(k, d))
    rules["attn.v_bias"] = ("attn.bv", lambda b: b.reshape(k, d))
  if config.qk_norm:
    rules["attn.q_norm.w"] = ("attn.q_norm.scale", None)
    rules["attn.k_norm.w"] = ("attn.k_norm.scale", None)
  return rules


def name_map(config: LlamaConfig) -> dict[str, tuple[LeafPath, Any]]:
  """Every Tunix parameter name of a model with `config` -> (engine leaf path, layout change)."""
  top: dict[str, tuple[LeafPath, Any]] = {
    "embedder.input_embedding": (("embed",), None),
    "final_norm.w": (("final_norm", "scale"), None),
  }
  if not config.tie_word_embeddings:
    top["lm_head.w"] = (("lm_head",), lambda w: w.T)  # [E, V] -> [V, E]
  for i in range(config.num_hidden_layers):
    for src, (dst, change) in _layer_rules(config, i in config.moe_layers).items():
      top[f"layers.{i}.{src}"] = (("layers", i, *dst.split(".")), change)
  return top


def _heads_last(w):
  """``[N, E, D]`` einsum weight -> ``[N, D, E]`` (the engine's ``[out, in]`` per head)."""
  return w.transpose(0, 2, 1)


def _gemma_layer_rules(config: GemmaConfig) -> dict[str, tuple[str, Any]]:
  """Per layer: engine suffix -> (Tunix suffix, layout change)."""
  rules: dict[str, tuple[str, Any]] = {
    "input_norm.scale": ("pre_attention_norm.scale", None),
    "pre_feedforward_norm.scale": ("pre_ffw_norm.scale", None),
    "attn.wo": ("attn.attn_vec_einsum.w", lambda w: w.transpose(2, 0, 1)),  # [N,D,E] -> [E,N,D]
    "mlp.w_gate": ("mlp.gate_proj.kernel", lambda w: w.T),
    "mlp.w_up": ("mlp.up_proj.kernel", lambda w: w.T),
    "mlp.w_down": ("mlp.down_proj.kernel", lambda w: w.T),
  }
  if config.num_attention_heads == config.num_key_value_heads:  # Tunix's fused projection
    for index, name in enumerate(("wq", "wk", "wv")):
      rules[f"attn.{name}"] = ("attn.qkv_einsum.w", lambda w, i=index: _heads_last(w[i]))
  else:
    rules["attn.wq"] = ("attn.q_einsum.w", _heads_last)
    rules["attn.wk"] = ("attn.kv_einsum.w", lambda w: _heads_last(w[0]))
    rules["attn.wv"] = ("attn.kv_einsum.w", lambda w: _heads_last(w[1]))
  if config.post_norms:
    post_attn = "post_attention_norm.scale" if config.qk_norm else "post_attn_norm.scale"
    rules["post_attention_norm.scale"] = (post_attn, None)
    rules["post_feedforward_norm.scale"] = ("post_ffw_norm.scale", None)
  if config.qk_norm:
    rules["attn.q_norm.scale"] = ("attn._query_norm.scale", None)
    rules["attn.k_norm.scale"] = ("attn._key_norm.scale", None)
  return rules


def leaf_rules(config: EngineConfig) -> dict[LeafPath, tuple[str, Any]]:
  """Every engine leaf of a model with `config` -> (the Tunix parameter it comes from, layout
  change or None). A Tunix tensor may feed several leaves (Gemma's fused key/value weights)."""
  if isinstance(config, LlamaConfig):
    return {path: (name, change) for name, (path, change) in name_map(config).items()}
  rules: dict[LeafPath, tuple[str, Any]] = {
    ("embed",): ("embedder.input_embedding", None),
    ("final_norm", "scale"): ("final_norm.scale", None),
  }
  for i in range(config.num_hidden_layers):
    for dst, (src, change) in _gemma_layer_rules(config).items():
      rules[("layers", i, *dst.split("."))] = (f"layers.{i}.{src}", change)
  return rules


@functools.partial(jax.jit, static_argnames=("config", "dtype"))
def _convert(leaves: dict[str, jax.Array], config: EngineConfig, dtype) -> dict[str, jax.Array]:
  """The layout changes of `leaf_rules`, one jitted call for every tensor (norm scales
  float32)."""
  out = {}
  for path, (name, change) in leaf_rules(config).items():
    value = leaves[name] if change is None else change(leaves[name])
    is_norm = path[-1] == "scale"
    out[dotted(path)] = value.astype(jnp.float32 if is_norm else dtype)
  return out


def on_device(x: Any, device: jax.Device) -> jax.Array:
  """`x` on `device` as a plain array (no explicit-sharding type), device to device.

  A trainer on a mesh with explicit axes (`jax.make_mesh`'s default) holds arrays whose type
  carries their sharding (``float32[264@tp,32@fsdp]``); jitted code written for plain arrays,
  the engine's, cannot take them. The array is first relabelled on the same devices with an
  `Auto` mesh (no data moves), then gathered onto `device`. NumPy arrays are copied from the
  host.
  """
  sharding = getattr(x, "sharding", None)
  if isinstance(sharding, NamedSharding) and any(
    t == AxisType.Explicit for t in sharding.mesh.axis_types
  ):
    mesh = sharding.mesh
    auto = Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))
    x = jax.device_put(x, NamedSharding(auto, sharding.spec))
  return jax.device_put(x, device)


@functools.lru_cache(maxsize=64)
def _unit_rules(config: EngineConfig, unit: int | None) -> dict[LeafPath, tuple[str, Any]]:
  """`leaf_rules` of one conversion unit: the top-level leaves (`unit` None, full paths and
  names) or layer `unit`'s (paths and Tunix names relative to the layer: ``("attn", "wq")`` from
  ``"attn.q_proj.w"``)."""
  rules = leaf_rules(config)
  if unit is None:
    return {path: rule for path, rule in rules.items() if path[0] != "layers"}
  prefix = f"layers.{unit}."
  return {
    path[2:]: (name.removeprefix(prefix), change)
    for path, (name, change) in rules.items()
    if path[:2] == ("layers", unit)
  }


def _template_layer(config: EngineConfig, layer: int) -> int:
  """The first layer converted as `layer` is (a mixture-of-experts layer or a dense one), so
  every layer of a kind shares one executable of `_convert_unit`."""
  moe_layers = getattr(config, "moe_layers", ()) if getattr(config, "num_experts", 0) else ()
  sparse = layer in moe_layers
  return next(i for i in range(config.num_hidden_layers) if (i in moe_layers) == sparse)


@functools.partial(jax.jit, static_argnames=("config", "dtype", "unit"))
def _convert_unit(
  leaves: dict[str, jax.Array], config: EngineConfig, dtype, unit: int | None
) -> dict[str, jax.Array]:
  """`_convert` of one unit (`_unit_rules`; a layer by its `_template_layer`, so the 30 layers
  of a dense model compile one executable)."""
  out = {}
  for path, (name, change) in _unit_rules(config, unit).items():
    value = leaves[name] if change is None else change(leaves[name])
    out[dotted(path)] = value.astype(jnp.float32 if path[-1] == "scale" else dtype)
  return out


def check_tunix_params(params: Mapping[str, Any], config: EngineConfig) -> list[str]:
  """The Tunix parameter names the engine reads, sorted, after checking `params` by name alone
  (on the host).

  Raises:
    ValueError: naming the first missing or unexpected parameter (a qwix LoRA leaf: where it
      goes instead).
  """
  expected = sorted({name for name, _ in leaf_rules(config).values()})
  missing = [name for name in expected if name not in params]
  if missing:
    raise ValueError(f"the Tunix parameters lack {missing[0]!r} ({len(missing)} missing)")
  known = set(expected)
  extra = [n for n in params if n not in known and not n.startswith(IGNORED_PREFIXES)]
  if extra:
    if "_lora_" in extra[0]:
      raise ValueError(
        f"unexpected Tunix parameter {extra[0]!r}: a qwix LoRA leaf is no base weight (split "
        "it off with jaxengine.integrations.tunix_lora.split_lora_leaves; JaxEngineRollout "
        "serves it on the engine's LoRA slots)"
      )
    raise ValueError(f"unexpected Tunix parameter {extra[0]!r}")
  return expected


def check_chunk_bytes(value: Any, field: str) -> None:
  """Checks a chunk size of `engine_leaves` on the host.

  Raises:
    ValueError: naming `field` and `value` when it is neither None nor a positive Python int.
  """
  if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
    raise ValueError(f"{field} must be a positive int or None, got {value!r}")


def engine_leaves(
  params: Mapping[str, jax.Array],
  config: EngineConfig,
  dtype,
  device: jax.Device,
  *,
  shardings: Mapping[LeafPath, jax.sharding.Sharding] | None = None,
  chunk_bytes: int | None = None,
) -> dict[LeafPath, jax.Array]:
  """The engine model's leaves from a Tunix model's parameters (see `tunix_param_leaves`).

  All at once (`chunk_bytes` None): every parameter is moved onto `device`, then one jitted
  function changes every layout; the peak is two extra copies of the model (the parameters
  moved and the converted leaves). In chunks: the top-level parameters, then layer after
  layer, each moved, converted (one executable per kind of layer, compiled on the first sync)
  and placed; after each chunk of at least `chunk_bytes` of parameters (or the last) the host
  waits for the device, so the parameters in flight never exceed a chunk and one layer: the
  peak is one extra copy of the model (the converted leaves) and a chunk. The values are the
  same either way.

  Args:
    params: every Tunix parameter by dotted name; JAX or NumPy arrays of any floating dtype.
    config: the engine model's config (`config_from_tunix`).
    dtype: the engine model's parameter dtype (norm scales stay float32).
    device: where the parameters are converted (`on_device`; JAX arrays never pass through the
      host, so this runs under Tunix's transfer guard).
    shardings: where each converted leaf goes (the engine's placement, by leaf path), per chunk;
      None: it stays on `device`.
    chunk_bytes: the parameter bytes per chunk (a positive int), or None: all at once.

  Returns:
    ``{engine leaf path: array}`` for every leaf, committed to `device` (or `shardings`).

  Raises:
    ValueError: naming the first missing or unexpected Tunix parameter, or a `chunk_bytes` that
      is not a positive int (nothing is converted then; shapes are checked by
      `LLM.load_weights`).
  """
  check_chunk_bytes(chunk_bytes, "chunk_bytes")
  rules = leaf_rules(config)
  expected = check_tunix_params(params, config)
  place = (lambda x, _: x) if shardings is None else (lambda x, p: jax.device_put(x, shardings[p]))
  if chunk_bytes is None:
    placed = {name: on_device(params[name], device) for name in expected}
    converted = _convert(placed, config, jnp.dtype(dtype))
    return {path: place(converted[dotted(path)], path) for path in rules}
  out: dict[LeafPath, jax.Array] = {}
  chunk: list[jax.Array] = []
  in_flight = 0
  units: list[int | None] = [None, *range(config.num_hidden_layers)]
  for index, unit in enumerate(units):
    template = None if unit is None else _template_layer(config, unit)
    prefix = "" if unit is None else f"layers.{unit}."
    names = sorted({name for name, _ in _unit_rules(config, template).values()})
    placed = {name: on_device(params[prefix + name], device) for name in names}
    converted = _convert_unit(placed, config, jnp.dtype(dtype), template)
    for rel in _unit_rules(config, template):
      path = rel if unit is None else ("layers", unit, *rel)
      out[path] = place(converted[dotted(rel)], path)
      chunk.append(out[path])
    in_flight += sum(int(x.nbytes) for x in placed.values())
    if in_flight >= chunk_bytes or index == len(units) - 1:
      jax.block_until_ready(chunk)  # the chunk's moved parameters are freed before the next
      chunk, in_flight = [], 0
  return out
