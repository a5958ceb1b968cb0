"""Host-side launch helpers every op family shares: whether a CUDA-graph capture is under way,
whether the Triton interpreter runs, whether to use programmatic dependent launch, the GPU's
SM count, and the power-of-two sizes Triton's block shapes need.

They live here, owned by no op, because every folder (and glm5-comm's collectives) asks the
same questions the same way: one answer per question keeps a capture that must never compile,
the interpreter's CPU fallbacks and the GLM5_PDL switch consistent across all the kernels of
a step. Torch only; nothing here imports Triton.
"""

from __future__ import annotations

import os

import torch

__all__ = ["capturing", "first_call", "interpreting", "next_pow2", "sm_count", "use_pdl"]


def interpreting() -> bool:
    """Whether Triton runs its CPU interpreter (TRITON_INTERPRET=1): the kernels then take
    their INTERPRETER paths and may read CPU tensors."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def use_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch: SM90 and newer, not under the interpreter, and not
    with GLM5_PDL=0 in the environment."""
    if os.environ.get("GLM5_PDL", "1") == "0":
        return False
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def sm_count(device: torch.device) -> int:
    """The device's SMs, which the launch plans fill; 16 under the interpreter, so small test
    shapes still split their work."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 16


def capturing() -> bool:
    """Whether the current stream is capturing a CUDA graph (then nothing may compile, and
    no host sync may check an input)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def first_call(op, m: int) -> None:
    """Record in `op._ready` that `op` has run (so compiled) for M tokens; a first call inside
    CUDA-graph capture is refused, since it would compile there."""
    if m not in op._ready:
        if capturing():
            raise RuntimeError(
                f"{type(op).__name__}: M={m} was not prepared; call prepare() before "
                "CUDA-graph capture (a capture must never compile)"
            )
        op._ready.add(m)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): Triton's block shapes and
    tl.arange extents must be powers of two."""
    return 1 << max(0, n - 1).bit_length()
