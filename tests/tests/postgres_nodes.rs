//! A PostgresCluster on several real nodes (`Options::real_nodes`), each instance on a node of
//! its own with a volume that stays on that node: what happens when the primary's node loses
//! power, as production clusters see it (kubelet, containerd and every process of the node
//! gone at once, the Node `NotReady` only after the controller manager's grace period).
//!
//! Needs root; the machine runs one set of real nodes at a time, so the tests take turns.

#![allow(clippy::unwrap_used)] // tests fail loudly

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::ListParams;
use serde_json::json;
use steward_testenv::eventually;

#[path = "support/postgres.rs"]
mod postgres;
#[path = "support/real_node.rs"]
mod support;
use postgres::*;
use support::connect;

/// The node each instance runs on, by pod name.
async fn placement(cluster: &Cluster) -> Vec<(String, String)> {
    let pods = cluster
        .pods()
        .list(&ListParams::default().labels("database.steward.dev/cluster=pg"))
        .await
        .unwrap();
    let mut placed: Vec<(String, String)> = pods
        .items
        .iter()
        .map(|p: &Pod| {
            (
                p.name_any(),
                p.spec
                    .as_ref()
                    .and_then(|s| s.node_name.clone())
                    .unwrap_or_default(),
            )
        })
        .collect();
    placed.sort();
    placed
}

/// The primary's node loses power under writes: a replica on another node takes over, no
/// acknowledged write is lost (one synchronous replica), and when the node is back its old
/// primary follows the new one.
#[tokio::test]
async fn the_primary_losing_its_node_fails_over_to_another_node_and_loses_no_acknowledged_write() {
    let _turn = NODE.lock().await;
    let mut cluster = Cluster::on_nodes("rn-pgnode", 3, 3).await;
    cluster.create(json!({"synchronousReplicas": 1})).await;
    let placed = placement(&cluster).await;
    let nodes: std::collections::BTreeSet<&String> = placed.iter().map(|(_, n)| n).collect();
    assert_eq!(
        nodes.len(),
        3,
        "each instance on a node of its own: {placed:?}"
    );
    let rw = cluster.cluster_ip("pg-rw").await;
    connect(&rw, &cluster.password)
        .await
        .unwrap()
        .batch_execute("create table acks (id bigint, at timestamptz default now())")
        .await
        .unwrap();
    let (old, old_ip) = cluster.primary().await;
    let node_name = placed
        .iter()
        .find(|(pod, _)| *pod == old)
        .map(|(_, node)| node.clone())
        .unwrap();
    let index = cluster
        ._cp
        .real_nodes()
        .iter()
        .position(|n| n.name() == node_name)
        .unwrap();
    let (acks, stop, writing) = start_writer(&rw, &cluster.password, 5).await;

    let lost_at = Instant::now();
    cluster._cp.real_node_mut(index).unwrap().stop().unwrap();
    let taken_over = taken_over(&acks, lost_at, &old_ip, Duration::from_secs(150)).await;
    let taken_over = match taken_over {
        Ok(after) => after,
        Err(e) => panic!("{e}\n{}", cluster.logs().await),
    };
    stop.cancel();
    writing.await.unwrap();
    let (present, acknowledged) = acknowledged_present(&rw, &cluster.password, &acks).await;
    let (new, _) = cluster.primary().await;
    eprintln!(
        "{old}'s node {node_name} lost power; {new} took over {taken_over:.1?} later; acknowledged rows lost: {} of {acknowledged}",
        acknowledged - present,
    );
    assert_eq!(present, acknowledged, "acknowledged rows lost");
    assert_ne!(new, old, "the primary moved off the lost node");

    // The node comes back: the old primary follows the new one, the cluster is whole again.
    let client = cluster.client.clone();
    cluster
        ._cp
        .real_node_mut(index)
        .unwrap()
        .start_again(&client, support::WAIT)
        .await
        .unwrap();
    // Its pod starts again (until then the API still has it Ready, from before its node was
    // lost) and streams from the new primary: both replicas do.
    let primary = connect(&rw, &cluster.password).await.unwrap();
    let streaming = eventually(
        "both replicas streaming from the new primary",
        Duration::from_secs(120),
        || async {
            let rows = primary
                .query(
                    "select application_name from pg_stat_replication where state = 'streaming'",
                    &[],
                )
                .await
                .map_err(|e| e.to_string())?;
            let names: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
            if names.len() == 2 && names.contains(&old) {
                Ok(names)
            } else {
                Err(format!("streaming: {names:?}"))
            }
        },
    )
    .await;
    if let Err(e) = streaming {
        panic!("{e}\n{}", cluster.logs().await);
    }
    cluster.wait_ready(Duration::from_secs(240)).await;
    assert_eq!(
        cluster.primary().await.0,
        new,
        "the primary stays where it moved"
    );
    cluster.stop_operator().await;
}
