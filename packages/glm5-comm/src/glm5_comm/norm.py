"""The MTP layer's all-reduces with the norms above them, each one launch, a CTA a whole row
(the norm needs no second pass); world size 1: the norms, no exchange.

`AllReduceNorm`: a TP-partial sublayer output all-reduced through the mailboxes, added to the
residual, RMSNorm'd — `all_reduce_norm_ref` (the residual bit for bit; the normed row within
a BF16 rounding: the kernel's 1/sqrt and the row sum's order differ from torch's).
`EmbedNorm`: the vocab-parallel embedding's partial rows all-reduced, zeroed at position 0,
enorm'd, beside hnorm(hidden) — `embed_norm_ref`, the MTP eh_proj input."""

from __future__ import annotations

import torch
from torch import Tensor

from glm5_comm.allreduce import Mailbox
from glm5_kernels.launch import capturing, interpreting, use_pdl

__all__ = ["AllReduceNorm", "EmbedNorm"]


class _RowOp:
    """What the ops a CTA a whole row share: the mailbox, their kernel (`kernel_name`), the
    row checks and the capture guard, the launch options."""

    kernel_name = ""

    def __init__(self, mailbox: Mailbox):
        self.mailbox = mailbox
        self._interp, self._pdl = interpreting(), use_pdl(mailbox.peers.device)
        from glm5_comm import triton_exchange  # Triton: an extra

        self._kernel = getattr(triton_exchange, self.kernel_name)
        self._ready = False

    def supports(self, m: int) -> bool:
        return 1 <= m <= self.mailbox.max_tokens

    def _rows(self, named: list[tuple[str, Tensor]], problems: list[str]) -> int:
        """M of the [M, hidden] BF16 rows `named` (the first sets M), or one error naming
        every problem (with those the caller found)."""
        d, first = self.mailbox.hidden, named[0][1]
        m = first.shape[0] if first.dim() == 2 else -1
        for name, x in named:
            if x.dim() != 2 or tuple(x.shape) != (m, d) or x.dtype != torch.bfloat16 \
                    or x.stride(1) != 1:  # fmt: skip
                problems.append(f"{name}: {tuple(x.shape)} {x.dtype}, expected [M, {d}] bfloat16")
        if not problems and not self.supports(m):
            problems.append(f"M={m} rows, outside 1..{self.mailbox.max_tokens} (the mailbox's "
                            "max_tokens)")  # fmt: skip
        if problems:
            raise ValueError(f"{type(self).__name__}: " + "; ".join(problems))
        if not self._ready and capturing():
            raise RuntimeError(f"{type(self).__name__}: not prepared before CUDA-graph capture")
        return m

    def _meta(self) -> dict:
        mb = self.mailbox
        return dict(WORLD=mb.world, BD=1 << (mb.hidden - 1).bit_length(),
                    INTERPRETER=self._interp, PDL=self._pdl, num_warps=8,
                    launch_pdl=self._pdl)  # fmt: skip


class AllReduceNorm(_RowOp):
    kernel_name = "all_reduce_norm_kernel"

    def __init__(self, mailbox: Mailbox, norm_weight: Tensor, eps: float):
        if tuple(norm_weight.shape) != (mailbox.hidden,):
            raise ValueError(f"AllReduceNorm: norm_weight {tuple(norm_weight.shape)}, expected "
                             f"[{mailbox.hidden}]")  # fmt: skip
        super().__init__(mailbox)
        self.weight, self.eps = norm_weight, float(eps)

    def prepare(self, tokens=None) -> None:
        """Compile before CUDA-graph capture: one call on zeros (every rank alike)."""
        z = torch.zeros(1, self.mailbox.hidden, dtype=torch.bfloat16,
                        device=self.mailbox.peers.device)  # fmt: skip
        self(z, z.clone())
        self._ready = True

    def __call__(self, partial: Tensor, residual: Tensor, *, out=None) -> tuple[Tensor, Tensor]:
        """partial, residual [M, hidden] BF16 -> (residual', normed), each [M, hidden] BF16
        (`out`: the two, to write into)."""
        mb, d = self.mailbox, self.mailbox.hidden
        named = [("partial", partial), ("residual", residual)]
        if out is not None:
            named += [("out[0]", out[0]), ("out[1]", out[1])]
        m = self._rows(named, [])
        res_out, normed = out if out is not None else (torch.empty_like(residual),
                                                       torch.empty_like(residual))  # fmt: skip
        self._kernel[(m,)](
            partial, residual, res_out, normed, self.weight, mb.peers, mb.state,
            m, d, partial.stride(0), residual.stride(0), res_out.stride(0), normed.stride(0),
            mb.max_tokens * d, mb.rank, self.eps, **self._meta(),
        )  # fmt: skip
        return res_out, normed


class EmbedNorm(_RowOp):
    kernel_name = "embed_norm_kernel"

    def __init__(self, mailbox: Mailbox, enorm_weight: Tensor, hnorm_weight: Tensor, eps: float):
        d = mailbox.hidden
        if tuple(enorm_weight.shape) != (d,) or tuple(hnorm_weight.shape) != (d,):
            raise ValueError(f"EmbedNorm: norm weights {tuple(enorm_weight.shape)} / "
                             f"{tuple(hnorm_weight.shape)}, expected [{d}]")  # fmt: skip
        super().__init__(mailbox)
        self.enorm, self.hnorm, self.eps = enorm_weight, hnorm_weight, float(eps)

    def prepare(self, tokens=None) -> None:
        """Compile before CUDA-graph capture: one call on zeros (every rank alike)."""
        dev = self.mailbox.peers.device
        z = torch.zeros(1, self.mailbox.hidden, dtype=torch.bfloat16, device=dev)
        self(z, torch.zeros(1, dtype=torch.int64, device=dev), z.clone())
        self._ready = True

    def __call__(self, embed_partial: Tensor, positions: Tensor, hidden: Tensor) -> Tensor:
        """embed_partial, hidden [M, hidden] BF16, positions [M] int -> [M, 2 * hidden] BF16:
        enorm(embedding, 0 at position 0) | hnorm(hidden)."""
        mb, d = self.mailbox, self.mailbox.hidden
        rows = embed_partial.shape[0] if embed_partial.dim() == 2 else -1
        problems = []
        if tuple(positions.shape) != (rows,) or positions.dtype not in (torch.int32, torch.int64):
            problems.append(f"positions: {tuple(positions.shape)} {positions.dtype}, expected "
                            f"[{rows}] int")  # fmt: skip
        m = self._rows([("embed_partial", embed_partial), ("hidden", hidden)], problems)
        out = torch.empty(m, 2 * d, dtype=torch.bfloat16, device=hidden.device)
        self._kernel[(m,)](
            embed_partial, positions.contiguous(), hidden, out, self.enorm, self.hnorm,
            mb.peers, mb.state, m, d, embed_partial.stride(0), hidden.stride(0),
            out.stride(0), mb.max_tokens * d, mb.rank, self.eps, **self._meta(),
        )  # fmt: skip
        return out
