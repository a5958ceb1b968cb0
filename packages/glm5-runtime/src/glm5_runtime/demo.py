"""`glm5-decode demo`: random prompts served on the reference backbone (random weights) with
greedy MTP drafting — prefill, then per step the MTP layer drafts, the target verifies
q = 1 + spec tokens and keeps them up to the first disagreement — and, with `--compare`, the
same prompts again with the target's steps run by the specialized decode.

A path is what runs the target's decode / verify steps:
  - stock: the reference backbone's torch ops;
  - specialized: `SpecializedDecode`'s planned step over the same backbone (its stages per
    the GPU family's policy table; on CPU its Triton kernels run interpreted, seconds a
    step; on a GPU each step is captured in a CUDA graph and replayed, as vLLM runs it).
Prefills and the MTP drafts run the reference on both paths. Both paths serve the same
prompts from the same weights, so their tokens agree unless BF16 rounding flips a greedy
choice; the demo prints both and says where they part.

On a GPU both paths' steps are captured and replayed (a fresh graph a step: the demo
replays each once), which gives every step's kernel launches and replay time; the first
step of each path runs once on a spare request outside any capture (compiles, first
allocations), since a step run twice would advance its request's KDA state twice."""

from __future__ import annotations

import logging
import re
import statistics
import time
from dataclasses import dataclass, field

import torch

from glm5_policy import DecodeConfig

from .cli import BLOCK_SIZE
from .reference import ReferenceModel, geometry
from .stage_timer import StageTimer

__all__ = ["serve", "show"]


@dataclass
class Served:
    """One path's run: per prompt its generated tokens; the times in seconds."""

    name: str
    generated: list[list[int]] = field(default_factory=list)
    prefill_s: float = 0.0
    step_s: list[float] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    wall_s: float = 0.0
    stages_s: dict[str, float] = field(default_factory=dict)
    replay_ms: list[float] = field(default_factory=list)  # on a GPU: each step's graph
    kernels: list[int] = field(default_factory=list)


class Stock:
    """The target's steps on the reference backbone."""

    name = "stock"

    def __init__(self, model: ReferenceModel, graphs: bool):
        self.model, self.graphs = model, graphs

    def runner(self, served: Served):
        """What runs a step's layers (model.forward's `run`): a CUDA graph a step on a GPU."""
        return _graphed(self.run, served) if self.graphs else self.run

    def run(self, tokens, step):
        return self.model.backbone(tokens, step)

    def logits(self, hidden):
        return self.model.logits(hidden)


class Specialized(Stock):
    """The target's steps as the specialized decode's planned steps (one token count: q)."""

    name = "specialized"

    def __init__(self, model: ReferenceModel, graphs: bool, args):
        super().__init__(model, graphs)
        from .decode import SpecializedDecode
        from .reference.backbone import ReferenceBackbone

        q = 1 + args.spec
        config = DecodeConfig.build(
            max_context=args.max_context, q=q, capture_sizes=(q,), policy=args.policy,
            family=args.family,
        )  # fmt: skip
        self.stock: dict[str, str] = {}  # stage -> why it runs stock
        self.warned: list[str] = []  # the decode's other warnings
        with _warnings("glm5_runtime") as warned:
            self.decode = SpecializedDecode(ReferenceBackbone(model), config)
            self.decode.prepare()  # compiles every stage kernel
        for message in warned:
            found = re.match(r"Specialized decode: stage (\w+) runs stock \((.*)\)$", message)
            if found:
                self.stock[found[1]] = found[2]
            else:
                self.warned.append(message)
        self.built = sorted({self.decode.stage_of[id(op)] for op, _ in self.decode.ops})

    def run(self, tokens, step):
        decision = self.decode.plan(step, capturing=True)
        if decision.step is None:
            raise RuntimeError(f"a {tokens.numel()}-token step is not planned: {decision.reason}")
        return self.decode.run(decision.step, tokens, step)

    def logits(self, hidden):
        return self.decode.compute_logits(hidden)


class _warnings(logging.Handler):
    """The warnings a logger gives inside the block, kept instead of printed."""

    def __init__(self, logger: str):
        super().__init__(logging.WARNING)
        self.logger, self.messages = logging.getLogger(logger), []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def __enter__(self) -> list[str]:
        self.propagate, self.logger.propagate = self.logger.propagate, False
        self.logger.addHandler(self)
        return self.messages

    def __exit__(self, *exc) -> None:
        self.logger.removeHandler(self)
        self.logger.propagate = self.propagate


def _graphed(fn, served: Served):
    """fn(tokens, step) captured in a fresh CUDA graph and replayed once; its kernel
    launches and replay time go to `served`."""
    from .bench import graph_nodes

    def run(tokens, step):
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(graph):
            out = fn(tokens, step)
        graph.instantiate()
        nodes = graph_nodes(graph)
        if nodes is not None:
            served.kernels.append(nodes.get("kernel", 0))
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        served.replay_ms.append(start.elapsed_time(end))
        out = out.clone()  # the graph's pool goes with it
        del graph
        return out

    return run


def build(args) -> ReferenceModel:
    # A spare request on a GPU for the warm-up steps (see the module docstring).
    spare = 1 if args.compare and args.device == "cuda" else 0
    return ReferenceModel.random(
        geometry(args.geometry), seed=args.seed, device=torch.device(args.device),
        max_requests=args.prompts + spare, max_context=args.max_context, q=1 + args.spec,
        block_size=BLOCK_SIZE,
    )  # fmt: skip


def _shown(tokens: list[int], limit: int = 32) -> str:
    return str(tokens) if len(tokens) <= limit else f"{str(tokens[:limit])[:-1]}, ...]"


def _greedy(path, hidden):
    """The target's greedy tokens [R, T] after hidden states [R, T, D]."""
    return path.logits(hidden).argmax(-1)


def _draft(model, r: int, tokens, hidden, start: int, args):
    """Request r's MTP drafts [1, spec] (none without speculation)."""
    if not args.spec:
        return tokens.new_empty(1, 0)
    return model.draft([r], tokens, hidden, start, args.spec, share_index=args.share_index)


def warm_up(model: ReferenceModel, path, args) -> None:
    """One step of `path` on a spare request, outside any capture."""
    r = model.add()
    block = torch.zeros(1, 1 + args.spec, dtype=torch.long, device=model.device)
    with torch.no_grad():
        model.forward([r], block, verify=True, run=path.run)
        model.accept(r, 1)
    model.release(r)


def say(line: str) -> None:
    print(line, flush=True)


def serve(model: ReferenceModel, path, args) -> Served:
    """Every prompt on `model`, the target's steps by `path`, printed as it goes."""
    device, g, q = model.device, model.g, 1 + args.spec
    served = Served(path.name)
    cuda = device.type == "cuda"
    step = path.runner(served)
    # The stock path's split (the specialized stages run inside the layer loop, and a
    # capture must not synchronize).
    timer = StageTimer(model) if path.name == "stock" and not path.graphs else None
    gen = torch.Generator().manual_seed(args.seed)
    start = time.perf_counter()
    try:
        with torch.no_grad():
            for p in range(args.prompts):
                prompt = torch.randint(0, g.vocab_size, (1, args.prompt_len), generator=gen)
                say(f"prompt {p} ({args.prompt_len} tokens): {_shown(prompt[0].tolist())}")
                prompt = prompt.to(device)
                r = model.add()
                t0 = time.perf_counter()
                hidden = model.forward([r], prompt)  # the prefill: the reference on both paths
                nxt = _greedy(path, hidden[:, -1:])
                # The MTP layer pairs each target hidden state h_i with token i + 1.
                drafts = _draft(model, r, torch.cat([prompt[:, 1:], nxt], 1), hidden, 0, args)
                if cuda:
                    torch.cuda.synchronize()
                served.prefill_s += time.perf_counter() - t0
                generated = [nxt.item()]
                say(
                    f"  prefill: {1e3 * (time.perf_counter() - t0):.0f} ms, generates "
                    f"{generated[0]} (the first token){', then drafts' if args.spec else ''}"
                )
                for s in range(args.steps):
                    t0 = time.perf_counter()
                    base = model.lengths[r]
                    block = torch.cat([nxt, drafts], dim=1)  # [1, q]
                    hidden = model.forward([r], block, verify=True, run=step)
                    predicted = _greedy(path, hidden)  # [1, q]: the target's token after each
                    n = 1
                    while n < q and block[0, n] == predicted[0, n - 1]:
                        n += 1
                    model.accept(r, n)
                    nxt = predicted[:, n - 1 : n]
                    new = [*block[0, 1:n].tolist(), nxt.item()]
                    if s + 1 < args.steps:  # the last step's drafts would never be verified
                        kept = torch.cat([block[:, 1:n], nxt], 1)
                        drafts = _draft(model, r, kept, hidden[:, :n], base, args)
                    if cuda:
                        torch.cuda.synchronize()
                    served.step_s.append(time.perf_counter() - t0)
                    generated += new
                    served.drafted += args.spec
                    served.accepted += n - 1
                    shown = f"drafts {block[0, 1:].tolist()}, {n - 1} accepted, " if q > 1 else ""
                    say(
                        f"  step {s + 1}/{args.steps}: {shown}emits {new} "
                        f"({1e3 * served.step_s[-1]:.0f} ms)"
                    )
                say(f"generated ({len(generated)} tokens): {_shown(generated)}")
                served.generated.append(generated)
                model.release(r)
    finally:
        if timer is not None:
            timer.restore()
    served.wall_s = time.perf_counter() - start
    served.stages_s = dict(timer.totals) if timer is not None else {}
    return served


def summary(served: Served, args) -> None:
    """What a path's run took: prefills, steps (and what a step includes), the whole serve,
    and the per-stage split of it."""
    q, steps = 1 + args.spec, len(served.step_s)
    total = sum(served.step_s)
    made = steps + served.accepted
    holds = (
        f"q={q} verify and the MTP layer's {args.spec} drafts for the next"
        if args.spec
        else "1-token decode"
    )
    print(
        f"\n{served.name}: prefills {served.prefill_s:.2f} s ({args.prompts} prompts), "
        f"{steps} steps {total:.2f} s, in all {served.wall_s:.2f} s"
    )
    print(
        f"  {1e3 * total / steps:.1f} ms/step (the target's {holds}), "
        f"{made / steps:.2f} tokens/step, {made / total:.1f} tokens/s"
    )
    if args.spec:
        print(
            f"  {served.accepted} of {served.drafted} drafts accepted: with random weights "
            "the MTP layer's drafts almost never match the target's greedy tokens (a trained "
            "MTP layer's mostly do)"
        )
    if served.replay_ms:
        kernels = f", {statistics.median(served.kernels):.0f} kernels" if served.kernels else ""
        print(
            f"  each step's CUDA graph: median {statistics.median(served.replay_ms):.2f} ms "
            f"a replay{kernels}"
        )
    if served.stages_s:
        parts = "prefills, steps and drafts" if args.spec else "prefills and steps"
        print(f"  per stage (of the {served.wall_s:.2f} s: {parts}):")
        rest = served.wall_s - sum(served.stages_s.values())
        rows = [*served.stages_s.items(), ("mhc, norms, sampling, host", rest)]
        for name, seconds in sorted(rows, key=lambda kv: -kv[1]):
            print(f"    {name:28s} {1e3 * seconds:9.1f} ms")


def show(args) -> None:
    """The demo: the stock path, then with `args.compare` the specialized one and whether
    their tokens agree."""
    g = geometry(args.geometry)
    graphs = args.device == "cuda" and args.compare
    print(
        f"building {args.geometry} (tp {g.tp_size}, ranks {list(g.ranks)}) on {args.device}, "
        "random weights ...",
        flush=True,
    )
    start = time.perf_counter()
    model = build(args)
    print(f"built in {time.perf_counter() - start:.1f}s", flush=True)
    q = 1 + args.spec
    if args.spec:
        print(
            f"{args.steps} verify steps per prompt, q = {q} tokens each: the last token "
            f"and {args.spec} MTP drafts, kept up to the first draft the target disagrees with",
            flush=True,
        )
    else:
        print(f"{args.steps} decode steps per prompt, q = 1 (no MTP drafts)", flush=True)
    paths = [Stock(model, graphs)]
    if args.compare:
        start = time.perf_counter()
        where = "CUDA graphs" if graphs else "Triton interpreted on CPU"
        policy = f"{args.family}'s default table{' + --policy' if args.policy else ''}"
        print(f"specialized decode ({where}, {policy}): compiling ...", flush=True)
        spec = Specialized(model, graphs, args)
        print(
            f"compiled in {time.perf_counter() - start:.1f}s; stages {', '.join(spec.built)}",
            flush=True,
        )
        for stage, why in sorted(spec.stock.items()):
            print(f"  {stage} runs stock: {why[:96] + ('...' if len(why) > 96 else '')}")
        for message in spec.warned:
            print(f"  warning: {message}")
        paths.append(spec)
    runs = []
    for path in paths:
        if args.compare:
            print(f"\n== {path.name} ==", flush=True)
        if graphs:
            warm_up(model, path, args)
        runs.append(serve(model, path, args))
    for served in runs:
        summary(served, args)
    if args.compare:
        compare(*runs)


def compare(stock: Served, specialized: Served) -> None:
    """Both paths' tokens, prompt by prompt, and where they part."""
    print("\ntokens, stock vs specialized:")
    agree = True
    for p, (a, b) in enumerate(zip(stock.generated, specialized.generated, strict=True)):
        same = a == b
        agree &= same
        print(f"  prompt {p}: stock       {_shown(a)}")
        print(f"  prompt {p}: specialized {_shown(b)}")
        if not same:
            pairs = zip(a, b, strict=False)
            i = next((i for i, (x, y) in enumerate(pairs) if x != y), min(len(a), len(b)))
            print(f"  prompt {p}: they part at generated token {i} (BF16 rounding, greedy ties)")
    total = sum(map(len, stock.generated))
    if agree:
        print(f"the paths agree: all {total} generated tokens equal")
    else:
        print("the paths disagree (see above)")
    if stock.replay_ms and specialized.replay_ms:
        ratio = statistics.median(stock.replay_ms) / statistics.median(specialized.replay_ms)
        print(f"specialized step graphs: {ratio:.1f}x the stock's speed")
