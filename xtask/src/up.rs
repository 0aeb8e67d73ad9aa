//! `cargo xtask up`: all of Steward on this machine, in one command.
//!
//! ```text
//! control plane        steward_testenv::ControlPlane (etcd, kube-apiserver, controller-manager,
//!                      scheduler, kwok nodes): built on first use, then ~5 s
//! PostgreSQL           steward_testenv::postgres (Debian's package, installed if missing)
//! crds/                server-side applied, each until Established
//! deploy/              the namespaces, ServiceAccounts and RBAC of every operator (not the
//!                      Deployments: kwok would only pretend to run them)
//! operators            in this process, each authenticated as its own ServiceAccount (a
//!                      TokenRequest token in a file, renewed), with leader election on its Lease
//! deploy/samples/      into namespace `steward-demo`; the Database sample is pointed at the
//!                      local PostgreSQL through a Secret holding its superuser
//! ```
//!
//! Then it waits until every sample is Ready and prints what to look at next. Ctrl-C stops
//! the operators (they release their Leases), PostgreSQL and the control plane.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow};
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DynamicObject, ListParams, PostParams};
use kube::discovery::ApiResource;
use kube::{Client, Config};
use serde_json::{Value, json};
use steward_core::Operator;
use steward_core::cli::CommonArgs;
use steward_testenv::ControlPlane;
use steward_testenv::manifests;
use steward_testenv::postgres::Postgres;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Where the samples go.
const DEMO_NAMESPACE: &str = "steward-demo";
/// The Secret holding the local PostgreSQL's superuser, referenced by the Database sample.
const POSTGRES_SECRET: &str = "local-postgres-admin";
const FIELD_MANAGER: &str = "steward-xtask-up";
/// How long `up` waits for the samples before printing what it has.
const READY_TIMEOUT: Duration = Duration::from_secs(180);
/// ServiceAccount tokens live this long and are renewed at half-life.
const TOKEN_LIFETIME: Duration = Duration::from_secs(3600);

pub fn run() -> Result<()> {
    crate::prerequisites::ensure_postgres()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(up())
}

async fn up() -> Result<()> {
    let root = crate::workspace_root();
    say("starting the control plane (the first run builds it from Go modules: 10–20 minutes)");
    let cp = ControlPlane::start(steward_testenv::Options::default())
        .await
        .context("starting the control plane")?;
    say(&format!(
        "control plane ready in {:.1?} at {}",
        cp.started_in(),
        cp.apiserver_url()
    ));
    let log = cp.dir().join("operators.log");
    init_logging(&log)?;

    say("starting PostgreSQL");
    let pg = Postgres::start().await.context("starting PostgreSQL")?;
    say(&format!(
        "PostgreSQL {} on 127.0.0.1:{}",
        pg.major_version(),
        pg.port()
    ));

    let client = cp.client()?;
    say("installing crds/");
    let crds = cp.install_crds(&root.join("crds")).await?;
    say(&format!("  {} CRDs Established", crds.len()));

    say(
        "installing deploy/ (namespaces, ServiceAccounts, RBAC; the operators run here instead of the Deployments)",
    );
    let deploy = cp.kustomize(&root.join("deploy"))?;
    let (namespaces, rest): (Vec<&Value>, Vec<&Value>) = deploy
        .iter()
        .filter(|o| kind(o) != "Deployment")
        .partition(|o| kind(o) == "Namespace");
    for obj in namespaces.into_iter().chain(rest) {
        apply(&client, obj, None).await?;
    }

    let stop = CancellationToken::new();
    let mut running = Vec::new();
    for (name, register) in operators() {
        running.push(start_operator(&cp, name, register, stop.clone()).await?);
        say(&format!(
            "  {name} running as ServiceAccount {}/{name}",
            namespace_of(name)
        ));
    }

    say(&format!(
        "applying deploy/samples/ into namespace {DEMO_NAMESPACE}"
    ));
    apply(
        &client,
        &json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": DEMO_NAMESPACE}}),
        None,
    )
    .await?;
    apply(&client, &postgres_secret(&pg), Some(DEMO_NAMESPACE)).await?;
    let mut samples = cp.kustomize(&root.join("deploy/samples"))?;
    for sample in &mut samples {
        point_at_local_postgres(sample, pg.host(), pg.port());
        // kwok has no volume provisioner: PersistentVolumes for a PostgresCluster's claims;
        // stand-ins for the Secrets and ConfigMaps a Tenant shares.
        for prerequisite in volumes_for(sample)
            .into_iter()
            .chain(shared_sources(sample))
        {
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
    let interrupted = tokio::select! {
        all_ready = wait_ready(&watched) => {
            print_summary(&cp, &client, &pg, &running, &log, all_ready).await;
            tokio::signal::ctrl_c().await
        }
        signal = tokio::signal::ctrl_c() => signal,
    };
    interrupted.context("waiting for Ctrl-C")?;
    say("stopping the operators");
    stop.cancel();
    for op in running {
        match tokio::time::timeout(Duration::from_secs(45), op.task).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => say(&format!("  {}: {}", op.name, steward_core::chain(&e))),
            Ok(Err(e)) => say(&format!("  {}: {e}", op.name)),
            Err(_) => say(&format!("  {} did not stop in time", op.name)),
        }
    }
    say("stopping PostgreSQL and the control plane");
    drop(pg);
    drop(cp);
    Ok(())
}

fn say(text: &str) {
    println!("xtask up: {text}");
}

/// Operator logs go to a file; the terminal keeps the summary.
fn init_logging(path: &Path) -> Result<()> {
    let file =
        std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(false)
        .with_writer(std::sync::Mutex::new(file))
        .try_init()
        .map_err(|e| anyhow!("installing the log subscriber: {e}"))
}

// ---------------------------------------------------------------------------------------
// Operators
// ---------------------------------------------------------------------------------------

type Register = fn(&mut Operator) -> Result<()>;

/// Every operator and how to add its controllers, with default options.
fn operators() -> [(&'static str, Register); 3] {
    [
        (database_operator::NAME, |op| {
            database_operator::register(op, Default::default()).map_err(Into::into)
        }),
        (tenant_operator::NAME, |op| {
            tenant_operator::register(op, Default::default()).map_err(Into::into)
        }),
        (upgrade_orchestrator::NAME, |op| {
            upgrade_orchestrator::register(op, Default::default()).map_err(Into::into)
        }),
    ]
}

/// The namespace `deploy/<operator>/` installs an operator into.
fn namespace_of(operator: &str) -> String {
    format!("{operator}-system")
}

struct Running {
    name: &'static str,
    metrics: SocketAddr,
    health: SocketAddr,
    task: JoinHandle<Result<(), steward_core::Error>>,
}

/// Starts `name` in this process as its ServiceAccount, with leader election in its namespace.
async fn start_operator(
    cp: &ControlPlane,
    name: &'static str,
    register: Register,
    stop: CancellationToken,
) -> Result<Running> {
    let namespace = namespace_of(name);
    let token_file = cp.dir().join(format!("{name}.token"));
    write_token(cp, &namespace, name, &token_file).await?;
    tokio::spawn(renew_token(
        cp.client()?,
        namespace.clone(),
        name,
        token_file.clone(),
        stop.clone(),
    ));
    let mut config: Config = cp.config().clone();
    // kube reloads a token file about once a minute, so renewed tokens are picked up.
    config.auth_info = kube::config::AuthInfo {
        token_file: Some(token_file.display().to_string()),
        ..Default::default()
    };

    let metrics = free_addr()?;
    let health = free_addr()?;
    let args = CommonArgs {
        leader_elect: true,
        leader_election_namespace: Some(namespace),
        metrics_bind_address: metrics.to_string(),
        health_probe_bind_address: health.to_string(),
        ..CommonArgs::default()
    };
    let mut operator = Operator::with_config(name, args, config)?;
    register(&mut operator)?;
    let token = operator.shutdown_token();
    tokio::spawn(async move {
        stop.cancelled().await;
        token.cancel();
    });
    let task = tokio::spawn(operator.run());
    Ok(Running {
        name,
        metrics,
        health,
        task,
    })
}

async fn request_token(client: &Client, namespace: &str, name: &str) -> Result<String> {
    let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), namespace);
    let request = TokenRequest {
        spec: Some(TokenRequestSpec {
            expiration_seconds: Some(TOKEN_LIFETIME.as_secs() as i64),
            ..Default::default()
        }),
        ..Default::default()
    };
    sas.create_token_request(name, &PostParams::default(), &request)
        .await
        .with_context(|| format!("requesting a token for ServiceAccount {namespace}/{name}"))?
        .status
        .and_then(|s| s.token)
        .context("TokenRequest returned no token")
}

async fn write_token(cp: &ControlPlane, namespace: &str, name: &str, path: &Path) -> Result<()> {
    let token = request_token(&cp.client()?, namespace, name).await?;
    write_secret_file(path, &token)
}

/// Writes `path` readable by this user only, replacing it atomically.
fn write_secret_file(path: &Path, text: &str) -> Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension("tmp");
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    file.write_all(text.as_bytes())?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

async fn renew_token(
    client: Client,
    namespace: String,
    name: &'static str,
    path: PathBuf,
    stop: CancellationToken,
) {
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(TOKEN_LIFETIME / 2) => {}
        }
        let renewed = match request_token(&client, &namespace, name).await {
            Ok(token) => write_secret_file(&path, &token),
            Err(e) => Err(e),
        };
        if let Err(e) = renewed {
            tracing::warn!(
                operator = name,
                error = format!("{e:#}"),
                "failed to renew the ServiceAccount token"
            );
        }
    }
}

fn free_addr() -> Result<SocketAddr> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?)
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

/// hostPath PersistentVolumes for every instance of a PostgresCluster sample, of its storage
/// size and class (none: no StorageClass, the claims bind to volumes without one).
fn volumes_for(obj: &Value) -> Vec<Value> {
    if kind(obj) != "PostgresCluster" {
        return Vec::new();
    }
    let spec = &obj["spec"];
    let instances = spec["instances"].as_u64().unwrap_or(1);
    let size = spec["storage"]["size"].as_str().unwrap_or("1Gi");
    let class = spec["storage"]["storageClassName"]
        .as_str()
        .unwrap_or_default();
    (0..instances)
        .map(|i| {
            let pv_name = format!("{DEMO_NAMESPACE}-{}-{i}", name(obj));
            json!({
                "apiVersion": "v1", "kind": "PersistentVolume",
                "metadata": {"name": pv_name, "labels": {"app.kubernetes.io/part-of": "steward-demo"}},
                "spec": {
                    "capacity": {"storage": size},
                    "accessModes": ["ReadWriteOnce"],
                    "storageClassName": class,
                    "persistentVolumeReclaimPolicy": "Retain",
                    "hostPath": {"path": format!("/tmp/{pv_name}")},
                },
            })
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

fn postgres_secret(pg: &Postgres) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": POSTGRES_SECRET},
        "stringData": {"username": pg.superuser(), "password": pg.password()},
    })
}

/// Points a Database sample at the local PostgreSQL (the operators run on this machine, so
/// 127.0.0.1 reaches it); other objects are left alone.
fn point_at_local_postgres(obj: &mut Value, host: &str, port: u16) {
    if kind(obj) != "Database"
        || !obj["apiVersion"]
            .as_str()
            .unwrap_or_default()
            .starts_with("database.steward.dev/")
    {
        return;
    }
    if let Some(spec) = obj["spec"].as_object_mut() {
        spec.remove("clusterRef");
        spec.insert(
            "external".into(),
            json!({
                "host": host,
                "port": port,
                "sslMode": "disable",
                "adminSecretRef": {"name": POSTGRES_SECRET},
            }),
        );
    }
}

// ---------------------------------------------------------------------------------------
// Readiness and the summary
// ---------------------------------------------------------------------------------------

/// Whether `up` stops waiting for an object: it is Ready, or it waits for a person (an
/// UpgradePlan with `approval: Manual` waiting for `spec.approvedWaves`).
fn settled(kind: &str, ready: &str, phase: &str) -> bool {
    ready == "True" || (kind == "UpgradePlan" && phase == "WaitingApproval")
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

async fn print_summary(
    cp: &ControlPlane,
    client: &Client,
    pg: &Postgres,
    running: &[Running],
    log: &Path,
    all_ready: bool,
) {
    let kubectl = cp.binaries().kubectl.display().to_string();
    let kubeconfig = cp.kubeconfig_path().display().to_string();
    println!();
    println!(
        "Steward is up{}.",
        if all_ready {
            ""
        } else {
            " (some samples are not Ready yet; see below)"
        }
    );
    println!();
    println!("  export KUBECONFIG={kubeconfig}");
    println!(
        "  alias kubectl={kubectl}        # kubectl {}, or any kubectl",
        cp.binaries().versions.kubernetes
    );
    println!("  kubectl get steward -A         # every Steward object (the `steward` category)");
    println!("  kubectl get events -n {DEMO_NAMESPACE} --sort-by=.lastTimestamp");
    println!("  kubectl get leases -A           # who leads: the holder of each operator's Lease");
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
    let endpoints: BTreeMap<&str, (SocketAddr, SocketAddr)> = running
        .iter()
        .map(|r| (r.name, (r.metrics, r.health)))
        .collect();
    for (name, (metrics, health)) in endpoints {
        println!("  {name:<22} metrics http://{metrics}/metrics   health http://{health}/readyz");
    }
    println!();
    println!("  PostgreSQL: psql '{}'", pg.url("postgres"));
    println!("  operator logs: {}", log.display());
    println!("  control plane logs: {}", cp.dir().display());
    println!();
    println!("Ctrl-C stops everything.");
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
    fn a_postgres_cluster_gets_one_volume_per_instance_of_its_size_and_class() {
        let pgc = json!({"apiVersion": "database.steward.dev/v1alpha1", "kind": "PostgresCluster", "metadata": {"name": "main"},
            "spec": {"instances": 3, "version": 16, "storage": {"size": "10Gi"}}});
        let pvs = volumes_for(&pgc);
        assert_eq!(pvs.len(), 3);
        assert_eq!(pvs[2]["metadata"]["name"], "steward-demo-main-2");
        assert_eq!(pvs[0]["spec"]["capacity"]["storage"], "10Gi");
        assert_eq!(
            pvs[0]["spec"]["storageClassName"], "",
            "no class: binds claims without one"
        );
        assert!(volumes_for(&json!({"kind": "Database", "metadata": {"name": "x"}})).is_empty());
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

    #[test]
    fn only_database_samples_are_pointed_at_the_local_server() {
        let mut db = json!({"apiVersion": "database.steward.dev/v1alpha1", "kind": "Database", "metadata": {"name": "app"},
            "spec": {"clusterRef": {"name": "pg"}, "name": "app", "owner": "app"}});
        point_at_local_postgres(&mut db, "127.0.0.1", 5433);
        assert_eq!(db["spec"].get("clusterRef"), None);
        assert_eq!(
            db["spec"]["external"],
            json!({"host": "127.0.0.1", "port": 5433, "sslMode": "disable", "adminSecretRef": {"name": POSTGRES_SECRET}})
        );
        assert_eq!(db["spec"]["name"], "app");
        let mut role = json!({"apiVersion": "database.steward.dev/v1alpha1", "kind": "DatabaseRole", "metadata": {"name": "r"}, "spec": {}});
        let before = role.clone();
        point_at_local_postgres(&mut role, "127.0.0.1", 5433);
        assert_eq!(role, before);
    }
}
