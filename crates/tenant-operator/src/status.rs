//! Status: computed in one place from what a reconcile observed and did (pure), written once.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use std::collections::BTreeMap;

use steward_core::conditions;

use crate::crd::{QUOTA_EXCEEDED, QuotaStatus, TenantPhase, TenantStatus};
use crate::quantity::Milli;

/// Something that keeps the tenant from being Ready.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    /// CamelCase reason.
    pub reason: &'static str,
    pub message: String,
}

/// What a reconcile found.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Observation {
    pub generation: Option<i64>,
    /// The tenant's usable namespaces, sorted.
    pub namespaces: Vec<String>,
    /// Those of them the tenant adopted (they existed before), sorted.
    pub adopted: Vec<String>,
    /// Tenant-wide limits (empty without `tenantQuota`).
    pub tenant_hard: BTreeMap<String, Milli>,
    /// Per-namespace limits (empty without `resourceQuota`).
    pub namespace_hard: BTreeMap<String, Milli>,
    /// Usage per namespace, from the ResourceQuotas.
    pub used: BTreeMap<String, BTreeMap<String, Milli>>,
    /// The hard limits each namespace's ResourceQuota was given (the tenant-wide split).
    pub split: BTreeMap<String, BTreeMap<String, Milli>>,
    pub problems: Vec<Problem>,
    /// The reconcile's error, if it failed: `(reason, message)`.
    pub error: Option<(String, String)>,
    pub cordoned: bool,
    pub deleting: bool,
}

fn reached(used: Milli, hard: Milli) -> bool {
    used > hard || (used == hard && hard > Milli::ZERO)
}

/// Where the tenant-wide limit leaves a namespace less than `resourceQuota` promises, what each
/// namespace got: `pods: the tenant's 10 are shared, a 5, b 5 (resourceQuota 50 each)`. Empty
/// when the per-namespace limits hold as written.
fn shared_below_per_namespace(obs: &Observation) -> String {
    let mut notes = Vec::new();
    for (r, tenant) in &obs.tenant_hard {
        let Some(per_ns) = obs.namespace_hard.get(r) else {
            continue;
        };
        let given: Vec<(&String, Milli)> = obs
            .split
            .iter()
            .filter_map(|(ns, hard)| hard.get(r).map(|h| (ns, *h)))
            .collect();
        if given.iter().all(|(_, h)| h >= per_ns) {
            continue;
        }
        let each = given
            .iter()
            .map(|(ns, h)| format!("{ns} {}", h.format_for(r)))
            .collect::<Vec<_>>()
            .join(", ");
        notes.push(format!(
            "{r}: the tenant's {} are shared, {each} (resourceQuota {} each)",
            tenant.format_for(r),
            per_ns.format_for(r)
        ));
    }
    notes.join("; ")
}

/// The status for `obs`, keeping condition transition times from `previous`.
pub fn compute(previous: Option<&TenantStatus>, obs: &Observation) -> TenantStatus {
    let mut conds = previous.map(|p| p.conditions.clone()).unwrap_or_default();
    let generation = obs.generation;
    let ready = set_ready(&mut conds, obs);
    let total = usage(obs);
    let has_quota = !obs.tenant_hard.is_empty() || !obs.namespace_hard.is_empty();
    set_quota_exceeded(&mut conds, obs, &total);

    let phase = if obs.deleting {
        TenantPhase::Terminating
    } else if !ready {
        TenantPhase::Degraded
    } else if obs.cordoned {
        TenantPhase::Cordoned
    } else {
        TenantPhase::Active
    };
    TenantStatus {
        observed_generation: generation,
        phase: Some(phase),
        namespaces: obs.namespaces.clone(),
        namespace_count: i32::try_from(obs.namespaces.len()).unwrap_or(i32::MAX),
        adopted_namespaces: obs.adopted.clone(),
        quota: has_quota.then(|| QuotaStatus {
            hard: obs
                .tenant_hard
                .iter()
                .map(|(k, v)| (k.clone(), v.format_for(k)))
                .collect(),
            used: total
                .iter()
                .map(|(k, v)| (k.clone(), v.format_for(k)))
                .collect(),
        }),
        conditions: conds,
    }
}

/// Sets `Ready` from the failed step or the problems found (all of them, the first one's
/// reason); returns whether the tenant is ready.
fn set_ready(conds: &mut Vec<Condition>, obs: &Observation) -> bool {
    let generation = obs.generation;
    let ready = obs.error.is_none() && obs.problems.is_empty();
    match (&obs.error, obs.problems.first()) {
        (Some((reason, message)), _) => {
            conditions::set(
                conds,
                conditions::READY,
                false,
                reason,
                message.clone(),
                generation,
            );
        }
        (None, Some(first)) => {
            let message = obs
                .problems
                .iter()
                .map(|p| p.message.as_str())
                .collect::<Vec<_>>()
                .join("; ");
            conditions::set(
                conds,
                conditions::READY,
                false,
                first.reason,
                message,
                generation,
            );
        }
        (None, None) => {
            let n = obs.namespaces.len();
            let message = format!("{n} namespace{} reconciled", if n == 1 { "" } else { "s" });
            conditions::set(
                conds,
                conditions::READY,
                true,
                "Reconciled",
                message,
                generation,
            );
        }
    }
    ready
}

/// What the tenant uses of each resource, summed over its namespaces; a limited resource
/// nobody uses yet counts 0.
fn usage(obs: &Observation) -> BTreeMap<String, Milli> {
    let mut total: BTreeMap<String, Milli> = BTreeMap::new();
    for per_ns in obs.used.values() {
        for (r, v) in per_ns {
            let e = total.entry(r.clone()).or_default();
            *e = e.saturating_add(*v);
        }
    }
    // A limited resource nobody uses yet is reported as 0 before kube-controller-manager has
    // filled the quotas' usage, so its first report does not change the status again.
    for r in obs.tenant_hard.keys().chain(obs.namespace_hard.keys()) {
        total.entry(r.clone()).or_default();
    }
    total
}

/// Sets `QuotaExceeded`: every limit reached, across the tenant or in one namespace.
fn set_quota_exceeded(
    conds: &mut Vec<Condition>,
    obs: &Observation,
    total: &BTreeMap<String, Milli>,
) {
    let generation = obs.generation;
    let mut exceeded = Vec::new();
    for (r, hard) in &obs.tenant_hard {
        let used = total.get(r).copied().unwrap_or_default();
        if reached(used, *hard) {
            exceeded.push(format!(
                "{r} {}/{} across the tenant",
                used.format_for(r),
                hard.format_for(r)
            ));
        }
    }
    for (ns, per_ns) in &obs.used {
        for (r, hard) in &obs.namespace_hard {
            let used = per_ns.get(r).copied().unwrap_or_default();
            if reached(used, *hard) {
                exceeded.push(format!(
                    "{r} {}/{} in {ns}",
                    used.format_for(r),
                    hard.format_for(r)
                ));
            }
        }
    }
    if exceeded.is_empty() {
        conditions::set(
            conds,
            QUOTA_EXCEEDED,
            false,
            "WithinLimits",
            shared_below_per_namespace(obs),
            generation,
        );
    } else {
        conditions::set(
            conds,
            QUOTA_EXCEEDED,
            true,
            "LimitReached",
            exceeded.join(", "),
            generation,
        );
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn obs() -> Observation {
        Observation {
            generation: Some(3),
            namespaces: vec!["a".into(), "b".into()],
            tenant_hard: BTreeMap::from([("pods".into(), Milli::units(4))]),
            used: BTreeMap::from([
                (
                    "a".into(),
                    BTreeMap::from([("pods".into(), Milli::units(1))]),
                ),
                (
                    "b".into(),
                    BTreeMap::from([("pods".into(), Milli::units(2))]),
                ),
            ]),
            ..Default::default()
        }
    }

    #[test]
    fn ready_tenant_sums_usage() {
        let s = compute(None, &obs());
        assert_eq!(s.phase, Some(TenantPhase::Active));
        assert_eq!(s.namespace_count, 2);
        assert_eq!(s.observed_generation, Some(3));
        assert!(conditions::is_true(&s.conditions, conditions::READY));
        assert!(!conditions::is_true(&s.conditions, QUOTA_EXCEEDED));
        let q = s.quota.unwrap();
        assert_eq!(q.used["pods"], "3");
        assert_eq!(q.hard["pods"], "4");
    }

    #[test]
    fn reaching_the_tenant_limit_sets_quota_exceeded() {
        let mut o = obs();
        o.used
            .get_mut("b")
            .unwrap()
            .insert("pods".into(), Milli::units(3));
        let s = compute(None, &o);
        let c = conditions::get(&s.conditions, QUOTA_EXCEEDED).unwrap();
        assert_eq!(c.status, "True");
        assert_eq!(c.message, "pods 4/4 across the tenant");
    }

    #[test]
    fn a_tenant_limit_below_the_per_namespace_one_is_reported_not_silent() {
        let mut o = obs();
        o.tenant_hard = BTreeMap::from([("pods".into(), Milli::units(10))]);
        o.namespace_hard = BTreeMap::from([("pods".into(), Milli::units(50))]);
        o.used.clear();
        o.split = BTreeMap::from([
            (
                "a".into(),
                BTreeMap::from([("pods".into(), Milli::units(5))]),
            ),
            (
                "b".into(),
                BTreeMap::from([("pods".into(), Milli::units(5))]),
            ),
        ]);
        let s = compute(None, &o);
        let c = s
            .conditions
            .iter()
            .find(|c| c.type_ == QUOTA_EXCEEDED)
            .unwrap();
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("False", "WithinLimits")
        );
        assert_eq!(
            c.message,
            "pods: the tenant's 10 are shared, a 5, b 5 (resourceQuota 50 each)"
        );
        // A tenant limit that leaves every namespace its full per-namespace limit says nothing.
        o.tenant_hard = BTreeMap::from([("pods".into(), Milli::units(100))]);
        o.split = BTreeMap::from([
            (
                "a".into(),
                BTreeMap::from([("pods".into(), Milli::units(50))]),
            ),
            (
                "b".into(),
                BTreeMap::from([("pods".into(), Milli::units(50))]),
            ),
        ]);
        let c = compute(None, &o)
            .conditions
            .into_iter()
            .find(|c| c.type_ == QUOTA_EXCEEDED)
            .unwrap();
        assert_eq!(c.message, "");
    }

    #[test]
    fn problems_and_errors_make_it_degraded() {
        let mut o = obs();
        o.problems.push(Problem {
            reason: "NamespaceConflict",
            message: "x belongs to tenant y".into(),
        });
        let s = compute(None, &o);
        assert_eq!(s.phase, Some(TenantPhase::Degraded));
        assert_eq!(
            conditions::get(&s.conditions, conditions::READY)
                .unwrap()
                .reason,
            "NamespaceConflict"
        );
        o.error = Some(("ApplyFailed".into(), "boom".into()));
        let s = compute(None, &o);
        assert_eq!(
            conditions::get(&s.conditions, conditions::READY)
                .unwrap()
                .reason,
            "ApplyFailed"
        );
    }

    #[test]
    fn unchanged_observation_gives_an_identical_status() {
        let first = compute(None, &obs());
        let second = compute(Some(&first), &obs());
        assert_eq!(first, second, "so the status write is skipped");
    }

    #[test]
    fn usage_not_reported_yet_reads_as_zero_so_the_first_report_changes_nothing() {
        let limits = Observation {
            generation: Some(1),
            namespaces: vec!["a".into()],
            namespace_hard: BTreeMap::from([
                ("pods".into(), Milli::units(10)),
                ("requests.cpu".into(), Milli::units(2)),
            ]),
            ..Default::default()
        };
        let before = compute(None, &limits);
        let q = before.quota.clone().unwrap();
        assert_eq!(q.used["pods"], "0");
        assert_eq!(q.used["requests.cpu"], "0");
        let reported = Observation {
            used: BTreeMap::from([(
                "a".into(),
                BTreeMap::from([
                    ("pods".into(), Milli::ZERO),
                    ("requests.cpu".into(), Milli::ZERO),
                ]),
            )]),
            ..limits
        };
        assert_eq!(compute(Some(&before), &reported), before);
    }

    #[test]
    fn cordoned_and_deleting_phases() {
        let mut o = obs();
        o.cordoned = true;
        assert_eq!(compute(None, &o).phase, Some(TenantPhase::Cordoned));
        o.deleting = true;
        assert_eq!(compute(None, &o).phase, Some(TenantPhase::Terminating));
    }
}
