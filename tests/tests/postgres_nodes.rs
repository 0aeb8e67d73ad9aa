//! A PostgresCluster on several real nodes (`Options::real_nodes`), each instance on a node of
//! its own with a volume that stays on that node (testenv's node-local provisioner): what
//! happens when the primary's node is drained (the operator switches over first: the primary's
//! PodDisruptionBudget holds its eviction until then; the old primary cannot come back while
//! the node is cordoned), loses power, is cut off the network, or is drained and removed for
//! good with its disks, as production clusters see it (kubelet, containerd and every process
//! of the node gone at once, the Node `NotReady` only after the controller manager's grace
//! period).
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

/// The index (among the real nodes) of the node pod `pod` runs on, and its name.
async fn node_of(cluster: &Cluster, pod: &str) -> (usize, String) {
    let placed = placement(cluster).await;
    let name = placed
        .iter()
        .find(|(p, _)| p == pod)
        .map(|(_, node)| node.clone())
        .unwrap_or_else(|| panic!("{pod} is not placed: {placed:?}"));
    let index = cluster
        ._cp
        .real_nodes()
        .iter()
        .position(|n| n.name() == name)
        .unwrap();
    (index, name)
}

/// Waits until `primary` streams to two replicas, `member` one of them (it follows the new
/// primary); the cluster's logs on failure.
async fn both_replicas_stream(cluster: &Cluster, rw: &str, member: &str) {
    let primary = connect(rw, &cluster.password).await.unwrap();
    let streaming = eventually(
        &format!("both replicas streaming from the primary, {member} among them"),
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
            if names.len() == 2 && names.iter().any(|n| n == member) {
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
}

/// A client writing through `-rw` while the primary's node is taken away.
struct UnderWrites {
    old: String,
    old_ip: String,
    node: String,
    index: usize,
    acks: std::sync::Arc<std::sync::Mutex<Acks>>,
    stop: tokio_util::sync::CancellationToken,
    writing: tokio::task::JoinHandle<()>,
    at: Instant,
}

impl UnderWrites {
    /// Starts writing (once five writes are acknowledged, the fault may come).
    async fn start(cluster: &Cluster, rw: &str) -> Self {
        let (old, old_ip) = cluster.primary().await;
        let (index, node) = node_of(cluster, &old).await;
        let (acks, stop, writing) = start_writer(rw, &cluster.password, 5).await;
        Self {
            old,
            old_ip,
            node,
            index,
            acks,
            stop,
            writing,
            at: Instant::now(),
        }
    }

    /// Once an instance on another node acknowledged writes: stops writing and checks that no
    /// acknowledged write is lost; returns the new primary and when it acknowledged its first.
    async fn taken_over(self, cluster: &Cluster, rw: &str, what: &str) -> (String, Instant) {
        let after =
            match taken_over(&self.acks, self.at, &self.old_ip, Duration::from_secs(150)).await {
                Ok(after) => after,
                Err(e) => panic!("{e}\n{}", cluster.logs().await),
            };
        self.stop.cancel();
        self.writing.await.unwrap();
        let (present, acknowledged) = acknowledged_present(rw, &cluster.password, &self.acks).await;
        let (new, _) = cluster.primary().await;
        eprintln!(
            "{}'s node {} {what}; {new} took over {after:.1?} later, writes waited at most {:.1?}; acknowledged rows lost: {} of {acknowledged}",
            self.old,
            self.node,
            longest_gap(&self.acks, self.at),
            acknowledged - present,
        );
        assert_eq!(present, acknowledged, "acknowledged rows lost");
        assert_ne!(new, self.old, "the primary moved off {}", self.node);
        assert_ne!(node_of(cluster, &new).await.1, self.node, "to another node");
        (new, self.at + after)
    }
}

/// Three instances, one per node, one synchronous replica, a client writing through `-rw`:
/// the primary's node is drained (the operator sees it cordoned and switches over; the
/// primary's PodDisruptionBudget refuses its eviction until then; evicted as a replica, it
/// cannot come back while its node is cordoned, its volume being on it), then the new
/// primary's node loses power, then the next primary's node is cut off the network (fenced
/// before the takeover: it accepts no write once the new primary has). Each time a replica on
/// another node takes over and no acknowledged write is lost; when the node is schedulable,
/// back or healed, its instance follows the new primary. Last, the primary's node is drained
/// and removed for good with its disks: the instance drained off it is replaced (a new claim,
/// a new volume on another node) and follows the primary.
#[tokio::test]
async fn a_primary_drained_losing_its_node_or_cut_off_moves_to_another_node_and_loses_no_acknowledged_write()
 {
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
        .batch_execute(
            "create table acks (id bigint, at timestamptz default now()); \
             create table fence_probe (at timestamptz default now())",
        )
        .await
        .unwrap();

    // A drain: the primary evicted (a clean stop, the Lease released with where its WAL ends).
    let drain = UnderWrites::start(&cluster, &rw).await;
    let (drained_pod, drained_node, drained_index) =
        (drain.old.clone(), drain.node.clone(), drain.index);
    let drained_uid = cluster.pods().get(&drained_pod).await.unwrap().uid();
    steward_testenv::node::drain(&cluster._cp, &drained_node, support::WAIT)
        .await
        .unwrap();
    drain.taken_over(&cluster, &rw, "was drained").await;
    // Switched over before the eviction: the primary's budget held the drain until the
    // operator, seeing the node cordoned, had moved the primary; no failover.
    let reasons = cluster_events(&cluster).await;
    assert!(
        reasons
            .iter()
            .any(|r| r.contains(" Switchover: ") && r.contains("is cordoned (a drain)")),
        "the operator switched over for the drain: {reasons:#?}"
    );
    assert!(
        reasons.iter().any(|r| r.contains(" SwitchedOver: ")),
        "the new primary was reported as a switchover: {reasons:#?}"
    );
    // Straight to the target: the old primary released the Lease naming itself and where its
    // WAL ends beside the target, so no other replica takes it first to hand it on (CI saw
    // that hop at `848efcb` and `0d60191`, when a switchover's release carried no record).
    let hops: Vec<&String> = reasons
        .iter()
        .filter(|r| r.contains(" FailedOver: "))
        .collect();
    assert!(
        hops.is_empty(),
        "the drain's switchover went through another replica first: {hops:#?}"
    );
    let pending = cluster.pods().get(&drained_pod).await.unwrap();
    let phase = pending.status.as_ref().and_then(|s| s.phase.clone());
    assert!(
        pending.uid() != drained_uid && phase.as_deref() == Some("Pending"),
        "{drained_pod} is {phase:?}, its volume on the cordoned {drained_node} (uid changed: {})",
        pending.uid() != drained_uid
    );
    cluster._cp.real_nodes()[drained_index]
        .uncordon(&cluster.client)
        .await
        .unwrap();
    both_replicas_stream(&cluster, &rw, &drained_pod).await;

    // Power lost under the new primary: kubelet, containerd and every process of its node
    // gone at once; the Node NotReady only after the grace period.
    let power = UnderWrites::start(&cluster, &rw).await;
    let (lost_pod, lost_index) = (power.old.clone(), power.index);
    cluster
        ._cp
        .real_node_mut(lost_index)
        .unwrap()
        .stop()
        .unwrap();
    power.taken_over(&cluster, &rw, "lost power").await;
    let client = cluster.client.clone();
    cluster
        ._cp
        .real_node_mut(lost_index)
        .unwrap()
        .start_again(&client, support::WAIT)
        .await
        .unwrap();
    // Its pod starts again (until then the API still has it Ready, from before its node was
    // lost) and follows the new primary.
    both_replicas_stream(&cluster, &rw, &lost_pod).await;

    // Cut off: the primary's node partitioned, its processes running. Its instance manager
    // cannot renew the Lease: its watchdog fences PostgreSQL at the renew deadline, before the
    // Lease expires and a replica elsewhere takes it. The old primary accepts no write once the
    // new one has (probed from inside its pod's network namespace, which the partition leaves
    // reachable from the host).
    let cut = UnderWrites::start(&cluster, &rw).await;
    let (cut_pod, cut_index) = (cut.old.clone(), cut.index);
    let accepted = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let probe_stop = tokio_util::sync::CancellationToken::new();
    let probing = probe_primary(&cluster, &cut_pod, accepted.clone(), probe_stop.clone()).await;
    cluster._cp.real_nodes()[cut_index].partition().unwrap();
    let (_, first) = cut.taken_over(&cluster, &rw, "was cut off").await;
    probe_stop.cancel();
    probing.await.unwrap();
    let accepted = accepted.lock().unwrap().clone();
    let last = accepted.iter().max().copied();
    assert!(
        last.is_some_and(|last| last < first),
        "the old primary accepted writes after the new one did (fenced {:?} before the takeover)",
        last.map(|last| first.checked_duration_since(last))
    );
    eprintln!(
        "{cut_pod} fenced: its last write accepted {:.1?} before the new primary's first",
        last.and_then(|last| first.checked_duration_since(last))
            .unwrap_or_default()
    );
    cluster._cp.real_nodes()[cut_index].heal().unwrap();
    both_replicas_stream(&cluster, &rw, &cut_pod).await;

    // Drained, and never back: the primary's node drained (a switchover again), then removed
    // for good with its disks (its Node deleted). The instance drained off it, Pending since
    // (its volume was there), is replaced: the operator deletes its claim and pod, the
    // StatefulSet makes both again, the new claim gets a volume on another node, and the new
    // instance clones the primary.
    let gone = UnderWrites::start(&cluster, &rw).await;
    let (gone_pod, gone_node, gone_index) = (gone.old.clone(), gone.node.clone(), gone.index);
    let claims: kube::Api<k8s_openapi::api::core::v1::PersistentVolumeClaim> =
        kube::Api::namespaced(cluster.client.clone(), &cluster.ns);
    let claim = format!("data-{gone_pod}");
    let old_claim = claims.get(&claim).await.unwrap().uid();
    steward_testenv::node::drain(&cluster._cp, &gone_node, support::WAIT)
        .await
        .unwrap();
    gone.taken_over(&cluster, &rw, "was drained").await;
    let client = cluster.client.clone();
    cluster
        ._cp
        .real_node_mut(gone_index)
        .unwrap()
        .remove(&client)
        .await
        .unwrap();
    let removed = Instant::now();
    both_replicas_stream(&cluster, &rw, &gone_pod).await;
    let (_, placed_on) = node_of(&cluster, &gone_pod).await;
    eprintln!(
        "{gone_pod}, drained off {gone_node}, which was then removed: re-created on {placed_on} with a new volume and streaming {:.1?} after the removal",
        removed.elapsed()
    );
    assert_ne!(placed_on, gone_node);
    assert_ne!(
        claims.get(&claim).await.unwrap().uid(),
        old_claim,
        "a new claim"
    );
    let reasons = cluster_events(&cluster).await;
    assert!(
        reasons
            .iter()
            .any(|r| r.contains(" VolumeLost: ") && r.contains(&gone_node)),
        "the operator said why it replaced {gone_pod}: {reasons:#?}"
    );
    cluster.wait_ready(Duration::from_secs(240)).await;
    cluster.stop_operator().await;
}
