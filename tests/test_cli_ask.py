"""`swarmctl ask --transport inproc`, run as a real process: the answer, and bad input."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from harness.tiny_models import write_unsupported_model

PROMPT = "The three primary colours are"


def swarmctl(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "swarmctl", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_inproc_raw_greedy_completion_matches_llama_cpp(oracle):
    """The CLI's streamed text is llama-cpp-python's create_completion text, token for token."""
    want = oracle.create_completion(PROMPT, max_tokens=24, temperature=0)["choices"][0]["text"]
    r = swarmctl("ask", "--transport", "inproc", "--raw", "--temperature", "0", "--max-tokens", "24",
                 "--threads", "2", PROMPT)
    assert r.returncode == 0, r.stderr
    assert r.stdout == want + "\n"
    assert r.stderr == ""  # logs go to stderr only with -v


def test_chat_answer_streams_and_logs_to_stderr(oracle, bundled_model):
    """The chat answer is llama-cpp-python's greedy continuation of the same templated prompt. (It
    once asserted the answer's words; which colours 40 greedy tokens name differs between CPUs.)"""
    from kernels.tokenizer import Tokenizer
    from harness.oracle import oracle_greedy

    question = "Name the three primary colours."
    tokenizer = Tokenizer(bundled_model)
    want = tokenizer.decode(oracle_greedy(oracle, tokenizer.encode_chat([{"role": "user", "content": question}]), 40))
    r = swarmctl("ask", "-v", "--transport", "inproc", "--temperature", "0", "--max-tokens", "40", "--threads", "2",
                 question)
    assert r.returncode == 0, r.stderr
    assert r.stdout == want + "\n" and len(want) > 40
    assert "layers [4, 15), layers [15, 26)" in r.stderr  # head 4 / trunk 11 + 11 / tail 4


def _bad_input_cases(tmp: Path, bundled: Path) -> dict[str, tuple[list[str], str]]:
    not_gguf = tmp / "notes.gguf"
    not_gguf.write_text("these are my notes, not a model\n")
    truncated = tmp / "truncated.gguf"
    truncated.write_bytes(bundled.read_bytes()[:4096])
    unsupported = write_unsupported_model(tmp / "bert.gguf")
    return {
        "missing file": (["--model", str(tmp / "nope.gguf")], "model file not found"),
        "not GGUF": (["--model", str(not_gguf)], "is not a GGUF file"),
        "truncated GGUF": (["--model", str(truncated)], "truncated"),
        "unsupported architecture": (["--model", str(unsupported)], "architecture 'bert' is not supported"),
        "head layers beyond the model": (["--head-layers", "20"], "needs 40 layers; the model has 30"),
        "more stages than layers": (["--stages", "40"], "cannot split 22 trunk layers into 40 stages"),
        "prompt longer than the context": (["--ctx", "16", "--raw"], "context length is 16"),
        "zero max tokens": (["--max-tokens", "0"], "must be a positive number"),
        "negative max tokens": (["--max-tokens", "-3"], "must be a positive number"),
        "bad top-p": (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
    }


CASES = ["missing file", "not GGUF", "truncated GGUF", "unsupported architecture", "head layers beyond the model",
         "more stages than layers", "prompt longer than the context", "zero max tokens", "negative max tokens",
         "bad top-p"]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_gets_one_line_and_nonzero_exit(tmp_path, bundled_model, case):
    args, expected = _bad_input_cases(tmp_path, bundled_model)[case]
    prompt = "word " * 40 if "context" in case else "hello"
    r = swarmctl("ask", "--transport", "inproc", *args, prompt)
    assert r.returncode != 0
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr
    assert expected in lines[0]


def test_unknown_command_and_help():
    r = swarmctl("frobnicate")
    assert r.returncode == 2 and "unknown command 'frobnicate'" in r.stderr
    r = swarmctl("--help")
    assert r.returncode == 0 and "ask" in r.stdout


@pytest.mark.parametrize("prompt", ["", "   ", "\n\t "])
def test_an_empty_prompt_is_refused_in_one_line(prompt):
    """Before, `ask ""` was accepted and answered whatever the chat template alone led to."""
    r = swarmctl("ask", "--transport", "inproc", prompt)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == ['swarmctl ask: the prompt is empty (give the question as an argument: '
                                             'swarmctl ask "...")'], r.stderr


def test_max_tokens_past_the_context_says_where_it_stops_and_goes_on():
    """--max-tokens beyond the context was cut silently; now one line says where the answer
    stops, and it stops exactly there: the same text as asking for that many tokens."""
    args = ("ask", "--transport", "inproc", "--raw", "--temperature", "0", "--threads", "2", "--ctx", "32")
    prompt = "Once upon a time, in a land far away, there lived a"  # 14 tokens
    r = swarmctl(*args, "--max-tokens", "100", prompt)
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines() == ["swarmctl ask: note: --max-tokens 100 goes past the context: the prompt takes "
                                     "14 of its 32 tokens, so the answer stops after at most 19 (--ctx sets the "
                                     "context)"], r.stderr
    exact = swarmctl(*args, "--max-tokens", "19", prompt)
    assert exact.returncode == 0 and exact.stderr == "", exact.stderr  # 19 fit: no note
    assert r.stdout == exact.stdout and r.stdout.strip()


def test_the_context_note():
    from swarmctl.commands.ask import context_note

    assert context_note(14, 19, 32) == "" and context_note(14, 20, 32).endswith("stops after at most 19 (--ctx "
                                                                                 "sets the context)")
    assert context_note(31, 2, 32) == "" and "at most 2" in context_note(31, 3, 32)
    assert context_note(32, 100, 32) == ""  # no room at all: the asker refuses the prompt instead
