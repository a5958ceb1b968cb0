"""Sessions: tests (CPU), demo, vllm_tests, lint; gpu_tests and bench (GPU hosts, off by
default).

`nox` alone runs lint and the CPU tests, as CI does."""

from __future__ import annotations

import shutil
import subprocess

import nox

nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = True

# In dependency order: pip resolves the exact sibling pins from these paths.
PACKAGES = ["glm5-policy", "glm5-kernels", "glm5-comm", "glm5-runtime"]
CPU_TORCH = "torch==2.13.0"
CPU_PINS = ["-c", "constraints/tests.txt"]  # what torch, transformers and the runners leave open
# The CuTe DSL compiles its kernels for SM90 and SM100 on a CPU (it cannot run them there):
# the tests compile every CuTe kernel for both.
TEST_DEPS = ["pytest>=8", "hypothesis>=6.100", "transformers==5.17.0", "triton==3.9.0",
             "nvidia-cutlass-dsl[cu13]==4.8.1"]  # fmt: skip
# The GPU host's Triton: the compile check runs under it too (a kernel Triton 3.9 accepted
# once failed to compile there). Installed beside the venv, put first on the compile child's
# path only.
GPU_HOST_TRITON = "triton==3.6.0"


def _install(session: nox.Session, *packages: str) -> None:
    for package in packages:
        session.install("-e", f"packages/{package}")


@nox.session(python="3.11")
def tests(session: nox.Session) -> None:
    """CPU suite: everything not marked gpu, multi_gpu or vllm."""
    session.install(*CPU_PINS, CPU_TORCH, *TEST_DEPS)
    _install(session, *PACKAGES)
    gpu_host = f"{session.virtualenv.location}/gpu-host-triton"
    session.install("--no-deps", "--upgrade", "--target", gpu_host, GPU_HOST_TRITON)
    session.run(
        "pytest",
        "-m",
        "not gpu and not multi_gpu and not vllm",
        *session.posargs,
        env={"TRITON_INTERPRET": "1", "GLM5_GPU_HOST_TRITON": gpu_host},
    )


@nox.session(python="3.11")
def vllm_tests(session: nox.Session) -> None:
    """The plugin against the real vllm==0.33.0 (a CUDA build of torch: a large venv)."""
    # vLLM pins torch but leaves transformers, Triton and the rest open: the constraints
    # file (a pip freeze of this venv; its header says how to regenerate it) pins them all.
    # One pip run: the editable siblings resolve from their paths, under the same pins.
    editable = [arg for p in (*PACKAGES, "glm5-vllm") for arg in ("-e", f"packages/{p}")]
    pins = ["-c", "constraints/vllm.txt"]
    session.install(*pins, "vllm==0.33.0", "pytest>=8", "hypothesis>=6.100", *editable)
    # The adapter's tests run glm5-kernels' Triton stage ops over vLLM's CPU modules.
    env = {"TRITON_INTERPRET": "1"}
    session.run("pytest", "-m", "vllm", "tests/glm5_vllm", *session.posargs, env=env)


@nox.session(venv_backend="none", default=False)
def gpu_tests(session: nox.Session) -> None:
    """GPU suite on the machine's own CUDA torch (GPU hosts have no package index).
    `nox -s gpu_tests -- quick`: the quick selection (tests/conftest.py QUICK), for every
    change that touches a kernel; the full suite for a stage's own issue. The multi_gpu tests
    run where the host has 2+ GPUs. Other arguments go to pytest."""
    if shutil.which("nvidia-smi") is None:
        session.skip("no NVIDIA GPU on this machine")
    listed = session.run("nvidia-smi", "-L", silent=True, external=True) or ""
    gpus = sum(line.startswith("GPU ") for line in listed.splitlines())
    args = list(session.posargs)
    quick = args[:1] == ["quick"]
    markers = "gpu or multi_gpu" if gpus >= 2 else "gpu"
    if gpus < 2:
        session.log(
            f"{gpus} GPU on this host: the multi_gpu tests (NVLink exchanges and TP ranks "
            "across GPUs) need 2+ GPUs of one host and are left out"
        )
    if quick:  # each test's time printed: the selection has a wall-time budget (README)
        args, markers = ["--durations=0", *args[1:]], f"({markers}) and quick"
        # On a fresh host the selection is Triton's compiles (H200: 334 s cold in one process,
        # 38 s warm): eight processes compile side by side, sharing Triton's on-disk cache.
        xdist = subprocess.run(["python", "-c", "import xdist"], capture_output=True)
        if xdist.returncode == 0:
            args = ["-n", "8", "--dist", "load", *args]
        else:
            session.log("pytest-xdist is not installed: the quick selection runs in one process")
    paths = ":".join(f"packages/{p}/src" for p in PACKAGES)
    session.run("python", "-m", "pytest", "-m", markers, *args, env={"PYTHONPATH": paths})


@nox.session(python="3.11")
def demo(session: nox.Session) -> None:
    """The main job: the reference backbone serving prompts with MTP drafting (CPU, tiny);
    pass options after --, e.g. `nox -s demo -- --device cuda --geometry flash-tp4-rank`
    (`-- --compare`: the specialized decode beside it, its Triton kernels interpreted)."""
    session.install(*CPU_PINS, CPU_TORCH, "triton==3.9.0")
    _install(session, *PACKAGES)
    session.run("glm5-decode", "demo", *session.posargs)


@nox.session(venv_backend="none", default=False)
def bench(session: nox.Session) -> None:
    """GPU benchmarks on the machine's own CUDA torch; results land in benchmarks/results/.
    `nox -s bench -- skinny_gemm` runs one of them (skinny_gemm, decode;
    default: all)."""
    if shutil.which("nvidia-smi") is None:
        session.skip("no NVIDIA GPU on this machine")
    env = {"PYTHONPATH": ":".join(f"packages/{p}/src" for p in PACKAGES)}
    results = "benchmarks/results"
    for name in session.posargs or ["skinny_gemm", "decode"]:
        if name != "decode":
            out = f"{results}/{name}_h200.json"
            session.run("python", f"benchmarks/{name}.py", "--out", out, env=env)
            continue
        for tp in (4, 8):  # stock vs specialized decode steps, one rank's weights
            out = f"{results}/decode_h200_tp{tp}.json"
            cli = ["python", "-m", "glm5_runtime.cli", "bench", "--out", out]
            session.run(*cli, "--geometry", f"flash-tp{tp}-rank", "--iters", "10", env=env)


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    session.install("ruff==0.17.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
