//! `steward-pooler`: see the library's documentation.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use steward_pooler::agent::{self, Settings};
use steward_pooler::config::{self, PoolMode, Tls};
use steward_pooler::contract;
use tokio_util::sync::CancellationToken;

/// `steward-pooler [flags]` runs the agent; `steward-pooler copy <dir>` copies the binary.
#[derive(Parser)]
#[command(
    name = "steward-pooler",
    about = "Steward's PgBouncer agent: runs PgBouncer as this pod's pooler of the cluster",
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Subcommand)]
enum Command {
    /// Copies this binary into `dir` (an init container's job: the PgBouncer image needs
    /// nothing of Steward's).
    Copy { dir: PathBuf },
}

// The three names are required to run, not to copy: `Option`s clap requires unless a
// subcommand is given.
#[derive(clap::Args)]
struct RunArgs {
    /// The PostgresCluster this pooler serves.
    #[arg(long, env = "CLUSTER_NAME", required = true)]
    cluster: Option<String>,
    #[arg(long, env = "POD_NAMESPACE", required = true)]
    namespace: Option<String>,
    /// This pod's name: its key in the state ConfigMap.
    #[arg(long, env = "POD_NAME", required = true)]
    pod: Option<String>,
    #[arg(long, env = "POOL_MODE", value_enum, default_value = "transaction")]
    pool_mode: PoolMode,
    /// Server connections per (database, user) pair.
    #[arg(long, env = "DEFAULT_POOL_SIZE", default_value_t = 20)]
    default_pool_size: u32,
    #[arg(long, env = "MAX_CLIENT_CONN", default_value_t = 1000)]
    max_client_conn: u32,
    /// The password of the lookup role (`steward_pooler`).
    #[arg(
        long,
        env = "AUTH_PASSWORD_FILE",
        default_value = "/etc/steward-pooler/password"
    )]
    auth_password_file: PathBuf,
    /// `tls.crt` and `tls.key` (PgBouncer's certificate for its clients) and `ca.crt` (the
    /// cluster's CA, to verify PostgreSQL).
    #[arg(long, env = "TLS_DIR", default_value = "/etc/steward-tls")]
    tls_dir: PathBuf,
    /// A writable directory (an emptyDir): pgbouncer.ini, the auth file, the Unix socket.
    #[arg(long, env = "STEWARD_RUN_DIR", default_value = "/steward/run")]
    run_dir: PathBuf,
    /// The PgBouncer program (on PATH, or a path).
    #[arg(long, env = "PGBOUNCER", default_value = "pgbouncer")]
    pgbouncer: PathBuf,
    /// How long PgBouncer may take to stop (in-flight transactions) before it is killed.
    #[arg(long, env = "SHUTDOWN_GRACE", default_value = "25s", value_parser = steward_core::cli::parse_duration)]
    grace: Duration,
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match cli.command {
        Some(Command::Copy { dir }) => {
            let exe = std::env::current_exe()?;
            std::fs::create_dir_all(&dir)?;
            let to = dir.join(contract::pooler::BINARY);
            std::fs::copy(&exe, &to).with_context(|| format!("copy to {}", to.display()))?;
            println!("copied {} to {}", exe.display(), to.display());
            Ok(())
        }
        None => tokio::runtime::Runtime::new()?.block_on(run(cli.run)),
    }
}

async fn run(args: RunArgs) -> anyhow::Result<()> {
    let named =
        |value: Option<String>, flag: &str| value.with_context(|| format!("--{flag} is required"));
    let settings = Settings {
        cluster: named(args.cluster, "cluster")?,
        namespace: named(args.namespace, "namespace")?,
        pod: named(args.pod, "pod")?,
        pgbouncer: config::Settings {
            listen_addr: "*".into(),
            listen_port: contract::pooler::PORT,
            server_port: contract::PG_PORT,
            run_dir: args.run_dir,
            pool_mode: args.pool_mode,
            default_pool_size: args.default_pool_size,
            max_client_conn: args.max_client_conn,
            tls: Some(Tls { dir: args.tls_dir }),
        },
        auth_password_file: args.auth_password_file,
        program: args.pgbouncer,
        grace: args.grace,
    };
    // The run directory is a fresh emptyDir (or a path inside one).
    std::fs::create_dir_all(&settings.pgbouncer.run_dir)
        .with_context(|| format!("create {}", settings.pgbouncer.run_dir.display()))?;
    let client = kube::Client::try_default()
        .await
        .context("a Kubernetes client from the pod's ServiceAccount")?;
    let shutdown = CancellationToken::new();
    let signal = shutdown.clone();
    tokio::spawn(async move {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(e) => {
                    tracing::error!(error = %e, "cannot handle SIGTERM");
                    return;
                }
            };
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
        tracing::info!("signal received: stopping PgBouncer");
        signal.cancel();
    });
    agent::run(settings, client, shutdown)
        .await
        .context("steward-pooler")
}
