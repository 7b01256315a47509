//! gRPC service (in progress).
