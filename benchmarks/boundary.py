"""The mHC boundary of GLM-5.3-Flash decode (4 streams x hidden 4096) on one GPU: the
previous sublayer's post, the next one's pre (mix, 20 Sinkhorn iterations) and its input
RMSNorm. Ours (`MhcBoundary.post_pre`, one launch: the Triton kernel, path `triton`, the
CuTe DSL cluster kernel, path `cute`, or that kernel taking the previous boundary's comb as
mix logits and leaving its own so, path `cute_deferred`: both Sinkhorns before its PDL
wait, under the previous call) vs the stock sequence (the backbone's torch
ops: post, pre, norm, as the reference backbone and vLLM's native path run them), and the HBM
floor (x, the streams read and written, fn, the norm weight and the normed output ÷
`hbm_bandwidth()` measured in the same run). World size 1: no all-reduce (`nccl_us` null).

Timing: CUDA-graph replays, median, every call on its own copy of the weights and inputs
(more than L2 in all). Launches: kernel nodes of one boundary's captured graph. Each
boundary is checked against the stock output before it is timed. `--sweep` times the plan's
tile variants (Triton: tokens per CTA x columns per CTA; CuTe: tokens per cluster, built
for two CTAs an SM and for one) at each token count. `--phases` replays the same chain of
CuTe boundaries built with timestamps (`cute_mhc.PHASES`: thread 0 of every CTA reads the
global timer and its SM's cycle counter at each point) and reports, as medians over the
chain's boundaries, where one boundary's time goes: from the previous boundary's last CTA
done to this one's PDL wait returning (`release`), then each phase of the kernel in its
CTAs' cycles (rank 0, which runs Sinkhorn, apart from the others), and the chain's period;
with `--paths cute_deferred`, the deferred build twice: each call's comb the previous
call's (chained) and each call's its own, ready before the chain (as a step's).
`--sinkhorn-iters N` builds every boundary (and the stock) with N Sinkhorn iterations
instead of the model's 20: an experiment that prices one iteration on the critical path
(timed with N = 1 and 20, say).

    PYTHONPATH=packages/glm5-kernels/src:packages/glm5-runtime/src:packages/glm5-policy/src \\
        python benchmarks/boundary.py --out benchmarks/results/boundary_h200.json
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import time

import torch
from provenance import floor_bandwidth, provenance, result_args, write_result

from glm5_kernels.mhc import MhcBoundary, MhcConfig, PendingComb, hc_fused_post_pre_ref
from glm5_kernels.mhc.boundary import MAX_CLUSTERS, POST
from glm5_kernels.mhc.cute_mhc import READY
from glm5_kernels.mhc.reference import sinkhorn_ref
from glm5_kernels.timing import graph_calls_us
from glm5_runtime.bench import call_launches

D, H = 4096, 4
CONFIG = MhcConfig(hc=H, hidden=D, rms_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20, norm_eps=1e-5)
COPIES = 40  # sites cycled through per graph: 40 x 1.5 MB of fn alone, beyond L2


def inputs(m: int, gen):
    c = CONFIG
    fn = torch.randn(c.mix, H * D, generator=gen, device="cuda") * 0.5 / (H * D) ** 0.5
    scale = 0.5 + torch.rand(3, generator=gen, device="cuda")
    base = 0.5 * torch.randn(c.mix, generator=gen, device="cuda")
    norm = (1 + 0.1 * torch.randn(D, generator=gen, device="cuda")).bfloat16()
    x = torch.randn(m, D, generator=gen, device="cuda").bfloat16()
    streams = torch.randn(m, H, D, generator=gen, device="cuda").bfloat16()
    post = 2 * torch.rand(m, H, generator=gen, device="cuda")
    logits = torch.randn(m, H, H, generator=gen, device="cuda")
    comb = sinkhorn_ref(logits, c.hc_eps, c.sinkhorn_iters)
    return x, streams, post, comb, fn, scale, base, norm, logits


def deferred(s, op: MhcBoundary):
    """A set's inputs with comb as the pending logits of a boundary done before (ready
    words for `op`'s clusters)."""
    x, streams, post, _, fn, scale, base, norm, logits = s
    ready = torch.full((op.cute_groups(len(x)),), READY, dtype=torch.int32,
                       device="cuda")  # fmt: skip
    return x, streams, post, PendingComb(logits, ready), fn, scale, base, norm


def stock(args):
    c = CONFIG
    eps = {"rms_eps": c.rms_eps, "hc_eps": c.hc_eps, "sinkhorn_iters": c.sinkhorn_iters}
    return lambda: hc_fused_post_pre_ref(*args, **eps, norm_eps=c.norm_eps)


def boundary_bytes(m: int) -> int:
    c = CONFIG
    return m * D * 2 * 2 + 2 * m * H * D * 2 + c.mix * H * D * 4 + D * 2 + m * H * (1 + H) * 8


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default="1,2,4,8,16,32,64")
    parser.add_argument("--paths", default="triton,cute", help="kernels to time")
    parser.add_argument("--sweep", action="store_true", help="time tile variants")
    parser.add_argument(
        "--phases",
        action="store_true",
        help="where a CuTe boundary's time goes: a timestamped build's chain",
    )
    parser.add_argument("--profile", action="store_true",
                        help="one eager boundary per path and token count, nothing timed (for "
                             "`ncu -k regex:'hc_boundary|CuteBoundary'`)")  # fmt: skip
    parser.add_argument("--sinkhorn-iters", type=int, default=None,
                        help="Sinkhorn iterations of every boundary (an experiment; the model "
                             "runs 20)")  # fmt: skip
    result_args(parser)
    args = parser.parse_args()
    if args.table:
        print(table(args.table))
        return
    if args.sinkhorn_iters is not None:
        if args.sinkhorn_iters < 1:
            parser.error("--sinkhorn-iters: at least 1")
        global CONFIG
        CONFIG = dataclasses.replace(CONFIG, sinkhorn_iters=args.sinkhorn_iters)
    gen = torch.Generator("cuda").manual_seed(0)
    bw = floor_bandwidth()
    paths = args.paths.split(",")
    ops = {"triton": MhcBoundary(CONFIG, device="cuda")}
    if "cute" in paths:
        ops["cute"] = MhcBoundary(CONFIG, device="cuda", cute_tokens=range(1, 65))
    if "cute_deferred" in paths:
        ops["cute_deferred"] = MhcBoundary(CONFIG, device="cuda", cute_tokens=range(1, 65),
                                           defer_tokens=range(1, 65))  # fmt: skip
    if args.profile:
        for m in (int(t) for t in args.tokens.split(",")):
            for path in paths:
                s = inputs(m, gen)
                ops[path].post_pre(*(deferred(s, ops[path]) if path == "cute_deferred" else s[:8]))
        torch.cuda.synchronize()
        return
    if args.phases:
        kinds = ([(False, False)] if paths != ["cute_deferred"] else []) + (
            [(True, True), (True, False)] if "cute_deferred" in paths else [])  # fmt: skip
        op = ops.get("cute", ops.get("cute_deferred"))
        found = [phases(int(m), [inputs(int(m), gen) for _ in range(COPIES)], op, *kind)
                 for m in args.tokens.split(",") for kind in kinds]  # fmt: skip
        write_result(args.out, provenance("boundary", args) | {"phases": found})
        return
    rows, sweep, start = [], [], time.perf_counter()
    for m in (int(t) for t in args.tokens.split(",")):
        sets = [inputs(m, gen) for _ in range(COPIES)]
        stocks = [stock(s[:8]) for s in sets]
        want = stocks[0]()
        floor = boundary_bytes(m) / bw * 1e6
        stock_us = graph_calls_us(stocks)
        for path in paths:
            op = ops[path]
            given = [deferred(s, op) if path == "cute_deferred" else s[:8] for s in sets]
            ours = [lambda s=s, op=op: op.post_pre(*s) for s in given]
            got = list(ours[0]())
            got[2] = op.resolve_comb(got[2])
            if path.startswith("cute"):
                assert m in op.cute_tokens, "the CuTe DSL boundary did not build"
            err = max(((g.float() - w.float()).abs().max() / w.float().abs().max()).item()
                      for g, w in zip(got, want, strict=True))  # fmt: skip
            us = graph_calls_us(ours)
            plan = ({"tb": op.cute_tb(m), "per_sm": op.cute_per_sm(m)} if path.startswith("cute")
                    else vars(op.plans[m]))  # fmt: skip
            row = {"world": 1, "tokens": m, "path": path, "us": us, "stock_us": stock_us,
                   "nccl_us": None, "floor_us": floor, "floor_ratio": us / floor,
                   "speedup_vs_stock": stock_us / us, "launches": call_launches(ours[0]),
                   "stock_launches": call_launches(stocks[0]), "max_rel_error": err,
                   "plan": plan}  # fmt: skip
            rows.append(row)
            print(f"T={m:2d} {path:6s}: {us:6.2f} µs (floor {floor:5.2f}, ×{us / floor:.2f}) "
                  f"stock {stock_us:7.1f} µs [{row['launches']} vs {row['stock_launches']} "
                  f"launches] err {err:.1e} plan {plan}")  # fmt: skip
            if args.sweep:
                sweep += _sweep(path, op, m, ours)
    result = provenance("boundary", args) | {
        "hbm_bytes_per_s": bw, "config": vars(CONFIG), "rows": rows, "sweep": sweep,
        "seconds": time.perf_counter() - start,
    }  # fmt: skip
    write_result(args.out, result)


def _sweep(path: str, op: MhcBoundary, m: int, ours) -> list[dict]:
    """The tile variants of one path at m tokens, timed (the plan restored after)."""
    out = []
    if path == "cute_deferred":  # its pending inputs are sized by the plan's clusters
        return out
    if path == "cute":  # tokens a cluster, built for two CTAs an SM and for one
        for per_sm, tb in itertools.product((2, 1), (1, 2, 3, 4, 5, 6, 8)):
            if -(-m // tb) > MAX_CLUSTERS or tb > m:  # the plan's cap; a cluster with no token
                continue
            op.cute_tb, op.cute_per_sm = (lambda _m, tb=tb: tb), (lambda _m, n=per_sm: n)
            ours[0]()  # compiled outside the capture
            t = graph_calls_us(ours)
            out.append({"tokens": m, "path": path, "tb": tb, "per_sm": per_sm, "us": t})
            print(f"   tb {tb} ({per_sm} an SM): {t:6.2f} µs")
        del op.cute_tb, op.cute_per_sm
        return out
    best = op.plans[m]
    for bd in (32, 64, 128, 256):
        for warps in (4, 8):
            op.plans[m] = op._tiles(m, bd, warps)
            if not op.plans[m].fused:
                continue
            t = graph_calls_us(ours)
            out.append({"tokens": m, "path": path, "bd": bd, "warps": warps, "us": t})
            print(f"   bd {bd:3d} warps {warps}: {t:6.2f} µs")
    op.plans[m] = best
    return out


def phases(m: int, sets, op: MhcBoundary, deferred: bool = False,
           chained: bool = False) -> dict:  # fmt: skip
    """The timestamped CuTe boundary's chain over `sets` (one call each) at m tokens: the
    median over calls 2.. of each interval (module docstring), in µs. `deferred`: every call
    takes a pending comb and leaves its own so — `chained`, the previous call's (set at its
    very end: no sublayer between), else its set's logits, ready before the chain starts (as
    a step's comb is, a sublayer after its boundary). `op`: its plan's tokens a cluster."""
    from glm5_kernels.mhc import cute_mhc

    c, tb = CONFIG, op.cute_tb(m)
    kernel = cute_mhc.compile_boundary(
        cute_mhc.slot_dtypes(("float32", "float32", "float32", "bfloat16")), mode=POST,
        head=False, store=True, tb=tb, hidden=D, rms_eps=c.rms_eps, hc_eps=c.hc_eps,
        norm_eps=c.norm_eps, post_mult=c.post_mult, sinkhorn_iters=c.sinkhorn_iters, pdl=True,
        phases=True, pend_in=deferred, pend_out=deferred,
    )  # fmt: skip
    n, groups = len(cute_mhc.PHASES), op.cute_groups(m)
    stamps = torch.zeros(len(sets), m, cute_mhc.CLUSTER * 2 * n, dtype=torch.int64,
                         device="cuda")  # fmt: skip
    outs = [(torch.empty(m, H, D, dtype=torch.bfloat16, device="cuda"),
             torch.empty(m, H, device="cuda"), torch.empty(m, H, H, device="cuda"),
             torch.empty(m, D, dtype=torch.bfloat16, device="cuda")) for _ in sets]  # fmt: skip
    # Each call's ready words (in: the previous call's out; the first's, ready already).
    ready = torch.zeros(len(sets) + 1, groups, dtype=torch.int32, device="cuda")
    ready[0] = READY
    given_ready = torch.full((groups,), READY, dtype=torch.int32, device="cuda")

    def chain():
        stream = torch.cuda.current_stream().cuda_stream
        for k, (s, out, st) in enumerate(zip(sets, outs, stamps, strict=True)):
            given, before = list(s[:8]), ready[k]
            if deferred and chained and k:  # post and comb (logits) of the call before
                given[2:4] = outs[k - 1][1], outs[k - 1][2]
            elif deferred:  # its set's logits, ready
                given[3], before = s[8], given_ready
            cute_mhc.launch(kernel, [*given, *out, st, before, ready[k + 1]], m, stream)

    chain()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    for _ in range(20):  # warm; the last replay's stamps are read
        graph.replay()
    torch.cuda.synchronize()
    t = stamps[:, :groups].view(len(sets), groups, cute_mhc.CLUSTER, 2, n).cpu().double()
    ns, cycles = t[..., 0, :], t[..., 1, :]
    ghz = (cycles[..., -1] - cycles[..., 0]).sum() / (ns[..., -1] - ns[..., 0]).sum()
    end = ns[..., -1].amax(dim=(1, 2))  # the call's last CTA done
    waited = ns[..., 1].amin(dim=(1, 2))  # its first CTA released
    span = cycles.diff(dim=-1) / ghz / 1e3  # µs between consecutive points, each CTA
    rank0, others = span[:, :, 0], span[:, :, 1:]
    med = lambda x: statistics.median(x[1:].flatten().tolist())  # noqa: E731 (call 1 is cold)
    steps = [f"{a}->{b}" for a, b in itertools.pairwise(cute_mhc.PHASES)]
    found = {
        "tokens": m, "tb": tb, "deferred": deferred, "chained": chained, "sm_ghz": ghz.item(),
        "period_us": med(end.diff() / 1e3),
        "release_us": med((waited[1:] - end[:-1]) / 1e3),
        "rank0_us": {step: med(rank0[..., i]) for i, step in enumerate(steps)},
        "others_us": {step: med(others[..., i]) for i, step in enumerate(steps)},
    }  # fmt: skip
    kind = (" deferred, chained" if chained else " deferred") if deferred else ""
    print(f"T={m:2d}{kind} phases (µs, median over the chain): "
          f"period {found['period_us']:.2f}, "
          f"release {found['release_us']:.2f}; rank 0 {found['rank0_us']}; "
          f"others {found['others_us']}")  # fmt: skip
    return found


def table(path: str) -> str:
    with open(path) as f:
        result = json.load(f)
    out = [
        f"{result['gpu']}, {result['date']}, commit {result['commit']}: `{result['command']}`",
        "",
        "| world | tokens | path | µs (× floor) | launches | stock µs | launches | speedup |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["rows"]:
        out.append(
            f"| {r['world']} | {r['tokens']} | {r.get('path', 'triton')} | "
            f"{r['us']:.2f} ({r['floor_ratio']:.2f}×) | "
            f"{r['launches']} | {r['stock_us']:.1f} | {r['stock_launches']} | "
            f"{r['speedup_vs_stock']:.0f}× |"
        )
    if result.get("sweep"):
        out += ["", *sweep_table(result)]
    return "\n".join(out)


def sweep_table(result: dict) -> list[str]:
    """The CuTe sweep as tokens x (tokens a cluster, CTAs an SM), µs; the plan's variant in
    bold. (Results from before the one-an-SM build hold two an SM.)"""
    cute = [r for r in result["sweep"] if r["path"] == "cute"]
    variants = sorted({(r.get("per_sm", 2), r["tb"]) for r in cute}, key=lambda v: (-v[0], v[1]))
    planned = {r["tokens"]: (r["plan"].get("per_sm", 2), r["plan"]["tb"])
               for r in result["rows"] if r["path"] == "cute"}  # fmt: skip
    name = {2: "", 1: ", 1 an SM"}
    out = ["| tokens | " + " | ".join(f"{tb} a cluster{name[n]}" for n, tb in variants) + " |",
           "| --- |" + " --- |" * len(variants)]  # fmt: skip
    for m in sorted({r["tokens"] for r in cute}):
        us = {(r.get("per_sm", 2), r["tb"]): r["us"] for r in cute if r["tokens"] == m}
        cells = [("" if v not in us else f"**{us[v]:.2f}**" if v == planned.get(m)
                  else f"{us[v]:.2f}") for v in variants]  # fmt: skip
        out.append(f"| {m} | " + " | ".join(cells) + " |")
    return out


if __name__ == "__main__":
    main()
