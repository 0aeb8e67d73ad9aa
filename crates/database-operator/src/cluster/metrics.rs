//! What each PostgresCluster's status says, as gauges computed from the watch cache when
//! scraped (steward-core's `FromStore`): the alert rules of `deploy/monitoring/` read them.
//!
//! | metric | labels |
//! |---|---|
//! | `steward_postgrescluster_instances` | namespace, cluster — `spec.instances` |
//! | `steward_postgrescluster_ready_instances` | namespace, cluster |
//! | `steward_postgrescluster_primary_ready` | namespace, cluster — 1 while the primary named by the status is a ready primary |
//! | `steward_postgrescluster_replica_lag_bytes` | namespace, cluster, replica — WAL received but not replayed |

use kube::ResourceExt;
use kube::runtime::reflector::Store;
use steward_core::metrics::{FromStore, Metrics, SampleLabels};

use crate::api::PostgresCluster;

fn labels(cluster: &PostgresCluster) -> SampleLabels {
    vec![
        ("namespace", cluster.namespace().unwrap_or_default()),
        ("cluster", cluster.name_any()),
    ]
}

/// `steward_postgrescluster_instances`.
pub fn instances(cluster: &PostgresCluster) -> Vec<(SampleLabels, f64)> {
    vec![(labels(cluster), f64::from(cluster.spec.instances))]
}

/// `steward_postgrescluster_ready_instances`.
pub fn ready_instances(cluster: &PostgresCluster) -> Vec<(SampleLabels, f64)> {
    let ready = cluster.status.as_ref().map_or(0, |s| s.ready_instances);
    vec![(labels(cluster), f64::from(ready))]
}

/// `steward_postgrescluster_primary_ready`.
pub fn primary_ready(cluster: &PostgresCluster) -> Vec<(SampleLabels, f64)> {
    let ready = cluster.status.as_ref().is_some_and(|s| {
        s.instances
            .iter()
            .any(|i| Some(&i.name) == s.primary.as_ref() && i.role == "primary" && i.ready)
    });
    vec![(labels(cluster), if ready { 1.0 } else { 0.0 })]
}

/// `steward_postgrescluster_replica_lag_bytes`, one sample per replica.
pub fn replica_lag(cluster: &PostgresCluster) -> Vec<(SampleLabels, f64)> {
    let Some(status) = &cluster.status else {
        return Vec::new();
    };
    status
        .instances
        .iter()
        .filter(|i| i.role == "replica")
        .map(|i| {
            let mut l = labels(cluster);
            l.push(("replica", i.name.clone()));
            (l, i.replay_lag_bytes as f64)
        })
        .collect()
}

/// Registers the gauges over the PostgresCluster cache.
pub fn register(metrics: &Metrics, clusters: &Store<PostgresCluster>) {
    metrics.register(
        "steward_postgrescluster_instances",
        "Instances a PostgresCluster asks for (spec.instances)",
        FromStore::new(clusters.clone(), instances),
    );
    metrics.register(
        "steward_postgrescluster_ready_instances",
        "Instances of a PostgresCluster whose pod is Ready",
        FromStore::new(clusters.clone(), ready_instances),
    );
    metrics.register(
        "steward_postgrescluster_primary_ready",
        "1 while the PostgresCluster's primary (status.primary) is a ready primary, else 0",
        FromStore::new(clusters.clone(), primary_ready),
    );
    metrics.register(
        "steward_postgrescluster_replica_lag_bytes",
        "WAL a replica received but has not replayed yet, in bytes",
        FromStore::new(clusters.clone(), replica_lag),
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn cluster(status: serde_json::Value) -> PostgresCluster {
        serde_json::from_value(json!({
            "apiVersion": "database.steward.dev/v1alpha1",
            "kind": "PostgresCluster",
            "metadata": {"name": "pg", "namespace": "db"},
            "spec": {"instances": 2, "version": 17, "storage": {"size": "1Gi"}},
            "status": status,
        }))
        .expect("cluster")
    }

    fn instance(name: &str, role: &str, ready: bool, lag: u64) -> serde_json::Value {
        json!({"name": name, "role": role, "timeline": 1, "lsn": "0/1", "replayLagBytes": lag, "ready": ready})
    }

    #[test]
    fn the_primary_counts_only_when_the_named_primary_is_ready() {
        let ok = cluster(
            json!({"primary": "pg-0", "instances": [instance("pg-0", "primary", true, 0)]}),
        );
        assert_eq!(primary_ready(&ok)[0].1, 1.0);
        let down =
            cluster(json!({"primary": "pg-0", "instances": [instance("pg-0", "down", false, 0)]}));
        assert_eq!(primary_ready(&down)[0].1, 0.0);
        let other = cluster(
            json!({"primary": "pg-1", "instances": [instance("pg-0", "primary", true, 0)]}),
        );
        assert_eq!(
            primary_ready(&other)[0].1,
            0.0,
            "the status names another primary"
        );
        assert_eq!(primary_ready(&cluster(json!({})))[0].1, 0.0);
    }

    #[test]
    fn lag_is_reported_per_replica() {
        let c = cluster(json!({"primary": "pg-0", "instances": [
            instance("pg-0", "primary", true, 0),
            instance("pg-1", "replica", true, 4096),
        ]}));
        let lag = replica_lag(&c);
        assert_eq!(lag.len(), 1);
        assert_eq!(lag[0].0[2], ("replica", "pg-1".to_string()));
        assert_eq!(lag[0].1, 4096.0);
        assert_eq!(instances(&c)[0].1, 2.0);
    }
}
