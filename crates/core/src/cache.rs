//! A reflector's store and whether it has listed once: [`Cache`].

use futures::{Stream, StreamExt};
use kube::Resource;
use kube::core::PartialObjectMeta;
use kube::runtime::reflector::Store;
use kube::runtime::watcher::Event;

/// A reflector's store and whether it has listed once, from [`crate::controller::watch`] or
/// [`crate::controller::watch_metadata`].
/// Derefs to the [`Store`].
///
/// # Guarantees
/// [`Cache::listed`] wakes **every** task waiting on it once the reflector has seen its first
/// complete list. kube-runtime 5's `Store::wait_until_ready` does not: it polls one oneshot
/// receiver that keeps only the last poller's waker, so of several reconciles waiting on a
/// store at once (the first reconciles after a start or a failover), all but one would sleep
/// until their own timeout.
pub struct Cache<K: Resource<DynamicType = ()> + 'static> {
    store: Store<K>,
    listed: Listed,
}

impl<K: Resource<DynamicType = ()> + Clone + 'static> Clone for Cache<K> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            listed: self.listed.clone(),
        }
    }
}

impl<K: Resource<DynamicType = ()> + 'static> std::ops::Deref for Cache<K> {
    type Target = Store<K>;

    fn deref(&self) -> &Store<K> {
        &self.store
    }
}

impl<K: Resource<DynamicType = ()> + Clone + 'static> Cache<K> {
    /// The store.
    pub fn store(&self) -> &Store<K> {
        &self.store
    }

    /// Whether the reflector has listed once; waits until it has. `false` if its watch was
    /// dropped first.
    pub async fn listed(&self) -> bool {
        self.listed.wait().await
    }

    /// The cache of `reader`, and `stream` (the reflector's events) telling it when the
    /// reflector has listed.
    pub(crate) fn follow(
        reader: Store<K>,
        stream: impl Stream<Item = Event<K>> + Send + 'static,
    ) -> (Self, impl Stream<Item = Event<K>> + Send + 'static)
    where
        K: Send,
    {
        let (tx, rx) = tokio::sync::watch::channel(false);
        let stream = stream.inspect(move |event| {
            if matches!(event, Event::InitDone) {
                tx.send_if_modified(|listed| !std::mem::replace(listed, true));
            }
        });
        let cache = Self {
            store: reader,
            listed: Listed(rx),
        };
        (cache, stream)
    }

    /// A cache no watch fills: empty, and [`Cache::listed`] answers `false` at once. For unit
    /// tests of decide functions, whose plans name a cache they do not read.
    pub fn unfilled() -> Self {
        let (reader, _writer) = kube::runtime::reflector::store();
        let (_tx, rx) = tokio::sync::watch::channel(false);
        Self {
            store: reader,
            listed: Listed(rx),
        }
    }

    /// The handle [`Cache::listed`] waits on, for waiting on several caches at once.
    pub fn listed_handle(&self) -> Listed {
        self.listed.clone()
    }
}

/// Whether a reflector has listed once (from [`Cache::listed_handle`]): a `watch` channel set
/// by the first `InitDone` that passes its [`crate::controller::Watch`], so every waiter wakes.
#[derive(Clone, Debug)]
pub struct Listed(tokio::sync::watch::Receiver<bool>);

impl Listed {
    /// Waits until the reflector has listed once; `false` if its watch was dropped first.
    pub async fn wait(&self) -> bool {
        self.0.clone().wait_for(|listed| *listed).await.is_ok()
    }

    /// Waits until every one of `all` has listed; `false` if a watch was dropped first.
    pub async fn all(all: &[Listed]) -> bool {
        futures::future::join_all(all.iter().map(Listed::wait))
            .await
            .into_iter()
            .all(|listed| listed)
    }
}

/// How long `Children::ensure_cached` waits for a cache's first list.
pub(crate) const CACHE_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// The `kubectl apply` annotation: a second copy of the object, never read by an operator.
const LAST_APPLIED: &str = "kubectl.kubernetes.io/last-applied-configuration";

/// Drops from `obj` what no Steward operator reads, and packs what it reads rarely, before a
/// store keeps it.
///
/// # Guarantees
/// - Kept: every field of the object except those below; in `managedFields`, every
///   server-side-apply entry of the object itself (`operation: Apply`, no subresource), which
///   is what a write-skip compares against (the fields its own last apply set).
/// - Dropped: `managedFields` entries of `Update` operations and of subresources (such as the
///   quota controller's `status` updates), and the `kubectl.kubernetes.io/last-applied-configuration`
///   annotation; in the kept entries, their `apiVersion` and `fieldsType` (never read).
/// - Shared: each kept entry's `fieldsV1` becomes a reference to the one copy of its set of
///   owned fields ([`crate::fields::intern`]; JSON text past its bound); [`crate::fields::owned`]
///   reads it back.
/// - Moved: the write-skip's digest ([`crate::object::APPLIED_ANNOTATION`], on every child) is
///   kept among the labels, whose map every child has anyway: on most children it is the only
///   annotation, and a map of its own costs about half a KiB per object.
///   `apply::applied_digest` reads it from either place.
/// - Lists of metadata are cut to their length (a decoded list of one owner reference or one
///   entry reserves room for four).
///
/// # Caveats
/// A reconcile that needs what is dropped must read the object from the API server. A cached
/// object is not fit to send back whole (its `fieldsV1` are references, the digest is among its
/// labels): Steward's writes are applies of desired objects, never of cached ones.
pub fn trim<K: Resource>(obj: &mut K) {
    let meta = obj.meta_mut();
    if let Some(entries) = meta.managed_fields.as_mut() {
        entries.retain(|e| {
            e.operation.as_deref() == Some("Apply")
                && e.subresource.as_deref().unwrap_or_default().is_empty()
        });
        for e in entries.iter_mut() {
            e.api_version = None;
            e.fields_type = None;
            if let Some(fields) = e.fields_v1.as_mut() {
                fields.0 = crate::fields::intern(&fields.0);
            }
        }
        entries.shrink_to_fit();
    }
    if let Some(owners) = meta.owner_references.as_mut() {
        owners.shrink_to_fit();
    }
    if let Some(finalizers) = meta.finalizers.as_mut() {
        finalizers.shrink_to_fit();
    }
    if let Some(annotations) = meta.annotations.as_mut() {
        annotations.remove(LAST_APPLIED);
        if let Some(digest) = annotations.remove(crate::object::APPLIED_ANNOTATION) {
            meta.labels
                .get_or_insert_with(Default::default)
                .insert(crate::object::APPLIED_ANNOTATION.to_string(), digest);
        }
        if annotations.is_empty() {
            meta.annotations = None;
        }
    }
}

/// [`trim`] for a store of metadata only ([`crate::controller::watch_metadata`]): also drops
/// the type fields (the store's type says them) and, with [`Owners::Dropped`] (a store whose
/// objects are found by label), the owner references.
pub fn trim_metadata<K: Resource>(obj: &mut PartialObjectMeta<K>, owners: Owners) {
    trim(obj);
    obj.types = None;
    if owners == Owners::Dropped {
        obj.metadata.owner_references = None;
    }
}

/// Whether a metadata store keeps its objects' owner references.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Owners {
    /// Kept: something maps an object to its owner through them
    /// ([`crate::controller::Controller::owns_watched`]).
    Kept,
    /// Dropped: the owner is found by a label (about 0.3 KiB less per object).
    Dropped,
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{LAST_APPLIED, trim};

    use futures::StreamExt;
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::runtime::reflector;
    use kube::runtime::watcher::Event;

    use super::Cache;

    /// The first reconciles after a start or a failover each wait for the cache to list: all
    /// of them wake when it has, none sleeps until its own timeout. (On kube-runtime 5's
    /// `Store::wait_until_ready` only the last of them woke; the others waited the 10 s.)
    fn named(name: &str) -> ConfigMap {
        let mut map = ConfigMap::default();
        map.metadata.name = Some(name.to_string());
        map
    }

    #[tokio::test(start_paused = true)]
    async fn every_concurrent_waiter_wakes_when_the_cache_lists() {
        const WAITERS: usize = 8;
        const BOUND: Duration = super::CACHE_WAIT;
        let (reader, writer) = reflector::store::<ConfigMap>();
        let (tx, events) = futures::channel::mpsc::unbounded();
        let (cache, stream) = Cache::follow(
            reader,
            reflector::reflector(writer, events.map(Ok::<_, kube::runtime::watcher::Error>))
                .filter_map(|e| futures::future::ready(e.ok())),
        );
        let drive = tokio::spawn(stream.for_each(|_| futures::future::ready(())));
        let start = tokio::time::Instant::now();
        let waiters: Vec<_> = (0..WAITERS)
            .map(|_| {
                let cache = cache.clone();
                tokio::spawn(async move {
                    let listed = tokio::time::timeout(BOUND, cache.listed()).await;
                    (listed, start.elapsed())
                })
            })
            .collect();
        // Every waiter is waiting before the list completes.
        tokio::task::yield_now().await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        for event in [Event::Init, Event::InitApply(named("a")), Event::InitDone] {
            tx.unbounded_send(event).expect("the reflector runs");
        }
        for waiter in waiters {
            let (listed, waited) = waiter.await.expect("the waiter does not panic");
            assert_eq!(listed, Ok(true), "a waiter timed out after {waited:?}");
            assert!(waited < BOUND, "a waiter woke only after {waited:?}");
        }
        assert!(cache.listed().await, "a later waiter returns at once");
        drop(tx);
        drive.await.expect("the reflector ends with its events");
    }

    /// [`Listed::all`] returns once every cache has listed, a re-list counting once.
    #[tokio::test(start_paused = true)]
    async fn all_waits_for_every_cache() {
        let feed = || {
            let (reader, writer) = reflector::store::<ConfigMap>();
            let (tx, events) = futures::channel::mpsc::unbounded();
            let events = events.map(Ok::<_, kube::runtime::watcher::Error>);
            let stream =
                reflector::reflector(writer, events).filter_map(|e| futures::future::ready(e.ok()));
            let (cache, stream) = Cache::follow(reader, stream);
            tokio::spawn(stream.for_each(|_| futures::future::ready(())));
            (cache.listed_handle(), tx)
        };
        let ((a, tx_a), (b, tx_b)) = (feed(), feed());
        let all = vec![a, b];
        let waiters: Vec<_> = (0..4)
            .map(|_| {
                let all = all.clone();
                tokio::spawn(async move { super::Listed::all(&all).await })
            })
            .collect();
        for event in [Event::Init, Event::InitDone, Event::Init, Event::InitDone] {
            tx_a.unbounded_send(event).expect("the reflector runs");
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(
            waiters.iter().all(|w| !w.is_finished()),
            "one cache has not listed yet"
        );
        tx_b.unbounded_send(Event::InitDone)
            .expect("the reflector runs");
        for waiter in waiters {
            let all_listed = tokio::time::timeout(Duration::from_secs(1), waiter)
                .await
                .expect("every waiter wakes")
                .expect("no panic");
            assert!(all_listed);
        }
    }

    #[test]
    fn trim_keeps_the_applies_of_the_object_and_drops_the_rest() {
        let entry = |manager: &str, operation: &str, subresource: Option<&str>| {
            serde_json::json!({"manager": manager, "operation": operation,
                "subresource": subresource, "fieldsType": "FieldsV1",
                "fieldsV1": {"f:data": {"f:k": {}}}})
        };
        let mut cm: ConfigMap = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "a", "annotations": {LAST_APPLIED: "{}", "keep": "me"},
                "managedFields": [entry("op", "Apply", None), entry("kubectl", "Update", None),
                    entry("kcm", "Update", Some("status")), entry("op", "Apply", Some("status")),
                    entry("gitops", "Apply", None)]},
            "data": {"k": "v"},
        }))
        .unwrap_or_default();
        trim(&mut cm);
        let managers: Vec<(&str, &str)> = cm
            .metadata
            .managed_fields
            .iter()
            .flatten()
            .map(|e| {
                (
                    e.manager.as_deref().unwrap_or_default(),
                    e.operation.as_deref().unwrap_or_default(),
                )
            })
            .collect();
        assert_eq!(managers, vec![("op", "Apply"), ("gitops", "Apply")]);
        let packed = cm.metadata.managed_fields.iter().flatten().map(|e| {
            let fields = &e
                .fields_v1
                .as_ref()
                .map(|f| f.0.clone())
                .unwrap_or_default();
            (fields.is_string(), crate::fields::owned(fields))
        });
        let data_k = crate::fields::Paths::from([vec!["data".to_string(), "k".to_string()]]);
        for (is_string, fields) in packed {
            assert!(is_string);
            assert_eq!(fields.as_deref(), Some(&data_k));
        }
        let annotations = cm.metadata.annotations.unwrap_or_default();
        assert_eq!(annotations.keys().collect::<Vec<_>>(), vec!["keep"]);
        assert_eq!(cm.data.unwrap_or_default()["k"], "v");
    }
}
