"""Errors of the command line itself (the engine's live in kernels.errors)."""


class UsageError(Exception):
    """Bad command-line usage; reported in one line with exit code 2."""
