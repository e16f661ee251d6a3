"""The packages stand in layers and every import points down or sideways within one package
(docs/architecture.md): the core (`splitspec`) imports no service and no tool, a service imports
the core and itself only (never another service), and the tools (`splitspec_tools`) stand on top.
Read from the source with `ast`, lazy imports inside functions included."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYER = {"splitspec": 0, "target_service": 1, "draft_service": 1, "gateway": 1, "splitspec_tools": 2}


def imported_packages(source: str, package: str) -> list[tuple[int, str]]:
    """(line, top-level package) of every import in `source`, a module of `package`; relative
    imports stay inside their own package."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, package if node.level else (node.module or "").split(".")[0]))
    return found


def wrong_way(source: str, package: str) -> list[str]:
    """The imports of a module of `package` that point up a layer or across to another service."""
    here = LAYER[package]
    bad = []
    for line, top in imported_packages(source, package):
        if top in LAYER and top != package and LAYER[top] >= here:
            bad.append(f"line {line}: {package} imports {top}")
    return bad


def test_every_import_points_down_or_stays_home():
    bad = []
    for package in LAYER:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            bad += [f"{path.relative_to(ROOT)} {b}" for b in wrong_way(path.read_text(), package)]
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def test_the_check_sees_an_upward_a_sideways_and_a_lazy_import():
    lazy_up = "def f():\n    from gateway.chat import render\n"
    assert wrong_way(lazy_up, "splitspec") == ["line 2: splitspec imports gateway"]
    assert wrong_way("import target_service.scheduler\n", "draft_service") == \
        ["line 1: draft_service imports target_service"]
    assert wrong_way("from splitspec_tools.bench import run\n", "gateway") == ["line 1: gateway imports splitspec_tools"]
    # Down, and within the package (relative or not), is fine.
    assert wrong_way("from splitspec.engine import tree\nfrom . import server\nimport gateway.chat\n", "gateway") == []
    assert wrong_way("import target_service.engine\nfrom gateway import chat\n", "splitspec_tools") == []
