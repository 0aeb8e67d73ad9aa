//! Health gates: whether a workload finished rolling out its current spec.
//!
//! Pure functions of the object as read, one per kind; the reconcile calls them each time a
//! watch event on the target (or the plan) wakes it. They judge the *current* spec: whether
//! that spec carries the component's new value is checked separately (see [`crate::progress`]).
//!
//! # Custom rules: a budget, and never on the async workers
//!
//! A component's own rules (`health: {healthy, failed}`, CEL over the target) are checked
//! before the plan starts ([`check`]): they must parse, nest at most [`MAX_DEPTH`] deep, and
//! cost at most [`MAX_COST`] by a static [`estimate`] (comprehensions multiply the cost of
//! their body by the size of their list, so `L.all(a, L.all(b, ...))` over a literal list of
//! 40 grows as 40^n); otherwise the plan is `Valid=False InvalidHealthCheck` saying which
//! limit. Parsing runs on a thread with a large stack, so no nesting can overflow a worker's.
//! They are evaluated ([`bounded`]) on a thread of their own, one evaluation at a time, with a
//! time limit ([`EVALUATION_LIMIT`]); the reconcile's async workers only wait for the answer.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

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

/// The most a custom health expression may cost, by [`estimate`]: about a million steps of
/// evaluation (the Kubernetes API server's per-expression runtime limit is the same figure).
pub const MAX_COST: u64 = 1_000_000;
/// The deepest a custom health expression's syntax tree may be (its parentheses, brackets,
/// calls and operators nested in one another; a macro such as `all` counts a few levels).
pub const MAX_DEPTH: usize = 64;
/// The most parentheses and brackets a custom health expression may nest ([`nesting`]).
pub const MAX_NESTING: usize = 32;
/// How many elements [`estimate`] assumes a list or map of the target (or any list whose
/// length is not written in the expression) has.
pub const ASSUMED_SIZE: u64 = 100;
/// How long one evaluation of a component's health rules may take, and the longest it waits
/// for the evaluator (one evaluation runs at a time).
pub const EVALUATION_LIMIT: Duration = Duration::from_secs(1);
/// The stack of the threads that parse and evaluate expressions: far more than a tree of
/// [`MAX_DEPTH`] needs, and enough for the parser on the deepest 4 096 characters can nest
/// before its own limit stops it.
pub const STACK: usize = 64 << 20;

/// Checks a custom health expression: it parses, its syntax tree is at most [`MAX_DEPTH`]
/// deep and its [`estimate`] is at most [`MAX_COST`]. The parse runs on a thread of its own
/// with a large stack ([`STACK`]), so no expression can overflow the caller's; results are
/// remembered by text, so a plan's rules are parsed once, not on every reconcile.
///
/// # Errors
/// The parser's message (with the position), or which limit the expression exceeds.
pub fn check(expression: &str) -> Result<(), String> {
    static CHECKED: Mutex<BTreeMap<String, Result<(), String>>> = Mutex::new(BTreeMap::new());
    if let Some(known) = lock(&CHECKED).get(expression) {
        return known.clone();
    }
    let text = expression.to_string();
    let result = on_big_stack(move || compile(&text).map(drop))
        .unwrap_or_else(|| Err("the expression could not be checked".to_string()));
    let mut checked = lock(&CHECKED);
    if checked.len() >= 4096 {
        checked.clear();
    }
    checked.insert(expression.to_string(), result.clone());
    result
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Runs `f` on a thread with a [`STACK`]-sized stack and waits for it; `None` if the thread
/// could not be started or panicked.
fn on_big_stack<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    std::thread::Builder::new()
        .name("health-cel".into())
        .stack_size(STACK)
        .spawn(f)
        .ok()?
        .join()
        .ok()
}

/// Compiles a custom health expression within the limits of [`check`]. Call it on a thread
/// with a [`STACK`]-sized stack: the parser recurses as deep as the expression nests.
///
/// # Errors
/// As [`check`].
fn compile(expression: &str) -> Result<cel::Program, String> {
    let brackets = nesting(expression);
    if brackets > MAX_NESTING {
        return Err(format!(
            "it nests {brackets} levels of parentheses and brackets, more than {MAX_NESTING}"
        ));
    }
    let program =
        cel::Program::compile(expression).map_err(|e| e.to_string().trim().to_string())?;
    let cost = estimate(program.expression())?;
    if cost > MAX_COST {
        return Err(format!(
            "its estimated cost {cost} exceeds the budget of {MAX_COST} (comprehensions such as all, exists and map multiply the cost of their body by the size of their list: {ASSUMED_SIZE} elements assumed for a list of the target, the number written for a literal list)"
        ));
    }
    Ok(program)
}

/// How deep `expression` nests parentheses and brackets, read before it is parsed (quoted
/// text skipped, as far as a simple scan can tell: the parse is safe anyway, on its own
/// thread with a large stack; this refuses deep nesting early and cheaply).
pub fn nesting(expression: &str) -> usize {
    let (mut depth, mut deepest) = (0usize, 0usize);
    let mut quote: Option<char> = None;
    let mut escaped = false;
    for ch in expression.chars() {
        match (quote, ch) {
            (Some(_), _) if escaped => escaped = false,
            (Some(_), '\\') => escaped = true,
            (Some(q), c) if c == q => quote = None,
            (Some(_), _) => {}
            (None, '\'' | '"') => quote = Some(ch),
            (None, '(' | '[' | '{') => {
                depth += 1;
                deepest = deepest.max(depth);
            }
            (None, ')' | ']' | '}') => depth = depth.saturating_sub(1),
            (None, _) => {}
        }
    }
    deepest
}

/// A static estimate of the cost of evaluating `expr`, like the API server's estimate for its
/// CEL rules: one per node of the syntax tree, a comprehension (`all`, `exists`,
/// `exists_one`, `map`, `filter`) costing its body once per element of its list (the
/// number of elements of a list or map literal; [`ASSUMED_SIZE`] for any other list, such as
/// one of the target), `x in list` the list's size. Pure.
///
/// # Errors
/// The tree is deeper than [`MAX_DEPTH`].
pub fn estimate(expr: &cel::IdedExpr) -> Result<u64, String> {
    walk(expr, 0).map(|e| e.cost)
}

/// The cost of evaluating an expression and, if it is a list or map, its size.
#[derive(Clone, Copy)]
struct Estimate {
    cost: u64,
    size: u64,
}

fn walk(expr: &cel::IdedExpr, depth: usize) -> Result<Estimate, String> {
    use cel::common::ast::{Expr, operators};
    if depth > MAX_DEPTH {
        return Err(format!(
            "it nests deeper than {MAX_DEPTH} levels (parentheses, brackets, calls and operators inside one another)"
        ));
    }
    let sum =
        |exprs: &mut dyn Iterator<Item = &cel::IdedExpr>| -> Result<(u64, Vec<Estimate>), String> {
            let mut cost = 1u64;
            let mut parts = Vec::new();
            for e in exprs {
                let part = walk(e, depth + 1)?;
                cost = cost.saturating_add(part.cost);
                parts.push(part);
            }
            Ok((cost, parts))
        };
    let count = |n: usize| u64::try_from(n).unwrap_or(u64::MAX);
    Ok(match &expr.expr {
        Expr::Unspecified | Expr::Literal(_) => Estimate { cost: 1, size: 1 },
        Expr::Ident(_) => Estimate {
            cost: 1,
            size: ASSUMED_SIZE,
        },
        Expr::Select(select) => Estimate {
            cost: walk(&select.operand, depth + 1)?.cost.saturating_add(1),
            size: ASSUMED_SIZE,
        },
        Expr::List(list) => Estimate {
            cost: sum(&mut list.elements.iter())?.0,
            size: count(list.elements.len()),
        },
        Expr::Map(map) => Estimate {
            cost: sum(&mut entries(&map.entries))?.0,
            size: count(map.entries.len()),
        },
        Expr::Struct(structure) => Estimate {
            cost: sum(&mut entries(&structure.entries))?.0,
            size: 1,
        },
        Expr::Call(call) => {
            let (cost, parts) = sum(&mut call.target.iter().map(|t| &**t).chain(&call.args))?;
            match call.func_name.as_str() {
                // Concatenating lists: as long as both.
                operators::ADD => Estimate {
                    cost,
                    size: parts.iter().fold(0u64, |n, p| n.saturating_add(p.size)),
                },
                // A search through the list (or map).
                operators::IN => Estimate {
                    cost: cost.saturating_add(parts.last().map_or(0, |p| p.size)),
                    size: 1,
                },
                _ => Estimate {
                    cost,
                    size: ASSUMED_SIZE,
                },
            }
        }
        Expr::Comprehension(c) => {
            let range = walk(&c.iter_range, depth + 1)?;
            let once = [&c.accu_init, &c.result]
                .into_iter()
                .map(|e| walk(e, depth + 1).map(|e| e.cost))
                .try_fold(range.cost.saturating_add(1), |n, c| {
                    c.map(|c| n.saturating_add(c))
                })?;
            let step = walk(&c.loop_cond, depth + 1)?
                .cost
                .saturating_add(walk(&c.loop_step, depth + 1)?.cost);
            Estimate {
                cost: once.saturating_add(range.size.saturating_mul(step)),
                size: range.size,
            }
        }
    })
}

/// The expressions of a map's or struct's entries.
fn entries(entries: &[cel::common::ast::IdedEntryExpr]) -> impl Iterator<Item = &cel::IdedExpr> {
    use cel::common::ast::EntryExpr;
    entries.iter().flat_map(|entry| match &entry.expr {
        EntryExpr::MapEntry(e) => vec![&e.key, &e.value],
        EntryExpr::StructField(f) => vec![&f.value],
    })
}

/// A component's own rule ([`crate::crd::HealthCheck`]) over the target `obj`, evaluated off
/// the async workers: on a thread of its own (with a [`STACK`]-sized stack), one at a time
/// (so runaway evaluations can take one core at most, never the async workers that renew the
/// Lease and answer probes), within [`EVALUATION_LIMIT`] (after waiting at most as long for
/// the evaluator: a busy evaluator is reported as progressing). `quote_errors`: whether an
/// evaluation error may be shown as it is (it may quote the target's data); see [`custom`].
///
/// An evaluation that does not finish in time is reported as progressing, and its rules are
/// remembered as too slow ([`too_slow`]): a plan that has not started yet is then
/// `Valid=False`, and they are not evaluated again (until the orchestrator restarts).
///
/// # Caveats
/// A thread cannot be stopped: an evaluation past its limit still runs to its end, holding
/// the evaluator. [`check`]'s budget bounds how long that is (the estimate assumes lists of
/// the target hold [`ASSUMED_SIZE`] elements; a target with far longer lists takes
/// proportionally longer).
pub async fn bounded(check: &crate::crd::HealthCheck, obj: Value, quote_errors: bool) -> Health {
    bounded_within(check, obj, quote_errors, EVALUATION_LIMIT).await
}

/// [`bounded`] with the time limit `limit`.
async fn bounded_within(
    check: &crate::crd::HealthCheck,
    obj: Value,
    quote_errors: bool,
    limit: Duration,
) -> Health {
    static EVALUATOR: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(1);
    let expressions = || std::iter::once(&check.healthy).chain(check.failed.as_ref());
    if let Some(slow) = expressions().find(|e| too_slow(e)) {
        return Health::Progressing(slow_message(slow));
    }
    let Ok(Ok(permit)) = tokio::time::timeout(limit, EVALUATOR.acquire()).await else {
        return Health::Progressing(format!(
            "{BUSY}, busy for over {}s with another expression",
            limit.as_secs_f64()
        ));
    };
    let (tx, rx) = tokio::sync::oneshot::channel();
    let rules = check.clone();
    let spawned = std::thread::Builder::new()
        .name("health-cel".into())
        .stack_size(STACK)
        .spawn(move || {
            let health = custom(&rules, &obj, quote_errors);
            drop(permit);
            let _ = tx.send(health);
        });
    if let Err(e) = spawned {
        return Health::Progressing(format!("the health rules cannot be evaluated: {e}"));
    }
    match tokio::time::timeout(limit, rx).await {
        Ok(Ok(health)) => health,
        Ok(Err(_)) => Health::Progressing("the evaluation of the health rules failed".into()),
        Err(_) => {
            let mut slow = lock(&SLOW);
            // At most one a second can be added (one evaluation at a time); bounded anyway.
            if slow.len() < 4096 {
                slow.extend(expressions().cloned());
            }
            Health::Progressing(slow_message(&check.healthy))
        }
    }
}

/// How the health of a component whose rules wait for the evaluator starts.
const BUSY: &str = "the health rules wait for the evaluator";

/// Whether `health` says the rules could not be evaluated because the evaluator was busy
/// (the reconcile then looks again within [`EVALUATION_LIMIT`]).
pub fn is_busy(health: &Health) -> bool {
    matches!(health, Health::Progressing(m) if m.starts_with(BUSY))
}

/// Expressions whose evaluation outlived [`EVALUATION_LIMIT`].
static SLOW: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());

/// Whether an evaluation of `expression` outlived [`EVALUATION_LIMIT`] (since the
/// orchestrator started).
pub fn too_slow(expression: &str) -> bool {
    lock(&SLOW).contains(expression)
}

fn slow_message(expression: &str) -> String {
    let short: String = expression.chars().take(80).collect();
    format!(
        "evaluating the health rules took over {}s (the limit) on this target: not evaluated again; change the expression ({short}...)",
        EVALUATION_LIMIT.as_secs_f64()
    )
}

/// A component's own rule ([`crate::crd::HealthCheck`]) over the target `obj` (`self`):
/// `failed` first, then `healthy`. An expression that cannot be evaluated yet (a field the
/// target does not have, as before its controller wrote a status) means still progressing;
/// the evaluation error is shown only if `quote_errors` (it may quote the target's data, see
/// [`crate::redact`]). Synchronous and unbounded: call [`bounded`] instead, or call it on a
/// thread with a [`STACK`]-sized stack.
pub fn custom(check: &crate::crd::HealthCheck, obj: &Value, quote_errors: bool) -> Health {
    let evaluate = |expression: &str| -> Result<bool, String> {
        let program = compile(expression)?;
        let mut context = cel::Context::default();
        let target = cel::to_value(obj).map_err(|e| e.to_string())?;
        context
            .add_variable("self", target)
            .map_err(|e| e.to_string())?;
        match program.execute(&context) {
            Ok(cel::Value::Bool(b)) => Ok(b),
            Ok(other) if quote_errors => Err(format!("it gave {other:?}, not a bool")),
            Ok(_) => Err("it did not give a bool".into()),
            Err(e) if quote_errors => Err(e.to_string()),
            Err(_) => Err(
                "(the error is not shown: it may quote the target's data, which this plan does not publish)"
                    .into(),
            ),
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
        assert_eq!(
            custom(&check, &obj(2, 2, "Done", "True"), true),
            Health::Healthy
        );
        assert!(
            matches!(custom(&check, &obj(2, 1, "Done", "True"), true), Health::Progressing(m) if m.starts_with("waiting for health.healthy"))
        );
        assert!(
            matches!(custom(&check, &obj(2, 2, "Broken", "False"), true), Health::Failed(m) if m.contains("Broken"))
        );
        assert!(matches!(
            custom(&check, &json!({"metadata": {"generation": 1}}), true),
            Health::Progressing(m) if m.contains("cannot be evaluated yet")
        ));
        let not_bool = crate::crd::HealthCheck {
            healthy: "1 + 1".into(),
            failed: None,
        };
        assert!(
            matches!(custom(&not_bool, &json!({}), true), Health::Progressing(m) if m.contains("not a bool"))
        );
        assert!(crate::health::check("self.status.(").is_err());
        // A rule over a target whose data the plan does not show: errors quote none of it.
        let quoting = crate::crd::HealthCheck {
            healthy: "self.data.password + 1 == 2".into(),
            failed: None,
        };
        let secret = json!({"data": {"password": "aHVudGVyMg=="}});
        assert!(
            matches!(custom(&quoting, &secret, true), Health::Progressing(m) if m.contains("aHVudGVyMg=="))
        );
        assert!(
            matches!(custom(&quoting, &secret, false), Health::Progressing(m) if !m.contains("aHVudGVyMg==") && m.contains("not shown"))
        );
    }

    /// The reproduction of issue #39: five comprehensions nested over a literal list of 40.
    fn pathological() -> String {
        let list = format!(
            "[{}]",
            (0..40)
                .map(|i| i.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        );
        format!(
            "{list}.all(a, {list}.all(b, {list}.all(c, {list}.all(d, {list}.all(e, a+b+c+d+e >= 0)))))"
        )
    }

    #[test]
    fn nested_comprehensions_over_literal_lists_exceed_the_budget() {
        let expression = pathological();
        let err = check(&expression).unwrap_err();
        assert!(err.contains("exceeds the budget"), "{err}");
        let cost = |e: &str| estimate(cel::Program::compile(e).unwrap().expression()).unwrap();
        // 40^5 iterations of the innermost body.
        assert!(cost(&expression) > 40u64.pow(5), "{}", cost(&expression));
        // Each level multiplies by the list's length.
        let level = |n: usize| {
            let mut e = "true".to_string();
            for v in 0..n {
                e = format!("[1, 2, 3, 4, 5, 6, 7, 8, 9, 10].all(x{v}, {e})");
            }
            cost(&e)
        };
        assert!(level(2) > 10 * level(1) && level(3) > 10 * level(2));
        assert!(level(5) <= MAX_COST && level(6) > MAX_COST);
        // Lists of the target are assumed to hold ASSUMED_SIZE elements.
        let over_target = cost("self.items.all(a, a.ports.all(p, p.port > 0))");
        assert!(
            over_target > ASSUMED_SIZE * ASSUMED_SIZE && over_target <= MAX_COST,
            "{over_target}"
        );
        assert!(cost("self.a.all(x, self.b.all(y, self.c.all(z, x + y + z > 0)))") > MAX_COST);
        // `in` searches its list.
        assert!(cost("1 in self.items") > ASSUMED_SIZE);
        // The rules of docs/upgrades.md and the tests are well within it.
        for ordinary in [
            "self.status.observedGeneration == self.metadata.generation && self.status.conditions.exists(c, c.type == 'Ready' && c.status == 'True')",
            "has(self.metadata.annotations) && 'verified' in self.metadata.annotations && self.metadata.annotations['verified'] == self.spec.template.spec.containers[0].image",
        ] {
            assert_eq!(check(ordinary), Ok(()), "{ordinary}");
            assert!(
                cost(ordinary) < MAX_COST / 100,
                "{ordinary}: {}",
                cost(ordinary)
            );
        }
    }

    #[test]
    fn nesting_is_counted_outside_quoted_text() {
        assert_eq!(nesting("self.a"), 0);
        assert_eq!(nesting("size([1, (2)]) > 0 && {'a': [1]}.size() == 1"), 3);
        assert_eq!(nesting("'(((' + \"[[[\" + 'it\\'s ((' == ''"), 0);
        assert_eq!(
            nesting(&format!("{}1{}", "[".repeat(40), "]".repeat(40))),
            40
        );
        let too_deep = format!("{}1{} == [1]", "[".repeat(33), "]".repeat(33));
        let err = check(&too_deep).unwrap_err();
        assert!(err.contains("33 levels"), "{err}");
    }

    #[test]
    fn deep_nesting_is_refused_without_overflowing_a_stack() {
        let short = |e: &str| e.chars().take(40).collect::<String>();
        let cases = [
            // Brackets, counted before parsing.
            (
                format!("{}true{}", "(".repeat(2000), ")".repeat(2000)),
                Some("levels of parentheses"),
            ),
            (
                format!("{}1{}.size() > 0", "[".repeat(2000), "]".repeat(2000)),
                Some("levels of parentheses"),
            ),
            (
                format!("{}1{}", "size([".repeat(500), "])".repeat(500)),
                Some("levels of parentheses"),
            ),
            (
                format!("{}true", "!(".repeat(1000)),
                Some("levels of parentheses"),
            ),
            (
                format!("{}1", "(true ? ".repeat(500)),
                Some("levels of parentheses"),
            ),
            // Chains without brackets nest the syntax tree as deep (parsed on the big stack).
            (
                format!("1{} > 0", " + 1".repeat(1000)),
                Some("deeper than 64"),
            ),
            (
                format!("self{} == 1", ".a".repeat(2000)),
                Some("deeper than 64"),
            ),
            // Runs of unary operators fold into a node or two: harmless, accepted.
            (format!("{}true", "!".repeat(4000)), None),
            (format!("{}1 > 0", "-".repeat(4000)), None),
        ];
        for (expression, refused) in &cases {
            assert!(expression.len() <= 4096);
            match (check(expression), refused) {
                (Err(err), Some(why)) => assert!(err.contains(why), "{}: {err}", short(expression)),
                (Ok(()), None) => {}
                (result, _) => panic!("{}: {result:?}", short(expression)),
            }
        }
        // Within the depth: accepted.
        let nested = format!("{}true{}", "(".repeat(20), ")".repeat(20));
        assert_eq!(check(&nested), Ok(()));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_evaluation_past_its_limit_is_reported_and_remembered() {
        let rules = |healthy: &str| crate::crd::HealthCheck {
            healthy: healthy.into(),
            failed: None,
        };
        let items: Vec<i64> = (0..2000).collect();
        let obj = json!({"items": items});
        let quick = rules("self.items.exists(i, i == 1999)");
        let start = std::time::Instant::now();
        assert_eq!(bounded(&quick, obj.clone(), true).await, Health::Healthy);
        assert!(start.elapsed() < EVALUATION_LIMIT);
        // Within the static budget (lists of the target are assumed to hold 100), but 4 million
        // steps on this one: past a 20 ms limit.
        let slow = rules("self.items.all(a, self.items.all(b, a + b >= 0))");
        assert_eq!(check(&slow.healthy), Ok(()));
        let limit = Duration::from_millis(20);
        let start = std::time::Instant::now();
        let health = bounded_within(&slow, obj.clone(), true, limit).await;
        let took = start.elapsed();
        assert!(
            matches!(&health, Health::Progressing(m) if m.contains("not evaluated again")),
            "{health:?}"
        );
        assert!(took < limit * 10, "answered after {took:?}");
        // The timed-out evaluation still holds the evaluator: another waits, then says so.
        let other = bounded_within(&quick, obj.clone(), true, limit).await;
        assert!(is_busy(&other), "{other:?}");
        assert!(!is_busy(&health));
        assert!(too_slow(&slow.healthy) && !too_slow(&quick.healthy));
        // Not evaluated again: answered at once.
        let start = std::time::Instant::now();
        assert_eq!(bounded(&slow, obj, true).await, health);
        assert!(start.elapsed() < limit);
        // A plan that has not started with that rule is invalid.
        let mut component: crate::crd::Component = serde_json::from_value(json!({
            "name": "c", "target": {"kind": "Deployment", "name": "d"},
            "image": {"container": "app", "image": "app:2"}
        }))
        .unwrap();
        assert_eq!(
            crate::plan::slow_health(std::slice::from_ref(&component)),
            Ok(())
        );
        component.health = Some(slow);
        let invalid = crate::plan::slow_health(&[component]).unwrap_err();
        assert_eq!(invalid.reason(), "InvalidHealthCheck");
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
