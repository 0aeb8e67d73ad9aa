//! Safe deletion: a finalizer on kube-runtime's [`kube::runtime::finalizer()`], and the shared
//! [`DeletionPolicy`] of Steward's CRDs.
//!
//! The top-level reconcile only dispatches, with [`dispatch`]:
//!
//! ```no_run
//! # use std::sync::Arc;
//! # use kube::runtime::controller::Action;
//! # use steward_core::finalizer::{self, Cleanup};
//! # #[derive(Debug, thiserror::Error)] #[error("x")] struct MyError;
//! # async fn apply(_: Arc<k8s_openapi::api::core::v1::ConfigMap>) -> Result<Action, MyError> { todo!() }
//! # async fn cleanup(_: Arc<k8s_openapi::api::core::v1::ConfigMap>) -> Result<Cleanup, MyError> { todo!() }
//! # async fn f(client: kube::Client, obj: Arc<k8s_openapi::api::core::v1::ConfigMap>) {
//! let result = finalizer::dispatch(&client, "example.steward.dev/cleanup", obj, apply, cleanup).await;
//! # }
//! ```
//!
//! # Guarantees
//! The finalizer is added before the first Apply and removed only after Cleanup returned
//! `Ok`. A failing Cleanup keeps the finalizer and the object; the error goes back to the
//! runtime, which records a Warning Event and retries with backoff. Operators also set a
//! condition saying why (see [`crate::conditions`]). Under [`DeletionPolicy::Retain`] the
//! operator's Cleanup does nothing external and returns `Ok` at once. Cleanup runs on the API
//! server's copy, read just before it: a lagging cache's copy of an object whose cleanup is
//! already over (gone, or its finalizer removed) cleans up nothing a second time.

use std::fmt::Debug;
use std::future::Future;
use std::sync::Arc;

use kube::api::Api;
use kube::runtime::controller::Action;
use kube::{Resource, ResourceExt};
use schemars::JsonSchema;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

pub use kube::runtime::finalizer::Event;

/// What happens to external state (databases, namespaces, volumes) when the custom resource
/// is deleted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum DeletionPolicy {
    /// Keep it; only the finalizer is removed. A new object of the same name adopts it again.
    #[default]
    Retain,
    /// Delete it.
    Delete,
}

/// Why a finalizer-wrapped reconcile failed.
#[derive(Debug, thiserror::Error)]
pub enum Error<E: std::error::Error + 'static> {
    /// The operator's Apply step failed.
    #[error(transparent)]
    Apply(E),
    /// The operator's Cleanup step failed; the finalizer stays.
    #[error(transparent)]
    Cleanup(E),
    /// Adding the finalizer failed.
    #[error("failed to add the finalizer")]
    AddFinalizer(#[source] kube::Error),
    /// Reading the object before its cleanup failed (the cleanup did not run).
    #[error("failed to read the object before cleaning up")]
    ReadBeforeCleanup(#[source] kube::Error),
    /// Removing the finalizer failed.
    #[error("failed to remove the finalizer")]
    RemoveFinalizer(#[source] kube::Error),
    /// The object has no name.
    #[error("object has no name")]
    UnnamedObject,
    /// The finalizer name is invalid.
    #[error("invalid finalizer name")]
    InvalidFinalizer,
}

impl<E: crate::ReconcileError> crate::ReconcileError for Error<E> {
    fn reason(&self) -> &str {
        match self {
            Error::Apply(e) => e.reason(),
            Error::Cleanup(e) => e.reason(),
            Error::AddFinalizer(_) => "AddFinalizerFailed",
            Error::RemoveFinalizer(_) => "RemoveFinalizerFailed",
            Error::ReadBeforeCleanup(_) => "ReadFailed",
            Error::UnnamedObject | Error::InvalidFinalizer => "InvalidObject",
        }
    }

    fn is_permanent(&self) -> bool {
        matches!(self, Error::Apply(e) if e.is_permanent())
    }
}

/// Runs `reconcile` under finalizer `name` (kube-runtime's finalizer, with its JSON-patch
/// `test` guard against concurrent edits of the finalizer list). Adding or removing the
/// finalizer of an object that no longer exists is success (a stale copy's second Cleanup),
/// not an error.
///
/// # Errors
/// [`Error::Apply`] / [`Error::Cleanup`] carry the operator's error; the others are API failures.
pub async fn run<K, E, F, Fut>(
    api: &Api<K>,
    name: &str,
    obj: Arc<K>,
    reconcile: F,
) -> Result<Action, Error<E>>
where
    K: Resource + Clone + DeserializeOwned + Serialize + Debug,
    E: std::error::Error + Send + 'static,
    F: FnOnce(Event<K>) -> Fut,
    Fut: Future<Output = Result<Action, E>>,
{
    use kube::runtime::finalizer::Error as KubeErr;
    match kube::runtime::finalizer(api, name, obj, reconcile).await {
        // The object is gone, so is its finalizer. A reconcile of a stale copy (one still
        // carrying the finalizer another reconcile already removed, or one of an object
        // deleted before its finalizer was added) ends here: not a failure to report.
        Err(
            KubeErr::RemoveFinalizer(kube::Error::Api(s))
            | KubeErr::AddFinalizer(kube::Error::Api(s)),
        ) if s.is_not_found() => {
            return Ok(Action::await_change());
        }
        result => result,
    }
    .map_err(|e| match e {
        KubeErr::ApplyFailed(e) => Error::Apply(e),
        KubeErr::CleanupFailed(e) => Error::Cleanup(e),
        KubeErr::AddFinalizer(e) => Error::AddFinalizer(e),
        KubeErr::RemoveFinalizer(e) => Error::RemoveFinalizer(e),
        KubeErr::UnnamedObject => Error::UnnamedObject,
        KubeErr::InvalidFinalizer => Error::InvalidFinalizer,
    })
}

/// What a finalizer's cleanup achieved.
#[derive(Debug)]
pub enum Cleanup {
    /// Everything is cleaned up: the finalizer is removed and the object goes.
    Done,
    /// Not yet (a rollback under way, say): the finalizer stays and the object is reconciled
    /// again as `Action` says (or on its next change).
    Pending(Action),
}

/// The top-level reconcile of a kind with finalizer `name`: `apply` while `obj` lives (after
/// adding the finalizer), `cleanup` once it is being deleted, the finalizer removed when the
/// cleanup is [`Cleanup::Done`]. The `Api` is `obj`'s own (its namespace, or cluster-scoped).
///
/// # Errors
/// [`Error::Apply`] / [`Error::Cleanup`] carry the operator's error (a failed cleanup keeps
/// the finalizer); the others are API failures.
pub async fn dispatch<K, E, A, FA, C, FC>(
    client: &kube::Client,
    name: &str,
    obj: Arc<K>,
    apply: A,
    cleanup: C,
) -> Result<Action, Error<E>>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Serialize + Debug,
    K::Scope: crate::apply::ScopeApi,
    E: std::error::Error + Send + 'static,
    A: FnOnce(Arc<K>) -> FA,
    FA: Future<Output = Result<Action, E>>,
    C: FnOnce(Arc<K>) -> FC,
    FC: Future<Output = Result<Cleanup, E>>,
{
    use crate::apply::ScopeApi;
    let api = K::Scope::api::<K>(client.clone(), obj.namespace().as_deref());
    if is_deleting(obj.as_ref()) && has_finalizer(obj.as_ref(), name) {
        // The cache may lag: the copy in hand can be one whose cleanup another reconcile
        // already finished (its finalizer removed, the object gone, its children being
        // collected). A cleanup acts outside the cluster (drops, dumps, Jobs), so it runs only
        // on the server's own copy of this object, read now.
        let Some(obj) = still_cleaning(&api, name, &obj)
            .await
            .map_err(Error::ReadBeforeCleanup)?
        else {
            return Ok(Action::await_change());
        };
        if let Cleanup::Pending(action) = cleanup(obj.clone()).await.map_err(Error::Cleanup)? {
            return Ok(action);
        }
        // Cleaned up: kube-runtime's finalizer removes it (its cleanup has nothing left to do).
        return run(&api, name, obj, |_| async {
            Ok::<_, E>(Action::await_change())
        })
        .await;
    }
    run(&api, name, obj, |event| async move {
        match event {
            Event::Apply(obj) => apply(obj).await,
            // A deleted object without the finalizer: nothing of the operator's to clean up
            // (kube-runtime does not call this; kept total).
            Event::Cleanup(_) => Ok(Action::await_change()),
        }
    })
    .await
}

/// The server's copy of `obj` if it is still the same object (its uid), being deleted and
/// carrying finalizer `name`: what a cleanup may act on. `None` when the cleanup is over.
async fn still_cleaning<K>(api: &Api<K>, name: &str, obj: &K) -> Result<Option<Arc<K>>, kube::Error>
where
    K: Resource + Clone + DeserializeOwned + Debug,
{
    let fresh = api.get_opt(&obj.name_any()).await?;
    Ok(fresh
        .filter(|f| f.uid() == obj.uid() && is_deleting(f) && has_finalizer(f, name))
        .map(Arc::new))
}

/// Whether `obj` is being deleted.
pub fn is_deleting<K: Resource>(obj: &K) -> bool {
    obj.meta().deletion_timestamp.is_some()
}

/// Whether `obj` carries finalizer `name`.
pub fn has_finalizer<K: Resource>(obj: &K, name: &str) -> bool {
    obj.finalizers().iter().any(|f| f == name)
}
