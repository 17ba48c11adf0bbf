"""`swarmctl chat --transport inproc`, a real process driven through its stdin: each answer is
llama-cpp-python's greedy continuation of the whole conversation so far (so a later turn is
answered with the earlier ones in its prompt, from the kept prefix of the turn before), /system,
/save's file, /clear, Ctrl-C, bad input."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

MAX_TOKENS = 24
PROMPT = b">>> "
CHAT = ("chat", "--transport", "inproc", "--temperature", "0", "--threads", "2")


def start_chat(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "swarmctl", *CHAT, *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def chat(lines: list[str], *args: str) -> subprocess.CompletedProcess:
    process = start_chat("--max-tokens", str(MAX_TOKENS), *args)
    out, err = process.communicate("".join(line + "\n" for line in lines), timeout=300)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def saved(path: Path) -> list[dict]:
    return json.loads(path.read_text())["messages"]


def greedy_answer(oracle, tokenizer, messages: list[dict], n: int = MAX_TOKENS) -> str:
    from harness.oracle import oracle_greedy

    return tokenizer.decode(oracle_greedy(oracle, tokenizer.encode_chat(messages), n))


def test_turns_see_the_conversation_and_system_save_clear_work(tmp_path, oracle, bundled_model):
    from kernels.tokenizer import Tokenizer

    first, second = tmp_path / "first.json", tmp_path / "second.json"
    r = chat(["/system You are a terse assistant.", "My favourite colour is green.", "What is my favourite colour?",
              f"/save {first}", "/clear", "What is my favourite colour?", f"/save {second}", "/exit",
              "never read: the chat has ended"], "-v")
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    before, after = saved(first), saved(second)
    assert [m["role"] for m in before] == ["system", "user", "assistant", "user", "assistant"]
    assert before[0]["content"] == "You are a terse assistant."
    assert [m["role"] for m in after] == ["system", "user", "assistant"]  # /clear kept the system message
    assert after[1] == before[3]
    assert oct(first.stat().st_mode & 0o777) == "0o600"
    tokenizer = Tokenizer(bundled_model)
    for conversation in (before, after):
        for i, message in enumerate(conversation):
            if message["role"] == "assistant":  # the answer to everything before it, the earlier answers included
                assert message["content"] == greedy_answer(oracle, tokenizer, conversation[:i]), i
    answers = [m["content"] for m in before[2::2] + after[2:]]
    assert r.stdout == "".join(a + "\n" for a in answers)  # answers alone on stdout; notes on stderr
    assert f"conversation saved to {first}" in r.stderr and "conversation cleared" in r.stderr
    # Each turn started from the previous turn's kept prompt (the answers above are still the oracle's).
    reused = [int(n) for n in re.findall(r"\((\d+) from the kept prefix\)", r.stderr)]
    assert len(reused) == 3 and reused[0] == 0 and reused[1] > 0, r.stderr


def test_ctrl_c_stops_the_answer_and_the_chat_goes_on(tmp_path, oracle, bundled_model):
    from kernels.tokenizer import Tokenizer

    path = tmp_path / "chat.json"
    process = start_chat("--max-tokens", "2000")
    try:
        process.stdin.write("Count from 1 to 1000, one number per line.\n")
        process.stdin.flush()
        assert process.stdout.read(1)  # the answer has begun streaming
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(f"Say hello.\n/save {path}\n", timeout=300)  # then Ctrl-D
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, err
    assert "(answer stopped)" in err and "Traceback" not in err
    messages = saved(path)
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    stopped = messages[1]["content"]
    tokenizer = Tokenizer(bundled_model)
    assert 0 < len(tokenizer.encode_prompt(stopped)) < 2000  # stopped part-way (the rest was never generated)
    assert messages[3]["content"] == greedy_answer(oracle, tokenizer, messages[:3], 2000)


class Terminal:
    """`swarmctl chat` on a pseudo-terminal of its own: a Ctrl-C typed there is the terminal's
    SIGINT to the chat's whole process group, its local swarm's nodes included unless they are
    in a group of their own (as a user at a terminal sends it)."""

    def __init__(self, *args: str) -> None:
        self.pid, self.fd = os.forkpty()
        if self.pid == 0:  # the child: the chat, its stdin and stdout the terminal
            os.execv(sys.executable, [sys.executable, "-m", "swarmctl", "chat", *args])
        self.screen = b""

    def read_until(self, done, bound_s: float = 300) -> bytes:
        """What the terminal shows once ``done(screen)``; the bound only keeps a hang from lasting."""
        import select
        import time

        deadline = time.monotonic() + bound_s
        while not done(self.screen):
            assert time.monotonic() < deadline, self.screen.decode(errors="replace")[-2000:]
            if select.select([self.fd], [], [], 1)[0]:
                try:
                    self.screen += os.read(self.fd, 65536)
                except OSError:  # the chat has ended and the terminal closed
                    break
        return self.screen

    def type(self, text: bytes) -> None:
        os.write(self.fd, text)

    def close(self) -> int:
        self.read_until(lambda screen: False if self._alive() else True, 60)
        _, status = os.waitpid(self.pid, 0)
        os.close(self.fd)
        return os.waitstatus_to_exitcode(status)

    def _alive(self) -> bool:
        return os.waitpid(self.pid, os.WNOHANG) == (0, 0)


def test_ctrl_c_at_a_terminal_stops_the_answer_and_the_local_swarm_serves_the_next(tmp_path):
    """The default transport: a local swarm (host and trunk processes) behind the chat. Ctrl-C
    typed at the terminal once stopped the answer and the swarm with it, so the next turn waited
    on routes that were gone."""
    terminal = Terminal("--temperature", "0", "--max-tokens", "300")
    try:
        terminal.read_until(lambda screen: screen.count(PROMPT) == 1)
        terminal.type(b"Count from 1 to 1000, one number per line.\r")
        terminal.read_until(lambda screen: screen.split(PROMPT)[-1].count(b"\n") >= 3)  # the answer has begun
        terminal.type(b"\x03")
        terminal.read_until(lambda screen: screen.count(PROMPT) == 2)
        terminal.type(b"Say hello.\r")
        screen = terminal.read_until(lambda screen: screen.count(PROMPT) == 3 or b"route failed" in screen)
        terminal.type(b"/exit\r")
    finally:
        status = terminal.close()
    assert status == 0
    text = screen.decode(errors="replace")
    assert "(answer stopped)" in text and "route failed" not in text and "Traceback" not in text
    hello = text.split(">>> ")[2].split("\n", 1)[1]  # after the echoed question
    assert hello.strip(), text


def test_bad_input_is_one_line_and_the_chat_goes_on(tmp_path):
    r = chat(["/nope", f"/save {tmp_path / 'missing-dir' / 'x.json'}", "/save", f"/save {tmp_path / 'ok.json'}"])
    assert r.returncode == 0 and r.stdout == ""
    lines = r.stderr.splitlines()
    assert lines[0] == "swarmctl chat: unknown command /nope (/help lists them)"
    assert lines[1].startswith("swarmctl chat: cannot save to ") and "No such file or directory" in lines[1]
    assert lines[2] == "swarmctl chat: /save needs a file name: /save FILE"
    assert saved(tmp_path / "ok.json") == []

    r = chat(["word " * 80, f"/save {tmp_path / 'long.json'}"], "--ctx", "48")
    assert r.returncode == 0 and r.stdout == ""
    assert "more than the context length (48): /clear to start over" in r.stderr and "Traceback" not in r.stderr
    assert saved(tmp_path / "long.json") == []  # the turn that did not fit is not kept

    r = subprocess.run([sys.executable, "-m", "swarmctl", *CHAT, "--top-p", "2"], capture_output=True, text=True,
                       stdin=subprocess.DEVNULL, timeout=60)
    assert (r.returncode, r.stderr) == (2, "--top-p must be in (0, 1]\n")


@pytest.mark.parametrize("line, name, argument", [
    ("hello", "", "hello"), ("  /system  Be brief. ", "system", "Be brief."), ("/system", "system", ""),
    ("/BYE", "exit", ""), ("//etc/hosts is a file", "", "/etc/hosts is a file"), ("/save a b.json", "save", "a b.json"),
])
def test_lines_parse_into_commands_or_messages(line, name, argument):
    from swarmctl.chat.conversation import parse_line

    command = parse_line(line)
    assert (command.name, command.argument) == (name, argument)
