"""The indexer's pool scoring and top-k selection in one launch: `IndexerTopk`, the contract
of `index_topk_ref` (`triton_indexer`: the scoring split over CTAs, the last CTA of each
query row selects)."""

from __future__ import annotations

import torch
from torch import Tensor

from glm5_kernels.dsa.checks import index_problems, paged, table_problems
from glm5_kernels.launch import capturing, interpreting, next_pow2, use_pdl

__all__ = ["IndexerTopk"]

BP, BC, WARPS = 64, 64, 4  # pools a scoring step, output pools a store step


class IndexerTopk:
    """A DSA layer's selection: `heads` indexer heads of `head_dim` (a power of two >= 16),
    pools of `kpool` tokens, `topk` tokens selected (+ the tail's kpool - 1 with `tail`), for
    up to `max_rows` query rows over block tables of up to `max_pools` pools."""

    def __init__(self, heads: int, head_dim: int, *, kpool: int, topk: int, tail: bool,
                 max_rows: int = 64, max_pools: int = 8192, device="cuda"):  # fmt: skip
        problems = []
        if head_dim < 16 or head_dim & (head_dim - 1):
            problems.append(f"head_dim={head_dim}: a power of two >= 16 expected")
        if kpool < 1 or kpool & (kpool - 1) or topk % kpool:
            problems.append(f"kpool={kpool}, topk={topk}: kpool a power of two dividing topk")
        if problems:
            raise ValueError("IndexerTopk: " + "; ".join(problems))
        self.heads, self.head_dim, self.kpool, self.topk = heads, head_dim, kpool, topk
        self.tail, self.max_rows, self.max_pools = tail, max_rows, max_pools
        self.width = topk + (kpool - 1 if tail and kpool > 1 else 0)
        self._pmax = next_pow2(max_pools)
        dev = torch.device(device)
        self._device, self._pdl, self._interp = dev, use_pdl(dev), interpreting()
        self._sms = (
            torch.cuda.get_device_properties(dev).multi_processor_count
            if dev.type == "cuda"
            else 132
        )
        self._scores = torch.empty(max_rows, self._pmax, device=dev)
        self._pools = torch.empty(max_rows, self._pmax, dtype=torch.int32, device=dev)
        self._count = torch.zeros(max_rows, dtype=torch.int32, device=dev)  # self-resetting
        from glm5_kernels.dsa.triton_indexer import indexer_topk_kernel

        self._kernel = indexer_topk_kernel
        self._ready = False

    def supports(self, rows: int) -> bool:
        return 1 <= rows <= self.max_rows

    def splits(self, rows: int, pools: int) -> int:
        """CTAs a row's pools are scored by: the SMs filled twice, at least BP pools each."""
        return max(1, min(-(-2 * self._sms // rows), -(-pools // BP)))

    def prepare(self, tokens=None) -> None:
        """Compile the kernel (one specialization) before any CUDA-graph capture."""
        dev, h, hd = self._device, self.heads, self.head_dim
        q = torch.zeros(1, h, hd, device=dev).to(torch.float8_e4m3fn)
        ones = torch.ones(1, h, device=dev)
        pages = torch.zeros(1, 1, hd + 4, dtype=torch.uint8, device=dev)
        one = torch.zeros(1, 1, dtype=torch.int32, device=dev)
        self(q, ones, ones, pages, one, one[0], one[0])
        self._ready = True

    def __call__(self, q: Tensor, q_scale: Tensor, weights: Tensor, pages: Tensor,
                 block_table: Tensor, request: Tensor, positions: Tensor, *,
                 out: Tensor | None = None) -> Tensor:  # fmt: skip
        """q [N, H, hd] float8_e4m3fn (rotated queries), q_scale / weights [N, H] FP32 (unit
        columns, any row stride: weights may be columns of the indexer's one projection),
        pages [blocks, S, hd + 4] uint8 (vLLM's pool cache), block_table [R, B], request [N]
        (each row's request), positions [N] -> token positions [N, width] int32 (-1: none),
        `index_topk_ref`'s set in its layout."""
        self._check(q, q_scale, weights, pages, block_table, request, positions, out)
        if not self._ready and capturing():
            raise RuntimeError("IndexerTopk: not prepared; call prepare() before capture")
        n, s = q.shape[0], pages.shape[1]
        pools = block_table.shape[1] * s
        if out is None:
            out = torch.empty(n, self.width, dtype=torch.int32, device=q.device)
        splits = self.splits(n, pools)
        per_split = -(-pools // splits)
        per_split = -(-per_split // BP) * BP  # whole scoring steps a split
        splits = -(-pools // per_split)
        self._kernel[(n, splits)](
            q, q_scale, weights, pages, pages.view(torch.float32), block_table, request,
            positions, self._scores, self._pools, self._count, out,
            pools, s, pages.stride(0), per_split, min(self.topk // self.kpool, pools),
            self.width,
            self.head_dim**-0.5 * self.heads**-0.5,
            q.stride(0), q.stride(1), q_scale.stride(0), weights.stride(0), block_table.stride(0),
            out.stride(0),
            IH=max(16, next_pow2(self.heads)), H=self.heads, HD=self.head_dim, KP=self.kpool,
            BP=BP, PMAX=self._pmax, BC=BC, TAIL=self.width > self.topk, PDL=self._pdl,
            num_warps=WARPS, launch_pdl=self._pdl,
        )  # fmt: skip
        return out

    def _check(self, q, q_scale, weights, pages, block_table, request, positions, out) -> None:
        """Every problem with a call's inputs in one error (index ranges: outside capture)."""
        h, hd, problems = self.heads, self.head_dim, []
        n = q.shape[0] if q.dim() == 3 else -1
        if q.dim() != 3 or q.shape[1:] != (h, hd) or q.dtype != torch.float8_e4m3fn \
                or q.stride(2) != 1:  # fmt: skip
            problems.append(f"q: {tuple(q.shape)} {q.dtype}, expected [N, {h}, {hd}] "
                            "float8_e4m3fn")  # fmt: skip
        elif not self.supports(n):
            problems.append(f"q: {n} rows, outside 1..{self.max_rows}")
        for name, x in (("q_scale", q_scale), ("weights", weights)):
            if x.shape != (n, h) or x.dtype != torch.float32 or x.stride(1) != 1:
                problems.append(f"{name}: {tuple(x.shape)} {x.dtype}, expected [{n}, {h}] "
                                "float32")  # fmt: skip
        if not paged(pages, hd):
            problems.append(f"pages: {tuple(pages.shape)} {pages.dtype} strides "
                            f"{pages.stride()}, expected [blocks, S, {hd + 4}] uint8, each "
                            "block's page contiguous at a 4-byte aligned block stride")  # fmt: skip
        problems += index_problems(block_table=(block_table, 2), request=(request, 1),
                                   positions=(positions, 1))  # fmt: skip
        if not problems:
            if request.shape[0] != n or positions.shape[0] != n:
                problems.append(f"request / positions: {request.shape[0]} / "
                                f"{positions.shape[0]} rows, q has {n}")  # fmt: skip
            pools = block_table.shape[1] * pages.shape[1]
            if pools > self._pmax:
                problems.append(f"block_table: {pools} pools, above the {self.max_pools} "
                                "this op was built for")  # fmt: skip
        if out is not None and (tuple(out.shape) != (n, self.width)
                                or out.dtype != torch.int32 or out.stride(1) != 1):  # fmt: skip
            problems.append(f"out: {tuple(out.shape)} {out.dtype}, expected [{n}, "
                            f"{self.width}] int32")  # fmt: skip
        if not problems and not capturing():  # host syncs: only outside capture
            problems += table_problems(request, block_table, pages.shape[0])
            if n and positions.min() < 0:
                problems.append("positions: negative")
        if problems:
            raise ValueError("IndexerTopk: " + "; ".join(problems))
