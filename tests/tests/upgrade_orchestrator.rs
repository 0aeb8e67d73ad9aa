//! The upgrade-orchestrator against a real control plane: kube-apiserver, controller-manager,
//! scheduler and kwok nodes, so Deployments, StatefulSets and DaemonSets really roll.
//!
//! Each test runs its own orchestrator in-process, limited to its own namespace.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::apps::v1::{
    DaemonSet, DaemonSetSpec, Deployment, DeploymentStrategy, RollingUpdateDeployment, StatefulSet,
    StatefulSetSpec,
};
use k8s_openapi::api::core::v1::{
    Affinity, Node, PodAffinityTerm, PodAntiAffinity, PodSpec, PodTemplateSpec,
};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use serde_json::json;
use steward_core::Operator;
use steward_core::cli::CommonArgs;
use steward_testenv::harness::Harness;
use steward_testenv::{ControlPlane, eventually};
use tokio::task::JoinHandle;

use upgrade_orchestrator::crd::{
    Approval, Component, ComponentPhase, ComponentRollback, ComponentStatus, FailurePolicy,
    FieldChange, HealthCheck, MaintenanceWindow, PlanPhase, Strategy, TargetRef, UpgradePlan,
    UpgradePlanStatus,
};
use upgrade_orchestrator::health::{self, Health};

#[path = "support/fixtures.rs"]
mod fixtures;
use fixtures::{component, plan};

const ROLL: Duration = Duration::from_secs(180);
/// How long a plan may take to be reported valid or invalid.
const WAIT_VALID: Duration = Duration::from_secs(30);

// ---------------------------------------------------------------------------------------------
// Harness

struct Env {
    cp: &'static ControlPlane,
    client: Client,
    ns: String,
}

impl Env {
    async fn new(prefix: &str) -> Self {
        let cp = steward_testenv::shared().await.expect("control plane");
        cp.apply_crd(&<UpgradePlan as kube::CustomResourceExt>::crd())
            .await
            .expect("install UpgradePlan CRD");
        let ns = cp.namespace(prefix).await.expect("namespace");
        Self {
            cp,
            client: cp.client().expect("client"),
            ns,
        }
    }

    fn plans(&self) -> Api<UpgradePlan> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    fn api<K>(&self) -> Api<K>
    where
        K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>,
    {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    fn args(&self) -> CommonArgs {
        CommonArgs {
            leader_elect: false,
            metrics_bind_address: "127.0.0.1:0".into(),
            health_probe_bind_address: "127.0.0.1:0".into(),
            watch_namespace: Some(self.ns.clone()),
            ..Default::default()
        }
    }

    /// Starts an orchestrator for this namespace on the test's runtime.
    async fn start(&self) -> Harness {
        self.start_with(upgrade_orchestrator::Options {
            watch_postgresclusters: false,
            ..Default::default()
        })
        .await
    }

    async fn start_with(&self, options: upgrade_orchestrator::Options) -> Harness {
        let mut op = Operator::with_config(
            upgrade_orchestrator::NAME,
            self.args(),
            self.cp.config().clone(),
        )
        .expect("operator")
        .backoff(Duration::from_millis(200), Duration::from_secs(2));
        upgrade_orchestrator::register(&mut op, options).expect("register");
        Harness::start(op).await
    }

    async fn create_plan(&self, plan: UpgradePlan) -> UpgradePlan {
        self.plans()
            .create(&PostParams::default(), &plan)
            .await
            .expect("create plan")
    }

    /// Creates `plan`, which admission must refuse, and asserts the refusal says `why`.
    async fn assert_refused(&self, plan: UpgradePlan, why: &str) {
        let name = plan.name_any();
        let refused = self
            .plans()
            .create(&PostParams::default(), &plan)
            .await
            .expect_err(&format!("plan {name} is refused at admission"));
        assert!(refused.to_string().contains(why), "{name}: {refused}");
    }

    async fn status(&self, plan: &str) -> UpgradePlanStatus {
        self.plans()
            .get(plan)
            .await
            .expect("get plan")
            .status
            .unwrap_or_default()
    }

    /// Waits until the plan is in one of `phases` and returns its status.
    async fn wait_phase(
        &self,
        plan: &str,
        phases: &[PlanPhase],
        timeout: Duration,
    ) -> UpgradePlanStatus {
        self.wait_phase_until(plan, timeout, |s| {
            s.phase.is_some_and(|ph| phases.contains(&ph))
        })
        .await
    }

    /// Waits until the plan has finished and asserts that it rolled back.
    async fn wait_rolled_back(&self, plan: &str) -> UpgradePlanStatus {
        let finished = [
            PlanPhase::RolledBack,
            PlanPhase::Failed,
            PlanPhase::Succeeded,
        ];
        let status = self.wait_phase(plan, &finished, ROLL).await;
        assert_eq!(
            status.phase,
            Some(PlanPhase::RolledBack),
            "{}",
            describe(&status)
        );
        status
    }

    /// Waits until `done` holds for the plan's status and returns it.
    async fn wait_phase_until(
        &self,
        plan: &str,
        timeout: Duration,
        done: impl Fn(&UpgradePlanStatus) -> bool,
    ) -> UpgradePlanStatus {
        let plans = self.plans();
        let done = &done;
        eventually(&format!("plan {plan}"), timeout, || {
            let plans = plans.clone();
            async move {
                let p = plans.get(plan).await.map_err(|e| e.to_string())?;
                let status = p.status.unwrap_or_default();
                if done(&status) {
                    Ok(status)
                } else {
                    Err(describe(&status))
                }
            }
        })
        .await
        .expect("plan status")
    }

    /// Waits until the plan's component `component` is in `phase` and returns the plan's
    /// status.
    async fn wait_component(
        &self,
        plan: &str,
        component: &str,
        phase: ComponentPhase,
    ) -> UpgradePlanStatus {
        self.wait_phase_until(plan, ROLL, |s| {
            s.components
                .iter()
                .any(|c| c.name == component && c.phase == phase)
        })
        .await
    }

    /// Waits until the plan reports `Valid=False` and returns its status.
    /// Waits until `plan` ends (Succeeded, Paused or Failed) within [`ROLL`] and asserts it
    /// succeeded; its status.
    async fn wait_succeeded(&self, plan: &str) -> UpgradePlanStatus {
        let status = self
            .wait_phase(
                plan,
                &[PlanPhase::Succeeded, PlanPhase::Paused, PlanPhase::Failed],
                ROLL,
            )
            .await;
        assert_eq!(
            status.phase,
            Some(PlanPhase::Succeeded),
            "{plan}: {}",
            describe(&status)
        );
        status
    }

    async fn wait_invalid(&self, plan: &str) -> UpgradePlanStatus {
        let plans = self.plans();
        eventually(&format!("plan {plan} reported invalid"), WAIT_VALID, || {
            let plans = plans.clone();
            async move {
                let s = plans
                    .get(plan)
                    .await
                    .map_err(|e| e.to_string())?
                    .status
                    .unwrap_or_default();
                match steward_core::conditions::get(&s.conditions, "Valid") {
                    Some(c) if c.status == "False" => Ok(s),
                    _ => Err(describe(&s)),
                }
            }
        })
        .await
        .expect("Valid=False")
    }

    /// PostgresClusters of this namespace, as dynamic objects.
    fn postgres_clusters(&self) -> Api<kube::api::DynamicObject> {
        let resource = kube::api::ApiResource {
            group: "database.steward.dev".into(),
            version: "v1alpha1".into(),
            api_version: "database.steward.dev/v1alpha1".into(),
            kind: "PostgresCluster".into(),
            plural: "postgresclusters".into(),
        };
        Api::namespaced_with(self.client.clone(), &self.ns, &resource)
    }

    async fn patch_plan(&self, plan: &str, patch: serde_json::Value) {
        self.plans()
            .patch(plan, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .expect("patch plan");
    }

    /// Waits until Events about `plan` with each of `reasons` exist (they are published just
    /// after the status write that a test may have seen first).
    async fn expect_events(&self, plan: &str, reasons: &[&str]) {
        eventually(
            &format!("Events {reasons:?} about {plan}"),
            Duration::from_secs(10),
            || async {
                let seen = self.event_reasons(plan).await;
                let missing: Vec<&&str> = reasons
                    .iter()
                    .filter(|r| !seen.iter().any(|s| s == **r))
                    .collect();
                if missing.is_empty() {
                    Ok(())
                } else {
                    Err(format!("missing {missing:?} in {seen:?}"))
                }
            },
        )
        .await
        .expect("events");
    }

    /// Reasons of the Events about `plan`.
    async fn event_reasons(&self, plan: &str) -> Vec<String> {
        let events: Api<Event> = self.api();
        events
            .list(&ListParams::default())
            .await
            .expect("events")
            .items
            .into_iter()
            .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(plan))
            .filter_map(|e| e.reason)
            .collect()
    }

    async fn node_count(&self) -> usize {
        Api::<Node>::all(self.client.clone())
            .list(&ListParams::default())
            .await
            .expect("nodes")
            .items
            .len()
    }
}

/// The plan reconciles so far, whatever their result.
fn reconciles(metrics: &steward_core::metrics::Metrics) -> u64 {
    ["success", "error", "skipped"]
        .iter()
        .map(|result| {
            metrics
                .reconcile_total
                .get_or_create(&steward_core::metrics::ResultLabels {
                    controller: upgrade_orchestrator::CONTROLLER.into(),
                    result: (*result).into(),
                })
                .get()
        })
        .sum()
}

/// Makes the orchestrator look at `plan` again, and waits until it has: once no reconcile
/// is running and the count is steady, an annotation on the plan (a watch event, no
/// spec change) must be followed by one more reconcile. What the test asserts as
/// "nothing changed" afterwards was decided by the operator, not by a sleep that passes
/// when the operator is slow.
async fn looked_again(metrics: &steward_core::metrics::Metrics, env: &Env, plan: &str) {
    let workers = || {
        metrics
            .active_workers
            .get_or_create(&steward_core::metrics::ControllerLabels {
                controller: upgrade_orchestrator::CONTROLLER.into(),
            })
            .get()
    };
    // Settled: no reconcile running and the count steady over 200 ms.
    let settle_by = Instant::now() + WAIT_VALID;
    let mut from = reconciles(metrics);
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let now = reconciles(metrics);
        if workers() == 0 && now == from {
            break;
        }
        assert!(Instant::now() < settle_by, "plan reconciles never settled");
        from = now;
    }
    let nudge = json!({"metadata": {"annotations": {"test.steward.dev/nudge": from.to_string()}}});
    env.plans()
        .patch(plan, &PatchParams::default(), &Patch::Merge(&nudge))
        .await
        .expect("annotate plan");
    eventually("one more plan reconcile", WAIT_VALID, || async {
        let now = reconciles(metrics);
        if now > from {
            Ok(())
        } else {
            Err("none yet".to_string())
        }
    })
    .await
    .expect("reconciled again");
}

fn describe(status: &UpgradePlanStatus) -> String {
    let comps: Vec<String> = status
        .components
        .iter()
        .map(|c| {
            format!(
                "{}={}{}",
                c.name,
                c.phase.as_str(),
                c.message
                    .as_deref()
                    .map(|m| format!(" ({m})"))
                    .unwrap_or_default()
            )
        })
        .collect();
    let ready = steward_core::conditions::get(&status.conditions, "Ready")
        .map(|c| c.message.clone())
        .unwrap_or_default();
    let valid = steward_core::conditions::get(&status.conditions, "Valid")
        .map(|c| c.message.clone())
        .unwrap_or_default();
    format!(
        "phase {:?}: {ready} [{}] valid: {valid}",
        status.phase,
        comps.join(", ")
    )
}

fn comp<'a>(status: &'a UpgradePlanStatus, name: &str) -> &'a ComponentStatus {
    status
        .components
        .iter()
        .find(|c| c.name == name)
        .unwrap_or_else(|| panic!("no component {name} in {status:?}"))
}

fn micros(t: &Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime>) -> i64 {
    t.as_ref()
        .map(|t| t.0.as_microsecond())
        .expect("timestamp set")
}

// ---------------------------------------------------------------------------------------------
// Fixtures

/// One container `app` running `image`, stopped at once.
fn pod(image: &str) -> PodSpec {
    PodSpec {
        termination_grace_period_seconds: Some(0),
        ..fixtures::pod_spec([fixtures::container("app", image)])
    }
}

fn template(app: &str, image: &str) -> PodTemplateSpec {
    fixtures::pod_template(app, pod(image))
}

fn deployment(name: &str, image: &str) -> Deployment {
    steward_integration_tests::deployment(name, image, 2)
}

fn statefulset(name: &str, image: &str) -> StatefulSet {
    StatefulSet {
        metadata: fixtures::meta(name),
        spec: StatefulSetSpec {
            replicas: Some(2),
            service_name: Some(name.into()),
            selector: fixtures::app_selector(name),
            template: template(name, image),
            ..StatefulSetSpec::default()
        },
        ..StatefulSet::default()
    }
}

fn daemonset(name: &str, image: &str) -> DaemonSet {
    DaemonSet {
        metadata: fixtures::meta(name),
        spec: DaemonSetSpec {
            selector: fixtures::app_selector(name),
            template: template(name, image),
            ..DaemonSetSpec::default()
        },
        ..DaemonSet::default()
    }
}

/// A Deployment whose next rollout can never finish: one replica per node, required
/// anti-affinity between its pods, and `maxUnavailable: 0`. Every node already runs one of
/// its pods, so the surge pod of a new template cannot be scheduled, and the old pods are
/// never removed. (kwok makes any scheduled pod Ready whatever its image, so the failure has
/// to come from scheduling.)
fn stuck_on_update(
    name: &str,
    image: &str,
    replicas: usize,
    progress_deadline: Option<i32>,
) -> Deployment {
    let spread = PodSpec {
        affinity: Some(Affinity {
            pod_anti_affinity: Some(PodAntiAffinity {
                required_during_scheduling_ignored_during_execution: Some(vec![PodAffinityTerm {
                    label_selector: Some(fixtures::app_selector(name)),
                    topology_key: "kubernetes.io/hostname".into(),
                    ..PodAffinityTerm::default()
                }]),
                ..PodAntiAffinity::default()
            }),
            ..Affinity::default()
        }),
        ..pod(image)
    };
    let mut d = fixtures::deployment(name, i32::try_from(replicas).expect("replicas"), spread);
    d.spec.strategy = Some(DeploymentStrategy {
        type_: Some("RollingUpdate".into()),
        rolling_update: Some(RollingUpdateDeployment {
            max_surge: Some(IntOrString::Int(1)),
            max_unavailable: Some(IntOrString::Int(0)),
        }),
    });
    d.spec.progress_deadline_seconds = progress_deadline;
    d
}

/// A plan's strategy: at most `max_concurrent` components at a time, each within
/// `progress_deadline_seconds`, the rest as by default.
fn concurrent(max_concurrent: i32, progress_deadline_seconds: i32) -> Strategy {
    Strategy {
        max_concurrent,
        progress_deadline_seconds,
        ..Strategy::default()
    }
}

/// A plan's strategy: roll back on failure, the rest as by default.
fn rollback() -> Strategy {
    Strategy {
        failure_policy: FailurePolicy::Rollback,
        ..Strategy::default()
    }
}

/// A plan's strategy: on failure `failure_policy`, each component within
/// `progress_deadline_seconds`.
fn on_failure(failure_policy: FailurePolicy, progress_deadline_seconds: i32) -> Strategy {
    Strategy {
        failure_policy,
        progress_deadline_seconds,
        ..Strategy::default()
    }
}

/// Creates the workloads and waits until each has rolled out.
async fn create_and_wait(
    env: &Env,
    deployments: &[Deployment],
    statefulsets: &[StatefulSet],
    daemonsets: &[DaemonSet],
) {
    for d in deployments {
        env.api::<Deployment>()
            .create(&PostParams::default(), d)
            .await
            .expect("create deployment");
    }
    for s in statefulsets {
        env.api::<StatefulSet>()
            .create(&PostParams::default(), s)
            .await
            .expect("create statefulset");
    }
    for d in daemonsets {
        env.api::<DaemonSet>()
            .create(&PostParams::default(), d)
            .await
            .expect("create daemonset");
    }
    let env_ref = &env;
    eventually("workloads rolled out", ROLL, || async move {
        let mut waiting = Vec::new();
        for d in env_ref
            .api::<Deployment>()
            .list(&ListParams::default())
            .await
            .map_err(|e| e.to_string())?
            .items
        {
            if let h @ (Health::Progressing(_) | Health::Failed(_)) = health::deployment(&d) {
                waiting.push(format!("Deployment {}: {h:?}", d.name_any()));
            }
        }
        for s in env_ref
            .api::<StatefulSet>()
            .list(&ListParams::default())
            .await
            .map_err(|e| e.to_string())?
            .items
        {
            if let h @ (Health::Progressing(_) | Health::Failed(_)) = health::statefulset(&s) {
                waiting.push(format!("StatefulSet {}: {h:?}", s.name_any()));
            }
        }
        for d in env_ref
            .api::<DaemonSet>()
            .list(&ListParams::default())
            .await
            .map_err(|e| e.to_string())?
            .items
        {
            if let h @ (Health::Progressing(_) | Health::Failed(_)) = health::daemonset(&d) {
                waiting.push(format!("DaemonSet {}: {h:?}", d.name_any()));
            }
        }
        if waiting.is_empty() {
            Ok(())
        } else {
            Err(waiting.join("; "))
        }
    })
    .await
    .expect("initial rollout (if this times out, kwok pods are not becoming Ready)");
}

async fn deployment_image(env: &Env, name: &str) -> (String, i64) {
    let d = env
        .api::<Deployment>()
        .get(name)
        .await
        .expect("get deployment");
    (
        d.spec.template.spec.as_ref().expect("pod spec").containers[0]
            .image
            .clone()
            .unwrap_or_default(),
        d.metadata.generation.unwrap_or(0),
    )
}

fn managed_by_orchestrator(
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
) -> bool {
    meta.managed_fields
        .iter()
        .flatten()
        .any(|m| m.manager.as_deref() == Some(upgrade_orchestrator::NAME))
}

/// Records, from the test's own watches, when each workload's spec first carried its new
/// image and when it first became healthy with it: an outside view of the orchestration.
#[derive(Default, Debug, Clone)]
struct Seen {
    changed: Option<Instant>,
    healthy: Option<Instant>,
}

type Timeline = Arc<Mutex<BTreeMap<String, Seen>>>;

fn watch_timeline(
    env: &Env,
    new_images: BTreeMap<String, String>,
) -> (Timeline, Vec<JoinHandle<()>>) {
    let seen: Timeline = Arc::default();
    let record = {
        let seen = seen.clone();
        move |name: String, image: Option<String>, health: Health| {
            let Some(want) = new_images.get(&name) else {
                return;
            };
            if image.as_ref() != Some(want) {
                return;
            }
            let mut seen = seen.lock().expect("lock");
            let entry = seen.entry(name).or_default();
            entry.changed.get_or_insert_with(Instant::now);
            if health.is_healthy() {
                entry.healthy.get_or_insert_with(Instant::now);
            }
        }
    };
    let image = |spec: Option<&k8s_openapi::api::core::v1::PodSpec>| {
        spec.and_then(|s| s.containers.first())
            .and_then(|c| c.image.clone())
    };
    let mut tasks = Vec::new();
    {
        let record = record.clone();
        let stream = watcher(env.api::<Deployment>(), watcher::Config::default()).applied_objects();
        tasks.push(tokio::spawn(stream.for_each(move |d| {
            if let Ok(d) = d {
                record(
                    d.name_any(),
                    image(d.spec.template.spec.as_ref()),
                    health::deployment(&d),
                );
            }
            futures::future::ready(())
        })));
    }
    {
        let record = record.clone();
        let stream =
            watcher(env.api::<StatefulSet>(), watcher::Config::default()).applied_objects();
        tasks.push(tokio::spawn(stream.for_each(move |s| {
            if let Ok(s) = s {
                record(
                    s.name_any(),
                    image(s.spec.template.spec.as_ref()),
                    health::statefulset(&s),
                );
            }
            futures::future::ready(())
        })));
    }
    {
        let stream = watcher(env.api::<DaemonSet>(), watcher::Config::default()).applied_objects();
        tasks.push(tokio::spawn(stream.for_each(move |d| {
            if let Ok(d) = d {
                record(
                    d.name_any(),
                    image(d.spec.template.spec.as_ref()),
                    health::daemonset(&d),
                );
            }
            futures::future::ready(())
        })));
    }
    (seen, tasks)
}

// ---------------------------------------------------------------------------------------------
// 1. Diamond over four workloads of three kinds

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn diamond_plan_upgrades_in_dependency_order() {
    let env = Env::new("uo-diamond").await;
    create_and_wait(
        &env,
        &[deployment("api", "api:1"), deployment("worker", "worker:1")],
        &[statefulset("db", "db:1")],
        &[daemonset("web", "web:1")],
    )
    .await;
    let before: BTreeMap<&str, i64> = BTreeMap::from([
        ("api", deployment_image(&env, "api").await.1),
        ("worker", deployment_image(&env, "worker").await.1),
        (
            "db",
            env.api::<StatefulSet>()
                .get("db")
                .await
                .expect("db")
                .metadata
                .generation
                .unwrap_or(0),
        ),
        (
            "web",
            env.api::<DaemonSet>()
                .get("web")
                .await
                .expect("web")
                .metadata
                .generation
                .unwrap_or(0),
        ),
    ]);
    let new_images: BTreeMap<String, String> = ["api", "worker", "db", "web"]
        .iter()
        .map(|n| (n.to_string(), format!("{n}:2")))
        .collect();
    let (timeline, watchers) = watch_timeline(&env, new_images);

    let op = env.start().await;
    let started = Instant::now();
    env.create_plan(plan(
        "release",
        vec![
            component("web", "DaemonSet", "web:2", &["api", "worker"]),
            component("api", "Deployment", "api:2", &["db"]),
            component("worker", "Deployment", "worker:2", &["db"]),
            component("db", "StatefulSet", "db:2", &[]),
        ],
        concurrent(2, 120),
    ))
    .await;
    let status = env
        .wait_phase(
            "release",
            &[
                PlanPhase::Succeeded,
                PlanPhase::Failed,
                PlanPhase::RolledBack,
                PlanPhase::Paused,
            ],
            ROLL,
        )
        .await;
    let total = started.elapsed();
    assert_eq!(
        status.phase,
        Some(PlanPhase::Succeeded),
        "{}",
        describe(&status)
    );
    assert_eq!(status.progress.as_deref(), Some("4/4"));
    assert_eq!(status.waves, Some(3));

    // Every component started after each of its dependencies finished (status timestamps, µs).
    let deps: &[(&str, &[&str])] = &[
        ("db", &[]),
        ("api", &["db"]),
        ("worker", &["db"]),
        ("web", &["api", "worker"]),
    ];
    for (name, ds) in deps {
        let c = comp(&status, name);
        assert_eq!(c.phase, ComponentPhase::Succeeded);
        assert_eq!(c.previous.as_deref(), Some(format!("{name}:1").as_str()));
        assert_eq!(c.target.as_deref(), Some(format!("{name}:2").as_str()));
        assert!(micros(&c.finished_at) > micros(&c.started_at));
        for d in *ds {
            assert!(
                micros(&c.started_at) >= micros(&comp(&status, d).finished_at),
                "{name} started before its dependency {d} finished"
            );
        }
    }
    // api and worker ran side by side (maxConcurrent 2): both started in one step.
    assert_eq!(
        comp(&status, "api").started_at,
        comp(&status, "worker").started_at
    );

    // Each target changed exactly once, by the orchestrator.
    let api = env.api::<Deployment>().get("api").await.expect("api");
    let db = env.api::<StatefulSet>().get("db").await.expect("db");
    let web = env.api::<DaemonSet>().get("web").await.expect("web");
    assert_eq!(api.metadata.generation, Some(before["api"] + 1));
    assert_eq!(db.metadata.generation, Some(before["db"] + 1));
    assert_eq!(web.metadata.generation, Some(before["web"] + 1));
    assert_eq!(
        deployment_image(&env, "worker").await,
        ("worker:2".to_string(), before["worker"] + 1)
    );
    assert!(
        managed_by_orchestrator(&api.metadata)
            && managed_by_orchestrator(&db.metadata)
            && managed_by_orchestrator(&web.metadata)
    );
    assert_eq!(health::statefulset(&db), Health::Healthy);
    assert_eq!(health::daemonset(&web), Health::Healthy);

    // The outside view: the test's own watches saw each target change only after its
    // dependencies were healthy; the gap is the orchestration overhead.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let seen = timeline.lock().expect("lock").clone();
    for w in watchers {
        w.abort();
    }
    let mut overheads = Vec::new();
    for (name, ds) in deps {
        let changed = seen[*name].changed.expect("change seen");
        for d in *ds {
            let healthy = seen[*d].healthy.expect("health seen");
            assert!(
                changed > healthy,
                "{name} changed before {d} was healthy (seen by the test's watch)"
            );
        }
        if let Some(last_dep) = ds.iter().map(|d| seen[*d].healthy.expect("healthy")).max() {
            overheads.push((name.to_string(), changed.duration_since(last_dep)));
        }
    }
    eprintln!(
        "diamond plan: {total:.2?} end to end; overhead from last dependency healthy to target changed (test's watch): {overheads:?}"
    );
    for (name, d) in &overheads {
        assert!(*d < Duration::from_secs(5), "{name}: overhead {d:?}");
    }

    env.expect_events(
        "release",
        &[
            "PlanStarted",
            "ComponentStarted",
            "TargetChanged",
            "ComponentSucceeded",
            "PlanSucceeded",
        ],
    )
    .await;
    let metrics = op.metrics().encode();
    assert!(
        metrics.contains(r#"steward_upgrade_component_duration_seconds_count{kind="Deployment",result="succeeded"} 2"#),
        "{metrics}"
    );
    assert!(
        metrics.contains("steward_upgrade_plans_in_progress 0"),
        "{metrics}"
    );
    op.stop().await.expect("clean shutdown");
}

// ---------------------------------------------------------------------------------------------
// 2. A component that cannot become healthy

/// `front` (fine) then `back` (its new pods cannot be scheduled).
async fn failing_plan(
    env: &Env,
    plan_name: &str,
    strategy: Strategy,
    back_progress_deadline: Option<i32>,
) {
    let nodes = env.node_count().await;
    create_and_wait(
        env,
        &[
            deployment("front", "front:1"),
            stuck_on_update("back", "back:1", nodes, back_progress_deadline),
        ],
        &[],
        &[],
    )
    .await;
    env.create_plan(plan(
        plan_name,
        vec![
            component("front", "Deployment", "front:2", &[]),
            component("back", "Deployment", "back:2", &["front"]),
        ],
        strategy,
    ))
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_component_rolls_back_every_upgraded_component() {
    let env = Env::new("uo-rollback").await;
    let op = env.start().await;
    let deadline: i64 = 15;
    failing_plan(
        &env,
        "risky",
        on_failure(
            FailurePolicy::Rollback,
            i32::try_from(deadline).expect("deadline"),
        ),
        None,
    )
    .await;
    let (_, front_generation) = deployment_image(&env, "front").await;
    let (_, back_generation) = deployment_image(&env, "back").await;

    let status = env
        .wait_phase(
            "risky",
            &[
                PlanPhase::RolledBack,
                PlanPhase::Failed,
                PlanPhase::Succeeded,
            ],
            ROLL,
        )
        .await;
    assert_eq!(
        status.phase,
        Some(PlanPhase::RolledBack),
        "{}",
        describe(&status)
    );
    let front = comp(&status, "front");
    let back = comp(&status, "back");
    assert_eq!(
        (front.phase, back.phase),
        (ComponentPhase::RolledBack, ComponentPhase::RolledBack)
    );
    // back failed on the plan's deadline, then reverted first; front was reverted after it.
    let failed_after = micros(&back.finished_at) - micros(&back.started_at);
    assert!(
        failed_after >= deadline * 1_000_000,
        "back failed after {failed_after} µs"
    );
    assert!(
        micros(&front.rollback_started_at) >= micros(&back.rolled_back_at),
        "reverse dependency order"
    );
    // Exactly the previous images, each changed once and reverted once.
    assert_eq!(
        deployment_image(&env, "front").await,
        ("front:1".to_string(), front_generation + 2)
    );
    assert_eq!(
        deployment_image(&env, "back").await,
        ("back:1".to_string(), back_generation + 2)
    );
    for name in ["front", "back"] {
        let d = env.api::<Deployment>().get(name).await.expect("get");
        assert_eq!(
            health::deployment(&d),
            Health::Healthy,
            "{name} is healthy on its old image again"
        );
    }
    assert!(!steward_core::conditions::is_true(
        &status.conditions,
        "Ready"
    ));
    assert!(steward_core::conditions::is_true(
        &status.conditions,
        "Degraded"
    ));
    env.expect_events(
        "risky",
        &[
            "ComponentFailed",
            "RollbackStarted",
            "TargetReverted",
            "ComponentRolledBack",
            "PlanRolledBack",
        ],
    )
    .await;
    eprintln!(
        "rollback: back failed after {:.1}s (deadline {deadline}s); plan started {} -> rolled back {}",
        failed_after as f64 / 1e6,
        micros(&status.started_at),
        micros(&status.finished_at)
    );
    op.stop().await.expect("clean shutdown");
}

/// A reconcile handed a stale copy of a plan must not re-apply what the stored plan already
/// undid. The interleaving, reproduced exactly: a copy is kept while `back`'s change is
/// recorded and `Progressing`; the plan then fails, rolls back and reverts both targets; the
/// reconcile function is called with the kept copy. Its recorded change still "applies" (the
/// JSON-patch `test` of the old value passes on the reverted target), so only the check that
/// the copy is current keeps `back:2` from being deployed again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_copy_of_a_rolled_back_plan_changes_nothing() {
    use steward_core::Context;
    use upgrade_orchestrator::metrics::PlanMetrics;
    use upgrade_orchestrator::reconcile::{Data, reconcile};

    let env = Env::new("uo-stale").await;
    let op = env.start().await;
    // back's Deployment reports ProgressDeadlineExceeded after 5 s: the plan rolls back.
    failing_plan(
        &env,
        "stale",
        on_failure(FailurePolicy::Rollback, 300),
        Some(5),
    )
    .await;
    let plans = env.plans();
    let stale = eventually("back's change recorded and Progressing", ROLL, || {
        let plans = plans.clone();
        async move {
            let plan = plans.get("stale").await.map_err(|e| e.to_string())?;
            let status = plan.status.clone().unwrap_or_default();
            let back = status.components.iter().find(|c| c.name == "back");
            if back.is_some_and(|c| c.phase == ComponentPhase::Progressing) {
                Ok(plan)
            } else {
                Err(describe(&status))
            }
        }
    })
    .await
    .expect("a copy while back is Progressing");
    let status = env
        .wait_phase("stale", &[PlanPhase::RolledBack], ROLL)
        .await;
    op.stop().await.expect("clean shutdown");
    let reverted = [
        deployment_image(&env, "front").await,
        deployment_image(&env, "back").await,
    ];
    assert_eq!(
        [reverted[0].0.as_str(), reverted[1].0.as_str()],
        ["front:1", "back:1"],
        "{}",
        describe(&status)
    );

    let metrics = steward_core::metrics::Metrics::new();
    let data = Data {
        metrics: PlanMetrics::register(&metrics, kube::runtime::reflector::store().0),
        default_service_account: None,
    };
    let ctx = Arc::new(Context::new(
        env.client.clone(),
        upgrade_orchestrator::NAME,
        data,
    ));
    reconcile(Arc::new(stale), ctx)
        .await
        .expect("the stale reconcile ends without an error");
    assert_eq!(
        [
            deployment_image(&env, "front").await,
            deployment_image(&env, "back").await,
        ],
        reverted,
        "the stale copy changed a target (image, generation)"
    );
    assert_eq!(env.status("stale").await.phase, Some(PlanPhase::RolledBack));
}

/// A component starts as soon as its own dependencies are upgraded and healthy: `after`
/// (depending on `fast` only) does not wait for `stuck`, which shares `fast`'s wave.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_component_waits_only_for_its_own_dependencies() {
    let env = Env::new("uo-dag").await;
    let nodes = env.node_count().await;
    create_and_wait(
        &env,
        &[
            deployment("fast", "fast:1"),
            deployment("after", "after:1"),
            stuck_on_update("stuck", "stuck:1", nodes, None),
        ],
        &[],
        &[],
    )
    .await;
    let op = env.start().await;
    env.create_plan(plan(
        "dag",
        vec![
            component("fast", "Deployment", "fast:2", &[]),
            component("stuck", "Deployment", "stuck:2", &[]),
            component("after", "Deployment", "after:2", &["fast"]),
        ],
        concurrent(2, 600),
    ))
    .await;
    let status = env
        .wait_component("dag", "after", ComponentPhase::Succeeded)
        .await;
    assert_eq!(comp(&status, "stuck").phase, ComponentPhase::Progressing);
    assert_eq!(status.phase, Some(PlanPhase::Progressing));
    assert_eq!(deployment_image(&env, "after").await.0, "after:2");
    op.stop().await.expect("clean shutdown");
}

/// A component's own health rule (CEL over its target) decides when it is done: the next
/// component waits for it, not for the built-in rule; its `failed` rule applies the failure
/// policy (here: roll back).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn custom_health_rules_gate_the_next_component_and_can_fail_the_plan() {
    let env = Env::new("uo-cel").await;
    create_and_wait(
        &env,
        &[deployment("gate", "gate:1"), deployment("next", "next:1")],
        &[],
        &[],
    )
    .await;
    let op = env.start().await;
    let with_rule = |image: &str| {
        let mut gate = component("gate", "Deployment", image, &[]);
        gate.health = Some(HealthCheck {
            healthy: "has(self.metadata.annotations) && 'verified' in self.metadata.annotations && self.metadata.annotations['verified'] == self.spec.template.spec.containers[0].image".into(),
            failed: Some("has(self.metadata.annotations) && 'broken' in self.metadata.annotations && self.metadata.annotations['broken'] == self.spec.template.spec.containers[0].image".into()),
        });
        gate
    };
    env.create_plan(plan(
        "cel",
        vec![
            with_rule("gate:2"),
            component("next", "Deployment", "next:2", &["gate"]),
        ],
        rollback(),
    ))
    .await;
    // Rolled out by the built-in rule's measure, but not verified: next waits.
    let status = env
        .wait_phase_until("cel", ROLL, |s| {
            s.components.iter().any(|c| {
                c.name == "gate"
                    && c.message
                        .as_deref()
                        .is_some_and(|m| m.contains("waiting for health.healthy"))
            })
        })
        .await;
    assert_eq!(
        comp(&status, "next").phase,
        ComponentPhase::Pending,
        "{}",
        describe(&status)
    );
    assert_eq!(deployment_image(&env, "gate").await.0, "gate:2");
    assert_eq!(deployment_image(&env, "next").await.0, "next:1");
    let annotate = |key: &'static str, value: &'static str| {
        let api = env.api::<Deployment>();
        async move {
            api.patch(
                "gate",
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"annotations": {key: value}}})),
            )
            .await
            .expect("annotate gate");
        }
    };
    annotate("verified", "gate:2").await;
    env.wait_phase("cel", &[PlanPhase::Succeeded], ROLL).await;
    assert_eq!(deployment_image(&env, "next").await.0, "next:2");

    // A second plan whose target reports itself broken is rolled back.
    env.create_plan(plan("cel-broken", vec![with_rule("gate:3")], rollback()))
        .await;
    env.wait_component("cel-broken", "gate", ComponentPhase::Progressing)
        .await;
    // gate:3 reports itself broken; gate:2, reverted to, is still verified and not broken.
    annotate("broken", "gate:3").await;
    env.wait_phase("cel-broken", &[PlanPhase::RolledBack], ROLL)
        .await;
    assert_eq!(deployment_image(&env, "gate").await.0, "gate:2");
    // Events follow the status write a test may see first.
    let events: Api<Event> = env.api();
    eventually(
        "a ComponentFailed Event naming the rule",
        WAIT_VALID,
        || {
            let events = events.clone();
            async move {
                let failed: Vec<String> = events
                    .list(&ListParams::default())
                    .await
                    .map_err(|e| e.to_string())?
                    .items
                    .into_iter()
                    .filter(|e| e.reason.as_deref() == Some("ComponentFailed"))
                    .filter_map(|e| e.note)
                    .collect();
                if failed.iter().any(|n| n.contains("health.failed holds")) {
                    Ok(())
                } else {
                    Err(format!("{failed:?}"))
                }
            }
        },
    )
    .await
    .expect("the failure says which rule held");
    op.stop().await.expect("clean shutdown");
}

/// Deleting a plan mid-flight rolls it back before it goes (whatever its failure policy); a
/// finished plan, or one that never started, goes at once. Each leaves a `PlanDeleted` Event
/// saying what the targets were left with.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_running_plan_rolls_it_back_before_it_goes() {
    let env = Env::new("uo-delete").await;
    let op = env.start().await;
    // Pause policy, long deadline: left alone, the plan would wait on `back` for minutes.
    failing_plan(&env, "doomed", on_failure(FailurePolicy::Pause, 600), None).await;
    eventually("back changed, the plan in flight", ROLL, || async {
        match deployment_image(&env, "back").await.0.as_str() {
            "back:2" => Ok(()),
            other => Err(format!("back at {other}")),
        }
    })
    .await
    .expect("back changed");
    assert_eq!(deployment_image(&env, "front").await.0, "front:2");
    env.plans()
        .delete("doomed", &DeleteParams::default())
        .await
        .expect("delete");
    let kept = env
        .plans()
        .get("doomed")
        .await
        .expect("kept by its finalizer");
    assert!(kept.metadata.deletion_timestamp.is_some());
    eventually("the plan gone after its rollback", ROLL, || async {
        match env.plans().get_opt("doomed").await {
            Ok(None) => Ok(()),
            Ok(Some(p)) => Err(format!("still there: {:?}", p.status.and_then(|s| s.phase))),
            Err(e) => Err(e.to_string()),
        }
    })
    .await
    .expect("plan gone");
    assert_eq!(deployment_image(&env, "front").await.0, "front:1");
    assert_eq!(deployment_image(&env, "back").await.0, "back:1");
    env.expect_events("doomed", &["RollbackStarted", "PlanDeleted"])
        .await;
    let record = deleted_message(&env, "doomed").await;
    assert!(
        record.starts_with("deleted while RolledBack:")
            && record.contains("front RolledBack at front:1"),
        "{record}"
    );

    // Finished: it goes at once and its change stays.
    create_and_wait(&env, &[deployment("solo", "solo:1")], &[], &[]).await;
    env.create_plan(plan(
        "done",
        vec![component("solo", "Deployment", "solo:2", &[])],
        Strategy::default(),
    ))
    .await;
    env.wait_phase("done", &[PlanPhase::Succeeded], ROLL).await;
    env.plans()
        .delete("done", &DeleteParams::default())
        .await
        .expect("delete");
    eventually(
        "the finished plan gone",
        Duration::from_secs(20),
        || async {
            match env.plans().get_opt("done").await {
                Ok(None) => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await
    .expect("finished plan gone");
    assert_eq!(deployment_image(&env, "solo").await.0, "solo:2");
    let record = deleted_message(&env, "done").await;
    assert_eq!(record, "deleted while Succeeded: solo Succeeded at solo:2");
    op.stop().await.expect("clean shutdown");
}

/// The message of the `PlanDeleted` Event about `plan`.
async fn deleted_message(env: &Env, plan: &str) -> String {
    let events: Api<Event> = env.api();
    eventually("a PlanDeleted Event", Duration::from_secs(10), || async {
        events
            .list(&ListParams::default())
            .await
            .map_err(|e| e.to_string())?
            .items
            .into_iter()
            .find(|e| {
                e.reason.as_deref() == Some("PlanDeleted")
                    && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(plan)
            })
            .and_then(|e| e.note)
            .ok_or_else(|| "none yet".to_string())
    })
    .await
    .expect("PlanDeleted")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_component_pauses_the_plan_when_asked() {
    let env = Env::new("uo-pause").await;
    let op = env.start().await;
    // The Deployment itself reports failure (ProgressDeadlineExceeded after 5 s), long before
    // the plan's 300 s deadline.
    failing_plan(
        &env,
        "careful",
        on_failure(FailurePolicy::Pause, 300),
        Some(5),
    )
    .await;
    let status = env
        .wait_phase(
            "careful",
            &[
                PlanPhase::Paused,
                PlanPhase::RolledBack,
                PlanPhase::Succeeded,
            ],
            ROLL,
        )
        .await;
    assert_eq!(
        status.phase,
        Some(PlanPhase::Paused),
        "{}",
        describe(&status)
    );
    let back = comp(&status, "back");
    assert_eq!(back.phase, ComponentPhase::Failed);
    assert!(
        back.message
            .as_deref()
            .unwrap_or_default()
            .contains("ProgressDeadlineExceeded"),
        "{back:?}"
    );
    assert!(
        micros(&back.finished_at) - micros(&back.started_at) < 120_000_000,
        "the workload's own failure, not the plan deadline"
    );
    assert_eq!(comp(&status, "front").phase, ComponentPhase::Succeeded);
    assert_eq!(
        steward_core::conditions::get(&status.conditions, "Ready").map(|c| c.reason.clone()),
        Some("ComponentFailed".to_string())
    );

    // It stays stopped: nothing is reverted, nothing else happens.
    let (front_image, front_generation) = deployment_image(&env, "front").await;
    let (back_image, back_generation) = deployment_image(&env, "back").await;
    looked_again(op.metrics(), &env, "careful").await;
    let later = env.status("careful").await;
    assert_eq!(later.phase, Some(PlanPhase::Paused));
    assert_eq!(
        later.components, status.components,
        "nothing moved while paused"
    );
    assert_eq!(
        deployment_image(&env, "front").await,
        (front_image.clone(), front_generation)
    );
    assert_eq!(
        deployment_image(&env, "back").await,
        (back_image.clone(), back_generation)
    );
    assert_eq!(
        (front_image.as_str(), back_image.as_str()),
        ("front:2", "back:2")
    );

    // The user decides: roll back.
    env.patch_plan(
        "careful",
        json!({"spec": {"strategy": {"failurePolicy": "Rollback"}}}),
    )
    .await;
    let status = env
        .wait_phase("careful", &[PlanPhase::RolledBack, PlanPhase::Failed], ROLL)
        .await;
    assert_eq!(
        status.phase,
        Some(PlanPhase::RolledBack),
        "{}",
        describe(&status)
    );
    assert_eq!(deployment_image(&env, "front").await.0, "front:1");
    assert_eq!(deployment_image(&env, "back").await.0, "back:1");
    op.stop().await.expect("clean shutdown");
}

// ---------------------------------------------------------------------------------------------
// 4. Manual approval and pause

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manual_approval_waits_at_each_wave() {
    let env = Env::new("uo-approval").await;
    create_and_wait(
        &env,
        &[deployment("a", "a:1"), deployment("b", "b:1")],
        &[],
        &[],
    )
    .await;
    let op = env.start().await;
    env.create_plan(plan(
        "gated",
        vec![
            component("a", "Deployment", "a:2", &[]),
            component("b", "Deployment", "b:2", &["a"]),
        ],
        Strategy {
            approval: Approval::Manual,
            ..Strategy::default()
        },
    ))
    .await;
    let status = env
        .wait_phase(
            "gated",
            &[PlanPhase::WaitingApproval],
            Duration::from_secs(30),
        )
        .await;
    assert_eq!(status.current_wave, Some(1));
    let (_, a_generation) = deployment_image(&env, "a").await;
    looked_again(op.metrics(), &env, "gated").await;
    assert_eq!(
        deployment_image(&env, "a").await,
        ("a:1".to_string(), a_generation),
        "nothing changes unapproved"
    );
    assert_eq!(
        env.status("gated").await.phase,
        Some(PlanPhase::WaitingApproval)
    );

    env.patch_plan("gated", json!({"spec": {"approvedWaves": 1}}))
        .await;
    let status = env
        .wait_phase("gated", &[PlanPhase::WaitingApproval], ROLL)
        .await;
    // Wait for the second wave's gate, not the first one still showing.
    let status = if status.current_wave == Some(2) {
        status
    } else {
        let plans = env.plans();
        eventually("wave 2 waits for approval", ROLL, || {
            let plans = plans.clone();
            async move {
                let s = plans
                    .get("gated")
                    .await
                    .map_err(|e| e.to_string())?
                    .status
                    .unwrap_or_default();
                if s.current_wave == Some(2) && s.phase == Some(PlanPhase::WaitingApproval) {
                    Ok(s)
                } else {
                    Err(describe(&s))
                }
            }
        })
        .await
        .expect("wave 2 gate")
    };
    assert_eq!(comp(&status, "a").phase, ComponentPhase::Succeeded);
    assert_eq!(comp(&status, "b").phase, ComponentPhase::Pending);
    assert_eq!(deployment_image(&env, "b").await.0, "b:1");

    // approvedWaves can only grow (CEL transition rule).
    let err = env
        .plans()
        .patch(
            "gated",
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"approvedWaves": 0}})),
        )
        .await
        .expect_err("lowering approvedWaves is rejected");
    assert!(
        err.to_string().contains("approvedWaves cannot decrease"),
        "{err}"
    );

    env.patch_plan("gated", json!({"spec": {"approvedWaves": 2}}))
        .await;
    let status = env.wait_phase("gated", &[PlanPhase::Succeeded], ROLL).await;
    assert!(micros(&comp(&status, "b").started_at) >= micros(&comp(&status, "a").finished_at));
    env.expect_events(
        "gated",
        &["WaitingApproval", "WaveApproved", "PlanSucceeded"],
    )
    .await;
    op.stop().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_plan_halts_between_components() {
    let env = Env::new("uo-paused").await;
    // a rolls slowly (minReadySeconds), so the plan can be paused while a is in flight.
    let mut slow = deployment("a", "a:1");
    slow.spec.min_ready_seconds = Some(6);
    create_and_wait(&env, &[slow, deployment("b", "b:1")], &[], &[]).await;
    let op = env.start().await;
    env.create_plan(plan(
        "stepwise",
        vec![
            component("a", "Deployment", "a:2", &[]),
            component("b", "Deployment", "b:2", &["a"]),
        ],
        Strategy::default(),
    ))
    .await;
    let plans = env.plans();
    eventually("a in flight", Duration::from_secs(30), || {
        let plans = plans.clone();
        async move {
            let s = plans
                .get("stepwise")
                .await
                .map_err(|e| e.to_string())?
                .status
                .unwrap_or_default();
            if s.components
                .iter()
                .any(|c| c.name == "a" && c.phase == ComponentPhase::Progressing)
            {
                Ok(())
            } else {
                Err(describe(&s))
            }
        }
    })
    .await
    .expect("a starts");
    env.patch_plan("stepwise", json!({"spec": {"strategy": {"paused": true}}}))
        .await;

    // a still finishes; b does not start.
    let plans = env.plans();
    eventually("a finished while paused", ROLL, || {
        let plans = plans.clone();
        async move {
            let s = plans
                .get("stepwise")
                .await
                .map_err(|e| e.to_string())?
                .status
                .unwrap_or_default();
            if s.phase == Some(PlanPhase::Paused)
                && comp(&s, "a").phase == ComponentPhase::Succeeded
            {
                Ok(s)
            } else {
                Err(describe(&s))
            }
        }
    })
    .await
    .expect("paused with a done");
    let (_, b_generation) = deployment_image(&env, "b").await;
    looked_again(op.metrics(), &env, "stepwise").await;
    let later = env.status("stepwise").await;
    assert_eq!(later.phase, Some(PlanPhase::Paused));
    assert_eq!(
        comp(&later, "b").phase,
        ComponentPhase::Pending,
        "b waits while paused"
    );
    assert_eq!(
        deployment_image(&env, "b").await,
        ("b:1".to_string(), b_generation)
    );
    let unpaused = k8s_openapi::jiff::Timestamp::now().as_microsecond();
    env.patch_plan("stepwise", json!({"spec": {"strategy": {"paused": false}}}))
        .await;
    let status = env
        .wait_phase("stepwise", &[PlanPhase::Succeeded], ROLL)
        .await;
    assert!(
        micros(&comp(&status, "b").started_at) >= unpaused,
        "b started only after the unpause"
    );
    env.expect_events("stepwise", &["PlanPaused", "PlanResumed"])
        .await;
    op.stop().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plan_starts_components_only_inside_its_maintenance_window() {
    use k8s_openapi::jiff::{SignedDuration, Timestamp, tz::TimeZone};

    let env = Env::new("uo-window").await;
    create_and_wait(&env, &[deployment("a", "a:1")], &[], &[]).await;
    let op = env.start().await;

    // A one-minute window twelve hours from now: closed for the whole test.
    let later = (Timestamp::now() + SignedDuration::from_hours(12)).to_zoned(TimeZone::UTC);
    let schedule = format!("{} {} * * *", later.minute(), later.hour());
    let closed = Strategy {
        maintenance_windows: vec![MaintenanceWindow {
            schedule,
            duration: "1m".into(),
            time_zone: None,
        }],
        ..Strategy::default()
    };
    env.create_plan(plan(
        "nightly",
        vec![component("a", "Deployment", "a:2", &[])],
        closed,
    ))
    .await;
    let status = env
        .wait_phase("nightly", &[PlanPhase::WaitingWindow], WAIT_VALID)
        .await;
    let ready = steward_core::conditions::get(&status.conditions, "Ready").expect("Ready");
    assert_eq!(ready.reason, "OutsideMaintenanceWindow");
    assert!(
        ready.message.contains(&format!(
            "opens at {}",
            later.strftime("%Y-%m-%dT%H:%M:00+00:00[UTC]")
        )),
        "{}",
        ready.message
    );
    assert!(status.started_at.is_none(), "{}", describe(&status));
    assert_eq!(deployment_image(&env, "a").await.0, "a:1");

    // A schedule the API server cannot judge is the orchestrator's to refuse, by name.
    env.patch_plan(
        "nightly",
        json!({"spec": {"strategy": {"maintenanceWindows": [{"schedule": "0 25 * * *", "duration": "1h"}]}}}),
    )
    .await;
    let invalid = env.wait_invalid("nightly").await;
    let valid = steward_core::conditions::get(&invalid.conditions, "Valid").expect("Valid");
    assert_eq!(valid.reason, "InvalidMaintenanceWindow");
    assert!(
        valid.message.contains("maintenanceWindows[0]"),
        "{}",
        valid.message
    );
    assert_eq!(deployment_image(&env, "a").await.0, "a:1");
    // A malformed duration never gets in.
    let refused = env
        .plans()
        .patch(
            "nightly",
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"strategy": {"maintenanceWindows": [{"schedule": "@daily", "duration": "soon"}]}}})),
        )
        .await
        .expect_err("a duration that is not one is refused at admission");
    assert!(refused.to_string().contains("duration"), "{refused}");

    // The window opens (any minute, for an hour): the plan runs.
    env.patch_plan(
        "nightly",
        json!({"spec": {"strategy": {"maintenanceWindows": [{"schedule": "* * * * *", "duration": "1h", "timeZone": "Europe/Berlin"}]}}}),
    )
    .await;
    env.wait_phase("nightly", &[PlanPhase::Succeeded], ROLL)
        .await;
    assert_eq!(deployment_image(&env, "a").await.0, "a:2");
    env.expect_events("nightly", &["WaitingWindow", "PlanStarted"])
        .await;
    op.stop().await.expect("clean shutdown");
}

// ---------------------------------------------------------------------------------------------
// 5. Invalid plans

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_plans_are_reported_and_change_nothing() {
    let env = Env::new("uo-invalid").await;
    create_and_wait(
        &env,
        &[deployment("a", "a:1"), deployment("b", "b:1")],
        &[],
        &[],
    )
    .await;
    let generations = (
        deployment_image(&env, "a").await,
        deployment_image(&env, "b").await,
    );
    let op = env.start().await;
    let cases: Vec<(&str, Vec<Component>, &str)> = vec![
        (
            "cycle",
            vec![
                component("a", "Deployment", "a:2", &["b"]),
                component("b", "Deployment", "b:2", &["a"]),
            ],
            "DependencyCycle",
        ),
        (
            "unknown",
            vec![component("a", "Deployment", "a:2", &["nope"])],
            "UnknownDependency",
        ),
        (
            "duplicate",
            vec![
                component("a", "Deployment", "a:2", &[]),
                component("a", "Deployment", "a:3", &[]),
            ],
            "DuplicateName",
        ),
        (
            "missing",
            vec![
                component("a", "Deployment", "a:2", &[]),
                component("ghost", "Deployment", "ghost:2", &["a"]),
            ],
            "TargetNotFound",
        ),
        (
            "container",
            vec![Component {
                image: fixtures::image("nope", "a:2"),
                ..component("a", "Deployment", "a:2", &[])
            }],
            "TargetNotFound",
        ),
        (
            "badhealth",
            vec![Component {
                health: Some(HealthCheck {
                    healthy: "self.status.(".into(),
                    failed: None,
                }),
                ..component("a", "Deployment", "a:2", &[])
            }],
            "InvalidHealthCheck",
        ),
    ];
    for (name, components, _) in &cases {
        env.create_plan(plan(name, components.clone(), Strategy::default()))
            .await;
    }
    for (name, _, reason) in &cases {
        let status = env.wait_invalid(name).await;
        let valid = steward_core::conditions::get(&status.conditions, "Valid").expect("Valid");
        assert_eq!(valid.reason, *reason, "{name}: {}", valid.message);
        assert_eq!(status.phase, Some(PlanPhase::Pending), "{name}");
        assert!(status.started_at.is_none(), "{name}");
        assert!(
            status
                .components
                .iter()
                .all(|c| c.phase == ComponentPhase::Pending && c.previous.is_none()),
            "{name}"
        );
        env.expect_events(
            name,
            &[if *reason == "TargetNotFound" {
                "TargetNotFound"
            } else {
                "InvalidPlan"
            }],
        )
        .await;
    }
    // The sample is accepted by the schema; its targets do not exist here.
    let sample = std::fs::read_to_string(
        steward_testenv::workspace_root().join("deploy/samples/upgradeplan.yaml"),
    )
    .expect("sample");
    let sample: UpgradePlan = serde_yaml::from_str(&sample).expect("sample parses");
    env.plans()
        .create(&PostParams::default(), &sample)
        .await
        .expect("the sample is valid");
    let plans = env.plans();
    eventually(
        "sample reports its missing targets",
        Duration::from_secs(30),
        || {
            let plans = plans.clone();
            async move {
                let s = plans
                    .get("release-2-0")
                    .await
                    .map_err(|e| e.to_string())?
                    .status
                    .unwrap_or_default();
                match steward_core::conditions::get(&s.conditions, "Valid") {
                    Some(c)
                        if c.reason == "TargetNotFound"
                            && c.message.contains("PostgresCluster main not found") =>
                    {
                        Ok(())
                    }
                    _ => Err(describe(&s)),
                }
            }
        },
    )
    .await
    .expect("sample reported");

    // Each plan looked at again after it was reported: still nothing touched.
    for name in cases.iter().map(|c| c.0).chain(["release-2-0"]) {
        looked_again(op.metrics(), &env, name).await;
    }
    assert_eq!(
        (
            deployment_image(&env, "a").await,
            deployment_image(&env, "b").await
        ),
        generations,
        "no target touched"
    );

    // Schema-level rules reject what cannot be expressed at all.
    let rejected = |plan: UpgradePlan| {
        let plans = env.plans();
        async move {
            plans
                .create(&PostParams::default(), &plan)
                .await
                .expect_err("rejected by the API server")
                .to_string()
        }
    };
    let err = rejected(plan(
        "pg-with-image",
        vec![Component {
            image: fixtures::image("x", "y"),
            ..fixtures::change("db", fixtures::target("PostgresCluster", "db"))
        }],
        Strategy::default(),
    ))
    .await;
    assert!(
        err.contains("exactly one of: image (a Deployment, StatefulSet or DaemonSet), version (a PostgresCluster)"),
        "{err}"
    );
    let err = rejected(plan(
        "bad-name",
        vec![component("Not_A_Name", "Deployment", "x", &[])],
        Strategy::default(),
    ))
    .await;
    assert!(err.contains("spec.components[0].name"), "{err}");
    let err = rejected(plan("no-components", vec![], Strategy::default())).await;
    assert!(err.contains("spec.components"), "{err}");
    let err = rejected(plan(
        "zero",
        vec![component("a", "Deployment", "a:2", &[])],
        Strategy {
            max_concurrent: 0,
            ..Strategy::default()
        },
    ))
    .await;
    assert!(err.contains("maxConcurrent"), "{err}");

    // Fixing an invalid plan makes it run; once started, its components are immutable.
    env.patch_plan(
        "unknown",
        json!({"spec": {"components": [component("a", "Deployment", "a:2", &[])]}}),
    )
    .await;
    env.wait_phase("unknown", &[PlanPhase::Succeeded], ROLL)
        .await;
    let err = env
        .plans()
        .patch(
            "unknown",
            &PatchParams::default(),
            &Patch::Merge(
                &json!({"spec": {"components": [component("a", "Deployment", "a:3", &[])]}}),
            ),
        )
        .await
        .expect_err("components are immutable once started");
    assert!(
        err.to_string()
            .contains("immutable once the plan has started"),
        "{err}"
    );
    op.stop().await.expect("clean shutdown");
}

// ---------------------------------------------------------------------------------------------
// 3. Crashes and leadership changes at every step

/// An orchestrator on its own tokio runtime, so it can be killed at any await point (dropping
/// the runtime drops every task mid-flight, like a crashed process), not just shut down.
struct Crashable {
    operator: steward_testenv::harness::Crashable,
    leadership: steward_core::Leadership,
    metrics: steward_core::metrics::Metrics,
}

impl Crashable {
    async fn start(env: &Env, args: CommonArgs) -> Self {
        let config = env.cp.config().clone();
        let (operator, (leadership, metrics)) =
            steward_testenv::harness::Crashable::start(move || {
                let mut op = Operator::with_config(upgrade_orchestrator::NAME, args, config)
                    .expect("operator")
                    .backoff(Duration::from_millis(200), Duration::from_secs(2));
                upgrade_orchestrator::register(
                    &mut op,
                    upgrade_orchestrator::Options {
                        watch_postgresclusters: false,
                        ..Default::default()
                    },
                )
                .expect("register");
                let leadership = op.leadership();
                let metrics = op.metrics();
                (op, (leadership, metrics))
            })
            .await;
        Self {
            operator,
            leadership,
            metrics,
        }
    }

    fn kill(self) {
        self.operator.kill();
    }
}

/// Four Deployments in a diamond, one component at a time: about a dozen status changes.
/// `api` runs a hook Job before and after its change; `worker`'s health is a CEL rule.
async fn crash_fixture(env: &Env) -> BTreeMap<String, i64> {
    create_and_wait(
        env,
        &[
            deployment("db", "db:1"),
            deployment("api", "api:1"),
            deployment("worker", "worker:1"),
            deployment("web", "web:1"),
        ],
        &[],
        &[],
    )
    .await;
    let mut generations = BTreeMap::new();
    for n in ["db", "api", "worker", "web"] {
        generations.insert(n.to_string(), deployment_image(env, n).await.1);
    }
    let mut api = component("api", "Deployment", "api:2", &["db"]);
    api.hooks = fixtures::hooks(Some(hook_job(false)), Some(hook_job(false)));
    let mut worker = component("worker", "Deployment", "worker:2", &["db"]);
    worker.health = Some(HealthCheck {
        healthy: "self.status.observedGeneration == self.metadata.generation && self.status.updatedReplicas == self.spec.replicas && self.status.availableReplicas == self.spec.replicas && !has(self.status.unavailableReplicas)".into(),
        failed: None,
    });
    env.create_plan(plan(
        "resilient",
        vec![
            component("web", "Deployment", "web:2", &["api", "worker"]),
            api,
            worker,
            component("db", "Deployment", "db:2", &[]),
        ],
        concurrent(1, 120),
    ))
    .await;
    generations
}

/// Waits until the plan's resourceVersion differs from `last`, polling every 10 ms so that a
/// kill lands right after the write that changed it (the orchestrator's next write needs an
/// event and a reconcile, or a rollout, first).
async fn next_change(env: &Env, last: &str) -> UpgradePlan {
    let plans = env.plans();
    let deadline = tokio::time::Instant::now() + ROLL;
    loop {
        if let Ok(p) = plans.get("resilient").await
            && p.resource_version().as_deref() != Some(last)
        {
            return p;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the plan did not change in {ROLL:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// How many Progressing components have their start recorded but their target unchanged:
/// a kill there is the write-ahead window.
async fn recorded_not_applied(env: &Env, status: &UpgradePlanStatus) -> usize {
    let mut n = 0;
    for c in status
        .components
        .iter()
        .filter(|c| c.phase == ComponentPhase::Progressing)
    {
        if deployment_image(env, &c.name).await.0 == c.previous.clone().unwrap_or_default() {
            n += 1;
        }
    }
    n
}

async fn assert_completed_once(
    env: &Env,
    generations: &BTreeMap<String, i64>,
) -> UpgradePlanStatus {
    let status = env
        .wait_phase(
            "resilient",
            &[
                PlanPhase::Succeeded,
                PlanPhase::Failed,
                PlanPhase::RolledBack,
                PlanPhase::Paused,
            ],
            ROLL,
        )
        .await;
    assert_eq!(
        status.phase,
        Some(PlanPhase::Succeeded),
        "{}",
        describe(&status)
    );
    for (name, generation) in generations {
        let d = env.api::<Deployment>().get(name).await.expect("get");
        assert_eq!(
            d.metadata.generation,
            Some(generation + 1),
            "{name} changed exactly once"
        );
        assert_eq!(
            d.annotations()
                .get("deployment.kubernetes.io/revision")
                .map(String::as_str),
            Some("2"),
            "{name}: one new template, never a third"
        );
        assert!(managed_by_orchestrator(&d.metadata));
    }
    let deps: &[(&str, &[&str])] = &[
        ("api", &["db"]),
        ("worker", &["db"]),
        ("web", &["api", "worker"]),
    ];
    for (name, ds) in deps {
        for d in *ds {
            assert!(
                micros(&comp(&status, name).started_at) >= micros(&comp(&status, d).finished_at),
                "{name} before {d}"
            );
        }
    }
    // maxConcurrent 1 held across restarts: no two components' [start, finish] overlap.
    let mut spans: Vec<(i64, i64)> = status
        .components
        .iter()
        .map(|c| (micros(&c.started_at), micros(&c.finished_at)))
        .collect();
    spans.sort_unstable();
    for w in spans.windows(2) {
        assert!(w[1].0 >= w[0].1, "overlapping components: {spans:?}");
    }
    status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_at_every_step_the_plan_completes_once() {
    let env = Env::new("uo-crash").await;
    let generations = crash_fixture(&env).await;
    let mut last = String::new();
    let (mut kills, mut in_window, mut in_hook) = (0, 0, 0);
    // The components an instance was killed in the middle of (recorded Progressing).
    let mut killed_mid = BTreeSet::new();
    loop {
        let instance = Crashable::start(&env, env.args()).await;
        let plan = next_change(&env, &last).await;
        instance.kill(); // right after each status change: between record and change, mid-rollout, ...
        kills += 1;
        last = plan.resource_version().unwrap_or_default();
        let status = plan.status.clone().unwrap_or_default();
        killed_mid.extend(
            status
                .components
                .iter()
                .filter(|c| c.phase == ComponentPhase::Progressing)
                .map(|c| c.name.clone()),
        );
        in_window += recorded_not_applied(&env, &status).await;
        in_hook += status
            .components
            .iter()
            .filter(|c| c.phase == ComponentPhase::Progressing)
            .filter(|c| {
                c.hook
                    .as_ref()
                    .is_some_and(|h| h.phase == upgrade_orchestrator::crd::HookPhase::Running)
            })
            .count();
        if status.phase == Some(PlanPhase::Succeeded) || kills > 200 {
            break;
        }
    }
    // The status write is guarded by the plan's resourceVersion: a write from a stale copy
    // (what a killed leader's late request would be) is refused.
    let current = env.plans().get("resilient").await.expect("plan");
    env.patch_plan(
        "resilient",
        json!({"metadata": {"annotations": {"touched": "yes"}}}),
    )
    .await;
    let stale = json!({
        "apiVersion": "upgrade.steward.dev/v1alpha1", "kind": "UpgradePlan",
        "metadata": {"name": "resilient", "resourceVersion": current.resource_version()},
        "status": {"phase": "Pending"},
    });
    let err = env
        .plans()
        .patch_status(
            "resilient",
            &PatchParams::apply(upgrade_orchestrator::NAME).force(),
            &Patch::Apply(&stale),
        )
        .await
        .expect_err("stale status write refused");
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 409),
        "{err}"
    );

    // One more instance proves nothing is left to do and nothing changes again.
    let instance = Crashable::start(&env, env.args()).await;
    looked_again(&instance.metrics, &env, "resilient").await;
    let status = assert_completed_once(&env, &generations).await;
    instance.kill();
    eprintln!(
        "crash test: {kills} kills, {in_window} of them between recording a start and changing the target, {in_hook} while a hook ran"
    );
    // Each hook ran as exactly one Job, which completed, however often it was interrupted.
    let jobs: Api<k8s_openapi::api::batch::v1::Job> = env.api();
    let jobs = jobs.list(&ListParams::default()).await.expect("jobs").items;
    let names: BTreeSet<String> = jobs.iter().map(ResourceExt::name_any).collect();
    assert_eq!(
        names,
        BTreeSet::from([
            "resilient-api-after-1".to_string(),
            "resilient-api-before-1".to_string()
        ])
    );
    assert!(
        jobs.iter().all(|j| upgrade_orchestrator::hook::state(j)
            == upgrade_orchestrator::hook::JobState::Succeeded)
    );
    assert!(in_hook > 0, "no kill while a hook ran ({kills} kills)");
    // Every component's start is its own write, followed by a rollout: each one was killed in
    // the middle at least once, and the plan needed a new instance for every step.
    let all: BTreeSet<String> = generations.keys().cloned().collect();
    assert_eq!(
        killed_mid,
        all,
        "components killed mid-upgrade ({kills} kills): {}",
        describe(&status)
    );
    assert!(
        kills > all.len(),
        "only {kills} kills: {}",
        describe(&status)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leadership_moves_and_the_plan_completes_once() {
    let env = Env::new("uo-leader").await;
    let mut args = env.args();
    args.leader_elect = true;
    args.leader_election_namespace = Some(env.ns.clone());
    args.leader_election_id = Some("upgrade-orchestrator-test".into());
    args.leader_election_lease_duration = Duration::from_secs(2);
    args.leader_election_renew_deadline = Duration::from_millis(1500);
    args.leader_election_retry_period = Duration::from_millis(400);
    let mut candidates = vec![
        Crashable::start(&env, args.clone()).await,
        Crashable::start(&env, args.clone()).await,
    ];
    let generations = crash_fixture(&env).await;
    let mut last = String::new();
    let mut moves = 0;
    let started = Instant::now();
    loop {
        let plan = next_change(&env, &last).await;
        last = plan.resource_version().unwrap_or_default();
        if plan.status.as_ref().and_then(|s| s.phase) == Some(PlanPhase::Succeeded) {
            break;
        }
        // Kill the leader; a new candidate joins, the other one takes over.
        if let Some(i) = candidates.iter().position(|c| c.leadership.is_leader()) {
            candidates.swap_remove(i).kill();
            moves += 1;
            candidates.push(Crashable::start(&env, args.clone()).await);
        }
    }
    let status = assert_completed_once(&env, &generations).await;
    eprintln!(
        "leader test: leadership moved {moves} times; plan took {:.1?}",
        started.elapsed()
    );
    assert!(
        moves >= 4,
        "leadership moved only {moves} times: {}",
        describe(&status)
    );
    for c in candidates {
        c.kill();
    }
}

// ---------------------------------------------------------------------------------------------
/// Changes the target's own validation refuses are found before the plan starts (a dry run of
/// the plan's patch): a PostgresCluster version that is not a number, out of range, or lower
/// than the current one. Each plan says which component, which target and the server's reason
/// in `Valid=False ChangeRefused`, and nothing changes. (The API server accepts nearly any
/// image reference, so images are checked only for their container, as before.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changes_the_target_refuses_are_reported_before_anything_changes() {
    use kube::api::DynamicObject;

    let env = Env::new("uo-refused").await;
    for crd in database_operator::crds() {
        env.cp.apply_crd(&crd).await.expect("install database CRDs");
    }
    let clusters = env.postgres_clusters();
    let cluster: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "database.steward.dev/v1alpha1", "kind": "PostgresCluster",
        "metadata": {"name": "pg"},
        "spec": {"instances": 1, "version": 16, "storage": {"size": "1Gi"}}
    }))
    .expect("cluster");
    let cluster = clusters
        .create(&PostParams::default(), &cluster)
        .await
        .expect("create PostgresCluster");
    let op = env.start().await;
    let version = |v: &str| fixtures::version("db", "pg", v);
    let cases = [
        ("pg-abc", version("abc"), "spec.version"),
        ("pg-99", version("99"), "spec.version"),
        ("pg-lower", version("14"), "cannot be lowered"),
    ];
    for (name, component, _) in &cases {
        env.create_plan(plan(name, vec![component.clone()], Strategy::default()))
            .await;
    }
    for (name, _, says) in &cases {
        let status = env.wait_invalid(name).await;
        let valid = steward_core::conditions::get(&status.conditions, "Valid").expect("Valid");
        assert_eq!(valid.reason, "ChangeRefused", "{name}: {}", valid.message);
        assert!(
            valid.message.contains(says) && valid.message.contains("refuses the change"),
            "{name}: {}",
            valid.message
        );
        assert_eq!(status.phase, Some(PlanPhase::Pending), "{name}");
        assert!(status.started_at.is_none(), "{name}");
    }
    // A valid change of the same targets is not refused (the dry run changed nothing).
    env.create_plan(plan("pg-17", vec![version("17")], Strategy::default()))
        .await;
    env.wait_phase(
        "pg-17",
        &[
            PlanPhase::Progressing,
            PlanPhase::Succeeded,
            PlanPhase::Failed,
        ],
        WAIT_VALID,
    )
    .await;
    op.stop().await.expect("clean shutdown");
    let pg = clusters.get("pg").await.expect("get PostgresCluster");
    assert_eq!(
        pg.data["spec"]["version"],
        json!(17),
        "the valid plan changed it"
    );
    assert_eq!(
        pg.metadata.generation,
        cluster.metadata.generation.map(|g| g + 1),
        "changed once: by the valid plan, never by a refused one or a dry run"
    );
}

// 6. A PostgresCluster version upgrade as one component, with the database operator running

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_cluster_upgrade_is_a_component() {
    use k8s_openapi::api::core::v1::PersistentVolume;
    use kube::api::DynamicObject;

    let env = Env::new("uo-pg").await;
    for crd in database_operator::crds() {
        env.cp.apply_crd(&crd).await.expect("install database CRDs");
    }
    // The database operator, for this namespace.
    let mut db_operator =
        Operator::with_config(database_operator::NAME, env.args(), env.cp.config().clone())
            .expect("database operator")
            .backoff(Duration::from_millis(500), Duration::from_secs(4));
    database_operator::register(&mut db_operator, database_operator::Options::default())
        .expect("register");
    let db_operator = Harness::start(db_operator).await;

    // kwok has no volume provisioner: a PersistentVolume of a class unique to this test.
    let class = format!("steward-{}", env.ns);
    let pv = fixtures::persistent_volume(
        &format!("{class}-0"),
        &class,
        "Delete",
        "upgrade-orchestrator",
    );
    Api::<PersistentVolume>::all(env.client.clone())
        .create(&PostParams::default(), &pv)
        .await
        .expect("create PV");
    let clusters = env.postgres_clusters();
    let cluster: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "database.steward.dev/v1alpha1", "kind": "PostgresCluster",
        "metadata": {"name": "pg"},
        "spec": {"instances": 1, "version": 16, "storage": {"size": "1Gi", "storageClassName": class}}
    }))
    .expect("cluster");
    clusters
        .create(&PostParams::default(), &cluster)
        .await
        .expect("create PostgresCluster");
    let ready_at = |version: i64| {
        let clusters = clusters.clone();
        async move {
            eventually(
                &format!("PostgresCluster Ready at version {version}"),
                ROLL,
                || {
                    let clusters = clusters.clone();
                    async move {
                        let c = clusters.get("pg").await.map_err(|e| e.to_string())?;
                        let v = serde_json::to_value(&c).map_err(|e| e.to_string())?;
                        let healthy = health::postgres(&v);
                        let current = v
                            .pointer("/status/currentVersion")
                            .and_then(serde_json::Value::as_i64);
                        if healthy.is_healthy() && current == Some(version) {
                            Ok(v)
                        } else {
                            Err(format!("{healthy:?}, currentVersion {current:?}"))
                        }
                    }
                },
            )
            .await
            .expect("cluster ready")
        }
    };
    ready_at(16).await;
    create_and_wait(&env, &[deployment("app", "app:1")], &[], &[]).await;

    let mut args = env.args();
    args.watch_namespace = Some(env.ns.clone());
    let mut op = Operator::with_config(upgrade_orchestrator::NAME, args, env.cp.config().clone())
        .expect("operator")
        .backoff(Duration::from_millis(200), Duration::from_secs(2));
    upgrade_orchestrator::register(
        &mut op,
        upgrade_orchestrator::Options {
            watch_postgresclusters: true,
            ..Default::default()
        },
    )
    .expect("register");
    let op = Harness::start(op).await;

    env.create_plan(plan(
        "database-first",
        vec![
            fixtures::version("db", "pg", "17"),
            component("app", "Deployment", "app:2", &["db"]),
        ],
        Strategy {
            progress_deadline_seconds: 180,
            ..Strategy::default()
        },
    ))
    .await;
    let status = env.wait_succeeded("database-first").await;
    let db = comp(&status, "db");
    assert_eq!(
        (db.previous.as_deref(), db.target.as_deref()),
        (Some("16"), Some("17"))
    );
    assert!(micros(&comp(&status, "app").started_at) >= micros(&db.finished_at));
    let cluster = ready_at(17).await;
    assert_eq!(
        cluster.pointer("/spec/version"),
        Some(&json!(17)),
        "the version stays an integer"
    );
    assert_eq!(deployment_image(&env, "app").await.0, "app:2");
    eprintln!(
        "postgres component: {:.1}s from the version change to Ready at 17",
        (micros(&db.finished_at) - micros(&db.started_at)) as f64 / 1e6
    );

    // A PostgreSQL major version cannot be lowered (the database operator's CEL rule), so a
    // plan that would roll it back is refused at admission unless the component says
    // `rollback: Never`; with it, the others are reverted and the cluster keeps its version.
    let nodes = env.node_count().await;
    create_and_wait(
        &env,
        &[stuck_on_update("late", "late:1", nodes, None)],
        &[],
        &[],
    )
    .await;
    let one_way = |rollback: Option<ComponentRollback>| {
        let db = Component {
            rollback,
            ..fixtures::version("db", "pg", "18")
        };
        plan(
            "one-way",
            vec![db, component("late", "Deployment", "late:2", &["db"])],
            on_failure(FailurePolicy::Rollback, 15),
        )
    };
    let refused = env
        .plans()
        .create(&PostParams::default(), &one_way(None))
        .await
        .expect_err("a plan that would roll a PostgresCluster back is refused");
    assert!(
        refused
            .to_string()
            .contains("set rollback: Never on its component"),
        "{refused}"
    );
    env.create_plan(one_way(Some(ComponentRollback::Never)))
        .await;
    let status = env
        .wait_phase(
            "one-way",
            &[
                PlanPhase::Failed,
                PlanPhase::RolledBack,
                PlanPhase::Succeeded,
            ],
            ROLL,
        )
        .await;
    assert_eq!(
        status.phase,
        Some(PlanPhase::RolledBack),
        "{}",
        describe(&status)
    );
    assert_eq!(comp(&status, "late").phase, ComponentPhase::RolledBack);
    assert_eq!(deployment_image(&env, "late").await.0, "late:1");
    assert_eq!(comp(&status, "db").phase, ComponentPhase::Succeeded);
    let ready = steward_core::conditions::get(&status.conditions, "Ready").expect("Ready");
    assert!(
        ready.message.contains("kept (rollback: Never): db at 18"),
        "{}",
        ready.message
    );
    assert_eq!(
        clusters
            .get("pg")
            .await
            .expect("pg")
            .data
            .pointer("/spec/version"),
        Some(&json!(18))
    );
    env.expect_events("one-way", &["PlanRolledBack", "TargetReverted"])
        .await;

    op.stop().await.expect("orchestrator stops");
    let _ = db_operator.stop().await;
}

/// The state a leader leaves when it dies right after recording a start (or a revert) and
/// before changing the target — written here by hand, so this window is hit every time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resumes_a_recorded_start_and_a_recorded_revert() {
    let env = Env::new("uo-resume").await;
    create_and_wait(
        &env,
        &[
            deployment("a", "a:1"),
            deployment("b", "b:1"),
            deployment("c", "c:1"),
        ],
        &[],
        &[],
    )
    .await;
    // c already carries the new image, as if the dead leader's change had gone through.
    env.api::<Deployment>()
        .patch("c", &PatchParams::default(), &Patch::Merge(&json!({"spec": {"template": {"spec": {"containers": [{"name": "app", "image": "c:2"}]}}}})))
        .await
        .expect("pre-change c");
    let generations = (
        deployment_image(&env, "a").await.1,
        deployment_image(&env, "c").await.1,
    );
    env.create_plan(plan(
        "forward",
        vec![
            component("a", "Deployment", "a:2", &[]),
            component("b", "Deployment", "b:2", &["a"]),
        ],
        Strategy::default(),
    ))
    .await;
    env.create_plan(plan(
        "backward",
        vec![component("c", "Deployment", "c:2", &[])],
        rollback(),
    ))
    .await;
    let recorded = k8s_openapi::jiff::Timestamp::from_microsecond(
        k8s_openapi::jiff::Timestamp::now().as_microsecond(),
    )
    .expect("now");
    let now = recorded.to_string();
    let write = |name: &'static str, status: serde_json::Value| {
        let plans = env.plans();
        async move {
            let body = json!({"apiVersion": "upgrade.steward.dev/v1alpha1", "kind": "UpgradePlan", "metadata": {"name": name}, "status": status});
            plans
                .patch_status(
                    name,
                    &PatchParams::apply(upgrade_orchestrator::NAME).force(),
                    &Patch::Apply(&body),
                )
                .await
                .expect("status");
        }
    };
    write("forward", json!({
        "phase": "Progressing", "observedGeneration": 1, "startedAt": now, "currentWave": 1, "waves": 2,
        "components": [
            {"name": "a", "wave": 1, "phase": "Progressing", "previous": "a:1", "target": "a:2", "startedAt": now},
            {"name": "b", "wave": 2, "phase": "Pending"},
        ],
    }))
    .await;
    write("backward", json!({
        "phase": "RollingBack", "observedGeneration": 1, "startedAt": now, "currentWave": 1, "waves": 1,
        "components": [
            {"name": "c", "wave": 1, "phase": "RollingBack", "previous": "c:1", "target": "c:2", "startedAt": now,
             "finishedAt": now, "rollbackStartedAt": now, "message": "the previous leader died here"},
        ],
    }))
    .await;
    assert_eq!(
        deployment_image(&env, "a").await.0,
        "a:1",
        "recorded, not yet changed"
    );

    let op = env.start().await;
    let forward = env
        .wait_phase(
            "forward",
            &[
                PlanPhase::Succeeded,
                PlanPhase::Paused,
                PlanPhase::RolledBack,
            ],
            ROLL,
        )
        .await;
    let backward = env
        .wait_phase(
            "backward",
            &[PlanPhase::RolledBack, PlanPhase::Failed],
            ROLL,
        )
        .await;
    assert_eq!(
        forward.phase,
        Some(PlanPhase::Succeeded),
        "{}",
        describe(&forward)
    );
    assert_eq!(
        micros(&comp(&forward, "a").started_at),
        recorded.as_microsecond(),
        "the recorded start is kept"
    );
    assert_eq!(
        deployment_image(&env, "a").await,
        ("a:2".to_string(), generations.0 + 1),
        "changed once"
    );
    assert_eq!(
        backward.phase,
        Some(PlanPhase::RolledBack),
        "{}",
        describe(&backward)
    );
    assert_eq!(
        deployment_image(&env, "c").await,
        ("c:1".to_string(), generations.1 + 1),
        "reverted once, to the recorded value"
    );
    op.stop().await.expect("clean shutdown");
}

// ---------------------------------------------------------------------------------------------
// Hooks: Jobs before and after a component's change

/// A hook Job spec; `fails`: its pod can never be scheduled (no node has the label), so the
/// Job fails on its 3 s deadline (kwok completes any scheduled Job pod successfully).
fn hook_job(fails: bool) -> serde_json::Value {
    let mut spec = json!({
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 0,
        "containers": [{"name": "hook", "image": "migrate:2"}],
    });
    if fails {
        spec["nodeSelector"] = json!({"steward.dev/no-such-node": "true"});
    }
    let mut job = json!({"backoffLimit": 0, "template": {"spec": spec}});
    if fails {
        job["activeDeadlineSeconds"] = json!(3);
    }
    job
}

/// When each of the namespace's Jobs was first seen complete (by the test's own watch).
fn watch_job_completions(env: &Env) -> (Arc<Mutex<BTreeMap<String, Instant>>>, JoinHandle<()>) {
    let done: Arc<Mutex<BTreeMap<String, Instant>>> = Arc::default();
    let record = done.clone();
    let api: Api<k8s_openapi::api::batch::v1::Job> = env.api();
    let task = tokio::spawn(
        watcher(api, watcher::Config::default())
            .applied_objects()
            .for_each(move |job| {
                if let Ok(job) = job
                    && upgrade_orchestrator::hook::state(&job)
                        == upgrade_orchestrator::hook::JobState::Succeeded
                {
                    let mut done = record.lock().expect("lock");
                    done.entry(job.name_any()).or_insert_with(Instant::now);
                }
                futures::future::ready(())
            }),
    );
    (done, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hooks_gate_the_change_and_a_failed_hook_rolls_the_plan_back() {
    let env = Env::new("uo-hooks").await;
    create_and_wait(
        &env,
        &[deployment("db", "db:1"), deployment("api", "api:1")],
        &[],
        &[],
    )
    .await;
    let (db_generation, api_generation) = (
        deployment_image(&env, "db").await.1,
        deployment_image(&env, "api").await.1,
    );
    let op = env.start().await;

    // A hook Job the API server refuses (no containers) is reported before anything changes.
    let mut bad = component("db", "Deployment", "db:2", &[]);
    bad.hooks = fixtures::hooks(
        Some(json!({"template": {"spec": {"restartPolicy": "Never", "containers": []}}})),
        None,
    );
    env.create_plan(plan("bad-hook", vec![bad], Strategy::default()))
        .await;
    let status = env.wait_invalid("bad-hook").await;
    let valid = steward_core::conditions::get(&status.conditions, "Valid").expect("Valid");
    assert_eq!(valid.reason, "InvalidHook", "{}", valid.message);
    assert!(
        valid.message.contains("db") && valid.message.contains("before"),
        "{}",
        valid.message
    );
    assert!(status.started_at.is_none());
    env.plans()
        .delete("bad-hook", &DeleteParams::default())
        .await
        .expect("delete");
    assert_eq!(
        deployment_image(&env, "db").await,
        ("db:1".to_string(), db_generation)
    );

    // db: a before hook (say, a migration) and an after hook (a smoke test), both succeed;
    // api: its after hook fails, so the plan rolls both back.
    let (timeline, watches) = watch_timeline(
        &env,
        BTreeMap::from([("db".to_string(), "db:2".to_string())]),
    );
    let (completed, job_watch) = watch_job_completions(&env);
    let mut db = component("db", "Deployment", "db:2", &[]);
    db.hooks = fixtures::hooks(Some(hook_job(false)), Some(hook_job(false)));
    let mut api = component("api", "Deployment", "api:2", &["db"]);
    api.hooks = fixtures::hooks(None, Some(hook_job(true)));
    env.create_plan(plan(
        "hooks",
        vec![db, api],
        on_failure(FailurePolicy::Rollback, 60),
    ))
    .await;
    let status = env.wait_rolled_back("hooks").await;

    // The before hook finished before db's image changed; db succeeded only after its after
    // hook did.
    let migrated = completed
        .lock()
        .expect("lock")
        .get("hooks-db-before-1")
        .copied();
    let changed = timeline
        .lock()
        .expect("lock")
        .get("db")
        .and_then(|s| s.changed);
    match (migrated, changed) {
        (Some(m), Some(c)) => assert!(m <= c, "db changed {:?} before its hook finished", m - c),
        other => panic!("hook completion and change not both seen: {other:?}"),
    }
    assert!(
        completed
            .lock()
            .expect("lock")
            .contains_key("hooks-db-after-1"),
        "db's after hook ran"
    );
    let db_status = comp(&status, "db");
    assert_eq!(db_status.phase, ComponentPhase::RolledBack);
    let api_status = comp(&status, "api");
    assert_eq!(api_status.phase, ComponentPhase::RolledBack);
    let api_hook = api_status.hook.as_ref().expect("api's hook is recorded");
    assert_eq!(
        (api_hook.job.as_str(), api_hook.phase),
        (
            "hooks-api-after-1",
            upgrade_orchestrator::crd::HookPhase::Failed
        )
    );
    // Each Job is the plan's (deleted with it) and carries the plan's labels.
    let job: k8s_openapi::api::batch::v1::Job =
        env.api().get("hooks-api-after-1").await.expect("job");
    assert_eq!(job.owner_references()[0].name, "hooks");
    assert_eq!(
        job.labels()[upgrade_orchestrator::hook::STAGE_LABEL],
        "after"
    );
    // Changed once and reverted once each: back to the old images.
    assert_eq!(
        deployment_image(&env, "db").await,
        ("db:1".to_string(), db_generation + 2)
    );
    assert_eq!(
        deployment_image(&env, "api").await,
        ("api:1".to_string(), api_generation + 2)
    );
    env.expect_events(
        "hooks",
        &[
            "HookStarted",
            "HookSucceeded",
            "ComponentFailed",
            "RollbackStarted",
            "PlanRolledBack",
        ],
    )
    .await;
    let events: Api<Event> = env.api();
    let failed = events
        .list(&ListParams::default())
        .await
        .expect("events")
        .items
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some("ComponentFailed"))
        .filter_map(|e| e.note)
        .collect::<Vec<_>>();
    assert!(
        failed
            .iter()
            .any(|n| n.contains("after hook Job hooks-api-after-1 failed: DeadlineExceeded")),
        "{failed:?}"
    );
    for t in watches {
        t.abort();
    }
    job_watch.abort();
    op.stop().await.expect("clean shutdown");
}

// ---------------------------------------------------------------------------------------------
// Any kind: a field by JSON pointer

/// A custom resource with no controller (so no status: healthy once changed).
async fn widget_crd(env: &Env) -> Api<kube::api::DynamicObject> {
    let crd: k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition =
        serde_json::from_value(json!({
            "metadata": {"name": "widgets.test.steward.dev"},
            "spec": {
                "group": "test.steward.dev",
                "names": {"kind": "Widget", "plural": "widgets", "singular": "widget"},
                "scope": "Namespaced",
                "versions": [{"name": "v1", "served": true, "storage": true, "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "properties": {"spec": {"type": "object", "properties": {"size": {"type": "integer", "maximum": 10}}}}
                }}}]
            }
        }))
        .expect("crd");
    env.cp.apply_crd(&crd).await.expect("install Widget CRD");
    let resource = kube::api::ApiResource {
        group: "test.steward.dev".into(),
        version: "v1".into(),
        api_version: "test.steward.dev/v1".into(),
        kind: "Widget".into(),
        plural: "widgets".into(),
    };
    Api::namespaced_with(env.client.clone(), &env.ns, &resource)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fields_of_any_kind_are_changed_and_rolled_back_exactly() {
    use k8s_openapi::api::core::v1::ConfigMap;
    let env = Env::new("uo-anykind").await;
    let widgets = widget_crd(&env).await;
    let widget: kube::api::DynamicObject = serde_json::from_value(json!({
        "apiVersion": "test.steward.dev/v1", "kind": "Widget",
        "metadata": {"name": "w1"}, "spec": {"size": 1}
    }))
    .expect("widget");
    eventually("Widget served", Duration::from_secs(30), || async {
        widgets
            .create(&PostParams::default(), &widget)
            .await
            .map(|_| ())
            .map_err(|e| e.to_string())
    })
    .await
    .expect("create widget");
    let config = ConfigMap {
        metadata: fixtures::meta("app-config"),
        data: Some(fixtures::map([("release", "1.0")])),
        ..ConfigMap::default()
    };
    env.api::<ConfigMap>()
        .create(&PostParams::default(), &config)
        .await
        .expect("create configmap");
    create_and_wait(
        &env,
        &[deployment("api", "api:1"), deployment("gate", "gate:1")],
        &[],
        &[],
    )
    .await;
    let api_generation = deployment_image(&env, "api").await.1;
    let op = env.start().await;

    // Bad targets are refused at admission, saying why.
    let no_version = Component {
        set: Some(FieldChange {
            path: "/data/release".into(),
            value: "2.0".into(),
        }),
        ..fixtures::change("config", fixtures::target("ConfigMap", "config"))
    };
    env.assert_refused(
        plan("bad-kind", vec![no_version], Strategy::default()),
        "needs its apiVersion",
    )
    .await;
    let mut image_on_config = component("config", "ConfigMap", "x", &[]);
    image_on_config.target.api_version = Some("v1".into());
    env.assert_refused(
        plan("bad-change", vec![image_on_config], Strategy::default()),
        "exactly one of",
    )
    .await;

    // A ConfigMap's data, a custom resource's spec field and a container's env (absent before)
    // change; then `gate` fails, and each is put back exactly.
    // Component `name` setting `path` of `target` to `value`.
    let set = |name: &str, target: TargetRef, path: &str, value: serde_json::Value| Component {
        set: Some(FieldChange {
            path: path.into(),
            value,
        }),
        ..fixtures::change(name, target)
    };
    let config = set(
        "config",
        TargetRef {
            api_version: Some("v1".into()),
            ..fixtures::target("ConfigMap", "app-config")
        },
        "/data/release",
        "2.0".into(),
    );
    let widget = set(
        "widget",
        TargetRef {
            api_version: Some("test.steward.dev/v1".into()),
            ..fixtures::target("Widget", "w1")
        },
        "/spec/size",
        5.into(),
    );
    let env_var = Component {
        depends_on: vec!["config".into()],
        ..set(
            "api",
            fixtures::target("Deployment", "api"),
            "/spec/template/spec/containers/0/env",
            json!([{"name": "RELEASE", "value": "2.0"}]),
        )
    };
    let mut gate = component("gate", "Deployment", "gate:2", &["widget", "api"]);
    // It fails as soon as it holds gate:2, and is healthy again on gate:1.
    gate.health = Some(HealthCheck {
        healthy: "self.spec.template.spec.containers[0].image == 'gate:1'".into(),
        failed: Some("self.spec.template.spec.containers[0].image == 'gate:2'".into()),
    });
    env.create_plan(plan(
        "anykind",
        vec![config, widget, env_var, gate],
        Strategy {
            failure_policy: FailurePolicy::Rollback,
            max_concurrent: 3,
            ..Strategy::default()
        },
    ))
    .await;
    let status = env.wait_rolled_back("anykind").await;
    let recorded = |name: &str| {
        let c = comp(&status, name);
        (
            c.phase,
            c.previous.clone().unwrap_or_default(),
            c.target.clone().unwrap_or_default(),
        )
    };
    // Outside /spec: recorded as digests only (the ConfigMap kept the value to restore).
    assert_eq!(
        recorded("config"),
        (
            ComponentPhase::RolledBack,
            upgrade_orchestrator::redact::digest("\"1.0\""),
            upgrade_orchestrator::redact::digest("\"2.0\"")
        )
    );
    assert_eq!(
        recorded("widget"),
        (ComponentPhase::RolledBack, "1".into(), "5".into())
    );
    assert_eq!(
        recorded("api"),
        (
            ComponentPhase::RolledBack,
            "null".into(),
            r#"[{"name":"RELEASE","value":"2.0"}]"#.into()
        )
    );
    let config = env
        .api::<ConfigMap>()
        .get("app-config")
        .await
        .expect("configmap");
    assert_eq!(config.data.unwrap()["release"], "1.0");
    let widget = widgets.get("w1").await.expect("widget");
    assert_eq!(widget.data["spec"]["size"], json!(1));
    let api = env.api::<Deployment>().get("api").await.expect("api");
    assert_eq!(
        api.spec.template.spec.unwrap().containers[0].env,
        None,
        "the env the plan added is removed again"
    );
    assert_eq!(api.metadata.generation, Some(api_generation + 2));
    env.expect_events(
        "anykind",
        &["TargetChanged", "TargetReverted", "PlanRolledBack"],
    )
    .await;
    op.stop().await.expect("clean shutdown");
}

// ---------------------------------------------------------------------------------------------
// Acting as the plan's ServiceAccount, across namespaces

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plan_acts_as_its_service_account_and_changes_only_what_it_may() {
    use k8s_openapi::api::core::v1::ServiceAccount;
    use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding};
    let env = Env::new("uo-impersonate").await;
    let other = env.cp.namespace("uo-target").await.expect("namespace");
    let in_other = |name: &str, image: &str| {
        let mut d = deployment(name, image);
        d.metadata.namespace = Some(other.clone());
        d
    };
    let deployments: Api<Deployment> = Api::namespaced(env.client.clone(), &other);
    for d in [in_other("web", "web:1"), in_other("admin", "admin:1")] {
        deployments
            .create(&PostParams::default(), &d)
            .await
            .expect("create deployment");
    }
    // `deployer` may get and patch the Deployment `web` there, nothing else; `nobody` nothing;
    // `bystander` as much as `deployer`, but it lets no plan act as it.
    let delegate = upgrade_orchestrator::plan::DELEGATE_ANNOTATION;
    for (sa, plans) in [
        (
            "deployer",
            Some("as-deployer, other-target, hook-as-nobody"),
        ),
        ("nobody", Some("*")),
        ("bystander", None),
    ] {
        let mut metadata = fixtures::meta(sa);
        if let Some(plans) = plans {
            metadata.annotations = Some([(delegate.to_string(), plans.to_string())].into());
        }
        let sa = ServiceAccount {
            metadata,
            ..ServiceAccount::default()
        };
        env.api::<ServiceAccount>()
            .create(&PostParams::default(), &sa)
            .await
            .expect("create sa");
    }
    let role = fixtures::role(
        "deploy-web",
        vec![PolicyRule {
            resource_names: Some(vec!["web".into()]),
            ..fixtures::rule(&["apps"], &["deployments"], &["get", "patch"])
        }],
    );
    Api::<Role>::namespaced(env.client.clone(), &other)
        .create(&PostParams::default(), &role)
        .await
        .expect("create role");
    let binding = fixtures::role_binding(
        "deploy-web",
        vec![
            fixtures::rbac_service_account(&env.ns, "deployer"),
            fixtures::rbac_service_account(&env.ns, "bystander"),
        ],
    );
    Api::<RoleBinding>::namespaced(env.client.clone(), &other)
        .create(&PostParams::default(), &binding)
        .await
        .expect("create binding");
    let op = env.start().await;
    let across = |target: &str, image: &str| {
        let mut c = component(target, "Deployment", image, &[]);
        c.target.namespace = Some(other.clone());
        c
    };

    // Without a ServiceAccount a target elsewhere is refused at admission.
    let refused = env
        .plans()
        .create(
            &PostParams::default(),
            &plan("no-sa", vec![across("web", "web:2")], Strategy::default()),
        )
        .await
        .expect_err("refused");
    assert!(
        refused
            .to_string()
            .contains("needs spec.serviceAccountName"),
        "{refused}"
    );

    // What the ServiceAccount may not touch is reported before anything changes.
    for (name, sa, target) in [
        ("as-nobody", "nobody", "web"),
        ("other-target", "deployer", "admin"),
    ] {
        let mut p = plan(
            name,
            vec![across(target, &format!("{target}:2"))],
            Strategy::default(),
        );
        p.spec.service_account_name = Some(sa.into());
        env.create_plan(p).await;
        let status = env.wait_invalid(name).await;
        let valid = steward_core::conditions::get(&status.conditions, "Valid").expect("Valid");
        assert!(
            valid.message.contains("cannot be read") && valid.message.contains("forbidden"),
            "{name}: {}",
            valid.message
        );
        assert!(status.started_at.is_none(), "{name} did not start");
    }

    // A ServiceAccount that does not delegate to the plan (or does not exist) is not acted
    // as, whatever it may do (issue #39, item 7: creating a plan amounted to acting as any
    // ServiceAccount of the namespace).
    for (name, sa, why) in [
        (
            "as-bystander",
            "bystander",
            "does not delegate to this plan",
        ),
        ("as-ghost", "ghost", "does not exist"),
    ] {
        let mut p = plan(name, vec![across("web", "web:2")], Strategy::default());
        p.spec.service_account_name = Some(sa.into());
        env.create_plan(p).await;
        let status = env.wait_invalid(name).await;
        let valid = steward_core::conditions::get(&status.conditions, "Valid").expect("Valid");
        assert_eq!(valid.reason, "ServiceAccountNotDelegated", "{name}");
        assert!(
            valid.message.contains(why) && valid.message.contains(delegate),
            "{name}: {}",
            valid.message
        );
        assert!(status.started_at.is_none(), "{name} did not start");
    }
    // Nor does a hook run as another ServiceAccount than the plan's.
    let mut hooked = across("web", "web:2");
    let mut job = hook_job(false);
    job["template"]["spec"]["serviceAccountName"] = json!("nobody");
    hooked.hooks = fixtures::hooks(Some(job), None);
    let mut p = plan("hook-as-nobody", vec![hooked], Strategy::default());
    p.spec.service_account_name = Some("deployer".into());
    env.create_plan(p).await;
    let status = env.wait_invalid("hook-as-nobody").await;
    let valid = steward_core::conditions::get(&status.conditions, "Valid").expect("Valid");
    assert_eq!(valid.reason, "InvalidHook", "{}", valid.message);
    assert!(
        valid.message.contains("runs as ServiceAccount \"nobody\""),
        "{}",
        valid.message
    );
    assert_eq!(
        deployments
            .get("web")
            .await
            .expect("web")
            .spec
            .template
            .spec
            .unwrap()
            .containers[0]
            .image
            .as_deref(),
        Some("web:1"),
        "nothing changed yet"
    );

    // What it may change, it changes, as itself.
    let mut p = plan(
        "as-deployer",
        vec![across("web", "web:2")],
        Strategy::default(),
    );
    p.spec.service_account_name = Some("deployer".into());
    env.create_plan(p).await;
    env.wait_succeeded("as-deployer").await;
    let web = deployments.get("web").await.expect("web");
    assert_eq!(
        web.spec
            .template
            .spec
            .as_ref()
            .expect("pod spec")
            .containers[0]
            .image
            .as_deref(),
        Some("web:2")
    );
    let admin = deployments.get("admin").await.expect("admin");
    assert_eq!(
        admin
            .spec
            .template
            .spec
            .as_ref()
            .expect("pod spec")
            .containers[0]
            .image
            .as_deref(),
        Some("admin:1"),
        "untouched"
    );
    op.stop().await.expect("clean shutdown");
}

/// Issue #39, item 7: a plan that names no ServiceAccount acted with the orchestrator's own
/// rights (every Deployment of its namespace, and more), so `create` on UpgradePlans was
/// worth more than any ServiceAccount there. With `--default-service-account default` it
/// acts as the namespace's `default` ServiceAccount, impersonated, without delegation: here
/// `default` may patch Deployment `web` only, so a plan on `web` succeeds and one on `admin`
/// is `Valid=False` (the target cannot be read, forbidden to `default`), with `admin`
/// untouched. A plan that names a ServiceAccount still needs its delegation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plan_naming_no_service_account_acts_as_the_default_one_when_configured() {
    use k8s_openapi::api::core::v1::ServiceAccount;
    use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding};
    let env = Env::new("uo-default-sa").await;
    for d in [deployment("web", "web:1"), deployment("admin", "admin:1")] {
        env.api::<Deployment>()
            .create(&PostParams::default(), &d)
            .await
            .expect("create deployment");
    }
    // The namespace's `default` ServiceAccount exists once its controller made it; the
    // test's control plane may not run that controller, so it is made here if missing.
    let accounts = env.api::<ServiceAccount>();
    if accounts.get_opt("default").await.expect("get sa").is_none() {
        let sa = ServiceAccount {
            metadata: fixtures::meta("default"),
            ..ServiceAccount::default()
        };
        accounts
            .create(&PostParams::default(), &sa)
            .await
            .expect("create default sa");
    }
    let sa = ServiceAccount {
        metadata: fixtures::meta("undelegated"),
        ..ServiceAccount::default()
    };
    accounts
        .create(&PostParams::default(), &sa)
        .await
        .expect("create sa");
    let role = fixtures::role(
        "deploy-web",
        vec![PolicyRule {
            resource_names: Some(vec!["web".into()]),
            ..fixtures::rule(&["apps"], &["deployments"], &["get", "patch"])
        }],
    );
    env.api::<Role>()
        .create(&PostParams::default(), &role)
        .await
        .expect("create role");
    let binding = fixtures::role_binding(
        "deploy-web",
        vec![
            fixtures::rbac_service_account(&env.ns, "default"),
            fixtures::rbac_service_account(&env.ns, "undelegated"),
        ],
    );
    env.api::<RoleBinding>()
        .create(&PostParams::default(), &binding)
        .await
        .expect("create binding");
    let op = env
        .start_with(upgrade_orchestrator::Options {
            watch_postgresclusters: false,
            default_service_account: Some("default".into()),
        })
        .await;

    // Beyond what `default` may: refused before anything changes.
    env.create_plan(plan(
        "on-admin",
        vec![component("admin", "Deployment", "admin:2", &[])],
        Strategy::default(),
    ))
    .await;
    let status = env.wait_invalid("on-admin").await;
    let valid = steward_core::conditions::get(&status.conditions, "Valid").expect("Valid");
    let acting = format!("system:serviceaccount:{}:default", env.ns);
    assert!(
        valid.message.contains("forbidden") && valid.message.contains(&acting),
        "as {acting}: {}",
        valid.message
    );
    assert!(status.started_at.is_none(), "on-admin did not start");
    // A ServiceAccount named explicitly still has to delegate.
    let mut p = plan(
        "as-undelegated",
        vec![component("web", "Deployment", "web:2", &[])],
        Strategy::default(),
    );
    p.spec.service_account_name = Some("undelegated".into());
    env.create_plan(p).await;
    let status = env.wait_invalid("as-undelegated").await;
    let valid = steward_core::conditions::get(&status.conditions, "Valid").expect("Valid");
    assert_eq!(
        valid.reason, "ServiceAccountNotDelegated",
        "{}",
        valid.message
    );

    // Within what `default` may: done, as `default`.
    env.create_plan(plan(
        "on-web",
        vec![component("web", "Deployment", "web:2", &[])],
        Strategy::default(),
    ))
    .await;
    env.wait_succeeded("on-web").await;
    let image = |d: Deployment| {
        d.spec
            .template
            .spec
            .and_then(|p| p.containers.into_iter().next())
            .and_then(|c| c.image)
    };
    let deployments = env.api::<Deployment>();
    assert_eq!(
        image(deployments.get("web").await.expect("web")).as_deref(),
        Some("web:2")
    );
    assert_eq!(
        image(deployments.get("admin").await.expect("admin")).as_deref(),
        Some("admin:1"),
        "untouched"
    );
    op.stop().await.expect("clean shutdown");
}

// ---------------------------------------------------------------------------------------------
// What a plan publishes of the values it changes (issue #39, item 3)

/// Every Event note in the test's namespace.
async fn event_notes(env: &Env) -> Vec<String> {
    let events: Api<Event> = env.api();
    events
        .list(&ListParams::default())
        .await
        .expect("events")
        .items
        .into_iter()
        .filter_map(|e| e.note)
        .collect()
}

/// Asserts that none of `values` appears in `status` or in any Event of the namespace.
async fn assert_unpublished(env: &Env, status: &UpgradePlanStatus, values: &[String]) {
    let status = serde_json::to_string(status).expect("status");
    let notes = event_notes(env).await;
    let texts = std::iter::once(("the plan's status", &status))
        .chain(notes.iter().map(|note| ("an Event", note)));
    for (what, text) in texts {
        for value in values {
            assert!(
                !text.contains(value.as_str()),
                "{what} shows {value:?}: {text}"
            );
        }
    }
}

/// A plan on a Secret's field and a ConfigMap's data, rolled back by a failing component:
/// neither the Secret's old nor its new value (as text or base64) appears in the plan's
/// status or in any Event of the namespace, the ConfigMap's only as a digest, and the
/// rollback restores both exactly. Fault: a component fails after both changed. Invariant:
/// no value of the Secret outside the Secret (and the plan's own spec, which holds the new
/// one); every target back to its value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plan_on_a_secret_publishes_none_of_its_values_and_still_reverts_them() {
    use k8s_openapi::ByteString;
    use k8s_openapi::api::core::v1::{ConfigMap, Secret};
    const OLD: &str = "hunter2-old-password";
    const NEW: &str = "s3cret-new-password";
    const RELEASE_OLD: &str = "release-1.0-old";
    const RELEASE_NEW: &str = "release-2.0-new";
    let base64 = |text: &str| -> String {
        serde_json::to_value(ByteString(text.as_bytes().to_vec()))
            .expect("base64")
            .as_str()
            .expect("a string")
            .to_string()
    };
    let forbidden = [
        OLD.to_string(),
        NEW.to_string(),
        base64(OLD),
        base64(NEW),
        RELEASE_OLD.to_string(),
        RELEASE_NEW.to_string(),
    ];
    let env = Env::new("uo-secret").await;
    env.api::<Secret>()
        .create(
            &PostParams::default(),
            &Secret {
                metadata: fixtures::meta("db-credentials"),
                data: Some([("password".to_string(), ByteString(OLD.into()))].into()),
                ..Secret::default()
            },
        )
        .await
        .expect("create secret");
    env.api::<ConfigMap>()
        .create(
            &PostParams::default(),
            &ConfigMap {
                metadata: fixtures::meta("app-config"),
                data: Some(fixtures::map([("release", RELEASE_OLD)])),
                ..ConfigMap::default()
            },
        )
        .await
        .expect("create configmap");
    create_and_wait(&env, &[deployment("gate", "gate:1")], &[], &[]).await;
    let op = env.start().await;

    // `/stringData` is write-only: refused at admission, naming the field.
    let string_data = Component {
        set: Some(FieldChange {
            path: "/stringData/password".into(),
            value: NEW.into(),
        }),
        ..fixtures::change(
            "password",
            TargetRef {
                api_version: Some("v1".into()),
                ..fixtures::target("Secret", "db-credentials")
            },
        )
    };
    env.assert_refused(
        plan("string-data", vec![string_data], Strategy::default()),
        "set.path",
    )
    .await;

    let set = |name: &str, kind: &str, target: &str, path: &str, value: &str| Component {
        set: Some(FieldChange {
            path: path.into(),
            value: value.into(),
        }),
        ..fixtures::change(
            name,
            TargetRef {
                api_version: Some("v1".into()),
                ..fixtures::target(kind, target)
            },
        )
    };
    let mut gate = component("gate", "Deployment", "gate:2", &["password", "release"]);
    // Fails once annotated broken at the image it holds; healthy on gate:1 again.
    gate.health = Some(HealthCheck {
        healthy: "self.spec.template.spec.containers[0].image == 'gate:1'".into(),
        failed: Some("has(self.metadata.annotations) && 'broken' in self.metadata.annotations && self.metadata.annotations['broken'] == self.spec.template.spec.containers[0].image".into()),
    });
    env.create_plan(plan(
        "secret",
        vec![
            set(
                "password",
                "Secret",
                "db-credentials",
                "/data/password",
                &base64(NEW),
            ),
            set(
                "release",
                "ConfigMap",
                "app-config",
                "/data/release",
                RELEASE_NEW,
            ),
            gate,
        ],
        Strategy {
            failure_policy: FailurePolicy::Rollback,
            max_concurrent: 2,
            ..Strategy::default()
        },
    ))
    .await;

    // Both changed, gate in flight.
    let status = env
        .wait_component("secret", "gate", ComponentPhase::Progressing)
        .await;
    let secret = env
        .api::<Secret>()
        .get("db-credentials")
        .await
        .expect("secret");
    assert_eq!(secret.data.as_ref().unwrap()["password"].0, NEW.as_bytes());
    // The value to restore is kept on the Secret itself.
    let kept: Vec<&String> = secret
        .metadata
        .annotations
        .iter()
        .flatten()
        .filter(|(k, _)| k.starts_with("upgrade.steward.dev/previous-"))
        .map(|(_, v)| v)
        .collect();
    assert_eq!(kept, [&format!("\"{}\"", base64(OLD))]);
    let password = comp(&status, "password");
    for shown in [&password.previous, &password.target] {
        let shown = shown.as_deref().unwrap_or_default();
        assert!(
            !shown.is_empty() && !shown.contains("sha256:"),
            "a Secret's value is not even digested: {shown:?}"
        );
    }
    assert_ne!(password.previous, password.target);
    let release = comp(&status, "release");
    for shown in [&release.previous, &release.target] {
        let shown = shown.as_deref().unwrap_or_default();
        assert!(shown.starts_with("sha256:"), "{shown:?}");
    }
    env.expect_events("secret", &["ComponentStarted", "TargetChanged"])
        .await;
    assert_unpublished(&env, &status, &forbidden).await;

    // gate fails: everything is reverted, the Secret from its annotation.
    env.api::<Deployment>()
        .patch(
            "gate",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {"broken": "gate:2"}}})),
        )
        .await
        .expect("annotate gate");
    let status = env.wait_rolled_back("secret").await;
    let secret = env
        .api::<Secret>()
        .get("db-credentials")
        .await
        .expect("secret");
    assert_eq!(secret.data.as_ref().unwrap()["password"].0, OLD.as_bytes());
    assert!(
        !secret
            .metadata
            .annotations
            .iter()
            .flatten()
            .any(|(k, _)| k.starts_with("upgrade.steward.dev/")),
        "the revert removes the kept value: {:?}",
        secret.metadata.annotations
    );
    let config = env
        .api::<ConfigMap>()
        .get("app-config")
        .await
        .expect("configmap");
    assert_eq!(config.data.unwrap()["release"], RELEASE_OLD);
    env.expect_events("secret", &["TargetReverted", "PlanRolledBack"])
        .await;
    assert_unpublished(&env, &status, &forbidden).await;

    // A plan that succeeds: the new value stays, the kept one is removed once it is over.
    env.create_plan(plan(
        "secret-succeeds",
        vec![set(
            "password",
            "Secret",
            "db-credentials",
            "/data/password",
            &base64(NEW),
        )],
        Strategy::default(),
    ))
    .await;
    let status = env
        .wait_phase("secret-succeeds", &[PlanPhase::Succeeded], ROLL)
        .await;
    env.expect_events("secret-succeeds", &["TargetChanged", "PlanSucceeded"])
        .await;
    let secret = eventually("the kept value removed", WAIT_VALID, || async {
        let secret = env
            .api::<Secret>()
            .get("db-credentials")
            .await
            .map_err(|e| e.to_string())?;
        match &secret.metadata.annotations {
            Some(a) if a.keys().any(|k| k.starts_with("upgrade.steward.dev/")) => {
                Err(format!("{a:?}"))
            }
            _ => Ok(secret),
        }
    })
    .await
    .expect("no kept value after success");
    assert_eq!(secret.data.as_ref().unwrap()["password"].0, NEW.as_bytes());
    assert_unpublished(&env, &status, &forbidden).await;
    op.stop().await.expect("clean shutdown");
}

// ---------------------------------------------------------------------------------------------
// Custom health rules within a budget (issue #39, item 4)

/// Issue #39's reproduction: five comprehensions over a literal list of 40 ints (614
/// characters), 40^5 evaluations of the innermost body.
fn pathological_health() -> String {
    let list = format!(
        "[{}]",
        (0..40).map(|i| i.to_string()).collect::<Vec<_>>().join(",")
    );
    let rule = format!(
        "{list}.all(a, {list}.all(b, {list}.all(c, {list}.all(d, {list}.all(e, a+b+c+d+e >= 0)))))"
    );
    assert_eq!(rule.len(), 614);
    rule
}

/// Two plans whose health rule is the pathological expression of issue #39, and one nested
/// 2 000 parentheses deep, are `Valid=False InvalidHealthCheck` (nothing changed), while an
/// ordinary plan created after them progresses to Succeeded. Fault: expressions that pinned
/// the leader's CPU (and could overflow a stack). Invariant: refused before anything changes,
/// other plans unaffected. Figures: time to each verdict.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pathological_health_rules_are_refused_and_other_plans_progress() {
    let env = Env::new("uo-budget").await;
    create_and_wait(
        &env,
        &[
            deployment("slow-a", "slow-a:1"),
            deployment("slow-b", "slow-b:1"),
            deployment("fine", "fine:1"),
        ],
        &[],
        &[],
    )
    .await;
    let op = env.start().await;
    let started = Instant::now();
    let with_rule = |name: &str, healthy: String| Component {
        health: Some(HealthCheck {
            healthy,
            failed: None,
        }),
        ..component(name, "Deployment", &format!("{name}:2"), &[])
    };
    let deep = format!("{}true{}", "(".repeat(2000), ")".repeat(2000));
    for (plan_name, target, rule) in [
        ("pathological-a", "slow-a", pathological_health()),
        ("pathological-b", "slow-b", pathological_health()),
        ("deep", "slow-a", deep),
    ] {
        env.create_plan(plan(
            plan_name,
            vec![with_rule(target, rule)],
            Strategy::default(),
        ))
        .await;
    }
    env.create_plan(plan(
        "ordinary",
        vec![component("fine", "Deployment", "fine:2", &[])],
        Strategy::default(),
    ))
    .await;
    for name in ["pathological-a", "pathological-b", "deep"] {
        let status = env.wait_invalid(name).await;
        let valid = steward_core::conditions::get(&status.conditions, "Valid").expect("Valid");
        assert_eq!(
            valid.reason, "InvalidHealthCheck",
            "{name}: {}",
            valid.message
        );
        assert!(
            valid.message.contains("health.healthy"),
            "{}",
            valid.message
        );
        assert!(status.started_at.is_none(), "{name}");
        eprintln!(
            "{name}: Valid=False after {:.1}s: {}",
            started.elapsed().as_secs_f64(),
            valid.message
        );
    }
    let status = env.status("pathological-a").await;
    let budget = &steward_core::conditions::get(&status.conditions, "Valid")
        .expect("Valid")
        .message;
    assert!(budget.contains("budget"), "{budget}");
    env.wait_phase("ordinary", &[PlanPhase::Succeeded], ROLL)
        .await;
    eprintln!(
        "ordinary: Succeeded after {:.1}s",
        started.elapsed().as_secs_f64()
    );
    assert_eq!(deployment_image(&env, "fine").await.0, "fine:2");
    assert_eq!(deployment_image(&env, "slow-a").await.0, "slow-a:1");
    assert_eq!(deployment_image(&env, "slow-b").await.0, "slow-b:1");
    op.stop().await.expect("clean shutdown");
}
