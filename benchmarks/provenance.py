"""What every result JSON under benchmarks/results records about its run (benchmark, GPU,
torch, date, commit, command line), and the one way the benchmarks write it."""

from __future__ import annotations

import argparse
import json
import subprocess
from datetime import date

import torch


def provenance(benchmark: str, args: argparse.Namespace) -> dict:
    """The header of `benchmark`'s result; `args.commit`, where given, names the code's commit
    (a working tree copied without its git history has none)."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    flags = " ".join(
        f"--{k.replace('_', '-')}" if v is True else f"--{k.replace('_', '-')} {v}"
        for k, v in vars(args).items()
        if v not in (None, "", False) and k not in ("out", "commit")
    )
    return {
        "benchmark": benchmark,
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": date.today().isoformat(),
        "commit": getattr(args, "commit", None) or head.stdout.strip() or "unknown",
        "command": f"python benchmarks/{benchmark}.py {flags}".rstrip(),
    }


def result_args(parser: argparse.ArgumentParser, table: bool = True) -> None:
    """The options every benchmark takes: where its JSON goes, the code's commit, and (with
    a `table(path)` of its own) printing a results file as markdown instead of running."""
    parser.add_argument("--out")
    parser.add_argument("--commit", help="the code's commit, where this tree's git lacks it")
    if table:
        parser.add_argument("--table", metavar="JSON", help="print a results file as markdown")


def write_result(path: str | None, result: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


def floor_bandwidth() -> float:
    """The bytes/s every floor of a run divides by (`hbm_bandwidth()["floor"]`, measured
    now), printed with the GPU's name."""
    from glm5_kernels.timing import hbm_bandwidth

    bw = hbm_bandwidth()["floor"]
    print(f"{torch.cuda.get_device_name()}: HBM {bw / 1e12:.2f} TB/s")
    return bw
