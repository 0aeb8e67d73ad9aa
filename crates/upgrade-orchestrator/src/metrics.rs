//! The orchestrator's own metrics, next to steward-core's controller metrics.
//!
//! | metric | type | labels |
//! |---|---|---|
//! | `steward_upgrade_plans_in_progress` | gauge | — plans in Progressing, RollingBack, WaitingApproval, WaitingWindow or Paused, counted from the watch cache at scrape time |
//! | `steward_upgrade_component_duration_seconds` | histogram | kind, result (`succeeded`, `failed`, `rolled_back`) |
//! | `steward_upgrade_plan_started_timestamp_seconds` | gauge | namespace, plan, phase — when a plan in progress started (from the cache at scrape time), for "stuck" alerts |

use kube::runtime::reflector::Store;
use prometheus_client::encoding::{EncodeLabelSet, EncodeMetric, MetricEncoder};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};

use crate::crd::{PlanPhase, UpgradePlan};
use crate::progress::Finished;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DurationLabels {
    pub kind: String,
    pub result: String,
}

/// Metrics handles the reconcile updates.
#[derive(Clone)]
pub struct PlanMetrics {
    pub component_duration: Family<DurationLabels, Histogram>,
}

impl PlanMetrics {
    /// Creates the metrics and registers them (and the in-progress gauge over `plans`).
    pub fn register(metrics: &steward_core::metrics::Metrics, plans: Store<UpgradePlan>) -> Self {
        let component_duration = Family::<DurationLabels, Histogram>::new_with_constructor(|| {
            // 1 s .. ~68 min
            Histogram::new(exponential_buckets(1.0, 2.0, 13))
        });
        metrics.register(
            "steward_upgrade_component_duration_seconds",
            "Time from a component's start to its health (or failure), and of its rollback",
            component_duration.clone(),
        );
        metrics.register(
            "steward_upgrade_plan_started_timestamp_seconds",
            "When an UpgradePlan still in progress started (Unix seconds), labelled with its phase",
            steward_core::metrics::FromStore::new(plans.clone(), started),
        );
        metrics.register(
            "steward_upgrade_plans_in_progress",
            "UpgradePlans in Progressing, RollingBack, WaitingApproval, WaitingWindow or Paused",
            InProgress { plans },
        );
        Self { component_duration }
    }

    /// Records components that finished a step.
    pub fn observe(&self, finished: &[Finished]) {
        for f in finished {
            self.component_duration
                .get_or_create(&DurationLabels {
                    kind: f.kind.clone(),
                    result: f.result.to_string(),
                })
                .observe(f.seconds);
        }
    }
}

/// `steward_upgrade_plan_started_timestamp_seconds`: one sample for a plan in progress that
/// has started, none otherwise.
pub fn started(plan: &UpgradePlan) -> Vec<(steward_core::metrics::SampleLabels, f64)> {
    use kube::ResourceExt;
    let Some(status) = &plan.status else {
        return Vec::new();
    };
    let (Some(phase), Some(at)) = (status.phase, &status.started_at) else {
        return Vec::new();
    };
    if !in_progress(Some(phase)) {
        return Vec::new();
    }
    let labels = vec![
        ("namespace", plan.namespace().unwrap_or_default()),
        ("plan", plan.name_any()),
        ("phase", phase.as_str().to_string()),
    ];
    vec![(labels, at.0.as_second() as f64)]
}

/// A gauge computed from the plan cache when scraped, so deleted plans never linger.
struct InProgress {
    plans: Store<UpgradePlan>,
}

impl std::fmt::Debug for InProgress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InProgress").finish_non_exhaustive()
    }
}

/// Whether a plan in `phase` counts as in progress.
pub fn in_progress(phase: Option<PlanPhase>) -> bool {
    matches!(
        phase,
        Some(
            PlanPhase::Progressing
                | PlanPhase::RollingBack
                | PlanPhase::WaitingApproval
                | PlanPhase::WaitingWindow
                | PlanPhase::Paused
        )
    )
}

impl EncodeMetric for InProgress {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let n = self
            .plans
            .state()
            .iter()
            .filter(|p| in_progress(p.status.as_ref().and_then(|s| s.phase)))
            .count();
        encoder.encode_gauge(&(n as i64))
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Gauge
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn plan(status: serde_json::Value) -> UpgradePlan {
        serde_json::from_value(json!({
            "apiVersion": "upgrade.steward.dev/v1alpha1",
            "kind": "UpgradePlan",
            "metadata": {"name": "release", "namespace": "apps"},
            "spec": {"components": [{"name": "a", "target": {"kind": "Deployment", "name": "a"},
                                     "image": {"container": "app", "image": "a:2"}}]},
            "status": status,
        }))
        .expect("plan")
    }

    #[test]
    fn only_started_plans_in_progress_report_when_they_started() {
        let running =
            plan(json!({"phase": "Progressing", "startedAt": "2026-12-01T10:00:00.000000Z"}));
        let samples = started(&running);
        assert_eq!(samples.len(), 1);
        assert_eq!(samples[0].0[2], ("phase", "Progressing".to_string()));
        assert_eq!(samples[0].1, 1_796_119_200.0);
        let done = plan(json!({"phase": "Succeeded", "startedAt": "2026-12-01T10:00:00.000000Z"}));
        assert!(started(&done).is_empty());
        assert!(started(&plan(json!({"phase": "Pending"}))).is_empty());
    }
}
