"""GPU timing for benchmarks: CUDA-graph replays timed with one CUDA event pair each, and the
one HBM bandwidth figure every floor in the project divides by."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import torch

__all__ = ["graph_calls_us", "hbm_bandwidth", "replay_times"]


def replay_times(graph: torch.cuda.CUDAGraph, iters: int) -> list[float]:
    """Milliseconds of each of `iters` replays of `graph`."""
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def warm_up(graph: torch.cuda.CUDAGraph, ms: float = 25.0) -> None:
    """Replay `graph` for about `ms`: after an idle gap (a compile, building weights) the
    GPU's clocks take milliseconds to come back, and a few timed replays of a short graph
    would otherwise measure the ramp (seen on the H200: the first shape timed after its
    compile 5-10 % slower than the same launches timed again)."""
    first = replay_times(graph, 1)[0]
    for _ in range(max(2, int(ms / max(first, 1e-3)))):  # a long graph: two more replays
        graph.replay()


def graph_calls_us(
    fns: Sequence[Callable[[], object]], iters: int = 15, warmup_ms: float = 25.0
) -> float:
    """Median microseconds per call of `fns` run back to back in one CUDA graph (each run once
    eagerly first, so nothing compiles or allocates for the first time inside the capture),
    after `warm_up`."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    warm_up(graph, warmup_ms)
    ms = statistics.median(replay_times(graph, iters))
    del graph
    return ms * 1e3 / len(fns)


def hbm_bandwidth() -> dict[str, float]:
    """Bytes/s of HBM, measured as every floor here is judged: a 4 GiB read-only reduction
    (torch's), the same read as a plain Triton stream (`stream_read.stream_sum` at 16 and 32
    programs an SM; where Triton imports) and a 2 GiB device copy (read + write), each a
    warmed-up CUDA-graph median. "floor" is the best of them: the figure every floor
    (bytes ÷ bandwidth) divides by, so no floor is easier than what a plain read or copy
    reaches on this GPU."""
    big = torch.ones(1 << 31, dtype=torch.bfloat16, device="cuda")
    read = graph_calls_us([lambda b=big: torch.sum(b, dtype=torch.float32)] * 4)
    bw = {"read": big.nbytes / (read * 1e-6)}
    try:
        from .stream_read import stream_sum
    except ImportError:  # no Triton: torch's read and the copy
        pass
    else:
        sms = torch.cuda.get_device_properties(big.device).multi_processor_count
        out = torch.empty(32 * sms, dtype=torch.float32, device=big.device)
        stream = min(
            graph_calls_us([lambda p=p, b=big: stream_sum(b, p, out=out)] * 4)
            for p in (16 * sms, 32 * sms)
        )
        bw["stream"] = big.nbytes / (stream * 1e-6)
    src = big.view(torch.uint8)[: 2 << 30]
    dst = torch.empty_like(src)
    copy = graph_calls_us([lambda d=dst, s=src: d.copy_(s)] * 4)
    bw["copy"] = 2 * src.nbytes / (copy * 1e-6)
    del big, dst
    torch.cuda.empty_cache()
    return {**bw, "floor": max(bw.values())}
