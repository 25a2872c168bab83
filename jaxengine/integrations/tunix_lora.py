"""qwix LoRA on Tunix's Llama 3, Qwen2, Qwen3, Gemma and Gemma 3 as an engine LoRA adapter.

Tunix trains LoRA with qwix (``qwix.apply_lora_to_model(model, qwix.LoraProvider(...))``),
which gives each matched projection two `nnx.LoRAParam` leaves next to its weight,
``<weight>_lora_a`` and ``<weight>_lora_b``, and adds ``(x A) B * alpha / rank`` to the
projection (the rank and alpha of the first `LoraRule` whose ``module_path`` regex fully
matches the module's ``/``-joined path). Its einsum projections keep the heads split, so the
pairs are reshaped to the engine's ``A [in, R]``, ``B [R, out]`` (heads flattened head-major,
as the engine's projections are). Names and shapes (``E`` hidden, ``F`` MLP width, ``H``/``K``
query/key-value heads, ``D`` head dim, ``R`` rank), Tunix -> engine target:

    layers.i.attn.q_proj.w_lora_a   [E, R]        -> q_proj A [E, R]
    layers.i.attn.q_proj.w_lora_b   [R, H, D]     -> q_proj B [R, H*D]
    layers.i.attn.{k,v}_proj.w_lora_{a,b}  [E, R], [R, K, D] -> {k,v}_proj  [E, R], [R, K*D]
    layers.i.attn.o_proj.w_lora_a   [H, D, R]     -> o_proj A [H*D, R]
    layers.i.attn.o_proj.w_lora_b   [R, E]        -> o_proj B [R, E]
    layers.i.mlp.{gate,up,down}_proj.kernel_lora_{a,b} [in, R], [R, out] -> as they are

Gemma and Gemma 3 (``N`` query heads; Tunix's einsum projections, their fused key/value (and
query) weights' pairs sharing one ``A``, each engine target taking its part of ``B``, rank ``R``
each, exact):

    layers.i.attn.q_einsum.w_lora_a [E, R], _lora_b [R, N, D]   -> q_proj  [E, R], [R, N*D]
    layers.i.attn.kv_einsum.w_lora_a [E, R], _lora_b [R, 2, K, D] -> k_proj, v_proj [E, R],
                                                                     B[:, 0], B[:, 1] [R, K*D]
    layers.i.attn.qkv_einsum.w_lora_b [R, 3, N, D]  (N == K)     -> q_proj, k_proj, v_proj
    layers.i.attn.attn_vec_einsum.w_lora_a [N, D, R], _lora_b [R, E] -> o_proj [N*D, R], [R, E]
    layers.i.mlp.{gate,up,down}_proj.kernel_lora_{a,b}           -> as for Llama

The pairs go onto the engine's LoRA slots unmerged (the base weights stay the actor's base
weights). A mixture-of-experts Qwen3 takes LoRA on its attention only here (a LoRA leaf on its
``[X, in, out]`` expert parameters is refused by name).

A rollout serving a LoRA actor scales every pair by ``lora_alpha / rank``
(`actor_lora_scales`: qwix keeps its rules private, so the alpha is given) and turns LoRA on in
its engine with room for the actor's rank (`lora_engine_options`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from jaxengine.lora import LoRAAdapter, lora_adapter_from_arrays

__all__ = [
  "LORA_MARK",
  "actor_lora_scales",
  "lora_adapter_from_tunix",
  "lora_engine_options",
  "lora_scales",
  "split_lora_leaves",
]

#: In a Tunix parameter name, what marks a qwix LoRA leaf.
LORA_MARK = "_lora_"

#: ``layers.{i}.{attn|mlp}.{module}.{w|kernel}_lora_{a|b}``.
_LORA_NAME = re.compile(r"layers\.(\d+)\.(attn|mlp)\.(\w+_proj|\w+_einsum)\.(w|kernel)_lora_([ab])")
#: Each Tunix module qwix wraps: (block, weight name), and the engine targets its pair gives.
_SOURCES: dict[str, tuple[tuple[str, str], tuple[str, ...]]] = {
  "q_proj": (("attn", "w"), ("q_proj",)),
  "k_proj": (("attn", "w"), ("k_proj",)),
  "v_proj": (("attn", "w"), ("v_proj",)),
  "o_proj": (("attn", "w"), ("o_proj",)),
  "gate_proj": (("mlp", "kernel"), ("gate_proj",)),
  "up_proj": (("mlp", "kernel"), ("up_proj",)),
  "down_proj": (("mlp", "kernel"), ("down_proj",)),
  # Gemma and Gemma 3's einsum projections.
  "q_einsum": (("attn", "w"), ("q_proj",)),
  "kv_einsum": (("attn", "w"), ("k_proj", "v_proj")),
  "qkv_einsum": (("attn", "w"), ("q_proj", "k_proj", "v_proj")),
  "attn_vec_einsum": (("attn", "w"), ("o_proj",)),
}


def split_lora_leaves(params: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
  """Tunix parameters by dotted name -> ``(base, lora)``: the qwix LoRA leaves (`LORA_MARK` in
  the name) apart from the rest."""
  base = {n: v for n, v in params.items() if LORA_MARK not in n}
  lora = {n: v for n, v in params.items() if LORA_MARK in n}
  return base, lora


def lora_scales(
  lora: Mapping[str, Any], rules: list[tuple[str, int, float]]
) -> dict[tuple[int, str], float]:
  """``alpha / rank`` of each ``(layer, target)`` pair among the LoRA leaves `lora`, from the
  first rule whose ``module_path`` fully matches the module (qwix's choice).

  Raises:
    ValueError: a pair no LoRA rule matches (naming its module), or a rule whose rank is not
      the pair's. (`JaxEngineRollout` passes one rule, ``(".*", rank, lora_alpha)``.)
  """
  scales = {}
  for name, value in lora.items():
    match = _LORA_NAME.fullmatch(name)
    if match is None or match[5] != "a":
      continue
    module = f"layers/{match[1]}/{match[2]}/{match[3]}"
    rule = next((r for r in rules if re.fullmatch(r[0], module)), None)
    if rule is None:
      raise ValueError(f"no qwix LoraRule matches module {module!r} (its LoRA leaf {name!r})")
    rank = int(value.shape[-1])
    if rule[1] != rank:
      raise ValueError(f"{name!r} has rank {rank}, its LoraRule {rule[0]!r} rank={rule[1]}")
    for target in _SOURCES.get(match[3], (None, (match[3],)))[1]:
      scales[int(match[1]), target] = rule[2] / rule[1]
  return scales


def _pairs(module: str, a: Any, b: Any) -> dict[str, tuple[Any, Any]]:
  """qwix's ``(A, B)`` of Tunix module `module` as engine target -> ``(A [in, R], B [R,
  out])`` (module docstring)."""
  r = b.shape[0]
  if module in ("o_proj", "attn_vec_einsum"):  # A [H, D, R]
    return {"o_proj": (a.reshape(-1, a.shape[-1]), b)}
  if module in ("q_proj", "k_proj", "v_proj"):  # B [R, H, D]
    return {module: (a, b.reshape(r, -1))}
  if module == "q_einsum":  # B [R, N, D]
    return {"q_proj": (a, b.reshape(r, -1))}
  if module in ("kv_einsum", "qkv_einsum"):  # B [R, 2 or 3, K, D]: one A, B's parts
    targets = _SOURCES[module][1]
    if b.ndim != 4 or b.shape[1] != len(targets):
      raise ValueError(f"{module} lora_b of shape {b.shape} is not [R, {len(targets)}, K, D]")
    return {t: (a, b[:, i].reshape(r, -1)) for i, t in enumerate(targets)}
  return {module: (a, b)}


def lora_adapter_from_tunix(
  lora: Mapping[str, Any],
  *,
  lora_int_id: int,
  num_layers: int,
  scales: Mapping[tuple[int, str], float],
  targets: Mapping[str, tuple[int, ...]],
) -> LoRAAdapter:
  """The engine adapter of a Tunix model's qwix LoRA leaves.

  Args:
    lora: the LoRA leaves by dotted Tunix name (`split_lora_leaves`), JAX or NumPy arrays.
    lora_int_id: the adapter's id in the engine.
    num_layers: the model's decoder layers.
    scales: ``(layer, target)`` -> ``alpha / rank`` (`lora_scales`).
    targets: the engine model's `lora_target_shapes`.

  Returns:
    A `LoRAAdapter` (host float32 copies, the scales folded into ``B``).

  Raises:
    ValueError: naming the first leaf of an unknown name, layer or target, a pair missing its
      other half or its scale, or a pair whose shapes do not reshape to the target's.
  """
  halves: dict[tuple[int, str], dict[str, Any]] = {}
  for name, value in lora.items():
    match = _LORA_NAME.fullmatch(name)
    module = None if match is None else match[3]
    source = _SOURCES.get(str(module))
    if (
      match is None
      or source is None
      or source[0] != (match[2], match[4])
      or any(t not in targets for t in source[1])
      or int(match[1]) >= num_layers
    ):
      raise ValueError(
        f"unsupported LoRA parameter {name!r} (LoRA on layers.<i>.attn.{{q,k,v,o}}_proj.w, "
        "Gemma's attn.{q,kv,qkv,attn_vec}_einsum.w and the MLP's *_proj.kernel; targets here: "
        f"{sorted(targets)})"
      )
    halves.setdefault((int(match[1]), str(module)), {})[match[5]] = value
  pairs = {}
  for (layer, module), half in sorted(halves.items()):
    if set(half) != {"a", "b"}:
      raise ValueError(
        f"LoRA on layer {layer} {module} lacks lora_{({'a', 'b'} - set(half)).pop()}"
      )
    try:
      module_pairs = _pairs(module, half["a"], half["b"])
    except ValueError as error:
      raise ValueError(f"LoRA on layer {layer}: {error}") from None
    for target, (a, b) in module_pairs.items():
      if (layer, target) not in scales:
        raise ValueError(f"LoRA on layer {layer} {target} lacks its scale")
      n_in, n_out = targets[target][-2:]
      if a.ndim != 2 or b.ndim != 2 or a.shape[0] != n_in or b.shape[-1] != n_out:
        raise ValueError(
          f"LoRA on layer {layer} {module}: lora_a, lora_b of shapes {half['a'].shape}, "
          f"{half['b'].shape} do not give {target}'s [{n_in}, r], [r, {n_out}]"
        )
      pairs[layer, target] = (a, b)
  return lora_adapter_from_arrays(lora_int_id, pairs, scale=dict(scales))


def actor_lora_scales(
  lora: dict[str, Any], lora_alpha: float | None
) -> dict[tuple[int, str], float]:
  """``lora_alpha / rank`` per LoRA pair (qwix's scale). qwix keeps its `LoraRule`s private to
  its provider, so the alpha is given (ValueError when it is not a positive number)."""
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


def lora_engine_options(engine_options: dict[str, Any], lora: dict[str, Any]) -> None:
  """`enable_lora` and a `max_lora_rank` holding the actor's rank in `engine_options`
  (ValueError if one given is smaller, or LoRA is switched off)."""
  rank = _lora_rank(lora)
  if engine_options.get("enable_lora") is False:
    raise ValueError("enable_lora=False, but the rollout actor has LoRA parameters")
  engine_options["enable_lora"] = True
  given = engine_options.setdefault("max_lora_rank", rank)
  if isinstance(given, int) and given < rank:
    raise ValueError(f"max_lora_rank={given} is below the actor's LoRA rank {rank}")
