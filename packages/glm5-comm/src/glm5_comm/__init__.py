"""glm5-comm: the NVLink one-shot all-reduce on torch symmetric memory, fused with the mHC
boundary, residual + RMSNorm and the embedding; the logits all-gather. Each has a
torch.distributed reference and a world-size-1 path. Today: the references
(`glm5_comm.reference`); over peer mailboxes (`Mailbox`), each one launch: the all-reduce
(`AllReduce`), the all-reduce inside the mHC boundary (`AllReduceBoundary`), the all-reduce
+ residual + RMSNorm (`AllReduceNorm`), the MTP eh_proj input (`EmbedNorm`) and the logits
gather (`LogitsGather`) — CPU-checked under the Triton interpreter, not yet run on GPUs."""

from glm5_comm.allreduce import AllReduce, ExchangeTimeout, Mailbox, MailboxWatch
from glm5_comm.boundary import AllReduceBoundary
from glm5_comm.gather import LogitsGather
from glm5_comm.norm import AllReduceNorm, EmbedNorm
from glm5_comm.reference import (
    all_reduce_boundary_ref,
    all_reduce_head_ref,
    all_reduce_norm_ref,
    all_reduce_ref,
    embed_norm_ref,
    logits_gather_ref,
    moe_partial_ref,
)

__version__ = "0.1.0"

__all__ = [
    "AllReduce",
    "AllReduceBoundary",
    "AllReduceNorm",
    "EmbedNorm",
    "ExchangeTimeout",
    "LogitsGather",
    "Mailbox",
    "MailboxWatch",
    "all_reduce_boundary_ref",
    "all_reduce_head_ref",
    "all_reduce_norm_ref",
    "all_reduce_ref",
    "embed_norm_ref",
    "logits_gather_ref",
    "moe_partial_ref",
]
