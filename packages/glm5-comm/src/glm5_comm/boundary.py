"""`AllReduceBoundary`: a TP-partial sublayer output all-reduced (`AllReduce`, one-shot over the
mailboxes) and the mHC boundary above it (glm5-kernels' `MhcBoundary`: post -> pre -> norm, or
the last layer's head) — today two launches with PDL between them, the reduced rows passed
through a buffer sized for max_tokens (capturable). World size 1: the boundary alone. Equal to
`all_reduce_boundary_ref` / `all_reduce_head_ref` within the boundary kernel's tolerances (the
all-reduce itself is bit-equal). One launch (the exchange inside the boundary kernel's phase
1) is the next step, to be judged against these two on GPUs."""

from __future__ import annotations

import torch
from torch import Tensor

from glm5_comm.allreduce import AllReduce, Mailbox
from glm5_kernels.mhc import MhcBoundary

__all__ = ["AllReduceBoundary"]


class AllReduceBoundary:
    def __init__(self, mailbox: Mailbox, boundary: MhcBoundary):
        if boundary.config.hidden != mailbox.hidden or boundary.max_tokens < mailbox.max_tokens:
            raise ValueError(
                f"AllReduceBoundary: the boundary (hidden {boundary.config.hidden}, max_tokens "
                f"{boundary.max_tokens}) does not cover the mailbox (hidden {mailbox.hidden}, "
                f"max_tokens {mailbox.max_tokens})"
            )
        self.reduce, self.boundary = AllReduce(mailbox), boundary
        self._y = torch.empty(mailbox.max_tokens, mailbox.hidden, dtype=torch.bfloat16,
                              device=mailbox.peers.device)  # fmt: skip

    def supports(self, m: int) -> bool:
        return self.reduce.supports(m)

    def prepare(self, tokens=None) -> None:
        self.reduce.prepare(tokens)
        self.boundary.prepare(tokens)

    def _reduced(self, partial: Tensor) -> Tensor:
        return self.reduce(partial, out=self._y[: partial.shape[0]])

    def post_pre(self, partial, streams, post, comb, fn, scale, base, norm_weight, *, out=None):
        """This rank's partial [T, D] BF16 summed over the ranks, posted into the streams,
        then the next pre and norm: (streams', post', comb', normed), as `MhcBoundary.post_pre`."""
        y = self._reduced(partial)
        return self.boundary.post_pre(y, streams, post, comb, fn, scale, base, norm_weight,
                                      out=out)  # fmt: skip

    def head(self, partial, streams, post, comb, norm_weight, *, out=None) -> Tensor:
        """The last sublayer's partial summed, posted, the streams' mean and the final norm."""
        return self.boundary.head(self._reduced(partial), streams, post, comb, norm_weight,
                                  out=out)  # fmt: skip
