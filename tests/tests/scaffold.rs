//! `cargo xtask new-operator` end to end: in a copy of this workspace, scaffold an operator,
//! then build it and run, against the control plane, its generated integration test and the
//! deploy tests (which iterate the registry, so they check the new operator's manifests, RBAC,
//! CRD and sample like every other operator's). Nothing is edited by hand in between.
//!
//! The copy builds into its own target directory, `target/scaffold-test/` of this workspace
//! (kept between runs, so only the first run compiles the dependencies). Not `target/`
//! itself: cargo hashes a workspace crate by its path relative to the workspace root, so the
//! copy's crates would overwrite this workspace's artifacts with ones naming the copy's paths.

use std::path::Path;
use std::process::Command;

use steward_testenv::workspace_root;

/// `cargo <args>` in `dir`, building into `target/scaffold-test/`; panics with the command's
/// output tail when it fails.
fn cargo(dir: &Path, args: &[&str]) {
    let out = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(args)
        .current_dir(dir)
        .env("RUST_BACKTRACE", "0")
        .env(
            "CARGO_TARGET_DIR",
            workspace_root().join("target/scaffold-test"),
        )
        .output()
        .unwrap_or_else(|e| panic!("cargo {args:?}: {e}"));
    let text =
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    eprintln!("cargo {args:?}: {}", out.status);
    if !out.status.success() {
        let tail: Vec<&str> = text.lines().rev().take(60).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        panic!(
            "cargo {args:?} failed ({}):\n{}",
            out.status,
            tail.join("\n")
        );
    }
}

/// The workspace's files (tracked, and untracked but not ignored) copied to `to`.
fn copy_workspace(to: &Path) {
    let root = workspace_root();
    let out = Command::new("git")
        .args([
            "ls-files",
            "-z",
            "--cached",
            "--others",
            "--exclude-standard",
        ])
        .current_dir(&root)
        .output()
        .expect("git ls-files");
    assert!(
        out.status.success(),
        "git ls-files in {}: {}: {}",
        root.display(),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    for file in out.stdout.split(|b| *b == 0).filter(|f| !f.is_empty()) {
        let file = Path::new(std::str::from_utf8(file).expect("a UTF-8 path"));
        let from = root.join(file);
        if !from.is_file() {
            continue; // deleted in the work tree
        }
        let dest = to.join(file);
        std::fs::create_dir_all(dest.parent().expect("a parent")).expect("mkdir");
        std::fs::copy(&from, &dest).unwrap_or_else(|e| panic!("copy {}: {e}", from.display()));
    }
}

#[test]
fn a_scaffolded_operator_builds_deploys_and_passes_its_own_test() {
    let copy = tempfile::tempdir().expect("temp dir");
    let ws = copy.path();
    copy_workspace(ws);

    cargo(
        ws,
        &[
            "run",
            "--quiet",
            "-p",
            "xtask",
            "--",
            "new-operator",
            "demo-operator",
        ],
    );
    for generated in [
        "crates/demo-operator/src/reconcile.rs",
        "deploy/demo-operator/role.yaml",
        "deploy/samples/demo-operator.yaml",
        "crds/demo.steward.dev_demos.yaml",
        "tests/tests/demo_operator.rs",
    ] {
        assert!(ws.join(generated).is_file(), "{generated} was not written");
    }
    // Generated crds/ are what crdgen writes (the check CI runs).
    cargo(
        ws,
        &["run", "--quiet", "-p", "xtask", "--", "crdgen", "--check"],
    );
    // Its unit tests, its integration test, and the deploy tests over every operator.
    cargo(
        ws,
        &[
            "test",
            "-p",
            "demo-operator",
            "-p",
            "steward-integration-tests",
            "--lib",
            "--test",
            "demo_operator",
            "--test",
            "deploy",
        ],
    );
}
