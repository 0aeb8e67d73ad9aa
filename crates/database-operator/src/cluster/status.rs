//! The PostgresCluster's status, computed in one place from what a reconcile observed and
//! decided: the instances and the rollout ([`rollout::status`]), the primary and its
//! switchovers, waiting commits and failing instances, continuous backup, the major upgrade,
//! a standby's progress ([`standby`]). Written once by `cluster::reconcile`.

use k8s_openapi::api::core::v1::Pod;
use kube::{Resource, ResourceExt};
use steward_core::conditions::{self, READY};
use steward_core::events::Wanted;

use super::{
    PrimaryRoles, SWITCHOVER_ANNOTATION, backup, build, monitoring, rollout, standby, upgrade,
};
use crate::crd::{ClusterPhase, MajorUpgradePhase, PostgresCluster, PostgresClusterStatus};

/// What the status is computed from.
pub struct Inputs<'a> {
    pub cluster: &'a PostgresCluster,
    /// The StatefulSet as applied and the pods as listed.
    pub observed: rollout::Observed<'a>,
    pub roles: &'a PrimaryRoles,
    /// The switchover this reconcile named on the Lease (the Lease as read does not say so).
    pub asked_now: Option<String>,
    pub pods: &'a [Pod],
    /// The instances' `synchronousReplicas` (held during a major upgrade).
    pub synchronous_replicas: Option<i32>,
    /// Continuous backup's report (`None`: not configured).
    pub backups: Option<backup::Reported>,
    pub upgrade: &'a upgrade::Decision,
    /// What `spec.monitoring.queriesConfigMap` holds.
    pub queries: &'a monitoring::Queries,
    /// Where `spec.pooler` stands.
    pub pooled: &'a super::pooler::Pooled,
}

/// The status to write.
pub fn compute(i: Inputs<'_>) -> PostgresClusterStatus {
    let cluster = i.cluster;
    let generation = cluster.meta().generation;
    let previous = cluster.status.as_ref();
    let roles = i.roles;
    let mut status = rollout::status(&i.observed, previous);
    status.switchover_target = i.asked_now.or_else(|| roles.switching_to.clone());
    status.switchover_refused = roles
        .standing_refusal()
        .map(|(target, why)| format!("{target}: {why}"));
    status.primary_transitions = if roles.primary.is_some() {
        roles.transitions
    } else {
        previous.and_then(|p| p.primary_transitions)
    };
    status.instances = i.pods.iter().filter_map(build::instance_state).collect();
    rollout::commits_waiting(&mut status, i.synchronous_replicas, generation);
    rollout::instance_problems(&mut status);
    // A standby (`spec.replica`): its leader's progress; while it follows, a Ready cluster
    // says it is a read-only standby.
    let leader_report = roles
        .primary
        .as_deref()
        .and_then(|p| i.pods.iter().find(|pod| pod.name_any() == p))
        .and_then(build::instance_report);
    let leader = roles
        .primary
        .as_deref()
        .zip(leader_report.as_ref())
        .map(|(name, report)| standby::Leader { name, report });
    let standby = standby::report(
        cluster.spec.replica.as_ref(),
        leader,
        previous.and_then(|p| p.replica.as_ref()),
    );
    status.replica = standby.status;
    conditions::set_wanted(
        &mut status.conditions,
        standby::STANDBY,
        standby.condition.as_ref(),
        generation,
    );
    if let Some(source) = standby::follows(&cluster.spec).filter(|_| standby.following) {
        standby_ready(&mut status, source, generation);
    }
    // Continuous backup: the schedule, retention, and what is recoverable.
    let (archiving, backup_status) = i.backups.map(|r| (r.condition, r.status)).unzip();
    if backup_status.is_some() {
        status.backup = backup_status;
    }
    conditions::set_wanted(
        &mut status.conditions,
        backup::CONTINUOUS_ARCHIVING,
        archiving.as_ref(),
        generation,
    );
    // The metrics queries: whether they serve (never a reason for Ready to be false).
    conditions::set_wanted(
        &mut status.conditions,
        monitoring::METRICS_QUERIES,
        i.queries.condition().as_ref(),
        generation,
    );
    // The pooler: whether it serves (never a reason for Ready to be false either: the
    // cluster serves through its own Services).
    conditions::set_wanted(
        &mut status.conditions,
        super::pooler::POOLER_READY,
        i.pooled.condition().as_ref(),
        generation,
    );
    // The major upgrade's progress (or outcome) as a condition; while the instances are
    // stopped for it, the cluster is not Ready and says why.
    let decided = i.upgrade;
    status.target_version = Some(cluster.spec.version);
    status.major_upgrade = decided.status.clone();
    conditions::set_wanted(
        &mut status.conditions,
        upgrade::MAJOR_UPGRADE,
        decided.condition.as_ref(),
        generation,
    );
    if let Some(condition) = &decided.condition {
        if decided.hold.as_ref().is_some_and(|h| h.instances == 0) {
            status.phase = Some(ClusterPhase::Upgrading);
            conditions::set(
                &mut status.conditions,
                READY,
                false,
                "MajorUpgrade",
                condition.message.clone(),
                generation,
            );
        }
        if let Some(u) = decided
            .status
            .as_ref()
            .filter(|u| u.phase == MajorUpgradePhase::Completed)
        {
            // The data is on the new major from now on, even before a pod reports it.
            status.current_version = status.current_version.max(Some(u.to));
        }
    }
    status
}

/// A Ready standby says so: `Ready` keeps its status and gets the reason
/// [`standby::STANDBY_REASON`] and a note naming the source (nothing when not Ready).
fn standby_ready(
    status: &mut PostgresClusterStatus,
    source: &crate::crd::ObjectStore,
    generation: Option<i64>,
) {
    let Some(ready) = conditions::get(&status.conditions, READY).filter(|c| c.status == "True")
    else {
        return;
    };
    let note = standby::ready_note(source);
    let message = if ready.message.contains(&note) {
        ready.message.clone()
    } else {
        format!("{}; {note}", ready.message)
    };
    conditions::set(
        &mut status.conditions,
        READY,
        true,
        standby::STANDBY_REASON,
        message,
        generation,
    );
}

/// The Event of a new primary since the status was written (the Lease's `leaseTransitions`
/// grew): `SwitchedOver` if it was planned (recorded in the status, or still asked for on the
/// cluster: the operator that passed the request to the Lease may have died before it
/// recorded it), `FailedOver` otherwise. Publish it only once this reconcile's status write,
/// guarded by the cluster's resourceVersion, went through: a reconcile of a stale copy (whose
/// status predates the transition) would report it again.
pub fn transition(cluster: &PostgresCluster, roles: &PrimaryRoles, lease: &str) -> Option<Wanted> {
    let previous = cluster.status.as_ref();
    let before = previous.and_then(|p| p.primary_transitions)?;
    let now = roles.primary.as_ref()?;
    if roles.transitions? <= before {
        return None;
    }
    let asked = cluster
        .annotations()
        .get(SWITCHOVER_ANNOTATION)
        .is_some_and(|to| to == now);
    let planned = previous.and_then(|p| p.switchover_target.as_ref()) == Some(now) || asked;
    Some(if planned {
        Wanted::normal(
            "SwitchedOver",
            "Switchover",
            format!("{now} is the primary, as planned"),
        )
    } else {
        Wanted::warning(
            "FailedOver",
            "Failover",
            format!(
                "{now} is the primary now: the instances elected the most advanced replica through the Lease {lease} after the previous primary stopped renewing or released it"
            ),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::tests::cluster;

    fn roles(primary: &str, transitions: i32) -> PrimaryRoles {
        PrimaryRoles {
            primary: Some(primary.into()),
            switching_to: None,
            refused: None,
            transitions: Some(transitions),
        }
    }

    /// A Ready standby keeps Ready true with the reason `Standby` and the source named, the
    /// same message every time (no write per reconcile); a standby that is not Ready is left
    /// as the rollout says.
    #[test]
    fn a_ready_standby_says_it_is_one_and_an_unready_one_is_left_alone() {
        let source = crate::cluster::standby::tests::source_store();
        let mut s = PostgresClusterStatus::default();
        conditions::set(
            &mut s.conditions,
            READY,
            true,
            "Ready",
            "3 of 3 instances ready, PostgreSQL 16",
            Some(2),
        );
        standby_ready(&mut s, &source, Some(2));
        let ready = conditions::get(&s.conditions, READY).unwrap();
        assert_eq!(
            (ready.status.as_str(), ready.reason.as_str()),
            ("True", standby::STANDBY_REASON)
        );
        assert_eq!(
            ready.message,
            "3 of 3 instances ready, PostgreSQL 16; a read-only standby of s3://dr/prod/orders: see the Standby condition and status.replica"
        );
        let once = s.clone();
        standby_ready(&mut s, &source, Some(2));
        assert_eq!(s, once);

        let mut creating = PostgresClusterStatus::default();
        conditions::set(
            &mut creating.conditions,
            READY,
            false,
            "Creating",
            "0 of 3 instances ready",
            Some(2),
        );
        let before = creating.clone();
        standby_ready(&mut creating, &source, Some(2));
        assert_eq!(creating, before);
    }

    #[test]
    fn a_new_primary_is_reported_as_planned_or_as_a_failover_once() {
        let mut c = cluster("pg");
        c.status = Some(PostgresClusterStatus {
            primary_transitions: Some(1),
            switchover_target: Some("pg-1".into()),
            ..Default::default()
        });
        assert_eq!(transition(&c, &roles("pg-0", 1), "pg-primary"), None);
        let planned = transition(&c, &roles("pg-1", 2), "pg-primary").unwrap();
        assert_eq!(planned.reason, "SwitchedOver");
        let failed = transition(&c, &roles("pg-2", 2), "pg-primary").unwrap();
        assert_eq!(failed.reason, "FailedOver");
        // Still asked for on the cluster: planned, even if the status never recorded it.
        c.annotations_mut()
            .insert(SWITCHOVER_ANNOTATION.into(), "pg-2".into());
        let asked = transition(&c, &roles("pg-2", 2), "pg-primary").unwrap();
        assert_eq!(asked.reason, "SwitchedOver");
        // No status yet: nothing to compare with.
        c.status = None;
        assert_eq!(transition(&c, &roles("pg-2", 5), "pg-primary"), None);
    }
}
