"""TRL's GRPOTrainer as DAPO (``loss_type="dapo"``, ε 0.2/0.28, β = 0, fp32, no gradient checkpointing), timed per
generation round: ``python bench/trl_grpo_worker.py SPEC.json OUT.json`` (run by ``bench_vs_trl.py``).

SPEC: model_dir (HF checkpoint), tokenizer_dir, prompts (rendered prompt texts, in order), ground_truths, group_size,
prompts_per_step, updates, max_new_tokens, rounds, seed. One round = one generation batch of prompts_per_step × G
completions and ``updates`` optimizer steps, the shape ``dapo train`` runs with dynamic sampling off. TRL's own
profiling spans (generation, logprob passes, rewards) are summed per round by wrapping its ProfilingContext.
TRL is the optional ``[bench]`` extra; the package itself never imports it.
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from collections import defaultdict

warnings.filterwarnings("ignore")


def main(spec_path: str, out_path: str) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.extras import profiling

    from megatron_dapo.reward.math_dapo import compute_score

    spec = json.loads(open(spec_path).read())
    torch.manual_seed(spec["seed"])
    tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer_dir"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    rounds, per_step = spec["rounds"], spec["prompts_per_step"]
    prompts = spec["prompts"][: rounds * per_step]
    truths = spec["ground_truths"][: rounds * per_step]
    data = Dataset.from_dict({"prompt": prompts, "ground_truth": truths})

    def reward(completions, ground_truth, **_):
        return [compute_score(c, t)["score"] for c, t in zip(completions, ground_truth)]

    completions = per_step * spec["group_size"]
    config = GRPOConfig(
        output_dir=spec["out_dir"],
        use_cpu=True,
        bf16=False,
        fp16=False,
        seed=spec["seed"],
        learning_rate=1e-6,
        beta=0.0,
        loss_type="dapo",
        epsilon=0.2,
        epsilon_high=0.28,
        num_generations=spec["group_size"],
        per_device_train_batch_size=completions // spec["updates"],
        steps_per_generation=spec["updates"],
        gradient_accumulation_steps=1,
        num_iterations=1,
        max_completion_length=spec["max_new_tokens"],
        temperature=1.0,
        top_p=1.0,
        max_steps=rounds * spec["updates"],
        shuffle_dataset=False,
        gradient_checkpointing=False,
        logging_steps=10**9,
        save_strategy="no",
        report_to=[],
        dataloader_num_workers=0,
        disable_tqdm=True,
    )

    spans: dict[str, float] = defaultdict(float)
    original = profiling.ProfilingContext._log_metrics

    def record(self, duration):
        spans[self.name] += duration
        return original(self, duration)

    profiling.ProfilingContext._log_metrics = record

    step_end: list[float] = []
    span_at_step: list[dict] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            step_end.append(time.perf_counter())
            span_at_step.append(dict(spans))

    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=config, train_dataset=data, processing_class=tokenizer,
        callbacks=[Clock()],
    )  # fmt: skip
    start = time.perf_counter()
    trainer.train()
    u = spec["updates"]
    ends = [start] + step_end[u - 1 :: u]  # the end of each round (its last optimizer step)
    marks = [{}] + span_at_step[u - 1 :: u]
    out = []
    for k in range(1, len(ends)):
        delta = {n: marks[k].get(n, 0.0) - marks[k - 1].get(n, 0.0) for n in marks[k]}
        out.append({"seconds": ends[k] - ends[k - 1], "spans": delta, "samples": completions})
    with open(out_path, "w") as f:
        json.dump({"rounds": out}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
