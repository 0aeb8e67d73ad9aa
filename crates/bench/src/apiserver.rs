//! `apiserver_request_total` from the kube-apiserver's own `/metrics`, read with the admin
//! client, and differences between two readings.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use kube::Client;
use serde::Serialize;

/// Verbs that change state, as the API server names them (`APPLY` is server-side apply).
pub const WRITE_VERBS: &[&str] = &[
    "POST",
    "PUT",
    "PATCH",
    "APPLY",
    "DELETE",
    "DELETECOLLECTION",
];

/// Resources an operator under test reads and writes. Everything else (ServiceAccounts and
/// `kube-root-ca.crt` ConfigMaps made by kube-controller-manager, quota status, nodes, pods)
/// is other components' traffic.
pub const OPERATOR_RESOURCES: &[(&str, &str)] = &[
    ("tenants", ""),
    ("tenants", "status"),
    ("namespaces", ""),
    ("rolebindings", ""),
    ("clusterroles", ""),
    ("clusterrolebindings", ""),
    ("resourcequotas", ""),
    ("limitranges", ""),
    ("networkpolicies", ""),
    ("events", ""),
    ("leases", ""),
    ("validatingadmissionpolicies", ""),
    ("validatingadmissionpolicybindings", ""),
    ("mutatingadmissionpolicies", ""),
    ("mutatingadmissionpolicybindings", ""),
];

/// Resources only other components read (the scheduler, kwok, the garbage collector's discovery).
const OTHER_READS: &[&str] = &[
    "nodes",
    "pods",
    "serviceaccounts",
    "endpointslices",
    "services",
    "nodes/status",
];

/// (verb, resource, subresource).
pub type Key = (String, String, String);

/// One reading: request counts by key, and when it was taken.
#[derive(Clone, Debug)]
pub struct Reading {
    pub at: Instant,
    pub counts: BTreeMap<Key, f64>,
}

pub async fn read(client: &Client) -> Result<Reading> {
    let req = http::Request::get("/metrics").body(Vec::new())?;
    let text = client
        .request_text(req)
        .await
        .context("reading the kube-apiserver's /metrics")?;
    let at = Instant::now();
    let mut counts = BTreeMap::new();
    for line in text
        .lines()
        .filter(|l| l.starts_with("apiserver_request_total{"))
    {
        let Some((labels, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let Ok(value) = value.parse::<f64>() else {
            continue;
        };
        let label = |name: &str| {
            let pat = format!("{name}=\"");
            labels.find(&pat).map(|i| {
                let rest = &labels[i + pat.len()..];
                rest[..rest.find('"').unwrap_or(rest.len())].to_string()
            })
        };
        let key = (
            label("verb").unwrap_or_default(),
            label("resource").unwrap_or_default(),
            label("subresource").unwrap_or_default(),
        );
        *counts.entry(key).or_insert(0.0) += value;
    }
    Ok(Reading { at, counts })
}

/// Requests per key between two readings, less the background (`baseline`, requests per
/// second per key measured with no operator running) over the same time, never below zero.
pub fn delta(from: &Reading, to: &Reading, baseline: &BTreeMap<Key, f64>) -> BTreeMap<Key, f64> {
    let secs = to.at.duration_since(from.at).as_secs_f64();
    let mut out = BTreeMap::new();
    for (k, v) in &to.counts {
        let d = v
            - from.counts.get(k).copied().unwrap_or(0.0)
            - baseline.get(k).copied().unwrap_or(0.0) * secs;
        if d > 0.5 {
            out.insert(k.clone(), d.round());
        }
    }
    out
}

/// Background requests per second per key, over `window` with nothing under test running.
pub async fn baseline(client: &Client, window: Duration) -> Result<BTreeMap<Key, f64>> {
    let a = read(client).await?;
    tokio::time::sleep(window).await;
    let b = read(client).await?;
    let secs = b.at.duration_since(a.at).as_secs_f64();
    let zero = BTreeMap::new();
    Ok(delta(&a, &b, &zero)
        .into_iter()
        .map(|(k, v)| (k, v / secs))
        .collect())
}

/// Requests of the operator's resources, grouped.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Load {
    /// Requests by verb (operator resources, leases excluded).
    pub by_verb: BTreeMap<String, f64>,
    /// Requests by `verb resource[/subresource]` (operator resources, leases excluded).
    pub by_resource: BTreeMap<String, f64>,
    /// Writes (POST, PUT, PATCH, APPLY, DELETE) to operator resources, leases excluded.
    pub writes: f64,
    /// Lease writes (leader election renewals), background subtracted.
    pub lease_writes: f64,
    /// Everything else the API server served in the window (other components), by resource.
    pub other_writes: BTreeMap<String, f64>,
}

/// Groups a delta into the operator's load, after removing what the harness itself did
/// (`harness`, by key).
pub fn load(delta: &BTreeMap<Key, f64>, harness: &BTreeMap<Key, f64>) -> Load {
    let mut l = Load::default();
    for ((verb, resource, sub), v) in delta {
        let v = (v - harness
            .get(&(verb.clone(), resource.clone(), sub.clone()))
            .copied()
            .unwrap_or(0.0))
        .max(0.0);
        if v == 0.0 {
            continue;
        }
        let is_write = WRITE_VERBS.contains(&verb.as_str());
        // Reads of any resource count (the operators' caches watch Secrets and ConfigMaps too;
        // other components read through long-lived watches, which the baseline removes);
        // writes count only for the operator's own resources (kube-controller-manager writes
        // ServiceAccounts and ConfigMaps into every new namespace).
        // GETs of ClusterRoles and ClusterRoleBindings show up for the floor too, which sends
        // none: they come from the control plane (RBAC and the garbage collector), not a subject.
        let control_plane_read =
            verb == "GET" && (resource == "clusterroles" || resource == "clusterrolebindings");
        let ours = if control_plane_read {
            false
        } else if is_write {
            OPERATOR_RESOURCES
                .iter()
                .any(|(r, s)| r == resource && s == sub)
        } else {
            !resource.is_empty() && !OTHER_READS.contains(&resource.as_str())
        };
        if !ours {
            if is_write {
                let name = if sub.is_empty() {
                    resource.clone()
                } else {
                    format!("{resource}/{sub}")
                };
                *l.other_writes.entry(name).or_default() += v;
            }
            continue;
        }
        if resource == "leases" {
            if is_write {
                l.lease_writes += v;
            }
            continue;
        }
        *l.by_verb.entry(verb.clone()).or_default() += v;
        let name = if sub.is_empty() {
            resource.clone()
        } else {
            format!("{resource}/{sub}")
        };
        *l.by_resource.entry(format!("{verb} {name}")).or_default() += v;
        if is_write {
            l.writes += v;
        }
    }
    l
}
