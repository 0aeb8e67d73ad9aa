//! A watch cache with an index by one label's value: [`Indexed`].
//!
//! A reconcile that finds "the objects of this owner" by scanning a store costs O(N) per
//! reconcile, and so O(N²) for a resync or a convergence of N owners: at 10 000 Tenants the
//! tenant-operator's scans of its child stores (namespaces, quotas, the children it prunes)
//! took more CPU than the API server (`docs/benchmarks.md`). [`Indexed`] keeps, next to the
//! store, the store's own objects grouped by the value of one label (the tenant label, an
//! owner label), updated by the same watch that fills the store, so [`Indexed::labelled`]
//! returns them without a scan.
//!
//! Start with [`Indexed::new`] and [`Indexed::follow`]; the store stays reachable (`Deref`), so
//! code that reads the store by key is unchanged.

use std::collections::HashMap;
use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
use std::sync::{Arc, RwLock};

use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher::Event;
use kube::{Resource, ResourceExt};

use crate::cache::Cache;
use crate::controller::Watch;

/// Objects grouped by the hash of a label value: the hash, not the value, is the key (8 bytes
/// per group instead of a string), so a lookup checks the label of what it finds.
type Groups<K> = HashMap<u64, Vec<Arc<K>>>;

/// A [`Cache`] and its objects grouped by the value of the label `label`.
///
/// # Guarantees
/// - [`Indexed::labelled`] returns exactly the objects of the store whose label has that
///   value, as the store holds them, once the watch's event that changed the store has been
///   passed on by [`Indexed::follow`] (the reflector writes the store first, then the event
///   reaches the index, then the controller): what a reconcile triggered by that event reads.
/// - The index holds the store's own `Arc`s: an object is not copied.
///
/// # Caveats
/// - Objects without the label are not indexed ([`Indexed::labelled`] never returns them).
/// - An object whose label value changes stays in its old group too until the next full
///   list (a lookup checks each object is still the store's, so it is not returned, but that
///   old version is kept alive until then); Steward's tenant and owner labels never change on
///   an object.
pub struct Indexed<K: Resource<DynamicType = ()> + Clone + 'static> {
    store: Cache<K>,
    label: &'static str,
    groups: Arc<RwLock<Groups<K>>>,
}

impl<K: Resource<DynamicType = ()> + Clone + 'static> Clone for Indexed<K> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            label: self.label,
            groups: Arc::clone(&self.groups),
        }
    }
}

impl<K: Resource<DynamicType = ()> + Clone + 'static> std::ops::Deref for Indexed<K> {
    type Target = Cache<K>;

    fn deref(&self) -> &Cache<K> {
        &self.store
    }
}

fn hash(value: &str) -> u64 {
    BuildHasherDefault::<DefaultHasher>::default().hash_one(value)
}

impl<K: Resource<DynamicType = ()> + Clone + Send + Sync + 'static> Indexed<K> {
    /// An index of `store` by `label`; empty until [`Indexed::follow`]'s watch runs.
    pub fn new(store: Cache<K>, label: &'static str) -> Self {
        Self {
            store,
            label,
            groups: Arc::default(),
        }
    }

    /// `watch` (the watch that fills the store), keeping the index up to date as its events
    /// pass.
    #[must_use]
    pub fn follow(&self, watch: Watch<K>) -> Watch<K> {
        let me = self.clone();
        watch.inspect(move |event| me.apply(event))
    }

    /// The store's objects whose label is `value`.
    pub fn labelled(&self, value: &str) -> Vec<Arc<K>> {
        let groups = self
            .groups
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        groups
            .get(&hash(value))
            .map(|group| {
                group
                    .iter()
                    .filter(|o| o.labels().get(self.label).map(String::as_str) == Some(value))
                    // Still the store's object (not one relabelled since, left in this group).
                    .filter(|o| {
                        self.store
                            .get(&ObjectRef::from_obj(o.as_ref()))
                            .is_some_and(|current| Arc::ptr_eq(&current, o))
                    })
                    .cloned()
                    .collect()
            })
            .unwrap_or_default()
    }

    fn key(&self, obj: &K) -> Option<u64> {
        obj.labels().get(self.label).map(|v| hash(v))
    }

    fn apply(&self, event: &Event<K>) {
        match event {
            // The reflector has replaced the store's object: index the store's copy.
            Event::Apply(obj) => {
                let Some(key) = self.key(obj) else { return };
                let Some(stored) = self.store.get(&ObjectRef::from_obj(obj)) else {
                    return;
                };
                let mut groups = self.write();
                let group = groups.entry(key).or_default();
                group.retain(|o| !same(o.as_ref(), obj));
                group.push(stored);
            }
            Event::Delete(obj) => {
                let Some(key) = self.key(obj) else { return };
                let mut groups = self.write();
                if let Some(group) = groups.get_mut(&key) {
                    group.retain(|o| !same(o.as_ref(), obj));
                    if group.is_empty() {
                        groups.remove(&key);
                    }
                }
            }
            // A full list replaced the store: regroup what it holds now.
            Event::InitDone => {
                let mut fresh = Groups::<K>::default();
                for obj in self.store.state() {
                    if let Some(key) = self.key(&obj) {
                        fresh.entry(key).or_default().push(obj);
                    }
                }
                *self.write() = fresh;
            }
            Event::Init | Event::InitApply(_) => {}
        }
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Groups<K>> {
        self.groups
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Whether `a` and `b` are the same object (name and namespace).
fn same<K: Resource>(a: &K, b: &K) -> bool {
    a.meta().name == b.meta().name && a.meta().namespace == b.meta().namespace
}

/// A mapper for a watch of `Target`s (for `Controller::watches*`): the objects of `store` that
/// refer to the changed target, as `refers(object, target_namespace, target_name)` says.
///
/// # Caveats
/// A scan of `store` per event of a target (not an index): for kinds that refer to few targets
/// and change rarely (Databases to their cluster, plans to their workloads, Tenants to shared
/// sources).
pub fn referring<K, Target>(
    store: Store<K>,
    refers: impl Fn(&K, &str, &str) -> bool + Send + Sync + 'static,
) -> impl Fn(Target) -> Vec<ObjectRef<K>> + Send + Sync + 'static
where
    K: Resource<DynamicType = ()> + Clone + Send + Sync + 'static,
    Target: Resource,
{
    move |target| {
        let namespace = target.meta().namespace.clone().unwrap_or_default();
        let name = target.meta().name.clone().unwrap_or_default();
        store
            .state()
            .iter()
            .filter(|obj| refers(obj, &namespace, &name))
            .map(|obj| ObjectRef::from_obj(obj.as_ref()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::runtime::reflector;

    use super::*;

    const LABEL: &str = "example.com/owner";

    fn cm(name: &str, owner: Option<&str>, data: &str) -> ConfigMap {
        let mut cm = ConfigMap::default();
        cm.metadata.name = Some(name.into());
        cm.metadata.namespace = Some("ns".into());
        cm.metadata.labels = owner.map(|o| [(LABEL.to_string(), o.to_string())].into());
        cm.data = Some([("v".to_string(), data.to_string())].into());
        cm
    }

    fn names(objects: &[Arc<ConfigMap>]) -> Vec<String> {
        let mut v: Vec<String> = objects.iter().map(|o| o.name_any()).collect();
        v.sort();
        v
    }

    /// Feeds `event` through the reflector's writer, then the index, in the order a watch
    /// stream does.
    fn feed(
        writer: &mut reflector::store::Writer<ConfigMap>,
        index: &Indexed<ConfigMap>,
        event: Event<ConfigMap>,
    ) {
        writer.apply_watcher_event(&event);
        index.apply(&event);
    }

    #[test]
    fn the_index_follows_lists_updates_and_deletes_and_holds_the_stores_objects() {
        let (store, mut writer) = reflector::store();
        let (cache, _) = crate::cache::Cache::follow(store, futures::stream::empty());
        let index = Indexed::new(cache, LABEL);
        feed(&mut writer, &index, Event::Init);
        for (name, owner) in [
            ("a", Some("x")),
            ("b", Some("x")),
            ("c", Some("y")),
            ("d", None),
        ] {
            feed(&mut writer, &index, Event::InitApply(cm(name, owner, "1")));
        }
        assert!(
            index.labelled("x").is_empty(),
            "nothing before the list is done"
        );
        feed(&mut writer, &index, Event::InitDone);
        assert_eq!(names(&index.labelled("x")), ["a", "b"]);
        assert_eq!(names(&index.labelled("y")), ["c"]);
        assert!(index.labelled("z").is_empty());

        feed(&mut writer, &index, Event::Apply(cm("b", Some("x"), "2")));
        feed(&mut writer, &index, Event::Apply(cm("e", Some("y"), "1")));
        let x = index.labelled("x");
        assert_eq!(
            names(&x),
            ["a", "b"],
            "an update replaces, never duplicates"
        );
        let b = x.iter().find(|o| o.name_any() == "b").expect("b");
        assert_eq!(
            b.data.as_ref().and_then(|d| d.get("v")).map(String::as_str),
            Some("2")
        );
        let stored = index
            .get(&ObjectRef::new("b").within("ns"))
            .expect("in the store");
        assert!(
            Arc::ptr_eq(b, &stored),
            "the index holds the store's own object"
        );
        assert_eq!(names(&index.labelled("y")), ["c", "e"]);

        feed(&mut writer, &index, Event::Delete(cm("a", Some("x"), "1")));
        assert_eq!(names(&index.labelled("x")), ["b"]);

        // A relabelled object leaves its old group on lookup.
        feed(&mut writer, &index, Event::Apply(cm("c", Some("x"), "1")));
        assert_eq!(names(&index.labelled("y")), ["e"]);
        assert_eq!(names(&index.labelled("x")), ["b", "c"]);

        // A relist replaces everything.
        feed(&mut writer, &index, Event::Init);
        feed(
            &mut writer,
            &index,
            Event::InitApply(cm("f", Some("x"), "1")),
        );
        feed(&mut writer, &index, Event::InitDone);
        assert_eq!(names(&index.labelled("x")), ["f"]);
        assert!(index.labelled("y").is_empty());
    }

    /// `referring` names the objects whose reference matches the changed target, in its
    /// namespace, and nothing else.
    #[test]
    fn referring_maps_a_target_to_the_objects_that_name_it() {
        let (store, mut writer) = reflector::store();
        // Each ConfigMap "refers" to the target named by its data.
        for (name, target) in [("a", "t1"), ("b", "t1"), ("c", "t2")] {
            writer.apply_watcher_event(&Event::Apply(cm(name, None, target)));
        }
        let mapper = referring(store, |obj: &ConfigMap, namespace, name| {
            obj.metadata.namespace.as_deref() == Some(namespace)
                && obj
                    .data
                    .as_ref()
                    .and_then(|d| d.get("v"))
                    .map(String::as_str)
                    == Some(name)
        });
        let refs = |target: ConfigMap| {
            let mut v: Vec<String> = mapper(target).into_iter().map(|r| r.name).collect();
            v.sort();
            v
        };
        assert_eq!(refs(cm("t1", None, "")), ["a", "b"]);
        assert_eq!(refs(cm("t2", None, "")), ["c"]);
        assert!(refs(cm("t3", None, "")).is_empty());
        let mut elsewhere = cm("t1", None, "");
        elsewhere.metadata.namespace = Some("other".into());
        assert!(
            refs(elsewhere).is_empty(),
            "a target of the same name in another namespace"
        );
    }
}
