//! The database-operator binary: steward-core's common flags plus [`database_operator::Options`].

use clap::Parser;

#[derive(Parser)]
#[command(
    name = "database-operator",
    version,
    about = "Manages PostgreSQL clusters, databases and roles"
)]
struct Args {
    #[command(flatten)]
    common: steward_core::cli::CommonArgs,
    #[command(flatten)]
    options: database_operator::Options,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    args.common.init_logging();
    let mut operator = steward_core::Operator::new(database_operator::NAME, args.common).await?;
    database_operator::register(&mut operator, args.options)?;
    operator.run().await?;
    Ok(())
}
