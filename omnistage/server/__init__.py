"""The OpenAI-compatible HTTP server: app factory, protocol models, error mapping, metrics."""

from omnistage.server.app import build_app

__all__ = ["build_app"]
