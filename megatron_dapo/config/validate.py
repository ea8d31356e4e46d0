"""Validation of a run configuration: impossible values, overrides a run would ignore, and server flags the weight sync
cannot work with. Every error names the key and where it came from."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from megatron_dapo.config.typed_yaml import ConfigError
from megatron_dapo.engines.registry import ENGINES, engine_spec

if TYPE_CHECKING:
    from megatron_dapo.config.run_config import DapoConfig, ParallelConfig


# Settings a run ignores under some other setting: key -> (ignored?, why). A command-line override of one of them is
# an error (the user meant it to change the run); a recipe may keep them for when the other setting is switched.
_SYNTHETIC = (lambda c: c.data.synthetic == "none", "data.synthetic = 'none'")
_NO_WARMUP = (lambda c: not c.train.supervised_warmup_steps, "train.supervised_warmup_steps = 0")
_NO_SERVERS = (lambda c: not engine_spec(c.rollout.engine).servers, "rollout.engine = {rollout.engine!r} (no servers)")
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
    "rollout.server_urls": _NO_SERVERS,
    "rollout.mem_fraction": _NO_SERVERS,
    "rollout.fallback_hf": _NO_SERVERS,
    "rollout.max_concurrency": _NO_SERVERS,
    "rollout.fanout": _NO_SERVERS,
    "algo.overlong_cache": _NO_OVERLONG,
    "algo.overlong_penalty_factor": _NO_OVERLONG,
    "algo.max_gen_batches": (lambda c: not c.algo.dynamic_sampling, "algo.dynamic_sampling = false"),
    "algo.tis_cap": (lambda c: not c.tis_possible, "truncated importance sampling is off (algo.tis = {algo.tis!r})"),
    "train.recompute_old_logprobs": (lambda c: c.algo.old_logprobs == "rollout", "algo.old_logprobs = 'rollout'"),
    "algo.correction": (lambda c: not c.tis_possible, "mismatch corrections are off (algo.tis = {algo.tis!r})"),
    "algo.correction_bounds": (lambda c: not c.tis_possible, "mismatch corrections are off (algo.tis = {algo.tis!r})"),
    "rollout.partial_max_age": (
        lambda c: not c.rollout.partial and c.rollout.schedule != "stream",
        "rollout.partial = false and rollout.schedule = {rollout.schedule!r}",
    ),
    "rollout.partial": (lambda c: c.rollout.schedule == "stream", "rollout.schedule = 'stream' (always partial)"),
    "rollout.stream_staleness": (lambda c: c.rollout.schedule != "stream", "rollout.schedule = {rollout.schedule!r}"),
    "rollout.stream_order": (lambda c: c.rollout.schedule != "stream", "rollout.schedule = {rollout.schedule!r}"),
    "rollout.generate_args": (lambda c: c.rollout.generate is None, "rollout.generate = null"),
    "rollout.generate_concurrency": (lambda c: c.rollout.generate is None, "rollout.generate = null"),
    "rollout.tools.calls_per_turn": (lambda c: c.rollout.generate is None, "rollout.generate = null"),
    "rollout.tools.calls_per_sample": (lambda c: c.rollout.generate is None, "rollout.generate = null"),
    "rollout.tools.wall_s_per_sample": (lambda c: c.rollout.generate is None, "rollout.generate = null"),
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
        block = key.split(".")[1] if key.startswith("rollout.") and key.count(".") >= 2 else None
        if block in ENGINES and block != cfg.rollout.engine:  # rollout.<engine>.*: that engine's own settings
            raise ConfigError(f"command line: {key} = {value!r} would be ignored: rollout.engine = "
                              f"{cfg.rollout.engine!r}")  # fmt: skip
        ignored, why = _IGNORED_WHEN.get(key, (lambda c: False, ""))
        if ignored(cfg):
            raise ConfigError(f"command line: {key} = {value!r} would be ignored: {why.format(**sections)}")


# ----------------------------------------------------------------------------------------------------------------------
# Validation of a whole run configuration


def validate(cfg: DapoConfig, source: str = "config") -> None:
    """Reject impossible values before any compute; every message names the key."""

    def fail(key: str, value: Any, msg: str) -> None:
        raise ConfigError(f"{source}: {key} = {value!r}: {msg}")

    a, t, p, r, d = cfg.algo, cfg.train, cfg.parallel, cfg.rollout, cfg.data
    if p.ep < 1:
        fail("parallel.ep", p.ep, "must be >= 1")
    lora = cfg.model.lora
    if lora.rank < 0:
        fail("model.lora.rank", lora.rank, "must be >= 0 (0: no LoRA, full fine-tuning)")
    if lora.rank and lora.alpha <= 0:
        fail("model.lora.alpha", lora.alpha, "must be > 0 (the update is scaled by alpha / rank)")
    if not 0 <= lora.dropout < 1:
        fail("model.lora.dropout", lora.dropout, "must be in [0, 1)")
    targets = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    if lora.rank and (not lora.targets or set(lora.targets) - set(targets)):
        fail("model.lora.targets", lora.targets, f"must name some of {list(targets)}")
    spec = engine_spec(r.engine)
    if lora.rank and r.lora_sync == "adapter" and spec.adapter_sync_factory is None:
        with_adapters = [n for n, e in ENGINES.items() if e.adapter_sync_factory]
        fail("rollout.lora_sync", r.lora_sync, f"rollout.engine = {r.engine!r} cannot load adapters (engines that "
             f"can: {', '.join(with_adapters)}): lora_sync = merged or auto sends it the merged weights")  # fmt: skip
    if not 0 <= cfg.model.moe_aux_loss_coeff:
        fail("model.moe_aux_loss_coeff", cfg.model.moe_aux_loss_coeff, "must be >= 0 (0: no load-balancing loss)")
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
    lo_hi = a.correction_bounds  # the name is checked where corrections live (algo/corrections.py check_correction)
    if len(lo_hi) != 2 or not 0 <= lo_hi[0] < 1 < lo_hi[1]:
        fail("algo.correction_bounds", lo_hi, "expected [low, high] with 0 <= low < 1 < high (bounds of the ratio)")
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
    if r.partial_max_age < 1:
        fail("rollout.partial_max_age", r.partial_max_age, "must be >= 1 (weight versions a carried group may lag)")
    if r.max_staleness < 1:
        fail("rollout.max_staleness", r.max_staleness, "must be >= 1 (weight versions the producer may run ahead)")
    if r.stream_staleness < 0:
        fail("rollout.stream_staleness", r.stream_staleness, "must be >= 0 (a share of algo.gen_batch_prompts)")
    if r.sync_every < 1:
        fail("rollout.sync_every", r.sync_every, "must be >= 1 (steps between weight syncs)")
    if cfg.train.stream_updates and r.schedule != "stream":
        fail("train.stream_updates", True, f"needs rollout.schedule = 'stream' (it is {r.schedule!r})")
    if cfg.train.stream_updates and cfg.algo.old_logprobs != "rollout":
        fail(
            "train.stream_updates",
            True,
            "needs algo.old_logprobs = 'rollout': a later mini-batch's π_old would be the policy before the step's "
            "first update, which a pass over the whole batch gives only once the whole batch is collected",
        )
    if r.sync_every > 1 and r.schedule != "stream":
        fail("rollout.sync_every", r.sync_every, "syncs less often than every step only with rollout.schedule=stream")
    if r.sync_every > 1 and cfg.eval.interval % r.sync_every:
        fail(
            "eval.interval",
            cfg.eval.interval,
            f"must be a multiple of rollout.sync_every ({r.sync_every}): the engines evaluate the synced weights",
        )
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
    if r.max_concurrency < 1:
        fail("rollout.max_concurrency", r.max_concurrency, "must be >= 1 (requests in flight per server)")
    if r.max_restarts_per_step < 0:
        fail("rollout.max_restarts_per_step", r.max_restarts_per_step, "must be >= 0 (0 = stop at the first death)")
    if not 0 < r.mem_fraction < 1:
        fail("rollout.mem_fraction", r.mem_fraction, "must be in (0, 1)")
    if r.weight_sync not in spec.weight_syncs:
        fail(
            "rollout.weight_sync", r.weight_sync, f"rollout.engine = {r.engine!r} takes {', '.join(spec.weight_syncs)}"
        )
    if r.control_timeout_s < r.server_timeout_s:
        fail(
            "rollout.control_timeout_s",
            r.control_timeout_s,
            f"the other ranks wait this long on the control plane while rank 0 starts its servers: must be >= "
            f"rollout.server_timeout_s ({r.server_timeout_s})",
        )
    if spec.check is not None:  # the engine's own rules (engines/<engine>/options.py)
        spec.check(cfg, fail)
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
    if r.generate_concurrency < 1:
        fail("rollout.generate_concurrency", r.generate_concurrency, "must be >= 1")
    for key in ("calls_per_turn", "calls_per_sample"):
        if getattr(r.tools, key) < 1:
            fail(f"rollout.tools.{key}", getattr(r.tools, key), "must be >= 1")
    if r.tools.wall_s_per_sample <= 0:
        fail("rollout.tools.wall_s_per_sample", r.tools.wall_s_per_sample, "must be > 0")
    rw = cfg.reward
    if rw.workers < 0:
        fail("reward.workers", rw.workers, "must be >= 0 (0 = in the trainer's process)")
    if rw.timeout_s <= 0:
        fail("reward.timeout_s", rw.timeout_s, "must be > 0")
    if rw.max_consecutive_failures < 1:
        fail("reward.max_consecutive_failures", rw.max_consecutive_failures, "must be >= 1")
    if rw.worker_max_tasks < 0:
        fail("reward.worker_max_tasks", rw.worker_max_tasks, "must be >= 0 (0 = never recycle)")
    if rw.worker_max_rss_mb < 0:
        fail("reward.worker_max_rss_mb", rw.worker_max_rss_mb, "must be >= 0 (0 = no limit)")
    c = cfg.cluster
    if c.placement == "disaggregated" and not 0 < c.rollout_nodes < c.nodes:
        fail(
            "cluster.rollout_nodes",
            c.rollout_nodes,
            f"disaggregated placement needs 0 < rollout_nodes < nodes ({c.nodes})",
        )


def check_world_divides(parallel: ParallelConfig, world: int, what: str = "ranks") -> None:
    mp = parallel.tp * parallel.pp * parallel.cp
    if world % mp:
        raise ConfigError(
            f"parallel.tp x pp x cp = {parallel.tp}x{parallel.pp}x{parallel.cp} = {mp} does not divide the {world} "
            f"{what}"
        )
    emp = parallel.tp * parallel.ep * parallel.pp  # expert model parallel: TP (= expert TP) x EP x PP
    if parallel.ep > 1 and world % emp:
        raise ConfigError(
            f"parallel.tp x ep x pp = {parallel.tp}x{parallel.ep}x{parallel.pp} = {emp} does not divide the {world} "
            f"{what} (megatron-core places each expert-parallel group inside the data-parallel ranks)"
        )
