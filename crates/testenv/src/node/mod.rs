//! A real worker node for the test control plane: kubelet, containerd (runc shim), the CNI
//! bridge, kube-proxy (iptables) and CoreDNS, run as local processes as root.
//!
//! # How it works
//! - The harness creates the bridge [`BRIDGE`] with the node's address [`GATEWAY`]; pods get
//!   addresses in [`POD_CIDR`], Services in [`SERVICE_CIDR`] — both in 198.18.0.0/15, the
//!   range reserved for benchmarking. A `STEWARD-NODE` chain in `FORWARD` drops anything
//!   routed between the bridge and another interface, so nothing leaves the machine.
//! - kubelet listens on the bridge address (the API server reaches it there for logs, exec
//!   and port-forward, `--kubelet-preferred-address-types=InternalIP,Hostname`); CoreDNS
//!   serves the cluster domain on the bridge address, kubelet's `clusterDNS`.
//! - No image can be pulled: the pause image and test images are built by
//!   [`crate::images`] and imported with `ctr -n k8s.io images import`.
//! - Host paths ([`NODE_ROOT`], [`NODE_RUN`], port 10250, `/var/lib/kubelet/device-plugins`)
//!   are fixed, so a machine runs one real node at a time: a file lock serializes them across
//!   test processes, and the teardown sweep removes what a crashed node left before a new one
//!   starts and when a node is dropped.
//!
//! Traps of this machine (cgroup v1, root without `CAP_SYS_RESOURCE`) are handled in
//! `node/config.rs`.

mod config;
pub mod teardown;

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Node;
use kube::Api;

use crate::binaries::{self, NodeBinaries};
use crate::images::{self, Image};
use crate::process::{Process, free_port, wait_healthy};
use crate::{ControlPlane, Error};
use config::Layout;

/// The node's name (and hostname).
pub const NODE_NAME: &str = "steward-node";
/// The bridge the pods are attached to.
pub const BRIDGE: &str = "steward0";
/// The node's address on the bridge: kubelet, CoreDNS and the pods' gateway.
pub const GATEWAY: &str = "198.18.0.1";
/// Pod addresses.
pub const POD_CIDR: &str = "198.18.0.0/24";
/// Service ClusterIPs (the API server's `--service-cluster-ip-range`).
pub const SERVICE_CIDR: &str = "198.19.0.0/16";
/// The cluster DNS domain.
pub const CLUSTER_DOMAIN: &str = "cluster.local";
/// kubelet's and containerd's persistent state.
pub const NODE_ROOT: &str = "/var/lib/steward-testenv-node";
/// Configuration, sockets and containerd's runtime state.
pub const NODE_RUN: &str = "/run/steward-testenv-node";
/// Held while a real node runs on this machine.
const LOCK: &str = "/run/steward-testenv-node.lock";

/// A running real node. Dropping it stops every component and removes all it left on the
/// host (see [`teardown`]).
pub struct RealNode {
    // Stopped in reverse order: kubelet, kube-proxy, CoreDNS, then containerd.
    processes: Vec<Process>,
    binaries: NodeBinaries,
    kube_proxy: PathBuf,
    imported: Mutex<HashSet<String>>,
    started_in: Duration,
    _lock: std::fs::File,
}

impl std::fmt::Debug for RealNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RealNode")
            .field("name", &NODE_NAME)
            .field("started_in", &self.started_in)
            .finish()
    }
}

fn host_err(what: impl Into<String>, reason: impl Into<String>) -> Error {
    Error::Host {
        what: what.into(),
        reason: reason.into(),
    }
}

/// Runs a host command (`ip`, `iptables`), failing with its stderr.
fn run(program: &str, args: &[&str]) -> Result<(), Error> {
    let out = std::process::Command::new(program)
        .args(args)
        .output()
        .map_err(|e| host_err(format!("run {program}"), e.to_string()))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(host_err(
            format!("run {program} {}", args.join(" ")),
            String::from_utf8_lossy(&out.stderr).trim().to_string(),
        ))
    }
}

impl RealNode {
    /// Starts a node registered with `cp` and waits until it is Ready, kube-proxy is healthy
    /// and CoreDNS answers.
    ///
    /// Waits for another real node on this machine (in another test process) to stop first.
    ///
    /// # Errors
    /// [`Error::Build`] if a component cannot be built, [`Error::Start`] or
    /// [`Error::Unhealthy`] naming the component and its log, [`Error::Host`] if the host
    /// network cannot be set up.
    pub(crate) async fn start(cp: &ControlPlane, timeout: Duration) -> Result<Self, Error> {
        let started = Instant::now();
        let lock = blocking(|| {
            let file = std::fs::File::create(LOCK)
                .map_err(|e| host_err(format!("create {LOCK}"), e.to_string()))?;
            if file.try_lock().is_err() {
                eprintln!("steward-testenv: waiting for the real node of another process ({LOCK})");
                file.lock()
                    .map_err(|e| host_err(format!("lock {LOCK}"), e.to_string()))?;
            }
            Ok(file)
        })
        .await?;
        let (binaries, pause) =
            blocking(|| Ok((binaries::ensure_node()?, images::pause()?))).await?;
        let kube_proxy = cp.binaries().kube_proxy.clone();
        {
            let kube_proxy = kube_proxy.clone();
            let problems = blocking(move || Ok(teardown::sweep(Some(&kube_proxy)))).await?;
            if !problems.is_empty() {
                return Err(host_err(
                    "remove what an earlier real node left",
                    problems.join("; "),
                ));
            }
        }
        let mut node = Self {
            processes: Vec::new(),
            binaries,
            kube_proxy,
            imported: Mutex::new(HashSet::new()),
            started_in: Duration::ZERO,
            _lock: lock,
        };
        node.boot(cp, &pause, timeout).await?;
        node.started_in = started.elapsed();
        Ok(node)
    }

    async fn boot(
        &mut self,
        cp: &ControlPlane,
        pause: &Image,
        timeout: Duration,
    ) -> Result<(), Error> {
        let logs = cp.dir().join("node");
        let io = |what: String| move |e: std::io::Error| host_err(what, e.to_string());
        std::fs::create_dir_all(&logs).map_err(io(format!("create {}", logs.display())))?;
        let layout = Layout {
            kubeconfig: cp.kubeconfig_path().to_path_buf(),
            shim: self.binaries.containerd_shim.clone(),
            runc: PathBuf::from("/usr/sbin/runc"),
            cni_bin: PathBuf::from("/usr/lib/cni"),
            kubelet_healthz_port: free_port()?,
            proxy_healthz_port: free_port()?,
            proxy_metrics_port: free_port()?,
            coredns_health_port: free_port()?,
            coredns_ready_port: free_port()?,
        };
        for (what, path) in [
            ("runc", &layout.runc),
            ("the CNI bridge plugin", &layout.cni_bin.join("bridge")),
        ] {
            if !path.exists() {
                return Err(Error::Start {
                    component: "real node",
                    log: path.clone(),
                    reason: format!(
                        "{what} is missing; install Debian's runc, containernetworking-plugins and iptables (cargo xtask test does)"
                    ),
                });
            }
        }
        let api_port = apiserver_port(cp)?;
        blocking(move || setup_host(api_port)).await?;
        let write = |path: PathBuf, text: String| {
            std::fs::write(&path, text).map_err(io(format!("write {}", path.display())))
        };
        std::fs::create_dir_all(Layout::cni_conf_dir())
            .map_err(io(format!("create {}", Layout::cni_conf_dir().display())))?;
        write(
            Layout::containerd_config(),
            config::containerd(&layout, images::PAUSE_REFERENCE),
        )?;
        write(
            Layout::cni_conf_dir().join("10-steward.conflist"),
            config::cni_conflist(),
        )?;
        write(Layout::kubelet_config(), config::kubelet(&layout))?;
        write(Layout::proxy_config(), config::kube_proxy(&layout))?;
        write(Layout::corefile(), config::corefile(&layout))?;
        write(Layout::resolv_conf(), String::new())?;

        // containerd, then the sandbox image.
        self.processes.push(Process::spawn(
            "containerd",
            &self.binaries.containerd,
            &[
                "--config".into(),
                Layout::containerd_config().display().to_string(),
                "--log-level=warn".into(),
            ],
            logs.join("containerd.log"),
        )?);
        let socket = Layout::containerd_socket();
        let ctr_bin = self.binaries.ctr.clone();
        self.wait(0, timeout, || {
            let ok = socket.exists() && ctr(&ctr_bin, &["version"]).is_ok();
            async move {
                if ok {
                    Ok(())
                } else {
                    Err("socket not answering".into())
                }
            }
        })
        .await?;
        self.import(pause).await?;

        let b = cp.binaries();
        self.processes.push(Process::spawn(
            "kube-proxy",
            &b.kube_proxy,
            &[
                format!("--config={}", Layout::proxy_config().display()),
                "--v=1".into(),
            ],
            logs.join("kube-proxy.log"),
        )?);
        self.processes.push(Process::spawn(
            "coredns",
            &self.binaries.coredns,
            &["-conf".into(), Layout::corefile().display().to_string()],
            logs.join("coredns.log"),
        )?);
        self.processes.push(Process::spawn(
            "kubelet",
            &b.kubelet,
            &[
                format!("--config={}", Layout::kubelet_config().display()),
                format!("--kubeconfig={}", cp.kubeconfig_path().display()),
                format!("--hostname-override={NODE_NAME}"),
                format!("--node-ip={GATEWAY}"),
                format!("--root-dir={}", Layout::kubelet_root().display()),
                format!("--cert-dir={}/pki", Layout::kubelet_root().display()),
                "--node-labels=steward.dev/node=real".into(),
                "--v=1".into(),
            ],
            logs.join("kubelet.log"),
        )?);

        let nodes: Api<Node> = Api::all(cp.client()?);
        self.wait(3, timeout, || {
            let nodes = nodes.clone();
            async move {
                let node = nodes
                    .get_opt(NODE_NAME)
                    .await
                    .map_err(|e| e.to_string())?
                    .ok_or_else(|| "node not registered yet".to_string())?;
                let ready = node
                    .status
                    .and_then(|s| s.conditions)
                    .unwrap_or_default()
                    .into_iter()
                    .find(|c| c.type_ == "Ready");
                match ready {
                    Some(c) if c.status == "True" => Ok(()),
                    Some(c) => Err(format!(
                        "Ready={}: {}",
                        c.status,
                        c.message.unwrap_or_default()
                    )),
                    None => Err("no Ready condition yet".into()),
                }
            }
        })
        .await?;
        let proxy = std::net::SocketAddr::from(([127, 0, 0, 1], layout.proxy_healthz_port));
        self.wait(
            1,
            timeout,
            || async move { http_ok(proxy, "/healthz").await },
        )
        .await?;
        let dns = std::net::SocketAddr::from(([127, 0, 0, 1], layout.coredns_ready_port));
        self.wait(2, timeout, || async move { http_ok(dns, "/ready").await })
            .await?;
        kubernetes_service_endpoints(cp).await
    }

    /// Polls `check` until it succeeds, failing early (with its log) if a component exited,
    /// or after `timeout` naming component `index`.
    async fn wait<F, Fut>(&mut self, index: usize, timeout: Duration, check: F) -> Result<(), Error>
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = Result<(), String>>,
    {
        wait_healthy(&mut self.processes, index, timeout, check).await
    }

    /// Imports an image archive into the node (`ctr -n k8s.io images import`) unless this node
    /// already has it. Pods name it by `image.reference` (with `imagePullPolicy: Never` or
    /// `IfNotPresent`).
    ///
    /// # Errors
    /// [`Error::Start`] naming containerd's log if the import fails.
    pub async fn import(&self, image: &Image) -> Result<(), Error> {
        if self.imported_has(&image.reference) {
            return Ok(());
        }
        let archive = image.archive.display().to_string();
        let ctr_bin = self.binaries.ctr.clone();
        let result = {
            let archive = archive.clone();
            blocking(move || {
                Ok(ctr(
                    &ctr_bin,
                    &["-n", "k8s.io", "images", "import", &archive],
                ))
            })
            .await?
        };
        if let Err(reason) = result {
            return Err(Error::Start {
                component: "containerd",
                log: self.log("containerd"),
                reason: format!("ctr images import {archive} failed: {reason}"),
            });
        }
        if let Ok(mut set) = self.imported.lock() {
            set.insert(image.reference.clone());
        }
        Ok(())
    }

    fn imported_has(&self, reference: &str) -> bool {
        self.imported
            .lock()
            .map(|s| s.contains(reference))
            .unwrap_or(false)
    }

    /// Builds (or finds cached) and imports the busybox image; returns its reference.
    ///
    /// # Errors
    /// As [`images::busybox`] and [`RealNode::import`].
    pub async fn busybox_image(&self) -> Result<String, Error> {
        let image = blocking(images::busybox).await?;
        self.import(&image).await?;
        Ok(image.reference)
    }

    /// Builds (or finds cached) and imports the PostgreSQL image; returns its reference.
    ///
    /// # Errors
    /// As [`images::postgresql`] and [`RealNode::import`].
    pub async fn postgresql_image(&self) -> Result<String, Error> {
        let image = blocking(images::postgresql).await?;
        self.import(&image).await?;
        Ok(image.reference)
    }

    /// Builds (or finds cached) and imports the PostgreSQL image of a PyPI bundle (a second
    /// major, see [`images::BUNDLED_POSTGRESQL`]); returns its reference.
    ///
    /// # Errors
    /// As [`images::postgresql_bundle`] and [`RealNode::import`].
    pub async fn postgresql_bundle_image(&self, version: &str) -> Result<String, Error> {
        let version = version.to_string();
        let image = blocking(move || images::postgresql_bundle(&version)).await?;
        self.import(&image).await?;
        Ok(image.reference)
    }

    /// A hostPath PersistentVolume on this node, with no StorageClass (the node has no
    /// provisioner): its directory `<NODE_ROOT>/volumes/<name>` is created owned by `owner`
    /// (uid and gid; fsGroup does not apply to hostPath volumes) and removed with the node.
    /// With `claim` (namespace, name) it is bound to that claim only. Apply the returned
    /// manifest.
    ///
    /// # Errors
    /// [`Error::Host`] if the directory cannot be created or chowned.
    pub fn volume(
        &self,
        name: &str,
        size: &str,
        claim: Option<(&str, &str)>,
        owner: u32,
    ) -> Result<serde_json::Value, Error> {
        let dir = Path::new(NODE_ROOT).join("volumes").join(name);
        std::fs::create_dir_all(&dir)
            .and_then(|()| std::os::unix::fs::chown(&dir, Some(owner), Some(owner)))
            .and_then(|()| {
                std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o750))
            })
            .map_err(|e| host_err(format!("create volume {}", dir.display()), e.to_string()))?;
        Ok(host_path_volume(name, size, &dir, claim))
    }

    /// The log of a node component: `containerd`, `kubelet`, `kube-proxy` or `coredns`.
    pub fn log(&self, component: &str) -> PathBuf {
        self.processes
            .iter()
            .find(|p| p.name == component)
            .map(|p| p.log.clone())
            .unwrap_or_else(|| PathBuf::from(format!("<no {component} on this node>")))
    }

    /// The node's name.
    pub fn name(&self) -> &'static str {
        NODE_NAME
    }

    /// Time from the start of the node (lock, build check, sweep) to a Ready node with DNS and
    /// kube-proxy.
    pub fn started_in(&self) -> Duration {
        self.started_in
    }

    /// containerd and CoreDNS versions.
    pub fn versions(&self) -> (String, String) {
        (
            self.binaries.containerd_version.clone(),
            self.binaries.coredns_version.clone(),
        )
    }
}

impl Drop for RealNode {
    fn drop(&mut self) {
        while let Some(p) = self.processes.pop() {
            drop(p);
        }
        let problems = teardown::sweep(Some(&self.kube_proxy));
        if !problems.is_empty() {
            eprintln!(
                "steward-testenv: real node teardown left: {}",
                problems.join("; ")
            );
        }
    }
}

/// The manifest of a hostPath PersistentVolume `name` of `size` at `path`, without a
/// StorageClass, optionally bound in advance to `claim` (namespace, name).
pub fn host_path_volume(
    name: &str,
    size: &str,
    path: &Path,
    claim: Option<(&str, &str)>,
) -> serde_json::Value {
    let mut pv = serde_json::json!({
        "apiVersion": "v1", "kind": "PersistentVolume",
        "metadata": {"name": name, "labels": {"steward.dev/node": "real"}},
        "spec": {
            "capacity": {"storage": size},
            "accessModes": ["ReadWriteOnce"],
            "storageClassName": "",
            "persistentVolumeReclaimPolicy": "Retain",
            "hostPath": {"path": path.display().to_string(), "type": "Directory"},
        },
    });
    if let Some((namespace, claim)) = claim {
        pv["spec"]["claimRef"] = serde_json::json!({"namespace": namespace, "name": claim});
    }
    pv
}

/// Points the `kubernetes` Service at the API server on the bridge address, so pods (operators
/// in-cluster) reach it (the API server's own endpoint reconciler is off).
async fn kubernetes_service_endpoints(cp: &ControlPlane) -> Result<(), Error> {
    use k8s_openapi::api::discovery::v1::EndpointSlice;
    use kube::api::{Patch, PatchParams};
    let port = apiserver_port(cp)?;
    let slice: EndpointSlice = serde_json::from_value(serde_json::json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": "kubernetes",
            "namespace": "default",
            "labels": {
                "kubernetes.io/service-name": "kubernetes",
                "endpointslice.kubernetes.io/managed-by": "steward-testenv",
            },
        },
        "addressType": "IPv4",
        "endpoints": [{"addresses": [GATEWAY], "conditions": {"ready": true}}],
        "ports": [{"name": "https", "port": port, "protocol": "TCP"}],
    }))
    .map_err(|e| Error::Other(format!("EndpointSlice manifest: {e}")))?;
    Api::<EndpointSlice>::namespaced(cp.client()?, "default")
        .patch(
            "kubernetes",
            &PatchParams::apply("steward-testenv").force(),
            &Patch::Apply(&slice),
        )
        .await
        .map(|_| ())
        .map_err(|source| Error::Kube {
            what: "point the kubernetes Service at the API server".into(),
            source,
        })
}

/// Host setup: sysctls (recorded for the teardown), the bridge with the node's address, the
/// chain that keeps pod traffic on the bridge and the one that keeps the node's listeners off
/// other interfaces.
fn setup_host(api_port: u16) -> Result<(), Error> {
    teardown::record_sysctls().map_err(|e| host_err("record sysctls", e.to_string()))?;
    if !Path::new("/proc/sys/net/bridge").exists() {
        let _ = std::process::Command::new("modprobe")
            .arg("br_netfilter")
            .output();
    }
    for (name, value) in [
        ("net/ipv4/ip_forward", "1"),
        ("net/bridge/bridge-nf-call-iptables", "1"),
    ] {
        std::fs::write(Path::new("/proc/sys").join(name), value)
            .map_err(|e| host_err(format!("set sysctl {name}={value}"), e.to_string()))?;
    }
    std::fs::create_dir_all(NODE_RUN)
        .map_err(|e| host_err(format!("create {NODE_RUN}"), e.to_string()))?;
    run("ip", &["link", "add", BRIDGE, "type", "bridge"])?;
    run(
        "ip",
        &["addr", "add", &format!("{GATEWAY}/24"), "dev", BRIDGE],
    )?;
    run("ip", &["link", "set", BRIDGE, "up"])?;
    run("iptables", &["-N", "STEWARD-NODE"])?;
    for rule in [
        ["-i", BRIDGE, "-o", BRIDGE, "-j", "ACCEPT"].as_slice(),
        &["-i", BRIDGE, "-j", "DROP"],
        &["-o", BRIDGE, "-j", "DROP"],
    ] {
        let mut args = vec!["-A", "STEWARD-NODE"];
        args.extend_from_slice(rule);
        run("iptables", &args)?;
    }
    run("iptables", &["-I", "FORWARD", "1", "-j", "STEWARD-NODE"])?;
    // What listens for the node (the API server on all addresses, kubelet, CoreDNS and
    // NodePorts on the bridge address) answers only on loopback and the bridge.
    let api_port = api_port.to_string();
    run("iptables", &["-N", "STEWARD-NODE-INPUT"])?;
    for rule in [
        ["-i", "lo", "-j", "RETURN"].as_slice(),
        &["-i", BRIDGE, "-j", "RETURN"],
        &["-d", "198.18.0.0/15", "-j", "DROP"],
        &["-p", "tcp", "--dport", &api_port, "-j", "DROP"],
    ] {
        let mut args = vec!["-A", "STEWARD-NODE-INPUT"];
        args.extend_from_slice(rule);
        run("iptables", &args)?;
    }
    run(
        "iptables",
        &["-I", "INPUT", "1", "-j", "STEWARD-NODE-INPUT"],
    )
}

/// The API server's port, from its URL.
fn apiserver_port(cp: &ControlPlane) -> Result<u16, Error> {
    cp.apiserver_url()
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .ok_or_else(|| Error::Other(format!("no port in {}", cp.apiserver_url())))
}

/// Runs `ctr` against the node's containerd.
fn ctr(binary: &Path, args: &[&str]) -> Result<String, String> {
    let out = std::process::Command::new(binary)
        .arg("--address")
        .arg(Layout::containerd_socket())
        .args(args)
        .output()
        .map_err(|e| e.to_string())?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).to_string())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).trim().to_string())
    }
}

async fn http_ok(addr: std::net::SocketAddr, path: &str) -> Result<(), String> {
    match crate::http_get(addr, path).await {
        Ok((200, _)) => Ok(()),
        Ok((code, body)) => Err(format!("GET {path}: {code} {body}")),
        Err(e) => Err(e.to_string()),
    }
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, Error> + Send + 'static,
) -> Result<T, Error> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::Other(format!("blocking task failed: {e}")))?
}
