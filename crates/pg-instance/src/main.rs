//! `steward-pg-instance`: see the library's documentation.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use steward_pg_instance::archive::{self, Store, StoreConfig};
use steward_pg_instance::contract;
use steward_pg_instance::manager::{self, Settings};
use steward_pg_instance::postgres::Paths;
use tokio_util::sync::CancellationToken;

#[derive(Parser)]
#[command(
    name = "steward-pg-instance",
    about = "Steward's PostgreSQL instance manager"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Copies this binary into `dir` (an init container's job: the PostgreSQL image needs
    /// nothing of Steward's).
    Copy { dir: PathBuf },
    /// Runs PostgreSQL as this pod's instance of the cluster.
    Run(Box<RunArgs>),
    /// The fence process the manager starts (reads its heartbeats on stdin).
    Watchdog,
    /// PostgreSQL's `archive_command`: archives WAL file `path` (`%p`) as `name` (`%f`) to
    /// the object store of `STEWARD_BACKUP_*`.
    WalPush { path: PathBuf, name: String },
    /// PostgreSQL's `restore_command`: restores archived WAL file `name` (`%f`) to `dest`
    /// (`%p`); exits 1 when the archive has no such file.
    WalFetch {
        name: String,
        dest: PathBuf,
        /// From the store a new cluster is restored from (`STEWARD_RECOVERY_*`).
        #[arg(long, conflicts_with = "from_source")]
        from_recovery: bool,
        /// From the archive of the cluster a standby cluster follows
        /// (`STEWARD_REPLICA_SOURCE_*`); a failure counts as a missing file, as a replica's.
        #[arg(long)]
        from_source: bool,
    },
    /// An init container of the old major's image: exports that PostgreSQL installation (and
    /// the libraries it links) into `to` for `major-upgrade`.
    ExportBinaries { to: PathBuf },
    /// A parameters check Job, in the cluster's PostgreSQL image: has `postgres -C` read the
    /// `postgresql.conf` in `STEWARD_CHECK_CONFIG` as a starting server would, so that no
    /// instance is restarted onto a configuration PostgreSQL refuses. A refusal (PostgreSQL's
    /// own words) is also written to `/dev/termination-log` for the operator's condition.
    CheckConfig {
        #[arg(long, env = contract::CHECK_CONFIG_ENV, hide_env_values = true)]
        config: String,
        #[arg(long, env = "STEWARD_RUN_DIR", default_value = "/steward/run")]
        run_dir: PathBuf,
    },
    /// The upgrade Job, in the new major's image: `pg_upgrade`s the data directory with the
    /// old major's programs exported to `old`. On failure the reason is also written to
    /// `/dev/termination-log` (the operator shows it in the cluster's condition).
    MajorUpgrade {
        #[arg(long, env = "PGDATA")]
        pgdata: PathBuf,
        #[arg(long, default_value = "/steward/old")]
        old: PathBuf,
        /// Scratch space: pg_upgrade's logs and sockets.
        #[arg(long, default_value = "/steward/run/upgrade")]
        work: PathBuf,
    },
}

#[derive(clap::Args)]
struct RunArgs {
    #[arg(long, env = "POD_NAME")]
    pod: String,
    #[arg(long, env = "POD_NAMESPACE")]
    namespace: String,
    #[arg(long, env = "CLUSTER_NAME")]
    cluster: String,
    #[arg(long, env = "PGDATA")]
    pgdata: PathBuf,
    #[arg(
        long,
        env = "PG_CONFIG_FILE",
        default_value = "/etc/steward/postgresql.conf"
    )]
    config_file: PathBuf,
    #[arg(long, env = "STEWARD_RUN_DIR", default_value = "/steward/run")]
    run_dir: PathBuf,
    #[arg(long, env = "PG_TLS_DIR", default_value = "/etc/steward-tls")]
    tls_dir: PathBuf,
    #[arg(long, env = "POSTGRES_PASSWORD", hide_env_values = true)]
    superuser_password: String,
    #[arg(long, env = "REPLICATION_PASSWORD", hide_env_values = true)]
    replication_password: String,
    #[arg(long, env = "LEASE_DURATION", default_value = "10s", value_parser = steward_core::cli::parse_duration)]
    lease_duration: Duration,
    #[arg(long, env = "RENEW_DEADLINE", default_value = "6s", value_parser = steward_core::cli::parse_duration)]
    renew_deadline: Duration,
    #[arg(long, env = "RETRY_PERIOD", default_value = "1s", value_parser = steward_core::cli::parse_duration)]
    retry_period: Duration,
    #[arg(long, env = "STREAM_TIMEOUT", default_value = "20s", value_parser = steward_core::cli::parse_duration)]
    stream_timeout: Duration,
    /// How long the primary's PostgreSQL may leave the health query unanswered (hung,
    /// `SIGSTOP`ped, out of connections) before the instance kills it and gives up the Lease.
    #[arg(long, env = "UNRESPONSIVE_TIMEOUT", default_value = "10s", value_parser = steward_core::cli::parse_duration)]
    unresponsive_timeout: Duration,
    /// Base backups the retention policy keeps (0: all).
    #[arg(long, env = contract::BACKUP_KEEP_ENV, default_value_t = 0)]
    backup_keep: usize,
    /// Restore up to this time (RFC 3339) rather than to the end of the archive.
    #[arg(long, env = contract::RECOVERY_TARGET_TIME_ENV)]
    recovery_target_time: Option<String>,
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let rt = tokio::runtime::Runtime::new()?;
    match cli.command {
        Command::Copy { dir } => {
            let exe = std::env::current_exe()?;
            std::fs::create_dir_all(&dir)?;
            let to = dir.join(steward_pg_instance::contract::BINARY);
            std::fs::copy(&exe, &to).with_context(|| format!("copy to {}", to.display()))?;
            println!("copied {} to {}", exe.display(), to.display());
            Ok(())
        }
        Command::Watchdog => {
            rt.block_on(steward_pg_instance::watchdog::run());
            Ok(())
        }
        Command::Run(args) => rt.block_on(run(*args)),
        Command::ExportBinaries { to } => {
            let major = rt.block_on(steward_pg_instance::upgrade::export(&to))?;
            println!("exported PostgreSQL {major} to {}", to.display());
            Ok(())
        }
        Command::CheckConfig { config, run_dir } => {
            match rt.block_on(steward_pg_instance::postgres::check_config(
                &run_dir, &config,
            )) {
                Ok(()) => {
                    println!("PostgreSQL accepts the configuration");
                    Ok(())
                }
                Err(e) => told(e),
            }
        }
        Command::MajorUpgrade { pgdata, old, work } => {
            match rt.block_on(steward_pg_instance::upgrade::upgrade(&pgdata, &old, &work)) {
                Ok((from, to)) => {
                    println!(
                        "upgraded {} from PostgreSQL {from} to {to}",
                        pgdata.display()
                    );
                    Ok(())
                }
                Err(e) => told(e),
            }
        }
        Command::WalPush { path, name } => {
            let store = store(contract::BACKUP_ENV)?;
            // PostgreSQL runs it in the data directory, `path` relative to it.
            let pgdata = std::env::current_dir().context("the data directory")?;
            rt.block_on(archive::push_wal(&store, &pgdata, &path, &name))
                .with_context(|| format!("archiving {name} to {}", store.config().url()))
        }
        Command::WalFetch {
            name,
            dest,
            from_recovery,
            from_source,
        } => {
            let prefix = if from_source {
                contract::REPLICA_SOURCE_ENV
            } else if from_recovery {
                // A panic's exit status (101) would read as "missing" too, and end the
                // restore early: a panicking restore stops as a failed read does.
                let report = std::panic::take_hook();
                std::panic::set_hook(Box::new(move |info| {
                    report(info);
                    std::process::exit(RESTORE_FAILED);
                }));
                contract::RECOVERY_ENV
            } else {
                contract::BACKUP_ENV
            };
            let fetched = store(prefix).and_then(|store| {
                // The WAL of the system of the data directory it restores into: the server
                // runs it there (`%p` = pg_wal/…), pg_rewind elsewhere (`%p` = <data>/pg_wal/…).
                let pgdata = match dest.parent().and_then(Path::parent) {
                    Some(data) if dest.is_absolute() => data.to_path_buf(),
                    _ => std::env::current_dir().context("the data directory")?,
                };
                let system = archive::system_identifier(&pgdata)?;
                let fetch = archive::fetch_wal(&store, &system, &name, &dest);
                let found = if from_recovery {
                    rt.block_on(fetch)
                } else {
                    rt.block_on(async { tokio::time::timeout(STANDBY_FETCH_TIMEOUT, fetch).await })
                        .unwrap_or_else(|_| {
                            Err(archive::Error::Invalid(format!(
                                "no answer within {STANDBY_FETCH_TIMEOUT:?}"
                            )))
                        })
                };
                found.with_context(|| format!("restoring {name} from {}", store.config().url()))
            });
            match fetched {
                Ok(true) => Ok(()),
                // Not an error: PostgreSQL asks for files that may not exist.
                Ok(false) => std::process::exit(1),
                // A replica: the file counts as missing, so PostgreSQL goes back to streaming
                // from the primary at once instead of waiting on the store.
                Err(e) if !from_recovery => {
                    eprintln!("steward-pg-instance wal-fetch: {e:#}; trying the primary");
                    std::process::exit(1)
                }
                // A restore: "missing" would end recovery here and promote without the rest
                // of the archive. An exit status above 125 makes PostgreSQL stop instead;
                // the instance manager starts it again, and replay resumes where it was.
                Err(e) => {
                    eprintln!(
                        "steward-pg-instance wal-fetch: {e:#}; stopping the restore rather than ending it early"
                    );
                    std::process::exit(RESTORE_FAILED)
                }
            }
        }
    }
}

/// How long a replica's `wal-fetch` may wait on its cluster's object store.
const STANDBY_FETCH_TIMEOUT: Duration = Duration::from_secs(10);

/// `wal-fetch`'s exit status when a restore cannot read its archive: PostgreSQL treats a
/// `restore_command` status above 125 as fatal (as the shell's "command not found" or a
/// signal), any other failure as a file the archive does not have.
const RESTORE_FAILED: i32 = 126;

/// A one-off Job's failure: its reason also goes to `/dev/termination-log`, which the operator
/// shows in the cluster's condition.
fn told<E>(e: E) -> anyhow::Result<()>
where
    E: std::fmt::Display + Into<anyhow::Error>,
{
    let reason: String = format!("{e}").chars().take(3500).collect();
    let _ = std::fs::write("/dev/termination-log", &reason);
    Err(e.into())
}

/// The object store configured under `prefix` in the environment.
fn store(prefix: &str) -> anyhow::Result<Store> {
    let config = StoreConfig::from_env(prefix)?
        .with_context(|| format!("{prefix}_ENDPOINT is not set: no object store configured"))?;
    Ok(Store::open(config)?)
}

async fn run(args: RunArgs) -> anyhow::Result<()> {
    let settings = Settings {
        pod: args.pod,
        namespace: args.namespace,
        cluster: args.cluster,
        paths: Paths {
            pgdata: args.pgdata,
            config_file: args.config_file,
            run_dir: args.run_dir,
            tls_dir: args.tls_dir,
        },
        superuser_password: args.superuser_password,
        replication_password: args.replication_password,
        lease_duration: args.lease_duration,
        renew_deadline: args.renew_deadline,
        retry_period: args.retry_period,
        stream_timeout: args.stream_timeout,
        unresponsive_timeout: args.unresponsive_timeout,
        exe: std::env::current_exe()?,
        backup: StoreConfig::from_env(contract::BACKUP_ENV)
            .map_err(|e| e.to_string())
            .transpose(),
        backup_keep: args.backup_keep,
        recovery: StoreConfig::from_env(contract::RECOVERY_ENV)?,
        replica_source: StoreConfig::from_env(contract::REPLICA_SOURCE_ENV)?,
        recovery_target_time: args.recovery_target_time,
    };
    let client = kube::Client::try_default()
        .await
        .context("a Kubernetes client from the pod's ServiceAccount")?;
    let shutdown = CancellationToken::new();
    let signal = shutdown.clone();
    tokio::spawn(async move {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => return,
            };
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
        tracing::info!("signal received");
        signal.cancel();
    });
    manager::run(settings, client, shutdown).await
}
