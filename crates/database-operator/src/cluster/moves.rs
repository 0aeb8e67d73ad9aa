//! Who is primary next, and which pods go: the switchovers a reconcile names on the Lease (on
//! request, for a drain of the primary's node, for a rolling update), the pods it deletes (the
//! rolling update's next, an instance whose volume is gone) and the Events that say why —
//! decided in one pure function ([`decide`]) from what the reconcile observed, and executed by
//! `cluster::reconcile`.

use std::collections::{BTreeMap, BTreeSet};

use kube::ResourceExt;
use steward_core::events::Wanted;

use super::rollout::{self, PodView};
use super::{PrimaryRoles, SWITCHOVER_ANNOTATION, drain, lost};
use crate::crd::PostgresCluster;

/// What a reconcile observed that bears on the primary and the pods.
pub struct Facts<'a> {
    pub cluster: &'a PostgresCluster,
    /// The instances the StatefulSet runs (held during a major upgrade).
    pub instances: i32,
    pub roles: &'a PrimaryRoles,
    pub views: &'a [PodView],
    /// The switchover asked for on the cluster ([`SWITCHOVER_ANNOTATION`]).
    pub requested: Option<&'a str>,
    /// Each pod's node, and the cordoned ones among them (read only when the primary's is).
    pub node_of: &'a BTreeMap<String, String>,
    pub cordoned: &'a BTreeSet<String>,
    /// The instances that cannot be scheduled, and where their volumes are.
    pub unscheduled: &'a [lost::Unscheduled],
    /// The rolling update's next step, while one runs and no switchover is requested.
    pub rollout: Option<rollout::Step>,
}

/// What to do, in this order; then the Events.
#[derive(Debug, Default, PartialEq)]
pub struct Moves {
    /// Remove the refusal recorded on the Lease (no longer asked for: the next reconcile may
    /// ask again).
    pub clear_refusal: Option<String>,
    /// Switchover targets to name on the Lease, in order (the last stands).
    pub ask: Vec<String>,
    /// Delete this pod: the rolling update's next (the StatefulSet re-creates it).
    pub delete_pod: Option<String>,
    /// Replace this instance: its volume is gone ([`lost`]).
    pub replace: Option<String>,
    /// The requested switchover is done: remove the request after the status write.
    pub clear_request: bool,
    pub events: Vec<Wanted>,
}

/// Decides the moves of one reconcile.
pub fn decide(f: &Facts<'_>) -> Moves {
    let mut m = Moves::default();
    let roles = f.roles;
    // A switchover the primary refused (its target did not confirm the last WAL).
    let refused = roles.standing_refusal();
    if let Some((target, why)) = refused {
        let asked = f.requested == Some(target.as_str());
        let note = if asked {
            format!(
                "the primary refused the switchover to {target} and runs on: {why}; the annotation {SWITCHOVER_ANNOTATION} is left for you to change or remove"
            )
        } else {
            // Withdrawn, or the rolling update's: the next reconcile may ask again.
            m.clear_refusal = Some(target.clone());
            format!(
                "the primary refused the switchover to {target} and runs on: {why}; it is asked again while still needed"
            )
        };
        m.events
            .push(Wanted::warning("SwitchoverRefused", "Switchover", note));
    }
    let refused_target = refused.map(|(target, _)| target.as_str());
    if let Some(to) = f.requested {
        if roles.primary.as_deref() == Some(to) {
            m.clear_request = true;
        } else if refused_target == Some(to) {
            // Reported above; asking again needs a new request.
        } else if let Err(why) = switchover_allowed(to, f.cluster, f.views, roles) {
            m.events.push(Wanted::warning(
                "SwitchoverRefused",
                "Switchover",
                format!("switchover to {to} refused: {why}; the annotation {SWITCHOVER_ANNOTATION} is left for you to change or remove"),
            ));
        } else if roles.switching_to.as_deref() != Some(to) {
            m.ask.push(to.to_string());
            m.events.push(Wanted::normal(
                "Switchover",
                "Switchover",
                format!("switching over to {to} as asked by {SWITCHOVER_ANNOTATION}"),
            ));
        }
    }

    // A drain of the primary's node (cordoned): a switchover before its eviction, which the
    // primary's own budget refuses until then.
    if let Some(primary) = roles.primary.as_deref()
        && f.instances > 1
        && f.requested.is_none()
        && roles.switching_to.is_none()
        && let Some(to) = drain::switchover_target(primary, f.views, f.node_of, f.cordoned)
            .filter(|to| refused_target != Some(to.as_str()))
    {
        m.events.push(Wanted::normal(
            "Switchover",
            "Drain",
            format!(
                "node {} of the primary {primary} is cordoned (a drain): switching over to {to} before the primary is evicted",
                f.node_of.get(primary).map_or("?", String::as_str)
            ),
        ));
        m.ask.push(to);
    }

    // An instance whose volume is gone (its node deleted): replaced, cloning the primary.
    match lost::decide(roles.primary.as_deref(), f.views, f.unscheduled) {
        lost::Decision::Replace { pod, why } => {
            m.events.push(Wanted::warning(
                "VolumeLost",
                "Replace",
                format!("{pod}: {why}"),
            ));
            m.replace = Some(pod);
        }
        lost::Decision::Blocked { pod, why } => {
            m.events.push(Wanted::warning(
                "VolumeLost",
                "Wait",
                format!("{pod}: {why}"),
            ));
        }
        lost::Decision::Nothing => {}
    }

    // One step of the rolling update.
    match &f.rollout {
        Some(rollout::Step::Delete { pod, primary }) => {
            m.events.push(Wanted::normal(
                "RollingUpdate",
                "Update",
                format!(
                    "replacing {} {pod} with the new template",
                    if *primary { "the primary" } else { "replica" }
                ),
            ));
            m.delete_pod = Some(pod.clone());
        }
        Some(rollout::Step::Switchover { to }) if refused_target != Some(to.as_str()) => {
            m.events.push(Wanted::normal(
                "Switchover",
                "Update",
                format!("every replica is updated: switching over to {to} before the old primary is replaced"),
            ));
            m.ask.push(to.clone());
        }
        Some(_) | None => {}
    }
    m
}

/// Why a switchover to `to` cannot start now, if it cannot.
fn switchover_allowed(
    to: &str,
    cluster: &PostgresCluster,
    pods: &[PodView],
    roles: &PrimaryRoles,
) -> Result<(), String> {
    if roles.primary.is_none() {
        return Err("there is no primary right now (a failover is under way)".into());
    }
    let Some(pod) = pods.iter().find(|p| p.name == to) else {
        return Err(format!(
            "{to} is not an instance of this cluster (its instances are {}-0 to {}-{})",
            cluster.name_any(),
            cluster.name_any(),
            cluster.spec.instances - 1
        ));
    };
    if pod.ordinal >= cluster.spec.instances || !pod.ready || pod.deleting {
        return Err(format!("{to} is not a ready replica"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::tests::cluster;

    fn roles(primary: Option<&str>) -> PrimaryRoles {
        PrimaryRoles {
            primary: primary.map(str::to_string),
            switching_to: None,
            refused: None,
            transitions: Some(1),
        }
    }

    fn ready() -> Vec<PodView> {
        (0..3)
            .map(|i| PodView::named(&format!("pg-{i}"), i, true))
            .collect()
    }

    /// What a test changes of a quiet three-instance cluster, each pod on its node.
    struct Knobs {
        instances: i32,
        requested: Option<&'static str>,
        cordoned: &'static [&'static str],
        unscheduled: Vec<lost::Unscheduled>,
        rollout: Option<rollout::Step>,
    }

    impl Default for Knobs {
        fn default() -> Self {
            Self {
                instances: 3,
                requested: None,
                cordoned: &[],
                unscheduled: Vec::new(),
                rollout: None,
            }
        }
    }

    fn decide_with(roles: &PrimaryRoles, views: &[PodView], knobs: Knobs) -> Moves {
        let cluster = cluster("pg");
        let node_of: BTreeMap<String, String> = (0..3)
            .map(|i| (format!("pg-{i}"), format!("node-{i}")))
            .collect();
        let cordoned: BTreeSet<String> = knobs.cordoned.iter().map(|n| n.to_string()).collect();
        decide(&Facts {
            cluster: &cluster,
            instances: knobs.instances,
            roles,
            views,
            requested: knobs.requested,
            node_of: &node_of,
            cordoned: &cordoned,
            unscheduled: &knobs.unscheduled,
            rollout: knobs.rollout,
        })
    }

    #[test]
    fn a_quiet_cluster_moves_nothing() {
        assert_eq!(
            decide_with(&roles(Some("pg-0")), &ready(), Knobs::default()),
            Moves::default()
        );
    }

    #[test]
    fn a_requested_switchover_is_asked_once_then_cleared_when_done() {
        let views = ready();
        let asked = decide_with(
            &roles(Some("pg-0")),
            &views,
            Knobs {
                requested: Some("pg-2"),
                ..Knobs::default()
            },
        );
        assert_eq!(asked.ask, ["pg-2"]);
        assert_eq!(asked.events[0].reason, "Switchover");
        // Already named on the Lease: not asked again.
        let mut switching = roles(Some("pg-0"));
        switching.switching_to = Some("pg-2".into());
        let waiting = decide_with(
            &switching,
            &views,
            Knobs {
                requested: Some("pg-2"),
                ..Knobs::default()
            },
        );
        assert!(waiting.ask.is_empty() && waiting.events.is_empty());
        // Done: the request is removed.
        let done = decide_with(
            &roles(Some("pg-2")),
            &views,
            Knobs {
                requested: Some("pg-2"),
                ..Knobs::default()
            },
        );
        assert!(done.clear_request && done.ask.is_empty());
        // Not an instance, or during a failover: refused with a reason, nothing asked.
        let unknown = decide_with(
            &roles(Some("pg-0")),
            &views,
            Knobs {
                requested: Some("pg-7"),
                ..Knobs::default()
            },
        );
        assert!(unknown.ask.is_empty());
        assert!(unknown.events[0].note.contains("not an instance"));
        let failover = decide_with(
            &roles(None),
            &views,
            Knobs {
                requested: Some("pg-1"),
                ..Knobs::default()
            },
        );
        assert!(failover.events[0].note.contains("no primary"));
    }

    #[test]
    fn a_refusal_is_reported_and_cleared_unless_still_requested() {
        let mut refused = roles(Some("pg-0"));
        refused.refused = Some(("pg-1".into(), "the target did not confirm".into()));
        let views = ready();
        let withdrawn = decide_with(&refused, &views, Knobs::default());
        assert_eq!(withdrawn.clear_refusal.as_deref(), Some("pg-1"));
        assert_eq!(withdrawn.events[0].reason, "SwitchoverRefused");
        // Still requested: left for the user, and not asked again.
        let kept = decide_with(
            &refused,
            &views,
            Knobs {
                requested: Some("pg-1"),
                ..Knobs::default()
            },
        );
        assert_eq!(kept.clear_refusal, None);
        assert!(kept.ask.is_empty());
        // A drain does not pick the refused target either.
        let mut views = ready();
        views[2].ready = false;
        let drained = decide_with(
            &refused,
            &views,
            Knobs {
                cordoned: &["node-0"],
                ..Knobs::default()
            },
        );
        assert!(drained.ask.is_empty(), "{drained:?}");
    }

    #[test]
    fn a_cordoned_primary_node_is_a_switchover_unless_one_is_requested_or_under_way() {
        let views = ready();
        let drained = decide_with(
            &roles(Some("pg-0")),
            &views,
            Knobs {
                cordoned: &["node-0"],
                ..Knobs::default()
            },
        );
        assert_eq!(drained.ask, ["pg-1"]);
        assert_eq!(drained.events[0].action, "Drain");
        let requested = decide_with(
            &roles(Some("pg-0")),
            &views,
            Knobs {
                cordoned: &["node-0"],
                requested: Some("pg-2"),
                ..Knobs::default()
            },
        );
        assert_eq!(requested.ask, ["pg-2"], "the request wins");
        let single = decide_with(
            &roles(Some("pg-0")),
            &views,
            Knobs {
                cordoned: &["node-0"],
                instances: 1,
                ..Knobs::default()
            },
        );
        assert!(single.ask.is_empty());
    }

    #[test]
    fn a_lost_volume_and_the_rolling_update_are_moves_with_their_events() {
        let mut views = ready();
        views[2].ready = false;
        let lost = vec![lost::Unscheduled {
            pod: "pg-2".into(),
            volume: lost::Volume::OnGoneNodes(BTreeSet::from(["node-2".to_string()])),
            claim_uid: Some("u".into()),
            pod_uid: None,
        }];
        let replaced = decide_with(
            &roles(Some("pg-0")),
            &views,
            Knobs {
                unscheduled: lost,
                ..Knobs::default()
            },
        );
        assert_eq!(replaced.replace.as_deref(), Some("pg-2"));
        assert_eq!(
            (replaced.events[0].reason, replaced.events[0].action),
            ("VolumeLost", "Replace")
        );
        let views = ready();
        let delete = decide_with(
            &roles(Some("pg-0")),
            &views,
            Knobs {
                rollout: Some(rollout::Step::Delete {
                    pod: "pg-1".into(),
                    primary: false,
                }),
                ..Knobs::default()
            },
        );
        assert_eq!(delete.delete_pod.as_deref(), Some("pg-1"));
        let handover = decide_with(
            &roles(Some("pg-0")),
            &views,
            Knobs {
                rollout: Some(rollout::Step::Switchover { to: "pg-1".into() }),
                ..Knobs::default()
            },
        );
        assert_eq!(handover.ask, ["pg-1"]);
    }
}
