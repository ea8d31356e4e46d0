"""MegatronActor: a megatron-core GPT policy that computes logprobs and takes DAPO train steps.

Every rank of the job constructs one actor with the same config and calls the same methods with the same batch
(the trainer broadcasts it); sequences are partitioned over data-parallel ranks here, balanced by tokens, and packed
into micro-batches by a token budget. Forward/backward go through megatron-core's pipeline schedules, so TP, PP and
DP work the same way; the loss uses the GLOBAL token denominator of the mini-batch (all micro-batches, all DP ranks).
"""

from __future__ import annotations

import datetime
import functools
import math
import sys
import time
from functools import partial

import torch
import torch.distributed as dist

from megatron_dapo.actor import checkpoint as ckpt
from megatron_dapo.actor import routes, shares
from megatron_dapo.actor.dist import init_distributed, seed_everything
from megatron_dapo.actor.gather import all_gather_small, dp_rank_members, route
from megatron_dapo.actor.logprobs import token_logprobs
from megatron_dapo.actor.micro_batches import micro_batch_budget, per_position_arrays
from megatron_dapo.actor.provider import DTYPES, build_model, describe_spec, model_position_ids, use_transformer_engine
from megatron_dapo.actor.step_metrics import StepTally, step_metrics
from megatron_dapo.actor.thd_cp import get_thd_batch_on_this_cp_rank
from megatron_dapo.algo.corrections import check_correction
from megatron_dapo.algo.loss import loss_denominator, policy_loss, sft_loss
from megatron_dapo.config.run_config import DapoConfig
from megatron_dapo.data.geometry import micro_batch_geometry
from megatron_dapo.data.packing import balance_across_dp, pack_sequences
from megatron_dapo.data.shared_prompt import plan_rows, prompt_groups, shared_prompt_batch
from megatron_dapo.models.arch import ArchConfig, load_arch, padded_vocab_size, routing_replay_enabled
from megatron_dapo.types import Sequence


def _passthrough_head(hidden, weight=None, runtime_gather_output=None):
    """Replaces ``GPTModel.output_layer.forward``: the model returns hidden states; logits are formed in chunks."""
    return hidden, None


def _sequence_parallel_head(hidden, weight=None, runtime_gather_output=None):
    """The passthrough under sequence parallelism: all-gather the sequence shards [s/TP, b, h] -> [s, b, h] the way
    megatron's output ColumnParallelLinear does before its GEMM (megatron-core 0.16.1 tensor_parallel/layers.py:478-484
    forward all-gather, :548-558 backward reduce-scatter; the op is layers.py:431-434). The backward reduce-scatter
    sums the vocab shards' partial gradients, so ``token_logprobs`` must not all-reduce them again."""
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    return gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True), None


class MegatronActor:
    def __init__(self, cfg: DapoConfig, arch: ArchConfig | None = None):
        from megatron.core import parallel_state
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )

        self.cfg = cfg
        self.arch = arch or load_arch(cfg.model.arch)
        p = cfg.parallel
        init_distributed(p, timeout_s=p.collective_timeout_s)
        seed_everything(cfg.train.seed)
        self.te = use_transformer_engine(cfg.model)
        if dist.get_rank() == 0:
            print(describe_spec(cfg.model), file=sys.stderr, flush=True)
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.first_stage = parallel_state.is_pipeline_first_stage()
        self.last_stage = parallel_state.is_pipeline_last_stage()
        self.padded_vocab = padded_vocab_size(self.arch.vocab_size, p.tp)
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        )
        # the host control group of the actor's own gathers: never the NCCL default group (actor/gather.py)
        self.gloo = None
        if dist.get_world_size() > 1:
            self.gloo = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=p.collective_timeout_s))
        self.dp_members = dp_rank_members(self.dp_rank, self.gloo)  # per DP rank, its global ranks
        self.distributed_optimizer = (
            torch.cuda.is_available() if p.distributed_optimizer is None else p.distributed_optimizer
        )

        if cfg.tis_possible:
            check_correction(cfg.algo.correction, p.cp)
        self.replay = routing_replay_enabled(cfg.rollout.routing_replay, self.arch)
        self.routed = self.arch.is_moe  # the engine's routes come with the samples: replayed, or only compared
        if self.replay:
            routes.check_replay(cfg)
        if self.routed:
            routes.clear_instances()
            self.replay_layers = routes.stage_moe_layers(self.arch, p.pp, self.pp_rank)
        chunks = build_model(self.arch, cfg.model, p, routing_replay=self.routed)
        self.lora_layers = []  # LoRA: the adapted layers; everything else frozen (actor/lora.py)
        if cfg.model.lora.rank:
            from megatron_dapo.actor.lora import apply_lora

            self.lora_layers = apply_lora(chunks, cfg.model.lora, p.sequence_parallel, cfg.train.seed)
        self.tf_config = chunks[0].config
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=self.distributed_optimizer
        )
        self.model = [DistributedDataParallel(self.tf_config, ddp_config, c) for c in chunks]
        self.geometry = micro_batch_geometry(
            self.te, tp=p.tp, cp=p.cp, sequence_parallel=p.sequence_parallel, fp8=bool(cfg.model.fp8)
        )
        # logprobs of the distribution the rollout samples from: softmax(logits / T) (greedy: T = 1)
        self.temperature = cfg.rollout.sampling.temperature or 1.0
        self.micro_batch_tokens, budget_note = micro_batch_budget(cfg, self.arch, self.geometry.layout, self.dp_size)
        if dist.get_rank() == 0:
            print(budget_note, file=sys.stderr, flush=True)
        head = _sequence_parallel_head if p.sequence_parallel else _passthrough_head
        for m in self.model:
            if m.module.post_process:
                m.module.output_layer.forward = head
        # Hooks megatron-core's schedules call (megatron's own training loop sets the same ones).
        self.tf_config.finalize_model_grads_func = finalize_model_grads
        self.tf_config.no_sync_func = self.model[0].no_sync
        self.optimizer, self.scheduler = self._build_optimizer()
        self.step = 0  # completed train steps
        self.skipped_updates = 0

    # ------------------------------------------------------------------------------------------------------------------
    def _build_optimizer(self):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        from megatron_dapo.actor.lr_schedule import make_scheduler

        t = self.cfg.train
        dtype = DTYPES[self.cfg.model.dtype]
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=t.lr,
            min_lr=t.min_lr if t.min_lr is not None else t.lr,
            weight_decay=t.weight_decay,
            adam_beta1=t.adam_beta1,
            adam_beta2=t.adam_beta2,
            adam_eps=t.adam_eps,
            clip_grad=t.grad_clip,
            bf16=dtype == torch.bfloat16,
            fp16=dtype == torch.float16,
            params_dtype=dtype,
            use_distributed_optimizer=self.distributed_optimizer,
        )
        optimizer = get_megatron_optimizer(opt_config, self.model)
        # warmup, then a decay over the run's steps or budgets (lr_schedule.py)
        return optimizer, make_scheduler(optimizer, t)

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def _head_weight(self, model) -> torch.Tensor:
        m = model.module
        return m.shared_embedding_or_output_weight() if m.share_embeddings_and_output_weights else m.output_layer.weight

    # ------------------------------------------------------------------------------------------------------------------
    # Micro-batches

    def _micro_batches(self, seqs: list[Sequence]) -> list[dict]:
        """This DP rank's micro-batches (equal count on every DP rank; empty ones carry a dummy token), shaped by
        ``self.geometry``: packed THD rows on Transformer Engine; on the local spec, right-padded rows in which a
        group's responses share one copy of their prompt where that is cheaper (``data/shared_prompt.py``)."""
        rows, per_rank = self.plan_micro_batches(seqs)
        return [self._micro_batch(seqs, [rows[k] for k in mb]) for mb in per_rank[self.dp_rank]]

    def plan_micro_batches(self, seqs: list[Sequence]) -> tuple[list[list[int]], list[list[list[int]]]]:
        """(rows: lists of indices into ``seqs``, per DP rank its micro-batches as lists of row indices): from the
        sequences' lengths and prompts only, the same on every rank (``actor/shares.py`` sends each DP rank what its
        micro-batches hold)."""
        prompt_lens = [s.prompt_len for s in seqs]
        if self.geometry.layout == "padded" and self.cfg.parallel.share_prompts:
            rows = plan_rows(
                prompt_lens,
                [s.response_len for s in seqs],
                prompt_groups([s.tokens[: s.prompt_len] for s in seqs]),
                self.micro_batch_tokens,
                *self._flop_weights,
            )
        else:
            rows = [[i] for i in range(len(seqs))]
        lengths = [prompt_lens[r[0]] + sum(seqs[i].response_len for i in r) for r in rows]
        per_rank, self.last_balance = balance_across_dp(lengths, self.dp_size, self.micro_batch_tokens, self.geometry)
        return rows, per_rank

    @functools.cached_property
    def _flop_weights(self) -> tuple[float, float]:
        """(FLOPs per token outside attention, FLOPs per attended (query, key) pair), per layer and TP rank."""
        from megatron_dapo.models.memory import active_gemm_params

        a, tp = self.arch, self.cfg.parallel.tp  # an MoE token goes through its top-k experts only
        return 2.0 * active_gemm_params(a) / a.num_layers / tp, 4.0 * a.num_attention_heads * a.head_dim / tp

    def _micro_batch(self, seqs: list[Sequence], rows: list[list[int]]) -> dict:
        """One micro-batch of ``rows`` (lists of indices into ``seqs``): the model inputs plus, for each response
        token (``sel_*``), the index of the hidden state that predicts it, its label, sequence, response offset, old
        and rollout logprobs, advantage and loss mask."""
        if any(getattr(seqs[i], "remote", False) for r in rows for i in r):
            raise RuntimeError(
                "a micro-batch of this DP rank holds a sequence of another rank's share (actor/shares.py)"
            )
        if self.geometry.layout == "padded":
            return self._shared_prompt_micro_batch(seqs, rows)
        indices = [i for r in rows for i in r]
        chosen = [seqs[i] for i in indices]
        layout = pack_sequences([s.tokens for s in chosen], self.geometry)
        # per POSITION: context parallelism slices every array with the tokens (megatron-core 0.16.1's THD split,
        # vendored in actor/thd_cp.py: 0.19 slices only tokens/labels/loss_mask/position_ids)
        per_position = per_position_arrays(chosen, indices, layout.offsets, layout.total_tokens)
        batch = {"tokens": layout.tokens, "position_ids": layout.position_ids}
        batch.update({k: v.view(layout.tokens.shape) for k, v in per_position.items()})
        cu_seqlens = layout.cu_seqlens.to(self.device)
        # the same tensor object when nothing is padded: TE then keeps its FlashAttention-2 backend available
        # (TE attention/dot_product_attention/dot_product_attention.py:2014-2026, pad_between_seqs)
        same = torch.equal(layout.cu_seqlens, layout.cu_seqlens_padded)
        cu_padded = cu_seqlens if same else layout.cu_seqlens_padded.to(self.device)
        batch, packed_seq_params = get_thd_batch_on_this_cp_rank(
            {k: v.to(self.device) for k, v in batch.items()}, cu_seqlens, cu_padded, torch.tensor([layout.max_seqlen])
        )
        mb = {"num_tokens": batch["tokens"].shape[1], "attention_mask": None, "packed_seq_params": packed_seq_params}
        mb.update({k: v.to(self.device) for k, v in batch.items()})
        keep = mb["valid"].reshape(-1)  # this rank's response-predicting positions
        for key in per_position:
            if key != "valid":
                mb["sel_" + key] = mb[key].reshape(-1)[keep]
        mb["sel_index"] = keep.nonzero().squeeze(-1)
        if self.routed and all(s.routes is not None for s in chosen):
            a = self.arch
            r, ok = routes.packed_routes(chosen, layout.offsets, layout.total_tokens, len(self.moe_all), a.moe_topk)
            self._attach_routes(mb, r, ok)
        return mb

    @property
    def moe_all(self) -> list[int]:
        return [layer for layer in range(self.arch.num_layers) if self.arch.is_moe_layer(layer)]

    def _attach_routes(self, mb: dict, r: torch.Tensor, ok: torch.Tensor) -> None:
        """The micro-batch's routes as its routers read them (``actor/routes.py``), and which tokens have one."""
        p = self.cfg.parallel
        sp = p.tp if p.sequence_parallel else 1
        mb["router_targets"] = [
            t.to(self.device) for t in routes.router_inputs(r, self.replay_layers, sp, self.tp_rank)
        ]
        flat_ok = ok.transpose(0, 1).reshape(-1)
        mb["routed"] = flat_ok.chunk(sp)[self.tp_rank] if sp > 1 else flat_ok
        mb["sel_routed"] = ok.reshape(-1).to(self.device)[mb["sel_index"]]

    def _shared_prompt_micro_batch(self, seqs: list[Sequence], rows: list[list[int]]) -> dict:
        b = shared_prompt_batch([s.tokens for s in seqs], [s.prompt_len for s in seqs], rows)
        order = [seqs[i] for r in rows for i in r]  # the targets' sequence order

        def per_target(field: str, default: float) -> torch.Tensor:
            parts = [
                getattr(s, field) if getattr(s, field) is not None else torch.full((s.response_len,), default)
                for s in order
            ]
            return torch.cat(parts).float() if parts else torch.zeros(0)

        sel = {
            "index": b.target_index,
            "labels": b.labels,
            "seq_id": b.target_seq,
            "resp_off": b.target_offset,
            "old_logprobs": per_target("old_logprobs", 0.0),
            "rollout_logprobs": per_target("rollout_logprobs", 0.0),
            "loss_mask": per_target("loss_mask", 1.0),
            "tis_mask": per_target("tis_mask", 0.0),
            "advantages": torch.cat([torch.full((s.response_len,), float(s.advantage)) for s in order])
            if order
            else torch.zeros(0),
        }
        pos = b.position_ids
        if bool((pos == pos[:1]).all()):  # the same positions in every row: one row of RoPE tables broadcasts
            pos = pos[:1]
        mb = {
            "num_tokens": b.total_tokens,
            "tokens": b.tokens.to(self.device),
            "position_ids": model_position_ids(pos, self.cfg.model).to(self.device),
            "attention_mask": b.attention_mask.to(self.device),
        }
        mb.update({"sel_" + k: v.to(self.device) for k, v in sel.items()})
        if self.routed and all(seqs[i].routes is not None for r in rows for i in r):
            r, ok = routes.padded_routes(
                seqs, [s.prompt_len for s in seqs], rows, b.tokens.shape[1], len(self.moe_all), self.arch.moe_topk
            )
            self._attach_routes(mb, r, ok)
        return mb

    def _run(self, micro_batches: list[dict], loss_fn, forward_only: bool) -> list[dict]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        # full recompute re-runs each layer's forward in the backward: the routers must replay there too
        recomputed = not forward_only and self.cfg.model.recompute == "full"

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            targets = mb.get("router_targets") if self.replay or mb.get("probe") else None
            with routes.replaying(targets, record=mb.get("record_routes", False), keep_for_backward=recomputed):
                out = model(
                    mb["tokens"],
                    mb["position_ids"],
                    mb["attention_mask"],
                    packed_seq_params=mb.get("packed_seq_params"),
                )
            if recomputed and targets is not None:
                routes.replay_in_backward(out)
            return out, partial(loss_fn, mb, model)

        try:
            return get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter(micro_batches),
                model=self.model,
                num_microbatches=len(micro_batches),
                seq_length=max(mb["num_tokens"] for mb in micro_batches),
                micro_batch_size=1,
                forward_only=forward_only,
            )
        finally:
            if self.routed:
                routes.clear_replay()

    def _token_logprobs(self, mb: dict, model, hidden: torch.Tensor, with_entropy: bool):
        # hidden: [b, s, h] on the last stage (the output layer is a passthrough; b = 1 for packed rows)
        h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, mb["sel_index"])
        return token_logprobs(
            h,
            self._head_weight(model),
            mb["sel_labels"],
            self.arch.vocab_size,
            chunk_tokens=self.cfg.parallel.logprob_chunk_tokens,
            with_entropy=with_entropy,
            grad_reduced=self.cfg.parallel.sequence_parallel,
            temperature=self.temperature,
        )

    # ------------------------------------------------------------------------------------------------------------------
    # Public API

    @torch.no_grad()
    def compute_logprobs(self, seqs: list[Sequence], with_entropy: bool = False, owner: list[int] | None = None):
        """Per-sequence logprobs of the response tokens ([R] fp32 each), and entropies if asked; on every rank, or
        with ``owner`` only where ``_per_sequence`` sends them (None elsewhere). Logprobs are of the sampling
        distribution, softmax(logits / T) at the rollout temperature T (engine.py)."""
        results = self.logprob_pass(seqs, with_entropy)
        lp_out, ent_out = self._per_sequence(results, seqs, owner, with_entropy=with_entropy)
        return (lp_out, ent_out) if with_entropy else lp_out

    @torch.no_grad()
    def logprob_pass(self, seqs: list[Sequence], with_entropy: bool) -> list[dict]:
        """The forward-only pass of ``compute_logprobs``: per micro-batch of this rank, its positions' logprobs
        (and entropies) on the last stage, before they are sent to the ranks that need them."""
        for m in self.model:
            m.eval()

        def loss_fn(mb, model, hidden):
            lp, ent = self._token_logprobs(mb, model, hidden, with_entropy)
            return hidden.new_zeros(()), {"logprobs": lp, "entropy": ent, "mb": mb}

        return self._run(self._micro_batches(seqs), loss_fn, forward_only=True)

    def _per_sequence(
        self, results: list[dict], seqs: list[Sequence], owner: list[int] | None = None, *, with_entropy: bool = True
    ) -> tuple[list, list]:
        """The per-position "logprobs" (and "entropy") of ``results`` as one [R] tensor per sequence, sent from the
        last stage of every DP (and CP) rank: with no ``owner``, to every rank; else sequence i to rank 0 and, where
        ``owner[i]`` >= 0, the ranks of DP rank ``owner[i]``; None on the other ranks."""
        parts = []  # (sequence, response offset, logprob, entropy) of this rank's positions
        if self.last_stage and self.tp_rank == 0:
            for res in results:
                mb, ent = res["mb"], res.get("entropy")
                parts.append(
                    (
                        mb["sel_seq_id"].cpu(),
                        mb["sel_resp_off"].cpu(),
                        res["logprobs"].detach().cpu(),
                        ent.cpu() if with_entropy else None,
                    )
                )
        if owner is None:
            keys, dests = [0] * len(seqs), [set(range(dist.get_world_size()))]
        else:
            keys = [d if d >= 0 else self.dp_size for d in owner]
            dests = [{0, *m} for m in self.dp_members] + [{0}]
        return route(parts, [s.response_len for s in seqs], keys, dests, with_entropy, self.gloo)

    def train_step(self, seqs: list[Sequence]) -> dict[str, float]:
        """One DAPO step: ``num_updates`` mini-batch updates over ``seqs`` (grouped by prompt, in order).

        π_old is the policy before the step. Sequences that come with ``old_logprobs`` use them; for the others they
        are computed here, before the first update — except for the first mini-batch (unless
        ``train.recompute_old_logprobs``): there π_old IS the current policy, so its training forward's detached
        logprobs are π_old exactly (ratio 1, as verl and TRL do) and no separate pass is needed. Afterwards every
        sequence holds the ``old_logprobs`` (and, where computed here, the ``entropy``) the step used."""
        minis, first_from_forward, missing_idx = self.step_plan(seqs)
        self.check_batch(seqs)
        tally = StepTally(time.perf_counter())
        missing = [seqs[i] for i in missing_idx]
        if missing:  # to rank 0 (metrics) and the DP rank that trains on each sequence, not to every rank
            owner = shares.train_owners(self, seqs, minis, first_from_forward)
            for s, lp, ent in zip(missing, *self.compute_logprobs(missing, True, [owner[i] for i in missing_idx])):
                if lp is not None:
                    s.old_logprobs, s.entropy = lp, ent
        tally.old_seconds, tally.old_pass_seqs = time.perf_counter() - tally.started, len(missing)
        for s in seqs[minis[0].start : minis[0].stop] if not first_from_forward else []:
            if s.old_logprobs is not None and s.old_logprobs.numel() != s.response_len:  # None: not this rank's
                raise ValueError(
                    f"train_step: old_logprobs has {s.old_logprobs.numel()} entries, the response "
                    f"{s.response_len} tokens"
                )
        for k, rng in enumerate(minis):
            self.update_mini_batch([seqs[i] for i in rng], tally, from_forward=first_from_forward and k == 0)
        return self.finish_step(tally)

    def train_streamed(self, next_mini, count: int) -> StepTally:
        """``train.stream_updates``: a step's ``count`` mini-batch updates, each started as soon as ``next_mini(k)``
        (every rank) returns its sequences, not when the whole batch is collected; ``finish_step`` then ends the step.
        π_old is the rollout's (``algo.old_logprobs: rollout``): no pass over the whole batch before the first
        update. Each mini-batch's loss and token denominator are its own, as in ``train_step``."""
        if self.cfg.algo.old_logprobs != "rollout":
            raise ValueError("train.stream_updates needs algo.old_logprobs = 'rollout' (no π_old pass over the batch)")
        tally = StepTally(time.perf_counter(), streamed=True)
        for k in range(count):
            mini = next_mini(k)
            self.check_batch(mini)
            t0 = time.perf_counter()
            self.update_mini_batch(mini, tally, from_forward=k == 0)
            tally.update_seconds += time.perf_counter() - t0
        return tally

    def check_batch(self, seqs: list[Sequence]) -> None:
        """What the updates read, checked before the first (the whole batch, or a streamed mini-batch on arrival)."""
        if self.replay:
            routes.check_routes(seqs, self.cfg)
        if self.cfg.tis_possible and self.cfg.algo.tis_cap and any(s.rollout_logprobs is None for s in seqs):
            raise ValueError("algo.tis is on but a sequence has no rollout_logprobs (the engine's logprobs)")
        if self.cfg.algo.old_logprobs == "rollout" and any(s.rollout_logprobs is None for s in seqs):
            raise ValueError("algo.old_logprobs = 'rollout' but a sequence has no rollout_logprobs (the engine's)")

    def update_mini_batch(self, mini: list[Sequence], tally: StepTally, from_forward: bool) -> None:
        """One optimizer update on ``mini`` (a DP rank's share whole, the rest as stubs); ``from_forward``: π_old is
        the current policy, taken from this forward (the step's first update)."""
        a = self.cfg.algo
        tis_cap = a.tis_cap if self.cfg.tis_possible else None  # tis_enabled: every token; else the tis_mask ones
        rollout_old = a.old_logprobs == "rollout"
        if tally.updates == 0:
            tally.replay_metrics = routes.routing_probe(self, mini) if self.routed else {}
        for m in self.model:
            m.train()
        all_mask = torch.cat(
            [s.loss_mask.float() if s.loss_mask is not None else torch.ones(s.response_len) for s in mini]
        )
        ids = torch.cat([torch.full((s.response_len,), j) for j, s in enumerate(mini)])
        denominator = loss_denominator(all_mask[None], a.loss_agg, seq_ids=ids[None]).item()
        mbs = self._micro_batches(mini)
        scale = len(mbs) * self.dp_size  # undo the schedule's 1/num_microbatches and DDP's 1/DP averaging
        for mb in mbs if self.replay and self.tp_rank == 0 else []:
            tally.covered[0] += int(mb["sel_routed"].sum()) if "sel_routed" in mb else 0
            tally.covered[1] += int(mb["sel_index"].numel())

        def loss_fn(mb, model, hidden):
            lp, ent = self._token_logprobs(mb, model, hidden, with_entropy=from_forward)
            old = lp.detach() if from_forward else mb["sel_old_logprobs"]
            if rollout_old:  # the PPO ratio against the rollout; the correction compares the policy with it
                old = mb["sel_rollout_logprobs"]
            loss, metrics = policy_loss(
                lp[None],
                old[None],
                mb["sel_advantages"][None],
                mb["sel_loss_mask"][None],
                eps_low=a.eps_low,
                eps_high=a.eps_high,
                clip_c=a.clip_c,
                agg=a.loss_agg,
                denominator=denominator,
                seq_ids=mb["sel_seq_id"][None],
                rollout_logprobs=mb["sel_rollout_logprobs"][None] if tis_cap else None,
                tis_cap=tis_cap,
                tis_mask=mb["sel_tis_mask"][None] if tis_cap and not self.cfg.tis_enabled else None,
                correction=a.correction,
                correction_bounds=tuple(a.correction_bounds),
                correction_reference=lp.detach()[None] if rollout_old and tis_cap else None,
            )
            out = {"loss": loss.detach(), **{k: v.detach() for k, v in metrics.items()}}
            if from_forward:
                out.update(logprobs=lp.detach(), entropy=ent, mb=mb)
            return loss * scale, out

        for m in self.model:
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        results = self._run(mbs, loss_fn, forward_only=False)
        if from_forward:  # π_old of a trained mini-batch: for rank 0's metrics only
            for s, lp, ent in zip(mini, *self._per_sequence(results, mini, [-1] * len(mini))):
                if lp is not None:
                    s.old_logprobs, s.entropy = lp, ent
        tally.grad_norms.append(self._optimizer_update())
        if self.last_stage and self.tp_rank == 0:  # TP ranks hold identical copies of the loss
            tally.parts += [{k: v for k, v in r.items() if k not in ("logprobs", "entropy", "mb")} for r in results]
            tally.losses.append(sum(float(r["loss"]) for r in results))
        tally.tokens += sum(mb["num_tokens"] for mb in mbs)
        tally.micro_batches += len(mbs)
        tally.updates += 1

    def finish_step(self, tally: StepTally) -> dict[str, float]:
        """After a step's updates: the LR schedule advances, and the step's metrics, the same on every rank."""
        self.scheduler.step(increment=1)
        self.step += 1
        seconds = tally.update_seconds if tally.streamed else time.perf_counter() - tally.started  # streamed: no waits
        metrics = step_metrics(self, tally.parts, tally.losses, tally.grad_norms, tally.tokens, seconds)
        metrics["time/old_logprobs_s"] = tally.old_seconds
        if tally.streamed:  # the updates' own time (time/rollout_s holds it too: they ran while groups came in)
            metrics["time/update_s"] = tally.update_seconds
        replay_metrics = tally.replay_metrics
        if self.replay:
            got = all_gather_small(tally.covered if self.pp_rank == 0 else [0, 0], self.gloo)
            replay_metrics["routing/coverage"] = sum(g[0] for g in got) / max(1, sum(g[1] for g in got))
        elif self.routed:
            routes.warn_low_agreement(replay_metrics)
        metrics.update(replay_metrics)
        metrics["train/old_logprob_pass_seqs"] = float(tally.old_pass_seqs)
        if self.arch.is_moe and self.cfg.model.moe_aux_loss_coeff:
            metrics.update(routes.moe_aux_losses(self.arch, tally.micro_batches))
        return metrics

    def step_plan(self, seqs: list[Sequence]) -> tuple[list[range], bool, list[int]]:
        """(the mini-batches, whether the first takes π_old from its training forward, the indices of the sequences
        whose π_old a separate pass computes first): ``actor/shares.py`` ``step_plan``."""
        return shares.step_plan(self, seqs)

    def supervised_step(self, seqs: list[Sequence], lr: float) -> dict[str, float]:
        """One supervised (NLL) update on the response tokens at learning rate ``lr`` (warm start); the RL LR schedule
        is neither used nor advanced."""
        for m in self.model:
            m.train()
        mask = torch.cat([s.loss_mask.float() if s.loss_mask is not None else torch.ones(s.response_len) for s in seqs])
        denominator = float(mask.sum())  # the tokens trained: a tool's output in the target is context only
        mbs = self._micro_batches(seqs)
        scale = len(mbs) * self.dp_size

        def loss_fn(mb, model, hidden):
            lp, _ = self._token_logprobs(mb, model, hidden, with_entropy=False)
            loss = sft_loss(lp, mb["sel_loss_mask"], denominator)
            return loss * scale, {"loss": loss.detach()}

        for m in self.model:
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        results = self._run(mbs, loss_fn, forward_only=False)
        grad_norm = self._optimizer_update()
        self.scheduler.step(increment=0)  # restore the RL learning rate
        local = sum(float(r["loss"]) for r in results) if self.last_stage and self.tp_rank == 0 else 0.0
        return {"sft/loss": sum(all_gather_small(local, self.gloo)), "sft/grad_norm": grad_norm}

    def reset_optimizer_state(self) -> None:
        """Forget Adam's moments (after the supervised warm start, so RL starts from fresh statistics)."""
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            opt.optimizer.state.clear()

    def _optimizer_update(self) -> float:
        """Clip and step unless the gradient is non-finite: then skip the update (weights untouched) and count it."""
        found_inf = self.optimizer.prepare_grads()
        grad_norm = float(self.optimizer.get_grad_norm())
        if found_inf or not math.isfinite(grad_norm):
            self.skipped_updates += 1
            self.optimizer.zero_grad()
            return grad_norm
        if self.cfg.train.grad_clip > 0:
            clip_by_total_norm(self.optimizer, self.cfg.train.grad_clip, grad_norm)
        self.optimizer.step_with_ready_grads()
        return grad_norm

    # ------------------------------------------------------------------------------------------------------------------
    # Checkpoints and weights

    def save(self, path, extra: dict | None = None) -> None:
        ckpt.save(self, path, extra or {})

    def load(self, path, load_optimizer: bool = True) -> dict:
        return ckpt.load(self, path, load_optimizer=load_optimizer)

    def named_parameters(self):
        """(megatron name, local shard) of this rank's model chunk(s)."""
        for m in self.model:
            yield from m.module.named_parameters()


def clip_by_total_norm(optimizer, max_norm: float, total_norm: float) -> None:
    """Scale the gradients so that their total norm (over every part of the optimizer) is at most ``max_norm``.

    An MoE model's optimizer is a ``ChainedOptimizer`` (expert and dense parameters reduce over different groups), and
    its inherited ``MegatronOptimizer.clip_grad_norm`` reads ``.optimizer``, which asserts a single part; this clips
    each part by the chain's total norm, as ``ChainedOptimizer.step`` does (megatron-core 0.16.1
    optimizer/optimizer.py, ``clip_grad_by_total_norm_fp32`` per chained optimizer)."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        params = part.get_parameters()
        if params:
            decoupled = getattr(part.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False)
            clip_grad_by_total_norm_fp32(params, max_norm=max_norm, total_norm=total_norm, use_decoupled_grad=decoupled)
