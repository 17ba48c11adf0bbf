"""The asker's side of the U-shaped split, and the generation loop.

    text → tokens → embedding → head layers [0, K)  ──activations──►  trunk [K, L-K)
    text ← tokens ← sample ← LM head ← tail layers [L-K, L)  ◄──activations──┘

Text, token ids and logits stay in this process; the trunk sees only activations.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Protocol, Sequence

import numpy as np

from kernels.errors import ContextOverflowError, EngineError, SliceRangeError
from kernels.gguf_file import GGUFFile
from kernels.sampling import Sampler, SamplingParams
from kernels.slice import SliceEngine
from kernels.spec import ModelSpec, SliceSpec
from kernels.tokenizer import Tokenizer


class Trunk(Protocol):
    """The middle of the U: whatever runs layers [K, L-K) (in-process engines, or a swarm)."""

    def forward(self, request_id: bytes, hidden: np.ndarray, start_pos: int) -> np.ndarray: ...

    def release(self, request_id: bytes) -> None: ...


@dataclass(frozen=True)
class USplit:
    head: SliceSpec  # embedding + layers [0, K)
    trunk: tuple[SliceSpec, ...]  # layers [K, L-K) in consecutive stages
    tail: SliceSpec  # layers [L-K, L) + output norm + LM head


def u_ends(n_layer: int, head_layers: int) -> tuple[SliceSpec, SliceSpec]:
    """The asker's two slices: embedding + [0, K), and [L-K, L) + LM head."""
    if head_layers < 0:
        raise SliceRangeError("--head-layers must be 0 or more")
    if 2 * head_layers > n_layer:
        raise SliceRangeError(f"--head-layers {head_layers} needs {2 * head_layers} layers; the model has {n_layer}")
    return (SliceSpec(0, head_layers, has_embedding=True),
            SliceSpec(n_layer - head_layers, n_layer, has_lm_head=True))


def u_split(n_layer: int, head_layers: int, n_stages: int) -> USplit:
    """Head and tail of K layers each on the asker; the trunk split evenly into n_stages."""
    head, tail = u_ends(n_layer, head_layers)
    n_trunk = n_layer - 2 * head_layers
    if n_stages < 0 or (n_stages == 0 and n_trunk > 0):
        raise SliceRangeError("--stages must be at least 1 when there are trunk layers")
    if n_stages > n_trunk:
        raise SliceRangeError(f"cannot split {n_trunk} trunk layers into {n_stages} stages")
    bounds = [head_layers + (n_trunk * i) // n_stages for i in range(n_stages + 1)] if n_stages else [head_layers]
    trunk = tuple(SliceSpec(a, b) for a, b in zip(bounds, bounds[1:]))
    return USplit(head=head, trunk=trunk, tail=tail)


class LocalTrunk:
    """Trunk stages as slice engines in this process (``--transport inproc``)."""

    def __init__(self, gguf: GGUFFile, stages: Sequence[SliceSpec], *, n_threads: int | None, max_context: int):
        self.engines: list[SliceEngine] = []
        try:
            for stage in stages:
                self.engines.append(SliceEngine(gguf, stage, n_threads=n_threads, max_context=max_context))
        except BaseException:
            self.close()
            raise

    def forward(self, request_id: bytes, hidden: np.ndarray, start_pos: int) -> np.ndarray:
        for engine in self.engines:
            hidden = engine.forward(request_id, start_pos=start_pos, hidden=hidden)
        return hidden

    def release(self, request_id: bytes) -> None:
        for engine in self.engines:
            engine.release(request_id)

    def close(self) -> None:
        for engine in self.engines:
            engine.close()
        self.engines = []


class Generation:
    """An iterator of generated token ids; ``finish_reason`` is set once it is exhausted:
    "stop" (end-of-generation token), "length" (max tokens) or "context" (context full)."""

    def __init__(self, steps: Iterator[int]) -> None:
        self._steps = steps
        self.finish_reason: str | None = None

    def __iter__(self) -> "Generation":
        return self

    def __next__(self) -> int:
        return next(self._steps)


class UShapeClient:
    """Embedding, head, tail, LM head, tokenizer and sampler: everything the asker keeps."""

    def __init__(self, model_path: str | Path, head_layers: int, *, n_threads: int | None = None,
                 max_context: int | None = None) -> None:
        self.gguf = GGUFFile(model_path)
        self.head: SliceEngine | None = None
        self.tail: SliceEngine | None = None
        try:
            self.spec = ModelSpec.from_gguf(self.gguf)
            head, tail = u_ends(self.spec.n_layer, head_layers)
            self.head = SliceEngine(self.gguf, head, n_threads=n_threads, max_context=max_context)
            self.tail = SliceEngine(self.gguf, tail, n_threads=n_threads, max_context=max_context)
            self.max_context = self.head.max_context
            self.tokenizer = Tokenizer(model_path)
        except BaseException:
            self.close()
            raise

    def generate(self, prompt: Sequence[int], trunk: Trunk | None, *, max_tokens: int,
                 sampling: SamplingParams) -> Generation:
        if max_tokens <= 0:
            raise EngineError("--max-tokens must be a positive number")
        if not prompt:
            raise EngineError("the prompt is empty")
        if len(prompt) >= self.max_context:
            raise ContextOverflowError(
                f"the prompt has {len(prompt)} tokens but the context length is {self.max_context}"
            )
        generation = Generation(iter(()))
        generation._steps = self._steps(list(prompt), trunk, max_tokens, Sampler(sampling), generation)
        return generation

    def _steps(self, prompt: list[int], trunk: Trunk | None, max_tokens: int, sample: Sampler,
               generation: Generation) -> Iterator[int]:
        assert self.head is not None and self.tail is not None
        request_id = secrets.token_bytes(16)
        new_tokens, start = prompt, 0
        try:
            for produced in range(max_tokens):
                hidden = self.head.forward(request_id, start_pos=start, tokens=new_tokens)
                if trunk is not None:
                    hidden = trunk.forward(request_id, hidden, start)
                logits = self.tail.forward(request_id, start_pos=start, hidden=hidden)
                token = sample(logits[-1])
                start += len(new_tokens)
                if self.tokenizer.is_end_of_generation(token):
                    generation.finish_reason = "stop"
                    return
                yield token
                if start + 1 > self.max_context:
                    generation.finish_reason = "context"
                    return
                new_tokens = [token]
            generation.finish_reason = "length"
        finally:
            self.head.release(request_id)
            self.tail.release(request_id)
            if trunk is not None:
                trunk.release(request_id)

    def close(self) -> None:
        for engine in (self.head, self.tail):
            if engine is not None:
                engine.close()
        self.head = self.tail = None
        self.gguf.close()
