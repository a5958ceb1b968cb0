"""The reference backbone's decode step on one GPU: build a geometry (default
flash-tp4-rank: what one rank of a TP4 deployment holds), pin every request at a context
length, capture one decode step (backbone + logits) in a CUDA graph and time its replay.

This is the stock side that specialized kernels are measured against, not a fast path.
With one rank held, the TP reduce is the identity (no peers), so the numbers are one
rank's compute and memory traffic, without all-reduce latency.

    PYTHONPATH=packages/glm5-kernels/src:packages/glm5-runtime/src \\
        python benchmarks/reference_decode.py --out benchmarks/results/reference_decode_h200.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from provenance import provenance, write_result

from glm5_kernels.timing import replay_times
from glm5_runtime.bench import floor_bytes
from glm5_runtime.reference import ReferenceModel, geometry


def hbm_bandwidth(gib: int = 4) -> float:
    """Bytes/s of a device-to-device copy (read + write), median of graph replays."""
    src = torch.empty(gib << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dst.copy_(src)
    ms = statistics.median(replay_times(graph, 10))
    return 2 * src.numel() / (ms * 1e-3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--geometry", default="flash-tp4-rank")
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    g = geometry(args.geometry)
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    model = ReferenceModel.random(
        g, seed=0, device="cuda", max_requests=max(batches), max_context=args.context + 8
    )
    torch.cuda.synchronize()
    build_s = time.perf_counter() - start
    held = sum(t.numel() * t.element_size() for rank in model.ranks for t in rank.w.values())
    print(
        f"built {args.geometry} in {build_s:.0f}s: weights {held / 2**30:.1f} GiB, "
        f"allocated {torch.cuda.memory_allocated() / 2**30:.1f} GiB"
    )
    bandwidth = hbm_bandwidth()
    print(f"HBM copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    rows = []
    for b in batches:
        requests = list(range(b))
        positions = torch.full((b, 1), args.context, device="cuda")
        step = model.place(requests, positions)
        tokens = torch.randint(0, g.vocab_size, (b, 1), device="cuda")
        with torch.no_grad():
            model.logits(model.backbone(tokens, step))  # warm up outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                model.logits(model.backbone(tokens, step))
        replay_times(graph, 2)
        ms = replay_times(graph, args.iters)
        row = {
            "batch": b,
            "context": args.context,
            "median_ms": statistics.median(ms),
            "min_ms": min(ms),
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
            "floor_bytes": floor_bytes(model, b, args.context),
        }
        row["floor_ms"] = row["floor_bytes"] / bandwidth * 1e3
        row["ratio_to_floor"] = row["median_ms"] / row["floor_ms"]
        print(row)
        rows.append(row)
        del graph
        torch.cuda.empty_cache()
    write_result(args.out, {
        **provenance("reference_decode", args),
        "geometry": args.geometry,
        "build_seconds": build_s,
        "weights_gib": held / 2**30,
        "hbm_copy_bandwidth_tbps": bandwidth / 1e12,
        "rows": rows,
    })  # fmt: skip


if __name__ == "__main__":
    main()
