"""The skinny-GEMM, MoE, mHC boundary, KDA decode and sparse MLA Triton kernels compile for
SM90 (Hopper) and SM100 (Blackwell) on this CPU with the launch options the ops use
(compile_cases.py): catches a kernel only the interpreter accepts, and on SM90 checks the PTX
has wgmma, pipelined cp.async weight loads and PDL.
Under TRITON_INTERPRET=1 kernels cannot compile, so the cases run in a child without it."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


@pytest.mark.parametrize("arch", [90, 100], ids=["sm90", "sm100"])
def test_kernels_compile(arch):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("compile_cases.py")
    child = subprocess.run(
        [sys.executable, str(script), str(arch)], env=env, capture_output=True, text=True
    )
    assert child.returncode == 0, child.stderr[-4000:]
    assert f"sm{arch}: compiled 9 kernels" in child.stdout
    moe = re.search(rf"sm{arch}: compiled (\d+) MoE kernels", child.stdout)
    assert moe and int(moe.group(1)) >= 9, child.stdout  # route, gate_up, down: 3+ tiles each
    assert f"sm{arch}: compiled 11 mHC kernels" in child.stdout
    assert f"sm{arch}: compiled 5 KDA kernels" in child.stdout
    assert f"sm{arch}: compiled 5 DSA kernels" in child.stdout
