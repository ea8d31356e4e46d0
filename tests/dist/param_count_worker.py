"""Build real megatron-core GPTModels (local spec) and record the parameters each rank holds.

    torchrun --nproc-per-node TP tests/dist/param_count_worker.py OUT.json ARCHS.json TP

ARCHS.json holds a list of ArchConfig dicts. For each, every pipeline stage of PP ∈ {1, 2, 4} (that divides the
layers) is built on its own (a model with num_layers = layers per stage, pre_process / post_process as for that
stage) and rank 0 writes {arch name: {"pp/rank": numel of one TP rank}} to OUT.json.
Used by tests/unit/test_plan.py (TP = 1) and tests/dist/test_plan_params_tp.py (TP = 2).
"""

import json
import sys

import torch.distributed as dist

from megatron_dapo.actor.cpu import apply_cpu_shims  # the project's one place for CPU shims

apply_cpu_shims()


def main(out: str, arch_json: str, tp: int) -> None:
    from megatron.core import parallel_state

    from megatron_dapo.models.arch import ArchConfig

    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    counts = {}
    for spec in json.loads(open(arch_json).read()):
        a = ArchConfig(**spec)
        counts[a.name] = count_stages(a, tp)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, counts)
    if dist.get_rank() == 0:
        assert all(g == counts for g in gathered), f"TP ranks hold different counts: {gathered}"
        with open(out, "w") as f:
            json.dump(counts, f)
    dist.destroy_process_group()


def count_stages(a, tp: int) -> dict:
    """Each PP stage built on its own with the actor's provider settings (a model of that stage's layers)."""
    import dataclasses

    from megatron.core.models.gpt import GPTModel

    from megatron_dapo.actor.provider import layer_spec, transformer_config
    from megatron_dapo.config.run_config import ModelConfig, ParallelConfig
    from megatron_dapo.models.arch import padded_vocab_size

    counts = {}
    for pp in (1, 2, 4):
        if a.num_layers % pp:
            continue
        stage_arch = dataclasses.replace(a, num_layers=a.num_layers // pp)
        cfg = transformer_config(stage_arch, ModelConfig(), ParallelConfig(tp=tp))
        for rank in range(pp):
            model = GPTModel(
                cfg,
                layer_spec(ModelConfig()),
                vocab_size=padded_vocab_size(a.vocab_size, tp),
                max_sequence_length=a.max_position_embeddings,
                pre_process=rank == 0,
                post_process=rank == pp - 1,
                share_embeddings_and_output_weights=a.tie_embeddings,
                position_embedding_type="rope",
            )
            counts[f"{pp}/{rank}"] = sum(p.numel() for p in model.parameters())
    return counts


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
