//! Faults of one node, as a machine has them: it loses power ([`RealNode::stop`]) and comes
//! back ([`RealNode::start_again`]) or is gone for good with its disks ([`RealNode::remove`]), it is cut off from the network ([`RealNode::partition`],
//! [`RealNode::heal`]), or an administrator drains it ([`drain`], as `kubectl drain` does).
//! Power and network faults need a node in a network namespace of its own
//! ([`crate::Options::real_nodes`] with at least two).

use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, EvictParams, ListParams, Patch, PatchParams};
use kube::{Client, ResourceExt};

use super::{RealNode, host_err, run_in, teardown};
use crate::{ControlPlane, Error};

/// The chain a partitioned node's traffic on its link goes to (in its network namespace).
const PARTITION: &str = "STEWARD-PARTITION";

/// The jumps to [`PARTITION`]: everything in or out of the node's link, its pods' traffic
/// included.
const PARTITION_JUMPS: [[&str; 3]; 4] = [
    ["INPUT", "-i", "eth0"],
    ["OUTPUT", "-o", "eth0"],
    ["FORWARD", "-i", "eth0"],
    ["FORWARD", "-o", "eth0"],
];

impl RealNode {
    fn own_namespace(&self, fault: &str) -> Result<(), Error> {
        if self.site.netns.is_none() {
            return Err(Error::Other(format!(
                "{fault} needs a node in a network namespace of its own: start several (Options::real_nodes)"
            )));
        }
        Ok(())
    }

    /// The node loses power: kubelet, kube-proxy, containerd, every shim and every process of
    /// its pods are SIGKILLed at once. Its state stays on disk (like a machine's), its Node
    /// object in the API (it goes `NotReady` once the controller manager's grace period has
    /// passed without a heartbeat). [`RealNode::start_again`] boots it.
    ///
    /// # Errors
    /// [`Error::Other`] for the only node (in the host's namespace); [`Error::Host`] naming
    /// processes that survived SIGKILL.
    pub fn stop(&mut self) -> Result<(), Error> {
        self.own_namespace("stop")?;
        for process in self.processes.iter_mut().rev() {
            process.kill();
        }
        self.stopped = true;
        let left = teardown::kill_site(&self.site);
        if left.is_empty() {
            Ok(())
        } else {
            Err(host_err(
                format!("stop node {}", self.site.name),
                left.join("; "),
            ))
        }
    }

    /// Whether [`RealNode::stop`] stopped the node (and it has not started again).
    pub fn is_stopped(&self) -> bool {
        self.stopped
    }

    /// Boots a stopped node again, as a machine coming back: containerd, kube-proxy and
    /// kubelet start on the state they left; kubelet finds the pods bound to it and starts
    /// them. Waits until the node is Ready.
    ///
    /// # Errors
    /// As [`crate::ControlPlane::start`] for a component that does not come up.
    pub async fn start_again(&mut self, client: &Client, timeout: Duration) -> Result<(), Error> {
        self.own_namespace("start_again")?;
        let _ = std::fs::remove_file(self.site.containerd_socket());
        self.processes[0].restart()?;
        self.wait_containerd(timeout).await?;
        self.processes[1].restart()?;
        self.processes[2].restart()?;
        self.stopped = false;
        self.wait_ready(client, timeout).await
    }

    /// The machine is gone for good: powered off as by [`RealNode::stop`] (unless it is
    /// already), the data of its local disks lost (its volumes' directories removed) and its
    /// Node object deleted, as an administrator or a cloud's node controller does for a
    /// machine that will not come back. The pods bound to it are then removed by the
    /// controller manager's pod garbage collector. [`RealNode::start_again`] boots it as a new,
    /// empty machine of the same name (it registers a new Node).
    ///
    /// # Errors
    /// As [`RealNode::stop`]; [`Error::Host`] if the volumes cannot be removed;
    /// [`Error::Kube`] if the Node cannot be deleted.
    pub async fn remove(&mut self, client: &Client) -> Result<(), Error> {
        if !self.stopped {
            self.stop()?;
        }
        let volumes = self.site.root.join("volumes");
        match std::fs::remove_dir_all(&volumes) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(host_err(
                    format!("remove {}", volumes.display()),
                    e.to_string(),
                ));
            }
        }
        match Api::<Node>::all(client.clone())
            .delete(self.name(), &Default::default())
            .await
        {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.is_not_found() => Ok(()),
            Err(source) => Err(Error::Kube {
                what: format!("delete node {}", self.name()),
                source,
            }),
        }
    }

    /// Cuts the node off: everything in or out of its link to the host is dropped (the API
    /// server, the other nodes, DNS, the test process), its pods' traffic included. Its
    /// processes keep running. [`RealNode::heal`] undoes it.
    ///
    /// # Errors
    /// [`Error::Other`] for the only node; [`Error::Host`] if iptables fails.
    pub fn partition(&self) -> Result<(), Error> {
        self.own_namespace("partition")?;
        run_in(&self.site, "iptables", &["-w", "-N", PARTITION])?;
        run_in(
            &self.site,
            "iptables",
            &["-w", "-A", PARTITION, "-j", "DROP"],
        )?;
        for [chain, direction, link] in PARTITION_JUMPS {
            run_in(
                &self.site,
                "iptables",
                &["-w", "-I", chain, "1", direction, link, "-j", PARTITION],
            )?;
        }
        Ok(())
    }

    /// Undoes [`RealNode::partition`].
    ///
    /// # Errors
    /// [`Error::Host`] if iptables fails (e.g. the node was not partitioned).
    pub fn heal(&self) -> Result<(), Error> {
        self.own_namespace("heal")?;
        for [chain, direction, link] in PARTITION_JUMPS {
            run_in(
                &self.site,
                "iptables",
                &["-w", "-D", chain, direction, link, "-j", PARTITION],
            )?;
        }
        run_in(&self.site, "iptables", &["-w", "-F", PARTITION])?;
        run_in(&self.site, "iptables", &["-w", "-X", PARTITION])
    }

    /// Drains the node as `kubectl drain` does: see [`drain`].
    ///
    /// # Errors
    /// As [`drain`].
    pub async fn drain(&self, cp: &ControlPlane, timeout: Duration) -> Result<(), Error> {
        drain(cp, self.name(), timeout).await
    }

    /// Makes the node schedulable again after [`RealNode::drain`].
    ///
    /// # Errors
    /// [`Error::Kube`] if the Node cannot be patched.
    pub async fn uncordon(&self, client: &Client) -> Result<(), Error> {
        cordon(client, self.name(), false).await
    }
}

async fn cordon(client: &Client, node: &str, unschedulable: bool) -> Result<(), Error> {
    Api::<Node>::all(client.clone())
        .patch(
            node,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"unschedulable": unschedulable}})),
        )
        .await
        .map(|_| ())
        .map_err(|source| Error::Kube {
            what: format!("cordon node {node}"),
            source,
        })
}

/// Whether `kubectl drain` leaves `pod` where it is: a DaemonSet's pod or a static pod's
/// mirror.
fn stays(pod: &Pod) -> bool {
    pod.annotations()
        .contains_key("kubernetes.io/config.mirror")
        || pod
            .owner_references()
            .iter()
            .any(|o| o.kind == "DaemonSet" && o.controller == Some(true))
}

/// Drains node `node` as `kubectl drain --ignore-daemonsets` does: cordons it, then evicts
/// each of its pods through the Eviction API (so PodDisruptionBudgets hold: an eviction they
/// refuse is tried again every second) until none is left, DaemonSet pods and static pods
/// aside.
///
/// # Errors
/// [`Error::Kube`] if the Node cannot be cordoned or its pods listed, [`Error::Unhealthy`]
/// naming the pods still there after `timeout` (and why their last eviction was refused).
pub async fn drain(cp: &ControlPlane, node: &str, timeout: Duration) -> Result<(), Error> {
    // kube's client retries a 429 on its own, with backoff, for minutes: a refused eviction
    // must come back at once, to be tried again (and the timeout to hold).
    let mut config = cp.config().clone();
    config.default_retry = false;
    let client = &Client::try_from(config).map_err(|source| Error::Kube {
        what: "make a client for the drain".into(),
        source,
    })?;
    cordon(client, node, true).await?;
    let pods: Api<Pod> = Api::all(client.clone());
    let on_node = ListParams::default().fields(&format!("spec.nodeName={node}"));
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let list = pods.list(&on_node).await.map_err(|source| Error::Kube {
            what: format!("list the pods of node {node}"),
            source,
        })?;
        let left: Vec<Pod> = list.items.into_iter().filter(|p| !stays(p)).collect();
        if left.is_empty() {
            return Ok(());
        }
        let mut refused = Vec::new();
        for pod in left
            .iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
        {
            let ns = pod.namespace().unwrap_or_default();
            let evicted = Api::<Pod>::namespaced(client.clone(), &ns)
                .evict(&pod.name_any(), &EvictParams::default())
                .await;
            match evicted {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.is_not_found() => {}
                Err(e) => refused.push(format!("{ns}/{}: {e}", pod.name_any())),
            }
        }
        if std::time::Instant::now() > deadline {
            let names: Vec<String> = left
                .iter()
                .map(|p| format!("{}/{}", p.namespace().unwrap_or_default(), p.name_any()))
                .collect();
            return Err(Error::Unhealthy {
                component: "drain",
                log: std::path::PathBuf::from(node),
                waited_secs: timeout.as_secs(),
                reason: format!(
                    "pods still on node {node}: {}; refused: {}",
                    names.join(", "),
                    refused.join("; ")
                ),
            });
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}
