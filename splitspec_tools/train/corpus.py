"""The training corpus: the Python standard library that ships with the running interpreter.

Nothing is downloaded and no corpus text is committed; the split is by file, decided by a hash
of the file's path relative to the stdlib root, so it is the same on every machine and run.
"""
from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Folder names that hold the stdlib's own test suites (test, tests, idlelib/idle_test,
# lib2to3/tests, unittest/test/testmock, ...): held out entirely, never trained on.
TEST_DIR_NAMES = {"test", "tests", "idle_test", "testmock"}
SKIP_DIR_NAMES = {"site-packages", "dist-packages", "__pycache__"}
# Generated data rather than code: ~750 KB of English help text and the gencodec.py charmap
# tables (~1.7 MB of '\x00' -> NULL lines). Together ~20% of the bytes; they would teach
# nothing about Python and dilute a small training budget.
SKIP_FILES = {"pydoc_data/topics.py"}
GENERATED_MARKER = "with gencodec.py"

HELDOUT_PERCENT = 2


@dataclass(frozen=True)
class Doc:
    path: str   # relative to the stdlib root, '/'-separated
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_test_or_skipped(rel: Path) -> bool:
    dirs = rel.parts[:-1]
    return any(d in TEST_DIR_NAMES or d in SKIP_DIR_NAMES or d.startswith("config-")
               for d in dirs) or rel.as_posix() in SKIP_FILES


def list_sources(root: Path | None = None) -> list[str]:
    root = Path(root) if root is not None else stdlib_root()
    rels = (p.relative_to(root) for p in root.rglob("*.py") if p.is_file())
    return sorted(r.as_posix() for r in rels if not is_test_or_skipped(r))


def is_heldout(rel: str, percent: int = HELDOUT_PERCENT) -> bool:
    digest = hashlib.sha256(rel.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % 100 < percent


def read_doc(root: Path, rel: str) -> Doc | None:
    try:
        text = (root / rel).read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None
    if GENERATED_MARKER in text[:500] or not text.strip():
        return None
    return Doc(rel, text)


def load_corpus(root: Path | None = None, max_files: int | None = None) -> tuple[list[Doc], list[Doc]]:
    """(train, heldout) documents. `max_files` keeps a small deterministic subset (tests):
    the first max_files train files and at least one held-out file."""
    root = Path(root) if root is not None else stdlib_root()
    train, heldout = [], []
    for rel in list_sources(root):
        (heldout if is_heldout(rel) else train).append(rel)
    if max_files is not None:
        train, heldout = train[:max_files], heldout[:max(1, max_files // 10)]
    load = lambda rels: [d for d in (read_doc(root, r) for r in rels) if d is not None]  # noqa: E731
    return load(train), load(heldout)
