//! An operator shaped like the scaffold's (`xtask/templates/operator/`), on ConfigMaps instead
//! of a CRD of its own: for every ConfigMap labelled `example.steward.dev/echo=true` it keeps an
//! owned copy `<name><suffix>` (`--suffix`, default `-echo`), pruned when the label goes away,
//! and records an Event. [`Echo`] is its `Definition`; a reconcile observes, [`decide`]s a
//! [`Plan`] (pure, unit-tested) and steward-core executes it, adding leader election, backoff,
//! graceful shutdown, `/metrics`, `/healthz` and `/readyz`.
//!
//! ```text
//! cargo run -p steward-core --example echo_operator -- --kubeconfig $KUBECONFIG \
//!     --leader-election-namespace default --metrics-bind-address 127.0.0.1:8080 \
//!     --health-probe-bind-address 127.0.0.1:8081 --suffix=-echo
//! ```

use std::sync::Arc;

use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::ResourceExt;
use kube::core::PartialObjectMeta;
use kube::runtime::{controller::Action, watcher};
use steward_core::apply::{MANAGED_BY_LABEL, OWNER_LABEL};
use steward_core::controller::{Cache, Owners, watch_metadata};
use steward_core::events::Wanted;
use steward_core::reconcile::{self, Error, Plan};
use steward_core::{Context, Controller, Operator};

const SOURCE_LABEL: &str = "example.steward.dev/echo";

/// The metadata of echoes, as the cache holds them.
type Echoes = Vec<Arc<PartialObjectMeta<ConfigMap>>>;

/// Flags of the echo-operator (next to steward-core's common flags).
#[derive(clap::Args, Clone, Debug)]
struct Options {
    /// What an echo's name adds to its source's (not empty: the echo would be its source).
    #[arg(long, default_value = "-echo", value_parser = clap::builder::NonEmptyStringValueParser::new())]
    suffix: String,
}

/// What every reconcile shares: the options and the metadata of the echoes.
#[derive(Clone)]
struct State {
    options: Options,
    echoes: Cache<PartialObjectMeta<ConfigMap>>,
}

/// The echo-operator, as steward-core runs it ([`steward_core::operator::main`]).
struct Echo;

impl steward_core::operator::Definition for Echo {
    const NAME: &'static str = "echo-operator";
    const ABOUT: &'static str = "Keeps an echo of every labelled ConfigMap";
    type Options = Options;
    type Error = std::convert::Infallible;

    fn crds() -> Vec<CustomResourceDefinition> {
        Vec::new()
    }

    /// Watches every ConfigMap (not only labelled ones, so removing the label prunes the echo)
    /// and the metadata of the echoes it manages (a changed or deleted echo is put back).
    fn register(operator: &mut Operator, options: Options) -> Result<(), Self::Error> {
        let managed = format!("{MANAGED_BY_LABEL}={}", Self::NAME);
        let (echoes, watch) = watch_metadata(
            operator.api::<ConfigMap>(),
            watcher::Config::default().labels(&managed),
            Owners::Kept,
        );
        let controller = Controller::new(operator.api::<ConfigMap>(), watcher::Config::default())
            .owns_watched(watch);
        operator.controller(controller, State { options, echoes }, reconcile);
        Ok(())
    }
}

/// A ConfigMap has no status to write: [`reconcile::execute`] is given this one as both the
/// current and the planned status, and it equals every other, so no write is ever sent. A
/// failure still reaches the runtime (a Warning Event, a retry with backoff).
#[derive(Default, serde::Serialize)]
struct NoStatus(#[serde(skip)] Vec<Condition>);

impl PartialEq for NoStatus {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl reconcile::Conditions for NoStatus {
    fn conditions_mut(&mut self) -> &mut Vec<Condition> {
        &mut self.0
    }
}

/// The echo of `source` (pure, no client).
fn build(source: &ConfigMap, suffix: &str) -> ConfigMap {
    let mut echo = ConfigMap::default();
    echo.metadata.name = Some(format!("{}{suffix}", source.name_any()));
    echo.metadata.namespace = source.namespace();
    echo.data.clone_from(&source.data);
    echo
}

/// Decide (pure, no client): the echo `source` wants if labelled, the `owned` echoes (observed)
/// it no longer wants pruned, and an Event for each.
fn decide(source: &ConfigMap, owned: Echoes, state: &State) -> Plan<NoStatus> {
    let mut plan = Plan::new(NoStatus::default());
    if source.labels().get(SOURCE_LABEL).map(String::as_str) == Some("true") {
        let echo = build(source, &state.options.suffix);
        let event = Wanted::normal("Echoed", "Apply", format!("kept {}", echo.name_any()));
        plan = plan.child(&state.echoes, echo).event(event);
    }
    let stale: Vec<String> = (owned.iter())
        .filter(|e| e.metadata.deletion_timestamp.is_none() && !plan.kept().contains(e.as_ref()))
        .map(|e| e.name_any())
        .collect();
    if !stale.is_empty() {
        let note = format!("removed {}", stale.join(", "));
        plan = plan.event(Wanted::normal("EchoRemoved", "Prune", note));
    }
    plan.prune_among(owned)
}

/// Reconciles one ConfigMap: observes its echoes, decides, and steward-core executes the plan
/// (the echo applied only when it differs, stale echoes deleted, then the Events).
async fn reconcile(source: Arc<ConfigMap>, ctx: Arc<Context<State>>) -> Result<Action, Error> {
    let uid = source.uid();
    let owned = (ctx.data.echoes.state().into_iter())
        .filter(|e| e.labels().get(OWNER_LABEL) == uid.as_ref())
        .collect();
    let plan = decide(&source, owned, &ctx.data);
    reconcile::execute(&ctx, source.as_ref(), Some(&NoStatus::default()), plan).await
}

fn main() -> std::process::ExitCode {
    steward_core::operator::main::<Echo>()
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::core::PartialObjectMetaExt;

    /// The plan for ConfigMap `settings` labelled `label`, which owns an echo named `echo`.
    fn plan(label: &str, echo: &str) -> Plan<NoStatus> {
        let mut source = ConfigMap::default();
        source.metadata.name = Some("settings".into());
        source.metadata.namespace = Some("ns".into());
        source.metadata.labels = Some([(SOURCE_LABEL.into(), label.into())].into());
        source.data = Some([("k".into(), "v".into())].into());
        let mut owned = source.metadata.clone();
        owned.name = Some(echo.into());
        let owned = vec![Arc::new(owned.into_response_partial())];
        // The options as no flag sets them (`--suffix` is `-echo`); a cache nothing fills.
        let (options, echoes) = (steward_core::cli::defaults(), Cache::unfilled());
        decide(&source, owned, &State { options, echoes })
    }

    #[test]
    fn a_labelled_configmap_wants_its_echo_and_an_unlabelled_one_prunes_it() {
        let labelled = plan("true", "settings-old");
        let wanted = labelled.wanted::<ConfigMap>();
        assert_eq!(wanted.len(), 1, "one echo");
        assert_eq!(wanted[0].metadata.name.as_deref(), Some("settings-echo"));
        assert_eq!(wanted[0].metadata.namespace.as_deref(), Some("ns"));
        assert_eq!(wanted[0].data, Some([("k".into(), "v".into())].into()));
        let notes: Vec<_> = labelled.events().iter().map(|e| e.note.as_str()).collect();
        assert_eq!(notes, ["kept settings-echo", "removed settings-old"]);

        let unlabelled = plan("false", "settings-echo");
        assert!(unlabelled.children() == 0 && unlabelled.kept().is_empty());
        assert_eq!(unlabelled.events()[0].reason, "EchoRemoved");
    }
}
