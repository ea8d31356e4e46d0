"""Typed run configuration: dataclasses, loaded from YAML with dotted CLI overrides, validated up front.

    cfg = load_config("demo_cpu", overrides=["algo.eps_high=0.3", "train.steps=5"])

A recipe is a YAML file (or the name of one in ``megatron_dapo/recipes/``) whose top-level sections match
``DapoConfig``'s fields; ``base: NAME`` starts from another recipe and overrides its keys section by section. Every error names the key and where it came from (file or command line), e.g.
``ConfigError: recipes/demo_cpu.yaml: algo.eps_low = 1.5: must be in (0, 1)``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from megatron_dapo.config.typed_yaml import (
    ConfigError,
    from_dict,
    parse_override,
    read_yaml,
    resolve_named_yaml,
    set_dotted,
)

PACKAGE_DIR = Path(__file__).resolve().parent.parent
RECIPES_DIR = PACKAGE_DIR / "recipes"
# The architectures: model_configs/ at the repository's top level, where users edit them (a checkout, an editable
# install); a wheel carries the same files as megatron_dapo/model_configs (pyproject.toml maps the folder in).
MODEL_CONFIGS_DIR = next(
    (d for d in (PACKAGE_DIR / "model_configs", PACKAGE_DIR.parent / "model_configs") if d.is_dir()),
    PACKAGE_DIR.parent / "model_configs",
)


def resolve_arch_path(name_or_path: str | Path) -> Path:
    return resolve_named_yaml(name_or_path, MODEL_CONFIGS_DIR, "model config", "known")


# ----------------------------------------------------------------------------------------------------------------------
# Run configuration sections


@dataclass
class ModelConfig:
    arch: str = "tiny"  # name in megatron_dapo/model_configs/ or a path to an architecture YAML
    hf_init: str | None = None  # start from this HF checkpoint directory (safetensors)
    load: str | None = None  # start from this megatron checkpoint directory
    tokenizer: str | None = None  # HF tokenizer dir; None = the char tokenizer of the synthetic task
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    fp8: Literal["e4m3", "hybrid"] | None = None  # GPU + Transformer Engine only
    fp8_recipe: Literal["delayed", "blockwise"] = "delayed"
    recompute: Literal["selective", "full"] | None = None
    transformer_impl: Literal["auto", "local", "transformer_engine"] = "auto"  # auto = TE when importable on GPU


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    cp: int = 1  # context parallel: GPU + TE only
    sequence_parallel: bool = False  # GPU + TE only
    distributed_optimizer: bool | None = None  # None = on for GPU, off on CPU
    # token budget of one micro-batch (per CP group); None = the largest the memory model fits in this machine's
    # memory (memory.py; capped at max_auto_micro_batch_tokens); a value predicted not to fit is refused
    max_tokens_per_micro_batch: int | None = None
    max_auto_micro_batch_tokens: int = 8192
    # local spec: a group's responses share one copy of their prompt in a row where that saves FLOPs (exact)
    share_prompts: bool = True
    logprob_chunk_tokens: int = 1024  # tokens per chunk of the vocab-parallel log-softmax
    # the default (NCCL on GPU) group's collective timeout; rollout and eval never wait in it (rollout.control_timeout_s)
    collective_timeout_s: float = 600.0


@dataclass
class SamplingConfig:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    max_new_tokens: int = 64


@dataclass
class RolloutConfig:
    engine: Literal["hf", "sglang"] = "hf"
    # sglang but the sglang package is not installed: the in-process HF engine generates instead, said at start
    fallback_hf: bool = False
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    # copy: in process (hf engine); tensor: /update_weights_from_tensor (CUDA IPC handles on GPU, shared memory on CPU);
    # distributed: a process group with the servers (NCCL on GPU, gloo on CPU); disk: safetensors files
    weight_sync: Literal["copy", "tensor", "distributed", "disk"] = "copy"
    bucket_mb: int = 512
    verify_sync: Literal["checksum", "sample", "off"] = "checksum"
    logp_gap_alarm: float = 0.5  # stop when mean |logp_rollout - logp_actor| exceeds this (0 = never)
    hf_max_batch: int = 64  # HF engine (CPU): sequences per generate call, whole groups; also the abort granularity
    dtype: Literal["fp32", "bf16", "fp16"] | None = None  # the rollout engine's weights; None = model.dtype
    # SGLang
    server_urls: list[str] = field(default_factory=list)  # attach to running servers; empty = start them
    sglang_tp: int = 1
    sglang_device: Literal["cuda", "cpu"] = "cuda"  # cpu: the real server on CPU cores (tests, demo_cpu_sglang)
    sglang_deterministic: bool = True  # --enable-deterministic-inference (honours sampling seeds; GPU backends only)
    sglang_args: list[str] = field(default_factory=list)  # more `sglang.launch_server` flags
    sglang_env: list[str] = field(default_factory=list)  # KEY=VALUE for the server processes
    sglang_pythonpath: list[str] = field(default_factory=list)  # prepended to the servers' PYTHONPATH
    mem_fraction: float = 0.6
    colocate: bool = True
    server_timeout_s: float = 600.0
    # the control plane: how long ranks other than rank 0 wait (gloo group, never NCCL) while rank 0 generates,
    # evaluates or syncs weights: sized to the longest such phase (32B: 1,536 prompts x 16 x 20k tokens), not 10 min
    control_timeout_s: float = 6 * 3600.0
    # SGLang: requests in flight on EACH server: what it runs at once (its max_running_requests), at most this
    max_concurrency: int = 512
    # SGLang: prompt = every sample of a prompt to one engine (radix-cache reuse), the least loaded when the prompt is
    # submitted; request = round-robin per request (bench/fanout.py compares them and sglang-router)
    fanout: Literal["prompt", "request"] = "prompt"
    # a server that dies mid-rollout is restarted, resynced and its requests re-issued; more deaths than this in one
    # step stop the run with an error naming the server's node and log
    max_restarts_per_step: int = 3
    # partial rollout (loop/schedule.py): the samples still in flight when a step has its groups are aborted but
    # kept and resumed first next step with the budget they have left; a group whose oldest token is more than
    # partial_max_age weight versions behind the trainer is dropped (counted)
    partial: bool = False
    partial_max_age: int = 2
    # when a step's batch is generated (loop/async_schedule.py): sync = in the step, on the trainer's weights;
    # one_step_off = step k+1's batch in the background on v_{k-1} while step k trains (async, max_staleness 1);
    # async = a producer running up to max_staleness weight versions ahead of the trainer. Both: engines on their own
    # devices (rollout.colocate = false); the weight sync waits for the batch in progress (a batch is one version)
    schedule: Literal["sync", "one_step_off", "async"] = "sync"
    max_staleness: int = 2  # async: a batch is trained at most this many versions after the weights it started on
    # your own rollout, "package.module:function" (loop/rollout_fn.py has the contract; megatron_dapo.rollouts.
    # tool_agent:generate is the built-in multi-turn tool agent), called per sample with generate_args as keywords;
    # null = the engine's own single-turn generation
    generate: str | None = None
    generate_args: dict = field(default_factory=dict)
    generate_concurrency: int = 64  # rollout-function calls running at once (threads)


@dataclass
class AlgoConfig:
    group_size: int = 16  # G: responses per prompt
    eps_low: float = 0.2
    eps_high: float = 0.28  # clip-higher; = eps_low for naive GRPO/PPO
    clip_c: float | None = 10.0  # dual clip for A < 0; None = off
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    adv_eps: float = 1e-6
    overlong_penalty: bool = True  # soft overlong punishment
    overlong_cache: int = 4096  # L_cache
    overlong_penalty_factor: float = 1.0
    overlong_filter: bool = False  # mask truncated samples out of the loss
    dynamic_sampling: bool = True
    gen_batch_prompts: int = 1536  # prompts generated per round (DAPO: 3 x B)
    max_gen_batches: int = 10  # <= 0: unbounded
    # truncated importance sampling: weight each token's loss by min(pi_old / pi_rollout, tis_cap) (verl, slime);
    # auto = on when training and rollout precision differ (model.fp8)
    tis: Literal["auto", "on", "off"] = "auto"
    tis_cap: float = 2.0


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)  # parquet in the DAPO schema
    # generate a synthetic verifiable task instead of files: add2 (the demo), chain (variable-length reasoning),
    # chain_mix (the ablation toy: chains answered directly or written out, data/chain_mix.py), word_math (word
    # problems in the DAPO prompt, for a real tokenizer: data/word_math.py), tool_mul (products a small model needs the
    # calculator for: data/tool_mul.py)
    synthetic: Literal["add2", "chain", "chain_mix", "word_math", "tool_mul", "none"] = "none"
    chain_max_terms: int = 7
    word_math_max_ops: int = 2  # word_math: steps per problem, 1..this
    synthetic_train_size: int = 20000
    synthetic_eval_size: int = 200
    # chain_mix: the held-out partition the eval set comes from: dev selects a warm start (train.supervised_stop_acc),
    # eval is never trained or selected on
    synthetic_eval_split: Literal["eval", "dev"] = "eval"
    max_prompt_len: int = 2048
    prompt_overflow: Literal["truncate", "error"] = "truncate"  # longer prompts: cut from the left (counted) | refuse
    shuffle: bool = True
    apply_chat_template: bool = True


@dataclass
class RewardConfig:
    # your own reward function, "package.module:function" or "path/to/file.py:function" (its contract:
    # megatron_dapo/reward/user_fn.py); null = by each row's data_source (the DAPO "Answer:" rule, math-verify)
    fn: str | None = None
    batched: bool = False  # fn gets a group at a time (lists) and returns a list
    workers: int = 2  # processes fn runs in; 0 = the trainer's own process, without a time limit
    timeout_s: float = 30.0  # per call
    failure_score: float = -1.0  # the score of a sample whose call raised or timed out
    max_consecutive_failures: int = 64  # this many failed samples in a row stop the run


@dataclass
class EvalConfig:
    files: list[str] = field(default_factory=list)
    interval: int = 0  # steps; 0 = only at the end
    n: int = 32  # samples per prompt (avg@n)
    temperature: float = 1.0
    top_p: float = 0.7
    max_new_tokens: int | None = None  # None = rollout.sampling.max_new_tokens
    greedy: bool = False  # one greedy sample instead of n samples
    at_start: bool = False  # also evaluate the starting policy: step 0 (base/eval/... there when a warm start follows)


@dataclass
class TrainConfig:
    steps: int = 100
    batch_prompts: int = 512  # B: kept prompts (groups) per step
    mini_batch_prompts: int = 32  # prompts per optimizer update -> batch_prompts / mini_batch_prompts updates
    lr: float = 1e-6
    min_lr: float | None = None  # None = constant after warmup
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    warmup_steps: int = 20
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    seed: int = 1234
    save_interval: int = 50  # steps; 0 = only at the end
    keep_checkpoints: int = 2
    export_hf: bool = True  # also write an HF checkpoint at the end
    # pi_old of the first mini-batch of a step is the current policy: take it from the training forward (exact) instead
    # of a separate forward pass; true = recompute every sequence's old logprobs first
    recompute_old_logprobs: bool = False
    # stop early, after the step that reaches it: samples generated by RL (0 = off), RL seconds (0 = off), both counted
    # over the whole run (resumes included). With min_lr set, the LR decays over whichever of steps / sample_budget /
    # time_budget_s ends the run (actor/lr_schedule.py); while the time budget leads, the LR is not reproducible
    sample_budget: int = 0
    time_budget_s: float = 0.0
    run_dir: str = "runs"
    name: str = "dapo"
    wandb_project: str | None = None
    supervised_warmup_steps: int = 0  # optional SFT warm start on the synthetic task (demo); max steps
    supervised_lr: float = 1e-3
    supervised_batch: int = 128
    supervised_stop_acc: float = 1.0  # stop the warm start once held-out accuracy (the eval's avg@k) reaches this


@dataclass
class ClusterConfig:
    placement: Literal["colocated", "disaggregated"] = "colocated"
    nodes: int = 1
    gpus_per_node: int = 8
    rollout_nodes: int = 0  # disaggregated: nodes running SGLang servers
    container_image: str | None = None  # pyxis --container-image
    container_mounts: list[str] = field(default_factory=list)
    nccl_socket_ifname: str | None = None
    ib_hca: str | None = None
    # ports: by default from the job's block (megatron_dapo/ports.py); set these to pin them
    port_base: int | None = None  # first port of the block; None = derived from the Slurm job id
    master_port: int | None = None  # torch.distributed rendezvous
    server_port: int | None = None  # the first SGLang server on a host (the k-th: + k)
    fs_read_gbps: float = 2.0  # what the servers' weights load at, all together: scales the health wait
    gpu_mem_gb: float = 80.0  # GiB per GPU: `dapo launch` refuses a layout whose predicted phase peak exceeds 95% of it
    memory_check: bool = True  # false: launch a layout even when the memory model (plan.py) predicts it will not fit


@dataclass
class DapoConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    @property
    def num_updates(self) -> int:
        return self.train.batch_prompts // self.train.mini_batch_prompts

    @property
    def tis_enabled(self) -> bool:
        """Truncated importance sampling on: asked for, or (auto) training in FP8 against a bf16/fp32 rollout."""
        return self.algo.tis == "on" or (self.algo.tis == "auto" and self.model.fp8 is not None)

    @property
    def tis_possible(self) -> bool:
        """TIS may weight some tokens: on for all (``tis_enabled``), or (auto, partial rollout) for the tokens sampled
        from older weights than the trainer's (the batch's ``Sequence.tis_mask``)."""
        return self.tis_enabled or (self.algo.tis == "auto" and (self.rollout.partial or self.off_policy_schedule))

    @property
    def off_policy_schedule(self) -> bool:
        """The batch is generated on older weights than it is trained on (one_step_off, async)."""
        return self.rollout.schedule != "sync"

    @property
    def max_seq_len(self) -> int:
        return self.data.max_prompt_len + self.rollout.sampling.max_new_tokens


def resolve_recipe(name_or_path: str | Path) -> Path:
    """A recipe name (``demo_cpu``) or a path to a YAML file."""
    return resolve_named_yaml(name_or_path, RECIPES_DIR, "recipe", "known recipes")


def _read_recipe(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    """A recipe's YAML; ``base: other_recipe`` starts from that recipe, this file's sections merged over it."""
    data = read_yaml(path)
    base = data.pop("base", None)
    if base is None:
        return data
    base_path = resolve_recipe(base)
    if base_path.resolve() in seen:
        raise ConfigError(f"{path}: base = {base!r}: recipes include each other")
    return _merge(_read_recipe(base_path, (*seen, path.resolve())), data)


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def load_config(recipe: str | Path | None = None, overrides: list[str] | None = None) -> DapoConfig:
    """Load a recipe (name or path), apply ``key=value`` overrides, validate; raise ``ConfigError`` naming the key."""
    data: dict = {}
    source = "defaults"
    if recipe is not None:
        path = resolve_recipe(recipe)
        data = _read_recipe(path)
        source = str(path)
    # Check the file alone first, so that an error in it is reported against the file, not the command line.
    from_dict(DapoConfig, data, source)
    for text in overrides or []:
        key, value = parse_override(text)
        set_dotted(data, key, value)
        from_dict(DapoConfig, data, f"command line ({key})")
    cfg = from_dict(DapoConfig, data, source)
    validate(cfg, source)
    check_unused_overrides(cfg, [parse_override(text) for text in overrides or []])
    return cfg


# Settings a run ignores under some other setting: key -> (ignored?, why). A command-line override of one of them is
# an error (the user meant it to change the run); a recipe may keep them for when the other setting is switched.
_SYNTHETIC = (lambda c: c.data.synthetic == "none", "data.synthetic = 'none'")
_NO_WARMUP = (lambda c: not c.train.supervised_warmup_steps, "train.supervised_warmup_steps = 0")
_NOT_SGLANG = (lambda c: c.rollout.engine != "sglang", "rollout.engine = {rollout.engine!r}")
_NO_OVERLONG = (lambda c: not c.algo.overlong_penalty, "algo.overlong_penalty = false")
_NO_REWARD_FN = (lambda c: c.reward.fn is None, "reward.fn = null (rows are scored by their data_source)")
_GREEDY = (lambda c: c.eval.greedy, "eval.greedy = true (one greedy sample per problem)")
_IGNORED_WHEN = {
    "data.train_files": (
        lambda c: c.data.synthetic != "none",
        "data.synthetic = {data.synthetic!r} makes the prompts (set data.synthetic=none to use files)",
    ),
    "data.synthetic_train_size": _SYNTHETIC,
    "data.synthetic_eval_size": _SYNTHETIC,
    "data.synthetic_eval_split": (lambda c: c.data.synthetic != "chain_mix", "data.synthetic = {data.synthetic!r}"),
    "data.word_math_max_ops": (lambda c: c.data.synthetic != "word_math", "data.synthetic = {data.synthetic!r}"),
    "train.supervised_lr": _NO_WARMUP,
    "train.supervised_batch": _NO_WARMUP,
    "train.supervised_stop_acc": _NO_WARMUP,
    "rollout.hf_max_batch": (lambda c: c.rollout.engine != "hf", "rollout.engine = {rollout.engine!r}"),
    "rollout.server_urls": _NOT_SGLANG,
    "rollout.sglang_tp": _NOT_SGLANG,
    "rollout.mem_fraction": _NOT_SGLANG,
    "rollout.fallback_hf": _NOT_SGLANG,
    "rollout.max_concurrency": _NOT_SGLANG,
    "rollout.fanout": _NOT_SGLANG,
    "algo.overlong_cache": _NO_OVERLONG,
    "algo.overlong_penalty_factor": _NO_OVERLONG,
    "algo.max_gen_batches": (lambda c: not c.algo.dynamic_sampling, "algo.dynamic_sampling = false"),
    "algo.tis_cap": (lambda c: not c.tis_possible, "truncated importance sampling is off (algo.tis = {algo.tis!r})"),
    "rollout.partial_max_age": (lambda c: not c.rollout.partial, "rollout.partial = false"),
    "rollout.generate_args": (lambda c: c.rollout.generate is None, "rollout.generate = null"),
    "rollout.generate_concurrency": (lambda c: c.rollout.generate is None, "rollout.generate = null"),
    "rollout.max_staleness": (lambda c: c.rollout.schedule != "async", "rollout.schedule = {rollout.schedule!r}"),
    "model.fp8_recipe": (lambda c: c.model.fp8 is None, "model.fp8 = null"),
    **{
        f"reward.{k}": _NO_REWARD_FN
        for k in ("batched", "workers", "timeout_s", "failure_score", "max_consecutive_failures")
    },
    "eval.n": _GREEDY,
    "eval.temperature": _GREEDY,
    "eval.top_p": _GREEDY,
}


def check_unused_overrides(cfg: DapoConfig, overrides: list[tuple[str, Any]]) -> None:
    """An override the run would silently ignore is an error naming it and the setting that makes it unused."""
    sections = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}  # "{data.synthetic!r}" in the reasons
    for key, value in overrides:
        ignored, why = _IGNORED_WHEN.get(key, (lambda c: False, ""))
        if ignored(cfg):
            raise ConfigError(f"command line: {key} = {value!r} would be ignored: {why.format(**sections)}")


def config_to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg: DapoConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))


# ----------------------------------------------------------------------------------------------------------------------
# SGLang server flags the weight sync cannot work with

# every weight-update endpoint of SGLang 0.5.23 asserts get_parallel().dp_size == 1 (sglang/srt/managers/
# tokenizer_control_mixin.py: init_weights_update_group, update_weights_from_distributed/_tensor/_ipc, ...)
DP_FLAGS = ("--dp-size", "--dp", "--data-parallel-size")


def sglang_data_parallel(args: list[str] | tuple[str, ...]) -> str | None:
    """The flag in ``args`` that makes an SGLang server data-parallel (``--dp-size 2``, ``--dp=2``, or an abbreviation
    SGLang's argparse accepts, ``--dp-s 2``), as written; None if there is none. One check for the servers the trainer
    starts (``sglang_server.SGLangServer``) and those ``dapo launch`` starts (config validation, before any step)."""
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        full = len(flag) >= 4 and any(f.startswith(flag) for f in DP_FLAGS)  # argparse takes unique prefixes
        if not full:
            continue
        value = value if eq else (args[i + 1] if i + 1 < len(args) else "1")
        try:
            if int(value) > 1:
                return f"{flag} {value}"
        except ValueError:
            continue  # not a size: SGLang's own parser refuses it
    return None


# ----------------------------------------------------------------------------------------------------------------------
# Validation of a whole run configuration


def validate(cfg: DapoConfig, source: str = "config") -> None:
    """Reject impossible values before any compute; every message names the key."""

    def fail(key: str, value: Any, msg: str) -> None:
        raise ConfigError(f"{source}: {key} = {value!r}: {msg}")

    a, t, p, r, d = cfg.algo, cfg.train, cfg.parallel, cfg.rollout, cfg.data
    if not 0 < a.eps_low < 1:
        fail("algo.eps_low", a.eps_low, "must be in (0, 1)")
    if a.eps_high <= 0:
        fail("algo.eps_high", a.eps_high, "must be > 0")
    if a.clip_c is not None and a.clip_c <= 1:
        fail("algo.clip_c", a.clip_c, "dual-clip constant must be > 1 (or null to turn it off)")
    if a.group_size < 1:
        fail("algo.group_size", a.group_size, "must be >= 1")
    if a.dynamic_sampling and a.group_size < 2:
        fail("algo.group_size", a.group_size, "dynamic sampling needs at least 2 responses per prompt")
    if a.adv_eps <= 0:
        fail("algo.adv_eps", a.adv_eps, "must be > 0")
    if a.overlong_penalty and a.overlong_cache <= 0:
        fail("algo.overlong_cache", a.overlong_cache, "must be > 0 when algo.overlong_penalty is on")
    if a.overlong_penalty and r.sampling.max_new_tokens <= a.overlong_cache:
        fail(
            "rollout.sampling.max_new_tokens",
            r.sampling.max_new_tokens,
            f"the max response length must exceed algo.overlong_cache ({a.overlong_cache})",
        )
    if a.tis_cap <= 0:
        fail("algo.tis_cap", a.tis_cap, "must be > 0 (the cap C of the importance weights min(pi_old/pi_rollout, C))")
    if a.gen_batch_prompts < 1:
        fail("algo.gen_batch_prompts", a.gen_batch_prompts, "must be >= 1")
    if not a.dynamic_sampling and a.gen_batch_prompts < t.batch_prompts:
        fail("algo.gen_batch_prompts", a.gen_batch_prompts, f"must be >= train.batch_prompts ({t.batch_prompts})")
    if t.batch_prompts < 1:
        fail("train.batch_prompts", t.batch_prompts, "must be >= 1")
    if t.mini_batch_prompts < 1 or t.batch_prompts % t.mini_batch_prompts:
        fail("train.mini_batch_prompts", t.mini_batch_prompts, f"must divide train.batch_prompts ({t.batch_prompts})")
    if t.lr <= 0:
        fail("train.lr", t.lr, "must be > 0")
    if t.min_lr is not None and not 0 <= t.min_lr <= t.lr:
        fail("train.min_lr", t.min_lr, f"must be in [0, train.lr = {t.lr}]")
    for key in ("steps", "warmup_steps", "save_interval", "keep_checkpoints", "supervised_warmup_steps"):
        if getattr(t, key) < 0:
            fail(f"train.{key}", getattr(t, key), "must be >= 0")
    if t.sample_budget < 0:
        fail("train.sample_budget", t.sample_budget, "must be >= 0 (samples generated by RL; 0 = no budget)")
    if t.time_budget_s < 0:
        fail("train.time_budget_s", t.time_budget_s, "must be >= 0 (RL seconds; 0 = no budget)")
    if t.grad_clip < 0:
        fail("train.grad_clip", t.grad_clip, "must be >= 0 (0 = no clipping)")
    if not 0 <= t.weight_decay < 1:
        fail("train.weight_decay", t.weight_decay, "must be in [0, 1)")
    for key in ("tp", "pp", "cp"):
        if getattr(p, key) < 1:
            fail(f"parallel.{key}", getattr(p, key), "must be >= 1")
    if p.max_tokens_per_micro_batch is not None and p.max_tokens_per_micro_batch < cfg.max_seq_len:
        fail(
            "parallel.max_tokens_per_micro_batch",
            p.max_tokens_per_micro_batch,
            f"must hold one full sequence (data.max_prompt_len + rollout.sampling.max_new_tokens = {cfg.max_seq_len})",
        )
    if p.logprob_chunk_tokens < 1:
        fail("parallel.logprob_chunk_tokens", p.logprob_chunk_tokens, "must be >= 1")
    if not p.collective_timeout_s > 0:
        fail("parallel.collective_timeout_s", p.collective_timeout_s, "must be > 0 seconds")
    s = r.sampling
    if s.temperature < 0:
        fail("rollout.sampling.temperature", s.temperature, "must be >= 0 (0 = greedy)")
    if not 0 < s.top_p <= 1:
        fail("rollout.sampling.top_p", s.top_p, "must be in (0, 1]")
    if s.max_new_tokens < 1:
        fail("rollout.sampling.max_new_tokens", s.max_new_tokens, "must be >= 1")
    if r.bucket_mb < 1:
        fail("rollout.bucket_mb", r.bucket_mb, "must be >= 1")
    if r.hf_max_batch < 1:
        fail("rollout.hf_max_batch", r.hf_max_batch, "must be >= 1")
    if r.partial_max_age < 1:
        fail("rollout.partial_max_age", r.partial_max_age, "must be >= 1 (weight versions a carried group may lag)")
    if r.max_staleness < 1:
        fail("rollout.max_staleness", r.max_staleness, "must be >= 1 (weight versions the producer may run ahead)")
    if r.schedule != "sync" and r.colocate:
        fail(
            "rollout.schedule",
            r.schedule,
            "with rollout.colocate = true the engines share the trainer's devices and release their memory while it "
            "trains (loop/phases.py), so nothing can generate meanwhile: use rollout.schedule=sync (with "
            "rollout.partial=true if you like), or rollout.colocate=false (SGLang: servers on their own GPUs, from "
            "rollout.server_urls or cluster.placement=disaggregated; the hf engine: its own copy of the weights, "
            "generating in a thread)",
        )
    # engines/sglang/client.py from_config: without server_urls the trainer starts one server itself, with SGLang's
    # default --base-gpu-id 0, i.e. on the trainer's own GPUs; uncolocated it never releases their memory. A CPU
    # server runs on cores (nothing shared to release), and under the disaggregated placement `dapo launch` starts
    # the servers on cluster.rollout_nodes and hands their URLs to the trainer.
    colocated_layout = cfg.cluster.placement == "colocated"
    # a server told which GPUs to use (--base-gpu-id, CUDA_VISIBLE_DEVICES) is the user's choice: one node's async
    own_gpus = "--base-gpu-id" in r.sglang_args or any(kv.startswith("CUDA_VISIBLE_DEVICES=") for kv in r.sglang_env)
    if (
        r.engine == "sglang"
        and r.sglang_device == "cuda"
        and not r.colocate
        and not r.server_urls
        and colocated_layout
        and not own_gpus
    ):
        fail(
            "rollout.colocate",
            r.colocate,
            "with rollout.server_urls empty the trainer would start its SGLang server on its own GPUs (GPU 0 on, "
            "never releasing their memory): set rollout.server_urls=[URL, ...] (servers started on other GPUs or "
            "nodes), or cluster.placement=disaggregated with cluster.rollout_nodes and run `dapo launch` (it "
            "starts the servers on their own nodes), or rollout.sglang_args=[--base-gpu-id, N] (GPUs the trainer does "
            "not use), or rollout.colocate=true with rollout.schedule=sync",
        )
    if r.max_concurrency < 1:
        fail("rollout.max_concurrency", r.max_concurrency, "must be >= 1 (requests in flight per server)")
    if r.max_restarts_per_step < 0:
        fail("rollout.max_restarts_per_step", r.max_restarts_per_step, "must be >= 0 (0 = stop at the first death)")
    if not 0 < r.mem_fraction < 1:
        fail("rollout.mem_fraction", r.mem_fraction, "must be in (0, 1)")
    if r.engine == "hf" and r.weight_sync != "copy":
        fail("rollout.weight_sync", r.weight_sync, "the hf engine is synced in process: use 'copy'")
    if r.engine == "sglang" and r.weight_sync == "copy":
        fail("rollout.weight_sync", r.weight_sync, "sglang needs tensor, distributed or disk")
    dp_flag = sglang_data_parallel(r.sglang_args)
    if dp_flag:
        fail(
            "rollout.sglang_args",
            r.sglang_args,
            f"{dp_flag}: every weight update of SGLang asserts dp_size == 1 (tokenizer_control_mixin.py); for more "
            "replicas use more servers: dapo launch starts one per rollout.sglang_tp GPUs, or list them in "
            "rollout.server_urls",
        )
    # NCCL src/init.cc (initTransportsRank): "Duplicate GPU detected : rank %d and rank %d both on CUDA device" ->
    # ncclInvalidUsage, when two ranks of one communicator share a bus id; a gloo group (CPU servers) has no such rule
    if r.engine == "sglang" and r.colocate and r.sglang_device == "cuda" and r.weight_sync == "distributed":
        fail(
            "rollout.weight_sync",
            r.weight_sync,
            "with rollout.colocate = true the sync group would hold trainer rank 0 and SGLang's TP rank 0 on one "
            "GPU, and NCCL refuses two ranks of a group on one device: use rollout.weight_sync=tensor (CUDA IPC, "
            "for colocated servers) or disk, or rollout.colocate=false with cluster.placement=disaggregated",
        )
    if r.control_timeout_s < r.server_timeout_s:
        fail(
            "rollout.control_timeout_s",
            r.control_timeout_s,
            f"the other ranks wait this long on the control plane while rank 0 starts its servers: must be >= "
            f"rollout.server_timeout_s ({r.server_timeout_s})",
        )
    for kv in r.sglang_env:
        if "=" not in kv or not kv.split("=", 1)[0]:
            fail("rollout.sglang_env", kv, "entries are KEY=VALUE")
    if r.sglang_device == "cpu" and r.sglang_deterministic:
        fail(
            "rollout.sglang_deterministic",
            r.sglang_deterministic,
            "SGLang's deterministic inference needs a GPU attention backend (on a CPU it only has torch_native)",
        )
    if r.engine == "sglang" and not r.server_urls:
        for path in r.sglang_pythonpath:
            if not Path(path).is_dir():
                fail("rollout.sglang_pythonpath", path, f"not a directory (relative to {Path.cwd()})")
    if d.max_prompt_len < 1:
        fail("data.max_prompt_len", d.max_prompt_len, "must be >= 1")
    if d.synthetic_eval_split == "dev" and d.synthetic != "chain_mix":
        fail("data.synthetic_eval_split", d.synthetic_eval_split, "only data.synthetic = chain_mix has a dev split")
    if d.word_math_max_ops < 1:
        fail("data.word_math_max_ops", d.word_math_max_ops, "must be >= 1")
    if d.synthetic == "none" and not d.train_files:
        fail("data.train_files", d.train_files, "give parquet files or set data.synthetic")
    if cfg.eval.n < 1:
        fail("eval.n", cfg.eval.n, "must be >= 1")
    if r.generate is not None and r.partial:
        fail("rollout.partial", r.partial, "a rollout function (rollout.generate) runs without partial rollout so far")
    if r.generate_concurrency < 1:
        fail("rollout.generate_concurrency", r.generate_concurrency, "must be >= 1")
    rw = cfg.reward
    if rw.workers < 0:
        fail("reward.workers", rw.workers, "must be >= 0 (0 = in the trainer's process)")
    if rw.timeout_s <= 0:
        fail("reward.timeout_s", rw.timeout_s, "must be > 0")
    if rw.max_consecutive_failures < 1:
        fail("reward.max_consecutive_failures", rw.max_consecutive_failures, "must be >= 1")
    c = cfg.cluster
    if c.placement == "disaggregated" and not 0 < c.rollout_nodes < c.nodes:
        fail(
            "cluster.rollout_nodes",
            c.rollout_nodes,
            f"disaggregated placement needs 0 < rollout_nodes < nodes ({c.nodes})",
        )
    resolve_arch_path(cfg.model.arch)  # unknown architecture names fail here, before compute


def check_world_divides(parallel: ParallelConfig, world: int, what: str = "ranks") -> None:
    mp = parallel.tp * parallel.pp * parallel.cp
    if world % mp:
        raise ConfigError(
            f"parallel.tp x pp x cp = {parallel.tp}x{parallel.pp}x{parallel.cp} = {mp} does not divide the {world} "
            f"{what}"
        )
