"""The service layer: one implementation of every operation the HTTP surfaces expose."""

from .service import Core

__all__ = ["Core"]
