//! Drains: when the primary's node is cordoned (`kubectl drain` cordons before it evicts), the
//! operator switches over to a ready replica on a node that is not, so the primary is never
//! evicted while it is the primary. Its own PodDisruptionBudget (`<cluster>-primary`,
//! `minAvailable: 1` with more than one instance) refuses the eviction until the switchover
//! has moved the primary label; the old primary is then a replica, which the replicas'
//! budget lets go one at a time. Writes wait only for the switchover, not for a failover.

use std::collections::{BTreeMap, BTreeSet};

use super::rollout::PodView;

/// The replica to switch over to because the primary's node is cordoned, if any: the ready
/// replica, lowest ordinal first, whose node is not cordoned. `node_of` maps pod names to
/// their nodes; `cordoned` holds the nodes marked unschedulable.
pub fn switchover_target(
    primary: &str,
    pods: &[PodView],
    node_of: &BTreeMap<String, String>,
    cordoned: &BTreeSet<String>,
) -> Option<String> {
    let primary_node = node_of.get(primary)?;
    if !cordoned.contains(primary_node) {
        return None;
    }
    let mut candidates: Vec<&PodView> = pods
        .iter()
        .filter(|p| p.name != primary && p.ready && !p.deleting)
        .filter(|p| {
            node_of
                .get(&p.name)
                .is_some_and(|node| node != primary_node && !cordoned.contains(node))
        })
        .collect();
    candidates.sort_by_key(|p| p.ordinal);
    candidates.first().map(|p| p.name.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str, ordinal: i32, ready: bool) -> PodView {
        PodView::named(name, ordinal, ready)
    }

    fn nodes(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(p, n)| (p.to_string(), n.to_string()))
            .collect()
    }

    #[test]
    fn a_cordoned_primary_node_switches_to_a_ready_replica_on_a_schedulable_node() {
        let pods = [
            pod("pg-0", 0, true),
            pod("pg-1", 1, false),
            pod("pg-2", 2, true),
        ];
        let node_of = nodes(&[("pg-0", "a"), ("pg-1", "b"), ("pg-2", "c")]);
        let cordoned = BTreeSet::from(["a".to_string()]);
        assert_eq!(
            switchover_target("pg-0", &pods, &node_of, &cordoned).as_deref(),
            Some("pg-2"),
            "pg-1 is not ready"
        );
        // Nothing to do while the primary's node is schedulable.
        assert_eq!(
            switchover_target("pg-0", &pods, &node_of, &BTreeSet::new()),
            None
        );
        // A replica on a cordoned node (drained next), or on the primary's own node, is no
        // target; with none left the primary stays (its budget holds the drain).
        let both = BTreeSet::from(["a".to_string(), "c".to_string()]);
        assert_eq!(switchover_target("pg-0", &pods, &node_of, &both), None);
        let shared = nodes(&[("pg-0", "a"), ("pg-1", "b"), ("pg-2", "a")]);
        assert_eq!(switchover_target("pg-0", &pods, &shared, &cordoned), None);
        // A primary whose node is unknown (not scheduled) is no drain.
        assert_eq!(switchover_target("pg-9", &pods, &node_of, &cordoned), None);
    }
}
