//! Steward's benchmark harness, the `steward-bench` binary (run as `cargo xtask bench`):
//! Steward's tenant-operator against a controller-runtime reference and a raw-write floor, on
//! one real control plane, in one run. Also the PostgreSQL fault campaign
//! (`cargo xtask chaos postgres`, [`postgres::chaos`]).
//!
//! Start with [`run`]: it builds the subjects (the release `tenant-operator` — debug for
//! `--smoke`, which measures nothing — and the Go reference
//! under `bench/reference-tenant-controller`), starts a control plane, creates the unrelated
//! ConfigMaps and Secrets, and then for each Tenant count and each subject measures, in order:
//! convergence and API load (`workload`, `apiserver`), idle writes, memory, startup and
//! failover (`procs`). Subjects run one after another, each starting from a cluster with
//! none of the previous subject's Tenants or namespaces. Then the tenant-operator scaled out on
//! three replicas with three shards, at the largest Tenant count (`sharded`), the
//! upgrade-orchestrator's overhead (`orchestration`), the other two operators' idle writes
//! (`idle`) and the database-operator scaled out on three replicas (`db_sharded`). A
//! 10 000-Tenant point is `--tenants 1000,10000` (not in the default run; from
//! [`FRESH_CLUSTER_AT`] Tenants on, each subject gets a control plane of its own). `report` writes
//! `docs/benchmarks.md` and `docs/benchmarks.json`. `--postgres N` runs [`postgres`] instead:
//! PostgreSQL failover and switchover on the real node.
//!
//! Its own crate, apart from xtask, so that xtask stays small and quick to build and has no
//! global allocator: this library installs [`cache::Counting`], for the binary and the unit
//! tests alike (nothing else links it).

mod apiserver;
pub mod cache;
mod db_sharded;
mod idle;
mod orchestration;
pub mod postgres;
mod procs;
mod report;
mod sharded;
mod workload;

/// Counts what each thread allocates, for the cache breakdown ([`cache`]).
#[global_allocator]
static ALLOCATOR: cache::Counting = cache::Counting;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use kube::Client;
use serde::Serialize;

use procs::{Launch, Replica};

/// Flags of `cargo xtask bench`.
#[derive(Clone, Debug, Serialize)]
pub struct Args {
    pub smoke: bool,
    pub tenants: Vec<usize>,
    pub namespaces_per_tenant: usize,
    pub unrelated: usize,
    pub idle: Duration,
    pub failovers: usize,
    pub lease: [Duration; 3],
    pub concurrency: usize,
    pub subjects: Vec<String>,
    pub client_go_defaults: bool,
    pub orchestration_components: usize,
    pub idle_objects: usize,
    pub sharded: bool,
    pub db_sharded: usize,
    pub skip_build: bool,
    pub out: PathBuf,
}

/// The command-line flags of `cargo xtask bench`; what is not given takes the full run's
/// default, or the smoke run's with `--smoke`.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct Flags {
    /// The tiny configuration `cargo xtask test` runs (5 Tenants, 5 s idle, 1 failover of
    /// each kind, 4 s / 3 s / 1 s leases): shows that the harness works, measures nothing.
    #[arg(long)]
    pub smoke: bool,
    /// Tenant counts to measure, comma-separated [default: 100,1000].
    #[arg(long, value_delimiter = ',')]
    pub tenants: Option<Vec<usize>>,
    /// Namespaces per Tenant, 1..=26 [default: 1].
    #[arg(long)]
    pub namespaces_per_tenant: Option<usize>,
    /// Unrelated ConfigMaps and Secrets created first [default: 10000].
    #[arg(long)]
    pub unrelated: Option<usize>,
    /// Idle window after convergence, counting writes [default: 300s].
    #[arg(long, value_parser = steward_core::cli::parse_duration)]
    pub idle: Option<Duration>,
    /// Failovers of each kind (SIGKILL, SIGTERM) [default: 20].
    #[arg(long)]
    pub failovers: Option<usize>,
    /// LeaseDuration,RenewDeadline,RetryPeriod [default: 15s,10s,2s].
    #[arg(long, value_delimiter = ',', value_parser = steward_core::cli::parse_duration)]
    pub lease: Option<Vec<Duration>>,
    /// Concurrent reconciles of every subject [default: 8].
    #[arg(long)]
    pub concurrency: Option<usize>,
    /// Subjects to measure, comma-separated [default: floor,steward,controller-runtime].
    #[arg(long, value_delimiter = ',')]
    pub subjects: Option<Vec<String>>,
    /// Run controller-runtime with client-go's default client rate limits (QPS 5, burst 10).
    #[arg(long)]
    pub client_go_defaults: bool,
    /// Deployments in the orchestration scenario's chain [default: 5].
    #[arg(long)]
    pub orchestration_components: Option<usize>,
    /// PostgresClusters, Databases, DatabaseRoles and UpgradePlans in the idle-writes scenario
    /// of the database-operator and upgrade-orchestrator (0 skips it) [default: 100].
    #[arg(long)]
    pub idle_objects: Option<usize>,
    /// Skip scenario 7, the tenant-operator with `--shards 3` on three replicas (run at the
    /// largest Tenant count when `steward` is a subject).
    #[arg(long)]
    pub no_sharded: bool,
    /// Databases, and as many DatabaseRoles, in scenario 8: the database-operator with
    /// `--shards 3` on three replicas, over external servers (0 skips it) [default: 300].
    #[arg(long)]
    pub db_sharded: Option<usize>,
    /// Use the subjects' binaries already built.
    #[arg(long)]
    pub skip_build: bool,
    /// Where to write benchmarks.md and benchmarks.json [default: docs].
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Instead of the tenant benchmark: PostgreSQL failover and switchover on the real node
    /// (as root), this many runs of each scenario; writes benchmarks-postgres.md and .json.
    #[arg(long, value_name = "RUNS")]
    pub postgres: Option<usize>,
}

impl Args {
    /// The run `flags` ask for.
    ///
    /// # Errors
    /// A value out of range.
    pub fn from_flags(flags: Flags) -> Result<Self> {
        let smoke = flags.smoke;
        let lease = match flags.lease {
            Some(v) => v.try_into().map_err(|_| {
                anyhow::anyhow!("--lease takes LeaseDuration,RenewDeadline,RetryPeriod")
            })?,
            None if smoke => [
                Duration::from_secs(4),
                Duration::from_secs(3),
                Duration::from_secs(1),
            ],
            None => [
                Duration::from_secs(15),
                Duration::from_secs(10),
                Duration::from_secs(2),
            ],
        };
        let a = Args {
            smoke,
            tenants: flags
                .tenants
                .unwrap_or_else(|| if smoke { vec![5] } else { vec![100, 1000] }),
            namespaces_per_tenant: flags.namespaces_per_tenant.unwrap_or(1),
            unrelated: flags.unrelated.unwrap_or(if smoke { 100 } else { 10_000 }),
            idle: flags
                .idle
                .unwrap_or(Duration::from_secs(if smoke { 5 } else { 300 })),
            failovers: flags.failovers.unwrap_or(if smoke { 1 } else { 20 }),
            lease,
            concurrency: flags.concurrency.unwrap_or(8),
            subjects: flags.subjects.unwrap_or_else(|| {
                vec![
                    "floor".into(),
                    "steward".into(),
                    "controller-runtime".into(),
                ]
            }),
            client_go_defaults: flags.client_go_defaults,
            orchestration_components: flags.orchestration_components.unwrap_or(5),
            idle_objects: flags.idle_objects.unwrap_or(if smoke { 3 } else { 100 }),
            sharded: !flags.no_sharded,
            db_sharded: flags.db_sharded.unwrap_or(if smoke { 6 } else { 300 }),
            skip_build: flags.skip_build,
            out: flags
                .out
                .unwrap_or_else(|| steward_testenv::workspace_root().join("docs")),
        };
        if a.namespaces_per_tenant == 0 || a.namespaces_per_tenant > 26 {
            bail!("--namespaces-per-tenant must be 1..=26");
        }
        Ok(a)
    }
}

/// One operator implementation under test.
#[derive(Clone, Debug)]
struct Subject {
    /// `floor`, `steward`, `controller-runtime` or `controller-runtime-qps5`.
    name: String,
    /// Prefix of its Tenants' names.
    short: &'static str,
    /// How to start it; `None` for the floor (the harness writes itself).
    launch: Option<Launch>,
    /// The client-side rate limits it runs with, for the table.
    limits: String,
}

/// Everything measured for one subject at one Tenant count.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Measured {
    pub subject: String,
    pub tenants: usize,
    pub client_limits: String,
    pub convergence_secs: f64,
    pub ready_p50_secs: f64,
    pub ready_p99_secs: f64,
    pub load: apiserver::Load,
    pub requests_per_tenant: BTreeMap<String, f64>,
    pub idle_window_secs: f64,
    pub idle: Option<apiserver::Load>,
    pub rss_bytes: Option<u64>,
    /// CPU time the leader used from the first Tenant created until every Tenant was Ready.
    pub convergence_cpu_secs: Option<f64>,
    pub rss_peak_bytes: Option<u64>,
    /// What the tenant-operator's stores hold (steward only).
    pub cache: Option<Vec<cache::Kind>>,
    pub startup: Option<Startup>,
    pub failover: Option<Failover>,
    pub notes: Vec<String>,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct Startup {
    /// Process start → `/readyz` 200 (caches synced).
    pub to_ready_secs: f64,
    /// Process start → the watch delivered a Tenant changed while the operator was down, with
    /// its new generation observed and Ready.
    pub to_first_reconcile_secs: f64,
    /// The difference: first reconcile after cache sync (includes acquiring the free Lease).
    pub after_ready_secs: f64,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct Failover {
    pub lease: [f64; 3],
    /// SIGKILL of the leader → a Tenant changed right after the kill shows the new
    /// generation observed and Ready (seconds, one per repetition).
    pub kill_secs: Vec<f64>,
    /// SIGKILL → the new holder's Lease `acquireTime`.
    pub kill_lease_secs: Vec<f64>,
    pub term_secs: Vec<f64>,
    pub term_lease_secs: Vec<f64>,
}

/// The whole run, as written to `docs/benchmarks.json`.
#[derive(Clone, Debug, Serialize)]
pub struct Results {
    pub args: Args,
    pub environment: report::Environment,
    pub baseline_requests_per_sec: BTreeMap<String, f64>,
    pub runs: Vec<Measured>,
    pub binary_sizes: BTreeMap<String, u64>,
    /// Scenario 5, or why it was not measured.
    pub orchestration: Result<orchestration::Orchestration, String>,
    /// Scenario 6: the other operators' idle writes (each, or why it was not measured).
    pub idle_writes: Vec<Result<idle::IdleWrites, String>>,
    /// Scenario 7: the tenant-operator on three replicas with three shards, or why not.
    pub sharded: Result<sharded::Sharded, String>,
    /// Scenario 8: the database-operator on three replicas with three shards, or why not.
    pub db_sharded: Result<db_sharded::DbSharded, String>,
    pub total_secs: f64,
}

/// Runs the benchmark `flags` ask for and writes its report (`docs/` unless `--out`).
///
/// # Errors
/// A flag out of range, a failed build of a subject, or a control plane that does not start;
/// a subject that fails is reported in the tables instead.
pub fn run(flags: Flags) -> Result<()> {
    if let Some(runs) = flags.postgres {
        let root = steward_testenv::workspace_root();
        let out = flags.out.clone().unwrap_or_else(|| root.join("docs"));
        return postgres::run(&root, runs, &out);
    }
    let args = Args::from_flags(flags)?;
    let started = Instant::now();
    let root = steward_testenv::workspace_root();
    let bench_dir = root.join("target/bench");
    std::fs::create_dir_all(&bench_dir)?;
    let (steward_bin, go_bin, sizes) = build(&root, &bench_dir, &args)?;
    let orchestrator_bin = args.binary(&root, "upgrade-orchestrator");

    let rt = tokio::runtime::Runtime::new()?;
    let results = rt.block_on(async {
        let mut slot = None;
        let cluster = slot.insert(Cluster::start(&root, &args).await?);
        let first_baseline = cluster.baseline.clone();
        let environment = report::environment(&root, cluster.cp.binaries());
        let log_dir = bench_dir.join("logs");
        let _ = std::fs::remove_dir_all(&log_dir);
        let subjects = subjects(&args, &steward_bin, &go_bin, &log_dir);
        let largest = args.tenants.iter().copied().max().unwrap_or(5);

        let mut runs = Vec::new();
        for (ni, &n) in args.tenants.iter().enumerate() {
            for subject in &subjects {
                if subject.name == "controller-runtime-qps5" && ni > 0 {
                    continue;
                }
                let c = cluster_for(&mut slot, &root, &args, n).await?;
                eprintln!("bench: {} with {n} Tenants", subject.name);
                let failovers = n == largest && !args.tenants[..ni].contains(&n);
                let m = match measure(&args, c, subject, n, failovers).await {
                    Ok(m) => m,
                    Err(e) => {
                        // Report what failed and go on with a clean cluster.
                        eprintln!("bench: {} with {n} Tenants FAILED: {e:#}", subject.name);
                        c.after_failure(&format!("{}{n}", subject.short), n).await;
                        Measured {
                            subject: subject.name.clone(),
                            tenants: n,
                            client_limits: subject.limits.clone(),
                            convergence_secs: f64::NAN,
                            notes: vec![format!("FAILED: {e:#}")],
                            ..Default::default()
                        }
                    }
                };
                eprintln!(
                    "bench: {} with {n} Tenants: converged in {:.2}s",
                    subject.name, m.convergence_secs
                );
                runs.push(m);
                // Partial results survive a failure later in the run.
                let partial = bench_dir.join("partial.json");
                std::fs::write(&partial, serde_json::to_string_pretty(&runs)?)?;
            }
        }
        let steward = subjects.iter().find(|s| s.name == "steward");
        let sharded = match (args.sharded, steward.and_then(|s| s.launch.as_ref())) {
            (true, Some(launch)) => {
                let n = largest;
                let c = cluster_for(&mut slot, &root, &args, n).await?;
                eprintln!(
                    "bench: tenant-operator with {n} Tenants, {} shards on {} replicas",
                    sharded::SHARDS,
                    sharded::SHARDS
                );
                let r = sharded::measure(&args, c, launch, n)
                    .await
                    .map_err(|e| format!("not measured: {e:#}"));
                if let Err(e) = &r {
                    eprintln!("bench: sharded {e}");
                    c.after_failure(&format!("sh{n}"), n).await;
                }
                r
            }
            (false, _) => Err("not measured (--no-sharded)".to_string()),
            (true, None) => Err("not measured (steward is not a subject)".to_string()),
        };
        let (orchestration, idle_writes) =
            if args.orchestration_components > 1 || args.idle_objects > 0 {
                let cluster = cluster_for(&mut slot, &root, &args, 0).await?;
                others(&args, cluster, &root, &orchestrator_bin, &log_dir).await
            } else {
                let not = "not measured (--orchestration-components 0)";
                (Err(not.to_string()), Vec::new())
            };
        let db_sharded = if args.db_sharded > 0 {
            let n = args.db_sharded;
            let c = cluster_for(&mut slot, &root, &args, 0).await?;
            eprintln!(
                "bench: database-operator with {n} Databases and DatabaseRoles, {} shards on {} replicas",
                sharded::SHARDS,
                sharded::SHARDS
            );
            let r = db_sharded::measure(
                &c.client,
                &args.binary(&root, "database-operator"),
                &log_dir,
                c.cp.kubeconfig_path(),
                n,
            )
            .await
            .map_err(|e| format!("not measured: {e:#}"));
            match &r {
                Ok(m) => eprintln!(
                    "bench: database-operator sharded: converged in {:.2}s, one writer per shard: {}",
                    m.convergence_secs,
                    m.one_writer_per_shard()
                ),
                // The last scenario: what it leaves (its namespace) no other scenario meets.
                Err(e) => eprintln!("bench: database-operator sharded {e}"),
            }
            r
        } else {
            Err("not measured (--db-sharded 0)".to_string())
        };
        anyhow::Ok(Results {
            args: args.clone(),
            environment,
            baseline_requests_per_sec: first_baseline
                .into_iter()
                .map(|((v, r, s), x)| {
                    (
                        format!("{v} {r}{}{s}", if s.is_empty() { "" } else { "/" }),
                        x,
                    )
                })
                .collect(),
            runs,
            binary_sizes: sizes,
            orchestration,
            idle_writes,
            sharded,
            db_sharded,
            total_secs: 0.0,
        })
    })?;
    let mut results = results;
    results.total_secs = started.elapsed().as_secs_f64();
    report::write(&args.out, &results)?;
    eprintln!(
        "bench: wrote {} in {:.0?}",
        args.out.join("benchmarks.md").display(),
        started.elapsed()
    );
    Ok(())
}

/// `cargo` in the workspace, for a build made once (the subjects): no incremental state, in
/// the environment `cargo xtask test`'s builds have, so they share every artifact.
fn cargo_once() -> std::process::Command {
    let mut cmd = steward_testenv::harness::cargo_command();
    cmd.current_dir(steward_testenv::workspace_root())
        .env("CARGO_INCREMENTAL", "0");
    cmd
}

/// Scenarios 5 and 6: the upgrade-orchestrator's overhead and the other operators' idle
/// writes, each or why it was not measured.
async fn others(
    args: &Args,
    cluster: &Cluster,
    root: &Path,
    orchestrator_bin: &Path,
    log_dir: &Path,
) -> (
    Result<orchestration::Orchestration, String>,
    Vec<Result<idle::IdleWrites, String>>,
) {
    let (client, cp, baseline) = (&cluster.client, &cluster.cp, &cluster.baseline);
    let orchestration = if args.orchestration_components > 1 {
        eprintln!(
            "bench: upgrade-orchestrator with {} chained Deployments",
            args.orchestration_components
        );
        orchestration::measure(
            client,
            orchestrator_bin,
            log_dir,
            cp.kubeconfig_path(),
            args.orchestration_components,
        )
        .await
        .map_err(|e| format!("not measured: {e:#}"))
    } else {
        Err("not measured (--orchestration-components 0)".to_string())
    };
    if let Err(e) = &orchestration {
        eprintln!("bench: orchestration {e}");
    }
    let mut idle_writes = Vec::new();
    if args.idle_objects > 0 {
        let n = args.idle_objects;
        eprintln!("bench: database-operator idle writes with {n} of each kind");
        let db = idle::database_operator(
            client,
            baseline,
            &args.binary(root, "database-operator"),
            log_dir,
            cp.kubeconfig_path(),
            n,
            args.idle,
        )
        .await
        .map_err(|e| format!("database-operator not measured: {e:#}"));
        eprintln!("bench: upgrade-orchestrator idle writes with {n} plans");
        let up = idle::upgrade_orchestrator(
            client,
            baseline,
            orchestrator_bin,
            log_dir,
            cp.kubeconfig_path(),
            n,
            args.idle,
        )
        .await
        .map_err(|e| format!("upgrade-orchestrator not measured: {e:#}"));
        for r in [&db, &up] {
            match r {
                Ok(w) => eprintln!(
                    "bench: {} idle: {:.0} writes, {:?} SQL changes",
                    w.operator,
                    w.total_writes(),
                    w.sql_changes
                ),
                Err(e) => eprintln!("bench: {e}"),
            }
        }
        idle_writes = vec![db, up];
    }
    (orchestration, idle_writes)
}

impl Args {
    /// The operator binary `name` under test: built for release when measuring; a debug build
    /// for the smoke run, which measures nothing and so skips a release build with LTO (about 7
    /// of its 10 minutes on 2 cores).
    fn binary(&self, root: &Path, name: &str) -> PathBuf {
        let profile = if self.smoke { "debug" } else { "release" };
        root.join("target").join(profile).join(name)
    }
}

/// Builds the tenant-operator and upgrade-orchestrator (release, or debug for `--smoke`) and the
/// Go reference; returns their paths and sizes.
fn build(
    root: &Path,
    bench_dir: &Path,
    args: &Args,
) -> Result<(PathBuf, PathBuf, BTreeMap<String, u64>)> {
    let steward = args.binary(root, "tenant-operator");
    let go = bench_dir.join("reference-tenant-controller");
    let go_stripped = bench_dir.join("reference-tenant-controller-stripped");
    if !args.skip_build {
        if args.subjects.iter().any(|s| s == "steward") {
            if args.smoke {
                // As the tests build them (and in `cargo xtask test`'s environment), so it
                // shares their dependencies.
                let args = steward_testenv::harness::CARGO_BUILD;
                eprintln!("bench: cargo {}", args.join(" "));
                if !cargo_once().args(args).status()?.success() {
                    bail!("building the operators failed");
                }
            } else {
                eprintln!(
                    "bench: cargo build --release -p tenant-operator -p upgrade-orchestrator -p database-operator"
                );
                let status = cargo_once()
                    .args(["build", "--release"])
                    .args([
                        "-p",
                        "tenant-operator",
                        "-p",
                        "upgrade-orchestrator",
                        "-p",
                        "database-operator",
                    ])
                    .status()?;
                if !status.success() {
                    bail!("building tenant-operator failed");
                }
            }
        }
        let src = root.join("bench/reference-tenant-controller");
        for (out, flags) in [(&go, ""), (&go_stripped, "-s -w")] {
            eprintln!("bench: go build -ldflags={flags:?} {}", src.display());
            let status = std::process::Command::new("go")
                .current_dir(&src)
                .args(["build", "-trimpath", &format!("-ldflags={flags}"), "-o"])
                .arg(out)
                .arg(".")
                .status()
                .context("running go build")?;
            if !status.success() {
                bail!("building the controller-runtime reference failed");
            }
        }
    }
    let mut sizes = BTreeMap::new();
    let kind = if args.smoke {
        "debug: smoke run"
    } else {
        "release, stripped"
    };
    for (name, path) in [
        (format!("steward tenant-operator ({kind})"), &steward),
        (
            format!("steward upgrade-orchestrator ({kind})"),
            &args.binary(root, "upgrade-orchestrator"),
        ),
        ("controller-runtime reference (go build)".to_string(), &go),
        (
            "controller-runtime reference (-ldflags='-s -w')".to_string(),
            &go_stripped,
        ),
    ] {
        if let Ok(meta) = std::fs::metadata(path) {
            sizes.insert(name, meta.len());
        }
    }
    Ok((steward, go, sizes))
}

fn subjects(args: &Args, steward: &Path, go: &Path, log_dir: &Path) -> Vec<Subject> {
    let fmt = |d: Duration| format!("{}ms", d.as_millis());
    let common = |id: &str| {
        vec![
            "--leader-elect=true".to_string(),
            "--leader-election-namespace=default".into(),
            format!("--leader-election-id={id}"),
            format!("--leader-election-lease-duration={}", fmt(args.lease[0])),
            format!("--leader-election-renew-deadline={}", fmt(args.lease[1])),
            format!("--leader-election-retry-period={}", fmt(args.lease[2])),
            format!("--concurrency={}", args.concurrency),
        ]
    };
    let mut out = Vec::new();
    for name in &args.subjects {
        match name.as_str() {
            "floor" => out.push(Subject {
                name: name.clone(),
                short: "fl",
                launch: None,
                limits: format!("none (kube-rs), {} writers", args.concurrency),
            }),
            "steward" => {
                let mut a = common("bench-steward");
                // The admission policies stay in the cluster and would tax every later
                // subject's writes; the reference has none.
                a.extend([
                    "--apply-policies=false".to_string(),
                    "--log-level=warn".into(),
                ]);
                out.push(Subject {
                    name: name.clone(),
                    short: "st",
                    launch: Some(Launch {
                        binary: steward.to_path_buf(),
                        args: a,
                        log_dir: log_dir.to_path_buf(),
                        label: "steward".into(),
                    }),
                    limits: "none (kube-rs has no client-side limiter)".into(),
                });
            }
            "controller-runtime" => {
                let mut a = common("bench-controller-runtime");
                a.extend([
                    "--kube-api-qps=-1".to_string(),
                    "--zap-log-level=error".into(),
                ]);
                out.push(Subject {
                    name: name.clone(),
                    short: "cr",
                    launch: Some(Launch {
                        binary: go.to_path_buf(),
                        args: a,
                        log_dir: log_dir.to_path_buf(),
                        label: "controller-runtime".into(),
                    }),
                    limits: "none (QPS -1, controller-runtime v0.25 default)".into(),
                });
            }
            _ => eprintln!("bench: unknown subject {name}, skipped"),
        }
    }
    if args.client_go_defaults {
        let mut a = common("bench-controller-runtime-qps5");
        a.extend([
            "--kube-api-qps=5".to_string(),
            "--kube-api-burst=10".into(),
            "--zap-log-level=error".into(),
        ]);
        out.push(Subject {
            name: "controller-runtime-qps5".into(),
            short: "cq",
            launch: Some(Launch {
                binary: go.to_path_buf(),
                args: a,
                log_dir: log_dir.to_path_buf(),
                label: "controller-runtime-qps5".into(),
            }),
            limits: "QPS 5, burst 10 (client-go defaults)".into(),
        });
    }
    out
}

/// From this many Tenants on, each subject (and scenario 7) runs on a control plane of its
/// own, started with the same unrelated objects, and leaves its objects behind: deleting
/// 10 000 namespaces takes the namespace controller tens of minutes on 2 cores, and a
/// deletion still running would load the next subject's window.
pub const FRESH_CLUSTER_AT: usize = 5000;

/// The control plane the scenarios run on, with the unrelated objects and the background
/// request rate measured on it.
struct Cluster {
    cp: steward_testenv::ControlPlane,
    client: Client,
    baseline: BTreeMap<apiserver::Key, f64>,
    /// A scenario ran on it.
    used: bool,
    /// A scenario left its objects behind: the next one needs a fresh control plane.
    dirty: bool,
}

impl Cluster {
    async fn start(root: &Path, args: &Args) -> Result<Self> {
        eprintln!("bench: starting the control plane");
        let cp = steward_testenv::ControlPlane::start(steward_testenv::Options::default()).await?;
        let client = cp.client()?;
        cp.install_crds(&root.join("crds")).await?;
        eprintln!(
            "bench: creating {} unrelated ConfigMaps and Secrets",
            args.unrelated
        );
        let t = Instant::now();
        workload::create_unrelated(&client, args.unrelated).await?;
        eprintln!("bench: unrelated objects created in {:.1?}", t.elapsed());
        eprintln!("bench: measuring the background request rate");
        let baseline = apiserver::baseline(
            &client,
            Duration::from_secs(if args.smoke { 5 } else { 20 }),
        )
        .await?;
        Ok(Self {
            cp,
            client,
            baseline,
            used: false,
            dirty: false,
        })
    }

    /// Deletes run `run`'s `n` Tenants and namespaces (through the operator's finalizers when
    /// `operator_running`), unless the scenario has this control plane to itself: then it is
    /// replaced instead ([`cluster_for`]).
    async fn clean_up(&self, run: &str, operator_running: bool, n: usize) -> Result<()> {
        if self.dirty {
            return Ok(());
        }
        workload::cleanup(
            &self.client,
            run,
            operator_running,
            workload::cleanup_timeout(n),
        )
        .await
    }

    /// [`Cluster::clean_up`] after a scenario failed, its operator stopped; a failure to clean
    /// up is reported, and the run goes on.
    async fn after_failure(&self, run: &str, n: usize) {
        if let Err(e) = self.clean_up(run, false, n).await {
            eprintln!("bench: cleanup after the failure failed too: {e:#}");
        }
    }
}

/// The control plane for a scenario with `n` Tenants. From [`FRESH_CLUSTER_AT`] Tenants on,
/// the scenario gets a control plane nothing ran on and leaves its objects; below, it shares
/// one with the others and cleans up ([`Cluster::clean_up`]). A
/// control plane a scenario left objects on is replaced (stopped before its successor starts:
/// they would share 2 cores).
async fn cluster_for<'a>(
    slot: &'a mut Option<Cluster>,
    root: &Path,
    args: &Args,
    n: usize,
) -> Result<&'a Cluster> {
    let own = n >= FRESH_CLUSTER_AT;
    if let Some(old) = slot.take_if(|c| c.dirty || (own && c.used)) {
        eprintln!("bench: replacing the control plane");
        drop(old);
    }
    if slot.is_none() {
        *slot = Some(Cluster::start(root, args).await?);
    }
    let cluster = slot.as_mut().context("no control plane")?;
    cluster.used = true;
    cluster.dirty = own;
    Ok(cluster)
}

/// Measures `subject` at `n` Tenants on `cluster`; failover only when `failovers` (it takes
/// LeaseDuration per repetition, so it runs at one Tenant count); then [`Cluster::clean_up`].
async fn measure(
    args: &Args,
    cluster: &Cluster,
    subject: &Subject,
    n: usize,
    failovers: bool,
) -> Result<Measured> {
    let (cp, client, baseline) = (&cluster.cp, &cluster.client, &cluster.baseline);
    let run = format!("{}{n}", subject.short);
    let mut m = Measured {
        subject: subject.name.clone(),
        tenants: n,
        client_limits: subject.limits.clone(),
        ..Default::default()
    };
    let (tracker, watch) = workload::Tracker::start(client, &run);
    let timeout = Duration::from_secs(120 + n as u64);
    // What the harness itself sends during the convergence window, removed from the counts.
    let harness: BTreeMap<apiserver::Key, f64> =
        BTreeMap::from([(("POST".into(), "tenants".into(), String::new()), n as f64)]);
    let per_tenant = |load: &apiserver::Load| {
        load.by_verb
            .iter()
            .map(|(k, v)| (k.clone(), v / n as f64))
            .collect()
    };

    let Some(launch) = &subject.launch else {
        // The floor.
        tokio::time::sleep(Duration::from_secs(1)).await;
        let m0 = apiserver::read(client).await?;
        let t0 = Instant::now();
        workload::floor(
            client,
            &run,
            n,
            args.namespaces_per_tenant,
            args.concurrency,
        )
        .await?;
        let ready = tracker.wait_all_ready(n, timeout).await?;
        let m1 = apiserver::read(client).await?;
        fill_convergence(&mut m, t0, &ready);
        m.load = apiserver::load(&apiserver::delta(&m0, &m1, baseline), &harness);
        m.requests_per_tenant = per_tenant(&m.load);
        m.notes.push(
            "the harness writes the objects itself: load counts the floor's own requests".into(),
        );
        watch.abort();
        cluster.clean_up(&run, false, n).await?;
        return Ok(m);
    };

    let kubeconfig = cp.kubeconfig_path();
    let mut index = 0;
    let mut leader = Replica::spawn(launch, kubeconfig, index)?;
    index += 1;
    leader.wait_ready(Duration::from_secs(120)).await?;
    tokio::time::sleep(Duration::from_secs(2)).await;

    // 1–2. Convergence and API load.
    let m0 = apiserver::read(client).await?;
    let cpu0 = leader.cpu_secs()?;
    let t0 = Instant::now();
    workload::create_tenants(client, &run, n, args.namespaces_per_tenant, None).await?;
    let ready = tracker.wait_all_ready(n, timeout).await?;
    m.convergence_cpu_secs = Some(leader.cpu_secs()? - cpu0);
    let m1 = apiserver::read(client).await?;
    fill_convergence(&mut m, t0, &ready);
    m.load = apiserver::load(&apiserver::delta(&m0, &m1, baseline), &harness);
    m.requests_per_tenant = per_tenant(&m.load);

    // Idle writes.
    if subject.name != "controller-runtime-qps5" {
        eprintln!("bench: {}: idle for {:?}", subject.name, args.idle);
        tokio::time::sleep(args.idle).await;
        let m2 = apiserver::read(client).await?;
        m.idle_window_secs = m2.at.duration_since(m1.at).as_secs_f64();
        m.idle = Some(apiserver::load(
            &apiserver::delta(&m1, &m2, baseline),
            &BTreeMap::new(),
        ));

        // 3. Memory, after convergence and the idle window.
        let (rss, hwm) = leader.memory()?;
        m.rss_bytes = Some(rss);
        m.rss_peak_bytes = Some(hwm);
        if subject.name == "steward" {
            match cache::tenant_operator(client).await {
                Ok(kinds) => m.cache = Some(kinds),
                Err(e) => m.notes.push(format!("cache breakdown not measured: {e:#}")),
            }
        }

        // 6. Startup: stop, change a Tenant while down, start, time the first reconcile.
        let name = workload::tenant_name(&run, 0);
        leader.stop().await?;
        let generation = workload::bump(client, &name, 1_000_000).await?;
        let mut fresh = Replica::spawn(launch, kubeconfig, index)?;
        index += 1;
        let spawned = fresh.started;
        let ready_at = fresh.wait_ready(Duration::from_secs(120)).await?;
        let reconciled = tracker.wait_observed(&name, generation, timeout).await?;
        m.startup = Some(Startup {
            to_ready_secs: ready_at.duration_since(spawned).as_secs_f64(),
            to_first_reconcile_secs: reconciled.saturating_duration_since(spawned).as_secs_f64(),
            after_ready_secs: reconciled.saturating_duration_since(ready_at).as_secs_f64(),
        });
        leader = fresh;

        // 4. Failover (at the largest Tenant count only: it takes LeaseDuration per repetition).
        if failovers && args.failovers > 0 {
            let f = failover(
                args, client, launch, kubeconfig, &tracker, n, &name, leader, &mut index,
            )
            .await?;
            m.failover = Some(f.0);
            leader = f.1;
        }
    }

    cluster.clean_up(&run, true, n).await?;
    watch.abort();
    leader.stop().await?;
    Ok(m)
}

fn fill_convergence(m: &mut Measured, t0: Instant, ready: &[Instant]) {
    let mut secs: Vec<f64> = ready
        .iter()
        .map(|t| t.saturating_duration_since(t0).as_secs_f64())
        .collect();
    secs.sort_by(|a, b| a.total_cmp(b));
    m.convergence_secs = secs.last().copied().unwrap_or(f64::NAN);
    m.ready_p50_secs = workload::percentile(&secs, 50.0);
    m.ready_p99_secs = workload::percentile(&secs, 99.0);
}

/// Two replicas; `args.failovers` times each: signal the leader, change a Tenant, time until
/// its new generation is observed; restart the signalled replica as the new standby.
#[allow(clippy::too_many_arguments)]
async fn failover(
    args: &Args,
    client: &Client,
    launch: &Launch,
    kubeconfig: &Path,
    tracker: &workload::Tracker,
    n: usize,
    tenant: &str,
    first: Replica,
    index: &mut usize,
) -> Result<(Failover, Replica)> {
    use k8s_openapi::api::coordination::v1::Lease;
    let leases: kube::Api<Lease> = kube::Api::namespaced(client.clone(), "default");
    let lease_name = launch
        .args
        .iter()
        .find_map(|a| a.strip_prefix("--leader-election-id="))
        .unwrap_or_default()
        .to_string();
    let mut replicas = vec![first, Replica::spawn(launch, kubeconfig, *index)?];
    *index += 1;
    replicas[1].wait_ready(Duration::from_secs(120)).await?;
    let mut f = Failover {
        lease: args.lease.map(|d| d.as_secs_f64()),
        ..Default::default()
    };
    let mut bump = 2_000_000;
    for signal in ["KILL", "TERM"] {
        for rep in 0..args.failovers {
            // The current leader, once exactly one replica says so.
            let deadline = Instant::now() + Duration::from_secs(60);
            let leader_idx = loop {
                let a = replicas[0].is_leader().await;
                let b = replicas[1].is_leader().await;
                match (a, b) {
                    (true, false) => break 0,
                    (false, true) => break 1,
                    _ if Instant::now() > deadline => {
                        bail!("no single leader after 60s (replica 0: {a}, replica 1: {b})")
                    }
                    _ => tokio::time::sleep(Duration::from_millis(100)).await,
                }
            };
            // Signal at a random moment in the standby's steady state, not right after it
            // started: its first read of the Lease would otherwise coincide with the signal
            // and every failover would take exactly LeaseDuration.
            let retry = args.lease[2];
            tokio::time::sleep(retry.mul_f64(1.5 + 2.0 * rand::random::<f64>())).await;
            let wall0 = k8s_openapi::jiff::Timestamp::now();
            let t0 = Instant::now();
            replicas[leader_idx].signal(signal)?;
            bump += 1;
            let generation = workload::bump(client, tenant, bump).await?;
            let observed = tracker
                .wait_observed(tenant, generation, workload::resync_timeout(n))
                .await?;
            let secs = observed.saturating_duration_since(t0).as_secs_f64();
            let lease = leases.get(&lease_name).await?;
            let acquired = lease
                .spec
                .and_then(|s| s.acquire_time)
                .map(|t| t.0.duration_since(wall0).as_secs_f64())
                .unwrap_or(f64::NAN);
            eprintln!(
                "bench: failover {signal} #{rep}: reconciled after {secs:.2}s, lease acquired after {acquired:.2}s"
            );
            if signal == "KILL" {
                f.kill_secs.push(secs);
                f.kill_lease_secs.push(acquired);
            } else {
                f.term_secs.push(secs);
                f.term_lease_secs.push(acquired);
            }
            replicas[leader_idx]
                .wait_exit(Duration::from_secs(60))
                .await?;
            let mut fresh = Replica::spawn(launch, kubeconfig, *index)?;
            *index += 1;
            fresh.wait_ready(Duration::from_secs(120)).await?;
            replicas[leader_idx] = fresh;
        }
    }
    // Keep the current leader; stop the standby.
    let leader_idx = if replicas[0].is_leader().await { 0 } else { 1 };
    let standby = replicas.remove(1 - leader_idx);
    standby.stop().await?;
    Ok((f, replicas.remove(0)))
}
