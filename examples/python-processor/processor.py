"""A taskstream processor in Python: a gRPC ProcessorService that enriches each
record and counts records per key through state operations.

Generate the stubs from the repository's proto/ once, then run it beside the
server (see the README's "Processors in any language"):

    python -m grpc_tools.protoc -I proto --python_out=gen --grpc_python_out=gen \
        proto/taskstream/v1/taskstream.proto proto/taskstream/v1/processor.proto
    PYTHONPATH=gen python examples/python-processor/processor.py 127.0.0.1:7000
"""

import sys
from concurrent import futures

import grpc
from taskstream.v1 import processor_pb2 as pb
from taskstream.v1 import processor_pb2_grpc
from taskstream.v1 import taskstream_pb2


class Enricher(processor_pb2_grpc.ProcessorServiceServicer):
    def Process(self, request, context):
        # The store's count of each key of this call (the pipeline sets
        # include_state = true), carried from one record to the next.
        counts = {s.key: int(s.value) if s.HasField("value") else 0 for s in request.state}
        results = []
        for record in request.records:
            if not record.HasField("key"):
                results.append(pb.RecordResult(success=pb.RecordSuccess()))
                continue
            try:
                text = record.value.decode("utf-8")
            except UnicodeDecodeError:
                # Retrying cannot help: straight to the dead-letter topic.
                failure = pb.RecordFailure(kind="NotUtf8", message="value is not UTF-8", retryable=False)
                results.append(pb.RecordResult(failure=failure))
                continue
            counts[record.key] = counts.get(record.key, 0) + 1
            count = counts[record.key]
            enriched = pb.OutputRecord(
                key=record.key,
                value=f"{text.upper()} (#{count} of {record.key.decode('utf-8', 'replace')})".encode(),
                headers=[taskstream_pb2.Header(name="source-offset", value=str(record.offset).encode())],
            )
            put = pb.StateOp(key=record.key, put=str(count).encode())
            results.append(pb.RecordResult(success=pb.RecordSuccess(state_ops=[put], outputs=[enriched])))
        return pb.ProcessResponse(results=results)


def main():
    address = sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:7000"
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    processor_pb2_grpc.add_ProcessorServiceServicer_to_server(Enricher(), server)
    port = server.add_insecure_port(address)
    server.start()
    print(f"processor listening on port {port}", flush=True)
    server.wait_for_termination()


if __name__ == "__main__":
    main()
