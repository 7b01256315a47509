from taskstream.v1 import taskstream_pb2 as _taskstream_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProcessRequest(_message.Message):
    __slots__ = ("pipeline", "task", "source_topic", "partition", "attempt", "deadline_ms", "records", "state")
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    SOURCE_TOPIC_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    pipeline: str
    task: str
    source_topic: str
    partition: int
    attempt: int
    deadline_ms: int
    records: _containers.RepeatedCompositeFieldContainer[ProcessRecord]
    state: _containers.RepeatedCompositeFieldContainer[KeyState]
    def __init__(self, pipeline: _Optional[str] = ..., task: _Optional[str] = ..., source_topic: _Optional[str] = ..., partition: _Optional[int] = ..., attempt: _Optional[int] = ..., deadline_ms: _Optional[int] = ..., records: _Optional[_Iterable[_Union[ProcessRecord, _Mapping]]] = ..., state: _Optional[_Iterable[_Union[KeyState, _Mapping]]] = ...) -> None: ...

class ProcessRecord(_message.Message):
    __slots__ = ("offset", "timestamp_ms", "key", "value", "headers")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    offset: int
    timestamp_ms: int
    key: bytes
    value: bytes
    headers: _containers.RepeatedCompositeFieldContainer[_taskstream_pb2.Header]
    def __init__(self, offset: _Optional[int] = ..., timestamp_ms: _Optional[int] = ..., key: _Optional[bytes] = ..., value: _Optional[bytes] = ..., headers: _Optional[_Iterable[_Union[_taskstream_pb2.Header, _Mapping]]] = ...) -> None: ...

class KeyState(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    value: bytes
    def __init__(self, key: _Optional[bytes] = ..., value: _Optional[bytes] = ...) -> None: ...

class ProcessResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[RecordResult]
    def __init__(self, results: _Optional[_Iterable[_Union[RecordResult, _Mapping]]] = ...) -> None: ...

class RecordResult(_message.Message):
    __slots__ = ("success", "failure")
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    success: RecordSuccess
    failure: RecordFailure
    def __init__(self, success: _Optional[_Union[RecordSuccess, _Mapping]] = ..., failure: _Optional[_Union[RecordFailure, _Mapping]] = ...) -> None: ...

class RecordSuccess(_message.Message):
    __slots__ = ("state_ops", "outputs")
    STATE_OPS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    state_ops: _containers.RepeatedCompositeFieldContainer[StateOp]
    outputs: _containers.RepeatedCompositeFieldContainer[OutputRecord]
    def __init__(self, state_ops: _Optional[_Iterable[_Union[StateOp, _Mapping]]] = ..., outputs: _Optional[_Iterable[_Union[OutputRecord, _Mapping]]] = ...) -> None: ...

class StateOp(_message.Message):
    __slots__ = ("key", "put", "delete")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PUT_FIELD_NUMBER: _ClassVar[int]
    DELETE_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    put: bytes
    delete: bool
    def __init__(self, key: _Optional[bytes] = ..., put: _Optional[bytes] = ..., delete: _Optional[bool] = ...) -> None: ...

class OutputRecord(_message.Message):
    __slots__ = ("key", "value", "headers", "partition", "timestamp_ms")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    value: bytes
    headers: _containers.RepeatedCompositeFieldContainer[_taskstream_pb2.Header]
    partition: int
    timestamp_ms: int
    def __init__(self, key: _Optional[bytes] = ..., value: _Optional[bytes] = ..., headers: _Optional[_Iterable[_Union[_taskstream_pb2.Header, _Mapping]]] = ..., partition: _Optional[int] = ..., timestamp_ms: _Optional[int] = ...) -> None: ...

class RecordFailure(_message.Message):
    __slots__ = ("kind", "message", "retryable")
    KIND_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RETRYABLE_FIELD_NUMBER: _ClassVar[int]
    kind: str
    message: str
    retryable: bool
    def __init__(self, kind: _Optional[str] = ..., message: _Optional[str] = ..., retryable: _Optional[bool] = ...) -> None: ...
