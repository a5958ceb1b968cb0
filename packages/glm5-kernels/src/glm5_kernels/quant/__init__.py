"""FP8 E4M3 block (128x128) quantization."""

from glm5_kernels.quant.reference import dequantize_fp8_block_ref, quantize_fp8_block_ref

__all__ = ["dequantize_fp8_block_ref", "quantize_fp8_block_ref"]
