//! `kubectl steward status <cluster>`: a PostgresCluster's instances by what PostgreSQL says,
//! read from each instance manager's `/metrics` through the API server's pod proxy (the user
//! needs `get` on `pods/proxy`; without it, or with a pod unreachable, the row says why).
//! [`rows`] is pure: the headline figures from the scraped texts. `scrape`, `samples` and
//! `label` serve [`crate::poolers`] too.

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use kube::{Client, ResourceExt};
use serde::Serialize;
use steward_database_api::contract::{CLUSTER_LABEL, HTTP_PORT};

use crate::Error;

/// One instance's headline figures.
#[derive(Debug, Default, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct InstanceRow {
    pub name: String,
    /// `primary`, `replica`, or `None` when the metrics could not be read.
    pub role: Option<String>,
    /// Client connections and `max_connections`.
    pub connections: Option<(u64, u64)>,
    /// A replica's lag in bytes: as the primary sees it (the position the replica last
    /// published), else what it received and has not replayed.
    pub lag_bytes: Option<u64>,
    /// Whether a replica streams from the primary.
    pub streaming: Option<bool>,
    pub oldest_transaction_seconds: Option<f64>,
    /// The largest `age(datfrozenxid)` of its databases.
    pub frozen_xid_age: Option<u64>,
    /// Seconds since a WAL file was archived (`Some(None)`: archiving on, nothing archived).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_archived_seconds: Option<Option<f64>>,
    /// The metrics queries that failed in this scrape.
    pub failing_queries: Vec<String>,
    /// Why the metrics could not be read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unavailable: Option<String>,
}

/// The instances of `cluster` in `namespace`, each scraped through the API server.
///
/// # Errors
/// [`Error::Api`] when the pods cannot be listed.
pub async fn gather(
    client: &Client,
    namespace: &str,
    cluster: &str,
) -> Result<Vec<InstanceRow>, Error> {
    let selector = format!("{CLUSTER_LABEL}={cluster}");
    let scraped = scrape(client, namespace, &selector, HTTP_PORT)
        .await
        .map_err(Error::api(format!("list the pods of {cluster}")))?
        .into_iter()
        .map(|(pod, text)| (pod.name_any(), text))
        .collect::<Vec<_>>();
    Ok(rows(&scraped))
}

/// The pods of `namespace` that `selector` picks, sorted by name, each with its `/metrics` on
/// `port` read through the API server's pod proxy (`Err`: why not, in a cell's words).
///
/// # Errors
/// The kube error when the pods cannot be listed.
pub(crate) async fn scrape(
    client: &Client,
    namespace: &str,
    selector: &str,
    port: u16,
) -> Result<Vec<(Pod, Result<String, String>)>, kube::Error> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let mut listed = pods
        .list(&ListParams::default().labels(selector))
        .await?
        .items;
    listed.sort_by_key(ResourceExt::name_any);
    let mut scraped = Vec::new();
    for pod in listed {
        let name = pod.name_any();
        let path = format!("/api/v1/namespaces/{namespace}/pods/{name}:{port}/proxy/metrics");
        let text = match http::Request::get(&path).body(Vec::new()) {
            Ok(request) => client.request_text(request).await.map_err(|e| short(&e)),
            Err(e) => Err(e.to_string()),
        };
        scraped.push((pod, text));
    }
    Ok(scraped)
}

/// A kube error in a cell's words.
fn short(e: &kube::Error) -> String {
    match e {
        kube::Error::Api(s) if s.is_forbidden() => "forbidden (needs get on pods/proxy)".into(),
        kube::Error::Api(s) => s.message.clone(),
        other => other.to_string(),
    }
}

/// The rows of the instances scraped (`Err`: why not), the primary's view of each replica's
/// lag included.
pub fn rows(scraped: &[(String, Result<String, String>)]) -> Vec<InstanceRow> {
    // What the primary says of each replica, by name.
    let member_lag: Vec<(String, f64)> = scraped
        .iter()
        .filter_map(|(_, text)| text.as_ref().ok())
        .flat_map(|text| samples(text, "steward_pg_member_lag_bytes"))
        .filter_map(|(labels, v)| Some((label(&labels, "member")?, v)))
        .collect();
    scraped
        .iter()
        .map(|(name, text)| {
            let text = match text {
                Ok(text) => text,
                Err(why) => {
                    return InstanceRow {
                        name: name.clone(),
                        unavailable: Some(why.clone()),
                        ..InstanceRow::default()
                    };
                }
            };
            let one = |series: &str| samples(text, series).first().map(|(_, v)| *v);
            if one("steward_pg_up") != Some(1.0) {
                return InstanceRow {
                    name: name.clone(),
                    unavailable: Some("PostgreSQL does not answer its instance manager".into()),
                    ..InstanceRow::default()
                };
            }
            let replica = one("steward_pg_instance_in_recovery") == Some(1.0);
            let count = |v: f64| v.max(0.0) as u64;
            let connections: f64 = samples(text, "steward_pg_connections_count")
                .iter()
                .map(|(_, v)| v)
                .sum();
            let primary_says = member_lag
                .iter()
                .find(|(member, _)| member == name)
                .map(|(_, v)| count(*v));
            InstanceRow {
                name: name.clone(),
                role: Some(if replica { "replica" } else { "primary" }.into()),
                connections: one("steward_pg_instance_max_connections")
                    .map(|max| (count(connections), count(max))),
                lag_bytes: replica
                    .then(|| primary_says.or(one("steward_pg_replica_replay_lag_bytes").map(count)))
                    .flatten(),
                streaming: replica
                    .then(|| one("steward_pg_replica_streaming").map(|v| v == 1.0))
                    .flatten(),
                oldest_transaction_seconds: one("steward_pg_transactions_oldest_seconds"),
                frozen_xid_age: samples(text, "steward_pg_database_frozen_xid_age")
                    .iter()
                    .map(|(_, v)| count(*v))
                    .max(),
                last_archived_seconds: (one("steward_pg_archiver_enabled") == Some(1.0)
                    && !replica)
                    .then(|| {
                        one("steward_pg_archiver_last_archived_age_seconds").filter(|v| *v >= 0.0)
                    }),
                failing_queries: samples(text, "steward_pg_query_error")
                    .into_iter()
                    .filter(|(_, v)| *v != 0.0)
                    .filter_map(|(labels, _)| label(&labels, "query"))
                    .collect(),
                unavailable: None,
            }
        })
        .collect()
}

/// The samples of family `name` in an exposition: each with its label text (between the
/// braces, empty without) and value.
pub(crate) fn samples(text: &str, name: &str) -> Vec<(String, f64)> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?;
            let (labels, value) = match rest.strip_prefix('{') {
                Some(rest) => {
                    let (labels, value) = rest.rsplit_once("} ")?;
                    (labels.to_string(), value)
                }
                None => (String::new(), rest.strip_prefix(' ')?),
            };
            Some((labels, value.trim().parse().ok()?))
        })
        .collect()
}

/// The value of label `key` in a sample's label text (`a="x",b="y"`; values with escaped
/// quotes are read up to the first unescaped one).
pub(crate) fn label(labels: &str, key: &str) -> Option<String> {
    let start = labels
        .match_indices(&format!("{key}=\""))
        .find(|(i, _)| *i == 0 || labels.as_bytes()[i - 1] == b',')?
        .0
        + key.len()
        + 2;
    let mut value = String::new();
    let mut chars = labels[start..].chars();
    while let Some(c) = chars.next() {
        match c {
            '"' => return Some(value),
            '\\' => match chars.next() {
                Some('n') => value.push('\n'),
                Some(other) => value.push(other),
                None => return None,
            },
            c => value.push(c),
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    const PRIMARY: &str = "\
# HELP steward_pg_up x
# TYPE steward_pg_up gauge
steward_pg_up 1
steward_pg_member_lag_bytes{member=\"pg-1\"} 3271360
steward_pg_instance_in_recovery 0
steward_pg_instance_max_connections 100
steward_pg_connections_count{datname=\"postgres\",state=\"active\"} 3
steward_pg_connections_count{datname=\"app\",state=\"idle\"} 4
steward_pg_transactions_oldest_seconds 12.5
steward_pg_database_frozen_xid_age{datname=\"postgres\"} 700
steward_pg_database_frozen_xid_age{datname=\"app\"} 900
steward_pg_archiver_enabled 1
steward_pg_archiver_last_archived_age_seconds -1
steward_pg_query_error{query=\"steward_pg_locks\"} 0
steward_pg_query_error{query=\"app_slow\"} 1
";

    const REPLICA: &str = "\
steward_pg_up 1
steward_pg_instance_in_recovery 1
steward_pg_instance_max_connections 100
steward_pg_replica_streaming 0
steward_pg_replica_replay_lag_bytes 10
steward_pg_archiver_enabled 1
";

    #[test]
    fn the_headline_figures_come_from_each_instance_and_the_primary_s_view_of_the_replicas() {
        let rows = rows(&[
            ("pg-0".into(), Ok(PRIMARY.into())),
            ("pg-1".into(), Ok(REPLICA.into())),
            (
                "pg-2".into(),
                Err("forbidden (needs get on pods/proxy)".into()),
            ),
            ("pg-3".into(), Ok("steward_pg_up 0\n".into())),
        ]);
        assert_eq!(rows[0].role.as_deref(), Some("primary"));
        assert_eq!(rows[0].connections, Some((7, 100)));
        assert_eq!(rows[0].lag_bytes, None);
        assert_eq!(rows[0].frozen_xid_age, Some(900));
        assert_eq!(rows[0].oldest_transaction_seconds, Some(12.5));
        // Archiving on, nothing archived yet.
        assert_eq!(rows[0].last_archived_seconds, Some(None));
        assert_eq!(rows[0].failing_queries, ["app_slow"]);
        // The replica's lag as the primary sees it, not its own replay lag.
        assert_eq!(rows[1].role.as_deref(), Some("replica"));
        assert_eq!(rows[1].lag_bytes, Some(3_271_360));
        assert_eq!(rows[1].streaming, Some(false));
        assert_eq!(rows[1].last_archived_seconds, None);
        assert_eq!(
            rows[2].unavailable.as_deref(),
            Some("forbidden (needs get on pods/proxy)")
        );
        assert!(
            rows[3]
                .unavailable
                .as_deref()
                .is_some_and(|u| u.contains("does not answer"))
        );
    }

    #[test]
    fn labels_are_read_with_their_escapes_and_never_from_another_label_s_tail() {
        assert_eq!(label(r#"a="x",b="y""#, "b").as_deref(), Some("y"));
        assert_eq!(label(r#"xb="no",b="yes""#, "b").as_deref(), Some("yes"));
        assert_eq!(label(r#"q="a\"b\\c""#, "q").as_deref(), Some("a\"b\\c"));
        assert_eq!(label(r#"q="open"#, "q"), None);
        assert_eq!(
            samples("steward_pg_upx 1\nsteward_pg_up 1\n", "steward_pg_up").len(),
            1
        );
    }
}
