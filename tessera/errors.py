"""Errors that describe what a caller sent, each with the HTTP status the server answers it with.

Everything here is a ValueError, so the offline API and the CLI treat them as bad input like any
other ValueError; the server maps `status_code` onto its response."""

from __future__ import annotations


class InputError(ValueError):
    """Bad input: 400."""

    status_code = 400


class InputTooLargeError(InputError):
    """Input over a size limit (bytes, pixels, characters): 413."""

    status_code = 413


class ServerBusyError(RuntimeError):
    """Too much work of one kind is in flight (e.g. media fetches); retry later: 503."""

    status_code = 503


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker died or the ranks fell out of step: the engine cannot run another step
    and must be restarted (unlike a model error, which fails only that step's requests)."""


class EngineDeadError(RuntimeError):
    """The engine (its thread, a replica process or a tensor-parallel rank) stopped after an unexpected error;
    nothing more can be generated until it is restarted: 503."""

    status_code = 503


class RequestFailedError(RuntimeError):
    """The engine failed while running this request; others go on. `status_code`: 500 where it is not
    the caller's fault, 400 where the request's own inputs could not run, 503 where the server ended it
    while shutting down."""

    def __init__(self, message: str, status_code: int = 500) -> None:
        super().__init__(message)
        self.status_code = status_code
