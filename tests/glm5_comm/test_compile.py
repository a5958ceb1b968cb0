"""glm5-comm's Triton kernels compile for SM90 (Hopper) and SM100 (Blackwell) on this CPU
with the launch options their ops use: the all-reduce at world sizes 2, 4 and 8 (the PTX
polls with volatile loads, hands the step on through an atomic and waits with PDL), the
all-reduce + norm at 1 (no exchange), 2 and 8, a row of 4096 a CTA without spills; the
MTP input (embedding all-reduce + enorm | hnorm) at 1 and 2; the logits gather at 2 and 8. Under
TRITON_INTERPRET=1 kernels cannot compile, so the cases run in a child without it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

CASES = """
import sys
sys.path.insert(0, {kernels_tests!r})
from compile_cases import _compile
from glm5_comm.triton_exchange import one_shot_all_reduce_kernel as kernel

arch = {arch}
types = {{"x_ptr": "*bf16", "out_ptr": "*bf16", "peers_ptr": "*i64", "state_ptr": "*i32"}}
types |= {{n: "i32" for n in ("M", "D", "stride_x", "stride_out", "slot_elems", "rank")}}
n = 0
for world, bm in ((2, 1), (4, 16), (8, 8)):
    consts = {{"WORLD": world, "BM": bm, "BD": 512, "INTERPRETER": False, "PDL": True}}
    ptx = _compile(kernel, types, consts, arch, num_warps=4)
    for needed in ("ld.volatile", "atom", "cas.b32", "griddepcontrol.wait"):
        assert needed in ptx, (world, needed)
    n += 1
from glm5_comm.triton_exchange import all_reduce_norm_kernel as norm
types = {{n: "*bf16" for n in ("x_ptr", "res_ptr", "res_out_ptr", "normed_ptr", "w_ptr")}}
types |= {{"peers_ptr": "*i64", "state_ptr": "*i32", "eps": "fp32"}}
types |= {{n: "i32" for n in ("M", "D", "stride_x", "stride_res", "stride_res_out",
                              "stride_normed", "slot_elems", "rank")}}
for world in (1, 2, 8):
    consts = {{"WORLD": world, "BD": 4096, "INTERPRETER": False, "PDL": True}}
    ptx = _compile(norm, types, consts, arch, num_warps=8)
    assert "griddepcontrol.wait" in ptx and "st.local" not in ptx, world
    assert ("ld.volatile" in ptx) == (world > 1), world
    n += 1
from glm5_comm.triton_exchange import embed_norm_kernel as embed
types = {{n: "*bf16" for n in ("x_ptr", "hidden_ptr", "out_ptr", "ew_ptr", "hw_ptr")}}
types |= {{"pos_ptr": "*i64", "peers_ptr": "*i64", "state_ptr": "*i32", "eps": "fp32"}}
types |= {{n: "i32" for n in ("M", "D", "stride_x", "stride_h", "stride_out", "slot_elems",
                              "rank")}}
for world in (1, 2):
    consts = {{"WORLD": world, "BD": 4096, "INTERPRETER": False, "PDL": True}}
    ptx = _compile(embed, types, consts, arch, num_warps=8)
    assert "griddepcontrol.wait" in ptx and "st.local" not in ptx, world
    n += 1

from glm5_comm.triton_exchange import logits_gather_kernel as gather
types = {{"x_ptr": "*fp32", "out_ptr": "*fp32", "peers_ptr": "*i64", "state_ptr": "*i32"}}
types |= {{n: "i32" for n in ("M", "S", "stride_x", "stride_out", "slot_elems", "rank")}}
for world in (2, 8):
    consts = {{"WORLD": world, "BM": 16, "BS": 1024, "PDL": True}}
    ptx = _compile(gather, types, consts, arch, num_warps=4)
    for needed in ("ld.volatile", "atom", "cas.b32", "griddepcontrol.wait"):
        assert needed in ptx, (world, needed)
    n += 1
print(f"sm{{arch}}: compiled {{n}} exchange kernels")
"""


@pytest.mark.parametrize("arch", [90, 100], ids=["sm90", "sm100"])
def test_exchange_compiles(arch):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    kernels_tests = str(Path(__file__).parents[1] / "glm5_kernels")
    code = CASES.format(kernels_tests=kernels_tests, arch=arch)
    child = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert child.returncode == 0, child.stderr[-4000:]
    assert f"sm{arch}: compiled 10 exchange kernels" in child.stdout
