"""`bench/hlo_copies.py`'s HLO parser on hand-written HLO text (no compile).

The GPU finding it produces (which buffers a decode program copies) is only
as good as its attribution of each copy to a computation: a copy inside a
fusion is a layout change, one in a while body is a memcpy per step.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.hlo_copies import copies  # noqa: E402

HLO = """\
HloModule jit_loop, entry_computation_layout={(f32[4]{0})->f32[4]{0}}

%fused_computation.1 (param_0.1: u8[2,1024]) -> u8[1024,2] {
  %param_0.1 = u8[2,1024]{1,0} parameter(0)
  ROOT %copy.1 = u8[1024,2]{1,0} copy(%param_0.1), metadata={op_name="jit(f)/transpose"}
}

%wide.region_0.7 (arg_tuple.1: (s32[], u8[64,65536], /*index=2*/f32[8])) -> (s32[], u8[64,65536], /*index=2*/f32[8]) {
  %arg_tuple.1 = (s32[], u8[64,65536]{1,0}, f32[8]{0}) parameter(0)
  %gte.1 = u8[64,65536]{1,0} get-tuple-element(%arg_tuple.1), index=1
  %copy.2 = u8[64,65536]{1,0} copy(%gte.1), metadata={op_name="jit(f)/while/body/dynamic_update_slice"}
  %copy.3 = s32[] copy(%gte.1)
}

ENTRY %main.9 (Arg_0.1: f32[4], /*index=1*/Arg_1.2: u8[64,65536]) -> f32[4] {
  %Arg_1.2 = u8[64,65536]{1,0} parameter(1)
  %copy-start.4 = (u8[64,65536]{1,0}, u8[64,65536]{1,0}, u32[]) copy-start(%Arg_1.2)
  %copy.5 = f32[1024,1024]{0,1} copy(%Arg_0.1)
}
"""


def test_copies_attributed_to_their_computation():
  found = copies(HLO, min_bytes=1 << 20)
  # The fused copy (2 KiB, a layout change inside a fusion) and the scalar are
  # not memcpys worth listing; the while body's 4 MiB copy and the entry's are.
  got = [(c["name"], c["kind"], c["computation"], c["bytes"]) for c in found]
  assert got == [("copy.2", "copy", "wide.region_0.7", 64 * 65536),
                 ("copy-start.4", "copy-start", "main.9", 64 * 65536),
                 ("copy.5", "copy", "main.9", 1024 * 1024 * 4)], got
  assert found[0]["op_name"] == "jit(f)/while/body/dynamic_update_slice"


def test_fused_copies_skipped_and_threshold():
  assert all(not c["computation"].startswith("fused") for c in copies(HLO, min_bytes=0))
  names = [c["name"] for c in copies(HLO, min_bytes=0)]
  assert names == ["copy.2", "copy.3", "copy-start.4", "copy.5"], names
