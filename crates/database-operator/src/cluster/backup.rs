//! A PostgresCluster's continuous backup, as the operator sees it: scheduled
//! `PostgresBackup`s, retention of completed ones, and `status.backup` with the
//! `ContinuousArchiving` condition.
//!
//! The instance managers do the work (the primary archives WAL and takes each
//! `PostgresBackup`, see `steward_pg_instance::backups`); the operator only creates backups
//! when the schedule says, deletes the `PostgresBackup`s whose base backups the retention
//! policy removed from the object store, and reports.

use std::time::Duration;

use croner::Cron;
use croner::parser::{CronParser, Seconds, Year};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::{Resource, ResourceExt};
use steward_core::conditions::Wanted;
use steward_core::object::unless_exists;
use steward_database_api::contract::{Archiver, BackupPhase};

use crate::crd::{ClusterBackupStatus, PostgresBackup, PostgresBackupSpec, PostgresCluster};
use crate::error::Error;

/// The condition on a cluster with `spec.backup`: WAL reaches the object store.
pub const CONTINUOUS_ARCHIVING: &str = "ContinuousArchiving";

/// `spec.backup.schedule`, parsed (5 fields or a nickname).
///
/// # Errors
/// A message naming the field.
pub fn parse_schedule(schedule: &str) -> Result<Cron, String> {
    let fields = schedule.split_whitespace().count();
    if fields != 5 && !schedule.trim_start().starts_with('@') {
        return Err(format!(
            "spec.backup.schedule {schedule:?} has {fields} fields; expected 5 (minute hour day-of-month month day-of-week, UTC) or a nickname such as @daily"
        ));
    }
    CronParser::builder()
        .seconds(Seconds::Disallowed)
        .year(Year::Disallowed)
        .build()
        .parse(schedule)
        .map_err(|e| format!("spec.backup.schedule {schedule:?}: {e}"))
}

/// What the schedule asks for at `now`: the backup due (its time) if one is, and when to
/// look again. `last`: when the schedule last created a backup (else the cluster's
/// creation): a time missed while the operator was down is made up once, not once per miss.
pub fn schedule_step(
    cron: &Cron,
    last: jiff::Timestamp,
    now: jiff::Timestamp,
) -> (Option<jiff::Timestamp>, Option<jiff::Timestamp>) {
    let utc = |t: jiff::Timestamp| t.to_zoned(jiff::tz::TimeZone::UTC);
    let next = cron
        .find_next_occurrence(&utc(last), false)
        .ok()
        .map(|z| z.timestamp());
    match next {
        Some(due) if due <= now => {
            let following = cron
                .find_next_occurrence(&utc(now), false)
                .ok()
                .map(|z| z.timestamp());
            (Some(due), following)
        }
        other => (None, other),
    }
}

pub use crate::crd::scheduled_backup_name as scheduled_name;

/// The completed backups as (completion time, name), oldest first.
fn completed(backups: &[PostgresBackup]) -> Vec<(&str, String)> {
    let mut completed: Vec<(&str, String)> = backups
        .iter()
        .filter_map(|b| {
            let status = b.status.as_ref()?;
            (status.phase == Some(BackupPhase::Completed))
                .then(|| (status.completed_at.as_deref().unwrap_or(""), b.name_any()))
        })
        .collect();
    completed.sort();
    completed
}

/// Completed backups beyond the `keep` newest, oldest first: the ones retention removed.
pub fn beyond_retention(backups: &[PostgresBackup], keep: usize) -> Vec<String> {
    let completed = completed(backups);
    let extra = completed.len().saturating_sub(keep);
    completed
        .into_iter()
        .take(extra)
        .map(|(_, name)| name)
        .collect()
}

/// `status.backup` from the primary's archiver and the completed backups.
pub fn status(
    archiver: Option<&Archiver>,
    backups: &[PostgresBackup],
    last_scheduled: Option<String>,
) -> ClusterBackupStatus {
    // Only those that say when they completed are recovery points.
    let completed: Vec<(&str, String)> = completed(backups)
        .into_iter()
        .filter(|(at, _)| !at.is_empty())
        .collect();
    let archiver = archiver.cloned().unwrap_or_default();
    ClusterBackupStatus {
        last_archived_wal: archiver.last_archived_wal,
        last_archived_time: archiver.last_archived_at,
        last_failed_wal: archiver.last_failed_wal,
        last_failed_time: archiver.last_failed_at,
        last_base_backup: completed.last().map(|(_, n)| n.clone()),
        last_base_backup_time: completed.last().map(|(t, _)| (*t).to_string()),
        first_recoverability_point: completed.first().map(|(t, _)| (*t).to_string()),
        last_scheduled_time: last_scheduled,
    }
}

/// The `ContinuousArchiving` condition for `status`.
pub fn archiving_condition(status: &ClusterBackupStatus) -> Wanted {
    let archiver = Archiver {
        last_archived_wal: status.last_archived_wal.clone(),
        last_archived_at: status.last_archived_time.clone(),
        last_failed_wal: status.last_failed_wal.clone(),
        last_failed_at: status.last_failed_time.clone(),
    };
    if archiver.failing() {
        let success = match (&status.last_archived_wal, &status.last_archived_time) {
            (Some(wal), Some(at)) => format!("the last success was {wal} at {at}"),
            _ => "no WAL file was ever archived".to_string(),
        };
        return Wanted::fails(
            "ArchivingFailing",
            format!(
                "archiving WAL file {} failed at {}; {success}. PostgreSQL keeps the WAL until it is archived: see the primary's log",
                status.last_failed_wal.as_deref().unwrap_or("?"),
                status.last_failed_time.as_deref().unwrap_or("?"),
            ),
        );
    }
    match (&status.last_archived_wal, &status.last_archived_time) {
        (Some(wal), Some(at)) => Wanted::holds("WALArchived", format!("last archived {wal} at {at}")),
        _ => Wanted::fails(
            "NoWALArchivedYet",
            "no WAL file archived yet (the primary switches to a new one when it starts and at least every archive_timeout)".to_string(),
        ),
    }
}

/// The `ContinuousArchiving` condition of a standby following `source`: it archives nothing
/// of its own until it is promoted.
pub fn standby_condition(source: &crate::crd::ObjectStore) -> Wanted {
    Wanted::fails(
        "Standby",
        format!(
            "a standby archives no WAL of its own while it follows {}: archiving to spec.backup starts when it is promoted (spec.replica.enabled: false), and so do scheduled base backups",
            source.url()
        ),
    )
}

/// What [`reconcile`] found.
pub struct Reported {
    pub status: ClusterBackupStatus,
    /// `ContinuousArchiving`.
    pub condition: Wanted,
    /// When the schedule is next due.
    pub requeue: Option<Duration>,
}

/// Creates the scheduled backup if one is due, deletes the backups beyond retention, and
/// returns `status.backup`, its `ContinuousArchiving` condition and
/// when the schedule is next due. A standby that follows its source (`spec.replica.enabled`)
/// schedules nothing (a time missed meanwhile is made up once, after its promotion).
///
/// # Errors
/// [`Error::Backups`] when listing, creating or deleting PostgresBackups fails.
pub async fn reconcile(
    client: &kube::Client,
    cluster: &PostgresCluster,
    primary: Option<&Pod>,
    previous: Option<&ClusterBackupStatus>,
) -> Result<Option<Reported>, Error> {
    let Some(spec) = &cluster.spec.backup else {
        return Ok(None);
    };
    let ns = cluster.namespace().unwrap_or_default();
    let name = cluster.name_any();
    let api: Api<PostgresBackup> = Api::namespaced(client.clone(), &ns);
    let err = |what: String| move |source| Error::Backups { what, source };
    let mut backups: Vec<PostgresBackup> = api
        .list(&ListParams::default())
        .await
        .map_err(err(format!("list the PostgresBackups of {ns}")))?
        .items
        .into_iter()
        .filter(|b| b.spec.cluster == name)
        .collect();

    let now = jiff::Timestamp::now();
    let mut last_scheduled = previous.and_then(|p| p.last_scheduled_time.clone());
    let mut requeue = None;
    let standby = super::standby::follows(&cluster.spec);
    if let Some(schedule) = spec.schedule.as_ref().filter(|_| standby.is_none()) {
        let cron = parse_schedule(schedule).map_err(Error::InvalidSpec)?;
        let since = last_scheduled
            .as_deref()
            .and_then(|t| t.parse().ok())
            .or_else(|| {
                cluster
                    .meta()
                    .creation_timestamp
                    .as_ref()
                    .and_then(|t| t.0.to_string().parse().ok())
            })
            .unwrap_or(now);
        let (due, next) = schedule_step(&cron, since, now);
        if let Some(due) = due {
            let backup_name = scheduled_name(&name, due);
            let mut backup = PostgresBackup::new(
                &backup_name,
                PostgresBackupSpec {
                    cluster: name.clone(),
                },
            );
            backup.meta_mut().namespace = Some(ns.clone());
            backup.meta_mut().owner_references = cluster.controller_owner_ref(&()).map(|o| vec![o]);
            let created = unless_exists(api.create(&PostParams::default(), &backup).await)
                .map_err(|source| Error::Backups {
                    what: format!("create the scheduled PostgresBackup {backup_name}"),
                    source,
                })?;
            backups.extend(created);
            last_scheduled = Some(due.to_string());
        }
        requeue = next.map(|n| {
            Duration::try_from(n.duration_since(now)).unwrap_or(Duration::from_secs(1))
                + Duration::from_secs(1)
        });
    }

    if let Some(keep) = spec.keep {
        for old in beyond_retention(&backups, keep as usize) {
            match api.delete(&old, &DeleteParams::default()).await {
                Ok(_) | Err(kube::Error::Api(_)) => {}
                Err(source) => {
                    return Err(Error::Backups {
                        what: format!("delete PostgresBackup {old} (beyond retention)"),
                        source,
                    });
                }
            }
            backups.retain(|b| b.name_any() != old);
        }
    }

    let archiver = primary
        .and_then(super::build::instance_report)
        .and_then(|s| s.archiver);
    let status = status(archiver.as_ref(), &backups, last_scheduled);
    let condition = standby.map_or_else(|| archiving_condition(&status), standby_condition);
    Ok(Some(Reported {
        status,
        condition,
        requeue,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use steward_database_api::contract::BackupRun;

    fn ts(s: &str) -> jiff::Timestamp {
        s.parse().unwrap()
    }

    fn backup(name: &str, phase: BackupPhase, completed: &str) -> PostgresBackup {
        let mut b = PostgresBackup::new(
            name,
            PostgresBackupSpec {
                cluster: "pg".into(),
            },
        );
        b.status = Some(BackupRun {
            phase: Some(phase),
            completed_at: Some(completed.into()),
            ..BackupRun::default()
        });
        b
    }

    #[test]
    fn a_due_schedule_makes_one_backup_even_after_missing_several() {
        let cron = parse_schedule("0 * * * *").unwrap();
        let (due, next) = schedule_step(
            &cron,
            ts("2026-12-02T01:00:00Z"),
            ts("2026-12-02T04:30:00Z"),
        );
        assert_eq!(due, Some(ts("2026-12-02T02:00:00Z")));
        assert_eq!(next, Some(ts("2026-12-02T05:00:00Z")));
        let (due, next) = schedule_step(
            &cron,
            ts("2026-12-02T04:00:00Z"),
            ts("2026-12-02T04:30:00Z"),
        );
        assert_eq!(due, None);
        assert_eq!(next, Some(ts("2026-12-02T05:00:00Z")));
        assert_eq!(
            scheduled_name("pg", ts("2026-12-02T05:00:00Z")),
            "pg-20261202050000"
        );
    }

    #[test]
    fn schedules_need_five_fields_or_a_nickname() {
        assert!(parse_schedule("@daily").is_ok());
        assert!(parse_schedule("*/5 * * * *").is_ok());
        let err = parse_schedule("0 0 * * * *").unwrap_err();
        assert!(err.contains("6 fields"), "{err}");
        assert!(parse_schedule("61 * * * *").is_err());
    }

    #[test]
    fn retention_removes_the_oldest_completed_backups_only() {
        let backups = [
            backup("b", BackupPhase::Completed, "2026-12-02T02:00:00Z"),
            backup("a", BackupPhase::Completed, "2026-12-02T01:00:00Z"),
            backup("failed", BackupPhase::Failed, "2026-12-02T00:00:00Z"),
            backup("c", BackupPhase::Completed, "2026-12-02T03:00:00Z"),
        ];
        assert_eq!(beyond_retention(&backups, 2), ["a"]);
        assert_eq!(beyond_retention(&backups, 1), ["a", "b"]);
        assert!(beyond_retention(&backups, 3).is_empty());
    }

    #[test]
    fn status_names_the_last_backup_and_the_first_recoverability_point() {
        let backups = [
            backup("b", BackupPhase::Completed, "2026-12-02T02:00:00Z"),
            backup("a", BackupPhase::Completed, "2026-12-02T01:00:00Z"),
            backup("running", BackupPhase::Running, "2026-12-02T05:00:00Z"),
        ];
        let archiver = Archiver {
            last_archived_wal: Some("000000010000000000000003".into()),
            last_archived_at: Some("2026-12-02T02:01:00Z".into()),
            ..Archiver::default()
        };
        let s = status(Some(&archiver), &backups, None);
        assert_eq!(s.last_base_backup.as_deref(), Some("b"));
        assert_eq!(
            s.first_recoverability_point.as_deref(),
            Some("2026-12-02T01:00:00Z")
        );
        let Wanted {
            status: ok,
            reason,
            message,
        } = archiving_condition(&s);
        assert!(ok);
        assert_eq!(reason, "WALArchived");
        assert!(message.contains("000000010000000000000003"), "{message}");
    }

    /// A standby archives nothing of its own: `ContinuousArchiving` says why, not that
    /// archiving fails.
    #[test]
    fn a_standby_says_why_it_archives_nothing() {
        let source = crate::cluster::standby::tests::source_store();
        let Wanted {
            status: ok,
            reason,
            message,
        } = standby_condition(&source);
        assert!(!ok);
        assert_eq!(reason, "Standby");
        assert!(
            message.contains("follows s3://dr/prod/orders") && message.contains("promoted"),
            "{message}"
        );
    }

    #[test]
    fn archiving_is_false_until_the_first_wal_and_when_the_last_attempt_failed() {
        let Wanted {
            status: ok, reason, ..
        } = archiving_condition(&ClusterBackupStatus::default());
        assert!(!ok);
        assert_eq!(reason, "NoWALArchivedYet");
        let failing = ClusterBackupStatus {
            last_archived_wal: Some("000000010000000000000003".into()),
            last_archived_time: Some("2026-12-02T02:01:00Z".into()),
            last_failed_wal: Some("000000010000000000000004".into()),
            last_failed_time: Some("2026-12-02T02:06:00Z".into()),
            ..ClusterBackupStatus::default()
        };
        let Wanted {
            status: ok,
            reason,
            message,
        } = archiving_condition(&failing);
        assert!(!ok);
        assert_eq!(reason, "ArchivingFailing");
        assert!(message.contains("000000010000000000000004"), "{message}");
        assert!(
            message.contains("the last success was 000000010000000000000003"),
            "{message}"
        );
    }
}
