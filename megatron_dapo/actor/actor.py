"""MegatronActor: a megatron-core GPT policy that computes logprobs and takes DAPO train steps.

Every rank of the job constructs one actor with the same config and calls the same methods with the same batch
(the trainer broadcasts it); sequences are partitioned over data-parallel ranks here, balanced by tokens, and packed
into micro-batches by a token budget. Forward/backward go through megatron-core's pipeline schedules, so TP, PP and
DP work the same way; the loss uses the GLOBAL token denominator of the mini-batch (all micro-batches, all DP ranks).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from megatron_dapo.actor import checkpoint as ckpt
from megatron_dapo.actor.dist import init_distributed, seed_everything
from megatron_dapo.actor.logprobs import token_logprobs
from megatron_dapo.actor.provider import DTYPES, build_model, use_transformer_engine
from megatron_dapo.algo.loss import combine_loss_metrics, loss_denominator, policy_loss, sft_loss
from megatron_dapo.config import ArchConfig, DapoConfig, load_arch, padded_vocab_size
from megatron_dapo.data.packing import balance_across_dp, pack_sequences, split_mini_batches


@dataclass
class Sequence:
    """One prompt + response. Per-response-token fields have length ``len(tokens) - prompt_len``."""

    tokens: torch.Tensor  # [L] int64: prompt then response
    prompt_len: int
    advantage: float = 0.0
    old_logprobs: torch.Tensor | None = None  # [R] fp32 (recomputed by the actor before training)
    loss_mask: torch.Tensor | None = None  # [R] 1 = in the loss (overlong filtering zeroes truncated samples)

    @property
    def response_len(self) -> int:
        return int(self.tokens.numel()) - self.prompt_len


def _passthrough_head(hidden, weight=None, runtime_gather_output=None):
    """Replaces ``GPTModel.output_layer.forward``: the model returns hidden states; logits are formed in chunks."""
    return hidden, None


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
        init_distributed(p)
        seed_everything(cfg.train.seed)
        self.te = use_transformer_engine(cfg.model)
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
        self.distributed_optimizer = (
            torch.cuda.is_available() if p.distributed_optimizer is None else p.distributed_optimizer
        )

        chunks = build_model(self.arch, cfg.model, p)
        self.tf_config = chunks[0].config
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=self.distributed_optimizer
        )
        self.model = [DistributedDataParallel(self.tf_config, ddp_config, c) for c in chunks]
        for m in self.model:
            if m.module.post_process:
                m.module.output_layer.forward = _passthrough_head
        # Hooks megatron-core's schedules call (megatron's own training loop sets the same ones).
        self.tf_config.finalize_model_grads_func = finalize_model_grads
        self.tf_config.no_sync_func = self.model[0].no_sync
        self.optimizer, self.scheduler = self._build_optimizer()
        self.step = 0  # completed train steps
        self.skipped_updates = 0

    # ------------------------------------------------------------------------------------------------------------------
    def _build_optimizer(self):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

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
        # One scheduler step per train step (as verl's DAPO recipe counts warmup). Weight decay is excluded from norms
        # and biases (wd_mult = 0) only through the scheduler, so it is always used.
        total = max(self.cfg.train.steps, t.warmup_steps + 1)
        scheduler = OptimizerParamScheduler(
            optimizer,
            init_lr=0.0 if t.warmup_steps else t.lr,
            max_lr=t.lr,
            min_lr=t.min_lr if t.min_lr is not None else t.lr,
            lr_warmup_steps=t.warmup_steps,
            lr_decay_steps=total,
            lr_decay_style="constant" if t.min_lr is None else "cosine",
            start_wd=t.weight_decay,
            end_wd=t.weight_decay,
            wd_incr_steps=total,
            wd_incr_style="constant",
        )
        return optimizer, scheduler

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def _head_weight(self, model) -> torch.Tensor:
        m = model.module
        return m.shared_embedding_or_output_weight() if m.share_embeddings_and_output_weights else m.output_layer.weight

    # ------------------------------------------------------------------------------------------------------------------
    # Micro-batches

    def _micro_batches(self, seqs: list[Sequence]) -> list[dict]:
        """This DP rank's packed micro-batches (equal count on every DP rank; empty ones carry a dummy token)."""
        lengths = [int(s.tokens.numel()) for s in seqs]
        per_rank, self.last_balance = balance_across_dp(
            lengths, self.dp_size, self.cfg.parallel.max_tokens_per_micro_batch
        )
        return [self._micro_batch([seqs[i] for i in idx], idx) for idx in per_rank[self.dp_rank]]

    def _micro_batch(self, seqs: list[Sequence], indices: list[int]) -> dict:
        """One packed row plus per-POSITION arrays: position t carries the label t+1 of its sequence and, where that
        label is a response token, its old logprob, advantage, loss mask, sequence and response offset. Keeping every
        array per position lets context parallelism slice them all with the tokens (megatron-core's THD split)."""
        cp = self.cfg.parallel.cp
        packed = pack_sequences([s.tokens for s in seqs], seq_pad_multiple=2 * cp if cp > 1 else 1)
        total = packed.total_tokens
        labels = torch.zeros(total, dtype=torch.long)
        valid = torch.zeros(total, dtype=torch.bool)
        seq_id = torch.full((total,), -1, dtype=torch.long)
        resp_off = torch.zeros(total, dtype=torch.long)
        old, adv, mask = torch.zeros(total), torch.zeros(total), torch.zeros(total)
        for j, (s, off) in enumerate(zip(seqs, packed.cu_seqlens_padded.tolist())):
            r, start = s.response_len, off + s.prompt_len - 1  # position `start` predicts the first response token
            span = slice(start, start + r)
            labels[span] = s.tokens[s.prompt_len :]
            valid[span] = True
            seq_id[span] = indices[j]
            resp_off[span] = torch.arange(r)
            old[span] = s.old_logprobs if s.old_logprobs is not None else 0.0
            adv[span] = float(s.advantage)
            mask[span] = s.loss_mask.float() if s.loss_mask is not None else 1.0
        batch = {
            "tokens": packed.tokens,
            "position_ids": packed.position_ids,
            "labels": labels[None],
            "valid": valid[None],
            "seq_id": seq_id[None],
            "resp_off": resp_off[None],
            "old_logprobs": old[None],
            "advantages": adv[None],
            "loss_mask": mask[None],
        }
        mb = {"num_tokens": total}
        if self.te:  # TE: packed THD format; with CP each rank keeps its load-balanced chunks of every sequence
            from megatron.core.utils import get_thd_batch_on_this_cp_rank

            batch, mb["packed_seq_params"] = get_thd_batch_on_this_cp_rank(
                {k: v.to(self.device) for k, v in batch.items()},
                packed.cu_seqlens.to(self.device),
                packed.cu_seqlens_padded.to(self.device),
                torch.tensor([packed.max_seqlen]),
            )
            mb["attention_mask"] = None
            mb["num_tokens"] = batch["tokens"].shape[1]
        else:  # local spec: block-diagonal causal mask (RoPE is relative, so global positions give the same scores)
            mb["attention_mask"] = packed.attention_mask().to(self.device)
        mb.update({k: v.to(self.device) for k, v in batch.items()})
        keep = mb["valid"][0]
        # the loss inputs: this rank's response-predicting positions only
        for key in ("labels", "seq_id", "resp_off", "old_logprobs", "advantages", "loss_mask"):
            mb["sel_" + key] = mb[key][0][keep]
        mb["sel_index"] = keep.nonzero().squeeze(-1)
        return mb

    def _run(self, micro_batches: list[dict], loss_fn, forward_only: bool) -> list[dict]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            out = model(
                mb["tokens"], mb["position_ids"], mb["attention_mask"], packed_seq_params=mb.get("packed_seq_params")
            )
            return out, partial(loss_fn, mb, model)

        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(micro_batches),
            model=self.model,
            num_microbatches=len(micro_batches),
            seq_length=max(mb["num_tokens"] for mb in micro_batches),
            micro_batch_size=1,
            forward_only=forward_only,
        )

    def _token_logprobs(self, mb: dict, model, hidden: torch.Tensor, with_entropy: bool):
        # hidden: [1, T, h] on the last stage (the output layer is a passthrough)
        h = hidden[0].index_select(0, mb["sel_index"])
        return token_logprobs(
            h,
            self._head_weight(model),
            mb["sel_labels"],
            self.arch.vocab_size,
            chunk_tokens=self.cfg.parallel.logprob_chunk_tokens,
            with_entropy=with_entropy,
        )

    # ------------------------------------------------------------------------------------------------------------------
    # Public API

    @torch.no_grad()
    def compute_logprobs(self, seqs: list[Sequence], with_entropy: bool = False):
        """Per-sequence logprobs of the response tokens ([R] fp32 each), and entropies if asked; on every rank."""
        for m in self.model:
            m.eval()

        def loss_fn(mb, model, hidden):
            lp, ent = self._token_logprobs(mb, model, hidden, with_entropy)
            return hidden.new_zeros(()), {"logprobs": lp, "entropy": ent, "mb": mb}

        mbs = self._micro_batches(seqs)
        results = self._run(mbs, loss_fn, forward_only=True)
        parts = []  # (sequence, response offset, logprob, entropy) of this rank's positions
        if self.last_stage and self.tp_rank == 0:
            for res in results:
                mb = res["mb"]
                ent = res["entropy"].cpu() if with_entropy else torch.zeros_like(res["logprobs"])
                parts.append((mb["sel_seq_id"].cpu(), mb["sel_resp_off"].cpu(), res["logprobs"].cpu(), ent))
        lp_out = [torch.zeros(s.response_len) for s in seqs]
        ent_out = [torch.zeros(s.response_len) for s in seqs]
        gathered = [parts]
        if dist.get_world_size() > 1:  # from the last stage of every DP (and CP) rank to everyone
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, parts)
        for rank_parts in gathered:
            for seq_id, off, lp, ent in rank_parts:
                for i in seq_id.unique().tolist():
                    sel = seq_id == i
                    lp_out[i][off[sel]] = lp[sel]
                    ent_out[i][off[sel]] = ent[sel]
        return (lp_out, ent_out) if with_entropy else lp_out

    def train_step(self, seqs: list[Sequence]) -> dict[str, float]:
        """One DAPO step: ``num_updates`` mini-batch updates over ``seqs`` (grouped by prompt, in order)."""
        a = self.cfg.algo
        num_updates = self.cfg.num_updates
        for s in seqs:
            if s.old_logprobs is None or s.old_logprobs.numel() != s.response_len:
                raise ValueError("train_step: every Sequence needs old_logprobs of its response (compute_logprobs)")
        t0 = time.perf_counter()
        for m in self.model:
            m.train()
        parts, losses, grad_norms, tokens = [], [], [], 0
        for rng in split_mini_batches(len(seqs), num_updates):
            mini = [seqs[i] for i in rng]
            all_mask = torch.cat(
                [s.loss_mask.float() if s.loss_mask is not None else torch.ones(s.response_len) for s in mini]
            )
            ids = torch.cat([torch.full((s.response_len,), j) for j, s in enumerate(mini)])
            denominator = loss_denominator(all_mask[None], a.loss_agg, seq_ids=ids[None]).item()
            mbs = self._micro_batches(mini)
            scale = len(mbs) * self.dp_size  # undo the schedule's 1/num_microbatches and DDP's 1/DP averaging

            def loss_fn(mb, model, hidden, denominator=denominator, scale=scale):
                lp, _ = self._token_logprobs(mb, model, hidden, with_entropy=False)
                loss, metrics = policy_loss(
                    lp[None],
                    mb["sel_old_logprobs"][None],
                    mb["sel_advantages"][None],
                    mb["sel_loss_mask"][None],
                    eps_low=a.eps_low,
                    eps_high=a.eps_high,
                    clip_c=a.clip_c,
                    agg=a.loss_agg,
                    denominator=denominator,
                    seq_ids=mb["sel_seq_id"][None],
                )
                return loss * scale, {"loss": loss.detach(), **{k: v.detach() for k, v in metrics.items()}}

            for m in self.model:
                m.zero_grad_buffer()
            self.optimizer.zero_grad()
            results = self._run(mbs, loss_fn, forward_only=False)
            grad_norm = self._optimizer_update()
            grad_norms.append(grad_norm)
            if self.last_stage and self.tp_rank == 0:  # TP ranks hold identical copies of the loss
                parts += results
                losses.append(sum(float(r["loss"]) for r in results))
            tokens += sum(mb["num_tokens"] for mb in mbs)
        self.scheduler.step(increment=1)
        self.step += 1
        return self._step_metrics(parts, losses, grad_norms, tokens, time.perf_counter() - t0)

    def supervised_step(self, seqs: list[Sequence], lr: float) -> dict[str, float]:
        """One supervised (NLL) update on the response tokens at learning rate ``lr`` (warm start); the RL LR schedule
        is neither used nor advanced."""
        for m in self.model:
            m.train()
        mask = torch.cat([torch.ones(s.response_len) for s in seqs])
        denominator = float(mask.sum())
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
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
        return {"sft/loss": sum(gathered), "sft/grad_norm": grad_norm}

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
            self.optimizer.clip_grad_norm(self.cfg.train.grad_clip)
        self.optimizer.step_with_ready_grads()
        return grad_norm

    def _step_metrics(self, parts, losses, grad_norms, tokens, seconds) -> dict[str, float]:
        keys = (
            "num_tokens",
            "clip_low_tokens",
            "clip_high_tokens",
            "clip_dual_tokens",
            "ppo_kl_sum",
            "ratio_sum",
            "ratio_max",
            "ratio_min",
        )
        local = [{k: r[k].cpu() for k in keys} for r in parts]
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (local, sum(losses), tokens))
        all_parts = [p for g in gathered for p in g[0]]
        m = combine_loss_metrics(all_parts) if all_parts else {}
        # loss: sum over ranks of the local sums of per-micro-batch losses, averaged over the updates
        loss = sum(g[1] for g in gathered if g) / self.cfg.num_updates
        total_tokens = sum(g[2] for g in gathered) / max(1, self.cfg.parallel.tp * self.cfg.parallel.pp)
        return {
            "train/loss": loss,
            "train/clip_frac_low": float(m.get("clip_frac_low", 0.0)),
            "train/clip_frac_high": float(m.get("clip_frac_high", 0.0)),
            "train/clip_frac_dual": float(m.get("clip_frac_dual", 0.0)),
            "train/ppo_kl": float(m.get("ppo_kl", 0.0)),
            "train/ratio_mean": float(m.get("ratio_mean", 1.0)),
            "train/ratio_max": float(m.get("ratio_max", 1.0)),
            "train/ratio_min": float(m.get("ratio_min", 1.0)),
            "train/grad_norm": sum(grad_norms) / len(grad_norms),
            "train/lr": self.lr,
            "train/skipped_updates": float(self.skipped_updates),
            "perf/tokens_per_s": total_tokens / seconds if seconds > 0 else 0.0,
            "perf/packing_efficiency": 1.0 / (1.0 + self.last_balance.padding_waste),
            "perf/dp_imbalance": self.last_balance.imbalance,
        }

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
