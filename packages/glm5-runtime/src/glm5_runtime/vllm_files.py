"""The vllm==0.33.0 wheel's source files that the vLLM-kernel stock (`glm5_runtime.vllm_stock`)
and `benchmarks/kda_decode.py` run, as one folder carried to a GPU host without vLLM (vLLM
0.33 needs torch 2.14; the host has 2.11), read by path: glm5-runtime never imports vllm.

The folder mirrors the package (`<folder>/model_executor/layers/fused_moe/fused_moe.py`, ...)
beside a manifest, `vllm_files.json`: the vLLM version the files came from and each file's
sha256, checked before anything loads, so a result names exactly which kernels it timed.

    python benchmarks/vllm_files.py vllm-files     # where vllm==0.33.0 is installed

`load` runs named top-level definitions of one file (kernels, their launch code, the
constants they read) in a namespace the caller fills in place of the file's imports: the
files import vLLM's platform, environment, logger and compiled ops at the top, which a host
without vLLM has not. Only the definitions asked for run, so a file's other imports never
matter, and the Triton kernels keep their file and line numbers (Triton reads a kernel's
source back from them). No torch here: the CLI checks a folder before it imports torch."""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import importlib.util
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

__all__ = ["FILES", "MANIFEST", "VLLM_VERSION", "copy_files", "load", "manifest", "problems"]

VLLM_VERSION = "0.33.0"
MANIFEST = "vllm_files.json"
# Paths inside the vllm package by what of each runs.
FILES = {
    # fused_moe_kernel, its launch, the default tiles, the naive / aligned block assignment
    "fused_moe": "model_executor/layers/fused_moe/fused_moe.py",
    # moe_align_block_size's wrapper (its sort is a C++ op: written in torch by the stock)
    "moe_align": "model_executor/layers/fused_moe/moe_align_block_size.py",
    # the swap-AB rule, the clamped SwiGLU kernel, the tensor-descriptor switch
    "moe_utils": "model_executor/layers/fused_moe/utils.py",
    # per-token-group FP8 quantization (its Triton path)
    "fp8": "model_executor/layers/quantization/utils/fp8_utils.py",
    # KDA's short conv (causal_conv1d_update)
    "conv": "model_executor/layers/mamba/ops/causal_conv1d.py",
    # GLM-5's KDA recurrence kernel, and its launch (fused_recurrent_kda)
    "glm5_recurrent": "models/glm5next/nvidia/ops/third_party/kda/fused_recurrent.py",
    "glm5_kda": "models/glm5next/nvidia/ops/third_party/kda/kernels.py",
    # the gated RMSNorm after the recurrence (rms_norm_gated)
    "gated_norm": "third_party/flash_linear_attention/ops/kda.py",
    # Kimi's KDA decode kernels: benchmarks/kda_decode.py's stock
    "kimi_kda": "models/kimi_k3/nvidia/ops/third_party/kda/fused_recurrent.py",
    # mHC: the pre gate from the mix GEMM (mhc_pre_mix_triton), the stream collapse
    "mhc": "model_executor/kernels/mhc/triton.py",
}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def installed_vllm() -> tuple[Path, str]:
    """The installed vllm package's folder and version, found without importing it."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("vllm is not installed here: pip install vllm==0.33.0")
    return Path(next(iter(spec.submodule_search_locations))), importlib.metadata.version("vllm")


def copy_files(dest: str | Path) -> dict:
    """Copy FILES out of the installed vllm into `dest` with the manifest; -> the manifest.
    Refuses any vLLM but VLLM_VERSION."""
    src, version = installed_vllm()
    if version != VLLM_VERSION:
        raise ValueError(f"vllm {version} is installed; the stock runs vLLM {VLLM_VERSION}'s files")
    dest = Path(dest)
    files = {}
    for path in FILES.values():
        (dest / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src / path, dest / path)
        files[path] = _sha256(dest / path)
    result = {"vllm": version, "files": files}
    (dest / MANIFEST).write_text(json.dumps(result, indent=1) + "\n")
    return result


def problems(folder: str | Path) -> list[str]:
    """Why `folder` is not a folder of vLLM VLLM_VERSION's files (empty when it is)."""
    folder = Path(folder)
    if not folder.is_dir():
        return [f"no folder {str(folder)!r}"]
    try:
        held = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return [f"{str(folder)!r} has no {MANIFEST} (benchmarks/vllm_files.py makes the folder)"]
    if held.get("vllm") != VLLM_VERSION:
        return [f"{str(folder)!r} holds vLLM {held.get('vllm')}'s files, not {VLLM_VERSION}'s"]
    out = []
    for path in FILES.values():
        file = folder / path
        if not file.is_file():
            out.append(f"{path}: missing")
        elif _sha256(file) != held.get("files", {}).get(path):
            out.append(f"{path}: not the file the manifest names (edited?)")
    return out


def manifest(folder: str | Path) -> dict:
    """The folder's manifest, after checking it (ValueError naming every problem)."""
    found = problems(folder)
    if found:
        raise ValueError(f"{str(folder)!r}: " + "; ".join(found))
    return json.loads((Path(folder) / MANIFEST).read_text())


def _defined(node: ast.stmt) -> list[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []


def load(folder: str | Path, file: str, names: list[str], scope: dict) -> SimpleNamespace:
    """The top-level definitions `names` of FILES[file] in `folder` (each with every statement
    that binds it: a function's `@overload`s too), run in file order in a namespace holding
    `scope` in place of the file's imports -> a namespace of them."""
    path = FILES[file]
    file = Path(folder) / path
    tree = ast.parse(file.read_text(), filename=str(file))
    binds: dict[str, list[ast.stmt]] = {}
    for node in tree.body:
        for name in _defined(node):
            binds.setdefault(name, []).append(node)
    missing = [n for n in names if n not in binds]
    if missing:
        raise ValueError(f"{path}: no top-level {', '.join(missing)} (not vLLM {VLLM_VERSION}'s?)")
    picked = {id(node): node for n in names for node in binds[n]}
    body = sorted(picked.values(), key=lambda node: node.lineno)
    namespace = {"__name__": "vllm_files." + path.removesuffix(".py").replace("/", "."),
                 "__file__": str(file), **scope}  # fmt: skip
    exec(compile(ast.Module(body=body, type_ignores=[]), str(file), "exec"), namespace)
    return SimpleNamespace(**{n: namespace[n] for n in names})
