"""The sparse MLA decode of a DSA layer: `SparseMlaDecode`, the contract of
`sparse_mla_decode_ref` in two launches (`triton_attn`: the split attention over the selected
tokens, then the merge and the value-up)."""

from __future__ import annotations

import torch
from torch import Tensor

from glm5_kernels.dsa.checks import index_problems, table_problems
from glm5_kernels.launch import capturing, interpreting, use_pdl

__all__ = ["SparseMlaDecode"]

BH, BW, BN, BV = 16, 32, 16, 64  # heads, selected tokens, query rows, value columns a tile
WARPS = 8  # [16, 512] FP32 accumulators and [32, 512] BF16 latent tiles without spills
SB = 16  # splits a merge step of the row-at-a-time merge
ROWWISE_ROWS = 2  # the most rows a step merges row at a time (rowwise() says where)


def merge_unroll(heads: int) -> int:
    """Splits the merge loads at once. H200, 2063 selected tokens: 8 at 16 heads (a TP-4
    rank) is 0-20 % faster than one at a time at 1-4 requests; at 64 heads it is 5-35 %
    slower (benchmarks/results/dsa_decode_h200.json), so one there."""
    return 8 if heads <= 16 else 1


def rowwise(rows: int, heads: int) -> bool:
    """Whether the value-up merges row at a time (triton_attn._merge_rows_value_up). H200,
    16k context, the plan's splits: 16 heads 25.8 -> 18.0 µs at 1 row, 31.1 -> 23.1 at 2,
    33.7 -> 36.6 at 4 (slower); 64 heads 35.6 -> 26.1 at 1 row, 33.8 -> 36.4 at 2."""
    return rows <= (ROWWISE_ROWS if heads <= 16 else 1)


def _absorption(w_uk: Tensor, max_rows: int):
    """q . W_uk as one skinny GEMM, block-diagonal over the heads (`Projection(blocks=H)`:
    head h's L output columns from its P query columns; W_uk transposed once, [H L, P]),
    launched like the projections around it (PDL, the weights prefetched before the wait);
    None where it cannot build (no GPU or interpreter, a column tile across two heads)."""
    from glm5_kernels.gemm import Projection

    h, p, lat = w_uk.shape
    try:
        return Projection(w_uk.transpose(1, 2).reshape(h * lat, p), max_tokens=max_rows,
                          blocks=h)  # fmt: skip
    except (ValueError, ImportError):
        return None


class SparseMlaDecode:
    """A layer's value-up W_uv [H, Vd, L] BF16 (kv_b_proj's value rows per head) and the
    softmax scale; steps of up to `max_rows` query rows (requests x tokens). `w_uk` [H, P, L]
    BF16 (kv_b_proj's key rows per head, transposed): the query absorption `absorb` too."""

    def __init__(self, w_uv: Tensor, scale: float, *, max_rows: int = 64,
                 w_uk: Tensor | None = None):  # fmt: skip
        problems = []
        if w_uk is not None and (
            w_uk.dim() != 3 or w_uk.dtype != torch.bfloat16 or w_uk.shape[0] != w_uv.shape[0]
            or w_uk.shape[2] != w_uv.shape[-1]
        ):  # fmt: skip
            problems.append(f"w_uk: {tuple(w_uk.shape)} {w_uk.dtype}, expected [H, P, L] "
                            "bfloat16 beside w_uv's H and L")  # fmt: skip
        if w_uv.dim() != 3 or w_uv.dtype != torch.bfloat16 or w_uv.stride(-1) != 1:
            problems.append(f"w_uv: {tuple(w_uv.shape)} {w_uv.dtype}, expected [H, Vd, L] "
                            "bfloat16, rows contiguous")  # fmt: skip
        elif w_uv.shape[2] < 16 or w_uv.shape[2] & (w_uv.shape[2] - 1):
            problems.append(f"L={w_uv.shape[2]}: a power of two >= 16 expected")
        if problems:
            raise ValueError("SparseMlaDecode: " + "; ".join(problems))
        self.w_uv, self.scale, self.max_rows = w_uv, float(scale), max_rows
        self._absorb = None if w_uk is None else _absorption(w_uk, max_rows)
        # The batched GEMM's operand where the skinny one does not serve (one layout,
        # whatever the backbone keeps: the absorption's rounding is the same).
        self.w_uk = w_uk if w_uk is None or self._absorb is not None else w_uk.contiguous()
        self.heads, self.vd, self.lat = w_uv.shape
        dev = w_uv.device
        self._device, self._pdl, self._interp = dev, use_pdl(dev), interpreting()
        self._sms = (
            torch.cuda.get_device_properties(dev).multi_processor_count
            if dev.type == "cuda"
            else 132
        )
        from glm5_kernels.dsa.triton_attn import sparse_mla_split_kernel, value_up_kernel

        self._split, self._value_up = sparse_mla_split_kernel, value_up_kernel
        self._part_o = torch.empty(0, device=dev)
        self._part_ml = torch.empty(0, device=dev)
        self._ready = False

    def supports(self, rows: int) -> bool:
        return 1 <= rows <= self.max_rows

    def absorb(self, q: Tensor) -> Tensor:
        """The absorbed query q . W_uk: q [N, H, P] BF16 (the nope parts, any row stride) ->
        [N, H, L] BF16 (FP32 accumulation, one rounding) written token-major, as vLLM's MLA
        decode absorbs it: where each row's heads are adjacent (q_b's output), one
        block-diagonal skinny GEMM (`_absorption`), else a batched GEMM."""
        if self.w_uk is None:
            raise ValueError("SparseMlaDecode: built without w_uk, nothing to absorb with")
        n, h, p = q.shape
        if (self._absorb is not None and q.stride(2) == 1 and q.stride(1) == p
                and q.data_ptr() % 16 == 0 and self._absorb.supports(n)):  # fmt: skip
            return self._absorb(q.as_strided((n, h * p), (q.stride(0), 1))).view(n, h, self.lat)
        out = torch.empty(n, self.heads, self.lat, dtype=torch.bfloat16, device=q.device)
        torch.bmm(q.transpose(0, 1), self.w_uk, out=out.transpose(0, 1))
        return out

    def splits(self, rows: int, selected: int) -> int:
        """Splits of the selected tokens: enough CTAs for two an SM, at least one BW block
        each."""
        ctas = rows * -(-self.heads // BH)
        return max(1, min(-(-2 * self._sms // ctas), -(-selected // BW)))

    def prepare(self, tokens=None) -> None:
        """Compile both kernels (the value-up's row-at-a-time and tiled merges) and size the
        workspace for `max_rows` rows (the split count bounds rows x splits by the SMs),
        before any CUDA-graph capture."""
        dev, h, lat = self._device, self.heads, self.lat
        if self._absorb is not None:
            self._absorb.prepare(range(1, self.max_rows + 1) if tokens is None else tokens)
        self._room(max(r * self.splits(r, 1 << 16) for r in range(1, self.max_rows + 1)))
        cache = torch.zeros(1, 16, lat, dtype=torch.bfloat16, device=dev)
        for n in sorted({1, min(self.max_rows, ROWWISE_ROWS + 1)}):  # both merges
            q = torch.zeros(n, h, lat, dtype=torch.bfloat16, device=dev)
            idx = torch.zeros(n, 1, dtype=torch.int32, device=dev)
            self(q, cache, idx[:1], idx[:, 0], idx)
        self._ready = True

    def _room(self, rows_x_splits: int) -> None:
        need = rows_x_splits * self.heads * self.lat
        if self._part_o.numel() >= need:
            return
        if capturing():
            raise RuntimeError("SparseMlaDecode: workspace not prepared; call prepare() before "
                               "CUDA-graph capture")  # fmt: skip
        self._part_o = torch.empty(need, device=self._device)
        self._part_ml = torch.empty(2 * rows_x_splits * self.heads, device=self._device)

    def __call__(self, q_lat: Tensor, cache: Tensor, block_table: Tensor, request: Tensor,
                 indices: Tensor, *, out: Tensor | None = None) -> Tensor:  # fmt: skip
        """q_lat [N, H, L] BF16, cache [blocks, bs, L] BF16, block_table [R, B], request [N]
        (each row's request), indices [N, W] (token positions, -1: none), int32 or int64 ->
        [N, H, Vd] BF16 (`sparse_mla_decode_ref`)."""
        self._check(q_lat, cache, block_table, request, indices, out)
        if self._capturing_unprepared():
            raise RuntimeError("SparseMlaDecode: not prepared; call prepare() before capture")
        n, w = indices.shape
        splits = self.splits(n, w)
        self._room(n * splits)
        per_split = -(-w // splits)
        chunk = -(-per_split // BW) * BW  # tokens a split, whole BW blocks
        splits = -(-w // chunk)
        if out is None:
            out = torch.empty(n, self.heads, self.vd, dtype=torch.bfloat16, device=q_lat.device)
        self._split[(n, -(-self.heads // BH), splits)](
            q_lat, cache, block_table, request, indices, self._part_o, self._part_ml,
            n, self.heads, w, chunk, cache.shape[1], self.scale,
            q_lat.stride(0), q_lat.stride(1), cache.stride(0), cache.stride(1),
            block_table.stride(0), indices.stride(0),
            L=self.lat, BH=BH, BW=BW, INTERPRETER=self._interp, PDL=self._pdl, num_warps=WARPS,
            launch_pdl=self._pdl,
        )  # fmt: skip
        self._value_up[(self.heads, -(-self.vd // BV))](
            self._part_o, self._part_ml, self.w_uv, out,
            n, self.heads, self.vd, splits, self.w_uv.stride(0), self.w_uv.stride(1),
            out.stride(0), out.stride(1),
            L=self.lat, BN=BN, BV=BV, UNROLL=merge_unroll(self.heads), SB=SB,
            ROWWISE=rowwise(n, self.heads), INTERPRETER=self._interp, PDL=self._pdl,
            num_warps=WARPS, launch_pdl=self._pdl,
        )  # fmt: skip
        return out

    def _capturing_unprepared(self) -> bool:
        return not self._ready and capturing()

    def _check(self, q_lat, cache, block_table, request, indices, out) -> None:
        """Every problem with a call's inputs in one error (index ranges: outside capture)."""
        h, lat, problems = self.heads, self.lat, []
        n = q_lat.shape[0] if q_lat.dim() == 3 else -1
        if q_lat.dim() != 3 or q_lat.shape[1:] != (h, lat) or q_lat.dtype != torch.bfloat16 \
                or q_lat.stride(2) != 1:  # fmt: skip
            problems.append(f"q_lat: {tuple(q_lat.shape)} {q_lat.dtype}, expected [N, {h}, {lat}] "
                            "bfloat16")  # fmt: skip
        elif not self.supports(n):
            problems.append(f"q_lat: {n} rows, outside 1..{self.max_rows}")
        # Blocks at any stride (vLLM packs several layers' caches block by block), rows
        # inside a block at a uniform one.
        if cache.dim() != 3 or cache.shape[2] != lat or cache.dtype != torch.bfloat16 \
                or cache.stride(2) != 1:  # fmt: skip
            problems.append(f"cache: {tuple(cache.shape)} {cache.dtype}, expected [blocks, bs, "
                            f"{lat}] bfloat16, latents contiguous")  # fmt: skip
        problems += index_problems(block_table=(block_table, 2), request=(request, 1),
                                   indices=(indices, 2))  # fmt: skip
        if not problems and (request.shape[0] != n or indices.shape[0] != n):
            problems.append(f"request / indices: {request.shape[0]} / {indices.shape[0]} rows, "
                            f"q_lat has {n}")  # fmt: skip
        if out is not None and (tuple(out.shape) != (n, h, self.vd) or out.dtype != torch.bfloat16
                                or out.stride(2) != 1):  # fmt: skip
            problems.append(f"out: {tuple(out.shape)} {out.dtype}, expected [{n}, {h}, "
                            f"{self.vd}] bfloat16")  # fmt: skip
        if not problems and not capturing():  # host syncs: only outside capture
            bs, blocks = cache.shape[1], block_table.shape[1]
            if indices.numel() and indices.max() >= blocks * bs:
                problems.append(f"indices: a position past the block table ({blocks} x {bs})")
            problems += table_problems(request, block_table, cache.shape[0])
        if problems:
            raise ValueError("SparseMlaDecode: " + "; ".join(problems))
