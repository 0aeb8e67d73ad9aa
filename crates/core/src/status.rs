//! One status write per reconcile, by server-side apply, skipped when nothing changed, and
//! conditional on the version it was computed from.
//!
//! The write carries the `resourceVersion` of the object the reconcile read. If the object
//! changed since (a spec edit, or a newer leader's status write), the API server refuses it
//! with 409 Conflict and the write is skipped: the change triggers another reconcile, which
//! computes the status from the newer version. So a status computed by a leader that lost
//! its Lease can never overwrite what the new leader wrote, however late it arrives.
//!
//! "Nothing changed" is judged against the object the reconcile was given, which comes from
//! a cache: right after a status write, a reconcile triggered by a child can still see the
//! version from before that write. [`Written`] remembers what this process wrote on top of
//! which version, so that stale copy does not cause the same write again.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kube::api::{Api, Patch, PatchParams};
use kube::{Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::Error;

/// Writes `status` to `obj`'s status subresource by server-side apply under `field_manager`,
/// with `obj`'s resourceVersion as a precondition, unless it equals the status `obj` already
/// has. Returns whether a write happened: `false` also when `obj` is no longer the current
/// version (409 Conflict; the newer version is reconciled next).
///
/// # Errors
/// [`Error::WriteStatus`] when the API server rejects the patch for another reason.
pub async fn apply<K, S>(
    api: &Api<K>,
    obj: &K,
    current: Option<&S>,
    status: &S,
    field_manager: &str,
) -> Result<bool, Error>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug,
    S: Serialize + PartialEq,
{
    if current == Some(status) {
        return Ok(false);
    }
    let patch = serde_json::json!({
        "apiVersion": K::api_version(&()),
        "kind": K::kind(&()),
        "metadata": {"name": obj.name_any(), "resourceVersion": obj.resource_version()},
        "status": status,
    });
    match api
        .patch_status(
            &obj.name_any(),
            &PatchParams::apply(field_manager).force(),
            &Patch::Apply(&patch),
        )
        .await
    {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(status)) if status.code == 409 => {
            tracing::debug!(object = %obj.name_any(), version = ?obj.resource_version(), "status not written: the object changed since it was read");
            Ok(false)
        }
        Err(source) => Err(Error::WriteStatus {
            object: obj.name_any(),
            source,
        }),
    }
}

/// How long a write is remembered; by then the cache has long caught up.
const REMEMBER: Duration = Duration::from_secs(300);

/// The statuses this process wrote recently: per object UID, the resourceVersion the write was
/// based on and a hash of the status written.
#[derive(Clone, Debug, Default)]
pub struct Written {
    entries: Arc<Mutex<HashMap<String, Entry>>>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Entry {
    based_on: Option<String>,
    status: u64,
    at: Instant,
}

impl Written {
    /// Whether `status` is what this process already wrote on top of exactly this version of
    /// `obj` (which is then a stale copy). Forgets the object's entry once a newer version
    /// is seen.
    pub fn already<K: Resource, S: Serialize>(&self, obj: &K, status: &S) -> bool {
        let Some(uid) = obj.meta().uid.as_deref() else {
            return false;
        };
        let Ok(mut entries) = self.entries.lock() else {
            return false;
        };
        let hash = hash(status);
        let version = obj.meta().resource_version.as_deref();
        match entries.get(uid) {
            Some(e) if e.based_on.as_deref() == version => e.status == hash,
            Some(_) => {
                entries.remove(uid);
                false
            }
            None => false,
        }
    }

    /// Records that `status` was written on top of this version of `obj`.
    pub fn remember<K: Resource, S: Serialize>(&self, obj: &K, status: &S) {
        let Some(uid) = obj.meta().uid.clone() else {
            return;
        };
        if let Ok(mut entries) = self.entries.lock() {
            let now = Instant::now();
            entries.retain(|_, e| now.duration_since(e.at) < REMEMBER);
            entries.insert(
                uid,
                Entry {
                    based_on: obj.meta().resource_version.clone(),
                    status: hash(status),
                    at: now,
                },
            );
        }
    }
}

fn hash<S: Serialize>(status: &S) -> u64 {
    let mut h = DefaultHasher::new();
    serde_json::to_string(status)
        .unwrap_or_default()
        .hash(&mut h);
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ConfigMap;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn obj(version: &str) -> ConfigMap {
        ConfigMap {
            metadata: ObjectMeta {
                uid: Some("u1".into()),
                resource_version: Some(version.into()),
                ..ObjectMeta::default()
            },
            ..ConfigMap::default()
        }
    }

    #[test]
    fn a_stale_copy_does_not_repeat_the_write_but_a_newer_version_is_judged_by_itself() {
        let written = Written::default();
        assert!(!written.already(&obj("1"), &"ready"));
        written.remember(&obj("1"), &"ready");
        // The cache still holds version 1: the same status is not written again...
        assert!(written.already(&obj("1"), &"ready"));
        // ...but a different one is.
        assert!(!written.already(&obj("1"), &"degraded"));
        // Once version 2 (ours, or anybody's) is seen, the object itself is the truth.
        assert!(!written.already(&obj("2"), &"ready"));
        assert!(!written.already(&obj("1"), &"ready"), "forgotten");
    }
}
