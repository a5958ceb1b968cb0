"""`glm5-decode bench`: per-step latency of the stock decode steps and the specialized decode
(each step captured in one CUDA graph, median of warmed-up replays), the kernel launches each
captured step holds, a per-stage split of the step that adds up to it, the HBM floor, JSON
results and a PNG plot (`glm5-decode plot`).

Three stocks: `reference`, the reference backbone's plain torch ops (the equivalence oracle);
`torch`, the same step with its linears, experts and KDA recurrence on torch-level
library calls (`glm5_runtime.library`: cuBLAS, torch's block-FP8 `_scaled_mm`, fla's KDA
where it imports); `vllm`, the same step with its routed experts and KDA core on vLLM 0.33's
own Triton kernels, loaded from a folder of the wheel's files (`glm5_runtime.vllm_stock`;
`--vllm-ops DIR`), the path a vLLM user runs for those ops. Where the policy leaves a stage
stock, the specialized side runs that op as the `vllm` stock does when it is timed (as in a
vLLM server; `specialized_stock` in the results), else the reference's.
Each stock names what runs each of its ops in the results (`stock_sources`, `library_kernels`).

`--kernels` adds each step's kernel table (`glm5_runtime.kernel_table`): every kernel by
the stage that launched it, its launches and own time, each stage's bytes and floor ratio.

    glm5-decode bench --geometry flash-tp4-rank --tokens 1,8,64 --kernels --out bench.json
    glm5-decode bench --stock vllm,torch --vllm-ops vllm-files --out bench.json
    glm5-decode plot bench.json --out bench.png
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from contextlib import contextmanager, nullcontext
from datetime import date

import torch

from glm5_kernels.timing import hbm_bandwidth, replay_times, warm_up
from glm5_policy import DecodeConfig

from .decode import SpecializedDecode
from .floor import floor_bytes, touched_experts
from .kernel_table import kernel_table, owner_bytes, owner_rows
from .library import LibraryStock
from .reference import ReferenceModel, geometry
from .reference.backbone import ReferenceBackbone
from .reference.stages import _pages
from .results import BETWEEN, STAGES, plot, table

__all__ = ["StageMarks", "bench_model", "call_launches", "floor_bytes", "graph_nodes", "plot",
           "provenance", "run", "table"]  # fmt: skip


@contextmanager
def _environment(**values: str):
    """The process environment with `values` set, restored after (the stages read GLM5_PDL
    when they are built)."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _progress(done: int, total: int, what: str) -> None:
    bar = "#" * (20 * done // total)
    print(f"\r[{bar:20s}] {done}/{total} {what:48s}", end="", file=sys.stderr, flush=True)
    if done == total:
        print(file=sys.stderr)


def graph_nodes(graph: torch.cuda.CUDAGraph) -> dict[str, int] | None:
    """Nodes of a captured graph (kept: `CUDAGraph(keep_graph=True)`) by kind: "kernel" is
    the launches one replay makes. None where cuda-python is missing."""
    try:
        from cuda.bindings import runtime as rt
    except ImportError:
        return None
    raw = graph.raw_cuda_graph()
    handle = raw if isinstance(raw, rt.cudaGraph_t) else rt.cudaGraph_t(init_value=int(raw))
    err, _, count = rt.cudaGraphGetNodes(handle, 0)
    err, nodes, count = rt.cudaGraphGetNodes(handle, count)
    if err != rt.cudaError_t.cudaSuccess:
        raise RuntimeError(f"cudaGraphGetNodes: {err}")
    kinds: Counter = Counter()
    for node in nodes[:count]:
        _, kind = rt.cudaGraphNodeGetType(node)
        kinds[kind.name.removeprefix("cudaGraphNodeType").lower()] += 1
    return dict(kinds)


class StageMarks:
    """Timing events captured into the step at each stage's start and end (CUDA event record
    nodes): after a replay, the interval from one mark to the next belongs to the stage that
    ran between them (`BETWEEN` outside any stage), so the split adds up to the replay from
    the first mark to the last — the graph's own time, not an eager re-run's."""

    def __init__(self, model: ReferenceModel):
        self.model = model
        self.marks: list[tuple[torch.cuda.Event, str]] = []

    def mark(self, label: str) -> None:
        event = torch.cuda.Event(enable_timing=True, external=True)
        event.record()
        self.marks.append((event, label))

    def _wrap(self, name, fn):
        def marked(*args, **kwargs):
            self.mark(name)
            out = fn(*args, **kwargs)
            self.mark(BETWEEN)
            return out

        return marked

    def __enter__(self) -> StageMarks:
        # A stock's own stage (VllmStock's kda) is wrapped, and put back on exit.
        self.own = [(rank, name, rank.__dict__.get(name)) for rank in self.model.ranks
                    for name in STAGES]  # fmt: skip
        for rank, name, _ in self.own:
            setattr(rank, name, self._wrap(name, getattr(rank, name)))
        return self

    def __exit__(self, *exc) -> None:
        for rank, name, own in self.own:
            rank.__dict__.pop(name, None)
            if own is not None:
                setattr(rank, name, own)

    def split(self) -> dict[str, float]:
        """Milliseconds per stage of the last replay (the marks must have completed)."""
        ms: Counter = Counter()
        for (a, label), (b, _) in zip(self.marks, self.marks[1:], strict=False):
            ms[label] += a.elapsed_time(b)
        return dict(ms)


def call_launches(fn) -> int | None:
    """Kernel launches of one call of `fn` (run once eagerly first, then captured); None
    where cuda-python is missing."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        fn()
    nodes = graph_nodes(graph)
    return None if nodes is None else nodes.get("kernel", 0)


def _fill_caches(model: ReferenceModel, seed: int = 0) -> None:
    """Random caches at the benchmark's context (no step is timed on zeros: zero latents,
    pool keys and states take other paths through softmax, top-k and the recurrence than a
    served request's, and ran faster on the H200). Scales are kept positive and FP8 keys
    finite; the KDA states small enough that the delta rule stays in range."""
    gen = torch.Generator(model.device).manual_seed(seed)

    def randn(t: torch.Tensor, std: float = 1.0) -> torch.Tensor:
        return torch.randn(t.shape, generator=gen, device=t.device) * std

    for rank in model.ranks:
        c = rank.c
        for kind, std in ((c.conv, 1.0), (c.latent, 1.0), (c.tail, 1.0), (c.recurrent, 0.1)):
            for t in kind.values():
                t.copy_(randn(t, std).to(t.dtype))
        for t in c.kpool.values():
            if t.dtype != torch.uint8:
                t.copy_(randn(t).to(t.dtype))
                continue
            keys, scales = _pages(t)  # vLLM's pages: FP8 pool keys, then FP32 scales
            keys.copy_(randn(keys).to(torch.float8_e4m3fn).view(torch.uint8))
            scales.copy_(0.01 + torch.rand(scales.shape, generator=gen, device=t.device) / 100)


def provenance(command: str, args) -> dict:
    """What a `glm5-decode <command>` results file says of its run: the geometry and context
    timed, the GPU, torch, date, commit and command line."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return {
        "benchmark": f"glm5-decode {command}",
        "geometry": args.geometry,
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": date.today().isoformat(),
        "commit": args.commit or commit.stdout.strip() or "unknown",
        "command": f"glm5-decode {command} " + " ".join(sys.argv[2:]),
        "context": args.context,
    }


def bench_model(g, requests: int, context: int, q: int) -> ReferenceModel:
    """The random-weight model a GPU run times: `requests` requests held (context + 16
    tokens of room each), its caches filled at random (`_fill_caches`)."""
    model = ReferenceModel.random(g, seed=0, device="cuda", max_requests=requests,
                                  max_context=context + 16, q=q)  # fmt: skip
    for _ in range(requests):
        model.add()
    _fill_caches(model)
    return model


def _token_ids(model: ReferenceModel, requests: int, q: int) -> torch.Tensor:
    """Token ids [requests, q] in the first held rank's vocabulary slice: a rank embeds only
    its own rows, so with one rank of TP held, other ids would embed to zeros."""
    rows = model.ranks[0].w["embed_tokens.weight"].shape[0]
    first = model.ranks[0].rank * rows
    return torch.randint(first, first + rows, (requests, q), device=model.device)


def _step(model: ReferenceModel, tokens: int, q: int, context: int):
    """A placed decode (q = 1) or verify step of `tokens` rows at `context`."""
    requests = list(range(tokens // q))
    for r in requests:
        model.lengths[r], model.current[r] = context, 0
        model.pending.pop(r, None)
    return requests, model.step(requests, q, verify=q > 1)


def _forward(model, decode, side: str, ids, step):
    """One side's step, eager or captured: the stock backbone's, or the planned one."""

    def forward():
        if side != "specialized":
            return model.logits(model.backbone(ids, step))
        decision = decode.plan(step, capturing=True)
        if decision.step is None:
            raise RuntimeError(f"{step.positions.numel()} tokens not planned: {decision.reason}")
        return decode.compute_logits(decode.run(decision.step, ids, step))

    return forward


def _captured(forward) -> torch.cuda.CUDAGraph:
    forward()  # warm-up outside the capture: compiles, first allocations
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        forward()
    graph.instantiate()
    return graph


def _measure(model, decode, side: str, ids, step, iters: int, unlaunched=None, stock=None) -> dict:
    """One side's step: its graph's median replay ms and nodes, and the per-stage split of a
    second capture with `StageMarks` (its median per stage over the replays); with
    `unlaunched` (the specialized side's decode built with PDL off), its kernel table.
    `stock`: the context that installs a stock side's ops (LibraryStock, VllmStock).
    Replays repeat the step on caches it updated in place, so outputs are not compared here:
    equivalence is tests/glm5_runtime/test_decode*.py's job."""
    forward = _forward(model, decode, side, ids, step)
    library = nullcontext() if stock is None else stock
    table = None
    with torch.no_grad(), library:
        graph = _captured(forward)
        nodes = graph_nodes(graph)
        warm_up(graph)
        ms = statistics.median(replay_times(graph, iters))
        del graph
        marks = StageMarks(model)
        graph = torch.cuda.CUDAGraph()
        with marks, torch.cuda.graph(graph):
            marks.mark(BETWEEN)
            forward()
            marks.mark("end")
        warm_up(graph)
        splits = []
        for _ in range(iters):
            graph.replay()
            torch.cuda.synchronize()
            splits.append(marks.split())
        del graph
        if unlaunched is not None:  # the specialized step again, its stages' PDL off
            forward = _forward(model, unlaunched, side, ids, step)
            graph = _captured(forward)
            warm_up(graph)
            table = kernel_table(model, forward, graph, iters, unlaunched)
            del graph
    stages = {k: statistics.median(s[k] for s in splits) for k in splits[0]}
    marked = statistics.median(sum(s.values()) for s in splits)
    return {
        "ms": ms,
        "nodes": nodes,
        "stages_ms": stages,
        "marked_ms": marked,
        "kernel_table": table,
        "kernels": getattr(library, "kernels", None),
    }


def _kernels(row: dict, side: str) -> str:
    nodes = row["nodes"][side]
    return "? kernels" if nodes is None else f"{nodes.get('kernel', 0)} kernels"


def run(args) -> dict:
    g = geometry(args.geometry)
    q = args.q
    tokens = [int(t) for t in args.tokens.split(",")]
    stock = getattr(args, "stock", "both")
    stocks = {"both": "reference,torch"}.get(stock, stock).split(",")
    model = bench_model(g, max(tokens) // q, args.context, q)
    config = DecodeConfig.build(
        max_context=args.context + 16, q=q, capture_sizes=tokens, policy=args.policy,
        family=args.family,
    )  # fmt: skip
    start = time.perf_counter()
    decode = SpecializedDecode(ReferenceBackbone(model), config)
    decode.prepare()
    build_s = time.perf_counter() - start
    bandwidth = hbm_bandwidth()
    sides = [*stocks, "specialized"]
    installs = {}  # each stock side's ops, installed while it is measured
    if "torch" in stocks:
        installs["torch"] = LibraryStock(model)
    if "vllm" in stocks:
        from .vllm_stock import VllmStock  # Triton, and vLLM's files: only for this stock

        installs["vllm"] = VllmStock(model, args.vllm_ops)
    unlaunched = None
    if args.kernels:  # the kernel tables' own times: the same stages with PDL off
        with _environment(GLM5_PDL="0"):
            unlaunched = SpecializedDecode(ReferenceBackbone(model), config)
            unlaunched.prepare()
    rows, total = [], len(sides) * len(tokens)
    library_kernels = None  # which library calls the torch stock ran
    for i, b in enumerate(tokens):
        requests, step = _step(model, b, q, args.context)
        ids = _token_ids(model, len(requests), q)
        # The experts this step's routing selects (the reference's, one eager run): the floor's.
        touched = touched_experts(model, _forward(model, decode, "reference", ids, step))
        results = {}
        for j, side in enumerate(sides):
            _progress(len(sides) * i + j, total, f"{b} tokens: {side}")
            # The specialized side's kernel table (a stock's holds 30,000-300,000 launches).
            plain = unlaunched if side == "specialized" else None
            # Where the policy leaves a stage stock, the specialized side runs the vLLM
            # stock's op when that stock is timed (as in a vLLM server), else the reference's.
            ops = installs.get("vllm") if side == "specialized" else installs.get(side)
            results[side] = _measure(model, decode, side, ids, step, args.iters, plain, ops)
            library_kernels = results[side].pop("kernels") or library_kernels
        traffic = {"requests": len(requests), "touched": touched}
        floor_ms = floor_bytes(model, b, args.context, **traffic) / bandwidth["floor"] * 1e3
        spec = results["specialized"]["ms"]
        row = {"tokens": b, "q": q, "floor_ms": floor_ms, "touched_experts": touched}
        for side in sides:
            row[f"{side}_ms"] = results[side]["ms"]
            row[f"{side}_to_floor"] = results[side]["ms"] / floor_ms
            if side != "specialized":
                row[f"speedup_vs_{side}"] = results[side]["ms"] / spec
        for key in ("nodes", "stages_ms", "marked_ms"):
            row[key] = {side: results[side][key] for side in sides}
        if args.kernels:
            table_ = results["specialized"]["kernel_table"]
            held = owner_bytes(model, b, args.context, decode, **traffic)
            row["kernel_tables"] = {
                "specialized": {
                    "owners": owner_rows(table_, held, bandwidth["floor"]),
                    "kernels": table_,
                }
            }
        rows.append(row)
        _progress(len(sides) * (i + 1), total, f"{b} tokens done")
        print(
            f"{b:3d} tokens (q={q}): "
            + ", ".join(
                f"{side} {row[f'{side}_ms']:8.2f} ms ({_kernels(row, side)})" for side in sides
            )
            + f"; floor {floor_ms:.2f} ms (specialized {row['specialized_to_floor']:.1f}x)"
        )
        torch.cuda.empty_cache()
    return {
        **provenance("bench", args),
        "policy": decode.policy.to_json(),
        "stages_built": sorted({type(op).__name__ for op, _ in decode.ops}),
        "library_kernels": library_kernels,
        "stock_sources": {s: op.sources for s, op in installs.items() if hasattr(op, "sources")},
        "specialized_stock": "vllm" if "vllm" in installs else "reference",
        "vllm_files": installs["vllm"].vk.manifest if "vllm" in installs else None,
        "build_seconds": build_s,
        "bandwidth_tbps": {k: v / 1e12 for k, v in bandwidth.items()},
        "kernel_tables": "the specialized step's kernels, each by its owner (the policy stage "
        "whose op launched it, else `stock <reference method>`) with launches and own µs "
        "(torch profiler over replays of the step captured with PDL off, median per kernel); "
        "per owner the bytes it must move (weights of its ops, routed experts by expected "
        "hits, its caches; the owners' bytes sum to floor_ms's) and the floor ratio"
        if args.kernels
        else None,
        "split": "CUDA event record nodes captured at each stage's start and end in a second "
        "graph of the same step; median ms per stage over its replays (marked_ms: their sum)",
        "rows": rows,
    }
