"""The attacker's entry point: public weights and captured bytes in, tokens out.

``attack(model, captures)`` takes the GGUF's path and each stage's capture files, nothing else. The
curious members it models are the two best placed: the first trunk stage, which receives the
asker's head output (the uplink), and the last, which sends the trunk's output back (the downlink).
Which captures play those parts is read from the packets themselves (their layer indexes).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

import numpy as np

from kernels.errors import EngineError

from .capture import ObservedStream, read_capture, received_streams, result_streams
from .downlink import DownlinkDecoder
from .invert import DEFAULT_MAX_CANDIDATES, Inversion, UplinkInverter


class NoTrafficError(EngineError):
    """The captures hold no activations to attack."""


@dataclass
class AttackResult:
    uplink_stage: str  # whose captures the uplink came from
    uplink_layer: int  # the layer boundary it was observed at (K)
    downlink_stage: str | None
    inversions: dict[bytes, Inversion] = field(default_factory=dict)  # by request id
    downlink: dict[bytes, list[int]] = field(default_factory=dict)  # top-1 token after each result packet
    table_build_s: float = 0.0
    attack_s: float = 0.0


def attack(model: str | Path, captures: Mapping[str, Iterable[Path]], *, cache_dir: Path | None = None,
           max_candidates: int = DEFAULT_MAX_CANDIDATES, n_threads: int | None = None,
           weights: np.ndarray | None = None, table_threads: int | None = None) -> AttackResult:
    t0 = time.perf_counter()
    received: dict[str, list[ObservedStream]] = {}
    results: dict[str, list[ObservedStream]] = {}
    for stage, files in captures.items():
        packets = read_capture(files)
        received[stage], results[stage] = received_streams(packets), result_streams(packets)
    seen = {stage: min(s.layer_index for s in streams) for stage, streams in received.items() if streams}
    if not seen:
        raise NoTrafficError("the captures hold no activations")
    uplink_stage = min(seen, key=seen.get)
    layer = seen[uplink_stage]
    downlink_stage = next((stage for stage, streams in results.items() if streams), None)
    result = AttackResult(uplink_stage, layer, downlink_stage)
    with UplinkInverter(model, layer, cache_dir=cache_dir, max_candidates=max_candidates, n_threads=n_threads,
                        weights=weights, table_threads=table_threads) as inverter:
        result.table_build_s = inverter.table.build_s
        for stream in received[uplink_stage]:
            if stream.layer_index != layer or not stream.complete:
                continue  # another boundary, or not seen from position 0: no prefix to build on
            result.inversions[stream.request_id] = inverter.invert(stream)
    if downlink_stage is not None:
        streams = results[downlink_stage]
        with DownlinkDecoder(model, streams[0].layer_index, n_threads=n_threads) as decoder:
            for stream in streams:
                result.downlink[stream.request_id] = decoder.decode(stream)
    result.attack_s = time.perf_counter() - t0 - result.table_build_s
    return result
