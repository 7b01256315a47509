"""The processor helper: result types to protobuf, state carried within a call,
exceptions as retryable failures, asyncio keys in parallel and each key in
order; then sync and asyncio processors driving a real server's pipeline
(store counts, sink records, a non-retryable failure dead-lettered)."""

import asyncio
import threading

import pytest
from conftest import eventually

import taskstream
from taskstream import processor as tp
from taskstream.v1 import processor_pb2 as ppb


def request(*records, state=()):
    message = ppb.ProcessRequest(pipeline="p", task="p_0", source_topic="t", partition=0, attempt=1)
    for offset, (key, value) in enumerate(records):
        rec = message.records.add(offset=offset, value=value)
        if key is not None:
            rec.key = key
    for key, value in state:
        entry = message.state.add(key=key)
        if value is not None:
            entry.value = value
    return message


def counting(record, call):
    if record.key is None:
        return None
    if record.value == b"bad":
        return tp.Failure("Invalid", "bad value", retryable=False)
    if record.value == b"raise":
        raise KeyError("oops")
    count = int(call.state.get(record.key) or 0) + 1
    return tp.Success([tp.put(record.key, str(count))], [tp.output(f"{count}", key=record.key, headers=[("h", "x")])])


def test_sync_results_and_state_within_a_call():
    response = tp.process_request(counting, request(
        (b"a", b"1"), (b"a", b"2"), (None, b"x"), (b"b", b"bad"), (b"b", b"raise"), (b"c", b"1"),
        state=[(b"a", b"5"), (b"b", None), (b"c", None)]))
    results = list(response.results)
    assert len(results) == 6
    assert results[0].success.state_ops[0].put == b"6"
    assert results[1].success.state_ops[0].put == b"7", "the call carries its own writes"
    assert results[1].success.outputs[0].headers[0].name == "h"
    assert results[2].WhichOneof("result") == "success" and not results[2].success.state_ops
    assert (results[3].failure.kind, results[3].failure.retryable) == ("Invalid", False)
    assert (results[4].failure.kind, results[4].failure.retryable) == ("KeyError", True)
    assert results[5].success.state_ops[0].put == b"1"
    assert tp.process_request(counting, request()).results == [], "a probe is answered with no results"


def test_bad_results_and_bad_arguments():
    response = tp.process_request(lambda r, c: "yes", request((b"a", b"1")))
    assert response.results[0].failure.kind == "InvalidResult"
    assert not response.results[0].failure.retryable
    deleted = tp.process_request(lambda r, c: tp.Success([tp.delete(r.key)]), request((b"a", b"1")))
    assert deleted.results[0].success.state_ops[0].delete
    with pytest.raises(ValueError, match="kind"):
        tp.Failure("")
    with pytest.raises(TypeError, match="state op"):
        tp.Success(["put"])
    with pytest.raises(TypeError, match="an output"):
        tp.Success([], [b"x"])
    with pytest.raises(TypeError, match="AsyncServicer"):
        tp.Servicer(async_counting)
    with pytest.raises(TypeError, match="async def"):
        tp.AsyncServicer(counting)


async def async_counting(record, call):
    await asyncio.sleep(0)
    return counting(record, call)


def test_async_keys_in_parallel_each_key_in_order():
    order = []
    b_started = asyncio.Event

    async def main():
        started = b_started()

        async def process(record, call):
            if record.key == b"a" and record.value == b"1":
                # Waits for key b: only possible if keys run concurrently.
                await asyncio.wait_for(started.wait(), 5)
            if record.key == b"b":
                started.set()
            order.append((record.key, record.value))
            return await async_counting(record, call)

        return await tp.process_request_async(process, request(
            (b"a", b"1"), (b"b", b"1"), (b"a", b"2"), (b"b", b"bad")))

    response = asyncio.run(main())
    assert [r.WhichOneof("result") for r in response.results] == ["success", "success", "success", "failure"]
    assert response.results[2].success.state_ops[0].put == b"2"
    assert [v for k, v in order if k == b"a"] == [b"1", b"2"]


PIPELINE = """
application_id = "pytest-processor"
num_stream_threads = 2
num_threads_per_task = 2
commit_interval_ms = 50
retry_backoff_ms = 10
retry_max_attempts = 2

[[topics]]
name = "words"
partitions = 2

[[pipelines]]
name = "wordcount"
source_topic = "words"
processor = {{ type = "grpc", endpoint = "http://127.0.0.1:{port}", include_state = true }}
sink_topic = "counted"
"""


def drive_pipeline(start_server, port):
    server = start_server(PIPELINE.format(port=port))
    with taskstream.Client(server.address) as client:
        client.wait_ready()
        words = ["apple", "pear", "fig"]
        client.produce("words", [(words[i % 3], "x") for i in range(30)] + [("fig", "bad")])
        eventually("counts of 10", lambda: all(client.get("wordcount", w) == b"10" for w in words))

        def sink():
            return [r for p in range(2) for r in client.read_topic("counted", p).records]

        records = eventually("30 sink records", lambda: len(sink()) == 30 and sink())
        per_key = {}
        for rec in records:
            per_key.setdefault(rec.key, []).append(int(rec.value))
        assert per_key == {w.encode(): list(range(1, 11)) for w in words}

        def dead():
            return [r for p in range(2) for r in client.read_topic("pytest-processor-wordcount-dlq", p).records]

        letters = eventually("one dead letter", lambda: dead())
        assert [r.value for r in letters] == [b"bad"]
        headers = {h.name: h.value for h in letters[0].headers}
        assert b"Invalid" in headers.get("__streams.errors.exception", b""), headers


def test_sync_processor_drives_a_pipeline(start_server):
    server = tp.ProcessorServer(counting)
    port = server.start()
    try:
        drive_pipeline(start_server, port)
    finally:
        server.stop(1)


def test_async_processor_drives_a_pipeline(start_server):
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    box = {}

    async def run():
        box["stop"] = asyncio.Event()
        server = tp.AsyncProcessorServer(async_counting)
        box["port"] = await server.start()
        ready.set()
        await box["stop"].wait()
        await server.stop(1)

    thread = threading.Thread(target=lambda: loop.run_until_complete(run()), daemon=True)
    thread.start()
    assert ready.wait(10)
    try:
        drive_pipeline(start_server, box["port"])
    finally:
        loop.call_soon_threadsafe(box["stop"].set)
        thread.join(10)
    assert not thread.is_alive(), "the asyncio processor did not stop"
