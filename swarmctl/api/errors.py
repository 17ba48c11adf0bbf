"""OpenAI's error shape, ``{"error": {"message", "type", "param", "code"}}``, and which failure
gets which HTTP status."""

from __future__ import annotations

import json
from dataclasses import dataclass

from kernels.errors import ContextOverflowError, EngineError, ModelFileError


@dataclass(eq=False)  # exceptions compare and hash by identity
class ApiError(Exception):
    status: int
    message: str
    type: str = "invalid_request_error"
    code: str | None = None
    param: str | None = None

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def encode(self) -> bytes:
        return json.dumps(self.body()).encode("utf-8")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def context_exceeded(message: str) -> ApiError:
    return ApiError(400, message, param="messages", code="context_length_exceeded")


def unavailable(message: str) -> ApiError:
    return ApiError(503, message, type="server_error", code="swarm_unavailable")


def http_error_body(status: int, message: str, code: str | None = None, path: str = "") -> bytes:
    """For failures below the API (a request the HTTP layer cannot read, too many connections):
    in Anthropic's shape on its routes (``path``), else OpenAI's."""
    from swarmctl.api.anthropic_shapes import encode_error

    kind = "server_error" if status >= 500 else "invalid_request_error"
    return encode_error(path, ApiError(status, message, type=kind, code=code))


def from_exception(error: BaseException) -> ApiError:
    """A failure while generating → the error the client gets. The trunk link failing or the
    admission bound timing out mean the swarm cannot take the request now: 503."""
    from kernels.grammar import GrammarError
    from swarmctl.asker.head_tail import BusyError
    from swarmctl.asker.link import SwarmError

    message = " ".join(str(error).split()) or type(error).__name__
    if isinstance(error, ApiError):
        return error
    if isinstance(error, ContextOverflowError):
        return context_exceeded(message)
    if isinstance(error, BusyError):
        return ApiError(503, message, type="server_error", code="swarm_busy")
    if isinstance(error, (SwarmError, ConnectionError, OSError)):
        return unavailable(f"the swarm is unavailable: {message}")
    if isinstance(error, GrammarError) and grammar_error_code(error) is not None:
        # structured output too costly (a step past its time budget): the schema's doing, not the server's
        return bad_request(message, code=grammar_error_code(error))
    if isinstance(error, ModelFileError):  # e.g. a model without a chat template
        return bad_request(message)
    if isinstance(error, EngineError):
        return ApiError(500, message, type="server_error")
    return ApiError(500, f"internal error ({type(error).__name__})", type="server_error")


def grammar_error_code(error: Exception) -> str | None:
    """The code of a structured-output refusal (kernels/grammar.py): a schema beyond the limits,
    or grammar work past its time budget; None for others."""
    from kernels.grammar import GrammarBudgetError, GrammarLimitError

    if isinstance(error, GrammarLimitError):
        return "schema_too_complex"
    if isinstance(error, GrammarBudgetError):
        return "grammar_budget_exceeded"
    return None
