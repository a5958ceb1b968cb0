"""`glm5-decode demo`: the reference GLM-5.3-Flash backbone serving a few prompts with
greedy MTP drafting (prefill, then draft / verify / accept steps), with timing per step and
per stage.

    glm5-decode demo                                  # tiny geometry, CPU
    glm5-decode demo --device cuda --geometry flash-tp4-rank --steps 8
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

from .reference import ReferenceModel, geometry

STAGES = ("embed", "kda", "mla", "dense_mlp", "moe", "head")


class StageTimer:
    """Wall time per stage (synchronizing CUDA around each call, so stages don't overlap)."""

    def __init__(self, model: ReferenceModel):
        self.totals: dict[str, float] = defaultdict(float)
        self.cuda = model.device.type == "cuda"
        self.ranks = model.ranks
        for rank in model.ranks:
            for name in STAGES:
                setattr(rank, name, self._wrap(name, getattr(rank, name)))

    def restore(self) -> None:
        """Unwrap the stages (a CUDA-graph capture must not synchronize)."""
        for rank in self.ranks:
            for name in STAGES:
                delattr(rank, name)

    def _wrap(self, name, fn):
        def timed(*args, **kwargs):
            if self.cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            if self.cuda:
                torch.cuda.synchronize()
            self.totals[name] += time.perf_counter() - start
            return out

        return timed


def greedy(model: ReferenceModel, hidden: torch.Tensor) -> torch.Tensor:
    return model.logits(hidden).argmax(-1)


def demo(args) -> None:
    g = geometry(args.geometry)
    device = torch.device(args.device)
    q = 1 + args.spec
    start = time.perf_counter()
    model = ReferenceModel.random(
        g,
        seed=args.seed,
        device=device,
        max_requests=args.prompts,
        max_context=args.max_context,
        q=q,
    )
    print(
        f"built {args.geometry} (tp {g.tp_size}, ranks {list(g.ranks)}) on {device} "
        f"in {time.perf_counter() - start:.1f}s"
    )
    timer = StageTimer(model)
    gen = torch.Generator().manual_seed(args.seed)
    accepted_total, steps_total, step_times = 0, 0, []
    served = time.perf_counter()
    with torch.no_grad():
        for p in range(args.prompts):
            prompt = torch.randint(0, g.vocab_size, (1, args.prompt_len), generator=gen).to(device)
            r = model.add()
            hidden = model.forward([r], prompt)
            nxt = greedy(model, hidden[:, -1:])
            # The MTP layer pairs each target hidden state h_i with token i + 1.
            drafts = model.draft(
                [r],
                torch.cat([prompt[:, 1:], nxt], 1),
                hidden,
                0,
                args.spec,
                share_index=args.share_index,
            )
            produced = [nxt.item()]
            for _ in range(args.steps):
                t0 = time.perf_counter()
                base = model.lengths[r]
                block = torch.cat([nxt, drafts], dim=1)  # [1, q]
                hidden = model.forward([r], block, verify=True)
                predicted = greedy(model, hidden)  # [1, q]
                n = 1
                while n < q and block[0, n] == predicted[0, n - 1]:
                    n += 1
                model.accept(r, n)
                nxt = predicted[:, n - 1 : n]
                produced += [*block[0, 1:n].tolist(), nxt.item()]
                accepted = torch.cat([block[:, 1:n], nxt], 1)
                drafts = model.draft(
                    [r], accepted, hidden[:, :n], base, args.spec, share_index=args.share_index
                )
                if device.type == "cuda":
                    torch.cuda.synchronize()
                step_times.append(time.perf_counter() - t0)
                accepted_total += n
                steps_total += 1
            more = " ..." if len(produced) > 12 else ""
            print(f"prompt {p}: {len(produced)} tokens: {produced[:12]}{more}")
            model.release(r)
    wall = time.perf_counter() - served
    total = sum(step_times)
    print(
        f"\n{steps_total} verify steps (q={q}): {1e3 * total / steps_total:.1f} ms/step, "
        f"{accepted_total / steps_total:.2f} tokens/step accepted, "
        f"{accepted_total / total:.1f} tokens/s"
    )
    print("per stage (all steps, prefill included):")
    rest = wall - sum(timer.totals.values())
    rows = [*timer.totals.items(), ("mhc, norms, sampling, host", rest)]
    for name, seconds in sorted(rows, key=lambda kv: -kv[1]):
        print(f"  {name:28s} {1e3 * seconds:9.1f} ms")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="glm5-decode", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="serve a few random prompts on the reference backbone")
    d.add_argument("--geometry", default="tiny", help="tiny | flash | flash-tp{1,2,4,8}-rank")
    d.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    d.add_argument("--prompts", type=int, default=3)
    d.add_argument("--prompt-len", type=int, default=24)
    d.add_argument("--steps", type=int, default=8, help="verify steps per prompt")
    d.add_argument("--spec", type=int, default=3, help="MTP drafted tokens per step (q - 1)")
    d.add_argument(
        "--share-index", action="store_true", help="draft steps reuse step 0's top-k (vLLM option)"
    )
    d.add_argument("--max-context", type=int, default=512)
    d.add_argument("--seed", type=int, default=0)
    b = sub.add_parser("bench", help="stock vs specialized decode steps on the GPU")
    b.add_argument("--geometry", default="flash-tp4-rank")
    b.add_argument("--tokens", default="1,8,64", help="token counts per step")
    b.add_argument("--q", type=int, default=1, help="tokens per request (1: decode)")
    b.add_argument("--context", type=int, default=4096)
    b.add_argument("--iters", type=int, default=10)
    b.add_argument("--policy", default=None, help="policy table JSON over the family default")
    b.add_argument("--family", default="sm90", choices=["sm90", "sm100"])
    b.add_argument("--out", help="results JSON")
    b.add_argument("--plot", help="results PNG (needs matplotlib)")
    b.add_argument("--commit", help="the code's commit, where the tree's git lacks it")
    p = sub.add_parser("plot", help="plot bench results JSON files into one PNG")
    p.add_argument("results", nargs="+")
    p.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.command == "demo":
        demo(args)
    elif args.command == "bench":
        import json

        from .bench import plot, run

        result = run(args)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
        if args.plot and args.out:
            try:
                plot([args.out], args.plot)
            except ImportError:
                print("no matplotlib here: plot later with `glm5-decode plot`")
    elif args.command == "plot":
        from .bench import plot

        plot(args.results, args.out)


if __name__ == "__main__":
    main()
