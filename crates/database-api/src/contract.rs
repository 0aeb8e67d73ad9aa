//! What the instance manager and the database-operator agree on: names, labels, the Lease
//! and the status each instance publishes on its pod. They talk only through the
//! Kubernetes API.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Label on every pod of a cluster: the cluster's name.
pub const CLUSTER_LABEL: &str = "database.steward.dev/cluster";
/// Label on each pod: [`PRIMARY`] or [`REPLICA`]. The `-rw` Service selects the primary by
/// it; the instance that wins the Lease moves it as part of its promotion.
pub const ROLE_LABEL: &str = "database.steward.dev/role";
pub const PRIMARY: &str = "primary";
pub const REPLICA: &str = "replica";
/// Annotation on each pod: its instance's [`InstanceStatus`] as JSON, written by its
/// instance manager when its role, timeline or position changed.
pub const STATUS_ANNOTATION: &str = "database.steward.dev/instance";
/// Annotation on the Lease: the instance the primary should hand over to (a planned
/// switchover, set by the operator for a rolling update or on request). The primary shuts
/// down cleanly and releases the Lease; only that instance may take it; it clears the
/// annotation once it leads.
pub const TARGET_ANNOTATION: &str = "database.steward.dev/target-primary";
/// Annotation on the Lease: a switchover the primary refused, as `<target>: <reason>` (the
/// target did not confirm the primary's last WAL; the primary runs on). Written by the
/// primary as it clears [`TARGET_ANNOTATION`]; the operator reports it and removes it when
/// it asks for another switchover or the request is withdrawn.
pub const SWITCHOVER_REFUSED_ANNOTATION: &str = "database.steward.dev/switchover-refused";
/// Annotation on the Lease: the instance that last released it on a clean stop (written just
/// before it released), so a cluster stopped as a whole starts again on the instance that
/// has every write.
pub const LAST_PRIMARY_ANNOTATION: &str = "database.steward.dev/last-primary";
/// Annotation on the Lease beside [`LAST_PRIMARY_ANNOTATION`]: where that primary's WAL ends
/// ([`WalEnd`], just after its shutdown checkpoint). A replica on that timeline that has
/// received WAL up to there has every write and need not wait for the last primary to come
/// back (a drained node, a pod that stays Pending, a lost volume).
pub const LAST_PRIMARY_WAL_ANNOTATION: &str = "database.steward.dev/last-primary-wal";
/// The role streaming replicas (and `pg_rewind`) connect as; never the superuser.
pub const REPLICATION_USER: &str = "steward_replication";
/// The instance manager's binary, in the operator's image and copied into each pod.
pub const BINARY: &str = "steward-pg-instance";
/// Port of the instance manager's `/healthz`, `/readyz` and `/status`.
pub const HTTP_PORT: u16 = 8008;
/// PostgreSQL's port.
pub const PG_PORT: u16 = 5432;
/// Connection slots kept for roles granted `pg_use_reserved_connections` (PostgreSQL 16 and
/// later): the replication role, as which `pg_rewind` and a switchover's confirmation connect
/// through ordinary (not replication) connections. The instance manager's own queries go
/// over the socket as the superuser, which `superuser_reserved_connections` (3) covers;
/// streaming and cloning use WAL senders, which have slots of their own. The instance manager
/// sets it; the operator counts it when it checks `max_connections`.
pub const RESERVED_CONNECTIONS: u32 = 3;

/// Environment of the PostgreSQL container naming the cluster's backup object store
/// (`spec.backup`): `STEWARD_BACKUP_<field>` for each of [`STORE_FIELDS`].
pub const BACKUP_ENV: &str = "STEWARD_BACKUP";
/// The object store a new cluster is restored from (`spec.bootstrap.recovery`):
/// `STEWARD_RECOVERY_<field>`.
pub const RECOVERY_ENV: &str = "STEWARD_RECOVERY";
/// The object store a standby cluster follows (`spec.replica.source`):
/// `STEWARD_REPLICA_SOURCE_<field>`. Set, the instance manager reads `spec.replica.enabled`
/// from its PostgresCluster each tick: the leader follows the source's archive while it is
/// true, and fences the source's store before it promotes when it turns false.
pub const REPLICA_SOURCE_ENV: &str = "STEWARD_REPLICA_SOURCE";
/// The object, under a cluster's backup path, that fences it: a cluster promoted from its
/// archive wrote it ([`Fence`]). A primary of that path on a timeline at or below the fence's
/// never runs read-write again.
pub const FENCE_OBJECT: &str = "fence.json";
/// The object, under a cluster's backup path, that a standby following it writes when it
/// starts following (`{"by": "<namespace>/<name>", "at": …}`): the source then knows it may be
/// fenced, and refuses to start read-write while it cannot read its fence.
pub const FOLLOWED_OBJECT: &str = "followed.json";
/// On a promoted standby cluster's Lease: the source store (`s3://bucket/path`) its
/// promotion fenced. Its later failovers do not fence (or read) the source again.
pub const SOURCE_FENCED_ANNOTATION: &str = "database.steward.dev/source-fenced";
/// On a demoted cluster's Lease: where its WAL ended when it stopped as the primary
/// ([`WalEnd`]), its demotion token; removed when it runs read-write again.
pub const DEMOTION_TOKEN_ANNOTATION: &str = "database.steward.dev/demotion-token";
/// The fields of an object store's environment: endpoint URL, bucket, path (the prefix
/// every object of the cluster's backups is under), region and the credentials.
pub const STORE_FIELDS: [&str; 6] = [
    "ENDPOINT",
    "BUCKET",
    "PATH",
    "REGION",
    "ACCESS_KEY_ID",
    "SECRET_ACCESS_KEY",
];
/// How many base backups to keep (`spec.backup.retention.keep`): older ones, and the WAL
/// only they needed, are deleted after each new base backup.
pub const BACKUP_KEEP_ENV: &str = "STEWARD_BACKUP_KEEP";
/// Recover up to this time (RFC 3339), not to the end of the archive.
pub const RECOVERY_TARGET_TIME_ENV: &str = "STEWARD_RECOVERY_TARGET_TIME";
/// The `postgresql.conf` a parameters check Job (`check-config`) has PostgreSQL read.
pub const CHECK_CONFIG_ENV: &str = "STEWARD_CHECK_CONFIG";
/// The most a checked `postgresql.conf` may hold: it travels in [`CHECK_CONFIG_ENV`], and
/// Linux takes at most 128 KiB in one environment variable.
pub const CHECK_CONFIG_MAX_BYTES: usize = 64 * 1024;

/// `<prefix>_<field>`.
pub fn store_env(prefix: &str, field: &str) -> String {
    format!("{prefix}_{field}")
}

/// The API group and plural of [`PostgresBackup`](crate::PostgresBackup) (a base backup, run
/// by the cluster's primary instance manager, which claims it by writing its status), for the
/// instances' RBAC rules.
pub const BACKUP_GROUP: &str = crate::GROUP;
pub const BACKUP_PLURAL: &str = "postgresbackups";
/// The plural of [`PostgresCluster`](crate::PostgresCluster) (group [`crate::GROUP`]): each
/// cluster's instance managers may `get` their own (a standby's leader reads
/// `spec.replica.enabled`).
pub const CLUSTER_PLURAL: &str = "postgresclusters";

/// Where a base backup is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub enum BackupPhase {
    /// A primary instance manager claimed it and runs `pg_basebackup`.
    Running,
    /// In the object store, with everything needed to restore it.
    Completed,
    /// Not taken; `message` says why.
    Failed,
}

/// A `PostgresBackup`'s status, written by the instance manager that takes it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BackupRun {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<BackupPhase>,
    /// The pod (the primary) that took it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completed_at: Option<String>,
    /// Timeline and WAL position where the backup begins.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeline: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub begin_lsn: Option<String>,
    /// Where it is in the object store (`s3://bucket/path/base/<name>/`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub location: Option<String>,
    /// Compressed size in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// The Lease whose holder is the cluster's primary: only its holder may accept writes.
pub fn lease_name(cluster: &str) -> String {
    format!("{cluster}-primary")
}

/// What a promoted standby cluster writes into its source's object store ([`FENCE_OBJECT`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Fence {
    /// The promoted cluster, `<namespace>/<name>` (of its own Kubernetes cluster).
    pub promoted: String,
    /// The last timeline of the source that it replayed: a primary of the source on this
    /// timeline or an earlier one is fenced.
    pub timeline: u32,
    /// Where its replay ended: what of the source it has (the data-loss bound is the source's
    /// writes after this).
    pub lsn: Lsn,
    /// When (RFC 3339).
    pub at: String,
}

/// A standby cluster's leader: how far it has followed its source.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Following {
    /// The source's object store (`s3://bucket/path`).
    pub source: String,
    /// What it has replayed.
    pub replayed: Lsn,
    /// The commit time of the last transaction replayed (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replayed_at: Option<String>,
    /// The newest WAL segment the source archived, as last listed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_wal: Option<String>,
    /// Bytes of WAL the source archived beyond what was replayed (by the end of
    /// `source_wal`: at most a segment more than the truth; the source's unarchived WAL is
    /// not counted).
    #[serde(default)]
    pub lag_bytes: u64,
    /// Why the source's store could not be listed, if it could not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_error: Option<String>,
    /// This cluster was a primary and was demoted (`spec.replica.enabled` on a running
    /// cluster): where its WAL ends ([`WalEnd`], `<timeline>:<LSN>`), the token the new
    /// primary's `spec.replica.promotionToken` waits for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub demotion_token: Option<String>,
}

/// What an instance is doing, as it reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Role {
    /// Accepting writes (holds the Lease).
    Primary,
    /// Streaming (or trying to stream) from the primary.
    Replica,
    /// Not running PostgreSQL: initializing, cloning, rewinding, fenced or stopped.
    Down,
}

/// One instance's status, published on its pod ([`STATUS_ANNOTATION`]) for the other
/// instances (which one is most advanced) and the operator (the cluster's status).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct InstanceStatus {
    pub role: Role,
    /// The timeline PostgreSQL runs on (0: unknown).
    pub timeline: u32,
    /// The primary's current write position, or what a replica has received (the larger of
    /// received and replayed).
    pub lsn: Lsn,
    /// Bytes a replica has received but not yet replayed.
    #[serde(default)]
    pub replay_lag: u64,
    /// The primary's WAL archiving (`pg_stat_archiver`), when archiving is on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub archiver: Option<Archiver>,
    /// On the primary: commits that have waited longer than [`COMMIT_WAIT`] for synchronous
    /// standbys to confirm them (`pg_stat_activity`, wait event `SyncRep`): they return
    /// once enough replicas stream again.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub commits_waiting: u32,
    /// Why the instance manager's last step failed, while it keeps failing (a restore with
    /// no base backup of this major, a clone the primary refuses…): what keeps the instance
    /// from running, for the cluster's status. Cleared by the next step that succeeds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub problem: Option<String>,
    /// The leader of a standby cluster (`spec.replica`): it runs as a replica of the source's
    /// archive, and this says how far it is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub following: Option<Following>,
}

/// How long a commit may wait for synchronous standbys before it counts as waiting (each
/// commit waits for their confirmation a moment; only a standby that is missing makes it
/// wait this long).
pub const COMMIT_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// `pg_stat_archiver`: the last WAL file archived and the last that failed, with when (RFC
/// 3339).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Archiver {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_archived_wal: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_archived_at: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_failed_wal: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_failed_at: Option<String>,
}

impl Archiver {
    /// Whether the last attempt failed (a failure after the last success).
    pub fn failing(&self) -> bool {
        match (&self.last_failed_at, &self.last_archived_at) {
            (None, _) => false,
            (Some(_), None) => true,
            (Some(failed), Some(archived)) => {
                match (
                    failed.parse::<jiff::Timestamp>(),
                    archived.parse::<jiff::Timestamp>(),
                ) {
                    (Ok(f), Ok(a)) => f > a,
                    _ => failed > archived,
                }
            }
        }
    }
}

/// A WAL position, written as PostgreSQL writes it (`16/B374D848`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Lsn(pub u64);

impl fmt::Display for Lsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:X}/{:X}", self.0 >> 32, self.0 & 0xFFFF_FFFF)
    }
}

/// A string that is not `HEX/HEX`.
#[derive(Debug, thiserror::Error)]
#[error("not an LSN: {0:?}")]
pub struct BadLsn(String);

impl FromStr for Lsn {
    type Err = BadLsn;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || BadLsn(s.to_string());
        let (hi, lo) = s.split_once('/').ok_or_else(bad)?;
        let hi = u32::from_str_radix(hi, 16).map_err(|_| bad())?;
        let lo = u32::from_str_radix(lo, 16).map_err(|_| bad())?;
        Ok(Lsn((u64::from(hi) << 32) | u64::from(lo)))
    }
}

impl Serialize for Lsn {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Lsn {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// Where a cleanly stopped primary's WAL ends: its timeline and the position just after its
/// shutdown checkpoint, written `<timeline>:<LSN>` (`2:0/3000108`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WalEnd {
    pub timeline: u32,
    pub lsn: Lsn,
}

impl WalEnd {
    /// Whether an instance reporting `status` has all of this WAL: on the same timeline, at
    /// least as far.
    pub fn reached_by(&self, status: &InstanceStatus) -> bool {
        status.timeline == self.timeline && status.lsn >= self.lsn
    }
}

impl fmt::Display for WalEnd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.timeline, self.lsn)
    }
}

impl FromStr for WalEnd {
    type Err = BadLsn;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || BadLsn(s.to_string());
        let (timeline, lsn) = s.split_once(':').ok_or_else(bad)?;
        Ok(WalEnd {
            timeline: timeline.parse().map_err(|_| bad())?,
            lsn: lsn.parse().map_err(|_| bad())?,
        })
    }
}

/// Whether `pod`'s `Ready` condition is true (the kubelet's probes pass).
pub fn pod_ready(pod: &k8s_openapi::api::core::v1::Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// The ordinal of a StatefulSet pod (`pg-2` → 2).
pub fn ordinal(pod: &str) -> Option<u32> {
    pod.rsplit_once('-')?.1.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lsn_round_trips_as_postgresql_writes_it() {
        let lsn: Lsn = "16/B374D848".parse().unwrap();
        assert_eq!(lsn.0, 0x16_B374_D848);
        assert_eq!(lsn.to_string(), "16/B374D848");
        assert_eq!("0/0".parse::<Lsn>().unwrap(), Lsn(0));
        assert!("0/3000060".parse::<Lsn>().unwrap() > "0/30000".parse().unwrap());
        assert!("16".parse::<Lsn>().is_err());
        assert!("x/1".parse::<Lsn>().is_err());
    }

    #[test]
    fn status_is_camel_case_json_with_the_lsn_as_text() {
        let status = InstanceStatus {
            role: Role::Replica,
            timeline: 2,
            lsn: Lsn(0x3000060),
            replay_lag: 0,
            archiver: None,
            commits_waiting: 0,
            problem: None,
            following: None,
        };
        let json = serde_json::to_string(&status).unwrap();
        assert_eq!(
            json,
            r#"{"role":"replica","timeline":2,"lsn":"0/3000060","replayLag":0}"#
        );
        assert_eq!(
            serde_json::from_str::<InstanceStatus>(&json).unwrap(),
            status
        );
    }

    #[test]
    fn commits_waiting_are_published_only_when_there_are_some() {
        let status = InstanceStatus {
            role: Role::Primary,
            timeline: 1,
            lsn: Lsn(1),
            replay_lag: 0,
            archiver: None,
            commits_waiting: 4,
            problem: None,
            following: None,
        };
        let json = serde_json::to_string(&status).unwrap();
        assert!(json.ends_with(r#","commitsWaiting":4}"#), "{json}");
        assert_eq!(
            serde_json::from_str::<InstanceStatus>(&json).unwrap(),
            status
        );
    }

    #[test]
    fn archiving_fails_when_the_last_failure_is_newer_than_the_last_success() {
        let at = |archived: Option<&str>, failed: Option<&str>| Archiver {
            last_archived_at: archived.map(String::from),
            last_failed_at: failed.map(String::from),
            ..Archiver::default()
        };
        assert!(!at(None, None).failing());
        assert!(!at(Some("2026-12-02T03:00:00Z"), None).failing());
        assert!(at(None, Some("2026-12-02T03:00:00Z")).failing());
        assert!(at(Some("2026-12-02T03:00:00Z"), Some("2026-12-02T03:00:01Z")).failing());
        assert!(
            !at(
                Some("2026-12-02T03:00:02+00:00"),
                Some("2026-12-02T03:00:01Z")
            )
            .failing()
        );
    }

    #[test]
    fn a_wal_end_round_trips_and_is_reached_on_its_timeline_only() {
        let end: WalEnd = "2:0/3000108".parse().unwrap();
        assert_eq!(
            end,
            WalEnd {
                timeline: 2,
                lsn: Lsn(0x300_0108)
            }
        );
        assert_eq!(end.to_string(), "2:0/3000108");
        assert!("0/3000108".parse::<WalEnd>().is_err());
        assert!("x:0/1".parse::<WalEnd>().is_err());
        let at = |timeline, lsn| InstanceStatus {
            role: Role::Replica,
            timeline,
            lsn: Lsn(lsn),
            replay_lag: 0,
            archiver: None,
            commits_waiting: 0,
            problem: None,
            following: None,
        };
        assert!(end.reached_by(&at(2, 0x300_0108)));
        assert!(end.reached_by(&at(2, 0x400_0000)));
        assert!(!end.reached_by(&at(2, 0x300_0107)), "one byte short");
        assert!(!end.reached_by(&at(3, 0x400_0000)), "another timeline");
        assert!(!end.reached_by(&at(1, 0x400_0000)), "another timeline");
    }

    #[test]
    fn the_backup_api_names_are_the_crds() {
        use kube::Resource;
        assert_eq!(crate::PostgresBackup::group(&()), BACKUP_GROUP);
        assert_eq!(crate::PostgresBackup::plural(&()), BACKUP_PLURAL);
        assert_eq!(crate::PostgresCluster::group(&()), crate::GROUP);
        assert_eq!(crate::PostgresCluster::plural(&()), CLUSTER_PLURAL);
    }

    #[test]
    fn ordinals_and_lease_names() {
        assert_eq!(ordinal("pg-2"), Some(2));
        assert_eq!(ordinal("my-db-10"), Some(10));
        assert_eq!(ordinal("pg"), None);
        assert_eq!(lease_name("pg"), "pg-primary");
    }
}

/// The connection pooler (`spec.pooler`): what the pooler agents (`steward-pooler`, PID 1 of
/// each PgBouncer pod), the instance managers and the operator agree on. A planned
/// switchover pauses the poolers before the primary stops: the primary names the pause on
/// the Lease ([`PAUSE_ANNOTATION`]), each agent `PAUSE`s its PgBouncer (in-flight
/// transactions finish, new ones wait) and acknowledges it in the state ConfigMap
/// ([`state_config_map`]); the primary stops only once every pooler acknowledged, within
/// [`PAUSE_WAIT`], and otherwise refuses the switchover and lifts the pause. The new primary
/// lifts it once it leads (as it clears [`TARGET_ANNOTATION`]); each agent then points its
/// PgBouncer at the new primary's pod and `RESUME`s.
pub mod pooler {
    use std::time::Duration;

    /// Label on every pooler pod: the cluster's name (not [`super::CLUSTER_LABEL`]: a pooler
    /// pod is no instance).
    pub const LABEL: &str = "database.steward.dev/pooler";
    /// Annotation on the Lease, written by a primary about to hand over: the pause it asks
    /// for, as `<target>/<unix milliseconds>` (each switchover its own).
    pub const PAUSE_ANNOTATION: &str = "database.steward.dev/pooler-pause";
    /// The ConfigMap where each agent acknowledges a pause: key its pod's name, value the
    /// pause ([`PAUSE_ANNOTATION`]'s value) its PgBouncer finished. Created (empty) by the
    /// operator; each agent writes only its own key (server-side apply, field manager
    /// `steward-pooler/<pod>`).
    pub fn state_config_map(cluster: &str) -> String {
        format!("{cluster}-pooler-state")
    }
    /// How long a primary waits for every pooler to acknowledge a pause before it refuses
    /// the switchover (a transaction that does not end, an agent that does not answer).
    pub const PAUSE_WAIT: Duration = Duration::from_secs(10);
    /// How long an agent's `PAUSE` may take before it is undone and not acknowledged:
    /// shorter than [`PAUSE_WAIT`], so that a pause that completes is acknowledged while the
    /// primary still waits (the agent sees the pause through its Lease watch, and the primary
    /// reads the acknowledgement by polling: the difference covers both). A longer bound
    /// would let an agent acknowledge, and hold its clients, after the primary gave up.
    pub const AGENT_PAUSE_WAIT: Duration = Duration::from_secs(8);
    const _: () = assert!(AGENT_PAUSE_WAIT.as_millis() < PAUSE_WAIT.as_millis());
    /// How long an agent keeps its PgBouncer paused at most, whatever the Lease says: beyond
    /// the longest a switchover takes ([`PAUSE_WAIT`], the clean shutdown, the target's
    /// confirmation and its promotion), a pause nobody lifts (a primary killed mid-way) ends.
    pub const MAX_PAUSE: Duration = Duration::from_secs(60);
    /// The role PgBouncer's `auth_query` connects as: it may run [`LOOKUP_FUNCTION`] and
    /// nothing else. Its password is in the Secret `<cluster>-pooler`.
    pub const AUTH_USER: &str = "steward_pooler";
    /// `SECURITY DEFINER` function in the `postgres` database returning a login role's name
    /// and password verifier, refusing superusers, replication roles and Steward's own.
    pub const LOOKUP_FUNCTION: &str = "steward_pooler.lookup";
    /// The version of [`lookup_sql`]'s function, its comment: a newer operator replaces an
    /// older one.
    pub const LOOKUP_VERSION: &str = "steward-pooler lookup v1";

    /// The statements that (re)create [`LOOKUP_FUNCTION`] in the `postgres` database, for
    /// [`AUTH_USER`] (which must exist): a login role's name and password verifier, never a
    /// superuser's, a replication role's, one of Steward's own (`steward_*`) or one past its
    /// `VALID UNTIL`. Run by the operator as the superuser; the tests of the pooler agent run
    /// the same.
    pub fn lookup_sql() -> Vec<String> {
        let (function, user) = (LOOKUP_FUNCTION, AUTH_USER);
        vec![
            "CREATE SCHEMA IF NOT EXISTS steward_pooler".to_string(),
            "REVOKE ALL ON SCHEMA steward_pooler FROM PUBLIC".to_string(),
            format!("GRANT USAGE ON SCHEMA steward_pooler TO {user}"),
            // A set: a refused name is no row ("no such user" to the client), where a record
            // would be a row of NULLs, on which PgBouncer drops its auth connection.
            format!("DROP FUNCTION IF EXISTS {function}(text)"),
            format!(
                "CREATE FUNCTION {function}(i_username text) \
                 RETURNS TABLE (usename name, passwd text) LANGUAGE sql STABLE SECURITY DEFINER \
                 SET search_path = pg_catalog AS $lookup$ \
                 SELECT rolname, rolpassword FROM pg_catalog.pg_authid \
                 WHERE rolname = i_username AND rolcanlogin AND NOT rolsuper AND NOT rolreplication \
                 AND rolname !~ '^steward_' AND (rolvaliduntil IS NULL OR rolvaliduntil > now()) $lookup$"
            ),
            format!("REVOKE ALL ON FUNCTION {function}(text) FROM PUBLIC"),
            format!("GRANT EXECUTE ON FUNCTION {function}(text) TO {user}"),
            format!("COMMENT ON FUNCTION {function}(text) IS '{LOOKUP_VERSION}'"),
        ]
    }

    /// The agent's binary, in the operator's image and copied into each pooler pod.
    pub const BINARY: &str = "steward-pooler";
    /// PgBouncer's port (clients).
    pub const PORT: u16 = 5432;
    /// The agent's `/healthz`, `/readyz` and `/metrics`.
    pub const HTTP_PORT: u16 = 8009;
}
