"""`kernels` as a swarm setting, with real processes: set at `init`, carried in the plan, applied by
every member (the asker's head and tail too), changed with `swarmctl config`.

A two-trunk swarm on a tiny Q4_0 model (every matrix has a repacked layout on AVX2 / NEON CPUs)
set to repack answers exactly what llama-cpp-python's default (repacked) load answers on this
CPU; set back to plain with `config`, every trunk reloads and it answers what llama-cpp-python
with plain buffers answers. (On this tiny model the two answers happen to coincide, so each
member's own line says which kernels it loaded: the trunks' logs and the asker's.) The bits
themselves are compared with llama.cpp in one process: tests/test_kernels_choice.py.
"""

from __future__ import annotations

import re

import pytest

from harness.swarm import Swarm, swarmctl
from harness.tiny_models import write_tiny_model
from kernels.backend import AMX_BUFFER_TYPE, cpu_extra_buffer_types
from kernels.oracle_llama import load_llama
from tests.conftest import N_THREADS
from tests.test_kernels_choice import LLAMA_Q4_0

PROMPT = "The three primary colours are"
ASK = ("ask", "-v", "--raw", "--temperature", "0", "--max-tokens", "16", PROMPT)


def _llama_answer(model, repack: bool) -> str:
    llm = load_llama(model, repack=repack, n_ctx=512, n_threads=N_THREADS, n_threads_batch=N_THREADS)
    try:
        return llm.create_completion(PROMPT, max_tokens=16, temperature=0)["choices"][0]["text"] + "\n"
    finally:
        llm.close()


def _start(swarm: Swarm, model) -> None:
    swarm.start_host()
    swarm.wait_host()
    for name in ("trunk-a", "trunk-b"):
        swarm.join(name, "--model", str(model))
    swarm.join("alice", "--model", str(model), role="asker")
    swarm.start_trunk("trunk-a", capture=False)
    swarm.start_trunk("trunk-b", capture=False)
    swarm.wait_complete(2)


def _repacked_counts(swarm: Swarm) -> list[int]:
    """How many weights each trunk repacked at its latest load (its log's last kernels line)."""
    counts = []
    for node in swarm.nodes[1:]:
        found = re.findall(r"kernels \w+: .*\((\d+) weights repacked\)", node.log())
        counts.append(int(found[-1]) if found else -1)
    return counts


def test_a_swarm_on_repack_answers_llama_cpp_default_and_plain_after_config(tmp_path, bundled_model):
    offered = cpu_extra_buffer_types()
    if not offered:
        pytest.skip("this CPU backend offers no extra buffer types: repack is plain here")
    if AMX_BUFFER_TYPE in offered:
        pytest.skip("llama.cpp's default load uses AMX on this CPU (our `amx` choice), which has crashed on AMX Xeons")
    model = write_tiny_model(tmp_path / "llama-q4_0.gguf", LLAMA_Q4_0, bundled_model)
    swarm = Swarm(tmp_path)
    try:
        swarm.init("--model", str(model), "--head-layers", "1", "--kernels", "repack")
        _start(swarm, model)
        plan = swarm.plan(via="alice")
        assert plan["kernels"] == "repack"
        assert all(n > 0 for n in _repacked_counts(swarm)), [n.log() for n in swarm.nodes[1:]]
        r = swarmctl(swarm.homes["alice"], *ASK)
        assert r.returncode == 0, r.stderr
        assert r.stdout == _llama_answer(model, repack=True)
        assert re.search(r"head and tail: kernels repack: .*\([1-9]\d* weights repacked\)", r.stderr), r.stderr

        swarm.configure_and_wait("kernels", "plain", asker="alice")
        assert _repacked_counts(swarm) == [0, 0], "every trunk reloaded its weights plain"
        r = swarmctl(swarm.homes["alice"], *ASK)
        assert r.returncode == 0 and r.stdout == _llama_answer(model, repack=False), r.stderr
        assert "head and tail: kernels plain" in r.stderr and "(0 weights repacked)" in r.stderr, r.stderr
    finally:
        swarm.close()
