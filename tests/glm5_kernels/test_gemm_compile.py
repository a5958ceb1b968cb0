"""The skinny-GEMM, MoE, mHC boundary, KDA decode and sparse MLA Triton kernels compile for
SM90 (Hopper) and SM100 (Blackwell) on this CPU with the launch options the ops use
(compile_cases.py): catches a kernel only the interpreter accepts, and on SM90 checks the PTX
has wgmma, pipelined cp.async weight loads and PDL; on both, that no kernel issues a
pipelined load before its PDL wait, and none designed to read nothing there (only L2
prefetches of its weights) has a global load before it (the pitfall of loads hoisted above
the wait: stale reads of the previous kernel's output).
Under TRITON_INTERPRET=1 kernels cannot compile, so the cases run in a child without it."""

import os
import re
import sys
from concurrent.futures import Future
from pathlib import Path

import compile_children
import pytest

pytest.importorskip("triton")


def start(arch: int, triton: str) -> Future | None:
    """The compile child of (arch, triton) (compile_children: in the background from the
    end of collection), started now unless it already was; None where the GPU host's
    Triton is not named (the test skips)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if triton == "gpu-host":
        where = os.environ.get("GLM5_GPU_HOST_TRITON")
        if not where:
            return None
        env["PYTHONPATH"] = os.pathsep.join([where, *filter(None, [env.get("PYTHONPATH")])])
    command = [sys.executable, str(Path(__file__).with_name("compile_cases.py")), str(arch)]
    return compile_children.start(("triton", arch, triton), command, env)


@pytest.mark.parametrize("triton", ["venv", "gpu-host"])
@pytest.mark.parametrize("arch", [90, 100], ids=["sm90", "sm100"])
def test_kernels_compile(arch, triton):
    """With this venv's Triton, and with the GPU host's (`nox -s tests` installs it beside the
    venv and names it in GLM5_GPU_HOST_TRITON)."""
    child = start(arch, triton)
    if child is None:
        pytest.skip("GLM5_GPU_HOST_TRITON unset: run through `nox -s tests`")
    child = compile_children.result(child)
    assert child.returncode == 0, child.stderr[-4000:]
    if triton == "gpu-host":  # the child really compiled with the GPU host's Triton
        assert f"triton {os.environ['GLM5_GPU_HOST_TRITON']}" in child.stdout
    assert f"sm{arch}: compiled 9 kernels" in child.stdout
    moe = re.search(rf"sm{arch}: compiled (\d+) MoE kernels", child.stdout)
    assert moe and int(moe.group(1)) >= 9, child.stdout  # route, gate_up, down: 3+ tiles each
    assert f"sm{arch}: compiled 12 mHC kernels" in child.stdout
    assert f"sm{arch}: compiled 16 KDA kernels" in child.stdout
    assert f"sm{arch}: compiled 8 DSA kernels" in child.stdout
    assert f"sm{arch}: compiled 1 embedding kernel" in child.stdout
