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
import subprocess
import sys
import threading
from concurrent.futures import Future
from pathlib import Path

import pytest

pytest.importorskip("triton")


# The compiles themselves run in child processes started in the background as soon as the
# session has collected these tests (tests/conftest.py), one at a time on the core the
# single-threaded suite leaves idle, two at a time once the suite reaches these tests (run
# last) and waits: from an empty Triton cache the four children take 2-4 minutes each on a
# 2-core machine, with it warm seconds (a clean clone's suite: 19.4 minutes with them one at
# a time). Daemon threads: a session stopped early does not wait for them.
_CORES = threading.Semaphore(1)  # the suite's idle core; the suite's own joins when it waits
_JOINED = threading.Event()
_CHILDREN: dict[tuple[int, str], Future] = {}


def _run(command: list[str], env: dict, done: Future) -> None:
    with _CORES:
        try:
            done.set_result(subprocess.run(command, env=env, capture_output=True, text=True))
        except Exception as error:  # the test reports it
            done.set_exception(error)


def start(arch: int, triton: str) -> Future | None:
    """The compile child of (arch, triton), started now unless it already was; None where
    the GPU host's Triton is not named (the test skips)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if triton == "gpu-host":
        where = os.environ.get("GLM5_GPU_HOST_TRITON")
        if not where:
            return None
        env["PYTHONPATH"] = os.pathsep.join([where, *filter(None, [env.get("PYTHONPATH")])])
    if (arch, triton) not in _CHILDREN:
        command = [sys.executable, str(Path(__file__).with_name("compile_cases.py")), str(arch)]
        done = _CHILDREN[arch, triton] = Future()
        threading.Thread(target=_run, args=(command, env, done), daemon=True).start()
    return _CHILDREN[arch, triton]


@pytest.mark.parametrize("triton", ["venv", "gpu-host"])
@pytest.mark.parametrize("arch", [90, 100], ids=["sm90", "sm100"])
def test_kernels_compile(arch, triton):
    """With this venv's Triton, and with the GPU host's (`nox -s tests` installs it beside the
    venv and names it in GLM5_GPU_HOST_TRITON)."""
    child = start(arch, triton)
    if child is None:
        pytest.skip("GLM5_GPU_HOST_TRITON unset: run through `nox -s tests`")
    if not _JOINED.is_set():  # the suite waits from here on: its core compiles too
        _JOINED.set()
        _CORES.release()
    child = child.result()
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
