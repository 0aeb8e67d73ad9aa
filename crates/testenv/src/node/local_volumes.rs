//! A local-path provisioner of testenv's own, for several real nodes: StorageClass
//! [`STORAGE_CLASS`] (`volumeBindingMode: WaitForFirstConsumer`, `reclaimPolicy: Delete`)
//! gives each claim a directory on the node the scheduler chose for its first pod, as a
//! local disk would: a hostPath PersistentVolume `pvc-<claim uid>` at
//! `<node root>/volumes/pvc-<claim uid>`, pinned to that node (node affinity on
//! `kubernetes.io/hostname`), so its pod can run nowhere else. A released volume (its claim
//! deleted) is removed, directory and PersistentVolume.
//!
//! How a claim is provisioned, as an external provisioner does it: the scheduler picks a node
//! for the pod and writes it on the claim (`volume.kubernetes.io/selected-node`), the
//! PersistentVolume controller names the provisioner on it
//! (`volume.kubernetes.io/storage-provisioner`), and this creates the PersistentVolume bound
//! to the claim (`claimRef` with its uid); the controller completes the binding and the
//! scheduler binds the pod. Everything is on this host, so the directory is made here.
//!
//! It runs on a thread of its own (its own tokio runtime: a control plane outlives the test
//! that started it when a binary shares one), from the nodes' start until they are dropped.

use std::collections::BTreeMap;
use std::path::PathBuf;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use kube::api::{Api, DeleteParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};

use crate::Error;

/// The StorageClass of node-local volumes.
pub const STORAGE_CLASS: &str = "steward-local";
/// Its provisioner's name.
pub const PROVISIONER: &str = "testenv.steward.dev/local-path";
/// Where the scheduler writes the node it chose for a claim's first pod.
const SELECTED_NODE: &str = "volume.kubernetes.io/selected-node";
/// Who provisioned a PersistentVolume.
const PROVISIONED_BY: &str = "pv.kubernetes.io/provisioned-by";
const HOSTNAME: &str = "kubernetes.io/hostname";

/// The running provisioner; dropping it stops it.
pub(crate) struct LocalVolumes {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for LocalVolumes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LocalVolumes")
    }
}

/// What the provisioner needs to know of the nodes: each one's name and volume directory.
pub(crate) type Roots = BTreeMap<String, PathBuf>;

impl LocalVolumes {
    /// Creates the StorageClass (with `client`) and starts provisioning for the nodes of
    /// `roots`, with a client of its own made from `config`.
    ///
    /// # Errors
    /// [`Error::Kube`] if the StorageClass cannot be applied; [`Error::Other`] if the thread
    /// cannot start.
    pub(crate) async fn start(
        client: &Client,
        config: kube::Config,
        roots: Roots,
    ) -> Result<Self, Error> {
        crate::manifests::apply(client, &storage_class(), None, "steward-testenv", false)
            .await
            .map_err(|e| Error::Other(format!("StorageClass {STORAGE_CLASS}: {e}")))?;
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let thread = std::thread::Builder::new()
            .name("local-volumes".into())
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(runtime) => runtime,
                    Err(e) => {
                        eprintln!("steward-testenv: local volumes: no runtime: {e}");
                        return;
                    }
                };
                runtime.block_on(async move {
                    let client = match Client::try_from(config) {
                        Ok(client) => client,
                        Err(e) => {
                            eprintln!("steward-testenv: local volumes: no client: {e}");
                            return;
                        }
                    };
                    tokio::select! {
                        () = provision(client.clone(), &roots) => {}
                        () = reclaim(client, &roots) => {}
                        _ = stopped => {}
                    }
                });
            })
            .map_err(|e| Error::Other(format!("start the local volumes' thread: {e}")))?;
        Ok(Self {
            stop: Some(stop),
            thread: Some(thread),
        })
    }
}

impl Drop for LocalVolumes {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The StorageClass's manifest.
fn storage_class() -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "storage.k8s.io/v1", "kind": "StorageClass",
        "metadata": {"name": STORAGE_CLASS, "labels": {"steward.dev/node": "real"}},
        "provisioner": PROVISIONER,
        "volumeBindingMode": "WaitForFirstConsumer",
        "reclaimPolicy": "Delete",
    })
}

/// Creates a PersistentVolume for each claim of the class the scheduler chose a node for.
async fn provision(client: Client, roots: &Roots) {
    let claims: Api<PersistentVolumeClaim> = Api::all(client.clone());
    let volumes: Api<PersistentVolume> = Api::all(client);
    let mut events = std::pin::pin!(
        watcher(claims, watcher::Config::default())
            .default_backoff()
            .applied_objects()
    );
    while let Some(event) = events.next().await {
        let Ok(claim) = event else { continue };
        let Some(pv) = volume_for(&claim, roots) else {
            continue;
        };
        if let Err(e) = create(&volumes, pv).await {
            eprintln!(
                "steward-testenv: local volumes: claim {}/{}: {e}",
                claim.namespace().unwrap_or_default(),
                claim.name_any()
            );
        }
    }
}

/// The PersistentVolume `claim` needs, if it is of the class, unbound and its node chosen
/// (one of `roots`); its directory is made here.
fn volume_for(claim: &PersistentVolumeClaim, roots: &Roots) -> Option<PersistentVolume> {
    let spec = claim.spec.as_ref()?;
    if spec.storage_class_name.as_deref() != Some(STORAGE_CLASS) || spec.volume_name.is_some() {
        return None;
    }
    if claim.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let node = claim.annotations().get(SELECTED_NODE)?;
    let root = roots.get(node)?;
    let name = format!("pvc-{}", claim.uid()?);
    let size = spec.resources.as_ref()?.requests.as_ref()?.get("storage")?;
    let dir = root.join("volumes").join(&name);
    // Any user may write the directory, as with hostPath provisioners (a hostPath volume
    // takes no fsGroup); the pod makes what it needs inside with its own permissions.
    let made = std::fs::create_dir_all(&dir).and_then(|()| {
        std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o777))
    });
    if let Err(e) = made {
        eprintln!(
            "steward-testenv: local volumes: create {}: {e}",
            dir.display()
        );
        return None;
    }
    serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "PersistentVolume",
        "metadata": {
            "name": name,
            "labels": {"steward.dev/node": "real"},
            "annotations": {PROVISIONED_BY: PROVISIONER},
        },
        "spec": {
            "capacity": {"storage": size},
            "accessModes": spec.access_modes.clone().unwrap_or_else(|| vec!["ReadWriteOnce".into()]),
            "storageClassName": STORAGE_CLASS,
            "persistentVolumeReclaimPolicy": "Delete",
            "hostPath": {"path": dir.display().to_string(), "type": "Directory"},
            "nodeAffinity": {"required": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": HOSTNAME, "operator": "In", "values": [node]}]}
            ]}},
            "claimRef": {
                "apiVersion": "v1", "kind": "PersistentVolumeClaim",
                "namespace": claim.namespace(), "name": claim.name_any(), "uid": claim.uid(),
            },
        },
    }))
    .ok()
}

async fn create(volumes: &Api<PersistentVolume>, pv: PersistentVolume) -> Result<(), kube::Error> {
    match volumes.create(&PostParams::default(), &pv).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.is_already_exists() => Ok(()),
        Err(e) => Err(e),
    }
}

/// Removes the provisioned volumes whose claims are gone (`Released`): the directory, then
/// the PersistentVolume.
async fn reclaim(client: Client, roots: &Roots) {
    let volumes: Api<PersistentVolume> = Api::all(client);
    let mut events = std::pin::pin!(
        watcher(volumes.clone(), watcher::Config::default())
            .default_backoff()
            .applied_objects()
    );
    while let Some(event) = events.next().await {
        let Ok(pv) = event else { continue };
        if pv.annotations().get(PROVISIONED_BY).map(String::as_str) != Some(PROVISIONER)
            || pv.status.as_ref().and_then(|s| s.phase.as_deref()) != Some("Released")
        {
            continue;
        }
        let dir = roots
            .values()
            .map(|root| root.join("volumes").join(pv.name_any()))
            .find(|dir| dir.exists());
        if let Some(dir) = dir
            && let Err(e) = std::fs::remove_dir_all(&dir)
        {
            eprintln!(
                "steward-testenv: local volumes: remove {}: {e}",
                dir.display()
            );
            continue;
        }
        match volumes
            .delete(&pv.name_any(), &DeleteParams::default())
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.is_not_found() => {}
            Err(e) => eprintln!(
                "steward-testenv: local volumes: delete {}: {e}",
                pv.name_any()
            ),
        }
        // A failing delete is tried again at the watch's next event for it.
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(class: &str, node: Option<&str>) -> PersistentVolumeClaim {
        let mut claim: PersistentVolumeClaim = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "data-pg-0", "namespace": "ns", "uid": "u-1"},
            "spec": {"storageClassName": class, "accessModes": ["ReadWriteOnce"],
                     "resources": {"requests": {"storage": "1Gi"}}},
        }))
        .unwrap();
        if let Some(node) = node {
            claim
                .annotations_mut()
                .insert(SELECTED_NODE.into(), node.into());
        }
        claim
    }

    #[test]
    fn a_claim_gets_a_volume_on_the_node_chosen_for_it_and_only_then() {
        let dir = std::env::temp_dir().join(format!("local-volumes-{}", std::process::id()));
        let roots = Roots::from([("n-1".to_string(), dir.clone())]);
        assert!(volume_for(&claim(STORAGE_CLASS, None), &roots).is_none());
        assert!(volume_for(&claim("other", Some("n-1")), &roots).is_none());
        assert!(volume_for(&claim(STORAGE_CLASS, Some("elsewhere")), &roots).is_none());
        let pv = volume_for(&claim(STORAGE_CLASS, Some("n-1")), &roots).unwrap();
        let pv = serde_json::to_value(pv).unwrap();
        assert_eq!(pv["metadata"]["name"], "pvc-u-1");
        assert_eq!(pv["spec"]["claimRef"]["uid"], "u-1");
        assert_eq!(
            pv["spec"]["nodeAffinity"]["required"]["nodeSelectorTerms"][0]["matchExpressions"][0]["values"]
                [0],
            "n-1"
        );
        assert!(dir.join("volumes/pvc-u-1").is_dir());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
