"""The taskstream client: one `Client` over a grpcio channel with the RPCs of
StreamsService and AdminService as methods, every failure raised as a
`taskstream.errors.TaskstreamError`, and `get_metadata_async`, which calls a
callback per streamed batch on a background thread (the Rust client's
RecordCallback, in Python) until the stream ends or is stopped.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import grpc

from . import errors
from .v1 import taskstream_pb2 as pb
from .v1 import taskstream_pb2_grpc as pb_grpc

#: Seconds a unary call may take unless the client or the call says otherwise.
DEFAULT_TIMEOUT_S = 30.0

Bytes = Union[bytes, str]
RecordLike = Union[pb.ProducerRecord, Tuple[Optional[Bytes], Bytes], Bytes]


def _bytes(value: Bytes, what: str) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    raise TypeError(f"{what} must be bytes or str, not {type(value).__name__}")


def _store(store: str) -> str:
    if not isinstance(store, str) or not store:
        raise ValueError("store must be a non-empty string (the pipeline's name)")
    return store


def record(
    value: Bytes,
    key: Optional[Bytes] = None,
    *,
    partition: Optional[int] = None,
    headers: Optional[Mapping[str, Bytes]] = None,
    timestamp_ms: int = 0,
) -> pb.ProducerRecord:
    """A ProducerRecord; str values and keys are encoded as UTF-8."""
    message = pb.ProducerRecord(value=_bytes(value, "value"), timestamp_ms=timestamp_ms)
    if key is not None:
        message.key = _bytes(key, "key")
    if partition is not None:
        if partition < 0:
            raise ValueError(f"partition must be 0 or more, not {partition}")
        message.partition = partition
    for name, header in (headers or {}).items():
        message.headers[name] = _bytes(header, f"header {name!r}")
    return message


def _as_record(item: RecordLike) -> pb.ProducerRecord:
    if isinstance(item, pb.ProducerRecord):
        return item
    if isinstance(item, tuple):
        if len(item) != 2:
            raise ValueError(f"a record tuple is (key, value), not {len(item)} items")
        return record(item[1], item[0])
    return record(item)


def parse_target(target: str) -> Tuple[str, bool]:
    """`host:port`, `http://host:port` or `https://host:port` -> (host:port, tls)."""
    if not isinstance(target, str) or not target:
        raise ValueError("target must be host:port, http://host:port or https://host:port")
    tls = False
    rest = target
    if "://" in target:
        scheme, rest = target.split("://", 1)
        if scheme not in ("http", "https"):
            raise ValueError(f"target {target!r}: the scheme must be http or https, not {scheme!r}")
        tls = scheme == "https"
    rest = rest.rstrip("/")
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"target {target!r} is not host:port (e.g. 127.0.0.1:50051)")
    return rest, tls


@dataclass(frozen=True)
class Entry:
    """One key and value of a store, with the partition that holds it."""

    partition: int
    key: bytes
    value: bytes


#: A GetMetadataAsync callback: called as callback(error, batch), exactly one of them None.
MetadataCallback = Callable[[Optional[errors.TaskstreamError], Optional[pb.MetadataBatch]], None]


class MetadataSubscription:
    """A running `get_metadata_async`: `stop()` ends it, `join()` waits for it.

    The callback runs on this subscription's thread, one call at a time in
    stream order: `callback(None, batch)` per batch, `callback(Lagged, None)`
    per in-band notice that batches were dropped, and `callback(error, None)`
    once for an error that ends the stream. A stream that completes (a bounded
    `end`) or is stopped ends with no error callback.
    """

    def __init__(self, call, callback: MetadataCallback):
        self._call = call
        self._callback = callback
        self._stopped = threading.Event()
        #: The error that ended the stream (also given to the callback), or None.
        self.error: Optional[BaseException] = None
        #: Batches handed to the callback.
        self.batches = 0
        self._thread = threading.Thread(target=self._run, name="taskstream-metadata", daemon=True)
        self._thread.start()

    def _run(self):
        try:
            for response in self._call:
                if self._stopped.is_set():
                    break
                event = response.WhichOneof("event")
                if event == "batch":
                    self.batches += 1
                    self._callback(None, response.batch)
                elif event == "lagged":
                    self._callback(errors.lagged_notice(response.lagged.missed_batches), None)
        except grpc.RpcError as rpc_error:
            if self._stopped.is_set() and rpc_error.code() == grpc.StatusCode.CANCELLED:
                return
            self.error = errors.from_rpc_error(rpc_error)
            try:
                self._callback(self.error, None)
            except Exception as callback_error:  # the stream is over; keep what the callback raised
                self.error = callback_error
        except Exception as callback_error:  # a callback that raised stops the stream
            self.error = callback_error
            self._stopped.set()
            self._call.cancel()

    def stop(self, timeout: Optional[float] = 10.0) -> bool:
        """Cancels the stream and waits for the thread; True when it has ended."""
        self._stopped.set()
        self._call.cancel()
        return self.join(timeout)

    def join(self, timeout: Optional[float] = None) -> bool:
        """Waits for the stream to end (completed, failed or stopped); True when it has."""
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


class Client:
    """A connection to one taskstream server.

    `target` is `host:port`, `http://host:port`, or `https://host:port` (TLS,
    trusting `root_certificates` (PEM bytes) or the system's roots). `token`
    is sent as `authorization: Bearer TOKEN`. `timeout` is the default
    deadline of unary calls, in seconds.
    """

    def __init__(
        self,
        target: str = "127.0.0.1:50051",
        *,
        token: Optional[str] = None,
        root_certificates: Optional[bytes] = None,
        client_certificate: Optional[Tuple[bytes, bytes]] = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        options: Sequence[Tuple[str, object]] = (),
    ):
        address, tls = parse_target(target)
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout must be more than 0 seconds, not {timeout}")
        if token is not None and (not token or any(c.isspace() for c in token)):
            raise ValueError("token must be a non-empty string without spaces")
        self.target = address
        self.timeout = timeout
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        if tls or root_certificates is not None or client_certificate is not None:
            key, chain = (client_certificate[1], client_certificate[0]) if client_certificate else (None, None)
            credentials = grpc.ssl_channel_credentials(root_certificates, key, chain)
            self.channel = grpc.secure_channel(address, credentials, options=list(options))
        else:
            self.channel = grpc.insecure_channel(address, options=list(options))
        self.streams = pb_grpc.StreamsServiceStub(self.channel)
        self.admin = pb_grpc.AdminServiceStub(self.channel)

    def close(self):
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def wait_ready(self, timeout: float = 10.0):
        """Waits until the channel connects; raises Unavailable past `timeout`."""
        try:
            grpc.channel_ready_future(self.channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise errors.Unavailable(
                grpc.StatusCode.UNAVAILABLE, f"{self.target} did not answer within {timeout} s"
            ) from None

    def _call(self, method, request, timeout=None):
        try:
            return method(request, timeout=timeout or self.timeout, metadata=self._metadata)
        except grpc.RpcError as error:
            raise errors.from_rpc_error(error) from None

    # StreamsService

    def process_metadata_for_store(self, store: str, in_order: bool = False) -> pb.ProcessMetadataForStoreResponse:
        """The StreamsMetadata of every instance hosting `store` (FailedPrecondition if `in_order` is refused)."""
        request = pb.ProcessMetadataForStoreRequest(store=_store(store), in_order=in_order)
        return self._call(self.streams.ProcessMetadataForStore, request)

    def metadata_for_store(self, store: str) -> pb.ProcessMetadataForStoreResponse:
        """`process_metadata_for_store(store, in_order=True)`."""
        return self.process_metadata_for_store(store, in_order=True)

    def metadata_for_key(self, store: str, key: Bytes) -> pb.MetadataForKeyResponse:
        """The partition of `key` in `store` and the hosts serving it."""
        request = pb.MetadataForKeyRequest(store=_store(store), key=_bytes(key, "key"))
        return self._call(self.streams.MetadataForKey, request)

    def query(self, request: pb.QueryRequest) -> pb.QueryResponse:
        """A raw Query."""
        return self._call(self.streams.Query, request)

    def get(self, store: str, key: Bytes) -> Optional[bytes]:
        """The value of `key` in `store`, or None."""
        request = pb.QueryRequest(store=_store(store), key=pb.KeyQuery(key=_bytes(key, "key")))
        for result in self.query(request).results:
            for entry in result.entries:
                return entry.value
        return None

    def range(
        self,
        store: str,
        start: Optional[Bytes] = None,
        end: Optional[Bytes] = None,
        *,
        partitions: Iterable[int] = (),
        limit: int = 0,
    ) -> Iterator[Entry]:
        """Keys in [start, end] (inclusive; None is open), every page, per partition."""
        query = pb.RangeQuery()
        if start is not None:
            setattr(query, "from", _bytes(start, "start"))
        if end is not None:
            query.to = _bytes(end, "end")
        request = pb.QueryRequest(store=_store(store), range=query, partitions=list(partitions), limit=limit)
        while True:
            response = self.query(request)
            for result in response.results:
                for entry in result.entries:
                    yield Entry(result.partition, entry.key, entry.value)
            if not response.next_page_token:
                return
            request.page_token = response.next_page_token

    def produce(self, topic: str, records: Iterable[RecordLike]) -> pb.ProduceResponse:
        """Appends records (ProducerRecord, (key, value) or a value) to `topic`."""
        if not isinstance(topic, str) or not topic:
            raise ValueError("topic must be a non-empty string")
        request = pb.ProduceRequest(topic=topic, records=[_as_record(r) for r in records])
        return self._call(self.streams.Produce, request)

    def produce_stream(self, topic: str, batches: Iterable[Iterable[RecordLike]]) -> pb.ProduceResponse:
        """Bulk append: one ProduceRequest per batch on one stream."""
        if not isinstance(topic, str) or not topic:
            raise ValueError("topic must be a non-empty string")
        requests = (pb.ProduceRequest(topic=topic, records=[_as_record(r) for r in batch]) for batch in batches)
        return self._call(self.streams.ProduceStream, requests)

    def read_topic(self, topic: str, partition: int, offset: int = 0, max_records: int = 0) -> pb.ReadTopicResponse:
        """Records of one partition of any topic, from `offset`."""
        if offset < 0:
            raise ValueError(f"offset must be 0 or more, not {offset}")
        request = pb.ReadTopicRequest(topic=topic, partition=partition, offset=offset, max_records=max_records)
        return self._call(self.streams.ReadTopic, request)

    def get_metadata_async(
        self,
        store: str,
        callback: MetadataCallback,
        *,
        in_order: bool = False,
        start: int = pb.START_POSITION_LATEST,
        start_offsets: Optional[Mapping[int, int]] = None,
        end: int = pb.END_POSITION_OPEN,
        end_offsets: Optional[Mapping[int, int]] = None,
        max_batch_records: int = 0,
        partitions: Iterable[int] = (),
    ) -> MetadataSubscription:
        """Streams record outcomes of `store` into `callback(error, batch)`; returns at once.

        `start_offsets` implies START_POSITION_OFFSETS, `end_offsets`
        END_POSITION_OFFSETS. The returned subscription's `stop()` ends the
        stream cleanly (no error callback), `join()` waits for a bounded one.
        """
        if not callable(callback):
            on_complete = getattr(callback, "on_complete", None)
            if not callable(on_complete):
                raise TypeError("callback must be callable as callback(error, batch) or have on_complete(error, batch)")
            callback = on_complete
        request = pb.GetMetadataAsyncRequest(
            store=_store(store),
            in_order=in_order,
            start=start,
            end=end,
            max_batch_records=max_batch_records,
            partitions=list(partitions),
        )
        if start_offsets is not None:
            request.start = pb.START_POSITION_OFFSETS
            for partition, offset in start_offsets.items():
                request.start_offsets[partition] = offset
        if end_offsets is not None:
            request.end = pb.END_POSITION_OFFSETS
            for partition, offset in end_offsets.items():
                request.end_offsets[partition] = offset
        call = self.streams.GetMetadataAsync(request, metadata=self._metadata)
        return MetadataSubscription(call, callback)

    # AdminService

    def describe_runtime(self) -> pb.DescribeRuntimeResponse:
        return self._call(self.admin.DescribeRuntime, pb.DescribeRuntimeRequest())

    def add_stream_thread(self) -> pb.AddStreamThreadResponse:
        return self._call(self.admin.AddStreamThread, pb.AddStreamThreadRequest())

    def remove_stream_thread(self, thread_name: str = "") -> pb.RemoveStreamThreadResponse:
        """Stops `thread_name` (empty: the most recently started thread)."""
        return self._call(self.admin.RemoveStreamThread, pb.RemoveStreamThreadRequest(thread_name=thread_name))

    def redrive_dead_letters(
        self, pipeline: str, partition: int, offsets: Optional[Iterable[int]] = None, *, all: bool = False
    ) -> pb.RedriveDeadLettersResponse:
        """Puts dead letters (by dead-letter offset, or all of a partition) back on the retry path."""
        offsets = list(offsets or ())
        if all == bool(offsets):
            raise ValueError("give either dead-letter offsets or all=True")
        request = pb.RedriveDeadLettersRequest(pipeline=_store(pipeline), partition=partition, offsets=offsets, all=all)
        return self._call(self.admin.RedriveDeadLetters, request)


def final_records(batch: pb.MetadataBatch) -> List[pb.RecordMetadata]:
    """The records of a batch whose outcome is final (processed, failed or dead-lettered)."""
    pending = (pb.RECORD_OUTCOME_RETRYING, pb.RECORD_OUTCOME_UNSPECIFIED)
    return [r for r in batch.records if r.outcome not in pending]
