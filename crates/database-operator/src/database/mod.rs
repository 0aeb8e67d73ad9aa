//! The Database controller: under the finalizer [`FINALIZER`], Apply converges the
//! database, its owner role, schemas and extensions on every reconcile; Cleanup drops them
//! (`deletionPolicy: Delete`, after a dump if `backupBeforeDelete`) or leaves them (`Retain`).
//!
//! ```text
//! apply:   validate → resolve server (+ in-use finalizer on an external admin Secret)
//!          → credentials Secret → connect
//!          → owner role (CREATE/ALTER ROLE … PASSWORD '<SCRAM verifier>')
//!          → database (CREATE DATABASE / ALTER DATABASE … OWNER, REVOKE CONNECT FROM PUBLIC)
//!          → inside it: schemas, extensions → status (one write)
//! cleanup: wait for DatabaseRoles (and, the last by name, for Databases sharing its admin
//!          Secret) → Retain: done | Delete: [dump Job] → terminate sessions
//!          → DROP DATABASE → REASSIGN/DROP OWNED → DROP ROLE → release the admin Secret
//!          (any failure: finalizer kept, Ready=False saying why, Warning Event, retry)
//! ```
//!
//! # Caveats
//! Cleanup needs the server: a Delete-policy Database whose server never comes back stays
//! until its `deletionPolicy` is set to `Retain` (the condition says so). The admin Secret
//! of an `external` server carries [`IN_USE_FINALIZER`] so that deleting the namespace
//! cannot take the credentials away first; of several Databases deleted together that share
//! it, the last by name releases it, after the others ([`secret_release`]). A Database whose
//! `clusterRef` cluster is gone or being deleted finishes without dropping (a Warning Event
//! says so): the database lives and dies with the cluster's volumes.

pub mod backup;

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, ListParams};
use kube::runtime::controller::Action;
use kube::{Resource, ResourceExt};
use steward_core::Context;
use steward_core::events::Wanted;
use steward_core::finalizer::{self, Cleanup};
use steward_core::object::Object;

use crate::crd::{
    BackupStatus, Database, DatabaseRole, DatabaseSpec, DatabaseStatus, DeletionPolicy,
};
use crate::ident::{self, Kind};
use crate::ownership::{self, Claim, Marker};
use crate::password::Password;
use crate::pg::{self, Server};
use crate::{Error, State, observe, server, sql};

/// The finalizer of Databases.
pub const FINALIZER: &str = "database.steward.dev/database-cleanup";
/// Finalizer on an external server's admin Secret while a Database uses it, so deleting the
/// namespace (which deletes the Secret too) cannot strand a Database that still has to drop.
pub const IN_USE_FINALIZER: &str = "database.steward.dev/in-use";
const IN_USE_MANAGER: &str = "database-operator-in-use";
pub use crate::status::SERVER_REACHABLE;

/// Name of a Database's credentials Secret.
pub fn secret_name(db: &Database) -> String {
    format!("{}-db-credentials", db.name_any())
}

/// Reconciles one Database.
///
/// # Errors
/// The step that failed, wrapped by the finalizer.
pub async fn reconcile(
    db: Arc<Database>,
    ctx: Arc<Context<State>>,
) -> Result<Action, finalizer::Error<Error>> {
    let ctx = ctx.as_ref();
    finalizer::dispatch(
        &ctx.client,
        FINALIZER,
        db,
        |db| async move { apply(&db, ctx).await },
        |db| async move { cleanup(&db, ctx).await },
    )
    .await
}

/// What a reconcile learned, kept for the status even when a later step fails.
#[derive(Debug, Default)]
struct Progress {
    server: Option<String>,
    reachable: Option<Result<(), String>>,
    secret: Option<String>,
    backup: Option<BackupStatus>,
}

/// Checks in code what the schema checks at admission.
///
/// # Errors
/// [`Error::InvalidSpec`].
pub fn validate(db: &Database) -> Result<(), Error> {
    let invalid = |e: ident::InvalidName| Error::InvalidSpec(e.to_string());
    let spec = &db.spec;
    ident::validate(Kind::Database, &spec.name).map_err(invalid)?;
    ident::validate(Kind::Role, &spec.owner).map_err(invalid)?;
    for s in &spec.schemas {
        ident::validate(Kind::Schema, &s.name).map_err(invalid)?;
        if s.name.starts_with("pg_") || s.name == "information_schema" {
            return Err(Error::InvalidSpec(format!(
                "schema {:?} is a system schema and cannot be managed",
                s.name
            )));
        }
    }
    for e in &spec.extensions {
        ident::validate(Kind::Extension, &e.name).map_err(invalid)?;
        if let Some(s) = &e.schema {
            ident::validate(Kind::Schema, s).map_err(invalid)?;
        }
    }
    if spec.cluster_ref.is_some() == spec.external.is_some() {
        return Err(Error::InvalidSpec(
            "exactly one of clusterRef and external must be set".into(),
        ));
    }
    Ok(())
}

async fn apply(db: &Database, ctx: &Context<State>) -> Result<Action, Error> {
    let mut progress = Progress::default();
    let result = converge(db, ctx, &mut progress).await;
    if matches!(result, Err(Error::Gone)) {
        return Ok(Action::await_change());
    }
    let status = status_of(db, &progress, result.as_ref().map(|_| ()), false);
    write_status(db, ctx, status).await?;
    result?;
    Ok(Action::requeue(ctx.data.options.resync_interval))
}

async fn converge(
    db: &Database,
    ctx: &Context<State>,
    progress: &mut Progress,
) -> Result<(), Error> {
    validate(db)?;
    let ns = db.namespace().unwrap_or_default();
    let spec = &db.spec;
    let server = server::resolve(&ctx.client, &ns, spec).await?;
    if server.admin_user == spec.owner {
        return Err(Error::InvalidSpec(format!(
            "owner {:?} is the server's admin role; choose another owner",
            spec.owner
        )));
    }
    progress.server = Some(server.address());
    let mut still_wanted = StillWanted::new(ctx, db);
    protect_admin_secret(db, ctx, Some(&mut still_wanted)).await?;

    let (name, password) = owner_secret(db, ctx, &server).await?;
    progress.secret = Some(name);

    // The server.
    let address = server.address();
    let admin = pg::connect_admin(&server, &ctx.leadership, &mut progress.reachable).await?;
    let sql_err = |step: &str| {
        let address = address.clone();
        let step = step.to_string();
        move |e| Error::sql(step, &address, e)
    };
    let (admin_is_superuser, _) = observe::session(&admin)
        .await
        .map_err(sql_err("read the session"))?;
    // Ownership first: nothing another resource owns is touched (see crate::ownership).
    let me = marker(db);
    let role_owner = observe::role_ownership(&admin, &spec.owner)
        .await
        .map_err(sql_err("read the owner role's marker"))?;
    let role_claim = ownership::claim(
        &ctx.client,
        &format!("role {:?}", spec.owner),
        &role_owner,
        &me,
        spec.adopt,
    )
    .await?;
    let db_owner = database_ownership(&admin, spec, &role_owner, &me)
        .await
        .map_err(sql_err("read the database's marker and owner"))?;
    let db_claim = ownership::claim(
        &ctx.client,
        &format!("database {:?}", spec.name),
        &db_owner,
        &me,
        spec.adopt,
    )
    .await?;

    let role_state = observe::role(&admin, &spec.owner)
        .await
        .map_err(sql_err("read the owner role"))?;
    let role_plan = ownership::mark(
        sql::plan_login_role_off_runtime(&spec.owner, role_state.as_ref(), &password).await?,
        &role_claim,
        sql::comment_on_role(&spec.owner, &me.render()),
    );
    still_wanted.before(&role_plan).await?;
    crate::run_plan::<Database>(ctx, &admin, &role_plan)
        .await
        .map_err(sql_err("create or update the owner role"))?;
    let db_state = observe::database_server(&admin, &spec.name, &spec.owner, admin_is_superuser)
        .await
        .map_err(sql_err("read the database"))?;
    let db_plan = ownership::mark(
        sql::plan_database_server(&spec.name, &spec.owner, &db_state),
        &db_claim,
        sql::comment_on_database(&spec.name, &me.render()),
    );
    still_wanted.before(&db_plan).await?;
    crate::run_plan::<Database>(ctx, &admin, &db_plan)
        .await
        .map_err(sql_err("create or update the database"))?;

    let inside = pg::connect(&server, &spec.name, &ctx.leadership)
        .await
        .map_err(sql_err(&format!("connect to database {}", spec.name)))?;
    let in_state = observe::in_database(&inside)
        .await
        .map_err(sql_err("read schemas and extensions"))?;
    let in_plan = sql::plan_in_database(&spec.owner, &spec.schemas, &spec.extensions, &in_state);
    still_wanted.before(&in_plan).await?;
    crate::run_plan::<Database>(ctx, &inside, &in_plan)
        .await
        .map_err(sql_err("converge schemas and extensions"))?;

    // Tell what changed.
    let created = db_state.owner.is_none();
    let changes: Vec<String> = role_plan
        .iter()
        .chain(&db_plan)
        .chain(&in_plan)
        .map(|s| pg::redact(s))
        .collect();
    let adopted = db_claim == (Claim::Manage { remark: true });
    if let Some(event) = converge_event(db, &address, created, adopted, &changes) {
        ctx.recorder.emit(db, event).await;
    }
    if role_state.is_none() && !created {
        tracing::info!(role = %spec.owner, "created the owner role of an existing database");
    }
    Ok(())
}

/// The owner's credentials: the password generated once and kept in the Secret (refused if
/// that Secret is not this Database's). Returns the Secret's name and the password.
async fn owner_secret(
    db: &Database,
    ctx: &Context<State>,
    server: &Server,
) -> Result<(String, Password), Error> {
    let ns = db.namespace().unwrap_or_default();
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &ns);
    let name = secret_name(db);
    let existing = secrets.get_opt(&name).await.map_err(|source| Error::Read {
        what: format!("Secret {name}"),
        source,
    })?;
    crate::ownership::ensure_ours(existing.as_ref(), db, None)?;
    let password = existing
        .as_ref()
        .and_then(server::password_of)
        .unwrap_or_else(Password::generate);
    let data = server::credentials(server, &db.spec.name, &db.spec.owner, &password);
    ctx.children(db)
        .ensure_cached(
            &ctx.data.children.secrets,
            server::credentials_secret(&name, &ns, data, BTreeMap::new()),
        )
        .await?;
    Ok((name, password))
}

/// The Event saying what a converge did, if anything: created the database, took over an
/// existing one (`adopted`: with `adopt: true`, or from a deleted predecessor of the same
/// name), or corrected drift (`changes`: the statements run, passwords redacted).
fn converge_event(
    db: &Database,
    address: &str,
    created: bool,
    adopted: bool,
    changes: &[String],
) -> Option<Wanted> {
    let spec = &db.spec;
    if created {
        Some(Wanted::normal(
            "Created",
            "Create",
            format!(
                "created database {} owned by {} on {address}",
                spec.name, spec.owner
            ),
        ))
    } else if adopted {
        Some(Wanted::normal(
            "Adopted",
            "Adopt",
            format!("adopted the existing database {} on {address}", spec.name),
        ))
    } else if !changes.is_empty() {
        Some(Wanted::normal(
            "DriftCorrected",
            "Converge",
            format!("corrected drift: {}", changes.join("; ")),
        ))
    } else {
        None
    }
}

async fn cleanup(db: &Database, ctx: &Context<State>) -> Result<Cleanup, Error> {
    let mut progress = Progress::default();
    let result = drop_all(db, ctx, &mut progress)
        .await
        .map_err(Error::blocking_cleanup);
    if let Err(e) = &result {
        let status = status_of(db, &progress, Err(e), true);
        write_status(db, ctx, status).await?;
    }
    result.map(|_| Cleanup::Done)
}

/// Re-reads `obj` from the API server (not the cache) right before something is dropped:
/// `true` only if this very object (same UID) is still there and being deleted. A stale
/// cache — a paused leader waking up, another replica having finished the cleanup — drops
/// nothing.
///
/// # Errors
/// [`Error::Read`] when the object cannot be read.
pub(crate) async fn still_deleting<K>(ctx: &Context<State>, obj: &K) -> Result<bool, Error>
where
    K: Object + kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>,
{
    Ok(fresh(ctx, obj, "before dropping")
        .await?
        .is_some_and(|f| f.meta().deletion_timestamp.is_some()))
}

/// `obj` as the API server has it now (not the cache), if it is this very object (same UID).
async fn fresh<K>(ctx: &Context<State>, obj: &K, when: &str) -> Result<Option<K>, Error>
where
    K: Object + kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>,
{
    let api: Api<K> = Api::namespaced(ctx.client.clone(), &obj.namespace().unwrap_or_default());
    let fresh = api
        .get_opt(&obj.name_any())
        .await
        .map_err(|source| Error::Read {
            what: format!("{} {} ({when})", K::kind(&()), obj.name_any()),
            source,
        })?;
    Ok(fresh.filter(|f| f.meta().uid == obj.meta().uid))
}

/// Guards a reconcile's first statement that creates or changes anything: it runs only if the
/// object is, on the API server (not the cache), still there (same UID) and not being deleted.
/// A copy from a lagging cache — a new leader's first list served from the API server's watch
/// cache just after another replica's cleanup dropped everything and removed the finalizer —
/// would otherwise create a role and a database that no cleanup will ever drop (found by
/// `database_chaos`: `CREATE ROLE` and `CREATE DATABASE` for a Database deleted a moment
/// before). Read once per reconcile, and only when a plan has statements: a converged object
/// costs no read.
pub(crate) struct StillWanted<'a, K> {
    ctx: &'a Context<State>,
    obj: &'a K,
    checked: bool,
}

impl<'a, K> StillWanted<'a, K>
where
    K: Object + kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>,
{
    pub(crate) fn new(ctx: &'a Context<State>, obj: &'a K) -> Self {
        Self {
            ctx,
            obj,
            checked: false,
        }
    }

    /// Before running `plan`: [`Error::Gone`] if the object is gone or being deleted.
    ///
    /// # Errors
    /// [`Error::Gone`], [`Error::Read`].
    pub(crate) async fn before(&mut self, plan: &[String]) -> Result<(), Error> {
        if plan.is_empty() {
            return Ok(());
        }
        self.confirm().await
    }

    /// Before a change that is not a plan of statements: [`Error::Gone`] if the object is gone
    /// or being deleted (read once per reconcile).
    ///
    /// # Errors
    /// [`Error::Gone`], [`Error::Read`].
    pub(crate) async fn confirm(&mut self) -> Result<(), Error> {
        if self.checked {
            return Ok(());
        }
        let wanted = fresh(self.ctx, self.obj, "before changing anything")
            .await?
            .is_some_and(|f| f.meta().deletion_timestamp.is_none());
        if !wanted {
            return Err(Error::Gone);
        }
        self.checked = true;
        Ok(())
    }
}

/// What the catalog shows about the ownership of `spec`'s database, knowing what it shows
/// about its owner role (see [`ownership::Observed::owner_marked_for_me`]).
async fn database_ownership(
    admin: &tokio_postgres::Client,
    spec: &DatabaseSpec,
    role_owner: &ownership::Observed,
    me: &Marker,
) -> Result<ownership::Observed, pg::PgError> {
    let mut observed = observe::database_ownership(admin, &spec.name).await?;
    observed.owner_marked_for_me = ownership::marked_for(role_owner, me)
        && observe::database_owner(admin, &spec.name).await?.as_deref()
            == Some(spec.owner.as_str());
    Ok(observed)
}

/// The owner marker of `db` (see [`crate::ownership`]).
fn marker(db: &Database) -> Marker {
    Marker::new(
        "Database",
        &db.namespace().unwrap_or_default(),
        &db.name_any(),
        db.meta().uid.as_deref().unwrap_or_default(),
    )
}

/// The name of the PostgresCluster `spec` points at, when it is gone or being deleted (e.g.
/// with its namespace, where it has no finalizer and goes first): there is no server left to
/// drop anything from, so cleanups must finish instead of waiting forever.
///
/// # Errors
/// [`Error::Read`] when the cluster cannot be read.
pub(crate) async fn cluster_gone(
    ctx: &Context<State>,
    ns: &str,
    spec: &DatabaseSpec,
) -> Result<Option<String>, Error> {
    let Some(r) = &spec.cluster_ref else {
        return Ok(None);
    };
    let clusters: Api<crate::crd::PostgresCluster> = Api::namespaced(ctx.client.clone(), ns);
    let cluster = clusters
        .get_opt(&r.name)
        .await
        .map_err(|source| Error::Read {
            what: format!("PostgresCluster {}", r.name),
            source,
        })?;
    Ok(cluster
        .is_none_or(|c| c.metadata.deletion_timestamp.is_some())
        .then(|| r.name.clone()))
}

async fn drop_all(
    db: &Database,
    ctx: &Context<State>,
    progress: &mut Progress,
) -> Result<Action, Error> {
    match ready_to_drop(db, ctx, progress).await? {
        Some(server) => drop_on_server(db, ctx, progress, &server).await,
        None => Ok(Action::await_change()),
    }
}

/// Whether the database may be dropped now, and on which server: its DatabaseRoles gone
/// first (they need its server for their own cleanup), no other Database sharing its admin
/// Secret mid-deletion, the dump taken first if asked for. `None`: nothing is dropped (kept by
/// `deletionPolicy: Retain`, or its cluster is gone), said by an Event; the deletion goes on.
async fn ready_to_drop(
    db: &Database,
    ctx: &Context<State>,
    progress: &mut Progress,
) -> Result<Option<Server>, Error> {
    let ns = db.namespace().unwrap_or_default();
    let spec = &db.spec;
    progress.backup = db.status.as_ref().and_then(|s| s.backup.clone());

    // DatabaseRoles need this object (its server) for their own cleanup: they go first.
    let roles: Api<DatabaseRole> = Api::namespaced(ctx.client.clone(), &ns);
    let waiting: Vec<String> = roles
        .list(&ListParams::default())
        .await
        .map_err(|source| Error::Read {
            what: "DatabaseRoles".into(),
            source,
        })?
        .items
        .into_iter()
        .filter(|r| r.spec.database_ref.name == db.name_any())
        .map(|r| r.name_any())
        .collect();
    if !waiting.is_empty() {
        return Err(Error::WaitingForRoles(waiting.join(", ")));
    }
    wait_for_sharing_databases(db, ctx).await?;

    if spec.deletion_policy == DeletionPolicy::Retain {
        ctx.recorder
            .normal(
                db,
                "Retained",
                "Delete",
                format!(
                    "deletionPolicy Retain: database {} and role {} were left on the server",
                    spec.name, spec.owner
                ),
            )
            .await;
        release_admin_secret(db, ctx).await?;
        return Ok(None);
    }
    validate(db)?;
    if let Some(cluster) = cluster_gone(ctx, &ns, spec).await? {
        ctx.recorder
            .warning(
                db,
                "ClusterGone",
                "Delete",
                format!(
                    "PostgresCluster {cluster} is gone or being deleted, so database {} was not dropped: it goes with the cluster's volumes (deletionPolicy Delete) or stays on the kept ones (Retain)",
                    spec.name
                ),
            )
            .await;
        return Ok(None);
    }
    let server = server::resolve(&ctx.client, &ns, spec).await?;
    progress.server = Some(server.address());

    if spec.backup_before_delete {
        let state = ensure_backup(db, ctx, &server).await?;
        progress.backup = Some(backup::status(db, state));
        match state {
            backup::JobState::Succeeded => {}
            backup::JobState::Running => {
                return Err(Error::WaitingForBackup {
                    job: backup::name(db),
                });
            }
            backup::JobState::Failed => {
                return Err(Error::BackupFailed {
                    job: backup::name(db),
                });
            }
        }
    }

    Ok(Some(server))
}

/// Drops the database (sessions terminated first) and its owner role unless the role owns
/// other databases, only if this Database made them (its owner marker); Events say what was
/// done or kept.
async fn drop_on_server(
    db: &Database,
    ctx: &Context<State>,
    progress: &mut Progress,
    server: &Server,
) -> Result<Action, Error> {
    let spec = &db.spec;
    let address = server.address();
    let admin = pg::connect_admin(server, &ctx.leadership, &mut progress.reachable).await?;
    let sql_err = |step: &'static str| {
        let address = address.clone();
        move |e| Error::sql(step, &address, e)
    };
    let (_, major) = observe::session(&admin)
        .await
        .map_err(sql_err("read the session"))?;
    let terminated = observe::terminate_connections(&admin, &spec.name)
        .await
        .map_err(sql_err("terminate the database's sessions"))?;
    observe::end_stale_sessions(&admin, &pg::application_name(ctx.leadership.identity()))
        .await
        .map_err(sql_err("end other instances' sessions"))?;
    let me = marker(db);
    let role_owner = observe::role_ownership(&admin, &spec.owner)
        .await
        .map_err(sql_err("read the owner role's marker"))?;
    let db_owner = database_ownership(&admin, spec, &role_owner, &me)
        .await
        .map_err(sql_err("read the database's marker and owner"))?;
    if db_owner.exists && !ownership::may_drop(&db_owner, &me) {
        ctx.recorder
            .warning(
                db,
                "NotOwned",
                "Delete",
                format!(
                    "database {} was not created by this Database (its owner marker: {}), so it was not dropped",
                    spec.name,
                    db_owner.comment.as_deref().unwrap_or("none")
                ),
            )
            .await;
        release_admin_secret(db, ctx).await?;
        return Ok(Action::await_change());
    }
    let owner_exists = ownership::may_drop(&role_owner, &me);
    let others: Vec<String> = if owner_exists {
        observe::owned_databases(&admin, &spec.owner)
            .await
            .map_err(sql_err("read the owner's databases"))?
            .into_iter()
            .filter(|d| d != &spec.name)
            .collect()
    } else {
        Vec::new()
    };
    let (mut plan, kept) = sql::plan_drop_database(&spec.name, &spec.owner, major, &others);
    if !owner_exists {
        plan.truncate(1);
    }
    if !still_deleting(ctx, db).await? {
        return Ok(Action::await_change());
    }
    crate::run_plan::<Database>(ctx, &admin, &plan)
        .await
        .map_err(sql_err("drop the database and its owner role"))?;
    let backup_note = progress
        .backup
        .as_ref()
        .map(|b| format!(" (dump {} in claim {})", b.file, b.claim))
        .unwrap_or_default();
    ctx.recorder
        .normal(
            db,
            "Dropped",
            "Delete",
            format!(
                "dropped database {} after terminating {terminated} sessions{backup_note}",
                spec.name
            ),
        )
        .await;
    if let Some(why) = kept {
        ctx.recorder.normal(db, "RoleKept", "Delete", why).await;
    }
    release_admin_secret(db, ctx).await?;
    Ok(Action::await_change())
}

/// What a deleting Database does with the in-use finalizer of the admin Secret it shares
/// ([`secret_release`]).
#[derive(Debug, PartialEq, Eq)]
pub enum SecretRelease {
    /// No other Database refers to the Secret: release it.
    Release,
    /// A Database that is not being deleted refers to it: leave it.
    InUse,
    /// Other Databases that refer to it are being deleted too, and one of them (the last by
    /// name) releases it: leave it and finish.
    LeaveToLast,
    /// Other Databases that refer to it are being deleted, and this one is the last by name:
    /// it waits until they are gone, then releases the Secret.
    WaitFor(Vec<String>),
}

/// Decides [`SecretRelease`] for `db` (being deleted), given every Database of its namespace.
/// Deciding "am I the last?" on what each one sees would race when several are deleted at
/// once (each sees the others, none releases, and the Secret keeps its namespace Terminating
/// for ever): the last by name is the one that releases, and it waits for the others, which
/// never wait for anything, so the order of their cleanups does not matter.
pub fn secret_release(db: &Database, secret: &str, databases: &[Database]) -> SecretRelease {
    let me = db.name_any();
    let others: Vec<&Database> = databases
        .iter()
        .filter(|d| d.uid() != db.uid())
        .filter(|d| {
            d.spec
                .external
                .as_ref()
                .is_some_and(|e| e.admin_secret_ref.name == secret)
        })
        .collect();
    if others.is_empty() {
        return SecretRelease::Release;
    }
    if others.iter().any(|d| d.meta().deletion_timestamp.is_none()) {
        return SecretRelease::InUse;
    }
    let mut deleting: Vec<String> = others.iter().map(|d| d.name_any()).collect();
    deleting.sort();
    if deleting.iter().any(|name| *name > me) {
        SecretRelease::LeaveToLast
    } else {
        SecretRelease::WaitFor(deleting)
    }
}

/// The [`secret_release`] of `db` for its `external` server's admin Secret (`None` without
/// one), read from the API server, not a cache, since the Databases sharing it change while
/// they are deleted. [`SecretRelease::WaitFor`] is [`Error::WaitingForDatabases`].
async fn admin_secret_release(
    db: &Database,
    ctx: &Context<State>,
) -> Result<Option<SecretRelease>, Error> {
    let Some(ext) = &db.spec.external else {
        return Ok(None);
    };
    let name = &ext.admin_secret_ref.name;
    let databases: Api<Database> =
        Api::namespaced(ctx.client.clone(), &db.namespace().unwrap_or_default());
    let all = databases
        .list(&ListParams::default())
        .await
        .map_err(|source| Error::Read {
            what: "Databases".into(),
            source,
        })?
        .items;
    match secret_release(db, name, &all) {
        SecretRelease::WaitFor(databases) => Err(Error::WaitingForDatabases {
            secret: name.clone(),
            databases: databases.join(", "),
        }),
        release => Ok(Some(release)),
    }
}

/// Before a deleting Database's cleanup: the last (by name) of several deleting Databases that
/// share an admin Secret waits for the others ([`Error::WaitingForDatabases`]).
async fn wait_for_sharing_databases(db: &Database, ctx: &Context<State>) -> Result<(), Error> {
    admin_secret_release(db, ctx).await.map(|_| ())
}

/// At the end of a deleting Database's cleanup: releases the admin Secret's in-use finalizer
/// when [`secret_release`] says so (a Database that came to share it meanwhile makes the
/// last one wait again).
async fn release_admin_secret(db: &Database, ctx: &Context<State>) -> Result<(), Error> {
    match admin_secret_release(db, ctx).await? {
        Some(SecretRelease::Release) => protect_admin_secret(db, ctx, None).await,
        _ => Ok(()),
    }
}

/// Adds (`protect`) or removes this operator's [`IN_USE_FINALIZER`] on the admin Secret of
/// an `external` server (removed only as [`release_admin_secret`] decides). Server-side apply
/// under its own field manager touches only that list entry.
async fn protect_admin_secret(
    db: &Database,
    ctx: &Context<State>,
    protect: Option<&mut StillWanted<'_, Database>>,
) -> Result<(), Error> {
    let Some(ext) = &db.spec.external else {
        return Ok(());
    };
    let ns = db.namespace().unwrap_or_default();
    let name = &ext.admin_secret_ref.name;
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &ns);
    let read_err = |source| Error::Read {
        what: format!("Secret {name}"),
        source,
    };
    let Some(secret) = secrets.get_opt(name).await.map_err(read_err)? else {
        return Ok(());
    };
    let has = secret.finalizers().iter().any(|f| f == IN_USE_FINALIZER);
    // No finalizer can be added to an object already being deleted.
    let unchanged = if protect.is_some() {
        has || secret.metadata.deletion_timestamp.is_some()
    } else {
        !has
    };
    if unchanged {
        return Ok(());
    }
    let finalizers: Vec<&str> = match protect {
        Some(still_wanted) => {
            // A stale copy of a Database whose cleanup released the Secret must not hold it
            // again: nothing would ever release it.
            still_wanted.confirm().await?;
            vec![IN_USE_FINALIZER]
        }
        None => vec![],
    };
    let patch = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "finalizers": finalizers},
    });
    let patched = secrets
        .patch(
            name,
            &kube::api::PatchParams::apply(IN_USE_MANAGER),
            &kube::api::Patch::Apply(&patch),
        )
        .await;
    steward_core::object::unless_gone(patched)
        .map(drop)
        .map_err(|source| Error::ProtectSecret {
            name: name.clone(),
            source,
        })
}

async fn ensure_backup(
    db: &Database,
    ctx: &Context<State>,
    server: &Server,
) -> Result<backup::JobState, Error> {
    let ns = db.namespace().unwrap_or_default();
    let jobs: Api<Job> = Api::namespaced(ctx.client.clone(), &ns);
    let name = backup::name(db);
    let existing = jobs.get_opt(&name).await.map_err(|source| Error::Read {
        what: format!("Job {name}"),
        source,
    })?;
    let job = match existing {
        Some(job) => job,
        None => {
            let children = ctx.children(db);
            // The claim outlives the Database: no owner reference.
            children
                .clone()
                .without_owner_reference()
                .apply(backup::claim(db))
                .await?;
            let job = children
                .apply(backup::job(db, server, &ctx.data.options.backup_image))
                .await?;
            ctx.recorder
                .normal(
                    db,
                    "BackupStarted",
                    "Backup",
                    format!(
                        "started Job {name} to dump database {} before dropping it",
                        db.spec.name
                    ),
                )
                .await;
            job
        }
    };
    Ok(backup::job_state(&job))
}

fn status_of(
    db: &Database,
    progress: &Progress,
    result: Result<(), &Error>,
    deleting: bool,
) -> DatabaseStatus {
    let previous = db.status.clone().unwrap_or_default();
    let generation = db.meta().generation;
    let mut conds = previous.conditions.clone();
    let phase = crate::status::server_status(
        &mut conds,
        &progress.reachable,
        result,
        deleting,
        format!("database {} is owned by {}", db.spec.name, db.spec.owner),
        generation,
    );
    DatabaseStatus {
        phase: Some(phase),
        server: progress.server.clone().or(previous.server),
        secret_name: progress.secret.clone().or(previous.secret_name),
        backup: progress.backup.clone().or(previous.backup),
        observed_generation: generation,
        conditions: conds,
    }
}

async fn write_status(
    db: &Database,
    ctx: &Context<State>,
    status: DatabaseStatus,
) -> Result<(), Error> {
    ctx.apply_status(db, db.status.as_ref(), &status).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::{DatabaseSpec, ExternalServer, ResourcePhase, SslMode};
    use steward_core::conditions;

    pub(crate) fn database(name: &str) -> Database {
        let mut db = Database::new(
            name,
            DatabaseSpec {
                cluster_ref: None,
                external: Some(ExternalServer::plain("127.0.0.1", 5432, "admin")),
                name: "app".into(),
                owner: "app_owner".into(),
                extensions: vec![],
                schemas: vec![],
                deletion_policy: DeletionPolicy::Delete,
                backup_before_delete: true,
                backup: None,
                adopt: false,
            },
        );
        db.meta_mut().namespace = Some("ns".into());
        db.meta_mut().uid = Some("0123abcd-ffff".into());
        db.meta_mut().generation = Some(3);
        db
    }

    #[test]
    fn a_converge_says_what_it_did_once_and_nothing_when_nothing_changed() {
        let db = database("app");
        let reason = |created, adopted, changes: &[String]| {
            converge_event(&db, "pg:5432", created, adopted, changes).map(|e| e.reason)
        };
        let drift = ["ALTER ROLE app_owner LOGIN".to_string()];
        assert_eq!(reason(true, false, &drift), Some("Created"));
        assert_eq!(reason(false, true, &drift), Some("Adopted"));
        assert_eq!(reason(false, false, &drift), Some("DriftCorrected"));
        assert_eq!(reason(false, false, &[]), None);
    }

    #[test]
    fn of_several_databases_deleted_with_one_admin_secret_exactly_the_last_by_name_releases_it() {
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
        let secret = "admin"; // ExternalServer::plain's admin Secret
        let make = |name: &str, deleting: bool| {
            let mut d = database(name);
            d.meta_mut().uid = Some(format!("uid-{name}"));
            if deleting {
                d.meta_mut().deletion_timestamp = Some(Time(jiff::Timestamp::UNIX_EPOCH));
            }
            d
        };
        let all = [make("a", true), make("b", true), make("c", true)];
        let decisions: Vec<SecretRelease> = all
            .iter()
            .map(|d| secret_release(d, secret, &all))
            .collect();
        assert_eq!(
            decisions,
            [
                SecretRelease::LeaveToLast,
                SecretRelease::LeaveToLast,
                SecretRelease::WaitFor(vec!["a".into(), "b".into()]),
            ],
            "the two that finish first leave it; the last waits for them"
        );
        // Once a and b are gone, c releases it: whatever order their cleanups ran in.
        assert_eq!(
            secret_release(&all[2], secret, &all[2..]),
            SecretRelease::Release
        );
        // One that is not being deleted keeps it for everyone, and nobody waits for it.
        let with_live = [make("a", true), make("z", false)];
        assert_eq!(
            secret_release(&with_live[0], secret, &with_live),
            SecretRelease::InUse
        );
        // Another Secret, or a clusterRef, does not count.
        let mut other = make("b", true);
        other.spec.external = Some(ExternalServer::plain("127.0.0.1", 5432, "other-admin"));
        let mut cluster = make("c", true);
        cluster.spec.external = None;
        let unrelated = [make("a", true), other, cluster];
        assert_eq!(
            secret_release(&unrelated[0], secret, &unrelated),
            SecretRelease::Release
        );
    }

    #[test]
    fn validate_catches_what_the_schema_does() {
        let mut db = database("x");
        validate(&db).unwrap();
        db.spec.name = "x\"; DROP DATABASE postgres; --".into();
        assert!(
            matches!(validate(&db), Err(Error::InvalidSpec(m)) if m.contains("invalid database name"))
        );
        let mut db = database("x");
        db.spec.owner = "pg_signal_backend".into();
        assert!(validate(&db).is_err());
        let mut db = database("x");
        db.spec.external = None;
        assert!(validate(&db).is_err(), "neither clusterRef nor external");
    }

    #[test]
    fn unreachable_server_is_a_condition_with_the_error() {
        let db = database("x");
        let progress = Progress {
            server: Some("127.0.0.1:1".into()),
            reachable: Some(Err("connection refused".into())),
            secret: Some("x-db-credentials".into()),
            backup: None,
        };
        let err = Error::MissingReference("whatever".into());
        let s = status_of(&db, &progress, Err(&err), false);
        let c = conditions::get(&s.conditions, SERVER_REACHABLE).unwrap();
        assert_eq!(
            (c.status.as_str(), c.reason.as_str(), c.message.as_str()),
            ("False", "ServerUnreachable", "connection refused")
        );
        assert_eq!(s.phase, Some(ResourcePhase::Pending));
        assert_eq!(s.observed_generation, Some(3));
        let s = status_of(&db, &progress, Err(&err), true);
        assert_eq!(s.phase, Some(ResourcePhase::Deleting));
    }

    #[test]
    fn backup_job_reads_credentials_from_the_admin_secret() {
        let mut db = database("orders");
        db.meta_mut().deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::from_second(1_700_000_000).unwrap(),
            ));
        let server = Server {
            host: "h".into(),
            port: 5432,
            ssl_mode: SslMode::Disable,
            admin_user: "admin".into(),
            admin_password: Password::from_existing("secret-pw".into()),
            admin_database: "postgres".into(),
            ca_pem: None,
        };
        let job = backup::job(&db, &server, "postgres:17");
        let text = serde_json::to_string(&job).unwrap();
        assert!(
            !text.contains("secret-pw"),
            "the password is a secretKeyRef, never inline"
        );
        assert_eq!(backup::name(&db), "orders-backup-0123abcd");
        assert_eq!(backup::file_name(&db), "app-20231114T221320Z.dump");
        assert!(text.contains("--file=/backup/app-20231114T221320Z.dump"));
        let claim = backup::claim(&db);
        assert_eq!(
            claim.metadata.name.as_deref(),
            Some("orders-backup-0123abcd")
        );
        assert_eq!(backup::job_state(&job), backup::JobState::Running);
        assert!(
            !text.contains("PGSSLROOTCERT"),
            "no CA, nothing to verify with"
        );

        // With the server's CA known, the dump verifies the server with it.
        let verified = Server {
            ssl_mode: SslMode::VerifyFull,
            ca_pem: Some(b"pem".to_vec()),
            ..server
        };
        let job = backup::job(&db, &verified, "postgres:17");
        let pod = job.spec.unwrap().template.spec.unwrap();
        let env = pod.containers[0].env.clone().unwrap();
        let var = |n: &str| {
            env.iter()
                .find(|e| e.name == n)
                .and_then(|e| e.value.clone())
        };
        assert_eq!(var("PGSSLMODE").as_deref(), Some("verify-full"));
        let root = var("PGSSLROOTCERT").unwrap();
        let volumes = pod.volumes.unwrap();
        let ca = volumes.iter().find(|v| v.name == "ca").unwrap();
        assert_eq!(
            ca.secret.as_ref().unwrap().items.as_ref().unwrap()[0].key,
            "ca.crt"
        );
        let mount = pod.containers[0].volume_mounts.as_ref().unwrap();
        let dir = &mount.iter().find(|m| m.name == "ca").unwrap().mount_path;
        assert_eq!(root, format!("{dir}/ca.crt"));
    }
}
