"""The compile checks' children (test_gemm_compile.py: Triton, test_cute_compile.py: the CuTe
DSL), started in the background as soon as the session has collected those tests
(tests/conftest.py), one at a time on the core the single-threaded suite leaves idle, two at a
time once the suite reaches them (run last) and waits: from an empty Triton cache the four
Triton children take 2-4 minutes each on a 2-core machine, the two CuTe ones ~30 s, with the
cache warm seconds (a clean clone's suite: 19.4 minutes with the Triton ones one at a time in
the background; the CuTe ones in the foreground then added a minute). Daemon threads: a
session stopped early does not wait for them."""

import subprocess
import threading
from concurrent.futures import Future

_CORES = threading.Semaphore(1)  # the suite's idle core; the suite's own joins when it waits
_JOINED = threading.Event()
_CHILDREN: dict[tuple, Future] = {}


def _run(command: list[str], env: dict, cwd: str | None, done: Future) -> None:
    with _CORES:
        try:
            result = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True)
            done.set_result(result)
        except Exception as error:  # the test reports it
            done.set_exception(error)


def start(key: tuple, command: list[str], env: dict, cwd: str | None = None) -> Future:
    """The child `key` (running `command`), started now unless it already was."""
    if key not in _CHILDREN:
        done = _CHILDREN[key] = Future()
        threading.Thread(target=_run, args=(command, env, cwd, done), daemon=True).start()
    return _CHILDREN[key]


def result(child: Future) -> subprocess.CompletedProcess:
    """The child's outcome, once it is done; from the first call on, the suite's own core
    compiles too (it only waits from here)."""
    if not _JOINED.is_set():
        _JOINED.set()
        _CORES.release()
    return child.result()
