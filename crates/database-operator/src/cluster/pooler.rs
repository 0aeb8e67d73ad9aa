//! `spec.pooler`: PgBouncer in front of the primary. Each pod runs `steward-pooler` as PID 1
//! (copied from the operator's image like the instance manager), which configures and runs
//! PgBouncer, points it at the primary's pod and pauses it across planned switchovers (the
//! protocol is [`steward_database_api::contract::pooler`]). This module builds the pooler's
//! children (pure) and the plan of SQL that gives PgBouncer's `auth_query` its role and
//! lookup function in the `postgres` database ([`auth_plan`]).
//!
//! Children: the Deployment and Service `<cluster>-pooler(-rw)`, a PodDisruptionBudget, the
//! auth role's password (Secret `<cluster>-pooler`), a certificate of the cluster's CA for
//! the Service's names (Secret `<cluster>-pooler-tls`, issued beside the instances' one), the
//! agents' identity and rights (read the Lease and the pods, write their own key of the state
//! ConfigMap), and that ConfigMap.

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::apps::v1::{
    Deployment, DeploymentSpec, DeploymentStrategy, RollingUpdateDeployment,
};
use k8s_openapi::api::core::v1::{
    Affinity, ConfigMap, Container, KeyToPath, PodAffinityTerm, PodAntiAffinity,
    PodSecurityContext, PodSpec, PodTemplateSpec, Secret, SecretVolumeSource, SecurityContext,
    Service, ServiceAccount, ServicePort, ServiceSpec, Volume, WeightedPodAffinityTerm,
};
use k8s_openapi::api::policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::ResourceExt;
use steward_core::conditions::Wanted;
use steward_database_api::contract::{self, pooler};

use super::build::{
    STEWARD_DIR, TLS_DIR, binding, copier, env, field, http_probe, meta, pull_policy,
    read_only_mount, rule, scratch_volume, steward_mount, tcp_port,
};
use crate::crd::{Pooler, PostgresCluster};
use crate::password::Password;

/// Where the pooler agent is in the operator's image.
pub const BINARY_IN_IMAGE: &str = "/usr/local/bin/steward-pooler";
/// Where the pods mount the auth role's password (`password`).
const AUTH_DIR: &str = "/etc/steward-pooler";
/// The default PgBouncer pool size and client limit (`spec.pooler` leaves them unset).
pub const DEFAULT_POOL_SIZE: i32 = 20;
pub const DEFAULT_MAX_CLIENT_CONNECTIONS: i32 = 1000;
/// A PgBouncer pod's user in testenv's image and in PgBouncer's usual images.
const PGBOUNCER_UID: i64 = 70;

/// The names of a cluster's pooler children.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Names {
    /// Deployment, ServiceAccount, Role, RoleBinding, PodDisruptionBudget, and the auth
    /// role's password Secret.
    pub pooler: String,
    /// The clients' Service.
    pub rw: String,
    pub tls_secret: String,
    pub state: String,
}

impl Names {
    pub fn of(cluster: &str) -> Self {
        Self {
            pooler: format!("{cluster}-pooler"),
            rw: format!("{cluster}-pooler-rw"),
            tls_secret: format!("{cluster}-pooler-tls"),
            state: pooler::state_config_map(cluster),
        }
    }
}

/// Labels of the pooler pods (never [`contract::CLUSTER_LABEL`]: they are no instances).
pub fn pod_labels(cluster: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (
            "app.kubernetes.io/name".to_string(),
            "pgbouncer".to_string(),
        ),
        (
            "app.kubernetes.io/instance".to_string(),
            cluster.to_string(),
        ),
        (pooler::LABEL.to_string(), cluster.to_string()),
    ])
}

/// The names the pooler's certificate is for: its Service, short and qualified.
pub fn tls_names(cluster: &str, namespace: &str) -> Vec<String> {
    let service = Names::of(cluster).rw;
    vec![
        service.clone(),
        format!("{service}.{namespace}"),
        format!("{service}.{namespace}.svc"),
        format!("{service}.{namespace}.svc.cluster.local"),
    ]
}

/// The auth role's password (`password`), generated once.
pub fn auth_secret(cluster: &PostgresCluster, password: &Password) -> Secret {
    let names = Names::of(&cluster.name_any());
    Secret {
        metadata: meta(cluster, &names.pooler),
        type_: Some("Opaque".into()),
        data: Some(BTreeMap::from([
            (
                "username".to_string(),
                ByteString(pooler::AUTH_USER.as_bytes().to_vec()),
            ),
            (
                "password".to_string(),
                ByteString(password.expose().as_bytes().to_vec()),
            ),
        ])),
        ..Default::default()
    }
}

/// The ConfigMap where the agents acknowledge pauses (each writes its own key).
pub fn state_config_map(cluster: &PostgresCluster) -> ConfigMap {
    ConfigMap {
        metadata: meta(cluster, &Names::of(&cluster.name_any()).state),
        ..Default::default()
    }
}

pub fn service_account(cluster: &PostgresCluster) -> ServiceAccount {
    ServiceAccount {
        metadata: meta(cluster, &Names::of(&cluster.name_any()).pooler),
        ..Default::default()
    }
}

/// What an agent may do, and nothing more: read the cluster's Lease and the pods (where the
/// primary is), and write the state ConfigMap (its acknowledgements). It cannot take the
/// Lease, label a pod or read a Secret: a compromised pooler pod can lie about a pause (the
/// switchover then cuts its clients' transactions, as without a pooler), not move the
/// primary.
pub fn role(cluster: &PostgresCluster) -> Role {
    let name = cluster.name_any();
    let names = Names::of(&name);
    Role {
        metadata: meta(cluster, &names.pooler),
        rules: Some(vec![
            rule(
                &["coordination.k8s.io"],
                &["leases"],
                &["get", "list", "watch"],
                Some(vec![contract::lease_name(&name)]),
            ),
            rule(&[""], &["pods"], &["get", "list", "watch"], None),
            rule(
                &[""],
                &["configmaps"],
                &["get", "patch"],
                Some(vec![names.state.clone()]),
            ),
        ]),
    }
}

pub fn role_binding(cluster: &PostgresCluster) -> RoleBinding {
    binding(cluster, &Names::of(&cluster.name_any()).pooler)
}

/// The clients' Service `<cluster>-pooler-rw`.
pub fn service(cluster: &PostgresCluster) -> Service {
    let name = cluster.name_any();
    Service {
        metadata: meta(cluster, &Names::of(&name).rw),
        spec: Some(ServiceSpec {
            type_: Some("ClusterIP".into()),
            selector: Some(pod_labels(&name)),
            ports: Some(vec![ServicePort {
                name: Some("pgbouncer".into()),
                port: i32::from(pooler::PORT),
                target_port: Some(IntOrString::Int(i32::from(pooler::PORT))),
                protocol: Some("TCP".into()),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// All pooler pods but one stay through a drain (none is kept with a single one: it may go).
pub fn disruption_budget(cluster: &PostgresCluster, spec: &Pooler) -> PodDisruptionBudget {
    let name = cluster.name_any();
    PodDisruptionBudget {
        metadata: meta(cluster, &Names::of(&name).pooler),
        spec: Some(PodDisruptionBudgetSpec {
            min_available: Some(IntOrString::Int((spec.instances - 1).max(0))),
            selector: Some(LabelSelector {
                match_labels: Some(pod_labels(&name)),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The PgBouncer pods: `steward-pooler` (copied by an init container from `instance_image`,
/// the operator's) runs PgBouncer of `spec.image` (else `default_image`). A new template
/// rolls one pod at a time, the next only once the new one is ready (`maxUnavailable: 0`);
/// an old pod's PgBouncer finishes its clients' transactions before it exits (the agent
/// stops it with SIGINT, within the grace period).
pub fn deployment(
    cluster: &PostgresCluster,
    spec: &Pooler,
    instance_image: &str,
    default_image: &str,
) -> Deployment {
    let name = cluster.name_any();
    let names = Names::of(&name);
    let labels = pod_labels(&name);
    let mut copier = copier(cluster, "pooler-agent", instance_image, BINARY_IN_IMAGE);
    copier.security_context = Some(restricted());
    let secret_volume = |volume: &str, secret: &str, keys: &[&str]| Volume {
        name: volume.into(),
        secret: Some(SecretVolumeSource {
            secret_name: Some(secret.into()),
            items: Some(
                keys.iter()
                    .map(|k| KeyToPath {
                        key: (*k).into(),
                        path: (*k).into(),
                        ..Default::default()
                    })
                    .collect(),
            ),
            default_mode: Some(0o440),
            ..Default::default()
        }),
        ..Default::default()
    };
    Deployment {
        metadata: meta(cluster, &names.pooler),
        spec: DeploymentSpec {
            replicas: Some(spec.instances),
            selector: LabelSelector {
                match_labels: Some(labels.clone()),
                ..Default::default()
            },
            strategy: Some(DeploymentStrategy {
                type_: Some("RollingUpdate".into()),
                rolling_update: Some(RollingUpdateDeployment {
                    max_unavailable: Some(IntOrString::Int(0)),
                    max_surge: Some(IntOrString::Int(1)),
                }),
            }),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(labels.clone()),
                    ..Default::default()
                }),
                spec: Some(PodSpec {
                    service_account_name: Some(names.pooler.clone()),
                    init_containers: Some(vec![copier]),
                    containers: vec![pgbouncer(cluster, spec, default_image)],
                    security_context: Some(PodSecurityContext {
                        run_as_user: Some(PGBOUNCER_UID),
                        run_as_group: Some(PGBOUNCER_UID),
                        fs_group: Some(PGBOUNCER_UID),
                        run_as_non_root: Some(true),
                        ..Default::default()
                    }),
                    // PgBouncer's clients finish their transactions (SIGINT) within it.
                    termination_grace_period_seconds: Some(30),
                    affinity: Some(Affinity {
                        pod_anti_affinity: Some(PodAntiAffinity {
                            preferred_during_scheduling_ignored_during_execution: Some(vec![
                                WeightedPodAffinityTerm {
                                    weight: 100,
                                    pod_affinity_term: PodAffinityTerm {
                                        topology_key: "kubernetes.io/hostname".into(),
                                        label_selector: Some(LabelSelector {
                                            match_labels: Some(labels),
                                            ..Default::default()
                                        }),
                                        ..Default::default()
                                    },
                                },
                            ]),
                            ..Default::default()
                        }),
                        ..Default::default()
                    }),
                    volumes: Some(vec![
                        scratch_volume(),
                        secret_volume("auth", &names.pooler, &["password"]),
                        secret_volume("tls", &names.tls_secret, &["tls.crt", "tls.key", "ca.crt"]),
                    ]),
                    ..Default::default()
                }),
            },
            ..Default::default()
        },
        ..Default::default()
    }
}

/// A container that may not gain privileges nor write its root filesystem.
fn restricted() -> SecurityContext {
    SecurityContext {
        allow_privilege_escalation: Some(false),
        read_only_root_filesystem: Some(true),
        ..Default::default()
    }
}

/// The PgBouncer container: `steward-pooler` (from the scratch volume) runs PgBouncer of
/// `spec.image`, else `default_image`.
fn pgbouncer(cluster: &PostgresCluster, spec: &Pooler, default_image: &str) -> Container {
    let probe = |path: &str, period: i32, failures: i32| {
        http_probe(pooler::HTTP_PORT, path, period, failures)
    };
    Container {
        name: "pgbouncer".into(),
        image: Some(
            spec.image
                .clone()
                .unwrap_or_else(|| default_image.to_string()),
        ),
        image_pull_policy: pull_policy(cluster),
        command: Some(vec![format!("{STEWARD_DIR}/bin/{}", pooler::BINARY)]),
        args: Some(vec![
            "--pool-mode".into(),
            spec.pool_mode.as_pgbouncer().into(),
            "--default-pool-size".into(),
            spec.default_pool_size
                .unwrap_or(DEFAULT_POOL_SIZE)
                .to_string(),
            "--max-client-conn".into(),
            spec.max_client_connections
                .unwrap_or(DEFAULT_MAX_CLIENT_CONNECTIONS)
                .to_string(),
            "--run-dir".into(),
            format!("{STEWARD_DIR}/run"),
            "--auth-password-file".into(),
            format!("{AUTH_DIR}/password"),
            "--tls-dir".into(),
            TLS_DIR.into(),
        ]),
        env: Some(vec![
            field("POD_NAME", "metadata.name"),
            field("POD_NAMESPACE", "metadata.namespace"),
            env("CLUSTER_NAME", cluster.name_any()),
        ]),
        ports: Some(vec![
            tcp_port("pgbouncer", i32::from(pooler::PORT)),
            tcp_port("pooler", i32::from(pooler::HTTP_PORT)),
        ]),
        readiness_probe: Some(probe("/readyz", 1, 2)),
        liveness_probe: Some(probe("/healthz", 5, 3)),
        volume_mounts: Some(vec![
            steward_mount(),
            read_only_mount("auth", AUTH_DIR),
            read_only_mount("tls", TLS_DIR),
        ]),
        security_context: Some(restricted()),
        ..Default::default()
    }
}

/// What the `postgres` database holds of the pooler's authentication, read before deciding.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AuthSeen {
    /// `pg_authid.rolpassword` of [`pooler::AUTH_USER`], if the role exists (`Some(None)`: it
    /// exists without a password).
    pub role: Option<Option<String>>,
    /// Whether the role may log in, and is nothing more than a login.
    pub role_is_plain_login: bool,
    /// The lookup function's comment (its version), if it exists.
    pub lookup_version: Option<String>,
}

/// SQL that reads [`AuthSeen`] (one row).
pub const AUTH_OBSERVE_SQL: &str = "SELECT \
    (SELECT rolpassword FROM pg_authid WHERE rolname = $1) AS password, \
    EXISTS (SELECT 1 FROM pg_authid WHERE rolname = $1) AS role_exists, \
    COALESCE((SELECT rolcanlogin AND NOT rolsuper AND NOT rolcreaterole AND NOT rolcreatedb \
        AND NOT rolreplication AND NOT rolbypassrls FROM pg_authid WHERE rolname = $1), false) AS plain, \
    (SELECT obj_description(p.oid, 'pg_proc') FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace \
        WHERE n.nspname = 'steward_pooler' AND p.proname = 'lookup') AS lookup";

/// The statements that make the `postgres` database match: the auth role with the Secret's
/// password (a plain login, nothing more), and the lookup function, which returns a login
/// role's name and password verifier — never a superuser's, a replication role's or one of
/// Steward's own (`steward_*`), so none of them can log in through the pooler, and a role
/// past its `VALID UNTIL` gets no verifier. Empty when it matches: a converged cluster runs
/// no statement.
pub fn auth_plan(seen: &AuthSeen, password: &Password) -> Vec<String> {
    let user = pooler::AUTH_USER;
    let quoted = crate::ident::quote_literal(&password.scram_verifier());
    let mut plan = Vec::new();
    match &seen.role {
        None => plan.push(format!(
            "CREATE ROLE {user} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS NOINHERIT PASSWORD {quoted}"
        )),
        Some(stored) => {
            if !seen.role_is_plain_login {
                plan.push(format!(
                    "ALTER ROLE {user} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS NOINHERIT"
                ));
            }
            if !stored
                .as_deref()
                .is_some_and(|s| crate::password::verifies(s, password))
            {
                plan.push(format!("ALTER ROLE {user} PASSWORD {quoted}"));
            }
        }
    }
    if seen.lookup_version.as_deref() != Some(pooler::LOOKUP_VERSION) {
        plan.extend(pooler::lookup_sql());
    }
    plan
}

/// The condition type: whether the pooler serves.
pub const POOLER_READY: &str = "PoolerReady";

/// Where the pooler stands, for [`POOLER_READY`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Pooled {
    /// `spec.pooler` is unset.
    NotAsked,
    /// The auth role or lookup function could not be set up (the primary is not ready, or
    /// the statement failed): PgBouncer cannot log clients in yet.
    AuthPending(String),
    /// Ready pods out of those asked for.
    Pods { ready: i32, wanted: i32 },
    /// The cluster is a standby following this source (`s3://…`): its primary is read-only
    /// and its roles are its source's, so the auth role waits for the promotion.
    Standby(String),
}

impl Pooled {
    /// The [`POOLER_READY`] condition; `None` removes it.
    pub fn condition(&self) -> Option<Wanted> {
        match self {
            Pooled::NotAsked => None,
            Pooled::AuthPending(why) => Some(Wanted::fails(
                "AuthPending",
                format!("PgBouncer's auth_query role is not set up yet: {why}"),
            )),
            Pooled::Pods { ready, wanted } if ready >= wanted => Some(Wanted::holds(
                "Serving",
                format!("{ready} PgBouncer pod(s) ready"),
            )),
            Pooled::Pods { ready, wanted } => Some(Wanted::fails(
                "PodsNotReady",
                format!("{ready} of {wanted} PgBouncer pods ready"),
            )),
            Pooled::Standby(source) => Some(Wanted::fails(
                "Standby",
                format!(
                    "PgBouncer's auth_query role is set up once the cluster is promoted: a standby of {source} accepts no writes, and its roles (the auth role's password included) are its source's, so PgBouncer may not log clients in until then"
                ),
            )),
        }
    }
}

/// Applies the pooler's children, or deletes them once `spec.pooler` is unset. Returns the
/// auth role's password (generated once) when the pooler is asked for.
///
/// # Errors
/// [`Error`] naming the child that could not be read, applied or deleted.
pub async fn apply(
    ctx: &steward_core::Context<crate::State>,
    children: &steward_core::apply::Children,
    secrets: &kube::Api<Secret>,
    cluster: &PostgresCluster,
) -> Result<Option<Password>, crate::Error> {
    let cached = &ctx.data.children;
    let names = Names::of(&cluster.name_any());
    let Some(spec) = &cluster.spec.pooler else {
        let ns = cluster.namespace();
        let ns = ns.as_deref();
        let key =
            kube::runtime::reflector::ObjectRef::new(&names.pooler).within(ns.unwrap_or_default());
        let present = cached.deployments.get(&key).is_some()
            || cached
                .config_maps
                .get(
                    &kube::runtime::reflector::ObjectRef::new(&names.state)
                        .within(ns.unwrap_or_default()),
                )
                .is_some();
        if present {
            children.delete::<Deployment>(ns, &names.pooler).await?;
            children.delete::<Service>(ns, &names.rw).await?;
            children
                .delete::<PodDisruptionBudget>(ns, &names.pooler)
                .await?;
            children.delete::<RoleBinding>(ns, &names.pooler).await?;
            children.delete::<Role>(ns, &names.pooler).await?;
            children.delete::<ServiceAccount>(ns, &names.pooler).await?;
            children.delete::<Secret>(ns, &names.tls_secret).await?;
            children.delete::<Secret>(ns, &names.pooler).await?;
            children.delete::<ConfigMap>(ns, &names.state).await?;
        }
        return Ok(None);
    };
    let password = super::existing_password(secrets, cluster, &names.pooler).await?;
    children
        .ensure_cached(&cached.secrets, auth_secret(cluster, &password))
        .await?;
    children
        .ensure_cached(&cached.config_maps, state_config_map(cluster))
        .await?;
    children
        .ensure_cached(&cached.service_accounts, service_account(cluster))
        .await?;
    children.ensure_cached(&cached.roles, role(cluster)).await?;
    children
        .ensure_cached(&cached.role_bindings, role_binding(cluster))
        .await?;
    let options = &ctx.data.options;
    children
        .ensure_cached(
            &cached.deployments,
            deployment(
                cluster,
                spec,
                &options.instance_image,
                &options.pooler_image,
            ),
        )
        .await?;
    children
        .ensure_cached(&cached.services, service(cluster))
        .await?;
    children
        .ensure_cached(&cached.pdbs, disruption_budget(cluster, spec))
        .await?;
    Ok(Some(password))
}

/// Sets up the auth role and lookup function on the primary (its pod's IP, when it is
/// ready) and reads how many PgBouncer pods are ready. Nothing is tried on a standby that
/// follows its source (its primary is read-only): [`Pooled::Standby`].
///
/// # Errors
/// [`crate::Error::Read`] when the Deployment cannot be read; a failed SQL step is no error
/// (the condition says it, and the next reconcile retries).
pub async fn serve(
    ctx: &steward_core::Context<crate::State>,
    cluster: &PostgresCluster,
    namespace: &str,
    ready_primary: Option<&str>,
    credentials: &super::Credentials,
) -> Result<Pooled, crate::Error> {
    let (Some(spec), Some(auth)) = (&cluster.spec.pooler, &credentials.pooler) else {
        ctx.data.pooler_auth.forget(&check_key(cluster));
        return Ok(Pooled::NotAsked);
    };
    if let Some(source) = super::standby::follows(&cluster.spec) {
        // Checked afresh once it is promoted.
        ctx.data.pooler_auth.forget(&check_key(cluster));
        return Ok(Pooled::Standby(source.url()));
    }
    match ready_primary {
        Some(primary_ip) => {
            let (checks, key) = (&ctx.data.pooler_auth, check_key(cluster));
            let resync = ctx.data.options.resync_interval;
            if !checks.fresh(&key, primary_ip, auth, resync) {
                // The primary's pod, not the `-rw` Service: no wait for the Service to follow
                // a new primary, and no cluster DNS needed. Its certificate names the
                // Services, not the IP: the CA is verified, as the instances verify each other.
                let server = crate::pg::Server {
                    host: primary_ip.to_string(),
                    port: super::build::PORT as u16,
                    ssl_mode: crate::crd::SslMode::VerifyCa,
                    admin_user: "postgres".into(),
                    admin_password: credentials.superuser.clone(),
                    admin_database: "postgres".into(),
                    ca_pem: Some(credentials.ca_bundle.as_bytes().to_vec()),
                };
                if let Err(why) = ensure_auth(ctx, &server, auth).await {
                    checks.forget(&key);
                    return Ok(Pooled::AuthPending(why));
                }
                checks.record(&key, primary_ip, auth);
            }
        }
        // No ready primary for a moment (a switchover, a failover): the auth role set up
        // before still serves, so the condition says how the pods are (PgBouncer waits, paused
        // or reconnecting), and the role is checked again once a primary is ready.
        None if auth_set_up_before(cluster) => {}
        None => return Ok(Pooled::AuthPending("the primary is not ready".into())),
    }
    // Read: the children's cache holds the Deployment's metadata only.
    let deployments: kube::Api<Deployment> = kube::Api::namespaced(ctx.client.clone(), namespace);
    let name = Names::of(&cluster.name_any()).pooler;
    let ready = deployments
        .get_opt(&name)
        .await
        .map_err(|source| crate::Error::Read {
            what: format!("Deployment {name}"),
            source,
        })?
        .and_then(|d| d.status?.ready_replicas)
        .unwrap_or(0);
    Ok(Pooled::Pods {
        ready,
        wanted: spec.instances,
    })
}

/// When each cluster's auth role and lookup function were last found converged, on which
/// primary and with which password: checked again (a superuser connection to the primary)
/// only once [`AuthChecks::fresh`] says the check is stale — a new primary, a new password, or
/// `within` (the resync interval) passed — instead of at every reconcile of a rollout.
/// Drift (someone altered the role or the function) is repaired within that interval.
#[derive(Clone, Debug, Default)]
pub struct AuthChecks(std::sync::Arc<std::sync::Mutex<std::collections::HashMap<String, Checked>>>);

/// One cluster's last converged check.
#[derive(Clone, Debug)]
struct Checked {
    primary: String,
    password: [u8; 32],
    at: std::time::Instant,
}

fn digest(password: &Password) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(password.expose().as_bytes()).into()
}

impl AuthChecks {
    fn checks(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<String, Checked>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether cluster `key`'s auth was found converged on `primary` with `password` less
    /// than `within` ago.
    pub fn fresh(
        &self,
        key: &str,
        primary: &str,
        password: &Password,
        within: std::time::Duration,
    ) -> bool {
        self.checks().get(key).is_some_and(|c| {
            c.primary == primary && c.password == digest(password) && c.at.elapsed() < within
        })
    }

    /// Records that cluster `key`'s auth was found converged on `primary` with `password`.
    pub fn record(&self, key: &str, primary: &str, password: &Password) {
        let checked = Checked {
            primary: primary.to_string(),
            password: digest(password),
            at: std::time::Instant::now(),
        };
        self.checks().insert(key.to_string(), checked);
    }

    /// Forgets cluster `key`'s check (it failed, or the pooler went).
    pub fn forget(&self, key: &str) {
        self.checks().remove(key);
    }
}

/// Whether the auth role and lookup function were set up by an earlier reconcile: the last
/// [`POOLER_READY`] written says so (any reason past `AuthPending`).
fn auth_set_up_before(cluster: &PostgresCluster) -> bool {
    cluster
        .status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == POOLER_READY))
        .is_some_and(|c| c.reason == "Serving" || c.reason == "PodsNotReady")
}

/// The key of `cluster` in [`AuthChecks`]: its UID (a cluster deleted and created again
/// under its name is checked afresh).
fn check_key(cluster: &PostgresCluster) -> String {
    cluster.uid().unwrap_or_else(|| {
        format!(
            "{}/{}",
            cluster.namespace().unwrap_or_default(),
            cluster.name_any()
        )
    })
}

/// Observe, decide ([`auth_plan`]), execute, on the `postgres` database; the error as text.
async fn ensure_auth(
    ctx: &steward_core::Context<crate::State>,
    server: &crate::pg::Server,
    password: &Password,
) -> Result<(), String> {
    let mut reachable = None;
    let client = crate::pg::connect_admin(server, &ctx.leadership, &mut reachable)
        .await
        .map_err(|e| steward_core::chain(&e))?;
    let row = client
        .query_one(AUTH_OBSERVE_SQL, &[&pooler::AUTH_USER])
        .await
        .map_err(|e| format!("reading the auth role: {}", steward_core::chain(&e)))?;
    let exists: bool = row.get("role_exists");
    let seen = AuthSeen {
        role: exists.then(|| row.get::<_, Option<String>>("password")),
        role_is_plain_login: row.get("plain"),
        lookup_version: row.get("lookup"),
    };
    let plan = auth_plan(&seen, password);
    crate::run_plan::<PostgresCluster>(ctx, &client, &plan)
        .await
        .map_err(|e| steward_core::chain(&e))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The auth role is checked again on a new primary, with a new password, once the
    /// interval passed, and after a failure; not at every reconcile in between.
    #[test]
    fn the_auth_role_is_checked_again_only_when_something_changed() {
        let checks = AuthChecks::default();
        let (a, b) = (Password::generate(), Password::generate());
        let hour = std::time::Duration::from_secs(3600);
        assert!(
            !checks.fresh("uid", "198.18.0.1", &a, hour),
            "never checked"
        );
        checks.record("uid", "198.18.0.1", &a);
        assert!(checks.fresh("uid", "198.18.0.1", &a, hour));
        assert!(
            !checks.fresh("uid", "198.18.0.2", &a, hour),
            "a new primary"
        );
        assert!(
            !checks.fresh("uid", "198.18.0.1", &b, hour),
            "a new password"
        );
        assert!(
            !checks.fresh("other", "198.18.0.1", &a, hour),
            "another cluster"
        );
        assert!(
            !checks.fresh("uid", "198.18.0.1", &a, std::time::Duration::ZERO),
            "the interval passed"
        );
        checks.forget("uid");
        assert!(!checks.fresh("uid", "198.18.0.1", &a, hour), "forgotten");
    }

    fn cluster() -> PostgresCluster {
        let mut c = PostgresCluster::new("pg", crate::cluster::tests::cluster("pg").spec);
        c.metadata.namespace = Some("apps".into());
        c
    }

    #[test]
    fn pooler_pods_are_no_instances_and_the_agent_may_not_move_the_primary() {
        let c = cluster();
        let labels = pod_labels("pg");
        assert!(!labels.contains_key(contract::CLUSTER_LABEL));
        let spec = Pooler {
            instances: 2,
            pool_mode: crate::crd::PoolMode::Transaction,
            default_pool_size: None,
            max_client_connections: Some(50),
            image: None,
        };
        let d = deployment(&c, &spec, "op:1", "pgbouncer:1");
        let pod = d.spec.template;
        assert_eq!(pod.metadata.unwrap().labels.unwrap(), labels);
        let container = &pod.spec.as_ref().unwrap().containers[0];
        assert_eq!(container.image.as_deref(), Some("pgbouncer:1"));
        let args = container.args.clone().unwrap().join(" ");
        assert!(
            args.contains("--pool-mode transaction --default-pool-size 20 --max-client-conn 50"),
            "{args}"
        );
        // Read-only but for the acknowledgements: no Lease write, no pod patch, no Secret.
        for rule in role(&c).rules.unwrap() {
            let resources = rule.resources.unwrap_or_default();
            let writes = rule
                .verbs
                .iter()
                .any(|v| !["get", "list", "watch"].contains(&v.as_str()));
            if writes {
                assert_eq!(resources, vec!["configmaps".to_string()]);
                assert_eq!(
                    rule.resource_names,
                    Some(vec!["pg-pooler-state".to_string()])
                );
            }
            assert!(!resources.contains(&"secrets".to_string()));
        }
        assert_eq!(
            disruption_budget(&c, &spec).spec.unwrap().min_available,
            Some(IntOrString::Int(1))
        );
    }

    #[test]
    fn a_primary_missing_for_a_moment_does_not_undo_an_auth_role_set_up_before() {
        let with = |reason: Option<&str>| {
            let mut c = cluster();
            let mut status = crate::crd::PostgresClusterStatus::default();
            if let Some(reason) = reason {
                status
                    .conditions
                    .push(k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
                        type_: POOLER_READY.into(),
                        status: "True".into(),
                        reason: reason.into(),
                        message: String::new(),
                        last_transition_time: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                            Default::default(),
                        ),
                        observed_generation: None,
                    });
            }
            c.status = Some(status);
            auth_set_up_before(&c)
        };
        assert!(with(Some("Serving")) && with(Some("PodsNotReady")));
        assert!(!with(Some("AuthPending")) && !with(None));
        assert!(
            !with(Some("Standby")),
            "a promoted standby sets its auth role up afresh"
        );
    }

    /// A standby's pooler says why it cannot log clients in yet, not that something failed
    /// on the primary.
    #[test]
    fn a_standbys_pooler_waits_for_the_promotion_and_says_so() {
        let condition = Pooled::Standby("s3://dr/prod/orders".into())
            .condition()
            .unwrap();
        assert!(!condition.status);
        assert_eq!(condition.reason, "Standby");
        assert!(
            condition
                .message
                .contains("once the cluster is promoted: a standby of s3://dr/prod/orders"),
            "{}",
            condition.message
        );
    }

    #[test]
    fn auth_plan_is_empty_once_it_matches_and_repairs_what_differs() {
        let password = Password::from_existing("s3cret-s3cret".into());
        let fresh = auth_plan(&AuthSeen::default(), &password);
        assert!(
            fresh[0].starts_with("CREATE ROLE steward_pooler LOGIN NOSUPERUSER"),
            "{fresh:?}"
        );
        assert!(
            fresh
                .iter()
                .any(|s| s.contains("SECURITY DEFINER") && s.contains("NOT rolsuper"))
        );
        assert!(
            fresh
                .iter()
                .any(|s| s == "REVOKE ALL ON FUNCTION steward_pooler.lookup(text) FROM PUBLIC")
        );
        let converged = AuthSeen {
            role: Some(Some(password.scram_verifier())),
            role_is_plain_login: true,
            lookup_version: Some(pooler::LOOKUP_VERSION.into()),
        };
        assert!(auth_plan(&converged, &password).is_empty());
        // A password changed by hand, a role made superuser: both put back.
        let drifted = AuthSeen {
            role: Some(Some("md5abc".into())),
            role_is_plain_login: false,
            ..converged
        };
        let plan = auth_plan(&drifted, &password);
        assert_eq!(plan.len(), 2, "{plan:?}");
        assert!(plan[0].starts_with("ALTER ROLE steward_pooler LOGIN NOSUPERUSER"));
        assert!(plan[1].starts_with("ALTER ROLE steward_pooler PASSWORD 'SCRAM-SHA-256$"));
    }
}
