//! `kubectl-steward`: see the library's docs (`kubectl_steward`).

use clap::Parser;

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::process::ExitCode {
    let cli = kubectl_steward::Cli::parse();
    let mut out = std::io::stdout();
    match kubectl_steward::run(cli, &mut out).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
