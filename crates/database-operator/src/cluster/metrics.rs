//! What each PostgresCluster's status says, as gauges computed from the watch cache when
//! scraped (steward-core's `FromStore`): the alert rules of `deploy/monitoring/` read them.
//!
//! | metric | labels |
//! |---|---|
//! | `steward_postgrescluster_instances` | namespace, cluster — `spec.instances` |
//! | `steward_postgrescluster_ready_instances` | namespace, cluster |
//! | `steward_postgrescluster_primary_ready` | namespace, cluster — 1 while the primary named by the status is a ready primary (of a standby cluster: a ready leader that follows its source) |
//! | `steward_postgrescluster_replica_lag_bytes` | namespace, cluster, replica — WAL received but not replayed |
//! | `steward_postgrescluster_archiving_ok` | namespace, cluster — with `spec.backup`, unless a standby follows its source: 1 while `ContinuousArchiving` is true |
//! | `steward_postgrescluster_standby_lag_bytes` | namespace, cluster — a standby following its source: WAL the source archived that it has not replayed |
//! | `steward_postgrescluster_last_base_backup_timestamp_seconds` | namespace, cluster — when the newest base backup completed |

use kube::ResourceExt;
use steward_core::metrics::{FromStore, Metrics, SampleLabels, Stores};

use crate::crd::PostgresCluster;

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

/// `steward_postgrescluster_primary_ready`. A standby cluster's primary is its leader, a
/// replica of its source: ready while it follows (the `Standby` condition holds).
pub fn primary_ready(cluster: &PostgresCluster) -> Vec<(SampleLabels, f64)> {
    let following = following(cluster);
    let ready = cluster.status.as_ref().is_some_and(|s| {
        let role = if following { "replica" } else { "primary" };
        s.instances
            .iter()
            .any(|i| Some(&i.name) == s.primary.as_ref() && i.role == role && i.ready)
    });
    vec![(labels(cluster), if ready { 1.0 } else { 0.0 })]
}

/// Whether `cluster` is a standby whose leader follows its source, as its status says.
fn following(cluster: &PostgresCluster) -> bool {
    super::standby::follows(&cluster.spec).is_some()
        && cluster.status.as_ref().is_some_and(|s| {
            steward_core::conditions::is_true(&s.conditions, super::standby::STANDBY)
        })
}

/// `steward_postgrescluster_standby_lag_bytes`: nothing unless a standby follows its source.
pub fn standby_lag(cluster: &PostgresCluster) -> Vec<(SampleLabels, f64)> {
    if super::standby::follows(&cluster.spec).is_none() {
        return Vec::new();
    }
    cluster
        .status
        .as_ref()
        .and_then(|s| s.replica.as_ref()?.lag_bytes)
        .map(|lag| vec![(labels(cluster), lag as f64)])
        .unwrap_or_default()
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

/// `steward_postgrescluster_archiving_ok`: nothing for a cluster without `spec.backup`, nor
/// for a standby that follows its source (it archives nothing of its own until promoted).
pub fn archiving_ok(cluster: &PostgresCluster) -> Vec<(SampleLabels, f64)> {
    if cluster.spec.backup.is_none() || super::standby::follows(&cluster.spec).is_some() {
        return Vec::new();
    }
    let ok = cluster.status.as_ref().is_some_and(|s| {
        steward_core::conditions::is_true(&s.conditions, super::backup::CONTINUOUS_ARCHIVING)
    });
    vec![(labels(cluster), if ok { 1.0 } else { 0.0 })]
}

/// `steward_postgrescluster_last_base_backup_timestamp_seconds`.
pub fn last_base_backup(cluster: &PostgresCluster) -> Vec<(SampleLabels, f64)> {
    let at = cluster
        .status
        .as_ref()
        .and_then(|s| s.backup.as_ref())
        .and_then(|b| b.last_base_backup_time.as_deref())
        .and_then(|t| t.parse::<jiff::Timestamp>().ok());
    at.map(|t| vec![(labels(cluster), t.as_millisecond() as f64 / 1000.0)])
        .unwrap_or_default()
}

/// Registers the gauges over the PostgresCluster caches (one per shard this replica holds, or
/// the one cache when not sharded).
pub fn register(metrics: &Metrics, clusters: &Stores<PostgresCluster>) {
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
    metrics.register(
        "steward_postgrescluster_standby_lag_bytes",
        "A standby PostgresCluster following its source (spec.replica): bytes of WAL the source archived that it has not replayed",
        FromStore::new(clusters.clone(), standby_lag),
    );
    metrics.register(
        "steward_postgrescluster_archiving_ok",
        "With spec.backup: 1 while WAL archiving works (the ContinuousArchiving condition), else 0",
        FromStore::new(clusters.clone(), archiving_ok),
    );
    metrics.register(
        "steward_postgrescluster_last_base_backup_timestamp_seconds",
        "When the PostgresCluster's newest base backup completed (Unix seconds)",
        FromStore::new(clusters.clone(), last_base_backup),
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

    #[test]
    fn archiving_and_the_last_backup_are_reported_only_for_backed_up_clusters() {
        let plain = cluster(json!({}));
        assert!(archiving_ok(&plain).is_empty());
        assert!(last_base_backup(&plain).is_empty());
        let mut backed_up = cluster(json!({
            "conditions": [{"type": "ContinuousArchiving", "status": "False", "reason": "ArchivingFailing",
                            "message": "", "lastTransitionTime": "2026-12-02T03:00:00Z"}],
            "backup": {"lastBaseBackup": "b", "lastBaseBackupTime": "2026-12-02T03:00:00Z"},
        }));
        backed_up.spec.backup = Some(crate::crd::ClusterBackup {
            object_store: crate::crd::ObjectStore {
                endpoint: "http://s3:9000".into(),
                bucket: "b".into(),
                path: "p".into(),
                region: None,
                credentials_secret: "s".into(),
            },
            schedule: None,
            keep: None,
        });
        assert_eq!(archiving_ok(&backed_up)[0].1, 0.0);
        assert_eq!(last_base_backup(&backed_up)[0].1, 1_796_180_400.0);
    }

    /// A standby's primary is its leader, a replica of its source: ready while it follows,
    /// not alerting as a lost primary; its own archiving is not reported until it is
    /// promoted; its lag behind the source is.
    #[test]
    fn a_standby_counts_its_following_leader_as_its_primary_and_reports_its_lag() {
        let store = crate::crd::ObjectStore {
            endpoint: "http://s3:9000".into(),
            bucket: "b".into(),
            path: "p".into(),
            region: None,
            credentials_secret: "s".into(),
        };
        let standby = |standby_status: &str, enabled: bool| {
            let mut c = cluster(json!({
                "primary": "pg-0",
                "instances": [instance("pg-0", "replica", true, 0)],
                "replica": {"source": "s3://src/p", "enabled": enabled, "lagBytes": 8192},
                "conditions": [{"type": "Standby", "status": standby_status, "reason": "Following",
                                "message": "", "lastTransitionTime": "2026-12-02T03:00:00Z"}],
            }));
            c.spec.replica = Some(crate::crd::ReplicaSpec {
                enabled,
                source: crate::crd::ObjectStore {
                    bucket: "src".into(),
                    ..store.clone()
                },
                promotion_token: None,
            });
            c.spec.backup = Some(crate::crd::ClusterBackup {
                object_store: store.clone(),
                schedule: None,
                keep: None,
            });
            c
        };
        let following = standby("True", true);
        assert_eq!(primary_ready(&following)[0].1, 1.0);
        assert!(archiving_ok(&following).is_empty());
        assert_eq!(standby_lag(&following)[0].1, 8192.0);
        // Nobody follows: no primary.
        assert_eq!(primary_ready(&standby("False", true))[0].1, 0.0);
        // Promoted (or promoting): a primary must be a primary, archiving counts again.
        let promoted = standby("False", false);
        assert_eq!(primary_ready(&promoted)[0].1, 0.0);
        assert_eq!(archiving_ok(&promoted).len(), 1);
        assert!(standby_lag(&promoted).is_empty());
        assert!(standby_lag(&cluster(json!({}))).is_empty());
    }
}
