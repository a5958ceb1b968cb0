"""The indexer's pool write and query rotation of a step in one launch: `KpoolWrite`, the
contract of `kpool_write_ref` (`triton_kpool`: a CTA per token row)."""

from __future__ import annotations

import torch
from torch import Tensor

from glm5_kernels.dsa.checks import INTS, paged
from glm5_kernels.dsa.reference import _hadamard
from glm5_kernels.launch import interpreting, use_pdl

__all__ = ["KpoolWrite"]


class KpoolWrite:
    """A DSA layer's pool write: `heads` indexer heads of `head_dim` (a power of two >= 16),
    pools of `kpool` tokens in blocks of `block_size`, learned per-slot bias `ape` [kpool,
    head_dim]; steps of up to `max_rows` token rows.

    `key_norm` (weight [head_dim], bias [head_dim], eps): the op takes the keys and gate
    scores as one projection's FP32 sums and applies what lies between that projection and
    the pool write inside its kernel: both rounded to BF16 (a BF16 GEMM's output), the key
    LayerNormed in FP32 and rounded (`index_keys_ref`) -- no norm or cast kernels between them."""

    def __init__(self, heads: int, head_dim: int, ape: Tensor, *, kpool: int, block_size: int,
                 max_rows: int = 64,
                 key_norm: tuple[Tensor, Tensor, float] | None = None):  # fmt: skip
        problems = []
        if head_dim < 16 or head_dim & (head_dim - 1):
            problems.append(f"head_dim={head_dim}: a power of two >= 16 expected")
        if kpool < 1 or kpool & (kpool - 1) or block_size % kpool:
            problems.append(f"kpool={kpool}, block_size={block_size}: kpool a power of two "
                            "dividing the block size")  # fmt: skip
        if tuple(ape.shape) != (kpool, head_dim):
            problems.append(f"ape: {tuple(ape.shape)}, expected ({kpool}, {head_dim})")
        if key_norm is not None:
            w, b, eps = key_norm
            for name, t in (("weight", w), ("bias", b)):
                if tuple(t.shape) != (head_dim,) or not t.is_floating_point() \
                        or t.device != ape.device:  # fmt: skip
                    problems.append(
                        f"key_norm {name}: {tuple(t.shape)} {t.dtype} on "
                        f"{t.device}, expected [{head_dim}] float on {ape.device}"
                    )
            if not eps > 0:
                problems.append(f"key_norm eps={eps}: must be > 0")
        if problems:
            raise ValueError("KpoolWrite: " + "; ".join(problems))
        self.key_norm = None
        if key_norm is not None:  # FP32 once: the kernel reads them as they are
            w, b, eps = key_norm
            self.key_norm = (w.float().contiguous(), b.float().contiguous(), float(eps))
        self.heads, self.head_dim, self.kpool, self.block_size = heads, head_dim, kpool, block_size
        self.max_rows, self.ape = max_rows, ape.contiguous()
        dev = ape.device
        # The Hadamard matrix as its signs (BF16, exact) and one scale: see triton_kpool.
        self._sign = _hadamard(head_dim, str(dev)).sign().bfloat16().contiguous()
        self._pdl, self._interp = use_pdl(dev), interpreting()
        from glm5_kernels.dsa.triton_kpool import kpool_write_kernel

        self._kernel = kpool_write_kernel

    def supports(self, rows: int) -> bool:
        return 1 <= rows <= self.max_rows

    def prepare(self, tokens=None) -> None:
        """Compile the kernel (one specialization) before any CUDA-graph capture: one call
        on scratch caches (a token completing a pool, so every path is built)."""
        dev, hd, kp = self.ape.device, self.head_dim, self.kpool
        z = torch.zeros(1, 1, hd, dtype=self._input_dtype, device=dev)
        q = torch.zeros(1, 1, self.heads, hd, dtype=torch.bfloat16, device=dev)
        tail = torch.zeros(1, 2, 2 * kp, hd, dtype=torch.bfloat16, device=dev)
        pages = torch.zeros(1, self.block_size // kp, hd + 4, dtype=torch.uint8, device=dev)
        zero = torch.zeros(1, 1, dtype=torch.int32, device=dev)
        self(z, z, q, tail, pages, zero, zero + kp - 1, zero[0])

    @property
    def _input_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.key_norm is None else torch.float32

    def __call__(self, k: Tensor, gate: Tensor, q: Tensor, tail: Tensor, pages: Tensor,
                 block_table: Tensor, positions: Tensor,
                 tail_rows: Tensor) -> tuple[Tensor, Tensor]:  # fmt: skip
        """k, gate [R, T, hd] BF16 (with key_norm: FP32 sums; rows of unit columns at uniform
        strides), q [R, T, H, hd] BF16, tail [rows, 2,
        ring, hd] BF16 and pages [blocks, S, hd + 4] uint8 (written), block_table [R, B],
        positions [R, T], tail_rows [R] (-1: a padding request, which writes nothing) ->
        (FP8 queries [R, T, H, hd], scales [R, T, H])."""
        self._check(k, gate, q, tail, pages, block_table, positions, tail_rows)
        r, t, hd = k.shape
        h = self.heads
        q8 = torch.empty(r, t, h, hd, dtype=torch.float8_e4m3fn, device=k.device)
        qs = torch.empty(r, t, h, dtype=torch.float32, device=k.device)
        norm_w, norm_b, eps = self.key_norm or (self.ape, self.ape, 1.0)  # (unread unless RAW)
        self._kernel[(r * t,)](
            k, gate, q, tail, pages, pages.view(torch.float32), self.ape, self._sign,
            norm_w, norm_b, block_table, positions, tail_rows, q8, qs,
            t, tail.shape[2], pages.shape[1], pages.stride(0), self.block_size, hd**-0.5, eps,
            _row_stride(k), _row_stride(gate), _row_stride(q), q.stride(2), tail.stride(0),
            tail.stride(1), block_table.stride(0),
            IH=max(16, 1 << (h - 1).bit_length()), H=h, HD=hd, KP=self.kpool,
            RAW=self.key_norm is not None, INTERPRETER=self._interp, PDL=self._pdl,
            num_warps=4, launch_pdl=self._pdl,
        )  # fmt: skip
        return q8, qs

    def _check(self, k, gate, q, tail, pages, block_table, positions, tail_rows) -> None:
        """Every problem with a call's inputs in one error."""
        h, hd, problems = self.heads, self.head_dim, []
        rt = tuple(k.shape[:2]) if k.dim() == 3 else None
        dtype = self._input_dtype
        for name, x in (("k", k), ("gate", gate)):
            if x.dim() != 3 or x.shape[2] != hd or x.dtype != dtype or x.stride(2) != 1 \
                    or not _uniform_rows(x):  # fmt: skip
                problems.append(f"{name}: {tuple(x.shape)} {x.dtype}, expected [R, T, {hd}] "
                                f"{dtype} with uniform row strides")  # fmt: skip
        if rt is not None and not self.supports(rt[0] * rt[1]):
            problems.append(f"k: {rt[0] * rt[1]} rows, outside 1..{self.max_rows}")
        if q.dim() != 4 or q.shape[2:] != (h, hd) or q.dtype != torch.bfloat16 \
                or q.stride(3) != 1 or not _uniform_rows(q):  # fmt: skip
            problems.append(f"q: {tuple(q.shape)} {q.dtype}, expected [R, T, {h}, {hd}] "
                            "bfloat16 with uniform row strides")  # fmt: skip
        ring = tail.shape[2] if tail.dim() == 4 else 0
        if tail.dim() != 4 or tail.shape[1] != 2 or tail.shape[3] != hd \
                or tail.dtype != torch.bfloat16 or tail.stride(3) != 1 \
                or tail.stride(2) != hd:  # fmt: skip
            problems.append(f"tail: {tuple(tail.shape)} {tail.dtype}, expected [rows, 2, ring, "
                            f"{hd}] bfloat16, slots contiguous")  # fmt: skip
        s = self.block_size // self.kpool
        if not paged(pages, hd) or pages.shape[1] != s:
            problems.append(f"pages: {tuple(pages.shape)} {pages.dtype} strides "
                            f"{pages.stride()}, expected [blocks, {s}, {hd + 4}] uint8, each "
                            "block's page contiguous at a 4-byte aligned block stride")  # fmt: skip
        if rt is not None and ring and ring < self.kpool + rt[1] - 1:
            problems.append(f"tail: a ring of {ring} cannot hold a pool of {self.kpool} and "
                            f"{rt[1]} tokens a request")  # fmt: skip
        for name, x, shape in (("block_table", block_table, None), ("positions", positions, rt),
                               ("tail_rows", tail_rows, rt[:1] if rt else None)):  # fmt: skip
            bad = x.dtype not in INTS or not x.is_contiguous()
            if bad or (shape is not None and tuple(x.shape) != shape):
                problems.append(f"{name}: {tuple(x.shape)} {x.dtype}, expected contiguous int"
                                + (f" {shape}" if shape else ""))  # fmt: skip
        if problems:
            raise ValueError("KpoolWrite: " + "; ".join(problems))


def _uniform_rows(x: Tensor) -> bool:
    """Whether x [R, T, ...]'s R * T token rows sit at one stride (`_row_stride`)."""
    return x.shape[1] == 1 or x.shape[0] == 1 or x.stride(0) == x.shape[1] * x.stride(1)


def _row_stride(x: Tensor) -> int:
    """The stride between x [R, T, ...]'s token rows (row n = request n // T, token n % T)."""
    return x.stride(0) if x.shape[1] == 1 else x.stride(1)
