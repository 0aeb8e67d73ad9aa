//! `cargo xtask up`: all of Steward on this machine, in one command, deployed as a user would
//! deploy it.
//!
//! ```text
//! control plane        steward_testenv::ControlPlane with one real node (kubelet, containerd,
//!                      CNI bridge on 198.18.0.1/24, kube-proxy, CoreDNS) and no kwok nodes:
//!                      built from Go modules on first use, then seconds
//! crds/                server-side applied, each until Established
//! operators            each built (debug), assembled as its image (steward_testenv::images,
//!                      as `cargo xtask image`), imported into the node (never pulled) and
//!                      deployed by deploy/<operator>/: a Deployment of 2 replicas, its
//!                      ServiceAccount and RBAC, probes, restricted Pod Security
//!                      (steward_testenv::deploy, shared with the real-node tests); waits until
//!                      every replica is Ready
//! deploy/samples/      into namespace `steward-demo`: the PostgresCluster runs real PostgreSQL
//!                      pods (the image testenv assembles from Debian's PostgreSQL package,
//!                      imagePullPolicy Never) on hostPath volumes of the node; the Database and
//!                      DatabaseRole samples use that cluster; the Tenant's shared Secret gets
//!                      a stand-in; the PostgresCluster backs up to a demo object store
//!                      (S3Proxy on the node's bridge address, bucket
//!                      `steward-demo`), so the PostgresBackup sample completes
//! ```
//!
//! Then it waits until every sample is Ready and prints what to look at next. Ctrl-C stops the
//! control plane and removes the node (pods, containerd, iptables chains, the bridge) from the
//! host. It needs a machine that can run the real node: root, Linux, the Debian packages
//! `prerequisites::ensure_node_packages` installs; otherwise it fails and says why (it never
//! falls back to simulated nodes). One real node runs per machine: a second `up` (or a
//! real-node test) waits for the first to stop.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Client;
use kube::api::{Api, DynamicObject, ListParams};
use kube::discovery::ApiResource;
use serde_json::{Value, json};
use steward_testenv::deploy::{self, Deployed};
use steward_testenv::{ControlPlane, RealNode, manifests};

/// Where the samples go.
const DEMO_NAMESPACE: &str = "steward-demo";
const FIELD_MANAGER: &str = "steward-xtask-up";
/// The demo object store's bucket and the Secret holding its credentials.
const DEMO_BUCKET: &str = "steward-demo";
const DEMO_S3_SECRET: &str = "main-s3";
/// How long `up` waits for the operators' replicas, then for the samples.
const OPERATORS_TIMEOUT: Duration = Duration::from_secs(120);
const READY_TIMEOUT: Duration = Duration::from_secs(300);

/// `check`: stop after the summary instead of waiting for Ctrl-C, failing unless every
/// sample became Ready. `nodes`: how many real nodes.
pub fn run(check: bool, nodes: usize) -> Result<()> {
    can_run_a_real_node()?;
    crate::prerequisites::ensure_node_packages()?;
    crate::prerequisites::ensure_postgres()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(up(check, nodes))
}

/// What the real node needs and cannot install: Linux and root (kubelet, containerd, the
/// bridge and iptables rules).
fn can_run_a_real_node() -> Result<()> {
    if !cfg!(target_os = "linux") {
        bail!(
            "cargo xtask up runs a real Kubernetes node (kubelet, containerd), which needs Linux"
        );
    }
    let uid = std::process::Command::new("id")
        .arg("-u")
        .output()
        .context("running `id -u`")?;
    if String::from_utf8_lossy(&uid.stdout).trim() != "0" {
        bail!(
            "cargo xtask up runs a real Kubernetes node (kubelet, containerd, a network bridge, iptables rules), which needs root; run it as root (sudo -E cargo xtask up)"
        );
    }
    Ok(())
}

async fn up(check: bool, nodes: usize) -> Result<()> {
    let started = Instant::now();
    let root = crate::workspace_root();
    say("building the operators (debug)");
    let specs: Vec<deploy::Spec<'_>> = steward_operators::all()
        .iter()
        .map(deploy::Spec::of)
        .collect();
    let binaries = deploy::build(&specs).context("building the operators")?;

    say(&format!(
        "starting the control plane with {nodes} real node(s) (the first run builds it from Go modules: 15–25 minutes)",
    ));
    let cp = ControlPlane::start(steward_testenv::Options::real_nodes(nodes))
        .await
        .context("starting the control plane with real nodes")?;
    let node = cp
        .real_node()
        .context("the control plane started without its real node")?;
    for node in cp.real_nodes() {
        say(&format!(
            "  real node {} ({}) Ready in {:.1?}",
            node.name(),
            node.zone().unwrap_or("no zone"),
            node.started_in(),
        ));
    }
    say(&format!(
        "control plane with {nodes} Ready real node(s) in {:.1?} at {}",
        cp.started_in(),
        cp.apiserver_url()
    ));
    let client = cp.client()?;
    say("installing crds/");
    let crds = cp.install_crds(&root.join("crds")).await?;
    say(&format!("  {} CRDs Established", crds.len()));

    say("deploying the operators as their images (deploy/<operator>/)");
    let mut deployed = Vec::new();
    for built in &binaries {
        let operator = &built.name;
        let d = deploy::operator(&cp, built, FIELD_MANAGER)
            .await
            .with_context(|| format!("deploying {operator}"))?;
        say(&format!("  {operator}: {} applied", d.image));
        deployed.push(d);
    }
    for d in &deployed {
        let took = d
            .wait_available(&cp, OPERATORS_TIMEOUT)
            .await
            .with_context(|| format!("waiting for {}", d.operator))?;
        say(&format!(
            "  {}: {} replicas Ready ({took:.1?})",
            d.operator, d.replicas
        ));
    }

    say("building the PostgreSQL image from Debian's packages");
    let mut postgres_image = String::new();
    for node in cp.real_nodes() {
        postgres_image = node.postgresql_image().await?;
    }
    let major: i64 = postgres_image
        .rsplit(':')
        .next()
        .and_then(|m| m.parse().ok())
        .with_context(|| format!("no major version in {postgres_image}"))?;

    say(&format!(
        "applying deploy/samples/ into namespace {DEMO_NAMESPACE}"
    ));
    apply(
        &client,
        &json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": DEMO_NAMESPACE}}),
        None,
    )
    .await?;
    // A demo object store, so the PostgresCluster archives its WAL and the PostgresBackup
    // sample really completes: S3Proxy on the node's bridge address (pods reach it), the
    // same server the backup tests use; stopped with `up`.
    say("starting an S3 object store for backups (S3Proxy, downloaded on first use)");
    let s3 = steward_testenv::s3::S3Server::start(node.host_address(), &[DEMO_BUCKET])
        .await
        .context("starting S3Proxy for the backup samples")?;
    let credentials =
        steward_testenv::s3::S3Server::credentials_secret(DEMO_S3_SECRET, DEMO_NAMESPACE);
    apply(&client, &credentials, None).await?;
    say(&format!("  {} (bucket {DEMO_BUCKET})", s3.endpoint()));
    let mut samples = cp.kustomize(&root.join("deploy/samples"))?;
    for sample in &mut samples {
        on_this_node(sample, &postgres_image, major);
        backed_up_to(sample, s3.endpoint());
        for (i, (volume, claim, size)) in volumes_for(sample).into_iter().enumerate() {
            // Instance i's volume on node i (of several: each instance on a node of its own).
            let nodes = cp.real_nodes();
            let pv = nodes[i % nodes.len()].volume(
                &volume,
                &size,
                Some((DEMO_NAMESPACE, &claim)),
                steward_testenv::images::POSTGRES_UID,
            )?;
            apply(&client, &pv, None).await?;
        }
        // Stand-ins for the Secrets and ConfigMaps a Tenant shares.
        for prerequisite in shared_sources(sample) {
            apply(&client, &prerequisite, None).await?;
        }
    }
    let mut watched = Vec::new();
    for sample in &samples {
        let (api, resource) = manifests::dynamic_api(&client, sample, Some(DEMO_NAMESPACE)).await?;
        apply(&client, sample, Some(DEMO_NAMESPACE)).await?;
        if resource.group.ends_with("steward.dev") {
            watched.push((resource.kind.clone(), name(sample).to_string(), api));
        }
    }
    // Ctrl-C while waiting stops as cleanly as Ctrl-C after the summary.
    let mut samples_ready = false;
    let interrupted = tokio::select! {
        all_ready = wait_ready(&watched) => {
            samples_ready = all_ready;
            let took = started.elapsed();
            print_summary(&cp, node, &client, &deployed, s3.endpoint(), all_ready, took).await;
            if check {
                Ok(())
            } else {
                tokio::signal::ctrl_c().await
            }
        }
        signal = tokio::signal::ctrl_c() => signal,
    };
    interrupted.context("waiting for Ctrl-C")?;
    say(&format!(
        "stopping the control plane and removing the node from the host (up for {:.0?})",
        started.elapsed()
    ));
    drop(s3);
    drop(cp);
    if check && !samples_ready {
        bail!("not every sample became Ready within {READY_TIMEOUT:?}");
    }
    Ok(())
}

fn say(text: &str) {
    println!("xtask up: {text}");
}

// ---------------------------------------------------------------------------------------
// Manifests
// ---------------------------------------------------------------------------------------

fn kind(obj: &Value) -> &str {
    obj["kind"].as_str().unwrap_or_default()
}

fn name(obj: &Value) -> &str {
    obj["metadata"]["name"].as_str().unwrap_or_default()
}

async fn apply(
    client: &Client,
    obj: &Value,
    default_namespace: Option<&str>,
) -> Result<DynamicObject> {
    Ok(manifests::apply(client, obj, default_namespace, FIELD_MANAGER, false).await?)
}

/// Points a PostgresCluster sample at the PostgreSQL image on the node (never pulled: no
/// registry is reachable) and at that image's major version; other objects are left alone.
fn on_this_node(obj: &mut Value, image: &str, major: i64) {
    if kind(obj) != "PostgresCluster" {
        return;
    }
    if let Some(spec) = obj["spec"].as_object_mut() {
        spec.insert("image".into(), json!(image));
        spec.insert("imagePullPolicy".into(), json!("Never"));
        spec.insert("version".into(), json!(major));
    }
}

/// Gives a PostgresCluster sample without `spec.backup` the demo object store (bucket
/// [`DEMO_BUCKET`], a path of its own, credentials in [`DEMO_S3_SECRET`]).
fn backed_up_to(obj: &mut Value, endpoint: &str) {
    if kind(obj) != "PostgresCluster" || !obj["spec"]["backup"].is_null() {
        return;
    }
    let path = format!("{DEMO_NAMESPACE}/{}", name(obj));
    if let Some(spec) = obj["spec"].as_object_mut() {
        spec.insert(
            "backup".into(),
            json!({
                "objectStore": {
                    "endpoint": endpoint,
                    "bucket": DEMO_BUCKET,
                    "path": path,
                    "credentialsSecret": DEMO_S3_SECRET,
                },
                "keep": 7,
            }),
        );
    }
}

/// For a PostgresCluster sample: one (volume, claim, size) per instance, the claim being the
/// one its StatefulSet makes for that ordinal (`data-<cluster>-<i>`). The node has no volume
/// provisioner, so each claim gets a hostPath volume bound to it.
fn volumes_for(obj: &Value) -> Vec<(String, String, String)> {
    if kind(obj) != "PostgresCluster" {
        return Vec::new();
    }
    let spec = &obj["spec"];
    let instances = spec["instances"].as_u64().unwrap_or(1);
    let size = spec["storage"]["size"].as_str().unwrap_or("1Gi");
    (0..instances)
        .map(|i| {
            (
                format!("{DEMO_NAMESPACE}-{}-{i}", name(obj)),
                format!("data-{}-{i}", name(obj)),
                size.to_string(),
            )
        })
        .collect()
}

/// For a Tenant sample: each shared Secret or ConfigMap it names, as a labelled shareable
/// stand-in, after its namespace.
fn shared_sources(obj: &Value) -> Vec<Value> {
    if kind(obj) != "Tenant" {
        return Vec::new();
    }
    let mut out = Vec::new();
    for shared in obj["spec"]["sharedObjects"]
        .as_array()
        .into_iter()
        .flatten()
    {
        let (Some(kind_), Some(ns), Some(name_)) = (
            shared["kind"].as_str(),
            shared["namespace"].as_str(),
            shared["name"].as_str(),
        ) else {
            continue;
        };
        let metadata = json!({"name": name_, "namespace": ns,
            "labels": {"tenancy.steward.dev/shareable": "true", "app.kubernetes.io/part-of": "steward-demo"}});
        let source = match kind_ {
            "Secret" => {
                json!({"apiVersion": "v1", "kind": "Secret", "metadata": metadata, "stringData": {"note": "a stand-in made by cargo xtask up"}})
            }
            "ConfigMap" => {
                json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": {"note": "a stand-in made by cargo xtask up"}})
            }
            _ => continue,
        };
        out.push(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}));
        out.push(source);
    }
    out
}

// ---------------------------------------------------------------------------------------
// Readiness and the summary
// ---------------------------------------------------------------------------------------

/// Whether `up` stops waiting for an object: it is Ready, it waits for a person (an
/// UpgradePlan with `approval: Manual` waiting for `spec.approvedWaves`), or it is a
/// PostgresBackup that completed (a backup has a phase, no Ready condition).
fn settled(kind: &str, ready: &str, phase: &str) -> bool {
    ready == "True"
        || (kind == "UpgradePlan" && phase == "WaitingApproval")
        || (kind == "PostgresBackup" && phase == "Completed")
}

/// `Ready` condition status (`True`, `False`, `Unknown`, or `-`), phase and the Ready message.
fn readiness(obj: &DynamicObject) -> (String, String, String) {
    let status = &obj.data["status"];
    let ready = status["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["type"] == "Ready");
    let text = |v: &Value| v.as_str().unwrap_or("-").to_string();
    (
        ready.map_or_else(|| "-".into(), |c| text(&c["status"])),
        text(&status["phase"]),
        ready.map_or_else(String::new, |c| text(&c["message"])),
    )
}

/// Waits until every watched object is Ready, printing who is still waiting now and then.
/// Returns whether all became Ready in time.
async fn wait_ready(watched: &[(String, String, Api<DynamicObject>)]) -> bool {
    let started = Instant::now();
    let mut last_report = Instant::now();
    loop {
        let mut waiting = Vec::new();
        for (kind, name, api) in watched {
            match api.get(name).await {
                Ok(obj) => {
                    let (ready, phase, message) = readiness(&obj);
                    if !settled(kind, &ready, &phase) {
                        waiting.push(format!(
                            "{kind}/{name} (Ready={ready}, phase {phase}{})",
                            if message.is_empty() {
                                String::new()
                            } else {
                                format!(": {message}")
                            }
                        ));
                    }
                }
                Err(e) => waiting.push(format!("{kind}/{name} ({e})")),
            }
        }
        if waiting.is_empty() {
            say(&format!(
                "every sample is Ready or waits for approval ({:.0?})",
                started.elapsed()
            ));
            return true;
        }
        if started.elapsed() > READY_TIMEOUT {
            say(&format!(
                "not Ready after {READY_TIMEOUT:?}: {}",
                waiting.join(", ")
            ));
            return false;
        }
        if last_report.elapsed() > Duration::from_secs(10) {
            say(&format!("waiting for {}", waiting.join(", ")));
            last_report = Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Every object of every Steward CRD, as `kind namespace/name Ready phase message` rows.
async fn steward_objects(client: &Client) -> Result<Vec<[String; 5]>> {
    let crds = Api::<CustomResourceDefinition>::all(client.clone())
        .list(&ListParams::default())
        .await?;
    let mut rows = Vec::new();
    for crd in crds
        .items
        .iter()
        .filter(|c| c.spec.group.ends_with("steward.dev"))
    {
        let Some(version) = crd.spec.versions.iter().find(|v| v.storage) else {
            continue;
        };
        let resource = ApiResource {
            group: crd.spec.group.clone(),
            version: version.name.clone(),
            api_version: format!("{}/{}", crd.spec.group, version.name),
            kind: crd.spec.names.kind.clone(),
            plural: crd.spec.names.plural.clone(),
        };
        let api: Api<DynamicObject> = Api::all_with(client.clone(), &resource);
        for obj in api.list(&ListParams::default()).await? {
            let (ready, phase, message) = readiness(&obj);
            let at = match &obj.metadata.namespace {
                Some(ns) => format!("{ns}/{}", obj.metadata.name.clone().unwrap_or_default()),
                None => obj.metadata.name.clone().unwrap_or_default(),
            };
            rows.push([resource.kind.clone(), at, ready, phase, message]);
        }
    }
    Ok(rows)
}

/// Each operator's pods: name, pod IP, whether it holds the Lease.
async fn operator_pods(client: &Client, d: &Deployed) -> Vec<(String, String, bool)> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), &d.namespace);
    let holder = Api::<Lease>::namespaced(client.clone(), &d.namespace)
        .get_opt(&d.operator)
        .await
        .ok()
        .flatten()
        .and_then(|l| l.spec?.holder_identity)
        .unwrap_or_default();
    let selector = ListParams::default().labels(&format!("app.kubernetes.io/name={}", d.operator));
    pods.list(&selector)
        .await
        .map(|l| l.items)
        .unwrap_or_default()
        .into_iter()
        .map(|p| {
            let name = p.metadata.name.clone().unwrap_or_default();
            let ip = p.status.and_then(|s| s.pod_ip).unwrap_or_default();
            let leads = holder.starts_with(&format!("{name}_"));
            (name, ip, leads)
        })
        .collect()
}

async fn print_summary(
    cp: &ControlPlane,
    node: &RealNode,
    client: &Client,
    deployed: &[Deployed],
    s3_endpoint: &str,
    all_ready: bool,
    took: Duration,
) {
    let kubectl = cp.binaries().kubectl.display().to_string();
    let kubeconfig = cp.kubeconfig_path().display().to_string();
    println!();
    println!(
        "Steward is up{} ({:.0?} after `cargo xtask up` started its work).",
        if all_ready {
            ""
        } else {
            " (some samples are not Ready yet; see below)"
        },
        took
    );
    println!();
    println!("  export KUBECONFIG={kubeconfig}");
    println!(
        "  alias kubectl={kubectl}        # kubectl {}, or any kubectl",
        cp.binaries().versions.kubernetes
    );
    println!("  kubectl get steward -A         # every Steward object (the `steward` category)");
    println!(
        "  kubectl get pods -A -o wide    # the operators and PostgreSQL, on node {}",
        node.name()
    );
    println!("  kubectl get events -n {DEMO_NAMESPACE} --sort-by=.lastTimestamp");
    println!("  kubectl get leases -A           # who leads: the holder of each operator's Lease");
    println!(
        "  kubectl -n {DEMO_NAMESPACE} exec -it main-0 -- psql -U postgres   # the PostgresCluster's primary"
    );
    println!(
        "  kubectl -n {DEMO_NAMESPACE} get pgb -w             # backups to {s3_endpoint} (bucket {DEMO_BUCKET})"
    );
    println!(
        "  kubectl steward backup main -n {DEMO_NAMESPACE}   # another backup (plugin: cargo install --path crates/kubectl-steward)"
    );
    println!();
    match steward_objects(client).await {
        Ok(rows) => {
            for row in rows
                .iter()
                .filter(|r| r[0] == "UpgradePlan" && r[3] == "WaitingApproval")
            {
                let (ns, plan) = row[1].split_once('/').unwrap_or((DEMO_NAMESPACE, &row[1]));
                println!(
                    "  kubectl -n {ns} patch uplan {plan} --type merge -p '{{\"spec\":{{\"approvedWaves\":1}}}}'   # approve wave 1"
                );
            }
            println!();
            let mut widths = [4usize, 4, 5, 5, 7];
            let header = ["KIND", "NAME", "READY", "PHASE", "MESSAGE"].map(String::from);
            for row in std::iter::once(&header).chain(&rows) {
                for (w, cell) in widths.iter_mut().zip(row) {
                    *w = (*w).max(cell.len());
                }
            }
            for row in std::iter::once(&header).chain(&rows) {
                let cells: Vec<String> = row
                    .iter()
                    .zip(widths)
                    .map(|(c, w)| format!("{c:<w$}"))
                    .collect();
                println!("  {}", cells.join("  ").trim_end());
            }
        }
        Err(e) => println!("  (could not list Steward objects: {e:#})"),
    }
    println!();
    for d in deployed {
        println!(
            "  {}  (kubectl -n {} logs deploy/{})",
            d.operator, d.namespace, d.deployment
        );
        for (pod, ip, leads) in operator_pods(client, d).await {
            println!(
                "    {pod:<40} metrics http://{ip}:8080/metrics  health http://{ip}:8081/readyz{}",
                if leads { "  (leader)" } else { "" }
            );
        }
    }
    println!();
    println!(
        "  node logs (kubelet, containerd, kube-proxy, CoreDNS): {}",
        node.log("kubelet")
            .parent()
            .map(|p| p.display().to_string())
            .unwrap_or_default()
    );
    println!("  control plane logs: {}", cp.dir().display());
    println!();
    println!("Ctrl-C stops everything and removes the node from the host.");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readiness_reads_the_ready_condition() {
        let obj: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "x.steward.dev/v1", "kind": "X", "metadata": {"name": "a"},
            "status": {"phase": "Ready", "conditions": [
                {"type": "Progressing", "status": "False"},
                {"type": "Ready", "status": "True", "message": "all good"},
            ]},
        }))
        .expect("object");
        assert_eq!(
            readiness(&obj),
            ("True".into(), "Ready".into(), "all good".into())
        );
        let bare: DynamicObject = serde_json::from_value(
            json!({"apiVersion": "v1", "kind": "X", "metadata": {"name": "b"}}),
        )
        .expect("object");
        assert_eq!(readiness(&bare), ("-".into(), "-".into(), String::new()));
    }

    #[test]
    fn a_postgres_cluster_gets_one_volume_per_instance_bound_to_its_claim() {
        let pgc = json!({"apiVersion": "database.steward.dev/v1alpha1", "kind": "PostgresCluster", "metadata": {"name": "main"},
            "spec": {"instances": 3, "version": 16, "storage": {"size": "10Gi"}}});
        let volumes = volumes_for(&pgc);
        assert_eq!(volumes.len(), 3);
        assert_eq!(
            volumes[2],
            (
                "steward-demo-main-2".to_string(),
                "data-main-2".to_string(),
                "10Gi".to_string()
            )
        );
        assert!(volumes_for(&json!({"kind": "Database", "metadata": {"name": "x"}})).is_empty());
    }

    #[test]
    fn a_postgres_cluster_runs_the_image_on_the_node_and_its_major() {
        let mut pgc = json!({"apiVersion": "database.steward.dev/v1alpha1", "kind": "PostgresCluster", "metadata": {"name": "main"},
            "spec": {"instances": 3, "version": 16, "storage": {"size": "10Gi"}}});
        on_this_node(&mut pgc, "steward.dev/testenv/postgresql:15", 15);
        assert_eq!(pgc["spec"]["image"], "steward.dev/testenv/postgresql:15");
        assert_eq!(pgc["spec"]["imagePullPolicy"], "Never");
        assert_eq!(pgc["spec"]["version"], 15);
        assert_eq!(pgc["spec"]["instances"], 3);
        let mut db = json!({"apiVersion": "database.steward.dev/v1alpha1", "kind": "Database", "metadata": {"name": "app"},
            "spec": {"clusterRef": {"name": "main"}}});
        let before = db.clone();
        on_this_node(&mut db, "x", 1);
        assert_eq!(db, before, "the Database keeps its clusterRef");
    }

    #[test]
    fn a_tenant_gets_labelled_stand_ins_for_what_it_shares() {
        let tenant = json!({"apiVersion": "tenancy.steward.dev/v1alpha1", "kind": "Tenant", "metadata": {"name": "t"},
            "spec": {"sharedObjects": [{"kind": "Secret", "namespace": "platform", "name": "registry-pull"}]}});
        let objs = shared_sources(&tenant);
        assert_eq!(
            objs.iter().map(kind).collect::<Vec<_>>(),
            ["Namespace", "Secret"]
        );
        assert_eq!(objs[0]["metadata"]["name"], "platform");
        assert_eq!(objs[1]["metadata"]["namespace"], "platform");
        assert_eq!(
            objs[1]["metadata"]["labels"]["tenancy.steward.dev/shareable"],
            "true"
        );
        assert!(shared_sources(&json!({"kind": "Database"})).is_empty());
    }

    #[test]
    fn manual_plans_waiting_for_approval_are_settled() {
        assert!(settled("Database", "True", "Ready"));
        assert!(!settled("Database", "False", "Pending"));
        assert!(settled("UpgradePlan", "False", "WaitingApproval"));
        assert!(!settled("UpgradePlan", "False", "Pending"));
    }
}
