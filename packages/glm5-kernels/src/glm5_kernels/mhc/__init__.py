"""mHC: hyper-connection stream mixing (pre / post / boundary / head / expand): the references
and `MhcBoundary`, each boundary as one kernel."""

from glm5_kernels.mhc.boundary import MhcBoundary, MhcConfig, PendingComb
from glm5_kernels.mhc.reference import (
    hc_expand_ref,
    hc_fused_post_pre_ref,
    hc_head_ref,
    hc_mix_ref,
    hc_post_ref,
    hc_pre_ref,
)

__all__ = [
    "MhcBoundary",
    "MhcConfig",
    "PendingComb",
    "hc_expand_ref",
    "hc_fused_post_pre_ref",
    "hc_head_ref",
    "hc_mix_ref",
    "hc_post_ref",
    "hc_pre_ref",
]
