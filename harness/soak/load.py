"""The soak's load: `swarmctl ask` processes coming and going from two members' homes, and
streaming HTTP clients of `swarmctl serve`, each starting a request, waiting for its end and
pausing, until the load's time or its count of requests is up. Every request ends as "ok" (its
prompt's reference text), "wrong" (other text), "failed" (an error the client was told) or "lost"
(no answer and no error by the soak's deadline: the process is killed or the connection dropped)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
from collections.abc import Sequence

from harness.soak.config import Config, Prompt
from harness.soak.http import HttpError, api_request
from harness.soak.records import Clock, Request
from harness.soak.swarm import SoakSwarm, last_line
from harness.swarm import die_with_this_process

CLIENT_STAGGER_S = 0.5  # clients start this far apart: a cold start of them all at once is not the steady state
OUTPUT_READ_S = 10.0  # an `ask` process that has exited: its output is read within this


class LoadGenerator:
    def __init__(self, config: Config, prompts: Sequence[Prompt], swarm: SoakSwarm, clock: Clock) -> None:
        self.config = config
        self.prompts = prompts
        self.swarm = swarm
        self.clock = clock
        self.rng = random.Random(config.seed)
        self.max_requests = config.request_limit
        self.references: list[str] = []  # each prompt's expected text, set before the load starts
        self.model_id = ""  # as `serve` names it, read before the load starts
        self.requests: list[Request] = []
        self.children: set[asyncio.subprocess.Process] = set()  # `ask` processes running now
        self.interrupted = False

    def in_flight(self) -> int:
        return sum(1 for r in self.requests if r.outcome is None)

    async def read_model_id(self) -> None:
        status, body = await api_request(self.swarm.serve_port, "/v1/models", None)
        self.model_id = json.loads(body)["data"][0]["id"]

    def start_clients(self) -> list[asyncio.Future]:
        """--askers `ask` clients from the asker's home, --friend-askers from the friend's, then
        --api-clients HTTP clients; each ends when the load does."""
        c = self.config
        members = [*["asker"] * c.askers, *["friend"] * c.friend_askers, *[None] * c.api_clients]
        return [asyncio.ensure_future(self.ask_client(member, CLIENT_STAGGER_S * i) if member
                                      else self.api_client(CLIENT_STAGGER_S * i))
                for i, member in enumerate(members)]

    def kill_children(self) -> None:
        for proc in list(self.children):
            if proc.returncode is None:
                try:
                    proc.kill()
                except ProcessLookupError:
                    pass

    # --- requests ---

    def _may_start(self) -> bool:
        return not self.interrupted and self.clock.now() < self.config.load_s \
            and len(self.requests) < self.max_requests

    def _new_request(self, channel: str) -> Request:
        req = Request(len(self.requests), channel, self.rng.randrange(len(self.prompts)), self.clock.now())
        self.requests.append(req)
        return req

    def _finish(self, req: Request, outcome: str, cause: str | None = None, got: str | None = None,
                clear: bool | None = None) -> None:
        req.ended_s = self.clock.now()
        if outcome == "ok" and got != self.references[req.prompt]:
            outcome, cause = "wrong", "the text differs from the reference answer"
        req.outcome, req.cause, req.clear_error = outcome, cause, clear
        if outcome == "wrong":
            req.got = got

    # --- `swarmctl ask` ---

    async def ask_client(self, member: str, delay: float) -> None:
        await asyncio.sleep(delay)
        while self._may_start():
            req = self._new_request(f"ask:{member}")
            await self.run_ask(req, member)
            await asyncio.sleep(self.rng.uniform(0, self.config.pause_s))

    async def run_ask(self, req: Request, member: str) -> None:
        mode, text, max_tokens = self.prompts[req.prompt]
        args = [sys.executable, "-m", "swarmctl", "ask", "--temperature", "0", "--max-tokens", str(max_tokens),
                "--threads", str(self.config.threads), *(["--raw"] if mode == "raw" else []), text]
        env = {**os.environ, "SWARMCTL_HOME": str(self.swarm.homes[member]), "OMP_WAIT_POLICY": "PASSIVE"}
        proc = await asyncio.create_subprocess_exec(*args, env=env, stdin=asyncio.subprocess.DEVNULL,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                                                    preexec_fn=die_with_this_process())
        self.children.add(proc)
        out_task = asyncio.ensure_future(proc.stdout.read())
        err_task = asyncio.ensure_future(proc.stderr.read())
        timed_out = False
        try:
            try:
                await asyncio.wait_for(proc.wait(), self.config.deadline_s)
            except asyncio.TimeoutError:
                timed_out = True
                proc.kill()
                await proc.wait()
            out, err = await asyncio.wait_for(asyncio.gather(out_task, err_task), OUTPUT_READ_S)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            self.children.discard(proc)
        self._ask_ended(req, proc.returncode, out, err.decode(errors="replace"), timed_out)

    def _ask_ended(self, req: Request, returncode: int | None, out: bytes, err_text: str, timed_out: bool) -> None:
        if timed_out:
            tail = " | ".join(line.strip() for line in err_text.strip().splitlines()[-3:]) or "nothing"
            self._finish(req, "lost", f"no answer within the {self.config.deadline_s:.0f}s deadline (killed; "
                                      f"{len(out)} bytes of answer had arrived; stderr ends: {tail})")
        elif returncode != 0:
            line = last_line(err_text)
            self._finish(req, "failed", f"exit {returncode}: {line or 'no message'}",
                         clear=bool(line) and "Traceback" not in err_text)
        else:
            out_text = out.decode(errors="replace")
            self._finish(req, "ok", got=out_text[:-1] if out_text.endswith("\n") else out_text)

    # --- `swarmctl serve` ---

    async def api_client(self, delay: float) -> None:
        await asyncio.sleep(delay)
        while self._may_start():
            req = self._new_request("api")
            await self.run_api(req)
            await asyncio.sleep(self.rng.uniform(0, self.config.pause_s))

    async def run_api(self, req: Request) -> None:
        """Chat prompts through /v1/chat/completions (the model's chat template, as `ask` uses it),
        raw ones through /v1/completions (as `ask --raw`)."""
        mode, text, max_tokens = self.prompts[req.prompt]
        body: dict = {"model": self.model_id, "temperature": 0, "max_tokens": max_tokens, "stream": True}
        if mode == "chat":
            body["messages"] = [{"role": "user", "content": text}]
            path, req.channel = "/v1/chat/completions", "api:chat"
        else:
            body["prompt"] = text
            path, req.channel = "/v1/completions", "api:completions"
        try:
            status, answer = await asyncio.wait_for(
                api_request(self.swarm.serve_port, path, body, req, self.clock.t0), self.config.deadline_s)
        except asyncio.TimeoutError:
            self._finish(req, "lost", f"no answer within the {self.config.deadline_s:.0f}s deadline "
                                      f"(connection closed)")
            return
        except HttpError as e:
            self._finish(req, "failed", str(e), clear=str(e).startswith("error event"))
            return
        except (ConnectionError, OSError, asyncio.IncompleteReadError, ValueError) as e:
            self._finish(req, "failed", f"{type(e).__name__}: {e}", clear=False)
            return
        if status != 200:
            self._finish(req, "failed", f"HTTP {status}: {answer}", clear=bool(answer))
        else:
            self._finish(req, "ok", got=answer)
