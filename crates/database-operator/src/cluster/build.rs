//! The children of a [`PostgresCluster`], built without touching the API server.

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::apps::v1::{
    RollingUpdateStatefulSetStrategy, StatefulSet, StatefulSetPersistentVolumeClaimRetentionPolicy,
    StatefulSetSpec, StatefulSetUpdateStrategy,
};
use k8s_openapi::api::core::v1::{
    ConfigMap, ConfigMapVolumeSource, Container, ContainerPort, EnvVar, EnvVarSource, ExecAction,
    ObjectFieldSelector, PersistentVolumeClaim, PersistentVolumeClaimSpec, PodSecurityContext,
    PodSpec, PodTemplateSpec, Probe, Secret, SecretKeySelector, Service, ServicePort, ServiceSpec,
    Volume, VolumeMount, VolumeResourceRequirements,
};
use k8s_openapi::api::policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::ResourceExt;
use sha2::{Digest, Sha256};

use crate::api::{DeletionPolicy, PostgresCluster, Resources};
use crate::password::Password;

/// Label on every pod of a cluster: the cluster's name.
pub const CLUSTER_LABEL: &str = "database.steward.dev/cluster";
/// Label the operator sets on each pod: `primary` or `replica`.
pub const ROLE_LABEL: &str = "database.steward.dev/role";
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
const CONFIG_DIR: &str = "/etc/steward";
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
    pub config: String,
    pub pdb: String,
    /// The primary's pod (ordinal 0).
    pub primary_pod: String,
}

impl Names {
    pub fn of(cluster: &str) -> Self {
        Self {
            statefulset: cluster.to_string(),
            headless: format!("{cluster}-hl"),
            rw: format!("{cluster}-rw"),
            ro: format!("{cluster}-ro"),
            superuser_secret: format!("{cluster}-superuser"),
            config: format!("{cluster}-config"),
            pdb: cluster.to_string(),
            primary_pod: format!("{cluster}-0"),
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

fn meta(cluster: &PostgresCluster, name: &str) -> ObjectMeta {
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
    selector.insert(ROLE_LABEL.into(), "primary".into());
    service(cluster, &names.rw, selector, false)
}

/// The read-only Service: the pods labelled `role=replica`.
pub fn ro_service(cluster: &PostgresCluster) -> Service {
    let names = Names::of(&cluster.name_any());
    let mut selector = selector_labels(&cluster.name_any());
    selector.insert(ROLE_LABEL.into(), "replica".into());
    service(cluster, &names.ro, selector, false)
}

/// The superuser Secret (`username`, `password`). Under `deletionPolicy: Retain` it is
/// applied without an owner reference, so it outlives the cluster together with the
/// PersistentVolumeClaims whose data it opens (see [`superuser_secret_owned`]).
pub fn superuser_secret(cluster: &PostgresCluster, password: &Password) -> Secret {
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
        ])),
        ..Default::default()
    }
}

/// Whether the superuser Secret carries an owner reference (is deleted with the cluster).
pub fn superuser_secret_owned(cluster: &PostgresCluster) -> bool {
    cluster.spec.deletion_policy == DeletionPolicy::Delete
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
pub fn render_parameters(parameters: &BTreeMap<String, String>) -> String {
    let mut out =
        String::from("# Managed by database-operator: spec.parameters of the PostgresCluster.\n");
    out.push_str("listen_addresses = '*'\n");
    out.push_str(&format!("port = {PORT}\n"));
    out.push_str(&format!("hba_file = '{CONFIG_DIR}/pg_hba.conf'\n"));
    for (k, v) in parameters {
        // The schema and validation restrict keys and refuse control characters in values.
        out.push_str(&format!("{k} = {}\n", conf_quote(v)));
    }
    out
}

const PG_HBA: &str = "\
# Managed by database-operator.
local   all             all                                     trust
host    all             all             127.0.0.1/32            scram-sha-256
host    all             all             ::1/128                 scram-sha-256
host    replication     all             0.0.0.0/0               scram-sha-256
host    replication     all             ::/0                    scram-sha-256
host    all             all             0.0.0.0/0               scram-sha-256
host    all             all             ::/0                    scram-sha-256
";

/// Starts an instance, in POSIX `sh` (stock images and the test images, whose shell is
/// busybox's): on first start ordinal 0 initializes the data directory (`initdb`, the
/// superuser's password from `POSTGRES_PASSWORD`) and runs as the primary; the others clone
/// the primary with `pg_basebackup -R` and run as streaming replicas. Then `postgres` with
/// `postgresql.conf` from the ConfigMap (the data directory comes from `PGDATA`). It needs
/// only `initdb`, `pg_isready`, `pg_basebackup` and `postgres` on `PATH`, no image's own
/// entrypoint.
const BOOTSTRAP: &str = r#"#!/bin/sh
# Managed by database-operator.
set -eu
ordinal="${POD_NAME##*-}"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  if [ "$ordinal" = "0" ]; then
    echo "initializing $PGDATA"
    pwfile="$(mktemp)"
    printf '%s\n' "$POSTGRES_PASSWORD" > "$pwfile"
    initdb -D "$PGDATA" -U postgres --pwfile="$pwfile" -E UTF8 --locale=C \
      --auth-local=trust --auth-host=scram-sha-256
    rm -f "$pwfile"
  else
    export PGPASSWORD="$POSTGRES_PASSWORD"
    until pg_isready -q -h "$PRIMARY_HOST" -p 5432; do echo "waiting for the primary $PRIMARY_HOST"; sleep 2; done
    mkdir -p "$PGDATA" && chmod 0700 "$PGDATA"
    until pg_basebackup -h "$PRIMARY_HOST" -p 5432 -U postgres -D "$PGDATA" -R -X stream -c fast; do
      echo "pg_basebackup failed; retrying"; rm -rf "${PGDATA:?}"/* "${PGDATA:?}"/.[!.]* 2>/dev/null || true; sleep 5
    done
    unset PGPASSWORD
  fi
fi
if [ -n "${PG_MAJOR:-}" ] && [ "$(cat "$PGDATA/PG_VERSION")" != "$PG_MAJOR" ]; then
  echo "data directory is PostgreSQL $(cat "$PGDATA/PG_VERSION"), image is $PG_MAJOR: a major upgrade needs pg_upgrade, which this image does not run" >&2
fi
exec postgres -c "config_file=/etc/steward/postgresql.conf"
"#;

/// The ConfigMap with `postgresql.conf` (parameters), `pg_hba.conf` and `bootstrap.sh`.
pub fn config_map(cluster: &PostgresCluster) -> ConfigMap {
    let names = Names::of(&cluster.name_any());
    ConfigMap {
        metadata: meta(cluster, &names.config),
        data: Some(BTreeMap::from([
            (
                "postgresql.conf".to_string(),
                render_parameters(&cluster.spec.parameters),
            ),
            ("pg_hba.conf".to_string(), PG_HBA.to_string()),
            ("bootstrap.sh".to_string(), BOOTSTRAP.to_string()),
        ])),
        ..Default::default()
    }
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

/// At most one instance voluntarily down at a time.
pub fn pod_disruption_budget(cluster: &PostgresCluster) -> PodDisruptionBudget {
    let names = Names::of(&cluster.name_any());
    PodDisruptionBudget {
        metadata: meta(cluster, &names.pdb),
        spec: Some(PodDisruptionBudgetSpec {
            max_unavailable: Some(IntOrString::Int(1)),
            selector: Some(LabelSelector {
                match_labels: Some(selector_labels(&cluster.name_any())),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The StatefulSet: `instances` pods, OrderedReady, rolling updates gated by `partition`
/// (pods with an ordinal ≥ partition run the new template).
pub fn statefulset(cluster: &PostgresCluster, config_hash: &str, partition: i32) -> StatefulSet {
    let name = cluster.name_any();
    let names = Names::of(&name);
    let mut pod_labels = selector_labels(&name);
    pod_labels.insert(VERSION_LABEL.into(), cluster.spec.version.to_string());
    let env = |name: &str, value: String| EnvVar {
        name: name.into(),
        value: Some(value),
        ..Default::default()
    };
    let container = Container {
        name: "postgres".into(),
        image: Some(image(cluster)),
        image_pull_policy: cluster
            .spec
            .image_pull_policy
            .map(|p| p.as_str().to_string()),
        command: Some(vec!["/bin/sh".into(), format!("{CONFIG_DIR}/bootstrap.sh")]),
        env: Some(vec![
            EnvVar {
                name: "POD_NAME".into(),
                value_from: Some(EnvVarSource {
                    field_ref: Some(ObjectFieldSelector {
                        field_path: "metadata.name".into(),
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            },
            env("POSTGRES_USER", "postgres".into()),
            EnvVar {
                name: "POSTGRES_PASSWORD".into(),
                value_from: Some(EnvVarSource {
                    secret_key_ref: Some(SecretKeySelector {
                        name: names.superuser_secret.clone(),
                        key: "password".into(),
                        optional: Some(false),
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            },
            env("PGDATA", format!("{DATA_DIR}/pgdata")),
            env(
                "PRIMARY_HOST",
                format!("{}.{}", names.primary_pod, names.headless),
            ),
        ]),
        ports: Some(vec![ContainerPort {
            name: Some("postgres".into()),
            container_port: PORT,
            protocol: Some("TCP".into()),
            ..Default::default()
        }]),
        readiness_probe: Some(Probe {
            exec: Some(ExecAction {
                command: Some(vec![
                    "pg_isready".into(),
                    "-q".into(),
                    "-h".into(),
                    "127.0.0.1".into(),
                    "-U".into(),
                    "postgres".into(),
                ]),
            }),
            period_seconds: Some(5),
            failure_threshold: Some(3),
            ..Default::default()
        }),
        resources: cluster
            .spec
            .resources
            .as_ref()
            .map(Resources::to_requirements),
        volume_mounts: Some(vec![
            VolumeMount {
                name: "data".into(),
                mount_path: DATA_DIR.into(),
                ..Default::default()
            },
            VolumeMount {
                name: "config".into(),
                mount_path: CONFIG_DIR.into(),
                read_only: Some(true),
                ..Default::default()
            },
        ]),
        ..Default::default()
    };
    let claim = PersistentVolumeClaim {
        metadata: ObjectMeta {
            name: Some("data".into()),
            labels: Some(selector_labels(&name)),
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
    };
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
                type_: Some("RollingUpdate".into()),
                rolling_update: Some(RollingUpdateStatefulSetStrategy {
                    partition: Some(partition),
                    max_unavailable: None,
                }),
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
                    containers: vec![container],
                    security_context: Some(PodSecurityContext {
                        run_as_user: Some(POSTGRES_UID),
                        run_as_group: Some(POSTGRES_UID),
                        fs_group: Some(POSTGRES_UID),
                        run_as_non_root: Some(true),
                        ..Default::default()
                    }),
                    termination_grace_period_seconds: Some(60),
                    volumes: Some(vec![Volume {
                        name: "config".into(),
                        config_map: Some(ConfigMapVolumeSource {
                            name: names.config.clone(),
                            default_mode: Some(0o555),
                            ..Default::default()
                        }),
                        ..Default::default()
                    }]),
                    ..Default::default()
                }),
            },
            volume_claim_templates: Some(vec![claim]),
            ..Default::default()
        },
        ..Default::default()
    }
}

/// Hash of a StatefulSet's pod template (whether the template changed since the last apply).
pub fn template_hash(sts: &StatefulSet) -> String {
    let template = serde_json::to_vec(&sts.spec.template).unwrap_or_default();
    hex::encode(&Sha256::digest(template)[..8])
}
