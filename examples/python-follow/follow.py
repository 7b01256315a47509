"""Follow a store's record outcomes across partition moves, with grpcio.

The same recipe as the Rust client's `get_metadata_async_all` (README, "Streams
follow the partition"): one GetMetadataAsync stream per partition, from the
instance ProcessMetadataForStore names as its owner. When a stream ends
(UNAVAILABLE: the partition moved; a broken connection: the instance died),
ask again who owns the partition, with backoff until a deadline, and resume
there at the first offset not delivered yet. Outcomes the new owner repeats
(it re-processes from its last commit) are dropped by offset. When the new
owner no longer holds the outcomes wanted, it answers OUT_OF_RANGE with
ErrorInfo `earliest`: the offsets below it are reported missed (`on_lagged`)
and the stream resumes at `earliest`.

Usage as a script, with the taskstream package (`pip install ./client/python`):

    python follow.py ADDR STORE

prints one line per record and one per missed range. As a module:
`follow(addresses, store, on_batch, on_lagged, stop, partitions)`.
"""

import sys
import threading
import time

import grpc
import taskstream
from taskstream import errors
from taskstream.v1 import taskstream_pb2 as pb

FIRST_BACKOFF_S = 0.1
MAX_BACKOFF_S = 2.0
# A rebalance after a crash waits for the group's session timeout (45 s by
# default), then for the new owner's restore.
FOLLOW_DEADLINE_S = 120.0


class PartitionFollow:
    """What was delivered of one partition; no I/O.

    Every offset below `settled_below` had its final outcome delivered or was
    reported missed; `settled_above` holds final offsets delivered above it
    (out of order, or past a record still retrying).
    """

    def __init__(self, start=None):
        self.settled_below = start
        self.settled_above = set()
        # Before a resume, lower offsets are no repeats: from Latest the
        # start is only the first batch's lowest offset.
        self.resumed = False

    def resume_from(self):
        return self.settled_below

    def _settled(self, offset):
        below = self.settled_below
        return (self.resumed and below is not None and offset < below) or offset in self.settled_above

    def _settle(self, offset):
        if self.settled_below is not None and offset < self.settled_below:
            return
        self.settled_above.add(offset)
        while self.settled_below in self.settled_above:
            self.settled_above.remove(self.settled_below)
            self.settled_below += 1

    def accept(self, records, final_of):
        """The records not delivered before; marks the final ones delivered."""
        if self.settled_below is None and records:
            self.settled_below = min(r.offset for r in records)
        kept = [r for r in records if not self._settled(r.offset)]
        for record in kept:
            if final_of(record):
                self._settle(record.offset)
        return kept

    def missed_until(self, available):
        """Offsets in [resume_from, available) not delivered: (first, last) ranges."""
        start = self.settled_below
        if start is None or available <= start:
            self.settled_below = available if start is None else start
            return []
        gaps, first = [], None
        for offset in range(start, available):
            if offset in self.settled_above:
                if first is not None:
                    gaps.append((first, offset - 1))
                    first = None
            elif first is None:
                first = offset
        if first is not None:
            gaps.append((first, available - 1))
        self.settled_above = {o for o in self.settled_above if o >= available}
        self.settled_below = available
        while self.settled_below in self.settled_above:
            self.settled_above.remove(self.settled_below)
            self.settled_below += 1
        return gaps


def earliest_of(error):
    """(partition, earliest) of an OUT_OF_RANGE answer (decoded by the package), or None."""
    if not isinstance(error, errors.OutOfRange) or error.reason != errors.REASON_OFFSET_OUT_OF_RANGE:
        return None
    if error.partition is None or error.earliest is None:
        return None
    return error.partition, error.earliest


def _owner(addresses, store, partition):
    """The advertised host:port of the partition's owner, asking each known address in turn."""
    for address in list(addresses):
        try:
            with taskstream.Client(address, timeout=5) as client:
                answer = client.process_metadata_for_store(store)
        except errors.TaskstreamError:
            continue
        for instance in answer.metadata:
            known = f"{instance.host_info.host}:{instance.host_info.port}"
            if known not in addresses:
                addresses.append(known)
        for instance in answer.metadata:
            if any(tp.partition == partition for tp in instance.topic_partitions):
                return f"{instance.host_info.host}:{instance.host_info.port}"
    return None


def follow_partition(addresses, store, partition, start, on_batch, on_lagged, stop,
                     deadline_s=FOLLOW_DEADLINE_S, in_order=True):
    """Streams one partition's outcomes until `stop()`; follows it across owners."""
    final = (pb.RECORD_OUTCOME_RETRYING, pb.RECORD_OUTCOME_UNSPECIFIED)
    state = PartitionFollow(start)
    backoff, lost_at, started = FIRST_BACKOFF_S, None, False
    while not stop():
        owner = _owner(addresses, store, partition)
        resume = state.resume_from()
        # Every stream after the first one resumes.
        state.resumed, started = started, True
        request = pb.GetMetadataAsyncRequest(store=store, in_order=in_order, partitions=[partition])
        if resume is not None:
            request.start = pb.START_POSITION_OFFSETS
            request.start_offsets[partition] = resume
        try:
            if owner is None:
                raise LookupError(f"no instance lists partition {partition} yet")
            with taskstream.Client(owner) as client:
                stream = client.streams.GetMetadataAsync(request)
                for response in stream:
                    backoff, lost_at = FIRST_BACKOFF_S, None
                    if response.HasField("batch"):
                        batch = response.batch
                        kept = state.accept(list(batch.records), lambda r: r.outcome not in final)
                        if kept:
                            on_batch(batch, kept)
                    if stop():
                        stream.cancel()
                        return
        except grpc.RpcError as rpc_error:
            error = errors.from_rpc_error(rpc_error)
            gap = earliest_of(error)
            if gap and gap[0] == partition:
                for first, last in state.missed_until(gap[1]):
                    on_lagged(partition, first, last)
                continue
            if error.code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN,
                                  grpc.StatusCode.CANCELLED, grpc.StatusCode.FAILED_PRECONDITION):
                raise error from None
        except LookupError:
            pass
        # The stream ended or could not open: the partition is on the move.
        lost_at = lost_at or time.monotonic()
        if time.monotonic() - lost_at > deadline_s:
            raise TimeoutError(f"partition {partition}: no owner within {deadline_s} s")
        time.sleep(backoff)
        backoff = min(backoff * 2, MAX_BACKOFF_S)


def follow(addresses, store, on_batch, on_lagged, stop, partitions, start=None, **options):
    """One thread per partition; callbacks run under one lock, one at a time."""
    lock = threading.Lock()
    failures = []

    def locked(callback):
        def run(*args):
            with lock:
                callback(*args)
        return run

    def one(partition):
        try:
            follow_partition(list(addresses), store, partition,
                             None if start is None else start.get(partition, 0),
                             locked(on_batch), locked(on_lagged), stop, **options)
        except Exception as error:  # handed to the caller, who decides
            failures.append(error)

    threads = [threading.Thread(target=one, args=(p,), daemon=True) for p in partitions]
    for thread in threads:
        thread.start()
    return threads, failures


def main():
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    addr, store = sys.argv[1:]
    with taskstream.Client(addr) as client:
        metadata = client.process_metadata_for_store(store)
    partitions = sorted({tp.partition for m in metadata.metadata for tp in m.topic_partitions})

    def on_batch(batch, records):
        for record in records:
            print(f"{batch.partition}/{record.offset} {pb.RecordOutcome.Name(record.outcome)}")

    def on_lagged(partition, first, last):
        print(f"lagged partition={partition} offsets={first}..={last}")

    threads, failures = follow([addr], store, on_batch, on_lagged, lambda: bool(failures), partitions)
    for thread in threads:
        thread.join()
    for failure in failures:
        print(f"error: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
