"""The Triton interpreter (TRITON_INTERPRET=1, the CPU suite) without its per-call re-patching.

Triton 3.9's interpreter patches `triton.language` for the interpreter when a launch starts
(`GridExecutor.__call__`, restored at its end) and *again* at every device-function call
inside the kernel (`InterpretedFunction.__call__`), a walk over the language's members by
`inspect.getmembers` that is never undone and changes nothing where the launch patched the
same modules: 40,561 such walks in one planned-step test (cProfile). `install()` skips a
device function's patch when the launch in progress has patched every language module its
globals name (`tl.zeros`'s module names `triton.language.core`, which a kernel naming only
`triton.language` leaves unpatched: that call still patches); outside a launch, Triton's own
path. The kernels run exactly as before: the same rewritten functions on the same patched
language. Measured on this 2-core machine: a planned-step test 97 -> 84 s, test_gemm.py
30 -> 25 s."""

import os

_PINNED = "3.9.0"  # the version whose internals this reads (constraints/tests.txt)


def install() -> bool:
    """Apply under TRITON_INTERPRET=1 and the pinned Triton; True if applied."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import triton
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    if triton.__version__ != _PINNED or getattr(interpreter, "_glm5_patched", None) is not None:
        return False
    launch, call = interpreter.GridExecutor.__call__, interpreter.InterpretedFunction.__call__
    # Per launch in progress: the language modules patched for it. `_patch_lang` patches the
    # modules a function's globals name (`triton.language`, `triton.language.core`): a kernel
    # naming only the first calls `tl.zeros`, whose module names the second.
    patched: list[set] = []
    named: dict = {}  # by function: the language modules its globals name

    def langs(fn) -> set:
        if fn not in named:
            named[fn] = {id(m) for m in fn.__globals__.values() if m is tl or m is tl.core}
        return named[fn]

    def launch_once(self, *args, **kwargs):
        patched.append(langs(self.fn))
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.pop()

    def device_call(self, *args, **kwargs):
        needs = langs(self.fn)
        if not patched or not needs <= patched[-1]:
            if patched:
                patched[-1] |= needs
            return call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # as Triton's own path reports it
            raise interpreter.InterpreterError(repr(e)) from e

    interpreter.GridExecutor.__call__ = launch_once
    interpreter.InterpretedFunction.__call__ = device_call
    interpreter._glm5_patched = patched
    return True
