//! `kubectl steward status`: [`gather`] lists each kind (a kind whose CRD is not installed is
//! named in [`Report::not_installed`], not an error), the `*_row` functions turn an object
//! into what matters about it, and [`render`] prints the rows as kubectl-like tables. The
//! JSON and YAML outputs are the [`Report`] itself.

use std::collections::BTreeSet;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::api::{Api, ListParams};
use kube::{Client, Resource, ResourceExt};
use serde::Serialize;
use steward_database_api::{Database, DatabaseRole, PostgresCluster};
use steward_tenant_api::Tenant;
use steward_upgrade_api::{ComponentPhase, PlanPhase, UpgradePlan};

use crate::Error;

/// Where to look.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Scope {
    Namespace(String),
    All,
}

/// Everything `status` shows.
#[derive(Debug, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Report {
    pub operators: Vec<OperatorRow>,
    pub postgres_clusters: Vec<ClusterRow>,
    pub databases: Vec<DatabaseRow>,
    pub database_roles: Vec<RoleRow>,
    pub tenants: Vec<TenantRow>,
    pub upgrade_plans: Vec<PlanRow>,
    /// With `status <cluster>`: its instances, by what PostgreSQL says.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub instances: Vec<crate::instances::InstanceRow>,
    /// With `status <cluster>` and `spec.pooler`: its PgBouncer pods, by what their agents say.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub poolers: Vec<crate::poolers::PoolerRow>,
    /// Kinds whose CRD the cluster does not have (their operator is not installed).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub not_installed: Vec<String>,
    /// Kinds the user may not list here (their rows are left out, not the whole report).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub forbidden: Vec<String>,
}

impl Report {
    /// `status <cluster>`: PostgresCluster `cluster` of `namespace` alone, with the Databases
    /// on it and their roles; the operators stay, the other kinds go.
    ///
    /// # Errors
    /// [`crate::Error::Refused`] when there is no such PostgresCluster.
    pub fn focus_on_cluster(&mut self, namespace: &str, cluster: &str) -> Result<(), crate::Error> {
        self.postgres_clusters
            .retain(|c| c.namespace == namespace && c.name == cluster);
        if self.postgres_clusters.is_empty() {
            return Err(crate::Error::Refused(format!(
                "no PostgresCluster {cluster} in namespace {namespace}"
            )));
        }
        let on_it = format!("postgrescluster/{cluster}");
        self.databases
            .retain(|d| d.namespace == namespace && d.server.ends_with(&on_it));
        let databases: BTreeSet<&str> = self.databases.iter().map(|d| d.name.as_str()).collect();
        self.database_roles
            .retain(|r| r.namespace == namespace && databases.contains(r.database.as_str()));
        self.tenants.clear();
        self.upgrade_plans.clear();
        Ok(())
    }
}

/// The `Ready` condition, as a cell: `True`, `False`, `Unknown`, or absent (not reported yet).
#[derive(Debug, Default, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Readiness {
    pub ready: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

impl Readiness {
    pub fn of(conditions: &[Condition]) -> Self {
        match conditions.iter().find(|c| c.type_ == "Ready") {
            Some(c) => Self {
                ready: c.status.clone(),
                reason: (c.status != "True").then(|| c.reason.clone()),
                message: (c.status != "True" && !c.message.is_empty()).then(|| c.message.clone()),
            },
            None => Self {
                ready: "Unknown".into(),
                reason: Some("NotReported".into()),
                message: None,
            },
        }
    }

    fn cell(&self) -> String {
        match &self.reason {
            Some(reason) if self.ready != "True" => format!("{}: {reason}", self.ready),
            _ => self.ready.clone(),
        }
    }
}

/// The pod leading an operator: the holder of the Lease named after the operator.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct OperatorRow {
    pub namespace: String,
    pub operator: String,
    /// The leader's pod (`holderIdentity` is `<pod>_<random>`); absent when nobody holds it.
    pub leader: Option<String>,
    /// Seconds since the leader last renewed.
    pub renewed_seconds_ago: Option<i64>,
    pub transitions: i32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ClusterRow {
    pub namespace: String,
    pub name: String,
    #[serde(flatten)]
    pub readiness: Readiness,
    pub phase: Option<String>,
    pub ready_instances: i32,
    pub instances: i32,
    pub primary: Option<String>,
    /// `current` or `current→target` while a version change rolls.
    pub version: String,
    /// The largest replay lag of a replica, in bytes.
    pub max_lag_bytes: Option<u64>,
    /// The switchover under way, or the one the primary refused (`refused: <target>: <reason>`).
    pub switchover_to: Option<String>,
    /// With `spec.backup`: when the newest base backup completed, and whether WAL archiving
    /// works (the `ContinuousArchiving` condition).
    pub backup: Option<BackupCell>,
    /// With `spec.pooler`: its `PoolerReady` condition (reason `Serving`, `PodsNotReady` or
    /// `AuthPending`), the reason and message said even when it serves.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pooler: Option<Readiness>,
}

/// A backed-up cluster's backup state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct BackupCell {
    pub last_base_backup: Option<String>,
    pub archiving: bool,
    /// The condition's reason when archiving does not work.
    pub archiving_reason: Option<String>,
}

impl BackupCell {
    fn cell(&self) -> String {
        let last = self.last_base_backup.as_deref().unwrap_or("no base backup");
        match (&self.archiving, &self.archiving_reason) {
            (true, _) => last.to_string(),
            (false, Some(reason)) => format!("{last}, WAL: {reason}"),
            (false, None) => format!("{last}, WAL not archived"),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DatabaseRow {
    pub namespace: String,
    pub name: String,
    #[serde(flatten)]
    pub readiness: Readiness,
    pub phase: Option<String>,
    pub database: String,
    pub owner: String,
    /// The PostgresCluster or external server it lives on.
    pub server: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RoleRow {
    pub namespace: String,
    pub name: String,
    #[serde(flatten)]
    pub readiness: Readiness,
    pub role: String,
    pub database: String,
    pub privileges: String,
    pub password_updated: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TenantRow {
    pub name: String,
    #[serde(flatten)]
    pub readiness: Readiness,
    pub phase: Option<String>,
    pub namespaces: i32,
    pub max_namespaces: Option<i32>,
    /// `resource used/hard` for each tenant-wide limit.
    pub quota: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PlanRow {
    pub namespace: String,
    pub name: String,
    #[serde(flatten)]
    pub readiness: Readiness,
    pub phase: Option<String>,
    pub current_wave: Option<i32>,
    pub waves: Option<i32>,
    pub progress: Option<String>,
    /// What happens next, or what the user has to do.
    pub next: String,
}

/// Lists every kind in `scope` (Tenants are cluster-scoped: all of them) and the operators'
/// Leases (in every namespace).
///
/// # Errors
/// [`Error::Api`] when a list fails for another reason than the kind not being installed.
pub async fn gather(client: &Client, scope: &Scope) -> Result<Report, Error> {
    let mut report = Report::default();
    let now = jiff::Timestamp::now();
    let operators: BTreeSet<&str> = crate::OPERATORS.into_iter().collect();
    if let Some(leases) = list(Api::<Lease>::all(client.clone()), &mut report).await? {
        report.operators = leases
            .iter()
            .filter(|l| operators.contains(l.name_any().as_str()))
            .map(|l| operator_row(l, now))
            .collect();
    }
    if let Some(items) = list(scoped::<PostgresCluster>(client, scope), &mut report).await? {
        report.postgres_clusters = items.iter().map(cluster_row).collect();
    }
    if let Some(items) = list(scoped::<Database>(client, scope), &mut report).await? {
        report.databases = items.iter().map(database_row).collect();
    }
    if let Some(items) = list(scoped::<DatabaseRole>(client, scope), &mut report).await? {
        report.database_roles = items.iter().map(role_row).collect();
    }
    if let Some(items) = list(Api::<Tenant>::all(client.clone()), &mut report).await? {
        report.tenants = items.iter().map(tenant_row).collect();
    }
    if let Some(items) = list(scoped::<UpgradePlan>(client, scope), &mut report).await? {
        report.upgrade_plans = items.iter().map(plan_row).collect();
    }
    Ok(report)
}

/// The API of namespaced kind `K` in `scope`.
fn scoped<K>(client: &Client, scope: &Scope) -> Api<K>
where
    K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>,
{
    match scope {
        Scope::Namespace(ns) => Api::namespaced(client.clone(), ns),
        Scope::All => Api::all(client.clone()),
    }
}

/// The objects `api` lists, sorted, or `None` (and the kind noted) when the API server does
/// not serve the kind or the user may not list it.
async fn list<K>(api: Api<K>, report: &mut Report) -> Result<Option<Vec<K>>, Error>
where
    K: Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match api.list(&ListParams::default()).await {
        Ok(list) => {
            let mut items = list.items;
            items.sort_by_key(|o| (o.namespace(), o.name_any()));
            Ok(Some(items))
        }
        Err(kube::Error::Api(s)) if s.is_not_found() => {
            report.not_installed.push(K::kind(&()).into_owned());
            Ok(None)
        }
        Err(kube::Error::Api(s)) if s.is_forbidden() => {
            report.forbidden.push(K::kind(&()).into_owned());
            Ok(None)
        }
        Err(e) => Err(Error::Api {
            what: format!("list {}", K::plural(&())),
            source: e,
        }),
    }
}

pub fn operator_row(lease: &Lease, now: jiff::Timestamp) -> OperatorRow {
    let spec = lease.spec.clone().unwrap_or_default();
    let leader = spec
        .holder_identity
        .filter(|h| !h.is_empty())
        .map(|h| h.split('_').next().unwrap_or_default().to_string());
    OperatorRow {
        namespace: lease.namespace().unwrap_or_default(),
        operator: lease.name_any(),
        renewed_seconds_ago: leader
            .as_ref()
            .and(spec.renew_time)
            .map(|t| now.duration_since(t.0).as_secs()),
        leader,
        transitions: spec.lease_transitions.unwrap_or(0),
    }
}

pub fn cluster_row(cluster: &PostgresCluster) -> ClusterRow {
    let status = cluster.status.clone().unwrap_or_default();
    let current = status.current_version.unwrap_or(cluster.spec.version);
    let version = match status.target_version {
        Some(target) if target != current => format!("{current}→{target}"),
        _ => current.to_string(),
    };
    ClusterRow {
        namespace: cluster.namespace().unwrap_or_default(),
        name: cluster.name_any(),
        readiness: Readiness::of(&status.conditions),
        phase: status.phase.map(|p| format!("{p:?}")),
        ready_instances: status.ready_instances,
        instances: cluster.spec.instances,
        primary: status.primary.clone(),
        version,
        max_lag_bytes: status
            .instances
            .iter()
            .filter(|i| i.role == "replica")
            .map(|i| i.replay_lag_bytes)
            .max(),
        switchover_to: match (&status.switchover_target, &status.switchover_refused) {
            (Some(to), _) => Some(to.clone()),
            (None, Some(refused)) => Some(format!("refused: {refused}")),
            (None, None) => None,
        },
        backup: cluster.spec.backup.as_ref().map(|_| {
            let archiving = status
                .conditions
                .iter()
                .find(|c| c.type_ == "ContinuousArchiving");
            BackupCell {
                last_base_backup: status
                    .backup
                    .as_ref()
                    .and_then(|b| b.last_base_backup_time.clone()),
                archiving: archiving.is_some_and(|c| c.status == "True"),
                archiving_reason: archiving
                    .filter(|c| c.status != "True")
                    .map(|c| c.reason.clone()),
            }
        }),
        pooler: status
            .conditions
            .iter()
            .find(|c| c.type_ == "PoolerReady")
            .map(|c| Readiness {
                ready: c.status.clone(),
                reason: Some(c.reason.clone()),
                message: (!c.message.is_empty()).then(|| c.message.clone()),
            }),
    }
}

pub fn database_row(db: &Database) -> DatabaseRow {
    let status = db.status.clone().unwrap_or_default();
    let server =
        status
            .server
            .clone()
            .unwrap_or_else(|| match (&db.spec.cluster_ref, &db.spec.external) {
                (Some(cluster), _) => format!("postgrescluster/{}", cluster.name),
                (None, Some(_)) => "external".to_string(),
                (None, None) => String::new(),
            });
    DatabaseRow {
        namespace: db.namespace().unwrap_or_default(),
        name: db.name_any(),
        readiness: Readiness::of(&status.conditions),
        phase: status.phase.map(|p| format!("{p:?}")),
        database: db.spec.name.clone(),
        owner: db.spec.owner.clone(),
        server,
    }
}

pub fn role_row(role: &DatabaseRole) -> RoleRow {
    let status = role.status.clone().unwrap_or_default();
    RoleRow {
        namespace: role.namespace().unwrap_or_default(),
        name: role.name_any(),
        readiness: Readiness::of(&status.conditions),
        role: role.spec.role_name.clone(),
        database: role.spec.database_ref.name.clone(),
        privileges: format!("{:?}", role.spec.privileges),
        password_updated: status.password_updated_at.map(|t| t.0.to_string()),
    }
}

pub fn tenant_row(tenant: &Tenant) -> TenantRow {
    let status = tenant.status.clone().unwrap_or_default();
    let quota = status
        .quota
        .map(|q| {
            q.hard
                .iter()
                .map(|(resource, hard)| {
                    let used = q.used.get(resource).map_or("0", String::as_str);
                    format!("{resource} {used}/{hard}")
                })
                .collect()
        })
        .unwrap_or_default();
    TenantRow {
        name: tenant.name_any(),
        readiness: Readiness::of(&status.conditions),
        phase: status.phase.map(|p| format!("{p:?}")),
        namespaces: status.namespace_count,
        max_namespaces: tenant.spec.max_namespaces,
        quota,
    }
}

pub fn plan_row(plan: &UpgradePlan) -> PlanRow {
    let status = plan.status.clone().unwrap_or_default();
    PlanRow {
        namespace: plan.namespace().unwrap_or_default(),
        name: plan.name_any(),
        readiness: Readiness::of(&status.conditions),
        phase: status.phase.map(|p| p.as_str().to_string()),
        current_wave: status.current_wave,
        waves: status.waves,
        progress: status.progress.clone(),
        next: next_step(plan),
    }
}

/// What happens next to `plan`, or the command that moves it on.
pub fn next_step(plan: &UpgradePlan) -> String {
    let name = plan.name_any();
    let Some(status) = &plan.status else {
        return "waiting for the orchestrator".into();
    };
    let names = |phase: ComponentPhase| {
        status
            .components
            .iter()
            .filter(|c| c.phase == phase)
            .map(|c| c.name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    match status.phase {
        None | Some(PlanPhase::Pending) => "waiting to start".into(),
        Some(PlanPhase::WaitingApproval) => format!(
            "wave {} waits for approval: kubectl steward approve {name}",
            status.current_wave.unwrap_or(1)
        ),
        Some(PlanPhase::WaitingWindow) => Readiness::of(&status.conditions)
            .message
            .and_then(|m| {
                m.split("; ")
                    .find_map(|part| part.strip_prefix(steward_upgrade_api::NEXT_OPENING))
                    .map(str::to_string)
            })
            .map_or_else(
                || "waits for its maintenance window".to_string(),
                |at| format!("waits for the maintenance window opening at {at}"),
            ),
        Some(PlanPhase::Paused) if plan.spec.strategy.paused => {
            format!("paused: kubectl steward resume {name}")
        }
        Some(PlanPhase::Paused) => {
            format!("paused after a failure: {}", names(ComponentPhase::Failed))
        }
        Some(PlanPhase::Progressing) => {
            let rolling = names(ComponentPhase::Progressing);
            if rolling.is_empty() {
                "starting the next components".into()
            } else {
                format!("upgrading {rolling}")
            }
        }
        Some(PlanPhase::RollingBack) => {
            format!("rolling back {}", names(ComponentPhase::RollingBack))
        }
        Some(PlanPhase::Succeeded | PlanPhase::Failed | PlanPhase::RolledBack) => "done".into(),
    }
}

/// The report as kubectl-like tables, one per kind that has objects.
pub fn render(report: &Report, scope: &Scope) -> String {
    let mut out = String::new();
    let namespaced = matches!(scope, Scope::All);
    let with_ns = |ns: &str, mut row: Vec<String>| {
        if namespaced {
            row.insert(0, ns.to_string());
        }
        row
    };
    let headers = |h: &[&str]| {
        let mut h: Vec<String> = h.iter().map(ToString::to_string).collect();
        if namespaced {
            h.insert(0, "NAMESPACE".into());
        }
        h
    };
    let dash = |v: Option<String>| v.unwrap_or_else(|| "-".into());

    if !report.operators.is_empty() {
        let rows = report
            .operators
            .iter()
            .map(|o| {
                vec![
                    o.operator.clone(),
                    o.namespace.clone(),
                    dash(o.leader.clone()),
                    dash(o.renewed_seconds_ago.map(|s| format!("{s}s ago"))),
                    o.transitions.to_string(),
                ]
            })
            .collect();
        section(
            &mut out,
            "Operators",
            &["OPERATOR", "NAMESPACE", "LEADER", "RENEWED", "TRANSITIONS"].map(String::from),
            rows,
        );
    }
    if !report.postgres_clusters.is_empty() {
        let rows = report
            .postgres_clusters
            .iter()
            .map(|c| {
                with_ns(
                    &c.namespace,
                    vec![
                        c.name.clone(),
                        c.readiness.cell(),
                        dash(c.phase.clone()),
                        format!("{}/{}", c.ready_instances, c.instances),
                        dash(c.primary.clone()),
                        c.version.clone(),
                        dash(c.max_lag_bytes.map(bytes)),
                        dash(c.switchover_to.clone()),
                        dash(c.backup.as_ref().map(BackupCell::cell)),
                    ],
                )
            })
            .collect();
        let h = headers(&[
            "NAME",
            "READY",
            "PHASE",
            "INSTANCES",
            "PRIMARY",
            "VERSION",
            "MAX LAG",
            "SWITCHOVER TO",
            "LAST BACKUP",
        ]);
        section(&mut out, "PostgresClusters", &h, rows);
    }
    if !report.instances.is_empty() {
        let rows = report.instances.iter().map(instance_cells).collect();
        section(
            &mut out,
            "Instances",
            &[
                "INSTANCE",
                "ROLE",
                "CONNECTIONS",
                "LAG",
                "STREAMING",
                "OLDEST TX",
                "XID AGE",
                "LAST ARCHIVED",
                "FAILING QUERIES",
                "NOTE",
            ]
            .map(String::from),
            rows,
        );
    }
    if !report.poolers.is_empty() {
        let rows = report.poolers.iter().map(pooler_cells).collect();
        // `status <cluster>` keeps that one cluster.
        let condition = report
            .postgres_clusters
            .first()
            .and_then(|c| c.pooler.as_ref());
        let title = match condition.map(|c| (&c.reason, &c.message)) {
            Some((Some(reason), Some(message))) => format!("Poolers ({reason}: {message})"),
            Some((Some(reason), None)) => format!("Poolers ({reason})"),
            _ => "Poolers".to_string(),
        };
        section(
            &mut out,
            &title,
            &[
                "NAME",
                "READY",
                "STATE",
                "CLIENTS",
                "WAITING",
                "MAX WAIT",
                "SERVERS",
                "PAUSES",
                "LAST PAUSE",
            ]
            .map(String::from),
            rows,
        );
    }
    if !report.databases.is_empty() {
        let rows = report
            .databases
            .iter()
            .map(|d| {
                with_ns(
                    &d.namespace,
                    vec![
                        d.name.clone(),
                        d.readiness.cell(),
                        dash(d.phase.clone()),
                        d.database.clone(),
                        d.owner.clone(),
                        d.server.clone(),
                    ],
                )
            })
            .collect();
        let h = headers(&["NAME", "READY", "PHASE", "DATABASE", "OWNER", "SERVER"]);
        section(&mut out, "Databases", &h, rows);
    }
    if !report.database_roles.is_empty() {
        let rows = report
            .database_roles
            .iter()
            .map(|r| {
                with_ns(
                    &r.namespace,
                    vec![
                        r.name.clone(),
                        r.readiness.cell(),
                        r.role.clone(),
                        r.database.clone(),
                        r.privileges.clone(),
                        dash(r.password_updated.clone()),
                    ],
                )
            })
            .collect();
        let h = headers(&[
            "NAME",
            "READY",
            "ROLE",
            "DATABASE",
            "PRIVILEGES",
            "PASSWORD UPDATED",
        ]);
        section(&mut out, "DatabaseRoles", &h, rows);
    }
    if !report.tenants.is_empty() {
        let rows = report
            .tenants
            .iter()
            .map(|t| {
                vec![
                    t.name.clone(),
                    t.readiness.cell(),
                    dash(t.phase.clone()),
                    match t.max_namespaces {
                        Some(max) => format!("{}/{max}", t.namespaces),
                        None => t.namespaces.to_string(),
                    },
                    if t.quota.is_empty() {
                        "-".into()
                    } else {
                        t.quota.join(", ")
                    },
                ]
            })
            .collect();
        let h = ["NAME", "READY", "PHASE", "NAMESPACES", "QUOTA"].map(String::from);
        section(&mut out, "Tenants", &h, rows);
    }
    if !report.upgrade_plans.is_empty() {
        let rows = report
            .upgrade_plans
            .iter()
            .map(|p| {
                with_ns(
                    &p.namespace,
                    vec![
                        p.name.clone(),
                        p.readiness.cell(),
                        dash(p.phase.clone()),
                        match (p.current_wave, p.waves) {
                            (Some(c), Some(w)) => format!("{c}/{w}"),
                            _ => "-".into(),
                        },
                        dash(p.progress.clone()),
                        p.next.clone(),
                    ],
                )
            })
            .collect();
        let h = headers(&["NAME", "READY", "PHASE", "WAVE", "PROGRESS", "NEXT"]);
        section(&mut out, "UpgradePlans", &h, rows);
    }
    if out.is_empty() {
        out = match scope {
            Scope::Namespace(ns) => format!("No Steward objects in namespace {ns}.\n"),
            Scope::All => "No Steward objects.\n".into(),
        };
    }
    if !report.not_installed.is_empty() {
        out.push_str(&format!(
            "Not installed (no CRD): {}\n",
            report.not_installed.join(", ")
        ));
    }
    if !report.forbidden.is_empty() {
        out.push_str(&format!(
            "Not shown (you may not list them): {}\n",
            report.forbidden.join(", ")
        ));
    }
    out
}

/// An instance's cells; one that could not be read says why in its second.
fn instance_cells(i: &crate::instances::InstanceRow) -> Vec<String> {
    let dash = |v: Option<String>| v.unwrap_or_else(|| "-".into());
    if let Some(why) = &i.unavailable {
        let mut cells = vec!["-".to_string(); 9];
        cells[0] = i.name.clone();
        cells.push(format!("metrics unavailable: {why}"));
        return cells;
    }
    vec![
        i.name.clone(),
        dash(i.role.clone()),
        dash(i.connections.map(|(n, max)| format!("{n}/{max}"))),
        dash(i.lag_bytes.map(bytes)),
        dash(
            i.streaming
                .map(|s| if s { "yes" } else { "NO" }.to_string()),
        ),
        dash(i.oldest_transaction_seconds.map(seconds)),
        dash(i.frozen_xid_age.map(|a| a.to_string())),
        match i.last_archived_seconds {
            None => "-".into(),
            Some(None) => "never".into(),
            Some(Some(s)) => format!("{} ago", seconds(s)),
        },
        if i.failing_queries.is_empty() {
            "-".into()
        } else {
            i.failing_queries.join(",")
        },
        String::new(),
    ]
}

/// A pooler pod's cells; one whose metrics could not be read says why in its STATE.
fn pooler_cells(p: &crate::poolers::PoolerRow) -> Vec<String> {
    let dash = |v: Option<String>| v.unwrap_or_else(|| "-".into());
    let count = |v: Option<u64>| dash(v.map(|n| n.to_string()));
    vec![
        p.name.clone(),
        if p.ready { "True" } else { "False" }.into(),
        match (&p.state, &p.unavailable) {
            (Some(state), _) => state.clone(),
            (None, Some(why)) => format!("metrics unavailable: {why}"),
            (None, None) => "-".into(),
        },
        count(p.clients_active),
        count(p.clients_waiting),
        dash(p.max_wait_seconds.map(short_seconds)),
        dash(
            p.servers_active
                .zip(p.servers_idle)
                .map(|(active, idle)| format!("{} ({idle} idle)", active + idle)),
        ),
        count(p.pauses),
        dash(p.last_pause_seconds.map(short_seconds)),
    ]
}

/// Seconds that may be under one, as `0s`, `350ms`, `1.2s`, then as [`seconds`] says them.
pub fn short_seconds(s: f64) -> String {
    let ms = (s.max(0.0) * 1000.0).round() as u64;
    match ms {
        0 => "0s".into(),
        1..1000 => format!("{ms}ms"),
        1000..60_000 => format!("{:.1}s", ms as f64 / 1000.0),
        _ => seconds(s),
    }
}

/// Seconds as `12s`, `3m`, `2h5m`, `3d`.
pub fn seconds(s: f64) -> String {
    let s = s.max(0.0) as u64;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m", s / 60),
        3600..86_400 if (s % 3600) / 60 > 0 => format!("{}h{}m", s / 3600, (s % 3600) / 60),
        3600..86_400 => format!("{}h", s / 3600),
        _ => format!("{}d", s / 86_400),
    }
}

/// Appends a titled table, its columns padded like kubectl's.
fn section(out: &mut String, title: &str, headers: &[String], rows: Vec<Vec<String>>) {
    if !out.is_empty() {
        out.push('\n');
    }
    out.push_str(title);
    out.push('\n');
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    for row in std::iter::once(headers.to_vec()).chain(rows) {
        let last = row.len().saturating_sub(1);
        let line: String = row
            .iter()
            .enumerate()
            .map(|(i, cell)| {
                if i == last {
                    cell.clone()
                } else {
                    let pad = widths[i] + 3 - cell.chars().count();
                    format!("{cell}{}", " ".repeat(pad))
                }
            })
            .collect();
        out.push_str(line.trim_end());
        out.push('\n');
    }
}

/// Bytes as `0 B`, `12 KiB`, `3.4 MiB`.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut value = n as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if value < 10.0 {
        format!("{value:.1} {}", UNITS[unit])
    } else {
        format!("{value:.0} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn plan(spec: serde_json::Value, status: serde_json::Value) -> UpgradePlan {
        serde_json::from_value(json!({
            "apiVersion": "upgrade.steward.dev/v1alpha1",
            "kind": "UpgradePlan",
            "metadata": {"name": "rollout", "namespace": "apps"},
            "spec": spec,
            "status": status,
        }))
        .expect("plan")
    }

    fn two_components() -> serde_json::Value {
        json!({
            "components": [
                {"name": "db", "target": {"kind": "Deployment", "name": "db"}, "version": "2"},
                {"name": "api", "target": {"kind": "Deployment", "name": "api"}, "version": "2", "dependsOn": ["db"]},
            ],
            "strategy": {"approval": "Manual"},
        })
    }

    #[test]
    fn a_plan_waiting_for_approval_names_the_command_that_approves_it() {
        let p = plan(
            two_components(),
            json!({"phase": "WaitingApproval", "currentWave": 2, "waves": 2, "progress": "1/2"}),
        );
        let row = plan_row(&p);
        assert_eq!(
            row.next,
            "wave 2 waits for approval: kubectl steward approve rollout"
        );
        assert_eq!((row.current_wave, row.waves), (Some(2), Some(2)));
    }

    #[test]
    fn a_plan_outside_its_window_says_when_the_next_one_opens() {
        let status = json!({"phase": "WaitingWindow", "conditions": [{
            "type": "Ready", "status": "False", "reason": "OutsideMaintenanceWindow",
            "lastTransitionTime": "2026-12-01T12:00:00Z",
            "message": "outside the maintenance windows: no component starts; the next maintenance window opens at 2026-12-05T01:00:00+00:00[UTC] (0 1 * * SAT UTC for 4h)",
        }]});
        assert_eq!(
            next_step(&plan(two_components(), status)),
            "waits for the maintenance window opening at 2026-12-05T01:00:00+00:00[UTC] (0 1 * * SAT UTC for 4h)"
        );
    }

    #[test]
    fn a_rolling_plan_names_what_rolls_and_a_paused_one_how_to_resume() {
        let status = json!({"phase": "Progressing", "components": [
            {"name": "db", "wave": 1, "phase": "Succeeded"},
            {"name": "api", "wave": 2, "phase": "Progressing"},
        ]});
        assert_eq!(next_step(&plan(two_components(), status)), "upgrading api");
        let mut spec = two_components();
        spec["strategy"]["paused"] = json!(true);
        assert_eq!(
            next_step(&plan(spec, json!({"phase": "Paused"}))),
            "paused: kubectl steward resume rollout"
        );
        let failed = json!({"phase": "Paused", "components": [{"name": "db", "wave": 1, "phase": "Failed"}]});
        assert_eq!(
            next_step(&plan(two_components(), failed)),
            "paused after a failure: db"
        );
    }

    #[test]
    fn readiness_says_why_when_not_ready() {
        let cond = |status: &str| Condition {
            type_: "Ready".into(),
            status: status.into(),
            reason: "ServerUnreachable".into(),
            message: "connection refused".into(),
            last_transition_time: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                jiff::Timestamp::UNIX_EPOCH,
            ),
            observed_generation: None,
        };
        assert_eq!(Readiness::of(&[cond("True")]).cell(), "True");
        let not = Readiness::of(&[cond("False")]);
        assert_eq!(not.cell(), "False: ServerUnreachable");
        assert_eq!(not.message.as_deref(), Some("connection refused"));
        assert_eq!(Readiness::of(&[]).cell(), "Unknown: NotReported");
    }

    #[test]
    fn a_cluster_row_shows_primary_lag_and_a_version_change() {
        let cluster: PostgresCluster = serde_json::from_value(json!({
            "apiVersion": "database.steward.dev/v1alpha1",
            "kind": "PostgresCluster",
            "metadata": {"name": "pg", "namespace": "db"},
            "spec": {"instances": 3, "version": 17, "storage": {"size": "1Gi"}},
            "status": {
                "phase": "Upgrading", "readyInstances": 2, "currentVersion": 16, "targetVersion": 17,
                "primary": "pg-1",
                "instances": [
                    {"name": "pg-0", "role": "replica", "timeline": 2, "lsn": "0/3000000", "replayLagBytes": 2048, "ready": true},
                    {"name": "pg-1", "role": "primary", "timeline": 2, "lsn": "0/3000800", "replayLagBytes": 0, "ready": true},
                    {"name": "pg-2", "role": "replica", "timeline": 2, "lsn": "0/3000000", "replayLagBytes": 5_000_000, "ready": false},
                ],
            },
        }))
        .expect("cluster");
        let mut refused = cluster.clone();
        if let Some(s) = refused.status.as_mut() {
            s.switchover_refused = Some("pg-2: it does not stream from this primary".into());
        }
        assert_eq!(
            cluster_row(&refused).switchover_to.as_deref(),
            Some("refused: pg-2: it does not stream from this primary"),
            "a refused switchover says why"
        );
        let row = cluster_row(&cluster);
        assert_eq!(row.version, "16→17");
        assert_eq!(row.primary.as_deref(), Some("pg-1"));
        assert_eq!(row.max_lag_bytes, Some(5_000_000));
        assert_eq!((row.ready_instances, row.instances), (2, 3));
        let report = Report {
            postgres_clusters: vec![row],
            ..Report::default()
        };
        let table = render(&report, &Scope::Namespace("db".into()));
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines[0], "PostgresClusters");
        assert!(lines[1].starts_with("NAME   READY"), "{table}");
        assert!(
            lines[2].contains("2/3") && lines[2].contains("pg-1") && lines[2].contains("4.8 MiB"),
            "{table}"
        );
        // Every column starts where its header does.
        let at = |line: &str, s: &str| line.find(s).expect(s);
        assert_eq!(at(lines[1], "PRIMARY"), at(lines[2], "pg-1"));
        assert!(
            lines[2].trim_end().ends_with('-'),
            "no spec.backup: {table}"
        );
    }

    #[test]
    fn a_backed_up_cluster_shows_its_last_backup_and_whether_wal_is_archived() {
        let mut cluster: PostgresCluster = serde_json::from_value(json!({
            "apiVersion": "database.steward.dev/v1alpha1",
            "kind": "PostgresCluster",
            "metadata": {"name": "pg", "namespace": "db"},
            "spec": {"instances": 1, "version": 17, "storage": {"size": "1Gi"},
                     "backup": {"objectStore": {"endpoint": "http://s3:9000", "bucket": "b", "path": "p", "credentialsSecret": "s"}}},
            "status": {
                "backup": {"lastBaseBackup": "pg-1", "lastBaseBackupTime": "2026-12-02T03:00:00Z"},
                "conditions": [{"type": "ContinuousArchiving", "status": "False", "reason": "ArchivingFailing",
                                "message": "", "lastTransitionTime": "2026-12-02T03:00:00Z"}],
            },
        }))
        .expect("cluster");
        assert_eq!(
            cluster_row(&cluster).backup.unwrap().cell(),
            "2026-12-02T03:00:00Z, WAL: ArchivingFailing"
        );
        if let Some(s) = cluster.status.as_mut() {
            s.conditions[0].status = "True".into();
        }
        assert_eq!(
            cluster_row(&cluster).backup.unwrap().cell(),
            "2026-12-02T03:00:00Z"
        );
        if let Some(s) = cluster.status.as_mut() {
            s.backup = None;
        }
        assert_eq!(
            cluster_row(&cluster).backup.unwrap().cell(),
            "no base backup"
        );
    }

    #[test]
    fn tenants_show_namespaces_against_their_maximum_and_quota_use() {
        let tenant: Tenant = serde_json::from_value(json!({
            "apiVersion": "tenancy.steward.dev/v1alpha1",
            "kind": "Tenant",
            "metadata": {"name": "team-a"},
            "spec": {"owners": [{"kind": "User", "name": "alice"}], "maxNamespaces": 3},
            "status": {"namespaceCount": 2, "quota": {"hard": {"pods": "10"}, "used": {"pods": "4"}}},
        }))
        .expect("tenant");
        let row = tenant_row(&tenant);
        assert_eq!(row.quota, ["pods 4/10"]);
        let table = render(
            &Report {
                tenants: vec![row],
                ..Report::default()
            },
            &Scope::All,
        );
        assert!(
            table.contains("2/3") && table.contains("pods 4/10"),
            "{table}"
        );
    }

    #[test]
    fn an_empty_report_says_so_and_names_missing_kinds() {
        let report = Report {
            not_installed: vec!["Tenant".into()],
            ..Report::default()
        };
        assert_eq!(
            render(&report, &Scope::Namespace("x".into())),
            "No Steward objects in namespace x.\nNot installed (no CRD): Tenant\n"
        );
    }

    #[test]
    fn bytes_are_said_in_binary_units() {
        assert_eq!(bytes(0), "0 B");
        assert_eq!(bytes(2048), "2.0 KiB");
        assert_eq!(bytes(50 * 1024 * 1024), "50 MiB");
    }

    #[test]
    fn a_cluster_s_instances_show_what_postgresql_says_and_why_one_cannot_be_read() {
        use crate::instances::InstanceRow;
        let report = Report {
            instances: vec![
                InstanceRow {
                    name: "pg-0".into(),
                    role: Some("primary".into()),
                    connections: Some((7, 100)),
                    oldest_transaction_seconds: Some(3725.0),
                    frozen_xid_age: Some(900),
                    last_archived_seconds: Some(Some(42.0)),
                    failing_queries: vec!["app_slow".into()],
                    ..InstanceRow::default()
                },
                InstanceRow {
                    name: "pg-1".into(),
                    unavailable: Some("forbidden (needs get on pods/proxy)".into()),
                    ..InstanceRow::default()
                },
            ],
            ..Report::default()
        };
        let out = render(&report, &Scope::Namespace("db".into()));
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines[0], "Instances");
        assert!(
            lines[1].starts_with("INSTANCE   ROLE      CONNECTIONS   LAG"),
            "{out}"
        );
        let primary: Vec<&str> = lines[2].split_whitespace().collect();
        assert_eq!(
            primary,
            [
                "pg-0", "primary", "7/100", "-", "-", "1h2m", "900", "42s", "ago", "app_slow"
            ]
        );
        assert!(lines[3].contains("metrics unavailable: forbidden (needs get on pods/proxy)"));
        assert_eq!(seconds(59.9), "59s");
        assert_eq!(seconds(7200.0), "2h");
        assert_eq!(seconds(200_000.0), "2d");
    }

    #[test]
    fn a_cluster_s_poolers_show_their_state_under_the_pooler_ready_condition() {
        use crate::poolers::PoolerRow;
        let cluster: PostgresCluster = serde_json::from_value(json!({
            "apiVersion": "database.steward.dev/v1alpha1",
            "kind": "PostgresCluster",
            "metadata": {"name": "pg", "namespace": "db"},
            "spec": {"instances": 2, "version": 17, "storage": {"size": "1Gi"}, "pooler": {}},
            "status": {"conditions": [{"type": "PoolerReady", "status": "False", "reason": "PodsNotReady",
                                       "message": "1 of 2 PgBouncer pods ready", "lastTransitionTime": "2026-12-02T03:00:00Z"}]},
        }))
        .expect("cluster");
        let report = Report {
            postgres_clusters: vec![cluster_row(&cluster)],
            poolers: vec![
                PoolerRow {
                    name: "pg-pooler-7c9d-x2x".into(),
                    ready: true,
                    state: Some("serving".into()),
                    clients_active: Some(5),
                    clients_waiting: Some(2),
                    max_wait_seconds: Some(1.25),
                    servers_active: Some(5),
                    servers_idle: Some(1),
                    pauses: Some(2),
                    last_pause_seconds: Some(0.35),
                    primary_changes: Some(2),
                    unavailable: None,
                },
                PoolerRow {
                    name: "pg-pooler-7c9d-q8r".into(),
                    unavailable: Some("forbidden (needs get on pods/proxy)".into()),
                    ..PoolerRow::default()
                },
            ],
            ..Report::default()
        };
        let out = render(&report, &Scope::Namespace("db".into()));
        let section: Vec<&str> = out
            .lines()
            .skip_while(|l| !l.starts_with("Poolers"))
            .collect();
        assert_eq!(
            section,
            [
                "Poolers (PodsNotReady: 1 of 2 PgBouncer pods ready)",
                "NAME                 READY   STATE                                                      CLIENTS   WAITING   MAX WAIT   SERVERS      PAUSES   LAST PAUSE",
                "pg-pooler-7c9d-x2x   True    serving                                                    5         2         1.2s       6 (1 idle)   2        350ms",
                "pg-pooler-7c9d-q8r   False   metrics unavailable: forbidden (needs get on pods/proxy)   -         -         -          -            -        -",
            ],
            "{out}"
        );
        let json = serde_json::to_value(&report).expect("json");
        assert_eq!(
            json["postgresClusters"][0]["pooler"]["reason"],
            "PodsNotReady"
        );
        assert_eq!(json["poolers"][0]["clientsActive"], 5);
        assert_eq!(json["poolers"][1]["state"], serde_json::Value::Null);
        assert_eq!(short_seconds(0.0), "0s");
        assert_eq!(short_seconds(75.0), "1m");
    }

    #[test]
    fn the_leader_is_the_pod_in_the_holder_identity() {
        let lease: Lease = serde_json::from_value(json!({
            "metadata": {"name": "tenant-operator", "namespace": "tenant-operator-system"},
            "spec": {"holderIdentity": "tenant-operator-7d9f-abcde_1f2e", "leaseTransitions": 3,
                     "renewTime": "2026-12-01T10:00:00.000000Z"},
        }))
        .expect("lease");
        let now: jiff::Timestamp = "2026-12-01T10:00:05Z".parse().expect("time");
        let row = operator_row(&lease, now);
        assert_eq!(row.leader.as_deref(), Some("tenant-operator-7d9f-abcde"));
        assert_eq!(row.renewed_seconds_ago, Some(5));
        assert_eq!(row.transitions, 3);
    }
}
