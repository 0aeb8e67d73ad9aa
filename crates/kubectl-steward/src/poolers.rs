//! `kubectl steward status <cluster>`: a PostgresCluster's PgBouncer pods (`spec.pooler`) by
//! what their pooler agents say, read from each agent's `/metrics` through the API server's
//! pod proxy, as the instances are (a row says why it could not be read). [`rows`] is pure:
//! the headline figures from the scraped texts.

use kube::{Client, ResourceExt};
use serde::Serialize;
use steward_database_api::contract::pooler::{HTTP_PORT, LABEL};

use crate::Error;
use crate::instances::{label, samples, scrape};

/// PgBouncer's own admin pool (`SHOW` commands), left out of the sums.
const ADMIN_DATABASE: &str = "pgbouncer";

/// One pooler pod's headline figures.
#[derive(Debug, Default, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PoolerRow {
    pub name: String,
    /// The pod's `Ready` condition.
    pub ready: bool,
    /// `serving`, `paused` (for a switchover) or `down` (PgBouncer's console does not answer
    /// its agent); `None` when the metrics could not be read.
    pub state: Option<String>,
    /// Why the metrics could not be read (then every figure is `None`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unavailable: Option<String>,
    /// Client connections running a transaction (or ready to), over the pools.
    pub clients_active: Option<u64>,
    /// Client connections waiting for a server connection.
    pub clients_waiting: Option<u64>,
    /// How long the oldest waiting client has waited, the longest over the pools.
    pub max_wait_seconds: Option<f64>,
    /// Server connections to the primary, active and idle.
    pub servers_active: Option<u64>,
    pub servers_idle: Option<u64>,
    /// Pauses the agent started (switchovers), since it started.
    pub pauses: Option<u64>,
    /// How long the last finished pause held clients (`None` before the first).
    pub last_pause_seconds: Option<f64>,
    /// Times the agent pointed PgBouncer at another primary.
    pub primary_changes: Option<u64>,
}

/// The pooler pods of `cluster` in `namespace`, each scraped through the API server (none
/// without `spec.pooler`).
///
/// # Errors
/// [`Error::Api`] when the pooler pods cannot be listed.
pub async fn gather(
    client: &Client,
    namespace: &str,
    cluster: &str,
) -> Result<Vec<PoolerRow>, Error> {
    let scraped = scrape(client, namespace, &format!("{LABEL}={cluster}"), HTTP_PORT)
        .await
        .map_err(Error::api(format!("list the pooler pods of {cluster}")))?
        .into_iter()
        .map(|(pod, text)| {
            let ready = pod
                .status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
            (pod.name_any(), ready, text)
        })
        .collect::<Vec<_>>();
    Ok(rows(&scraped))
}

/// The rows of the pooler pods scraped: name, whether the pod is ready, and its metrics
/// (`Err`: why not).
pub fn rows(scraped: &[(String, bool, Result<String, String>)]) -> Vec<PoolerRow> {
    scraped
        .iter()
        .map(|(name, ready, text)| {
            let text = match text {
                Ok(text) => text,
                Err(why) => {
                    return PoolerRow {
                        name: name.clone(),
                        ready: *ready,
                        unavailable: Some(why.clone()),
                        ..PoolerRow::default()
                    };
                }
            };
            let one = |series: &str| samples(text, series).first().map(|(_, v)| *v);
            let count = |v: f64| v.max(0.0) as u64;
            // The client pools' samples of a per-pool family (none while PgBouncer is down).
            let pools = |series: &str| -> Vec<f64> {
                samples(text, series)
                    .into_iter()
                    .filter(|(labels, _)| {
                        label(labels, "database").as_deref() != Some(ADMIN_DATABASE)
                    })
                    .map(|(_, v)| v)
                    .collect()
            };
            let up = one("steward_pooler_up") == Some(1.0);
            let sum = |series: &str| up.then(|| count(pools(series).iter().sum()));
            let paused = one("steward_pooler_paused") == Some(1.0);
            let pauses = one("steward_pooler_pauses_total").map(count);
            // Pauses that finished: the one under way has no length yet.
            let finished = pauses.map(|n| n.saturating_sub(u64::from(paused)));
            PoolerRow {
                name: name.clone(),
                ready: *ready,
                state: Some(
                    match (up, paused) {
                        (false, _) => "down",
                        (true, true) => "paused",
                        (true, false) => "serving",
                    }
                    .into(),
                ),
                clients_active: sum("steward_pgbouncer_clients_active"),
                clients_waiting: sum("steward_pgbouncer_clients_waiting"),
                max_wait_seconds: up.then(|| {
                    pools("steward_pgbouncer_max_wait_seconds")
                        .into_iter()
                        .fold(0.0, f64::max)
                }),
                servers_active: sum("steward_pgbouncer_servers_active"),
                servers_idle: sum("steward_pgbouncer_servers_idle"),
                last_pause_seconds: finished
                    .filter(|n| *n > 0)
                    .and(one("steward_pooler_last_pause_seconds")),
                pauses,
                primary_changes: one("steward_pooler_primary_changes_total").map(count),
                unavailable: None,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pooler in front of `app` for two users, PgBouncer's admin pool beside them, after
    /// two switchovers.
    const SERVING: &str = "\
# HELP steward_pgbouncer_clients_active x
# TYPE steward_pgbouncer_clients_active gauge
steward_pgbouncer_clients_active{database=\"app\",user=\"alice\"} 3
steward_pgbouncer_clients_active{database=\"app\",user=\"bob\"} 2
steward_pgbouncer_clients_active{database=\"pgbouncer\",user=\"pgbouncer\"} 1
steward_pgbouncer_clients_waiting{database=\"app\",user=\"alice\"} 2
steward_pgbouncer_clients_waiting{database=\"pgbouncer\",user=\"pgbouncer\"} 4
steward_pgbouncer_servers_active{database=\"app\",user=\"alice\"} 3
steward_pgbouncer_servers_active{database=\"app\",user=\"bob\"} 2
steward_pgbouncer_servers_idle{database=\"app\",user=\"alice\"} 1
steward_pgbouncer_max_wait_seconds{database=\"app\",user=\"alice\"} 1.25
steward_pgbouncer_max_wait_seconds{database=\"app\",user=\"bob\"} 0.5
steward_pgbouncer_max_wait_seconds{database=\"pgbouncer\",user=\"pgbouncer\"} 9
steward_pgbouncer_transactions_total{database=\"app\"} 10
steward_pooler_up 1
steward_pooler_paused 0
steward_pooler_pauses_total 2
steward_pooler_last_pause_seconds 0.35
steward_pooler_primary_changes_total 2
";

    /// Paused for a switchover, its first.
    const PAUSED: &str = "\
steward_pgbouncer_clients_waiting{database=\"app\",user=\"alice\"} 5
steward_pooler_up 1
steward_pooler_paused 1
steward_pooler_pauses_total 1
steward_pooler_last_pause_seconds 0
";

    /// PgBouncer's console does not answer: the agent's own figures alone.
    const DOWN: &str = "\
steward_pooler_up 0
steward_pooler_paused 0
steward_pooler_pauses_total 0
steward_pooler_last_pause_seconds 0
steward_pooler_primary_changes_total 0
";

    #[test]
    fn the_sums_leave_pgbouncer_s_admin_pool_out_and_a_pause_or_an_outage_shows() {
        let rows = rows(&[
            ("pg-pooler-a".into(), true, Ok(SERVING.into())),
            ("pg-pooler-b".into(), true, Ok(PAUSED.into())),
            ("pg-pooler-c".into(), false, Ok(DOWN.into())),
            (
                "pg-pooler-d".into(),
                false,
                Err("forbidden (needs get on pods/proxy)".into()),
            ),
        ]);
        let serving = &rows[0];
        assert_eq!(serving.state.as_deref(), Some("serving"));
        assert!(serving.ready);
        assert_eq!(serving.clients_active, Some(5));
        assert_eq!(serving.clients_waiting, Some(2));
        assert_eq!(serving.max_wait_seconds, Some(1.25));
        assert_eq!(
            (serving.servers_active, serving.servers_idle),
            (Some(5), Some(1))
        );
        assert_eq!(serving.pauses, Some(2));
        assert_eq!(serving.last_pause_seconds, Some(0.35));
        assert_eq!(serving.primary_changes, Some(2));

        let paused = &rows[1];
        assert_eq!(paused.state.as_deref(), Some("paused"));
        assert_eq!(paused.clients_waiting, Some(5));
        // A pool without a sample counts nothing, and no client waits past no pool.
        assert_eq!(paused.servers_active, Some(0));
        assert_eq!(paused.max_wait_seconds, Some(0.0));
        // The first pause has not finished: no last pause yet.
        assert_eq!(paused.last_pause_seconds, None);

        let down = &rows[2];
        assert_eq!(down.state.as_deref(), Some("down"));
        assert!(!down.ready);
        assert_eq!((down.clients_active, down.max_wait_seconds), (None, None));
        assert_eq!((down.pauses, down.last_pause_seconds), (Some(0), None));

        let unreadable = &rows[3];
        assert_eq!(unreadable.state, None);
        assert_eq!(
            unreadable.unavailable.as_deref(),
            Some("forbidden (needs get on pods/proxy)")
        );
    }
}
