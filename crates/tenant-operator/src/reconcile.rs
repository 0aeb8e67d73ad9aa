//! Reconcile one Tenant: validate → build → apply → status, and the finalizer's cleanup.
//!
//! Reads come from the watch caches ([`crate::controller::Stores`]); the only live read is a
//! consistent LIST of the tenant's ResourceQuotas when it has a tenant-wide quota (the split
//! must not be computed from stale usage). Writes happen only for objects that differ from
//! what the operator last applied ([`steward_core::apply`]), and the status is written once, only
//! when it changed: a resync with nothing changed writes nothing.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Namespace, ResourceQuota};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Client, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use steward_core::apply::{Children, OWNER_LABEL, Outcome, ScopeApi, is_conflict};
use steward_core::controller::Cache;
use steward_core::finalizer::{self, Cleanup};
use steward_core::reconcile::{Kept, Prune};
use steward_core::{Context, ReconcileError};

use crate::build::{self, ACCESS_ROLE, Access, NamespaceChildren, QUOTA_NAME, SharedCopy, Source};
use crate::controller::State;
use crate::crd::{
    FINALIZER, NamespaceDeletionPolicy, SharedKind, SharedObject, TENANT_LABEL, Tenant,
};
use crate::namespaces::{self, Existing};
use crate::quantity::Milli;
use crate::quota;
use crate::status::{self, Observation, Problem};
use crate::validate::{self, InvalidSpec};

/// Why reconciling a Tenant failed; each variant names the step.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The spec cannot be reconciled until it changes.
    #[error(transparent)]
    InvalidSpec(#[from] InvalidSpec),
    /// A watch cache stopped or has not listed yet.
    #[error("failed to read the operator's caches: a watch ended or has not listed yet")]
    CachesUnavailable,
    /// Creating or updating a tenant namespace failed.
    #[error("failed to apply namespace {name}")]
    ApplyNamespace {
        name: String,
        #[source]
        source: steward_core::Error,
    },
    /// Deleting a namespace (policy `Delete`) failed.
    #[error("failed to delete namespace {name}")]
    DeleteNamespace {
        name: String,
        #[source]
        source: steward_core::Error,
    },
    /// Removing the operator's labels from a namespace (policy `Orphan`) failed.
    #[error("failed to release namespace {name}")]
    ReleaseNamespace {
        name: String,
        #[source]
        source: kube::Error,
    },
    /// Listing the tenant's namespaces (to admit owner-created ones) failed.
    #[error("failed to list the namespaces of tenant {tenant}")]
    ListNamespaces {
        tenant: String,
        #[source]
        source: kube::Error,
    },
    /// Listing the tenant's ResourceQuotas failed.
    #[error("failed to list the ResourceQuotas of tenant {tenant}")]
    ListQuotas {
        tenant: String,
        #[source]
        source: kube::Error,
    },
    /// Applying a namespace's ResourceQuota failed.
    #[error("failed to apply the ResourceQuota of namespace {namespace}")]
    ApplyQuota {
        namespace: String,
        #[source]
        source: steward_core::Error,
    },
    /// Applying a child (LimitRange, NetworkPolicy, RoleBinding, ClusterRole, copy) failed.
    #[error("failed to apply {kind} {key}")]
    ApplyChild {
        kind: &'static str,
        key: String,
        #[source]
        source: steward_core::Error,
    },
    /// Checking whether a shared copy's name is taken failed.
    #[error("failed to read {kind} {key}")]
    ReadTarget {
        kind: &'static str,
        key: String,
        #[source]
        source: kube::Error,
    },
    /// Finding the operator's own user (the subject of its access Roles) failed.
    #[error("failed to find the operator's own user")]
    WhoAmI(#[source] crate::policy::Error),
    /// Deleting a child no longer wanted failed (the source names it).
    #[error("failed to prune a child the tenant no longer wants")]
    Prune(#[source] steward_core::Error),
    /// Finding which admission policies are wanted (they exempt the operator) failed.
    #[error("failed to find which admission policies are wanted")]
    GuardRails(#[source] crate::policy::Error),
    /// Writing the status failed.
    #[error("failed to write the status")]
    WriteStatus(#[source] steward_core::Error),
}

impl ReconcileError for Error {
    fn reason(&self) -> &str {
        match self {
            Error::InvalidSpec(_) => "InvalidSpec",
            Error::CachesUnavailable => "CachesUnavailable",
            Error::ApplyNamespace { .. } => "NamespaceApplyFailed",
            Error::DeleteNamespace { .. } => "NamespaceDeleteFailed",
            Error::ReleaseNamespace { .. } => "NamespaceReleaseFailed",
            Error::ListNamespaces { .. } => "NamespaceReadFailed",
            Error::ListQuotas { .. } => "QuotaReadFailed",
            Error::ApplyQuota { .. } => "QuotaApplyFailed",
            Error::ApplyChild { .. } => "ApplyFailed",
            Error::ReadTarget { .. } => "ReadFailed",
            Error::WhoAmI(_) => "WhoAmIFailed",
            Error::GuardRails(_) => "GuardRailsReadFailed",
            Error::Prune(_) => "PruneFailed",
            Error::WriteStatus(_) => "StatusWriteFailed",
        }
    }

    fn is_permanent(&self) -> bool {
        matches!(self, Error::InvalidSpec(_))
    }
}

/// How long a reconcile waits for the watch caches' first lists.
const CACHE_WAIT: Duration = Duration::from_secs(30);

/// How soon to look again while a quota split waits for the quota controller.
const SOON: Duration = Duration::from_secs(2);

/// The top-level reconcile: only dispatches the finalizer event.
///
/// # Errors
/// The finalizer's error wrapping [`Error`].
pub async fn reconcile(
    tenant: Arc<Tenant>,
    ctx: Arc<Context<State>>,
) -> Result<Action, finalizer::Error<Error>> {
    tracing::debug!(tenant = %tenant.name_any(), "reconcile");
    match tokio::time::timeout(CACHE_WAIT, ctx.data.stores.ready()).await {
        Ok(true) => {}
        Ok(false) | Err(_) => return Err(finalizer::Error::Apply(Error::CachesUnavailable)),
    }
    finalizer::dispatch(
        &ctx.client,
        FINALIZER,
        tenant,
        |t| apply(t, &ctx),
        |t| cleanup(t, &ctx),
    )
    .await
}

async fn apply(tenant: Arc<Tenant>, ctx: &Context<State>) -> Result<Action, Error> {
    let mut obs = Observation {
        generation: tenant.metadata.generation,
        cordoned: tenant.spec.cordoned,
        ..Default::default()
    };
    let result = converge(&tenant, ctx, &mut obs).await;
    if let Err(e) = &result {
        obs.error = Some((e.reason().to_string(), steward_core::chain(e)));
    }
    write_status(&tenant, ctx, &obs).await?;
    result
}

async fn write_status(
    tenant: &Tenant,
    ctx: &Context<State>,
    obs: &Observation,
) -> Result<bool, Error> {
    let new = status::compute(tenant.status.as_ref(), obs);
    let written = ctx
        .apply_status(tenant, tenant.status.as_ref(), &new)
        .await
        .map_err(Error::WriteStatus)?;
    Ok(written)
}

fn key(namespace: Option<&str>, name: &str) -> String {
    match namespace {
        Some(ns) => format!("{ns}/{name}"),
        None => name.to_string(),
    }
}

fn labelled_namespaces(stores: &crate::controller::Stores, tenant: &str) -> Vec<Existing> {
    stores
        .namespaces
        .labelled(tenant)
        .iter()
        .map(|n| Existing::of(&n.metadata))
        .collect()
}

/// An owner-created namespace the operator has not decided on yet.
fn undecided(e: &Existing) -> bool {
    !e.admitted && !e.declared && !e.terminating
}

/// `e`, counted as admitted when the tenant's access was granted in it before namespaces
/// carried [`crate::crd::ADMITTED_LABEL`] (so an upgrade never takes a namespace in use for an
/// excess one).
fn admitted_before(stores: &crate::controller::Stores, mut e: Existing) -> Existing {
    if undecided(&e)
        && let Some(tenant) = &e.tenant
    {
        e.admitted = stores.role_bindings.labelled(tenant).iter().any(|rb| {
            rb.namespace().as_deref() == Some(e.name.as_str()) && rb.name_any() != ACCESS_ROLE
        });
    }
    e
}

/// Validate, then apply in order: the namespaces, the owners' cluster-scoped access, the
/// quotas (so no namespace is usable before it is limited), each namespace's children (access
/// last), and prune what the tenant no longer wants ([`kept`] decides what it keeps). The
/// steps return what they found; `obs` is filled here only.
async fn converge(
    tenant: &Arc<Tenant>,
    ctx: &Context<State>,
    obs: &mut Observation,
) -> Result<Action, Error> {
    let spec = validate::validate(&tenant.spec)?;
    obs.tenant_hard = spec.tenant.clone();
    obs.namespace_hard = spec.per_namespace.clone();
    let name = tenant.name_any();
    let uid = tenant.uid().unwrap_or_default();
    let stores = &ctx.data.stores;
    let children = ctx.children(tenant.as_ref());

    let namespaces = converge_namespaces(tenant, ctx).await?;
    obs.problems.extend(namespaces.problems);
    obs.adopted = namespaces.adopted;
    obs.namespaces = namespaces.active.clone();
    let (active, terminating) = (namespaces.active, namespaces.terminating);
    tracing::debug!(tenant = %name, namespaces = ?active, "namespaces applied");

    // Decide: what the tenant wants in each namespace, and so what it keeps.
    let wanted: Vec<(String, NamespaceChildren)> = active
        .iter()
        .map(|ns| {
            let children = build::namespace_children(tenant, ns, &ctx.data.settings, |shared| {
                source(stores, shared)
            });
            (ns.clone(), children)
        })
        .collect();
    let kept = kept(tenant, &spec, &wanted);

    // Per tenant: the owners' ClusterRole and ClusterRoleBinding.
    let owner_role = build::owner_cluster_role(tenant, &active);
    ensure_child(&children, &stores.cluster_roles, owner_role).await?;
    let owner_binding = build::owner_cluster_role_binding(tenant);
    ensure_child(&children, &stores.cluster_role_bindings, owner_binding).await?;

    let Some(quotas) = converge_quotas(tenant, ctx, &spec, &active).await? else {
        // Usage changed since the list: plan again with fresh numbers. Nothing else is
        // applied meanwhile, so no namespace is reachable without its quota.
        return Ok(Action::requeue(Duration::from_millis(200)));
    };
    obs.used = quotas.used;
    obs.split = quotas.split;
    let mut soon = quotas.held_back;
    tracing::debug!(tenant = %name, "quotas applied");

    // Owners get access only where every guard rail is in force: the admission policies
    // (read back from the API server, not taken on trust) and, per namespace below, the
    // parameters they read there.
    let rails = guard_rails(ctx).await?;
    let guarded = rails.is_none();
    soon |= !guarded;
    obs.problems.extend(rails);
    let mut shared = SharedOutcome::default();
    for (ns, mut wanted) in wanted {
        shared
            .missing_sources
            .extend(std::mem::take(&mut wanted.missing_sources));
        let enforced = quotas_enforced(&stores.quotas, &kept, &ns);
        let mut applied =
            converge_namespace(tenant, ctx, &children, &ns, wanted, guarded, enforced).await?;
        let problems = applied.problems(&ns);
        shared.taken.extend(std::mem::take(&mut applied.taken));
        soon |= !problems.is_empty();
        obs.problems.extend(problems);
    }
    // Namespaces the tenant no longer has (released, or removed under `Orphan`): its copies
    // there go first, then (pruned below) the access that let the operator reach them.
    for role in stores.roles.labelled(&name) {
        let Some(ns) = role.namespace() else { continue };
        if active.contains(&ns) || terminating.contains(&ns) {
            continue;
        }
        delete_copies(ctx, &children, &uid, &ns, &Access::of(&role)).await?;
    }
    let not_shared = not_shared(tenant, stores);
    obs.problems
        .extend(shared.problems(&not_shared, &stores.source_secrets.namespaces()));
    tracing::debug!(tenant = %name, "children applied");

    // What the tenant no longer wants, in the namespaces before the access that reached them.
    Prune::new(kept)
        .sparing(terminating)
        .among(stores.quotas.labelled(&name))
        .among(stores.limit_ranges.labelled(&name))
        .among(stores.network_policies.labelled(&name))
        .among(stores.role_bindings.labelled(&name))
        .among(stores.roles.labelled(&name))
        .among(stores.cluster_roles.labelled(&name))
        .among(stores.cluster_role_bindings.labelled(&name))
        .run(&children)
        .await
        .map_err(Error::Prune)?;
    Ok(Action::requeue(if soon { SOON } else { ctx.data.resync }))
}

/// The admission policies not in force (read back from the API server, not taken on trust),
/// as the problem that keeps owners out of new namespaces; `None` when all are.
async fn guard_rails(ctx: &Context<State>) -> Result<Option<Problem>, Error> {
    let Some(rails) = &ctx.data.guard_rails else {
        return Ok(None);
    };
    let missing = rails
        .missing(&ctx.data.stores.admission)
        .await
        .map_err(Error::GuardRails)?;
    Ok((!missing.is_empty()).then(|| Problem {
        reason: "GuardRailsMissing",
        message: format!(
            "owners get access to new namespaces once every admission policy is in force; not in force: {}",
            missing.join("; ")
        ),
    }))
}

/// The tenant's shared objects outside the namespaces the operator shares from, as
/// `<kind> <namespace>/<name>`.
fn not_shared(tenant: &Tenant, stores: &crate::controller::Stores) -> Vec<String> {
    tenant
        .spec
        .shared_objects
        .iter()
        .filter(|s| !stores.source_secrets.shares(&s.namespace))
        .map(|s| format!("{:?} {}/{}", s.kind, s.namespace, s.name))
        .collect()
}

/// What the tenant keeps of its children (the rest is pruned), decided from what it wants
/// (pure): the owners' cluster-scoped access; in each namespace (`wanted`) its ResourceQuota
/// when the spec has quotas, the spec's additional quotas, limit ranges, network policies and
/// RoleBindings (also those held back until the quotas are enforced), and the operator's
/// access Role and binding when there is something there to reach by name.
fn kept(
    tenant: &Tenant,
    spec: &validate::Validated,
    wanted: &[(String, NamespaceChildren)],
) -> Kept {
    let mut kept = Kept::default();
    let owners = build::owner_cluster_object_name(tenant);
    kept.insert_named::<ClusterRole>(None, &owners);
    kept.insert_named::<ClusterRoleBinding>(None, &owners);
    for (ns, w) in wanted {
        if spec.has_quota() {
            kept.insert_named::<ResourceQuota>(Some(ns), QUOTA_NAME);
        }
        w.quotas.iter().for_each(|q| kept.insert(q));
        w.limit_ranges.iter().for_each(|l| kept.insert(l));
        w.network_policies.iter().for_each(|n| kept.insert(n));
        w.role_bindings.iter().for_each(|rb| kept.insert(rb));
        if !w.access().is_empty() {
            kept.insert_named::<Role>(Some(ns), ACCESS_ROLE);
            kept.insert_named::<RoleBinding>(Some(ns), ACCESS_ROLE);
        }
    }
    kept
}

/// What the namespaces' shared copies came to: sources missing, copies whose names are taken.
#[derive(Default)]
struct SharedOutcome {
    /// Shared objects not found (not shareable, or absent), as `<kind> <namespace>/<name>`.
    missing_sources: BTreeSet<String>,
    /// Copies not made: an object of that name exists and is not the tenant's.
    taken: BTreeSet<String>,
}

impl SharedOutcome {
    /// The problems to report: shared objects outside the shared namespaces (`not_shared`;
    /// `allowed` are those namespaces), missing sources, taken names.
    fn problems(&self, not_shared: &[String], allowed: &[String]) -> Vec<Problem> {
        let mut problems = Vec::new();
        if !not_shared.is_empty() {
            problems.push(Problem {
                reason: "SharedNamespaceNotAllowed",
                message: format!(
                    "{} not copied: the operator reads shared objects only from the namespaces {} (--shared-namespace)",
                    not_shared.join(", "),
                    allowed.join(", ")
                ),
            });
        }
        let missing: Vec<&String> = self
            .missing_sources
            .iter()
            .filter(|m| !not_shared.contains(m))
            .collect();
        if !missing.is_empty() {
            problems.push(Problem {
                reason: "SharedObjectMissing",
                message: format!(
                    "{} not found (a source must carry the label tenancy.steward.dev/shareable=true)",
                    missing.into_iter().cloned().collect::<Vec<_>>().join(", ")
                ),
            });
        }
        if !self.taken.is_empty() {
            problems.push(Problem {
                reason: "SharedObjectConflict",
                message: format!(
                    "{} already exist and are not the tenant's copies",
                    self.taken.iter().cloned().collect::<Vec<_>>().join(", ")
                ),
            });
        }
        problems
    }
}

/// What applying one namespace's children came to.
#[derive(Debug, Default, PartialEq)]
struct InNamespace {
    /// Copies or parameters not written yet: the operator's access Role there was just
    /// applied, and RBAC takes a moment to see it.
    pending: bool,
    /// Every admission policy parameter there is written.
    params_written: bool,
    /// Its ResourceQuotas are enforced.
    enforced: bool,
    /// Owners' RoleBindings held back (not applied yet).
    held: bool,
    /// Copies not made, as `<kind> <namespace>/<name>`: the name is someone else's.
    taken: Vec<String>,
}

impl InNamespace {
    /// The problems to report for namespace `ns` (each a reason to look again soon).
    fn problems(&self, ns: &str) -> Vec<Problem> {
        let mut problems = Vec::new();
        if self.pending {
            problems.push(Problem {
                reason: "CopiesPending",
                message: format!(
                    "waiting for the operator's access to namespace {ns} (its Role there was just applied) to copy the shared objects"
                ),
            });
        }
        if self.held && !self.params_written {
            problems.push(Problem {
                reason: "WaitingForPolicies",
                message: format!(
                    "owners get access to namespace {ns} once the parameters of its admission policies are written there"
                ),
            });
        } else if self.held && !self.enforced {
            problems.push(Problem {
                reason: "WaitingForQuota",
                message: format!(
                    "owners get access to namespace {ns} once its ResourceQuotas are enforced"
                ),
            });
        }
        problems
    }
}

/// One of the tenant's namespaces (`wanted` there): its quotas, limit ranges and network
/// policies; the operator's access to what it writes there by name, then the admission
/// policies' parameters and the shared copies; the owners' access last, once the quotas are
/// `enforced` and the admission policies in force (`guarded`: every policy is; and their
/// parameters here are).
async fn converge_namespace(
    tenant: &Arc<Tenant>,
    ctx: &Context<State>,
    children: &Children,
    ns: &str,
    wanted: NamespaceChildren,
    guarded: bool,
    enforced: bool,
) -> Result<InNamespace, Error> {
    let stores = &ctx.data.stores;
    let uid = tenant.uid().unwrap_or_default();
    // What the operator reaches here by name (the copies, the policy parameters).
    let want = wanted.access();
    ensure_all(children, &stores.quotas, wanted.quotas).await?;
    ensure_all(children, &stores.limit_ranges, wanted.limit_ranges).await?;
    ensure_all(children, &stores.network_policies, wanted.network_policies).await?;
    // The operator's access to what it writes here by name, then those objects: the
    // admission parameters before the owners' access, the shared copies.
    let granted = granted(stores, ns);
    let stale = granted.minus(&want);
    grant(tenant, ctx, children, ns, &want.union(&stale)).await?;
    let mut applied = InNamespace {
        params_written: true,
        enforced,
        ..InNamespace::default()
    };
    for params in wanted.policy_params {
        let written = apply_by_name(ctx, children, &uid, params, false).await?;
        applied.params_written &= written == ByName::Applied;
        applied.pending |= written == ByName::NoAccessYet;
    }
    for shared in wanted.copies {
        let (kind, copy_name) = (shared.kind(), shared.name());
        let written = match shared {
            SharedCopy::Secret(s) => apply_by_name(ctx, children, &uid, s, true).await?,
            SharedCopy::ConfigMap(c) => apply_by_name(ctx, children, &uid, c, true).await?,
        };
        match written {
            ByName::Applied => {}
            ByName::Taken => applied.taken.push(format!("{kind} {ns}/{copy_name}")),
            ByName::NoAccessYet => applied.pending = true,
        }
    }
    if !stale.is_empty() {
        delete_copies(ctx, children, &uid, ns, &stale).await?;
        grant(tenant, ctx, children, ns, &want).await?;
    }
    // Access last, and only once the namespace's quotas are enforced: until the quota
    // controller has copied a ResourceQuota's limits into `status.hard`, the API server
    // admits anything, so an owner bound earlier could create unquoted objects.
    // And only once the admission policies and their parameters here are in force: a
    // pod created before would never be checked. A binding that exists already stays as
    // it is applied (it is kept either way).
    let guarded = guarded && applied.params_written;
    let (bind, held): (Vec<_>, Vec<_>) = wanted.role_bindings.into_iter().partition(|rb| {
        (enforced && guarded)
            || stores
                .role_bindings
                .get(&ObjectRef::new(&rb.name_any()).within(ns))
                .is_some()
    });
    applied.held = !held.is_empty();
    ensure_all(children, &stores.role_bindings, bind).await?;
    Ok(applied)
}

/// Carries out the tenant's namespace plan: namespaces created beyond `maxNamespaces`
/// deleted, the wanted ones created (only with a marker, never taking one someone else made)
/// and applied, the removed ones handled by `deletionPolicy`; Events and problems say what
/// happened. Returns the problems of the namespaces it could not create (someone else did
/// first).
async fn apply_namespace_plan(
    tenant: &Arc<Tenant>,
    ctx: &Context<State>,
    plan: &namespaces::NamespacePlan,
    max: Option<usize>,
) -> Result<Vec<Problem>, Error> {
    let name = tenant.name_any();
    let stores = &ctx.data.stores;
    let ns_children = ctx.children(tenant.as_ref()).without_owner_reference();
    for excess in &plan.excess {
        // Never admitted: nobody was given access in it, so nothing in it is lost.
        ctx.children(tenant.as_ref())
            .delete::<Namespace>(None, excess)
            .await
            .map_err(|source| Error::DeleteNamespace {
                name: excess.clone(),
                source,
            })?;
        ctx.recorder
            .warning(
                tenant.as_ref(),
                "NamespaceRefused",
                "DeleteNamespace",
                format!(
                    "namespace {excess} was created beyond maxNamespaces {}; deleted before any access was granted in it",
                    max.unwrap_or_default()
                ),
            )
            .await;
    }
    let mut problems = Vec::new();
    // A namespace being deleted is left alone ([`NamespacePlan::problems`] says so).
    for w in plan.wanted.iter().filter(|w| !w.terminating) {
        let desired = build::namespace(tenant, &w.name, w.declared, w.adopted);
        if !w.exists {
            // Created with only a marker, then applied like any other: if someone created it
            // meanwhile it is not taken, and every label stays owned by the apply (so a label
            // dropped from the spec is removed later).
            if !create_namespace(ctx, &name, &w.name).await? {
                problems.push(Problem {
                    reason: "NamespaceNotAdoptable",
                    message: format!(
                        "namespace {} was created by someone else before the tenant could create it",
                        w.name
                    ),
                });
                continue;
            }
            // No Event: the status lists the namespace, and one Event per namespace made as
            // asked is a stored object per Tenant at scale (an Event stays when the unexpected
            // happens: a namespace refused, adopted, or taken by someone else first).
        }
        let current = stores.namespaces.get(&ObjectRef::new(&w.name));
        let outcome = ns_children
            .ensure(current.as_deref().map(|c| &c.metadata), desired)
            .await
            .map_err(|source| Error::ApplyNamespace {
                name: w.name.clone(),
                source,
            })?;
        if outcome == Outcome::Applied && current.is_none() && w.adopted {
            ctx.recorder
                .normal(
                    tenant.as_ref(),
                    "NamespaceAdopted",
                    "AdoptNamespace",
                    format!(
                        "namespace {} handed to the tenant by its {} annotation; it is released, never deleted, when the tenant lets it go",
                        w.name,
                        crate::crd::ADOPT_ANNOTATION
                    ),
                )
                .await;
        }
    }
    for removed in &plan.removed {
        remove_namespace(tenant, ctx, &removed.name, removed.adopted).await?;
    }
    Ok(problems)
}

/// The tenant's existing namespaces: those labelled for it (read from the API server rather
/// than the cache while an owner-created one awaits admission under `maxNamespaces`), and the
/// listed ones not labelled for it, by name (so an existing namespace is never taken without
/// the adoption annotation).
async fn existing_namespaces(
    tenant: &Tenant,
    ctx: &Context<State>,
    max: Option<usize>,
) -> Result<(Vec<Existing>, BTreeMap<String, Existing>), Error> {
    let name = tenant.name_any();
    let stores = &ctx.data.stores;
    let client = &ctx.client;
    let mut labelled = labelled_namespaces(stores, &name);
    if max.is_some() && labelled.iter().any(undecided) {
        // Owner-created namespaces wait to be admitted: decide on a consistent read, so an
        // admission written by an earlier reconcile is never missed for a stale cache. (A
        // namespace from before the admitted label costs this read once: its next apply
        // labels it.)
        labelled = Api::<Namespace>::all(client.clone())
            .list(&ListParams::default().labels(&format!("{TENANT_LABEL}={name}")))
            .await
            .map_err(|source| Error::ListNamespaces {
                tenant: name.clone(),
                source,
            })?
            .items
            .iter()
            .map(|ns| Existing::of(&ns.metadata))
            .collect();
    }
    let labelled: Vec<Existing> = labelled
        .into_iter()
        .map(|e| admitted_before(stores, e))
        .collect();
    let mut unlabelled = BTreeMap::new();
    for listed in &tenant.spec.namespaces {
        if stores.namespaces.get(&ObjectRef::new(listed)).is_none()
            && !ctx.data.settings.protected.contains(listed)
        {
            let found = Api::<Namespace>::all(client.clone())
                .get_opt(listed)
                .await
                .map_err(|source| Error::ReadTarget {
                    kind: "Namespace",
                    key: listed.clone(),
                    source,
                })?;
            if let Some(ns) = found {
                unlabelled.insert(listed.clone(), Existing::of(&ns.metadata));
            }
        }
    }
    Ok((labelled, unlabelled))
}

/// The namespaces a tenant has after [`converge_namespaces`].
struct Namespaces {
    /// Its namespaces that are not being deleted: where its children go (sorted).
    active: Vec<String>,
    /// Those of them it adopted (they existed before), sorted.
    adopted: Vec<String>,
    /// Its namespaces being deleted: their children are not pruned (they go with them).
    terminating: BTreeSet<String>,
    /// What keeps namespaces from the tenant.
    problems: Vec<Problem>,
}

/// Decides which namespaces the tenant has ([`namespaces::plan`]), creates, adopts, applies,
/// refuses, releases or deletes them accordingly, and says what keeps any from it.
async fn converge_namespaces(
    tenant: &Arc<Tenant>,
    ctx: &Context<State>,
) -> Result<Namespaces, Error> {
    let name = tenant.name_any();
    let stores = &ctx.data.stores;
    let max = tenant
        .spec
        .max_namespaces
        .map(|m| usize::try_from(m).unwrap_or(0));
    let (labelled, unlabelled) = existing_namespaces(tenant, ctx, max).await?;
    let plan = namespaces::plan(
        &name,
        &tenant.spec.namespaces,
        |n| {
            stores
                .namespaces
                .get(&ObjectRef::new(n))
                .map(|ns| Existing::of(&ns.metadata))
                .or_else(|| unlabelled.get(n).cloned())
        },
        &labelled,
        &ctx.data.settings.protected,
        max,
    );
    let mut problems = plan.problems();
    problems.extend(apply_namespace_plan(tenant, ctx, &plan, max).await?);
    let adopted = plan
        .wanted
        .iter()
        .filter(|w| w.adopted && !w.terminating)
        .map(|w| w.name.clone())
        .collect();
    let terminating = labelled
        .iter()
        .filter(|e| e.terminating)
        .map(|e| e.name.clone())
        .collect();
    Ok(Namespaces {
        active: plan.active(),
        adopted,
        terminating,
        problems,
    })
}

/// What [`converge_quotas`] applied.
#[derive(Default)]
struct Quotas {
    /// Part of a tenant-wide split waits for the quota controller.
    held_back: bool,
    /// Usage per namespace, from the ResourceQuotas.
    used: BTreeMap<String, BTreeMap<String, Milli>>,
    /// The tenant-wide split (empty without `tenantQuota`).
    split: BTreeMap<String, BTreeMap<String, Milli>>,
}

/// Applies the tenant's ResourceQuota [`QUOTA_NAME`] in each active namespace: the
/// per-namespace limits, with a tenant-wide quota split across namespaces ([`quota::plan`])
/// from a consistent read of their usage, lowered limits before raised ones. `Some`: applied;
/// `None`: a quota changed since it was read (the split must be planned again).
async fn converge_quotas(
    tenant: &Tenant,
    ctx: &Context<State>,
    spec: &validate::Validated,
    active: &[String],
) -> Result<Option<Quotas>, Error> {
    let name = tenant.name_any();
    let stores = &ctx.data.stores;
    let client = &ctx.client;
    let children = ctx.children(tenant);
    let mut applied = Quotas::default();
    if spec.has_quota() {
        let current: BTreeMap<String, ResourceQuota> = if spec.tenant.is_empty() {
            stores
                .quotas
                .labelled(&name)
                .iter()
                .filter(|q| q.name_any() == QUOTA_NAME)
                .map(|q| (q.namespace().unwrap_or_default(), q.as_ref().clone()))
                .collect()
        } else {
            // A consistent read: the split must not rest on stale usage.
            Api::<ResourceQuota>::all(client.clone())
                .list(&ListParams::default().labels(&format!("{TENANT_LABEL}={name}")))
                .await
                .map_err(|source| Error::ListQuotas {
                    tenant: name.clone(),
                    source,
                })?
                .items
                .into_iter()
                .filter(|q| q.name_any() == QUOTA_NAME)
                .map(|q| (q.namespace().unwrap_or_default(), q))
                .collect()
        };
        let observed: Vec<quota::Observed> = active
            .iter()
            .map(|ns| observed_quota(ns, current.get(ns)))
            .collect();
        let plan = quota::plan(&spec.per_namespace, &spec.tenant, &observed);
        applied.used = observed
            .iter()
            .map(|o| (o.namespace.clone(), o.used.clone()))
            .collect();
        applied.held_back = !plan.held_back.is_empty();
        if !spec.tenant.is_empty() {
            applied.split = plan.hard.clone();
        }
        let mut order: Vec<&quota::Observed> = observed.iter().collect();
        // Lower limits before raising others.
        order.sort_by_key(|o| !plan.lowers(&o.namespace, o.spec_hard.as_ref()));
        for o in order {
            let ns = &o.namespace;
            let hard = plan.hard.get(ns).cloned().unwrap_or_default();
            let desired = build::resource_quota(tenant, ns, &hard);
            let result = if spec.tenant.is_empty() {
                children
                    .ensure(current.get(ns).map(|q| &q.metadata), desired)
                    .await
            } else {
                children
                    .ensure_unchanged_since(current.get(ns).map(|q| &q.metadata), desired)
                    .await
            };
            match result {
                Ok(_) => {}
                Err(e) if is_conflict(&e) => {
                    tracing::debug!(namespace = %ns, "ResourceQuota changed while splitting the tenant quota; retrying");
                    return Ok(None);
                }
                Err(source) => {
                    return Err(Error::ApplyQuota {
                        namespace: ns.clone(),
                        source,
                    });
                }
            }
        }
    }

    Ok(Some(applied))
}

fn parse_quantities(map: Option<&BTreeMap<String, Quantity>>) -> BTreeMap<String, Milli> {
    map.into_iter()
        .flatten()
        .filter_map(|(k, v)| Milli::parse(&v.0).ok().map(|m| (k.clone(), m)))
        .collect()
}

fn observed_quota(namespace: &str, rq: Option<&ResourceQuota>) -> quota::Observed {
    quota::Observed {
        namespace: namespace.to_string(),
        spec_hard: rq.map(|q| parse_quantities(q.spec.as_ref().and_then(|s| s.hard.as_ref()))),
        enforced: parse_quantities(
            rq.and_then(|q| q.status.as_ref())
                .and_then(|s| s.hard.as_ref()),
        ),
        used: parse_quantities(
            rq.and_then(|q| q.status.as_ref())
                .and_then(|s| s.used.as_ref()),
        ),
    }
}

/// Whether every ResourceQuota the tenant keeps in `ns` is enforced: the quota controller has
/// put each of its `spec.hard` limits into `status.hard`. The store can lag the API server but
/// never lead it, so `true` is never early.
fn quotas_enforced(store: &Store<ResourceQuota>, kept: &Kept, ns: &str) -> bool {
    kept.names::<ResourceQuota>(Some(ns))
        .into_iter()
        .all(|name| {
            store
                .get(&ObjectRef::new(name).within(ns))
                .is_some_and(|q| {
                    let enforced = q.status.as_ref().and_then(|s| s.hard.as_ref());
                    q.spec
                        .as_ref()
                        .and_then(|s| s.hard.as_ref())
                        .into_iter()
                        .flatten()
                        .all(|(k, _)| enforced.is_some_and(|e| e.contains_key(k)))
                })
        })
}

/// [`ensure`] with the current object from `store` (of its kind, or of its metadata).
async fn ensure_child<K, C>(
    children: &Children,
    store: &Cache<C>,
    desired: K,
) -> Result<Outcome, Error>
where
    K: Resource<DynamicType = ()> + Clone + Serialize + DeserializeOwned + Debug,
    K::Scope: ScopeApi,
    C: Resource<DynamicType = ()> + Clone,
{
    let name = desired.name_any();
    let namespace = desired.namespace();
    children
        .ensure_cached(store, desired)
        .await
        .map_err(|source| Error::ApplyChild {
            kind: kind_name::<K>(),
            key: key(namespace.as_deref(), &name),
            source,
        })
}

fn kind_name<K: Resource<DynamicType = ()>>() -> &'static str {
    match K::kind(&()).as_ref() {
        "ResourceQuota" => "ResourceQuota",
        "LimitRange" => "LimitRange",
        "NetworkPolicy" => "NetworkPolicy",
        "RoleBinding" => "RoleBinding",
        "ClusterRole" => "ClusterRole",
        "ClusterRoleBinding" => "ClusterRoleBinding",
        "Secret" => "Secret",
        "ConfigMap" => "ConfigMap",
        "Namespace" => "Namespace",
        _ => "object",
    }
}

/// What [`apply_by_name`] did.
#[derive(Debug, PartialEq, Eq)]
enum ByName {
    /// The object is as desired.
    Applied,
    /// The name is taken by an object that is not this tenant's (only when asked to check).
    Taken,
    /// The operator may not read or write it yet: the Role granting that was just applied.
    NoAccessYet,
}

/// Applies `desired`, read first by name (the operator holds no list of Secrets or ConfigMaps,
/// only `get` on the names of its [`build::access_role`]). With `only_ours`, a name taken by
/// an object that is not this tenant's copy is left alone.
async fn apply_by_name<K>(
    ctx: &Context<State>,
    children: &Children,
    uid: &str,
    desired: K,
    only_ours: bool,
) -> Result<ByName, Error>
where
    K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + Serialize
        + DeserializeOwned
        + Debug,
{
    let name = desired.name_any();
    let namespace = desired.namespace().unwrap_or_default();
    let api: Api<K> = Api::namespaced(ctx.client.clone(), &namespace);
    let existing = match api.get_opt(&name).await {
        Ok(existing) => existing,
        Err(kube::Error::Api(s)) if s.is_forbidden() => return Ok(ByName::NoAccessYet),
        Err(source) => {
            return Err(Error::ReadTarget {
                kind: kind_name::<K>(),
                key: key(Some(&namespace), &name),
                source,
            });
        }
    };
    if only_ours && existing.as_ref().is_some_and(|e| !ours(e, uid)) {
        return Ok(ByName::Taken);
    }
    match children
        .ensure(existing.as_ref().map(|c| c.meta()), desired)
        .await
    {
        Ok(_) => Ok(ByName::Applied),
        // The read may pass where the write does not yet: the operator may `get` every
        // ConfigMap (admission policies with ConfigMap params need that), while `patch` comes
        // only from the access Role, which RBAC sees a moment after it is applied.
        Err(e) if steward_core::apply::is_forbidden(&e) => Ok(ByName::NoAccessYet),
        Err(source) => Err(Error::ApplyChild {
            kind: kind_name::<K>(),
            key: key(Some(&namespace), &name),
            source,
        }),
    }
}

fn ours<K: Resource>(obj: &K, uid: &str) -> bool {
    obj.labels().get(OWNER_LABEL).map(String::as_str) == Some(uid)
}

/// What the operator's access Role in `ns` grants now (from the cache).
fn granted(stores: &crate::controller::Stores, ns: &str) -> Access {
    stores
        .roles
        .get(&ObjectRef::new(ACCESS_ROLE).within(ns))
        .map(|r| Access::of(&r))
        .unwrap_or_default()
}

/// Applies the operator's access Role and its binding in `ns` for `access`, or nothing when
/// there is nothing to reach ([`kept`] does not keep them then: they are pruned).
async fn grant(
    tenant: &Tenant,
    ctx: &Context<State>,
    children: &Children,
    ns: &str,
    access: &Access,
) -> Result<(), Error> {
    if access.is_empty() {
        return Ok(());
    }
    let me = ctx
        .data
        .me
        .get_or_try_init(|| crate::policy::whoami(&ctx.client))
        .await
        .map_err(Error::WhoAmI)?;
    let stores = &ctx.data.stores;
    ensure_child(
        children,
        &stores.roles,
        build::access_role(tenant, ns, access),
    )
    .await?;
    ensure_child(
        children,
        &stores.role_bindings,
        build::access_role_binding(tenant, ns, me),
    )
    .await
    .map(drop)
}

/// Deletes the tenant's copies (and policy parameters) named in `access` in `ns`: each is read
/// first, and only this tenant's own objects are deleted (a name once wanted may belong to
/// someone else).
async fn delete_copies(
    ctx: &Context<State>,
    children: &Children,
    uid: &str,
    ns: &str,
    access: &Access,
) -> Result<(), Error> {
    for name in &access.secrets {
        delete_ours::<k8s_openapi::api::core::v1::Secret>(ctx, children, uid, ns, name).await?;
    }
    for name in &access.config_maps {
        delete_ours::<k8s_openapi::api::core::v1::ConfigMap>(ctx, children, uid, ns, name).await?;
    }
    Ok(())
}

async fn delete_ours<K>(
    ctx: &Context<State>,
    children: &Children,
    uid: &str,
    ns: &str,
    name: &str,
) -> Result<(), Error>
where
    K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + DeserializeOwned
        + Debug,
{
    let api: Api<K> = Api::namespaced(ctx.client.clone(), ns);
    match api.get_opt(name).await {
        Ok(Some(obj)) if ours(&obj, uid) => children
            .delete::<K>(Some(ns), name)
            .await
            .map_err(Error::Prune),
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.is_forbidden() => Ok(()),
        Err(source) => Err(Error::ReadTarget {
            kind: kind_name::<K>(),
            key: key(Some(ns), name),
            source,
        }),
    }
}

/// [`ensure_child`] for each of `desired`.
async fn ensure_all<K, C>(
    children: &Children,
    store: &Cache<C>,
    desired: Vec<K>,
) -> Result<(), Error>
where
    K: Resource<DynamicType = ()> + Clone + Serialize + DeserializeOwned + Debug,
    K::Scope: ScopeApi,
    C: Resource<DynamicType = ()> + Clone,
{
    for obj in desired {
        ensure_child(children, store, obj).await?;
    }
    Ok(())
}

/// The cached source of a shared object (only shareable sources in shared namespaces are
/// cached).
fn source(stores: &crate::controller::Stores, shared: &SharedObject) -> Option<Source> {
    let (name, namespace) = (&shared.name, &shared.namespace);
    match shared.kind {
        SharedKind::Secret => stores
            .source_secrets
            .get(namespace, name)
            .map(Source::Secret),
        SharedKind::ConfigMap => stores
            .source_config_maps
            .get(namespace, name)
            .map(Source::ConfigMap),
    }
}

/// Creates namespace `ns` for `tenant` with only the [`crate::crd::CREATED_FOR_ANNOTATION`]
/// marker (so a crash before the apply that labels it does not leave it refused) unless it
/// exists: `false` when someone else created it first (it is then not taken).
async fn create_namespace(ctx: &Context<State>, tenant: &str, ns: &str) -> Result<bool, Error> {
    let mut created = Namespace::default();
    created.metadata.name = Some(ns.to_string());
    created.metadata.annotations = Some(
        [(
            crate::crd::CREATED_FOR_ANNOTATION.to_string(),
            tenant.to_string(),
        )]
        .into(),
    );
    let params = PostParams {
        field_manager: Some(ctx.field_manager.clone()),
        ..Default::default()
    };
    ctx.writes("tenant").inc("Namespace", "create");
    let answer = Api::<Namespace>::all(ctx.client.clone())
        .create(&params, &created)
        .await;
    let created =
        steward_core::object::unless_exists(answer).map_err(|source| Error::ApplyNamespace {
            name: ns.to_string(),
            source: steward_core::Error::ApplyChild {
                kind: "Namespace".into(),
                name: ns.to_string(),
                source,
            },
        })?;
    Ok(created.is_some())
}

/// Applies the deletion policy to one namespace the tenant no longer has; an adopted one is
/// released whatever the policy.
async fn remove_namespace(
    tenant: &Tenant,
    ctx: &Context<State>,
    ns: &str,
    adopted: bool,
) -> Result<(), Error> {
    let policy = if adopted {
        NamespaceDeletionPolicy::Orphan
    } else {
        tenant.spec.deletion_policy
    };
    match policy {
        NamespaceDeletionPolicy::Delete => {
            ctx.children(tenant)
                .delete::<Namespace>(None, ns)
                .await
                .map_err(|source| Error::DeleteNamespace {
                    name: ns.to_string(),
                    source,
                })?;
            ctx.recorder
                .normal(
                    tenant,
                    "NamespaceDeleted",
                    "DeleteNamespace",
                    format!("namespace {ns} deleted (deletionPolicy Delete)"),
                )
                .await;
        }
        NamespaceDeletionPolicy::Orphan => {
            ctx.children(tenant).count("Namespace", "release");
            release(&ctx.client, &ctx.field_manager, tenant, ns)
                .await
                .map_err(|source| Error::ReleaseNamespace {
                    name: ns.to_string(),
                    source,
                })?;
            ctx.recorder
                .normal(
                    tenant,
                    "NamespaceReleased",
                    "ReleaseNamespace",
                    if adopted {
                        format!("namespace {ns} handed back: it existed before the tenant took it, so it is never deleted")
                    } else {
                        format!("namespace {ns} kept without the tenant (deletionPolicy Orphan)")
                    },
                )
                .await;
        }
    }
    Ok(())
}

/// Removes the labels and annotations the operator put on namespace `ns`; the namespace and
/// everything in it stay.
async fn release(
    client: &Client,
    manager: &str,
    tenant: &Tenant,
    ns: &str,
) -> Result<(), kube::Error> {
    let (labels, annotations) = build::namespace_metadata_keys(tenant);
    let nulls = |keys: Vec<String>| {
        keys.into_iter()
            .map(|k| (k, serde_json::Value::Null))
            .collect::<serde_json::Map<_, _>>()
    };
    let patch = serde_json::json!({"metadata": {"labels": nulls(labels), "annotations": nulls(annotations)}});
    let params = PatchParams {
        field_manager: Some(manager.to_string()),
        ..Default::default()
    };
    let patched = Api::<Namespace>::all(client.clone())
        .patch(ns, &params, &Patch::Merge(&patch))
        .await;
    steward_core::object::unless_gone(patched).map(drop)
}

/// The finalizer's cleanup: applies `deletionPolicy` to every namespace of the tenant. The
/// other children go with the Tenant (owner references). A failure keeps the finalizer and
/// says why in the Ready condition.
async fn cleanup(tenant: Arc<Tenant>, ctx: &Context<State>) -> Result<Cleanup, Error> {
    let name = tenant.name_any();
    let existing: Vec<Existing> = labelled_namespaces(&ctx.data.stores, &name)
        .into_iter()
        .filter(|e| !e.terminating)
        .collect();
    let namespaces: Vec<String> = existing.iter().map(|e| e.name.clone()).collect();
    let mut result = Ok(());
    for ns in &existing {
        result = remove_namespace(&tenant, ctx, &ns.name, ns.adopted).await;
        if result.is_err() {
            break;
        }
    }
    if let Err(e) = &result {
        let obs = Observation {
            generation: tenant.metadata.generation,
            namespaces: namespaces.clone(),
            deleting: true,
            error: Some(("CleanupFailed".to_string(), steward_core::chain(e))),
            ..Default::default()
        };
        if let Err(status_err) = write_status(&tenant, ctx, &obs).await {
            tracing::warn!(error = %steward_core::chain(&status_err), "failed to report the cleanup failure in the status");
        }
    }
    result.map(|()| Cleanup::Done)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::build::tests::TenantFixture;

    fn wanted(tenant: &Tenant, namespaces: &[&str]) -> Vec<(String, NamespaceChildren)> {
        let settings = build::Settings {
            protected: Default::default(),
            owner_cluster_role: "admin".into(),
        };
        namespaces
            .iter()
            .map(|ns| {
                let children = build::namespace_children(tenant, ns, &settings, |_| None);
                (ns.to_string(), children)
            })
            .collect()
    }

    fn named<K: Resource<DynamicType = ()> + Default>(ns: Option<&str>, name: &str) -> K {
        let mut obj = K::default();
        obj.meta_mut().namespace = ns.map(str::to_string);
        obj.meta_mut().name = Some(name.into());
        obj
    }

    /// What a tenant keeps is decided from what it wants: its quota in each namespace only
    /// with quotas in the spec, every owner binding (also one held back until the quota is
    /// enforced), the operator's access where it writes by name, the owners' cluster access;
    /// anything else of its children is pruned.
    #[test]
    fn a_tenant_keeps_what_it_wants_and_nothing_else() {
        let tenant = TenantFixture::new("acme").owner_user("alice").build();
        let spec = validate::validate(&tenant.spec).unwrap();
        let wanted = wanted(&tenant, &["a", "b"]);
        let kept = kept(&tenant, &spec, &wanted);
        for ns in ["a", "b"] {
            for rb in &wanted[usize::from(ns == "b")].1.role_bindings {
                assert!(kept.contains(rb), "{rb:?}");
            }
            assert!(kept.contains(&named::<Role>(Some(ns), ACCESS_ROLE)));
            assert!(kept.contains(&named::<RoleBinding>(Some(ns), ACCESS_ROLE)));
            assert!(
                kept.names::<ResourceQuota>(Some(ns)).is_empty(),
                "no quota in the spec: none kept"
            );
            assert!(!kept.contains(&named::<RoleBinding>(Some(ns), "removed-binding")));
        }
        let owners = build::owner_cluster_object_name(&tenant);
        assert!(kept.contains(&named::<ClusterRole>(None, &owners)));
        assert!(kept.contains(&named::<ClusterRoleBinding>(None, &owners)));
        assert!(
            !kept.contains(&named::<Role>(Some("c"), ACCESS_ROLE)),
            "not its namespace"
        );

        let limited = TenantFixture::new("acme")
            .owner_user("alice")
            .spec(|s| {
                s.resource_quota = Some(
                    serde_json::from_value(serde_json::json!({"hard": {"pods": "5"}})).unwrap(),
                );
            })
            .build();
        let spec = validate::validate(&limited.spec).unwrap();
        let kept = super::kept(&limited, &spec, &wanted);
        assert_eq!(kept.names::<ResourceQuota>(Some("a")), [QUOTA_NAME]);
        assert_eq!(kept.names::<ResourceQuota>(Some("b")), [QUOTA_NAME]);
    }

    /// Each thing that keeps owners out of a namespace for now is said once, most basic
    /// first: the access to copy, the policies' parameters, then the quota.
    #[test]
    fn a_namespace_says_what_holds_its_owners_back() {
        let done = InNamespace {
            params_written: true,
            enforced: true,
            ..InNamespace::default()
        };
        assert!(done.problems("a").is_empty());
        let reasons = |applied: InNamespace| -> Vec<&'static str> {
            applied.problems("a").iter().map(|p| p.reason).collect()
        };
        assert_eq!(
            reasons(InNamespace {
                pending: true,
                held: true,
                enforced: false,
                ..InNamespace::default()
            }),
            ["CopiesPending", "WaitingForPolicies"]
        );
        assert_eq!(
            reasons(InNamespace {
                held: true,
                params_written: true,
                ..InNamespace::default()
            }),
            ["WaitingForQuota"]
        );
        // Not enforced, but no binding waits (they exist already): nothing to say.
        assert!(
            InNamespace {
                params_written: true,
                ..InNamespace::default()
            }
            .problems("a")
            .is_empty()
        );
        assert!(
            InNamespace {
                held: true,
                params_written: true,
                ..InNamespace::default()
            }
            .problems("team-x")[0]
                .message
                .contains("team-x")
        );
    }

    #[test]
    fn shared_copies_report_each_kind_of_problem_once() {
        let outcome = SharedOutcome {
            missing_sources: BTreeSet::from([
                "Secret other/token".to_string(),
                "Secret shared/gone".to_string(),
            ]),
            taken: BTreeSet::from(["Secret team-a/pull".to_string()]),
        };
        let not_shared = ["Secret other/token".to_string()];
        let problems = outcome.problems(&not_shared, &["shared".to_string()]);
        let reasons: Vec<&str> = problems.iter().map(|p| p.reason).collect();
        assert_eq!(
            reasons,
            [
                "SharedNamespaceNotAllowed",
                "SharedObjectMissing",
                "SharedObjectConflict"
            ]
        );
        // A source outside the shared namespaces is reported as such, not also as missing.
        assert!(!problems[1].message.contains("other/token"), "{problems:?}");
        assert!(problems[1].message.contains("shared/gone"));
        assert!(SharedOutcome::default().problems(&[], &[]).is_empty());
    }
}
