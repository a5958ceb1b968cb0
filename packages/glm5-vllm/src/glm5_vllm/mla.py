"""The sparse MLA stage inside vLLM's MLA layer (seam 5): the stage's constants from the
layers (`mla_constants`: `Backbone.mla`) and the hooks the route `layers.{i}.self_attn.
dsa_attn` installs on the layer's `MLAAttention` (`install_sparse_mla`).

vLLM's decode of an MLA layer absorbs the query (q_nope . W_UK_T, [N, H, 512]), asks its
sparse backend's `forward_mqa` for the attention over the indexer's selection, then applies
W_UV in `_v_up_proj`. The route keeps everything before: projections, norms, the indexer
(which fills the model-wide top-k buffer with request-relative token positions) and the
latent cache write. On a step whose rows are all decodes (verify rows included) its
`forward_mqa` defers; its `_v_up_proj` then runs the stage op — attention and value-up in
one — on the absorbed query, the layer's latent cache [blocks, block_size, 512], the
metadata's block table and each row's request, and the top-k buffer's rows, writing where
vLLM's value-up would. Any other step (a prefill, an FP8 cache or query, context parallel
decode, more rows than the op was built for) runs vLLM's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from glm5_runtime.protocol import Mla

__all__ = ["install_sparse_mla", "mla_constants", "uninstall_sparse_mla"]


def mla_constants(layers: list[nn.Module]) -> Mla | None:
    """The sparse MLA stage's constants where every MLA layer is vLLM's NoPE sparse MLA
    (`MLAAttention` over a sparse backend with the model-wide top-k buffer, no context
    parallel decode) with one nope / value split and softmax scale; None otherwise (then
    MLA stays vLLM's)."""
    if not layers or any(not _sparse_nope(m) for m in layers):
        return None
    found = {(m.qk_nope_head_dim, m.v_head_dim, float(m.impl.scale)) for m in layers}
    if len(found) != 1:
        return None
    return Mla(*found.pop())


def _sparse_nope(m: nn.Module) -> bool:
    impl = getattr(m, "impl", None)
    return (
        impl is not None
        and getattr(impl, "is_sparse", False)
        and getattr(impl, "topk_indices_buffer", None) is not None
        and getattr(impl, "dcp_world_size", 1) == 1
        and getattr(m, "qk_rope_head_dim", None) == 0
        and hasattr(m, "_v_up_proj")
    )


@dataclass
class _Deferred:
    """What `forward_mqa` hands `_v_up_proj` on a routed step: the absorbed query, the
    latent cache and the step's metadata."""

    q_lat: Tensor
    cache: Tensor
    metadata: Any


def install_sparse_mla(layer: nn.Module, op: Any, width: int | None = None) -> None:
    """Route `layer` (an `MLAAttention`)'s decode attention and value-up through `op`
    (`glm5_kernels.dsa.SparseMlaDecode`'s call: q_lat, cache, block_table, request, indices,
    out). `width`: the top-k buffer's columns the indexer writes (top-k + the tail's kpool
    - 1; vLLM pads its rows to 2176 with -1, which the op need not walk); None: all."""
    impl = layer.impl
    stock_mqa = type(impl).forward_mqa.__get__(impl)
    stock_up = type(layer)._v_up_proj.__get__(layer)
    heads, v_dim = layer.num_heads, layer.v_head_dim

    def forward_mqa(q, kv_cache, metadata, attn_layer):
        if _covered(q, kv_cache, metadata, op):
            return _Deferred(q[0], kv_cache, metadata), None
        return stock_mqa(q, kv_cache, metadata, attn_layer)

    def v_up_proj(x, out: Tensor) -> None:
        if not isinstance(x, _Deferred):
            return stock_up(x, out)
        n, md = x.q_lat.shape[0], x.metadata
        indices = impl.topk_indices_buffer[:n, :width]
        op(x.q_lat, x.cache, md.block_table, md.req_id_per_token[:n], indices,
           out=out.view(n, heads, v_dim))  # fmt: skip
        return None

    impl.forward_mqa = forward_mqa
    layer._v_up_proj = v_up_proj


def uninstall_sparse_mla(layer: nn.Module) -> None:
    """vLLM's own decode attention and value-up again."""
    layer.impl.__dict__.pop("forward_mqa", None)
    layer.__dict__.pop("_v_up_proj", None)


def _covered(q, kv_cache: Tensor, md: Any, op: Any) -> bool:
    """Whether the stage runs this step: the BF16 NoPE query as vLLM's (absorbed, rope
    part empty) pair, a BF16 latent cache, and sparse metadata whose every row is a decode
    (a plain decode or a uniform verify), no more rows than the op was built for."""
    if not isinstance(q, tuple) or q[1].shape[-1] != 0 or q[0].dtype != torch.bfloat16:
        return False
    if kv_cache.dtype != torch.bfloat16 or kv_cache.dim() != 3:
        return False
    if kv_cache.shape[1] != getattr(md, "block_size", kv_cache.shape[1]):
        return False  # the block table's blocks are not the cache tensor's
    if not all(hasattr(md, a) for a in ("block_table", "req_id_per_token", "num_prefills")):
        return False
    n = q[0].shape[0]
    return md.num_prefills == 0 and md.num_decode_tokens == n and op.supports(n)
