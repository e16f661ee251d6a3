"""The committed stubs in splitspec/v1 are what protos/ generates: regenerate into a temporary
folder and compare (run `python -m splitspec_tools.protogen` after editing a proto).

The lines that only record which generator wrote a stub (grpcio-tools' GRPC_GENERATED_VERSION,
protoc's version banner and runtime check) are masked: the registry moves grpcio-tools forward
within the pinned minor series, and a stub stamped with an older patch release is still the
right stub (it asks the runtime for that release or newer, which `grpcio>=` guarantees)."""
from __future__ import annotations

import re
from pathlib import Path

from splitspec_tools import protogen

STUBS = Path(protogen.ROOT) / "splitspec" / "v1"

_GENERATOR_STAMPS = [
    re.compile(rb"^GRPC_GENERATED_VERSION = '[^']*'$", re.M),
    re.compile(rb"^# Protobuf Python Version: .*$", re.M),
    re.compile(rb"_runtime_version\.ValidateProtobufRuntimeVersion\([^)]*\)", re.S),
]


def without_generator_stamps(text: bytes) -> bytes:
    for stamp in _GENERATOR_STAMPS:
        text = stamp.sub(b"<generator stamp>", text)
    return text


def test_stubs_are_up_to_date(tmp_path):
    fresh = {p.name: p.read_bytes() for p in protogen.generate(tmp_path)}
    committed = {p.name: p.read_bytes() for p in STUBS.glob("*_pb2*.py*")}
    assert sorted(fresh) == sorted(committed), "stub files differ: run python -m splitspec_tools.protogen"
    stale = [name for name in fresh
             if without_generator_stamps(fresh[name]) != without_generator_stamps(committed[name])]
    assert not stale, f"stale stubs {stale}: run python -m splitspec_tools.protogen"


def test_the_mask_hides_only_generator_stamps():
    stub = (STUBS / "target_pb2_grpc.py").read_bytes()
    bumped = stub.replace(b"GRPC_GENERATED_VERSION = '", b"GRPC_GENERATED_VERSION = '9")
    assert bumped != stub and without_generator_stamps(bumped) == without_generator_stamps(stub)
    edited = stub.replace(b"def ", b"def x_", 1)
    assert without_generator_stamps(edited) != without_generator_stamps(stub)


def test_every_proto_has_stubs():
    protos = sorted(p.stem for p in (protogen.PROTO_DIR / "splitspec" / "v1").glob("*.proto"))
    assert protos == ["common", "draft", "gateway", "target"]
    for name in protos:
        assert (STUBS / f"{name}_pb2.py").is_file() and (STUBS / f"{name}_pb2_grpc.py").is_file()
