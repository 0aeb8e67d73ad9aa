//! The actions: each reads the object, decides (pure: [`approval`], [`pick_switchover`]) whether
//! and what to write, and writes one merge patch — to the spec where the API has a field for
//! it, to the annotation the operator watches otherwise. When the action does not apply,
//! nothing is written and the error says why.

use kube::api::{Api, Patch, PatchParams};
use kube::{Client, Resource, ResourceExt};
use serde_json::json;
use steward_database_api::{
    DatabaseRole, PostgresBackup, PostgresBackupSpec, PostgresCluster, PostgresClusterStatus,
    ROTATE_ANNOTATION, SWITCHOVER_ANNOTATION,
};
use steward_upgrade_api::{Approval, UpgradePlan};

use crate::Error;

/// The field manager of the plugin's writes.
pub const FIELD_MANAGER: &str = "kubectl-steward";

async fn get<K>(client: &Client, ns: &str, name: &str) -> Result<K, Error>
where
    K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
{
    Api::<K>::namespaced(client.clone(), ns)
        .get(name)
        .await
        .map_err(Error::api(format!(
            "get {}/{name} in {ns}",
            K::kind(&()).to_lowercase()
        )))
}

async fn patch<K>(
    client: &Client,
    ns: &str,
    name: &str,
    body: serde_json::Value,
) -> Result<(), Error>
where
    K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
{
    let params = PatchParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..PatchParams::default()
    };
    Api::<K>::namespaced(client.clone(), ns)
        .patch(name, &params, &Patch::Merge(&body))
        .await
        .map(|_| ())
        .map_err(Error::api(format!(
            "patch {}/{name} in {ns}",
            K::kind(&()).to_lowercase()
        )))
}

/// The `spec.approvedWaves` to write to approve `wave` (default: the next unapproved one),
/// or why not.
pub fn approval(plan: &UpgradePlan, wave: Option<i32>) -> Result<i32, String> {
    if plan.spec.strategy.approval != Approval::Manual {
        return Err("it does not wait for approval (spec.strategy.approval is Automatic)".into());
    }
    let status = plan.status.clone().unwrap_or_default();
    if status.phase.is_some_and(|p| p.is_terminal()) {
        return Err(format!(
            "it is over ({})",
            status.phase.map(|p| p.as_str()).unwrap_or_default()
        ));
    }
    let approved = plan.spec.approved_waves.unwrap_or(0);
    let waves = status.waves;
    let wanted = wave.unwrap_or(approved + 1);
    if wanted < 1 {
        return Err(format!("there is no wave {wanted}: waves count from 1"));
    }
    if let Some(waves) = waves
        && wanted > waves
    {
        return Err(if approved >= waves {
            format!("all {waves} waves are approved already")
        } else {
            format!("it has {waves} waves, not {wanted}")
        });
    }
    if wanted <= approved {
        return Err(format!("waves up to {approved} are approved already"));
    }
    Ok(wanted)
}

/// `kubectl steward approve`.
pub async fn approve(
    client: &Client,
    ns: &str,
    name: &str,
    wave: Option<i32>,
) -> Result<String, Error> {
    let plan: UpgradePlan = get(client, ns, name).await?;
    let wave = approval(&plan, wave)
        .map_err(|why| Error::Refused(format!("upgradeplan/{name} not approved: {why}")))?;
    patch::<UpgradePlan>(client, ns, name, json!({"spec": {"approvedWaves": wave}})).await?;
    Ok(format!("upgradeplan/{name}: waves up to {wave} approved\n"))
}

/// `kubectl steward pause` and `resume`.
pub async fn set_paused(
    client: &Client,
    ns: &str,
    name: &str,
    paused: bool,
) -> Result<String, Error> {
    let plan: UpgradePlan = get(client, ns, name).await?;
    let verb = if paused { "paused" } else { "resumed" };
    if let Some(phase) = plan.status.as_ref().and_then(|s| s.phase)
        && phase.is_terminal()
    {
        return Err(Error::Refused(format!(
            "upgradeplan/{name} not {verb}: it is over ({})",
            phase.as_str()
        )));
    }
    if plan.spec.strategy.paused == paused {
        return Ok(format!("upgradeplan/{name} is {verb} already\n"));
    }
    patch::<UpgradePlan>(
        client,
        ns,
        name,
        json!({"spec": {"strategy": {"paused": paused}}}),
    )
    .await?;
    Ok(format!("upgradeplan/{name} {verb}\n"))
}

/// Sets annotation `key` of `name` (a `K`, which must exist) to the current time, a value it
/// has never had: a request its operator acts on once. Returns that time.
async fn stamp<K>(client: &Client, ns: &str, name: &str, key: &str) -> Result<String, Error>
where
    K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
{
    let _: K = get(client, ns, name).await?;
    let at = jiff::Timestamp::now().to_string();
    patch::<K>(
        client,
        ns,
        name,
        json!({"metadata": {"annotations": {key: at}}}),
    )
    .await?;
    Ok(at)
}

/// `kubectl steward rotate`: sets the rotation annotation to the current time, a value it has
/// never had, so the database-operator rotates the password once.
pub async fn rotate(client: &Client, ns: &str, name: &str) -> Result<String, Error> {
    let at = stamp::<DatabaseRole>(client, ns, name, ROTATE_ANNOTATION).await?;
    Ok(format!(
        "databaserole/{name}: password rotation requested ({ROTATE_ANNOTATION}={at})\n"
    ))
}

/// `kubectl steward rotate-ca`: sets the cluster's CA rotation annotation to the current
/// time, a value it has never had, so the database-operator rotates its CA once (trusted
/// beside the old one first, then signing, then alone).
pub async fn rotate_ca(client: &Client, ns: &str, name: &str) -> Result<String, Error> {
    use steward_database_api::ROTATE_CA_ANNOTATION;
    let at = stamp::<PostgresCluster>(client, ns, name, ROTATE_CA_ANNOTATION).await?;
    Ok(format!(
        "postgrescluster/{name}: CA rotation requested ({ROTATE_CA_ANNOTATION}={at}); every ca.crt of the cluster holds both CAs before the new one signs\n"
    ))
}

/// The instance a switchover should hand the primary to: `to` if it is a ready replica,
/// otherwise the ready replica with the least replay lag.
pub fn pick_switchover(status: &PostgresClusterStatus, to: Option<&str>) -> Result<String, String> {
    if let Some(target) = &status.switchover_target {
        return Err(format!("a switchover to {target} is under way"));
    }
    let replicas = status
        .instances
        .iter()
        .filter(|i| i.role == "replica" && i.ready);
    match to {
        Some(to) if status.primary.as_deref() == Some(to) => {
            Err(format!("{to} is the primary already"))
        }
        Some(to) => match status.instances.iter().find(|i| i.name == to) {
            None => Err(format!(
                "it has no instance {to} (instances: {})",
                status
                    .instances
                    .iter()
                    .map(|i| i.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )),
            Some(i) if i.role != "replica" || !i.ready => Err(format!(
                "{to} is not a ready replica (role {}, ready {})",
                i.role, i.ready
            )),
            Some(i) => Ok(i.name.clone()),
        },
        None => replicas
            .min_by_key(|i| (i.replay_lag_bytes, i.name.clone()))
            .map(|i| i.name.clone())
            .ok_or_else(|| "it has no ready replica".to_string()),
    }
}

/// `kubectl steward switchover`: asks the database-operator (through its annotation) to hand
/// the primary over; the operator checks again and reports in the cluster's Events and status.
pub async fn switchover(
    client: &Client,
    ns: &str,
    name: &str,
    to: Option<&str>,
) -> Result<String, Error> {
    let cluster: PostgresCluster = get(client, ns, name).await?;
    let status = cluster.status.clone().unwrap_or_default();
    let target = pick_switchover(&status, to)
        .map_err(|why| Error::Refused(format!("postgrescluster/{name}: no switchover: {why}")))?;
    patch::<PostgresCluster>(
        client,
        ns,
        name,
        json!({"metadata": {"annotations": {SWITCHOVER_ANNOTATION: target}}}),
    )
    .await?;
    Ok(format!(
        "postgrescluster/{name}: switchover from {} to {target} requested; follow it with kubectl steward status\n",
        status.primary.as_deref().unwrap_or("(no primary)")
    ))
}

/// The `PostgresBackup` `kubectl steward backup` creates for `cluster` at `now`, or why none:
/// the cluster must have `spec.backup`.
pub fn backup_for(
    cluster: &PostgresCluster,
    name: Option<&str>,
    now: jiff::Timestamp,
) -> Result<PostgresBackup, String> {
    let cluster_name = cluster.name_any();
    if cluster.spec.backup.is_none() {
        return Err(
            "it has no spec.backup: there is nowhere to store a backup (set spec.backup.objectStore)"
                .to_string(),
        );
    }
    let name = name.map_or_else(
        || steward_database_api::scheduled_backup_name(&cluster_name, now),
        str::to_string,
    );
    let mut backup = PostgresBackup::new(
        &name,
        PostgresBackupSpec {
            cluster: cluster_name,
        },
    );
    backup.metadata.namespace = cluster.namespace();
    Ok(backup)
}

/// `kubectl steward backup`: a base backup now, taken by the cluster's primary.
pub async fn backup(
    client: &Client,
    ns: &str,
    cluster: &str,
    name: Option<&str>,
) -> Result<String, Error> {
    let pg: PostgresCluster = get(client, ns, cluster).await?;
    let backup = backup_for(&pg, name, jiff::Timestamp::now())
        .map_err(|why| Error::Refused(format!("postgrescluster/{cluster}: no backup: {why}")))?;
    let params = kube::api::PostParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..Default::default()
    };
    let created = Api::<PostgresBackup>::namespaced(client.clone(), ns)
        .create(&params, &backup)
        .await
        .map_err(Error::api(format!("create postgresbackup in {ns}")))?;
    let name = created.name_any();
    Ok(format!(
        "postgresbackup/{name}: base backup of {cluster} requested; follow it with kubectl get pgb {name} -n {ns}\n"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn plan(approval: &str, approved: Option<i32>, status: serde_json::Value) -> UpgradePlan {
        serde_json::from_value(json!({
            "apiVersion": "upgrade.steward.dev/v1alpha1",
            "kind": "UpgradePlan",
            "metadata": {"name": "p", "namespace": "n"},
            "spec": {
                "components": [{"name": "a", "target": {"kind": "Deployment", "name": "a"}, "version": "2"}],
                "strategy": {"approval": approval},
                "approvedWaves": approved,
            },
            "status": status,
        }))
        .expect("plan")
    }

    #[test]
    fn approve_takes_the_next_wave_or_the_one_asked_for() {
        let waiting = json!({"phase": "WaitingApproval", "currentWave": 1, "waves": 3});
        assert_eq!(
            approval(&plan("Manual", None, waiting.clone()), None),
            Ok(1)
        );
        assert_eq!(
            approval(&plan("Manual", Some(1), waiting.clone()), None),
            Ok(2)
        );
        assert_eq!(
            approval(&plan("Manual", Some(1), waiting.clone()), Some(3)),
            Ok(3)
        );
    }

    #[test]
    fn approve_refuses_what_would_change_nothing_or_make_no_sense() {
        let waiting = json!({"phase": "WaitingApproval", "currentWave": 2, "waves": 2});
        let refused = |p: UpgradePlan, wave| approval(&p, wave).expect_err("refused");
        assert!(refused(plan("Automatic", None, waiting.clone()), None).contains("Automatic"));
        assert_eq!(
            refused(plan("Manual", Some(2), waiting.clone()), None),
            "all 2 waves are approved already"
        );
        assert_eq!(
            refused(plan("Manual", None, waiting.clone()), Some(5)),
            "it has 2 waves, not 5"
        );
        assert_eq!(
            refused(plan("Manual", Some(2), json!({"waves": 3})), Some(1)),
            "waves up to 2 are approved already"
        );
        assert_eq!(
            refused(
                plan("Manual", None, json!({"phase": "Succeeded", "waves": 2})),
                None
            ),
            "it is over (Succeeded)"
        );
    }

    fn cluster_status(value: serde_json::Value) -> PostgresClusterStatus {
        serde_json::from_value(value).expect("status")
    }

    #[test]
    fn switchover_goes_to_the_most_caught_up_ready_replica_unless_told() {
        let status = cluster_status(json!({
            "primary": "pg-0",
            "instances": [
                {"name": "pg-0", "role": "primary", "timeline": 1, "lsn": "0/5", "replayLagBytes": 0, "ready": true},
                {"name": "pg-1", "role": "replica", "timeline": 1, "lsn": "0/4", "replayLagBytes": 900, "ready": true},
                {"name": "pg-2", "role": "replica", "timeline": 1, "lsn": "0/5", "replayLagBytes": 0, "ready": true},
                {"name": "pg-3", "role": "replica", "timeline": 1, "lsn": "0/5", "replayLagBytes": 0, "ready": false},
            ],
        }));
        assert_eq!(pick_switchover(&status, None), Ok("pg-2".into()));
        assert_eq!(pick_switchover(&status, Some("pg-1")), Ok("pg-1".into()));
        assert_eq!(
            pick_switchover(&status, Some("pg-0")),
            Err("pg-0 is the primary already".into())
        );
        assert!(
            pick_switchover(&status, Some("pg-3"))
                .is_err_and(|e| e.contains("not a ready replica"))
        );
        assert!(
            pick_switchover(&status, Some("pg-9")).is_err_and(|e| e.contains("no instance pg-9"))
        );
    }

    #[test]
    fn switchover_is_refused_without_a_replica_or_while_one_runs() {
        let alone = cluster_status(json!({"primary": "pg-0", "instances": [
            {"name": "pg-0", "role": "primary", "timeline": 1, "lsn": "0/5", "replayLagBytes": 0, "ready": true},
        ]}));
        assert_eq!(
            pick_switchover(&alone, None),
            Err("it has no ready replica".into())
        );
        let busy = cluster_status(json!({"primary": "pg-0", "switchoverTarget": "pg-1"}));
        assert_eq!(
            pick_switchover(&busy, None),
            Err("a switchover to pg-1 is under way".into())
        );
    }

    #[test]
    fn a_backup_needs_spec_backup_and_is_named_after_the_cluster_and_the_time() {
        let mut cluster: PostgresCluster = serde_json::from_value(json!({
            "apiVersion": "database.steward.dev/v1alpha1",
            "kind": "PostgresCluster",
            "metadata": {"name": "pg", "namespace": "db"},
            "spec": {"instances": 1, "version": 17, "storage": {"size": "1Gi"}},
        }))
        .expect("cluster");
        let now: jiff::Timestamp = "2026-12-02T03:04:05Z".parse().unwrap();
        let why = backup_for(&cluster, None, now).unwrap_err();
        assert!(why.contains("no spec.backup"), "{why}");
        cluster.spec.backup = serde_json::from_value(json!({"objectStore": {
            "endpoint": "http://s3:9000", "bucket": "b", "path": "p", "credentialsSecret": "s"}}))
        .unwrap();
        let backup = backup_for(&cluster, None, now).unwrap();
        assert_eq!(backup.name_any(), "pg-20261202030405");
        assert_eq!(backup.namespace().as_deref(), Some("db"));
        assert_eq!(backup.spec.cluster, "pg");
        let named = backup_for(&cluster, Some("before-migration"), now).unwrap();
        assert_eq!(named.name_any(), "before-migration");
    }
}
