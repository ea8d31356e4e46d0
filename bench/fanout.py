"""Rollout fan-out over several SGLang engines, measured on real SGLang 0.5.23 CPU servers (issue 14, build item 4).

    .venv/bin/python bench/fanout.py [--servers 2] [--prompts 24] [--n 8] [--prompt-len 384] [--repeats 2]

The same batch (prompts x n samples, long shared prompts: the radix cache matters, as with DAPO's group of 16) through:
* ``request``: SGLangEngine, round-robin per request (a prompt's samples land on every engine);
* ``prompt``:  SGLangEngine, every sample of a prompt on one engine, the least loaded (``rollout.fanout``'s default);
* ``router``:  the real sglang-router 0.3.2 (``--policy cache_aware``, its default) in front of the engines (the
  sglang environment of ``make test`` installs it: requirements/sglang-cpu.txt).
Each mode runs ``--repeats`` times in rotating order, caches flushed before each run; it prints seconds per run, samples
per second, and each mode's time relative to ``prompt``, all from this one run. Writes a JSON next to ``--out``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _model(out: Path) -> Path:
    from megatron_dapo.actor.actor import MegatronActor
    from megatron_dapo.bridge.export import save_hf_checkpoint
    from megatron_dapo.config.run_config import load_config
    from megatron_dapo.data.tokenizer import load_tokenizer

    cfg = load_config("demo_cpu", ["model.arch=tiny"])
    actor = MegatronActor(cfg)
    save_hf_checkpoint(actor.model, actor.arch, out, load_tokenizer(None))
    return out


def _server(model: Path, log: Path):
    from megatron_dapo.engines.sglang.server import SGLangServer

    return SGLangServer(model, device="cpu", pythonpath=[REPO / "tests" / "sglang_cpu_support"], mem_fraction=0.05,
                        dtype="bf16", log_path=log, env={"OMP_NUM_THREADS": "1"},
                        extra_args=["--skip-tokenizer-init", "--max-total-tokens", "16384", "--random-seed", "0"])  # fmt: skip


def _router(urls: list[str], port: int, log: Path) -> subprocess.Popen:
    from megatron_dapo.engines.sglang.auth import api_key

    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
           "--worker-urls", *urls, "--policy", "cache_aware", "--api-key", api_key()]  # fmt: skip
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


def _wait_router(url: str, timeout: float = 60) -> None:
    """Until the router routes: it answers /health at once, /generate once it has checked its workers."""
    from megatron_dapo.engines.sglang.server import http_call
    from megatron_dapo.types import RolloutError

    deadline = time.monotonic() + timeout
    while True:
        try:
            http_call(url, "/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}, timeout=10)
            return
        except RolloutError as e:
            if time.monotonic() > deadline:
                raise RuntimeError(f"sglang-router at {url} not routing after {timeout:.0f} s: {e}") from e
            time.sleep(0.5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=384)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "fanout.json"))
    args = ap.parse_args()

    import random

    from megatron_dapo.actor.dist import free_port
    from megatron_dapo.engines.sglang.client import SGLangEngine
    from megatron_dapo.types import SamplingParams, TokenizerInfo

    work = Path(tempfile.mkdtemp(prefix="bench_fanout_"))
    model = _model(work / "model")
    servers = [_server(model, work / f"server{i}.log") for i in range(args.servers)]
    router = None
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_healthy(600)
        modes = ["request", "prompt"]
        router_url = None
        if importlib.util.find_spec("sglang_router"):
            port = free_port()
            router = _router([s.url for s in servers], port, work / "router.log")
            router_url = f"http://127.0.0.1:{port}"
            _wait_router(router_url)
            modes.append("router")
        else:
            print("sglang_router is not installed: the router row is skipped (make .venv/.installed-sglang)")
        rng = random.Random(0)
        prompts = [[rng.randrange(3, 30) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
        sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, seed=0, logprobs=True)
        info = TokenizerInfo((), 0)
        engines = {
            "request": SGLangEngine(servers, tokenizer_info=info, fanout="request", start=False, max_concurrency=256),
            "prompt": SGLangEngine(servers, tokenizer_info=info, fanout="prompt", start=False, max_concurrency=256),
        }
        if router_url:
            engines["router"] = SGLangEngine(servers, router_url=router_url, tokenizer_info=info, start=False,
                                             max_concurrency=256)  # fmt: skip
        times: dict[str, list[float]] = {m: [] for m in modes}
        engines["prompt"].generate(prompts[:2], sampling, n=2)  # warm-up
        for r in range(args.repeats):
            for m in modes[r % len(modes) :] + modes[: r % len(modes)]:
                engines[m].call_workers("/flush_cache", {})
                t0 = time.perf_counter()
                out = engines[m].generate(prompts, sampling, n=args.n)
                times[m].append(time.perf_counter() - t0)
                assert len(out) == args.prompts * args.n, (m, len(out))
                print(f"  run {r} {m:8s} {times[m][-1]:7.2f} s", flush=True)
        samples = args.prompts * args.n
        best = {m: min(v) for m, v in times.items()}
        print(f"\n{args.servers} real SGLang CPU servers, {args.prompts} prompts x {args.n} samples, "
              f"{args.prompt_len} prompt tokens, {args.max_new_tokens} new tokens")  # fmt: skip
        print(f"{'mode':10s} {'best s':>8s} {'samples/s':>10s} {'vs prompt':>10s}")
        for m in modes:
            print(f"{m:10s} {best[m]:8.2f} {samples / best[m]:10.1f} {best[m] / best['prompt']:9.2f}x")
        result = {"servers": args.servers, "prompts": args.prompts, "n": args.n, "prompt_len": args.prompt_len,
                  "max_new_tokens": args.max_new_tokens, "seconds": times, "best_s": best}  # fmt: skip
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
        for e in engines.values():
            e.shutdown(stop_servers=False)
    finally:
        if router is not None:
            router.terminate()
            router.wait(30)
        for s in servers:
            s.stop()


if __name__ == "__main__":
    main()
