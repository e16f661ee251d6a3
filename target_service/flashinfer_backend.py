"""FlashInfer verification backend (CUDA only, `pip install splitspec[cuda]`).

Same semantics as `verify.py`: FlashInfer's `chain_speculative_sampling` implements the
min(1, p/q) rule with residual norm(max(p - q, 0)); a deterministic draft is passed as
one-hot q, which reduces that rule to target-only sampling (accept with p(x), resample from
p without x). Trees with branches go to the torch reference, which handles any shape.
FlashInfer is imported only when this backend is chosen, so CPU installs never need it.
"""
from __future__ import annotations

import torch

from splitspec.engine.flashinfer_attention import require_flashinfer
from splitspec.engine.sample import SamplingParams, probs_from_logits
from splitspec.engine.tree import Tree
from target_service.torch_verifier import TorchVerifier
from target_service.verify import VerifyResult, verify_tree


class BackendError(RuntimeError):
    """The requested sampling backend cannot run here."""


class FlashInferVerifier:
    name = "flashinfer"

    def __init__(self, device: torch.device):
        require_flashinfer(device, "--sampling-backend", BackendError)
        import flashinfer.sampling as fis
        self._fis = fis

    def verify(self, logits: torch.Tensor, tree: Tree, params: SamplingParams,
               generator: torch.Generator | None, draft_probs: torch.Tensor | None,
               position: int | None = None) -> VerifyResult:
        is_chain = list(tree.parents) == list(range(-1, len(tree) - 1))
        # Coupled sampling draws no coins: the walk costs one Gumbel-argmax per accepted row.
        if params.greedy or params.coupled or not is_chain or len(tree) == 0:
            return verify_tree(logits, tree, params, generator, draft_probs, position)
        ids = torch.tensor([tree.token_ids], device=logits.device, dtype=torch.int32)
        target_probs = probs_from_logits(logits, params)[None]            # [1, n+1, V]
        if draft_probs is None:
            q = torch.nn.functional.one_hot(ids[0].long(), logits.shape[-1]).float()[None]
        else:
            q = draft_probs.float()[None]
        out, _, _ = self._fis.chain_speculative_sampling(q, ids, target_probs, generator=generator)
        row = [int(t) for t in out[0].tolist()]
        emitted = [t for t in row if t >= 0]
        return VerifyResult(list(range(len(emitted) - 1)), emitted[-1]) if emitted else VerifyResult([], row[0])


def make_verifier(backend: str, device: torch.device):
    if backend == "torch":
        return TorchVerifier()
    if backend == "flashinfer":
        return FlashInferVerifier(device)
    raise BackendError(f"--sampling-backend {backend!r} is not supported; expected torch or flashinfer")
