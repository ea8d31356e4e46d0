"""SGLang's share of a GPU (megatron_dapo/engines/sglang/memory.py) against SGLang 0.5.23's own code: its functions,
called in a child process with a mocked GPU (tests/unit/sglang_memory_worker.py), must give what our formulas give,
and the lines our docstrings cite must still say what we read there. Without sglang these skip, unless
DAPO_REQUIRE_SGLANG=1 (``make test``): then they fail."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dapo.engines.sglang import memory as sm
from megatron_dapo.engines.sglang.memory import GiB, MiB
from megatron_dapo.models import gpus
from megatron_dapo.models.arch import load_arch
from megatron_dapo.models.hf_config import hf_from_arch
from tests.helpers import REPO, skip_unless_required

H100 = gpus.GPU_MEMORY_MIB["h100-80gb"]
H200 = gpus.GPU_MEMORY_MIB["h200-141gb"]
QWEN32 = load_arch("qwen2.5-32b")


# ----------------------------------------------------------------------------------------------------------------------
# Without sglang


def test_gpu_memory_of_a_kind():
    """An "80 GB" H100 exposes 81,559 MiB = 85,520,809,984 B = 79.65 GiB, not 80; the planner's GiB come from here."""
    assert gpus.gpu_total_bytes("h100-80gb") == 85_520_809_984
    assert gpus.gpu_total_gib(80) == pytest.approx(79.647, abs=1e-3)
    assert gpus.gpu_total_gib(141) == pytest.approx(140.401, abs=1e-3)
    assert gpus.gpu_total_gib(48) == 48.0 and gpus.gpu_total_gib(79.5) == 79.5  # unknown sizes: as given
    with pytest.raises(KeyError, match="h100-80gb"):
        gpus.gpu_total_bytes("h100")


def test_32b_recipe_terms():
    """dapo_32b: Qwen2.5-32B, SGLang TP4, mem_fraction 0.62 on an H100, SGLang's defaults for the rest (8k prefill
    chunk, cuda_graph_max_bs 512, no prefill graphs with the memory saver). Per GPU at start-up."""
    s = sm.sglang_arch_terms(QWEN32, 4, gpus.gpu_total_bytes("h100-80gb"), 0.62)
    assert (s.chunked_prefill_size, s.cuda_graph_max_bs, s.prefill_graph_tokens) == (8192, 512, 0)
    assert s.weights == pytest.approx(2 * 32_763_876_352 / 4)  # 15.26 GiB
    cell = 2 * 2 * 128 * 64 * 2  # 2 of the 8 KV heads, K and V, 64 layers, bf16
    assert s.kv_tokens == int((0.62 * (85_520_809_984 - sm.CUDA_CONTEXT_BYTES) - s.weights) // cell) == 554_017
    assert s.kv_cache == s.kv_tokens * cell  # 33.81 GiB
    assert s.max_running_requests == 2164  # 554,017 / 131,072 × 512
    assert s.req_to_token == 4 * 2165 * (131_072 + 4)  # 1.06 GiB: the 128k context of the HF config
    assert s.cuda_graphs == 1 * GiB  # 512 × 2 MB
    assert (s.context, s.metadata, s.parallel) == (0.5 * GiB, 0.5 * GiB, 0.5 * GiB)
    assert s.activations == 12 * GiB  # 8192 × 1.5 MB
    assert s.startup == pytest.approx(sum(v for k, v in s.terms.items() if k != "activations"))
    assert s.startup / GiB == pytest.approx(52.63, abs=0.01) and s.rollout == s.startup + s.activations
    # mem_fraction applies to the memory free at start: a trainer already resident leaves the server less
    later = sm.sglang_arch_terms(QWEN32, 4, gpus.gpu_total_bytes("h100-80gb"), 0.62, free_at_start=60 * GiB)
    assert later.weights + later.kv_cache == pytest.approx(0.62 * 60 * GiB, abs=cell)


def test_terms_follow_the_settings():
    g = gpus.gpu_total_bytes("h100-80gb")
    base = sm.sglang_arch_terms(QWEN32, 4, g, 0.62)
    assert sm.sglang_arch_terms(QWEN32, 4, g, 0.62, prefill_cuda_graph=True).cuda_graphs == (1024 + 58 * 8) * MiB
    assert sm.sglang_arch_terms(QWEN32, 4, g, 0.62, cuda_graph_max_bs=128).cuda_graphs == 256 * MiB
    assert sm.sglang_arch_terms(QWEN32, 4, g, 0.62, max_running_requests_cap=100).cuda_graph_max_bs == 100
    small = sm.sglang_arch_terms(QWEN32, 4, g, 0.62, chunked_prefill_size=2048)
    assert small.activations == 3 * GiB and small.kv_tokens == base.kv_tokens
    assert sm.sglang_arch_terms(QWEN32, 8, g, 0.62).kv_tokens > 2 * base.kv_tokens  # half the weights, half the cell
    assert sm.sglang_arch_terms(QWEN32, 4, g, None).mem_fraction == sm.default_mem_fraction(
        H100, 4, prefill_graph_tokens=0
    )
    none = sm.sglang_arch_terms(QWEN32, 1, g, 0.2)  # the weights alone overflow 20 %: SGLang refuses to start
    assert none.kv_tokens == 0 and none.req_to_token == 0


def test_fit_mem_fraction():
    """The largest mem_fraction whose server fits the room each phase leaves it (what the planner asks when
    rollout.mem_fraction is unset)."""
    g = gpus.gpu_total_bytes("h100-80gb")
    s62 = sm.sglang_arch_terms(QWEN32, 4, g, 0.62)
    assert sm.fit_mem_fraction(QWEN32, 4, g, s62.startup, s62.rollout) == 0.62
    assert sm.fit_mem_fraction(QWEN32, 4, g, s62.startup - 1, s62.rollout) == 0.61
    assert sm.fit_mem_fraction(QWEN32, 4, g, s62.startup + 0.5 * GiB, s62.rollout - 1) == 0.61  # the rollout binds
    assert sm.fit_mem_fraction(QWEN32, 4, g, s62.startup) == 0.62  # rollout unchecked
    assert sm.fit_mem_fraction(QWEN32, 4, g, 10 * GiB, 100 * GiB) == 0.0  # not even the weights
    assert sm.fit_mem_fraction(QWEN32, 4, g, 200 * GiB) == 0.99


def test_phases_take_sglang_terms():
    """models.memory's rollout and start-up phases: with ``r.engine_terms`` (what the planner attaches) the engine's rows
    are its own terms and "overhead" is the trainer's; without, the rows the planner has always had."""
    from types import SimpleNamespace as NS

    from megatron_dapo.models.memory import rollout_phase, startup_phase

    sg = sm.sglang_arch_terms(QWEN32, 4, gpus.gpu_total_bytes("h100-80gb"), 0.62)
    m = NS(weights=7 * GiB, fp8_cache=0.5 * GiB, grads=7.5 * GiB, optimizer=3 * GiB, stage=1)
    o = NS(offload_train_state=True, overhead_gb=5.0, cuda_graph_gb=2.0)
    r = NS(engine_tp=4, share=sg.weights + sg.kv_cache, mem_fraction=0.62, weights=sg.weights, kv_tokens=sg.kv_tokens,
           engine_terms=None)  # fmt: skip
    usable = 0.95 * gpus.gpu_total_bytes("h100-80gb")
    old = startup_phase(m, r, o, usable, 8)
    assert [k for k, _, _ in old.rows][-3:] == ["SGLang weights + KV", "SGLang CUDA graphs", "overhead"]
    r.engine_terms = sg
    start, gen = startup_phase(m, r, o, usable, 8), rollout_phase(m, r, o, usable)
    assert start.total == pytest.approx(18 * GiB + sg.startup + 5 * GiB)
    assert gen.total == pytest.approx(7.5 * GiB + sg.rollout + 5 * GiB)
    rows = dict((k, v) for k, v, _ in gen.rows)
    assert rows["SGLang CUDA graphs"] == 1 * GiB and rows["SGLang activations"] == 12 * GiB
    assert rows["SGLang request table"] == sg.req_to_token and rows["SGLang KV cache"] == sg.kv_cache
    assert "SGLang activations" not in dict((k, v) for k, v, _ in start.rows)
    assert "554,017" in start.explain() and "the trainer's CUDA context" in gen.explain()


# ----------------------------------------------------------------------------------------------------------------------
# Against SGLang's code

HAVE_SGLANG = importlib.util.find_spec("sglang") is not None


@pytest.fixture(scope="module")
def sglang_dir() -> Path:
    if not HAVE_SGLANG:
        skip_unless_required("sglang", "sglang is not installed (make .venv/.installed-sglang)")
    return Path(importlib.util.find_spec("sglang").origin).parent


SERVER_CASES = [  # the GPU as nvidia-smi reports it (MiB), TP, --mem-fraction-static, --max-running-requests, prefill
    {"gpu_mib": H100, "tp": 4},
    {"gpu_mib": H100, "tp": 4, "prefill_backend": "disabled"},
    {"gpu_mib": H100, "tp": 4, "mem_fraction": 0.62, "prefill_backend": "disabled"},
    {"gpu_mib": H100, "tp": 4, "max_running_requests": 100, "prefill_backend": "disabled"},
    {"gpu_mib": H100, "tp": 1, "prefill_backend": "disabled"},
    {"gpu_mib": H200, "tp": 1},
    {"gpu_mib": 40960, "tp": 2},
    {"gpu_mib": 24576, "tp": 4},
    {"gpu_mib": 16384, "tp": 1},
    {"gpu_mib": 196608, "tp": 8},
]
KV_CASES = [(QWEN32, 4, 0.62), (load_arch("qwen2.5-7b"), 1, 0.5)]
POOL_CASES = [{"bytes": 10**10 + 12345, "cell": 65536, "page_size": 16}, {"bytes": 36_000_000_000, "cell": 65536, "page_size": 1},
              {"bytes": 65536 * 3 - 1, "cell": 65536, "page_size": 1}]  # fmt: skip
REQUEST_CASES = [{"tokens": 554_017, "context_len": 131_072}, {"tokens": 10**7, "context_len": 4096},
                 {"tokens": 1000, "context_len": 4096}, {"tokens": 554_017, "context_len": 131_072, "requested": 100},
                 {"tokens": 1000, "context_len": 4096, "requested": 10**6}]  # fmt: skip


@pytest.fixture(scope="module")
def sglang_answers(sglang_dir, tmp_path_factory) -> dict:
    """One child process (~20 s: importing sglang) answers every case."""
    model_dir = tmp_path_factory.mktemp("qwen2.5-32b")
    (model_dir / "config.json").write_text(json.dumps(hf_from_arch(QWEN32, "bfloat16")))
    g = gpus.gpu_total_bytes("h100-80gb")
    kv = []
    for arch, tp, mf in KV_CASES:
        weights = sm.sglang_arch_terms(arch, tp, g, mf).weights
        pre = g - sm.CUDA_CONTEXT_BYTES
        kv.append({"pre_gib": pre / GiB, "free_after_load_gib": (pre - weights) / GiB, "mem_fraction": mf,
                   "expect": sm.kv_cache_bytes(pre, mf, weights)})  # fmt: skip
    cases = {"model_dir": str(model_dir), "server_args": SERVER_CASES, "kv_budget": kv, "cell": [1, 2, 4, 8, 16],
             "pool": POOL_CASES, "requests": REQUEST_CASES, "req_table": [{"requests": 7, "context_len": 100}]}  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "sglang_cpu_support"), str(REPO)]),
           "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}  # fmt: skip
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("sglang_memory_worker.py"))], input=json.dumps(cases),
                          capture_output=True, text=True, env=env, timeout=600, cwd=REPO)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {"cases": cases, **json.loads(proc.stdout.strip().splitlines()[-1])}


@pytest.mark.parametrize("i", range(len(SERVER_CASES)))
def test_defaults_and_graph_reserve_match_server_args(sglang_answers, i):
    """What SGLang's ServerArgs resolution picks for a GPU (chunk size, cuda_graph_max_bs, prefill capture sizes,
    mem_fraction when unset) and its CUDA-graph reserve (memory_hook.reserve_for_graph_mb) = ours."""
    case, got = SERVER_CASES[i], sglang_answers["server_args"][i]
    prefill_on = case.get("prefill_backend", "breakable") != "disabled"
    chunk = sm.default_chunked_prefill_size(case["gpu_mib"])
    bs = sm.default_cuda_graph_max_bs(case["gpu_mib"], case["tp"], case.get("max_running_requests"))
    assert (got["chunked_prefill_size"], got["decode_max_bs"]) == (chunk, bs)
    assert got["prefill_sizes"] == sm.prefill_cuda_graph_sizes(chunk)
    assert got["graph_reserve_mb"] * MiB == sm.cuda_graph_bytes(bs, chunk if prefill_on else 0)
    mf = case.get("mem_fraction") or sm.default_mem_fraction(case["gpu_mib"], case["tp"], cuda_graph_max_bs=bs,
                                                             prefill_graph_tokens=None if prefill_on else 0)  # fmt: skip
    assert got["mem_fraction"] == mf


def test_kv_budget_matches_profile_available_bytes(sglang_answers):
    """The KV pool's bytes: SGLang's _profile_available_bytes (free after loading − pre × (1 − mem_fraction))."""
    for case, got in zip(sglang_answers["cases"]["kv_budget"], sglang_answers["kv_budget"]):
        assert got == pytest.approx(case["expect"], abs=1)


def test_cell_and_context_match_model_config(sglang_answers):
    """Bytes per token per TP rank (DefaultPoolConfigurator._compute_cell_size) and the context length SGLang reads
    from the HF config (ModelConfig.context_len)."""
    for tp, got in zip(sglang_answers["cases"]["cell"], sglang_answers["cell"]):
        assert got["cell"] == sm.kv_cell_bytes(QWEN32.num_layers, QWEN32.num_query_groups, QWEN32.head_dim, tp)
        assert got["context_len"] == QWEN32.max_position_embeddings


def test_tokens_requests_and_table_match(sglang_answers):
    """Bytes → tokens (calculate_pool_sizes), tokens → request slots (resolve_max_num_reqs), and the request table's
    bytes (a real ReqToTokenPool)."""
    for case, got in zip(POOL_CASES, sglang_answers["pool"]):
        assert got == sm.kv_tokens(case["bytes"], case["cell"], case["page_size"])
    for case, got in zip(REQUEST_CASES, sglang_answers["requests"]):
        assert got == sm.max_running_requests(case["tokens"], case["context_len"], case.get("requested"))
    table = sglang_answers["req_table"][0]
    assert table["extra"] == sm.REQ_TO_TOKEN_EXTRA and table["bytes"] == sm.req_to_token_bytes(7, 100)


# (file under sglang/, line, what it says there): the lines memory.py cites
CITED = [
    ("srt/arg_groups/memory_hook.py", 309, "reserved_mem = 512"),
    ("srt/arg_groups/memory_hook.py", 310, "reserved_mem += activation_tokens * 1.5"),
    ("srt/arg_groups/memory_hook.py", 312, "reserved_mem += cfg.tp_size * cfg.pp_size / 8 * 1024"),
    ("srt/arg_groups/memory_hook.py", 315, "reserved_mem = max(reserved_mem, 10 * 1024)"),
    ("srt/arg_groups/memory_hook.py", 325, "round((gpu_mem - reserved_mem) / gpu_mem, 3)"),
    ("srt/arg_groups/memory_hook.py", 368, "reserved_mem += decode_cuda_graph_config.max_bs * 2"),
    ("srt/arg_groups/memory_hook.py", 386, "reserved_mem += len(prefill_cuda_graph_config.bs) * 8"),
    ("srt/mem_cache/kv_cache_configurator.py", 3007, "slack_gb = pre_model_load_memory * (1 - "),
    ("srt/mem_cache/kv_cache_configurator.py", 3038, "rest_memory = available_gpu_memory - slack_gb"),
    ("srt/mem_cache/kv_cache_configurator.py", 3123, "estimated = int(token_capacity / self.model_config.context_len * 512)"),
    ("srt/mem_cache/kv_cache_configurator.py", 1773, "max_context_len=self.model_config.context_len + extra_max_context_len"),
    ("srt/mem_cache/memory_pool.py", 407, "(self._alloc_size, max_context_len), dtype=torch.int32"),
    ("srt/mem_cache/allocation_sizing.py", 105, "extra = 4 +"),
    ("srt/model_executor/pool_configurator.py", 492, "n = model_config.get_num_kv_heads(tp_size, dcp_size)"),
    ("srt/model_executor/pool_configurator.py", 642, "available_bytes // self._cell_size"),
    ("srt/configs/model_config.py", 1711, "return max(1, total_num_kv_heads // kv_tensor_parallel_size)"),
    ("srt/distributed/bootstrap.py", 207, "pre_model_load_memory = get_available_gpu_memory("),
    ("srt/utils/common.py", 456, "free_gpu_memory, _ = torch.cuda.mem_get_info(gpu_id)"),
    ("srt/utils/common.py", 806, "--query-gpu=memory.total"),
    ("srt/model_executor/runner_backend/breakable_cuda_graph_backend.py", 93, "not compatible with memory saver mode"),
]  # fmt: skip


@pytest.mark.parametrize("path,line,text", CITED)
def test_cited_lines(sglang_dir, path, line, text):
    lines = (sglang_dir / path).read_text().splitlines()
    assert text in lines[line - 1], f"sglang/{path}:{line} is now {lines[line - 1].strip()!r}: update the citation"
