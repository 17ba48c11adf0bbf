"""float32 arithmetic the way llama.cpp's C++ does it, for the few scalars we compute ourselves
(RoPE's attention factor, DeepSeek's attention scale): a scalar one ulp off changes every
activation's bits downstream."""

from __future__ import annotations

import ctypes
import ctypes.util

import numpy as np

_LIBM = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
_LIBM.logf.restype = ctypes.c_float
_LIBM.logf.argtypes = [ctypes.c_float]


def f32(x: float) -> np.float32:
    return np.float32(x)


def logf(x: np.float32) -> np.float32:
    """C's logf (numpy's float32 log may round differently)."""
    return np.float32(_LIBM.logf(ctypes.c_float(float(x))))


def sqrtf(x: np.float32) -> np.float32:
    return np.sqrt(np.float32(x))  # IEEE square root: correctly rounded in both


def get_mscale(scale: np.float32, mscale: np.float32) -> np.float32:
    """YaRN's magnitude correction (llama-context.cpp's get_mscale)."""
    return f32(1.0) if scale <= 1.0 else f32(0.1) * mscale * logf(scale) + f32(1.0)
