//! The generated gRPC API of taskstream (package `taskstream.v1`), shared by the
//! server, the client and any Rust program that talks to taskstream.
//!
//! The contract itself is `proto/taskstream/v1/taskstream.proto`; this crate only
//! compiles it (see `build.rs`) and exposes the descriptor set for reflection.

/// Package `taskstream.v1`: messages, `streams_service_*` and `admin_service_*`
/// client and server modules, and `processor_service_*`: the service a user
/// implements to process a pipeline's records (proto/taskstream/v1/processor.proto).
pub mod v1 {
    #![allow(clippy::large_enum_variant, clippy::doc_lazy_continuation)]
    tonic::include_proto!("taskstream.v1");
}

/// The encoded `FileDescriptorSet` of the server's services (taskstream.proto), for server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/taskstream_descriptor.bin"));
