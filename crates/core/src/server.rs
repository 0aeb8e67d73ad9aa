//! The HTTP endpoints every operator serves: `/metrics`, `/healthz`, `/readyz`.
//!
//! `/healthz` answers 200 while the process does its work, 503 with the reason when it does
//! not: a controller task ended, a leading controller has had work queued without starting a
//! reconcile for longer than `--stall-timeout`, or one of its watches has failed for that long.
//! The kubelet then restarts the pod and a standby takes over.
//!
//! `/readyz` answers 200 once every controller's caches have synced (leader or not: a
//! follower with warm caches is ready to take over) and while every watch is current (its last
//! event was not an error), 503 with the reason otherwise.
//!
//! A pod's agent that is not an operator (the PostgreSQL instance manager, the pooler agent)
//! serves the same three paths with its own answers: [`probes`].

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use tokio_util::sync::CancellationToken;

use crate::Error;
use crate::controller::Liveness;
use crate::metrics::Metrics;

/// Readiness shared between controllers and the HTTP server.
#[derive(Clone, Default)]
pub struct Health {
    inner: Arc<HealthInner>,
}

struct HealthInner {
    pending: AtomicUsize,
    registered: AtomicBool,
    alive: AtomicBool,
    dead_reason: Mutex<String>,
    controllers: Mutex<Vec<Arc<dyn Liveness>>>,
    stall_timeout: Mutex<Duration>,
}

impl Default for HealthInner {
    fn default() -> Self {
        Self {
            pending: AtomicUsize::new(0),
            registered: AtomicBool::new(false),
            alive: AtomicBool::new(true),
            dead_reason: Mutex::new(String::new()),
            controllers: Mutex::new(Vec::new()),
            stall_timeout: Mutex::new(Duration::from_secs(60)),
        }
    }
}

impl Health {
    /// Healthy and not ready until the caches report in.
    pub fn new() -> Self {
        Self::default()
    }

    /// How long a controller may have queued work without progress (or a failing watch)
    /// before `/healthz` fails.
    pub fn set_stall_timeout(&self, bound: Duration) {
        *self
            .inner
            .stall_timeout
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = bound;
    }

    pub(crate) fn watch_controller(&self, controller: Arc<dyn Liveness>) {
        self.inner
            .controllers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(controller);
    }

    /// Forgets a controller [`Health::watch_controller`] registered (a shard's term ended).
    pub(crate) fn unwatch_controller(&self, controller: &Arc<dyn Liveness>) {
        self.inner
            .controllers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|c| !Arc::ptr_eq(c, controller));
    }

    fn controllers(&self) -> Vec<Arc<dyn Liveness>> {
        self.inner
            .controllers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// `Ok` while the process does its work, else why not.
    ///
    /// # Errors
    /// The reason `/healthz` fails.
    pub fn liveness(&self) -> Result<(), String> {
        if !self.inner.alive.load(Ordering::SeqCst) {
            let reason = self
                .inner
                .dead_reason
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone();
            return Err(if reason.is_empty() {
                "not alive".into()
            } else {
                reason
            });
        }
        let bound = *self
            .inner
            .stall_timeout
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        self.controllers()
            .iter()
            .try_for_each(|c| c.check(now, bound))
    }

    /// `Ok` when every cache synced and every watch is current, else why not.
    ///
    /// # Errors
    /// The reason `/readyz` fails.
    pub fn readiness(&self) -> Result<(), String> {
        if !self.is_ready() {
            return Err("caches not synced".into());
        }
        match self.controllers().iter().find(|c| !c.watches_current()) {
            Some(c) => Err(format!("controller {}: a watch is failing", c.name())),
            None => Ok(()),
        }
    }

    /// Updates `steward_reconcile_queue_oldest_seconds` for every controller.
    pub(crate) fn export(&self, metrics: &Metrics) {
        let now = Instant::now();
        for c in self.controllers() {
            let age = c.oldest_pending(now).unwrap_or_default();
            metrics
                .queue_oldest
                .get_or_create(&crate::controller::controller_labels(c.name()))
                .set(age.as_secs_f64());
        }
    }

    /// Registers one cache that must sync before `/readyz` says ready; call the returned
    /// function when it has synced.
    pub fn register_cache(&self) -> impl FnOnce() + Send + 'static {
        self.inner.pending.fetch_add(1, Ordering::SeqCst);
        self.inner.registered.store(true, Ordering::SeqCst);
        let inner = self.inner.clone();
        move || {
            inner.pending.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Whether every registered cache has synced (and at least one was registered).
    pub fn is_ready(&self) -> bool {
        self.inner.registered.load(Ordering::SeqCst)
            && self.inner.pending.load(Ordering::SeqCst) == 0
    }

    /// Marks the process as not alive (`/healthz` then answers 503 with `reason`).
    pub fn set_dead(&self, reason: impl Into<String>) {
        *self
            .inner
            .dead_reason
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = reason.into();
        self.inner.alive.store(false, Ordering::SeqCst);
    }

    /// Whether `/healthz` answers 200.
    pub fn is_alive(&self) -> bool {
        self.liveness().is_ok()
    }
}

#[derive(Clone)]
struct AppState {
    metrics: Metrics,
    health: Health,
}

/// Binds `addr` and serves the metrics and probe endpoints until `shutdown`.
/// Returns the bound address (port 0 picks a free one) and the server task.
///
/// # Errors
/// [`Error::Bind`] if the address is taken.
pub async fn serve(
    addr: SocketAddr,
    metrics: Metrics,
    health: Health,
    shutdown: CancellationToken,
) -> Result<(SocketAddr, tokio::task::JoinHandle<()>), Error> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| Error::Bind { addr, source })?;
    let bound = listener
        .local_addr()
        .map_err(|source| Error::Bind { addr, source })?;
    let app = Router::new()
        .route("/metrics", get(metrics_handler))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(AppState { metrics, health });
    let task = tokio::spawn(async move {
        let result = axum::serve(listener, app)
            .with_graceful_shutdown(async move { shutdown.cancelled().await })
            .await;
        if let Err(e) = result {
            tracing::error!(error = %e, "metrics/health server failed");
        }
    });
    Ok((bound, task))
}

/// The routes of a pod's agent: `/healthz` and `/readyz` answer 200 `ok` when `live()` and
/// `ready()` say so, 503 `not ok` otherwise; `/metrics` serves what `render()` renders, in
/// Prometheus' text format.
pub fn probes<L, R, M, F>(live: L, ready: R, render: M) -> Router
where
    L: Fn() -> bool + Clone + Send + Sync + 'static,
    R: Fn() -> bool + Clone + Send + Sync + 'static,
    M: Fn() -> F + Clone + Send + Sync + 'static,
    F: std::future::Future<Output = String> + Send + 'static,
{
    fn answer(ok: bool) -> (StatusCode, &'static str) {
        if ok {
            (StatusCode::OK, "ok\n")
        } else {
            (StatusCode::SERVICE_UNAVAILABLE, "not ok\n")
        }
    }
    Router::new()
        .route(
            "/metrics",
            get(move || {
                let rendered = render();
                async move {
                    (
                        [(
                            header::CONTENT_TYPE,
                            "text/plain; version=0.0.4; charset=utf-8",
                        )],
                        rendered.await,
                    )
                }
            }),
        )
        .route("/healthz", get(move || async move { answer(live()) }))
        .route("/readyz", get(move || async move { answer(ready()) }))
}

async fn metrics_handler(State(state): State<AppState>) -> impl IntoResponse {
    state.health.export(&state.metrics);
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.metrics.encode(),
    )
}

async fn healthz(State(state): State<AppState>) -> impl IntoResponse {
    match state.health.liveness() {
        Ok(()) => (StatusCode::OK, "ok".to_string()),
        Err(why) => {
            tracing::warn!(reason = %why, "/healthz failing");
            (StatusCode::SERVICE_UNAVAILABLE, why)
        }
    }
}

async fn readyz(State(state): State<AppState>) -> impl IntoResponse {
    match state.health.readiness() {
        Ok(()) => (StatusCode::OK, "ok".to_string()),
        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, why),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::http::Request;
    use tower::ServiceExt;

    async fn get_path(app: Router, path: &str) -> (StatusCode, String) {
        let response = app
            .oneshot(Request::get(path).body(Body::empty()).unwrap())
            .await
            .unwrap();
        let status = response.status();
        let body = axum::body::to_bytes(response.into_body(), 1 << 16)
            .await
            .unwrap();
        (status, String::from_utf8(body.to_vec()).unwrap())
    }

    /// An agent's probes answer what its functions say, and `/metrics` what it renders.
    #[tokio::test]
    async fn an_agents_probes_answer_what_it_says() {
        let app = probes(|| true, || false, || async { "up 1\n".to_string() });
        assert_eq!(
            get_path(app.clone(), "/healthz").await,
            (StatusCode::OK, "ok\n".into())
        );
        assert_eq!(
            get_path(app.clone(), "/readyz").await,
            (StatusCode::SERVICE_UNAVAILABLE, "not ok\n".into())
        );
        assert_eq!(
            get_path(app, "/metrics").await,
            (StatusCode::OK, "up 1\n".into())
        );
    }
}
