"""`jaxengine.aot.hbm_bytes`: the HBM bytes of a compiled TPU executable, read from HLO text in
the form XLA:TPU prints it (layouts with memory spaces, async slices, fusions, conditionals);
no compile needed."""

from __future__ import annotations

import pytest

from jaxengine.aot.hbm_bytes import hbm_bytes, shape_bytes

#: A weight [1024, 512] bf16 (1 MiB) prefetched into VMEM in two async slices and joined by a
#: ConcatBitcast, then read by a matvec fusion from VMEM; a second weight read from HBM.
PREFETCH = """HloModule m

%fused_dot (p0: bf16[1024,512], p1: bf16[1,512]) -> bf16[1,1024] {
  %p0 = bf16[1024,512]{1,0:T(8,128)(2,1)S(1)} parameter(0)
  %p1 = bf16[1,512]{1,0:T(2,128)(2,1)} parameter(1)
  ROOT %dot = bf16[1,1024]{1,0:T(2,128)(2,1)} dot(%p1, %p0), lhs_contracting_dims={1}
}

%fused_dot2 (q0: bf16[512,1024], q1: bf16[1,1024]) -> bf16[1,512] {
  %q0 = bf16[512,1024]{1,0:T(8,128)(2,1)} parameter(0)
  %q1 = bf16[1,1024]{1,0:T(2,128)(2,1)} parameter(1)
  ROOT %dot2 = bf16[1,512]{1,0:T(2,128)(2,1)} dot(%q1, %q0), lhs_contracting_dims={1}
}

ENTRY %main (w: bf16[1024,512], w2: bf16[512,1024], x: bf16[1,512]) -> bf16[1,512] {
  %w = bf16[1024,512]{1,0:T(8,128)(2,1)} parameter(0)
  %w2 = bf16[512,1024]{1,0:T(8,128)(2,1)} parameter(1)
  %x = bf16[1,512]{1,0:T(2,128)(2,1)} parameter(2)
  %bitcast = s8[1048576]{0:T(1024)} bitcast(%w)
  %slice-start = ((s8[1048576]{0}), s8[524288]{0:S(1)}, s32[]{:S(2)}) slice-start(%bitcast)
  %slice-start.1 = ((s8[1048576]{0}), s8[524288]{0:S(1)}, s32[]{:S(2)}) slice-start(%bitcast)
  %sd = s8[524288]{0:T(1024)S(1)} slice-done(%slice-start)
  %sd.1 = s8[524288]{0:T(1024)S(1)} slice-done(%slice-start.1)
  %cc = bf16[1024,512]{1,0:S(1)} custom-call(%sd, %sd.1), custom_call_target="ConcatBitcast"
  %fusion = bf16[1,1024]{1,0} fusion(%cc, %x), kind=kOutput, calls=%fused_dot
  ROOT %fusion.2 = bf16[1,512]{1,0} fusion(%w2, %fusion), kind=kOutput, calls=%fused_dot2
}
"""

#: A [4096, 64] f32 page array (1 MiB) updated in place at one row, a row read from a [8192, 64]
#: f32 table (2 MiB) by a fused dynamic-slice, and a conditional whose branches read 1 MiB and
#: 2 MiB.
IN_PLACE_AND_BRANCHES = """HloModule m

%fused_update (a0: f32[4096,64], a1: f32[1,64], a2: s32[]) -> f32[4096,64] {
  %a0 = f32[4096,64]{1,0:T(8,128)} parameter(0)
  %a1 = f32[1,64]{1,0:T(1,128)} parameter(1)
  %a2 = s32[]{:T(128)} parameter(2)
  %zero = s32[]{:T(128)} constant(0)
  ROOT %dus = f32[4096,64]{1,0:T(8,128)} dynamic-update-slice(%a0, %a1, %a2, %zero)
}

%fused_row (b0: f32[8192,64], b1: s32[]) -> f32[1,64] {
  %b0 = f32[8192,64]{1,0:T(8,128)} parameter(0)
  %b1 = s32[]{:T(128)} parameter(1)
  %zero.1 = s32[]{:T(128)} constant(0)
  %ds = f32[1,64]{1,0:T(1,128)} dynamic-slice(%b0, %b1, %zero.1), dynamic_slice_sizes={1,64}
  ROOT %neg = f32[1,64]{1,0:T(1,128)} negate(%ds)
}

%small_branch (c0: f32[4096,64]) -> f32[] {
  %c0 = f32[4096,64]{1,0:T(8,128)} parameter(0)
  %z = f32[]{:T(128)} constant(0)
  ROOT %r = f32[] reduce(%c0, %z), dimensions={0,1}, to_apply=%add
}

%big_branch (d0: f32[8192,64]) -> f32[] {
  %d0 = f32[8192,64]{1,0:T(8,128)} parameter(0)
  %z.1 = f32[]{:T(128)} constant(0)
  ROOT %r.1 = f32[] reduce(%d0, %z.1), dimensions={0,1}, to_apply=%add
}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

ENTRY %main (pages: f32[4096,64], table: f32[8192,64], i: s32[], which: s32[]) -> (f32[4096,64], f32[]) {
  %pages = f32[4096,64]{1,0:T(8,128)} parameter(0)
  %table = f32[8192,64]{1,0:T(8,128)} parameter(1)
  %i = s32[]{:T(128)} parameter(2)
  %which = s32[]{:T(128)} parameter(3)
  %row = f32[1,64]{1,0:T(1,128)} fusion(%table, %i), kind=kLoop, calls=%fused_row
  %updated = f32[4096,64]{1,0:T(8,128)} fusion(%pages, %row, %i), kind=kLoop, calls=%fused_update
  %cond = f32[]{:T(128)} conditional(%which, %pages, %table), branch_computations={%small_branch, %big_branch}
  ROOT %out = (f32[4096,64]{1,0:T(8,128)}, f32[]{:T(128)}) tuple(%updated, %cond)
}
"""
MIB = 1 << 20


def test_a_weight_prefetched_into_vmem_counts_once_as_read_from_hbm():
  """XLA's count of this module would take the 1 MiB weight four times (the slices' HBM read
  and VMEM write, the ConcatBitcast's write, the matmul's VMEM read); in HBM it is read once,
  beside the second weight read directly, and the activations."""
  result = hbm_bytes(PREFETCH)
  activations = 2 * (512 * 2) + 2 * (1024 * 2)  # x and fusion's output, each read and written
  assert result.total == 2 * MIB + activations
  assert result.ops[0].name == "fusion.2" and result.ops[0].bytes == MIB + 1024 * 2 + 512 * 2
  assert {o.name: o.bytes for o in result.ops}["slice-start"] == MIB // 2
  every_space = hbm_bytes(PREFETCH, hbm_only=False)  # XLA's way: VMEM copies counted
  assert every_space.total == 5 * MIB + activations


def test_in_place_updates_row_reads_and_a_conditional_s_costliest_branch():
  """An in-place dynamic-update-slice of a 1 MiB page array counts its row, not the array; a
  fused dynamic-slice of a 2 MiB table its row; a conditional its costlier branch (2 MiB), not
  both (3 MiB)."""
  result = hbm_bytes(IN_PLACE_AND_BRANCHES)
  by_name = {o.name: o.bytes for o in result.ops}
  row = 64 * 4
  assert by_name["updated"] == 2 * row + 4  # the row read and written in place, the index
  assert by_name["row"] == 2 * row + 4  # the table's row read, the result written, the index
  assert by_name["cond"] == 2 * MIB + 3 * 4  # the index, the table, the reduce's init and result
  assert result.total == by_name["updated"] + by_name["row"] + by_name["cond"]


@pytest.mark.parametrize(
  "shape, hbm, every",
  [
    ("bf16[1024,512]{1,0:T(8,128)(2,1)}", MIB, MIB),
    ("bf16[1024,512]{1,0:T(8,128)(2,1)S(1)}", 0, MIB),
    ("(f32[64]{0:T(128)}, f32[64]{0:T(128)S(1)}, u32[]{:S(2)})", 256, 516),
    ("pred[256,128256]{1,0:T(32,128)(4,1)}", 256 * 128256, 256 * 128256),
  ],
)
def test_shape_bytes_by_memory_space(shape, hbm, every):
  assert shape_bytes(shape) == hbm and shape_bytes(shape, hbm_only=False) == every


def test_text_without_an_entry_is_refused():
  with pytest.raises(ValueError, match="ENTRY"):
    hbm_bytes("HloModule m\n")


KERNELS = """HloModule m

ENTRY %main (pages: bf16[4096,256], w: bf16[8,256,128], q: bf16[1,256]) -> (bf16[1,256], bf16[1,128]) {
  %pages = bf16[4096,256]{1,0} parameter(0)
  %w = bf16[8,256,128]{2,1,0} parameter(1)
  %q = bf16[1,256]{1,0} parameter(2)
  %attn = bf16[1,256]{1,0} custom-call(%q, %pages), custom_call_target="tpu_custom_call",
    metadata={op_name="jit(step)/ragged_paged_attention_kernel/pallas_call"}
  %gmm = bf16[1,128]{1,0} custom-call(%attn, %w), custom_call_target="tpu_custom_call",
    metadata={op_name="jit(step)/ragged_dot_general/ragged-dot-none"}
  ROOT %out = (bf16[1,256]{1,0}, bf16[1,128]{1,0}) tuple(%attn, %gmm)
}
"""


def test_a_kernel_counts_its_operands_but_the_paged_attention_kernel_its_none():
  """XLA's ragged dot (a Mosaic kernel) reads its 512 KiB expert stack (all experts: an upper
  bound); the paged attention kernel's 2 MiB pool is the report's separate KV term."""
  result = hbm_bytes(KERNELS.replace(",\n    metadata", ", metadata"))
  by_name = {o.name: o.bytes for o in result.ops}
  assert by_name == {"gmm": 8 * 256 * 128 * 2 + 256 * 2 + 128 * 2}


#: A scan over 4 stacked layers of a [4, 1024, 256] f32 weight (4 MiB): each iteration reads
#: its layer's 1 MiB through a fused dynamic-slice; XLA:TPU left the loop without a
#: ``known_trip_count`` (the scanned decoder's loop), its condition ``i < 4``.
SCAN = """HloModule m

%fused_layer (w0: f32[4,1024,256], i0: s32[]) -> f32[1024] {
  %w0 = f32[4,1024,256]{2,1,0:T(8,128)} parameter(0)
  %i0 = s32[]{:T(128)} parameter(1)
  %zero = s32[]{:T(128)} constant(0)
  %ds = f32[1,1024,256]{2,1,0:T(8,128)S(1)} dynamic-slice(%w0, %i0, %zero, %zero)
  %z = f32[]{:T(128)} constant(0)
  ROOT %r = f32[1024]{0:T(1024)S(1)} reduce(%ds, %z), dimensions={0,2}, to_apply=%add
}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%body (t: (s32[], f32[4,1024,256])) -> (s32[], f32[4,1024,256]) {
  %t = (s32[]{:T(128)}, f32[4,1024,256]{2,1,0:T(8,128)}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%t), index=0
  %w = f32[4,1024,256]{2,1,0:T(8,128)} get-tuple-element(%t), index=1
  %layer = f32[1024]{0:T(1024)S(1)} fusion(%w, %i), kind=kLoop, calls=%fused_layer
  %one = s32[]{:T(128)} constant(1)
  %next = s32[]{:T(128)} add(%i, %one)
  ROOT %out = (s32[]{:T(128)}, f32[4,1024,256]{2,1,0:T(8,128)}) tuple(%next, %w)
}

%cond (c: (s32[], f32[4,1024,256])) -> pred[] {
  %four = s32[]{:T(128)} constant(4)
  %c = (s32[]{:T(128)}, f32[4,1024,256]{2,1,0:T(8,128)}) parameter(0)
  %ci = s32[]{:T(128)} get-tuple-element(%c), index=0
  ROOT %lt = pred[]{:T(512)} compare(%ci, %four), direction=LT
}

ENTRY %main (weights: f32[4,1024,256]) -> (s32[], f32[4,1024,256]) {
  %weights = f32[4,1024,256]{2,1,0:T(8,128)} parameter(0)
  %start = s32[]{:T(128)} constant(0)
  %init = (s32[]{:T(128)}, f32[4,1024,256]{2,1,0:T(8,128)}) tuple(%start, %weights)
  ROOT %loop = (s32[]{:T(128)}, f32[4,1024,256]{2,1,0:T(8,128)}) while(%init), condition=%cond, body=%body
}
"""


#: The same loop as XLA:TPU fuses a scanned decoder's matmul: the layer's slice in a nested
#: fusion inside the fusion that reads the stacked weight.
SCAN_NESTED = SCAN.replace(
  """%fused_layer (w0: f32[4,1024,256], i0: s32[]) -> f32[1024] {
  %w0 = f32[4,1024,256]{2,1,0:T(8,128)} parameter(0)
  %i0 = s32[]{:T(128)} parameter(1)
  %zero = s32[]{:T(128)} constant(0)
  %ds = f32[1,1024,256]{2,1,0:T(8,128)S(1)} dynamic-slice(%w0, %i0, %zero, %zero)""",
  """%fused_slice (v0: f32[4,1024,256], j0: s32[]) -> f32[1,1024,256] {
  %v0 = f32[4,1024,256]{2,1,0:T(8,128)} parameter(0)
  %j0 = s32[]{:T(128)} parameter(1)
  %zero.2 = s32[]{:T(128)} constant(0)
  ROOT %ds.2 = f32[1,1024,256]{2,1,0:T(8,128)} dynamic-slice(%v0, %j0, %zero.2, %zero.2)
}

%fused_layer (w0: f32[4,1024,256], i0: s32[]) -> f32[1024] {
  %w0 = f32[4,1024,256]{2,1,0:T(8,128)} parameter(0)
  %i0 = s32[]{:T(128)} parameter(1)
  %ds = f32[1,1024,256]{2,1,0:T(8,128)S(1)} fusion(%w0, %i0), kind=kLoop, calls=%fused_slice""",
)


@pytest.mark.parametrize("text", [SCAN, SCAN_NESTED], ids=["slice", "nested_slice"])
def test_a_scan_without_a_known_trip_count_counts_every_iteration(text):
  """Each of the 4 iterations reads its layer's 1 MiB: 4 MiB in all, not the one iteration a
  loop of unknown length counts, and not the whole stack per iteration where the slice is
  fused one level down."""
  result = hbm_bytes(text)
  # per iteration: the layer's rows and the slice index, the counter's add (2 operands and its
  # result), the condition's compare (2 operands, a 1-byte result)
  iteration = MIB + 4 + 3 * 4 + (2 * 4 + 1)
  assert result.total == 4 * iteration
