//! `/metrics`: PostgreSQL's own figures from this instance, in Prometheus' text format.
//!
//! Each scrape runs the built-in queries and those of the mounted ConfigMap
//! ([`monitoring::QUERIES_DIR`], one YAML list per key) as `steward_monitor`, a login role
//! with `pg_monitor` and no password (it can connect only through the pod's own socket), each
//! in a read-only transaction bounded by its `statement_timeout`. A query that fails or runs
//! past its bound is reported (`steward_pg_query_error{query} 1`) and the others are served.
//! Besides the queries: `steward_pg_up`, and on the primary `steward_pg_member_lag_bytes`, how
//! far behind each replica is by the position it last published on its pod (a replica whose
//! walreceiver stopped is no longer in `pg_stat_replication`, but its lag still grows here).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use steward_database_api::monitoring::{self, Kind, Query};
use tokio_postgres::types::{FromSql, Type};

use crate::contract::PG_PORT;

/// The login role the queries run as.
pub const MONITOR_USER: &str = "steward_monitor";

/// What `/metrics` serves from: the instance's socket directory, the queries, and what the
/// manager loop knows (the replicas' lag).
#[derive(Clone, Debug)]
pub struct Metrics {
    socket_dir: PathBuf,
    queries_dir: PathBuf,
    members: Arc<Mutex<BTreeMap<String, u64>>>,
    /// The last scrape and when it finished; held while one runs, so scrapes never overlap.
    last: Arc<tokio::sync::Mutex<Option<(Instant, String)>>>,
}

impl Metrics {
    pub fn new(socket_dir: PathBuf, queries_dir: PathBuf) -> Self {
        Self {
            socket_dir,
            queries_dir,
            members: Arc::default(),
            last: Arc::default(),
        }
    }

    /// On the primary: each replica's lag, in bytes, by the positions they published; empty
    /// elsewhere.
    pub fn set_member_lag(&self, lag: BTreeMap<String, u64>) {
        *self.members.lock().unwrap_or_else(PoisonError::into_inner) = lag;
    }

    /// One scrape, or the last one if it finished under [`REUSED_FOR`] ago: one at a time,
    /// so any number of requests (two Prometheus replicas, or a flood from inside the cluster)
    /// costs PostgreSQL at most one run of the queries at a time and one a second.
    pub async fn render(&self) -> String {
        let mut last = self.last.lock().await;
        if let Some((at, text)) = last.as_ref()
            && at.elapsed() < REUSED_FOR
        {
            return text.clone();
        }
        let text = self.scrape().await;
        *last = Some((Instant::now(), text.clone()));
        text
    }

    async fn scrape(&self) -> String {
        let mut out = Exposition::default();
        let (user, file_errors) = user_queries(&self.queries_dir, monitoring::builtin());
        for (file, error) in &file_errors {
            tracing::warn!(%file, %error, "metrics queries not served");
        }
        out.family(
            "steward_pg_queries_file_error",
            Kind::Gauge,
            "1 when a file of the queries' ConfigMap cannot be served (the instance manager's log says why)",
            file_errors
                .iter()
                .map(|(file, _)| (vec![("file".to_string(), file.clone())], 1.0)),
        );
        let members = self
            .members
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        out.family(
            "steward_pg_member_lag_bytes",
            Kind::Gauge,
            "On the primary: WAL between its position and the one each replica last published, in bytes",
            members
                .into_iter()
                .map(|(member, lag)| (vec![("member".to_string(), member)], lag as f64)),
        );
        let mut sessions = Sessions::new(&self.socket_dir);
        let version = match sessions.get("postgres").await {
            Ok(client) => server_version(client).await,
            Err(e) => Err(e),
        };
        let version = match version {
            Ok(v) => v,
            Err(e) => {
                tracing::debug!(error = %e.message, "metrics: PostgreSQL does not answer");
                out.family("steward_pg_up", Kind::Gauge, UP_HELP, [(vec![], 0.0)]);
                return out.text;
            }
        };
        out.family("steward_pg_up", Kind::Gauge, UP_HELP, [(vec![], 1.0)]);
        let mut outcomes = Vec::new();
        let queries = monitoring::builtin().iter().chain(user.iter());
        for query in queries.filter(|q| q.runs_on(version)) {
            let started = Instant::now();
            let result = match sessions.get(query.database()).await {
                Ok(client) => run(client, query).await,
                Err(e) => Err(e),
            };
            if matches!(&result, Err(e) if e.broken) {
                sessions.drop(query.database());
            }
            match result {
                Ok(rows) => {
                    for (metric, samples) in query.metrics.iter().zip(rows) {
                        out.family(
                            &query.metric_name(metric),
                            metric.kind,
                            &metric.help,
                            samples,
                        );
                    }
                    outcomes.push((query.name.clone(), false, started.elapsed()));
                }
                Err(e) => {
                    tracing::warn!(query = %query.name, error = %e.message, "a metrics query failed");
                    outcomes.push((query.name.clone(), true, started.elapsed()));
                }
            }
        }
        out.family(
            "steward_pg_query_error",
            Kind::Gauge,
            "1 when the metrics query failed or ran past its timeout in this scrape",
            outcomes.iter().map(|(name, failed, _)| {
                (
                    vec![("query".to_string(), name.clone())],
                    f64::from(u8::from(*failed)),
                )
            }),
        );
        out.family(
            "steward_pg_query_duration_seconds",
            Kind::Gauge,
            "How long the metrics query took in this scrape",
            outcomes.iter().map(|(name, _, took)| {
                (
                    vec![("query".to_string(), name.clone())],
                    took.as_secs_f64(),
                )
            }),
        );
        out.text
    }
}

/// How long a scrape's text is served again.
const REUSED_FOR: Duration = Duration::from_secs(1);

const UP_HELP: &str = "1 when PostgreSQL answered the metrics connection";

/// The queries of every file in `dir` (a mounted ConfigMap: its keys, not the `..data`
/// links), and the files that cannot be served, with why.
fn user_queries(dir: &Path, builtin: &[Query]) -> (Vec<Query>, Vec<(String, String)>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return (Vec::new(), Vec::new());
    };
    let mut files: Vec<(String, PathBuf)> = entries
        .filter_map(Result::ok)
        .map(|e| (e.file_name().to_string_lossy().into_owned(), e.path()))
        .filter(|(name, path)| !name.starts_with('.') && path.is_file())
        .collect();
    files.sort();
    let (mut texts, mut unreadable) = (Vec::new(), Vec::new());
    for (name, path) in files {
        match std::fs::read_to_string(&path) {
            Ok(text) => texts.push((name, text)),
            Err(e) => unreadable.push((name, e.to_string())),
        }
    }
    let keys = texts
        .iter()
        .map(|(name, text)| (name.as_str(), text.as_str()));
    let (queries, mut left_out) = monitoring::from_keys(keys, builtin);
    left_out.append(&mut unreadable);
    (queries, left_out)
}

/// One connection per database, opened on first use in a scrape. A database that could not
/// be connected to is not tried again in the same scrape: with PostgreSQL hung, each attempt
/// would wait out the connect timeout, once per query.
struct Sessions<'a> {
    socket_dir: &'a Path,
    open: BTreeMap<String, tokio_postgres::Client>,
    refused: BTreeMap<String, String>,
}

impl<'a> Sessions<'a> {
    fn new(socket_dir: &'a Path) -> Self {
        Self {
            socket_dir,
            open: BTreeMap::new(),
            refused: BTreeMap::new(),
        }
    }

    async fn get(&mut self, database: &str) -> Result<&mut tokio_postgres::Client, Failed> {
        if let Some(why) = self.refused.get(database) {
            return Err(Failed::query(why.clone()));
        }
        if !self.open.contains_key(database) {
            match connect(self.socket_dir, database).await {
                Ok(client) => {
                    self.open.insert(database.to_string(), client);
                }
                Err(e) => {
                    self.refused.insert(database.to_string(), e.message.clone());
                    return Err(e);
                }
            }
        }
        self.open
            .get_mut(database)
            .ok_or_else(|| Failed::broken("no connection"))
    }

    fn drop(&mut self, database: &str) {
        self.open.remove(database);
    }
}

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

async fn connect(socket_dir: &Path, database: &str) -> Result<tokio_postgres::Client, Failed> {
    let mut config = tokio_postgres::Config::new();
    config
        .host_path(socket_dir)
        .port(PG_PORT)
        .user(MONITOR_USER)
        .dbname(database)
        .application_name("steward-metrics")
        .connect_timeout(CONNECT_TIMEOUT);
    let (client, connection) =
        tokio::time::timeout(CONNECT_TIMEOUT, config.connect(tokio_postgres::NoTls))
            .await
            .map_err(|_| Failed::broken("connecting timed out"))?
            .map_err(|e| Failed::broken(e.to_string()))?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(client)
}

async fn server_version(client: &tokio_postgres::Client) -> Result<u32, Failed> {
    let row = tokio::time::timeout(
        CONNECT_TIMEOUT,
        client.query_one("select current_setting('server_version_num')::int", &[]),
    )
    .await
    .map_err(|_| Failed::broken("timed out"))?
    .map_err(|e| Failed::broken(e.to_string()))?;
    Ok(u32::try_from(row.get::<_, i32>(0)).unwrap_or(0))
}

/// Why a query gave nothing; `broken`: its connection is not to be used again.
#[derive(Debug)]
struct Failed {
    message: String,
    broken: bool,
}

impl Failed {
    fn broken(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            broken: true,
        }
    }

    fn query(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            broken: false,
        }
    }
}

/// A family's samples: label pairs and a value.
type Samples = Vec<(Vec<(String, String)>, f64)>;

/// Runs `query` in a read-only transaction bounded by its timeout; the samples of each of its
/// metrics, in order.
async fn run(client: &mut tokio_postgres::Client, query: &Query) -> Result<Vec<Samples>, Failed> {
    let timeout = query.timeout();
    // The server's bound first; the client's a little later, for a server that does not
    // answer at all (its connection is then dropped).
    let begin = format!(
        "set transaction read only; set local statement_timeout = {}",
        timeout.as_millis().max(1)
    );
    let sql = query.query.as_str();
    // Through a portal, at most one row past the bound: a query that returns millions of
    // rows must not fill this process's memory (it is PID 1 of the pod).
    let limit = i32::try_from(MAX_ROWS + 1).unwrap_or(i32::MAX);
    let rows = tokio::time::timeout(timeout + Duration::from_secs(1), async {
        let tx = client.transaction().await?;
        tx.batch_execute(&begin).await?;
        let statement = tx.prepare(sql).await?;
        let portal = tx.bind(&statement, &[]).await?;
        let rows = tx.query_portal(&portal, limit).await;
        tx.rollback().await?;
        rows
    })
    .await
    .map_err(|_| Failed::broken(format!("ran past {timeout:?}")))?
    .map_err(|e| Failed::query(error_text(&e)))?;
    if rows.len() > MAX_ROWS {
        return Err(Failed::query(format!(
            "it returns more than {MAX_ROWS} rows; served: none"
        )));
    }
    samples(query, &rows).map_err(Failed::query)
}

/// The most rows one query may return.
const MAX_ROWS: usize = 10_000;

fn error_text(e: &tokio_postgres::Error) -> String {
    e.as_db_error()
        .map_or_else(|| e.to_string(), |db| db.message().to_string())
}

/// The samples of each metric of `query` from its `rows`; a NULL value is no sample.
fn samples(query: &Query, rows: &[tokio_postgres::Row]) -> Result<Vec<Samples>, String> {
    let mut out: Vec<Samples> = vec![Vec::new(); query.metrics.len()];
    let Some(first) = rows.first() else {
        return Ok(out);
    };
    let index = |column: &str| {
        first
            .columns()
            .iter()
            .position(|c| c.name() == column)
            .ok_or_else(|| format!("column {column:?} is not in the query's result"))
    };
    let labels: Vec<(String, usize)> = query
        .labels
        .iter()
        .map(|l| Ok((l.clone(), index(l)?)))
        .collect::<Result<_, String>>()?;
    let metrics: Vec<usize> = query
        .metrics
        .iter()
        .map(|m| index(&m.column))
        .collect::<Result<_, String>>()?;
    for row in rows {
        let mut pairs = Vec::with_capacity(labels.len());
        for (name, i) in &labels {
            let value: Option<Text> = row
                .try_get(*i)
                .map_err(|e| format!("label column {name:?}: {e}"))?;
            pairs.push((name.clone(), value.map(|t| t.0).unwrap_or_default()));
        }
        for (k, i) in metrics.iter().enumerate() {
            let value: Option<Number> = row
                .try_get(*i)
                .map_err(|e| format!("metric column {:?}: {e}", query.metrics[k].column))?;
            if let Some(Number(v)) = value {
                out[k].push((pairs.clone(), v));
            }
        }
    }
    Ok(out)
}

/// A metric's value: any number PostgreSQL returns (integers, floats, `numeric`, `oid`) or
/// a boolean (1 or 0).
#[derive(Debug, PartialEq)]
struct Number(f64);

impl<'a> FromSql<'a> for Number {
    fn from_sql(
        ty: &Type,
        raw: &'a [u8],
    ) -> Result<Self, Box<dyn std::error::Error + Sync + Send>> {
        Ok(Number(match *ty {
            Type::BOOL => f64::from(u8::from(bool::from_sql(ty, raw)?)),
            Type::INT2 => f64::from(i16::from_sql(ty, raw)?),
            Type::INT4 => f64::from(i32::from_sql(ty, raw)?),
            Type::INT8 => i64::from_sql(ty, raw)? as f64,
            Type::OID => f64::from(u32::from_sql(ty, raw)?),
            Type::FLOAT4 => f64::from(f32::from_sql(ty, raw)?),
            Type::FLOAT8 => f64::from_sql(ty, raw)?,
            Type::NUMERIC => numeric(raw)?,
            _ => return Err(format!("{ty} is not a number: cast it (::float8)").into()),
        }))
    }

    fn accepts(ty: &Type) -> bool {
        matches!(
            *ty,
            Type::BOOL
                | Type::INT2
                | Type::INT4
                | Type::INT8
                | Type::OID
                | Type::FLOAT4
                | Type::FLOAT8
                | Type::NUMERIC
        )
    }
}

/// `numeric`'s binary form: digit count, weight, sign, scale, then base-10000 digits.
fn numeric(raw: &[u8]) -> Result<f64, Box<dyn std::error::Error + Sync + Send>> {
    let word = |i: usize| -> Result<u16, Box<dyn std::error::Error + Sync + Send>> {
        raw.get(i * 2..i * 2 + 2)
            .map(|b| u16::from_be_bytes([b[0], b[1]]))
            .ok_or_else(|| "a numeric value is truncated".into())
    };
    let (count, weight, sign) = (word(0)?, word(1)? as i16, word(2)?);
    match sign {
        0xC000 => return Ok(f64::NAN),
        0xD000 => return Ok(f64::INFINITY),
        0xF000 => return Ok(f64::NEG_INFINITY),
        _ => {}
    }
    let mut value = 0.0;
    for i in 0..usize::from(count) {
        let exponent = i32::from(weight) - i32::try_from(i).unwrap_or(i32::MAX);
        value += f64::from(word(4 + i)?) * 10_000f64.powi(exponent);
    }
    Ok(if sign == 0x4000 { -value } else { value })
}

/// A label's value: text, or a number or boolean written out.
#[derive(Debug, PartialEq)]
struct Text(String);

impl<'a> FromSql<'a> for Text {
    fn from_sql(
        ty: &Type,
        raw: &'a [u8],
    ) -> Result<Self, Box<dyn std::error::Error + Sync + Send>> {
        if <&str as FromSql>::accepts(ty) {
            return Ok(Text(<&str>::from_sql(ty, raw)?.to_string()));
        }
        let Number(v) = Number::from_sql(ty, raw)?;
        Ok(Text(v.to_string()))
    }

    fn accepts(ty: &Type) -> bool {
        <&str as FromSql>::accepts(ty) || Number::accepts(ty)
    }
}

/// Prometheus' text format (0.0.4), one family after another.
#[derive(Default)]
struct Exposition {
    text: String,
    named: std::collections::BTreeSet<String>,
}

impl Exposition {
    /// Writes a family; its samples' label values escaped. A name already written (two
    /// queries of one name on this server) is skipped: a family appears once.
    fn family(
        &mut self,
        name: &str,
        kind: Kind,
        help: &str,
        samples: impl IntoIterator<Item = (Vec<(String, String)>, f64)>,
    ) {
        if !self.named.insert(name.to_string()) {
            return;
        }
        let help = help.replace('\\', "\\\\").replace('\n', "\\n");
        let _ = writeln!(self.text, "# HELP {name} {help}");
        let _ = writeln!(self.text, "# TYPE {name} {}", kind.as_str());
        for (labels, value) in samples {
            self.text.push_str(name);
            if !labels.is_empty() {
                self.text.push('{');
                for (i, (k, v)) in labels.iter().enumerate() {
                    if i > 0 {
                        self.text.push(',');
                    }
                    let v = v
                        .replace('\\', "\\\\")
                        .replace('"', "\\\"")
                        .replace('\n', "\\n");
                    let _ = write!(self.text, "{k}=\"{v}\"");
                }
                self.text.push('}');
            }
            let _ = writeln!(self.text, " {}", number(value));
        }
    }
}

/// A sample value as Prometheus writes it.
fn number(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v == f64::INFINITY {
        "+Inf".into()
    } else if v == f64::NEG_INFINITY {
        "-Inf".into()
    } else {
        v.to_string()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn numeric_bytes(count: u16, weight: i16, sign: u16, scale: u16, digits: &[u16]) -> Vec<u8> {
        let mut raw = Vec::new();
        for w in [count, weight as u16, sign, scale].iter().chain(digits) {
            raw.extend_from_slice(&w.to_be_bytes());
        }
        raw
    }

    #[test]
    fn numeric_values_are_decoded() {
        // 12345678.9 = 1234 5678 . 9000
        let raw = numeric_bytes(3, 1, 0, 1, &[1234, 5678, 9000]);
        assert!((numeric(&raw).unwrap() - 12_345_678.9).abs() < 1e-6);
        // -0.0042 = 0.0042: weight -1, digit 42
        let raw = numeric_bytes(1, -1, 0x4000, 4, &[42]);
        assert!((numeric(&raw).unwrap() + 0.0042).abs() < 1e-12);
        assert_eq!(numeric(&numeric_bytes(0, 0, 0, 0, &[])).unwrap(), 0.0);
        assert!(
            numeric(&numeric_bytes(0, 0, 0xC000, 0, &[]))
                .unwrap()
                .is_nan()
        );
        assert!(numeric(&[0, 2, 0, 0]).is_err());
    }

    #[test]
    fn the_exposition_escapes_label_values_and_writes_a_family_once() {
        let mut out = Exposition::default();
        out.family(
            "app_x",
            Kind::Counter,
            "help with \\ and\nnewline",
            [(vec![("l".to_string(), "a\"b\\c\nd".to_string())], 2.5)],
        );
        out.family("app_x", Kind::Gauge, "again", [(vec![], 1.0)]);
        out.family("app_y", Kind::Gauge, "", [(vec![], f64::NAN)]);
        assert_eq!(
            out.text,
            "# HELP app_x help with \\\\ and\\nnewline\n# TYPE app_x counter\n\
             app_x{l=\"a\\\"b\\\\c\\nd\"} 2.5\n# HELP app_y \n# TYPE app_y gauge\napp_y NaN\n"
        );
    }

    #[test]
    fn user_queries_come_from_the_mounted_files_and_bad_files_are_named() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("app.yaml"),
            "- {name: app_orders, query: select 1 as n, metrics: [{column: n}]}",
        )
        .unwrap();
        std::fs::write(dir.path().join("broken.yaml"), "- {name: x").unwrap();
        std::fs::write(
            dir.path().join("clash.yaml"),
            "- {name: steward_pg_locks, query: select 1 as n, metrics: [{column: n}]}",
        )
        .unwrap();
        // A ConfigMap volume's own links are not keys.
        std::fs::create_dir(dir.path().join("..data")).unwrap();
        let (queries, errors) = user_queries(dir.path(), monitoring::builtin());
        assert_eq!(
            queries.iter().map(|q| q.name.as_str()).collect::<Vec<_>>(),
            ["app_orders"]
        );
        let named: Vec<&str> = errors.iter().map(|(f, _)| f.as_str()).collect();
        assert_eq!(named, ["broken.yaml", "clash.yaml"]);
        assert!(user_queries(&dir.path().join("absent"), &[]).0.is_empty());
    }
}
