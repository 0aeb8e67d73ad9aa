//! The `Tenant` custom resource (`tenancy.steward.dev/v1alpha1`, cluster-scoped, short name `tnt`),
//! the labels and annotations the tenant-operator puts on tenant namespaces, and exact
//! [`quantity`] arithmetic. Types only: no controller code, so `kubectl steward` depends on
//! this crate, not on the operator.
//!
//! Invalid input is rejected at admission by the schema: names are DNS labels, quantities are
//! CEL-checked with the Kubernetes quantity library (`isQuantity`, non-negative), owner kinds
//! are an enum, and cross-field rules (`namespaces` within `maxNamespaces`, a namespace for
//! ServiceAccount owners) are `x-kubernetes-validations`.

#![forbid(unsafe_code)]

pub mod quantity;

use std::collections::BTreeMap;
use std::fmt;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::quantity::{Milli, ParseError};

/// API group of every Steward tenancy kind.
pub const GROUP: &str = "tenancy.steward.dev";
/// The operator that serves these kinds: its binary, field manager, Lease and Event reporter.
pub const OPERATOR: &str = "tenant-operator";
/// Label on every tenant namespace and every object the operator makes for a tenant.
pub const TENANT_LABEL: &str = "tenancy.steward.dev/tenant";
/// Label on namespaces listed in `spec.namespaces` (as opposed to those owners created).
pub const DECLARED_LABEL: &str = "tenancy.steward.dev/declared";
/// On a namespace labelled for a tenant: the tenant took it over (it existed before), so it is
/// released, never deleted, when the tenant lets it go.
pub const ADOPTED_LABEL: &str = "tenancy.steward.dev/adopted";
/// On a namespace that existed before: the tenant a cluster admin hands it to. Without it, a
/// Tenant listing an existing namespace is refused (`NamespaceNotAdoptable`).
pub const ADOPT_ANNOTATION: &str = "tenancy.steward.dev/adopt-by";
/// On a namespace the operator created for a tenant, from the moment it exists (before it is
/// labelled): the tenant's name.
pub const CREATED_FOR_ANNOTATION: &str = "tenancy.steward.dev/created-for";
/// Label on every namespace the operator has accepted for a tenant (`"true"`): declared ones,
/// adopted ones, and owner-created ones within `maxNamespaces`. Owners cannot set it (the
/// `…-namespace-owner` policy), so an owner-created namespace without it is still undecided; it
/// is set before any access is granted in the namespace.
pub const ADMITTED_LABEL: &str = "tenancy.steward.dev/admitted";
/// Label on the namespaces of a cordoned tenant; the cordon admission policy selects it.
pub const CORDONED_LABEL: &str = "tenancy.steward.dev/cordoned";
/// Label a Secret or ConfigMap must carry to be copied into tenants (`"true"`).
pub const SHAREABLE_LABEL: &str = "tenancy.steward.dev/shareable";
/// Annotation on shared copies naming their source, `namespace/name`.
pub const SOURCE_ANNOTATION: &str = "tenancy.steward.dev/source";
/// The Pod Security admission label the operator sets from `spec.podSecurity`.
pub const POD_SECURITY_LABEL: &str = "pod-security.kubernetes.io/enforce";
/// The finalizer that applies `spec.deletionPolicy`.
pub const FINALIZER: &str = "tenancy.steward.dev/namespaces";

/// A team's slice of the cluster: its namespaces, who administers them, their quotas, limits
/// and network isolation, and the Secrets and ConfigMaps shared into them.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[kube(
    group = "tenancy.steward.dev",
    version = "v1alpha1",
    kind = "Tenant",
    plural = "tenants",
    shortname = "tnt",
    category = "steward",
    status = "TenantStatus",
    derive = "PartialEq",
    doc = "A tenant: namespaces, owners, quotas, limits, network isolation and shared objects for one team.",
    printcolumn(name = "Ready", type_ = "string", json_path = ".status.conditions[?(@.type==\"Ready\")].status"),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(name = "Namespaces", type_ = "integer", json_path = ".status.namespaceCount"),
    printcolumn(name = "Max", type_ = "integer", json_path = ".spec.maxNamespaces"),
    printcolumn(name = "Cordoned", type_ = "boolean", json_path = ".spec.cordoned"),
    printcolumn(name = "Quota", type_ = "string", json_path = ".status.conditions[?(@.type==\"QuotaExceeded\")].reason", priority = 1),
    printcolumn(name = "Deletion", type_ = "string", json_path = ".spec.deletionPolicy", priority = 1),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp"),
    validation = Rule::new("size(self.metadata.name) <= 63 && self.metadata.name.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?$')")
        .message("a Tenant name must be a DNS label (lowercase letters, digits and '-', at most 63 characters): it becomes a label value"),
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "!has(self.maxNamespaces) || size(self.namespaces) <= self.maxNamespaces",
     "message": "namespaces lists more namespaces than maxNamespaces allows"},
    {"rule": "!has(self.networkIsolation) || !has(self.networkIsolation.allowFromNamespaces) || !has(self.namespaces) || !self.networkIsolation.allowFromNamespaces.exists(n, n in self.namespaces)",
     "message": "networkIsolation.allowFromNamespaces need not list the tenant's own namespaces"}
]))]
pub struct TenantSpec {
    /// Who administers the tenant: they get `ownerClusterRole` in every tenant namespace and
    /// may create namespaces for the tenant (up to `maxNamespaces`).
    #[schemars(length(min = 1, max = 32))]
    pub owners: Vec<Subject>,

    /// The ClusterRole bound to the owners in each namespace (default: the operator's
    /// `--owner-cluster-role`, itself defaulting to `admin`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub owner_cluster_role: Option<String>,

    /// More RoleBindings in every tenant namespace (e.g. `view` for an auditors group).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub additional_role_bindings: Vec<AdditionalRoleBinding>,

    /// The namespaces the operator creates for the tenant. Removing one applies
    /// `deletionPolicy` to it.
    #[serde(default)]
    #[schemars(length(max = 256), extend("x-kubernetes-list-type" = "set"), inner(length(min = 1, max = 63), regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")))]
    #[schemars(extend("x-kubernetes-validations" = [
        {"rule": "self.all(n, n != 'default' && !n.startsWith('kube-'))",
         "message": "system namespaces (default, kube-*) cannot belong to a tenant"}
    ]))]
    pub namespaces: Vec<String>,

    /// The most namespaces the tenant may have, those listed plus those its owners create.
    /// Unset: no limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 10000))]
    pub max_namespaces: Option<i32>,

    /// Labels and annotations put on every tenant namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace_metadata: Option<NamespaceMetadata>,

    /// The Pod Security Standard enforced in the tenant's namespaces
    /// (`pod-security.kubernetes.io/enforce`). Unset: the cluster default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_security: Option<PodSecurityLevel>,

    /// A ResourceQuota in every tenant namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource_quota: Option<QuotaSpec>,

    /// More ResourceQuotas in every tenant namespace besides `resourceQuota`, e.g. one with
    /// scopes (`BestEffort: pods 0`) or a scope selector (per PriorityClass). Copied as they
    /// are: `tenantQuota` does not split them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 8))]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub additional_resource_quotas: Vec<NamedQuota>,

    /// A quota across all the tenant's namespaces together, enforced by keeping the hard limits
    /// of the namespaces' ResourceQuotas such that their sum never exceeds it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant_quota: Option<QuotaSpec>,

    /// A LimitRange in every tenant namespace (defaults and bounds for containers and pods).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit_range: Option<LimitRangeSpec>,

    /// Network isolation: a NetworkPolicy in every tenant namespace admitting ingress only from
    /// the tenant's own namespaces and the namespaces listed here. On unless disabled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_isolation: Option<NetworkIsolation>,

    /// More NetworkPolicies in every tenant namespace besides the isolating one, e.g. egress
    /// rules. Owners cannot change or delete them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 8))]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub additional_network_policies: Vec<NamedNetworkPolicy>,

    /// Secrets and ConfigMaps copied into every tenant namespace and kept in sync. A source
    /// must carry the label `tenancy.steward.dev/shareable=true` and live in a namespace the
    /// operator shares from (`--shared-namespace`, default `steward-shared`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    pub shared_objects: Vec<SharedObject>,

    /// What happens to the tenant's namespaces when the Tenant is deleted (and to a namespace
    /// removed from `namespaces`): `Orphan` keeps them, `Delete` deletes them.
    #[serde(default)]
    pub deletion_policy: NamespaceDeletionPolicy,

    /// Freezes the tenant: its owners can neither create namespaces nor change anything in the
    /// tenant's namespaces.
    #[serde(default)]
    pub cordoned: bool,

    /// What the tenant's namespaces may hold: registries, pull policy, classes, Service types,
    /// node pinning. Enforced at admission for everyone but the exempt, controllers included
    /// (a Deployment's pods are refused like a bare pod).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policies: Option<TenantPolicies>,
}

/// Admission rules for the objects in a tenant's namespaces. An empty list or unset field
/// imposes nothing. Two are defaults as well as rules: a pod is given the tenant's
/// `nodeSelector` labels it lacks and, naming none, the `defaultRuntimeClass`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "!has(self.defaultRuntimeClass) || !has(self.allowedRuntimeClasses) || self.defaultRuntimeClass in self.allowedRuntimeClasses",
     "message": "defaultRuntimeClass must be one of allowedRuntimeClasses"}
]))]
pub struct TenantPolicies {
    /// Where every container image (init and ephemeral ones too) must come from: a registry
    /// (`registry.example.com`, or with a port), or a repository path in one
    /// (`registry.example.com/team-a`, or `…/team-a/` for what lies under it only). An entry
    /// matches whole segments: `registry.example.com` admits `registry.example.com/app:1`,
    /// never `registry.example.com.evil.example/app`; a repository also with its tag or digest
    /// (`…/team-a:1`, `…/team-a@sha256:…`). No wildcards; to allow every registry, leave the
    /// field out (an empty list is refused: it would read as "none").
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(min = 1, max = 32), extend("x-kubernetes-list-type" = "set"), inner(length(min = 1, max = 253), regex(pattern = r"^[a-z0-9]([a-z0-9.-]*[a-z0-9])?(:[0-9]{1,5})?(/[A-Za-z0-9._-]+)*/?$")))]
    pub allowed_registries: Vec<String>,

    /// The `imagePullPolicy` every container must have (e.g. `Always`, so a node's cached copy
    /// of a private image is not used without credentials).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_policy: Option<PullPolicy>,

    /// StorageClasses a PersistentVolumeClaim may name (a claim must name one).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32), extend("x-kubernetes-list-type" = "set"), inner(length(min = 1, max = 253), regex(pattern = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")))]
    pub allowed_storage_classes: Vec<String>,

    /// IngressClasses an Ingress may name (an Ingress must name one).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32), extend("x-kubernetes-list-type" = "set"), inner(length(min = 1, max = 253), regex(pattern = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")))]
    pub allowed_ingress_classes: Vec<String>,

    /// PriorityClasses a pod may name (a pod naming none is allowed).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32), extend("x-kubernetes-list-type" = "set"), inner(length(min = 1, max = 253), regex(pattern = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")))]
    pub allowed_priority_classes: Vec<String>,

    /// RuntimeClasses a pod may name (a pod naming none is allowed).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32), extend("x-kubernetes-list-type" = "set"), inner(length(min = 1, max = 253), regex(pattern = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")))]
    pub allowed_runtime_classes: Vec<String>,

    /// The RuntimeClass a pod naming none is given at admission (by the MutatingAdmissionPolicy
    /// `tenancy.steward.dev-pod-defaults`). Admission policies run after Kubernetes' own
    /// RuntimeClass admission, so the class must have no `overhead` (a pod given one with an
    /// overhead is refused: "Pod's Overhead doesn't match RuntimeClass's defined Overhead")
    /// and its `scheduling` is not added to the pod (pin nodes with `nodeSelector` instead).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 253),
        regex(pattern = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    )]
    pub default_runtime_class: Option<String>,

    /// Service types the tenant may not create, e.g. `NodePort` and `LoadBalancer`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "set"))]
    pub forbidden_service_types: Vec<ServiceType>,

    /// Refuses Services with `externalIPs` (which can capture traffic to any address).
    #[serde(default, rename = "forbidExternalIPs")]
    pub forbid_external_ips: bool,

    /// Labels every pod's `nodeSelector` must carry with these values, pinning the tenant to
    /// its nodes. A pod lacking some is given them at admission (a Deployment needs no
    /// change); one naming a label with another value is refused. Keys are label keys
    /// (checked by the operator: `Ready=False InvalidSpec` otherwise).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend(
        "maxProperties" = 16,
        "additionalProperties" = {"type": "string", "maxLength": 63, "pattern": "^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$"}
    ))]
    pub node_selector: BTreeMap<String, String>,
}

/// A container's `imagePullPolicy`.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum PullPolicy {
    Always,
    IfNotPresent,
    Never,
}

/// A Service's `spec.type`.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, JsonSchema,
)]
pub enum ServiceType {
    ClusterIP,
    NodePort,
    LoadBalancer,
    ExternalName,
}

impl TenantPolicies {
    /// Whether any rule is set.
    pub fn is_empty(&self) -> bool {
        self == &Self::default()
    }
}

/// A User, Group or ServiceAccount, as in an RBAC subject.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "self.kind == 'ServiceAccount' ? has(self.__namespace__) : !has(self.__namespace__)",
     "message": "namespace is required for a ServiceAccount and not allowed for a User or Group"}
]))]
pub struct Subject {
    /// `User`, `Group` or `ServiceAccount`.
    pub kind: SubjectKind,
    /// The user, group or ServiceAccount name.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// The ServiceAccount's namespace (ServiceAccounts only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 63),
        regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    )]
    pub namespace: Option<String>,
}

#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, JsonSchema,
)]
pub enum SubjectKind {
    User,
    Group,
    ServiceAccount,
}

impl fmt::Display for SubjectKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SubjectKind::User => "User",
            SubjectKind::Group => "Group",
            SubjectKind::ServiceAccount => "ServiceAccount",
        })
    }
}

/// A ClusterRole granted to subjects in every tenant namespace.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AdditionalRoleBinding {
    /// The ClusterRole to bind.
    #[schemars(length(min = 1, max = 253))]
    pub cluster_role: String,
    #[schemars(length(min = 1, max = 32))]
    pub subjects: Vec<Subject>,
}

/// Labels and annotations for the tenant's namespaces.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NamespaceMetadata {
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(schema_with = "label_map_schema")]
    pub labels: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(schema_with = "annotation_map_schema")]
    pub annotations: BTreeMap<String, String>,
}

/// A Pod Security Standard level.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum PodSecurityLevel {
    Privileged,
    Baseline,
    Restricted,
}

impl PodSecurityLevel {
    /// The value of the `pod-security.kubernetes.io/enforce` label.
    pub fn as_label(self) -> &'static str {
        match self {
            PodSecurityLevel::Privileged => "privileged",
            PodSecurityLevel::Baseline => "baseline",
            PodSecurityLevel::Restricted => "restricted",
        }
    }
}

/// Hard limits, as in a ResourceQuota (`pods: 10`, `requests.cpu: "4"`, `requests.memory: 8Gi`).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct QuotaSpec {
    #[schemars(schema_with = "resource_list_schema")]
    pub hard: BTreeMap<String, QuantityValue>,
}

/// A ResourceQuota put as it is into every tenant namespace.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NamedQuota {
    /// The ResourceQuota's name in each namespace (not `tenant-quota`, which is
    /// `resourceQuota`'s).
    #[schemars(
        length(min = 1, max = 63),
        regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    )]
    #[schemars(extend("x-kubernetes-validations" = [
        {"rule": "self != 'tenant-quota'", "message": "tenant-quota is the name of resourceQuota's quota"}
    ]))]
    pub name: String,
    #[schemars(schema_with = "resource_list_schema")]
    pub hard: BTreeMap<String, QuantityValue>,
    /// The quota's scopes (`BestEffort`, `NotBestEffort`, `Terminating`, `NotTerminating`,
    /// `PriorityClass`, `CrossNamespacePodAffinity`, `VolumeAttributesClass`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 8), inner(length(min = 1, max = 64)))]
    pub scopes: Vec<String>,
    /// The quota's scope selector, as in a ResourceQuota.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scope_selector: Option<k8s_openapi::api::core::v1::ScopeSelector>,
}

/// A NetworkPolicy put as it is into every tenant namespace.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NamedNetworkPolicy {
    /// The NetworkPolicy's name in each namespace (not `tenant-isolation`, the isolating one's).
    #[schemars(
        length(min = 1, max = 63),
        regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    )]
    #[schemars(extend("x-kubernetes-validations" = [
        {"rule": "self != 'tenant-isolation'", "message": "tenant-isolation is the name of the isolating NetworkPolicy"}
    ]))]
    pub name: String,
    /// The policy, as in a NetworkPolicy's `spec`.
    pub spec: k8s_openapi::api::networking::v1::NetworkPolicySpec,
}

/// LimitRange items applied in every tenant namespace.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LimitRangeSpec {
    #[schemars(length(min = 1, max = 8))]
    pub limits: Vec<LimitItem>,
}

/// One LimitRange item.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LimitItem {
    /// `Container`, `Pod` or `PersistentVolumeClaim`.
    #[serde(rename = "type")]
    pub type_: LimitType,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(schema_with = "resource_list_schema")]
    pub default: BTreeMap<String, QuantityValue>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(schema_with = "resource_list_schema")]
    pub default_request: BTreeMap<String, QuantityValue>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(schema_with = "resource_list_schema")]
    pub max: BTreeMap<String, QuantityValue>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(schema_with = "resource_list_schema")]
    pub min: BTreeMap<String, QuantityValue>,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum LimitType {
    Container,
    Pod,
    PersistentVolumeClaim,
}

impl LimitType {
    pub fn as_str(self) -> &'static str {
        match self {
            LimitType::Container => "Container",
            LimitType::Pod => "Pod",
            LimitType::PersistentVolumeClaim => "PersistentVolumeClaim",
        }
    }
}

/// Ingress isolation between tenants.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NetworkIsolation {
    /// Whether the operator puts the isolating NetworkPolicy into each namespace.
    #[serde(default = "default_true")]
    pub enabled: bool,
    /// Namespaces outside every tenant whose pods may reach the tenant's pods, e.g. an
    /// ingress controller's or monitoring's. A listed name that belongs to a tenant is not a
    /// peer (its owners could have created it to get in).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64), extend("x-kubernetes-list-type" = "set"), inner(length(min = 1, max = 63), regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")))]
    pub allow_from_namespaces: Vec<String>,
}

impl Default for NetworkIsolation {
    fn default() -> Self {
        Self {
            enabled: true,
            allow_from_namespaces: Vec::new(),
        }
    }
}

fn default_true() -> bool {
    true
}

/// A Secret or ConfigMap to copy into every tenant namespace.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SharedObject {
    pub kind: SharedKind,
    /// The source's namespace: one the operator shares from (`--shared-namespace`).
    #[schemars(
        length(min = 1, max = 63),
        regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    )]
    pub namespace: String,
    /// The source's name, also the copies' name.
    #[schemars(
        length(min = 1, max = 253),
        regex(pattern = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    )]
    pub name: String,
}

#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, JsonSchema,
)]
pub enum SharedKind {
    Secret,
    ConfigMap,
}

/// What happens to namespaces the tenant no longer has.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default, JsonSchema)]
pub enum NamespaceDeletionPolicy {
    /// Keep the namespace and everything in it; the operator removes its labels and
    /// annotations, and its quotas, limits, policies and role bindings are removed.
    #[default]
    Orphan,
    /// Delete the namespace with everything in it.
    Delete,
}

/// A quantity as written in a spec: a string (`"500m"`, `"10Gi"`) or an integer (`10`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuantityValue(pub String);

impl QuantityValue {
    /// The exact value.
    ///
    /// # Errors
    /// [`ParseError`] when the string is not a quantity (admission rejects those, so this
    /// only happens for objects stored before the CRD had its rules).
    pub fn milli(&self) -> Result<Milli, ParseError> {
        Milli::parse(&self.0)
    }
}

impl From<&str> for QuantityValue {
    fn from(s: &str) -> Self {
        QuantityValue(s.to_string())
    }
}

impl Serialize for QuantityValue {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for QuantityValue {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Int(i64),
            Float(f64),
            Str(String),
        }
        Ok(QuantityValue(match Raw::deserialize(deserializer)? {
            Raw::Int(i) => i.to_string(),
            Raw::Float(f) => f.to_string(),
            Raw::Str(s) => s,
        }))
    }
}

impl JsonSchema for QuantityValue {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "QuantityValue".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        quantity_schema()
    }
}

fn quantity_schema() -> schemars::Schema {
    schemars::json_schema!({
        "x-kubernetes-int-or-string": true,
        "anyOf": [{"type": "integer"}, {"type": "string"}],
        "maxLength": 64,
        "x-kubernetes-validations": [{
            "rule": "isQuantity(string(self)) && !quantity(string(self)).isLessThan(quantity('0'))",
            "message": "must be a non-negative quantity such as 500m, 2 or 10Gi"
        }]
    })
}

fn resource_list_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "object",
        "maxProperties": 32,
        "additionalProperties": quantity_schema(),
    })
}

fn label_map_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "object",
        "maxProperties": 64,
        "additionalProperties": {"type": "string", "maxLength": 63},
        "x-kubernetes-validations": [{
            "rule": "self.all(k, !k.startsWith('tenancy.steward.dev/') && !k.startsWith('steward.dev/') && !k.startsWith('pod-security.kubernetes.io/') && k != 'app.kubernetes.io/managed-by')",
            "message": "labels under tenancy.steward.dev/, steward.dev/ and pod-security.kubernetes.io/ and app.kubernetes.io/managed-by are set by the operator"
        }]
    })
}

fn annotation_map_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "object",
        "maxProperties": 64,
        "additionalProperties": {"type": "string", "maxLength": 4096},
        "x-kubernetes-validations": [{
            "rule": "self.all(k, !k.startsWith('tenancy.steward.dev/'))",
            "message": "annotations under tenancy.steward.dev/ are set by the operator"
        }]
    })
}

/// What the operator observed and did.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TenantStatus {
    /// The generation the status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Active`, `Cordoned`, `Degraded` or `Terminating`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<TenantPhase>,
    /// The tenant's namespaces, sorted: those listed in the spec that exist, and those its
    /// owners created.
    #[serde(default)]
    pub namespaces: Vec<String>,
    /// `len(namespaces)`, for `kubectl get`.
    #[serde(default)]
    pub namespace_count: i32,
    /// Those of `namespaces` that existed before the tenant took them (handed over with the
    /// `tenancy.steward.dev/adopt-by` annotation): released, never deleted, when the tenant
    /// lets them go. The others were created for the tenant.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub adopted_namespaces: Vec<String>,
    /// Usage across all the tenant's namespaces, summed from their ResourceQuotas.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quota: Option<QuotaStatus>,
    /// `Ready` and `QuotaExceeded`.
    #[serde(default)]
    pub conditions: Vec<Condition>,
}

/// Tenant-wide quota usage.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct QuotaStatus {
    /// The tenant-wide limits (from `spec.tenantQuota`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub hard: BTreeMap<String, String>,
    /// The summed usage of every quota'd resource.
    #[serde(default)]
    pub used: BTreeMap<String, String>,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum TenantPhase {
    Active,
    Cordoned,
    Degraded,
    Terminating,
}

/// The condition reporting tenant-wide quota exhaustion.
pub const QUOTA_EXCEEDED: &str = "QuotaExceeded";

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use kube::CustomResourceExt;

    #[test]
    fn crd_has_the_required_metadata() {
        let crd = Tenant::crd();
        assert_eq!(crd.spec.scope, "Cluster");
        assert_eq!(
            crd.spec.names.short_names.as_deref(),
            Some(&["tnt".to_string()][..])
        );
        // Steward's conventions are checked for every operator by the registry's test.
        let columns: Vec<_> = crd.spec.versions[0]
            .additional_printer_columns
            .iter()
            .flatten()
            .map(|c| c.name.as_str())
            .collect();
        for c in ["Ready", "Phase", "Namespaces"] {
            assert!(columns.contains(&c), "{c} column in {columns:?}");
        }
        let yaml = serde_json::to_string(&crd).unwrap();
        assert!(yaml.contains("isQuantity"), "quantities are CEL-checked");
        assert!(
            yaml.contains("x-kubernetes-list-type"),
            "namespaces are a set"
        );
    }

    #[test]
    fn quantities_accept_integers_and_strings() {
        let q: BTreeMap<String, QuantityValue> =
            serde_json::from_str(r#"{"pods": 10, "cpu": "500m"}"#).unwrap();
        assert_eq!(q["pods"].0, "10");
        assert_eq!(q["cpu"].milli().unwrap(), Milli(500));
        assert_eq!(
            serde_json::to_string(&q).unwrap(),
            r#"{"cpu":"500m","pods":"10"}"#
        );
    }

    #[test]
    fn spec_defaults() {
        let spec: TenantSpec =
            serde_json::from_str(r#"{"owners": [{"kind": "User", "name": "alice"}]}"#).unwrap();
        assert_eq!(spec.deletion_policy, NamespaceDeletionPolicy::Orphan);
        assert!(!spec.cordoned);
        assert!(
            spec.network_isolation.is_none(),
            "absent means on with no exceptions"
        );
    }
}
