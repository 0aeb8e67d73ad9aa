//! Starting and stopping the control plane processes.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};

use crate::binaries::{self, Binaries};
use crate::node::{self, Cluster, Machine, RealNode, RealNodes};
use crate::process::{Process, free_port};
use crate::{Error, eventually};

/// With [`Options::audit`]: Lease writes with their request bodies (who claimed to hold it),
/// every other write by its metadata, nothing else.
const AUDIT_POLICY: &str = "apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Request
    resources: [{group: coordination.k8s.io, resources: [leases]}]
    verbs: [create, update, patch]
  - level: Metadata
    verbs: [create, update, patch, delete, deletecollection]
  - level: None
";

/// How to start a control plane.
#[derive(Clone, Debug)]
pub struct Options {
    /// Number of kwok nodes to create.
    pub nodes: usize,
    /// Keep the temp dir (logs, kubeconfig, etcd data) after drop. Also set by
    /// `STEWARD_TESTENV_KEEP=1`.
    pub keep_dir: bool,
    /// How long to wait for each component to become healthy.
    pub timeout: Duration,
    /// Also start one real node (kubelet, containerd, CNI, kube-proxy, CoreDNS; needs root and
    /// is one per machine, see [`crate::node`]).
    pub real_node: bool,
    /// With `real_node`, how many real nodes (0 or 1: one, in the host's network namespace;
    /// more, or any number in a pair ([`ControlPlane::start_pair`]): each in a network
    /// namespace of its own, in zones of their own). See [`Options::real_nodes`].
    pub real_nodes: usize,
    /// Record every write (and, with their request bodies, the Lease writes) in an audit log
    /// ([`ControlPlane::audit_log`]), for tests that check who wrote what when.
    pub audit: bool,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            nodes: 2,
            keep_dir: std::env::var_os("STEWARD_TESTENV_KEEP").is_some(),
            // Generous: on a loaded 2-core machine the apiserver has taken over a minute to
            // listen. A component that exits fails at once, whatever the timeout.
            timeout: Duration::from_secs(180),
            real_node: false,
            real_nodes: 0,
            audit: false,
        }
    }
}

impl Options {
    /// `count` real nodes and no kwok node: one in the host's network namespace (the fast
    /// single node), or several, each in a network namespace of its own and a zone of its own
    /// (`topology.kubernetes.io/zone=zone-<i>`), which node faults act on
    /// ([`RealNode::stop`], [`RealNode::partition`], [`crate::node::drain`]). With several,
    /// the controller manager marks a node `NotReady` after [`NODE_MONITOR_GRACE`] without a
    /// heartbeat.
    pub fn real_nodes(count: usize) -> Self {
        Self {
            nodes: 0,
            real_node: true,
            real_nodes: count,
            ..Self::default()
        }
    }

    /// How many real nodes these options start.
    fn real_node_count(&self) -> usize {
        match (self.real_node, self.real_nodes) {
            (false, _) => 0,
            (true, n) => n.max(1),
        }
    }
}

/// Where a control plane's real nodes go on the host, and the machine they share with
/// another control plane (a pair's).
struct Placement {
    cluster: Cluster,
    machine: Option<Arc<Machine>>,
}

/// With several real nodes: how long the controller manager waits for a node's heartbeat
/// before it marks the node `NotReady` (`--node-monitor-grace-period`; 50 s by default, which
/// CloudNativePG's documentation counts into its 40–55 s of node-loss detection). Shorter
/// here so node-loss tests take less time; kubelet renews its Lease every 5 s
/// (`nodeLeaseDurationSeconds` 20).
pub const NODE_MONITOR_GRACE: Duration = Duration::from_secs(20);

/// A component a fault test can kill, restart or pause ([`ControlPlane::kill`],
/// [`ControlPlane::start_again`], [`ControlPlane::pause`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Component {
    Etcd,
    KubeApiserver,
    KubeControllerManager,
    KubeScheduler,
}

impl Component {
    /// Index in `ControlPlane::processes` (the start order).
    fn index(self) -> usize {
        match self {
            Self::Etcd => 0,
            Self::KubeApiserver => 1,
            Self::KubeControllerManager => 2,
            Self::KubeScheduler => 3,
        }
    }
}

/// A running control plane. Dropping it kills every process and removes its temp dir.
pub struct ControlPlane {
    // Field order matters for drop: the node before the control plane, processes before the
    // directory holding their data.
    node: Option<RealNodes>,
    processes: Vec<Process>,
    dir: PathBuf,
    keep_dir: bool,
    config: Config,
    kubeconfig: PathBuf,
    apiserver_url: String,
    binaries: Binaries,
    started_in: Duration,
    etcd_port: u16,
}

impl std::fmt::Debug for ControlPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlPlane")
            .field("apiserver", &self.apiserver_url)
            .field("kubeconfig", &self.kubeconfig)
            .finish()
    }
}

const ADMIN_USER: &str = "steward-admin";
/// The controller manager's own user, which the API server's bootstrap RBAC policy binds.
const KCM_USER: &str = "system:kube-controller-manager";

impl ControlPlane {
    /// Builds the binaries if needed and starts every component, waiting until each is healthy.
    ///
    /// # Errors
    /// [`Error::Build`], [`Error::Start`] or [`Error::Unhealthy`] naming the component and the
    /// path of its log. On failure the temp dir (with the logs) is kept.
    pub async fn start(options: Options) -> Result<Self, Error> {
        let placement = match options.real_node_count() {
            0 => None,
            count => Some(Placement {
                cluster: Cluster::alone(count).map_err(Error::Other)?,
                machine: None,
            }),
        };
        Self::start_placed(options, placement).await
    }

    /// Two control planes on this host, each with its own real nodes (`first` and `second`
    /// say how many, as [`Options::real_nodes`]; one each is the least), as two Kubernetes
    /// clusters of one site would be: every node in a network namespace of its own (one node
    /// too), each control plane with its own Service CIDR
    /// ([`crate::node::PAIR_SERVICE_CIDRS`]), its own CoreDNS on its own host address
    /// ([`crate::node::PAIR_HOSTS`], [`RealNode::host_address`]) and its own host-side
    /// kube-proxy, so the test process reaches both's Services. What links them is what a
    /// real deployment shares: the host (an object store on either host address is reached
    /// by the pods of both, [`crate::s3::S3Server`]) and routed pod addresses (a pod of one
    /// reaches a pod IP of the other). See [`crate::node`] for the layout.
    ///
    /// They start side by side, on one claim of the machine (its lock and one sweep before
    /// either starts); the host is swept once both are dropped. Dropped first, one stops its
    /// nodes and their pods at once.
    ///
    /// # Errors
    /// As [`ControlPlane::start`]; [`Error::Other`] when either has no real node or both
    /// together more than [`crate::node::MAX_NODES`].
    pub async fn start_pair(first: Options, second: Options) -> Result<(Self, Self), Error> {
        let [a, b] = Cluster::pair([first.real_node_count(), second.real_node_count()])
            .map_err(Error::Other)?;
        let binaries = tokio::task::spawn_blocking(binaries::ensure)
            .await
            .map_err(|e| Error::Other(format!("binary build task failed: {e}")))??;
        let machine = Arc::new(Machine::claim(binaries.kube_proxy.clone(), true).await?);
        let place = |cluster| {
            Some(Placement {
                cluster,
                machine: Some(machine.clone()),
            })
        };
        tokio::try_join!(
            Self::start_placed(first, place(a)),
            Self::start_placed(second, place(b)),
        )
    }

    async fn start_placed(options: Options, placement: Option<Placement>) -> Result<Self, Error> {
        let started = Instant::now();
        let binaries = tokio::task::spawn_blocking(binaries::ensure)
            .await
            .map_err(|e| Error::Other(format!("binary build task failed: {e}")))??;
        let dir = new_run_dir()?;
        let mut cp = Self {
            node: None,
            processes: Vec::new(),
            dir: dir.clone(),
            keep_dir: options.keep_dir,
            config: Config::new(
                "https://127.0.0.1"
                    .parse()
                    .map_err(|_| Error::Other("uri".into()))?,
            ),
            kubeconfig: dir.join("kubeconfig"),
            apiserver_url: String::new(),
            binaries,
            started_in: Duration::ZERO,
            etcd_port: 0,
        };
        if cp.keep_dir {
            cp.keep();
        }
        match cp.boot(&options, placement).await {
            Ok(()) => {
                cp.started_in = started.elapsed();
                Ok(cp)
            }
            Err(e) => {
                cp.keep();
                Err(e)
            }
        }
    }

    /// Keeps the temp dir (logs) after drop, and marks it so later runs do not sweep it.
    fn keep(&mut self) {
        self.keep_dir = true;
        let _ = std::fs::write(self.dir.join("keep"), "kept for inspection\n");
    }

    async fn boot(&mut self, options: &Options, placement: Option<Placement>) -> Result<(), Error> {
        let dir = self.dir.clone();
        let io = |what: String| move |source| Error::Io { what, source };
        let b = self.binaries.clone();

        // etcd
        let etcd_port = free_port()?;
        self.etcd_port = etcd_port;
        let etcd_url = format!("http://127.0.0.1:{etcd_port}");
        let peer_url = format!("http://127.0.0.1:{}", free_port()?);
        let etcd = Process::spawn(
            "etcd",
            &b.etcd,
            &[
                format!("--data-dir={}", dir.join("etcd").display()),
                format!("--listen-client-urls={etcd_url}"),
                format!("--advertise-client-urls={etcd_url}"),
                "--name=steward".into(),
                format!("--listen-peer-urls={peer_url}"),
                format!("--initial-advertise-peer-urls={peer_url}"),
                format!("--initial-cluster=steward={peer_url}"),
                "--unsafe-no-fsync=true".into(),
                "--quota-backend-bytes=4294967296".into(),
                "--log-level=warn".into(),
            ],
            dir.join("etcd.log"),
        )?;
        self.processes.push(etcd);
        self.wait_healthy(0, options.timeout, || async move {
            plain_http_get(etcd_port, "/health").await.and_then(|body| {
                if body.contains("\"health\":\"true\"") {
                    Ok(())
                } else {
                    Err(body)
                }
            })
        })
        .await?;

        // kube-apiserver
        let token = random_token();
        // kube-controller-manager runs as itself, as kubeadm sets it up (each controller with
        // its own kube-system ServiceAccount), not as a cluster admin: admission policies see
        // the identities a real cluster's controllers have.
        let kcm_token = random_token();
        std::fs::write(
            dir.join("tokens.csv"),
            format!(
                "{token},{ADMIN_USER},{ADMIN_USER},\"system:masters\"\n{kcm_token},{KCM_USER},{KCM_USER}\n"
            ),
        )
        .map_err(io("write tokens.csv".into()))?;
        let sa_key = dir.join("sa.key");
        run_openssl(
            &["genrsa", "-out", &sa_key.display().to_string(), "2048"],
            &dir,
        )?;
        let api_port = free_port()?;
        self.apiserver_url = format!("https://127.0.0.1:{api_port}");
        let pki = dir.join("pki");
        let mut audit_args = Vec::new();
        if options.audit {
            let policy = dir.join("audit-policy.yaml");
            std::fs::write(&policy, AUDIT_POLICY).map_err(io("write audit-policy.yaml".into()))?;
            audit_args = vec![
                format!("--audit-policy-file={}", policy.display()),
                format!("--audit-log-path={}", dir.join("audit.log").display()),
                "--audit-log-format=json".into(),
                "--audit-log-mode=blocking".into(),
            ];
        }
        let apiserver = Process::spawn(
            "kube-apiserver",
            &b.kube_apiserver,
            &[
                format!("--etcd-servers={etcd_url}"),
                // A real node's pods reach the API server on the bridge address.
                format!(
                    "--bind-address={}",
                    if options.real_node {
                        "0.0.0.0"
                    } else {
                        "127.0.0.1"
                    }
                ),
                "--advertise-address=127.0.0.1".into(),
                format!("--secure-port={api_port}"),
                format!("--cert-dir={}", pki.display()),
                format!("--token-auth-file={}", dir.join("tokens.csv").display()),
                "--authorization-mode=RBAC".into(),
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local".into(),
                format!("--service-account-key-file={}", sa_key.display()),
                format!("--service-account-signing-key-file={}", sa_key.display()),
                format!(
                    "--service-cluster-ip-range={}",
                    placement
                        .as_ref()
                        .map_or(node::SERVICE_CIDR, |p| p.cluster.service_cidr.as_str())
                ),
                "--kubelet-preferred-address-types=InternalIP,Hostname".into(),
                "--allow-privileged=true".into(),
                "--enable-priority-and-fairness=false".into(),
                "--endpoint-reconciler-type=none".into(),
                "--v=1".into(),
            ]
            .into_iter()
            .chain(audit_args)
            .collect::<Vec<_>>(),
            dir.join("kube-apiserver.log"),
        )?;
        self.processes.push(apiserver);
        let cert = pki.join("apiserver.crt");
        self.wait_healthy(1, options.timeout, {
            let cert = cert.clone();
            move || {
                let cert = cert.clone();
                async move {
                    if cert.exists() {
                        Ok(())
                    } else {
                        Err("serving certificate not written yet".into())
                    }
                }
            }
        })
        .await?;
        // apiserver.crt holds the serving certificate followed by the self-signed CA that
        // issued it; clients and kube-root-ca.crt want only the CA.
        let chain =
            std::fs::read_to_string(&cert).map_err(io(format!("read {}", cert.display())))?;
        let ca_pem = last_pem_block(&chain).into_bytes();
        let ca_file = dir.join("ca.crt");
        std::fs::write(&ca_file, &ca_pem).map_err(io("write ca.crt".into()))?;
        let kubeconfig = kubeconfig_yaml(&self.apiserver_url, &ca_pem, &token);
        std::fs::write(&self.kubeconfig, &kubeconfig).map_err(io("write kubeconfig".into()))?;
        self.config = load_kubeconfig(&self.kubeconfig).await?;
        let config = self.config.clone();
        self.wait_healthy(1, options.timeout, move || {
            let config = config.clone();
            async move { get_text(&config, "/readyz").await.map(|_| ()) }
        })
        .await?;

        // kube-scheduler and kwok share the admin kubeconfig; kube-controller-manager has its
        // own identity.
        let kcm_port = free_port()?;
        let kubeconfig_arg = format!("--kubeconfig={}", self.kubeconfig.display());
        let kcm_kubeconfig = dir.join("kube-controller-manager.kubeconfig");
        std::fs::write(
            &kcm_kubeconfig,
            kubeconfig_yaml(&self.apiserver_url, &ca_pem, &kcm_token),
        )
        .map_err(io("write the controller manager's kubeconfig".into()))?;
        let mut kcm_args = vec![
            format!("--kubeconfig={}", kcm_kubeconfig.display()),
            "--bind-address=127.0.0.1".into(),
            format!("--secure-port={kcm_port}"),
            format!("--cert-dir={}", dir.join("kcm-pki").display()),
            "--leader-elect=false".into(),
            "--controllers=*,-node-ipam-controller,-persistentvolume-attach-detach-controller"
                .into(),
            format!("--service-account-private-key-file={}", sa_key.display()),
            format!("--root-ca-file={}", ca_file.display()),
            "--use-service-account-credentials=true".into(),
            "--concurrent-gc-syncs=10".into(),
            // At the default 20 requests/s per client, setting its controllers
            // up (a token each) took ~5 s of every start, and namespace deletion
            // and garbage collection crawl under load.
            "--kube-api-qps=500".into(),
            "--kube-api-burst=1000".into(),
            "--v=1".into(),
        ];
        if placement
            .as_ref()
            .is_some_and(|p| p.cluster.in_namespaces())
        {
            kcm_args.extend([
                format!(
                    "--node-monitor-grace-period={}s",
                    NODE_MONITOR_GRACE.as_secs()
                ),
                "--node-monitor-period=2s".into(),
            ]);
        }
        let kcm = Process::spawn(
            "kube-controller-manager",
            &b.kube_controller_manager,
            &kcm_args,
            dir.join("kube-controller-manager.log"),
        )?;
        self.processes.push(kcm);
        let sched_port = free_port()?;
        let scheduler = Process::spawn(
            "kube-scheduler",
            &b.kube_scheduler,
            &[
                kubeconfig_arg.clone(),
                "--bind-address=127.0.0.1".into(),
                format!("--secure-port={sched_port}"),
                format!("--cert-dir={}", dir.join("scheduler-pki").display()),
                "--leader-elect=false".into(),
                "--v=1".into(),
            ],
            dir.join("kube-scheduler.log"),
        )?;
        self.processes.push(scheduler);
        let kwok = Process::spawn(
            "kwok",
            &b.kwok,
            &[
                kubeconfig_arg,
                format!("--config={}", b.kwok_stages.display()),
                "--manage-all-nodes=false".into(),
                "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake".into(),
                "--node-lease-duration-seconds=40".into(),
                // Simulated pod IPs, in 198.18.0.0/15 like every address the tests use (the
                // real node's bridge is 198.18.0.0/24, Services 198.19.0.0/16).
                "--cidr=198.18.128.0/17".into(),
                "--node-ip=127.0.0.1".into(),
                format!("--server-address=127.0.0.1:{}", free_port()?),
            ],
            dir.join("kwok.log"),
        )?;
        self.processes.push(kwok);
        // The real nodes need only the API server: they start while the controllers come up.
        let env = node::NodeEnv {
            binaries: self.binaries.clone(),
            dir: self.dir.clone(),
            kubeconfig: self.kubeconfig.clone(),
            apiserver_url: self.apiserver_url.clone(),
            client: self.client()?,
            config: self.config.clone(),
        };
        let real_nodes = async {
            match placement {
                Some(Placement { cluster, machine }) => {
                    RealNodes::start(&env, cluster, machine, options.timeout)
                        .await
                        .map(Some)
                }
                None => Ok(None),
            }
        };
        let (controllers, real_nodes) = tokio::join!(
            self.wait_controllers(options, kcm_port, sched_port),
            real_nodes
        );
        controllers?;
        self.node = real_nodes?;
        self.create_nodes(options).await
    }

    /// Waits until the controller manager and the scheduler are healthy and the controllers
    /// act (the `default` ServiceAccount exists).
    async fn wait_controllers(
        &mut self,
        options: &Options,
        kcm_port: u16,
        sched_port: u16,
    ) -> Result<(), Error> {
        for (index, port) in [(2, kcm_port), (3, sched_port)] {
            let url = format!("https://127.0.0.1:{port}");
            self.wait_healthy(index, options.timeout, move || {
                let url = url.clone();
                async move { insecure_healthz(&url).await }
            })
            .await?;
        }
        // The controllers act with their own ServiceAccounts' tokens, which they fetch as they
        // start: ready once the ServiceAccount controller has made `default/default` (a pod
        // needs its namespace's `default`).
        let client = self.client()?;
        self.wait_healthy(2, options.timeout, move || {
            let accounts: Api<k8s_openapi::api::core::v1::ServiceAccount> =
                Api::namespaced(client.clone(), "default");
            async move {
                accounts
                    .get("default")
                    .await
                    .map(|_| ())
                    .map_err(|e| format!("ServiceAccount default/default: {e}"))
            }
        })
        .await
    }

    /// Creates kwok-managed fake nodes and waits until they are Ready (proving kwok works).
    async fn create_nodes(&mut self, options: &Options) -> Result<(), Error> {
        let nodes: Api<Node> = Api::all(self.client()?);
        for i in 0..options.nodes {
            let node: Node = serde_json::from_value(serde_json::json!({
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": format!("kwok-node-{i}"),
                    "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
                    "labels": {
                        "type": "kwok",
                        "kubernetes.io/hostname": format!("kwok-node-{i}"),
                        "kubernetes.io/os": "linux",
                        "kubernetes.io/arch": "amd64",
                        "topology.kubernetes.io/zone": format!("zone-{}", i % 3),
                    }
                },
                "status": {
                    "allocatable": {"cpu": "64", "memory": "256Gi", "pods": "500"},
                    "capacity": {"cpu": "64", "memory": "256Gi", "pods": "500"}
                }
            }))
            .map_err(|e| Error::Other(format!("node manifest: {e}")))?;
            nodes
                .create(&PostParams::default(), &node)
                .await
                .map_err(|source| Error::Kube {
                    what: "create kwok node".into(),
                    source,
                })?;
        }
        let kwok_log = self.processes[4].log.clone();
        eventually("kwok nodes Ready", options.timeout, || {
            let nodes = nodes.clone();
            async move {
                let list = nodes
                    .list(&Default::default())
                    .await
                    .map_err(|e| e.to_string())?;
                let ready = list
                    .items
                    .iter()
                    .filter(|n| {
                        n.status
                            .as_ref()
                            .and_then(|s| s.conditions.as_ref())
                            .is_some_and(|c| {
                                c.iter().any(|c| c.type_ == "Ready" && c.status == "True")
                            })
                    })
                    .count();
                if ready == list.items.len() {
                    Ok(())
                } else {
                    Err(format!("{ready}/{} nodes Ready", list.items.len()))
                }
            }
        })
        .await
        .map_err(|e| Error::Unhealthy {
            component: "kwok",
            log: kwok_log,
            waited_secs: options.timeout.as_secs(),
            reason: e.to_string(),
        })
    }

    /// Polls `check` until it succeeds, failing early if a component's process exited.
    async fn wait_healthy<F, Fut>(
        &mut self,
        index: usize,
        timeout: Duration,
        check: F,
    ) -> Result<(), Error>
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = Result<(), String>>,
    {
        crate::process::wait_healthy(&mut self.processes, index, timeout, check).await
    }

    /// SIGKILLs `component` (it stays down until [`ControlPlane::start_again`]).
    pub fn kill(&mut self, component: Component) {
        self.processes[component.index()].kill();
    }

    /// Starts a killed `component` again with its arguments and data, and waits until it
    /// and the API server are healthy (`/readyz`).
    ///
    /// # Errors
    /// [`Error::Start`] or [`Error::Unhealthy`] naming the component and its log.
    pub async fn start_again(
        &mut self,
        component: Component,
        timeout: Duration,
    ) -> Result<(), Error> {
        self.processes[component.index()].restart()?;
        if component == Component::Etcd {
            let port = self.etcd_port;
            self.wait_healthy(0, timeout, move || async move {
                plain_http_get(port, "/health").await.map(|_| ())
            })
            .await?;
        }
        self.wait_apiserver_ready(timeout).await
    }

    /// SIGKILLs every component, the scheduler first and etcd last (the whole control plane
    /// lost, as its machine powered off); [`ControlPlane::start_all_again`] boots it.
    pub fn kill_all(&mut self) {
        for process in self.processes.iter_mut().rev() {
            process.kill();
        }
    }

    /// Starts every component again after [`ControlPlane::kill_all`], on their data; waits
    /// until etcd is healthy and the API server ready.
    ///
    /// # Errors
    /// [`Error::Start`] or [`Error::Unhealthy`] naming the component and its log.
    pub async fn start_all_again(&mut self, timeout: Duration) -> Result<(), Error> {
        // All of them first: a wait fails on any component that is not running. The API
        // server retries etcd until it answers.
        for process in &mut self.processes {
            process.restart()?;
        }
        let port = self.etcd_port;
        self.wait_healthy(0, timeout, move || async move {
            plain_http_get(port, "/health").await.map(|_| ())
        })
        .await?;
        self.wait_apiserver_ready(timeout).await
    }

    /// Sends SIGSTOP to `component` (a paused process: connections stay open, nothing answers).
    ///
    /// # Errors
    /// [`Error::Other`] when the signal cannot be sent.
    pub fn pause(&self, component: Component) -> Result<(), Error> {
        self.processes[component.index()].signal("STOP")
    }

    /// Sends SIGCONT to a paused `component`.
    ///
    /// # Errors
    /// [`Error::Other`] when the signal cannot be sent.
    pub fn resume(&self, component: Component) -> Result<(), Error> {
        self.processes[component.index()].signal("CONT")
    }

    /// Waits until the API server answers `/readyz` with 200 (etcd reachable, informers synced).
    ///
    /// # Errors
    /// [`Error::Unhealthy`] naming the API server's log.
    pub async fn wait_apiserver_ready(&mut self, timeout: Duration) -> Result<(), Error> {
        let config = self.config.clone();
        self.wait_healthy(Component::KubeApiserver.index(), timeout, move || {
            let config = config.clone();
            async move {
                match tokio::time::timeout(Duration::from_secs(5), get_text(&config, "/readyz"))
                    .await
                {
                    Ok(r) => r.map(|_| ()),
                    Err(_) => Err("/readyz did not answer within 5 s".into()),
                }
            }
        })
        .await
    }

    /// A new admin client (member of `system:masters`).
    ///
    /// Each call makes a new client, so tests running on different tokio runtimes never share
    /// a connection pool.
    pub fn client(&self) -> Result<Client, Error> {
        Client::try_from(self.config.clone()).map_err(|source| Error::Kube {
            what: "build a client".into(),
            source,
        })
    }

    /// The admin client configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The kubeconfig file for people and other tools (kubectl, Go programs).
    pub fn kubeconfig_path(&self) -> &Path {
        &self.kubeconfig
    }

    /// The API server's URL.
    pub fn apiserver_url(&self) -> &str {
        &self.apiserver_url
    }

    /// The binaries and versions this control plane runs.
    pub fn binaries(&self) -> &Binaries {
        &self.binaries
    }

    /// Time from [`ControlPlane::start`] to a ready control plane, including any build.
    pub fn started_in(&self) -> Duration {
        self.started_in
    }

    /// The (first) real node, if [`Options::real_node`] was set.
    pub fn real_node(&self) -> Option<&RealNode> {
        self.real_nodes().first()
    }

    /// The real nodes (none without [`Options::real_node`]).
    pub fn real_nodes(&self) -> &[RealNode] {
        self.node.as_ref().map_or(&[], RealNodes::nodes)
    }

    /// Real node `index`, to stop, start again or partition it.
    pub fn real_node_mut(&mut self, index: usize) -> Option<&mut RealNode> {
        self.node
            .as_mut()
            .and_then(|nodes| nodes.nodes_mut().get_mut(index))
    }

    /// The API server's audit log (JSON lines), when started with [`Options::audit`].
    pub fn audit_log(&self) -> Option<PathBuf> {
        let path = self.dir.join("audit.log");
        path.exists().then_some(path)
    }

    /// The directory holding logs, kubeconfig and etcd data.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        // The real node first (its teardown needs nothing from the control plane), then the
        // rest in reverse start order: clients of the API server first, etcd last.
        self.node = None;
        while let Some(p) = self.processes.pop() {
            drop(p);
        }
        if !self.keep_dir {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// A fresh directory under `$TMPDIR/steward-testenv/`, sweeping those of dead processes
/// (a test binary's shared control plane is never dropped, so its dir is removed next time).
fn new_run_dir() -> Result<PathBuf, Error> {
    let base = std::env::temp_dir().join("steward-testenv");
    std::fs::create_dir_all(&base).map_err(|source| Error::Io {
        what: format!("create {}", base.display()),
        source,
    })?;
    if let Ok(entries) = std::fs::read_dir(&base) {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().to_string();
            let pid = name
                .strip_prefix("cp-")
                .and_then(|r| r.split('-').next())
                .and_then(|p| p.parse::<u32>().ok());
            if let Some(pid) = pid
                && !Path::new(&format!("/proc/{pid}")).exists()
                && !entry.path().join("keep").exists()
            {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    }
    let dir = base.join(format!(
        "cp-{}-{:08x}",
        std::process::id(),
        rand::random::<u32>()
    ));
    std::fs::create_dir_all(&dir).map_err(|source| Error::Io {
        what: format!("create {}", dir.display()),
        source,
    })?;
    Ok(dir)
}

/// The last `-----BEGIN ...-----` block of a PEM bundle (the whole text if there is none).
fn last_pem_block(pem: &str) -> String {
    match pem.rfind("-----BEGIN") {
        Some(i) => pem[i..].to_string(),
        None => pem.to_string(),
    }
}

fn random_token() -> String {
    hex::encode(rand::random::<[u8; 24]>())
}

fn run_openssl(args: &[&str], dir: &Path) -> Result<(), Error> {
    let out = std::process::Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .map_err(|source| Error::Io {
            what: "run openssl (needed to make the service-account key)".into(),
            source,
        })?;
    if out.status.success() {
        Ok(())
    } else {
        Err(Error::Other(format!(
            "openssl {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        )))
    }
}

fn kubeconfig_yaml(server: &str, ca_pem: &[u8], token: &str) -> String {
    use base64::Engine;
    let ca = base64::engine::general_purpose::STANDARD.encode(ca_pem);
    format!(
        "apiVersion: v1
kind: Config
clusters:
- name: steward-testenv
  cluster:
    server: {server}
    certificate-authority-data: {ca}
users:
- name: {ADMIN_USER}
  user:
    token: {token}
contexts:
- name: steward-testenv
  context:
    cluster: steward-testenv
    user: {ADMIN_USER}
    namespace: default
current-context: steward-testenv
"
    )
}

async fn load_kubeconfig(path: &Path) -> Result<Config, Error> {
    let kc =
        Kubeconfig::read_from(path).map_err(|e| Error::Other(format!("read kubeconfig: {e}")))?;
    Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .map_err(|e| Error::Other(format!("load kubeconfig: {e}")))
}

async fn get_text(config: &Config, path: &str) -> Result<String, String> {
    let client = Client::try_from(config.clone()).map_err(|e| e.to_string())?;
    let req = http::Request::get(path)
        .body(Vec::new())
        .map_err(|e| e.to_string())?;
    client.request_text(req).await.map_err(|e| e.to_string())
}

async fn insecure_healthz(url: &str) -> Result<(), String> {
    let mut config = Config::new(url.parse().map_err(|e| format!("{e}"))?);
    config.accept_invalid_certs = true;
    let body = get_text(&config, "/healthz").await?;
    if body.trim() == "ok" {
        Ok(())
    } else {
        Err(body)
    }
}

/// A GET over plain HTTP/1.0 on loopback (etcd's health endpoint).
async fn plain_http_get(port: u16, path: &str) -> Result<String, String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(|e| e.to_string())?;
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())
        .await
        .map_err(|e| e.to_string())?;
    let mut body = String::new();
    stream
        .read_to_string(&mut body)
        .await
        .map_err(|e| e.to_string())?;
    Ok(body)
}
