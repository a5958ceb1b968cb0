"""`glm5-decode tune` on the GPU, over the tiny geometry (seconds): the real step timed per
candidate, a stage that cannot build there recorded with its warning and never picked, and
the written table read back by the policy parser."""

import json
from types import SimpleNamespace

import pytest

from glm5_policy import Policy
from glm5_runtime import tune

pytestmark = pytest.mark.gpu


def test_tune_times_the_real_step_and_records_what_cannot_build(tmp_path):
    out = tmp_path / "tune.json"
    args = SimpleNamespace(geometry="tiny", q=1, tokens="1,2", context=64, iters=3,
                           vllm_ops=None, policy=None, family="sm90",
                           stages="moe,kda,boundary", commit="test", out=str(out),
                           resume=None)  # fmt: skip
    result = tune.run(args)
    assert result["sizes"] == [1, 2] and list(result["stages"]) == ["moe", "boundary", "kda"]
    # tiny's hidden size (64) is not a whole FP8 block: the MoE stage cannot build there.
    moe = result["stages"]["moe"]["candidates"]
    assert all("did not build: " in moe[c]["failed"] for c in ("per_route", "grouped"))
    assert set(result["stages"]["moe"]["picked"].values()) == {None}
    for stage in ("kda", "boundary"):
        runs = result["stages"][stage]["candidates"]
        assert all(t > 0 for t in runs["stock"]["ms"].values()), runs
    policy = Policy.from_json(result["policy"])
    assert tune.from_policy(policy, [1, 2])["kda"] == result["stages"]["kda"]["picked"]
    assert all(c["tuned_ms"] > 0 and c["start_ms"] > 0 for c in result["confirm"].values())
    # The checkpoint after the last stage: a run going on from it times only the new stage.
    saved = json.loads(out.read_text())
    assert saved["unfinished"] and saved["remaining"] == [] and saved["policy"] == result["policy"]
    more = SimpleNamespace(**{**vars(args), "stages": "moe,kda,boundary,router",
                              "resume": saved, "out": str(tmp_path / "more.json")})  # fmt: skip
    assert tune.resume_problem(saved, more) is None
    again = tune.run(more)
    assert list(again["stages"]) == ["moe", "boundary", "kda", "router"]
    for stage in ("moe", "boundary", "kda"):  # kept, not re-timed
        assert again["stages"][stage] == result["stages"][stage], stage
    assert again["start_ms"] == result["start_ms"] and again["earlier_runs"][0]["commit"] == "test"
