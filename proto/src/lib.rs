//! Generated gRPC code for the `sequoia.v1` API.
//!
//! `proto/sequoia/v1/sequoia.proto` is the single source of the wire API; this crate is the one
//! home of the code generated from it, used by draft-service, verify-service and the CLI.

#![allow(clippy::all)]

pub mod v1 {
    tonic::include_proto!("sequoia.v1");
}

/// Encoded file descriptor set, for gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("sequoia_descriptor");
