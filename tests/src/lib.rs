//! Integration tests for Steward, run against a real control plane started by
//! [`steward_testenv`]. The tests live in `tests/tests/*.rs`; run them with `cargo xtask test`.

use k8s_openapi::api::apps::v1::Deployment;
use serde_json::json;

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
