"""What the hardened sandbox costs: python-tool calls per second, today's sandbox against the one before the per-call
limits (its module read from git), and a bare ``python -I -S`` subprocess (no isolation at all), measured in one run.

    .venv/bin/python bench/bench_sandbox.py [--calls 60] [--jobs 2] [--before 54198e0]

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
    spec.loader.exec_module(module)
    return module


def bare(code: str) -> bool:
    r = subprocess.run([sandbox._python(), "-I", "-S", "-c", code], capture_output=True, text=True, timeout=60)
    return r.returncode == 0


def measure(name: str, call, calls: int, jobs: int) -> float:
    call()  # warm: the isolation probe, page cache
    start = time.monotonic()
    with cf.ThreadPoolExecutor(jobs) as pool:
        ok = sum(bool(x) for x in pool.map(lambda _: call(), range(calls)))
    took = time.monotonic() - start
    print(f"{name:<36} {calls / took:7.2f} calls/s  {1000 * took * jobs / calls:7.1f} ms per call  ({ok}/{calls} ok)")
    return calls / took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--before", default="54198e0", help="the commit whose sandbox is the baseline")
    args = ap.parse_args()
    print(f"sandbox now: {sandbox.isolation_path()}; {args.calls} calls, {args.jobs} at a time")
    rates = {"bare": measure("bare python -I -S (no isolation)", lambda: bare(PROGRAM), args.calls, args.jobs)}
    try:
        before = load_before(args.before)
        limits = before.SandboxLimits(wall_s=30)
        rates["before"] = measure(f"sandbox at {args.before}", lambda: before.run_python(PROGRAM, limits).ok,
                                  args.calls, args.jobs)  # fmt: skip
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        print(f"(no baseline: git show {args.before} failed: {e})")
    limits = sandbox.SandboxLimits(wall_s=30)
    rates["now"] = measure("sandbox now (per-call limits)", lambda: sandbox.run_python(PROGRAM, limits).ok,
                           args.calls, args.jobs)  # fmt: skip
    if "before" in rates:
        print(f"now / before: {rates['now'] / rates['before']:.3f} of the calls per second")
    print(f"now / bare:   {rates['now'] / rates['bare']:.3f} of the calls per second")


if __name__ == "__main__":
    main()
