//! The `UpgradePlan` custom resource (`upgrade.steward.dev/v1alpha1`), and what a plan may
//! publish of the values it changes ([`redact`]). Types only: no controller code, so
//! `kubectl steward` depends on this crate, not on the upgrade-orchestrator.
//!
//! ```yaml
//! apiVersion: upgrade.steward.dev/v1alpha1
//! kind: UpgradePlan
//! metadata: {name: release-42}
//! spec:
//!   components:
//!     - name: db
//!       target: {kind: PostgresCluster, name: main}
//!       version: "17"
//!     - name: api
//!       target: {kind: Deployment, name: api}
//!       image: {container: api, image: registry.example/api:2.0}
//!       dependsOn: [db]
//!     - name: flags
//!       target: {apiVersion: v1, kind: ConfigMap, name: features}
//!       set: {path: /data/checkout-v2, value: "on"}
//!       dependsOn: [api]
//!   strategy: {maxConcurrent: 1, progressDeadlineSeconds: 600, failurePolicy: Rollback}
//! ```

#![forbid(unsafe_code)]

pub mod redact;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, MicroTime};
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The API group of this operator.
pub const GROUP: &str = "upgrade.steward.dev";
/// The operator that serves these kinds: its binary, field manager, Lease and Event reporter.
pub const OPERATOR: &str = "upgrade-orchestrator";

/// How a plan's Ready message introduces the next opening of its maintenance windows
/// (`kubectl steward status` reads it).
pub const NEXT_OPENING: &str = "the next maintenance window opens at ";

/// Rolls new versions across several dependent workloads, one dependency wave at a time.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "upgrade.steward.dev",
    version = "v1alpha1",
    kind = "UpgradePlan",
    doc = "An ordered upgrade of several dependent workloads: components in dependency waves, with health gates, write-ahead state and rollback.",
    namespaced,
    shortname = "uplan",
    category = "steward",
    status = "UpgradePlanStatus",
    derive = "PartialEq",
    printcolumn(name = "Ready", type_ = "string", json_path = r#".status.conditions[?(@.type=="Ready")].status"#),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(name = "Wave", type_ = "integer", json_path = ".status.currentWave", description = "The dependency wave being worked on (1-based)"),
    printcolumn(name = "Waves", type_ = "integer", json_path = ".status.waves", priority = 1),
    printcolumn(name = "Upgraded", type_ = "string", json_path = ".status.progress", description = "Components upgraded / total"),
    printcolumn(name = "Policy", type_ = "string", json_path = ".spec.strategy.failurePolicy"),
    printcolumn(name = "Approval", type_ = "string", json_path = ".spec.strategy.approval", priority = 1),
    printcolumn(name = "Paused", type_ = "boolean", json_path = ".spec.strategy.paused", priority = 1),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp"),
    printcolumn(name = "Step", type_ = "string", json_path = r#".status.conditions[?(@.type=="Ready")].message"#, description = "What the plan is doing and what it waits for"),
    printcolumn(name = "Next", type_ = "string", json_path = ".status.next", description = "What follows the components in flight"),
    validation = Rule::new(
        "!has(oldSelf.status) || !has(oldSelf.status.startedAt) || self.spec.components == oldSelf.spec.components"
    )
    .message("spec.components is immutable once the plan has started; create a new plan instead"),
    validation = Rule::new(
        "self.spec.strategy.failurePolicy != 'Rollback' || self.spec.components.all(c, c.target.kind != 'PostgresCluster' || (has(c.rollback) && c.rollback == 'Never'))"
    )
    .message("a PostgresCluster's version cannot be lowered, so failurePolicy Rollback cannot revert it: set rollback: Never on its component (it keeps the new version while the others are reverted) or use failurePolicy Pause"),
    validation = Rule::new(
        "!self.spec.components.exists(c, has(c.target.namespace)) || has(self.spec.serviceAccountName)"
    )
    .message("a target in another namespace needs spec.serviceAccountName: the plan acts there as that ServiceAccount, so it can change only what the ServiceAccount may")
)]
#[serde(rename_all = "camelCase")]
pub struct UpgradePlanSpec {
    /// The workloads to upgrade. A component starts only when every component it depends on
    /// is upgraded and healthy. Immutable once the plan has started.
    #[schemars(length(min = 1, max = 50))]
    pub components: Vec<Component>,

    /// How the plan proceeds.
    #[serde(default)]
    pub strategy: Strategy,

    /// With `approval: Manual`, the number of waves approved to start: wave N starts only when
    /// `approvedWaves >= N`. Can only grow.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 1000))]
    #[x_kube(validation = Rule::new("self >= oldSelf").message("approvedWaves cannot decrease"))]
    pub approved_waves: Option<i32>,

    /// A ServiceAccount of the plan's namespace to act as: every target is read and changed,
    /// and every hook Job created, by impersonating it, so the plan can change only what the
    /// ServiceAccount may. The ServiceAccount must delegate to the plan: its annotation
    /// `upgrade.steward.dev/plans` names the plan (comma-separated names, or `*`). Needed for
    /// targets in other namespaces. Without it the plan acts with the orchestrator's own
    /// rights, in its own namespace only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 253),
        regex(pattern = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    )]
    pub service_account_name: Option<String>,
}

/// One workload to upgrade, and what to change in it.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new(
        "(has(self.image) ? 1 : 0) + (has(self.version) ? 1 : 0) + (has(self.set) ? 1 : 0) == 1 && (!has(self.version) || (self.target.kind == 'PostgresCluster' && !has(self.target.apiVersion))) && (!has(self.image) || (self.target.kind in ['Deployment', 'StatefulSet', 'DaemonSet'] && !has(self.target.apiVersion)))"
    )
    .message("a component sets exactly one of: image (a Deployment, StatefulSet or DaemonSet), version (a PostgresCluster) or set (a field of any kind)")
)]
pub struct Component {
    /// Unique within the plan; other components name it in `dependsOn`.
    #[schemars(
        length(min = 1, max = 63),
        regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    )]
    pub name: String,

    /// The workload to change, in the plan's namespace.
    pub target: TargetRef,

    /// For a Deployment, StatefulSet or DaemonSet: the container whose image changes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<ImageChange>,

    /// Any field of any kind: the JSON value to put at a JSON pointer, e.g.
    /// `{path: /data/release, value: "2.0"}` on a ConfigMap, `{path: /spec/replicas, value: 3}`.
    /// The previous value is recorded as JSON text (`null`: the field was absent, and a
    /// rollback removes it again); outside `/spec` only as a digest, and for a Secret not at
    /// all: the target itself keeps the previous value, in an annotation, for the rollback.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub set: Option<FieldChange>,

    /// For a PostgresCluster: the new `spec.version`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 32),
        regex(pattern = r"^[0-9A-Za-z][0-9A-Za-z._-]*$")
    )]
    pub version: Option<String>,

    /// Names of the components that must be upgraded and healthy before this one starts.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 50), inner(length(min = 1, max = 63)))]
    pub depends_on: Vec<String>,

    /// What a rollback of the plan does to this component once changed. A PostgresCluster
    /// component in a plan with `failurePolicy: Rollback` must say `Never` (its version
    /// cannot be lowered).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollback: Option<ComponentRollback>,

    /// When the target counts as healthy (or failed), as CEL over the target object
    /// (`self`), instead of the built-in rule of its kind. Compiled when the plan is
    /// validated: an expression that does not parse, nests deeper than 64 levels or whose
    /// estimated cost exceeds its budget (comprehensions multiply their body's cost by their
    /// list's size) is `Valid=False InvalidHealthCheck`. Evaluated off the reconcile's
    /// workers, within 1 s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health: Option<HealthCheck>,

    /// Jobs run around the change: `before` (e.g. a schema migration) must succeed before
    /// the target changes, `after` (e.g. a smoke test) once it is healthy, before the
    /// component counts as upgraded. A hook that fails (or outlives the progress deadline)
    /// fails the component, and the failure policy applies. Hooks do not run on rollback.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hooks: Option<Hooks>,
}

/// The Jobs run before and after a component's change.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Hooks {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub before: Option<Hook>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after: Option<Hook>,
}

/// A Job the orchestrator creates in the plan's namespace, owned by the plan and named
/// `<plan>-<component>-<before|after>-<generation>` (shortened with a hash past 63
/// characters). Its pods run as the template's ServiceAccount, which may only be the plan's
/// `spec.serviceAccountName` or `default`; a template naming none runs as the plan's
/// ServiceAccount when it names one, else as `default`. Whoever may create an UpgradePlan with
/// hooks may run Jobs in its namespace as those. A Job without
/// `activeDeadlineSeconds` gets the plan's `progressDeadlineSeconds`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Hook {
    /// The Job's spec (`template`, `backoffLimit`, `activeDeadlineSeconds`, ...), as in a
    /// batch/v1 Job. Not expanded in this CRD's schema (two copies of a pod template would
    /// make it over a megabyte): before the plan starts, the API server validates it by a
    /// dry-run create, and a Job it refuses is `Valid=False InvalidHook`.
    #[schemars(schema_with = "job_spec_schema")]
    pub job: serde_json::Value,
}

/// Any object: the Job spec is checked by the API server's dry run, not by this schema.
fn job_spec_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": true,
    })
}

/// When a hook runs.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum HookStage {
    /// Before the target changes.
    Before,
    /// After the changed target is healthy.
    After,
}

impl HookRun {
    /// A hook recorded as started (its Job not yet created, or running).
    pub fn running(stage: HookStage, job: String, started_at: Option<MicroTime>) -> Self {
        Self {
            stage,
            job,
            phase: HookPhase::Running,
            started_at,
            finished_at: None,
        }
    }
}

impl HookStage {
    pub fn as_str(self) -> &'static str {
        match self {
            HookStage::Before => "before",
            HookStage::After => "after",
        }
    }
}

/// Where a hook's Job is.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum HookPhase {
    Running,
    Succeeded,
    Failed,
}

/// The hook a component ran last (recorded before its Job is created).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HookRun {
    pub stage: HookStage,
    /// The Job's name.
    pub job: String,
    pub phase: HookPhase,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<MicroTime>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<MicroTime>,
}

/// A value to put at a field of the target.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FieldChange {
    /// A JSON pointer (RFC 6901) into the object, e.g. `/spec/template/spec/containers/0/env/0/value`
    /// or `/data/release` (`~1` stands for a `/` inside a key). Under `/spec`, `/data` or
    /// `/binaryData` (the status and metadata belong to others; a Secret's `/stringData` is
    /// write-only, so a change there could be neither seen nor reverted). Values outside
    /// `/spec` are shown in the plan's status and Events only as a digest, a Secret's not at
    /// all (see docs/upgrades.md).
    #[schemars(
        length(min = 2, max = 512),
        regex(pattern = r"^/(spec|data|binaryData)(/.*)?$")
    )]
    pub path: String,
    /// The new value: any JSON (a string, number, boolean, list or object).
    #[schemars(schema_with = "any_value_schema")]
    pub value: serde_json::Value,
}

/// Any JSON value (checked by the target's own validation when the change is dry-run).
fn any_value_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "x-kubernetes-preserve-unknown-fields": true,
    })
}

/// A component's own health rule, evaluated each time the target changes.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HealthCheck {
    /// True once the target finished rolling out its current spec, e.g.
    /// `self.status.observedGeneration == self.metadata.generation &&
    /// self.status.conditions.exists(c, c.type == 'Ready' && c.status == 'True')`.
    /// A field that is not there yet (no status) means not yet healthy.
    #[schemars(length(min = 1, max = 4096))]
    pub healthy: String,
    /// True when the rollout failed: the plan's failure policy applies (checked first).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 4096))]
    pub failed: Option<String>,
}

/// What a rollback does to a changed component.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum ComponentRollback {
    /// Revert it to its recorded previous value (the default).
    #[default]
    Revert,
    /// Keep the new value: the rollback leaves it as it is and says so in the plan's status.
    Never,
}

/// An object in the plan's namespace: one of the four built-in kinds (`kind` alone), or any
/// namespaced kind with its `apiVersion` (then the component uses `set`, and the
/// orchestrator needs `get` and `patch` on that kind: grant them to its ServiceAccount).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new(
        "has(self.apiVersion) || self.kind in ['Deployment', 'StatefulSet', 'DaemonSet', 'PostgresCluster']"
    )
    .message("a kind other than Deployment, StatefulSet, DaemonSet or PostgresCluster needs its apiVersion (e.g. v1 for a ConfigMap)")
)]
pub struct TargetRef {
    /// `group/version` (or `v1`) of a kind other than the built-in four.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 253),
        regex(pattern = r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?v[0-9]+((alpha|beta)[0-9]+)?$")
    )]
    pub api_version: Option<String>,
    /// Another namespace than the plan's (requires `spec.serviceAccountName`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 63),
        regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    )]
    pub namespace: Option<String>,
    /// `Deployment`, `StatefulSet`, `DaemonSet`, `PostgresCluster`, or any kind with
    /// `apiVersion`.
    #[schemars(length(min = 1, max = 63), regex(pattern = r"^[A-Z][A-Za-z0-9]*$"))]
    pub kind: String,
    #[schemars(
        length(min = 1, max = 253),
        regex(pattern = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    )]
    pub name: String,
}

/// The kinds the orchestrator knows (typed short forms, built-in health, watched).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum TargetKind {
    Deployment,
    StatefulSet,
    DaemonSet,
    /// `database.steward.dev/v1alpha1` PostgresCluster.
    PostgresCluster,
}

impl TargetRef {
    /// The built-in kind this names, if any (without `apiVersion`, or with that kind's own).
    pub fn typed(&self) -> Option<TargetKind> {
        let kind = match self.kind.as_str() {
            "Deployment" => TargetKind::Deployment,
            "StatefulSet" => TargetKind::StatefulSet,
            "DaemonSet" => TargetKind::DaemonSet,
            "PostgresCluster" => TargetKind::PostgresCluster,
            _ => return None,
        };
        match &self.api_version {
            None => Some(kind),
            Some(v) if *v == kind.api_version() => Some(kind),
            Some(_) => None,
        }
    }

    /// The namespace of the target of a plan in `plan_namespace`.
    pub fn namespace_in<'a>(&'a self, plan_namespace: &'a str) -> &'a str {
        self.namespace.as_deref().unwrap_or(plan_namespace)
    }

    /// A target of the built-in `kind`.
    pub fn of(kind: TargetKind, name: &str) -> Self {
        Self {
            api_version: None,
            namespace: None,
            kind: kind.as_str().to_string(),
            name: name.to_string(),
        }
    }
}

impl TargetKind {
    /// The apiVersion of the built-in kind.
    pub fn api_version(self) -> &'static str {
        match self {
            TargetKind::PostgresCluster => "database.steward.dev/v1alpha1",
            _ => "apps/v1",
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            TargetKind::Deployment => "Deployment",
            TargetKind::StatefulSet => "StatefulSet",
            TargetKind::DaemonSet => "DaemonSet",
            TargetKind::PostgresCluster => "PostgresCluster",
        }
    }
}

impl std::fmt::Display for TargetKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A new image for one container of a pod template.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ImageChange {
    /// The container's name in the pod template (`spec.template.spec.containers[].name`).
    #[schemars(length(min = 1, max = 63))]
    pub container: String,
    /// The new image reference.
    #[schemars(length(min = 1, max = 512))]
    pub image: String,
}

/// How a plan proceeds and what it does on failure.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Strategy {
    /// At most this many components are upgrading at once.
    #[serde(default = "default_max_concurrent")]
    #[schemars(range(min = 1, max = 50))]
    pub max_concurrent: i32,

    /// How long a component may take to become healthy after its change (and after a
    /// revert, during rollback) before it counts as failed.
    #[serde(default = "default_progress_deadline")]
    #[schemars(range(min = 1, max = 86400))]
    pub progress_deadline_seconds: i32,

    /// What happens when a component fails.
    #[serde(default)]
    pub failure_policy: FailurePolicy,

    /// Whether each wave waits for `spec.approvedWaves`.
    #[serde(default)]
    pub approval: Approval,

    /// Stops the plan between components: nothing new starts while set; components already
    /// upgrading are still followed to the end.
    #[serde(default)]
    pub paused: bool,

    /// When a component may start (within `maxConcurrent`).
    #[serde(default)]
    pub scheduling: Scheduling,

    /// Components start only while one of these windows is open; outside them nothing new
    /// starts, components already upgrading are followed to the end, and rollbacks are never
    /// held back. Empty: at any time.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 20))]
    pub maintenance_windows: Vec<MaintenanceWindow>,
}

/// A recurring time during which a plan may start components.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MaintenanceWindow {
    /// When the window opens: a cron schedule of 5 fields (minute hour day-of-month month
    /// day-of-week, e.g. `0 2 * * SAT`) or a nickname (`@daily`, `@weekly`).
    #[schemars(length(min = 1, max = 128))]
    pub schedule: String,
    /// How long it stays open, e.g. `4h` or `90m` (at most 31 days).
    #[schemars(
        length(min = 2, max = 32),
        regex(pattern = r"^([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$")
    )]
    pub duration: String,
    /// The IANA time zone the schedule is read in, e.g. `Europe/Berlin` (daylight saving
    /// included). Default: UTC.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 64))]
    pub time_zone: Option<String>,
}

/// When a component may start.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum Scheduling {
    /// As soon as every component it depends on is upgraded and healthy, whatever else its
    /// wave holds. With `approval: Manual` a plan runs by `Waves` (approvals are per wave).
    #[default]
    Dag,
    /// Also wait until the whole previous wave is upgraded.
    Waves,
}

fn default_max_concurrent() -> i32 {
    1
}

fn default_progress_deadline() -> i32 {
    600
}

impl Default for Strategy {
    fn default() -> Self {
        Self {
            max_concurrent: default_max_concurrent(),
            progress_deadline_seconds: default_progress_deadline(),
            failure_policy: FailurePolicy::default(),
            approval: Approval::default(),
            paused: false,
            scheduling: Scheduling::default(),
            maintenance_windows: Vec::new(),
        }
    }
}

/// What a plan does when a component fails (deadline passed, or the workload reports failure).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum FailurePolicy {
    /// Stop and wait for the user. Any later change to the spec retries the failed
    /// component; switching to `Rollback` rolls back.
    #[default]
    Pause,
    /// Revert every changed component to its recorded previous value, in reverse dependency
    /// order, and end `RolledBack`.
    Rollback,
}

/// Whether waves start on their own.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum Approval {
    #[default]
    Automatic,
    /// Wave N starts only once `spec.approvedWaves >= N`.
    Manual,
}

/// Observed state of an `UpgradePlan`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct UpgradePlanStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<PlanPhase>,
    /// The generation this status was computed from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// The dependency wave being upgraded (or rolled back), 1-based.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_wave: Option<i32>,
    /// Number of dependency waves.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waves: Option<i32>,
    /// Components upgraded / total, e.g. `2/4`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<String>,
    /// When the first component started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<MicroTime>,
    /// When the plan reached Succeeded, RolledBack or Failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<MicroTime>,
    /// What follows the components in flight: the next components to start (`api, worker
    /// (wave 2)`), or during a rollback `revert ...`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next: Option<String>,
    /// One entry per component, in spec order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub components: Vec<ComponentStatus>,
    /// `Valid`, `Ready`, `Progressing`, `Degraded`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

/// Where a plan is.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum PlanPhase {
    /// Not started (also while the plan is invalid or a target is missing).
    Pending,
    Progressing,
    /// `spec.strategy.paused`, or a component failed under `failurePolicy: Pause`.
    Paused,
    /// `approval: Manual` and the next wave is not approved yet.
    WaitingApproval,
    /// Outside every maintenance window: no component starts until the next one opens.
    WaitingWindow,
    /// Reverting changed components after a failure.
    RollingBack,
    Succeeded,
    /// A rollback could not complete; needs a human.
    Failed,
    RolledBack,
}

impl PlanPhase {
    /// Whether the plan is over (nothing more will happen).
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            PlanPhase::Succeeded | PlanPhase::Failed | PlanPhase::RolledBack
        )
    }

    pub fn as_str(self) -> &'static str {
        match self {
            PlanPhase::Pending => "Pending",
            PlanPhase::Progressing => "Progressing",
            PlanPhase::Paused => "Paused",
            PlanPhase::WaitingApproval => "WaitingApproval",
            PlanPhase::WaitingWindow => "WaitingWindow",
            PlanPhase::RollingBack => "RollingBack",
            PlanPhase::Succeeded => "Succeeded",
            PlanPhase::Failed => "Failed",
            PlanPhase::RolledBack => "RolledBack",
        }
    }
}

/// The state of one component. `previous` is recorded before the target is changed
/// (write-ahead), so a rollback restores exactly that value.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ComponentStatus {
    pub name: String,
    /// The component's dependency wave, 1-based.
    pub wave: i32,
    pub phase: ComponentPhase,
    /// The image or version before the change (a field's JSON text; outside `/spec` its
    /// `sha256:` digest; for a Secret a stand-in that shows nothing of it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous: Option<String>,
    /// The image or version the change sets (shown as `previous` is).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<MicroTime>,
    /// When the component became healthy (or failed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<MicroTime>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollback_started_at: Option<MicroTime>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rolled_back_at: Option<MicroTime>,
    /// The plan generation at which the component failed; a newer generation retries it
    /// (under `failurePolicy: Pause`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed_generation: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// The component's current (or last) hook Job.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hook: Option<HookRun>,
}

impl ComponentStatus {
    /// A component that has not started.
    pub fn pending(name: &str, wave: i32) -> Self {
        Self {
            name: name.to_string(),
            wave,
            phase: ComponentPhase::Pending,
            previous: None,
            target: None,
            started_at: None,
            finished_at: None,
            rollback_started_at: None,
            rolled_back_at: None,
            failed_generation: None,
            message: None,
            hook: None,
        }
    }
}

/// Where a component is.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum ComponentPhase {
    Pending,
    /// Previous value recorded; the change is applied and the workload is rolling.
    Progressing,
    /// Changed and healthy.
    Succeeded,
    /// Not healthy within the deadline, or the workload reported failure.
    Failed,
    /// Being reverted to `previous`.
    RollingBack,
    /// Reverted and healthy.
    RolledBack,
}

impl ComponentPhase {
    pub fn as_str(self) -> &'static str {
        match self {
            ComponentPhase::Pending => "Pending",
            ComponentPhase::Progressing => "Progressing",
            ComponentPhase::Succeeded => "Succeeded",
            ComponentPhase::Failed => "Failed",
            ComponentPhase::RollingBack => "RollingBack",
            ComponentPhase::RolledBack => "RolledBack",
        }
    }
}

impl Component {
    /// The value this component sets (image, version, or a field's JSON text), as its plan
    /// shows it ([`crate::redact`]: a digest outside `/spec`, a stand-in for a Secret), if its
    /// spec is consistent.
    pub fn desired(&self) -> Option<String> {
        if let Some(set) = &self.set {
            let text = set.value.to_string();
            let exposure = crate::redact::exposure(self);
            return Some(crate::redact::shown(exposure, &text, &text, None));
        }
        match self.target.typed() {
            Some(TargetKind::PostgresCluster) => self.version.clone(),
            Some(_) => self.image.as_ref().map(|i| i.image.clone()),
            None => None,
        }
    }

    /// The hook run at `stage`, if any.
    pub fn hook(&self, stage: HookStage) -> Option<&Hook> {
        let hooks = self.hooks.as_ref()?;
        match stage {
            HookStage::Before => hooks.before.as_ref(),
            HookStage::After => hooks.after.as_ref(),
        }
    }

    /// Whether a rollback reverts this component once changed.
    pub fn reverts(&self) -> bool {
        self.rollback.unwrap_or_default() == ComponentRollback::Revert
    }

    /// What changes, for messages: `Deployment web container app image`.
    pub fn describe(&self) -> String {
        let (kind, name) = (&self.target.kind, &self.target.name);
        match (&self.set, &self.image) {
            (Some(set), _) => format!("{kind} {name} {}", set.path),
            (None, _) if self.target.typed() == Some(TargetKind::PostgresCluster) => {
                format!("PostgresCluster {name} version")
            }
            (None, Some(i)) => format!("{kind} {name} container {} image", i.container),
            (None, None) => format!("{kind} {name}"),
        }
    }
}
