//! The DatabaseRole controller: a login role with `owner`, `readWrite` or `readOnly`
//! privileges on a [`Database`], its password in a Secret, rotated on an interval or when
//! the annotation [`ROTATE_ANNOTATION`] changes.
//!
//! A rotation writes the new password to the Secret first and then to the server (as a
//! SCRAM verifier); every reconcile checks the server's verifier against the Secret, so a
//! rotation interrupted between the two steps, or a password changed by hand, converges.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::Api;
use kube::runtime::controller::Action;
use kube::{Resource, ResourceExt};
use steward_core::Context;
use steward_core::events::Wanted;
use steward_core::finalizer::{self, Cleanup};

use crate::crd::{
    Database, DatabaseRole, DatabaseRoleStatus, DeletionPolicy, Ensure, ROTATE_ANNOTATION,
};
use crate::ident::{self, Kind};
use crate::ownership::{self, Marker};
use crate::password::Password;
use crate::pg::Server;
use crate::{Error, State, observe, pg, server, sql};

/// The finalizer of DatabaseRoles.
pub const FINALIZER: &str = "database.steward.dev/role-cleanup";
/// Annotation on the role's Secret: when its password was generated (RFC 3339).
pub const UPDATED_AT_ANNOTATION: &str = "database.steward.dev/password-updated-at";
/// Annotation on the role's Secret: the last value of [`ROTATE_ANNOTATION`] acted on.
pub const HANDLED_REQUEST_ANNOTATION: &str = "database.steward.dev/rotation-request";

/// Name of a DatabaseRole's credentials Secret.
pub fn secret_name(role: &DatabaseRole) -> String {
    format!("{}-role-credentials", role.name_any())
}

/// Reconciles one DatabaseRole.
///
/// # Errors
/// The step that failed, wrapped by the finalizer.
pub async fn reconcile(
    role: Arc<DatabaseRole>,
    ctx: Arc<Context<State>>,
) -> Result<Action, finalizer::Error<Error>> {
    let ctx = ctx.as_ref();
    finalizer::dispatch(
        &ctx.client,
        FINALIZER,
        role,
        |role| async move { apply(&role, ctx).await },
        |role| async move { cleanup(&role, ctx).await },
    )
    .await
}

/// Why the password changes in this reconcile.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rotation {
    /// No password yet.
    Initial,
    /// The rotation annotation has a value not acted on yet.
    Requested,
    /// The rotation interval has passed.
    Interval,
}

/// Whether (and why) to generate a new password.
pub fn rotation(
    has_password: bool,
    updated_at: Option<Timestamp>,
    handled_request: Option<&str>,
    requested: Option<&str>,
    interval: Option<Duration>,
    now: Timestamp,
) -> Option<Rotation> {
    if !has_password {
        return Some(Rotation::Initial);
    }
    if requested.is_some_and(|r| Some(r) != handled_request) {
        return Some(Rotation::Requested);
    }
    match (interval, updated_at) {
        (Some(every), Some(at)) if due(at, every) <= now => Some(Rotation::Interval),
        _ => None,
    }
}

fn due(at: Timestamp, every: Duration) -> Timestamp {
    let every = SignedDuration::try_from(every).unwrap_or(SignedDuration::MAX);
    at.checked_add(every).unwrap_or(Timestamp::MAX)
}

/// The rotation interval of `role`, if any.
///
/// # Errors
/// [`Error::InvalidSpec`] for an unparsable interval or one outside 1h..=87600h (the schema's
/// bounds, checked again for objects admitted before them).
pub fn interval(role: &DatabaseRole) -> Result<Option<Duration>, Error> {
    let Some(r) = &role.spec.password_rotation else {
        return Ok(None);
    };
    let d = steward_core::cli::parse_duration(&r.interval)
        .map_err(|e| Error::InvalidSpec(format!("passwordRotation.interval: {e}")))?;
    if !(MIN_ROTATION..=MAX_ROTATION).contains(&d) {
        return Err(Error::InvalidSpec(format!(
            "passwordRotation.interval {:?} must be between 1h and 87600h",
            r.interval
        )));
    }
    Ok(Some(d))
}

/// The shortest rotation interval: rotating more often only breaks clients mid-deploy.
pub const MIN_ROTATION: Duration = Duration::from_secs(3600);
/// The longest rotation interval (ten years).
pub const MAX_ROTATION: Duration = Duration::from_secs(87600 * 3600);

/// The owner marker of `role` (see [`crate::ownership`]).
fn marker(role: &DatabaseRole) -> Marker {
    Marker::new(
        "DatabaseRole",
        &role.namespace().unwrap_or_default(),
        &role.name_any(),
        role.meta().uid.as_deref().unwrap_or_default(),
    )
}

#[derive(Debug, Default)]
struct Progress {
    reachable: Option<Result<(), String>>,
    secret: Option<String>,
    updated_at: Option<Timestamp>,
}

async fn apply(role: &DatabaseRole, ctx: &Context<State>) -> Result<Action, Error> {
    let mut progress = Progress::default();
    let result = converge(role, ctx, &mut progress).await;
    if matches!(result, Err(Error::Gone)) {
        return Ok(Action::await_change());
    }
    let status = status_of(role, &progress, result.as_ref().map(|_| ()), false);
    write_status(role, ctx, status).await?;
    let next_rotation = result?;
    let resync = ctx.data.options.resync_interval;
    Ok(Action::requeue(
        next_rotation.map_or(resync, |d| d.min(resync)),
    ))
}

async fn get_database(ctx: &Context<State>, ns: &str, name: &str) -> Result<Database, Error> {
    Api::<Database>::namespaced(ctx.client.clone(), ns)
        .get_opt(name)
        .await
        .map_err(|source| Error::Read {
            what: format!("Database {name}"),
            source,
        })?
        .ok_or_else(|| {
            Error::MissingReference(format!("Database {name} not found in namespace {ns}"))
        })
}

/// Converges the role; returns how long until the next interval rotation.
/// The role's Secret as [`role_secret`] wrote it.
struct RoleSecret {
    name: String,
    password: Password,
    /// Why the password is new, if it is.
    rotate: Option<Rotation>,
    /// When the password was last set.
    updated_at: Timestamp,
}

/// The role's password — kept, generated, or rotated (on request, or its interval `every`
/// elapsed) — written to its Secret (refused if that Secret is not this role's), before the
/// server gets it.
async fn role_secret(
    role: &DatabaseRole,
    ctx: &Context<State>,
    server: &Server,
    dbname: &str,
    every: Option<Duration>,
) -> Result<RoleSecret, Error> {
    let ns = role.namespace().unwrap_or_default();
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &ns);
    let name = secret_name(role);
    let existing = secrets.get_opt(&name).await.map_err(|source| Error::Read {
        what: format!("Secret {name}"),
        source,
    })?;
    crate::ownership::ensure_ours(existing.as_ref(), role, None)?;
    let annotations = existing
        .as_ref()
        .map(|s| s.annotations().clone())
        .unwrap_or_default();
    let current = existing.as_ref().and_then(server::password_of);
    let mut updated_at = annotations
        .get(UPDATED_AT_ANNOTATION)
        .and_then(|t| t.parse::<Timestamp>().ok());
    let requested = role.annotations().get(ROTATE_ANNOTATION).cloned();
    let handled = annotations.get(HANDLED_REQUEST_ANNOTATION).cloned();
    let now = Timestamp::now();
    let rotate = rotation(
        current.is_some(),
        updated_at,
        handled.as_deref(),
        requested.as_deref(),
        every,
        now,
    );
    let password = match (&rotate, current) {
        (None, Some(p)) => p,
        _ => {
            updated_at = Some(Timestamp::from_second(now.as_second()).unwrap_or(now));
            Password::generate()
        }
    };
    let updated_at = updated_at.unwrap_or(now);
    let mut new_annotations =
        BTreeMap::from([(UPDATED_AT_ANNOTATION.to_string(), updated_at.to_string())]);
    if let Some(r) = requested.or(handled) {
        new_annotations.insert(HANDLED_REQUEST_ANNOTATION.to_string(), r);
    }
    let data = server::credentials(server, dbname, &role.spec.role_name, &password);
    ctx.children(role)
        .ensure_cached(
            &ctx.data.children.secrets,
            server::credentials_secret(&name, &ns, data, new_annotations),
        )
        .await?;
    Ok(RoleSecret {
        name,
        password,
        rotate,
        updated_at,
    })
}

/// The Event saying what a converge did to the role's password: created the role (`created`:
/// it did not exist), or rotated its password on request or after its interval.
fn rotation_event(
    rotate: Option<Rotation>,
    created: bool,
    role_name: &str,
    address: &str,
) -> Option<Wanted> {
    match rotate? {
        Rotation::Initial if created => Some(Wanted::normal(
            "Created",
            "Create",
            format!("created role {role_name} on {address}"),
        )),
        Rotation::Initial => None,
        Rotation::Requested => Some(Wanted::normal(
            "PasswordRotated",
            "Rotate",
            "rotated the password on request (annotation)",
        )),
        Rotation::Interval => Some(Wanted::normal(
            "PasswordRotated",
            "Rotate",
            "rotated the password (interval elapsed)",
        )),
    }
}

async fn converge(
    role: &DatabaseRole,
    ctx: &Context<State>,
    progress: &mut Progress,
) -> Result<Option<Duration>, Error> {
    ident::validate(Kind::Role, &role.spec.role_name)
        .map_err(|e| Error::InvalidSpec(e.to_string()))?;
    let every = interval(role)?;
    let ns = role.namespace().unwrap_or_default();
    let db = get_database(ctx, &ns, &role.spec.database_ref.name).await?;
    let (dbname, owner) = (db.spec.name.clone(), db.spec.owner.clone());
    if role.spec.role_name == owner {
        return Err(Error::InvalidSpec(format!(
            "roleName {owner:?} is the owner of Database {}; use another name",
            db.name_any()
        )));
    }
    let server = server::resolve(&ctx.client, &ns, &db.spec).await?;
    if server.admin_user == role.spec.role_name {
        return Err(Error::InvalidSpec(format!(
            "roleName {:?} is the server's admin role",
            role.spec.role_name
        )));
    }

    // The password: kept, generated, or rotated; written to the Secret before the server.
    let secret = role_secret(role, ctx, &server, &dbname, every).await?;
    let (password, rotate, updated_at) = (secret.password, secret.rotate, secret.updated_at);
    progress.secret = Some(secret.name);
    progress.updated_at = Some(updated_at);

    // The server.
    let address = server.address();
    let admin = pg::connect_admin(&server, &ctx.leadership, &mut progress.reachable).await?;
    let sql_err = |step: &'static str| {
        let address = address.clone();
        move |e| Error::sql(step, &address, e)
    };
    if observe::database_owner(&admin, &dbname)
        .await
        .map_err(sql_err("read the database"))?
        .is_none()
    {
        return Err(Error::MissingReference(format!(
            "database {dbname} does not exist on {address} yet"
        )));
    }
    // Ownership first: a role another resource owns is never altered or handed out.
    let me = marker(role);
    let observed = observe::role_ownership(&admin, &role.spec.role_name)
        .await
        .map_err(sql_err("read the role's marker"))?;
    let claim = ownership::claim(
        &ctx.client,
        &format!("role {:?}", role.spec.role_name),
        &observed,
        &me,
        role.spec.adopt,
    )
    .await?;
    let state = observe::role(&admin, &role.spec.role_name)
        .await
        .map_err(sql_err("read the role"))?;
    let plan = ownership::mark(
        sql::plan_login_role_off_runtime(&role.spec.role_name, state.as_ref(), &password).await?,
        &claim,
        sql::comment_on_role(&role.spec.role_name, &me.render()),
    );
    let mut still_wanted = crate::database::StillWanted::new(ctx, role);
    still_wanted.before(&plan).await?;
    crate::run_plan::<DatabaseRole>(ctx, &admin, &plan)
        .await
        .map_err(sql_err("create or update the role"))?;

    let inside = pg::connect(&server, &dbname, &ctx.leadership)
        .await
        .map_err(sql_err("connect to the database"))?;
    let in_state = observe::in_database(&inside)
        .await
        .map_err(sql_err("read the schemas"))?;
    let mut schemas: Vec<String> = vec!["public".to_string()];
    schemas.extend(
        db.spec
            .schemas
            .iter()
            .filter(|s| s.ensure == Ensure::Present)
            .map(|s| s.name.clone()),
    );
    schemas.retain(|s| in_state.schemas.contains_key(s));
    schemas.dedup();
    let member = observe::is_direct_member(&inside, &role.spec.role_name, &owner)
        .await
        .map_err(sql_err("read role membership"))?;
    let held = observe::grants(&inside, &dbname, &role.spec.role_name, &owner, &schemas)
        .await
        .map_err(sql_err("read the grants"))?;
    let grants = sql::plan_grants(
        &dbname,
        &owner,
        &role.spec.role_name,
        role.spec.privileges,
        &held,
        member,
    );
    still_wanted.before(&grants).await?;
    crate::run_plan::<DatabaseRole>(ctx, &inside, &grants)
        .await
        .map_err(sql_err("grant privileges"))?;

    if let Some(event) = rotation_event(rotate, state.is_none(), &role.spec.role_name, &address) {
        ctx.recorder.emit(role, event).await;
    }
    Ok(every.map(|e| {
        let next = due(updated_at, e);
        Duration::try_from(next.duration_since(Timestamp::now()))
            .unwrap_or(Duration::from_secs(1))
            .max(Duration::from_secs(1))
    }))
}

async fn cleanup(role: &DatabaseRole, ctx: &Context<State>) -> Result<Cleanup, Error> {
    let mut progress = Progress::default();
    let result = drop_role(role, ctx, &mut progress)
        .await
        .map_err(Error::blocking_cleanup);
    if let Err(e) = &result {
        let status = status_of(role, &progress, Err(e), true);
        write_status(role, ctx, status).await?;
    }
    result.map(|_| Cleanup::Done)
}

/// Whether `role` never got as far as its server: its credentials Secret (written before the
/// role is created) does not exist and its status never named one.
async fn never_created(role: &DatabaseRole, ctx: &Context<State>) -> Result<bool, Error> {
    if role
        .status
        .as_ref()
        .is_some_and(|s| s.secret_name.is_some() || s.password_updated_at.is_some())
    {
        return Ok(false);
    }
    let name = secret_name(role);
    let secrets: Api<Secret> =
        Api::namespaced(ctx.client.clone(), &role.namespace().unwrap_or_default());
    let secret = secrets.get_opt(&name).await.map_err(|source| Error::Read {
        what: format!("Secret {name}"),
        source,
    })?;
    Ok(secret.is_none())
}

async fn drop_role(
    role: &DatabaseRole,
    ctx: &Context<State>,
    progress: &mut Progress,
) -> Result<Action, Error> {
    match ready_to_drop(role, ctx).await? {
        Some((db, server)) => drop_on_server(role, ctx, progress, &db, &server).await,
        None => Ok(Action::await_change()),
    }
}

/// Whether the role may be dropped now, and where: its Database (for the server and the
/// owner its objects go to). `None`: nothing is dropped (kept by `deletionPolicy: Retain`,
/// never created, or its cluster is gone), said by an Event; the deletion goes on.
///
/// # Errors
/// [`Error::MissingReference`] when its Database is gone but the role may exist.
async fn ready_to_drop(
    role: &DatabaseRole,
    ctx: &Context<State>,
) -> Result<Option<(Database, Server)>, Error> {
    if role.spec.deletion_policy == DeletionPolicy::Retain {
        ctx.recorder
            .normal(
                role,
                "Retained",
                "Delete",
                format!(
                    "deletionPolicy Retain: role {} was left on the server",
                    role.spec.role_name
                ),
            )
            .await;
        return Ok(None);
    }
    ident::validate(Kind::Role, &role.spec.role_name)
        .map_err(|e| Error::InvalidSpec(e.to_string()))?;
    let ns = role.namespace().unwrap_or_default();
    let db = match get_database(ctx, &ns, &role.spec.database_ref.name).await {
        Ok(db) => db,
        Err(Error::MissingReference(m)) => {
            // Its password goes to its Secret before the role goes to the server: without
            // either (nor a trace of them in status), it never created anything.
            if never_created(role, ctx).await? {
                ctx.recorder
                    .normal(
                        role,
                        "NothingToDrop",
                        "Delete",
                        format!(
                            "{m}, and role {} was never created (no credentials Secret was ever written), so there is nothing to drop",
                            role.spec.role_name
                        ),
                    )
                    .await;
                return Ok(None);
            }
            return Err(Error::MissingReference(format!(
                "{m}: cannot find the server to drop role {}; recreate the Database or set deletionPolicy: Retain to release this object",
                role.spec.role_name
            )));
        }
        Err(other) => return Err(other),
    };
    if let Some(cluster) = crate::database::cluster_gone(ctx, &ns, &db.spec).await? {
        ctx.recorder
            .warning(
                role,
                "ClusterGone",
                "Delete",
                format!(
                    "PostgresCluster {cluster} is gone or being deleted, so role {} was not dropped: it goes with the cluster's volumes (deletionPolicy Delete) or stays on the kept ones (Retain)",
                    role.spec.role_name
                ),
            )
            .await;
        return Ok(None);
    }
    let server = server::resolve(&ctx.client, &ns, &db.spec).await?;
    Ok(Some((db, server)))
}

/// Drops the role (its objects reassigned to the database's owner first), only if this
/// DatabaseRole made it (its owner marker).
async fn drop_on_server(
    role: &DatabaseRole,
    ctx: &Context<State>,
    progress: &mut Progress,
    db: &Database,
    server: &Server,
) -> Result<Action, Error> {
    let address = server.address();
    let admin = pg::connect_admin(server, &ctx.leadership, &mut progress.reachable).await?;
    let sql_err = |step: &'static str| {
        let address = address.clone();
        move |e| Error::sql(step, &address, e)
    };
    observe::end_stale_sessions(&admin, &pg::application_name(ctx.leadership.identity()))
        .await
        .map_err(sql_err("end other instances' sessions"))?;
    let observed = observe::role_ownership(&admin, &role.spec.role_name)
        .await
        .map_err(sql_err("read the role's marker"))?;
    if !observed.exists {
        return Ok(Action::await_change());
    }
    if !ownership::may_drop(&observed, &marker(role)) {
        ctx.recorder
            .warning(
                role,
                "NotOwned",
                "Delete",
                format!(
                    "role {} was not created by this DatabaseRole (its owner marker: {}), so it was not dropped",
                    role.spec.role_name,
                    observed.comment.as_deref().unwrap_or("none")
                ),
            )
            .await;
        return Ok(Action::await_change());
    }
    let db_exists = observe::database_owner(&admin, &db.spec.name)
        .await
        .map_err(sql_err("read the database"))?
        .is_some();
    let owner_exists = observe::role(&admin, &db.spec.owner)
        .await
        .map_err(sql_err("read the owner role"))?
        .is_some();
    if !crate::database::still_deleting(ctx, role).await? {
        return Ok(Action::await_change());
    }
    let (inside_plan, admin_plan) = sql::plan_drop_role(
        &role.spec.role_name,
        &db.spec.owner,
        db_exists && owner_exists,
    );
    if !inside_plan.is_empty() {
        let inside = pg::connect(server, &db.spec.name, &ctx.leadership)
            .await
            .map_err(sql_err("connect to the database"))?;
        crate::run_plan::<DatabaseRole>(ctx, &inside, &inside_plan)
            .await
            .map_err(sql_err("reassign and drop the role's objects"))?;
    }
    crate::run_plan::<DatabaseRole>(ctx, &admin, &admin_plan)
        .await
        .map_err(sql_err("drop the role"))?;
    ctx.recorder
        .normal(
            role,
            "Dropped",
            "Delete",
            format!("dropped role {}", role.spec.role_name),
        )
        .await;
    Ok(Action::await_change())
}

fn status_of(
    role: &DatabaseRole,
    progress: &Progress,
    result: Result<(), &Error>,
    deleting: bool,
) -> DatabaseRoleStatus {
    let previous = role.status.clone().unwrap_or_default();
    let generation = role.meta().generation;
    let mut conds = previous.conditions.clone();
    let phase = crate::status::server_status(
        &mut conds,
        &progress.reachable,
        result,
        deleting,
        format!(
            "role {} has {:?} privileges",
            role.spec.role_name, role.spec.privileges
        ),
        generation,
    );
    DatabaseRoleStatus {
        phase: Some(phase),
        secret_name: progress.secret.clone().or(previous.secret_name),
        password_updated_at: progress
            .updated_at
            .map(Time)
            .or(previous.password_updated_at),
        observed_generation: generation,
        conditions: conds,
    }
}

async fn write_status(
    role: &DatabaseRole,
    ctx: &Context<State>,
    status: DatabaseRoleStatus,
) -> Result<(), Error> {
    ctx.apply_status(role, role.status.as_ref(), &status)
        .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: i64) -> Timestamp {
        Timestamp::from_second(s).unwrap()
    }

    #[test]
    fn a_converge_says_when_it_created_the_role_or_rotated_its_password() {
        let reason = |rotate, created| {
            rotation_event(rotate, created, "app_reader", "pg:5432").map(|e| e.reason)
        };
        assert_eq!(reason(Some(Rotation::Initial), true), Some("Created"));
        // A role that existed (adopted, or its Secret lost): its new password is no creation.
        assert_eq!(reason(Some(Rotation::Initial), false), None);
        assert_eq!(
            reason(Some(Rotation::Requested), false),
            Some("PasswordRotated")
        );
        assert_eq!(
            reason(Some(Rotation::Interval), false),
            Some("PasswordRotated")
        );
        assert_eq!(reason(None, false), None);
    }

    #[test]
    fn rotation_decisions() {
        let hour = Some(Duration::from_secs(3600));
        assert_eq!(
            rotation(false, None, None, None, None, t(0)),
            Some(Rotation::Initial)
        );
        assert_eq!(
            rotation(true, Some(t(0)), None, None, None, t(10_000)),
            None,
            "no interval, no request"
        );
        assert_eq!(rotation(true, Some(t(0)), None, None, hour, t(3599)), None);
        assert_eq!(
            rotation(true, Some(t(0)), None, None, hour, t(3600)),
            Some(Rotation::Interval)
        );
        assert_eq!(
            rotation(true, Some(t(0)), None, Some("1"), None, t(1)),
            Some(Rotation::Requested)
        );
        assert_eq!(
            rotation(true, Some(t(0)), Some("1"), Some("1"), None, t(1)),
            None,
            "a request is acted on once"
        );
        assert_eq!(
            rotation(true, Some(t(0)), Some("1"), Some("2"), None, t(1)),
            Some(Rotation::Requested)
        );
        assert_eq!(
            rotation(true, None, None, None, hour, t(1)),
            None,
            "unknown age: no rotation, the age is recorded"
        );
    }

    #[test]
    fn interval_parses() {
        let mut role = DatabaseRole::new(
            "r",
            crate::crd::DatabaseRoleSpec {
                database_ref: crate::crd::LocalRef { name: "db".into() },
                role_name: "r".into(),
                privileges: crate::crd::Privileges::ReadOnly,
                password_rotation: Some(crate::crd::PasswordRotation {
                    interval: "720h".into(),
                }),
                deletion_policy: DeletionPolicy::Retain,
                adopt: false,
            },
        );
        assert_eq!(
            interval(&role).unwrap(),
            Some(Duration::from_secs(720 * 3600))
        );
        role.spec.password_rotation = Some(crate::crd::PasswordRotation {
            interval: "0s".into(),
        });
        assert!(interval(&role).is_err());
        role.spec.password_rotation = None;
        assert_eq!(interval(&role).unwrap(), None);
    }
}
