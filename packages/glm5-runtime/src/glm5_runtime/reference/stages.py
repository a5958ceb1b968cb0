"""The stock stages of one TP rank, written plainly: each returns the rank's TP-partial
output (the sum over ranks is the layer's output; `reduce` is that sum).

Tensors: x [R, T, D] BF16 (R requests, T new tokens each); `Placement` says where the tokens
sit in the caches. Math follows transformers' Glm5Next (the oracle) with glm5-kernels'
torch references as the one spec per op; matmuls of BF16 weights run in BF16 as
`nn.Linear` does, mixing and recurrences in FP32."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

from glm5_kernels.dsa import (
    index_logits_fp8_ref,
    kpool_write_ref,
    pool_sources_ref,
    select_tokens_ref,
)
from glm5_kernels.gemm import quantize_tokens_fp8_ref, swiglu_ref
from glm5_kernels.kda import kda_decode_ref, kda_recurrence_ref
from glm5_kernels.moe import experts_ref, route_ref
from glm5_kernels.norm import rms_norm_ref
from glm5_kernels.quant import dequantize_fp8_block_ref

from .caches import RankCaches
from .config import Geometry

KEY_EPS = 1e-6  # the indexer's key LayerNorm (transformers' and vLLM's)

# HF projections that vLLM runs as one GEMM over one fused weight, rows in this order (its
# `fused_qkv_a_proj` and `in_proj_qkvbfg_a`). A routed op over the fused weight (`fuse`)
# serves every part in one launch, as vLLM's module does.
FUSED_PARTS = {
    "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),
    "in_proj_qkvbfg_a": ("q_proj", "k_proj", "v_proj", "b_proj", "forget_gate.f_a_proj",
                         "g_a_proj"),
}  # fmt: skip


@dataclass
class Placement:
    """Where a uniform step's tokens go in the caches (the reference backbone's `placement`;
    `glm5_runtime.plan.Step` is the planned step's shape). positions/slots [R, T] int64
    (slot = flat paged cache index); block_table [R, blocks] int64. KDA, as vLLM's spec
    decode keeps it:
    read_slots [R]: the recurrent state each request starts from; write_slots [R, T]: where
    the state after each token goes (-1: not stored; a decode writes in place, a verify keeps
    every token's, so accepting n resumes from write_slots[:, n - 1]); conv_slots [R]: the
    request's conv state row, whose W-1 window starts at column conv_offset [R] (n - 1
    after accepting n). tail_rows [R]: each request's indexer ring. row_request [R * T]: each
    token row's request (derived, once per step: the MLA sublayer's placement reads it)."""

    positions: Tensor
    slots: Tensor
    block_table: Tensor
    read_slots: Tensor
    write_slots: Tensor
    conv_slots: Tensor
    conv_offset: Tensor
    tail_rows: Tensor
    block_size: int
    keep_states: bool = False
    row_request: Tensor = field(init=False)

    def __post_init__(self) -> None:
        requests, tokens = self.positions.shape
        rows = torch.arange(requests, device=self.positions.device)
        self.row_request = rows.repeat_interleave(tokens)


class RankStages:
    """One rank's weights and caches, and the stock stages over them.

    `routes` (name -> op with `supports(m)`): ops that stand in for a stock linear (by its
    weight's name), a SwiGLU MLP (by its prefix) or a router (by its gate weight) when they
    support the row count; the specialized decode installs them for its planned steps.
    `fp8_activations`: FP8 linears quantize their activations per token in 1x128 groups
    first, as vLLM's block-FP8 linears do (transformers' BF16 oracle does not)."""

    def __init__(
        self,
        g: Geometry,
        rank: int,
        weights: dict[str, Tensor],
        caches: RankCaches,
        fp8_activations: bool = False,
        ue8m0: bool = False,
    ):
        self.g, self.rank, self.w, self.c = g, rank, weights, caches
        self.fp8_activations, self.ue8m0 = fp8_activations, ue8m0
        self.routes: dict[str, object] = {}

    def _routed(self, name: str, x: Tensor) -> Tensor | None:
        """The routed op's output for x [..., K], None when no route takes these rows."""
        op = self.routes.get(name)
        rows = x.numel() // x.shape[-1]
        if op is None or x.dtype != torch.bfloat16 or not op.supports(rows):
            return None
        y = op(x.reshape(rows, x.shape[-1]).contiguous())
        return y.view(*x.shape[:-1], y.shape[-1])

    def fuse(self, prefix: str, fused: str) -> Tensor | None:
        """The fused weight `{prefix}.{fused}.weight` (FUSED_PARTS): its parts' BF16 rows in
        one tensor, the parts re-pointed to views of it (no second copy of any weight). None
        where a part is missing or not BF16."""
        name = f"{prefix}.{fused}.weight"
        if name not in self.w:
            parts = [f"{prefix}.{p}.weight" for p in FUSED_PARTS[fused]]
            ws = [self.w.get(p) for p in parts]
            if any(w is None or w.dtype != torch.bfloat16 for w in ws):
                return None
            self.w[name] = torch.cat(ws)
            for p, view in zip(parts, self.w[name].split([w.shape[0] for w in ws]), strict=True):
                self.w[p] = view
        return self.w[name]

    def _parts(self, x: Tensor, prefix: str, fused: str) -> tuple[Tensor | None, list[Tensor]]:
        """(the fused output or None, each part's output): one routed op over the fused
        weight where one takes x, else a linear per part."""
        names = [f"{prefix}.{p}.weight" for p in FUSED_PARTS[fused]]
        whole = self._routed(f"{prefix}.{fused}.weight", x)
        if whole is None:
            return None, [self.linear(x, n) for n in names]
        return whole, list(whole.split([self.w[n].shape[0] for n in names], dim=-1))

    def linear(self, x: Tensor, name: str) -> Tensor:
        routed = self._routed(name, x)
        if routed is not None:
            return routed
        w = self.w[name]
        if w.dtype != torch.float8_e4m3fn:
            return F.linear(x, w)
        scale = self.w[name + "_scale_inv"]
        if not self.fp8_activations:
            return F.linear(x, dequantize_fp8_block_ref(w, scale, dtype=x.dtype))
        rows = x.reshape(-1, x.shape[-1])
        q, sx = quantize_tokens_fp8_ref(rows, self.ue8m0)
        xd = (q.float().view(rows.shape[0], -1, 128) * sx[..., None]).view(rows.shape)
        y = F.linear(xd, dequantize_fp8_block_ref(w, scale))  # FP32, like the block-FP8 GEMM
        return y.to(x.dtype).view(*x.shape[:-1], -1)

    # Embedding and head: vocab-parallel rows.
    def embed(self, ids: Tensor) -> Tensor:
        table = self.w["embed_tokens.weight"]
        rows = table.shape[0]
        local = ids - self.rank * rows
        inside = (local >= 0) & (local < rows)
        out = table[local.clamp(0, rows - 1)]
        return out * inside[..., None].to(out.dtype)

    def head(self, x: Tensor) -> Tensor:
        """Logits of this rank's vocab slice [N, V / tp] FP32."""
        return F.linear(x, self.w["lm_head.weight"]).float()

    # KDA linear attention.
    def kda(self, layer: int, x: Tensor, step: Placement) -> Tensor:
        g, a = self.g, f"layers.{layer}.self_attn"
        T = x.shape[1]
        whole, (q, k, v, b, f_a, g_a) = self._parts(x, a, "in_proj_qkvbfg_a")
        width = q.shape[-1] + k.shape[-1] + v.shape[-1]
        # q | k | v: the fused output's first columns (a view), or the parts concatenated.
        mixed = whole[..., :width] if whole is not None else torch.cat([q, k, v], dim=-1)
        conv, rec = self.c.conv[layer], self.c.recurrent[layer]
        place = dict(
            conv_slots=step.conv_slots, conv_offset=step.conv_offset,
            read_slots=step.read_slots, write_slots=step.write_slots,
            keep=step.keep_states and T > 1,
        )  # fmt: skip
        f = self.linear(f_a, f"{a}.forget_gate.f_b_proj.weight")
        gate_o = self.linear(g_a, f"{a}.g_b_proj.weight")
        o = kda_decode_ref(
            mixed, f, b, gate_o, conv, rec, self.w[f"{a}.conv1d.weight"][:, 0],
            self.w[f"{a}.forget_gate.dt_bias"], self.w[f"{a}.forget_gate.A_log"],
            self.w[f"{a}.o_norm.weight"], **place, lower_bound=g.linear_lower_bound,
            eps=g.rms_norm_eps, recurrence=self.recurrence,
        )  # fmt: skip
        return self.linear(o, f"{a}.o_proj.weight")

    def recurrence(self, q, k, v, gate, beta, state, *, all_states: bool):
        """KDA's delta rule over a sequence of stacked heads: `kda_recurrence_ref`'s contract."""
        return kda_recurrence_ref(q, k, v, gate, beta, state, all_states=all_states)

    # MLA (NoPE) with the DSA indexer.
    def mla(
        self, layer: int, x: Tensor, step: Placement, topk: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """Partial output and the token indices [R, T, index_topk + kpool - 1] it attended.
        `topk` given: attend those (a shared layer, or an MTP draft step reusing step 0's
        selection) without running the indexer or writing its caches."""
        g, a = self.g, f"layers.{layer}.self_attn"
        R, T, _ = x.shape
        eps = g.rms_norm_eps
        _, (q_a, kv_a) = self._parts(x, a, "fused_qkv_a_proj")
        heads = g.num_attention_heads // g.tp_size
        nope, vd, lora = g.qk_nope_head_dim, g.v_head_dim, g.kv_lora_rank
        latent = self.c.latent[layer].view(-1, lora)
        q_resid = rms_norm_ref(q_a, self.w[f"{a}.q_a_layernorm.weight"], eps)
        kv = rms_norm_ref(kv_a, self.w[f"{a}.kv_a_layernorm.weight"], eps)
        latent[step.slots.reshape(-1)] = kv.reshape(-1, lora).to(latent.dtype)
        q = self.linear(q_resid, f"{a}.q_b_proj.weight").reshape(R, T, heads, nope)
        if topk is None and f"{a}.indexer.wk.weight" in self.w:
            topk = self.indexer(layer, x, q_resid, step)
        if topk is None:
            raise ValueError(f"layers.{layer}: a shared indexer layer needs a full layer before it")
        # Absorbed MLA: q·(W_uk c) = (W_uk^T q)·c, and o = W_uv (p·c): exact, without
        # expanding every selected token to all heads.
        kv_b = self.w[f"{a}.kv_b_proj.weight"].reshape(heads, nope + vd, lora).float()
        w_uk, w_uv = kv_b[:, :nope], kv_b[:, nope:]
        q_lat = torch.einsum("rthn,hnl->rthl", q.float(), w_uk)
        valid = topk >= 0  # [R, T, W]
        idx = topk.clamp(min=0).long()  # the selection stage's are int32
        cached = latent[_slots(idx, step)].float()  # [R, T, W, lora]
        scores = (
            torch.einsum("rthl,rtwl->rthw", q_lat, cached) * (nope + g.qk_rope_head_dim) ** -0.5
        )
        scores = scores.masked_fill(~valid[:, :, None], float("-inf"))
        p = torch.softmax(scores, dim=-1)
        o = torch.einsum("rthw,rtwl->rthl", p, cached)
        o = torch.einsum("rthl,hvl->rthv", o, w_uv).to(x.dtype)
        return self.linear(o.reshape(R, T, heads * vd), f"{a}.o_proj.weight"), topk

    def indexer(self, layer: int, x: Tensor, q_resid: Tensor, step: Placement) -> Tensor:
        """Top-k pools (+ the always-selected incomplete tail) per query, as token indices.
        The pool cache's dtype picks the numerics: uint8 pages are vLLM's (FP32 key norm,
        Hadamard + FP8 pool keys and queries), BF16 keys are transformers'."""
        g, n = self.g, f"layers.{layer}.self_attn.indexer"
        R, T, _ = x.shape
        ih, hd, kp = g.index_n_heads, g.index_head_dim, g.index_kpool
        kpool = self.c.kpool[layer]
        vllm = kpool.dtype == torch.uint8
        q = self.linear(q_resid, f"{n}.wq_b.weight").reshape(R, T, ih, hd)
        k = self.linear(x, f"{n}.wk.weight")
        norm = (self.w[f"{n}.k_norm.weight"], self.w[f"{n}.k_norm.bias"])
        if vllm:  # vLLM's key norm runs in FP32
            k = F.layer_norm(k.float(), (hd,), norm[0].float(), norm[1].float(), KEY_EPS)
            k = k.to(x.dtype)
        else:
            k = F.layer_norm(k, (hd,), *norm, KEY_EPS)
        gate = F.linear(x, self.w[f"{n}.index_kpool_compress_gate"])
        # A token that completes a pool compresses it (kpool_ref: members from this step's
        # rows and the request's ring; tokens that complete nothing write to the null block,
        # where vLLM skips the write).
        # A draft step's positions are a column of its verify's (a row stride): the stages
        # read them as rows of T (a no-op copy everywhere else).
        tail, pos = self.c.tail[layer], step.positions.contiguous()
        ape = self.w[f"{n}.index_kpool_compress_ape"]
        tail_on = bool(g.index_kpool_always_select_tail and kp > 1)
        width = g.index_topk + (kp - 1 if tail_on else 0)
        if vllm:
            q8, q_scale = kpool_write_ref(k, gate, q, tail, kpool, ape, step.block_table, pos,
                                          step.tail_rows, step.block_size)  # fmt: skip
            weights = F.linear(x.float(), self.w[f"{n}.weights_proj.weight"].float())
            page_keys, page_scales = _pages(kpool)
            pool_keys = page_keys[step.block_table].reshape(R, -1, hd).view(torch.float8_e4m3fn)
            pool_scales = page_scales[step.block_table].reshape(R, -1)
            index_scores = index_logits_fp8_ref(
                q8, q_scale, weights, pool_keys[:, None], pool_scales[:, None]
            )
        else:  # transformers' numerics: BF16 pool keys, no rotation
            keys, scores = pool_sources_ref(k, gate, tail, pos, step.tail_rows, kp)
            done = (pos + 1) % kp == 0
            target = torch.where(done, _slots(pos // kp * kp, step) // kp, 0)  # block * S + pool
            logits = scores.float() + ape.float()
            pooled = (torch.softmax(logits, dim=2).to(keys.dtype) * keys).sum(2)  # [R, T, hd]
            kpool.view(-1, hd)[target] = pooled.to(kpool.dtype)
            pools = kpool[step.block_table].reshape(R, -1, hd)  # [R, P, hd]
            s = F.relu(torch.einsum("rtih,rph->rtip", q.float(), pools.float()) * hd**-0.5)
            weights = F.linear(x, self.w[f"{n}.weights_proj.weight"]).float() * ih**-0.5
            index_scores = torch.einsum("rti,rtip->rtp", weights, s)
        # Every pool of the request's blocks scored; those ending after the query are masked;
        # ties go to the earlier pool; the selection in pool order (select_tokens_ref).
        return select_tokens_ref(index_scores, pos, g.index_topk, kp, tail_on, width)

    # MLPs.
    def dense_mlp(self, layer: int, x: Tensor) -> Tensor:
        return self._swiglu_mlp(f"layers.{layer}.mlp", x)

    def _swiglu_mlp(self, prefix: str, x: Tensor) -> Tensor:
        routed = self._routed(prefix, x)
        if routed is not None:
            return routed
        gate_up = torch.cat(
            [
                self.linear(x, f"{prefix}.gate_proj.weight"),
                self.linear(x, f"{prefix}.up_proj.weight"),
            ],
            -1,
        )
        act = swiglu_ref(gate_up.float(), self.g.swiglu_limit).to(x.dtype)
        return self.linear(act, f"{prefix}.down_proj.weight")

    def moe(self, layer: int, x: Tensor) -> Tensor:
        g, m = self.g, f"layers.{layer}.mlp"
        routed = self._routed(m, x)  # the whole layer as one stage op (router to sum)
        if routed is not None:
            return routed
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, ids = route_ref(
            self.router(f"{m}.gate.weight", flat),
            self.w[f"{m}.gate.e_score_correction_bias"],
            g.num_experts_per_tok,
            g.routed_scaling_factor,
        )
        routed = self.experts(f"{m}.experts", flat, ids, weights)
        shared = self._swiglu_mlp(f"{m}.shared_experts", flat)
        return (routed.to(x.dtype) + shared).reshape(shape)

    def router(self, name: str, x: Tensor) -> Tensor:
        """x [N, D] BF16 -> FP32 router logits [N, E]."""
        logits = self._routed(name, x)
        return F.linear(x.float(), self.w[name].float()) if logits is None else logits

    def experts(self, prefix: str, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        """x [N, D] BF16, ids / weights [N, k] -> the routed experts' weighted sum [N, D] FP32.
        With fp8_activations, vLLM's block-FP8 numerics: each expert's input and SwiGLU
        quantized per token in 1x128 groups, FP32 products, the gate_up output in BF16."""
        w13, w2 = self.w[f"{prefix}.gate_up_proj"], self.w[f"{prefix}.down_proj"]
        s13, s2 = (self.w.get(f"{prefix}.{n}_proj_scale_inv") for n in ("gate_up", "down"))
        limit = self.g.swiglu_limit
        if not x.is_cuda and not self.fp8_activations:
            return experts_ref(x, w13, w2, ids, weights, limit, s13, s2)
        quant = partial(_fake_quant, ue8m0=self.ue8m0) if self.fp8_activations else None
        return stock_experts(x, w13, w2, ids, weights, limit, s13, s2, quant)


def stock_experts(x, w13, w2, ids, weights, limit, w13_scale, w2_scale, quant=None) -> Tensor:
    """`experts_ref`'s sum, capturable (no host sync, no routing-dependent shape): every
    expert once over all tokens where there are no more experts than routes, else each
    token's k experts gathered per route slot. `quant`: vLLM's FP8 activation numerics."""
    dense = w13.shape[0] <= ids.numel()
    experts = _experts_dense if dense else _experts_by_slot
    return experts(x, w13, w2, ids, weights, limit, w13_scale, w2_scale, quant)


def _fake_quant(x: Tensor, ue8m0: bool) -> Tensor:
    """x [N, K] -> FP32 values of its per-token 1x128 FP8 quantization."""
    q, sx = quantize_tokens_fp8_ref(x, ue8m0)
    return (q.float().view(x.shape[0], -1, 128) * sx[..., None]).view(x.shape)


def _expert(x, up, down, limit, quant):
    """One expert's SwiGLU MLP on rows x [N, D] (up [2I, D] / down [D, I], or one per row
    [N, 2I, D] / [N, D, I]): in x's dtype with weights dequantized to it (transformers'), or
    with `quant` vLLM's FP8 sequence in FP32 -> FP32 rows [N, D]."""

    def mm(w, v):
        return v @ w.T if w.dim() == 2 else torch.bmm(w, v[:, :, None]).squeeze(-1)

    if quant is None:
        h = swiglu_ref(mm(up, x).float(), limit).to(x.dtype)
        return mm(down, h).float()
    a = swiglu_ref(mm(up, quant(x)).to(x.dtype).float(), limit).to(x.dtype)
    return mm(down, quant(a))


def _experts_by_slot(x, w13, w2, ids, weights, limit, w13_scale, w2_scale, quant=None) -> Tensor:
    """`experts_ref` without host syncs or data-dependent shapes, so a CUDA graph can
    capture it: each of the k route slots gathers its experts' FP8 weights per token."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    dtype = x.dtype if quant is None else torch.float32
    for j in range(ids.shape[1]):
        e = ids[:, j]
        up = dequantize_fp8_block_ref(w13[e], w13_scale[e], dtype=dtype)  # [N, 2I, D]
        down = dequantize_fp8_block_ref(w2[e], w2_scale[e], dtype=dtype)  # [N, D, I]
        out += _expert(x, up, down, limit, quant) * weights[:, j : j + 1]
    return out


def _experts_dense(x, w13, w2, ids, weights, limit, w13_scale, w2_scale, quant=None) -> Tensor:
    """`_experts_by_slot`'s numbers with each expert's weights dequantized once and run on
    every token (weighted 0 where it is not routed): cheaper when there are fewer experts
    than (token, slot) pairs, as in the tests' 16-expert models."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    dtype = x.dtype if quant is None else torch.float32
    for e in range(w13.shape[0]):
        combine = (weights * (ids == e)).sum(-1, keepdim=True).float()  # [N, 1]
        up = dequantize_fp8_block_ref(w13[e], w13_scale[e], dtype=dtype)  # [2I, D]
        down = dequantize_fp8_block_ref(w2[e], w2_scale[e], dtype=dtype)  # [D, I]
        out += _expert(x, up, down, limit, quant) * combine
    return out


def _pages(kpool: Tensor) -> tuple[Tensor, Tensor]:
    """Views of a vLLM k-pool cache [blocks, S, hd + 4] uint8, whose block row holds S*hd
    FP8 key bytes then S FP32 scales: (keys [blocks, S, hd] uint8, scales [blocks, S])."""
    blocks, per_block, width = kpool.shape
    row = kpool.view(blocks, per_block * width)
    keys = row[:, : per_block * (width - 4)].view(blocks, per_block, width - 4)
    return keys, row[:, per_block * (width - 4) :].view(torch.float32)


def _slots(index: Tensor, step: Placement) -> Tensor:
    """Flat paged-cache slots of token positions `index` [R, ...] through the block table."""
    bs = step.block_size
    R = index.shape[0]
    flat = index.reshape(R, -1)
    blocks = step.block_table.gather(1, (flat // bs).clamp(max=step.block_table.shape[1] - 1))
    return (blocks * bs + flat % bs).reshape(index.shape)


def reduce(partials: list[Tensor]) -> Tensor:
    """The TP all-reduce of simulated ranks (FP32 sum, like a one-shot reduce). One rank's
    partial is its own sum: returned as it is (the FP32 round trip of BF16 values is exact,
    and cost a TP-4 rank's one-GPU step two copy kernels a sublayer, 0.3 ms of 5.2)."""
    if len(partials) == 1:
        return partials[0]
    out = partials[0].float()
    for p in partials[1:]:
        out = out + p.float()
    return out.to(partials[0].dtype)
