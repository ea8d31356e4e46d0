"""Worker for test_logprob_gather.py: `torchrun --nproc-per-node 2 tests/dist/logprob_gather_worker.py OUT_PREFIX`.

One DP=2 actor; torch.distributed's object gather and point-to-point receive are spied on. Every call of the actor's
per-sequence gather is checked against the all-gather-everything scatter it replaces (``reference``, run on a gloo
group of the worker's own). Each rank writes what it saw to OUT_PREFIX.<rank>.pt.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.dist.actor_worker import make_cfg, make_seqs  # noqa: E402

ALL_GATHER_OBJECT, IRECV = dist.all_gather_object, dist.irecv


def reference(actor, results, seqs, group):
    """The per-sequence logprobs and entropies every rank gets when every rank receives every rank's positions."""
    parts = []
    if actor.last_stage and actor.tp_rank == 0:
        for res in results:
            mb, lp = res["mb"], res["logprobs"].detach().cpu()
            ent = res["entropy"].cpu() if res.get("entropy") is not None else torch.zeros_like(lp)
            parts.append((mb["sel_seq_id"].cpu(), mb["sel_resp_off"].cpu(), lp, ent))
    lp_out = [torch.zeros(s.response_len) for s in seqs]
    ent_out = [torch.zeros(s.response_len) for s in seqs]
    gathered = [None] * dist.get_world_size()
    ALL_GATHER_OBJECT(gathered, parts, group=group)
    for rank_parts in gathered:
        for seq_id, off, lp, ent in rank_parts:
            for i in seq_id.unique().tolist():
                sel = seq_id == i
                lp_out[i][off[sel]] = lp[sel]
                ent_out[i][off[sel]] = ent[sel]
    return lp_out, ent_out


def main():
    from megatron_dapo.actor.actor import MegatronActor

    out = sys.argv[1]
    actor = MegatronActor(make_cfg())
    group = dist.new_group(backend="gloo")  # the reference's own
    seen = {"object_gathers": [], "irecv_bytes": 0, "checked": 0, "mismatched": [], "received": []}

    def spy_object(object_list, obj, group=None):
        seen["object_gathers"].append({"phase": seen.get("phase"), "default_group": group is None,
                                       "backend": str(dist.get_backend(group))})  # fmt: skip
        return ALL_GATHER_OBJECT(object_list, obj, group=group)

    def spy_irecv(tensor, *args, **kwargs):
        seen["irecv_bytes"] += tensor.numel() * tensor.element_size()
        return IRECV(tensor, *args, **kwargs)

    per_sequence = actor._per_sequence

    def checked(results, seqs, *args, **kwargs):
        before = seen["irecv_bytes"]
        lp, ent = per_sequence(results, seqs, *args, **kwargs)
        ref_lp, ref_ent = reference(actor, results, seqs, group)
        got = [i for i, x in enumerate(lp) if x is not None]
        own = sum(int(r["mb"]["sel_seq_id"].numel()) for r in results)  # TP = PP = 1: every rank computes
        seen["received"].append({"phase": seen.get("phase"), "indices": got, "n": len(seqs), "own_tokens": own,
                                 "total_tokens": sum(s.response_len for s in seqs),
                                 "irecv_bytes": seen["irecv_bytes"] - before})  # fmt: skip
        for i in got:  # bit for bit, where this rank receives a sequence
            seen["checked"] += 1
            same = torch.equal(lp[i], ref_lp[i]) and (ent[i] is None or torch.equal(ent[i], ref_ent[i]))
            if not same:
                seen["mismatched"].append(i)
        return lp, ent

    actor._per_sequence = checked
    dist.all_gather_object, dist.irecv = spy_object, spy_irecv
    try:
        seqs = make_seqs(group=2)
        seen["phase"] = "compute_logprobs"
        lp, ent = actor.compute_logprobs(seqs, with_entropy=True)
        seen["every_rank"] = all(x is not None for x in lp) and len(lp) == len(seqs)

        # what the π_old pass should deliver here: the later mini-batch's sequences this DP rank trains on
        minis, first_from_forward, missing = actor.step_plan(seqs)
        later = [i for k, rng in enumerate(minis) if k > 0 for i in rng]
        rows, per_rank = actor.plan_micro_batches([seqs[i] for i in later])
        seen["mine_later"] = sorted(later[j] for mb in per_rank[actor.dp_rank] for r in mb for j in rows[r])
        seen["missing"], seen["first_from_forward"] = missing, first_from_forward
        seen["phase"] = "train_step"
        actor.train_step(seqs)
        seen["held"] = [i for i, s in enumerate(seqs) if s.old_logprobs is not None]
        seen["n_seqs"] = len(seqs)
    finally:
        dist.all_gather_object, dist.irecv = ALL_GATHER_OBJECT, IRECV
    torch.save(seen, f"{out}.{dist.get_rank()}.pt")
    dist.barrier()


if __name__ == "__main__":
    main()
