//! `/metrics`: PgBouncer's pools and totals (`SHOW POOLS`, `SHOW STATS` on the admin console)
//! and the agent's own pause and routing figures, in Prometheus' text format.
//!
//! A scrape logs into the console afresh and is bounded ([`SCRAPE_BOUND`]); scrapes run one at
//! a time and one finished under a second ago is served again, so a flood of requests costs
//! PgBouncer at most one console session a second. When the console does not answer,
//! `steward_pooler_up` is 0 and only the agent's own figures are served.

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::admin::{self, Console, Login, Pool, Stats};

/// The most a scrape waits for PgBouncer.
pub const SCRAPE_BOUND: Duration = Duration::from_secs(3);
/// How long a scrape's answer is served again.
const REUSED_FOR: Duration = Duration::from_secs(1);

/// The agent's counters, shared by its loop (which counts) and `/metrics`.
#[derive(Debug, Default)]
pub struct Counters {
    paused: AtomicBool,
    pauses: AtomicU64,
    /// Microseconds, summed over finished pauses.
    pause_micros: AtomicU64,
    last_pause_micros: AtomicU64,
    primary_changes: AtomicU64,
}

impl Counters {
    /// PgBouncer was paused.
    pub fn paused(&self) {
        self.paused.store(true, Ordering::SeqCst);
        self.pauses.fetch_add(1, Ordering::SeqCst);
    }

    /// PgBouncer resumed after a pause of `lasted`.
    pub fn resumed(&self, lasted: Duration) {
        let micros = u64::try_from(lasted.as_micros()).unwrap_or(u64::MAX);
        self.paused.store(false, Ordering::SeqCst);
        self.pause_micros.fetch_add(micros, Ordering::SeqCst);
        self.last_pause_micros.store(micros, Ordering::SeqCst);
    }

    /// PgBouncer now points at another primary.
    pub fn primary_changed(&self) {
        self.primary_changes.fetch_add(1, Ordering::SeqCst);
    }

    fn snapshot(&self) -> Snapshot {
        Snapshot {
            paused: self.paused.load(Ordering::SeqCst),
            pauses: self.pauses.load(Ordering::SeqCst),
            pause_seconds: self.pause_micros.load(Ordering::SeqCst) as f64 / 1e6,
            last_pause_seconds: self.last_pause_micros.load(Ordering::SeqCst) as f64 / 1e6,
            primary_changes: self.primary_changes.load(Ordering::SeqCst),
        }
    }
}

/// The agent's figures at one moment.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Snapshot {
    pub paused: bool,
    pub pauses: u64,
    pub pause_seconds: f64,
    pub last_pause_seconds: f64,
    pub primary_changes: u64,
}

/// What `/metrics` serves from.
#[derive(Clone, Debug)]
pub struct Metrics {
    login: Login,
    pub counters: Arc<Counters>,
    last: Arc<tokio::sync::Mutex<Option<(Instant, String)>>>,
}

impl Metrics {
    pub fn new(login: Login, counters: Arc<Counters>) -> Self {
        Metrics {
            login,
            counters,
            last: Arc::default(),
        }
    }

    /// One scrape, or the last one if it finished under a second ago.
    pub async fn render(&self) -> String {
        let mut last = self.last.lock().await;
        if let Some((at, text)) = last.as_ref()
            && at.elapsed() < REUSED_FOR
        {
            return text.clone();
        }
        let console = match tokio::time::timeout(SCRAPE_BOUND, scrape(&self.login)).await {
            Ok(Ok(figures)) => Some(figures),
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "metrics: the admin console does not answer");
                None
            }
            Err(_) => {
                tracing::debug!("metrics: the admin console did not answer in {SCRAPE_BOUND:?}");
                None
            }
        };
        let text = exposition(
            console.as_ref().map(|(p, s)| (p.as_slice(), s.as_slice())),
            &self.counters.snapshot(),
        );
        *last = Some((Instant::now(), text.clone()));
        text
    }
}

async fn scrape(login: &Login) -> Result<(Vec<Pool>, Vec<Stats>), admin::Error> {
    let console = Console::connect(login).await?;
    let pools = admin::pools(&console.show("SHOW POOLS", SCRAPE_BOUND).await?)?;
    let stats = admin::stats(&console.show("SHOW STATS", SCRAPE_BOUND).await?)?;
    Ok((pools, stats))
}

/// The text of `/metrics`: the console's figures (`None`: it did not answer) and the
/// agent's.
pub fn exposition(console: Option<(&[Pool], &[Stats])>, agent: &Snapshot) -> String {
    let mut out = Exposition::default();
    let (pools, stats) = console.unwrap_or_default();
    let per_pool = |f: fn(&Pool) -> f64| {
        pools
            .iter()
            .map(move |p| {
                (
                    vec![("database", p.database.as_str()), ("user", p.user.as_str())],
                    f(p),
                )
            })
            .collect::<Vec<_>>()
    };
    out.family(
        "steward_pgbouncer_clients_active",
        GAUGE,
        "Client connections linked to a server connection or idle (SHOW POOLS cl_active)",
        per_pool(|p| p.cl_active),
    );
    out.family(
        "steward_pgbouncer_clients_waiting",
        GAUGE,
        "Client connections waiting for a server connection (SHOW POOLS cl_waiting)",
        per_pool(|p| p.cl_waiting),
    );
    out.family(
        "steward_pgbouncer_servers_active",
        GAUGE,
        "Server connections linked to a client (SHOW POOLS sv_active)",
        per_pool(|p| p.sv_active),
    );
    out.family(
        "steward_pgbouncer_servers_idle",
        GAUGE,
        "Server connections unused and ready (SHOW POOLS sv_idle)",
        per_pool(|p| p.sv_idle),
    );
    out.family(
        "steward_pgbouncer_servers_used",
        GAUGE,
        "Server connections idle long enough to be checked before reuse (SHOW POOLS sv_used)",
        per_pool(|p| p.sv_used),
    );
    out.family(
        "steward_pgbouncer_max_wait_seconds",
        GAUGE,
        "How long the oldest waiting client has waited (SHOW POOLS maxwait, maxwait_us)",
        per_pool(|p| p.max_wait_seconds),
    );
    let per_database = |f: fn(&Stats) -> f64| {
        stats
            .iter()
            .map(move |s| (vec![("database", s.database.as_str())], f(s)))
            .collect::<Vec<_>>()
    };
    out.family(
        "steward_pgbouncer_transactions_total",
        COUNTER,
        "Transactions pooled since PgBouncer started (SHOW STATS total_xact_count)",
        per_database(|s| s.transactions),
    );
    out.family(
        "steward_pgbouncer_queries_total",
        COUNTER,
        "Queries pooled since PgBouncer started (SHOW STATS total_query_count)",
        per_database(|s| s.queries),
    );
    out.family(
        "steward_pgbouncer_wait_seconds_total",
        COUNTER,
        "Time clients waited for a server connection (SHOW STATS total_wait_time)",
        per_database(|s| s.wait_seconds),
    );
    let one = |v: f64| vec![(Vec::new(), v)];
    out.family(
        "steward_pooler_up",
        GAUGE,
        "1 when PgBouncer's admin console answered this scrape",
        one(if console.is_some() { 1.0 } else { 0.0 }),
    );
    out.family(
        "steward_pooler_paused",
        GAUGE,
        "1 while the agent holds PgBouncer paused for a switchover",
        one(if agent.paused { 1.0 } else { 0.0 }),
    );
    out.family(
        "steward_pooler_pauses_total",
        COUNTER,
        "Pauses the agent started",
        one(agent.pauses as f64),
    );
    out.family(
        "steward_pooler_pause_seconds_total",
        COUNTER,
        "Time PgBouncer spent paused, from PAUSE to RESUME, over finished pauses",
        one(agent.pause_seconds),
    );
    out.family(
        "steward_pooler_last_pause_seconds",
        GAUGE,
        "How long the last finished pause lasted, from PAUSE to RESUME",
        one(agent.last_pause_seconds),
    );
    out.family(
        "steward_pooler_primary_changes_total",
        COUNTER,
        "Times the agent pointed PgBouncer at another primary pod",
        one(agent.primary_changes as f64),
    );
    out.text
}

const GAUGE: &str = "gauge";
const COUNTER: &str = "counter";

#[derive(Default)]
struct Exposition {
    text: String,
}

impl Exposition {
    /// Writes a family, its label values escaped.
    fn family(
        &mut self,
        name: &str,
        kind: &str,
        help: &str,
        samples: Vec<(Vec<(&str, &str)>, f64)>,
    ) {
        let _ = writeln!(self.text, "# HELP {name} {help}");
        let _ = writeln!(self.text, "# TYPE {name} {kind}");
        for (labels, value) in samples {
            self.text.push_str(name);
            if !labels.is_empty() {
                let labels: Vec<String> = labels
                    .iter()
                    .map(|(k, v)| {
                        let v = v
                            .replace('\\', "\\\\")
                            .replace('"', "\\\"")
                            .replace('\n', "\\n");
                        format!("{k}=\"{v}\"")
                    })
                    .collect();
                let _ = write!(self.text, "{{{}}}", labels.join(","));
            }
            let _ = writeln!(self.text, " {value}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admin::Table;

    #[test]
    fn show_pools_rows_become_labelled_gauges() {
        let table = Table::new(
            &[
                "database",
                "user",
                "cl_active",
                "cl_waiting",
                "sv_active",
                "sv_idle",
                "sv_used",
                "maxwait",
                "maxwait_us",
                "pool_mode",
            ],
            &[
                &[
                    "app",
                    "alice",
                    "3",
                    "2",
                    "3",
                    "1",
                    "4",
                    "1",
                    "250000",
                    "transaction",
                ],
                &[
                    "pgbouncer",
                    "pgbouncer",
                    "1",
                    "0",
                    "0",
                    "0",
                    "0",
                    "0",
                    "0",
                    "statement",
                ],
            ],
        );
        let pools = admin::pools(&table).unwrap();
        let text = exposition(Some((&pools, &[])), &Snapshot::default());
        for line in [
            r#"steward_pgbouncer_clients_active{database="app",user="alice"} 3"#,
            r#"steward_pgbouncer_clients_waiting{database="app",user="alice"} 2"#,
            r#"steward_pgbouncer_servers_active{database="app",user="alice"} 3"#,
            r#"steward_pgbouncer_servers_idle{database="app",user="alice"} 1"#,
            r#"steward_pgbouncer_servers_used{database="app",user="alice"} 4"#,
            r#"steward_pgbouncer_max_wait_seconds{database="app",user="alice"} 1.25"#,
            r#"steward_pgbouncer_clients_active{database="pgbouncer",user="pgbouncer"} 1"#,
            "# TYPE steward_pgbouncer_clients_active gauge",
            "steward_pooler_up 1",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing in\n{text}");
        }
    }

    #[test]
    fn stats_are_counters_per_database() {
        let stats = [Stats {
            database: "app".into(),
            transactions: 10.0,
            queries: 25.0,
            wait_seconds: 0.5,
        }];
        let text = exposition(Some((&[], &stats)), &Snapshot::default());
        for line in [
            "# TYPE steward_pgbouncer_transactions_total counter",
            r#"steward_pgbouncer_transactions_total{database="app"} 10"#,
            r#"steward_pgbouncer_queries_total{database="app"} 25"#,
            r#"steward_pgbouncer_wait_seconds_total{database="app"} 0.5"#,
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing in\n{text}");
        }
    }

    #[test]
    fn without_the_console_only_the_agent_figures_have_samples() {
        let counters = Counters::default();
        counters.paused();
        counters.resumed(Duration::from_millis(1500));
        counters.paused();
        counters.primary_changed();
        let text = exposition(None, &counters.snapshot());
        for line in [
            "steward_pooler_up 0",
            "steward_pooler_paused 1",
            "steward_pooler_pauses_total 2",
            "steward_pooler_pause_seconds_total 1.5",
            "steward_pooler_last_pause_seconds 1.5",
            "steward_pooler_primary_changes_total 1",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing in\n{text}");
        }
        assert!(
            !text.contains("steward_pgbouncer_clients_active{"),
            "{text}"
        );
    }

    #[test]
    fn label_values_are_escaped() {
        let pools = [Pool {
            database: "we\"ird\\db".into(),
            user: "u\nx".into(),
            cl_active: 1.0,
            cl_waiting: 0.0,
            sv_active: 0.0,
            sv_idle: 0.0,
            sv_used: 0.0,
            max_wait_seconds: 0.0,
        }];
        let text = exposition(Some((&pools, &[])), &Snapshot::default());
        assert!(
            text.contains(
                r#"steward_pgbouncer_clients_active{database="we\"ird\\db",user="u\nx"} 1"#
            ),
            "{text}"
        );
    }
}
