//! A complete operator in about 100 lines, using only steward-core's public API.
//!
//! For every ConfigMap labelled `example.steward.dev/echo=true` it keeps an owned copy named
//! `<name>-echo` (server-side apply, owner reference, pruned when the label goes away) and
//! records an Event. It gets leader election, backoff, graceful shutdown, `/metrics`,
//! `/healthz` and `/readyz` from the runtime.
//!
//! ```text
//! cargo run -p steward-core --example echo_operator -- --kubeconfig $KUBECONFIG \
//!     --leader-election-namespace default --metrics-bind-address 127.0.0.1:8080 \
//!     --health-probe-bind-address 127.0.0.1:8080
//! ```

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use clap::Parser;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::ResourceExt;
use kube::runtime::controller::Action;
use kube::runtime::watcher;
use steward_core::Controller;
use steward_core::apply::Children;
use steward_core::cli::CommonArgs;
use steward_core::{Context, Operator, ReconcileError};

const SOURCE_LABEL: &str = "example.steward.dev/echo";

#[derive(Parser)]
#[command(version, about = "Keeps an echo of every labelled ConfigMap")]
struct Args {
    #[command(flatten)]
    common: CommonArgs,
    /// Suffix of the copies.
    #[arg(long, default_value = "-echo")]
    suffix: String,
}

/// Errors of one reconcile, named after the step that failed.
#[derive(Debug, thiserror::Error)]
enum Error {
    #[error("failed to apply the echo")]
    ApplyEcho(#[source] steward_core::Error),
    #[error("failed to prune stale echoes")]
    Prune(#[source] steward_core::Error),
}

impl ReconcileError for Error {
    fn reason(&self) -> &str {
        match self {
            Error::ApplyEcho(_) => "ApplyFailed",
            Error::Prune(_) => "PruneFailed",
        }
    }
}

/// Build: the desired echo of `source` (pure, no client).
fn build_echo(source: &ConfigMap, suffix: &str) -> ConfigMap {
    let mut echo = ConfigMap::default();
    echo.metadata.name = Some(format!("{}{suffix}", source.name_any()));
    echo.metadata.namespace = source.namespace();
    echo.data = Some(source.data.clone().unwrap_or_default());
    echo.metadata.annotations = Some(BTreeMap::from([(
        "example.steward.dev/source".into(),
        source.name_any(),
    )]));
    echo
}

/// Reconcile: build, apply, prune, tell.
async fn reconcile(source: Arc<ConfigMap>, ctx: Arc<Context<String>>) -> Result<Action, Error> {
    let children = Children::new(ctx.client.clone(), source.as_ref(), &ctx.field_manager);
    let labelled = source
        .labels()
        .get(SOURCE_LABEL)
        .is_some_and(|v| v == "true");
    let mut keep = BTreeSet::new();
    if labelled {
        let echo = children
            .apply(build_echo(&source, &ctx.data))
            .await
            .map_err(Error::ApplyEcho)?;
        keep.insert(echo.name_any());
    }
    let pruned = children
        .prune::<ConfigMap>(source.namespace().as_deref(), &keep)
        .await
        .map_err(Error::Prune)?;
    if labelled {
        ctx.recorder
            .normal(
                source.as_ref(),
                "Echoed",
                "Apply",
                format!("kept {}{}", source.name_any(), ctx.data),
            )
            .await;
    } else if !pruned.is_empty() {
        ctx.recorder
            .normal(
                source.as_ref(),
                "EchoRemoved",
                "Prune",
                format!("removed {pruned:?}"),
            )
            .await;
    }
    Ok(Action::await_change())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    steward_core::telemetry::init_logs(&args.common);
    let mut operator = Operator::new("echo-operator", args.common.clone()).await?;
    let sources = operator.api::<ConfigMap>();
    let children = operator.api::<ConfigMap>();
    // Watch every ConfigMap (not only labelled ones) so removing the label prunes the echo.
    let controller = Controller::new(sources, watcher::Config::default()).owns(
        children,
        watcher::Config::default().labels("app.kubernetes.io/managed-by=echo-operator"),
    );
    operator.controller(controller, args.suffix, reconcile);
    operator.run().await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn echo_copies_data_and_names_its_source() {
        let mut source = ConfigMap::default();
        source.metadata.name = Some("settings".into());
        source.data = Some(BTreeMap::from([("k".into(), "v".into())]));
        let echo = build_echo(&source, "-echo");
        assert_eq!(echo.name_any(), "settings-echo");
        assert_eq!(echo.data, source.data);
    }
}
