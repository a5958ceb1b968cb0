"""The CuTe DSL kernels compile for SM90 (Hopper) and SM100 (Blackwell) on this CPU
(`CUTE_DSL_ARCH`: the DSL compiles without a GPU, it cannot run), in a child process per
architecture (cute_compile_cases.py; compile_children.py starts them in the background at
the end of collection, beside the Triton compile checks). The kept PTX of the mHC boundary
shows what the design relies on: the weights' loads issued before the PDL wait, the
cluster's partial sums stored into the peers' shared memory by st.async completing on an
mbarrier, no global atomics and no local memory; with comb deferred, the ready word polled
with acquire loads before the wait, cleared between the wait and the release of the
dependents, set with a release store after them."""

import os
import re
import shutil
import sys
import tempfile
from concurrent.futures import Future
from pathlib import Path

import compile_children
import pytest

pytest.importorskip("cutlass", reason="the CuTe DSL (glm5-kernels[cute]) is not installed")

_KEPT: dict[str, str] = {}  # by architecture: the child's working directory (its PTX)


def start(arch: str) -> Future:
    """The compile child of `arch` (compile_children: in the background from the end of
    collection), started now unless it already was."""
    env = {**os.environ, "CUTE_DSL_ARCH": arch, "CUTE_DSL_KEEP_PTX": "1"}
    if arch not in _KEPT:
        _KEPT[arch] = tempfile.mkdtemp(prefix=f"cute-{arch}-")
    script = Path(__file__).with_name("cute_compile_cases.py")
    return compile_children.start(("cute", arch), [sys.executable, str(script), arch], env,
                                  cwd=_KEPT[arch])  # fmt: skip


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_kernels_compile(arch):
    child = compile_children.result(start(arch))
    tmp_path = Path(_KEPT[arch])
    try:
        _check(arch, child, tmp_path)
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)


def _check(arch, child, tmp_path):
    assert child.returncode == 0, child.stderr[-4000:]
    compiled = re.search(rf"{arch}: compiled (\d+) CuTe mHC kernels", child.stdout)
    # 4 modes + the post's tb, deferred: 3 modes + the post's tb; two one-an-SM builds
    assert compiled and int(compiled.group(1)) >= 13, child.stdout
    assert len(list(tmp_path.glob("mhc-*-wide.ptx"))) == 2
    ptx = sorted(tmp_path.glob("mhc-*.ptx"))
    assert len(ptx) == int(compiled.group(1)), [p.name for p in ptx]
    for path in ptx:
        text = path.read_text()
        assert f".target {arch.removeprefix('sm_')}" in text or f".target {arch}" in text
        body = text[text.index("griddepcontrol.wait") :]
        before = text[: text.index("griddepcontrol.wait")]
        # fn (24 x 4 values a thread, where the kernel mixes) and the norm weight before the wait.
        weights = 1 if "-head" in path.stem else 24 * 4 + 1
        assert before.count("ld.global") >= weights, path.name
        assert "ld.global" in body, "the inputs are read after the wait"
        assert "barrier.cluster.arrive" in before and "barrier.cluster.wait" in body
        assert re.search(r"st\.async\.shared::cluster\.mbarrier::complete_tx::bytes", body)
        assert "mbarrier.try_wait" in body
        assert "atom.global" not in text and "red.global" not in text
        assert ".local" not in text, "a register array fell to local memory"
        # Two CTAs an SM (ptxas bounds the registers for them), one for the `-wide` builds,
        # and no IEEE division or square root on the Sinkhorn / norm chains (each
        # compiles to a slow-path branch the scheduler cannot interleave).
        assert f".minnctapersm {1 if '-wide' in path.stem else 2}" in text, path.name
        assert not re.search(r"\b(div|rcp|sqrt)\.rn\.f32", text), path.name
        # The ready words (module docstring of cute_mhc): polled (bounded: a trap) before
        # the wait where comb comes in deferred, cleared before the dependents' release and
        # set by a release store after the wait where it goes out so.
        pend_in, pend_out = "-in" in path.stem, "-out" in path.stem
        assert ("ld.acquire.gpu" in before and "trap;" in before) == pend_in, path.name
        assert "ld.acquire.gpu" not in body, path.name
        released = body[: body.index("griddepcontrol.launch_dependents")]
        assert ("st.relaxed.gpu" in released and "fence.acq_rel.gpu" in released) == pend_out
        assert ("st.release.gpu" in body[len(released) :]) == pend_out, path.name
