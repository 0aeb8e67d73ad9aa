//! Build: the plan's state machine, as pure functions of (spec, status, observed targets, now).
//!
//! ```text
//! component:  Pending ─start─▶ Progressing ─healthy─▶ Succeeded
//!                                   │ deadline / workload failed
//!                                   ▼
//!                                 Failed ──(Rollback)──▶ RollingBack ─healthy─▶ RolledBack
//!                                   │ (Pause: the spec changes) ▲
//!                                   └──────▶ Progressing         └── every changed component,
//!                                                                    last wave first
//! ```
//!
//! A component with hooks ([`crate::hook`]) stays Progressing through them: its `before`
//! Job must complete before [`writes`] changes the target, and once the target is healthy
//! its `after` Job must complete before it is Succeeded. A hook's failure is the
//! component's.
//!
//! # Guarantees
//! - Write-ahead: [`step`] only *records* a start (previous value, target, start time) or a
//!   revert; the change to the target is made by [`writes`] from a status that is already
//!   stored (right after the write, or by a later reconcile). A crash between the two is
//!   resumed exactly: the recorded previous value is what a rollback restores.
//! - A component starts only when every component of earlier waves succeeded and its own
//!   dependencies are healthy right now; at most `maxConcurrent` are in flight.
//! - A change is made at most once: [`writes`] asks for it only while the target still holds
//!   the recorded previous value.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, Time};
use k8s_openapi::jiff::Timestamp;
use steward_core::conditions;

use crate::crd::{
    Approval, ComponentPhase, ComponentStatus, FailurePolicy, HookPhase, HookRun, HookStage,
    PlanPhase, Scheduling, UpgradePlanSpec, UpgradePlanStatus,
};
use crate::health::Health;
use crate::hook::{self, JobState};
use crate::plan::{Invalid, Plan};
use crate::target::Observation;
use crate::window::Window;

/// The `Valid` condition type.
pub const VALID: &str = "Valid";

/// How often a target the orchestrator does not watch (any kind but the built-in four, or
/// in another namespace than its plan) is read again while the plan waits for it.
pub const POLL_UNWATCHED: Duration = Duration::from_secs(5);

/// Everything [`step`] decides from.
pub struct Input<'a> {
    /// The plan's name (hook Jobs are named after it).
    pub name: &'a str,
    pub spec: &'a UpgradePlanSpec,
    pub generation: i64,
    pub status: &'a UpgradePlanStatus,
    pub plan: &'a Plan,
    /// Observations of the targets, by component name.
    pub observed: &'a BTreeMap<String, Observation>,
    /// The plan's hook Jobs, by name.
    pub jobs: &'a BTreeMap<String, JobState>,
    /// Recorded changes the API server refused as invalid (e.g. a PostgresCluster version
    /// that cannot be lowered), by component name, with the server's message.
    pub rejected: &'a BTreeMap<String, String>,
    pub now: Timestamp,
    /// The plan is being deleted: revert what it changed, start nothing, retry nothing.
    pub deleting: bool,
}

/// What [`step`] decided.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// The status to write (skipped when equal to the current one).
    pub status: UpgradePlanStatus,
    /// Events to publish once the status is written.
    pub notes: Vec<Note>,
    /// Components that finished a step, for the duration metric.
    pub finished: Vec<Finished>,
    /// When to look again if no watch event comes first (the earliest deadline).
    pub recheck_after: Option<Duration>,
}

/// An Event to publish about the plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Note {
    pub warning: bool,
    pub reason: &'static str,
    pub action: &'static str,
    pub message: String,
}

/// A component that finished upgrading (or rolling back) in this step.
#[derive(Debug, Clone, PartialEq)]
pub struct Finished {
    /// The target's kind.
    pub kind: String,
    /// `succeeded`, `failed` or `rolled_back`.
    pub result: &'static str,
    pub seconds: f64,
}

/// A change to make to a target, recorded in the status before it is made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Write {
    /// Index into `spec.components`.
    pub index: usize,
    pub from: String,
    pub to: String,
    /// `true` for a rollback (target → previous).
    pub revert: bool,
}

/// The changes the stored status asks for that the targets do not show yet: a Progressing
/// component whose target still holds `previous`, a RollingBack one whose target holds `target`.
pub fn writes(
    spec: &UpgradePlanSpec,
    status: &UpgradePlanStatus,
    observed: &BTreeMap<String, Observation>,
) -> Vec<Write> {
    let mut out = Vec::new();
    for (index, component) in spec.components.iter().enumerate() {
        let Some(cs) = status.components.iter().find(|s| s.name == component.name) else {
            continue;
        };
        let (Some(previous), Some(target)) = (&cs.previous, &cs.target) else {
            continue;
        };
        if previous == target {
            continue;
        }
        let Some(Ok(value)) = observed.get(&component.name).map(|o| &o.value) else {
            continue;
        };
        match cs.phase {
            ComponentPhase::Progressing if value == previous && !waits_for_before_hook(cs) => {
                out.push(Write {
                    index,
                    from: previous.clone(),
                    to: target.clone(),
                    revert: false,
                });
            }
            ComponentPhase::RollingBack if value == target => {
                out.push(Write {
                    index,
                    from: target.clone(),
                    to: previous.clone(),
                    revert: true,
                });
            }
            _ => {}
        }
    }
    out
}

/// A component whose before hook has not succeeded yet: its target must not change.
fn waits_for_before_hook(cs: &ComponentStatus) -> bool {
    cs.hook
        .as_ref()
        .is_some_and(|h| h.stage == HookStage::Before && h.phase != HookPhase::Succeeded)
}

/// The status of a plan whose spec is invalid: `Valid=False`, nothing starts.
pub fn invalid(
    status: &UpgradePlanStatus,
    generation: i64,
    error: &Invalid,
    now: Timestamp,
) -> Outcome {
    let mut st = status.clone();
    st.observed_generation = Some(generation);
    if st.phase.is_none() {
        st.phase = Some(PlanPhase::Pending);
    }
    let at = second(now);
    let message = error.to_string();
    set(
        &mut st,
        VALID,
        false,
        error.reason(),
        &message,
        generation,
        &at,
    );
    set(
        &mut st,
        conditions::READY,
        false,
        "InvalidPlan",
        &message,
        generation,
        &at,
    );
    set(
        &mut st,
        conditions::PROGRESSING,
        false,
        "InvalidPlan",
        &message,
        generation,
        &at,
    );
    let degraded = st
        .components
        .iter()
        .any(|c| c.phase == ComponentPhase::Failed);
    set(
        &mut st,
        conditions::DEGRADED,
        degraded,
        if degraded {
            "ComponentFailed"
        } else {
            "AsExpected"
        },
        "",
        generation,
        &at,
    );
    let mut notes = Vec::new();
    if conditions::get(&status.conditions, VALID)
        .is_none_or(|c| c.status != "False" || c.message != message)
    {
        notes.push(Note {
            warning: true,
            reason: "InvalidPlan",
            action: "Validate",
            message,
        });
    }
    Outcome {
        status: st,
        notes,
        finished: Vec::new(),
        recheck_after: None,
    }
}

/// How one component's target compares to what it should be.
enum Eval {
    Healthy,
    Waiting(String),
    Failed(String),
}

fn evaluate(observation: Option<&Observation>, expected: &str, other: &str) -> Eval {
    let Some(o) = observation else {
        return Eval::Waiting("target not observed yet".into());
    };
    match &o.value {
        Err(why) => Eval::Failed(why.clone()),
        Ok(v) if v == expected => match &o.health {
            Health::Healthy => Eval::Healthy,
            Health::Progressing(m) => Eval::Waiting(m.clone()),
            Health::Failed(m) => Eval::Failed(m.clone()),
        },
        Ok(v) if v == other => {
            Eval::Waiting(format!("the change to {expected:?} is not applied yet"))
        }
        Ok(v) => Eval::Failed(format!(
            "the target now holds {v:?}, expected {expected:?}: changed by someone else"
        )),
    }
}

/// Microseconds since `t`.
fn elapsed(t: Option<&MicroTime>, now: Timestamp) -> Duration {
    let start = t.map_or(now.as_microsecond(), |t| t.0.as_microsecond());
    Duration::from_micros(u64::try_from(now.as_microsecond().saturating_sub(start)).unwrap_or(0))
}

fn micro(now: Timestamp) -> MicroTime {
    MicroTime(Timestamp::from_microsecond(now.as_microsecond()).unwrap_or(now))
}

fn second(now: Timestamp) -> Time {
    Time(Timestamp::from_second(now.as_second()).unwrap_or(now))
}

fn set(
    st: &mut UpgradePlanStatus,
    type_: &str,
    value: bool,
    reason: &str,
    message: &str,
    generation: i64,
    at: &Time,
) {
    conditions::set_at(
        &mut st.conditions,
        type_,
        value,
        reason,
        message.to_string(),
        Some(generation),
        at.clone(),
    );
}

/// Builds the outcome step by step.
struct Stepper<'a> {
    i: &'a Input<'a>,
    comps: Vec<ComponentStatus>,
    notes: Vec<Note>,
    finished: Vec<Finished>,
    recheck: Option<Duration>,
    deadline: Duration,
}

impl Stepper<'_> {
    fn note(&mut self, warning: bool, reason: &'static str, action: &'static str, message: String) {
        self.notes.push(Note {
            warning,
            reason,
            action,
            message,
        });
    }

    fn recheck_in(&mut self, d: Duration) {
        self.recheck = Some(self.recheck.map_or(d, |r| r.min(d)));
    }

    fn kind(&self, index: usize) -> String {
        self.i.spec.components[index].target.kind.clone()
    }

    fn fail(&mut self, index: usize, message: String) {
        let now = self.i.now;
        let kind = self.kind(index);
        let describe = self.i.spec.components[index].describe();
        let cs = &mut self.comps[index];
        let seconds = elapsed(cs.started_at.as_ref(), now).as_secs_f64();
        cs.phase = ComponentPhase::Failed;
        cs.finished_at = Some(micro(now));
        cs.failed_generation = Some(self.i.generation);
        cs.message = Some(message.clone());
        let name = cs.name.clone();
        self.finished.push(Finished {
            kind,
            result: "failed",
            seconds,
        });
        self.note(
            true,
            "ComponentFailed",
            "Upgrade",
            format!("component {name} ({describe}) failed: {message}"),
        );
    }

    /// Records that component `index` runs its `stage` hook now; its Job is created from the
    /// stored record.
    fn start_hook(&mut self, index: usize, stage: HookStage) {
        let now = self.i.now;
        let job = hook::job_name(
            self.i.name,
            &self.comps[index].name,
            stage,
            self.i.generation,
        );
        let cs = &mut self.comps[index];
        cs.hook = Some(HookRun::running(stage, job.clone(), Some(micro(now))));
        cs.message = Some(format!("running the {} hook Job {job}", stage.as_str()));
        let name = cs.name.clone();
        self.recheck_in(self.deadline);
        self.note(
            false,
            "HookStarted",
            "Upgrade",
            format!(
                "component {name}: {} hook Job {job} started",
                stage.as_str()
            ),
        );
    }

    /// Follows component `index`'s recorded hook: true once its Job succeeded (recorded
    /// here), false while it runs or once it failed the component (the Job failed, or did
    /// not finish within the progress deadline).
    fn follow_hook(&mut self, index: usize) -> bool {
        let now = self.i.now;
        let Some(run) = self.comps[index].hook.clone() else {
            return true;
        };
        if run.phase == HookPhase::Succeeded {
            return true;
        }
        let stage = run.stage.as_str();
        let job = &run.job;
        let spent = elapsed(run.started_at.as_ref(), now);
        let failure = match self.i.jobs.get(job) {
            Some(JobState::Succeeded) => {
                let cs = &mut self.comps[index];
                if let Some(h) = cs.hook.as_mut() {
                    h.phase = HookPhase::Succeeded;
                    h.finished_at = Some(micro(now));
                }
                let name = cs.name.clone();
                self.note(
                    false,
                    "HookSucceeded",
                    "Upgrade",
                    format!(
                        "component {name}: {stage} hook Job {job} succeeded after {:.1}s",
                        spent.as_secs_f64()
                    ),
                );
                return true;
            }
            Some(JobState::Failed(why)) => format!("the {stage} hook Job {job} failed: {why}"),
            _ if run.phase == HookPhase::Failed => format!("the {stage} hook Job {job} failed"),
            _ if spent >= self.deadline => format!(
                "the {stage} hook Job {job} did not finish within {}s",
                self.deadline.as_secs()
            ),
            other => {
                let what = match other {
                    Some(JobState::Running(m)) => m.clone(),
                    _ => "not created yet".to_string(),
                };
                self.comps[index].message =
                    Some(format!("waiting for the {stage} hook Job {job}: {what}"));
                self.recheck_in(self.deadline - spent);
                return false;
            }
        };
        if let Some(h) = self.comps[index].hook.as_mut() {
            h.phase = HookPhase::Failed;
            h.finished_at = Some(micro(now));
        }
        self.fail(index, failure);
        false
    }

    /// Follows components that are upgrading.
    fn track_forward(&mut self) {
        let now = self.i.now;
        for index in 0..self.comps.len() {
            if self.comps[index].phase != ComponentPhase::Progressing {
                continue;
            }
            let cs = &self.comps[index];
            let (Some(previous), Some(target)) = (cs.previous.clone(), cs.target.clone()) else {
                self.fail(index, "no previous value was recorded".into());
                continue;
            };
            // The change started when the component did, or when its before hook finished
            // (a retry after a failed change starts later than that).
            let before_done = cs
                .hook
                .as_ref()
                .filter(|h| h.stage == HookStage::Before)
                .and_then(|h| h.finished_at.as_ref());
            let change_start = match (cs.started_at.as_ref(), before_done) {
                (Some(a), Some(b)) => Some(if a.0 >= b.0 { a } else { b }),
                (a, b) => a.or(b),
            };
            let spent = elapsed(change_start, now);
            let name = cs.name.clone();
            if let Some(why) = self.i.rejected.get(&name) {
                self.fail(index, format!("the API server refused the change: {why}"));
                continue;
            }
            if waits_for_before_hook(cs) {
                if self.follow_hook(index) {
                    self.comps[index].message =
                        Some("the before hook succeeded; changing the target".into());
                    self.recheck_in(self.deadline);
                }
                continue;
            }
            match evaluate(self.i.observed.get(&name), &target, &previous) {
                Eval::Healthy => {
                    if self.i.spec.components[index]
                        .hook(HookStage::After)
                        .is_some()
                    {
                        let after_started = self.comps[index]
                            .hook
                            .as_ref()
                            .is_some_and(|h| h.stage == HookStage::After);
                        if !after_started {
                            self.start_hook(index, HookStage::After);
                            continue;
                        }
                        if !self.follow_hook(index) {
                            continue;
                        }
                    }
                    let kind = self.kind(index);
                    let describe = self.i.spec.components[index].describe();
                    let cs = &mut self.comps[index];
                    cs.phase = ComponentPhase::Succeeded;
                    cs.finished_at = Some(micro(now));
                    cs.message = None;
                    self.finished.push(Finished {
                        kind,
                        result: "succeeded",
                        seconds: spent.as_secs_f64(),
                    });
                    self.note(
                        false,
                        "ComponentSucceeded",
                        "Upgrade",
                        format!(
                            "component {name}: {describe} is {target:?} and healthy after {:.1}s",
                            spent.as_secs_f64()
                        ),
                    );
                }
                Eval::Failed(m) => self.fail(index, m),
                Eval::Waiting(m) if spent >= self.deadline => {
                    self.fail(
                        index,
                        format!("not healthy within {}s: {m}", self.deadline.as_secs()),
                    );
                }
                Eval::Waiting(m) => {
                    self.comps[index].message = Some(m);
                    self.recheck_in(self.deadline - spent);
                    self.poll_unwatched(index);
                }
            }
        }
    }

    /// A target the orchestrator does not watch (another kind, or in another namespace) is
    /// looked at again every [`POLL_UNWATCHED`] while it is waited for.
    fn poll_unwatched(&mut self, index: usize) {
        let target = &self.i.spec.components[index].target;
        if target.typed().is_none() || target.namespace.is_some() {
            self.recheck_in(POLL_UNWATCHED);
        }
    }

    /// Follows components that are being reverted; returns why the rollback failed, if it did.
    fn track_rollback(&mut self) -> Option<String> {
        let now = self.i.now;
        let mut failure = None;
        for index in 0..self.comps.len() {
            if self.comps[index].phase != ComponentPhase::RollingBack {
                continue;
            }
            let cs = &self.comps[index];
            let (Some(previous), Some(target)) = (cs.previous.clone(), cs.target.clone()) else {
                failure = Some(format!(
                    "component {}: no previous value was recorded",
                    cs.name
                ));
                continue;
            };
            let spent = elapsed(cs.rollback_started_at.as_ref(), now);
            let name = cs.name.clone();
            if let Some(why) = self.i.rejected.get(&name) {
                let m = format!("the API server refused the revert: {why}");
                self.comps[index].message = Some(m.clone());
                failure = Some(format!("component {name}: {m}"));
                continue;
            }
            match evaluate(self.i.observed.get(&name), &previous, &target) {
                Eval::Healthy => {
                    let kind = self.kind(index);
                    let describe = self.i.spec.components[index].describe();
                    let cs = &mut self.comps[index];
                    cs.phase = ComponentPhase::RolledBack;
                    cs.rolled_back_at = Some(micro(now));
                    cs.message = None;
                    self.finished.push(Finished {
                        kind,
                        result: "rolled_back",
                        seconds: spent.as_secs_f64(),
                    });
                    self.note(
                        false,
                        "ComponentRolledBack",
                        "Rollback",
                        format!("component {name}: {describe} is back to {previous:?} and healthy"),
                    );
                }
                Eval::Failed(m) => {
                    self.comps[index].message = Some(m.clone());
                    failure = Some(format!("component {name}: {m}"));
                }
                Eval::Waiting(m) if spent >= self.deadline => {
                    let m = format!(
                        "not healthy within {}s of the revert: {m}",
                        self.deadline.as_secs()
                    );
                    self.comps[index].message = Some(m.clone());
                    failure = Some(format!("component {name}: {m}"));
                }
                Eval::Waiting(m) => {
                    self.comps[index].message = Some(m);
                    self.recheck_in(self.deadline - spent);
                    self.poll_unwatched(index);
                }
            }
        }
        failure
    }

    /// Under `failurePolicy: Pause`, a newer spec generation retries failed components.
    fn retry_failed(&mut self) {
        let now = self.i.now;
        for index in 0..self.comps.len() {
            let cs = &mut self.comps[index];
            if cs.phase != ComponentPhase::Failed
                || cs.failed_generation.is_some_and(|g| g >= self.i.generation)
            {
                continue;
            }
            cs.phase = ComponentPhase::Progressing;
            cs.started_at = Some(micro(now));
            cs.finished_at = None;
            cs.failed_generation = None;
            cs.message = Some("retrying: the plan changed after the failure".into());
            // A failed hook runs again, as a new Job.
            let failed_hook = cs
                .hook
                .as_ref()
                .filter(|h| h.phase == HookPhase::Failed)
                .map(|h| h.stage);
            let name = cs.name.clone();
            self.recheck_in(self.deadline);
            self.note(
                false,
                "ComponentRetried",
                "Upgrade",
                format!("component {name}: retrying after the plan changed"),
            );
            if let Some(stage) = failed_hook {
                self.start_hook(index, stage);
            }
        }
    }

    /// Why component `index` cannot start now because of a dependency, if it cannot.
    fn blocked_by_dependency(&self, index: usize) -> Option<String> {
        let component = &self.i.spec.components[index];
        for dep in &component.depends_on {
            let Some(ds) = self.comps.iter().find(|c| &c.name == dep) else {
                return Some(format!("dependency {dep} is unknown"));
            };
            if ds.phase != ComponentPhase::Succeeded {
                return Some(format!("dependency {dep} is {}", ds.phase.as_str()));
            }
            let expected = ds.target.as_deref().unwrap_or_default();
            match self.i.observed.get(dep) {
                Some(o) if o.value.as_deref() == Ok(expected) && o.health.is_healthy() => {}
                Some(o) => {
                    let why = match (&o.value, &o.health) {
                        (Ok(v), _) if v != expected => format!("holds {v:?}, not {expected:?}"),
                        (Err(e), _) => e.clone(),
                        (_, Health::Progressing(m) | Health::Failed(m)) => m.clone(),
                        (_, Health::Healthy) => "unknown".into(),
                    };
                    return Some(format!(
                        "waiting for dependency {dep} to be healthy again: {why}"
                    ));
                }
                None => return Some(format!("dependency {dep} not observed")),
            }
        }
        None
    }

    /// Starts Pending components of wave `wave` (0-based) up to `maxConcurrent` in flight.
    /// Returns a message about components that could not start.
    fn start_wave(&mut self, wave: usize) -> Option<String> {
        let now = self.i.now;
        let max = usize::try_from(self.i.spec.strategy.max_concurrent.max(1)).unwrap_or(1);
        let mut in_flight = self
            .comps
            .iter()
            .filter(|c| c.phase == ComponentPhase::Progressing)
            .count();
        let mut blocked = None;
        let members = self.i.plan.waves.get(wave).cloned().unwrap_or_default();
        for index in members {
            if in_flight >= max {
                break;
            }
            if self.comps[index].phase != ComponentPhase::Pending {
                continue;
            }
            if let Some(why) = self.blocked_by_dependency(index) {
                blocked = Some(format!("component {}: {why}", self.comps[index].name));
                continue;
            }
            let component = &self.i.spec.components[index];
            let before_hook = component.hook(HookStage::Before).is_some();
            let Some(desired) = component.desired() else {
                self.fail(index, "the component sets no value".into());
                continue;
            };
            let value = self
                .i
                .observed
                .get(&component.name)
                .map(|o| o.value.clone());
            match value {
                Some(Ok(previous)) => {
                    let describe = component.describe();
                    let cs = &mut self.comps[index];
                    cs.phase = ComponentPhase::Progressing;
                    cs.previous = Some(previous.clone());
                    cs.target = Some(desired.clone());
                    cs.started_at = Some(micro(now));
                    cs.finished_at = None;
                    cs.message = Some("recorded the previous value; changing the target".into());
                    let (name, wave) = (cs.name.clone(), cs.wave);
                    in_flight += 1;
                    self.recheck_in(self.deadline);
                    self.note(
                        false,
                        "ComponentStarted",
                        "Upgrade",
                        format!(
                            "component {name} (wave {wave}): {describe} {previous:?} -> {desired:?}"
                        ),
                    );
                    if before_hook {
                        self.start_hook(index, HookStage::Before);
                    }
                }
                Some(Err(why)) => self.fail(index, why),
                None => {
                    blocked = Some(format!("component {}: target not observed", component.name))
                }
            }
        }
        blocked
    }
}

/// What the plan is after a step: its phase, and the reason and message of its conditions.
struct Verdict {
    phase: PlanPhase,
    reason: String,
    message: String,
}

impl Verdict {
    fn new(phase: PlanPhase, reason: &str, message: impl Into<String>) -> Self {
        Self {
            phase,
            reason: reason.to_string(),
            message: message.into(),
        }
    }
}

/// One step of the plan: follows what is in flight, applies the failure policy, and records
/// the next components to start. Pure; see the module's guarantees.
///
/// Validate → follow → decide (`Stepper::decide`: a rollback, a pause, a wait, or the next
/// wave) → the conditions and Events of the decision (`Stepper::finish`).
pub fn step(i: &Input<'_>) -> Outcome {
    let spec = i.spec;
    let mut st = i.status.clone();
    let old_phase = st.phase;
    st.observed_generation = Some(i.generation);
    st.waves = Some(i32::try_from(i.plan.waves.len()).unwrap_or(i32::MAX));
    let mut s = Stepper {
        i,
        comps: components(i),
        notes: Vec::new(),
        finished: Vec::new(),
        recheck: None,
        deadline: Duration::from_secs(
            u64::try_from(spec.strategy.progress_deadline_seconds.max(1)).unwrap_or(600),
        ),
    };
    let waves = i.plan.waves.len();
    s.set(
        &mut st,
        VALID,
        true,
        "Valid",
        &format!("{} components in {waves} waves", spec.components.len()),
    );
    if let Some(p) = old_phase.filter(|p| p.is_terminal()) {
        // A finished plan stays as it finished: only its conditions are kept current.
        let ready = conditions::get(&st.conditions, conditions::READY);
        let verdict = Verdict::new(
            p,
            ready.map_or(p.as_str(), |c| c.reason.as_str()),
            ready.map(|c| c.message.clone()).unwrap_or_default(),
        );
        return s.finish(st, old_phase, &verdict);
    }
    let verdict = s.decide(&mut st, old_phase);
    st.next = next_step(i, &s.comps, verdict.phase);
    s.finish(st, old_phase, &verdict)
}

/// The plan's components in spec order, each with its recorded status (Pending if none) and
/// its wave in the current plan.
fn components(i: &Input<'_>) -> Vec<ComponentStatus> {
    i.spec
        .components
        .iter()
        .enumerate()
        .map(|(index, c)| {
            let wave = i.plan.wave_number(index);
            let mut cs = i
                .status
                .components
                .iter()
                .find(|s| s.name == c.name)
                .cloned()
                .unwrap_or_else(|| ComponentStatus::pending(&c.name, wave));
            cs.wave = wave;
            cs
        })
        .collect()
}

impl Stepper<'_> {
    /// Sets condition `kind` on `st` for this step's generation and time.
    fn set(&self, st: &mut UpgradePlanStatus, kind: &str, ok: bool, reason: &str, message: &str) {
        set(
            st,
            kind,
            ok,
            reason,
            message,
            self.i.generation,
            &second(self.i.now),
        );
    }

    /// The decision of a plan that has not finished: follows the components in flight, then
    /// the first that applies of: targets missing (before the start), a rollback, a pause for
    /// failed components, success, a pause by the user, a wave waiting for approval, a closed
    /// maintenance window, and otherwise the next components started.
    fn decide(&mut self, st: &mut UpgradePlanStatus, old_phase: Option<PlanPhase>) -> Verdict {
        let i = self.i;
        let strategy = &i.spec.strategy;
        if st.started_at.is_none()
            && let Some(verdict) = self.targets_missing(st)
        {
            return verdict;
        }
        self.track_forward();
        let rollback_failure = self.track_rollback();
        if strategy.failure_policy == FailurePolicy::Pause
            && !strategy.paused
            && !i.deleting
            && old_phase != Some(PlanPhase::RollingBack)
        {
            self.retry_failed();
        }
        if let Some(why) = rollback_failure {
            return Verdict::new(
                PlanPhase::Failed,
                "RollbackFailed",
                format!("the rollback could not complete: {why}"),
            );
        }
        let failed: Vec<String> = self
            .comps
            .iter()
            .filter(|c| c.phase == ComponentPhase::Failed)
            .map(|c| c.name.clone())
            .collect();
        let rolling_back = old_phase == Some(PlanPhase::RollingBack)
            || self
                .comps
                .iter()
                .any(|c| c.phase == ComponentPhase::RollingBack);
        if rolling_back
            || i.deleting
            || (!failed.is_empty() && strategy.failure_policy == FailurePolicy::Rollback)
        {
            return self.roll_back(st, rolling_back, &failed);
        }
        if !failed.is_empty() {
            return Verdict::new(
                PlanPhase::Paused,
                "ComponentFailed",
                format!(
                    "component(s) {} failed; paused. Change the spec to retry, or set failurePolicy: Rollback",
                    failed.join(", ")
                ),
            );
        }
        if self
            .comps
            .iter()
            .all(|c| c.phase == ComponentPhase::Succeeded)
        {
            st.current_wave = st.waves;
            return Verdict::new(
                PlanPhase::Succeeded,
                "Succeeded",
                format!("all {} components upgraded", self.comps.len()),
            );
        }
        let Some(wave) = i.plan.waves.iter().position(|w| {
            w.iter()
                .any(|&x| self.comps[x].phase != ComponentPhase::Succeeded)
        }) else {
            return Verdict::new(PlanPhase::Succeeded, "Succeeded", "all components upgraded");
        };
        st.current_wave = Some(i32::try_from(wave + 1).unwrap_or(i32::MAX));
        if let Some(verdict) = self.held(st, wave) {
            return verdict;
        }
        self.advance(st, wave)
    }

    /// Before the plan starts: Pending with `TargetNotFound` (and the Valid condition false)
    /// while a component's target cannot be read.
    fn targets_missing(&mut self, st: &mut UpgradePlanStatus) -> Option<Verdict> {
        let i = self.i;
        let missing: Vec<String> = i
            .spec
            .components
            .iter()
            .filter_map(|c| match i.observed.get(&c.name).map(|o| &o.value) {
                Some(Ok(_)) => None,
                Some(Err(why)) => Some(format!("component {}: {why}", c.name)),
                None => Some(format!("component {}: target not observed", c.name)),
            })
            .collect();
        if missing.is_empty() {
            return None;
        }
        let message = missing.join("; ");
        self.set(st, VALID, false, "TargetNotFound", &message);
        if conditions::get(&i.status.conditions, VALID).is_none_or(|c| c.message != message) {
            self.note(true, "TargetNotFound", "Validate", message.clone());
        }
        Some(Verdict::new(PlanPhase::Pending, "TargetNotFound", message))
    }

    /// The rollback (a component failed under `failurePolicy: Rollback`, the plan is being
    /// deleted, or a rollback is under way): reverts the latest wave that still has changed
    /// components, one wave at a time; RolledBack once nothing is left to revert.
    fn roll_back(
        &mut self,
        st: &mut UpgradePlanStatus,
        rolling_back: bool,
        failed: &[String],
    ) -> Verdict {
        let i = self.i;
        let reverting = |wave: i32| {
            Verdict::new(
                PlanPhase::RollingBack,
                "RollingBack",
                format!("reverting wave {wave}"),
            )
        };
        if let Some(wave) = self
            .comps
            .iter()
            .filter(|c| c.phase == ComponentPhase::RollingBack)
            .map(|c| c.wave)
            .max()
        {
            st.current_wave = Some(wave);
            return reverting(wave);
        }
        let to_revert = |comps: &[ComponentStatus], index: usize| {
            changed(&comps[index]) && i.spec.components[index].reverts()
        };
        let Some(wave) = (0..self.comps.len())
            .filter(|&x| to_revert(&self.comps, x))
            .map(|x| self.comps[x].wave)
            .max()
        else {
            let kept: Vec<String> = self
                .comps
                .iter()
                .filter(|c| changed(c))
                .map(|c| format!("{} at {}", c.name, c.target.as_deref().unwrap_or_default()))
                .collect();
            let message = if kept.is_empty() {
                "every changed component is back to its previous value".to_string()
            } else {
                format!(
                    "every other changed component is back to its previous value; kept (rollback: Never): {}",
                    kept.join(", ")
                )
            };
            return Verdict::new(PlanPhase::RolledBack, "RolledBack", message);
        };
        if !rolling_back {
            let why = if i.deleting {
                "the plan is being deleted".to_string()
            } else {
                format!("component(s) {} failed", failed.join(", "))
            };
            self.note(
                true,
                "RollbackStarted",
                "Rollback",
                format!("{why}; reverting every changed component, last wave first"),
            );
        }
        let now: Vec<usize> = (0..self.comps.len())
            .filter(|&x| self.comps[x].wave == wave && to_revert(&self.comps, x))
            .collect();
        for index in now {
            let describe = i.spec.components[index].describe();
            let cs = &mut self.comps[index];
            cs.phase = ComponentPhase::RollingBack;
            cs.rollback_started_at = Some(micro(i.now));
            cs.message = Some("reverting to the previous value".into());
            let note = format!(
                "component {}: reverting {describe} from {:?} to {:?}",
                cs.name,
                cs.target.as_deref().unwrap_or_default(),
                cs.previous.as_deref().unwrap_or_default()
            );
            self.note(true, "ComponentRollingBack", "Rollback", note);
        }
        self.recheck_in(self.deadline);
        st.current_wave = Some(wave);
        reverting(wave)
    }

    /// What holds wave `wave` (index) back, if anything: the user's pause, a missing
    /// approval, a closed (or invalid) maintenance window. Components in flight are still
    /// followed meanwhile.
    fn held(&mut self, st: &mut UpgradePlanStatus, wave: usize) -> Option<Verdict> {
        let i = self.i;
        let strategy = &i.spec.strategy;
        let wave_number = i32::try_from(wave + 1).unwrap_or(i32::MAX);
        let in_flight = self.in_flight().count();
        // An invalid window is a validation failure whatever else holds the wave (a pause, a
        // missing approval): reported now, not once the wave is approved.
        let window = match crate::window::check(&strategy.maintenance_windows, i.now) {
            Ok(window) => window,
            Err(why) => {
                self.set(st, VALID, false, "InvalidMaintenanceWindow", &why);
                let phase = if st.started_at.is_some() {
                    PlanPhase::Paused
                } else {
                    PlanPhase::Pending
                };
                return Some(Verdict::new(phase, "InvalidMaintenanceWindow", why));
            }
        };
        if strategy.paused {
            let message = if in_flight > 0 {
                format!("paused: no component starts; {in_flight} in flight still followed")
            } else {
                "paused between components: no component starts until spec.strategy.paused is false"
                    .to_string()
            };
            return Some(Verdict::new(PlanPhase::Paused, "PausedByUser", message));
        }
        let wave_started = i.plan.waves[wave]
            .iter()
            .any(|&x| self.comps[x].phase != ComponentPhase::Pending);
        if strategy.approval == Approval::Manual
            && !wave_started
            && i.spec.approved_waves.unwrap_or(0) < wave_number
        {
            return Some(Verdict::new(
                PlanPhase::WaitingApproval,
                "WaitingApproval",
                format!(
                    "wave {wave_number} waits for approval: set spec.approvedWaves to {wave_number}"
                ),
            ));
        }
        match window {
            Window::Closed { opens, window } => {
                self.recheck_in(crate::window::until(i.now, opens.timestamp()));
                let next = format!(
                    "{}{} ({window})",
                    crate::window::NEXT_OPENING,
                    opens.strftime("%Y-%m-%dT%H:%M:%S%:z[%Q]")
                );
                let message = if in_flight > 0 {
                    format!(
                        "outside the maintenance windows: no component starts; {in_flight} in flight still followed; {next}"
                    )
                } else {
                    format!("outside the maintenance windows: no component starts; {next}")
                };
                Some(Verdict::new(
                    PlanPhase::WaitingWindow,
                    "OutsideMaintenanceWindow",
                    message,
                ))
            }
            Window::Open { closes } => {
                self.recheck_in(crate::window::until(i.now, closes));
                None
            }
            Window::Always => None,
        }
    }

    /// Starts what may start in wave `wave` (index), and under DAG scheduling with automatic
    /// approval in later waves too (a component whose own dependencies are done need not wait
    /// for the rest of its wave): Progressing, naming what is in flight and what is blocked.
    fn advance(&mut self, st: &mut UpgradePlanStatus, wave: usize) -> Verdict {
        let i = self.i;
        let strategy = &i.spec.strategy;
        let blocked = self.start_wave(wave);
        if strategy.scheduling == Scheduling::Dag && strategy.approval == Approval::Automatic {
            // What blocks later waves is said by the first wave's message.
            for later in wave + 1..i.plan.waves.len() {
                self.start_wave(later);
            }
        }
        if st.started_at.is_none()
            && self
                .comps
                .iter()
                .any(|c| c.phase != ComponentPhase::Pending)
        {
            st.started_at = Some(micro(i.now));
        }
        let active: Vec<&str> = self.in_flight().map(|c| c.name.as_str()).collect();
        let mut message = format!(
            "wave {} of {}: upgrading {}",
            wave + 1,
            i.plan.waves.len(),
            active.join(", ")
        );
        if let Some(b) = blocked {
            message = if active.is_empty() {
                b
            } else {
                format!("{message}; {b}")
            };
        }
        Verdict::new(PlanPhase::Progressing, "Progressing", message)
    }

    /// The components in flight (Progressing).
    fn in_flight(&self) -> impl Iterator<Item = &ComponentStatus> {
        self.comps
            .iter()
            .filter(|c| c.phase == ComponentPhase::Progressing)
    }

    /// The step's outcome for `verdict`: the components, phase, progress, the Ready,
    /// Progressing and Degraded conditions, and the Event of a phase change.
    fn finish(
        mut self,
        mut st: UpgradePlanStatus,
        old_phase: Option<PlanPhase>,
        verdict: &Verdict,
    ) -> Outcome {
        let Verdict {
            phase,
            reason,
            message,
        } = verdict;
        let phase = *phase;
        st.components = std::mem::take(&mut self.comps);
        if phase.is_terminal() && st.finished_at.is_none() {
            st.finished_at = Some(micro(self.i.now));
        }
        st.phase = Some(phase);
        let upgraded = st
            .components
            .iter()
            .filter(|c| c.phase == ComponentPhase::Succeeded)
            .count();
        st.progress = Some(format!("{upgraded}/{}", st.components.len()));
        self.set(
            &mut st,
            conditions::READY,
            phase == PlanPhase::Succeeded,
            reason,
            message,
        );
        let progressing = matches!(phase, PlanPhase::Progressing | PlanPhase::RollingBack);
        self.set(
            &mut st,
            conditions::PROGRESSING,
            progressing,
            reason,
            message,
        );
        let failed: Vec<&str> = st
            .components
            .iter()
            .filter(|c| c.phase == ComponentPhase::Failed)
            .map(|c| c.name.as_str())
            .collect();
        let (degraded, degraded_reason, degraded_message) = match phase {
            PlanPhase::Failed => (true, "RollbackFailed", message.clone()),
            PlanPhase::RolledBack | PlanPhase::RollingBack => (
                true,
                "RolledBack",
                "a component failed; the plan was rolled back".into(),
            ),
            _ if !failed.is_empty() => (
                true,
                "ComponentFailed",
                format!("failed: {}", failed.join(", ")),
            ),
            _ => (false, "AsExpected", String::new()),
        };
        self.set(
            &mut st,
            conditions::DEGRADED,
            degraded,
            degraded_reason,
            &degraded_message,
        );
        if old_phase != Some(phase)
            && let Some((warning, reason)) = phase_event(old_phase, phase, reason)
        {
            self.note(warning, reason, "Upgrade", message.clone());
        }
        Outcome {
            status: st,
            notes: self.notes,
            finished: self.finished,
            recheck_after: self.recheck,
        }
    }
}

/// The Event of a change of the plan's phase to `phase` (`reason`: the decision's), as
/// (warning, reason); `None` for phases whose start is said otherwise.
fn phase_event(
    old_phase: Option<PlanPhase>,
    phase: PlanPhase,
    reason: &str,
) -> Option<(bool, &'static str)> {
    match phase {
        PlanPhase::Succeeded => Some((false, "PlanSucceeded")),
        PlanPhase::RolledBack => Some((true, "PlanRolledBack")),
        PlanPhase::Failed => Some((true, "PlanFailed")),
        PlanPhase::Paused => Some((reason == "ComponentFailed", "PlanPaused")),
        PlanPhase::WaitingApproval => Some((false, "WaitingApproval")),
        PlanPhase::WaitingWindow => Some((false, "WaitingWindow")),
        PlanPhase::Progressing => match old_phase {
            None | Some(PlanPhase::Pending) => Some((false, "PlanStarted")),
            Some(PlanPhase::WaitingApproval) => Some((false, "WaveApproved")),
            Some(PlanPhase::WaitingWindow) => Some((false, "WindowOpened")),
            Some(_) => Some((false, "PlanResumed")),
        },
        PlanPhase::Pending | PlanPhase::RollingBack => None,
    }
}

/// Whether a component changed its target (started with a recorded previous value, and not
/// reverted): what a rollback reverts. One that failed before its start was recorded has
/// nothing to revert.
fn changed(c: &ComponentStatus) -> bool {
    c.previous.is_some()
        && matches!(
            c.phase,
            ComponentPhase::Progressing | ComponentPhase::Succeeded | ComponentPhase::Failed
        )
}

/// What the plan does after the components in flight, for `kubectl get uplan`: the
/// Pending components of the earliest wave that has any (`api, worker (wave 2)`), or during a
/// rollback the changed components of the latest wave not yet being reverted. `None` when
/// nothing follows.
fn next_step(i: &Input<'_>, comps: &[ComponentStatus], phase: PlanPhase) -> Option<String> {
    let names = |wave: i32, pick: &dyn Fn(&ComponentStatus, usize) -> bool| {
        let names: Vec<&str> = comps
            .iter()
            .enumerate()
            .filter(|(x, c)| c.wave == wave && pick(c, *x))
            .map(|(_, c)| c.name.as_str())
            .collect();
        format!("{} (wave {wave})", names.join(", "))
    };
    match phase {
        PlanPhase::RollingBack => {
            let to_revert =
                |c: &ComponentStatus, x: usize| changed(c) && i.spec.components[x].reverts();
            let reverting = comps
                .iter()
                .filter(|c| c.phase == ComponentPhase::RollingBack)
                .map(|c| c.wave)
                .max();
            let wave = comps
                .iter()
                .enumerate()
                .filter(|(x, c)| to_revert(c, *x) && reverting.is_none_or(|r| c.wave < r))
                .map(|(_, c)| c.wave)
                .max()?;
            Some(format!("revert {}", names(wave, &to_revert)))
        }
        p if p.is_terminal() => None,
        _ => {
            let pending = |c: &ComponentStatus, _: usize| c.phase == ComponentPhase::Pending;
            let wave = comps
                .iter()
                .filter(|c| c.phase == ComponentPhase::Pending)
                .map(|c| c.wave)
                .min()?;
            Some(names(wave, &pending))
        }
    }
}

/// What a deleted plan left its targets with, for its `PlanDeleted` Event: its phase and,
/// per component that was started, its phase and value.
pub fn deletion_record(status: Option<&UpgradePlanStatus>) -> String {
    let Some(status) = status.filter(|s| s.started_at.is_some()) else {
        return "deleted before it started: no target was changed".to_string();
    };
    let phase = status.phase.map_or("unknown", PlanPhase::as_str);
    let components: Vec<String> = status
        .components
        .iter()
        .filter(|c| c.previous.is_some())
        .map(|c| {
            let value = match c.phase {
                ComponentPhase::RolledBack => c.previous.as_deref(),
                _ => c.target.as_deref(),
            };
            format!(
                "{} {} at {}",
                c.name,
                c.phase.as_str(),
                value.unwrap_or_default()
            )
        })
        .collect();
    format!("deleted while {phase}: {}", components.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::{Component, ImageChange, Strategy, TargetKind, TargetRef};
    use crate::plan;

    fn t(secs: i64) -> Timestamp {
        Timestamp::from_second(1_700_000_000 + secs).unwrap()
    }

    fn component(name: &str, deps: &[&str]) -> Component {
        Component {
            name: name.into(),
            target: TargetRef::of(TargetKind::Deployment, name),
            image: Some(ImageChange {
                container: "app".into(),
                image: format!("{name}:2"),
            }),
            version: None,
            depends_on: deps.iter().map(|d| d.to_string()).collect(),
            rollback: None,
            health: None,
            hooks: None,
            set: None,
        }
    }

    /// A plan and a simulated cluster: each target holds a value and is healthy or rolling.
    struct Sim {
        spec: UpgradePlanSpec,
        generation: i64,
        status: UpgradePlanStatus,
        values: BTreeMap<String, String>,
        healthy: BTreeMap<String, bool>,
        changes: Vec<(String, String, String)>,
        /// Targets whose API refuses to go back to their old value (like a PostgresCluster).
        one_way: Vec<String>,
        rejected: BTreeMap<String, String>,
        /// Hook Jobs by name; a recorded hook's Job is created (Running) by `reconcile`.
        jobs: BTreeMap<String, JobState>,
        now: i64,
        notes: Vec<Note>,
        deleting: bool,
    }

    impl Sim {
        fn diamond() -> Self {
            Self::new(vec![
                component("web", &["api", "worker"]),
                component("api", &["db"]),
                component("worker", &["db"]),
                component("db", &[]),
            ])
        }

        fn new(components: Vec<Component>) -> Self {
            let values = components
                .iter()
                .map(|c| (c.name.clone(), format!("{}:1", c.name)))
                .collect();
            let healthy = components.iter().map(|c| (c.name.clone(), true)).collect();
            Self {
                spec: UpgradePlanSpec {
                    components,
                    strategy: Strategy::default(),
                    approved_waves: None,
                    service_account_name: None,
                },
                generation: 1,
                status: UpgradePlanStatus::default(),
                values,
                healthy,
                changes: Vec::new(),
                one_way: Vec::new(),
                rejected: BTreeMap::new(),
                jobs: BTreeMap::new(),
                now: 0,
                notes: Vec::new(),
                deleting: false,
            }
        }

        fn with(mut self, f: impl FnOnce(&mut Strategy)) -> Self {
            f(&mut self.spec.strategy);
            self
        }

        fn observed(&self) -> BTreeMap<String, Observation> {
            self.spec
                .components
                .iter()
                .map(|c| {
                    let value = self
                        .values
                        .get(&c.name)
                        .cloned()
                        .ok_or_else(|| format!("Deployment {} not found", c.name));
                    let health = if self.healthy[&c.name] {
                        Health::Healthy
                    } else {
                        Health::Progressing("rolling".into())
                    };
                    (c.name.clone(), Observation { value, health })
                })
                .collect()
        }

        /// One reconcile: make recorded changes (new rollouts start unhealthy), then step.
        fn reconcile(&mut self) -> Outcome {
            let observed = self.observed();
            self.rejected.clear();
            for (_, run) in hook::to_create(&self.spec, &self.status, &self.jobs) {
                self.jobs
                    .insert(run.job, JobState::Running("1 pod(s) running".into()));
            }
            for w in writes(&self.spec, &self.status, &observed) {
                let name = self.spec.components[w.index].name.clone();
                if w.revert && self.one_way.contains(&name) {
                    self.rejected
                        .insert(name, "the version cannot be lowered".into());
                    continue;
                }
                assert_eq!(
                    self.values[&name], w.from,
                    "a change applies only over its recorded value"
                );
                self.values.insert(name.clone(), w.to.clone());
                self.healthy.insert(name.clone(), false);
                self.changes.push((name, w.from, w.to));
            }
            let p = plan::plan(&self.spec.components).unwrap();
            let observed = self.observed();
            let out = step(&Input {
                name: "plan",
                jobs: &self.jobs,
                spec: &self.spec,
                generation: self.generation,
                status: &self.status,
                plan: &p,
                observed: &observed,
                rejected: &self.rejected,
                now: t(self.now),
                deleting: self.deleting,
            });
            self.status = out.status.clone();
            self.notes.extend(out.notes.clone());
            out
        }

        /// The diamond's first wave done and `api` changed (in flight).
        fn db_done_then_api_started(&mut self) {
            self.reconcile();
            self.reconcile();
            self.roll_out("db");
            self.reconcile();
            self.reconcile();
            assert_eq!(self.values["api"], "api:2", "api in flight");
        }

        fn roll_out(&mut self, name: &str) {
            self.healthy.insert(name.to_string(), true);
        }

        fn roll_out_all(&mut self) {
            for h in self.healthy.values_mut() {
                *h = true;
            }
        }

        fn comp(&self, name: &str) -> &ComponentStatus {
            self.status
                .components
                .iter()
                .find(|c| c.name == name)
                .unwrap()
        }

        fn phases(&self) -> Vec<(&str, ComponentPhase)> {
            self.status
                .components
                .iter()
                .map(|c| (c.name.as_str(), c.phase))
                .collect()
        }

        fn phase(&self) -> PlanPhase {
            self.status.phase.unwrap()
        }

        fn reasons(&self) -> Vec<&'static str> {
            self.notes.iter().map(|n| n.reason).collect()
        }
    }

    /// Midnight UTC for an hour; the simulation starts at 2023-11-14T22:13:20Z, 6400 s before.
    fn nightly() -> Vec<crate::crd::MaintenanceWindow> {
        vec![crate::crd::MaintenanceWindow {
            schedule: "0 0 * * *".into(),
            duration: "1h".into(),
            time_zone: None,
        }]
    }

    #[test]
    fn outside_its_maintenance_window_nothing_starts_and_components_in_flight_finish() {
        let mut s = Sim::diamond().with(|st| {
            st.max_concurrent = 2;
            st.maintenance_windows = nightly();
        });
        let out = s.reconcile();
        assert_eq!(s.phase(), PlanPhase::WaitingWindow);
        assert!(s.changes.is_empty() && s.status.started_at.is_none());
        assert_eq!(out.recheck_after, Some(Duration::from_secs(6400)));
        let ready = conditions::get(&s.status.conditions, conditions::READY).unwrap();
        assert_eq!(ready.reason, "OutsideMaintenanceWindow");
        assert!(
            ready
                .message
                .contains("opens at 2023-11-15T00:00:00+00:00[UTC] (0 0 * * * UTC for 1h)"),
            "{}",
            ready.message
        );
        assert!(s.reasons().contains(&"WaitingWindow"));

        // The window opens: db, then api and worker start.
        s.now = 6400;
        s.reconcile();
        assert_eq!(s.phase(), PlanPhase::Progressing);
        assert!(s.reasons().contains(&"WindowOpened"));
        s.reconcile();
        s.roll_out_all();
        s.reconcile();
        let out = s.reconcile();
        assert_eq!(s.values["api"], "api:2");
        assert_eq!(s.values["worker"], "worker:2");
        assert!(
            out.recheck_after
                .is_some_and(|d| d <= Duration::from_secs(3600)),
            "looks again when the window closes: {:?}",
            out.recheck_after
        );

        // It closes with api and worker in flight: they are followed to the end; web waits.
        s.now = 6400 + 3600;
        s.roll_out_all();
        for _ in 0..3 {
            s.reconcile();
        }
        assert_eq!(s.comp("api").phase, ComponentPhase::Succeeded);
        assert_eq!(s.comp("worker").phase, ComponentPhase::Succeeded);
        assert_eq!(s.comp("web").phase, ComponentPhase::Pending);
        assert_eq!(s.values["web"], "web:1");
        assert_eq!(s.phase(), PlanPhase::WaitingWindow);

        // The next night it finishes.
        s.now = 6400 + 86_400;
        for _ in 0..3 {
            s.reconcile();
            s.roll_out_all();
        }
        s.reconcile();
        assert_eq!(s.phase(), PlanPhase::Succeeded);
    }

    #[test]
    fn a_rollback_is_not_held_back_by_a_closed_window() {
        let mut s = Sim::diamond().with(|st| {
            st.failure_policy = FailurePolicy::Rollback;
            st.progress_deadline_seconds = 60;
            st.maintenance_windows = nightly();
        });
        s.now = 6400;
        s.db_done_then_api_started();
        // api never becomes healthy; its deadline passes after the window closed.
        s.now = 6400 + 3600;
        for _ in 0..4 {
            s.reconcile();
        }
        assert_eq!(s.values["api"], "api:1", "api reverted outside the window");
        s.roll_out_all();
        for _ in 0..4 {
            s.reconcile();
            s.roll_out_all();
        }
        assert_eq!(s.values["db"], "db:1", "db reverted outside the window");
        assert_eq!(s.phase(), PlanPhase::RolledBack);
    }

    #[test]
    fn an_invalid_window_is_a_validation_failure_that_starts_nothing() {
        let mut s = Sim::diamond().with(|st| {
            st.maintenance_windows = vec![crate::crd::MaintenanceWindow {
                schedule: "0 25 * * *".into(),
                duration: "1h".into(),
                time_zone: None,
            }];
        });
        s.reconcile();
        assert_eq!(s.phase(), PlanPhase::Pending);
        let valid = conditions::get(&s.status.conditions, VALID).unwrap();
        assert_eq!(
            (valid.status.as_str(), valid.reason.as_str()),
            ("False", "InvalidMaintenanceWindow")
        );
        assert!(
            valid.message.contains("maintenanceWindows[0]"),
            "{}",
            valid.message
        );
        assert!(s.changes.is_empty());
    }

    #[test]
    fn an_invalid_window_is_reported_before_its_wave_is_approved_or_unpaused() {
        for (manual, paused) in [(true, false), (false, true)] {
            let mut s = Sim::diamond().with(|st| {
                if manual {
                    st.approval = crate::crd::Approval::Manual;
                }
                st.paused = paused;
                st.maintenance_windows = vec![crate::crd::MaintenanceWindow {
                    schedule: "0 25 * * *".into(),
                    duration: "1h".into(),
                    time_zone: None,
                }];
            });
            s.reconcile();
            let valid = conditions::get(&s.status.conditions, VALID).unwrap();
            assert_eq!(
                (valid.status.as_str(), valid.reason.as_str()),
                ("False", "InvalidMaintenanceWindow"),
                "manual approval {manual}, paused {paused}"
            );
            assert!(s.changes.is_empty());
        }
    }

    #[test]
    fn start_is_recorded_before_the_target_changes() {
        let mut s = Sim::diamond();
        s.reconcile();
        assert_eq!(s.phase(), PlanPhase::Progressing);
        let db = s.comp("db");
        assert_eq!(db.phase, ComponentPhase::Progressing);
        assert_eq!(db.previous.as_deref(), Some("db:1"));
        assert_eq!(db.target.as_deref(), Some("db:2"));
        assert!(
            s.changes.is_empty(),
            "the first reconcile only records the start"
        );
        assert_eq!(s.values["db"], "db:1");
        s.reconcile();
        assert_eq!(s.changes, vec![("db".into(), "db:1".into(), "db:2".into())]);
        assert!(s.status.started_at.is_some());
        assert!(s.reasons().contains(&"ComponentStarted") && s.reasons().contains(&"PlanStarted"));
    }

    #[test]
    fn diamond_runs_wave_by_wave_and_changes_each_target_once() {
        let mut s = Sim::diamond().with(|st| st.max_concurrent = 2);
        for _ in 0..20 {
            s.now += 1;
            s.reconcile();
            s.roll_out_all();
        }
        assert_eq!(s.phase(), PlanPhase::Succeeded);
        assert_eq!(s.status.progress.as_deref(), Some("4/4"));
        assert!(conditions::is_true(&s.status.conditions, conditions::READY));
        let changed: Vec<&str> = s.changes.iter().map(|c| c.0.as_str()).collect();
        assert_eq!(changed, vec!["db", "api", "worker", "web"]);
        for c in &s.spec.components {
            let cs = s.comp(&c.name);
            for d in &c.depends_on {
                assert!(
                    cs.started_at >= s.comp(d).finished_at,
                    "{} started before {d} finished",
                    c.name
                );
            }
        }
        // api and worker ran together (maxConcurrent 2).
        assert_eq!(s.comp("api").started_at, s.comp("worker").started_at);
    }

    #[test]
    fn a_component_waits_for_its_own_dependencies_not_its_whole_wave() {
        for scheduling in [Scheduling::Dag, Scheduling::Waves] {
            let mut s = Sim::new(vec![
                component("a", &[]),
                component("slow", &[]),
                component("c", &["a"]),
            ])
            .with(|st| {
                st.max_concurrent = 2;
                st.scheduling = scheduling;
            });
            s.reconcile();
            s.reconcile();
            assert_eq!(
                (s.values["a"].as_str(), s.values["slow"].as_str()),
                ("a:2", "slow:2")
            );
            s.roll_out("a");
            s.reconcile();
            s.reconcile();
            let c_started = s.values["c"] == "c:2";
            assert_eq!(c_started, scheduling == Scheduling::Dag, "{scheduling:?}");
            assert_eq!(
                s.comp("slow").phase,
                ComponentPhase::Progressing,
                "{scheduling:?}"
            );
            s.roll_out_all();
            s.reconcile();
            s.reconcile();
            s.roll_out_all();
            s.reconcile();
            assert_eq!(s.phase(), PlanPhase::Succeeded, "{scheduling:?}");
            assert_eq!(s.changes.len(), 3, "each target changed once");
        }
    }

    #[test]
    fn max_concurrent_limits_a_wave() {
        let mut s = Sim::diamond();
        s.reconcile();
        s.reconcile();
        s.roll_out("db");
        s.reconcile();
        assert_eq!(s.comp("db").phase, ComponentPhase::Succeeded);
        assert_eq!(
            s.comp("api").phase,
            ComponentPhase::Progressing,
            "names sort: api first"
        );
        assert_eq!(s.comp("worker").phase, ComponentPhase::Pending);
        assert_eq!(s.status.current_wave, Some(2));
    }

    #[test]
    fn step_is_idempotent_when_nothing_changes() {
        let mut s = Sim::diamond();
        s.reconcile();
        s.reconcile();
        let before = s.status.clone();
        s.now += 5;
        let out = s.reconcile();
        assert_eq!(
            out.status, before,
            "no new fact, same status (the write is skipped)"
        );
        assert!(out.notes.is_empty());
        assert!(
            out.recheck_after
                .is_some_and(|d| d <= Duration::from_secs(600 - 5))
        );
    }

    #[test]
    fn deadline_with_pause_stops_and_a_spec_change_retries() {
        let mut s = Sim::diamond().with(|st| st.progress_deadline_seconds = 30);
        s.reconcile();
        s.reconcile();
        s.now = 31;
        s.reconcile();
        assert_eq!(s.comp("db").phase, ComponentPhase::Failed);
        assert!(
            s.comp("db")
                .message
                .as_deref()
                .unwrap()
                .contains("not healthy within 30s")
        );
        assert_eq!(s.phase(), PlanPhase::Paused);
        assert_eq!(
            conditions::get(&s.status.conditions, conditions::READY)
                .unwrap()
                .reason,
            "ComponentFailed"
        );
        assert!(conditions::is_true(
            &s.status.conditions,
            conditions::DEGRADED
        ));
        s.now = 100;
        s.roll_out_all();
        s.reconcile();
        assert_eq!(
            s.phase(),
            PlanPhase::Paused,
            "recovery alone does not resume a paused plan"
        );
        assert_eq!(s.comp("api").phase, ComponentPhase::Pending);
        s.generation = 2;
        s.reconcile();
        assert_eq!(s.comp("db").phase, ComponentPhase::Progressing, "retried");
        s.reconcile();
        assert_eq!(s.comp("db").phase, ComponentPhase::Succeeded);
        assert_eq!(
            s.changes.len(),
            1,
            "the retry did not change the target again"
        );
        assert!(s.reasons().contains(&"ComponentRetried"));
    }

    #[test]
    fn rollback_reverts_changed_components_last_wave_first() {
        let mut s = Sim::diamond().with(|st| {
            st.failure_policy = FailurePolicy::Rollback;
            st.max_concurrent = 2;
            st.progress_deadline_seconds = 60;
        });
        // db succeeds; api and worker start; worker succeeds, api never becomes healthy.
        s.db_done_then_api_started();
        s.roll_out("worker");
        s.now = 10;
        s.reconcile();
        assert_eq!(s.comp("worker").phase, ComponentPhase::Succeeded);
        s.now = 61;
        s.reconcile();
        assert_eq!(
            s.comp("api").phase,
            ComponentPhase::RollingBack,
            "the failure starts the rollback at once"
        );
        assert_eq!(
            s.comp("worker").phase,
            ComponentPhase::RollingBack,
            "same wave"
        );
        assert_eq!(
            s.comp("db").phase,
            ComponentPhase::Succeeded,
            "earlier wave waits"
        );
        assert_eq!(s.phase(), PlanPhase::RollingBack);
        assert_eq!(s.status.current_wave, Some(2));
        s.reconcile();
        assert_eq!(s.values["api"], "api:1");
        assert_eq!(s.values["worker"], "worker:1");
        assert_eq!(
            s.values["db"], "db:2",
            "db is reverted only after wave 2 is healthy again"
        );
        s.roll_out_all();
        s.reconcile();
        assert_eq!(s.comp("api").phase, ComponentPhase::RolledBack);
        assert_eq!(s.comp("db").phase, ComponentPhase::RollingBack);
        s.reconcile();
        assert_eq!(s.values["db"], "db:1");
        s.roll_out_all();
        s.reconcile();
        assert_eq!(s.phase(), PlanPhase::RolledBack);
        assert_eq!(
            s.comp("web").phase,
            ComponentPhase::Pending,
            "never started, never touched"
        );
        assert!(s.status.finished_at.is_some());
        let reverts: Vec<&str> = s.changes.iter().skip(3).map(|c| c.0.as_str()).collect();
        assert_eq!(reverts, vec!["api", "worker", "db"]);
        assert!(
            s.reasons().contains(&"RollbackStarted") && s.reasons().contains(&"PlanRolledBack")
        );
        // Terminal: nothing moves any more.
        let before = s.status.clone();
        s.now = 1000;
        s.reconcile();
        assert_eq!(s.status, before);
    }

    #[test]
    fn deleting_a_running_plan_reverts_what_it_changed_and_starts_nothing() {
        // Pause policy: a deletion rolls back whatever the failure policy says.
        let mut s = Sim::diamond().with(|st| st.max_concurrent = 2);
        s.db_done_then_api_started();
        assert_eq!(
            deletion_record(None),
            "deleted before it started: no target was changed"
        );
        s.deleting = true;
        s.reconcile();
        assert_eq!(s.phase(), PlanPhase::RollingBack);
        assert!(
            s.notes.iter().any(|n| n.reason == "RollbackStarted"
                && n.message.starts_with("the plan is being deleted"))
        );
        s.reconcile();
        assert_eq!(
            s.values["api"], "api:1",
            "the component in flight is reverted"
        );
        s.roll_out_all();
        s.reconcile();
        s.reconcile();
        s.roll_out_all();
        s.reconcile();
        assert_eq!(s.phase(), PlanPhase::RolledBack);
        assert!(
            s.values.iter().all(|(k, v)| *v == format!("{k}:1")),
            "{:?}",
            s.values
        );
        assert_eq!(
            s.comp("web").phase,
            ComponentPhase::Pending,
            "never started"
        );
        let record = deletion_record(Some(&s.status));
        assert!(record.starts_with("deleted while RolledBack: "), "{record}");
        assert!(record.contains("db RolledBack at db:1"), "{record}");
    }

    #[test]
    fn a_component_that_never_rolls_back_keeps_its_value_and_is_named() {
        let mut s = Sim::diamond().with(|st| {
            st.failure_policy = FailurePolicy::Rollback;
            st.progress_deadline_seconds = 60;
        });
        let db = s.spec.components.iter_mut().find(|c| c.name == "db");
        db.expect("db").rollback = Some(crate::crd::ComponentRollback::Never);
        s.db_done_then_api_started();
        s.now = 61;
        s.reconcile();
        assert_eq!(s.phase(), PlanPhase::RollingBack);
        s.reconcile();
        s.roll_out_all();
        s.reconcile();
        s.reconcile();
        assert_eq!(s.phase(), PlanPhase::RolledBack);
        assert_eq!(s.values["api"], "api:1", "reverted");
        assert_eq!(s.values["db"], "db:2", "kept");
        assert_eq!(s.comp("db").phase, ComponentPhase::Succeeded);
        let reverts: Vec<&str> = s.changes.iter().skip(2).map(|c| c.0.as_str()).collect();
        assert_eq!(reverts, vec!["api"], "db is never changed back");
        let ready = conditions::get(&s.status.conditions, conditions::READY).expect("Ready");
        assert!(
            ready.message.contains("kept (rollback: Never): db at db:2"),
            "{}",
            ready.message
        );
    }

    #[test]
    fn a_refused_revert_fails_the_plan_instead_of_retrying_forever() {
        let mut s = Sim::new(vec![component("db", &[]), component("app", &["db"])]).with(|st| {
            st.failure_policy = FailurePolicy::Rollback;
            st.progress_deadline_seconds = 10;
        });
        s.one_way.push("db".into());
        s.reconcile();
        s.reconcile();
        s.roll_out_all();
        s.reconcile();
        s.reconcile();
        s.now = 20;
        s.reconcile();
        s.reconcile();
        s.roll_out_all();
        s.reconcile();
        assert_eq!(s.comp("app").phase, ComponentPhase::RolledBack);
        assert_eq!(s.comp("db").phase, ComponentPhase::RollingBack);
        s.reconcile();
        assert_eq!(s.phase(), PlanPhase::Failed);
        assert!(
            s.comp("db")
                .message
                .as_deref()
                .unwrap()
                .contains("refused the revert")
        );
        assert_eq!(s.values["db"], "db:2");
        assert_eq!(
            conditions::get(&s.status.conditions, conditions::DEGRADED)
                .unwrap()
                .reason,
            "RollbackFailed"
        );
    }

    #[test]
    fn switching_a_paused_failure_to_rollback_rolls_back() {
        let mut s = Sim::diamond().with(|st| st.progress_deadline_seconds = 5);
        s.reconcile();
        s.reconcile();
        s.now = 6;
        s.reconcile();
        assert_eq!(s.phase(), PlanPhase::Paused);
        s.spec.strategy.failure_policy = FailurePolicy::Rollback;
        s.generation = 2;
        s.reconcile();
        assert_eq!(s.phase(), PlanPhase::RollingBack);
        s.reconcile();
        s.roll_out_all();
        s.reconcile();
        assert_eq!(s.phase(), PlanPhase::RolledBack);
        assert_eq!(s.values["db"], "db:1");
    }

    #[test]
    fn workload_failure_fails_the_component_before_the_deadline() {
        let mut s = Sim::new(vec![component("a", &[])]);
        s.reconcile();
        s.reconcile();
        let p = plan::plan(&s.spec.components).unwrap();
        let mut observed = s.observed();
        observed.get_mut("a").unwrap().health =
            Health::Failed("ProgressDeadlineExceeded: timed out".into());
        let out = step(&Input {
            name: "plan",
            jobs: &BTreeMap::new(),
            spec: &s.spec,
            generation: 1,
            status: &s.status,
            plan: &p,
            observed: &observed,
            rejected: &BTreeMap::new(),
            deleting: false,
            now: t(1),
        });
        let a = &out.status.components[0];
        assert_eq!(a.phase, ComponentPhase::Failed);
        assert!(
            a.message
                .as_deref()
                .unwrap()
                .contains("ProgressDeadlineExceeded")
        );
        assert_eq!(
            out.finished,
            vec![Finished {
                kind: "Deployment".into(),
                result: "failed",
                seconds: 1.0
            }]
        );
    }

    #[test]
    fn a_change_by_someone_else_is_a_failure_not_overwritten() {
        let mut s = Sim::new(vec![component("a", &[])]);
        s.reconcile();
        s.values.insert("a".into(), "a:hotfix".into());
        s.reconcile();
        assert!(
            s.changes.is_empty(),
            "the recorded previous value no longer holds: no write"
        );
        assert_eq!(s.comp("a").phase, ComponentPhase::Failed);
        assert!(
            s.comp("a")
                .message
                .as_deref()
                .unwrap()
                .contains("someone else")
        );
    }

    #[test]
    fn manual_approval_waits_at_each_wave() {
        let mut s = Sim::new(vec![component("a", &[]), component("b", &["a"])])
            .with(|st| st.approval = Approval::Manual);
        s.reconcile();
        assert_eq!(s.phase(), PlanPhase::WaitingApproval);
        assert_eq!(s.comp("a").phase, ComponentPhase::Pending);
        assert!(
            conditions::get(&s.status.conditions, conditions::READY)
                .unwrap()
                .message
                .contains("approvedWaves to 1")
        );
        s.spec.approved_waves = Some(1);
        s.generation = 2;
        s.reconcile();
        assert_eq!(s.comp("a").phase, ComponentPhase::Progressing);
        s.reconcile();
        s.roll_out_all();
        s.reconcile();
        assert_eq!(s.phase(), PlanPhase::WaitingApproval);
        assert_eq!(s.status.current_wave, Some(2));
        assert_eq!(s.comp("b").phase, ComponentPhase::Pending);
        s.spec.approved_waves = Some(2);
        s.reconcile();
        s.reconcile();
        s.roll_out_all();
        s.reconcile();
        assert_eq!(s.phase(), PlanPhase::Succeeded);
        assert_eq!(
            s.reasons()
                .iter()
                .filter(|r| **r == "WaitingApproval")
                .count(),
            2
        );
    }

    #[test]
    fn paused_halts_between_components_but_follows_those_in_flight() {
        let mut s = Sim::new(vec![component("a", &[]), component("b", &["a"])]);
        s.reconcile();
        s.reconcile();
        s.spec.strategy.paused = true;
        s.reconcile();
        assert_eq!(s.phase(), PlanPhase::Paused);
        s.roll_out_all();
        s.reconcile();
        assert_eq!(
            s.comp("a").phase,
            ComponentPhase::Succeeded,
            "in flight: followed to the end"
        );
        assert_eq!(
            s.comp("b").phase,
            ComponentPhase::Pending,
            "nothing new starts"
        );
        s.spec.strategy.paused = false;
        s.reconcile();
        assert_eq!(s.comp("b").phase, ComponentPhase::Progressing);
        assert!(s.reasons().contains(&"PlanPaused") && s.reasons().contains(&"PlanResumed"));
    }

    #[test]
    fn missing_target_before_start_is_invalid_and_starts_nothing() {
        let mut s = Sim::diamond();
        s.values.remove("web");
        s.reconcile();
        assert_eq!(s.phase(), PlanPhase::Pending);
        let valid = conditions::get(&s.status.conditions, VALID).unwrap();
        assert_eq!(
            (valid.status.as_str(), valid.reason.as_str()),
            ("False", "TargetNotFound")
        );
        assert!(valid.message.contains("Deployment web not found"));
        assert!(
            s.status
                .components
                .iter()
                .all(|c| c.phase == ComponentPhase::Pending)
        );
        s.reconcile();
        assert!(s.changes.is_empty());
        assert_eq!(
            s.reasons()
                .iter()
                .filter(|r| **r == "TargetNotFound")
                .count(),
            1,
            "one Event, not one per reconcile"
        );
    }

    #[test]
    fn invalid_plan_reports_and_records_no_start() {
        let status = UpgradePlanStatus::default();
        let err = plan::plan(&[component("a", &["b"]), component("b", &["a"])]).unwrap_err();
        let out = invalid(&status, 3, &err, t(0));
        let valid = conditions::get(&out.status.conditions, VALID).unwrap();
        assert_eq!(
            (valid.status.as_str(), valid.reason.as_str()),
            ("False", "DependencyCycle")
        );
        assert_eq!(out.status.phase, Some(PlanPhase::Pending));
        assert_eq!(out.status.observed_generation, Some(3));
        assert!(out.status.components.is_empty());
        assert_eq!(out.notes.len(), 1);
        let again = invalid(&out.status, 3, &err, t(10));
        assert_eq!(again.status, out.status);
        assert!(again.notes.is_empty());
    }

    #[test]
    fn a_dependency_that_turned_unhealthy_blocks_its_dependents() {
        let mut s = Sim::new(vec![component("a", &[]), component("b", &["a"])]);
        s.reconcile();
        s.reconcile();
        s.roll_out_all();
        let p = plan::plan(&s.spec.components).unwrap();
        // a becomes healthy (recorded Succeeded) ...
        s.reconcile();
        assert_eq!(s.comp("b").phase, ComponentPhase::Progressing);
        // ... but had it turned unhealthy first, b would wait.
        let mut status = s.status.clone();
        status.components[1] = ComponentStatus::pending("b", 2);
        let mut observed = s.observed();
        observed.get_mut("a").unwrap().health =
            Health::Progressing("1 of 3 replicas available".into());
        let out = step(&Input {
            name: "plan",
            jobs: &BTreeMap::new(),
            spec: &s.spec,
            generation: 1,
            status: &status,
            plan: &p,
            observed: &observed,
            rejected: &BTreeMap::new(),
            deleting: false,
            now: t(9),
        });
        assert_eq!(out.status.components[1].phase, ComponentPhase::Pending);
        assert!(
            conditions::get(&out.status.conditions, conditions::READY)
                .unwrap()
                .message
                .contains("waiting for dependency a")
        );
    }

    /// Crashes at every point: a reconcile whose status write is lost, at every step of the
    /// plan. The plan still completes, each target changes exactly once, never early.
    #[test]
    fn lost_status_writes_never_double_change_or_reorder() {
        for lose_at in 0..40 {
            let mut s = Sim::diamond().with(|st| st.max_concurrent = 2);
            for n in 0..60 {
                s.now += 1;
                let saved = s.status.clone();
                s.reconcile();
                if n == lose_at || n % 7 == lose_at % 7 {
                    s.status = saved; // the process died before (or while) writing the status
                }
                if n % 3 == 2 {
                    s.roll_out_all();
                }
            }
            assert_eq!(
                s.phase(),
                PlanPhase::Succeeded,
                "lose_at {lose_at}: {:?}",
                s.phases()
            );
            let mut changed: Vec<&str> = s.changes.iter().map(|c| c.0.as_str()).collect();
            assert_eq!(changed.len(), 4, "lose_at {lose_at}: {:?}", s.changes);
            changed.sort_unstable();
            assert_eq!(changed, vec!["api", "db", "web", "worker"]);
            for c in &s.spec.components {
                for d in &c.depends_on {
                    assert!(s.comp(&c.name).started_at >= s.comp(d).finished_at);
                }
            }
        }
    }

    fn with_hooks(mut c: Component, before: bool, after: bool) -> Component {
        let hook = || crate::crd::Hook {
            job: serde_json::json!({"template": {"spec": {
                "restartPolicy": "Never",
                "containers": [{"name": "hook", "image": "hook:1"}]
            }}}),
        };
        c.hooks = Some(crate::crd::Hooks {
            before: before.then(hook),
            after: after.then(hook),
        });
        c
    }

    #[test]
    fn a_before_hook_runs_first_and_the_target_changes_only_once_it_succeeded() {
        let mut s = Sim::new(vec![with_hooks(component("api", &[]), true, false)]);
        s.reconcile();
        let run = s.comp("api").hook.clone().unwrap();
        assert_eq!(
            (run.stage, run.phase, run.job.as_str()),
            (HookStage::Before, HookPhase::Running, "plan-api-before-1")
        );
        assert_eq!(
            s.comp("api").previous.as_deref(),
            Some("api:1"),
            "write-ahead"
        );
        s.reconcile();
        assert!(
            s.jobs.contains_key("plan-api-before-1"),
            "its Job was created"
        );
        assert_eq!(s.values["api"], "api:1", "no change while the hook runs");
        assert!(
            s.comp("api")
                .message
                .as_deref()
                .unwrap()
                .contains("waiting for the before hook Job")
        );
        s.jobs
            .insert("plan-api-before-1".into(), JobState::Succeeded);
        s.reconcile();
        assert_eq!(
            s.comp("api").hook.as_ref().unwrap().phase,
            HookPhase::Succeeded
        );
        s.reconcile();
        assert_eq!(s.values["api"], "api:2", "changed after the hook");
        s.roll_out("api");
        s.reconcile();
        assert_eq!(s.comp("api").phase, ComponentPhase::Succeeded);
        let reasons: Vec<&str> = s.notes.iter().map(|n| n.reason).collect();
        assert!(reasons.contains(&"HookStarted") && reasons.contains(&"HookSucceeded"));
    }

    #[test]
    fn a_failed_after_hook_fails_the_component_and_the_rollback_reverts_it() {
        let mut s = Sim::new(vec![
            component("db", &[]),
            with_hooks(component("api", &["db"]), false, true),
        ])
        .with(|st| st.failure_policy = FailurePolicy::Rollback);
        s.reconcile();
        s.reconcile();
        s.roll_out("db");
        s.reconcile();
        s.reconcile();
        assert_eq!(s.values["api"], "api:2");
        s.roll_out("api");
        s.reconcile();
        assert_eq!(
            s.comp("api").phase,
            ComponentPhase::Progressing,
            "after hook runs"
        );
        let job = s.comp("api").hook.clone().unwrap().job;
        assert_eq!(job, "plan-api-after-1");
        s.reconcile();
        s.jobs
            .insert(job, JobState::Failed("BackoffLimitExceeded".into()));
        s.reconcile();
        assert_eq!(
            s.comp("api").hook.as_ref().unwrap().phase,
            HookPhase::Failed
        );
        assert!(
            s.notes.iter().any(|n| n.reason == "ComponentFailed"
                && n.message
                    .contains("after hook Job plan-api-after-1 failed: BackoffLimitExceeded")),
            "{:?}",
            s.notes
        );
        for _ in 0..6 {
            s.reconcile();
            s.roll_out_all();
        }
        assert_eq!(s.status.phase, Some(PlanPhase::RolledBack));
        assert_eq!(
            (s.values["api"].as_str(), s.values["db"].as_str()),
            ("api:1", "db:1")
        );
    }

    #[test]
    fn a_failed_before_hook_changes_nothing_and_a_spec_change_runs_a_new_job() {
        let mut s = Sim::new(vec![with_hooks(component("api", &[]), true, false)]);
        s.reconcile();
        s.reconcile();
        s.jobs.insert(
            "plan-api-before-1".into(),
            JobState::Failed("DeadlineExceeded".into()),
        );
        s.reconcile();
        assert_eq!(s.comp("api").phase, ComponentPhase::Failed);
        assert_eq!(s.status.phase, Some(PlanPhase::Paused));
        s.reconcile();
        assert_eq!(
            s.values["api"], "api:1",
            "a failed before hook changes nothing"
        );
        s.generation = 2;
        s.reconcile();
        let run = s.comp("api").hook.clone().unwrap();
        assert_eq!(
            (run.job.as_str(), run.phase),
            ("plan-api-before-2", HookPhase::Running)
        );
        s.reconcile();
        s.jobs
            .insert("plan-api-before-2".into(), JobState::Succeeded);
        s.reconcile();
        s.reconcile();
        s.roll_out("api");
        s.reconcile();
        assert_eq!(s.comp("api").phase, ComponentPhase::Succeeded);
    }

    #[test]
    fn a_hook_that_outlives_the_deadline_fails_the_component() {
        let mut s = Sim::new(vec![with_hooks(component("api", &[]), true, false)])
            .with(|st| st.progress_deadline_seconds = 60);
        s.reconcile();
        s.reconcile();
        s.now = 61;
        s.reconcile();
        assert_eq!(s.comp("api").phase, ComponentPhase::Failed);
        assert!(
            s.comp("api")
                .message
                .as_deref()
                .unwrap()
                .contains("did not finish within 60s")
        );
        assert_eq!(
            s.comp("api").hook.as_ref().unwrap().phase,
            HookPhase::Failed
        );
        assert_eq!(s.values["api"], "api:1");
    }

    #[test]
    fn the_status_says_what_comes_next() {
        let mut s = Sim::diamond().with(|st| st.failure_policy = FailurePolicy::Rollback);
        s.reconcile();
        assert_eq!(s.comp("db").phase, ComponentPhase::Progressing);
        assert_eq!(s.status.next.as_deref(), Some("api, worker (wave 2)"));
        s.db_done_then_api_started();
        assert_eq!(s.status.next.as_deref(), Some("worker (wave 2)"));
        // api fails: api (wave 2) is reverted first, db after it.
        s.now = 10_000;
        s.reconcile();
        assert_eq!(s.status.phase, Some(PlanPhase::RollingBack));
        assert_eq!(s.status.next.as_deref(), Some("revert db (wave 1)"));
        for _ in 0..6 {
            s.roll_out_all();
            s.reconcile();
        }
        assert_eq!(s.status.phase, Some(PlanPhase::RolledBack));
        assert_eq!(s.status.next, None);
    }
}
