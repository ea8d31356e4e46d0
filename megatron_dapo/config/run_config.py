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
from megatron_dapo.config.validate import check_unused_overrides, validate
from megatron_dapo.engines.registry import DEFAULT_ENGINE, ENGINES

ENGINE_NAMES = tuple(ENGINES)  # rollout.engine's choices

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
class LoraConfig:
    """LoRA (actor/lora.py): rank 0 = off (full fine-tuning)."""

    rank: int = 0
    alpha: float = 32.0  # the update is scaled by alpha / rank
    dropout: float = 0.0
    targets: list[str] = field(default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])
    # peft: A Kaiming-uniform, B = 0 (step 0 is the base model); random: B random too, N(0, 0.02), as PEFT's
    # init_lora_weights=False (tests: the adapted model differs from the base from the first step)
    init: Literal["peft", "random"] = "peft"
    # adapters: checkpoints hold the adapters (and their optimizer state) alone when the frozen base comes from a file
    # (model.hf_init / model.load), which a resume loads first and checks by its fingerprint; full: the base too
    checkpoint: Literal["adapters", "full"] = "adapters"


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
    # MoE: the weight of the load-balancing auxiliary loss (megatron-core moe_aux_loss_coeff; 0 = none, as in most RL
    # recipes: the routes the rollout engine chose are what the policy is trained on)
    moe_aux_loss_coeff: float = 0.0
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    cp: int = 1  # context parallel: GPU + TE only
    ep: int = 1  # expert parallel (MoE): each rank holds experts / ep experts, each split over TP (expert TP = TP)
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
class ToolsConfig:
    """One sample's tool budget (rollouts/tools.py ToolBudget), for rollout functions that take ``tool_budget``
    (the tool agent does); a call over it is refused with an error the model reads."""

    calls_per_turn: int = 8
    calls_per_sample: int = 32
    wall_s_per_sample: float = 120.0  # tool wall-clock seconds per sample: the sandbox is cut to what is left


@dataclass
class RolloutSettings:
    """``rollout:`` without the engines' own blocks (``RolloutConfig`` below adds them)."""

    engine: Literal[ENGINE_NAMES] = DEFAULT_ENGINE  # engines/registry.py
    # a server engine whose package is not installed: the in-process HF engine generates instead, said at start
    fallback_hf: bool = False
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    # copy: in process (hf engine); tensor: /update_weights_from_tensor (CUDA IPC handles on GPU, shared memory on CPU);
    # distributed: a process group with the servers (NCCL on GPU, gloo on CPU); disk: safetensors files
    weight_sync: Literal["copy", "tensor", "distributed", "disk"] = "copy"
    # with model.lora: adapter = the engine loads each new adapter version (SGLang: a PEFT folder in the run directory,
    # /load_lora_adapter; the base weights never move); merged = the merged weights through rollout.weight_sync;
    # auto = adapter on SGLang, merged on the in-process HF engine
    lora_sync: Literal["auto", "adapter", "merged"] = "auto"
    bucket_mb: int = 512
    verify_sync: Literal["checksum", "sample", "off"] = "checksum"
    logp_gap_alarm: float = 0.5  # stop when mean |logp_rollout - logp_actor| exceeds this (0 = never)
    # the rollout engine's weights; None = model.dtype; auto = bf16 on GPUs and on CPUs with bf16 matmul units
    # (AVX512-BF16 / AMX), else fp32 (engines/sglang/server.server_dtype)
    dtype: Literal["fp32", "bf16", "fp16", "auto"] | None = None
    # server engines (their own settings: rollout.<engine>, engines/<engine>/options.py)
    server_urls: list[str] = field(default_factory=list)  # attach to running servers; empty = start them
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
    # MoE rollout routing replay (R3): the engine returns the experts it routed each token to and the actor replays
    # them in every forward (old logprobs and training); None = on for a mixture of experts, off for a dense model
    routing_replay: bool | None = None
    partial_max_age: int = 2
    # when a step's batch is generated (loop/async_schedule.py): sync = in the step, on the trainer's weights;
    # one_step_off = step k+1's batch in the background on v_{k-1} while step k trains (async, max_staleness 1);
    # async = a producer running up to max_staleness weight versions ahead of the trainer. Both: engines on their own
    # devices (rollout.colocate = false); the weight sync waits for the batch in progress (a batch is one version)
    # stream (loop/stream_schedule.py) = engines kept full across steps, the weight sync interrupting generation
    # (the samples in flight keep their tokens and resume on the new weights)
    schedule: Literal["sync", "one_step_off", "async", "stream"] = "sync"
    max_staleness: int = 2  # async: a batch is trained at most this many versions after the weights it started on
    # stream: at most (1 + stream_staleness) x algo.gen_batch_prompts groups admitted and not yet trained: the share
    # of a generation batch that may begin on weights older than those it is trained from (verl's staleness_threshold)
    stream_staleness: float = 0.5
    # stream: which complete groups a step takes: the complete prefix of the window (prompt order: the head waits for
    # its longest sample) or any complete group in the order it completed (verl; long groups are trained later, older)
    stream_order: Literal["prompt", "completion"] = "prompt"
    # steps between weight syncs (1 = every step); the engines generate on older weights meanwhile
    sync_every: int = 1
    # your own rollout, "package.module:function" (loop/rollout_fn.py has the contract; megatron_dapo.rollouts.
    # tool_agent:generate is the built-in multi-turn tool agent), called per sample with generate_args as keywords;
    # null = the engine's own single-turn generation
    generate: str | None = None
    generate_args: dict = field(default_factory=dict)
    generate_concurrency: int = 64  # rollout-function calls running at once (threads)
    tools: ToolsConfig = field(default_factory=ToolsConfig)


# rollout: the settings above and one block per engine, ``rollout.<engine>`` (its options dataclass, owned and checked
# by the engine: engines/<engine>/options.py), so that this module names no engine
RolloutConfig = dataclasses.make_dataclass(
    "RolloutConfig",
    [(name, spec.options, field(default_factory=spec.options)) for name, spec in ENGINES.items() if spec.options],
    bases=(RolloutSettings,),
)
RolloutConfig.__module__ = __name__  # pickled by name (make_dataclass's module= is Python 3.12+)


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
    # which mismatch correction weighs those tokens (algo/corrections.py): token_tis (min(ratio, tis_cap)), seq_tis,
    # token_mis, seq_mis, icepop, geo_reject, or "package.module:function"; the masking ones keep ratios within
    # correction_bounds
    correction: str = "token_tis"
    # pi_old, the policy the PPO ratio is taken against: recompute (the trainer's forward before the update, exact) or
    # rollout (the engine's logprobs: no pi_old forward, as verl's fully async; the correction then compares the
    # current policy, detached, with the rollout's)
    old_logprobs: Literal["recompute", "rollout"] = "recompute"
    correction_bounds: list[float] = field(default_factory=lambda: [0.5, 2.0])


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
    # reward worker processes (reward.fn's and math-verify's) are recycled after this many calls (0 = never) and when
    # their resident memory after a call passes this many MB (0 = no limit)
    worker_max_tasks: int = 1000
    worker_max_rss_mb: int = 2048


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
    # streaming training (rollout.schedule: stream, algo.old_logprobs: rollout): each mini-batch update starts as soon as
    # its groups are kept, not when the whole batch is; each update's loss and token denominator are unchanged
    stream_updates: bool = False
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
    _refuse_moved_keys(data, source)
    from_dict(DapoConfig, data, source)
    for text in overrides or []:
        key, value = parse_override(text)
        _refuse_moved_keys({}, "command line", key)
        set_dotted(data, key, value)
        from_dict(DapoConfig, data, f"command line ({key})")
    cfg = from_dict(DapoConfig, data, source)
    validate(cfg, source)
    resolve_arch_path(cfg.model.arch)  # unknown architecture names fail here, before compute
    check_unused_overrides(cfg, [parse_override(text) for text in overrides or []])
    return cfg


def _refuse_moved_keys(data: dict, source: str, dotted: str | None = None) -> None:
    """A key an engine moved into its block (``rollout.sglang_tp`` -> ``rollout.sglang.tp``) is named with its new
    place, in a recipe (``data``) or an override (``dotted``)."""
    moved = {old: new for spec in ENGINES.values() for old, new in spec.moved_keys.items()}
    rollout = data.get("rollout") if isinstance(data.get("rollout"), dict) else {}
    for old in [dotted] if dotted else [f"rollout.{k}" for k in rollout]:
        if old in moved:
            raise ConfigError(f"{source}: {old}: this key is now {moved[old]} (engines own their settings: "
                              f"rollout.<engine>.*, docs/guides/recipes-and-config.md)")  # fmt: skip


def config_to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg: DapoConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
