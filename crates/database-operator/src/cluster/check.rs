//! PostgreSQL checks `spec.parameters` itself before any instance loads them.
//!
//! [`crate::parameters`] knows the values of common parameters; every other name and value
//! (an unknown name, a parameter outside its table, a time zone) only PostgreSQL can judge.
//! So a new `postgresql.conf` holding user parameters is first read by the cluster's own
//! PostgreSQL major, in a one-off Job of the instances' pod template
//! (`steward-pg-instance check-config`: `postgres -C`, which parses the configuration as a
//! starting server does and exits). Until the Job succeeds the ConfigMap and the StatefulSet
//! keep what they hold; a refusal is `Ready=False InvalidParameters` in PostgreSQL's words,
//! and no instance restarts onto it. A Job that fails for another reason (its pod could not
//! start within 5 minutes) is reported the same way, with that reason: delete the Job to have
//! the check run again.
//!
//! The Job is named after the configuration's hash. Its outcome is the record of the check
//! (a reconcile working from a stale copy finds the same outcome), so it is kept until the
//! configuration it passed is written, then every check Job of the cluster is deleted; a
//! finished one left behind (a refusal the spec has moved away from) goes ten minutes after
//! it finished (`ttlSecondsAfterFinished`), and is run again if the spec comes back to it.
//!
//! # Caveats
//! What a server finds only later at start is not checked: a preloaded library that fails to
//! load, limits across settings (`max_connections` and the reserved slots are checked in code,
//! [`super::validate`]). A change of major alone, with the same parameters, is not checked
//! again.

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{ConfigMap, EmptyDirVolumeSource, EnvVar, Volume};
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use steward_database_api::contract::{BINARY, CHECK_CONFIG_ENV, CHECK_CONFIG_MAX_BYTES};

use super::build;
use super::upgrade::{self, JobState};
use crate::Error;
use crate::crd::PostgresCluster;

/// The label on every parameters check Job of a cluster (its value: the cluster).
pub const CHECK_OF_LABEL: &str = "database.steward.dev/parameters-check-of";

/// The outcome of PostgreSQL's check of a configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Checked {
    /// Nothing to check: no user parameters, or the ConfigMap holds this configuration
    /// already.
    Unneeded,
    /// PostgreSQL accepted it: write it, then [`clean_up`].
    Passed,
    /// The Job runs: write nothing yet.
    Running,
    /// PostgreSQL refused it: why, for the condition.
    Refused(String),
}

/// Whether `desired` must be checked by PostgreSQL first: it holds user parameters, and the
/// ConfigMap (`current`) does not hold it already.
pub fn needed(cluster: &PostgresCluster, current: Option<&ConfigMap>, desired: &ConfigMap) -> bool {
    !cluster.spec.parameters.is_empty()
        && current.and_then(|c| c.data.as_ref()) != desired.data.as_ref()
}

/// The check Job of `cluster` for the configuration hashed `config_hash`: at most 47 + 15
/// characters, within the 63 of the `job-name` label.
pub fn job_name(cluster: &str, config_hash: &str) -> String {
    let short: String = config_hash.chars().take(8).collect();
    format!("{cluster}-check-{short}")
}

/// The check Job: the instances' pod template (`sts`, so the same PostgreSQL image, user and
/// scheduling) running `check-config` on `config`, with no data volume, no mounted
/// configuration, Secret or token (nothing but the instance manager it copies in).
pub fn job(cluster: &PostgresCluster, sts: &StatefulSet, name: &str, config: &str) -> Job {
    let mut job = upgrade::one_off_job(cluster, sts, name, [(CHECK_OF_LABEL, cluster.name_any())]);
    if let Some(job) = job.spec.as_mut() {
        // A pod that cannot start (an image that cannot be pulled) is not a verdict on the
        // parameters; it fails the Job, and its reason is shown.
        job.active_deadline_seconds = Some(300);
        // A refusal is kept as the record while the spec stays as it is; one the spec has
        // moved away from (back to what the ConfigMap holds) goes after ten minutes.
        job.ttl_seconds_after_finished = Some(600);
    }
    let Some(spec) = job.spec.as_mut().and_then(|j| j.template.spec.as_mut()) else {
        return job;
    };
    spec.automount_service_account_token = Some(false);
    spec.volumes = Some(vec![Volume {
        name: "steward".into(),
        empty_dir: Some(EmptyDirVolumeSource::default()),
        ..Default::default()
    }]);
    spec.containers.truncate(1);
    if let Some(main) = spec.containers.first_mut() {
        main.name = "check-config".into();
        main.command = Some(vec![
            format!("{}/bin/{BINARY}", build::STEWARD_DIR),
            "check-config".into(),
        ]);
        main.env = Some(vec![
            EnvVar {
                name: "STEWARD_RUN_DIR".into(),
                value: Some(format!("{}/run", build::STEWARD_DIR)),
                ..Default::default()
            },
            EnvVar {
                name: CHECK_CONFIG_ENV.into(),
                value: Some(config.to_string()),
                ..Default::default()
            },
        ]);
        main.volume_mounts = main
            .volume_mounts
            .take()
            .map(|mounts| mounts.into_iter().filter(|m| m.name == "steward").collect());
        upgrade::strip_instance(main);
    }
    job
}

/// Has PostgreSQL check `desired` (see the module documentation), starting the Job if it
/// does not exist. `target` is the StatefulSet the configuration is for.
///
/// # Errors
/// [`Error::Read`] of the ConfigMap or the Job, [`Error::CheckParameters`] when creating the
/// Job fails.
pub async fn check(
    client: &kube::Client,
    cluster: &PostgresCluster,
    desired: &ConfigMap,
    config_hash: &str,
    target: &StatefulSet,
) -> Result<Checked, Error> {
    if cluster.spec.parameters.is_empty() {
        return Ok(Checked::Unneeded);
    }
    let ns = cluster.namespace().unwrap_or_default();
    let name = build::Names::of(&cluster.name_any()).config;
    let current = Api::<ConfigMap>::namespaced(client.clone(), &ns)
        .get_opt(&name)
        .await
        .map_err(|source| Error::Read {
            what: format!("ConfigMap {name}"),
            source,
        })?;
    if !needed(cluster, current.as_ref(), desired) {
        return Ok(Checked::Unneeded);
    }
    let config = desired
        .data
        .as_ref()
        .and_then(|d| d.get("postgresql.conf"))
        .cloned()
        .unwrap_or_default();
    if config.len() > CHECK_CONFIG_MAX_BYTES {
        return Ok(Checked::Refused(format!(
            "spec.parameters make a postgresql.conf of {} bytes; at most {CHECK_CONFIG_MAX_BYTES} are taken",
            config.len()
        )));
    }
    let jobs: Api<Job> = Api::namespaced(client.clone(), &ns);
    let name = job_name(&cluster.name_any(), config_hash);
    let state = upgrade::job_state(client, &ns, &jobs, &name).await?;
    Ok(match state {
        JobState::Succeeded => Checked::Passed,
        JobState::Running => Checked::Running,
        JobState::Failed(reason) => Checked::Refused(format!(
            "PostgreSQL {} refuses spec.parameters: {reason}",
            cluster.spec.version
        )),
        JobState::Missing => {
            let job = job(cluster, target, &name, &config);
            steward_core::object::unless_exists(jobs.create(&PostParams::default(), &job).await)
                .map_err(|source| Error::CheckParameters {
                    what: format!("create Job {name}"),
                    source,
                })?;
            Checked::Running
        }
    })
}

/// Deletes the cluster's check Jobs (and their pods), once what they checked is written.
///
/// # Errors
/// [`Error::CheckParameters`].
pub async fn clean_up(client: &kube::Client, cluster: &PostgresCluster) -> Result<(), Error> {
    let ns = cluster.namespace().unwrap_or_default();
    let jobs: Api<Job> = Api::namespaced(client.clone(), &ns);
    let selector = format!("{CHECK_OF_LABEL}={}", cluster.name_any());
    jobs.delete_collection(
        &DeleteParams::background(),
        &ListParams::default().labels(&selector),
    )
    .await
    .map(|_| ())
    .map_err(|source| Error::CheckParameters {
        what: "delete the parameters check Jobs".into(),
        source,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn cluster(parameters: &[(&str, &str)]) -> PostgresCluster {
        let mut c = super::super::tests::cluster("pg");
        c.spec.parameters = parameters
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        c
    }

    #[test]
    fn only_a_new_configuration_with_user_parameters_is_checked() {
        let plain = cluster(&[]);
        let tuned = cluster(&[("timezone", "Mars/Olympus")]);
        let desired = build::config_map(&tuned);
        assert!(
            !needed(&plain, None, &build::config_map(&plain)),
            "the operator's own"
        );
        assert!(needed(&tuned, None, &desired), "a new cluster's");
        assert!(
            needed(&tuned, Some(&build::config_map(&plain)), &desired),
            "a change"
        );
        assert!(!needed(&tuned, Some(&desired), &desired), "written already");
    }

    #[test]
    fn the_job_runs_the_check_in_the_instances_image_with_nothing_mounted_but_its_program() {
        let c = cluster(&[("timezone", "Mars/Olympus")]);
        let sts = build::statefulset(&c, "abc", "steward/database-operator:test");
        let name = job_name(
            "a-cluster-name-of-forty-seven-characters-xxxxxx",
            "0123456789abcdef",
        );
        assert!(name.len() <= 63, "{name}");
        let job = job(&c, &sts, &name, "timezone = 'Mars/Olympus'\n");
        let spec = job.spec.unwrap().template.spec.unwrap();
        let main = &spec.containers[0];
        let instance = &sts.spec.template.spec.clone().unwrap().containers[0];
        assert_eq!(main.image, instance.image, "the cluster's PostgreSQL");
        assert_eq!(main.command.as_ref().unwrap()[1], "check-config");
        let env = main.env.clone().unwrap();
        assert!(env.iter().any(|e| e.name == CHECK_CONFIG_ENV
            && e.value.as_deref() == Some("timezone = 'Mars/Olympus'\n")));
        assert!(env.iter().all(|e| e.value_from.is_none()), "no Secret");
        let mounts: Vec<_> = main
            .volume_mounts
            .iter()
            .flatten()
            .map(|m| &m.name)
            .collect();
        assert_eq!(mounts, ["steward"]);
        assert_eq!(spec.volumes.unwrap().len(), 1);
        assert_eq!(spec.automount_service_account_token, Some(false));
        assert_eq!(spec.restart_policy.as_deref(), Some("Never"));
        assert!(main.readiness_probe.is_none() && main.ports.is_none());
        let labels = job.metadata.labels.unwrap();
        assert!(
            !labels.contains_key(build::CLUSTER_LABEL),
            "not an instance"
        );
        assert_eq!(labels[CHECK_OF_LABEL], "pg");
    }
}
