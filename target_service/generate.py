"""Target-only in-process generation (`generate`), re-exported for callers that want just that."""
from .engine import generate

__all__ = ["generate"]
