//! tenant-operator: gives each team a tenant (namespaces, access, quotas and isolation), as
//! Capsule does, built on steward-core. API group `tenancy.steward.dev/v1alpha1`, kind
//! [`Tenant`] (cluster-scoped, short name `tnt`).
//!
//! Start with [`register`], which wires the controller ([`controller`]) and the admission
//! policies ([`policy`]) into a steward-core [`Operator`]. One reconcile ([`reconcile`]) runs
//! the usual pipeline, one module per step:
//!
//! ```text
//! validate   spec checks admission cannot do; quantities parsed          (pure)
//! namespaces which namespaces the tenant has, keeps, releases, deletes   (pure)
//! quota      the tenant-wide quota split into per-namespace hard limits  (pure)
//! build      namespaces, ResourceQuota, LimitRange, NetworkPolicy,
//!            RoleBindings, shared copies, the owners' ClusterRole        (pure)
//! apply      steward-core's Children: apply what differs, prune what is unwanted
//! status     namespaces, summed usage, Ready and QuotaExceeded           (pure, one write)
//! ```
//!
//! Enforcement needs no webhook server: [`policy`] generates ValidatingAdmissionPolicies that
//! keep owners from touching the operator's objects and tenant labels, from creating namespaces
//! beyond their allowance, and from changing anything in a cordoned tenant.

pub mod build;
pub mod controller;
/// The `Tenant` resource, from its own crate (types only).
pub use steward_tenant_api as crd;
pub mod metrics;
pub mod namespaces;
pub mod policy;
pub use steward_tenant_api::quantity;
pub mod quota;
pub mod reconcile;
pub mod status;
pub mod validate;

use std::time::Duration;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;
use steward_core::Operator;

pub use crd::{Tenant, TenantSpec, TenantStatus};

/// The operator's name: binary, field manager, Lease and Event reporter.
pub const NAME: &str = steward_tenant_api::OPERATOR;

/// Every CustomResourceDefinition this operator owns, for `cargo xtask crdgen`.
pub fn crds() -> Vec<CustomResourceDefinition> {
    vec![Tenant::crd()]
}

/// The tenant-operator's own flags.
#[derive(clap::Args, Clone, Debug)]
pub struct Options {
    /// ClusterRole bound to a tenant's owners in its namespaces when the Tenant names none.
    #[arg(long, default_value = "admin")]
    pub owner_cluster_role: String,

    /// Reconcile only Tenants matching this label selector (e.g. to shard tenants).
    #[arg(long)]
    pub tenant_selector: Option<String>,

    /// Apply the admission policies at startup (when leading).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub apply_policies: bool,

    /// A user the admission policies let through, besides the operator itself and the control
    /// plane (repeatable).
    #[arg(long = "exempt-user")]
    pub exempt_users: Vec<String>,

    /// A group the admission policies let through, besides `system:masters` and
    /// `system:nodes` (repeatable).
    #[arg(long = "exempt-group")]
    pub exempt_groups: Vec<String>,

    /// How often every Tenant is reconciled again without a change.
    #[arg(long, default_value = "10m", value_parser = steward_core::cli::parse_duration)]
    pub resync_period: Duration,

    /// A namespace no Tenant may have (repeatable), besides `default` and every `kube-*`. The
    /// operator's own namespace (POD_NAMESPACE) is added at start.
    #[arg(
        long = "protected-namespace",
        default_values_t = [
            "database-operator-system".to_string(),
            "tenant-operator-system".to_string(),
            "upgrade-orchestrator-system".to_string(),
        ]
    )]
    pub protected_namespaces: Vec<String>,

    /// A namespace Tenants may share Secrets and ConfigMaps from (repeatable). The operator
    /// watches only these for sources: it needs `get`, `list` and `watch` on Secrets and
    /// ConfigMaps there (the deployment grants them in `steward-shared`), never cluster-wide.
    #[arg(long = "shared-namespace", default_values_t = ["steward-shared".to_string()])]
    pub shared_namespaces: Vec<String>,

    /// Print the admission policies (exempting `--exempt-user`/`--exempt-group`, which should
    /// include the operator's ServiceAccount) as YAML and exit.
    #[arg(long)]
    pub print_policies: bool,
}

impl Default for Options {
    /// The defaults of every flag.
    fn default() -> Self {
        steward_core::cli::defaults()
    }
}

/// The tenant-operator, as steward-core runs it ([`steward_core::operator::main`]).
pub struct TenantOperator;

impl steward_core::operator::Definition for TenantOperator {
    const NAME: &'static str = NAME;
    const ABOUT: &'static str =
        "Gives each team a tenant: namespaces, access, quotas and isolation";
    const SAMPLES: &'static [&'static str] = &["tenant.yaml"];
    type Options = Options;
    type Error = Error;

    fn crds() -> Vec<CustomResourceDefinition> {
        crds()
    }

    fn register(operator: &mut Operator, options: Options) -> Result<(), Error> {
        register(operator, options)
    }

    /// `--print-policies`: the admission policies as YAML.
    fn print_instead(options: &Options) -> Result<Option<String>, Error> {
        if !options.print_policies {
            return Ok(None);
        }
        let exempt =
            policy::Exemptions::new(options.exempt_users.clone(), options.exempt_groups.clone());
        policy::to_yaml(&policy::Policies::new(&exempt, None, NAME))
            .map(Some)
            .map_err(|e| Error::PrintPolicies(e.to_string()))
    }

    /// The MutatingAdmissionPolicy and its binding, which the deployment installs.
    fn manifests() -> Result<steward_core::operator::Manifests, String> {
        Ok(vec![(
            policy::DEFAULTS_FILE,
            policy::deployed_defaults(NAME)?,
        )])
    }
}

/// Why the operator could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A flag has an unusable value.
    #[error("invalid option {flag}: {reason}")]
    InvalidOption { flag: &'static str, reason: String },
    /// The admission policies could not be rendered as YAML.
    #[error("failed to print the admission policies: {0}")]
    PrintPolicies(String),
}

/// Adds the Tenant controller (and, with `apply_policies`, the leader-only task applying the
/// admission policies and restoring them when someone changes or deletes them) to `operator`.
///
/// # Errors
/// [`Error::InvalidOption`] for an empty `--owner-cluster-role` or `--tenant-selector`.
pub fn register(operator: &mut Operator, options: Options) -> Result<(), Error> {
    if options.owner_cluster_role.trim().is_empty() {
        return Err(Error::InvalidOption {
            flag: "--owner-cluster-role",
            reason: "must name a ClusterRole".into(),
        });
    }
    if options
        .tenant_selector
        .as_deref()
        .is_some_and(|s| s.trim().is_empty())
    {
        return Err(Error::InvalidOption {
            flag: "--tenant-selector",
            reason: "must not be empty".into(),
        });
    }
    // The admission policies' writes, counted with the tenant controller's.
    let writes = steward_core::apply::WriteCounter::new(&operator.metrics(), "tenant");
    let settings = build::Settings {
        owner_cluster_role: options.owner_cluster_role.clone(),
        protected: namespaces::Protected {
            names: options
                .protected_namespaces
                .iter()
                .cloned()
                .chain(std::env::var("POD_NAMESPACE").ok())
                .filter(|n| !n.trim().is_empty())
                .collect(),
        },
    };
    let (client, metrics) = (operator.unguarded_client(), operator.metrics());
    let (selector, shared) = (
        options.tenant_selector.clone(),
        options.shared_namespaces.clone(),
    );
    let resync = options.resync_period;
    let extra = policy::Exemptions {
        users: options.exempt_users,
        groups: options.exempt_groups,
        user_prefixes: Vec::new(),
    };
    let guard_rails = options
        .apply_policies
        .then(|| policy::GuardRails::new(operator.unguarded_client(), extra.clone(), NAME));
    // The per-Tenant gauges read the Tenant cache of each shard this replica holds (the one
    // cache when not sharded).
    let tenants = steward_core::metrics::Stores::default();
    metrics::register(&metrics, &tenants);
    let held = operator.shard_leaderships();
    // Per shard (`--shards`): a controller watching and caching only that shard's Tenants and
    // children, built when this replica takes the shard.
    let build = move |shard: Option<u32>| {
        let (controller, stores) =
            controller::build(client.clone(), selector.as_deref(), &shared, shard);
        let leadership = shard
            .and_then(|i| held.get(usize::try_from(i).ok()?).cloned())
            .unwrap_or_else(steward_core::leader::Leadership::always_leader);
        tenants.set(shard, controller.store(), leadership);
        let state = controller::State {
            stores,
            settings: settings.clone(),
            resync,
            me: Default::default(),
            guard_rails: guard_rails.clone(),
        };
        (controller, state)
    };
    operator.sharded_controller(build, reconcile::reconcile);
    // Sharded: the main leader labels new Tenants, and namespaces owners create, with their shard.
    operator.shard_labels::<Tenant>(options.tenant_selector.as_deref(), |m| {
        Some(steward_core::shard::key_of(m))
    });
    operator.shard_labels::<k8s_openapi::api::core::v1::Namespace>(Some(crd::TENANT_LABEL), |m| {
        m.labels.as_ref()?.get(crd::TENANT_LABEL).cloned()
    });
    if options.apply_policies {
        let client = operator.client();
        let recheck = options.resync_period;
        operator.singleton(move |stop| {
            policy::keep_in_place(
                client.clone(),
                extra.clone(),
                NAME.to_string(),
                writes.clone(),
                recheck,
                stop,
            )
        });
    }
    Ok(())
}
