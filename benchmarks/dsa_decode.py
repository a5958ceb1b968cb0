"""The sparse MLA decode of a DSA layer (stage `dsa_attn`: attention over the indexer's
selection + the value-up) at GLM-5.3-Flash's shapes — latent 512, value dim 256, the top-2048
tokens + the 15-token tail selected, blocks of 64 tokens — for 64 heads (TP 1) and 16 (a TP-4
rank): `SparseMlaDecode` (two launches) vs the torch reference (`sparse_mla_decode_ref`, the
reference backbone's MLA core) and the HBM floor.

Floor: the bytes a call must move ÷ `hbm_bandwidth()` of the same run — every row's selected
latents (its own selection: rows of one request overlap, but a kernel reading them per row
is what the floor judges), the absorbed queries, W_uv once, the output. Contexts only size
the cache and the block table (the selection is 2063 tokens once the context holds them).
Timing: CUDA-graph replays, median; every call in a graph on its own selection (more than L2
in all). Each case checks ours against the reference first.

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

from glm5_kernels.dsa import SparseMlaDecode, sparse_mla_decode_ref
from glm5_kernels.timing import graph_calls_us
from glm5_runtime.bench import call_launches

L, VD, BS, SELECTED = 512, 256, 64, 2048 + 15
SCALE = 256**-0.5  # the model's (qk_nope 256 + qk_rope 0)^-1/2: NoPE
L2_BYTES = 50 << 20


def call_bytes(heads: int, rows: int, width: int) -> int:
    return rows * (width * L * 2 + heads * L * 2 + heads * VD * 2) + heads * VD * L * 2


def case(op, heads, requests, q, context, bw, gen) -> dict:
    rows, per = requests * q, -(-context // BS)
    width = min(SELECTED, context)
    cache = torch.randn(requests * per, BS, L, generator=gen, device="cuda").bfloat16()
    table = torch.randperm(requests * per, generator=gen, device="cuda").view(requests, per)
    table = table.int()
    request = torch.arange(requests, device="cuda").repeat_interleave(q).int()
    per_call = call_bytes(heads, rows, width)
    copies = max(2, min(32, math.ceil(2 * L2_BYTES / per_call)))

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--heads", default="16,64")
    parser.add_argument("--contexts", default="4096,16384,65536,131072")
    parser.add_argument("--requests", default="1,2,4,8,16,32,64")
    parser.add_argument("--q", default="1,4")
    result_args(parser)
    args = parser.parse_args()
    if args.table:
        print(table(args.table))
        return
    gen = torch.Generator("cuda").manual_seed(0)
    bw = floor_bandwidth()
    rows, start = [], time.perf_counter()
    for heads in (int(h) for h in args.heads.split(",")):
        w_uv = (torch.randn(heads, VD, L, generator=gen, device="cuda") / L**0.5).bfloat16()
        op = SparseMlaDecode(w_uv, SCALE, max_rows=256)
        op.prepare()
        for context in (int(c) for c in args.contexts.split(",")):
            for q in (int(x) for x in args.q.split(",")):
                for r in (int(x) for x in args.requests.split(",")):
                    if r * math.ceil(context / BS) * BS * L * 2 > (24 << 30):
                        continue  # the cache alone past 24 GiB
                    row = case(op, heads, r, q, context, bw, gen)
                    rows.append(row)
                    print(f"H={heads:2d} ctx={context:6d} R={r:2d} q={q}: {row['us']:8.2f} µs "
                          f"(floor {row['floor_us']:7.2f}, ×{row['floor_ratio']:.2f}) ref "
                          f"{row['ref_us'] or float('nan'):9.1f} [{row['launches']} launches, "
                          f"{row['splits']} splits] err {row['max_rel_error']:.1e}")  # fmt: skip
                    result = provenance("dsa_decode", args) | {
                        "hbm_bytes_per_s": bw, "rows": rows,
                        "seconds": time.perf_counter() - start,
                    }  # fmt: skip
                    write_result(args.out, result)  # after every case: a cut run keeps its rows


def table(path: str) -> str:
    with open(path) as f:
        result = json.load(f)
    out = [
        f"{result['gpu']}, {result['date']}, commit {result['commit']}: `{result['command']}`",
        "",
        "| heads | context | requests | q | µs (× floor) | launches | reference µs |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["rows"]:
        ref = f"{r['ref_us']:.1f}" if r["ref_us"] else "-"
        out.append(
            f"| {r['heads']} | {r['context']} | {r['requests']} | {r['q']} | {r['us']:.1f} "
            f"({r['floor_ratio']:.2f}×) | {r['launches']} | {ref} |"
        )
    return "\n".join(out)


if __name__ == "__main__":
    main()
