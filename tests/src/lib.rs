//! Integration tests for Steward, run against a real control plane started by
//! `steward_testenv`. The tests live in `tests/tests/*.rs`; run them with `cargo xtask test`.

use k8s_openapi::api::apps::v1::Deployment;
use serde_json::json;
use steward_core::Operator;
use steward_core::cli::CommonArgs;
use tenant_operator::Tenant;

/// A Deployment of `replicas` pods with one container `app` running `image` (kwok makes its
/// pods Ready whatever the image), labelled and selected by `app: <name>`.
///
/// # Panics
/// Never for a valid name: the object is fixed but for the name and image.
pub fn deployment(name: &str, image: &str, replicas: i32) -> Deployment {
    serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {"containers": [{"name": "app", "image": image}], "terminationGracePeriodSeconds": 0}
            }
        }
    }))
    .expect("a Deployment")
}

/// The label that ties a test's Tenants to its own tenant-operator.
pub const TEST_LABEL: &str = "steward.dev/test";

/// A tenant-operator (not yet started) with `args`, reconciling only the Tenants labelled
/// `steward.dev/test=<id>`, so tests sharing a control plane leave each other's alone.
///
/// # Errors
/// When the operator cannot be built or registered.
pub fn tenant_operator(
    args: CommonArgs,
    config: kube::Config,
    id: &str,
) -> anyhow::Result<Operator> {
    let mut op = Operator::with_config(tenant_operator::NAME, args, config)?;
    let options = tenant_operator::Options {
        tenant_selector: Some(format!("{TEST_LABEL}={id}")),
        ..tenant_operator::Options::default()
    };
    tenant_operator::register(&mut op, options)?;
    Ok(op)
}

/// Tenant `<id>-team`, labelled for [`tenant_operator()`]`(…, id)`, owned by user alice, with
/// one namespace `<id>-a`.
///
/// # Panics
/// Never: the object is fixed but for the names.
pub fn tenant(id: &str) -> Tenant {
    serde_json::from_value(json!({
        "apiVersion": "tenancy.steward.dev/v1alpha1", "kind": "Tenant",
        "metadata": {"name": format!("{id}-team"), "labels": {TEST_LABEL: id}},
        "spec": {"owners": [{"kind": "User", "name": "alice"}], "namespaces": [format!("{id}-a")]},
    }))
    .expect("a Tenant")
}
