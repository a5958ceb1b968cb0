"""KDA: forget gate, short conv, delta-rule recurrence, gated output norm; and the decode
step they make (`kda_decode_ref`; `KdaDecode`, one kernel)."""

from glm5_kernels.kda.decode import KdaDecode
from glm5_kernels.kda.reference import (
    gated_rms_norm_ref,
    kda_decode_ref,
    kda_gate_ref,
    kda_recurrence_ref,
    short_conv_ref,
)

__all__ = [
    "KdaDecode",
    "gated_rms_norm_ref",
    "kda_decode_ref",
    "kda_gate_ref",
    "kda_recurrence_ref",
    "short_conv_ref",
]
