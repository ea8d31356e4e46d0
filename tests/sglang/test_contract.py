"""Our request types against SGLang 0.5.23's own: SGLang ignores unknown top-level fields silently, so a misspelt
field would never fail at run time. The field names are read from the real server's routes (the request class each
endpoint parses its body into), in a subprocess with the server's import-only stand-ins."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from megatron_dapo.engines.sglang import types as T
from tests.sglang.helpers import SUPPORT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

READ_ROUTES = r"""
import dataclasses, inspect, json, sys, typing
from sglang.srt.entrypoints.http_server import app
from sglang.srt.sampling.sampling_params import SamplingParams

def fields(cls):
    if hasattr(cls, "__struct_fields__"):
        return list(cls.__struct_fields__)
    if dataclasses.is_dataclass(cls):
        return [f.name for f in dataclasses.fields(cls)]
    if hasattr(cls, "model_fields"):
        return list(cls.model_fields)
    raise TypeError(cls)

out = {}
for route in app.routes:
    if getattr(route, "path", None) not in sys.argv[1:] or "POST" not in getattr(route, "methods", ()):
        continue
    for p in inspect.signature(route.endpoint).parameters.values():
        ann = p.annotation
        if isinstance(ann, str):
            ann = eval(ann, route.endpoint.__globals__)
        ann = typing.get_args(ann)[0] if typing.get_origin(ann) is typing.Annotated else ann
        args = [a for a in typing.get_args(ann) if a is not type(None)]  # Optional[X]
        ann = args[0] if len(args) == 1 else ann
        if isinstance(ann, type) and ann.__name__.endswith(("ReqInput", "Req")):
            out[route.path] = {"class": ann.__name__, "fields": fields(ann)}
out["sampling_params"] = {"class": "SamplingParams", "fields": list(inspect.signature(SamplingParams).parameters)}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def sglang_requests() -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SUPPORT), os.environ.get("PYTHONPATH", "")]),
           "SGLANG_USE_CPU_ENGINE": "1", "PYTHONWARNINGS": "ignore"}  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", READ_ROUTES, *T.ENDPOINTS], env=env, capture_output=True, text=True,
                          timeout=240)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("path", sorted(T.ENDPOINTS))
def test_every_field_we_send_is_one_sglang_reads(path, sglang_requests):
    assert path in sglang_requests, f"SGLang 0.5.23 has no POST {path} taking a request object"
    ours = {f.name for f in dataclasses.fields(T.ENDPOINTS[path])}
    theirs = set(sglang_requests[path]["fields"])
    assert ours <= theirs, f"{path}: {sorted(ours - theirs)} unknown to SGLang's {sglang_requests[path]['class']}"


def test_sampling_params_are_sglangs(sglang_requests):
    ours = {f.name for f in dataclasses.fields(T.SGLangSamplingParams)}
    assert ours <= set(sglang_requests["sampling_params"]["fields"])
