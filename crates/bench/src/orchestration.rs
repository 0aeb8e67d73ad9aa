//! Scenario 5: the upgrade-orchestrator's overhead between components.
//!
//! A chain of Deployments `c0 → c1 → …` (each depends on the previous one) is upgraded by one
//! UpgradePlan. The harness watches the Deployments itself and records, on one clock, when each
//! turned healthy with the new image (the orchestrator's own rule: current generation observed,
//! every replica updated and available, no old replicas) and when the next one's pod template
//! got the new image. Overhead = next changed − previous healthy. The plan's own
//! `status.components[].startedAt/finishedAt` are reported next to it.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, PostParams};
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use serde::Serialize;
use serde_json::json;

use super::procs::{Launch, Replica};

const NAMESPACE: &str = "bench-upgrade";
const OLD: &str = "registry.example/app:1.0.0";
const NEW: &str = "registry.example/app:2.0.0";

#[derive(Clone, Debug, Default, Serialize)]
pub struct Orchestration {
    pub components: usize,
    /// Next component's template changed − previous component healthy, as the harness's
    /// Deployment watch saw them (seconds, one per hand-over).
    pub overhead_secs: Vec<f64>,
    /// The plan's `startedAt` of the next − `finishedAt` of the previous component.
    pub status_overhead_secs: Vec<f64>,
    /// Previous component healthy (watch) → the plan's `finishedAt` for it.
    pub finished_lag_secs: Vec<f64>,
    /// Plan created → plan Succeeded.
    pub total_secs: f64,
}

#[derive(Default, Clone, Copy)]
struct Seen {
    changed: Option<Instant>,
    healthy: Option<Instant>,
}

fn is_new_and_healthy(d: &Deployment) -> (bool, bool) {
    let image = d
        .spec
        .template
        .spec
        .as_ref()
        .and_then(|p| p.containers.first())
        .and_then(|c| c.image.clone())
        .unwrap_or_default();
    let changed = image == NEW;
    let Some(st) = &d.status else {
        return (changed, false);
    };
    let desired = d.spec.replicas.unwrap_or(1);
    let healthy = st.observed_generation >= d.metadata.generation
        && st.updated_replicas.unwrap_or(0) >= desired
        && st.replicas.unwrap_or(0) <= st.updated_replicas.unwrap_or(0)
        && st.available_replicas.unwrap_or(0) >= desired;
    (changed, changed && healthy)
}

pub async fn measure(
    client: &Client,
    binary: &Path,
    log_dir: &Path,
    kubeconfig: &Path,
    components: usize,
) -> Result<Orchestration> {
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": NAMESPACE}}))?;
    namespaces
        .create(&PostParams::default(), &ns)
        .await
        .context("creating the upgrade namespace")?;
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), NAMESPACE);
    for i in 0..components {
        let d: Deployment = serde_json::from_value(json!({
            "metadata": {"name": format!("c{i}")},
            "spec": {"replicas": 2, "selector": {"matchLabels": {"app": format!("c{i}")}},
                "strategy": {"rollingUpdate": {"maxSurge": 2, "maxUnavailable": 0}},
                "template": {"metadata": {"labels": {"app": format!("c{i}")}},
                    "spec": {"containers": [{"name": "app", "image": OLD}]}}}
        }))?;
        deployments.create(&PostParams::default(), &d).await?;
    }
    // Every Deployment available before the plan.
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let list = deployments.list(&Default::default()).await?;
        if list.items.iter().all(|d| {
            d.status
                .as_ref()
                .and_then(|s| s.available_replicas)
                .unwrap_or(0)
                >= 2
        }) {
            break;
        }
        if Instant::now() > deadline {
            bail!("the upgrade scenario's Deployments did not become available (kwok nodes?)");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    let seen: Arc<Mutex<HashMap<String, Seen>>> = Arc::default();
    let watch = {
        let seen = seen.clone();
        let api = deployments.clone();
        tokio::spawn(async move {
            let mut events = watcher(api, watcher::Config::default()).boxed();
            while let Some(ev) = events.next().await {
                let now = Instant::now();
                if let Ok(watcher::Event::Apply(d) | watcher::Event::InitApply(d)) = ev {
                    let (changed, healthy) = is_new_and_healthy(&d);
                    let mut map = seen.lock().unwrap_or_else(|p| p.into_inner());
                    let s = map.entry(d.name_any()).or_default();
                    if changed && s.changed.is_none() {
                        s.changed = Some(now);
                    }
                    if healthy && s.healthy.is_none() {
                        s.healthy = Some(now);
                    }
                }
            }
        })
    };

    let launch = Launch {
        binary: binary.to_path_buf(),
        args: vec![
            "--leader-elect=true".into(),
            "--leader-election-namespace=default".into(),
            "--leader-election-id=bench-upgrade-orchestrator".into(),
            "--log-level=warn".into(),
        ],
        log_dir: log_dir.to_path_buf(),
        label: "upgrade-orchestrator".into(),
    };
    let mut op = Replica::spawn(&launch, kubeconfig, 0)?;
    op.wait_ready(Duration::from_secs(120)).await?;

    let ar = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("upgrade.steward.dev", "v1alpha1", "UpgradePlan"),
        "upgradeplans",
    );
    let plans: Api<DynamicObject> = Api::namespaced_with(client.clone(), NAMESPACE, &ar);
    let comps: Vec<_> = (0..components)
        .map(|i| {
            let mut c = json!({"name": format!("c{i}"), "target": {"kind": "Deployment", "name": format!("c{i}")},
                "image": {"container": "app", "image": NEW}});
            if i > 0 {
                c["dependsOn"] = json!([format!("c{}", i - 1)]);
            }
            c
        })
        .collect();
    let plan: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "upgrade.steward.dev/v1alpha1", "kind": "UpgradePlan",
        "metadata": {"name": "bench", "namespace": NAMESPACE},
        "spec": {"components": comps, "strategy": {"maxConcurrent": 1, "failurePolicy": "Pause", "approval": "Automatic"}}
    }))?;
    let t0 = Instant::now();
    plans
        .create(&PostParams::default(), &plan)
        .await
        .context("creating the UpgradePlan")?;
    let deadline = Instant::now() + Duration::from_secs(60 + 30 * components as u64);
    let status = loop {
        let p = plans.get("bench").await?;
        let phase = p.data["status"]["phase"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        if phase == "Succeeded" {
            break p.data["status"].clone();
        }
        if Instant::now() > deadline {
            bail!(
                "UpgradePlan not Succeeded within the deadline (phase {phase:?}); log: {}",
                op.log.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let total = t0.elapsed().as_secs_f64();
    tokio::time::sleep(Duration::from_millis(500)).await;
    watch.abort();
    op.stop().await?;

    let map = seen.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let mut out = Orchestration {
        components,
        total_secs: total,
        ..Default::default()
    };
    let ts = |i: usize, field: &str| {
        status["components"][i][field]
            .as_str()
            .and_then(|s| s.parse::<k8s_openapi::jiff::Timestamp>().ok())
    };
    for i in 0..components.saturating_sub(1) {
        let prev = map.get(&format!("c{i}")).copied().unwrap_or_default();
        let next = map.get(&format!("c{}", i + 1)).copied().unwrap_or_default();
        if let (Some(h), Some(c)) = (prev.healthy, next.changed) {
            out.overhead_secs.push(
                c.saturating_duration_since(h).as_secs_f64()
                    - h.saturating_duration_since(c).as_secs_f64(),
            );
        }
        if let (Some(f), Some(s)) = (ts(i, "finishedAt"), ts(i + 1, "startedAt")) {
            out.status_overhead_secs
                .push(s.duration_since(f).as_secs_f64());
        }
    }
    // Watch-healthy → finishedAt needs one clock: convert with the plan's startedAt of c0 and
    // the watch's changed time of c0 as the common origin.
    if let (Some(origin_wall), Some(origin)) =
        (ts(0, "startedAt"), map.get("c0").and_then(|s| s.changed))
    {
        for i in 0..components {
            if let (Some(f), Some(h)) = (
                ts(i, "finishedAt"),
                map.get(&format!("c{i}")).and_then(|s| s.healthy),
            ) {
                let finished = f.duration_since(origin_wall).as_secs_f64();
                let healthy = h.saturating_duration_since(origin).as_secs_f64();
                out.finished_lag_secs.push(finished - healthy);
            }
        }
    }
    let _ = namespaces.delete(NAMESPACE, &Default::default()).await;
    Ok(out)
}
