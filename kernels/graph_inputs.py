"""A graph's inputs on the host side: numpy arrays allocated once with the graph, refilled for
each step (positions, each request's mask and KV cell indices) and copied into the graph's
placeholders, and its outputs read back per request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from . import ggml
from .errors import TensorBoundsError
from .graph import GraphShape, SliceGraph


@dataclass
class WithHidden:
    """A step's output with every row's hidden state: a slice with the LM head asked for
    ``hidden_rows`` (the final normed state), or a nextn slice (its block's output, which feeds
    its next step)."""

    rows: np.ndarray  # [rows, n_vocab] logits, as the step's ``outputs`` says
    hidden: np.ndarray  # [n_tokens, n_embd]


class InputHost:
    """Host-side arrays for one graph's inputs, allocated with the graph and refilled per step, so a
    steady decode step costs a few in-place writes and one copy per input (no allocation)."""

    def __init__(self, graph: SliceGraph, v_width: int, capacities: list[int]) -> None:
        """``v_width``: V values per cell (0: a cache without V, latent attention);
        ``capacities``: the KV cells of each request's cache, in the graph's order."""
        self.graph = graph
        shape = graph.shape
        if shape.flash:  # V rows go to the cells K rows go to: no element indices
            v_width = 0
        mask_dtype = np.float16 if shape.flash else np.float32  # (flash attention takes an F16 mask)
        self.pos = np.empty(shape.n_tokens, dtype=np.int32)
        self.members = []
        copies = []
        for r, cap, inp in zip(shape.requests, capacities, graph.inputs.attention):
            member = {
                "n": r.n_tokens,
                "mask": np.empty((r.n_tokens, r.n_kv), dtype=mask_dtype),
                "cells": np.arange(r.n_kv, dtype=np.int32),
                "k_idxs": np.empty(r.n_tokens, dtype=np.int64),
                "v_idxs": np.empty((r.n_tokens, v_width), dtype=np.int64),
                "v_base": np.arange(v_width, dtype=np.int64) * cap,  # V is transposed
            }
            self.members.append(member)
            copies += [(inp.kq_mask, member["mask"]), (inp.k_idxs, member["k_idxs"])]
            if inp.v_idxs is not None:
                copies.append((inp.v_idxs, member["v_idxs"]))
        self.out_ids = output_rows(shape)
        if graph.inputs.pos is not None:
            copies.append((graph.inputs.pos, self.pos))
        if graph.inputs.out_ids is not None:
            copies.append((graph.inputs.out_ids, self.out_ids))
        for t, a in copies:  # checked once here, so the per-step uploads need no check
            if a.nbytes != ggml.nbytes(t):
                raise TensorBoundsError(f"input of {a.nbytes} bytes for a placeholder of {ggml.nbytes(t)}")
        self.copies = [(t, a.ctypes.data, a.nbytes) for t, a in copies]
        self.out_shape = ggml.tensor_shape(graph.output)[1::-1]  # (rows, width)

    def fill(self, starts: list[int]) -> None:
        offset = 0
        for member, start in zip(self.members, starts):
            n = member["n"]
            pos = self.pos[offset:offset + n]
            if n == 1:  # a decode step: the common case, kept cheap
                pos[0] = start
                member["mask"].fill(-np.inf)
                member["mask"][0, : start + 1] = 0.0
                member["k_idxs"][0] = start
                np.add(member["v_base"], start, out=member["v_idxs"][0])
            else:
                pos[:] = np.arange(start, start + n, dtype=np.int32)
                member["mask"][:] = np.where(member["cells"][None, :] <= pos[:, None], 0.0, -np.inf)
                member["k_idxs"][:] = pos  # cell i holds position i
                np.add(member["k_idxs"][:, None], member["v_base"][None, :], out=member["v_idxs"])
            offset += n
        if not self.members:  # a slice without layers still stacks positions (unused)
            self.pos[:] = 0

    def upload(self) -> None:
        for tensor, address, size in self.copies:
            ggml.backend_tensor_set(tensor, address, 0, size)

    def set(self, x: np.ndarray, starts: list[int], tokens: np.ndarray | None = None) -> None:
        """Copy in the batch's stacked input (token ids or activations; a nextn layer's
        activations and ``tokens``) and every placeholder."""
        inputs = self.graph.inputs
        if inputs.tokens is not None and inputs.embd is not None:
            ggml.copy_in(inputs.tokens, tokens)
            ggml.copy_in(inputs.embd, x)
        else:
            ggml.copy_in(inputs.tokens if inputs.tokens is not None else inputs.embd, x)
        self.fill(starts)
        self.upload()

    def read_outputs(self, with_hidden: Sequence[bool] = ()) -> list[np.ndarray | WithHidden]:
        """The graph's output rows, one array per request; a ``WithHidden`` for the requests
        ``with_hidden`` marks, when the graph outputs every row's hidden state."""
        out = np.empty(self.out_shape, dtype=np.float32)
        ggml.copy_out(self.graph.output, out)
        requests = self.graph.shape.requests
        bounds = np.cumsum([0] + [r.n_outputs for r in requests])
        rows = [out] if len(requests) == 1 else [out[a:b] for a, b in zip(bounds, bounds[1:])]
        tensor = self.graph.extra_outputs.get("hidden")
        if tensor is None or not any(with_hidden):
            return rows
        hidden = np.empty((self.graph.shape.n_tokens, ggml.tensor_shape(tensor)[0]), dtype=np.float32)
        ggml.copy_out(tensor, hidden)
        bounds = np.cumsum([0] + [r.n_tokens for r in requests])
        return [WithHidden(r, hidden[a:b]) if wanted else r
                for r, wanted, a, b in zip(rows, with_hidden, bounds, bounds[1:])]


def output_rows(shape: GraphShape) -> np.ndarray:
    """Stacked row index of every output row (the last row of a request keeping one)."""
    rows, start = [], 0
    for r in shape.requests:
        rows.extend(range(start + r.n_tokens - r.n_outputs, start + r.n_tokens))
        start += r.n_tokens
    return np.array(rows, dtype=np.int32)
