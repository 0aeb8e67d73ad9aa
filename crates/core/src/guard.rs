//! A client whose writes are sent, and complete, only while this process leads.
//!
//! Start with [`client`]. Every write a reconciler makes goes through it, so a leader that
//! lost its Lease, or was paused past its renew deadline, cannot write, whatever the
//! reconcile code does. A write (POST, PUT, PATCH, DELETE) is fenced three times:
//!
//! 1. **When it is dispatched**: refused unless [`Leadership::guard`] passes.
//! 2. **When its bytes are sent**: the request body checks [`Leadership::guard`] again when
//!    the connection pulls it to write it to the socket. A request that waited for a
//!    connection, a TLS handshake or a paused process is never sent once leadership lapsed;
//!    the API server sees a request without its body and does nothing.
//! 3. **Until it completes**: the caller gets [`Unconfirmed`] as soon as leadership lapses
//!    with no answer yet (the last renewal plus the renew deadline, on the monotonic clock,
//!    re-evaluated after every renewal); the request is dropped, which closes its connection.
//!
//! # What this guarantees, and what it cannot
//! A write whose answer this process received was committed before its leadership lapsed,
//! so before any other candidate could take the Lease over (they wait the longer
//! `lease_duration` from having read our last renewal). A write abandoned with
//! [`Unconfirmed`] may or may not have been applied: treat it as failed and decide again
//! after re-acquiring.
//!
//! The last window is the network itself: bytes handed to the kernel before the lapse can
//! still reach the API server later, and the API server has no fencing tokens to refuse
//! them. `lease_duration - renew_deadline` (5 s by default) is the delay that is tolerated.
//! Past it, only a precondition makes the server refuse a stale write: status writes carry
//! the resourceVersion they were computed from (see [`crate::status`]), so a newer leader's
//! write in between makes the stale one fail with 409 Conflict. Writes of desired child
//! state by server-side apply carry none: a late one is a stale desired state that the new
//! leader's next reconcile of the owner puts right.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request};
use hyper_timeout::TimeoutConnector;
use hyper_util::client::legacy::Client as HttpClient;
use hyper_util::rt::TokioExecutor;
use kube::client::{Body, ClientBuilder, ConfigExt};
use tokio::time::{Instant, Sleep};
use tower::{BoxError, Layer, Service, ServiceBuilder};

use crate::Error;
use crate::leader::{Leadership, NotLeader};

/// Builds a leader-guarded client from `config`: reads pass freely, writes are fenced as the
/// module documentation describes.
///
/// The stack is kube's default one (base URI, retries, authentication, extra headers, rustls
/// with the configured timeouts) around a hyper client whose request bodies are fenced, plus
/// [`crate::telemetry::RequestSpans`]: a span for each request made inside a reconcile
/// (kube's own tracing layer would trace watches and Lease renewals too).
///
/// # Errors
/// [`Error::Config`] when the client cannot be built, or `config` names a proxy (not
/// supported by the guarded client).
pub fn client(config: kube::Config, leadership: Leadership) -> Result<kube::Client, Error> {
    let config_error = |e: kube::Error| Error::Config(e.to_string());
    if let Some(proxy) = &config.proxy_url {
        return Err(Error::Config(format!(
            "the leader-guarded client does not support proxies ({proxy})"
        )));
    }
    let mut connector =
        TimeoutConnector::new(config.rustls_https_connector().map_err(config_error)?);
    connector.set_connect_timeout(config.connect_timeout);
    connector.set_read_timeout(config.read_timeout);
    connector.set_write_timeout(config.write_timeout);
    connector.set_reset_reader_on_write(config.reset_reader_on_write);
    let http: HttpClient<_, Fenced> = HttpClient::builder(TokioExecutor::new()).build(connector);

    let fence = leadership.clone();
    let send = tower::service_fn(move |req: Request<Body>| {
        let fence = is_write(req.method()).then(|| fence.clone());
        http.request(req.map(|body| Fenced { body, fence }))
    });
    let retry = config
        .default_retry
        .then(|| tower::retry::RetryLayer::new(kube::client::retry::RetryPolicy::server_retry()));
    let service = ServiceBuilder::new()
        .layer(crate::telemetry::RequestSpans)
        .layer(GuardLayer { leadership })
        .layer(config.base_uri_layer())
        .option_layer(retry)
        .option_layer(config.auth_layer().map_err(config_error)?)
        .layer(config.extra_headers_layer().map_err(config_error)?)
        .map_err(BoxError::from)
        .service(send);
    Ok(ClientBuilder::new(service, config.default_namespace).build())
}

/// A write abandoned because leadership lapsed before its answer arrived.
#[derive(Debug, thiserror::Error)]
#[error(
    "write abandoned after {in_flight:?} in flight because leadership lapsed; it may or may not have been applied"
)]
pub struct Unconfirmed {
    /// How long the write had been in flight.
    pub in_flight: Duration,
    /// Why this process may no longer write.
    #[source]
    pub reason: NotLeader,
}

fn is_write(method: &Method) -> bool {
    matches!(
        *method,
        Method::POST | Method::PUT | Method::PATCH | Method::DELETE
    )
}

#[derive(Clone)]
struct GuardLayer {
    leadership: Leadership,
}

impl<S> Layer<S> for GuardLayer {
    type Service = Guard<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Guard {
            inner,
            leadership: self.leadership.clone(),
        }
    }
}

#[derive(Clone)]
struct Guard<S> {
    inner: S,
    leadership: Leadership,
}

impl<S, B> Service<Request<B>> for Guard<S>
where
    S: Service<Request<B>>,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        if !is_write(req.method()) {
            let fut = self.inner.call(req);
            return Box::pin(async move { fut.await.map_err(Into::into) });
        }
        if let Err(e) = self.leadership.guard() {
            let err: BoxError = Box::new(e);
            return Box::pin(async move { Err(err) });
        }
        Box::pin(InFlight {
            request: Box::pin(self.inner.call(req)),
            leadership: self.leadership.clone(),
            started: Instant::now(),
            timer: None,
        })
    }
}

/// A write in flight: resolves with its answer, or with [`Unconfirmed`] once leadership
/// lapses. Leadership is checked *before* the request is polled, so a process that wakes
/// from a pause abandons the write before it can make progress.
struct InFlight<F> {
    request: Pin<Box<F>>,
    leadership: Leadership,
    started: Instant,
    /// Wakes this future when leadership would lapse without another renewal.
    timer: Option<Pin<Box<Sleep>>>,
}

impl<F, T, E> Future for InFlight<F>
where
    F: Future<Output = Result<T, E>>,
    E: Into<BoxError>,
{
    type Output = Result<T, BoxError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let deadline = match self.leadership.deadline() {
            Ok(deadline) => deadline,
            Err(reason) => {
                return Poll::Ready(Err(Box::new(Unconfirmed {
                    in_flight: self.started.elapsed(),
                    reason,
                })));
            }
        };
        if let Poll::Ready(out) = self.request.as_mut().poll(cx) {
            return Poll::Ready(out.map_err(Into::into));
        }
        if let Some(deadline) = deadline {
            // Re-armed at the latest deadline: each renewal moves it.
            match &mut self.timer {
                Some(timer) if timer.deadline() == deadline => {}
                Some(timer) => timer.as_mut().reset(deadline),
                None => self.timer = Some(Box::pin(tokio::time::sleep_until(deadline))),
            }
            if let Some(timer) = &mut self.timer
                && timer.as_mut().poll(cx).is_ready()
            {
                // The deadline passed: the next poll reports it (or sees a renewal).
                cx.waker().wake_by_ref();
            }
        }
        Poll::Pending
    }
}

/// A request body that releases its bytes only while `fence` (for writes) may write.
struct Fenced {
    body: Body,
    fence: Option<Leadership>,
}

impl http_body::Body for Fenced {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, BoxError>>> {
        if let Some(fence) = &self.fence
            && let Err(e) = fence.guard()
        {
            return Poll::Ready(Some(Err(Box::new(e))));
        }
        let frame = ready!(Pin::new(&mut self.body).poll_frame(cx));
        Poll::Ready(frame.map(|f| f.map_err(Into::into)))
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use http_body::Body as _;
    use tokio::time::Instant;

    use super::*;
    use crate::LeaseConfig;

    fn leading(renew_deadline: Duration) -> Leadership {
        let mut config = LeaseConfig::new("lock", "ns", "me");
        config.renew_deadline = renew_deadline;
        let leadership = Leadership::new(&config);
        leadership.renewed_at(Instant::now());
        leadership
    }

    fn in_flight(leadership: &Leadership) -> InFlight<std::future::Pending<Result<(), BoxError>>> {
        InFlight {
            request: Box::pin(std::future::pending()),
            leadership: leadership.clone(),
            started: Instant::now(),
            timer: None,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn an_unanswered_write_is_abandoned_when_leadership_lapses_and_renewals_extend_it() {
        let leadership = leading(Duration::from_secs(3));
        let started = Instant::now();
        let write = tokio::spawn(in_flight(&leadership));
        tokio::time::sleep(Duration::from_secs(2)).await;
        leadership.renewed_at(Instant::now());
        let err = write
            .await
            .expect("join")
            .expect_err("never answered: abandoned");
        assert_eq!(
            started.elapsed(),
            Duration::from_secs(5),
            "abandoned at the last renewal plus the renew deadline, not the first"
        );
        let err = err.downcast::<Unconfirmed>().expect("an Unconfirmed error");
        assert_eq!(err.in_flight, Duration::from_secs(5));
        assert!(matches!(err.reason, NotLeader::Stale { .. }));
    }

    #[tokio::test(start_paused = true)]
    async fn a_write_outliving_a_step_down_is_abandoned_naming_it() {
        let leadership = leading(Duration::from_secs(3));
        let write = tokio::spawn(in_flight(&leadership));
        tokio::task::yield_now().await;
        leadership.step_down();
        // The next poll (its timer at the latest) sees the step-down.
        let err = write.await.expect("join").expect_err("abandoned");
        let err = err.downcast::<Unconfirmed>().expect("an Unconfirmed error");
        assert!(matches!(err.reason, NotLeader::Follower { .. }));
    }

    #[tokio::test(start_paused = true)]
    async fn a_write_body_is_released_only_while_leading() {
        let leadership = leading(Duration::from_secs(3));
        let body = |fence: Option<Leadership>| Fenced {
            body: Body::from(b"{}".to_vec()),
            fence,
        };
        let mut fresh = std::pin::pin!(body(Some(leadership.clone())));
        let frame = std::future::poll_fn(|cx| fresh.as_mut().poll_frame(cx)).await;
        assert!(matches!(frame, Some(Ok(_))), "sent while leading");

        tokio::time::advance(Duration::from_secs(3)).await;
        let mut late = std::pin::pin!(body(Some(leadership.clone())));
        let frame = std::future::poll_fn(|cx| late.as_mut().poll_frame(cx)).await;
        assert!(matches!(frame, Some(Err(_))), "refused once stale");

        let mut read = std::pin::pin!(body(None));
        let frame = std::future::poll_fn(|cx| read.as_mut().poll_frame(cx)).await;
        assert!(
            matches!(frame, Some(Ok(_))),
            "a read's body is never fenced"
        );
    }
}
