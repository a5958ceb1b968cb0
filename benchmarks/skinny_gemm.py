"""Skinny GEMMs of GLM-5.3-Flash decode on one GPU: every op of a TP-1 and a TP-4 rank
(glm5_kernels.gemm.shapes) at M in {1, 2, 4, 8, 16, 32, 64} tokens, ours vs the stock path
built from the best library here, and vs the HBM floor.

Stock: BF16 -> cuBLAS (`x @ wᵀ`; router: `torch.mm(..., out_dtype=float32)` where torch has
it, else cuBLAS BF16 + cast); FP8 -> torch._scaled_mm with 1x128 / 128x128 block scales
(CUTLASS) on activations quantized beforehand (the quantization is *not* charged to stock);
FP8 MLP -> the same two GEMMs plus torch's SwiGLU and quantization ops. Floor: weights +
scales + activations + outputs / `glm5_kernels.timing.hbm_bandwidth` measured in the same run.
Timing: each op is captured many times in one CUDA graph over rotating weight copies that
together exceed 4x L2 (every call streams cold weights); median over replays / calls.
Every timed op is first checked against its FP64 reference.

`--chain` also times each projection (not the dense MLP) as the step runs it: after a kernel
it depends on. A link is `handoff_kernel` (it writes the projection's input from the
previous link's output, after its PDL wait) then the projection; the links, each on its own
weights, in one graph. `chain_us` is a link's time with PDL (the projection's first weight
lines requested before its wait, under the handoff), `chain_no_pdl_us` the same launches
without it; `chain_hbm_fraction` the projection's floor over `chain_us` (the handoff, a few
KB, is charged to the link).

    PYTHONPATH=packages/glm5-kernels/src python benchmarks/skinny_gemm.py \\
        --out benchmarks/results/skinny_gemm_h200.json
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

import torch
import triton
import triton.language as tl
from provenance import provenance, result_args, write_result
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from glm5_kernels.gemm import (
    DenseMlp,
    Fp8Linear,
    Projection,
    Router,
    Tile,
    fp8_linear_ref,
    fp8_mlp_ref,
    linear_ref,
    quantize_tokens_fp8_ref,
)
from glm5_kernels.gemm.library import (
    block_fp8_supported,
    fp8_linear_library,
    scaled_mm_block,
    supports,
)
from glm5_kernels.gemm.shapes import flash_shapes
from glm5_kernels.quant import quantize_fp8_block_ref
from glm5_kernels.timing import graph_calls_us, hbm_bandwidth


def stock_fp8(x, w, s):
    """torch._scaled_mm with block scales on pre-quantized activations (None: unsupported),
    its rows padded to 16 beforehand, as a stock CUTLASS block-FP8 path pads them."""
    if block_fp8_supported(x.device) is None or not supports(w):
        return None
    xq, sx = quantize_tokens_fp8_ref(torch.nn.functional.pad(x, (0, 0, 0, -x.shape[0] % 16)))
    return lambda xq=xq, sx=sx: scaled_mm_block(xq, sx, w, s)


def projection(kind, n, k, gen):
    """(op, its weights) of a projection shape: BF16 (`bf16`, `router`: FP32 out) or
    block-FP8 weights (w, scales), random at unit output scale."""
    w = torch.randn(n, k, generator=gen, device="cuda") / k**0.5
    if kind == "fp8":
        wq, s = quantize_fp8_block_ref(w)
        return Fp8Linear(wq, s), (wq, s)
    w = w.bfloat16()
    return (Router(w) if kind == "router" else Projection(w)), (w,)


def build(kind, n, k, m, copies, gen, tile: Tile | None):
    """(ours, stock, stock name, bytes touched, max relative error, tile, unreduced) for one
    shape; unreduced: for FP8 GEMMs that split K, the same launches leaving their FP32
    partials unsummed (as DenseMlp's gate_up does): the split-K fixup's cost is the gap."""
    x = torch.randn(m, k, generator=gen, device="cuda").bfloat16()
    ours, stock, unreduced, nbytes, err = [], [], [], 0, 0.0
    name = "cublas"
    for _ in range(copies):
        if kind in ("bf16", "router"):
            op, (w,) = projection(kind, n, k, gen)
            out_bytes = m * n * (4 if kind == "router" else 2)
            nbytes = w.nbytes + x.nbytes + out_bytes
            if kind == "router":
                try:
                    torch.mm(x, w.T, out_dtype=torch.float32)
                    stock.append(lambda x=x, w=w: torch.mm(x, w.T, out_dtype=torch.float32))
                    name = "cublas (out_dtype=fp32)"
                except (RuntimeError, TypeError):
                    stock.append(lambda x=x, w=w: (x @ w.T).float())
                    name = "cublas + cast"
            else:
                stock.append(lambda x=x, w=w: x @ w.T)
            ref = linear_ref(x, w, torch.float64)
        elif kind == "fp8":
            op, (wq, s) = projection(kind, n, k, gen)
            nbytes = wq.nbytes + s.nbytes + x.nbytes + m * n * 2
            fn = stock_fp8(x, wq, s)
            if fn is not None:
                stock.append(fn)
                name = "torch._scaled_mm block-scaled (activations pre-quantized)"
            ref = fp8_linear_ref(x, wq, s, out_dtype=torch.float64)
        else:  # mlp: n = 2I, k = D
            i = n // 2
            q13, s13 = quantize_fp8_block_ref(torch.randn(n, k, generator=gen, device="cuda"))
            q2, s2 = quantize_fp8_block_ref(torch.randn(k, i, generator=gen, device="cuda"))
            op = DenseMlp(q13, s13, q2, s2, 10.0)
            nbytes = q13.nbytes + s13.nbytes + q2.nbytes + s2.nbytes + 2 * x.nbytes
            up, down = stock_fp8(x, q13, s13), None
            if up is not None:
                h = up()[:m]
                a = torch.nn.functional.silu(h[:, :i].clamp(max=10.0)) * h[:, i:].clamp(-10, 10)
                down = stock_fp8(a.bfloat16(), q2, s2)
            if down is not None:

                def mlp(x=x, q13=q13, s13=s13, q2=q2, s2=s2, i=i):
                    h = fp8_linear_library(x, q13, s13)
                    g = torch.nn.functional.silu(h[:, :i].clamp(max=10.0))
                    return fp8_linear_library((g * h[:, i:].clamp(-10, 10)).bfloat16(), q2, s2)

                stock.append(mlp)
                name = "torch._scaled_mm x2 + torch SwiGLU / quantization ops"
            ref = fp8_mlp_ref(x, q13, s13, q2, s2, 10.0).double()  # the stock sequence's values
        if tile is not None:
            op.tiles[m] = tile
        op.prepare([m])
        y = op(x).double()
        err = max(err, ((y - ref).norm() / ref.norm()).item())
        ours.append(lambda op=op, x=x: op(x))
        if kind == "fp8" and op.tiles[m].split_k > 1:
            unreduced.append(lambda op=op, x=x: op._split_partials(x, m))
    plan = getattr(op, "tiles", {}).get(m)
    return ours, stock, name, nbytes, err, plan and vars(plan), unreduced


@triton.jit
def handoff_kernel(y_ptr, x_ptr, total, K, N, stride_y, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """x[m, k] = y[m, k % N] as BF16: the next projection's input written from the previous
    one's output, so each link depends on the one before (as a projection depends on the
    boundary or the attention core before it in the step). It releases its dependent right
    after its wait, as a small kernel of the step does."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < total
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    m, k = offs // K, offs % K
    y = tl.load(y_ptr + m * stride_y + k % N, mask=live, other=0.0)
    tl.store(x_ptr + offs, y.to(tl.bfloat16), mask=live)


def chain(kind, n, k, m, copies, gen, pdl: bool) -> float:
    """µs a link of the dependent chain (the module docstring): `copies` projections of the
    shape on their own weights, each after the handoff from the one before; pdl False:
    every launch of the chain without PDL (the projections' tiles too)."""
    ops, xs, ys = [], [], []
    for _ in range(copies):
        op = projection(kind, n, k, gen)[0]
        tile = op.tiles[m]
        op.tiles[m] = replace(tile, pdl=pdl and tile.pdl, prefetch=tile.prefetch if pdl else 0)
        op.prepare([m])
        ops.append(op)
        xs.append(torch.randn(m, k, generator=gen, device="cuda").bfloat16())
        ys.append(torch.randn(m, n, generator=gen, device="cuda").to(op.out_dtype))
    block = 1024
    grid = (-(-m * k // block),)

    def link(i: int) -> None:
        y, x = ys[i - 1], xs[i]
        handoff_kernel[grid](y, x, m * k, k, n, y.stride(0), BLOCK=block, PDL=pdl,
                             launch_pdl=pdl)  # fmt: skip
        ops[i](x, out=ys[i])

    return graph_calls_us([lambda i=i: link(i) for i in range(copies)])


def copies_for(nbytes: int, l2: int) -> int:
    return max(2, min(24, -(-4 * l2 // nbytes)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", default="1,4")
    parser.add_argument("--tokens", default="1,2,4,8,16,32,64")
    parser.add_argument("--ops", default="", help="comma-separated op names (default: all)")
    parser.add_argument("--sweep", action="store_true", help="also time alternative tiles")
    parser.add_argument("--chain", action="store_true",
                        help="also time each projection after a kernel it depends on, PDL on "
                        "and off")  # fmt: skip
    result_args(parser)
    args = parser.parse_args()
    if args.table:
        print(table(args.table))
        chained = chain_table(args.table)
        if chained:
            print("\n" + chained)
        return
    gen = torch.Generator("cuda").manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    bw = hbm_bandwidth()
    peak = bw["floor"]
    print(f"{props.name}: read {bw['read'] / 1e12:.2f} TB/s, copy {bw['copy'] / 1e12:.2f} TB/s")
    rows = []
    start = time.perf_counter()
    for tp in (int(t) for t in args.tp.split(",")):
        for op_name, (kind, n, k) in flash_shapes(tp).items():
            if args.ops and op_name not in args.ops.split(","):
                continue
            for m in (int(t) for t in args.tokens.split(",")):
                weight = n * k * {"bf16": 2, "router": 2, "fp8": 1, "mlp": 1.5}[kind]
                copies = copies_for(int(weight), props.L2_cache_size)
                built = build(kind, n, k, m, copies, gen, None)
                ours, stock, stock_name, nbytes, err, tile, unreduced = built
                row = {
                    "tp": tp, "op": op_name, "kind": kind, "n": n, "k": k, "m": m,
                    "bytes": nbytes, "floor_us": nbytes / peak * 1e6,
                    "ours_us": graph_calls_us(ours), "max_rel_error": err,
                    "tile": tile,
                    "stock": stock_name if stock else None,
                    "stock_us": graph_calls_us(stock) if stock else None,
                    "unreduced_us": graph_calls_us(unreduced) if unreduced else None,
                }  # fmt: skip
                row["hbm_fraction"] = row["floor_us"] / row["ours_us"]
                row["speedup_vs_stock"] = (
                    row["stock_us"] / row["ours_us"] if row["stock_us"] else None
                )
                if args.chain and kind != "mlp":
                    row["chain_us"] = chain(kind, n, k, m, copies, gen, pdl=True)
                    row["chain_no_pdl_us"] = chain(kind, n, k, m, copies, gen, pdl=False)
                    row["chain_hbm_fraction"] = row["floor_us"] / row["chain_us"]
                if args.sweep and kind != "mlp":
                    row["sweep"] = sweep(kind, n, k, m, copies, gen, row["tile"])
                print(
                    f"tp{tp} {op_name:18s} m={m:2d} {nbytes / 1e6:8.1f} MB  ours "
                    f"{row['ours_us']:8.1f} us ({row['hbm_fraction']:.0%} HBM)  stock "
                    + (f"{row['stock_us']:8.1f} us" if row["stock_us"] else "    n/a")
                    + f"  err {err:.1e}"
                    + (f"  unreduced {row['unreduced_us']:.1f} us" if unreduced else "")
                    + (
                        f"  chain {row['chain_us']:.1f} us ({row['chain_hbm_fraction']:.0%} HBM),"
                        f" no PDL {row['chain_no_pdl_us']:.1f}"
                        if "chain_us" in row
                        else ""
                    ),
                    flush=True,
                )
                rows.append(row)
                del ours, stock, unreduced
                torch.cuda.empty_cache()
    write_result(args.out, {
        **provenance("skinny_gemm", args),
        "sms": props.multi_processor_count,
        "bandwidth_tbps": {k: v / 1e12 for k, v in bw.items()},
        "seconds": time.perf_counter() - start,
        "rows": rows,
    })  # fmt: skip


def table(path: str) -> str:
    """A results JSON as the markdown table of the glm5-kernels README."""
    with open(path) as f:
        result = json.load(f)
    rows = result["rows"]
    ms = (1, 8, 16, 64)
    out = [
        "| TP | op | MB | µs at M = 1 / 8 / 16 / 64 | % of HBM floor | × stock |",
        "| --- | --- | --: | --- | --- | --- |",
    ]
    for tp in sorted({r["tp"] for r in rows}):
        for op in dict.fromkeys(r["op"] for r in rows if r["tp"] == tp):
            at = {r["m"]: r for r in rows if r["tp"] == tp and r["op"] == op}
            if not all(m in at for m in ms):
                continue
            us = " / ".join(f"{at[m]['ours_us']:.1f}" for m in ms)
            hbm = " / ".join(f"{at[m]['hbm_fraction']:.0%}" for m in ms)
            vs = " / ".join(
                f"{at[m]['speedup_vs_stock']:.2f}" if at[m]["speedup_vs_stock"] else "n/a"
                for m in ms
            )
            out.append(f"| {tp} | {op} | {at[1]['bytes'] / 1e6:.1f} | {us} | {hbm} | {vs} |")
    return "\n".join(out)


def chain_table(path: str, m: int = 1) -> str:
    """The `--chain` rows at M = m as a markdown table: a projection's link after a kernel it
    depends on, with and without PDL ("" where the run had no `--chain`)."""
    with open(path) as f:
        rows = [r for r in json.load(f)["rows"] if "chain_us" in r and r["m"] == m]
    if not rows:
        return ""
    out = [
        "| TP | op | MB | alone µs | chain µs (% of HBM floor) | no PDL µs | PDL gain |",
        "| --- | --- | --: | --: | --: | --: | --: |",
    ]
    for r in rows:
        gain = r["chain_no_pdl_us"] / r["chain_us"] - 1
        out.append(
            f"| {r['tp']} | {r['op']} | {r['bytes'] / 1e6:.1f} | {r['ours_us']:.1f} "
            f"| {r['chain_us']:.1f} ({r['chain_hbm_fraction']:.0%}) | {r['chain_no_pdl_us']:.1f} "
            f"| {gain:+.0%} |"
        )
    return "\n".join(out)


def sweep(kind, n, k, m, copies, gen, chosen: dict) -> list[dict]:
    """One field at a time around the plan's tile: BN, split-K, stages, PDL and prefetch."""
    base = Tile(**chosen)
    k_tiles = -(-k // base.bk)
    options = {
        "bn": (32, 64, 128),
        "split_k": (1, max(1, base.split_k // 2), min(k_tiles, base.split_k * 2), 8, 16),
        "stages": (3, 4, 5, 6),
        "prefetch": (0, 2, 8),
        "warps": (8,),
    }
    if kind == "fp8":
        options["quantize_first"] = (not base.quantize_first,)
    variants = {replace(base, **{f: v}) for f, vs in options.items() for v in vs}
    variants |= {replace(base, pdl=False, prefetch=0), replace(base, bn=128, warps=8)}
    if kind == "fp8":  # K blocks per step with the stages that keep ~the same bytes in flight
        variants |= {replace(base, blocks=1, stages=s) for s in (3, 6)}
        variants |= {replace(base, blocks=2, stages=s) for s in (2, 4)}
    elif k % 256 == 0:  # 512-byte row segments per step (fewer, longer DRAM bursts)
        variants |= {replace(base, bk=256, stages=s) for s in (2, 3, 4)}
    out = []
    for t in sorted(variants - {base}, key=lambda t: tuple(vars(t).values())):
        if t.split_k > k_tiles:
            continue
        try:
            ours = build(kind, n, k, m, copies, gen, t)[0]
            out.append({**vars(t), "us": graph_calls_us(ours, 7)})
        except Exception as e:  # an infeasible tile (shared memory) is a data point too
            out.append({**vars(t), "error": str(e).splitlines()[0][:120]})
    return out


if __name__ == "__main__":
    main()
