//! The PostgresCluster fixture of the real-node tests (`postgres_cluster`, `postgres_backup`):
//! [`Cluster`] starts a control plane with the real node, the database-operator in the test
//! process and a PostgresCluster on it; [`writer`] and [`gated_writer`] write through its
//! `-rw` Service and record what was acknowledged.

#![allow(dead_code)] // each test binary uses part of it

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use database_operator::crd::PostgresCluster;
use k8s_openapi::api::core::v1::{Pod, Secret, Service};
use kube::api::Api;
use kube::{Client, ResourceExt};
use serde_json::json;
use steward_testenv::{ControlPlane, deploy, eventually};

use crate::support::{WAIT, connect, logs, start, start_nodes};

/// The CA rotation grace the real-node tests' operator runs with (`--ca-rotation-grace`; 24 h
/// by default): longer than the kubelet's 10 s sync of the pods' Secret volumes, so every pod
/// has the bundle of both CAs before the new one signs.
pub(crate) const CA_ROTATION_GRACE: Duration = Duration::from_secs(20);

/// One real node per machine: the tests of this binary take turns.
pub(crate) static NODE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The database-operator's and the instance manager's binaries, built.
fn operator_binary() -> deploy::Built {
    let mut built = deploy::build(&[deploy::Spec {
        name: database_operator::NAME,
        companions:
            <database_operator::DatabaseOperator as steward_core::operator::Definition>::COMPANIONS,
    }])
    .expect("database-operator and steward-pg-instance binaries");
    built.remove(0)
}

/// A PostgresCluster `pg` on the real node, reconciled by an in-process database-operator.
pub(crate) struct Cluster {
    /// Kept alive: dropping it stops the control plane and the node.
    pub(crate) _cp: ControlPlane,
    pub(crate) ns: String,
    pub(crate) client: Client,
    pub(crate) password: String,
    pub(crate) operator: Option<steward_testenv::harness::Harness>,
    /// An operator started by [`Cluster::start_killable_operator`].
    pub(crate) killable: Option<steward_testenv::harness::Crashable>,
    pub(crate) instance_image: String,
    /// The operator's binaries (for [`deploy::operator`]).
    pub(crate) built: deploy::Built,
    pub(crate) instances: i32,
    /// `spec.synchronousReplicas` of `pg` (0: asynchronous).
    pub(crate) synchronous_replicas: i32,
    /// The node's PostgreSQL image (`…:<major>`).
    pub(crate) image: String,
    /// The volumes' StorageClass: none (hostPath volumes made by the fixture, bound in
    /// advance) on one node, testenv's node-local provisioner on several.
    pub(crate) storage_class: Option<&'static str>,
}

impl Cluster {
    /// Builds the operator's image (with the instance manager), creates hostPath volumes,
    /// starts the operator and a PostgresCluster of `instances`, and waits until it is Ready.
    pub(crate) async fn start(
        prefix: &str,
        instances: i32,
        synchronous_replicas: Option<i32>,
    ) -> Cluster {
        let mut cluster = Cluster::new(prefix, instances).await;
        cluster
            .create(json!({"synchronousReplicas": synchronous_replicas}))
            .await;
        cluster
    }

    /// Everything but the PostgresCluster: the control plane with the real node, the
    /// operator's image, a namespace, hostPath volumes for `pg`'s instances, the operator.
    pub(crate) async fn new(prefix: &str, instances: i32) -> Cluster {
        Self::on_nodes(prefix, instances, 1).await
    }

    /// [`Cluster::new`] on `nodes` real nodes (several: each in a zone of its own, the
    /// volumes provisioned by testenv on the node the scheduler chose for each instance, see
    /// `steward_testenv::node::local_volumes`).
    pub(crate) async fn on_nodes(prefix: &str, instances: i32, nodes: usize) -> Cluster {
        let built = Instant::now();
        let binary = operator_binary();
        let binaries = format!("binaries {:.1?}", built.elapsed());
        let started = Instant::now();
        let cp = if nodes > 1 {
            start_nodes(nodes).await
        } else {
            start().await
        };
        let started = format!("control plane {:.1?}", started.elapsed());
        let storage_class =
            (nodes > 1).then_some(steward_testenv::node::local_volumes::STORAGE_CLASS);
        Self::on(
            cp,
            prefix,
            instances,
            binary,
            storage_class,
            vec![binaries, started],
        )
        .await
    }

    /// Two Kubernetes clusters on the machine (two control planes with a real node each,
    /// sharing nothing but the host, where a test's object store runs): a fixture in each,
    /// with its own operator and a namespace named after `prefix`, of `instances[i]`.
    pub(crate) async fn pair(prefix: &str, instances: [i32; 2]) -> (Cluster, Cluster) {
        let binary = operator_binary();
        let started = Instant::now();
        let (a, b) = ControlPlane::start_pair(
            steward_testenv::Options::real_nodes(1),
            steward_testenv::Options::real_nodes(1),
        )
        .await
        .expect("two control planes with a real node each");
        let started = format!("two control planes {:.1?}", started.elapsed());
        let class = Some(steward_testenv::node::local_volumes::STORAGE_CLASS);
        let a = Self::on(
            a,
            prefix,
            instances[0],
            binary.clone(),
            class,
            vec![started],
        )
        .await;
        let b = Self::on(b, prefix, instances[1], binary, class, Vec::new()).await;
        (a, b)
    }

    /// The fixture on control plane `cp`: the operator's image on its nodes, a namespace,
    /// volumes for `pg`'s instances (hostPath ones made here without `storage_class`), the
    /// operator.
    async fn on(
        cp: ControlPlane,
        prefix: &str,
        instances: i32,
        binary: deploy::Built,
        storage_class: Option<&'static str>,
        mut laps: Vec<String>,
    ) -> Cluster {
        let mut lap = Instant::now();
        let mut time = |what: &'static str| {
            laps.push(format!("{what} {:.1?}", lap.elapsed()));
            lap = Instant::now();
        };
        cp.install_crds(&steward_testenv::workspace_root().join("crds"))
            .await
            .expect("CRDs");
        time("CRDs");
        let instance_image = deploy::image(&cp, &binary)
            .await
            .expect("the operator's image")
            .reference;
        time("operator image");
        let ns = cp.namespace(prefix).await.unwrap();
        let images = futures::future::try_join_all(
            cp.real_nodes()
                .iter()
                .map(steward_testenv::RealNode::postgresql_image),
        )
        .await
        .expect("PostgreSQL image");
        let image = images[0].clone();
        time("PostgreSQL image");
        let client = cp.client().unwrap();
        let mut cluster = Cluster {
            _cp: cp,
            ns: ns.clone(),
            client: client.clone(),
            password: String::new(),
            operator: None,
            killable: None,
            instance_image,
            built: binary,
            instances,
            synchronous_replicas: 0,
            image,
            storage_class,
        };
        if cluster.storage_class.is_none() {
            cluster.volumes("pg", instances).await;
            time("volumes");
        }
        cluster.start_operator().await;
        time("operator");
        eprintln!("PostgresCluster fixture: {}", laps.join(", "));
        cluster
    }

    /// hostPath volumes for the instances of PostgresCluster `name`.
    pub(crate) async fn volumes(&self, name: &str, instances: i32) {
        if self.storage_class.is_some() {
            return; // provisioned by testenv
        }
        for i in 0..instances {
            self.volume(&format!("{name}-{i}"), &format!("{}-{name}-{i}", self.ns))
                .await;
        }
    }

    /// A new, empty hostPath volume `pv` for the claim of instance `pod` (the testenv's
    /// node has no provisioner: this is one, by hand).
    pub(crate) async fn volume(&self, pod: &str, pv: &str) {
        let nodes = self._cp.real_nodes();
        let index: usize = pod
            .rsplit('-')
            .next()
            .and_then(|i| i.parse().ok())
            .unwrap_or(0);
        let pv = nodes[index % nodes.len()]
            .volume(
                pv,
                "1Gi",
                Some((&self.ns, &format!("data-{pod}"))),
                steward_testenv::images::POSTGRES_UID,
            )
            .unwrap();
        steward_testenv::manifests::apply(&self.client, &pv, None, "real-node-test", false)
            .await
            .unwrap();
    }

    /// The manifest of PostgresCluster `name` of `instances` on the node's PostgreSQL image,
    /// with `extra` merged into its spec.
    pub(crate) fn manifest(
        &self,
        name: &str,
        instances: i32,
        extra: serde_json::Value,
    ) -> serde_json::Value {
        let major = image_major(&self.image);
        let mut manifest = json!({
            "apiVersion": "database.steward.dev/v1alpha1", "kind": "PostgresCluster",
            "metadata": {"name": name, "namespace": self.ns},
            "spec": {"instances": instances, "version": major, "image": self.image, "imagePullPolicy": "Never",
                     "storage": {"size": "1Gi"}, "deletionPolicy": "Delete",
                     "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}}},
        });
        if let Some(class) = self.storage_class {
            manifest["spec"]["storage"]["storageClassName"] = json!(class);
        }
        for (k, v) in extra.as_object().unwrap() {
            manifest["spec"][k] = v.clone();
        }
        manifest
    }

    /// Creates PostgresCluster `pg` (with `extra` in its spec) and waits until it is Ready.
    pub(crate) async fn create(&mut self, extra: serde_json::Value) {
        let (client, instances) = (self.client.clone(), self.instances);
        let created = Instant::now();
        self.synchronous_replicas = extra["synchronousReplicas"]
            .as_i64()
            .and_then(|n| i32::try_from(n).ok())
            .unwrap_or(0);
        let manifest = self.manifest("pg", instances, extra);
        steward_testenv::manifests::apply(&client, &manifest, None, "real-node-test", false)
            .await
            .unwrap();
        self.password = self.superuser_password("pg").await;
        self.wait_ready(Duration::from_secs(240)).await;
        eprintln!(
            "PostgresCluster of {instances} instances Ready {:.1?} after it was created",
            created.elapsed()
        );
    }

    /// The superuser password of PostgresCluster `name`, once its Secret exists.
    pub(crate) async fn superuser_password(&self, name: &str) -> String {
        self.secret_value(&format!("{name}-superuser"), "password")
            .await
    }

    /// Key `key` of Secret `name` in the cluster's namespace, once the Secret exists.
    pub(crate) async fn secret_value(&self, name: &str, key: &str) -> String {
        let secrets: Api<Secret> = Api::namespaced(self.client.clone(), &self.ns);
        let secret: Secret = eventually(&format!("Secret {name}"), WAIT, || {
            let secrets = secrets.clone();
            async move { secrets.get(name).await.map_err(|e| e.to_string()) }
        })
        .await
        .unwrap();
        String::from_utf8(secret.data.unwrap()[key].0.clone()).unwrap()
    }

    /// The database-operator watching the cluster's namespace, registered, not started
    /// (a closure, to build it on the runtime it runs on).
    pub(crate) fn operator(&self) -> impl FnOnce() -> steward_core::Operator + Send + 'static {
        let (ns, config, instance_image) = (
            self.ns.clone(),
            self._cp.config().clone(),
            self.instance_image.clone(),
        );
        move || {
            // test_args' 5 s shutdown bound, shorter than the 10 s connect timeout on
            // purpose: a reconcile connecting to a partitioned or killed instance when the
            // test stops the operator is cancelled at the drain deadline, and the stop is
            // clean (`stop_operator` asserts it).
            let args = steward_core::cli::CommonArgs {
                watch_namespace: Some(ns),
                ..steward_testenv::harness::test_args()
            };
            let mut operator =
                steward_core::Operator::with_config(database_operator::NAME, args, config).unwrap();
            database_operator::register(
                &mut operator,
                database_operator::Options {
                    resync_interval: Duration::from_secs(2),
                    instance_image,
                    ca_rotation_grace: CA_ROTATION_GRACE,
                    ..Default::default()
                },
            )
            .unwrap();
            operator
        }
    }

    /// Starts the database-operator (in this process), watching the cluster's namespace.
    pub(crate) async fn start_operator(&mut self) {
        let operator = self.operator()();
        self.operator = Some(steward_testenv::harness::Harness::start(operator).await);
    }

    /// Starts the database-operator on a runtime of its own, so that
    /// [`Cluster::kill_operator`] can kill it mid-flight.
    pub(crate) async fn start_killable_operator(&mut self) {
        let build = self.operator();
        let (operator, ()) =
            steward_testenv::harness::Crashable::start(move || (build(), ())).await;
        self.killable = Some(operator);
    }

    pub(crate) fn kill_operator(&mut self) {
        if let Some(operator) = self.killable.take() {
            operator.kill();
        }
    }

    pub(crate) async fn stop_operator(&mut self) {
        if let Some(operator) = self.operator.take() {
            operator.stop().await.unwrap();
        }
        self.kill_operator();
    }

    pub(crate) fn clusters(&self) -> Api<PostgresCluster> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    /// The message of condition `type_` of PostgresCluster `pg`, once it has `status` and
    /// `reason`.
    pub(crate) async fn condition_message(
        &self,
        type_: &str,
        status: &str,
        reason: &str,
    ) -> String {
        self.status_matching(&format!("{type_} is {status} ({reason})"), |got| {
            got.conditions
                .iter()
                .find(|c| c.type_ == type_ && c.status == status && c.reason == reason)
                .map(|c| c.message.clone())
        })
        .await
    }

    /// Asks for a switchover to `to` (annotation `database.steward.dev/switchover-to`), or
    /// withdraws the request (`None`).
    pub(crate) async fn ask_switchover(&self, to: Option<&str>) {
        let annotation =
            json!({"metadata": {"annotations": {"database.steward.dev/switchover-to": to}}});
        self.clusters()
            .patch(
                "pg",
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(annotation),
            )
            .await
            .unwrap();
    }

    /// What `pick` finds in PostgresCluster `pg`'s status, once it finds something.
    pub(crate) async fn status_matching(
        &self,
        what: &str,
        pick: impl Fn(&database_operator::crd::PostgresClusterStatus) -> Option<String>,
    ) -> String {
        let clusters = self.clusters();
        let pick = &pick;
        let found = eventually(what, WAIT, || {
            let clusters = clusters.clone();
            async move {
                let got = clusters
                    .get("pg")
                    .await
                    .map_err(|e| e.to_string())?
                    .status
                    .unwrap_or_default();
                pick(&got).ok_or_else(|| format!("{got:?}"))
            }
        })
        .await;
        match found {
            Ok(found) => found,
            Err(e) => {
                let pods = self.pods().list(&Default::default()).await.unwrap();
                panic!(
                    "{e}\npods: {}\n{}",
                    deploy::describe_pods(&pods.items),
                    self.logs().await
                )
            }
        }
    }

    pub(crate) async fn status(&self) -> database_operator::crd::PostgresClusterStatus {
        self.clusters()
            .get("pg")
            .await
            .unwrap()
            .status
            .unwrap_or_default()
    }

    pub(crate) fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    /// Waits until the cluster says Ready with every instance ready; panics with the pods'
    /// logs otherwise.
    pub(crate) async fn wait_ready(&self, timeout: Duration) {
        let clusters: Api<PostgresCluster> = Api::namespaced(self.client.clone(), &self.ns);
        let (pods, instances) = (self.pods(), self.instances);
        let ready = eventually("PostgresCluster pg Ready", timeout, || {
            let (clusters, pods) = (clusters.clone(), pods.clone());
            async move {
                let c = clusters.get("pg").await.map_err(|e| e.to_string())?;
                let status = c.status.unwrap_or_default();
                let ready = status
                    .conditions
                    .iter()
                    .any(|c| c.type_ == "Ready" && c.status == "True");
                if ready && status.ready_instances == instances {
                    return Ok(());
                }
                let list = pods
                    .list(&Default::default())
                    .await
                    .map_err(|e| e.to_string())?;
                Err(format!(
                    "phase {:?}, primary {:?}; pods: {}",
                    status.phase,
                    status.primary,
                    deploy::describe_pods(&list.items)
                ))
            }
        })
        .await;
        if let Err(e) = ready {
            panic!("{e}\n{}", self.logs().await);
        }
    }

    pub(crate) async fn logs(&self) -> String {
        let mut out = String::new();
        for i in 0..self.instances {
            let pod = format!("pg-{i}");
            // A container that restarted: what it said before, too.
            let previous = kube::api::LogParams {
                previous: true,
                ..Default::default()
            };
            if let Ok(before) = self.pods().logs(&pod, &previous).await {
                out.push_str(&format!("--- {pod} (previous container):\n{before}\n"));
            }
            out.push_str(&format!("--- {pod}:\n{}\n", logs(&self.pods(), &pod).await));
        }
        // The poolers' agents (`spec.pooler`), if any.
        let poolers =
            kube::api::ListParams::default().labels(steward_pg_instance::contract::pooler::LABEL);
        if let Ok(list) = self.pods().list(&poolers).await {
            for pod in list.items {
                let pod = pod.name_any();
                out.push_str(&format!("--- {pod}:\n{}\n", logs(&self.pods(), &pod).await));
            }
        }
        out
    }

    pub(crate) async fn cluster_ip(&self, service: &str) -> String {
        let services: Api<Service> = Api::namespaced(self.client.clone(), &self.ns);
        services
            .get(service)
            .await
            .unwrap()
            .spec
            .unwrap()
            .cluster_ip
            .unwrap()
    }

    /// [`Cluster::cluster_ip`] of a Service that may not exist yet: once it does.
    pub(crate) async fn wait_cluster_ip(&self, service: &str) -> String {
        eventually(&format!("Service {service}"), WAIT, || async {
            let services: Api<Service> = Api::namespaced(self.client.clone(), &self.ns);
            services
                .get(service)
                .await
                .map_err(|e| e.to_string())?
                .spec
                .and_then(|s| s.cluster_ip)
                .ok_or("no ClusterIP".to_string())
        })
        .await
        .unwrap()
    }

    /// The pod labelled primary now, if one is (during a switchover the label moves).
    pub(crate) async fn labelled_primary(&self) -> Result<String, String> {
        let list = self
            .pods()
            .list(&kube::api::ListParams::default().labels("database.steward.dev/role=primary"))
            .await
            .map_err(|e| e.to_string())?;
        list.items
            .first()
            .map(ResourceExt::name_any)
            .ok_or_else(|| "no pod labelled primary".to_string())
    }

    /// The pod labelled primary, and its IP.
    pub(crate) async fn primary(&self) -> (String, String) {
        let list = self
            .pods()
            .list(&kube::api::ListParams::default().labels("database.steward.dev/role=primary"))
            .await
            .unwrap();
        let pod = list.items.first().expect("a pod labelled primary");
        (
            pod.name_any(),
            pod.status.as_ref().unwrap().pod_ip.clone().unwrap(),
        )
    }

    /// Host pids of `pod`'s instance manager (`steward-pg-instance run`) and postmaster.
    pub(crate) fn processes(&self, pod: &str) -> (u32, u32) {
        let all = self.pod_processes(pod);
        let manager = all
            .iter()
            .find(|(_, _, cmd)| cmd.contains("steward-pg-instance run"))
            .map(|(pid, ..)| *pid)
            .unwrap_or_else(|| panic!("no instance manager of {pod} found"));
        let postmaster = all
            .iter()
            .find(|(_, ppid, cmd)| *ppid == manager && cmd.starts_with("postgres"))
            .map(|(pid, ..)| *pid)
            .unwrap_or_else(|| panic!("no postmaster under {pod}'s manager {manager}: {all:?}"));
        (manager, postmaster)
    }

    /// The host pid of `pod`'s watchdog (`steward-pg-instance watchdog`, a child of its
    /// instance manager `manager`), if it runs.
    pub(crate) fn watchdog(&self, pod: &str, manager: u32) -> Option<u32> {
        self.pod_processes(pod)
            .into_iter()
            .find(|(_, ppid, cmd)| *ppid == manager && cmd.contains("watchdog"))
            .map(|(pid, ..)| pid)
    }

    /// The host pid of `pod`'s WAL receiver (a replica streaming), if it runs: a child of
    /// its postmaster (PostgreSQL's process titles overwrite a child's environment, so it is
    /// found by its parent, not by the pod's variables).
    pub(crate) fn walreceiver(&self, pod: &str) -> Option<u32> {
        let postmaster = self
            .pod_processes(pod)
            .into_iter()
            .find(|(.., cmd)| cmd.starts_with("postgres"))?
            .0;
        host_processes(|_| true)
            .into_iter()
            .find(|(_, ppid, cmd)| *ppid == postmaster && cmd.contains("walreceiver"))
            .map(|(pid, ..)| pid)
    }

    /// Every host process of `pod`'s instance container that still has its environment:
    /// pid, parent pid, command line.
    fn pod_processes(&self, pod: &str) -> Vec<(u32, u32, String)> {
        let markers = [
            format!("POD_NAME={pod}"),
            format!("POD_NAMESPACE={}", self.ns),
        ];
        host_processes(|environ| markers.iter().all(|m| environ.split('\0').any(|e| e == m)))
    }
}

/// The PostgreSQL major of a testenv PostgreSQL image (its tag: `…:<major>`).
pub(crate) fn image_major(image: &str) -> i32 {
    image
        .rsplit(':')
        .next()
        .and_then(|tag| tag.parse().ok())
        .unwrap_or_else(|| panic!("{image} is not tagged with its major"))
}

/// The host's processes whose environment passes `keep`: pid, parent pid, command line.
fn host_processes(keep: impl Fn(&str) -> bool) -> Vec<(u32, u32, String)> {
    let mut all = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let environ = std::fs::read(entry.path().join("environ")).unwrap_or_default();
        if !keep(&String::from_utf8_lossy(&environ)) {
            continue;
        }
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        let ppid: u32 = stat
            .rsplit(')')
            .next()
            .and_then(|s| s.split_whitespace().nth(1))
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        all.push((pid, ppid, cmdline));
    }
    all
}

/// A process in the same network namespace as host process `pid` that lives as long as the
/// pod: its sandbox (pause) process, so the namespace can be entered after the container
/// restarted.
pub(crate) fn sandbox_of(pid: u32) -> u32 {
    let netns = std::fs::read_link(format!("/proc/{pid}/ns/net")).unwrap();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_string_lossy().parse::<u32>().ok())
        .find(|p| {
            std::fs::read_link(format!("/proc/{p}/ns/net")).is_ok_and(|n| n == netns)
                && std::fs::read(format!("/proc/{p}/cmdline"))
                    .is_ok_and(|c| String::from_utf8_lossy(&c).contains("pause"))
        })
        .unwrap_or(pid)
}

/// A connection to `host_ip` as `postgres`, TLS verified for `name` against `ca` (PEM):
/// libpq's `sslmode=verify-full` with `hostaddr`.
pub(crate) async fn verify_full(
    name: &str,
    host_ip: &str,
    password: &str,
    ca: &[u8],
) -> Result<tokio_postgres::Client, String> {
    verify_full_as(name, host_ip, ("postgres", password, "postgres"), ca).await
}

/// As [`verify_full`], as `(user, password, database)`.
pub(crate) async fn verify_full_as(
    name: &str,
    host_ip: &str,
    (user, password, dbname): (&str, &str, &str),
    ca: &[u8],
) -> Result<tokio_postgres::Client, String> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca) {
        roots
            .add(cert.map_err(|e| e.to_string())?)
            .map_err(|e| e.to_string())?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    let mut config = tokio_postgres::Config::new();
    config
        .host(name)
        .hostaddr(host_ip.parse().map_err(|e| format!("{e}"))?)
        .port(5432)
        .user(user)
        .password(password)
        .dbname(dbname)
        .ssl_mode(tokio_postgres::config::SslMode::Require)
        .connect_timeout(Duration::from_secs(5));
    let (client, connection) = config
        .connect(tokio_postgres_rustls::MakeRustlsConnect::new(tls))
        .await
        .map_err(|e| format!("{e:?}"))?;
    tokio::spawn(connection);
    Ok(client)
}

pub(crate) fn signal(pid: u32, signal: &str) {
    let status = std::process::Command::new("kill")
        .args([&format!("-{signal}"), &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill -{signal} {pid}");
}

/// What a writer saw: acknowledged ids, with when and which server acknowledged them.
#[derive(Default)]
pub(crate) struct Acks {
    pub(crate) rows: Vec<(i64, Instant, String)>,
    /// Ids whose insert failed or timed out: they may or may not have committed.
    pub(crate) unsure: Vec<i64>,
}

/// Starts a [`writer`] through `rw` and waits until it has `at_least` acknowledged writes:
/// what it records, the token that stops it, and its task.
pub(crate) async fn start_writer(
    rw: &str,
    password: &str,
    at_least: usize,
) -> (
    Arc<Mutex<Acks>>,
    tokio_util::sync::CancellationToken,
    tokio::task::JoinHandle<()>,
) {
    let acks = Arc::new(Mutex::new(Acks::default()));
    let stop = tokio_util::sync::CancellationToken::new();
    let writing = tokio::spawn(writer(
        rw.to_string(),
        password.to_string(),
        acks.clone(),
        stop.clone(),
    ));
    acknowledged("writes through pg-rw", &acks, at_least, WAIT).await;
    (acks, stop, writing)
}

/// Waits (up to `within`, as `what`) until `acks` has `at_least` acknowledged writes.
pub(crate) async fn acknowledged(
    what: &str,
    acks: &Arc<Mutex<Acks>>,
    at_least: usize,
    within: Duration,
) {
    eventually(what, within, || {
        let acks = acks.clone();
        async move {
            let n = acks.lock().unwrap().rows.len();
            if n >= at_least {
                Ok(())
            } else {
                Err(format!("{n} of {at_least} acknowledged writes"))
            }
        }
    })
    .await
    .unwrap();
}

/// How long after `since` an instance other than the one at `old_ip` first acknowledged a write
/// (a failover: a new primary serves `-rw`), waiting up to `within`.
pub(crate) async fn taken_over(
    acks: &Arc<Mutex<Acks>>,
    since: Instant,
    old_ip: &str,
    within: Duration,
) -> Result<Duration, steward_testenv::Error> {
    eventually(
        "a write acknowledged through pg-rw by another instance",
        within,
        || async move {
            let acks = acks.lock().unwrap();
            acks.rows
                .iter()
                .find(|(_, at, server)| *at > since && server != old_ip)
                .map(|(_, at, _)| at.duration_since(since))
                .ok_or_else(|| format!("{} writes acknowledged", acks.rows.len()))
        },
    )
    .await
}

/// Tries a write on the old primary every 100 ms until `stop`, from inside its pod's network
/// namespace (that of host process `pid`) to 127.0.0.1, so a primary
/// cut off the network is probed too; records when one was acknowledged.
pub(crate) async fn old_primary_probe(
    pid: u32,
    password: String,
    accepted: Arc<Mutex<Vec<Instant>>>,
    stop: tokio_util::sync::CancellationToken,
) {
    while !stop.is_cancelled() {
        let attempt = tokio::process::Command::new("nsenter")
            .arg(format!("--net=/proc/{pid}/ns/net"))
            .args([
                "psql",
                "host=127.0.0.1 port=5432 user=postgres dbname=postgres connect_timeout=1",
                "-qAtc",
                "insert into fence_probe default values",
            ])
            .env("PGPASSWORD", &password)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .status();
        let result = tokio::time::timeout(Duration::from_secs(2), attempt).await;
        if matches!(result, Ok(Ok(status)) if status.success()) {
            accepted.lock().unwrap().push(Instant::now());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Starts [`old_primary_probe`] on `pod` (from the network namespace of its sandbox, which
/// outlives its containers) and waits until the probe has written once.
pub(crate) async fn probe_primary(
    cluster: &Cluster,
    pod: &str,
    accepted: Arc<Mutex<Vec<Instant>>>,
    stop: tokio_util::sync::CancellationToken,
) -> tokio::task::JoinHandle<()> {
    let (manager, _) = cluster.processes(pod);
    let probing = tokio::spawn(old_primary_probe(
        sandbox_of(manager),
        cluster.password.clone(),
        accepted.clone(),
        stop,
    ));
    eventually(&format!("the probe writes on {pod}"), WAIT, || {
        let accepted = accepted.clone();
        async move {
            if accepted.lock().unwrap().is_empty() {
                Err("no write yet".to_string())
            } else {
                Ok(())
            }
        }
    })
    .await
    .unwrap();
    probing
}

/// The Events of the cluster's PostgresClusters, as `<time> <reason>: <message>`.
pub(crate) async fn cluster_events(cluster: &Cluster) -> Vec<String> {
    let events: Api<k8s_openapi::api::core::v1::Event> =
        Api::namespaced(cluster.client.clone(), &cluster.ns);
    events
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.involved_object.kind.as_deref() == Some("PostgresCluster"))
        .map(|e| {
            format!(
                "{} {}: {}",
                e.last_timestamp
                    .map(|t| t.0.to_string())
                    .unwrap_or_default(),
                e.reason.unwrap_or_default(),
                e.message.unwrap_or_default()
            )
        })
        .collect()
}

/// The longest time between two writes `acks` recorded as acknowledged after `since`.
pub(crate) fn longest_gap(acks: &Arc<Mutex<Acks>>, since: Instant) -> Duration {
    let acks = acks.lock().unwrap();
    let mut times: Vec<Instant> = acks
        .rows
        .iter()
        .map(|(_, at, _)| *at)
        .filter(|at| *at >= since)
        .collect();
    times.sort();
    std::iter::once(since)
        .chain(times)
        .collect::<Vec<_>>()
        .windows(2)
        .map(|w| w[1] - w[0])
        .max()
        .unwrap_or_default()
}

/// Of the rows `acks` recorded as acknowledged, how many `rw` has, and how many there are.
pub(crate) async fn acknowledged_present(
    rw: &str,
    password: &str,
    acks: &Arc<Mutex<Acks>>,
) -> (i64, i64) {
    let ids: Vec<i64> = acks.lock().unwrap().rows.iter().map(|r| r.0).collect();
    let present: i64 = connect(rw, password)
        .await
        .unwrap()
        .query_one(
            "select count(distinct id) from acks where id = any($1)",
            &[&ids],
        )
        .await
        .unwrap()
        .get(0);
    (present, ids.len() as i64)
}

/// Inserts one row every 50 ms through `host` (the `-rw` Service) until `stop`, reconnecting
/// after errors; records what was acknowledged.
pub(crate) async fn writer(
    host: String,
    password: String,
    acks: Arc<Mutex<Acks>>,
    stop: tokio_util::sync::CancellationToken,
) {
    let gate = Arc::new(tokio::sync::Mutex::new(()));
    gated_writer(host, password, acks, stop, gate).await;
}

/// [`writer`], holding `gate` during each insert: whoever holds it knows no insert is in
/// flight (every id is acknowledged, or recorded as unsure) until it lets go.
pub(crate) async fn gated_writer(
    host: String,
    password: String,
    acks: Arc<Mutex<Acks>>,
    stop: tokio_util::sync::CancellationToken,
    gate: Arc<tokio::sync::Mutex<()>>,
) {
    let conn = format!(
        "host={host} port=5432 user=postgres password={password} dbname=postgres connect_timeout=1"
    );
    let mut id: i64 = 0;
    let mut client: Option<tokio_postgres::Client> = None;
    while !stop.is_cancelled() {
        if client
            .as_ref()
            .is_none_or(tokio_postgres::Client::is_closed)
        {
            client = match tokio::time::timeout(
                Duration::from_secs(2),
                tokio_postgres::connect(&conn, tokio_postgres::NoTls),
            )
            .await
            {
                Ok(Ok((c, connection))) => {
                    tokio::spawn(connection);
                    Some(c)
                }
                _ => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
        }
        let Some(c) = client.as_ref() else { continue };
        let held = gate.lock().await;
        if stop.is_cancelled() {
            break;
        }
        id += 1;
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&id];
        let insert = c.query_one(
            "insert into acks (id) values ($1) returning host(inet_server_addr())",
            &params,
        );
        match tokio::time::timeout(Duration::from_secs(2), insert).await {
            Ok(Ok(row)) => {
                let server: String = row.get(0);
                acks.lock().unwrap().rows.push((id, Instant::now(), server));
            }
            _ => {
                acks.lock().unwrap().unsure.push(id);
                client = None;
            }
        }
        drop(held);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The status of PostgresCluster `name` (for `eventually`: errors as text).
pub(crate) async fn status_of(
    clusters: &Api<PostgresCluster>,
    name: &str,
) -> Result<database_operator::crd::PostgresClusterStatus, String> {
    let cluster = clusters.get(name).await.map_err(|e| e.to_string())?;
    Ok(cluster.status.unwrap_or_default())
}

/// Waits until the cluster's `MajorUpgrade` condition has `reason`; its message. Panics with
/// the pods' logs otherwise.
pub(crate) async fn major_upgrade_condition(cluster: &Cluster, reason: &str) -> String {
    let clusters = cluster.clusters();
    let found = eventually(
        &format!("MajorUpgrade {reason}"),
        Duration::from_secs(300),
        || {
            let clusters = clusters.clone();
            async move {
                let status = status_of(&clusters, "pg").await?;
                let condition = status.conditions.iter().find(|c| c.type_ == "MajorUpgrade");
                match condition {
                    Some(c) if c.reason == reason => Ok(c.message.clone()),
                    other => Err(format!(
                        "condition {other:?}, upgrade {:?}",
                        status.major_upgrade
                    )),
                }
            }
        },
    )
    .await;
    match found {
        Ok(message) => message,
        Err(e) => panic!("{e}\n{}", cluster.logs().await),
    }
}

/// The backup tests' bucket.
pub(crate) const BUCKET: &str = "steward-backups";

/// An S3 server (S3Proxy) with the bucket `steward-backups` on the node's bridge address, the `s3-credentials` Secret in the
/// cluster's namespace, `spec.backup.objectStore` for the prefix `<ns>/<prefix>`, and a client
/// of that prefix to list what is stored.
pub(crate) async fn object_store(
    cluster: &Cluster,
    prefix: &str,
) -> (
    steward_testenv::s3::S3Server,
    serde_json::Value,
    steward_pg_instance::archive::Store,
) {
    let host = cluster._cp.real_node().expect("a real node").host_address();
    let s3 = steward_testenv::s3::S3Server::start(host, &[BUCKET])
        .await
        .expect("S3Proxy");
    let (spec, store) = store_on(cluster, &s3, prefix).await;
    (s3, spec, store)
}

/// The `s3-credentials` Secret in `cluster`'s namespace, `spec.backup.objectStore` for the
/// prefix `<ns>/<prefix>` of `s3`, and a client of that prefix.
pub(crate) async fn store_on(
    cluster: &Cluster,
    s3: &steward_testenv::s3::S3Server,
    prefix: &str,
) -> (serde_json::Value, steward_pg_instance::archive::Store) {
    use steward_pg_instance::archive::{Store, StoreConfig};
    let secret = steward_testenv::s3::S3Server::credentials_secret("s3-credentials", &cluster.ns);
    steward_testenv::manifests::apply(&cluster.client, &secret, None, "real-node-test", false)
        .await
        .unwrap();
    let path = format!("{}/{prefix}", cluster.ns);
    let spec = json!({"endpoint": s3.endpoint(), "bucket": BUCKET,
                      "path": path, "credentialsSecret": "s3-credentials"});
    let store = Store::open(
        StoreConfig::from_vars("S3", |name| match name {
            "S3_ENDPOINT" => Some(s3.endpoint().to_string()),
            "S3_BUCKET" => Some(BUCKET.into()),
            "S3_PATH" => Some(path.clone()),
            "S3_ACCESS_KEY_ID" => Some(steward_testenv::s3::S3Server::ACCESS_KEY.into()),
            "S3_SECRET_ACCESS_KEY" => Some(steward_testenv::s3::S3Server::SECRET_KEY.into()),
            _ => None,
        })
        .unwrap()
        .unwrap(),
    )
    .unwrap();
    (spec, store)
}

/// Waits until PostgresCluster `pg` says its WAL archiving works; its `status.backup` then
/// (the test's log and S3's in the panic otherwise).
pub(crate) async fn archiving(
    cluster: &Cluster,
    s3: &steward_testenv::s3::S3Server,
) -> database_operator::crd::ClusterBackupStatus {
    let archived = eventually("ContinuousArchiving True", WAIT, || {
        let clusters = cluster.clusters();
        async move {
            let status = status_of(&clusters, "pg").await?;
            let archiving = status
                .conditions
                .iter()
                .find(|c| c.type_ == "ContinuousArchiving")
                .cloned();
            match archiving {
                Some(c) if c.status == "True" => Ok(status.backup.unwrap_or_default()),
                other => Err(format!("{other:?}")),
            }
        }
    })
    .await;
    match archived {
        Ok(a) => a,
        Err(e) => panic!(
            "{e}\n{}\nS3 log:\n{}",
            cluster.logs().await,
            std::fs::read_to_string(s3.log()).unwrap_or_default()
        ),
    }
}

/// Ends the primary's current WAL file (on `db`) and waits until `pg`'s status reports it
/// archived; its name.
pub(crate) async fn archive_now(cluster: &Cluster, db: &tokio_postgres::Client) -> String {
    let segment: String = db
        .query_one("select pg_walfile_name(pg_switch_wal())", &[])
        .await
        .unwrap()
        .get(0);
    let archived = eventually(&format!("{segment} archived"), WAIT, || {
        let clusters = cluster.clusters();
        let segment = segment.clone();
        async move {
            let status = status_of(&clusters, "pg").await?;
            let last = status
                .backup
                .and_then(|b| b.last_archived_wal)
                .unwrap_or_default();
            // Compare log and segment numbers: a later timeline archives the same segment.
            if last.get(8..24) >= segment.get(8..24) {
                Ok(())
            } else {
                Err(format!("last archived {last}"))
            }
        }
    })
    .await;
    if let Err(e) = archived {
        panic!("{e}\n{}", cluster.logs().await);
    }
    segment
}

/// Leaves `replica` behind by far more than a `wal_keep_size` of 32 MB: its WAL receiver is
/// stopped while the primary (through `rw`) writes about 100 MB of WAL and checkpoints twice,
/// then `after_the_gap` gets a row; `before_resuming` runs on the primary's connection, then
/// the receiver resumes. The WAL position then, and when it resumed.
pub(crate) async fn leave_behind<F: std::future::Future<Output = ()>>(
    cluster: &Cluster,
    rw: &str,
    replica: &str,
    before_resuming: impl FnOnce(tokio_postgres::Client) -> F,
) -> (i64, Instant) {
    // A replica that just rejoined may still replay the archive before it streams.
    let receiver = eventually(&format!("{replica} runs a WAL receiver"), WAIT, || async {
        cluster
            .walreceiver(replica)
            .ok_or_else(|| "none yet".to_string())
    })
    .await;
    let receiver = match receiver {
        Ok(pid) => pid,
        Err(e) => panic!("{e}\n{}", cluster.logs().await),
    };
    signal(receiver, "STOP");
    let db = connect(rw, &cluster.password).await.unwrap();
    db.batch_execute(
        "create table filler as select i, repeat('x', 200) as pad from generate_series(1, 400000) i; \
         checkpoint; select pg_switch_wal(); checkpoint; \
         create table after_the_gap (at timestamptz default now()); \
         insert into after_the_gap default values",
    )
    .await
    .unwrap();
    let written: i64 = db
        .query_one(
            "select pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    before_resuming(db).await;
    signal(receiver, "CONT");
    (written, Instant::now())
}

/// Waits (up to 4 minutes) until `-ro` serves the row [`leave_behind`] wrote after the gap.
pub(crate) async fn reads_after_the_gap(cluster: &Cluster) {
    let ro = cluster.cluster_ip("pg-ro").await;
    let caught_up = eventually(
        "the replica reads the row written after the gap",
        Duration::from_secs(240),
        || {
            let (ro, password) = (ro.clone(), cluster.password.clone());
            async move {
                let c = connect(&ro, &password).await.map_err(|e| e.to_string())?;
                let n: i64 = c
                    .query_one("select count(*) from after_the_gap", &[])
                    .await
                    .map_err(|e| e.to_string())?
                    .get(0);
                if n == 1 {
                    Ok(())
                } else {
                    Err(format!("{n} rows"))
                }
            }
        },
    )
    .await;
    if let Err(e) = caught_up {
        panic!("{e}\n{}", cluster.logs().await);
    }
}

/// Creates PostgresCluster `name` (1 instance) restored from `recovery`
/// (`spec.bootstrap.recovery`), waits until it is Ready; a connection to it and the time from
/// its creation to Ready.
pub(crate) async fn restore(
    cluster: &Cluster,
    name: &str,
    recovery: serde_json::Value,
) -> (tokio_postgres::Client, Duration) {
    restore_with(cluster, name, json!({"bootstrap": {"recovery": recovery}})).await
}

/// [`restore`] with the whole of `spec` beyond `instances` (`bootstrap.recovery` in it).
pub(crate) async fn restore_with(
    cluster: &Cluster,
    name: &str,
    spec: serde_json::Value,
) -> (tokio_postgres::Client, Duration) {
    let started = Instant::now();
    create_restore(cluster, name, spec).await;
    let password = cluster.superuser_password(name).await;
    let ready = eventually(
        &format!("PostgresCluster {name} Ready"),
        Duration::from_secs(600),
        || {
            let clusters = cluster.clusters();
            async move {
                let status = status_of(&clusters, name).await?;
                if status
                    .conditions
                    .iter()
                    .any(|c| c.type_ == "Ready" && c.status == "True")
                {
                    Ok(())
                } else {
                    Err(format!("{:?} {:?}", status.phase, status.conditions))
                }
            }
        },
    )
    .await;
    let took = started.elapsed();
    if let Err(e) = ready {
        panic!(
            "{e}\n--- {name}-0:\n{}",
            logs(&cluster.pods(), &format!("{name}-0")).await
        );
    }
    let db = connect(&cluster.cluster_ip(&format!("{name}-rw")).await, &password)
        .await
        .unwrap();
    (db, took)
}

/// Creates PostgresCluster `name` of one instance with `spec` (`bootstrap.recovery` in it)
/// and its volume; does not wait.
pub(crate) async fn create_restore(cluster: &Cluster, name: &str, spec: serde_json::Value) {
    cluster.volumes(name, 1).await;
    let manifest = cluster.manifest(name, 1, spec);
    steward_testenv::manifests::apply(&cluster.client, &manifest, None, "real-node-test", false)
        .await
        .unwrap();
}

/// The server's clock as RFC 3339 (a recovery target time).
pub(crate) async fn server_clock(db: &tokio_postgres::Client) -> String {
    db.query_one("select to_json(clock_timestamp()) #>> '{}'", &[])
        .await
        .unwrap()
        .get(0)
}

/// Creates PostgresBackup `name` of PostgresCluster `of`.
pub(crate) async fn create_backup(cluster: &Cluster, name: &str, of: &str) {
    let manifest = json!({
        "apiVersion": "database.steward.dev/v1alpha1", "kind": "PostgresBackup",
        "metadata": {"name": name, "namespace": cluster.ns},
        "spec": {"cluster": of},
    });
    steward_testenv::manifests::apply(&cluster.client, &manifest, None, "real-node-test", false)
        .await
        .unwrap();
}

/// The status of PostgresBackup `name` once it has ended: `Ok` when it completed, `Err` when
/// it failed (panics with the pods' logs if it takes too long).
pub(crate) async fn ended_backup(
    cluster: &Cluster,
    name: &str,
) -> Result<steward_pg_instance::contract::BackupRun, steward_pg_instance::contract::BackupRun> {
    use database_operator::crd::PostgresBackup;
    use steward_pg_instance::contract::BackupPhase;
    let backups: Api<PostgresBackup> = Api::namespaced(cluster.client.clone(), &cluster.ns);
    let done = eventually(&format!("PostgresBackup {name} ended"), WAIT, || {
        let backups = backups.clone();
        async move {
            let status = backups
                .get(name)
                .await
                .map_err(|e| e.to_string())?
                .status
                .unwrap_or_default();
            match status.phase {
                Some(BackupPhase::Completed) => Ok(Ok(status)),
                Some(BackupPhase::Failed) => Ok(Err(status)),
                _ => Err(format!("{status:?}")),
            }
        }
    })
    .await;
    match done {
        Ok(ended) => ended,
        Err(e) => panic!("{e}\n{}", cluster.logs().await),
    }
}

/// The status of PostgresBackup `name`, once it is `Completed` (panics with the pods' logs
/// if it fails or takes too long).
pub(crate) async fn completed_backup(
    cluster: &Cluster,
    name: &str,
) -> steward_pg_instance::contract::BackupRun {
    match ended_backup(cluster, name).await {
        Ok(status) => status,
        Err(failed) => panic!("{name} failed: {failed:?}\n{}", cluster.logs().await),
    }
}

/// What a [`Load`] saw.
#[derive(Clone, Debug, Default)]
pub(crate) struct Tally {
    pub(crate) commits: u64,
    /// Every error: a statement that failed, a connection that broke, a reconnect refused.
    pub(crate) errors: u64,
    /// Connections that broke (each counted in `errors` too).
    pub(crate) broken: u64,
    /// The longest transaction, from `BEGIN` sent to `COMMIT` answered.
    pub(crate) longest: Duration,
    pub(crate) first_error: Option<String>,
    /// When the first and the last error happened.
    pub(crate) errors_between: Option<(Instant, Instant)>,
}

impl Tally {
    fn add(&mut self, other: Tally) {
        self.commits += other.commits;
        self.errors += other.errors;
        self.broken += other.broken;
        self.longest = self.longest.max(other.longest);
        if self.first_error.is_none() {
            self.first_error = other.first_error;
        }
        self.errors_between = match (self.errors_between, other.errors_between) {
            (Some((a, b)), Some((c, d))) => Some((a.min(c), b.max(d))),
            (one, other) => one.or(other),
        };
    }

    fn error(&mut self, e: &tokio_postgres::Error) {
        self.errors += 1;
        self.first_error.get_or_insert_with(|| e.to_string());
        let now = Instant::now();
        let first = self.errors_between.map_or(now, |(first, _)| first);
        self.errors_between = Some((first, now));
    }
}

/// `clients` connections to `host:5432` as `(user, password)`, each committing short
/// transactions (`BEGIN`, an `INSERT` into `table`, `COMMIT`: three round trips) one after
/// another until [`Load::stop`]. A connection that breaks is counted and opened again.
pub(crate) struct Load {
    stop: Arc<std::sync::atomic::AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<Tally>>,
}

impl Load {
    /// Connects every client first (panics if one cannot), then starts them.
    pub(crate) async fn start(
        host: &str,
        (user, password): (&str, &str),
        table: &str,
        clients: usize,
    ) -> Load {
        let conn = format!(
            "host={host} port=5432 user={user} password={password} dbname=postgres connect_timeout=5"
        );
        let open = |conn: String| async move {
            let (client, connection) =
                tokio_postgres::connect(&conn, tokio_postgres::NoTls).await?;
            tokio::spawn(connection);
            Ok::<_, tokio_postgres::Error>(client)
        };
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut tasks = Vec::new();
        for n in 0..clients {
            let mut client = open(conn.clone())
                .await
                .unwrap_or_else(|e| panic!("client {n} of the load to {host} as {user}: {e}"));
            let (stop, conn, table) = (stop.clone(), conn.clone(), table.to_string());
            tasks.push(tokio::spawn(async move {
                let mut tally = Tally::default();
                let insert = format!("insert into {table} (client) values ($1)");
                let client_id = i32::try_from(n).unwrap_or(0);
                while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                    let began = Instant::now();
                    let done = async {
                        client.batch_execute("begin").await?;
                        client.execute(insert.as_str(), &[&client_id]).await?;
                        client.batch_execute("commit").await
                    }
                    .await;
                    match done {
                        Ok(()) => {
                            tally.commits += 1;
                            tally.longest = tally.longest.max(began.elapsed());
                        }
                        Err(e) => {
                            tally.error(&e);
                            if client.is_closed() {
                                tally.broken += 1;
                                loop {
                                    if stop.load(std::sync::atomic::Ordering::SeqCst) {
                                        return tally;
                                    }
                                    match open(conn.clone()).await {
                                        Ok(c) => {
                                            client = c;
                                            break;
                                        }
                                        Err(e) => {
                                            tally.error(&e);
                                            tokio::time::sleep(Duration::from_millis(100)).await;
                                        }
                                    }
                                }
                            } else {
                                // A failed statement leaves the transaction aborted.
                                let _ = client.batch_execute("rollback").await;
                            }
                        }
                    }
                }
                tally
            }));
        }
        Load { stop, tasks }
    }

    /// Stops every client; what they saw in all.
    pub(crate) async fn stop(self) -> Tally {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        let mut all = Tally::default();
        for task in self.tasks {
            all.add(task.await.unwrap_or_default());
        }
        all
    }
}
