//! Rolling updates and status of a [`PostgresCluster`](crate::crd::PostgresCluster), as pure functions of what the
//! StatefulSet and its pods report.
//!
//! The StatefulSet updates `OnDelete`: the operator replaces pods itself ([`next_step`]),
//! one at a time and only while every instance is Ready — the replicas first (highest
//! ordinal first), then a switchover to an updated replica, then the old primary. The
//! primary is whichever instance holds the cluster's Lease, so it may be any ordinal.

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::ResourceExt;
use steward_core::conditions::{self, DEGRADED, PROGRESSING, READY};

use super::build::{PRIMARY, REPLICA, REVISION_LABEL, VERSION_LABEL};
use crate::crd::{ClusterPhase, PostgresClusterStatus};

/// What matters about one pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodView {
    pub name: String,
    pub ordinal: i32,
    pub revision: Option<String>,
    pub ready: bool,
    pub version: Option<i32>,
    pub deleting: bool,
}

impl PodView {
    /// A pod of the current revision, for tests of decisions over pods.
    #[cfg(test)]
    pub fn named(name: &str, ordinal: i32, ready: bool) -> Self {
        Self {
            name: name.into(),
            ordinal,
            revision: None,
            ready,
            version: None,
            deleting: false,
        }
    }

    /// The view of `pod` of StatefulSet `sts_name`, `None` for pods not named `<sts>-<n>`.
    pub fn of(pod: &Pod, sts_name: &str) -> Option<Self> {
        let name = pod.name_any();
        let ordinal = name
            .strip_prefix(sts_name)?
            .strip_prefix('-')?
            .parse::<i32>()
            .ok()?;
        let ready = steward_database_api::contract::pod_ready(pod);
        Some(Self {
            name,
            ordinal,
            revision: pod.labels().get(REVISION_LABEL).cloned(),
            ready,
            version: pod.labels().get(VERSION_LABEL).and_then(|v| v.parse().ok()),
            deleting: pod.metadata.deletion_timestamp.is_some(),
        })
    }

    fn updated(&self, update_revision: &str) -> bool {
        !self.deleting && self.revision.as_deref() == Some(update_revision)
    }

    fn healthy(&self, update_revision: &str) -> bool {
        self.updated(update_revision) && self.ready
    }
}

/// The next step of a rolling update.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Every instance runs the update revision.
    Done,
    /// Nothing to do until something changes (a pod is missing, not ready, or being
    /// replaced; a switchover is under way).
    Wait,
    /// Delete this pod: the StatefulSet (`OnDelete`) re-creates it from the new template.
    Delete { pod: String, primary: bool },
    /// Hand the primary over to this updated, ready replica before the old primary is
    /// replaced: a rolling update costs one switchover, never a primary restart.
    Switchover { to: String },
}

/// What the rollout planner needs besides the pods.
#[derive(Clone, Copy, Debug)]
pub struct Roles<'a> {
    /// The primary's pod (the Lease's holder, or the first pod before a Lease exists).
    pub primary: Option<&'a str>,
    /// Instance managers elect the primary (a Lease exists): the primary is switched over,
    /// not deleted while it leads.
    pub elected: bool,
    /// A switchover under way (the Lease names a target).
    pub switching_to: Option<&'a str>,
}

/// Plans one step of the rollout to `update_revision`: replicas one at a time (highest
/// ordinal first), each only when every instance is Ready; then a switchover to an updated
/// replica; then the old primary, now a replica.
pub fn next_step(
    instances: i32,
    pods: &[PodView],
    update_revision: &str,
    roles: Roles<'_>,
) -> Step {
    let in_range: Vec<&PodView> = pods.iter().filter(|p| p.ordinal < instances).collect();
    let outdated: Vec<&PodView> = in_range
        .iter()
        .copied()
        .filter(|p| !p.updated(update_revision))
        .collect();
    if outdated.is_empty() && in_range.len() == instances as usize {
        return Step::Done;
    }
    let all_ready =
        in_range.len() == instances as usize && in_range.iter().all(|p| p.ready && !p.deleting);
    if !all_ready || roles.switching_to.is_some() {
        return Step::Wait;
    }
    let is_primary = |p: &PodView| Some(p.name.as_str()) == roles.primary;
    if let Some(replica) = outdated
        .iter()
        .filter(|p| !is_primary(p))
        .max_by_key(|p| p.ordinal)
    {
        return Step::Delete {
            pod: replica.name.clone(),
            primary: false,
        };
    }
    let Some(primary) = outdated.first() else {
        return Step::Wait;
    };
    let updated_replica = in_range
        .iter()
        .filter(|p| !is_primary(p) && p.healthy(update_revision))
        .min_by_key(|p| p.ordinal);
    match updated_replica {
        Some(to) if roles.elected => Step::Switchover {
            to: to.name.clone(),
        },
        _ => Step::Delete {
            pod: primary.name.clone(),
            primary: true,
        },
    }
}

/// The StatefulSet's update revision, if its status describes its current spec.
pub fn update_revision(sts: &StatefulSet) -> Option<&str> {
    let status = sts.status.as_ref()?;
    if status.observed_generation? < sts.metadata.generation? {
        return None;
    }
    status.update_revision.as_deref()
}

/// Everything the status is computed from.
#[derive(Clone, Debug)]
pub struct Observed<'a> {
    pub generation: Option<i64>,
    pub instances: i32,
    pub target_version: i32,
    /// `None` while the StatefulSet controller has not observed the applied spec.
    pub update_revision: Option<&'a str>,
    pub pods: &'a [PodView],
    /// The primary's pod: the Lease's holder (`None` while the Lease is free, mid-failover).
    pub primary: Option<&'a str>,
    pub superuser_secret: String,
}

/// The status for `observed`, keeping condition transition times from `previous`.
pub fn status(
    observed: &Observed<'_>,
    previous: Option<&PostgresClusterStatus>,
) -> PostgresClusterStatus {
    let in_range: Vec<&PodView> = observed
        .pods
        .iter()
        .filter(|p| p.ordinal < observed.instances && !p.deleting)
        .collect();
    let ready_instances = in_range.iter().filter(|p| p.ready).count() as i32;
    let updated_instances = match observed.update_revision {
        Some(rev) => in_range.iter().filter(|p| p.updated(rev)).count() as i32,
        None => 0,
    };
    let rolled_out = observed.update_revision.is_some() && updated_instances == observed.instances;
    let primary = in_range
        .iter()
        .find(|p| Some(p.name.as_str()) == observed.primary);
    let current_version = match primary {
        Some(p) if p.ready => p.version,
        _ => previous.and_then(|s| s.current_version),
    };
    let all_ready = ready_instances == observed.instances;
    let ready = rolled_out && all_ready && current_version == Some(observed.target_version);

    let (phase, reason, message) = if ready {
        (
            ClusterPhase::Ready,
            "Ready",
            format!(
                "{} of {} instances ready, PostgreSQL {}",
                ready_instances, observed.instances, observed.target_version
            ),
        )
    } else if current_version.is_none() {
        (
            ClusterPhase::Creating,
            "Creating",
            format!(
                "{ready_instances} of {} instances ready",
                observed.instances
            ),
        )
    } else if !rolled_out {
        (
            ClusterPhase::Upgrading,
            "RollingUpdate",
            format!(
                "{updated_instances} of {} instances updated (replicas first, the primary last), {ready_instances} ready",
                observed.instances
            ),
        )
    } else {
        (
            ClusterPhase::Degraded,
            "InstancesNotReady",
            format!(
                "{ready_instances} of {} instances ready",
                observed.instances
            ),
        )
    };

    let mut conds: Vec<Condition> = previous.map(|s| s.conditions.clone()).unwrap_or_default();
    let generation = observed.generation;
    conditions::set(
        &mut conds,
        READY,
        ready,
        reason,
        message.clone(),
        generation,
    );
    let progressing = matches!(phase, ClusterPhase::Creating | ClusterPhase::Upgrading);
    conditions::set(
        &mut conds,
        PROGRESSING,
        progressing,
        if progressing { reason } else { "Stable" },
        if progressing {
            message.clone()
        } else {
            "no rollout in progress".to_string()
        },
        generation,
    );
    let degraded = phase == ClusterPhase::Degraded;
    conditions::set(
        &mut conds,
        DEGRADED,
        degraded,
        if degraded { reason } else { "AsExpected" },
        if degraded {
            message
        } else {
            "no instance lost".to_string()
        },
        generation,
    );
    PostgresClusterStatus {
        phase: Some(phase),
        ready_instances,
        updated_instances,
        current_version,
        target_version: Some(observed.target_version),
        primary: observed.primary.map(str::to_string),
        switchover_target: None,
        switchover_refused: None,
        primary_transitions: None,
        instances: Vec::new(),
        superuser_secret: Some(observed.superuser_secret.clone()),
        backup: None,
        major_upgrade: None,
        replica: None,
        observed_generation: generation,
        conditions: conds,
    }
}

/// Marks `status` when commits on the primary wait for synchronous standbys that do not
/// confirm them (`status.instances` as reported): writes hang, so the cluster is neither
/// Ready nor as expected, and the conditions say what would let them through. Nothing
/// when no commit waits.
pub fn commits_waiting(
    status: &mut PostgresClusterStatus,
    synchronous_replicas: Option<i32>,
    generation: Option<i64>,
) {
    let Some(primary) = status
        .instances
        .iter()
        .find(|i| i.role == PRIMARY && i.commits_waiting > 0)
    else {
        return;
    };
    let ready_replicas = status
        .instances
        .iter()
        .filter(|i| i.role == REPLICA && i.ready)
        .count();
    let message = format!(
        "{} commits on the primary {} have waited more than {} s for synchronous standbys: synchronousReplicas is {} and {ready_replicas} replicas are ready; they complete once enough replicas stream again (or lower spec.synchronousReplicas)",
        primary.commits_waiting,
        primary.name,
        steward_database_api::contract::COMMIT_WAIT.as_secs(),
        synchronous_replicas.unwrap_or(0),
    );
    status.phase = Some(ClusterPhase::Degraded);
    for (kind, value) in [(READY, false), (DEGRADED, true)] {
        conditions::set(
            &mut status.conditions,
            kind,
            value,
            "CommitsWaiting",
            message.clone(),
            generation,
        );
    }
}

/// Adds to the message of every condition that says something is wrong (Ready false,
/// Progressing or Degraded true) what keeps each instance that is not ready from running,
/// as its instance manager reports it (`status.instances[].problem`: a restore with no base
/// backup of the cluster's major, a clone the primary refuses…). Nothing when none reports
/// one, or when the cluster is Ready.
pub fn instance_problems(status: &mut PostgresClusterStatus) {
    let problems: Vec<String> = status
        .instances
        .iter()
        .filter(|i| !i.ready)
        .filter_map(|i| Some(format!("{}: {}", i.name, i.problem.as_deref()?)))
        .collect();
    if problems.is_empty() {
        return;
    }
    let problems = problems.join("; ");
    for condition in &mut status.conditions {
        let wrong = match condition.type_.as_str() {
            READY => condition.status == "False",
            PROGRESSING | DEGRADED => condition.status == "True",
            _ => false,
        };
        if wrong && !condition.message.contains(&problems) {
            condition.message = format!("{} — {problems}", condition.message);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(ordinal: i32, rev: &str, ready: bool) -> PodView {
        PodView {
            name: format!("pg-{ordinal}"),
            ordinal,
            revision: Some(rev.into()),
            ready,
            version: Some(if rev == "new" { 17 } else { 16 }),
            deleting: false,
        }
    }

    const ELECTED: Roles<'static> = Roles {
        primary: Some("pg-0"),
        elected: true,
        switching_to: None,
    };

    #[test]
    fn rollout_replaces_replicas_first_then_switches_over_then_the_old_primary() {
        let mut pods = vec![
            pod(0, "old", true),
            pod(1, "old", true),
            pod(2, "old", true),
        ];
        let step = |pods: &[PodView], roles| next_step(3, pods, "new", roles);
        assert_eq!(
            step(&pods, ELECTED),
            Step::Delete {
                pod: "pg-2".into(),
                primary: false
            }
        );
        // pg-2 being replaced → wait.
        pods[2].deleting = true;
        assert_eq!(step(&pods, ELECTED), Step::Wait);
        pods.remove(2);
        assert_eq!(step(&pods, ELECTED), Step::Wait, "a pod is missing");
        pods.push(pod(2, "new", false));
        assert_eq!(step(&pods, ELECTED), Step::Wait, "not ready yet");
        pods[2].ready = true;
        assert_eq!(
            step(&pods, ELECTED),
            Step::Delete {
                pod: "pg-1".into(),
                primary: false
            }
        );
        pods[1] = pod(1, "new", true);
        assert_eq!(
            step(&pods, ELECTED),
            Step::Switchover { to: "pg-1".into() },
            "every replica updated: hand over to the lowest updated replica"
        );
        let switching = Roles {
            switching_to: Some("pg-1"),
            ..ELECTED
        };
        assert_eq!(step(&pods, switching), Step::Wait);
        // pg-1 leads now; pg-0 is an outdated replica.
        let after = Roles {
            primary: Some("pg-1"),
            ..ELECTED
        };
        assert_eq!(
            step(&pods, after),
            Step::Delete {
                pod: "pg-0".into(),
                primary: false
            }
        );
        pods[0] = pod(0, "new", true);
        assert_eq!(step(&pods, after), Step::Done);
    }

    #[test]
    fn the_primary_may_be_any_ordinal() {
        let pods = vec![
            pod(0, "old", true),
            pod(1, "old", true),
            pod(2, "old", true),
        ];
        let roles = Roles {
            primary: Some("pg-2"),
            ..ELECTED
        };
        assert_eq!(
            next_step(3, &pods, "new", roles),
            Step::Delete {
                pod: "pg-1".into(),
                primary: false
            },
            "the highest replica, skipping the primary"
        );
    }

    #[test]
    fn without_elected_primaries_or_replicas_the_primary_is_replaced_in_place() {
        let pods = vec![pod(0, "old", true), pod(1, "new", true)];
        let unelected = Roles {
            elected: false,
            ..ELECTED
        };
        assert_eq!(
            next_step(2, &pods, "new", unelected),
            Step::Delete {
                pod: "pg-0".into(),
                primary: true
            }
        );
        assert_eq!(
            next_step(1, &[pod(0, "old", true)], "new", ELECTED),
            Step::Delete {
                pod: "pg-0".into(),
                primary: true
            },
            "a single instance has nobody to hand over to"
        );
    }

    #[test]
    fn an_unready_instance_holds_the_rollout() {
        let pods = vec![
            pod(0, "old", true),
            pod(1, "new", true),
            pod(2, "new", false),
        ];
        assert_eq!(next_step(3, &pods, "new", ELECTED), Step::Wait);
    }

    fn observed<'a>(pods: &'a [PodView], rev: Option<&'a str>, target: i32) -> Observed<'a> {
        Observed {
            generation: Some(2),
            instances: 3,
            target_version: target,
            update_revision: rev,
            pods,
            primary: Some("pg-0"),
            superuser_secret: "pg-superuser".into(),
        }
    }

    #[test]
    fn status_reports_creating_upgrading_ready_degraded() {
        let none: Vec<PodView> = vec![];
        let s = status(&observed(&none, None, 16), None);
        assert_eq!(s.phase, Some(ClusterPhase::Creating));
        assert!(!conditions::is_true(&s.conditions, READY));
        assert!(conditions::is_true(&s.conditions, PROGRESSING));

        let old = vec![
            pod(0, "old", true),
            pod(1, "old", true),
            pod(2, "old", true),
        ];
        let s = status(&observed(&old, Some("old"), 16), Some(&s));
        assert_eq!(s.phase, Some(ClusterPhase::Ready));
        assert_eq!(
            (s.ready_instances, s.current_version, s.target_version),
            (3, Some(16), Some(16))
        );
        assert!(conditions::is_true(&s.conditions, READY));
        assert_eq!(
            conditions::get(&s.conditions, READY)
                .unwrap()
                .observed_generation,
            Some(2)
        );

        // Version bumped: the new revision exists, nobody runs it yet.
        let s = status(&observed(&old, Some("new"), 17), Some(&s));
        assert_eq!(s.phase, Some(ClusterPhase::Upgrading));
        assert!(
            !conditions::is_true(&s.conditions, READY),
            "not Ready until the primary runs the target"
        );
        assert_eq!(s.current_version, Some(16));

        // Replicas updated, the primary not yet: still not Ready.
        let mid = vec![
            pod(0, "old", true),
            pod(1, "new", true),
            pod(2, "new", true),
        ];
        let s = status(&observed(&mid, Some("new"), 17), Some(&s));
        assert_eq!(
            (s.phase, s.updated_instances, s.current_version),
            (Some(ClusterPhase::Upgrading), 2, Some(16))
        );

        let done = vec![
            pod(0, "new", true),
            pod(1, "new", true),
            pod(2, "new", true),
        ];
        let s = status(&observed(&done, Some("new"), 17), Some(&s));
        assert_eq!(
            (s.phase, s.current_version),
            (Some(ClusterPhase::Ready), Some(17))
        );

        let lost = vec![
            pod(0, "new", true),
            pod(1, "new", false),
            pod(2, "new", true),
        ];
        let s = status(&observed(&lost, Some("new"), 17), Some(&s));
        assert_eq!(s.phase, Some(ClusterPhase::Degraded));
        assert!(conditions::is_true(&s.conditions, DEGRADED));
    }

    /// Issue #37, item 10: a primary whose commits hung on a missing synchronous standby was
    /// reported Ready.
    #[test]
    fn commits_waiting_for_standbys_make_the_cluster_not_ready_and_say_why() {
        let pods = vec![pod(0, "old", true), pod(1, "old", true)];
        let mut s = status(&observed(&pods, Some("old"), 16), None);
        let instance = |name: &str, role: &str, waiting: u32| crate::crd::InstanceState {
            name: name.into(),
            role: role.into(),
            timeline: 1,
            lsn: "0/3000060".into(),
            replay_lag_bytes: 0,
            ready: true,
            commits_waiting: waiting,
            problem: None,
        };
        s.instances = vec![
            instance("pg-0", "primary", 0),
            instance("pg-1", "replica", 0),
        ];
        let before = s.clone();
        commits_waiting(&mut s, Some(1), Some(2));
        assert_eq!(s, before, "nothing waits: nothing changes");

        s.instances = vec![instance("pg-0", "primary", 7), instance("pg-1", "down", 0)];
        commits_waiting(&mut s, Some(1), Some(2));
        assert_eq!(s.phase, Some(ClusterPhase::Degraded));
        let ready = conditions::get(&s.conditions, READY).unwrap();
        assert_eq!(
            (ready.status.as_str(), ready.reason.as_str()),
            ("False", "CommitsWaiting")
        );
        assert!(
            ready.message.contains("7 commits on the primary pg-0")
                && ready
                    .message
                    .contains("synchronousReplicas is 1 and 0 replicas are ready"),
            "{}",
            ready.message
        );
        assert!(conditions::is_true(&s.conditions, DEGRADED));
    }

    /// A restore that cannot start (no base backup of the cluster's major before its target)
    /// left the cluster `Creating` with "0 of 1 instances ready" and nothing more: the
    /// instance manager's reason is now in the conditions.
    #[test]
    fn what_keeps_an_instance_from_running_is_in_the_conditions() {
        let pods = vec![pod(0, "old", false)];
        let mut s = status(&observed(&pods, None, 16), None);
        let why = "no complete base backup of PostgreSQL 17 completed before 2026-12-05T10:00:00Z (the newest, base, is of PostgreSQL 15: restore it with spec.version 15)";
        s.instances = vec![crate::crd::InstanceState {
            name: "pg-0".into(),
            role: "down".into(),
            timeline: 0,
            lsn: "0/0".into(),
            replay_lag_bytes: 0,
            ready: false,
            commits_waiting: 0,
            problem: Some(why.into()),
        }];
        instance_problems(&mut s);
        let ready = conditions::get(&s.conditions, READY).unwrap();
        assert_eq!(ready.status, "False");
        assert!(
            ready.message.ends_with(&format!("— pg-0: {why}")),
            "{}",
            ready.message
        );
        let progressing = conditions::get(&s.conditions, PROGRESSING).unwrap();
        assert!(progressing.message.contains(why), "{}", progressing.message);
        // Once, however often it is applied; and not on a condition that says all is well.
        let once = s.clone();
        instance_problems(&mut s);
        assert_eq!(s, once);
        let degraded = conditions::get(&s.conditions, DEGRADED).unwrap();
        assert!(!degraded.message.contains(why), "{}", degraded.message);
    }

    #[test]
    fn status_is_stable_when_nothing_changes() {
        let pods = vec![
            pod(0, "old", true),
            pod(1, "old", true),
            pod(2, "old", true),
        ];
        let a = status(&observed(&pods, Some("old"), 16), None);
        let b = status(&observed(&pods, Some("old"), 16), Some(&a));
        assert_eq!(
            a, b,
            "an unchanged cluster computes an unchanged status (no write)"
        );
    }
}
