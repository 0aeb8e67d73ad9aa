//! Building a controller whose watches recover on their own: [`Controller`].
//!
//! kube-runtime's `Controller` merges every trigger watch into one stream and applies one
//! exponential backoff to the merged stream: an error on *any* watch (a `410 Gone` after an
//! API server restart, a refused connection) pauses *every* watch, the reconcile-all on
//! acquiring leadership included, for up to ~30 s, and the errors of a dozen watches keep the
//! pause long. After an API server restart this stalled the tenant-operator for minutes
//! while `/healthz` said 200.
//!
//! Steward's [`Controller`] has the same builder methods (`new`, `owns`, `watches`,
//! `watches_with`, `watches_stream`), but builds every watch itself:
//!
//! - each watch has its **own** backoff ([`WatchBackoff`]: 100 ms doubling to 2 s, with
//!   jitter, reset by the next good event), so a failing watch re-lists promptly and never
//!   delays the others;
//! - errors are counted (`steward_watch_errors_total{controller,kind}`), logged and kept out
//!   of the merged stream, which therefore never pauses;
//! - every trigger is remembered until a reconcile of that object starts, so the runtime
//!   knows the age of the oldest queued item (`steward_reconcile_queue_oldest_seconds`) and
//!   `/healthz` fails when a leading controller has queued work but makes no progress, or a
//!   watch keeps failing, for longer than `--stall-timeout` (`Tracker`).
//!
//! Use [`watch`] for a reflector an operator reads itself (a store of another kind) and pass
//! it to [`Controller::watches_stream`].
//!
//! Every store keeps objects [`trim`]med: without the parts no Steward operator reads
//! (other managers' `managedFields` entries, kubectl's last-applied annotation), which were
//! about half of what the tenant-operator cached (`docs/memory.md`).

use std::collections::HashMap;
use std::fmt::Debug;
use std::hash::Hash;
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt};
use kube::core::PartialObjectMeta;
use kube::runtime::WatchStreamExt;
#[allow(deprecated)] // kube-runtime's own owns() uses it too
use kube::runtime::metadata_watcher;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::watcher::watcher;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Resource, ResourceExt};
use serde::de::DeserializeOwned;

pub use crate::cache::{Cache, Listed, Owners, trim, trim_metadata};
use crate::leader::Leadership;
use crate::metrics::{ControllerLabels, Metrics, WatchLabels};
use crate::object::Object;

/// A controller under construction: kube-runtime's `Controller` with Steward's watches.
///
/// Pass it to [`crate::Operator::controller`].
///
/// # Guarantees
/// - A failing watch is retried on its own schedule (at most 2 s apart) and never pauses
///   another watch, the reconcile queue or the reconcile-all on acquiring leadership.
/// - Every watch error is counted and logged at `warn` with the kind that failed.
pub struct Controller<K>
where
    K: Object,
{
    inner: kube::runtime::Controller<K>,
    cache: Cache<K>,
    tracker: Arc<Tracker<K>>,
}

/// A watch stream with Steward's per-watch backoff and error accounting, from [`watch`].
pub struct Watch<K> {
    stream: Pin<Box<dyn Stream<Item = Event<K>> + Send>>,
    source: Arc<StreamSource>,
}

impl<K: Send + 'static> Watch<K> {
    /// Calls `f` on every event (e.g. to learn when the first list completed).
    #[must_use]
    pub fn inspect(self, f: impl FnMut(&Event<K>) + Send + 'static) -> Self {
        Self {
            stream: Box::pin(self.stream.inspect(f)),
            source: self.source,
        }
    }
}

/// The [`Cache`] of `reader` and the [`Watch`] of `stream`, which fills it and says when it
/// has listed.
fn cache<K>(
    reader: Store<K>,
    stream: impl Stream<Item = Event<K>> + Send + 'static,
    source: Arc<StreamSource>,
) -> (Cache<K>, Watch<K>)
where
    K: Resource<DynamicType = ()> + Clone + Send + 'static,
{
    let (cache, stream) = Cache::follow(reader, stream);
    (
        cache,
        Watch {
            stream: Box::pin(stream),
            source,
        },
    )
}

/// A reflector over `api`: the cache it fills and the [`Watch`] that drives it. The watch
/// must be polled (pass it to [`Controller::watches_stream`]) for the cache to fill.
pub fn watch<K>(api: Api<K>, config: watcher::Config) -> (Cache<K>, Watch<K>)
where
    K: Object,
{
    let (reader, writer) = reflector::store();
    let source = StreamSource::new(K::kind(&()).to_string());
    let stream = resilient(
        kube::runtime::reflector(writer, watcher(api, config).modify(trim)),
        source.clone(),
    );
    cache(reader, stream, source)
}

/// A reflector over the metadata of `api`'s objects only (name, labels, annotations, this
/// manager's `managedFields`, and with [`Owners::Kept`] the owner references;
/// [`trim_metadata`]ed): enough for [`crate::apply::Children::ensure`] to judge a child, at a
/// fraction of a full object's memory. Pass the watch to [`Controller::owns_watched`] (which
/// needs [`Owners::Kept`]) or [`Controller::watches_stream`].
pub fn watch_metadata<K>(
    api: Api<K>,
    config: watcher::Config,
    owners: Owners,
) -> (Cache<PartialObjectMeta<K>>, Watch<PartialObjectMeta<K>>)
where
    K: Object,
{
    let (reader, writer) = reflector::store();
    let source = StreamSource::new(K::kind(&()).to_string());
    #[allow(deprecated)]
    let stream = resilient(
        kube::runtime::reflector(
            writer,
            metadata_watcher(api, config).modify(move |obj| trim_metadata(obj, owners)),
        ),
        source.clone(),
    );
    cache(reader, stream, source)
}

/// Applies the per-watch backoff, records errors in `source` and drops them from the stream.
///
/// `Init` (a re-list starting) is dropped before the backoff: kube-runtime's watcher emits it
/// *before* the list request, so counting it as a good event would reset the backoff (and the
/// failing state) on every retry of a list that keeps failing — a retry loop at the minimum
/// delay. Nothing downstream needs it: the reflector has already seen it.
fn resilient<K: Send + 'static>(
    stream: impl Stream<Item = Result<Event<K>, watcher::Error>> + Send + 'static,
    source: Arc<StreamSource>,
) -> impl Stream<Item = Event<K>> + Send + 'static {
    let stream = stream.filter(|item| futures::future::ready(!matches!(item, Ok(Event::Init))));
    kube::runtime::utils::StreamBackoff::new(stream, WatchBackoff::default()).filter_map(
        move |item| {
            let out = match item {
                Ok(event) => {
                    source.ok();
                    Some(event)
                }
                Err(e) => {
                    source.failed(&e);
                    None
                }
            };
            futures::future::ready(out)
        },
    )
}

/// The `K`s in `child`'s `ownerReferences` (in its namespace).
fn owners<K, Child>(child: PartialObjectMeta<Child>) -> Vec<ObjectRef<K>>
where
    K: Resource<DynamicType = ()>,
    Child: Resource<DynamicType = ()>,
{
    let (kind, api_version) = (K::kind(&()), K::api_version(&()));
    let namespace = child.namespace();
    child
        .owner_references()
        .iter()
        .filter(|o| o.kind == kind && o.api_version == api_version)
        .map(|o| {
            let r = ObjectRef::<K>::new(&o.name);
            match &namespace {
                Some(ns) => r.within(ns),
                None => r,
            }
        })
        .collect()
}

/// Touched objects of a watch: applied or deleted objects, markers dropped.
fn touched<K: Send + 'static>(
    stream: impl Stream<Item = Event<K>> + Send + 'static,
) -> impl Stream<Item = Result<K, watcher::Error>> + Send + 'static {
    stream.flat_map(|event| {
        let objects = match event {
            Event::Apply(obj) | Event::Delete(obj) | Event::InitApply(obj) => vec![Ok(obj)],
            Event::Init | Event::InitDone => Vec::new(),
        };
        futures::stream::iter(objects)
    })
}

impl<K> Controller<K>
where
    K: Object,
{
    /// A controller for the objects of `api` selected by `config`.
    pub fn new(api: Api<K>, config: watcher::Config) -> Self {
        let (cache, main) = watch(api, config);
        let store = cache.store().clone();
        let tracker = Arc::new(Tracker::new(store.clone()));
        tracker.add_source(main.source.clone());
        let marks = tracker.clone();
        let trigger = touched(main.stream).inspect(move |obj| {
            if let Ok(obj) = obj {
                marks.triggered(ObjectRef::from_obj(obj));
            }
        });
        let inner =
            kube::runtime::Controller::for_stream(trigger, store).trigger_backoff(NeverPause);
        Self {
            inner,
            cache,
            tracker,
        }
    }

    /// The cache of the controller's own kind.
    pub fn store(&self) -> Store<K> {
        self.cache.store().clone()
    }

    /// Reconciles the owner (a `K` in the child's `ownerReferences`) when a `Child` selected
    /// by `config` changes. Only metadata is watched.
    #[must_use]
    pub fn owns<Child>(self, api: Api<Child>, config: watcher::Config) -> Self
    where
        Child: Object,
    {
        self.watches_metadata(api, config, owners::<K, Child>)
    }

    /// [`Controller::owns`] with a watch from [`watch_metadata`], whose store the operator
    /// reads (the children's metadata, for [`crate::apply::Children::ensure`]).
    #[must_use]
    pub fn owns_watched<Child>(self, watch: Watch<PartialObjectMeta<Child>>) -> Self
    where
        Child: Object,
    {
        self.push(touched(watch.stream), watch.source, owners::<K, Child>, ())
    }

    /// Reconciles the objects `mapper` names when an `Other` selected by `config` changes,
    /// watching only its metadata (name, labels, owners; every change, status included,
    /// still arrives): for a mapper that needs no more, a smaller watch to decode.
    #[must_use]
    pub fn watches_metadata<Other, I>(
        self,
        api: Api<Other>,
        config: watcher::Config,
        mapper: impl Fn(PartialObjectMeta<Other>) -> I + Send + Sync + 'static,
    ) -> Self
    where
        Other: Object,
        I: IntoIterator<Item = ObjectRef<K>> + 'static,
        I::IntoIter: Send,
    {
        let source = StreamSource::new(Other::kind(&()).to_string());
        #[allow(deprecated)]
        let stream = touched(resilient(metadata_watcher(api, config), source.clone()));
        self.push(stream, source, mapper, ())
    }

    /// Reconciles the objects `mapper` names when an `Other` selected by `config` changes.
    #[must_use]
    pub fn watches<Other, I>(
        self,
        api: Api<Other>,
        config: watcher::Config,
        mapper: impl Fn(Other) -> I + Send + Sync + 'static,
    ) -> Self
    where
        Other: Object,
        I: IntoIterator<Item = ObjectRef<K>> + 'static,
        I::IntoIter: Send,
    {
        self.watches_with(api, (), config, mapper)
    }

    /// [`Controller::watches`] for a kind known only at run time (`DynamicObject`).
    #[must_use]
    pub fn watches_with<Other, I>(
        self,
        api: Api<Other>,
        dyntype: Other::DynamicType,
        config: watcher::Config,
        mapper: impl Fn(Other) -> I + Send + Sync + 'static,
    ) -> Self
    where
        Other: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
        Other::DynamicType: Debug + Clone + Eq + Hash + Send + Sync,
        I: IntoIterator<Item = ObjectRef<K>> + 'static,
        I::IntoIter: Send,
    {
        let source = StreamSource::new(Other::kind(&dyntype).to_string());
        let stream = touched(resilient(watcher(api, config), source.clone()));
        self.push(stream, source, mapper, dyntype)
    }

    /// Reconciles the objects `mapper` names when an object of `watch` (from [`watch`])
    /// changes; the operator reads the watch's store itself.
    #[must_use]
    pub fn watches_stream<Other, I>(
        self,
        watch: Watch<Other>,
        mapper: impl Fn(Other) -> I + Send + Sync + 'static,
    ) -> Self
    where
        Other: Object,
        I: IntoIterator<Item = ObjectRef<K>> + 'static,
        I::IntoIter: Send,
    {
        self.push(touched(watch.stream), watch.source, mapper, ())
    }

    fn push<Other, I>(
        self,
        stream: impl Stream<Item = Result<Other, watcher::Error>> + Send + 'static,
        source: Arc<StreamSource>,
        mapper: impl Fn(Other) -> I + Send + Sync + 'static,
        dyntype: Other::DynamicType,
    ) -> Self
    where
        Other: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
        Other::DynamicType: Debug + Clone,
        I: IntoIterator<Item = ObjectRef<K>> + 'static,
        I::IntoIter: Send,
    {
        self.tracker.add_source(source);
        let marks = self.tracker.clone();
        let mapper = move |obj: Other| {
            let refs: Vec<ObjectRef<K>> = mapper(obj).into_iter().collect();
            for r in &refs {
                marks.triggered(r.clone());
            }
            refs
        };
        Self {
            inner: self.inner.watches_stream_with(stream, mapper, dyntype),
            cache: self.cache,
            tracker: self.tracker,
        }
    }

    pub(crate) fn into_parts(self) -> (kube::runtime::Controller<K>, Cache<K>, Arc<Tracker<K>>) {
        (self.inner, self.cache, self.tracker)
    }
}

/// The backoff of one watch: 100 ms doubling to 2 s, ±50 % jitter; reset by a good event.
#[derive(Debug, Clone)]
pub struct WatchBackoff {
    next: Duration,
}

impl WatchBackoff {
    const MIN: Duration = Duration::from_millis(100);
    const MAX: Duration = Duration::from_secs(2);
}

impl Default for WatchBackoff {
    fn default() -> Self {
        Self { next: Self::MIN }
    }
}

impl Iterator for WatchBackoff {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        let base = self.next;
        self.next = (base * 2).min(Self::MAX);
        let jitter = rand::random_range(0.5..1.5);
        Some(base.mul_f64(jitter))
    }
}

impl kube::runtime::utils::Backoff for WatchBackoff {
    fn reset(&mut self) {
        self.next = Self::MIN;
    }
}

/// The merged trigger stream never pauses: each watch backs off on its own (and errors never
/// reach the merged stream anyway).
struct NeverPause;

impl Iterator for NeverPause {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        Some(Duration::ZERO)
    }
}

impl kube::runtime::utils::Backoff for NeverPause {
    fn reset(&mut self) {}
}

/// The state of one watch of a controller.
struct StreamSource {
    kind: String,
    state: Mutex<SourceState>,
    labels: OnceLock<(Metrics, WatchLabels)>,
}

#[derive(Default)]
struct SourceState {
    failing_since: Option<Instant>,
    last_error: String,
}

impl StreamSource {
    fn new(kind: String) -> Arc<Self> {
        Arc::new(Self {
            kind,
            state: Mutex::new(SourceState::default()),
            labels: OnceLock::new(),
        })
    }

    fn ok(&self) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if state.failing_since.take().is_some() {
            tracing::info!(kind = %self.kind, "watch recovered");
        }
    }

    fn failed(&self, e: &watcher::Error) {
        let message = crate::chain(e);
        if let Some((metrics, labels)) = self.labels.get() {
            metrics.watch_errors.get_or_create(labels).inc();
        }
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if state.failing_since.is_none() {
            tracing::warn!(kind = %self.kind, error = %message, "watch failed; retrying with backoff");
            state.failing_since = Some(Instant::now());
        } else {
            tracing::debug!(kind = %self.kind, error = %message, "watch still failing");
        }
        state.last_error = message;
    }

    /// Since when this watch has failed without a good event in between, and why.
    fn failing(&self) -> Option<(Instant, String)> {
        let state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.failing_since.map(|t| (t, state.last_error.clone()))
    }
}

/// What a controller has been asked to do and whether it does it: the watches' health and
/// the triggers not yet followed by a reconcile of their object.
pub(crate) struct Tracker<K: Resource<DynamicType = ()> + 'static> {
    store: Store<K>,
    sources: Mutex<Vec<Arc<StreamSource>>>,
    pending: Mutex<HashMap<ObjectRef<K>, Instant>>,
    last_start: Mutex<Option<Instant>>,
    attached: OnceLock<Attached>,
}

struct Attached {
    name: String,
    leadership: Leadership,
}

impl<K> Tracker<K>
where
    K: Object,
{
    fn new(store: Store<K>) -> Self {
        Self {
            store,
            sources: Mutex::new(Vec::new()),
            pending: Mutex::new(HashMap::new()),
            last_start: Mutex::new(None),
            attached: OnceLock::new(),
        }
    }

    fn add_source(&self, source: Arc<StreamSource>) {
        self.sources
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(source);
    }

    /// Connects the tracker to the running operator (metrics labels, leadership).
    pub(crate) fn attach(&self, name: &str, metrics: &Metrics, leadership: Leadership) {
        for source in self
            .sources
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
        {
            let labels = WatchLabels {
                controller: name.to_string(),
                kind: source.kind.clone(),
            };
            let _ = source.labels.set((metrics.clone(), labels));
        }
        let _ = self.attached.set(Attached {
            name: name.to_string(),
            leadership,
        });
    }

    fn leading(&self) -> bool {
        self.attached
            .get()
            .is_some_and(|a| a.leadership.is_leader())
    }

    /// A reconcile of `obj` was requested (only counted while leading: followers do not
    /// reconcile).
    pub(crate) fn triggered(&self, obj: ObjectRef<K>) {
        if self.leading() {
            self.pending
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .entry(obj)
                .or_insert_with(Instant::now);
        }
    }

    /// Every cached object was requested (leadership acquired).
    pub(crate) fn triggered_all(&self) {
        for obj in self.store.state() {
            self.triggered(ObjectRef::from_obj(obj.as_ref()));
        }
    }

    /// A reconcile of `obj` started.
    pub(crate) fn started(&self, obj: &K) {
        let now = Instant::now();
        *self.last_start.lock().unwrap_or_else(|p| p.into_inner()) = Some(now);
        self.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&ObjectRef::from_obj(obj));
    }
}

/// A controller's liveness, as the runtime's watchdog sees it.
pub(crate) trait Liveness: Send + Sync {
    /// The controller's name.
    fn name(&self) -> &str;
    /// Age of the oldest trigger not yet followed by a reconcile of its object.
    fn oldest_pending(&self, now: Instant) -> Option<Duration>;
    /// `Err(why)` when the controller has been stuck for longer than `bound`.
    fn check(&self, now: Instant, bound: Duration) -> Result<(), String>;
    /// Whether every watch delivered its last event without error.
    fn watches_current(&self) -> bool;
}

impl<K> Liveness for Tracker<K>
where
    K: Object,
{
    fn name(&self) -> &str {
        self.attached.get().map_or("", |a| a.name.as_str())
    }

    fn oldest_pending(&self, now: Instant) -> Option<Duration> {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        if !self.leading() {
            pending.clear();
            return None;
        }
        // A request for an object that is gone is dropped by kube-runtime, not reconciled.
        pending.retain(|obj, _| self.store.get(obj).is_some());
        pending
            .values()
            .min()
            .map(|since| now.saturating_duration_since(*since))
    }

    fn check(&self, now: Instant, bound: Duration) -> Result<(), String> {
        for source in self
            .sources
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
        {
            if let Some((since, error)) = source.failing()
                && now.saturating_duration_since(since) > bound
            {
                return Err(format!(
                    "controller {}: the {} watch has failed for {:.0?}: {error}",
                    self.name(),
                    source.kind,
                    now.saturating_duration_since(since)
                ));
            }
        }
        let Some(oldest) = self.oldest_pending(now) else {
            return Ok(());
        };
        let last_start = *self.last_start.lock().unwrap_or_else(|p| p.into_inner());
        let idle = last_start.map_or(oldest, |t| now.saturating_duration_since(t));
        if oldest > bound && idle > bound {
            return Err(format!(
                "controller {}: work queued for {oldest:.0?} and no reconcile started for {idle:.0?}",
                self.name()
            ));
        }
        Ok(())
    }

    fn watches_current(&self) -> bool {
        self.sources
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .all(|s| s.failing().is_none())
    }
}

/// Labels of the per-controller liveness gauges.
pub(crate) fn controller_labels(name: &str) -> ControllerLabels {
    ControllerLabels {
        controller: name.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ConfigMap;

    #[test]
    fn watch_backoff_grows_to_two_seconds_and_resets() {
        use kube::runtime::utils::Backoff;
        let mut b = WatchBackoff::default();
        let first = b.next().unwrap_or_default();
        assert!(first >= Duration::from_millis(50) && first <= Duration::from_millis(150));
        let later: Vec<_> = (0..10).map(|_| b.next().unwrap_or_default()).collect();
        assert!(later.iter().all(|d| *d <= Duration::from_secs(3)));
        assert!(later[9] >= Duration::from_secs(1));
        b.reset();
        assert!(b.next().unwrap_or_default() <= Duration::from_millis(150));
    }

    fn cm(name: &str) -> ConfigMap {
        ConfigMap {
            metadata: kube::api::ObjectMeta {
                name: Some(name.into()),
                namespace: Some("ns".into()),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    #[test]
    fn queued_work_without_progress_is_a_stall_and_progress_is_not() {
        let (store, mut writer) = reflector::store::<ConfigMap>();
        writer.apply_watcher_event(&Event::Apply(cm("a")));
        writer.apply_watcher_event(&Event::Apply(cm("b")));
        let tracker = Tracker::new(store);
        tracker.attach("test", &Metrics::new(), Leadership::always_leader());
        let bound = Duration::from_secs(10);
        let t0 = Instant::now();
        tracker.triggered(ObjectRef::from_obj(&cm("a")));
        assert!(tracker.check(t0, bound).is_ok());
        let later = t0 + Duration::from_secs(11);
        let err = tracker.check(later, bound).unwrap_err();
        assert!(err.contains("no reconcile started"), "{err}");
        // Another object's reconcile is progress: a long queue is not a stall.
        tracker.triggered(ObjectRef::from_obj(&cm("b")));
        tracker.started(&cm("b"));
        assert!(
            tracker
                .check(Instant::now() + Duration::from_secs(5), bound)
                .is_ok()
        );
        tracker.started(&cm("a"));
        assert_eq!(tracker.oldest_pending(later), None);
        // A trigger for an object that is gone is not work.
        tracker.triggered(ObjectRef::from_obj(&cm("gone")));
        assert_eq!(tracker.oldest_pending(later), None);
    }

    #[test]
    fn a_watch_failing_longer_than_the_bound_is_a_stall() {
        let (store, _writer) = reflector::store::<ConfigMap>();
        let tracker = Tracker::new(store);
        let source = StreamSource::new("ConfigMap".into());
        tracker.add_source(source.clone());
        tracker.attach("test", &Metrics::new(), Leadership::always_leader());
        source.failed(&watcher::Error::NoResourceVersion);
        assert!(!tracker.watches_current());
        let bound = Duration::from_secs(10);
        assert!(tracker.check(Instant::now(), bound).is_ok());
        let err = tracker
            .check(Instant::now() + Duration::from_secs(11), bound)
            .unwrap_err();
        assert!(err.contains("ConfigMap watch has failed"), "{err}");
        source.ok();
        assert!(tracker.watches_current());
        assert!(
            tracker
                .check(Instant::now() + Duration::from_secs(11), bound)
                .is_ok()
        );
    }
}
