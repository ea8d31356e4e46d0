"""A run's checkpoints by step number, and stop requests (megatron_dapo/runs.py)."""

import os
import signal

from megatron_dapo.runs import META_FILE, StopRequest, checkpoint_dir_name, checkpoints, latest_checkpoint


def _ckpt(root, step, complete=True, name=None):
    path = root / (name or checkpoint_dir_name(step))
    path.mkdir(parents=True)
    if complete:
        (path / META_FILE).write_text("{}")
    return path


def test_checkpoints_are_ordered_by_step_number_not_name(tmp_path):
    # by name, step_1000000 sorts before step_999999 and pruning would delete the newest
    big, small = _ckpt(tmp_path, 1_000_000), _ckpt(tmp_path, 999_999)
    _ckpt(tmp_path, 1_000_001, complete=False)  # a save that did not finish: no meta file
    _ckpt(tmp_path, 5, name=".step_000005.tmp")  # a save in progress
    _ckpt(tmp_path, 7, name="notes")
    assert sorted(p.name for p in tmp_path.glob("step_*"))[-1] == "step_999999"  # the trap of name order
    assert checkpoints(tmp_path) == [(999_999, small), (1_000_000, big)]
    assert latest_checkpoint(tmp_path) == (1_000_000, big)
    assert checkpoints(tmp_path / "missing") == [] and latest_checkpoint(tmp_path / "missing") is None


def test_stop_request_from_signal_or_file(tmp_path):
    stop_file = tmp_path / "stop"
    request = StopRequest.from_env({"DAPO_STOP_FILE": str(stop_file)})
    assert request.requested() is None
    stop_file.write_text("time limit\n")
    assert request.requested() == f"stop file {stop_file}"
    old = signal.getsignal(signal.SIGUSR1)
    try:
        request = StopRequest.from_env({}).install()
        assert request.requested() is None
        os.kill(os.getpid(), signal.SIGUSR1)  # without the handler: the default action ends the process
        assert request.requested() == "SIGUSR1"
    finally:
        signal.signal(signal.SIGUSR1, old)
