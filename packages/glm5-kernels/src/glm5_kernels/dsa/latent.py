"""The MLA layer's q_a / kv_a RMSNorms and its latent cache write in one launch:
`LatentWrite`, the contract of `latent_write_ref` (`triton_latent`: a CTA per token row).
Stock, they are two torch RMSNorms (~6 kernels each) and an `index_put` with its casts."""

from __future__ import annotations

import torch
from torch import Tensor

from glm5_kernels.launch import interpreting, next_pow2, use_pdl
from glm5_kernels.norm import rms_norm_ref

__all__ = ["LatentWrite", "latent_write_ref"]


def latent_write_ref(q_a: Tensor, kv_a: Tensor, q_norm: Tensor, kv_norm: Tensor, eps: float,
                     latent: Tensor, slots: Tensor) -> Tensor:  # fmt: skip
    """q_a [N, Q], kv_a [N, L] BF16, the norms' weights [Q], [L], latent [S, L] (written at
    `slots` [N]; -1: a padding row, not written) -> the normed q_a [N, Q]: `rms_norm_ref` of
    each, as the model runs them. No host sync (the planned-step tests capture it): a
    padding row writes what another row writes there (the first kept row's slot and value,
    or slot 0's own value where no row is kept), so the one scatter changes only the kept
    rows' slots."""
    rows = rms_norm_ref(kv_a, kv_norm, eps).to(latent.dtype)
    keep = slots >= 0
    first = keep.int().argmax().view(1)  # the first kept row (0 where there is none)
    anyone = keep.any()
    slot = torch.where(keep, slots, torch.where(anyone, slots.index_select(0, first), 0))
    stand_in = torch.where(anyone, rows.index_select(0, first)[0], latent[0])
    latent.index_copy_(0, slot.long(), torch.where(keep[:, None], rows, stand_in[None, :]))
    return rms_norm_ref(q_a, q_norm, eps)


class LatentWrite:
    """An MLA layer's input norms and latent write: q_a_layernorm [Q] and kv_a_layernorm
    [L] BF16 weights, their eps; steps of up to `max_rows` token rows."""

    def __init__(self, q_norm: Tensor, kv_norm: Tensor, eps: float, *, max_rows: int = 64):
        problems = [f"{n}: {t.dtype}, expected torch.bfloat16"
                    for n, t in (("q_norm", q_norm), ("kv_norm", kv_norm))
                    if t.dtype != torch.bfloat16]  # fmt: skip
        problems += [f"{n}: shape {tuple(t.shape)}, expected one dimension"
                     for n, t in (("q_norm", q_norm), ("kv_norm", kv_norm))
                     if t.dim() != 1]  # fmt: skip
        if problems:
            raise ValueError("LatentWrite: " + "; ".join(problems))
        self.q_norm, self.kv_norm = q_norm.contiguous(), kv_norm.contiguous()
        self.eps, self.max_rows = float(eps), max_rows
        self.q_dim, self.latent_dim = q_norm.numel(), kv_norm.numel()
        dev = q_norm.device
        self._pdl, self._interp = use_pdl(dev), interpreting()
        from glm5_kernels.dsa.triton_latent import latent_write_kernel

        self._kernel = latent_write_kernel

    def supports(self, rows: int) -> bool:
        return 1 <= rows <= self.max_rows

    def prepare(self, tokens=None) -> None:
        """Compile the kernel (one specialization) before any CUDA-graph capture."""
        dev, q, ld = self.q_norm.device, self.q_dim, self.latent_dim
        x = torch.zeros(1, q + ld, dtype=torch.bfloat16, device=dev)
        latent = torch.zeros(1, ld, dtype=torch.bfloat16, device=dev)
        self(x[:, :q], x[:, q:], latent, torch.zeros(1, dtype=torch.int64, device=dev))

    def __call__(self, q_a: Tensor, kv_a: Tensor, latent: Tensor, slots: Tensor) -> Tensor:
        """q_a [N, Q] and kv_a [N, L] BF16, columns of one tensor's rows (the fused q_a | kv_a
        projection's output: kv_a starting where q_a ends), latent [S, L] BF16 (written at
        `slots` [N] int64, each in range or -1 (vLLM's padding rows: not written); any
        stride: a draft step's are a column of its verify's) -> the normed q_a [N, Q] BF16."""
        self._check(q_a, kv_a, latent, slots)
        n = q_a.shape[0]
        out = torch.empty(n, self.q_dim, dtype=torch.bfloat16, device=q_a.device)
        self._kernel[(n,)](
            q_a, self.q_norm, self.kv_norm, slots, out, latent, q_a.stride(0), slots.stride(0),
            self.eps,
            Q=self.q_dim, L=self.latent_dim, BQ=next_pow2(self.q_dim),
            BL=next_pow2(self.latent_dim), INTERPRETER=self._interp, PDL=self._pdl,
            num_warps=4, launch_pdl=self._pdl,
        )  # fmt: skip
        return out

    def _check(self, q_a, kv_a, latent, slots) -> None:
        """One error naming every problem with a call's tensors."""
        q, ld, problems = self.q_dim, self.latent_dim, []
        n = q_a.shape[0] if q_a.dim() == 2 else -1
        if q_a.dim() != 2 or q_a.shape[1] != q or kv_a.dim() != 2 or kv_a.shape != (n, ld):
            problems.append(f"q_a {tuple(q_a.shape)}, kv_a {tuple(kv_a.shape)}: expected "
                            f"[N, {q}] and [N, {ld}]")  # fmt: skip
        elif not self.supports(n):
            problems.append(f"{n} rows: this op takes 1..{self.max_rows}")
        for name, t in (("q_a", q_a), ("kv_a", kv_a), ("latent", latent)):
            if t.dtype != torch.bfloat16:
                problems.append(f"{name}: {t.dtype}, expected torch.bfloat16")
        if q_a.dim() == 2 and kv_a.dim() == 2 and (
            q_a.stride(1) != 1 or kv_a.stride(1) != 1
            or (n > 1 and kv_a.stride(0) != q_a.stride(0))  # one row: any stride
            or kv_a.data_ptr() != q_a.data_ptr() + q * q_a.element_size()
        ):  # fmt: skip
            problems.append("kv_a: the columns right after q_a's in the same rows expected")
        if latent.dim() != 2 or latent.shape[1] != ld or not latent.is_contiguous():
            problems.append(f"latent {tuple(latent.shape)}: a contiguous [slots, {ld}] expected")
        if slots.dtype != torch.int64 or tuple(slots.shape) != (n,):
            problems.append(f"slots: {slots.dtype} {tuple(slots.shape)}, expected int64 [{n}]")
        devices = {t.device for t in (q_a, latent, slots, self.q_norm)}
        if len(devices) > 1:
            problems.append(f"tensors on {sorted(map(str, devices))}: one device expected")
        if problems:
            raise ValueError("LatentWrite: " + "; ".join(problems))
