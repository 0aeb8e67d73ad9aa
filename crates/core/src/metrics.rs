//! Prometheus metrics, named like controller-runtime's so existing dashboards fit.
//!
//! | metric | type | labels |
//! |---|---|---|
//! | `controller_runtime_reconcile_total` | counter | controller, result (`success`, `error`, `requeue`, `skipped`) |
//! | `controller_runtime_reconcile_errors_total` | counter | controller |
//! | `controller_runtime_reconcile_time_seconds` | histogram | controller |
//! | `controller_runtime_active_workers` | gauge | controller |
//! | `controller_runtime_max_concurrent_reconciles` | gauge | controller |
//! | `leader_election_master_status` | gauge | name |
//! | `steward_status_writes_total` | counter | controller |
//! | `steward_child_writes_total` | counter | controller, kind, verb (`apply`, `delete`, `create`, `release`); writes [`crate::apply::Children`] made (an apply skipped as unchanged is not one) |
//! | `steward_watch_errors_total` | counter | controller, kind |
//! | `steward_reconcile_queue_oldest_seconds` | gauge | controller (age of the oldest trigger not yet reconciled; 0 when none) |
//! | `steward_reconcile_panics_total` | counter | controller |
//!
//! Operators add their own with [`Metrics::register`]; [`FromStore`] computes a gauge family
//! from a watch cache at scrape time (what each object's status says).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// Labels of per-controller metrics.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ControllerLabels {
    /// The controller's name (its kind, lowercase).
    pub controller: String,
}

/// Labels of `controller_runtime_reconcile_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    /// The controller's name.
    pub controller: String,
    /// `success`, `error` or `skipped`.
    pub result: String,
}

/// Labels of one watch of a controller.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WatchLabels {
    /// The controller's name.
    pub controller: String,
    /// The watched kind.
    pub kind: String,
}

/// Labels of `steward_child_writes_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WriteLabels {
    /// The controller's name.
    pub controller: String,
    /// The written object's kind.
    pub kind: String,
    /// `apply`, `delete`, `create` or `release`.
    pub verb: String,
}

/// Labels of `leader_election_master_status`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LeaseLabels {
    /// The Lease's name.
    pub name: String,
}

/// All metrics of one operator process. Cheap to clone.
#[derive(Clone)]
pub struct Metrics {
    registry: Arc<Mutex<Registry>>,
    /// The registered families' names, in order (the exposition omits a family without
    /// samples; this does not).
    families: Arc<Mutex<Vec<String>>>,
    /// `controller_runtime_reconcile_total{controller, result}`.
    pub reconcile_total: Family<ResultLabels, Counter>,
    /// `controller_runtime_reconcile_errors_total{controller}`.
    pub reconcile_errors: Family<ControllerLabels, Counter>,
    /// `controller_runtime_reconcile_time_seconds{controller}`.
    pub reconcile_time: Family<ControllerLabels, Histogram>,
    /// `controller_runtime_active_workers{controller}`.
    pub active_workers: Family<ControllerLabels, Gauge>,
    /// `controller_runtime_max_concurrent_reconciles{controller}`.
    pub max_concurrent: Family<ControllerLabels, Gauge>,
    /// `leader_election_master_status{name}`: 1 while this process leads.
    pub leader: Family<LeaseLabels, Gauge>,
    /// `steward_status_writes_total{controller}`.
    pub status_writes: Family<ControllerLabels, Counter>,
    /// `steward_child_writes_total{controller, kind, verb}`.
    pub child_writes: Family<WriteLabels, Counter>,
    /// `steward_watch_errors_total{controller, kind}`.
    pub watch_errors: Family<WatchLabels, Counter>,
    /// `steward_reconcile_queue_oldest_seconds{controller}`: how long the oldest queued
    /// object has waited.
    pub queue_oldest: Family<ControllerLabels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    /// `steward_reconcile_panics_total{controller}`.
    pub reconcile_panics: Family<ControllerLabels, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Every metric, registered in a new registry.
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let mut families = Vec::new();
        let reconcile_total = Family::<ResultLabels, Counter>::default();
        let reconcile_errors = Family::<ControllerLabels, Counter>::default();
        let reconcile_time = Family::<ControllerLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.005, 2.0, 14))
        });
        let active_workers = Family::<ControllerLabels, Gauge>::default();
        let max_concurrent = Family::<ControllerLabels, Gauge>::default();
        let leader = Family::<LeaseLabels, Gauge>::default();
        let status_writes = Family::<ControllerLabels, Counter>::default();
        let child_writes = Family::<WriteLabels, Counter>::default();
        let watch_errors = Family::<WatchLabels, Counter>::default();
        let queue_oldest =
            Family::<ControllerLabels, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
        let reconcile_panics = Family::<ControllerLabels, Counter>::default();
        add(
            &mut registry,
            &mut families,
            "controller_runtime_reconcile",
            "Total number of reconciliations per controller",
            reconcile_total.clone(),
        );
        add(
            &mut registry,
            &mut families,
            "controller_runtime_reconcile_errors",
            "Total number of reconciliation errors per controller",
            reconcile_errors.clone(),
        );
        add(
            &mut registry,
            &mut families,
            "controller_runtime_reconcile_time_seconds",
            "Length of time per reconciliation per controller",
            reconcile_time.clone(),
        );
        add(
            &mut registry,
            &mut families,
            "controller_runtime_active_workers",
            "Number of currently used workers per controller",
            active_workers.clone(),
        );
        add(
            &mut registry,
            &mut families,
            "controller_runtime_max_concurrent_reconciles",
            "Maximum number of concurrent reconciles per controller",
            max_concurrent.clone(),
        );
        add(
            &mut registry,
            &mut families,
            "leader_election_master_status",
            "Gauge of if the reporting system is master of the relevant lease, 0 indicates backup, 1 indicates master",
            leader.clone(),
        );
        add(
            &mut registry,
            &mut families,
            "steward_status_writes",
            "Status writes per controller (skipped when nothing changed)",
            status_writes.clone(),
        );
        add(
            &mut registry,
            &mut families,
            "steward_child_writes",
            "Writes to the objects a controller manages (an apply skipped because the object is as desired is not counted)",
            child_writes.clone(),
        );
        add(
            &mut registry,
            &mut families,
            "steward_watch_errors",
            "Errors of a controller's watches, per watched kind (each is retried with its own backoff)",
            watch_errors.clone(),
        );
        add(
            &mut registry,
            &mut families,
            "steward_reconcile_queue_oldest_seconds",
            "Age of the oldest reconcile request not yet started (0 when none)",
            queue_oldest.clone(),
        );
        add(
            &mut registry,
            &mut families,
            "steward_reconcile_panics",
            "Reconciles that panicked (turned into failed reconciles)",
            reconcile_panics.clone(),
        );
        Self {
            registry: Arc::new(Mutex::new(registry)),
            families: Arc::new(Mutex::new(families)),
            reconcile_total,
            reconcile_errors,
            reconcile_time,
            active_workers,
            max_concurrent,
            leader,
            status_writes,
            child_writes,
            watch_errors,
            queue_oldest,
            reconcile_panics,
        }
    }

    /// Registers an operator's own metric.
    pub fn register(
        &self,
        name: &str,
        help: &str,
        metric: impl prometheus_client::registry::Metric,
    ) {
        if let (Ok(mut registry), Ok(mut families)) = (self.registry.lock(), self.families.lock()) {
            add(&mut registry, &mut families, name, help, metric);
        }
    }

    /// The names of every registered family (as registered: a counter `x` is exposed as
    /// `x_total`, a histogram as `x_bucket`, `x_sum` and `x_count`).
    pub fn families(&self) -> Vec<String> {
        self.families.lock().map(|f| f.clone()).unwrap_or_default()
    }

    /// Prometheus text exposition of every metric.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if let Ok(registry) = self.registry.lock() {
            let _ = prometheus_client::encoding::text::encode(&mut out, &registry);
        }
        out
    }

    /// The labels of controller `name`.
    pub fn controller(&self, name: &str) -> ControllerLabels {
        ControllerLabels {
            controller: name.to_string(),
        }
    }

    /// The labels of `controller` with `result`.
    pub fn result(&self, controller: &str, result: &str) -> ResultLabels {
        ResultLabels {
            controller: controller.to_string(),
            result: result.to_string(),
        }
    }
}

fn add(
    registry: &mut Registry,
    families: &mut Vec<String>,
    name: &str,
    help: &str,
    metric: impl prometheus_client::registry::Metric,
) {
    families.push(name.to_string());
    registry.register(name, help, metric);
}

/// Labels of a [`FromStore`] sample, e.g. `[("namespace", "db"), ("cluster", "pg")]`.
pub type SampleLabels = Vec<(&'static str, String)>;

/// What a [`FromStore`] family reports of one object: its samples.
pub type Sampler<K> = dyn Fn(&K) -> Vec<(SampleLabels, f64)> + Send + Sync;

/// A gauge family computed from a watch cache when it is scraped: the samples `sample` returns
/// for each cached object. Nothing is updated on the reconcile path, and a deleted object's
/// series goes with it. Every replica reports it (standbys keep warm caches), so alert rules
/// aggregate over replicas. A sharded controller's family reports, on each replica, the
/// objects of the shards that replica holds now ([`Stores`]).
pub struct FromStore<K: kube::Resource<DynamicType = ()> + 'static> {
    stores: Stores<K>,
    sample: Box<Sampler<K>>,
}

impl<K> FromStore<K>
where
    K: kube::Resource<DynamicType = ()> + Clone + 'static,
{
    /// The family over `stores` (one [`Store`](kube::runtime::reflector::Store), or a
    /// [`Stores`] a sharded controller fills), sampled by `sample`.
    pub fn new(
        stores: impl Into<Stores<K>>,
        sample: impl Fn(&K) -> Vec<(SampleLabels, f64)> + Send + Sync + 'static,
    ) -> Self {
        Self {
            stores: stores.into(),
            sample: Box::new(sample),
        }
    }
}

/// The watch caches a [`FromStore`] family reads: one per shard, each counted only while
/// its shard's [`Leadership`](crate::leader::Leadership) is held. A sharded controller is built
/// anew, with new stores, for each term of its shard ([`crate::Operator::sharded_controller`]):
/// its build calls [`Stores::set`], replacing the store of the shard's last term (which no
/// watch updates any more) so a shard handed to another replica stops being reported here.
pub struct Stores<K: kube::Resource<DynamicType = ()> + 'static> {
    by_shard: Arc<Mutex<BTreeMap<Option<u32>, Held<K>>>>,
}

type Held<K> = (
    kube::runtime::reflector::Store<K>,
    crate::leader::Leadership,
);

impl<K: kube::Resource<DynamicType = ()> + 'static> Clone for Stores<K> {
    fn clone(&self) -> Self {
        Self {
            by_shard: Arc::clone(&self.by_shard),
        }
    }
}

impl<K: kube::Resource<DynamicType = ()> + 'static> Default for Stores<K> {
    fn default() -> Self {
        Self {
            by_shard: Arc::default(),
        }
    }
}

impl<K> Stores<K>
where
    K: kube::Resource<DynamicType = ()> + Clone + 'static,
{
    /// Shard `shard`'s store (`None`: the controller is not sharded), reported while `held`.
    pub fn set(
        &self,
        shard: Option<u32>,
        store: kube::runtime::reflector::Store<K>,
        held: crate::leader::Leadership,
    ) {
        let mut by_shard = self
            .by_shard
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        by_shard.insert(shard, (store, held));
        Self::forget_lost(&mut by_shard);
    }

    /// Every object of the stores whose shard is held now.
    fn objects(&self) -> Vec<Arc<K>> {
        let mut by_shard = self
            .by_shard
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        Self::forget_lost(&mut by_shard);
        by_shard
            .values()
            .flat_map(|(store, _)| store.state())
            .collect()
    }

    /// Drops the stores of shards no longer held, so their objects are freed (a store
    /// handle keeps its cache alive after the watch that filled it stopped).
    fn forget_lost(by_shard: &mut BTreeMap<Option<u32>, Held<K>>) {
        by_shard.retain(|_, (_, held)| held.is_leader());
    }
}

impl<K> From<kube::runtime::reflector::Store<K>> for Stores<K>
where
    K: kube::Resource<DynamicType = ()> + Clone + 'static,
{
    fn from(store: kube::runtime::reflector::Store<K>) -> Self {
        let stores = Self::default();
        stores.set(None, store, crate::leader::Leadership::always_leader());
        stores
    }
}

impl<K: kube::Resource<DynamicType = ()> + 'static> std::fmt::Debug for FromStore<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FromStore").finish_non_exhaustive()
    }
}

impl<K> prometheus_client::encoding::EncodeMetric for FromStore<K>
where
    K: kube::Resource<DynamicType = ()> + Clone + 'static,
{
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::MetricEncoder,
    ) -> Result<(), std::fmt::Error> {
        for object in self.stores.objects() {
            for (labels, value) in (self.sample)(&object) {
                encoder.encode_family(&labels)?.encode_gauge(&value)?;
            }
        }
        Ok(())
    }

    fn metric_type(&self) -> prometheus_client::metrics::MetricType {
        prometheus_client::metrics::MetricType::Gauge
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::runtime::{reflector, watcher};

    use super::*;
    use crate::LeaseConfig;
    use crate::leader::Leadership;

    fn store(names: &[&str]) -> kube::runtime::reflector::Store<ConfigMap> {
        let (store, mut writer) = reflector::store();
        for name in names {
            let mut cm = ConfigMap::default();
            cm.metadata.name = Some((*name).to_string());
            cm.metadata.namespace = Some("ns".into());
            writer.apply_watcher_event(&watcher::Event::Apply(cm));
        }
        store
    }

    fn names(stores: &Stores<ConfigMap>) -> Vec<String> {
        let mut v: Vec<String> = stores
            .objects()
            .iter()
            .filter_map(|o| o.metadata.name.clone())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn only_the_stores_of_held_shards_are_reported_and_a_lost_one_is_dropped() {
        let held = Leadership::new(&LeaseConfig::new("l-shard-0", "ns", "me"));
        held.renewed_at(tokio::time::Instant::now());
        let other = Leadership::new(&LeaseConfig::new("l-shard-1", "ns", "me"));
        let stores = Stores::default();
        stores.set(Some(0), store(&["a", "b"]), held.clone());
        stores.set(Some(1), store(&["c"]), other.clone());
        assert_eq!(names(&stores), ["a", "b"], "shard 1 is not held here");
        assert_eq!(stores.by_shard.lock().map(|m| m.len()).ok(), Some(1));

        // A new term of shard 0 replaces the last term's store.
        stores.set(Some(0), store(&["d"]), held.clone());
        assert_eq!(names(&stores), ["d"]);

        held.step_down();
        assert!(
            names(&stores).is_empty(),
            "a shard handed over is not reported"
        );
        assert_eq!(
            stores.by_shard.lock().map(|m| m.len()).ok(),
            Some(0),
            "and its cache is freed"
        );
    }

    #[test]
    fn a_single_store_is_always_reported() {
        let stores: Stores<ConfigMap> = store(&["x"]).into();
        assert_eq!(names(&stores), ["x"]);
    }
}
