from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProcessingOrder(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROCESSING_ORDER_UNSPECIFIED: _ClassVar[ProcessingOrder]
    PROCESSING_ORDER_OFFSET: _ClassVar[ProcessingOrder]
    PROCESSING_ORDER_KEY: _ClassVar[ProcessingOrder]
    PROCESSING_ORDER_UNORDERED: _ClassVar[ProcessingOrder]

class TaskState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TASK_STATE_UNSPECIFIED: _ClassVar[TaskState]
    TASK_STATE_RESTORING: _ClassVar[TaskState]
    TASK_STATE_RUNNING: _ClassVar[TaskState]
    TASK_STATE_SUSPENDED: _ClassVar[TaskState]

class StartPosition(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    START_POSITION_UNSPECIFIED: _ClassVar[StartPosition]
    START_POSITION_LATEST: _ClassVar[StartPosition]
    START_POSITION_EARLIEST: _ClassVar[StartPosition]
    START_POSITION_OFFSETS: _ClassVar[StartPosition]

class EndPosition(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    END_POSITION_UNSPECIFIED: _ClassVar[EndPosition]
    END_POSITION_OPEN: _ClassVar[EndPosition]
    END_POSITION_CURRENT: _ClassVar[EndPosition]
    END_POSITION_OFFSETS: _ClassVar[EndPosition]

class RecordOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RECORD_OUTCOME_UNSPECIFIED: _ClassVar[RecordOutcome]
    RECORD_OUTCOME_PROCESSED: _ClassVar[RecordOutcome]
    RECORD_OUTCOME_FAILED: _ClassVar[RecordOutcome]
    RECORD_OUTCOME_RETRYING: _ClassVar[RecordOutcome]
    RECORD_OUTCOME_DEAD_LETTERED: _ClassVar[RecordOutcome]

class ThreadState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    THREAD_STATE_UNSPECIFIED: _ClassVar[ThreadState]
    THREAD_STATE_OWNER: _ClassVar[ThreadState]
    THREAD_STATE_HELPER: _ClassVar[ThreadState]
    THREAD_STATE_RESERVE: _ClassVar[ThreadState]
    THREAD_STATE_STOPPING: _ClassVar[ThreadState]
    THREAD_STATE_RETRY: _ClassVar[ThreadState]

class ServiceState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SERVICE_STATE_UNSPECIFIED: _ClassVar[ServiceState]
    SERVICE_STATE_STARTING: _ClassVar[ServiceState]
    SERVICE_STATE_RUNNING: _ClassVar[ServiceState]
    SERVICE_STATE_SHUTTING_DOWN: _ClassVar[ServiceState]
    SERVICE_STATE_REBALANCING: _ClassVar[ServiceState]
    SERVICE_STATE_RESTORING: _ClassVar[ServiceState]
PROCESSING_ORDER_UNSPECIFIED: ProcessingOrder
PROCESSING_ORDER_OFFSET: ProcessingOrder
PROCESSING_ORDER_KEY: ProcessingOrder
PROCESSING_ORDER_UNORDERED: ProcessingOrder
TASK_STATE_UNSPECIFIED: TaskState
TASK_STATE_RESTORING: TaskState
TASK_STATE_RUNNING: TaskState
TASK_STATE_SUSPENDED: TaskState
START_POSITION_UNSPECIFIED: StartPosition
START_POSITION_LATEST: StartPosition
START_POSITION_EARLIEST: StartPosition
START_POSITION_OFFSETS: StartPosition
END_POSITION_UNSPECIFIED: EndPosition
END_POSITION_OPEN: EndPosition
END_POSITION_CURRENT: EndPosition
END_POSITION_OFFSETS: EndPosition
RECORD_OUTCOME_UNSPECIFIED: RecordOutcome
RECORD_OUTCOME_PROCESSED: RecordOutcome
RECORD_OUTCOME_FAILED: RecordOutcome
RECORD_OUTCOME_RETRYING: RecordOutcome
RECORD_OUTCOME_DEAD_LETTERED: RecordOutcome
THREAD_STATE_UNSPECIFIED: ThreadState
THREAD_STATE_OWNER: ThreadState
THREAD_STATE_HELPER: ThreadState
THREAD_STATE_RESERVE: ThreadState
THREAD_STATE_STOPPING: ThreadState
THREAD_STATE_RETRY: ThreadState
SERVICE_STATE_UNSPECIFIED: ServiceState
SERVICE_STATE_STARTING: ServiceState
SERVICE_STATE_RUNNING: ServiceState
SERVICE_STATE_SHUTTING_DOWN: ServiceState
SERVICE_STATE_REBALANCING: ServiceState
SERVICE_STATE_RESTORING: ServiceState

class HostInfo(_message.Message):
    __slots__ = ("host", "port")
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    host: str
    port: int
    def __init__(self, host: _Optional[str] = ..., port: _Optional[int] = ...) -> None: ...

class TopicPartition(_message.Message):
    __slots__ = ("topic", "partition")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    topic: str
    partition: int
    def __init__(self, topic: _Optional[str] = ..., partition: _Optional[int] = ...) -> None: ...

class TaskMetadata(_message.Message):
    __slots__ = ("task_id", "pipeline", "topic", "partition", "state", "owner_thread", "helper_threads", "processing_order", "threads_per_task", "watermark", "committed_offset", "end_offset", "lag", "in_flight", "retry_backlog", "records_processed", "records_failed", "records_dead_lettered", "active_threads", "held_records", "last_commit_ms")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    OWNER_THREAD_FIELD_NUMBER: _ClassVar[int]
    HELPER_THREADS_FIELD_NUMBER: _ClassVar[int]
    PROCESSING_ORDER_FIELD_NUMBER: _ClassVar[int]
    THREADS_PER_TASK_FIELD_NUMBER: _ClassVar[int]
    WATERMARK_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_OFFSET_FIELD_NUMBER: _ClassVar[int]
    END_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LAG_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    RETRY_BACKLOG_FIELD_NUMBER: _ClassVar[int]
    RECORDS_PROCESSED_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FAILED_FIELD_NUMBER: _ClassVar[int]
    RECORDS_DEAD_LETTERED_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_THREADS_FIELD_NUMBER: _ClassVar[int]
    HELD_RECORDS_FIELD_NUMBER: _ClassVar[int]
    LAST_COMMIT_MS_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    pipeline: str
    topic: str
    partition: int
    state: TaskState
    owner_thread: str
    helper_threads: _containers.RepeatedScalarFieldContainer[str]
    processing_order: ProcessingOrder
    threads_per_task: int
    watermark: int
    committed_offset: int
    end_offset: int
    lag: int
    in_flight: int
    retry_backlog: int
    records_processed: int
    records_failed: int
    records_dead_lettered: int
    active_threads: int
    held_records: int
    last_commit_ms: int
    def __init__(self, task_id: _Optional[str] = ..., pipeline: _Optional[str] = ..., topic: _Optional[str] = ..., partition: _Optional[int] = ..., state: _Optional[_Union[TaskState, str]] = ..., owner_thread: _Optional[str] = ..., helper_threads: _Optional[_Iterable[str]] = ..., processing_order: _Optional[_Union[ProcessingOrder, str]] = ..., threads_per_task: _Optional[int] = ..., watermark: _Optional[int] = ..., committed_offset: _Optional[int] = ..., end_offset: _Optional[int] = ..., lag: _Optional[int] = ..., in_flight: _Optional[int] = ..., retry_backlog: _Optional[int] = ..., records_processed: _Optional[int] = ..., records_failed: _Optional[int] = ..., records_dead_lettered: _Optional[int] = ..., active_threads: _Optional[int] = ..., held_records: _Optional[int] = ..., last_commit_ms: _Optional[int] = ...) -> None: ...

class StreamsMetadata(_message.Message):
    __slots__ = ("host_info", "state_store_names", "topic_partitions", "standby_topic_partitions", "tasks")
    HOST_INFO_FIELD_NUMBER: _ClassVar[int]
    STATE_STORE_NAMES_FIELD_NUMBER: _ClassVar[int]
    TOPIC_PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    STANDBY_TOPIC_PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    host_info: HostInfo
    state_store_names: _containers.RepeatedScalarFieldContainer[str]
    topic_partitions: _containers.RepeatedCompositeFieldContainer[TopicPartition]
    standby_topic_partitions: _containers.RepeatedCompositeFieldContainer[TopicPartition]
    tasks: _containers.RepeatedCompositeFieldContainer[TaskMetadata]
    def __init__(self, host_info: _Optional[_Union[HostInfo, _Mapping]] = ..., state_store_names: _Optional[_Iterable[str]] = ..., topic_partitions: _Optional[_Iterable[_Union[TopicPartition, _Mapping]]] = ..., standby_topic_partitions: _Optional[_Iterable[_Union[TopicPartition, _Mapping]]] = ..., tasks: _Optional[_Iterable[_Union[TaskMetadata, _Mapping]]] = ...) -> None: ...

class ProcessMetadataForStoreRequest(_message.Message):
    __slots__ = ("store", "in_order")
    STORE_FIELD_NUMBER: _ClassVar[int]
    IN_ORDER_FIELD_NUMBER: _ClassVar[int]
    store: str
    in_order: bool
    def __init__(self, store: _Optional[str] = ..., in_order: _Optional[bool] = ...) -> None: ...

class ProcessMetadataForStoreResponse(_message.Message):
    __slots__ = ("metadata", "processing_order", "threads_per_task", "in_order")
    METADATA_FIELD_NUMBER: _ClassVar[int]
    PROCESSING_ORDER_FIELD_NUMBER: _ClassVar[int]
    THREADS_PER_TASK_FIELD_NUMBER: _ClassVar[int]
    IN_ORDER_FIELD_NUMBER: _ClassVar[int]
    metadata: _containers.RepeatedCompositeFieldContainer[StreamsMetadata]
    processing_order: ProcessingOrder
    threads_per_task: int
    in_order: bool
    def __init__(self, metadata: _Optional[_Iterable[_Union[StreamsMetadata, _Mapping]]] = ..., processing_order: _Optional[_Union[ProcessingOrder, str]] = ..., threads_per_task: _Optional[int] = ..., in_order: _Optional[bool] = ...) -> None: ...

class GetMetadataAsyncRequest(_message.Message):
    __slots__ = ("store", "in_order", "start", "start_offsets", "end", "end_offsets", "max_batch_records", "partitions")
    class StartOffsetsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    class EndOffsetsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    STORE_FIELD_NUMBER: _ClassVar[int]
    IN_ORDER_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    START_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    END_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_RECORDS_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    store: str
    in_order: bool
    start: StartPosition
    start_offsets: _containers.ScalarMap[int, int]
    end: EndPosition
    end_offsets: _containers.ScalarMap[int, int]
    max_batch_records: int
    partitions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, store: _Optional[str] = ..., in_order: _Optional[bool] = ..., start: _Optional[_Union[StartPosition, str]] = ..., start_offsets: _Optional[_Mapping[int, int]] = ..., end: _Optional[_Union[EndPosition, str]] = ..., end_offsets: _Optional[_Mapping[int, int]] = ..., max_batch_records: _Optional[int] = ..., partitions: _Optional[_Iterable[int]] = ...) -> None: ...

class RecordMetadata(_message.Message):
    __slots__ = ("offset", "key", "timestamp_ms", "outcome", "attempts", "error", "thread", "key_truncated")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    THREAD_FIELD_NUMBER: _ClassVar[int]
    KEY_TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    offset: int
    key: bytes
    timestamp_ms: int
    outcome: RecordOutcome
    attempts: int
    error: str
    thread: str
    key_truncated: bool
    def __init__(self, offset: _Optional[int] = ..., key: _Optional[bytes] = ..., timestamp_ms: _Optional[int] = ..., outcome: _Optional[_Union[RecordOutcome, str]] = ..., attempts: _Optional[int] = ..., error: _Optional[str] = ..., thread: _Optional[str] = ..., key_truncated: _Optional[bool] = ...) -> None: ...

class MetadataBatch(_message.Message):
    __slots__ = ("task_id", "store", "topic", "partition", "thread", "first_offset", "last_offset", "records", "reprocessed")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    THREAD_FIELD_NUMBER: _ClassVar[int]
    FIRST_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LAST_OFFSET_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    REPROCESSED_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    store: str
    topic: str
    partition: int
    thread: str
    first_offset: int
    last_offset: int
    records: _containers.RepeatedCompositeFieldContainer[RecordMetadata]
    reprocessed: bool
    def __init__(self, task_id: _Optional[str] = ..., store: _Optional[str] = ..., topic: _Optional[str] = ..., partition: _Optional[int] = ..., thread: _Optional[str] = ..., first_offset: _Optional[int] = ..., last_offset: _Optional[int] = ..., records: _Optional[_Iterable[_Union[RecordMetadata, _Mapping]]] = ..., reprocessed: _Optional[bool] = ...) -> None: ...

class Lagged(_message.Message):
    __slots__ = ("missed_batches",)
    MISSED_BATCHES_FIELD_NUMBER: _ClassVar[int]
    missed_batches: int
    def __init__(self, missed_batches: _Optional[int] = ...) -> None: ...

class GetMetadataAsyncResponse(_message.Message):
    __slots__ = ("batch", "lagged")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    LAGGED_FIELD_NUMBER: _ClassVar[int]
    batch: MetadataBatch
    lagged: Lagged
    def __init__(self, batch: _Optional[_Union[MetadataBatch, _Mapping]] = ..., lagged: _Optional[_Union[Lagged, _Mapping]] = ...) -> None: ...

class MetadataForKeyRequest(_message.Message):
    __slots__ = ("store", "key")
    STORE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    store: str
    key: bytes
    def __init__(self, store: _Optional[str] = ..., key: _Optional[bytes] = ...) -> None: ...

class MetadataForKeyResponse(_message.Message):
    __slots__ = ("store", "topic", "partition", "task_id", "active_host", "standby_hosts")
    STORE_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_HOST_FIELD_NUMBER: _ClassVar[int]
    STANDBY_HOSTS_FIELD_NUMBER: _ClassVar[int]
    store: str
    topic: str
    partition: int
    task_id: str
    active_host: HostInfo
    standby_hosts: _containers.RepeatedCompositeFieldContainer[HostInfo]
    def __init__(self, store: _Optional[str] = ..., topic: _Optional[str] = ..., partition: _Optional[int] = ..., task_id: _Optional[str] = ..., active_host: _Optional[_Union[HostInfo, _Mapping]] = ..., standby_hosts: _Optional[_Iterable[_Union[HostInfo, _Mapping]]] = ...) -> None: ...

class KeyQuery(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    def __init__(self, key: _Optional[bytes] = ...) -> None: ...

class RangeQuery(_message.Message):
    __slots__ = ("to",)
    FROM_FIELD_NUMBER: _ClassVar[int]
    TO_FIELD_NUMBER: _ClassVar[int]
    to: bytes
    def __init__(self, to: _Optional[bytes] = ..., **kwargs) -> None: ...

class QueryRequest(_message.Message):
    __slots__ = ("store", "key", "range", "partitions", "limit", "page_token", "local_only")
    STORE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    RANGE_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOCAL_ONLY_FIELD_NUMBER: _ClassVar[int]
    store: str
    key: KeyQuery
    range: RangeQuery
    partitions: _containers.RepeatedScalarFieldContainer[int]
    limit: int
    page_token: bytes
    local_only: bool
    def __init__(self, store: _Optional[str] = ..., key: _Optional[_Union[KeyQuery, _Mapping]] = ..., range: _Optional[_Union[RangeQuery, _Mapping]] = ..., partitions: _Optional[_Iterable[int]] = ..., limit: _Optional[int] = ..., page_token: _Optional[bytes] = ..., local_only: _Optional[bool] = ...) -> None: ...

class KeyValue(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    value: bytes
    def __init__(self, key: _Optional[bytes] = ..., value: _Optional[bytes] = ...) -> None: ...

class PartitionResult(_message.Message):
    __slots__ = ("partition", "position", "entries", "committed_at_ms", "host")
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    partition: int
    position: int
    entries: _containers.RepeatedCompositeFieldContainer[KeyValue]
    committed_at_ms: int
    host: HostInfo
    def __init__(self, partition: _Optional[int] = ..., position: _Optional[int] = ..., entries: _Optional[_Iterable[_Union[KeyValue, _Mapping]]] = ..., committed_at_ms: _Optional[int] = ..., host: _Optional[_Union[HostInfo, _Mapping]] = ...) -> None: ...

class QueryResponse(_message.Message):
    __slots__ = ("store", "results", "next_page_token")
    STORE_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    store: str
    results: _containers.RepeatedCompositeFieldContainer[PartitionResult]
    next_page_token: bytes
    def __init__(self, store: _Optional[str] = ..., results: _Optional[_Iterable[_Union[PartitionResult, _Mapping]]] = ..., next_page_token: _Optional[bytes] = ...) -> None: ...

class ProducerRecord(_message.Message):
    __slots__ = ("key", "value", "partition", "timestamp_ms", "headers")
    class HeadersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    value: bytes
    partition: int
    timestamp_ms: int
    headers: _containers.ScalarMap[str, bytes]
    def __init__(self, key: _Optional[bytes] = ..., value: _Optional[bytes] = ..., partition: _Optional[int] = ..., timestamp_ms: _Optional[int] = ..., headers: _Optional[_Mapping[str, bytes]] = ...) -> None: ...

class ProduceRequest(_message.Message):
    __slots__ = ("topic", "records")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    topic: str
    records: _containers.RepeatedCompositeFieldContainer[ProducerRecord]
    def __init__(self, topic: _Optional[str] = ..., records: _Optional[_Iterable[_Union[ProducerRecord, _Mapping]]] = ...) -> None: ...

class RecordPosition(_message.Message):
    __slots__ = ("partition", "offset")
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    partition: int
    offset: int
    def __init__(self, partition: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class PartitionRange(_message.Message):
    __slots__ = ("partition", "first_offset", "last_offset", "count")
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    FIRST_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LAST_OFFSET_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    partition: int
    first_offset: int
    last_offset: int
    count: int
    def __init__(self, partition: _Optional[int] = ..., first_offset: _Optional[int] = ..., last_offset: _Optional[int] = ..., count: _Optional[int] = ...) -> None: ...

class ProduceResponse(_message.Message):
    __slots__ = ("topic", "record_count", "positions", "partitions")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    RECORD_COUNT_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    topic: str
    record_count: int
    positions: _containers.RepeatedCompositeFieldContainer[RecordPosition]
    partitions: _containers.RepeatedCompositeFieldContainer[PartitionRange]
    def __init__(self, topic: _Optional[str] = ..., record_count: _Optional[int] = ..., positions: _Optional[_Iterable[_Union[RecordPosition, _Mapping]]] = ..., partitions: _Optional[_Iterable[_Union[PartitionRange, _Mapping]]] = ...) -> None: ...

class ReadTopicRequest(_message.Message):
    __slots__ = ("topic", "partition", "offset", "max_records")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    MAX_RECORDS_FIELD_NUMBER: _ClassVar[int]
    topic: str
    partition: int
    offset: int
    max_records: int
    def __init__(self, topic: _Optional[str] = ..., partition: _Optional[int] = ..., offset: _Optional[int] = ..., max_records: _Optional[int] = ...) -> None: ...

class Header(_message.Message):
    __slots__ = ("name", "value")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    name: str
    value: bytes
    def __init__(self, name: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...

class TopicRecord(_message.Message):
    __slots__ = ("partition", "offset", "timestamp_ms", "key", "value", "headers")
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    partition: int
    offset: int
    timestamp_ms: int
    key: bytes
    value: bytes
    headers: _containers.RepeatedCompositeFieldContainer[Header]
    def __init__(self, partition: _Optional[int] = ..., offset: _Optional[int] = ..., timestamp_ms: _Optional[int] = ..., key: _Optional[bytes] = ..., value: _Optional[bytes] = ..., headers: _Optional[_Iterable[_Union[Header, _Mapping]]] = ...) -> None: ...

class ReadTopicResponse(_message.Message):
    __slots__ = ("topic", "partition", "records", "start_offset", "end_offset", "partitions")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    START_OFFSET_FIELD_NUMBER: _ClassVar[int]
    END_OFFSET_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    topic: str
    partition: int
    records: _containers.RepeatedCompositeFieldContainer[TopicRecord]
    start_offset: int
    end_offset: int
    partitions: int
    def __init__(self, topic: _Optional[str] = ..., partition: _Optional[int] = ..., records: _Optional[_Iterable[_Union[TopicRecord, _Mapping]]] = ..., start_offset: _Optional[int] = ..., end_offset: _Optional[int] = ..., partitions: _Optional[int] = ...) -> None: ...

class DescribeRuntimeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ThreadMetadata(_message.Message):
    __slots__ = ("name", "state", "owned_tasks", "current_task", "records_processed")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    OWNED_TASKS_FIELD_NUMBER: _ClassVar[int]
    CURRENT_TASK_FIELD_NUMBER: _ClassVar[int]
    RECORDS_PROCESSED_FIELD_NUMBER: _ClassVar[int]
    name: str
    state: ThreadState
    owned_tasks: _containers.RepeatedScalarFieldContainer[str]
    current_task: str
    records_processed: int
    def __init__(self, name: _Optional[str] = ..., state: _Optional[_Union[ThreadState, str]] = ..., owned_tasks: _Optional[_Iterable[str]] = ..., current_task: _Optional[str] = ..., records_processed: _Optional[int] = ...) -> None: ...

class PipelineMetadata(_message.Message):
    __slots__ = ("name", "source_topic", "partitions", "processor", "processing_order", "threads_per_task", "store", "store_kind", "retry_policy", "retry_topic", "dead_letter_topic", "retry_backlog", "dead_lettered", "remote_processor", "sink_topic")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SOURCE_TOPIC_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    PROCESSOR_FIELD_NUMBER: _ClassVar[int]
    PROCESSING_ORDER_FIELD_NUMBER: _ClassVar[int]
    THREADS_PER_TASK_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    STORE_KIND_FIELD_NUMBER: _ClassVar[int]
    RETRY_POLICY_FIELD_NUMBER: _ClassVar[int]
    RETRY_TOPIC_FIELD_NUMBER: _ClassVar[int]
    DEAD_LETTER_TOPIC_FIELD_NUMBER: _ClassVar[int]
    RETRY_BACKLOG_FIELD_NUMBER: _ClassVar[int]
    DEAD_LETTERED_FIELD_NUMBER: _ClassVar[int]
    REMOTE_PROCESSOR_FIELD_NUMBER: _ClassVar[int]
    SINK_TOPIC_FIELD_NUMBER: _ClassVar[int]
    name: str
    source_topic: str
    partitions: int
    processor: str
    processing_order: ProcessingOrder
    threads_per_task: int
    store: str
    store_kind: str
    retry_policy: str
    retry_topic: str
    dead_letter_topic: str
    retry_backlog: int
    dead_lettered: int
    remote_processor: RemoteProcessorStatus
    sink_topic: str
    def __init__(self, name: _Optional[str] = ..., source_topic: _Optional[str] = ..., partitions: _Optional[int] = ..., processor: _Optional[str] = ..., processing_order: _Optional[_Union[ProcessingOrder, str]] = ..., threads_per_task: _Optional[int] = ..., store: _Optional[str] = ..., store_kind: _Optional[str] = ..., retry_policy: _Optional[str] = ..., retry_topic: _Optional[str] = ..., dead_letter_topic: _Optional[str] = ..., retry_backlog: _Optional[int] = ..., dead_lettered: _Optional[int] = ..., remote_processor: _Optional[_Union[RemoteProcessorStatus, _Mapping]] = ..., sink_topic: _Optional[str] = ...) -> None: ...

class RemoteProcessorStatus(_message.Message):
    __slots__ = ("endpoint", "waiting", "waiting_since_ms", "last_error", "unreachable_calls")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    WAITING_SINCE_MS_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    UNREACHABLE_CALLS_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    waiting: bool
    waiting_since_ms: int
    last_error: str
    unreachable_calls: int
    def __init__(self, endpoint: _Optional[str] = ..., waiting: _Optional[bool] = ..., waiting_since_ms: _Optional[int] = ..., last_error: _Optional[str] = ..., unreachable_calls: _Optional[int] = ...) -> None: ...

class DescribeRuntimeResponse(_message.Message):
    __slots__ = ("application_id", "host_info", "state", "num_stream_threads", "num_reserve_threads", "threads", "pipelines", "tasks", "num_retry_threads", "storage_faults")
    APPLICATION_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_INFO_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    NUM_STREAM_THREADS_FIELD_NUMBER: _ClassVar[int]
    NUM_RESERVE_THREADS_FIELD_NUMBER: _ClassVar[int]
    THREADS_FIELD_NUMBER: _ClassVar[int]
    PIPELINES_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RETRY_THREADS_FIELD_NUMBER: _ClassVar[int]
    STORAGE_FAULTS_FIELD_NUMBER: _ClassVar[int]
    application_id: str
    host_info: HostInfo
    state: ServiceState
    num_stream_threads: int
    num_reserve_threads: int
    threads: _containers.RepeatedCompositeFieldContainer[ThreadMetadata]
    pipelines: _containers.RepeatedCompositeFieldContainer[PipelineMetadata]
    tasks: _containers.RepeatedCompositeFieldContainer[TaskMetadata]
    num_retry_threads: int
    storage_faults: _containers.RepeatedCompositeFieldContainer[StorageFault]
    def __init__(self, application_id: _Optional[str] = ..., host_info: _Optional[_Union[HostInfo, _Mapping]] = ..., state: _Optional[_Union[ServiceState, str]] = ..., num_stream_threads: _Optional[int] = ..., num_reserve_threads: _Optional[int] = ..., threads: _Optional[_Iterable[_Union[ThreadMetadata, _Mapping]]] = ..., pipelines: _Optional[_Iterable[_Union[PipelineMetadata, _Mapping]]] = ..., tasks: _Optional[_Iterable[_Union[TaskMetadata, _Mapping]]] = ..., num_retry_threads: _Optional[int] = ..., storage_faults: _Optional[_Iterable[_Union[StorageFault, _Mapping]]] = ...) -> None: ...

class StorageFault(_message.Message):
    __slots__ = ("component", "name", "since_ms", "error", "errors")
    COMPONENT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SINCE_MS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    component: str
    name: str
    since_ms: int
    error: str
    errors: int
    def __init__(self, component: _Optional[str] = ..., name: _Optional[str] = ..., since_ms: _Optional[int] = ..., error: _Optional[str] = ..., errors: _Optional[int] = ...) -> None: ...

class AddStreamThreadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AddStreamThreadResponse(_message.Message):
    __slots__ = ("thread_name", "num_stream_threads")
    THREAD_NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_STREAM_THREADS_FIELD_NUMBER: _ClassVar[int]
    thread_name: str
    num_stream_threads: int
    def __init__(self, thread_name: _Optional[str] = ..., num_stream_threads: _Optional[int] = ...) -> None: ...

class RemoveStreamThreadRequest(_message.Message):
    __slots__ = ("thread_name",)
    THREAD_NAME_FIELD_NUMBER: _ClassVar[int]
    thread_name: str
    def __init__(self, thread_name: _Optional[str] = ...) -> None: ...

class RemoveStreamThreadResponse(_message.Message):
    __slots__ = ("thread_name", "num_stream_threads")
    THREAD_NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_STREAM_THREADS_FIELD_NUMBER: _ClassVar[int]
    thread_name: str
    num_stream_threads: int
    def __init__(self, thread_name: _Optional[str] = ..., num_stream_threads: _Optional[int] = ...) -> None: ...

class RedriveDeadLettersRequest(_message.Message):
    __slots__ = ("pipeline", "partition", "offsets", "all")
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    ALL_FIELD_NUMBER: _ClassVar[int]
    pipeline: str
    partition: int
    offsets: _containers.RepeatedScalarFieldContainer[int]
    all: bool
    def __init__(self, pipeline: _Optional[str] = ..., partition: _Optional[int] = ..., offsets: _Optional[_Iterable[int]] = ..., all: _Optional[bool] = ...) -> None: ...

class RedriveDeadLettersResponse(_message.Message):
    __slots__ = ("redriven", "retry_positions")
    REDRIVEN_FIELD_NUMBER: _ClassVar[int]
    RETRY_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    redriven: int
    retry_positions: _containers.RepeatedCompositeFieldContainer[RecordPosition]
    def __init__(self, redriven: _Optional[int] = ..., retry_positions: _Optional[_Iterable[_Union[RecordPosition, _Mapping]]] = ...) -> None: ...
