"""SGLang against vLLM on CPU cores, the same model and lengths, in one run (issue 50, build item 4).

    .venv/bin/python bench/engines.py [--prompts 96] [--n 8] [--max-new-tokens 12] [--repeats 3] [--steps 6]

1. Generation: one real server of each (bf16, the demo's tiny model as the actor initializes it), the demo's batch
   (96 prompts x 8 samples x 12 new tokens, one HTTP request per sample, 64 in flight) ``--repeats`` times, the
   engines alternating, each alone on the cores; tokens/s and vLLM's time over SGLang's.
2. Weight sync: each engine's CPU transport of the demo (SGLang ``tensor``, vLLM ``disk``), verified, ``--repeats``
   times; seconds.
3. Training: ``dapo train`` of ``demo_cpu_sglang`` and ``demo_cpu_vllm`` for ``--steps`` DAPO steps without the
   supervised warm start and dynamic sampling (the step time, not the learning: an untrained model gets every group
   wrong); the median seconds per step and its parts.
Writes ``--out`` (JSON). Needs sglang in .venv and .venv-vllm (``make test`` makes both).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _servers(model: Path, work: Path) -> dict:
    from tests.sglang.helpers import cpu_server as sglang_server
    from tests.vllm.helpers import cpu_server as vllm_server

    return {"sglang": sglang_server(model, work / "sglang.log"), "vllm": vllm_server(model, work / "vllm.log")}


def _engines(servers: dict) -> dict:
    from tests.sglang.helpers import make_engine as sglang_engine
    from tests.vllm.helpers import make_engine as vllm_engine

    return {"sglang": sglang_engine(servers["sglang"], max_concurrency=64),
            "vllm": vllm_engine(servers["vllm"], max_concurrency=64)}  # fmt: skip


def _syncs(engines: dict, work: Path) -> dict:
    from megatron_dapo.engines.sglang.sync import TensorSync
    from megatron_dapo.engines.vllm.sync import VLLMDiskSync

    return {"sglang": TensorSync(engines["sglang"], head_dim=32),
            "vllm": VLLMDiskSync(engines["vllm"], head_dim=32, directory=work / "vllm_sync")}  # fmt: skip


def _train(recipe: str, steps: int, run_dir: Path) -> dict:
    cmd = [str(REPO / ".venv" / "bin" / "dapo"), "train", "--recipe", recipe, f"train.steps={steps}",
           f"train.run_dir={run_dir}", "train.supervised_warmup_steps=0", "algo.dynamic_sampling=false",
           "train.export_hf=false", "eval.interval=0",
           "train.save_interval=0"]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{recipe}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    rows = [json.loads(x) for x in (run_dir / recipe / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rows = [r for r in rows if "time/step_s" in r][1:]  # the first step starts the server's kernels
    keys = ("time/step_s", "time/rollout_s", "time/old_logprobs_s", "time/train_s", "time/sync_s")
    return {"wall_s": time.perf_counter() - t0,
            **{k: statistics.median(r[k] for r in rows if k in r) for k in keys if any(k in r for r in rows)}}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=96)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "engines.json"))
    args = ap.parse_args()

    import torch

    from megatron_dapo.types import SamplingParams
    from tests.sglang.helpers import ARCH, buckets, random_weights, save_model

    work = Path(tempfile.mkdtemp(prefix="bench_engines_"))
    weights = random_weights(ARCH, seed=0)
    weights["model.embed_tokens.weight"] *= 0.15  # sampled tokens vary (tests/vllm/helpers.flat_weights)
    model = save_model(work / "model", ARCH, weights)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 30) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, seed=0)
    servers = _servers(model, work)
    result: dict = {"args": vars(args), "generate_s": {}, "tokens_per_s": {}, "sync_s": {}, "train": {}}
    try:
        for s in servers.values():  # one at a time: each start alone on the cores
            s.start()
            s.wait_healthy(600)
        engines = _engines(servers)
        syncs = _syncs(engines, work)
        for e in engines.values():
            e.generate(prompts[:4], sampling, n=2)  # warm-up (vLLM compiles its logprob kernel at the first)
        times: dict[str, list[float]] = {k: [] for k in engines}
        tokens: dict[str, list[int]] = {k: [] for k in engines}
        for r in range(args.repeats):
            for name in list(engines) if r % 2 == 0 else list(reversed(engines)):
                t0 = time.perf_counter()
                out = engines[name].generate(prompts, sampling, n=args.n)
                times[name].append(time.perf_counter() - t0)
                tokens[name].append(sum(len(s.response_ids) for s in out))
                print(f"  generate {r} {name:6s} {times[name][-1]:6.2f} s, {tokens[name][-1]} tokens", flush=True)
        sync_s: dict[str, list[float]] = {k: [] for k in engines}
        for r in range(args.repeats):
            for name, sync in syncs.items():
                w = {k: v + 1e-3 * (r + 1) * torch.ones_like(v) for k, v in weights.items()}
                rep = sync.sync(buckets(w), r + 1)
                sync_s[name].append(rep.seconds)
                print(f"  sync {r} {name:6s} {rep.seconds:6.3f} s ({rep.verified} verified)", flush=True)
        for name in engines:
            best = min(times[name])
            result["generate_s"][name] = times[name]
            result["tokens_per_s"][name] = tokens[name][times[name].index(best)] / best
            result["sync_s"][name] = sync_s[name]
        for e in engines.values():
            e.shutdown(stop_servers=False)
    finally:
        for s in servers.values():
            s.stop()
    for name, recipe in (("sglang", "demo_cpu_sglang"), ("vllm", "demo_cpu_vllm")):
        result["train"][name] = _train(recipe, args.steps, work / "runs")
        print(f"  train {name}: {result['train'][name]}", flush=True)

    tps, tr = result["tokens_per_s"], result["train"]
    print(f"\n{args.prompts} prompts x {args.n} samples x {args.max_new_tokens} tokens, one real server each, bf16, "
          f"2 cores")  # fmt: skip
    print(f"{'':22s} {'SGLang':>10s} {'vLLM':>10s} {'vLLM/SGLang':>12s}")
    print(f"{'generate, tokens/s':22s} {tps['sglang']:10.0f} {tps['vllm']:10.0f} {tps['vllm'] / tps['sglang']:11.2f}x")
    s_sync, v_sync = (statistics.median(result["sync_s"][k]) for k in ("sglang", "vllm"))
    print(f"{'weight sync, s':22s} {s_sync:10.3f} {v_sync:10.3f} {v_sync / s_sync:11.2f}x")
    for key in ("time/step_s", "time/rollout_s", "time/train_s", "time/sync_s"):
        if key in tr["sglang"] and key in tr["vllm"]:
            a, b = tr["sglang"][key], tr["vllm"][key]
            print(f"{key + ' (median)':22s} {a:10.2f} {b:10.2f} {b / a:11.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
