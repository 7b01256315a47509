"""Streams a bounded GetMetadataAsync (earliest -> current end offsets) with
Python grpcio and reports how many record outcomes it received and how fast.
Run by the `rpc` scenario of taskstream-bench.

Usage: metadata_stream.py ADDR STUBS_DIR STORE

STUBS_DIR holds stubs generated from proto/ at run time (grpc_tools.protoc).
Prints one line: `records=N processed=P messages=M lagged=L seconds=S`; exits 1
on a gRPC error.
"""

import sys
import time

TIMEOUT_S = 600.0


def main():
    if len(sys.argv) != 4:
        print(__doc__, file=sys.stderr)
        return 2
    addr, stubs, store = sys.argv[1:4]
    sys.path.insert(0, stubs)
    import grpc
    from taskstream.v1 import taskstream_pb2 as pb
    from taskstream.v1 import taskstream_pb2_grpc as pb_grpc

    channel = grpc.insecure_channel(addr, options=[("grpc.max_receive_message_length", 64 * 1024 * 1024)])
    grpc.channel_ready_future(channel).result(timeout=30)
    streams = pb_grpc.StreamsServiceStub(channel)
    request = pb.GetMetadataAsyncRequest(
        store=store,
        start=pb.START_POSITION_EARLIEST,
        end=pb.END_POSITION_CURRENT,
    )
    records = messages = lagged = processed = 0
    last_offset = -1
    start = time.perf_counter()
    try:
        # Every record is read as a Python object (offset and outcome), as a
        # callback would, and as the Rust client turns each into a struct.
        for response in streams.GetMetadataAsync(request, timeout=TIMEOUT_S):
            messages += 1
            if response.WhichOneof("event") == "batch":
                for record in response.batch.records:
                    records += 1
                    processed += record.outcome == pb.RECORD_OUTCOME_PROCESSED
                    last_offset = max(last_offset, record.offset)
            else:
                lagged += response.lagged.missed_batches
    except grpc.RpcError as error:
        print(f"error: {error.code()}: {error.details()}", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - start
    channel.close()
    print(f"records={records} processed={processed} messages={messages} lagged={lagged} seconds={seconds:.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
