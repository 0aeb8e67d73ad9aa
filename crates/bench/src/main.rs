//! `steward-bench`, run as `cargo xtask bench` and `cargo xtask chaos`: see the library's
//! documentation.

use anyhow::Result;
use clap::{Parser, Subcommand};

/// Benchmarks against controller-runtime; writes docs/benchmarks.md.
#[derive(Parser)]
#[command(name = "steward-bench", args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(flatten)]
    flags: steward_bench::Flags,
    #[command(subcommand)]
    command: Option<Cmd>,
}

#[derive(Subcommand)]
enum Cmd {
    /// A seeded fault campaign on the real node (as root): `postgres` runs the failover
    /// test's campaign (3 instances, every commit on every instance, a client writing
    /// through `-rw`; after every fault: no second writer, no acknowledged row lost, every
    /// instance ready again) and writes docs/benchmarks-postgres-campaign.md from every run
    /// recorded in target/bench/postgres-campaign.jsonl.
    Chaos {
        /// What to disrupt: `postgres`.
        target: String,
        /// The campaign's seed (a failing run prints its own).
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Faults in the campaign (the first seven are each failure once, in an order drawn
        /// from the seed).
        #[arg(long, default_value_t = 20)]
        steps: usize,
    },
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.command {
        None => steward_bench::run(cli.flags),
        Some(Cmd::Chaos {
            target,
            seed,
            steps,
        }) => match target.as_str() {
            "postgres" => {
                steward_bench::postgres::chaos(&steward_testenv::workspace_root(), seed, steps)
            }
            other => anyhow::bail!("cargo xtask chaos {other}: only `postgres` has a campaign"),
        },
    }
}
