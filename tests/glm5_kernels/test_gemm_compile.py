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


@pytest.mark.parametrize("triton", ["venv", "gpu-host"])
@pytest.mark.parametrize("arch", [90, 100], ids=["sm90", "sm100"])
def test_kernels_compile(arch, triton):
    """With this venv's Triton, and with the GPU host's (`nox -s tests` installs it beside the
    venv and names it in GLM5_GPU_HOST_TRITON)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if triton == "gpu-host":
        where = os.environ.get("GLM5_GPU_HOST_TRITON")
        if not where:
            pytest.skip("GLM5_GPU_HOST_TRITON unset: run through `nox -s tests`")
        env["PYTHONPATH"] = os.pathsep.join([where, *filter(None, [env.get("PYTHONPATH")])])
    script = Path(__file__).with_name("compile_cases.py")
    child = subprocess.run(
        [sys.executable, str(script), str(arch)], env=env, capture_output=True, text=True
    )
    assert child.returncode == 0, child.stderr[-4000:]
    if triton == "gpu-host":  # the child really compiled with the GPU host's Triton
        assert f"triton {os.environ['GLM5_GPU_HOST_TRITON']}" in child.stdout
    assert f"sm{arch}: compiled 9 kernels" in child.stdout
    moe = re.search(rf"sm{arch}: compiled (\d+) MoE kernels", child.stdout)
    assert moe and int(moe.group(1)) >= 9, child.stdout  # route, gate_up, down: 3+ tiles each
    assert f"sm{arch}: compiled 12 mHC kernels" in child.stdout
    assert f"sm{arch}: compiled 7 KDA kernels" in child.stdout
    assert f"sm{arch}: compiled 8 DSA kernels" in child.stdout
