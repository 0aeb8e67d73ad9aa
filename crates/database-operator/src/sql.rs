//! SQL, built by pure functions: catalog queries (every value a bind parameter) and the
//! statements that converge a server to the desired state (every identifier through
//! [`quote_ident`](crate::ident::quote_ident), every literal through [`quote_literal`], since PostgreSQL's utility
//! statements take no parameters).
//!
//! Each `plan_*` function compares observed catalog state with the desired state and returns
//! the statements to run, in order, one per round trip (`CREATE DATABASE` refuses to run in
//! the implicit transaction of a multi-statement query). An empty plan means "converged".

use std::collections::{BTreeMap, BTreeSet};

use crate::crd::{Ensure, ExtensionSpec, Privileges, SchemaSpec};
use crate::ident::{quote_ident as qi, quote_literal};
use crate::password::{self, Password};

// ---------------------------------------------------------------------------------------
// Catalog queries (bind parameters only)
// ---------------------------------------------------------------------------------------

/// `$1` role name → `rolsuper`, `rolcanlogin`.
pub const QUERY_ROLE: &str =
    "SELECT rolsuper, rolcanlogin FROM pg_catalog.pg_roles WHERE rolname = $1";
/// `$1` role name → `rolpassword` (superusers only; others get a permission error).
pub const QUERY_ROLE_PASSWORD: &str =
    "SELECT rolpassword FROM pg_catalog.pg_authid WHERE rolname = $1";
/// → whether the session user is a superuser, and the server's major version.
pub const QUERY_SESSION: &str = "SELECT rolsuper, current_setting('server_version_num')::int / 10000 FROM pg_catalog.pg_roles WHERE rolname = current_user";
/// `$1` role → whether the session user is a member of it (with its privileges).
pub const QUERY_IS_MEMBER: &str = "SELECT pg_catalog.pg_has_role(current_user, $1, 'USAGE')";
/// `$1` member, `$2` group → whether `$1` is a direct member of `$2`.
pub const QUERY_DIRECT_MEMBER: &str = "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_auth_members m \
     JOIN pg_catalog.pg_roles r ON r.oid = m.roleid JOIN pg_catalog.pg_roles u ON u.oid = m.member \
     WHERE u.rolname = $1 AND r.rolname = $2)";
/// `$1` role → its comment (the ownership marker) and whether it is privileged: superuser,
/// CREATEROLE, REPLICATION, BYPASSRLS, or a member of a `pg_*` role.
pub const QUERY_ROLE_OWNERSHIP: &str = "SELECT pg_catalog.shobj_description(r.oid, 'pg_authid'), \
     r.rolsuper OR r.rolcreaterole OR r.rolreplication OR r.rolbypassrls OR EXISTS ( \
     SELECT 1 FROM pg_catalog.pg_auth_members m JOIN pg_catalog.pg_roles g ON g.oid = m.roleid \
     WHERE m.member = r.oid AND g.rolname LIKE 'pg\\_%') \
     FROM pg_catalog.pg_roles r WHERE r.rolname = $1";
/// `$1` database → its comment (the ownership marker).
pub const QUERY_DATABASE_OWNERSHIP: &str = "SELECT pg_catalog.shobj_description(oid, 'pg_database') \
     FROM pg_catalog.pg_database WHERE datname = $1";
/// `$1` database → owner's name.
pub const QUERY_DATABASE_OWNER: &str =
    "SELECT pg_catalog.pg_get_userbyid(datdba) FROM pg_catalog.pg_database WHERE datname = $1";
/// `$1` database → whether PUBLIC may connect.
pub const QUERY_PUBLIC_CONNECT: &str = "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_database d, \
     pg_catalog.aclexplode(COALESCE(d.datacl, pg_catalog.acldefault('d', d.datdba))) a \
     WHERE d.datname = $1 AND a.grantee = 0 AND a.privilege_type = 'CONNECT')";
/// `$1` role → names of the databases it owns.
pub const QUERY_OWNED_DATABASES: &str = "SELECT datname FROM pg_catalog.pg_database d \
     JOIN pg_catalog.pg_roles r ON r.oid = d.datdba WHERE r.rolname = $1 ORDER BY datname";
/// → every schema of the current database and its owner.
pub const QUERY_SCHEMAS: &str =
    "SELECT nspname, pg_catalog.pg_get_userbyid(nspowner) FROM pg_catalog.pg_namespace";
/// → every extension installed in the current database.
pub const QUERY_EXTENSIONS: &str = "SELECT extname FROM pg_catalog.pg_extension";
/// `$1` role, `$2` database → whether CONNECT on it is granted to the role by name.
pub const QUERY_ROLE_CONNECT: &str = "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_database d, \
     pg_catalog.aclexplode(d.datacl) a JOIN pg_catalog.pg_roles r ON r.oid = a.grantee \
     WHERE r.rolname = $1 AND d.datname = $2 AND a.privilege_type = 'CONNECT')";
/// `$1` role, `$2` owner, `$3` schemas → per schema: whether the role holds USAGE on it by
/// name, and the privileges the owner's default ACL there gives it on new tables and on new
/// sequences.
pub const QUERY_SCHEMA_GRANTS: &str = "SELECT n.nspname, \
     EXISTS (SELECT 1 FROM pg_catalog.aclexplode(n.nspacl) a \
       WHERE a.grantee = r.oid AND a.privilege_type = 'USAGE'), \
     ARRAY(SELECT a.privilege_type FROM pg_catalog.pg_default_acl d, pg_catalog.aclexplode(d.defaclacl) a \
       WHERE d.defaclrole = o.oid AND d.defaclnamespace = n.oid AND d.defaclobjtype = 'r' AND a.grantee = r.oid), \
     ARRAY(SELECT a.privilege_type FROM pg_catalog.pg_default_acl d, pg_catalog.aclexplode(d.defaclacl) a \
       WHERE d.defaclrole = o.oid AND d.defaclnamespace = n.oid AND d.defaclobjtype = 'S' AND a.grantee = r.oid) \
     FROM pg_catalog.pg_namespace n, pg_catalog.pg_roles r, pg_catalog.pg_roles o \
     WHERE r.rolname = $1 AND o.rolname = $2 AND n.nspname = ANY($3)";
/// `$1` role, `$2` schemas → per schema, kind (sequence or not) and privilege: how many
/// objects there are and on how many the role holds the privilege by name. One row per
/// privilege, not per object: a schema of 10 000 tables is still at most 12 rows.
pub const QUERY_OBJECT_GRANTS: &str = "WITH rel AS (SELECT n.nspname, c.relkind = 'S' AS seq, \
     ARRAY(SELECT a.privilege_type FROM pg_catalog.aclexplode(c.relacl) a \
       JOIN pg_catalog.pg_roles r ON r.oid = a.grantee WHERE r.rolname = $1) AS held \
     FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
     WHERE n.nspname = ANY($2) AND c.relkind IN ('r', 'p', 'v', 'm', 'f', 'S')) \
     SELECT nspname, seq, p, count(*), count(*) FILTER (WHERE p = ANY(held)) \
     FROM rel, unnest(ARRAY['SELECT', 'INSERT', 'UPDATE', 'DELETE', 'TRUNCATE', 'USAGE']) p \
     GROUP BY 1, 2, 3";
/// `$1` database → terminates every other session on it.
pub const TERMINATE_CONNECTIONS: &str = "SELECT pg_catalog.pg_terminate_backend(pid) FROM pg_catalog.pg_stat_activity \
     WHERE datname = $1 AND pid <> pg_catalog.pg_backend_pid()";

/// `$1` this process's `application_name` → terminates every session of *other* instances of
/// this operator (a replica that was killed or lost its Lease), idle ones included: an idle
/// session may still have a statement waiting unread in its socket, which it would run later.
pub const TERMINATE_STALE_SESSIONS: &str = "SELECT pg_catalog.pg_terminate_backend(pid) \
     FROM pg_catalog.pg_stat_activity WHERE application_name LIKE 'database-operator %' \
     AND application_name <> $1 AND pid <> pg_catalog.pg_backend_pid()";
/// `$1` this process's `application_name` → how many sessions of other instances are left.
pub const COUNT_STALE_SESSIONS: &str = "SELECT count(*) FROM pg_catalog.pg_stat_activity \
     WHERE application_name LIKE 'database-operator %' AND application_name <> $1 \
     AND pid <> pg_catalog.pg_backend_pid()";

// ---------------------------------------------------------------------------------------
// Statements
// ---------------------------------------------------------------------------------------

/// `CREATE ROLE r WITH LOGIN PASSWORD '<SCRAM verifier>'`: the password itself never
/// reaches the server.
pub fn create_login_role(role: &str, scram_verifier: &str) -> String {
    format!(
        "CREATE ROLE {} WITH LOGIN PASSWORD {}",
        qi(role),
        quote_literal(scram_verifier)
    )
}

pub fn alter_role_login(role: &str) -> String {
    format!("ALTER ROLE {} WITH LOGIN", qi(role))
}

pub fn alter_role_password(role: &str, scram_verifier: &str) -> String {
    format!(
        "ALTER ROLE {} WITH PASSWORD {}",
        qi(role),
        quote_literal(scram_verifier)
    )
}

pub fn grant_role(role: &str, to: &str) -> String {
    format!("GRANT {} TO {}", qi(role), qi(to))
}

pub fn grant_role_to_current_user(role: &str) -> String {
    format!("GRANT {} TO CURRENT_USER", qi(role))
}

pub fn revoke_role(role: &str, from: &str) -> String {
    format!("REVOKE {} FROM {}", qi(role), qi(from))
}

pub fn create_database(db: &str, owner: &str) -> String {
    format!("CREATE DATABASE {} OWNER {}", qi(db), qi(owner))
}

pub fn alter_database_owner(db: &str, owner: &str) -> String {
    format!("ALTER DATABASE {} OWNER TO {}", qi(db), qi(owner))
}

pub fn revoke_public_connect(db: &str) -> String {
    format!(
        "REVOKE CONNECT, TEMPORARY ON DATABASE {} FROM PUBLIC",
        qi(db)
    )
}

pub fn grant_connect(db: &str, role: &str) -> String {
    format!("GRANT CONNECT ON DATABASE {} TO {}", qi(db), qi(role))
}

/// `DROP DATABASE IF EXISTS`, with `FORCE` (PostgreSQL 13+) so sessions that connect after
/// [`TERMINATE_CONNECTIONS`] cannot block it.
pub fn drop_database(db: &str, force: bool) -> String {
    if force {
        format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", qi(db))
    } else {
        format!("DROP DATABASE IF EXISTS {}", qi(db))
    }
}

/// `REASSIGN OWNED BY role TO to`; `to` is always a named role of the same tenant (never the
/// admin, `CURRENT_USER`).
pub fn reassign_owned(role: &str, to: &str) -> String {
    format!("REASSIGN OWNED BY {} TO {}", qi(role), qi(to))
}

/// `COMMENT ON ROLE r IS '<marker>'` (see [`crate::ownership`]).
pub fn comment_on_role(role: &str, marker: &str) -> String {
    format!("COMMENT ON ROLE {} IS {}", qi(role), quote_literal(marker))
}

/// `COMMENT ON DATABASE d IS '<marker>'` (see [`crate::ownership`]).
pub fn comment_on_database(db: &str, marker: &str) -> String {
    format!(
        "COMMENT ON DATABASE {} IS {}",
        qi(db),
        quote_literal(marker)
    )
}

pub fn drop_owned(role: &str) -> String {
    format!("DROP OWNED BY {}", qi(role))
}

pub fn drop_role(role: &str) -> String {
    format!("DROP ROLE IF EXISTS {}", qi(role))
}

pub fn create_schema(schema: &str, owner: &str) -> String {
    format!(
        "CREATE SCHEMA IF NOT EXISTS {} AUTHORIZATION {}",
        qi(schema),
        qi(owner)
    )
}

pub fn alter_schema_owner(schema: &str, owner: &str) -> String {
    format!("ALTER SCHEMA {} OWNER TO {}", qi(schema), qi(owner))
}

/// Without `CASCADE`: a schema that still holds objects is an error, not a silent loss.
pub fn drop_schema(schema: &str) -> String {
    format!("DROP SCHEMA IF EXISTS {}", qi(schema))
}

pub fn create_extension(extension: &str, schema: Option<&str>) -> String {
    match schema {
        Some(s) => format!(
            "CREATE EXTENSION IF NOT EXISTS {} WITH SCHEMA {}",
            qi(extension),
            qi(s)
        ),
        None => format!("CREATE EXTENSION IF NOT EXISTS {}", qi(extension)),
    }
}

/// Without `CASCADE`, like [`drop_schema`].
pub fn drop_extension(extension: &str) -> String {
    format!("DROP EXTENSION IF EXISTS {}", qi(extension))
}

// ---------------------------------------------------------------------------------------
// Plans
// ---------------------------------------------------------------------------------------

/// A login role as found in the catalog.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RoleState {
    pub superuser: bool,
    pub can_login: bool,
    /// `None`: the admin cannot read `pg_authid` (not a superuser); the password is then set
    /// on every reconcile. `Some(None)`: the role has no password.
    pub stored_password: Option<Option<String>>,
}

/// Why a plan cannot be made (the desired state is unsafe).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// The role exists and is a superuser: the operator never takes one over.
    #[error("role {0:?} exists and is a superuser; the operator refuses to manage it")]
    SuperuserRole(String),
    /// The blocking task that checks the stored verifier did not finish (shutdown).
    #[error("checking the stored password of role {0:?} was interrupted")]
    Interrupted(String),
}

/// [`plan_login_role`] on a blocking thread: checking the stored verifier costs PBKDF2 rounds
/// (up to [`password::MAX_ITERATIONS`]), which must not stall the async runtime and with it
/// the Lease renewals.
///
/// # Errors
/// As [`plan_login_role`]; [`PlanError::Interrupted`] when the task was cancelled.
pub async fn plan_login_role_off_runtime(
    role: &str,
    state: Option<&RoleState>,
    password: &Password,
) -> Result<Vec<String>, PlanError> {
    let (name, state, password) = (role.to_string(), state.cloned(), password.clone());
    match tokio::task::spawn_blocking(move || plan_login_role(&name, state.as_ref(), &password))
        .await
    {
        Ok(plan) => plan,
        Err(e) => match e.try_into_panic() {
            Ok(panic) => std::panic::resume_unwind(panic),
            Err(_) => Err(PlanError::Interrupted(role.to_string())),
        },
    }
}

/// Statements that make `role` a login role whose password is `password`.
///
/// # Errors
/// [`PlanError::SuperuserRole`] when `role` is a superuser.
pub fn plan_login_role(
    role: &str,
    state: Option<&RoleState>,
    password: &Password,
) -> Result<Vec<String>, PlanError> {
    let Some(state) = state else {
        return Ok(vec![create_login_role(role, &password.scram_verifier())]);
    };
    if state.superuser {
        return Err(PlanError::SuperuserRole(role.to_string()));
    }
    let mut out = Vec::new();
    if !state.can_login {
        out.push(alter_role_login(role));
    }
    let matches = match &state.stored_password {
        Some(Some(stored)) => password::verifies(stored, password),
        Some(None) | None => false,
    };
    if !matches {
        out.push(alter_role_password(role, &password.scram_verifier()));
    }
    Ok(out)
}

/// Server-level state of a database, read on the admin database.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DatabaseServerState {
    /// Owner of the database, `None` when it does not exist.
    pub owner: Option<String>,
    /// Whether PUBLIC may connect to it.
    pub public_connect: bool,
    /// Whether the admin is a superuser.
    pub admin_is_superuser: bool,
    /// Whether the admin already has the owner role's privileges.
    pub admin_has_owner_role: bool,
}

/// Statements (on the admin database) that create the database owned by `owner`, set its
/// owner back if it drifted, and keep PUBLIC from connecting. Run after the owner role exists.
pub fn plan_database_server(db: &str, owner: &str, state: &DatabaseServerState) -> Vec<String> {
    let mut out = Vec::new();
    if !state.admin_is_superuser && !state.admin_has_owner_role {
        // CREATE/ALTER DATABASE … OWNER and ALTER DEFAULT PRIVILEGES FOR ROLE need it.
        out.push(grant_role_to_current_user(owner));
    }
    match &state.owner {
        None => {
            out.push(create_database(db, owner));
            out.push(revoke_public_connect(db));
        }
        Some(current) => {
            if current != owner {
                out.push(alter_database_owner(db, owner));
            }
            if state.public_connect {
                out.push(revoke_public_connect(db));
            }
        }
    }
    out
}

/// State inside the database.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct InDatabaseState {
    /// Schema name → owner.
    pub schemas: BTreeMap<String, String>,
    pub extensions: BTreeSet<String>,
}

/// Statements (inside the database) for its schemas and extensions: schemas are created
/// first (an extension may go into one) and dropped last.
pub fn plan_in_database(
    owner: &str,
    schemas: &[SchemaSpec],
    extensions: &[ExtensionSpec],
    state: &InDatabaseState,
) -> Vec<String> {
    let mut out = Vec::new();
    for s in schemas.iter().filter(|s| s.ensure == Ensure::Present) {
        match state.schemas.get(&s.name) {
            None => out.push(create_schema(&s.name, owner)),
            Some(current) if current != owner => out.push(alter_schema_owner(&s.name, owner)),
            Some(_) => {}
        }
    }
    for e in extensions {
        let installed = state.extensions.contains(&e.name);
        match e.ensure {
            Ensure::Present if !installed => {
                out.push(create_extension(&e.name, e.schema.as_deref()))
            }
            Ensure::Absent if installed => out.push(drop_extension(&e.name)),
            _ => {}
        }
    }
    for s in schemas.iter().filter(|s| s.ensure == Ensure::Absent) {
        if state.schemas.contains_key(&s.name) {
            out.push(drop_schema(&s.name));
        }
    }
    out
}

/// What one privilege level grants on one kind of object: to hold on every object of that
/// kind in a schema (and by default on new ones), and to hold on none.
struct Level {
    tables: (&'static [&'static str], &'static [&'static str]),
    sequences: (&'static [&'static str], &'static [&'static str]),
}

const READ_WRITE: Level = Level {
    tables: (&["SELECT", "INSERT", "UPDATE", "DELETE"], &[]),
    sequences: (&["USAGE", "SELECT", "UPDATE"], &[]),
};
const READ_ONLY: Level = Level {
    tables: (&["SELECT"], &["INSERT", "UPDATE", "DELETE", "TRUNCATE"]),
    sequences: (&["USAGE", "SELECT"], &["UPDATE"]),
};

/// Statements (inside the database) granting `role` the `privileges` on database `db` owned
/// by `owner`, over the schemas of `held` (those that exist and are managed), revoking what
/// the other privilege levels would have granted so a change of level converges.
///
/// Only what `held` shows missing (or extra) is planned: a converged role plans nothing, so
/// resyncs change nothing on the server. A table created since is missing its grant and gets
/// the `… ON ALL TABLES IN SCHEMA` statement again.
pub fn plan_grants(
    db: &str,
    owner: &str,
    role: &str,
    privileges: Privileges,
    held: &HeldGrants,
    is_member_of_owner: bool,
) -> Vec<String> {
    let (r, o) = (qi(role), qi(owner));
    let mut out = Vec::new();
    if !held.connect {
        out.push(grant_connect(db, role));
    }
    let level = match privileges {
        Privileges::Owner => {
            if !is_member_of_owner {
                out.push(grant_role(owner, role));
            }
            return out;
        }
        Privileges::ReadWrite => READ_WRITE,
        Privileges::ReadOnly => READ_ONLY,
    };
    if is_member_of_owner {
        out.push(revoke_role(owner, role));
    }
    for (schema, h) in &held.schemas {
        let s = qi(schema);
        if !h.usage {
            out.push(format!("GRANT USAGE ON SCHEMA {s} TO {r}"));
        }
        let default =
            |what: String| format!("ALTER DEFAULT PRIVILEGES FOR ROLE {o} IN SCHEMA {s} {what}");
        let kinds = [
            ("TABLES", level.tables, &h.tables, &h.default_tables),
            (
                "SEQUENCES",
                level.sequences,
                &h.sequences,
                &h.default_sequences,
            ),
        ];
        for (kind, (want, forbid), objects, defaults) in kinds {
            let extra: Vec<&str> = forbid
                .iter()
                .copied()
                .filter(|p| objects.on_any(p))
                .collect();
            if !extra.is_empty() {
                out.push(format!(
                    "REVOKE {} ON ALL {kind} IN SCHEMA {s} FROM {r}",
                    forbid.join(", ")
                ));
            }
            if want.iter().any(|p| !objects.on_all(p)) {
                out.push(format!(
                    "GRANT {} ON ALL {kind} IN SCHEMA {s} TO {r}",
                    want.join(", ")
                ));
            }
            if forbid.iter().any(|p| defaults.contains(*p)) {
                out.push(default(format!(
                    "REVOKE {} ON {kind} FROM {r}",
                    forbid.join(", ")
                )));
            }
            if want.iter().any(|p| !defaults.contains(*p)) {
                out.push(default(format!(
                    "GRANT {} ON {kind} TO {r}",
                    want.join(", ")
                )));
            }
        }
    }
    out
}

/// What a role holds inside one database, granted to it by name (what PUBLIC holds does
/// not count: the Database may revoke it): read by `observe::grants`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HeldGrants {
    /// `CONNECT` on the database.
    pub connect: bool,
    /// Per managed schema that exists.
    pub schemas: BTreeMap<String, SchemaGrants>,
}

/// What a role holds in one schema.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SchemaGrants {
    /// `USAGE` on the schema.
    pub usage: bool,
    /// Its tables (views, materialized views, foreign and partitioned tables included: what
    /// `ALL TABLES IN SCHEMA` covers).
    pub tables: Held,
    pub sequences: Held,
    /// What the owner's default privileges in the schema give the role on new tables.
    pub default_tables: BTreeSet<String>,
    pub default_sequences: BTreeSet<String>,
}

/// Privileges held over the objects of one kind in a schema.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Held {
    /// How many objects there are.
    pub objects: i64,
    /// Privilege → on how many of them the role holds it.
    pub holding: BTreeMap<String, i64>,
}

impl Held {
    fn count(&self, privilege: &str) -> i64 {
        self.holding.get(privilege).copied().unwrap_or(0)
    }
    /// Whether the role holds `privilege` on every object (true when there are none).
    pub fn on_all(&self, privilege: &str) -> bool {
        self.count(privilege) >= self.objects
    }
    /// Whether the role holds `privilege` on at least one object.
    pub fn on_any(&self, privilege: &str) -> bool {
        self.count(privilege) > 0
    }
}

/// How a Database is dropped: statements on the admin database after
/// [`TERMINATE_CONNECTIONS`]. The owner role is kept (and the reason returned) while it
/// still owns other databases: `REASSIGN OWNED` would otherwise hand those to the admin.
pub fn plan_drop_database(
    db: &str,
    owner: &str,
    server_major: i32,
    other_owned_databases: &[String],
) -> (Vec<String>, Option<String>) {
    let mut out = vec![drop_database(db, server_major >= 13)];
    if other_owned_databases.is_empty() {
        // What the role still owns here (say a SECURITY DEFINER function it planted in the
        // admin database) is dropped, never reassigned to the admin: that would hand it the
        // admin's privileges.
        out.push(drop_owned(owner));
        out.push(drop_role(owner));
        (out, None)
    } else {
        let why = format!(
            "role {owner:?} was kept: it still owns the databases {}",
            other_owned_databases.join(", ")
        );
        (out, Some(why))
    }
}

/// How a DatabaseRole is dropped: statements inside its database (objects go to the
/// database's owner, privileges are revoked), then on the admin database.
pub fn plan_drop_role(
    role: &str,
    owner: &str,
    database_exists: bool,
) -> (Vec<String>, Vec<String>) {
    let inside = if database_exists {
        vec![reassign_owned(role, owner), drop_owned(role)]
    } else {
        Vec::new()
    };
    (inside, vec![drop_role(role)])
}

#[cfg(test)]
mod tests {
    use super::*;

    const EVIL: &str = "x\"; DROP DATABASE postgres; --";

    fn pw() -> Password {
        Password::from_existing("pw".into())
    }

    #[test]
    fn identifiers_are_quoted_everywhere() {
        let statements = [
            create_login_role(EVIL, "v"),
            create_database(EVIL, EVIL),
            alter_database_owner(EVIL, EVIL),
            drop_database(EVIL, true),
            create_schema(EVIL, EVIL),
            create_extension(EVIL, Some(EVIL)),
            drop_role(EVIL),
            reassign_owned(EVIL, EVIL),
        ];
        for s in statements {
            // The only double quotes are the doubled one inside the name and the delimiters.
            assert!(s.contains("\"x\"\"; DROP DATABASE postgres; --\""), "{s}");
            assert_eq!(
                s.matches("\"x\"\";").count(),
                s.matches("\"x").count(),
                "{s}"
            );
        }
        assert_eq!(
            create_database(EVIL, "o"),
            "CREATE DATABASE \"x\"\"; DROP DATABASE postgres; --\" OWNER \"o\""
        );
    }

    #[test]
    fn role_passwords_are_scram_verifiers_never_plaintext() {
        let p = Password::from_existing("plain-text-secret".into());
        let plan = plan_login_role("app", None, &p).unwrap();
        assert_eq!(plan.len(), 1);
        assert!(
            plan[0].starts_with("CREATE ROLE \"app\" WITH LOGIN PASSWORD 'SCRAM-SHA-256$4096:"),
            "{}",
            plan[0]
        );
        assert!(!plan[0].contains("plain-text-secret"));
    }

    #[test]
    fn role_plan_converges_login_and_password() {
        let p = pw();
        let good = RoleState {
            superuser: false,
            can_login: true,
            stored_password: Some(Some(p.scram_verifier())),
        };
        assert!(
            plan_login_role("app", Some(&good), &p).unwrap().is_empty(),
            "converged role needs nothing"
        );

        let drifted = RoleState {
            superuser: false,
            can_login: false,
            stored_password: Some(Some("md5x".into())),
        };
        let plan = plan_login_role("app", Some(&drifted), &p).unwrap();
        assert_eq!(plan[0], "ALTER ROLE \"app\" WITH LOGIN");
        assert!(plan[1].starts_with("ALTER ROLE \"app\" WITH PASSWORD 'SCRAM-SHA-256$"));

        let unreadable = RoleState {
            superuser: false,
            can_login: true,
            stored_password: None,
        };
        assert_eq!(
            plan_login_role("app", Some(&unreadable), &p).unwrap().len(),
            1,
            "unknown password is set"
        );

        let sup = RoleState {
            superuser: true,
            can_login: true,
            stored_password: None,
        };
        assert_eq!(
            plan_login_role("app", Some(&sup), &p),
            Err(PlanError::SuperuserRole("app".into()))
        );
    }

    #[test]
    fn database_plan_creates_and_fixes_owner_drift() {
        let fresh = DatabaseServerState {
            owner: None,
            public_connect: false,
            admin_is_superuser: true,
            admin_has_owner_role: true,
        };
        assert_eq!(
            plan_database_server("app", "app_owner", &fresh),
            vec![
                "CREATE DATABASE \"app\" OWNER \"app_owner\"".to_string(),
                "REVOKE CONNECT, TEMPORARY ON DATABASE \"app\" FROM PUBLIC".to_string()
            ]
        );
        let drift = DatabaseServerState {
            owner: Some("mallory".into()),
            ..fresh.clone()
        };
        assert_eq!(
            plan_database_server("app", "app_owner", &drift),
            vec!["ALTER DATABASE \"app\" OWNER TO \"app_owner\"".to_string()]
        );
        let ok = DatabaseServerState {
            owner: Some("app_owner".into()),
            ..fresh.clone()
        };
        assert!(plan_database_server("app", "app_owner", &ok).is_empty());
        let not_super = DatabaseServerState {
            admin_is_superuser: false,
            admin_has_owner_role: false,
            ..ok
        };
        assert_eq!(
            plan_database_server("app", "app_owner", &not_super),
            vec!["GRANT \"app_owner\" TO CURRENT_USER".to_string()]
        );
    }

    #[test]
    fn in_database_plan_orders_schemas_and_extensions() {
        let schemas = vec![
            SchemaSpec {
                name: "ext".into(),
                ensure: Ensure::Present,
            },
            SchemaSpec {
                name: "old".into(),
                ensure: Ensure::Absent,
            },
            SchemaSpec {
                name: "reports".into(),
                ensure: Ensure::Present,
            },
        ];
        let extensions = vec![
            ExtensionSpec {
                name: "uuid-ossp".into(),
                ensure: Ensure::Present,
                schema: Some("ext".into()),
            },
            ExtensionSpec {
                name: "pgcrypto".into(),
                ensure: Ensure::Present,
                schema: None,
            },
            ExtensionSpec {
                name: "hstore".into(),
                ensure: Ensure::Absent,
                schema: None,
            },
        ];
        let state = InDatabaseState {
            schemas: [
                ("old".to_string(), "o".to_string()),
                ("reports".to_string(), "someone".to_string()),
            ]
            .into(),
            extensions: ["hstore".to_string(), "pgcrypto".to_string()].into(),
        };
        assert_eq!(
            plan_in_database("o", &schemas, &extensions, &state),
            vec![
                "CREATE SCHEMA IF NOT EXISTS \"ext\" AUTHORIZATION \"o\"",
                "ALTER SCHEMA \"reports\" OWNER TO \"o\"",
                "CREATE EXTENSION IF NOT EXISTS \"uuid-ossp\" WITH SCHEMA \"ext\"",
                "DROP EXTENSION IF EXISTS \"hstore\"",
                "DROP SCHEMA IF EXISTS \"old\"",
            ]
        );
        let converged = InDatabaseState {
            schemas: [
                ("ext".to_string(), "o".to_string()),
                ("reports".to_string(), "o".to_string()),
            ]
            .into(),
            extensions: ["uuid-ossp".to_string(), "pgcrypto".to_string()].into(),
        };
        assert!(plan_in_database("o", &schemas, &extensions, &converged).is_empty());
    }

    fn held(objects: i64, privileges: &[&str]) -> Held {
        Held {
            objects,
            holding: privileges
                .iter()
                .map(|p| (p.to_string(), objects))
                .collect(),
        }
    }

    fn set(privileges: &[&str]) -> BTreeSet<String> {
        privileges.iter().map(|p| p.to_string()).collect()
    }

    /// Nothing held yet: one schema with a table and a sequence.
    fn nothing() -> HeldGrants {
        HeldGrants {
            connect: false,
            schemas: [(
                "public".to_string(),
                SchemaGrants {
                    tables: held(1, &[]),
                    sequences: held(1, &[]),
                    ..Default::default()
                },
            )]
            .into(),
        }
    }

    #[test]
    fn grants_per_privilege_level() {
        let owner = plan_grants("app", "o", "r", Privileges::Owner, &nothing(), false);
        assert_eq!(
            owner,
            vec![
                "GRANT CONNECT ON DATABASE \"app\" TO \"r\"",
                "GRANT \"o\" TO \"r\""
            ]
        );
        assert_eq!(
            plan_grants("app", "o", "r", Privileges::Owner, &nothing(), true).len(),
            1
        );

        let rw = plan_grants("app", "o", "r", Privileges::ReadWrite, &nothing(), false);
        assert_eq!(
            rw,
            vec![
                "GRANT CONNECT ON DATABASE \"app\" TO \"r\"",
                "GRANT USAGE ON SCHEMA \"public\" TO \"r\"",
                "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA \"public\" TO \"r\"",
                "ALTER DEFAULT PRIVILEGES FOR ROLE \"o\" IN SCHEMA \"public\" GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO \"r\"",
                "GRANT USAGE, SELECT, UPDATE ON ALL SEQUENCES IN SCHEMA \"public\" TO \"r\"",
                "ALTER DEFAULT PRIVILEGES FOR ROLE \"o\" IN SCHEMA \"public\" GRANT USAGE, SELECT, UPDATE ON SEQUENCES TO \"r\"",
            ]
        );

        // Demoted from owner to read-only, with write privileges left from read-write.
        let mut was_rw = nothing();
        let s = was_rw.schemas.get_mut("public").unwrap();
        s.tables = held(1, &["SELECT", "INSERT", "UPDATE", "DELETE"]);
        s.default_tables = set(&["SELECT", "INSERT"]);
        let ro = plan_grants("app", "o", "r", Privileges::ReadOnly, &was_rw, true).join(";\n");
        assert!(
            ro.contains("REVOKE \"o\" FROM \"r\""),
            "demoted from owner: membership revoked"
        );
        assert!(ro.contains(
            "REVOKE INSERT, UPDATE, DELETE, TRUNCATE ON ALL TABLES IN SCHEMA \"public\" FROM \"r\""
        ));
        assert!(
            !ro.contains("GRANT SELECT ON ALL TABLES"),
            "SELECT is held: {ro}"
        );
        assert!(ro.contains(
            "IN SCHEMA \"public\" REVOKE INSERT, UPDATE, DELETE, TRUNCATE ON TABLES FROM \"r\""
        ));
        assert!(ro.contains("GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA \"public\" TO \"r\""));
        assert!(!ro.contains("GRANT SELECT, INSERT"));
    }

    /// A converged role plans nothing (so resyncs change nothing on the server); one table
    /// created since brings back the one statement that covers it.
    #[test]
    fn converged_grants_plan_nothing() {
        let converged = |privileges: Privileges| {
            let (tables, sequences) = match privileges {
                Privileges::ReadWrite => (READ_WRITE.tables.0, READ_WRITE.sequences.0),
                _ => (READ_ONLY.tables.0, READ_ONLY.sequences.0),
            };
            HeldGrants {
                connect: true,
                schemas: ["public", "sales"]
                    .map(|s| {
                        let g = SchemaGrants {
                            usage: true,
                            tables: held(3, tables),
                            sequences: held(2, sequences),
                            default_tables: set(tables),
                            default_sequences: set(sequences),
                        };
                        (s.to_string(), g)
                    })
                    .into(),
            }
        };
        for privileges in [Privileges::ReadWrite, Privileges::ReadOnly] {
            let mut held = converged(privileges);
            assert_eq!(
                plan_grants("app", "o", "r", privileges, &held, false),
                Vec::<String>::new()
            );
            held.schemas.get_mut("sales").unwrap().tables.objects += 1;
            let plan = plan_grants("app", "o", "r", privileges, &held, false);
            assert_eq!(plan.len(), 1, "{plan:?}");
            assert!(plan[0].contains("ON ALL TABLES IN SCHEMA \"sales\""));
        }
        let empty = HeldGrants {
            connect: true,
            schemas: BTreeMap::new(),
        };
        assert!(plan_grants("app", "o", "r", Privileges::Owner, &empty, true).is_empty());
        // No objects at all: nothing to grant on them, only the defaults.
        let mut bare = converged(Privileges::ReadWrite);
        for s in bare.schemas.values_mut() {
            s.tables = Held::default();
            s.sequences = Held::default();
        }
        assert!(plan_grants("app", "o", "r", Privileges::ReadWrite, &bare, false).is_empty());
    }

    #[test]
    fn drop_plans() {
        let (plan, kept) = plan_drop_database("app", "o", 15, &[]);
        assert_eq!(
            plan,
            vec![
                "DROP DATABASE IF EXISTS \"app\" WITH (FORCE)",
                "DROP OWNED BY \"o\"",
                "DROP ROLE IF EXISTS \"o\"",
            ]
        );
        assert!(kept.is_none());
        let (plan, kept) = plan_drop_database("app", "o", 12, &["other".to_string()]);
        assert_eq!(plan, vec!["DROP DATABASE IF EXISTS \"app\""]);
        assert!(kept.unwrap().contains("other"));

        let (inside, admin) = plan_drop_role("r", "o", true);
        assert_eq!(
            inside,
            vec!["REASSIGN OWNED BY \"r\" TO \"o\"", "DROP OWNED BY \"r\""]
        );
        assert_eq!(admin, vec!["DROP ROLE IF EXISTS \"r\""]);
        assert!(plan_drop_role("r", "o", false).0.is_empty());
    }
}
