//! The HTTP endpoints every operator serves: `/metrics`, `/healthz`, `/readyz`.
//!
//! `/healthz` answers 200 while the process runs its loops. `/readyz` answers 200 once every
//! controller's caches have synced (leader or not: a follower with warm caches is ready to
//! take over), 503 before.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use tokio_util::sync::CancellationToken;

use crate::Error;
use crate::metrics::Metrics;

/// Readiness shared between controllers and the HTTP server.
#[derive(Clone, Default)]
pub struct Health {
    inner: Arc<HealthInner>,
}

#[derive(Default)]
struct HealthInner {
    pending: AtomicUsize,
    registered: AtomicBool,
    alive: AtomicBool,
}

impl Health {
    pub fn new() -> Self {
        let h = Self::default();
        h.inner.alive.store(true, Ordering::SeqCst);
        h
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

    /// Marks the process as not alive (`/healthz` then answers 503).
    pub fn set_dead(&self) {
        self.inner.alive.store(false, Ordering::SeqCst);
    }

    pub fn is_alive(&self) -> bool {
        self.inner.alive.load(Ordering::SeqCst)
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

async fn metrics_handler(State(state): State<AppState>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.metrics.encode(),
    )
}

async fn healthz(State(state): State<AppState>) -> impl IntoResponse {
    if state.health.is_alive() {
        (StatusCode::OK, "ok")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not alive")
    }
}

async fn readyz(State(state): State<AppState>) -> impl IntoResponse {
    if state.health.is_ready() {
        (StatusCode::OK, "ok")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "caches not synced")
    }
}
