"""The MoE stage of decode: routing and the routed + shared experts of M <= 64 tokens in three
launches after the router GEMM (`MoeLayer`: four in all; three where the router GEMM runs in
the routing launch, `gate=`), reading each touched expert's FP8 weights once per group of
tokens.

Two ways to cut the work, the policy's `moe` choices:
  * `MegaExperts` (`per_route`): one group per touched expert holding all of its tokens, so
    every expert's weights are read exactly once per step;
  * `GroupedExperts` (`grouped`): groups of at most 16 tokens: smaller MMA tiles (more
    pipeline stages per SM) for the price of reading a hot expert's weights once per 16.
Both run the shared expert as one more expert of the same launches, and return the routes
unfinalized (`MoeRows`: what a fused boundary weights and sums), or finalized by the down
kernel's last CTA per column tile (`finalized`).

Numerics are vLLM's block-FP8 sequence per route (tokens quantized in 1x128 groups, the
gate_up output in BF16, clamped SwiGLU in FP32 stored in BF16, quantized again, FP32 down
rows), and the stock sum: BF16(Σ weight·row) + BF16(shared row).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import Tensor

from glm5_kernels.gemm import MAX_TOKENS, Router
from glm5_kernels.launch import capturing, first_call, interpreting, next_pow2, sm_count, use_pdl

__all__ = ["MAX_TOP_K", "GroupedExperts", "MegaExperts", "MoeLayer", "MoeRows"]

MAX_TOP_K = 16  # the routing kernel's compiled bound on routes per token
GROUP = 128
QUANT_GROUPS = 8  # 1x128 groups a routing program quantizes at a time


@dataclass(frozen=True)
class MoeRows:
    """The MoE output before the weighted sum, for a consumer that fuses it (a boundary).

    rows [M·k (+ M), D] FP32: with `shared`, rows 0..M-1 are the shared expert's output for
    tokens 0..M-1; then one unweighted row per (token, route), grouped by expert. route_row
    [M, k] int32: the row of each token's route j (-1: an id outside [0, E), which
    contributes nothing). weights [M, k] FP32: the route weights (renormalized, × routed
    scaling). ids [M, k] int32: the experts."""

    rows: Tensor
    route_row: Tensor
    weights: Tensor
    ids: Tensor
    shared: bool = True

    def finalize(self) -> Tensor:
        """[M, D] BF16: BF16(Σ_j weights[:, j] · rows[route_row[:, j]]) (+ BF16(shared rows)),
        the routes summed in order j = 0..k-1 (as the fused finalization does)."""
        m = self.route_row.shape[0]
        routed = torch.zeros(m, self.rows.shape[1], dtype=torch.float32, device=self.rows.device)
        for j in range(self.route_row.shape[1]):
            r = self.route_row[:, j].long()
            y = self.rows[r.clamp(min=0)] * (r >= 0)[:, None]
            routed += self.weights[:, j : j + 1] * y
        if not self.shared:
            return routed.bfloat16()
        return (routed.bfloat16().float() + self.rows[:m].bfloat16().float()).bfloat16()


@dataclass(frozen=True)
class _Plan:
    chunk: int  # tokens per group at most
    groups: int  # G: the grid's groups (an upper bound on those a routing can use)
    bm: int  # token tile of the expert kernels
    bn_gate_up: int
    bn_down: int
    blocks: int  # gate_up: 128-wide K blocks per pipelined step
    tiles_down: int = 1  # down: BN-wide column tiles per CTA
    stages_gate_up: int = 3
    stages_down: int = 3
    warps_gate_up: int = 4
    warps_down: int = 4
    warps_route: int = 4
    # The routing launch's tokens quantized by programs of their own (route_kernel's, and
    # router_route_kernel's after the router tiles').
    quantize_apart: bool = True
    split_gate_up: int = 1  # gate_up: CTAs sharing a column tile's K (the last one's SwiGLU)
    release_early: bool = False  # the routing launch releases gate_up right after its wait


class MegaExperts:
    """Routed experts of one MoE layer (this rank's shard) with its shared expert.

    w13 [E, 2I, D] e4m3 (each expert's gate rows, then its up rows), w13_scale [E, 2I/128,
    D/128]; w2 [E, D, I] e4m3, w2_scale [E, D/128, I/128]; scales FP32 or float8_e8m0fnu
    (UE8M0). `shared`: the shared expert's (w13 [2I, D], w13_scale, w2 [D, I], w2_scale), the
    same dtypes, run as one more expert of the same launches (None: routed experts only, for a
    shared expert run beside them, `MoeLayer(shared_mlp=...)`). `bias`:
    e_score_correction_bias [E]. `ue8m0`: activation scales rounded up to powers of two
    (DeepGEMM's E8M0 mode). Weights are read in place, never copied.
    """

    chunk_tokens: int | None = None  # tokens per group (None: all of an expert's tokens)

    def __init__(
        self,
        w13: Tensor,
        w13_scale: Tensor,
        w2: Tensor,
        w2_scale: Tensor,
        *,
        bias: Tensor,
        shared: tuple[Tensor, Tensor, Tensor, Tensor] | None,
        top_k: int,
        routed_scaling: float,
        swiglu_limit: float,
        ue8m0: bool = False,
        max_tokens: int = MAX_TOKENS,
    ):
        try:
            import triton  # noqa: F401  (the kernels' backend: glm5-kernels[triton])
        except ImportError as e:
            raise ImportError(f"{type(self).__name__} needs Triton (glm5-kernels[triton])") from e
        _check_weights(type(self).__name__, w13, w13_scale, w2, w2_scale, bias, shared, top_k,
                       swiglu_limit, max_tokens)  # fmt: skip
        self.w13, self.w2, self.bias = w13, w2, bias
        self.num_experts, two_i, self.hidden = w13.shape
        self.inter = two_i // 2
        self.top_k, self.routed_scaling, self.limit = top_k, float(routed_scaling), swiglu_limit
        self.ue8m0, self.max_tokens = ue8m0, max_tokens
        e8m0 = w13_scale.dtype == torch.float8_e8m0fnu
        self.scale_e8m0 = e8m0
        raw = (lambda s: s.view(torch.uint8)) if e8m0 else (lambda s: s)
        self.w13_scale, self.w2_scale = raw(w13_scale), raw(w2_scale)
        self.shared = shared is not None
        self.shared_offsets = (0, 0, 0, 0)
        if shared is not None:
            sw13, ss13, sw2, ss2 = shared
            # The shared expert's tensors as element offsets from the routed stacks' bases.
            self.shared_offsets = tuple(
                _offset(base, t) for base, t in
                ((w13, sw13), (self.w13_scale, raw(ss13)), (w2, sw2), (self.w2_scale, raw(ss2)))
            )  # fmt: skip
        self._shared = shared  # kept alive: the kernels read it through the offsets
        self._device = w13.device
        # Launch options fixed per build, not looked up per call.
        self._pdl, self._interp = use_pdl(self._device), interpreting()
        sms = sm_count(self._device)
        self.plans = {m: self._plan(m, sms) for m in range(1, max_tokens + 1)}
        self._counts = torch.zeros(-(-self.hidden // 16), dtype=torch.int32, device=self._device)
        # gate_up's split arrivals: one counter per (group, column tile) at any plan's tiles.
        most = max(p.groups for p in self.plans.values()) * -(-self.inter // 16)
        self._gate_up_counts = torch.zeros(most, dtype=torch.int32, device=self._device)
        self._arrivals = torch.zeros(1, dtype=torch.int32, device=self._device)
        self._ready: set[int] = set()

    def _plan(self, m: int, sms: int) -> _Plan:
        """Tiles from the H200 sweeps of benchmarks/moe_decode.py --sweep (TP 4 rank, 1-64
        tokens): BN 64 (32 / 16: 15-80 % slower); gate_up takes two K blocks per pipelined
        step in 3 stages (one: 5-25 % slower, 2 or 4 stages: 5-70 %), one where the tile is
        64 tokens (two overflow shared memory); down in 3 stages, one column tile per CTA,
        two where I has only 4 K blocks and the groups are many (64 tokens: 5 % faster, at
        1-8 tokens 1-10 % slower); routing on 4 warps (one: 25 % slower), the tokens
        quantized by programs beside the routing ones (H100, TP 4 and 8 ranks, 1-8 tokens:
        the routing launch 7.6-8.3 -> 6.1-6.6 us, benchmarks/results/moe_sweep_h100.json).
        H200 sweep at TP 4 / 8 ranks, 1-8 tokens (moe_sweep_h200.json): gate_up's K split
        over 4 CTAs a tile where the grid is a quarter wave (TP 8, one token: 36 CTAs, 13.8
        -> 10.6 us), over 2 where it is half of one (TP 8, 2 tokens 15.1 -> 14.5; TP 4, one
        token 15.3 -> 15.0), and not where it fills one (2-9 us slower); down on two column
        tiles a CTA where I has only 2 K blocks (TP 8) from 2 tokens (7-15 % faster)."""
        k, e, d, i = self.top_k, self.num_experts, self.hidden, self.inter
        chunk = m if self.chunk_tokens is None else min(self.chunk_tokens, m)
        # Groups: the shared expert's, one per touched expert, and the extra ones of experts
        # holding more than `chunk` tokens (none when a chunk holds all M).
        shared = -(-m // chunk) if self.shared else 0
        groups = shared + min(e, m * k) + (m * k // chunk if chunk < m else 0)
        bm = max(16, next_pow2(chunk))
        bn = next(b for b in (64, 32, 16) if i % b == 0)
        blocks = 2 if (d // GROUP) % 2 == 0 and bm < 64 else 1
        bn_down = next(b for b in (64, 32, 16) if d % b == 0)
        few_k = (i // GROUP <= 2 and m > 1) or (i // GROUP <= 4 and m > 16)
        tiles = 2 if few_k and d % (2 * bn_down) == 0 else 1
        ctas, k_blocks = (i // bn) * groups, d // GROUP
        split = next((s for s in (4, 2) if s * ctas <= 1.25 * sms and k_blocks % (s * blocks) == 0),
                     1)  # fmt: skip
        return _Plan(chunk, groups, bm, bn, bn_down, blocks, tiles, split_gate_up=split)

    def supports(self, m: int) -> bool:
        return 1 <= m <= self.max_tokens

    def prepare(self, tokens: Iterable[int]) -> None:
        """Compile and run once per token count, both outputs (before CUDA-graph capture)."""
        for m in tokens:
            if not self.supports(m):
                raise ValueError(f"{type(self).__name__}: M={m} outside 1..{self.max_tokens}")
            x = torch.zeros(m, self.hidden, dtype=torch.bfloat16, device=self._device)
            logits = torch.zeros(m, self.num_experts, dtype=torch.float32, device=self._device)
            self(x, logits)
            self.finalized(x, logits)

    def __call__(self, x: Tensor, logits: Tensor) -> MoeRows:
        """x [M, D] BF16, router logits [M, E] FP32 -> the unfinalized routes."""
        m = self._check(x, logits=logits)
        rows, _ = self._run(x, m, logits, None, None, finalize=False)
        return rows

    def finalized(self, x: Tensor, logits: Tensor | None = None, out: Tensor | None = None, *,
                  gate: Router | None = None) -> Tensor:  # fmt: skip
        """x [M, D] BF16, router logits [M, E] FP32 -> routed + shared output [M, D] BF16.
        With `gate` (the layer's `Router`) instead of logits, the router GEMM runs inside
        the routing launch (`router_route_kernel`: three launches for the whole layer)."""
        if gate is None and logits is None:
            raise ValueError(f"{type(self).__name__}: finalized needs the router logits or gate=")
        if gate is not None:
            m = self._check(x, out=out, gate=gate)
            logits = torch.empty(m, self.num_experts, dtype=torch.float32, device=self._device)
            return self._run(x, m, logits, None, None, finalize=True, out=out, gate=gate)[1]
        m = self._check(x, logits=logits, out=out)
        return self._run(x, m, logits, None, None, finalize=True, out=out)[1]

    def routed(
        self, x: Tensor, ids: Tensor, weights: Tensor, *, finalize: bool = False
    ) -> MoeRows | Tensor:
        """The same from a routing computed elsewhere: ids [M, k] int32, weights [M, k] FP32.
        Outside CUDA-graph capture an id outside [0, E) is an error; inside (no host sync
        there) it contributes nothing, like an expert-parallel sentinel id."""
        m = self._check(x, ids=ids, weights=weights)
        rows, out = self._run(x, m, None, ids, weights, finalize=finalize)
        return out if finalize else rows

    def _check(self, x: Tensor, *, logits=None, ids=None, weights=None, out=None,
               gate=None) -> int:  # fmt: skip
        name, problems = type(self).__name__, []
        d, e, k = self.hidden, self.num_experts, self.top_k
        if x.dim() != 2 or x.shape[1] != d or x.dtype != torch.bfloat16 or x.stride(-1) != 1:
            problems.append(f"x: {tuple(x.shape)} {x.dtype}, expected [M, {d}] bfloat16 with "
                            "contiguous columns")  # fmt: skip
        m = x.shape[0] if x.dim() == 2 else 0
        if not self.supports(m):
            problems.append(f"x: M={m} outside the compiled range 1..{self.max_tokens}")
        if x.device != self._device:
            problems.append(f"x: on {x.device}, weights on {self._device}")
        if logits is not None and (logits.shape != (m, e) or logits.dtype != torch.float32
                                   or logits.stride(-1) != 1):  # fmt: skip
            problems.append(f"logits: {tuple(logits.shape)} {logits.dtype}, expected [{m}, {e}] "
                            "float32 with contiguous columns")  # fmt: skip
        if ids is not None:
            if ids.shape != (m, k) or ids.dtype != torch.int32 or not ids.is_contiguous():
                problems.append(f"ids: {tuple(ids.shape)} {ids.dtype}, expected contiguous "
                                f"[{m}, {k}] int32 (top-k is {k})")  # fmt: skip
            elif not capturing() and ids.numel() and not ((ids >= 0) & (ids < e)).all():
                bad = ids[(ids < 0) | (ids >= e)].unique().tolist()
                problems.append(f"ids: expert ids {bad[:8]} outside [0, {e})")
            if weights is None or weights.shape != (m, k) or weights.dtype != torch.float32 \
                    or not weights.is_contiguous():  # fmt: skip
                got = None if weights is None else (tuple(weights.shape), weights.dtype)
                problems.append(f"weights: {got}, expected contiguous [{m}, {k}] float32")
        if out is not None and (out.shape != (m, d) or out.dtype != torch.bfloat16
                                or out.stride(-1) != 1):  # fmt: skip
            problems.append(f"out: {tuple(out.shape)} {out.dtype}, expected [{m}, {d}] bfloat16")
        if gate is not None and (gate.n != e or gate.k != d or gate.out_dtype != torch.float32):
            problems.append(f"gate: a Router [{gate.n}, {gate.k}] -> {gate.out_dtype}, expected "
                            f"[{e}, {d}] -> float32 logits")  # fmt: skip
        if gate is not None and not gate.supports(m):
            problems.append(f"gate: M={m} outside its compiled range 1..{gate.max_tokens}")
        if problems:
            raise ValueError(f"{name}: " + "; ".join(problems))
        first_call(self, m)
        return m

    def _buffers(self, x, m, logits, ids, weights, finalize: bool, out) -> SimpleNamespace:
        """One call's inputs and scratch (the CUDA graph's pool during capture)."""
        dev, d, k = self._device, self.hidden, self.top_k
        routed_here = ids is None
        if routed_here:
            ids = torch.empty(m, k, dtype=torch.int32, device=dev)
            weights = torch.empty(m, k, dtype=torch.float32, device=dev)
        rows_total = m * k + (m if self.shared else 0)
        if finalize and out is None:
            out = torch.empty(m, d, dtype=torch.bfloat16, device=dev)
        split = self.plans[m].split_gate_up  # gate_up's K split: each split's FP32 partials
        part = None if split == 1 else torch.empty(split, rows_total, 2 * self.inter,
                                                   dtype=torch.float32, device=dev)  # fmt: skip
        return SimpleNamespace(
            m=m, x=x, logits=logits, ids=ids, weights=weights, route=routed_here,
            finalize=finalize, out=out,
            route_row=torch.empty(m, k, dtype=torch.int32, device=dev),
            group=torch.empty(3, self.plans[m].groups, dtype=torch.int32, device=dev),
            row_token=torch.empty(rows_total, dtype=torch.int32, device=dev),
            xq=torch.empty(m, d, dtype=torch.float8_e4m3fn, device=dev),
            xs=torch.empty(m, d // GROUP, dtype=torch.float32, device=dev),
            act=torch.empty(rows_total, self.inter, dtype=torch.bfloat16, device=dev),
            rows=torch.empty(rows_total, d, dtype=torch.float32, device=dev), part=part,
        )  # fmt: skip

    def _run(self, x, m, logits, ids, weights, *, finalize: bool, out=None, gate=None):
        b = self._buffers(x, m, logits, ids, weights, finalize, out)
        if gate is None:
            self._route(b)
        else:
            self._route_gated(b, gate)
        self._gate_up(b)
        self._down(b)
        return MoeRows(b.rows, b.route_row, b.weights, b.ids, self.shared), b.out

    def _route(self, b: SimpleNamespace) -> None:
        from .triton_moe import route_kernel

        p, m, pdl = self.plans[b.m], b.m, self._pdl
        group = b.group
        apart = m * -(-self.hidden // (GROUP * QUANT_GROUPS)) if p.quantize_apart else 0
        route_kernel[(m + apart,)](
            b.logits if b.route else b.x, self.bias, b.ids, b.weights, b.route_row, group[0],
            group[1], group[2], b.row_token, b.x, b.xq, b.xs, self._arrivals, m, self.num_experts,
            self.hidden, b.logits.stride(0) if b.route else 0, b.x.stride(0),
            self.routed_scaling, p.groups, p.chunk,
            MAX_CHUNKS=-(-m // p.chunk), TOP_K=self.top_k, KP=next_pow2(self.top_k),
            BR=max(2, next_pow2(m * self.top_k)), BE=next_pow2(self.num_experts + 1), ROUTE=b.route,
            UE8M0=self.ue8m0, QUANT_GROUPS=QUANT_GROUPS, INTERPRETER=self._interp, PDL=pdl,
            SHARED=self.shared, QUANT_APART=p.quantize_apart, RELEASE_EARLY=p.release_early,
            num_warps=p.warps_route, launch_pdl=pdl,
        )  # fmt: skip

    def _route_gated(self, b: SimpleNamespace, gate: Router) -> None:
        """The router GEMM on the Router's tile for M tokens (its split-K partials summed by
        the launch's last program instead of each column tile's), then the routing."""
        from .triton_moe import router_route_kernel

        p, m, pdl, t = self.plans[b.m], b.m, self._pdl, gate.tiles[b.m]
        e, d = self.num_experts, self.hidden
        k_tiles = -(-d // t.bk)
        gemm = -(-e // t.bn) * t.split_k  # the router tiles' programs
        apart = p.quantize_apart
        grid = gemm + m * -(-d // (GROUP * QUANT_GROUPS)) if apart else max(gemm, m)
        part = torch.empty(t.split_k, m, e, dtype=torch.float32, device=self._device)
        router_route_kernel[(grid,)](
            gate.weight, part, b.logits, self.bias, b.ids, b.weights, b.route_row, b.group[0],
            b.group[1], b.group[2], b.row_token, b.x, b.xq, b.xs, self._arrivals, m, e, d,
            b.x.stride(0), self.routed_scaling, p.groups, p.chunk, -(-k_tiles // t.split_k),
            MAX_CHUNKS=-(-m // p.chunk), TOP_K=self.top_k, KP=next_pow2(self.top_k),
            BR=max(2, next_pow2(m * self.top_k)), BE=next_pow2(e + 1), BM=t.bm, BN=t.bn,
            BK=t.bk, SPLIT_K=t.split_k, BT=min(4, next_pow2(m)), UE8M0=self.ue8m0,
            QUANT_GROUPS=QUANT_GROUPS, INTERPRETER=self._interp, PDL=pdl,
            PREFETCH=t.prefetch if pdl else 0,
            SHARED=self.shared, QUANT_APART=apart, num_warps=t.warps, num_stages=t.stages,
            launch_pdl=pdl,
        )  # fmt: skip

    def _gate_up(self, b: SimpleNamespace) -> None:
        from .triton_moe import gate_up_kernel

        p, pdl = self.plans[b.m], self._pdl
        w13_off, s13_off = self.shared_offsets[:2]
        rows, split = b.act.shape[0], p.split_gate_up
        k_blocks = self.hidden // GROUP
        if k_blocks % split or (k_blocks // split) % p.blocks:
            raise ValueError(f"{type(self).__name__}: gate_up split {split} x {p.blocks} K "
                             f"blocks a step does not tile {k_blocks} K blocks")  # fmt: skip
        part = b.act if b.part is None else b.part  # (unread without a split)
        gate_up_kernel[(self.inter // p.bn_gate_up, p.groups, split)](
            b.xq, b.xs, self.w13, self.w13_scale, b.act, b.group[0], b.group[1], b.group[2],
            b.row_token, part, self._gate_up_counts, b.m, self.num_experts, self.hidden,
            self.inter, w13_off, s13_off, self.limit, rows,
            BM=p.bm, BN=p.bn_gate_up, KB=p.blocks, SPLIT=split, SCALE_E8M0=self.scale_e8m0,
            INTERPRETER=self._interp, PDL=pdl, num_warps=p.warps_gate_up,
            num_stages=p.stages_gate_up, launch_pdl=pdl,
        )  # fmt: skip

    def _down(self, b: SimpleNamespace) -> None:
        from .triton_moe import down_kernel

        p, m, pdl = self.plans[b.m], b.m, self._pdl
        w2_off, s2_off = self.shared_offsets[2:]
        out = b.out if b.finalize else b.rows
        down_kernel[(self.hidden // (p.bn_down * p.tiles_down), p.groups)](
            b.act, self.w2, self.w2_scale, b.rows, out, self._counts, b.group[0], b.group[1],
            b.group[2], b.route_row, b.weights, m, self.num_experts, self.hidden, self.inter,
            w2_off, s2_off, out.stride(0), p.groups,
            BM=p.bm, BN=p.bn_down, NT=p.tiles_down, BT=max(2, next_pow2(m)), TOP_K=self.top_k,
            KP=next_pow2(self.top_k),
            SCALE_E8M0=self.scale_e8m0, UE8M0=self.ue8m0, FINALIZE=b.finalize,
            INTERPRETER=self._interp, PDL=pdl, PREFETCH=2 if pdl else 0, SHARED=self.shared,
            num_warps=p.warps_down, num_stages=p.stages_down, launch_pdl=pdl,
        )  # fmt: skip


class GroupedExperts(MegaExperts):
    """`MegaExperts` with groups of at most 16 tokens (the policy's `grouped`)."""

    chunk_tokens = 16


class MoeLayer:
    """A whole MoE layer's decode for the token counts it serves: the BF16 router (split-K,
    FP32 logits), then the experts op the policy picked for that count, finalized: x [M, D]
    BF16 -> routed + shared output [M, D] BF16 (this rank's TP-partial). At the `gated`
    token counts the router GEMM runs inside the experts' routing launch (three launches).

    `shared_mlp` (a `SharedExpert`, with experts built `shared=None`): the shared expert
    runs on a second stream beside the router and routed experts (forked and joined inside
    a CUDA graph as well) and is added at the end — the seed's other way to run it, for the
    benchmark to weigh against one more group of the same launches."""

    def __init__(self, router: Router, experts: dict[int, MegaExperts], shared_mlp=None,
                 gated: Iterable[int] = ()):  # fmt: skip
        if any(op.shared == (shared_mlp is not None) for op in experts.values()):
            raise ValueError("MoeLayer: the shared expert belongs either to the experts op "
                             "(shared=...) or to shared_mlp, exactly one")  # fmt: skip
        self.router, self.experts, self.shared_mlp = router, dict(experts), shared_mlp
        self.gated = frozenset(gated)  # token counts whose router runs in the routing launch
        if not self.gated <= set(self.experts):
            raise ValueError(f"MoeLayer: gated token counts {sorted(self.gated - set(experts))} "
                             "have no experts op")  # fmt: skip
        self._stream = None

    def supports(self, m: int) -> bool:
        return m in self.experts

    def prepare(self, tokens: Iterable[int]) -> None:
        tokens = list(tokens)
        self.router.prepare(tokens)
        if self.shared_mlp is not None:
            self.shared_mlp.prepare(tokens)
        for m in tokens:
            self.experts[m].prepare([m])
            if m in self.gated:
                dev = self.router.weight.device
                x = torch.zeros(m, self.router.k, dtype=torch.bfloat16, device=dev)
                self.experts[m].finalized(x, gate=self.router)

    def _routed(self, x: Tensor) -> Tensor:
        experts = self.experts[x.shape[0]]
        if x.shape[0] in self.gated:
            return experts.finalized(x, gate=self.router)
        return experts.finalized(x, self.router(x))

    def __call__(self, x: Tensor) -> Tensor:
        if self.shared_mlp is None:
            return self._routed(x)
        if not x.is_cuda:
            return self._routed(x) + self.shared_mlp(x)
        main = torch.cuda.current_stream(x.device)
        if self._stream is None:
            self._stream = torch.cuda.Stream(x.device)
        self._stream.wait_stream(main)
        with torch.cuda.stream(self._stream):
            shared = self.shared_mlp(x)
        routed = self._routed(x)
        main.wait_stream(self._stream)
        return routed + shared  # BF16 + BF16: the stock sum's rounding


def _offset(base: Tensor, t: Tensor) -> int:
    """t's first element as an element offset from base's (same dtype)."""
    delta = t.data_ptr() - base.data_ptr()
    assert delta % base.element_size() == 0  # same dtype: both aligned to it
    return delta // base.element_size()


def _check_weights(name, w13, s13, w2, s2, bias, shared, top_k, limit, max_tokens) -> None:
    """Every problem with the weights and settings in one error."""
    problems: list[str] = []
    fp8, scale_types = torch.float8_e4m3fn, (torch.float32, torch.float8_e8m0fnu)
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"{name}: w13 / w2 must be [E, 2I, D] / [E, D, I], got "
                         f"{tuple(w13.shape)} / {tuple(w2.shape)}")  # fmt: skip
    e, two_i, d = w13.shape
    i = two_i // 2
    want = {
        "w13": (w13, (e, 2 * i, d), fp8),
        "w2": (w2, (e, d, i), fp8),
        "w13_scale": (s13, (e, -(-2 * i // GROUP), d // GROUP), None),
        "w2_scale": (s2, (e, d // GROUP, -(-i // GROUP)), None),
    }
    if isinstance(shared, tuple) and len(shared) == 4:
        for n, t in zip(("w13", "w13_scale", "w2", "w2_scale"), shared, strict=True):
            want[f"shared {n}"] = (t, want[n][1][1:], want[n][2])
    elif shared is not None:
        problems.append("shared: expected (w13, w13_scale, w2, w2_scale) of the shared expert "
                        "or None")  # fmt: skip
    for n, (t, shape, dtype) in want.items():
        if tuple(t.shape) != shape or not t.is_contiguous():
            problems.append(f"{n}: shape {tuple(t.shape)}, expected contiguous {shape}")
        if dtype is not None and t.dtype != dtype:
            problems.append(f"{n}: dtype {t.dtype}, expected {dtype}")
        if dtype is None and t.dtype != s13.dtype:
            problems.append(f"{n}: dtype {t.dtype}, expected the routed scales' {s13.dtype}")
        if t.device != w13.device:
            problems.append(f"{n}: on {t.device}, w13 on {w13.device}")
    if s13.dtype not in scale_types:
        problems.append(f"w13_scale: dtype {s13.dtype}, expected one of {scale_types}")
    if two_i % 2 or i % GROUP or d % GROUP:
        problems.append(f"I={two_i / 2}, D={d}: both must be multiples of {GROUP}")
    if tuple(bias.shape) != (e,) or not bias.is_contiguous() or not bias.is_floating_point():
        problems.append(f"bias: {tuple(bias.shape)} {bias.dtype}, expected contiguous [{e}] float")
    if not 1 <= top_k <= min(e, MAX_TOP_K):
        problems.append(f"top_k={top_k}: must be in 1..{min(e, MAX_TOP_K)} (the compiled maximum "
                        f"is {MAX_TOP_K})")  # fmt: skip
    if not (limit > 0 and math.isfinite(limit)):
        problems.append(f"swiglu_limit={limit}: must be finite and > 0")
    if not 1 <= max_tokens <= MAX_TOKENS:
        problems.append(f"max_tokens={max_tokens}: must be in 1..{MAX_TOKENS}")
    if w13.device.type != "cuda" and not interpreting():
        problems.append(f"weights on {w13.device}; the Triton kernels need CUDA")
    if problems:
        raise ValueError(f"{name}: " + "; ".join(problems))
