"""Where the bundled default models live, for every command that loads them (`splitspec up`,
the bench, the trainers). One small module so the commands do not import each other."""
from __future__ import annotations

from pathlib import Path

DEFAULT_TARGET = "models/splitspec-code-target"
DEFAULT_DRAFT = "models/splitspec-code-draft"
DEFAULT_GATEWAY_PORT = 50050


def model_dir(given: str | None, default: str) -> Path | None:
    """The given folder, else the default one under the working directory or the source tree."""
    if given:
        return Path(given)
    for root in (Path.cwd(), Path(__file__).resolve().parent.parent):
        if (root / default / "config.json").is_file():
            return root / default
    return None
