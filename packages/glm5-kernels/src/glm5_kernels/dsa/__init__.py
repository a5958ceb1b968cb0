"""DSA indexer ops: k-pool compression, Hadamard + FP8 keys and queries, pool logits."""

from glm5_kernels.dsa.reference import (
    index_logits_fp8_ref,
    kpool_compress_ref,
    pack_kpool_pages_ref,
    rotate_quant_fp8_ref,
    unpack_kpool_pages_ref,
)

__all__ = [
    "index_logits_fp8_ref",
    "kpool_compress_ref",
    "pack_kpool_pages_ref",
    "rotate_quant_fp8_ref",
    "unpack_kpool_pages_ref",
]
