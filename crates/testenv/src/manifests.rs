//! Manifests as people write them: kustomize rendering and server-side apply of arbitrary
//! objects, shared by the deploy tests and `cargo xtask up`.

use std::path::Path;

use kube::Client;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams, TypeMeta};
use kube::discovery::Scope;
use serde::Deserialize;
use serde_json::Value;

use crate::{ControlPlane, Error};

impl ControlPlane {
    /// `kubectl kustomize <dir>` with the control plane's own kubectl: the objects, in order.
    ///
    /// # Errors
    /// As [`kustomize`].
    pub fn kustomize(&self, dir: &Path) -> Result<Vec<Value>, Error> {
        kustomize(&self.binaries().kubectl, dir)
    }
}

/// `<kubectl> kustomize <dir>`: the objects, in order.
///
/// # Errors
/// [`Error::Other`] with kubectl's message when the kustomization does not render.
pub fn kustomize(kubectl: &Path, dir: &Path) -> Result<Vec<Value>, Error> {
    {
        let out = std::process::Command::new(kubectl)
            .arg("kustomize")
            .arg(dir)
            .output()
            .map_err(|source| Error::Io {
                what: format!("run {} kustomize", kubectl.display()),
                source,
            })?;
        if !out.status.success() {
            return Err(Error::Other(format!(
                "kubectl kustomize {} failed ({}): {}",
                dir.display(),
                out.status,
                String::from_utf8_lossy(&out.stderr)
            )));
        }
        documents(&String::from_utf8_lossy(&out.stdout))
            .map_err(|e| Error::Other(format!("kubectl kustomize {}: output {e}", dir.display())))
    }
}

/// The YAML documents of a multi-document stream (`---`-separated), empty ones left out.
///
/// # Errors
/// [`Error::Other`] when a document is not YAML.
pub fn documents(text: &str) -> Result<Vec<Value>, Error> {
    let mut objects = Vec::new();
    for doc in serde_yaml::Deserializer::from_str(text) {
        let value = Value::deserialize(doc).map_err(|e| Error::Other(format!("not YAML: {e}")))?;
        if !value.is_null() {
            objects.push(value);
        }
    }
    Ok(objects)
}

/// `Kind namespace/name` of a manifest, for messages.
pub fn describe(obj: &Value) -> String {
    let kind = obj["kind"].as_str().unwrap_or_default();
    let name = obj["metadata"]["name"].as_str().unwrap_or_default();
    match obj["metadata"]["namespace"].as_str() {
        Some(ns) => format!("{kind} {ns}/{name}"),
        None => format!("{kind} {name}"),
    }
}

/// `objects` moved from namespace `from` to `to`: without the Namespace `from` (others, such as
/// the tenant-operator's `steward-shared`, stay), every string
/// equal to `from` (the objects' namespaces, subjects' namespaces) replaced by `to`. What the
/// Helm chart renders of `deploy/<operator>` (whose namespace is `<operator>-system`).
pub fn moved(objects: Vec<Value>, from: &str, to: &str) -> Vec<Value> {
    fn replace(value: &mut Value, from: &str, to: &str) {
        match value {
            Value::String(s) if s == from => *s = to.to_string(),
            Value::Array(items) => items.iter_mut().for_each(|v| replace(v, from, to)),
            Value::Object(map) => map.values_mut().for_each(|v| replace(v, from, to)),
            _ => {}
        }
    }
    objects
        .into_iter()
        .filter(|o| !(o["kind"] == "Namespace" && o["metadata"]["name"] == from))
        .map(|mut o| {
            replace(&mut o, from, to);
            o
        })
        .collect()
}

/// The `Api` for `obj`'s kind (found by discovery), in its namespace or `default_namespace`
/// (`default` if neither), and the resource it resolved to.
///
/// # Errors
/// [`Error::Other`] for a manifest without apiVersion/kind; [`Error::Kube`] when discovery fails.
pub async fn dynamic_api(
    client: &Client,
    obj: &Value,
    default_namespace: Option<&str>,
) -> Result<(Api<DynamicObject>, ApiResource), Error> {
    let types: TypeMeta = serde_json::from_value(obj.clone())
        .map_err(|e| Error::Other(format!("{} has no apiVersion/kind: {e}", describe(obj))))?;
    let gvk = GroupVersionKind::try_from(&types)
        .map_err(|e| Error::Other(format!("{}: {e}", describe(obj))))?;
    let (resource, caps) = kube::discovery::pinned_kind(client, &gvk)
        .await
        .map_err(|source| Error::Kube {
            what: format!("discover {}", types.api_version),
            source,
        })?;
    let api = match caps.scope {
        Scope::Namespaced => {
            let ns = obj["metadata"]["namespace"]
                .as_str()
                .or(default_namespace)
                .unwrap_or("default");
            Api::namespaced_with(client.clone(), ns, &resource)
        }
        Scope::Cluster => Api::all_with(client.clone(), &resource),
    };
    Ok((api, resource))
}

/// Server-side applies `obj` (forced) as `field_manager`, optionally as a dry run (`dryRun=All`).
///
/// # Errors
/// [`Error::Kube`] naming the object when the API server refuses it.
pub async fn apply(
    client: &Client,
    obj: &Value,
    default_namespace: Option<&str>,
    field_manager: &str,
    dry_run: bool,
) -> Result<DynamicObject, Error> {
    let (api, _) = dynamic_api(client, obj, default_namespace).await?;
    let mut params = PatchParams::apply(field_manager).force();
    if dry_run {
        params = params.dry_run();
    }
    let name = obj["metadata"]["name"].as_str().unwrap_or_default();
    api.patch(name, &params, &Patch::Apply(obj))
        .await
        .map_err(|source| Error::Kube {
            what: format!(
                "server-side apply{} {}",
                if dry_run { " (dry run)" } else { "" },
                describe(obj)
            ),
            source,
        })
}
