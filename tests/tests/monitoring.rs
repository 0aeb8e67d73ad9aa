//! `deploy/monitoring` with a real Prometheus and promtool (Debian's, or built from Go modules
//! by testenv where it is not installed): the alert rules pass their `promtool test rules`
//! cases, every alert with a case where it fires; every metric the rules and the Grafana
//! dashboard read is one the operators, the instance managers or the pooler agents export; and
//! a Prometheus server scrapes a running tenant-operator, loads the rules without error
//! and sees a Tenant's gauge.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use kube::api::{Api, PostParams};
use serde_json::{Value, json};
use steward_core::Operator;
use steward_core::cli::CommonArgs;
use steward_testenv::harness::{self, Harness};
use steward_testenv::{Process, eventually, free_port, http_get, workspace_root};
use tenant_operator::Tenant;

fn monitoring() -> PathBuf {
    workspace_root().join("deploy/monitoring")
}

/// `spec` of deploy/monitoring/prometheusrule.yaml: a Prometheus rule file.
fn rule_file() -> String {
    let text = std::fs::read_to_string(monitoring().join("prometheusrule.yaml")).expect("read");
    let rule: Value = serde_yaml::from_str(&text).expect("YAML");
    serde_yaml::to_string(&rule["spec"]).expect("rules as YAML")
}

/// A temp directory with `alerts.yaml` (the rule file) and the promtool tests.
fn rules_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::write(dir.path().join("alerts.yaml"), rule_file()).expect("write rules");
    std::fs::copy(
        monitoring().join("alerts_test.yaml"),
        dir.path().join("alerts_test.yaml"),
    )
    .expect("copy tests");
    dir
}

/// The alerts `deploy/monitoring/prometheusrule.yaml` defines (`- alert:` entries).
fn alert_count() -> usize {
    let path = steward_testenv::workspace_root().join("deploy/monitoring/prometheusrule.yaml");
    std::fs::read_to_string(&path)
        .expect("prometheusrule.yaml")
        .lines()
        .filter(|l| l.trim_start().starts_with("- alert:"))
        .count()
}

/// The rule groups `deploy/monitoring/prometheusrule.yaml` defines.
fn group_count() -> usize {
    let rules: Value = serde_yaml::from_str(&rule_file()).expect("rules");
    rules["groups"].as_array().expect("groups").len()
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().expect("run");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{cmd:?} failed:\n{text}");
    text
}

#[test]
fn alert_rules_pass_their_promtool_tests() {
    let (_, promtool) = steward_testenv::binaries::prometheus().expect("build Prometheus");
    let dir = rules_dir();
    let checked = run(Command::new(&promtool)
        .args(["check", "rules", "alerts.yaml"])
        .current_dir(dir.path()));
    assert!(
        checked.contains(&format!("SUCCESS: {} rules found", alert_count())),
        "{checked}"
    );
    run(Command::new(&promtool)
        .args(["test", "rules", "alerts_test.yaml"])
        .current_dir(dir.path()));
}

/// Every alert has a promtool case where it fires (`exp_alerts` not empty), with its labels
/// and annotations.
#[test]
fn every_alert_has_a_promtool_case_where_it_fires() {
    let rules: Value = serde_yaml::from_str(&rule_file()).expect("rules");
    let alerts: BTreeSet<String> = rules["groups"]
        .as_array()
        .expect("groups")
        .iter()
        .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
        .filter_map(|r| r["alert"].as_str().map(String::from))
        .collect();
    let text = std::fs::read_to_string(monitoring().join("alerts_test.yaml")).expect("read");
    let tests: Value = serde_yaml::from_str(&text).expect("YAML");
    let firing: BTreeSet<String> = tests["tests"]
        .as_array()
        .expect("tests")
        .iter()
        .flat_map(|t| t["alert_rule_test"].as_array().cloned().unwrap_or_default())
        .filter(|case| {
            case["exp_alerts"]
                .as_array()
                .is_some_and(|alerts| !alerts.is_empty())
        })
        .filter_map(|case| case["alertname"].as_str().map(String::from))
        .collect();
    let untested: Vec<&String> = alerts.difference(&firing).collect();
    assert!(untested.is_empty(), "no promtool case fires {untested:?}");
}

/// The metric names an expression reads (those of Steward's families, and `up`).
fn metric_names(expr: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let is_ident = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    let mut rest = expr;
    while let Some(start) = rest.find(|c: char| c.is_ascii_alphabetic() || c == '_') {
        let tail = &rest[start..];
        let end = tail.find(|c| !is_ident(c)).unwrap_or(tail.len());
        let word = &tail[..end];
        let preceded_by_ident = start > 0 && rest[..start].ends_with(is_ident);
        if !preceded_by_ident
            && [
                "controller_runtime_",
                "steward_",
                "leader_election_",
                "tenant_operator_",
            ]
            .iter()
            .any(|p| word.starts_with(p))
        {
            names.insert(word.to_string());
        }
        rest = &tail[end..];
    }
    names
}

/// Whether a sample name belongs to one of `families` (`x_total` of counter `x`, `x_bucket` of
/// histogram `x`).
fn exported(families: &BTreeSet<String>, name: &str) -> bool {
    families.contains(name)
        || ["_total", "_bucket", "_sum", "_count"]
            .iter()
            .any(|suffix| {
                name.strip_suffix(suffix)
                    .is_some_and(|f| families.contains(f))
            })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_the_rules_and_the_dashboard_read_is_exported() {
    let cp = steward_testenv::shared().await.expect("control plane");
    // What the operators export once registered (every family, with samples or not yet).
    let mut families = BTreeSet::new();
    for entry in steward_operators::all() {
        let mut op = Operator::with_config(entry.name, harness::test_args(), cp.config().clone())
            .expect("operator");
        (entry.register)(&mut op, &[]).expect("register");
        families.extend(op.metrics().families());
    }
    // What each PostgreSQL pod's instance manager serves: its built-in queries' metrics, and
    // those it computes itself (crates/pg-instance/src/metrics.rs).
    for query in database_operator::crd::monitoring::builtin() {
        families.extend(query.metrics.iter().map(|m| query.metric_name(m)));
    }
    families.extend(
        [
            "steward_pg_up",
            "steward_pg_member_lag_bytes",
            "steward_pg_query_error",
            "steward_pg_query_duration_seconds",
            "steward_pg_queries_file_error",
        ]
        .map(String::from),
    );
    // What each pooler agent serves (crates/pooler/src/metrics.rs).
    families.extend(
        [
            "steward_pgbouncer_clients_active",
            "steward_pgbouncer_clients_waiting",
            "steward_pgbouncer_servers_active",
            "steward_pgbouncer_servers_idle",
            "steward_pgbouncer_servers_used",
            "steward_pgbouncer_max_wait_seconds",
            "steward_pgbouncer_transactions_total",
            "steward_pgbouncer_queries_total",
            "steward_pgbouncer_wait_seconds_total",
            "steward_pooler_up",
            "steward_pooler_paused",
            "steward_pooler_pauses_total",
            "steward_pooler_pause_seconds_total",
            "steward_pooler_last_pause_seconds",
            "steward_pooler_primary_changes_total",
        ]
        .map(String::from),
    );

    let rules: Value = serde_yaml::from_str(&rule_file()).expect("rules");
    let mut exprs: Vec<(String, String)> = Vec::new();
    for group in rules["groups"].as_array().expect("groups") {
        for rule in group["rules"].as_array().expect("rules") {
            exprs.push((
                format!("alert {}", rule["alert"].as_str().unwrap_or_default()),
                rule["expr"].as_str().unwrap_or_default().to_string(),
            ));
        }
    }
    let dashboard: Value = serde_json::from_str(
        &std::fs::read_to_string(monitoring().join("dashboard.json")).expect("dashboard"),
    )
    .expect("the dashboard is JSON");
    for panel in dashboard["panels"].as_array().expect("panels") {
        if panel["type"] == "row" {
            continue;
        }
        for target in panel["targets"].as_array().expect("targets") {
            exprs.push((
                format!("panel {}", panel["title"].as_str().unwrap_or_default()),
                target["expr"].as_str().unwrap_or_default().to_string(),
            ));
        }
    }
    assert!(exprs.len() > 20, "{} expressions", exprs.len());
    let mut missing = Vec::new();
    for (what, expr) in &exprs {
        let names = metric_names(expr);
        assert!(
            !names.is_empty() || expr.contains("up{"),
            "{what} reads no Steward metric: {expr}"
        );
        missing.extend(
            names
                .into_iter()
                .filter(|n| !exported(&families, n))
                .map(|n| format!("{what}: {n}")),
        );
    }
    assert!(
        missing.is_empty(),
        "not exported by any operator: {missing:#?}"
    );

    // The kustomization renders: ServiceMonitor, PodMonitors (PostgreSQL and pooler pods),
    // PrometheusRule, the dashboard's ConfigMap.
    let objects = cp
        .kustomize(&monitoring())
        .expect("kustomize deploy/monitoring");
    let kinds: BTreeSet<&str> = objects.iter().filter_map(|o| o["kind"].as_str()).collect();
    assert_eq!(
        kinds,
        BTreeSet::from([
            "ConfigMap",
            "PodMonitor",
            "PrometheusRule",
            "ServiceMonitor"
        ])
    );
    let pod_monitors: BTreeSet<&str> = objects
        .iter()
        .filter(|o| o["kind"] == "PodMonitor")
        .filter_map(|o| o["metadata"]["name"].as_str())
        .collect();
    assert_eq!(
        pod_monitors,
        BTreeSet::from(["steward-pooler", "steward-postgres"])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deploy_monitoring_applies_against_the_prometheus_operator_crds() {
    let crds =
        steward_testenv::binaries::prometheus_operator_crds().expect("Prometheus Operator CRDs");
    let cp = steward_testenv::shared().await.expect("control plane");
    // Only the kinds deploy/monitoring uses (the others are large and unused here).
    let dir = tempfile::tempdir().expect("temp dir");
    for plural in ["servicemonitors", "podmonitors", "prometheusrules"] {
        let file = format!("monitoring.coreos.com_{plural}.yaml");
        std::fs::copy(crds.join(&file), dir.path().join(&file)).expect("copy CRD");
    }
    cp.install_crds(dir.path()).await.expect("install the CRDs");

    // What `kubectl apply --server-side -k deploy/monitoring -n <ns>` does: server-side apply
    // checks every field against the CRDs' schemas (an unknown field is an error).
    let ns = cp.namespace("monitoring").await.expect("namespace");
    let client = cp.client().expect("client");
    let objects = cp
        .kustomize(&monitoring())
        .expect("kustomize deploy/monitoring");
    for obj in &objects {
        let applied =
            steward_testenv::manifests::apply(&client, obj, Some(&ns), "monitoring-test", false)
                .await
                .unwrap_or_else(|e| panic!("{e}"));
        let applied = serde_json::to_value(applied).expect("JSON");
        match obj["kind"].as_str() {
            Some("PrometheusRule") => {
                let groups = applied["spec"]["groups"].as_array().expect("groups");
                let rules: usize = groups
                    .iter()
                    .map(|g| g["rules"].as_array().map_or(0, Vec::len))
                    .sum();
                assert_eq!(
                    (groups.len(), rules),
                    (group_count(), alert_count()),
                    "the rules as stored"
                );
            }
            Some("ServiceMonitor") => {
                assert_eq!(applied["spec"]["endpoints"][0]["honorLabels"], true);
                assert_eq!(applied["spec"]["endpoints"][0]["port"], "metrics");
            }
            Some("PodMonitor") => {
                // Each selects its pods by a label (Exists) and takes `cluster` from it.
                let name = applied["metadata"]["name"].as_str().unwrap_or_default();
                let (label, port) = match name {
                    "steward-postgres" => {
                        (database_operator::crd::contract::CLUSTER_LABEL, "instance")
                    }
                    "steward-pooler" => (database_operator::crd::contract::pooler::LABEL, "pooler"),
                    other => panic!("unexpected PodMonitor {other}"),
                };
                let selector = &applied["spec"]["selector"]["matchExpressions"][0];
                assert_eq!(
                    (&selector["key"], &selector["operator"]),
                    (&json!(label), &json!("Exists")),
                    "{name}"
                );
                let endpoint = &applied["spec"]["podMetricsEndpoints"][0];
                assert_eq!(endpoint["port"], port, "{name}");
                assert_eq!(endpoint["path"], "/metrics", "{name}");
                assert_eq!(endpoint["relabelings"][0]["replacement"], name);
                let meta_label = format!(
                    "__meta_kubernetes_pod_label_{}",
                    label.replace(|c: char| !c.is_ascii_alphanumeric(), "_")
                );
                assert_eq!(
                    endpoint["relabelings"][1]["sourceLabels"],
                    json!([meta_label]),
                    "{name}"
                );
                assert_eq!(
                    endpoint["relabelings"][1]["targetLabel"], "cluster",
                    "{name}"
                );
            }
            Some("ConfigMap") => {
                let dashboard = applied["data"]["steward.json"].as_str().expect("dashboard");
                let _: Value = serde_json::from_str(dashboard).expect("the dashboard is JSON");
                assert_eq!(applied["metadata"]["labels"]["grafana_dashboard"], "1");
            }
            other => panic!("unexpected {other:?} in deploy/monitoring"),
        }
    }
}

/// A Prometheus server, killed on drop.
struct Prometheus {
    process: Process,
    addr: std::net::SocketAddr,
    /// The config, rules and data; removed on drop.
    _dir: tempfile::TempDir,
}

impl Prometheus {
    fn start(bin: &Path, scrape: &str, operator: &str) -> Self {
        let dir = rules_dir();
        let port = free_port().expect("port");
        let config = json!({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            // Relative to the config file's directory.
            "rule_files": ["alerts.yaml"],
            "scrape_configs": [{
                "job_name": "steward",
                "static_configs": [{"targets": [scrape], "labels": {"operator": operator}}],
            }],
        });
        let config_path = dir.path().join("prometheus.yml");
        std::fs::write(
            &config_path,
            serde_yaml::to_string(&config).expect("config"),
        )
        .expect("write config");
        let process = Process::spawn(
            "prometheus",
            bin,
            &[
                format!("--config.file={}", config_path.display()),
                format!("--storage.tsdb.path={}", dir.path().join("data").display()),
                format!("--web.listen-address=127.0.0.1:{port}"),
            ],
            dir.path().join("prometheus.log"),
        )
        .expect("start prometheus");
        Self {
            process,
            addr: ([127, 0, 0, 1], port).into(),
            _dir: dir,
        }
    }

    async fn api(&self, path: &str) -> Result<Value, String> {
        let (status, body) = http_get(self.addr, path).await.map_err(|e| e.to_string())?;
        if status != 200 {
            return Err(format!("GET {path}: {status} {body}"));
        }
        serde_json::from_str(&body).map_err(|e| format!("GET {path}: {e}: {body}"))
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.process.log).unwrap_or_default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_scrapes_an_operator_and_loads_the_rules() {
    let (prometheus, _) = steward_testenv::binaries::prometheus().expect("build Prometheus");
    let cp = steward_testenv::shared().await.expect("control plane");
    cp.apply_crd(&<Tenant as kube::CustomResourceExt>::crd())
        .await
        .expect("Tenant CRD");
    let id = format!("mon{}", std::process::id());
    let metrics_port = free_port().expect("port");
    let args = CommonArgs {
        metrics_bind_address: format!("127.0.0.1:{metrics_port}"),
        ..harness::test_args()
    };
    let op = steward_integration_tests::tenant_operator(args, cp.config().clone(), &id)
        .expect("tenant-operator");
    let running = Harness::start(op).await;

    let t = steward_integration_tests::tenant(&id);
    let tenant = t.metadata.name.clone().unwrap_or_default();
    let tenants: Api<Tenant> = Api::all(cp.client().expect("client"));
    tenants
        .create(&PostParams::default(), &t)
        .await
        .expect("create tenant");

    let server = Prometheus::start(
        &prometheus,
        &format!("127.0.0.1:{metrics_port}"),
        tenant_operator::NAME,
    );
    let wait = Duration::from_secs(90);
    let query =
        format!("/api/v1/query?query=steward_tenant_namespaces%7Btenant%3D%22{tenant}%22%7D");
    let sample = eventually("Prometheus has the Tenant's gauge", wait, || {
        let (server, query) = (&server, query.clone());
        async move {
            let body = server.api(&query).await?;
            let result = &body["data"]["result"][0];
            if result["value"][1] == "1" {
                Ok(result.clone())
            } else {
                Err(body.to_string())
            }
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\nprometheus log:\n{}", server.log()));
    assert_eq!(sample["metric"]["job"], "steward");
    assert_eq!(sample["metric"]["operator"], tenant_operator::NAME);

    // Every group loaded, and every rule evaluated without error against the real series.
    let rules = eventually("the rules evaluated", wait, || {
        let server = &server;
        async move {
            let body = server.api("/api/v1/rules").await?;
            let groups = body["data"]["groups"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            let rules: Vec<Value> = groups
                .iter()
                .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
                .collect();
            if groups.len() == group_count() && rules.iter().all(|r| r["health"] == "ok") {
                Ok(rules)
            } else {
                Err(body.to_string())
            }
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\nprometheus log:\n{}", server.log()));
    assert_eq!(rules.len(), alert_count());
    drop(server);
    running.stop().await.expect("operator stops");
}
