"""A Python grpcio client of taskstream, run by tests/python_grpcio.rs.

Usage: grpcio_client.py ADDR STUBS_DIR

STUBS_DIR holds stubs generated from proto/ at test time (grpc_tools.protoc).
The server must run the embedded default (topic `events`, 8 partitions, store
`counts`, offset order, T = 2) plus a store `ukeys` on `events` that runs
`unordered` with T = 2, and `events` must be empty. Every check runs even when
an earlier one failed; the exit code is 0 only if all of them passed.
"""

import sys
import threading
import traceback

TIMEOUT_S = 30.0
KEYED_RECORDS = 60
KEYS = 12


def main():
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    addr, stubs = sys.argv[1], sys.argv[2]
    sys.path.insert(0, stubs)
    import grpc
    from taskstream.v1 import taskstream_pb2 as pb
    from taskstream.v1 import taskstream_pb2_grpc as pb_grpc

    channel = grpc.insecure_channel(addr)
    grpc.channel_ready_future(channel).result(timeout=TIMEOUT_S)
    streams = pb_grpc.StreamsServiceStub(channel)
    port = int(addr.rsplit(":", 1)[1])

    results = []

    def check(name, function):
        try:
            detail = function()
            results.append((name, True))
            print(f"ok    {name}" + (f": {detail}" if detail else ""))
        except Exception:  # every check runs; the failure is reported with its trace
            results.append((name, False))
            print(f"FAIL  {name}", flush=True)
            traceback.print_exc(file=sys.stdout)

    def expect_code(code, call):
        try:
            call()
        except grpc.RpcError as error:
            if error.code() != code:
                raise AssertionError(f"expected {code}, got {error.code()}: {error.details()}") from None
            return f"{error.code()}: {error.details()}"
        raise AssertionError(f"expected {code}, the call succeeded")

    # Per partition: the (offset, key) of every produced record, in offset order.
    produced = {}

    def produce():
        records = [
            pb.ProducerRecord(key=f"user-{i % KEYS}".encode(), value=str(i).encode())
            for i in range(KEYED_RECORDS)
        ]
        records.append(pb.ProducerRecord(value=b"no key"))
        response = streams.Produce(pb.ProduceRequest(topic="events", records=records), timeout=TIMEOUT_S)
        assert response.topic == "events", response
        assert response.record_count == len(records), response
        assert len(response.positions) == len(records), response
        for record, position in zip(records, response.positions):
            assert position.partition < 8, position
            key = record.key if record.HasField("key") else None
            produced.setdefault(position.partition, []).append((position.offset, key))
        for partition, entries in produced.items():
            offsets = [offset for offset, _ in entries]
            assert offsets == list(range(len(offsets))), f"partition {partition}: {offsets}"
        counted = sum(r.count for r in response.partitions)
        assert counted == len(records), response.partitions
        return f"{len(records)} records over {len(produced)} partitions"

    def metadata():
        request = pb.ProcessMetadataForStoreRequest(store="counts", in_order=True)
        response = streams.ProcessMetadataForStore(request, timeout=TIMEOUT_S)
        assert response.in_order, response
        assert response.processing_order == pb.PROCESSING_ORDER_OFFSET, response
        assert response.threads_per_task == 2, response
        assert len(response.metadata) == 1, response
        instance = response.metadata[0]
        assert instance.host_info.host == "127.0.0.1", instance.host_info
        assert instance.host_info.port == port, instance.host_info
        assert "counts" in instance.state_store_names, instance.state_store_names
        assert sorted(tp.partition for tp in instance.topic_partitions) == list(range(8))
        assert len(instance.tasks) == 8, instance.tasks
        for task in instance.tasks:
            assert task.task_id == f"counts_{task.partition}", task
            assert task.processing_order == pb.PROCESSING_ORDER_OFFSET, task
            assert task.owner_thread, task
            expected_end = len(produced.get(task.partition, []))
            assert task.end_offset == expected_end, (task, expected_end)
        return f"{len(instance.tasks)} tasks on {instance.host_info.host}:{instance.host_info.port}"

    def bounded_stream():
        request = pb.GetMetadataAsyncRequest(
            store="counts",
            in_order=True,
            start=pb.START_POSITION_EARLIEST,
            end=pb.END_POSITION_CURRENT,
        )
        seen = {}
        messages = 0
        # Iterating to the end raises unless the stream completes with OK.
        for response in streams.GetMetadataAsync(request, timeout=TIMEOUT_S):
            messages += 1
            assert response.WhichOneof("event") == "batch", f"unexpected event: {response}"
            batch = response.batch
            assert batch.store == "counts" and batch.topic == "events", batch
            assert batch.task_id == f"counts_{batch.partition}", batch
            assert batch.records, f"empty batch: {batch}"
            assert batch.first_offset == batch.records[0].offset, batch
            assert batch.last_offset == batch.records[-1].offset, batch
            for record in batch.records:
                assert record.outcome == pb.RECORD_OUTCOME_PROCESSED, record
                key = record.key if record.HasField("key") else None
                seen.setdefault(batch.partition, []).append((record.offset, key))
        # In arrival order: offsets per partition exactly as produced, each once.
        assert seen == produced, f"streamed {seen}\nproduced {produced}"
        return f"{sum(len(v) for v in seen.values())} records in {messages} messages, offset order"

    def failed_precondition():
        unary = expect_code(
            grpc.StatusCode.FAILED_PRECONDITION,
            lambda: streams.ProcessMetadataForStore(
                pb.ProcessMetadataForStoreRequest(store="ukeys", in_order=True), timeout=TIMEOUT_S
            ),
        )
        # A server stream reports its status when read.
        expect_code(
            grpc.StatusCode.FAILED_PRECONDITION,
            lambda: list(
                streams.GetMetadataAsync(
                    pb.GetMetadataAsyncRequest(store="ukeys", in_order=True, end=pb.END_POSITION_CURRENT),
                    timeout=TIMEOUT_S,
                )
            ),
        )
        granted = streams.ProcessMetadataForStore(
            pb.ProcessMetadataForStoreRequest(store="ukeys", in_order=False), timeout=TIMEOUT_S
        )
        assert not granted.in_order, granted
        assert granted.processing_order == pb.PROCESSING_ORDER_UNORDERED, granted
        return unary

    def not_found():
        return expect_code(
            grpc.StatusCode.NOT_FOUND,
            lambda: streams.ProcessMetadataForStore(
                pb.ProcessMetadataForStoreRequest(store="no-such-store", in_order=True), timeout=TIMEOUT_S
            ),
        )

    def invalid_argument():
        return expect_code(
            grpc.StatusCode.INVALID_ARGUMENT,
            lambda: streams.ProcessMetadataForStore(
                pb.ProcessMetadataForStoreRequest(store="", in_order=True), timeout=TIMEOUT_S
            ),
        )

    def rich_error_details():
        # grpcio shows code and message; the details (google.rpc.Status in the
        # grpc-status-details-bin trailer) need the grpcio-status package.
        from google.rpc import error_details_pb2
        from grpc_status import rpc_status

        try:
            streams.ProcessMetadataForStore(pb.ProcessMetadataForStoreRequest(store="", in_order=True), timeout=TIMEOUT_S)
        except grpc.RpcError as error:
            status = rpc_status.from_call(error)
        else:
            raise AssertionError("an empty store name was accepted")
        assert status is not None, "no rich error details in the trailers"
        assert status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], status
        violations = []
        for detail in status.details:
            bad_request = error_details_pb2.BadRequest()
            if detail.Unpack(bad_request):
                violations.extend(bad_request.field_violations)
        assert [v.field for v in violations] == ["store"], status
        return f"BadRequest: {violations[0].field}: {violations[0].description}"

    def huge_store_name():
        # Stock grpcio refuses response metadata over 16 KiB ("Stream removed"): the server
        # must name the field without echoing a megabyte of it back.
        from grpc_status import rpc_status

        name = "x" * (1 << 20)
        try:
            streams.ProcessMetadataForStore(pb.ProcessMetadataForStoreRequest(store=name), timeout=TIMEOUT_S)
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details()[:300])
            assert len(error.details().encode()) <= 1024, len(error.details())
            assert "\u2026" in error.details(), error.details()
            status = rpc_status.from_call(error)
            assert status is not None and len(status.SerializeToString()) <= 4096, status
            return f"{error.code()}: {len(error.details())} characters: {error.details()[:60]}..."
        raise AssertionError("a 1 MB store name was accepted")

    def raw_call(method, payload):
        # Bytes as they are on the wire: no stub can send malformed protobuf.
        call = channel.unary_unary(f"/taskstream.v1.StreamsService/{method}")
        try:
            call(payload, timeout=TIMEOUT_S)
        except grpc.RpcError as error:
            return error
        raise AssertionError(f"{method} accepted {payload[:20]!r}")

    def malformed_protobuf():
        from google.rpc import error_details_pb2
        from grpc_status import rpc_status

        # ProduceRequest{topic: "e", records: [{key: <a varint where bytes belong>}]}
        error = raw_call("Produce", b"\x0a\x01e\x12\x02\x08\x01")
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details())
        for rust_name in ("ProduceRequest", "ProducerRecord", "Protobuf"):
            assert rust_name not in error.details(), error.details()
        fields = []
        for detail in rpc_status.from_call(error).details:
            bad_request = error_details_pb2.BadRequest()
            if detail.Unpack(bad_request):
                fields.extend(v.field for v in bad_request.field_violations)
        assert fields == ["records.key"], fields
        # A store name that is not UTF-8.
        error = raw_call("ProcessMetadataForStore", b"\x0a\x02\xff\xfe")
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details())
        assert error.details() == "invalid store: is not valid UTF-8", error.details()
        return f"{error.code()}: {error.details()}"

    def message_over_the_limit():
        from google.rpc import error_details_pb2
        from grpc_status import rpc_status

        # 5 MiB of one record value: over the 4 MiB default of max_message_bytes.
        request = pb.ProduceRequest(topic="events", records=[pb.ProducerRecord(value=b"v" * (5 << 20))])
        try:
            streams.Produce(request, timeout=TIMEOUT_S)
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (error.code(), error.details())
            reasons = []
            for detail in rpc_status.from_call(error).details:
                info = error_details_pb2.ErrorInfo()
                if detail.Unpack(info):
                    reasons.append((info.reason, info.metadata["setting"]))
            assert reasons == [("LIMIT_EXCEEDED", "max_message_bytes")], reasons
            return f"{error.code()}: {error.details()}"
        raise AssertionError("a 5 MiB request was accepted")

    def follow_recipe_state():
        # The sans-I/O part of examples/python-follow/follow.py.
        sys.path.insert(0, "examples/python-follow")
        import follow

        class R:
            def __init__(self, offset):
                self.offset = offset

        state = follow.PartitionFollow(0)
        final = lambda r: True  # noqa: E731
        assert [r.offset for r in state.accept([R(o) for o in range(5)], final)] == list(range(5))
        assert state.resume_from() == 5
        state.resumed = True
        # The new owner re-processed from its last commit, 3: 3 and 4 repeat.
        assert [r.offset for r in state.accept([R(o) for o in range(3, 7)], final)] == [5, 6]
        state.accept([R(9)], final)
        # The next owner retains from 12 on: 7, 8, 10, 11 are missed.
        assert state.missed_until(12) == [(7, 8), (10, 11)], state.missed_until(12)
        assert state.resume_from() == 12
        return "repeats dropped by offset, missed ranges named"

    def follow_recipe_stream():
        # The recipe against this one server: every produced record once.
        sys.path.insert(0, "examples/python-follow")
        import follow

        want = sum(len(v) for v in produced.values())
        got, lagged, done = {}, [], threading.Event()

        def on_batch(batch, records):
            for record in records:
                key = (batch.partition, record.offset)
                got[key] = got.get(key, 0) + 1
            if len(got) >= want:
                done.set()

        def on_lagged(partition, first, last):
            lagged.append((partition, first, last))

        threads, errors = follow.follow(
            [addr], "counts", on_batch, on_lagged, done.is_set,
            partitions=list(range(8)), start={p: 0 for p in range(8)},
        )
        assert done.wait(TIMEOUT_S), f"{len(got)} of {want} records; errors {errors}"
        assert not errors and not lagged, (errors, lagged)
        assert all(n == 1 for n in got.values()), got
        expected = {(p, o) for p, entries in produced.items() for o, _ in entries}
        assert set(got) == expected, (sorted(got), sorted(expected))
        return f"{len(got)} records over {len(threads)} partition streams"

    check("produce", produce)
    check("ProcessMetadataForStore(counts, in_order)", metadata)
    check("bounded GetMetadataAsync(counts, in_order)", bounded_stream)
    check("in_order on unordered store -> FAILED_PRECONDITION", failed_precondition)
    check("unknown store -> NOT_FOUND", not_found)
    check("empty store name -> INVALID_ARGUMENT", invalid_argument)
    check("BadRequest details decoded with grpcio-status", rich_error_details)
    check("1 MB store name -> INVALID_ARGUMENT, echo cut", huge_store_name)
    check("malformed protobuf -> INVALID_ARGUMENT naming the field", malformed_protobuf)
    check("5 MiB request -> RESOURCE_EXHAUSTED, LIMIT_EXCEEDED", message_over_the_limit)
    check("follow recipe: dedupe and missed ranges", follow_recipe_state)
    check("follow recipe: one stream per partition", follow_recipe_stream)
    channel.close()

    failed = [name for name, ok in results if not ok]
    print(f"{len(results) - len(failed)}/{len(results)} checks passed")
    if failed:
        print("failed: " + "; ".join(failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
