//! `cargo xtask test`'s test runner: `cargo test`, but every test binary runs under a time
//! limit, so one hung test fails the run with its name instead of eating CI's whole budget.
//!
//! The binaries are built by `cargo test --no-run` and run one after another as cargo would
//! run them (working directory = their package, the arguments after `--`); the doc tests run
//! by `cargo test --doc` afterwards. A binary still running after [`limit`] is killed; its
//! processes (control planes, kubelets) go with it (testenv starts them with a parent-death
//! signal) and a real node it left is swept by the next start.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// Per test binary, unless `STEWARD_TEST_BINARY_TIMEOUT` (seconds) says otherwise. The
/// slowest binary takes about 2.5 min on a quiet machine.
const DEFAULT_LIMIT: Duration = Duration::from_secs(15 * 60);

/// The time limit of one test binary.
fn limit() -> Duration {
    std::env::var("STEWARD_TEST_BINARY_TIMEOUT")
        .ok()
        .and_then(|s| s.parse().ok())
        .map_or(DEFAULT_LIMIT, Duration::from_secs)
}

/// A test executable cargo built.
struct TestBinary {
    /// `<package> <kind> <target>`, as the summary names it.
    name: String,
    executable: PathBuf,
    /// Its package's directory (cargo runs tests there).
    package_dir: PathBuf,
}

/// Builds and runs every test of the workspace; `extra` is what `cargo xtask test` was given:
/// cargo's options, then `--` and the test binaries' (`--test real_node -- --nocapture`).
pub fn run(extra: &[&str]) -> Result<()> {
    let (cargo_args, test_args) = match extra.iter().position(|a| *a == "--") {
        Some(i) => (&extra[..i], &extra[i + 1..]),
        None => (extra, &[][..]),
    };
    let binaries = build(cargo_args)?;
    let limit = limit();
    let mut failed = Vec::new();
    for binary in &binaries {
        eprintln!("\n     Running {}", binary.name);
        let started = Instant::now();
        match run_one(binary, test_args, limit)? {
            Outcome::Passed => {}
            Outcome::Failed(status) => failed.push(format!("{} ({status})", binary.name)),
            Outcome::TimedOut => {
                eprintln!(
                    "xtask: {} still ran after {limit:?} and was killed (the tests it reported as \
                     \"running for over 60 seconds\" above without a result are the hung ones)",
                    binary.name
                );
                failed.push(format!("{} (killed after {limit:?})", binary.name));
            }
        }
        eprintln!("xtask: {} took {:.0?}", binary.name, started.elapsed());
    }
    if runs_doc_tests(cargo_args) {
        let status = super::cargo_once()
            .args(["test", "--workspace", "--doc"])
            .args(cargo_args)
            .arg("--")
            .args(test_args)
            .status()
            .context("running the doc tests")?;
        if !status.success() {
            failed.push(format!("doc tests ({status})"));
        }
    }
    if !failed.is_empty() {
        bail!("{} failed:\n  {}", failed.len(), failed.join("\n  "));
    }
    Ok(())
}

/// `--doc` cannot be combined with a target selection.
fn runs_doc_tests(cargo_args: &[&str]) -> bool {
    const TARGETS: [&str; 8] = [
        "--test",
        "--tests",
        "--lib",
        "--bin",
        "--bins",
        "--example",
        "--examples",
        "--bench",
    ];
    !cargo_args.iter().any(|a| {
        TARGETS
            .iter()
            .any(|t| a == t || a.starts_with(&format!("{t}=")))
    })
}

fn build(cargo_args: &[&str]) -> Result<Vec<TestBinary>> {
    let out = super::cargo_once()
        .args([
            "test",
            "--workspace",
            "--no-run",
            "--message-format=json-render-diagnostics",
        ])
        .args(cargo_args)
        .stderr(Stdio::inherit())
        .output()
        .context("running cargo test --no-run")?;
    if !out.status.success() {
        bail!("building the tests failed ({})", out.status);
    }
    let binaries = test_binaries(&String::from_utf8_lossy(&out.stdout));
    if binaries.is_empty() {
        bail!("cargo test --no-run built no test binary");
    }
    Ok(binaries)
}

/// The test executables in cargo's JSON messages, in cargo's order.
fn test_binaries(messages: &str) -> Vec<TestBinary> {
    messages
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|m| m["reason"] == "compiler-artifact" && m["profile"]["test"] == true)
        .filter_map(|m| {
            let executable = PathBuf::from(m["executable"].as_str()?);
            let manifest = PathBuf::from(m["manifest_path"].as_str()?);
            let target = &m["target"];
            let kind = target["kind"][0].as_str().unwrap_or("test");
            let name = target["name"].as_str()?;
            let package = manifest
                .parent()
                .and_then(|d| d.file_name())
                .map(|d| d.to_string_lossy().into_owned())
                .unwrap_or_default();
            Some(TestBinary {
                name: format!("{package} {kind} {name}"),
                executable,
                package_dir: manifest.parent()?.to_path_buf(),
            })
        })
        .collect()
}

enum Outcome {
    Passed,
    Failed(std::process::ExitStatus),
    TimedOut,
}

fn run_one(binary: &TestBinary, test_args: &[&str], limit: Duration) -> Result<Outcome> {
    let mut child = Command::new(&binary.executable)
        .args(test_args)
        .current_dir(&binary.package_dir)
        .env("CARGO_MANIFEST_DIR", &binary.package_dir)
        .envs(super::BUILT_ONCE)
        .spawn()
        .with_context(|| format!("starting {}", binary.executable.display()))?;
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(if status.success() {
                Outcome::Passed
            } else {
                Outcome::Failed(status)
            });
        }
        if Instant::now() >= deadline {
            child.kill().ok();
            child.wait().ok();
            return Ok(Outcome::TimedOut);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_executables_are_read_from_cargos_messages() {
        let messages = r#"{"reason":"compiler-artifact","manifest_path":"/w/tests/Cargo.toml","target":{"kind":["test"],"name":"real_node"},"profile":{"test":true},"executable":"/w/target/debug/deps/real_node-1"}
{"reason":"compiler-artifact","manifest_path":"/w/crates/core/Cargo.toml","target":{"kind":["lib"],"name":"steward_core"},"profile":{"test":false},"executable":null}
{"reason":"compiler-artifact","manifest_path":"/w/crates/core/Cargo.toml","target":{"kind":["lib"],"name":"steward_core"},"profile":{"test":true},"executable":"/w/target/debug/deps/steward_core-2"}
{"reason":"build-finished","success":true}"#;
        let found: Vec<(String, PathBuf, PathBuf)> = test_binaries(messages)
            .into_iter()
            .map(|b| (b.name, b.executable, b.package_dir))
            .collect();
        assert_eq!(
            found,
            [
                (
                    "tests test real_node".to_string(),
                    PathBuf::from("/w/target/debug/deps/real_node-1"),
                    PathBuf::from("/w/tests")
                ),
                (
                    "core lib steward_core".to_string(),
                    PathBuf::from("/w/target/debug/deps/steward_core-2"),
                    PathBuf::from("/w/crates/core")
                ),
            ]
        );
    }

    #[test]
    fn doc_tests_run_unless_targets_are_selected() {
        assert!(runs_doc_tests(&[]));
        assert!(runs_doc_tests(&["-p", "steward-core"]));
        assert!(!runs_doc_tests(&["--test", "real_node"]));
        assert!(!runs_doc_tests(&["--lib"]));
        assert!(!runs_doc_tests(&["--test=real_node"]));
    }

    #[test]
    fn a_binary_over_its_limit_is_killed() {
        let binary = TestBinary {
            name: "sleep".into(),
            executable: "sleep".into(),
            package_dir: std::env::temp_dir(),
        };
        let started = Instant::now();
        let outcome = run_one(&binary, &["30"], Duration::from_millis(300)).unwrap();
        assert!(matches!(outcome, Outcome::TimedOut));
        assert!(started.elapsed() < Duration::from_secs(10));
        let outcome = run_one(&binary, &["0"], Duration::from_secs(10)).unwrap();
        assert!(matches!(outcome, Outcome::Passed));
    }
}
