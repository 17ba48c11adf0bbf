"""What `swarmctl serve` answers from the moment it listens: 503 with Retry-After while the model
and the swarm come up, then the API's routes.

`serve` binds its port before anything else, so that a port in use fails at once. Clients that
connect while the swarm starts (a script polling for readiness) are answered at once instead of
waiting unaccepted in the listen backlog, giving up, and leaving the server to answer a client
that has gone (logged as a 500 before). The API key is checked here too: a stranger learns
nothing, not even that the server is starting.
"""

from __future__ import annotations

import logging

from swarmctl.api.anthropic_shapes import encode_error
from swarmctl.api.browser import HostPolicy
from swarmctl.api.errors import ApiError
from swarmctl.api.http import Refusal, Request, Responder
from swarmctl.api.server import ApiServer, check_head

log = logging.getLogger("swarmctl.serve")

RETRY_AFTER_S = 2  # what a client polling during start-up is told to wait between tries


class StartingServer:
    """The HTTP handler and gate of `serve`: 503 + Retry-After until ``ready`` hands it the API."""

    def __init__(self, api_key: str | None, hosts: HostPolicy | None = None) -> None:
        """``hosts``: the Host and Origin checks (swarmctl/api/browser.py; None: none)."""
        self.api_key = api_key or None
        self.hosts = hosts
        self.api: ApiServer | None = None

    def ready(self, api: ApiServer) -> None:
        self.api = api

    def check_head(self, request: Request) -> Refusal | None:
        if self.api is not None:
            return self.api.check_head(request)
        return check_head(request, self.api_key, self.hosts, bodies=False)  # (bodies are not read: 503 to all)

    async def handle(self, request: Request, responder: Responder) -> None:
        if self.api is not None:
            await self.api.handle(request, responder)
            return
        # Expected while starting, so not a warning: a poller would fill the log.
        log.debug("%s %s -> 503 (starting)", request.method, request.path[:200])
        error = ApiError(503, "the server is starting (loading the model and reaching the swarm); retry shortly",
                         type="server_error", code="starting")
        await responder.send(503, encode_error(request.path, error), headers={"Retry-After": str(RETRY_AFTER_S)})
