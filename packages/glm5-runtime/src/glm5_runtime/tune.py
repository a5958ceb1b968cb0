"""`glm5-decode tune`: the policy table measured on this GPU, for one TP rank's shapes, q and
the capture sizes.

Each stage's choices (stock included) are timed where the table is used — the whole planned
step, one CUDA graph per capture size, every other stage as chosen so far — and per size the
fastest is kept; a choice within the noise of the fastest loses to a simpler one (stock, then
`SIMPLER` order). The whole step, not the stage alone, because a choice changes what its
neighbours launch and read (a fused KDA step removes the stock ops around it; PDL overlaps
one kernel's loads with the last one's tail), and the step's time is what the table is for.
Each size's step reads only that size's entries, so one build of a candidate times every
size. Stages that serve one sublayer together are timed as one (`TOGETHER`: the MLA
stages). Noise: the starting table timed twice; a size's tie band is the larger of `TIE`
and twice that run-to-run difference. The chosen table is then timed beside the starting one,
the two alternately, twice each (the confirmation: a step timed minutes apart moved by 10 %
on an H100, more than the replay-to-replay noise, so the starting table's first times are no
yardstick for the chosen one's last; the move is recorded as each size's `drift`), and
written with the measurements, command, GPU, commit and date; its `policy` is what `bench
--policy` and the plugin's `"policy"` take.

Where a stage is stock the reference backbone's op runs; with `--vllm-ops DIR`, vLLM 0.33's
own kernels run the routed experts, the KDA core and the mHC pre there (`VllmStock`), as in
a vLLM server. A candidate whose stage does not build is recorded with why, never picked;
one a whole-sublayer stage leaves nothing to serve (the router where `moe` serves every
size) is recorded as `unserved`, with which stage serves instead.
`logits_gather` is kept from the starting table: one GPU has no gather to time.

    glm5-decode tune --geometry flash-tp4-rank --q 1 --tokens 1,2,4,8,16,32,64 \\
        --vllm-ops vllm-files --out tune_tp4_q1.json
"""

from __future__ import annotations

import json
import logging
import os
import statistics
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext

from glm5_policy import MAX_TOKENS, STAGES, DecodeConfig, Policy

Table = dict[str, dict[int, str | None]]  # stage -> capture size -> choice (None: stock)

TIE = 0.01  # the smallest tie band: 1 % of the step
# Simplest first after stock: the Triton boundary before the CuTe cluster kernel, the plain
# KDA step before the one that projects its gates, one expert group per route before 16-row
# groups, the router in its own launch before the one inside the routing launch.
SIMPLER = {"boundary": ("triton", "cute", "cute_deferred"), "kda": ("fused", "fused_gates"),
           "moe": ("per_route", "grouped", "fused_router")}  # fmt: skip
# The order stages are tuned in: the ones that own most of the step first; moe before the
# router and shared expert it runs inside its own launches where it serves a size.
ORDER = ("moe", "boundary", "kda", "kda_proj", "dsa_attn", "dsa_proj", "router",
         "shared_expert", "dense_mlp", "logits_head", "embed")  # fmt: skip
KEPT = frozenset({"logits_gather"})  # not measurable on one GPU
# How `time_table` says a stage serves no size of the table (not a warning: a whole-sublayer
# stage serves them), e.g. "stage router serves no token count: moe (...) serves ...".
UNSERVED = " serves no token count: "
# Stages that serve one sublayer together, tuned as one: the first's choice on sets the
# others' (the MLA sublayer: its attention, pool write and selection), stock sets them stock.
TOGETHER = {"dsa_attn": {"dsa_kpool": "fused", "dsa_indexer": "fused"}}
assert set(ORDER) | KEPT | {s for g in TOGETHER.values() for s in g} == set(STAGES)


def candidates(stage: str) -> list[str | None]:
    """Stock, then the stage's built choices, simplest first."""
    order = SIMPLER.get(stage, ())
    return [None, *sorted(STAGES[stage], key=lambda c: (order.index(c) if c in order else 0, c))]


def pick(times: dict[str | None, float], band: float) -> str | None:
    """The simplest choice (`times` in candidates' order) within `band` (relative) of the
    fastest."""
    best = min(times.values())
    return next(c for c, ms in times.items() if ms <= best * (1 + band))


def policy_json(table: Table, sizes: Sequence[int]) -> dict:
    """The table as policy JSON: capture size s_i's choice covers s_(i-1)+1 .. s_i (a step is
    padded up to a capture size, so no other count is ever planned); consecutive sizes of one
    choice join; stock entries are left out (a stage never chosen: null)."""
    sizes = sorted(sizes)
    out: dict = {}
    for stage in STAGES:
        spans: list[list] = []
        for lo, hi in zip([0, *sizes], sizes, strict=False):
            choice = table.get(stage, {}).get(hi)
            if choice is not None and spans and spans[-1][2] == choice and spans[-1][1] == lo:
                spans[-1][1] = hi
            elif choice is not None:
                spans.append([lo + 1, hi, choice])
        out[stage] = {(f"{a}-{b}" if a != b else str(a)): c for a, b, c in spans} or None
    return out


def merged(results: Sequence[dict]) -> dict:
    """One table from several tune results (each q, each geometry a deployment serves): at
    each token count 1..64 the choice every result that measured the stage there picked,
    else the simplest of their picks — a choice enters only where it was the best, or tied
    with it, in every one. A result speaks for the counts its capture sizes span (its
    smallest to its largest: a q = 4 run has no say at 1-3 tokens, which its deployment
    never runs), and a later run of the same step (geometry, q) that measured the stage
    again at a count speaks there instead of the earlier one (the code moved on in between).
    A stage no result measured: the same rule over the tables they ran. (The SM90 default is
    this over the H200's results: tests/glm5_runtime/test_tune.py.)"""
    counts = range(1, MAX_TOKENS + 1)
    tables = [from_policy(Policy.from_json(r["policy"]), counts) for r in results]
    spans = [range(min(r["sizes"]), max(r["sizes"]) + 1) for r in results]

    def superseded(i: int, stage: str, m: int) -> bool:
        r = results[i]
        return any((o["geometry"], o["q"]) == (r["geometry"], r["q"]) and o["date"] > r["date"]
                   and stage in o["stages"] and m in spans[j]
                   for j, o in enumerate(results))  # fmt: skip

    table: Table = {}
    for stage in STAGES:
        measured = [i for i, r in enumerate(results) if stage in r["stages"]]
        pool = measured or range(len(results))  # not measured (`KEPT`): as they ran
        order = candidates(stage)
        table[stage] = {}
        for m in counts:
            speak = [i for i in pool if m in spans[i] and not superseded(i, stage, m)]
            picks = [tables[i][stage][m] for i in (speak or pool)]
            table[stage][m] = min(picks, key=order.index, default=None)
    return policy_json(table, counts)


def from_policy(policy: Policy, sizes: Sequence[int]) -> Table:
    return {stage: {m: policy(stage, m) for m in sizes} for stage in STAGES}


def as_policy(table: Table, sizes: Sequence[int]) -> Policy:
    return Policy.from_json(policy_json(table, sizes))


def markdown(table: Table, sizes: Sequence[int]) -> str:
    """Choice x token count, one row per stage."""
    head = "| stage | " + " | ".join(map(str, sizes)) + " |"
    rule = "| --- |" + " --- |" * len(sizes)
    rows = [f"| {s} | " + " | ".join(table[s].get(m) or "stock" for m in sizes) + " |"
            for s in STAGES]  # fmt: skip
    return "\n".join([head, rule, *rows])


@contextmanager
def _warnings() -> Iterator[list[str]]:
    """The glm5 loggers' warnings while entered (a stage that runs stock says why)."""
    caught: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            caught.append(record.getMessage())

    handler = Keep(logging.WARNING)
    loggers = [logging.getLogger(n) for n in ("glm5_runtime", "glm5_kernels", "glm5_comm")]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        yield caught
    finally:
        for lg in loggers:
            lg.removeHandler(handler)


def tune(
    time_table: Callable[[Table], tuple[dict[int, float], set[str], list[str]]],
    start: Table,
    sizes: Sequence[int],
    stages: Sequence[str] = ORDER,
    progress: Callable[[int, int, str], None] | None = None,
    prior: dict | None = None,
    checkpoint: Callable[[dict], None] | None = None,
) -> dict:
    """Coordinate descent over `stages` from `start`: per stage, every candidate at every size
    (`time_table(table, stage tried)` -> (ms per size, stages built, warnings; no times
    where the stage tried serves no size: `UNSERVED`)), the pick per size.
    Returns the chosen table, each stage's measurements, the noise, the starting table's
    times and the confirmation. `prior`: an unfinished run's result (`start` its table) to
    go on from: its noise, starting table (`origin`, else `start`) and times are kept, its
    measured stages not re-timed.
    `checkpoint(result so far)` after each stage, `remaining` the stages still to time."""
    table = {s: dict(v) for s, v in start.items()}
    origin = (prior or {}).get("origin") or {s: dict(v) for s, v in start.items()}
    if prior is None:
        first, _, _ = time_table(table)
        again, _, _ = time_table(table)
        start_ms = {m: min(first[m], again[m]) for m in sizes}
        noise = {m: abs(first[m] - again[m]) / start_ms[m] for m in sizes}
        measured: dict[str, dict] = {}
    else:
        start_ms, noise, measured = prior["start_ms"], prior["noise"], dict(prior["stages"])
    band = {m: max(TIE, 2 * noise[m]) for m in sizes}
    todo = [s for s in stages if s not in measured]
    total = sum(len(candidates(s)) for s in todo) + 1
    done = 0
    for i, stage in enumerate(todo):
        runs: dict[str, dict] = {}
        times: dict[int, dict[str | None, float]] = {m: {} for m in sizes}
        for choice in candidates(stage):
            label = choice or "stock"
            if progress:
                progress(done, total, f"{stage}: {label}")
            done += 1
            trial = {**table, **_chosen(stage, dict.fromkeys(sizes, choice))}
            try:
                ms, built, said = time_table(trial, stage)
            except Exception as e:  # a candidate that cannot run is a measurement too
                runs[label] = {"failed": f"{type(e).__name__}: {e}"}
                continue
            if choice is not None and stage not in built:
                unserved = [w for w in said if w.startswith(f"stage {stage}{UNSERVED}")]
                if unserved:  # not a failure: a whole-sublayer stage serves those sizes
                    runs[label] = {"unserved": unserved[0]}
                    continue
                why = [w for w in said if f"stage {stage} " in w] or said or ["no reason"]
                runs[label] = {"failed": "did not build: " + "; ".join(why)}
                continue
            runs[label] = {"ms": ms, "warnings": [w for w in said if UNSERVED not in w]}
            for m in sizes:
                times[m][choice] = ms[m]
        # A size where nothing ran keeps its choice (the error is in `runs`).
        table.update(_chosen(stage, {m: pick(times[m], band[m]) if times[m] else table[stage][m]
                                     for m in sizes}))  # fmt: skip
        measured[stage] = {"candidates": runs, "picked": table[stage]}
        if checkpoint:
            checkpoint({"table": table, "origin": origin, "stages": measured, "noise": noise,
                        "tie_band": band, "start_ms": start_ms,
                        "remaining": todo[i + 1 :]})  # fmt: skip
    if progress:
        progress(total - 1, total, "confirming")
    runs = [time_table(t)[0] for t in (table, origin, table, origin)]  # side by side
    if progress:
        progress(total, total, "done")
    confirm = {m: {"start_ms": min(runs[1][m], runs[3][m]),
                   "tuned_ms": min(runs[0][m], runs[2][m]),
                   "drift": min(runs[1][m], runs[3][m]) / start_ms[m] - 1}
               for m in sizes}  # fmt: skip
    return {"table": table, "origin": origin, "stages": measured, "noise": noise,
            "tie_band": band, "start_ms": start_ms, "confirm": confirm}  # fmt: skip


def _chosen(stage: str, by_size: dict[int, str | None]) -> Table:
    """The table entries a stage's choice per size sets: its own and, for the first of
    stages that serve together (`TOGETHER`), the others' (on where it is on)."""
    out: Table = {stage: by_size}
    for other, on in TOGETHER.get(stage, {}).items():
        out[other] = {m: on if c is not None else None for m, c in by_size.items()}
    return out


def resumed(saved: dict, sizes: Sequence[int]) -> tuple[Table, dict]:
    """An unfinished `--out` file's table and the `prior` that `tune` goes on from (JSON
    keeps the sizes as strings: back to ints)."""

    def by_size(d: dict) -> dict:
        return {int(m): v for m, v in d.items()}

    table = from_policy(Policy.from_json(saved["policy"]), sizes)  # every stage named
    stages = {s: {"candidates": {c: {**r, "ms": by_size(r["ms"])} if "ms" in r else r
                                 for c, r in v["candidates"].items()},
                  "picked": by_size(v["picked"])}
              for s, v in saved["stages"].items()}  # fmt: skip
    # The starting table (files from before it was kept: the table it stopped at).
    origin = saved.get("start_policy")
    origin = from_policy(Policy.from_json(origin), sizes) if origin is not None else table
    return table, {"start_ms": by_size(saved["start_ms"]), "noise": by_size(saved["noise"]),
                   "stages": stages, "origin": origin}  # fmt: skip


def run(args) -> dict:
    """The GPU side of `glm5-decode tune` (cli.py checked the arguments)."""
    import torch

    from glm5_kernels.timing import replay_times, warm_up

    from .bench import _captured, _forward, _progress, _step, _token_ids, bench_model, provenance
    from .decode import SpecializedDecode
    from .reference import geometry
    from .reference.backbone import ReferenceBackbone

    q, sizes = args.q, sorted(int(t) for t in args.tokens.split(","))
    g = geometry(args.geometry)
    model = bench_model(g, max(sizes) // q, args.context, q)
    stock = nullcontext()
    if args.vllm_ops:
        from .vllm_stock import VllmStock

        stock = VllmStock(model, args.vllm_ops)

    def time_table(table: Table, trying: str | None = None):
        config = DecodeConfig.build(max_context=args.context + 16, q=q, capture_sizes=sizes,
                                    policy=as_policy(table, sizes))  # fmt: skip
        with _warnings() as said:
            decode = SpecializedDecode(ReferenceBackbone(model), config)
            said += [f"stage {s}{UNSERVED}{why}" for s, why in decode.unserved.items()]
            if trying in decode.unserved:  # nothing of it to time: no compile, no capture
                return {}, {decode.stage_of[id(op)] for op, _ in decode.ops}, said
            decode.prepare()
        built = {decode.stage_of[id(op)] for op, _ in decode.ops}
        ms = {}
        for m in sizes:
            requests, step = _step(model, m, q, args.context)
            ids = _token_ids(model, len(requests), q)
            with torch.no_grad(), stock:
                graph = _captured(_forward(model, decode, "specialized", ids, step))
                warm_up(graph)
                ms[m] = statistics.median(replay_times(graph, args.iters))
                del graph
        del decode
        torch.cuda.empty_cache()
        return ms, built, said

    stages = [s for s in ORDER if s in (args.stages.split(",") if args.stages else ORDER)]
    earlier: list[dict] = []
    if args.resume:
        saved = args.resume  # cli.py read it and checked it is this step's
        start, prior = resumed(saved, sizes)
        earlier = [*saved.get("earlier_runs", []), {k: saved[k] for k in RUN_KEYS}]
    else:
        start, prior = from_policy(Policy.from_json(args.policy, family=args.family), sizes), None
    head = {**provenance("tune", args), **timed_step(args),
            **({"earlier_runs": earlier} if earlier else {})}  # fmt: skip

    def results(result: dict) -> dict:
        table, origin = result.pop("table"), result.pop("origin")
        return {**head, "policy": policy_json(table, sizes), "table": markdown(table, sizes),
                "start_policy": policy_json(origin, sizes), **result}  # fmt: skip

    def checkpoint(result: dict) -> None:
        """The unfinished file (`--resume` goes on from it), replaced whole after each stage
        so a run cut short leaves every stage it finished."""
        if args.out:
            with open(args.out + ".part", "w") as f:
                json.dump({**results(result), "unfinished": True}, f, indent=1)
            os.replace(args.out + ".part", args.out)

    return results(tune(time_table, start, sizes, stages, _progress, prior, checkpoint))


# What an unfinished file's run is remembered by in the file that finishes it.
RUN_KEYS = ("command", "commit", "date", "gpu")


def timed_step(args) -> dict:
    """What a run times (an unfinished file and the command going on from it must agree)."""
    return {
        "geometry": args.geometry,
        "context": args.context,
        "q": args.q,
        "sizes": sorted(int(t) for t in args.tokens.split(",")),
        "family": args.family,
        "iters": args.iters,
        "stock": "vLLM 0.33's experts, KDA core and mHC pre (VllmStock), torch elsewhere"
        if args.vllm_ops
        else "the reference backbone's torch ops",
    }


def is_result(saved: dict) -> bool:
    """Whether `saved` is a `glm5-decode tune --out` file's contents (finished or not)."""
    return saved.get("benchmark") == "glm5-decode tune" and {"policy", "stages"} <= set(saved)


def resume_problem(saved: dict, args) -> str | None:
    """Why `--resume` cannot go on from `saved` with these arguments, or None."""
    if not is_result(saved):
        return "not a `glm5-decode tune --out` file"
    if not saved.get("unfinished"):
        return 'that run finished (its table is under "policy")'
    if args.policy is not None:
        return "--policy: the starting table is the file's"
    step = timed_step(args)
    differ = [f"{k} {saved.get(k)!r} there, {v!r} here" for k, v in step.items()
              if saved.get(k) != v]  # fmt: skip
    return "a different step: " + "; ".join(differ) if differ else None


def slower(result: dict) -> dict[str, float]:
    """The token counts where a finished run's confirmation put the tuned table behind the
    starting one by more than the tie band: count -> relative excess."""
    band = result.get("tie_band", {})
    out = {}
    for m, c in result.get("confirm", {}).items():
        excess = c["tuned_ms"] / c["start_ms"] - 1
        if excess > band.get(m, TIE):
            out[m] = excess
    return out


def summary(result: dict) -> str:
    """A results file for a README: what ran where, then `show`'s tables (an unfinished
    run: its measured stages, the rest as it started)."""
    where = (f"**{result['geometry']}, q = {result['q']}** — {result['gpu']}, "
             f"{result['date']}, commit {result['commit']}: `{result['command']}`")  # fmt: skip
    if result.get("unfinished"):
        where += f" (unfinished: {', '.join(result['remaining'])} not yet timed)"
    return where + "\n\n" + show(result)


def show(result: dict) -> str:
    """What a run prints: the chosen table, the confirmation (a finished run; an unfinished
    one: the starting table's times), the policy JSON line."""
    lines = [result["table"], ""]
    if "confirm" in result:
        drift = lambda c: f"{100 * c['drift']:+.1f}" if "drift" in c else "–"  # noqa: E731
        lines += ["| tokens | start ms | tuned ms | start's drift % |",
                  "| ---: | ---: | ---: | ---: |"]  # fmt: skip
        lines += [f"| {m} | {c['start_ms']:.3f} | {c['tuned_ms']:.3f} | {drift(c)} |"
                  for m, c in result["confirm"].items()]  # fmt: skip
        worse = slower(result)
        if worse:  # each stage's pick was the fastest; together they are not: say so
            lines += ["", "**The tuned table is slower than the start at " + ", ".join(
                f"{m} tokens (+{100 * r:.1f} %)" for m, r in worse.items()) + "**: choices "
                "that interact across token counts; do not ship it as it stands."]  # fmt: skip
    else:
        lines += ["| tokens | start ms |", "| ---: | ---: |"]
        lines += [f"| {m} | {ms:.3f} |" for m, ms in result["start_ms"].items()]
    lines += ["", "policy: " + json.dumps(result["policy"], separators=(",", ":"))]
    return "\n".join(lines)
