//! A client whose writes pass only while this process leads.
//!
//! A tower layer in the client's stack refuses POST, PUT, PATCH and DELETE requests unless
//! [`Leadership::guard`] passes. Every write a reconciler makes goes through it, so a leader
//! that lost its Lease (or was paused past RenewDeadline) cannot write, whatever the
//! reconcile code does.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::{Method, Request};
use kube::client::ClientBuilder;
use tower::{BoxError, Layer, Service};

use crate::Error;
use crate::leader::Leadership;

/// Builds a leader-guarded client from `config`.
///
/// # Errors
/// [`Error::Config`] when the client cannot be built.
pub fn client(config: kube::Config, leadership: Leadership) -> Result<kube::Client, Error> {
    let builder = ClientBuilder::try_from(config).map_err(|e| Error::Config(e.to_string()))?;
    Ok(builder.with_layer(&GuardLayer { leadership }).build())
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

fn is_write(method: &Method) -> bool {
    matches!(
        *method,
        Method::POST | Method::PUT | Method::PATCH | Method::DELETE
    )
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
        if is_write(req.method())
            && let Err(e) = self.leadership.guard()
        {
            let err: BoxError = Box::new(e);
            return Box::pin(async move { Err(err) });
        }
        let fut = self.inner.call(req);
        Box::pin(async move { fut.await.map_err(Into::into) })
    }
}
