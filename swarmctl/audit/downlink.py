"""Downlink decoding: the last trunk stage runs the public tail layers [L-K, L) and the LM head on
the results it sends back, and reads off the asker's next token (the asker runs the very same
computation on the very same bytes)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kernels.gguf_file import GGUFFile
from kernels.slice import SliceEngine
from kernels.spec import ModelSpec, SliceSpec

from .capture import ObservedStream


class DownlinkDecoder:
    def __init__(self, model: str | Path, layer_index: int, *, n_threads: int | None = None) -> None:
        self.gguf = GGUFFile(model)
        try:
            spec = ModelSpec.from_gguf(self.gguf)
            self.tail = SliceEngine(self.gguf, SliceSpec(layer_index, spec.n_layer, has_lm_head=True),
                                    n_threads=n_threads)
        except BaseException:
            self.gguf.close()
            raise
        self.layer_index = layer_index

    def decode(self, stream: ObservedStream) -> list[int]:
        """The top-1 token after each result packet, in the order they were sent."""
        rid = b"audit-downlink-" + stream.request_id[:1]
        tokens = []
        try:
            for chunk in stream.chunks:
                logits = self.tail.forward(rid, start_pos=chunk.start_pos, hidden=chunk.data)
                tokens.append(int(np.argmax(logits[-1])))
        finally:
            self.tail.release(rid)
        return tokens

    def close(self) -> None:
        self.tail.close()
        self.gguf.close()

    def __enter__(self) -> "DownlinkDecoder":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
