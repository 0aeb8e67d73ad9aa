//! Build: the objects a tenant wants, as pure functions of the Tenant (and, for shared
//! copies, their sources). Nothing here touches the API server.
//!
//! Per namespace: a ResourceQuota `tenant-quota`, a LimitRange `tenant-limits`, a
//! NetworkPolicy `tenant-isolation`, RoleBindings `tenant-owner-<role>` and `tenant-<role>`,
//! and copies of the shared Secrets and ConfigMaps. Per tenant: a ClusterRole and
//! ClusterRoleBinding that let the owners create namespaces for the tenant and mark them as
//! its owners for the admission policies (the custom verb `own` on their Tenant).
//! Every object carries the label `tenancy.steward.dev/tenant=<tenant>`.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use k8s_openapi::api::core::v1::{
    ConfigMap, LimitRange, LimitRangeItem, LimitRangeSpec, Namespace, ResourceQuota,
    ResourceQuotaSpec, Secret,
};
use k8s_openapi::api::networking::v1::{
    NetworkPolicy, NetworkPolicyIngressRule, NetworkPolicyPeer, NetworkPolicySpec,
};
use k8s_openapi::api::rbac::v1::{
    ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding, RoleRef, Subject as RbacSubject,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{
    LabelSelector, LabelSelectorRequirement, ObjectMeta,
};
use kube::ResourceExt;

use crate::crd::{
    ADMITTED_LABEL, ADOPTED_LABEL, CORDONED_LABEL, DECLARED_LABEL, GROUP, POD_SECURITY_LABEL,
    QuantityValue, SOURCE_ANNOTATION, SharedKind, SharedObject, SubjectKind, TENANT_LABEL, Tenant,
};
use crate::quantity::Milli;

/// Name of the ResourceQuota in every tenant namespace.
pub const QUOTA_NAME: &str = "tenant-quota";
/// Name of the LimitRange in every tenant namespace.
pub const LIMITS_NAME: &str = "tenant-limits";
/// Name of the NetworkPolicy in every tenant namespace.
pub const NETWORK_POLICY_NAME: &str = "tenant-isolation";
/// The custom RBAC verb on a Tenant that makes a subject one of its owners for the
/// admission policies.
pub const OWN_VERB: &str = "own";

/// Operator-wide settings the builders need.
#[derive(Clone, Debug)]
pub struct Settings {
    /// ClusterRole for owners when the Tenant names none.
    pub owner_cluster_role: String,
    /// Namespaces never given to a tenant.
    pub protected: crate::namespaces::Protected,
}

fn meta(tenant: &Tenant, name: &str, namespace: Option<&str>) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.to_string()),
        namespace: namespace.map(str::to_string),
        labels: Some(BTreeMap::from([(
            TENANT_LABEL.to_string(),
            tenant.name_any(),
        )])),
        ..Default::default()
    }
}

/// The namespace `name` as the tenant wants it: the tenant label (and `declared` for those in
/// `spec.namespaces`, `adopted` for those that existed before), the Pod Security level, the
/// cordon mark, propagated labels and annotations.
pub fn namespace(tenant: &Tenant, name: &str, declared: bool, adopted: bool) -> Namespace {
    let mut m = meta(tenant, name, None);
    let labels = m.labels.get_or_insert_with(BTreeMap::new);
    let spec = &tenant.spec;
    if let Some(md) = &spec.namespace_metadata {
        for (k, v) in &md.labels {
            labels.insert(k.clone(), v.clone());
        }
        if !md.annotations.is_empty() {
            m.annotations = Some(md.annotations.clone());
        }
    }
    let labels = m.labels.get_or_insert_with(BTreeMap::new);
    labels.insert(TENANT_LABEL.to_string(), tenant.name_any());
    labels.insert(ADMITTED_LABEL.to_string(), "true".to_string());
    if declared {
        labels.insert(DECLARED_LABEL.to_string(), "true".to_string());
    }
    if adopted {
        labels.insert(ADOPTED_LABEL.to_string(), "true".to_string());
    }
    if spec.cordoned {
        labels.insert(CORDONED_LABEL.to_string(), "true".to_string());
    }
    if let Some(level) = spec.pod_security {
        labels.insert(POD_SECURITY_LABEL.to_string(), level.as_label().to_string());
    }
    Namespace {
        metadata: m,
        ..Default::default()
    }
}

/// The label keys and annotation keys [`namespace`] sets, for releasing an orphaned namespace.
pub fn namespace_metadata_keys(tenant: &Tenant) -> (Vec<String>, Vec<String>) {
    let ns = namespace(tenant, "x", true, true);
    let mut labels: Vec<String> = ns.metadata.labels.unwrap_or_default().into_keys().collect();
    labels.push(CORDONED_LABEL.to_string());
    labels.push(steward_core::apply::OWNER_LABEL.to_string());
    labels.push(steward_core::apply::MANAGED_BY_LABEL.to_string());
    labels.sort();
    labels.dedup();
    let mut annotations: Vec<String> = ns
        .metadata
        .annotations
        .unwrap_or_default()
        .into_keys()
        .collect();
    annotations.push(crate::crd::CREATED_FOR_ANNOTATION.to_string());
    annotations.push(steward_core::apply::APPLIED_ANNOTATION.to_string());
    (labels, annotations)
}

fn quantities(map: &BTreeMap<String, Milli>) -> BTreeMap<String, Quantity> {
    map.iter()
        .map(|(k, v)| (k.clone(), Quantity(v.format_for(k))))
        .collect()
}

fn spec_quantities(map: &BTreeMap<String, QuantityValue>) -> Option<BTreeMap<String, Quantity>> {
    (!map.is_empty()).then(|| {
        map.iter()
            .map(|(k, v)| (k.clone(), Quantity(v.0.clone())))
            .collect()
    })
}

/// The ResourceQuota of one namespace with the given hard limits (see [`crate::quota`]).
pub fn resource_quota(
    tenant: &Tenant,
    namespace: &str,
    hard: &BTreeMap<String, Milli>,
) -> ResourceQuota {
    ResourceQuota {
        metadata: meta(tenant, QUOTA_NAME, Some(namespace)),
        spec: Some(ResourceQuotaSpec {
            hard: Some(quantities(hard)),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The tenant's `additionalResourceQuotas` for one namespace, as they are.
pub fn additional_quotas(tenant: &Tenant, namespace: &str) -> Vec<ResourceQuota> {
    tenant
        .spec
        .additional_resource_quotas
        .iter()
        .map(|q| ResourceQuota {
            metadata: meta(tenant, &q.name, Some(namespace)),
            spec: Some(ResourceQuotaSpec {
                hard: Some(
                    q.hard
                        .iter()
                        .map(|(k, v)| (k.clone(), Quantity(v.0.clone())))
                        .collect(),
                ),
                scopes: (!q.scopes.is_empty()).then(|| q.scopes.clone()),
                scope_selector: q.scope_selector.clone(),
            }),
            ..Default::default()
        })
        .collect()
}

/// The tenant's `additionalNetworkPolicies` for one namespace, as they are.
pub fn additional_network_policies(tenant: &Tenant, namespace: &str) -> Vec<NetworkPolicy> {
    tenant
        .spec
        .additional_network_policies
        .iter()
        .map(|p| NetworkPolicy {
            metadata: meta(tenant, &p.name, Some(namespace)),
            spec: Some(p.spec.clone()),
        })
        .collect()
}

/// The LimitRange of one namespace, if the tenant has `limitRange`.
pub fn limit_range(tenant: &Tenant, namespace: &str) -> Option<LimitRange> {
    let spec = tenant.spec.limit_range.as_ref()?;
    let limits = spec
        .limits
        .iter()
        .map(|item| LimitRangeItem {
            type_: item.type_.as_str().to_string(),
            default: spec_quantities(&item.default),
            default_request: spec_quantities(&item.default_request),
            max: spec_quantities(&item.max),
            min: spec_quantities(&item.min),
            ..Default::default()
        })
        .collect();
    Some(LimitRange {
        metadata: meta(tenant, LIMITS_NAME, Some(namespace)),
        spec: Some(LimitRangeSpec { limits }),
    })
}

/// The isolating NetworkPolicy of one namespace, unless isolation is disabled: ingress to
/// every pod only from the tenant's namespaces and the explicitly allowed ones (by name, and
/// only namespaces outside every tenant, which owners cannot create).
pub fn network_policy(tenant: &Tenant, namespace: &str) -> Option<NetworkPolicy> {
    let isolation = tenant.spec.network_isolation.clone().unwrap_or_default();
    if !isolation.enabled {
        return None;
    }
    let mut peers = vec![NetworkPolicyPeer {
        namespace_selector: Some(LabelSelector {
            match_labels: Some(BTreeMap::from([(
                TENANT_LABEL.to_string(),
                tenant.name_any(),
            )])),
            ..Default::default()
        }),
        ..Default::default()
    }];
    if !isolation.allow_from_namespaces.is_empty() {
        peers.push(NetworkPolicyPeer {
            namespace_selector: Some(LabelSelector {
                // By name, and only outside every tenant: a tenant owner could otherwise create
                // a namespace with an allowed name and reach this tenant's pods from it.
                match_expressions: Some(vec![
                    LabelSelectorRequirement {
                        key: "kubernetes.io/metadata.name".to_string(),
                        operator: "In".to_string(),
                        values: Some(isolation.allow_from_namespaces.clone()),
                    },
                    LabelSelectorRequirement {
                        key: TENANT_LABEL.to_string(),
                        operator: "DoesNotExist".to_string(),
                        values: None,
                    },
                ]),
                ..Default::default()
            }),
            ..Default::default()
        });
    }
    Some(NetworkPolicy {
        metadata: meta(tenant, NETWORK_POLICY_NAME, Some(namespace)),
        spec: Some(NetworkPolicySpec {
            pod_selector: Some(LabelSelector::default()),
            policy_types: Some(vec!["Ingress".to_string()]),
            ingress: Some(vec![NetworkPolicyIngressRule {
                from: Some(peers),
                ..Default::default()
            }]),
            ..Default::default()
        }),
    })
}

fn rbac_subject(s: &crate::crd::Subject) -> RbacSubject {
    match s.kind {
        SubjectKind::ServiceAccount => RbacSubject {
            kind: "ServiceAccount".to_string(),
            name: s.name.clone(),
            namespace: s.namespace.clone(),
            api_group: None,
        },
        kind => RbacSubject {
            kind: kind.to_string(),
            name: s.name.clone(),
            namespace: None,
            api_group: Some("rbac.authorization.k8s.io".to_string()),
        },
    }
}

fn dedup_subjects<'a>(subjects: impl Iterator<Item = &'a crate::crd::Subject>) -> Vec<RbacSubject> {
    let mut seen = std::collections::BTreeSet::new();
    subjects
        .filter(|s| seen.insert((*s).clone()))
        .map(rbac_subject)
        .collect()
}

/// The owners' ClusterRole for `tenant`, honouring the spec's override.
pub fn owner_role<'a>(tenant: &'a Tenant, settings: &'a Settings) -> &'a str {
    tenant
        .spec
        .owner_cluster_role
        .as_deref()
        .unwrap_or(&settings.owner_cluster_role)
}

/// The RoleBindings of one namespace: the owners' (named after the role, because a
/// RoleBinding's roleRef cannot change) and one per additional ClusterRole, subjects merged.
pub fn role_bindings(tenant: &Tenant, namespace: &str, settings: &Settings) -> Vec<RoleBinding> {
    let binding = |name: String, role: &str, subjects: Vec<RbacSubject>| RoleBinding {
        metadata: meta(tenant, &name, Some(namespace)),
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".to_string()),
            kind: "ClusterRole".to_string(),
            name: role.to_string(),
        },
        subjects: Some(subjects),
    };
    let role = owner_role(tenant, settings);
    let mut out = vec![binding(
        format!("tenant-owner-{role}"),
        role,
        dedup_subjects(tenant.spec.owners.iter()),
    )];
    let mut by_role: BTreeMap<&str, Vec<&crate::crd::Subject>> = BTreeMap::new();
    for extra in &tenant.spec.additional_role_bindings {
        by_role
            .entry(extra.cluster_role.as_str())
            .or_default()
            .extend(extra.subjects.iter());
    }
    for (role, subjects) in by_role {
        out.push(binding(
            format!("tenant-{role}"),
            role,
            dedup_subjects(subjects.into_iter()),
        ));
    }
    out
}

/// Name of the ConfigMap in each tenant namespace holding the tenant's `spec.policies` for the
/// admission policies (their `params`).
pub const POLICY_PARAMS: &str = "tenancy.steward.dev-policies";

/// The `spec.policies` of `tenant` as the admission policies read them in `namespace`: one key
/// per rule that is set, lists joined with `,`, the node selector as `k=v,…`. Written for
/// every tenant, empty when no rule is set: the policies refuse a tenant namespace without
/// it (their `parameterNotFoundAction` is `Deny`).
pub fn policy_params(tenant: &Tenant, namespace: &str) -> ConfigMap {
    let mut data = BTreeMap::new();
    let Some(p) = tenant.spec.policies.as_ref() else {
        return ConfigMap {
            metadata: meta(tenant, POLICY_PARAMS, Some(namespace)),
            data: Some(data),
            ..Default::default()
        };
    };
    let mut list = |key: &str, values: Vec<String>| {
        if !values.is_empty() {
            data.insert(key.to_string(), values.join(","));
        }
    };
    list("allowedRegistries", p.allowed_registries.clone());
    list("allowedStorageClasses", p.allowed_storage_classes.clone());
    list("allowedIngressClasses", p.allowed_ingress_classes.clone());
    list("allowedPriorityClasses", p.allowed_priority_classes.clone());
    list("allowedRuntimeClasses", p.allowed_runtime_classes.clone());
    list(
        "forbiddenServiceTypes",
        p.forbidden_service_types
            .iter()
            .map(|t| format!("{t:?}"))
            .collect(),
    );
    list(
        "nodeSelector",
        p.node_selector
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect(),
    );
    if let Some(class) = &p.default_runtime_class {
        data.insert("defaultRuntimeClass".to_string(), class.clone());
    }
    if let Some(policy) = p.image_pull_policy {
        data.insert("imagePullPolicy".to_string(), format!("{policy:?}"));
    }
    if p.forbid_external_ips {
        data.insert("forbidExternalIPs".to_string(), "true".to_string());
    }
    ConfigMap {
        metadata: meta(tenant, POLICY_PARAMS, Some(namespace)),
        data: Some(data),
        ..Default::default()
    }
}

/// Name of the per-tenant ClusterRole and ClusterRoleBinding.
pub fn owner_cluster_object_name(tenant: &Tenant) -> String {
    format!("{GROUP}:owner:{}", tenant.name_any())
}

/// The ClusterRole of the tenant's owners: read their Tenant, the custom verb `own` on it
/// (which the admission policies check with `authorizer`), create namespaces (which the
/// policies limit to namespaces labelled for a tenant they own, within `maxNamespaces`), and
/// `get` on the tenant's `namespaces` by name, so `kubectl get namespace <name>` works for
/// them (RBAC cannot filter a `list`, so listing all namespaces stays refused).
pub fn owner_cluster_role(tenant: &Tenant, namespaces: &[String]) -> ClusterRole {
    let see = (!namespaces.is_empty()).then(|| PolicyRule {
        api_groups: Some(vec![String::new()]),
        resources: Some(vec!["namespaces".to_string()]),
        resource_names: Some(namespaces.to_vec()),
        verbs: vec!["get".to_string()],
        ..Default::default()
    });
    ClusterRole {
        metadata: meta(tenant, &owner_cluster_object_name(tenant), None),
        rules: Some(
            vec![
                PolicyRule {
                    api_groups: Some(vec![GROUP.to_string()]),
                    resources: Some(vec!["tenants".to_string()]),
                    resource_names: Some(vec![tenant.name_any()]),
                    verbs: vec!["get".to_string(), OWN_VERB.to_string()],
                    ..Default::default()
                },
                PolicyRule {
                    api_groups: Some(vec![String::new()]),
                    resources: Some(vec!["namespaces".to_string()]),
                    verbs: vec!["create".to_string()],
                    ..Default::default()
                },
            ]
            .into_iter()
            .chain(see)
            .collect(),
        ),
        ..Default::default()
    }
}

/// Binds [`owner_cluster_role`] to the owners.
pub fn owner_cluster_role_binding(tenant: &Tenant) -> ClusterRoleBinding {
    let name = owner_cluster_object_name(tenant);
    ClusterRoleBinding {
        metadata: meta(tenant, &name, None),
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".to_string()),
            kind: "ClusterRole".to_string(),
            name,
        },
        subjects: Some(dedup_subjects(tenant.spec.owners.iter())),
    }
}

/// Name of the Role and RoleBinding in each tenant namespace through which the operator reads
/// and changes its copies and the policy parameters there, by name: it holds no cluster-wide
/// read of Secrets or ConfigMaps.
pub const ACCESS_ROLE: &str = "tenancy.steward.dev:tenant-operator";

/// Verbs of [`access_role`]: reading a copy, applying it (server-side apply is a patch; the
/// first one also needs `create`, which the operator holds cluster-wide, as RBAC cannot limit
/// it by name) and deleting it.
pub const ACCESS_VERBS: [&str; 3] = ["get", "patch", "delete"];

/// The Secrets and ConfigMaps the operator may read and change in one namespace, by name.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Access {
    pub secrets: BTreeSet<String>,
    pub config_maps: BTreeSet<String>,
}

impl Access {
    /// What `role` (an [`access_role`]) grants.
    pub fn of(role: &Role) -> Access {
        let mut access = Access::default();
        for rule in role.rules.iter().flatten() {
            let names = rule.resource_names.iter().flatten().cloned();
            for resource in rule.resources.iter().flatten() {
                match resource.as_str() {
                    "secrets" => access.secrets.extend(names.clone()),
                    "configmaps" => access.config_maps.extend(names.clone()),
                    _ => {}
                }
            }
        }
        access
    }

    /// What either grants.
    pub fn union(&self, other: &Access) -> Access {
        Access {
            secrets: self.secrets.union(&other.secrets).cloned().collect(),
            config_maps: self
                .config_maps
                .union(&other.config_maps)
                .cloned()
                .collect(),
        }
    }

    /// What `self` grants and `other` does not.
    pub fn minus(&self, other: &Access) -> Access {
        Access {
            secrets: self.secrets.difference(&other.secrets).cloned().collect(),
            config_maps: self
                .config_maps
                .difference(&other.config_maps)
                .cloned()
                .collect(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.secrets.is_empty() && self.config_maps.is_empty()
    }
}

/// The operator's Role in `namespace`: [`ACCESS_VERBS`] on the Secrets and ConfigMaps named
/// in `access`, nothing else.
pub fn access_role(tenant: &Tenant, namespace: &str, access: &Access) -> Role {
    let rule = |resource: &str, names: &BTreeSet<String>| {
        (!names.is_empty()).then(|| PolicyRule {
            api_groups: Some(vec![String::new()]),
            resources: Some(vec![resource.to_string()]),
            resource_names: Some(names.iter().cloned().collect()),
            verbs: ACCESS_VERBS.iter().map(|v| v.to_string()).collect(),
            ..Default::default()
        })
    };
    Role {
        metadata: meta(tenant, ACCESS_ROLE, Some(namespace)),
        rules: Some(
            [
                rule("secrets", &access.secrets),
                rule("configmaps", &access.config_maps),
            ]
            .into_iter()
            .flatten()
            .collect(),
        ),
    }
}

/// Binds [`access_role`] in `namespace` to the operator itself, user `me` (a ServiceAccount's
/// user name becomes a ServiceAccount subject).
pub fn access_role_binding(tenant: &Tenant, namespace: &str, me: &str) -> RoleBinding {
    let subject = match me
        .strip_prefix("system:serviceaccount:")
        .and_then(|rest| rest.split_once(':'))
    {
        Some((ns, name)) => RbacSubject {
            kind: "ServiceAccount".to_string(),
            namespace: Some(ns.to_string()),
            name: name.to_string(),
            ..Default::default()
        },
        None => RbacSubject {
            kind: "User".to_string(),
            api_group: Some("rbac.authorization.k8s.io".to_string()),
            name: me.to_string(),
            ..Default::default()
        },
    };
    RoleBinding {
        metadata: meta(tenant, ACCESS_ROLE, Some(namespace)),
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".to_string()),
            kind: "Role".to_string(),
            name: ACCESS_ROLE.to_string(),
        },
        subjects: Some(vec![subject]),
    }
}

fn copy_meta(tenant: &Tenant, namespace: &str, source: &ObjectMeta) -> ObjectMeta {
    let mut m = meta(
        tenant,
        source.name.as_deref().unwrap_or_default(),
        Some(namespace),
    );
    m.annotations = Some(BTreeMap::from([(
        SOURCE_ANNOTATION.to_string(),
        format!(
            "{}/{}",
            source.namespace.as_deref().unwrap_or_default(),
            source.name.as_deref().unwrap_or_default()
        ),
    )]));
    m
}

/// A copy of `source` in `namespace` (data and type; not the source's labels).
pub fn shared_secret(tenant: &Tenant, namespace: &str, source: &Secret) -> Secret {
    Secret {
        metadata: copy_meta(tenant, namespace, &source.metadata),
        data: source.data.clone().filter(|d| !d.is_empty()),
        type_: source.type_.clone(),
        ..Default::default()
    }
}

/// A copy of `source` in `namespace` (data and binaryData; not the source's labels).
pub fn shared_config_map(tenant: &Tenant, namespace: &str, source: &ConfigMap) -> ConfigMap {
    ConfigMap {
        metadata: copy_meta(tenant, namespace, &source.metadata),
        data: source.data.clone().filter(|d| !d.is_empty()),
        binary_data: source.binary_data.clone().filter(|d| !d.is_empty()),
        ..Default::default()
    }
}

/// The source of a shared object, as the operator's cache holds it.
pub enum Source {
    /// A shared Secret.
    Secret(Arc<Secret>),
    /// A shared ConfigMap.
    ConfigMap(Arc<ConfigMap>),
}

/// A tenant's copy of a shared object.
pub enum SharedCopy {
    /// A copy of a shared Secret.
    Secret(Secret),
    /// A copy of a shared ConfigMap.
    ConfigMap(ConfigMap),
}

impl SharedCopy {
    /// `Secret` or `ConfigMap`.
    pub fn kind(&self) -> &'static str {
        match self {
            SharedCopy::Secret(_) => "Secret",
            SharedCopy::ConfigMap(_) => "ConfigMap",
        }
    }

    /// The copy's name (its source's).
    pub fn name(&self) -> String {
        match self {
            SharedCopy::Secret(s) => s.name_any(),
            SharedCopy::ConfigMap(c) => c.name_any(),
        }
    }
}

/// What a tenant wants in one of its namespaces besides its ResourceQuota
/// [`QUOTA_NAME`] (which is split across namespaces, see [`crate::quota`]), per kind.
/// Applied limits and isolation first, admission parameters before access, access last.
#[derive(Default)]
pub struct NamespaceChildren {
    /// The spec's additional ResourceQuotas.
    pub quotas: Vec<ResourceQuota>,
    /// The LimitRange, if the spec asks for defaults or limits.
    pub limit_ranges: Vec<LimitRange>,
    /// The isolating NetworkPolicy and the spec's additional ones.
    pub network_policies: Vec<NetworkPolicy>,
    /// The parameters of the tenant's admission policies.
    pub policy_params: Vec<ConfigMap>,
    /// Copies of the shared objects whose source exists (not in the source's namespace).
    pub copies: Vec<SharedCopy>,
    /// The shared objects whose source was not found, as `Kind namespace/name`.
    pub missing_sources: Vec<String>,
    /// The owners' and other subjects' RoleBindings.
    pub role_bindings: Vec<RoleBinding>,
}

impl NamespaceChildren {
    /// What the operator must reach by name here: the copies and the policy parameters.
    pub fn access(&self) -> Access {
        let named = |kind: &str| {
            self.copies
                .iter()
                .filter(|c| c.kind() == kind)
                .map(SharedCopy::name)
                .collect::<BTreeSet<_>>()
        };
        let mut config_maps = named("ConfigMap");
        config_maps.extend(self.policy_params.iter().map(|c| c.name_any()));
        Access {
            secrets: named("Secret"),
            config_maps,
        }
    }
}

/// Everything `tenant` wants in namespace `namespace` besides its split ResourceQuota;
/// `source` finds a shared object's source.
pub fn namespace_children(
    tenant: &Tenant,
    namespace: &str,
    settings: &Settings,
    source: impl Fn(&SharedObject) -> Option<Source>,
) -> NamespaceChildren {
    let mut wanted = NamespaceChildren {
        quotas: additional_quotas(tenant, namespace),
        limit_ranges: limit_range(tenant, namespace).into_iter().collect(),
        network_policies: network_policy(tenant, namespace)
            .into_iter()
            .chain(additional_network_policies(tenant, namespace))
            .collect(),
        policy_params: vec![policy_params(tenant, namespace)],
        role_bindings: role_bindings(tenant, namespace, settings),
        ..Default::default()
    };
    for shared in &tenant.spec.shared_objects {
        if shared.namespace == namespace {
            continue;
        }
        match (shared.kind, source(shared)) {
            (SharedKind::Secret, Some(Source::Secret(src))) => wanted
                .copies
                .push(SharedCopy::Secret(shared_secret(tenant, namespace, &src))),
            (SharedKind::ConfigMap, Some(Source::ConfigMap(src))) => wanted.copies.push(
                SharedCopy::ConfigMap(shared_config_map(tenant, namespace, &src)),
            ),
            _ => wanted.missing_sources.push(format!(
                "{:?} {}/{}",
                shared.kind, shared.namespace, shared.name
            )),
        }
    }
    wanted
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
pub(crate) mod tests {
    use super::*;
    use crate::crd::{
        AdditionalRoleBinding, LimitItem, LimitType, NamespaceMetadata, NetworkIsolation,
        PodSecurityLevel, Subject, TenantSpec,
    };

    /// A chainable Tenant fixture: `TenantFixture::new("acme").owner_user("alice").build()`.
    pub struct TenantFixture(Tenant);

    impl TenantFixture {
        pub fn new(name: &str) -> Self {
            let mut t = Tenant::new(name, TenantSpec::default());
            t.metadata.uid = Some(format!("uid-{name}"));
            Self(t)
        }
        pub fn owner_user(mut self, name: &str) -> Self {
            self.0.spec.owners.push(Subject {
                kind: SubjectKind::User,
                name: name.into(),
                namespace: None,
            });
            self
        }
        pub fn owner_sa(mut self, namespace: &str, name: &str) -> Self {
            self.0.spec.owners.push(Subject {
                kind: SubjectKind::ServiceAccount,
                name: name.into(),
                namespace: Some(namespace.into()),
            });
            self
        }
        pub fn spec(mut self, f: impl FnOnce(&mut TenantSpec)) -> Self {
            f(&mut self.0.spec);
            self
        }
        pub fn build(self) -> Tenant {
            self.0
        }
    }

    fn settings() -> Settings {
        Settings {
            protected: Default::default(),
            owner_cluster_role: "admin".into(),
        }
    }

    #[test]
    fn namespace_carries_tenant_pod_security_and_propagated_metadata() {
        let t = TenantFixture::new("acme")
            .owner_user("alice")
            .spec(|s| {
                s.pod_security = Some(PodSecurityLevel::Restricted);
                s.namespace_metadata = Some(NamespaceMetadata {
                    labels: BTreeMap::from([("team".into(), "a".into())]),
                    annotations: BTreeMap::from([("contact".into(), "a@example.com".into())]),
                });
                s.cordoned = true;
            })
            .build();
        let ns = namespace(&t, "acme-dev", true, false);
        let labels = ns.metadata.labels.unwrap();
        assert_eq!(labels[TENANT_LABEL], "acme");
        assert_eq!(labels[DECLARED_LABEL], "true");
        assert_eq!(labels[CORDONED_LABEL], "true");
        assert_eq!(labels[POD_SECURITY_LABEL], "restricted");
        assert_eq!(labels["team"], "a");
        assert_eq!(ns.metadata.annotations.unwrap()["contact"], "a@example.com");

        let owned = namespace(
            &TenantFixture::new("acme").build(),
            "self-made",
            false,
            false,
        );
        let labels = owned.metadata.labels.unwrap();
        assert!(
            !labels.contains_key(DECLARED_LABEL),
            "owner-created namespaces are not declared"
        );
        assert!(!labels.contains_key(CORDONED_LABEL));
        assert!(
            owned.metadata.annotations.is_none(),
            "no empty annotation map"
        );
    }

    #[test]
    fn role_bindings_bind_owners_and_merge_additional_subjects() {
        let t = TenantFixture::new("acme")
            .owner_user("alice")
            .owner_sa("ci", "deployer")
            .owner_user("alice")
            .spec(|s| {
                s.additional_role_bindings = vec![
                    AdditionalRoleBinding {
                        cluster_role: "view".into(),
                        subjects: vec![Subject {
                            kind: SubjectKind::Group,
                            name: "auditors".into(),
                            namespace: None,
                        }],
                    },
                    AdditionalRoleBinding {
                        cluster_role: "view".into(),
                        subjects: vec![Subject {
                            kind: SubjectKind::User,
                            name: "bob".into(),
                            namespace: None,
                        }],
                    },
                ];
            })
            .build();
        let rbs = role_bindings(&t, "acme-dev", &settings());
        let names: Vec<_> = rbs.iter().map(|r| r.name_any()).collect();
        assert_eq!(names, ["tenant-owner-admin", "tenant-view"]);
        let owners = rbs[0].subjects.as_ref().unwrap();
        assert_eq!(owners.len(), 2, "duplicate owners bound once");
        assert_eq!(owners[1].kind, "ServiceAccount");
        assert_eq!(owners[1].namespace.as_deref(), Some("ci"));
        assert_eq!(owners[1].api_group, None);
        assert_eq!(
            owners[0].api_group.as_deref(),
            Some("rbac.authorization.k8s.io")
        );
        assert_eq!(
            rbs[1].subjects.as_ref().unwrap().len(),
            2,
            "subjects of one role merged"
        );
        assert!(
            rbs.iter()
                .all(|r| r.namespace().as_deref() == Some("acme-dev"))
        );

        let custom = TenantFixture::new("acme")
            .owner_user("alice")
            .spec(|s| s.owner_cluster_role = Some("edit".into()))
            .build();
        assert_eq!(
            role_bindings(&custom, "n", &settings())[0].role_ref.name,
            "edit"
        );
        assert_eq!(
            role_bindings(&custom, "n", &settings())[0].name_any(),
            "tenant-owner-edit"
        );
    }

    #[test]
    fn network_policy_admits_the_tenant_and_allowed_namespaces_only() {
        let t = TenantFixture::new("acme")
            .spec(|s| {
                s.network_isolation = Some(NetworkIsolation {
                    enabled: true,
                    allow_from_namespaces: vec!["ingress".into()],
                })
            })
            .build();
        let np = network_policy(&t, "acme-dev").unwrap();
        let spec = np.spec.unwrap();
        assert_eq!(
            spec.pod_selector,
            Some(LabelSelector::default()),
            "all pods"
        );
        assert_eq!(
            spec.policy_types.as_deref(),
            Some(&["Ingress".to_string()][..])
        );
        let from = spec.ingress.unwrap()[0].from.clone().unwrap();
        assert_eq!(
            from[0]
                .namespace_selector
                .as_ref()
                .unwrap()
                .match_labels
                .as_ref()
                .unwrap()[TENANT_LABEL],
            "acme"
        );
        let allowed = from[1]
            .namespace_selector
            .as_ref()
            .unwrap()
            .match_expressions
            .as_ref()
            .unwrap();
        assert_eq!(
            allowed[0].values.as_deref(),
            Some(&["ingress".to_string()][..])
        );
        assert_eq!(
            (allowed[1].key.as_str(), allowed[1].operator.as_str()),
            (TENANT_LABEL, "DoesNotExist"),
            "an allowed name that a tenant owns (perhaps squatted by its owner) is no peer"
        );

        assert!(
            network_policy(&TenantFixture::new("x").build(), "n").is_some(),
            "isolation is on by default"
        );
        let off = TenantFixture::new("x")
            .spec(|s| {
                s.network_isolation = Some(NetworkIsolation {
                    enabled: false,
                    allow_from_namespaces: vec![],
                })
            })
            .build();
        assert!(network_policy(&off, "n").is_none());
    }

    #[test]
    fn quota_and_limits_render_quantities() {
        let t = TenantFixture::new("acme")
            .spec(|s| {
                s.limit_range = Some(crate::crd::LimitRangeSpec {
                    limits: vec![LimitItem {
                        type_: LimitType::Container,
                        default: BTreeMap::from([("cpu".into(), "500m".into())]),
                        default_request: BTreeMap::from([("memory".into(), "128Mi".into())]),
                        max: BTreeMap::new(),
                        min: BTreeMap::new(),
                    }],
                })
            })
            .build();
        let hard = BTreeMap::from([
            ("pods".to_string(), Milli::units(4)),
            ("requests.memory".to_string(), Milli::units(1 << 30)),
        ]);
        let rq = resource_quota(&t, "acme-dev", &hard);
        let h = rq.spec.unwrap().hard.unwrap();
        assert_eq!(h["pods"].0, "4");
        assert_eq!(h["requests.memory"].0, "1Gi");
        let lr = limit_range(&t, "acme-dev").unwrap();
        let item = &lr.spec.unwrap().limits[0];
        assert_eq!(item.type_, "Container");
        assert_eq!(item.default.as_ref().unwrap()["cpu"].0, "500m");
        assert!(item.max.is_none(), "empty maps are left out");
        assert!(limit_range(&TenantFixture::new("x").build(), "n").is_none());
    }

    #[test]
    fn owners_may_own_their_tenant_and_create_namespaces() {
        let t = TenantFixture::new("acme").owner_user("alice").build();
        let role = owner_cluster_role(&t, &[]);
        assert_eq!(
            role.rules.as_ref().unwrap().len(),
            2,
            "no namespaces, nothing to see"
        );
        let role = owner_cluster_role(&t, &["acme-dev".to_string()]);
        let rules = role.rules.unwrap();
        assert_eq!(
            (
                rules[2].verbs.as_slice(),
                rules[2].resource_names.as_deref()
            ),
            (
                &["get".to_string()][..],
                Some(&["acme-dev".to_string()][..])
            ),
            "owners get their namespaces by name"
        );
        assert_eq!(
            rules[0].resource_names.as_deref(),
            Some(&["acme".to_string()][..])
        );
        assert!(rules[0].verbs.contains(&OWN_VERB.to_string()));
        assert_eq!(rules[1].verbs, ["create"]);
        let binding = owner_cluster_role_binding(&t);
        assert_eq!(binding.role_ref.name, role.metadata.name.unwrap());
        assert_eq!(binding.subjects.unwrap()[0].name, "alice");
    }

    #[test]
    fn shared_copies_keep_data_and_name_their_source() {
        let t = TenantFixture::new("acme").build();
        let mut source = Secret::default();
        source.metadata.name = Some("registry".into());
        source.metadata.namespace = Some("shared".into());
        source.metadata.labels = Some(BTreeMap::from([(
            "tenancy.steward.dev/shareable".into(),
            "true".into(),
        )]));
        source.type_ = Some("kubernetes.io/dockerconfigjson".into());
        source.data = Some(BTreeMap::from([(
            ".dockerconfigjson".into(),
            k8s_openapi::ByteString(b"{}".to_vec()),
        )]));
        let copy = shared_secret(&t, "acme-dev", &source);
        assert_eq!(copy.metadata.namespace.as_deref(), Some("acme-dev"));
        assert_eq!(copy.metadata.name.as_deref(), Some("registry"));
        assert_eq!(copy.type_, source.type_);
        assert_eq!(copy.data, source.data);
        assert_eq!(
            copy.metadata.annotations.unwrap()[SOURCE_ANNOTATION],
            "shared/registry"
        );
        assert!(
            !copy
                .metadata
                .labels
                .unwrap()
                .contains_key("tenancy.steward.dev/shareable"),
            "copies are not sources"
        );
    }

    #[test]
    fn a_namespace_wants_its_isolation_and_access_and_copies_of_found_sources_only() {
        let shared = |kind, namespace: &str, name: &str| SharedObject {
            kind,
            namespace: namespace.into(),
            name: name.into(),
        };
        let t = TenantFixture::new("acme")
            .owner_user("alice")
            .spec(|s| {
                s.shared_objects = vec![
                    shared(SharedKind::Secret, "shared", "registry"),
                    shared(SharedKind::ConfigMap, "shared", "gone"),
                    shared(SharedKind::ConfigMap, "acme-dev", "local"),
                ];
            })
            .build();
        let mut registry = Secret::default();
        registry.metadata.name = Some("registry".into());
        registry.metadata.namespace = Some("shared".into());
        let registry = Arc::new(registry);
        let wanted = namespace_children(&t, "acme-dev", &settings(), |s| {
            (s.name == "registry").then(|| Source::Secret(registry.clone()))
        });
        assert_eq!(wanted.network_policies.len(), 1, "the isolating policy");
        assert_eq!(wanted.role_bindings.len(), 1, "alice's binding");
        assert!(wanted.limit_ranges.is_empty() && wanted.quotas.is_empty());
        let copies: Vec<String> = wanted
            .copies
            .iter()
            .map(|c| match c {
                SharedCopy::Secret(s) => format!("Secret {}", s.name_any()),
                SharedCopy::ConfigMap(c) => format!("ConfigMap {}", c.name_any()),
            })
            .collect();
        assert_eq!(
            copies,
            ["Secret registry"],
            "no copy into the source's namespace"
        );
        assert_eq!(wanted.missing_sources, ["ConfigMap shared/gone"]);
    }

    #[test]
    fn release_keys_cover_everything_namespace_sets() {
        let t = TenantFixture::new("acme")
            .spec(|s| {
                s.pod_security = Some(PodSecurityLevel::Baseline);
                s.namespace_metadata = Some(NamespaceMetadata {
                    labels: BTreeMap::from([("team".into(), "a".into())]),
                    annotations: BTreeMap::from([("contact".into(), "x".into())]),
                });
            })
            .build();
        let (labels, annotations) = namespace_metadata_keys(&t);
        for k in [
            TENANT_LABEL,
            DECLARED_LABEL,
            ADOPTED_LABEL,
            CORDONED_LABEL,
            POD_SECURITY_LABEL,
            "team",
            steward_core::apply::OWNER_LABEL,
        ] {
            assert!(labels.contains(&k.to_string()), "{k}");
        }
        assert_eq!(
            annotations,
            [
                "contact",
                crate::crd::CREATED_FOR_ANNOTATION,
                steward_core::apply::APPLIED_ANNOTATION
            ],
            "the creation marker and the applied digest go too"
        );
    }

    #[test]
    fn policy_params_hold_only_the_rules_that_are_set() {
        use crate::crd::{PullPolicy, ServiceType, TenantPolicies};
        let none = policy_params(&TenantFixture::new("t").build(), "ns");
        assert_eq!(
            none.data,
            Some(BTreeMap::new()),
            "written, empty, for a tenant without spec.policies"
        );
        let t = TenantFixture::new("t")
            .spec(|s| {
                s.policies = Some(TenantPolicies {
                    allowed_registries: vec!["a.example/".into(), "b.example/x/".into()],
                    image_pull_policy: Some(PullPolicy::Always),
                    forbidden_service_types: vec![ServiceType::NodePort],
                    forbid_external_ips: true,
                    node_selector: [("pool".to_string(), "t".to_string())].into(),
                    ..TenantPolicies::default()
                })
            })
            .build();
        let cm = policy_params(&t, "ns");
        assert_eq!(cm.metadata.name.as_deref(), Some(POLICY_PARAMS));
        assert_eq!(cm.metadata.namespace.as_deref(), Some("ns"));
        let data = cm.data.unwrap();
        assert_eq!(
            data,
            [
                ("allowedRegistries", "a.example/,b.example/x/"),
                ("forbidExternalIPs", "true"),
                ("forbiddenServiceTypes", "NodePort"),
                ("imagePullPolicy", "Always"),
                ("nodeSelector", "pool=t"),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
        );
        let none = TenantFixture::new("t")
            .spec(|s| s.policies = Some(TenantPolicies::default()))
            .build();
        assert_eq!(
            policy_params(&none, "ns").data,
            Some(BTreeMap::new()),
            "an empty policies block writes no rule"
        );
    }
}
