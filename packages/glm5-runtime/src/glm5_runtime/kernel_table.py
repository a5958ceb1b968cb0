"""`glm5-decode bench --kernels`: every kernel of a timed step by name, the stage that
launched it, its own time, and per stage the bytes it must move and its floor.

Who launched a kernel is read from an eager run of the step under the torch profiler: every
stage op runs inside a `record_function` range named for its policy stage, every reference
stage method (`STAGES`) inside one named `stock <method>`, and a kernel belongs to the
innermost range around its launch (`stock mhc, norms, reduce` outside them all: the mHC
pre / post, norms and sums no boundary stage serves, the glue between stages). Its own time is
read from replays of the step's CUDA graph captured with PDL off (a kernel launched early
would count its wait for the one before): the k-th kernel of a name in a replay is the k-th
of that name in the eager run, median over the replays.

A stage's bytes are the weights its ops read (the routed experts by the share the step's
routing selected, as `floor.floor_bytes` counts them) and the cache traffic the floor counts
for its layers; over all owners they sum to the step's floor."""

from __future__ import annotations

import json
import os
import re
import statistics
import tempfile
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from .floor import cache_bytes, expert_hits
from .reference import ReferenceModel
from .reference.stages import FUSED_PARTS
from .results import BETWEEN, STAGES

__all__ = ["assign", "kernel_table", "owner_bytes", "owner_rows", "owners", "short_name"]

STAGE, STOCK = "stage ", "stock "
OUTSIDE = STOCK + BETWEEN
UNATTRIBUTED = "unattributed"  # a replayed kernel the eager run did not launch
_DEVICE = ("kernel", "gpu_memcpy", "gpu_memset")
_LAUNCH = ("cuda_runtime", "cuda_driver")
# The weights a fused stage reads whose stock op is not a route of its own name: route
# suffix -> the layer's weight-name prefixes it owns (the rest of its inputs are activations
# and caches).
_HOLDS = {
    ".kda": ("conv1d.", "forget_gate.dt_bias", "forget_gate.A_log", "o_norm."),
    ".f_b_g_b_proj": ("forget_gate.f_b_proj.", "g_b_proj."),
    ".dsa_attn": ("kv_b_proj.",),
    ".q_b_wq_b": ("q_b_proj.", "indexer.wq_b."),
    ".latent": ("q_a_layernorm.", "kv_a_layernorm."),
    ".indexer.kpool": ("indexer.index_kpool_compress_ape",),
    ".indexer.inputs": ("indexer.wk.", "indexer.index_kpool_compress_gate",
                        "indexer.weights_proj.", "indexer.k_norm."),
}  # fmt: skip


class _Named:
    """A stage op that runs inside a profiler range named for its stage (the boundary's
    entry points too); everything else is the op's own."""

    ENTRIES = ("expand_pre", "post_pre", "head", "absorb")  # the boundary's, the MLA query's

    def __init__(self, op: Any, label: str):
        self._op, self._label = op, label

    def __call__(self, *args, **kwargs):
        with record_function(self._label):
            return self._op(*args, **kwargs)

    def __getattr__(self, name: str):
        value = getattr(self._op, name)
        if name not in self.ENTRIES:
            return value

        return _ranged(value, self._label)


def _ranged(method: Callable, label: str) -> Callable:
    def ranged(*args, **kwargs):
        with record_function(label):
            return method(*args, **kwargs)

    return ranged


@contextmanager
def owners(model: ReferenceModel, decode=None) -> Iterator[None]:
    """While open, every kernel a step launches does so inside a range naming its owner:
    the decode's stage ops (routes and sublayers' ops, boundaries, embedding, head, gather)
    `stage <policy stage>`, the reference's stage methods `stock <method>`."""
    named: dict[int, _Named] = {}

    def wrap(op):
        if op is None:
            return None
        if id(op) not in named:
            named[id(op)] = _Named(op, STAGE + decode.stage_of.get(id(op), "unnamed"))
        return named[id(op)]

    keys = ("routes", "mhc", "exchange", "head", "logits_gather", "embedding")
    saved = {k: getattr(decode, k) for k in keys} if decode is not None else {}
    if decode is not None:
        decode.routes = {b: [(s, n, wrap(op)) for s, n, op in rs]
                         for b, rs in saved["routes"].items()}  # fmt: skip
        decode.mhc, decode.exchange = wrap(saved["mhc"]), wrap(saved["exchange"])
        decode.head = {b: [wrap(op) for op in ops] for b, ops in saved["head"].items()}
        decode.logits_gather = wrap(saved["logits_gather"])
        decode.embedding = {b: [wrap(op) for op in ops] for b, ops in saved["embedding"].items()}
    methods = [(rank, name, rank.__dict__.get(name)) for rank in model.ranks for name in STAGES]
    for rank, name, _ in methods:
        setattr(rank, name, _ranged(getattr(rank, name), STOCK + name))
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(decode, k, v)
        for rank, name, own in methods:  # an instance's own method back (a stock's patch)
            if own is None:
                rank.__dict__.pop(name, None)
            else:
                setattr(rank, name, own)


def _trace(run: Callable[[], None]) -> list[dict]:
    """Chrome-trace events of `run` under the torch profiler (CPU ranges, launches, kernels)."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)["traceEvents"]


def _device(events: list[dict]) -> list[dict]:
    return sorted(
        (e for e in events if e.get("ph") == "X" and e.get("cat") in _DEVICE),
        key=lambda e: e["ts"],
    )


def assign(eager: list[dict], replays: list[dict], replay_count: int) -> list[dict]:
    """Per kernel of the eager run (trace events), its owner and its median own time over
    the replays: [{"kernel", "owner", "us"}], in launch order, then any replayed kernel the
    eager run did not launch (owner UNATTRIBUTED)."""
    ranges = sorted(
        (e["ts"], e["ts"] + e.get("dur", 0), e["name"].removeprefix(STAGE))
        for e in eager
        if e.get("ph") == "X" and e.get("cat") == "user_annotation"
        and e["name"].startswith((STAGE, STOCK))
    )  # fmt: skip
    launch_ts = {
        e["args"]["correlation"]: e["ts"]
        for e in eager
        if e.get("cat") in _LAUNCH and "correlation" in e.get("args", {})
    }

    def owner(kernel: dict) -> str:
        t = launch_ts.get(kernel.get("args", {}).get("correlation"))
        if t is None:
            return OUTSIDE
        inner = [r for r in ranges if r[0] <= t <= r[1]]
        return max(inner)[2] if inner else OUTSIDE  # the latest start: the innermost range

    rows = [{"kernel": k["name"], "owner": owner(k), "times": []} for k in _device(eager)]
    positions = defaultdict(list)
    for i, row in enumerate(rows):
        positions[row["kernel"]].append(i)
    extra: dict[str, list[float]] = defaultdict(list)
    for replay in _replays(replays, replay_count):
        seen: Counter = Counter()
        for k in replay:
            at, n = positions.get(k["name"], []), seen[k["name"]]
            seen[k["name"]] += 1
            if n < len(at):
                rows[at[n]]["times"].append(k.get("dur", 0.0))
            else:
                extra[k["name"]].append(k.get("dur", 0.0))
    # An eager launch no replay ran (a check a stage skips while capturing) is not the step's.
    out = [
        {"kernel": r["kernel"], "owner": r["owner"], "us": statistics.median(r["times"])}
        for r in rows
        if r["times"]
    ]  # fmt: skip
    for name, times in extra.items():  # per replay: their sum over the replays / count
        launches = max(1, round(len(times) / replay_count))
        each = statistics.median(times)
        out += [{"kernel": name, "owner": UNATTRIBUTED, "us": each}] * launches
    return out


def _replays(events: list[dict], count: int) -> list[list[dict]]:
    """The device events of `count` graph replays, one list a replay: by the graph launch's
    correlation where the trace keeps it, else in equal runs of time order."""
    device = _device(events)
    by_launch: dict[Any, list[dict]] = defaultdict(list)
    for e in device:
        by_launch[e.get("args", {}).get("correlation")].append(e)
    if len(by_launch) == count:
        return list(by_launch.values())
    if not device or len(device) % count:
        raise RuntimeError(
            f"{len(device)} device events in {count} graph replays: cannot split them"
        )
    n = len(device) // count
    return [device[i * n : (i + 1) * n] for i in range(count)]


# The torch op a generic kernel runs, named in its template arguments; the wrappers around
# it name nothing.
_FUNCTOR = re.compile(r"(\w+?)(?:_kernel)?_cuda\b|(\w+(?:Functor|_functor|Ops))\b")
# CuTe DSL kernels: kernel_cutlass_kernel_<module path><Class>_object_at_<arguments>.
_CUTE = re.compile(r"kernel_cutlass_kernel_\w*?([A-Z]\w*?)_object_at_")
_WRAPPERS = {"BinaryFunctor", "UnaryFunctor", "OpaqueType"}


def short_name(kernel: str) -> str:
    """A kernel's name for the table: the function without namespaces, return type or
    template arguments, and the torch op it runs where its template names one
    (`vectorized_elementwise_kernel[direct_copy]`, `reduce_kernel[MeanOps]`); a CuTe DSL
    kernel by its class (`cute:CuteBoundary`)."""
    cute = _CUTE.match(kernel)
    if cute:
        return f"cute:{cute[1]}"
    head = re.split(r"[<(]", kernel, maxsplit=1)[0].strip().split(" ")[-1]
    base = head.rsplit("::", 1)[-1] or kernel[:60]
    ops = [next(g for g in m.groups() if g) for m in _FUNCTOR.finditer(kernel[len(head) :])]
    ops = [op for op in ops if op not in _WRAPPERS]
    return f"{base}[{ops[0]}]" if ops else base


def kernel_table(
    model: ReferenceModel, forward: Callable[[], Any], graph, iters: int, decode=None
) -> list[dict]:
    """The step's kernels by (owner, kernel), most time first: launches and own µs a step.
    `forward` runs the step eagerly (`decode`'s stage ops, where it is the specialized
    step); `graph` is the same step captured with PDL off, replayed `iters` times."""
    with torch.no_grad(), owners(model, decode):
        eager = _trace(forward)

    def replay():
        for _ in range(iters):
            graph.replay()
            torch.cuda.synchronize()

    kernels = assign(eager, _trace(replay), iters)
    grouped: dict[tuple[str, str], list[float]] = defaultdict(list)
    for k in kernels:
        grouped[k["owner"], k["kernel"]].append(k["us"])
    rows = [
        {"owner": owner, "kernel": short_name(name), "name": name[:300], "launches": len(us),
         "us": sum(us)}
        for (owner, name), us in grouped.items()
    ]  # fmt: skip
    return sorted(rows, key=lambda r: -r["us"])


def owner_bytes(
    model: ReferenceModel,
    tokens: int,
    context: int,
    decode=None,
    requests: int | None = None,
    touched: dict[int, int] | None = None,
) -> dict[str, float]:
    """Bytes each owner of a `tokens`-token step must move: `floor.floor_bytes` (same
    arguments) split by who reads them — the weights of the ops it runs (a fused weight once,
    the routed experts by `expert_hits`, no embedding table) and, for the attention stages,
    the caches they read and write. Without `decode`, every owner is a stock one."""
    g = model.g
    routes, boundary, head, holds = {}, False, False, dict(_HOLDS)
    if decode is not None:
        routed = decode.routes.get(tokens, [])
        routes = {n: decode.stage_of.get(id(op), "unnamed") for _, n, op in routed}
        if any(getattr(op, "low_rank", False) for _, _, op in routed):  # kda: fused_gates
            holds[".kda"] += ("forget_gate.f_b_proj.", "g_b_proj.")
        boundary = decode.mhc is not None and tokens in decode.mhc_tokens
        head = tokens in decode.head
    attention = {i: "mla" for i in g.mla_layers} | {i: "kda" for i in g.kda_layers}
    mlp = {i: "dense_mlp" if t == "dense" else "moe" for i, t in enumerate(g.mlp_layer_types)}
    hits = expert_hits(model, tokens, touched)
    mtp = tuple(f"layers.{i}." for i in model.mtp_layers)

    def owner(name: str) -> str:
        base = name.removesuffix("_scale_inv")
        for fused, parts in FUSED_PARTS.items():  # a part of a fused weight: the fused op's
            for part in (p for p in parts if base.endswith(f".{p}.weight")):
                whole = base.removesuffix(f"{part}.weight") + f"{fused}.weight"
                if whole in routes:
                    return routes[whole]
        for r, stage in routes.items():
            if base == r or name.startswith(r + "."):
                return stage
            for suffix, held in holds.items():
                layer = r.removesuffix(suffix)
                if r.endswith(suffix) and name.startswith(tuple(f"{layer}.{h}" for h in held)):
                    return stage
        if name == "norm.weight" or "_hc." in name or name.endswith("layernorm.weight"):
            return "boundary" if boundary else OUTSIDE
        if name.startswith("lm_head."):
            return "logits_head" if head else STOCK + "head"
        i = int(name.split(".")[1])  # a layer's stock op: its stock method
        return STOCK + (attention[i] if ".self_attn." in name else mlp[i])

    out: Counter = Counter()
    for rank in model.ranks:
        for name, t in rank.w.items():
            # A fused weight's parts are views of it: its bytes count once, as its parts.
            fused = name.removesuffix(".weight").rpartition(".")[2] in FUSED_PARTS
            if not (name.startswith(mtp) or "embed_tokens" in name or fused):
                hit = hits[int(name.split(".")[1])] if ".experts." in name else 1
                out[owner(name)] += t.nbytes * hit
    # The caches, once a step as the floor counts them (per request): one query's selected
    # latents and every pool key, the KDA states read and written.
    c = cache_bytes(model, tokens if requests is None else requests, context)
    for i in g.mla_layers:
        a = f"layers.{i}.self_attn"
        out[routes.get(f"{a}.dsa_attn", STOCK + "mla")] += c["latents"]
        out[routes.get(f"{a}.indexer.topk", STOCK + "mla")] += c["pools"]
    for i in g.kda_layers:
        out[routes.get(f"layers.{i}.self_attn.kda", STOCK + "kda")] += c["states"]
    return dict(out)


def owner_rows(table: list[dict], bytes_: dict[str, float], bandwidth: float) -> list[dict]:
    """Each owner of a step's kernels (and of bytes): launches, own µs, bytes, floor µs and
    the ratio, most time first."""
    launches, us = Counter(), Counter()
    for k in table:
        launches[k["owner"]] += k["launches"]
        us[k["owner"]] += k["us"]
    rows = []
    for owner in sorted(set(us) | set(bytes_), key=lambda o: -us[o]):
        b = bytes_.get(owner, 0.0)
        floor = b / bandwidth * 1e6
        ratio = us[owner] / floor if floor else None
        rows.append({"owner": owner, "launches": launches[owner], "us": us[owner], "bytes": b,
                     "floor_us": floor, "to_floor": ratio})  # fmt: skip
    return rows
