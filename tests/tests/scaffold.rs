//! `cargo xtask new-operator` end to end: in a copy of this workspace, scaffold an operator,
//! then build it and run, against the control plane, its generated integration test and the
//! deploy tests (which iterate the registry, so they check the new operator's manifests, RBAC,
//! CRD and sample like every other operator's). Nothing is edited by hand in between.
//!
//! The copy builds into its own target directory, `target/scaffold-test/` of this workspace
//! (kept between runs). Not `target/` itself: cargo hashes a workspace crate by its path
//! relative to the workspace root, so the copy's crates would overwrite this workspace's
//! artifacts with ones naming the copy's paths. So that not even the first run compiles the
//! crates.io dependencies again, `seed_target_dir` hard-links this workspace's artifacts of
//! non-workspace packages into it first (cargo finds them fresh: a registry package's
//! fingerprint does not depend on where its target directory is).

use std::path::Path;
use std::process::Command;

use steward_testenv::workspace_root;

/// `cargo <args>` in `dir`, building into `target/scaffold-test/`; panics with the command's
/// output tail when it fails.
fn cargo(dir: &Path, args: &[&str]) {
    let out = steward_testenv::harness::cargo_command()
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

/// Names under `target/debug/{deps,build,.fingerprint}` of this workspace's own packages and
/// targets (`-` spelt `_`), from `cargo metadata`.
fn workspace_names(root: &Path) -> std::collections::BTreeSet<String> {
    let out = steward_testenv::harness::cargo_command()
        .args(["metadata", "--no-deps", "--format-version", "1"])
        .current_dir(root)
        .output()
        .expect("cargo metadata");
    assert!(out.status.success(), "cargo metadata: {}", out.status);
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).expect("metadata JSON");
    let mut names = std::collections::BTreeSet::new();
    for package in meta["packages"].as_array().into_iter().flatten() {
        names.insert(
            package["name"]
                .as_str()
                .unwrap_or_default()
                .replace('-', "_"),
        );
        for target in package["targets"].as_array().into_iter().flatten() {
            names.insert(
                target["name"]
                    .as_str()
                    .unwrap_or_default()
                    .replace('-', "_"),
            );
        }
    }
    names
}

/// The crate an artifact name is of: `libfoo_bar-0123abcd.rlib`, `foo-bar-0123abcd` → `foo_bar`.
fn artifact_crate(file: &str) -> String {
    let stem = file.split('.').next().unwrap_or(file);
    let stem = stem.rsplit_once('-').map_or(stem, |(name, _hash)| name);
    stem.strip_prefix("lib").unwrap_or(stem).replace('-', "_")
}

/// Hard-links `from` (a file or a directory tree) to `to`.
fn link_tree(from: &Path, to: &Path) -> std::io::Result<()> {
    if from.is_dir() {
        std::fs::create_dir_all(to)?;
        for entry in std::fs::read_dir(from)? {
            let entry = entry?;
            link_tree(&entry.path(), &to.join(entry.file_name()))?;
        }
        Ok(())
    } else {
        std::fs::hard_link(from, to)
    }
}

/// Hard-links into `target/scaffold-test/debug` the artifacts, build-script outputs and
/// fingerprints that `target/debug` has of packages that are not this workspace's (whose
/// files the copy's build writes, so they must not be shared). Best effort: what fails to link
/// is compiled instead.
fn seed_target_dir() {
    let root = workspace_root();
    let ours = workspace_names(&root);
    let (from, to) = (
        root.join("target/debug"),
        root.join("target/scaffold-test/debug"),
    );
    let mut linked = 0;
    for dir in ["deps", "build", ".fingerprint"] {
        let Ok(entries) = std::fs::read_dir(from.join(dir)) else {
            continue;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let dest = to.join(dir).join(&name);
            if ours.contains(&artifact_crate(&name)) || dest.exists() {
                continue;
            }
            let _ = std::fs::create_dir_all(to.join(dir));
            if link_tree(&entry.path(), &dest).is_ok() {
                linked += 1;
            }
        }
    }
    eprintln!(
        "seeded {} with {linked} entries from {}",
        to.display(),
        from.display()
    );
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
    seed_target_dir();

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
    // Generated crds/ are what crdgen writes, the chart what helm writes (the checks CI runs).
    cargo(
        ws,
        &["run", "--quiet", "-p", "xtask", "--", "crdgen", "--check"],
    );
    // And so is the chart, with the new operator in it.
    cargo(
        ws,
        &["run", "--quiet", "-p", "xtask", "--", "helm", "--check"],
    );
    assert!(
        ws.join("charts/steward/templates/demo-operator.yaml")
            .is_file(),
        "the chart has the new operator"
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
