//! `cargo xtask new-operator` end to end: in a copy of this workspace, scaffold an operator,
//! then build it and run, against the control plane, its generated integration test and the
//! deploy tests (which iterate the registry, so they check the new operator's manifests, RBAC,
//! CRD and sample like every other operator's). Nothing is edited by hand in between.
//!
//! The copy builds into its own target directory, `target/scaffold-test/` of this workspace
//! (kept between runs). Not `target/` itself: cargo hashes a workspace crate by its path
//! relative to the workspace root, so the copy's crates would overwrite this workspace's
//! artifacts with ones naming the copy's paths. On its first run that directory is seeded from
//! `target/debug/` with every compiled dependency that is not a workspace crate (hard links for
//! the libraries, copies of the small bookkeeping files), so a fresh clone compiles the
//! dependencies once, not twice.

use std::collections::BTreeSet;
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

/// The names cargo gives this workspace's own build units (packages and their targets), with
/// `-` as `_`.
fn workspace_units() -> BTreeSet<String> {
    let out = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(["metadata", "--no-deps", "--format-version", "1"])
        .current_dir(workspace_root())
        .output()
        .expect("cargo metadata");
    assert!(out.status.success(), "cargo metadata: {}", out.status);
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).expect("metadata JSON");
    let mut names = BTreeSet::new();
    for package in meta["packages"].as_array().into_iter().flatten() {
        names.extend(package["name"].as_str().map(|n| n.replace('-', "_")));
        for target in package["targets"].as_array().into_iter().flatten() {
            names.extend(target["name"].as_str().map(|n| n.replace('-', "_")));
        }
    }
    names
}

/// Compiled libraries: hard-linked when seeding, never rewritten in place.
const LIBRARIES: [&str; 3] = [".rlib", ".rmeta", ".so"];

/// The unit a file or directory under `target/debug/{deps,build,.fingerprint}` belongs to:
/// `libtokio-0123abcd.rlib`, `tokio-0123abcd.d` and `tokio-0123abcd/` all name `tokio`.
fn unit_of(file_name: &str) -> String {
    let library = LIBRARIES.iter().any(|ext| file_name.ends_with(ext));
    let name = match file_name.strip_prefix("lib") {
        Some(rest) if library => rest,
        _ => file_name,
    };
    let stem = name.rsplit_once('-').map_or(name, |(stem, _hash)| stem);
    stem.replace('-', "_")
}

/// Seeds `into` (a target directory) from this workspace's `target/debug/` with the compiled
/// dependencies, leaving out the workspace's own units. Libraries are hard-linked (rustc and
/// cargo replace outputs by renaming, never in place); everything else is copied.
fn seed_target(into: &Path) {
    let from = workspace_root().join("target/debug");
    if into.exists() || !from.is_dir() {
        return;
    }
    let ours = workspace_units();
    fn copy_tree(from: &Path, to: &Path, link: bool) -> std::io::Result<()> {
        if from.is_dir() {
            std::fs::create_dir_all(to)?;
            for entry in std::fs::read_dir(from)? {
                let entry = entry?;
                copy_tree(&entry.path(), &to.join(entry.file_name()), link)?;
            }
            Ok(())
        } else if link {
            std::fs::hard_link(from, to)
        } else {
            std::fs::copy(from, to).map(|_| ())
        }
    }
    let mut seeded = 0;
    for sub in ["deps", "build", ".fingerprint"] {
        let Ok(entries) = std::fs::read_dir(from.join(sub)) else {
            continue;
        };
        std::fs::create_dir_all(into.join("debug").join(sub)).expect("mkdir");
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if ours.contains(&unit_of(&name)) {
                continue;
            }
            let link = sub == "deps" && LIBRARIES.iter().any(|ext| name.ends_with(ext));
            copy_tree(
                &entry.path(),
                &into.join("debug").join(sub).join(&name),
                link,
            )
            .unwrap_or_else(|e| panic!("seeding {name}: {e}"));
            seeded += 1;
        }
    }
    eprintln!("seeded {} with {seeded} dependency units", into.display());
}

#[test]
fn build_units_are_named_without_hash_or_lib_prefix() {
    assert_eq!(unit_of("libtokio-0123abcd.rlib"), "tokio");
    assert_eq!(unit_of("steward_core-0123abcd.d"), "steward_core");
    assert_eq!(unit_of("steward-core-0123abcd"), "steward_core");
    assert_eq!(
        unit_of("libc-0123abcd"),
        "libc",
        "a build directory keeps its lib"
    );
    assert_eq!(unit_of("liblibc-0123abcd.rmeta"), "libc");
}

#[test]
fn a_scaffolded_operator_builds_deploys_and_passes_its_own_test() {
    let copy = tempfile::tempdir().expect("temp dir");
    let ws = copy.path();
    copy_workspace(ws);
    seed_target(&workspace_root().join("target/scaffold-test"));

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
