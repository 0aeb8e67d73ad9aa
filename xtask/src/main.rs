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
//! - `image [OPERATOR|all]`, `bench`: operator images; benchmarks.
//! - `new-operator <name>`: scaffold and register a new operator crate (see `new_operator.rs`).

mod bench;
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

/// Counts what each thread allocates, for `bench`'s cache breakdown (`bench/cache.rs`).
#[global_allocator]
static ALLOCATOR: bench::cache::Counting = bench::cache::Counting;

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
    },
    /// A control plane with a real node, the CRDs, the operators as their images (deploy/)
    /// and the samples; Ctrl-C stops.
    Up,
    /// A new operator crate (sample CRD, working reconcile, deploy/, sample, integration
    /// test), registered in the workspace; then crdgen.
    NewOperator {
        /// The operator's name, a DNS label such as `cache-operator`.
        name: String,
    },
    /// Benchmarks against controller-runtime; writes docs/benchmarks.md.
    Bench(Box<bench::Flags>),
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
        Cmd::Testenv { real_node } => testenv(real_node),
        Cmd::Up => up::run(),
        Cmd::NewOperator { name } => new_operator::run(&name),
        Cmd::Bench(flags) => bench::run(*flags),
        Cmd::Image { operator } => match operator.as_deref() {
            None | Some("all") => steward_operators::names()
                .into_iter()
                .try_for_each(|op| image::run(op).map(|_| ())),
            Some(op) => image::run(op).map(|_| ()),
        },
    }
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

/// Runs every test. The Go builds (control plane, real node, Helm, Prometheus, the
/// collector, SeaweedFS: 20 minutes cold on 2 cores) start first, in two background chains,
/// so they overlap the Debian packages and the Rust build of the tests; the tests start once
/// all are done. Ends with a table of where the time went.
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

    // The two chains take about as long as each other cold; each build is cached apart.
    let control_plane = std::thread::spawn(|| {
        let started = std::time::Instant::now();
        let built = steward_testenv::binaries::ensure()
            .context("building the control plane")
            .and_then(|b| {
                let node = steward_testenv::binaries::ensure_node()
                    .context("building the real node")?;
                Ok((b, node))
            });
        (built, started.elapsed())
    });
    let tools = std::thread::spawn(|| {
        let started = std::time::Instant::now();
        let built = (|| -> Result<()> {
            steward_testenv::binaries::prometheus().context("building Prometheus")?;
            steward_testenv::binaries::seaweedfs().context("building SeaweedFS")?;
            steward_testenv::binaries::helm().context("building Helm")?;
            steward_testenv::binaries::otelcol()
                .context("building the OpenTelemetry Collector")?;
            Ok(())
        })();
        (built, started.elapsed())
    });
    let packages = phases.time("Debian packages", || {
        prerequisites::ensure_postgres()?;
        prerequisites::ensure_node_packages()
    });
    let go_builds = || -> Result<()> {
        let (built, took) = control_plane
            .join()
            .map_err(|_| anyhow::anyhow!("the control-plane build thread panicked"))?;
        phases.record("Go: control plane and real node (background)", took);
        let (binaries, node) = built?;
        let (built, took) = tools
            .join()
            .map_err(|_| anyhow::anyhow!("the tools build thread panicked"))?;
        phases.record("Go: Prometheus, SeaweedFS, Helm, collector (background)", took);
        built?;
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
    let tests = match packages {
        Ok(()) => testrun::run(extra, go_builds, phases),
        // Still wait for the Go builds: they are cached for the next run.
        Err(e) => {
            let _ = go_builds();
            Err(e)
        }
    };
    tests?;
    // The benchmark harness in its tiny configuration, so it does not rot; it asserts no
    // timing. Skipped when the run is narrowed to some tests.
    if extra.is_empty() {
        let out = workspace_root().join("target/bench-smoke");
        phases
            .time("bench --smoke", || {
                bench::run(bench::Flags {
                    smoke: true,
                    out: Some(out.clone()),
                    ..bench::Flags::default()
                })
            })
            .context("cargo xtask bench --smoke")?;
        eprintln!("xtask: bench --smoke wrote {}/benchmarks.md", out.display());
    }
    Ok(())
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

/// Starts a control plane (with a real node: no kwok nodes) and keeps it running until Ctrl-C.
fn testenv(real_node: bool) -> Result<()> {
    if real_node {
        prerequisites::ensure_node_packages()?;
    }
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let options = if real_node {
            steward_testenv::Options {
                nodes: 0,
                real_node: true,
                ..Default::default()
            }
        } else {
            steward_testenv::Options::default()
        };
        let cp = steward_testenv::ControlPlane::start(options).await?;
        println!("control plane ready in {:.1?}", cp.started_in());
        if let Some(node) = cp.real_node() {
            println!(
                "  real node {} Ready (node start {:.1?}); logs in {}/node/",
                node.name(),
                node.started_in(),
                cp.dir().display()
            );
            println!(
                "  images: {}, {} and {} (imagePullPolicy: Never)",
                node.busybox_image().await?,
                node.postgresql_image().await?,
                node.postgresql_bundle_image(steward_testenv::images::BUNDLED_POSTGRESQL[0].0)
                    .await?
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
