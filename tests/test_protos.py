"""The committed stubs in splitspec/v1 are what protos/ generates: regenerate into a temporary
folder and compare byte for byte (run `python -m splitspec.protogen` after editing a proto)."""
from __future__ import annotations

from pathlib import Path

from splitspec import protogen

STUBS = Path(protogen.ROOT) / "splitspec" / "v1"


def test_stubs_are_up_to_date(tmp_path):
    fresh = {p.name: p.read_bytes() for p in protogen.generate(tmp_path)}
    committed = {p.name: p.read_bytes() for p in STUBS.glob("*_pb2*.py*")}
    assert sorted(fresh) == sorted(committed), "stub files differ: run python -m splitspec.protogen"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale stubs {stale}: run python -m splitspec.protogen"


def test_every_proto_has_stubs():
    protos = sorted(p.stem for p in (protogen.PROTO_DIR / "splitspec" / "v1").glob("*.proto"))
    assert protos == ["common", "draft", "gateway", "target"]
    for name in protos:
        assert (STUBS / f"{name}_pb2.py").is_file() and (STUBS / f"{name}_pb2_grpc.py").is_file()
