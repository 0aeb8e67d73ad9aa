//! Errors of steward-core, and the trait operators' reconcile errors implement.

use std::net::SocketAddr;

/// Errors from steward-core's helpers and runtime.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Loading the client configuration failed.
    #[error("failed to load the Kubernetes client configuration: {0}")]
    Config(String),
    /// The metrics or probe server could not bind.
    #[error("failed to bind {addr}")]
    Bind {
        /// The address that could not be bound.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Leader election could not be set up or failed.
    #[error("leader election failed")]
    Leader(#[from] crate::leader::Error),
    /// Leader election configuration is invalid.
    #[error("invalid leader election configuration")]
    LeaderConfig(#[from] crate::leader::ConfigError),
    /// Server-side apply of an owned child failed.
    #[error("failed to apply {kind} {name}")]
    ApplyChild {
        /// The child's kind.
        kind: String,
        /// The child's name.
        name: String,
        /// The API server's answer.
        #[source]
        source: kube::Error,
    },
    /// Deleting a child that is no longer desired failed.
    #[error("failed to prune {kind} {name}")]
    PruneChild {
        /// The child's kind.
        kind: String,
        /// The child's name (`namespace/name` when namespaced).
        name: String,
        /// The API server's answer.
        #[source]
        source: kube::Error,
    },
    /// Writing status failed.
    #[error("failed to write the status of {object}")]
    WriteStatus {
        /// The object whose status was written.
        object: String,
        /// The API server's answer.
        #[source]
        source: kube::Error,
    },
    /// An object could not be serialized.
    #[error("failed to serialize {what}: {message}")]
    Serialize {
        /// What was being serialized.
        what: String,
        /// The serializer's message.
        message: String,
    },
    /// Graceful shutdown could not release the Lease (or a shard Lease) within its bound:
    /// in-flight work is cancelled at the drain deadline, so only the release can miss it
    /// (an API server that does not answer); the Lease then expires on its own.
    #[error("graceful shutdown did not release the Lease within {0:?}")]
    ShutdownTimeout(std::time::Duration),
}

/// What the runtime needs to know about an operator's reconcile error.
pub trait ReconcileError: std::error::Error + Send + Sync + 'static {
    /// A CamelCase reason for Events and conditions (`ServerUnreachable`, `InvalidSpec`).
    fn reason(&self) -> &str {
        "ReconcileError"
    }

    /// `true` when retrying cannot help until the object changes (an invalid spec): the
    /// runtime then waits for a change instead of retrying with backoff.
    fn is_permanent(&self) -> bool {
        false
    }

    /// The longest the runtime waits before retrying after this error, whatever the
    /// per-object backoff has grown to: for failures that end outside the operator's view (an
    /// external server coming back), so recovery is noticed within this bound. `None`: the
    /// backoff alone decides.
    fn max_backoff(&self) -> Option<std::time::Duration> {
        None
    }
}

/// The full chain of an error's messages, `a: b: c`, for conditions and Events.
pub fn chain(err: &dyn std::error::Error) -> String {
    let mut out = err.to_string();
    let mut source = err.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}
