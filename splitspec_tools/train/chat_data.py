"""Chat prompts for training a draft against an instruct target, built offline from what is on
disk: the functions and classes of the Python standard library (the training split of
`corpus.py`; its held-out files stay out) turned into instructions, code-completion requests,
explanations and short multi-turn exchanges (the request after the code, so that the cut
below keeps it), rendered with the target's own chat template.

HumanEval is never read here. The target answers these prompts itself (the trainer regenerates
every answer), so the draft learns the target's own distribution in the format it is served in:
acceptance falls sharply when the serving prompt format differs from the training one.

The prompts come out as a pool [N, W]: each row the last W tokens of one rendered prompt, which
ends with the assistant's header, so every row is where an answer starts (`draft_data.windows`
draws rows from it)."""
from __future__ import annotations

import ast
import random
import textwrap
from pathlib import Path

import torch

from . import corpus

MAX_SOURCE_LINES = 30


def _functions(doc: corpus.Doc):
    """(qualified name, signature line, docstring, source) of each documented function."""
    try:
        tree = ast.parse(doc.text)
    except (SyntaxError, ValueError):
        return
    lines = doc.text.splitlines()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
            continue
        text = ast.get_docstring(node)
        if not text or len(text) < 40:
            continue
        source = "\n".join(lines[node.lineno - 1: node.end_lineno])
        sig = lines[node.lineno - 1].strip().rstrip(":")
        yield node.name, sig, text, textwrap.dedent(source)


def conversations(docs: list[corpus.Doc], seed: int) -> list[list[dict]]:
    """Chat message lists (user turns, and earlier assistant turns in the multi-turn ones)."""
    rng = random.Random(seed)
    out = []
    for doc in docs:
        module = doc.path.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
        for name, sig, text, source in _functions(doc):
            summary = text.strip().split("\n\n")[0].replace("\n", " ")
            code = "\n".join(source.splitlines()[:MAX_SOURCE_LINES])
            stub = f"{sig}:\n    \"\"\"{textwrap.indent(text, '    ').strip()}\n    \"\"\"\n"
            kind = rng.randrange(6)
            if kind == 0:
                msgs = [{"role": "user", "content": f"Write a Python function `{sig.removeprefix('def ')}`. "
                                                    f"It should do the following: {summary}"}]
            elif kind == 1:
                msgs = [{"role": "user", "content": f"```python\n{stub}```\nComplete this Python function."}]
            elif kind == 2:
                msgs = [{"role": "user", "content": f"```python\n{code}\n```\nExplain what this Python code does."}]
            elif kind == 3:
                msgs = [{"role": "user", "content": f"```python\n{code}\n```\nWrite a docstring for this function."}]
            elif kind == 4:
                msgs = [{"role": "user", "content": f"What does `{name}` in Python's `{module}` module do?"},
                        {"role": "assistant", "content": summary},
                        {"role": "user", "content": "Can you show a short example of how to use it?"}]
            else:
                msgs = [{"role": "user", "content": f"I need a function that does this: {summary} "
                                                    "How would you write it in Python?"}]
            out.append(msgs)
    rng.shuffle(out)
    return out


def prompt_pool(target_path, width: int, *, max_files: int | None, seed: int = 0) -> dict[str, torch.Tensor]:
    """{"train": [N, width], "heldout": [M, width]} token ids of rendered chat prompts, each cut
    to its last `width` tokens; prompts shorter than `width` are left out."""
    from gateway.chat import ChatTemplate
    from splitspec.models.loader import load_tokenizer, model_folder
    folder = model_folder(target_path)
    template = ChatTemplate((folder / "tokenizer_config.json").read_text(), str(folder))
    if not template.available:
        raise ValueError(f"{target_path}: the target has no chat template; --data chat needs one")
    tok = load_tokenizer(folder)
    train_docs, held_docs = corpus.load_corpus(max_files=max_files)

    def pool(docs, salt):
        texts = [template.render(m) for m in conversations(docs, seed + salt)]
        rows = [enc.ids[-width:] for enc in tok.encode_batch(texts, add_special_tokens=False)
                if len(enc.ids) >= width]
        if not rows:
            raise ValueError(f"no chat prompt of {width} tokens or more; lower --prompt-len")
        return torch.tensor(rows, dtype=torch.int32)

    return {"train": pool(train_docs, 0), "heldout": pool(held_docs, 1),
            "train_files": len(train_docs), "heldout_files": len(held_docs)}
