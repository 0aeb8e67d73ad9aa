//! The benchmark's Tenants, the watch that times their convergence, the unrelated objects,
//! the raw-write floor and cleanup.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use futures::{StreamExt, TryStreamExt, stream};
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, Patch,
    PatchParams, PostParams,
};
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use serde_json::{Value, json};

/// Label on every Tenant of one benchmark run (`<subject>-<n>`), for the watch.
pub const RUN_LABEL: &str = "bench.steward.dev/run";
const TENANT_LABEL: &str = "tenancy.steward.dev/tenant";
const FILLER_LABEL: &str = "bench.steward.dev/filler";
/// How many requests the harness has in flight while creating Tenants (the same for every subject).
pub const CREATE_CONCURRENCY: usize = 16;

pub fn tenant_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("tenancy.steward.dev", "v1alpha1", "Tenant"),
        "tenants",
    )
}

pub fn tenants(client: &Client) -> Api<DynamicObject> {
    Api::all_with(client.clone(), &tenant_resource())
}

/// Tenant `i` of run `run`: two owners, an extra `view` binding, `namespaces_per_tenant`
/// namespaces, a ResourceQuota, a LimitRange and (by default) network isolation. Deleting it
/// deletes its namespaces, so runs clean up after themselves.
pub fn tenant(run: &str, i: usize, namespaces_per_tenant: usize) -> Value {
    let name = tenant_name(run, i);
    let namespaces: Vec<String> = (0..namespaces_per_tenant)
        .map(|k| format!("{name}-{}", (b'a' + k as u8) as char))
        .collect();
    json!({
        "apiVersion": "tenancy.steward.dev/v1alpha1",
        "kind": "Tenant",
        "metadata": {"name": name, "labels": {RUN_LABEL: run}},
        "spec": {
            "owners": [{"kind": "User", "name": "alice"}, {"kind": "Group", "name": format!("team-{i}")}],
            "additionalRoleBindings": [{"clusterRole": "view", "subjects": [{"kind": "Group", "name": "auditors"}]}],
            "namespaces": namespaces,
            "resourceQuota": {"hard": {"pods": "20", "requests.cpu": "4", "requests.memory": "8Gi"}},
            "limitRange": {"limits": [{"type": "Container",
                "default": {"cpu": "500m", "memory": "256Mi"},
                "defaultRequest": {"cpu": "100m", "memory": "128Mi"}}]},
            "deletionPolicy": "Delete"
        }
    })
}

/// How long deleting `n` Tenants and their namespaces may take: the namespace controller
/// deletes a namespace's contents kind by kind, about 10 namespaces a second here.
pub fn cleanup_timeout(n: usize) -> Duration {
    Duration::from_secs(300 + n as u64 / 10)
}

/// How long a new leader may take to reach one changed Tenant: controller-runtime queues its
/// resync of every Tenant in no particular order, at about 9 writes per Tenant.
pub fn resync_timeout(n: usize) -> Duration {
    Duration::from_secs(180 + n as u64 / 20)
}

pub fn tenant_name(run: &str, i: usize) -> String {
    format!("{run}-{i:04}")
}

/// Per-Tenant convergence as seen through one watch: when each became Ready at its current
/// generation, and the latest generation/observedGeneration seen.
#[derive(Clone, Default)]
pub struct Tracker {
    state: Arc<Mutex<HashMap<String, Seen>>>,
    changed: Arc<tokio::sync::Notify>,
}

#[derive(Clone, Debug, Default)]
struct Seen {
    generation: i64,
    observed: i64,
    ready: bool,
    first_ready: Option<Instant>,
    /// When `observed` last changed.
    observed_at: Option<Instant>,
}

/// Whether `t` has `Ready=True` for its current generation.
fn ready_now(t: &DynamicObject) -> (i64, i64, bool) {
    let generation = t.metadata.generation.unwrap_or(0);
    let status = t.data.get("status");
    let observed = status
        .and_then(|s| s.get("observedGeneration"))
        .and_then(Value::as_i64)
        .unwrap_or(0);
    let ready = status
        .and_then(|s| s.get("conditions"))
        .and_then(Value::as_array)
        .is_some_and(|cs| {
            cs.iter()
                .any(|c| c["type"] == "Ready" && c["status"] == "True")
        });
    (generation, observed, ready && observed == generation)
}

impl Tracker {
    /// Starts watching the Tenants labelled with `run`.
    pub fn start(client: &Client, run: &str) -> (Self, tokio::task::JoinHandle<()>) {
        let tracker = Self::default();
        let t = tracker.clone();
        let api = tenants(client);
        let cfg = watcher::Config::default().labels(&format!("{RUN_LABEL}={run}"));
        let handle = tokio::spawn(async move {
            let mut events = watcher(api, cfg).boxed();
            while let Some(ev) = events.next().await {
                let now = Instant::now();
                let obj = match ev {
                    Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o)) => o,
                    Ok(watcher::Event::Delete(o)) => {
                        t.state
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .remove(&o.name_any());
                        t.changed.notify_waiters();
                        continue;
                    }
                    _ => continue,
                };
                let (generation, observed, ready) = ready_now(&obj);
                {
                    let mut map = t.state.lock().unwrap_or_else(|p| p.into_inner());
                    let seen = map.entry(obj.name_any()).or_default();
                    if seen.observed != observed {
                        seen.observed_at = Some(now);
                    }
                    seen.generation = generation;
                    seen.observed = observed;
                    seen.ready = ready;
                    if ready && seen.first_ready.is_none() {
                        seen.first_ready = Some(now);
                    }
                }
                t.changed.notify_waiters();
            }
        });
        (tracker, handle)
    }

    fn count_ready(&self) -> usize {
        self.state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .filter(|s| s.ready)
            .count()
    }

    /// Waits until `n` Tenants are Ready at their generation; returns the first-Ready times.
    pub async fn wait_all_ready(&self, n: usize, timeout: Duration) -> Result<Vec<Instant>> {
        let deadline = Instant::now() + timeout;
        loop {
            let notified = self.changed.notified();
            if self.count_ready() >= n {
                let map = self.state.lock().unwrap_or_else(|p| p.into_inner());
                return Ok(map.values().filter_map(|s| s.first_ready).collect());
            }
            if Instant::now() > deadline {
                bail!(
                    "only {} of {n} Tenants Ready after {timeout:?}",
                    self.count_ready()
                );
            }
            let _ = tokio::time::timeout(Duration::from_millis(500), notified).await;
        }
    }

    /// Waits until `name`'s status reports `generation` as observed (and Ready); returns when
    /// the watch delivered that.
    pub async fn wait_observed(
        &self,
        name: &str,
        generation: i64,
        timeout: Duration,
    ) -> Result<Instant> {
        let deadline = Instant::now() + timeout;
        loop {
            let notified = self.changed.notified();
            if let Some(s) = self
                .state
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(name)
                && s.observed >= generation
                && s.ready
            {
                return Ok(s.observed_at.unwrap_or_else(Instant::now));
            }
            if Instant::now() > deadline {
                bail!(
                    "Tenant {name} did not report observedGeneration {generation} within {timeout:?}"
                );
            }
            let _ = tokio::time::timeout(Duration::from_millis(200), notified).await;
        }
    }
}

/// Creates Tenants `0..n` of `run` with [`CREATE_CONCURRENCY`] requests in flight; each
/// created object is also sent to `created` (the floor's workers consume it).
pub async fn create_tenants(
    client: &Client,
    run: &str,
    n: usize,
    namespaces_per_tenant: usize,
    created: Option<tokio::sync::mpsc::UnboundedSender<DynamicObject>>,
) -> Result<()> {
    let api = tenants(client);
    stream::iter(0..n)
        .map(|i| {
            let api = api.clone();
            let created = created.clone();
            async move {
                let obj: DynamicObject =
                    serde_json::from_value(tenant(run, i, namespaces_per_tenant))?;
                let obj = api
                    .create(&PostParams::default(), &obj)
                    .await
                    .with_context(|| format!("creating Tenant {i}"))?;
                if let Some(tx) = created {
                    let _ = tx.send(obj);
                }
                anyhow::Ok(())
            }
        })
        .buffer_unordered(CREATE_CONCURRENCY)
        .try_collect::<Vec<_>>()
        .await?;
    Ok(())
}

/// Changes `name`'s spec (a namespace label), so its generation goes up; returns the new generation.
pub async fn bump(client: &Client, name: &str, value: usize) -> Result<i64> {
    let patch =
        json!({"spec": {"namespaceMetadata": {"labels": {"bench-bump": value.to_string()}}}});
    let obj = tenants(client)
        .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .with_context(|| format!("bumping Tenant {name}"))?;
    obj.metadata.generation.context("no generation")
}

/// Creates `count` unrelated objects, half ConfigMaps and half Secrets (1 KiB each), spread
/// over 10 namespaces, unless they already exist.
pub async fn create_unrelated(client: &Client, count: usize) -> Result<()> {
    use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Secret};
    let namespaces: Api<Namespace> = Api::all(client.clone());
    for k in 0..10 {
        let ns: Namespace =
            serde_json::from_value(json!({"metadata": {"name": format!("bench-unrelated-{k}")}}))?;
        match namespaces.create(&PostParams::default(), &ns).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 409 => {}
            Err(e) => return Err(e.into()),
        }
    }
    let payload = "x".repeat(1024);
    stream::iter(0..count)
        .map(|i| {
            let client = client.clone();
            let payload = payload.clone();
            async move {
                let ns = format!("bench-unrelated-{}", i % 10);
                let meta = json!({"name": format!("unrelated-{i}"), "namespace": ns, "labels": {FILLER_LABEL: "true"}});
                let res = if i % 2 == 0 {
                    let cm: ConfigMap = serde_json::from_value(json!({"metadata": meta, "data": {"payload": payload}}))?;
                    Api::<ConfigMap>::namespaced(client, &ns).create(&PostParams::default(), &cm).await.map(|_| ())
                } else {
                    let s: Secret = serde_json::from_value(json!({"metadata": meta, "stringData": {"payload": payload}}))?;
                    Api::<Secret>::namespaced(client, &ns).create(&PostParams::default(), &s).await.map(|_| ())
                };
                match res {
                    Ok(()) => anyhow::Ok(()),
                    Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
                    Err(e) => Err(e.into()),
                }
            }
        })
        .buffer_unordered(32)
        .try_collect::<Vec<_>>()
        .await?;
    Ok(())
}

/// Deletes the Tenants of `run` and waits until they and their namespaces are gone. With no
/// operator running (`operator_running = false`, the floor) the harness does the operator's
/// part: deletes the namespaces and removes the finalizer.
pub async fn cleanup(
    client: &Client,
    run: &str,
    operator_running: bool,
    timeout: Duration,
) -> Result<()> {
    use k8s_openapi::api::core::v1::Namespace;
    let api = tenants(client);
    let lp = ListParams::default().labels(&format!("{RUN_LABEL}={run}"));
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let list = api.list_metadata(&lp).await?;
    stream::iter(list.items)
        .map(|t| {
            let api = api.clone();
            let namespaces = namespaces.clone();
            async move {
                let name = t.name_any();
                if !operator_running {
                    let owned = namespaces
                        .list_metadata(
                            &ListParams::default().labels(&format!("{TENANT_LABEL}={name}")),
                        )
                        .await?;
                    for ns in owned.items {
                        let _ = namespaces
                            .delete(&ns.name_any(), &DeleteParams::background())
                            .await;
                    }
                    let _ = api
                        .patch(
                            &name,
                            &PatchParams::default(),
                            &Patch::Merge(json!({"metadata": {"finalizers": null}})),
                        )
                        .await;
                }
                match api.delete(&name, &DeleteParams::background()).await {
                    Ok(_) => anyhow::Ok(()),
                    Err(kube::Error::Api(e)) if e.is_not_found() => Ok(()),
                    Err(e) => Err(e.into()),
                }
            }
        })
        .buffer_unordered(CREATE_CONCURRENCY)
        .try_collect::<Vec<_>>()
        .await?;
    let deadline = Instant::now() + timeout;
    loop {
        let left = api.list_metadata(&lp).await?.items;
        if left.is_empty() {
            break;
        }
        if Instant::now() > deadline {
            eprintln!(
                "bench: {} Tenants of {run} still there; removing their finalizers",
                left.len()
            );
            for t in left {
                let _ = api
                    .patch(
                        &t.name_any(),
                        &PatchParams::default(),
                        &Patch::Merge(json!({"metadata": {"finalizers": null}})),
                    )
                    .await;
            }
            break;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    // The garbage collector removes the ClusterRoles and ClusterRoleBindings; wait for it so its
    // requests do not land in the next subject's window.
    let owned_prefix = format!("tenancy.steward.dev:owner:{run}-");
    let roles: Api<k8s_openapi::api::rbac::v1::ClusterRole> = Api::all(client.clone());
    let bindings: Api<k8s_openapi::api::rbac::v1::ClusterRoleBinding> = Api::all(client.clone());
    loop {
        let left = roles
            .list_metadata(&ListParams::default())
            .await?
            .items
            .iter()
            .filter(|r| r.name_any().starts_with(&owned_prefix))
            .count()
            + bindings
                .list_metadata(&ListParams::default())
                .await?
                .items
                .iter()
                .filter(|r| r.name_any().starts_with(&owned_prefix))
                .count();
        if left == 0 {
            break;
        }
        if Instant::now() > deadline + timeout {
            bail!(
                "{left} ClusterRoles/ClusterRoleBindings of {run} not garbage-collected after {:?}",
                timeout * 2
            );
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    // Namespaces: wait until the namespace controller has removed them (so the next subject
    // starts on the same cluster), deleting leftovers.
    let prefix = format!("{run}-");
    loop {
        let left: Vec<_> = namespaces
            .list_metadata(&ListParams::default())
            .await?
            .items
            .into_iter()
            .filter(|n| n.name_any().starts_with(&prefix))
            .collect();
        if left.is_empty() {
            return Ok(());
        }
        for n in left
            .iter()
            .filter(|n| n.metadata.deletion_timestamp.is_none())
        {
            let _ = namespaces
                .delete(&n.name_any(), &DeleteParams::background())
                .await;
        }
        if Instant::now() > deadline + timeout {
            bail!(
                "{} namespaces of {run} still terminating after {:?}",
                left.len(),
                timeout * 2
            );
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

/// The objects a Tenant wants (as the tenant-operator's `build.rs` and the Go reference make
/// them), for the floor client.
pub fn children(
    t: &DynamicObject,
    field_manager: &str,
) -> Vec<(ApiResource, Option<String>, Value)> {
    let name = t.name_any();
    let uid = t.metadata.uid.clone().unwrap_or_default();
    let spec = &t.data["spec"];
    let labels = json!({TENANT_LABEL: name, "steward.dev/owner-uid": uid, "app.kubernetes.io/managed-by": field_manager});
    let owner = json!([{"apiVersion": "tenancy.steward.dev/v1alpha1", "kind": "Tenant", "name": name, "uid": uid,
        "controller": true, "blockOwnerDeletion": true}]);
    let ar = |g: &str, v: &str, k: &str, p: &str| {
        ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(g, v, k), p)
    };
    let owners = spec["owners"].as_array().cloned().unwrap_or_default();
    let subjects = |list: &[Value]| -> Value {
        Value::Array(
            list.iter()
                .map(|s| json!({"kind": s["kind"], "name": s["name"], "apiGroup": "rbac.authorization.k8s.io"}))
                .collect(),
        )
    };
    let mut out = Vec::new();
    for ns in spec["namespaces"].as_array().cloned().unwrap_or_default() {
        let ns = ns.as_str().unwrap_or_default().to_string();
        let mut ns_labels = labels.clone();
        ns_labels["tenancy.steward.dev/declared"] = json!("true");
        out.push((
            ar("", "v1", "Namespace", "namespaces"),
            None,
            json!({"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": ns, "labels": ns_labels}}),
        ));
        let meta = |n: &str| json!({"name": n, "namespace": ns, "labels": labels, "ownerReferences": owner});
        out.push((ar("rbac.authorization.k8s.io", "v1", "RoleBinding", "rolebindings"), Some(ns.clone()), json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta("tenant-owner-admin"),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "admin"},
            "subjects": subjects(&owners)})));
        for extra in spec["additionalRoleBindings"]
            .as_array()
            .cloned()
            .unwrap_or_default()
        {
            let role = extra["clusterRole"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            out.push((ar("rbac.authorization.k8s.io", "v1", "RoleBinding", "rolebindings"), Some(ns.clone()), json!({
                "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta(&format!("tenant-{role}")),
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
                "subjects": subjects(extra["subjects"].as_array().map(Vec::as_slice).unwrap_or_default())})));
        }
        out.push((ar("", "v1", "ResourceQuota", "resourcequotas"), Some(ns.clone()), json!({"apiVersion": "v1",
            "kind": "ResourceQuota", "metadata": meta("tenant-quota"), "spec": {"hard": spec["resourceQuota"]["hard"]}})));
        out.push((
            ar("", "v1", "LimitRange", "limitranges"),
            Some(ns.clone()),
            json!({"apiVersion": "v1",
            "kind": "LimitRange", "metadata": meta("tenant-limits"), "spec": spec["limitRange"]}),
        ));
        out.push((ar("networking.k8s.io", "v1", "NetworkPolicy", "networkpolicies"), Some(ns.clone()), json!({
            "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": meta("tenant-isolation"),
            "spec": {"podSelector": {}, "policyTypes": ["Ingress"],
                "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {TENANT_LABEL: name}}}]}]}})));
    }
    let cluster_name = format!("tenancy.steward.dev:owner:{name}");
    let cmeta = json!({"name": cluster_name, "labels": labels, "ownerReferences": owner});
    out.push((ar("rbac.authorization.k8s.io", "v1", "ClusterRole", "clusterroles"), None, json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": cmeta,
        "rules": [{"apiGroups": ["tenancy.steward.dev"], "resources": ["tenants"], "resourceNames": [name], "verbs": ["get", "own"]},
                  {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["create"]}]})));
    out.push((ar("rbac.authorization.k8s.io", "v1", "ClusterRoleBinding", "clusterrolebindings"), None, json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": cmeta,
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": cluster_name},
        "subjects": subjects(&owners)})));
    out
}

/// The raw-write floor: `concurrency` workers take each Tenant as soon as the harness created
/// it and write exactly what an operator writes (finalizer, children by server-side apply,
/// status), with no watch, cache or queue in between.
pub async fn floor(
    client: &Client,
    run: &str,
    n: usize,
    namespaces_per_tenant: usize,
    concurrency: usize,
) -> Result<()> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<DynamicObject>();
    let rx = Arc::new(tokio::sync::Mutex::new(rx));
    let mut workers = Vec::new();
    for _ in 0..concurrency {
        let rx = rx.clone();
        let client = client.clone();
        workers.push(tokio::spawn(async move {
            loop {
                let next = rx.lock().await.recv().await;
                let Some(t) = next else { return anyhow::Ok(()) };
                write_tenant(&client, &t).await?;
            }
        }));
    }
    create_tenants(client, run, n, namespaces_per_tenant, Some(tx)).await?;
    for w in workers {
        w.await??;
    }
    Ok(())
}

async fn write_tenant(client: &Client, t: &DynamicObject) -> Result<()> {
    const FM: &str = "bench-floor";
    let api = tenants(client);
    let name = t.name_any();
    api.patch(
        &name,
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"finalizers": ["tenancy.steward.dev/namespaces"]}})),
    )
    .await
    .context("floor: finalizer")?;
    let pp = PatchParams::apply(FM).force();
    let mut namespaces = Vec::new();
    for (ar, ns, obj) in children(t, FM) {
        let api: Api<DynamicObject> = match &ns {
            Some(ns) => Api::namespaced_with(client.clone(), ns, &ar),
            None => Api::all_with(client.clone(), &ar),
        };
        let child_name = obj["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        if ar.kind == "Namespace" {
            namespaces.push(child_name.clone());
        }
        api.patch(&child_name, &pp, &Patch::Apply(&obj))
            .await
            .with_context(|| format!("floor: {} {child_name}", ar.kind))?;
    }
    let generation = t.metadata.generation.unwrap_or(1);
    let status = json!({"apiVersion": "tenancy.steward.dev/v1alpha1", "kind": "Tenant", "status": {
        "observedGeneration": generation, "phase": "Active", "namespaces": namespaces, "namespaceCount": namespaces.len(),
        "conditions": [{"type": "Ready", "status": "True", "reason": "Reconciled", "message": "all tenant objects are applied",
            "observedGeneration": generation, "lastTransitionTime": k8s_openapi::jiff::Timestamp::now().strftime("%Y-%m-%dT%H:%M:%SZ").to_string()}]}});
    api.patch_status(&name, &pp, &Patch::Apply(&status))
        .await
        .context("floor: status")?;
    Ok(())
}

/// Percentile (0–100) of durations in seconds.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let idx = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

/// Median and maximum.
pub fn median_max(values: &[f64]) -> (f64, f64) {
    let mut v = values.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    let median = match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    };
    (median, v.last().copied().unwrap_or(f64::NAN))
}
