"""glm5-comm: the NVLink one-shot all-reduce on torch symmetric memory, fused with the mHC
boundary, residual + RMSNorm and the embedding; the logits all-gather. Each has a
torch.distributed reference and a world-size-1 path."""

__version__ = "0.1.0"
