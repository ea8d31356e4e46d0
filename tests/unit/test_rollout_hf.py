"""HFEngine: batched KV-cache sampling checked against transformers' own greedy generate and a teacher-forced forward."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_dapo.engines.hf import HFEngine, filter_logits
from megatron_dapo.models.arch import ArchConfig
from megatron_dapo.models.hf_config import hf_from_arch
from megatron_dapo.types import GenRequest, RolloutError, SamplingParams, TokenizerInfo, WeightSyncError

pytestmark = pytest.mark.timeout(300)

VOCAB = 48
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13, 14, 15]]  # mixed lengths -> left padding


def make_arch(family: str = "qwen2", tie: bool = False) -> ArchConfig:
    return ArchConfig(
        name=f"test-{family}",
        family=family,
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=128,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        rope_theta=10000.0,
        qkv_bias=family == "qwen2",
        tie_embeddings=tie,
    )


def random_weights(engine: HFEngine, seed: int = 0) -> dict[str, torch.Tensor]:
    """Weights with a non-degenerate next-token distribution (the default init is nearly uniform)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in engine.weight_names():
        shape = tuple(engine.state_tensor(name).shape)
        if name.endswith("norm.weight"):
            out[name] = 1 + 0.1 * torch.randn(shape, generator=g)
        elif name.endswith("bias"):
            out[name] = 0.1 * torch.randn(shape, generator=g)
        elif "embed" in name:
            out[name] = torch.randn(shape, generator=g)
        else:
            out[name] = torch.randn(shape, generator=g) / shape[-1] ** 0.5
    return out


def make_engine(tok=None, family="qwen2", tie=False, seed=0, **kw) -> tuple[HFEngine, dict]:
    engine = HFEngine(make_arch(family, tie), tok or TokenizerInfo((), 0), **kw)
    weights = random_weights(engine, seed)
    engine.update_weights([list(weights.items())], version=1)
    return engine, weights


def teacher_forced_logprobs(model, prompt: list[int], response: list[int], temperature: float = 1.0) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
    lp = torch.log_softmax(logits / temperature, dim=-1)[len(prompt) - 1 : -1]
    return lp.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


@pytest.fixture(scope="module")
def engine():
    return make_engine()[0]


def test_greedy_equals_transformers_generate(engine):
    out = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=12))
    assert len(out) == len(PROMPTS)
    for p, s in zip(PROMPTS, out):
        ref = engine.model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=12, pad_token_id=0)
        assert s.response_ids == ref[0, len(p) :].tolist(), f"prompt {p}"
        assert s.finish_reason == "length" and s.weight_version == 1 and s.prompt_ids == p
    assert len({tuple(s.response_ids) for s in out}) == len(PROMPTS), "degenerate model: the test would prove little"


def test_logprobs_are_of_the_sampling_temperature_before_truncation(engine):
    sp = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_new_tokens=10, seed=5)
    out = engine.generate(PROMPTS, sp, n=3)
    assert [(s.prompt_index, s.sample_index) for s in out] == [(p, j) for p in range(4) for j in range(3)]
    for s in out:
        ref = teacher_forced_logprobs(engine.model, s.prompt_ids, s.response_ids, temperature=0.8)
        torch.testing.assert_close(torch.tensor(s.logprobs), ref, atol=1e-5, rtol=0)
        untempered = teacher_forced_logprobs(engine.model, s.prompt_ids, s.response_ids)
        assert (torch.tensor(s.logprobs) - untempered).abs().max() > 1e-3  # T = 0.8 is not T = 1
    for s in engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=6), n=1):  # greedy: T = 1
        ref = teacher_forced_logprobs(engine.model, s.prompt_ids, s.response_ids)
        torch.testing.assert_close(torch.tensor(s.logprobs), ref, atol=1e-5, rtol=0)


def test_seeds_are_reproducible_and_batch_independent(engine):
    sp = SamplingParams(temperature=1.0, max_new_tokens=8, seed=42)
    a = engine.generate(PROMPTS, sp, n=4)
    b = engine.generate(PROMPTS, sp, n=4)
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    assert len({tuple(s.response_ids) for s in a[:4]}) > 1, "samples of a group must differ"
    small = HFEngine(engine.arch, engine.tokenizer, model=engine.model, max_batch=1)  # one row per forward
    assert [s.response_ids for s in small.generate(PROMPTS, sp, n=4)] == [s.response_ids for s in a]
    other = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=8, seed=43), n=4)
    assert [s.response_ids for s in other] != [s.response_ids for s in a]


def test_a_resumed_request_draws_what_the_uninterrupted_sample_drew(engine):
    """GenRequest.offset: a sample cut after k tokens and resumed (prompt + its k tokens, the rest of the budget, the
    same seed) continues its random stream, so on unchanged weights it ends as if never cut (the streaming schedule's
    kill test relies on it); without the offset the continuation replays the first draws."""
    sp = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=12, seed=7)
    whole = [GenRequest(list(p), 12, seed=100 + i) for i, p in enumerate(PROMPTS)]
    full = {s.prompt_index: s for s in engine.generate_requests(whole, sp)}
    assert all(len(s.response_ids) == 12 for s in full.values())
    for cut in (1, 5, 11):
        rest = [GenRequest(list(p) + full[i].response_ids[:cut], 12 - cut, seed=100 + i, offset=cut)
                for i, p in enumerate(PROMPTS)]  # fmt: skip
        for s in engine.generate_requests(rest, sp):
            assert s.response_ids == full[s.prompt_index].response_ids[cut:], (cut, s.prompt_index)
            torch.testing.assert_close(s.logprobs, full[s.prompt_index].logprobs[cut:], atol=1e-5, rtol=0)
    replay = [GenRequest(list(p) + full[i].response_ids[:5], 7, seed=100 + i) for i, p in enumerate(PROMPTS)]
    differ = [s.response_ids != full[s.prompt_index].response_ids[5:] for s in engine.generate_requests(replay, sp)]
    assert any(differ), "without the offset the continuation should differ: the test would prove nothing"


def test_top_k_1_and_tiny_top_p_are_greedy(engine):
    greedy = [s.response_ids for s in engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=10))]
    top1 = engine.generate(PROMPTS, SamplingParams(temperature=1.0, top_k=1, max_new_tokens=10, seed=1))
    nucleus = engine.generate(PROMPTS, SamplingParams(temperature=1.5, top_p=1e-6, max_new_tokens=10, seed=2))
    assert [s.response_ids for s in top1] == greedy
    assert [s.response_ids for s in nucleus] == greedy


def _first_token_probs(engine, prompt, temperature=1.0):
    with torch.no_grad():
        logits = engine.model(torch.tensor([prompt])).logits[0, -1].double()
    return torch.softmax(logits / temperature, dim=-1)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 1.0), (0.7, 5, 1.0), (1.0, -1, 0.6)])
def test_sampled_frequencies_match_the_filtered_distribution(temperature, top_k, top_p):
    engine, _ = make_engine(max_batch=4000)
    prompt, n = [5, 6, 7], 4000
    sp = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=1, seed=3)
    tokens = torch.tensor([s.response_ids[0] for s in engine.generate([prompt], sp, n=n)])
    p = _first_token_probs(engine, prompt, temperature)
    order = torch.argsort(p, descending=True)  # reference filter, written independently of filter_logits
    keep = torch.zeros_like(p, dtype=torch.bool)
    mass = 0.0
    for rank, tok in enumerate(order.tolist()):
        if (top_k > 0 and rank >= top_k) or (top_p < 1 and mass >= top_p):
            break
        keep[tok] = True
        mass += float(p[tok])
    q = torch.where(keep, p, torch.zeros_like(p))
    q /= q.sum()
    freq = torch.bincount(tokens, minlength=VOCAB).double() / n
    assert not (freq[~keep] > 0).any(), "sampled a token outside the top-k / top-p set"
    tv = 0.5 * (freq - q).abs().sum().item()
    assert tv < 0.06, f"total variation {tv:.3f} between sampled and expected frequencies"


def test_filter_logits_keeps_the_nucleus():
    x = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isfinite(filter_logits(x, -1, 0.79)).tolist() == [[True, True, False, False]]
    assert torch.isfinite(filter_logits(x, -1, 0.81)).tolist() == [[True, True, True, False]]
    assert torch.isfinite(filter_logits(x, 3, 1.0)).tolist() == [[True, True, True, False]]


def test_stop_tokens_and_eos_end_samples(engine):
    sp = SamplingParams(temperature=0, max_new_tokens=12)
    greedy = engine.generate(PROMPTS, sp)
    resp = greedy[0].response_ids
    i = next(k for k in range(2, len(resp)) if resp[k] not in resp[:k])
    stop_tok = resp[i]
    out = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=(stop_tok,)))
    assert out[0].response_ids == resp[: i + 1] and out[0].finish_reason == "stop"  # the stop token is kept
    assert len(out[0].logprobs) == i + 1
    for g, s in zip(greedy[1:], out[1:]):
        expect = g.response_ids[: g.response_ids.index(stop_tok) + 1] if stop_tok in g.response_ids else g.response_ids
        assert s.response_ids == expect
        assert s.finish_reason == ("stop" if stop_tok in g.response_ids else "length")
    eos_engine = HFEngine(
        engine.arch, TokenizerInfo((stop_tok,), 0, decode=lambda ids: ",".join(map(str, ids))), model=engine.model
    )
    e = eos_engine.generate(PROMPTS[:1], sp)[0]
    assert (
        e.response_ids == resp[: i + 1] and e.finish_reason == "stop" and e.text == ",".join(map(str, e.response_ids))
    )


def test_abort_stops_the_stream(engine):
    small = HFEngine(engine.arch, engine.tokenizer, model=engine.model, max_batch=2)
    got = []
    for group in small.generate_stream(PROMPTS * 2, SamplingParams(max_new_tokens=4, seed=0), n=1):
        got.append(group)
        small.abort()
    assert len(got) == 2, "after abort only the already-finished micro-batch is delivered"
    assert len(small.generate(PROMPTS, SamplingParams(max_new_tokens=2))) == 4, "a new call runs normally"


def test_update_weights_equals_from_pretrained(tmp_path):
    from safetensors.torch import save_file

    for family, tie in (("qwen2", True), ("llama", False)):
        engine, weights = make_engine(family=family, tie=tie, seed=7)
        d = tmp_path / family
        d.mkdir()
        save_file({k: v.contiguous() for k, v in weights.items()}, str(d / "model.safetensors"))
        (d / "config.json").write_text(json.dumps(hf_from_arch(engine.arch)))
        fresh = HFEngine.from_pretrained(d, engine.tokenizer)
        assert fresh.arch.family == family and fresh.tied == tie
        sp = SamplingParams(temperature=1.0, max_new_tokens=8, seed=9)
        a, b = engine.generate(PROMPTS, sp, n=2), fresh.generate(PROMPTS, sp, n=2)
        assert [s.response_ids for s in a] == [s.response_ids for s in b]
        torch.testing.assert_close([s.logprobs for s in a], [s.logprobs for s in b], atol=1e-6, rtol=0)


def test_update_weights_is_strict():
    engine, weights = make_engine(tie=True)
    items = list(weights.items())
    with pytest.raises(WeightSyncError, match="model.layers.9.mlp.up_proj.weight"):
        engine.update_weights([items + [("model.layers.9.mlp.up_proj.weight", torch.zeros(2))]], 2)
    assert engine.weight_version == -1, "a failed update leaves the engine marked dirty"
    name, t = items[3]
    with pytest.raises(WeightSyncError, match=rf"{name}.*shape"):
        engine.update_weights([[(name, t.t().contiguous() if t.dim() == 2 else t[:-1])]], 2)
    with pytest.raises(WeightSyncError, match=r"missing.*model.norm.weight"):
        engine.update_weights([[(n, v) for n, v in items if n != "model.norm.weight"]], 2)
    engine.update_weights([items, [("lm_head.weight", weights["model.embed_tokens.weight"])]], 3)  # tied: accepted
    assert engine.weight_version == 3
    with pytest.raises(WeightSyncError, match="lm_head.weight"):
        engine.update_weights([items, [("lm_head.weight", torch.zeros(VOCAB, 64))]], 4)


def test_bad_prompts_are_named(engine):
    with pytest.raises(RolloutError, match="prompt 1 is empty"):
        engine.generate([[1], []], SamplingParams())
    with pytest.raises(RolloutError, match=r"prompt 0: token ids must be in \[0, 48\)"):
        engine.generate([[48]], SamplingParams())
