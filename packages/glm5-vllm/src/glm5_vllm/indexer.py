"""vLLM's GLM-5.3-Flash indexers as the MLA sublayer stage reads them (seam 5): the pool
write's and selection's constants (`indexer_constants`: `Backbone.indexer`).

vLLM's indexer projects the query (wq_b), the key and the head weights (wk | weights_proj),
normalizes the key, rotates + quantizes the query, then runs one custom op that writes the
tail ring and completed pools and selects (DeepGEMM scores, a top-k kernel, the pools
expanded to tokens) into the model-wide top-k buffer. The stage runs the same from the
module's weights on its caches (glm5_vllm.mla: their placement): one FP32 projection over
[wk; compress gate; weights_proj] (vLLM's wk | weights_proj, its FP32 copy of weights_proj,
the gate), `KpoolWrite` (the key norm and BF16 roundings, ring, pools into vLLM's pages, the
queries rotated and cast) and `IndexerTopk` (scores and top-k), handing the selection to the
attention as a value. The layouts are vLLM's own (tests/glm5_vllm/test_vllm_indexer_kernels.py
checks them against vLLM's kernels).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from glm5_runtime.protocol import Indexer

__all__ = ["indexer_constants"]


def indexer_constants(indexers: list[nn.Module]) -> Indexer | None:
    """The stages' constants where every MLA layer's indexer is vLLM's kpool indexer (pools
    of more than one token, no rope part, the model-wide top-k buffer) with one shape and
    bound caches whose pages hold whole pools; None otherwise (the indexer stays vLLM's)."""
    if not indexers or any(not _kpool_indexer(m) for m in indexers):
        return None
    found = {(m.n_head, m.head_dim, m.index_kpool, m.topk_tokens, m.max_pool_len,
              _pages(m).shape[1] * m.index_kpool) for m in indexers}  # fmt: skip
    if len(found) != 1:
        return None
    heads, head_dim, kpool, topk, pools, block_size = found.pop()
    # The one input projection where every indexer holds wk | weights_proj as vLLM's merged
    # BF16 linear (its rows: the key's, then the heads') and a BF16 gate, one key-norm eps.
    eps = {m.k_norm.eps for m in indexers if _projects_inputs(m)}
    one = len(eps) == 1 and all(_projects_inputs(m) for m in indexers)
    return Indexer(heads, head_dim, kpool, topk, True, pools, block_size,
                   key_norm_eps=eps.pop() if one else None)  # fmt: skip


def _projects_inputs(m: nn.Module) -> bool:
    wk = m.wk_weights_proj
    gate = m.index_kpool_compress_gate
    return (
        list(getattr(wk, "output_partition_sizes", ())) == [m.head_dim, m.n_head]
        and getattr(wk, "weight", None) is not None and wk.weight.dtype == torch.bfloat16
        and gate.dtype == torch.bfloat16 and isinstance(getattr(m.k_norm, "eps", None), float)
    )  # fmt: skip


def _kpool_indexer(m: nn.Module) -> bool:
    needed = ("wq_b", "wk_weights_proj", "k_norm", "index_kpool_compress_gate", "k_cache",
              "tail_cache", "n_head", "head_dim", "index_kpool", "topk_tokens")  # fmt: skip
    if m is None or not all(hasattr(m, n) for n in needed):
        return False
    return (
        m.index_kpool > 1
        and getattr(m, "rope_dim", 0) == 0
        and getattr(m, "topk_indices_buffer", None) is not None
        and isinstance(_pages(m), Tensor)
        and isinstance(getattr(m.tail_cache, "kv_cache", None), Tensor)
    )


def _pages(m: nn.Module) -> Tensor | None:
    pages = getattr(m.k_cache, "kv_cache", None)
    return pages if isinstance(pages, Tensor) and pages.dim() == 3 else None
