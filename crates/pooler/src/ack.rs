//! The agent's acknowledgement of a pause, in the cluster's state ConfigMap
//! ([`state_config_map`]): key its pod's name, value the pause its PgBouncer finished. The
//! primary reads it before it stops for a switchover.
//!
//! Each agent writes only its own key, by server-side apply with its own field manager
//! (`steward-pooler/<pod>`): applying with the key sets it, applying without `data` removes
//! it (the field manager no longer claims it), and agents never conflict.
//!
//! # Caveats
//! The ConfigMap is the operator's (it owns and deletes it with the cluster); the agent never
//! creates it. An apply would, so the agent reads it first and applies only to the object it
//! read (its `uid` in the applied object); the window between the read and the apply is the
//! only one in which a deleted ConfigMap could come back without an owner.
//!
//! [`state_config_map`]: crate::contract::pooler::state_config_map

use std::time::Duration;

use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use kube::api::{Patch, PatchParams};

use crate::contract::pooler::state_config_map;

/// How long one API call may take.
const API_BOUND: Duration = Duration::from_secs(10);

/// A failure writing the acknowledgement.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Reading the ConfigMap failed.
    #[error("failed to read ConfigMap {name}")]
    Read {
        name: String,
        #[source]
        source: kube::Error,
    },
    /// The apply failed.
    #[error("failed to apply the acknowledgement to ConfigMap {name}")]
    Apply {
        name: String,
        #[source]
        source: kube::Error,
    },
    /// The API server did not answer in time.
    #[error("the API server did not answer about ConfigMap {name} within {API_BOUND:?}")]
    Timeout { name: String },
}

/// What became of a write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Written {
    Done,
    /// No such ConfigMap (not created by the operator yet, or being deleted): nothing written.
    Missing,
}

/// The agent's key in its cluster's state ConfigMap.
#[derive(Clone)]
pub struct Acks {
    api: Api<ConfigMap>,
    name: String,
    pod: String,
    params: PatchParams,
}

/// The field manager of `pod`'s acknowledgements.
pub fn field_manager(pod: &str) -> String {
    format!("steward-pooler/{pod}")
}

/// The object `pod` applies: its key set to `pause`, or no `data` at all (`None`).
pub fn applied(name: &str, uid: Option<&str>, pod: &str, pause: Option<&str>) -> serde_json::Value {
    let mut object = serde_json::json!({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": { "name": name },
    });
    if let Some(uid) = uid {
        object["metadata"]["uid"] = uid.into();
    }
    if let Some(pause) = pause {
        object["data"] = serde_json::json!({ pod: pause });
    }
    object
}

impl Acks {
    pub fn new(client: kube::Client, namespace: &str, cluster: &str, pod: &str) -> Self {
        Acks {
            api: Api::namespaced(client, namespace),
            name: state_config_map(cluster),
            pod: pod.to_string(),
            params: PatchParams::apply(&field_manager(pod)).force(),
        }
    }

    /// Sets the agent's key to `pause`, or removes it (`None`).
    ///
    /// # Errors
    /// [`Error::Read`], [`Error::Apply`], [`Error::Timeout`].
    pub async fn write(&self, pause: Option<&str>) -> Result<Written, Error> {
        let timeout = || Error::Timeout {
            name: self.name.clone(),
        };
        let current = tokio::time::timeout(API_BOUND, self.api.get_opt(&self.name))
            .await
            .map_err(|_| timeout())?
            .map_err(|source| Error::Read {
                name: self.name.clone(),
                source,
            })?;
        let Some(current) = current else {
            return Ok(Written::Missing);
        };
        let object = applied(
            &self.name,
            current.metadata.uid.as_deref(),
            &self.pod,
            pause,
        );
        tokio::time::timeout(
            API_BOUND,
            self.api
                .patch(&self.name, &self.params, &Patch::Apply(&object)),
        )
        .await
        .map_err(|_| timeout())?
        .map_err(|source| Error::Apply {
            name: self.name.clone(),
            source,
        })?;
        Ok(Written::Done)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ack_applies_only_the_agents_key_to_the_object_read() {
        assert_eq!(
            applied(
                "pg-pooler-state",
                Some("u-1"),
                "pg-pooler-abc",
                Some("pg-1/17")
            ),
            serde_json::json!({
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": { "name": "pg-pooler-state", "uid": "u-1" },
                "data": { "pg-pooler-abc": "pg-1/17" },
            })
        );
        assert_eq!(
            field_manager("pg-pooler-abc"),
            "steward-pooler/pg-pooler-abc"
        );
    }

    #[test]
    fn removing_applies_no_data() {
        let object = applied("pg-pooler-state", Some("u-1"), "pg-pooler-abc", None);
        assert!(object.get("data").is_none(), "{object}");
    }
}
