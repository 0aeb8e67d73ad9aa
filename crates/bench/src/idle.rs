//! Scenario 6: idle writes of the database-operator and the upgrade-orchestrator (the
//! tenant-operator's are scenario 2).
//!
//! Each operator runs as its binary against the bench's control plane with objects that have
//! converged, is restarted (the new process reconciles every object from empty caches, as a
//! new leader does), and then stays idle for the window with its resyncs on. The API server's
//! own counters give every write in the window (leases and kwok's node heartbeats excluded); for the database-operator,
//! a real PostgreSQL server logs every statement that changes anything (`log_statement =
//! 'mod'`: DDL, DCL and data changes), so a resync that re-runs a `GRANT` or an `ALTER ROLE`
//! shows up too.
//!
//! - database-operator: `n` PostgresClusters (on kwok nodes no instance runs, so this covers
//!   the children the operator applies: Secrets, ServiceAccount, Role, RoleBinding,
//!   ConfigMap, three Services, PodDisruptionBudget, StatefulSet), `n` Databases and `n`
//!   DatabaseRoles on the PostgreSQL server; `--resync-interval` a third of the window.
//! - upgrade-orchestrator: `n` UpgradePlans, each changing one Deployment's image, all
//!   Succeeded before the restart.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::Client;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, PostParams};
use serde::Serialize;
use serde_json::{Value, json};

use super::apiserver::{self, Key, WRITE_VERBS};
use super::procs::{Launch, Replica};

/// What one operator wrote while idle.
#[derive(Clone, Debug, Default, Serialize)]
pub struct IdleWrites {
    pub operator: String,
    /// What it managed, e.g. `100 PostgresClusters, 100 Databases, 100 DatabaseRoles`.
    pub objects: String,
    /// Restart → end of the window.
    pub window_secs: f64,
    /// Its resync interval during the window (`None`: it has none; converged objects wait for
    /// a change).
    pub resync_secs: Option<f64>,
    /// Reconciles it ran in the window (its `controller_runtime_reconcile_total`).
    pub reconciles: f64,
    /// Writes the API server served in the window, by `verb resource[/subresource]`, leases
    /// excluded, the background rate subtracted.
    pub writes: BTreeMap<String, f64>,
    /// Namespaces still being deleted when the window began (the namespace controller's
    /// deletes in them are counted too); empty: none.
    pub overlapped: Vec<String>,
    /// Statements that changed something on the PostgreSQL server in the window (`None`
    /// where the operator uses none), and the first few of them.
    pub sql_changes: Option<usize>,
    pub sql_sample: Vec<String>,
}

impl IdleWrites {
    /// Every write in the window but Events (the scheduler and the volume controller keep
    /// writing Events about the clusters' pods, which cannot run on kwok nodes).
    pub fn total_writes(&self) -> f64 {
        let sum: f64 = self
            .writes
            .iter()
            .filter(|(k, _)| !k.ends_with(" events"))
            .map(|(_, v)| v)
            .sum();
        // The background subtraction can leave -0, which would print as such.
        sum.max(0.0) + 0.0
    }

    /// Event writes in the window, whoever wrote them.
    pub fn event_writes(&self) -> f64 {
        self.writes
            .iter()
            .filter(|(k, _)| k.ends_with(" events"))
            .map(|(_, v)| v)
            .sum()
    }
}

const DB_NAMESPACE: &str = "bench-idle-db";
const UP_NAMESPACE: &str = "bench-idle-up";
const OLD: &str = "registry.example/app:1.0.0";
const NEW: &str = "registry.example/app:2.0.0";

pub(crate) fn resource(group: &str, kind: &str, plural: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, "v1alpha1", kind), plural)
}

pub(crate) async fn create_all(api: &Api<DynamicObject>, objects: Vec<Value>) -> Result<()> {
    for o in objects {
        let obj: DynamicObject = serde_json::from_value(o)?;
        api.create(&PostParams::default(), &obj).await?;
    }
    Ok(())
}

/// Waits until `done` holds for every object of `api`, at most `timeout`.
pub(crate) async fn wait_all(
    what: &str,
    api: &Api<DynamicObject>,
    n: usize,
    timeout: Duration,
    done: impl Fn(&DynamicObject) -> bool,
) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        let list = api.list(&Default::default()).await?;
        let ok = list.items.iter().filter(|o| done(o)).count();
        if ok >= n {
            return Ok(());
        }
        if Instant::now() > deadline {
            let stuck = list.items.iter().find(|o| !done(o)).map(|o| {
                format!(
                    "; {} is at {}",
                    o.metadata.name.as_deref().unwrap_or_default(),
                    o.data["status"]
                )
            });
            bail!(
                "{what}: {ok} of {n} within {timeout:?}{}",
                stuck.unwrap_or_default()
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

pub(crate) fn ready(o: &DynamicObject) -> bool {
    let status = &o.data["status"];
    observed(o)
        && status["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| c["type"] == "Ready" && c["status"] == "True")
}

/// The status was written for the current generation (whatever it says). (A
/// `DynamicObject`'s metadata is not in its `data`.)
fn observed(o: &DynamicObject) -> bool {
    o.metadata.generation.is_some()
        && o.data["status"]["observedGeneration"].as_i64() == o.metadata.generation
}

/// Writes in `delta` by `verb resource[/sub]`, without leases (leader election) and nodes
/// (kwok's heartbeats: neither operator writes a Node, and their rate is too uneven for the
/// background subtraction).
fn writes(delta: &BTreeMap<Key, f64>) -> BTreeMap<String, f64> {
    delta
        .iter()
        .filter(|((verb, resource, _), _)| {
            WRITE_VERBS.contains(&verb.as_str()) && resource != "leases" && resource != "nodes"
        })
        .map(|((verb, resource, sub), v)| {
            let name = if sub.is_empty() {
                resource.clone()
            } else {
                format!("{resource}/{sub}")
            };
            // The background rate subtracted can leave a little below zero: none.
            (format!("{verb} {name}"), v.max(0.0) + 0.0)
        })
        .collect()
}

/// `controller_runtime_reconcile_total` summed over controllers and results.
async fn reconciles(op: &Replica) -> f64 {
    let Ok((_, text)) = super::procs::http_get(op.metrics_port, "/metrics").await else {
        return f64::NAN;
    };
    text.lines()
        .filter(|l| l.starts_with("controller_runtime_reconcile_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Stops `op`, starts it again, and measures the window from the restart.
///
/// The window starts once no namespace is being deleted (at most twice the window, 30 s to
/// 5 min later): the namespace controller's deletes of an earlier scenario's objects would count
/// as writes in it (they did: `DELETE` of every kind, in 6 namespaces).
async fn restart_and_idle(
    client: &Client,
    baseline: &BTreeMap<Key, f64>,
    launch: &Launch,
    kubeconfig: &Path,
    op: &mut Replica,
    idle: Duration,
) -> Result<Window> {
    let settle = (2 * idle).clamp(Duration::from_secs(30), Duration::from_secs(300));
    let overlapped = terminating_namespaces(client, settle).await?;
    op.signal("TERM")?;
    op.wait_exit(Duration::from_secs(30)).await?;
    let a = apiserver::read(client).await?;
    let mut restarted = Replica::spawn(launch, kubeconfig, 1)?;
    restarted.wait_ready(Duration::from_secs(120)).await?;
    tokio::time::sleep(idle).await;
    let b = apiserver::read(client).await?;
    let reconciles = reconciles(&restarted).await;
    Ok(Window {
        op: restarted,
        secs: b.at.duration_since(a.at).as_secs_f64(),
        writes: writes(&apiserver::delta(&a, &b, baseline)),
        reconciles,
        overlapped,
    })
}

/// An idle window ([`restart_and_idle`]).
struct Window {
    /// The restarted operator.
    op: Replica,
    secs: f64,
    writes: BTreeMap<String, f64>,
    reconciles: f64,
    /// The namespaces still being deleted when it began.
    overlapped: Vec<String>,
}

/// Waits until no namespace is being deleted, at most `bound`; returns those still being
/// deleted then.
async fn terminating_namespaces(client: &Client, bound: Duration) -> Result<Vec<String>> {
    let api: Api<Namespace> = Api::all(client.clone());
    let deadline = Instant::now() + bound;
    loop {
        let terminating: Vec<String> = api
            .list_metadata(&Default::default())
            .await?
            .items
            .into_iter()
            .filter(|n| n.metadata.deletion_timestamp.is_some())
            .filter_map(|n| n.metadata.name)
            .collect();
        if terminating.is_empty() || Instant::now() >= deadline {
            return Ok(terminating);
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

fn launch(binary: &Path, log_dir: &Path, label: &str, extra: &[String]) -> Launch {
    let mut args = vec![
        "--leader-elect=true".to_string(),
        "--leader-election-namespace=default".to_string(),
        format!("--leader-election-id=bench-idle-{label}"),
        "--log-level=warn".to_string(),
    ];
    args.extend(extra.iter().cloned());
    Launch {
        binary: binary.to_path_buf(),
        args,
        log_dir: log_dir.to_path_buf(),
        label: format!("idle-{label}"),
    }
}

pub(crate) async fn namespace(client: &Client, name: &str) -> Result<()> {
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": name}}))?;
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
        .with_context(|| format!("creating namespace {name}"))?;
    Ok(())
}

/// The database-operator with `n` PostgresClusters, Databases and DatabaseRoles.
pub async fn database_operator(
    client: &Client,
    baseline: &BTreeMap<Key, f64>,
    binary: &Path,
    log_dir: &Path,
    kubeconfig: &Path,
    n: usize,
    idle: Duration,
) -> Result<IdleWrites> {
    let pg = steward_testenv::postgres::Postgres::start()
        .await
        .context("starting PostgreSQL (the Databases' server)")?;
    let (sql, connection) = tokio_postgres::connect(&pg.url("postgres"), tokio_postgres::NoTls)
        .await
        .context("connecting to PostgreSQL")?;
    tokio::spawn(connection);
    // One statement each: several in one batch run as a transaction, which ALTER SYSTEM refuses.
    sql.batch_execute("ALTER SYSTEM SET log_statement = 'mod'")
        .await?;
    sql.batch_execute("SELECT pg_reload_conf()").await?;

    namespace(client, DB_NAMESPACE).await?;
    let admin: Secret = serde_json::from_value(json!({
        "metadata": {"name": "admin"},
        "stringData": {"username": pg.superuser(), "password": pg.password()}
    }))?;
    Api::<Secret>::namespaced(client.clone(), DB_NAMESPACE)
        .create(&PostParams::default(), &admin)
        .await?;
    let resync = (idle / 3).max(Duration::from_secs(2));
    let launch = launch(
        binary,
        log_dir,
        "database-operator",
        &[format!("--resync-interval={}s", resync.as_secs())],
    );
    let mut op = Replica::spawn(&launch, kubeconfig, 0)?;
    op.wait_ready(Duration::from_secs(120)).await?;

    let group = "database.steward.dev";
    let api = |kind: &str, plural: &str| -> Api<DynamicObject> {
        Api::namespaced_with(client.clone(), DB_NAMESPACE, &resource(group, kind, plural))
    };
    let (clusters, databases, roles) = (
        api("PostgresCluster", "postgresclusters"),
        api("Database", "databases"),
        api("DatabaseRole", "databaseroles"),
    );
    let meta = |kind: &str, name: String| json!({"apiVersion": format!("{group}/v1alpha1"), "kind": kind, "metadata": {"name": name}});
    let external =
        json!({"host": pg.host(), "port": pg.port(), "adminSecretRef": {"name": "admin"}});
    create_all(
        &clusters,
        (0..n)
            .map(|i| {
                let mut o = meta("PostgresCluster", format!("pg-{i}"));
                o["spec"] = json!({"instances": 1, "version": 16, "storage": {"size": "1Gi"}});
                o
            })
            .collect(),
    )
    .await?;
    create_all(
        &databases,
        (0..n)
            .map(|i| {
                let mut o = meta("Database", format!("db-{i}"));
                o["spec"] = json!({"external": external, "name": format!("db_{i}"), "owner": format!("owner_{i}"),
                    "schemas": [{"name": "app"}], "deletionPolicy": "Delete", "backupBeforeDelete": false});
                o
            })
            .collect(),
    )
    .await?;
    create_all(
        &roles,
        (0..n)
            .map(|i| {
                let mut o = meta("DatabaseRole", format!("reader-{i}"));
                o["spec"] = json!({"databaseRef": {"name": format!("db-{i}")}, "roleName": format!("reader_{i}"),
                    "privileges": "readOnly", "deletionPolicy": "Delete"});
                o
            })
            .collect(),
    )
    .await?;
    let converge = Duration::from_secs(300);
    wait_all("Databases Ready", &databases, n, converge, ready).await?;
    wait_all("DatabaseRoles Ready", &roles, n, converge, ready).await?;
    wait_all(
        "PostgresClusters observed",
        &clusters,
        n,
        converge,
        observed,
    )
    .await?;

    let log_start = pg.log_text().len();
    let w = restart_and_idle(client, baseline, &launch, kubeconfig, &mut op, idle).await?;
    let mut op = w.op;
    let log = pg.log_text();
    let changes: Vec<String> = log
        .get(log_start..)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("statement: "))
        .map(|l| l.split("statement: ").nth(1).unwrap_or(l).to_string())
        .collect();

    // Clean up: the Databases and roles are dropped by the operator (deletionPolicy Delete).
    let dp = DeleteParams::default();
    for api in [&roles, &databases, &clusters] {
        api.delete_collection(&dp, &Default::default()).await?;
    }
    let deadline = Instant::now() + converge;
    while Instant::now() < deadline && !databases.list(&Default::default()).await?.items.is_empty()
    {
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    op.signal("TERM")?;
    op.wait_exit(Duration::from_secs(30)).await.ok();
    Api::<Namespace>::all(client.clone())
        .delete(DB_NAMESPACE, &dp)
        .await
        .ok();
    Ok(IdleWrites {
        operator: "database-operator".into(),
        objects: format!("{n} PostgresClusters, {n} Databases, {n} DatabaseRoles"),
        window_secs: w.secs,
        resync_secs: Some(resync.as_secs_f64()),
        reconciles: w.reconciles,
        writes: w.writes,
        overlapped: w.overlapped,
        sql_changes: Some(changes.len()),
        sql_sample: changes.into_iter().take(5).collect(),
    })
}

/// The upgrade-orchestrator with `n` Succeeded UpgradePlans.
pub async fn upgrade_orchestrator(
    client: &Client,
    baseline: &BTreeMap<Key, f64>,
    binary: &Path,
    log_dir: &Path,
    kubeconfig: &Path,
    n: usize,
    idle: Duration,
) -> Result<IdleWrites> {
    namespace(client, UP_NAMESPACE).await?;
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), UP_NAMESPACE);
    for i in 0..n {
        let d: Deployment = serde_json::from_value(json!({
            "metadata": {"name": format!("d-{i}")},
            "spec": {"replicas": 1, "selector": {"matchLabels": {"app": format!("d-{i}")}},
                "template": {"metadata": {"labels": {"app": format!("d-{i}")}},
                    "spec": {"containers": [{"name": "app", "image": OLD}]}}}
        }))?;
        deployments.create(&PostParams::default(), &d).await?;
    }
    let launch = launch(binary, log_dir, "upgrade-orchestrator", &[]);
    let mut op = Replica::spawn(&launch, kubeconfig, 0)?;
    op.wait_ready(Duration::from_secs(120)).await?;
    let plans: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        UP_NAMESPACE,
        &resource("upgrade.steward.dev", "UpgradePlan", "upgradeplans"),
    );
    create_all(
        &plans,
        (0..n)
            .map(|i| {
                json!({"apiVersion": "upgrade.steward.dev/v1alpha1", "kind": "UpgradePlan",
                    "metadata": {"name": format!("p-{i}")},
                    "spec": {"components": [{"name": "app", "target": {"kind": "Deployment", "name": format!("d-{i}")},
                        "image": {"container": "app", "image": NEW}}]}})
            })
            .collect(),
    )
    .await?;
    wait_all(
        "UpgradePlans Succeeded",
        &plans,
        n,
        Duration::from_secs(300),
        |p| p.data["status"]["phase"] == "Succeeded",
    )
    .await?;
    let w = restart_and_idle(client, baseline, &launch, kubeconfig, &mut op, idle).await?;
    let mut op = w.op;
    op.signal("TERM")?;
    op.wait_exit(Duration::from_secs(30)).await.ok();
    Api::<Namespace>::all(client.clone())
        .delete(UP_NAMESPACE, &DeleteParams::default())
        .await
        .ok();
    Ok(IdleWrites {
        operator: "upgrade-orchestrator".into(),
        objects: format!("{n} Succeeded UpgradePlans (one Deployment each)"),
        window_secs: w.secs,
        resync_secs: None,
        reconciles: w.reconciles,
        writes: w.writes,
        overlapped: w.overlapped,
        sql_changes: None,
        sql_sample: Vec::new(),
    })
}
