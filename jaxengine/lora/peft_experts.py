"""PEFT adapters on a mixture of experts' routed experts, read onto the expert targets
(`jaxengine.models.lora.EXPERT_LORA_TARGETS`: one ``(A [X, in, r], B [X, r, out])`` pair per
layer and projection, `jaxengine.models.moe_lora`).

PEFT saves them in one of two forms:

- fused (transformers 5's experts, one ``[X, 2F, E]`` ``gate_up_proj`` and one ``[X, E, F]``
  ``down_proj`` parameter per layer; ``target_parameters`` ``["mlp.experts.gate_up_proj",
  "mlp.experts.down_proj"]``): each targeted parameter is wrapped once, the wrappers nested
  (``experts.lora_A``, ``experts.base_layer.lora_A``, ...), each wrapper's ``lora_A`` ``[X * r,
  in]`` (expert-major rows) and ``lora_B`` ``[out, r * X]`` (rank-major columns), expert ``e``'s
  matrix becoming ``W_e + scale * B_e A_e``. The nesting order is not in the names; each wrapper
  is told by its ``(in, out)``: ``(E, 2F)`` is ``gate_up_proj`` (its first ``F`` outputs the
  gate, as transformers splits it), ``(F, E)`` ``down_proj`` (they never agree: that would need
  ``E == F == 2F``). ``gate_up_proj`` gives both ``experts.gate_proj`` and ``experts.up_proj``
  its ``A`` and half of its ``B``;
  Gemma 4's experts sit beside its MLP (``layers.{i}.experts``), the others' in it
  (``mlp.experts``; Mixtral's ``block_sparse_moe.experts`` in earlier checkpoints);
- per expert (earlier transformers' expert modules, ``target_modules`` ``gate_proj`` ...;
  Mixtral's ``w1`` / ``w3`` / ``w2``): ``mlp.experts.{e}.gate_proj.lora_A.weight`` (Mixtral:
  ``block_sparse_moe.experts.{e}.w1``), every expert's pair stacked.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = [
  "LEGACY_EXPERT_MODULES",
  "expert_pairs",
  "is_expert_tensor",
  "module_name",
  "parameter_targets",
]

_BLOCK = r"layers\.(\d+)\.(?:(?:mlp|block_sparse_moe)\.)?experts\."
#: A fused wrapper's tensor: layer, nesting (``base_layer.`` repeated), half.
_FUSED = re.compile(_BLOCK + r"((?:base_layer\.)*)lora_([AB])(?:\.\w+)?\.weight$")
#: A per-expert module's tensor: layer, expert, module, half.
_PER_EXPERT = re.compile(
  _BLOCK + r"(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.lora_([AB])(?:\.\w+)?\.weight$"
)
#: The expert target of each per-expert module name (Mixtral's ``w1``, ``w3``, ``w2``).
LEGACY_EXPERT_MODULES = {
  "gate_proj": "experts.gate_proj",
  "up_proj": "experts.up_proj",
  "down_proj": "experts.down_proj",
  "w1": "experts.gate_proj",
  "w3": "experts.up_proj",
  "w2": "experts.down_proj",
}

Pair = tuple[np.ndarray, np.ndarray]


def is_expert_tensor(name: str) -> bool:
  """Whether adapter tensor `name` is one of a routed expert (either form)."""
  return bool(_FUSED.search(name) or _PER_EXPERT.search(name))


def parameter_targets(value: Any, where: str, target_shapes: Mapping[str, tuple]) -> list[str]:
  """The ``target_parameters`` of an adapter config, each a fused expert parameter of a model
  with expert targets.

  Raises:
    ValueError: (naming `where` and the entry) an entry that is not a routed expert's
      ``gate_up_proj`` / ``down_proj``, or any entry on a model without routed experts.
  """
  names = [value] if isinstance(value, str) else list(value or [])
  for name in names:
    if not isinstance(name, str) or name.rpartition(".")[2] not in ("gate_up_proj", "down_proj"):
      raise ValueError(
        f"lora_path={where!r}: target_parameters entry {name!r} is not supported (supported: "
        "a mixture of experts' experts.gate_up_proj, experts.down_proj)"
      )
    if "experts.gate_proj" not in target_shapes:
      raise ValueError(
        f"lora_path={where!r}: target_parameters {names} need a mixture of experts; this "
        "model has no routed experts"
      )
  return names


def expert_pairs(
  where: str,
  tensors: Mapping[str, np.ndarray],
  other_model: str,
  ranks: Any,
  num_layers: int,
  target_shapes: Mapping[str, tuple],
) -> dict[tuple[int, str], Pair]:
  """The expert tensors' ``(A [X, in, r], scale * B [X, r, out])`` float32 pairs by ``(layer,
  target)``.

  Args:
    where: the adapter's directory (for errors).
    tensors: its routed experts' tensors (`is_expert_tensor`), by saved name.
    other_model: the start of an error for an adapter of another base model.
    ranks: each module's rank and scale by its dotted name (``rank(module)``,
      ``module_scale(module)``: PEFT's ``r``, ``lora_alpha`` and their patterns; a fused
      ``gate_up_proj`` made from ``gate_proj`` and ``up_proj`` targets has twice the rank).
    num_layers: the model's layers; target_shapes: its `lora_target_shapes`.

  Raises:
    ValueError: tensors on a model without routed experts, a layer beyond the model's, a
      wrapper whose sizes are none of the model's expert parameters (another base model), a
      projection given twice, a pair missing a half or of other shapes than rank ``r``, or a
      per-expert projection missing experts.
  """
  if "experts.gate_proj" not in target_shapes:
    raise ValueError(f"{other_model}: tensor {next(iter(tensors))!r} is of routed experts")
  num_experts, e, f = target_shapes["experts.gate_proj"]
  # Each half by "A" / "B", and its module's dotted name by "module".
  fused: dict[tuple[int, str], dict[str, Any]] = {}
  per_expert: dict[tuple[int, str], dict[int, dict[str, Any]]] = {}
  for name, tensor in tensors.items():
    match = _FUSED.search(name)
    if match is not None:
      layer, key, half = int(match[1]), match[2], match[3]
      entry = fused.setdefault((layer, key), {})
      entry[half], entry["module"] = np.asarray(tensor, np.float32), module_name(name)
    else:
      match = _PER_EXPERT.search(name)
      assert match is not None  # `is_expert_tensor`
      layer, key, half = int(match[1]), LEGACY_EXPERT_MODULES[match[3]], match[4]
      experts = per_expert.setdefault((layer, key), {})
      entry = experts.setdefault(int(match[2]), {})
      entry[half], entry["module"] = np.asarray(tensor, np.float32), module_name(name)
    if layer >= num_layers:
      raise ValueError(
        f"{other_model}: tensor {name!r} is for layer {layer}, this model has {num_layers} "
        f"layers (0..{num_layers - 1})"
      )
  pairs: dict[tuple[int, str], Pair] = {}

  def put(layer: int, target: str, a: np.ndarray, b: np.ndarray, scale: float) -> None:
    if (layer, target) in pairs:
      raise ValueError(f"lora_path={where!r}: layer {layer} {target} is given twice")
    pairs[layer, target] = (np.ascontiguousarray(a), np.ascontiguousarray(b) * scale)

  for (layer, nesting), halves in fused.items():
    a, b = halves.get("A"), halves.get("B")
    if a is None or b is None or a.ndim != 2 or b.ndim != 2:
      shapes = [None if t is None else t.shape for t in (a, b)]
      raise ValueError(
        f"lora_path={where!r}: layer {layer} experts.{nesting}lora_A, lora_B have shapes "
        f"{shapes}, expected 2-D [X * r, in], [out, r * X]"
      )
    n_in, n_out = a.shape[1], b.shape[0]
    kind = {(e, 2 * f): "gate_up_proj", (f, e): "down_proj"}.get((n_in, n_out))
    if kind is None:
      raise ValueError(
        f"{other_model}: its layer {layer} experts map {n_in} -> {n_out} features (lora_A, "
        f"lora_B of shapes {a.shape}, {b.shape}), this model's experts.gate_up_proj {e} -> "
        f"{2 * f}, experts.down_proj {f} -> {e}"
      )
    module = f"{halves['module']}.{kind}"  # PEFT's key: the parameter's dotted name
    rank, scale = ranks.rank(module), ranks.module_scale(module)
    if a.shape != (num_experts * rank, n_in) or b.shape != (n_out, rank * num_experts):
      raise ValueError(
        f"lora_path={where!r}: layer {layer} experts.{kind} has lora_A, lora_B of shapes "
        f"{a.shape}, {b.shape}, expected {(num_experts * rank, n_in)}, "
        f"{(n_out, rank * num_experts)} ({num_experts} experts of rank {rank})"
      )
    a3 = a.reshape(num_experts, rank, n_in).transpose(0, 2, 1)  # [X, in, r]
    b3 = b.reshape(n_out, rank, num_experts).transpose(2, 1, 0)  # [X, r, out]
    if kind == "down_proj":
      put(layer, "experts.down_proj", a3, b3, scale)
    else:  # transformers' chunk(2): the gate's outputs first
      put(layer, "experts.gate_proj", a3, b3[..., :f], scale)
      put(layer, "experts.up_proj", a3, b3[..., f:], scale)
  for (layer, target), experts in per_expert.items():
    missing = sorted(set(range(num_experts)) - set(experts))
    if missing or len(experts) != num_experts:
      raise ValueError(
        f"{other_model}: its layer {layer} {target} has experts {sorted(experts)}, this "
        f"model's {num_experts} (0..{num_experts - 1})"
      )
    _, n_in, n_out = target_shapes[target]
    rank, scale = ranks.rank(experts[0]["module"]), ranks.module_scale(experts[0]["module"])
    a_list, b_list = [], []
    for expert in range(num_experts):
      a, b = experts[expert].get("A"), experts[expert].get("B")
      if a is None or b is None or a.shape != (rank, n_in) or b.shape != (n_out, rank):
        shapes = [None if t is None else t.shape for t in (a, b)]
        raise ValueError(
          f"lora_path={where!r}: layer {layer} expert {expert} {target} has lora_A, lora_B of "
          f"shapes {shapes}, expected {(rank, n_in)}, {(n_out, rank)}"
        )
      a_list.append(a.T)
      b_list.append(b.T)
    put(layer, target, np.stack(a_list), np.stack(b_list), scale)
  return pairs


def module_name(tensor_name: str) -> str:
  """The base model's dotted module name of an adapter tensor (PEFT's ``base_model.model.``
  prefix, ``base_layer.`` wrappers and the ``lora_A.weight`` tail left out)."""
  name = tensor_name.removeprefix("base_model.model.").replace("base_layer.", "")
  return name.rpartition(".lora_")[0]
