//! upgrade-orchestrator: rolls new versions across several dependent workloads, in order.
//!
//! Start with [`crd`] (the `UpgradePlan` resource), then [`reconcile`] (the pipeline), which
//! calls one module per step:
//!
//! ```text
//! plan      validate: names, dependencies, cycles → waves            (pure)
//! target    observe:  read each target; its value and health         (health: pure)
//!           apply:    make the changes the status already records    (JSON patch + test)
//! progress  build:    the state machine → next status, Events        (pure)
//! hook                the Jobs run before/after a component's change (pure)
//! window              maintenance windows: may a component start now (pure)
//! redact              what a plan shows of the values it changes        (pure)
//! reconcile status:   one write, resourceVersion-guarded; then Events
//! ```
//!
//! # Guarantees
//! - **Order**: waves run one after the other; a component starts only when all of its
//!   dependencies succeeded and are healthy right now; at most `maxConcurrent` at once.
//! - **Write-ahead**: a component's previous value is recorded in the status before its target
//!   changes, and a change is made only while the target still holds that value. A crash or
//!   leader change at any point resumes where it stopped and never changes a target twice; a
//!   rollback restores exactly the recorded value. (A value the plan must not publish — a
//!   Secret's, or outside `/spec` — is recorded as a stand-in or a digest, and the target
//!   keeps the value itself, written by the patch that changes it: see [`redact`].)
//! - **Bounded health rules**: custom CEL health rules have a cost budget and a nesting limit
//!   checked before the plan starts, and run off the async workers within a time limit (see
//!   [`health`]).
//! - **Watch-driven**: Deployments, StatefulSets, DaemonSets and PostgresClusters are watched
//!   and mapped to the plans that target them, so a rollout finishing wakes its plan; timers
//!   are used only for deadlines. Hook Jobs (owned by their plan) wake it when they finish.
//!
//! [`register`] adds the controller to a [`steward_core::Operator`].

#![forbid(unsafe_code)]
#![cfg_attr(test, allow(clippy::unwrap_used))]

/// The `UpgradePlan` resource, from its own crate (types only).
pub use steward_upgrade_api as crd;
pub mod error;
pub mod health;
pub mod hook;
pub mod metrics;
pub mod plan;
pub mod progress;
pub mod reconcile;
pub use steward_upgrade_api::redact;
pub mod target;
pub mod window;

use std::sync::Arc;

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment, StatefulSet};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DynamicObject};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use kube::{CustomResourceExt, Resource};
use steward_core::Controller;

pub use crd::{UpgradePlan, UpgradePlanSpec, UpgradePlanStatus};
pub use error::Error;

/// The operator's name: binary, field manager, Lease, Event reporter.
pub const NAME: &str = steward_upgrade_api::OPERATOR;
/// The controller's name in metrics.
pub const CONTROLLER: &str = "upgradeplan";

/// Every CustomResourceDefinition this operator owns, for `cargo xtask crdgen`.
pub fn crds() -> Vec<CustomResourceDefinition> {
    vec![UpgradePlan::crd()]
}

/// Flags of the upgrade-orchestrator (next to steward-core's common flags).
#[derive(clap::Args, Clone, Debug)]
pub struct Options {
    /// Watch PostgresClusters (database.steward.dev) so their readiness wakes plans at once.
    /// Turn off where that CRD is not installed; plans with PostgresCluster components then
    /// see its readiness only on their deadline timer or other events.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub watch_postgresclusters: bool,
    /// The ServiceAccount (of the plan's namespace) that a plan naming no
    /// `spec.serviceAccountName` acts as, impersonated like a named one (it needs no
    /// delegation: it acts for every plan of its namespace). Unset, such a plan acts with the
    /// orchestrator's own rights; set it (e.g. to `default`) wherever whoever may create an
    /// UpgradePlan must not change more than a ServiceAccount of that namespace may.
    #[arg(long)]
    pub default_service_account: Option<String>,
}

impl Default for Options {
    /// The defaults of every flag.
    fn default() -> Self {
        steward_core::cli::defaults()
    }
}

/// The upgrade-orchestrator, as steward-core runs it ([`steward_core::operator::main`]).
pub struct UpgradeOrchestrator;

impl steward_core::operator::Definition for UpgradeOrchestrator {
    const NAME: &'static str = NAME;
    const ABOUT: &'static str = "Rolls new versions across several dependent workloads, in order (UpgradePlan, upgrade.steward.dev)";
    const SAMPLES: &'static [&'static str] = &["upgradeplan-targets.yaml", "upgradeplan.yaml"];
    type Options = Options;
    type Error = Error;

    fn crds() -> Vec<CustomResourceDefinition> {
        crds()
    }

    fn register(operator: &mut steward_core::Operator, options: Options) -> Result<(), Error> {
        register(operator, options)
    }
}

/// Adds the `UpgradePlan` controller to `operator`, watching the plans and every kind of
/// target, and registers the metrics.
///
/// # Errors
/// None today; the signature leaves room for option validation.
pub fn register(operator: &mut steward_core::Operator, options: Options) -> Result<(), Error> {
    let plans = operator.api::<UpgradePlan>();
    let controller = Controller::new(plans, watcher::Config::default());
    let store = controller.store();
    let mut controller = controller
        // Hook Jobs: a Job finishing wakes its plan.
        .owns(
            operator.api::<Job>(),
            watcher::Config::default().labels(hook::PLAN_LABEL),
        )
        .watches_metadata(
            operator.api::<Deployment>(),
            watcher::Config::default(),
            plans_targeting(store.clone(), crd::TargetKind::Deployment),
        )
        .watches_metadata(
            operator.api::<StatefulSet>(),
            watcher::Config::default(),
            plans_targeting(store.clone(), crd::TargetKind::StatefulSet),
        )
        .watches_metadata(
            operator.api::<DaemonSet>(),
            watcher::Config::default(),
            plans_targeting(store.clone(), crd::TargetKind::DaemonSet),
        );
    if options.watch_postgresclusters {
        let resource = target::postgres_resource();
        let client = operator.client();
        let api: Api<DynamicObject> = match &operator.args().watch_namespace {
            Some(ns) => Api::namespaced_with(client, ns, &resource),
            None => Api::all_with(client, &resource),
        };
        controller = controller.watches_with(
            api,
            resource,
            watcher::Config::default(),
            plans_targeting(store.clone(), crd::TargetKind::PostgresCluster),
        );
    }
    let metrics = metrics::PlanMetrics::register(&operator.metrics(), store);
    operator.controller(
        controller,
        reconcile::Data {
            metrics,
            default_service_account: options.default_service_account,
        },
        |plan: Arc<UpgradePlan>, ctx| reconcile::reconcile(plan, ctx),
    );
    Ok(())
}

/// Maps a changed workload of `kind` to the unfinished plans in its namespace that target it:
/// an index of targets over the plan cache.
fn plans_targeting<K: Resource>(
    plans: Store<UpgradePlan>,
    kind: crd::TargetKind,
) -> impl Fn(K) -> Vec<ObjectRef<UpgradePlan>> + Send + Sync + 'static {
    steward_core::index::referring(plans, move |p: &UpgradePlan, namespace, name| {
        let finished = p
            .status
            .as_ref()
            .and_then(|s| s.phase)
            .is_some_and(|ph| ph.is_terminal());
        let plan_namespace = p.metadata.namespace.as_deref().unwrap_or_default();
        !finished
            && p.spec.components.iter().any(|c| {
                c.target.typed() == Some(kind)
                    && c.target.name == name
                    && c.target.namespace_in(plan_namespace) == namespace
            })
    })
}
