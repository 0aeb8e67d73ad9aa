//! Rolling updates and status of a [`PostgresCluster`], as pure functions of what the
//! StatefulSet and its pods report.
//!
//! The primary is ordinal 0, so replicas are the higher ordinals. A template change starts
//! with the StatefulSet's `partition` at `instances - 1`: only the highest replica is
//! replaced. Each reconcile then lowers the partition by one only when every pod above it
//! runs the new revision and is Ready, so instances are replaced one at a time, replicas
//! first, the primary last.

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::ResourceExt;
use steward_core::conditions::{self, DEGRADED, PROGRESSING, READY};

use super::build::{REVISION_LABEL, VERSION_LABEL};
use crate::api::{ClusterPhase, PostgresClusterStatus};

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
    /// The view of `pod` of StatefulSet `sts_name`, `None` for pods not named `<sts>-<n>`.
    pub fn of(pod: &Pod, sts_name: &str) -> Option<Self> {
        let name = pod.name_any();
        let ordinal = name
            .strip_prefix(sts_name)?
            .strip_prefix('-')?
            .parse::<i32>()
            .ok()?;
        let ready = pod
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
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

/// The partition for the next step of a rollout to `update_revision`: the highest ordinal
/// not yet updated, once every pod above it is updated and Ready; otherwise hold (that
/// ordinal + 1). `0` when every instance is updated.
pub fn next_partition(instances: i32, pods: &[PodView], update_revision: &str) -> i32 {
    let pod = |ordinal: i32| pods.iter().find(|p| p.ordinal == ordinal);
    let not_updated = (0..instances)
        .rev()
        .find(|&o| !pod(o).is_some_and(|p| p.updated(update_revision)));
    let Some(next) = not_updated else { return 0 };
    let above_healthy =
        (next + 1..instances).all(|o| pod(o).is_some_and(|p| p.healthy(update_revision)));
    if above_healthy { next } else { next + 1 }
}

/// The partition to apply: `0` for a new StatefulSet, `instances - 1` when the template just
/// changed, else the next step of the rollout, or the current partition while the
/// StatefulSet controller has not caught up (its status is older than its spec).
pub fn partition(
    instances: i32,
    existing: Option<&StatefulSet>,
    template_changed: bool,
    pods: &[PodView],
) -> i32 {
    let Some(sts) = existing else { return 0 };
    if template_changed {
        return (instances - 1).max(0);
    }
    let current = sts
        .spec
        .update_strategy
        .as_ref()
        .and_then(|u| u.rolling_update.as_ref())
        .and_then(|r| r.partition)
        .unwrap_or(0);
    match update_revision(sts) {
        Some(rev) => next_partition(instances, pods, rev),
        None => current.min((instances - 1).max(0)),
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
        primary: primary.map(|p| p.name.clone()),
        superuser_secret: Some(observed.superuser_secret.clone()),
        observed_generation: generation,
        conditions: conds,
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

    #[test]
    fn rollout_goes_replicas_first_primary_last_one_at_a_time() {
        // Template just changed: nothing updated yet → only ordinal 2 may update.
        let mut pods = vec![
            pod(0, "old", true),
            pod(1, "old", true),
            pod(2, "old", true),
        ];
        assert_eq!(next_partition(3, &pods, "new"), 2);
        // Ordinal 2 recreated, not ready yet → hold at 2.
        pods[2] = pod(2, "new", false);
        assert_eq!(next_partition(3, &pods, "new"), 2);
        // Ordinal 2 ready → ordinal 1 may update.
        pods[2].ready = true;
        assert_eq!(next_partition(3, &pods, "new"), 1);
        // Ordinal 1 is being replaced (gone for a moment) → still 1.
        pods.remove(1);
        assert_eq!(next_partition(3, &pods, "new"), 1);
        pods.insert(1, pod(1, "new", false));
        assert_eq!(next_partition(3, &pods, "new"), 1);
        pods[1].ready = true;
        // Both replicas updated and ready → the primary (0) may update.
        assert_eq!(next_partition(3, &pods, "new"), 0);
        pods[0] = pod(0, "new", true);
        assert_eq!(next_partition(3, &pods, "new"), 0);
    }

    #[test]
    fn unready_updated_replica_blocks_the_primary() {
        let pods = vec![
            pod(0, "old", true),
            pod(1, "new", true),
            pod(2, "new", false),
        ];
        assert_eq!(
            next_partition(3, &pods, "new"),
            1,
            "ordinal 2 not ready: ordinal 1 is done, hold before 0"
        );
    }

    #[test]
    fn single_instance_updates_directly() {
        assert_eq!(next_partition(1, &[pod(0, "old", true)], "new"), 0);
        assert_eq!(partition(1, Some(&StatefulSet::default()), true, &[]), 0);
    }

    #[test]
    fn partition_starts_at_highest_ordinal_on_template_change() {
        let sts = StatefulSet::default();
        assert_eq!(
            partition(3, None, false, &[]),
            0,
            "new StatefulSet: everything at once"
        );
        assert_eq!(partition(3, Some(&sts), true, &[]), 2);
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
