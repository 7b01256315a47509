"""Errors of taskstream calls: one exception class per status code the server
answers with, each carrying the code, the message and the google.rpc error
details decoded from the `grpc-status-details-bin` trailer (BadRequest,
PreconditionFailure, RetryInfo, ErrorInfo, ResourceInfo, ...).

`from_rpc_error` is the one place that turns a `grpc.RpcError` into one of
these; the client raises nothing else for a failed call.

| exception            | status code                                                  |
|----------------------|--------------------------------------------------------------|
| InvalidArgument      | INVALID_ARGUMENT                                             |
| NotFound             | NOT_FOUND                                                    |
| FailedPrecondition   | FAILED_PRECONDITION                                          |
| NotHosted            | FAILED_PRECONDITION, ErrorInfo reason PARTITION_NOT_HOSTED   |
| Unavailable          | UNAVAILABLE (retryable; `retry_delay` from RetryInfo)        |
| OutOfRange           | OUT_OF_RANGE (`partition`, `earliest` from ErrorInfo)        |
| Lagged               | RESOURCE_EXHAUSTED reason SUBSCRIBER_LAGGED, or the in-band notice |
| LimitExceeded        | any other RESOURCE_EXHAUSTED                                 |
| Unauthenticated      | UNAUTHENTICATED                                              |
| PermissionDenied     | PERMISSION_DENIED (`role` needed, from ErrorInfo)            |
| DeadlineExceeded     | DEADLINE_EXCEEDED                                            |
| Cancelled            | CANCELLED                                                    |
| TaskstreamError      | anything else (INTERNAL, UNKNOWN, ...), the base of them all |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

#: The trailer that holds the serialized google.rpc.Status.
STATUS_DETAILS_KEY = "grpc-status-details-bin"

#: ErrorInfo reasons the server uses.
REASON_NOT_HOSTED = "PARTITION_NOT_HOSTED"
REASON_SUBSCRIBER_LAGGED = "SUBSCRIBER_LAGGED"
REASON_LIMIT_EXCEEDED = "LIMIT_EXCEEDED"
REASON_ROLE_REQUIRED = "ROLE_REQUIRED"
REASON_OFFSET_OUT_OF_RANGE = "OFFSET_OUT_OF_RANGE"

# Every detail type of google/rpc/error_details.proto, by its type URL.
_DETAIL_TYPES = {
    cls.DESCRIPTOR.full_name: cls
    for cls in (
        error_details_pb2.ErrorInfo,
        error_details_pb2.RetryInfo,
        error_details_pb2.DebugInfo,
        error_details_pb2.QuotaFailure,
        error_details_pb2.PreconditionFailure,
        error_details_pb2.BadRequest,
        error_details_pb2.RequestInfo,
        error_details_pb2.ResourceInfo,
        error_details_pb2.Help,
        error_details_pb2.LocalizedMessage,
    )
}


@dataclass(frozen=True)
class FieldViolation:
    """One field of a request the server refused (google.rpc.BadRequest)."""

    field: str
    description: str


@dataclass(frozen=True)
class PreconditionViolation:
    """One precondition that failed (google.rpc.PreconditionFailure)."""

    type: str
    subject: str
    description: str


class TaskstreamError(Exception):
    """A failed taskstream call.

    `code` is the `grpc.StatusCode`, `message` the server's text, `details` the
    decoded google.rpc messages (an `Any` stays as it is when its type is not
    one of google/rpc/error_details.proto).
    """

    def __init__(self, code: grpc.StatusCode, message: str, details: Sequence[Any] = ()):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.details = list(details)

    def _of(self, cls):
        return [d for d in self.details if isinstance(d, cls)]

    @property
    def field_violations(self) -> List[FieldViolation]:
        """BadRequest field violations, in order."""
        return [
            FieldViolation(v.field, v.description)
            for bad in self._of(error_details_pb2.BadRequest)
            for v in bad.field_violations
        ]

    @property
    def precondition_violations(self) -> List[PreconditionViolation]:
        """PreconditionFailure violations, in order."""
        return [
            PreconditionViolation(v.type, v.subject, v.description)
            for failure in self._of(error_details_pb2.PreconditionFailure)
            for v in failure.violations
        ]

    @property
    def error_info(self) -> Optional[error_details_pb2.ErrorInfo]:
        """The first ErrorInfo, if any."""
        infos = self._of(error_details_pb2.ErrorInfo)
        return infos[0] if infos else None

    @property
    def reason(self) -> Optional[str]:
        """ErrorInfo reason, if any."""
        info = self.error_info
        return info.reason if info is not None else None

    @property
    def resource_info(self) -> Optional[error_details_pb2.ResourceInfo]:
        """The first ResourceInfo (the unknown store or topic), if any."""
        infos = self._of(error_details_pb2.ResourceInfo)
        return infos[0] if infos else None

    @property
    def retry_delay(self) -> Optional[float]:
        """Seconds to wait before retrying, from RetryInfo, if the server said."""
        for info in self._of(error_details_pb2.RetryInfo):
            if info.HasField("retry_delay"):
                return info.retry_delay.seconds + info.retry_delay.nanos / 1e9
        return None

    @property
    def retryable(self) -> bool:
        """True when the same call may succeed later unchanged."""
        return self.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class InvalidArgument(TaskstreamError):
    """A malformed request: empty store name, bad offsets, an invalid setting."""


class NotFound(TaskstreamError):
    """An unknown store or topic."""


class FailedPrecondition(TaskstreamError):
    """A valid request the store cannot honour as configured (e.g. `in_order`)."""


class NotHosted(FailedPrecondition):
    """The partition is held by another instance; `owner` is its host:port when known."""

    @property
    def owner(self) -> Optional[str]:
        info = self.error_info
        return info.metadata.get("owner") if info is not None else None


class Unavailable(TaskstreamError):
    """The instance is starting, rebalancing, restoring or shutting down, or cannot be reached."""


class OutOfRange(TaskstreamError):
    """A stream asked for offsets no longer retained: `earliest` is where it may start."""

    def _metadata(self, name: str) -> Optional[int]:
        info = self.error_info
        if info is None or name not in info.metadata:
            return None
        try:
            return int(info.metadata[name])
        except ValueError:
            return None

    @property
    def partition(self) -> Optional[int]:
        return self._metadata("partition")

    @property
    def earliest(self) -> Optional[int]:
        return self._metadata("earliest")


class Lagged(TaskstreamError):
    """A subscriber too slow for the server's buffer: `missed_batches` were dropped for it."""

    def __init__(self, code, message, details=(), missed_batches: Optional[int] = None):
        super().__init__(code, message, details)
        self.missed_batches = missed_batches


class LimitExceeded(TaskstreamError):
    """A size or count over one of the server's limits; ErrorInfo metadata `setting` names it."""

    @property
    def setting(self) -> Optional[str]:
        info = self.error_info
        return info.metadata.get("setting") if info is not None else None


class Unauthenticated(TaskstreamError):
    """No bearer token, or one the server does not know."""


class PermissionDenied(TaskstreamError):
    """The token's role is below the call's; `role` names the role needed."""

    @property
    def role(self) -> Optional[str]:
        info = self.error_info
        return info.metadata.get("role") if info is not None else None


class DeadlineExceeded(TaskstreamError):
    """The call's timeout passed before the server answered."""


class Cancelled(TaskstreamError):
    """The call was cancelled."""


_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.OUT_OF_RANGE: OutOfRange,
    grpc.StatusCode.RESOURCE_EXHAUSTED: LimitExceeded,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
}


def decode_details(status: status_pb2.Status) -> List[Any]:
    """The details of a google.rpc.Status, each unpacked into its google.rpc type."""
    decoded = []
    for detail in status.details:
        cls = _DETAIL_TYPES.get(detail.TypeName())
        message = cls() if cls is not None else None
        if message is not None and detail.Unpack(message):
            decoded.append(message)
        else:
            kept = any_pb2.Any()
            kept.CopyFrom(detail)
            decoded.append(kept)
    return decoded


def _status_from_metadata(code: grpc.StatusCode, metadata) -> Optional[status_pb2.Status]:
    for key, value in metadata or ():
        if key == STATUS_DETAILS_KEY:
            status = status_pb2.Status.FromString(value)
            # A trailer that disagrees with the call's code is not this call's.
            return status if status.code == code.value[0] else None
    return None


def error_of(code: grpc.StatusCode, message: str, trailing_metadata=(), status=None) -> TaskstreamError:
    """The exception for a status code, message and trailers (or an already decoded Status)."""
    if status is None:
        status = _status_from_metadata(code, trailing_metadata)
    details = decode_details(status) if status is not None else []
    cls = _BY_CODE.get(code, TaskstreamError)
    error = cls(code, message, details)
    reason = error.reason
    if code == grpc.StatusCode.FAILED_PRECONDITION and reason == REASON_NOT_HOSTED:
        error = NotHosted(code, message, details)
    elif code == grpc.StatusCode.RESOURCE_EXHAUSTED and reason == REASON_SUBSCRIBER_LAGGED:
        error = Lagged(code, message, details)
    return error


def from_rpc_error(error: grpc.RpcError) -> TaskstreamError:
    """The exception for a failed grpcio call (sync or asyncio)."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    message = error.details() if hasattr(error, "details") else str(error)
    metadata = error.trailing_metadata() if hasattr(error, "trailing_metadata") else ()
    status = None
    if isinstance(error, grpc.Call):
        # grpcio-status checks the trailer against the call's code and message.
        try:
            status = rpc_status.from_call(error)
        except ValueError:
            status = None
    return error_of(code or grpc.StatusCode.UNKNOWN, message or "", metadata, status)


def lagged_notice(missed_batches: int) -> Lagged:
    """The in-band `Lagged` notice of a GetMetadataAsync stream, as an exception value."""
    return Lagged(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"the subscriber was too slow: {missed_batches} batches dropped",
        missed_batches=missed_batches,
    )


__all__: Tuple[str, ...] = (
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
    "FieldViolation",
    "PreconditionViolation",
    "from_rpc_error",
    "error_of",
    "decode_details",
    "lagged_notice",
)
