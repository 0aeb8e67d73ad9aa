//! What each Tenant's status says, as gauges computed from the watch cache when scraped
//! (steward-core's `FromStore`), for the alert rules of `deploy/monitoring/`.
//!
//! | metric | labels |
//! |---|---|
//! | `steward_tenant_namespaces` | tenant — `status.namespaceCount` |
//! | `steward_tenant_quota_exceeded` | tenant — 1 while the `QuotaExceeded` condition is True |
//! | `steward_tenant_ready` | tenant — 1 while `Ready` is True |
//!
//! With `--shards`, each replica reports the Tenants of the shards it holds.

use kube::ResourceExt;
use steward_core::metrics::{FromStore, Metrics, SampleLabels, Stores};

use crate::crd::{QUOTA_EXCEEDED, Tenant};

fn condition(tenant: &Tenant, type_: &str) -> f64 {
    let on = tenant.status.as_ref().is_some_and(|s| {
        s.conditions
            .iter()
            .any(|c| c.type_ == type_ && c.status == "True")
    });
    if on { 1.0 } else { 0.0 }
}

fn labels(tenant: &Tenant) -> SampleLabels {
    vec![("tenant", tenant.name_any())]
}

/// `steward_tenant_namespaces`.
pub fn namespaces(tenant: &Tenant) -> Vec<(SampleLabels, f64)> {
    let n = tenant.status.as_ref().map_or(0, |s| s.namespace_count);
    vec![(labels(tenant), f64::from(n))]
}

/// `steward_tenant_quota_exceeded`.
pub fn quota_exceeded(tenant: &Tenant) -> Vec<(SampleLabels, f64)> {
    vec![(labels(tenant), condition(tenant, QUOTA_EXCEEDED))]
}

/// `steward_tenant_ready`.
pub fn ready(tenant: &Tenant) -> Vec<(SampleLabels, f64)> {
    vec![(
        labels(tenant),
        condition(tenant, steward_core::conditions::READY),
    )]
}

/// Registers the gauges over the Tenant cache.
pub fn register(metrics: &Metrics, tenants: &Stores<Tenant>) {
    metrics.register(
        "steward_tenant_namespaces",
        "Namespaces of a Tenant (status.namespaceCount)",
        FromStore::new(tenants.clone(), namespaces),
    );
    metrics.register(
        "steward_tenant_quota_exceeded",
        "1 while a Tenant's QuotaExceeded condition is True, else 0",
        FromStore::new(tenants.clone(), quota_exceeded),
    );
    metrics.register(
        "steward_tenant_ready",
        "1 while a Tenant's Ready condition is True, else 0",
        FromStore::new(tenants.clone(), ready),
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn conditions_become_zero_or_one() {
        let tenant: Tenant = serde_json::from_value(json!({
            "apiVersion": "tenancy.steward.dev/v1alpha1",
            "kind": "Tenant",
            "metadata": {"name": "team-a"},
            "spec": {"owners": [{"kind": "User", "name": "alice"}]},
            "status": {"namespaceCount": 3, "conditions": [
                {"type": "Ready", "status": "True", "reason": "Reconciled", "message": "", "lastTransitionTime": "2026-12-01T00:00:00Z"},
                {"type": "QuotaExceeded", "status": "False", "reason": "WithinLimits", "message": "", "lastTransitionTime": "2026-12-01T00:00:00Z"},
            ]},
        }))
        .expect("tenant");
        assert_eq!(
            namespaces(&tenant),
            [(vec![("tenant", "team-a".to_string())], 3.0)]
        );
        assert_eq!(ready(&tenant)[0].1, 1.0);
        assert_eq!(quota_exceeded(&tenant)[0].1, 0.0);
    }
}
