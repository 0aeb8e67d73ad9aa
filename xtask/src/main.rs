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

/// Runs every test. Builds the control plane first (a cold build takes 10–20 minutes), so the
/// integration tests start in seconds.
fn test(extra: &[&str]) -> Result<()> {
    let started = std::time::Instant::now();
    crdgen::run(true)?;
    eprintln!("xtask: crds/ is up to date");

    prerequisites::ensure_postgres()?;
    prerequisites::ensure_node_packages()?;
    let binaries = steward_testenv::binaries::ensure().context("building the control plane")?;
    let node = steward_testenv::binaries::ensure_node().context("building the real node")?;
    steward_testenv::binaries::helm().context("building Helm")?;
    steward_testenv::binaries::prometheus().context("building Prometheus")?;
    steward_testenv::binaries::otelcol().context("building the OpenTelemetry Collector")?;
    steward_testenv::binaries::seaweedfs().context("building SeaweedFS")?;
    helm::run(true)?;
    eprintln!("xtask: {} is up to date", helm::CHART);
    eprintln!(
        "xtask: control plane ready: kubernetes {}, etcd {}, kwok {}, containerd {}, CoreDNS {} ({})",
        binaries.versions.kubernetes,
        binaries.versions.etcd,
        binaries.versions.kwok,
        node.containerd_version,
        node.coredns_version,
        binaries.versions.go
    );

    let tests = testrun::run(extra);
    eprintln!("xtask: the tests finished in {:.0?}", started.elapsed());
    tests?;
    // The benchmark harness in its tiny configuration, so it does not rot; it asserts no
    // timing. Skipped when the run is narrowed to some tests.
    if extra.is_empty() {
        let out = workspace_root().join("target/bench-smoke");
        bench::run(bench::Flags {
            smoke: true,
            out: Some(out.clone()),
            ..bench::Flags::default()
        })
        .context("cargo xtask bench --smoke")?;
        eprintln!("xtask: bench --smoke wrote {}/benchmarks.md", out.display());
    }
    eprintln!("xtask: test finished in {:.0?}", started.elapsed());
    Ok(())
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
