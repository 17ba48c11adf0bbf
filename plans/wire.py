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

from net.wire import Q8_0_BLOCK, DType  # the one vocabulary: q8_0 carries rows of whole blocks

__all__ = ["AUTO", "Q8_0_BLOCK", "SETTINGS", "SITE_RTT_MS", "hop_bytes", "hop_dtype"]

SITE_RTT_MS = 2.0
AUTO = "auto"  # a setting, not a dtype: each hop's is chosen by where its ends are
SETTINGS = (*(d.label for d in DType), AUTO)  # what --wire-dtype takes


def hop_dtype(setting: str, within_site: bool) -> DType:
    """The dtype one hop travels in under the swarm's setting."""
    if setting == AUTO:
        return DType.F32 if within_site else DType.F16
    return DType.named(setting)


def hop_bytes(f32_bytes: float, dtype: DType) -> float:
    """A row's bytes in ``dtype``, from its size in f32."""
    return f32_bytes * dtype.bytes_per_value / 4.0
