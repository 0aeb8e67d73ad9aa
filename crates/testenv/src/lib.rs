//! A real Kubernetes control plane for Steward's tests: etcd, kube-apiserver,
//! kube-controller-manager, kube-scheduler and kwok (simulated nodes), built from Go modules
//! and run as local processes on loopback.
//!
//! Start here:
//! - [`shared`]: the control plane of this test binary, started on first use.
//! - [`ControlPlane::namespace`]: a fresh, labelled namespace per test.
//! - [`ControlPlane::client`], [`ControlPlane::service_account_client`],
//!   [`ControlPlane::impersonating_client`]: admin and less privileged clients.
//! - [`ControlPlane::install_crds`] applies `crds/`; [`eventually`] waits with a useful message.
//! - [`harness::Harness`]: an operator running in the test (metrics, probes, wait, stop).
//! - [`ControlPlane::kill`], [`ControlPlane::start_again`], [`ControlPlane::pause`]: faults.
//! - `Options { real_node: true, .. }`: a control plane with one real node ([`node`]: kubelet,
//!   containerd, CNI bridge, kube-proxy, CoreDNS) whose pods run, from images assembled by
//!   [`images`]. Opt-in; kwok's simulated nodes stay the default. Start one per test and drop
//!   it (not in a `static`, which is never dropped): the drop removes the node from the host.
//! - [`ControlPlane::start_pair`]: two control planes on one host, each with its own real
//!   nodes (two Kubernetes clusters linked by the host and routed pod addresses only).
//! - [`deploy`]: the operators as their images on the real node, deployed by `deploy/`.
//!
//! The binaries are built once by [`binaries::ensure`] and cached outside the repository.
//! A control plane that cannot be built or started is an error naming the component and its
//! log, never a skipped test.

pub mod binaries;
mod cache;
mod controlplane;
pub mod deploy;
pub mod harness;
mod helpers;
pub mod images;
pub mod manifests;
pub mod node;
pub mod postgres;
mod process;
pub mod s3;

pub use binaries::{Binaries, NodeBinaries, Versions};
pub use controlplane::{Component, ControlPlane, NODE_MONITOR_GRACE, Options};
pub use helpers::{at_least, eventually, shared, workspace_root};
pub use node::RealNode;
pub use process::{Process, free_port, http_get};

use std::path::PathBuf;

/// Everything that can go wrong while building or running the control plane.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The `go` command could not be run.
    #[error("failed to run `go` (is Go 1.26 installed and on PATH?)")]
    GoMissing {
        #[source]
        source: std::io::Error,
    },
    /// `go build` failed for a component.
    #[error("failed to build {component}: {reason}; build log: {}", log.display())]
    Build {
        component: String,
        log: PathBuf,
        reason: String,
    },
    /// A component could not be started or exited early.
    #[error("failed to start {component}: {reason}; log: {}", log.display())]
    Start {
        component: &'static str,
        log: PathBuf,
        reason: String,
    },
    /// A component did not become healthy in time.
    #[error("{component} did not become healthy within {waited_secs}s: {reason}; log: {}", log.display())]
    Unhealthy {
        component: &'static str,
        log: PathBuf,
        waited_secs: u64,
        reason: String,
    },
    /// A filesystem or process operation failed.
    #[error("failed to {what}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    /// A call to the API server failed.
    #[error("failed to {what}")]
    Kube {
        what: String,
        #[source]
        source: kube::Error,
    },
    /// A condition was not reached in time.
    #[error("timed out after {waited_secs}s waiting for {what}; last observed: {last}")]
    Timeout {
        what: String,
        waited_secs: u64,
        last: String,
    },
    /// Setting up or cleaning the host for the real node failed (bridge, iptables, sysctls).
    #[error("failed to {what}: {reason}")]
    Host { what: String, reason: String },
    /// Any other failure with a message (kubeconfig, CRD files).
    #[error("{0}")]
    Other(String),
}
