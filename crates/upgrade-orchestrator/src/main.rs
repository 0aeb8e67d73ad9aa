//! The `upgrade-orchestrator` binary: steward-core's common flags plus [`upgrade_orchestrator::Options`].

use clap::Parser;
use steward_core::Operator;
use steward_core::cli::CommonArgs;

/// Rolls new versions across several dependent workloads, in order (UpgradePlan, upgrade.steward.dev).
#[derive(Parser)]
#[command(name = "upgrade-orchestrator", version, about)]
struct Args {
    #[command(flatten)]
    common: CommonArgs,
    #[command(flatten)]
    options: upgrade_orchestrator::Options,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    args.common.init_logging();
    let mut operator = Operator::new(upgrade_orchestrator::NAME, args.common).await?;
    upgrade_orchestrator::register(&mut operator, args.options)?;
    operator.run().await?;
    Ok(())
}
