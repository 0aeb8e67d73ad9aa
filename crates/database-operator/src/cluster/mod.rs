//! The PostgresCluster controller: validate → build ([`build`]) → apply → roll ([`rollout`])
//! → status.
//!
//! No finalizer: children carry owner references, so the garbage collector removes them.
//! The PersistentVolumeClaims follow the StatefulSet's `persistentVolumeClaimRetentionPolicy`
//! (`whenDeleted: Retain` unless `deletionPolicy: Delete`), and under `Retain` the superuser
//! Secret has no owner reference either, so kept data stays usable.

pub mod build;
pub mod rollout;

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::{Resource, ResourceExt};
use steward_core::Context;
use steward_core::apply::Children;

use crate::api::PostgresCluster;
use crate::ident::{self, Kind};
use crate::password::Password;
use crate::{Error, State};
use build::{Names, ROLE_LABEL, TEMPLATE_HASH_ANNOTATION};

/// Reconciles one PostgresCluster.
///
/// # Errors
/// [`Error`] naming the step that failed.
pub async fn reconcile(
    cluster: Arc<PostgresCluster>,
    ctx: Arc<Context<State>>,
) -> Result<Action, Error> {
    if steward_core::finalizer::is_deleting(cluster.as_ref()) {
        // The garbage collector removes the children.
        return Ok(Action::await_change());
    }
    if let Err(invalid) = validate(&cluster) {
        // Say so in status (nothing else changes: no child is applied with an invalid spec).
        let mut status = cluster.status.clone().unwrap_or_default();
        steward_core::conditions::set(
            &mut status.conditions,
            steward_core::conditions::READY,
            false,
            steward_core::ReconcileError::reason(&invalid),
            invalid.to_string(),
            cluster.meta().generation,
        );
        status.observed_generation = cluster.meta().generation;
        ctx.apply_status(cluster.as_ref(), cluster.status.as_ref(), &status)
            .await?;
        return Err(invalid);
    }
    let ns = cluster
        .namespace()
        .ok_or_else(|| Error::InvalidSpec("PostgresCluster must be namespaced".into()))?;
    let name = cluster.name_any();
    let names = Names::of(&name);
    let client = ctx.client.clone();
    let children = Children::new(client.clone(), cluster.as_ref(), &ctx.field_manager);

    // Passwords are generated once and never regenerated.
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &ns);
    let password = existing_password(&secrets, &cluster, &names.superuser_secret).await?;
    let secret = build::superuser_secret(&cluster, &password);
    if build::superuser_secret_owned(&cluster) {
        children.apply(secret).await?;
    } else {
        children
            .clone()
            .without_owner_reference()
            .apply(secret)
            .await?;
    }
    let replication = existing_password(&secrets, &cluster, &names.replication_secret).await?;
    children
        .apply(build::replication_secret(&cluster, &replication))
        .await?;
    // The instance managers' identity and rights (before the pods that use them).
    children
        .apply(build::instance_service_account(&cluster))
        .await?;
    children.apply(build::instance_role(&cluster)).await?;
    children
        .apply(build::instance_role_binding(&cluster))
        .await?;

    let config = build::config_map(&cluster);
    let config_hash = build::config_hash(&config);
    children.apply(config).await?;
    children.apply(build::headless_service(&cluster)).await?;
    children.apply(build::rw_service(&cluster)).await?;
    children.apply(build::ro_service(&cluster)).await?;
    children
        .apply(build::pod_disruption_budget(&cluster))
        .await?;

    // The StatefulSet, with the partition for the next step of a rollout.
    let statefulsets: Api<StatefulSet> = Api::namespaced(client.clone(), &ns);
    let current = statefulsets
        .get_opt(&names.statefulset)
        .await
        .map_err(|source| Error::Read {
            what: format!("StatefulSet {}", names.statefulset),
            source,
        })?;
    let pods_api: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let pods = pods_api
        .list(&ListParams::default().labels(&format!("{}={name}", build::CLUSTER_LABEL)))
        .await
        .map_err(|source| Error::Read {
            what: "the cluster's pods".into(),
            source,
        })?;
    let views: Vec<rollout::PodView> = pods
        .items
        .iter()
        .filter_map(|p| rollout::PodView::of(p, &names.statefulset))
        .collect();

    let mut desired =
        build::statefulset(&cluster, &config_hash, 0, &ctx.data.options.instance_image);
    let template_hash = build::template_hash(&desired);
    let template_changed = current
        .as_ref()
        .is_some_and(|s| s.annotations().get(TEMPLATE_HASH_ANNOTATION) != Some(&template_hash));
    let partition = rollout::partition(
        cluster.spec.instances,
        current.as_ref(),
        template_changed,
        &views,
    );
    desired = build::statefulset(
        &cluster,
        &config_hash,
        partition,
        &ctx.data.options.instance_image,
    );
    desired
        .annotations_mut()
        .insert(TEMPLATE_HASH_ANNOTATION.into(), template_hash);
    children.apply(desired).await?;
    if template_changed {
        ctx.recorder
            .normal(cluster.as_ref(), "RollingUpdate", "Update", format!("pod template changed; replacing instances one at a time from ordinal {partition} down to the primary"))
            .await;
    }

    // The primary is the Lease's holder (the instance managers elect it); before any Lease
    // exists, the first instance, which creates it. Its manager moves the role labels when
    // it is promoted; here they are only corrected (say, a label edited by hand).
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns);
    let lease = leases
        .get_opt(&names.lease)
        .await
        .map_err(|source| Error::Read {
            what: format!("Lease {}", names.lease),
            source,
        })?;
    let primary = match &lease {
        None => Some(names.first_pod.clone()),
        Some(lease) => lease
            .spec
            .as_ref()
            .and_then(|s| s.holder_identity.clone())
            .filter(|h| !h.is_empty()),
    };
    if let Some(primary) = &primary {
        for pod in &pods.items {
            let role = if pod.name_any() == *primary {
                build::PRIMARY
            } else {
                build::REPLICA
            };
            if pod.labels().get(ROLE_LABEL).map(String::as_str) == Some(role)
                || pod.metadata.deletion_timestamp.is_some()
            {
                continue;
            }
            let patch = serde_json::json!({"metadata": {"labels": {ROLE_LABEL: role}}});
            match pods_api
                .patch(
                    &pod.name_any(),
                    &PatchParams::default(),
                    &Patch::Merge(&patch),
                )
                .await
            {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.code == 404 => {}
                Err(source) => {
                    return Err(Error::LabelPod {
                        pod: pod.name_any(),
                        source,
                    });
                }
            }
        }
    }

    // Status, from the StatefulSet as applied and the pods as listed.
    let observed = rollout::Observed {
        generation: cluster.meta().generation,
        instances: cluster.spec.instances,
        target_version: cluster.spec.version,
        update_revision: if template_changed {
            None
        } else {
            current.as_ref().and_then(rollout::update_revision)
        },
        pods: &views,
        primary: primary.as_deref(),
        superuser_secret: names.superuser_secret.clone(),
    };
    let status = rollout::status(&observed, cluster.status.as_ref());
    let ready =
        steward_core::conditions::is_true(&status.conditions, steward_core::conditions::READY);
    ctx.apply_status(cluster.as_ref(), cluster.status.as_ref(), &status)
        .await?;
    Ok(if ready {
        Action::requeue(ctx.data.options.resync_interval)
    } else {
        Action::requeue(Duration::from_secs(10))
    })
}

/// The password in Secret `name` if it exists and is this cluster's, else a new one.
async fn existing_password(
    secrets: &Api<Secret>,
    cluster: &PostgresCluster,
    name: &str,
) -> Result<Password, Error> {
    let existing = secrets.get_opt(name).await.map_err(|source| Error::Read {
        what: format!("Secret {name}"),
        source,
    })?;
    crate::server::ensure_ours(
        existing.as_ref(),
        cluster,
        Some((build::CLUSTER_LABEL, cluster.name_any().as_str())),
    )?;
    Ok(existing
        .as_ref()
        .and_then(|s| s.data.as_ref()?.get("password"))
        .and_then(|p| String::from_utf8(p.0.clone()).ok())
        .filter(|p| !p.is_empty())
        .map(Password::from_existing)
        .unwrap_or_else(Password::generate))
}

/// Checks in code what the schema checks at admission.
///
/// # Errors
/// [`Error::InvalidSpec`] (permanent).
pub fn validate(cluster: &PostgresCluster) -> Result<(), Error> {
    let spec = &cluster.spec;
    if !(1..=9).contains(&spec.instances) {
        return Err(Error::InvalidSpec(format!(
            "instances must be between 1 and 9, not {}",
            spec.instances
        )));
    }
    if !(13..=18).contains(&spec.version) {
        return Err(Error::InvalidSpec(format!(
            "version must be a PostgreSQL major version from 13 to 18, not {}",
            spec.version
        )));
    }
    for (key, value) in &spec.parameters {
        ident::validate(Kind::Parameter, key).map_err(|e| Error::InvalidSpec(e.to_string()))?;
        if value.chars().any(char::is_control) {
            return Err(Error::InvalidParameters(format!(
                "the value of {key} contains a control character (a newline?), which postgresql.conf cannot hold; no instance was restarted"
            )));
        }
    }
    if cluster.name_any().len() > 47 {
        return Err(Error::InvalidSpec(
            "metadata.name must be at most 47 characters".into(),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use kube::Resource;

    use super::build::*;
    use super::*;
    use crate::api::{DeletionPolicy, PostgresClusterSpec, StorageSpec};

    /// A test fixture: `cluster("pg").instances(3).version(16)`.
    fn cluster(name: &str) -> PostgresCluster {
        let mut c = PostgresCluster::new(
            name,
            PostgresClusterSpec {
                instances: 3,
                version: 16,
                image: None,
                image_pull_policy: None,
                storage: StorageSpec {
                    size: Quantity("1Gi".into()),
                    storage_class_name: Some("fast".into()),
                },
                resources: None,
                parameters: BTreeMap::from([("max_connections".to_string(), "200".to_string())]),
                deletion_policy: DeletionPolicy::Retain,
            },
        );
        c.meta_mut().namespace = Some("ns".into());
        c.meta_mut().uid = Some("uid-1".into());
        c
    }

    #[test]
    fn services_select_primary_and_replicas() {
        let c = cluster("pg");
        let rw = rw_service(&c);
        let ro = ro_service(&c);
        let hl = headless_service(&c);
        assert_eq!(rw.metadata.name.as_deref(), Some("pg-rw"));
        assert_eq!(
            rw.spec.as_ref().unwrap().selector.as_ref().unwrap()[ROLE_LABEL],
            "primary"
        );
        assert_eq!(
            ro.spec.as_ref().unwrap().selector.as_ref().unwrap()[ROLE_LABEL],
            "replica"
        );
        assert_eq!(
            hl.spec.as_ref().unwrap().cluster_ip.as_deref(),
            Some("None")
        );
        assert!(
            !hl.spec
                .as_ref()
                .unwrap()
                .selector
                .as_ref()
                .unwrap()
                .contains_key(ROLE_LABEL)
        );
        assert_eq!(rw.metadata.namespace.as_deref(), Some("ns"));
    }

    #[test]
    fn statefulset_has_partition_storage_and_retention() {
        let c = cluster("pg");
        let sts = statefulset(&c, "abc", 2, "op:1");
        let spec = &sts.spec;
        assert_eq!(spec.replicas, Some(3));
        assert_eq!(spec.service_name.as_deref(), Some("pg-hl"));
        assert_eq!(
            spec.update_strategy
                .as_ref()
                .unwrap()
                .rolling_update
                .as_ref()
                .unwrap()
                .partition,
            Some(2)
        );
        assert_eq!(
            spec.persistent_volume_claim_retention_policy
                .as_ref()
                .unwrap()
                .when_deleted
                .as_deref(),
            Some("Retain")
        );
        let claim = &spec.volume_claim_templates.as_ref().unwrap()[0];
        assert_eq!(
            claim.spec.as_ref().unwrap().storage_class_name.as_deref(),
            Some("fast")
        );
        let pod = spec.template.spec.as_ref().unwrap();
        assert_eq!(pod.containers[0].image.as_deref(), Some("postgres:16"));
        let labels = spec
            .template
            .metadata
            .as_ref()
            .unwrap()
            .labels
            .as_ref()
            .unwrap();
        assert_eq!(labels[VERSION_LABEL], "16");
        let env = pod.containers[0].env.as_ref().unwrap();
        let pw = env.iter().find(|e| e.name == "POSTGRES_PASSWORD").unwrap();
        assert!(
            pw.value.is_none(),
            "the password comes from the Secret, never inline"
        );
        assert_eq!(
            pw.value_from
                .as_ref()
                .unwrap()
                .secret_key_ref
                .as_ref()
                .unwrap()
                .name,
            "pg-superuser"
        );

        let mut d = cluster("pg");
        d.spec.deletion_policy = DeletionPolicy::Delete;
        let sts = statefulset(&d, "abc", 0, "op:1");
        assert_eq!(
            sts.spec
                .persistent_volume_claim_retention_policy
                .unwrap()
                .when_deleted
                .as_deref(),
            Some("Delete")
        );
        assert!(superuser_secret_owned(&d));
        assert!(!superuser_secret_owned(&c));
    }

    #[test]
    fn template_hash_tracks_version_and_config_not_partition() {
        let c = cluster("pg");
        let a = template_hash(&statefulset(&c, "h1", 0, "op:1"));
        assert_eq!(
            a,
            template_hash(&statefulset(&c, "h1", 2, "op:1")),
            "partition is not part of the template"
        );
        assert_ne!(
            a,
            template_hash(&statefulset(&c, "h2", 0, "op:1")),
            "config change rolls"
        );
        let mut v = cluster("pg");
        v.spec.version = 17;
        assert_ne!(
            a,
            template_hash(&statefulset(&v, "h1", 0, "op:1")),
            "version change rolls"
        );
    }

    #[test]
    fn config_renders_quoted_parameters_and_hash_changes() {
        let mut c = cluster("pg");
        c.spec
            .parameters
            .insert("search_path".into(), "a', b".into());
        let cm = config_map(&c);
        let conf = &cm.data.as_ref().unwrap()["postgresql.conf"];
        assert!(conf.contains("max_connections = '200'\n"), "{conf}");
        assert!(conf.contains("search_path = 'a'', b'\n"), "{conf}");
        assert!(conf.contains("hba_file = '/etc/steward/pg_hba.conf'"));
        let h1 = config_hash(&cm);
        c.spec
            .parameters
            .insert("max_connections".into(), "300".into());
        assert_ne!(h1, config_hash(&config_map(&c)));
    }

    #[test]
    fn conf_values_use_the_config_files_quoting() {
        assert_eq!(conf_quote("abc"), "'abc'");
        assert_eq!(
            conf_quote("a\\b"),
            "'a\\\\b'",
            "a backslash is doubled, no E prefix"
        );
        assert_eq!(conf_quote("it's"), "'it''s'");
        assert_eq!(conf_quote("a\nb"), "'a b'");
        let mut c = cluster("pg");
        c.spec
            .parameters
            .insert("log_line_prefix".into(), "a\\b".into());
        let conf = render_parameters(&c.spec.parameters);
        assert!(conf.contains("log_line_prefix = 'a\\\\b'\n"), "{conf}");
        assert!(validate(&c).is_ok());
        c.spec
            .parameters
            .insert("log_line_prefix".into(), "a\nb".into());
        assert!(
            matches!(validate(&c), Err(Error::InvalidParameters(m)) if m.contains("log_line_prefix"))
        );
    }

    #[test]
    fn pods_run_the_instance_manager_copied_from_the_operators_image() {
        let c = cluster("pg");
        let sts = statefulset(&c, "abc", 0, "steward/database-operator:9");
        let pod = sts.spec.template.spec.as_ref().unwrap();
        let init = &pod.init_containers.as_ref().unwrap()[0];
        assert_eq!(init.image.as_deref(), Some("steward/database-operator:9"));
        assert_eq!(
            init.command.as_ref().unwrap(),
            &[INSTANCE_BINARY_IN_IMAGE, "copy", "/steward/bin"]
        );
        let pg = &pod.containers[0];
        assert_eq!(pg.image.as_deref(), Some("postgres:16"));
        assert_eq!(
            pg.command.as_ref().unwrap(),
            &["/steward/bin/steward-pg-instance", "run"]
        );
        assert_eq!(pod.service_account_name.as_deref(), Some("pg-instance"));
        let env = pg.env.as_ref().unwrap();
        let from_secret = |name: &str| {
            env.iter()
                .find(|e| e.name == name)
                .and_then(|e| e.value_from.as_ref()?.secret_key_ref.as_ref())
                .map(|s| s.name.clone())
        };
        assert_eq!(
            from_secret("REPLICATION_PASSWORD").as_deref(),
            Some("pg-replication")
        );
        let probe = |p: &Option<k8s_openapi::api::core::v1::Probe>| {
            p.as_ref().unwrap().http_get.as_ref().unwrap().path.clone()
        };
        assert_eq!(probe(&pg.readiness_probe).as_deref(), Some("/readyz"));
        assert_eq!(probe(&pg.liveness_probe).as_deref(), Some("/healthz"));
    }

    #[test]
    fn instance_managers_may_touch_only_their_lease_and_pods() {
        let c = cluster("pg");
        let role = instance_role(&c);
        let rules = role.rules.unwrap();
        let lease = rules
            .iter()
            .find(|r| r.verbs.contains(&"update".to_string()))
            .unwrap();
        assert_eq!(
            lease.resources.as_deref(),
            Some(&["leases".to_string()][..])
        );
        assert_eq!(
            lease.resource_names.as_deref(),
            Some(&["pg-primary".to_string()][..])
        );
        let patch = rules
            .iter()
            .find(|r| {
                r.verbs.contains(&"patch".to_string()) && r.resources.as_ref().unwrap()[0] == "pods"
            })
            .unwrap();
        assert_eq!(
            patch.resource_names.as_ref().unwrap(),
            &["pg-0", "pg-1", "pg-2"]
        );
        assert!(
            !rules
                .iter()
                .any(|r| r.resources.as_ref().unwrap().iter().any(|x| x == "secrets")),
            "no Secret access: passwords come as environment variables"
        );
        let binding = instance_role_binding(&c);
        assert_eq!(binding.subjects.unwrap()[0].name, "pg-instance");
        assert_eq!(binding.role_ref.name, "pg-instance");
    }

    #[test]
    fn config_includes_the_instance_file_last_and_replication_is_the_dedicated_role() {
        let cm = config_map(&cluster("pg"));
        let data = cm.data.unwrap();
        let conf = &data["postgresql.conf"];
        assert!(
            conf.trim_end()
                .ends_with("include_if_exists = '/steward/run/instance.conf'"),
            "{conf}"
        );
        let hba = &data["pg_hba.conf"];
        assert!(hba.contains("host    replication     steward_replication 0.0.0.0/0"));
        assert!(!hba.contains("replication     all"), "{hba}");
        assert!(!data.contains_key("bootstrap.sh"));
    }

    #[test]
    fn superuser_secret_and_pdb() {
        let c = cluster("pg");
        let s = superuser_secret(&c, &Password::from_existing("pw".into()));
        assert_eq!(s.metadata.name.as_deref(), Some("pg-superuser"));
        assert_eq!(s.data.as_ref().unwrap()["password"].0, b"pw");
        let pdb = pod_disruption_budget(&c);
        assert_eq!(
            pdb.spec.unwrap().max_unavailable,
            Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(1))
        );
    }

    #[test]
    fn validate_rejects_out_of_range() {
        let mut c = cluster("pg");
        validate(&c).unwrap();
        c.spec.instances = 10;
        assert!(validate(&c).is_err());
        let mut c = cluster("pg");
        c.spec.parameters.insert("bad key".into(), "x".into());
        assert!(matches!(validate(&c), Err(Error::InvalidSpec(_))));
    }
}
