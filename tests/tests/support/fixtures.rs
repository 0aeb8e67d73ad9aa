//! Typed fixtures for the integration tests: the objects the tests create, built from the
//! operators' own types and k8s-openapi's, instead of `serde_json::from_value(json!(…))`.
//!
//! Kubernetes objects are plain functions (tweak the rest with struct-update syntax on the
//! k8s-openapi types, which all have `Default`); a Tenant and a PostgresCluster have small
//! builders, an UpgradePlan is a function of its components and [`Strategy`].
//!
//! Wired in like the other support modules: `#[path = "support/fixtures.rs"] mod fixtures;`.

#![allow(dead_code)] // each test binary uses part of it

use std::collections::BTreeMap;

use database_operator::crd::{DeletionPolicy, PostgresCluster, PostgresClusterSpec, StorageSpec};
use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec};
use k8s_openapi::api::core::v1::{
    Container, HostPathVolumeSource, Namespace, PersistentVolume, PersistentVolumeSpec, Pod,
    PodSpec, PodTemplateSpec, Secret,
};
use k8s_openapi::api::rbac::v1::{
    ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding, RoleRef, Subject,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use tenant_operator::crd::{
    AdditionalRoleBinding, LimitItem, LimitRangeSpec, LimitType, NamedNetworkPolicy, NamedQuota,
    NamespaceDeletionPolicy, NamespaceMetadata, NetworkIsolation, PodSecurityLevel, QuantityValue,
    QuotaSpec, SharedKind, SharedObject, SubjectKind, Tenant, TenantPolicies, TenantSpec,
};
use upgrade_orchestrator::crd::{
    Component, Hook, Hooks, ImageChange, Strategy, TargetRef, UpgradePlan, UpgradePlanSpec,
};

// ---------------------------------------------------------------------------------------------
// Kubernetes objects

/// `{k: v, …}` as an owned map (labels, selectors, string data).
pub(crate) fn map<'a>(
    pairs: impl IntoIterator<Item = (&'a str, &'a str)>,
) -> BTreeMap<String, String> {
    pairs
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// Resource quantities, as in a container's `requests`: `resource_list([("cpu", "10m")])`.
pub(crate) fn resource_list<'a>(
    pairs: impl IntoIterator<Item = (&'a str, &'a str)>,
) -> BTreeMap<String, Quantity> {
    pairs
        .into_iter()
        .map(|(k, v)| (k.to_string(), Quantity(v.to_string())))
        .collect()
}

/// Metadata with just a name.
pub(crate) fn meta(name: &str) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.into()),
        ..ObjectMeta::default()
    }
}

/// Metadata with a name and labels.
pub(crate) fn labelled<'a>(
    name: &str,
    labels: impl IntoIterator<Item = (&'a str, &'a str)>,
) -> ObjectMeta {
    ObjectMeta {
        labels: Some(map(labels)),
        ..meta(name)
    }
}

pub(crate) fn namespace(name: &str) -> Namespace {
    Namespace {
        metadata: meta(name),
        ..Namespace::default()
    }
}

/// A Secret with `stringData` (set `metadata` to label it).
pub(crate) fn secret<'a>(
    name: &str,
    string_data: impl IntoIterator<Item = (&'a str, &'a str)>,
) -> Secret {
    Secret {
        metadata: meta(name),
        string_data: Some(map(string_data)),
        ..Secret::default()
    }
}

/// A container `name` running `image`, nothing else set.
pub(crate) fn container(name: &str, image: &str) -> Container {
    Container {
        name: name.into(),
        image: Some(image.into()),
        ..Container::default()
    }
}

/// A pod spec of these containers, nothing else set.
pub(crate) fn pod_spec(containers: impl IntoIterator<Item = Container>) -> PodSpec {
    PodSpec {
        containers: containers.into_iter().collect(),
        ..PodSpec::default()
    }
}

pub(crate) fn pod(name: &str, spec: PodSpec) -> Pod {
    Pod {
        metadata: meta(name),
        spec: Some(spec),
        ..Pod::default()
    }
}

/// A pod template labelled `app: <app>`.
pub(crate) fn pod_template(app: &str, spec: PodSpec) -> PodTemplateSpec {
    PodTemplateSpec {
        metadata: Some(ObjectMeta {
            labels: Some(map([("app", app)])),
            ..ObjectMeta::default()
        }),
        spec: Some(spec),
    }
}

/// The selector `app: <app>`.
pub(crate) fn app_selector(app: &str) -> LabelSelector {
    LabelSelector {
        match_labels: Some(map([("app", app)])),
        ..LabelSelector::default()
    }
}

/// A Deployment of `replicas` pods of `spec`, labelled and selected by `app: <name>`.
pub(crate) fn deployment(name: &str, replicas: i32, spec: PodSpec) -> Deployment {
    Deployment {
        metadata: meta(name),
        spec: DeploymentSpec {
            replicas: Some(replicas),
            selector: app_selector(name),
            template: pod_template(name, spec),
            ..DeploymentSpec::default()
        },
        ..Deployment::default()
    }
}

/// A 1Gi ReadWriteOnce hostPath PersistentVolume (`/tmp/<name>`) of `class`, labelled
/// `steward.dev/test: <test>` (kwok has no provisioner).
pub(crate) fn persistent_volume(
    name: &str,
    class: &str,
    reclaim: &str,
    test: &str,
) -> PersistentVolume {
    PersistentVolume {
        metadata: labelled(name, [("steward.dev/test", test)]),
        spec: Some(PersistentVolumeSpec {
            capacity: Some(resource_list([("storage", "1Gi")])),
            access_modes: Some(vec!["ReadWriteOnce".into()]),
            storage_class_name: Some(class.into()),
            persistent_volume_reclaim_policy: Some(reclaim.into()),
            host_path: Some(HostPathVolumeSource {
                path: format!("/tmp/{name}"),
                ..HostPathVolumeSource::default()
            }),
            ..PersistentVolumeSpec::default()
        }),
        ..PersistentVolume::default()
    }
}

/// An RBAC rule: `verbs` on `resources` of `api_groups` (set `resource_names` with
/// struct-update syntax).
pub(crate) fn rule(api_groups: &[&str], resources: &[&str], verbs: &[&str]) -> PolicyRule {
    let strings = |s: &[&str]| Some(s.iter().map(|s| s.to_string()).collect());
    PolicyRule {
        api_groups: strings(api_groups),
        resources: strings(resources),
        verbs: verbs.iter().map(|s| s.to_string()).collect(),
        ..PolicyRule::default()
    }
}

pub(crate) fn cluster_role(name: &str, rules: Vec<PolicyRule>) -> ClusterRole {
    ClusterRole {
        metadata: meta(name),
        rules: Some(rules),
        ..ClusterRole::default()
    }
}

pub(crate) fn role(name: &str, rules: Vec<PolicyRule>) -> Role {
    Role {
        metadata: meta(name),
        rules: Some(rules),
    }
}

fn role_ref(kind: &str, name: &str) -> RoleRef {
    RoleRef {
        api_group: Some("rbac.authorization.k8s.io".into()),
        kind: kind.into(),
        name: name.into(),
    }
}

/// The RBAC subject User `name`.
pub(crate) fn rbac_user(name: &str) -> Subject {
    Subject {
        api_group: Some("rbac.authorization.k8s.io".into()),
        kind: "User".into(),
        name: name.into(),
        namespace: None,
    }
}

/// The RBAC subject ServiceAccount `namespace/name`.
pub(crate) fn rbac_service_account(namespace: &str, name: &str) -> Subject {
    Subject {
        api_group: None,
        kind: "ServiceAccount".into(),
        name: name.into(),
        namespace: Some(namespace.into()),
    }
}

/// Binds ClusterRole `name` (the binding's name too) to `subjects`.
pub(crate) fn cluster_role_binding(name: &str, subjects: Vec<Subject>) -> ClusterRoleBinding {
    ClusterRoleBinding {
        metadata: meta(name),
        role_ref: role_ref("ClusterRole", name),
        subjects: Some(subjects),
    }
}

/// Binds Role `name` (the binding's name too) to `subjects`.
pub(crate) fn role_binding(name: &str, subjects: Vec<Subject>) -> RoleBinding {
    RoleBinding {
        metadata: meta(name),
        role_ref: role_ref("Role", name),
        subjects: Some(subjects),
    }
}

// ---------------------------------------------------------------------------------------------
// Tenant (tenant-operator)

fn quantities<'a>(
    hard: impl IntoIterator<Item = (&'a str, &'a str)>,
) -> BTreeMap<String, QuantityValue> {
    hard.into_iter()
        .map(|(k, v)| (k.to_string(), QuantityValue::from(v)))
        .collect()
}

/// Hard limits, as in a ResourceQuota: `quota([("pods", "5"), ("requests.cpu", "2")])`.
pub(crate) fn quota<'a>(hard: impl IntoIterator<Item = (&'a str, &'a str)>) -> QuotaSpec {
    QuotaSpec {
        hard: quantities(hard),
    }
}

/// An extra ResourceQuota `name` with `hard` limits (set scopes with struct-update syntax).
pub(crate) fn named_quota<'a>(
    name: &str,
    hard: impl IntoIterator<Item = (&'a str, &'a str)>,
) -> NamedQuota {
    NamedQuota {
        name: name.into(),
        hard: quantities(hard),
        ..NamedQuota::default()
    }
}

/// A tenant owner or subject of `kind` (User or Group).
pub(crate) fn tenant_subject(kind: SubjectKind, name: &str) -> tenant_operator::crd::Subject {
    tenant_operator::crd::Subject {
        kind,
        name: name.into(),
        namespace: None,
    }
}

/// `fixtures::tenant("t1").owner_user("alice").namespaces(["t1-a"]).build()`.
pub(crate) fn tenant(name: &str) -> TenantBuilder {
    TenantBuilder {
        name: name.into(),
        labels: BTreeMap::new(),
        spec: TenantSpec::default(),
    }
}

/// A Tenant under construction; `build` makes it. Only what is set is set: unset `Option`s
/// and empty lists are left out, as absent fields of a Tenant's JSON are.
#[must_use]
pub(crate) struct TenantBuilder {
    name: String,
    labels: BTreeMap<String, String>,
    spec: TenantSpec,
}

impl TenantBuilder {
    pub(crate) fn label(mut self, key: &str, value: &str) -> Self {
        self.labels.insert(key.into(), value.into());
        self
    }

    pub(crate) fn owner_user(mut self, name: &str) -> Self {
        self.spec
            .owners
            .push(tenant_subject(SubjectKind::User, name));
        self
    }

    pub(crate) fn namespaces<S: AsRef<str>>(mut self, names: impl IntoIterator<Item = S>) -> Self {
        self.spec
            .namespaces
            .extend(names.into_iter().map(|n| n.as_ref().to_string()));
        self
    }

    pub(crate) fn max_namespaces(mut self, max: i32) -> Self {
        self.spec.max_namespaces = Some(max);
        self
    }

    pub(crate) fn deletion_policy(mut self, policy: NamespaceDeletionPolicy) -> Self {
        self.spec.deletion_policy = policy;
        self
    }

    pub(crate) fn pod_security(mut self, level: PodSecurityLevel) -> Self {
        self.spec.pod_security = Some(level);
        self
    }

    pub(crate) fn namespace_metadata<'a>(
        mut self,
        labels: impl IntoIterator<Item = (&'a str, &'a str)>,
        annotations: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Self {
        self.spec.namespace_metadata = Some(NamespaceMetadata {
            labels: map(labels),
            annotations: map(annotations),
        });
        self
    }

    pub(crate) fn resource_quota<'a>(
        mut self,
        hard: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Self {
        self.spec.resource_quota = Some(quota(hard));
        self
    }

    pub(crate) fn tenant_quota<'a>(
        mut self,
        hard: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Self {
        self.spec.tenant_quota = Some(quota(hard));
        self
    }

    pub(crate) fn additional_quota(mut self, quota: NamedQuota) -> Self {
        self.spec.additional_resource_quotas.push(quota);
        self
    }

    pub(crate) fn additional_network_policy(
        mut self,
        name: &str,
        spec: k8s_openapi::api::networking::v1::NetworkPolicySpec,
    ) -> Self {
        self.spec
            .additional_network_policies
            .push(NamedNetworkPolicy {
                name: name.into(),
                spec,
            });
        self
    }

    /// A `Container` LimitRange item with these `default` and `defaultRequest` values.
    pub(crate) fn container_limits<'a>(
        mut self,
        default: impl IntoIterator<Item = (&'a str, &'a str)>,
        default_request: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Self {
        self.spec
            .limit_range
            .get_or_insert_with(LimitRangeSpec::default)
            .limits
            .push(LimitItem {
                type_: LimitType::Container,
                default: quantities(default),
                default_request: quantities(default_request),
                max: BTreeMap::new(),
                min: BTreeMap::new(),
            });
        self
    }

    /// Network isolation on, admitting ingress from these namespaces too.
    pub(crate) fn allow_from_namespaces<'a>(
        mut self,
        namespaces: impl IntoIterator<Item = &'a str>,
    ) -> Self {
        self.spec.network_isolation = Some(NetworkIsolation {
            allow_from_namespaces: namespaces.into_iter().map(str::to_string).collect(),
            ..NetworkIsolation::default()
        });
        self
    }

    pub(crate) fn shared(mut self, kind: SharedKind, namespace: &str, name: &str) -> Self {
        self.spec.shared_objects.push(SharedObject {
            kind,
            namespace: namespace.into(),
            name: name.into(),
        });
        self
    }

    /// Binds `cluster_role` to `subjects` in every tenant namespace.
    pub(crate) fn role_binding(
        mut self,
        cluster_role: &str,
        subjects: Vec<tenant_operator::crd::Subject>,
    ) -> Self {
        self.spec
            .additional_role_bindings
            .push(AdditionalRoleBinding {
                cluster_role: cluster_role.into(),
                subjects,
            });
        self
    }

    pub(crate) fn policies(mut self, policies: TenantPolicies) -> Self {
        self.spec.policies = Some(policies);
        self
    }

    pub(crate) fn build(self) -> Tenant {
        let mut tenant = Tenant::new(&self.name, self.spec);
        if !self.labels.is_empty() {
            tenant.metadata.labels = Some(self.labels);
        }
        tenant
    }
}

// ---------------------------------------------------------------------------------------------
// PostgresCluster (database-operator)

/// `fixtures::postgres_cluster("pg", 3).storage_class(&class).build()`: PostgreSQL 16 on 1Gi
/// volumes unless told otherwise.
pub(crate) fn postgres_cluster(name: &str, instances: i32) -> PostgresClusterBuilder {
    PostgresClusterBuilder {
        name: name.into(),
        spec: PostgresClusterSpec {
            instances,
            version: 16,
            image: None,
            image_pull_policy: None,
            storage: StorageSpec {
                size: Quantity("1Gi".into()),
                storage_class_name: None,
            },
            resources: None,
            parameters: BTreeMap::new(),
            synchronous_replicas: None,
            deletion_policy: DeletionPolicy::default(),
            backup: None,
            bootstrap: None,
            placement: None,
            pooler: None,
            replica: None,
            monitoring: None,
        },
    }
}

/// A PostgresCluster under construction; `build` makes it.
#[must_use]
pub(crate) struct PostgresClusterBuilder {
    name: String,
    spec: PostgresClusterSpec,
}

impl PostgresClusterBuilder {
    pub(crate) fn storage_class(mut self, class: &str) -> Self {
        self.spec.storage.storage_class_name = Some(class.into());
        self
    }

    pub(crate) fn parameter(mut self, key: &str, value: &str) -> Self {
        self.spec.parameters.insert(key.into(), value.into());
        self
    }

    pub(crate) fn deletion_policy(mut self, policy: DeletionPolicy) -> Self {
        self.spec.deletion_policy = policy;
        self
    }

    pub(crate) fn build(self) -> PostgresCluster {
        PostgresCluster::new(&self.name, self.spec)
    }
}

// ---------------------------------------------------------------------------------------------
// UpgradePlan (upgrade-orchestrator)

/// The object `kind/name` in the plan's namespace (set `api_version` and `namespace` with
/// struct-update syntax).
pub(crate) fn target(kind: &str, name: &str) -> TargetRef {
    TargetRef {
        api_version: None,
        namespace: None,
        kind: kind.into(),
        name: name.into(),
    }
}

/// A component `name` of `target` with no change yet: set `image`, `version` or `set` with
/// struct-update syntax.
pub(crate) fn change(name: &str, target: TargetRef) -> Component {
    Component {
        name: name.into(),
        target,
        image: None,
        set: None,
        version: None,
        depends_on: Vec::new(),
        rollback: None,
        health: None,
        hooks: None,
    }
}

/// `image` for the container `container`.
pub(crate) fn image(container: &str, image: &str) -> Option<ImageChange> {
    Some(ImageChange {
        container: container.into(),
        image: image.into(),
    })
}

/// Component `name`: the `kind` named `name`, its container `app` to `image`, after `deps`.
pub(crate) fn component(name: &str, kind: &str, image_: &str, deps: &[&str]) -> Component {
    Component {
        image: image("app", image_),
        depends_on: deps.iter().map(|d| d.to_string()).collect(),
        ..change(name, target(kind, name))
    }
}

/// Component `name`: PostgresCluster `cluster` to major `version`.
pub(crate) fn version(name: &str, cluster: &str, version: &str) -> Component {
    Component {
        version: Some(version.into()),
        ..change(name, target("PostgresCluster", cluster))
    }
}

/// A component's hooks: the Job specs (raw JSON in the CRD) to run before and after it.
pub(crate) fn hooks(
    before: Option<serde_json::Value>,
    after: Option<serde_json::Value>,
) -> Option<Hooks> {
    Some(Hooks {
        before: before.map(|job| Hook { job }),
        after: after.map(|job| Hook { job }),
    })
}

/// UpgradePlan `name` of `components`.
pub(crate) fn plan(name: &str, components: Vec<Component>, strategy: Strategy) -> UpgradePlan {
    UpgradePlan::new(
        name,
        UpgradePlanSpec {
            components,
            strategy,
            approved_waves: None,
            service_account_name: None,
        },
    )
}
