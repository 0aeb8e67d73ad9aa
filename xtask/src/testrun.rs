//! `cargo xtask test`'s test runner: `cargo test`, but every test binary runs under a time
//! limit, so one hung test fails the run with its name instead of eating CI's whole budget,
//! and binaries that mostly wait run beside each other.
//!
//! The binaries are built by `cargo test --no-run` and run as cargo would run them (working
//! directory = their package, the arguments after `--`); the doc tests run by
//! `cargo test --doc` afterwards. The side job's binary (the smoke benchmark's
//! `steward-bench`) is built right after them, with every binary of the workspace as the
//! tests build them ([`steward_testenv::harness::CARGO_BUILD`]), so neither it nor a test that
//! starts a binary waits for a compile later. They run in two phases:
//! 1. the binaries that need the real node ([`ONE_LANE`], one after another: the host has
//!    one node), and beside them, one at a time: the light binaries ([`BESIDE_THE_NODE`]),
//!    then every other binary but the solo ones, the longest first (by the times of the
//!    previous run, kept in `target/xtask-test-times.tsv`), then the side job (the smoke
//!    benchmark). The real node's lane leaves about half of the two cores idle while it
//!    waits for kubelets, PostgreSQL and failover timeouts; the binaries beside it wait on
//!    control planes and Lease timings, and assert with margins derived from those, never
//!    from the machine's speed. `STEWARD_TEST_JOBS=N` (see [`DEFAULT_JOBS`]) runs N of the
//!    other binaries at once once the lane has ended;
//! 2. the [`SOLO`] binaries, alone.
//!
//! A binary running beside another writes its output to `target/xtask-test-logs/<binary>.log`,
//! printed whole when it ends; the real node's lane, and everything when one runs at a time,
//! prints live. A binary still running after [`limit`] is killed; its processes (control
//! planes, kubelets) go with it (testenv starts them with a parent-death signal) and a real
//! node it left is swept by the next start.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// Per test binary, unless `STEWARD_TEST_BINARY_TIMEOUT` (seconds) says otherwise. The
/// slowest binary takes about 5 min on a quiet machine.
const DEFAULT_LIMIT: Duration = Duration::from_secs(15 * 60);

/// How many of the other binaries run at once once the real node's lane has ended, unless
/// `STEWARD_TEST_JOBS` says otherwise: one (beside the lane, one at a time always). Two at a
/// time once put the real node's lane beside all the other binaries at two at a time (37.3
/// min warm instead of about 41, green at `4a15a13`), but each run that way found a
/// contention failure (on the cold run at `9b6c4c0`, the tenant-operator's binary, in
/// [`SOLO`] since).
const DEFAULT_JOBS: usize = 1;

/// The test targets that run in one lane, one after another: those that start testenv's real
/// node (one set per host: one control plane's, or a pair's), `cargo xtask up --check`
/// included.
const ONE_LANE: [&str; 9] = [
    "real_node",
    "real_nodes",
    "two_clusters",
    "postgres_nodes",
    "postgres_cluster",
    "postgres_backup",
    "postgres_dr",
    "postgres_upgrade",
    "up",
];

/// The test targets that run beside the real node's lane, one after another, and then the
/// side job: short binaries (under a minute each at `a1e72b3`, 2.1 min in all) whose tests
/// wait on a control plane and measure nothing against the machine's speed (the sharding
/// test's takeover bound has 4 s of margin over its Lease timings), and the smoke benchmark
/// (2.4 min), which asserts no timing. Nothing that starts a real node, loads both cores or
/// was ever seen failing beside another binary.
const BESIDE_THE_NODE: [&str; 8] = [
    "xtask",
    "steward_bench",
    "kubectl_plugin",
    "monitoring",
    "traces",
    "deploy",
    "sharding",
    "helm",
];

/// The test targets that run alone, after all the others: the chaos soak and the control
/// plane faults, whose deadlines measure recovery (the soak once missed its per-cycle deadline
/// sharing the 2 cores), and the tenant-operator's, whose admission policies read their
/// params from the API server within its own deadline (beside the real node's lane on a cold
/// run, a pod create was refused with "failed to configure binding: … context deadline
/// exceeded"). The scaffold test, which compiles a new operator on both cores, runs beside the
/// lane: its builds run at `nice 19`, so they take only the CPU the lane leaves.
const SOLO: [&str; 3] = ["database_chaos", "faults", "tenant_operator"];

/// The time limit of one test binary.
fn limit() -> Duration {
    std::env::var("STEWARD_TEST_BINARY_TIMEOUT")
        .ok()
        .and_then(|s| s.parse().ok())
        .map_or(DEFAULT_LIMIT, Duration::from_secs)
}

/// How many test binaries run at once.
fn jobs() -> usize {
    std::env::var("STEWARD_TEST_JOBS")
        .ok()
        .and_then(|s| s.parse().ok())
        .filter(|n| *n > 0)
        .unwrap_or(DEFAULT_JOBS)
}

/// A test executable cargo built.
struct TestBinary {
    /// `<package> <kind> <target>`, as the summary names it.
    name: String,
    /// The target's name (`real_node`).
    target: String,
    executable: PathBuf,
    /// Its package's directory (cargo runs tests there).
    package_dir: PathBuf,
}

/// Builds and runs every test of the workspace; `extra` is what `cargo xtask test` was given:
/// cargo's options, then `--` and the test binaries' (`--test real_node -- --nocapture`).
/// `before_running` runs between the build and the first test (it waits for the Go builds);
/// each phase's time goes to `phases`.
pub fn run(
    extra: &[&str],
    before_running: impl FnOnce() -> Result<()>,
    side_job: Option<SideJob>,
    phases: &super::Phases,
) -> Result<()> {
    let (cargo_args, test_args) = match extra.iter().position(|a| *a == "--") {
        Some(i) => (&extra[..i], &extra[i + 1..]),
        None => (extra, &[][..]),
    };
    let built = phases
        .time("Rust: build the tests", || build(cargo_args))
        .and_then(|binaries| {
            let side_job = side_job
                .map(|job| phases.time("Rust: build the binaries", || build_side_job(job)))
                .transpose()?;
            Ok((binaries, side_job))
        });
    let waited = phases.time("after it: waiting for the Go builds", before_running);
    let (binaries, side_job) = built?;
    waited?;
    let target_dir = binaries[0]
        .executable
        .ancestors()
        .nth(3)
        .map_or_else(|| PathBuf::from("target"), Path::to_path_buf);
    let times_file = target_dir.join("xtask-test-times.tsv");
    let previous = read_times(&times_file);
    let (solo, binaries): (Vec<_>, Vec<_>) = binaries
        .into_iter()
        .partition(|b| SOLO.contains(&b.target.as_str()));
    let (beside, binaries): (Vec<_>, Vec<_>) = binaries
        .into_iter()
        .partition(|b| BESIDE_THE_NODE.contains(&b.target.as_str()));
    let (node_lane, lanes) = node_lane(lanes(binaries, &previous));
    let jobs = jobs();
    let log_dir = target_dir.join("xtask-test-logs");
    std::fs::create_dir_all(&log_dir).with_context(|| format!("creating {}", log_dir.display()))?;
    let limit = limit();
    let failed = Mutex::new(Vec::new());
    let times = Mutex::new(previous);
    let run_lane = |lane: &[TestBinary], log_dir: Option<&Path>| {
        for binary in lane {
            let log = log_dir.map(|d| d.join(format!("{}.log", binary.name.replace(' ', "-"))));
            let result = run_logged(binary, test_args, limit, log.as_deref());
            phases.record(&format!("test {}", binary.name), result.elapsed);
            if let Ok(mut times) = times.lock() {
                times.insert(binary.name.clone(), result.elapsed);
            }
            if let Some(failure) = result.failure
                && let Ok(mut failed) = failed.lock()
            {
                failed.push(failure);
            }
        }
    };
    // Like a test binary, under the same limit; output live.
    let run_side_job = |(binary, args): (TestBinary, Vec<String>)| {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let result = run_logged(&binary, &args, limit, None);
        phases.record(&binary.name, result.elapsed);
        if let Some(failure) = result.failure
            && let Ok(mut failed) = failed.lock()
        {
            failed.push(failure);
        }
    };
    let started = Instant::now();
    let queue = Mutex::new(lanes.into_iter());
    let drain = |log_dir: Option<&Path>| {
        loop {
            let lane = queue.lock().map(|mut q| q.next()).ok().flatten();
            let Some(lane) = lane else { break };
            run_lane(&lane, log_dir);
        }
    };
    // Beside the real node's lane (when there is one), output to logs; alone, live.
    let beside_log = (!node_lane.is_empty()).then_some(log_dir.as_path());
    std::thread::scope(|scope| {
        scope.spawn(|| {
            run_lane(&node_lane, None);
            // More than one at a time only when asked: the lane's end frees its share.
            if jobs > 1 {
                std::thread::scope(|inner| {
                    for _ in 1..jobs {
                        inner.spawn(|| drain(Some(&log_dir)));
                    }
                });
            }
        });
        scope.spawn(|| {
            run_lane(&beside, Some(&log_dir));
            drain(if jobs > 1 { Some(&log_dir) } else { beside_log });
            if let Some(job) = side_job {
                run_side_job(job);
            }
        });
    });
    phases.record(
        "the real node's lane, and beside it the light binaries, the other binaries one at a time and the side job (wall clock)",
        started.elapsed(),
    );
    // Alone, output live.
    let started = Instant::now();
    run_lane(&solo, None);
    phases.record("the solo binaries (wall clock)", started.elapsed());
    if let Ok(times) = times.into_inner() {
        write_times(&times_file, &times);
    }
    let mut failed = failed.into_inner().unwrap_or_default();
    if runs_doc_tests(cargo_args) {
        let status = phases.time("doc tests", || {
            super::cargo_once()
                .args(["test", "--workspace", "--doc"])
                .args(cargo_args)
                .arg("--")
                .args(test_args)
                .status()
                .context("running the doc tests")
        })?;
        if !status.success() {
            failed.push(format!("doc tests ({status})"));
        }
    }
    if !failed.is_empty() {
        bail!("{} failed:\n  {}", failed.len(), failed.join("\n  "));
    }
    Ok(())
}

/// Work that runs beside the real node's lane after the light binaries (the smoke
/// benchmark): a binary of the workspace, built with the tests, run as a test binary is.
pub struct SideJob {
    /// Its name in the output and the time table (`bench --smoke`).
    pub name: &'static str,
    /// The binary target it runs (`steward-bench`).
    pub binary: &'static str,
    pub args: Vec<String>,
}

/// What running one binary came to.
struct Ran {
    elapsed: Duration,
    /// The summary line of a failure.
    failure: Option<String>,
}

/// Runs one binary, its output to `log` (printed when it ends) or, without one, live.
fn run_logged(binary: &TestBinary, test_args: &[&str], limit: Duration, log: Option<&Path>) -> Ran {
    eprintln!("\n     Running {}", binary.name);
    let started = Instant::now();
    let outcome = run_one(binary, test_args, limit, log);
    let elapsed = started.elapsed();
    if let Some(log) = log {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        eprintln!("\n     Ran {} ({})\n{text}", binary.name, log.display());
    }
    let failure = match outcome {
        Ok(Outcome::Passed) => None,
        Ok(Outcome::Failed(status)) => Some(format!("{} ({status})", binary.name)),
        Ok(Outcome::TimedOut) => {
            eprintln!(
                "xtask: {} still ran after {limit:?} and was killed (the tests it reported as \
                 \"running for over 60 seconds\" above without a result are the hung ones)",
                binary.name
            );
            Some(format!("{} (killed after {limit:?})", binary.name))
        }
        Err(e) => Some(format!("{} ({e:#})", binary.name)),
    };
    eprintln!("xtask: {} took {elapsed:.0?}", binary.name);
    Ran { elapsed, failure }
}

/// The binaries grouped into lanes ([`ONE_LANE`] in one, every other alone), the
/// longest first by `previous` times; a binary never timed counts as long, so a new test
/// does not end up last.
fn lanes(binaries: Vec<TestBinary>, previous: &HashMap<String, Duration>) -> Vec<Vec<TestBinary>> {
    let (node, others): (Vec<_>, Vec<_>) = binaries
        .into_iter()
        .partition(|b| ONE_LANE.contains(&b.target.as_str()));
    let mut lanes: Vec<Vec<TestBinary>> = others.into_iter().map(|b| vec![b]).collect();
    if !node.is_empty() {
        lanes.push(node);
    }
    let expected = |lane: &Vec<TestBinary>| -> Duration {
        lane.iter()
            .map(|b| {
                previous
                    .get(&b.name)
                    .copied()
                    .unwrap_or(Duration::from_secs(600))
            })
            .sum()
    };
    lanes.sort_by_key(|lane| std::cmp::Reverse(expected(lane)));
    lanes
}

/// The lane of the binaries that need the real node (empty when none was built), and the
/// other lanes.
fn node_lane(mut lanes: Vec<Vec<TestBinary>>) -> (Vec<TestBinary>, Vec<Vec<TestBinary>>) {
    let node = lanes
        .iter()
        .position(|lane| lane.iter().any(|b| ONE_LANE.contains(&b.target.as_str())))
        .map(|i| lanes.remove(i))
        .unwrap_or_default();
    (node, lanes)
}

/// `name<TAB>seconds` lines of the previous run (nothing when there is none).
fn read_times(path: &Path) -> HashMap<String, Duration> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|line| {
            let (name, secs) = line.split_once('\t')?;
            Some((
                name.to_string(),
                Duration::from_secs_f64(secs.parse().ok()?),
            ))
        })
        .collect()
}

fn write_times(path: &Path, times: &HashMap<String, Duration>) {
    let mut lines: Vec<String> = times
        .iter()
        .map(|(name, t)| format!("{name}\t{:.1}", t.as_secs_f64()))
        .collect();
    lines.sort();
    if let Err(e) = std::fs::write(path, lines.join("\n") + "\n") {
        eprintln!(
            "xtask: could not record test times in {}: {e}",
            path.display()
        );
    }
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

/// Builds every binary of the workspace as the tests build them (so the side job and the tests
/// that start a binary find them built); the side job's executable, named after the job, and
/// its arguments.
fn build_side_job(job: SideJob) -> Result<(TestBinary, Vec<String>)> {
    let build = steward_testenv::harness::CARGO_BUILD;
    let out = super::cargo_once()
        .args(build)
        .arg("--message-format=json-render-diagnostics")
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running cargo {}", build.join(" ")))?;
    if !out.status.success() {
        bail!("building the binaries failed ({})", out.status);
    }
    let binary = executables(&String::from_utf8_lossy(&out.stdout), false)
        .into_iter()
        .find(|b| b.target == job.binary)
        .with_context(|| format!("cargo {} built no {}", build.join(" "), job.binary))?;
    Ok((
        TestBinary {
            name: job.name.to_string(),
            ..binary
        },
        job.args,
    ))
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
    let binaries = executables(&String::from_utf8_lossy(&out.stdout), true);
    if binaries.is_empty() {
        bail!("cargo test --no-run built no test binary");
    }
    Ok(binaries)
}

/// The executables in cargo's JSON messages, in cargo's order: the test executables when
/// `test`, else the binaries and examples.
fn executables(messages: &str, test: bool) -> Vec<TestBinary> {
    messages
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|m| m["reason"] == "compiler-artifact" && m["profile"]["test"] == test)
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
                target: name.to_string(),
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

fn run_one(
    binary: &TestBinary,
    test_args: &[&str],
    limit: Duration,
    log: Option<&Path>,
) -> Result<Outcome> {
    let mut command = Command::new(&binary.executable);
    command
        .args(test_args)
        .current_dir(&binary.package_dir)
        .env("CARGO_MANIFEST_DIR", &binary.package_dir)
        .envs(super::BUILT_ONCE);
    if let Some(log) = log {
        let file =
            std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
        command.stdout(file.try_clone()?).stderr(file);
    }
    let mut child = command
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
    fn executables_are_read_from_cargos_messages() {
        let messages = r#"{"reason":"compiler-artifact","manifest_path":"/w/tests/Cargo.toml","target":{"kind":["test"],"name":"real_node"},"profile":{"test":true},"executable":"/w/target/debug/deps/real_node-1"}
{"reason":"compiler-artifact","manifest_path":"/w/crates/core/Cargo.toml","target":{"kind":["lib"],"name":"steward_core"},"profile":{"test":false},"executable":null}
{"reason":"compiler-artifact","manifest_path":"/w/crates/core/Cargo.toml","target":{"kind":["lib"],"name":"steward_core"},"profile":{"test":true},"executable":"/w/target/debug/deps/steward_core-2"}
{"reason":"compiler-artifact","manifest_path":"/w/crates/bench/Cargo.toml","target":{"kind":["bin"],"name":"steward-bench"},"profile":{"test":false},"executable":"/w/target/debug/steward-bench"}
{"reason":"build-finished","success":true}"#;
        let found: Vec<(String, PathBuf, PathBuf)> = executables(messages, true)
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
        let built: Vec<(String, PathBuf)> = executables(messages, false)
            .into_iter()
            .map(|b| (b.target, b.executable))
            .collect();
        assert_eq!(
            built,
            [(
                "steward-bench".to_string(),
                PathBuf::from("/w/target/debug/steward-bench")
            )]
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

    fn binary(target: &str) -> TestBinary {
        TestBinary {
            name: format!("tests test {target}"),
            target: target.into(),
            executable: target.into(),
            package_dir: std::env::temp_dir(),
        }
    }

    #[test]
    fn the_real_node_tests_share_a_lane_and_the_longest_lanes_go_first() {
        let previous: HashMap<String, Duration> = [
            ("tests test real_node", 280),
            ("tests test postgres_cluster", 240),
            ("tests test faults", 230),
            ("tests test deploy", 20),
        ]
        .into_iter()
        .map(|(n, s)| (n.to_string(), Duration::from_secs(s)))
        .collect();
        let binaries = [
            "deploy",
            "real_node",
            "faults",
            "brand_new",
            "postgres_cluster",
        ]
        .map(binary)
        .into_iter()
        .collect();
        let lanes: Vec<Vec<String>> = lanes(binaries, &previous)
            .into_iter()
            .map(|lane| lane.into_iter().map(|b| b.target).collect())
            .collect();
        assert_eq!(
            lanes,
            [
                vec!["brand_new"],
                vec!["real_node", "postgres_cluster"],
                vec!["faults"],
                vec!["deploy"],
            ]
        );
    }

    #[test]
    fn the_real_node_lane_is_taken_apart_from_the_others() {
        let targets = |lanes: &[Vec<TestBinary>]| -> Vec<Vec<String>> {
            lanes
                .iter()
                .map(|lane| lane.iter().map(|b| b.target.clone()).collect())
                .collect()
        };
        let (node, others) = node_lane(vec![
            vec![binary("faults")],
            vec![binary("real_node"), binary("postgres_cluster")],
            vec![binary("deploy")],
        ]);
        assert_eq!(targets(&[node]), [vec!["real_node", "postgres_cluster"]]);
        assert_eq!(targets(&others), [vec!["faults"], vec!["deploy"]]);
        let (node, others) = node_lane(vec![vec![binary("deploy")]]);
        assert!(node.is_empty());
        assert_eq!(targets(&others), [vec!["deploy"]]);
    }

    #[test]
    fn test_times_survive_a_round_trip() {
        let path = std::env::temp_dir().join(format!("xtask-times-{}.tsv", std::process::id()));
        let times: HashMap<String, Duration> = [(
            "tests test faults".to_string(),
            Duration::from_millis(230_500),
        )]
        .into();
        write_times(&path, &times);
        assert_eq!(read_times(&path), times);
        std::fs::remove_file(&path).ok();
        assert!(read_times(&path).is_empty());
    }

    #[test]
    fn a_binary_over_its_limit_is_killed() {
        let binary = TestBinary {
            name: "sleep".into(),
            target: "sleep".into(),
            executable: "sleep".into(),
            package_dir: std::env::temp_dir(),
        };
        let started = Instant::now();
        let outcome = run_one(&binary, &["30"], Duration::from_millis(300), None).unwrap();
        assert!(matches!(outcome, Outcome::TimedOut));
        assert!(started.elapsed() < Duration::from_secs(10));
        let outcome = run_one(&binary, &["0"], Duration::from_secs(10), None).unwrap();
        assert!(matches!(outcome, Outcome::Passed));
    }
}
