"""Issue 22 #3: the data-parallel check (``engines.sglang.options.sglang_data_parallel``, run by config validation for every path)
reads ``rollout.sglang.args`` as SGLang 0.5.23's own parser does (``prepare_server_args``: full flags, ``=`` forms,
argparse's unique abbreviations): a server it lets through has dp_size == 1, which every weight update asserts
(srt/managers/tokenizer_control_mixin.py)."""

from __future__ import annotations

import pytest

from megatron_dapo.engines.sglang.options import sglang_data_parallel

FORMS = [["--dp-size", "2"], ["--dp", "2"], ["--data-parallel-size", "3"], ["--dp-size=2"], ["--dp-s", "2"],
         ["--data-p", "2"], ["--dp-size", "1"], ["--attn-dp-size", "2"], ["--max-total-tokens", "2"], []]  # fmt: skip


def test_the_check_agrees_with_sglangs_parser(tmp_path):
    from sglang.srt.server_args import prepare_server_args

    for args in FORMS:
        dp = prepare_server_args(["--model-path", str(tmp_path), *args]).dp_size
        assert (sglang_data_parallel(args) is not None) == (dp > 1), (args, dp)


def test_servers_the_trainer_starts_use_the_same_check(tmp_path):
    from megatron_dapo.engines.sglang.server import SGLangServer

    with pytest.raises(ValueError, match=r"--dp-s 2: every weight-update endpoint"):
        SGLangServer(tmp_path, port=1, extra_args=["--dp-s", "2"])
