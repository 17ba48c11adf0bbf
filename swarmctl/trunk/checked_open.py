"""A trunk opens the layers it serves only after checking them against the host's copy."""

from __future__ import annotations

from pathlib import Path

from kernels.errors import EngineError
from kernels.gguf_file import GGUFFile
from plans.plan import Plan


def open_checked(model: Path, layers: range, plan: Plan) -> GGUFFile:
    """Open the model (or slice) file, refusing it unless every layer we are to serve hashes to
    what the host's copy does."""
    gguf = GGUFFile(model)
    try:
        mismatched = [i for i in layers if gguf.layer_hash(i) != plan.layer_hashes[i]]
        if mismatched:
            raise EngineError(f"this trunk's copy of the model ({model.name}) differs from the "
                              f"host's ({plan.model_name}) in layers {mismatched[0]}..{mismatched[-1]}; "
                              "refusing to serve them")
    except BaseException:
        gguf.close()
        raise
    return gguf
