"""Decoder layers under `jax.lax.scan`: stacked ``[L, ...]`` layer weights, one traced body.

A model built with ``scan_layers=True`` (`jaxengine.models.LlamaConfig.scan_layers`,
``LLM(..., scan_layers=True)``) keeps its `L` decoder layers as one layer module whose every
parameter has a leading layer axis (`stack_layers`), and `scan_layers` runs them as one
`jax.lax.scan`: XLA compiles one layer body whatever the depth, so a step's trace and compile
time stay flat with `L` (unrolled, SmolLM2-135M's 30 layers made a forward step compile in
seconds, each new step shape paying it again). What the scan costs instead: XLA reads each
layer's weights out of the stack per iteration. On TPU and GPU that is the usual layout; on
XLA:CPU a dynamic slice of a stacked weight is not fused into the dot, so each layer's weights
are copied first (measured on 2 CPU cores, SmolLM2's MLP weights of 30 layers, batch 1 / 8 /
32: 13.8 / 23.1 / 39.8 ms unrolled against 18.8 / 30.2 / 45.8 ms scanned), which is why the
engine's default (`scanned_model`) scans on accelerators and not on CPU.

The KV cache of a scanned model is stacked as well
(`jaxengine.models.kv_cache.KVCacheSpec.stacked`): one buffer per page array holding every
layer's pages along the page axis, carried through the scan (written in place, donatable), each
layer reaching its own pages by offsetting the step's page ids
(`jaxengine.models.kv_pages.PagedKVCache.layer_metadata`), never by slicing a layer's pages out.

Weights keep their per-layer names: a stacked leaf is ``("layers", "attn", "wq")`` of shape
``[L, H, D, E]``, and checkpoint tensors name a layer as before (``model.layers.3...``), filling
row 3 of it (`stacked_weight_specs`, `jaxengine.models.weights.WeightSpec.layer`). LoRA adapters
are stacked per step (`LoRAInputs.layers` to one ``[L, ...]`` tree), quantization adds the layer
axis to the scales (`jaxengine.models.quantization.quantize_model` reads `stacked_paths`), a mesh
leaves the layer axis unsplit (`jaxengine.parallel.weight_shardings`), and `load_weights` of a
whole unrolled state (a trainer's own module) checks it per layer, then stacks it
(`is_unrolled_state`, `unrolled_leaves`, `restacked`).

Measured (``benchmarks/bench_layer_scan.py``, SmolLM2-135M, a decode step over 64 cached
positions, a shared 2-core CPU at a load average of about 2.5): compile 4.6 / 4.8 / 5.1 s
unrolled against 1.2 / 1.7 / 1.3 s scanned at 1 / 8 / 32 rows, while a step ran 37 / 110 / 187
ms unrolled against 70 / 152 / 241 ms scanned; a fresh process's first ``LLM.generate`` (16
tokens, no compilation cache) 15.4 to 16.9 s unrolled against 6.6 to 9.9 s scanned.
Llama-3.1-8B compiled deviceless for v6e:1x1 (``jaxengine compile``'s path, one ragged step of 8
rows and 8 tokens): 49.6 s unrolled against 14.2 s scanned, and XLA:TPU reads each layer's
weights in place from the stack (15.02 GB of HBM traffic a step by `jaxengine.aot.hbm_bytes`,
15.05 GB unrolled).

Layers that repeat a pattern of kinds (Gemma 2's alternating local and global layers, Gemma 3's
five local and one global, each kind with its own window and rotary base, static in the
attention): their weights share one structure and stack as above (``[L, ...]``, the same
names, LoRA, quantization, mesh and `load_weights` paths), and `scan_layer_groups` scans over
the repeating group instead of over single layers: one iteration runs the group's ``P`` layers
(each position its own traced body, its weights row ``g P + j`` of the stack), the layers after
the last whole group (Gemma 3 1B: 26 = 4 * 6 + 2) run unrolled after the loop. The kind is a
static argument of the call, not the stacked module's (`jaxengine.models.gemma.Gemma.
stack_decoder_layers`). Measured on the same shared 2-core VM at a load average of 4 to 7, so
with wide spreads: Gemma 3 1B's config (26 layers) compiled deviceless for v6e:1x1 (one ragged
step of 8 rows and 8 tokens) in 36.9 to 42.2 s unrolled against 15.5 to 16.9 s scanned, Gemma 3
4B's (34 layers) in 35.7 to 69.6 s against 21.9 to 32.4 s (four runs), with 2.04 / 2.02 GB and
7.89 / 8.07 GB of HBM traffic a step unrolled / scanned (`jaxengine.aot.hbm_bytes`). On
XLA:CPU (``bench_layer_scan.py --model gemma3``: 26 layers at width 256, a decode step) tracing
and lowering fell from 1.3-1.9 s to 0.3-0.7 s, while XLA's compile stayed within the noise
(4.9 / 6.7 / 9.7 s unrolled against 4.8 / 9.1 / 7.6 s scanned at 1 / 8 / 32 rows) and steps ran
slower (11.5 / 26.4 / 48.3 ms against 34.6 / 51.0 / 63.5 ms): CPU's default stays unrolled.

Layers of more than one structure stack by kind, one stack each, and the scan over the
repeating group reads each layer's weights from its kind's stack: Qwen3.5's Gated DeltaNet and
full-attention layers (`jaxengine.models.qwen3_5_scan`, its recurrent state pool stacked per
linear layer too) and Gemma 4's local, global and KV-shared layers
(`jaxengine.models.gemma4_scan`). Their checkpoint names, `load_weights` of an unrolled state
and LoRA follow each layer to its row (`LayerRows`, the config's ``layer_rows``).

What a stacked layer cannot be: a Llama whose layers mix dense and mixture-of-experts MLPs:
`can_scan` says no, `scan_config` and `scanned_model` refuse ``scan_layers=True`` for it
(ValueError naming the field) and leave it unrolled by default.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxengine.models.kv_pages import PagedKVCache
from jaxengine.models.lora import LayerLoRA, LoRAInputs
from jaxengine.models.paged_attention import PagedAttentionMetadata
from jaxengine.models.weights import LeafPath, WeightSpec, state_leaves

__all__ = [
  "LAYERS",
  "LayerRows",
  "can_scan",
  "check_scan_layers",
  "is_unrolled_state",
  "layer_rows",
  "restacked",
  "scan_config",
  "scan_layer_groups",
  "scan_layers",
  "scanned_model",
  "stack_layers",
  "stacked_lora",
  "stacked_weight_specs",
  "unrolled_leaves",
]

#: The attribute (and state path) of a model's stacked decoder layers.
LAYERS = "layers"

#: Platforms whose engine scans by default (`resolve_scan_layers`).
SCAN_PLATFORMS = ("tpu", "gpu", "cuda", "rocm")
#: The model families that scan, as the refusals name them.
SCANNING_FAMILIES = "the Llama family, Gemma 2, 3 and 4, and Qwen3.5"


def check_scan_layers(value: Any) -> bool | None:
  """`value` if it is None, True or False (`EngineConfig.scan_layers`).

  Raises:
    ValueError: anything else, naming the field and the value.
  """
  if value is None or isinstance(value, bool):
    return value
  raise ValueError(f"scan_layers must be None, True or False, got {value!r}")


def stack_layers(layers: Sequence[nnx.Module]) -> nnx.Module:
  """One module of the layers' common structure whose every leaf stacks theirs on a new leading
  ``[L]`` axis (abstract leaves stay abstract under `nnx.eval_shape`).

  Raises:
    ValueError: no layers, or layers whose structures differ (naming the first that does).
  """
  if not layers:
    raise ValueError("scan_layers needs at least one decoder layer")
  graphdef, first = nnx.split(layers[0])
  states = [first]
  for index, layer in enumerate(layers[1:], start=1):
    other, state = nnx.split(layer)
    if other != graphdef:
      raise ValueError(
        f"scan_layers=True needs decoder layers of one structure; layer {index} differs from "
        "layer 0 (e.g. a dense MLP beside a mixture of experts)"
      )
    states.append(state)
  stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *states)
  return nnx.merge(graphdef, stacked)


def can_scan(model: Any) -> bool:
  """Whether `model` can run its layers under a scan: a model that declares `stacked_paths`
  (`jaxengine.models.Llama`, `jaxengine.models.gemma.Gemma`) whose layers share one structure
  (not a mix of dense and mixture-of-experts layers)."""
  config: Any = getattr(model, "config", None)
  if not hasattr(type(model), "stacked_paths") or not hasattr(config, "scan_layers"):
    return False
  moe = set(getattr(config, "moe_layers", ()))
  return moe in (set(), set(range(config.num_hidden_layers)))


def scan_config(config: Any, value: bool | None, platform: str | None = None) -> Any:
  """A checkpoint's model config with ``scan_layers`` set as `EngineConfig.scan_layers` asks,
  before the model is built (its weights then load into the stacked leaves, with no unrolled
  copy): True, False, or None for the platform's default (as `scanned_model`).

  Raises:
    ValueError: True for a config without ``scan_layers`` (naming the model family and the
      field), or for one whose layers differ in structure (`jaxengine.models.LlamaConfig`).
  """
  if not hasattr(config, "scan_layers"):
    if value:
      family = type(config).__name__.removesuffix("Config")
      raise ValueError(
        f"scan_layers=True: {family} models cannot run their layers under a scan yet "
        f"({SCANNING_FAMILIES} can); use scan_layers=False"
      )
    return config
  if value is None:
    moe = set(getattr(config, "moe_layers", ()))
    uniform = moe in (set(), set(range(config.num_hidden_layers)))
    value = uniform and (platform or jax.default_backend()) in SCAN_PLATFORMS
  return dataclasses.replace(config, scan_layers=bool(value))


def scanned_model(model: Any, value: bool | None, platform: str | None = None) -> Any:
  """The module an engine of ``scan_layers=value`` serves: `model` itself when its layers are
  already as asked, else a copy whose layers are stacked (`stack_layers`; the other arrays
  shared, the caller's module unchanged).

  Args:
    model: the engine's model (`jaxengine.models.Llama` scans; it declares `stacked_paths`).
    value: `EngineConfig.scan_layers`: True or False, or None for the platform's default:
      stacked on TPU and GPU when the model can (`can_scan`) or when it already is, unrolled
      on CPU (XLA:CPU copies each layer's weights out of the stack: module docstring).
    platform: the platform the steps run on (default `jax.default_backend()`).

  Raises:
    ValueError: True with a model that cannot scan its layers (naming its type and the
      field), or False with a model whose layers are already stacked.
  """
  config: Any = getattr(model, "config", None)
  is_scanned = bool(getattr(config, "scan_layers", False))
  if value is None:
    on_accelerator = (platform or jax.default_backend()) in SCAN_PLATFORMS
    value = is_scanned or (on_accelerator and can_scan(model))
  scan = value
  if is_scanned == scan:
    return model
  if not scan:
    raise ValueError(
      "scan_layers=False, but the model's layers are stacked (its config has scan_layers=True): "
      "build it with scan_layers=False, or leave scan_layers None"
    )
  if not hasattr(type(model), "stacked_paths") or not hasattr(config, "scan_layers"):
    raise ValueError(
      f"scan_layers=True: {type(model).__name__} models cannot run their layers under a scan "
      f"yet ({SCANNING_FAMILIES} can); use scan_layers=False"
    )
  config = dataclasses.replace(config, scan_layers=True)  # refuses mixed dense / MoE layers
  graphdef, state = nnx.split(model)
  copy = nnx.merge(graphdef, state)
  # A model whose layers differ in static attributes only (Gemma's kinds) stacks them its way.
  stack = getattr(copy, "stack_decoder_layers", stack_layers)
  copy.layers = stack(list(copy.layers))
  copy.config = config
  return copy


#: Per unrolled layer ``i``, where a stacked model keeps it: ``(sub, row)``, its leaves under
#: ``("layers", *sub, ...)`` at row ``row`` (a hybrid's stacks by kind,
#: `jaxengine.models.qwen3_5_checkpoints.Qwen3_5Config.layer_rows`); None: ``((), i)``.
LayerRows = Sequence[tuple[tuple[str, ...], int]]


def layer_rows(model: Any) -> LayerRows | None:
  """The `LayerRows` of a scanned `model` (its config's ``layer_rows``), None for one stack."""
  config: Any = getattr(model, "config", None)
  if not getattr(config, "scan_layers", False):
    return None
  return getattr(config, "layer_rows", None)


def stacked_weight_specs(
  specs: Sequence[WeightSpec], rows: LayerRows | None = None
) -> list[WeightSpec]:
  """Per-layer specs (path ``("layers", i, ...)``) moved onto the stacked leaves: path
  ``("layers", ...)`` and row ``i`` (``(i, j)`` for row ``j`` of a per-layer stack, an
  expert), or with `rows` path ``("layers", *sub, ...)`` and row ``r`` for ``rows[i] == (sub,
  r)``; every other spec as it is (its class kept)."""
  moved = []
  for spec in specs:
    path = spec.path
    if path is None or len(path) < 2 or path[0] != LAYERS or not isinstance(path[1], int):
      moved.append(spec)
      continue
    sub, row = ((), path[1]) if rows is None else rows[path[1]]
    layer = (row, *spec.index)
    moved.append(
      dataclasses.replace(
        spec, path=(LAYERS, *sub, *path[2:]), layer=layer[0] if len(layer) == 1 else layer
      )
    )
  return moved


def _is_layer_path(path: tuple) -> bool:
  """Whether `path` is an unrolled layer's leaf, ``("layers", i, ...)``."""
  return len(path) > 2 and path[0] == LAYERS and isinstance(path[1], int)


def is_unrolled_state(state: Any, leaves: Mapping[LeafPath, Any]) -> bool:
  """Whether a whole state given to `load_weights` (an `nnx.State`, a module, a pure dict)
  holds an unrolled model's per-layer leaves where the engine's `leaves` are stacked (a
  trainer's unrolled module loaded into a scanned engine)."""
  if not any(path[:1] == (LAYERS,) and not _is_layer_path(path) for path in leaves):
    return False
  given = state_leaves(nnx.state(state) if isinstance(state, nnx.Module) else state)
  return any(_is_layer_path(path) for path in given)


def _stack_layers(path: LeafPath, num_rows: int, rows: LayerRows | None) -> list[LeafPath]:
  """The unrolled leaves, row by row, that the stacked leaf `path` of `num_rows` rows holds."""
  if rows is None:
    return [(LAYERS, i, *path[1:]) for i in range(num_rows)]
  held = sorted(
    (r, i, len(sub)) for i, (sub, r) in enumerate(rows) if path[1 : 1 + len(sub)] == sub
  )
  return [(LAYERS, i, *path[1 + depth :]) for _, i, depth in held]


def unrolled_leaves(
  leaves: Mapping[LeafPath, Any], rows: LayerRows | None = None
) -> dict[LeafPath, Any]:
  """`leaves` with each stacked ``("layers", ...)`` leaf ``[L, ...]`` as its ``L`` per-layer
  leaves ``("layers", i, ...)`` (shape and dtype structs; `rows`: where each layer is, as
  `stacked_weight_specs`): what an unrolled state is checked against."""
  unrolled: dict[LeafPath, Any] = {}
  for path, leaf in leaves.items():
    if path[:1] != (LAYERS,) or _is_layer_path(path):
      unrolled[path] = leaf
      continue
    row = jax.ShapeDtypeStruct(tuple(leaf.shape[1:]), leaf.dtype)
    unrolled.update(dict.fromkeys(_stack_layers(path, leaf.shape[0], rows), row))
  return unrolled


def restacked(
  given: Mapping[LeafPath, Any], leaves: Mapping[LeafPath, Any], rows: LayerRows | None = None
) -> dict[LeafPath, Any]:
  """Checked per-layer tensors (`unrolled_leaves`' paths) stacked into the stacked leaves of
  `leaves` (NumPy on the host, JAX arrays where they are); the other tensors as they are."""
  result = {path: tensor for path, tensor in given.items() if not _is_layer_path(path)}
  for path, leaf in leaves.items():
    if path in result:
      continue
    values = [given[layer] for layer in _stack_layers(path, leaf.shape[0], rows)]
    on_host = all(isinstance(v, np.ndarray) for v in values)
    result[path] = np.stack(values) if on_host else jnp.stack(values)
  return result


def stacked_lora(lora: LoRAInputs | None) -> Any:
  """The adapters of every layer as one ``{target: (A [L, N + 1, in, R], B [L, ...])}`` tree
  (a copy per step: the adapters are small next to the layers' weights), or None."""
  if lora is None:
    return None
  return jax.tree.map(lambda *per_layer: jnp.stack(per_layer), *lora.layers)


def scan_layers(
  layers: nnx.Module,
  x: jax.Array,
  positions: jax.Array,
  kv_cache: PagedKVCache,
  metadata: PagedAttentionMetadata,
  *,
  num_layers: int,
  lora: LoRAInputs | None = None,
  routed_experts: jax.Array | None = None,
  return_routed: bool = False,
) -> tuple[jax.Array, PagedKVCache, jax.Array | None]:
  """``x, kv_cache`` after every layer of a stacked layer module, as one `jax.lax.scan`.

  Layer ``l`` is called as ``layer(x, positions, kv_cache, l, metadata, lora_l, replay_l)``
  with ``l`` a traced ``[] int32`` (the attention seam offsets its pages: module docstring).

  Args:
    layers: the stacked layer module (`stack_layers`; every leaf ``[L, ...]``).
    x: ``[..., E]`` the residual stream.
    positions: ``[..., T] int32`` the tokens' positions.
    kv_cache: a `PagedKVCache` with stacked pages (`PagedKVCache.stacked_layers`).
    metadata: the step's attention metadata.
    num_layers: ``L``.
    lora: the step's LoRA adapters (``L`` per-layer dicts), or None.
    routed_experts: None, or ``[..., L, k]`` experts to replay at every (mixture-of-experts)
      layer.
    return_routed: the layer returns its ``[..., k]`` experts third; they are returned.

  Returns:
    ``(x, kv_cache, experts)``: the last layer's output, the cache, and with `return_routed`
    the ``[..., L, k] int32`` experts of every layer (else None).

  Raises:
    ValueError: a cache whose pages are not stacked for these ``L`` layers.
  """
  if kv_cache.stacked_layers is None or kv_cache.num_layers != num_layers:
    raise ValueError(
      f"a scanned model needs a stacked KV cache of {num_layers} layers (KVCacheSpec.stacked, "
      f"the model's kv_cache_spec), got stacked_layers={kv_cache.stacked_layers}"
    )
  graphdef, weights = nnx.split(layers)
  replay = None if routed_experts is None else jnp.moveaxis(routed_experts, -2, 0)  # [L, ..., k]
  xs = (weights, jnp.arange(num_layers, dtype=jnp.int32), stacked_lora(lora), replay)

  def body(carry, per_layer):
    x, pages = carry
    layer_weights, index, layer_lora, layer_replay = per_layer
    layer = nnx.merge(graphdef, layer_weights)
    cache = dataclasses.replace(kv_cache, pages=pages)
    view = None if lora is None else LayerLoRA(lora.slots, layer_lora)
    x, cache, *more = layer(x, positions, cache, index, metadata, view, layer_replay)
    return (x, cache.pages), (more[0] if return_routed and more else None)

  (x, pages), experts = jax.lax.scan(body, (x, kv_cache.pages), xs)
  kv_cache = dataclasses.replace(kv_cache, pages=pages)
  if experts is not None:
    experts = jnp.moveaxis(experts, 0, -2)  # [..., L, k]
  return x, kv_cache, experts


def scan_layer_groups(
  layers: nnx.Module,
  x: jax.Array,
  positions: jax.Array,
  kv_cache: PagedKVCache,
  metadata: PagedAttentionMetadata,
  *,
  num_layers: int,
  period: int,
  lora: LoRAInputs | None = None,
) -> tuple[jax.Array, PagedKVCache]:
  """``x, kv_cache`` after every layer of a stacked layer module whose layers repeat a pattern
  of `period` kinds (Gemma's local and global layers, `jaxengine.models.gemma_config.
  GemmaConfig.layer_period`): one `jax.lax.scan` over the ``G = L // P`` whole groups, each
  iteration running the group's ``P`` layers in order, then the ``L - G P`` layers after the
  last whole group unrolled. XLA compiles ``P`` layer bodies and the remainder's, whatever
  ``G``; every layer computes what it does unrolled.

  Layer ``l`` is called as ``layer(x, positions, kv_cache, l, metadata, lora_l, kind=l % P)``:
  ``l`` a traced ``[] int32`` in the scan (a static int after it), the cache index whose pages
  the attention seam offsets to (`scan_layers`), and ``kind`` static, the layer of the first
  group whose window and rotary base it takes. Its weights are row ``l`` of the stack, read
  inside the loop (`jax.lax.dynamic_index_in_dim`: no copy of the stack's first ``G P`` rows
  is made when ``P`` does not divide ``L``).

  Args:
    layers: the stacked layer module (every leaf ``[L, ...]``).
    x: ``[..., E]`` the residual stream.
    positions: ``[..., T] int32`` the tokens' positions.
    kv_cache: a `PagedKVCache` with stacked pages (`PagedKVCache.stacked_layers`; with KV
      cache groups, ``stacked_layers`` is the page's slots and `PagedKVCache.layer_groups`
      maps each layer to one).
    metadata: the step's attention metadata.
    num_layers: ``L``.
    period: ``P``, between 1 and ``L``.
    lora: the step's LoRA adapters (``L`` per-layer dicts), or None.

  Returns:
    ``(x, kv_cache)``: the last layer's output and the cache.

  Raises:
    ValueError: a cache whose pages are not stacked, or a `period` outside ``[1, L]``.
  """
  if kv_cache.stacked_layers is None:
    raise ValueError(
      "a scanned model needs a stacked KV cache (KVCacheSpec.stacked, the model's "
      "kv_cache_spec), got per-layer pages"
    )
  if not 1 <= period <= num_layers:
    raise ValueError(f"period must be between 1 and num_layers={num_layers}, got {period}")
  graphdef, weights = nnx.split(layers)
  groups, rest = divmod(num_layers, period)
  all_lora = stacked_lora(lora)

  def run(x, pages, index, kind):
    row = lambda leaf: jax.lax.dynamic_index_in_dim(leaf, index, keepdims=False)
    layer = nnx.merge(graphdef, jax.tree.map(row, weights))
    view = None
    if lora is not None:
      layer_lora = lora.layers[index] if isinstance(index, int) else jax.tree.map(row, all_lora)
      view = LayerLoRA(lora.slots, layer_lora)
    cache = dataclasses.replace(kv_cache, pages=pages)
    x, cache = layer(x, positions, cache, index, metadata, view, kind=kind)
    return x, cache.pages

  def body(carry, group):
    x, pages = carry
    for kind in range(period):
      x, pages = run(x, pages, group * period + kind, kind)
    return (x, pages), None

  group_ids = jnp.arange(groups, dtype=jnp.int32)
  (x, pages), _ = jax.lax.scan(body, (x, kv_cache.pages), group_ids)
  for kind in range(rest):  # the layers after the last whole group
    x, pages = run(x, pages, groups * period + kind, kind)
  return x, dataclasses.replace(kv_cache, pages=pages)
