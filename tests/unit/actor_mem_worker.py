"""Peak RSS of MegatronActor train steps at one shape: ``python actor_mem_worker.py SPEC_JSON`` prints JSON.

With ``"saved": true`` in the spec it prints instead the bytes per token that autograd saves for the backward pass in
ONE layer of the model (the forward of a 2-layer model less that of a 1-layer one, parameters excluded, each storage
counted once): what ``memory.local_activation_bytes_per_token`` counts.

SPEC_JSON: {"arch": {ArchConfig fields}, "rows": B, "len": L, "prompt": P, "dtype": "fp32", "recompute": null,
"chunk": 1024}. The micro-batch budget is set to B·L, so the step runs one padded micro-batch of B rows × L tokens
(random, distinct prompts: nothing is shared). Measured, as ``logprob_mem_worker.py`` does (``clear_refs`` 5, then
VmHWM): ``base`` the resident size after the imports and ``init_distributed`` (before the actor), ``built`` after the
actor is constructed, and ``peak`` the high-water mark of the second train step (the first allocates Adam's states,
which the second holds throughout, as every later step of a run does).
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from logprob_mem_worker import _reset_high_water_mark, _Sampler, _status_kb  # noqa: E402


def _config(spec: dict):
    from megatron_dapo.config.run_config import load_config

    rows, length, prompt = spec["rows"], spec["len"], spec["prompt"]
    overrides = [
        f"model.dtype={spec.get('dtype', 'fp32')}",
        f"parallel.max_tokens_per_micro_batch={rows * length}",
        f"parallel.logprob_chunk_tokens={spec.get('chunk', 1024)}",
        f"data.max_prompt_len={prompt}",
        f"rollout.sampling.max_new_tokens={length - prompt}",
        "train.batch_prompts=1",  # one update per step (the actor does not count sequences per prompt)
        "train.mini_batch_prompts=1",
        "parallel.share_prompts=false",  # one row per sequence: the rows are exactly B × L
    ]
    if spec.get("recompute"):
        overrides.append(f"model.recompute={spec['recompute']}")
    return load_config("demo_cpu", overrides)


def _sequences(spec: dict, vocab: int) -> list:
    from megatron_dapo.types import Sequence

    g = torch.Generator().manual_seed(0)
    return [
        Sequence(torch.randint(0, vocab, (spec["len"],), generator=g), prompt_len=spec["prompt"],
                 advantage=float(torch.randn(1, generator=g)))
        for _ in range(spec["rows"])
    ]  # fmt: skip


def saved_bytes_per_layer(spec: dict) -> float:
    import dataclasses

    from megatron_dapo.actor.actor import MegatronActor
    from megatron_dapo.models.arch import ArchConfig

    cfg, per_token = _config(spec), []
    for layers in (1, 2):
        arch = dataclasses.replace(ArchConfig(**spec["arch"]), num_layers=layers)
        actor = MegatronActor(cfg, arch)
        (mb,) = actor._micro_batches(_sequences(spec, arch.vocab_size))
        model, seen = actor.model[0], {}
        model.train()

        def pack(t, seen=seen):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(mb["tokens"], mb["position_ids"], mb["attention_mask"])
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        per_token.append(sum(n for ptr, n in seen.items() if ptr not in params) / (spec["rows"] * spec["len"]))
    return per_token[1] - per_token[0]


def main(spec: dict) -> None:
    from megatron_dapo.actor.actor import MegatronActor
    from megatron_dapo.actor.dist import init_distributed
    from megatron_dapo.models.arch import ArchConfig

    torch.set_num_threads(1)
    rows, length = spec["rows"], spec["len"]
    if spec.get("saved"):
        print(json.dumps({"saved_bytes_per_layer_token": saved_bytes_per_layer(spec)}))
        return
    cfg = _config(spec)
    arch = ArchConfig(**spec["arch"])
    init_distributed(cfg.parallel)
    seqs = _sequences(spec, arch.vocab_size)
    base = _status_kb("VmRSS")
    actor = MegatronActor(cfg, arch)
    built = _status_kb("VmRSS")
    assert actor.micro_batch_tokens == rows * length
    assert len(actor._micro_batches(seqs)) == 1, "the shape must be one micro-batch"
    actor.train_step(seqs)
    for s in seqs:
        s.old_logprobs = None
    stepped = _status_kb("VmRSS")
    exact = _reset_high_water_mark()
    sampler = None if exact else _Sampler()
    if sampler:
        sampler.start()
    actor.train_step(seqs)
    if sampler:
        sampler.done.set()
        sampler.join()
    peak = _status_kb("VmHWM") if exact else sampler.peak_kb
    mib = 1 / 1024
    print(json.dumps({"base_mib": base * mib, "built_mib": (built - base) * mib, "stepped_mib": (stepped - base) * mib,
                      "peak_mib": (peak - base) * mib, "exact": exact}))  # fmt: skip


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
