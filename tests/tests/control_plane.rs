//! What the real API server does, as Steward's operators rely on it: structural schemas,
//! finalizers, garbage collection, namespace deletion, workload controllers with kwok nodes,
//! RBAC and optimistic concurrency.

use std::time::Duration;

use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::{CustomResource, CustomResourceExt, Resource};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::json;
use steward_testenv::eventually;

/// A throwaway custom resource for these tests.
#[derive(CustomResource, Clone, Debug, Deserialize, Serialize, JsonSchema)]
#[kube(
    group = "testenv.steward.dev",
    version = "v1",
    kind = "Widget",
    namespaced
)]
pub struct WidgetSpec {
    /// Between 1 and 9.
    #[schemars(range(min = 1, max = 9))]
    pub size: i32,
}

const WAIT: Duration = Duration::from_secs(60);

async fn widgets(prefix: &str) -> (Api<Widget>, kube::Client, String) {
    let cp = steward_testenv::shared().await.expect("control plane");
    cp.apply_crd(&Widget::crd())
        .await
        .expect("install Widget CRD");
    let ns = cp.namespace(prefix).await.expect("namespace");
    let client = cp.client().expect("client");
    (Api::namespaced(client.clone(), &ns), client, ns)
}

fn widget(name: &str, size: i32) -> Widget {
    Widget::new(name, WidgetSpec { size })
}

fn api_error_code(err: &kube::Error) -> Option<u16> {
    match err {
        kube::Error::Api(status) => Some(status.code),
        _ => None,
    }
}

#[tokio::test]
async fn crd_becomes_established_and_schema_rejects_bad_objects() {
    let (api, _, _) = widgets("schema").await;
    api.create(&PostParams::default(), &widget("good", 3))
        .await
        .expect("create");
    let back = api.get("good").await.expect("read back");
    assert_eq!(back.spec.size, 3);

    let err = api
        .create(&PostParams::default(), &widget("bad", 42))
        .await
        .expect_err("size 42 must be rejected");
    assert_eq!(api_error_code(&err), Some(422), "{err}");
    assert!(
        err.to_string().contains("spec.size"),
        "the error names the field: {err}"
    );
}

#[tokio::test]
async fn finalizer_holds_deletion_until_removed() {
    let (api, _, _) = widgets("finalizer").await;
    let mut w = widget("held", 1);
    w.meta_mut().finalizers = Some(vec!["testenv.steward.dev/hold".into()]);
    api.create(&PostParams::default(), &w)
        .await
        .expect("create");
    api.delete("held", &DeleteParams::default())
        .await
        .expect("delete");

    let held = api.get("held").await.expect("still there");
    assert!(
        held.metadata.deletion_timestamp.is_some(),
        "deletionTimestamp is set"
    );

    api.patch(
        "held",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"finalizers": null}})),
    )
    .await
    .expect("remove finalizer");
    eventually("held widget gone", WAIT, || async {
        match api.get_opt("held").await {
            Ok(None) => Ok(()),
            Ok(Some(_)) => Err("still present".to_string()),
            Err(e) => Err(e.to_string()),
        }
    })
    .await
    .expect("gone after the finalizer is removed");
}

#[tokio::test]
async fn owned_configmap_is_garbage_collected() {
    let (api, client, ns) = widgets("gc").await;
    let owner = api
        .create(&PostParams::default(), &widget("owner", 1))
        .await
        .expect("create owner");
    let cms: Api<ConfigMap> = Api::namespaced(client, &ns);
    let cm: ConfigMap = serde_json::from_value(json!({
        "metadata": {"name": "owned", "ownerReferences": [owner.controller_owner_ref(&()).expect("owner ref")]},
        "data": {"k": "v"}
    }))
    .expect("configmap");
    cms.create(&PostParams::default(), &cm)
        .await
        .expect("create configmap");
    api.delete("owner", &DeleteParams::background())
        .await
        .expect("delete owner");
    eventually("owned ConfigMap garbage-collected", WAIT, || async {
        match cms.get_opt("owned").await {
            Ok(None) => Ok(()),
            Ok(Some(_)) => Err("ConfigMap still present".to_string()),
            Err(e) => Err(e.to_string()),
        }
    })
    .await
    .expect("the garbage collector removes it");
}

#[tokio::test]
async fn namespace_with_objects_goes_away() {
    let (api, client, ns) = widgets("nsdelete").await;
    api.create(&PostParams::default(), &widget("inside", 1))
        .await
        .expect("create widget");
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
    cms.create(
        &PostParams::default(),
        &serde_json::from_value(json!({"metadata": {"name": "c"}})).expect("cm"),
    )
    .await
    .expect("create configmap");
    let namespaces: Api<Namespace> = Api::all(client);
    namespaces
        .delete(&ns, &DeleteParams::default())
        .await
        .expect("delete namespace");
    eventually("namespace deleted", WAIT, || async {
        match namespaces.get_opt(&ns).await {
            Ok(None) => Ok(()),
            Ok(Some(n)) => Err(format!("phase {:?}", n.status.and_then(|s| s.phase))),
            Err(e) => Err(e.to_string()),
        }
    })
    .await
    .expect("the namespace controller empties and removes it");
}

#[tokio::test]
async fn deployment_and_statefulset_become_ready_on_kwok_nodes() {
    let cp = steward_testenv::shared().await.expect("control plane");
    let ns = cp.namespace("workloads").await.expect("namespace");
    let client = cp.client().expect("client");
    let template = json!({
        "metadata": {"labels": {"app": "web"}},
        "spec": {"containers": [{"name": "web", "image": "example.invalid/web:1"}]}
    });
    let deploy: Deployment = serde_json::from_value(json!({
        "metadata": {"name": "web"},
        "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "web"}}, "template": template}
    }))
    .expect("deployment");
    let sts: StatefulSet = serde_json::from_value(json!({
        "metadata": {"name": "db"},
        "spec": {"replicas": 2, "serviceName": "db", "selector": {"matchLabels": {"app": "web"}}, "template": template}
    }))
    .expect("statefulset");
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    let statefulsets: Api<StatefulSet> = Api::namespaced(client, &ns);
    deployments
        .create(&PostParams::default(), &deploy)
        .await
        .expect("create deployment");
    statefulsets
        .create(&PostParams::default(), &sts)
        .await
        .expect("create statefulset");

    eventually("Deployment availableReplicas == 2", WAIT, || async {
        let d = deployments.get("web").await.map_err(|e| e.to_string())?;
        let available = d.status.and_then(|s| s.available_replicas).unwrap_or(0);
        if available == 2 {
            Ok(())
        } else {
            Err(format!("availableReplicas {available}"))
        }
    })
    .await
    .expect("deployment available");
    eventually("StatefulSet readyReplicas == 2", WAIT, || async {
        let s = statefulsets.get("db").await.map_err(|e| e.to_string())?;
        let ready = s.status.and_then(|s| s.ready_replicas).unwrap_or(0);
        if ready == 2 {
            Ok(())
        } else {
            Err(format!("readyReplicas {ready}"))
        }
    })
    .await
    .expect("statefulset ready");
}

#[tokio::test]
async fn service_account_is_denied_until_bound() {
    let cp = steward_testenv::shared().await.expect("control plane");
    let ns = cp.namespace("rbac").await.expect("namespace");
    let sa_client = cp
        .service_account_client(&ns, "reader")
        .await
        .expect("sa client");
    let as_sa: Api<ConfigMap> = Api::namespaced(sa_client, &ns);
    let err = as_sa
        .list(&Default::default())
        .await
        .expect_err("no rights yet");
    assert_eq!(api_error_code(&err), Some(403), "{err}");

    let admin = cp.client().expect("client");
    let role: Role = serde_json::from_value(json!({
        "metadata": {"name": "cm-reader"},
        "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list"]}]
    }))
    .expect("role");
    let binding: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "cm-reader"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "cm-reader"},
        "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": ns}]
    }))
    .expect("rolebinding");
    Api::<Role>::namespaced(admin.clone(), &ns)
        .create(&PostParams::default(), &role)
        .await
        .expect("role");
    Api::<RoleBinding>::namespaced(admin, &ns)
        .create(&PostParams::default(), &binding)
        .await
        .expect("binding");
    // RBAC is evaluated from an informer cache in the API server: allow it a moment.
    eventually("list allowed after the RoleBinding", WAIT, || async {
        as_sa
            .list(&Default::default())
            .await
            .map(|_| ())
            .map_err(|e| e.to_string())
    })
    .await
    .expect("the same call succeeds once bound");

    let impersonated: Api<ConfigMap> = Api::namespaced(
        cp.impersonating_client("mallory", &["outsiders"])
            .expect("impersonate"),
        &ns,
    );
    let err = impersonated
        .list(&Default::default())
        .await
        .expect_err("mallory has no rights");
    assert_eq!(api_error_code(&err), Some(403), "{err}");
}

#[tokio::test]
async fn same_resource_version_twice_conflicts_once() {
    let (api, _, _) = widgets("conflict").await;
    let created = api
        .create(&PostParams::default(), &widget("racy", 1))
        .await
        .expect("create");
    let mut first = created.clone();
    first.spec.size = 2;
    let mut second = created;
    second.spec.size = 3;
    let a = api.replace("racy", &PostParams::default(), &first).await;
    let b = api.replace("racy", &PostParams::default(), &second).await;
    assert!(a.is_ok(), "the first update wins: {a:?}");
    let err = b.expect_err("the second update with the same resourceVersion fails");
    assert_eq!(api_error_code(&err), Some(409), "{err}");
    assert_eq!(api.get("racy").await.expect("get").spec.size, 2);
}
