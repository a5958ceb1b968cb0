"""GPU timing for benchmarks: CUDA-graph replays timed with one CUDA event pair each."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import torch

__all__ = ["graph_calls_us", "replay_times"]


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


def graph_calls_us(
    fns: Sequence[Callable[[], object]], iters: int = 15, warmup_ms: float = 25.0
) -> float:
    """Median microseconds per call of `fns` run back to back in one CUDA graph (each run once
    eagerly first, so nothing compiles or allocates for the first time inside the capture).

    The graph replays for `warmup_ms` before the timed replays: after an idle gap (a compile,
    building weights) the GPU's clocks take milliseconds to come back, and a few timed
    replays of a short graph would otherwise measure the ramp (seen on the H200: the first
    shape timed after its compile 5-10 % slower than the same launches timed again)."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    first = replay_times(graph, 1)[0]
    for _ in range(int(warmup_ms / max(first, 1e-3))):
        graph.replay()
    ms = statistics.median(replay_times(graph, iters))
    del graph
    return ms * 1e3 / len(fns)
