//! Targets: reading a workload, the value a component changes in it, and the change itself.
//!
//! A change is a JSON patch with `test` operations: it replaces the container image (or
//! `spec.version`, or the field a `set` names) only if the value is still the one recorded as
//! `previous` (and the container index still holds that container). So a change is applied
//! at most once, and a concurrent edit by someone else makes the patch fail instead of being
//! overwritten. (A `set` on a field that was absent cannot test for the absence: it adds
//! the field.) Kinds other than the built-in four are read and patched as dynamic objects,
//! their API resource found by discovery.
//! A value the plan does not show as it is (a Secret's field, a field outside `/spec`: see
//! [`crate::redact`]) is compared through what the plan shows of it, and its change also
//! keeps the replaced value in an annotation of the target, which the revert restores it from.
//! (Server-side apply would make the orchestrator the owner of the field for good, and has no
//! compare-and-swap on a value.)

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment, StatefulSet};
use k8s_openapi::api::core::v1::PodSpec;
use kube::Client;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams};
use serde_json::{Value, json};

use crate::crd::{Component, FieldChange, TargetKind, TargetRef};
use crate::health::{self, Health};
use crate::redact::{self, Exposure};

/// `database.steward.dev/v1alpha1` PostgresCluster, addressed dynamically so this crate does
/// not depend on the database operator's types.
pub fn postgres_resource() -> ApiResource {
    ApiResource {
        group: "database.steward.dev".into(),
        version: "v1alpha1".into(),
        api_version: "database.steward.dev/v1alpha1".into(),
        kind: "PostgresCluster".into(),
        plural: "postgresclusters".into(),
    }
}

/// A target as read from the API server.
#[derive(Clone, Debug)]
pub enum Workload {
    Deployment(Box<Deployment>),
    StatefulSet(Box<StatefulSet>),
    DaemonSet(Box<DaemonSet>),
    Postgres(Box<DynamicObject>),
    /// Any other kind.
    Object(Box<DynamicObject>),
}

/// What the reconcile knows about one component's target.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Observation {
    /// The current image or version, or why there is none (target or container missing).
    pub value: Result<String, String>,
    /// The workload's rollout health for its current spec.
    pub health: Health,
}

impl Observation {
    /// A target that does not exist.
    pub fn missing(target: &TargetRef) -> Self {
        Self::unavailable(format!("{} {} not found", target.kind, target.name))
    }

    /// A target with no value to read, and why.
    fn unavailable(why: String) -> Self {
        Self {
            value: Err(why.clone()),
            health: Health::Progressing(why),
        }
    }

    /// A target the orchestrator may not read.
    pub fn forbidden(target: &TargetRef, message: &str) -> Self {
        Self::unavailable(format!(
            "{} {} cannot be read: {message} (grant the upgrade-orchestrator get and patch on it)",
            target.kind, target.name
        ))
    }

    /// The observation of `workload` for `component`, whose target keeps the value the
    /// component replaced in the annotation `kept` ([`redact::kept_annotation`]). A custom
    /// health rule is evaluated off the async workers, within its time limit
    /// ([`health::bounded`]).
    pub async fn of(component: &Component, workload: &Workload, kept: &str) -> Self {
        let health = match &component.health {
            Some(check) => match workload.to_json() {
                Ok(obj) => {
                    let quote = redact::exposure(component) == Exposure::Clear;
                    health::bounded(check, obj, quote).await
                }
                Err(e) => Health::Progressing(format!("unreadable target: {e}")),
            },
            None => workload.health(),
        };
        Self {
            value: workload.value(component, kept),
            health,
        }
    }
}

impl Workload {
    /// The object as JSON (what a custom health rule sees as `self`).
    fn to_json(&self) -> Result<Value, serde_json::Error> {
        match self {
            Workload::Deployment(d) => serde_json::to_value(d.as_ref()),
            Workload::StatefulSet(s) => serde_json::to_value(s.as_ref()),
            Workload::DaemonSet(d) => serde_json::to_value(d.as_ref()),
            Workload::Postgres(p) | Workload::Object(p) => serde_json::to_value(p.as_ref()),
        }
    }

    /// The workload's built-in health (see [`crate::health`]).
    pub fn health(&self) -> Health {
        match self {
            Workload::Deployment(d) => health::deployment(d),
            Workload::StatefulSet(s) => health::statefulset(s),
            Workload::DaemonSet(d) => health::daemonset(d),
            Workload::Postgres(p) => match serde_json::to_value(p.as_ref()) {
                Ok(v) => health::postgres(&v),
                Err(e) => Health::Progressing(format!("unreadable PostgresCluster: {e}")),
            },
            Workload::Object(o) => match serde_json::to_value(o.as_ref()) {
                Ok(v) => health::generic(&v),
                Err(e) => Health::Progressing(format!("unreadable target: {e}")),
            },
        }
    }

    fn pod_spec(&self) -> Option<&PodSpec> {
        match self {
            Workload::Deployment(d) => d.spec.template.spec.as_ref(),
            Workload::StatefulSet(s) => s.spec.template.spec.as_ref(),
            Workload::DaemonSet(d) => d.spec.template.spec.as_ref(),
            Workload::Postgres(_) | Workload::Object(_) => None,
        }
    }

    /// The index and image of `container` in the pod template.
    fn container(&self, container: &str) -> Result<(usize, String), String> {
        let spec = self
            .pod_spec()
            .ok_or_else(|| "the workload has no pod template".to_string())?;
        spec.containers
            .iter()
            .enumerate()
            .find(|(_, c)| c.name == container)
            .map(|(i, c)| (i, c.image.clone().unwrap_or_default()))
            .ok_or_else(|| format!("container {container:?} not found in the pod template"))
    }

    fn version(&self) -> Result<&Value, String> {
        match self {
            Workload::Postgres(p) => p
                .data
                .pointer("/spec/version")
                .ok_or_else(|| "spec.version is not set".to_string()),
            _ => Err("only a PostgresCluster has a version".into()),
        }
    }

    /// The value `component` changes, as it is now and as its plan shows it
    /// ([`redact::shown`]; `kept`: the annotation the target keeps the replaced value in).
    ///
    /// # Errors
    /// Why there is none (missing container, no `spec.version`).
    pub fn value(&self, component: &Component, kept: &str) -> Result<String, String> {
        if let Some(set) = &component.set {
            let current = self.field(set)?.to_string();
            let planned = set.value.to_string();
            let exposure = redact::exposure(component);
            let kept = self.annotation(kept);
            return Ok(redact::shown(exposure, &current, &planned, kept.as_deref()));
        }
        match (component.target.typed(), &component.image) {
            (Some(TargetKind::PostgresCluster), _) => self.version().map(version_string),
            (_, Some(change)) => self.container(&change.container).map(|(_, image)| image),
            (_, None) => Err("the component sets no image".into()),
        }
    }

    /// The JSON patch that changes `component`'s value from `from` to `to` (as its plan shows
    /// them, see [`Workload::value`]), guarded by `test` operations so it applies only while
    /// the value is still `from`.
    ///
    /// # Errors
    /// A message when the value is not `from` (any more) or cannot be found.
    pub fn change(
        &self,
        component: &Component,
        kept: &str,
        from: &str,
        to: &str,
    ) -> Result<json_patch::Patch, String> {
        if let Some(set) = &component.set {
            return match redact::exposure(component) {
                Exposure::Clear => self.set_field(set, from, to),
                exposure => self.set_unshown(component, set, exposure, kept, from, to),
            };
        }
        let ops = match (component.target.typed(), &component.image) {
            (Some(TargetKind::PostgresCluster), _) => {
                let current = self.version()?;
                if version_string(current) != from {
                    return Err(format!(
                        "spec.version is {}, not {from:?}",
                        version_string(current)
                    ));
                }
                // Keep the field's JSON type: a number stays a number.
                let new = match (current, to.parse::<i64>()) {
                    (Value::Number(_), Ok(n)) => json!(n),
                    _ => json!(to),
                };
                json!([
                    {"op": "test", "path": "/spec/version", "value": current},
                    {"op": "replace", "path": "/spec/version", "value": new},
                ])
            }
            (_, Some(change)) => {
                let (index, image) = self.container(&change.container)?;
                if image != from {
                    return Err(format!(
                        "container {:?} image is {image:?}, not {from:?}",
                        change.container
                    ));
                }
                let base = format!("/spec/template/spec/containers/{index}");
                json!([
                    {"op": "test", "path": format!("{base}/name"), "value": change.container},
                    {"op": "test", "path": format!("{base}/image"), "value": from},
                    {"op": "replace", "path": format!("{base}/image"), "value": to},
                ])
            }
            (_, None) => return Err("the component sets no image".into()),
        };
        serde_json::from_value(ops).map_err(|e| format!("invalid JSON patch: {e}"))
    }

    /// The value at `set.path` (`null` when absent).
    fn field(&self, set: &FieldChange) -> Result<Value, String> {
        let obj = self
            .to_json()
            .map_err(|e| format!("unreadable target: {e}"))?;
        Ok(obj.pointer(&set.path).cloned().unwrap_or(Value::Null))
    }

    /// The patch that sets `set.path` from the JSON text `from` to the JSON text `to`
    /// (`null`: remove the field).
    fn set_field(
        &self,
        set: &FieldChange,
        from: &str,
        to: &str,
    ) -> Result<json_patch::Patch, String> {
        let current = self.field(set)?;
        // Compared as JSON text: the string "2" and the number 2 differ.
        let text = current.to_string();
        if text != from {
            return Err(format!("{} is {text}, not {from}", set.path));
        }
        let new: Value = serde_json::from_str(to).map_err(|e| format!("{to} is not JSON: {e}"))?;
        let path = &set.path;
        let mut ops = Vec::new();
        if !current.is_null() {
            ops.push(json!({"op": "test", "path": path, "value": current}));
        }
        ops.push(match (current.is_null(), new.is_null()) {
            (_, true) => json!({"op": "remove", "path": path}),
            (true, false) => json!({"op": "add", "path": path, "value": new}),
            (false, false) => json!({"op": "replace", "path": path, "value": new}),
        });
        serde_json::from_value(Value::Array(ops)).map_err(|e| format!("invalid JSON patch: {e}"))
    }
}

impl Workload {
    /// The target's annotations, if it has any.
    fn annotations(&self) -> Option<&BTreeMap<String, String>> {
        match self {
            Workload::Deployment(d) => d.metadata.annotations.as_ref(),
            Workload::StatefulSet(s) => s.metadata.annotations.as_ref(),
            Workload::DaemonSet(d) => d.metadata.annotations.as_ref(),
            Workload::Postgres(p) | Workload::Object(p) => p.metadata.annotations.as_ref(),
        }
    }

    /// The patch that removes the annotation `key` (while it holds what it holds now), if the
    /// target has it.
    pub fn forget(&self, key: &str) -> Option<json_patch::Patch> {
        let value = self.annotation(key)?;
        let path = format!("/metadata/annotations/{}", redact::pointer_segment(key));
        serde_json::from_value(json!([
            {"op": "test", "path": path, "value": value},
            {"op": "remove", "path": path},
        ]))
        .ok()
    }

    /// The value of annotation `key`, if the target has it.
    fn annotation(&self, key: &str) -> Option<String> {
        self.annotations().and_then(|a| a.get(key)).cloned()
    }

    /// [`Workload::set_field`] for a value the plan does not show as it is
    /// ([`redact`]): `from` and `to` are what the plan shows. The change writes the value it
    /// replaces to the annotation `kept`, in the same patch; the revert (a `to` other than the
    /// plan's value) restores the field from that annotation, and removes it. No message
    /// quotes a value.
    fn set_unshown(
        &self,
        component: &Component,
        set: &FieldChange,
        exposure: Exposure,
        kept: &str,
        from: &str,
        to: &str,
    ) -> Result<json_patch::Patch, String> {
        let current = self.field(set)?;
        let planned = set.value.to_string();
        let kept_value = self.annotation(kept);
        let shown = |text: &str| redact::shown(exposure, text, &planned, kept_value.as_deref());
        let path = &set.path;
        let now = shown(&current.to_string());
        if now != from {
            return Err(format!("{path} is {now}, not {from}"));
        }
        let annotation = format!("/metadata/annotations/{}", redact::pointer_segment(kept));
        let mut ops = Vec::new();
        if !current.is_null() {
            ops.push(json!({"op": "test", "path": path, "value": current}));
        }
        let new = if to == shown(&planned) {
            // The change: keep what it replaces.
            let replaced = current.to_string();
            // Into the annotations, or as the first one.
            ops.push(if self.annotations().is_some() {
                json!({"op": "add", "path": annotation, "value": replaced})
            } else {
                json!({"op": "add", "path": "/metadata/annotations", "value": {kept: replaced}})
            });
            set.value.clone()
        } else {
            // The revert: back to the kept value, which must be the recorded one.
            let Some(previous) = kept_value.as_deref() else {
                return Err(format!(
                    "{} {}: the annotation {kept} that keeps the value to restore is gone, so {path} cannot be reverted",
                    component.target.kind, component.target.name
                ));
            };
            if shown(previous) != to {
                return Err(format!(
                    "the annotation {kept} keeps {}, not the recorded {to}",
                    shown(previous)
                ));
            }
            ops.push(json!({"op": "test", "path": annotation, "value": previous}));
            ops.push(json!({"op": "remove", "path": annotation}));
            serde_json::from_str(previous)
                .map_err(|_| format!("the annotation {kept} does not hold JSON"))?
        };
        ops.push(match (current.is_null(), new.is_null()) {
            (_, true) => json!({"op": "remove", "path": path}),
            (true, false) => json!({"op": "add", "path": path, "value": new}),
            (false, false) => json!({"op": "replace", "path": path, "value": new}),
        });
        serde_json::from_value(Value::Array(ops)).map_err(|_| "invalid JSON patch".to_string())
    }
}

fn version_string(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Reads `target` in `namespace`; `None` when it does not exist.
///
/// # Errors
/// The API error of the read.
pub async fn get(
    client: &Client,
    namespace: &str,
    target: &TargetRef,
) -> Result<Option<Workload>, kube::Error> {
    let name = target.name.as_str();
    let Some(kind) = target.typed() else {
        let Some(resource) = resource_of(client, target).await? else {
            return Ok(None);
        };
        return Ok(
            Api::<DynamicObject>::namespaced_with(client.clone(), namespace, &resource)
                .get_opt(name)
                .await?
                .map(|o| Workload::Object(Box::new(o))),
        );
    };
    Ok(match kind {
        TargetKind::Deployment => Api::<Deployment>::namespaced(client.clone(), namespace)
            .get_opt(name)
            .await?
            .map(|d| Workload::Deployment(Box::new(d))),
        TargetKind::StatefulSet => Api::<StatefulSet>::namespaced(client.clone(), namespace)
            .get_opt(name)
            .await?
            .map(|s| Workload::StatefulSet(Box::new(s))),
        TargetKind::DaemonSet => Api::<DaemonSet>::namespaced(client.clone(), namespace)
            .get_opt(name)
            .await?
            .map(|d| Workload::DaemonSet(Box::new(d))),
        TargetKind::PostgresCluster => {
            match Api::<DynamicObject>::namespaced_with(
                client.clone(),
                namespace,
                &postgres_resource(),
            )
            .get_opt(name)
            .await
            {
                Ok(p) => p.map(|p| Workload::Postgres(Box::new(p))),
                // The PostgresCluster CRD is not installed: the target does not exist.
                Err(kube::Error::Api(s)) if s.is_not_found() => None,
                Err(e) => return Err(e),
            }
        }
    })
}

/// Applies `patch` to `target` as `field_manager`, returning the workload as stored.
///
/// # Errors
/// The API error (a failed `test` operation included).
pub async fn patch(
    client: &Client,
    namespace: &str,
    target: &TargetRef,
    patch: json_patch::Patch,
    field_manager: &str,
    dry_run: bool,
) -> Result<Workload, kube::Error> {
    let params = PatchParams {
        field_manager: Some(field_manager.to_string()),
        dry_run,
        ..PatchParams::default()
    };
    let patch = Patch::Json::<()>(patch);
    let name = target.name.as_str();
    let Some(kind) = target.typed() else {
        let resource = resource_of(client, target).await?.ok_or_else(|| {
            kube::Error::Api(
                kube::core::Status::failure(
                    &format!(
                        "{} {} is not served",
                        target_api_version(target),
                        target.kind
                    ),
                    "NotFound",
                )
                .with_code(404)
                .boxed(),
            )
        })?;
        return Ok(Workload::Object(Box::new(
            Api::<DynamicObject>::namespaced_with(client.clone(), namespace, &resource)
                .patch(name, &params, &patch)
                .await?,
        )));
    };
    Ok(match kind {
        TargetKind::Deployment => Workload::Deployment(Box::new(
            Api::<Deployment>::namespaced(client.clone(), namespace)
                .patch(name, &params, &patch)
                .await?,
        )),
        TargetKind::StatefulSet => Workload::StatefulSet(Box::new(
            Api::<StatefulSet>::namespaced(client.clone(), namespace)
                .patch(name, &params, &patch)
                .await?,
        )),
        TargetKind::DaemonSet => Workload::DaemonSet(Box::new(
            Api::<DaemonSet>::namespaced(client.clone(), namespace)
                .patch(name, &params, &patch)
                .await?,
        )),
        TargetKind::PostgresCluster => Workload::Postgres(Box::new(
            Api::<DynamicObject>::namespaced_with(client.clone(), namespace, &postgres_resource())
                .patch(name, &params, &patch)
                .await?,
        )),
    })
}

fn target_api_version(target: &TargetRef) -> &str {
    target.api_version.as_deref().unwrap_or_default()
}

/// The API resource of a kind other than the built-in four, by discovery; `None` when the
/// API server does not serve it (the target then does not exist).
async fn resource_of(
    client: &Client,
    target: &TargetRef,
) -> Result<Option<ApiResource>, kube::Error> {
    let api_version = target_api_version(target);
    let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
    let gvk = GroupVersionKind::gvk(group, version, &target.kind);
    match kube::discovery::pinned_kind(client, &gvk).await {
        Ok((resource, _)) => Ok(Some(resource)),
        Err(kube::Error::Api(s)) if s.is_not_found() => Ok(None),
        Err(kube::Error::Discovery(_)) => Ok(None),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::ImageChange;

    /// The annotation the tests' targets keep a replaced value in.
    const K: &str = "upgrade.steward.dev/previous-0123456789abcdef";

    fn component(kind: TargetKind) -> Component {
        let pg = kind == TargetKind::PostgresCluster;
        Component {
            name: "c".into(),
            target: TargetRef::of(kind, "t"),
            image: (!pg).then(|| ImageChange {
                container: "app".into(),
                image: "app:2".into(),
            }),
            version: pg.then(|| "17".into()),
            depends_on: vec![],
            rollback: None,
            health: None,
            hooks: None,
            set: None,
        }
    }

    fn deployment() -> Workload {
        Workload::Deployment(Box::new(
            serde_json::from_value(json!({
                "metadata": {"name": "t"},
                "spec": {"selector": {}, "template": {"spec": {"containers": [
                    {"name": "sidecar", "image": "proxy:1"}, {"name": "app", "image": "app:1"}
                ]}}}
            }))
            .unwrap(),
        ))
    }

    fn postgres(version: Value) -> Workload {
        Workload::Postgres(Box::new(
            serde_json::from_value(json!({
                "apiVersion": "database.steward.dev/v1alpha1", "kind": "PostgresCluster",
                "metadata": {"name": "t"}, "spec": {"version": version}
            }))
            .unwrap(),
        ))
    }

    #[test]
    fn image_change_is_guarded_by_name_and_previous_image() {
        let c = component(TargetKind::Deployment);
        let w = deployment();
        assert_eq!(w.value(&c, K), Ok("app:1".into()));
        let patch = serde_json::to_value(w.change(&c, K, "app:1", "app:2").unwrap()).unwrap();
        assert_eq!(
            patch,
            json!([
                {"op": "test", "path": "/spec/template/spec/containers/1/name", "value": "app"},
                {"op": "test", "path": "/spec/template/spec/containers/1/image", "value": "app:1"},
                {"op": "replace", "path": "/spec/template/spec/containers/1/image", "value": "app:2"},
            ])
        );
        assert!(
            w.change(&c, K, "app:0", "app:2")
                .unwrap_err()
                .contains("not \"app:0\"")
        );
    }

    #[test]
    fn missing_container_has_no_value() {
        let mut c = component(TargetKind::Deployment);
        c.image = Some(ImageChange {
            container: "nope".into(),
            image: "x".into(),
        });
        assert!(
            deployment()
                .value(&c, K)
                .unwrap_err()
                .contains("\"nope\" not found")
        );
    }

    #[test]
    fn postgres_version_keeps_its_json_type() {
        let c = component(TargetKind::PostgresCluster);
        let numeric = postgres(json!(16));
        assert_eq!(numeric.value(&c, K), Ok("16".into()));
        let patch = serde_json::to_value(numeric.change(&c, K, "16", "17").unwrap()).unwrap();
        assert_eq!(
            patch[0],
            json!({"op": "test", "path": "/spec/version", "value": 16})
        );
        assert_eq!(
            patch[1],
            json!({"op": "replace", "path": "/spec/version", "value": 17})
        );
        let text = postgres(json!("16"));
        let patch = serde_json::to_value(text.change(&c, K, "16", "17").unwrap()).unwrap();
        assert_eq!(patch[1]["value"], json!("17"));
    }

    #[test]
    fn missing_target_is_an_observation() {
        let o = Observation::missing(&TargetRef::of(TargetKind::StatefulSet, "db"));
        assert_eq!(o.value, Err("StatefulSet db not found".into()));
    }

    fn config_map(data: Value) -> Workload {
        Workload::Object(Box::new(
            serde_json::from_value(json!({
                "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "t"}, "data": data
            }))
            .unwrap(),
        ))
    }

    fn set(path: &str, value: Value) -> Component {
        let mut c = component(TargetKind::Deployment);
        c.target = TargetRef {
            api_version: Some("v1".into()),
            namespace: None,
            kind: "ConfigMap".into(),
            name: "t".into(),
        };
        c.image = None;
        c.set = Some(FieldChange {
            path: path.into(),
            value,
        });
        c
    }

    fn widget(spec: Value) -> Workload {
        Workload::Object(Box::new(
            serde_json::from_value(json!({
                "apiVersion": "test.steward.dev/v1", "kind": "Widget", "metadata": {"name": "t"},
                "spec": spec
            }))
            .unwrap(),
        ))
    }

    fn set_on(api_version: &str, kind: &str, path: &str, value: Value) -> Component {
        let mut c = set(path, value);
        c.target.api_version = Some(api_version.into());
        c.target.kind = kind.into();
        c
    }

    #[test]
    fn a_field_change_is_json_text_guarded_by_the_previous_value() {
        let c = set_on(
            "test.steward.dev/v1",
            "Widget",
            "/spec/release",
            json!("2.0"),
        );
        assert_eq!(c.desired().as_deref(), Some("\"2.0\""));
        assert_eq!(c.target.typed(), None);
        let w = widget(json!({"release": "1.0"}));
        assert_eq!(w.value(&c, K), Ok("\"1.0\"".into()));
        let patch = serde_json::to_value(w.change(&c, K, "\"1.0\"", "\"2.0\"").unwrap()).unwrap();
        assert_eq!(
            patch,
            json!([
                {"op": "test", "path": "/spec/release", "value": "1.0"},
                {"op": "replace", "path": "/spec/release", "value": "2.0"},
            ])
        );
        assert!(
            w.change(&c, K, "\"0.9\"", "\"2.0\"")
                .unwrap_err()
                .contains("not \"0.9\"")
        );
        // Absent before: added, and a revert removes it again.
        let absent = widget(json!({}));
        assert_eq!(absent.value(&c, K), Ok("null".into()));
        let add = serde_json::to_value(absent.change(&c, K, "null", "\"2.0\"").unwrap()).unwrap();
        assert_eq!(
            add,
            json!([{"op": "add", "path": "/spec/release", "value": "2.0"}])
        );
        let changed = widget(json!({"release": "2.0"}));
        let revert =
            serde_json::to_value(changed.change(&c, K, "\"2.0\"", "null").unwrap()).unwrap();
        assert_eq!(revert[1], json!({"op": "remove", "path": "/spec/release"}));
        // A number stays a number.
        let replicas = set("/spec/replicas", json!(3));
        assert_eq!(replicas.desired().as_deref(), Some("3"));
    }

    /// `obj` with the annotation `K` holding `kept`.
    fn keeping(w: Workload, kept: &str) -> Workload {
        let Workload::Object(mut o) = w else {
            panic!("not an object")
        };
        o.metadata.annotations = Some([(K.to_string(), kept.to_string())].into());
        Workload::Object(o)
    }

    fn secret(data: Value) -> Workload {
        Workload::Object(Box::new(
            serde_json::from_value(json!({
                "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "t"}, "data": data
            }))
            .unwrap(),
        ))
    }

    #[test]
    fn a_field_outside_spec_is_shown_as_a_digest_and_kept_on_the_target() {
        let c = set("/data/release", json!("2.0"));
        let (d1, d2) = (redact::digest("\"1.0\""), redact::digest("\"2.0\""));
        assert_eq!(c.desired(), Some(d2.clone()));
        let w = config_map(json!({"release": "1.0"}));
        assert_eq!(w.value(&c, K), Ok(d1.clone()));
        // The change keeps the replaced value in the annotation, in the same patch.
        let patch = serde_json::to_value(w.change(&c, K, &d1, &d2).unwrap()).unwrap();
        assert_eq!(
            patch,
            json!([
                {"op": "test", "path": "/data/release", "value": "1.0"},
                {"op": "add", "path": "/metadata/annotations", "value": {K: "\"1.0\""}},
                {"op": "replace", "path": "/data/release", "value": "2.0"},
            ])
        );
        let stale = w
            .change(&c, K, &redact::digest("\"0.9\""), &d2)
            .unwrap_err();
        assert!(!stale.contains("1.0") && stale.contains(&d1), "{stale}");
        // The revert restores the kept value, tests and removes the annotation.
        let changed = keeping(config_map(json!({"release": "2.0"})), "\"1.0\"");
        assert_eq!(changed.value(&c, K), Ok(d2.clone()));
        let revert = serde_json::to_value(changed.change(&c, K, &d2, &d1).unwrap()).unwrap();
        let annotation = format!("/metadata/annotations/{}", K.replace('/', "~1"));
        assert_eq!(
            revert,
            json!([
                {"op": "test", "path": "/data/release", "value": "2.0"},
                {"op": "test", "path": annotation, "value": "\"1.0\""},
                {"op": "remove", "path": annotation},
                {"op": "replace", "path": "/data/release", "value": "1.0"},
            ])
        );
        // Without the annotation (or with another value in it) there is nothing to revert to.
        let gone = config_map(json!({"release": "2.0"}))
            .change(&c, K, &d2, &d1)
            .unwrap_err();
        assert!(gone.contains("is gone") && !gone.contains("1.0"), "{gone}");
        let other = keeping(config_map(json!({"release": "2.0"})), "\"0.9\"")
            .change(&c, K, &d2, &d1)
            .unwrap_err();
        assert!(!other.contains("0.9") && !other.contains("1.0"), "{other}");
    }

    #[test]
    fn a_secret_field_is_never_shown_not_even_as_a_digest() {
        let (old, new) = ("aHVudGVyMg==", "czNjcmV0");
        let c = set_on("v1", "Secret", "/data/password", json!(new));
        let shows = |text: &str| {
            for secret in [old, new] {
                let quoted = format!("\"{secret}\"");
                assert!(
                    !text.contains(secret) && !text.contains(&redact::digest(&quoted)),
                    "{text} shows {secret}"
                );
            }
        };
        assert_eq!(c.desired().as_deref(), Some(redact::PLANNED));
        let w = secret(json!({"password": old}));
        let before = w.value(&c, K).unwrap();
        assert_eq!(before, redact::BEFORE);
        let patch = w.change(&c, K, redact::BEFORE, redact::PLANNED).unwrap();
        assert_eq!(
            serde_json::to_value(&patch).unwrap(),
            json!([
                {"op": "test", "path": "/data/password", "value": old},
                {"op": "add", "path": "/metadata/annotations", "value": {K: format!("\"{old}\"")}},
                {"op": "replace", "path": "/data/password", "value": new},
            ])
        );
        let changed = keeping(secret(json!({"password": new})), &format!("\"{old}\""));
        assert_eq!(changed.value(&c, K).unwrap(), redact::PLANNED);
        let revert = changed
            .change(&c, K, redact::PLANNED, redact::BEFORE)
            .unwrap();
        assert_eq!(
            serde_json::to_value(&revert).unwrap()[3],
            json!({"op": "replace", "path": "/data/password", "value": old})
        );
        // Someone else's value, once the plan changed it, is neither.
        let edited = keeping(
            secret(json!({"password": "b3RoZXI="})),
            &format!("\"{old}\""),
        );
        assert_eq!(edited.value(&c, K).unwrap(), redact::OTHER);
        let refused = edited
            .change(&c, K, redact::PLANNED, redact::BEFORE)
            .unwrap_err();
        shows(&refused);
        assert!(!refused.contains("b3RoZXI="), "{refused}");
        // Absent before: the revert removes it again.
        let absent = secret(json!({}));
        assert_eq!(absent.value(&c, K).unwrap(), redact::BEFORE);
        let added = keeping(secret(json!({"password": new})), "null");
        let remove = serde_json::to_value(
            added
                .change(&c, K, redact::PLANNED, redact::BEFORE)
                .unwrap(),
        )
        .unwrap();
        assert_eq!(remove[3], json!({"op": "remove", "path": "/data/password"}));
        let gone = secret(json!({"password": new}))
            .change(&c, K, redact::PLANNED, redact::BEFORE)
            .unwrap_err();
        for shown in [before, c.desired().unwrap(), gone] {
            shows(&shown);
        }
        // Once the plan is over, the kept value is removed (while it is the one seen).
        let forget = serde_json::to_value(added.forget(K).unwrap()).unwrap();
        let annotation = format!("/metadata/annotations/{}", K.replace('/', "~1"));
        assert_eq!(
            forget,
            json!([
                {"op": "test", "path": annotation, "value": "null"},
                {"op": "remove", "path": annotation},
            ])
        );
        assert!(secret(json!({})).forget(K).is_none());
    }

    #[test]
    fn only_the_four_built_in_kinds_are_typed() {
        assert_eq!(
            TargetRef::of(TargetKind::DaemonSet, "d").typed(),
            Some(TargetKind::DaemonSet)
        );
        let with = |v: &str, k: &str| TargetRef {
            api_version: Some(v.into()),
            namespace: None,
            kind: k.into(),
            name: "x".into(),
        };
        assert_eq!(
            with("apps/v1", "Deployment").typed(),
            Some(TargetKind::Deployment)
        );
        assert_eq!(with("example.com/v1", "Deployment").typed(), None);
        assert_eq!(with("v1", "ConfigMap").typed(), None);
    }
}
