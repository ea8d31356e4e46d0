"""Typed config: YAML recipes, dotted overrides, validation errors that name the key and the file."""

import copy
from pathlib import Path

import pytest

from megatron_dapo.config.run_config import RECIPES_DIR, load_config, save_config
from megatron_dapo.config.typed_yaml import ConfigError
from megatron_dapo.models.arch import load_arch


def _recipe(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("name", sorted(p.stem for p in RECIPES_DIR.glob("*.yaml")))
def test_every_recipe_loads(name):
    cfg = load_config(name)
    assert cfg.train.batch_prompts % cfg.train.mini_batch_prompts == 0


def test_dapo_32b_carries_the_paper_numbers():
    c = load_config("dapo_32b")
    assert (c.train.batch_prompts, c.algo.group_size, c.train.mini_batch_prompts, c.num_updates) == (512, 16, 32, 16)
    assert (c.algo.eps_low, c.algo.eps_high, c.algo.clip_c) == (0.2, 0.28, 10.0)
    assert (c.train.lr, c.train.weight_decay, c.train.grad_clip, c.train.warmup_steps) == (1e-6, 0.1, 1.0, 20)
    assert (c.data.max_prompt_len, c.rollout.sampling.max_new_tokens, c.algo.overlong_cache) == (2048, 20480, 4096)
    assert c.algo.gen_batch_prompts == 3 * c.train.batch_prompts and c.algo.loss_agg == "token-mean"
    assert (c.eval.n, c.eval.temperature, c.eval.top_p) == (32, 1.0, 0.7)
    assert c.rollout.sampling.temperature == 1.0 and c.rollout.sampling.top_p == 1.0


def test_dotted_overrides_are_typed():
    c = load_config(
        "demo_cpu",
        ["algo.eps_high=0.3", "train.lr=1e-3", "data.synthetic=none", "data.train_files=[a.parquet, b.parquet]",
         "algo.clip_c=null"],
    )  # fmt: skip
    assert c.algo.eps_high == 0.3 and c.train.lr == 1e-3 and c.algo.clip_c is None
    assert c.data.train_files == ["a.parquet", "b.parquet"]


@pytest.mark.parametrize(
    "override,needle",
    [
        ("algo.eps_hihg=0.3", "algo.eps_hihg: unknown key"),
        ("train.steps=ten", "train.steps = 'ten': expected an integer"),
        ("algo.eps_low=1.0", "algo.eps_low = 1.0: must be in (0, 1)"),
        ("algo.group_size=1", "algo.group_size = 1: dynamic sampling needs at least 2"),
        ("rollout.sampling.max_new_tokens=100", "rollout.sampling.max_new_tokens = 100"),
        ("train.mini_batch_prompts=5", "train.mini_batch_prompts = 5: must divide"),
        ("rollout.engine=trtllm", "rollout.engine = 'trtllm': must be one of"),
        ("rollout.hf.max_batch=0", "rollout.hf.max_batch = 0: must be >= 1"),
        ("rollout.max_restarts_per_step=-1", "rollout.max_restarts_per_step = -1: must be >= 0"),
        ("model.arch=no-such-model", "unknown model config 'no-such-model'"),
        ("algo", "expected key=value"),
    ],
)
def test_errors_name_the_key(override, needle):
    overrides = [override]
    if "max_new_tokens" in override:
        overrides.append("algo.overlong_penalty=true")  # max response must exceed the overlong cache (4096)
    with pytest.raises(ConfigError) as e:
        load_config("dapo_32b" if "max_new_tokens" in override else "demo_cpu", overrides)
    assert needle in str(e.value)


def test_file_errors_name_the_file(tmp_path):
    path = _recipe(tmp_path, "algo:\n  eps_low: 1.5\n")
    with pytest.raises(ConfigError, match=rf"{path}: algo.eps_low = 1.5: must be in \(0, 1\)"):
        load_config(path)
    path = _recipe(tmp_path, "train:\n  batch_prompt: 4\n")
    with pytest.raises(ConfigError, match=rf"{path}: train.batch_prompt: unknown key \(did you mean batch_prompts"):
        load_config(path)
    with pytest.raises(ConfigError, match="unknown recipe 'nope'"):
        load_config("nope")


def test_architectures_load_and_validate(tmp_path):
    a = load_arch("qwen2.5-32b")
    assert (a.num_layers, a.hidden_size, a.num_query_groups, a.vocab_size, a.tie_embeddings) == (
        64,
        5120,
        8,
        152064,
        False,
    )
    bad = tmp_path / "bad.yaml"
    bad.write_text("num_attention_heads: 4\nnum_query_groups: 3\n")
    with pytest.raises(ConfigError, match=f"{bad}: num_query_groups = 3: must divide num_attention_heads"):
        load_arch(bad)


@pytest.mark.parametrize(
    "overrides, culprit, because",
    [
        (["data.train_files=[/data/train.parquet]"], "data.train_files", "data.synthetic = 'add2'"),
        (["train.supervised_warmup_steps=0", "train.supervised_lr=0.01"], "train.supervised_lr", "supervised_warmup"),
        (["rollout.sglang.tp=2"], "rollout.sglang.tp", "rollout.engine = 'hf'"),
        (["algo.dynamic_sampling=false", "algo.gen_batch_prompts=64", "algo.max_gen_batches=3"], "algo.max_gen_batches",
         "algo.dynamic_sampling = false"),
        (["eval.greedy=true", "eval.n=8"], "eval.n", "eval.greedy = true"),
        (["algo.overlong_cache=4"], "algo.overlong_cache", "algo.overlong_penalty = false"),
    ],
)  # fmt: skip
def test_an_override_the_run_would_ignore_is_an_error(overrides, culprit, because):
    """demo_cpu makes its prompts (data.synthetic: add2): a train_files override used to be silently ignored."""
    with pytest.raises(ConfigError, match=rf"command line: {culprit} = .* would be ignored: .*{because}"):
        load_config("demo_cpu", overrides)


def test_overrides_the_run_uses_and_recipe_keys_are_accepted():
    # the same keys are fine once the setting that uses them is on (and the demo recipe itself sets
    # supervised_* and hf.max_batch, which it uses)
    cfg = load_config("demo_cpu", ["data.synthetic=none", "data.train_files=[/data/train.parquet]", "eval.n=8"])
    assert cfg.data.train_files == ["/data/train.parquet"] and cfg.eval.n == 8
    # a recipe may keep settings for another engine; switching the engine on the command line is not an error
    cfg = load_config("dapo_7b", ["rollout.engine=hf", "rollout.weight_sync=copy"])
    assert cfg.rollout.sglang.tp >= 1


def test_parallel_sizes_that_do_not_divide_name_the_key():
    from megatron_dapo.config.run_config import ParallelConfig
    from megatron_dapo.config.validate import check_world_divides
    from megatron_dapo.models.arch import check_divisible

    tiny = load_arch("tiny")  # 2 layers, 2 KV groups, FFN 512
    check_divisible(tiny, 2, 2, prefix="parallel.")
    with pytest.raises(ConfigError, match=r"parallel\.tp = 4: must divide the KV groups of tiny \(2\)"):
        check_divisible(tiny, 4, 1, prefix="parallel.")
    with pytest.raises(ConfigError, match=r"parallel\.pp = 3: must divide the layers of tiny \(2\)"):
        check_divisible(tiny, 1, 3, prefix="parallel.")
    check_world_divides(ParallelConfig(tp=2, pp=2), 8)
    with pytest.raises(ConfigError, match=r"parallel\.tp x pp x cp = 2x2x1 = 4 does not divide the 6 ranks"):
        check_world_divides(ParallelConfig(tp=2, pp=2), 6)


SGLANG = ["rollout.engine=sglang", "rollout.weight_sync=tensor", "rollout.sglang.device=cpu",
          "rollout.sglang.deterministic=false"]  # fmt: skip


@pytest.mark.parametrize(
    "overrides, culprit",
    [
        (["rollout.sglang.env=[NOVALUE]"], r"rollout\.sglang\.env = 'NOVALUE': entries are KEY=VALUE"),
        (["rollout.weight_sync=copy"], r"rollout\.weight_sync = 'copy': rollout.engine = 'sglang' takes tensor"),
        (["rollout.sglang.deterministic=true"], r"rollout\.sglang\.deterministic = True: SGLang's deterministic"),
        (["rollout.sglang.pythonpath=[/no/such/dir]"], r"rollout\.sglang\.pythonpath = '/no/such/dir': not a dir"),
        (["rollout.sglang.tp=0"], r"rollout\.sglang\.tp = 0: must be >= 1"),
    ],
)  # fmt: skip
def test_sglang_settings_are_checked(overrides, culprit):
    """SGLang's own rules (engines/sglang/options.py), run by the config's validation through the registry."""
    load_config("demo_cpu", SGLANG)
    with pytest.raises(ConfigError, match=culprit):
        load_config("demo_cpu", SGLANG + overrides)


def test_an_engines_settings_on_another_engine_and_the_old_keys_are_named():
    with pytest.raises(ConfigError, match=r"rollout\.sglang\.tp = 2 would be ignored: rollout.engine = 'hf'"):
        load_config("demo_cpu", ["rollout.sglang.tp=2"])
    with pytest.raises(ConfigError, match=r"rollout\.hf\.max_batch = 8 would be ignored: rollout.engine = 'sglang'"):
        load_config("demo_cpu", [*SGLANG, "rollout.hf.max_batch=8"])
    for old, new in (("rollout.sglang_tp=2", "rollout.sglang.tp"), ("rollout.hf_max_batch=8", "rollout.hf.max_batch")):
        with pytest.raises(ConfigError, match=f"command line: {old.split('=')[0]}: this key is now {new}"):
            load_config("demo_cpu", [old])


def test_a_recipe_with_an_old_key_is_told_where_it_went(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("base: demo_cpu_sglang\nrollout: {sglang_device: cpu}\n")
    with pytest.raises(ConfigError, match=r"old.yaml: rollout.sglang_device: this key is now rollout.sglang.device"):
        load_config(path)


def test_a_recipe_can_start_from_another(tmp_path):
    path = _recipe(tmp_path, "base: demo_cpu\nrollout: {engine: hf, hf: {max_batch: 7}}\ntrain: {name: child}\n")
    c, base = load_config(path), load_config("demo_cpu")
    assert c.rollout.hf.max_batch == 7 and c.train.name == "child"
    assert c.rollout.sampling == base.rollout.sampling and c.train.steps == base.train.steps  # merged per key
    s = load_config("demo_cpu_sglang")
    assert (s.rollout.engine, s.rollout.sglang.device, s.rollout.dtype) == ("sglang", "cpu", "bf16")
    assert s.algo == base.algo and s.train.steps == base.train.steps and s.model == base.model
    loop = tmp_path / "loop.yaml"
    loop.write_text(f"base: {loop}\n")
    with pytest.raises(ConfigError, match="include each other"):
        load_config(loop)


# issue 22 #2: colocated servers and the trainer share the GPUs; one NCCL group cannot hold two ranks on one device
def test_colocated_distributed_sync_is_refused_naming_the_keys_and_the_alternative():
    gpu = ["model.hf_init=/m", "rollout.colocate=true", "rollout.weight_sync=distributed"]
    with pytest.raises(ConfigError) as e:
        load_config("dapo_7b", gpu)
    msg = str(e.value)
    assert "rollout.weight_sync = 'distributed'" in msg and "rollout.colocate = true" in msg
    assert "NCCL refuses two ranks" in msg and "rollout.weight_sync=tensor (CUDA IPC" in msg
    assert "cluster.placement=disaggregated" in msg
    # what stays accepted: tensor/disk colocated, distributed when disaggregated, distributed between CPU processes
    load_config("dapo_7b", ["model.hf_init=/m", "rollout.weight_sync=tensor"])
    load_config("dapo_7b", ["model.hf_init=/m", "rollout.weight_sync=disk"])
    load_config("dapo_7b", ["rollout.colocate=false", "rollout.weight_sync=distributed", "cluster.nodes=2",
                            "cluster.placement=disaggregated", "cluster.rollout_nodes=1"])  # fmt: skip
    load_config("demo_cpu_sglang", ["rollout.colocate=true", "rollout.weight_sync=distributed"])


# issue 22 #3: SGLang asserts dp_size == 1 in every weight update; the check every path runs (before any server)
@pytest.mark.parametrize("args", [["--dp-size", 2], ["--dp-size", "2"], ["--dp=4"], ["--data-parallel-size", "2"],
                                  ["--dp-s", "2"], ["--max-total-tokens", 8192, "--dp", 2]])  # fmt: skip
def test_data_parallel_sglang_args_are_refused(args):
    with pytest.raises(ConfigError, match=r"rollout\.sglang.args = .*: --d.* every weight update of SGLang asserts "
                       r"dp_size == 1 \(tokenizer_control_mixin\.py\)"):  # fmt: skip
        load_config("demo_cpu_sglang", [f"rollout.sglang.args={args}".replace("'", "")])


def test_sglang_args_take_bare_numbers_as_written():
    # [--dp-size, 2] used to be refused as "rollout.sglang.args[1] = 2: expected a string"
    cfg = load_config("demo_cpu_sglang", ["rollout.sglang.args=[--max-total-tokens, 8192, --dp-size, 1, --x, 0.5]"])
    assert cfg.rollout.sglang.args == ["--max-total-tokens", "8192", "--dp-size", "1", "--x", "0.5"]
    for ok in (["--attn-dp-size", "2"], ["--dp-size", "1"], ["--dtype", "bfloat16"]):
        load_config("demo_cpu_sglang", [f"rollout.sglang.args=[{', '.join(ok)}]"])
    with pytest.raises(ConfigError, match=r"rollout\.sglang.args\[0\] = True: expected a string"):
        load_config("demo_cpu_sglang", ["rollout.sglang.args=[true]"])


def test_the_control_plane_outwaits_the_server_start():
    with pytest.raises(ConfigError, match=r"rollout\.control_timeout_s = 60\.0: .* rollout\.server_timeout_s"):
        load_config("demo_cpu", ["rollout.control_timeout_s=60", "rollout.server_timeout_s=600"])


def test_on_and_off_choices_take_yamls_bare_on_and_off(tmp_path):
    # YAML 1.1 reads a bare `on` / `off` as a bool: `algo.tis=on` was refused as "algo.tis = True: must be one of ..."
    assert load_config("demo_cpu", ["algo.tis=on"]).algo.tis == "on"
    assert load_config("demo_cpu", ["algo.tis=off"]).algo.tis == "off"
    # a choice kept as the command line's bare word could not be saved: `dapo train algo.tis=off` died in save_config
    cfg = load_config("demo_cpu", ["algo.tis=off"])
    assert type(cfg.algo.tis) is str and copy.deepcopy(cfg).algo.tis == "off"
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(str(tmp_path / "config.yaml")).algo.tis == "off"
    with pytest.raises(ConfigError, match=r"algo\.tis = 'yes': must be one of 'auto', 'on', 'off'"):
        load_config("demo_cpu", ["algo.tis='yes'"])


def test_a_bare_boolean_word_is_text_for_a_string_and_a_flag_for_a_bool():
    # `train.name=off` was refused as "train.name = False: expected a string" (YAML 1.1 reads off/yes/no as bools)
    cfg = load_config("demo_cpu", ["train.name=off", "train.export_hf=off"])
    assert cfg.train.name == "off" and type(cfg.train.name) is str and cfg.train.export_hf is False
    assert load_config("demo_cpu", ["train.name=Yes"]).train.name == "Yes"
    assert load_config("demo_cpu", ["train.export_hf=yes"]).train.export_hf is True
    with pytest.raises(ConfigError, match=r"train\.steps = False: expected an integer"):
        load_config("demo_cpu", ["train.steps=off"])
