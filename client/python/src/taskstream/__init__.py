"""taskstream for Python: a client of the taskstream gRPC service
(`taskstream.Client`), its errors as exceptions with decoded google.rpc details
(`taskstream.errors`), and a helper to write remote processors, sync or asyncio
(`taskstream.processor`). The generated stubs of proto/ are `taskstream.v1`.
"""

from . import errors, processor
from .client import Client, Entry, MetadataSubscription, final_records, parse_target, record
from .errors import (
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    Lagged,
    LimitExceeded,
    NotFound,
    NotHosted,
    OutOfRange,
    PermissionDenied,
    TaskstreamError,
    Unauthenticated,
    Unavailable,
)
from .v1 import processor_pb2, taskstream_pb2

__version__ = "0.1.0"

__all__ = [
    "Client",
    "Entry",
    "MetadataSubscription",
    "final_records",
    "parse_target",
    "record",
    "errors",
    "processor",
    "processor_pb2",
    "taskstream_pb2",
    "TaskstreamError",
    "InvalidArgument",
    "NotFound",
    "FailedPrecondition",
    "NotHosted",
    "Unavailable",
    "OutOfRange",
    "Lagged",
    "LimitExceeded",
    "Unauthenticated",
    "PermissionDenied",
    "DeadlineExceeded",
    "Cancelled",
]
