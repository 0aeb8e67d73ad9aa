//! database-operator: PostgreSQL on Kubernetes, built on steward-core.
//!
//! Start with [`crd`] (the custom resources: [`crd::PostgresCluster`], [`crd::Database`],
//! [`crd::DatabaseRole`], defined in `steward-database-api`) and [`register`] (the three
//! controllers). Each controller is a module with a `reconcile` that validates, builds with
//! pure functions, applies and writes status once:
//!
//! - [`cluster`]: a StatefulSet of one primary and replicas (each pod runs
//!   `steward-pg-instance`, which elects the primary through the cluster's Lease), its
//!   Services, Secrets, RBAC, ConfigMap and PodDisruptionBudget; rolling updates replace the
//!   replicas, switch over, then replace the old primary ([`cluster::rollout`]); continuous
//!   backup ([`cluster::backup`]); a raised major runs `pg_upgrade` ([`cluster::upgrade`]).
//! - [`database`]: a database and its owner role on a server reached through [`server`]
//!   (a `clusterRef` or an `external` server); drops it on delete if asked, after a dump.
//! - [`role`]: login roles with privileges and rotated passwords.
//!
//! With `--shards N` the three are sharded by cluster ([`sharding`]): a cluster's Databases
//! and DatabaseRoles (or an external server's) are on the cluster's (the server's) shard.
//!
//! What `spec.parameters` may hold is decided in [`parameters`] (the CRD's admission rules and
//! the controller's value checks come from the same tables).
//!
//! The SQL is built in [`sql`] (identifiers quoted by [`ident`], passwords sent as SCRAM
//! verifiers from [`password`]) and run by [`pg`].

#![forbid(unsafe_code)]
#![cfg_attr(test, allow(clippy::unwrap_used))]

pub mod cluster;
/// The custom resources and the instance contract, from their own crate (types only).
pub use steward_database_api as crd;
pub mod database;
mod error;
pub mod ident;
pub mod observe;
pub mod ownership;
pub use steward_database_api::parameters;
pub mod password;
pub mod pg;
pub mod role;
pub mod server;
pub mod sharding;
pub mod sql;
pub mod status;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;

pub use crd::{
    Database, DatabaseRole, DatabaseRoleSpec, DatabaseSpec, PostgresBackup, PostgresBackupSpec,
    PostgresCluster, PostgresClusterSpec, PostgresClusterStatus,
};
pub use error::Error;

/// The operator's name: field manager, Event reporter, Lease name.
pub const NAME: &str = steward_database_api::OPERATOR;

/// Every CustomResourceDefinition this operator owns, for `cargo xtask crdgen`.
pub fn crds() -> Vec<CustomResourceDefinition> {
    vec![
        crd::PostgresCluster::crd(),
        crd::PostgresBackup::crd(),
        crd::Database::crd(),
        crd::DatabaseRole::crd(),
    ]
}

/// Flags of the database-operator (next to steward-core's common flags).
#[derive(clap::Args, Clone, Debug)]
pub struct Options {
    /// How often converged objects are reconciled again, to correct drift made by hand
    /// (changed owners, dropped extensions, changed passwords).
    #[arg(long, default_value = "5m", value_parser = steward_core::cli::parse_duration)]
    pub resync_interval: Duration,

    /// Image with `pg_dump` for pre-delete dumps (a Database's `backup.image` wins).
    #[arg(long, default_value = "postgres:17")]
    pub backup_image: String,

    /// Image holding `steward-pg-instance` (the operator's own image ships it): each
    /// PostgresCluster pod's init container copies the instance manager from it.
    #[arg(
        long,
        env = "STEWARD_INSTANCE_IMAGE",
        default_value = "steward/database-operator:0.1.0"
    )]
    pub instance_image: String,

    /// The PgBouncer image of `spec.pooler` when it names none: any image with `pgbouncer`
    /// (1.19 or later) on its `PATH`, run as a non-root user.
    #[arg(
        long,
        env = "STEWARD_POOLER_IMAGE",
        default_value = "ghcr.io/cloudnative-pg/pgbouncer:1.24.1"
    )]
    pub pooler_image: String,

    /// Has the cluster's own PostgreSQL read every new `spec.parameters` (`postgres -C`, in a
    /// one-off Job of the instances' image) before any instance loads it. Off only where no
    /// pod can run (the tests on a control plane without a node).
    #[arg(long, env = "STEWARD_CHECK_PARAMETERS", default_value_t = true, action = clap::ArgAction::Set)]
    pub check_parameters: bool,
    /// How long each phase of a CA rotation lasts at least: the new CA trusted beside the
    /// old, then signing with the old still trusted. The time clients are given to reload
    /// the `ca.crt` of a cluster's Secrets.
    #[arg(long, default_value = "24h", value_parser = steward_core::cli::parse_duration)]
    pub ca_rotation_grace: Duration,
}

impl Default for Options {
    /// The defaults of every flag.
    fn default() -> Self {
        steward_core::cli::defaults()
    }
}

/// The database-operator, as steward-core runs it ([`steward_core::operator::main`]).
pub struct DatabaseOperator;

impl steward_core::operator::Definition for DatabaseOperator {
    const NAME: &'static str = NAME;
    const ABOUT: &'static str = "Manages PostgreSQL clusters, databases and roles";
    const COMPANIONS: &'static [&'static str] = &[
        steward_database_api::contract::BINARY,
        steward_database_api::contract::pooler::BINARY,
    ];
    const SAMPLES: &'static [&'static str] = &[
        "database-postgrescluster.yaml",
        "database-postgresbackup.yaml",
        "database.yaml",
        "database-role.yaml",
    ];
    type Options = Options;
    type Error = Error;

    fn crds() -> Vec<CustomResourceDefinition> {
        crds()
    }

    fn register(operator: &mut steward_core::Operator, options: Options) -> Result<(), Error> {
        register(operator, options)
    }
}

/// Shared state of the controllers.
#[derive(Clone)]
pub struct State {
    pub options: Options,
    /// The metadata of the children the operator applies, so an apply is skipped when a child
    /// is already as desired (`Children::ensure_cached`).
    pub children: ChildStores,
    /// `steward_sql_statements_total{controller}`.
    pub sql_statements: SqlStatements,
    /// The nodes whose change matters to each PostgresCluster, so a change of a Node wakes
    /// the clusters concerned.
    pub watched_nodes: WatchedNodes,
    /// When each cluster's pooler auth role was last found converged (checked again only
    /// when something changed or at the resync).
    pub pooler_auth: cluster::pooler::AuthChecks,
}

impl State {
    /// A state whose child caches no watch fills (a child read finds nothing, and an apply is
    /// then made rather than skipped): for driving one reconcile by hand, as a test does with
    /// a stale copy of an object.
    pub fn unwatched(options: Options) -> Self {
        Self {
            options,
            children: ChildStores::secrets_only(Cache::unfilled()),
            sql_statements: SqlStatements::default(),
            watched_nodes: WatchedNodes::default(),
            pooler_auth: cluster::pooler::AuthChecks::default(),
        }
    }
}

/// The nodes that matter to each PostgresCluster, as its last reconcile saw them: its
/// primary's (cordoned: a drain, switch over) and those its unscheduled instances' volumes
/// are pinned to (deleted: the volume is gone, replace the instance).
#[derive(Clone, Default)]
pub struct WatchedNodes(
    Arc<
        Mutex<
            HashMap<
                kube::runtime::reflector::ObjectRef<crd::PostgresCluster>,
                std::collections::BTreeSet<String>,
            >,
        >,
    >,
);

impl WatchedNodes {
    /// Records the nodes that matter to `cluster` (none: forgets it).
    pub fn record(
        &self,
        cluster: &crd::PostgresCluster,
        nodes: std::collections::BTreeSet<String>,
    ) {
        let Ok(mut map) = self.0.lock() else { return };
        let key = kube::runtime::reflector::ObjectRef::from_obj(cluster);
        if nodes.is_empty() {
            map.remove(&key);
        } else if map.get(&key) != Some(&nodes) {
            map.insert(key, nodes);
        }
    }

    /// The clusters `node` matters to.
    pub fn on(&self, node: &str) -> Vec<kube::runtime::reflector::ObjectRef<crd::PostgresCluster>> {
        self.0
            .lock()
            .map(|map| {
                map.iter()
                    .filter(|(_, nodes)| nodes.contains(node))
                    .map(|(c, _)| c.clone())
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// `steward_sql_statements_total{controller}`: the statements each controller ran that may
/// change a server (plans; not the catalog reads). A converged object adds none at resync.
#[derive(Clone, Default)]
pub struct SqlStatements(
    prometheus_client::metrics::family::Family<
        steward_core::metrics::ControllerLabels,
        prometheus_client::metrics::counter::Counter,
    >,
);

impl SqlStatements {
    /// The counter of the controller of `K` (named as steward-core names it: the kind in
    /// lower case). It shares its value with the family.
    pub fn of<K: kube::Resource<DynamicType = ()>>(
        &self,
    ) -> prometheus_client::metrics::counter::Counter {
        self.0
            .get_or_create(&steward_core::metrics::ControllerLabels {
                controller: K::kind(&()).to_lowercase(),
            })
            .clone()
    }
}

/// Metadata caches of the operator's children (label `app.kubernetes.io/managed-by`).
#[derive(Clone)]
pub struct ChildStores {
    pub secrets: Cache<k8s_openapi::api::core::v1::Secret>,
    pub config_maps: Cache<k8s_openapi::api::core::v1::ConfigMap>,
    pub services: Cache<k8s_openapi::api::core::v1::Service>,
    pub service_accounts: Cache<k8s_openapi::api::core::v1::ServiceAccount>,
    pub roles: Cache<k8s_openapi::api::rbac::v1::Role>,
    pub role_bindings: Cache<k8s_openapi::api::rbac::v1::RoleBinding>,
    pub statefulsets: Cache<k8s_openapi::api::apps::v1::StatefulSet>,
    /// The poolers (`spec.pooler`).
    pub deployments: Cache<k8s_openapi::api::apps::v1::Deployment>,
    pub pdbs: Cache<k8s_openapi::api::policy::v1::PodDisruptionBudget>,
}

impl ChildStores {
    /// The caches of a sharded Database or DatabaseRole controller, which reads only the
    /// Secrets': `secrets`, the other kinds' never filled (a read finds nothing and waits for
    /// no list; a child judged by one would only be applied once more).
    fn secrets_only(secrets: Cache<k8s_openapi::api::core::v1::Secret>) -> Self {
        Self {
            secrets,
            config_maps: Cache::unfilled(),
            services: Cache::unfilled(),
            service_accounts: Cache::unfilled(),
            roles: Cache::unfilled(),
            role_bindings: Cache::unfilled(),
            statefulsets: Cache::unfilled(),
            deployments: Cache::unfilled(),
            pdbs: Cache::unfilled(),
        }
    }
}

/// Runs `plan` on `client` as the controller of `K`: fenced by leadership and counted in
/// `steward_sql_statements_total` ([`pg::execute`]).
///
/// # Errors
/// Those of [`pg::execute`].
pub async fn run_plan<K: kube::Resource<DynamicType = ()>>(
    ctx: &steward_core::Context<State>,
    client: &tokio_postgres::Client,
    plan: &[String],
) -> Result<(), pg::PgError> {
    pg::execute(
        client,
        plan,
        &ctx.leadership,
        &ctx.data.sql_statements.of::<K>(),
    )
    .await
}

/// A metadata cache of one kind of child.
pub type Cache<K> = steward_core::controller::Cache<kube::core::PartialObjectMeta<K>>;

/// Adds the PostgresCluster, Database and DatabaseRole controllers to `operator`.
///
/// With `--shards N > 1` the three are sharded by server ([`sharding`]): a cluster, its
/// Databases and their DatabaseRoles (or every object of one external server) share a shard,
/// whose controllers watch and cache only that shard's objects and children, so one replica
/// writes for the whole cluster. The main leader labels PostgresClusters (steward-core's
/// labeller) and Databases and DatabaseRoles ([`sharding::label`]). Without it (`--shards 1`)
/// nothing of this runs.
///
/// # Errors
/// None today; the `Result` leaves room for checks of the options.
pub fn register(operator: &mut steward_core::Operator, options: Options) -> Result<(), Error> {
    let namespace = operator.args().watch_namespace.clone();
    let sql_statements = SqlStatements::default();
    operator.metrics().register(
        "steward_sql_statements",
        "Statements run on PostgreSQL servers that may change them (catalog reads are not counted); a converged object adds none",
        sql_statements.0.clone(),
    );
    let client = operator.client();
    let unsharded = (operator.shards() <= 1).then(|| {
        let (stores, watches) = children_caches(&client, namespace.as_deref(), None);
        (stores, Mutex::new(Some(watches)))
    });
    let wiring = Arc::new(Wiring {
        client,
        namespace: namespace.clone(),
        options,
        sql_statements,
        watched_nodes: WatchedNodes::default(),
        pooler_auth: cluster::pooler::AuthChecks::default(),
        unsharded,
    });

    // The per-cluster gauges read the PostgresCluster cache of each shard this replica holds
    // (the one cache when not sharded).
    let clusters = steward_core::metrics::Stores::default();
    cluster::metrics::register(&operator.metrics(), &clusters);
    let held = operator.shard_leaderships();
    let w = wiring.clone();
    operator.sharded_controller(
        move |shard| {
            let (controller, state) = w.clusters(shard);
            let leadership = shard
                .and_then(|i| held.get(usize::try_from(i).ok()?).cloned())
                .unwrap_or_else(steward_core::Leadership::always_leader);
            clusters.set(shard, controller.store(), leadership);
            (controller, state)
        },
        cluster::reconcile,
    );
    let w = wiring.clone();
    operator.sharded_controller(move |shard| w.databases(shard), database::reconcile);
    operator.sharded_controller(move |shard| wiring.roles(shard), role::reconcile);

    // Sharded: the main leader labels each object with its shard (nothing without sharding).
    operator.shard_labels::<PostgresCluster>(None, |m| Some(steward_core::shard::key_of(m)));
    let shards = operator.shards();
    if shards > 1 {
        let client = operator.client();
        operator.singleton(move |stop| {
            sharding::label(
                client.clone(),
                namespace.clone(),
                shards,
                stop.cancelled_owned(),
            )
        });
    }
    Ok(())
}

/// The watches filling [`ChildStores`], for the PostgresCluster controller to drive.
struct ChildWatches {
    secrets: Watch<k8s_openapi::api::core::v1::Secret>,
    config_maps: Watch<k8s_openapi::api::core::v1::ConfigMap>,
    services: Watch<k8s_openapi::api::core::v1::Service>,
    service_accounts: Watch<k8s_openapi::api::core::v1::ServiceAccount>,
    roles: Watch<k8s_openapi::api::rbac::v1::Role>,
    role_bindings: Watch<k8s_openapi::api::rbac::v1::RoleBinding>,
    statefulsets: Watch<k8s_openapi::api::apps::v1::StatefulSet>,
    deployments: Watch<k8s_openapi::api::apps::v1::Deployment>,
    pdbs: Watch<k8s_openapi::api::policy::v1::PodDisruptionBudget>,
}

/// The metadata watch of one kind of child.
type Watch<K> = steward_core::controller::Watch<kube::core::PartialObjectMeta<K>>;

/// The objects of `api`'s kind in `namespace` (every namespace when `None`).
fn scoped<K>(client: &kube::Client, namespace: Option<&str>) -> kube::Api<K>
where
    K: kube::Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>,
{
    match namespace {
        Some(ns) => kube::Api::namespaced(client.clone(), ns),
        None => kube::Api::all(client.clone()),
    }
}

/// The watch of the operator's own kinds: all of them, or shard `shard`'s.
fn own(shard: Option<u32>) -> kube::runtime::watcher::Config {
    let config = kube::runtime::watcher::Config::default();
    match steward_core::shard::narrow(None, shard) {
        Some(selector) => config.labels(&selector),
        None => config,
    }
}

/// The watch of the operator's children (its managed-by label): all of them, or shard
/// `shard`'s (steward-core's Children give each child its owner's shard label).
fn managed(shard: Option<u32>) -> kube::runtime::watcher::Config {
    let base = format!("{}={NAME}", steward_core::apply::MANAGED_BY_LABEL);
    let selector = steward_core::shard::narrow(Some(&base), shard).unwrap_or(base);
    kube::runtime::watcher::Config::default().labels(&selector)
}

/// The children's metadata caches (of shard `shard`, or all) and the watches filling them.
fn children_caches(
    client: &kube::Client,
    namespace: Option<&str>,
    shard: Option<u32>,
) -> (ChildStores, ChildWatches) {
    use steward_core::controller::{Owners, watch_metadata};
    let config = managed(shard);
    // Mapped to their owners through their owner references (`owns_watched`).
    const KEPT: Owners = Owners::Kept;
    let (secrets, secrets_watch) = watch_metadata(scoped(client, namespace), config.clone(), KEPT);
    let (config_maps, config_maps_watch) =
        watch_metadata(scoped(client, namespace), config.clone(), KEPT);
    let (services, services_watch) =
        watch_metadata(scoped(client, namespace), config.clone(), KEPT);
    let (service_accounts, service_accounts_watch) =
        watch_metadata(scoped(client, namespace), config.clone(), KEPT);
    let (roles, roles_watch) = watch_metadata(scoped(client, namespace), config.clone(), KEPT);
    let (role_bindings, role_bindings_watch) =
        watch_metadata(scoped(client, namespace), config.clone(), KEPT);
    let (statefulsets, statefulsets_watch) =
        watch_metadata(scoped(client, namespace), config.clone(), KEPT);
    let (deployments, deployments_watch) =
        watch_metadata(scoped(client, namespace), config.clone(), KEPT);
    let (pdbs, pdbs_watch) = watch_metadata(scoped(client, namespace), config, KEPT);
    (
        ChildStores {
            secrets,
            config_maps,
            services,
            service_accounts,
            roles,
            role_bindings,
            statefulsets,
            deployments,
            pdbs,
        },
        ChildWatches {
            secrets: secrets_watch,
            config_maps: config_maps_watch,
            services: services_watch,
            service_accounts: service_accounts_watch,
            roles: roles_watch,
            role_bindings: role_bindings_watch,
            statefulsets: statefulsets_watch,
            deployments: deployments_watch,
            pdbs: pdbs_watch,
        },
    )
}

/// What the three controllers are built from, for each shard (once, with `None`, without
/// sharding).
struct Wiring {
    client: kube::Client,
    namespace: Option<String>,
    options: Options,
    sql_statements: SqlStatements,
    watched_nodes: WatchedNodes,
    pooler_auth: cluster::pooler::AuthChecks,
    /// Without sharding: the children's caches the three controllers read, and the watches
    /// filling them, which the PostgresCluster controller takes (each wakes the controller
    /// owning that kind most). Sharded, each shard's controllers have their own, narrowed to
    /// the shard.
    unsharded: Option<(ChildStores, Mutex<Option<ChildWatches>>)>,
}

impl Wiring {
    fn api<K>(&self) -> kube::Api<K>
    where
        K: kube::Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>,
    {
        scoped(&self.client, self.namespace.as_deref())
    }

    fn state(&self, children: ChildStores) -> State {
        State {
            options: self.options.clone(),
            children,
            sql_statements: self.sql_statements.clone(),
            watched_nodes: self.watched_nodes.clone(),
            pooler_auth: self.pooler_auth.clone(),
        }
    }

    /// The PostgresCluster controller of `shard`: its children and its pods.
    fn clusters(&self, shard: Option<u32>) -> (steward_core::Controller<PostgresCluster>, State) {
        use k8s_openapi::api::batch::v1::Job;
        use k8s_openapi::api::core::v1::{Node, Pod};
        use kube::ResourceExt;
        use kube::core::PartialObjectMeta;
        use kube::runtime::reflector::ObjectRef;
        use kube::runtime::watcher::Config;

        // Without sharding `clusters(None)` is called once, and takes the shared watches.
        let taken = match (&self.unsharded, shard) {
            (Some((stores, watches)), None) => watches
                .lock()
                .ok()
                .and_then(|mut w| w.take())
                .map(|w| (stores.clone(), w)),
            _ => None,
        };
        let (children, watches) = taken
            .unwrap_or_else(|| children_caches(&self.client, self.namespace.as_deref(), shard));
        let watched_nodes = self.watched_nodes.clone();
        let controller = steward_core::Controller::new(self.api::<PostgresCluster>(), own(shard))
            .owns_watched(watches.statefulsets)
            .owns_watched(watches.deployments)
            // The major-upgrade and parameter-check Jobs. They are created without
            // steward-core's Children, so without a shard label: watched on every shard (one
            // of another shard's cluster names no object of this shard's cache: ignored).
            .owns(self.api::<Job>(), managed(None))
            .owns_watched(watches.services)
            .owns_watched(watches.config_maps)
            .owns_watched(watches.secrets)
            .owns_watched(watches.service_accounts)
            .owns_watched(watches.roles)
            .owns_watched(watches.role_bindings)
            .owns_watched(watches.pdbs)
            // Backups (a user's carry no shard label), pods (the StatefulSet's, unlabelled)
            // and Nodes wake the clusters they name, watched on every shard likewise.
            .watches(
                self.api::<PostgresBackup>(),
                Config::default(),
                |backup: PostgresBackup| {
                    backup.namespace().map(|ns| {
                        ObjectRef::<PostgresCluster>::new(&backup.spec.cluster).within(&ns)
                    })
                },
            )
            .watches_metadata(
                self.api::<Pod>(),
                Config::default().labels(cluster::build::CLUSTER_LABEL),
                |pod: PartialObjectMeta<Pod>| {
                    let cluster = pod.labels().get(cluster::build::CLUSTER_LABEL).cloned();
                    cluster
                        .zip(pod.namespace())
                        .map(|(c, ns)| ObjectRef::<PostgresCluster>::new(&c).within(&ns))
                },
            )
            // A Node changed (cordoned for a drain, deleted with the volumes on it): the
            // clusters it matters to.
            .watches_metadata(
                kube::Api::<Node>::all(self.client.clone()),
                Config::default(),
                move |node: PartialObjectMeta<Node>| watched_nodes.on(&node.name_any()),
            );
        (controller, self.state(children))
    }

    /// The controller of a Database or DatabaseRole kind `K` for `shard`, owning its Secrets,
    /// with its store (for the mappers of its other watches) and the children's caches it
    /// reads: without sharding the shared caches (filled by the PostgresCluster controller),
    /// sharded its own Secret cache, narrowed to the shard, whose watch wakes it.
    fn owning_secrets<K>(
        &self,
        shard: Option<u32>,
    ) -> (
        steward_core::Controller<K>,
        kube::runtime::reflector::Store<K>,
        ChildStores,
    )
    where
        K: kube::Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
            + Clone
            + serde::de::DeserializeOwned
            + std::fmt::Debug
            + Send
            + Sync
            + 'static,
    {
        use k8s_openapi::api::core::v1::Secret;

        let controller = steward_core::Controller::new(self.api::<K>(), own(shard));
        let store = controller.store();
        match (&self.unsharded, shard) {
            (Some((stores, _)), None) => (
                controller.owns(self.api::<Secret>(), managed(None)),
                store,
                stores.clone(),
            ),
            _ => {
                let (secrets, watch) = steward_core::controller::watch_metadata(
                    self.api(),
                    managed(shard),
                    steward_core::controller::Owners::Kept,
                );
                (
                    controller.owns_watched(watch),
                    store,
                    ChildStores::secrets_only(secrets),
                )
            }
        }
    }

    /// The Database controller of `shard`: its Secret and backup Job; woken by its
    /// DatabaseRoles (deletion waits for them) and by its PostgresCluster.
    fn databases(&self, shard: Option<u32>) -> (steward_core::Controller<Database>, State) {
        use k8s_openapi::api::batch::v1::Job;
        use kube::ResourceExt;
        use kube::runtime::reflector::ObjectRef;

        let (controller, store, children) = self.owning_secrets::<Database>(shard);
        let controller = controller
            .owns(self.api::<Job>(), managed(shard))
            .watches(
                self.api::<DatabaseRole>(),
                own(shard),
                |role: DatabaseRole| {
                    role.namespace().map(|ns| {
                        ObjectRef::<Database>::new(&role.spec.database_ref.name).within(&ns)
                    })
                },
            )
            .watches_metadata(
                self.api::<PostgresCluster>(),
                own(shard),
                referring::<_, PostgresCluster>(store, |db: &Database| {
                    db.spec.cluster_ref.as_ref().map(|r| r.name.as_str())
                }),
            );
        (controller, self.state(children))
    }

    /// The DatabaseRole controller of `shard`: its Secret; woken by its Database.
    fn roles(&self, shard: Option<u32>) -> (steward_core::Controller<DatabaseRole>, State) {
        let (controller, store, children) = self.owning_secrets::<DatabaseRole>(shard);
        let controller = controller.watches_metadata(
            self.api::<Database>(),
            own(shard),
            referring::<_, Database>(store, |r: &DatabaseRole| {
                Some(r.spec.database_ref.name.as_str())
            }),
        );
        (controller, self.state(children))
    }
}

/// A mapper for a watch of `Target`s: the objects of `store` in the same namespace whose
/// reference (`names`) is the changed target's name.
fn referring<K, Target>(
    store: kube::runtime::reflector::Store<K>,
    names: impl Fn(&K) -> Option<&str> + Send + Sync + 'static,
) -> impl Fn(kube::core::PartialObjectMeta<Target>) -> Vec<kube::runtime::reflector::ObjectRef<K>>
+ Send
+ Sync
+ 'static
where
    K: kube::Resource<DynamicType = ()> + Clone + Send + Sync + 'static,
    Target: kube::Resource<DynamicType = ()>,
{
    steward_core::index::referring(store, move |obj: &K, namespace, name| {
        obj.meta().namespace.as_deref() == Some(namespace) && names(obj) == Some(name)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn patterns(value: &serde_json::Value, out: &mut Vec<String>) {
        match value {
            serde_json::Value::Object(map) => {
                for (k, v) in map {
                    if k == "pattern" {
                        out.push(v.as_str().unwrap_or_default().to_string());
                    }
                    patterns(v, out);
                }
            }
            serde_json::Value::Array(items) => items.iter().for_each(|v| patterns(v, out)),
            _ => {}
        }
    }

    /// Steward's conventions (checked for every operator by the registry's test), and what
    /// is this operator's own: a short name for each, and the columns each kind shows.
    #[test]
    fn every_crd_has_a_short_name_and_its_columns() {
        for crd in crds() {
            let names = &crd.spec.names;
            assert!(
                names.short_names.as_ref().is_some_and(|s| !s.is_empty()),
                "{}",
                names.kind
            );
            let columns: Vec<&str> = crd.spec.versions[0]
                .additional_printer_columns
                .iter()
                .flatten()
                .map(|c| c.name.as_str())
                .collect();
            // A backup has a phase, not readiness.
            let wanted: &[&str] = if names.kind == "PostgresBackup" {
                &["Cluster", "Phase"]
            } else {
                &["Ready", "Phase"]
            };
            for &wanted in wanted {
                assert!(
                    columns.contains(&wanted),
                    "{} lacks column {wanted}: {columns:?}",
                    names.kind
                );
            }
        }
    }

    #[test]
    fn schema_patterns_are_the_ones_code_validates_with() {
        let mut found = Vec::new();
        for crd in crds() {
            patterns(&serde_json::to_value(&crd).unwrap(), &mut found);
        }
        let allowed = [
            ident::NAME_PATTERN,
            ident::EXTENSION_PATTERN,
            "^[0-9]{1,7}(s|m|h)$",
            // The object store of a cluster's backups (used by the S3 client, never in SQL).
            r"^https?://[^\s/]+(/.*)?$",
            "^[a-z0-9][a-z0-9.-]*[a-z0-9]$",
            "^[A-Za-z0-9._/-]+$",
            // `spec.placement.topologyKey`, a label key: never in SQL, and the API server
            // checks it again in the StatefulSet's pod template (an apply it refuses leaves
            // `Ready=False` naming it).
            r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$",
            // `spec.replica.promotionToken`, `<timeline>:<LSN>`: parsed by the instance
            // manager as a WAL end, never in SQL.
            r"^[0-9]+:[0-9A-Fa-f]{1,8}/[0-9A-Fa-f]{1,8}$",
        ];
        assert!(
            found
                .iter()
                .filter(|p| p.as_str() == ident::NAME_PATTERN)
                .count()
                >= 4,
            "{found:?}"
        );
        for p in &found {
            assert!(allowed.contains(&p.as_str()), "unexpected pattern {p}");
        }
        let text = serde_json::to_string(&crds()).unwrap();
        assert!(text.contains("\"maxLength\":63"));
        for message in [
            "name is immutable",
            "roleName is immutable",
            "exactly one of clusterRef and external must be set",
            "storage is immutable",
        ] {
            assert!(text.contains(message), "CEL rule with message {message:?}");
        }
    }
}
