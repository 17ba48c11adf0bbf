"""A real swarm with a web mirror of its model's parts (``swarmctl init --model-url``): a trunk with
no model file fetches its slice, and an asker with none its part, from the mirror and the host at
once, the asker's mostly from the mirror; the swarm answers as llama-cpp-python on the parts. (Bad mirrors: tests/test_fetch_sources.py.)"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from aiohttp import web

from harness.swarm import Swarm, swarmctl
from harness.tiny_models import write_split_copy
from kernels.gguf_file import GGUFFile
from swarmctl.model_files.distribution import asker_tensor_names
from tests.conftest import make_oracle

PROMPT = "The capital of France is"


class Mirror:
    """The files of ``folder`` over HTTP on 127.0.0.1, Range requests answered (aiohttp's
    FileResponse), in a thread of its own; counts the bytes it was asked for."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.url = ""
        self.requests: list[str] = []
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True)

    async def _file(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(request.headers.get("Range", ""))
        path = self.folder / request.match_info["name"]
        if not path.is_file():
            raise web.HTTPNotFound()
        return web.FileResponse(path)

    async def _serve(self) -> None:
        app = web.Application()
        app.router.add_get("/models/{name}", self._file)
        runner = web.AppRunner(app, shutdown_timeout=0.5)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{runner.addresses[0][1]}/models/"
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        self._ready.set()
        await self._stop.wait()
        await runner.cleanup()

    def __enter__(self) -> "Mirror":
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(5)


def shares_in(log: str, what: str = "fetched the asker's part") -> dict[str, int]:
    """Each source's share of the bytes, from the fetch's last line."""
    line = next(ln for ln in log.splitlines() if what in ln)
    return {part.split(" from the ")[1].strip(): int(part.split("%")[0].strip())
            for part in line.split("MB): ", 1)[1].split("; ")}


def test_a_trunk_and_an_asker_fetch_mostly_from_the_mirror_and_the_answer_is_the_same(tiny_model, tmp_path):
    parts = write_split_copy(tiny_model("llama-q8_0"), tmp_path / "parts" / "tiny-llama.gguf", 3)
    swarm = Swarm(tmp_path / "swarm")
    with Mirror(parts[0].parent) as mirror:
        try:
            swarm.init("--model", str(parts[1]), "--head-layers", "1", "--model-url", mirror.url)
            swarm.start_host()
            swarm.wait_host()
            swarm.join("trunk-a", "--model", str(parts[2]))
            swarm.join("trunk-b", "--model", str(tmp_path / "no-such-model.gguf"))
            swarm.join("asker", role="asker")
            swarm.start_trunk("trunk-a", capture=False)
            swarm.wait_complete(1)
            trunk_b = swarm.start_trunk("trunk-b", capture=False)
            swarm.wait_complete(2)
            question = ("ask", "--raw", "--temperature", "0", "--max-tokens", "8", "-v", PROMPT)
            first = swarmctl(swarm.homes["asker"], *question, timeout=300)
            assert first.returncode == 0, first.stderr
        finally:
            swarm.close()
    shares = shares_in(first.stderr)
    # (the trunk's slice is a few small tensors: whichever source answers first sends most of it)
    assert sum(shares_in(trunk_b.log(), "fetched layers").values()) in (99, 100, 101), trunk_b.log()
    assert shares.get("mirror", 0) >= 50, first.stderr
    assert mirror.requests and all(r.startswith("bytes=") for r in mirror.requests)
    part = next((swarm.homes["asker"] / "parts").glob("*-asker-1.gguf"))
    with GGUFFile(part) as mine, GGUFFile(parts[0]) as whole:
        wanted = asker_tensor_names(whole, 1)
        assert sorted(mine.tensors) == sorted(wanted)
        assert all(mine.tensor_hash(n) == whole.tensor_hash(n) for n in wanted)
    llm = make_oracle(parts[0])
    try:
        want = llm.create_completion(PROMPT, max_tokens=8, temperature=0)["choices"][0]["text"]
    finally:
        llm.close()
    assert first.stdout == want + "\n"
