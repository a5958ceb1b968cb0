"""The indexer's pool-write and selection stages inside vLLM's GLM-5.3-Flash indexer (seam 5):
the stages' constants from the indexers (`indexer_constants`: `Backbone.indexer`) and the
forward the routes `layers.{i}.self_attn.indexer.kpool` / `.topk` install together, with
`.inputs` where the pool write takes the projection's sums (`install_indexer`).

vLLM's indexer projects the query (wq_b), the key and the head weights (wk | weights_proj),
normalizes the key, rotates + quantizes the query, then runs one custom op that writes the
tail ring and completed pools and selects (DeepGEMM scores, a top-k kernel, the pools
expanded to tokens) into the model-wide top-k buffer. Routed, on a step whose rows are all
decodes of one length (a plain decode or a uniform verify) and whose pages have the op's
blocks, the same projections feed `KpoolWrite` (ring, pools into vLLM's pages, the queries
rotated and cast) and `IndexerTopk` (scores and top-k), which writes the buffer's rows as
vLLM's op does (top-k + kpool - 1 columns, -1 past them). With `.inputs`, one FP32
projection over [wk; compress gate; weights_proj] replaces vLLM's three (wk | weights_proj,
its FP32 copy of weights_proj, the gate) and `KpoolWrite` norms the key from its sums
(vLLM's FP32 key norm and BF16 roundings, inside the write). The layouts are vLLM's own
(tests/glm5_vllm/test_vllm_indexer_kernels.py checks them against vLLM's kernels).

Placement from vLLM's metadata: the pool pages' block table is the indexer metadata's decode
block table; a request's ring row is its tail-cache slot // ring (the tail metadata holds
slots, not a block table), -1 for padding and dummy requests, which then write nothing; the
head weights are hidden . weights_proj in FP32 before vLLM folds the query scales into them
(`IndexerTopk` folds its own). The placement is the step's (`VllmStep`, which the backbone
hands the indexer while the layer's attention runs), derived once for every indexer of the
step. Any other step runs vLLM's forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from glm5_runtime.protocol import Indexer

__all__ = ["indexer_constants", "install_indexer"]


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


def install_indexer(module: nn.Module, ops: dict[str, Any], kind: str, op: Any | None,
                    step: Callable[[], Any]) -> None:  # fmt: skip
    """Set (op) or clear (None) one of the indexer's stage ops in `ops` (the ops the backbone
    holds for this indexer: "kpool" KpoolWrite, "topk" IndexerTopk, "inputs" Projection
    where the pool write takes its sums); its forward runs the stages while the pool write
    and the selection are set (and the input projection, where the write norms the key from
    its sums), at the placement of `step()` (the `VllmStep` whose attention runs now, None
    outside one: vLLM's forward), and vLLM's own forward otherwise."""
    if op is None:
        ops.pop(kind, None)
    else:
        ops[kind] = op
    kpool, inputs = ops.get("kpool"), ops.get("inputs")
    if kpool is not None and "topk" in ops and (kpool.key_norm is None) == (inputs is None):
        module.forward = _forward(module, kpool, ops["topk"], inputs, step)
    else:
        module.__dict__.pop("forward", None)


@dataclass
class _Placement:
    """A uniform decode step in the stages' terms: R requests x T tokens."""

    block_table: Tensor  # [R, B] the pool pages' blocks
    positions: Tensor  # [R, T]
    tail_rows: Tensor  # [R] each request's ring row, -1: padding
    request: Tensor  # [R * T] each row's request


def _forward(module: nn.Module, kpool: Any, topk: Any, inputs: Any | None, step):
    stock = type(module).forward.__get__(module)
    h, hd, width = module.n_head, module.head_dim, topk.width

    def forward(hidden_states: Tensor, qr: Tensor, positions: Tensor, rotary_emb=None):
        place = _placement(module, step(), positions, kpool, topk, inputs)
        if place is None:
            return stock(hidden_states, qr, positions, rotary_emb)
        r, t = place.positions.shape
        n = r * t
        x = hidden_states[:n]
        q = module.wq_b(qr[:n])[0].view(r, t, h, hd)
        if inputs is not None:  # [n, hd | hd | h] FP32 sums: the write norms and rounds
            sums = inputs(x)
            k, gate = (sums[:, i * hd : (i + 1) * hd].view(r, t, hd) for i in (0, 1))
            weights = sums[:, 2 * hd :]
        else:
            k, gate, weights = _stock_inputs(module, x, r, t)
        q8, q_scale = kpool(k, gate, q, module.tail_cache.kv_cache, module.k_cache.kv_cache,
                            place.block_table, place.positions, place.tail_rows)  # fmt: skip
        buffer = module.topk_indices_buffer
        topk(q8.view(n, h, hd), q_scale.view(n, h), weights, module.k_cache.kv_cache,
             place.block_table, place.request, place.positions.view(n),
             out=buffer[:n, :width])  # fmt: skip
        return buffer

    return forward


def _stock_inputs(module: nn.Module, x: Tensor, r: int, t: int):
    """vLLM's key (normed), gate score and FP32 head weights of rows x, as its forward has
    them (its compiled key norm's FP32 LayerNorm)."""
    hd = module.head_dim
    kw = module.wk_weights_proj(x)[0]
    norm = module.k_norm  # vLLM's key norm: FP32 LayerNorm, back to the input dtype
    k = F.layer_norm(kw[:, :hd].float(), (hd,), norm.weight, norm.bias, norm.eps)
    k = k.to(kw.dtype).view(r, t, hd)
    if module._wp_fp32 is None:  # as vLLM caches it: weights_proj's rows, FP32
        module._wp_fp32 = module.wk_weights_proj.weight.data[hd:].t().contiguous().float()
    weights = torch.mm(x.float(), module._wp_fp32)
    gate = F.linear(x, module.index_kpool_compress_gate).view(r, t, hd)
    return k, gate, weights


def _placement(module: nn.Module, step: Any, positions: Tensor, kpool: Any, topk: Any,
               inputs: Any):  # fmt: skip
    """The placement of `step` (a `VllmStep`; None: none) for this indexer: None unless every
    row is a decode of one length, the ops serve its rows and the pages have the op's
    blocks. Derived once a step: the step's indexers share their metadata."""
    if step is None:
        return None
    md = step.metadata.get(module.k_cache.prefix)
    tail_md = step.metadata.get(module.tail_cache.prefix)
    decode = getattr(md, "decode", None)
    if md is None or tail_md is None or decode is None or md.num_prefills != 0:
        return None
    r, n = md.num_decodes, md.num_decode_tokens
    if r <= 0 or n % r or decode.requires_padding or not decode.decode_is_uniform:
        return None
    pages, tail = module.k_cache.kv_cache, module.tail_cache.kv_cache
    if pages.shape[1] * module.index_kpool != kpool.block_size or tail.dim() != 4:
        return None  # the op was built for other blocks
    served = kpool.supports(n) and topk.supports(n) and (inputs is None or inputs.supports(n))
    if not served or positions.shape[0] < n:
        return None
    buffer = module.topk_indices_buffer  # model-wide: its columns past the selection's

    def place():
        buffer[:n, topk.width :] = -1  # -1 once a step (vLLM's own backend reads whole rows)
        return _place(decode, tail_md, positions, r, n // r, tail.shape[2])

    return step.once(f"indexer ring {tail.shape[2]}", (md, tail_md, positions), place)


def _place(decode: Any, tail_md: Any, positions: Tensor, r: int, t: int, ring: int):
    n = r * t
    slots = tail_md.slot_mapping[:n].view(r, t)[:, 0]
    tail_rows = torch.where(slots >= 0, slots.div(ring, rounding_mode="floor"), -1)
    request = torch.arange(r, device=positions.device).repeat_interleave(t)
    return _Placement(decode.block_table[:r], positions[:n].view(r, t), tail_rows, request)
