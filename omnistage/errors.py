"""Typed errors raised where a problem is found; the server maps each to an HTTP status in one place."""


class OmnistageError(Exception):
    """Base class of every error omnistage raises on purpose."""


class CheckpointError(OmnistageError):
    """The checkpoint on disk cannot be loaded (missing, unexpected, misshapen or unreadable tensors)."""


class ConfigError(OmnistageError):
    """A config.json or YAML file asks for something omnistage cannot serve."""


class InvalidRequest(OmnistageError):
    """A request is malformed or asks for something impossible (the client's fault, HTTP 400)."""

    # the part of a speaking request it is about, which the server spells as the route's field (server/errors.py)
    field: str | None = None


class RequestTooLarge(InvalidRequest):
    """A request can never fit the KV page pool or the model's context."""


class InvalidMedia(InvalidRequest):
    """An audio or image attachment cannot be decoded or breaks a limit."""


class QueueFull(OmnistageError):
    """The server's waiting queue is at its limit (HTTP 503)."""
