"""The automatic micro-batch budget (``actor.micro_batches.micro_batch_budget``, docs/design.md "Micro-batch budget"): unset, the largest
budget (in steps of 64 tokens) whose predicted peak fits this rank's share of the RAM, capped at
``parallel.max_auto_micro_batch_tokens``; a budget set by hand that is predicted not to fit is refused, term by term.
The memory model itself is checked against measurements elsewhere; here it is the oracle the choice must respect."""

from types import SimpleNamespace

import psutil
import pytest

from megatron_dapo.actor.micro_batches import micro_batch_budget
from megatron_dapo.config.run_config import load_config
from megatron_dapo.config.typed_yaml import ConfigError
from megatron_dapo.models.arch import load_arch
from megatron_dapo.models.memory import GiB, actor_memory

KW = dict(dtype_bytes=4, tp=1, pp=1, dp=1, layout="padded", recompute="none", distributed_optimizer=False,
          logprob_chunk_tokens=None, engine_bytes_per_param=4)  # fmt: skip


@pytest.fixture
def ram(monkeypatch):
    """Pretend the machine has ``gib`` GiB available, shared by ``ranks`` local ranks."""

    def set_ram(gib, ranks=1):
        monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=gib * GiB))
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))

    return set_ram


def _cfg(*overrides):
    return load_config("demo_cpu", ["model.arch=smollm2-135m", "data.max_prompt_len=256", *overrides])


def _peak(cfg, tokens):
    kw = dict(KW, logprob_chunk_tokens=cfg.parallel.logprob_chunk_tokens)
    # shared prompts (the default): the longest row holds a prompt and its group's responses
    row = cfg.data.max_prompt_len + cfg.algo.group_size * cfg.rollout.sampling.max_new_tokens
    return actor_memory(load_arch(cfg.model.arch), tokens, row, **kw).total


@pytest.mark.parametrize("gib,ranks", [(8.0, 1), (16.0, 1), (16.0, 2)])
def test_chosen_budget_is_the_largest_that_fits(ram, gib, ranks):
    cfg = _cfg("parallel.max_auto_micro_batch_tokens=1000000")
    ram(gib, ranks)
    tokens, note = micro_batch_budget(cfg, load_arch(cfg.model.arch), "padded", 1)
    share = 0.85 * gib * GiB / ranks
    assert tokens % 64 == 0 and tokens >= cfg.max_seq_len
    assert _peak(cfg, tokens) <= share < _peak(cfg, tokens + 64), (tokens, share / GiB)
    assert f"micro-batch budget {tokens} tokens (chosen; predicted peak" in note
    assert f"of {share / GiB:.1f} GiB of the available RAM for this rank" in note


def test_rank_share_and_cap(ram):
    cfg = _cfg("parallel.max_auto_micro_batch_tokens=1000000")
    ram(16.0, 1)
    one, _ = micro_batch_budget(cfg, load_arch(cfg.model.arch), "padded", 1)
    ram(16.0, 2)
    two, _ = micro_batch_budget(cfg, load_arch(cfg.model.arch), "padded", 1)
    assert two < one  # two local ranks share the RAM
    ram(10_000.0)
    capped = _cfg("parallel.max_auto_micro_batch_tokens=5000")
    assert micro_batch_budget(capped, load_arch(capped.model.arch), "padded", 1)[0] == 4992  # 5000 to 64s


def test_a_budget_that_does_not_fit_is_refused_with_the_prediction(ram):
    ram(8.0)
    cfg = _cfg("parallel.max_tokens_per_micro_batch=200000")
    with pytest.raises(ConfigError) as err:
        micro_batch_budget(cfg, load_arch(cfg.model.arch), "padded", 1)
    msg = str(err.value)
    assert msg.startswith("parallel.max_tokens_per_micro_batch = 200000: predicted peak")
    assert f"> {0.85 * 8:.1f} GiB of the available RAM for this rank; at most" in msg
    for term in ("weights", "grads", "optimizer", "activations", "logits", "engine"):
        assert term in msg, term
    fits = int(msg.split("at most ")[1].split()[0])
    assert _peak(cfg, fits) <= 0.85 * 8 * GiB  # the number it offers fits
    ok = _cfg(f"parallel.max_tokens_per_micro_batch={fits // 64 * 64}")
    assert "(set; predicted peak" in micro_batch_budget(ok, load_arch(ok.model.arch), "padded", 1)[1]


def test_not_even_one_sequence_fits(ram):
    ram(1.0)
    cfg = _cfg()
    with pytest.raises(ConfigError, match=r"not even one sequence of 268 tokens fits: predicted peak .* GiB of the"):
        micro_batch_budget(cfg, load_arch(cfg.model.arch), "padded", 1)
