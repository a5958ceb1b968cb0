"""The package DAG: policy never imports torch; kernels/comm/runtime never import vLLM;
kernels imports no sibling. Checked in a fresh interpreter per package."""

import subprocess
import sys

import pytest

FORBIDDEN = {
    "glm5_policy": ["torch", "vllm", "glm5_kernels", "glm5_comm", "glm5_runtime"],
    "glm5_kernels": ["vllm", "glm5_policy", "glm5_comm", "glm5_runtime"],
    "glm5_comm": ["vllm", "glm5_policy", "glm5_runtime"],
    "glm5_runtime": ["vllm"],
}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_stay_inside_the_dag(package):
    code = (
        f"import sys, importlib, pkgutil; import {package} as p\n"
        "for m in pkgutil.walk_packages(p.__path__, p.__name__ + '.'):\n"
        "    importlib.import_module(m.name)\n"
        f"print(' '.join(sorted(n for n in {FORBIDDEN[package]!r} if n in sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"{package} imports {out.stdout.strip()}"


def test_versions_and_exact_sibling_pins():
    from pathlib import Path

    import tomllib

    root = Path(__file__).resolve().parents[2] / "packages"
    versions = {}
    for project in sorted(root.iterdir()):
        init = project / "src" / project.name.replace("-", "_") / "__init__.py"
        versions[project.name] = next(
            line.split('"')[1]
            for line in init.read_text().splitlines()
            if line.startswith("__version__")
        )
        assert (init.parent / "py.typed").exists()
    for project in root.iterdir():
        meta = tomllib.loads((project / "pyproject.toml").read_text())["project"]
        for dep in meta["dependencies"]:
            name = dep.split("==")[0].split(">")[0].strip()
            if name in versions:
                assert dep == f"{name}=={versions[name]}", (project.name, dep)
