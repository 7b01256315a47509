"""The client against a real server: every RPC as a method, errors as the
exception of their status code with decoded details, and get_metadata_async's
callbacks (one per batch, clean stop, bounded completion)."""

import threading

import grpc
import pytest
from conftest import eventually

import taskstream
from taskstream import errors
from taskstream.v1 import taskstream_pb2 as pb

CONFIG = """
application_id = "pytest-client"
num_stream_threads = 2
num_threads_per_task = 2
commit_interval_ms = 50

[[topics]]
name = "events"
partitions = 4

[[pipelines]]
name = "counts"
source_topic = "events"
processor = "count"

[[pipelines]]
name = "ukeys"
source_topic = "events"
processor = "latest"
processing_order = "unordered"
"""

KEYS = ["alice", "bob", "carol", "dave", "erin", "frank"]


@pytest.fixture
def client(start_server):
    server = start_server(CONFIG)
    with taskstream.Client(server.address, timeout=10) as client:
        client.wait_ready()
        yield client


def produce_keyed(client, count):
    records = [(KEYS[i % len(KEYS)], f"value {i}") for i in range(count)]
    return client.produce("events", records)


def test_produce_query_and_metadata(client):
    answer = produce_keyed(client, 60)
    assert answer.record_count == 60
    assert len(answer.positions) == 60
    eventually("counts of 10 per key", lambda: all(client.get("counts", k) == b"10" for k in KEYS))
    entries = list(client.range("counts"))
    assert sorted(e.key for e in entries) == sorted(k.encode() for k in KEYS)
    assert all(e.value == b"10" for e in entries)
    assert client.get("counts", "nobody") is None

    metadata = client.metadata_for_store("counts")
    assert metadata.in_order and metadata.processing_order == pb.PROCESSING_ORDER_OFFSET
    partitions = {tp.partition for m in metadata.metadata for tp in m.topic_partitions}
    assert partitions == {0, 1, 2, 3}
    key = client.metadata_for_key("counts", "alice")
    assert key.partition in partitions and key.active_host.port > 0

    read = client.read_topic("events", key.partition)
    assert read.records and all(r.partition == key.partition for r in read.records)
    runtime = client.describe_runtime()
    assert runtime.application_id == "pytest-client"
    assert {p.name for p in runtime.pipelines} == {"counts", "ukeys"}


def test_produce_stream_and_record_helper(client):
    batches = [[taskstream.record("v", key="k", headers={"h": "1"})], [("k", "w"), "no key"]]
    answer = client.produce_stream("events", batches)
    assert answer.record_count == 3
    with pytest.raises(ValueError, match="partition must be 0 or more"):
        taskstream.record("v", partition=-1)
    with pytest.raises(TypeError, match="value must be bytes or str"):
        client.produce("events", [("k", 3)])


def test_admin_threads(client):
    added = client.add_stream_thread()
    assert added.num_stream_threads == 3
    removed = client.remove_stream_thread(added.thread_name)
    assert removed.thread_name == added.thread_name and removed.num_stream_threads == 2
    with pytest.raises(errors.InvalidArgument):
        # Fewer threads than num_threads_per_task (2) would remain.
        client.remove_stream_thread()
    with pytest.raises(ValueError, match="either dead-letter offsets or all=True"):
        client.redrive_dead_letters("counts", 0)


def test_errors_carry_code_and_details(client):
    with pytest.raises(errors.InvalidArgument) as invalid:
        client.query(pb.QueryRequest(store="", key=pb.KeyQuery(key=b"k")))
    assert invalid.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert [v.field for v in invalid.value.field_violations] == ["store"]
    assert not invalid.value.retryable

    with pytest.raises(errors.NotFound) as missing:
        client.process_metadata_for_store("no-such-store")
    assert missing.value.resource_info is not None
    assert missing.value.resource_info.resource_name == "no-such-store"
    assert missing.value.resource_info.resource_type == "store"

    with pytest.raises(errors.FailedPrecondition) as refused:
        client.metadata_for_store("ukeys")
    violations = refused.value.precondition_violations
    assert violations and violations[0].subject == "ukeys", violations
    assert not isinstance(refused.value, errors.NotHosted)

    with pytest.raises(errors.LimitExceeded) as limit:
        client.produce("events", [taskstream.record(b"v" * (5 << 20))])
    assert limit.value.reason == errors.REASON_LIMIT_EXCEEDED
    assert limit.value.setting == "max_message_bytes"

    with pytest.raises(errors.NotFound):
        client.produce("no-such-topic", ["v"])

    # Bad input never reaches the server.
    with pytest.raises(ValueError, match="store must be a non-empty string"):
        client.metadata_for_store("")


def test_unreachable_server_is_unavailable():
    with taskstream.Client("127.0.0.1:1", timeout=5) as client:
        with pytest.raises(errors.Unavailable) as unreachable:
            client.describe_runtime()
    assert unreachable.value.retryable


def test_bad_targets_are_refused_clearly():
    for target, message in [
        ("", "target must be"),
        ("localhost", "is not host:port"),
        ("ftp://h:1", "scheme must be http or https"),
        ("h:99999", "is not host:port"),
    ]:
        with pytest.raises(ValueError, match=message):
            taskstream.Client(target)
    assert taskstream.parse_target("https://example:443/") == ("example:443", True)
    with pytest.raises(ValueError, match="timeout must be more than 0"):
        taskstream.Client("h:1", timeout=0)


def test_bounded_stream_calls_back_per_batch_then_completes(client):
    produce_keyed(client, 120)
    eventually("120 records counted", lambda: sum(int(e.value) for e in client.range("counts")) == 120)
    batches, errors_seen, lock = [], [], threading.Lock()

    def callback(error, batch):
        with lock:
            if error is not None:
                errors_seen.append(error)
            else:
                batches.append(batch)

    subscription = client.get_metadata_async(
        "counts", callback, in_order=True, start=pb.START_POSITION_EARLIEST, end=pb.END_POSITION_CURRENT
    )
    assert subscription.join(30), "a bounded stream must complete"
    assert subscription.error is None and not errors_seen, errors_seen
    assert subscription.batches == len(batches) > 0
    offsets = {}
    for batch in batches:
        offsets.setdefault(batch.partition, []).extend(r.offset for r in taskstream.final_records(batch))
    assert sum(len(v) for v in offsets.values()) == 120
    for partition, seen in offsets.items():
        assert seen == list(range(len(seen))), f"partition {partition} not in offset order: {seen}"


def test_open_stream_stops_cleanly_and_errors_reach_the_callback(client):
    got = threading.Event()
    calls = []

    class Recorder:
        def on_complete(self, error, batch):
            calls.append((error, batch))
            if batch is not None:
                got.set()

    subscription = client.get_metadata_async("counts", Recorder())
    produce_keyed(client, 10)
    assert got.wait(30), "no batch arrived"
    assert subscription.stop(10), "stop() did not end the stream"
    assert subscription.done and subscription.error is None
    assert all(error is None for error, _ in calls), calls

    # An error that ends the stream: one callback with it, none after.
    failures = []
    failed = client.get_metadata_async("ukeys", lambda e, b: failures.append(e), in_order=True)
    assert failed.join(30)
    assert len(failures) == 1 and isinstance(failures[0], errors.FailedPrecondition), failures
    assert isinstance(failed.error, errors.FailedPrecondition)

    # A callback that raises stops its stream and is kept as the error.
    def exploding(error, batch):
        raise RuntimeError("boom")

    exploded = client.get_metadata_async("counts", exploding)
    produce_keyed(client, 10)
    assert exploded.join(30)
    assert isinstance(exploded.error, RuntimeError)

    with pytest.raises(TypeError, match="callback must be callable"):
        client.get_metadata_async("counts", object())


def test_error_mapping_without_a_server():
    from google.rpc import error_details_pb2, status_pb2

    status = status_pb2.Status(code=grpc.StatusCode.FAILED_PRECONDITION.value[0], message="elsewhere")
    info = error_details_pb2.ErrorInfo(reason="PARTITION_NOT_HOSTED", domain="taskstream",
                                       metadata={"owner": "10.0.0.2:50051"})
    status.details.add().Pack(info)
    trailer = [(errors.STATUS_DETAILS_KEY, status.SerializeToString())]
    error = errors.error_of(grpc.StatusCode.FAILED_PRECONDITION, "elsewhere", trailer)
    assert isinstance(error, errors.NotHosted) and error.owner == "10.0.0.2:50051"

    # A trailer with another code is not this call's.
    other = errors.error_of(grpc.StatusCode.INTERNAL, "x", trailer)
    assert type(other) is errors.TaskstreamError and other.details == []

    retry = status_pb2.Status(code=grpc.StatusCode.UNAVAILABLE.value[0], message="restoring")
    retry_info = error_details_pb2.RetryInfo()
    retry_info.retry_delay.FromMilliseconds(250)
    retry.details.add().Pack(retry_info)
    unavailable = errors.error_of(grpc.StatusCode.UNAVAILABLE, "restoring",
                                  [(errors.STATUS_DETAILS_KEY, retry.SerializeToString())])
    assert isinstance(unavailable, errors.Unavailable) and unavailable.retry_delay == 0.25

    out = status_pb2.Status(code=grpc.StatusCode.OUT_OF_RANGE.value[0], message="gone")
    out.details.add().Pack(error_details_pb2.ErrorInfo(reason="OFFSET_OUT_OF_RANGE",
                                                        metadata={"partition": "3", "earliest": "42"}))
    gone = errors.error_of(grpc.StatusCode.OUT_OF_RANGE, "gone",
                           [(errors.STATUS_DETAILS_KEY, out.SerializeToString())])
    assert isinstance(gone, errors.OutOfRange) and (gone.partition, gone.earliest) == (3, 42)

    notice = errors.lagged_notice(7)
    assert isinstance(notice, errors.Lagged) and notice.missed_batches == 7
