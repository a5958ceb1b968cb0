"""Real vLLM 0.33 configuration objects for tiny GLM-5.3-Flash configs (they construct on CPU
with DeviceConfig(device="cpu"), reading a local config.json offline)."""

import json
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session", autouse=True)
def vllm_cpu_platform():
    """vLLM's CPU platform (tiny_model's, which also builds sparse-MLA layers) as the current
    platform before any test imports vllm.config: it binds `current_platform` when it loads,
    and the platform's hooks (CpuPlatform.check_and_update_config) shape every config the
    tests build. Set first, they are the CPU platform's whatever test runs first."""
    import vllm.platforms
    from tiny_model import cpu_platform

    previous = vllm.platforms._current_platform
    cpu_platform()
    yield
    vllm.platforms._current_platform = previous


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as m:
        yield m


@pytest.fixture(scope="module")
def cpu_linears(monkeypatch_module):
    """vLLM's CPU linears use its CPU build's kernels (AMX / oneDNN, absent from the CUDA
    wheel); these switches send them down vLLM's own torch fallback (F.linear), for the
    module's tests that build a model."""
    import vllm.model_executor.layers.utils as layer_utils

    monkeypatch_module.setattr(layer_utils, "check_cpu_sgl_kernel", lambda *a: False)
    monkeypatch_module.setattr(layer_utils.ops, "_supports_onednn", False, raising=False)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A folder holding the tiny geometry's config.json, as a checkpoint's (with "mhc")."""
    from glm5_runtime.reference import geometry

    config = geometry("tiny").to_hf().to_dict()
    config["architectures"] = ["Glm5NextForCausalLM"]
    config["mhc"] = True  # real checkpoints set it; transformers' config does not declare it
    folder = tmp_path_factory.mktemp("glm5-tiny")
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.fixture
def vllm_config(model_dir):
    """VllmConfig(**sections) for the tiny model on CPU (tiny_model.cpu_config: prefix
    caching off, whatever the CPU); sections override the defaults."""
    from tiny_model import cpu_config
    from vllm.config import ModelConfig

    def build(model_kw=None, **sections):
        model = ModelConfig(
            model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", **(model_kw or {})
        )
        return cpu_config(model, **sections)

    return build
