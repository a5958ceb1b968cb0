"""`AllReduceBoundary`: a TP-partial sublayer output all-reduced and the mHC boundary above it
(post -> pre -> norm, or the last layer's head) in **one launch**: glm5-kernels'
`MhcBoundary` with this rank's mailbox as its `exchange` — its first phase sums every rank's
tile of the partial through the peer mailboxes (rank order, one rounding), then runs the
boundary on it. Equal to `all_reduce_boundary_ref` / `all_reduce_head_ref` within the
boundary kernel's tolerances (the sum itself is bit-equal to `all_reduce_ref`'s). World size
1: the boundary alone."""

from __future__ import annotations

import torch
from torch import Tensor

from glm5_comm.allreduce import Mailbox
from glm5_kernels.mhc import MhcBoundary

__all__ = ["AllReduceBoundary"]


class AllReduceBoundary:
    def __init__(self, mailbox: Mailbox, boundary: MhcBoundary):
        problems = []
        if boundary.config.hidden != mailbox.hidden or boundary.max_tokens < mailbox.max_tokens:
            problems.append(
                f"the boundary (hidden {boundary.config.hidden}, max_tokens "
                f"{boundary.max_tokens}) does not cover the mailbox (hidden {mailbox.hidden}, "
                f"max_tokens {mailbox.max_tokens})"
            )
        if mailbox.dtype != torch.int16:
            problems.append(f"a mailbox of {mailbox.dtype}, BF16 rows need int16")
        if problems:
            raise ValueError("AllReduceBoundary: " + "; ".join(problems))
        self.mailbox, self.boundary = mailbox, boundary
        self._exchange = mailbox if mailbox.world > 1 else None

    def supports(self, m: int) -> bool:
        return 1 <= m <= self.mailbox.max_tokens

    def prepare(self, tokens=None) -> None:
        """Compile every boundary for the step sizes (every rank alike: each call exchanges),
        before CUDA-graph capture."""
        self.boundary.prepare(tokens or range(1, self.mailbox.max_tokens + 1), self._exchange)

    def expand_pre(self, partial, fn, scale, base, norm_weight, *, out=None):
        """This rank's vocab-parallel embedding partial [T, D] BF16 (a token's row on the rank
        holding it, zeros elsewhere) summed — exact — and expanded into the streams, then
        the first pre and norm, as `MhcBoundary.expand_pre`."""
        return self.boundary.expand_pre(partial, fn, scale, base, norm_weight, out=out,
                                        exchange=self._exchange)  # fmt: skip

    def post_pre(self, partial, streams, post, comb, fn, scale, base, norm_weight, *, out=None):
        """This rank's partial [T, D] BF16 summed over the ranks, posted into the streams,
        then the next pre and norm: (streams', post', comb', normed), as `MhcBoundary.post_pre`."""
        return self.boundary.post_pre(partial, streams, post, comb, fn, scale, base, norm_weight,
                                      out=out, exchange=self._exchange)  # fmt: skip

    def head(self, partial, streams, post, comb, norm_weight, *, out=None) -> Tensor:
        """The last sublayer's partial summed, posted, the streams' mean and the final norm."""
        return self.boundary.head(partial, streams, post, comb, norm_weight, out=out,
                                  exchange=self._exchange)  # fmt: skip
