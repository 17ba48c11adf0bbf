"""Importing kernels loads no shared library (issue 31 item 6): the host reads a GGUF's spec and the
planner a layout without llama.cpp's libraries in the process; the first ggml call loads them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROBE = """
import json, sys
def loaded():
    return sorted({line.split("/")[-1] for line in open("/proc/self/maps") if "libggml" in line or "libllama" in line})
import kernels, kernels.spec, kernels.gguf_file, plans.layout, plans.planner, swarmctl.host.service
before = loaded()
from kernels import ggml
imported = loaded()
size = ggml.type_size(ggml.TYPE_F32)
print(json.dumps({"before": before, "imported": imported, "after": loaded(), "size": size}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_kernels_import_without_loading_ggml_and_load_on_first_call():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True)
    seen = json.loads(out.stdout.splitlines()[-1])
    assert seen["before"] == [] and seen["imported"] == []
    assert any(name.startswith("libggml-base") for name in seen["after"]) and seen["size"] == 4


def test_an_unknown_binding_is_an_attribute_error():
    from kernels import ggml

    with pytest.raises(AttributeError, match="no attribute 'ggml_no_such_function'"):
        ggml.ggml_no_such_function  # noqa: B018
