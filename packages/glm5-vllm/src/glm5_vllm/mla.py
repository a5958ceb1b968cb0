"""vLLM's MLA layers as the MLA sublayer stage reads them (seam 5): the stage's constants
(`mla_constants`: `Backbone.mla`), each layer's caches and the step's neutral placement
(`mla_placement`) from vLLM's metadata.

vLLM's decode of a GLM-5.3-Flash MLA layer (`MultiHeadLatentAttentionWrapper`) projects
q_a | kv_a in one GEMM, norms both, writes the normed kv_a into the latent cache at the
forward context's slot mapping, projects q_b, runs the indexer (which writes its pools and
ring and fills the model-wide top-k buffer), absorbs the query with W_UK_T, asks its sparse
backend for the attention over the selection and applies W_UV, then o_proj. The runtime's
stage runs all of it from the module's weights, on the module's caches, at this placement;
vLLM's module runs where a step is not a decode of one length per request (a prefill, a
mixed batch, padded requests the indexer's metadata marks), or the layout is not the
stage's (an FP8 latent cache, context-parallel decode, a hierarchical sparse cache, an
output gate). Where vLLM skips the layer's indexer (`set_skip_topk`: its MTP drafter's steps
after the first reuse step 0's selection, compacted in the model-wide top-k buffer), the
placement carries those rows and the stage attends them without its indexer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from glm5_runtime.protocol import Mla, MlaPlacement

__all__ = ["mla_constants", "mla_placement"]


def mla_constants(layers: list[nn.Module]) -> Mla | None:
    """The stage's constants where every MLA layer (`Glm5NextMLAAttention`) is vLLM's NoPE
    sparse MLA with a q LoRA (fused q_a | kv_a), a BF16 latent cache, no context-parallel
    decode, one nope / value split, softmax scale and norm eps, BF16 norm weights; None
    otherwise (then MLA stays vLLM's)."""
    if not layers or any(not _sparse_nope(m) for m in layers):
        return None
    found = {(m.qk_nope_head_dim, m.v_head_dim, float(m.mla_attn.mla_attn.impl.scale),
              float(m.q_a_layernorm.variance_epsilon)) for m in layers}  # fmt: skip
    if len(found) != 1:
        return None
    nope, v_dim, scale, eps = found.pop()
    return Mla(nope, v_dim, scale, norm_eps=eps)


def _sparse_nope(m: nn.Module) -> bool:
    core = getattr(getattr(m, "mla_attn", None), "mla_attn", None)
    impl = getattr(core, "impl", None)
    norms = [getattr(m, n, None) for n in ("q_a_layernorm", "kv_a_layernorm")]
    return (
        impl is not None
        and getattr(impl, "is_sparse", False)
        and getattr(impl, "dcp_world_size", 1) == 1
        and getattr(m, "qk_rope_head_dim", None) == 0
        and getattr(m, "fused_qkv_a_proj", None) is not None
        and getattr(m.mla_attn, "g_proj", None) is None  # no output gate
        and not getattr(m.mla_attn, "dcp_q_replicate", False)
        and getattr(core, "kv_cache_dtype", "auto") == "auto"
        and getattr(core, "hisparse_cache", None) is None
        and all(n is not None and n.weight.dtype == torch.bfloat16 for n in norms)
        and norms[0].variance_epsilon == norms[1].variance_epsilon
    )


def mla_placement(md: Any, index_md: Any, tail_md: Any, slot_mapping: Tensor | None,
                  positions: Tensor, ring: int) -> MlaPlacement | None:  # fmt: skip
    """An MLA layer's sparse-MLA metadata `md`, its indexer's pool metadata `index_md` and
    ring metadata `tail_md`, the latent slot mapping of the forward context and the step's
    positions as the stage's placement (`ring`: the ring's tokens a row), for a step whose
    rows are all decodes of one length (a plain decode or a uniform verify, no padded
    requests); None for anything else. Tensor ops only (no host sync: capturable)."""
    decode = getattr(index_md, "decode", None)
    if md is None or tail_md is None or decode is None or slot_mapping is None:
        return None
    if not all(hasattr(md, a) for a in ("block_table", "req_id_per_token", "num_prefills")):
        return None
    r, n = md.num_decodes, md.num_decode_tokens
    if md.num_prefills or index_md.num_prefills or r <= 0 or n % r or positions.shape[0] < n:
        return None
    if decode.requires_padding or not decode.decode_is_uniform:
        return None
    t = n // r
    slots = tail_md.slot_mapping[:n].view(r, t)[:, 0]  # a request's ring row: slot // ring
    tail_rows = torch.where(slots >= 0, slots.div(ring, rounding_mode="floor"), -1)
    return MlaPlacement(
        slot_mapping[:n].long(), md.block_table[:r], md.req_id_per_token[:n],
        positions[:n].view(r, t), decode.block_table[:r], tail_rows,
    )  # fmt: skip
