"""Stand-in trainer for the Slurm tests: records what one rank sees, checks the servers, optionally fails.

Writes ``<out>/rank-<RANK>.json`` with the torch distributed variables (set by ``rank-exec``), the Slurm node, and
the HTTP status of every rollout server's /health. ``--allreduce`` runs a real gloo all_reduce over all ranks
(sum of rank + 1) through MASTER_ADDR/MASTER_PORT. ``--fail-rank R`` makes rank R exit with ``--code``.
"""

import argparse
import hashlib
import json
import os
import sys
import urllib.request
from pathlib import Path

KEYS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "DAPO_LOCAL_SERVER_URL",
)


def health(url: str) -> int:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url + "/health", timeout=5) as r:
            return r.status
    except OSError as e:
        return getattr(e, "code", -1)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--server-urls", default=os.environ.get("DAPO_SERVER_URLS", "[]"), help="default: the launcher's")
    ap.add_argument("--allreduce", action="store_true")
    ap.add_argument("--fail-rank", type=int, default=-1)
    ap.add_argument("--code", type=int, default=3)
    ap.add_argument("--log-dir", help="look for the job's API key in every file here (it must be in none)")
    args = ap.parse_args()
    rank = int(os.environ["RANK"])
    rec = {k: os.environ.get(k) for k in KEYS}
    rec["node"] = os.environ.get("SLURMD_NODENAME")
    rec["cwd"] = os.getcwd()  # where `python -m megatron_dapo...` of the step imports the package from
    rec["servers"] = {u: health(u) for u in json.loads(args.server_urls)}
    key = os.environ.get("DAPO_SGLANG_API_KEY", "")  # the job's server key: recorded as a hash, never printed
    rec["api_key_sha256"] = hashlib.sha256(key.encode()).hexdigest() if key else None
    if args.log_dir:
        files = [p for p in Path(args.log_dir).rglob("*") if p.is_file()]
        rec["key_in"] = [p.name for p in files if key and key.encode() in p.read_bytes()]
        args_file = Path(args.log_dir, "sglang-args.yaml")
        rec["args_file_mode"] = oct(args_file.stat().st_mode & 0o777) if args_file.exists() else None
    if args.allreduce:
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        rec["allreduce"] = t.item()
        dist.destroy_process_group()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, f"rank-{rank}.json").write_text(json.dumps(rec))
    print(f"rank {rank} on {rec['node']}: {rec}", flush=True)
    return args.code if rank == args.fail_rank else 0


if __name__ == "__main__":
    sys.exit(main())
