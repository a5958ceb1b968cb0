"""The peer-mailbox exchange kernels are built from (`triton_exchange`: Triton device
functions, imported where a kernel uses them): a rank's tile pushed into every peer's mailbox
and the peers' tiles polled until written — Lamport-style, the data is its own flag, each
value the sentinel until a peer writes it. glm5-comm owns the mailboxes (torch symmetric
memory) and the collectives; the mHC boundary kernel fuses the all-reduce into its first
phase with these functions.

Host constants (importable without Triton): the sentinels, a value no sender ever writes."""

SENTINEL = -32768  # 0x8000, BF16 -0.0 (a sender sends -0.0 as +0.0): BF16 rows
SENTINEL32 = -1  # 0xFFFFFFFF, a NaN payload no arithmetic makes: FP32 rows

__all__ = ["SENTINEL", "SENTINEL32"]
