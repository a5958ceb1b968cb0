"""`glm5-decode bench` results files read back without torch: the plot (`glm5-decode plot`)
and the runtime README's markdown tables (`glm5-decode table`). Formatting JSON needs neither
torch nor NumPy, so `table` answers at once on any machine."""

from __future__ import annotations

import json

__all__ = ["BETWEEN", "LINES", "STAGES", "kernel_tables", "plot", "table"]

# The stage methods a step's split is timed by (`stage_timer`, `bench.StageMarks`) and what
# runs between them: hc pre / post, norms, the sums.
STAGES = ("embed", "kda", "mla", "dense_mlp", "moe", "head")
BETWEEN = "mhc, norms, reduce"

LINES = (
    ("reference_ms", "reference stock"),
    ("torch_ms", "torch stock"),
    ("specialized_ms", "specialized"),
    ("floor_ms", "HBM floor"),
    ("vllm_ms", "vLLM-kernel stock"),
)


def plot(result_paths: list[str], out: str) -> None:
    """Each stock, specialized and floor ms per token count, one panel per results file."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [_load(path) for path in result_paths]
    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4), squeeze=False)
    for ax, r in zip(axes[0], results, strict=True):
        x = [row["tokens"] for row in r["rows"]]
        for i, (key, label) in enumerate(LINES):  # one colour a line in every panel
            if key in r["rows"][0]:
                ax.plot(x, [row[key] for row in r["rows"]], marker="o", label=label, color=f"C{i}")
        ax.set(xscale="log", yscale="log", xlabel="tokens per step", ylabel="ms per step",
               title=f"{r['geometry']} ({r['gpu']}, ctx {r['context']})")  # fmt: skip
        ax.set_xticks(x, [str(v) for v in x])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def _load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def table(result_paths: list[str]) -> str:
    """Results JSON files as the runtime README's markdown tables: per step the time of each
    side, kernels per step, the ratios; then the graph-captured stage split."""
    results = [_load(path) for path in result_paths]
    # The vLLM-kernel stock's columns where some file timed it.
    vllm = any("vllm_ms" in row for r in results for row in r["rows"])
    stocks = ["reference", "torch", *(["vllm"] if vllm else [])]
    short = {"reference": "ref", "torch": "torch", "vllm": "vllm"}
    out = [
        "| geometry | tokens | q | " + "".join(f"{s} ms | " for s in stocks) + "specialized ms "
        "| floor ms | " + "".join(f"vs {s} | " for s in stocks) + "specialized × floor "
        f"| kernels ({' / '.join(short[s] for s in stocks)} / spec) |",
        "| --- | ---: | ---: | " + "---: | " * (2 * len(stocks) + 3) + "--- |",
    ]

    def cell(row: dict, key: str, digits: int) -> str:
        return f"{row[key]:.{digits}f}" if key in row else "–"  # a stock not timed (--stock)

    for r in results:
        for row in r["rows"]:
            kernels = " / ".join(
                str((row["nodes"].get(side) or {}).get("kernel", "–"))
                for side in (*stocks, "specialized")
            )
            out.append(
                f"| {r['geometry']} | {row['tokens']} | {row['q']} | "
                + "".join(f"{cell(row, f'{s}_ms', 1)} | " for s in stocks)
                + f"{row['specialized_ms']:.1f} | {row['floor_ms']:.2f} | "
                + "".join(f"{cell(row, f'speedup_vs_{s}', 2)} | " for s in stocks)
                + f"{row['specialized_to_floor']:.1f} | {kernels} |"
            )
    # The split in shares of the marked graph's sum: its marks cost time of their own (each
    # an event record node that also breaks a PDL chain), so its sum exceeds the graph's.
    # The marks wrap the reference's stage methods; a step none of them ran in (a planned
    # step of sublayer stage objects) has no split, only the kernel table's owners.
    stages = [*STAGES, BETWEEN]
    out += ["", "| geometry | tokens | q | side | " + " | ".join(f"{s} %" for s in stages)
            + " | marked ms | graph ms |"]  # fmt: skip
    out.append("| --- | ---: | ---: | --- |" + " ---: |" * (len(stages) + 2))
    for r in results:
        for row in r["rows"]:
            for side, split in row["stages_ms"].items():
                if not set(split) & set(STAGES):
                    continue
                marked = row["marked_ms"][side]
                cells = " | ".join(f"{100 * split.get(s, 0) / marked:.1f}" for s in stages)
                out.append(
                    f"| {r['geometry']} | {row['tokens']} | {row['q']} | {side} | {cells} "
                    f"| {row['marked_ms'][side]:.1f} | {row[f'{side}_ms']:.1f} |"
                )
    tables = kernel_tables(results)
    return "\n".join(out) + ("\n\n" + tables if tables else "")


def kernel_tables(results: list[dict], top: int = 25) -> str:
    """`bench --kernels`' tables: per step and side, the owners of its kernels (launches,
    own µs, bytes, floor, ratio); for the specialized side its `top` kernels by time."""
    out = []
    for r in results:
        for row in r["rows"]:
            for side, t in (row.get("kernel_tables") or {}).items():
                launches = sum(o["launches"] for o in t["owners"])
                us = sum(o["us"] for o in t["owners"])
                out += [
                    f"**{r['geometry']}, {row['tokens']} token{'s' * (row['tokens'] > 1)} "
                    f"(q = {row['q']}), {side}**: {launches} launches (kernels and copies), "
                    f"{us / 1e3:.2f} ms of their own time "
                    f"(the graph {row[f'{side}_ms']:.2f} ms)",
                    "",
                    "| owner | launches | own µs | MB | floor µs | × floor |",
                    "| --- | ---: | ---: | ---: | ---: | ---: |",
                ]
                for o in t["owners"]:
                    ratio = "–" if o["to_floor"] is None else f"{o['to_floor']:.1f}"
                    out.append(
                        f"| {o['owner']} | {o['launches']} | {o['us']:.1f} "
                        f"| {o['bytes'] / 1e6:.2f} | {o['floor_us']:.1f} | {ratio} |"
                    )
                out.append("")
                if side != "specialized":
                    continue
                out += ["| owner | kernel | launches | own µs | µs each |",
                        "| --- | --- | ---: | ---: | ---: |"]  # fmt: skip
                for k in t["kernels"][:top]:
                    out.append(
                        f"| {k['owner']} | `{k['kernel']}` | {k['launches']} | {k['us']:.1f} "
                        f"| {k['us'] / k['launches']:.2f} |"
                    )
                out.append("")
    return "\n".join(out).rstrip()
