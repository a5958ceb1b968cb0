"""The quick GPU selection (tests/conftest.py QUICK, `nox -s gpu_tests -- quick`) checked on
the CPU by collection: each entry names exactly one collected test (a renamed test or
parameter would drop it silently), and every kernel's GPU test file is in it."""

import importlib.util
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parents[1]
ROOT = TESTS.parent
# tests/conftest.py by its path: `import conftest` would find whichever folder's comes first.
_spec = importlib.util.spec_from_file_location("tests_conftest", TESTS / "conftest.py")
_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_conftest)
QUICK, quick_key = _conftest.QUICK, _conftest.quick_key


def _collected(marker: str) -> list[str]:
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "-m", marker, "tests/glm5_kernels", "tests/glm5_runtime", "tests/glm5_comm"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return [line for line in run.stdout.splitlines() if "::" in line]


def _key(node: str):
    path, _, name = node.partition("::")
    test, _, params = name.partition("[")
    return quick_key(Path(path).relative_to("tests").as_posix(), test, params.rstrip("]"))


def test_every_entry_names_one_collected_test_and_every_kernel_is_in():
    nodes = _collected("quick")
    keys = [_key(n) for n in nodes]
    for entry in QUICK:
        assert keys.count(quick_key(*entry)) == 1, (entry, nodes)
    assert len(nodes) == len(QUICK)
    kernels = {p.relative_to(TESTS).as_posix() for p in (TESTS / "glm5_kernels").glob("*_gpu.py")}
    assert kernels <= {file for file, _, _ in QUICK}, kernels - {f for f, _, _ in QUICK}
    # The whole step, with every stage on, at one q (three of its capture sizes).
    assert [k for k in keys if k[0] == "glm5_runtime/test_decode_gpu.py"] == [
        ("glm5_runtime/test_decode_gpu.py", "test_three_capture_sizes_with_draft_equal_stock", ())
    ]
    # All of it GPU tests (their files' `pytestmark`): no CPU test that -m quick drags in.
    assert all(file.endswith("_gpu.py") for file, _, _ in QUICK)
