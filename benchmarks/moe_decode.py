"""A whole MoE layer of GLM-5.3-Flash decode on one GPU (router, routing, 288 routed experts
top-8, the shared expert): TP 1 and TP 4 ranks, M in {1, 2, 4, 8, 16, 32, 64} tokens, uniform
and skewed (Zipf) routing; ours (`per_route` = MegaExperts, `grouped` = GroupedExperts, each
after the split-K router; `fused_router`: MegaExperts with the router GEMM inside its routing
launch, three launches) vs the best stock path built from library parts here, the torch
reference, and the HBM floor. `fused_router` routes by its router's own logits (random
weights and tokens: uniform routing only), so its row is checked against the four-launch
path on those logits and its floor counts the experts they touch.

Library stock: the router on cuBLAS with an FP32 output, torch's routing ops, then per touched
expert torch's block-scaled `_scaled_mm` (CUTLASS) for gate_up and down with torch's
quantization / SwiGLU ops between, weighted and summed with index_add, plus the shared
expert the same way. The touched experts and their tokens are known on the host when the
graph is captured (a stock path would have to gather or sync to know them): generous to it.
Reference: the runtime's stock experts (FP8 weights dequantized per route, capturable).
vLLM (`--vllm-ops DIR`, a folder of vLLM 0.33's files made by `benchmarks/vllm_files.py`): the
library router and routing ops, then vLLM 0.33's fused-MoE Triton kernel over the block-FP8
weights in place, as its TritonExperts runs it (`glm5_runtime.vllm_stock.fused_experts`:
vLLM's per-token-group quantization, block assignment, fused_moe_kernel for w13 and w2, the
clamped SwiGLU; the alignment sort and the top-k sum in torch), the shared expert through the
same sequence as one expert of weight 1 (torch's block-scaled _scaled_mm, the library's GEMM,
refuses TP 8's down_proj: K 256).
Floor: the touched experts' weights and scales (each once), the shared expert's, the
router's, and x / logits / output bytes ÷ `hbm_bandwidth()` measured in the same run.

Timing: CUDA-graph replays, median; every call reads cold weights (per call a fresh routing
over the 288 experts, and a different copy of the router and shared-expert weights).
Launches: kernel nodes of one layer's captured graph. Each path is checked against the
library's output (the same FP8 numerics) before it is timed.

    PYTHONPATH=packages/glm5-kernels/src:packages/glm5-runtime/src:packages/glm5-policy/src \\
        python benchmarks/moe_decode.py --vllm-ops DIR --out benchmarks/results/moe_decode_h200.json
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from functools import partial

import torch
from provenance import floor_bandwidth, provenance, result_args, write_result

from glm5_kernels.gemm import Router, quantize_tokens_fp8_ref, swiglu_ref
from glm5_kernels.gemm.library import (
    block_fp8_supported,
    fp8_mlp_library,
    router_library,
    supports,
)
from glm5_kernels.moe import (
    GroupedExperts,
    MegaExperts,
    SharedExpert,
    moe_output_ref,
    moe_rows_ref,
    route_ref,
)
from glm5_kernels.quant import dequantize_fp8_block_ref, quantize_fp8_block_ref
from glm5_kernels.timing import graph_calls_us
from glm5_runtime.bench import call_launches
from glm5_runtime.vllm_stock import VllmKernels, fused_experts

E, D, K, LIMIT, SCALING, INTER = 288, 4096, 8, 10.0, 2.5, 2048
COPIES = 8  # routings / router / shared-expert copies cycled through per graph
VLLM_ROW = (
    "library router + torch routing ops + vLLM 0.33's TritonExperts sequence "
    "(glm5_runtime.vllm_stock.fused_experts) + the shared expert through the same sequence "
    "(one expert, weight 1)"
)
# per_route_side: MegaExperts without the shared expert, which runs beside them on a second
# stream inside the graph (gemm.SharedExpert), added at the end.
PATHS = {"per_route": MegaExperts, "grouped": GroupedExperts, "per_route_side": MegaExperts,
         "fused_router": MegaExperts}  # fmt: skip


def fp8_stack(count: int, n: int, k: int, gen) -> tuple[torch.Tensor, torch.Tensor]:
    qs, ss = [], []
    for _ in range(count):
        q, s = quantize_fp8_block_ref(torch.randn(n, k, generator=gen, device="cuda") / k**0.5)
        qs.append(q)
        ss.append(s)
    return torch.stack(qs), torch.stack(ss)


def logits_for(routing: str, m: int, gen) -> torch.Tensor:
    """Uniform: Gaussian logits. Zipf: each token's 8 experts drawn without replacement with
    P(expert of popularity rank r) ∝ 1 / r^1.2 (a fixed random popularity order), given the
    top logits; the rest Gaussian far below."""
    logits = torch.randn(m, E, generator=gen, device="cuda")
    if routing == "zipf":
        p = torch.arange(1, E + 1, device="cuda", dtype=torch.float32) ** -1.2
        order = torch.randperm(E, generator=gen, device="cuda")
        picks = order[torch.multinomial(p.expand(m, E), K, generator=gen)]
        logits = logits - 8.0
        logits.scatter_(1, picks, 8.0 + torch.rand(m, K, generator=gen, device="cuda"))
    return logits


def torch_routing(logits, bias):
    """torch's routing ops: sigmoid, top-k of scores + bias, renormalized, scaled."""
    scores = torch.sigmoid(logits)
    ids = torch.topk(scores + bias, K, dim=-1).indices
    weights = scores.gather(1, ids)
    return weights / (weights.sum(-1, keepdim=True) + 1e-20) * SCALING, ids


def ratio(library_us: float | None, us: float) -> float | None:
    return None if library_us is None else library_us / us


def library_layer(x, router_w, bias, logits, experts, shared):
    """The library stock for one call; `logits` fixes the routing the host planned for."""
    w13, s13, w2, s2 = experts
    _, ids_host = route_ref(logits, bias, K, SCALING)
    plan = [(e, torch.where((ids_host == e).any(-1))[0]) for e in ids_host.unique().tolist()]

    def run():
        router_library(x, router_w)  # its logits are replaced by the planned ones
        weights, ids = torch_routing(logits, bias)
        xq, sx = quantize_tokens_fp8_ref(x)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e, tok in plan:
            y = fp8_mlp_library(xq[tok], sx[tok], w13[e], s13[e], w2[e], s2[e], LIMIT)
            combine = (weights[tok] * (ids[tok] == e)).sum(-1, keepdim=True)
            out.index_add_(0, tok, y.float() * combine)
        return (out.bfloat16() + fp8_mlp_library(xq, sx, *shared, LIMIT)).bfloat16()

    return run


def vllm_layer(kernels, x, router_w, bias, logits, experts, shared):
    """vLLM's fused-MoE experts after the library router and torch's routing ops (`logits`
    fix the routing), plus the shared expert through the same kernel (one expert, weight 1)."""
    w13, s13, w2, s2 = experts
    one = [t[None] for t in shared]
    ids = torch.zeros(x.shape[0], 1, dtype=torch.int32, device=x.device)
    unit = torch.ones(x.shape[0], 1, device=x.device)

    def run():
        router_library(x, router_w)  # its logits are replaced by the planned ones
        weights, routes = torch_routing(logits, bias)
        routed = fused_experts(kernels, x, w13, s13, w2, s2, routes, weights, LIMIT)
        return routed + fused_experts(kernels, x, *one, ids, unit, LIMIT)

    return run


def reference_layer(x, router_w, bias, logits, experts, shared):
    """The runtime's stock MoE (weights dequantized per route, or per expert once there are
    more routes than experts) with the routing `logits` fix."""
    from glm5_runtime.reference.stages import stock_experts

    w13, s13, w2, s2 = experts
    sw13, ss13, sw2, ss2 = shared

    def run():
        x.float() @ router_w.float().T  # the reference router (its logits replaced)
        weights, ids = route_ref(logits, bias, K, SCALING)
        routed = stock_experts(x, w13, w2, ids, weights, LIMIT, s13, s2)
        h = swiglu_ref(x @ dequantize_fp8_block_ref(sw13, ss13, dtype=x.dtype).T, LIMIT)
        down = dequantize_fp8_block_ref(sw2, ss2, dtype=x.dtype)
        return routed.bfloat16() + h.to(x.dtype) @ down.T

    return run


def fp8_layer_ref(x, bias, logits, experts, shared):
    """The check's yardstick where the library stock cannot run: vLLM's block-FP8 sequence
    per route (`moe_rows_ref`, combined by `moe_output_ref`). Not `reference_layer`, whose
    BF16 activations (transformers' numerics) sit ~4.6 % from any FP8-activation kernel,
    vLLM's own included: a yardstick that coarse would hide a wrong route."""
    weights, ids = route_ref(logits, bias, K, SCALING)
    w13, s13, w2, s2 = experts
    return moe_output_ref(moe_rows_ref(x, ids, w13, s13, w2, s2, shared, LIMIT), weights)


def sweep(path_ops, router_ops, xs, logits, m: int, floors: dict[str, float]) -> dict:
    """Each launch of the layer timed alone (its inputs left by a full run), at the plan's
    tile and at variants of it: where the time goes, and what the plan should pick; the
    expert launches also L2-hot (`*_hot_us`)."""

    def buffers():  # a full run leaves every launch's inputs in place
        out = []
        for c, op in enumerate(path_ops):
            b = op._buffers(xs[c], m, logits[c], None, None, True, None)
            _layer(op, b)
            out.append(b)
        return out

    out = {
        "router_us": graph_calls_us(
            [lambda r=r, x=x: r(x) for r, x in zip(router_ops, xs, strict=True)]
        )
    }

    def each(field, values):
        return [{field: v} for v in values]

    variants = {  # each a change of the plan
        "route": each("warps_route", (1, 2, 4, 8)) + each("quantize_apart", (False, True)),
        # Two warpgroups (warps 8) split the MMA's N: two warps a scheduler where one
        # waits on its own latencies (Nsight: 4.6 cycles an instruction at 4 warps).
        "gate_up": each("stages_gate_up", (2, 3, 4)) + each("blocks", (1, 2, 4))
        + each("bn_gate_up", (16, 32, 64)) + each("split_gate_up", (1, 2, 4, 8))
        + each("warps_gate_up", (4, 8))
        + [{"blocks": 4, "stages_gate_up": 2}, {"split_gate_up": 2, "stages_gate_up": 4},
           {"split_gate_up": 4, "stages_gate_up": 4}, {"split_gate_up": 2, "bn_gate_up": 32},
           {"split_gate_up": 4, "blocks": 1}, {"warps_gate_up": 8, "split_gate_up": 1},
           {"warps_gate_up": 8, "split_gate_up": 2}, {"warps_gate_up": 8, "stages_gate_up": 4}],
        "down": each("tiles_down", (1, 2, 4)) + each("stages_down", (2, 3, 4))
        + each("warps_down", (4, 8)),
        # The three launches together: what a change of one does to the next one's start.
        "layer": each("release_early", (False, True)),
    }  # fmt: skip
    plan = path_ops[0].plans[m]
    for kernel, changes in variants.items():

        def timed(iters: int, kernel: str = kernel) -> float:
            bs = buffers()
            fns = [getattr(op, f"_{kernel}", None) or partial(_layer, op) for op in path_ops]
            return graph_calls_us(
                [lambda f=f, b=b: f(b) for f, b in zip(fns, bs, strict=True)], iters
            )

        out[f"{kernel}_us"] = timed(15)
        if kernel in ("gate_up", "down"):
            # The same layer's launch back to back: its weights L2-resident after the first
            # (tens of MB at TP 4 / 8). Near the cold time, the launch waits on latency, not
            # on HBM.
            b0, f0 = buffers()[0], getattr(path_ops[0], f"_{kernel}")
            out[f"{kernel}_hot_us"] = graph_calls_us([partial(f0, b0)] * len(path_ops), 15)
        out[f"{kernel}_floor_us"] = floors.get(kernel)
        tried = []
        for change in changes:
            if all(getattr(plan, f) == v for f, v in change.items()):
                continue
            for op in path_ops:
                op.plans[m] = replace(plan, **change)
            try:
                tried.append({**change, "us": timed(7)})
            except Exception as e:  # a tile that does not fit: say so, go on
                tried.append({**change, "error": f"{type(e).__name__}: {e}"[:200]})
            for op in path_ops:
                op.plans[m] = plan
        out[f"{kernel}_variants"] = tried
    out["plan"] = vars(plan)
    return out


def _layer(op, b) -> None:
    """The routing, gate_up and down launches of one layer (the sweep's "layer")."""
    op._route(b)
    op._gate_up(b)
    op._down(b)


def side(path: str) -> bool:
    return path.endswith("_side")


def layer_call(router, experts, shared_mlp, stream, x, logits):
    """One MoE layer's call with the routing `logits` fix (the router still runs): the
    shared expert inside the experts' launches, or (`shared_mlp`) beside them on `stream`."""

    def run():
        if shared_mlp is None:
            return router(x), experts.finalized(x, logits)
        main = torch.cuda.current_stream()
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            s = shared_mlp(x)
        router(x)
        y = experts.finalized(x, logits)
        main.wait_stream(stream)
        return None, y + s

    return run


def gated_row(path_ops, router_ops, xs, base, expert_bytes, bw, m) -> dict:
    """`fused_router`: each copy's router inside its routing launch, on its own logits; the
    check is the four-launch path on those logits, the floor the experts they touch."""
    fns = [(lambda op=op, r=r, x=x: op.finalized(x, gate=r))
           for op, r, x in zip(path_ops, router_ops, xs, strict=True)]  # fmt: skip
    for c, op in enumerate(path_ops):
        dummy = torch.zeros_like(xs[c])
        op.finalized(dummy, gate=router_ops[c])  # compiled before the capture
    own = [r(x) for r, x in zip(router_ops, xs, strict=True)]
    want = path_ops[0].finalized(xs[0], own[0]).double()
    got = fns[0]().double()
    touched = sum(route_ref(lg, path_ops[0].bias, K, SCALING)[1].unique().numel() for lg in own)
    nbytes = base["bytes"] + (touched / COPIES - base["touched_experts"]) * expert_bytes
    floor = nbytes / bw * 1e6
    us = graph_calls_us(fns)
    return {**base, "floor_us": floor, "touched_experts": touched / COPIES, "bytes": nbytes,
            "path": "fused_router", "us": us, "floor_ratio": us / floor,
            "speedup_vs_library": None, "rel_error": ((got - want).norm() / want.norm()).item(),
            "launches": call_launches(fns[0])}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", default="1,4")
    parser.add_argument("--tokens", default="1,2,4,8,16,32,64")
    parser.add_argument("--routing", default="uniform,zipf")
    parser.add_argument("--reference-tokens", default="1,8",
                        help="token counts the (slow) torch reference is timed at")  # fmt: skip
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--sweep", action="store_true", help="time each launch and tile variants")
    parser.add_argument("--vllm-ops", help="folder of vLLM 0.33's files (vllm_files.py): the "
                        "vLLM fused-MoE row")  # fmt: skip
    result_args(parser)
    args = parser.parse_args()
    if args.table:
        print(table(args.table))
        return
    if block_fp8_supported(torch.device("cuda")) is None:
        raise SystemExit("the library stock needs torch's block-scaled _scaled_mm")
    kernels = VllmKernels(args.vllm_ops) if args.vllm_ops else None
    gen = torch.Generator("cuda").manual_seed(0)
    bw = floor_bandwidth()
    rows, start = [], time.perf_counter()
    ref_tokens = {int(t) for t in args.reference_tokens.split(",") if t}
    for tp in (int(t) for t in args.tp.split(",")):
        inter = INTER // tp
        experts = (*fp8_stack(E, 2 * inter, D, gen), *fp8_stack(E, D, inter, gen))
        w13, s13, w2, s2 = experts
        shared = [
            (*fp8_stack(1, 2 * inter, D, gen), *fp8_stack(1, D, inter, gen)) for _ in range(COPIES)
        ]
        shared = [tuple(t[0] for t in s) for s in shared]
        routers = [
            (torch.randn(E, D, generator=gen, device="cuda") / D**0.5).bfloat16()
            for _ in range(COPIES)
        ]
        bias = torch.zeros(E, device="cuda")
        # torch's block-scaled _scaled_mm refuses K = I/TP not a multiple of 512 (TP 8's
        # down_proj, K 256): no library row there, the checks against fp8_layer_ref.
        library_runs = supports(w13[0]) and supports(w2[0])
        expert_bytes = w13[0].nbytes + s13[0].nbytes + w2[0].nbytes + s2[0].nbytes
        ops = {
            path: [cls(w13, s13, w2, s2, bias=bias, shared=None if side(path) else shared[c],
                       top_k=K, routed_scaling=SCALING, swiglu_limit=LIMIT)
                   for c in range(COPIES)]
            for path, cls in PATHS.items()
            if path in args.paths.split(",")
        }  # fmt: skip
        beside = [SharedExpert(*s, swiglu_limit=LIMIT) for s in shared]
        stream = torch.cuda.Stream()
        router_ops = [Router(w) for w in routers]
        for routing in args.routing.split(","):
            for m in (int(t) for t in args.tokens.split(",")):
                xs = [torch.randn(m, D, generator=gen, device="cuda").bfloat16()
                      for _ in range(COPIES)]  # fmt: skip
                logits = [logits_for(routing, m, gen) for _ in range(COPIES)]
                touched = [route_ref(lg, bias, K, SCALING)[1].unique().numel() for lg in logits]
                library = [
                    library_layer(xs[c], routers[c], bias, logits[c], experts, shared[c])
                    for c in range(COPIES)
                ] if library_runs else None  # fmt: skip
                nbytes = (
                    sum(touched) / COPIES * expert_bytes + expert_bytes + routers[0].nbytes
                    + xs[0].nbytes * 2 + logits[0].nbytes
                )  # fmt: skip
                floor = nbytes / bw * 1e6
                if library is not None:
                    library_us = graph_calls_us(library)
                    want = library[0]().double()
                else:  # the check's yardstick: vLLM's FP8 sequence route by route
                    library_us = None
                    want = fp8_layer_ref(xs[0], bias, logits[0], experts, shared[0]).double()
                base = {"tp": tp, "M": m, "routing": routing, "floor_us": floor,
                        "library_us": library_us, "touched_experts": sum(touched) / COPIES,
                        "bytes": nbytes}  # fmt: skip
                for path, path_ops in ops.items():
                    for c, op in enumerate(path_ops):
                        router_ops[c].prepare([m])
                        op.prepare([m])
                        beside[c].prepare([m])
                    if path == "fused_router":
                        if routing == "uniform":
                            rows.append(gated_row(path_ops, router_ops, xs, base, expert_bytes,
                                                  bw, m))  # fmt: skip
                            print(json.dumps(rows[-1]))
                        continue
                    fns = [
                        layer_call(router_ops[c], op, beside[c] if side(path) else None, stream,
                                   xs[c], logits[c])
                        for c, op in enumerate(path_ops)
                    ]  # fmt: skip
                    got = fns[0]()[1].double()
                    err = ((got - want).norm() / want.norm()).item()
                    us = graph_calls_us(fns)
                    rows.append({**base, "path": path, "us": us, "floor_ratio": us / floor,
                                 "speedup_vs_library": ratio(library_us, us), "rel_error": err,
                                 "launches": call_launches(fns[0])})  # fmt: skip
                    if args.sweep:
                        touched_bytes = sum(touched) / COPIES + 1
                        floors = {
                            "gate_up": touched_bytes * (w13[0].nbytes + s13[0].nbytes) / bw * 1e6,
                            "down": touched_bytes * (w2[0].nbytes + s2[0].nbytes) / bw * 1e6,
                        }
                        rows[-1]["sweep"] = sweep(path_ops, router_ops, xs, logits, m, floors)
                    print(json.dumps(rows[-1]))
                if kernels is not None:
                    fns = [vllm_layer(kernels, xs[c], routers[c], bias, logits[c], experts,
                                      shared[c]) for c in range(COPIES)]  # fmt: skip
                    got = fns[0]().double()
                    us = graph_calls_us(fns)
                    rows.append({**base, "path": "vllm", "us": us, "floor_ratio": us / floor,
                                 "speedup_vs_library": ratio(library_us, us),
                                 "rel_error": ((got - want).norm() / want.norm()).item(),
                                 "launches": call_launches(fns[0])})  # fmt: skip
                    print(json.dumps(rows[-1]))
                if m in ref_tokens:
                    refs = [reference_layer(xs[c], routers[c], bias, logits[c], experts,
                                            shared[c]) for c in range(2)]  # fmt: skip
                    us = graph_calls_us(refs, iters=5)
                    rows.append({**base, "path": "reference", "us": us, "floor_ratio": us / floor,
                                 "speedup_vs_library": ratio(library_us, us)})  # fmt: skip
                    print(json.dumps(rows[-1]))
                if library is not None:
                    rows.append({**base, "path": "library", "us": library_us,
                                 "floor_ratio": library_us / floor, "speedup_vs_library": 1.0,
                                 "launches": call_launches(library[0])})  # fmt: skip
        del experts, w13, s13, w2, s2, ops, shared
        torch.cuda.empty_cache()
    result = {
        **provenance("moe_decode", args),
        "bandwidth_tbps": bw / 1e12,
        "library": "cuBLAS router (FP32 out) + torch routing ops + torch._scaled_mm block-"
        "scaled per touched expert (touched set known on the host) + torch quantization / "
        "SwiGLU / index_add ops; the shared expert the same way",
        "vllm": VLLM_ROW if kernels else None,
        "vllm_files": kernels.manifest if kernels else None,
        "seconds": time.perf_counter() - start,
        "rows": rows,
    }
    write_result(args.out, result)


def table(path: str) -> str:
    """Markdown: us (floor ratio) per path, per tp / routing / M."""
    with open(path) as f:
        result = json.load(f)
    paths = [p for p in (*PATHS, "vllm", "library", "reference")
             if any(r["path"] == p for r in result["rows"])]  # fmt: skip
    lines = [
        f"{result['gpu']}, {result['date']}, commit {result['commit']}: µs per MoE layer "
        "(× HBM floor); launches per layer in brackets",
        "",
        "| TP | routing | M | floor µs | " + " | ".join(paths) + " |",
        "|---|---|---|---|" + "---|" * len(paths),
    ]
    cases: dict[tuple, dict] = {}
    for r in result["rows"]:
        cases.setdefault((r["tp"], r["routing"], r["M"]), {})[r["path"]] = r
    for (tp, routing, m), by in cases.items():
        cells = []
        for p in paths:
            r = by.get(p)
            launches = f" [{r['launches']}]" if r and r.get("launches") else ""
            cells.append(f"{r['us']:.1f} ({r['floor_ratio']:.2f}×){launches}" if r else "–")
        floor = next(iter(by.values()))["floor_us"]
        lines.append(f"| {tp} | {routing} | {m} | {floor:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
