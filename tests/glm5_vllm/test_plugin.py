"""The plugin as vLLM loads it: the entry point is discovered, register() points the three
GLM-5.3-Flash architectures at glm5-vllm's subclasses of vLLM's classes (re-entrantly), and
with VLLM_PLUGINS='' nothing changes."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.vllm

ARCHS = ("Glm5NextForCausalLM", "Glm5NextForConditionalGeneration", "Glm5NextMTPModel")

PROBE = """
import os
os.environ.setdefault("HF_HUB_OFFLINE", "1")
from vllm.plugins import load_general_plugins
from vllm.model_executor.models.registry import ModelRegistry
load_general_plugins()
for arch in {archs}:
    print(arch, ModelRegistry.models[arch].module_name)
"""


def _registered(env_plugins):
    env = dict(os.environ)
    env.pop("VLLM_PLUGINS", None)
    if env_plugins is not None:
        env["VLLM_PLUGINS"] = env_plugins
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(archs=ARCHS)], env=env, capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return dict(line.split() for line in out.stdout.splitlines() if line.startswith("Glm5"))


def test_entry_point_is_discovered():
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group

    plugins = load_plugins_by_group(DEFAULT_PLUGINS_GROUP)
    assert "glm5" in plugins
    import glm5_vllm

    assert plugins["glm5"] is glm5_vllm.register


def test_vllm_loads_the_plugin_and_only_when_allowed():
    assert _registered(None) == {arch: "glm5_vllm.models" for arch in ARCHS}
    assert _registered("glm5") == {arch: "glm5_vllm.models" for arch in ARCHS}
    stock = _registered("")
    assert all(not module.startswith("glm5_vllm") for module in stock.values()), stock


def test_register_is_reentrant_and_resolves_subclasses_of_vllms_classes():
    import vllm.models.glm5next as stock
    from vllm.model_executor.models.registry import ModelRegistry

    import glm5_vllm
    from glm5_vllm import models

    glm5_vllm.register()
    glm5_vllm.register()
    for arch, ours in glm5_vllm.OVERRIDES.items():
        lazy = ModelRegistry.models[arch]
        assert (lazy.module_name, lazy.class_name) == ("glm5_vllm.models", ours)
        cls = ModelRegistry._try_load_model_cls(arch)
        assert cls is getattr(models, ours)
    assert issubclass(models.Glm5NextForCausalLM, stock.Glm5NextForCausalLM)
    assert issubclass(models.Glm5NextMTP, stock.Glm5NextMTP)
    assert issubclass(
        models.Glm5NextForConditionalGeneration, stock.Glm5NextForConditionalGeneration
    )
