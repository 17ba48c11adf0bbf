"""An expert node's share of the model, fetched as a trunk fetches its slice
(swarmctl/model_files/distribution.py): experts [first, last) of each expert tensor (``ffn_gate_exps``,
``ffn_up_exps``, ``ffn_down_exps``) of the MoE layers among [start, stop), and the metadata that
opens them, nothing else.

In a GGUF an expert's weights are one contiguous slab of its layer's expert tensor, so the node
asks for the host's chunks that hold its slabs, checks each whole chunk against the host's hash
and keeps only its slabs' bytes: its file holds each expert tensor cut to [first, last)
(``swarmctl.experts.first`` / ``.last`` in its metadata say which, kernels/experts.py reads them).
The manifest carries the hashes of the layers' other tensors as well, so the node checks that the
chunk hashes it was given make up the plan's layer hashes before the file takes its final name.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable, Mapping

from gguf import GGUFValueType

from kernels.errors import EngineError
from kernels.experts import EXPERT_TENSORS, FIRST_KEY, LAST_KEY
from kernels.gguf_file import GGUFFile, encode_kv
from kernels.spec import ModelSpec
from net import messages as m
from net.protocol import SwarmProtocol
from swarmctl.model_files.distribution import HostSource, OpenStream, SliceManifest, build_manifest, fetch_file


def expert_slice_path(folder: Path, model_hash: str, start: int, stop: int, first: int, last: int) -> Path:
    return folder / f"{model_hash[:16]}-layers-{start}-{stop}-experts-{first}-{last}.gguf"


def build_expert_manifest(gguf: GGUFFile, start: int, stop: int, first: int, last: int, model_hash: str,
                          chunk_hashes: Mapping[str, list[str]] | None = None, mirror: str = "") -> SliceManifest:
    """Experts [first, last) of the MoE layers among [start, stop). ``chunk_hashes``: the host's."""
    spec = ModelSpec.from_gguf(gguf)
    if not 0 <= first < last <= spec.n_expert:
        raise EngineError(f"experts [{first}, {last}) are outside the model's {spec.n_expert}")
    layers = build_manifest(gguf, start, stop, model_hash, chunk_hashes, mirror)
    names = {f"blk.{il}.{stem}.weight" for il in range(start, stop) if spec.is_moe_layer(il) for stem in EXPERT_TENSORS}
    if not names:
        raise EngineError(f"layers [{start}, {stop}) have no experts")
    kv = layers.kv + encode_kv(FIRST_KEY, first, GGUFValueType.UINT32) + encode_kv(LAST_KEY, last, GGUFValueType.UINT32)
    return replace(layers, kind="experts", n_kv=layers.n_kv + 2, kv=kv,
                   tensors=[t for t in layers.tensors if t.name in names],
                   first_expert=first, last_expert=last, n_expert=spec.n_expert,
                   other_tensors={t.name: t.hash for t in layers.tensors if t.name not in names})


async def fetch_experts(conn: SwarmProtocol, open_stream: OpenStream, close_stream: Callable[[int], None],
                        folder: Path, *, model_hash: str, start: int, stop: int, first: int, last: int,
                        layer_hashes: list[str],
                        on_progress: Callable[[int, int], None] | None = None) -> tuple[Path, int]:
    """Fetch experts [first, last) of layers [start, stop) (``build_expert_manifest``) from the
    host and the manifest's mirror, if any. Returns the file and the bytes received."""
    final = expert_slice_path(folder, model_hash, start, stop, first, last)
    host = HostSource(conn, open_stream, close_stream,
                      lambda have, want: m.FetchSlice(start=start, stop=stop, have=have, want=want,
                                                      experts=[first, last]))
    return await fetch_file(host, final, f"experts [{first}, {last}) of layers [{start}, {stop})", model_hash,
                            layer_hashes, on_progress)
