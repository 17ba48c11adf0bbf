"""How activations travel on each hop of a plan: the swarm's wire dtype (``--wire-dtype``), made
concrete per hop.

    f32    as computed: the answer is the one a single machine gives (the oracle rule)
    f16    half the bytes and datagrams
    q8_0   ggml's block_q8_0 (per 32 values an f16 scale and 32 int8): 34 bytes per 32 values
    auto   f32 within a site, f16 between sites

A hop is within a site when both ends share a site in the nodes file, or the link between them
was measured at a round trip of at most SITE_RTT_MS (a LAN; a home's uplink to another home is
tens of ms). The host writes each stage's outgoing dtype into the plan (``StageAssignment.
send_dtype``; the last stage's is its hop back to the asker) and the asker's own (``Plan.
entry_dtype``); the planner charges each hop the bytes and datagrams of its dtype.
"""

from __future__ import annotations

SITE_RTT_MS = 2.0
Q8_0_BLOCK = 32  # q8_0 carries rows of whole blocks (net/wire.py): a model of another width gets f16
BYTES_PER_VALUE = {"f32": 4.0, "f16": 2.0, "q8_0": 34 / 32}


def hop_dtype(setting: str, within_site: bool) -> str:
    """The dtype one hop travels in under the swarm's setting."""
    if setting == "auto":
        return "f32" if within_site else "f16"
    return setting


def hop_bytes(f32_bytes: float, dtype: str) -> float:
    """A row's bytes in ``dtype``, from its size in f32."""
    return f32_bytes * BYTES_PER_VALUE[dtype] / 4.0
