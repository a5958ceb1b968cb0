"""What the reference model takes on its device, checked before anything is allocated: the
held shards' weights, and the caches sized by max_requests x max_context (an oversized
request count otherwise ends in the kernel's OOM killer, with no message at all).

    problem = fit_problem(geometry("tiny"), "cpu", max_requests=3, max_context=512, q=4)
"""

from __future__ import annotations

import math
import os

import torch

from .caches import allocate
from .config import Geometry, geometry
from .weights import model_specs, shard_shape

GiB = 2**30
# The named geometries from the largest shard to the smallest: what a refusal suggests.
FALLBACKS = ("flash-tp1-rank", "flash-tp2-rank", "flash-tp4-rank", "flash-tp8-rank", "tiny")


def weight_bytes(g: Geometry) -> int:
    """The held shards' weights: FP8 tensors one byte an element, the rest two (block scales
    and the few FP32 vectors are left out: under 1 % of any geometry)."""
    return len(g.ranks) * sum(
        math.prod(shard_shape(spec, g.tp_size)) * (1 if spec.fp8 else 2)
        for spec in model_specs(g).values()
    )


def cache_bytes(
    g: Geometry,
    *,
    max_requests: int,
    max_context: int,
    q: int = 1,
    block_size: int = 64,
    dtype: torch.dtype = torch.bfloat16,
    indexer_numerics: str = "vllm",
) -> int:
    """The caches, block table and state slots `ReferenceModel(...)` allocates for these
    arguments, counted on the meta device (so the count is allocate()'s own layout)."""
    blocks = math.ceil(max_context / block_size)
    mtp = [g.num_hidden_layers + k for k in range(g.num_nextn_predict_layers)]
    caches = allocate(
        g,
        num_slots=1 + max_requests * q,
        num_blocks=max_requests * blocks,
        num_requests=max_requests,
        block_size=block_size,
        device="meta",
        layers=list(range(g.num_hidden_layers)) + mtp,
        mla_layers=set(g.mla_layers) | set(mtp),
        dtype=dtype,
        q=q,
        indexer_numerics=indexer_numerics,
    )
    kinds = (caches.conv, caches.recurrent, caches.latent, caches.tail, caches.kpool)
    per_rank = sum(t.nbytes for kind in kinds for t in kind.values())
    tables = 8 * max_requests * (blocks + q)  # int64 block table and state slots
    return len(g.ranks) * per_rank + tables


def free_bytes(device: torch.device | str) -> int:
    """Memory free for new tensors on `device` (host: MemAvailable, which counts the page
    cache the kernel gives back; sysconf's free pages do not)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def fit_problem(
    g: Geometry, device: torch.device | str, *, max_requests: int, max_context: int, **kw
) -> str | None:
    """None when the model (weights + caches, `kw` as `cache_bytes`) fits `device`, else one
    line naming what it needs, what is free and what fits: fewer requests where the weights
    fit, else the largest named geometry that does."""
    free = free_bytes(device)

    def need(g: Geometry, requests: int) -> int:
        caches = cache_bytes(g, max_requests=requests, max_context=max_context, **kw)
        return weight_bytes(g) + caches

    total = need(g, max_requests)
    if total <= free:
        return None
    one = need(g, 1)
    if one <= free:
        per_request = need(g, 2) - one  # caches grow linearly in requests
        hint = f"at most {1 + (free - one) // per_request} requests of {max_context} tokens fit"
    else:
        fits = [
            name
            for name in FALLBACKS
            if geometry(name) != g and need(geometry(name), max_requests) <= free
        ]
        hint = (
            f"geometry '{fits[0]}' fits"
            if fits
            else f"no named geometry fits {max_requests} requests of {max_context} tokens"
        )
    weights = weight_bytes(g)
    return (
        f"{len(g.ranks)} of {g.tp_size} TP ranks need {total / GiB:.1f} GiB on "
        f"{torch.device(device)} (weights {weights / GiB:.1f} GiB, caches "
        f"{(total - weights) / GiB:.1f} GiB for {max_requests} requests of {max_context} "
        f"tokens), {free / GiB:.1f} GiB free: {hint}"
    )
