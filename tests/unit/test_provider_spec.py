"""Which layer spec the actor uses: TE when usable, the local spec on CPU, loud errors on a GPU whose TE is missing
or broken (transformer-engine cannot be installed here, so CUDA and the TE import are simulated)."""

import builtins
import importlib.util

import pytest
import torch

from megatron_dapo.actor import provider
from megatron_dapo.config.run_config import ModelConfig
from megatron_dapo.config.typed_yaml import ConfigError


@pytest.fixture
def machine(monkeypatch):
    """Set what the machine has: machine(cuda=..., te=None | "ok" | an exception to raise on import)."""

    def setup(cuda: bool, te):
        provider.transformer_engine_status.cache_clear()
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        real_find, real_import = importlib.util.find_spec, builtins.__import__
        monkeypatch.setattr(
            importlib.util,
            "find_spec",
            lambda n, *a: (object() if te else None) if n == "transformer_engine" else real_find(n, *a),
        )

        def fake_import(name, *args, **kw):
            if name.startswith("transformer_engine"):
                if isinstance(te, Exception):
                    raise te
                return object()
            return real_import(name, *args, **kw)

        monkeypatch.setattr(builtins, "__import__", fake_import)

    yield setup
    provider.transformer_engine_status.cache_clear()


def test_cpu_uses_the_local_spec_and_says_so(machine):
    machine(cuda=False, te=None)
    assert not provider.use_transformer_engine(ModelConfig())
    assert "local layer spec (no CUDA device), padded [B, L]" in provider.describe_spec(ModelConfig())
    with pytest.raises(ConfigError, match="transformer_impl = 'transformer_engine'.*no CUDA device"):
        provider.use_transformer_engine(ModelConfig(transformer_impl="transformer_engine"))


def test_gpu_with_te_uses_it(machine):
    machine(cuda=True, te="ok")
    assert provider.use_transformer_engine(ModelConfig())
    assert "Transformer Engine layer spec, packed THD micro-batches, FP8 e4m3" in provider.describe_spec(
        ModelConfig(fp8="e4m3")
    )


def test_gpu_without_te_warns_loudly_and_explicit_te_names_the_package(machine):
    machine(cuda=True, te=None)
    assert not provider.use_transformer_engine(ModelConfig())
    assert "WARNING: dense attention on a GPU" in provider.describe_spec(ModelConfig())
    with pytest.raises(ConfigError, match="transformer_engine is not installed.*transformer-engine\\[pytorch\\]"):
        provider.use_transformer_engine(ModelConfig(transformer_impl="transformer_engine"))


def test_gpu_with_a_broken_te_is_an_error_not_a_silent_fallback(machine):
    machine(cuda=True, te=RuntimeError("libtransformer_engine.so: undefined symbol"))
    with pytest.raises(ConfigError, match="installed but broken.*RuntimeError: libtransformer_engine.so"):
        provider.use_transformer_engine(ModelConfig())
    assert not provider.use_transformer_engine(ModelConfig(transformer_impl="local"))  # on purpose: allowed
