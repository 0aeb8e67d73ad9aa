//! Steward's operators as their images on the real node, deployed by `deploy/<operator>/` as a
//! user would deploy them (a Deployment of 2 replicas, its ServiceAccount and RBAC, probes,
//! restricted Pod Security): one piece of code for the real-node tests and `cargo xtask up`.
//!
//! ```no_run
//! # async fn f(cp: &steward_testenv::ControlPlane) -> Result<(), steward_testenv::Error> {
//! use steward_testenv::deploy;
//! let spec = deploy::Spec { name: "tenant-operator", companions: &[] };
//! let binaries = deploy::build(&[spec])?;
//! let deployed = deploy::operator(cp, &binaries[0], "my-test").await?;
//! deployed.wait_available(cp, std::time::Duration::from_secs(90)).await?;
//! # Ok(()) }
//! ```

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use serde_json::{Value, json};

use crate::{ControlPlane, Error, eventually};

/// An operator to build: its package (and binary) and the companion binaries its image
/// ships (steward-core's `Definition::COMPANIONS`; the registry `steward_operators::all()`
/// lists both).
#[derive(Clone, Copy, Debug)]
pub struct Spec<'a> {
    pub name: &'a str,
    pub companions: &'a [&'a str],
}

impl Spec<'static> {
    /// The spec of a registered operator (`steward_operators::all()`).
    pub fn of(entry: &steward_core::operator::Entry) -> Self {
        Self {
            name: entry.name,
            companions: entry.companions,
        }
    }
}

/// An operator's built (debug) binaries.
#[derive(Clone, Debug)]
pub struct Built {
    pub name: String,
    pub binary: PathBuf,
    /// Shipped next to it at `/usr/local/bin/<name>`.
    pub companions: Vec<PathBuf>,
}

/// Builds the (debug) binaries of `operators` and their companions (with the workspace's
/// other binaries: see [`crate::harness::cargo_build`]).
///
/// # Errors
/// As [`crate::harness::cargo_build`].
pub fn build(operators: &[Spec<'_>]) -> Result<Vec<Built>, Error> {
    let dir = crate::harness::cargo_build()?;
    Ok(operators
        .iter()
        .map(|op| Built {
            name: op.name.to_string(),
            binary: dir.join(op.name),
            companions: op.companions.iter().map(|c| dir.join(c)).collect(),
        })
        .collect())
}

/// An operator applied by [`operator`].
#[derive(Clone, Debug)]
pub struct Deployed {
    pub operator: String,
    /// Namespace and name of its Deployment.
    pub namespace: String,
    pub deployment: String,
    /// Desired replicas of the Deployment.
    pub replicas: i32,
    /// The image reference its pods run.
    pub image: String,
}

/// Builds the image of `binary` without its debug information (testenv's
/// [`crate::images::operator`], as `cargo xtask image` does), imports it into the control plane's real node, renders
/// `deploy/<operator>/` with that image (`imagePullPolicy: Never`) and server-side applies
/// every object as `field_manager`, namespaces first. Install `crds/` before.
///
/// # Errors
/// [`Error::Other`] without a real node or a Deployment in the kustomization; as
/// [`crate::images::operator`], [`crate::RealNode::import`], [`ControlPlane::kustomize`] and
/// [`crate::manifests::apply`].
pub async fn operator(
    cp: &ControlPlane,
    built: &Built,
    field_manager: &str,
) -> Result<Deployed, Error> {
    let kustomization = crate::workspace_root().join("deploy").join(&built.name);
    operator_from(cp, built, &kustomization, &[], field_manager).await
}

/// As [`operator`], from another kustomization (an overlay such as
/// `deploy/sharded/tenant-operator`), with `args` appended to the operator container's.
///
/// # Errors
/// As [`operator`].
pub async fn operator_from(
    cp: &ControlPlane,
    built: &Built,
    kustomization: &Path,
    args: &[&str],
    field_manager: &str,
) -> Result<Deployed, Error> {
    let operator = built.name.as_str();
    let image = image(cp, built).await?;
    let mut objects = cp.kustomize(kustomization)?;
    let deployment = with_image(&mut objects, &image.reference, args).ok_or_else(|| {
        Error::Other(format!(
            "{} renders no Deployment with a container",
            kustomization.display()
        ))
    })?;
    let client = cp.client()?;
    for obj in &objects {
        crate::manifests::apply(&client, obj, None, field_manager, false).await?;
    }
    Ok(Deployed {
        operator: operator.to_string(),
        namespace: deployment["metadata"]["namespace"]
            .as_str()
            .unwrap_or("default")
            .to_string(),
        deployment: deployment["metadata"]["name"]
            .as_str()
            .unwrap_or(operator)
            .to_string(),
        replicas: deployment["spec"]["replicas"]
            .as_i64()
            .and_then(|r| i32::try_from(r).ok())
            .unwrap_or(1),
        image: image.reference,
    })
}

/// Builds `built`'s image without debug information (testenv's [`crate::images::operator`],
/// as `cargo xtask image` does) and imports it into each of the control plane's real nodes; returns
/// its reference (`steward.dev/testenv/<operator>:dev`).
///
/// # Errors
/// [`Error::Other`] without a real node; as [`crate::images::operator`] and
/// [`crate::RealNode::import`].
pub async fn image(cp: &ControlPlane, built: &Built) -> Result<crate::images::Image, Error> {
    let operator = built.name.as_str();
    if cp.real_nodes().is_empty() {
        return Err(Error::Other(format!(
            "{operator} runs as its image only on a real node (Options {{ real_node: true, .. }})"
        )));
    }
    let image = {
        let built = built.clone();
        tokio::task::spawn_blocking(move || {
            let archive = cached_archive(&built)?;
            if archive.exists() {
                return Ok(crate::images::Image {
                    reference: reference(&built.name),
                    archive,
                });
            }
            let binary = without_debug_info(&built.binary, &archive.with_extension("bin"));
            let companions: Vec<PathBuf> = built
                .companions
                .iter()
                .map(|c| {
                    let name = c.file_name().unwrap_or_default().to_string_lossy();
                    without_debug_info(c, &archive.with_file_name(format!("{name}.bin")))
                })
                .collect();
            let name = built.name;
            let image = crate::images::operator(
                &binary,
                &companions,
                &name,
                &reference(&name),
                json!({}),
                &archive,
                false,
            );
            for stripped in std::iter::once(&binary).chain(&companions) {
                if stripped.starts_with(archive.parent().unwrap_or(&archive)) {
                    let _ = std::fs::remove_file(stripped);
                }
            }
            image
        })
        .await
        .map_err(|e| Error::Other(format!("building the {operator} image: {e}")))??
    };
    futures::future::try_join_all(cp.real_nodes().iter().map(|n| n.import(&image))).await?;
    Ok(image)
}

/// The reference of `operator`'s image.
fn reference(operator: &str) -> String {
    format!("steward.dev/testenv/{operator}:dev")
}

/// Where the image archive of `built` is cached (`<cache>/images/<operator>-<key>.oci.tar`),
/// keyed by the size and modification time of its binaries: every real-node test imports the
/// same build, and writing the archive (stripping, hashing 100–200 MB) took seconds each time.
/// Archives of earlier builds of the operator are removed.
fn cached_archive(built: &Built) -> Result<PathBuf, Error> {
    use sha2::{Digest, Sha256};
    let mut key = Sha256::new();
    for binary in std::iter::once(&built.binary).chain(&built.companions) {
        let meta = std::fs::metadata(binary).map_err(|source| Error::Io {
            what: format!("read {}", binary.display()),
            source,
        })?;
        let modified = meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .unwrap_or_default();
        key.update(binary.as_os_str().as_encoded_bytes());
        key.update(meta.len().to_le_bytes());
        key.update(modified.as_nanos().to_le_bytes());
    }
    let key = hex::encode(key.finalize());
    let dir = crate::binaries::cache_dir().join("images");
    let prefix = format!("{}-", built.name);
    let archive = dir.join(format!("{prefix}{}.oci.tar", &key[..16]));
    if !archive.exists()
        && let Ok(entries) = std::fs::read_dir(&dir)
    {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let earlier = name.strip_prefix(&prefix).is_some_and(|rest| {
                rest.len() == 16 + ".oci.tar".len() && rest.ends_with(".oci.tar")
            });
            if earlier {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
    Ok(archive)
}

/// A copy of `binary` at `copy` without debug information (`strip --strip-debug`: a debug
/// build's 250–360 MB become about a tenth, so the image is written and imported in a
/// fraction of the time), or `binary` itself if that fails.
fn without_debug_info(binary: &Path, copy: &Path) -> PathBuf {
    let stripped = std::process::Command::new("strip")
        .arg("--strip-debug")
        .arg("-o")
        .arg(copy)
        .arg(binary)
        .status()
        .is_ok_and(|s| s.success());
    if stripped {
        copy.to_path_buf()
    } else {
        binary.to_path_buf()
    }
}

/// Points the first container of the (first) Deployment in `objects` at `image`, never
/// pulled, and orders namespaces first; returns that Deployment.
fn with_image(objects: &mut [Value], image: &str, args: &[&str]) -> Option<Value> {
    objects.sort_by_key(|o| o["kind"] != "Namespace");
    let deployment = objects.iter_mut().find(|o| o["kind"] == "Deployment")?;
    let container = deployment["spec"]["template"]["spec"]["containers"].get_mut(0)?;
    container["image"] = json!(image);
    container["imagePullPolicy"] = json!("Never");
    if let Some(existing) = container["args"].as_array_mut() {
        existing.extend(args.iter().map(|a| json!(a)));
    } else if !args.is_empty() {
        container["args"] = json!(args);
    }
    // The database-operator's pods copy its instance manager from its own image.
    for env in container["env"].as_array_mut().into_iter().flatten() {
        if env["name"] == "STEWARD_INSTANCE_IMAGE" {
            env["value"] = json!(image);
        }
    }
    Some(deployment.clone())
}

impl Deployed {
    /// Waits until every replica of the Deployment is Ready (the kubelet's readiness probes
    /// pass); returns how long that took. The error lists each pod's phase, readiness,
    /// restarts and container state.
    ///
    /// # Errors
    /// [`Error::Timeout`], or [`Error::Kube`] if the client cannot be built.
    pub async fn wait_available(
        &self,
        cp: &ControlPlane,
        timeout: Duration,
    ) -> Result<Duration, Error> {
        let started = Instant::now();
        let client = cp.client()?;
        let deployments: Api<Deployment> = Api::namespaced(client.clone(), &self.namespace);
        let pods: Api<Pod> = Api::namespaced(client, &self.namespace);
        let selector =
            ListParams::default().labels(&format!("app.kubernetes.io/name={}", self.operator));
        let kubelet = cp.real_node().map(|n| n.log("kubelet"));
        eventually(
            &format!(
                "{}: {} replicas Ready (kubelet readiness probes)",
                self.operator, self.replicas
            ),
            timeout,
            || {
                let (deployments, pods, selector) =
                    (deployments.clone(), pods.clone(), selector.clone());
                async move {
                    let d = deployments
                        .get(&self.deployment)
                        .await
                        .map_err(|e| e.to_string())?;
                    let ready = d.status.and_then(|s| s.ready_replicas).unwrap_or(0);
                    if ready == self.replicas {
                        return Ok(());
                    }
                    let list = pods.list(&selector).await.map_err(|e| e.to_string())?;
                    Err(format!(
                        "{ready}/{} ready; {}",
                        self.replicas,
                        describe_pods(&list.items)
                    ))
                }
            },
        )
        .await
        .map_err(|e| match (e, kubelet) {
            (
                Error::Timeout {
                    what,
                    waited_secs,
                    last,
                },
                Some(log),
            ) => Error::Timeout {
                what,
                waited_secs,
                last: format!("{last}; kubelet log: {}", log.display()),
            },
            (e, _) => e,
        })?;
        Ok(started.elapsed())
    }
}

/// `name: phase, ready, restarts, state` of each pod, for messages.
pub fn describe_pods(pods: &[Pod]) -> String {
    pods.iter()
        .map(|p| {
            let status = p.status.clone().unwrap_or_default();
            let containers: Vec<String> = status
                .container_statuses
                .unwrap_or_default()
                .into_iter()
                .map(|c| {
                    let state = c.state.unwrap_or_default();
                    let state = if let Some(w) = state.waiting {
                        format!("waiting {}", w.reason.unwrap_or_default())
                    } else if let Some(t) = state.terminated {
                        format!(
                            "terminated {} ({})",
                            t.reason.unwrap_or_default(),
                            t.exit_code
                        )
                    } else if state.running.is_some() {
                        "running".to_string()
                    } else {
                        "unknown".to_string()
                    };
                    format!(
                        "{} ready={} restarts={} {state}",
                        c.name, c.ready, c.restart_count
                    )
                })
                .collect();
            format!(
                "{}: {} [{}]",
                p.metadata.name.clone().unwrap_or_default(),
                status.phase.unwrap_or_default(),
                containers.join(", ")
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_deployment_gets_the_local_image_and_namespaces_come_first() {
        let mut objects = vec![
            json!({"kind": "ServiceAccount", "metadata": {"name": "op", "namespace": "op-system"}}),
            json!({"kind": "Deployment", "metadata": {"name": "op", "namespace": "op-system"},
                "spec": {"replicas": 2, "template": {"spec": {"containers": [{"name": "operator", "image": "steward/op:0.1.0", "imagePullPolicy": "IfNotPresent"}]}}}}),
            json!({"kind": "Namespace", "metadata": {"name": "op-system"}}),
        ];
        let d = with_image(&mut objects, "steward.dev/testenv/op:dev", &[]).unwrap();
        assert_eq!(objects[0]["kind"], "Namespace");
        let container = &d["spec"]["template"]["spec"]["containers"][0];
        assert_eq!(container["image"], "steward.dev/testenv/op:dev");
        assert_eq!(container["imagePullPolicy"], "Never");
        assert_eq!(
            objects[2]["spec"]["template"]["spec"]["containers"][0]["image"],
            "steward.dev/testenv/op:dev",
            "the applied object is changed, not only the returned copy"
        );
        let mut none = vec![json!({"kind": "Namespace"})];
        assert!(with_image(&mut none, "x", &[]).is_none());
    }
}
