"""What docs/guides/recipes-and-config.md says a recipe is: the recipes load with those values, and differ from each other only there."""

from megatron_dapo.config.run_config import config_to_dict, load_config


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def test_grpo_cpu_is_demo_cpu_as_naive_grpo():
    """docs/guides/recipes-and-config.md: ``grpo_cpu`` (same budget, naive GRPO: symmetric clip, sequence-level loss, no dynamic sampling)."""
    demo, grpo = (_flat(config_to_dict(load_config(name))) for name in ("demo_cpu", "grpo_cpu"))
    differ = {k: (demo[k], grpo[k]) for k in demo if demo[k] != grpo[k]}
    assert differ == {
        # naive GRPO
        "algo.eps_high": (0.28, 0.2),  # symmetric clip: eps_high = eps_low
        "algo.loss_agg": ("token-mean", "seq-mean-token-mean"),  # sequence-level loss
        "algo.dynamic_sampling": (True, False),
        "algo.clip_c": (10.0, None),  # no dual clip
        # how it is computed, not what: no refill rounds without dynamic sampling, so fewer prompts per generation
        "algo.gen_batch_prompts": (96, 64),
        "parallel.max_tokens_per_micro_batch": (None, 512),
        "rollout.hf.max_batch": (512, 128),
        "train.name": ("demo_cpu", "grpo_cpu"),
    }
    assert grpo["algo.eps_low"] == grpo["algo.eps_high"] == 0.2
    # the same budget: steps, prompts and samples per step, updates, optimizer, data, eval
    for key in ("train.steps", "train.batch_prompts", "algo.group_size", "train.mini_batch_prompts", "train.lr",
                "rollout.sampling.max_new_tokens", "data.synthetic_train_size", "eval.n"):  # fmt: skip
        assert grpo[key] == demo[key], key
    assert grpo["algo.gen_batch_prompts"] >= grpo["train.batch_prompts"]  # one generation batch fills a step
