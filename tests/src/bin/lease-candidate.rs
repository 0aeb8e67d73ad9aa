//! A leader election candidate for `tests/tests/leader_election.rs`.
//!
//! While it leads (through `run_while_leader`) it performs a leader-only write every 100 ms:
//! it takes the time, checks `Leadership::guard()`, and appends
//! `<identity> <unix-nanos> <term>` to the writes log. SIGTERM (or Ctrl-C) stops the work,
//! then releases the Lease, then exits 0.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use clap::Parser;
use kube::config::{KubeConfigOptions, Kubeconfig};
use steward_core::leader::{LeaderElector, Leadership, LeaseConfig, run_while_leader};
use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;

/// A Steward leader election candidate that logs its leader-only writes.
#[derive(Parser, Debug)]
struct Args {
    kubeconfig: PathBuf,
    namespace: String,
    lease: String,
    identity: String,
    lease_duration_ms: u64,
    renew_deadline_ms: u64,
    retry_period_ms: u64,
    writes_log: PathBuf,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,steward_core=debug")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
    let args = Args::parse();
    let kubeconfig = Kubeconfig::read_from(&args.kubeconfig).context("read kubeconfig")?;
    let client_config =
        kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
            .await
            .context("load kubeconfig")?;
    let client = kube::Client::try_from(client_config).context("build client")?;

    let mut config = LeaseConfig::new(&args.lease, &args.namespace, &args.identity);
    config.lease_duration = Duration::from_millis(args.lease_duration_ms);
    config.renew_deadline = Duration::from_millis(args.renew_deadline_ms);
    config.retry_period = Duration::from_millis(args.retry_period_ms);
    let elector = LeaderElector::new(client, config)?.with_reporter("lease-candidate");
    let leadership = elector.leadership();
    let writes = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&args.writes_log)
        .context("open writes log")?;
    let writes = Arc::new(writes);

    let (work_stop, election_stop) = (CancellationToken::new(), CancellationToken::new());
    let election = tokio::spawn(elector.run(election_stop.clone()));
    let terms = Arc::new(AtomicU64::new(0));
    let work = tokio::spawn(run_while_leader(
        leadership.clone(),
        work_stop.clone(),
        move |token| {
            let term = terms.fetch_add(1, Ordering::SeqCst) + 1;
            write_while_leading(leadership.clone(), token, writes.clone(), term)
        },
    ));

    let mut sigterm = signal(SignalKind::terminate()).context("install SIGTERM handler")?;
    tokio::select! {
        _ = sigterm.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    eprintln!("{}: shutting down", args.identity);
    // Stop the work first, so nothing is written once the Lease is released.
    work_stop.cancel();
    work.await.context("work task")?;
    election_stop.cancel();
    election.await.context("election task")??;
    eprintln!("{}: exiting", args.identity);
    Ok(())
}

async fn write_while_leading(
    leadership: Leadership,
    token: CancellationToken,
    writes: Arc<File>,
    term: u64,
) {
    eprintln!("{}: leading, term {term}", leadership.identity());
    loop {
        tokio::select! {
            () = token.cancelled() => break,
            () = tokio::time::sleep(Duration::from_millis(100)) => {}
        }
        // The time is taken before the check: every line carries a time at which we led.
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        match leadership.guard() {
            Ok(()) => {
                let line = format!("{} {nanos} {term}\n", leadership.identity());
                if let Err(err) = (&*writes).write_all(line.as_bytes()) {
                    eprintln!(
                        "{}: cannot append to the writes log: {err}",
                        leadership.identity()
                    );
                }
            }
            Err(not_leader) => eprintln!("{}: write skipped: {not_leader}", leadership.identity()),
        }
    }
    eprintln!("{}: stopped work of term {term}", leadership.identity());
}
