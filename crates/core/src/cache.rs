//! A reflector's store and whether it has listed once: [`Cache`].

use futures::{Stream, StreamExt};
use kube::Resource;
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

    /// The handle [`Cache::listed`] waits on, for waiting on several caches at once.
    pub fn listed_handle(&self) -> Listed {
        self.listed.clone()
    }
}

/// Whether a reflector has listed once (from [`Cache::listed_handle`]): a `watch` channel set
/// by the first `InitDone` that passes its [`Watch`], so every waiter wakes.
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

impl<K: Resource<DynamicType = ()> + Clone + 'static> Cache<K> {
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
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

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
        const BOUND: Duration = crate::apply::CACHE_WAIT;
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
}
