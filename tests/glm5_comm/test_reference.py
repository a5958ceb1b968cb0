"""glm5-comm's references under gloo on CPU, at 2 and 4 processes: every rank's result equals
the single-process math over all ranks' partials (summed in FP32 in rank order, rounded
once), bit for bit and the same on every rank — the mHC boundary above a BF16 partial and
above an unfinalized MoE partial, the last layer's head, the MTP layer's add + norm, the
vocab-parallel embedding's enorm / hnorm and the logits gather. Without a process group
each is the plain math (world size 1)."""

import pytest
import torch
from gloo_ranks import spawn_gloo

from glm5_comm import (
    all_reduce_boundary_ref,
    all_reduce_head_ref,
    all_reduce_norm_ref,
    all_reduce_ref,
    embed_norm_ref,
    logits_gather_ref,
    moe_partial_ref,
)
from glm5_kernels.mhc import MhcConfig, hc_fused_post_pre_ref, hc_head_ref, hc_post_ref
from glm5_kernels.moe import MoeRows
from glm5_kernels.norm import rms_norm_ref

M, D, K, V = 3, 64, 4, 40
CONFIG = MhcConfig(hc=4, hidden=D, rms_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20, norm_eps=1e-5)


def _inputs(world: int) -> dict:
    """Every rank's partials and the shared inputs, from one seed (each process draws all)."""
    gen = torch.Generator().manual_seed(world)

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=gen).to(dtype)

    def moe_rows() -> MoeRows:
        route_row = torch.randperm(M * K, generator=gen).view(M, K).int() + M
        route_row[0, 1] = -1  # a sentinel route: contributes nothing
        return MoeRows(randn(M + M * K, D), route_row, torch.rand(M, K, generator=gen),
                       torch.zeros(M, K, dtype=torch.int32))  # fmt: skip

    h = CONFIG.hc
    site = (randn(CONFIG.mix, h * D) / (h * D) ** 0.5, 0.5 + torch.rand(3, generator=gen),
            randn(CONFIG.mix), (1 + 0.1 * randn(D)).bfloat16())  # fmt: skip
    comb = torch.rand(M, h, h, generator=gen)
    ids = torch.randint(0, V, (M,), generator=gen)
    table = randn(V, D, dtype=torch.bfloat16)
    shard = V // world
    embeds = [table[ids] * ((ids // shard) == r)[:, None] for r in range(world)]  # vocab-parallel
    return {
        "partials": [randn(M, D, dtype=torch.bfloat16) for _ in range(world)],
        "moe": [moe_rows() for _ in range(world)],
        "streams": randn(M, h, D, dtype=torch.bfloat16),
        "post": 2 * torch.rand(M, h, generator=gen),
        "comb": comb / comb.sum(1, keepdim=True),
        "site": site,
        "residual": randn(M, D, dtype=torch.bfloat16),
        "embeds": embeds,
        "embedded": table[ids],
        "positions": torch.tensor([0, 5, 9]),
        "hidden": randn(M, D, dtype=torch.bfloat16),
        "logits": [randn(M, shard) for _ in range(world)],
    }


def _summed(parts) -> torch.Tensor:
    total = parts[0].float()
    for p in parts[1:]:
        total = total + p.float()
    return total.bfloat16()


def _check(rank: int, world: int) -> None:
    x = _inputs(world)
    s, p, c, (fn, scale, base, norm) = x["streams"], x["post"], x["comb"], x["site"]
    eps = {"rms_eps": CONFIG.rms_eps, "hc_eps": CONFIG.hc_eps,
           "sinkhorn_iters": CONFIG.sinkhorn_iters, "norm_eps": CONFIG.norm_eps}  # fmt: skip

    def same(got, want):
        for a, b in zip(got, want, strict=True) if isinstance(got, tuple) else [(got, want)]:
            assert a.dtype == b.dtype and torch.equal(a, b)

    y = _summed(x["partials"])
    assert torch.equal(all_reduce_ref(x["partials"][rank]), y)
    same(all_reduce_boundary_ref(x["partials"][rank], s, p, c, fn, scale, base, norm, CONFIG),
         hc_fused_post_pre_ref(y, s, p, c, fn, scale, base, norm, **eps))  # fmt: skip
    # An unfinalized MoE partial: each rank's FP32 weighted sum, rounded only after the sum.
    y_moe = _summed([moe_partial_ref(r) for r in x["moe"]])
    same(all_reduce_boundary_ref(x["moe"][rank], s, p, c, fn, scale, base, norm, CONFIG),
         hc_fused_post_pre_ref(y_moe, s, p, c, fn, scale, base, norm, **eps))  # fmt: skip
    same(all_reduce_head_ref(x["partials"][rank], s, p, c, norm, CONFIG),
         rms_norm_ref(hc_head_ref(hc_post_ref(y, s, p, c)), norm, CONFIG.norm_eps))  # fmt: skip
    residual = (y.float() + x["residual"].float()).bfloat16()
    same(all_reduce_norm_ref(x["partials"][rank], x["residual"], norm, 1e-5),
         (residual, rms_norm_ref(residual, norm, 1e-5)))  # fmt: skip
    # The vocab-parallel embedding: exactly one rank holds each row, so the sum is exact.
    want = torch.cat([rms_norm_ref(x["embedded"] * (x["positions"] != 0)[:, None], norm, 1e-5),
                      rms_norm_ref(x["hidden"], norm, 1e-5)], dim=-1)  # fmt: skip
    same(embed_norm_ref(x["embeds"][rank], x["positions"], x["hidden"], norm, norm, 1e-5), want)
    same(logits_gather_ref(x["logits"][rank]), torch.cat(x["logits"], dim=-1))


@pytest.mark.parametrize("world", [2, 4])
def test_references_under_gloo_equal_the_single_process_math(world):
    spawn_gloo(_check, world, world)


def test_world_size_one_is_the_plain_math():
    """No process group: the references are the math with no exchange; an unfinalized MoE
    partial is its FP32 sum rounded once, within the roundings `MoeRows.finalize` adds (it
    rounds the routed sum and the shared rows apart, then their sum: half an ulp of each)."""
    _check(0, 1)
    rows = _inputs(1)["moe"][0]
    got, staged = all_reduce_ref(rows).float(), rows.finalize().float()
    shared = rows.rows[:M].float()
    routed = moe_partial_ref(rows) - shared
    assert ((got - staged).abs() <= 2**-8 * (routed.abs() + shared.abs() + got.abs())).all()
