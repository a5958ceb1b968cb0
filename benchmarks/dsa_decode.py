"""The DSA layer's stages at GLM-5.3-Flash's shapes:

- `dsa_indexer`: the selection (`IndexerTopk`, one launch) — 32 indexer heads of 128 score
  every visible pool of 16 tokens in vLLM's FP8 pages, the top 2048 tokens + the 15-token
  tail selected — vs `index_topk_ref` (torch); floor: each row's pages, queries and output;
- `dsa_kpool`: the pool write (`KpoolWrite`, one launch: the ring, each completed pool
  into vLLM's FP8 pages, the queries rotated and cast) vs `kpool_write_ref`;
- `dsa_attn`: the sparse MLA decode (attention over the selection + the value-up,
  `SparseMlaDecode`, two launches) — latent 512, value dim 256, blocks of 64 tokens — for 64
  heads (TP 1) and 16 (a TP-4 rank) vs `sparse_mla_decode_ref` (the reference backbone's MLA
  core); floor: every row's selected latents (its own selection: rows of one request
  overlap, but a kernel reading them per row is what the floor judges), the absorbed
  queries, W_uv once, the output.

Floors divide by `hbm_bandwidth()` of the same run. Contexts size the cache and the block
table (the attention's selection is 2063 tokens once the context holds them). Timing:
CUDA-graph replays, median; every call in a graph on its own inputs (more than L2 in all).
Each case checks ours against the reference first.

    PYTHONPATH=packages/glm5-kernels/src:packages/glm5-runtime/src:packages/glm5-policy/src \\
        python benchmarks/dsa_decode.py --out benchmarks/results/dsa_decode_h200.json
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
from provenance import floor_bandwidth, provenance, result_args, write_result

from glm5_kernels.dsa import (
    IndexerTopk,
    KpoolWrite,
    SparseMlaDecode,
    index_topk_ref,
    kpool_write_ref,
    pack_kpool_pages_ref,
    rotate_quant_fp8_ref,
    sparse_mla_decode_ref,
)
from glm5_kernels.timing import graph_calls_us
from glm5_runtime.bench import call_launches

L, VD, BS, SELECTED = 512, 256, 64, 2048 + 15
SCALE = 256**-0.5  # the model's (qk_nope 256 + qk_rope 0)^-1/2: NoPE
L2_BYTES = 50 << 20


def call_bytes(heads: int, rows: int, width: int) -> int:
    return rows * (width * L * 2 + heads * L * 2 + heads * VD * 2) + heads * VD * L * 2


def _copies(per_call: int) -> int:
    """Calls on distinct inputs a graph replays: twice L2 in all, 2 to 32 of them."""
    return max(2, min(32, math.ceil(2 * L2_BYTES / per_call)))


def case(op, heads, requests, q, context, bw, gen) -> dict:
    rows, per = requests * q, -(-context // BS)
    width = min(SELECTED, context)
    cache = torch.randn(requests * per, BS, L, generator=gen, device="cuda").bfloat16()
    table = torch.randperm(requests * per, generator=gen, device="cuda").view(requests, per)
    table = table.int()
    request = torch.arange(requests, device="cuda").repeat_interleave(q).int()
    per_call = call_bytes(heads, rows, width)
    copies = _copies(per_call)

    def selection():
        idx = torch.full((rows, SELECTED), -1, dtype=torch.int32, device="cuda")
        score = torch.rand(rows, context, generator=gen, device="cuda")
        idx[:, :width] = score.topk(width, dim=1).indices.int()
        return idx

    calls = [(torch.randn(rows, heads, L, generator=gen, device="cuda").bfloat16(), selection())
             for _ in range(copies)]  # fmt: skip
    w_uv = op.w_uv
    ours = [lambda c=c: op(c[0], cache, table, request, c[1]) for c in calls]
    ref = [lambda c=c: sparse_mla_decode_ref(c[0], cache, table, request, c[1], w_uv, SCALE)
           for c in calls]  # fmt: skip
    got, want = ours[0](), ref[0]()
    err = ((got.float() - want.float()).abs() / want.float().abs().amax(-1, keepdim=True)).max()
    floor = per_call / bw * 1e6
    us = graph_calls_us(ours)
    ref_us = graph_calls_us(ref) if rows * width * L * 4 < (8 << 30) else None
    return {"stage": "dsa_attn", "heads": heads, "context": context, "requests": requests,
            "q": q, "us": us, "ref_us": ref_us, "floor_us": floor, "floor_ratio": us / floor,
            "launches": call_launches(ours[0]), "splits": op.splits(rows, width),
            "max_rel_error": err.item(), "copies": copies}  # fmt: skip


IH, IHD, KP = 32, 128, 16  # the indexer: heads, head dim, tokens a pool


def indexer_case(requests, q, context, bw, gen) -> dict:
    """Stage `dsa_indexer`: every visible pool of each row scored (vLLM's FP8 pages through
    the block table), the top 2048 tokens + tail selected. Floor: each row's pages (a request's
    rows share them, but a kernel reading them per row is what it judges), q, the output."""
    rows, per = requests * q, -(-context // BS)
    s = BS // KP
    blocks = requests * per
    k8, ks = rotate_quant_fp8_ref(torch.randn(blocks, s, IHD, generator=gen, device="cuda"))
    pages = pack_kpool_pages_ref(k8, ks)
    table = torch.randperm(blocks, generator=gen, device="cuda").view(requests, per).int()
    request = torch.arange(requests, device="cuda").repeat_interleave(q).int()
    positions = (context - q + torch.arange(q, device="cuda")).repeat(requests).int()
    pools = per * s
    op = IndexerTopk(IH, IHD, kpool=KP, topk=2048, tail=True, max_rows=rows, max_pools=pools)
    op.prepare()
    per_call = rows * (pools * (IHD + 4) + IH * (IHD + 8) + op.width * 4)
    copies = _copies(per_call)
    calls = []
    for _ in range(copies):
        q8, q_scale = rotate_quant_fp8_ref(torch.randn(rows, IH, IHD, generator=gen, device="cuda"))
        calls.append((q8, q_scale, torch.randn(rows, IH, generator=gen, device="cuda")))
    ours = [lambda c=c: op(*c, pages, table, request, positions) for c in calls]
    kw = dict(topk=2048, kpool=KP, tail=True, width=op.width)
    ref = [lambda c=c: index_topk_ref(*c, pages, table, request, positions, **kw) for c in calls]
    same = torch.equal(ours[0]().long(), ref[0]())
    floor = per_call / bw * 1e6
    us = graph_calls_us(ours)
    return {"stage": "dsa_indexer", "heads": IH, "context": context, "requests": requests,
            "q": q, "us": us, "ref_us": graph_calls_us(ref[:2]), "floor_us": floor,
            "floor_ratio": us / floor, "launches": call_launches(ours[0]),
            "splits": op.splits(rows, pools), "equal_to_reference": same,
            "copies": copies}  # fmt: skip


def kpool_case(requests, q, bw, gen) -> dict:
    """Stage `dsa_kpool`: the step's ring write, the completed pools (every request's last
    token completes one: the most work) into the pages, the queries rotated and cast. Floor:
    keys, gate scores and queries in, ring members read, ring / pages / FP8 queries out."""
    rows, s, ring = requests * q, BS // KP, 32
    blocks = 1 + requests * 4
    tail = torch.randn(requests, 2, ring, IHD, generator=gen, device="cuda").bfloat16()
    pages = torch.zeros(blocks, s, IHD + 4, dtype=torch.uint8, device="cuda")
    table = (1 + torch.arange(requests * 4, device="cuda")).view(requests, 4).int()
    positions = (4 * KP - q + torch.arange(q, device="cuda")).repeat(requests, 1).int()
    tail_rows = torch.arange(requests, device="cuda").int()
    ape = torch.randn(KP, IHD, generator=gen, device="cuda").bfloat16()
    op = KpoolWrite(IH, IHD, ape, kpool=KP, block_size=BS, max_rows=rows)
    op.prepare()
    per_call = rows * (2 * IHD * 2 + IH * IHD * 3 + IH * 4) + requests * (KP * 2 * IHD * 2 + IHD)
    copies = 8
    calls = [tuple(torch.randn(requests, q, *shape, generator=gen, device="cuda").bfloat16()
                   for shape in ((IHD,), (IHD,), (IH, IHD))) for _ in range(copies)]  # fmt: skip
    place = (table, positions, tail_rows)
    ours = [lambda c=c: op(*c, tail, pages, *place) for c in calls]
    ref = [lambda c=c: kpool_write_ref(*c, tail, pages, ape, *place, BS) for c in calls]
    floor = per_call / bw * 1e6
    us = graph_calls_us(ours)
    return {"stage": "dsa_kpool", "heads": IH, "context": 4 * KP, "requests": requests, "q": q,
            "us": us, "ref_us": graph_calls_us(ref[:2]), "floor_us": floor,
            "floor_ratio": us / floor, "launches": call_launches(ours[0]),
            "copies": copies}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--heads", default="16,64")
    parser.add_argument("--contexts", default="4096,16384,65536,131072")
    parser.add_argument("--requests", default="1,2,4,8,16,32,64")
    parser.add_argument("--q", default="1,4")
    parser.add_argument("--stages", default="dsa_attn,dsa_indexer,dsa_kpool")
    result_args(parser)
    args = parser.parse_args()
    if args.table:
        print(table(args.table))
        return
    gen = torch.Generator("cuda").manual_seed(0)
    bw = floor_bandwidth()
    rows, start = [], time.perf_counter()
    stages = args.stages.split(",")

    def record(row: dict) -> None:
        rows.append(row)
        result = provenance("dsa_decode", args) | {
            "hbm_bytes_per_s": bw, "rows": rows, "seconds": time.perf_counter() - start,
        }  # fmt: skip
        write_result(args.out, result)  # after every case: a cut run keeps its rows

    if "dsa_kpool" in stages:
        for q in (int(x) for x in args.q.split(",")):
            for r in (int(x) for x in args.requests.split(",")):
                row = kpool_case(r, q, bw, gen)
                record(row)
                print(f"kpool R={r:2d} q={q}: {row['us']:8.2f} µs (floor {row['floor_us']:7.2f}) "
                      f"ref {row['ref_us']:9.1f} [{row['launches']} launches]")  # fmt: skip
    if "dsa_indexer" in stages:
        for context in (int(c) for c in args.contexts.split(",")):
            for q in (int(x) for x in args.q.split(",")):
                for r in (int(x) for x in args.requests.split(",")):
                    row = indexer_case(r, q, context, bw, gen)
                    record(row)
                    print(f"indexer ctx={context:6d} R={r:2d} q={q}: {row['us']:8.2f} µs "
                          f"(floor {row['floor_us']:7.2f}, ×{row['floor_ratio']:.2f}) ref "
                          f"{row['ref_us']:9.1f} [{row['launches']} launches, {row['splits']} "
                          f"splits] equal {row['equal_to_reference']}")  # fmt: skip
    for heads in (int(h) for h in args.heads.split(",")) if "dsa_attn" in stages else ():
        w_uv = (torch.randn(heads, VD, L, generator=gen, device="cuda") / L**0.5).bfloat16()
        op = SparseMlaDecode(w_uv, SCALE, max_rows=256)
        op.prepare()
        for context in (int(c) for c in args.contexts.split(",")):
            for q in (int(x) for x in args.q.split(",")):
                for r in (int(x) for x in args.requests.split(",")):
                    if r * math.ceil(context / BS) * BS * L * 2 > (24 << 30):
                        continue  # the cache alone past 24 GiB
                    row = case(op, heads, r, q, context, bw, gen)
                    print(f"H={heads:2d} ctx={context:6d} R={r:2d} q={q}: {row['us']:8.2f} µs "
                          f"(floor {row['floor_us']:7.2f}, ×{row['floor_ratio']:.2f}) ref "
                          f"{row['ref_us'] or float('nan'):9.1f} [{row['launches']} launches, "
                          f"{row['splits']} splits] err {row['max_rel_error']:.1e}")  # fmt: skip
                    record(row)


def table(path: str) -> str:
    with open(path) as f:
        result = json.load(f)
    out = [
        f"{result['gpu']}, {result['date']}, commit {result['commit']}: `{result['command']}`",
        "",
        "| stage | heads | context | requests | q | µs (× floor) | launches | reference µs |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["rows"]:
        ref = f"{r['ref_us']:.1f}" if r["ref_us"] else "-"
        out.append(
            f"| {r['stage']} | {r['heads']} | {r['context']} | {r['requests']} | {r['q']} "
            f"| {r['us']:.1f} "
            f"({r['floor_ratio']:.2f}×) | {r['launches']} | {ref} |"
        )
    return "\n".join(out)


if __name__ == "__main__":
    main()
