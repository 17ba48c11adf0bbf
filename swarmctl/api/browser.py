"""What keeps web pages of other origins out of `serve`, checked on a request's head.

A keyless `serve` on loopback trusts whoever can connect, and a browser on the same machine can
be made to connect by any page it shows: a hidden form posting ``text/plain``, or a no-cors
``fetch``, delivers a body without the page ever reading the answer (a CSRF: enough to spend the
swarm, or to send a request that hurts it); a name the attacker controls, re-pointed at 127.0.0.1
after the page has loaded (DNS rebinding), makes the page same-origin with the server, answers
and all. So, before the body is read:

- ``Host`` must name this server: a loopback name or address, the address it listens on (any
  address when that is a wildcard: a rebinding page always comes by a name), or a name given
  with ``serve --allow-host`` (``*``: any). Otherwise 421. A request without ``Host`` (HTTP/1.0)
  did not come from a browser and passes.
- ``Origin``, which browsers send on every POST and on any cross-origin request, must be this
  server's own (the scheme's host and port those of ``Host``); ``null`` or another origin is 403.
- A POST body must be declared ``application/json``: no form or no-cors request can send that
  without the server's consent (it would need a CORS preflight, which `serve` never grants).
  Anything else, or none, is 415.

The page itself (``swarmctl/api/ui/index.html``) goes out with ``PAGE_HEADERS``: a Content
Security Policy allowing only its own inline script and style (by hash) and requests to its own
origin, ``X-Frame-Options: DENY`` (no other site can frame it to trick a click), and
``X-Content-Type-Options: nosniff``.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import re
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from urllib.parse import urlsplit

from swarmctl.api.errors import ApiError
from swarmctl.api.http import Request

LOOPBACK_NAMES = ("localhost",)
DEFAULT_PORTS = {"http": 80, "https": 443}
JSON_MEDIA_TYPE = "application/json"


@dataclass(frozen=True)
class HostPolicy:
    """The names and addresses `serve` answers for (its ``Host`` check)."""

    listen: str = "127.0.0.1"  # the address it listens on (serve --host)
    names: tuple[str, ...] = ()  # serve --allow-host: more names it may be reached by ("*": any)

    def allows(self, host: str) -> bool:
        """``host``: a Host header's host part, without the port (IPv6 without brackets)."""
        name = host.lower().rstrip(".")
        if "*" in self.names or name in LOOPBACK_NAMES or name in (n.lower().rstrip(".") for n in self.names):
            return True
        listen = self.listen.lower().rstrip(".")
        address = _ip(name)
        if address is None:
            return name == listen  # serve --host NAME
        bound = _ip(listen)
        return address.is_loopback or (bound is not None and (bound.is_unspecified or address == bound))


def check_browser(request: Request, hosts: HostPolicy | None) -> ApiError | None:
    """A request from a web page of another origin, or by a name this server does not answer
    for: the error to refuse it with (None: let it through). ``hosts`` None: no Host or Origin
    check (a server embedded in tests)."""
    if hosts is None:
        return None
    host_header = request.headers.get("host")
    if host_header is not None:
        host, _ = split_authority(host_header)
        if host is None or not hosts.allows(host):
            return ApiError(421, f"this server does not answer for the host {host_header[:100]!r}: it answers for "
                                 f"loopback names and addresses, the address it listens on, and names given with "
                                 f"serve --allow-host", code="host_not_allowed")
    origin = request.headers.get("origin")
    if origin is not None and not _same_origin(origin, host_header):
        return ApiError(403, f"requests from the web page at {origin[:100]!r} are refused: only this server's own "
                             f"page may call it from a browser", code="origin_not_allowed")
    return None


def check_json_body(request: Request) -> ApiError | None:
    """A POST whose body is not declared JSON: 415 (what forms and no-cors fetches send)."""
    if request.method != "POST":
        return None
    declared = request.headers.get("content-type", "")
    if declared.partition(";")[0].strip().lower() == JSON_MEDIA_TYPE:
        return None
    shown = f"Content-Type {declared[:100]!r}" if declared else "no Content-Type"
    return ApiError(415, f"request bodies must be JSON sent with Content-Type: {JSON_MEDIA_TYPE} (this one has "
                         f"{shown})", code="unsupported_media_type")


def split_authority(value: str) -> tuple[str | None, int | None]:
    """``host[:port]`` (IPv6 in brackets) → (host, port); (None, None) when it cannot be read."""
    m = _AUTHORITY.fullmatch(value.strip())
    if m is None:
        return None, None
    host = m["v6"] if m["v6"] is not None else m["name"]
    port = int(m["port"]) if m["port"] else None
    if port is not None and port > 65535:
        return None, None
    return host, port


_AUTHORITY = re.compile(r"(?:\[(?P<v6>[0-9A-Fa-f:.]+(?:%[\w.~-]+)?)\]|(?P<name>[\w.~-]+))(?::(?P<port>\d{1,5}))?")


def _same_origin(origin: str, host_header: str | None) -> bool:
    """Whether ``origin`` (scheme://host[:port]) is the origin the request was sent to (its Host)."""
    if host_header is None:
        return False
    parts = urlsplit(origin.strip())
    if parts.scheme not in DEFAULT_PORTS or parts.path or parts.query or parts.username:
        return False  # "null" (a sandboxed frame, a file), or not an origin at all
    host, port = split_authority(parts.netloc)
    sent_host, sent_port = split_authority(host_header)
    if host is None or sent_host is None:
        return False
    default = DEFAULT_PORTS[parts.scheme]
    return host.lower().rstrip(".") == sent_host.lower().rstrip(".") and (port or default) == (sent_port or default)


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(name.partition("%")[0])
    except ValueError:
        return None


@lru_cache(maxsize=1)
def page() -> tuple[bytes, dict[str, str]]:
    """The web page and the headers it goes out with (its CSP names its inline script and style
    by their SHA-256, so nothing injected into it could run)."""
    html = resources.files("swarmctl.api").joinpath("ui/index.html").read_bytes()
    return html, page_headers(html)


def page_headers(html: bytes) -> dict[str, str]:
    def hashes(tag: bytes) -> str:
        blocks = re.findall(rb"<%s>(.*?)</%s>" % (tag, tag), html, re.DOTALL)
        return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(b).digest()).decode()}'" for b in blocks) \
            or "'none'"

    policy = (f"default-src 'self'; script-src {hashes(b'script')}; style-src {hashes(b'style')}; "
              f"object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
    return {"Content-Security-Policy": policy, "X-Frame-Options": "DENY", "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer", "Cache-Control": "no-store"}
