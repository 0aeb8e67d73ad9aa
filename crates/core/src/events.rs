//! Kubernetes Events about the objects an operator manages.
//!
//! [`Recorder`] never fails a reconcile: a rejected Event is logged and dropped. Messages are
//! cut to the API's 1 kB limit.
//!
//! An Event that repeats one seen in the last few minutes — same object, type, reason, action
//! *and note* — is counted in the existing Event's `series` instead of creating another
//! object, as client-go does. Unlike kube-runtime's recorder, the note is part of that
//! identity: "corrected drift: A" followed by "corrected drift: B" are two Events, so what an
//! operator reports is never folded into an earlier, different message.
//!
//! Events are written through the core `v1` Events API with both field sets: the current ones
//! (`eventTime`, `series`, `action`, `reportingComponent`/`reportingInstance`, read as
//! `events.k8s.io/v1`'s `reportingController`) and the legacy ones client-go's recorder fills
//! (`firstTimestamp`, `lastTimestamp`, `count`, `source`), so `kubectl get events
//! --sort-by=.lastTimestamp` and tools that read only the legacy fields order and count them
//! right. (`events.k8s.io/v1` refuses the legacy fields: "needs to be unset".)

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use k8s_openapi::api::core::v1::{Event as KubeEvent, EventSeries, EventSource, ObjectReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, Time};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Patch, PatchParams, PostParams};
pub use kube::runtime::events::EventType;
use kube::{Api, Client, Resource};

/// How long a published Event is remembered for counting repeats (client-go uses 6 minutes).
const REPEAT_WINDOW: SignedDuration = SignedDuration::from_mins(6);

/// The API rejects notes longer than this many bytes.
const MAX_NOTE: usize = 1000;

/// Publishes Events as one operator (`reportingController`) and instance.
#[derive(Clone)]
pub struct Recorder {
    client: Client,
    controller: String,
    instance: String,
    recent: Arc<Mutex<HashMap<Key, Recent>>>,
}

/// What makes two Events the same occurrence.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Key {
    namespace: String,
    regarding: (
        Option<String>,
        Option<String>,
        Option<String>,
        Option<String>,
    ),
    type_: &'static str,
    reason: String,
    action: String,
    note: String,
}

/// The Event object already published for a [`Key`], how often it occurred and when last.
#[derive(Clone, Debug)]
struct Recent {
    name: String,
    count: i32,
    last: Timestamp,
}

/// An Event a decide step wants published: a value its unit tests can compare, published by
/// the execute step with [`Recorder::emit`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Wanted {
    /// Normal or Warning.
    pub type_: EventType,
    /// Why, in one CamelCase word (`reason`).
    pub reason: &'static str,
    /// What the operator did or failed to do (`action`).
    pub action: &'static str,
    /// The message.
    pub note: String,
}

impl Wanted {
    /// A Normal Event.
    pub fn normal(reason: &'static str, action: &'static str, note: impl Into<String>) -> Self {
        Self {
            type_: EventType::Normal,
            reason,
            action,
            note: note.into(),
        }
    }

    /// A Warning Event.
    pub fn warning(reason: &'static str, action: &'static str, note: impl Into<String>) -> Self {
        Self {
            type_: EventType::Warning,
            reason,
            action,
            note: note.into(),
        }
    }
}

impl Recorder {
    /// Publishes `event` on `obj`.
    pub async fn emit<K: Resource<DynamicType = ()>>(&self, obj: &K, event: Wanted) {
        self.publish(
            obj.object_ref(&()),
            event.type_,
            event.reason,
            event.action,
            event.note,
        )
        .await;
    }

    /// `controller` becomes the Events' `reportingController`, `instance` (default: the
    /// controller) their `reportingInstance`.
    pub fn new(client: Client, controller: &str, instance: Option<String>) -> Self {
        Self {
            client,
            controller: controller.to_string(),
            instance: instance.unwrap_or_else(|| controller.to_string()),
            recent: Arc::default(),
        }
    }

    /// A Normal event on `obj`.
    pub async fn normal<K: Resource<DynamicType = ()>>(
        &self,
        obj: &K,
        reason: &str,
        action: &str,
        note: impl Into<String>,
    ) {
        self.publish(
            obj.object_ref(&()),
            EventType::Normal,
            reason,
            action,
            note.into(),
        )
        .await;
    }

    /// A Warning event on `obj`.
    pub async fn warning<K: Resource<DynamicType = ()>>(
        &self,
        obj: &K,
        reason: &str,
        action: &str,
        note: impl Into<String>,
    ) {
        self.publish(
            obj.object_ref(&()),
            EventType::Warning,
            reason,
            action,
            note.into(),
        )
        .await;
    }

    /// An event on any object reference; a failure is logged.
    pub async fn publish(
        &self,
        reference: ObjectReference,
        type_: EventType,
        reason: &str,
        action: &str,
        note: String,
    ) {
        if let Err(e) = self
            .try_publish(reference, type_, reason, action, note)
            .await
        {
            tracing::warn!(error = %e, reason, "failed to publish an Event");
        }
    }

    async fn try_publish(
        &self,
        reference: ObjectReference,
        type_: EventType,
        reason: &str,
        action: &str,
        note: String,
    ) -> Result<(), kube::Error> {
        let now = Timestamp::now();
        let note = truncate(note, MAX_NOTE);
        let namespace = reference
            .namespace
            .clone()
            .unwrap_or_else(|| "default".to_string());
        let key = Key {
            namespace: namespace.clone(),
            regarding: (
                reference.api_version.clone(),
                reference.kind.clone(),
                reference.name.clone(),
                reference.uid.clone(),
            ),
            type_: type_name(type_),
            reason: reason.to_string(),
            action: action.to_string(),
            note,
        };
        let api: Api<KubeEvent> = Api::namespaced(self.client.clone(), &namespace);
        let repeat = self
            .recent
            .lock()
            .ok()
            .and_then(|mut recent| repeat_of(&mut recent, &key, now));
        let (name, count) = match repeat {
            Some((name, count)) => {
                let series = KubeEvent {
                    series: Some(EventSeries {
                        count: Some(count),
                        last_observed_time: Some(MicroTime(now)),
                    }),
                    count: Some(count),
                    last_timestamp: Some(Time(now)),
                    ..KubeEvent::default()
                };
                api.patch(&name, &PatchParams::default(), &Patch::Merge(&series))
                    .await?;
                (name, count)
            }
            None => {
                let event = self.build(&key, reference, now);
                let name = event.metadata.name.clone().unwrap_or_default();
                api.create(&PostParams::default(), &event).await?;
                (name, 1)
            }
        };
        if let Ok(mut recent) = self.recent.lock() {
            recent.insert(
                key,
                Recent {
                    name,
                    count,
                    last: now,
                },
            );
        }
        Ok(())
    }

    fn build(&self, key: &Key, regarding: ObjectReference, now: Timestamp) -> KubeEvent {
        let object = regarding.name.as_deref().unwrap_or(&self.controller);
        KubeEvent {
            metadata: ObjectMeta {
                name: Some(format!("{object}.{:x}", now.as_nanosecond())),
                namespace: Some(key.namespace.clone()),
                ..ObjectMeta::default()
            },
            event_time: Some(MicroTime(now)),
            type_: Some(key.type_.to_string()),
            reason: Some(key.reason.clone()),
            action: Some(key.action.clone()),
            message: Some(key.note.clone()),
            involved_object: regarding,
            reporting_component: Some(self.controller.clone()),
            reporting_instance: Some(self.instance.clone()),
            first_timestamp: Some(Time(now)),
            last_timestamp: Some(Time(now)),
            count: Some(1),
            source: Some(EventSource {
                component: Some(self.controller.clone()),
                host: None,
            }),
            ..KubeEvent::default()
        }
    }
}

/// If `key` occurred within the repeat window: the name of its Event and the occurrence
/// count including this one. Forgets Events older than the window.
fn repeat_of(
    recent: &mut HashMap<Key, Recent>,
    key: &Key,
    now: Timestamp,
) -> Option<(String, i32)> {
    recent.retain(|_, r| r.last + REPEAT_WINDOW > now);
    recent.get(key).map(|r| (r.name.clone(), r.count + 1))
}

fn type_name(type_: EventType) -> &'static str {
    match type_ {
        EventType::Normal => "Normal",
        EventType::Warning => "Warning",
    }
}

/// `s` cut to at most `max` bytes on a character boundary.
fn truncate(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut cut = max;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(note: &str) -> Key {
        Key {
            namespace: "ns".into(),
            regarding: (
                Some("v1".into()),
                Some("Pod".into()),
                Some("p".into()),
                None,
            ),
            type_: "Normal",
            reason: "DriftCorrected".into(),
            action: "Converge".into(),
            note: note.into(),
        }
    }

    #[test]
    fn a_repeat_counts_in_the_series_and_a_different_note_is_a_new_event() {
        let t0 = Timestamp::UNIX_EPOCH;
        let mut recent = HashMap::new();
        assert_eq!(repeat_of(&mut recent, &key("A"), t0), None);
        recent.insert(
            key("A"),
            Recent {
                name: "p.1".into(),
                count: 1,
                last: t0,
            },
        );
        let t1 = t0 + SignedDuration::from_secs(60);
        assert_eq!(
            repeat_of(&mut recent, &key("A"), t1),
            Some(("p.1".to_string(), 2))
        );
        assert_eq!(repeat_of(&mut recent, &key("B"), t1), None, "another note");
        // Past the window the Event is forgotten: the next occurrence is a new Event.
        let late = t0 + REPEAT_WINDOW + SignedDuration::from_secs(1);
        assert_eq!(repeat_of(&mut recent, &key("A"), late), None);
        assert!(recent.is_empty());
    }

    #[test]
    fn notes_are_cut_on_a_character_boundary() {
        assert_eq!(truncate("abc".into(), 10), "abc");
        assert_eq!(truncate("abcdef".into(), 4), "abcd");
        // "é" is two bytes: cutting at 2 would split it.
        assert_eq!(truncate("aé".into(), 2), "a");
    }
}
