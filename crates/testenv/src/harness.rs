//! Running an operator in a test: [`Harness`] starts a registered [`Operator`] in-process,
//! reads its metrics and probes, waits for what it does, and stops it.
//!
//! ```no_run
//! # async fn f(cp: &steward_testenv::ControlPlane) {
//! use steward_testenv::harness::{Harness, test_args};
//! let mut operator = steward_core::Operator::with_config("demo", test_args(), cp.config().clone()).unwrap();
//! // my_operator::register(&mut operator, Default::default());
//! let running = Harness::start(operator).await;
//! running.wait_reconciles("demo", 1, std::time::Duration::from_secs(30)).await.unwrap();
//! running.stop().await.unwrap();
//! # }
//! ```

use std::net::SocketAddr;
use std::time::Duration;

use steward_core::Operator;
use steward_core::cli::CommonArgs;
use steward_core::metrics::{Metrics, ResultLabels};
use tokio_util::sync::CancellationToken;

use crate::{Error, eventually, free_port, http_get};

/// Flags for an operator in a test: no leader election, probes on a free loopback port (see
/// [`Harness::health_addr`]), no metrics port (read [`Harness::metrics`] directly), a 5 s
/// shutdown bound.
pub fn test_args() -> CommonArgs {
    let health = free_port()
        .map(|p| format!("127.0.0.1:{p}"))
        .unwrap_or_else(|_| "127.0.0.1:0".into());
    CommonArgs {
        leader_elect: false,
        metrics_bind_address: "0".into(),
        health_probe_bind_address: health,
        shutdown_timeout: Duration::from_secs(5),
        ..CommonArgs::default()
    }
}

/// An operator running in this test process; stopped when dropped (without waiting: call
/// [`Harness::stop`] to see how it ended).
pub struct Harness {
    stop: CancellationToken,
    task: Option<tokio::task::JoinHandle<Result<(), steward_core::Error>>>,
    metrics: Metrics,
    health_addr: Option<SocketAddr>,
}

impl Drop for Harness {
    fn drop(&mut self) {
        self.stop.cancel();
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

impl Harness {
    /// Runs `operator` (already registered) on the current runtime.
    pub async fn start(operator: Operator) -> Self {
        if std::env::var_os("RUST_LOG").is_some() {
            steward_core::telemetry::init_logs(operator.args());
        }
        let health_addr = operator.args().health_addr().ok().flatten();
        let stop = operator.shutdown_token();
        let metrics = operator.metrics();
        let task = Some(tokio::spawn(operator.run()));
        Self {
            stop,
            task,
            metrics,
            health_addr,
        }
    }

    /// The operator's metrics.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Where `/healthz` and `/readyz` are served (when the flags named a port).
    pub fn health_addr(&self) -> Option<SocketAddr> {
        self.health_addr
    }

    /// `controller_runtime_reconcile_total{controller, result}`.
    pub fn reconciles(&self, controller: &str, result: &str) -> u64 {
        self.metrics
            .reconcile_total
            .get_or_create(&ResultLabels {
                controller: controller.into(),
                result: result.into(),
            })
            .get()
    }

    /// The sum of family `name`'s samples labelled `controller` in the operator's metrics
    /// (a counter by its exposed name: `steward_child_writes_total`), summed over their
    /// other labels.
    pub fn counter(&self, name: &str, controller: &str) -> f64 {
        let label = format!("controller=\"{controller}\"");
        let prefix = format!("{name}{{");
        self.metrics
            .encode()
            .lines()
            .filter(|l| l.starts_with(&prefix) && l.contains(&label))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    /// Every reconcile of `controller` so far, whatever its result.
    pub fn all_reconciles(&self, controller: &str) -> f64 {
        self.counter("controller_runtime_reconcile_total", controller)
    }

    /// Every write of the operator so far: its children's (`steward_child_writes_total`)
    /// and its status writes, all controllers.
    pub fn writes(&self) -> f64 {
        self.metrics
            .encode()
            .lines()
            .filter(|l| {
                l.starts_with("steward_child_writes_total{")
                    || l.starts_with("steward_status_writes_total{")
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    /// Waits until `controller` has run `more` reconciles (whatever their result) past
    /// `from` (an earlier [`Harness::all_reconciles`]).
    ///
    /// # Errors
    /// [`Error::Timeout`] with the count seen.
    pub async fn reconciled(
        &self,
        controller: &str,
        from: f64,
        more: f64,
        timeout: Duration,
    ) -> Result<(), Error> {
        eventually(
            &format!("{more} more {controller} reconciles"),
            timeout,
            || async move {
                let now = self.all_reconciles(controller);
                if now >= from + more {
                    Ok(())
                } else {
                    Err(format!("{} so far", now - from))
                }
            },
        )
        .await
    }

    /// Waits until `controller` has `n` more successful reconciles than `from` (use
    /// [`Harness::reconciles`] for `from`): "the operator looked again", instead of a sleep.
    ///
    /// # Errors
    /// [`Error::Timeout`] with the counts seen.
    pub async fn wait_reconciles(
        &self,
        controller: &str,
        n: u64,
        timeout: Duration,
    ) -> Result<u64, Error> {
        let from = self.reconciles(controller, "success");
        eventually(
            &format!("{n} more successful {controller} reconciles"),
            timeout,
            || async move {
                let now = self.reconciles(controller, "success");
                if now >= from + n {
                    Ok(now)
                } else {
                    Err(format!(
                        "{} more ({} errors, {} skipped in all)",
                        now - from,
                        self.reconciles(controller, "error"),
                        self.reconciles(controller, "skipped")
                    ))
                }
            },
        )
        .await
    }

    /// `GET path` on the probe port: the status code and body.
    ///
    /// # Errors
    /// [`Error::Other`] when no probe port was configured; [`Error::Io`] when the request fails.
    pub async fn probe(&self, path: &str) -> Result<(u16, String), Error> {
        let addr = self
            .health_addr
            .ok_or_else(|| Error::Other("the operator serves no probes".into()))?;
        http_get(addr, path).await
    }

    /// Whether the operator is still running (its `run` has not returned).
    pub fn is_running(&self) -> bool {
        self.task.as_ref().is_some_and(|t| !t.is_finished())
    }

    /// Stops the operator (SIGTERM-like: drain, release the Lease) and returns how `run` ended.
    ///
    /// # Errors
    /// The operator's own error, or [`Error::Other`] when its task panicked.
    pub async fn stop(mut self) -> Result<(), Error> {
        self.stop.cancel();
        let Some(task) = self.task.take() else {
            return Ok(());
        };
        match task.await {
            Ok(r) => r.map_err(|e| Error::Other(format!("operator stopped with an error: {e}"))),
            Err(e) => Err(Error::Other(format!("operator task failed: {e}"))),
        }
    }
}

/// `cargo`, without the variables cargo sets for the crate being run (`CARGO_MANIFEST_DIR`,
/// `CARGO_PKG_*`, …), which a test, or `cargo xtask`, inherits from the cargo that started it.
/// Build scripts such as ring's say `rerun-if-env-changed` on some of them, and cargo compares
/// the values in its own environment: a cargo started from a test would find ring's build
/// stale, rebuild it and everything that depends on it (kube's TLS, every operator), and the
/// next plain `cargo build` would rebuild them back.
pub fn cargo_command() -> std::process::Command {
    let mut cmd =
        std::process::Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    for (name, _) in std::env::vars_os() {
        let Some(name) = name.to_str() else { continue };
        let set_for_a_crate = matches!(
            name,
            "CARGO_MANIFEST_DIR"
                | "CARGO_MANIFEST_PATH"
                | "CARGO_MANIFEST_LINKS"
                | "CARGO_CRATE_NAME"
                | "CARGO_BIN_NAME"
                | "CARGO_PRIMARY_PACKAGE"
                | "CARGO_TARGET_TMPDIR"
                | "CARGO_RUSTC_CURRENT_DIR"
                | "OUT_DIR"
        ) || name.starts_with("CARGO_PKG_")
            || name.starts_with("CARGO_BIN_EXE_");
        if set_for_a_crate {
            cmd.env_remove(name);
        }
    }
    cmd
}

/// [`cargo_build`]'s arguments.
pub const CARGO_BUILD: [&str; 5] = ["build", "--quiet", "--workspace", "--bins", "--examples"];

/// `cargo build --quiet --workspace --bins --examples` (debug, as the tests are), for tests
/// that run an operator, the plugin or an example as its own process (to SIGKILL it, or to put
/// it in an image); returns the debug output directory (`target/debug`).
///
/// Every binary and example at once rather than the one a test needs: cargo resolves features
/// per invocation, over the packages it selects and, when an example is among the targets,
/// their dev-dependencies (tokio's `test-util` among them), which is exactly how `cargo test
/// --workspace` resolves them. So this build reuses the test build's dependencies; a build of
/// `-p tenant-operator` alone would compile tokio and everything above it again (about 45 s of
/// both cores for each package set a test asked for).
///
/// # Errors
/// [`Error::Build`] with a log of cargo's output when the build fails.
pub fn cargo_build() -> Result<std::path::PathBuf, Error> {
    let root = crate::workspace_root();
    let out = cargo_command()
        .current_dir(&root)
        .args(CARGO_BUILD)
        .output()
        .map_err(|source| Error::Io {
            what: format!("run cargo {}", CARGO_BUILD.join(" ")),
            source,
        })?;
    if !out.status.success() {
        let log = std::env::temp_dir().join("steward-cargo-build.log");
        let _ = std::fs::write(&log, &out.stderr);
        return Err(Error::Build {
            component: "the workspace's binaries".into(),
            log,
            reason: format!("cargo build exited with {}", out.status),
        });
    }
    Ok(std::env::var_os("CARGO_TARGET_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| root.join("target"))
        .join("debug"))
}

/// Builds the `kubectl-steward` plugin; returns the directory it is in (for [`kubectl`]).
///
/// # Errors
/// As [`cargo_build`].
pub fn kubectl_steward() -> Result<std::path::PathBuf, Error> {
    cargo_build()
}

/// What a command printed.
#[derive(Debug)]
pub struct Ran {
    pub success: bool,
    pub stdout: String,
    pub stderr: String,
}

/// The control plane's `kubectl ARGS` as a user runs it, with `plugins` (a directory with
/// `kubectl-<name>` binaries) first on the `PATH`.
///
/// # Errors
/// [`Error::Io`] when kubectl cannot be started.
pub fn kubectl(
    cp: &crate::ControlPlane,
    plugins: &std::path::Path,
    args: &[&str],
) -> Result<Ran, Error> {
    let path = std::env::join_paths(std::iter::once(plugins.to_path_buf()).chain(
        std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()),
    ))
    .map_err(|e| Error::Other(format!("PATH with {}: {e}", plugins.display())))?;
    let out = std::process::Command::new(&cp.binaries().kubectl)
        .args(args)
        .env("KUBECONFIG", cp.kubeconfig_path())
        .env("PATH", path)
        .output()
        .map_err(|source| Error::Io {
            what: format!("run kubectl {}", args.join(" ")),
            source,
        })?;
    Ok(Ran {
        success: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    })
}

/// An operator on a tokio runtime of its own, so it can be killed at any await point, as a
/// crashed process would be: [`Crashable::kill`] drops the runtime and with it every task
/// mid-flight (reconciles, Lease renewals, requests on the wire), where [`Harness::stop`]
/// drains them.
pub struct Crashable {
    /// `None` once killed.
    runtime: Option<tokio::runtime::Runtime>,
}

impl Crashable {
    /// Builds the operator with `build` on a new one-thread runtime (a client must be built
    /// on the runtime it runs on) and runs it; returns once it runs, with what `build`
    /// returned besides the operator (its leadership, say).
    ///
    /// # Panics
    /// When the runtime cannot be built or `build` panics.
    pub async fn start<T, F>(build: F) -> (Self, T)
    where
        T: Send + 'static,
        F: FnOnce() -> (Operator, T) + Send + 'static,
    {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("a runtime for the operator");
        let (tx, rx) = tokio::sync::oneshot::channel();
        runtime.spawn(async move {
            let (operator, value) = build();
            let _ = tx.send(value);
            let _ = operator.run().await;
        });
        let value = rx.await.expect("the operator was built");
        (
            Self {
                runtime: Some(runtime),
            },
            value,
        )
    }

    /// Kills the operator: nothing of it runs after this returns.
    pub fn kill(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

/// Dropped (a test that failed half-way, say): killed, without blocking (a runtime must not
/// be dropped inside another one's task).
impl Drop for Crashable {
    fn drop(&mut self) {
        self.shutdown();
    }
}
