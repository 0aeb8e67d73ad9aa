//! Traces reach a real OTLP receiver: an OpenTelemetry Collector (OTLP/HTTP receiver, file
//! exporter), built from Go modules by testenv. The tenant-operator runs in-process with the
//! subscriber `steward_core::telemetry::init` installs for `--otlp-endpoint`, as its binary
//! does; a Tenant's reconcile arrives as a `reconcile` span naming the controller, the
//! object and the result, under kube-runtime's `reconciling object` span (which says why it
//! ran) and with its Kubernetes API requests as child spans. A controller
//! whose reconcile fails shows the error on the span with an error status.
//!
//! One test per binary: the tracing subscriber is global to the process.

#![allow(clippy::unwrap_used)] // test helpers: a failed call is a failed test

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, ListParams, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::watcher;
use serde_json::{Value, json};
use steward_core::cli::CommonArgs;
use steward_core::{Context, Controller, ReconcileError};
use steward_testenv::harness::{self, Harness};
use steward_testenv::{Process, eventually, free_port};
use tenant_operator::Tenant;

/// An OpenTelemetry Collector writing what it receives to `traces.jsonl`; killed on drop.
struct Collector {
    process: Process,
    endpoint: String,
    dir: tempfile::TempDir,
}

impl Collector {
    fn start(bin: &Path) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let port = free_port().unwrap();
        let config = json!({
            "receivers": {"otlp": {"protocols": {"http": {"endpoint": format!("127.0.0.1:{port}")}}}},
            "exporters": {"file": {"path": dir.path().join("traces.jsonl"), "flush_interval": "100ms"}},
            "service": {
                "telemetry": {"metrics": {"level": "none"}},
                "pipelines": {"traces": {"receivers": ["otlp"], "exporters": ["file"]}},
            },
        });
        let config_path = dir.path().join("config.yaml");
        std::fs::write(&config_path, serde_yaml::to_string(&config).unwrap()).unwrap();
        let process = Process::spawn(
            "otelcol",
            bin,
            &["--config".into(), config_path.display().to_string()],
            dir.path().join("collector.log"),
        )
        .expect("start the collector");
        Self {
            process,
            endpoint: format!("http://127.0.0.1:{port}"),
            dir,
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.process.log).unwrap_or_default()
    }

    /// Every span received so far, each with its resource's `service.name`.
    fn spans(&self) -> Vec<Span> {
        let text = std::fs::read_to_string(self.path("traces.jsonl")).unwrap_or_default();
        let mut spans = Vec::new();
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let Ok(request) = serde_json::from_str::<Value>(line) else {
                continue; // a line still being written
            };
            for resource in request["resourceSpans"].as_array().into_iter().flatten() {
                let service = attribute(&resource["resource"]["attributes"], "service.name");
                for scope in resource["scopeSpans"].as_array().into_iter().flatten() {
                    for span in scope["spans"].as_array().into_iter().flatten() {
                        spans.push(Span {
                            service: service.clone(),
                            raw: span.clone(),
                        });
                    }
                }
            }
        }
        spans
    }
}

/// One received span.
#[derive(Clone, Debug)]
struct Span {
    service: String,
    raw: Value,
}

impl Span {
    fn name(&self) -> &str {
        self.raw["name"].as_str().unwrap_or_default()
    }
    fn attr(&self, key: &str) -> String {
        attribute(&self.raw["attributes"], key)
    }
    fn id(&self) -> &str {
        self.raw["spanId"].as_str().unwrap_or_default()
    }
    fn parent(&self) -> &str {
        self.raw["parentSpanId"].as_str().unwrap_or_default()
    }
    /// OTLP status code: 0 unset, 1 ok, 2 error.
    fn status(&self) -> u64 {
        self.raw["status"]["code"].as_u64().unwrap_or(0)
    }
    fn nanos(&self, field: &str) -> u128 {
        self.raw[field]
            .as_str()
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    }
}

/// An OTLP JSON attribute's value as a string (`stringValue`, `intValue` or `boolValue`).
fn attribute(attributes: &Value, key: &str) -> String {
    attributes
        .as_array()
        .into_iter()
        .flatten()
        .find(|a| a["key"] == key)
        .map(|a| {
            let v = &a["value"];
            v["stringValue"]
                .as_str()
                .map(str::to_string)
                .or_else(|| v["intValue"].as_str().map(str::to_string))
                .or_else(|| v["intValue"].as_i64().map(|i| i.to_string()))
                .unwrap_or_else(|| v.to_string())
        })
        .unwrap_or_default()
}

#[derive(Debug, thiserror::Error)]
#[error("the ConfigMap asks this reconcile to fail")]
struct AskedToFail;

impl ReconcileError for AskedToFail {
    fn reason(&self) -> &str {
        "AskedToFail"
    }
}

/// Reads the ConfigMap's namespace (an API request inside the reconcile), then fails when
/// the ConfigMap has a `fail` key.
async fn failing_reconcile(
    cm: Arc<ConfigMap>,
    ctx: Arc<Context<()>>,
) -> Result<Action, AskedToFail> {
    let ns = cm.metadata.namespace.clone().unwrap_or_default();
    let maps: Api<ConfigMap> = Api::namespaced(ctx.client.clone(), &ns);
    let _ = maps.list(&ListParams::default().limit(1)).await;
    if cm.data.as_ref().is_some_and(|d| d.contains_key("fail")) {
        return Err(AskedToFail);
    }
    Ok(Action::await_change())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_spans_with_their_api_requests_arrive_at_an_otlp_collector() {
    let bin = steward_testenv::binaries::otelcol().expect("build the collector");
    let collector = Collector::start(&bin);
    let cp = steward_testenv::shared().await.expect("control plane");
    cp.apply_crd(&<Tenant as kube::CustomResourceExt>::crd())
        .await
        .expect("Tenant CRD");
    let ns = cp.namespace("traces").await.expect("namespace");
    let id = format!("trc{}", std::process::id());

    let args = CommonArgs {
        otlp_endpoint: Some(collector.endpoint.clone()),
        ..harness::test_args()
    };
    let telemetry = steward_core::telemetry::init(&args, tenant_operator::NAME).expect("telemetry");
    assert!(telemetry.exporting());
    let mut op = steward_integration_tests::tenant_operator(args, cp.config().clone(), &id)
        .expect("tenant-operator");
    op.controller(
        Controller::new(
            Api::<ConfigMap>::namespaced(op.client(), &ns),
            watcher::Config::default().labels(&format!("steward.dev/test={id}")),
        ),
        (),
        failing_reconcile,
    );
    let running = Harness::start(op).await;

    let t = steward_integration_tests::tenant(&id);
    let tenant = t.metadata.name.clone().unwrap_or_default();
    let tenants: Api<Tenant> = Api::all(cp.client().unwrap());
    tenants
        .create(&PostParams::default(), &t)
        .await
        .expect("create tenant");
    let failing: ConfigMap = serde_json::from_value(json!({
        "metadata": {"name": "fails", "labels": {"steward.dev/test": id}},
        "data": {"fail": "yes"},
    }))
    .unwrap();
    Api::<ConfigMap>::namespaced(cp.client().unwrap(), &ns)
        .create(&PostParams::default(), &failing)
        .await
        .expect("create ConfigMap");

    let wait = Duration::from_secs(90);
    let (reconcile, requests) = eventually("a Tenant reconcile's trace arrives", wait, || {
        let spans = collector.spans();
        let tenant = tenant.clone();
        async move {
            let reconcile = spans
                .iter()
                .find(|s| {
                    s.name() == "reconcile"
                        && s.attr("object") == tenant
                        && s.attr("result") == "success"
                })
                .cloned()
                .ok_or_else(|| {
                    format!(
                        "{} spans, none a successful reconcile of {tenant}",
                        spans.len()
                    )
                })?;
            let requests: Vec<Span> = spans
                .iter()
                .filter(|s| s.parent() == reconcile.id())
                .cloned()
                .collect();
            if requests.is_empty() {
                return Err("the reconcile span has no child spans yet".into());
            }
            Ok((reconcile, requests))
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\ncollector log:\n{}", collector.log()));
    assert_eq!(reconcile.service, tenant_operator::NAME);
    assert!(
        !reconcile.attr("controller").is_empty(),
        "{:?}",
        reconcile.raw
    );
    assert_ne!(reconcile.status(), 2, "{:?}", reconcile.raw);
    let (start, end) = (
        reconcile.nanos("startTimeUnixNano"),
        reconcile.nanos("endTimeUnixNano"),
    );
    assert!(start > 0 && end >= start, "{:?}", reconcile.raw);
    for request in &requests {
        assert_eq!(
            request.name(),
            request.attr("http.request.method"),
            "{:?}",
            request.raw
        );
        assert!(
            request.attr("url.path").starts_with("/api"),
            "{:?}",
            request.raw
        );
        assert!(
            !request.attr("http.response.status_code").is_empty(),
            "{:?}",
            request.raw
        );
        assert!(
            request.raw["traceId"] == reconcile.raw["traceId"],
            "{:?}",
            request.raw
        );
        assert!(
            request.nanos("startTimeUnixNano") >= start && request.nanos("endTimeUnixNano") <= end,
            "a request span lies within its reconcile: {:?}",
            request.raw
        );
    }

    let key = format!("{ns}/fails");
    let failed = eventually("a failed reconcile's span arrives", wait, || {
        let spans = collector.spans();
        let key = key.clone();
        async move {
            spans
                .into_iter()
                .find(|s| {
                    s.name() == "reconcile"
                        && s.attr("object") == key
                        && s.attr("result") == "error"
                })
                .ok_or_else(|| format!("no failed reconcile of {key} yet"))
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\ncollector log:\n{}", collector.log()));
    assert_eq!(failed.status(), 2, "error status: {:?}", failed.raw);
    assert!(
        failed.attr("error").contains("asks this reconcile to fail"),
        "{:?}",
        failed.raw
    );
    // Each reconcile span sits under kube-runtime's `reconciling object` span, which says why
    // it ran; watches and Lease traffic outside a reconcile make no spans of their own.
    let spans = collector.spans();
    let parent = spans
        .iter()
        .find(|s| s.id() == reconcile.parent())
        .unwrap_or_else(|| panic!("the reconcile's parent span arrived: {:?}", reconcile.raw));
    assert_eq!(parent.name(), "reconciling object", "{:?}", parent.raw);
    assert!(
        parent.attr("object.ref").contains(&tenant),
        "{:?}",
        parent.raw
    );
    assert!(!parent.attr("object.reason").is_empty(), "{:?}", parent.raw);
    let orphans: Vec<&Span> = spans
        .iter()
        .filter(|s| s.parent().is_empty() && s.name() != "reconciling object")
        .collect();
    assert!(
        orphans.is_empty(),
        "root spans that are not reconciles: {orphans:?}"
    );

    running.stop().await.expect("stop");
    tokio::task::spawn_blocking(move || telemetry.shutdown())
        .await
        .unwrap();
}
