#!/usr/bin/env python
"""The same as ``dapo convert megatron-to-hf`` (megatron_dapo/bridge/convert_cli.py), from a checkout: --help for the options."""

import sys

from megatron_dapo.bridge.convert_cli import megatron_to_hf_main

if __name__ == "__main__":  # the guard matters: dist_checkpointing starts helper processes
    sys.exit(megatron_to_hf_main())
