//! `verify-service --model PATH --listen ADDR [--config FILE]`

fn main() -> anyhow::Result<()> {
    verify_service::cli::main()
}
