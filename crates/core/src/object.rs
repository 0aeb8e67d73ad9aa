//! What every module agrees on about the objects Steward manages: the labels and annotations it
//! writes on them, and how to reach a kind of either scope ([`ScopeApi`]). It depends on no
//! other module of steward-core.

use std::fmt::Debug;

use kube::{Api, Client, Resource};
use serde::de::DeserializeOwned;

/// Label on every child, holding the owner's UID.
pub const OWNER_LABEL: &str = "steward.dev/owner-uid";
/// Label on every child, naming the operator that manages it.
pub const MANAGED_BY_LABEL: &str = "app.kubernetes.io/managed-by";
/// Annotation on every child: a digest of what this operator last applied, so
/// [`crate::apply::up_to_date`] can tell "as desired" from the object's metadata alone.
pub const APPLIED_ANNOTATION: &str = "steward.dev/applied";

/// The label carrying an object's shard number (decimal, `0..N`).
pub const SHARD_LABEL: &str = "steward.dev/shard";

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

/// A kind Steward's controllers and caches can watch: a typed Kubernetes object that can be
/// decoded, cloned and shared between tasks. Implemented for every such type.
pub trait Object:
    Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static
{
}

impl<K> Object for K where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static
{
}

/// A create that found the name taken (409 `AlreadyExists`) is done: `Ok(None)` (the object
/// exists, made by an earlier attempt of the same step, or by someone else: the caller decides
/// whether that matters); `Ok(Some(created))` otherwise; any other answer is passed on. For
/// creates that a retry may repeat.
///
/// # Errors
/// The request's error, unless the name was taken.
pub fn unless_exists<T>(result: Result<T, kube::Error>) -> Result<Option<T>, kube::Error> {
    match result {
        Ok(value) => Ok(Some(value)),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(None),
        Err(e) => Err(e),
    }
}

/// Whether the API server refused a request for good: invalid (422 `Invalid`, 400
/// `BadRequest`: a validation rule, a failed JSON patch test) or forbidden (403: the
/// ServiceAccount may not). Retrying the same request cannot help; the caller says why instead.
pub fn is_refusal(status: &kube::core::Status) -> bool {
    status.is_invalid() || status.is_forbidden() || status.code == 400
}

/// A request about an object that turned out to be gone (404) is done: `Ok(None)`; any other
/// answer is passed on. For deletes, and patches of objects that may have gone meanwhile.
///
/// # Errors
/// The request's error, unless it is "not found".
pub fn unless_gone<T>(result: Result<T, kube::Error>) -> Result<Option<T>, kube::Error> {
    match result {
        Ok(value) => Ok(Some(value)),
        Err(kube::Error::Api(s)) if s.is_not_found() => Ok(None),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(code: u16, reason: &str) -> kube::core::Status {
        kube::core::Status::failure("refused", reason).with_code(code)
    }

    #[test]
    fn invalid_bad_and_forbidden_requests_are_refusals_conflicts_and_outages_are_not() {
        assert!(is_refusal(&status(422, "Invalid")));
        assert!(is_refusal(&status(400, "BadRequest")));
        assert!(is_refusal(&status(403, "Forbidden")));
        assert!(!is_refusal(&status(409, "Conflict")));
        assert!(!is_refusal(&status(409, "AlreadyExists")));
        assert!(!is_refusal(&status(404, "NotFound")));
        assert!(!is_refusal(&status(503, "ServiceUnavailable")));
        assert!(!is_refusal(&status(500, "InternalError")));
    }
}
