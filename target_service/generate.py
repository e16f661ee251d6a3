"""Target-only in-process generation (`generate`), re-exported for callers that want just that."""
from target_service.engine import generate

__all__ = ["generate"]
