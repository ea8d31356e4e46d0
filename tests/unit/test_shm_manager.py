"""A trainer that synced CPU tensors to an attached server must not hold its caller's pipe open after it exits.

torch's "file_system" sharing (the CPU tensor transport, sglang_server.PLATFORMS) starts a ``torch_shm_manager``
that inherits stderr and lives while any process maps a segment: the attached SGLang server. Seen: a test that read
``dapo train``'s output through a pipe hung until the server stopped. Here a sleeping child stands in for the server.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

pytest.importorskip("sglang")

TRAINER = r"""
import subprocess, sys, torch
from megatron_dapo.engines.sglang.client import SGLangEngine
from megatron_dapo.engines.sglang.server import SGLangServer
from megatron_dapo.engines.sglang.sync import TensorSync

engine = SGLangEngine([SGLangServer.attach("http://127.0.0.1:9", device="cpu")], dtype="bfloat16", start=False)
payload, blob, _ = TensorSync(engine, verify="off").serialize([("w", torch.ones(4))])
# the "server": maps the segment (as SGLang's loader does), then outlives us, its own output detached from our pipes
subprocess.Popen([sys.executable, "-c", CONSUMER, blob, sys.argv[1]], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                 stderr=subprocess.DEVNULL, start_new_session=True)
sys.stdin.readline()  # the test has seen the consumer's file: it mapped the tensor
print("trainer done", flush=True)
"""

CONSUMER = r"""
import sys, time, torch
from sglang.srt.utils import MultiprocessingSerializer
torch.multiprocessing.set_sharing_strategy("file_system")
bucket = MultiprocessingSerializer.deserialize(sys.argv[1])
open(sys.argv[2], "w").close()
time.sleep(25)
"""


@pytest.mark.timeout(120)
def test_the_trainer_output_ends_when_the_trainer_exits_though_the_server_lives_on(tmp_path):
    ready = tmp_path / "mapped"
    code = f"CONSUMER = {CONSUMER!r}\n" + TRAINER
    proc = subprocess.Popen([sys.executable, "-c", code, str(ready)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 90
    while not ready.exists():  # the consumer has deserialized (mapped) the shared tensor
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the consumer never mapped the tensor"
        time.sleep(0.2)
    proc.stdin.write("\n")
    proc.stdin.flush()
    proc.wait(timeout=60)
    started = time.monotonic()
    out, err = proc.communicate(timeout=15)  # EOF on both pipes: nothing of the trainer's holds them any more
    assert "trainer done" in out, err
    assert time.monotonic() - started < 15
