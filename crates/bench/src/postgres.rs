//! `cargo xtask bench --postgres N`: PostgreSQL failover and switchover on the real node, N
//! times, written to `docs/benchmarks-postgres.md` and `.json`.
//!
//! The scenarios are the real-node tests' own (`tests/tests/postgres_cluster.rs`: a client
//! writing every 50 ms through the `-rw` Service while the harness kills PostgreSQL, deletes
//! the primary's pod, SIGSTOPs its instance manager, partitions it, asks for a switchover,
//! kills the operator mid-switchover, rolls a parameter change). Each test appends what it
//! measured to the file named by `STEWARD_BENCH_RECORD`; this runs them `runs` times and
//! tabulates the records, so the figures and the assertions come from one harness. Needs
//! root (the real node).

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};

/// The tests that measure, in `tests/tests/postgres_cluster.rs`.
const TESTS: &[&str] = &[
    "postgres_cluster_fails_over_and_never_has_two_writers",
    "postgres_cluster_switches_over_and_rolls_a_parameter_change_with_one_switchover",
];

/// The instance managers' Lease timings the tests run with (their defaults).
const SETTINGS: &str = "Lease 10 s, renew deadline 6 s, retry 1 s; stream timeout default; asynchronous replication; 2 instances";

/// One fault, as a test recorded it.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct Record {
    pub scenario: String,
    pub instances: i32,
    pub unavailable_ms: u64,
    pub lost: i64,
}

/// A scenario over every run.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    pub scenario: String,
    pub runs: usize,
    pub min_s: f64,
    pub median_s: f64,
    pub max_s: f64,
    /// Acknowledged rows lost, summed over the runs.
    pub lost: i64,
}

/// `cargo test` of `tests` (exact names) in `tests/tests/postgres_cluster.rs`, one at a time.
pub fn cargo_test_scenarios(root: &Path, tests: &[&str]) -> std::process::Command {
    let mut cmd = steward_testenv::harness::cargo_command();
    cmd.current_dir(root)
        .args([
            "test",
            "-p",
            "steward-integration-tests",
            "--test",
            "postgres_cluster",
            "--",
            "--exact",
            "--test-threads",
            "1",
        ])
        .args(tests);
    cmd
}

/// `cargo xtask chaos postgres`: the failover test's seeded fault campaign, `steps` faults
/// drawn from `seed` (see `postgres_cluster_fails_over_and_never_has_two_writers`).
///
/// # Errors
/// When the campaign fails: its output (inherited) names the seed and the step.
pub fn chaos(root: &Path, seed: u64, steps: usize) -> Result<()> {
    let started = Instant::now();
    let mut cmd = cargo_test_scenarios(root, &[TESTS[0], "--nocapture"]);
    cmd.env("STEWARD_CHAOS_SEED", seed.to_string())
        .env("STEWARD_CHAOS_STEPS", steps.to_string());
    let status = cmd.status().context("cargo test")?;
    if !status.success() {
        bail!(
            "the fault campaign with seed {seed} ({steps} steps) failed ({status}); replay it with the same --seed and --steps"
        );
    }
    eprintln!(
        "chaos: seed {seed}, {steps} steps passed in {:.0?}",
        started.elapsed()
    );
    Ok(())
}

/// Runs the scenarios `runs` times and writes the report into `out`.
///
/// # Errors
/// When a test fails (its output is inherited) or the records cannot be read.
pub fn run(root: &Path, runs: usize, out: &Path) -> Result<()> {
    if runs == 0 {
        bail!("--postgres takes the number of runs (at least 1)");
    }
    let record = root.join("target/bench/postgres-records.jsonl");
    std::fs::create_dir_all(record.parent().context("record path")?)?;
    let _ = std::fs::remove_file(&record);
    let started = Instant::now();
    for run in 1..=runs {
        eprintln!("bench: PostgreSQL failover and switchover, run {run} of {runs}");
        let mut cmd = cargo_test_scenarios(root, TESTS);
        cmd.env("STEWARD_BENCH_RECORD", &record);
        let status = cmd.status().context("cargo test")?;
        if !status.success() {
            bail!("run {run}: the PostgreSQL scenarios failed ({status})");
        }
    }
    let text = std::fs::read_to_string(&record).context("the tests' records")?;
    let records: Vec<Record> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()
        .context("a record")?;
    let rows = rows(&records);
    std::fs::create_dir_all(out)?;
    std::fs::write(
        out.join("benchmarks-postgres.json"),
        serde_json::to_string_pretty(&serde_json::json!({
            "settings": SETTINGS, "runs": runs, "rows": rows, "records": records,
        }))?,
    )?;
    std::fs::write(
        out.join("benchmarks-postgres.md"),
        markdown(&rows, runs, started.elapsed()),
    )?;
    eprintln!(
        "bench: wrote {} and {}",
        out.join("benchmarks-postgres.md").display(),
        out.join("benchmarks-postgres.json").display()
    );
    Ok(())
}

/// One row per scenario, in the order first recorded.
pub fn rows(records: &[Record]) -> Vec<Row> {
    let mut order: Vec<&str> = Vec::new();
    let mut by: BTreeMap<&str, Vec<&Record>> = BTreeMap::new();
    for r in records {
        if !by.contains_key(r.scenario.as_str()) {
            order.push(&r.scenario);
        }
        by.entry(&r.scenario).or_default().push(r);
    }
    order
        .into_iter()
        .map(|scenario| {
            let rs = &by[scenario];
            let mut secs: Vec<f64> = rs
                .iter()
                .map(|r| r.unavailable_ms as f64 / 1000.0)
                .collect();
            secs.sort_by(f64::total_cmp);
            Row {
                scenario: scenario.to_string(),
                runs: rs.len(),
                min_s: secs[0],
                median_s: secs[secs.len() / 2],
                max_s: secs[secs.len() - 1],
                lost: rs.iter().map(|r| r.lost).sum(),
            }
        })
        .collect()
}

fn markdown(rows: &[Row], runs: usize, took: Duration) -> String {
    let mut md = String::from(
        "# PostgreSQL failover and switchover\n\n\
         Generated by `cargo xtask bench --postgres N` (as root: the real node); do not edit.\n\n",
    );
    md.push_str(&format!(
        "Settings: {SETTINGS}. {runs} run(s) of each scenario, {:.0} s in all. \"Unavailable\" is the \
         longest gap between writes acknowledged through the `-rw` Service around the fault \
         (a client writes every 50 ms); \"lost\" counts acknowledged rows missing afterwards, \
         summed over the runs. Every run also asserts that the old primary accepted no write \
         once the new one had. The scenarios are the variants of `Fault` in \
         `tests/tests/postgres_cluster.rs`, each documented there.\n\n",
        took.as_secs_f64()
    ));
    md.push_str("| scenario | runs | unavailable min | median | max | acknowledged rows lost |\n");
    md.push_str("|---|---|---|---|---|---|\n");
    for r in rows {
        md.push_str(&format!(
            "| {} | {} | {:.1} s | {:.1} s | {:.1} s | {} |\n",
            r.scenario, r.runs, r.min_s, r.median_s, r.max_s, r.lost
        ));
    }
    md
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_summarise_each_scenario_in_first_seen_order() {
        let r = |scenario: &str, ms, lost| Record {
            scenario: scenario.into(),
            instances: 2,
            unavailable_ms: ms,
            lost,
        };
        let rows = rows(&[
            r("KillPostgres", 3000, 0),
            r("DeletePod", 5000, 1),
            r("KillPostgres", 1000, 0),
            r("KillPostgres", 2000, 2),
        ]);
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].scenario, "KillPostgres");
        assert_eq!(
            (
                rows[0].runs,
                rows[0].min_s,
                rows[0].median_s,
                rows[0].max_s,
                rows[0].lost
            ),
            (3, 1.0, 2.0, 3.0, 2)
        );
        assert_eq!((rows[1].runs, rows[1].lost), (1, 1));
        let md = markdown(&rows, 3, Duration::from_secs(90));
        assert!(
            md.contains("| KillPostgres | 3 | 1.0 s | 2.0 s | 3.0 s | 2 |"),
            "{md}"
        );
    }
}
