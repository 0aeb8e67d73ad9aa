//! The API of `database.steward.dev/v1alpha1`: the custom resources [`PostgresCluster`],
//! [`PostgresBackup`], [`Database`] and [`DatabaseRole`], the annotations users set on them,
//! and the [`contract`] between the database-operator and the instance manager
//! (`steward-pg-instance`) in each PostgreSQL pod. Types only: no controller code, so the
//! operator, the instance manager and `kubectl steward` depend on this crate and never on
//! each other.
//!
//! Names are validated twice: by the schema (pattern, at most 63 bytes, CEL rules, so bad
//! input is rejected at admission with a message naming the field) and again in code (the
//! database-operator's `ident::validate`) before any SQL is built. What `spec.parameters` may
//! hold is decided in [`parameters`]: the CRD's admission rules and the operator's value
//! checks come from the same tables.

#![forbid(unsafe_code)]
// kube-derive takes one `printcolumn(...)` per column; clippy reads them as duplicates.
#![allow(clippy::duplicated_attributes)]

pub mod contract;
pub mod monitoring;
pub mod parameters;

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ResourceRequirements;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
pub use steward_core::finalizer::DeletionPolicy;

/// The API group of every resource here.
pub const GROUP: &str = "database.steward.dev";

/// Annotation that asks for a password rotation of a [`DatabaseRole`]: set it to a new value
/// (a timestamp, a counter) and the password is rotated once for that value.
pub const ROTATE_ANNOTATION: &str = "database.steward.dev/rotate-password";

/// Annotation on a [`PostgresCluster`] asking for a switchover to the named instance (pod);
/// removed by the operator once that instance is the primary.
pub const SWITCHOVER_ANNOTATION: &str = "database.steward.dev/switchover-to";

/// Annotation on a [`PostgresCluster`] asking for a rotation of its CA: any value it has not
/// had before starts one (`kubectl steward rotate-ca` sets the time). The CA is also rotated
/// by itself a year before it ends.
pub const ROTATE_CA_ANNOTATION: &str = "database.steward.dev/rotate-ca";

/// The operator that serves these kinds: its field manager, Event reporter and Lease name.
pub const OPERATOR: &str = "database-operator";

// ---------------------------------------------------------------------------------------
// PostgresCluster
// ---------------------------------------------------------------------------------------

/// A PostgreSQL cluster: one primary and `instances - 1` streaming replicas in a StatefulSet.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "database.steward.dev",
    version = "v1alpha1",
    kind = "PostgresCluster",
    namespaced,
    shortname = "pgc",
    category = "steward",
    status = "PostgresClusterStatus",
    derive = "PartialEq",
    doc = "A PostgreSQL cluster: a StatefulSet of one primary and streaming replicas, its Services, superuser Secret, parameters and PodDisruptionBudget.",
    printcolumn(name = "Ready", type_ = "string", json_path = ".status.conditions[?(@.type==\"Ready\")].status"),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(name = "Instances", type_ = "integer", json_path = ".spec.instances"),
    printcolumn(name = "Ready Instances", type_ = "integer", json_path = ".status.readyInstances"),
    printcolumn(name = "Version", type_ = "integer", json_path = ".status.currentVersion"),
    printcolumn(name = "Primary", type_ = "string", json_path = ".status.primary"),
    printcolumn(name = "Standby", type_ = "boolean", json_path = ".spec.replica.enabled"),
    printcolumn(name = "Target", type_ = "integer", json_path = ".spec.version", priority = 1),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp"),
    validation = Rule::new("size(self.metadata.name) <= 47").message("metadata.name must be at most 47 characters so that the names of its pods and Services stay valid"),
)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(self.synchronousReplicas) || self.synchronousReplicas < self.instances").message("synchronousReplicas must be below instances: a commit waits for that many replicas"))]
#[x_kube(validation = Rule::new("!has(self.replica) || !has(self.bootstrap)").message("spec.replica: a standby cluster bootstraps from its source; remove spec.bootstrap"))]
#[x_kube(validation = Rule::new(REPLICA_NOT_OWN_STORE).message("spec.replica.source: a cluster cannot follow its own object store"))]
#[x_kube(validation = Rule::new("has(self.replica) || !has(oldSelf.replica) || !oldSelf.replica.enabled").message("spec.replica cannot be removed while enabled: set spec.replica.enabled to false first, which promotes the cluster and fences its source"))]
#[x_kube(validation = Rule::new("!has(self.replica) || !self.replica.enabled || !has(oldSelf.replica) || !oldSelf.replica.enabled || (self.replica.source.bucket == oldSelf.replica.source.bucket && self.replica.source.path == oldSelf.replica.source.path)").message("spec.replica.source: the bucket and path cannot change while the cluster follows them: a standby follows one cluster's history"))]
#[x_kube(validation = Rule::new("self.version == oldSelf.version || ((!has(self.replica) || !self.replica.enabled) && (!has(oldSelf.replica) || !oldSelf.replica.enabled))").message("spec.version cannot change while spec.replica.enabled: a standby runs its source's major version (promote it first, then upgrade)"))]
pub struct PostgresClusterSpec {
    /// Number of instances: one primary and `instances - 1` replicas.
    #[serde(default = "default_instances")]
    #[schemars(range(min = 1, max = 9))]
    pub instances: i32,

    /// PostgreSQL major version, e.g. 16. Raising it upgrades the cluster with `pg_upgrade`
    /// (a `PostgresBackup` first with `spec.backup`; every instance is stopped meanwhile; the
    /// replicas are cloned again afterwards): change `image` with it unless it is the default
    /// `postgres:<version>`. Downgrades are rejected.
    #[schemars(range(min = 13, max = 18))]
    #[x_kube(validation = Rule::new("self >= oldSelf").message("the PostgreSQL major version cannot be lowered"))]
    pub version: i32,

    /// Container image; default `postgres:<version>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 512))]
    pub image: Option<String>,

    /// When the kubelet pulls `image`: `Always`, `IfNotPresent`, or `Never` (an image already
    /// on the node). Unset: Kubernetes' default (`IfNotPresent` unless the tag is `latest`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_policy: Option<ImagePullPolicy>,

    /// Persistent storage of each instance (immutable: StatefulSet volume claim templates
    /// cannot change).
    #[x_kube(validation = Rule::new("self == oldSelf").message("storage is immutable"))]
    pub storage: StorageSpec,

    /// Compute resources of the PostgreSQL container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<Resources>,

    /// Server parameters (`postgresql.conf`), e.g. `max_connections: "200"`. Changing them
    /// rolls the instances like a version change. What the operator sets itself (where
    /// PostgreSQL listens and its files, `include*`, `archive_*` but `archive_timeout`,
    /// `restore_command`, `recovery_*`, `primary_*`, `hot_standby`, `synchronous_standby_names`,
    /// `cluster_name`, `wal_log_hints`, `full_page_writes`, `ssl`, `ssl_*`) is refused, and so
    /// are libraries given by path, log files outside the data directory and `wal_level:
    /// minimal`. Values of common parameters are checked by PostgreSQL's rules before anything
    /// rolls: a bad one leaves the cluster as it runs, `Ready=False InvalidParameters`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend("maxProperties" = 200, "additionalProperties" = {"type": "string", "maxLength": 4096}))]
    #[x_kube(validation = Rule::new("self.all(k, !self[k].matches('[[:cntrl:]]'))").message("parameter values must not contain control characters (newlines included): postgresql.conf holds one setting per line"))]
    #[x_kube(validation = Rule::new("self.all(k, k.matches('^[a-z_][a-z0-9_.]*$') && size(k) <= 63)").message("parameter names may contain only lower-case letters, digits, '_' and '.' (at most 63 bytes)"))]
    #[x_kube(validation = crate::parameters::owned_rule())]
    #[x_kube(validation = crate::parameters::libraries_rule())]
    #[x_kube(validation = crate::parameters::paths_rule())]
    #[x_kube(validation = crate::parameters::wal_level_rule())]
    pub parameters: BTreeMap<String, String>,

    /// Synchronous replication: a commit is acknowledged only once this many replicas have
    /// flushed it (`synchronous_standby_names = 'ANY n (*)'`). With `instances - 1`, no
    /// acknowledged transaction is lost on failover; writes wait while fewer replicas run.
    /// Unset: asynchronous.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 8))]
    pub synchronous_replicas: Option<i32>,

    /// What happens to the PersistentVolumeClaims (and the superuser Secret) when the cluster
    /// is deleted: `Retain` (default) keeps them, `Delete` deletes them.
    #[serde(default)]
    pub deletion_policy: DeletionPolicy,

    /// Continuous backup to S3-compatible object storage: every WAL file is archived
    /// (`archive_command`), and base backups are taken on request (`PostgresBackup`) and on
    /// `schedule`. Unset: no archiving. Changing it rolls the instances.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backup: Option<ClusterBackup>,

    /// PostgreSQL's metrics: every instance serves its built-in ones on port 8008
    /// (`/metrics`), and with `queriesConfigMap` the queries you add.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub monitoring: Option<Monitoring>,

    /// How the cluster's first instance is created. Unset: an empty cluster (`initdb`).
    /// Immutable: it only matters when the cluster is created.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self == oldSelf").message("bootstrap is immutable: it only applies when the cluster is created"))]
    pub bootstrap: Option<Bootstrap>,

    /// How the instances are spread over the nodes. Unset: each instance prefers a node no
    /// other instance of the cluster runs on (`spread: Preferred` over
    /// `kubernetes.io/hostname`), so one node lost takes one instance, not the primary and
    /// its replicas at once. Changing it rolls the instances.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placement: Option<Placement>,

    /// A standby cluster (disaster recovery across Kubernetes clusters): this cluster follows
    /// another one through its object store. Its first instance restores the source's newest
    /// base backup, then replays the source's archived WAL as it arrives; its other instances
    /// replicate from it (cascading). It accepts no writes. Setting `enabled: false` promotes
    /// it: before it accepts a write it writes a fence into the source's object store, which
    /// keeps the source (should it come back) from running read-write again. See
    /// docs/disaster-recovery.md. Unset: a cluster of its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replica: Option<ReplicaSpec>,

    /// A PgBouncer connection pooler in front of the primary: the Service
    /// `<cluster>-pooler-rw`. A planned switchover (on request, a rolling update, a drain)
    /// pauses it, so clients connected through it see no error, only a wait. Unset: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pooler: Option<Pooler>,
}

/// `spec.pooler` of a [`PostgresCluster`]: PgBouncer pods, each run by Steward's pooler agent
/// (which pauses it across switchovers and points it at the primary), behind the Service
/// `<cluster>-pooler-rw`, TLS to clients with a certificate of the cluster's CA for that
/// Service's names, TLS to PostgreSQL. Clients log in as their own roles: PgBouncer looks up
/// their password verifier through `auth_query` as the role `steward_pooler`, which may read
/// no other role's (superusers, replication roles and Steward's own roles cannot log in
/// through the pooler).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Pooler {
    /// PgBouncer pods (default 2; a PodDisruptionBudget keeps all but one through a drain).
    #[serde(default = "default_pooler_instances")]
    #[schemars(range(min = 1, max = 20))]
    pub instances: i32,
    /// `Transaction` (default): a server connection per transaction, released at its end
    /// (session state such as `SET` or prepared statements outside a transaction does not
    /// carry over); `Session`: one per client connection. A switchover waits for running
    /// transactions (`Transaction`) or for client connections to close (`Session`, so
    /// it is refused while clients stay connected).
    #[serde(default)]
    pub pool_mode: PoolMode,
    /// Server connections per user and database (`default_pool_size`, default 20).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 10000))]
    pub default_pool_size: Option<i32>,
    /// Client connections each PgBouncer pod accepts (`max_client_conn`, default 1000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 100000))]
    pub max_client_connections: Option<i32>,
    /// The PgBouncer image (any with `pgbouncer` on its `PATH`, 1.19 or later). Unset: the
    /// operator's `--pooler-image`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 512))]
    pub image: Option<String>,
}

fn default_pooler_instances() -> i32 {
    2
}

/// How a [`Pooler`] shares server connections.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum PoolMode {
    #[default]
    Transaction,
    Session,
}

impl PoolMode {
    /// PgBouncer's name for it.
    pub fn as_pgbouncer(self) -> &'static str {
        match self {
            PoolMode::Transaction => "transaction",
            PoolMode::Session => "session",
        }
    }
}

/// How a [`PostgresCluster`]'s instances are spread over nodes or zones (pod anti-affinity
/// between its instances).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Placement {
    /// `Preferred` (default): the scheduler puts instances on different domains of
    /// `topologyKey` when it can, on the same one when it cannot (fewer nodes than instances);
    /// `Required`: only on different domains (an instance stays Pending, with the scheduler's
    /// reason in its pod's events, rather than share one); `None`: no rule.
    #[serde(default)]
    pub spread: Spread,
    /// The node label whose values are the domains: `kubernetes.io/hostname` (default, one
    /// node each) or `topology.kubernetes.io/zone` (one zone each).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 316),
        regex(
            pattern = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
        )
    )]
    pub topology_key: Option<String>,
}

impl Placement {
    /// The label key of the domains (`kubernetes.io/hostname` unless set).
    pub fn topology_key(&self) -> &str {
        self.topology_key
            .as_deref()
            .unwrap_or("kubernetes.io/hostname")
    }
}

/// How strictly a [`Placement`] spreads instances.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum Spread {
    /// On different domains when the scheduler can.
    #[default]
    Preferred,
    /// Only on different domains.
    Required,
    /// No rule.
    None,
}

/// `spec.monitoring` of a [`PostgresCluster`].
#[derive(Clone, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Monitoring {
    /// A ConfigMap in the cluster's namespace whose every key is a YAML list of metrics
    /// queries (format: docs/postgres.md, "Metrics"), run by every instance beside the
    /// built-in ones, as `steward_monitor` (`pg_monitor`), read-only and bounded. Naming
    /// another ConfigMap rolls the instances; editing it does not (the kubelet refreshes the
    /// files within about a minute). The condition `MetricsQueries` says whether it serves.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub queries_config_map: Option<String>,
}

/// Where and how a [`PostgresCluster`] is backed up.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClusterBackup {
    /// The bucket and path this cluster's WAL and base backups go to. One path per cluster:
    /// archiving refuses to overwrite a WAL file another cluster wrote.
    pub object_store: ObjectStore,
    /// Base backups on a schedule: a cron expression of 5 fields (UTC) or a nickname
    /// (`@daily`). A `PostgresBackup` named `<cluster>-<yyyymmddhhmmss>` is created each
    /// time. Unset: only on request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 256))]
    pub schedule: Option<String>,
    /// How many base backups to keep: after each new one, older base backups and the WAL
    /// only they needed are deleted from the object store (and their `PostgresBackup`s).
    /// Unset: all are kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1000))]
    pub keep: Option<u32>,
}

/// An S3-compatible bucket and the path under it.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct ObjectStore {
    /// The S3 endpoint URL (`https://s3.eu-west-1.amazonaws.com`, `http://minio.minio:9000`).
    #[schemars(
        length(min = 1, max = 1024),
        regex(pattern = r"^https?://[^\s/]+(/.*)?$")
    )]
    pub endpoint: String,
    #[schemars(
        length(min = 3, max = 63),
        regex(pattern = r"^[a-z0-9][a-z0-9.-]*[a-z0-9]$")
    )]
    pub bucket: String,
    /// The prefix of every object (`prod/orders-db`): relative, without `.` or `..` segments
    /// or `//` (one spelling per place, so two clusters cannot share one by writing it
    /// differently).
    #[schemars(length(min = 1, max = 512), regex(pattern = r"^[A-Za-z0-9._/-]+$"))]
    #[x_kube(validation = Rule::new("!self.startsWith('/') && !self.contains('//') && !self.split('/').exists(s, s == '.' || s == '..')").message("path must be relative, without '.' or '..' segments or '//', e.g. prod/orders-db"))]
    pub path: String,
    /// Default `us-east-1`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 64))]
    pub region: Option<String>,
    /// A Secret in the cluster's namespace with the keys `accessKeyId` and
    /// `secretAccessKey`.
    #[schemars(length(min = 1, max = 253))]
    pub credentials_secret: String,
}

/// `spec.replica` of a [`PostgresCluster`]: the cluster it follows, and whether it still does.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReplicaSpec {
    /// Whether this cluster follows `source` (read-only). `false` promotes it: it fences the
    /// source's object store, then accepts writes on a new timeline.
    #[serde(default = "enabled")]
    pub enabled: bool,
    /// The source cluster's object store (its `spec.backup.objectStore`), with credentials
    /// that may read it and write its fence.
    pub source: ObjectStore,
    /// A planned switchover: the source's demotion token (its `status.replica.demotionToken`
    /// once `spec.replica.enabled` made it a standby: `<timeline>:<LSN>`, where its WAL
    /// ends). With `enabled: false`, this cluster promotes only once it has replayed all of
    /// it, so no write the source acknowledged is lost. Unset: an unplanned promotion, at
    /// once, losing what the source had not archived.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 64),
        regex(pattern = r"^[0-9]+:[0-9A-Fa-f]{1,8}/[0-9A-Fa-f]{1,8}$")
    )]
    pub promotion_token: Option<String>,
}

fn enabled() -> bool {
    true
}

/// The admission rule refusing a `spec.replica.source` that is the cluster's own
/// `spec.backup.objectStore` (same endpoint, bucket and path, a trailing `/` aside), as
/// [`ObjectStore::same_place`] decides in code.
const REPLICA_NOT_OWN_STORE: &str = "!has(self.replica) || !has(self.backup) || !(self.replica.source.endpoint == self.backup.objectStore.endpoint && self.replica.source.bucket == self.backup.objectStore.bucket && (self.replica.source.path == self.backup.objectStore.path || self.replica.source.path + '/' == self.backup.objectStore.path || self.replica.source.path == self.backup.objectStore.path + '/'))";

impl ObjectStore {
    /// `s3://<bucket>/<path>`, as status and messages name a store.
    pub fn url(&self) -> String {
        format!("s3://{}/{}", self.bucket, self.path.trim_end_matches('/'))
    }

    /// Whether `other` is the same place: endpoint, bucket and path (a trailing `/` aside; the
    /// schema allows no other second spelling of a path).
    pub fn same_place(&self, other: &ObjectStore) -> bool {
        self.endpoint == other.endpoint
            && self.bucket == other.bucket
            && self.path.trim_end_matches('/') == other.path.trim_end_matches('/')
    }
}

/// How a [`PostgresCluster`] starts.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Bootstrap {
    /// Restore another cluster's backup (point-in-time recovery): its newest base backup
    /// completed before `targetTime`, then its archived WAL up to that time. The restored
    /// cluster is a normal cluster afterwards, on a new timeline; its superuser password is
    /// its own.
    pub recovery: Recovery,
}

/// A backup to restore.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Recovery {
    /// Where the source cluster's backups are (its `spec.backup.objectStore`).
    pub object_store: ObjectStore,
    /// Recover up to this time (RFC 3339, `2026-12-02T03:04:05Z`), checked at admission
    /// (`format: date-time`: a day or an hour that does not exist is refused). Unset: to the
    /// end of the archive.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 64), extend("format" = "date-time"))]
    pub target_time: Option<String>,
}

fn default_instances() -> i32 {
    1
}

/// Compute resources of the PostgreSQL container: quantities per resource name, each checked
/// at admission (a container's `resources`, without `claims`).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
pub struct Resources {
    /// Requested resources, e.g. `cpu: 500m`, `memory: 1Gi`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend("maxProperties" = 16, "additionalProperties" = {
        "x-kubernetes-int-or-string": true,
        "maxLength": 64,
        "x-kubernetes-validations": [{
            "rule": "isQuantity(string(self)) && !quantity(string(self)).isLessThan(quantity('0'))",
            "message": "must be a quantity that is not negative, e.g. 500m or 1Gi"
        }]
    }))]
    pub requests: BTreeMap<String, Quantity>,
    /// Limits, e.g. `memory: 2Gi`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend("maxProperties" = 16, "additionalProperties" = {
        "x-kubernetes-int-or-string": true,
        "maxLength": 64,
        "x-kubernetes-validations": [{
            "rule": "isQuantity(string(self)) && !quantity(string(self)).isLessThan(quantity('0'))",
            "message": "must be a quantity that is not negative, e.g. 500m or 1Gi"
        }]
    }))]
    pub limits: BTreeMap<String, Quantity>,
}

impl Resources {
    /// As a container's resource requirements.
    pub fn to_requirements(&self) -> ResourceRequirements {
        let map = |m: &BTreeMap<String, Quantity>| (!m.is_empty()).then(|| m.clone());
        ResourceRequirements {
            requests: map(&self.requests),
            limits: map(&self.limits),
            ..Default::default()
        }
    }
}

/// Storage of each instance.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct StorageSpec {
    /// Size of each instance's volume, e.g. `10Gi`.
    #[x_kube(validation = Rule::new("isQuantity(string(self)) && quantity(string(self)).isGreaterThan(quantity('0'))").message("storage.size must be a positive quantity, e.g. 10Gi"))]
    pub size: Quantity,
    /// StorageClass of the volumes; the cluster default when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub storage_class_name: Option<String>,
}

/// Observed state of a [`PostgresCluster`].
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PostgresClusterStatus {
    /// `Creating`, `Upgrading`, `Ready` or `Degraded`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<ClusterPhase>,
    /// Instances whose pod is Ready.
    #[serde(default)]
    pub ready_instances: i32,
    /// Instances running the target revision.
    #[serde(default)]
    pub updated_instances: i32,
    /// Major version the primary runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_version: Option<i32>,
    /// Major version the cluster is rolling to (`spec.version`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_version: Option<i32>,
    /// The primary's pod: the holder of the Lease `<cluster>-primary`, which the instance
    /// managers elect.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub primary: Option<String>,
    /// How many times the primary changed (the Lease's `leaseTransitions`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub primary_transitions: Option<i32>,
    /// The instance a switchover is handing the primary to, while one is under way.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub switchover_target: Option<String>,
    /// A switchover the primary refused, and why (`<target>: <reason>`: the target did not
    /// stream, lagged, or did not confirm the last WAL), while the refusal stands; a requested
    /// one is left for you to change or remove.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub switchover_refused: Option<String>,
    /// Each instance as its instance manager last reported it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub instances: Vec<InstanceState>,
    /// Secret with the superuser's credentials (`username`, `password`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub superuser_secret: Option<String>,
    /// Continuous backup, when `spec.backup` is set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backup: Option<ClusterBackupStatus>,
    /// The last major-version upgrade (`spec.version` raised): its progress, or how it ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub major_upgrade: Option<MajorUpgradeStatus>,
    /// A standby cluster (`spec.replica`): how far it has followed its source, from its
    /// leader's report; after a promotion, where the replay ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replica: Option<ReplicaStatus>,
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Ready`, `Progressing`, `Degraded` and, with `spec.backup`, `ContinuousArchiving`;
    /// with `spec.replica`, `Standby`.
    #[serde(default)]
    pub conditions: Vec<Condition>,
}

/// `status.replica` of a standby [`PostgresCluster`] (`spec.replica`), from what its leader
/// (the holder of the Lease `<cluster>-primary`) reports. The position fields keep their last
/// reported values while the leader reports none (restarting, promoted): after a promotion
/// they say where the replay of the source ended.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReplicaStatus {
    /// The source's object store, `s3://<bucket>/<path>`.
    pub source: String,
    /// `spec.replica.enabled`: `true` while the cluster follows its source, `false` once its
    /// promotion was asked for (the `Standby` condition says whether it is done).
    pub enabled: bool,
    /// How far the leader has replayed the source's WAL (`16/B374D848`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replayed_lsn: Option<String>,
    /// The commit time of the last transaction replayed (RFC 3339): the source's state this
    /// cluster shows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_replayed_at: Option<String>,
    /// Bytes of WAL the source archived beyond what was replayed (at most a WAL segment more
    /// than the truth; what the source has not archived yet is not counted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lag_bytes: Option<u64>,
    /// The newest WAL file the source archived, as the leader last listed it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_wal: Option<String>,
    /// Whether the leader could list the source's object store at its last look.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_reachable: Option<bool>,
    /// Why it could not, while it cannot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_error: Option<String>,
    /// This cluster was a primary and was demoted (`spec.replica.enabled` set on it): where
    /// its WAL ended (`<timeline>:<LSN>`), the `spec.replica.promotionToken` of the cluster
    /// that takes over.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub demotion_token: Option<String>,
}

/// A major-version upgrade: the primary's data directory is upgraded with `pg_upgrade` by a
/// Job while every instance is stopped, then the replicas are cloned again from it.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MajorUpgradeStatus {
    /// The major the data was on, and the one it is upgraded to.
    pub from: i32,
    pub to: i32,
    pub phase: MajorUpgradePhase,
    /// The instance whose data directory is upgraded (the primary when it began).
    pub instance: String,
    /// The old major's image, which the instances run until the upgrade completes (and again
    /// after it failed).
    pub from_image: String,
    /// The `PostgresBackup` taken first, with `spec.backup`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backup: Option<String>,
    /// Why it failed (`pg_upgrade`'s reason), or what it waits for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// The `metadata.generation` it ran for: a failed upgrade is tried again only when the
    /// spec changes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<String>,
}

/// Where a [`MajorUpgradeStatus`] is.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum MajorUpgradePhase {
    /// Waiting for the `PostgresBackup` taken before anything changes.
    #[default]
    BackingUp,
    /// Every instance is being stopped.
    Stopping,
    /// The upgrade Job runs `pg_upgrade` on the instance's volume.
    Upgrading,
    /// Done: the instances run the new major; the replicas clone the upgraded primary.
    Completed,
    /// The instances run the old major again, its data untouched; `message` says why.
    Failed,
}

/// What is recoverable, from the primary's archiver and the cluster's `PostgresBackup`s.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClusterBackupStatus {
    /// The last WAL file archived, and when.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_archived_wal: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_archived_time: Option<String>,
    /// The last WAL file whose archiving failed, and when.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_failed_wal: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_failed_time: Option<String>,
    /// The newest completed `PostgresBackup`, and when it completed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_base_backup: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_base_backup_time: Option<String>,
    /// The oldest completed base backup's completion: the earliest time it can be restored to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_recoverability_point: Option<String>,
    /// When the schedule last created a backup.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_scheduled_time: Option<String>,
}

/// One instance of a [`PostgresCluster`], as its instance manager reports it on its pod.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct InstanceState {
    /// The pod.
    pub name: String,
    /// `primary`, `replica` or `down`.
    pub role: String,
    /// The timeline PostgreSQL runs on.
    pub timeline: u32,
    /// The primary's write position, or what a replica received (`16/B374D848`).
    pub lsn: String,
    /// Bytes a replica received but has not replayed yet.
    pub replay_lag_bytes: u64,
    /// The pod is Ready (serving its role).
    pub ready: bool,
    /// On the primary: commits waiting more than 5 s for synchronous standbys to confirm
    /// them (`synchronousReplicas` replicas must stream for them to return).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub commits_waiting: u32,
    /// Why its instance manager's last step failed, while it keeps failing (e.g. a restore
    /// with no base backup of the cluster's major): what keeps it from running.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub problem: Option<String>,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// Lifecycle phase of a [`PostgresCluster`].
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum ClusterPhase {
    Creating,
    Upgrading,
    Ready,
    Degraded,
}

// ---------------------------------------------------------------------------------------
// PostgresBackup
// ---------------------------------------------------------------------------------------

/// A base backup of a [`PostgresCluster`] to its `spec.backup` object store, taken by the
/// cluster's primary instance manager (`pg_basebackup`, streamed compressed). Create one to
/// back up now; the schedule creates them too. Its status says where the backup is and from
/// which WAL position it restores.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "database.steward.dev",
    version = "v1alpha1",
    kind = "PostgresBackup",
    namespaced,
    shortname = "pgb",
    category = "steward",
    status = "contract::BackupRun",
    derive = "PartialEq",
    doc = "A base backup of a PostgresCluster to its object store, taken by its primary.",
    printcolumn(name = "Cluster", type_ = "string", json_path = ".spec.cluster"),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(name = "Completed", type_ = "date", json_path = ".status.completedAt"),
    printcolumn(
        name = "Size",
        type_ = "integer",
        json_path = ".status.size",
        priority = 1
    ),
    printcolumn(
        name = "Message",
        type_ = "string",
        json_path = ".status.message",
        priority = 1
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct PostgresBackupSpec {
    /// The PostgresCluster (same namespace) to back up.
    #[schemars(length(min = 1, max = 63))]
    #[x_kube(validation = Rule::new("self == oldSelf").message("cluster is immutable"))]
    pub cluster: String,
}

/// The name of the `PostgresBackup` a cluster's `spec.backup.schedule` creates when it is due
/// at `at`: `<cluster>-<yyyymmddhhmmss>` (UTC).
pub fn scheduled_backup_name(cluster: &str, at: jiff::Timestamp) -> String {
    format!("{cluster}-{}", at.strftime("%Y%m%d%H%M%S"))
}

// ---------------------------------------------------------------------------------------
// Database
// ---------------------------------------------------------------------------------------

/// A database and its owner role on a PostgreSQL server.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "database.steward.dev",
    version = "v1alpha1",
    kind = "Database",
    namespaced,
    shortname = "pgdb",
    category = "steward",
    status = "DatabaseStatus",
    derive = "PartialEq",
    doc = "A PostgreSQL database and its owner role, with extensions and schemas, on a PostgresCluster or an external server.",
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(name = "Database", type_ = "string", json_path = ".spec.name"),
    printcolumn(name = "Owner", type_ = "string", json_path = ".spec.owner"),
    printcolumn(name = "Server", type_ = "string", json_path = ".status.server"),
    printcolumn(
        name = "Policy",
        type_ = "string",
        json_path = ".spec.deletionPolicy",
        priority = 1
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[x_kube(validation = Rule::new("has(self.clusterRef) != has(self.external)").message("exactly one of clusterRef and external must be set"))]
#[x_kube(validation = Rule::new("has(self.clusterRef) == has(oldSelf.clusterRef) && (!has(self.clusterRef) || self.clusterRef.name == oldSelf.clusterRef.name) && (!has(self.external) || (self.external.host == oldSelf.external.host && self.external.port == oldSelf.external.port && self.external.adminSecretRef.name == oldSelf.external.adminSecretRef.name))").message("the server cannot change (clusterRef, or external host, port and adminSecretRef): the database on the old server would be orphaned; create another Database instead"))]
#[serde(rename_all = "camelCase")]
pub struct DatabaseSpec {
    /// A PostgresCluster in the same namespace (its read-write Service and superuser Secret).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster_ref: Option<LocalRef>,

    /// A server outside this operator's control.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub external: Option<ExternalServer>,

    /// Name of the database in PostgreSQL (immutable).
    #[schemars(length(min = 1, max = 63), regex(pattern = "^[a-z_][a-z0-9_]*$"))]
    #[x_kube(validation = Rule::new("self == oldSelf").message("name is immutable"))]
    #[x_kube(validation = Rule::new("!(self in ['postgres', 'template0', 'template1'])").message("the system databases postgres, template0 and template1 cannot be managed"))]
    pub name: String,

    /// The role owning the database; created (with login and a generated password) if missing.
    #[schemars(length(min = 1, max = 63), regex(pattern = "^[a-z_][a-z0-9_]*$"))]
    #[x_kube(validation = Rule::new("!self.startsWith('pg_') && !self.startsWith('steward_') && !(self in ['postgres', 'public', 'none', 'current_user', 'session_user', 'current_role'])").message("owner must not be a reserved role name (pg_*, steward_*, postgres, public, none, current_user, session_user, current_role)"))]
    pub owner: String,

    /// Extensions to create or drop.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    #[x_kube(validation = Rule::new("self.all(e, self.exists_one(f, f.name == e.name))").message("extension names must be unique"))]
    pub extensions: Vec<ExtensionSpec>,

    /// Schemas to create or drop.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    #[x_kube(validation = Rule::new("self.all(s, self.exists_one(t, t.name == s.name))").message("schema names must be unique"))]
    pub schemas: Vec<SchemaSpec>,

    /// `Retain` (default): deleting this object leaves the database and role in place;
    /// `Delete`: they are dropped.
    #[serde(default)]
    pub deletion_policy: DeletionPolicy,

    /// With `deletionPolicy: Delete`, dump the database (`pg_dump` in a Job, into a
    /// PersistentVolumeClaim that is kept) and drop it only after the dump succeeded.
    #[serde(default)]
    pub backup_before_delete: bool,

    /// Where and how the pre-delete dump runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backup: Option<BackupSpec>,

    /// Take over an existing database and owner role that no Steward resource owns (or whose
    /// owning resource no longer exists). Without it such a database is refused, so a
    /// Database can never silently adopt, hand out or drop what is not its own. Privileged
    /// roles are never taken over.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub adopt: bool,
}

/// A reference to an object in the same namespace.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
pub struct LocalRef {
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
}

/// A PostgreSQL server reached over the network with an admin role.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ExternalServer {
    /// Host name or IP address.
    #[schemars(length(min = 1, max = 253))]
    pub host: String,
    /// TCP port.
    #[serde(default = "default_port")]
    #[schemars(range(min = 1, max = 65535))]
    pub port: i32,
    /// libpq `sslmode`: `disable`, `prefer` (default), `require`, `verify-ca` or `verify-full`.
    #[serde(default)]
    pub ssl_mode: SslMode,
    /// Secret in this namespace with the admin role's `username` and `password` (and
    /// optionally `ca.crt` for `verify-ca`/`verify-full`).
    pub admin_secret_ref: SecretRef,
    /// Database the admin connects to for server-wide statements.
    #[serde(default = "default_admin_database")]
    #[schemars(length(min = 1, max = 63))]
    pub admin_database: String,
}

impl DatabaseSpec {
    /// Database `name` owned by role `owner` on `server`, with the defaults: no schemas or
    /// extensions, `Retain`, no backup, no adoption.
    pub fn on(server: ExternalServer, name: &str, owner: &str) -> Self {
        Self {
            cluster_ref: None,
            external: Some(server),
            name: name.into(),
            owner: owner.into(),
            extensions: vec![],
            schemas: vec![],
            deletion_policy: DeletionPolicy::Retain,
            backup_before_delete: false,
            backup: None,
            adopt: false,
        }
    }
}

impl ExternalServer {
    /// A server at `host:port` without TLS (`sslmode: disable`), its admin's `username` and
    /// `password` in Secret `admin_secret`, admin database `postgres`.
    pub fn plain(host: &str, port: u16, admin_secret: &str) -> Self {
        Self {
            host: host.into(),
            port: i32::from(port),
            ssl_mode: SslMode::Disable,
            admin_secret_ref: SecretRef {
                name: admin_secret.into(),
                username_key: default_username_key(),
                password_key: default_password_key(),
            },
            admin_database: default_admin_database(),
        }
    }
}

fn default_port() -> i32 {
    5432
}

fn default_admin_database() -> String {
    "postgres".into()
}

/// A Secret holding credentials, with the keys to read.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SecretRef {
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    #[serde(default = "default_username_key")]
    pub username_key: String,
    #[serde(default = "default_password_key")]
    pub password_key: String,
}

fn default_username_key() -> String {
    "username".into()
}

fn default_password_key() -> String {
    "password".into()
}

/// A container's `imagePullPolicy`.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum ImagePullPolicy {
    Always,
    IfNotPresent,
    Never,
}

impl ImagePullPolicy {
    /// The value as Kubernetes spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Always => "Always",
            Self::IfNotPresent => "IfNotPresent",
            Self::Never => "Never",
        }
    }
}

/// libpq's `sslmode` values the operator supports.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum SslMode {
    /// Plain TCP.
    Disable,
    /// TLS when the server offers it, without certificate checks; else plain TCP.
    #[default]
    Prefer,
    /// TLS without certificate checks.
    Require,
    /// TLS, certificate signed by the CA (`ca.crt` in the admin Secret, else system roots).
    VerifyCa,
    /// As `verify-ca`, and the certificate names the host.
    VerifyFull,
}

/// `present` or `absent`.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Ensure {
    #[default]
    Present,
    Absent,
}

/// An extension in the database.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ExtensionSpec {
    /// Extension name as in `pg_available_extensions`, e.g. `pgcrypto`, `uuid-ossp`.
    #[schemars(length(min = 1, max = 63), regex(pattern = "^[a-z_][a-z0-9_-]*$"))]
    pub name: String,
    #[serde(default)]
    pub ensure: Ensure,
    /// Schema to create the extension in (must exist); the default schema when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 63), regex(pattern = "^[a-z_][a-z0-9_]*$"))]
    pub schema: Option<String>,
}

/// A schema in the database, owned by the database owner.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct SchemaSpec {
    #[schemars(length(min = 1, max = 63), regex(pattern = "^[a-z_][a-z0-9_]*$"))]
    #[x_kube(validation = Rule::new("!self.startsWith('pg_') && self != 'information_schema'").message("system schemas (pg_*, information_schema) cannot be managed"))]
    pub name: String,
    /// `absent` drops the schema only if it is empty (never `CASCADE`).
    #[serde(default)]
    pub ensure: Ensure,
}

/// The pre-delete dump.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct BackupSpec {
    /// Size of the PersistentVolumeClaim the dump is written to (default 1Gi).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("isQuantity(string(self)) && quantity(string(self)).isGreaterThan(quantity('0'))").message("backup.storageSize must be a positive quantity, e.g. 1Gi"))]
    pub storage_size: Option<Quantity>,
    /// StorageClass of that claim; the cluster default when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage_class_name: Option<String>,
    /// Image with `pg_dump` (default `postgres:17`; must not be older than the server).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
}

/// Observed state of a [`Database`].
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DatabaseStatus {
    /// `Pending`, `Ready`, `Failed` or `Deleting`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<ResourcePhase>,
    /// `host:port` of the server.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server: Option<String>,
    /// Secret with `host`, `port`, `dbname`, `user`, `password`, `uri` and `jdbc-uri`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_name: Option<String>,
    /// The pre-delete dump, once started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backup: Option<BackupStatus>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Ready`, `ServerReachable` and, while deleting, `Deleting`.
    #[serde(default)]
    pub conditions: Vec<Condition>,
}

/// The pre-delete dump of a [`Database`].
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BackupStatus {
    /// The Job running `pg_dump`.
    pub job: String,
    /// The PersistentVolumeClaim holding the dump (kept after the Database is gone).
    pub claim: String,
    /// File name of the dump inside the claim.
    pub file: String,
    /// Whether the Job succeeded.
    pub succeeded: bool,
}

/// Lifecycle phase of a [`Database`] or [`DatabaseRole`].
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum ResourcePhase {
    Pending,
    Ready,
    Failed,
    Deleting,
}

// ---------------------------------------------------------------------------------------
// DatabaseRole
// ---------------------------------------------------------------------------------------

/// A login role with privileges on a [`Database`], with a generated, rotatable password.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "database.steward.dev",
    version = "v1alpha1",
    kind = "DatabaseRole",
    namespaced,
    shortname = "pgrole",
    category = "steward",
    status = "DatabaseRoleStatus",
    derive = "PartialEq",
    doc = "A PostgreSQL login role with owner, readWrite or readOnly privileges on a Database, and a generated, rotatable password in a Secret.",
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(name = "Role", type_ = "string", json_path = ".spec.roleName"),
    printcolumn(
        name = "Database",
        type_ = "string",
        json_path = ".spec.databaseRef.name"
    ),
    printcolumn(name = "Privileges", type_ = "string", json_path = ".spec.privileges"),
    printcolumn(
        name = "Rotated",
        type_ = "date",
        json_path = ".status.passwordUpdatedAt",
        priority = 1
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct DatabaseRoleSpec {
    /// The [`Database`] (same namespace) the privileges are on (immutable).
    #[x_kube(validation = Rule::new("self == oldSelf").message("databaseRef is immutable"))]
    pub database_ref: LocalRef,

    /// Name of the role in PostgreSQL (immutable).
    #[schemars(length(min = 1, max = 63), regex(pattern = "^[a-z_][a-z0-9_]*$"))]
    #[x_kube(validation = Rule::new("self == oldSelf").message("roleName is immutable"))]
    #[x_kube(validation = Rule::new("!self.startsWith('pg_') && !self.startsWith('steward_') && !(self in ['postgres', 'public', 'none', 'current_user', 'session_user', 'current_role'])").message("roleName must not be a reserved role name (pg_*, steward_*, postgres, public, none, current_user, session_user, current_role)"))]
    pub role_name: String,

    /// `owner` (member of the database's owner role), `readWrite` (read and write data in
    /// the database's schemas) or `readOnly` (read data).
    pub privileges: Privileges,

    /// Rotate the password on an interval. Independently, changing the annotation
    /// `database.steward.dev/rotate-password` rotates it once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password_rotation: Option<PasswordRotation>,

    /// Take over an existing role that no Steward resource owns (or whose owning resource no
    /// longer exists). Privileged roles are never taken over.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub adopt: bool,

    /// `Retain` (default): deleting this object leaves the role in place; `Delete`: its
    /// objects are reassigned to the database owner and the role is dropped.
    #[serde(default)]
    pub deletion_policy: DeletionPolicy,
}

/// Privileges of a [`DatabaseRole`].
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum Privileges {
    Owner,
    ReadWrite,
    ReadOnly,
}

/// Password rotation of a [`DatabaseRole`].
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct PasswordRotation {
    /// How often, e.g. `720h` (at least `1h`, at most `87600h`, ten years).
    #[schemars(regex(pattern = "^[0-9]{1,7}(s|m|h)$"))]
    #[x_kube(validation = Rule::new("duration(self) >= duration('1h') && duration(self) <= duration('87600h')").message("passwordRotation.interval must be between 1h and 87600h (ten years)"))]
    pub interval: String,
}

/// Observed state of a [`DatabaseRole`].
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DatabaseRoleStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<ResourcePhase>,
    /// Secret with `host`, `port`, `dbname`, `user`, `password`, `uri` and `jdbc-uri`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_name: Option<String>,
    /// When the current password was generated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password_updated_at: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Ready` and `ServerReachable`.
    #[serde(default)]
    pub conditions: Vec<Condition>,
}

#[cfg(test)]
mod tests {
    use kube::CustomResourceExt;
    use serde_json::{Value, json};

    use super::PostgresCluster;

    /// The spec's admission rules about `spec.replica`, as the CRD carries them: (rule,
    /// message).
    fn replica_rules() -> Vec<(String, String)> {
        let crd = serde_json::to_value(PostgresCluster::crd()).unwrap();
        let spec = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"];
        spec["x-kubernetes-validations"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                let text = |k: &str| r[k].as_str().unwrap_or_default().to_string();
                (text("rule"), text("message"))
            })
            .filter(|(rule, _)| rule.contains("replica"))
            .collect()
    }

    /// The messages of the rules `spec` breaks, updated from `old` (`None`: created). Rules
    /// with `oldSelf` are transition rules, which the API server skips on create.
    fn refusals(spec: &Value, old: Option<&Value>) -> Vec<String> {
        replica_rules()
            .into_iter()
            .filter(|(rule, _)| old.is_some() || !rule.contains("oldSelf"))
            .filter(|(rule, _)| {
                let program = cel::Program::compile(rule).unwrap();
                let mut context = cel::Context::default();
                context
                    .add_variable("self", cel::to_value(spec).unwrap())
                    .unwrap();
                if let Some(old) = old {
                    context
                        .add_variable("oldSelf", cel::to_value(old).unwrap())
                        .unwrap();
                }
                match program.execute(&context) {
                    Ok(cel::Value::Bool(holds)) => !holds,
                    other => panic!("{rule}: {other:?}"),
                }
            })
            .map(|(_, message)| message)
            .collect()
    }

    fn store(bucket: &str, path: &str) -> Value {
        json!({"endpoint": "https://s3.example", "bucket": bucket, "path": path,
               "credentialsSecret": "s3"})
    }

    fn spec(replica: Option<(bool, Value)>) -> Value {
        let mut spec = json!({"instances": 3, "version": 16, "storage": {"size": "1Gi"},
                              "backup": {"objectStore": store("dr", "standby/orders")}});
        if let Some((enabled, source)) = replica {
            spec["replica"] = json!({"enabled": enabled, "source": source});
        }
        spec
    }

    #[test]
    fn a_standby_is_refused_with_a_bootstrap_or_its_own_store() {
        let standby = spec(Some((true, store("dr", "prod/orders"))));
        assert_eq!(refusals(&standby, None), Vec::<String>::new());
        let mut restored = standby.clone();
        restored["bootstrap"] = json!({"recovery": {"objectStore": store("dr", "prod/orders")}});
        assert_eq!(
            refusals(&restored, None),
            ["spec.replica: a standby cluster bootstraps from its source; remove spec.bootstrap"]
        );
        for own in ["standby/orders", "standby/orders/"] {
            let mut itself = spec(Some((true, store("dr", own))));
            assert_eq!(
                refusals(&itself, None),
                ["spec.replica.source: a cluster cannot follow its own object store"],
                "{own}"
            );
            itself["backup"]["objectStore"]["path"] = json!("standby/orders/");
            assert_eq!(
                refusals(&itself, None).len(),
                1,
                "{own} against a trailing /"
            );
        }
        let mut elsewhere = spec(Some((true, store("dr", "standby/orders"))));
        elsewhere["replica"]["source"]["endpoint"] = json!("https://s3.other.example");
        assert!(refusals(&elsewhere, None).is_empty(), "another endpoint");
        let mut unbacked = spec(Some((true, store("dr", "prod/orders"))));
        unbacked.as_object_mut().unwrap().remove("backup");
        assert!(refusals(&unbacked, None).is_empty());
    }

    /// A standby moves to its promotion, and a primary may become a standby (a demotion),
    /// but a cluster that follows does not follow another history, is not upgraded, and does
    /// not drop `spec.replica` without a promotion (which would skip the fence).
    #[test]
    fn a_following_cluster_keeps_its_source_and_major_until_it_is_promoted() {
        let source = store("dr", "prod/orders");
        let following = spec(Some((true, source.clone())));
        let promoted = spec(Some((false, source.clone())));
        let plain = spec(None);
        let refused = |new: &Value, old: &Value| refusals(new, Some(old));
        assert!(refused(&following, &following).is_empty());
        assert!(refused(&promoted, &following).is_empty(), "the promotion");
        assert!(
            refused(&plain, &promoted).is_empty(),
            "spec.replica removed once promoted"
        );
        assert!(refused(&plain, &plain).is_empty());
        assert!(refused(&following, &plain).is_empty(), "a demotion");
        assert!(refused(&following, &promoted).is_empty(), "a switchback");
        let one = |new: &Value, old: &Value, says: &str| {
            let messages = refused(new, old);
            assert_eq!(messages.len(), 1, "{messages:?}");
            assert!(messages[0].starts_with(says), "{messages:?}");
        };
        one(
            &plain,
            &following,
            "spec.replica cannot be removed while enabled",
        );
        let mut other = following.clone();
        other["replica"]["source"]["path"] = json!("prod/other");
        one(
            &other,
            &following,
            "spec.replica.source: the bucket and path cannot change",
        );
        assert!(
            refused(&other, &promoted).is_empty(),
            "following another once promoted"
        );
        let mut rotated = following.clone();
        rotated["replica"]["source"]["credentialsSecret"] = json!("s3-rotated");
        assert!(refused(&rotated, &following).is_empty(), "new credentials");
        let mut upgraded = following.clone();
        upgraded["version"] = json!(17);
        one(&upgraded, &following, "spec.version cannot change while");
        let mut promoted_and_upgraded = promoted.clone();
        promoted_and_upgraded["version"] = json!(17);
        one(
            &promoted_and_upgraded,
            &following,
            "spec.version cannot change while",
        );
        assert!(
            refused(&promoted_and_upgraded, &promoted).is_empty(),
            "upgraded once promoted"
        );
    }
}
