"""The training checkpoint both trainers (target.py, draft.py) resume from: the model, the
optimizer, both RNG states, the run's flags and its own fields, written atomically. A resume
refuses a checkpoint made with other settings than those that shape the run."""
from __future__ import annotations

import os
import random
from pathlib import Path

import torch


def add_run_flags(a, out: str, run_dir: str, what: str) -> None:
    """The flags every trainer takes (`a`: a parser's add_argument): where the model goes, and the run
    folder its checkpoint resumes from."""
    a("--out", default=out, help=f"{what} folder to write")
    a("--run-dir", default=run_dir, help="checkpoint, cached data, logs and metrics")
    a("--fresh", action="store_true", help="ignore an existing checkpoint and cached data in --run-dir")


def save(path: Path, model, opt, args, **fields) -> None:
    blob = {"model": model.state_dict(), "optimizer": opt.state_dict(), "args": vars(args),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}, **fields}
    tmp = path.with_suffix(".tmp")
    torch.save(blob, tmp)
    os.replace(tmp, path)  # atomic: a kill mid-save leaves the previous checkpoint intact


def load(path: Path, model, opt, args, resume_keys: tuple[str, ...]) -> dict:
    """Restore `model`, `opt` and the RNGs from `path`; returns the whole checkpoint for the
    caller's own fields. `resume_keys`: the flags that must equal the checkpoint's."""
    blob = torch.load(path, weights_only=False, map_location="cpu")
    diff = [k for k in resume_keys if blob["args"].get(k) != getattr(args, k)]
    if diff:
        raise SystemExit(f"{path}: checkpoint was made with different {', '.join(diff)}; "
                         f"use the same settings or --fresh")
    model.load_state_dict(blob["model"])
    opt.load_state_dict(blob["optimizer"])
    torch.set_rng_state(blob["rng"]["torch"])
    random.setstate(blob["rng"]["python"])
    return blob
