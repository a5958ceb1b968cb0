"""A KDA layer's decode / verify step as one kernel: `KdaDecode`.

From the projections' outputs (q | k | v rows, the forget gate's f_b output, the beta
logits, the output gate's g_b output — or, built with f_b and g_b, their low-rank halves
f_a and g_a, projected in the kernel) to the gated-RMSNormed rows o_proj reads, with the
BF16 conv state and the FP32 recurrent state updated in place in vLLM 0.33's layouts — the
same contract as `kda_decode_ref`: one launch (`triton_kda.kda_decode_kernel`, a CTA per
request, head and slice of V) or, where a step has many heads x tokens, two
(`triton_split`: the conv, norms and gates a CTA per request and head, then the
recurrence a CTA per slice).
"""

from __future__ import annotations

import torch
from torch import Tensor

from glm5_kernels.launch import capturing, interpreting, use_pdl

__all__ = ["KdaDecode"]


def state_early(bv: int, warps: int) -> bool:
    """Whether the one-launch kernel at tile (bv, warps) reads its state slice before the PDL
    wait: slices of up to 32 rows on 2+ warps (the small steps' tiles), 0.3-0.9 us faster at
    16-64 heads x requests on the H100; at the larger tiles' steps 0.4-1 us slower (more CTAs
    than fit at once: later waves overlap nothing)."""
    return bv <= 32 and warps >= 2


class KdaDecode:
    """One KDA layer's weights: conv_weight [3C', W] (C' = H*K; q | k | v channels), dt_bias
    [H*K], A_log [H], the output norm's weight [V]; `lower_bound` of the forget gate (None:
    -exp(A_log) * softplus), the output norm's `eps`; steps of up to `max_tokens` tokens per
    request. With `f_b` [H*K, RF] and `g_b` [H*V, RG] (BF16, the gates' low-rank
    up-projections) a call's f and gate are the rows of f_a and g_a (`low_rank`)."""

    def __init__(
        self,
        conv_weight: Tensor,
        dt_bias: Tensor,
        A_log: Tensor,
        norm_weight: Tensor,
        *,
        lower_bound: float | None,
        eps: float,
        max_tokens: int = 8,
        f_b: Tensor | None = None,
        g_b: Tensor | None = None,
    ):
        h = A_log.numel()
        k = dt_bias.numel() // max(h, 1)
        v = norm_weight.numel()
        problems = []
        if conv_weight.dim() != 2 or conv_weight.shape[0] != 2 * h * k + h * v:
            problems.append(
                f"conv_weight: {tuple(conv_weight.shape)}, expected [{2 * h * k + h * v}, W]"
            )
        for name, n in (("K", k), ("V", v)):
            if n < 16 or n & (n - 1):
                problems.append(f"{name}={n}: a power of two >= 16 expected")
        if dt_bias.numel() != h * k:
            problems.append(f"dt_bias: {dt_bias.numel()} values, expected H*K = {h * k}")
        if (f_b is None) != (g_b is None):
            problems.append("f_b and g_b: both or neither (the low-rank gates)")
        for name, w, rows in (("f_b", f_b, h * k), ("g_b", g_b, h * v)):
            if w is not None and (w.dim() != 2 or w.shape[0] != rows or w.shape[1] % 8
                                  or w.dtype != torch.bfloat16):  # fmt: skip
                problems.append(f"{name}: {tuple(w.shape)} {w.dtype}, expected [{rows}, a "
                                "multiple of 8] bfloat16")  # fmt: skip
        if problems:
            raise ValueError("KdaDecode: " + "; ".join(problems))
        self.conv_weight = conv_weight.contiguous()
        self.dt_bias, self.A_log = dt_bias.contiguous(), A_log.reshape(-1).contiguous()
        self.norm_weight = norm_weight.contiguous()
        self.f_b = None if f_b is None else f_b.contiguous()
        self.g_b = None if g_b is None else g_b.contiguous()
        self.low_rank = f_b is not None
        # The widths of a call's f and gate rows.
        self.f_width = h * k if f_b is None else f_b.shape[1]
        self.gate_width = h * v if g_b is None else g_b.shape[1]
        self.heads, self.k, self.v, self.width = h, k, v, conv_weight.shape[1]
        self.lower_bound, self.eps, self.max_tokens = lower_bound, eps, max_tokens
        self._device = conv_weight.device
        self._pdl, self._interp = use_pdl(self._device), interpreting()
        from glm5_kernels.kda import triton_kda, triton_split  # Triton: an extra

        self._kernel = triton_kda.kda_decode_kernel
        self._inputs = triton_split.kda_inputs_kernel
        self._recurrence = triton_split.kda_recurrence_kernel
        cuda = self._device.type == "cuda"
        self._sms = (
            torch.cuda.get_device_properties(self._device).multi_processor_count if cuda else 132
        )
        # (BV, warps, launches) for every step, else plan()
        self.tile: tuple[int, int, int] | None = None
        self._ready: set[tuple] = set()  # (tokens per request, keep, tile) compiled
        self._part = torch.empty(0, device=self._device)  # slices' sums of squares
        self._gbuf = torch.empty(0, device=self._device)  # split heads' projected gates
        self._count = torch.zeros(0, dtype=torch.int32, device=self._device)  # per (request, head)
        self._ws = torch.empty(0, device=self._device)  # two launches: the recurrence's inputs

    def supports(self, tokens: int) -> bool:
        return 1 <= tokens <= self.max_tokens

    def plan(self, requests: int, tokens: int = 1) -> tuple[int, int, int]:
        """(BV, warps, launches) for `requests` x `tokens`: few heads in the step split each
        head's state over V // BV CTAs of one launch (one SM moves a 64 KB head too slowly),
        more keep a head whole, and from 1,024 heads x requests at a decode or a 2-token
        verify (from 17 at a 3- or 4-token one) the step takes two launches (`triton_split`:
        5-14 % faster there). The one-launch tiles are the H200 sweep's
        (`kda_decode_h200*.json`), the two-launch ones the H100's
        (`kda_decode_two_launch_h100.json`); above 4 tokens, one launch (two not timed)."""
        if self.tile is not None:
            return self.tile
        heads = requests * self.heads
        if tokens == 1:
            tile = ((16, 2, 1) if heads <= 64 else (128, 8, 1) if heads < 1024
                    else (16, 1, 2) if heads < 4096 else (128, 8, 2))  # fmt: skip
        elif tokens == 2:  # one warp a slice from 256 heads: 10-25 % faster at 256-1024
            tile = ((32, 2, 1) if heads <= 128 else (32, 1, 1) if heads < 1024
                    else (16, 1, 2) if heads < 4096 else (32, 4, 2))  # fmt: skip
        elif tokens <= 4:
            tile = (32, 4, 1) if heads <= 16 else (16, 1, 2) if heads < 256 else (32, 4, 2)
        else:
            tile = (32, 4, 1) if heads <= 16 else (64, 4, 1) if heads <= 128 else (128, 4, 1)
        return min(tile[0], self.v), tile[1], tile[2]

    def prepare(self, tokens=None) -> None:
        """Compile the steps a decode loop runs — a decode of one token per request, a
        verify of 2..max_tokens (every state kept) — at every tile `plan` picks for up to
        max(tokens) requests, on scratch caches, and size the workspace, before any
        CUDA-graph capture. (A step's tokens per request are not known from its size: every
        count is compiled. Other shapes compile on first use, outside capture.)"""
        h, k, v, w, dev = self.heads, self.k, self.v, self.width, self._device
        c, bf16 = 2 * h * k + h * v, torch.bfloat16
        most = max(tokens) if tokens else 64
        chosen = self.tile
        steps = {(t, self.plan(r, t)) for t in range(1, self.max_tokens + 1)
                 for r in range(1, most // t + 1)}  # fmt: skip
        self._room(most, most, max(tile[2] for _, tile in steps))
        for t, self.tile in sorted(steps):
            widths = (c, self.f_width, h, self.gate_width)
            rows = [torch.zeros(1, t, n, dtype=bf16, device=dev) for n in widths]
            conv = torch.zeros(2, w - 2 + t, c, dtype=bf16, device=dev)
            rec = torch.zeros(2, h, v, k, device=dev)
            one = torch.ones(1, dtype=torch.int64, device=dev)
            write = torch.ones(1, t, dtype=torch.int64, device=dev)
            place = dict(conv_slots=one, conv_offset=one - 1, read_slots=one)
            self(*rows, conv, rec, **place, write_slots=write, keep=t > 1)
        self.tile = chosen

    def _room(self, requests: int, rows: int, launches: int = 1) -> None:
        """The workspace for a step of `requests` x `rows` token rows (grown outside capture
        only; the counters are zero between steps)."""
        h, k, v = self.heads, self.k, self.v
        part, count = rows * h * (v // 16), requests * h
        gbuf = rows * h * v if self.low_rank else 1
        ws = rows * h * (3 * k + v + 1) if launches == 2 else 0  # q, k, decay, v, beta
        if (self._part.numel() >= part and self._count.numel() >= count
                and self._gbuf.numel() >= gbuf and self._ws.numel() >= ws):  # fmt: skip
            return
        if capturing():
            raise RuntimeError(
                f"KdaDecode: a step of {requests} requests not prepared; call prepare() with "
                "the step sizes before CUDA-graph capture"
            )
        self._part = torch.empty(max(part, self._part.numel()), device=self._device)
        self._gbuf = torch.empty(max(gbuf, self._gbuf.numel()), device=self._device)
        self._ws = torch.empty(max(ws, self._ws.numel()), device=self._device)
        self._count = torch.zeros(max(count, self._count.numel()), dtype=torch.int32,
                                  device=self._device)  # fmt: skip

    def __call__(
        self,
        qkv: Tensor,
        f: Tensor,
        b: Tensor,
        gate: Tensor,
        conv: Tensor,
        recurrent: Tensor,
        *,
        conv_slots: Tensor,
        conv_offset: Tensor,
        read_slots: Tensor,
        write_slots: Tensor,
        keep: bool,
        out: Tensor | None = None,
    ) -> Tensor:
        """qkv [R, T, >= 3C'] (q | k | v first; rows may be strided), f [R, T, H*K] (f_a
        [R, T, RF] where `low_rank`), b [R, T, H], gate [R, T, H*V] (g_a [R, T, RG]); conv
        [slots, W-2+q, 3C'] BF16, recurrent [slots, H, V, K] FP32 (in place); conv_slots /
        conv_offset / read_slots [R], write_slots [R, T] int32 or int64 (-1: not stored);
        `keep`: every token's state (a verify). -> [R, T, H*V]."""
        r, t = qkv.shape[0], qkv.shape[1]
        self._check(qkv, f, b, gate, conv, recurrent, conv_slots, conv_offset, read_slots,
                    write_slots, out)  # fmt: skip
        h, k, v = self.heads, self.k, self.v
        tile = self.plan(r, t)
        if (t, keep, tile) not in self._ready:
            if capturing():  # a capture must never compile
                raise RuntimeError(
                    f"KdaDecode: {t} tokens per request (keep={keep}, {r} requests) not "
                    "prepared; call prepare() before CUDA-graph capture"
                )
            self._ready.add((t, keep, tile))
        self._room(r, r * t, tile[2])
        if out is None:
            out = torch.empty(r, t, h * v, dtype=qkv.dtype, device=qkv.device)
        idx = [x.contiguous() for x in (conv_slots, conv_offset, read_slots, write_slots)]
        lb, tp = self.lower_bound, 1 << (t - 1).bit_length()
        fb = f if self.f_b is None else self.f_b
        gb = gate if self.g_b is None else self.g_b
        q_scale, bound = k**-0.5, 0.0 if lb is None else lb
        common = dict(
            T=t, TP=tp, K=k, V=v, W=self.width,
            NCP=1 << (self.width - 3 + t).bit_length(),  # >= W-2+T
            KEEP=keep, HAS_LB=lb is not None,
            RF=self.f_width if self.low_rank else 0, RG=self.gate_width if self.low_rank else 0,
            X8=self.low_rank and all(_row_stride(x) % 8 == 0 and x.data_ptr() % 16 == 0
                                     for x in (f, gate)),
            INTERPRETER=self._interp, PDL=self._pdl, launch_pdl=self._pdl,
        )  # fmt: skip
        bv, warps, launches = tile
        if launches == 1:
            self._kernel[(r, h, v // bv)](
                qkv, f, b, gate, out, conv, recurrent,
                self.conv_weight, self.dt_bias, self.A_log, self.norm_weight, fb, gb, *idx,
                self._part, self._count, self._gbuf,
                *(_row_stride(x) for x in (qkv, f, b, gate, out)),
                conv.stride(0), conv.stride(1), recurrent.stride(0),
                h, q_scale, bound, self.eps, BV=bv, num_warps=warps,
                STATE_EARLY=state_early(bv, warps), **common,
            )  # fmt: skip
            return out
        n = r * t * h
        q, kn, decay, vs, beta = self._ws[: n * (3 * k + v + 1)].split([n * k] * 3 + [n * v, n])
        self._inputs[(r, h)](
            qkv, f, b, gate, conv, self.conv_weight, self.dt_bias, self.A_log, fb, gb,
            idx[0], idx[1], q, kn, decay, vs, beta, self._gbuf,
            *(_row_stride(x) for x in (qkv, f, b, gate)), conv.stride(0), conv.stride(1),
            h, q_scale, bound, num_warps=8 if t > 4 else 4, **common,
        )  # fmt: skip
        self._recurrence[(r, h, v // bv)](
            q, kn, decay, vs, beta, self._gbuf, gate, out, recurrent, self.norm_weight, idx[2],
            idx[3], self._part, self._count, _row_stride(gate), _row_stride(out),
            recurrent.stride(0), h, self.eps, T=t, TP=tp, K=k, V=v, BV=bv, NW=warps, KEEP=keep,
            RG=common["RG"], INTERPRETER=self._interp, PDL=self._pdl, num_warps=warps,
            launch_pdl=self._pdl,
        )  # fmt: skip
        return out

    def _check(self, qkv, f, b, gate, conv, rec, conv_slots, conv_offset, read_slots,
               write_slots, out) -> None:  # fmt: skip
        """Every problem with a call's inputs in one error (slot ranges: outside capture)."""
        h, k, v, w = self.heads, self.k, self.v, self.width
        r, t = qkv.shape[0], qkv.shape[1] if qkv.dim() == 3 else -1
        problems = []
        if not self.supports(t):
            problems.append(f"T={t} tokens per request, outside 1..{self.max_tokens}")

        def rows(name, x, width, dtypes=(torch.bfloat16,)):
            # [R, T, >= width], columns contiguous, rows at a uniform stride (token r*T + t).
            ok = (x.dim() == 3 and x.shape[:2] == (r, t) and x.shape[2] >= width
                  and x.dtype in dtypes and x.stride(2) == 1
                  and x.stride(0) == t * _row_stride(x))  # fmt: skip
            if not ok:
                got = f"{tuple(x.shape)} {x.dtype} strides {x.stride()}"
                problems.append(f"{name}: {got}, expected [{r}, {t}, {width}] bfloat16 rows")

        rows("qkv", qkv, 2 * h * k + h * v)
        rows("f_a" if self.low_rank else "f", f, self.f_width)
        rows("b", b, h)
        rows("g_a" if self.low_rank else "gate", gate, self.gate_width)
        if out is not None:
            rows("out", out, h * v)
        c = 2 * h * k + h * v
        if (conv.dim() != 3 or conv.shape[2] != c or conv.stride(2) != 1
                or conv.dtype != torch.bfloat16 or conv.shape[1] < w - 2 + t):  # fmt: skip
            problems.append(f"conv: {tuple(conv.shape)} {conv.dtype}, expected [slots, >= "
                            f"{w - 2 + t}, {c}] bfloat16, channels contiguous")  # fmt: skip
        if (rec.dim() != 4 or tuple(rec.shape[1:]) != (h, v, k) or rec.dtype != torch.float32
                or not rec[0].is_contiguous()):  # fmt: skip
            problems.append(f"recurrent: {tuple(rec.shape)} {rec.dtype}, expected [slots, {h}, "
                            f"{v}, {k}] float32, each slot contiguous")  # fmt: skip
        places = [("conv_slots", conv_slots, (r,)), ("conv_offset", conv_offset, (r,)),
                  ("read_slots", read_slots, (r,)),
                  ("write_slots", write_slots, (r, t))]  # fmt: skip
        for name, x, shape in places:
            if tuple(x.shape) != shape or x.dtype not in (torch.int32, torch.int64):
                problems.append(f"{name}: {tuple(x.shape)} {x.dtype}, expected {list(shape)} int")
        if not problems and not capturing():  # a host sync: only outside capture
            slots = conv.shape[0]
            for name, x, low in (("conv_slots", conv_slots, 0), ("read_slots", read_slots, 0),
                                 ("write_slots", write_slots, -1)):  # fmt: skip
                if x.numel() and (x.min() < low or x.max() >= min(slots, rec.shape[0])):
                    problems.append(f"{name}: outside [{low}, {min(slots, rec.shape[0])})")
            if conv_offset.numel() and (conv_offset.min() < 0
                                        or conv_offset.max() + w - 1 > conv.shape[1]):  # fmt: skip
                problems.append(f"conv_offset: a window past the {conv.shape[1]} conv columns")
        if problems:
            raise ValueError("KdaDecode: " + "; ".join(problems))


def _row_stride(x: Tensor) -> int:
    """The stride between token rows r * T + t of [R, T, width] rows (a one-token step's T
    stride is whatever torch gave its size-1 dim: the request stride is the row stride)."""
    return x.stride(1) if x.shape[1] > 1 else x.stride(0)
