"""A checkpoint that cannot be written keeps the previous one and says so (actor/checkpoint.py save).

The writer is made to fail here (no root needed): megatron-core's ``dist_checkpointing.save`` replaced by one that
writes part of a file and raises ENOSPC, as a full disk does. The real full disk (a size-limited tmpfs) is in
tests/e2e/test_trainer.py.
"""

import subprocess
import sys

from tests.helpers import REPO

SCRIPT = r"""
import errno, json, sys
from pathlib import Path
from megatron.core import dist_checkpointing
from megatron_dapo.actor.actor import MegatronActor
from megatron_dapo.config.run_config import load_config
from megatron_dapo.runs import CheckpointError, checkpoints

if __name__ == "__main__":
    out = Path(sys.argv[1])
    actor = MegatronActor(load_config("demo_cpu", []))
    actor.save(out / "step_000001")
    real_save = dist_checkpointing.save

    def full_disk(state, directory, *args, **kwargs):
        Path(directory, "__0_0.distcp").write_bytes(b"x" * 1000)  # a partial shard, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    dist_checkpointing.save = full_disk
    try:
        actor.save(out / "step_000002")
        print("NO ERROR")
    except CheckpointError as e:
        print(json.dumps({"error": str(e), "left": sorted(p.name for p in out.iterdir()),
                          "complete": [str(p) for _, p in checkpoints(out)]}))
    dist_checkpointing.save = real_save
"""


def test_failed_write_keeps_previous_checkpoint_and_says_so(tmp_path):
    import json

    script = tmp_path / "save.py"
    script.write_text(SCRIPT)
    ckpts = tmp_path / "checkpoints"
    proc = subprocess.run([sys.executable, str(script), str(ckpts)], cwd=REPO, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["error"].startswith(f"checkpoint {ckpts}/step_000002 was not written (rank 0: ")
    assert "No space left on device" in out["error"]
    assert out["error"].endswith(f"the previous checkpoint {ckpts}/step_000001 is kept")
    assert out["left"] == ["step_000001"]  # the partial .step_000002.tmp is gone
    assert out["complete"] == [str(ckpts / "step_000001")]
