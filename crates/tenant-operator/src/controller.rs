//! Wiring: the Tenant controller, label-scoped watches of everything it makes, and the stores
//! the reconciler reads instead of the API server.
//!
//! Every child is watched through a reflector with a label selector
//! (`tenancy.steward.dev/tenant`, or `tenancy.steward.dev/shareable=true` for shared sources),
//! so the operator never caches unrelated Secrets, ConfigMaps or RoleBindings. A child's event
//! is mapped to its Tenant by that label, after the store saw it, so a reconcile never reads
//! a store older than its trigger.

use std::fmt::Debug;
use std::time::Duration;

use futures::Stream;
use k8s_openapi::api::core::v1::{ConfigMap, LimitRange, Namespace, ResourceQuota, Secret};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, RoleBinding};
use kube::api::Api;
use kube::runtime::reflector::{self, ObjectRef, Store, reflector};
use kube::runtime::{Controller, WatchStreamExt, watcher};
use kube::{Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;

use crate::build::Settings;
use crate::crd::{SHAREABLE_LABEL, SharedKind, TENANT_LABEL, Tenant};

/// Read-only caches of the Tenants and everything the operator makes or copies.
#[derive(Clone)]
pub struct Stores {
    pub tenants: Store<Tenant>,
    pub namespaces: Store<Namespace>,
    pub quotas: Store<ResourceQuota>,
    pub limit_ranges: Store<LimitRange>,
    pub network_policies: Store<NetworkPolicy>,
    pub role_bindings: Store<RoleBinding>,
    pub cluster_roles: Store<ClusterRole>,
    pub cluster_role_bindings: Store<ClusterRoleBinding>,
    /// Shared copies (labelled with their tenant).
    pub secrets: Store<Secret>,
    pub config_maps: Store<ConfigMap>,
    /// Shared sources (labelled shareable).
    pub source_secrets: Store<Secret>,
    pub source_config_maps: Store<ConfigMap>,
}

impl Stores {
    /// Waits until every store has its initial list. `false` if a store's watch ended.
    pub async fn ready(&self) -> bool {
        let results = futures::join!(
            self.tenants.wait_until_ready(),
            self.namespaces.wait_until_ready(),
            self.quotas.wait_until_ready(),
            self.limit_ranges.wait_until_ready(),
            self.network_policies.wait_until_ready(),
            self.role_bindings.wait_until_ready(),
            self.cluster_roles.wait_until_ready(),
            self.cluster_role_bindings.wait_until_ready(),
            self.secrets.wait_until_ready(),
            self.config_maps.wait_until_ready(),
            self.source_secrets.wait_until_ready(),
            self.source_config_maps.wait_until_ready(),
        );
        results.0.is_ok()
            && results.1.is_ok()
            && results.2.is_ok()
            && results.3.is_ok()
            && results.4.is_ok()
            && results.5.is_ok()
            && results.6.is_ok()
            && results.7.is_ok()
            && results.8.is_ok()
            && results.9.is_ok()
            && results.10.is_ok()
            && results.11.is_ok()
    }
}

/// What every reconcile shares.
pub struct State {
    pub stores: Stores,
    pub settings: Settings,
    /// Requeue interval without changes.
    pub resync: Duration,
    /// Counts the writes to managed objects.
    pub writes: crate::apply::Writes,
}

type Trigger<K> = std::pin::Pin<Box<dyn Stream<Item = Result<K, watcher::Error>> + Send>>;

/// A reflector over `api` limited by `labels`: its store and the stream of touched objects
/// (applied or deleted) that drives it.
fn reflect<K>(api: Api<K>, labels: &str) -> (Store<K>, Trigger<K>)
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
{
    let (reader, writer) = reflector::store();
    let stream = reflector(writer, watcher(api, watcher::Config::default().labels(labels).any_semantic()))
        .default_backoff()
        .touched_objects();
    (reader, Box::pin(stream))
}

fn by_tenant_label<K: Resource>(obj: K) -> Option<ObjectRef<Tenant>> {
    obj.labels().get(TENANT_LABEL).map(|t| ObjectRef::new(t))
}

/// Builds the Tenant controller with all its watches, and the stores it reads.
pub fn build(client: Client, tenant_selector: Option<&str>) -> (Controller<Tenant>, Stores) {
    let mut tenant_config = watcher::Config::default().any_semantic();
    if let Some(sel) = tenant_selector {
        tenant_config = tenant_config.labels(sel);
    }
    let controller = Controller::new(Api::<Tenant>::all(client.clone()), tenant_config);
    let tenants = controller.store();
    let has_tenant = TENANT_LABEL;
    let shareable = format!("{SHAREABLE_LABEL}=true");

    let (namespaces, ns_stream) = reflect(Api::<Namespace>::all(client.clone()), has_tenant);
    let (quotas, rq_stream) = reflect(Api::<ResourceQuota>::all(client.clone()), has_tenant);
    let (limit_ranges, lr_stream) = reflect(Api::<LimitRange>::all(client.clone()), has_tenant);
    let (network_policies, np_stream) = reflect(Api::<NetworkPolicy>::all(client.clone()), has_tenant);
    let (role_bindings, rb_stream) = reflect(Api::<RoleBinding>::all(client.clone()), has_tenant);
    let (cluster_roles, cr_stream) = reflect(Api::<ClusterRole>::all(client.clone()), has_tenant);
    let (cluster_role_bindings, crb_stream) = reflect(Api::<ClusterRoleBinding>::all(client.clone()), has_tenant);
    let (secrets, secret_stream) = reflect(Api::<Secret>::all(client.clone()), has_tenant);
    let (config_maps, cm_stream) = reflect(Api::<ConfigMap>::all(client.clone()), has_tenant);
    let (source_secrets, src_secret_stream) = reflect(Api::<Secret>::all(client.clone()), &shareable);
    let (source_config_maps, src_cm_stream) = reflect(Api::<ConfigMap>::all(client), &shareable);

    let sharing = |kind: SharedKind, tenants: Store<Tenant>| {
        move |obj: ObjectRefParts| {
            tenants
                .state()
                .into_iter()
                .filter(|t| {
                    t.spec
                        .shared_objects
                        .iter()
                        .any(|s| s.kind == kind && s.namespace == obj.namespace && s.name == obj.name)
                })
                .map(|t| ObjectRef::from_obj(t.as_ref()))
                .collect::<Vec<_>>()
        }
    };
    let secret_sharing = sharing(SharedKind::Secret, tenants.clone());
    let cm_sharing = sharing(SharedKind::ConfigMap, tenants.clone());

    let controller = controller
        .watches_stream(ns_stream, by_tenant_label)
        .watches_stream(rq_stream, by_tenant_label)
        .watches_stream(lr_stream, by_tenant_label)
        .watches_stream(np_stream, by_tenant_label)
        .watches_stream(rb_stream, by_tenant_label)
        .watches_stream(cr_stream, by_tenant_label)
        .watches_stream(crb_stream, by_tenant_label)
        .watches_stream(secret_stream, by_tenant_label)
        .watches_stream(cm_stream, by_tenant_label)
        .watches_stream(src_secret_stream, move |s: Secret| secret_sharing(ObjectRefParts::of(&s)))
        .watches_stream(src_cm_stream, move |c: ConfigMap| cm_sharing(ObjectRefParts::of(&c)));

    let stores = Stores {
        tenants,
        namespaces,
        quotas,
        limit_ranges,
        network_policies,
        role_bindings,
        cluster_roles,
        cluster_role_bindings,
        secrets,
        config_maps,
        source_secrets,
        source_config_maps,
    };
    (controller, stores)
}

/// Namespace and name of a shared source.
struct ObjectRefParts {
    namespace: String,
    name: String,
}

impl ObjectRefParts {
    fn of<K: Resource>(obj: &K) -> Self {
        Self { namespace: obj.namespace().unwrap_or_default(), name: obj.name_any() }
    }
}
