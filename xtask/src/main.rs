//! Project automation, run as `cargo xtask <command>` (`cargo xtask --help` lists the
//! commands, `cargo xtask <command> --help` their flags):
//!
//! - `crdgen [--check]`: write `crds/*.yaml` from the Rust types (or fail if they are stale).
//! - `helm [--check]`: write `charts/steward/` from `deploy/` and `crds/` (see `helm.rs`).
//! - `test`: everything CI runs: unit tests, `crdgen --check`, `helm --check`, integration tests
//!   against a real control plane (building it first if it is not cached).
//! - `testenv [--real-node]`: start the control plane (with a real node) and print the
//!   kubeconfig path; Ctrl-C stops it.
//! - `up`: the control plane with a real node, the operators deployed as their images by
//!   `deploy/`, and `deploy/samples/` (see `up.rs`).
//! - `image [OPERATOR|all]`: operator images.
//! - `bench`, `chaos`: run `steward-bench` (`crates/bench`), the benchmark harness and the
//!   PostgreSQL fault campaign, with the arguments given.
//! - `new-operator <name>`: scaffold and register a new operator crate (see `new_operator.rs`).

mod crdgen;
mod generated;
mod helm;
mod image;
mod kustomize;
mod new_operator;
mod prerequisites;
mod testrun;
mod up;

use std::process::Command;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};

/// Project automation for Steward.
#[derive(Parser)]
#[command(name = "cargo xtask", bin_name = "cargo xtask")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Write crds/ from the Rust types.
    Crdgen {
        /// Fail if crds/ is stale instead of writing it.
        #[arg(long)]
        check: bool,
    },
    /// Write charts/steward/ from deploy/ and crds/.
    Helm {
        /// Fail if the chart is stale instead of writing it.
        #[arg(long)]
        check: bool,
    },
    /// Unit tests, crdgen --check, helm --check, integration tests against a real control plane (built
    /// first if not cached), then the benchmark harness in its smoke configuration.
    Test {
        /// Passed to `cargo test` (then the smoke benchmark is skipped); after `--`, to the
        /// test binaries. Each test binary is killed after 15 min
        /// (`STEWARD_TEST_BINARY_TIMEOUT` seconds).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Start a local control plane and print its kubeconfig; Ctrl-C stops it.
    Testenv {
        /// Also start a real node (kubelet, containerd, CNI, kube-proxy, CoreDNS).
        #[arg(long)]
        real_node: bool,
        /// Start N real nodes instead (each in a network namespace and a zone of its own).
        #[arg(long, value_name = "N")]
        real_nodes: Option<usize>,
    },
    /// A control plane with a real node, the CRDs, the operators as their images (deploy/)
    /// and the samples; Ctrl-C stops.
    Up {
        /// Stop once every sample is Ready (after the summary) instead of waiting for Ctrl-C;
        /// fail if one is not.
        #[arg(long)]
        check: bool,
        /// Real nodes to run on (more than one: each in a network namespace and a zone of its
        /// own; the PostgresCluster's instances on different nodes).
        #[arg(long, default_value_t = 1, value_name = "N")]
        nodes: usize,
    },
    /// A new operator crate (sample CRD, working reconcile, deploy/, sample, integration
    /// test), registered in the workspace; then crdgen.
    NewOperator {
        /// The operator's name, a DNS label such as `cache-operator`.
        name: String,
    },
    /// Benchmarks against controller-runtime; writes docs/benchmarks.md (`steward-bench`;
    /// `cargo xtask bench --help` for its flags).
    #[command(disable_help_flag = true)]
    Bench {
        /// Passed to `steward-bench`.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// A seeded fault campaign on the real node (as root): `cargo xtask chaos postgres --seed S
    /// --steps N` (`steward-bench chaos`; `cargo xtask chaos --help` for its flags).
    #[command(disable_help_flag = true)]
    Chaos {
        /// Passed to `steward-bench chaos`.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Build an OCI image archive (no daemon) into target/images/.
    Image {
        /// An operator of the registry, or all of them when omitted.
        operator: Option<String>,
    },
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Cmd::Crdgen { check } => crdgen::run(check),
        Cmd::Helm { check } => helm::run(check),
        Cmd::Test { args } => test(&args.iter().map(String::as_str).collect::<Vec<_>>()),
        Cmd::Testenv {
            real_node,
            real_nodes,
        } => testenv(real_nodes.unwrap_or(usize::from(real_node))),
        Cmd::Up { check, nodes } => up::run(check, nodes),
        Cmd::NewOperator { name } => new_operator::run(&name),
        Cmd::Bench { args } => bench(&[], &args),
        Cmd::Chaos { args } => bench(&["chaos"], &args),
        Cmd::Image { operator } => match operator.as_deref() {
            None | Some("all") => steward_operators::names()
                .into_iter()
                .try_for_each(|op| image::run(op).map(|_| ())),
            Some(op) => image::run(op).map(|_| ()),
        },
    }
}

/// Runs `steward-bench <subcommand> <args>` by `cargo run`, a dev build as `cargo xtask`'s own,
/// from the directory `cargo xtask` was run in (an `--out` is relative to it); exits with its
/// status when it fails (its own message is the error).
fn bench(subcommand: &[&str], args: &[String]) -> Result<()> {
    let status = steward_testenv::harness::cargo_command()
        .args([
            "run",
            "--quiet",
            "--package",
            "steward-bench",
            "--manifest-path",
        ])
        .arg(workspace_root().join("Cargo.toml"))
        .arg("--")
        .args(subcommand)
        .args(args)
        .status()
        .context("running cargo run --package steward-bench")?;
    if !status.success() {
        std::process::exit(status.code().unwrap_or(1));
    }
    Ok(())
}

fn workspace_root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `cargo` in the workspace, in the environment a user's own `cargo build` has (see
/// [`steward_testenv::harness::cargo_command`]), so the two share every artifact.
fn cargo() -> Command {
    let mut cmd = steward_testenv::harness::cargo_command();
    cmd.current_dir(workspace_root());
    cmd
}

/// The environment of a build made once and thrown away with its run (the test build, the
/// builds tests start such as the scaffold test's, the smoke bench): no incremental state,
/// which would only take disk (about half of a fresh target directory) and time.
const BUILT_ONCE: [(&str, &str); 1] = [("CARGO_INCREMENTAL", "0")];

/// [`cargo`] for a build made once (see [`BUILT_ONCE`]).
fn cargo_once() -> Command {
    let mut cmd = cargo();
    cmd.envs(BUILT_ONCE);
    cmd
}

/// Runs every test. The Go builds (control plane, real node, Helm, the collector: about 16
/// minutes of one core cold) start first, taken by two
/// background workers, so they overlap each other, the Debian packages and the Rust build of
/// the tests; the tests start once all are done, the smoke benchmark beside the real node's
/// lane. Ends with
/// a table of where the time went.
fn test(extra: &[&str]) -> Result<()> {
    let started = std::time::Instant::now();
    let phases = Phases::default();
    let result = test_phases(extra, &phases);
    phases.print(started.elapsed());
    result
}

fn test_phases(extra: &[&str], phases: &Phases) -> Result<()> {
    phases.time("crdgen --check", || crdgen::run(true))?;
    eprintln!("xtask: crds/ is up to date");

    // Two workers take the builds longest first (cold on 2 cores beside the Rust build, at
    // 95fff27: kubernetes, etcd and kwok 16 min, containerd and CoreDNS 4.5, Helm 2.7, the
    // collector 0.6); each build is cached apart, a warm one takes milliseconds. Prometheus
    // comes from Debian's packages, the backup tests' S3 server from Maven Central.
    let go_builds = GoBuilds::start(2);
    let packages = phases.time("Debian packages", || {
        prerequisites::ensure_postgres()?;
        prerequisites::ensure_node_packages()
    });
    let go_builds = || -> Result<()> {
        go_builds.wait(phases)?;
        let binaries = steward_testenv::binaries::ensure().context("the control plane")?;
        let node = steward_testenv::binaries::ensure_node().context("the real node")?;
        // Debian's, installed with the packages; built from Go modules only where apt could
        // not install it.
        phases.time("Prometheus", || {
            steward_testenv::binaries::prometheus().context("Prometheus")
        })?;
        eprintln!(
            "xtask: control plane ready: kubernetes {}, etcd {}, kwok {}, containerd {}, CoreDNS {} ({})",
            binaries.versions.kubernetes,
            binaries.versions.etcd,
            binaries.versions.kwok,
            node.containerd_version,
            node.coredns_version,
            binaries.versions.go
        );
        phases.time("helm --check", || helm::run(true))?;
        eprintln!("xtask: {} is up to date", helm::CHART);
        Ok(())
    };
    // The benchmark harness in its tiny configuration, so it does not rot; it asserts no
    // timing, so it runs beside the tests (it has a control plane of its own). Skipped when
    // the run is narrowed to some tests. Its binary is built with the tests.
    let out = workspace_root().join("target/bench-smoke");
    let bench = extra.is_empty().then(|| testrun::SideJob {
        name: "bench --smoke",
        binary: "steward-bench",
        args: vec!["--smoke".into(), "--out".into(), out.display().to_string()],
    });
    let ran_bench = bench.is_some();
    match packages {
        Ok(()) => testrun::run(extra, go_builds, bench, phases)?,
        // Still wait for the Go builds: they are cached for the next run.
        Err(e) => {
            let _ = go_builds();
            return Err(e);
        }
    }
    if ran_bench {
        eprintln!("xtask: bench --smoke wrote {}/benchmarks.md", out.display());
    }
    Ok(())
}

/// The Go builds, run by worker threads in the background while the rest of `test` goes on.
struct GoBuilds {
    workers: Vec<std::thread::JoinHandle<Vec<Built>>>,
}

/// One Go build: its name in the time table and the call that builds it unless cached.
type GoBuild = (&'static str, fn() -> Result<()>);

/// A Go build done: its name, how long it took, how it ended.
type Built = (&'static str, std::time::Duration, Result<()>);

/// Longest first (cold), so the workers end about together: one takes kubernetes, the other
/// everything else.
const GO_BUILDS: [GoBuild; 5] = [
    ("Go: kubernetes", || {
        steward_testenv::binaries::kubernetes().context("building kubernetes")
    }),
    ("Go: containerd, CoreDNS", || {
        steward_testenv::binaries::ensure_node()
            .map(|_| ())
            .context("building the real node")
    }),
    ("Go: etcd, kwok", || {
        steward_testenv::binaries::etcd_and_kwok().context("building etcd and kwok")
    }),
    ("Go: Helm", || {
        steward_testenv::binaries::helm()
            .map(|_| ())
            .context("building Helm")
    }),
    ("Go: OpenTelemetry Collector", || {
        steward_testenv::binaries::otelcol()
            .map(|_| ())
            .context("building the OpenTelemetry Collector")
    }),
];

impl GoBuilds {
    /// Starts `workers` threads taking [`GO_BUILDS`] in order; a failed build does not stop
    /// the others (they are cached for the next run).
    fn start(workers: usize) -> Self {
        let queue = std::sync::Arc::new(std::sync::Mutex::new(GO_BUILDS.iter()));
        let workers = (0..workers)
            .map(|_| {
                let queue = queue.clone();
                std::thread::spawn(move || {
                    let mut done = Vec::new();
                    loop {
                        let next = queue.lock().ok().and_then(|mut q| q.next());
                        let Some((name, build)) = next else { break };
                        let started = std::time::Instant::now();
                        let result = build();
                        done.push((*name, started.elapsed(), result));
                    }
                    done
                })
            })
            .collect();
        Self { workers }
    }

    /// Waits for every build, records each one's time in `phases`; the first failure, if any.
    fn wait(self, phases: &Phases) -> Result<()> {
        let mut failed = None;
        for worker in self.workers {
            let Ok(done) = worker.join() else {
                failed.get_or_insert_with(|| anyhow::anyhow!("a Go build thread panicked"));
                continue;
            };
            for (name, took, result) in done {
                phases.record(&format!("{name} (background)"), took);
                if let Err(e) = result {
                    failed.get_or_insert(e);
                }
            }
        }
        failed.map_or(Ok(()), Err)
    }
}

/// Where `cargo xtask test`'s time went, phase by phase, printed at the end (also when it
/// failed). Background phases overlap the others, so the rows add up to more than the total.
#[derive(Default)]
pub(crate) struct Phases(std::sync::Mutex<Vec<(String, std::time::Duration)>>);

impl Phases {
    pub(crate) fn record(&self, phase: &str, took: std::time::Duration) {
        if let Ok(mut rows) = self.0.lock() {
            rows.push((phase.to_string(), took));
        }
    }

    pub(crate) fn time<T>(&self, phase: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let started = std::time::Instant::now();
        let out = f();
        self.record(phase, started.elapsed());
        out
    }

    fn print(&self, total: std::time::Duration) {
        let rows = self.0.lock().map(|r| r.clone()).unwrap_or_default();
        let width = rows.iter().map(|(p, _)| p.len()).max().unwrap_or(0).max(5);
        eprintln!("\nxtask: where the time went");
        for (phase, took) in &rows {
            eprintln!("  {phase:<width$}  {:>7.1} s", took.as_secs_f64());
        }
        eprintln!("  {:<width$}  {:>7.1} s", "total", total.as_secs_f64());
    }
}

/// Starts a control plane (with `real_nodes` real nodes and then no kwok nodes) and keeps it
/// running until Ctrl-C.
fn testenv(real_nodes: usize) -> Result<()> {
    if real_nodes > 0 {
        prerequisites::ensure_node_packages()?;
    }
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let options = if real_nodes > 0 {
            steward_testenv::Options::real_nodes(real_nodes)
        } else {
            steward_testenv::Options::default()
        };
        let cp = steward_testenv::ControlPlane::start(options).await?;
        println!("control plane ready in {:.1?}", cp.started_in());
        for node in cp.real_nodes() {
            println!(
                "  real node {} ({}) Ready (node start {:.1?}); logs in {}/node/",
                node.name(),
                node.zone().unwrap_or("no zone"),
                node.started_in(),
                cp.dir().display()
            );
        }
        let mut images = Vec::new();
        for node in cp.real_nodes() {
            images = vec![
                node.busybox_image().await?,
                node.postgresql_image().await?,
                node.postgresql_bundle_image(steward_testenv::images::BUNDLED_POSTGRESQL[0].0)
                    .await?,
            ];
        }
        if !images.is_empty() {
            println!(
                "  images on every node: {} (imagePullPolicy: Never)",
                images.join(", ")
            );
        }
        println!("  kube-apiserver: {}", cp.apiserver_url());
        println!("  logs and data:  {}", cp.dir().display());
        println!("  export KUBECONFIG={}", cp.kubeconfig_path().display());
        println!("Ctrl-C to stop.");
        tokio::signal::ctrl_c().await?;
        println!("stopping");
        drop(cp);
        Ok(())
    })
}
