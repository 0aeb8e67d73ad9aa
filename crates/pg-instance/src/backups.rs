//! Base backups on request: the primary's instance manager takes its cluster's
//! `PostgresBackup`s, one at a time, oldest first.
//!
//! Every few seconds while it runs read-write, the primary lists the `PostgresBackup`s of
//! its namespace. It claims a new one for its cluster by writing `phase: Running` and its
//! pod name into the status with the object's `resourceVersion` as a precondition (so two
//! managers never take the same backup), streams `pg_basebackup` into the object store
//! ([`crate::archive::base_backup`]) in a task that does not hold up fencing, then writes
//! `Completed` (timeline, begin LSN, location, size) or `Failed` with the reason, and applies
//! the retention policy. A backup left `Running` by a manager that restarted, or by a
//! former primary, is marked `Failed` with the reason.

use std::time::Duration;

use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::{Client, ResourceExt};
use steward_database_api::PostgresBackup;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::archive::{self, BaseBackup, Store};
use crate::contract::{BackupPhase, BackupRun};
use crate::postgres::Paths;

const CHECK_EVERY: Duration = Duration::from_secs(3);
const API_TIMEOUT: Duration = Duration::from_secs(5);

/// The backups of one cluster, as its instance manager runs them.
pub struct Runner {
    api: Api<PostgresBackup>,
    cluster: String,
    pod: String,
    /// `Err`: `spec.backup` is set but unusable (said on every backup requested).
    store: Option<Result<Store, String>>,
    keep: usize,
    paths: Paths,
    running: Option<(String, JoinHandle<Result<BaseBackup, archive::Error>>)>,
    checked: Option<Instant>,
}

impl Runner {
    pub fn new(
        client: Client,
        namespace: &str,
        cluster: &str,
        pod: &str,
        store: Option<Result<Store, String>>,
        keep: usize,
        paths: Paths,
    ) -> Self {
        Self {
            api: Api::namespaced(client, namespace),
            cluster: cluster.to_string(),
            pod: pod.to_string(),
            store,
            keep,
            paths,
            running: None,
            checked: None,
        }
    }

    /// Called every tick; `primary`: this instance runs read-write.
    ///
    /// # Errors
    /// When the API cannot be reached (retried at the next tick).
    pub async fn tick(&mut self, primary: bool) -> anyhow::Result<()> {
        if self
            .running
            .as_ref()
            .is_some_and(|(_, task)| task.is_finished())
            && let Some((name, task)) = self.running.take()
        {
            let result = task.await.unwrap_or_else(|e| {
                Err(archive::Error::Invalid(format!(
                    "the backup task failed: {e}"
                )))
            });
            self.finish(&name, result).await;
        }
        if !primary || self.checked.is_some_and(|t| t.elapsed() < CHECK_EVERY) {
            return Ok(());
        }
        self.checked = Some(Instant::now());
        let mut backups: Vec<PostgresBackup> =
            tokio::time::timeout(API_TIMEOUT, self.api.list(&ListParams::default()))
                .await??
                .items
                .into_iter()
                .filter(|b| b.spec.cluster == self.cluster)
                .collect();
        backups.sort_by(|a, b| {
            (a.creation_timestamp(), a.name_any()).cmp(&(b.creation_timestamp(), b.name_any()))
        });
        for backup in &backups {
            let name = backup.name_any();
            let status = backup.status.clone().unwrap_or_default();
            let mine = self.running.as_ref().is_some_and(|(n, _)| *n == name);
            match status.phase {
                Some(BackupPhase::Running) if !mine => {
                    let why = if status.instance.as_deref() == Some(self.pod.as_str()) {
                        "the instance manager restarted during the backup".to_string()
                    } else {
                        format!(
                            "{} stopped being the primary during the backup",
                            status.instance.as_deref().unwrap_or("the instance")
                        )
                    };
                    self.write(&name, failed(status, why), None).await?;
                }
                None if self.running.is_none() => self.start(backup, status).await?,
                _ => {}
            }
        }
        Ok(())
    }

    /// Claims `backup` (guarded by its resourceVersion) and starts it.
    async fn start(&mut self, backup: &PostgresBackup, status: BackupRun) -> anyhow::Result<()> {
        let name = backup.name_any();
        let store = match &self.store {
            Some(Ok(store)) => store.clone(),
            Some(Err(e)) => {
                let why = format!("the backup object store is misconfigured: {e}");
                return self.write(&name, failed(status, why), None).await;
            }
            None => {
                let why = format!(
                    "PostgresCluster {} has no spec.backup: there is nowhere to store a backup",
                    self.cluster
                );
                return self.write(&name, failed(status, why), None).await;
            }
        };
        let claim = BackupRun {
            phase: Some(BackupPhase::Running),
            instance: Some(self.pod.clone()),
            started_at: Some(jiff::Timestamp::now().to_string()),
            ..BackupRun::default()
        };
        match self
            .write(&name, claim, backup.resource_version().as_deref())
            .await
        {
            Ok(()) => {}
            Err(e) if is_conflict(&e) => return Ok(()), // claimed or changed: next check
            Err(e) => return Err(e),
        }
        tracing::info!(backup = %name, to = %store.config().url(), "taking a base backup");
        let paths = self.paths.clone();
        let keep = self.keep;
        let task_name = name.clone();
        let task = tokio::spawn(async move {
            let backup = archive::base_backup(&store, &paths, &task_name).await?;
            match archive::apply_retention(&store, keep).await {
                Ok((backups, wal)) if !backups.is_empty() => tracing::info!(
                    ?backups,
                    wal,
                    "retention: deleted base backups beyond {keep} and the WAL only they needed"
                ),
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "applying the retention policy failed"),
            }
            Ok(backup)
        });
        self.running = Some((name, task));
        Ok(())
    }

    async fn finish(&self, name: &str, result: Result<BaseBackup, archive::Error>) {
        let location = self
            .store
            .as_ref()
            .and_then(|s| s.as_ref().ok())
            .map(|s| format!("{}/base/{name}/", s.config().url().trim_end_matches('/')));
        let status = match result {
            Ok(b) => {
                tracing::info!(backup = %name, size = b.size, lsn = %b.begin_lsn, "base backup completed");
                BackupRun {
                    phase: Some(BackupPhase::Completed),
                    instance: Some(self.pod.clone()),
                    started_at: Some(b.started_at),
                    completed_at: Some(b.completed_at),
                    timeline: Some(b.timeline),
                    begin_lsn: Some(b.begin_lsn.to_string()),
                    location,
                    size: Some(b.size),
                    message: None,
                }
            }
            Err(e) => {
                tracing::warn!(backup = %name, error = %e, "base backup failed");
                BackupRun {
                    instance: Some(self.pod.clone()),
                    ..failed(BackupRun::default(), e.to_string())
                }
            }
        };
        // The status is retried at the next check if this write fails: a backup left
        // Running by this pod with no task is marked failed, so say so in the log.
        if let Err(e) = self.write(name, status, None).await {
            tracing::warn!(backup = %name, error = %e, "recording the backup's result failed");
        }
    }

    /// Writes `status` (a merge patch), with `resource_version` as a precondition if given.
    async fn write(
        &self,
        name: &str,
        status: BackupRun,
        resource_version: Option<&str>,
    ) -> anyhow::Result<()> {
        let mut patch = serde_json::json!({ "status": status });
        if let Some(rv) = resource_version {
            patch["metadata"] = serde_json::json!({ "resourceVersion": rv });
        }
        tokio::time::timeout(
            API_TIMEOUT,
            self.api
                .patch_status(name, &PatchParams::default(), &Patch::Merge(&patch)),
        )
        .await??;
        Ok(())
    }
}

/// `status` as failed for `why` (what it had recorded kept).
fn failed(status: BackupRun, why: String) -> BackupRun {
    BackupRun {
        phase: Some(BackupPhase::Failed),
        completed_at: Some(jiff::Timestamp::now().to_string()),
        message: Some(why),
        ..status
    }
}

fn is_conflict(e: &anyhow::Error) -> bool {
    matches!(e.downcast_ref::<kube::Error>(), Some(kube::Error::Api(s)) if s.code == 409)
}
