//! What the tenant-operator's caches hold, by kind and by part of the object.
//!
//! For every store the operator keeps (the kinds and label selectors of
//! `tenant_operator::controller::build`), the harness lists the objects and measures the Rust
//! heap each one takes once deserialized into its `k8s-openapi` type, as a reflector store
//! holds it: the live bytes a deserialization leaves allocated on this thread, counted by
//! [`Counting`] (the harness's global allocator, installed by `lib.rs`). A part's cost is what
//! removing it saves. `trimmed` is the object as `steward_core::controller::trim` leaves it,
//! i.e. what the stores keep now.
//!
//! Bytes are the sizes requested from the allocator (its own per-allocation overhead, typically
//! 8–16 bytes, is not included; the allocation count is reported for that reason).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::collections::BTreeMap;

use anyhow::Result;
use k8s_openapi::api::core::v1::{ConfigMap, LimitRange, Namespace, ResourceQuota, Secret};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use kube::api::ListParams;
use kube::core::PartialObjectMeta;
use kube::{Api, Client, Resource};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use steward_core::controller::Owners;
use tenant_operator::crd::{SHAREABLE_LABEL, TENANT_LABEL, Tenant};

/// The system allocator, counting the bytes live and the allocations made on each thread.
pub struct Counting;

thread_local! {
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static ALLOCATIONS: Cell<usize> = const { Cell::new(0) };
}

fn account(bytes: isize, allocations: usize) {
    // `try_with`: a thread being torn down has no locals left; nothing to count then.
    let _ = LIVE.try_with(|l| l.set(l.get() + bytes));
    let _ = ALLOCATIONS.try_with(|a| a.set(a.get() + allocations));
}

// The workspace's one `unsafe`: a global allocator cannot be written without it.
// SAFETY: every call is forwarded to `System` unchanged; the counters are thread-locals with
// const initializers, which never allocate.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        account(layout.size() as isize, 1);
        // SAFETY: same contract as ours.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        account(-(layout.size() as isize), 0);
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        account(layout.size() as isize, 1);
        // SAFETY: same contract as ours.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        account(new_size as isize - layout.size() as isize, 0);
        // SAFETY: same contract as ours.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// The heap one value of `K` deserialized from `json` keeps: (bytes, allocations); `None`
/// when `json` is not a `K` (a required part removed).
fn heap_of<K: DeserializeOwned>(json: &[u8]) -> Option<(u64, u64)> {
    kept_of::<K>(json, |_| {})
}

/// [`heap_of`] the value as `keep` leaves it, changed in place as a store's watch does
/// (a trim that frees a part, or only cuts a list to its length, counts as it is).
fn kept_of<K: DeserializeOwned>(json: &[u8], keep: impl FnOnce(&mut K)) -> Option<(u64, u64)> {
    let (b0, a0) = (LIVE.with(Cell::get), ALLOCATIONS.with(Cell::get));
    let mut obj: Option<K> = serde_json::from_slice(json).ok();
    if let Some(obj) = obj.as_mut() {
        keep(obj);
    }
    let (b1, a1) = (LIVE.with(Cell::get), ALLOCATIONS.with(Cell::get));
    // The allocations made and freed while parsing cancel out; what is left is the object's.
    let live = (b1 - b0).max(0) as u64 + std::mem::size_of::<K>() as u64;
    obj.map(|_| (live, (a1 - a0) as u64))
}

/// One store's objects: their count and heap, whole and by part.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Kind {
    pub kind: String,
    pub selector: String,
    pub objects: u64,
    /// The objects as the API server sends them (what the stores kept before trimming).
    pub bytes: u64,
    pub allocations: u64,
    /// As `steward_core::controller::trim` leaves them (what the stores keep now).
    pub trimmed_bytes: u64,
    /// What removing each part saves: `managedFields`, `annotations`, `labels`,
    /// `metadata (rest)`, `status`, and `content` (everything else: spec, data, rules, …);
    /// `None` when the kind cannot be read without it (a required field).
    pub parts: BTreeMap<String, Option<u64>>,
}

/// Every store of the tenant-operator, in the order `controller::build` creates them.
pub async fn tenant_operator(client: &Client) -> Result<Vec<Kind>> {
    let t = TENANT_LABEL;
    let s = format!("{SHAREABLE_LABEL}=true");
    Ok(vec![
        kind::<Tenant>(client, "", Stored::Whole).await?,
        kind::<Namespace>(client, t, Stored::Metadata).await?,
        kind::<ResourceQuota>(client, t, Stored::Whole).await?,
        kind::<LimitRange>(client, t, Stored::Metadata).await?,
        kind::<NetworkPolicy>(client, t, Stored::Metadata).await?,
        kind::<RoleBinding>(client, t, Stored::Metadata).await?,
        kind::<Role>(client, t, Stored::Whole).await?,
        kind::<ClusterRole>(client, t, Stored::Metadata).await?,
        kind::<ClusterRoleBinding>(client, t, Stored::Metadata).await?,
        // The shared sources (the operator watches them in its shared namespaces only; the
        // bench shares from none other). Its copies are read by name, never cached.
        kind::<Secret>(client, &s, Stored::Whole).await?,
        kind::<ConfigMap>(client, &s, Stored::Whole).await?,
    ])
}

/// What a store keeps of each object of a kind (`tenant_operator::controller::build`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stored {
    /// The object, trimmed.
    Whole,
    /// Its metadata only (a metadata watch), trimmed, without owner references (the
    /// tenant-operator finds its children by label).
    Metadata,
}

async fn kind<K>(client: &Client, selector: &str, stored: Stored) -> Result<Kind>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Serialize + std::fmt::Debug,
{
    let list = Api::<K>::all(client.clone())
        .list(&ListParams::default().labels(selector))
        .await?;
    let mut out = Kind {
        kind: K::kind(&()).to_string(),
        selector: selector.to_string(),
        ..Default::default()
    };
    for obj in list.items {
        let json = serde_json::to_value(&obj)?;
        let (whole, allocations) = heap_of::<K>(&serde_json::to_vec(&json)?)
            .ok_or_else(|| anyhow::anyhow!("a listed {} does not read back", out.kind))?;
        out.objects += 1;
        out.bytes += whole;
        out.allocations += allocations;
        for (part, pointer) in PARTS {
            let mut v = json.clone();
            if remove_part(&mut v, pointer) {
                let saved = heap_of::<K>(&serde_json::to_vec(&v)?)
                    .map(|(without, _)| whole.saturating_sub(without));
                let sum = out.parts.entry(part.to_string()).or_insert(Some(0));
                *sum = sum.zip(saved).map(|(a, b)| a + b);
            }
        }
        let sent = serde_json::to_vec(&obj)?;
        out.trimmed_bytes += match stored {
            Stored::Whole => kept_of::<K>(&sent, steward_core::controller::trim),
            Stored::Metadata => kept_of::<PartialObjectMeta<K>>(&sent, |m| {
                steward_core::controller::trim_metadata(m, Owners::Dropped);
            }),
        }
        .map_or(0, |(b, _)| b);
    }
    Ok(out)
}

/// The parts measured (the report's columns, in this order), and where they are (`content`:
/// every top-level field but these).
pub const PARTS: [(&str, &str); 6] = [
    ("managedFields", "/metadata/managedFields"),
    ("annotations", "/metadata/annotations"),
    ("labels", "/metadata/labels"),
    ("metadata (rest)", "/metadata"),
    ("status", "/status"),
    ("content", ""),
];

/// Removes one part of `v`; whether there was one. `/metadata` keeps what is measured on
/// its own (managedFields, annotations, labels) and the name, which every object needs.
fn remove_part(v: &mut Value, pointer: &str) -> bool {
    let Some(obj) = v.as_object_mut() else {
        return false;
    };
    match pointer {
        "" => {
            let content: Vec<String> = obj
                .keys()
                .filter(|k| !matches!(k.as_str(), "apiVersion" | "kind" | "metadata" | "status"))
                .cloned()
                .collect();
            for k in &content {
                obj.remove(k);
            }
            !content.is_empty()
        }
        "/metadata" => {
            let Some(meta) = obj.get_mut("metadata").and_then(Value::as_object_mut) else {
                return false;
            };
            let before = meta.len();
            meta.retain(|k, _| {
                matches!(
                    k.as_str(),
                    "name" | "managedFields" | "annotations" | "labels"
                )
            });
            meta.len() != before
        }
        "/status" => obj.remove("status").is_some(),
        _ => {
            let Some(field) = pointer.strip_prefix("/metadata/") else {
                return false;
            };
            obj.get_mut("metadata")
                .and_then(Value::as_object_mut)
                .and_then(|m| m.remove(field))
                .is_some()
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use k8s_openapi::api::core::v1::ConfigMap;
    use serde_json::json;

    use super::{heap_of, remove_part};

    #[test]
    fn a_larger_object_keeps_more_heap() {
        let small = json!({"metadata": {"name": "a"}, "data": {"k": "v"}});
        let large = json!({"metadata": {"name": "a"}, "data": {"k": "v".repeat(4096)}});
        let (s, _) = heap_of::<ConfigMap>(&serde_json::to_vec(&small).unwrap()).unwrap();
        let (l, _) = heap_of::<ConfigMap>(&serde_json::to_vec(&large).unwrap()).unwrap();
        assert!(l >= s + 4095, "small {s}, large {l}");
        assert!(heap_of::<ConfigMap>(b"[]").is_none());
    }

    #[test]
    fn parts_are_removed_where_they_are() {
        let mut v = json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "a", "uid": "u", "labels": {"x": "y"}}, "data": {"k": "v"}});
        assert!(remove_part(&mut v, ""));
        assert!(v.get("data").is_none() && v.get("kind").is_some());
        assert!(remove_part(&mut v, "/metadata"));
        assert_eq!(v["metadata"], json!({"name": "a", "labels": {"x": "y"}}));
        assert!(remove_part(&mut v, "/metadata/labels"));
        assert!(!remove_part(&mut v, "/status"));
    }
}
