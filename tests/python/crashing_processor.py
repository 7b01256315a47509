"""A ProcessorService for the crash tests (tests/python_processor_crash.rs):
counts records per key through state operations, like the example, and
exits at once (os._exit, no answer, no cleanup: a crash) when a call holds a
record whose value is the poison value given on the command line.

    crashing_processor.py ADDRESS POISON_VALUE
"""

import os
import sys
from concurrent import futures

import grpc
from taskstream.v1 import processor_pb2 as pb
from taskstream.v1 import processor_pb2_grpc


class Counter(processor_pb2_grpc.ProcessorServiceServicer):
    def __init__(self, poison):
        self.poison = poison

    def Process(self, request, context):
        if any(r.value == self.poison for r in request.records):
            os._exit(3)
        counts = {s.key: int(s.value) if s.HasField("value") else 0 for s in request.state}
        results = []
        for record in request.records:
            counts[record.key] = counts.get(record.key, 0) + 1
            put = pb.StateOp(key=record.key, put=str(counts[record.key]).encode())
            results.append(pb.RecordResult(success=pb.RecordSuccess(state_ops=[put])))
        return pb.ProcessResponse(results=results)


def main():
    address, poison = sys.argv[1], sys.argv[2].encode()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    processor_pb2_grpc.add_ProcessorServiceServicer_to_server(Counter(poison), server)
    port = server.add_insecure_port(address)
    server.start()
    print(f"processor listening on port {port}", flush=True)
    server.wait_for_termination()


if __name__ == "__main__":
    main()
