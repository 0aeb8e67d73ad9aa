//! Real worker nodes for the test control plane: kubelet, containerd (runc shim), the CNI
//! bridge, kube-proxy (iptables) and CoreDNS, run as local processes as root.
//!
//! # How it works
//! - **One node** ([`Options::real_node`](crate::Options)): the harness creates the bridge
//!   [`BRIDGE`] with the node's address [`GATEWAY`] in the host's network namespace; pods get
//!   addresses in [`POD_CIDR`], Services in [`SERVICE_CIDR`] — both in 198.18.0.0/15, the
//!   range reserved for benchmarking. A `STEWARD-NODE` chain in `FORWARD` drops anything
//!   routed between the bridge and another interface, so nothing leaves the machine.
//! - **Several nodes** ([`Options::real_nodes`](crate::Options::real_nodes)): each node's
//!   containerd, kube-proxy and kubelet run in a network namespace of its own
//!   (`steward-node-<i>`, entered with `nsenter --net`: its own iptables, its own bridge and pod
//!   network `198.18.<i+1>.0/24`), linked by a veth pair to the host's bridge
//!   [`config::LINK_BRIDGE`] at `198.18.100.<i+2>`; the host routes each pod network to its
//!   node, and `STEWARD-NODE` keeps all of it on the link bridge. Each node has its own
//!   directories under [`NODE_ROOT`] and [`NODE_RUN`], its own containerd (images are imported
//!   into each), a cgroup root of its own (`/steward-node-<i>`, so no kubelet takes another's
//!   pods for orphans) and the label `topology.kubernetes.io/zone=zone-<i>`. The host keeps
//!   CoreDNS and a kube-proxy of its own (so the test process reaches Services), at
//!   [`config::LINK_HOST`], where the API server is reached too (the nodes' kubeconfig names it
//!   there and checks the certificate for the name `kubernetes`).
//! - **Two control planes** ([`ControlPlane::start_pair`](crate::ControlPlane::start_pair),
//!   two Kubernetes clusters on one host, for disaster recovery across clusters): the
//!   several-node layout for both, one node each too. The first's nodes are the host's nodes
//!   `0..a`, the second's `a..a+b` (names `steward-node-<i>`, network namespaces, link
//!   addresses `198.18.100.<i+2>`, pod networks `198.18.<i+1>.0/24`, directories and cgroup
//!   roots all follow the host's index; zones count from 0 in each cluster). Each control
//!   plane has its own Service CIDR (the halves of [`SERVICE_CIDR`]: `198.19.0.0/17`,
//!   `198.19.128.0/17`, [`PAIR_SERVICE_CIDRS`]), its own host address on the one link bridge
//!   ([`PAIR_HOSTS`]: `198.18.100.1` and `198.18.100.101`, where its nodes reach its API
//!   server and its CoreDNS, their `clusterDNS`, listens) and its own host-side kube-proxy:
//!   the first's in the host's namespace as for several nodes, the second's in a namespace of
//!   its own (`steward-node-svc-1` at `198.18.100.201`, `masqueradeAll` so replies come back
//!   through it), to which the host routes the second's Service CIDR — two kube-proxies
//!   cannot share a network namespace (each rewrites `KUBE-SERVICES` and deletes the service
//!   chains it does not know). What links the clusters is what a real deployment shares: the
//!   host (either host address, and an object store there, is reached by the pods of both)
//!   and routed pod addresses: a pod of one reaches a pod IP of the other (through the host,
//!   as pods of two nodes of one cluster do). Nothing else: neither's DNS knows the other's
//!   names, and a pod's Service addresses are its own cluster's. Both start on one claim of
//!   the machine (one lock, one sweep before either starts, one after both are dropped).
//! - kubelet listens on the node's address (the API server reaches it there for logs, exec
//!   and port-forward, `--kubelet-preferred-address-types=InternalIP,Hostname`); CoreDNS
//!   serves the cluster domain on the host's address, kubelet's `clusterDNS`.
//! - No image can be pulled: the pause image and test images are built by
//!   [`crate::images`] and imported with `ctr -n k8s.io images import`.
//! - Host paths ([`NODE_ROOT`], [`NODE_RUN`], the bridges, `/var/lib/kubelet/device-plugins`,
//!   which every kubelet shares: no test uses device plugins) are fixed, so a machine runs one
//!   set of real nodes (one control plane's, or a pair's) at a time: a file lock serializes
//!   them across test processes ([`Machine`], which a pair's control planes share), and the
//!   teardown sweep removes what a crashed node left before new ones start and when they are
//!   dropped.
//! - Node faults ([`RealNode::stop`], [`RealNode::start_again`], [`RealNode::partition`],
//!   [`drain`]) act on one node as a machine failing would.
//!
//! Traps of this machine (cgroup v1, root without `CAP_SYS_RESOURCE`) are handled in
//! `node/config.rs`.

mod config;
mod faults;
pub mod local_volumes;
pub mod teardown;

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Node;
use kube::Api;

use crate::Error;
use crate::binaries::{self, NodeBinaries};
use crate::images::{self, Image};
use crate::process::{Process, free_port, wait_healthy};
pub(crate) use config::{Cluster, Site};
use config::{Dns, LINK_BRIDGE, LINK_HOST, LINK_PREFIX, Layout};
pub use config::{MAX_NODES, PAIR_HOSTS, PAIR_SERVICE_CIDRS};
pub use faults::drain;

/// The node's name (and hostname) when it is the only one; node `i` of several is
/// `steward-node-<i>`.
pub const NODE_NAME: &str = "steward-node";
/// The bridge the pods are attached to (in each node's network namespace).
pub const BRIDGE: &str = "steward0";
/// The single node's address on the bridge: kubelet, CoreDNS and the pods' gateway.
pub const GATEWAY: &str = "198.18.0.1";
/// The single node's pod addresses.
pub const POD_CIDR: &str = "198.18.0.0/24";
/// Service ClusterIPs (the API server's `--service-cluster-ip-range`) of a control plane
/// alone; a pair's split it ([`PAIR_SERVICE_CIDRS`]).
pub const SERVICE_CIDR: &str = "198.19.0.0/16";
/// The cluster DNS domain.
pub const CLUSTER_DOMAIN: &str = "cluster.local";
/// kubelet's and containerd's persistent state.
pub const NODE_ROOT: &str = "/var/lib/steward-testenv-node";
/// Configuration, sockets and containerd's runtime state.
pub const NODE_RUN: &str = "/run/steward-testenv-node";
/// Held while real nodes run on this machine.
const LOCK: &str = "/run/steward-testenv-node.lock";

/// The real nodes of a control plane and what they have on the host: CoreDNS (and, with
/// nodes in network namespaces, the host's kube-proxy for their Services) and the
/// [`Machine`]. Dropping it stops every node; dropping the machine's last control plane
/// removes all they left on the host (see [`teardown`]).
pub(crate) struct RealNodes {
    nodes: Vec<RealNode>,
    /// Nodes in network namespaces: their volumes' provisioner ([`local_volumes`]).
    volumes: Option<local_volumes::LocalVolumes>,
    /// CoreDNS, then (nodes in network namespaces) the host's kube-proxy.
    host: Vec<Process>,
    machine: Arc<Machine>,
}

impl std::fmt::Debug for RealNodes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(&self.nodes).finish()
    }
}

/// What the nodes need of their control plane (owned, so they start while the control plane
/// still waits for its controllers).
pub(crate) struct NodeEnv {
    pub binaries: crate::Binaries,
    pub dir: PathBuf,
    pub kubeconfig: PathBuf,
    pub apiserver_url: String,
    pub client: kube::Client,
    /// For clients of the nodes' own threads.
    pub config: kube::Config,
}

/// A running real node.
pub struct RealNode {
    site: Site,
    /// containerd, kube-proxy, kubelet.
    processes: Vec<Process>,
    binaries: NodeBinaries,
    imported: Mutex<HashSet<String>>,
    started_in: Duration,
    /// Whether [`RealNode::stop`] stopped it.
    stopped: bool,
}

impl std::fmt::Debug for RealNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RealNode")
            .field("name", &self.site.name)
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

/// Runs `program args…` in the network namespace of `site` (the host's if it has none).
fn run_in(site: &Site, program: &str, args: &[&str]) -> Result<(), Error> {
    match &site.netns {
        None => run(program, args),
        Some(netns) => {
            let net = format!("--net=/run/netns/{netns}");
            let mut all = vec![net.as_str(), "--", program];
            all.extend_from_slice(args);
            run("nsenter", &all)
        }
    }
}

/// `binary args…` as started in the network namespace of `site`: through `nsenter --net`
/// when it has one of its own.
fn in_netns(site: &Site, binary: &Path, args: Vec<String>) -> (PathBuf, Vec<String>) {
    match &site.netns {
        None => (binary.to_path_buf(), args),
        Some(netns) => {
            let mut all = vec![
                format!("--net=/run/netns/{netns}"),
                "--".into(),
                binary.display().to_string(),
            ];
            all.extend(args);
            (PathBuf::from("nsenter"), all)
        }
    }
}

/// The machine's share of real nodes: its lock, taken before the sweep that precedes them and
/// held until the sweep that removes them, and the node binaries and pause image they use.
/// A pair's control planes share one ([`Machine::claim`] once: a second `flock` from the same
/// process would wait for the first); the last one dropped sweeps (see [`teardown`]).
pub(crate) struct Machine {
    binaries: NodeBinaries,
    pause: Image,
    kube_proxy: PathBuf,
    /// A pair's host setups, one at a time (`ip netns add` mounts `/run/netns` once).
    setup: Mutex<()>,
    _lock: std::fs::File,
}

impl std::fmt::Debug for Machine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Machine")
    }
}

impl Machine {
    /// Waits for the real nodes of another process on this machine to stop, takes the lock,
    /// builds (or finds) the node binaries and the pause image, removes what earlier nodes
    /// left (with `kube_proxy --cleanup` among the rest) and, with `link`, creates the link
    /// bridge [`LINK_BRIDGE`] the nodes in network namespaces of their own attach to.
    ///
    /// # Errors
    /// [`Error::Build`] if a component cannot be built, [`Error::Host`] if the host cannot be
    /// swept or the link set up (what it set up is swept again).
    pub(crate) async fn claim(kube_proxy: PathBuf, link: bool) -> Result<Self, Error> {
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
        let machine = Self {
            binaries,
            pause,
            kube_proxy,
            setup: Mutex::new(()),
            _lock: lock,
        };
        if link {
            blocking(setup_link).await?;
        }
        Ok(machine)
    }
}

impl Drop for Machine {
    fn drop(&mut self) {
        let problems = teardown::sweep(Some(&self.kube_proxy));
        if !problems.is_empty() {
            eprintln!(
                "steward-testenv: real node teardown left: {}",
                problems.join("; ")
            );
        }
    }
}

impl RealNodes {
    /// Starts the nodes of `cluster` registered with the control plane of `env` (one in the
    /// host's network namespace, or each in a namespace of its own) and waits until each is
    /// Ready, kube-proxy is healthy and CoreDNS answers. On `machine` when given (the one a
    /// pair's control planes share, its link set up), else on one it claims.
    ///
    /// Waits for the real nodes of another process on this machine to stop first.
    ///
    /// # Errors
    /// [`Error::Build`] if a component cannot be built, [`Error::Start`] or
    /// [`Error::Unhealthy`] naming the component and its log, [`Error::Host`] if the host
    /// network cannot be set up.
    pub(crate) async fn start(
        env: &NodeEnv,
        cluster: Cluster,
        machine: Option<Arc<Machine>>,
        timeout: Duration,
    ) -> Result<Self, Error> {
        let started = Instant::now();
        let machine = match machine {
            Some(machine) => machine,
            None => Arc::new(
                Machine::claim(env.binaries.kube_proxy.clone(), cluster.in_namespaces()).await?,
            ),
        };
        let (binaries, pause) = (machine.binaries.clone(), machine.pause.clone());
        let mut nodes = Self {
            nodes: Vec::new(),
            volumes: None,
            host: Vec::new(),
            machine: machine.clone(),
        };
        let api_port = apiserver_port(env)?;
        {
            let cluster = cluster.clone();
            blocking(move || {
                if cluster.in_namespaces() {
                    let _one_at_a_time = machine
                        .setup
                        .lock()
                        .map_err(|_| Error::Other("a host setup panicked".into()))?;
                    setup_cluster(&cluster, api_port)
                } else {
                    setup_host(api_port)
                }
            })
            .await?;
        }
        let logs = env.dir.join("node");
        std::fs::create_dir_all(&logs)
            .map_err(|e| host_err(format!("create {}", logs.display()), e.to_string()))?;
        let dns = Dns {
            kubeconfig: env.kubeconfig.to_path_buf(),
            address: cluster.host.clone(),
            health_port: free_port()?,
            ready_port: free_port()?,
        };
        std::fs::create_dir_all(&cluster.run)
            .map_err(|e| host_err(format!("create {}", cluster.run.display()), e.to_string()))?;
        std::fs::write(cluster.corefile(), config::corefile(&dns))
            .map_err(|e| host_err("write the Corefile", e.to_string()))?;
        nodes.host.push(Process::spawn(
            "coredns",
            &binaries.coredns,
            &["-conf".into(), cluster.corefile().display().to_string()],
            logs.join("coredns.log"),
        )?);
        for site in cluster.sites.iter().cloned() {
            let mut node = RealNode {
                site,
                processes: Vec::new(),
                binaries: binaries.clone(),
                imported: Mutex::new(HashSet::new()),
                started_in: Duration::ZERO,
                stopped: false,
            };
            let node_started = Instant::now();
            node.boot(env, &pause, &logs, timeout).await?;
            // Until it is Ready (below): its boot, then the other nodes' boots meanwhile.
            node.started_in = node_started.elapsed();
            nodes.nodes.push(node);
        }
        let client = env.client.clone();
        let waiting = Instant::now();
        for node in &mut nodes.nodes {
            node.wait_ready(&client, timeout).await?;
            node.started_in += waiting.elapsed();
        }
        if let Some(services) = &cluster.services {
            // The host's kube-proxy for these Services: the test process reaches them as a
            // node would (once the node it names exists: kube-proxy waits for it).
            let proxy = spawn_host_kube_proxy(env, services, &binaries, &logs)?;
            nodes.host.push(proxy.0);
            let address = proxy.1;
            wait_healthy(&mut nodes.host, 1, timeout, || async move {
                http_ok(address, "/healthz").await
            })
            .await?;
        }
        let ready = std::net::SocketAddr::from(([127, 0, 0, 1], dns.ready_port));
        wait_healthy(&mut nodes.host, 0, timeout, || async move {
            http_ok(ready, "/ready").await
        })
        .await?;
        kubernetes_service_endpoints(env, &cluster.host).await?;
        if cluster.in_namespaces() {
            let roots = nodes
                .nodes
                .iter()
                .map(|n| (n.site.name.clone(), n.site.root.clone()))
                .collect();
            nodes.volumes = Some(
                local_volumes::LocalVolumes::start(&env.client, env.config.clone(), roots).await?,
            );
        }
        if let [only] = nodes.nodes.as_mut_slice() {
            // The only node: from the lock to a Ready node with DNS, as before several existed.
            only.started_in = started.elapsed();
        }
        Ok(nodes)
    }

    /// The nodes, in order.
    pub(crate) fn nodes(&self) -> &[RealNode] {
        &self.nodes
    }

    /// The nodes, to stop or start one.
    pub(crate) fn nodes_mut(&mut self) -> &mut [RealNode] {
        &mut self.nodes
    }
}

impl Drop for RealNodes {
    fn drop(&mut self) {
        // Before the sweep removes the directories it makes.
        drop(self.volumes.take());
        for node in &mut self.nodes {
            while let Some(p) = node.processes.pop() {
                drop(p);
            }
        }
        while let Some(p) = self.host.pop() {
            drop(p);
        }
        if Arc::strong_count(&self.machine) > 1 {
            // The other control plane of a pair still runs: the sweep waits for it, but
            // these nodes' shims and pods stop now, as they would with their machine.
            for node in self.nodes.iter().filter(|n| n.site.netns.is_some()) {
                let left = teardown::kill_site(&node.site);
                if !left.is_empty() {
                    eprintln!(
                        "steward-testenv: stopping {} left: {}",
                        node.site.name,
                        left.join("; ")
                    );
                }
            }
        }
        // The last of the machine's control planes sweeps as it drops the machine.
    }
}

/// `Ok` once Node `name` exists with the InternalIP `ip`.
async fn registered(client: &kube::Client, name: &str, ip: &str) -> Result<(), String> {
    let node = Api::<Node>::all(client.clone())
        .get_opt(name)
        .await
        .map_err(|e| e.to_string())?
        .ok_or_else(|| format!("Node {name} not registered yet"))?;
    let addresses = node.status.and_then(|s| s.addresses).unwrap_or_default();
    if addresses
        .iter()
        .any(|a| a.type_ == "InternalIP" && a.address == ip)
    {
        Ok(())
    } else {
        Err(format!(
            "Node {name} has no InternalIP {ip} yet: {addresses:?}"
        ))
    }
}

/// The host's kube-proxy for a control plane's Services at `site` (the host's network
/// namespace, or one of its own, where it masquerades so replies come back through it);
/// returns it and its health address.
fn spawn_host_kube_proxy(
    env: &NodeEnv,
    site: &Site,
    binaries: &NodeBinaries,
    logs: &Path,
) -> Result<(Process, std::net::SocketAddr), Error> {
    std::fs::create_dir_all(&site.run)
        .map_err(|e| host_err("create the host's kube-proxy directory", e.to_string()))?;
    let own_namespace = site.netns.is_some();
    let kubeconfig = if own_namespace {
        node_kubeconfig(env, site)?
    } else {
        env.kubeconfig.to_path_buf()
    };
    let layout = Layout {
        site: site.clone(),
        kubeconfig,
        shim: binaries.containerd_shim.clone(),
        runc: PathBuf::new(),
        cni_bin: PathBuf::new(),
        kubelet_healthz_port: 0,
        proxy_healthz_port: free_port()?,
        proxy_metrics_port: free_port()?,
        masquerade_all: own_namespace,
    };
    let health: std::net::IpAddr = layout
        .health_ip()
        .parse()
        .map_err(|e| Error::Other(format!("health address: {e}")))?;
    let process = spawn_kube_proxy(env, &layout, &logs.join("kube-proxy-host.log"))?;
    Ok((
        process,
        std::net::SocketAddr::from((health, layout.proxy_healthz_port)),
    ))
}

/// Writes the kubeconfig of `site`'s components (the API server on the site's host address)
/// and returns its path.
fn node_kubeconfig(env: &NodeEnv, site: &Site) -> Result<PathBuf, Error> {
    let io = |what: String| move |e: std::io::Error| host_err(what, e.to_string());
    let admin =
        std::fs::read_to_string(&env.kubeconfig).map_err(io("read the admin kubeconfig".into()))?;
    std::fs::create_dir_all(&site.run).map_err(io(format!("create {}", site.run.display())))?;
    std::fs::write(
        site.kubeconfig(),
        config::node_kubeconfig(&admin, &site.host),
    )
    .map_err(io(format!("write {}", site.kubeconfig().display())))?;
    Ok(site.kubeconfig())
}

/// kube-proxy with `layout`'s configuration, in its site's network namespace.
fn spawn_kube_proxy(env: &NodeEnv, layout: &Layout, log: &Path) -> Result<Process, Error> {
    let config = layout.site.proxy_config();
    std::fs::write(&config, config::kube_proxy(layout))
        .map_err(|e| host_err(format!("write {}", config.display()), e.to_string()))?;
    let (binary, args) = in_netns(
        &layout.site,
        &env.binaries.kube_proxy,
        vec![format!("--config={}", config.display()), "--v=1".into()],
    );
    Process::spawn("kube-proxy", &binary, &args, log.to_path_buf())
}

impl RealNode {
    async fn boot(
        &mut self,
        env: &NodeEnv,
        pause: &Image,
        logs: &Path,
        timeout: Duration,
    ) -> Result<(), Error> {
        let site = self.site.clone();
        let io = |what: String| move |e: std::io::Error| host_err(what, e.to_string());
        let kubeconfig = if site.netns.is_some() {
            node_kubeconfig(env, &site)?
        } else {
            env.kubeconfig.to_path_buf()
        };
        let layout = Layout {
            site: site.clone(),
            kubeconfig: kubeconfig.clone(),
            shim: self.binaries.containerd_shim.clone(),
            runc: PathBuf::from("/usr/sbin/runc"),
            cni_bin: PathBuf::from("/usr/lib/cni"),
            kubelet_healthz_port: free_port()?,
            proxy_healthz_port: free_port()?,
            proxy_metrics_port: free_port()?,
            masquerade_all: false,
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
        let write = |path: PathBuf, text: String| {
            std::fs::write(&path, text).map_err(io(format!("write {}", path.display())))
        };
        std::fs::create_dir_all(site.cni_conf_dir())
            .map_err(io(format!("create {}", site.cni_conf_dir().display())))?;
        write(
            site.containerd_config(),
            config::containerd(&layout, images::PAUSE_REFERENCE),
        )?;
        write(
            site.cni_conf_dir().join("10-steward.conflist"),
            config::cni_conflist(&site),
        )?;
        write(site.kubelet_config(), config::kubelet(&layout))?;
        write(site.resolv_conf(), String::new())?;
        let log = |component: &str| logs.join(format!("{}{component}.log", log_prefix(&site)));

        // containerd, then the sandbox image.
        let (binary, args) = in_netns(
            &site,
            &self.binaries.containerd,
            vec![
                "--config".into(),
                site.containerd_config().display().to_string(),
                "--log-level=warn".into(),
            ],
        );
        self.processes.push(Process::spawn(
            "containerd",
            &binary,
            &args,
            log("containerd"),
        )?);
        self.wait_containerd(timeout).await?;
        self.import(pause).await?;

        let mut labels = vec!["steward.dev/node=real".to_string()];
        if let Some(zone) = &site.zone {
            labels.push(format!("topology.kubernetes.io/zone={zone}"));
        }
        let (binary, args) = in_netns(
            &site,
            &env.binaries.kubelet,
            vec![
                format!("--config={}", site.kubelet_config().display()),
                format!("--kubeconfig={}", kubeconfig.display()),
                format!("--hostname-override={}", site.name),
                format!("--node-ip={}", site.node_ip),
                format!("--root-dir={}", site.kubelet_root().display()),
                format!("--cert-dir={}/pki", site.kubelet_root().display()),
                format!("--node-labels={}", labels.join(",")),
                "--v=1".into(),
            ],
        );
        self.processes
            .push(Process::spawn("kubelet", &binary, &args, log("kubelet"))?);
        // kube-proxy once kubelet registered the Node with its address: started before, it
        // gives up waiting for the Node on a slow start (two control planes booting at once
        // on two cores) and then exits when the Node's addresses appear ("NodeIPs changed").
        let (client, name, ip) = (env.client.clone(), site.name.clone(), site.node_ip.clone());
        wait_healthy(&mut self.processes, 1, timeout, || {
            let (client, name, ip) = (client.clone(), name.clone(), ip.clone());
            async move { registered(&client, &name, &ip).await }
        })
        .await?;
        // containerd, kube-proxy, kubelet: the order RealNode::start_again restarts them in.
        self.processes
            .insert(1, spawn_kube_proxy(env, &layout, &log("kube-proxy"))?);
        let health_ip: std::net::IpAddr = layout
            .health_ip()
            .parse()
            .map_err(|e| Error::Other(format!("health address: {e}")))?;
        let proxy = std::net::SocketAddr::from((health_ip, layout.proxy_healthz_port));
        wait_healthy(&mut self.processes, 1, timeout, || async move {
            http_ok(proxy, "/healthz").await
        })
        .await
    }

    /// Waits until the node's containerd (its first process) answers on its socket.
    async fn wait_containerd(&mut self, timeout: Duration) -> Result<(), Error> {
        let socket = self.site.containerd_socket();
        let ctr_bin = self.binaries.ctr.clone();
        wait_healthy(&mut self.processes[..1], 0, timeout, || {
            let ok = socket.exists() && ctr(&ctr_bin, &socket, &["version"]).is_ok();
            async move {
                if ok {
                    Ok(())
                } else {
                    Err("socket not answering".into())
                }
            }
        })
        .await
    }

    /// Waits until the node is registered and Ready.
    async fn wait_ready(&mut self, client: &kube::Client, timeout: Duration) -> Result<(), Error> {
        let nodes: Api<Node> = Api::all(client.clone());
        let name = self.site.name.clone();
        wait_healthy(&mut self.processes, 2, timeout, || {
            let (nodes, name) = (nodes.clone(), name.clone());
            async move {
                let node = nodes
                    .get_opt(&name)
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
        .await
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
        let (ctr_bin, socket) = (self.binaries.ctr.clone(), self.site.containerd_socket());
        let result = {
            let archive = archive.clone();
            blocking(move || {
                Ok(ctr(
                    &ctr_bin,
                    &socket,
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

    /// Builds (or finds cached) and imports the PgBouncer image (PgBouncer built from
    /// Debian's source, see [`images::pgbouncer`]); returns its reference.
    ///
    /// # Errors
    /// As [`images::pgbouncer`] and [`RealNode::import`].
    pub async fn pgbouncer_image(&self) -> Result<String, Error> {
        let image = blocking(images::pgbouncer).await?;
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
    /// provisioner): its directory `<node root>/volumes/<name>` is created owned by `owner`
    /// (uid and gid; fsGroup does not apply to hostPath volumes) and removed with the node.
    /// With `claim` (namespace, name) it is bound to that claim only. A node of several pins
    /// the volume to itself (node affinity), as a local disk is. Apply the returned manifest.
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
        let dir = self.site.root.join("volumes").join(name);
        std::fs::create_dir_all(&dir)
            .and_then(|()| std::os::unix::fs::chown(&dir, Some(owner), Some(owner)))
            .and_then(|()| {
                std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o750))
            })
            .map_err(|e| host_err(format!("create volume {}", dir.display()), e.to_string()))?;
        let mut pv = host_path_volume(name, size, &dir, claim);
        if self.site.netns.is_some() {
            pv["spec"]["nodeAffinity"] = serde_json::json!({"required": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": [self.site.name]}]}
            ]}});
        }
        Ok(pv)
    }

    /// The log of a node component: `containerd`, `kubelet` or `kube-proxy` (CoreDNS, the
    /// host's, logs to `<control plane dir>/node/coredns.log`).
    pub fn log(&self, component: &str) -> PathBuf {
        self.processes
            .iter()
            .find(|p| p.name == component)
            .map(|p| p.log.clone())
            .unwrap_or_else(|| PathBuf::from(format!("<no {component} on this node>")))
    }

    /// The node's name.
    pub fn name(&self) -> &str {
        &self.site.name
    }

    /// Its zone (`topology.kubernetes.io/zone`), when it is one of several.
    pub fn zone(&self) -> Option<&str> {
        self.site.zone.as_deref()
    }

    /// Its address (InternalIP).
    pub fn address(&self) -> &str {
        &self.site.node_ip
    }

    /// The host's address as the node's pods reach it (where a test serves them something,
    /// such as an object store): its control plane's (in a pair, each has its own, and the
    /// pods of both reach either).
    pub fn host_address(&self) -> &str {
        &self.site.host
    }

    /// Time from the start of the node (the only one: lock, build check, sweep; one of
    /// several: its own components) to a Ready node with kube-proxy.
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

/// The prefix of a node's log files: none for the only node, `<name>-` for one of several.
fn log_prefix(site: &Site) -> String {
    if site.netns.is_some() {
        format!("{}-", site.name)
    } else {
        String::new()
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

/// Points the `kubernetes` Service at the API server on the host's address `host`, so pods
/// (operators in-cluster) reach it (the API server's own endpoint reconciler is off).
async fn kubernetes_service_endpoints(env: &NodeEnv, host: &str) -> Result<(), Error> {
    use k8s_openapi::api::discovery::v1::EndpointSlice;
    use kube::api::{Patch, PatchParams};
    let port = apiserver_port(env)?;
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
        "endpoints": [{"addresses": [host], "conditions": {"ready": true}}],
        "ports": [{"name": "https", "port": port, "protocol": "TCP"}],
    }))
    .map_err(|e| Error::Other(format!("EndpointSlice manifest: {e}")))?;
    Api::<EndpointSlice>::namespaced(env.client.clone(), "default")
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

/// Host setup for the single node: sysctls (recorded for the teardown), the bridge with the
/// node's address, and the chains of [`guard`] with the API server's port.
fn setup_host(api_port: u16) -> Result<(), Error> {
    host_sysctls()?;
    run("ip", &["link", "add", BRIDGE, "type", "bridge"])?;
    run(
        "ip",
        &["addr", "add", &format!("{GATEWAY}/24"), "dev", BRIDGE],
    )?;
    run("ip", &["link", "set", BRIDGE, "up"])?;
    guard(BRIDGE)?;
    guard_api_port(api_port)
}

/// Host setup for nodes in network namespaces of their own, once per machine: sysctls, the
/// link bridge [`LINK_BRIDGE`] at [`LINK_HOST`] and the chains of [`guard`] on it.
fn setup_link() -> Result<(), Error> {
    host_sysctls()?;
    run("ip", &["link", "add", LINK_BRIDGE, "type", "bridge"])?;
    run(
        "ip",
        &[
            "addr",
            "add",
            &format!("{LINK_HOST}/{LINK_PREFIX}"),
            "dev",
            LINK_BRIDGE,
        ],
    )?;
    run("ip", &["link", "set", LINK_BRIDGE, "up"])?;
    guard(LINK_BRIDGE)
}

/// Host setup for one control plane's nodes on the link (after [`setup_link`]): its host
/// address on the link bridge, per node a network namespace linked to it (see
/// [`add_namespace`]), a route from the host to its pod network and a cgroup root; the route
/// of its Services (through the host's own kube-proxy, or through the kube-proxy in a
/// namespace of its own of a pair's second), and its API server's port in [`guard`]'s chain.
fn setup_cluster(cluster: &Cluster, api_port: u16) -> Result<(), Error> {
    if cluster.host != LINK_HOST {
        run(
            "ip",
            &[
                "addr",
                "add",
                &format!("{}/{LINK_PREFIX}", cluster.host),
                "dev",
                LINK_BRIDGE,
            ],
        )?;
    }
    for site in &cluster.sites {
        add_namespace(site)?;
        run(
            "ip",
            &["route", "add", &site.pod_cidr, "via", &site.node_ip],
        )?;
        if let Some(root) = &site.cgroup_root {
            teardown::create_cgroup_root(root)
                .map_err(|e| host_err(format!("create cgroup {root}"), e.to_string()))?;
        }
    }
    match &cluster.services {
        Some(services) if services.netns.is_some() => {
            add_namespace(services)?;
            run(
                "ip",
                &[
                    "route",
                    "add",
                    &cluster.service_cidr,
                    "via",
                    &services.node_ip,
                ],
            )?;
        }
        // The host's own traffic to Services goes out on the link (its kube-proxy rewrites it).
        _ => run(
            "ip",
            &["route", "add", &cluster.service_cidr, "dev", LINK_BRIDGE],
        )?,
    }
    guard_api_port(api_port)
}

/// The network namespace of `site`, linked by a veth pair to the link bridge: its address
/// inside, its default route the host, forwarding on, and bridged traffic through its own
/// iptables (a node's kube-proxy rules its bridge's traffic too).
fn add_namespace(site: &Site) -> Result<(), Error> {
    let Some(netns) = &site.netns else {
        return Ok(());
    };
    let veth = teardown::host_veth(netns);
    run("ip", &["netns", "add", netns])?;
    run(
        "ip",
        &[
            "link", "add", &veth, "type", "veth", "peer", "name", "eth0", "netns", netns,
        ],
    )?;
    run("ip", &["link", "set", &veth, "master", LINK_BRIDGE])?;
    run("ip", &["link", "set", &veth, "up"])?;
    run_in(site, "ip", &["link", "set", "lo", "up"])?;
    run_in(
        site,
        "ip",
        &[
            "addr",
            "add",
            &format!("{}/{LINK_PREFIX}", site.node_ip),
            "dev",
            "eth0",
        ],
    )?;
    run_in(site, "ip", &["link", "set", "eth0", "up"])?;
    run_in(site, "ip", &["route", "add", "default", "via", &site.host])?;
    run_in(
        site,
        "sh",
        &[
            "-c",
            "echo 1 > /proc/sys/net/ipv4/ip_forward && { echo 1 > /proc/sys/net/bridge/bridge-nf-call-iptables 2>/dev/null || true; }",
        ],
    )
}

/// sysctls (recorded for the teardown): forwarding, and bridged traffic through iptables.
fn host_sysctls() -> Result<(), Error> {
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
        .map_err(|e| host_err(format!("create {NODE_RUN}"), e.to_string()))
}

/// The chain that keeps the nodes' traffic on `bridge` (routed between its ports, never to or
/// from another interface) and the one that keeps the nodes' listeners (the API servers on
/// all addresses, kubelet, CoreDNS and NodePorts) answering only on loopback and `bridge`
/// (each API server's port is added by [`guard_api_port`]).
fn guard(bridge: &str) -> Result<(), Error> {
    run("iptables", &["-w", "-N", "STEWARD-NODE"])?;
    for rule in [
        ["-i", bridge, "-o", bridge, "-j", "ACCEPT"].as_slice(),
        &["-i", bridge, "-j", "DROP"],
        &["-o", bridge, "-j", "DROP"],
    ] {
        let mut args = vec!["-w", "-A", "STEWARD-NODE"];
        args.extend_from_slice(rule);
        run("iptables", &args)?;
    }
    run(
        "iptables",
        &["-w", "-I", "FORWARD", "1", "-j", "STEWARD-NODE"],
    )?;
    run("iptables", &["-w", "-N", "STEWARD-NODE-INPUT"])?;
    for rule in [
        ["-i", "lo", "-j", "RETURN"].as_slice(),
        &["-i", bridge, "-j", "RETURN"],
        &["-d", "198.18.0.0/15", "-j", "DROP"],
    ] {
        let mut args = vec!["-w", "-A", "STEWARD-NODE-INPUT"];
        args.extend_from_slice(rule);
        run("iptables", &args)?;
    }
    run(
        "iptables",
        &["-w", "-I", "INPUT", "1", "-j", "STEWARD-NODE-INPUT"],
    )
}

/// Closes an API server's port (which listens on all addresses) to all but loopback and the
/// nodes' bridge, in [`guard`]'s chain.
fn guard_api_port(api_port: u16) -> Result<(), Error> {
    let api_port = api_port.to_string();
    run(
        "iptables",
        &[
            "-w",
            "-A",
            "STEWARD-NODE-INPUT",
            "-p",
            "tcp",
            "--dport",
            &api_port,
            "-j",
            "DROP",
        ],
    )
}

/// The API server's port, from its URL.
fn apiserver_port(env: &NodeEnv) -> Result<u16, Error> {
    env.apiserver_url
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .ok_or_else(|| Error::Other(format!("no port in {}", env.apiserver_url)))
}

/// Runs `ctr` against the containerd listening on `socket`.
fn ctr(binary: &Path, socket: &Path, args: &[&str]) -> Result<String, String> {
    let out = std::process::Command::new(binary)
        .arg("--address")
        .arg(socket)
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
