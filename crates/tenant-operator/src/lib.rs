//! Placeholder: the operator's CRDs and reconcile logic land with its own issue.

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;

/// Every CustomResourceDefinition this operator owns, for `cargo xtask crdgen`.
pub fn crds() -> Vec<CustomResourceDefinition> {
    Vec::new()
}
