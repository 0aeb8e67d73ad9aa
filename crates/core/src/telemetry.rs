//! Logs and traces: one tracing subscriber for every operator binary.
//!
//! [`init`] installs it from [`CommonArgs`]: log lines (text or JSON, filtered by
//! `--log-level`/`RUST_LOG`) on stderr and, with `--otlp-endpoint`, the spans exported over
//! OTLP/HTTP (protobuf) to an OpenTelemetry collector, Jaeger, Tempo or anything else that
//! speaks OTLP. Each reconcile is one trace: kube-runtime's `reconciling object` span (the
//! object and why it was reconciled: "object updated", "related object updated: …", "error
//! policy requested retry"), then steward-core's `reconcile` span (controller, object key,
//! result, error; its duration is the reconcile's) whose children are the Kubernetes API
//! requests it made (method, path, status code). The `otel` layer has its own filter (spans at `info`
//! and above), so `--log-level` does not change what is traced.
//!
//! Spans are batched and sent from a background thread; [`Telemetry`] flushes what is left
//! when it is dropped (call [`Telemetry::shutdown`] outside the async runtime).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use http::{Request, Response};

use opentelemetry::KeyValue;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tower::{Layer as TowerLayer, Service};
use tracing::Instrument;
use tracing::field::Empty;
use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

use crate::Error;
use crate::cli::{CommonArgs, LogFormat, traces_url};

/// How long the exporter waits for the collector per batch.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

/// The installed subscriber's trace pipeline, if any: flushes and stops it on drop.
#[must_use = "dropping Telemetry stops exporting traces"]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Whether spans are exported.
    pub fn exporting(&self) -> bool {
        self.provider.is_some()
    }

    /// Sends the spans not yet exported and stops the exporter. Blocking: call it outside the
    /// async runtime (or from a blocking thread).
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        if let Some(provider) = self.provider.take()
            && let Err(e) = provider.shutdown()
        {
            eprintln!("traces: flushing spans at shutdown failed: {e}");
        }
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Installs the process's tracing subscriber for `args`; `service` names this process in
/// traces (`service.name`; `OTEL_SERVICE_NAME` wins when set), and `POD_NAME` (else the host
/// name) is its `service.instance.id`. Call once, first thing in `main`, inside the async
/// runtime; a second call leaves the first subscriber in place.
///
/// # Errors
/// [`Error::Config`] when `--otlp-endpoint` is not a URL or the exporter cannot be built.
pub fn init(args: &CommonArgs, service: &str) -> Result<Telemetry, Error> {
    let provider = args
        .otlp_endpoint
        .as_deref()
        .map(|endpoint| provider(endpoint, service))
        .transpose()?;
    let otel = provider.as_ref().map(|provider| {
        tracing_opentelemetry::layer()
            .with_tracer(provider.tracer(service.to_string()))
            .with_level(true)
            .with_location(false)
            .with_threads(false)
            .with_filter(LevelFilter::INFO)
    });
    let _ = tracing_subscriber::registry()
        .with(logs(args))
        .with(otel)
        .try_init();
    if let Some(endpoint) = &args.otlp_endpoint {
        tracing::info!(%endpoint, "exporting traces over OTLP/HTTP");
    }
    Ok(Telemetry { provider })
}

/// Installs a subscriber that only logs (no traces), as [`init`] does without
/// `--otlp-endpoint`: for tests and examples.
pub fn init_logs(args: &CommonArgs) {
    let _ = tracing_subscriber::registry().with(logs(args)).try_init();
}

/// The log lines on stderr, with their own filter.
fn logs<S>(args: &CommonArgs) -> Box<dyn Layer<S> + Send + Sync>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(&args.log_level));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(ansi);
    match args.log_format {
        LogFormat::Json => fmt.json().with_filter(filter).boxed(),
        LogFormat::Text => fmt.with_filter(filter).boxed(),
    }
}

fn provider(endpoint: &str, service: &str) -> Result<SdkTracerProvider, Error> {
    let url = traces_url(endpoint).map_err(Error::Config)?;
    // reqwest's rustls uses the process's crypto provider; kube uses ring, so does this.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_endpoint(url)
        .with_timeout(EXPORT_TIMEOUT)
        .build()
        .map_err(|e| Error::Config(format!("--otlp-endpoint {endpoint:?}: {e}")))?;
    let instance = std::env::var("POD_NAME")
        .or_else(|_| std::env::var("HOSTNAME"))
        .unwrap_or_else(|_| std::process::id().to_string());
    let mut resource = Resource::builder()
        .with_attribute(KeyValue::new("service.instance.id", instance))
        .with_attribute(KeyValue::new(
            "service.version",
            env!("CARGO_PKG_VERSION").to_string(),
        ));
    if std::env::var_os("OTEL_SERVICE_NAME").is_none() {
        resource = resource.with_service_name(service.to_string());
    }
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource.build())
        .build())
}

/// A tower layer that gives each Kubernetes API request made inside a span (a reconcile) a
/// child span: method, path, status code, and an error status for failures and 4xx/5xx
/// answers. Requests outside any span (watches, Lease renewals) get none, so they add no
/// traces of their own.
#[derive(Clone, Copy, Debug, Default)]
pub struct RequestSpans;

impl<S> TowerLayer<S> for RequestSpans {
    type Service = SpannedRequests<S>;

    fn layer(&self, inner: S) -> Self::Service {
        SpannedRequests { inner }
    }
}

/// The service [`RequestSpans`] wraps.
#[derive(Clone, Debug)]
pub struct SpannedRequests<S> {
    inner: S,
}

impl<S, B, RB> Service<Request<B>> for SpannedRequests<S>
where
    S: Service<Request<B>, Response = Response<RB>>,
    S::Error: std::fmt::Display,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        if tracing::Span::current().is_none() {
            return Box::pin(self.inner.call(req));
        }
        let span = tracing::info_span!(
            "kubernetes request",
            otel.name = %req.method(),
            otel.kind = "client",
            http.request.method = %req.method(),
            url.path = %req.uri().path(),
            url.query = req.uri().query().unwrap_or_default(),
            http.response.status_code = Empty,
            otel.status_code = Empty,
            error = Empty,
        );
        let response = self.inner.call(req);
        let recorded = span.clone();
        Box::pin(
            async move {
                let result = response.await;
                match &result {
                    Ok(answer) => {
                        let status = answer.status();
                        recorded.record("http.response.status_code", status.as_u16());
                        if status.is_client_error() || status.is_server_error() {
                            recorded.record("otel.status_code", "ERROR");
                        }
                    }
                    Err(e) => {
                        recorded.record("otel.status_code", "ERROR");
                        recorded.record("error", tracing::field::display(e));
                    }
                }
                result
            }
            .instrument(span),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_traces_url_is_the_base_url_with_the_signal_path() {
        assert_eq!(
            traces_url("http://otel-collector:4318").ok().as_deref(),
            Some("http://otel-collector:4318/v1/traces")
        );
        assert_eq!(
            traces_url("https://otlp.example.com/").ok().as_deref(),
            Some("https://otlp.example.com/v1/traces")
        );
    }

    #[test]
    fn an_endpoint_that_is_not_an_http_url_is_refused_naming_the_flag() {
        for bad in [
            "otel-collector:4318",
            "grpc://collector:4317",
            "",
            "http://",
        ] {
            let err = traces_url(bad)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(err.contains("--otlp-endpoint"), "{bad:?}: {err}");
        }
    }
}
