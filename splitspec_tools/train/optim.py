"""The optimizer both trainers (target.py, draft.py) use, and its flags: AdamW with betas
0.9 / 0.95, weight decay on matrices only (norms and biases keep theirs), gradient clipping, a
linear warm-up and a floor the decay ends at."""
from __future__ import annotations

import torch


def add_optimizer_flags(parser, *, lr: float, weight_decay: float) -> None:
    a = parser.add_argument
    a("--lr", type=float, default=lr)
    a("--min-lr-ratio", type=float, default=0.05)
    a("--warmup", type=int, default=100)
    a("--weight-decay", type=float, default=weight_decay)
    a("--clip", type=float, default=1.0)
    a("--seed", type=int, default=0)


def make_optimizer(model, args) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
