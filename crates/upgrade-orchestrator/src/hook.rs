//! Hooks: the Jobs a component runs before its change and after its target is healthy.
//! Pure: their names, the Job built from a hook, a Job's state, and which recorded hooks
//! still need their Job.
//!
//! Like a change to a target, a hook is *recorded* first ([`crate::progress::step`] writes
//! its [`HookRun`] into the status) and its Job created from the stored status
//! ([`to_create`]); the name is fixed by the record, so a crash between the two creates it
//! once (a second create is `AlreadyExists`).

use std::collections::BTreeMap;

use k8s_openapi::api::batch::v1::{Job, JobSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::{Resource, ResourceExt};
use sha2::{Digest, Sha256};

use crate::crd::{
    Component, ComponentPhase, HookPhase, HookRun, HookStage, UpgradePlan, UpgradePlanSpec,
    UpgradePlanStatus,
};

/// Label on hook Jobs (and their pods): the plan that runs them.
pub const PLAN_LABEL: &str = "upgrade.steward.dev/plan";
/// Label on hook Jobs: the component.
pub const COMPONENT_LABEL: &str = "upgrade.steward.dev/component";
/// Label on hook Jobs: `before` or `after`.
pub const STAGE_LABEL: &str = "upgrade.steward.dev/hook";

/// A hook Job as the step sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum JobState {
    /// Not finished; what it is doing.
    Running(String),
    Succeeded,
    /// Failed, with the Job's reason and message.
    Failed(String),
}

/// The state of `job` from its conditions (`Complete`, `Failed`).
pub fn state(job: &Job) -> JobState {
    let status = job.status.as_ref();
    let condition = |type_: &str| {
        status
            .and_then(|s| s.conditions.as_ref())
            .and_then(|c| c.iter().find(|c| c.type_ == type_ && c.status == "True"))
    };
    if condition("Complete").is_some() {
        return JobState::Succeeded;
    }
    if let Some(c) = condition("Failed") {
        let reason = c.reason.as_deref().unwrap_or("Failed");
        return JobState::Failed(match c.message.as_deref().filter(|m| !m.is_empty()) {
            Some(m) => format!("{reason}: {m}"),
            None => reason.to_string(),
        });
    }
    let active = status.and_then(|s| s.active).unwrap_or(0);
    let failed = status.and_then(|s| s.failed).unwrap_or(0);
    JobState::Running(format!("{active} pod(s) running, {failed} failed so far"))
}

/// The name of the Job a component runs at `stage`, recorded at `generation` (a retry after
/// a spec change runs a new Job). At most 63 characters, as a Job's name must be: a longer
/// one keeps its start and ends with a hash of the whole.
pub fn job_name(plan: &str, component: &str, stage: HookStage, generation: i64) -> String {
    let full = format!("{plan}-{component}-{}-{generation}", stage.as_str());
    if full.len() <= 63 {
        return full;
    }
    let digest = Sha256::digest(full.as_bytes());
    let hash: String = digest.iter().take(5).map(|b| format!("{b:02x}")).collect();
    let head = full[..52].trim_end_matches('-');
    format!("{head}-{hash}")
}

/// The Job of `run` for `component` of `plan`: the hook's spec, labelled, owned by the plan
/// (deleted with it), with `activeDeadlineSeconds` defaulting to the plan's
/// `progressDeadlineSeconds` and the pods' ServiceAccount to the plan's
/// `spec.serviceAccountName`.
///
/// # Errors
/// When the component has no hook at `run.stage` (the spec changed under the record), or
/// the hook's `job` does not decode as a Job spec.
pub fn build(plan: &UpgradePlan, component: &Component, run: &HookRun) -> Result<Job, String> {
    let hook = component.hook(run.stage).ok_or_else(|| {
        format!(
            "component {} has no {} hook",
            component.name,
            run.stage.as_str()
        )
    })?;
    let labels = BTreeMap::from([
        (PLAN_LABEL.to_string(), plan.name_any()),
        (COMPONENT_LABEL.to_string(), component.name.clone()),
        (STAGE_LABEL.to_string(), run.stage.as_str().to_string()),
    ]);
    let mut spec: JobSpec = serde_json::from_value(hook.job.clone())
        .map_err(|e| format!("hooks.{}.job is not a Job spec: {e}", run.stage.as_str()))?;
    let pod = spec.template.spec.as_ref();
    let account = pod.and_then(|p| {
        p.service_account_name
            .clone()
            .or_else(|| p.service_account.clone())
    });
    if let Some(account) = account.as_deref().filter(|a| !may_run_as(plan, a)) {
        return Err(format!(
            "hooks.{}.job runs as ServiceAccount {account:?}: a hook runs as the plan's spec.serviceAccountName ({}) or as the namespace's default",
            run.stage.as_str(),
            plan.spec
                .service_account_name
                .as_deref()
                .unwrap_or("none named")
        ));
    }
    // A hook that names no account runs as the plan's, when it has one: the account the
    // plan acts as, not the namespace's default.
    if account.is_none()
        && let (Some(pod), Some(plan_account)) = (
            spec.template.spec.as_mut(),
            plan.spec.service_account_name.as_ref(),
        )
    {
        pod.service_account_name = Some(plan_account.clone());
    }
    spec.active_deadline_seconds
        .get_or_insert(i64::from(plan.spec.strategy.progress_deadline_seconds));
    let template = spec
        .template
        .metadata
        .get_or_insert_with(ObjectMeta::default);
    template
        .labels
        .get_or_insert_with(BTreeMap::new)
        .extend(labels.clone());
    Ok(Job {
        metadata: ObjectMeta {
            name: Some(run.job.clone()),
            namespace: plan.namespace(),
            labels: Some(labels),
            owner_references: plan.controller_owner_ref(&()).map(|o| vec![o]),
            ..ObjectMeta::default()
        },
        spec: Some(spec),
        status: None,
    })
}

/// Whether a hook Job of `plan` may run as ServiceAccount `account`: the namespace's
/// `default` or the plan's own `spec.serviceAccountName` (which delegates to the plan). Any
/// other would let whoever may create a plan run code as every ServiceAccount of its
/// namespace.
fn may_run_as(plan: &UpgradePlan, account: &str) -> bool {
    account == "default" || plan.spec.service_account_name.as_deref() == Some(account)
}

/// The recorded hooks whose Job does not exist yet: `(component index, run)` of every
/// Progressing component whose hook is `Running` and not among `jobs`.
pub fn to_create(
    spec: &UpgradePlanSpec,
    status: &UpgradePlanStatus,
    jobs: &BTreeMap<String, JobState>,
) -> Vec<(usize, HookRun)> {
    spec.components
        .iter()
        .enumerate()
        .filter_map(|(index, component)| {
            let cs = status
                .components
                .iter()
                .find(|s| s.name == component.name)?;
            let run = cs.hook.as_ref()?;
            (cs.phase == ComponentPhase::Progressing
                && run.phase == HookPhase::Running
                && !jobs.contains_key(&run.job))
            .then(|| (index, run.clone()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::batch::v1::{JobCondition, JobStatus};
    use k8s_openapi::api::core::v1::{Container, PodSpec, PodTemplateSpec};

    #[test]
    fn names_fit_a_job_and_differ_by_stage_generation_and_plan() {
        assert_eq!(
            job_name("release", "db", HookStage::Before, 3),
            "release-db-before-3"
        );
        let long = "p".repeat(40);
        let a = job_name(&long, &"c".repeat(30), HookStage::After, 1);
        let b = job_name(&long, &"c".repeat(30), HookStage::After, 2);
        assert!(a.len() <= 63 && b.len() <= 63, "{a} {b}");
        assert_ne!(a, b);
        assert!(a.starts_with(&long));
    }

    fn job(conditions: &[(&str, &str)]) -> Job {
        Job {
            status: Some(JobStatus {
                active: Some(1),
                conditions: Some(
                    conditions
                        .iter()
                        .map(|(t, reason)| JobCondition {
                            type_: (*t).into(),
                            status: "True".into(),
                            reason: Some((*reason).into()),
                            message: Some("Job was active longer than specified deadline".into()),
                            ..JobCondition::default()
                        })
                        .collect(),
                ),
                ..JobStatus::default()
            }),
            ..Job::default()
        }
    }

    #[test]
    fn a_jobs_conditions_say_whether_it_finished() {
        assert_eq!(state(&job(&[("Complete", "")])), JobState::Succeeded);
        assert_eq!(
            state(&job(&[("Failed", "DeadlineExceeded")])),
            JobState::Failed(
                "DeadlineExceeded: Job was active longer than specified deadline".into()
            )
        );
        assert!(matches!(state(&job(&[])), JobState::Running(_)));
    }

    fn plan_with_hook() -> UpgradePlan {
        let spec: UpgradePlanSpec = serde_json::from_value(serde_json::json!({
            "components": [{
                "name": "api",
                "target": {"kind": "Deployment", "name": "api"},
                "image": {"container": "api", "image": "api:2"},
                "hooks": {"before": {"job": {"template": {"spec": {
                    "restartPolicy": "Never",
                    "containers": [{"name": "migrate", "image": "migrate:2"}]
                }}}}}
            }]
        }))
        .unwrap();
        let mut plan = UpgradePlan::new("release", spec);
        plan.metadata.namespace = Some("shop".into());
        plan.metadata.uid = Some("uid-1".into());
        plan
    }

    /// Issue #39, item 7: a hook ran as any ServiceAccount its Job spec named.
    #[test]
    fn a_hook_runs_as_the_plans_service_account_or_the_default_only() {
        let run = HookRun::running(HookStage::Before, "release-api-before-1".into(), None);
        let as_account = |plan_account: Option<&str>, field: &str, account: &str| {
            let mut plan = plan_with_hook();
            plan.spec.service_account_name = plan_account.map(str::to_string);
            let hooks = plan.spec.components[0].hooks.as_mut().unwrap();
            hooks.before.as_mut().unwrap().job["template"]["spec"][field] = account.into();
            build(&plan, &plan.spec.components[0], &run)
        };
        assert!(as_account(None, "serviceAccountName", "default").is_ok());
        assert!(as_account(Some("deployer"), "serviceAccountName", "deployer").is_ok());
        // A hook naming no account runs as the plan's, when it names one.
        let account_of = |plan_account: Option<&str>| {
            let mut plan = plan_with_hook();
            plan.spec.service_account_name = plan_account.map(str::to_string);
            let job = build(&plan, &plan.spec.components[0], &run).unwrap();
            job.spec
                .unwrap()
                .template
                .spec
                .unwrap()
                .service_account_name
        };
        assert_eq!(account_of(Some("deployer")).as_deref(), Some("deployer"));
        assert_eq!(account_of(None), None, "the namespace's default");
        for (plan_account, field) in [
            (None, "serviceAccountName"),
            (Some("deployer"), "serviceAccountName"),
            (Some("deployer"), "serviceAccount"),
        ] {
            let refused = as_account(plan_account, field, "cluster-admin-sa").unwrap_err();
            assert!(
                refused.contains("runs as ServiceAccount \"cluster-admin-sa\""),
                "{refused}"
            );
        }
    }

    #[test]
    fn the_job_is_the_hooks_spec_labelled_owned_and_bounded() {
        let plan = plan_with_hook();
        let run = HookRun::running(HookStage::Before, "release-api-before-1".into(), None);
        let job = build(&plan, &plan.spec.components[0], &run).unwrap();
        assert_eq!(job.metadata.name.as_deref(), Some("release-api-before-1"));
        assert_eq!(job.metadata.namespace.as_deref(), Some("shop"));
        let owner = &job.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.controller),
            ("UpgradePlan", Some(true))
        );
        let spec = job.spec.unwrap();
        assert_eq!(spec.active_deadline_seconds, Some(600));
        let pod_labels = spec.template.metadata.unwrap().labels.unwrap();
        assert_eq!(pod_labels[STAGE_LABEL], "before");
        assert_eq!(
            spec.template.spec.unwrap().containers[0].image.as_deref(),
            Some("migrate:2")
        );
        // No after hook: nothing to build.
        let after = HookRun {
            stage: HookStage::After,
            ..run
        };
        assert!(build(&plan, &plan.spec.components[0], &after).is_err());
        // A deadline the user set is kept.
        let mut own = plan_with_hook();
        own.spec.components[0].hooks.as_mut().unwrap().before = Some(crate::crd::Hook {
            job: serde_json::to_value(JobSpec {
                active_deadline_seconds: Some(30),
                template: PodTemplateSpec {
                    metadata: None,
                    spec: Some(PodSpec {
                        containers: vec![Container::default()],
                        ..PodSpec::default()
                    }),
                },
                ..JobSpec::default()
            })
            .unwrap(),
        });
        let before = HookRun {
            stage: HookStage::Before,
            ..after
        };
        let job = build(&own, &own.spec.components[0], &before).unwrap();
        assert_eq!(job.spec.unwrap().active_deadline_seconds, Some(30));
    }

    #[test]
    fn only_running_hooks_of_progressing_components_without_a_job_are_created() {
        let plan = plan_with_hook();
        let run = HookRun::running(HookStage::Before, "release-api-before-1".into(), None);
        let mut cs = crate::crd::ComponentStatus::pending("api", 1);
        cs.phase = ComponentPhase::Progressing;
        cs.hook = Some(run.clone());
        let status = UpgradePlanStatus {
            components: vec![cs],
            ..UpgradePlanStatus::default()
        };
        let none = BTreeMap::new();
        assert_eq!(
            to_create(&plan.spec, &status, &none),
            vec![(0, run.clone())]
        );
        let exists = BTreeMap::from([(run.job.clone(), JobState::Running(String::new()))]);
        assert!(to_create(&plan.spec, &status, &exists).is_empty());
        let mut done = status.clone();
        done.components[0].hook.as_mut().unwrap().phase = HookPhase::Succeeded;
        assert!(to_create(&plan.spec, &done, &none).is_empty());
        let mut rolling_back = status;
        rolling_back.components[0].phase = ComponentPhase::RollingBack;
        assert!(to_create(&plan.spec, &rolling_back, &none).is_empty());
    }
}
