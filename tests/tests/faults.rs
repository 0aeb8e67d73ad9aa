//! Control-plane faults in the middle of a convergence: kube-apiserver SIGKILLed and restarted,
//! etcd SIGKILLed and restarted, kube-apiserver paused (SIGSTOP) for 20 s.
//!
//! Invariant for every operator and fault: every object converges at its current generation
//! soon after the API server is ready again, with no duplicate children and without restarting
//! the operator, which stays healthy. Before steward-core gave each watch its own backoff, an
//! API server restart stalled the tenant-operator for 85–293 s (kube-runtime paused every
//! watch of a controller, the reconcile-all included, on any watch's error).
//!
//! Each test kills processes, so it starts its own control plane, and the tests run one at a
//! time. The figure each reports is the time from "API server ready" to "all converged"; the
//! assertion only bounds it generously (a stall is minutes, recovery is seconds).

#![allow(clippy::unwrap_used)] // tests fail loudly

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use database_operator::crd::{Database, DatabaseSpec, DeletionPolicy, ExternalServer};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Namespace, ResourceQuota, Secret};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, CustomResourceExt, ResourceExt};
use serde_json::json;
use steward_core::Operator;
use steward_core::cli::CommonArgs;
use steward_testenv::harness::{Harness, test_args};
use steward_testenv::postgres::Postgres;
use steward_testenv::{Component, ControlPlane, Options, eventually};
use tenant_operator::crd::{TENANT_LABEL, Tenant};
use upgrade_orchestrator::crd::UpgradePlan;

/// Recovery must be well below a stall (which lasted 85–293 s) yet tolerate a loaded machine
/// (and the controller-manager's own recovery, which the upgrade test waits for too).
const RECOVERY_BOUND: Duration = Duration::from_secs(45);
const SETUP: Duration = Duration::from_secs(600);

static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[derive(Clone, Copy, Debug)]
enum Fault {
    /// kube-apiserver SIGKILLed, started again 5 s later.
    ApiserverKill,
    /// etcd SIGKILLed, started again 5 s later.
    EtcdKill,
    /// kube-apiserver SIGSTOPped for 20 s, then SIGCONTed.
    ApiserverPause,
}

/// Injects `fault` and returns when the API server is ready again.
async fn inject(cp: &mut ControlPlane, fault: Fault) -> Instant {
    let timeout = Duration::from_secs(180);
    match fault {
        Fault::ApiserverKill => {
            cp.kill(Component::KubeApiserver);
            tokio::time::sleep(Duration::from_secs(5)).await;
            cp.start_again(Component::KubeApiserver, timeout)
                .await
                .expect("kube-apiserver back");
        }
        Fault::EtcdKill => {
            cp.kill(Component::Etcd);
            tokio::time::sleep(Duration::from_secs(5)).await;
            cp.start_again(Component::Etcd, timeout)
                .await
                .expect("etcd back");
        }
        Fault::ApiserverPause => {
            cp.pause(Component::KubeApiserver).expect("SIGSTOP");
            tokio::time::sleep(Duration::from_secs(20)).await;
            cp.resume(Component::KubeApiserver).expect("SIGCONT");
            cp.wait_apiserver_ready(timeout)
                .await
                .expect("kube-apiserver answers again");
        }
    }
    Instant::now()
}

async fn control_plane() -> ControlPlane {
    ControlPlane::start(Options {
        nodes: 1,
        ..Options::default()
    })
    .await
    .expect("control plane")
}

/// Flags of an operator with leader election (4 s / 3 s / 1 s, as in the report) in
/// `namespace`.
fn leader_args(namespace: &str) -> CommonArgs {
    CommonArgs {
        leader_elect: true,
        leader_election_namespace: Some(namespace.into()),
        leader_election_lease_duration: Duration::from_secs(4),
        leader_election_renew_deadline: Duration::from_secs(3),
        leader_election_retry_period: Duration::from_secs(1),
        ..test_args()
    }
}

/// Runs operator `name` with leader election, its Lease in `namespace` (and only that
/// namespace watched when `scoped`), registered by `register`.
async fn start_leading(
    cp: &ControlPlane,
    name: &str,
    namespace: &str,
    scoped: bool,
    register: impl FnOnce(&mut Operator),
) -> Harness {
    let args = CommonArgs {
        watch_namespace: scoped.then(|| namespace.to_string()),
        ..leader_args(namespace)
    };
    let mut operator = Operator::with_config(name, args, cp.config().clone())
        .unwrap()
        .backoff(Duration::from_millis(200), Duration::from_secs(5));
    register(&mut operator);
    Harness::start(operator).await
}

/// After recovery: the operator never stopped and says it is healthy.
async fn assert_alive(operator: &Harness, what: &str) {
    assert!(operator.is_running(), "{what}: the operator stopped");
    let (code, body) = operator.probe("/healthz").await.expect("/healthz");
    assert_eq!(code, 200, "{what}: /healthz {body}");
}

// ---------------------------------------------------------------------------------------------
// tenant-operator: 200 Tenants, each fault in turn

const TENANTS: usize = 200;

/// `Ok` when every Tenant is Ready at its generation and its namespace's quota allows `pods`;
/// also checks there is exactly one namespace and one quota per Tenant.
async fn tenants_converged(client: &Client, pods: u32) -> Result<(), String> {
    let tenants: Api<Tenant> = Api::all(client.clone());
    let list = tenants
        .list(&ListParams::default())
        .await
        .map_err(|e| e.to_string())?;
    let ready = list
        .items
        .iter()
        .filter(|t| {
            let s = t.status.clone().unwrap_or_default();
            s.observed_generation == t.metadata.generation
                && s.conditions
                    .iter()
                    .any(|c| c.type_ == "Ready" && c.status == "True")
        })
        .count();
    let quotas: Api<ResourceQuota> = Api::all(client.clone());
    let quotas = quotas
        .list(&ListParams::default().labels(TENANT_LABEL))
        .await
        .map_err(|e| e.to_string())?;
    let current = quotas
        .items
        .iter()
        .filter(|q| {
            q.spec
                .as_ref()
                .and_then(|s| s.hard.as_ref())
                .and_then(|h| h.get("pods"))
                .is_some_and(|p| p.0 == pods.to_string())
        })
        .count();
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let namespaces = namespaces
        .list(&ListParams::default().labels(TENANT_LABEL))
        .await
        .map_err(|e| e.to_string())?
        .items
        .len();
    if namespaces > TENANTS || quotas.items.len() > TENANTS {
        panic!(
            "duplicate children: {namespaces} namespaces and {} quotas for {TENANTS} Tenants",
            quotas.items.len()
        );
    }
    if ready == TENANTS && current == TENANTS && namespaces == TENANTS {
        Ok(())
    } else {
        Err(format!(
            "{ready}/{TENANTS} Tenants Ready at their generation, {current}/{TENANTS} quotas at pods={pods}, {namespaces} namespaces"
        ))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_operator_converges_after_each_control_plane_fault() {
    let _alone = ONE_AT_A_TIME.lock().await;
    let mut cp = control_plane().await;
    cp.apply_crd(&Tenant::crd()).await.expect("Tenant CRD");
    let client = cp.client().unwrap();
    let operator = start_leading(&cp, tenant_operator::NAME, "default", false, |op| {
        tenant_operator::register(op, tenant_operator::Options::default()).unwrap();
    })
    .await;

    let tenants: Api<Tenant> = Api::all(client.clone());
    let started = Instant::now();
    for i in 0..TENANTS {
        let t: Tenant = serde_json::from_value(json!({
            "apiVersion": "tenancy.steward.dev/v1alpha1", "kind": "Tenant",
            "metadata": {"name": format!("t{i:03}")},
            "spec": {
                "owners": [{"kind": "User", "name": format!("owner-{i}")}],
                "namespaces": [format!("t{i:03}-ns")],
                "resourceQuota": {"hard": {"pods": 10}},
            },
        }))
        .unwrap();
        tenants.create(&PostParams::default(), &t).await.unwrap();
    }
    eventually("200 Tenants Ready", SETUP, || {
        tenants_converged(&client, 10)
    })
    .await
    .expect("initial convergence");
    println!("{TENANTS} Tenants Ready in {:?}", started.elapsed());

    // Each fault: every Tenant patched just before it (work in flight when it hits), and
    // patched again as soon as the API server is ready (work that arrives after it: a stalled
    // controller would sit on it).
    let patch_all = |pods: u32| {
        let tenants = tenants.clone();
        async move {
            for i in 0..TENANTS {
                tenants
                    .patch(
                        &format!("t{i:03}"),
                        &PatchParams::default(),
                        &Patch::Merge(json!({"spec": {"resourceQuota": {"hard": {"pods": pods}}}})),
                    )
                    .await
                    .unwrap();
            }
        }
    };
    // The reference: the same two rounds of patches with no fault in between.
    let started = Instant::now();
    patch_all(18).await;
    patch_all(19).await;
    let client = cp.client().unwrap();
    eventually(
        "no fault: every Tenant at its new generation",
        Duration::from_secs(300),
        || tenants_converged(&client, 19),
    )
    .await
    .expect("converged without a fault");
    println!(
        "NO FAULT: {TENANTS} Tenants patched twice converged {:.1?} after the first patch",
        started.elapsed()
    );
    let mut figures = Vec::new();
    for (round, fault) in [Fault::ApiserverKill, Fault::EtcdKill, Fault::ApiserverPause]
        .into_iter()
        .enumerate()
    {
        let before = 20 + 2 * round as u32;
        patch_all(before).await;
        let ready_at = inject(&mut cp, fault).await;
        let after = before + 1;
        patch_all(after).await;
        let client = cp.client().unwrap();
        eventually(
            &format!("{fault:?}: every Tenant at its new generation"),
            Duration::from_secs(300),
            || tenants_converged(&client, after),
        )
        .await
        .unwrap_or_else(|e| panic!("{fault:?}: {e}"));
        let took = ready_at.elapsed();
        println!(
            "FAULT {fault:?}: {TENANTS} Tenants (patched before the fault and again after it) converged {took:.1?} after the API server was ready"
        );
        figures.push((fault, took));
        assert_alive(&operator, &format!("{fault:?}")).await;
    }
    for (fault, took) in figures {
        assert!(
            took <= RECOVERY_BOUND,
            "{fault:?}: converged only {took:?} after the API server was ready (bound {RECOVERY_BOUND:?})"
        );
    }
    operator.stop().await.expect("clean stop");
}

// ---------------------------------------------------------------------------------------------
// database-operator: Databases on an external PostgreSQL, API server restarted

const DATABASES: usize = 20;

async fn databases_converged(api: &Api<Database>, schemas: usize) -> Result<(), String> {
    let list = api
        .list(&ListParams::default())
        .await
        .map_err(|e| e.to_string())?;
    let done = list
        .items
        .iter()
        .filter(|d| {
            let s = d.status.clone().unwrap_or_default();
            d.spec.schemas.len() == schemas
                && s.observed_generation == d.metadata.generation
                && s.conditions
                    .iter()
                    .any(|c| c.type_ == "Ready" && c.status == "True")
        })
        .count();
    if done == DATABASES {
        Ok(())
    } else {
        Err(format!(
            "{done}/{DATABASES} Databases Ready at their generation"
        ))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_operator_converges_after_an_apiserver_restart() {
    let _alone = ONE_AT_A_TIME.lock().await;
    let mut cp = control_plane().await;
    for crd in database_operator::crds() {
        cp.apply_crd(&crd).await.expect("CRD");
    }
    let pg = Postgres::start().await.expect("PostgreSQL");
    let client = cp.client().unwrap();
    let ns = cp.namespace("dbfault").await.unwrap();
    let secret: Secret = serde_json::from_value(json!({
        "metadata": {"name": "admin"},
        "stringData": {"username": pg.superuser(), "password": pg.password()}
    }))
    .unwrap();
    Api::<Secret>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &secret)
        .await
        .unwrap();
    let operator = start_leading(&cp, database_operator::NAME, &ns, true, |op| {
        let options = database_operator::Options {
            // No resync help: recovery must come from the watches.
            resync_interval: Duration::from_secs(3600),
            ..Default::default()
        };
        database_operator::register(op, options).unwrap();
    })
    .await;

    let api: Api<Database> = Api::namespaced(client.clone(), &ns);
    for i in 0..DATABASES {
        let db = Database::new(
            &format!("db{i:02}"),
            DatabaseSpec {
                deletion_policy: DeletionPolicy::Retain,
                ..DatabaseSpec::on(
                    ExternalServer::plain("127.0.0.1", pg.port(), "admin"),
                    &format!("app{i:02}"),
                    &format!("app{i:02}_owner"),
                )
            },
        );
        api.create(&PostParams::default(), &db).await.unwrap();
    }
    eventually("Databases Ready", SETUP, || databases_converged(&api, 0))
        .await
        .expect("initial convergence");

    for i in 0..DATABASES {
        api.patch(
            &format!("db{i:02}"),
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"schemas": [{"name": "reports"}]}})),
        )
        .await
        .unwrap();
    }
    let ready_at = inject(&mut cp, Fault::ApiserverKill).await;
    let api: Api<Database> = Api::namespaced(cp.client().unwrap(), &ns);
    eventually(
        "every Database at its new generation",
        Duration::from_secs(300),
        || databases_converged(&api, 1),
    )
    .await
    .expect("converged after the restart");
    let took = ready_at.elapsed();
    println!(
        "FAULT ApiserverKill: {DATABASES} Databases converged {took:.1?} after the API server was ready"
    );
    // The schema really exists in every database.
    for i in 0..DATABASES {
        let (db, conn) = tokio_postgres::connect(
            &pg.conn_str(&format!("app{i:02}"), pg.superuser(), pg.password()),
            tokio_postgres::NoTls,
        )
        .await
        .unwrap();
        tokio::spawn(conn);
        let n: i64 = db
            .query_one(
                "SELECT count(*) FROM pg_namespace WHERE nspname = 'reports'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(n, 1, "schema reports in app{i:02}");
    }
    assert_alive(&operator, "ApiserverKill").await;
    assert!(
        took <= RECOVERY_BOUND,
        "converged only {took:?} after the API server was ready"
    );
    operator.stop().await.expect("clean stop");
}

// ---------------------------------------------------------------------------------------------
// upgrade-orchestrator: plans in flight, API server restarted

const PLANS: usize = 10;

fn deployment(name: &str, image: &str) -> Deployment {
    steward_integration_tests::deployment(name, image, 1)
}

async fn plans_phases(api: &Api<UpgradePlan>) -> Result<BTreeMap<String, usize>, String> {
    let mut phases = BTreeMap::new();
    for p in api
        .list(&ListParams::default())
        .await
        .map_err(|e| e.to_string())?
        .items
    {
        let phase = p
            .status
            .and_then(|s| s.phase)
            .map_or("None".to_string(), |p| format!("{p:?}"));
        *phases.entry(phase).or_default() += 1;
    }
    Ok(phases)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upgrade_orchestrator_finishes_plans_after_an_apiserver_restart() {
    let _alone = ONE_AT_A_TIME.lock().await;
    let mut cp = control_plane().await;
    cp.apply_crd(&UpgradePlan::crd()).await.expect("CRD");
    let client = cp.client().unwrap();
    let ns = cp.namespace("upfault").await.unwrap();
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    for i in 0..PLANS {
        for part in ["db", "api"] {
            deployments
                .create(
                    &PostParams::default(),
                    &deployment(&format!("{part}{i}"), "shop:1"),
                )
                .await
                .unwrap();
        }
    }
    let operator = start_leading(&cp, upgrade_orchestrator::NAME, &ns, true, |op| {
        let options = upgrade_orchestrator::Options {
            watch_postgresclusters: false,
            ..Default::default()
        };
        upgrade_orchestrator::register(op, options).unwrap();
    })
    .await;

    let plans: Api<UpgradePlan> = Api::namespaced(client.clone(), &ns);
    for i in 0..PLANS {
        let plan: UpgradePlan = serde_json::from_value(json!({
            "apiVersion": "upgrade.steward.dev/v1alpha1",
            "kind": "UpgradePlan",
            "metadata": {"name": format!("release{i}")},
            "spec": {
                "components": [
                    {"name": "db", "target": {"kind": "Deployment", "name": format!("db{i}")},
                     "image": {"container": "app", "image": "shop:2"}},
                    {"name": "api", "target": {"kind": "Deployment", "name": format!("api{i}")},
                     "image": {"container": "app", "image": "shop:2"}, "dependsOn": ["db"]},
                ],
                "strategy": {"maxConcurrent": 1, "progressDeadlineSeconds": 600, "failurePolicy": "Pause", "approval": "Automatic"}
            }
        }))
        .unwrap();
        plans.create(&PostParams::default(), &plan).await.unwrap();
    }
    eventually("every plan started", SETUP, || async {
        let phases = plans_phases(&plans).await?;
        let started = phases.get("Progressing").copied().unwrap_or(0)
            + phases.get("Succeeded").copied().unwrap_or(0);
        if started == PLANS {
            Ok(())
        } else {
            Err(format!("{phases:?}"))
        }
    })
    .await
    .expect("plans started");

    let ready_at = inject(&mut cp, Fault::ApiserverKill).await;
    let plans: Api<UpgradePlan> = Api::namespaced(cp.client().unwrap(), &ns);
    eventually("every plan Succeeded", Duration::from_secs(300), || async {
        let phases = plans_phases(&plans).await?;
        if phases.get("Succeeded") == Some(&PLANS) {
            Ok(())
        } else {
            Err(format!("{phases:?}"))
        }
    })
    .await
    .expect("plans finished after the restart");
    let took = ready_at.elapsed();
    println!(
        "FAULT ApiserverKill: {PLANS} UpgradePlans (2 components each) Succeeded {took:.1?} after the API server was ready"
    );
    let deployments: Api<Deployment> = Api::namespaced(cp.client().unwrap(), &ns);
    for d in deployments.list(&ListParams::default()).await.unwrap() {
        let image = d.spec.template.spec.as_ref().unwrap().containers[0]
            .image
            .clone()
            .unwrap_or_default();
        assert_eq!(image, "shop:2", "{} upgraded", d.name_any());
    }
    assert_alive(&operator, "ApiserverKill").await;
    assert!(
        took <= RECOVERY_BOUND,
        "finished only {took:?} after the API server was ready"
    );
    operator.stop().await.expect("clean stop");
}
