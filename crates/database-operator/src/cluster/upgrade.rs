//! Major-version upgrades: raising `spec.version` above the major the data is on.
//!
//! A new major cannot read the old one's data directory, so the instances are not rolled:
//! 1. **BackingUp** (with `spec.backup`): a `PostgresBackup` `<cluster>-before-pg<to>` must
//!    complete first — it is the way back;
//! 2. **Stopping**: the StatefulSet keeps the old major and image with 0 replicas;
//! 3. **Upgrading**: a Job mounts the primary's volume and runs `steward-pg-instance
//!    major-upgrade` in the new image, with the old major's programs exported by an init
//!    container of the old image (see `steward_pg_instance::upgrade`);
//! 4. **Completed**: the operator hands the Lease to the upgraded instance (nothing runs, so
//!    nobody else can hold it), and the StatefulSet comes back on the new major; the replicas'
//!    instance managers find an older data directory and clone the primary again.
//!
//! **Failed** (the backup or `pg_upgrade` failed): `pg_upgrade` never writes the old data
//! directory, so the instances come back on the old major and image with their data; the
//! `MajorUpgrade` condition says why. It is tried again when the spec changes.
//!
//! [`observe`] reads what [`plan`] needs, [`plan`] decides (pure, from [`Inputs`] built whole)
//! and [`execute`] does everything it decided, its Event and switchover request included.

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Resource, ResourceExt};

use super::build;
use crate::crd::{
    MajorUpgradePhase as Phase, MajorUpgradeStatus, PostgresBackup, PostgresBackupSpec,
    PostgresCluster, PostgresClusterStatus,
};
use crate::error::Error;
use steward_core::conditions::Wanted as Condition;
use steward_core::events::Wanted;
use steward_core::object::{unless_exists, unless_gone};
use steward_database_api::contract::{BINARY, BackupPhase};

/// The condition type.
pub const MAJOR_UPGRADE: &str = "MajorUpgrade";

/// What the StatefulSet runs while an upgrade holds the cluster on its old major.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hold {
    pub version: i32,
    pub image: String,
    /// 0 while stopped for `pg_upgrade`; `spec.instances` after a failure.
    pub instances: i32,
}

/// A one-off Job (the upgrade's, a parameters check), as read.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum JobState {
    #[default]
    Missing,
    Running,
    Succeeded,
    Failed(String),
}

/// What [`plan`] looks at.
#[derive(Clone, Debug)]
pub struct Inputs<'a> {
    pub spec_version: i32,
    pub spec_instances: i32,
    pub generation: Option<i64>,
    /// The major the data is on (`status.currentVersion`).
    pub current_version: Option<i32>,
    pub previous: Option<&'a MajorUpgradeStatus>,
    /// The primary (the Lease's holder, or the status' last one).
    pub primary: Option<&'a str>,
    /// Who last ran read-write, as the cluster's Lease says: the instance that recorded a
    /// clean stop on it, else its (last) holder. Read once every pod is gone.
    pub last_primary: Option<&'a str>,
    /// The image the StatefulSet runs now.
    pub running_image: Option<&'a str>,
    /// The cluster's pods that exist.
    pub pods: usize,
    /// The first instance (`<cluster>-0`) is Ready: a switchover target.
    pub first_ready: bool,
    pub backup_configured: bool,
    /// The pre-upgrade backup's phase and message, if it exists.
    pub backup: Option<(Option<BackupPhase>, Option<String>)>,
    pub job: JobState,
    pub now: String,
}

/// What to do about it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Decision {
    pub status: Option<MajorUpgradeStatus>,
    pub hold: Option<Hold>,
    pub create_backup: Option<String>,
    pub create_job: bool,
    /// A new attempt: the Jobs of earlier ones go (each attempt has its own, kept until then
    /// so that a reconcile working from a stale status finds the same outcome again).
    pub delete_old_jobs: bool,
    /// Hand the Lease to this instance before the StatefulSet comes back.
    pub hand_lease: Option<String>,
    /// The attempt's Job finished: delete its pod (the Job stays, with its outcome). A
    /// finished pod still counts as using the instance's claim, so while it exists a claim
    /// deleted later (a lost volume, an instance to clone afresh) stays Terminating and the
    /// StatefulSet never brings the instance back.
    pub release_claim: Option<String>,
    /// Switch the primary over to this instance first (the upgrade starts on it).
    pub switchover_to: Option<String>,
    /// The [`MAJOR_UPGRADE`] condition; `None`: no condition.
    pub condition: Option<Condition>,
    /// The Event to publish.
    pub event: Option<Wanted>,
}

/// The backup taken before upgrading `cluster` to `to`.
pub fn backup_name(cluster: &str, to: i32) -> String {
    format!("{cluster}-before-pg{to}")
}

/// The upgrade Job of `cluster` for the attempt made at `generation`, within the 63
/// characters of the `job-name` label: `<cluster>-major-upgrade-<generation>` when that fits
/// (the name every upgrade Job had, so one in flight is found again after an operator
/// upgrade), else `<cluster>-upgrade-<generation>` (a Job with the longer name could never be
/// created: nothing runs under it).
pub fn job_name(cluster: &str, generation: Option<i64>) -> String {
    let generation = generation.unwrap_or(0);
    let name = format!("{cluster}-major-upgrade-{generation}");
    if name.len() <= 63 {
        name
    } else {
        format!("{cluster}-upgrade-{generation}")
    }
}

/// The label on every upgrade Job of a cluster.
pub const UPGRADE_OF_LABEL: &str = "database.steward.dev/upgrade-of";

/// Decides the next step (see the module documentation): [`start`] one when none is in
/// flight, else [`advance`] the one that is.
pub fn plan(cluster: &str, i: &Inputs<'_>) -> Decision {
    match i
        .previous
        .filter(|u| !matches!(u.phase, Phase::Completed | Phase::Failed))
    {
        Some(u) => advance(cluster, i, u.clone()),
        None => start(cluster, i),
    }
}

/// The old major's image, at `instances`, while `u` runs or after it failed.
fn hold_old(u: &MajorUpgradeStatus, instances: i32) -> Hold {
    Hold {
        version: u.from,
        image: u.from_image.clone(),
        instances,
    }
}

/// Nothing in flight: starts an upgrade when `spec.version` is above the data's major, or
/// reports the last one.
fn start(cluster: &str, i: &Inputs<'_>) -> Decision {
    let mut d = Decision::default();
    let previous = i.previous;
    let retry_blocked = previous.is_some_and(|u| {
        u.phase == Phase::Failed && u.to == i.spec_version && u.generation == i.generation
    });
    // A completed upgrade put the data on its `to`, whatever a pod reported since.
    let current = match previous {
        Some(u) if u.phase == Phase::Completed => i.current_version.max(Some(u.to)),
        _ => i.current_version,
    };
    match (current, previous) {
        (Some(from), _) if i.spec_version > from && !retry_blocked => {
            let (Some(primary), Some(image)) = (i.primary, i.running_image) else {
                // Held on the major the data is on until it can start.
                d.hold = i.running_image.map(|image| Hold {
                    version: from,
                    image: image.to_string(),
                    instances: i.spec_instances,
                });
                d.condition = Some(Condition::fails(
                    "WaitingForPrimary",
                    format!(
                        "upgrading PostgreSQL {from} to {} starts once a primary runs",
                        i.spec_version
                    ),
                ));
                return d;
            };
            if !primary.ends_with("-0") {
                // The StatefulSet starts its pods in order, each once the one before is
                // Ready: the upgraded instance must be the first, or the others would wait
                // for a primary that is never started. A switchover moves it there.
                d.hold = Some(Hold {
                    version: from,
                    image: image.to_string(),
                    instances: i.spec_instances,
                });
                let first = format!("{cluster}-0");
                d.condition = Some(if i.first_ready {
                    d.switchover_to = Some(first.clone());
                    Condition::fails(
                        "SwitchingOver",
                        format!(
                            "upgrading PostgreSQL {from} to {} starts on the first instance: switching the primary over from {primary} to {first}",
                            i.spec_version
                        ),
                    )
                } else {
                    Condition::fails(
                        "PrimaryNotFirst",
                        format!(
                            "upgrading PostgreSQL {from} to {} needs the primary on the first instance: waiting for {first} to be a ready replica to switch over to (the primary is {primary})",
                            i.spec_version
                        ),
                    )
                });
                return d;
            }
            let mut u = MajorUpgradeStatus {
                from,
                to: i.spec_version,
                phase: Phase::Stopping,
                instance: primary.to_string(),
                from_image: image.to_string(),
                generation: i.generation,
                started_at: Some(i.now.clone()),
                ..Default::default()
            };
            d.delete_old_jobs = true;
            if i.backup_configured {
                u.phase = Phase::BackingUp;
                let name = backup_name(cluster, u.to);
                u.backup = Some(name.clone());
                d.create_backup = Some(name);
            }
            d.event = Some(Wanted::normal(
                "MajorUpgrade",
                ACTION,
                format!(
                    "upgrading PostgreSQL {from} to {} with pg_upgrade on {primary}'s volume{}",
                    u.to,
                    if i.backup_configured {
                        ", after a backup"
                    } else {
                        ""
                    }
                ),
            ));
            d.hold = Some(hold_old(
                &u,
                if u.phase == Phase::Stopping {
                    0
                } else {
                    i.spec_instances
                },
            ));
            return progress(d, u);
        }
        (_, Some(u)) if u.phase == Phase::Failed => {
            d.hold = Some(hold_old(u, i.spec_instances));
            return progress(d, u.clone());
        }
        (_, Some(u)) if u.phase == Phase::Completed => return progress(d, u.clone()),
        _ => {}
    }
    d
}

/// The upgrade `u` in flight: its next phase.
fn advance(cluster: &str, i: &Inputs<'_>, mut u: MajorUpgradeStatus) -> Decision {
    let mut d = Decision::default();
    let finished = |u: &mut MajorUpgradeStatus, phase: Phase, message: Option<String>| {
        u.phase = phase;
        u.message = message;
        u.finished_at = Some(i.now.clone());
    };
    match u.phase {
        Phase::BackingUp => match &i.backup {
            Some((Some(BackupPhase::Completed), _)) => {
                u.phase = Phase::Stopping;
                d.hold = Some(hold_old(&u, 0));
            }
            Some((Some(BackupPhase::Failed), message)) => {
                let why = format!(
                    "the backup {} taken first failed: {}",
                    u.backup.clone().unwrap_or_default(),
                    message.as_deref().unwrap_or("no reason given")
                );
                finished(&mut u, Phase::Failed, Some(why));
                d.hold = Some(hold_old(&u, i.spec_instances));
            }
            None => {
                d.create_backup = u.backup.clone();
                d.hold = Some(hold_old(&u, i.spec_instances));
            }
            Some(_) => d.hold = Some(hold_old(&u, i.spec_instances)),
        },
        Phase::Stopping => {
            d.hold = Some(hold_old(&u, 0));
            if i.pods == 0 {
                // The primary may have moved since the upgrade started (a failover while
                // backing up or stopping): pg_upgrade runs on the volume of the instance
                // that last wrote, never on a stale copy (issue #37, item 11).
                if let Some(last) = i.last_primary.filter(|l| *l != u.instance) {
                    u.instance = last.to_string();
                }
                u.phase = Phase::Upgrading;
                d.create_job = i.job == JobState::Missing;
            }
        }
        Phase::Upgrading => match &i.job {
            JobState::Succeeded => {
                finished(&mut u, Phase::Completed, None);
                d.release_claim = Some(job_name(cluster, u.generation));
                // Only while nothing runs: a reconcile from a stale status must never move
                // the Lease under a running primary.
                d.hand_lease = (i.pods == 0).then(|| u.instance.clone());
                if i.backup_configured {
                    // The old base backups cannot be replayed into the new cluster's WAL (a new
                    // system identifier): a point in time after the upgrade needs a new one.
                    d.create_backup = Some(format!("{cluster}-after-pg{}", u.to));
                }
                d.event = Some(Wanted::normal(
                    "MajorUpgraded",
                    ACTION,
                    format!(
                        "{} upgraded from PostgreSQL {} to {}: starting the instances, the replicas clone it again",
                        u.instance, u.from, u.to
                    ),
                ));
            }
            JobState::Failed(message) => {
                finished(&mut u, Phase::Failed, Some(message.clone()));
                d.release_claim = Some(job_name(cluster, u.generation));
                // Back on the old major, the same instance is the primary again.
                d.hand_lease = (i.pods == 0).then(|| u.instance.clone());
                d.hold = Some(hold_old(&u, i.spec_instances));
                d.event = Some(Wanted::warning(
                    "MajorUpgradeFailed",
                    ACTION,
                    format!(
                        "pg_upgrade failed; back on PostgreSQL {} with the data untouched: {message}",
                        u.from
                    ),
                ));
            }
            JobState::Missing => {
                d.create_job = true;
                d.hold = Some(hold_old(&u, 0));
            }
            JobState::Running => d.hold = Some(hold_old(&u, 0)),
        },
        Phase::Completed | Phase::Failed => {}
    }
    progress(d, u)
}

/// At most the first `max` characters of `reason` (the full one stays in the status).
fn brief(reason: &str, max: usize) -> String {
    if reason.chars().count() <= max {
        return reason.to_string();
    }
    let cut: String = reason.chars().take(max).collect();
    format!("{cut}… (the whole reason is in status.majorUpgrade.message)")
}

/// The condition and status for `u` after a step.
fn progress(mut d: Decision, u: MajorUpgradeStatus) -> Decision {
    d.condition = Some(match u.phase {
        Phase::BackingUp => Condition::fails(
            "BackingUp",
            format!(
                "upgrading PostgreSQL {} to {}: waiting for the backup {}",
                u.from,
                u.to,
                u.backup.as_deref().unwrap_or_default()
            ),
        ),
        Phase::Stopping => Condition::fails(
            "Stopping",
            format!(
                "upgrading PostgreSQL {} to {}: stopping every instance",
                u.from, u.to
            ),
        ),
        Phase::Upgrading => Condition::fails(
            "Upgrading",
            format!(
                "upgrading PostgreSQL {} to {}: pg_upgrade runs on {}'s volume",
                u.from, u.to, u.instance
            ),
        ),
        Phase::Completed => Condition::holds(
            "Completed",
            format!("upgraded PostgreSQL {} to {}", u.from, u.to),
        ),
        Phase::Failed => Condition::fails(
            "Failed",
            format!(
                "upgrading PostgreSQL {} to {} failed; the instances run {} with their data: {}. Fix the cause and change the spec to try again.",
                u.from,
                u.to,
                u.from,
                brief(u.message.as_deref().unwrap_or("no reason recorded"), 800)
            ),
        ),
    });
    d.status = Some(u);
    d
}

/// `cluster` as the StatefulSet must be built while `hold` applies.
pub fn held(cluster: &PostgresCluster, hold: Option<&Hold>) -> PostgresCluster {
    let mut held = cluster.clone();
    if let Some(h) = hold {
        held.spec.version = h.version;
        held.spec.image = Some(h.image.clone());
        held.spec.instances = h.instances;
    }
    held
}

/// The image of the postgres container of `sts`.
pub fn running_image(sts: &StatefulSet) -> Option<String> {
    sts.spec
        .template
        .spec
        .as_ref()?
        .containers
        .iter()
        .find(|c| c.name == "postgres")?
        .image
        .clone()
}

/// The `action` of the upgrade's Events.
const ACTION: &str = "MajorUpgrade";

/// What [`observe`] read for [`plan`].
#[derive(Clone, Debug, Default)]
pub struct Observed {
    /// The status to decide from: as stored while an upgrade may be under way (a reconcile
    /// from a cached copy older than the last step would stop the instances again), else as
    /// cached.
    pub status: PostgresClusterStatus,
    /// The current attempt's Job.
    pub job: JobState,
    /// The pre-upgrade backup's phase and message, if it exists.
    pub backup: Option<(Option<BackupPhase>, Option<String>)>,
}

/// Reads the status to decide from, the attempt's Job and its backup.
///
/// # Errors
/// [`Error::Read`] naming the object.
pub async fn observe(client: &kube::Client, cluster: &PostgresCluster) -> Result<Observed, Error> {
    let ns = cluster.namespace().unwrap_or_default();
    let name = cluster.name_any();
    let cached = cluster.status.clone().unwrap_or_default();
    let upgrading = cached
        .major_upgrade
        .as_ref()
        .is_some_and(|u| !matches!(u.phase, Phase::Completed | Phase::Failed))
        || cached
            .current_version
            .is_some_and(|v| cluster.spec.version > v);
    let status = if upgrading {
        let clusters: Api<PostgresCluster> = Api::namespaced(client.clone(), &ns);
        let stored = clusters.get(&name).await.map_err(|source| Error::Read {
            what: format!("PostgresCluster {name}"),
            source,
        })?;
        stored.status.unwrap_or(cached)
    } else {
        cached
    };
    let mut observed = Observed {
        status,
        ..Observed::default()
    };
    let Some(u) = &observed.status.major_upgrade else {
        return Ok(observed);
    };
    let jobs: Api<Job> = Api::namespaced(client.clone(), &ns);
    observed.job = job_state(client, &ns, &jobs, &job_name(&name, u.generation)).await?;
    if let Some(backup) = &u.backup {
        let backups: Api<PostgresBackup> = Api::namespaced(client.clone(), &ns);
        observed.backup = backups
            .get_opt(backup)
            .await
            .map_err(|source| Error::Read {
                what: format!("PostgresBackup {backup}"),
                source,
            })?
            .map(|b| {
                let status = b.status.unwrap_or_default();
                (status.phase, status.message)
            });
    }
    Ok(observed)
}

/// Does what `d` decided for `cluster`: the backup, the Jobs (the earlier attempts' deleted,
/// this one's created as `upgrade_job` builds it, its finished pod deleted), the Lease handed
/// over, the switchover asked for on the Lease `lease` (`leases`), the Event published.
///
/// # Errors
/// [`Error::MajorUpgrade`] naming the action, or the switchover request's error.
pub async fn execute(
    ctx: &steward_core::Context<crate::State>,
    cluster: &PostgresCluster,
    d: &Decision,
    upgrade_job: impl FnOnce(&MajorUpgradeStatus) -> Job,
    (leases, lease): (&Api<Lease>, &str),
) -> Result<(), Error> {
    let client = &ctx.client;
    let ns = cluster.namespace().unwrap_or_default();
    let name = cluster.name_any();
    let jobs: Api<Job> = Api::namespaced(client.clone(), &ns);
    if let Some(backup) = &d.create_backup {
        let mut pgb = PostgresBackup::new(
            backup,
            PostgresBackupSpec {
                cluster: name.clone(),
            },
        );
        pgb.metadata.namespace = Some(ns.clone());
        pgb.metadata.owner_references = cluster.controller_owner_ref(&()).map(|o| vec![o]);
        let backups: Api<PostgresBackup> = Api::namespaced(client.clone(), &ns);
        unless_exists(backups.create(&PostParams::default(), &pgb).await).map_err(|source| {
            Error::MajorUpgrade {
                what: format!("create PostgresBackup {backup}"),
                source,
            }
        })?;
    }
    if d.delete_old_jobs {
        let earlier = ListParams::default().labels(&format!("{UPGRADE_OF_LABEL}={name}"));
        jobs.delete_collection(&DeleteParams::background(), &earlier)
            .await
            .map_err(|source| Error::MajorUpgrade {
                what: "delete the Jobs of earlier attempts".into(),
                source,
            })?;
    }
    if d.create_job
        && let Some(u) = &d.status
    {
        let job_name = job_name(&name, u.generation);
        unless_exists(jobs.create(&PostParams::default(), &upgrade_job(u)).await).map_err(
            |source| Error::MajorUpgrade {
                what: format!("create Job {job_name}"),
                source,
            },
        )?;
    }
    if let Some(job) = &d.release_claim {
        let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(client.clone(), &ns);
        let of_job = ListParams::default().labels(&format!("batch.kubernetes.io/job-name={job}"));
        let failed = |source| Error::MajorUpgrade {
            what: format!("delete the pod of Job {job}"),
            source,
        };
        // One by one: the operator may list and delete pods, not delete collections of them.
        for pod in pods.list_metadata(&of_job).await.map_err(failed)? {
            unless_gone(pods.delete(&pod.name_any(), &DeleteParams::default()).await)
                .map_err(failed)?;
        }
    }
    if let Some(instance) = &d.hand_lease {
        hand_lease(client, &ns, &name, instance).await?;
    }
    if let Some(event) = &d.event {
        ctx.recorder.emit(cluster, event.clone()).await;
    }
    if let Some(to) = &d.switchover_to {
        super::request_switchover(leases, lease, to).await?;
    }
    Ok(())
}

/// The Job's outcome; a failure's reason is its pod's termination message.
pub(crate) async fn job_state(
    client: &kube::Client,
    ns: &str,
    jobs: &Api<Job>,
    name: &str,
) -> Result<JobState, Error> {
    let read = |source| Error::Read {
        what: format!("Job {name}"),
        source,
    };
    let Some(job) = jobs.get_opt(name).await.map_err(read)? else {
        return Ok(JobState::Missing);
    };
    let status = job.status.unwrap_or_default();
    if status.succeeded.unwrap_or(0) > 0 {
        return Ok(JobState::Succeeded);
    }
    let failed = status.failed.unwrap_or(0) > 0
        || status
            .conditions
            .unwrap_or_default()
            .iter()
            .any(|c| c.type_ == "Failed" && c.status == "True");
    if !failed {
        return Ok(JobState::Running);
    }
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let listed = pods
        .list(&ListParams::default().labels(&format!("job-name={name}")))
        .await
        .map_err(read)?;
    let reason = listed
        .items
        .iter()
        .filter_map(|p| p.status.as_ref()?.container_statuses.as_ref())
        .flatten()
        .filter_map(|c| c.state.as_ref()?.terminated.as_ref()?.message.clone())
        .find(|m| !m.trim().is_empty())
        .unwrap_or_else(|| format!("the Job {name} failed; see its pod's log"));
    Ok(JobState::Failed(reason.trim().to_string()))
}

/// Makes `instance` the Lease's holder while no instance runs, so it starts as the primary.
/// A missing Lease (an instance manager never took it, or it was deleted) is created held by
/// `instance`, for the instance managers' default duration; its holder renews it with its own.
async fn hand_lease(
    client: &kube::Client,
    ns: &str,
    cluster: &str,
    instance: &str,
) -> Result<(), Error> {
    let leases: Api<Lease> = Api::namespaced(client.clone(), ns);
    let lease = steward_database_api::contract::lease_name(cluster);
    let failed = |source| Error::MajorUpgrade {
        what: format!("hand the Lease {lease} to {instance}"),
        source,
    };
    let existing = leases.get_opt(&lease).await.map_err(|source| Error::Read {
        what: format!("Lease {lease}"),
        source,
    })?;
    let transitions = existing
        .as_ref()
        .and_then(|l| l.spec.as_ref()?.lease_transitions)
        .unwrap_or(0);
    let spec = handed_lease_spec(instance, transitions, k8s_openapi::jiff::Timestamp::now());
    match existing {
        Some(_) => leases
            .patch(
                &lease,
                &PatchParams::default(),
                &Patch::Merge(&serde_json::json!({ "spec": spec })),
            )
            .await
            .map(drop)
            .map_err(failed),
        None => {
            let created = Lease {
                metadata: kube::api::ObjectMeta {
                    name: Some(lease.clone()),
                    namespace: Some(ns.to_string()),
                    ..Default::default()
                },
                spec: Some(LeaseSpec {
                    lease_duration_seconds: Some(INSTANCE_LEASE_SECONDS),
                    ..spec
                }),
            };
            leases
                .create(&PostParams::default(), &created)
                .await
                .map(drop)
                .map_err(failed)
        }
    }
}

/// The instance managers' default Lease duration (`steward-pg-instance --lease-duration`).
const INSTANCE_LEASE_SECONDS: i32 = 10;

/// The Lease fields that make `instance` its holder, acquired and renewed `now`.
fn handed_lease_spec(
    instance: &str,
    transitions: i32,
    now: k8s_openapi::jiff::Timestamp,
) -> LeaseSpec {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
    LeaseSpec {
        holder_identity: Some(instance.to_string()),
        acquire_time: Some(MicroTime(now)),
        renew_time: Some(MicroTime(now)),
        lease_transitions: Some(transitions + 1),
        ..Default::default()
    }
}

/// The upgrade Job: the pod template of `sts` (the new major's StatefulSet) with the volume
/// of `u.instance`, an init container of the old image that exports its programs, and the
/// postgres container running `major-upgrade` instead of the instance manager.
pub fn job(cluster: &PostgresCluster, sts: &StatefulSet, u: &MajorUpgradeStatus) -> Job {
    use k8s_openapi::api::core::v1::{PersistentVolumeClaimVolumeSource, Volume};

    let name = cluster.name_any();
    let mut job = one_off_job(
        cluster,
        sts,
        &job_name(&name, u.generation),
        [
            ("database.steward.dev/major-upgrade", u.to.to_string()),
            (UPGRADE_OF_LABEL, name.clone()),
        ],
    );
    if let Some(spec) = job.spec.as_mut().and_then(|j| j.template.spec.as_mut()) {
        let claim = format!("data-{}", u.instance);
        let mut volumes: Vec<Volume> = spec.volumes.clone().unwrap_or_default();
        volumes.retain(|v| v.name != "data");
        volumes.push(Volume {
            name: "data".into(),
            persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                claim_name: claim,
                read_only: Some(false),
            }),
            ..Default::default()
        });
        spec.volumes = Some(volumes);
        let old = format!("{}/old", build::STEWARD_DIR);
        let binary = format!("{}/bin/{BINARY}", build::STEWARD_DIR);
        let main = spec.containers.first().cloned().unwrap_or_default();
        let mut export = main.clone();
        export.name = "export-old-major".into();
        export.image = Some(u.from_image.clone());
        export.command = Some(vec![binary.clone(), "export-binaries".into(), old.clone()]);
        strip_instance(&mut export);
        let mut upgrade = main;
        upgrade.name = "major-upgrade".into();
        upgrade.command = Some(vec![binary, "major-upgrade".into(), "--old".into(), old]);
        strip_instance(&mut upgrade);
        spec.init_containers
            .get_or_insert_with(Vec::new)
            .push(export);
        spec.containers = vec![upgrade];
    }
    job
}

/// A one-off Job `name` of `cluster` (the major upgrade, a parameters check) made from the
/// instances' pod template `sts`: labelled with `labels` and not as an instance (the Services
/// and the PodDisruptionBudget must not select it), watched by the cluster's controller (its
/// status wakes the reconcile), owned by the cluster, its pod never restarted nor retried.
pub(crate) fn one_off_job<'a>(
    cluster: &PostgresCluster,
    sts: &StatefulSet,
    name: &str,
    labels: impl IntoIterator<Item = (&'a str, String)>,
) -> Job {
    let mut template = sts.spec.template.clone();
    let mut all = build::selector_labels(&cluster.name_any());
    all.remove(build::CLUSTER_LABEL);
    all.extend(labels.into_iter().map(|(k, v)| (k.to_string(), v)));
    all.insert(
        steward_core::apply::MANAGED_BY_LABEL.into(),
        crate::NAME.into(),
    );
    let metadata = template.metadata.get_or_insert_with(Default::default);
    metadata.labels = Some(all.clone());
    metadata.annotations = None;
    if let Some(spec) = template.spec.as_mut() {
        spec.restart_policy = Some("Never".into());
    }
    Job {
        metadata: kube::api::ObjectMeta {
            name: Some(name.to_string()),
            namespace: cluster.namespace(),
            labels: Some(all),
            owner_references: cluster.controller_owner_ref(&()).map(|o| vec![o]),
            ..Default::default()
        },
        spec: Some(k8s_openapi::api::batch::v1::JobSpec {
            backoff_limit: Some(0),
            template,
            ..Default::default()
        }),
        status: None,
    }
}

/// A container of the instance's template as a one-off step: no probes or ports.
pub(crate) fn strip_instance(c: &mut k8s_openapi::api::core::v1::Container) {
    c.readiness_probe = None;
    c.liveness_probe = None;
    c.startup_probe = None;
    c.ports = None;
    c.termination_message_policy = Some("FallbackToLogsOnError".into());
}

#[cfg(test)]
mod tests {
    use super::*;
    use steward_core::events::EventType;

    fn inputs<'a>(previous: Option<&'a MajorUpgradeStatus>) -> Inputs<'a> {
        Inputs {
            spec_version: 17,
            spec_instances: 2,
            generation: Some(3),
            current_version: Some(15),
            previous,
            primary: Some("pg-0"),
            last_primary: Some("pg-0"),
            running_image: Some("postgres:15"),
            pods: 2,
            first_ready: true,
            backup_configured: false,
            backup: None,
            job: JobState::Missing,
            now: "2026-12-02T00:00:00Z".into(),
        }
    }

    #[test]
    fn raising_the_version_stops_the_old_major_then_runs_the_job_then_hands_over() {
        let d = plan("pg", &inputs(None));
        let u = d.status.clone().unwrap();
        assert_eq!((u.from, u.to, u.phase), (15, 17, Phase::Stopping));
        assert!(d.delete_old_jobs, "a new attempt");
        assert_eq!(job_name("pg", u.generation), "pg-major-upgrade-3");
        // The longest cluster name (47 characters) from generation 10 on.
        let longest = "p".repeat(47);
        assert_eq!(job_name(&longest, Some(9)).len(), 63);
        for generation in [10, 999, 9_999_999] {
            let name = job_name(&longest, Some(generation));
            assert!(name.len() <= 63, "{name}");
            assert!(name.ends_with(&format!("-upgrade-{generation}")), "{name}");
        }
        assert_eq!(u.instance, "pg-0");
        assert_eq!(
            d.hold,
            Some(Hold {
                version: 15,
                image: "postgres:15".into(),
                instances: 0
            })
        );
        assert!(!d.create_job && d.create_backup.is_none());

        // Pods still there: keep stopping.
        let d = plan("pg", &inputs(Some(&u)));
        assert_eq!(d.status.as_ref().unwrap().phase, Phase::Stopping);
        // All gone: the Job.
        let mut i = inputs(Some(&u));
        i.pods = 0;
        let d = plan("pg", &i);
        let u = d.status.clone().unwrap();
        assert_eq!(u.phase, Phase::Upgrading);
        assert!(d.create_job);
        assert_eq!(d.hold.as_ref().unwrap().instances, 0);
        // A failover while stopping: the Job goes to the instance that last wrote.
        let stopping = plan("pg", &inputs(None)).status.unwrap();
        let mut moved = inputs(Some(&stopping));
        moved.pods = 0;
        moved.last_primary = Some("pg-1");
        assert_eq!(plan("pg", &moved).status.unwrap().instance, "pg-1");

        let upgrading_copy = u.clone();
        let mut i = inputs(Some(&u));
        i.pods = 0;
        i.job = JobState::Running;
        let d = plan("pg", &i);
        assert!(!d.create_job && d.hand_lease.is_none());

        i.job = JobState::Succeeded;
        let d = plan("pg", &i);
        let u = d.status.clone().unwrap();
        assert_eq!(u.phase, Phase::Completed);
        assert_eq!(d.hand_lease.as_deref(), Some("pg-0"));
        assert!(d.hold.is_none());
        // The finished Job's pod goes, or the instance's claim could never be deleted.
        assert_eq!(
            d.release_claim,
            Some(job_name("pg", upgrading_copy.generation))
        );
        // The same outcome read again from a stale status, after the pods came back: the
        // Lease is not moved.
        let mut stale = inputs(Some(&upgrading_copy));
        stale.job = JobState::Succeeded;
        assert_eq!(plan("pg", &stale).hand_lease, None);
        assert!(d.condition.as_ref().unwrap().status);

        // Afterwards (the data is on 17): nothing more to do.
        let mut i = inputs(Some(&u));
        i.current_version = Some(17);
        let d = plan("pg", &i);
        assert!(d.hold.is_none() && !d.create_job && d.create_backup.is_none());
        assert_eq!(d.condition.unwrap().reason, "Completed");
    }

    #[test]
    fn a_failed_upgrade_runs_the_old_major_again_until_the_spec_changes() {
        let mut u = plan("pg", &inputs(None)).status.unwrap();
        u.phase = Phase::Upgrading;
        let mut i = inputs(Some(&u));
        i.pods = 0;
        i.job = JobState::Failed("pg_upgrade: prepared transactions".into());
        let d = plan("pg", &i);
        let failed = d.status.clone().unwrap();
        assert_eq!(failed.phase, Phase::Failed);
        assert_eq!(d.release_claim, Some(job_name("pg", u.generation)));
        assert_eq!(
            d.hold,
            Some(Hold {
                version: 15,
                image: "postgres:15".into(),
                instances: 2
            })
        );
        let Condition {
            status: ok,
            reason,
            message,
        } = d.condition.unwrap();
        assert!(
            !ok && reason == "Failed" && message.contains("prepared transactions"),
            "{message}"
        );
        assert_eq!(d.event.unwrap().type_, EventType::Warning);
        assert_eq!(
            d.hand_lease.as_deref(),
            Some("pg-0"),
            "nobody else could take it"
        );

        // Same generation: stays failed, on the old major.
        let d = plan("pg", &inputs(Some(&failed)));
        assert_eq!(d.status.unwrap().phase, Phase::Failed);
        assert_eq!(d.hold.unwrap().instances, 2);
        // A new generation: tried again.
        let mut i = inputs(Some(&failed));
        i.generation = Some(4);
        let d = plan("pg", &i);
        assert_eq!(d.status.unwrap().phase, Phase::Stopping);
    }

    #[test]
    fn with_backups_a_backup_comes_first_and_its_failure_changes_nothing() {
        let mut i = inputs(None);
        i.backup_configured = true;
        let d = plan("pg", &i);
        let u = d.status.clone().unwrap();
        assert_eq!(u.phase, Phase::BackingUp);
        assert_eq!(d.create_backup.as_deref(), Some("pg-before-pg17"));
        assert_eq!(
            d.hold.unwrap().instances,
            2,
            "still serving while it backs up"
        );

        let mut i = inputs(Some(&u));
        i.backup = Some((Some(BackupPhase::Running), None));
        assert_eq!(plan("pg", &i).status.unwrap().phase, Phase::BackingUp);
        i.backup = Some((Some(BackupPhase::Completed), None));
        assert_eq!(plan("pg", &i).status.unwrap().phase, Phase::Stopping);
        let mut upgrading = plan("pg", &i).status.unwrap();
        upgrading.phase = Phase::Upgrading;
        let mut done = inputs(Some(&upgrading));
        done.backup_configured = true;
        done.job = JobState::Succeeded;
        assert_eq!(
            plan("pg", &done).create_backup.as_deref(),
            Some("pg-after-pg17"),
            "a new base backup for the new major"
        );
        i.backup = Some((Some(BackupPhase::Failed), Some("no space".into())));
        let d = plan("pg", &i);
        assert_eq!(d.status.unwrap().phase, Phase::Failed);
        assert!(d.condition.unwrap().message.contains("no space"));
    }

    #[test]
    fn no_upgrade_without_a_primary_or_below_the_data_major() {
        let mut i = inputs(None);
        i.primary = None;
        let d = plan("pg", &i);
        assert!(d.status.is_none());
        assert_eq!(d.hold.unwrap().version, 15, "kept on the data's major");
        assert_eq!(d.condition.unwrap().reason, "WaitingForPrimary");
        // The primary elsewhere: switched over to the first instance, then it starts.
        let mut i = inputs(None);
        i.primary = Some("pg-1");
        let d = plan("pg", &i);
        assert!(d.status.is_none());
        assert_eq!(d.hold.unwrap().version, 15);
        assert_eq!(d.switchover_to.as_deref(), Some("pg-0"));
        assert_eq!(d.condition.unwrap().reason, "SwitchingOver");
        i.first_ready = false;
        let d = plan("pg", &i);
        assert_eq!(d.switchover_to, None);
        assert_eq!(d.condition.unwrap().reason, "PrimaryNotFirst");
        let mut i = inputs(None);
        i.spec_version = 15;
        assert_eq!(plan("pg", &i), Decision::default());
        let mut i = inputs(None);
        i.current_version = None;
        assert_eq!(plan("pg", &i), Decision::default());
    }

    #[test]
    fn a_handed_lease_names_the_instance_and_counts_a_transition() {
        let now = k8s_openapi::jiff::Timestamp::UNIX_EPOCH;
        let spec = handed_lease_spec("pg-0", 4, now);
        assert_eq!(spec.holder_identity.as_deref(), Some("pg-0"));
        assert_eq!(spec.lease_transitions, Some(5));
        assert_eq!(spec.renew_time, spec.acquire_time);
        // A merge patch leaves the holder's own duration alone.
        let patch = serde_json::to_value(&spec).expect("json");
        assert!(patch.get("leaseDurationSeconds").is_none(), "{patch}");
    }
}
