//! The pre-delete dump: a Job running `pg_dump` into a PersistentVolumeClaim that outlives
//! the Database (it has no owner reference).

use std::collections::BTreeMap;

use k8s_openapi::api::batch::v1::{Job, JobSpec};
use k8s_openapi::api::core::v1::{
    Container, EnvVar, EnvVarSource, KeyToPath, PersistentVolumeClaim, PersistentVolumeClaimSpec,
    PersistentVolumeClaimVolumeSource, PodSecurityContext, PodSpec, PodTemplateSpec,
    SecretKeySelector, SecretVolumeSource, Volume, VolumeMount, VolumeResourceRequirements,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::ResourceExt;

use crate::crd::{BackupStatus, Database};
use crate::pg::Server;
use crate::server::{admin_secret_of, sslmode_str};

/// Label on the dump's Job and claim: the Database's name.
pub const DATABASE_LABEL: &str = "database.steward.dev/database";

/// Name of the Job and the claim of `db`'s dump: `<name>-backup-<uid prefix>` (at most 63
/// characters, unique per Database object).
pub fn name(db: &Database) -> String {
    let base: String = db.name_any().chars().take(40).collect();
    let uid: String = db
        .uid()
        .unwrap_or_default()
        .chars()
        .filter(|c| c.is_ascii_alphanumeric())
        .take(8)
        .collect();
    format!("{}-backup-{uid}", base.trim_end_matches('-'))
}

/// The dump's file name: `<dbname>-<deletion time>.dump` (stable across reconciles).
pub fn file_name(db: &Database) -> String {
    let when = db
        .metadata
        .deletion_timestamp
        .as_ref()
        .map(|t| t.0.strftime("%Y%m%dT%H%M%SZ").to_string())
        .unwrap_or_else(|| "undated".into());
    format!("{}-{when}.dump", db.spec.name)
}

fn labels(db: &Database) -> BTreeMap<String, String> {
    BTreeMap::from([(DATABASE_LABEL.to_string(), db.name_any())])
}

/// The claim the dump is written to.
pub fn claim(db: &Database) -> PersistentVolumeClaim {
    let spec = db.spec.backup.as_ref();
    let size = spec
        .and_then(|b| b.storage_size.clone())
        .unwrap_or_else(|| Quantity("1Gi".into()));
    PersistentVolumeClaim {
        metadata: ObjectMeta {
            name: Some(name(db)),
            namespace: db.namespace(),
            labels: Some(labels(db)),
            ..Default::default()
        },
        spec: Some(PersistentVolumeClaimSpec {
            access_modes: Some(vec!["ReadWriteOnce".into()]),
            storage_class_name: spec.and_then(|b| b.storage_class_name.clone()),
            resources: Some(VolumeResourceRequirements {
                requests: Some(BTreeMap::from([("storage".to_string(), size)])),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Where the dump's container finds the server's CA (`ca.crt` of the admin Secret).
const CA_DIR: &str = "/etc/steward-ca";

/// The Job running `pg_dump --format=custom` as the admin (credentials from the admin Secret,
/// never inline). When the server's CA is known it verifies the server as the operator does
/// (the admin Secret's `ca.crt`, mounted, as `PGSSLROOTCERT`).
pub fn job(db: &Database, server: &Server, default_image: &str) -> Job {
    let image = db
        .spec
        .backup
        .as_ref()
        .and_then(|b| b.image.clone())
        .unwrap_or_else(|| default_image.to_string());
    let (secret, user_key, password_key) = admin_secret_of(&db.spec).unwrap_or_default();
    let env = |name: &str, value: String| EnvVar {
        name: name.into(),
        value: Some(value),
        ..Default::default()
    };
    let from_secret = |name: &str, key: String| EnvVar {
        name: name.into(),
        value_from: Some(EnvVarSource {
            secret_key_ref: Some(SecretKeySelector {
                name: secret.clone(),
                key,
                optional: Some(false),
            }),
            ..Default::default()
        }),
        ..Default::default()
    };
    let mut envs = vec![
        env("PGHOST", server.host.clone()),
        env("PGPORT", server.port.to_string()),
        from_secret("PGUSER", user_key),
        from_secret("PGPASSWORD", password_key),
        env("PGSSLMODE", sslmode_str(server.ssl_mode).into()),
        env("PGCONNECT_TIMEOUT", "10".into()),
    ];
    let mut mounts = vec![VolumeMount {
        name: "backup".into(),
        mount_path: "/backup".into(),
        ..Default::default()
    }];
    let mut volumes = vec![Volume {
        name: "backup".into(),
        persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
            claim_name: name(db),
            read_only: Some(false),
        }),
        ..Default::default()
    }];
    if server.ca_pem.is_some() {
        envs.push(env("PGSSLROOTCERT", format!("{CA_DIR}/ca.crt")));
        mounts.push(VolumeMount {
            name: "ca".into(),
            mount_path: CA_DIR.into(),
            read_only: Some(true),
            ..Default::default()
        });
        volumes.push(Volume {
            name: "ca".into(),
            secret: Some(SecretVolumeSource {
                secret_name: Some(secret.clone()),
                items: Some(vec![KeyToPath {
                    key: "ca.crt".into(),
                    path: "ca.crt".into(),
                    ..Default::default()
                }]),
                ..Default::default()
            }),
            ..Default::default()
        });
    }
    Job {
        metadata: ObjectMeta {
            name: Some(name(db)),
            namespace: db.namespace(),
            labels: Some(labels(db)),
            ..Default::default()
        },
        spec: Some(JobSpec {
            backoff_limit: Some(2),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(labels(db)),
                    ..Default::default()
                }),
                spec: Some(PodSpec {
                    restart_policy: Some("Never".into()),
                    containers: vec![Container {
                        name: "pg-dump".into(),
                        image: Some(image),
                        command: Some(vec![
                            "pg_dump".into(),
                            "--format=custom".into(),
                            "--no-password".into(),
                            format!("--file=/backup/{}", file_name(db)),
                            format!("--dbname={}", db.spec.name),
                        ]),
                        env: Some(envs),
                        volume_mounts: Some(mounts),
                        ..Default::default()
                    }],
                    security_context: Some(PodSecurityContext {
                        run_as_user: Some(999),
                        run_as_group: Some(999),
                        fs_group: Some(999),
                        run_as_non_root: Some(true),
                        ..Default::default()
                    }),
                    volumes: Some(volumes),
                    ..Default::default()
                }),
            },
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// How the dump's Job is doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JobState {
    Running,
    Succeeded,
    Failed,
}

/// The state of a dump Job from its conditions.
pub fn job_state(job: &Job) -> JobState {
    let conditions = job.status.as_ref().and_then(|s| s.conditions.as_ref());
    let is = |t: &str| {
        conditions.is_some_and(|cs| cs.iter().any(|c| c.type_ == t && c.status == "True"))
    };
    if is("Complete") {
        JobState::Succeeded
    } else if is("Failed") {
        JobState::Failed
    } else {
        JobState::Running
    }
}

/// The status entry for the dump of `db` in `state`.
pub fn status(db: &Database, state: JobState) -> BackupStatus {
    BackupStatus {
        job: name(db),
        claim: name(db),
        file: file_name(db),
        succeeded: state == JobState::Succeeded,
    }
}
