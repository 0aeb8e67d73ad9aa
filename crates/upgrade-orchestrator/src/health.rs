//! Health gates: whether a workload finished rolling out its current spec.
//!
//! Pure functions of the object as read, one per kind; the reconcile calls them each time a
//! watch event on the target (or the plan) wakes it. They judge the *current* spec: whether
//! that spec carries the component's new value is checked separately (see [`crate::progress`]).

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment, StatefulSet};
use serde_json::Value;

/// What a workload says about its rollout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Health {
    /// The current spec is fully rolled out and available.
    Healthy,
    /// Still rolling; the message says what is missing.
    Progressing(String),
    /// The workload itself reports that the rollout failed.
    Failed(String),
}

impl Health {
    pub fn is_healthy(&self) -> bool {
        matches!(self, Health::Healthy)
    }
}

/// Compiles a custom health expression.
///
/// # Errors
/// The parser's message (with the position).
pub fn compile(expression: &str) -> Result<cel::Program, String> {
    cel::Program::compile(expression).map_err(|e| e.to_string().trim().to_string())
}

/// A component's own rule ([`crate::crd::HealthCheck`]) over the target `obj` (`self`):
/// `failed` first, then `healthy`. An expression that cannot be evaluated yet (a field the
/// target does not have, as before its controller wrote a status) means still progressing.
pub fn custom(check: &crate::crd::HealthCheck, obj: &Value) -> Health {
    let evaluate = |expression: &str| -> Result<bool, String> {
        let program = compile(expression)?;
        let mut context = cel::Context::default();
        let target = cel::to_value(obj).map_err(|e| e.to_string())?;
        context
            .add_variable("self", target)
            .map_err(|e| e.to_string())?;
        match program.execute(&context) {
            Ok(cel::Value::Bool(b)) => Ok(b),
            Ok(other) => Err(format!("it gave {other:?}, not a bool")),
            Err(e) => Err(e.to_string()),
        }
    };
    if let Some(failed) = &check.failed {
        match evaluate(failed) {
            Ok(true) => return Health::Failed(format!("health.failed holds: {failed}")),
            Ok(false) => {}
            Err(e) => {
                return Health::Progressing(format!("health.failed cannot be evaluated yet: {e}"));
            }
        }
    }
    match evaluate(&check.healthy) {
        Ok(true) => Health::Healthy,
        Ok(false) => Health::Progressing(format!("waiting for health.healthy: {}", check.healthy)),
        Err(e) => Health::Progressing(format!("health.healthy cannot be evaluated yet: {e}")),
    }
}

fn generation_pending(
    generation: Option<i64>,
    observed: Option<i64>,
    controller: &str,
) -> Option<Health> {
    let generation = generation.unwrap_or(0);
    match observed {
        Some(o) if o >= generation => None,
        _ => Some(Health::Progressing(format!(
            "waiting for the {controller} controller to observe generation {generation} (observed {})",
            observed.map_or_else(|| "none".to_string(), |o| o.to_string())
        ))),
    }
}

/// A Deployment is healthy when its controller observed the current generation and the
/// updated, available and total replicas all equal the desired count. A `Progressing`
/// condition with reason `ProgressDeadlineExceeded` is a failure.
pub fn deployment(d: &Deployment) -> Health {
    let Some(status) = &d.status else {
        return Health::Progressing("no status yet".into());
    };
    if let Some(h) = generation_pending(
        d.metadata.generation,
        status.observed_generation,
        "deployment",
    ) {
        return h;
    }
    if let Some(c) = status.conditions.iter().flatten().find(|c| {
        c.type_.as_deref() == Some("Progressing")
            && c.reason.as_deref() == Some("ProgressDeadlineExceeded")
    }) {
        return Health::Failed(format!(
            "ProgressDeadlineExceeded: {}",
            c.message
                .as_deref()
                .unwrap_or("the deployment did not progress in time")
        ));
    }
    let desired = d.spec.replicas.unwrap_or(1);
    let updated = status.updated_replicas.unwrap_or(0);
    let available = status.available_replicas.unwrap_or(0);
    let total = status.replicas.unwrap_or(0);
    if updated < desired {
        return Health::Progressing(format!("{updated} of {desired} replicas updated"));
    }
    if total > updated {
        return Health::Progressing(format!(
            "{} old replicas pending termination",
            total - updated
        ));
    }
    if available < desired {
        return Health::Progressing(format!(
            "{available} of {desired} updated replicas available"
        ));
    }
    Health::Healthy
}

/// A StatefulSet is healthy when its controller observed the current generation,
/// `currentRevision == updateRevision` and every replica is ready (and updated).
pub fn statefulset(s: &StatefulSet) -> Health {
    let Some(status) = &s.status else {
        return Health::Progressing("no status yet".into());
    };
    if let Some(h) = generation_pending(
        s.metadata.generation,
        status.observed_generation,
        "statefulset",
    ) {
        return h;
    }
    let desired = s.spec.replicas.unwrap_or(1);
    let updated = status.updated_replicas.unwrap_or(0);
    let ready = status.ready_replicas.unwrap_or(0);
    if updated < desired {
        return Health::Progressing(format!("{updated} of {desired} replicas updated"));
    }
    if status.current_revision.is_none() || status.current_revision != status.update_revision {
        return Health::Progressing(format!(
            "currentRevision {} != updateRevision {}",
            status.current_revision.as_deref().unwrap_or("none"),
            status.update_revision.as_deref().unwrap_or("none")
        ));
    }
    if ready != desired {
        return Health::Progressing(format!("{ready} of {desired} replicas ready"));
    }
    Health::Healthy
}

/// A DaemonSet is healthy when its controller observed the current generation and the
/// updated, available and desired numbers of scheduled pods are equal.
pub fn daemonset(d: &DaemonSet) -> Health {
    let Some(status) = &d.status else {
        return Health::Progressing("no status yet".into());
    };
    if let Some(h) = generation_pending(
        d.metadata.generation,
        status.observed_generation,
        "daemonset",
    ) {
        return h;
    }
    let desired = status.desired_number_scheduled;
    let updated = status.updated_number_scheduled.unwrap_or(0);
    let available = status.number_available.unwrap_or(0);
    if updated != desired {
        return Health::Progressing(format!("{updated} of {desired} pods updated"));
    }
    if available != desired {
        return Health::Progressing(format!("{available} of {desired} pods available"));
    }
    Health::Healthy
}

/// A PostgresCluster (as JSON) is healthy when `status.observedGeneration` equals
/// `metadata.generation` and its `Ready` condition is `True` (and, when the condition carries
/// an `observedGeneration`, that is the current generation too).
/// Any other kind, by the conventions kstatus reads: an object with no status (a ConfigMap)
/// is healthy as soon as it is changed; one whose `status.observedGeneration` is behind
/// `metadata.generation` is progressing; a `Stalled=True` condition is a failure; a `Ready`
/// (or, failing that, `Available`) condition decides when present.
pub fn generic(obj: &Value) -> Health {
    let generation = obj.pointer("/metadata/generation").and_then(Value::as_i64);
    let observed = obj
        .pointer("/status/observedGeneration")
        .and_then(Value::as_i64);
    if let (Some(g), Some(o)) = (generation, observed)
        && o < g
    {
        return Health::Progressing(format!(
            "its controller observed generation {o}, not {g} yet"
        ));
    }
    let conditions = obj
        .pointer("/status/conditions")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default();
    let condition = |t: &str| {
        conditions
            .iter()
            .find(|c| c.get("type").and_then(Value::as_str) == Some(t))
    };
    let text = |c: &Value, key: &str| {
        c.get(key)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string()
    };
    if let Some(stalled) = condition("Stalled").filter(|c| text(c, "status") == "True") {
        return Health::Failed(format!(
            "Stalled: {} {}",
            text(stalled, "reason"),
            text(stalled, "message")
        ));
    }
    match condition("Ready").or_else(|| condition("Available")) {
        Some(c) if text(c, "status") == "True" => Health::Healthy,
        Some(c) => Health::Progressing(format!(
            "{}={}: {}",
            text(c, "type"),
            text(c, "status"),
            text(c, "reason")
        )),
        None => Health::Healthy,
    }
}

pub fn postgres(obj: &Value) -> Health {
    let generation = obj
        .pointer("/metadata/generation")
        .and_then(Value::as_i64)
        .unwrap_or(0);
    let observed = obj
        .pointer("/status/observedGeneration")
        .and_then(Value::as_i64);
    if observed != Some(generation) {
        return Health::Progressing(format!(
            "waiting for the database operator to observe generation {generation} (observed {})",
            observed.map_or_else(|| "none".to_string(), |o| o.to_string())
        ));
    }
    let ready = obj
        .pointer("/status/conditions")
        .and_then(Value::as_array)
        .and_then(|cs| {
            cs.iter()
                .find(|c| c.get("type").and_then(Value::as_str) == Some("Ready"))
        });
    let Some(ready) = ready else {
        return Health::Progressing("no Ready condition yet".into());
    };
    if let Some(cg) = ready.get("observedGeneration").and_then(Value::as_i64)
        && cg != generation
    {
        return Health::Progressing(format!(
            "Ready condition is for generation {cg}, not {generation}"
        ));
    }
    if ready.get("status").and_then(Value::as_str) == Some("True") {
        Health::Healthy
    } else {
        Health::Progressing(format!(
            "Ready={}: {}",
            ready
                .get("status")
                .and_then(Value::as_str)
                .unwrap_or("Unknown"),
            ready
                .get("message")
                .and_then(Value::as_str)
                .filter(|m| !m.is_empty())
                .or_else(|| ready.get("reason").and_then(Value::as_str))
                .unwrap_or("not ready")
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn deploy(generation: i64, status: Value) -> Deployment {
        serde_json::from_value(json!({
            "metadata": {"name": "web", "generation": generation},
            "spec": {"replicas": 3, "selector": {}, "template": {}},
            "status": status,
        }))
        .unwrap()
    }

    #[test]
    fn deployment_waits_for_the_controller_to_observe_the_generation() {
        let d = deploy(
            5,
            json!({"observedGeneration": 4, "replicas": 3, "updatedReplicas": 3, "availableReplicas": 3}),
        );
        assert!(matches!(deployment(&d), Health::Progressing(m) if m.contains("generation 5")));
    }

    #[test]
    fn deployment_needs_updated_available_and_desired_equal() {
        let healthy = json!({"observedGeneration": 2, "replicas": 3, "updatedReplicas": 3, "availableReplicas": 3});
        assert_eq!(deployment(&deploy(2, healthy)), Health::Healthy);
        let rolling = json!({"observedGeneration": 2, "replicas": 4, "updatedReplicas": 1, "availableReplicas": 3});
        assert!(
            matches!(deployment(&deploy(2, rolling)), Health::Progressing(m) if m == "1 of 3 replicas updated")
        );
        let old_left = json!({"observedGeneration": 2, "replicas": 4, "updatedReplicas": 3, "availableReplicas": 3});
        assert!(
            matches!(deployment(&deploy(2, old_left)), Health::Progressing(m) if m.contains("old replicas"))
        );
        let unavailable = json!({"observedGeneration": 2, "replicas": 3, "updatedReplicas": 3, "availableReplicas": 2});
        assert!(
            matches!(deployment(&deploy(2, unavailable)), Health::Progressing(m) if m.contains("2 of 3"))
        );
        assert!(matches!(
            deployment(&deploy(2, Value::Null)),
            Health::Progressing(_)
        ));
    }

    #[test]
    fn deployment_progress_deadline_exceeded_is_a_failure() {
        let status = json!({
            "observedGeneration": 2, "replicas": 4, "updatedReplicas": 1, "availableReplicas": 3,
            "conditions": [{"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
                            "message": "ReplicaSet \"web-2\" has timed out progressing."}]
        });
        assert!(
            matches!(deployment(&deploy(2, status)), Health::Failed(m) if m.contains("timed out"))
        );
    }

    #[test]
    fn deployment_defaults_to_one_replica() {
        let mut d = deploy(
            1,
            json!({"observedGeneration": 1, "replicas": 1, "updatedReplicas": 1, "availableReplicas": 1}),
        );
        d.spec.replicas = None;
        assert_eq!(deployment(&d), Health::Healthy);
    }

    fn sts(status: Value) -> StatefulSet {
        serde_json::from_value(json!({
            "metadata": {"name": "db", "generation": 3},
            "spec": {"replicas": 2, "selector": {}, "template": {}, "serviceName": "db"},
            "status": status,
        }))
        .unwrap()
    }

    #[test]
    fn statefulset_needs_revisions_equal_and_all_ready() {
        let healthy = json!({"observedGeneration": 3, "replicas": 2, "readyReplicas": 2, "updatedReplicas": 2,
                             "currentRevision": "db-2", "updateRevision": "db-2"});
        assert_eq!(statefulset(&sts(healthy)), Health::Healthy);
        let rolling = json!({"observedGeneration": 3, "replicas": 2, "readyReplicas": 2, "updatedReplicas": 2,
                             "currentRevision": "db-1", "updateRevision": "db-2"});
        assert!(matches!(statefulset(&sts(rolling)), Health::Progressing(m) if m.contains("db-1")));
        let not_ready = json!({"observedGeneration": 3, "replicas": 2, "readyReplicas": 1, "updatedReplicas": 2,
                               "currentRevision": "db-2", "updateRevision": "db-2"});
        assert!(
            matches!(statefulset(&sts(not_ready)), Health::Progressing(m) if m == "1 of 2 replicas ready")
        );
        let old_gen = json!({"observedGeneration": 2, "replicas": 2, "readyReplicas": 2, "updatedReplicas": 2,
                             "currentRevision": "db-2", "updateRevision": "db-2"});
        assert!(matches!(statefulset(&sts(old_gen)), Health::Progressing(_)));
    }

    fn ds(status: Value) -> DaemonSet {
        serde_json::from_value(json!({
            "metadata": {"name": "agent", "generation": 7},
            "spec": {"selector": {}, "template": {}},
            "status": status,
        }))
        .unwrap()
    }

    #[test]
    fn daemonset_needs_updated_available_desired_equal() {
        let base = |updated: i32, available: i32, gen_: i64| {
            json!({"observedGeneration": gen_, "currentNumberScheduled": 2, "desiredNumberScheduled": 2,
                   "numberMisscheduled": 0, "numberReady": available, "updatedNumberScheduled": updated,
                   "numberAvailable": available})
        };
        assert_eq!(daemonset(&ds(base(2, 2, 7))), Health::Healthy);
        assert!(
            matches!(daemonset(&ds(base(1, 2, 7))), Health::Progressing(m) if m == "1 of 2 pods updated")
        );
        assert!(
            matches!(daemonset(&ds(base(2, 1, 7))), Health::Progressing(m) if m == "1 of 2 pods available")
        );
        assert!(matches!(
            daemonset(&ds(base(2, 2, 6))),
            Health::Progressing(_)
        ));
    }

    #[test]
    fn a_custom_rule_decides_health_and_failure_over_the_target() {
        let check = crate::crd::HealthCheck {
            healthy: "self.status.observedGeneration == self.metadata.generation && self.status.conditions.exists(c, c.type == 'Ready' && c.status == 'True')".into(),
            failed: Some("self.status.conditions.exists(c, c.reason == 'Broken')".into()),
        };
        let obj = |generation: i64, observed: i64, reason: &str, status: &str| {
            json!({"metadata": {"generation": generation},
                   "status": {"observedGeneration": observed,
                              "conditions": [{"type": "Ready", "status": status, "reason": reason}]}})
        };
        assert_eq!(custom(&check, &obj(2, 2, "Done", "True")), Health::Healthy);
        assert!(
            matches!(custom(&check, &obj(2, 1, "Done", "True")), Health::Progressing(m) if m.starts_with("waiting for health.healthy"))
        );
        assert!(
            matches!(custom(&check, &obj(2, 2, "Broken", "False")), Health::Failed(m) if m.contains("Broken"))
        );
        assert!(matches!(
            custom(&check, &json!({"metadata": {"generation": 1}})),
            Health::Progressing(m) if m.contains("cannot be evaluated yet")
        ));
        let not_bool = crate::crd::HealthCheck {
            healthy: "1 + 1".into(),
            failed: None,
        };
        assert!(
            matches!(custom(&not_bool, &json!({})), Health::Progressing(m) if m.contains("not a bool"))
        );
        assert!(compile("self.status.(").is_err());
    }

    #[test]
    fn postgres_is_healthy_only_when_ready_at_its_generation() {
        let pg = |observed: i64, ready: &str, cond_gen: i64| {
            json!({"metadata": {"generation": 4},
                   "status": {"observedGeneration": observed,
                              "conditions": [{"type": "Ready", "status": ready, "reason": "Upgrading",
                                              "message": "", "observedGeneration": cond_gen}]}})
        };
        assert_eq!(postgres(&pg(4, "True", 4)), Health::Healthy);
        assert!(
            matches!(postgres(&pg(3, "True", 3)), Health::Progressing(_)),
            "stale status"
        );
        assert!(
            matches!(postgres(&pg(4, "True", 3)), Health::Progressing(_)),
            "stale condition"
        );
        assert!(
            matches!(postgres(&pg(4, "False", 4)), Health::Progressing(m) if m == "Ready=False: Upgrading")
        );
        assert!(matches!(
            postgres(&json!({"metadata": {"generation": 1}})),
            Health::Progressing(_)
        ));
    }

    #[test]
    fn other_kinds_follow_kstatus_conventions() {
        assert_eq!(
            generic(&json!({"data": {"a": "1"}})),
            Health::Healthy,
            "no status"
        );
        let obj = |observed: i64, conditions: Value| {
            json!({"metadata": {"generation": 3},
                   "status": {"observedGeneration": observed, "conditions": conditions}})
        };
        assert!(matches!(
            generic(&obj(2, json!([]))),
            Health::Progressing(_)
        ));
        assert_eq!(generic(&obj(3, json!([]))), Health::Healthy);
        assert_eq!(
            generic(&obj(3, json!([{"type": "Ready", "status": "True"}]))),
            Health::Healthy
        );
        assert_eq!(
            generic(&obj(
                3,
                json!([{"type": "Ready", "status": "False", "reason": "Syncing"}])
            )),
            Health::Progressing("Ready=False: Syncing".into())
        );
        assert!(matches!(
            generic(&obj(3, json!([{"type": "Stalled", "status": "True", "reason": "BadConfig"}]))),
            Health::Failed(m) if m.contains("BadConfig")
        ));
    }
}
