"""Errors the engine raises towards its callers; the server maps each to an OpenAI error body."""


class EngineError(Exception):
    """Base class of the engine's own errors."""


class InvalidRequestError(EngineError, ValueError):
    """The request cannot be served as given (HTTP 400): bad parameter, prompt too long, ..."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class QueueFullError(EngineError):
    """The waiting queue is at its limit (HTTP 429); retry later -- after `retry_after` seconds
    (the server's Retry-After header) when the engine has an estimate."""

    def __init__(self, message: str, retry_after: int | None = None):
        super().__init__(message)
        self.retry_after = retry_after


class EngineDeadError(EngineError):
    """The step loop died; no request can be served (HTTP 503)."""


class ModelNotFoundError(EngineError, FileNotFoundError):
    """A model source could not be located."""


class UnsupportedModelError(EngineError, ValueError):
    """A model was found but its architecture is not one the engine implements."""


class RequestFailedError(EngineError):
    """The engine failed while serving this request (HTTP 500; `code` "constraint_failed": its
    constraint failed, a 400); other requests were not affected."""

    def __init__(self, message: str, code: str = "request_failed"):
        super().__init__(message)
        self.code = code


class ConstraintError(EngineError):
    """A request's output constraint failed mid-generation (its matcher is in error: a limit of the
    grammar engine reached); the request ends with this error, never with a "stop"."""


class ShuttingDownError(EngineError):
    """The server is shutting down and cut this request short, or accepts no new ones (HTTP 503)."""


# Messages of device errors after which the CUDA context (and so every tensor on it) is unusable.
_DEVICE_FAILURE_MARKERS = ("CUDA error", "device-side assert", "illegal memory access", "CUBLAS_STATUS",
                           "CUDNN_STATUS", "NCCL error", "HIP error", "unspecified launch failure")


def is_unrecoverable(exc: BaseException) -> bool:
    """Whether `exc`, raised by a step, leaves the engine unable to serve anything.

    Device faults (a sticky CUDA error, a device-side assert) poison the whole context, and
    ``BaseException``s that are not ``Exception``s (KeyboardInterrupt, SystemExit) mean stop. Everything
    else -- a bad value in one request, a drafter bug, even an out-of-memory error -- is scoped to the
    step that raised it and handled by failing only the requests that cause it.
    """
    if not isinstance(exc, Exception):
        return True
    import torch

    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    if isinstance(exc, torch.OutOfMemoryError):
        return False
    message = str(exc)
    return isinstance(exc, RuntimeError) and any(marker in message for marker in _DEVICE_FAILURE_MARKERS)
