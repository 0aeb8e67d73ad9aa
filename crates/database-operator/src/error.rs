//! The reconcile errors of the three controllers, each variant named after the step that
//! failed.

use crate::pg::PgError;
use crate::sql::PlanError;

/// Why a reconcile (or a cleanup) did not finish.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The spec is invalid; nothing is retried until it changes.
    #[error("invalid spec: {0}")]
    InvalidSpec(String),

    /// A server parameter cannot be written to `postgresql.conf`; no instance is restarted
    /// with it, nothing is retried until the spec changes.
    #[error("invalid parameters: {0}")]
    InvalidParameters(String),

    /// A database or role on the server belongs to another resource, to nobody the operator
    /// knows (without `adopt`), or is privileged: it is left untouched.
    #[error(transparent)]
    Ownership(#[from] crate::ownership::Conflict),

    /// A Secret the operator would write exists and is not its own.
    #[error("{0}")]
    SecretConflict(String),

    /// Reading an object from the API server failed.
    #[error("failed to read {what}")]
    Read {
        what: String,
        #[source]
        source: kube::Error,
    },

    /// An object this one refers to does not exist (yet).
    #[error("{0}")]
    MissingReference(String),

    /// The PostgresCluster a Database is on is a standby that follows its source
    /// (`spec.replica.enabled`): its primary accepts no writes, and its databases and roles
    /// are its source's. Retried; converges once the cluster is promoted.
    #[error(
        "PostgresCluster {cluster} is a standby of {store} (spec.replica.enabled): it accepts no writes, its databases and roles are its source's; this converges once it is promoted"
    )]
    Standby { cluster: String, store: String },

    /// Applying a child, pruning, or writing status failed.
    #[error(transparent)]
    Apply(#[from] steward_core::Error),

    /// Adding or removing the in-use finalizer of an admin Secret failed.
    #[error("failed to update the in-use finalizer of Secret {name}")]
    ProtectSecret {
        name: String,
        #[source]
        source: kube::Error,
    },

    /// Labelling a pod with its role failed.
    #[error("failed to label pod {pod}")]
    LabelPod {
        pod: String,
        #[source]
        source: kube::Error,
    },

    /// Generating the cluster's CA or server certificate failed.
    #[error("TLS: {0}")]
    Certificate(String),

    /// Listing, creating or deleting the cluster's PostgresBackups (schedule, retention)
    /// failed.
    #[error("failed to {what}")]
    Backups {
        what: String,
        #[source]
        source: kube::Error,
    },

    /// Deleting a pod for the rolling update failed.
    #[error("failed to replace pod {pod}")]
    ReplacePod {
        pod: String,
        #[source]
        source: kube::Error,
    },

    /// Deleting the claim or the pod of an instance whose volume is gone failed.
    #[error("failed to replace instance {pod} (its volume is gone)")]
    ReplaceInstance {
        pod: String,
        #[source]
        source: kube::Error,
    },

    /// Naming the switchover target on the cluster's Lease (or clearing the request) failed.
    #[error("failed to request the switchover to {to}")]
    Switchover {
        to: String,
        #[source]
        source: kube::Error,
    },

    /// A step of a major-version upgrade (its backup, Job or the Lease hand-over) failed.
    #[error("major upgrade: failed to {what}")]
    MajorUpgrade {
        what: String,
        #[source]
        source: kube::Error,
    },

    /// Starting or clearing away PostgreSQL's check of new parameters failed.
    #[error("parameters check: failed to {what}")]
    CheckParameters {
        what: String,
        #[source]
        source: kube::Error,
    },

    /// The PostgreSQL server could not be reached or logged into.
    #[error("PostgreSQL server {address} is unreachable")]
    ServerUnreachable {
        address: String,
        #[source]
        source: PgError,
    },

    /// A statement or query failed on a reachable server.
    #[error("failed to {step}")]
    Sql {
        step: String,
        #[source]
        source: PgError,
    },

    /// The desired state is unsafe to converge (e.g. taking over a superuser).
    #[error("refusing to converge")]
    Unsafe(#[from] PlanError),

    /// Deletion waits for DatabaseRoles that still refer to the Database.
    #[error("waiting for DatabaseRoles that refer to this Database to be deleted first: {0}")]
    WaitingForRoles(String),

    /// Deletion waits for the other deleting Databases that share this one's admin Secret:
    /// the last of them (by name) releases the Secret's in-use finalizer once they are gone.
    #[error(
        "waiting for the other Databases being deleted that share admin Secret {secret} to finish first (this one releases it last): {databases}"
    )]
    WaitingForDatabases { secret: String, databases: String },

    /// Deletion waits for the pre-delete dump.
    #[error("waiting for the pre-delete dump (Job {job}) to succeed before dropping the database")]
    WaitingForBackup { job: String },

    /// A Delete-policy cleanup failed; the finalizer stays and the cleanup is retried.
    #[error(
        "cannot finish deleting yet; retrying (to remove the object without dropping anything, set spec.deletionPolicy to Retain)"
    )]
    CleanupBlocked(#[source] Box<Error>),

    /// The object this reconcile started from is gone from the API server, or being deleted,
    /// though the cache still showed it: nothing is created or changed for it, and the
    /// reconcile ends without a status write (there is nothing to write it to).
    #[error("the object is gone or being deleted on the API server; nothing was changed for it")]
    Gone,

    /// The pre-delete dump failed; the database is not dropped.
    #[error(
        "the pre-delete dump (Job {job}) failed, so the database was not dropped; see the Job's pods, fix the cause and delete the Job to retry"
    )]
    BackupFailed { job: String },
}

impl steward_core::ReconcileError for Error {
    fn reason(&self) -> &str {
        match self {
            Error::InvalidSpec(_) => "InvalidSpec",
            Error::InvalidParameters(_) => "InvalidParameters",
            Error::SecretConflict(_) => "SecretConflict",
            Error::Ownership(c) => match c {
                crate::ownership::Conflict::OwnedByAnother { .. } => "OwnedByAnother",
                crate::ownership::Conflict::NotOwned { .. } => "NotOwned",
                crate::ownership::Conflict::Privileged { .. } => "PrivilegedRole",
            },
            Error::Read { .. } => "ReadFailed",
            Error::MissingReference(_) => "MissingReference",
            Error::Standby { .. } => "ClusterIsStandby",
            Error::Apply(_) => "ApplyFailed",
            Error::LabelPod { .. } => "LabelPodFailed",
            Error::ReplacePod { .. } => "ReplacePodFailed",
            Error::ReplaceInstance { .. } => "ReplaceInstanceFailed",
            Error::Backups { .. } => "BackupsFailed",
            Error::Certificate(_) => "CertificateFailed",
            Error::Switchover { .. } => "SwitchoverFailed",
            Error::MajorUpgrade { .. } => "MajorUpgradeFailed",
            Error::CheckParameters { .. } => "CheckParametersFailed",
            Error::ProtectSecret { .. } => "ProtectSecretFailed",
            Error::ServerUnreachable { .. } => "ServerUnreachable",
            Error::Sql { .. } => "SqlFailed",
            Error::Unsafe(_) => "Unsafe",
            Error::WaitingForRoles(_) => "WaitingForRoles",
            Error::WaitingForBackup { .. } => "WaitingForBackup",
            Error::WaitingForDatabases { .. } => "WaitingForDatabases",
            Error::BackupFailed { .. } => "BackupFailed",
            Error::CleanupBlocked(inner) => inner.reason(),
            Error::Gone => "Gone",
        }
    }

    /// An unreachable server (restarted, failed over) is retried at least every 10 s, so it is
    /// reconnected within seconds of coming back rather than after a grown backoff.
    /// A Database waiting for the others that share its admin Secret has no watch that wakes
    /// it when they are gone, so it looks again every 2 s. One on a standby cluster looks
    /// again at least every minute (its cluster's promotion also wakes a Database).
    fn max_backoff(&self) -> Option<std::time::Duration> {
        match self {
            Error::ServerUnreachable { .. } => Some(std::time::Duration::from_secs(10)),
            Error::Standby { .. } => Some(std::time::Duration::from_secs(60)),
            Error::WaitingForDatabases { .. } => Some(std::time::Duration::from_secs(2)),
            _ => None,
        }
    }

    fn is_permanent(&self) -> bool {
        matches!(
            self,
            Error::InvalidSpec(_) | Error::InvalidParameters(_) | Error::Unsafe(_)
        )
    }
}

impl Error {
    /// Wraps a cleanup failure with the way out (waiting states stay as they are).
    pub fn blocking_cleanup(self) -> Self {
        match self {
            e @ (Error::WaitingForRoles(_)
            | Error::WaitingForBackup { .. }
            | Error::WaitingForDatabases { .. }
            | Error::CleanupBlocked(_)) => e,
            e => Error::CleanupBlocked(Box::new(e)),
        }
    }

    /// A SQL error at `step`, sorted into unreachable vs. refused.
    pub fn sql(step: impl Into<String>, address: &str, source: PgError) -> Self {
        if source.is_connect() {
            Error::ServerUnreachable {
                address: address.to_string(),
                source,
            }
        } else {
            Error::Sql {
                step: step.into(),
                source,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use steward_core::ReconcileError;

    use super::*;

    #[test]
    fn an_unreachable_server_is_retried_at_least_every_ten_seconds() {
        let unreachable = Error::ServerUnreachable {
            address: "db:5432".into(),
            source: PgError::Tls {
                address: "db:5432".into(),
                message: "no route".into(),
            },
        };
        assert_eq!(unreachable.max_backoff(), Some(Duration::from_secs(10)));
        assert!(!unreachable.is_permanent());
        assert_eq!(Error::InvalidSpec("x".into()).max_backoff(), None);
    }

    /// A Database on a standby cluster waits (not failed for good) and says for what.
    #[test]
    fn a_database_on_a_standby_waits_for_its_promotion() {
        let standby = Error::Standby {
            cluster: "pg".into(),
            store: "s3://dr/prod/orders".into(),
        };
        assert_eq!(standby.reason(), "ClusterIsStandby");
        assert!(!standby.is_permanent());
        assert_eq!(standby.max_backoff(), Some(Duration::from_secs(60)));
        let message = standby.to_string();
        assert!(
            message.starts_with("PostgresCluster pg is a standby of s3://dr/prod/orders")
                && message.ends_with("this converges once it is promoted"),
            "{message}"
        );
    }
}
