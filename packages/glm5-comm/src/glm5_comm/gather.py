"""`LogitsGather`: each rank's vocab shard of the logits [M, S] FP32 gathered into full rows
[M, world * S] on every rank, in one launch through FP32 mailboxes (`Mailbox(dtype=int32)`,
the sentinel a NaN payload no arithmetic makes) — equal to `logits_gather_ref` bit for bit
(a gather moves values: NaNs stay NaNs). World size 1: the shard is the row."""

from __future__ import annotations

import torch
from torch import Tensor

from glm5_comm.allreduce import Mailbox
from glm5_kernels.gemm.linear import _capturing, _pdl

__all__ = ["LogitsGather"]


class LogitsGather:
    def __init__(self, mailbox: Mailbox, *, block_rows: int = 16, block_cols: int = 1024):
        if mailbox.dtype != torch.int32:
            raise ValueError(f"LogitsGather: a mailbox of {mailbox.dtype}, FP32 rows need int32")
        self.mailbox = mailbox
        self.bm, self.bs = block_rows, min(block_cols, 1 << (mailbox.hidden - 1).bit_length())
        self._pdl = _pdl(mailbox.peers.device)
        if mailbox.world > 1:
            from glm5_comm.triton_exchange import logits_gather_kernel  # Triton: an extra

            self._kernel = logits_gather_kernel
        self._ready: set[int] = set()

    def supports(self, m: int) -> bool:
        return 1 <= m <= self.mailbox.max_tokens

    def _tile(self, m: int) -> int:
        return min(self.bm, 1 << (m - 1).bit_length())

    def prepare(self, tokens=None) -> None:
        """Compile every row tile the step sizes use (every rank alike), before capture."""
        if self.mailbox.world == 1:
            return
        sizes = {self._tile(m): m for m in tokens or range(1, self.mailbox.max_tokens + 1)}
        for m in sorted(sizes.values()):
            self(torch.zeros(m, self.mailbox.hidden, device=self.mailbox.peers.device))

    def __call__(self, shard: Tensor, out: Tensor | None = None) -> Tensor:
        """shard [M, S] FP32 (S: the mailbox's hidden) -> [M, world * S] FP32."""
        mb = self.mailbox
        m = shard.shape[0] if shard.dim() == 2 else -1
        full = (m, mb.world * mb.hidden)
        problems = []
        if shard.dim() != 2 or shard.shape[1] != mb.hidden or shard.dtype != torch.float32 \
                or shard.stride(1) != 1:  # fmt: skip
            problems.append(f"shard: {tuple(shard.shape)} {shard.dtype}, expected [M, "
                            f"{mb.hidden}] float32")  # fmt: skip
        elif not self.supports(m):
            problems.append(f"M={m} rows, outside 1..{mb.max_tokens} (the mailbox's max_tokens)")
        if out is not None and (tuple(out.shape) != full or out.dtype != torch.float32
                                or out.stride(1) != 1):  # fmt: skip
            problems.append(f"out: {tuple(out.shape)} {out.dtype}, expected {list(full)} float32")
        if problems:
            raise ValueError("LogitsGather: " + "; ".join(problems))
        if mb.world == 1:
            return shard if out is None else out.copy_(shard)
        if out is None:
            out = torch.empty(full, dtype=torch.float32, device=shard.device)
        bm = self._tile(m)
        if bm not in self._ready:
            if _capturing():
                raise RuntimeError(f"LogitsGather: {m} rows not prepared before capture")
            self._ready.add(bm)
        grid = (-(-m // bm), -(-mb.hidden // self.bs))
        self._kernel[grid](
            shard, out, mb.peers, mb.step, mb.arrive, m, mb.hidden, shard.stride(0),
            out.stride(0), mb.max_tokens * mb.hidden, mb.rank,
            WORLD=mb.world, BM=bm, BS=self.bs, PDL=self._pdl, num_warps=4,
            launch_pdl=self._pdl,
        )  # fmt: skip
        return out
