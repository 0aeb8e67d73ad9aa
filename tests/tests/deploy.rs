//! The deploy manifests against the real control plane: the repository-root kustomization
//! (`crds/` + `deploy/`), the samples, and each operator running in-process *as its own
//! ServiceAccount* with the RBAC of `deploy/<operator>/`.
//!
//! - `manifests_*`: the rendered manifests say what the issue asks (2 replicas, probes, the
//!   restricted profile, the downward API, RBAC without wildcards, args the binary accepts).
//! - `everything_applies_*`: every object applies by server-side apply, every CRD becomes
//!   Established, and the operators' Deployments become Available under the namespace's
//!   enforced `restricted` Pod Security level (kwok runs the pods).
//! - `samples_are_accepted`: every sample passes the API server's validation and admission.
//! - `<operator>_runs_as_its_service_account`: the operator, authenticated by a TokenRequest
//!   token of its ServiceAccount, takes its Lease, syncs its caches, drives a small scenario
//!   to success without a single "forbidden" in its logs, and is refused (403) outside its role.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write as _;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use anyhow::{Context as _, Result, anyhow, bail, ensure};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::api::rbac::v1::ClusterRoleBinding;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Client;
use kube::api::{Api, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use steward_core::Operator;
use steward_core::cli::CommonArgs;
use steward_testenv::harness::Harness;
use steward_testenv::manifests;
use steward_testenv::{ControlPlane, eventually, http_get, workspace_root};
use tokio::sync::OnceCell;

const WAIT: Duration = Duration::from_secs(90);

/// Every operator of the workspace (the registry in `crates/operators`).
fn operators() -> Vec<&'static str> {
    steward_operators::names()
}
const FIELD_MANAGER: &str = "steward-deploy-test";

// ---------------------------------------------------------------------------------------
// Rendering and applying manifests
// ---------------------------------------------------------------------------------------

/// The namespace `deploy/<operator>/` installs the operator into.
fn operator_namespace(operator: &str) -> String {
    format!("{operator}-system")
}

/// `kubectl kustomize <dir>` with the control plane's kubectl, as a list of objects.
fn kustomize(dir: &Path) -> Result<Vec<Value>> {
    Ok(manifests::kustomize(
        &steward_testenv::binaries::ensure()?.kubectl,
        dir,
    )?)
}

fn kind(obj: &Value) -> &str {
    obj["kind"].as_str().unwrap_or_default()
}

fn name(obj: &Value) -> &str {
    obj["metadata"]["name"].as_str().unwrap_or_default()
}

fn namespace(obj: &Value) -> Option<&str> {
    obj["metadata"]["namespace"].as_str()
}

fn describe(obj: &Value) -> String {
    match namespace(obj) {
        Some(ns) => format!("{} {ns}/{}", kind(obj), name(obj)),
        None => format!("{} {}", kind(obj), name(obj)),
    }
}

/// The `Api` for `obj`'s kind (by discovery), in its namespace or `default_namespace`.
async fn dynamic_api(
    client: &Client,
    obj: &Value,
    default_namespace: Option<&str>,
) -> Result<Api<DynamicObject>> {
    Ok(manifests::dynamic_api(client, obj, default_namespace)
        .await?
        .0)
}

/// Server-side applies `obj` (forced), optionally as a dry run (`dryRun=All`).
async fn apply(
    client: &Client,
    obj: &Value,
    default_namespace: Option<&str>,
    dry_run: bool,
) -> Result<DynamicObject> {
    Ok(manifests::apply(client, obj, default_namespace, FIELD_MANAGER, dry_run).await?)
}

/// Applies `crds/` and `deploy/` through the repository-root kustomization, once per test
/// binary: the CRDs first (each until Established), then everything else.
async fn installed() -> Result<&'static ControlPlane> {
    static INSTALLED: OnceCell<std::result::Result<(), String>> = OnceCell::const_new();
    let cp = steward_testenv::shared().await?;
    INSTALLED
        .get_or_init(|| async { install(cp).await.map_err(|e| format!("{e:#}")) })
        .await
        .clone()
        .map_err(|e| anyhow!("installing crds/ and deploy/ failed: {e}"))?;
    Ok(cp)
}

async fn install(cp: &ControlPlane) -> Result<()> {
    let objects = kustomize(&workspace_root())?;
    let client = cp.client()?;
    for obj in objects
        .iter()
        .filter(|o| kind(o) == "CustomResourceDefinition")
    {
        let crd: CustomResourceDefinition = serde_json::from_value(obj.clone())?;
        cp.apply_crd(&crd).await?;
    }
    // Namespaces before what lives in them; everything else in kustomize's order.
    let (namespaces, rest): (Vec<&Value>, Vec<&Value>) = objects
        .iter()
        .filter(|o| kind(o) != "CustomResourceDefinition")
        .partition(|o| kind(o) == "Namespace");
    for obj in namespaces.into_iter().chain(rest) {
        apply(&client, obj, None, false).await?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Static checks of the rendered manifests
// ---------------------------------------------------------------------------------------

/// The Deployment, ServiceAccount, roles and bindings of one operator, rendered.
struct Rendered {
    operator: &'static str,
    objects: Vec<Value>,
}

impl Rendered {
    fn of(operator: &'static str) -> Result<Self> {
        Ok(Self {
            operator,
            objects: kustomize(&workspace_root().join("deploy").join(operator))?,
        })
    }

    fn one(&self, kind_: &str) -> Result<&Value> {
        let found: Vec<_> = self.objects.iter().filter(|o| kind(o) == kind_).collect();
        match found.as_slice() {
            [one] => Ok(one),
            other => bail!(
                "deploy/{} renders {} {kind_} objects, expected 1",
                self.operator,
                other.len()
            ),
        }
    }

    fn of_kind<'a>(&'a self, kind_: &'a str) -> impl Iterator<Item = &'a Value> + 'a {
        self.objects.iter().filter(move |o| kind(o) == kind_)
    }
}

/// Parses the Deployment's args as the operator binary would (steward-core's flags and the
/// operator's own), so a typo in a flag fails here rather than in a crash-looping pod.
fn parse_args(operator: &str, args: &[String]) -> Result<CommonArgs> {
    let Some(entry) = steward_operators::find(operator) else {
        bail!("unknown operator {operator}");
    };
    Ok((entry.parse_args)(args)?)
}

fn check_deployment(r: &Rendered) -> Result<()> {
    let op = r.operator;
    let ns = operator_namespace(op);
    let d = r.one("Deployment")?;
    ensure!(
        namespace(d) == Some(ns.as_str()),
        "{op}: Deployment is not in {ns}"
    );
    ensure!(
        d["spec"]["replicas"] == 2,
        "{op}: replicas is {}, expected 2",
        d["spec"]["replicas"]
    );
    let pod = &d["spec"]["template"]["spec"];
    let sa = pod["serviceAccountName"].as_str().unwrap_or_default();
    ensure!(sa == op, "{op}: serviceAccountName is {sa:?}");
    ensure!(
        r.of_kind("ServiceAccount")
            .any(|s| name(s) == sa && namespace(s) == Some(ns.as_str())),
        "{op}: ServiceAccount {sa} is not rendered in {ns}"
    );

    // The restricted Pod Security profile.
    let psc = &pod["securityContext"];
    ensure!(
        psc["runAsNonRoot"] == true,
        "{op}: pod securityContext.runAsNonRoot is not true"
    );
    ensure!(
        psc["seccompProfile"]["type"] == "RuntimeDefault",
        "{op}: seccompProfile is not RuntimeDefault"
    );
    let containers = pod["containers"].as_array().context("no containers")?;
    ensure!(containers.len() == 1, "{op}: expected one container");
    let c = &containers[0];
    let sc = &c["securityContext"];
    ensure!(
        sc["allowPrivilegeEscalation"] == false,
        "{op}: allowPrivilegeEscalation is not false"
    );
    ensure!(
        sc["readOnlyRootFilesystem"] == true,
        "{op}: readOnlyRootFilesystem is not true"
    );
    ensure!(
        sc["capabilities"]["drop"] == json!(["ALL"]),
        "{op}: capabilities.drop is not [ALL]"
    );
    ensure!(
        sc.get("privileged").is_none_or(|p| p == false),
        "{op}: privileged"
    );
    ensure!(
        c["image"]
            .as_str()
            .is_some_and(|i| i.starts_with(&format!("steward/{op}:"))),
        "{op}: image is {}",
        c["image"]
    );

    // Resources.
    for (what, res) in [
        ("requests", &c["resources"]["requests"]),
        ("limits", &c["resources"]["limits"]),
    ] {
        ensure!(
            res["cpu"].is_string() && res["memory"].is_string(),
            "{op}: resources.{what} needs cpu and memory"
        );
    }

    // The downward API, read by steward-core for the identity and the Lease namespace.
    let env: BTreeMap<&str, &str> = c["env"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| {
            Some((
                e["name"].as_str()?,
                e["valueFrom"]["fieldRef"]["fieldPath"].as_str()?,
            ))
        })
        .collect();
    ensure!(
        env.get("POD_NAME") == Some(&"metadata.name"),
        "{op}: POD_NAME is not the pod's name: {env:?}"
    );
    ensure!(
        env.get("POD_NAMESPACE") == Some(&"metadata.namespace"),
        "{op}: POD_NAMESPACE is not the pod's namespace"
    );

    // Args the binary accepts, ports and probes that match them.
    let args: Vec<String> = c["args"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|a| a.as_str().map(String::from))
        .collect();
    let common =
        parse_args(op, &args).with_context(|| format!("{op}: the Deployment's args {args:?}"))?;
    ensure!(common.leader_elect, "{op}: leader election is off");
    let port = |name_: &str| -> Option<u64> {
        c["ports"].as_array()?.iter().find(|p| p["name"] == name_)?["containerPort"].as_u64()
    };
    let metrics = common.metrics_addr()?.context("metrics disabled")?;
    let health = common.health_addr()?.context("health probes disabled")?;
    ensure!(
        port("metrics") == Some(u64::from(metrics.port())),
        "{op}: port `metrics` is not the metrics address {metrics}"
    );
    ensure!(
        port("health") == Some(u64::from(health.port())),
        "{op}: port `health` is not the probe address {health}"
    );
    for (probe, path) in [("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")] {
        let get = &c[probe]["httpGet"];
        ensure!(
            get["path"] == path && get["port"] == "health",
            "{op}: {probe} is not GET {path} on the health port: {get}"
        );
    }
    // Long enough to drain (--shutdown-timeout) and release the Lease.
    let grace = pod["terminationGracePeriodSeconds"].as_u64().unwrap_or(30);
    ensure!(
        grace > common.shutdown_timeout.as_secs(),
        "{op}: terminationGracePeriodSeconds {grace} <= --shutdown-timeout"
    );
    Ok(())
}

/// Whether `op`'s role of kind `role_kind` may hold cluster-wide Lease rights: only the
/// database-operator's ClusterRole, which grants them (per cluster, by name) to the
/// PostgreSQL instance managers.
fn grants_instance_leases(op: &str, role_kind: &str) -> bool {
    op == database_operator::NAME && role_kind == "ClusterRole"
}

fn check_rbac(r: &Rendered) -> Result<()> {
    let op = r.operator;
    let ns = operator_namespace(op);
    let subject = json!([{"kind": "ServiceAccount", "name": op, "namespace": ns}]);
    let mut bound = BTreeSet::new();
    for b in r
        .of_kind("ClusterRoleBinding")
        .chain(r.of_kind("RoleBinding"))
    {
        ensure!(
            b["subjects"] == subject,
            "{op}: {} binds {} instead of only its ServiceAccount",
            describe(b),
            b["subjects"]
        );
        bound.insert((
            b["roleRef"]["kind"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
            b["roleRef"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
        ));
    }
    let mut lease_rules = 0;
    let mut event_verbs = BTreeSet::new();
    for role in r.of_kind("ClusterRole").chain(r.of_kind("Role")) {
        let role_kind = kind(role);
        ensure!(
            bound.contains(&(role_kind.to_string(), name(role).to_string())),
            "{op}: {} is not bound",
            describe(role)
        );
        ensure!(
            role.get("aggregationRule").is_none(),
            "{op}: {} aggregates other roles",
            describe(role)
        );
        for rule in role["rules"].as_array().context("rules")? {
            for field in ["apiGroups", "resources", "verbs"] {
                let values = rule[field].as_array().with_context(|| {
                    format!("{op}: a rule of {} has no {field}", describe(role))
                })?;
                ensure!(
                    !values.is_empty(),
                    "{op}: empty {field} in {}",
                    describe(role)
                );
                ensure!(
                    !values.iter().any(|v| v == "*"),
                    "{op}: wildcard {field} in {}: {rule}",
                    describe(role)
                );
            }
            ensure!(
                rule.get("nonResourceURLs").is_none(),
                "{op}: nonResourceURLs in {}",
                describe(role)
            );
            let verbs: Vec<&str> = rule["verbs"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .collect();
            let resources: Vec<&str> = rule["resources"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .collect();
            // The one exception: the tenant-operator writes, in each tenant namespace, the Role
            // that lets it read its own copies by name (it holds no read of Secrets to grant).
            ensure!(
                !verbs.contains(&"escalate")
                    || (op == "tenant-operator"
                        && resources == ["roles"]
                        && rule["resourceNames"] == json!(["tenancy.steward.dev:tenant-operator"])),
                "{op}: verb escalate in {}: {rule}",
                describe(role)
            );
            if verbs.contains(&"impersonate") {
                // The one exception: the upgrade-orchestrator acts as a plan's
                // `serviceAccountName` (so a plan changes only what that account may). Never
                // users, groups or other resources, and no other verb in the same rule.
                ensure!(
                    op == "upgrade-orchestrator"
                        && resources == ["serviceaccounts"]
                        && rule["apiGroups"] == json!([""])
                        && verbs == ["impersonate"],
                    "{op}: verb impersonate in {}: {rule}",
                    describe(role)
                );
            }
            if resources.contains(&"leases") && grants_instance_leases(op, role_kind) {
                // The database-operator gives each PostgresCluster's instance managers a
                // Role on that cluster's Lease; RBAC lets it grant only what it holds.
                ensure!(
                    verbs
                        .iter()
                        .all(|v| ["get", "list", "watch", "create", "update", "patch"].contains(v)),
                    "{op}: Lease verbs {verbs:?} beyond what instance managers need"
                );
            } else if resources.contains(&"leases") {
                // Only the operator's own Lease, in its own namespace.
                ensure!(
                    role_kind == "Role" && namespace(role) == Some(ns.as_str()),
                    "{op}: leases outside the Role in {ns}"
                );
                if verbs.iter().any(|v| *v != "create") {
                    ensure!(
                        rule["resourceNames"] == json!([op]),
                        "{op}: Lease {verbs:?} not limited to resourceNames [{op}]"
                    );
                }
                lease_rules += 1;
            }
            // steward-core's Recorder writes Events through the core v1 API.
            if rule["apiGroups"] == json!([""]) && resources == ["events"] {
                event_verbs.extend(verbs.iter().map(|v| v.to_string()));
            }
        }
    }
    ensure!(lease_rules > 0, "{op}: no Lease rule");
    if op == "tenant-operator" {
        // The admission policies it applies are exactly those its role names.
        let exempt = tenant_operator::policy::Exemptions {
            users: vec![],
            groups: vec![],
            user_prefixes: vec![],
        };
        let policies = tenant_operator::policy::Policies::new(&exempt, None, tenant_operator::NAME);
        let generated: BTreeSet<String> = policies
            .validating
            .iter()
            .flat_map(|p| {
                [
                    p.policy.metadata.name.clone(),
                    p.binding.metadata.name.clone(),
                ]
            })
            .flatten()
            .collect();
        // Its mutating policies it may only read: the deployment installs them.
        for rule in r
            .of_kind("ClusterRole")
            .flat_map(|role| role["rules"].as_array().cloned().unwrap_or_default())
            .filter(|rule| rule["apiGroups"] == json!(["admissionregistration.k8s.io"]))
        {
            let resources = rule["resources"].as_array().cloned().unwrap_or_default();
            let verbs = rule["verbs"].as_array().cloned().unwrap_or_default();
            let mutating = resources
                .iter()
                .any(|r| r.as_str().is_some_and(|r| r.starts_with("mutating")));
            let writes = verbs
                .iter()
                .any(|v| !["get", "list", "watch"].contains(&v.as_str().unwrap_or("")));
            ensure!(
                !(mutating && writes),
                "{op}: may write mutating admission policies: {rule}"
            );
            ensure!(
                !writes || !rule["resourceNames"].is_null(),
                "{op}: writes admission policies of any name: {rule}"
            );
        }
        for d in &policies.mutating {
            for (kind, name) in [
                ("MutatingAdmissionPolicy", &d.policy.metadata.name),
                ("MutatingAdmissionPolicyBinding", &d.binding.metadata.name),
            ] {
                let name = name.as_deref().unwrap_or_default();
                ensure!(
                    r.of_kind(kind).any(|o| self::name(o) == name),
                    "{op}: the deployment does not install {kind} {name}"
                );
            }
        }
        let named: BTreeSet<String> = r
            .of_kind("ClusterRole")
            .flat_map(|role| role["rules"].as_array().cloned().unwrap_or_default())
            .filter(|rule| {
                rule["apiGroups"] == json!(["admissionregistration.k8s.io"])
                    && !rule["resourceNames"].is_null()
            })
            .flat_map(|rule| {
                rule["resourceNames"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default()
            })
            .filter_map(|n| n.as_str().map(String::from))
            .collect();
        ensure!(
            generated == named,
            "{op}: its role names the admission policies {named:?}, the operator applies {generated:?}"
        );
    }
    ensure!(
        event_verbs == BTreeSet::from(["create".to_string(), "patch".to_string()]),
        "{op}: core v1 events verbs are {event_verbs:?}"
    );
    Ok(())
}

#[test]
fn manifests_have_two_replicas_probes_restricted_pods_and_rbac_without_wildcards() -> Result<()> {
    let mut problems = Vec::new();
    for op in operators() {
        let r = Rendered::of(op)?;
        for result in [check_deployment(&r), check_rbac(&r)] {
            if let Err(e) = result {
                problems.push(format!("{e:#}"));
            }
        }
        ensure!(
            r.of_kind("Namespace")
                .any(|ns| name(ns) == operator_namespace(op)),
            "{op}: no Namespace {}",
            operator_namespace(op)
        );
        for ns in r.of_kind("Namespace") {
            ensure!(
                ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted",
                "{op}: namespace {} does not enforce the restricted Pod Security level",
                name(ns)
            );
        }
    }
    ensure!(problems.is_empty(), "{}", problems.join("\n"));
    Ok(())
}

#[test]
fn root_kustomization_lists_every_crd_and_every_operator() -> Result<()> {
    let objects = kustomize(&workspace_root())?;
    let rendered: BTreeSet<String> = objects
        .iter()
        .filter(|o| kind(o) == "CustomResourceDefinition")
        .map(|o| name(o).to_string())
        .collect();
    let mut generated = BTreeSet::new();
    for entry in std::fs::read_dir(workspace_root().join("crds"))? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "yaml") {
            let crd: CustomResourceDefinition =
                serde_yaml::from_str(&std::fs::read_to_string(&path)?)?;
            generated.insert(crd.metadata.name.unwrap_or_default());
        }
    }
    ensure!(
        rendered == generated,
        "kustomization.yaml (repository root) renders CRDs {rendered:?} but crds/ holds {generated:?}: list every crds/*.yaml file in it"
    );
    let deployments: BTreeSet<&str> = objects
        .iter()
        .filter(|o| kind(o) == "Deployment")
        .map(name)
        .collect();
    ensure!(
        deployments == operators().into_iter().collect::<BTreeSet<_>>(),
        "the root kustomization renders Deployments {deployments:?}"
    );

    // No manifest is left out of its directory's kustomization.
    let dirs = operators()
        .into_iter()
        .map(|op| format!("deploy/{op}"))
        .chain(["deploy/base".to_string(), "deploy/samples".to_string()]);
    for dir in dirs {
        let path = workspace_root().join(&dir);
        let kustomization: Value =
            serde_yaml::from_str(&std::fs::read_to_string(path.join("kustomization.yaml"))?)?;
        let listed: BTreeSet<&str> = kustomization["resources"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .collect();
        for entry in std::fs::read_dir(&path)? {
            let file = entry?.file_name().to_string_lossy().to_string();
            if file.ends_with(".yaml") && file != "kustomization.yaml" {
                ensure!(
                    listed.contains(file.as_str()),
                    "{dir}/{file} is not listed in {dir}/kustomization.yaml"
                );
            }
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Against the control plane
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn everything_applies_crds_establish_and_operator_pods_run_under_restricted_pod_security()
-> Result<()> {
    let cp = installed().await?;
    let client = cp.client()?;
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    for obj in kustomize(&workspace_root())?
        .iter()
        .filter(|o| kind(o) == "CustomResourceDefinition")
    {
        let crd = crds.get(name(obj)).await?;
        let established = crd
            .status
            .and_then(|s| s.conditions)
            .unwrap_or_default()
            .iter()
            .any(|c| c.type_ == "Established" && c.status == "True");
        ensure!(established, "CRD {} is not Established", name(obj));
    }

    // Pod Security admission really enforces `restricted` in the operators' namespaces ...
    let privileged = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "privileged", "namespace": operator_namespace("database-operator")},
        "spec": {"containers": [{"name": "c", "image": "busybox", "securityContext": {"privileged": true}}]},
    });
    match apply(&client, &privileged, None, true).await {
        Err(e) if format!("{e:#}").contains("PodSecurity") => {}
        other => bail!("a privileged pod was not refused by Pod Security admission: {other:?}"),
    }
    // ... and the operators' pods pass it: each Deployment gets 2 available replicas.
    for op in operators() {
        let deployments: Api<k8s_openapi::api::apps::v1::Deployment> =
            Api::namespaced(client.clone(), &operator_namespace(op));
        eventually(
            &format!("Deployment {op} available with 2 replicas"),
            WAIT,
            || {
                let deployments = deployments.clone();
                async move {
                    let d = deployments.get(op).await.map_err(|e| e.to_string())?;
                    let status = d.status.unwrap_or_default();
                    match status.available_replicas {
                        Some(2) => Ok(()),
                        _ => Err(format!(
                            "status: {}",
                            serde_json::to_string(&status).unwrap_or_default()
                        )),
                    }
                }
            },
        )
        .await?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn samples_are_accepted() -> Result<()> {
    let cp = installed().await?;
    let client = cp.client()?;
    let ns = cp.namespace("deploy-samples").await?;
    let samples = kustomize(&workspace_root().join("deploy/samples"))?;
    let crds = kustomize(&workspace_root())?;
    let kinds: BTreeSet<String> = crds
        .iter()
        .filter(|o| kind(o) == "CustomResourceDefinition")
        .filter_map(|o| o["spec"]["names"]["kind"].as_str().map(String::from))
        .collect();
    let sampled: BTreeSet<String> = samples.iter().map(|o| kind(o).to_string()).collect();
    let missing: Vec<_> = kinds.difference(&sampled).collect();
    ensure!(
        missing.is_empty(),
        "deploy/samples has no sample of {missing:?}"
    );
    // Samples in kustomize's order (what they reference first), into a fresh namespace.
    let mut failures = Vec::new();
    for obj in &samples {
        if let Err(e) = apply(&client, obj, Some(&ns), false).await {
            failures.push(format!("{e:#}"));
        }
    }
    ensure!(
        failures.is_empty(),
        "samples refused:\n{}",
        failures.join("\n")
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Operators in-process, as their ServiceAccounts
// ---------------------------------------------------------------------------------------

/// Log lines of every in-process operator of this test binary.
fn logs() -> &'static Arc<Mutex<Vec<u8>>> {
    static LOGS: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOGS.get_or_init(|| {
        let buffer = Arc::new(Mutex::new(Vec::new()));
        let writer = {
            let buffer = buffer.clone();
            move || Capture(buffer.clone())
        };
        // Watch and list failures surface at debug level in steward-core's controller loop.
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(
                "info,steward_core=debug,kube_runtime=debug",
            ))
            .with_ansi(false)
            .with_writer(writer)
            .try_init();
        buffer
    })
}

struct Capture(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Capture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The last `n` log lines, for failure messages.
fn log_tail(n: usize) -> String {
    let text =
        String::from_utf8_lossy(&logs().lock().unwrap_or_else(|p| p.into_inner())).to_string();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Log lines that say `user` was forbidden something.
fn forbidden_lines(user: &str) -> Vec<String> {
    let text =
        String::from_utf8_lossy(&logs().lock().unwrap_or_else(|p| p.into_inner())).to_string();
    text.lines()
        .filter(|l| l.to_lowercase().contains("forbidden") && l.contains(user))
        .map(String::from)
        .collect()
}

/// An operator running in-process as its ServiceAccount, with leader election on.
struct Running {
    operator: &'static str,
    /// `system:serviceaccount:<ns>:<operator>`.
    user: String,
    /// A client authenticated as the operator's ServiceAccount.
    client: Client,
    metrics: SocketAddr,
    /// The operator, in-process (stopped on drop).
    harness: Harness,
}

impl Running {
    async fn start(
        cp: &ControlPlane,
        operator: &'static str,
        register: impl FnOnce(&mut Operator) -> Result<()>,
    ) -> Result<Self> {
        logs();
        let ns = operator_namespace(operator);
        let config = cp.service_account_config(&ns, operator).await?;
        let health: SocketAddr = format!("127.0.0.1:{}", steward_testenv::free_port()?).parse()?;
        let metrics: SocketAddr = format!("127.0.0.1:{}", steward_testenv::free_port()?).parse()?;
        let args = CommonArgs {
            leader_elect: true,
            leader_election_namespace: Some(ns.clone()),
            leader_election_lease_duration: Duration::from_secs(3),
            leader_election_renew_deadline: Duration::from_secs(2),
            leader_election_retry_period: Duration::from_millis(500),
            metrics_bind_address: metrics.to_string(),
            health_probe_bind_address: health.to_string(),
            ..CommonArgs::default()
        };
        let mut op = Operator::with_config(operator, args, config.clone())?
            .backoff(Duration::from_millis(200), Duration::from_secs(5));
        register(&mut op)?;
        let identity = op.leadership().identity().to_string();
        let running = Self {
            operator,
            user: format!("system:serviceaccount:{ns}:{operator}"),
            client: Client::try_from(config)?,
            metrics,
            harness: Harness::start(op).await,
        };

        // It leads through its own Lease ...
        let leases: Api<Lease> = Api::namespaced(cp.client()?, &ns);
        eventually(
            &format!("{operator} holds Lease {ns}/{operator}"),
            WAIT,
            || {
                let leases = leases.clone();
                let identity = identity.clone();
                async move {
                    let lease = leases.get_opt(operator).await.map_err(|e| e.to_string())?;
                    let holder = lease.and_then(|l| l.spec).and_then(|s| s.holder_identity);
                    if holder.as_deref() == Some(identity.as_str()) {
                        Ok(())
                    } else {
                        Err(format!("holder {holder:?}"))
                    }
                }
            },
        )
        .await
        .map_err(|e| anyhow!("{e}\nlast log lines:\n{}", log_tail(12)))?;
        // ... and its caches sync (list and watch of its own kind are allowed).
        eventually(&format!("{operator} /readyz"), WAIT, || async move {
            match http_get(health, "/readyz").await {
                Ok((200, _)) => Ok(()),
                Ok((code, body)) => Err(format!("{code} {body}")),
                Err(e) => Err(e.to_string()),
            }
        })
        .await
        .map_err(|e| anyhow!("{e}\nlast log lines:\n{}", log_tail(12)))?;
        Ok(running)
    }

    /// Asserts no log line says this operator was forbidden something, then that requests
    /// outside every operator's role, made with its credentials, are refused with 403.
    async fn check_rbac(&self) -> Result<()> {
        self.check_rbac_except(&[]).await
    }

    /// As [`Running::check_rbac`], ignoring log lines that mention one of `expected` (requests
    /// the test provoked on purpose).
    async fn check_rbac_except(&self, expected: &[&str]) -> Result<()> {
        let lines: Vec<String> = forbidden_lines(&self.user)
            .into_iter()
            .filter(|l| !expected.iter().any(|e| l.contains(e)))
            .collect();
        ensure!(
            lines.is_empty(),
            "{} was forbidden requests it needs:\n{}",
            self.operator,
            lines.join("\n")
        );
        self.expect_forbidden("create a ClusterRoleBinding (no escalation to cluster-admin)", async {
            let crb: ClusterRoleBinding = serde_json::from_value(json!({
                "metadata": {"name": format!("{}-escalation", self.operator)},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin"},
                "subjects": [{"kind": "User", "name": self.user}],
            }))?;
            Api::<ClusterRoleBinding>::all(self.client.clone()).create(&PostParams::default(), &crb).await.map(drop).map_err(Into::into)
        })
        .await?;
        self.expect_forbidden("delete a CRD", async {
            let crds = Api::<CustomResourceDefinition>::all(self.client.clone());
            crds.delete("upgradeplans.upgrade.steward.dev", &Default::default())
                .await
                .map(drop)
                .map_err(Into::into)
        })
        .await?;
        let reads_leases = grants_instance_leases(self.operator, "ClusterRole");
        for other in operators()
            .iter()
            .filter(|o| **o != self.operator && !reads_leases)
        {
            self.expect_forbidden(&format!("read {other}'s Lease"), async {
                Api::<Lease>::namespaced(self.client.clone(), &operator_namespace(other))
                    .get(other)
                    .await
                    .map(drop)
                    .map_err(Into::into)
            })
            .await?;
        }
        Ok(())
    }

    async fn expect_forbidden(
        &self,
        what: &str,
        request: impl std::future::Future<Output = Result<()>>,
    ) -> Result<()> {
        match request.await {
            Err(e) => match e.downcast_ref::<kube::Error>() {
                Some(kube::Error::Api(s)) if s.code == 403 => Ok(()),
                _ => bail!("{} may not {what}, expected 403, got: {e:#}", self.operator),
            },
            Ok(()) => bail!("{} could {what}: its role is too wide", self.operator),
        }
    }

    /// The operator's `/metrics` text.
    async fn metrics(&self) -> Result<String> {
        let (code, body) = http_get(self.metrics, "/metrics").await?;
        ensure!(code == 200, "/metrics answered {code}");
        Ok(body)
    }

    /// Stops the operator and checks it released its Lease (Lease `update` is allowed).
    async fn stop(self, cp: &ControlPlane) -> Result<()> {
        tokio::time::timeout(WAIT, self.harness.stop())
            .await
            .context("operator did not stop")?
            .context("operator run failed")?;
        let ns = operator_namespace(self.operator);
        let lease = Api::<Lease>::namespaced(cp.client()?, &ns)
            .get(self.operator)
            .await?;
        let holder = lease
            .spec
            .and_then(|s| s.holder_identity)
            .unwrap_or_default();
        ensure!(
            holder.is_empty(),
            "{} did not release its Lease (holder {holder:?})",
            self.operator
        );
        Ok(())
    }
}

/// `.status.conditions[type=Ready].status` of a dynamic object, and its phase and message.
fn readiness(obj: &DynamicObject) -> (Option<String>, String) {
    let status = &obj.data["status"];
    let ready = status["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["type"] == "Ready")
        .and_then(|c| c["status"].as_str().map(String::from));
    (
        ready,
        format!(
            "phase {} conditions {}",
            status["phase"], status["conditions"]
        ),
    )
}

/// Waits until `api`'s object `name` has condition Ready=True.
async fn wait_ready(api: &Api<DynamicObject>, name_: &str) -> Result<DynamicObject> {
    Ok(eventually(&format!("{name_} Ready"), WAIT, || {
        let api = api.clone();
        let name_ = name_.to_string();
        async move {
            let obj = api.get(&name_).await.map_err(|e| e.to_string())?;
            match readiness(&obj) {
                (Some(s), _) if s == "True" => Ok(obj),
                (_, detail) => Err(detail),
            }
        }
    })
    .await?)
}

fn write_note(text: &str) {
    let _ = writeln!(std::io::stderr(), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upgrade_orchestrator_runs_as_its_service_account() -> Result<()> {
    let cp = installed().await?;
    let admin = cp.client()?;
    let ns = cp.namespace("deploy-upgrade").await?;
    let running = Running::start(cp, "upgrade-orchestrator", |op| {
        upgrade_orchestrator::register(op, upgrade_orchestrator::Options::default())
            .map_err(Into::into)
    })
    .await?;

    // A Deployment at app:1, and a plan that moves it to app:2.
    let web = json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "web"},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": "web"}},
            "template": {"metadata": {"labels": {"app": "web"}}, "spec": {"containers": [{"name": "app", "image": "example.invalid/app:1"}]}},
        },
    });
    apply(&admin, &web, Some(&ns), false).await?;
    let plan = json!({
        "apiVersion": "upgrade.steward.dev/v1alpha1", "kind": "UpgradePlan",
        "metadata": {"name": "web-v2"},
        "spec": {"components": [{"name": "web", "target": {"kind": "Deployment", "name": "web"}, "image": {"container": "app", "image": "example.invalid/app:2"}}]},
    });
    let plans = dynamic_api(&admin, &plan, Some(&ns)).await?;
    apply(&admin, &plan, Some(&ns), false).await?;
    let done = eventually("UpgradePlan web-v2 Succeeded", WAIT, || {
        let plans = plans.clone();
        async move {
            let p = plans.get("web-v2").await.map_err(|e| e.to_string())?;
            if p.data["status"]["phase"] == "Succeeded" {
                Ok(p)
            } else {
                Err(readiness(&p).1)
            }
        }
    })
    .await?;
    write_note(&format!("plan status: {}", done.data["status"]));
    let deployments: Api<k8s_openapi::api::apps::v1::Deployment> =
        Api::namespaced(admin.clone(), &ns);
    let web = serde_json::to_value(deployments.get("web").await?)?;
    let image = &web["spec"]["template"]["spec"]["containers"][0]["image"];
    ensure!(
        image == "example.invalid/app:2",
        "the Deployment was not upgraded: image {image}"
    );

    running.check_rbac().await?;
    running
        .expect_forbidden("list Secrets", async {
            Api::<Secret>::all(running.client.clone())
                .list(&ListParams::default())
                .await
                .map(drop)
                .map_err(Into::into)
        })
        .await?;
    running
        .expect_forbidden("delete a Deployment", async {
            Api::<k8s_openapi::api::apps::v1::Deployment>::namespaced(running.client.clone(), &ns)
                .delete("web", &Default::default())
                .await
                .map(drop)
                .map_err(Into::into)
        })
        .await?;
    let metrics = running.metrics().await?;
    ensure!(
        metrics.contains("upgradeplan"),
        "no upgradeplan controller metrics:\n{metrics}"
    );
    running.stop(cp).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_operator_runs_as_its_service_account() -> Result<()> {
    let cp = installed().await?;
    let admin = cp.client()?;
    let ns = cp.namespace("deploy-database").await?;
    let pg = steward_testenv::postgres::Postgres::start().await?;
    let running = Running::start(cp, "database-operator", |op| {
        database_operator::register(op, database_operator::Options::default()).map_err(Into::into)
    })
    .await?;

    // A one-instance PostgresCluster on the kwok nodes (a PersistentVolume of a class of its
    // own: kwok has no provisioner), and a Database and DatabaseRole on the real PostgreSQL.
    let class = format!("steward-{ns}");
    let pv = json!({
        "apiVersion": "v1", "kind": "PersistentVolume",
        "metadata": {"name": format!("{class}-0"), "labels": {"steward.dev/test": "deploy"}},
        "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"], "storageClassName": class,
                 "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": format!("/tmp/{class}-0")}},
    });
    let objects = [
        pv,
        json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "admin"},
               "stringData": {"username": pg.superuser(), "password": pg.password()}}),
        json!({"apiVersion": "database.steward.dev/v1alpha1", "kind": "PostgresCluster", "metadata": {"name": "pg"},
               "spec": {"instances": 1, "version": 16, "storage": {"size": "1Gi", "storageClassName": class},
                        "pooler": {"instances": 1}}}),
        json!({"apiVersion": "database.steward.dev/v1alpha1", "kind": "Database", "metadata": {"name": "app"},
               "spec": {"name": "deploy_app", "owner": "deploy_app_owner",
                        "external": {"host": pg.host(), "port": pg.port(), "sslMode": "disable", "adminSecretRef": {"name": "admin"}}}}),
        json!({"apiVersion": "database.steward.dev/v1alpha1", "kind": "DatabaseRole", "metadata": {"name": "reader"},
               "spec": {"databaseRef": {"name": "app"}, "roleName": "deploy_reader", "privileges": "readOnly"}}),
    ];
    for obj in &objects {
        apply(&admin, obj, Some(&ns), false).await?;
    }
    let mut ready = BTreeMap::new();
    for obj in objects.iter().filter(|o| {
        o["apiVersion"]
            .as_str()
            .is_some_and(|v| v.starts_with("database.steward.dev/"))
    }) {
        let api = dynamic_api(&admin, obj, Some(&ns)).await?;
        let done = wait_ready(&api, name(obj))
            .await
            .with_context(|| format!("{}\nlast log lines:\n{}", describe(obj), log_tail(12)))?;
        ready.insert(kind(obj).to_string(), done);
    }
    // Its pooler's children are written as the operator's ServiceAccount (its role grants the
    // agents' Role, its restraint lets it write that Deployment) and deleted once
    // `spec.pooler` is removed (the restraint lets it delete only those).
    let deployments = Api::<k8s_openapi::api::apps::v1::Deployment>::namespaced(admin.clone(), &ns);
    let secrets = Api::<Secret>::namespaced(admin.clone(), &ns);
    eventually("the pooler's Deployment and Secrets", WAIT, || {
        let (deployments, secrets) = (deployments.clone(), secrets.clone());
        async move {
            let found = (
                deployments
                    .get_opt("pg-pooler")
                    .await
                    .map_err(|e| e.to_string())?
                    .is_some(),
                secrets
                    .get_opt("pg-pooler")
                    .await
                    .map_err(|e| e.to_string())?
                    .is_some(),
                secrets
                    .get_opt("pg-pooler-tls")
                    .await
                    .map_err(|e| e.to_string())?
                    .is_some(),
            );
            if found == (true, true, true) {
                Ok(())
            } else {
                Err(format!("{found:?}"))
            }
        }
    })
    .await
    .with_context(|| format!("last log lines:\n{}", log_tail(12)))?;
    let clusters = Api::<database_operator::crd::PostgresCluster>::namespaced(admin.clone(), &ns);
    clusters
        .patch(
            "pg",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"pooler": null}})),
        )
        .await?;
    eventually("the pooler's children deleted", WAIT, || {
        let (deployments, secrets) = (deployments.clone(), secrets.clone());
        async move {
            let left = (
                deployments
                    .get_opt("pg-pooler")
                    .await
                    .map_err(|e| e.to_string())?
                    .is_some(),
                secrets
                    .get_opt("pg-pooler")
                    .await
                    .map_err(|e| e.to_string())?
                    .is_some(),
            );
            if left == (false, false) {
                Ok(())
            } else {
                Err(format!("{left:?}"))
            }
        }
    })
    .await
    .with_context(|| format!("last log lines:\n{}", log_tail(12)))?;

    // The Database's connection Secret exists, with the owner's password.
    let secret_name = ready["Database"].data["status"]["secretName"]
        .as_str()
        .context("Database status names no Secret")?
        .to_string();
    let secret = Api::<Secret>::namespaced(admin.clone(), &ns)
        .get(&secret_name)
        .await?;
    ensure!(
        secret.data.is_some_and(|d| d.contains_key("password")),
        "Secret {secret_name} has no password"
    );

    // Deleting removes the finalizers (Retain: the database stays in PostgreSQL).
    for obj in objects
        .iter()
        .rev()
        .filter(|o| matches!(kind(o), "DatabaseRole" | "Database"))
    {
        let api = dynamic_api(&admin, obj, Some(&ns)).await?;
        api.delete(name(obj), &Default::default()).await?;
        eventually(&format!("{} deleted", describe(obj)), WAIT, || {
            let api = api.clone();
            let n = name(obj).to_string();
            async move {
                match api.get_opt(&n).await.map_err(|e| e.to_string())? {
                    None => Ok(()),
                    Some(o) => Err(format!(
                        "still there, finalizers {:?}",
                        o.metadata.finalizers
                    )),
                }
            }
        })
        .await?;
    }

    running.check_rbac().await?;
    running
        .expect_forbidden(
            "delete a Secret that is not its pooler's (restraint.yaml)",
            async {
                Api::<Secret>::namespaced(running.client.clone(), &ns)
                    .delete(&secret_name, &Default::default())
                    .await
                    .map(drop)
                    .map_err(Into::into)
            },
        )
        .await?;
    // Its role lets it write Deployments (its poolers'), its restraint only its poolers'.
    let web: k8s_openapi::api::apps::v1::Deployment = serde_json::from_value(json!({
        "metadata": {"name": "web"},
        "spec": {"replicas": 0, "selector": {"matchLabels": {"app": "web"}},
                 "template": {"metadata": {"labels": {"app": "web"}},
                              "spec": {"containers": [{"name": "web", "image": "example.invalid/web:1"}]}}},
    }))?;
    Api::<k8s_openapi::api::apps::v1::Deployment>::namespaced(admin.clone(), &ns)
        .create(&PostParams::default(), &web)
        .await?;
    running
        .expect_forbidden("patch a Deployment that is not its pooler's", async {
            let patch = json!({"metadata": {"labels": {"x": "y"}}});
            Api::<k8s_openapi::api::apps::v1::Deployment>::namespaced(running.client.clone(), &ns)
                .patch("web", &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .map(drop)
                .map_err(Into::into)
        })
        .await?;
    // Its restraint (restraint.yaml): of the claims its role lets it delete, only a
    // PostgresCluster instance's (dry runs: were the policy missing, nothing would be deleted
    // and the test fails instead).
    use k8s_openapi::api::core::v1::PersistentVolumeClaim;
    let other: PersistentVolumeClaim = serde_json::from_value(json!({
        "metadata": {"name": "notes"},
        "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": class,
                 "resources": {"requests": {"storage": "1Gi"}}},
    }))?;
    Api::<PersistentVolumeClaim>::namespaced(admin.clone(), &ns)
        .create(&PostParams::default(), &other)
        .await?;
    let dry_delete = kube::api::DeleteParams {
        dry_run: true,
        ..Default::default()
    };
    let claims_as = Api::<PersistentVolumeClaim>::namespaced(running.client.clone(), &ns);
    running
        .expect_forbidden(
            "delete a claim that is not a PostgresCluster instance's",
            async {
                claims_as
                    .delete("notes", &dry_delete)
                    .await
                    .map(drop)
                    .map_err(Into::into)
            },
        )
        .await?;
    claims_as
        .delete("data-pg-0", &dry_delete)
        .await
        .context("the database-operator may delete an instance's claim (its volume gone)")?;
    let metrics = running.metrics().await?;
    ensure!(
        metrics.contains("postgrescluster"),
        "no postgrescluster controller metrics:\n{metrics}"
    );
    running.stop(cp).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_operator_runs_as_its_service_account() -> Result<()> {
    let cp = installed().await?;
    let admin = cp.client()?;
    // The test's namespace holds the shared source; the tenant is named after it.
    let src = cp.namespace("deploy-tenant").await?;
    let tenant = src.clone();
    let (a, b) = (format!("{tenant}-a"), format!("{tenant}-b"));
    let running = Running::start(cp, "tenant-operator", |op| {
        tenant_operator::register(op, tenant_operator::Options::default()).map_err(Into::into)
    })
    .await?;

    // The shared source lives in the shared namespace the deployment grants it to read.
    let registry = format!("registry-{tenant}");
    let shared = json!({"apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": registry, "labels": {"tenancy.steward.dev/shareable": "true"}},
        "stringData": {"token": "t0ken"}});
    apply(&admin, &shared, Some("steward-shared"), false).await?;
    let spec = json!({
        "owners": [{"kind": "User", "name": "alice"}],
        "namespaces": [a, b],
        "deletionPolicy": "Delete",
        "resourceQuota": {"hard": {"pods": 5}},
        "limitRange": {"limits": [{"type": "Container", "defaultRequest": {"cpu": "10m", "memory": "16Mi"}}]},
        "networkIsolation": {},
        "sharedObjects": [{"kind": "Secret", "namespace": "steward-shared", "name": registry}],
        "additionalRoleBindings": [{"clusterRole": "view", "subjects": [{"kind": "Group", "name": "auditors"}]}],
    });
    let obj = json!({"apiVersion": "tenancy.steward.dev/v1alpha1", "kind": "Tenant", "metadata": {"name": tenant}, "spec": spec});
    let tenants = dynamic_api(&admin, &obj, None).await?;
    apply(&admin, &obj, None, false).await?;
    wait_ready(&tenants, &tenant)
        .await
        .map_err(|e| anyhow!("{e:#}\nlast log lines:\n{}", log_tail(12)))?;

    // What it made, as its ServiceAccount: namespaces, the owners' RoleBindings, the copy,
    // the owners' ClusterRole and binding, the admission policies.
    let rbs: Api<k8s_openapi::api::rbac::v1::RoleBinding> = Api::namespaced(admin.clone(), &a);
    for rb in ["tenant-owner-admin", "tenant-view"] {
        rbs.get(rb)
            .await
            .with_context(|| format!("RoleBinding {a}/{rb}"))?;
    }
    Api::<Secret>::namespaced(admin.clone(), &b)
        .get(&registry)
        .await
        .context("the shared Secret's copy")?;
    // It reads Secrets only in the shared namespace and, by name, its copies: not every
    // Secret of the cluster, not another Secret of a tenant namespace, not one elsewhere.
    let planted = json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "app-password"},
        "stringData": {"password": "hunter2"}});
    apply(&admin, &planted, Some(&a), false).await?;
    apply(&admin, &planted, Some(&src), false).await?;
    Api::<Secret>::namespaced(running.client.clone(), &b)
        .get(&registry)
        .await
        .context("the operator reads its copy by name")?;
    running
        .expect_forbidden("list Secrets cluster-wide", async {
            Api::<Secret>::all(running.client.clone())
                .list(&ListParams::default().limit(1))
                .await
                .map(drop)
                .map_err(Into::into)
        })
        .await?;
    running
        .expect_forbidden("list Secrets in a tenant namespace", async {
            Api::<Secret>::namespaced(running.client.clone(), &a)
                .list(&ListParams::default().limit(1))
                .await
                .map(drop)
                .map_err(Into::into)
        })
        .await?;
    for ns in [&a, &src] {
        running
            .expect_forbidden(&format!("read Secret {ns}/app-password"), async {
                Api::<Secret>::namespaced(running.client.clone(), ns)
                    .get("app-password")
                    .await
                    .map(drop)
                    .map_err(Into::into)
            })
            .await?;
    }
    running
        .expect_forbidden(
            "widen its access Role to every Secret",
            dry_merge(
                Api::<k8s_openapi::api::rbac::v1::Role>::namespaced(running.client.clone(), &a),
                "tenancy.steward.dev:tenant-operator",
                json!({"rules": [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "list"]}]}),
            ),
        )
        .await?;
    running
        .expect_forbidden("bind its access Role to someone else", async {
            let rb: k8s_openapi::api::rbac::v1::RoleBinding = serde_json::from_value(json!({
                "metadata": {"name": "mallory-reads"},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "tenancy.steward.dev:tenant-operator"},
                "subjects": [{"kind": "User", "name": "mallory"}],
            }))?;
            Api::<k8s_openapi::api::rbac::v1::RoleBinding>::namespaced(running.client.clone(), &a)
                .create(
                    &PostParams {
                        dry_run: true,
                        ..Default::default()
                    },
                    &rb,
                )
                .await
                .map(drop)
                .map_err(Into::into)
        })
        .await?;
    let owner_role = format!("tenancy.steward.dev:owner:{tenant}");
    Api::<k8s_openapi::api::rbac::v1::ClusterRole>::all(admin.clone())
        .get(&owner_role)
        .await
        .context("the owners' ClusterRole")?;
    Api::<ClusterRoleBinding>::all(admin.clone())
        .get(&owner_role)
        .await
        .context("the owners' ClusterRoleBinding")?;
    let vaps: Api<k8s_openapi::api::admissionregistration::v1::ValidatingAdmissionPolicy> =
        Api::all(admin.clone());
    eventually("the admission policies", WAIT, || {
        let vaps = vaps.clone();
        async move {
            match vaps
                .get_opt("tenancy.steward.dev-managed-objects")
                .await
                .map_err(|e| e.to_string())?
            {
                Some(_) => Ok(()),
                None => Err("not applied yet".into()),
            }
        }
    })
    .await
    .map_err(|e| anyhow!("{e}\nlast log lines:\n{}", log_tail(20)))?;
    Api::<k8s_openapi::api::admissionregistration::v1::MutatingAdmissionPolicy>::all(admin.clone())
        .get("tenancy.steward.dev-pod-defaults")
        .await
        .context("the defaults' MutatingAdmissionPolicy (applied before the rules)")?;

    // A guard rail out of force (here the defaults' binding, which the operator may not write
    // back): a new Tenant says which, and its owners get no access until it is back.
    type Mapb = k8s_openapi::api::admissionregistration::v1::MutatingAdmissionPolicyBinding;
    let mapbs = Api::<Mapb>::all(admin.clone());
    let binding_name = "tenancy.steward.dev-pod-defaults";
    let deployed = kustomize(&workspace_root().join("deploy/tenant-operator"))?
        .into_iter()
        .find(|o| kind(o) == "MutatingAdmissionPolicyBinding")
        .context("the deployment installs the defaults' binding")?;
    mapbs.delete(binding_name, &Default::default()).await?;
    let guarded = format!("{tenant}-g");
    let guarded_ns = format!("{guarded}-a");
    let guarded_obj = json!({"apiVersion": "tenancy.steward.dev/v1alpha1", "kind": "Tenant", "metadata": {"name": guarded},
        "spec": {"owners": [{"kind": "User", "name": "alice"}], "namespaces": [guarded_ns], "deletionPolicy": "Delete"}});
    apply(&admin, &guarded_obj, None, false).await?;
    let missing = eventually("the Tenant reports the missing guard rail", WAIT, || {
        let tenants = tenants.clone();
        let guarded = guarded.clone();
        async move {
            let t = tenants.get(&guarded).await.map_err(|e| e.to_string())?;
            let (ready, detail) = readiness(&t);
            if ready.as_deref() == Some("False")
                && detail.contains("GuardRailsMissing")
                && detail.contains(&format!("MutatingAdmissionPolicyBinding {binding_name}"))
            {
                Ok(detail)
            } else {
                Err(detail)
            }
        }
    })
    .await?;
    write_note(&format!("guard rail missing: {missing}"));
    let owner_binding = || async {
        Api::<k8s_openapi::api::rbac::v1::RoleBinding>::namespaced(admin.clone(), &guarded_ns)
            .get_opt("tenant-owner-admin")
            .await
    };
    ensure!(
        Api::<k8s_openapi::api::core::v1::Namespace>::all(admin.clone())
            .get_opt(&guarded_ns)
            .await?
            .is_some(),
        "the namespace is created meanwhile"
    );
    ensure!(
        owner_binding().await?.is_none(),
        "owners were bound while a guard rail was missing"
    );
    apply(&admin, &deployed, None, false).await?;
    wait_ready(&tenants, &guarded).await?;
    ensure!(
        owner_binding().await?.is_some(),
        "owners are bound once every guard rail is back"
    );
    tenants.delete(&guarded, &Default::default()).await?;

    // A Tenant cannot make the operator grant what it may not bind: cluster-admin is refused.
    let greedy = format!("{tenant}-x");
    let greedy_obj = json!({"apiVersion": "tenancy.steward.dev/v1alpha1", "kind": "Tenant", "metadata": {"name": greedy},
        "spec": {"owners": [{"kind": "User", "name": "mallory"}], "namespaces": [format!("{greedy}-a")],
                 "additionalRoleBindings": [{"clusterRole": "cluster-admin", "subjects": [{"kind": "User", "name": "mallory"}]}]}});
    apply(&admin, &greedy_obj, None, false).await?;
    let refused = eventually(
        "the greedy Tenant reports the refused binding",
        WAIT,
        || {
            let tenants = tenants.clone();
            let greedy = greedy.clone();
            async move {
                let t = tenants.get(&greedy).await.map_err(|e| e.to_string())?;
                let (ready, detail) = readiness(&t);
                if ready.as_deref() == Some("False") && detail.contains("forbidden") {
                    Ok(detail)
                } else {
                    Err(detail)
                }
            }
        },
    )
    .await?;
    write_note(&format!("greedy tenant: {refused}"));
    let crb = Api::<k8s_openapi::api::rbac::v1::RoleBinding>::namespaced(
        admin.clone(),
        &format!("{greedy}-a"),
    )
    .get_opt("tenant-cluster-admin")
    .await?;
    ensure!(crb.is_none(), "a RoleBinding to cluster-admin was created");

    // Deleting the Tenants deletes their namespaces (deletionPolicy Delete) and the finalizers.
    for name_ in [&greedy, &tenant] {
        tenants.delete(name_, &Default::default()).await?;
    }
    for name_ in [greedy.clone(), tenant.clone()] {
        eventually(&format!("Tenant {name_} deleted"), WAIT, || {
            let tenants = tenants.clone();
            let name_ = name_.clone();
            async move {
                match tenants.get_opt(&name_).await.map_err(|e| e.to_string())? {
                    None => Ok(()),
                    Some(t) => Err(readiness(&t).1),
                }
            }
        })
        .await?;
    }

    // Its writes of the defaults' binding deleted above were refused, as they must be.
    running
        .check_rbac_except(&["cluster-admin", "mutatingadmissionpolicybindings"])
        .await?;
    running
        .expect_forbidden("bind the cluster-admin ClusterRole in a namespace", async {
            let rb: k8s_openapi::api::rbac::v1::RoleBinding = escalation("cluster-admin")?;
            Api::<k8s_openapi::api::rbac::v1::RoleBinding>::namespaced(running.client.clone(), &src)
                .create(&PostParams::default(), &rb)
                .await
                .map(drop)
                .map_err(Into::into)
        })
        .await?;
    running
        .expect_forbidden("patch a ValidatingAdmissionPolicy it does not own", async {
            let patch = json!({"metadata": {"labels": {"x": "y"}}});
            vaps_as(&running.client)
                .patch(
                    "someone-elses-policy",
                    &PatchParams::default(),
                    &Patch::Merge(&patch),
                )
                .await
                .map(drop)
                .map_err(Into::into)
        })
        .await?;
    // What its ClusterRole allows but its restraint policy does not (dry runs: nothing changes
    // if the policy were missing, and the test fails instead).
    let dry = PostParams {
        dry_run: true,
        ..Default::default()
    };
    running
        .expect_forbidden("bind admin cluster-wide", async {
            let crb: ClusterRoleBinding = escalation("admin")?;
            Api::<ClusterRoleBinding>::all(running.client.clone())
                .create(&dry, &crb)
                .await
                .map(drop)
                .map_err(Into::into)
        })
        .await?;
    running
        .expect_forbidden("bind admin in a namespace outside every tenant", async {
            let rb: k8s_openapi::api::rbac::v1::RoleBinding = escalation("admin")?;
            Api::<k8s_openapi::api::rbac::v1::RoleBinding>::namespaced(running.client.clone(), &src)
                .create(&dry, &rb)
                .await
                .map(drop)
                .map_err(Into::into)
        })
        .await?;
    running
        .expect_forbidden("create a Secret in kube-system", async {
            let secret: Secret = serde_json::from_value(json!({"metadata": {"name": "planted"}}))?;
            Api::<Secret>::namespaced(running.client.clone(), "kube-system")
                .create(&dry, &secret)
                .await
                .map(drop)
                .map_err(Into::into)
        })
        .await?;
    running
        .expect_forbidden(
            "give kube-system to a tenant",
            dry_merge(
                Api::<k8s_openapi::api::core::v1::Namespace>::all(running.client.clone()),
                "kube-system",
                json!({"metadata": {"labels": {"tenancy.steward.dev/tenant": tenant}}}),
            ),
        )
        .await?;
    // Two steps that would give any namespace to a tenant (then an admin RoleBinding there,
    // or its deletion): writing the created-for or adopt-by mark first, then the label.
    type Ns = k8s_openapi::api::core::v1::Namespace;
    let namespaces = Api::<Ns>::all(running.client.clone());
    for key in ["created-for", "adopt-by"] {
        running
            .expect_forbidden(
                &format!("mark kube-system tenancy.steward.dev/{key}"),
                dry_merge(
                    namespaces.clone(),
                    "kube-system",
                    json!({"metadata": {"annotations": {format!("tenancy.steward.dev/{key}"): tenant}}}),
                ),
            )
            .await?;
    }
    let victim = format!("{tenant}-victim");
    apply(
        &admin,
        &json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": victim}}),
        None,
        false,
    )
    .await?;
    // Not a dry run: if the mark were written, the label would be next.
    running
        .expect_forbidden(
            "mark a namespace it did not create as created for a tenant",
            async {
                let patch = json!({"metadata": {"annotations": {"tenancy.steward.dev/created-for": tenant}}});
                namespaces
                    .patch(&victim, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                    .map(drop)
                    .map_err(Into::into)
            },
        )
        .await?;
    running
        .expect_forbidden(
            "label a namespace it did not create for a tenant",
            dry_merge(
                namespaces.clone(),
                &victim,
                json!({"metadata": {"labels": {"tenancy.steward.dev/tenant": tenant}}}),
            ),
        )
        .await?;
    // A namespace a cluster admin handed over is taken only as adopted, and stays adopted
    // (an adopted namespace is released, never deleted).
    let handed = format!("{tenant}-handed");
    // Handed to a tenant that does not exist, so the running operator leaves it alone.
    let ghost = format!("{tenant}-ghost");
    apply(
        &admin,
        &json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": handed,
            "annotations": {"tenancy.steward.dev/adopt-by": ghost}}}),
        None,
        false,
    )
    .await?;
    running
        .expect_forbidden(
            "take a handed-over namespace without marking it adopted",
            dry_merge(
                namespaces.clone(),
                &handed,
                json!({"metadata": {"labels": {"tenancy.steward.dev/tenant": ghost}}}),
            ),
        )
        .await?;
    dry_merge(
        namespaces.clone(),
        &handed,
        json!({"metadata": {"labels": {"tenancy.steward.dev/tenant": ghost, "tenancy.steward.dev/adopted": "true"}}}),
    )
    .await
    .context("the operator takes a handed-over namespace as adopted")?;
    apply(
        &admin,
        &json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": handed,
            "labels": {"tenancy.steward.dev/tenant": ghost, "tenancy.steward.dev/adopted": "true"}}}),
        None,
        false,
    )
    .await?;
    running
        .expect_forbidden(
            "unmark an adopted namespace (to delete it next)",
            dry_merge(
                namespaces.clone(),
                &handed,
                json!({"metadata": {"labels": {"tenancy.steward.dev/adopted": null}}}),
            ),
        )
        .await?;
    running
        .expect_forbidden("delete an adopted namespace", async {
            namespaces
                .delete(
                    &handed,
                    &kube::api::DeleteParams {
                        dry_run: true,
                        ..Default::default()
                    },
                )
                .await
                .map(drop)
                .map_err(Into::into)
        })
        .await?;
    for ns in [&victim, &handed] {
        Api::<Ns>::all(admin.clone())
            .delete(ns, &Default::default())
            .await?;
    }
    // Admission policies: only its own validating ones, by name; no mutating one at all (a
    // mutating policy may rewrite anything anyone creates, and admission policies never apply
    // to admission configuration: RBAC is the only restraint).
    let foreign_vap: k8s_openapi::api::admissionregistration::v1::ValidatingAdmissionPolicy =
        serde_json::from_value(json!({"metadata": {"name": "someone-elses-policy"},
            "spec": {"failurePolicy": "Fail", "matchConstraints": {"resourceRules": [{"apiGroups": [""],
              "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["configmaps"]}]},
              "validations": [{"expression": "false"}]}}))?;
    running
        .expect_forbidden(
            "create a ValidatingAdmissionPolicy of another name",
            async {
                vaps_as(&running.client)
                    .create(&dry, &foreign_vap)
                    .await
                    .map(drop)
                    .map_err(Into::into)
            },
        )
        .await?;
    running
        .expect_forbidden(
            "create a ValidatingAdmissionPolicy of another name by server-side apply",
            dry_apply(vaps_as(&running.client), &foreign_vap),
        )
        .await?;
    let maps = Api::<k8s_openapi::api::admissionregistration::v1::MutatingAdmissionPolicy>::all(
        running.client.clone(),
    );
    let mut own_map =
        Api::<k8s_openapi::api::admissionregistration::v1::MutatingAdmissionPolicy>::all(
            admin.clone(),
        )
        .get("tenancy.steward.dev-pod-defaults")
        .await?;
    own_map.metadata.managed_fields = None;
    own_map.metadata.resource_version = None;
    own_map.metadata.uid = None;
    own_map.metadata.creation_timestamp = None;
    own_map.metadata.generation = None;
    running
        .expect_forbidden(
            "rewrite its own MutatingAdmissionPolicy",
            dry_apply(maps.clone(), &own_map),
        )
        .await?;
    own_map.metadata.name = Some("steward-takeover".into());
    running
        .expect_forbidden("create a MutatingAdmissionPolicy", async {
            maps.create(&dry, &own_map)
                .await
                .map(drop)
                .map_err(Into::into)
        })
        .await?;
    running
        .expect_forbidden("delete a namespace outside every tenant", async {
            Api::<k8s_openapi::api::core::v1::Namespace>::all(running.client.clone())
                .delete(
                    &src,
                    &kube::api::DeleteParams {
                        dry_run: true,
                        ..Default::default()
                    },
                )
                .await
                .map(drop)
                .map_err(Into::into)
        })
        .await?;
    running
        .expect_forbidden("list Deployments", async {
            Api::<k8s_openapi::api::apps::v1::Deployment>::all(running.client.clone())
                .list(&ListParams::default())
                .await
                .map(drop)
                .map_err(Into::into)
        })
        .await?;
    running.stop(cp).await
}

/// A dry-run merge `patch` of `name` through `api`: refused or not, nothing changes.
async fn dry_merge<K>(api: Api<K>, name: &str, patch: Value) -> Result<()>
where
    K: Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let params = PatchParams {
        dry_run: true,
        ..Default::default()
    };
    api.patch(name, &params, &Patch::Merge(&patch))
        .await
        .map(drop)
        .map_err(Into::into)
}

/// A dry-run server-side apply of `obj` through `api` (as the operator's field manager): refused
/// or not, nothing changes.
async fn dry_apply<K>(api: Api<K>, obj: &K) -> Result<()>
where
    K: kube::Resource + Clone + serde::Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
    K::DynamicType: Default,
{
    let mut body = serde_json::to_value(obj)?;
    body["apiVersion"] = K::api_version(&Default::default()).into();
    body["kind"] = K::kind(&Default::default()).into();
    let params = PatchParams {
        dry_run: true,
        ..PatchParams::apply("tenant-operator").force()
    };
    let name = obj.meta().name.clone().unwrap_or_default();
    api.patch(&name, &params, &Patch::Apply(&body))
        .await
        .map(drop)
        .map_err(Into::into)
}

/// A (Cluster)RoleBinding `escalate` giving mallory the ClusterRole `role`.
fn escalation<B: serde::de::DeserializeOwned>(role: &str) -> Result<B> {
    Ok(serde_json::from_value(json!({
        "metadata": {"name": "escalate"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
        "subjects": [{"kind": "User", "name": "mallory"}],
    }))?)
}

fn vaps_as(
    client: &Client,
) -> Api<k8s_openapi::api::admissionregistration::v1::ValidatingAdmissionPolicy> {
    Api::all(client.clone())
}

/// A reconcile that does nothing, for a controller whose only job here is to need RBAC.
#[derive(Debug, thiserror::Error)]
#[error("never fails")]
struct NeverFails;

impl steward_core::ReconcileError for NeverFails {}

#[tokio::test]
async fn sharded_tenant_operator_needs_only_the_sharded_overlays_rbac() -> Result<()> {
    sharded_operator_needs_only_the_sharded_overlays_rbac::<tenant_operator::Tenant>(
        "tenant-operator",
    )
    .await
}

#[tokio::test]
async fn sharded_database_operator_needs_only_the_sharded_overlays_rbac() -> Result<()> {
    sharded_operator_needs_only_the_sharded_overlays_rbac::<database_operator::crd::PostgresCluster>(
        "database-operator",
    )
    .await
}

/// `deploy/sharded/<operator>` adds only the shard Leases' Role and binding, and two replicas
/// of `operator` sharding its kind `K` as its ServiceAccount (the base's RBAC plus that) take a
/// shard each, without a refused request, and leave the ring when stopped.
async fn sharded_operator_needs_only_the_sharded_overlays_rbac<K>(operator: &str) -> Result<()>
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + serde::Serialize
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
    K::Scope: steward_core::apply::ScopeApi,
{
    use steward_core::shard::{RING_LABEL, key_of, narrow};
    let cp = installed().await?;
    let admin = cp.client()?;
    let ns = operator_namespace(operator);

    // The overlay renders the base plus exactly the shard Leases' Role and binding, with three
    // replicas running --shards=3.
    let base = kustomize(&workspace_root().join("deploy").join(operator))?;
    let sharded = kustomize(&workspace_root().join("deploy/sharded").join(operator))?;
    let extra: Vec<&Value> = sharded
        .iter()
        .filter(|o| !base.iter().any(|b| describe(b) == describe(o)))
        .collect();
    let kinds: BTreeSet<&str> = extra.iter().map(|o| kind(o)).collect();
    ensure!(
        kinds == BTreeSet::from(["Role", "RoleBinding"]) && extra.len() == 2,
        "the overlay adds {:?}",
        extra.iter().map(|o| describe(o)).collect::<Vec<_>>()
    );
    let deployment = sharded
        .iter()
        .find(|o| kind(o) == "Deployment")
        .context("a Deployment")?;
    ensure!(deployment["spec"]["replicas"] == 3, "three replicas");
    let args: Vec<String> = serde_json::from_value(
        deployment["spec"]["template"]["spec"]["containers"][0]["args"].clone(),
    )?;
    ensure!(
        parse_args(operator, &args)?.shards == 3,
        "--shards=3 in {args:?}"
    );
    for obj in &extra {
        apply(&admin, obj, None, false).await?;
    }

    // Two replicas as the operator's ServiceAccount, two shards, a Lease name of this test's
    // own (the other tests' operators hold `tenant-operator`).
    let config = cp.service_account_config(&ns, operator).await?;
    let user = format!("system:serviceaccount:{ns}:{operator}");
    let id = format!("{operator}-shards-{}", std::process::id());
    let selector = format!("steward.dev/test={id}");
    let mut replicas = Vec::new();
    let mut identities = BTreeSet::new();
    for _ in 0..2 {
        logs();
        let args = CommonArgs {
            leader_elect: true,
            leader_election_namespace: Some(ns.clone()),
            leader_election_id: Some(id.clone()),
            leader_election_lease_duration: Duration::from_secs(3),
            leader_election_renew_deadline: Duration::from_secs(2),
            leader_election_retry_period: Duration::from_millis(500),
            shards: 2,
            metrics_bind_address: "0".into(),
            health_probe_bind_address: "0".into(),
            ..CommonArgs::default()
        };
        let mut op = Operator::with_config(operator, args, config.clone())?;
        let (client, of_test) = (op.unguarded_client(), selector.clone());
        op.sharded_controller(
            move |shard| {
                let labels = narrow(Some(&of_test), shard).unwrap_or_default();
                let controller = steward_core::Controller::new(
                    Api::<K>::all(client.clone()),
                    kube::runtime::watcher::Config::default().labels(&labels),
                );
                (controller, ())
            },
            |_, _| async { Ok::<_, NeverFails>(kube::runtime::controller::Action::await_change()) },
        );
        op.shard_labels::<K>(Some(&selector), |m| Some(key_of(m)));
        identities.insert(op.leadership().identity().to_string());
        replicas.push(Harness::start(op).await);
    }
    let leases: Api<Lease> = Api::namespaced(admin.clone(), &ns);
    eventually("each replica holds one shard", WAIT, || {
        let (leases, id, identities) = (leases.clone(), id.clone(), identities.clone());
        async move {
            let mut holders = BTreeSet::new();
            for shard in 0..2 {
                let lease = leases
                    .get_opt(&format!("{id}-shard-{shard}"))
                    .await
                    .map_err(|e| e.to_string())?;
                if let Some(h) = lease.and_then(|l| l.spec?.holder_identity) {
                    holders.insert(h);
                }
            }
            let members = leases
                .list(&ListParams::default().labels(&format!("{RING_LABEL}={id}")))
                .await
                .map_err(|e| e.to_string())?
                .items
                .len();
            if holders == identities && members == 2 {
                Ok(())
            } else {
                Err(format!("shard holders {holders:?}, {members} ring members"))
            }
        }
    })
    .await
    .map_err(|e| anyhow!("{e}\nlast log lines:\n{}", log_tail(12)))?;
    let forbidden: Vec<String> = forbidden_lines(&user)
        .into_iter()
        .filter(|l| l.contains("lease"))
        .collect();
    ensure!(forbidden.is_empty(), "refused: {forbidden:#?}");

    // Stopped gracefully, they release their shards and leave the ring.
    for r in replicas {
        tokio::time::timeout(WAIT, r.stop())
            .await
            .context("operator did not stop")?
            .context("operator run failed")?;
    }
    for shard in 0..2 {
        let holder = leases
            .get(&format!("{id}-shard-{shard}"))
            .await?
            .spec
            .and_then(|s| s.holder_identity)
            .unwrap_or_default();
        ensure!(holder.is_empty(), "shard {shard} still held by {holder}");
    }
    let left = leases
        .list(&ListParams::default().labels(&format!("{RING_LABEL}={id}")))
        .await?
        .items;
    ensure!(left.is_empty(), "{} member Leases left", left.len());
    Ok(())
}
