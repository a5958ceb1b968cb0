"""How close to the HBM floor can one call that reads W bytes get, measured as the skinny
GEMMs are (benchmarks/skinny_gemm.py: calls back to back in one CUDA graph over rotating
copies that exceed 4x L2, median per call)? For weight sizes from 8 MB to the 1.27 GB LM
head: a plain Triton streaming read (the best of several grid sizes and block widths), torch's
reduction, the one-token GEMV of cuBLAS (`x @ wᵀ`) and glm5-kernels' Projection. The fraction
of the floor a pure read reaches at a size is the ceiling any weight-streaming kernel of that
size can reach under this method.

The read is also timed under programmatic dependent launch (PDL), each call releasing its
successor at entry: "dependent" waits for its predecessor before reading, as a GEMM must
(its activations come from the predecessor) — the launch overlaps, the read does not;
"independent" waits only before its store, so successive reads overlap — a ceiling only a
kernel whose reads need nothing from its predecessor (a weight prefetch) could approach.

`--chains` (instead of the single reads) bounds each skinny-GEMM op of >= 20 MB
(glm5_kernels.gemm.shapes, TP 1 and 4) by its launch structure: one call is the op's launches
in order, each a dependent PDL read of the bytes that launch streams (a Projection: its
weight; an Fp8Linear: the activations' quantization, then weight + scales; an FP8 MLP:
quantization, gate_up, the SwiGLU's quantization, down), each at its best grid. No kernel
with those launches, each waiting for its inputs before it reads, is faster than its chain of
pure reads.

    PYTHONPATH=packages/glm5-kernels/src python benchmarks/read_ceiling.py \\
        --out benchmarks/results/read_ceiling_h200.json
    PYTHONPATH=packages/glm5-kernels/src python benchmarks/read_ceiling.py --chains \\
        --out benchmarks/results/launch_ceiling_h200.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).parent))
from provenance import provenance, result_args, write_result
from skinny_gemm import copies_for

from glm5_kernels.gemm import Projection
from glm5_kernels.gemm.shapes import flash_shapes
from glm5_kernels.stream_read import stream_sum
from glm5_kernels.timing import graph_calls_us, hbm_bandwidth

K = 4096  # weights as [N, 4096] BF16 (the model's hidden size)
SIZES_MB = (8, 16, 20, 24, 34, 48, 70, 100, 200, 400, 1270)
SCOPE = 20e6  # the goal's scope: weights of at least 20 MB
ACTIVATIONS = 16 * 4096 * 2  # what a quantization launch reads at 16 tokens (BF16)


def read_fn(w: torch.Tensor, programs: int, block: int, pdl: int = 0):
    """A call of the plain streaming read (`glm5_kernels.stream_read`) over w, and its
    output buffer."""
    out = torch.empty(programs, dtype=torch.float32, device=w.device)
    return (lambda: stream_sum(w, programs, block, out=out, pdl=pdl)), out


def launches(kind: str, n: int, k: int) -> list[int]:
    """Bytes each launch of one skinny-GEMM op streams, in launch order."""
    if kind in ("bf16", "router"):
        return [2 * n * k]
    scales = -(-n // 128) * -(-k // 128) * 4
    if kind == "fp8":
        return [ACTIVATIONS, n * k + scales]
    i = n // 2  # mlp: gate_up [2I, D], down [D, I]
    return [ACTIVATIONS, n * k + scales, 2 * i * 16 * 2, k * i + scales // 2]


def best_read(ws: list[torch.Tensor], pdl: int, grids: tuple[int, ...]) -> tuple[float, int, int]:
    """(us, programs, block) of the fastest read of the flat BF16 tensors `ws` (rotated)
    over `grids` x block widths, each checked against torch's sum."""
    best = None
    for programs in grids:
        for block in (1024, 2048, 4096):
            fns = [read_fn(w, programs, block, pdl)[0] for w in ws]
            out = fns[-1]()
            torch.cuda.synchronize()
            want = ws[-1].double().sum()
            assert torch.allclose(out.double().sum(), want, rtol=1e-3, atol=1.0)
            us = graph_calls_us(fns)
            if best is None or us < best[0]:
                best = (us, programs, block)
    return best


def best_dependent_read(nbytes: int, sms: int, cache: dict) -> tuple[float, int, int]:
    """(us, programs, block) of the fastest dependent PDL read of `nbytes` (cached)."""
    if nbytes not in cache:
        copies = copies_for(nbytes, torch.cuda.get_device_properties(0).L2_cache_size)
        ws = [torch.randn(nbytes // 2, device="cuda").bfloat16() for _ in range(copies)]
        cache[nbytes] = best_read(ws, 1, (sms, 4 * sms, 8 * sms, 16 * sms, 32 * sms))
    return cache[nbytes]


def chain_ceilings(sms: int, peak: float, l2: int) -> list[dict]:
    """Each >= 20 MB op's launch structure as back-to-back dependent reads (see the module
    docstring): the fastest a kernel with those launches can be under this timing."""
    rows, cache = [], {}
    for tp in (1, 4):
        for op, (kind, n, k) in flash_shapes(tp).items():
            reads = launches(kind, n, k)
            if sum(reads[1::2] if len(reads) > 1 else reads) < SCOPE:  # weights + scales
                continue
            configs = [best_dependent_read(b, sms, cache) for b in reads]
            copies = copies_for(sum(reads), l2)
            bufs = [[torch.ones(b // 2, device="cuda", dtype=torch.bfloat16) for b in reads]
                    for _ in range(copies)]  # fmt: skip
            calls = []
            for chain in bufs:
                fns = [read_fn(w, c[1], c[2], 1)[0] for w, c in zip(chain, configs, strict=True)]
                calls.append(lambda fns=fns: [fn() for fn in fns])
            chain_us = graph_calls_us(calls)
            floor_us = sum(reads) / peak * 1e6
            row = {
                "tp": tp, "op": op, "kind": kind, "launch_mb": [b / 1e6 for b in reads],
                "floor_us": floor_us, "chain_us": chain_us, "fraction": floor_us / chain_us,
                "launch_us_alone": [c[0] for c in configs],
            }  # fmt: skip
            print(
                f"tp{tp} {op:16s} launches {', '.join(f'{b / 1e6:.2f}' for b in reads)} MB: "
                f"chain {chain_us:6.1f} us, floor {floor_us:6.1f} us ({row['fraction']:.0%})",
                flush=True,
            )
            rows.append(row)
            del bufs, calls
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    result_args(parser, table=False)
    parser.add_argument("--chains", action="store_true",
                        help="time the ops' launch chains instead of the single reads")  # fmt: skip
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    bw = hbm_bandwidth()
    peak = bw["floor"]
    sms = props.multi_processor_count
    print(f"{props.name}: read {bw['read'] / 1e12:.2f} TB/s, copy {bw['copy'] / 1e12:.2f} TB/s")
    rows = []
    for mb in () if args.chains else SIZES_MB:
        n = round(mb * 1e6 / (2 * K) / 64) * 64
        nbytes = n * K * 2
        copies = copies_for(nbytes, props.L2_cache_size)
        ws = [torch.randn(n, K, device="cuda").bfloat16() for _ in range(copies)]
        floor_us = nbytes / peak * 1e6
        # The streaming read, checked against torch's sum, at its best grid / block width.
        grids = (4 * sms, 8 * sms, 16 * sms, 32 * sms)
        keys = ("read", "read_pdl_dependent", "read_pdl_independent")
        reads = {
            key: best_read([w.view(-1) for w in ws], pdl, grids) for pdl, key in enumerate(keys)
        }
        best = reads["read"]
        x = torch.randn(1, K, device="cuda").bfloat16()
        torch_sum = graph_calls_us([lambda w=w: torch.sum(w, dtype=torch.float32) for w in ws])
        cublas = graph_calls_us([lambda w=w, x=x: x @ w.T for w in ws])
        projections = [Projection(w, [1]) for w in ws]
        for p in projections:
            p.prepare([1])
        ours = graph_calls_us([lambda p=p, x=x: p(x) for p in projections])
        row = {
            "mb": nbytes / 1e6, "n": n, "k": K, "floor_us": floor_us,
            "read_us": best[0], "read_programs": best[1], "read_block": best[2],
            "read_pdl_dependent_us": reads["read_pdl_dependent"][0],
            "read_pdl_independent_us": reads["read_pdl_independent"][0],
            "torch_sum_us": torch_sum, "cublas_gemv_us": cublas, "projection_us": ours,
        }  # fmt: skip
        for key in (*reads, "torch_sum", "cublas_gemv", "projection"):
            row[f"{key}_fraction"] = floor_us / row[f"{key}_us"]
        print(
            f"{row['mb']:7.1f} MB floor {floor_us:7.1f} us | read {best[0]:7.1f} "
            f"({row['read_fraction']:.0%}) pdl dep {row['read_pdl_dependent_fraction']:.0%} "
            f"indep {row['read_pdl_independent_fraction']:.0%} "
            f"sum {torch_sum:7.1f} ({row['torch_sum_fraction']:.0%}) "
            f"cuBLAS {cublas:7.1f} ({row['cublas_gemv_fraction']:.0%}) ours {ours:7.1f} "
            f"({row['projection_fraction']:.0%})",
            flush=True,
        )
        rows.append(row)
        del ws, projections
        torch.cuda.empty_cache()
    write_result(args.out, {
        **provenance("read_ceiling", args),
        "triton": triton.__version__,
        "bandwidth_tbps": {k: v / 1e12 for k, v in bw.items()},
        "rows": rows,
        "chains": chain_ceilings(sms, peak, props.L2_cache_size) if args.chains else [],
    })  # fmt: skip


if __name__ == "__main__":
    main()
