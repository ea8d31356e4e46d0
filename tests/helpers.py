import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
AIME = REPO / "data" / "aime-2024.parquet"  # shipped with the repository (data/README.md)


def skip_unless_required(what: str, reason: str) -> None:
    """Skip for ``reason``, unless ``$DAPO_REQUIRE_<WHAT>=1`` (``make test`` sets it, as DAPO_REQUIRE_SGLANG): then the
    test fails, so CI never skips a Slurm or mount test silently (a non-root ``make test`` fails on purpose; run it as
    root, or pass ``DAPO_REQUIRE_SLURM=0`` / ``DAPO_REQUIRE_MOUNT=0`` to make)."""
    var = f"DAPO_REQUIRE_{what.upper()}"
    if os.environ.get(var) == "1":
        pytest.fail(f"{var}=1 but: {reason}")
    pytest.skip(reason)


def repo_pythonpath() -> str:
    """PYTHONPATH for a test's child process that runs a script (sys.path[0] = the script's folder): this checkout
    first, not an installed copy of the package (a venv shared with another checkout)."""
    return os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])


def torchrun_cmd(nproc: int) -> list[str]:
    """``python -m torch.distributed.run`` for ``nproc`` local ranks on a free rendezvous port."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-port=0",
            "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0"]  # fmt: skip


def run_torchrun(nproc: int, script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``script`` under torchrun (gloo on CPU) and fail with its output if it fails or hangs."""
    cmd = [*torchrun_cmd(nproc), str(script), *map(str, args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": repo_pythonpath()}
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"torchrun {script} {args} timed out after {timeout}s:\n{(e.stdout or b'')[-3000:]}")
    if proc.returncode != 0:
        pytest.fail(f"torchrun {script} {args} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


SPECIALS = ("<|pad|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_char_hf_tokenizer(directory: Path) -> Path:
    """Save a real HF fast tokenizer with one token per printable ASCII character (+ 3 specials, ChatML template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in [chr(c) for c in range(32, 127)] + ["\n"]:
        vocab.setdefault(ch, len(vocab))
    core = Tokenizer(models.WordLevel(vocab, unk_token=SPECIALS[0]))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=SPECIALS[0], bos_token=SPECIALS[1], eos_token=SPECIALS[2]
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(directory)
    return Path(directory)


def fake_allocation_srun(tmp_path: Path, monkeypatch, gpus_on_node: int = 8) -> Path:
    """Inside a (fake) one-node Slurm allocation with an ``srun`` on PATH that records its arguments and starts
    nothing: the file it writes to, which exists only if a job step was started."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "srun-calls"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f'#!/bin/sh\necho "$@" >> {calls}\nsleep 30\n')
    (bin_dir / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    for key in [k for k in os.environ if k.startswith(("SLURM_", "MASTER_"))]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n1")  # inside an allocation, not a dry run
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", str(gpus_on_node))
    return calls


def fresh_actors(make_config):
    """The body of a module fixture (``yield from fresh_actors(...)``): ``make(*args)`` builds a ``MegatronActor`` on
    ``make_config(*args)`` after tearing down the previous one's process groups (one actor lives at a time); the last
    is torn down when the module ends."""
    from megatron_dapo.actor.actor import MegatronActor
    from megatron_dapo.actor.dist import teardown

    made = []

    def make(*args):
        if made:
            teardown()
        made.append(MegatronActor(make_config(*args)))
        return made[-1]

    yield make
    teardown()


def process_tree(root: int) -> set[int]:
    """The live pids descending from ``root`` (not ``root`` itself), from /proc: what a test started, and not what
    another test worker on the node runs at the same time (processes a test counts must be its own)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except (FileNotFoundError, ProcessLookupError):
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if fields[0] != "Z":  # a zombie holds nothing but its pid
                children.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out
