//! The metrics queries each instance manager runs for its `/metrics`: its built-in ones and
//! those of the ConfigMap `spec.monitoring.queriesConfigMap` names (every key a YAML list of
//! [`Query`]). Parsed and checked here, so that the operator reports a bad ConfigMap with the
//! same words the instance manager would use.
//!
//! ```yaml
//! - name: app_orders             # metrics are named <name>_<column>
//!   database: shop               # default: postgres
//!   timeoutSeconds: 2            # default 5, at most 60
//!   query: select status, count(*) as count from orders group by status
//!   labels: [status]             # columns that become labels
//!   metrics:
//!     - {column: count, type: gauge, help: "Orders by status"}
//! ```

use std::collections::BTreeSet;
use std::time::Duration;

use serde::Deserialize;

/// The default bound of a query.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);
/// The longest bound a query may ask for.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(60);
/// Where the instance manager finds the queries' ConfigMap (mounted, each key a file).
pub const QUERIES_DIR: &str = "/steward/monitoring";

/// One query and the metrics it yields: one sample per row and metric column.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Query {
    pub name: String,
    pub query: String,
    #[serde(default)]
    pub database: Option<String>,
    #[serde(default)]
    pub labels: Vec<String>,
    pub metrics: Vec<Metric>,
    #[serde(default)]
    pub timeout_seconds: Option<f64>,
    /// Runs only on servers at least this `server_version_num` (`170000`: PostgreSQL 17).
    #[serde(default)]
    pub min_server_version: Option<u32>,
    /// Runs only on servers at most this `server_version_num`.
    #[serde(default)]
    pub max_server_version: Option<u32>,
}

/// A column of a [`Query`]'s result served as a metric.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Metric {
    pub column: String,
    #[serde(default, rename = "type")]
    pub kind: Kind,
    #[serde(default)]
    pub help: String,
}

/// The Prometheus type of a [`Metric`].
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    #[default]
    Gauge,
    Counter,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Gauge => "gauge",
            Kind::Counter => "counter",
        }
    }
}

impl Query {
    /// The bound of one run.
    pub fn timeout(&self) -> Duration {
        self.timeout_seconds
            .map_or(DEFAULT_TIMEOUT, Duration::from_secs_f64)
    }

    /// The database the query runs in.
    pub fn database(&self) -> &str {
        self.database.as_deref().unwrap_or("postgres")
    }

    /// Whether the query runs on a server of `server_version_num` `version`.
    pub fn runs_on(&self, version: u32) -> bool {
        self.min_server_version.is_none_or(|min| version >= min)
            && self.max_server_version.is_none_or(|max| version <= max)
    }

    /// The name of the metric of `metric`.
    pub fn metric_name(&self, metric: &Metric) -> String {
        format!("{}_{}", self.name, metric.column)
    }

    /// Why the query cannot run as written, if so.
    pub fn check(&self) -> Result<(), String> {
        let named = |what: &str, name: &str| {
            if valid_name(name) {
                Ok(())
            } else {
                Err(format!(
                    "{what} {name:?} is not a Prometheus name ([a-zA-Z_][a-zA-Z0-9_]*)"
                ))
            }
        };
        named("query name", &self.name)?;
        let fail = |why: String| Err(format!("query {}: {why}", self.name));
        if self.query.trim().is_empty() {
            return fail("its SQL is empty".into());
        }
        if self.metrics.is_empty() {
            return fail("it lists no metrics".into());
        }
        match self.timeout_seconds {
            Some(t) if !(t > 0.0 && t <= MAX_TIMEOUT.as_secs_f64()) => {
                return fail(format!(
                    "timeoutSeconds {t} is not in (0, {}]",
                    MAX_TIMEOUT.as_secs()
                ));
            }
            _ => {}
        }
        let mut columns = BTreeSet::new();
        for label in &self.labels {
            named("label column", label).or_else(fail)?;
            if label.starts_with("__") {
                return fail(format!(
                    "label {label:?}: names starting with __ are reserved"
                ));
            }
            if !columns.insert(label.as_str()) {
                return fail(format!("column {label:?} is listed twice"));
            }
        }
        for metric in &self.metrics {
            named("metric column", &metric.column).or_else(fail)?;
            if !columns.insert(metric.column.as_str()) {
                return fail(format!("column {:?} is listed twice", metric.column));
            }
        }
        Ok(())
    }
}

/// `[a-zA-Z_][a-zA-Z0-9_]*`.
fn valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// The queries of one YAML document (a list), each checked.
pub fn parse(yaml: &str) -> Result<Vec<Query>, String> {
    let queries: Vec<Query> = serde_yaml::from_str(yaml).map_err(|e| e.to_string())?;
    for query in &queries {
        query.check()?;
    }
    Ok(queries)
}

/// The queries of a ConfigMap's keys (`(key, text)`, in order), as the instance manager
/// serves them: a key that does not parse, or whose queries clash with the built-in ones or
/// an earlier key's ([`clashes`]), is left out whole and returned with why; the others are
/// served. The operator reports the first key left out (condition `MetricsQueries`).
pub fn from_keys<'a>(
    keys: impl IntoIterator<Item = (&'a str, &'a str)>,
    builtin: &[Query],
) -> (Vec<Query>, Vec<(String, String)>) {
    let (mut queries, mut left_out) = (Vec::new(), Vec::new());
    for (key, text) in keys {
        let served = queries.len();
        let checked = parse(text).and_then(|more| {
            queries.extend(more);
            clashes(&queries, builtin)
        });
        if let Err(why) = checked {
            queries.truncate(served);
            left_out.push((key.to_string(), why));
        }
    }
    (queries, left_out)
}

/// The instance manager's built-in queries, parsed once per process.
pub fn builtin() -> &'static [Query] {
    // Checked by a unit test: a bad built-in file fails the build's tests, not a scrape.
    static PARSED: std::sync::LazyLock<Vec<Query>> =
        std::sync::LazyLock::new(|| parse(BUILTIN).unwrap_or_default());
    &PARSED
}

/// The built-in queries, as YAML (also the example of the format).
pub const BUILTIN: &str = include_str!("monitoring/builtin.yaml");

/// Why user queries (`ours`) cannot be served beside the built-in ones, if so: a name a
/// built-in query already uses, or two user queries of one name.
pub fn clashes(ours: &[Query], builtin: &[Query]) -> Result<(), String> {
    let taken: BTreeSet<&str> = builtin.iter().map(|q| q.name.as_str()).collect();
    let mut seen = BTreeSet::new();
    for query in ours {
        if taken.contains(query.name.as_str()) {
            return Err(format!(
                "query {}: the name is a built-in query's",
                query.name
            ));
        }
        // The query's name and every metric it makes: `steward` with a column `pg_up` would
        // otherwise serve `steward_pg_up` (or the per-query error series) in the built-ins'
        // place.
        let names = std::iter::once(query.name.clone())
            .chain(query.metrics.iter().map(|m| query.metric_name(m)));
        if let Some(name) = names.into_iter().find(|n| n.starts_with("steward_pg_")) {
            return Err(format!(
                "query {}: {name}: names starting with steward_pg_ are the built-in metrics'",
                query.name
            ));
        }
        if !seen.insert((
            query.name.as_str(),
            query.min_server_version,
            query.max_server_version,
        )) {
            return Err(format!("query {}: the name is used twice", query.name));
        }
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_built_in_queries_parse_and_are_checked() {
        let builtin = parse(BUILTIN).unwrap();
        assert!(builtin.len() >= 10, "{}", builtin.len());
        assert!(builtin.iter().all(|q| q.name.starts_with("steward_pg_")));
        // Two checkpoint queries, for servers before and from PostgreSQL 17.
        let checkpoints: Vec<_> = builtin
            .iter()
            .filter(|q| q.name == "steward_pg_checkpoints")
            .collect();
        assert_eq!(checkpoints.len(), 2);
        assert!(checkpoints[0].runs_on(150_004) && !checkpoints[0].runs_on(170_000));
        assert!(!checkpoints[1].runs_on(150_004) && checkpoints[1].runs_on(170_002));
        assert_eq!(checkpoints[0].metrics, checkpoints[1].metrics);
    }

    #[test]
    fn bad_queries_are_refused_naming_what_is_wrong() {
        let refused = |yaml: &str| parse(yaml).unwrap_err();
        assert!(
            refused("- {name: a-b, query: select 1, metrics: [{column: x}]}")
                .contains("not a Prometheus name")
        );
        assert!(refused("- {name: a, query: ' ', metrics: [{column: x}]}").contains("empty"));
        assert!(refused("- {name: a, query: select 1, metrics: []}").contains("no metrics"));
        assert!(
            refused("- {name: a, query: select 1, timeoutSeconds: 600, metrics: [{column: x}]}")
                .contains("timeoutSeconds 600")
        );
        assert!(
            refused("- {name: a, query: select 1, labels: [x], metrics: [{column: x}]}")
                .contains("listed twice")
        );
        assert!(
            refused("- {name: a, query: select 1, metrics: [{column: x, type: histogram}]}")
                .contains("unknown variant")
        );
        assert!(
            refused("- {name: a, sql: select 1, metrics: [{column: x}]}").contains("unknown field")
        );
        let ok =
            parse("- {name: app, query: select 1 as x, metrics: [{column: x, type: counter}]}")
                .unwrap();
        assert_eq!(ok[0].metric_name(&ok[0].metrics[0]), "app_x");
        assert_eq!(ok[0].timeout(), DEFAULT_TIMEOUT);
        assert_eq!(ok[0].database(), "postgres");
        assert!(clashes(&ok, builtin()).is_ok());
        let builtin_name =
            parse("- {name: steward_pg_locks, query: select 1 as x, metrics: [{column: x}]}")
                .unwrap();
        assert!(
            clashes(&builtin_name, builtin())
                .unwrap_err()
                .contains("built-in")
        );
        let spoofing =
            parse("- {name: steward, query: select 0 as pg_up, metrics: [{column: pg_up}]}")
                .unwrap();
        assert!(
            clashes(&spoofing, builtin())
                .unwrap_err()
                .contains("steward_pg_up: names starting with steward_pg_")
        );
        let twice = [ok[0].clone(), ok[0].clone()];
        assert!(clashes(&twice, &[]).unwrap_err().contains("used twice"));
    }
}
