//! The reconcile pipeline: validate → observe → (before the plan starts) dry-run every change
//! against its target → apply recorded changes → step → status → apply the changes that status
//! just recorded.
//!
//! One status write per reconcile, by server-side apply *with the plan's resourceVersion as a
//! precondition*: a reconcile that acted on a stale copy of the plan cannot overwrite a newer
//! status (it gets a conflict and looks again). Events go out only after the write.
//!
//! A target is changed only on a status known to be current: the changes a reconcile makes
//! right after its own status write were recorded by that (guarded) write; the changes it makes
//! *before* stepping (recorded by an earlier reconcile that crashed or was cut off before making
//! them) are made only after a fresh read of the plan shows the cached copy's resourceVersion.
//! A stale copy — say one still `Progressing` while the stored plan is `RollingBack` and the
//! target is already reverted — would otherwise re-apply the very version being undone (its
//! JSON-patch `test` passes: the target holds the old value again).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams, PostParams};
use kube::runtime::controller::Action;
use kube::{Client, ResourceExt};
use steward_core::finalizer::{self, Cleanup};
use steward_core::{Context, object};

use crate::crd::{Component, HookRun, HookStage, PlanPhase, TargetRef, UpgradePlan};
use crate::error::Error;
use crate::health;
use crate::hook::{self, JobState};
use crate::metrics::PlanMetrics;
use crate::plan::Invalid;
use crate::progress::{self, Input, Outcome};
use crate::redact;
use crate::target::{self, Observation, Workload};
use crate::{CONTROLLER, plan};

/// The operator's state in every reconcile.
pub struct Data {
    pub metrics: PlanMetrics,
    /// `--default-service-account`: what a plan naming no ServiceAccount acts as.
    pub default_service_account: Option<String>,
}

/// The finalizer that keeps a deleted plan until what it changed is undone.
pub const FINALIZER: &str = "upgrade.steward.dev/rollback";

/// Reconciles one plan.
///
/// Deleting a plan that has started and not finished rolls it back first: every changed
/// component is reverted (last wave first, as after a failure; `rollback: Never` components
/// keep their value), components in flight included, and nothing new starts. The finalizer
/// [`FINALIZER`] keeps the plan, and its record, until then. A plan that never started or has
/// finished (`Succeeded`, `RolledBack`, `Failed`) goes at once. Either way a `PlanDeleted`
/// Event says what the targets were left with.
///
/// # Errors
/// The step that failed, wrapped by the finalizer; the runtime records it as a Warning Event
/// and retries with backoff.
pub async fn reconcile(
    plan: Arc<UpgradePlan>,
    ctx: Arc<Context<Data>>,
) -> Result<Action, finalizer::Error<Error>> {
    finalizer::dispatch(
        &ctx.client,
        FINALIZER,
        plan,
        |plan| converge(plan, ctx.clone(), false),
        |plan| async {
            if !may_go(&plan) {
                // Roll back what it changed first; the finalizer stays until then.
                return converge(plan, ctx.clone(), true)
                    .await
                    .map(Cleanup::Pending);
            }
            let message = progress::deletion_record(plan.status.as_ref());
            ctx.recorder
                .normal(plan.as_ref(), "PlanDeleted", "Delete", message)
                .await;
            Ok(Cleanup::Done)
        },
    )
    .await
}

/// Whether a deleted plan may go: it never started, or it has finished.
fn may_go(plan: &UpgradePlan) -> bool {
    plan.status
        .as_ref()
        .is_none_or(|s| s.started_at.is_none() || s.phase.is_some_and(|p| p.is_terminal()))
}

/// One reconcile of a plan; `deleting`: it is being deleted, so roll back what it changed.
async fn converge(
    plan: Arc<UpgradePlan>,
    ctx: Arc<Context<Data>>,
    deleting: bool,
) -> Result<Action, Error> {
    let plan = acting_plan(plan, ctx.data.default_service_account.as_deref());
    let name = plan.name_any();
    let namespace = plan
        .namespace()
        .ok_or_else(|| Error::NoNamespace(name.clone()))?;
    let generation = plan.metadata.generation.unwrap_or(0);
    let status = plan.status.clone().unwrap_or_default();
    if status.phase.is_some_and(|p| p.is_terminal())
        && status.observed_generation == Some(generation)
    {
        return Ok(Action::await_change());
    }
    let now = Timestamp::now();

    // A deleted plan rolls back as its ServiceAccount still (its namespace may be going, the
    // ServiceAccount with it).
    let not_delegated = if deleting {
        None
    } else {
        not_delegated(&ctx, &plan, &namespace).await?
    };
    let client = acting_client(&ctx, &plan, &namespace)?;
    let (outcome, targets) = match (not_delegated, plan::plan(&plan.spec.components)) {
        (Some(invalid), _) | (None, Err(invalid)) => {
            (progress::invalid(&status, generation, &invalid, now), None)
        }
        (None, Ok(validated)) => {
            match step(&ctx, &client, &plan, &namespace, &validated, deleting, now).await? {
                Some(stepped) => stepped,
                None => return Ok(Action::requeue(Duration::from_secs(1))),
            }
        }
    };

    // A health rule that could not be evaluated (the evaluator was busy) is looked at again
    // soon, not only on the target's next change.
    let busy = targets
        .as_ref()
        .is_some_and(|(observed, _, _)| observed.values().any(|o| health::is_busy(&o.health)));
    // Guarded by the plan's resourceVersion (steward-core): a stale copy writes nothing.
    let changed = plan.status.as_ref() != Some(&outcome.status);
    match ctx
        .apply_status(plan.as_ref(), plan.status.as_ref(), &outcome.status)
        .await
    {
        Ok(false) if changed => {
            // Our copy of the plan is stale (or this status is already written on top of
            // it); the newer version's watch event brings us back.
            tracing::debug!(plan = %name, "status not written on a stale copy; looking again");
            return Ok(Action::requeue(Duration::from_secs(1)));
        }
        Ok(false) => {}
        Ok(true) => {
            publish(&ctx, &plan, &outcome).await;
            if let Some((_, workloads, _)) = &targets
                && matches!(
                    outcome.status.phase,
                    Some(PlanPhase::Succeeded | PlanPhase::RolledBack)
                )
            {
                forget_kept(&ctx, &client, &plan, workloads).await;
            }
            // The starts (and reverts) this write recorded are stored now: make them at once
            // rather than on the write's own watch event. After a crash here, the next
            // reconcile makes them from the stored status instead.
            if let Some(targets) = targets
                && !outcome.status.phase.is_some_and(|p| p.is_terminal())
            {
                act_on_recorded(&ctx, &client, &plan, &namespace, &outcome.status, targets).await?;
            }
        }
        Err(source) => {
            return Err(Error::WriteStatus {
                name,
                source: Box::new(source),
            });
        }
    }
    let recheck = match (outcome.recheck_after, busy) {
        (Some(d), true) => Some(d.min(health::EVALUATION_LIMIT)),
        (None, true) => Some(health::EVALUATION_LIMIT),
        (after, false) => after,
    };
    Ok(match recheck {
        Some(d) => Action::requeue(d + Duration::from_millis(100)),
        None => Action::await_change(),
    })
}

/// `plan` as it acts: one that names no ServiceAccount acts as `default` (the orchestrator's
/// `--default-service-account`) when that is set, as if it named it.
fn acting_plan(plan: Arc<UpgradePlan>, default: Option<&str>) -> Arc<UpgradePlan> {
    match default {
        Some(account) if plan.spec.service_account_name.is_none() => {
            let mut acting = (*plan).clone();
            acting.spec.service_account_name = Some(account.to_string());
            Arc::new(acting)
        }
        _ => plan,
    }
}

/// Why `plan` may not act as its `spec.serviceAccountName`: the ServiceAccount does not exist
/// or does not delegate to the plan ([`plan::DELEGATE_ANNOTATION`]). Looked at on every
/// reconcile, so taking the annotation away stops a plan (`Valid=False`) until it is back.
/// The `--default-service-account` needs no delegation (it acts for every plan of its
/// namespace), only to exist.
async fn not_delegated(
    ctx: &Context<Data>,
    plan: &UpgradePlan,
    namespace: &str,
) -> Result<Option<Invalid>, Error> {
    let Some(account) = &plan.spec.service_account_name else {
        return Ok(None);
    };
    let acts_for_all = ctx.data.default_service_account.as_ref() == Some(account);
    let accounts: Api<ServiceAccount> = Api::namespaced(ctx.client.clone(), namespace);
    let found = accounts
        .get_opt(account)
        .await
        .map_err(|source| Error::ReadServiceAccount {
            account: account.clone(),
            source: Box::new(source),
        })?;
    let why = match &found {
        None => "does not exist",
        Some(sa) => {
            let names = sa.annotations().get(plan::DELEGATE_ANNOTATION);
            if acts_for_all || plan::delegates(names.map(String::as_str), &plan.name_any()) {
                return Ok(None);
            }
            "does not delegate to this plan"
        }
    };
    Ok(Some(Invalid::NotDelegated {
        account: account.clone(),
        plan: plan.name_any(),
        why,
    }))
}

/// The client a plan acts through on its targets and hook Jobs: impersonating its
/// `serviceAccountName` when it names one, else the orchestrator's own.
fn acting_client(
    ctx: &Context<Data>,
    plan: &UpgradePlan,
    namespace: &str,
) -> Result<Client, Error> {
    match &plan.spec.service_account_name {
        Some(sa) => ctx
            .impersonating(&format!("system:serviceaccount:{namespace}:{sa}"))
            .map_err(|source| Error::Impersonate {
                account: sa.clone(),
                source: Box::new(source),
            }),
        None => Ok(ctx.client.clone()),
    }
}

/// What a plan's step read of its targets: each target's observation, the workloads, the
/// hook Jobs.
type Targets = (
    BTreeMap<String, Observation>,
    BTreeMap<String, Workload>,
    BTreeMap<String, JobState>,
);

/// One step of a valid plan: reads the targets and hook Jobs, refuses a plan whose targets or
/// health rules cannot work (before it starts), makes the writes and Jobs the stored status
/// recorded but that are not there yet, then decides the next step ([`progress::step`]).
/// Returns the status to write and the targets as read (`None`: refused before any target was
/// read); `None` when the cached plan is older than the API server's, and nothing was done (the
/// newer version's watch event brings the plan back).
async fn step(
    ctx: &Context<Data>,
    client: &Client,
    plan: &UpgradePlan,
    namespace: &str,
    validated: &plan::Plan,
    deleting: bool,
    now: Timestamp,
) -> Result<Option<(progress::Outcome, Option<Targets>)>, Error> {
    let name = plan.name_any();
    let generation = plan.metadata.generation.unwrap_or(0);
    let status = plan.status.clone().unwrap_or_default();
    let (mut observed, workloads) = observe(client, plan, namespace).await?;
    let mut jobs = hook_jobs(client, plan, namespace).await?;
    let refused = if status.started_at.is_none() {
        match plan::slow_health(&plan.spec.components) {
            Err(invalid) => Some(invalid),
            Ok(()) => check_targets(ctx, client, plan, namespace, &workloads, &observed).await?,
        }
    } else {
        None
    };
    if let Some(invalid) = refused {
        return Ok(Some((
            progress::invalid(&status, generation, &invalid, now),
            None,
        )));
    }
    let mut rejected = BTreeMap::new();
    let (pending, missing_jobs) = if status.phase.is_some_and(|p| p.is_terminal()) {
        (Vec::new(), Vec::new())
    } else {
        (
            progress::writes(&plan.spec, &status, &observed),
            hook::to_create(&plan.spec, &status, &jobs),
        )
    };
    if !pending.is_empty() || !missing_jobs.is_empty() {
        if !is_current(ctx, plan, namespace).await? {
            tracing::debug!(plan = %name, "cached plan is stale; not acting on it");
            return Ok(None);
        }
        apply_recorded(
            ctx,
            client,
            plan,
            pending,
            &workloads,
            &mut observed,
            &mut rejected,
        )
        .await?;
        create_hook_jobs(ctx, client, plan, namespace, missing_jobs, &mut jobs).await?;
    }
    let outcome = progress::step(&Input {
        name: &name,
        jobs: &jobs,
        spec: &plan.spec,
        generation,
        status: &status,
        plan: validated,
        observed: &observed,
        rejected: &rejected,
        now: Timestamp::now(),
        deleting,
    });
    Ok(Some((outcome, Some((observed, workloads, jobs)))))
}

/// After a status write that recorded starts (or reverts): makes its hook Jobs and writes.
async fn act_on_recorded(
    ctx: &Context<Data>,
    client: &Client,
    plan: &UpgradePlan,
    namespace: &str,
    written: &crate::crd::UpgradePlanStatus,
    (mut observed, workloads, mut jobs): Targets,
) -> Result<(), Error> {
    let recorded = hook::to_create(&plan.spec, written, &jobs);
    create_hook_jobs(ctx, client, plan, namespace, recorded, &mut jobs).await?;
    let mut rejected = BTreeMap::new();
    let recorded = progress::writes(&plan.spec, written, &observed);
    apply_recorded(
        ctx,
        client,
        plan,
        recorded,
        &workloads,
        &mut observed,
        &mut rejected,
    )
    .await
}

/// Before a plan starts: whether each target's kind accepts the new value, by a server-side
/// dry run of the very patch the plan will send, so the target's own schema and CEL rules
/// decide (a PostgresCluster version that is not a number, out of range or lower than the
/// current one; an image the API server refuses). The first refusal, in component order.
/// Missing targets and containers are the step's to report (`TargetNotFound`). Each hook's
/// Job is dry-run created first, the same way (`InvalidHook`).
async fn check_targets(
    ctx: &Context<Data>,
    client: &Client,
    plan: &UpgradePlan,
    namespace: &str,
    workloads: &BTreeMap<String, Workload>,
    observed: &BTreeMap<String, Observation>,
) -> Result<Option<Invalid>, Error> {
    if let Some(invalid) = check_hooks(client, plan, namespace).await? {
        return Ok(Some(invalid));
    }
    for component in &plan.spec.components {
        let target = &component.target;
        let (Some(workload), Some(Ok(current)), Some(desired)) = (
            workloads.get(&component.name),
            observed.get(&component.name).map(|o| &o.value),
            component.desired(),
        ) else {
            continue;
        };
        if *current == desired {
            continue;
        }
        let kept = kept_annotation(plan, component);
        let patch = match workload.change(component, &kept, current, &desired) {
            Ok(patch) => patch,
            Err(message) => {
                return Ok(Some(Invalid::InvalidChange {
                    component: component.name.clone(),
                    message,
                }));
            }
        };
        match target::patch(
            client,
            target.namespace_in(namespace),
            target,
            patch,
            &ctx.field_manager,
            true,
        )
        .await
        {
            Ok(_) => {}
            // 403: the plan's ServiceAccount may not change it.
            Err(kube::Error::Api(s)) if object::is_refusal(&s) => {
                return Ok(Some(Invalid::ChangeRefused {
                    component: component.name.clone(),
                    kind: target.kind.clone(),
                    name: target.name.clone(),
                    message: s.message,
                }));
            }
            Err(source) => {
                return Err(Error::ChangeTarget {
                    kind: target.kind.clone(),
                    name: target.name.clone(),
                    from: current.clone(),
                    to: desired.to_string(),
                    source: Box::new(source),
                });
            }
        }
    }
    Ok(None)
}

/// Whether the API server accepts each hook's Job, by a server-side dry run of its create.
async fn check_hooks(
    client: &Client,
    plan: &UpgradePlan,
    namespace: &str,
) -> Result<Option<Invalid>, Error> {
    let jobs: Api<Job> = Api::namespaced(client.clone(), namespace);
    let generation = plan.metadata.generation.unwrap_or(0);
    for component in &plan.spec.components {
        for stage in [HookStage::Before, HookStage::After] {
            if component.hook(stage).is_none() {
                continue;
            }
            let refused = |message: String| Invalid::InvalidHook {
                component: component.name.clone(),
                stage: stage.as_str(),
                message,
            };
            let job = hook::job_name(&plan.name_any(), &component.name, stage, generation);
            let run = HookRun::running(stage, job, None);
            let job = match hook::build(plan, component, &run) {
                Ok(job) => job,
                Err(message) => return Ok(Some(refused(message))),
            };
            let dry_run = PostParams {
                dry_run: true,
                field_manager: None,
            };
            match jobs.create(&dry_run, &job).await {
                // AlreadyExists: the name is taken (by this plan's own Job after a crash).
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.is_already_exists() || s.is_conflict() => {}
                Err(kube::Error::Api(s)) if object::is_refusal(&s) => {
                    return Ok(Some(refused(s.message)));
                }
                Err(source) => {
                    return Err(Error::CreateHook {
                        job: run.job,
                        source: Box::new(source),
                    });
                }
            }
        }
    }
    Ok(None)
}

/// The plan's hook Jobs (by its label), by name; none listed for a plan without hooks.
async fn hook_jobs(
    client: &Client,
    plan: &UpgradePlan,
    namespace: &str,
) -> Result<BTreeMap<String, JobState>, Error> {
    if plan.spec.components.iter().all(|c| c.hooks.is_none()) {
        return Ok(BTreeMap::new());
    }
    let api: Api<Job> = Api::namespaced(client.clone(), namespace);
    let selector = format!("{}={}", hook::PLAN_LABEL, plan.name_any());
    let jobs = match api.list(&ListParams::default().labels(&selector)).await {
        Ok(jobs) => jobs,
        // The plan's ServiceAccount may not list Jobs: none seen; creating one is refused
        // too, which fails the component saying so.
        Err(kube::Error::Api(s)) if s.is_forbidden() => return Ok(BTreeMap::new()),
        Err(source) => {
            return Err(Error::ReadHooks {
                name: plan.name_any(),
                source: Box::new(source),
            });
        }
    };
    Ok(jobs
        .items
        .iter()
        .map(|job| (job.name_any(), hook::state(job)))
        .collect())
}

/// Creates the Jobs of hooks the status records ([`hook::to_create`]); one that exists
/// already (created before a crash, not yet listed) is left as it is.
async fn create_hook_jobs(
    ctx: &Context<Data>,
    client: &Client,
    plan: &UpgradePlan,
    namespace: &str,
    runs: Vec<(usize, HookRun)>,
    jobs: &mut BTreeMap<String, JobState>,
) -> Result<(), Error> {
    let api: Api<Job> = Api::namespaced(client.clone(), namespace);
    for (index, run) in runs {
        let Some(component) = plan.spec.components.get(index) else {
            continue;
        };
        let job = hook::build(plan, component, &run).map_err(|message| Error::BuildHook {
            job: run.job.clone(),
            message,
        })?;
        ctx.writes(CONTROLLER).inc("Job", "create");
        match api.create(&PostParams::default(), &job).await {
            Ok(_) => {
                tracing::info!(plan = %plan.name_any(), component = %component.name, job = %run.job, "created hook Job");
            }
            Err(kube::Error::Api(s)) if s.is_already_exists() || s.is_conflict() => {}
            // Refused as invalid, or forbidden: retrying cannot help; the step fails the
            // component.
            Err(kube::Error::Api(s)) if object::is_refusal(&s) => {
                tracing::warn!(plan = %plan.name_any(), job = %run.job, message = %s.message, "hook Job refused");
                jobs.insert(
                    run.job.clone(),
                    JobState::Failed(format!("the API server refused the Job: {}", s.message)),
                );
            }
            Err(source) => {
                return Err(Error::CreateHook {
                    job: run.job.clone(),
                    source: Box::new(source),
                });
            }
        }
    }
    Ok(())
}

/// Whether the API server still holds exactly this version of `plan` (a quorum read).
async fn is_current(
    ctx: &Context<Data>,
    plan: &UpgradePlan,
    namespace: &str,
) -> Result<bool, Error> {
    let api: Api<UpgradePlan> = Api::namespaced(ctx.client.clone(), namespace);
    let stored = api
        .get_opt(&plan.name_any())
        .await
        .map_err(|source| Error::ReadPlan {
            name: plan.name_any(),
            source: Box::new(source),
        })?;
    Ok(stored.is_some_and(|stored| stored.resource_version() == plan.resource_version()))
}

/// Reads every target of the plan.
async fn observe(
    client: &Client,
    plan: &UpgradePlan,
    namespace: &str,
) -> Result<(BTreeMap<String, Observation>, BTreeMap<String, Workload>), Error> {
    let mut observed = BTreeMap::new();
    let mut workloads = BTreeMap::new();
    for c in &plan.spec.components {
        let workload = match target::get(client, c.target.namespace_in(namespace), &c.target).await
        {
            Ok(workload) => workload,
            // Not allowed to read it (a kind the orchestrator's role does not cover): say so
            // in the plan, which cannot start (or go on) without it.
            Err(kube::Error::Api(s)) if s.is_forbidden() => {
                observed.insert(
                    c.name.clone(),
                    Observation::forbidden(&c.target, &s.message),
                );
                continue;
            }
            Err(source) => {
                return Err(Error::ReadTarget {
                    kind: c.target.kind.clone(),
                    name: c.target.name.clone(),
                    source: Box::new(source),
                });
            }
        };
        let observation = match &workload {
            Some(w) => Observation::of(c, w, &kept_annotation(plan, c)).await,
            None => Observation::missing(&c.target),
        };
        observed.insert(c.name.clone(), observation);
        if let Some(w) = workload {
            workloads.insert(c.name.clone(), w);
        }
    }
    Ok((observed, workloads))
}

/// Makes `writes`: the changes (and reverts) a status records but the targets do not show yet
/// ([`progress::writes`]).
async fn apply_recorded(
    ctx: &Context<Data>,
    client: &Client,
    plan: &UpgradePlan,
    writes: Vec<progress::Write>,
    workloads: &BTreeMap<String, Workload>,
    observed: &mut BTreeMap<String, Observation>,
    rejected: &mut BTreeMap<String, String>,
) -> Result<(), Error> {
    let namespace = plan.namespace().unwrap_or_default();
    for write in writes {
        let Some(component) = plan.spec.components.get(write.index) else {
            continue;
        };
        let target = &component.target;
        let Some(workload) = workloads.get(&component.name) else {
            continue;
        };
        let kept = kept_annotation(plan, component);
        let patch = workload
            .change(component, &kept, &write.from, &write.to)
            .map_err(|message| Error::BuildChange {
                kind: target.kind.clone(),
                name: target.name.clone(),
                message,
            })?;
        let updated = match change_target(ctx, client, &namespace, target, patch).await {
            Ok(updated) => updated,
            // Refused as invalid (a validation rule, e.g. a version that cannot be lowered):
            // retrying cannot help, the step fails the component (or the rollback).
            // Or forbidden (the plan's ServiceAccount may not change it).
            Err(kube::Error::Api(s)) if object::is_refusal(&s) => {
                tracing::warn!(plan = %plan.name_any(), component = %component.name, message = %s.message, "change refused");
                rejected.insert(component.name.clone(), s.message.clone());
                continue;
            }
            Err(source) => {
                return Err(Error::ChangeTarget {
                    kind: target.kind.clone(),
                    name: target.name.clone(),
                    from: write.from.clone(),
                    to: write.to.clone(),
                    source: Box::new(source),
                });
            }
        };
        observed.insert(
            component.name.clone(),
            Observation::of(component, &updated, &kept).await,
        );
        let (reason, action, verb) = if write.revert {
            ("TargetReverted", "Rollback", "reverted")
        } else {
            ("TargetChanged", "Upgrade", "changed")
        };
        let note = format!(
            "component {}: {verb} {} {:?} -> {:?}",
            component.name,
            component.describe(),
            write.from,
            write.to
        );
        tracing::info!(plan = %plan.name_any(), component = %component.name, from = %write.from, to = %write.to, "{verb} target");
        ctx.recorder.normal(plan, reason, action, note).await;
    }
    Ok(())
}

/// Patches `target` of a plan in `namespace` (counted as a write), returning it as stored.
async fn change_target(
    ctx: &Context<Data>,
    client: &Client,
    namespace: &str,
    target: &TargetRef,
    patch: json_patch::Patch,
) -> Result<Workload, kube::Error> {
    ctx.writes(CONTROLLER).inc(&target.kind, "patch");
    target::patch(
        client,
        target.namespace_in(namespace),
        target,
        patch,
        &ctx.field_manager,
        false,
    )
    .await
}

/// Once a plan has succeeded or rolled back, nothing restores a replaced value any more:
/// removes the annotations in which its targets keep them ([`redact`]). Best effort: a
/// removal that fails (or a crash before it) leaves the annotation, and says so in the log.
async fn forget_kept(
    ctx: &Context<Data>,
    client: &Client,
    plan: &UpgradePlan,
    workloads: &BTreeMap<String, Workload>,
) {
    let namespace = plan.namespace().unwrap_or_default();
    for component in &plan.spec.components {
        if redact::exposure(component) == redact::Exposure::Clear {
            continue;
        }
        let kept = kept_annotation(plan, component);
        let Some(patch) = workloads.get(&component.name).and_then(|w| w.forget(&kept)) else {
            continue;
        };
        let removed = change_target(ctx, client, &namespace, &component.target, patch).await;
        if let Err(error) = removed {
            tracing::warn!(plan = %plan.name_any(), component = %component.name, annotation = %kept, %error, "could not remove the kept previous value");
        }
    }
}

/// The annotation in which `component`'s target keeps the value it replaced, when its plan
/// does not show it ([`redact`]).
fn kept_annotation(plan: &UpgradePlan, component: &Component) -> String {
    redact::kept_annotation(
        &plan.namespace().unwrap_or_default(),
        &plan.name_any(),
        &component.name,
    )
}

/// Publishes the outcome's Events and records its metrics.
async fn publish(ctx: &Context<Data>, plan: &UpgradePlan, outcome: &Outcome) {
    for note in &outcome.notes {
        if note.warning {
            ctx.recorder
                .warning(plan, note.reason, note.action, note.message.clone())
                .await;
        } else {
            ctx.recorder
                .normal(plan, note.reason, note.action, note.message.clone())
                .await;
        }
    }
    ctx.data.metrics.observe(&outcome.finished);
}
