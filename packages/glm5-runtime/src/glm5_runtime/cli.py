"""`glm5-decode`: the reference GLM-5.3-Flash backbone serving random prompts with greedy MTP
drafting (`demo`: prefill, then draft / verify / accept steps, timed per step and per stage;
`--compare`: the same prompts through the specialized decode too), stock vs specialized
decode steps on the GPU (`bench`), their plot (`plot`) and tables (`table`), the policy
table measured on this GPU (`tune`) and one table from several of those (`merge`).

    glm5-decode demo                                  # tiny geometry, CPU, a few seconds
    glm5-decode demo --compare --prompts 1 --steps 2  # + the specialized decode (CPU: ~2 min)
    glm5-decode demo --device cuda --geometry flash-tp4-rank --steps 8 --compare
    glm5-decode bench --geometry flash-tp4-rank --tokens 1,8,64 --out bench.json
    glm5-decode table bench.json
    glm5-decode tune --geometry flash-tp4-rank --q 1 --tokens 1,2,4,8,16,32,64 --out tune.json
    glm5-decode merge tune.json tune_q4.json

Every bad input is one line on stderr and exit status 2, before any work starts: argparse
checks each value and the values together; the commands then check what needs torch (the
device, the memory the model takes). Torch is imported inside `demo`, `bench` and `tune`
only, so `--help`, `table` and `merge` answer at once. Ctrl-C stops a command with one line
and exit status 130.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import warnings

from glm5_policy import FAMILIES, MAX_Q, MAX_TOKENS, PolicyError, parse_table

from . import vllm_files

# The names reference.config.geometry() takes (importing it here would import torch).
GEOMETRIES = ("tiny", "flash", *(f"flash-tp{tp}-rank" for tp in (1, 2, 4, 8)))
STOCKS = ("reference", "torch", "vllm")
BOTH = "reference,torch"  # `--stock both`, the default
BLOCK_SIZE = 64  # ReferenceModel's default paged-cache block
_GEOMETRY = dict(
    choices=GEOMETRIES,
    metavar="NAME",
    help="tiny (every feature at CPU-test size), flash (GLM-5.3-Flash), or "
    "flash-tp{1,2,4,8}-rank (one rank's shard of a TP deployment)",
)


class _Defaults(argparse.ArgumentDefaultsHelpFormatter):
    """Help with each option's default, where it has one."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


class BadInput(Exception):
    """A bad command line found inside a command (the device, the memory): main() reports it
    as argparse reports its own errors."""


# argparse types: each value checked as it is parsed, one line per problem.
def _integer(low: int, high: int | None = None, why: str = ""):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            if high is not None:
                expects = f"an integer in {low}..{high}"
            else:
                expects = "a positive integer" if low == 1 else f"an integer >= {low}"
            raise argparse.ArgumentTypeError(f"expects {expects}{why}, got {text!r}")
        return value

    return parse


_count = _integer(1)


def _token_counts(text: str) -> str:
    """Comma-separated token counts, each a planned step size; kept as text (bench.run
    splits it)."""
    try:
        counts = [_integer(1, MAX_TOKENS)(part) for part in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expects comma-separated token counts in 1..{MAX_TOKENS} (the largest planned "
            f"step), e.g. 1,8,64, got {text!r}"
        ) from None
    repeated = sorted({c for c in counts if counts.count(c) > 1})
    if repeated:  # each count is timed once: a repeat would time the same step again
        raise argparse.ArgumentTypeError(
            f"expects each token count once, got {text!r} ({_listed(repeated)} repeated)"
        )
    return ",".join(map(str, counts))


def _stocks(text: str) -> str:
    """Comma-separated stocks (or `both`); kept as text (bench.run splits it)."""
    names = (BOTH if text == "both" else text).split(",")
    if not all(n in STOCKS for n in names) or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"expects comma-separated stocks from {', '.join(STOCKS)}, each once (or both: "
            f"{BOTH}), got {text!r}"
        )
    return ",".join(names)


def _vllm_folder(text: str) -> str:
    """A folder of vLLM 0.33's kernel files (`benchmarks/vllm_files.py` makes one)."""
    problems = vllm_files.problems(text)
    if problems:
        raise argparse.ArgumentTypeError("; ".join(problems))
    return text


def _listed(values: list[int]) -> str:
    return ", ".join(map(str, values))


def _policy(text: str) -> str:
    try:
        parse_table(text)
    except PolicyError as error:
        raise argparse.ArgumentTypeError("; ".join(error.problems)) from None
    return text


def _new_file(path: str) -> str:
    """A file to write: its folder must exist, so a long run doesn't fail at the end."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"no folder {folder!r} to write {path!r} in")
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{path!r} is a folder, not a file")
    return path


def _json_file(path: str) -> dict:
    """A JSON object's file, read."""
    try:
        with open(path) as f:
            result = json.load(f)
    except OSError as error:
        raise argparse.ArgumentTypeError(f"cannot read {path!r}: {error.strerror}") from None
    except ValueError:  # not JSON, or not even text
        raise argparse.ArgumentTypeError(f"{path!r} is not a JSON file") from None
    if not isinstance(result, dict):
        raise argparse.ArgumentTypeError(f"{path!r} holds no JSON object")
    return result


def _results(path: str) -> str:
    """A `glm5-decode bench --out` file."""
    if "rows" not in _json_file(path):
        raise argparse.ArgumentTypeError(f"{path!r} is not a glm5-decode bench results file")
    return path


def _bench_or_tune(path: str) -> str:
    """A `glm5-decode bench --out` or `tune --out` file."""
    from .tune import is_result  # no torch

    result = _json_file(path)
    if "rows" not in result and not is_result(result):
        raise argparse.ArgumentTypeError(f"{path!r} is neither a bench nor a tune results file")
    return path


def _tune_file(path: str) -> dict:
    """A `glm5-decode tune --out` file, read."""
    from .tune import is_result

    result = _json_file(path)
    if not is_result(result):
        raise argparse.ArgumentTypeError(f"{path!r} is not a glm5-decode tune results file")
    return result


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _import_torch():
    # A torch wheel without NumPy beside it warns "Failed to initialize NumPy" on import;
    # nothing here converts to NumPy, so the warning would only puzzle.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    import torch

    return torch


def _no_cuda(torch) -> str | None:
    """Why CUDA is unavailable, None where it is."""
    if torch.cuda.is_available():
        return None
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    return f"torch {torch.__version__} sees no CUDA device"


def _check_fits(g, device, name: str, **kw) -> None:
    from .reference.memory import fit_problem

    problem = fit_problem(g, device, **kw)
    if problem:
        raise BadInput(f"--geometry {name}: {problem}")


def demo(args) -> None:
    if args.compare and not _installed("triton"):
        raise BadInput(
            "--compare: the specialized decode's kernels need Triton: pip install triton"
        )
    if args.compare and args.device == "cpu":
        # No GPU: Triton's interpreter runs the kernels. Read when the kernels are defined,
        # so before glm5_kernels is first imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    torch = _import_torch()
    from .reference import geometry

    if args.device == "cuda" and (why := _no_cuda(torch)):
        raise BadInput(f"--device cuda: {why}")
    if args.family is None:
        from glm5_policy import family_of

        capability = torch.cuda.get_device_capability() if args.device == "cuda" else (9, 0)
        args.family = family_of(capability) or "sm90"
    spare = 1 if args.compare and args.device == "cuda" else 0  # demo.build's
    _check_fits(
        geometry(args.geometry), torch.device(args.device), args.geometry,
        max_requests=args.prompts + spare, max_context=args.max_context, q=1 + args.spec,
        block_size=BLOCK_SIZE,
    )  # fmt: skip
    from .demo import show

    show(args)


def bench(args) -> None:
    torch = _import_torch()
    from .reference import geometry

    if why := _no_cuda(torch):
        raise BadInput(f"needs a CUDA GPU: {why}")
    q, tokens = args.q, [int(t) for t in args.tokens.split(",")]
    # bench.run's model: one request per q tokens of the largest step, context + 16 tokens.
    _check_fits(
        geometry(args.geometry), "cuda", args.geometry, max_requests=max(tokens) // q,
        max_context=args.context + 16, q=q,
    )  # fmt: skip
    from .bench import plot, run

    result = run(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        if args.plot:
            plot([args.out], args.plot)


def tune(args) -> None:
    torch = _import_torch()
    from .reference import geometry

    if why := _no_cuda(torch):
        raise BadInput(f"needs a CUDA GPU: {why}")
    tokens = [int(t) for t in args.tokens.split(",")]
    _check_fits(
        geometry(args.geometry), "cuda", args.geometry, max_requests=max(tokens) // args.q,
        max_context=args.context + 16, q=args.q,
    )  # fmt: skip
    from .tune import run, show

    result = run(args)
    print(show(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


def _tuned_stages(text: str) -> str:
    """Comma-separated policy stages to tune (the others keep the starting table)."""
    from .tune import ORDER

    names = text.split(",")
    unknown = [n for n in names if n not in ORDER]
    if unknown or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"expects comma-separated stages from {', '.join(ORDER)}, each once, got {text!r}"
        )
    return text


def plot_files(args) -> None:
    from .results import plot

    plot(args.results, args.out)


def merge_files(args) -> None:
    from .tune import merged  # no torch either

    print(json.dumps(merged(args.results)))


def table_files(args) -> None:
    from .results import table  # no torch: formatting JSON needs none
    from .tune import summary

    read = [(path, _json_file(path)) for path in args.results]
    benches = [path for path, r in read if "rows" in r]
    print("\n\n".join([*([table(benches)] if benches else []),
                        *(summary(r) for _, r in read if "rows" not in r)]))  # fmt: skip


def _timed_steps(parser: argparse.ArgumentParser, tokens: str, what: str) -> None:
    """The steps a GPU command times (bench, tune): the geometry, token counts, q, context
    and replays."""
    parser.add_argument("--geometry", default="flash-tp4-rank", **_GEOMETRY)
    parser.add_argument(
        "--tokens", type=_token_counts, default=tokens,
        help=f"{what}, comma-separated, each a multiple of --q",
    )  # fmt: skip
    parser.add_argument(
        "--q", type=_integer(1, MAX_Q), default=1,
        help=f"tokens per request (1: decode, 2..{MAX_Q}: MTP verify)",
    )  # fmt: skip
    parser.add_argument(
        "--context", type=_count, default=4096, help="tokens already in each request"
    )
    parser.add_argument(
        "--iters", type=_count, default=10, help="CUDA-graph replays timed per step"
    )


COMMANDS = "{demo,bench,tune,merge,plot,table}"


def parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The `glm5-decode` parser and each command's own (which prints that command's usage
    above its errors)."""
    formatter = _Defaults
    top = argparse.ArgumentParser(
        prog="glm5-decode",
        description="The reference GLM-5.3-Flash backbone: a demo of MTP decoding, and the "
        "stock vs specialized decode benchmark.",
        formatter_class=formatter,
    )
    sub = top.add_subparsers(dest="command", required=True, metavar=COMMANDS)
    d = sub.add_parser(
        "demo",
        help="serve a few random prompts on the reference backbone (random weights)",
        description="Serve random prompts on the reference backbone with random weights: "
        "prefill, then per step the MTP layer drafts, the target verifies q = 1 + spec tokens "
        "and keeps them up to the first disagreement; timed per step and per stage.",
        formatter_class=formatter,
    )
    d.add_argument("--geometry", default="tiny", **_GEOMETRY)
    d.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="torch device")
    d.add_argument(
        "--prompts", type=_count, default=3, help="prompts served (the model holds caches for all)"
    )
    d.add_argument("--prompt-len", type=_count, default=24, help="tokens per prompt")
    d.add_argument("--steps", type=_count, default=8, help="verify steps per prompt")
    d.add_argument(
        "--spec",
        type=_integer(0, MAX_Q - 1, f" (q = 1 + spec <= {MAX_Q} tokens per verify)"),
        default=3,
        help=f"MTP drafted tokens per step, q - 1 (0..{MAX_Q - 1}; 0: plain decode)",
    )
    d.add_argument(
        "--share-index", action="store_true", help="draft steps reuse step 0's top-k (vLLM option)"
    )
    d.add_argument(
        "--max-context",
        type=_count,
        default=512,
        help="longest sequence the caches hold (>= prompt-len + steps * q)",
    )
    d.add_argument("--seed", type=_integer(0, 2**32 - 1), default=0, help="weights and prompts")
    d.add_argument(
        "--compare",
        action="store_true",
        help="serve the same prompts again with the target's steps on the specialized decode "
        "(CPU: Triton interpreted, seconds a step; GPU: each step a CUDA graph) and compare "
        "both paths' tokens",
    )
    d.add_argument(
        "--policy", type=_policy, default=None, help="with --compare: policy table JSON over "
        "the family default",
    )  # fmt: skip
    d.add_argument(
        "--family", default=None, choices=FAMILIES,
        help="with --compare: the GPU family's default table (default: this GPU's; sm90 on CPU)",
    )  # fmt: skip
    d.set_defaults(run=demo)

    b = sub.add_parser(
        "bench",
        help="stock vs specialized decode steps on the GPU",
        description="Per-step latency of the stock decode vs the specialized decode (each "
        "step one CUDA graph), with the HBM floor and a per-stage breakdown. Needs a GPU.",
        formatter_class=formatter,
    )
    _timed_steps(b, "1,8,64", "token counts per step")
    b.add_argument(
        "--stock",
        type=_stocks,
        default="both",
        help="the stock step(s) to time, comma-separated: reference (the reference backbone's "
        "plain torch ops), torch (its linears, experts and KDA recurrence on torch-level library "
        "calls: cuBLAS, torch block-FP8 _scaled_mm, fla's KDA where it imports), vllm (vLLM "
        f"0.33's own fused-MoE and KDA Triton kernels, from --vllm-ops); both: {BOTH}",
    )
    b.add_argument(
        "--vllm-ops", type=_vllm_folder, metavar="DIR",
        help="with --stock vllm: a folder of vLLM 0.33's kernel files (benchmarks/vllm_files.py "
        "copies them out of an installed vllm==0.33.0)",
    )  # fmt: skip
    b.add_argument(
        "--policy", type=_policy, default=None, help="policy table JSON over the family default"
    )
    b.add_argument("--family", default="sm90", choices=FAMILIES, help="GPU family's defaults")
    b.add_argument(
        "--kernels", action="store_true",
        help="also each step's kernel table: every kernel by the stage that launched it, its "
        "launches and own time (profiled with PDL off), each stage's bytes and floor ratio",
    )  # fmt: skip
    b.add_argument("--out", type=_new_file, help="results JSON")
    b.add_argument("--plot", type=_new_file, help="results PNG (needs --out and matplotlib)")
    b.add_argument("--commit", help="the code's commit, where the tree's git lacks it")
    b.set_defaults(run=bench)

    t = sub.add_parser(
        "tune",
        help="the policy table measured on this GPU",
        description="Time each stage's choices (stock included) in the whole planned step, one "
        "CUDA graph per capture size, stage after stage; keep the fastest per size (ties within "
        "the noise go to the simpler choice), confirm the table against the starting one and "
        "write it with its measurements. Needs a GPU.",
        formatter_class=formatter,
    )
    _timed_steps(t, "1,2,4,8,16,32,64", "the capture sizes")
    t.add_argument(
        "--vllm-ops", type=_vllm_folder, metavar="DIR",
        help="stock stages run vLLM 0.33's experts, KDA core and mHC pre from this folder of "
        "its files (benchmarks/vllm_files.py), as in a vLLM server; without it, the reference's "
        "torch ops",
    )  # fmt: skip
    t.add_argument(
        "--policy", type=_policy, default=None,
        help="the starting table: policy table JSON over the family default",
    )  # fmt: skip
    t.add_argument("--family", default="sm90", choices=FAMILIES, help="GPU family's defaults")
    t.add_argument(
        "--stages", type=_tuned_stages, default=None,
        help="comma-separated stages to tune (default: all; the others keep the starting table)",
    )  # fmt: skip
    t.add_argument(
        "--out", type=_new_file,
        help='results JSON (the table under "policy"), rewritten after each stage',
    )  # fmt: skip
    t.add_argument(
        "--resume", type=_json_file, metavar="FILE",
        help="go on from an unfinished --out file (a run cut short): its stages are kept, "
        "the others timed; the same step's arguments",
    )  # fmt: skip
    t.add_argument("--commit", help="the code's commit, where the tree's git lacks it")
    t.set_defaults(run=tune)

    def results_command(name: str, run, help: str, description: str, kind=_results,
                        files="`glm5-decode bench --out` files"):  # fmt: skip
        c = sub.add_parser(name, help=help, description=description, formatter_class=formatter)
        c.add_argument("results", nargs="+", type=kind, help=files)
        c.set_defaults(run=run)
        return c

    p = results_command(
        "plot", plot_files, "plot bench results JSON files into one PNG",
        "Stock, specialized and floor ms per token count, one panel per results file. Needs "
        "matplotlib.",
    )  # fmt: skip
    p.add_argument("--out", required=True, type=_new_file, help="the PNG to write")
    results_command(
        "table", table_files, "print bench or tune results JSON files as markdown tables",
        "Bench files: each step's time per side, kernels per step and ratios, then the stage "
        "split. Tune files: the chosen table, the confirmation and the policy. The runtime "
        "README's tables, straight from the results files.",
        _bench_or_tune, "`glm5-decode bench --out` or `tune --out` files",
    )  # fmt: skip
    m = sub.add_parser(
        "merge", help="one policy table from several tune results",
        description="The table a deployment serving several q's (or TP geometries) runs: at "
        "each token count the choice every tune result picked, else the simplest of their "
        "picks. The shipped SM90 default is this over the H200's results. Prints the policy "
        "JSON.",
        formatter_class=formatter,
    )  # fmt: skip
    m.add_argument("results", nargs="+", type=_tune_file, help="`glm5-decode tune --out` files")
    m.set_defaults(run=merge_files)
    return top, sub.choices


def _problem(args) -> str | None:
    """What the values say together (each value alone is the argparse types' check)."""
    if args.command == "demo":
        need = args.prompt_len + args.steps * (1 + args.spec)
        if args.max_context < need:
            return (
                f"--max-context {args.max_context}: a {args.prompt_len}-token prompt and "
                f"{args.steps} steps of q={1 + args.spec} tokens need {need}"
            )
        if not args.compare and (args.policy is not None or args.family is not None):
            return "--policy and --family: choose the specialized decode's stages (--compare)"
    elif args.command in ("bench", "tune"):
        uneven = [t for t in map(int, args.tokens.split(",")) if t % args.q]
        if uneven:
            return f"--tokens {args.tokens}: {uneven} not multiples of --q {args.q}"
    if args.command == "tune" and args.resume is not None:
        from .tune import resume_problem

        if why := resume_problem(args.resume, args):
            return f"--resume: {why}"
    if args.command == "bench":
        if args.plot and not args.out:
            return "--plot: needs --out (the plot is drawn from the results file)"
        vllm = "vllm" in args.stock.split(",")
        if vllm and not args.vllm_ops:
            return (
                "--stock vllm: needs --vllm-ops DIR, a folder of vLLM 0.33's kernel files "
                "(benchmarks/vllm_files.py copies them out of an installed vllm==0.33.0)"
            )
        if args.vllm_ops and not vllm:
            return "--vllm-ops: only with --stock vllm (the folder holds that stock's kernels)"
    plots = args.command == "plot" or (args.command == "bench" and args.plot)
    if plots and not _installed("matplotlib"):
        return "plotting needs matplotlib: pip install matplotlib"
    return None


def main(argv: list[str] | None = None) -> None:
    top, commands = parsers()
    args = top.parse_args(argv)
    command = commands[args.command]
    problem = _problem(args)
    if problem:
        command.error(problem)
    try:
        args.run(args)
    except BadInput as error:
        command.error(str(error))
    except KeyboardInterrupt:
        # One line, not the traceback of wherever the work was; 130 = 128 + SIGINT, as a shell
        # reports a command it interrupted.
        print(f"\n{command.prog}: interrupted", file=sys.stderr, flush=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
