//! The children of a [`PostgresCluster`], built without touching the API server.

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::apps::v1::{
    StatefulSet, StatefulSetPersistentVolumeClaimRetentionPolicy, StatefulSetSpec,
    StatefulSetUpdateStrategy,
};
use k8s_openapi::api::core::v1::{
    Affinity, ConfigMap, ConfigMapVolumeSource, Container, ContainerPort, EmptyDirVolumeSource,
    EnvVar, EnvVarSource, HTTPGetAction, ObjectFieldSelector, PersistentVolumeClaim,
    PersistentVolumeClaimSpec, PodAffinityTerm, PodAntiAffinity, PodSecurityContext, PodSpec,
    PodTemplateSpec, Probe, Secret, SecretKeySelector, SecretVolumeSource, Service, ServiceAccount,
    ServicePort, ServiceSpec, Volume, VolumeMount, VolumeResourceRequirements,
    WeightedPodAffinityTerm,
};
use k8s_openapi::api::policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec};
use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::ResourceExt;
use sha2::{Digest, Sha256};

use crate::crd::{DeletionPolicy, ObjectStore, PostgresCluster, Resources, Spread};
use crate::password::Password;

use steward_database_api::contract::{self as instance, BINARY, HTTP_PORT};
pub use steward_database_api::contract::{CLUSTER_LABEL, PRIMARY, REPLICA, ROLE_LABEL};
/// Label on each pod: the PostgreSQL major version of its template.
pub const VERSION_LABEL: &str = "database.steward.dev/version";
/// Annotation on the pod template: hash of the configuration, so a change rolls the pods.
pub const CONFIG_HASH_ANNOTATION: &str = "database.steward.dev/config-hash";
/// Annotation on the StatefulSet: hash of the pod template the operator last applied.
pub const TEMPLATE_HASH_ANNOTATION: &str = "database.steward.dev/template-hash";
/// Label the StatefulSet controller puts on pods: their revision.
pub const REVISION_LABEL: &str = "controller-revision-hash";

pub const PORT: i32 = 5432;
const DATA_DIR: &str = "/var/lib/postgresql/data";
/// The instances' volume claim template: instance `<pod>`'s claim is `data-<pod>`.
pub const DATA_VOLUME: &str = "data";
const CONFIG_DIR: &str = "/etc/steward";
/// The pod's scratch volume: the instance manager's binary (`bin/`, copied by the init
/// container) and its run directory (`run/`: socket, `instance.conf`, passfile).
pub const STEWARD_DIR: &str = "/steward";
/// The volume of `spec.monitoring.queriesConfigMap`.
const QUERIES_VOLUME: &str = "monitoring";
/// Where the pods mount the server certificate Secret (`tls.crt`, `tls.key`, `ca.crt`).
pub const TLS_DIR: &str = "/etc/steward-tls";
/// Annotations on the server certificate Secret: its last valid day and the names it is for.
pub const TLS_NOT_AFTER_ANNOTATION: &str = "database.steward.dev/not-after";
pub const TLS_NAMES_ANNOTATION: &str = "database.steward.dev/issued-for";
/// Where the instance manager's binary is in the operator's image.
pub const INSTANCE_BINARY_IN_IMAGE: &str = "/usr/local/bin/steward-pg-instance";
/// UID/GID of `postgres` in the official images (and in testenv's).
const POSTGRES_UID: i64 = 999;

/// Names of a cluster's children.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Names {
    /// StatefulSet, headless Service (its `serviceName`) and PodDisruptionBudget.
    pub statefulset: String,
    pub headless: String,
    /// Read-write Service: the primary.
    pub rw: String,
    /// Read-only Service: the replicas.
    pub ro: String,
    pub superuser_secret: String,
    /// The replication role's password (`password`), for replicas and `pg_rewind`.
    pub replication_secret: String,
    /// The cluster's CA (`ca.crt`, `ca.key`), generated once.
    pub ca_secret: String,
    /// The server certificate the pods mount (`tls.crt`, `tls.key`, `ca.crt`).
    pub tls_secret: String,
    pub config: String,
    /// The replicas' PodDisruptionBudget.
    pub pdb: String,
    /// The primary's PodDisruptionBudget.
    pub primary_pdb: String,
    /// ServiceAccount, Role and RoleBinding of the instance managers.
    pub instance_account: String,
    /// The Lease whose holder is the primary (taken and renewed by the instance managers).
    pub lease: String,
    /// The first instance: it creates the cluster and the Lease.
    pub first_pod: String,
}

impl Names {
    pub fn of(cluster: &str) -> Self {
        Self {
            statefulset: cluster.to_string(),
            headless: format!("{cluster}-hl"),
            rw: format!("{cluster}-rw"),
            ro: format!("{cluster}-ro"),
            superuser_secret: format!("{cluster}-superuser"),
            replication_secret: format!("{cluster}-replication"),
            ca_secret: format!("{cluster}-ca"),
            tls_secret: format!("{cluster}-tls"),
            config: format!("{cluster}-config"),
            pdb: cluster.to_string(),
            primary_pdb: format!("{cluster}-primary"),
            instance_account: format!("{cluster}-instance"),
            lease: instance::lease_name(cluster),
            first_pod: format!("{cluster}-0"),
        }
    }
}

/// Labels selecting every pod of `cluster`.
pub fn selector_labels(cluster: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("app.kubernetes.io/name".to_string(), "postgres".to_string()),
        (
            "app.kubernetes.io/instance".to_string(),
            cluster.to_string(),
        ),
        (CLUSTER_LABEL.to_string(), cluster.to_string()),
    ])
}

pub(super) fn meta(cluster: &PostgresCluster, name: &str) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.to_string()),
        namespace: cluster.namespace(),
        labels: Some(selector_labels(&cluster.name_any())),
        ..Default::default()
    }
}

/// The image of the cluster's instances.
pub fn image(cluster: &PostgresCluster) -> String {
    cluster
        .spec
        .image
        .clone()
        .unwrap_or_else(|| format!("postgres:{}", cluster.spec.version))
}

fn service(
    cluster: &PostgresCluster,
    name: &str,
    selector: BTreeMap<String, String>,
    headless: bool,
) -> Service {
    Service {
        metadata: meta(cluster, name),
        spec: Some(ServiceSpec {
            type_: Some("ClusterIP".into()),
            cluster_ip: headless.then(|| "None".to_string()),
            // The headless Service resolves pods before they are ready (replicas find the primary).
            publish_not_ready_addresses: headless.then_some(true),
            selector: Some(selector),
            ports: Some(vec![ServicePort {
                name: Some("postgres".into()),
                port: PORT,
                target_port: Some(IntOrString::Int(PORT)),
                protocol: Some("TCP".into()),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The headless Service governing the StatefulSet (stable pod DNS names).
pub fn headless_service(cluster: &PostgresCluster) -> Service {
    let names = Names::of(&cluster.name_any());
    service(
        cluster,
        &names.headless,
        selector_labels(&cluster.name_any()),
        true,
    )
}

/// The read-write Service: the pod labelled `role=primary`.
pub fn rw_service(cluster: &PostgresCluster) -> Service {
    let names = Names::of(&cluster.name_any());
    let mut selector = selector_labels(&cluster.name_any());
    selector.insert(ROLE_LABEL.into(), PRIMARY.into());
    service(cluster, &names.rw, selector, false)
}

/// The read-only Service: the pods labelled `role=replica`.
pub fn ro_service(cluster: &PostgresCluster) -> Service {
    let names = Names::of(&cluster.name_any());
    let mut selector = selector_labels(&cluster.name_any());
    selector.insert(ROLE_LABEL.into(), REPLICA.into());
    service(cluster, &names.ro, selector, false)
}

/// The superuser Secret (`username`, `password`). Under `deletionPolicy: Retain` it is
/// applied without an owner reference, so it outlives the cluster together with the
/// PersistentVolumeClaims whose data it opens (see [`superuser_secret_owned`]).
///
/// `ca.crt` is the cluster's CA, for clients connecting with `sslmode=verify-full` to the
/// Services' names.
pub fn superuser_secret(cluster: &PostgresCluster, password: &Password, ca_pem: &str) -> Secret {
    let names = Names::of(&cluster.name_any());
    Secret {
        metadata: meta(cluster, &names.superuser_secret),
        type_: Some("kubernetes.io/basic-auth".into()),
        data: Some(BTreeMap::from([
            ("username".to_string(), ByteString(b"postgres".to_vec())),
            (
                "password".to_string(),
                ByteString(password.expose().as_bytes().to_vec()),
            ),
            ("ca.crt".to_string(), ByteString(ca_pem.as_bytes().to_vec())),
        ])),
        ..Default::default()
    }
}

/// Annotations on the CA Secret: the signing CA's generation and last day, the rotation's
/// phase and since when, the other CA's last day, the last rotation request handled.
pub const CA_GENERATION_ANNOTATION: &str = "database.steward.dev/ca-generation";
pub const CA_UNTIL_ANNOTATION: &str = "database.steward.dev/ca-not-after";
pub const CA_PHASE_ANNOTATION: &str = "database.steward.dev/ca-phase";
pub const CA_SINCE_ANNOTATION: &str = "database.steward.dev/ca-phase-since";
pub const CA_OTHER_UNTIL_ANNOTATION: &str = "database.steward.dev/ca-other-not-after";
pub const CA_HANDLED_ANNOTATION: &str = "database.steward.dev/ca-rotation-handled";

/// The CA Secret: `ca.crt` (what clients trust: the signing CA, and during a rotation the
/// other one too), `ca.key` and `signing.crt` (the signing CA), and during a rotation
/// `other.crt` and `other.key`; the rest of [`super::tls::Authority`] in annotations.
pub fn ca_secret(cluster: &PostgresCluster, ca: &super::tls::Authority) -> Secret {
    let names = Names::of(&cluster.name_any());
    let bytes = |s: &str| ByteString(s.as_bytes().to_vec());
    let mut data = BTreeMap::from([
        ("ca.crt".to_string(), bytes(&ca.bundle())),
        ("ca.key".to_string(), bytes(&ca.signing.key_pem)),
        ("signing.crt".to_string(), bytes(&ca.signing.cert_pem)),
    ]);
    let mut annotations = BTreeMap::from([
        (
            CA_GENERATION_ANNOTATION.to_string(),
            ca.generation.to_string(),
        ),
        (
            CA_UNTIL_ANNOTATION.to_string(),
            ca.signing_until.to_string(),
        ),
        (
            CA_PHASE_ANNOTATION.to_string(),
            ca.phase.as_str().to_string(),
        ),
        (CA_SINCE_ANNOTATION.to_string(), ca.since.to_rfc3339()),
    ]);
    if let Some((other, until)) = &ca.other {
        data.insert("other.crt".to_string(), bytes(&other.cert_pem));
        data.insert("other.key".to_string(), bytes(&other.key_pem));
        annotations.insert(CA_OTHER_UNTIL_ANNOTATION.to_string(), until.to_string());
    }
    if let Some(handled) = &ca.handled {
        annotations.insert(CA_HANDLED_ANNOTATION.to_string(), handled.clone());
    }
    let mut metadata = meta(cluster, &names.ca_secret);
    metadata.annotations = Some(annotations);
    Secret {
        metadata,
        type_: Some("Opaque".into()),
        data: Some(data),
        ..Default::default()
    }
}

/// The authority a CA Secret holds ([`ca_secret`]); `None` without a CA. A Secret written
/// before rotations existed (`ca.crt` and `ca.key` only) is generation 0, stable since it
/// was created, ending [`super::tls::ca_until`] its creation day.
pub fn authority_of(secret: &Secret) -> Option<super::tls::Authority> {
    use super::tls::{Authority, CaPhase, Issued, ca_until};
    let field = |key: &str| crate::server::secret_text(secret, key);
    let annotation = |key: &str| secret.annotations().get(key).cloned();
    let created = secret
        .metadata
        .creation_timestamp
        .as_ref()
        .and_then(|t| chrono::DateTime::<chrono::Utc>::from_timestamp(t.0.as_second(), 0))
        .unwrap_or_else(chrono::Utc::now);
    let key_pem = field("ca.key")?;
    let cert_pem = field("signing.crt").or_else(|| field("ca.crt"))?;
    let day = |key: &str| annotation(key).and_then(|d| d.parse::<chrono::NaiveDate>().ok());
    let other = match (field("other.crt"), field("other.key")) {
        (Some(cert_pem), Some(key_pem)) => Some((
            Issued { cert_pem, key_pem },
            day(CA_OTHER_UNTIL_ANNOTATION).unwrap_or_else(|| ca_until(created.date_naive())),
        )),
        _ => None,
    };
    let phase = annotation(CA_PHASE_ANNOTATION)
        .and_then(|p| CaPhase::parse(&p))
        .unwrap_or(CaPhase::Stable);
    Some(Authority {
        generation: annotation(CA_GENERATION_ANNOTATION)
            .and_then(|g| g.parse().ok())
            .unwrap_or(0),
        signing: Issued { cert_pem, key_pem },
        signing_until: day(CA_UNTIL_ANNOTATION).unwrap_or_else(|| ca_until(created.date_naive())),
        // A rotation phase without its other CA cannot go on: it is over.
        phase: if other.is_none() {
            CaPhase::Stable
        } else {
            phase
        },
        other,
        since: annotation(CA_SINCE_ANNOTATION)
            .and_then(|s| chrono::DateTime::parse_from_rfc3339(&s).ok())
            .map_or(created, |t| t.with_timezone(&chrono::Utc)),
        handled: annotation(CA_HANDLED_ANNOTATION),
    })
}

/// The server certificate Secret the pods mount, annotated with its last valid day and the
/// names it is for (so the operator renews it without parsing it).
pub fn tls_secret(
    cluster: &PostgresCluster,
    name: &str,
    server: &super::tls::Issued,
    ca_pem: &str,
    not_after: chrono::NaiveDate,
    names_issued: &[String],
) -> Secret {
    let mut metadata = meta(cluster, name);
    metadata.annotations = Some(BTreeMap::from([
        (TLS_NOT_AFTER_ANNOTATION.to_string(), not_after.to_string()),
        (TLS_NAMES_ANNOTATION.to_string(), names_issued.join(",")),
    ]));
    Secret {
        metadata,
        type_: Some("kubernetes.io/tls".into()),
        data: Some(BTreeMap::from([
            (
                "tls.crt".to_string(),
                ByteString(server.cert_pem.as_bytes().to_vec()),
            ),
            (
                "tls.key".to_string(),
                ByteString(server.key_pem.as_bytes().to_vec()),
            ),
            ("ca.crt".to_string(), ByteString(ca_pem.as_bytes().to_vec())),
        ])),
        ..Default::default()
    }
}

/// Whether the superuser Secret carries an owner reference (is deleted with the cluster).
pub fn superuser_secret_owned(cluster: &PostgresCluster) -> bool {
    cluster.spec.deletion_policy == DeletionPolicy::Delete
}

/// The replication role's password. The primary's instance manager sets it on the role
/// whenever it starts leading, so a new Secret (after the cluster was deleted with
/// `Retain` and re-created) works with kept data.
pub fn replication_secret(cluster: &PostgresCluster, password: &Password) -> Secret {
    let names = Names::of(&cluster.name_any());
    Secret {
        metadata: meta(cluster, &names.replication_secret),
        type_: Some("Opaque".into()),
        data: Some(BTreeMap::from([(
            "password".to_string(),
            ByteString(password.expose().as_bytes().to_vec()),
        )])),
        ..Default::default()
    }
}

/// The instance managers' ServiceAccount.
pub fn instance_service_account(cluster: &PostgresCluster) -> ServiceAccount {
    let names = Names::of(&cluster.name_any());
    ServiceAccount {
        metadata: meta(cluster, &names.instance_account),
        ..Default::default()
    }
}

/// What the instance managers may do, and nothing more: take and renew this cluster's
/// Lease, read the cluster's pods and StatefulSet, label/annotate its own pods (by name),
/// read the poolers' acknowledgements, record Events, take PostgresBackups (read them, write
/// their status), read their own PostgresCluster (by name: a standby's leader follows
/// `spec.replica.enabled`).
pub fn instance_role(cluster: &PostgresCluster) -> Role {
    let name = cluster.name_any();
    let names = Names::of(&name);
    let pods: Vec<String> = (0..cluster.spec.instances)
        .map(|i| format!("{name}-{i}"))
        .collect();
    Role {
        metadata: meta(cluster, &names.instance_account),
        rules: Some(vec![
            // `create` cannot be limited to a name.
            rule(&["coordination.k8s.io"], &["leases"], &["create"], None),
            rule(
                &["coordination.k8s.io"],
                &["leases"],
                &["get", "update", "patch", "list", "watch"],
                Some(vec![names.lease.clone()]),
            ),
            rule(&[""], &["pods"], &["get", "list"], None),
            // How many instances the StatefulSet runs: after a whole-cluster stop, whether
            // the last primary is coming back.
            rule(
                &["apps"],
                &["statefulsets"],
                &["get"],
                Some(vec![names.statefulset.clone()]),
            ),
            rule(&[""], &["pods"], &["patch"], Some(pods)),
            // A standby cluster's leader follows its source while `spec.replica.enabled`,
            // and promotes when it turns false: it reads its own cluster, no other.
            rule(
                &[crate::crd::GROUP],
                &[instance::CLUSTER_PLURAL],
                &["get"],
                Some(vec![name.clone()]),
            ),
            // The poolers' acknowledgements of a switchover's pause (`spec.pooler`).
            rule(
                &[""],
                &["configmaps"],
                &["get"],
                Some(vec![instance::pooler::state_config_map(&name)]),
            ),
            rule(&[""], &["events"], &["create", "patch"], None),
            // The primary takes the cluster's PostgresBackups and records them.
            rule(
                &[instance::BACKUP_GROUP],
                &[instance::BACKUP_PLURAL],
                &["get", "list", "watch"],
                None,
            ),
            rule(
                &[instance::BACKUP_GROUP],
                &[&format!("{}/status", instance::BACKUP_PLURAL)],
                &["patch"],
                None,
            ),
        ]),
    }
}

/// An environment variable of a value.
pub(super) fn env(name: &str, value: String) -> EnvVar {
    EnvVar {
        name: name.into(),
        value: Some(value),
        ..Default::default()
    }
}

/// An environment variable of a field of the pod (`metadata.name`, …).
pub(super) fn field(name: &str, path: &str) -> EnvVar {
    EnvVar {
        name: name.into(),
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                field_path: path.into(),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// A probe of `path` on `port`, every `period` seconds, failing after `failures` in a row.
pub(super) fn http_probe(port: u16, path: &str, period: i32, failures: i32) -> Probe {
    Probe {
        http_get: Some(HTTPGetAction {
            path: Some(path.into()),
            port: IntOrString::Int(i32::from(port)),
            ..Default::default()
        }),
        period_seconds: Some(period),
        timeout_seconds: Some(2),
        failure_threshold: Some(failures),
        ..Default::default()
    }
}

/// Binds [`instance_role`] to [`instance_service_account`].
pub fn instance_role_binding(cluster: &PostgresCluster) -> RoleBinding {
    binding(cluster, &Names::of(&cluster.name_any()).instance_account)
}

/// A rule of a Role: `verbs` on `resources` of the API `groups`, only those `names` if given.
pub(super) fn rule(
    groups: &[&str],
    resources: &[&str],
    verbs: &[&str],
    names: Option<Vec<String>>,
) -> PolicyRule {
    PolicyRule {
        api_groups: Some(groups.iter().map(|s| (*s).to_string()).collect()),
        resources: Some(resources.iter().map(|s| (*s).to_string()).collect()),
        verbs: verbs.iter().map(|s| (*s).to_string()).collect(),
        resource_names: names,
        ..Default::default()
    }
}

/// Binds the Role `name` to the ServiceAccount `name`, both of `cluster`'s namespace.
pub(super) fn binding(cluster: &PostgresCluster, name: &str) -> RoleBinding {
    RoleBinding {
        metadata: meta(cluster, name),
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".into()),
            kind: "Role".into(),
            name: name.to_string(),
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".into(),
            name: name.to_string(),
            namespace: cluster.namespace(),
            ..Default::default()
        }]),
    }
}

/// A value quoted for `postgresql.conf` (its own syntax, not SQL's): inside single quotes, a
/// quote is doubled and a backslash is written `\\`, because the configuration file reader
/// processes backslash escapes (`E'…'` is SQL and makes the file unreadable). Control
/// characters cannot be written at all; [`super::validate`] refuses them before anything is
/// rendered (and the schema at admission), so here they only become spaces.
pub fn conf_quote(value: &str) -> String {
    let mut out = String::with_capacity(value.len() + 2);
    out.push('\'');
    for c in value.chars() {
        match c {
            '\'' => out.push_str("''"),
            '\\' => out.push_str("\\\\"),
            c if c.is_control() => out.push(' '),
            c => out.push(c),
        }
    }
    out.push('\'');
    out
}

/// `postgresql.conf` lines for the user's parameters, values quoted as string literals
/// (PostgreSQL accepts any setting quoted).
pub fn render_parameters(
    parameters: &BTreeMap<String, String>,
    synchronous_replicas: Option<i32>,
    archive: bool,
) -> String {
    let mut out =
        String::from("# Managed by database-operator: spec.parameters of the PostgresCluster.\n");
    out.push_str("listen_addresses = '*'\n");
    out.push_str(&format!("port = {PORT}\n"));
    out.push_str(&format!("hba_file = '{CONFIG_DIR}/pg_hba.conf'\n"));
    // TLS for every connection that asks for it; replication only over TLS (pg_hba.conf).
    out.push_str("ssl = on\n");
    out.push_str(&format!("ssl_cert_file = '{TLS_DIR}/tls.crt'\n"));
    out.push_str(&format!("ssl_key_file = '{TLS_DIR}/tls.key'\n"));
    out.push_str(&format!("ssl_ca_file = '{TLS_DIR}/ca.crt'\n"));
    // Replicas that fall behind, and a former primary rewinding, find the WAL they need.
    out.push_str("wal_keep_size = '512MB'\n");
    out.push_str("wal_log_hints = on\n");
    if archive {
        // Every finished WAL file goes to spec.backup's object store; at least every five
        // minutes, so an idle cluster's last writes are recoverable (a parameter may
        // change archive_timeout).
        out.push_str("archive_mode = on\n");
        out.push_str(&format!(
            "archive_command = '{STEWARD_DIR}/bin/{BINARY} wal-push %p %f'\n"
        ));
        out.push_str("archive_timeout = '5min'\n");
    }
    // The instance manager's defaults for the major its image runs (reserved_connections
    // from 16 on), before the user's parameters so that they may override them.
    out.push_str(&format!(
        "include_if_exists = '{STEWARD_DIR}/run/defaults.conf'\n"
    ));
    for (k, v) in parameters {
        // The schema and validation restrict keys and refuse control characters in values.
        out.push_str(&format!("{k} = {}\n", conf_quote(v)));
    }
    // Only the primary applies it; any replica (application_name = its pod) counts.
    if let Some(n) = synchronous_replicas {
        out.push_str(&format!("synchronous_standby_names = 'ANY {n} (*)'\n"));
    }
    // Last, so the role's settings (primary_conninfo) win: written by the instance manager.
    out.push_str(&format!(
        "include_if_exists = '{STEWARD_DIR}/run/instance.conf'\n"
    ));
    out
}

const PG_HBA: &str = "\
# Managed by database-operator.
local   all             all                                     trust
local   replication     postgres                                trust
host    all             all             127.0.0.1/32            scram-sha-256
host    all             all             ::1/128                 scram-sha-256
hostssl replication     steward_replication 0.0.0.0/0           scram-sha-256
hostssl replication     steward_replication ::/0                scram-sha-256
hostnossl all           steward_replication 0.0.0.0/0           reject
hostnossl all           steward_replication ::/0                reject
host    all             all             0.0.0.0/0               scram-sha-256
host    all             all             ::/0                    scram-sha-256
";

/// The ConfigMap with `postgresql.conf` (parameters) and `pg_hba.conf`.
pub fn config_map(cluster: &PostgresCluster) -> ConfigMap {
    let names = Names::of(&cluster.name_any());
    ConfigMap {
        metadata: meta(cluster, &names.config),
        data: Some(BTreeMap::from([
            (
                "postgresql.conf".to_string(),
                render_parameters(
                    &cluster.spec.parameters,
                    cluster.spec.synchronous_replicas,
                    cluster.spec.backup.is_some(),
                ),
            ),
            ("pg_hba.conf".to_string(), PG_HBA.to_string()),
        ])),
        ..Default::default()
    }
}

/// The environment naming the object stores of `spec.backup` (archiving, base backups,
/// retention), `spec.bootstrap.recovery` (the backup a new cluster restores) and
/// `spec.replica.source` (the cluster a standby follows), credentials from their Secrets.
/// `spec.replica.enabled` is not in it: the instance managers read it from the cluster, so a
/// promotion rolls no pod.
pub fn backup_env(cluster: &PostgresCluster) -> Vec<EnvVar> {
    let store = |prefix: &str, store: &ObjectStore| -> Vec<EnvVar> {
        let var = |field: &str, value: &str| EnvVar {
            name: instance::store_env(prefix, field),
            value: Some(value.to_string()),
            ..Default::default()
        };
        let secret = |field: &str, key: &str| EnvVar {
            name: instance::store_env(prefix, field),
            value_from: Some(EnvVarSource {
                secret_key_ref: Some(SecretKeySelector {
                    name: store.credentials_secret.clone(),
                    key: key.into(),
                    optional: Some(false),
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        vec![
            var("ENDPOINT", &store.endpoint),
            var("BUCKET", &store.bucket),
            var("PATH", &store.path),
            var("REGION", store.region.as_deref().unwrap_or("us-east-1")),
            secret("ACCESS_KEY_ID", "accessKeyId"),
            secret("SECRET_ACCESS_KEY", "secretAccessKey"),
        ]
    };
    let mut env = Vec::new();
    if let Some(backup) = &cluster.spec.backup {
        env.extend(store(instance::BACKUP_ENV, &backup.object_store));
        if let Some(keep) = backup.keep {
            env.push(EnvVar {
                name: instance::BACKUP_KEEP_ENV.into(),
                value: Some(keep.to_string()),
                ..Default::default()
            });
        }
    }
    if let Some(bootstrap) = &cluster.spec.bootstrap {
        let recovery = &bootstrap.recovery;
        env.extend(store(instance::RECOVERY_ENV, &recovery.object_store));
        if let Some(t) = &recovery.target_time {
            env.push(EnvVar {
                name: instance::RECOVERY_TARGET_TIME_ENV.into(),
                value: Some(t.clone()),
                ..Default::default()
            });
        }
    }
    if let Some(replica) = &cluster.spec.replica {
        env.extend(store(instance::REPLICA_SOURCE_ENV, &replica.source));
    }
    env
}

/// Hash of a ConfigMap's data (on the pod template, so a change rolls the pods).
pub fn config_hash(config: &ConfigMap) -> String {
    let mut hash = Sha256::new();
    for (k, v) in config.data.iter().flatten() {
        hash.update(k.as_bytes());
        hash.update([0]);
        hash.update(v.as_bytes());
        hash.update([0]);
    }
    hex::encode(&hash.finalize()[..8])
}

/// At most one instance voluntarily down at a time, among the replicas (every instance but the
/// primary, which [`primary_disruption_budget`] covers: a pod under two budgets cannot be
/// evicted at all). `minAvailable` as a number of pods: a `maxUnavailable` budget counts the
/// StatefulSet's replicas as expected, every instance, not the pods it selects.
pub fn pod_disruption_budget(cluster: &PostgresCluster) -> PodDisruptionBudget {
    let names = Names::of(&cluster.name_any());
    let replicas = (cluster.spec.instances - 1).max(0);
    disruption_budget(cluster, &names.pdb, "NotIn", (replicas - 1).max(0))
}

/// The primary is not evicted while it is the primary: with more than one instance, a drain
/// of its node waits until the operator has switched over to a replica on another node
/// ([`super::drain`]); a single instance may be evicted (there is nothing to switch to).
pub fn primary_disruption_budget(cluster: &PostgresCluster) -> PodDisruptionBudget {
    let names = Names::of(&cluster.name_any());
    let min_available = i32::from(cluster.spec.instances > 1);
    disruption_budget(cluster, &names.primary_pdb, "In", min_available)
}

/// A budget keeping `min_available` of the cluster's pods whose role label is (`In`) or is
/// not (`NotIn`) [`PRIMARY`].
fn disruption_budget(
    cluster: &PostgresCluster,
    name: &str,
    operator: &str,
    min_available: i32,
) -> PodDisruptionBudget {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement;
    PodDisruptionBudget {
        metadata: meta(cluster, name),
        spec: Some(PodDisruptionBudgetSpec {
            min_available: Some(IntOrString::Int(min_available)),
            selector: Some(LabelSelector {
                match_labels: Some(selector_labels(&cluster.name_any())),
                match_expressions: Some(vec![LabelSelectorRequirement {
                    key: ROLE_LABEL.into(),
                    operator: operator.into(),
                    values: Some(vec![PRIMARY.into()]),
                }]),
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The instances' spread ([`crate::crd::Placement`], by default preferred over nodes): each
/// instance avoids the domains of `topologyKey` where another instance of the cluster runs.
pub fn affinity(cluster: &PostgresCluster) -> Option<Affinity> {
    let placement = cluster.spec.placement.clone().unwrap_or_default();
    let term = PodAffinityTerm {
        topology_key: placement.topology_key().to_string(),
        label_selector: Some(LabelSelector {
            match_labels: Some(selector_labels(&cluster.name_any())),
            ..Default::default()
        }),
        ..Default::default()
    };
    let anti = match placement.spread {
        Spread::None => return None,
        Spread::Preferred => PodAntiAffinity {
            preferred_during_scheduling_ignored_during_execution: Some(vec![
                WeightedPodAffinityTerm {
                    weight: 100,
                    pod_affinity_term: term,
                },
            ]),
            ..Default::default()
        },
        Spread::Required => PodAntiAffinity {
            required_during_scheduling_ignored_during_execution: Some(vec![term]),
            ..Default::default()
        },
    };
    Some(Affinity {
        pod_anti_affinity: Some(anti),
        ..Default::default()
    })
}

/// The StatefulSet: `instances` pods, OrderedReady, updated `OnDelete`: the operator replaces
/// pods itself, replicas first and the primary after a switchover
/// ([`super::rollout::next_step`]).
///
/// Each pod runs `steward-pg-instance` as PID 1 of its PostgreSQL container: an init
/// container copies it from `instance_image` (the operator's image) into the pod's scratch
/// volume, so the PostgreSQL image needs nothing of Steward's.
pub fn statefulset(
    cluster: &PostgresCluster,
    config_hash: &str,
    instance_image: &str,
) -> StatefulSet {
    let name = cluster.name_any();
    let names = Names::of(&name);
    let mut pod_labels = selector_labels(&name);
    pod_labels.insert(VERSION_LABEL.into(), cluster.spec.version.to_string());
    let when = match cluster.spec.deletion_policy {
        DeletionPolicy::Retain => "Retain",
        DeletionPolicy::Delete => "Delete",
    };
    StatefulSet {
        metadata: meta(cluster, &names.statefulset),
        spec: StatefulSetSpec {
            replicas: Some(cluster.spec.instances),
            service_name: Some(names.headless.clone()),
            pod_management_policy: Some("OrderedReady".into()),
            selector: LabelSelector {
                match_labels: Some(selector_labels(&name)),
                ..Default::default()
            },
            update_strategy: Some(StatefulSetUpdateStrategy {
                type_: Some("OnDelete".into()),
                rolling_update: None,
            }),
            persistent_volume_claim_retention_policy: Some(
                StatefulSetPersistentVolumeClaimRetentionPolicy {
                    when_deleted: Some(when.into()),
                    when_scaled: Some("Retain".into()),
                },
            ),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(pod_labels),
                    annotations: Some(BTreeMap::from([(
                        CONFIG_HASH_ANNOTATION.to_string(),
                        config_hash.to_string(),
                    )])),
                    ..Default::default()
                }),
                spec: Some(PodSpec {
                    affinity: affinity(cluster),
                    init_containers: Some(vec![copier(
                        cluster,
                        "instance-manager",
                        instance_image,
                        INSTANCE_BINARY_IN_IMAGE,
                    )]),
                    containers: vec![postgres_container(cluster, &names)],
                    service_account_name: Some(names.instance_account.clone()),
                    security_context: Some(PodSecurityContext {
                        run_as_user: Some(POSTGRES_UID),
                        run_as_group: Some(POSTGRES_UID),
                        fs_group: Some(POSTGRES_UID),
                        run_as_non_root: Some(true),
                        ..Default::default()
                    }),
                    termination_grace_period_seconds: Some(60),
                    volumes: Some(pod_volumes(cluster, &names)),
                    ..Default::default()
                }),
            },
            volume_claim_templates: Some(vec![data_claim(cluster)]),
            ..Default::default()
        },
        ..Default::default()
    }
}

/// The ConfigMap of `spec.monitoring.queriesConfigMap`, if any.
fn queries_config_map(cluster: &PostgresCluster) -> Option<String> {
    cluster
        .spec
        .monitoring
        .as_ref()
        .and_then(|m| m.queries_config_map.clone())
}

/// The mount of the pod's scratch volume ([`scratch_volume`]), where Steward's binary is
/// copied to and runs from.
pub(super) fn steward_mount() -> VolumeMount {
    VolumeMount {
        name: "steward".into(),
        mount_path: STEWARD_DIR.into(),
        ..Default::default()
    }
}

/// The pod's scratch volume (an emptyDir): Steward's binary, its run directory.
pub(super) fn scratch_volume() -> Volume {
    Volume {
        name: "steward".into(),
        empty_dir: Some(EmptyDirVolumeSource::default()),
        ..Default::default()
    }
}

/// A read-only mount of volume `name` at `path`.
pub(super) fn read_only_mount(name: &str, path: &str) -> VolumeMount {
    VolumeMount {
        name: name.into(),
        mount_path: path.into(),
        read_only: Some(true),
        ..Default::default()
    }
}

/// A named TCP port of a container.
pub(super) fn tcp_port(name: &str, port: i32) -> ContainerPort {
    ContainerPort {
        name: Some(name.into()),
        container_port: port,
        protocol: Some("TCP".into()),
        ..Default::default()
    }
}

/// The cluster's `spec.imagePullPolicy`, for every container of its pods.
pub(super) fn pull_policy(cluster: &PostgresCluster) -> Option<String> {
    cluster
        .spec
        .image_pull_policy
        .map(|p| p.as_str().to_string())
}

/// An init container `name` that copies Steward's `binary` (its path in `image`, the
/// operator's image) into the scratch volume, where the pod's main container runs it from.
pub(super) fn copier(
    cluster: &PostgresCluster,
    name: &str,
    image: &str,
    binary: &str,
) -> Container {
    Container {
        name: name.into(),
        image: Some(image.to_string()),
        image_pull_policy: pull_policy(cluster),
        command: Some(vec![
            binary.into(),
            "copy".into(),
            format!("{STEWARD_DIR}/bin"),
        ]),
        volume_mounts: Some(vec![steward_mount()]),
        ..Default::default()
    }
}

/// The PostgreSQL container, its instance manager as PID 1: ready when PostgreSQL serves the
/// role the Lease gives it, live while the instance manager answers.
fn postgres_container(cluster: &PostgresCluster, names: &Names) -> Container {
    let secret = |name: &str, secret: &str| EnvVar {
        name: name.into(),
        value_from: Some(EnvVarSource {
            secret_key_ref: Some(SecretKeySelector {
                name: secret.into(),
                key: "password".into(),
                optional: Some(false),
            }),
            ..Default::default()
        }),
        ..Default::default()
    };
    let http_probe =
        |path: &str, period: i32, failures: i32| http_probe(HTTP_PORT, path, period, failures);
    Container {
        name: "postgres".into(),
        image: Some(image(cluster)),
        image_pull_policy: pull_policy(cluster),
        command: Some(vec![format!("{STEWARD_DIR}/bin/{BINARY}"), "run".into()]),
        env: Some(
            vec![
                field("POD_NAME", "metadata.name"),
                field("POD_NAMESPACE", "metadata.namespace"),
                env("CLUSTER_NAME", cluster.name_any()),
                secret("POSTGRES_PASSWORD", &names.superuser_secret),
                secret("REPLICATION_PASSWORD", &names.replication_secret),
                env("PGDATA", format!("{DATA_DIR}/pgdata")),
                env("PG_CONFIG_FILE", format!("{CONFIG_DIR}/postgresql.conf")),
                env("STEWARD_RUN_DIR", format!("{STEWARD_DIR}/run")),
                env("PG_TLS_DIR", TLS_DIR.to_string()),
            ]
            .into_iter()
            .chain(backup_env(cluster))
            .collect(),
        ),
        ports: Some(vec![
            tcp_port("postgres", PORT),
            tcp_port("instance", i32::from(HTTP_PORT)),
        ]),
        // Ready: PostgreSQL serves the role the Lease gives this instance.
        readiness_probe: Some(http_probe("/readyz", 1, 2)),
        // Live: the instance manager answers (a paused one does not).
        liveness_probe: Some(http_probe("/healthz", 5, 3)),
        resources: cluster
            .spec
            .resources
            .as_ref()
            .map(Resources::to_requirements),
        volume_mounts: Some(postgres_mounts(cluster)),
        ..Default::default()
    }
}

/// Where the PostgreSQL container mounts its data, configuration, scratch, TLS and (with
/// `spec.monitoring.queriesConfigMap`) metrics queries volumes.
fn postgres_mounts(cluster: &PostgresCluster) -> Vec<VolumeMount> {
    vec![
        VolumeMount {
            name: DATA_VOLUME.into(),
            mount_path: DATA_DIR.into(),
            ..Default::default()
        },
        read_only_mount("config", CONFIG_DIR),
        steward_mount(),
        read_only_mount("tls", TLS_DIR),
    ]
    .into_iter()
    .chain(queries_config_map(cluster).is_some().then(|| {
        read_only_mount(
            QUERIES_VOLUME,
            steward_database_api::monitoring::QUERIES_DIR,
        )
    }))
    .collect()
}

/// The pod's volumes but the data: the configuration, the scratch volume, TLS and the optional
/// metrics queries.
fn pod_volumes(cluster: &PostgresCluster, names: &Names) -> Vec<Volume> {
    vec![
        Volume {
            name: "config".into(),
            config_map: Some(ConfigMapVolumeSource {
                name: names.config.clone(),
                default_mode: Some(0o444),
                ..Default::default()
            }),
            ..Default::default()
        },
        scratch_volume(),
        // Root-owned, group postgres (fsGroup), 0640: what PostgreSQL accepts for a key file
        // it does not own.
        Volume {
            name: "tls".into(),
            secret: Some(SecretVolumeSource {
                secret_name: Some(names.tls_secret.clone()),
                default_mode: Some(0o640),
                ..Default::default()
            }),
            ..Default::default()
        },
    ]
    .into_iter()
    // Optional: a missing ConfigMap must not keep PostgreSQL from starting (the condition
    // MetricsQueries says it is missing).
    .chain(queries_config_map(cluster).map(|name| Volume {
        name: QUERIES_VOLUME.into(),
        config_map: Some(ConfigMapVolumeSource {
            name,
            optional: Some(true),
            default_mode: Some(0o444),
            ..Default::default()
        }),
        ..Default::default()
    }))
    .collect()
}

/// Each instance's data volume: `spec.storage`, ReadWriteOnce.
fn data_claim(cluster: &PostgresCluster) -> PersistentVolumeClaim {
    PersistentVolumeClaim {
        metadata: ObjectMeta {
            name: Some(DATA_VOLUME.into()),
            labels: Some(selector_labels(&cluster.name_any())),
            ..Default::default()
        },
        spec: Some(PersistentVolumeClaimSpec {
            access_modes: Some(vec!["ReadWriteOnce".into()]),
            storage_class_name: cluster.spec.storage.storage_class_name.clone(),
            resources: Some(VolumeResourceRequirements {
                requests: Some(BTreeMap::from([(
                    "storage".to_string(),
                    cluster.spec.storage.size.clone(),
                )])),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// What the instance manager of `pod` reports of itself ([`instance::STATUS_ANNOTATION`]),
/// if it published anything readable.
pub fn instance_report(pod: &k8s_openapi::api::core::v1::Pod) -> Option<instance::InstanceStatus> {
    serde_json::from_str(pod.annotations().get(instance::STATUS_ANNOTATION)?).ok()
}

/// The state an instance manager published on `pod`, if any.
pub fn instance_state(pod: &k8s_openapi::api::core::v1::Pod) -> Option<crate::crd::InstanceState> {
    let report = instance_report(pod)?;
    let ready = instance::pod_ready(pod);
    Some(crate::crd::InstanceState {
        name: pod.name_any(),
        role: match report.role {
            instance::Role::Primary => PRIMARY,
            instance::Role::Replica => REPLICA,
            instance::Role::Down => "down",
        }
        .to_string(),
        timeline: report.timeline,
        lsn: report.lsn.to_string(),
        replay_lag_bytes: report.replay_lag,
        ready,
        commits_waiting: report.commits_waiting,
        problem: report.problem,
    })
}

/// Hash of a StatefulSet's pod template (whether the template changed since the last apply).
pub fn template_hash(sts: &StatefulSet) -> String {
    let template = serde_json::to_vec(&sts.spec.template).unwrap_or_default();
    hex::encode(&Sha256::digest(template)[..8])
}
