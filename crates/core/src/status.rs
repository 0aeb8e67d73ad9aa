//! One status write per reconcile, by server-side apply, skipped when nothing changed.

use kube::api::{Api, Patch, PatchParams};
use kube::{Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::Error;

/// Writes `status` to `obj`'s status subresource by server-side apply under `field_manager`,
/// unless it equals the status `obj` already has. Returns whether a write happened.
///
/// # Errors
/// [`Error::WriteStatus`] when the API server rejects the patch.
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
        "status": status,
    });
    api.patch_status(
        &obj.name_any(),
        &PatchParams::apply(field_manager).force(),
        &Patch::Apply(&patch),
    )
    .await
    .map_err(|source| Error::WriteStatus {
        object: obj.name_any(),
        source,
    })?;
    Ok(true)
}
