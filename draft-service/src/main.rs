//! `draft-service --model PATH --verify URL[,URL...] --listen ADDR [--config FILE]`

fn main() -> anyhow::Result<()> {
    draft_service::cli::main()
}
