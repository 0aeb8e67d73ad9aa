//! The reconcile contract: *observe* (reads, from caches or the API) → *decide* (pure: returns
//! a [`Plan`]) → *execute* ([`execute`], here).
//!
//! ```no_run
//! # use std::sync::Arc;
//! # use k8s_openapi::api::core::v1::ConfigMap;
//! # use steward_core::controller::Cache;
//! # use steward_core::reconcile::{self, Plan};
//! # #[derive(Clone, Default, PartialEq, serde::Serialize)] struct Status { conditions: Vec<k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition> }
//! # impl reconcile::Conditions for Status { fn conditions_mut(&mut self) -> &mut Vec<k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition> { &mut self.conditions } }
//! # fn build(_: &ConfigMap) -> ConfigMap { ConfigMap::default() }
//! # async fn f(ctx: &steward_core::Context<()>, obj: Arc<ConfigMap>, cache: &Cache<kube::core::PartialObjectMeta<ConfigMap>>, current: Option<&Status>) -> Result<(), reconcile::Error> {
//! // decide: pure, unit-tested without a cluster
//! let plan = Plan::new(Status::default()).child(cache, build(&obj));
//! // execute: the children in order, then the one status write
//! reconcile::execute(ctx, obj.as_ref(), current, plan).await?;
//! # Ok(()) }
//! ```
//!
//! # Guarantees
//! - The children are applied in the order the plan names them, each only if its cached copy
//!   differs ([`crate::apply::Children::ensure_cached`]); the first that fails stops the rest
//!   (a later child may need an earlier one).
//! - The status is written once, after the children, whatever happened: when a child failed,
//!   its `Ready` condition is `False` with the failure's reason and message, so the object says
//!   why; the error then goes back to the runtime (a Warning Event, a retry with backoff).
//! - The write is the resourceVersion-guarded, skipped-when-unchanged write of
//!   [`crate::Context::apply_status`].
//!
//! - Once every child applied, the owner's children among the caches the plan prunes
//!   ([`Plan::prune_among`]) that the plan does not name (its children and [`Plan::keep`]) are
//!   deleted ([`Prune`], the way Stackable's `ClusterResources` deletes orphans). A failed
//!   child prunes nothing: a later child's old copy may still be what serves.
//!
//! - The Events the plan wants ([`Plan::event`]) are published after the status write went
//!   through, so an Event never announces what the status does not show; a failed child or
//!   status write publishes none (the runtime's Warning Event says why).
//!
//! # Caveats
//! External actions (SQL, Lease requests) are still the operator's. An operator
//! that applies in steps of its own uses [`Prune`] with the [`Kept`] set its decide step
//! built.

use std::collections::BTreeSet;
use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::Resource;
use kube::runtime::controller::Action;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::ReconcileError;
pub use crate::apply::Kept;
use crate::apply::{Children, Outcome};
use crate::cache::Cache;
use crate::object::ScopeApi;

/// A child a [`Plan`] can apply: a typed object sent by server-side apply.
pub trait Child:
    Resource<DynamicType = ()> + Clone + Serialize + DeserializeOwned + Debug + Send + Sync + 'static
{
}

impl<K> Child for K where
    K: Resource<DynamicType = ()>
        + Clone
        + Serialize
        + DeserializeOwned
        + Debug
        + Send
        + Sync
        + 'static
{
}

/// A status with conditions, so [`execute`] can say in it why a reconcile failed.
pub trait Conditions {
    /// The status's conditions.
    fn conditions_mut(&mut self) -> &mut Vec<Condition>;
}

/// What a reconcile's decide step wants done: the children to apply, in order, the status to
/// write, and when to reconcile again.
#[must_use]
pub struct Plan<S> {
    children: Vec<Box<dyn Wanted>>,
    prune: Prune,
    status: S,
    events: Vec<crate::events::Wanted>,
    requeue: Option<Duration>,
}

impl<S> Plan<S> {
    /// A plan that writes `status` and applies no child.
    pub fn new(status: S) -> Self {
        Self {
            children: Vec::new(),
            prune: Prune::new(Kept::default()),
            status,
            events: Vec::new(),
            requeue: None,
        }
    }

    /// Then applies `desired`, compared first with its copy in `cache` (of its kind, or of its
    /// metadata).
    pub fn child<K, C>(mut self, cache: &Cache<C>, desired: K) -> Self
    where
        K: Child,
        K::Scope: ScopeApi,
        C: Resource<DynamicType = ()> + Clone + Send + Sync + 'static,
    {
        self.prune.kept.insert(&desired);
        self.children.push(Box::new(Cached {
            cache: cache.clone(),
            desired,
        }));
        self
    }

    /// Keeps `obj` from pruning without applying it (a child the plan holds back, as it is).
    pub fn keep<K: Resource<DynamicType = ()>>(mut self, obj: &K) -> Self {
        self.prune.kept.insert(obj);
        self
    }

    /// Once every child applied, deletes the owner's children among `cached` (of one kind:
    /// a cache's objects, or those an [`crate::index::Indexed`] finds by label) that the plan
    /// does not name.
    pub fn prune_among<K>(mut self, cached: impl IntoIterator<Item = Arc<K>>) -> Self
    where
        K: Child,
        K::Scope: ScopeApi,
    {
        self.prune = self.prune.among(cached);
        self
    }

    /// What the plan keeps from pruning: its children and what it [`Plan::keep`]s.
    pub fn kept(&self) -> &Kept {
        &self.prune.kept
    }

    /// Publishes `event` once the status is written.
    pub fn event(mut self, event: crate::events::Wanted) -> Self {
        self.events.push(event);
        self
    }

    /// The Events the plan publishes, in order (for unit tests of decide functions).
    pub fn events(&self) -> &[crate::events::Wanted] {
        &self.events
    }

    /// Reconciles again after `after` even if nothing changes (otherwise only on a change).
    pub fn requeue_after(mut self, after: Duration) -> Self {
        self.requeue = Some(after);
        self
    }

    /// The status the plan writes when every child applies.
    pub fn status(&self) -> &S {
        &self.status
    }

    /// The children of kind `K` the plan applies, in order (for unit tests of decide
    /// functions).
    pub fn wanted<K: 'static>(&self) -> Vec<&K> {
        self.children
            .iter()
            .filter_map(|c| c.desired().downcast_ref::<K>())
            .collect()
    }

    /// How many children the plan applies.
    pub fn children(&self) -> usize {
        self.children.len()
    }
}

/// Why [`execute`] failed, named after the step.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A child could not be applied (the status says so).
    #[error(transparent)]
    ApplyChild(crate::Error),
    /// A child no longer wanted could not be deleted (the status says so).
    #[error(transparent)]
    Prune(crate::Error),
    /// The status could not be written.
    #[error("failed to write the status")]
    WriteStatus(#[source] crate::Error),
}

impl ReconcileError for Error {
    fn reason(&self) -> &str {
        match self {
            Error::ApplyChild(_) => "ApplyFailed",
            Error::Prune(_) => "PruneFailed",
            Error::WriteStatus(_) => "StatusFailed",
        }
    }
}

/// Executes `plan` for `obj`, whose status is `current` now: the children in order (stopping
/// at the first failure), then the one status write, with `Ready=False` saying why when a child
/// failed.
///
/// # Errors
/// [`Error::ApplyChild`] (after the status says it), [`Error::WriteStatus`].
pub async fn execute<K, S, D>(
    ctx: &crate::Context<D>,
    obj: &K,
    current: Option<&S>,
    plan: Plan<S>,
) -> Result<Action, Error>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug,
    K::Scope: ScopeApi,
    S: Serialize + PartialEq + Conditions,
{
    let children = ctx.children(obj);
    let mut failed = None;
    for child in plan.children {
        if let Err(e) = child.apply(&children).await {
            failed = Some(Error::ApplyChild(e));
            break;
        }
    }
    if failed.is_none()
        && let Err(e) = plan.prune.run(&children).await
    {
        failed = Some(Error::Prune(e));
    }
    let mut status = plan.status;
    if let Some(e) = &failed {
        crate::conditions::failed(status.conditions_mut(), e, obj.meta().generation);
    }
    ctx.apply_status(obj, current, &status)
        .await
        .map_err(Error::WriteStatus)?;
    if failed.is_none() {
        for event in plan.events {
            ctx.recorder.emit(obj, event).await;
        }
    }
    match failed {
        Some(e) => Err(e),
        None => Ok(plan
            .requeue
            .map_or_else(Action::await_change, Action::requeue)),
    }
}

/// Deletes an owner's children that a [`Kept`] set does not name, among the cached objects of
/// each kind it is given.
///
/// # Guarantees
/// Only the owner's children ([`Children::is_child`]) are deleted, never one being deleted
/// already nor one in a spared namespace; kinds are pruned in the order given (e.g. the
/// objects before the access that lets the operator reach them).
#[must_use]
pub struct Prune {
    kept: Kept,
    spared: BTreeSet<String>,
    among: Vec<Box<dyn Among>>,
}

impl Prune {
    /// Prunes what `kept` does not name.
    pub fn new(kept: Kept) -> Self {
        Self {
            kept,
            spared: BTreeSet::new(),
            among: Vec::new(),
        }
    }

    /// Among `cached` (objects of one kind), too.
    pub fn among<K>(mut self, cached: impl IntoIterator<Item = Arc<K>>) -> Self
    where
        K: Child,
        K::Scope: ScopeApi,
    {
        self.among
            .push(Box::new(cached.into_iter().collect::<Vec<_>>()));
        self
    }

    /// Leaves alone the children in `namespaces` (namespaces being deleted: their objects go
    /// with them).
    pub fn sparing(mut self, namespaces: BTreeSet<String>) -> Self {
        self.spared = namespaces;
        self
    }

    /// Deletes the children not kept; returns how many.
    ///
    /// # Errors
    /// The first delete that fails ([`crate::Error::PruneChild`]).
    pub async fn run(self, children: &Children) -> Result<usize, crate::Error> {
        let mut deleted = 0;
        for among in self.among {
            deleted += among.prune(children, &self.kept, &self.spared).await?;
        }
        Ok(deleted)
    }
}

/// The cached objects of one kind a [`Prune`] looks among.
trait Among: Send + Sync {
    fn prune<'a>(
        self: Box<Self>,
        children: &'a Children,
        kept: &'a Kept,
        spared: &'a BTreeSet<String>,
    ) -> BoxFuture<'a, Result<usize, crate::Error>>;
}

impl<K> Among for Vec<Arc<K>>
where
    K: Child,
    K::Scope: ScopeApi,
{
    fn prune<'a>(
        self: Box<Self>,
        children: &'a Children,
        kept: &'a Kept,
        spared: &'a BTreeSet<String>,
    ) -> BoxFuture<'a, Result<usize, crate::Error>> {
        Box::pin(async move {
            let spare = |obj: &K| {
                obj.meta()
                    .namespace
                    .as_ref()
                    .is_some_and(|ns| spared.contains(ns))
            };
            Ok(children.prune_unkept(*self, kept, spare).await?.len())
        })
    }
}

/// A child a [`Plan`] applies.
trait Wanted: Send + Sync {
    fn desired(&self) -> &dyn std::any::Any;

    fn apply<'a>(
        self: Box<Self>,
        children: &'a Children,
    ) -> BoxFuture<'a, Result<Outcome, crate::Error>>;
}

/// A child compared with its copy in a cache before it is applied.
struct Cached<K, C: Resource<DynamicType = ()> + 'static> {
    cache: Cache<C>,
    desired: K,
}

impl<K, C> Wanted for Cached<K, C>
where
    K: Child,
    K::Scope: ScopeApi,
    C: Resource<DynamicType = ()> + Clone + Send + Sync + 'static,
{
    fn desired(&self) -> &dyn std::any::Any {
        &self.desired
    }

    fn apply<'a>(
        self: Box<Self>,
        children: &'a Children,
    ) -> BoxFuture<'a, Result<Outcome, crate::Error>> {
        Box::pin(async move { children.ensure_cached(&self.cache, self.desired).await })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ConfigMap;
    use k8s_openapi::api::rbac::v1::RoleBinding;

    fn named<K: Resource<DynamicType = ()> + Default>(ns: &str, name: &str) -> K {
        let mut obj = K::default();
        obj.meta_mut().namespace = Some(ns.into());
        obj.meta_mut().name = Some(name.into());
        obj
    }

    /// A plan keeps from pruning exactly what it names: the children it applies and those it
    /// holds back; a child it stops naming is no longer kept.
    #[test]
    fn a_plan_keeps_what_it_names() {
        let cache: Cache<ConfigMap> = Cache::unfilled();
        let held: RoleBinding = named("n", "owners");
        let plan = Plan::new(())
            .child(&cache, named::<ConfigMap>("n", "settings"))
            .keep(&held)
            .prune_among(Vec::<Arc<ConfigMap>>::new())
            .event(crate::events::Wanted::normal(
                "Applied", "Apply", "settings",
            ));
        assert_eq!(plan.events()[0].reason, "Applied");
        assert!(plan.kept().contains(&named::<ConfigMap>("n", "settings")));
        assert!(plan.kept().contains(&held));
        assert!(!plan.kept().contains(&named::<ConfigMap>("n", "old")));
        assert!(!plan.kept().contains(&named::<RoleBinding>("n", "settings")));
        assert_eq!(plan.kept().len(), 2);
        assert_eq!(plan.children(), 1);
    }
}
