"""Write a taskstream processor (a `taskstream.v1.ProcessorService`) as a plain
function of one record: `process(record, call)` answers `Success` (state
operations and output records) or `Failure` (a kind, a message, retryable or
not). A function may also be `async def`: it then runs on a grpc.aio server,
the records of different keys of one call concurrently, those of one key in
order.

`call.state` holds the store's value of each key of the call (with
`include_state = true`) and is kept up to date with the operations of the
records already answered, so a key seen twice in one call sees its own
writes. An exception raised by the function fails its record as retryable,
with the exception's class name as kind; `None` is a success with nothing to
do.

`serve(process, address)` runs one (blocking); `ProcessorServer` and
`AsyncProcessorServer` give control over start and stop; `Servicer` and
`AsyncServicer` plug into a grpc server of one's own.
"""

from __future__ import annotations

import asyncio
import inspect
import sys
from concurrent import futures
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Dict, List, Optional, Sequence, Tuple, Union

import grpc

from .client import Bytes, _bytes
from .v1 import processor_pb2 as ppb
from .v1 import processor_pb2_grpc as ppb_grpc
from .v1 import taskstream_pb2 as pb


@dataclass(frozen=True)
class Record:
    """A record of the source topic."""

    offset: int
    timestamp_ms: int
    #: None for a record produced without a key.
    key: Optional[bytes]
    value: bytes
    #: (name, value) in order; names may repeat.
    headers: Tuple[Tuple[str, bytes], ...] = ()

    def header(self, name: str) -> Optional[bytes]:
        """The first header called `name`, or None."""
        for header_name, value in self.headers:
            if header_name == name:
                return value
        return None

    @staticmethod
    def from_proto(message: ppb.ProcessRecord) -> "Record":
        return Record(
            offset=message.offset,
            timestamp_ms=message.timestamp_ms,
            key=message.key if message.HasField("key") else None,
            value=message.value,
            headers=tuple((h.name, h.value) for h in message.headers),
        )


@dataclass
class Call:
    """What one Process call is about, and the state of its keys."""

    pipeline: str
    task: str
    source_topic: str
    partition: int
    #: 1 for records seen for the first time; a retry's attempt number.
    attempt: int
    #: When the call must be answered (ms since the Unix epoch); 0: no limit.
    deadline_ms: int
    #: key -> value (None: no value), for the keys the runtime sent state of,
    #: updated with each answered record's operations.
    state: Dict[bytes, Optional[bytes]] = field(default_factory=dict)

    @staticmethod
    def from_proto(request: ppb.ProcessRequest) -> "Call":
        return Call(
            pipeline=request.pipeline,
            task=request.task,
            source_topic=request.source_topic,
            partition=request.partition,
            attempt=request.attempt,
            deadline_ms=request.deadline_ms,
            state={s.key: (s.value if s.HasField("value") else None) for s in request.state},
        )


@dataclass(frozen=True)
class Put:
    """Sets `key` to `value` in the task's store."""

    key: bytes
    value: bytes


@dataclass(frozen=True)
class Delete:
    """Removes `key` from the task's store."""

    key: bytes


@dataclass(frozen=True)
class Output:
    """A record for the pipeline's sink topic."""

    value: bytes
    key: Optional[bytes] = None
    headers: Tuple[Tuple[str, bytes], ...] = ()
    partition: Optional[int] = None
    #: 0: the source record's timestamp.
    timestamp_ms: int = 0


def put(key: Bytes, value: Bytes) -> Put:
    return Put(_bytes(key, "key"), _bytes(value, "value"))


def delete(key: Bytes) -> Delete:
    return Delete(_bytes(key, "key"))


def output(
    value: Bytes,
    key: Optional[Bytes] = None,
    *,
    headers: Sequence[Tuple[str, Bytes]] = (),
    partition: Optional[int] = None,
    timestamp_ms: int = 0,
) -> Output:
    if partition is not None and partition < 0:
        raise ValueError(f"partition must be 0 or more, not {partition}")
    return Output(
        value=_bytes(value, "value"),
        key=None if key is None else _bytes(key, "key"),
        headers=tuple((name, _bytes(v, f"header {name!r}")) for name, v in headers),
        partition=partition,
        timestamp_ms=timestamp_ms,
    )


@dataclass(frozen=True)
class Success:
    """The record succeeded: apply `state_ops` (in order) and append `outputs`."""

    state_ops: Tuple[Union[Put, Delete], ...] = ()
    outputs: Tuple[Output, ...] = ()

    def __init__(self, state_ops: Sequence[Union[Put, Delete]] = (), outputs: Sequence[Output] = ()):
        for op in state_ops:
            if not isinstance(op, (Put, Delete)):
                raise TypeError(f"a state op is put(...) or delete(...), not {type(op).__name__}")
        for out in outputs:
            if not isinstance(out, Output):
                raise TypeError(f"an output is output(...), not {type(out).__name__}")
        object.__setattr__(self, "state_ops", tuple(state_ops))
        object.__setattr__(self, "outputs", tuple(outputs))


@dataclass(frozen=True)
class Failure:
    """The record failed: retried up to retry_max_attempts when `retryable`, else dead-lettered at once."""

    kind: str
    message: str = ""
    retryable: bool = True

    def __post_init__(self):
        if not isinstance(self.kind, str) or not self.kind:
            raise ValueError("a failure's kind is a short non-empty error type, e.g. 'ValidationError'")


Result = Union[Success, Failure, None]
SyncProcess = Callable[[Record, Call], Result]
AsyncProcess = Callable[[Record, Call], Awaitable[Result]]


def _to_proto(result: Result) -> ppb.RecordResult:
    if result is None:
        return ppb.RecordResult(success=ppb.RecordSuccess())
    if isinstance(result, Failure):
        return ppb.RecordResult(
            failure=ppb.RecordFailure(kind=result.kind, message=result.message, retryable=result.retryable)
        )
    if not isinstance(result, Success):
        return ppb.RecordResult(
            failure=ppb.RecordFailure(
                kind="InvalidResult",
                message=f"the processor returned {type(result).__name__}, not Success, Failure or None",
                retryable=False,
            )
        )
    success = ppb.RecordSuccess()
    for op in result.state_ops:
        if isinstance(op, Put):
            success.state_ops.append(ppb.StateOp(key=op.key, put=op.value))
        else:
            success.state_ops.append(ppb.StateOp(key=op.key, delete=True))
    for out in result.outputs:
        message = ppb.OutputRecord(
            value=out.value,
            headers=[pb.Header(name=n, value=v) for n, v in out.headers],
            timestamp_ms=out.timestamp_ms,
        )
        if out.key is not None:
            message.key = out.key
        if out.partition is not None:
            message.partition = out.partition
        success.outputs.append(message)
    return ppb.RecordResult(success=success)


def _failure_of(error: BaseException) -> Failure:
    return Failure(kind=type(error).__name__, message=str(error), retryable=True)


def _apply(call: Call, result: Result):
    if isinstance(result, Success):
        for op in result.state_ops:
            call.state[op.key] = op.value if isinstance(op, Put) else None


def process_request(process: SyncProcess, request: ppb.ProcessRequest) -> ppb.ProcessResponse:
    """Answers one ProcessRequest with a synchronous `process`, record by record."""
    call = Call.from_proto(request)
    results = []
    for message in request.records:
        try:
            result = process(Record.from_proto(message), call)
        except Exception as error:
            result = _failure_of(error)
        _apply(call, result)
        results.append(_to_proto(result))
    return ppb.ProcessResponse(results=results)


async def process_request_async(process: AsyncProcess, request: ppb.ProcessRequest) -> ppb.ProcessResponse:
    """Answers one ProcessRequest with an async `process`: keys concurrently, each key in order."""
    call = Call.from_proto(request)
    records = [Record.from_proto(m) for m in request.records]
    results: List[Optional[ppb.RecordResult]] = [None] * len(records)
    by_key: Dict[Optional[bytes], List[int]] = {}
    for index, rec in enumerate(records):
        by_key.setdefault(rec.key, []).append(index)

    async def one_key(indexes: List[int]):
        for index in indexes:
            try:
                result = await process(records[index], call)
            except Exception as error:
                result = _failure_of(error)
            _apply(call, result)
            results[index] = _to_proto(result)

    await asyncio.gather(*(one_key(indexes) for indexes in by_key.values()))
    return ppb.ProcessResponse(results=results)


class Servicer(ppb_grpc.ProcessorServiceServicer):
    """A ProcessorService over a synchronous `process(record, call)`."""

    def __init__(self, process: SyncProcess):
        if not callable(process) or inspect.iscoroutinefunction(process):
            raise TypeError("Servicer needs a plain function process(record, call); use AsyncServicer for async def")
        self._process = process

    def Process(self, request, context):
        return process_request(self._process, request)


class AsyncServicer(ppb_grpc.ProcessorServiceServicer):
    """A ProcessorService over an `async def process(record, call)`, for grpc.aio servers."""

    def __init__(self, process: AsyncProcess):
        if not inspect.iscoroutinefunction(process):
            raise TypeError("AsyncServicer needs an async def process(record, call)")
        self._process = process

    async def Process(self, request, context):
        return await process_request_async(self._process, request)


class ProcessorServer:
    """A grpc server running a synchronous processor; `start()` answers the bound port."""

    def __init__(self, process: SyncProcess, address: str = "127.0.0.1:0", *, max_workers: int = 16):
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers))
        ppb_grpc.add_ProcessorServiceServicer_to_server(Servicer(process), self._server)
        self.port = self._server.add_insecure_port(address)
        if self.port == 0:
            raise ValueError(f"cannot listen on {address!r}")

    def start(self) -> int:
        self._server.start()
        return self.port

    def stop(self, grace: Optional[float] = 5.0):
        """Stops taking calls and lets calls in hand finish for `grace` seconds."""
        self._server.stop(grace).wait()

    def wait(self, timeout: Optional[float] = None) -> bool:
        return self._server.wait_for_termination(timeout)


class AsyncProcessorServer:
    """A grpc.aio server running an async processor; `await start()` answers the bound port."""

    def __init__(self, process: AsyncProcess, address: str = "127.0.0.1:0"):
        self._server = grpc.aio.server()
        ppb_grpc.add_ProcessorServiceServicer_to_server(AsyncServicer(process), self._server)
        self.port = self._server.add_insecure_port(address)
        if self.port == 0:
            raise ValueError(f"cannot listen on {address!r}")

    async def start(self) -> int:
        await self._server.start()
        return self.port

    async def stop(self, grace: Optional[float] = 5.0):
        await self._server.stop(grace)

    async def wait(self):
        await self._server.wait_for_termination()


def serve(process: Union[SyncProcess, AsyncProcess], address: str = "127.0.0.1:7000"):
    """Runs `process` on `address` until interrupted; prints `processor listening on port N` first."""
    if inspect.iscoroutinefunction(process):

        async def main():
            server = AsyncProcessorServer(process, address)
            port = await server.start()
            print(f"processor listening on port {port}", flush=True)
            await server.wait()

        asyncio.run(main())
    else:
        server = ProcessorServer(process, address)
        port = server.start()
        print(f"processor listening on port {port}", flush=True)
        try:
            server.wait()
        except KeyboardInterrupt:
            server.stop()
            sys.exit(130)
