"""Errors the engine raises for bad input. Each message is one line meant for a user."""


class EngineError(Exception):
    """Base class: anything the CLI turns into a one-line message and a non-zero exit."""


class ModelFileError(EngineError):
    """The model file is missing, unreadable, not GGUF, or truncated."""


class UnsupportedModelError(EngineError):
    """A GGUF we can read but cannot run (architecture, tensor layout)."""


class SliceRangeError(EngineError):
    """A layer range that does not fit the model."""


class ContextOverflowError(EngineError):
    """A request that would need more positions than its context allows."""


class RequestStateError(EngineError):
    """An unknown request id, or positions that do not continue the request's cache."""


class InputShapeError(EngineError):
    """Input activations or tokens whose shape or values do not fit the slice."""


class TensorBoundsError(InputShapeError):
    """A copy into or out of a ggml tensor that does not fit it. Checked in Python (kernels.ggml
    ``copy_in`` / ``copy_out``) because ggml's own check is a GGML_ASSERT, which aborts the process:
    a stage would die of what a peer sent instead of answering it."""
