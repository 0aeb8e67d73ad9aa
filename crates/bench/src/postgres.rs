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
const SETTINGS: &str = "Lease 10 s, renew deadline 6 s, retry 1 s; stream timeout default";

/// Where `cargo xtask chaos postgres` appends what each step measured, run after run: the
/// campaign report is made from every run recorded there.
const CAMPAIGN_RECORDS: &str = "target/bench/postgres-campaign.jsonl";

/// One fault, as a test recorded it (or, with `campaign` set, the end of a campaign run as
/// `chaos` recorded it).
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
pub struct Record {
    #[serde(default)]
    pub scenario: String,
    #[serde(default)]
    pub instances: i32,
    /// `synchronousReplicas` (0: asynchronous).
    #[serde(default)]
    pub synchronous: i32,
    /// The campaign's seed, for a campaign's step.
    #[serde(default)]
    pub seed: Option<u64>,
    #[serde(default)]
    pub unavailable_ms: u64,
    /// From the fault until every instance was ready again.
    #[serde(default)]
    pub recovered_ms: Option<u64>,
    /// Rows acknowledged during the step.
    #[serde(default)]
    pub written: Option<u64>,
    #[serde(default)]
    pub lost: i64,
    /// A campaign run's end: its seed, steps, outcome and duration.
    #[serde(default)]
    pub campaign: Option<CampaignRun>,
    /// A load line: what the clients committing through the pooler saw during the scenario
    /// (the scenario's unavailability is its own line).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pooled: Option<LoadTally>,
    /// With `pooled`: the same load straight to the `-rw` Service, when the scenario ran it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub direct: Option<LoadTally>,
}

impl Record {
    /// A load line (see [`LoadTally`]), not a fault's unavailability.
    fn is_load(&self) -> bool {
        self.pooled.is_some() || self.direct.is_some()
    }
}

/// What `clients` committing short transactions (`BEGIN`, `INSERT`, `COMMIT`) back to back saw
/// during one scenario.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
pub struct LoadTally {
    #[serde(default)]
    pub clients: u64,
    #[serde(default)]
    pub commits: u64,
    /// Failed statements, broken connections and refused reconnects.
    #[serde(default)]
    pub errors: u64,
    /// Connections broken.
    #[serde(default)]
    pub broken: u64,
    /// The longest transaction.
    #[serde(default)]
    pub longest_ms: u64,
}

/// How one `cargo xtask chaos postgres` run ended.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct CampaignRun {
    pub seed: u64,
    pub steps: usize,
    pub passed: bool,
    pub secs: u64,
}

/// A scenario (on one cluster shape) over every run.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    pub scenario: String,
    /// `3 × sync 2`, `2 × async`.
    pub cluster: String,
    pub runs: usize,
    pub min_s: f64,
    pub median_s: f64,
    pub max_s: f64,
    /// From the fault until every instance was ready again: median and max, when recorded.
    pub recovered_median_s: Option<f64>,
    pub recovered_max_s: Option<f64>,
    /// Rows acknowledged during the steps.
    pub written: u64,
    /// Acknowledged rows lost, summed over the runs.
    pub lost: i64,
}

/// A scenario's load (on one cluster shape) over every run.
#[derive(Clone, Debug, Serialize)]
pub struct LoadRow {
    pub scenario: String,
    /// `3 × sync 2`, `2 × async`.
    pub cluster: String,
    /// Load lines recorded.
    pub runs: usize,
    /// Through the pooler.
    pub pooled: LoadSum,
    /// Straight to the `-rw` Service, when any run recorded it.
    pub direct: Option<LoadSum>,
}

/// [`LoadTally`]s summed over runs: the most clients, the commits, errors and broken
/// connections summed, the longest transaction of all.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct LoadSum {
    /// Runs that recorded this load.
    pub runs: usize,
    pub clients: u64,
    pub commits: u64,
    pub errors: u64,
    pub broken: u64,
    pub longest_s: f64,
}

impl LoadSum {
    fn of<'a>(tallies: impl IntoIterator<Item = &'a LoadTally>) -> Option<Self> {
        tallies.into_iter().fold(None, |sum, t| {
            let sum: LoadSum = sum.unwrap_or_default();
            Some(LoadSum {
                runs: sum.runs + 1,
                clients: sum.clients.max(t.clients),
                commits: sum.commits + t.commits,
                errors: sum.errors + t.errors,
                broken: sum.broken + t.broken,
                longest_s: sum.longest_s.max(t.longest_ms as f64 / 1000.0),
            })
        })
    }
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
/// drawn from `seed` (see `postgres_cluster_fails_over_and_never_has_two_writers`). Each
/// step's figures are appended to `target/bench/postgres-campaign.jsonl`, with the run's end;
/// then `docs/benchmarks-postgres-campaign.md` (and `.json`) are written from every run
/// recorded there, failed ones included.
///
/// # Errors
/// When the campaign fails: its output (inherited) names the seed and the step.
pub fn chaos(root: &Path, seed: u64, steps: usize) -> Result<()> {
    let started = Instant::now();
    let records = root.join(CAMPAIGN_RECORDS);
    std::fs::create_dir_all(records.parent().context("record path")?)?;
    let mut cmd = cargo_test_scenarios(root, &[TESTS[0], "--nocapture"]);
    cmd.env("STEWARD_CHAOS_SEED", seed.to_string())
        .env("STEWARD_CHAOS_STEPS", steps.to_string())
        .env("STEWARD_BENCH_RECORD", &records);
    let status = cmd.status().context("cargo test")?;
    let end = Record {
        campaign: Some(CampaignRun {
            seed,
            steps,
            passed: status.success(),
            secs: started.elapsed().as_secs(),
        }),
        ..Record::default()
    };
    {
        use std::io::Write;
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&records)?;
        writeln!(file, "{}", serde_json::to_string(&end)?)?;
    }
    let all = read_records(&records)?;
    let out = root.join("docs");
    std::fs::write(
        out.join("benchmarks-postgres-campaign.json"),
        serde_json::to_string_pretty(&serde_json::json!({
            "settings": SETTINGS, "rows": rows(&all), "pooler_rows": load_rows(&all),
            "runs": runs_of(&all),
        }))?,
    )?;
    std::fs::write(
        out.join("benchmarks-postgres-campaign.md"),
        campaign_markdown(&all),
    )?;
    if !status.success() {
        bail!(
            "the fault campaign with seed {seed} ({steps} steps) failed ({status}); replay it with the same --seed and --steps"
        );
    }
    eprintln!(
        "chaos: seed {seed}, {steps} steps passed in {:.0?}; docs/benchmarks-postgres-campaign.md written from {}",
        started.elapsed(),
        records.display()
    );
    Ok(())
}

/// The records in `path` (JSON lines).
fn read_records(path: &Path) -> Result<Vec<Record>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("{}", path.display()))?;
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).context("a record"))
        .collect()
}

/// The campaign runs' ends among `records`.
fn runs_of(records: &[Record]) -> Vec<CampaignRun> {
    records.iter().filter_map(|r| r.campaign.clone()).collect()
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
    let records = read_records(&record)?;
    let rows = rows(&records);
    let load = load_rows(&records);
    std::fs::create_dir_all(out)?;
    std::fs::write(
        out.join("benchmarks-postgres.json"),
        serde_json::to_string_pretty(&serde_json::json!({
            "settings": SETTINGS, "runs": runs, "rows": rows, "pooler_rows": load,
            "records": records,
        }))?,
    )?;
    std::fs::write(
        out.join("benchmarks-postgres.md"),
        markdown(&rows, &load, runs, started.elapsed()),
    )?;
    eprintln!(
        "bench: wrote {} and {}",
        out.join("benchmarks-postgres.md").display(),
        out.join("benchmarks-postgres.json").display()
    );
    Ok(())
}

/// The cluster shape of a record: `3 × sync 2`, `2 × async`.
fn shape(r: &Record) -> String {
    if r.synchronous > 0 {
        format!("{} × sync {}", r.instances, r.synchronous)
    } else {
        format!("{} × async", r.instances)
    }
}

fn median_max(mut xs: Vec<f64>) -> (f64, f64) {
    xs.sort_by(f64::total_cmp);
    (xs[xs.len() / 2], xs[xs.len() - 1])
}

/// `records` by scenario and cluster shape, in the order first recorded.
fn grouped<'a>(
    records: impl Iterator<Item = &'a Record>,
) -> Vec<((String, String), Vec<&'a Record>)> {
    let mut groups: Vec<((String, String), Vec<&Record>)> = Vec::new();
    let mut at: BTreeMap<(String, String), usize> = BTreeMap::new();
    for r in records {
        let key = (r.scenario.clone(), shape(r));
        let i = *at.entry(key.clone()).or_insert_with(|| {
            groups.push((key, Vec::new()));
            groups.len() - 1
        });
        groups[i].1.push(r);
    }
    groups
}

/// One row per scenario and cluster shape, in the order first recorded (campaign ends and
/// load lines are not faults).
pub fn rows(records: &[Record]) -> Vec<Row> {
    grouped(
        records
            .iter()
            .filter(|r| r.campaign.is_none() && !r.is_load()),
    )
    .into_iter()
    .map(|((scenario, cluster), rs)| {
        let mut secs: Vec<f64> = rs
            .iter()
            .map(|r| r.unavailable_ms as f64 / 1000.0)
            .collect();
        secs.sort_by(f64::total_cmp);
        let recovered: Vec<f64> = rs
            .iter()
            .filter_map(|r| r.recovered_ms)
            .map(|ms| ms as f64 / 1000.0)
            .collect();
        let (recovered_median_s, recovered_max_s) = if recovered.is_empty() {
            (None, None)
        } else {
            let (m, x) = median_max(recovered);
            (Some(m), Some(x))
        };
        Row {
            scenario,
            cluster,
            runs: rs.len(),
            min_s: secs[0],
            median_s: secs[secs.len() / 2],
            max_s: secs[secs.len() - 1],
            recovered_median_s,
            recovered_max_s,
            written: rs.iter().filter_map(|r| r.written).sum(),
            lost: rs.iter().map(|r| r.lost).sum(),
        }
    })
    .collect()
}

/// One row per scenario and cluster shape with load lines, in the order first recorded.
pub fn load_rows(records: &[Record]) -> Vec<LoadRow> {
    grouped(
        records
            .iter()
            .filter(|r| r.campaign.is_none() && r.is_load()),
    )
    .into_iter()
    .map(|((scenario, cluster), rs)| LoadRow {
        scenario,
        cluster,
        runs: rs.len(),
        pooled: LoadSum::of(rs.iter().filter_map(|r| r.pooled.as_ref())).unwrap_or_default(),
        direct: LoadSum::of(rs.iter().filter_map(|r| r.direct.as_ref())),
    })
    .collect()
}

/// "Through the pooler": the explanation, then the table (nothing when no load was recorded).
fn load_table(md: &mut String, rows: &[LoadRow]) {
    if rows.is_empty() {
        return;
    }
    md.push_str(
        "\n## Through the pooler\n\n\
         During the scenarios below, clients commit short transactions (`BEGIN`, `INSERT`, `COMMIT`) \
         back to back through the cluster's PgBouncer pooler and, in the scenarios that measure \
         it, the same load straight to the `-rw` Service (\"–\" where not). \"Errors\" counts \
         every failed statement, broken connection and refused reconnect, \"broken\" the \
         connections lost, both summed over the runs; \"longest\" is the longest transaction \
         of any run.\n\n",
    );
    md.push_str("| scenario | cluster | runs | clients | pooler commits | errors | broken | longest | `-rw` commits | errors | broken | longest |\n");
    md.push_str("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    let cells = |s: Option<&LoadSum>| {
        s.map_or_else(
            || "– | – | – | –".to_string(),
            |s| {
                format!(
                    "{} | {} | {} | {:.1} s",
                    s.commits, s.errors, s.broken, s.longest_s
                )
            },
        )
    };
    for r in rows {
        md.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} |\n",
            r.scenario,
            r.cluster,
            r.runs,
            r.pooled.clients,
            cells(Some(&r.pooled)),
            cells(r.direct.as_ref())
        ));
    }
}

fn table(md: &mut String, rows: &[Row]) {
    md.push_str("| scenario | cluster | runs | unavailable min | median | max | recovered median | max | rows acknowledged | lost |\n");
    md.push_str("|---|---|---|---|---|---|---|---|---|---|\n");
    let secs = |s: Option<f64>| s.map_or_else(|| "–".to_string(), |s| format!("{s:.1} s"));
    for r in rows {
        md.push_str(&format!(
            "| {} | {} | {} | {:.1} s | {:.1} s | {:.1} s | {} | {} | {} | {} |\n",
            r.scenario,
            r.cluster,
            r.runs,
            r.min_s,
            r.median_s,
            r.max_s,
            secs(r.recovered_median_s),
            secs(r.recovered_max_s),
            r.written,
            r.lost
        ));
    }
}

fn markdown(rows: &[Row], load: &[LoadRow], runs: usize, took: Duration) -> String {
    let mut md = String::from(
        "# PostgreSQL failover and switchover\n\n\
         Generated by `cargo xtask bench --postgres N` (as root: the real node); do not edit.\n\n",
    );
    md.push_str(&format!(
        "Settings: {SETTINGS}. {runs} run(s) of each scenario, {:.0} s in all. \"Unavailable\" is the \
         longest gap between writes acknowledged through the `-rw` Service around the fault \
         (a client writes every 50 ms); \"recovered\" runs from the fault until every instance is \
         ready again; \"lost\" counts acknowledged rows missing afterwards, \
         summed over the runs. Every run also asserts that the old primary accepted no write \
         once the new one had. The scenarios are the variants of `Fault` in \
         `tests/tests/postgres_cluster.rs`, each documented there: the campaign's default run \
         (each failure once, 3 instances, every commit on every instance) and the planned moves \
         (2 instances).\n\n",
        took.as_secs_f64()
    ));
    table(&mut md, rows);
    load_table(&mut md, load);
    md
}

/// The campaign report: the runs (seed, steps, outcome), then the faults by kind.
fn campaign_markdown(records: &[Record]) -> String {
    let runs = runs_of(records);
    let rows = rows(records);
    let steps: usize = rows.iter().map(|r| r.runs).sum();
    let written: u64 = rows.iter().map(|r| r.written).sum();
    let lost: i64 = rows.iter().map(|r| r.lost).sum();
    let mut md = String::from(
        "# PostgreSQL fault campaign\n\n\
         Generated by `cargo xtask chaos postgres --seed S --steps N` (as root: the real node) \
         from every run recorded in `target/bench/postgres-campaign.jsonl`; do not edit.\n\n",
    );
    md.push_str(&format!(
        "Settings: {SETTINGS}. {} run(s), {} passed; {steps} fault steps completed, {written} rows \
         acknowledged, {lost} lost. After every step the campaign asserts: a primary accepts \
         writes again within its bound, the old primary accepted no write once the new one had \
         (probed from inside its pod's network namespace), no acknowledged row is missing, every \
         instance is ready again; at the end of a run, every row of every step is still there and \
         no pod log holds a password. A failed run stops at the failing step (its steps before \
         are counted above).\n\n",
        runs.len(),
        runs.iter().filter(|r| r.passed).count()
    ));
    md.push_str("| seed | steps | result | duration |\n|---|---|---|---|\n");
    for r in &runs {
        md.push_str(&format!(
            "| {} | {} | {} | {:.0} min |\n",
            r.seed,
            r.steps,
            if r.passed { "passed" } else { "failed" },
            r.secs as f64 / 60.0
        ));
    }
    md.push_str("\n## Faults by kind\n\n");
    table(&mut md, &rows);
    load_table(&mut md, &load_rows(records));
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
            ..Record::default()
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
        let md = markdown(&rows, &[], 3, Duration::from_secs(90));
        assert!(
            md.contains("| KillPostgres | 2 × async | 3 | 1.0 s | 2.0 s | 3.0 s | – | – | 0 | 2 |"),
            "{md}"
        );
    }

    #[test]
    fn the_campaign_report_counts_runs_steps_and_shapes_apart() {
        let step = |scenario: &str, synchronous, recovered| Record {
            scenario: scenario.into(),
            instances: 3,
            synchronous,
            seed: Some(5),
            unavailable_ms: 4000,
            recovered_ms: Some(recovered),
            written: Some(100),
            ..Record::default()
        };
        let end = |passed| Record {
            campaign: Some(CampaignRun {
                seed: 5,
                steps: 2,
                passed,
                secs: 120,
            }),
            ..Record::default()
        };
        let records = [
            step("DeletePod", 2, 20_000),
            step("DeletePod", 2, 30_000),
            end(true),
            step("DeletePod", 0, 10_000),
            end(false),
        ];
        let rows = rows(&records);
        assert_eq!(rows.len(), 2, "{rows:?}");
        assert_eq!(
            (
                rows[0].cluster.as_str(),
                rows[0].runs,
                rows[0].recovered_max_s,
                rows[0].written
            ),
            ("3 × sync 2", 2, Some(30.0), 200)
        );
        let md = campaign_markdown(&records);
        assert!(
            md.contains("2 run(s), 1 passed; 3 fault steps completed, 300 rows"),
            "{md}"
        );
        assert!(md.contains("| 5 | 2 | failed | 2 min |"), "{md}");
    }

    /// Lines as `record_for_bench` and `record_load_for_bench` in
    /// `tests/tests/postgres_cluster.rs` write them.
    fn switchover_records() -> Vec<Record> {
        [
            r#"{"scenario":"Switchover","instances":2,"synchronous":0,"seed":null,"unavailable_ms":1500,"recovered_ms":9000,"written":40,"lost":0}"#,
            r#"{"scenario":"Switchover","instances":2,"synchronous":0,"pooled":{"clients":20,"commits":2459,"errors":0,"broken":0,"longest_ms":2390},"direct":{"clients":20,"commits":4415,"errors":302,"broken":20,"longest_ms":402}}"#,
            r#"{"scenario":"ThreeSwitchoversInARow","instances":2,"synchronous":0,"pooled":{"clients":20,"commits":7000,"errors":1,"broken":0,"longest_ms":3100},"direct":null}"#,
            r#"{"scenario":"Switchover","instances":2,"synchronous":0,"seed":null,"unavailable_ms":2500,"recovered_ms":11000,"written":50,"lost":0}"#,
            r#"{"scenario":"Switchover","instances":2,"synchronous":0,"pooled":{"clients":20,"commits":2000,"errors":3,"broken":1,"longest_ms":1800},"direct":{"clients":20,"commits":4000,"errors":250,"broken":20,"longest_ms":610}}"#,
            r#"{"scenario":"ThreeSwitchoversInARow","instances":2,"synchronous":0,"pooled":{"clients":20,"commits":6500,"errors":0,"broken":0,"longest_ms":4200},"direct":null}"#,
        ]
        .iter()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
    }

    #[test]
    fn load_lines_leave_the_unavailability_rows_alone() {
        let all = switchover_records();
        let faults: Vec<Record> = all.iter().filter(|r| !r.is_load()).cloned().collect();
        assert_eq!(faults.len(), 2);
        let (with, without) = (rows(&all), rows(&faults));
        assert_eq!(
            serde_json::to_value(&with).unwrap(),
            serde_json::to_value(&without).unwrap()
        );
        assert_eq!(with.len(), 1, "{with:?}");
        assert_eq!(
            (with[0].runs, with[0].min_s, with[0].max_s, with[0].written),
            (2, 1.5, 2.5, 90)
        );
        // Load lines round-trip; fault lines gain no `pooled` or `direct`.
        let line = serde_json::to_string(&all[1]).unwrap();
        assert!(
            line.contains(r#""direct":{"clients":20,"commits":4415"#),
            "{line}"
        );
        assert!(!serde_json::to_string(&all[0]).unwrap().contains("pooled"));
    }

    #[test]
    fn pooler_rows_sum_the_counts_and_keep_the_longest_transaction() {
        let all = switchover_records();
        let load = load_rows(&all);
        assert_eq!(load.len(), 2, "{load:?}");
        assert_eq!(
            (
                load[0].scenario.as_str(),
                load[0].cluster.as_str(),
                load[0].runs
            ),
            ("Switchover", "2 × async", 2)
        );
        assert_eq!(
            load[0].pooled,
            LoadSum {
                runs: 2,
                clients: 20,
                commits: 4459,
                errors: 3,
                broken: 1,
                longest_s: 2.39
            }
        );
        assert_eq!(
            load[0].direct,
            Some(LoadSum {
                runs: 2,
                clients: 20,
                commits: 8415,
                errors: 552,
                broken: 40,
                longest_s: 0.61
            })
        );
        assert_eq!(load[1].scenario, "ThreeSwitchoversInARow");
        assert_eq!(
            (
                load[1].pooled.commits,
                load[1].pooled.longest_s,
                &load[1].direct
            ),
            (13_500, 4.2, &None)
        );
        let md = markdown(&rows(&all), &load, 2, Duration::from_secs(600));
        assert!(md.contains("## Through the pooler"), "{md}");
        assert!(
            md.contains("| Switchover | 2 × async | 2 | 20 | 4459 | 3 | 1 | 2.4 s | 8415 | 552 | 40 | 0.6 s |"),
            "{md}"
        );
        assert!(
            md.contains("| ThreeSwitchoversInARow | 2 × async | 2 | 20 | 13500 | 1 | 0 | 4.2 s | – | – | – | – |"),
            "{md}"
        );
        // No load recorded, no pooler section.
        assert!(!markdown(&rows(&all), &[], 2, Duration::ZERO).contains("pooler"));
    }
}
