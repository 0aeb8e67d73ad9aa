//! The README's first command as a newcomer runs it: `cargo xtask up` builds and deploys the
//! operators on a control plane with a real node, applies `deploy/samples/` (a PostgresCluster
//! with the demo object store as its `spec.backup`, a PostgresBackup, a Database, a Tenant, an
//! UpgradePlan…) and ends with "Steward is up" once every sample is Ready. `--check` stops
//! there, failing unless every sample became Ready, and removes the node from the host.
//!
//! Starts the host's one real node, so it runs in the real node's lane. Needs root.

use std::time::Instant;

use steward_testenv::harness::cargo_command;
use steward_testenv::workspace_root;

#[test]
fn xtask_up_ends_with_steward_is_up_and_every_sample_ready() {
    let started = Instant::now();
    let out = cargo_command()
        .args([
            "run",
            "--quiet",
            "--package",
            "xtask",
            "--",
            "up",
            "--check",
        ])
        .current_dir(workspace_root())
        .output()
        .expect("cargo runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    eprintln!("{stderr}");
    assert!(
        out.status.success(),
        "cargo xtask up --check failed ({}) after {:.0?}",
        out.status,
        started.elapsed()
    );
    assert!(
        stdout.contains("Steward is up"),
        "cargo xtask up --check succeeded without saying \"Steward is up\""
    );
    assert!(
        !stdout.contains("some samples are not Ready yet"),
        "a sample is reported not Ready although --check passed"
    );
    println!("cargo xtask up --check: {:.0?}", started.elapsed());
}
