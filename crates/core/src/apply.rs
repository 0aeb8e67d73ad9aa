//! Owned children by server-side apply, and pruning of children no longer desired.
//!
//! Every child gets a controller owner reference to its parent (so the garbage collector
//! removes it with the parent) and the label [`OWNER_LABEL`] = the parent's UID (so the
//! operator finds its children with one label selector and deletes those it no longer wants).

use std::collections::BTreeSet;
use std::fmt::Debug;

use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::{Client, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::Error;

/// Label on every child, holding the owner's UID.
pub const OWNER_LABEL: &str = "steward.dev/owner-uid";
/// Label on every child, naming the operator that manages it.
pub const MANAGED_BY_LABEL: &str = "app.kubernetes.io/managed-by";

/// Applies children of one owner under one field manager.
///
/// # Guarantees
/// - Every child gets the owner label (the owner's UID), the managed-by label and, unless
///   [`Children::without_owner_reference`], a controller owner reference, so it is garbage
///   collected with the owner and found again by [`Children::selector`].
/// - [`Children::apply`] is a forced server-side apply under one field manager: fields this
///   manager stops setting are removed, fields other managers own are left alone.
/// - [`Children::prune`] deletes only objects carrying this owner's label.
///
/// # Caveats
/// An apply carries no resourceVersion: a late apply from a former leader can land (see
/// [`crate::guard`]); the next reconcile of the owner puts it right. Writes go through
/// whatever client it was given: give it the guarded one ([`crate::Context::client`]).
#[derive(Clone)]
pub struct Children {
    client: Client,
    field_manager: String,
    owner_ref: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference>,
    owner_uid: String,
}

impl Children {
    /// Children of `owner`, written as `field_manager` (one per operator).
    pub fn new<P: Resource<DynamicType = ()>>(
        client: Client,
        owner: &P,
        field_manager: &str,
    ) -> Self {
        Self {
            client,
            field_manager: field_manager.to_string(),
            owner_ref: owner.controller_owner_ref(&()),
            owner_uid: owner.meta().uid.clone().unwrap_or_default(),
        }
    }

    /// Children without an owner reference (cluster-scoped children of a cluster-scoped owner
    /// are fine with one; use this where the garbage collector must not delete them, e.g.
    /// namespaces kept by an `Orphan` policy). They still carry [`OWNER_LABEL`].
    pub fn without_owner_reference(mut self) -> Self {
        self.owner_ref = None;
        self
    }

    /// The label selector matching every child of this owner.
    pub fn selector(&self) -> String {
        format!("{OWNER_LABEL}={}", self.owner_uid)
    }

    /// Adds the owner reference and labels to `child` (pure; used by [`Children::apply`]).
    pub fn adopt<K: Resource>(&self, mut child: K) -> K {
        let meta = child.meta_mut();
        let labels = meta.labels.get_or_insert_with(Default::default);
        labels.insert(OWNER_LABEL.to_string(), self.owner_uid.clone());
        labels.insert(MANAGED_BY_LABEL.to_string(), self.field_manager.clone());
        if let Some(owner) = &self.owner_ref {
            meta.owner_references = Some(vec![owner.clone()]);
        }
        child
    }

    /// Server-side applies `child` (forced: the operator owns the fields it sets) in its
    /// namespace (or cluster-wide), returning the object as stored.
    ///
    /// # Errors
    /// [`Error::ApplyChild`] naming the child's kind and name.
    pub async fn apply<K>(&self, child: K) -> Result<K, Error>
    where
        K: Resource<DynamicType = ()> + Clone + Serialize + DeserializeOwned + Debug,
        K::Scope: ScopeApi,
    {
        let child = self.adopt(child);
        let name = child.name_any();
        let api: Api<K> = K::Scope::api(self.client.clone(), child.namespace().as_deref());
        let mut value = serde_json::to_value(&child).map_err(|e| Error::Serialize {
            what: name.clone(),
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
            }
        }
        api.patch(
            &name,
            &PatchParams::apply(&self.field_manager).force(),
            &Patch::Apply(&value),
        )
        .await
        .map_err(|source| Error::ApplyChild {
            kind: K::kind(&()).to_string(),
            name,
            source,
        })
    }

    /// Deletes children of kind `K` (in `namespace`, or cluster-wide) that carry this owner's
    /// label but are not named in `keep`. Returns the names deleted.
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
        let err = |name: String| {
            move |source| Error::PruneChild {
                kind: K::kind(&()).to_string(),
                name,
                source,
            }
        };
        let list = api
            .list_metadata(&ListParams::default().labels(&self.selector()))
            .await
            .map_err(err(String::new()))?;
        let mut deleted = Vec::new();
        for item in list.items {
            let name = item.name_any();
            if keep.contains(&name) || item.metadata.deletion_timestamp.is_some() {
                continue;
            }
            match api.delete(&name, &DeleteParams::background()).await {
                Ok(_) => deleted.push(name),
                Err(kube::Error::Api(s)) if s.code == 404 => {}
                Err(source) => return Err(err(name)(source)),
            }
        }
        Ok(deleted)
    }
}

/// Builds an `Api` for namespaced or cluster-scoped kinds alike.
pub trait ScopeApi: Sized {
    /// An `Api<K>` in `namespace`; across all namespaces with `None`, and always for
    /// cluster-scoped kinds.
    fn api<K: Resource<DynamicType = (), Scope = Self>>(
        client: Client,
        namespace: Option<&str>,
    ) -> Api<K>;
}

impl ScopeApi for k8s_openapi::NamespaceResourceScope {
    fn api<K: Resource<DynamicType = (), Scope = Self>>(
        client: Client,
        namespace: Option<&str>,
    ) -> Api<K> {
        match namespace {
            Some(ns) => Api::namespaced(client, ns),
            None => Api::all(client),
        }
    }
}

impl ScopeApi for k8s_openapi::ClusterResourceScope {
    fn api<K: Resource<DynamicType = (), Scope = Self>>(
        client: Client,
        _namespace: Option<&str>,
    ) -> Api<K> {
        Api::all(client)
    }
}
