"""`LogitsGather`: each rank's vocab shard of the logits [M, S] FP32 gathered into full rows
[M, world * S] on every rank, in one launch through FP32 mailboxes (`Mailbox(dtype=int32)`,
the sentinel a NaN payload no arithmetic makes) — equal to `logits_gather_ref` bit for bit
(a gather moves values: NaNs stay NaNs). World size 1: the shard is the row."""

from __future__ import annotations

import torch
from torch import Tensor

from glm5_comm.allreduce import Mailbox, TiledExchange

__all__ = ["LogitsGather"]


class LogitsGather(TiledExchange):
    kernel_name = "logits_gather_kernel"
    rows_dtype = torch.float32

    def __init__(self, mailbox: Mailbox, *, block_rows: int = 16, block_cols: int = 1024):
        super().__init__(mailbox, block_rows=block_rows, block_cols=block_cols)

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
        out = torch.empty(full, dtype=torch.float32, device=shard.device) if out is None else out
        return self._launch(shard, out, BS=self.bd)
