//! Enforcement without a webhook server: ValidatingAdmissionPolicies (CEL evaluated inside the
//! API server) and their bindings.
//!
//! | policy | denies (to everyone but the exempt) |
//! |---|---|
//! | `…-managed-objects` | updating or deleting the quotas, limit ranges, network policies, roles, role bindings and shared copies the operator manages in tenant namespaces |
//! | `…-namespace-labels` | changing, adding or removing `tenancy.steward.dev/*` and `pod-security.kubernetes.io/*` labels of tenant namespaces |
//! | `…-namespace-owner` | creating a namespace labelled for a tenant the requester does not own, or with other `tenancy.steward.dev/*` or Pod Security labels |
//! | `…-namespace-allowance` | a tenant owner creating an unlabelled namespace, or one beyond `maxNamespaces`, or for a cordoned tenant; anyone creating a namespace a Tenant lists in `spec.namespaces` (reserved: the operator creates it) (one evaluation per Tenant, the Tenant as `params`) |
//! | `…-cordon` | any create, update, delete or connect (exec, attach, port-forward) in the namespaces of a cordoned tenant, subresources included (scale, eviction, token requests) |
//! | `…-pods` | a pod (created, updated, or given an ephemeral container) whose images are not from `spec.policies.allowedRegistries`, whose containers lack the required `imagePullPolicy`, which names a PriorityClass or RuntimeClass not allowed, or whose `nodeSelector` lacks the tenant's labels |
//! | `…-services` | a Service of a forbidden type, or with `externalIPs` when forbidden |
//! | `…-volume-claims` | a PersistentVolumeClaim not naming an allowed StorageClass |
//! | `…-ingresses` | an Ingress not naming an allowed IngressClass |
//!
//! One MutatingAdmissionPolicy sets defaults before those rules are checked:
//!
//! | policy | adds (for everyone but the exempt) |
//! |---|---|
//! | `…-pod-defaults` | to a pod created in a tenant namespace: the labels of `spec.policies.nodeSelector` its `nodeSelector` lacks (a label it names with another value is left for `…-pods` to refuse), and `spec.policies.defaultRuntimeClass` when it names no RuntimeClass |
//!
//! The last four, and the defaults, read the tenant's `spec.policies` as `params` from the ConfigMap
//! `tenancy.steward.dev-policies` the operator keeps in every tenant namespace (written before
//! the owners get access there, empty for a tenant without `spec.policies`; changing or
//! deleting it is refused by `…-managed-objects`). A tenant namespace without it admits
//! nothing they match (`parameterNotFoundAction: Deny`: they fail closed). They
//! exempt only the operator and `--exempt-user`/`--exempt-group`, not the control plane nor
//! `system:masters`: the pods a ReplicaSet or Job controller creates for the tenant are checked
//! too, whatever credentials the controller manager runs with.
//!
//! "Owner" is decided by the RBAC authorizer: a subject owns tenant `t` when it may use the
//! custom verb `own` on `tenants/t`, which the operator grants to the owners (see
//! [`crate::build::owner_cluster_role`]).
//!
//! # Exemptions
//! The operator's own user (found with a SelfSubjectReview at startup), the control plane
//! (`system:kube-controller-manager`, `system:kube-scheduler`, kube-system ServiceAccounts such
//! as the garbage collector and the namespace controller, the `system:nodes` and
//! `system:masters` groups) and any `--exempt-user`/`--exempt-group` pass every policy.
//!
//! # Caveats
//! `maxNamespaces` is checked against the Tenant's status, so namespaces created in the same
//! instant can all pass. The limit is held by the operator instead: it admits owner-created
//! namespaces oldest first within the limit and deletes the rest before anyone is given access
//! in them (see [`crate::namespaces`]); this policy only turns most of them away early.

use std::sync::Arc;
use std::time::Duration;

use futures::{FutureExt, Stream, StreamExt};
use k8s_openapi::api::admissionregistration::v1::{
    JSONPatch, MatchCondition, MatchResources, MutatingAdmissionPolicy,
    MutatingAdmissionPolicyBinding, MutatingAdmissionPolicyBindingSpec,
    MutatingAdmissionPolicySpec, Mutation, NamedRuleWithOperations, ParamKind, ParamRef,
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
    ValidatingAdmissionPolicyBindingSpec, ValidatingAdmissionPolicySpec, Validation, Variable,
};
use k8s_openapi::api::authentication::v1::SelfSubjectReview;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{
    LabelSelector, LabelSelectorRequirement, ObjectMeta,
};
use kube::api::{Api, PostParams};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Client, Resource, ResourceExt};
use tokio_util::sync::CancellationToken;

use crate::build::{OWN_VERB, POLICY_PARAMS};
use crate::crd::{CORDONED_LABEL, GROUP, TENANT_LABEL};
use steward_core::apply::{Children, Outcome, WriteCounter, unowned_body};

/// Every Pod Security admission label (`enforce`, `enforce-version`, `warn`, `audit`, …).
const POD_SECURITY_PREFIX: &str = "pod-security.kubernetes.io/";

/// The control plane's own users (exempt from the tenancy policies, not from the rules of
/// `spec.policies`).
const CONTROL_PLANE_USERS: [&str; 2] = ["system:kube-controller-manager", "system:kube-scheduler"];
/// The nodes' group.
const CONTROL_PLANE_GROUP: &str = "system:nodes";
/// Cluster admins.
const MASTERS_GROUP: &str = "system:masters";

/// Who passes every policy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Exemptions {
    pub users: Vec<String>,
    pub groups: Vec<String>,
    pub user_prefixes: Vec<String>,
}

impl Exemptions {
    /// The control plane, plus `users` and `groups` (the operator's own user among them).
    pub fn new(
        users: impl IntoIterator<Item = String>,
        groups: impl IntoIterator<Item = String>,
    ) -> Self {
        let mut u: Vec<String> = CONTROL_PLANE_USERS.into_iter().map(String::from).collect();
        u.extend(users);
        u.sort();
        u.dedup();
        let mut g: Vec<String> = [MASTERS_GROUP, CONTROL_PLANE_GROUP]
            .into_iter()
            .map(String::from)
            .collect();
        g.extend(groups);
        g.sort();
        g.dedup();
        Self {
            users: u,
            groups: g,
            user_prefixes: vec!["system:serviceaccount:kube-system:".to_string()],
        }
    }

    /// These exemptions without the control plane's users, groups and kube-system
    /// ServiceAccounts, and without `system:masters`: for rules on what a tenant's namespaces
    /// hold, which must also hold for the pods controllers create on the tenant's behalf (a
    /// controller manager may run with `system:masters` credentials). Cluster admins who must
    /// pass them are named with `--exempt-user`/`--exempt-group`.
    pub fn without_control_plane(&self) -> Self {
        Self {
            users: self
                .users
                .iter()
                .filter(|u| !CONTROL_PLANE_USERS.contains(&u.as_str()))
                .cloned()
                .collect(),
            groups: self
                .groups
                .iter()
                .filter(|g| ![CONTROL_PLANE_GROUP, MASTERS_GROUP].contains(&g.as_str()))
                .cloned()
                .collect(),
            user_prefixes: Vec::new(),
        }
    }

    /// A CEL expression true for exempt requesters.
    pub fn cel(&self) -> String {
        let list = |v: &[String]| {
            v.iter()
                .map(|s| cel_string(s))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let mut parts = vec![format!(
            "request.userInfo.username in [{}]",
            list(&self.users)
        )];
        for p in &self.user_prefixes {
            parts.push(format!(
                "request.userInfo.username.startsWith({})",
                cel_string(p)
            ));
        }
        parts.push(format!(
            "request.userInfo.groups.exists(g, g in [{}])",
            list(&self.groups)
        ));
        parts.join(" || ")
    }
}

/// CEL: image `i` comes from `r`, an `allowedRegistries` entry, matched by whole segments: a
/// registry (`r` without `/`) or a path ending in `/` is a prefix of the image up to a `/`; a
/// repository path is the image's repository (followed by its tag or digest, or nothing).
const IMAGE_FROM_REGISTRY: &str = "i.startsWith(r.endsWith('/') ? r : r + '/') || \
     (r.contains('/') && (i == r || i.startsWith(r + ':') || i.startsWith(r + '@')))";

/// A CEL string literal.
fn cel_string(s: &str) -> String {
    format!("'{}'", s.replace('\\', "\\\\").replace('\'', "\\'"))
}

/// Name prefix of every policy and binding.
pub const PREFIX: &str = "tenancy.steward.dev";

fn rule(
    groups: &[&str],
    resources: &[&str],
    operations: &[&str],
    scope: Option<&str>,
) -> NamedRuleWithOperations {
    let s = |v: &[&str]| Some(v.iter().map(|x| x.to_string()).collect());
    NamedRuleWithOperations {
        api_groups: s(groups),
        api_versions: s(&["*"]),
        resources: s(resources),
        operations: s(operations),
        scope: scope.map(str::to_string),
        ..Default::default()
    }
}

fn exists(key: &str) -> LabelSelector {
    LabelSelector {
        match_expressions: Some(vec![LabelSelectorRequirement {
            key: key.to_string(),
            operator: "Exists".to_string(),
            values: None,
        }]),
        ..Default::default()
    }
}

fn equals(key: &str, value: &str) -> LabelSelector {
    LabelSelector {
        match_labels: Some([(key.to_string(), value.to_string())].into()),
        ..Default::default()
    }
}

fn validation(expression: &str, message: &str, message_expression: Option<&str>) -> Validation {
    Validation {
        expression: expression.to_string(),
        message: Some(message.to_string()),
        message_expression: message_expression.map(str::to_string),
        reason: Some("Forbidden".to_string()),
    }
}

fn variable(name: &str, expression: &str) -> Variable {
    Variable {
        name: name.to_string(),
        expression: expression.to_string(),
    }
}

fn metadata(name: &str, manager: &str) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.to_string()),
        labels: Some(
            [(
                steward_core::apply::MANAGED_BY_LABEL.to_string(),
                manager.to_string(),
            )]
            .into(),
        ),
        ..Default::default()
    }
}

/// One policy and its binding.
#[derive(Clone, Debug, PartialEq)]
pub struct Policy {
    pub policy: ValidatingAdmissionPolicy,
    pub binding: ValidatingAdmissionPolicyBinding,
}

/// One mutating policy and its binding.
#[derive(Clone, Debug, PartialEq)]
pub struct Defaulting {
    pub policy: MutatingAdmissionPolicy,
    pub binding: MutatingAdmissionPolicyBinding,
}

/// Every admission policy the operator keeps: the rules and the defaults.
#[derive(Clone, Debug, PartialEq)]
pub struct Policies {
    pub validating: Vec<Policy>,
    pub mutating: Vec<Defaulting>,
}

impl Policies {
    /// Every policy and binding, managed by `manager`: the rules exempting `exempt` and the
    /// `operator`'s own user, the defaults exempting `exempt` without the control plane (never
    /// the operator, which creates no pods: so they are the same whoever installs them, see
    /// [`deployed_defaults`]).
    pub fn new(exempt: &Exemptions, operator: Option<&str>, manager: &str) -> Self {
        let with_operator = Exemptions::new(
            exempt
                .users
                .iter()
                .cloned()
                .chain(operator.map(String::from)),
            exempt.groups.iter().cloned(),
        );
        Self {
            validating: policies(&with_operator, manager),
            mutating: defaults(exempt, manager),
        }
    }

    /// The names of every policy and binding.
    pub fn names(&self) -> Vec<String> {
        let validating = self.validating.iter().flat_map(|p| {
            [
                p.policy.metadata.name.clone(),
                p.binding.metadata.name.clone(),
            ]
        });
        let mutating = self.mutating.iter().flat_map(|p| {
            [
                p.policy.metadata.name.clone(),
                p.binding.metadata.name.clone(),
            ]
        });
        validating.chain(mutating).flatten().collect()
    }
}

/// The defaults of `spec.policies` for pods, as JSON Patch operations built in CEL from the
/// tenant's [`POLICY_PARAMS`]: `add` only what the pod lacks (a JSON Patch `add` of a map key
/// that exists would replace its value).
fn pod_defaults_patch() -> String {
    let rules = "variables.rules";
    let has_selector = "has(object.spec.nodeSelector)";
    [
        // The map first, when the pod has none: the labels are added into it.
        format!(
            "('nodeSelector' in {rules} && !{has_selector} ? [JSONPatch{{op: 'add', path: '/spec/nodeSelector', value: {{}}}}] : [])"
        ),
        format!(
            "('nodeSelector' in {rules} ? {rules}['nodeSelector'].split(',').filter(kv, !{has_selector} || !(kv.split('=')[0] in object.spec.nodeSelector)).map(kv, JSONPatch{{op: 'add', path: '/spec/nodeSelector/' + jsonpatch.escapeKey(kv.split('=')[0]), value: kv.split('=')[1]}}) : [])"
        ),
        format!(
            "('defaultRuntimeClass' in {rules} && !has(object.spec.runtimeClassName) ? [JSONPatch{{op: 'add', path: '/spec/runtimeClassName', value: {rules}['defaultRuntimeClass']}}] : [])"
        ),
    ]
    .join(" + ")
}

/// The mutating policies, exempting `exempt` without the control plane (as the rules of
/// `spec.policies` do: what is defaulted is what is then checked, the pods a ReplicaSet
/// creates included).
pub fn defaults(exempt: &Exemptions, manager: &str) -> Vec<Defaulting> {
    let exempt = exempt.without_control_plane();
    let name = format!("{PREFIX}-pod-defaults");
    let spec = MutatingAdmissionPolicySpec {
        failure_policy: Some("Fail".to_string()),
        param_kind: Some(params_kind()),
        match_constraints: Some(in_tenant_namespaces(vec![rule(
            &[""],
            &["pods"],
            &["CREATE"],
            None,
        )])),
        match_conditions: Some(vec![MatchCondition {
            name: "not-exempt".to_string(),
            expression: format!("!({})", exempt.cel()),
        }]),
        variables: Some(vec![rules_variable()]),
        mutations: Some(vec![Mutation {
            patch_type: "JSONPatch".to_string(),
            json_patch: Some(JSONPatch {
                expression: Some(pod_defaults_patch()),
            }),
            apply_configuration: None,
        }]),
        // Each patch adds only what is missing: running it again changes nothing.
        reinvocation_policy: Some("IfNeeded".to_string()),
    };
    vec![Defaulting {
        policy: MutatingAdmissionPolicy {
            metadata: metadata(&name, manager),
            spec: Some(spec),
        },
        binding: MutatingAdmissionPolicyBinding {
            metadata: metadata(&name, manager),
            spec: Some(MutatingAdmissionPolicyBindingSpec {
                policy_name: Some(name.clone()),
                param_ref: Some(params_in_namespace()),
                match_resources: None,
            }),
        },
    }]
}

/// Every policy, exempting `exempt`; `manager` is the operator's field manager (its children
/// carry `app.kubernetes.io/managed-by=<manager>`).
pub fn policies(exempt: &Exemptions, manager: &str) -> Vec<Policy> {
    let not_exempt = vec![MatchCondition {
        name: "not-exempt".to_string(),
        expression: format!("!({})", exempt.cel()),
    }];
    let tenant_of_object = format!(
        "has(object.metadata.labels) && '{TENANT_LABEL}' in object.metadata.labels ? object.metadata.labels['{TENANT_LABEL}'] : ''"
    );
    let owns = |tenant: &str| {
        format!(
            "authorizer.group('{GROUP}').resource('tenants').name({tenant}).check('{OWN_VERB}').allowed()"
        )
    };
    // The whole Pod Security prefix: `enforce-version: v1.0` weakens `enforce` as surely as
    // changing it.
    let protected_labels =
        format!("k.startsWith('{GROUP}/') || k.startsWith('{POD_SECURITY_PREFIX}')");

    let make = |suffix: &str, spec: ValidatingAdmissionPolicySpec, param_ref: Option<ParamRef>| {
        let name = format!("{PREFIX}-{suffix}");
        Policy {
            policy: ValidatingAdmissionPolicy {
                metadata: metadata(&name, manager),
                spec: Some(spec),
                ..Default::default()
            },
            binding: ValidatingAdmissionPolicyBinding {
                metadata: metadata(&name, manager),
                spec: ValidatingAdmissionPolicyBindingSpec {
                    policy_name: name.clone(),
                    param_ref,
                    validation_actions: vec!["Deny".to_string()],
                    ..Default::default()
                },
            },
        }
    };

    vec![
        make(
            "managed-objects",
            ValidatingAdmissionPolicySpec {
                failure_policy: Some("Fail".to_string()),
                match_constraints: Some(MatchResources {
                    namespace_selector: Some(exists(TENANT_LABEL)),
                    object_selector: Some(equals(steward_core::apply::MANAGED_BY_LABEL, manager)),
                    resource_rules: Some(vec![
                        rule(
                            &[""],
                            &["resourcequotas", "limitranges", "secrets", "configmaps"],
                            &["UPDATE", "DELETE"],
                            None,
                        ),
                        rule(
                            &["networking.k8s.io"],
                            &["networkpolicies"],
                            &["UPDATE", "DELETE"],
                            None,
                        ),
                        rule(
                            &["rbac.authorization.k8s.io"],
                            &["roles", "rolebindings"],
                            &["UPDATE", "DELETE"],
                            None,
                        ),
                    ]),
                    ..Default::default()
                }),
                match_conditions: Some(not_exempt.clone()),
                validations: Some(vec![validation(
                    "false",
                    "this object is managed by tenant-operator for its tenant and cannot be changed or deleted; change the Tenant instead",
                    Some(&format!(
                        "request.kind.kind + ' ' + request.namespace + '/' + request.name + ' is managed by {manager} for tenant ' + namespaceObject.metadata.labels['{TENANT_LABEL}'] + ' and cannot be changed or deleted; change the Tenant instead'"
                    )),
                )]),
                ..Default::default()
            },
            None,
        ),
        make(
            "namespace-labels",
            ValidatingAdmissionPolicySpec {
                failure_policy: Some("Fail".to_string()),
                match_constraints: Some(MatchResources {
                    object_selector: Some(exists(TENANT_LABEL)),
                    resource_rules: Some(vec![rule(&[""], &["namespaces"], &["UPDATE"], None)]),
                    ..Default::default()
                }),
                match_conditions: Some(not_exempt.clone()),
                variables: Some(vec![
                    variable(
                        "oldLabels",
                        "has(oldObject.metadata.labels) ? oldObject.metadata.labels : {}",
                    ),
                    variable(
                        "newLabels",
                        "has(object.metadata.labels) ? object.metadata.labels : {}",
                    ),
                ]),
                validations: Some(vec![validation(
                    &format!(
                        "variables.oldLabels.all(k, !({protected_labels}) || (k in variables.newLabels && variables.newLabels[k] == variables.oldLabels[k])) && variables.newLabels.all(k, !({protected_labels}) || k in variables.oldLabels)"
                    ),
                    &format!(
                        "the labels {GROUP}/* and {POD_SECURITY_PREFIX}* of a tenant namespace are managed by tenant-operator; change the Tenant instead"
                    ),
                    None,
                )]),
                ..Default::default()
            },
            None,
        ),
        make(
            "namespace-owner",
            ValidatingAdmissionPolicySpec {
                failure_policy: Some("Fail".to_string()),
                match_constraints: Some(MatchResources {
                    object_selector: Some(exists(TENANT_LABEL)),
                    resource_rules: Some(vec![rule(&[""], &["namespaces"], &["CREATE"], None)]),
                    ..Default::default()
                }),
                match_conditions: Some(not_exempt.clone()),
                variables: Some(vec![variable(
                    "tenant",
                    &format!("object.metadata.labels['{TENANT_LABEL}']"),
                )]),
                validations: Some(vec![
                    validation(
                        &owns("variables.tenant"),
                        "namespaces can only be created for a tenant you own",
                        Some(
                            "'you are not an owner of tenant ' + variables.tenant + '; namespaces can only be created for a tenant you own'",
                        ),
                    ),
                    validation(
                        &format!(
                            "object.metadata.labels.all(k, k == '{TENANT_LABEL}' || !({protected_labels}))"
                        ),
                        &format!(
                            "a new tenant namespace may carry only the label {TENANT_LABEL} of the {GROUP}/* and {POD_SECURITY_PREFIX}* labels; the operator sets the others from the Tenant"
                        ),
                        None,
                    ),
                ]),
                ..Default::default()
            },
            None,
        ),
        make(
            "namespace-allowance",
            ValidatingAdmissionPolicySpec {
                failure_policy: Some("Fail".to_string()),
                param_kind: Some(ParamKind {
                    api_version: Some(format!("{GROUP}/v1alpha1")),
                    kind: Some("Tenant".to_string()),
                }),
                match_constraints: Some(MatchResources {
                    resource_rules: Some(vec![rule(&[""], &["namespaces"], &["CREATE"], None)]),
                    ..Default::default()
                }),
                match_conditions: Some(not_exempt.clone()),
                variables: Some(vec![
                    variable("tenant", &tenant_of_object),
                    variable(
                        "declared",
                        "has(params.spec.namespaces) ? params.spec.namespaces : []",
                    ),
                    variable(
                        "count",
                        "size(variables.declared) + (has(params.status) && has(params.status.namespaces) ? size(params.status.namespaces.filter(n, !(n in variables.declared))) : 0)",
                    ),
                ]),
                validations: Some(vec![
                    validation(
                        &format!(
                            "variables.tenant != '' || !({})",
                            owns("params.metadata.name")
                        ),
                        "tenant owners must label new namespaces with tenancy.steward.dev/tenant",
                        Some(&format!(
                            "'owners of tenant ' + params.metadata.name + ' must label new namespaces with {TENANT_LABEL}=' + params.metadata.name"
                        )),
                    ),
                    validation(
                        "!(object.metadata.name in variables.declared)",
                        "the namespace is reserved: a tenant lists it in spec.namespaces, and the operator creates it",
                        Some(
                            "'namespace ' + object.metadata.name + ' is reserved: tenant ' + params.metadata.name + ' lists it in spec.namespaces, and the operator creates it'",
                        ),
                    ),
                    validation(
                        "variables.tenant != params.metadata.name || !has(params.spec.cordoned) || !params.spec.cordoned",
                        "the tenant is cordoned: no new namespaces",
                        Some(
                            "'tenant ' + params.metadata.name + ' is cordoned: no new namespaces'",
                        ),
                    ),
                    validation(
                        "variables.tenant != params.metadata.name || !has(params.spec.maxNamespaces) || variables.count < params.spec.maxNamespaces",
                        "the tenant has all the namespaces it may have",
                        Some(
                            "'tenant ' + params.metadata.name + ' already has ' + string(variables.count) + ' of its ' + string(params.spec.maxNamespaces) + ' namespaces (maxNamespaces)'",
                        ),
                    ),
                ]),
                ..Default::default()
            },
            Some(ParamRef {
                selector: Some(LabelSelector::default()),
                parameter_not_found_action: Some("Allow".to_string()),
                ..Default::default()
            }),
        ),
        make(
            "cordon",
            ValidatingAdmissionPolicySpec {
                failure_policy: Some("Fail".to_string()),
                match_constraints: Some(MatchResources {
                    namespace_selector: Some(equals(CORDONED_LABEL, "true")),
                    // `*/*`: every resource and subresource (scale, eviction,
                    // serviceaccounts/token, status); CONNECT: exec, attach, port-forward.
                    resource_rules: Some(vec![rule(
                        &["*"],
                        &["*/*"],
                        &["CREATE", "UPDATE", "DELETE", "CONNECT"],
                        Some("Namespaced"),
                    )]),
                    ..Default::default()
                }),
                match_conditions: Some(not_exempt.clone()),
                validations: Some(vec![validation(
                    "false",
                    "the tenant is cordoned: its namespaces are frozen",
                    Some(&format!(
                        "'tenant ' + namespaceObject.metadata.labels['{TENANT_LABEL}'] + ' is cordoned: its namespaces are frozen'"
                    )),
                )]),
                ..Default::default()
            },
            None,
        ),
    ]
    .into_iter()
    .chain(
        tenant_rules(&exempt.without_control_plane())
            .into_iter()
            .map(|(suffix, spec)| make(suffix, spec, Some(params_in_namespace()))),
    )
    .collect()
}

/// The kind of `params`: a ConfigMap (see [`params_in_namespace`]).
fn params_kind() -> ParamKind {
    ParamKind {
        api_version: Some("v1".to_string()),
        kind: Some("ConfigMap".to_string()),
    }
}

/// `variables.rules`: the tenant's rules from `params` (none without them).
fn rules_variable() -> Variable {
    variable("rules", "has(params.data) ? params.data : {}")
}

/// `resources` in the namespaces of a tenant.
fn in_tenant_namespaces(resources: Vec<NamedRuleWithOperations>) -> MatchResources {
    MatchResources {
        namespace_selector: Some(exists(TENANT_LABEL)),
        resource_rules: Some(resources),
        ..Default::default()
    }
}

/// `params`: the ConfigMap [`POLICY_PARAMS`] in the namespace of the object admitted. A
/// tenant namespace without one is refused everything these policies match (fail closed):
/// the operator writes one into every tenant namespace, empty for a tenant without
/// `spec.policies`, before the owners get access there, and nobody else may delete it.
fn params_in_namespace() -> ParamRef {
    ParamRef {
        name: Some(POLICY_PARAMS.to_string()),
        parameter_not_found_action: Some("Deny".to_string()),
        ..Default::default()
    }
}

/// The rules of `spec.policies`, one policy per kind of object: each reads the tenant's rules
/// from [`POLICY_PARAMS`] (written by the reconcile into every tenant namespace, before its
/// owners get access) and checks only the rules that are set there.
/// A tenant rule applies to a create, and to an update only when it changes the spec.
const SPEC_CHANGED: &str = "request.operation != 'UPDATE' || !has(oldObject.spec) || !has(object.spec) || object.spec != oldObject.spec";

fn tenant_rules(exempt: &Exemptions) -> Vec<(&'static str, ValidatingAdmissionPolicySpec)> {
    let tenant = format!("namespaceObject.metadata.labels['{TENANT_LABEL}']");
    let set = |key: &str| format!("'{key}' in variables.rules");
    let list = |key: &str| format!("variables.rules['{key}'].split(',')");
    let because = |key: &str| {
        format!(
            "' (spec.policies.{key} of tenant ' + {tenant} + ': ' + variables.rules['{key}'] + ')'"
        )
    };
    let rules = rules_variable();
    let spec = |resources: Vec<NamedRuleWithOperations>,
                variables: Vec<Variable>,
                validations: Vec<Validation>| ValidatingAdmissionPolicySpec {
        failure_policy: Some("Fail".to_string()),
        param_kind: Some(params_kind()),
        match_constraints: Some(in_tenant_namespaces(resources)),
        match_conditions: Some(vec![
            MatchCondition {
                name: "not-exempt".to_string(),
                expression: format!("!({})", exempt.cel()),
            },
            // An update is judged only when it changes the spec: an object admitted before
            // the policy (or before it changed) can still be labelled, annotated,
            // finalized or orphaned by the garbage collector.
            MatchCondition {
                name: "spec-changed".to_string(),
                expression: SPEC_CHANGED.to_string(),
            },
        ]),
        variables: Some(variables),
        validations: Some(validations),
        ..Default::default()
    };
    // Every container of a pod: regular, init and ephemeral.
    let of_containers = |field: &str| {
        ["containers", "initContainers", "ephemeralContainers"]
            .iter()
            .map(|list| {
                format!(
                    "(has(object.spec.{list}) ? object.spec.{list}.map(c, has(c.{field}) ? c.{field} : '') : [])"
                )
            })
            .collect::<Vec<_>>()
            .join(" + ")
    };
    let class = |field: &str, key: &str, what: &str, required: bool| {
        let present = format!("has(object.spec.{field})");
        let allowed = format!("object.spec.{field} in {}", list(key));
        let (expression, message) = if required {
            (
                format!("!({}) || ({present} && {allowed})", set(key)),
                format!(
                    "'{what} must name one of the allowed classes' + {}",
                    because(key)
                ),
            )
        } else {
            (
                format!("!({}) || !{present} || {allowed}", set(key)),
                format!(
                    "'{what} ' + object.spec.{field} + ' is not allowed' + {}",
                    because(key)
                ),
            )
        };
        validation(
            &expression,
            &format!("{what} is not allowed by the tenant's spec.policies.{key}"),
            Some(&message),
        )
    };
    vec![
        (
            "pods",
            spec(
                vec![
                    rule(&[""], &["pods"], &["CREATE", "UPDATE"], None),
                    rule(&[""], &["pods/ephemeralcontainers"], &["UPDATE"], None),
                ],
                vec![
                    rules.clone(),
                    variable("images", &of_containers("image")),
                    variable("pullPolicies", &of_containers("imagePullPolicy")),
                    variable(
                        "badImages",
                        &format!(
                            "{} ? variables.images.filter(i, !{}.exists(r, {})) : []",
                            set("allowedRegistries"),
                            list("allowedRegistries"),
                            IMAGE_FROM_REGISTRY
                        ),
                    ),
                ],
                vec![
                    validation(
                        "size(variables.badImages) == 0",
                        "an image is not from a registry the tenant's spec.policies.allowedRegistries allows",
                        Some(&format!(
                            "'image ' + variables.badImages[0] + ' is not from an allowed registry' + {}",
                            because("allowedRegistries")
                        )),
                    ),
                    validation(
                        &format!(
                            "!({}) || variables.pullPolicies.all(p, p == variables.rules['imagePullPolicy'])",
                            set("imagePullPolicy")
                        ),
                        "every container must have the imagePullPolicy the tenant's spec.policies.imagePullPolicy requires",
                        Some(&format!(
                            "'every container must have imagePullPolicy ' + variables.rules['imagePullPolicy'] + {}",
                            because("imagePullPolicy")
                        )),
                    ),
                    class(
                        "priorityClassName",
                        "allowedPriorityClasses",
                        "PriorityClass",
                        false,
                    ),
                    class(
                        "runtimeClassName",
                        "allowedRuntimeClasses",
                        "RuntimeClass",
                        false,
                    ),
                    validation(
                        &format!(
                            "!({}) || {}.all(kv, has(object.spec.nodeSelector) && kv.split('=')[0] in object.spec.nodeSelector && object.spec.nodeSelector[kv.split('=')[0]] == kv.split('=')[1])",
                            set("nodeSelector"),
                            list("nodeSelector")
                        ),
                        "the pod's nodeSelector must pin it to the tenant's nodes (spec.policies.nodeSelector)",
                        Some(&format!(
                            "'the pod must have nodeSelector ' + variables.rules['nodeSelector'] + {}",
                            because("nodeSelector")
                        )),
                    ),
                ],
            ),
        ),
        (
            "services",
            spec(
                vec![rule(&[""], &["services"], &["CREATE", "UPDATE"], None)],
                vec![rules.clone()],
                vec![
                    validation(
                        &format!(
                            "!({}) || !has(object.spec.type) || !(object.spec.type in {})",
                            set("forbiddenServiceTypes"),
                            list("forbiddenServiceTypes")
                        ),
                        "the Service type is forbidden by the tenant's spec.policies.forbiddenServiceTypes",
                        Some(&format!(
                            "'Services of type ' + object.spec.type + ' are forbidden' + {}",
                            because("forbiddenServiceTypes")
                        )),
                    ),
                    validation(
                        &format!(
                            "!({}) || !has(object.spec.externalIPs) || size(object.spec.externalIPs) == 0",
                            set("forbidExternalIPs")
                        ),
                        "Services with externalIPs are forbidden by the tenant's spec.policies.forbidExternalIPs",
                        Some(&format!(
                            "'Services with externalIPs are forbidden' + {}",
                            because("forbidExternalIPs")
                        )),
                    ),
                ],
            ),
        ),
        (
            "volume-claims",
            spec(
                vec![rule(&[""], &["persistentvolumeclaims"], &["CREATE"], None)],
                vec![rules.clone()],
                vec![class(
                    "storageClassName",
                    "allowedStorageClasses",
                    "a PersistentVolumeClaim",
                    true,
                )],
            ),
        ),
        (
            "ingresses",
            spec(
                vec![rule(
                    &["networking.k8s.io"],
                    &["ingresses"],
                    &["CREATE", "UPDATE"],
                    None,
                )],
                vec![rules],
                vec![class(
                    "ingressClassName",
                    "allowedIngressClasses",
                    "an Ingress",
                    true,
                )],
            ),
        ),
    ]
}

/// The policies as one multi-document YAML stream (for `tenant-operator policies`).
///
/// # Errors
/// A serialization failure (not expected).
pub fn to_yaml(policies: &Policies) -> Result<String, serde_yaml::Error> {
    let validating = policies
        .validating
        .iter()
        .flat_map(|p| [with_type(&p.policy), with_type(&p.binding)]);
    let mutating = policies
        .mutating
        .iter()
        .flat_map(|p| [with_type(&p.policy), with_type(&p.binding)]);
    let mut out = String::new();
    for value in validating.chain(mutating) {
        out.push_str("---\n");
        out.push_str(&serde_yaml::to_string(&value)?);
    }
    Ok(out)
}

fn with_type<K: Resource<DynamicType = ()> + serde::Serialize>(obj: &K) -> serde_json::Value {
    let mut v = serde_json::to_value(obj).unwrap_or_default();
    if let Some(o) = v.as_object_mut() {
        o.insert("apiVersion".into(), K::api_version(&()).into());
        o.insert("kind".into(), K::kind(&()).into());
    }
    v
}

/// Why the policies could not be applied.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The SelfSubjectReview asking who the operator is failed.
    #[error("failed to find the operator's own user with a SelfSubjectReview")]
    WhoAmI(#[source] kube::Error),
    /// Reading a policy or binding failed.
    #[error("failed to read {0}")]
    Read(String, #[source] kube::Error),
    /// Applying a policy or binding failed.
    #[error("failed to apply {0}")]
    Apply(String, #[source] steward_core::Error),
}

/// The user this client authenticates as.
///
/// # Errors
/// [`Error::WhoAmI`].
pub async fn whoami(client: &Client) -> Result<String, Error> {
    let api: Api<SelfSubjectReview> = Api::all(client.clone());
    let review = api
        .create(&PostParams::default(), &SelfSubjectReview::default())
        .await
        .map_err(Error::WhoAmI)?;
    Ok(review
        .status
        .and_then(|s| s.user_info)
        .and_then(|u| u.username)
        .unwrap_or_default())
}

/// The file of `deploy/tenant-operator/` with the defaults ([`deployed_defaults`]).
pub const DEFAULTS_FILE: &str = "defaults.yaml";

/// The mutating policies and their bindings as the deployment installs them (exempting no one:
/// with `--exempt-user`/`--exempt-group`, install them as `--print-policies` prints them), with
/// the labels and digest the operator applies them with, so it finds them in force without
/// writing. Its ServiceAccount may not write mutating policies: one that may can rewrite any
/// object anyone creates. `cargo xtask crdgen` writes them to [`DEFAULTS_FILE`].
///
/// # Errors
/// A serialization failure (not expected).
pub fn deployed_defaults(manager: &str) -> Result<String, String> {
    let exempt = Exemptions::new(Vec::<String>::new(), Vec::<String>::new());
    let mut out = String::from(
        "# generated by cargo xtask crdgen from crates/tenant-operator/src/policy.rs, do not edit.\n\
         # The tenant-operator's MutatingAdmissionPolicy and its binding, installed with it: its\n\
         # ServiceAccount may not write mutating admission policies, it checks they are in force.\n",
    );
    for d in defaults(&exempt, manager) {
        for body in [
            unowned_body(manager, d.policy),
            unowned_body(manager, d.binding),
        ] {
            let body = body.map_err(|e| e.to_string())?;
            out.push_str("---\n");
            out.push_str(&serde_yaml::to_string(&body).map_err(|e| e.to_string())?);
        }
    }
    Ok(out)
}

/// What [`apply`] came to: how many objects it wrote, and every policy or binding it could
/// not put in force.
#[derive(Debug, Default)]
pub struct Applied {
    pub written: usize,
    pub missing: Vec<Error>,
}

/// Applies every policy and binding that differs from what is stored, each whatever becomes
/// of the others (one that fails, or a kind the API server does not serve, leaves the rest in
/// force). The mutating ones are in force when they carry the digest of what this version
/// generates (the deployment installs them: [`deployed_defaults`]); only when they do not
/// are they applied, which an operator running as its ServiceAccount may not do.
pub async fn apply(client: &Client, policies: &Policies, children: &Children) -> Applied {
    let mut applied = Applied::default();
    let mut count = |result: Result<usize, Error>| match result {
        Ok(n) => applied.written += n,
        Err(e) => applied.missing.push(e),
    };
    // The defaults first: a rule never checks a pod its default was meant to complete.
    for p in &policies.mutating {
        count(apply_one(client, &p.policy, children, true).await);
        count(apply_one(client, &p.binding, children, true).await);
    }
    for p in &policies.validating {
        count(apply_one(client, &p.policy, children, false).await);
        count(apply_one(client, &p.binding, children, false).await);
    }
    applied
}

/// Applies `obj` unless it is up to date ([`Children::ensure`]), or, `by_digest`, unless it
/// carries the digest of `obj` (installed by someone else); returns how many were written.
async fn apply_one<K>(
    client: &Client,
    obj: &K,
    children: &Children,
    by_digest: bool,
) -> Result<usize, Error>
where
    K: Resource<DynamicType = (), Scope = k8s_openapi::ClusterResourceScope>
        + Clone
        + serde::Serialize
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
{
    let what = || format!("{} {}", K::kind(&()), obj.name_any());
    let current = Api::<K>::all(client.clone())
        .get_opt(&obj.name_any())
        .await
        .map_err(|e| Error::Read(what(), e))?;
    if by_digest
        && in_force(
            current.as_ref().map(Resource::meta),
            obj,
            children.field_manager(),
        )
    {
        return Ok(0);
    }
    let outcome = children
        .ensure(current.as_ref().map(Resource::meta), obj.clone())
        .await
        .map_err(|e| Error::Apply(what(), e))?;
    Ok(usize::from(outcome == Outcome::Applied))
}

/// Whether the object whose metadata is `current` carries the digest of `wanted` as applied
/// by `manager` (pure).
fn in_force<K>(current: Option<&ObjectMeta>, wanted: &K, manager: &str) -> bool
where
    K: Resource<DynamicType = ()> + Clone + serde::Serialize,
{
    let Ok(body) = unowned_body(manager, wanted.clone()) else {
        return false;
    };
    let digest = body
        .pointer("/metadata/annotations")
        .and_then(|a| a.get(steward_core::apply::APPLIED_ANNOTATION))
        .and_then(serde_json::Value::as_str);
    digest.is_some() && digest == current.and_then(steward_core::apply::applied_digest)
}

/// The operator's admission policies and bindings as a replica's caches hold them.
#[derive(Clone)]
pub struct Cached {
    pub vaps: Store<ValidatingAdmissionPolicy>,
    pub vap_bindings: Store<ValidatingAdmissionPolicyBinding>,
    pub maps: Store<MutatingAdmissionPolicy>,
    pub map_bindings: Store<MutatingAdmissionPolicyBinding>,
}

/// The guard rails as every replica sees them, for the Tenants' reconciles: which policies and
/// bindings this version wants are absent or not as it generates them, read from the
/// replica's watch caches ([`Cached`]), so a replica that is not the leader sees what the
/// leader put in place, and a policy deleted a moment ago is seen missing.
#[derive(Clone)]
pub struct GuardRails {
    client: Client,
    extra: Exemptions,
    manager: String,
    /// The policies wanted (they exempt the operator: found once by a SelfSubjectReview).
    wanted: Arc<tokio::sync::OnceCell<Policies>>,
}

impl GuardRails {
    /// The guard rails the operator keeps (exempting `extra` and itself), as `manager`.
    pub fn new(client: Client, extra: Exemptions, manager: &str) -> Self {
        Self {
            client,
            extra,
            manager: manager.to_string(),
            wanted: Arc::default(),
        }
    }

    /// The policies and bindings not in force, one line each (empty: all are).
    ///
    /// # Errors
    /// [`Error::WhoAmI`] the first time, when the API server cannot be asked.
    pub async fn missing(&self, cached: &Cached) -> Result<Vec<String>, Error> {
        let wanted = self
            .wanted
            .get_or_try_init(|| async {
                let me = whoami(&self.client).await?;
                Ok::<_, Error>(Policies::new(&self.extra, Some(&me), &self.manager))
            })
            .await?;
        Ok(missing(wanted, cached, &self.manager))
    }
}

/// The policies and bindings of `wanted` that `cached` lacks or holds otherwise than
/// `manager` generates them, one line each (pure).
pub fn missing(wanted: &Policies, cached: &Cached, manager: &str) -> Vec<String> {
    fn check<K>(store: &Store<K>, wanted: &K, manager: &str, out: &mut Vec<String>)
    where
        K: Resource<DynamicType = ()> + Clone + serde::Serialize,
    {
        let what = format!("{} {}", K::kind(&()), wanted.name_any());
        match store.get(&ObjectRef::new(&wanted.name_any())) {
            None => out.push(format!("{what} is not installed")),
            Some(c) if !in_force(Some(c.meta()), wanted, manager) => {
                out.push(format!("{what} is not as this version generates it"));
            }
            Some(_) => {}
        }
    }
    let mut out = Vec::new();
    for p in &wanted.mutating {
        check(&cached.maps, &p.policy, manager, &mut out);
        check(&cached.map_bindings, &p.binding, manager, &mut out);
    }
    for p in &wanted.validating {
        check(&cached.vaps, &p.policy, manager, &mut out);
        check(&cached.vap_bindings, &p.binding, manager, &mut out);
    }
    out
}

/// Leader-only task, for the whole leadership term: finds the operator's user, applies the
/// policies exempting it (and `extra`), then keeps them in place. A policy or binding someone
/// changes, deletes or unlabels is restored as soon as the watch sees it, and everything is
/// checked again every `recheck` (a write only when something differs). Failures are retried
/// with backoff until `stop` is cancelled.
pub async fn keep_in_place(
    client: Client,
    extra: Exemptions,
    manager: String,
    writes: WriteCounter,
    recheck: Duration,
    stop: CancellationToken,
) {
    let mut changes = std::pin::pin!(changes(&client, &manager));
    // Who the operator is, and so the policies, are found once per term.
    let mut wanted: Option<(String, Policies)> = None;
    let mut delay = Duration::from_millis(500);
    let mut in_place = false;
    loop {
        let attempt = async {
            let (me, policies) = match wanted.take() {
                Some(w) => w,
                None => {
                    let me = whoami(&client).await?;
                    let policies = Policies::new(&extra, Some(&me), &manager);
                    (me, policies)
                }
            };
            let children = Children::unowned(client.clone(), &manager).counted(writes.clone());
            let applied = apply(&client, &policies, &children).await;
            wanted = Some((me.clone(), policies));
            match applied.missing.into_iter().next() {
                // The others are applied; one error is enough to retry all with backoff.
                Some(e) => Err(e),
                None => Ok::<_, Error>((me, applied.written)),
            }
        };
        let result = tokio::select! {
            r = attempt => r,
            () = stop.cancelled() => return,
        };
        match result {
            Ok((me, written)) => {
                if !in_place {
                    tracing::info!(exempt_user = %me, written, "admission policies in place");
                } else if written > 0 {
                    tracing::warn!(
                        written,
                        "admission policies or bindings were changed or deleted by someone else; restored"
                    );
                }
                in_place = true;
                delay = Duration::from_millis(500);
                // Until something changes (a burst of events is one change) or it is time to
                // look again anyway.
                tokio::select! {
                    _ = changes.next() => {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        while changes.next().now_or_never().flatten().is_some() {}
                    }
                    () = tokio::time::sleep(recheck) => {}
                    () = stop.cancelled() => return,
                }
            }
            Err(e) => {
                tracing::warn!(error = %steward_core::chain(&e), retry_in = ?delay, "failed to apply the admission policies");
                tokio::select! {
                    () = tokio::time::sleep(delay) => {}
                    () = stop.cancelled() => return,
                }
                delay = (delay * 2).min(Duration::from_secs(30));
            }
        }
    }
}

/// Every change to a policy or binding labelled as this operator's (including its deletion,
/// or the label's removal), as `()`; watch errors are logged and retried with backoff (the
/// periodic re-check still runs meanwhile).
fn changes(client: &Client, manager: &str) -> impl Stream<Item = ()> + Send + 'static {
    use kube::runtime::{WatchStreamExt, watcher};
    let config = watcher::Config::default().labels(&format!(
        "{}={manager}",
        steward_core::apply::MANAGED_BY_LABEL
    ));
    fn changed<T>(event: Result<T, watcher::Error>) -> std::future::Ready<Option<()>> {
        if let Err(e) = &event {
            tracing::warn!(error = %steward_core::chain(e), "watching the admission policies failed; retrying");
        }
        std::future::ready(event.ok().map(|_| ()))
    }
    fn of<K>(client: &Client, config: &watcher::Config) -> futures::stream::BoxStream<'static, ()>
    where
        K: Resource<DynamicType = ()>
            + Clone
            + serde::de::DeserializeOwned
            + std::fmt::Debug
            + Send
            + 'static,
    {
        watcher(Api::<K>::all(client.clone()), config.clone())
            .default_backoff()
            .filter_map(changed)
            .boxed()
    }
    futures::stream::select_all([
        of::<ValidatingAdmissionPolicy>(client, &config),
        of::<ValidatingAdmissionPolicyBinding>(client, &config),
        of::<MutatingAdmissionPolicy>(client, &config),
        of::<MutatingAdmissionPolicyBinding>(client, &config),
    ])
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn all() -> Vec<Policy> {
        policies(
            &Exemptions::new(["op".to_string()], ["admins".to_string()]),
            "tenant-operator",
        )
    }

    #[test]
    fn exemptions_cover_the_control_plane_and_the_operator() {
        let e = Exemptions::new(
            ["system:serviceaccount:steward:tenant-operator".to_string()],
            [],
        );
        let cel = e.cel();
        assert!(cel.contains("'system:serviceaccount:steward:tenant-operator'"));
        assert!(cel.contains("'system:kube-controller-manager'"));
        assert!(cel.contains("startsWith('system:serviceaccount:kube-system:')"));
        assert!(cel.contains("'system:masters'"));
        assert_eq!(cel_string("it's"), r"'it\'s'");
    }

    #[test]
    fn every_policy_has_a_deny_binding_and_skips_exempt_users() {
        let ps = all();
        assert_eq!(ps.len(), 9);
        for p in &ps {
            let spec = p.policy.spec.as_ref().unwrap();
            let binding = &p.binding.spec;
            assert_eq!(binding.policy_name, p.policy.metadata.name.clone().unwrap());
            assert_eq!(binding.validation_actions, ["Deny"]);
            assert_eq!(spec.failure_policy.as_deref(), Some("Fail"));
            let mc = spec.match_conditions.as_ref().unwrap();
            assert!(
                mc[0].expression.starts_with("!(") && mc[0].expression.contains("'op'"),
                "{}",
                mc[0].expression
            );
            assert!(
                p.policy
                    .metadata
                    .name
                    .as_ref()
                    .unwrap()
                    .starts_with("tenancy.steward.dev-")
            );
        }
    }

    #[test]
    fn managed_objects_policy_protects_quotas_policies_and_bindings_in_tenant_namespaces() {
        let p = &all()[0].policy;
        let mc = p.spec.as_ref().unwrap().match_constraints.as_ref().unwrap();
        let resources: Vec<String> = mc
            .resource_rules
            .iter()
            .flatten()
            .flat_map(|r| r.resources.clone().unwrap_or_default())
            .collect();
        for r in [
            "resourcequotas",
            "limitranges",
            "networkpolicies",
            "rolebindings",
        ] {
            assert!(resources.contains(&r.to_string()), "{r}");
        }
        assert!(
            mc.resource_rules
                .iter()
                .flatten()
                .all(|r| r.operations.as_deref()
                    == Some(&["UPDATE".to_string(), "DELETE".to_string()][..]))
        );
        assert_eq!(
            mc.object_selector
                .as_ref()
                .unwrap()
                .match_labels
                .as_ref()
                .unwrap()["app.kubernetes.io/managed-by"],
            "tenant-operator"
        );
        assert_eq!(
            mc.namespace_selector
                .as_ref()
                .unwrap()
                .match_expressions
                .as_ref()
                .unwrap()[0]
                .key,
            TENANT_LABEL
        );
    }

    #[test]
    fn allowance_policy_is_evaluated_per_tenant() {
        let p = &all()[3];
        let spec = p.policy.spec.as_ref().unwrap();
        assert_eq!(
            spec.param_kind.as_ref().unwrap().kind.as_deref(),
            Some("Tenant")
        );
        let pr = p.binding.spec.param_ref.as_ref().unwrap();
        assert_eq!(pr.selector, Some(LabelSelector::default()), "every Tenant");
        assert_eq!(pr.parameter_not_found_action.as_deref(), Some("Allow"));
        let exprs: Vec<&str> = spec
            .validations
            .iter()
            .flatten()
            .map(|v| v.expression.as_str())
            .collect();
        assert!(exprs.iter().any(|e| e.contains("maxNamespaces")));
        assert!(exprs.iter().any(|e| e.contains("cordoned")));
    }

    #[test]
    fn cordon_policy_only_matches_namespaced_resources() {
        let p = &all()[4].policy;
        let rules = p
            .spec
            .as_ref()
            .unwrap()
            .match_constraints
            .as_ref()
            .unwrap()
            .resource_rules
            .clone()
            .unwrap();
        assert_eq!(
            rules[0].scope.as_deref(),
            Some("Namespaced"),
            "cluster-scoped objects are never frozen"
        );
        let resources = rules[0].resources.clone().unwrap();
        assert!(
            resources == ["*/*"],
            "subresources (scale, eviction, token) are frozen too: {resources:?}"
        );
        let operations = rules[0].operations.clone().unwrap();
        assert!(
            operations.contains(&"CONNECT".to_string()),
            "exec, attach and port-forward are frozen too: {operations:?}"
        );
    }

    #[test]
    fn tenant_rules_read_the_namespace_s_params_and_exempt_no_controller() {
        for p in all().iter().skip(5) {
            let spec = p.policy.spec.as_ref().unwrap();
            assert_eq!(
                spec.param_kind.as_ref().unwrap().kind.as_deref(),
                Some("ConfigMap")
            );
            let pr = p.binding.spec.param_ref.as_ref().unwrap();
            assert_eq!(pr.name.as_deref(), Some(POLICY_PARAMS));
            assert_eq!(pr.namespace, None, "the admitted object's namespace");
            assert_eq!(
                pr.parameter_not_found_action.as_deref(),
                Some("Deny"),
                "a tenant namespace without its parameters is refused, not open"
            );
            let exempt = &spec.match_conditions.as_ref().unwrap()[0].expression;
            assert!(
                exempt.contains("'op'") && exempt.contains("'admins'"),
                "{exempt}"
            );
            for control_plane in [
                "kube-system",
                "system:kube-controller-manager",
                "system:nodes",
            ] {
                assert!(
                    !exempt.contains(control_plane),
                    "pods a controller creates are checked too: {exempt}"
                );
            }
            let changed = &spec.match_conditions.as_ref().unwrap()[1];
            assert_eq!(
                changed.expression, SPEC_CHANGED,
                "an update that leaves the spec alone (labels, finalizers, orphaning) is not judged"
            );
        }
    }

    #[test]
    fn yaml_has_types() {
        let yaml = to_yaml(&Policies::new(
            &Exemptions::new(["op".to_string()], []),
            None,
            "tenant-operator",
        ))
        .unwrap();
        assert_eq!(yaml.matches("kind: ValidatingAdmissionPolicy\n").count(), 9);
        assert_eq!(
            yaml.matches("kind: ValidatingAdmissionPolicyBinding\n")
                .count(),
            9
        );
        assert_eq!(yaml.matches("kind: MutatingAdmissionPolicy\n").count(), 1);
        assert_eq!(
            yaml.matches("kind: MutatingAdmissionPolicyBinding\n")
                .count(),
            1
        );
        assert!(yaml.contains("apiVersion: admissionregistration.k8s.io/v1"));
    }

    #[test]
    fn the_deployed_defaults_are_in_force_whoever_the_operator_is() {
        let manager = "tenant-operator";
        let deployed: Vec<ObjectMeta> = deployed_defaults(manager)
            .unwrap()
            .split("---\n")
            .skip(1)
            .map(|doc| {
                let v: serde_json::Value = serde_yaml::from_str(doc).unwrap();
                serde_json::from_value(v["metadata"].clone()).unwrap()
            })
            .collect();
        assert_eq!(deployed.len(), 2, "the policy and its binding");
        let none = Exemptions::new(Vec::<String>::new(), Vec::<String>::new());
        for me in ["system:serviceaccount:a:tenant-operator", "someone-else"] {
            let wanted = &Policies::new(&none, Some(me), manager).mutating[0];
            assert!(in_force(Some(&deployed[0]), &wanted.policy, manager));
            assert!(in_force(Some(&deployed[1]), &wanted.binding, manager));
            // Not the rules: those exempt the operator.
            let rules = &Policies::new(&none, Some(me), manager).validating[0];
            assert!(
                rules
                    .policy
                    .spec
                    .as_ref()
                    .unwrap()
                    .match_conditions
                    .as_ref()
                    .unwrap()[0]
                    .expression
                    .contains(me)
            );
        }
        // With --exempt-user the defaults differ: the deployed ones are not in force.
        let admins = Exemptions::new(["admin".to_string()], Vec::<String>::new());
        let wanted = &Policies::new(&admins, None, manager).mutating[0];
        assert!(!in_force(Some(&deployed[0]), &wanted.policy, manager));
        assert!(!in_force(None, &wanted.policy, manager));
    }

    #[test]
    fn guard_rails_are_missing_when_absent_or_not_as_generated() {
        use kube::runtime::{reflector, watcher};
        fn cache<K>(objects: Vec<K>, manager: &str) -> Store<K>
        where
            K: Resource<DynamicType = ()> + Clone + serde::Serialize + serde::de::DeserializeOwned,
        {
            let (store, mut writer) = reflector::store::<K>();
            for o in objects {
                let applied: K = serde_json::from_value(unowned_body(manager, o).unwrap()).unwrap();
                writer.apply_watcher_event(&watcher::Event::Apply(applied));
            }
            store
        }
        let manager = "tenant-operator";
        let wanted = Policies::new(
            &Exemptions::new(Vec::<String>::new(), []),
            Some("op"),
            manager,
        );
        let mut vaps: Vec<_> = wanted.validating.iter().map(|p| p.policy.clone()).collect();
        // One rule lost, another changed since it was applied.
        let lost = vaps.remove(0).metadata.name.unwrap();
        let changed = vaps[0].metadata.name.clone().unwrap();
        let cached = Cached {
            vaps: cache(vaps, manager),
            vap_bindings: cache(
                wanted
                    .validating
                    .iter()
                    .map(|p| p.binding.clone())
                    .collect(),
                manager,
            ),
            maps: cache(
                wanted.mutating.iter().map(|p| p.policy.clone()).collect(),
                manager,
            ),
            map_bindings: cache(Vec::new(), manager),
        };
        let mut other = wanted.clone();
        other.validating[1]
            .policy
            .spec
            .as_mut()
            .unwrap()
            .failure_policy = Some("Ignore".into());
        let found = missing(&other, &cached, manager);
        assert_eq!(
            found,
            [
                "MutatingAdmissionPolicyBinding tenancy.steward.dev-pod-defaults is not installed"
                    .to_string(),
                format!("ValidatingAdmissionPolicy {lost} is not installed"),
                format!("ValidatingAdmissionPolicy {changed} is not as this version generates it"),
            ]
        );
    }

    #[test]
    fn pod_defaults_add_only_what_a_pod_lacks_for_the_same_users_the_rules_check() {
        let ds = defaults(
            &Exemptions::new(["op".to_string()], ["admins".to_string()]),
            "tenant-operator",
        );
        assert_eq!(ds.len(), 1);
        let d = &ds[0];
        let spec = d.policy.spec.as_ref().unwrap();
        let binding = d.binding.spec.as_ref().unwrap();
        assert_eq!(binding.policy_name, d.policy.metadata.name);
        assert_eq!(
            binding.param_ref.as_ref().and_then(|p| p.name.as_deref()),
            Some(POLICY_PARAMS)
        );
        assert_eq!(spec.failure_policy.as_deref(), Some("Fail"));
        // The same exemptions as the rules: what is defaulted is what is checked.
        let pods = all()
            .into_iter()
            .find(|p| p.policy.metadata.name.as_deref() == Some("tenancy.steward.dev-pods"))
            .unwrap();
        assert_eq!(
            spec.match_conditions.as_ref().unwrap()[0],
            pods.policy
                .spec
                .as_ref()
                .unwrap()
                .match_conditions
                .as_ref()
                .unwrap()[0]
        );
        let patch = spec.mutations.as_ref().unwrap()[0]
            .json_patch
            .as_ref()
            .unwrap()
            .expression
            .clone()
            .unwrap();
        // `add` replaces an existing key: only missing labels are added, and a runtime class
        // only when the pod names none.
        assert!(
            patch.contains("!(kv.split('=')[0] in object.spec.nodeSelector)"),
            "{patch}"
        );
        assert!(
            patch.contains("!has(object.spec.runtimeClassName)"),
            "{patch}"
        );
        assert!(patch.contains("jsonpatch.escapeKey"), "{patch}");
    }
}
