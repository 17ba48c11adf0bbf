"""Which of a slice's weights a device with too little memory holds, by tensor kind.

A dense model offloads as llama.cpp's ``n_gpu_layers`` does: its first layers whole, as many as
fit, the rest on the CPU. A mixture-of-experts model is placed the way people run DeepSeek-V3 and
Kimi K2 at home (llama.cpp's ``--override-tensor exps=CPU``, ktransformers): the device first takes
the dense part of every layer the slice holds (attention, norms, router, shared experts, a dense
FFN) and its KV cache, which every token runs through; then routed experts, layer by layer, while
they fit. Routed experts that do not fit stay in host RAM, where a token reads only the few its
router picks, and ggml's scheduler runs their matmuls on the CPU (the path partial offload
already takes). The slice's embedding and LM head stay on the CPU under a split, as llama.cpp's do.
"""

from __future__ import annotations

from dataclasses import dataclass

from .spec import ModelSpec, SliceSpec


@dataclass(frozen=True)
class DeviceSplit:
    """``dense``: the layers whose dense part and KV cache the device holds; ``experts``: the
    layers whose routed experts it holds too. The rest stays in host RAM."""

    dense: range
    experts: frozenset[int]

    def describe(self, device: str, slice_spec: SliceSpec, spec: ModelSpec) -> str:
        """For logs and status: ``vulkan:0 for layers [4, 9), cpu for [9, 15)``, or with routed
        experts in RAM ``vulkan:0 for layers [1, 31) and the experts of [1, 5); experts of
        [5, 31) in RAM (cpu)``."""
        if not self.dense:
            return f"cpu (nothing fits on {device})"
        routed = [il for il in slice_spec.layers if spec.is_moe_layer(il) and layer_expert_bytes(spec, il)]
        whole = not routed or all(il in self.experts for il in routed if il in self.dense)
        if whole:
            rest = f", cpu for [{self.dense.stop}, {slice_spec.stop})" if self.dense.stop < slice_spec.stop else ""
            return f"{device} for layers {_span(self.dense)}{rest}"
        on = [il for il in routed if il in self.experts]
        off = [il for il in routed if il not in self.experts]
        text = f"{device} for layers {_span(self.dense)}"
        text += f" and the experts of {_spans(on)}" if on else " without their routed experts"
        text += f"; experts of {_spans(off)} in RAM (cpu)"
        if self.dense.stop < slice_spec.stop:
            text += f"; cpu for [{self.dense.stop}, {slice_spec.stop})"
        return text


def layer_expert_bytes(spec: ModelSpec, il: int) -> int:
    return spec.layer_expert_bytes[il] if spec.layer_expert_bytes else 0


def layers_that_fit(spec: ModelSpec, slice_spec: SliceSpec, budget: int, max_context: int) -> range | None:
    """The slice's first layers whose weights and KV cache (one request at ``max_context``) fit in
    ``budget`` bytes; None when the whole slice fits, its embedding and LM head included."""
    kv_per_layer = spec.kv_bytes_per_token_per_layer * max_context
    used, fit = 0, 0
    for il in slice_spec.layers:
        need = spec.layer_bytes[il] + kv_per_layer
        if used + need > budget:
            break
        used, fit = used + need, fit + 1
    if fit == len(slice_spec.layers) and used + _globals_bytes(spec, slice_spec) <= budget:
        return None
    return range(slice_spec.start, slice_spec.start + fit)


def split_for_device(spec: ModelSpec, slice_spec: SliceSpec, budget: int, max_context: int) -> DeviceSplit | None:
    """What a device with ``budget`` bytes holds of the slice (module notes); None when it holds
    all of it, the embedding and LM head included."""
    if not any(layer_expert_bytes(spec, il) for il in slice_spec.layers):
        fit = layers_that_fit(spec, slice_spec, budget, max_context)
        return None if fit is None else DeviceSplit(fit, frozenset(fit))
    kv_per_layer = spec.kv_bytes_per_token_per_layer * max_context
    whole = sum(spec.layer_bytes[il] + kv_per_layer for il in slice_spec.layers) + _globals_bytes(spec, slice_spec)
    if whole <= budget:
        return None
    used, fit = 0, 0
    for il in slice_spec.layers:  # the dense part of each layer first
        need = spec.layer_bytes[il] - layer_expert_bytes(spec, il) + kv_per_layer
        if used + need > budget:
            break
        used, fit = used + need, fit + 1
    dense = range(slice_spec.start, slice_spec.start + fit)
    experts = set()
    if fit == len(slice_spec.layers):  # then routed experts, layer by layer, while they fit
        for il in slice_spec.layers:
            if used + layer_expert_bytes(spec, il) > budget:
                break
            used += layer_expert_bytes(spec, il)
            experts.add(il)
    return DeviceSplit(dense, frozenset(experts))


def _globals_bytes(spec: ModelSpec, slice_spec: SliceSpec) -> int:
    return (spec.embedding_bytes if slice_spec.has_embedding else 0) + \
        (spec.lm_head_bytes if slice_spec.has_lm_head else 0)


def _span(layers: range) -> str:
    return f"[{layers.start}, {layers.stop})"


def _spans(layers: list[int]) -> str:
    """[1, 5) or [1, 3) + [7, 9): consecutive runs."""
    runs: list[list[int]] = []
    for il in layers:
        if runs and runs[-1][1] == il:
            runs[-1][1] = il + 1
        else:
            runs.append([il, il + 1])
    return " + ".join(f"[{a}, {b})" for a, b in runs)
