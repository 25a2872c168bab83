"""The bytes a compiled TPU executable moves to and from HBM, per instruction, read from its
optimized HLO text (``compiled.as_text()``): the decode estimates' own model of memory traffic
(design: "an estimate needs per-branch bytes, or a model of its own").

Why not XLA's ``bytes accessed``: XLA:TPU's cost analysis counts every operand and result of
every instruction wherever it lives. Its memory-space assignment prefetches some weights into the
chip's on-core memory (VMEM, layouts marked ``S(1)``) with async slices (``slice-start``) and a
``ConcatBitcast``, and the matmul then reads the VMEM copy: the analysis counts the HBM read,
the VMEM write, the ``ConcatBitcast``'s write and the matmul's VMEM read, four times the one HBM
read the chip makes (Llama-3.1-8B's one-token step on v6e:1x1: 2.63 GB of attention weights
prefetched, 22.9 GB counted against 15.0 GB of HBM traffic). A ``conditional`` is counted as the
sum of its branches where one runs.

The model here, `hbm_bytes`, counts per instruction of the entry computation:

- operands and results whose layout is in HBM (memory space 0: no ``S(n)`` in the layout);
  on-core buffers (``S(1)`` VMEM and the other spaces) cost nothing;
- a fusion's operand by what the fused computation reads of it: a parameter read only through
  (dynamic-)slices or gathers, directly or in nested fusions, counts their results' bytes, one
  updated in place by the root's dynamic-update-slice or scatter counts nothing and the result
  counts the update's bytes;
- an async slice or copy (``slice-start``, ``copy-start``) its source read (the slice's bytes)
  and its destination written, each where it is in HBM; the matching ``-done`` nothing;
- a ``conditional`` as its costliest branch, a ``while`` as its body and condition times the
  trip count XLA knows, or that its condition ``i < N`` shows (once otherwise:
  `_Model.trip_count`), a ``call`` or an async call (``call-start``, ``async-start``: a scatter
  offloaded to the SparseCores) as its computation;
- nothing for views (``bitcast``, ``get-tuple-element``, ``tuple``, ``ConcatBitcast``) and for
  the paged attention kernel (its pages are the report's separate KV term: the kernel reads the
  context's pages, not the whole pool it is passed); other kernels (``tpu_custom_call``: Pallas
  kernels, and XLA's own Mosaic kernels such as the ragged dot of a mixture of experts) count
  their operands and results whole (the ragged dot reads every expert's matrix at most: an
  upper bound where a step routes to fewer experts).

Tile padding is not counted (logical shapes). It agrees with XLA's count where XLA counts right:
with every memory space counted (and the ``ConcatBitcast``'s result, as XLA counts it),
Llama-3.1-8B's one-token step comes to 22.930 GB against XLA's 22.936 GB.
"""

from __future__ import annotations

import dataclasses
import math
import re

_DTYPE_BITS = {
  "pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "f8e4m3fn": 8, "f8e5m2": 8, "f8e4m3b11fnuz": 8,
  "s16": 16, "u16": 16, "f16": 16, "bf16": 16, "s32": 32, "u32": 32, "f32": 32, "s64": 64,
  "u64": 64, "f64": 64, "c64": 64, "c128": 128,
}  # fmt: skip
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\](\{[^{}]*\})?")
_HEADER = re.compile(r"^(ENTRY )?%([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = ")
_OPERAND = re.compile(r"%([\w.\-]+)")
#: Instructions that move no bytes (views, bookkeeping, the second half of an async pair).
_FREE = {
  "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
  "replica-id", "copy-done", "slice-done", "opt-barrier", "add-dependency", "iota",
}  # fmt: skip
_FREE_CUSTOM_CALLS = {"ConcatBitcast"}
#: The JAX source of the paged attention kernel, whose pages the report counts on its own.
_PAGED_ATTENTION = "paged_attention"
_READ_IN_PART = {"dynamic-slice", "slice", "gather"}
_IN_PLACE = {"dynamic-update-slice", "scatter"}


@dataclasses.dataclass(frozen=True)
class Instruction:
  """One HLO instruction as this model reads it.

  Attributes:
    name: its name (without ``%``).
    shape: its result shape's text (an array or a tuple, layouts included).
    opcode: e.g. ``"fusion"``, ``"slice-start"``.
    operands: the names of its operands, in order.
    attributes: the text after its operand list (``calls=``, ``metadata=``, ...).
    number: a parameter's number (``parameter(2)``: 2), an integer scalar constant's value
      (``constant(32)``: 32), else -1.
  """

  name: str
  shape: str
  opcode: str
  operands: tuple[str, ...]
  attributes: str
  number: int = -1

  def called(self, key: str) -> list[str]:
    """The computations named by attribute `key` (``calls``, ``body``, ``branch_computations``)."""
    match = re.search(rf"\b{key}=(\{{[^}}]*\}}|%[\w.\-]+)", self.attributes)
    return _OPERAND.findall(match.group(1)) if match else []

  @property
  def op_name(self) -> str:
    """The JAX source of the instruction (metadata ``op_name``), or ``""``."""
    match = re.search(r'op_name="([^"]*)"', self.attributes)
    return match.group(1) if match else ""


@dataclasses.dataclass(frozen=True)
class OpBytes:
  """One entry instruction's HBM bytes (`hbm_bytes`'s ``ops``).

  Attributes:
    name: the instruction's name.
    opcode: its opcode (a custom call's target after a colon).
    op_name: its JAX source (metadata), or ``""``.
    bytes: the bytes it reads and writes in HBM (control flow: its callees' included).
  """

  name: str
  opcode: str
  op_name: str
  bytes: float


def shape_bytes(shape: str, hbm_only: bool = True) -> float:
  """Bytes of the arrays in `shape` (an HLO shape's text, a tuple's elements summed); with
  `hbm_only`, only those whose layout puts them in HBM (no ``S(n)`` memory space, or ``S(0)``)."""
  total = 0.0
  for dtype, dims, layout in _ARRAY.findall(shape):
    if dtype not in _DTYPE_BITS or (hbm_only and not in_hbm(layout)):
      continue
    total += math.prod(int(d) for d in dims.split(",") if d) * _DTYPE_BITS[dtype] / 8
  return total


def in_hbm(layout: str) -> bool:
  """Whether a layout's text (``{1,0:T(8,128)S(1)}``) leaves its array in HBM (memory space 0)."""
  space = re.search(r"S\((\d+)\)", layout)
  return space is None or space.group(1) == "0"


def parse_module(text: str) -> tuple[dict[str, list[Instruction]], str]:
  """An HLO module's text as its computations' instructions and the entry computation's name.

  Raises:
    ValueError: the text has no ENTRY computation.
  """
  computations: dict[str, list[Instruction]] = {}
  entry, current = None, None
  for line in text.splitlines():
    header = _HEADER.match(line)
    if header and not line.startswith(" "):
      current = header.group(2)
      computations[current] = []
      entry = current if header.group(1) else entry
    elif line.startswith("}"):
      current = None
    elif current is not None and (instruction := _parse_instruction(line)) is not None:
      computations[current].append(instruction)
  if entry is None:
    raise ValueError("the HLO text has no ENTRY computation")
  return computations, entry


def _parse_instruction(line: str) -> Instruction | None:
  head = _INSTRUCTION.match(line)
  if head is None:
    return None
  rest = line[head.end() :]
  shape_end = _balanced_end(rest, 0) if rest.startswith("(") else rest.index(" ")
  shape = rest[:shape_end]
  opcode_match = re.match(r"\s*([a-z][\w\-]*)\(", rest[shape_end:])
  if opcode_match is None:
    return None
  start = shape_end + opcode_match.end() - 1
  end = _balanced_end(rest, start)
  operands = tuple(_OPERAND.findall(rest[start:end]))
  opcode = opcode_match.group(1)
  literal = rest[start + 1 : end - 1]
  number = int(literal) if opcode == "parameter" else -1
  if opcode == "constant" and re.fullmatch(r"-?\d+", literal):  # an integer scalar's value
    number = int(literal)
  return Instruction(head.group(1), shape, opcode, operands, rest[end:], number)


def _balanced_end(text: str, start: int) -> int:
  """The index just past the parenthesis that closes the one at `start`."""
  depth = 0
  for index in range(start, len(text)):
    depth += {"(": 1, ")": -1}.get(text[index], 0)
    if depth == 0:
      return index + 1
  return len(text)


class _Model:
  """`hbm_bytes`'s counting over one module (see the module docstring)."""

  def __init__(self, text: str, hbm_only: bool):
    self.computations, self.entry = parse_module(text)
    self.hbm_only = hbm_only
    self.memo: dict[str, float] = {}

  def size(self, shape: str) -> float:
    return shape_bytes(shape, self.hbm_only)

  def computation(self, name: str) -> float:
    if name not in self.memo:
      shapes = {i.name: i.shape for i in self.computations[name]}
      self.memo[name] = sum(self.instruction(i, shapes) for i in self.computations[name])
    return self.memo[name]

  def instruction(self, op: Instruction, shapes: dict[str, str]) -> float:
    code = op.opcode
    operands = [shapes.get(o, "") for o in op.operands]
    if code == "custom-call" and _target(op) == "ConcatBitcast" and not self.hbm_only:
      return self.size(op.shape)  # XLA's count: its result, written (a view in VMEM)
    if code in _FREE or (code == "custom-call" and _target(op) in _FREE_CUSTOM_CALLS):
      return 0.0
    if code == "custom-call" and _PAGED_ATTENTION in op.op_name:
      return 0.0
    if code == "fusion":
      return self.fusion(op, operands)
    if code in ("slice-start", "copy-start"):
      # slice-start: ((source), destination, flag); copy-start: (destination, source, flag)
      parts = _tuple_elements(op.shape)
      source, destination = (parts[0], parts[1]) if code == "slice-start" else (parts[1], parts[0])
      moved = shape_bytes(destination, hbm_only=False)
      read = moved if self.size(source) > 0 or not self.hbm_only else 0.0
      return read + self.size(destination)
    if code == "conditional":
      branches = op.called("branch_computations") or (
        op.called("true_computation") + op.called("false_computation")
      )
      return self.size(operands[0]) + max((self.computation(b) for b in branches), default=0.0)
    if code == "while":
      loop = sum(self.computation(c) for c in op.called("body") + op.called("condition"))
      return loop * self.trip_count(op)
    if code == "call":
      return sum(self.computation(c) for c in op.called("to_apply"))
    if code in ("call-start", "async-start"):  # e.g. a scatter offloaded to the SparseCores
      return sum(self.computation(c) for c in op.called("calls") + op.called("to_apply"))
    if code in ("call-done", "async-done", "async-update"):
      return 0.0
    if code in _READ_IN_PART:  # reads the result's worth of operand 0
      return 2 * self.size(op.shape) + sum(self.size(s) for s in operands[1:])
    if code in _IN_PLACE:  # writes the update's worth into operand 0, in place
      update = operands[-1] if code == "scatter" else operands[1]
      indices = operands[1:-1] if code == "scatter" else operands[2:]
      return 2 * self.size(update) + sum(self.size(s) for s in indices)
    if code.endswith("-start"):  # a collective's operands; its -done writes the result
      return sum(self.size(s) for s in operands)
    return sum(self.size(s) for s in operands) + self.size(op.shape)

  def trip_count(self, op: Instruction) -> int:
    """A ``while``'s iterations: XLA's ``known_trip_count``, else a condition that is ``i < N``
    for a constant ``N`` and the loop's first tuple element ``i`` (a `jax.lax.scan`'s counter,
    which starts at 0: the scan over a model's stacked layers, whose compiled loop XLA:TPU
    leaves unannotated), else 1."""
    trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', op.attributes)
    if trips:
      return int(trips.group(1))
    (condition,) = op.called("condition") or [""]
    body = {i.name: i for i in self.computations.get(condition, [])}
    root = list(body.values())[-1] if body else None
    if root is None or root.opcode != "compare" or "direction=LT" not in root.attributes:
      return 1
    counter, bound = (body.get(name) for name in root.operands)
    if counter is None or bound is None or counter.opcode != "get-tuple-element":
      return 1
    if "index=0" in counter.attributes and bound.opcode == "constant":
      return max(bound.number, 1)
    return 1

  def partial_read(self, name: str, users: list[Instruction]) -> float | None:
    """The bytes `users` read of a fused parameter `name` when each reads only part of it: a
    (dynamic-)slice or gather of it, or a nested fusion that reads it so (a scan's layer
    slice: ``dynamic-slice`` of the stacked weight inside the dot's fusion); None when some
    user reads it whole."""
    total = 0.0
    for user in users:
      if user.opcode in _READ_IN_PART and user.operands[0] == name:
        total += shape_bytes(user.shape, hbm_only=False)
        continue
      if user.opcode != "fusion" or user.operands.count(name) != 1:
        return None
      (called,) = user.called("calls")
      body = self.computations[called]
      index = user.operands.index(name)
      inner = next((i for i in body if i.opcode == "parameter" and i.number == index), None)
      inner_users = [i for i in body if inner is not None and inner.name in i.operands]
      part = self.partial_read(inner.name, inner_users) if inner and inner_users else None
      if part is None:
        return None
      total += part
    return total

  def fusion(self, op: Instruction, operands: list[str]) -> float:
    (called,) = op.called("calls")
    body = self.computations[called]
    by_name = {i.name: i for i in body}
    params = {i.number: i for i in body if i.opcode == "parameter"}
    root = body[-1]
    roots = [by_name[n] for n in root.operands] if root.opcode == "tuple" else [root]
    in_place = {r.operands[0]: r for r in roots if r is not None and r.opcode in _IN_PLACE}
    total = 0.0
    for index, shape in enumerate(operands):
      param = params.get(index)
      if param is None or self.size(shape) == 0.0:
        continue
      users = [i for i in body if param.name in i.operands]
      if param.name in in_place:
        users = [u for u in users if u is not in_place[param.name]]
      part = self.partial_read(param.name, users) if users else None
      if part is not None:
        total += part
      elif users or param.name not in in_place:
        total += self.size(shape)
    outputs = _tuple_elements(op.shape) if op.shape.startswith("(") else [op.shape]
    for position, shape in enumerate(outputs):
      written = roots[min(position, len(roots) - 1)]
      if written.opcode in _IN_PLACE and self.size(shape) > 0:
        update = written.operands[-1] if written.opcode == "scatter" else written.operands[1]
        total += shape_bytes(by_name[update].shape if update in by_name else "", hbm_only=False)
      else:
        total += self.size(shape)
    return total


def _target(op: Instruction) -> str:
  match = re.search(r'custom_call_target="([^"]*)"', op.attributes)
  return match.group(1) if match else ""


def _tuple_elements(shape: str) -> list[str]:
  """The top-level elements of a tuple shape's text."""
  inner, parts, depth, start = shape[1:-1], [], 0, 0
  for index, char in enumerate(inner):
    depth += {"(": 1, ")": -1, "{": 1, "}": -1, "[": 1, "]": -1}.get(char, 0)
    if char == "," and depth == 0:
      parts.append(inner[start:index].strip())
      start = index + 1
  parts.append(inner[start:].strip())
  return parts


@dataclasses.dataclass(frozen=True)
class HbmBytes:
  """`hbm_bytes`'s result.

  Attributes:
    total: bytes the executable reads and writes in HBM, by the module docstring's model.
    ops: each entry instruction that moves any, costliest first.
  """

  total: float
  ops: tuple[OpBytes, ...]


def hbm_bytes(hlo_text: str, hbm_only: bool = True) -> HbmBytes:
  """The HBM bytes of a compiled executable (see the module docstring).

  Args:
    hlo_text: the optimized HLO module's text (``compiled.as_text()`` of a TPU compile).
    hbm_only: False counts every memory space (on-core buffers too), as XLA's ``bytes
      accessed`` does: a check of this model against XLA's count.

  Returns:
    The total and the entry computation's instructions with their bytes.

  Raises:
    ValueError: `hlo_text` has no ENTRY computation.
  """
  model = _Model(hlo_text, hbm_only)
  body = model.computations[model.entry]
  shapes = {i.name: i.shape for i in body}
  ops = []
  for op in body:
    moved = model.instruction(op, shapes)
    if moved > 0:
      code = op.opcode + (f":{_target(op)}" if op.opcode == "custom-call" else "")
      ops.append(OpBytes(op.name, code, op.op_name, moved))
  ops.sort(key=lambda o: -o.bytes)
  return HbmBytes(sum(o.bytes for o in ops), tuple(ops))
