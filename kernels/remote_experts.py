"""A slice whose MoE experts run on other nodes (expert parallelism), layer by layer.

Each MoE layer runs here up to its router (``build_router_segment``); the experts' outputs come
from elsewhere (``RemoteExperts``) and are weighted and added here in slot order with float32
arithmetic, the same operations the whole-layer graph performs, so the bits match. Dense layers
run whole. Each layer's graph is placed once per batch shape and kept in the engine's cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from . import ggml
from .errors import InputShapeError
from .graph import GraphShape, SliceGraph, build_router_segment, build_slice_graph
from .graph_cache import GraphCache, PlacedGraph
from .kv_cache import KVCache
from .spec import ModelSpec, SliceSpec
from .weights import SliceWeights

# (layer, rows [N, n_embd] for the experts, selected [N, k] expert ids) → outputs [N, k, n_embd]
RemoteExperts = Callable[[int, np.ndarray, np.ndarray], np.ndarray]


@dataclass
class RemoteExpertLayers:
    """The engine's layers run one at a time, with the experts' part done by ``call``."""

    spec: ModelSpec
    slice: SliceSpec
    weights: SliceWeights
    call: RemoteExperts
    place: Callable[[SliceGraph, list[KVCache]], PlacedGraph]  # the engine's: input host + compute buffer
    segments: GraphCache[tuple[GraphShape, int]]  # (shape, layer) → that layer's placed graph

    def forward(self, shape: GraphShape, caches: list[KVCache], inputs: list[np.ndarray],
                starts: list[int]) -> list[np.ndarray]:
        """Each request's output rows, as the whole-slice graph would give them."""
        x = inputs[0] if len(inputs) == 1 else np.concatenate(inputs)
        n, k, n_embd = shape.n_tokens, self.spec.n_expert_used, self.spec.n_embd
        for il in self.slice.layers:
            moe = self.weights.layers[il].is_moe
            placed = self._segment_for(shape, caches, il, moe)
            placed.host.set(x, starts)
            graph = placed.graph
            placed.compute()
            residual = _read(graph.output, (n, n_embd), np.float32)
            if not moe:
                x = residual
                continue
            ffn_in = _read(graph.extra_outputs["ffn_in"], (n, n_embd), np.float32)
            selected = _read(graph.extra_outputs["selected"], (n, k), np.int32)
            weights = _read(graph.extra_outputs["weights"], (n, k), np.float32)
            shared = graph.extra_outputs.get("shared")  # shared experts run here, with the stage
            shared = _read(shared, (n, n_embd), np.float32) if shared else None
            experts = np.asarray(self.call(il, ffn_in, selected), dtype=np.float32)
            if experts.shape != (n, k, n_embd):
                raise InputShapeError(f"expert outputs of shape {list(experts.shape)} do not fit")
            x = combine_experts(experts, weights, residual, shared)
        bounds = np.cumsum([0] + [r.n_tokens for r in shape.requests])
        return [x[a:b] for a, b in zip(bounds, bounds[1:])]

    def _segment_for(self, shape: GraphShape, caches: list[KVCache], il: int, moe: bool) -> PlacedGraph:
        """Layer ``il`` alone (up to its router when it is a MoE layer), placed and kept."""
        entry = self.segments.get((shape, il))
        if entry is None:
            if moe:
                graph = build_router_segment(self.spec, self.slice, self.weights, caches, shape, il)
            else:
                graph = build_slice_graph(self.spec, SliceSpec(il, il + 1), self.weights, caches, shape)
            entry = self.place(graph, caches)
            self.segments.put((shape, il), entry)
        return entry


def combine_experts(experts: np.ndarray, weights: np.ndarray, residual: np.ndarray,
                    shared: np.ndarray | None = None) -> np.ndarray:
    """l_out = residual + the experts' outputs [n, k, n_embd] weighted [n, k] and added in slot
    order (+ the shared experts' output), with the float32 operations the whole-layer graph
    performs (GraphBuilder.combine_experts, then the architecture's FFN)."""
    weighted = experts * weights[:, :, None]  # ggml_mul(experts, weights)
    out = weighted[:, 0]
    for slot in range(1, weighted.shape[1]):
        out = out + weighted[:, slot]  # the views added in slot order
    if shared is not None:
        out = out + shared  # ffn_out = ffn_moe_out + ffn_shexp
    return np.ascontiguousarray(out + residual, dtype=np.float32)  # l_out = ffn_out + ffn_inp


def _read(tensor: int, shape: tuple[int, ...], dtype) -> np.ndarray:
    out = np.empty(shape, dtype=dtype)
    ggml.copy_out(tensor, out)
    return out
