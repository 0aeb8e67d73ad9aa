//! Wiring: the Tenant controller, label-scoped watches of everything it makes, and the stores
//! the reconciler reads instead of the API server.
//!
//! Every child is watched through a reflector with a label selector
//! (`tenancy.steward.dev/tenant`), so the operator never caches unrelated objects. A child's
//! event is mapped to its Tenant by that label, after the store saw it, so a reconcile never
//! reads a store older than its trigger. The children whose content no reconcile reads
//! (Namespaces, LimitRanges, NetworkPolicies, RoleBindings, ClusterRoles, ClusterRoleBindings:
//! all but the ResourceQuotas and the operator's access Roles) are watched
//! as metadata only: the write-skip and the prune judge a child by its metadata (its digest and
//! the operator's `managedFields` entry), so their specs would be memory held for nothing.
//!
//! Secrets and ConfigMaps are the exception: the operator may not read them cluster-wide.
//! Shared sources are watched only in the shared namespaces (`--shared-namespace`, label
//! `tenancy.steward.dev/shareable=true`), where its deployment grants it a Role; its copies
//! (and the policy parameters) are read by name, through the Role it grants itself in each
//! tenant namespace (see `build::access_role`).

use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{ConfigMap, LimitRange, Namespace, ResourceQuota, Secret};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use kube::api::Api;
use kube::core::PartialObjectMeta;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use kube::{Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use steward_core::Controller;
use steward_core::controller::{Cache, Listed, Owners, Watch};
use steward_core::index::Indexed;

use crate::build::Settings;
use crate::crd::{SHAREABLE_LABEL, SharedKind, TENANT_LABEL, Tenant};

/// Read-only caches of the Tenants and everything the operator makes or copies.
#[derive(Clone)]
pub struct Stores {
    pub tenants: Store<Tenant>,
    /// The children, each also by tenant ([`TENANT_LABEL`]): a reconcile finds its tenant's
    /// without scanning every tenant's. Metadata only where no reconcile reads the content.
    pub namespaces: Indexed<PartialObjectMeta<Namespace>>,
    /// Whole: a quota's `status.hard` says whether it is enforced yet.
    pub quotas: Indexed<ResourceQuota>,
    pub limit_ranges: Indexed<PartialObjectMeta<LimitRange>>,
    pub network_policies: Indexed<PartialObjectMeta<NetworkPolicy>>,
    pub role_bindings: Indexed<PartialObjectMeta<RoleBinding>>,
    /// The operator's access Roles, one per tenant namespace, whole: their rules say which
    /// copies it may read.
    pub roles: Indexed<Role>,
    pub cluster_roles: Indexed<PartialObjectMeta<ClusterRole>>,
    pub cluster_role_bindings: Indexed<PartialObjectMeta<ClusterRoleBinding>>,
    /// Shared sources (labelled shareable), per shared namespace.
    pub source_secrets: Sources<Secret>,
    pub source_config_maps: Sources<ConfigMap>,
    /// The operator's admission policies and bindings (by its managed-by label), for
    /// [`crate::policy::GuardRails`]; not waited for: a kind the API server does not serve never
    /// lists, and an empty cache only makes the guard rails look missing (owners wait).
    pub admission: crate::policy::Cached,
    /// Whether each child store has listed.
    pub readiness: Vec<Listed>,
}

impl Stores {
    /// Waits until every child store has its initial list (the Tenant store is ready before
    /// the controller runs any reconcile). `false` if the reflectors were dropped.
    ///
    pub async fn ready(&self) -> bool {
        Listed::all(&self.readiness).await
    }
}

/// The caches of shared sources, one per shared namespace.
#[derive(Clone)]
pub struct Sources<K: Resource<DynamicType = ()> + 'static>(
    std::collections::BTreeMap<String, Cache<K>>,
);

impl<K: Resource<DynamicType = ()> + Clone + 'static> Sources<K> {
    /// The cached source `namespace/name`; `None` also for a namespace that is not shared.
    pub fn get(&self, namespace: &str, name: &str) -> Option<Arc<K>> {
        self.0
            .get(namespace)?
            .get(&ObjectRef::new(name).within(namespace))
    }

    /// The shared namespaces.
    pub fn namespaces(&self) -> Vec<String> {
        self.0.keys().cloned().collect()
    }

    /// Whether `namespace` is a shared namespace.
    pub fn shares(&self, namespace: &str) -> bool {
        self.0.contains_key(namespace)
    }
}

/// What every reconcile shares.
pub struct State {
    pub stores: Stores,
    pub settings: Settings,
    /// Requeue interval without changes.
    pub resync: Duration,
    /// The operator's own user (a SelfSubjectReview, once): the subject of its access Roles.
    pub me: tokio::sync::OnceCell<String>,
    /// The admission policies owners must not get access without (`None` without
    /// `--apply-policies`: the cluster admin enforces something else).
    pub guard_rails: Option<crate::policy::GuardRails>,
}

/// A reflector over `api` limited by `labels` (steward-core's watch: its own backoff, errors
/// counted): its cache and the watch that drives it. Whether it has listed is added to
/// `readiness`.
fn reflect<K>(api: Api<K>, labels: &str, readiness: &mut Vec<Listed>) -> (Cache<K>, Watch<K>)
where
    K: steward_core::object::Object,
{
    let (cache, watch) = cache(api, labels);
    readiness.push(cache.listed_handle());
    (cache, watch)
}

/// A reflector over `api` limited by `labels`, not waited for ([`Stores::ready`]).
fn cache<K>(api: Api<K>, labels: &str) -> (Cache<K>, Watch<K>)
where
    K: steward_core::object::Object,
{
    steward_core::controller::watch(api, selecting(labels))
}

/// A watch of the objects `labels` selects, listed from the API server's watch cache.
fn selecting(labels: &str) -> watcher::Config {
    watcher::Config::default().labels(labels).any_semantic()
}

/// [`reflect`] of the objects labelled with a tenant (those `labels` selects), indexed by it.
fn reflect_children<K>(
    api: Api<K>,
    labels: &str,
    readiness: &mut Vec<Listed>,
) -> (Indexed<K>, Watch<K>)
where
    K: steward_core::object::Object,
{
    by_tenant(cache(api, labels), readiness)
}

/// [`reflect_children`] of the objects' metadata only.
fn reflect_children_metadata<K>(
    api: Api<K>,
    labels: &str,
    readiness: &mut Vec<Listed>,
) -> (Indexed<PartialObjectMeta<K>>, Watch<PartialObjectMeta<K>>)
where
    K: steward_core::object::Object,
{
    by_tenant(
        // Found by the tenant label (`by_tenant_label`): their owner references are not kept.
        steward_core::controller::watch_metadata(api, selecting(labels), Owners::Dropped),
        readiness,
    )
}

/// `cache` indexed by the tenant label, kept up to date by `watch`; whether it has listed is
/// added to `readiness`.
fn by_tenant<K>(
    (cache, watch): (Cache<K>, Watch<K>),
    readiness: &mut Vec<Listed>,
) -> (Indexed<K>, Watch<K>)
where
    K: steward_core::object::Object,
{
    readiness.push(cache.listed_handle());
    let index = Indexed::new(cache, TENANT_LABEL);
    let watch = index.follow(watch);
    (index, watch)
}

/// For a watch that only fills a cache.
fn wakes_none<K>(_: K) -> Option<ObjectRef<Tenant>> {
    None
}

fn by_tenant_label<K: Resource>(obj: K) -> Option<ObjectRef<Tenant>> {
    obj.labels().get(TENANT_LABEL).map(|t| ObjectRef::new(t))
}

/// Builds the Tenant controller with all its watches, and the stores it reads; shared
/// sources are watched in `shared_namespaces` only. With `shard`, the Tenants and children of
/// that shard only (`steward_core::shard`).
pub fn build(
    client: Client,
    tenant_selector: Option<&str>,
    shared_namespaces: &[String],
    shard: Option<u32>,
) -> (Controller<Tenant>, Stores) {
    let mut tenant_config = watcher::Config::default().any_semantic();
    if let Some(sel) = steward_core::shard::narrow(tenant_selector, shard) {
        tenant_config = tenant_config.labels(&sel);
    }
    let controller = Controller::new(Api::<Tenant>::all(client.clone()), tenant_config);
    let tenants = controller.store();
    let children = steward_core::shard::narrow(Some(TENANT_LABEL), shard).unwrap_or_default();
    let has_tenant = children.as_str();
    let mut r = Vec::new();

    let (namespaces, ns_stream) =
        reflect_children_metadata(Api::<Namespace>::all(client.clone()), has_tenant, &mut r);
    let (quotas, rq_stream) = reflect_children(
        Api::<ResourceQuota>::all(client.clone()),
        has_tenant,
        &mut r,
    );
    let (limit_ranges, lr_stream) =
        reflect_children_metadata(Api::<LimitRange>::all(client.clone()), has_tenant, &mut r);
    let (network_policies, np_stream) = reflect_children_metadata(
        Api::<NetworkPolicy>::all(client.clone()),
        has_tenant,
        &mut r,
    );
    let (role_bindings, rb_stream) =
        reflect_children_metadata(Api::<RoleBinding>::all(client.clone()), has_tenant, &mut r);
    let (roles, role_stream) =
        reflect_children(Api::<Role>::all(client.clone()), has_tenant, &mut r);
    let (cluster_roles, cr_stream) =
        reflect_children_metadata(Api::<ClusterRole>::all(client.clone()), has_tenant, &mut r);
    let (cluster_role_bindings, crb_stream) = reflect_children_metadata(
        Api::<ClusterRoleBinding>::all(client.clone()),
        has_tenant,
        &mut r,
    );

    // The admission policies: cached only (a Tenant waiting for one requeues soon).
    let managed = format!("{}={}", steward_core::apply::MANAGED_BY_LABEL, crate::NAME);
    let (vaps, vap_stream) = cache(Api::all(client.clone()), &managed);
    let (vap_bindings, vapb_stream) = cache(Api::all(client.clone()), &managed);
    let (maps, map_stream) = cache(Api::all(client.clone()), &managed);
    let (map_bindings, mapb_stream) = cache(Api::all(client.clone()), &managed);
    let admission = crate::policy::Cached {
        vaps: vaps.store().clone(),
        vap_bindings: vap_bindings.store().clone(),
        maps: maps.store().clone(),
        map_bindings: map_bindings.store().clone(),
    };

    let mut controller = controller
        .watches_stream(vap_stream, wakes_none)
        .watches_stream(vapb_stream, wakes_none)
        .watches_stream(map_stream, wakes_none)
        .watches_stream(mapb_stream, wakes_none)
        .watches_stream(ns_stream, by_tenant_label)
        .watches_stream(rq_stream, by_tenant_label)
        .watches_stream(lr_stream, by_tenant_label)
        .watches_stream(np_stream, by_tenant_label)
        .watches_stream(rb_stream, by_tenant_label)
        .watches_stream(role_stream, by_tenant_label)
        .watches_stream(cr_stream, by_tenant_label)
        .watches_stream(crb_stream, by_tenant_label);
    let (source_secrets, with_secrets) =
        sources::<Secret>(&client, shared_namespaces, &tenants, &mut r, controller);
    let (source_config_maps, with_config_maps) =
        sources::<ConfigMap>(&client, shared_namespaces, &tenants, &mut r, with_secrets);
    controller = with_config_maps;

    let stores = Stores {
        tenants,
        namespaces,
        quotas,
        limit_ranges,
        network_policies,
        role_bindings,
        roles,
        cluster_roles,
        cluster_role_bindings,
        source_secrets,
        source_config_maps,
        admission,
        readiness: r,
    };
    (controller, stores)
}

/// The kinds a Tenant can share.
trait Shareable:
    Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
    + Clone
    + DeserializeOwned
    + Debug
    + Send
    + Sync
{
    const KIND: SharedKind;
}

impl Shareable for Secret {
    const KIND: SharedKind = SharedKind::Secret;
}

impl Shareable for ConfigMap {
    const KIND: SharedKind = SharedKind::ConfigMap;
}

/// Reflectors of the shareable `K`s of each shared namespace, each waking the Tenants that
/// share the changed object.
fn sources<K: Shareable + 'static>(
    client: &Client,
    namespaces: &[String],
    tenants: &Store<Tenant>,
    readiness: &mut Vec<Listed>,
    mut controller: Controller<Tenant>,
) -> (Sources<K>, Controller<Tenant>) {
    let shareable = format!("{SHAREABLE_LABEL}=true");
    let mut stores = std::collections::BTreeMap::new();
    for ns in namespaces {
        let (store, stream) = reflect(
            Api::<K>::namespaced(client.clone(), ns),
            &shareable,
            readiness,
        );
        stores.insert(ns.clone(), store);
        let sharing =
            steward_core::index::referring(tenants.clone(), |t: &Tenant, namespace, name| {
                t.spec
                    .shared_objects
                    .iter()
                    .any(|s| s.kind == K::KIND && s.namespace == namespace && s.name == name)
            });
        controller = controller.watches_stream(stream, sharing);
    }
    (Sources(stores), controller)
}
