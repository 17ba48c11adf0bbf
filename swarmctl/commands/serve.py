"""Serve the model over an OpenAI-compatible HTTP API.

This machine is the asker: the embedding, the first and last layers and the LM head run here,
the trunk on the swarm. With no swarm joined, a local one runs for as long as the server does
(as with `swarmctl ask`); --transport inproc runs every slice in this process. Requests that
arrive together go through the pipeline together, in shared batches.

routes: GET /v1/models, POST /v1/chat/completions, POST /v1/completions ("stream": true or not);
GET / says what the server is. The model's id is its file name without .gguf (e.g.
SmolLM2-135M-Instruct.Q4_1). While the model loads and the swarm comes up, every request is
answered 503 with a Retry-After header; "serving ..." is printed once it is ready.

It listens on loopback unless told otherwise. Anywhere else, give it an API key (--api-key, or
$SWARMCTL_API_KEY, which keeps the key out of the process list); clients send it as
"Authorization: Bearer KEY". With --tls-cert and --tls-key (PEM files) it serves HTTPS, so the
key and the conversation are not sent in the clear.

Web pages of other origins are kept out: it answers only requests whose Host is a loopback name
or address, the address it listens on, or a name given with --allow-host (a page that re-points
its own name at this machine, DNS rebinding, gets 421); a browser request from another origin
gets 403, and a POST body must be sent as Content-Type: application/json (415 otherwise).

examples:
  swarmctl serve
  swarmctl serve --port 8080 --api-key "$(openssl rand -hex 16)"
  SWARMCTL_API_KEY=... swarmctl serve --host 0.0.0.0
  swarmctl serve --host 0.0.0.0 --tls-cert cert.pem --tls-key key.pem --api-key "$KEY"
  swarmctl serve --host 0.0.0.0 --allow-host gpu-box.lan --api-key "$KEY"   (clients use http://gpu-box.lan:8000)
  swarmctl serve --trace traces/     (one Chrome trace-event JSON per request, for ui.perfetto.dev)

  python -c 'from openai import OpenAI
  client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")
  print(client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1",
        messages=[{"role": "user", "content": "Hi!"}]).choices[0].message.content)'
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import signal
import socket
import ssl
import sys
from pathlib import Path

from swarmctl.commands.options import add_asker_options, positive_int
from swarmctl.errors import UsageError

log = logging.getLogger("swarmctl.serve")

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this "
                                                            "machine only)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0: any free port)")
    parser.add_argument("--api-key", metavar="KEY", default=None,
                        help="require 'Authorization: Bearer KEY' (default: $SWARMCTL_API_KEY; none: no check)")
    add_asker_options(parser, model_default="the swarm's, or the bundled SmolLM2-135M-Instruct")
    parser.add_argument("--max-in-flight", type=positive_int, default=16, metavar="N",
                        help="requests generating at once (default 16); more wait for a free slot")
    parser.add_argument("--timeout", type=positive_int, default=600, metavar="S",
                        help="seconds a request may take, waiting for a slot included (default 600)")
    parser.add_argument("--max-connections", type=positive_int, default=64, metavar="N",
                        help="client connections open at once (default 64; a quarter per client address until it shows the key); more are answered 503 and closed unless they carry the key")
    parser.add_argument("--allow-host", metavar="NAME", action="append", default=[],
                        help="a host name clients may reach this server by, besides loopback names and addresses and "
                             "the address it listens on (repeatable; '*': any name, which lets DNS-rebinding pages "
                             "in)")
    parser.add_argument("--tls-cert", metavar="PEM", default=None,
                        help="serve HTTPS with this certificate (chain), together with --tls-key")
    parser.add_argument("--tls-key", metavar="PEM", default=None, help="the certificate's private key")
    parser.add_argument("--ui", action=argparse.BooleanOptionalAction, default=None,
                        help="a web page at / : a chat through this API and a view of the swarm (default: on when "
                             "listening on loopback, off otherwise; with a key, the browser asks for it)")
    parser.add_argument("--trace", metavar="DIR", default=None,
                        help="write each request's per-token trace (this machine, every stage, every crossing) "
                             "into DIR as REQUEST_ID.json (Chrome trace-event JSON, for ui.perfetto.dev); DIR is "
                             "made if missing")


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        raise UsageError("--port must be between 0 and 65535")
    if (args.tls_cert is None) != (args.tls_key is None):
        raise UsageError("--tls-cert and --tls-key go together: give both, or neither for plain HTTP")
    api_key = args.api_key or os.environ.get("SWARMCTL_API_KEY") or None
    if args.trace is not None:
        from swarmctl.asker.trace import check_trace_dir

        check_trace_dir(args.trace)  # before anything starts: a folder that cannot be written is one line at once
    # Checked before anything starts: a certificate that cannot be used stops the command at once.
    if args.tls_cert:
        from swarmctl.api.http import tls_context

        tls = tls_context(args.tls_cert, args.tls_key)
    else:
        tls = None
    if not is_loopback(args.host) and api_key is None:
        print(open_server_warning(args.host), file=sys.stderr, flush=True)
    # Bind before starting the swarm: a port in use fails at once, and clients that connect while
    # the model loads wait in the listen backlog instead of being refused.
    try:
        listener = socket.create_server((args.host, args.port),
                                        family=socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    except OSError as e:
        raise OSError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    try:
        return asyncio.run(_serve(args, listener, api_key, tls))
    finally:
        listener.close()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve anywhere


def open_server_warning(host: str) -> str:
    bar = "!" * 78
    return (f"{bar}\n"
            f"swarmctl: WARNING: serving on {host} WITHOUT AN API KEY. Anyone who can reach this address\n"
            f"can use this model and your friends' machines. Pass --api-key KEY (or set SWARMCTL_API_KEY).\n"
            f"{bar}")


async def _serve(args: argparse.Namespace, listener: socket.socket, api_key: str | None,
                 tls: ssl.SSLContext | None) -> int:
    from swarmctl.api.browser import HostPolicy
    from swarmctl.api.errors import http_error_body
    from swarmctl.api.http import Limits, start_server
    from swarmctl.api.server import ApiServer, ApiSettings
    from swarmctl.api.startup import StartingServer
    from swarmctl.asker.session import SessionOptions, open_session
    from swarmctl.asker.trace import TraceFolder

    options = SessionOptions(transport=args.transport, model=args.model, trunk_nodes=args.trunk_nodes,
                             head_layers=args.head_layers, stages=args.stages, threads=args.threads, ctx=args.ctx,
                             max_in_flight=args.max_in_flight, streams=args.max_in_flight, verify=args.verify,
                             device=args.device, speculate=args.speculate, draft_model=args.draft_model,
                             draft_tokens=args.draft_tokens, trace=args.trace is not None)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):  # stop cleanly: the local swarm must be shut down
        loop.add_signal_handler(sig, stop.set)
    # Answer from now on: 503 with Retry-After while the model loads and the swarm comes up.
    hosts = HostPolicy(listen=args.host, names=tuple(args.allow_host))
    front = StartingServer(api_key, hosts)
    http_server = await start_server(front.handle, error_body=http_error_body, gate=front.check_head, sock=listener,
                                     tls=tls, limits=Limits(max_connections=args.max_connections))
    host, port = listener.getsockname()[:2]
    url_host = f"[{host}]" if ":" in host else host
    scheme = "https" if tls else "http"
    log.info("listening at %s://%s:%d (503 until the model is ready)", scheme, url_host, port)
    try:
        async with open_session(options) as session:
            model_id = session.model.name.removesuffix(".gguf")
            traces = TraceFolder(Path(args.trace), session.model.name, session.describe_nodes) \
                if args.trace is not None else None
            wire = getattr(getattr(session.trunk, "link", session.trunk), "dtype", None)
            front.ready(ApiServer(session.asker, session.trunk, model_id,
                                  ApiSettings(api_key=api_key, created=int(session.model.stat().st_mtime),
                                              request_timeout=args.timeout, drafting=session.drafting,
                                              traces=traces, nodes=session.describe_nodes, hosts=hosts,
                                              ui=is_loopback(args.host) if args.ui is None else args.ui,
                                              wire_dtype=wire.label if wire is not None else "in process")))
            print(f"serving {model_id} at {scheme}://{url_host}:{port}/v1 (OpenAI-compatible; Anthropic clients: "
                  f"the same address without /v1; Ctrl-C to stop)", flush=True)
            try:
                await stop.wait()
            finally:
                http_server.close()
                await _end_connections()
    finally:
        http_server.close()  # a session that failed to open: stop answering 503 before the error is shown
    return 0


async def _end_connections() -> None:
    """Cancel the connections still open (their requests release themselves) before the session,
    and with it the local swarm, closes under them."""
    tasks = asyncio.all_tasks() - {asyncio.current_task()}
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
