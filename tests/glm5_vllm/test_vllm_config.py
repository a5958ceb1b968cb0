"""specialized_decode_config / unsupported on real VllmConfig objects: one reason per
unsupported setting, all of them at once, our additional_config keys only (a policy the
stock decode ignores and a misspelling of our keys warn once; a policy nested past the
recursion limit is one error); every spelling of the sparse-MLA FP8 cache; and the hardening
cases, each one error: an int-keyed policy (vLLM's hash would crash), another model with
"mhc": true, additional_config text, Unicode digits, a repeated key, the graphs mode named.
The configs come from the same builders on CPUs with and without AMX."""

import sys

import pytest
import torch

pytestmark = pytest.mark.vllm

H200 = (9, 0)


def _full_graphs(config):
    from vllm.config import CUDAGraphMode

    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    config.compilation_config.cudagraph_capture_sizes = [1, 2, 4, 8, 16, 32, 64, 128]
    return config


def _good(vllm_config, **extra):
    return _full_graphs(
        vllm_config(additional_config={"decode_backend": "latency_specialized", **extra})
    )


def test_stock_unless_asked(vllm_config):
    from glm5_vllm.config import specialized_decode_config

    assert specialized_decode_config(vllm_config(), H200) is None
    # Other plugins' and vLLM's keys are not ours: ignored.
    other = vllm_config(additional_config={"kda_prefill_backend": "x", "someone": {"else": 1}})
    assert specialized_decode_config(other, H200) is None


def test_supported_deployment_builds_the_decode_config(vllm_config):
    from glm5_policy import Policy
    from glm5_vllm.config import specialized_decode_config, unsupported

    config = _good(vllm_config, policy={"moe": {"1-8": "per_route", "9-64": "grouped"}})
    assert unsupported(config, H200) == []
    decode = specialized_decode_config(config, H200)
    assert decode.q == 1 and decode.planned_tokens == (1, 2, 4, 8, 16, 32, 64)
    assert decode.policy("moe", 8) == "per_route" and decode.policy("dense_mlp", 1) == "gemv"
    sm100 = specialized_decode_config(config, (10, 0))  # the SM100 table under the user's
    assert sm100.policy == Policy.from_json(config.additional_config["policy"], family="sm100")
    assert sm100.policy("boundary", 1) == "triton" and decode.policy("boundary", 1) == "cute"


def _set(obj, **values):
    for k, v in values.items():
        setattr(obj, k, v)


CASES = {
    "capability": (None, "no CUDA GPU"),
    "tp": (lambda c: _set(c.parallel_config, tensor_parallel_size=3), "tensor parallel size 3"),
    "pp": (lambda c: _set(c.parallel_config, pipeline_parallel_size=2), "pipeline parallelism"),
    "dp": (lambda c: _set(c.parallel_config, data_parallel_size=2), "data parallelism"),
    "ep": (lambda c: _set(c.parallel_config, enable_expert_parallel=True), "expert parallelism"),
    "dbo": (lambda c: _set(c.parallel_config, enable_dbo=True), "dual-batch overlap"),
    "dcp": (
        lambda c: _set(c.parallel_config, decode_context_parallel_size=2),
        "context parallelism",
    ),
    "lora": (lambda c: _set(c, lora_config=object()), "LoRA"),
    "sleep": (lambda c: _set(c.model_config, enable_sleep_mode=True), "sleep mode"),
    "compile": (
        lambda c: _set(
            c.compilation_config, mode=__import__("vllm").config.CompilationMode.STOCK_TORCH_COMPILE
        ),
        "torch.compile",
    ),
    "eager": (
        lambda c: _set(
            c.compilation_config, cudagraph_mode=__import__("vllm").config.CUDAGraphMode.NONE
        ),
        "FULL decode CUDA graphs",
    ),
    "kv-dtype": (lambda c: _set(c.cache_config, cache_dtype="fp8_e5m2"), "KV cache dtype"),
    "kda-dtype": (lambda c: _set(c.cache_config, mamba_cache_dtype="float32"), "KDA state dtypes"),
    "replay": (lambda c: _set(c.cache_config, use_replayssm=True), "ReplaySSM"),
    "mhc": (lambda c: _set(c.model_config.hf_text_config, mhc=False), "without mHC"),
    "geometry": (
        lambda c: _set(c.model_config.hf_text_config, qk_rope_head_dim=64),
        "qk_rope_head_dim=64",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_one_reason_per_setting(vllm_config, case):
    from glm5_vllm.config import specialized_decode_config, unsupported

    change, reason = CASES[case]
    config = _good(vllm_config)
    capability = H200
    if change is None:
        capability = None  # this CPU machine's platform has no GPU
    else:
        change(config)
    reasons = unsupported(config, capability)
    assert len(reasons) == 1 and reason in reasons[0], reasons
    with pytest.raises(ValueError, match="does not support"):
        specialized_decode_config(config, capability)


def test_sequence_parallel_moe_comes_with_its_expert_and_data_parallelism(vllm_config):
    from glm5_vllm.config import unsupported

    config = _good(vllm_config)
    _set(config.parallel_config, all2all_backend="deepep_low_latency", enable_expert_parallel=True,
         tensor_parallel_size=2, data_parallel_size=2)  # fmt: skip
    reasons = unsupported(config, H200)
    assert len(reasons) == 3
    for reason in ("data parallelism", "expert parallelism", "sequence-parallel MoE"):
        assert any(reason in r for r in reasons), reasons


def test_every_reason_at_once_in_one_error(vllm_config):
    from glm5_vllm.config import specialized_decode_config

    config = _good(vllm_config)
    config.parallel_config.pipeline_parallel_size = 2
    config.cache_config.use_replayssm = True
    config.model_config.enable_sleep_mode = True
    with pytest.raises(ValueError) as e:
        specialized_decode_config(config, (8, 0))
    message = str(e.value)
    for reason in ("compute capability (8, 0)", "pipeline", "ReplaySSM", "sleep mode"):
        assert reason in message


def test_bad_backend_or_policy_is_one_clear_error(vllm_config):
    from glm5_policy import PolicyError
    from glm5_vllm.config import specialized_decode_config

    with pytest.raises(ValueError, match="decode_backend"):
        specialized_decode_config(_good(vllm_config, decode_backend="fastest"), H200)
    with pytest.raises(PolicyError) as e:
        specialized_decode_config(_good(vllm_config, policy={"moe": "mega", "x": 1}), H200)
    assert len(e.value.problems) == 2


def test_kda_dtypes_follow_the_mamba_cache_dtype(vllm_config):
    from glm5_vllm.config import deployment

    assert deployment(_good(vllm_config), H200).kda_state_dtypes == (torch.bfloat16, torch.float32)


def test_models_fail_before_building_when_the_request_cannot_run(vllm_config):
    """The registered classes read the configuration first: an unsupported request (this
    CPU machine has no GPU) raises with its reasons before any module is built."""
    from glm5_vllm import models

    config = _good(vllm_config)
    for cls in (models.Glm5NextForCausalLM, models.Glm5NextMTP):
        with pytest.raises(ValueError, match="no CUDA GPU"):
            cls(vllm_config=config)
    stock = vllm_config()  # not requested: nothing of ours runs before vLLM's constructor
    model = models.Glm5NextForCausalLM.__new__(models.Glm5NextForCausalLM)
    model._configure(stock)
    assert model.glm5_decode is None


# The tests' VllmConfig builders on both kinds of CPU. vLLM's CPU platform turns prefix
# caching off for MLA models unless the CPU has AMX tiles, after the hybrid-model hook tied
# mamba_block_size to it: the builders ask for it off from the start.


def _amx(monkeypatch, available):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: available)


def _x86():
    from vllm.platforms.cpu import CpuArchEnum, CpuPlatform

    return CpuPlatform.get_cpu_architecture() == CpuArchEnum.X86


def _stripped(config):
    """The deployment and decode config on an H200, the model's config object aside."""
    from dataclasses import replace

    from glm5_vllm.config import deployment, specialized_decode_config

    return replace(deployment(config, H200), model=None), specialized_decode_config(config, H200)


@pytest.mark.parametrize("amx", [False, True], ids=["no-amx", "amx"])
def test_builders_agree_with_and_without_amx(vllm_config, tmp_path, monkeypatch, amx):
    from tiny_model import tiny_config

    from glm5_vllm.config import unsupported

    _amx(monkeypatch, amx)
    config = _good(vllm_config)
    draft = tiny_config(tmp_path, draft=True)  # build()'s: the MTP drafter's speculative config
    for c in (config, draft):
        assert not c.cache_config.enable_prefix_caching
        assert c.cache_config.mamba_block_size == c.model_config.max_model_len
    assert unsupported(config, H200) == []
    _amx(monkeypatch, not amx)
    assert _stripped(config) == _stripped(_good(vllm_config))


def test_the_checks_do_not_depend_on_prefix_caching(vllm_config, monkeypatch):
    """vLLM's default (prefix caching on, as on a GPU) builds on CPU only with AMX tiles, and
    gives the same deployment there as the builders' prefix caching off; without AMX, vLLM
    0.33 refuses it (the failure the builders avoid: if this stops raising, vLLM fixed it)."""
    from vllm.config import CacheConfig

    if not _x86():
        pytest.skip("vLLM's CPU platform probes AMX on x86 only")
    _amx(monkeypatch, True)
    on = _full_graphs(
        vllm_config(
            cache_config=CacheConfig(), additional_config={"decode_backend": "latency_specialized"}
        )
    )
    assert on.cache_config.enable_prefix_caching
    assert on.cache_config.mamba_block_size != on.model_config.max_model_len
    assert _stripped(on) == _stripped(_good(vllm_config))
    _amx(monkeypatch, False)
    with pytest.raises(ValueError, match="--mamba-block-size can only be set"):
        vllm_config(cache_config=CacheConfig())


# additional_config: malformed policies, ignored policies and misspelled keys


@pytest.fixture
def warnings_once(monkeypatch, caplog):
    """A fresh process's record of what glm5-vllm has warned; the warnings it then logs."""
    from glm5_vllm import config

    monkeypatch.setattr(config, "_warned", set())
    caplog.set_level("WARNING", logger="glm5_vllm")

    def logged():
        return [r.getMessage() for r in caplog.records if r.name == "glm5_vllm"]

    return logged


def _deep(depth, leaf):
    for _ in range(depth):
        leaf = {"1-8": leaf}
    return leaf


@pytest.mark.parametrize("form", ["mapping", "json"])
def test_a_deeply_nested_policy_is_one_clear_error(vllm_config, form):
    """Parsing recurses (json.loads of the text form, repr of a bad value in the mapping
    form): past Python's recursion limit it is still one ValueError naming the policy."""
    from glm5_vllm.config import specialized_decode_config

    depth = 10 * sys.getrecursionlimit()
    policy = {"moe": _deep(depth, "grouped")}
    if form == "json":
        policy = '{"moe": ' + "[" * depth + "]" * depth + "}"
    config = _good(vllm_config)
    config.additional_config["policy"] = policy
    with pytest.raises(ValueError) as e:
        specialized_decode_config(config, H200)
    (problem,) = str(e.value).splitlines()[1:]  # one problem under the heading
    assert problem.startswith("  - policy")
    assert ("nested too deeply" if form == "json" else "unknown choice") in problem


@pytest.mark.parametrize("backend", [None, "auto"], ids=["absent", "auto"])
def test_a_policy_for_the_stock_decode_warns_once(vllm_config, warnings_once, backend):
    from glm5_vllm.config import specialized_decode_config

    extra = {"policy": {"moe": "grouped"}}
    if backend is not None:
        extra["decode_backend"] = backend
    configs = [vllm_config(additional_config=extra), vllm_config(additional_config=dict(extra))]
    for config in configs * 2:  # every model class built in the process reads it
        assert specialized_decode_config(config, H200) is None
    (message,) = warnings_once()
    assert "additional_config['policy'] is ignored" in message
    assert "latency_specialized" in message
    assert ("not set" if backend is None else "decode_backend is 'auto'") in message
    # Asked for (the policy is read) or no policy given: nothing to warn about.
    specialized_decode_config(_good(vllm_config, policy={"moe": "grouped"}), H200)
    specialized_decode_config(vllm_config(additional_config={"policy": None}), H200)
    assert len(warnings_once()) == 1


@pytest.mark.parametrize(
    ("key", "ours"),
    [("polcy", "policy"), ("Policy", "policy"), ("ploicy", "policy"),
     ("decode_backnd", "decode_backend"), ("decode-backend", "decode_backend"),
     ("decodebackend", "decode_backend")],
)  # fmt: skip
def test_a_misspelled_key_of_ours_warns_once_naming_it(vllm_config, warnings_once, key, ours):
    from glm5_vllm.config import specialized_decode_config

    config = vllm_config(additional_config={key: "latency_specialized", "kda_decode_backend": "x"})
    for _ in range(3):
        assert specialized_decode_config(config, H200) is None  # stock: the key is not read
    (message,) = warnings_once()
    assert f"additional_config[{key!r}]" in message and f"did you mean {ours!r}" in message


def test_other_keys_stay_silent(vllm_config, warnings_once):
    """vLLM 0.33's own keys (some named after ours) and other plugins' keys."""
    from glm5_vllm.config import specialized_decode_config

    vllms = ["kda_decode_backend", "kda_spec_decode_backend", "kda_prefill_backend",
             "gdn_prefill_backend", "kda_prefill_checkpoint"]  # fmt: skip
    others = ["someone", "spec_decode_backend", "device_backend", "moe_backend", "policies",
              "profile", "ascend_scheduler_config"]  # fmt: skip
    extra = dict.fromkeys(vllms + others, "auto")
    specialized_decode_config(vllm_config(additional_config=extra), H200)
    specialized_decode_config(_good(vllm_config, **extra), H200)
    assert warnings_once() == []


@pytest.mark.parametrize("dtype", ["fp8", "fp8_e4m3", "fp8_ds_mla"])
def test_every_spelling_of_the_sparse_mla_fp8_cache_is_supported(vllm_config, dtype):
    """vLLM 0.33 serves "fp8" (and "fp8_e4m3") on FlashMLA-sparse as "fp8_ds_mla", and says
    so in the shared cache_config when it builds an MLA layer: the drafter, built after the
    target, reads the new name. Both spellings are the same deployment."""
    from vllm.config import CacheConfig
    from vllm.model_executor.layers.attention.mla_attention import (
        _canonicalize_sparse_mla_kv_cache_dtype as canonical,
    )
    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend

    from glm5_vllm.config import specialized_decode_config, unsupported

    assert canonical(FlashMLASparseBackend, dtype) == "fp8_ds_mla"
    cache = CacheConfig(cache_dtype=dtype, enable_prefix_caching=False)
    config = _good(vllm_config, cache_config=cache)
    config.additional_config = {"decode_backend": "latency_specialized"}
    for capability in (H200, (10, 0)):
        assert unsupported(config, capability) == []
    first = specialized_decode_config(config, H200)
    config.cache_config.cache_dtype = canonical(FlashMLASparseBackend, dtype)  # as MLA layers do
    assert unsupported(config, H200) == [] and specialized_decode_config(config, H200) == first


# Hardening: every bad deployment one clear error (real vLLM 0.33 configs).


def test_non_string_token_keys_are_refused_before_vllm_hashes_them(vllm_config):
    """A Python-API policy keyed by int would pass our parse and then crash vLLM's
    VllmConfig.compute_hash (json.dumps(sort_keys=True) cannot order 8 beside "1-4")."""
    from glm5_policy import PolicyError
    from glm5_vllm.config import specialized_decode_config

    config = _good(vllm_config, policy={"moe": {8: "per_route", "1-4": "grouped"}})
    with pytest.raises(TypeError, match="'<' not supported"):
        config.compute_hash()  # vLLM's own failure, which ours must come before
    with pytest.raises(PolicyError) as e:
        specialized_decode_config(config, H200)
    assert e.value.problems == [
        "policy['moe'][8]: token key 8 is not a string (keys are JSON text: write '8')"
    ]
    config.additional_config["policy"] = {"moe": {"8": "per_route", "1-4": "grouped"}}
    assert config.compute_hash()
    decode = specialized_decode_config(config, H200)
    assert decode.policy("moe", 8) == "per_route" and decode.policy("moe", 4) == "grouped"


def test_non_string_keys_of_a_policy_the_stock_decode_ignores_are_refused(vllm_config):
    """Ignored by the stock decode, the policy is still hashed by vLLM: its int keys would
    crash compute_hash there too."""
    from glm5_policy import PolicyError
    from glm5_vllm.config import specialized_decode_config

    config = vllm_config(additional_config={"policy": {"moe": {8: "grouped", "1-4": "grouped"}}})
    with pytest.raises(TypeError, match="'<' not supported"):
        config.compute_hash()
    with pytest.raises(PolicyError) as e:
        specialized_decode_config(config, H200)
    assert e.value.problems == [
        "policy['moe'][8]: key 8 is not a string (keys are JSON text: write '8')"
    ]


@pytest.fixture
def llama_dir(tmp_path):
    """A tiny Llama checkpoint config that carries "mhc": true."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
    ).to_dict()  # fmt: skip
    config.update(architectures=["LlamaForCausalLM"], mhc=True)
    (tmp_path / "config.json").write_text(__import__("json").dumps(config))
    return str(tmp_path)


def test_another_model_is_refused_by_its_architecture(llama_dir):
    """Its `mhc` flag and a geometry that reads as GLM's gave no reason at all."""
    from tiny_model import cpu_config
    from vllm.config import ModelConfig

    from glm5_vllm.config import specialized_decode_config, unsupported

    model = ModelConfig(model=llama_dir, skip_tokenizer_init=True, dtype="bfloat16")
    extra = {"decode_backend": "latency_specialized"}
    config = _full_graphs(cpu_config(model, additional_config=extra))
    assert config.model_config.architectures == ["LlamaForCausalLM"]
    assert unsupported(config, H200) == [
        "model architecture LlamaForCausalLM (model_type 'llama'): expects GLM-5.3-Flash "
        "(Glm5NextForCausalLM, Glm5NextForConditionalGeneration, Glm5NextMTPModel)"
    ]
    with pytest.raises(ValueError, match="model architecture LlamaForCausalLM"):
        specialized_decode_config(config, H200)


def test_the_mtp_drafters_architecture_is_glm(tmp_path):
    """vLLM renames the drafter's architecture (Glm5NextMTPModel, model_type glm5_next_mtp)."""
    from tiny_model import tiny_config

    from glm5_vllm.config import unsupported

    draft = tiny_config(tmp_path, draft=True)
    drafter = draft.speculative_config.draft_model_config
    assert drafter.architectures == ["Glm5NextMTPModel"]
    assert not any("architecture" in r for r in unsupported(draft, H200))


@pytest.mark.parametrize(
    "text, problem",
    [
        ("not json", "additional_config 'not json': not valid JSON (Expecting value)"),
        ("[1, 2]", "additional_config '[1, 2]': expects a JSON object, got list"),
        ('"latency_specialized"', "expects a JSON object, got str"),
    ],
    ids=["not-json", "list", "string"],
)
def test_additional_config_text_that_is_not_an_object_is_one_error(vllm_config, text, problem):
    """vLLM's CLI passes --additional-config text that does not parse as a JSON object
    through as a str. VllmConfig's validation refuses a str when it is built, but not when
    it is assigned later (a caller's or another plugin's hook): ours read it as {} and the
    stock decode ran without a word."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from glm5_policy import PolicyError
    from glm5_vllm.config import specialized_decode_config

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    passed = parser.parse_args(["--additional-config", text]).additional_config
    assert passed == text  # vLLM's own parse: the text itself
    with pytest.raises(ValueError, match="additional_config"):  # pydantic's, when built
        vllm_config(additional_config=passed)
    config = _good(vllm_config)
    config.additional_config = passed
    with pytest.raises(PolicyError) as e:
        specialized_decode_config(config, H200)
    (found,) = e.value.problems
    assert problem in found, found


def test_additional_config_as_json_text_is_read_as_its_object(vllm_config):
    from glm5_vllm.config import specialized_decode_config

    extra = {"decode_backend": "latency_specialized", "policy": {"moe": {"1-8": "grouped"}}}
    as_text = _good(vllm_config)
    as_text.additional_config = __import__("json").dumps(extra)
    as_dict = _good(vllm_config, policy=extra["policy"])
    decode = specialized_decode_config(as_text, H200)
    assert decode is not None and decode == specialized_decode_config(as_dict, H200)
    assert decode.policy("moe", 8) == "grouped"


@pytest.mark.parametrize(
    "text, repeated",
    [
        ('{"decode_backend": "latency_specialized", "decode_backend": "auto"}', "'decode_backend'"),
        ('{"decode_backend": "latency_specialized", "policy": {"moe": {"1-8": "grouped"}, '
         '"moe": null}}', "'moe'"),
    ],
    ids=["top-level", "in-the-policy"],
)  # fmt: skip
def test_a_key_repeated_in_additional_config_text_is_refused(vllm_config, text, repeated):
    """json.loads keeps a repeated key's last value: the text's own repeats are named, at the
    top level and inside the policy."""
    from glm5_policy import PolicyError
    from glm5_vllm.config import specialized_decode_config

    config = _good(vllm_config)
    config.additional_config = text
    with pytest.raises(PolicyError) as e:
        specialized_decode_config(config, H200)
    (problem,) = e.value.problems
    assert repeated in problem and "more than once" in problem, problem


@pytest.mark.parametrize("key", ["１-８", "1-٨"], ids=["fullwidth", "arabic-indic"])
def test_token_ranges_in_unicode_digits_are_refused(vllm_config, key):
    from glm5_policy import PolicyError
    from glm5_vllm.config import specialized_decode_config

    with pytest.raises(PolicyError) as e:
        specialized_decode_config(_good(vllm_config, policy={"moe": {key: "grouped"}}), H200)
    (problem,) = e.value.problems
    assert problem.startswith(f"policy['moe'][{key!r}]") and "ASCII digits" in problem


def test_a_key_repeated_in_the_policy_text_is_refused(vllm_config):
    from glm5_policy import PolicyError
    from glm5_vllm.config import specialized_decode_config

    text = '{"moe": {"1-8": "grouped"}, "moe": null}'
    with pytest.raises(PolicyError) as e:
        specialized_decode_config(_good(vllm_config, policy=text), H200)
    assert e.value.problems == ["policy: key 'moe' given more than once (JSON keeps only the last)"]


def test_the_graphs_reason_names_the_mode_found(vllm_config):
    """enforce-eager was named whatever turned FULL graphs off."""
    from vllm.config import CUDAGraphMode

    from glm5_vllm.config import unsupported

    def graphs_reason(config):
        (reason,) = [r for r in unsupported(config, H200) if "CUDA graphs" in r]
        assert reason.endswith(
            ": the specialized decode runs in FULL decode CUDA graphs "
            "(FULL, FULL_DECODE_ONLY, FULL_AND_PIECEWISE)"
        )
        return reason.split(":")[0]

    eager = vllm_config(model_kw={"enforce_eager": True})
    assert eager.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
    assert graphs_reason(eager) == "cudagraph_mode NONE (enforce-eager)"
    # vLLM's CPU platform turns graphs off for every model, enforce-eager or not.
    platform = vllm_config()
    assert not platform.model_config.enforce_eager
    assert graphs_reason(platform) == "cudagraph_mode NONE (enforce-eager not set)"
    piecewise = _good(vllm_config)
    piecewise.compilation_config.cudagraph_mode = CUDAGraphMode.PIECEWISE
    assert graphs_reason(piecewise) == "cudagraph_mode PIECEWISE (enforce-eager not set)"
    for mode in (CUDAGraphMode.FULL, CUDAGraphMode.FULL_DECODE_ONLY):
        piecewise.compilation_config.cudagraph_mode = mode
        assert unsupported(piecewise, H200) == []


def test_deployment_backend_and_policy_problems_come_in_one_error(vllm_config):
    from glm5_runtime.checks import DeploymentError
    from glm5_vllm.config import specialized_decode_config

    config = _good(vllm_config, decode_backend="fastest", policy={"moe": {4: "mega"}})
    config.parallel_config.pipeline_parallel_size = 2
    with pytest.raises(DeploymentError) as e:
        specialized_decode_config(config, H200)
    assert e.value.reasons == [
        "pipeline parallelism",
        "additional_config['decode_backend']='fastest': expects one of "
        "('auto', 'latency_specialized')",
        "policy['moe'][4]: token key 4 is not a string (keys are JSON text: write '4')",
        "policy['moe'][4]: unknown choice 'mega' (expects one of fused_router, grouped, "
        "per_route or null)",
    ]
