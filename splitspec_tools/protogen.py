"""Regenerate the Python gRPC stubs in `splitspec/v1/` from `protos/`.

    python -m splitspec_tools.protogen            # write the stubs in place
    python -m splitspec_tools.protogen --out DIR  # write them elsewhere (the staleness test does this)
"""
from __future__ import annotations

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"


def generate(out: Path) -> list[Path]:
    from grpc_tools import protoc
    import grpc_tools
    protos = sorted(str(p.relative_to(PROTO_DIR)) for p in (PROTO_DIR / "splitspec" / "v1").glob("*.proto"))
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    out.mkdir(parents=True, exist_ok=True)
    rc = protoc.main(["protoc", f"-I{PROTO_DIR}", f"-I{include}", f"--python_out={out}",
                      f"--grpc_python_out={out}", f"--pyi_out={out}", *protos])
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}")
    return sorted((out / "splitspec" / "v1").glob("*_pb2*.py*"))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT, help="root to write splitspec/v1/*_pb2*.py under")
    files = generate(ap.parse_args(argv).out)
    print("\n".join(str(f) for f in files))


if __name__ == "__main__":
    main()
