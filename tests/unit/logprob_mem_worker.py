"""Peak RSS of one vocab-parallel logprob computation: ``python logprob_mem_worker.py SEQ_LEN CHUNK`` prints JSON.

``ru_maxrss`` is a high-water mark since process start, so a peak reached while importing megatron-core hides the
computation's (CI saw 0 MiB for every size). The worker resets the kernel's high-water mark first (``clear_refs`` 5,
Linux >= 4.0) and measures the peak above the resident size at that moment; where the reset is refused it samples the
resident size from a thread every millisecond instead.
"""

import json
import re
import sys
import threading

import torch


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+)", f.read(), re.M).group(1))


def _reset_high_water_mark() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return _status_kb("VmHWM") <= _status_kb("VmRSS") + 1024


class _Sampler(threading.Thread):
    def __init__(self):
        super().__init__(daemon=True)
        self.peak_kb, self.done = _status_kb("VmRSS"), threading.Event()

    def run(self):
        while not self.done.wait(0.001):
            self.peak_kb = max(self.peak_kb, _status_kb("VmRSS"))


def main(seq_len: int, chunk: int) -> None:
    from megatron_dapo.actor.dist import init_distributed
    from megatron_dapo.actor.logprobs import token_logprobs
    from megatron_dapo.config.run_config import ParallelConfig

    init_distributed(ParallelConfig())
    torch.manual_seed(0)
    vocab, hidden = 32768, 64
    weight = torch.randn(vocab, hidden) * 0.05
    h = torch.randn(seq_len, hidden)
    targets = torch.randint(0, vocab, (seq_len,))
    exact = _reset_high_water_mark()
    base = _status_kb("VmRSS")
    sampler = None if exact else _Sampler()
    if sampler:
        sampler.start()
    lp, ent = token_logprobs(h, weight, targets, vocab, chunk_tokens=chunk, with_entropy=True)
    if sampler:
        sampler.done.set()
        sampler.join()
    peak = _status_kb("VmHWM") if exact else sampler.peak_kb
    out = {"extra_mb": (peak - base) / 1024, "exact": exact, "sum": float(lp.sum()), "ent": float(ent.sum())}
    print(json.dumps(out))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
