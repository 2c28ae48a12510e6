fn main() -> Result<(), Box<dyn std::error::Error>> {
    // A vendored protoc keeps fresh machines free of a system protobuf install.
    std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?);
    tonic_prost_build::configure()
        // JSON output of summaries in the CLI and tests.
        .type_attribute(".sequoia.v1", "#[derive(serde::Serialize)]")
        .file_descriptor_set_path(
            std::path::PathBuf::from(std::env::var("OUT_DIR")?).join("sequoia_descriptor.bin"),
        )
        .compile_protos(&["sequoia/v1/sequoia.proto"], &["."])?;
    println!("cargo:rerun-if-changed=sequoia/v1/sequoia.proto");
    Ok(())
}
