//! Project automation, run as `cargo xtask <command>`:
//!
//! - `crdgen [--check]`: write `crds/*.yaml` from the Rust types (or fail if they are stale).
//! - `test`: everything CI runs: unit tests, `crdgen --check`, integration tests against a real
//!   control plane (building it first if it is not cached).
//! - `testenv`: start the control plane and print the kubeconfig path; Ctrl-C stops it.

mod bench;
mod crdgen;
mod image;
mod prerequisites;
mod up;

use std::process::Command;

use anyhow::{Context, Result, bail};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let rest: Vec<&str> = args.iter().skip(1).map(String::as_str).collect();
    match args.first().map(String::as_str) {
        Some("crdgen") => crdgen::run(rest.contains(&"--check")),
        Some("test") => test(&rest),
        Some("testenv") => testenv(),
        Some("up") => up::run(),
        Some("bench") => bench::run(&rest),
        Some("image") => match rest.first() {
            Some(&"all") | None => image::OPERATORS
                .iter()
                .try_for_each(|op| image::run(op).map(|_| ())),
            Some(op) => image::run(op).map(|_| ()),
        },
        _ => {
            eprintln!(
                "usage: cargo xtask <command>\n\n\
                 commands:\n  \
                 crdgen [--check]   write crds/ from the Rust types (--check: fail if stale)\n  \
                 test [ARGS]        unit tests, crdgen --check, integration tests (ARGS go to cargo test)\n  \
                 testenv            start a local control plane; Ctrl-C stops it\n  \
                 up                 control plane + PostgreSQL + CRDs + the three operators + samples; Ctrl-C stops\n  \
                 bench [--smoke]    benchmarks vs controller-runtime; writes docs/benchmarks.md (--help: flags)\n  \
                 image [OPERATOR|all]  build an OCI image archive (no daemon) into target/images/"
            );
            bail!("unknown or missing command")
        }
    }
}

fn workspace_root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn cargo() -> Command {
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.current_dir(workspace_root());
    cmd
}

/// Runs every test. Builds the control plane first (a cold build takes 10–20 minutes), so the
/// integration tests start in seconds.
fn test(extra: &[&str]) -> Result<()> {
    let started = std::time::Instant::now();
    crdgen::run(true)?;
    eprintln!("xtask: crds/ is up to date");

    prerequisites::ensure_postgres()?;
    let binaries = steward_testenv::binaries::ensure().context("building the control plane")?;
    eprintln!(
        "xtask: control plane ready: kubernetes {}, etcd {}, kwok {} ({})",
        binaries.versions.kubernetes,
        binaries.versions.etcd,
        binaries.versions.kwok,
        binaries.versions.go
    );

    let status = cargo()
        .args(["test", "--workspace", "--no-fail-fast"])
        .args(extra)
        .status()
        .context("running cargo test")?;
    eprintln!("xtask: cargo test finished in {:.0?}", started.elapsed());
    if !status.success() {
        bail!("cargo test failed ({status})");
    }
    // The benchmark harness in its tiny configuration, so it does not rot; it asserts no
    // timing. Skipped when the run is narrowed to some tests.
    if extra.is_empty() {
        let out = workspace_root().join("target/bench-smoke");
        let out = out.to_string_lossy();
        bench::run(&["--smoke", "--out", &out]).context("cargo xtask bench --smoke")?;
        eprintln!("xtask: bench --smoke wrote {out}/benchmarks.md");
    }
    eprintln!("xtask: test finished in {:.0?}", started.elapsed());
    Ok(())
}

/// Starts a control plane and keeps it running until Ctrl-C.
fn testenv() -> Result<()> {
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let cp = steward_testenv::ControlPlane::start(steward_testenv::Options::default()).await?;
        println!("control plane ready in {:.1?}", cp.started_in());
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
