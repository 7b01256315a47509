//! Compiles proto/ with protox (pure Rust, no protoc) and tonic-prost-build, and
//! writes the file descriptor set that server reflection serves.

use std::{env, path::PathBuf};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = ["proto/taskstream/v1/taskstream.proto"];
    println!("cargo:rerun-if-changed=proto");

    let file_descriptors = protox::compile(protos, ["proto"])?;
    let out_dir = PathBuf::from(env::var("OUT_DIR")?);
    let descriptor_path = out_dir.join("taskstream_descriptor.bin");
    std::fs::write(&descriptor_path, prost::Message::encode_to_vec(&file_descriptors))?;

    tonic_prost_build::configure()
        .bytes(".")
        .compile_fds(file_descriptors)?;
    Ok(())
}
