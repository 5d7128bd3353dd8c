"""Errors users see as one clear line (the CLI prints them without a traceback)."""


class FitLLMError(Exception):
    """Base class: the message names the file or field and the problem."""


class ModelLoadError(FitLLMError):
    """A checkpoint is missing, broken or unsupported."""
