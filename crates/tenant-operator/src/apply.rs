//! Apply: server-side apply that skips objects already as desired, so a resync with nothing
//! changed issues no writes at all.
//!
//! [`up_to_date`] compares the desired object with the current one *as this field manager
//! owns it*: the fields recorded for the manager's last Apply in `managedFields` must be the
//! fields desired (so a label the operator stopped setting is noticed and removed by the next
//! apply; an atomic struct such as `roleRef` counts as one field), and each desired value must
//! be present in the current object (defaults the API server added are fine; quantities
//! compare by value, `1k` = `1000`).
//!
//! # Caveats
//! Inside an atomic struct or list, a sub-field the operator stops setting is not noticed
//! (its value is compared by containment); the builders never do that.

use std::collections::BTreeSet;
use std::fmt::Debug;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use kube::api::{Api, DeleteParams, Patch, PatchParams};
use kube::{Client, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use steward_core::apply::{Children, ScopeApi};

use crate::quantity::same_quantity;

/// Labels of `tenant_operator_writes_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
pub struct WriteLabels {
    pub kind: String,
    /// `apply`, `delete` or `release`.
    pub verb: String,
}

/// Counts every write the operator makes to the objects it manages
/// (`tenant_operator_writes_total{kind,verb}`), so "no writes on resync" can be checked.
#[derive(Clone, Default, Debug)]
pub struct Writes {
    pub family: prometheus_client::metrics::family::Family<
        WriteLabels,
        prometheus_client::metrics::counter::Counter,
    >,
    total: Arc<AtomicU64>,
}

impl Writes {
    /// Counts one write of `kind`.
    pub fn inc(&self, kind: &str, verb: &str) {
        self.family
            .get_or_create(&WriteLabels {
                kind: kind.to_string(),
                verb: verb.to_string(),
            })
            .inc();
        self.total.fetch_add(1, Ordering::Relaxed);
    }

    /// All writes counted so far.
    pub fn total(&self) -> u64 {
        self.total.load(Ordering::Relaxed)
    }
}

/// Fields never recorded in managedFields (identity, not content).
const IDENTITY: [&[&str]; 4] = [
    &["apiVersion"],
    &["kind"],
    &["metadata", "name"],
    &["metadata", "namespace"],
];

/// Whether `current` already is what applying `desired` as `manager` would make it.
pub fn up_to_date<K: Serialize>(current: &K, desired: &K, manager: &str) -> bool {
    let (Ok(current), Ok(desired)) = (serde_json::to_value(current), serde_json::to_value(desired))
    else {
        return false;
    };
    let Some(owned) = owned_paths(&current, manager) else {
        return false;
    };
    let mut wanted = BTreeSet::new();
    leaf_paths(&desired, &mut Vec::new(), &mut wanted);
    wanted.retain(|p| !is_identity(p) && p.first().map(String::as_str) != Some("status"));
    // An atomic struct or list is owned as one field (`f:roleRef: {}`) while the desired
    // object names its leaves, so a desired field matches an owned one that is its prefix.
    let related = |owned: &Vec<String>, wanted: &Vec<String>| {
        owned.len() <= wanted.len() && owned.iter().zip(wanted).all(|(x, y)| x == y)
    };
    if !wanted.iter().all(|w| owned.iter().any(|o| related(o, w)))
        || !owned.iter().all(|o| wanted.iter().any(|w| related(o, w)))
    {
        return false;
    }
    wanted.iter().all(
        |path| match (lookup(&current, path), lookup(&desired, path)) {
            (Some(c), Some(d)) => contains(c, d),
            _ => false,
        },
    )
}

fn is_identity(path: &[String]) -> bool {
    IDENTITY
        .iter()
        .any(|id| id.len() == path.len() && id.iter().zip(path).all(|(a, b)| a == b))
}

/// The leaf field paths `manager` owns through Apply (no subresource), from `managedFields`.
/// `None` when the manager never applied this object.
fn owned_paths(current: &Value, manager: &str) -> Option<BTreeSet<Vec<String>>> {
    let entries = current.pointer("/metadata/managedFields")?.as_array()?;
    let mut out = BTreeSet::new();
    let mut found = false;
    for e in entries {
        let is_ours = e.get("manager").and_then(Value::as_str) == Some(manager)
            && e.get("operation").and_then(Value::as_str) == Some("Apply")
            && e.get("subresource")
                .and_then(Value::as_str)
                .unwrap_or("")
                .is_empty();
        if !is_ours {
            continue;
        }
        found = true;
        if let Some(fields) = e.get("fieldsV1") {
            // Packed as JSON text in the operator's caches (steward_core::controller::trim).
            let fields = steward_core::controller::fields_v1(fields);
            fields_paths(&fields, &mut Vec::new(), &mut out);
        }
    }
    out.retain(|p| !is_identity(p));
    found.then_some(out)
}

/// Leaf paths of a `fieldsV1` set: descends through `f:<field>` keys; a node without such
/// children (a scalar, or a list keyed by `k:`/`v:`/`i:`) is a leaf.
fn fields_paths(node: &Value, prefix: &mut Vec<String>, out: &mut BTreeSet<Vec<String>>) {
    let children: Vec<(&String, &Value)> = node
        .as_object()
        .map(|m| m.iter().filter(|(k, _)| k.starts_with("f:")).collect())
        .unwrap_or_default();
    if children.is_empty() {
        if !prefix.is_empty() {
            out.insert(prefix.clone());
        }
        return;
    }
    for (k, v) in children {
        prefix.push(k[2..].to_string());
        fields_paths(v, prefix, out);
        prefix.pop();
    }
}

/// Leaf paths of a desired object: objects are descended (an empty object is a leaf), arrays
/// and scalars are leaves, nulls are skipped.
fn leaf_paths(v: &Value, prefix: &mut Vec<String>, out: &mut BTreeSet<Vec<String>>) {
    match v {
        Value::Null => {}
        Value::Object(m) if !m.is_empty() => {
            for (k, child) in m {
                prefix.push(k.clone());
                leaf_paths(child, prefix, out);
                prefix.pop();
            }
        }
        _ => {
            if !prefix.is_empty() {
                out.insert(prefix.clone());
            }
        }
    }
}

fn lookup<'a>(v: &'a Value, path: &[String]) -> Option<&'a Value> {
    path.iter().try_fold(v, |v, k| v.get(k))
}

/// Whether `current` holds everything `desired` does (objects: every desired key, recursively;
/// arrays: same length, element-wise; strings: equal or the same quantity).
fn contains(current: &Value, desired: &Value) -> bool {
    match (current, desired) {
        (_, Value::Null) => true,
        (Value::Object(c), Value::Object(d)) => d.iter().all(|(k, dv)| match c.get(k) {
            Some(cv) => contains(cv, dv),
            None => dv.is_null(),
        }),
        (Value::Array(c), Value::Array(d)) => {
            c.len() == d.len() && c.iter().zip(d).all(|(c, d)| contains(c, d))
        }
        (Value::String(c), Value::String(d)) => same_quantity(c, d),
        (Value::Number(c), Value::String(d)) | (Value::String(d), Value::Number(c)) => {
            same_quantity(&c.to_string(), d)
        }
        (c, d) => c == d,
    }
}

/// What [`ensure`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Unchanged,
    Applied,
}

/// Applies `desired` as a child of `children`'s owner unless `current` already matches it.
///
/// # Errors
/// [`steward_core::Error::ApplyChild`] when the API server rejects the apply.
pub async fn ensure<K>(
    children: &Children,
    manager: &str,
    writes: &Writes,
    current: Option<&K>,
    desired: K,
) -> Result<Outcome, steward_core::Error>
where
    K: Resource<DynamicType = ()> + Clone + Serialize + DeserializeOwned + Debug,
    K::Scope: ScopeApi,
{
    let desired = children.adopt(desired);
    if current.is_some_and(|c| up_to_date(c, &desired, manager)) {
        return Ok(Outcome::Unchanged);
    }
    writes.inc(&K::kind(&()), "apply");
    children.apply(desired).await?;
    Ok(Outcome::Applied)
}

/// Like [`ensure`], with the current object's `resourceVersion` as a precondition: the apply
/// fails with 409 Conflict if the object changed since it was read.
///
/// # Errors
/// [`steward_core::Error::ApplyChild`]; a conflict has source `kube::Error::Api` with code 409.
pub async fn ensure_unchanged_since<K>(
    client: &Client,
    children: &Children,
    manager: &str,
    writes: &Writes,
    current: Option<&K>,
    desired: K,
) -> Result<Outcome, steward_core::Error>
where
    K: Resource<DynamicType = ()> + Clone + Serialize + DeserializeOwned + Debug,
    K::Scope: ScopeApi,
{
    let mut desired = children.adopt(desired);
    if current.is_some_and(|c| up_to_date(c, &desired, manager)) {
        return Ok(Outcome::Unchanged);
    }
    desired.meta_mut().resource_version = current.and_then(|c| c.resource_version());
    let name = desired.name_any();
    let api: Api<K> = K::Scope::api(client.clone(), desired.namespace().as_deref());
    let mut value = serde_json::to_value(&desired).map_err(|e| steward_core::Error::Serialize {
        what: name.clone(),
        message: e.to_string(),
    })?;
    if let Some(obj) = value.as_object_mut() {
        obj.insert("apiVersion".into(), K::api_version(&()).into());
        obj.insert("kind".into(), K::kind(&()).into());
        obj.remove("status");
    }
    writes.inc(&K::kind(&()), "apply");
    api.patch(
        &name,
        &PatchParams::apply(manager).force(),
        &Patch::Apply(&value),
    )
    .await
    .map_err(|source| steward_core::Error::ApplyChild {
        kind: K::kind(&()).to_string(),
        name,
        source,
    })?;
    Ok(Outcome::Applied)
}

/// Deletes `name` (in `namespace`), treating "already gone" as success.
///
/// # Errors
/// [`steward_core::Error::PruneChild`].
pub async fn delete<K>(
    client: &Client,
    writes: &Writes,
    namespace: Option<&str>,
    name: &str,
) -> Result<(), steward_core::Error>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug,
    K::Scope: ScopeApi,
{
    writes.inc(&K::kind(&()), "delete");
    let api: Api<K> = K::Scope::api(client.clone(), namespace);
    match api.delete(name, &DeleteParams::background()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(source) => Err(steward_core::Error::PruneChild {
            kind: K::kind(&()).to_string(),
            name: name.to_string(),
            source,
        }),
    }
}

/// Whether `err` is the API server refusing a stale `resourceVersion`.
pub fn is_conflict(err: &steward_core::Error) -> bool {
    matches!(err, steward_core::Error::ApplyChild { source: kube::Error::Api(s), .. } if s.code == 409)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use serde_json::json;

    const ME: &str = "tenant-operator";

    fn object(labels: Value, hard: Value, fields: Value) -> Value {
        json!({
            "apiVersion": "v1", "kind": "ResourceQuota",
            "metadata": {
                "name": "q", "namespace": "n", "resourceVersion": "7",
                "labels": labels,
                "managedFields": [
                    {"manager": ME, "operation": "Apply", "apiVersion": "v1", "fieldsV1": fields},
                    {"manager": ME, "operation": "Update", "subresource": "status", "fieldsV1": {"f:status": {}}},
                    {"manager": "kubectl", "operation": "Update", "fieldsV1": {"f:metadata": {"f:labels": {"f:extra": {}}}}}
                ]
            },
            "spec": {"hard": hard},
            "status": {"used": {"pods": "1"}}
        })
    }

    fn fields(labels: &[&str], hard: &[&str]) -> Value {
        let l: serde_json::Map<String, Value> = labels
            .iter()
            .map(|k| (format!("f:{k}"), json!({})))
            .collect();
        let h: serde_json::Map<String, Value> =
            hard.iter().map(|k| (format!("f:{k}"), json!({}))).collect();
        json!({"f:metadata": {"f:labels": l}, "f:spec": {"f:hard": h}})
    }

    fn desired(labels: Value, hard: Value) -> Value {
        json!({"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "q", "namespace": "n", "labels": labels}, "spec": {"hard": hard}})
    }

    #[test]
    fn identical_content_is_up_to_date_despite_canonical_quantities_and_extra_fields() {
        let current = object(
            json!({"t": "a", "extra": "x"}),
            json!({"pods": "1k", "cpu": "500m"}),
            fields(&["t"], &["pods", "cpu"]),
        );
        let want = desired(json!({"t": "a"}), json!({"pods": "1000", "cpu": "0.5"}));
        assert!(up_to_date(&current, &want, ME));
    }

    #[test]
    fn changed_value_is_not_up_to_date() {
        let current = object(
            json!({"t": "a"}),
            json!({"pods": "4"}),
            fields(&["t"], &["pods"]),
        );
        assert!(!up_to_date(
            &current,
            &desired(json!({"t": "a"}), json!({"pods": "5"})),
            ME
        ));
        assert!(!up_to_date(
            &current,
            &desired(json!({"t": "b"}), json!({"pods": "4"})),
            ME
        ));
    }

    #[test]
    fn a_field_no_longer_desired_is_not_up_to_date() {
        let current = object(
            json!({"t": "a", "old": "1"}),
            json!({"pods": "4"}),
            fields(&["t", "old"], &["pods"]),
        );
        assert!(
            !up_to_date(
                &current,
                &desired(json!({"t": "a"}), json!({"pods": "4"})),
                ME
            ),
            "label 'old' must be removed"
        );
        let current = object(
            json!({"t": "a"}),
            json!({"pods": "4", "cpu": "1"}),
            fields(&["t"], &["pods", "cpu"]),
        );
        assert!(
            !up_to_date(
                &current,
                &desired(json!({"t": "a"}), json!({"pods": "4"})),
                ME
            ),
            "quota 'cpu' must be removed"
        );
    }

    #[test]
    fn never_applied_by_us_is_not_up_to_date() {
        let current = object(
            json!({"t": "a"}),
            json!({"pods": "4"}),
            fields(&["t"], &["pods"]),
        );
        assert!(!up_to_date(
            &current,
            &desired(json!({"t": "a"}), json!({"pods": "4"})),
            "someone-else"
        ));
    }

    #[test]
    fn arrays_compare_element_wise_with_server_defaults() {
        let current = json!({
            "metadata": {"name": "rb", "managedFields": [{"manager": ME, "operation": "Apply",
                "fieldsV1": {"f:subjects": {}, "f:roleRef": {"f:name": {}}}}]},
            "subjects": [{"kind": "User", "name": "alice", "apiGroup": "rbac.authorization.k8s.io"}],
            "roleRef": {"name": "admin"}
        });
        let same = json!({"metadata": {"name": "rb"}, "subjects": [{"kind": "User", "name": "alice"}], "roleRef": {"name": "admin"}});
        assert!(up_to_date(&current, &same, ME));
        let more = json!({"metadata": {"name": "rb"}, "subjects": [{"kind": "User", "name": "alice"}, {"kind": "User", "name": "bob"}], "roleRef": {"name": "admin"}});
        assert!(!up_to_date(&current, &more, ME));
    }

    #[test]
    fn a_cached_object_as_trimmed_is_judged_the_same() {
        use k8s_openapi::api::rbac::v1::RoleBinding;
        let current = json!({
            "metadata": {"name": "rb", "labels": {"t": "a"}, "managedFields": [
                {"manager": ME, "operation": "Apply",
                    "fieldsV1": {"f:metadata": {"f:labels": {"f:t": {}}}, "f:roleRef": {}, "f:subjects": {}}},
                {"manager": "kubectl", "operation": "Update", "fieldsV1": {"f:metadata": {"f:labels": {"f:x": {}}}}}]},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "admin"},
            "subjects": [{"kind": "User", "name": "alice"}]
        });
        let mut cached: RoleBinding = serde_json::from_value(current).unwrap();
        steward_core::controller::trim(&mut cached);
        let want: RoleBinding = serde_json::from_value(json!({"metadata": {"name": "rb", "labels": {"t": "a"}},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "admin"},
            "subjects": [{"kind": "User", "name": "alice"}]})).unwrap();
        assert!(up_to_date(&cached, &want, ME));
        let mut other = want.clone();
        other.role_ref.name = "edit".into();
        assert!(!up_to_date(&cached, &other, ME));
    }

    #[test]
    fn atomic_structs_are_one_owned_field() {
        let current = json!({
            "metadata": {"name": "rb", "labels": {"t": "a"}, "managedFields": [{"manager": ME, "operation": "Apply",
                "fieldsV1": {"f:metadata": {"f:labels": {"f:t": {}}}, "f:roleRef": {}, "f:subjects": {}}}]},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "admin"},
            "subjects": [{"kind": "User", "name": "alice"}]
        });
        let want = json!({"metadata": {"name": "rb", "labels": {"t": "a"}},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "admin"},
            "subjects": [{"kind": "User", "name": "alice"}]});
        assert!(up_to_date(&current, &want, ME));
        let mut other = want.clone();
        other["roleRef"]["name"] = json!("edit");
        assert!(!up_to_date(&current, &other, ME));
        let mut fewer = want.clone();
        fewer["metadata"]["labels"] = json!({});
        assert!(
            !up_to_date(&current, &fewer, ME),
            "a label no longer wanted"
        );
    }

    #[test]
    fn empty_objects_are_leaves() {
        let current = json!({
            "metadata": {"name": "np", "managedFields": [{"manager": ME, "operation": "Apply",
                "fieldsV1": {"f:spec": {"f:podSelector": {}, "f:ingress": {}}}}]},
            "spec": {"podSelector": {}, "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"t": "a"}}}]}]}
        });
        let want = json!({"metadata": {"name": "np"}, "spec": {"podSelector": {}, "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"t": "a"}}}]}]}});
        assert!(up_to_date(&current, &want, ME));
    }
}
