"""Generates the stubs of src/taskstream/v1 from proto/ with grpcio-tools.

    python generate.py            # write them
    python generate.py --check    # exit 1 if the committed stubs differ

proto/ is the repository's proto directory (a symlink in the repository, a
copy in the sdist), so this works in a clone and in an unpacked sdist alike.
"""

import filecmp
import pathlib
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
PROTOS = ["taskstream/v1/taskstream.proto", "taskstream/v1/processor.proto"]
OUTPUTS = [
    "taskstream/v1/taskstream_pb2.py",
    "taskstream/v1/taskstream_pb2.pyi",
    "taskstream/v1/taskstream_pb2_grpc.py",
    "taskstream/v1/processor_pb2.py",
    "taskstream/v1/processor_pb2.pyi",
    "taskstream/v1/processor_pb2_grpc.py",
]


def generate(proto_dir: pathlib.Path, out: pathlib.Path):
    from grpc_tools import protoc

    for proto in PROTOS:
        if not (proto_dir / proto).is_file():
            raise SystemExit(f"generate.py: {proto_dir / proto} is missing")
    args = [
        "grpc_tools.protoc",
        f"-I{proto_dir}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *PROTOS,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("generate.py: grpc_tools.protoc failed")


def drift(proto_dir: pathlib.Path, stubs: pathlib.Path):
    """The stub files under `stubs` that differ from what `proto_dir` generates."""
    with tempfile.TemporaryDirectory() as scratch:
        fresh = pathlib.Path(scratch)
        generate(proto_dir, fresh)
        return [name for name in OUTPUTS
                if not (stubs / name).is_file() or not filecmp.cmp(fresh / name, stubs / name, shallow=False)]


def main(argv):
    proto_dir, stubs = HERE / "proto", HERE / "src"
    if argv == ["--check"]:
        differ = drift(proto_dir, stubs)
        if differ:
            print("stubs differ from proto/: " + ", ".join(differ) + "; run python generate.py", file=sys.stderr)
            return 1
        print(f"{len(OUTPUTS)} stubs match proto/")
        return 0
    if argv:
        print(__doc__, file=sys.stderr)
        return 2
    generate(proto_dir, stubs)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
