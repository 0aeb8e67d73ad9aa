//! Kubernetes Events about the objects an operator manages.
//!
//! A thin wrapper over kube-runtime's [`Recorder`] that never fails a reconcile: a rejected
//! Event is logged and dropped. Messages are cut to the API's 1 kB limit.

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder as KubeRecorder, Reporter};
use kube::{Client, Resource};

/// Publishes Events as one operator (`reportingController`) and instance.
#[derive(Clone)]
pub struct Recorder {
    inner: KubeRecorder,
}

impl Recorder {
    pub fn new(client: Client, controller: &str, instance: Option<String>) -> Self {
        Self {
            inner: KubeRecorder::new(
                client,
                Reporter {
                    controller: controller.to_string(),
                    instance,
                },
            ),
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

    /// An event on any object reference.
    pub async fn publish(
        &self,
        reference: ObjectReference,
        type_: EventType,
        reason: &str,
        action: &str,
        mut note: String,
    ) {
        if note.len() > 1000 {
            let mut cut = 1000;
            while !note.is_char_boundary(cut) {
                cut -= 1;
            }
            note.truncate(cut);
        }
        let event = Event {
            type_,
            reason: reason.to_string(),
            note: Some(note),
            action: action.to_string(),
            secondary: None,
        };
        if let Err(e) = self.inner.publish(&event, &reference).await {
            tracing::warn!(error = %e, reason, "failed to publish an Event");
        }
    }
}
