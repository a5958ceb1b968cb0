"""DSA ops: the indexer's k-pool compression, Hadamard + FP8 keys and queries, pool logits;
the MLA layer's input norms and latent write (`LatentWrite`), the indexer's pool write
(`KpoolWrite`) and pool selection (`IndexerTopk`) and the sparse MLA decode over the
selected tokens (`SparseMlaDecode`), Triton, each with its spec."""

from glm5_kernels.dsa.attention import SparseMlaDecode
from glm5_kernels.dsa.attention_ref import sparse_mla_decode_ref
from glm5_kernels.dsa.indexer import IndexerTopk
from glm5_kernels.dsa.indexer_ref import index_topk_ref, select_tokens_ref
from glm5_kernels.dsa.kpool import KpoolWrite
from glm5_kernels.dsa.kpool_ref import index_keys_ref, kpool_write_ref, pool_sources_ref
from glm5_kernels.dsa.latent import LatentWrite, latent_write_ref
from glm5_kernels.dsa.reference import (
    index_logits_fp8_ref,
    kpool_compress_ref,
    pack_kpool_pages_ref,
    rotate_quant_fp8_ref,
    unpack_kpool_pages_ref,
)

__all__ = [
    "IndexerTopk",
    "KpoolWrite",
    "LatentWrite",
    "SparseMlaDecode",
    "index_keys_ref",
    "index_logits_fp8_ref",
    "index_topk_ref",
    "kpool_compress_ref",
    "kpool_write_ref",
    "latent_write_ref",
    "pack_kpool_pages_ref",
    "pool_sources_ref",
    "rotate_quant_fp8_ref",
    "select_tokens_ref",
    "sparse_mla_decode_ref",
    "unpack_kpool_pages_ref",
]
