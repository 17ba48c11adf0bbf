"""The one mitigation we measure: calibrated Gaussian noise on the uplink activations.

The head's output is perturbed before it leaves the asker: ``x + s · std_d · N(0, 1)`` for every
hidden dimension d, where ``std_d`` is that dimension's standard deviation over a fixed public
text and ``s`` is the sigma scale (``--uplink-noise S``). Off by default. It touches only the
uplink: the trunk's output comes back unperturbed, so the last stage's view of generated tokens
is untouched by it (the audit measures that too).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kernels.slice import SliceEngine
from kernels.spec import SliceSpec

from .texts import CALIBRATION_TEXT



def calibrate(model: str | Path, head_layers: int, *, text: str | None = None,
              n_threads: int | None = None) -> np.ndarray:
    """Per-dimension standard deviation [n_embd] of the head's output over ``text`` (by default the
    bundled calibration paragraph). Position 0 is left out: its attention-sink dimensions are
    hundreds of times larger than anywhere else and would set the scale for every position."""
    from kernels.tokenizer import Tokenizer

    tokens = Tokenizer(model).encode_prompt(CALIBRATION_TEXT if text is None else text)
    with SliceEngine.open(model, SliceSpec(0, head_layers, has_embedding=True), n_threads=n_threads) as head:
        states = head.forward(b"audit-calibrate0", start_pos=0, tokens=tokens, outputs="all")
    return states[1:].std(axis=0).astype(np.float32)


@dataclass
class UplinkNoise:
    """An ``Asker.uplink_transform``: adds ``scale · std · N(0, 1)`` to each row it is given."""

    std: np.ndarray  # [n_embd]
    scale: float
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(secrets.randbits(128)))

    def __call__(self, hidden: np.ndarray) -> np.ndarray:
        noise = self.rng.standard_normal(hidden.shape, dtype=np.float32)
        return hidden + noise * (np.float32(self.scale) * self.std)

    @classmethod
    def calibrated(cls, model: str | Path, head_layers: int, scale: float, *, seed: int | None = None,
                   n_threads: int | None = None) -> "UplinkNoise":
        rng = np.random.default_rng(secrets.randbits(128) if seed is None else seed)
        return cls(calibrate(model, head_layers, n_threads=n_threads), scale, rng)
