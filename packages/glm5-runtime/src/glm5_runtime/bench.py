"""`glm5-decode bench`: per-step latency of the stock reference decode vs the specialized
decode (each step captured in one CUDA graph, median of replays), with the HBM floor, an
eager per-stage breakdown, JSON results and a PNG plot (`glm5-decode plot`).

    glm5-decode bench --geometry flash-tp4-rank --tokens 1,8,64 --out bench.json
    glm5-decode plot bench.json bench.png
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from datetime import date

import torch

from glm5_kernels.timing import replay_times
from glm5_policy import DecodeConfig

from .cli import StageTimer
from .decode import SpecializedDecode
from .reference import ReferenceModel, geometry
from .reference.backbone import ReferenceBackbone

__all__ = ["floor_bytes", "plot", "read_bandwidth", "run"]


def _progress(done: int, total: int, what: str) -> None:
    bar = "#" * (20 * done // total)
    print(f"\r[{bar:20s}] {done}/{total} {what:48s}", end="", file=sys.stderr, flush=True)
    if done == total:
        print(file=sys.stderr)


def _replay_ms(graph: torch.cuda.CUDAGraph, iters: int) -> float:
    graph.replay()
    return statistics.median(replay_times(graph, iters))


def read_bandwidth(gib: int = 4) -> float:
    """Bytes/s of a read-only reduction over `gib` GiB (the HBM floor's denominator)."""
    big = torch.ones(gib << 29, dtype=torch.bfloat16, device="cuda")
    torch.sum(big, dtype=torch.float32)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.sum(big, dtype=torch.float32)
    return big.nbytes / (_replay_ms(graph, 10) * 1e-3)


def floor_bytes(model: ReferenceModel, batch: int, context: int) -> float:
    """The least HBM traffic of one backbone step on the held ranks: every backbone weight
    but the routed experts and the embedding table, the routed experts the batch is expected
    to hit (E * (1 - (1 - k/E)^B) per MoE block), the latents and pool keys each query
    reads, and the KDA states read and written."""
    g = model.g
    mtp = tuple(f"layers.{i}." for i in model.mtp_layers)
    weights = [(n, t) for rank in model.ranks for n, t in rank.w.items() if not n.startswith(mtp)]
    dense = sum(t.nbytes for n, t in weights if ".experts." not in n and "embed_tokens" not in n)
    experts = sum(t.nbytes for n, t in weights if ".experts." in n)
    e, k = g.n_routed_experts, g.num_experts_per_tok
    routed = experts * (1 - (1 - k / e) ** batch)
    selected = min(context + 1, g.index_topk + g.index_kpool - 1)
    pool_bytes = model.ranks[0].c.kpool[g.mla_layers[0]][0, 0].nbytes  # one pool's key
    pools = context // g.index_kpool
    attention = batch * len(g.mla_layers) * (selected * g.kv_lora_rank * 2 + pools * pool_bytes)
    heads = g.linear_num_heads // g.tp_size
    states = batch * len(g.kda_layers) * 2 * heads * g.linear_head_dim**2 * 4
    return dense + routed + attention + states


def _step(model: ReferenceModel, tokens: int, q: int, context: int):
    """A placed decode (q = 1) or verify step of `tokens` rows at `context`."""
    requests = list(range(tokens // q))
    for r in requests:
        model.lengths[r], model.current[r] = context, 0
        model.pending.pop(r, None)
    return requests, model.step(requests, q, verify=q > 1)


def _measure(model, decode, side: str, ids, step, iters: int) -> dict:
    """One side's step: graph-replay ms and an eager per-stage breakdown. (Replays repeat
    the step on caches it updated in place, so outputs are not compared here: equivalence is
    tests/glm5_runtime/test_decode*.py's job.)"""

    def forward():
        if side == "stock":
            return model.logits(model.backbone(ids, step))
        decision = decode.plan(step, capturing=True)
        if decision.step is None:
            raise RuntimeError(f"{step.positions.numel()} tokens not planned: {decision.reason}")
        return decode.compute_logits(decode.run(decision.step, ids, step))

    with torch.no_grad():
        forward()  # warm-up outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            forward()
        ms = _replay_ms(graph, iters)
        del graph
        timer = StageTimer(model)  # eager, synchronized around each stage
        try:
            forward()
        finally:
            timer.restore()
    stages = {k: 1e3 * v for k, v in timer.totals.items()}
    return {"ms": ms, "stages_ms": stages}


def run(args) -> dict:
    g = geometry(args.geometry)
    q = args.q
    tokens = [int(t) for t in args.tokens.split(",")]
    model = ReferenceModel.random(
        g, seed=0, device="cuda", max_requests=max(tokens) // q, max_context=args.context + 16,
        q=q,
    )  # fmt: skip
    for _ in range(max(tokens) // q):
        model.add()
    config = DecodeConfig.build(
        max_context=args.context + 16, q=q, capture_sizes=tokens, policy=args.policy,
        family=args.family,
    )  # fmt: skip
    start = time.perf_counter()
    decode = SpecializedDecode(ReferenceBackbone(model), config)
    decode.prepare()
    build_s = time.perf_counter() - start
    bandwidth = read_bandwidth()
    rows, total = [], 2 * len(tokens)
    for i, b in enumerate(tokens):
        requests, step = _step(model, b, q, args.context)
        ids = torch.randint(0, g.vocab_size, (len(requests), q), device="cuda")
        results = {}
        for j, side in enumerate(("stock", "specialized")):
            _progress(2 * i + j, total, f"{b} tokens: {side}")
            results[side] = _measure(model, decode, side, ids, step, args.iters)
        floor_ms = floor_bytes(model, b, args.context) / bandwidth * 1e3
        row = {
            "tokens": b,
            "q": q,
            "stock_ms": results["stock"]["ms"],
            "specialized_ms": results["specialized"]["ms"],
            "floor_ms": floor_ms,
            "speedup": results["stock"]["ms"] / results["specialized"]["ms"],
            "specialized_to_floor": results["specialized"]["ms"] / floor_ms,
            "stock_to_floor": results["stock"]["ms"] / floor_ms,
            "stages_ms": {k: v["stages_ms"] for k, v in results.items()},
        }
        rows.append(row)
        _progress(2 * i + 2, total, f"{b} tokens done")
        print(
            f"{b:3d} tokens (q={q}): stock {row['stock_ms']:8.2f} ms, specialized "
            f"{row['specialized_ms']:8.2f} ms ({row['speedup']:.2f}x), floor {floor_ms:.2f} ms "
            f"({row['specialized_to_floor']:.1f}x)"
        )
        torch.cuda.empty_cache()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return {
        "benchmark": "glm5-decode bench",
        "geometry": args.geometry,
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": date.today().isoformat(),
        "commit": args.commit or commit.stdout.strip() or "unknown",
        "context": args.context,
        "policy": decode.policy.to_json(),
        "stages_built": sorted({type(op).__name__ for op, _ in decode.ops}),
        "build_seconds": build_s,
        "read_bandwidth_tbps": bandwidth / 1e12,
        "rows": rows,
    }


def plot(result_paths: list[str], out: str) -> None:
    """Stock, specialized and floor ms per token count, one panel per results file."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = []
    for path in result_paths:
        with open(path) as f:
            results.append(json.load(f))
    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4), squeeze=False)
    for ax, r in zip(axes[0], results, strict=True):
        x = [row["tokens"] for row in r["rows"]]
        for key, label in (("stock_ms", "stock"), ("specialized_ms", "specialized"),
                           ("floor_ms", "HBM floor")):  # fmt: skip
            ax.plot(x, [row[key] for row in r["rows"]], marker="o", label=label)
        ax.set(xscale="log", yscale="log", xlabel="tokens per step", ylabel="ms per step",
               title=f"{r['geometry']} ({r['gpu']}, ctx {r['context']})")  # fmt: skip
        ax.set_xticks(x, [str(v) for v in x])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
