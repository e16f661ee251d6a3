"""The torch verification backend: `verify.py`'s rules on any device, for any tree shape.

Kept apart from `flashinfer_backend.py` so that the default backend never sits in a module
whose purpose is an optional CUDA dependency."""
from __future__ import annotations

from target_service.verify import VerifyResult, verify_tree


class TorchVerifier:
    name = "torch"

    def verify(self, logits, tree, params, generator, draft_probs, position=None) -> VerifyResult:
        return verify_tree(logits, tree, params, generator, draft_probs, position)
