"""What the hardened sandbox costs: python-tool calls per second, today's sandbox against the one before the per-call
limits (its module read from git), and a bare ``python -I -S`` subprocess (no isolation at all), measured in one run.

    .venv/bin/python bench/bench_sandbox.py [--calls 120] [--jobs 2] [--rounds 6] [--before 54198e0]

Each call runs a typical tool program (a sum over 10^5 squares, a few lines of output); ``--jobs`` calls at once, as
the tool agent's threads make them. Prints calls/s and ms per call for each, and the ratios. Relate it to a step: the
tool recipe on the real SGLang server spends ~32 s a step in rollout (docs/guides/agents-and-tools.md), so each
extra millisecond per call costs (python calls per step) x 1 ms / (jobs) of that.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_dapo.rollouts import sandbox  # noqa: E402

PROGRAM = "total = sum(i * i for i in range(10**5))\nprint('sum of squares:', total)\n"


def load_before(commit: str):
    """The sandbox module as it was at ``commit`` (a standalone module: the standard library only)."""
    text = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{commit}:megatron_dapo/rollouts/sandbox.py"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    path = Path(tempfile.mkdtemp(prefix="bench-sandbox-")) / "sandbox_before.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("sandbox_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["sandbox_before"] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def bare(code: str) -> bool:
    r = subprocess.run([sandbox._python(), "-I", "-S", "-c", code], capture_output=True, text=True, timeout=60)
    return r.returncode == 0


def timed(call, calls: int, jobs: int) -> tuple[float, int]:
    start = time.monotonic()
    with cf.ThreadPoolExecutor(jobs) as pool:
        ok = sum(bool(x) for x in pool.map(lambda _: call(), range(calls)))
    return time.monotonic() - start, ok


def measure(variants: dict, labels: dict, calls: int, jobs: int, rounds: int) -> dict[str, float]:
    """calls/s of each variant, its calls split into ``rounds`` rounds taken in turn (so that a slow minute of the
    machine falls on every variant alike)."""
    for call in variants.values():
        call()  # warm: the isolation probe, the page cache
    took, ok = dict.fromkeys(variants, 0.0), dict.fromkeys(variants, 0)
    for r in range(rounds):
        names = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in names:
            t, n = timed(variants[name], calls // rounds, jobs)
            took[name] += t
            ok[name] += n
    done = calls // rounds * rounds
    for name in variants:
        print(f"{labels[name]:<36} {done / took[name]:7.2f} calls/s  {1000 * took[name] * jobs / done:7.1f} ms per call  "
              f"({ok[name]}/{done} ok)")  # fmt: skip
    return {name: done / took[name] for name in variants}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=120)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--before", default="54198e0", help="the commit whose sandbox is the baseline")
    args = ap.parse_args()
    print(f"sandbox now: {sandbox.isolation_path()}; {args.calls} calls, {args.jobs} at a time, {args.rounds} rounds")
    variants = {"bare": lambda: bare(PROGRAM)}
    try:
        before = load_before(args.before)
        old_limits = before.SandboxLimits(wall_s=30)
        variants["before"] = lambda: before.run_python(PROGRAM, old_limits).ok
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        print(f"(no baseline: git show {args.before} failed: {e})")
    limits = sandbox.SandboxLimits(wall_s=30)
    variants["now"] = lambda: sandbox.run_python(PROGRAM, limits).ok
    labels = {"bare": "bare python -I -S (no isolation)", "before": f"sandbox at {args.before}",
              "now": "sandbox now (per-call limits)"}  # fmt: skip
    rates = measure(variants, labels, args.calls, args.jobs, args.rounds)
    if "before" in rates:
        print(f"now / before: {rates['now'] / rates['before']:.3f} of the calls per second")
    print(f"now / bare:   {rates['now'] / rates['bare']:.3f} of the calls per second")


if __name__ == "__main__":
    main()
