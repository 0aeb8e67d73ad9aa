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

/// How a [`cargo`] step runs beside the other test binaries.
#[derive(Clone, Copy)]
enum Priority {
    /// `nice -n 19`: a build, which takes whatever CPU the others leave (the test runner runs
    /// this binary beside the real node's lane, whose PostgreSQL failovers wait on timeouts).
    Build,
    /// At the test process's own priority: tests against a control plane, with deadlines.
    Run,
}

/// `cargo <args>` in `dir`, building into `target/scaffold-test/`; panics with the command's
/// output tail when it fails.
fn cargo(dir: &Path, args: &[&str], priority: Priority) {
    let cargo = steward_testenv::harness::cargo_command();
    let mut command = match priority {
        Priority::Run => cargo,
        Priority::Build => {
            let mut niced = Command::new("nice");
            niced.args(["-n", "19"]).arg(cargo.get_program());
            for (name, value) in cargo.get_envs() {
                match value {
                    Some(value) => niced.env(name, value),
                    None => niced.env_remove(name),
                };
            }
            niced
        }
    };
    let out = command
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
    for file in tracked_files(&root) {
        let from = root.join(&file);
        if !from.is_file() {
            continue; // deleted in the work tree
        }
        let dest = to.join(&file);
        std::fs::create_dir_all(dest.parent().expect("a parent")).expect("mkdir");
        std::fs::copy(&from, &dest).unwrap_or_else(|e| panic!("copy {}: {e}", from.display()));
    }
}

/// The files of the workspace at `root` that git tracks, or does not track but does not
/// ignore, relative to `root`.
fn tracked_files(root: &Path) -> Vec<std::path::PathBuf> {
    let out = Command::new("git")
        .args([
            "ls-files",
            "-z",
            "--cached",
            "--others",
            "--exclude-standard",
        ])
        .current_dir(root)
        .output()
        .expect("git ls-files");
    assert!(
        out.status.success(),
        "git ls-files in {}: {}: {}",
        root.display(),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
        .split(|b| *b == 0)
        .filter(|f| !f.is_empty())
        .map(|f| std::path::PathBuf::from(std::str::from_utf8(f).expect("a UTF-8 path")))
        .collect()
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
        Priority::Build,
    );
    // Of the workspace's existing files, the scaffold changed by hand only the registry (one
    // line in its list, one dependency line); the rest it changed are generated (crds/ and the
    // kustomizations by crdgen, the chart by helm, Cargo.lock by cargo).
    let root = workspace_root();
    let mut by_hand = Vec::new();
    for file in tracked_files(&root) {
        let (before, after) = (
            std::fs::read_to_string(root.join(&file)).unwrap_or_default(),
            std::fs::read_to_string(ws.join(&file)).unwrap_or_default(),
        );
        let generated = file.starts_with("crds/")
            || file.starts_with("charts/")
            || file.ends_with("kustomization.yaml")
            || file == Path::new("Cargo.lock");
        if before != after && !generated {
            let added: Vec<&str> = after
                .lines()
                .filter(|l| !before.lines().any(|b| b == *l))
                .collect();
            by_hand.push(format!("{}: {added:?}", file.display()));
        }
    }
    assert_eq!(
        by_hand,
        [
            "crates/operators/Cargo.toml: [\"demo-operator = { path = \\\"../demo-operator\\\" }\"]",
            "crates/operators/src/lib.rs: [\"    demo_operator::DemoOperator,\"]",
        ],
        "existing files the scaffold changed by hand"
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
        Priority::Build,
    );
    // And so is the chart, with the new operator in it.
    cargo(
        ws,
        &["run", "--quiet", "-p", "xtask", "--", "helm", "--check"],
        Priority::Build,
    );
    assert!(
        ws.join("charts/steward/templates/demo-operator.yaml")
            .is_file(),
        "the chart has the new operator"
    );
    // Its unit tests, its integration test, and the deploy tests over every operator: built
    // first at low priority, then run (`cargo test` finds them built).
    let tests = [
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
    ];
    cargo(ws, &[&tests[..], &["--no-run"]].concat(), Priority::Build);
    cargo(ws, &tests, Priority::Run);
}
