"""`glm5-decode`: every bad input is argparse's refusal (a usage block, one error line, exit
status 2, no traceback) before any work; `--help` and `table` import no torch; Ctrl-C is one
line and exit status 130; the demo shows prompts, the prefill's token and generated tokens
apart, what its times cover, and with `--compare` both paths' tokens. Also
`Geometry.from_hf` on a plain config.json, and the memory estimate the demo's refusal rests
on."""

import hashlib
import json
import os
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from glm5_runtime import cli
from glm5_runtime.reference import ReferenceModel, geometry
from glm5_runtime.reference import memory as reference_memory


def refused(capsys, argv: list[str]) -> str:
    """main(argv)'s error line, after checking it is argparse's refusal: exit status 2,
    stderr a usage block then exactly one "glm5-decode ...: error: ..." line, last."""
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    err = capsys.readouterr().err
    lines = err.rstrip("\n").splitlines()
    assert info.value.code == 2, err
    assert "Traceback" not in err
    assert lines[0].startswith("usage: glm5-decode")
    *usage, error = lines
    assert all(line.startswith(("usage:", " ")) for line in usage), err
    assert error.startswith("glm5-decode") and ": error: " in error
    return error.split(": error: ", 1)[1]


@pytest.fixture
def no_build(monkeypatch):
    """A refusal that fails to come must not build a model (flash would take 77 GiB)."""

    def build(*args, **kwargs):
        raise AssertionError("built a model: the input was not refused")

    monkeypatch.setattr(ReferenceModel, "random", build)


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["demo", "--prompts", "0"], "argument --prompts: expects a positive integer, got '0'"),
        (["demo", "--steps", "0"], "argument --steps: expects a positive integer, got '0'"),
        (["demo", "--spec", "-1"], "argument --spec: expects an integer in 0..7"),
        (["demo", "--spec", "10"], "argument --spec: expects an integer in 0..7"),
        (["demo", "--prompt-len", "abc"], "argument --prompt-len: expects a positive integer"),
        (["demo", "--max-context", "0"], "argument --max-context: expects a positive integer"),
        (["demo", "--seed", "-1"], "argument --seed: expects an integer in 0.."),
        (["demo", "--geometry", "flash-tp3-rank"], "argument --geometry: invalid choice"),
        (["demo", "--max-context", "40"], "--max-context 40: a 24-token prompt and 8 steps"),
        (["bench", "--tokens", "abc"], "argument --tokens: expects comma-separated token counts"),
        (["bench", "--tokens", "1,,8"], "argument --tokens: expects comma-separated"),
        (["bench", "--tokens", "1,128"], "argument --tokens: expects comma-separated"),
        (
            ["bench", "--tokens", "8,1,8,8"],
            "argument --tokens: expects each token count once, got '8,1,8,8' (8 repeated)",
        ),
        (["bench", "--q", "4", "--tokens", "4,6"], "--tokens 4,6: [6] not multiples of --q 4"),
        (["bench", "--q", "9"], "argument --q: expects an integer in 1..8"),
        (["bench", "--iters", "0"], "argument --iters: expects a positive integer"),
        (["bench", "--context", "0"], "argument --context: expects a positive integer"),
        (
            ["bench", "--stock", "cublas"],
            "argument --stock: expects comma-separated stocks from "
            "reference, torch, vllm, each once (or both: reference,torch), got 'cublas'",
        ),
        (["bench", "--stock", "vllm,vllm"], "argument --stock: expects comma-separated stocks"),
        (
            ["bench", "--stock", "torch,vllm"],
            "--stock vllm: needs --vllm-ops DIR, a folder of "
            "vLLM 0.33's kernel files (benchmarks/vllm_files.py copies them out of an installed "
            "vllm==0.33.0)",
        ),
        (
            ["bench", "--stock", "vllm", "--vllm-ops", "/no/such/folder"],
            "argument --vllm-ops: no folder '/no/such/folder'",
        ),
        (["bench", "--policy", "{"], "argument --policy: policy: not valid JSON"),
        (["bench", "--policy", '{"moe": "x"}'], "argument --policy: policy['moe']: unknown"),
        (
            ["bench", "--policy", '{"moe": "grouped", "kda": null, "moe": null}'],
            "argument --policy: policy: key 'moe' given more than once (JSON keeps only the last)",
        ),
        (
            ["demo", "--compare", "--policy", '{"moe": {"1-4": "grouped", "1-4": null}}'],
            "argument --policy: policy['moe']: key '1-4' given more than once",
        ),
        (["demo", "--policy", "{}"], "--policy and --family: choose the specialized decode's"),
        (["demo", "--family", "sm100"], "--policy and --family: choose the specialized"),
        (["bench", "--out", "/no/such/folder/b.json"], "argument --out: no folder"),
        (["bench", "--plot", "b.png"], "--plot: needs --out"),
        (["plot", "no-such-file.json", "--out", "p.png"], "argument results: cannot read"),
        (["tune", "--q", "4", "--tokens", "4,6"], "--tokens 4,6: [6] not multiples of --q 4"),
        (["tune", "--tokens", "1,65"], "argument --tokens: expects comma-separated token counts"),
        (
            ["tune", "--stages", "moe,attention"],
            "argument --stages: expects comma-separated stages from moe, boundary, kda,",
        ),
        (["tune", "--stages", "moe,moe"], "argument --stages: expects comma-separated stages"),
        (["tune", "--policy", '{"kda": "split_gate"}'], "argument --policy: policy['kda']"),
        (["tune", "--out", "/no/such/folder/t.json"], "argument --out: no folder"),
        ([], "the following arguments are required"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else "",
)
def test_bad_input_is_one_line(capsys, no_build, no_cuda, argv, message):
    assert refused(capsys, argv).startswith(message)


def _vllm_folder(path, version="0.33.0"):
    """A folder shaped as benchmarks/vllm_files.py makes one (its files' contents aside)."""
    from glm5_runtime.vllm_files import FILES, MANIFEST

    files = {}
    for name in FILES.values():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(f"# {name}\n")
        files[name] = hashlib.sha256((path / name).read_bytes()).hexdigest()
    (path / MANIFEST).write_text(json.dumps({"vllm": version, "files": files}))
    return str(path)


def test_vllm_ops_folder_is_checked_and_needs_the_vllm_stock(capsys, no_build, no_cuda, tmp_path):
    folder = _vllm_folder(tmp_path / "ok")
    assert refused(capsys, ["bench", "--vllm-ops", folder]) == (
        "--vllm-ops: only with --stock vllm (the folder holds that stock's kernels)"
    )
    assert refused(capsys, ["bench", "--stock", "vllm", "--vllm-ops", folder]).startswith(
        "needs a CUDA GPU"
    )  # the folder passed: the next check is the GPU's
    old = _vllm_folder(tmp_path / "old", version="0.32.0")
    assert refused(capsys, ["bench", "--stock", "vllm", "--vllm-ops", old]) == (
        f"argument --vllm-ops: {old!r} holds vLLM 0.32.0's files, not 0.33.0's"
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    assert refused(capsys, ["bench", "--stock", "vllm", "--vllm-ops", str(empty)]) == (
        f"argument --vllm-ops: {str(empty)!r} has no vllm_files.json (benchmarks/vllm_files.py "
        "makes the folder)"
    )


def test_cuda_demo_without_cuda(capsys, no_build, no_cuda):
    assert refused(capsys, ["demo", "--device", "cuda"]).startswith("--device cuda: torch ")


def test_bench_checks_arguments_then_cuda(capsys, no_build, no_cuda):
    assert refused(capsys, ["bench", "--tokens", "abc"]).startswith("argument --tokens")
    assert refused(capsys, ["bench"]).startswith("needs a CUDA GPU: torch ")


def test_tune_checks_arguments_then_cuda_then_the_geometry(capsys, monkeypatch, no_build):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert refused(capsys, ["tune", "--q", "3", "--tokens", "3,4"]).startswith("--tokens 3,4")
    assert refused(capsys, ["tune"]).startswith("needs a CUDA GPU: torch ")
    # A GPU of 60 GiB free: one TP-4 rank (77 GiB of weights) does not fit, before any work.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(reference_memory, "free_bytes", lambda device: 60 << 30)
    error = refused(capsys, ["tune", "--geometry", "flash-tp4-rank"])
    assert error.startswith("--geometry flash-tp4-rank: 1 of 4 TP ranks need ")


@pytest.mark.parametrize("argv", [["plot", "{results}", "--out", "p.png"],
                                  ["bench", "--out", "b.json", "--plot", "b.png"]])  # fmt: skip
def test_plot_without_matplotlib(capsys, monkeypatch, no_cuda, tmp_path, argv):
    results = tmp_path / "bench.json"
    results.write_text(json.dumps({"rows": []}))
    monkeypatch.setattr(cli, "_installed", lambda module: module != "matplotlib")
    argv = [a.format(results=results) for a in argv]
    assert refused(capsys, argv) == "plotting needs matplotlib: pip install matplotlib"


def test_more_prompts_than_fit(capsys, monkeypatch, no_build):
    monkeypatch.setattr(reference_memory, "free_bytes", lambda device: 4 << 30)
    error = refused(capsys, ["demo", "--prompts", "100000"])
    assert error.startswith("--geometry tiny: 1 of 1 TP ranks need ")
    assert "for 100000 requests of 512 tokens), 4.0 GiB free: at most " in error
    fit = int(error.split("at most ")[1].split()[0])
    caches = reference_memory.cache_bytes(geometry("tiny"), max_requests=fit, max_context=512, q=4)
    assert 0 < fit < 100000 and caches <= 4 << 30


def test_geometry_too_large_names_one_that_fits(capsys, monkeypatch, no_build):
    # 60 GiB: one rank of TP 4 (77 GiB of weights) does not fit, one of TP 8 (39 GiB) does.
    monkeypatch.setattr(reference_memory, "free_bytes", lambda device: 60 << 30)
    error = refused(capsys, ["demo", "--geometry", "flash-tp4-rank"])
    assert error.startswith("--geometry flash-tp4-rank: 1 of 4 TP ranks need ")
    assert error.endswith("geometry 'flash-tp8-rank' fits")


def test_help_imports_no_torch():
    script = """
import sys
from glm5_runtime.cli import main
for argv in (["--help"], ["demo", "--help"], ["bench", "--help"], ["tune", "--help"]):
    try:
        main(argv)
    except SystemExit as exit:
        assert exit.code == 0
heavy = sorted(m for m in ("torch", "triton", "numpy", "transformers") if m in sys.modules)
assert not heavy, heavy
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "--max-context MAX_CONTEXT" in run.stdout and "(default: 512)" in run.stdout


def test_geometry_choices_are_the_named_geometries():
    for name in cli.GEOMETRIES:
        geometry(name)


def test_tiny_demo_shows_prompt_and_generated_tokens_apart(capsys):
    cli.main(["demo", "--prompts", "1", "--steps", "1", "--prompt-len", "8"])
    out = capsys.readouterr().out
    lines = out.splitlines()
    prompt = next(i for i, line in enumerate(lines) if line.startswith("prompt 0 (8 tokens): ["))
    prefill = next(i for i, line in enumerate(lines) if line.startswith("  prefill: "))
    step = next(i for i, line in enumerate(lines) if line.startswith("  step 1/1: drafts ["))
    generated = next(i for i, line in enumerate(lines) if line.startswith("generated ("))
    assert prompt < prefill < step < generated
    assert "q = 4 tokens each" in out
    assert "drafts accepted: with random weights" in out
    tokens = json.loads(lines[generated].split(": ", 1)[1])
    assert lines[generated].startswith(f"generated ({len(tokens)} tokens)") and len(tokens) >= 2
    # The first generated token is the prefill's, and says so.
    assert f"generates {tokens[0]} (the first token), then drafts" in lines[prefill]
    # What the times cover: prefills, steps, the whole serve; what a step holds.
    (summary,) = [line for line in lines if line.startswith("stock: prefills ")]
    assert "(1 prompts), 1 steps " in summary and ", in all " in summary
    assert "ms/step (the target's q=4 verify and the MTP layer's 3 drafts for the next)" in out
    assert "per stage (of the " in out and ": prefills, steps and drafts):" in out


# The demo's compare with kernels the interpreter runs in seconds (moe off: where it serves,
# it runs the router itself).
CHEAP = json.dumps(
    {"boundary": None, "kda": None, "kda_proj": None, "dsa_proj": None, "dsa_attn": None,
     "dsa_indexer": None, "dsa_kpool": None, "moe": None, "router": "split_k",
     "logits_head": "skinny"}
)  # fmt: skip


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on CPU needs TRITON_INTERPRET=1"
)
def test_demo_compare_prints_both_paths_tokens_and_that_they_agree(capsys):
    """The product's point: the same prompts through the specialized decode (its Triton
    kernels interpreted on CPU) give the stock path's tokens."""
    argv = ["demo", "--compare", "--prompts", "2", "--steps", "2", "--prompt-len", "8"]
    cli.main([*argv, "--policy", CHEAP])
    out = capsys.readouterr().out
    lines = out.splitlines()
    (built,) = [line for line in lines if line.startswith("compiled in ")]
    assert built.endswith("stages logits_head, router"), built
    assert lines.index("== stock ==") < lines.index("== specialized ==")
    served = {}
    for side in ("stock", "specialized"):
        for p in range(2):
            (line,) = [x for x in lines if x.startswith(f"  prompt {p}: {side} ")]
            served[side, p] = json.loads(line.split(side, 1)[1])
            assert len(served[side, p]) >= 3  # the prefill's token and one a step at least
    assert all(served["stock", p] == served["specialized", p] for p in range(2))
    total = sum(len(served["stock", p]) for p in range(2))
    assert f"the paths agree: all {total} generated tokens equal" in lines
    assert any(x.startswith("specialized: prefills ") for x in lines)


def test_table_imports_no_torch():
    """Formatting a results file needs neither torch (2 s) nor NumPy (whose absence warned)."""
    script = """
import sys
from glm5_runtime.cli import main
tuned = "packages/glm5-policy/src/glm5_policy/defaults/measured/tune_h200_tp{}.json"
main(["table", "benchmarks/results/decode_h200_tp4.json", tuned.format("4_q1"),
      tuned.format("8_q1")])
heavy = sorted(m for m in ("torch", "triton", "numpy") if m in sys.modules)
assert not heavy, heavy
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert run.returncode == 0 and run.stderr == "", run.stderr
    assert "| flash-tp4-rank | 1 |" in run.stdout and "| mhc, norms, reduce % |" in run.stdout
    # Tune files: what ran, the chosen table, the confirmation (an unfinished run: says so).
    tp4, tp8 = run.stdout.split("**flash-tp4-rank, q = 1**")[1].split("**flash-tp8-rank, q = 1**")
    assert "| moe | per_route |" in tp4 and "| tokens | start ms | tuned ms |" in tp4
    assert "(unfinished: kda, " in tp8 and "| tokens | start ms |\n" in tp8


def test_ctrl_c_stops_the_demo_with_one_line_and_status_130():
    # SIGINT's handler set as an interactive shell leaves it: a child of a background job
    # inherits SIGINT ignored, and Python then installs no KeyboardInterrupt for it.
    script = (
        "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "from glm5_runtime.cli import main; "
        "main(['demo', '--steps', '200', '--prompt-len', '4', '--max-context', '1024'])"
    )
    demo = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        for line in demo.stdout:  # interrupted while serving, not while starting
            if line.startswith("  step 1/200"):
                break
        demo.send_signal(signal.SIGINT)
        _, err = demo.communicate(timeout=120)
    finally:
        demo.kill()
    assert demo.returncode == 130, err
    assert err.strip() == "glm5-decode demo: interrupted"


def test_cache_estimate_is_what_the_model_allocates():
    g = geometry("tiny")
    kw = dict(max_requests=3, max_context=200, q=4, block_size=32)
    model = ReferenceModel.random(g, **kw)
    caches = [model.block_table, model.state_slots] + [
        t
        for rank in model.ranks
        for kind in (rank.c.conv, rank.c.recurrent, rank.c.latent, rank.c.tail, rank.c.kpool)
        for t in kind.values()
    ]
    assert reference_memory.cache_bytes(g, **kw) == sum(t.nbytes for t in caches)


# Geometry.from_hf: a config.json read without transformers gives the transformers config's
# geometry, including what Glm5NextTextConfig derives in __post_init__.
def _plain(d: dict) -> SimpleNamespace:
    return json.loads(json.dumps(d), object_hook=lambda o: SimpleNamespace(**o))


def test_from_hf_plain_flash_config():
    from glm5_runtime.reference import Geometry

    config = geometry("flash").to_hf()
    assert Geometry.from_hf(_plain(config.to_dict())) == Geometry.from_hf(config)
    assert Geometry.from_hf(json.loads(config.to_json_string())) == Geometry.from_hf(config)


@pytest.mark.parametrize(
    "changes",
    [
        {"index_topk_pattern": "FFFFSFFF"},
        {"index_topk_pattern": ["full", "full", "full", "full", "shared", "full", "full", "full"]},
        {"index_topk_freq": 4, "index_skip_topk_offset": 4},
        {"index_topk_freq": 1},
        {},  # no indexer schedule at all: every layer runs its indexer
    ],
    ids=["pattern", "pattern-list", "freq-offset", "freq-1", "none"],
)
def test_from_hf_plain_derives_the_indexer_schedule(changes):
    transformers = pytest.importorskip("transformers")
    from glm5_runtime.reference import Geometry

    d = geometry("tiny").to_hf().to_dict()
    del d["indexer_types"]
    d.update(changes)
    expected = Geometry.from_hf(transformers.Glm5NextTextConfig(**d))
    assert Geometry.from_hf(_plain(d)) == expected
    assert Geometry.from_hf(d) == expected
    # A composite Glm5NextConfig's json holds the text fields under text_config.
    assert Geometry.from_hf(_plain({"text_config": d})) == expected


def test_from_hf_plain_linear_attn_config_and_layer_names():
    transformers = pytest.importorskip("transformers")
    from glm5_runtime.reference import Geometry

    d = geometry("tiny").to_hf().to_dict()
    d["layer_types"] = [
        "full_attention" if t == "deepseek_sparse_attention" else t for t in d["layer_types"]
    ]
    d["linear_attn_config"] = {"head_dim": 32, "num_heads": 4, "gate_lower_bound": None}
    expected = Geometry.from_hf(transformers.Glm5NextTextConfig(**d))
    assert expected.linear_head_dim == 32 and expected.linear_lower_bound == -5.0
    assert Geometry.from_hf(_plain(d)) == expected


def test_tune_resume_is_checked_before_cuda(capsys, no_build, no_cuda, tmp_path):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"rows": []}))
    assert refused(capsys, ["tune", "--resume", str(bench)]) == (
        "--resume: not a `glm5-decode tune --out` file"
    )
    assert refused(capsys, ["tune", "--resume", str(tmp_path / "none.json")]).startswith(
        "argument --resume: cannot read"
    )
    cut = {"benchmark": "glm5-decode tune", "policy": {}, "stages": {}, "unfinished": True,
           "geometry": "flash-tp4-rank", "context": 4096, "q": 1, "family": "sm90",
           "sizes": [1, 2, 4, 8, 16, 32, 64], "iters": 10,
           "stock": "the reference backbone's torch ops"}  # fmt: skip
    part = tmp_path / "part.json"
    part.write_text(json.dumps(cut))
    assert refused(capsys, ["tune", "--resume", str(part), "--iters", "5"]) == (
        "--resume: a different step: iters 10 there, 5 here"
    )
    assert refused(capsys, ["tune", "--resume", str(part)]).startswith("needs a CUDA GPU")


def test_merge_prints_the_merged_policy_and_imports_no_torch(capsys, tmp_path):
    script = """
import glob, sys
from glm5_runtime.cli import main
main(["merge", *sorted(glob.glob("packages/glm5-policy/src/glm5_policy/defaults/measured/*"))])
heavy = sorted(m for m in ("torch", "triton", "numpy") if m in sys.modules)
assert not heavy, heavy
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert run.returncode == 0 and run.stderr == "", run.stderr
    from glm5_policy import STAGES, Policy

    printed, default = Policy.from_json(json.loads(run.stdout)), Policy.default("sm90")
    assert all(printed.tables[s] == default.tables[s] for s in STAGES)
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"rows": []}))
    assert refused(capsys, ["merge", str(bench)]).endswith("is not a glm5-decode tune results file")
