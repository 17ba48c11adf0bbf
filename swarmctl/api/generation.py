"""One request's text: the asker's tokens, decoded as they come and cut at stop strings."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import AsyncIterator, Sequence

from kernels.grammar import Grammar
from kernels.sampling import SamplingParams
from swarmctl.api.shapes import FINISH_REASONS, Usage
from swarmctl.api.stops import StopScanner
from swarmctl.asker.head_tail import Asker, Generation, Trunk
from swarmctl.asker.logprobs import TokenLogprob
from swarmctl.asker.prefixes import PrefixCache
from swarmctl.asker.speculate import Speculation


@dataclass(frozen=True)
class TextRequest:
    """What one request asks for: its prompt's tokens and how to continue them."""

    prompt: Sequence[int]
    max_tokens: int
    sampling: SamplingParams
    stops: Sequence[str] = ()
    logprobs: int | None = None  # each token's log-probability and this many alternatives (None: not asked)
    grammar: Grammar | None = None  # structured output: only what it allows (closed with the generation)


class TextGeneration:
    def __init__(self, asker: Asker, trunk: Trunk | None, request: TextRequest, *, timeout: float | None,
                 speculation: Speculation | None = None, prefixes: PrefixCache | None = None) -> None:
        """``prefixes``: start from the longest kept prefix of an earlier prompt, and keep this one's."""
        self.generation = Generation(secrets.token_bytes(16), len(request.prompt))
        self.speculates = speculation is not None
        self.finish_reason: str | None = None  # OpenAI's: "stop" or "length", once the text has ended
        self._tokens = asker.generate(request.prompt, trunk, max_tokens=request.max_tokens, sampling=request.sampling,
                                      timeout=timeout, generation=self.generation, speculation=speculation,
                                      logprobs=request.logprobs, grammar=request.grammar, prefixes=prefixes)
        self._grammar = request.grammar
        self.wants_logprobs = request.logprobs is not None
        self._pushed = 0  # tokens turned into text so far (their log-probabilities go out with it)
        self._taken = 0
        self._decoder = asker.tokenizer.stream_decoder()
        self._stops = StopScanner(request.stops)
        self._first: int | None = None

    async def start(self) -> None:
        """Run up to the first token. Admission and the prompt's prefill happen here, so a busy or
        unreachable swarm fails before a response has begun and can still get its own status."""
        self._first = await anext(self._tokens, None)

    async def pieces(self) -> AsyncIterator[str]:
        """Text as it becomes final (never empty), until end of generation, max tokens or a stop."""
        token = self._first
        while token is not None:
            self._pushed += 1
            text, stopped = self._stops.push(self._decoder.push(token))
            if text:
                yield text
            if stopped:
                self.finish_reason = "stop"
                return
            token = await anext(self._tokens, None)
        text, stopped = self._stops.push(self._decoder.flush())
        text += "" if stopped else self._stops.flush()
        if text:
            yield text
        self.finish_reason = "stop" if stopped else FINISH_REASONS[self.generation.finish_reason or "length"]

    def take_logprobs(self) -> list[TokenLogprob]:
        """The log-probabilities of the tokens turned into text since the last call (a stream sends
        them with the text they made; a text held back for a stop string or an unfinished
        character goes out later, its tokens' figures with an earlier chunk)."""
        taken = self.generation.logprobs[self._taken:self._pushed]
        self._taken += len(taken)
        return taken

    @property
    def stop_sequence(self) -> str | None:
        """The stop string that ended the text, if one did."""
        return self._stops.found

    @property
    def usage(self) -> Usage:
        g = self.generation
        return Usage(g.prompt_tokens, len(g.tokens), g.drafted if self.speculates else None, g.accepted,
                     0 if g.prefix_recomputed else g.cached_tokens)

    async def aclose(self) -> None:
        """Stop generating (a stop string, an error, a client gone): the asker frees the request."""
        await self._tokens.aclose()
        if self._grammar is not None:
            self._grammar.close()
