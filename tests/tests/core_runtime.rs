//! steward-core's runtime against the real API server: finalizers, per-object backoff,
//! and the metrics and health endpoints. A test operator for a throwaway `Gadget` CRD runs
//! in-process.

#![allow(clippy::unwrap_used)] // test helpers: a failed call is a failed test

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Event as CoreEvent;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::{CustomResource, CustomResourceExt, ResourceExt};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::json;
use steward_core::Controller;
use steward_core::cli::CommonArgs;
use steward_core::finalizer::{self, DeletionPolicy, Event};
use steward_core::{Context, Operator, ReconcileError, conditions};
use steward_testenv::{at_least, eventually, free_port, http_get};

#[derive(CustomResource, Clone, Debug, Deserialize, Serialize, JsonSchema)]
#[kube(
    group = "coretest.steward.dev",
    version = "v1",
    kind = "Gadget",
    namespaced,
    status = "GadgetStatus"
)]
#[serde(rename_all = "camelCase")]
pub struct GadgetSpec {
    #[serde(default)]
    pub deletion_policy: DeletionPolicy,
}

#[derive(Clone, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq)]
pub struct GadgetStatus {
    #[serde(default)]
    pub conditions: Vec<Condition>,
}

const FINALIZER: &str = "coretest.steward.dev/cleanup";
const WAIT: Duration = Duration::from_secs(60);

/// What the test controls and observes.
#[derive(Default)]
struct Probe {
    fail_apply: AtomicBool,
    fail_cleanup: AtomicBool,
    cleanups: AtomicUsize,
    cleanup_attempts: AtomicUsize,
    attempts: Mutex<HashMap<String, Vec<Instant>>>,
    /// A reconcile of the object of this name panics.
    panic_on: Mutex<Option<String>>,
    /// A reconcile of the object of this name never returns (a call to a server that
    /// stopped answering, with no timeout of its own).
    hang_on: Mutex<Option<String>>,
}

impl Probe {
    /// How many reconciles of the object `name` started.
    fn attempts_of(&self, name: &str) -> usize {
        self.attempts.lock().unwrap().get(name).map_or(0, Vec::len)
    }
}

#[derive(Debug, thiserror::Error)]
enum TestError {
    #[error("apply failed on purpose")]
    ApplyFailed,
    #[error("external cleanup failed on purpose")]
    CleanupFailed,
    #[error(transparent)]
    Kube(#[from] kube::Error),
    #[error(transparent)]
    Core(#[from] steward_core::Error),
    #[error(transparent)]
    Finalizer(Box<finalizer::Error<TestError>>),
}

impl ReconcileError for TestError {
    fn reason(&self) -> &str {
        match self {
            TestError::ApplyFailed => "ApplyFailed",
            TestError::CleanupFailed => "CleanupFailed",
            TestError::Finalizer(e) => e.reason(),
            _ => "ApiError",
        }
    }
}

async fn write_conditions(
    ctx: &Context<Arc<Probe>>,
    g: &Gadget,
    ready: bool,
    reason: &str,
    message: &str,
) -> Result<(), TestError> {
    let mut next = g.status.clone().unwrap_or_default();
    conditions::set(
        &mut next.conditions,
        conditions::READY,
        ready,
        reason,
        message,
        g.metadata.generation,
    );
    ctx.apply_status(g, g.status.as_ref(), &next).await?;
    Ok(())
}

async fn reconcile(obj: Arc<Gadget>, ctx: Arc<Context<Arc<Probe>>>) -> Result<Action, TestError> {
    let probe = ctx.data.clone();
    probe
        .attempts
        .lock()
        .unwrap()
        .entry(obj.name_any())
        .or_default()
        .push(Instant::now());
    if probe.panic_on.lock().unwrap().as_deref() == Some(obj.name_any().as_str()) {
        panic!("reconcile of {} panicked on purpose", obj.name_any());
    }
    if probe.hang_on.lock().unwrap().as_deref() == Some(obj.name_any().as_str()) {
        std::future::pending::<()>().await;
    }
    let api: Api<Gadget> =
        Api::namespaced(ctx.client.clone(), &obj.namespace().unwrap_or_default());
    let ctx2 = ctx.clone();
    finalizer::run(&api, FINALIZER, obj, |event| async move {
        match event {
            Event::Apply(g) => {
                if probe.fail_apply.load(Ordering::SeqCst) {
                    return Err(TestError::ApplyFailed);
                }
                write_conditions(&ctx2, &g, true, "Reconciled", "all good").await?;
                Ok(Action::await_change())
            }
            Event::Cleanup(g) => {
                if g.spec.deletion_policy == DeletionPolicy::Retain {
                    return Ok(Action::await_change());
                }
                probe.cleanup_attempts.fetch_add(1, Ordering::SeqCst);
                if probe.fail_cleanup.load(Ordering::SeqCst) {
                    write_conditions(
                        &ctx2,
                        &g,
                        false,
                        "CleanupFailed",
                        "external cleanup failed; will retry",
                    )
                    .await?;
                    return Err(TestError::CleanupFailed);
                }
                probe.cleanups.fetch_add(1, Ordering::SeqCst);
                Ok(Action::await_change())
            }
        }
    })
    .await
    .map_err(|e| TestError::Finalizer(Box::new(e)))
}

struct Running {
    api: Api<Gadget>,
    ns: String,
    probe: Arc<Probe>,
    addr: SocketAddr,
    operator: steward_testenv::harness::Harness,
}

async fn start(prefix: &str, backoff_base: Duration) -> Running {
    start_with(prefix, backoff_base, None, |_| {}).await
}

/// [`start`], authenticated as ServiceAccount `service_account` of the test namespace when
/// given, with flags adjusted by `flags`.
async fn start_with(
    prefix: &str,
    backoff_base: Duration,
    service_account: Option<&str>,
    flags: impl FnOnce(&mut CommonArgs),
) -> Running {
    let cp = steward_testenv::shared().await.expect("control plane");
    cp.apply_crd(&Gadget::crd()).await.expect("Gadget CRD");
    let ns = cp.namespace(prefix).await.expect("namespace");
    let addr: SocketAddr = format!("127.0.0.1:{}", free_port().unwrap())
        .parse()
        .unwrap();
    let mut args = CommonArgs {
        leader_elect: false,
        watch_namespace: Some(ns.clone()),
        metrics_bind_address: addr.to_string(),
        health_probe_bind_address: addr.to_string(),
        ..CommonArgs::default()
    };
    flags(&mut args);
    if std::env::var_os("RUST_LOG").is_some() {
        steward_core::telemetry::init_logs(&args);
    }
    let config = match service_account {
        Some(sa) => cp
            .service_account_config(&ns, sa)
            .await
            .expect("ServiceAccount config"),
        None => cp.config().clone(),
    };
    let mut operator = Operator::with_config("coretest", args, config)
        .expect("operator")
        .backoff(backoff_base, Duration::from_secs(30));
    let probe = Arc::new(Probe::default());
    let api: Api<Gadget> = operator.api();
    operator.controller(
        Controller::new(api.clone(), Default::default()),
        probe.clone(),
        reconcile,
    );
    Running {
        api: Api::namespaced(cp.client().unwrap(), &ns),
        ns,
        probe,
        addr,
        operator: steward_testenv::harness::Harness::start(operator).await,
    }
}

/// Waits until Gadget `name` is Ready; `what` names the wait in its failure.
async fn wait_ready(api: &Api<Gadget>, name: &str, what: &str) {
    eventually(what, WAIT, || async {
        let g = api.get(name).await.map_err(|e| e.to_string())?;
        g.status
            .as_ref()
            .filter(|s| conditions::is_true(&s.conditions, "Ready"))
            .map(|_| ())
            .ok_or_else(|| "not Ready".to_string())
    })
    .await
    .unwrap();
}

/// Waits for an Event of `reason` in namespace `ns` and returns it.
async fn event_of(api: &Api<Gadget>, ns: &str, reason: &str) -> CoreEvent {
    let events: Api<CoreEvent> = Api::namespaced(api.clone().into_client(), ns);
    eventually(&format!("a {reason} Event"), WAIT, || async {
        let list = events
            .list(&ListParams::default())
            .await
            .map_err(|e| e.to_string())?;
        list.items
            .into_iter()
            .find(|e| e.reason.as_deref() == Some(reason))
            .ok_or_else(|| "none yet".to_string())
    })
    .await
    .unwrap()
}

impl Running {
    async fn stop(self) {
        self.operator.stop().await.expect("clean shutdown");
    }
}

fn gadget(name: &str, policy: DeletionPolicy) -> Gadget {
    Gadget::new(
        name,
        GadgetSpec {
            deletion_policy: policy,
        },
    )
}

async fn gone(api: &Api<Gadget>, name: &str) {
    eventually(&format!("{name} deleted"), WAIT, || async {
        match api.get_opt(name).await {
            Ok(None) => Ok(()),
            Ok(Some(g)) => Err(format!("still there, finalizers {:?}", g.finalizers())),
            Err(e) => Err(e.to_string()),
        }
    })
    .await
    .expect("deleted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finalizer_runs_cleanup_once_keeps_object_on_failure_and_retain_skips_cleanup() {
    let run = start("finalizer", Duration::from_millis(200)).await;
    let api = run.api.clone();

    // Apply adds the finalizer.
    api.create(
        &PostParams::default(),
        &gadget("doomed", DeletionPolicy::Delete),
    )
    .await
    .unwrap();
    eventually("finalizer added and Ready", WAIT, || async {
        let g = api.get("doomed").await.map_err(|e| e.to_string())?;
        let ready = g
            .status
            .as_ref()
            .is_some_and(|s| conditions::is_true(&s.conditions, "Ready"));
        if g.finalizers().iter().any(|f| f == FINALIZER) && ready {
            Ok(())
        } else {
            Err(format!("{:?}", g.metadata.finalizers))
        }
    })
    .await
    .unwrap();

    // Delete runs Cleanup exactly once.
    api.delete("doomed", &DeleteParams::default())
        .await
        .unwrap();
    gone(&api, "doomed").await;
    assert_eq!(run.probe.cleanups.load(Ordering::SeqCst), 1);

    // A failing Cleanup keeps the object, says why, and completes on retry.
    run.probe.fail_cleanup.store(true, Ordering::SeqCst);
    api.create(
        &PostParams::default(),
        &gadget("stubborn", DeletionPolicy::Delete),
    )
    .await
    .unwrap();
    eventually("finalizer on stubborn", WAIT, || async {
        let g = api.get("stubborn").await.map_err(|e| e.to_string())?;
        if g.finalizers().is_empty() {
            Err("no finalizer yet".to_string())
        } else {
            Ok(())
        }
    })
    .await
    .unwrap();
    api.delete("stubborn", &DeleteParams::default())
        .await
        .unwrap();
    let reason = eventually("CleanupFailed condition", WAIT, || async {
        let g = api.get("stubborn").await.map_err(|e| e.to_string())?;
        let c = g
            .status
            .as_ref()
            .and_then(|s| conditions::get(&s.conditions, "Ready").cloned());
        match c {
            Some(c)
                if c.reason == "CleanupFailed"
                    && run.probe.cleanup_attempts.load(Ordering::SeqCst) >= 3 =>
            {
                Ok(c.reason)
            }
            other => Err(format!("condition {other:?}")),
        }
    })
    .await
    .unwrap();
    assert_eq!(reason, "CleanupFailed");
    let still = api
        .get("stubborn")
        .await
        .expect("object kept while cleanup fails");
    assert!(still.metadata.deletion_timestamp.is_some());
    assert!(
        still.finalizers().iter().any(|f| f == FINALIZER),
        "finalizer kept"
    );
    let events: Api<CoreEvent> = Api::namespaced(api.clone().into_client(), &run.ns);
    let warning = eventually("Warning Event for the failed cleanup", WAIT, || async {
        let list = events
            .list(&ListParams::default())
            .await
            .map_err(|e| e.to_string())?;
        list.items
            .into_iter()
            .find(|e| {
                e.involved_object.name.as_deref() == Some("stubborn")
                    && e.type_.as_deref() == Some("Warning")
                    && e.reason.as_deref() == Some("CleanupFailed")
            })
            .ok_or_else(|| "no event yet".to_string())
    })
    .await
    .unwrap();
    assert!(
        warning
            .message
            .unwrap_or_default()
            .contains("external cleanup failed")
    );
    run.probe.fail_cleanup.store(false, Ordering::SeqCst);
    gone(&api, "stubborn").await;
    assert_eq!(
        run.probe.cleanups.load(Ordering::SeqCst),
        2,
        "the retry cleaned up"
    );

    // Retain removes the finalizer without cleanup.
    let attempts_before = run.probe.cleanup_attempts.load(Ordering::SeqCst);
    api.create(
        &PostParams::default(),
        &gadget("kept", DeletionPolicy::Retain),
    )
    .await
    .unwrap();
    eventually("finalizer on kept", WAIT, || async {
        let g = api.get("kept").await.map_err(|e| e.to_string())?;
        if g.finalizers().is_empty() {
            Err("no finalizer yet".to_string())
        } else {
            Ok(())
        }
    })
    .await
    .unwrap();
    api.delete("kept", &DeleteParams::default()).await.unwrap();
    gone(&api, "kept").await;
    assert_eq!(
        run.probe.cleanup_attempts.load(Ordering::SeqCst),
        attempts_before,
        "Retain runs no cleanup"
    );
    run.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_reconciles_back_off_exponentially_and_success_resets() {
    let base = Duration::from_millis(300);
    let run = start("backoff", base).await;
    let api = run.api.clone();
    run.probe.fail_apply.store(true, Ordering::SeqCst);
    api.create(
        &PostParams::default(),
        &gadget("flaky", DeletionPolicy::Retain),
    )
    .await
    .unwrap();
    let attempts = |n: usize| {
        let probe = run.probe.clone();
        async move {
            let a = probe
                .attempts
                .lock()
                .unwrap()
                .get("flaky")
                .cloned()
                .unwrap_or_default();
            if a.len() >= n {
                Ok(a)
            } else {
                Err(format!("{} attempts", a.len()))
            }
        }
    };
    // The first attempt only adds the finalizer (and succeeds); the failures start after it.
    let failing = eventually("5 failed attempts", WAIT, || attempts(6))
        .await
        .unwrap();
    let gaps: Vec<Duration> = failing[1..].windows(2).map(|w| w[1] - w[0]).collect();
    println!("gaps between failing attempts: {gaps:?}");
    for (i, gap) in gaps.iter().enumerate() {
        let expected = base * 2u32.pow(i as u32);
        assert!(
            *gap >= expected.mul_f64(0.9),
            "gap {i} = {gap:?}, expected about {expected:?}"
        );
        assert!(
            *gap < expected * 2 + Duration::from_millis(500),
            "gap {i} = {gap:?}, expected about {expected:?}"
        );
    }

    // Success resets the backoff: the next failure retries after `base` again.
    run.probe.fail_apply.store(false, Ordering::SeqCst);
    let n = failing.len();
    eventually("a successful attempt", WAIT, || attempts(n + 1))
        .await
        .unwrap();
    eventually("Ready after success", WAIT, || async {
        let g = api.get("flaky").await.map_err(|e| e.to_string())?;
        if g.status
            .as_ref()
            .is_some_and(|s| conditions::is_true(&s.conditions, "Ready"))
        {
            Ok(())
        } else {
            Err("not ready".into())
        }
    })
    .await
    .unwrap();
    run.probe.fail_apply.store(true, Ordering::SeqCst);
    let before = run.probe.attempts.lock().unwrap()["flaky"].len();
    api.patch(
        "flaky",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"annotations": {"poke": "1"}}})),
    )
    .await
    .unwrap();
    let after = eventually("two failures after the reset", WAIT, || {
        attempts(before + 2)
    })
    .await
    .unwrap();
    let gap = after[before + 1] - after[before];
    println!("first gap after reset: {gap:?}");
    assert!(
        gap < base * 2,
        "backoff restarted from base after success, got {gap:?}"
    );

    // The endpoints say what happened.
    let (code, metrics) = http_get(run.addr, "/metrics").await.unwrap();
    assert_eq!(code, 200);
    let value = |line_prefix: &str| -> f64 {
        metrics
            .lines()
            .find(|l| l.starts_with(line_prefix))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {line_prefix} in\n{metrics}"))
    };
    let errors = value("controller_runtime_reconcile_errors_total{controller=\"gadget\"}");
    let observed_failures = run.probe.attempts.lock().unwrap()["flaky"].len() - 2;
    assert!(
        errors >= 5.0 && errors <= observed_failures as f64 + 1.0,
        "errors {errors}, failures {observed_failures}"
    );
    assert!(
        value("controller_runtime_reconcile_total{controller=\"gadget\",result=\"success\"}")
            >= 1.0
    );
    assert_eq!(
        value("leader_election_master_status{name=\"coretest\"}"),
        1.0
    );
    assert_eq!(
        value("controller_runtime_max_concurrent_reconciles{controller=\"gadget\"}"),
        8.0
    );
    assert!(metrics.contains("controller_runtime_reconcile_time_seconds_bucket"));
    // One status write made Ready=True; the failures before it wrote nothing.
    assert_eq!(
        value("steward_status_writes_total{controller=\"gadget\"}"),
        1.0
    );
    assert_eq!(
        http_get(run.addr, "/healthz").await.unwrap(),
        (200, "ok".to_string())
    );
    assert_eq!(
        http_get(run.addr, "/readyz").await.unwrap(),
        (200, "ok".to_string())
    );
    run.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_repeat_as_a_series_and_a_new_note_is_a_new_event() {
    use k8s_openapi::api::core::v1::ConfigMap;
    use k8s_openapi::api::events::v1::Event as NewEvent;
    use steward_core::events::Recorder;

    let cp = steward_testenv::shared().await.expect("control plane");
    let ns = cp.namespace("events").await.expect("namespace");
    let client = cp.client().unwrap();
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
    let cm: ConfigMap = serde_json::from_value(json!({"metadata": {"name": "subject"}})).unwrap();
    let cm = cms.create(&PostParams::default(), &cm).await.unwrap();

    let recorder = Recorder::new(client.clone(), "events-test", Some("instance-1".into()));
    for note in ["fixed A", "fixed A", "fixed A", "fixed B"] {
        recorder
            .normal(&cm, "DriftCorrected", "Converge", note)
            .await;
    }
    recorder
        .warning(&cm, "DriftCorrected", "Converge", "fixed B")
        .await;

    let events: Api<NewEvent> = Api::namespaced(client, &ns);
    let mut seen: Vec<(String, String, i32)> = events
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.reporting_controller.as_deref() == Some("events-test"))
        .map(|e| {
            assert_eq!(e.reporting_instance.as_deref(), Some("instance-1"));
            assert_eq!(
                e.regarding.as_ref().and_then(|r| r.uid.clone()),
                cm.metadata.uid
            );
            (
                e.type_.unwrap_or_default(),
                e.note.unwrap_or_default(),
                e.series.map_or(1, |s| s.count),
            )
        })
        .collect();
    seen.sort();
    assert_eq!(
        seen,
        vec![
            ("Normal".to_string(), "fixed A".to_string(), 3),
            ("Normal".to_string(), "fixed B".to_string(), 1),
            ("Warning".to_string(), "fixed B".to_string(), 1),
        ],
        "one Event per distinct note and type, repeats counted in its series"
    );

    // The same Events through the core v1 API carry the legacy fields client-go's recorder
    // fills, so `kubectl get events --sort-by=.lastTimestamp` orders and counts them.
    let legacy: Api<k8s_openapi::api::core::v1::Event> = Api::namespaced(cp.client().unwrap(), &ns);
    let mut counted: Vec<(String, i32, bool, Option<String>)> = legacy
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.reporting_component.as_deref() == Some("events-test"))
        .map(|e| {
            let ordered = matches!(
                (&e.first_timestamp, &e.last_timestamp),
                (Some(first), Some(last)) if first.0 <= last.0
            );
            (
                e.message.unwrap_or_default(),
                e.count.unwrap_or(0),
                ordered,
                e.source.and_then(|s| s.component),
            )
        })
        .collect();
    counted.sort();
    let source = Some("events-test".to_string());
    assert_eq!(
        counted,
        vec![
            ("fixed A".to_string(), 3, true, source.clone()),
            ("fixed B".to_string(), 1, true, source.clone()),
            ("fixed B".to_string(), 1, true, source),
        ],
        "legacy count, first/last timestamps and source on every Event"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_reconcile_is_a_retried_failure_and_the_controller_keeps_working() {
    let run = start("panic", Duration::from_millis(200)).await;
    *run.probe.panic_on.lock().unwrap() = Some("boom".into());
    let api = run.api.clone();
    api.create(
        &PostParams::default(),
        &gadget("boom", DeletionPolicy::Retain),
    )
    .await
    .unwrap();
    // The panicking object is retried with backoff...
    at_least("boom attempted three times", 3, WAIT, || {
        run.probe.attempts_of("boom")
    })
    .await
    .unwrap();
    // ...while another object created afterwards is reconciled by the same controller.
    api.create(
        &PostParams::default(),
        &gadget("fine", DeletionPolicy::Retain),
    )
    .await
    .unwrap();
    wait_ready(&api, "fine", "fine Ready").await;
    let warning = event_of(&api, &run.ns, "ReconcilePanicked").await;
    assert!(
        warning
            .message
            .unwrap_or_default()
            .contains("panicked on purpose"),
        "the Event says what panicked"
    );
    let (code, _) = http_get(run.addr, "/healthz").await.unwrap();
    assert_eq!(
        code, 200,
        "a panicking reconcile does not make the process unhealthy"
    );
    let (_, metrics) = http_get(run.addr, "/metrics").await.unwrap();
    assert!(
        metrics.lines().any(|l| l
            .starts_with("steward_reconcile_panics_total{controller=\"gadget\"}")
            && !l.ends_with(" 0")),
        "panics are counted"
    );
    // Once the object stops panicking, it converges.
    *run.probe.panic_on.lock().unwrap() = None;
    wait_ready(&api, "boom", "boom Ready after the panics stop").await;
    run.stop().await;
}

/// A reconcile that waits on a call with no bound of its own (a server that accepts a
/// connection and never answers) is cancelled after `--reconcile-timeout`, said in a
/// `ReconcileTimedOut` warning Event and retried with backoff, while the controller keeps
/// reconciling other objects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconcile_past_its_timeout_is_cancelled_explained_and_retried() {
    let timeout = Duration::from_secs(1);
    let run = start_with("rtimeout", Duration::from_millis(200), None, |a| {
        a.reconcile_timeout = timeout;
    })
    .await;
    *run.probe.hang_on.lock().unwrap() = Some("stuck".into());
    let api = run.api.clone();
    api.create(
        &PostParams::default(),
        &gadget("stuck", DeletionPolicy::Retain),
    )
    .await
    .unwrap();
    // Each attempt hangs until the timeout cancels it; a second one starts only after that.
    at_least("stuck attempted twice", 2, WAIT, || {
        run.probe.attempts_of("stuck")
    })
    .await
    .unwrap();
    let attempts = run.probe.attempts.lock().unwrap()["stuck"].clone();
    assert!(
        attempts[1] - attempts[0] >= timeout,
        "the second attempt started {:?} after the first: not before the timeout cancelled it",
        attempts[1] - attempts[0]
    );
    api.create(
        &PostParams::default(),
        &gadget("fine", DeletionPolicy::Retain),
    )
    .await
    .unwrap();
    wait_ready(&api, "fine", "fine Ready beside the stuck one").await;
    let warning = event_of(&api, &run.ns, "ReconcileTimedOut").await;
    assert!(
        warning
            .message
            .unwrap_or_default()
            .contains("--reconcile-timeout"),
        "the Event names the flag"
    );
    // Once the call answers again, the object converges.
    *run.probe.hang_on.lock().unwrap() = None;
    wait_ready(&api, "stuck", "stuck Ready once its calls answer").await;
    run.stop().await;
}

/// A controller whose watch cannot work (its ServiceAccount may not list Gadgets: 403 on
/// every attempt) fails `/healthz` once the stall timeout has passed, naming the watch, so a
/// kubelet would restart it; `/readyz` fails at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_that_keeps_failing_fails_healthz_within_the_stall_timeout() {
    let stall_timeout = Duration::from_secs(3);
    let started = Instant::now();
    let run = start_with(
        "stall",
        Duration::from_millis(200),
        Some("no-rights"),
        |a| {
            a.stall_timeout = stall_timeout;
        },
    )
    .await;
    let addr = run.addr;
    let why = eventually("/healthz failing", Duration::from_secs(30), || async {
        match http_get(addr, "/healthz").await {
            Ok((503, body)) => Ok(body),
            Ok((code, body)) => Err(format!("{code} {body}")),
            Err(e) => Err(e.to_string()),
        }
    })
    .await
    .unwrap();
    let took = started.elapsed();
    println!("/healthz failed {took:?} after start (stall timeout {stall_timeout:?}): {why}");
    assert!(took >= stall_timeout, "not before the bound");
    assert!(why.contains("Gadget watch has failed"), "{why}");
    assert!(why.contains("forbidden") || why.contains("403"), "{why}");
    let (code, body) = http_get(addr, "/readyz").await.unwrap();
    assert_eq!(code, 503, "{body}");
    let (_, metrics) = http_get(addr, "/metrics").await.unwrap();
    assert!(
        metrics.lines().any(|l| l
            .starts_with("steward_watch_errors_total{controller=\"gadget\",kind=\"Gadget\"}")
            && !l.ends_with(" 0")),
        "watch errors are counted: {metrics}"
    );
    run.stop().await;
}

/// A stale copy of an object whose finalizer another reconcile already removed (so the object
/// is gone) ends its reconcile without an error — deleting a Tenant used to leave a Warning
/// `RemoveFinalizerFailed … not found` this way — and so does a copy of an object deleted
/// before its finalizer was added.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_copy_of_a_finalized_object_is_not_an_error() {
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::runtime::controller::Action;
    use steward_core::finalizer::{self, Event};

    let cp = steward_testenv::shared().await.expect("control plane");
    let ns = cp.namespace("stale-finalizer").await.expect("namespace");
    let api: Api<ConfigMap> = Api::namespaced(cp.client().unwrap(), &ns);
    let cleanups = std::sync::atomic::AtomicUsize::new(0);
    let reconcile = |obj: Arc<ConfigMap>| {
        let api = api.clone();
        let cleanups = &cleanups;
        async move {
            finalizer::run(&api, FINALIZER, obj, |event| async move {
                if let Event::Cleanup(_) = event {
                    cleanups.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                }
                Ok::<_, std::convert::Infallible>(Action::await_change())
            })
            .await
        }
    };
    let cm: ConfigMap = serde_json::from_value(json!({"metadata": {"name": "doomed"}})).unwrap();
    let created = api.create(&PostParams::default(), &cm).await.unwrap();
    reconcile(Arc::new(created))
        .await
        .expect("adds the finalizer");
    api.delete("doomed", &DeleteParams::default())
        .await
        .unwrap();
    let deleting = api.get("doomed").await.unwrap();
    assert!(deleting.metadata.deletion_timestamp.is_some());
    reconcile(Arc::new(deleting.clone()))
        .await
        .expect("cleanup, then the finalizer removed");
    gone_cm(&api, "doomed").await;
    reconcile(Arc::new(deleting))
        .await
        .expect("the stale copy's reconcile is not an error");
    assert_eq!(
        cleanups.load(std::sync::atomic::Ordering::SeqCst),
        2,
        "cleanup ran for each copy"
    );

    // Deleted before its finalizer was added: nothing to add it to, nothing to report.
    let created = api.create(&PostParams::default(), &cm).await.unwrap();
    api.delete("doomed", &DeleteParams::default())
        .await
        .unwrap();
    reconcile(Arc::new(created))
        .await
        .expect("a copy of a deleted object is not an error");
}

/// The class behind a dump Job re-created after its Database was dropped: a lagging cache
/// hands the reconcile a copy of an object whose cleanup is over (its finalizer removed, the
/// object gone) or a copy of an object since re-created under the same name. `dispatch` runs
/// the cleanup only on the server's own copy, so neither runs a second cleanup.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_copy_is_not_cleaned_up_twice() {
    use k8s_openapi::api::core::v1::ConfigMap;
    use std::sync::atomic::Ordering::SeqCst;
    use steward_core::finalizer::Cleanup;

    let cp = steward_testenv::shared().await.expect("control plane");
    let ns = cp.namespace("stale-cleanup").await.expect("namespace");
    let client = cp.client().unwrap();
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
    let cleanups = AtomicUsize::new(0);
    let reconcile = |obj: Arc<ConfigMap>| {
        let client = client.clone();
        let cleanups = &cleanups;
        async move {
            finalizer::dispatch(
                &client,
                FINALIZER,
                obj,
                |_| async { Ok::<_, std::convert::Infallible>(Action::await_change()) },
                |_| async {
                    cleanups.fetch_add(1, SeqCst);
                    Ok(Cleanup::Done)
                },
            )
            .await
        }
    };
    let cm: ConfigMap = serde_json::from_value(json!({"metadata": {"name": "once"}})).unwrap();
    let created = api.create(&PostParams::default(), &cm).await.unwrap();
    reconcile(Arc::new(created))
        .await
        .expect("adds the finalizer");
    api.delete("once", &DeleteParams::default()).await.unwrap();
    let deleting = api.get("once").await.unwrap();
    reconcile(Arc::new(deleting.clone()))
        .await
        .expect("cleanup, then the finalizer removed");
    assert_eq!(cleanups.load(SeqCst), 1);
    gone_cm(&api, "once").await;

    reconcile(Arc::new(deleting.clone()))
        .await
        .expect("the stale copy's reconcile is not an error");
    assert_eq!(
        cleanups.load(SeqCst),
        1,
        "no cleanup for a copy of a gone object"
    );

    // Re-created under the same name (and being deleted, with the finalizer): a copy of the
    // old one does not clean up the new one.
    let created = api.create(&PostParams::default(), &cm).await.unwrap();
    reconcile(Arc::new(created))
        .await
        .expect("adds the finalizer");
    api.delete("once", &DeleteParams::default()).await.unwrap();
    reconcile(Arc::new(deleting))
        .await
        .expect("the old object's copy is not an error");
    assert_eq!(cleanups.load(SeqCst), 1, "no cleanup of another object");
    let current = api.get("once").await.unwrap();
    reconcile(Arc::new(current))
        .await
        .expect("the new object's own cleanup");
    assert_eq!(cleanups.load(SeqCst), 2);
    gone_cm(&api, "once").await;
}

async fn gone_cm(api: &Api<k8s_openapi::api::core::v1::ConfigMap>, name: &str) {
    eventually("ConfigMap gone", WAIT, || async {
        match api.get_opt(name).await {
            Ok(None) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await
    .unwrap();
}

/// SIGTERM while a reconcile waits on a call that never returns (a SIGSTOPped server, a
/// paused API server, an unrouted connect): the operator stops taking work, cancels that
/// reconcile at the drain deadline, releases its Lease and returns `Ok` within
/// `--shutdown-timeout`, whatever the reconcile was waiting for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_cancels_a_hung_reconcile_and_releases_the_lease_within_the_bound() {
    let shutdown_timeout = Duration::from_secs(4);
    let renew_deadline = Duration::from_secs(2);
    let run = start_with("hang", Duration::from_millis(200), None, |a| {
        a.shutdown_timeout = shutdown_timeout;
        a.leader_elect = true;
        a.leader_election_namespace = a.watch_namespace.clone();
        a.leader_election_id = Some("coretest-hang".into());
        a.leader_election_lease_duration = Duration::from_secs(3);
        a.leader_election_renew_deadline = renew_deadline;
        a.leader_election_retry_period = Duration::from_millis(500);
    })
    .await;
    *run.probe.hang_on.lock().unwrap() = Some("stuck".into());
    run.api
        .create(
            &PostParams::default(),
            &gadget("stuck", DeletionPolicy::Retain),
        )
        .await
        .unwrap();
    at_least("the reconcile of stuck in flight", 1, WAIT, || {
        run.probe.attempts_of("stuck")
    })
    .await
    .unwrap();
    let leases: Api<k8s_openapi::api::coordination::v1::Lease> =
        Api::namespaced(run.api.clone().into_client(), &run.ns);
    let holder = |l: &k8s_openapi::api::coordination::v1::Lease| {
        l.spec
            .as_ref()
            .and_then(|s| s.holder_identity.clone())
            .unwrap_or_default()
    };
    let held = leases.get("coretest-hang").await.unwrap();
    assert!(
        !holder(&held).is_empty(),
        "the operator leads while it reconciles"
    );

    let stopping = Instant::now();
    let ended = run.operator.stop().await;
    let took = stopping.elapsed();
    assert!(
        ended.is_ok(),
        "a clean stop, the hung reconcile cancelled: {ended:?}"
    );
    // The bound is the configured one; the margin covers the test's own scheduling, not
    // the operator's work (which is cancelled at shutdown_timeout - renew_deadline).
    assert!(
        took <= shutdown_timeout + Duration::from_millis(500),
        "stopped in {took:?}, bound {shutdown_timeout:?}"
    );
    assert!(
        took >= shutdown_timeout - renew_deadline,
        "the hung reconcile had until the drain deadline ({:?}); stopped in {took:?}",
        shutdown_timeout - renew_deadline
    );
    let released = leases.get("coretest-hang").await.unwrap();
    assert_eq!(holder(&released), "", "the Lease is released: {released:?}");
}
