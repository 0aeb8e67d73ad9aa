//! `tenant-operator`: runs the Tenant controller, or prints the admission policies.

use clap::Parser;
use steward_core::Operator;
use steward_core::cli::CommonArgs;
use tenant_operator::{NAME, Options, policy, register};

/// Gives each team a tenant: namespaces, access, quotas and isolation.
#[derive(Parser)]
#[command(name = NAME, version, about)]
struct Cli {
    #[command(flatten)]
    common: CommonArgs,

    #[command(flatten)]
    options: Options,

    /// Print the admission policies (exempting `--exempt-user`/`--exempt-group`, which should
    /// include the operator's ServiceAccount) as YAML and exit.
    #[arg(long)]
    print_policies: bool,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if cli.print_policies {
        let exempt = policy::Exemptions::new(
            cli.options.exempt_users.clone(),
            cli.options.exempt_groups.clone(),
        );
        print!("{}", policy::to_yaml(&policy::policies(&exempt, NAME))?);
        return Ok(());
    }
    cli.common.init_logging();
    let mut operator = Operator::new(NAME, cli.common).await?;
    register(&mut operator, cli.options)?;
    operator.run().await?;
    Ok(())
}
