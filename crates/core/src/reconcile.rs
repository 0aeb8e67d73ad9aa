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
//! # Caveats
//! Pruning children the plan no longer names, Events and external actions (SQL, Lease
//! requests) are still the operator's.

use std::fmt::Debug;
use std::time::Duration;

use futures::future::BoxFuture;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::Resource;
use kube::runtime::controller::Action;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::ReconcileError;
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
    status: S,
    requeue: Option<Duration>,
}

impl<S> Plan<S> {
    /// A plan that writes `status` and applies no child.
    pub fn new(status: S) -> Self {
        Self {
            children: Vec::new(),
            status,
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
        self.children.push(Box::new(Cached {
            cache: cache.clone(),
            desired,
        }));
        self
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
    /// The status could not be written.
    #[error("failed to write the status")]
    WriteStatus(#[source] crate::Error),
}

impl ReconcileError for Error {
    fn reason(&self) -> &str {
        match self {
            Error::ApplyChild(_) => "ApplyFailed",
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
    let mut status = plan.status;
    if let Some(e) = &failed {
        crate::conditions::failed(status.conditions_mut(), e, obj.meta().generation);
    }
    ctx.apply_status(obj, current, &status)
        .await
        .map_err(Error::WriteStatus)?;
    match failed {
        Some(e) => Err(e),
        None => Ok(plan
            .requeue
            .map_or_else(Action::await_change, Action::requeue)),
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
