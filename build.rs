//! Compiles proto/ with protox (pure Rust, no protoc) and tonic-prost-build, and
//! writes the file descriptor set that server reflection serves: the server's
//! own services only, since ProcessorService is implemented by users, not by
//! the taskstream server.

use std::{env, path::PathBuf};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let served = ["proto/taskstream/v1/taskstream.proto"];
    let protos = [
        "proto/taskstream/v1/taskstream.proto",
        "proto/taskstream/v1/processor.proto",
    ];
    println!("cargo:rerun-if-changed=proto");

    let out_dir = PathBuf::from(env::var("OUT_DIR")?);
    let reflected = protox::compile(served, ["proto"])?;
    let descriptor_path = out_dir.join("taskstream_descriptor.bin");
    std::fs::write(&descriptor_path, prost::Message::encode_to_vec(&reflected))?;

    let file_descriptors = protox::compile(protos, ["proto"])?;

    tonic_prost_build::configure()
        .bytes(".")
        .compile_fds(file_descriptors)?;
    Ok(())
}
