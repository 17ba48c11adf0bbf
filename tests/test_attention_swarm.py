"""`attention` as a swarm setting, with real processes: set at `init`, carried in the plan, applied by
every stage and the asker's head and tail, changed with `swarmctl config`.

A two-trunk swarm on the bundled model set to flash answers exactly what llama-cpp-python with
``flash_attn=True`` answers; set back to plain with `config`, every trunk loads its stage again
and it answers what llama-cpp-python without flash attention answers. On this model and prompt
the two answers differ (checked), so the answers alone tell which attention ran; each member's log
line says it too. The bits in one process: tests/test_flash_attention.py.
"""

from __future__ import annotations

import re

from harness.swarm import Swarm, swarmctl
from kernels.oracle_llama import load_llama
from tests.conftest import N_THREADS
from tests.test_kernels_swarm import ASK, PROMPT, _start


def _llama_answer(model, flash: bool) -> str:
    llm = load_llama(model, n_ctx=512, n_threads=N_THREADS, n_threads_batch=N_THREADS, flash_attn=flash)
    try:
        return llm.create_completion(PROMPT, max_tokens=16, temperature=0)["choices"][0]["text"] + "\n"
    finally:
        llm.close()


def _attention_lines(swarm: Swarm) -> list[str]:
    """Each trunk's attention at its latest load (its log's last attention line)."""
    found = [re.findall(r"weights repacked\); (attention \w+)", node.log()) for node in swarm.nodes[1:]]
    return [f[-1] if f else "" for f in found]


def test_a_swarm_on_flash_answers_llama_cpp_with_flash_attention_and_plain_after_config(tmp_path, bundled_model):
    flash, plain = _llama_answer(bundled_model, True), _llama_answer(bundled_model, False)
    assert flash != plain
    swarm = Swarm(tmp_path)
    try:
        swarm.init("--model", str(bundled_model), "--head-layers", "1", "--attention", "flash")
        _start(swarm, bundled_model)
        assert swarm.plan(via="alice")["attention"] == "flash"
        assert _attention_lines(swarm) == ["attention flash"] * 2, [n.log() for n in swarm.nodes[1:]]
        r = swarmctl(swarm.homes["alice"], *ASK)
        assert r.returncode == 0, r.stderr
        assert r.stdout == flash
        assert re.search(r"head and tail: .*; attention flash", r.stderr), r.stderr

        swarm.configure_and_wait("attention", "plain", asker="alice")
        assert _attention_lines(swarm) == ["attention plain"] * 2, "every trunk loaded its stage again"
        r = swarmctl(swarm.homes["alice"], *ASK)
        assert r.returncode == 0 and r.stdout == plain, r.stderr
        assert re.search(r"head and tail: .*; attention plain", r.stderr), r.stderr
    finally:
        swarm.close()
