//! The real verify-service entry point ([`verify_service::cli::main`]), built inside this
//! package because Cargo hands integration tests the paths of their own package's binaries
//! only. The failover tests run it as separate processes, kill it with SIGKILL and drain it
//! with SIGTERM.

fn main() -> anyhow::Result<()> {
    verify_service::cli::main()
}
