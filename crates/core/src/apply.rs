//! Owned children by server-side apply, written only when they differ from what this
//! manager last applied, and pruning of children no longer desired.
//!
//! Every child gets a controller owner reference to its parent (so the garbage collector
//! removes it with the parent) and the label [`OWNER_LABEL`] = the parent's UID (so the
//! operator finds its children with one label selector and deletes those it no longer wants).
//!
//! Start with [`crate::Context::children`]: [`Children::ensure`] applies a child unless the
//! cached copy shows it already as desired, so a resync with nothing changed writes nothing;
//! every write is counted in `steward_child_writes_total{controller, kind, verb}`.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Debug;
use std::sync::Arc;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::runtime::reflector::ObjectRef;
use kube::{Client, Resource, ResourceExt};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::Error;
use crate::cache::{CACHE_WAIT, Cache};
use crate::metrics::{Metrics, WriteLabels};
pub use crate::object::{APPLIED_ANNOTATION, MANAGED_BY_LABEL, OWNER_LABEL, ScopeApi};

/// What [`Children::ensure`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The object already was as desired: nothing was sent.
    Unchanged,
    /// The object was applied.
    Applied,
}

/// Counts one controller's writes in `steward_child_writes_total`.
#[derive(Clone, Debug)]
pub struct WriteCounter {
    family: Family<WriteLabels, Counter>,
    controller: String,
}

impl WriteCounter {
    /// The counter of `controller` in `metrics`.
    pub fn new(metrics: &Metrics, controller: &str) -> Self {
        Self {
            family: metrics.child_writes.clone(),
            controller: controller.to_string(),
        }
    }

    /// Counts one `verb` (`apply`, `delete`, `create`, `release`) of a `kind`.
    pub fn inc(&self, kind: &str, verb: &str) {
        self.family
            .get_or_create(&WriteLabels {
                controller: self.controller.clone(),
                kind: kind.to_string(),
                verb: verb.to_string(),
            })
            .inc();
    }
}

/// Applies children of one owner under one field manager.
///
/// # Guarantees
/// - Every child gets the owner label (the owner's UID), the managed-by label and, unless
///   [`Children::without_owner_reference`], a controller owner reference, so it is garbage
///   collected with the owner and found again by [`Children::selector`].
/// - [`Children::apply`] is a forced server-side apply under one field manager: fields this
///   manager stops setting are removed, fields other managers own are left alone. It records
///   a digest of the applied object in [`APPLIED_ANNOTATION`].
/// - [`Children::ensure`] sends nothing when the current object's metadata shows it as
///   desired ([`up_to_date`]): same digest, and this manager still owns exactly the fields it
///   sets. A field someone else changed moves to their ownership, so it is noticed and put
///   back; a deleted child (absent from the cache) is created again.
/// - [`Children::prune`] deletes only objects carrying this owner's label.
/// - With a counter ([`crate::Context::children`] sets one), every write is counted.
///
/// # Caveats
/// An apply carries no resourceVersion (except [`Children::ensure_unchanged_since`]): a late
/// apply from a former leader can land (see [`crate::guard`]); the next reconcile of the owner
/// puts it right. Writes go through whatever client it was given: give it the guarded one
/// ([`crate::Context::client`]). [`Children::ensure`] trusts its `current`: a stale cached copy
/// costs one needless apply, never a missed one, since a cache never runs ahead of the server.
#[derive(Clone)]
pub struct Children {
    client: Client,
    field_manager: String,
    owner_ref: Option<OwnerReference>,
    /// `None` for [`Children::unowned`].
    owner_uid: Option<String>,
    /// The owner's [`crate::object::SHARD_LABEL`], copied to every child.
    shard: Option<String>,
    writes: Option<WriteCounter>,
}

impl Children {
    /// Children of `owner`, written as `field_manager` (one per operator), not counted.
    pub fn new<P: Resource<DynamicType = ()>>(
        client: Client,
        owner: &P,
        field_manager: &str,
    ) -> Self {
        Self {
            client,
            field_manager: field_manager.to_string(),
            owner_ref: owner.controller_owner_ref(&()),
            owner_uid: Some(owner.meta().uid.clone().unwrap_or_default()),
            shard: owner.labels().get(crate::object::SHARD_LABEL).cloned(),
            writes: None,
        }
    }

    /// Objects this operator manages that belong to no object (cluster-wide configuration
    /// such as admission policies): applied as `field_manager` with the managed-by label only.
    pub fn unowned(client: Client, field_manager: &str) -> Self {
        Self {
            client,
            field_manager: field_manager.to_string(),
            owner_ref: None,
            owner_uid: None,
            shard: None,
            writes: None,
        }
    }

    /// These children, with their writes counted by `writes`.
    #[must_use]
    pub fn counted(mut self, writes: WriteCounter) -> Self {
        self.writes = Some(writes);
        self
    }

    /// Children without an owner reference (cluster-scoped children of a cluster-scoped owner
    /// are fine with one; use this where the garbage collector must not delete them, e.g.
    /// namespaces kept by an `Orphan` policy). They still carry [`OWNER_LABEL`].
    #[must_use]
    pub fn without_owner_reference(mut self) -> Self {
        self.owner_ref = None;
        self
    }

    /// The label selector matching every child of this owner (of this manager, for
    /// [`Children::unowned`]).
    pub fn selector(&self) -> String {
        match &self.owner_uid {
            Some(uid) => format!("{OWNER_LABEL}={uid}"),
            None => format!("{MANAGED_BY_LABEL}={}", self.field_manager),
        }
    }

    /// The field manager these children are applied as.
    pub fn field_manager(&self) -> &str {
        &self.field_manager
    }

    /// Counts one write (no-op without a counter).
    pub fn count(&self, kind: &str, verb: &str) {
        if let Some(w) = &self.writes {
            w.inc(kind, verb);
        }
    }

    /// Adds the owner reference and labels to `child` (pure; used by [`Children::apply`]):
    /// [`OWNER_LABEL`], [`MANAGED_BY_LABEL`] and the owner's shard ([`crate::shard`]), so a
    /// sharded controller's child watches see it.
    pub fn adopt<K: Resource>(&self, mut child: K) -> K {
        let meta = child.meta_mut();
        let labels = meta.labels.get_or_insert_with(Default::default);
        if let Some(uid) = &self.owner_uid {
            labels.insert(OWNER_LABEL.to_string(), uid.clone());
        }
        labels.insert(MANAGED_BY_LABEL.to_string(), self.field_manager.clone());
        if let Some(shard) = &self.shard {
            labels.insert(crate::object::SHARD_LABEL.to_string(), shard.clone());
        }
        if let Some(owner) = &self.owner_ref {
            meta.owner_references = Some(vec![owner.clone()]);
        }
        child
    }

    /// The apply body for `child`: adopted, with apiVersion and kind, without status and
    /// server-set metadata, and with [`APPLIED_ANNOTATION`] (pure).
    ///
    /// # Errors
    /// [`Error::Serialize`] when `child` does not serialize.
    pub fn body<K>(&self, child: K) -> Result<Value, Error>
    where
        K: Resource<DynamicType = ()> + Serialize,
    {
        stamped(self.adopt(child))
    }

    /// Server-side applies `child` (forced: the operator owns the fields it sets) in its
    /// namespace (or cluster-wide), returning the object as stored. Always writes; prefer
    /// [`Children::ensure`].
    ///
    /// # Errors
    /// [`Error::ApplyChild`] naming the child's kind and name.
    pub async fn apply<K>(&self, child: K) -> Result<K, Error>
    where
        K: Resource<DynamicType = ()> + Clone + Serialize + DeserializeOwned + Debug,
        K::Scope: ScopeApi,
    {
        let (name, namespace) = (child.name_any(), child.namespace());
        let body = self.body(child)?;
        self.send::<K>(&name, namespace.as_deref(), &body).await
    }

    /// Applies `desired` unless `current` (the object as cached, or its metadata) already
    /// shows it as desired ([`up_to_date`]); `None` means it does not exist.
    ///
    /// # Errors
    /// [`Error::ApplyChild`] when the API server rejects the apply.
    pub async fn ensure<K>(
        &self,
        current: Option<&ObjectMeta>,
        desired: K,
    ) -> Result<Outcome, Error>
    where
        K: Resource<DynamicType = ()> + Clone + Serialize + DeserializeOwned + Debug,
        K::Scope: ScopeApi,
    {
        self.ensure_with(current, desired, false).await
    }

    /// [`Children::ensure`] with the current object looked up in `cache` (of the child's kind,
    /// or of its metadata from [`crate::controller::watch_metadata`]) by `desired`'s name and
    /// namespace, once the cache has listed (waiting up to 10 s; every concurrent waiter wakes
    /// when it has, see [`Cache`]).
    ///
    /// # Errors
    /// [`Error::ApplyChild`] when the API server rejects the apply.
    pub async fn ensure_cached<K, S>(&self, cache: &Cache<S>, desired: K) -> Result<Outcome, Error>
    where
        K: Resource<DynamicType = ()> + Clone + Serialize + DeserializeOwned + Debug,
        K::Scope: ScopeApi,
        S: Resource<DynamicType = ()> + Clone,
    {
        let mut key = ObjectRef::<S>::new(&desired.name_any());
        if let Some(ns) = desired.namespace() {
            key = key.within(&ns);
        }
        // Right after a start or a failover the cache may not have listed yet: an empty cache
        // would make every child look missing and cost a write each. Wait for its first list
        // (bounded: a cache that cannot list costs a write, never a stuck reconcile).
        let _ = tokio::time::timeout(CACHE_WAIT, cache.listed()).await;
        let current = cache.get(&key);
        self.ensure(current.as_deref().map(Resource::meta), desired)
            .await
    }

    /// [`Children::ensure`] with `current`'s resourceVersion as a precondition: the apply fails
    /// with 409 Conflict ([`is_conflict`]) if the object changed since it was read.
    ///
    /// # Errors
    /// [`Error::ApplyChild`]; a conflict has source `kube::Error::Api` with code 409.
    pub async fn ensure_unchanged_since<K>(
        &self,
        current: Option<&ObjectMeta>,
        desired: K,
    ) -> Result<Outcome, Error>
    where
        K: Resource<DynamicType = ()> + Clone + Serialize + DeserializeOwned + Debug,
        K::Scope: ScopeApi,
    {
        self.ensure_with(current, desired, true).await
    }

    /// [`Children::ensure`], with `current`'s resourceVersion as a precondition when
    /// `unchanged_since`.
    async fn ensure_with<K>(
        &self,
        current: Option<&ObjectMeta>,
        desired: K,
        unchanged_since: bool,
    ) -> Result<Outcome, Error>
    where
        K: Resource<DynamicType = ()> + Clone + Serialize + DeserializeOwned + Debug,
        K::Scope: ScopeApi,
    {
        let (name, namespace) = (desired.name_any(), desired.namespace());
        let mut body = self.body(desired)?;
        if current.is_some_and(|c| up_to_date(c, &body, &self.field_manager)) {
            return Ok(Outcome::Unchanged);
        }
        if let (true, Some(rv), Some(meta)) = (
            unchanged_since,
            current.and_then(|c| c.resource_version.clone()),
            body.get_mut("metadata").and_then(|m| m.as_object_mut()),
        ) {
            meta.insert("resourceVersion".into(), rv.into());
        }
        self.send::<K>(&name, namespace.as_deref(), &body).await?;
        Ok(Outcome::Applied)
    }

    async fn send<K>(&self, name: &str, namespace: Option<&str>, body: &Value) -> Result<K, Error>
    where
        K: Resource<DynamicType = ()> + Clone + Serialize + DeserializeOwned + Debug,
        K::Scope: ScopeApi,
    {
        let api: Api<K> = K::Scope::api(self.client.clone(), namespace);
        self.count(&K::kind(&()), "apply");
        api.patch(
            name,
            &PatchParams::apply(&self.field_manager).force(),
            &Patch::Apply(body),
        )
        .await
        .map_err(|source| Error::ApplyChild {
            kind: K::kind(&()).to_string(),
            name: name.to_string(),
            source,
        })
    }

    /// Deletes `name` (in `namespace`), counted; "already gone" is success.
    ///
    /// # Errors
    /// [`Error::PruneChild`].
    pub async fn delete<K>(&self, namespace: Option<&str>, name: &str) -> Result<(), Error>
    where
        K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug,
        K::Scope: ScopeApi,
    {
        self.count(&K::kind(&()), "delete");
        let api: Api<K> = K::Scope::api(self.client.clone(), namespace);
        match api.delete(name, &DeleteParams::background()).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.is_not_found() => Ok(()),
            Err(source) => Err(Error::PruneChild {
                kind: K::kind(&()).to_string(),
                name: namespace.map_or_else(|| name.to_string(), |ns| format!("{ns}/{name}")),
                source,
            }),
        }
    }

    /// Deletes children of kind `K` (in `namespace`, or cluster-wide) that carry this owner's
    /// label but are not named in `keep`, listing them from the API server. Returns the names
    /// deleted.
    ///
    /// # Errors
    /// [`Error::PruneChild`] for the first list or delete that fails.
    pub async fn prune<K>(
        &self,
        namespace: Option<&str>,
        keep: &BTreeSet<String>,
    ) -> Result<Vec<String>, Error>
    where
        K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug,
        K::Scope: ScopeApi,
    {
        let api: Api<K> = K::Scope::api(self.client.clone(), namespace);
        let list = api
            .list_metadata(&ListParams::default().labels(&self.selector()))
            .await
            .map_err(|source| Error::PruneChild {
                kind: K::kind(&()).to_string(),
                name: String::new(),
                source,
            })?;
        let mut deleted = Vec::new();
        for item in list.items {
            let name = item.name_any();
            if keep.contains(&name) || item.metadata.deletion_timestamp.is_some() {
                continue;
            }
            self.delete::<K>(item.namespace().as_deref(), &name).await?;
            deleted.push(name);
        }
        Ok(deleted)
    }

    /// Whether `meta` is one of these children: it carries this owner's [`OWNER_LABEL`] (the
    /// managed-by label, for [`Children::unowned`]).
    pub fn is_child(&self, meta: &ObjectMeta) -> bool {
        let labels = meta.labels.as_ref();
        let label = |k: &str| labels.and_then(|l| l.get(k)).map(String::as_str);
        match &self.owner_uid {
            Some(uid) => label(OWNER_LABEL) == Some(uid),
            None => label(MANAGED_BY_LABEL) == Some(&self.field_manager),
        }
    }

    /// [`Children::prune`] from the operator's watch cache of `K` instead of a list: deletes
    /// the children among `cached` (a store's `state()`, or the part of it an
    /// [`crate::index::Indexed`] finds by the owner's label, without a scan) that are not
    /// being deleted and that `keep` does not keep. Returns what it deleted.
    ///
    /// # Guarantees
    /// Only children of this owner ([`Children::is_child`]) are deleted, each at most once per
    /// call; a child the cache does not hold yet is left for a later call (a cache can lag,
    /// so this is for children that are re-checked at every reconcile).
    ///
    /// # Errors
    /// [`Error::PruneChild`] for the first delete that fails.
    pub async fn prune_cached<K>(
        &self,
        cached: impl IntoIterator<Item = Arc<K>>,
        keep: impl Fn(&K) -> bool,
    ) -> Result<Vec<ObjectRef<K>>, Error>
    where
        K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug,
        K::Scope: ScopeApi,
    {
        let mut deleted = Vec::new();
        for obj in cached {
            if !self.is_child(obj.meta()) || obj.meta().deletion_timestamp.is_some() || keep(&obj) {
                continue;
            }
            self.delete::<K>(obj.namespace().as_deref(), &obj.name_any())
                .await?;
            deleted.push(ObjectRef::from_obj(obj.as_ref()));
        }
        Ok(deleted)
    }
}

/// The children an owner wants, by kind, namespace and name: what [`Children::prune_unkept`]
/// keeps. Built by a reconcile's decide step from the objects it wants (a value, so it is
/// unit-tested with them), not collected while applying. Looked up without allocating: a
/// prune asks about every cached child at every reconcile.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Kept(BTreeMap<String, BTreeMap<String, BTreeSet<String>>>);

impl Kept {
    /// Keeps `obj` (its kind, namespace and name).
    pub fn insert<K: Resource<DynamicType = ()>>(&mut self, obj: &K) {
        let meta = obj.meta();
        self.insert_named::<K>(
            meta.namespace.as_deref(),
            meta.name.as_deref().unwrap_or_default(),
        );
    }

    /// Keeps the object of kind `K` named `name` in `namespace` (`None`: cluster-scoped).
    pub fn insert_named<K: Resource<DynamicType = ()>>(
        &mut self,
        namespace: Option<&str>,
        name: &str,
    ) {
        self.0
            .entry(K::kind(&()).into_owned())
            .or_default()
            .entry(namespace.unwrap_or_default().to_string())
            .or_default()
            .insert(name.to_string());
    }

    /// The kept names of kind `K` in `namespace` (`None`: cluster-scoped).
    fn in_namespace<K: Resource<DynamicType = ()>>(
        &self,
        namespace: Option<&str>,
    ) -> Option<&BTreeSet<String>> {
        self.0
            .get(K::kind(&()).as_ref())?
            .get(namespace.unwrap_or_default())
    }

    /// Whether `obj` is kept.
    pub fn contains<K: Resource<DynamicType = ()>>(&self, obj: &K) -> bool {
        let meta = obj.meta();
        self.in_namespace::<K>(meta.namespace.as_deref())
            .is_some_and(|names| names.contains(meta.name.as_deref().unwrap_or_default()))
    }

    /// The names of the kept objects of kind `K` in `namespace` (`None`: cluster-scoped).
    pub fn names<K: Resource<DynamicType = ()>>(&self, namespace: Option<&str>) -> Vec<&str> {
        self.in_namespace::<K>(namespace)
            .into_iter()
            .flatten()
            .map(String::as_str)
            .collect()
    }

    /// How many objects are kept.
    pub fn len(&self) -> usize {
        self.0
            .values()
            .flat_map(BTreeMap::values)
            .map(BTreeSet::len)
            .sum()
    }

    /// Whether nothing is kept.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Children {
    /// [`Children::prune_cached`] keeping what `kept` names: deletes the children among
    /// `cached` that `kept` does not name, unless `spare` spares them (e.g. those in a
    /// namespace being deleted, which go with it). Returns what it deleted.
    ///
    /// # Errors
    /// [`Error::PruneChild`] for the first delete that fails.
    pub async fn prune_unkept<K>(
        &self,
        cached: impl IntoIterator<Item = Arc<K>>,
        kept: &Kept,
        spare: impl Fn(&K) -> bool,
    ) -> Result<Vec<ObjectRef<K>>, Error>
    where
        K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug,
        K::Scope: ScopeApi,
    {
        self.prune_cached(cached, |obj| kept.contains(obj) || spare(obj))
            .await
    }
}

/// Whether `err` is the API server refusing a stale `resourceVersion`.
pub fn is_conflict(err: &Error) -> bool {
    matches!(err, Error::ApplyChild { source: kube::Error::Api(s), .. } if s.code == 409)
}

/// Whether `err` is the API server refusing the apply as not permitted (403: RBAC, or an
/// admission policy that denies with `Forbidden`).
pub fn is_forbidden(err: &Error) -> bool {
    matches!(err, Error::ApplyChild { source: kube::Error::Api(s), .. } if s.code == 403)
}

/// The apply body of an unowned child (what [`Children::unowned`]'s [`Children::body`] makes
/// of `child` for `field_manager`), without a client: for manifests generated ahead of time
/// and installed by someone else, which the operator then finds up to date by their digest.
///
/// # Errors
/// [`Error::Serialize`] when `child` does not serialize.
pub fn unowned_body<K>(field_manager: &str, mut child: K) -> Result<Value, Error>
where
    K: Resource<DynamicType = ()> + Serialize,
{
    child
        .meta_mut()
        .labels
        .get_or_insert_with(Default::default)
        .insert(MANAGED_BY_LABEL.to_string(), field_manager.to_string());
    stamped(child)
}

/// `child` as an apply body: with apiVersion and kind, without status and server-set
/// metadata, and with [`APPLIED_ANNOTATION`].
fn stamped<K>(child: K) -> Result<Value, Error>
where
    K: Resource<DynamicType = ()> + Serialize,
{
    let mut value = serde_json::to_value(&child).map_err(|e| Error::Serialize {
        what: child.name_any(),
        message: e.to_string(),
    })?;
    if let Some(obj) = value.as_object_mut() {
        obj.insert("apiVersion".into(), K::api_version(&()).into());
        obj.insert("kind".into(), K::kind(&()).into());
        obj.remove("status");
        if let Some(meta) = obj.get_mut("metadata").and_then(|m| m.as_object_mut()) {
            meta.remove("resourceVersion");
            meta.remove("managedFields");
            meta.remove("creationTimestamp");
            if let Some(Value::Object(a)) = meta.get_mut("annotations") {
                a.remove(APPLIED_ANNOTATION);
                if a.is_empty() {
                    meta.remove("annotations");
                }
            }
        }
    }
    let digest = digest(&value);
    if let Some(meta) = value.get_mut("metadata").and_then(|m| m.as_object_mut()) {
        let annotations = meta
            .entry("annotations")
            .or_insert_with(|| Value::Object(Default::default()));
        if let Some(a) = annotations.as_object_mut() {
            a.insert(APPLIED_ANNOTATION.into(), digest.into());
        }
    }
    Ok(value)
}

/// The digest recorded in [`APPLIED_ANNOTATION`]: SHA-256 of the apply body's JSON, 16 bytes.
fn digest(body: &Value) -> String {
    let bytes = serde_json::to_vec(body).unwrap_or_default();
    let hash = Sha256::digest(&bytes);
    hash.iter().take(16).map(|b| format!("{b:02x}")).collect()
}

/// The digest of what was last applied to the object of `meta` ([`APPLIED_ANNOTATION`]), also
/// on an object a store keeps, where [`crate::cache::trim`] moved it to the labels.
pub fn applied_digest(meta: &ObjectMeta) -> Option<&str> {
    meta.annotations
        .as_ref()
        .and_then(|a| a.get(APPLIED_ANNOTATION))
        .or_else(|| meta.labels.as_ref()?.get(APPLIED_ANNOTATION))
        .map(String::as_str)
}

/// Fields never recorded in managedFields (identity, not content).
const IDENTITY: [&[&str]; 4] = [
    &["apiVersion"],
    &["kind"],
    &["metadata", "name"],
    &["metadata", "namespace"],
];

/// Whether an object whose metadata is `current` already is what applying `body` (from
/// [`Children::body`]) as `manager` would make it: it carries `body`'s digest, and the fields
/// `manager` owns through Apply (its `managedFields` entry) are exactly the fields `body`
/// sets. Another manager that changes one of those fields takes it over, so a change by
/// anyone else is noticed; a label this manager stopped setting is still owned, so it is
/// noticed and removed. An atomic struct or list counts as one field.
pub fn up_to_date(current: &ObjectMeta, body: &Value, manager: &str) -> bool {
    let wanted_digest = body
        .pointer("/metadata/annotations")
        .and_then(|a| a.get(APPLIED_ANNOTATION))
        .and_then(Value::as_str);
    let current_digest = applied_digest(current);
    if wanted_digest.is_none() || wanted_digest != current_digest {
        return false;
    }
    let Some(owned) = owned_paths(current, manager) else {
        return false;
    };
    let mut wanted = BTreeSet::new();
    leaf_paths(body, &mut Vec::new(), &mut wanted);
    wanted.retain(|p| !is_identity(p) && p.first().map(String::as_str) != Some("status"));
    // An atomic struct or list is owned as one field (`f:roleRef: {}`) while the desired
    // object names its leaves, so a desired field matches an owned one that is its prefix.
    let related = |owned: &Vec<String>, wanted: &Vec<String>| {
        owned.len() <= wanted.len() && owned.iter().zip(wanted).all(|(x, y)| x == y)
    };
    wanted.iter().all(|w| owned.iter().any(|o| related(o, w)))
        && owned.iter().all(|o| wanted.iter().any(|w| related(o, w)))
}

fn is_identity(path: &[String]) -> bool {
    IDENTITY
        .iter()
        .any(|id| id.len() == path.len() && id.iter().zip(path).all(|(a, b)| a == b))
}

/// The leaf field paths `manager` owns through Apply (no subresource), from `managedFields`.
/// `None` when the manager never applied this object, or its fields cannot be read.
fn owned_paths(current: &ObjectMeta, manager: &str) -> Option<BTreeSet<Vec<String>>> {
    let mut out = BTreeSet::new();
    let mut found = false;
    for e in current.managed_fields.iter().flatten() {
        let is_ours = e.manager.as_deref() == Some(manager)
            && e.operation.as_deref() == Some("Apply")
            && e.subresource.as_deref().unwrap_or("").is_empty();
        if !is_ours {
            continue;
        }
        found = true;
        if let Some(fields) = &e.fields_v1 {
            // A reference to a shared set in the operators' caches (crate::cache::trim).
            out.extend(crate::fields::owned(&fields.0)?.iter().cloned());
        }
    }
    out.retain(|p| !is_identity(p));
    found.then_some(out)
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ConfigMap;
    use k8s_openapi::api::rbac::v1::RoleBinding;
    use serde_json::json;

    const ME: &str = "test-operator";

    fn children() -> Children {
        let config = kube::Config::new("http://127.0.0.1:9".parse().unwrap());
        let owner: ConfigMap = serde_json::from_value(json!({
            "metadata": {"name": "owner", "namespace": "n", "uid": "u-1"}
        }))
        .unwrap();
        Children::new(Client::try_from(config).unwrap(), &owner, ME)
    }

    fn binding(role: &str, labels: Value) -> RoleBinding {
        serde_json::from_value(json!({
            "metadata": {"name": "rb", "namespace": "n", "labels": labels},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
            "subjects": [{"kind": "User", "name": "alice"}]
        }))
        .unwrap()
    }

    /// `Kept` tells kinds, namespaces and names apart: a kept RoleBinding does not keep a
    /// ConfigMap of the same name, nor one of its name in another namespace.
    #[test]
    fn kept_names_kind_namespace_and_name() {
        let mut kept = Kept::default();
        kept.insert(&binding("edit", json!({})));
        kept.insert_named::<ConfigMap>(Some("m"), "cm");
        kept.insert_named::<k8s_openapi::api::rbac::v1::ClusterRole>(None, "owners");
        assert!(kept.contains(&binding("view", json!({}))));
        let mut elsewhere = binding("edit", json!({}));
        elsewhere.metadata.namespace = Some("other".into());
        assert!(!kept.contains(&elsewhere));
        let mut same_name = ConfigMap::default();
        same_name.metadata.name = Some("rb".into());
        same_name.metadata.namespace = Some("n".into());
        assert!(!kept.contains(&same_name));
        assert_eq!(kept.names::<ConfigMap>(Some("m")), ["cm"]);
        assert!(kept.names::<ConfigMap>(Some("n")).is_empty());
        assert_eq!(
            kept.names::<k8s_openapi::api::rbac::v1::ClusterRole>(None),
            ["owners"]
        );
        assert_eq!(kept.len(), 3);
    }

    /// The metadata the API server would store after `body` was applied as `manager`, with
    /// `fields` as its managedFields entry, plus another manager's entry.
    fn stored(body: &Value, manager: &str, fields: Value) -> ObjectMeta {
        let mut meta: ObjectMeta = serde_json::from_value(body["metadata"].clone()).unwrap();
        meta.managed_fields = Some(
            serde_json::from_value(json!([
                {"manager": manager, "operation": "Apply", "apiVersion": "rbac.authorization.k8s.io/v1", "fieldsV1": fields},
                {"manager": "kubectl", "operation": "Update", "fieldsV1": {"f:metadata": {"f:labels": {"f:x": {}}}}}
            ]))
            .unwrap(),
        );
        meta
    }

    fn owned(labels: &[&str]) -> Value {
        let mut l: serde_json::Map<String, Value> = labels
            .iter()
            .map(|k| (format!("f:{k}"), json!({})))
            .collect();
        for k in [OWNER_LABEL, MANAGED_BY_LABEL] {
            l.insert(format!("f:{k}"), json!({}));
        }
        json!({"f:metadata": {
            "f:labels": l,
            "f:annotations": {format!("f:{APPLIED_ANNOTATION}"): {}},
            "f:ownerReferences": {"k:{\"uid\":\"u-1\"}": {}},
        }, "f:roleRef": {}, "f:subjects": {}})
    }

    #[tokio::test]
    async fn children_are_recognised_by_the_owner_label_or_for_unowned_by_the_manager() {
        let meta = |labels: Value| binding("admin", labels).metadata;
        let c = children();
        assert!(c.is_child(&meta(json!({OWNER_LABEL: "u-1"}))));
        assert!(!c.is_child(&meta(json!({OWNER_LABEL: "u-2"}))));
        assert!(!c.is_child(&meta(json!({MANAGED_BY_LABEL: ME}))));
        let config = kube::Config::new("http://127.0.0.1:9".parse().unwrap());
        let unowned = Children::unowned(Client::try_from(config).unwrap(), ME);
        assert!(unowned.is_child(&meta(json!({MANAGED_BY_LABEL: ME}))));
        assert!(!unowned.is_child(&meta(json!({MANAGED_BY_LABEL: "other"}))));
        assert!(!unowned.is_child(&meta(json!({}))));
    }

    #[tokio::test]
    async fn an_object_as_last_applied_is_up_to_date() {
        let c = children();
        let body = c.body(binding("admin", json!({"t": "a"}))).unwrap();
        let meta = stored(&body, ME, owned(&["t"]));
        assert!(up_to_date(&meta, &body, ME));
        // The same as cached: fieldsV1 packed by the cache's trim.
        let mut cached = RoleBinding {
            metadata: meta,
            ..binding("admin", json!({}))
        };
        crate::cache::trim(&mut cached);
        assert!(
            cached.metadata.annotations.is_none(),
            "the digest, its only annotation, is kept with the labels"
        );
        assert!(applied_digest(&cached.metadata).is_some());
        assert!(up_to_date(&cached.metadata, &body, ME));
    }

    #[tokio::test]
    async fn a_changed_desire_is_not_up_to_date() {
        let c = children();
        let body = c.body(binding("admin", json!({"t": "a"}))).unwrap();
        let meta = stored(&body, ME, owned(&["t"]));
        for other in [
            binding("edit", json!({"t": "a"})),
            binding("admin", json!({"t": "b"})),
        ] {
            assert!(!up_to_date(&meta, &c.body(other).unwrap(), ME));
        }
    }

    #[tokio::test]
    async fn a_field_taken_over_or_no_longer_set_is_not_up_to_date() {
        let c = children();
        let body = c.body(binding("admin", json!({"t": "a"}))).unwrap();
        // Someone else changed roleRef: it is theirs now, no longer in our entry.
        let mut fields = owned(&["t"]);
        fields.as_object_mut().unwrap().remove("f:roleRef");
        assert!(!up_to_date(&stored(&body, ME, fields), &body, ME));
        // We still own a label we no longer set: the next apply removes it.
        assert!(!up_to_date(
            &stored(&body, ME, owned(&["t", "old"])),
            &body,
            ME
        ));
    }

    #[tokio::test]
    async fn never_applied_by_us_or_without_a_digest_is_not_up_to_date() {
        let c = children();
        let body = c.body(binding("admin", json!({}))).unwrap();
        assert!(!up_to_date(
            &stored(&body, "someone-else", owned(&[])),
            &body,
            ME
        ));
        let mut meta = stored(&body, ME, owned(&[]));
        meta.annotations = None;
        assert!(!up_to_date(&meta, &body, ME));
    }

    #[tokio::test]
    async fn the_body_is_adopted_and_its_digest_ignores_a_digest_already_there() {
        let c = children();
        let body = c.body(binding("admin", json!({}))).unwrap();
        assert_eq!(body["metadata"]["labels"][OWNER_LABEL], "u-1");
        assert_eq!(body["metadata"]["labels"][MANAGED_BY_LABEL], ME);
        assert_eq!(body["kind"], "RoleBinding");
        let mut again = binding("admin", json!({}));
        again.metadata.annotations =
            Some([(APPLIED_ANNOTATION.to_string(), "stale".to_string())].into());
        assert_eq!(c.body(again).unwrap(), body);
    }
}
