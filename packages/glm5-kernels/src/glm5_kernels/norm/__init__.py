"""RMSNorm."""

from glm5_kernels.norm.reference import rms_norm_ref

__all__ = ["rms_norm_ref"]
