"""LoRA at TP 2 x PP 2 against one process (torchrun, gloo), issue "LoRA RL on megatron-core", evidence (a):

- with B = 0 (the start) the adapted model's logprobs are the base model's;
- two DAPO updates from the same start train only the adapters and give the same merged weights and logprobs at
  TP 2 x PP 2 as in one process (the adapters' TP splits, their gradients' reductions, the fused QKV / gate-up rows);
- the merged HF checkpoint, loaded into a model without LoRA, gives the adapted actor's logprobs (the merge: W + (α/r)
  B A for every target, through the bridge's own export);
- the actor's checkpoint at TP 2 x PP 2 resumes in one process with the same adapters;
- evidence (b): the adapters exported in PEFT's format, loaded by ``peft`` onto the HF base, give the actor's logprobs.
"""

import json
import sys
from pathlib import Path

import pytest
import torch

from megatron_dapo.bridge.convert_to_hf import megatron_to_hf
from megatron_dapo.bridge.convert import hf_to_megatron
from megatron_dapo.bridge.convert_lora import peft_to_megatron
from tests.helpers import run_torchrun

WORKER = Path(__file__).with_name("lora_worker.py")
pytestmark = [pytest.mark.dist, pytest.mark.timeout(900)]
LORA = ["model.lora.rank=4", "model.lora.alpha=8"]
TP2PP2 = ["parallel.tp=2", "parallel.pp=2"]


def _launch(d: Path, nproc: int, name: str, plan: list) -> None:
    path = d / f"plan_{name}.json"
    path.write_text(json.dumps([[sc, str(d / out), args] for sc, out, args in plan]))
    run_torchrun(nproc, WORKER, path, timeout=600)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One base for all (megatron initializes TP shards from their own seeds): a TP=1 model written as HF."""
    d = tmp_path_factory.mktemp("lora")
    base = [f"model.hf_init={d / 'base_hf'}"]
    _launch(d, 1, "init", [("logprobs", "base_tp1.pt", [f"hf={d / 'base_hf'}"])])
    _launch(d, 4, "four", [
        ("logprobs", "base_tp2pp2.pt", [*TP2PP2, *base]),
        ("logprobs", "zero_tp2pp2.pt", [*TP2PP2, *LORA, *base]),
        ("train", "train_tp2pp2.pt",
         [*TP2PP2, *LORA, *base, f"hf={d / 'merged_hf'}", f"save={d / 'ckpt'}", f"peft={d / 'peft'}"]),
    ])  # fmt: skip
    # dapo convert, both ways: the TP 2 x PP 2 checkpoint (adapters alone) to HF + PEFT, and the PEFT folder back
    megatron_to_hf(d / "ckpt", d / "converted_hf")
    peft_to_megatron(d / "base_hf", d / "peft", d / "from_peft")
    hf_to_megatron(d / "base_hf", d / "base_megatron")  # a base without adapters, as model.load of a LoRA run
    _launch(d, 1, "one", [
        ("train", "train_tp1.pt", [*LORA, *base]),
        ("logprobs", "merged_tp1.pt", [f"model.hf_init={d / 'merged_hf'}"]),
        ("logprobs", "resumed_tp1.pt", [*LORA, f"load={d / 'ckpt'}"]),
        ("logprobs", "from_peft_tp1.pt", [*LORA, f"load={d / 'from_peft'}"]),
        ("logprobs", "zero_on_megatron_base_tp1.pt", [*LORA, f"load={d / 'base_megatron'}"]),
    ])  # fmt: skip
    out = {p.stem: torch.load(p) for p in d.glob("*.pt")}
    out["dir"] = d
    return out


def _gap(a, b) -> float:
    assert len(a) == len(b)
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def test_with_b_zero_the_adapted_model_is_the_base(runs):
    assert _gap(runs["base_tp2pp2"]["logprobs"], runs["zero_tp2pp2"]["logprobs"]) < 1e-6  # (fp32 rounding)
    trainable = runs["zero_tp2pp2"]["trainable"]
    assert trainable and all(n.endswith((".lora_A", ".lora_B")) for n in trainable)
    assert runs["base_tp2pp2"]["trainable"] and not any(".lora_" in n for n in runs["base_tp2pp2"]["trainable"])


def test_only_the_adapters_train_and_both_of_them_move(runs):
    changed = runs["train_tp2pp2"]["changed"]
    assert changed and all(".lora_" in n for n in changed)
    assert any(n.endswith(".lora_A") for n in changed) and any(n.endswith(".lora_B") for n in changed)


def test_tp2_pp2_trains_the_same_adapters_as_one_process(runs):
    tp1, tp4 = runs["train_tp1"], runs["train_tp2pp2"]
    assert set(tp1["merged"]) == set(tp4["merged"])
    gaps = {n: float((tp1["merged"][n] - tp4["merged"][n]).abs().max()) for n in tp1["merged"]}
    assert max(gaps.values()) < 1e-5, sorted(gaps.items(), key=lambda kv: -kv[1])[:5]
    moved = [n for n in tp1["merged"] if "proj" in n and gaps[n] < 1e-5]
    assert moved  # (the names the targets map to are there)
    assert _gap(tp1["logprobs"], tp4["logprobs"]) < 1e-4


def test_the_merged_checkpoint_without_lora_gives_the_adapted_logprobs(runs):
    adapted = runs["train_tp2pp2"]["logprobs"]
    base = runs["base_tp2pp2"]["logprobs"]
    assert _gap(adapted, base) > 1e-3  # the adapters changed the model...
    assert _gap(adapted, runs["merged_tp1"]["logprobs"]) < 1e-4  # ...and the merged weights carry the change


def test_a_checkpoint_at_tp2_pp2_resumes_its_adapters_in_one_process(runs):
    """The adapters' TP-split halves are saved as split tensors (actor/lora.py sharded_state_dict) and resharded."""
    assert _gap(runs["train_tp2pp2"]["logprobs"], runs["resumed_tp1"]["logprobs"]) < 1e-5


def test_the_checkpoint_holds_the_adapters_alone_and_names_its_base(runs):
    d = runs["dir"]
    meta = json.loads((d / "ckpt" / "dapo_meta.json").read_text())
    assert meta["weights"] == "adapters" and meta["base"] == {"hf_init": str((d / "base_hf").resolve())}
    assert len(meta["base_fingerprint"]) == 2


def test_dapo_convert_merges_the_adapters_and_writes_the_peft_folder(runs):
    """megatron-to-hf of a checkpoint holding the adapters alone: the base read from its HF folder, each target merged
    (W + (α/r) B A, the fused QKV / gate-up rows split as the bridge splits the weight) equals the live actor's merged
    export; the PEFT folder beside it equals the actor's own PEFT export."""
    from safetensors.torch import load_file

    d = runs["dir"]
    merged = runs["train_tp2pp2"]["merged"]
    converted = {}
    for f in (d / "converted_hf").glob("*.safetensors"):
        converted.update(load_file(f))
    assert set(converted) == set(merged) - {"lm_head.weight"} or set(converted) == set(merged)
    gaps = {n: float((converted[n] - merged[n]).abs().max()) for n in converted}
    assert max(gaps.values()) < 1e-6, sorted(gaps.items(), key=lambda kv: -kv[1])[:3]
    ours, theirs = load_file(d / "converted_hf_adapter" / "adapter_model.safetensors"), load_file(d / "peft" / "adapter_model.safetensors")
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    cfg = json.loads((d / "converted_hf_adapter" / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["lora_alpha"]) == (4, 8.0)


def test_a_megatron_checkpoint_without_adapters_is_a_lora_runs_base(runs):
    """model.load of a checkpoint with no adapters (a full fine-tuning's, a converted base) into a LoRA model: the base
    loads, the adapters keep their start (B = 0), so the logprobs are the base's."""
    assert _gap(runs["base_tp1"]["logprobs"], runs["zero_on_megatron_base_tp1"]["logprobs"]) < 1e-5


def test_a_peft_adapter_converted_to_megatron_gives_the_actors_logprobs(runs):
    """hf-to-megatron --adapter: the PEFT folder on its HF base, loaded by the actor (model.load), is the trained actor."""
    assert _gap(runs["train_tp2pp2"]["logprobs"], runs["from_peft_tp1"]["logprobs"]) < 1e-5


def test_the_peft_adapter_on_the_hf_base_gives_the_actors_logprobs(runs):
    """Evidence (b): ``PeftModel.from_pretrained(base, adapter)`` in HF transformers, on the base the actor started
    from, reproduces the adapted actor's logprobs (the fused QKV and gate/up adapters split as PEFT expects)."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(WORKER.parent))
    from actor_worker import make_seqs

    d = runs["dir"]
    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(d / "base_hf"), d / "peft").eval()
    got = []
    with torch.no_grad():
        for s in make_seqs():
            logits = model(s.tokens[None]).logits[0].float()
            lp = torch.log_softmax(logits[:-1], -1).gather(1, s.tokens[1:, None])[:, 0]
            got.append(lp[s.prompt_len - 1 :])
    assert _gap(runs["train_tp2pp2"]["logprobs"], got) < 1e-4


def test_the_planner_counts_the_adapters_each_rank_holds(runs):
    from megatron_dapo.models.arch import load_arch
    from megatron_dapo.models.memory import lora_params

    arch = load_arch("tiny")
    assert runs["zero_tp2pp2"]["lora_params"] == lora_params(arch, 4, tp=2, pp=2, pp_rank=0)
    assert runs["train_tp1"]["lora_params"] == lora_params(arch, 4)
    assert runs["base_tp2pp2"]["lora_params"] == 0
