"""The stubs of taskstream.v1 are exactly what grpcio-tools generates from
proto/ (the repository's, or the copy vendored into the sdist); a changed
proto without regenerated stubs fails here."""

import importlib.util
import os
import pathlib
import shutil

import taskstream.v1

PACKAGE_ROOT = pathlib.Path(__file__).resolve().parent.parent


def load_generator():
    spec = importlib.util.spec_from_file_location("generate", PACKAGE_ROOT / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def proto_dir():
    return pathlib.Path(os.environ.get("TASKSTREAM_PROTO_DIR", PACKAGE_ROOT / "proto"))


def installed_stubs():
    # taskstream/v1/__init__.py -> the directory that holds taskstream/.
    return pathlib.Path(taskstream.v1.__file__).resolve().parent.parent.parent


def test_installed_stubs_match_proto():
    generator = load_generator()
    assert (proto_dir() / "taskstream/v1/taskstream.proto").is_file(), proto_dir()
    assert generator.drift(proto_dir(), installed_stubs()) == []


def test_a_changed_proto_is_caught(tmp_path):
    generator = load_generator()
    changed = tmp_path / "proto"
    shutil.copytree(proto_dir(), changed)
    path = changed / "taskstream/v1/processor.proto"
    path.write_text(path.read_text() + "\nmessage AddedLater { string field = 1; }\n")
    differ = generator.drift(changed, installed_stubs())
    assert "taskstream/v1/processor_pb2.py" in differ
    assert "taskstream/v1/taskstream_pb2.py" not in differ
