"""Errors the engine raises towards its callers; the server maps each to an OpenAI error body."""


class EngineError(Exception):
    """Base class of the engine's own errors."""


class InvalidRequestError(EngineError, ValueError):
    """The request cannot be served as given (HTTP 400): bad parameter, prompt too long, ..."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class QueueFullError(EngineError):
    """The waiting queue is at its limit (HTTP 429); retry later."""


class EngineDeadError(EngineError):
    """The step loop died; no request can be served (HTTP 503)."""


class ModelNotFoundError(EngineError, FileNotFoundError):
    """A model source could not be located."""


class UnsupportedModelError(EngineError, ValueError):
    """A model was found but its architecture is not one the engine implements."""
