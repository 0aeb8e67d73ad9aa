//! SQL, built by pure functions: catalog queries (every value a bind parameter) and the
//! statements that converge a server to the desired state (every identifier through
//! [`quote_ident`], every literal through [`quote_literal`], since PostgreSQL's utility
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

/// Statements (inside the database) granting `role` the `privileges` on database `db` owned
/// by `owner`, over `schemas` (those that exist), revoking what the other privilege levels
/// would have granted so a change of level converges.
pub fn plan_grants(
    db: &str,
    owner: &str,
    role: &str,
    privileges: Privileges,
    schemas: &[String],
    is_member_of_owner: bool,
) -> Vec<String> {
    let (r, o) = (qi(role), qi(owner));
    let mut out = vec![grant_connect(db, role)];
    match privileges {
        Privileges::Owner => {
            if !is_member_of_owner {
                out.push(grant_role(owner, role));
            }
            return out;
        }
        Privileges::ReadWrite | Privileges::ReadOnly if is_member_of_owner => {
            out.push(revoke_role(owner, role))
        }
        _ => {}
    }
    for schema in schemas {
        let s = qi(schema);
        out.push(format!("GRANT USAGE ON SCHEMA {s} TO {r}"));
        let default =
            |what: &str| format!("ALTER DEFAULT PRIVILEGES FOR ROLE {o} IN SCHEMA {s} {what}");
        match privileges {
            Privileges::ReadWrite => {
                out.push(format!(
                    "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {s} TO {r}"
                ));
                out.push(format!(
                    "GRANT USAGE, SELECT, UPDATE ON ALL SEQUENCES IN SCHEMA {s} TO {r}"
                ));
                out.push(default(&format!(
                    "GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO {r}"
                )));
                out.push(default(&format!(
                    "GRANT USAGE, SELECT, UPDATE ON SEQUENCES TO {r}"
                )));
            }
            Privileges::ReadOnly => {
                out.push(format!(
                    "REVOKE INSERT, UPDATE, DELETE, TRUNCATE ON ALL TABLES IN SCHEMA {s} FROM {r}"
                ));
                out.push(format!("GRANT SELECT ON ALL TABLES IN SCHEMA {s} TO {r}"));
                out.push(format!(
                    "REVOKE UPDATE ON ALL SEQUENCES IN SCHEMA {s} FROM {r}"
                ));
                out.push(format!(
                    "GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA {s} TO {r}"
                ));
                out.push(default(&format!(
                    "REVOKE INSERT, UPDATE, DELETE, TRUNCATE ON TABLES FROM {r}"
                )));
                out.push(default(&format!("GRANT SELECT ON TABLES TO {r}")));
                out.push(default(&format!("REVOKE UPDATE ON SEQUENCES FROM {r}")));
                out.push(default(&format!("GRANT USAGE, SELECT ON SEQUENCES TO {r}")));
            }
            Privileges::Owner => {}
        }
    }
    out
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

    #[test]
    fn grants_per_privilege_level() {
        let schemas = vec!["public".to_string()];
        let owner = plan_grants("app", "o", "r", Privileges::Owner, &schemas, false);
        assert_eq!(
            owner,
            vec![
                "GRANT CONNECT ON DATABASE \"app\" TO \"r\"",
                "GRANT \"o\" TO \"r\""
            ]
        );
        assert_eq!(
            plan_grants("app", "o", "r", Privileges::Owner, &schemas, true).len(),
            1
        );

        let rw = plan_grants("app", "o", "r", Privileges::ReadWrite, &schemas, false).join(";\n");
        assert!(rw.contains(
            "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA \"public\" TO \"r\""
        ));
        assert!(rw.contains("ALTER DEFAULT PRIVILEGES FOR ROLE \"o\" IN SCHEMA \"public\" GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO \"r\""));
        assert!(!rw.contains("REVOKE"));

        let ro = plan_grants("app", "o", "r", Privileges::ReadOnly, &schemas, true).join(";\n");
        assert!(
            ro.contains("REVOKE \"o\" FROM \"r\""),
            "demoted from owner: membership revoked"
        );
        assert!(ro.contains(
            "REVOKE INSERT, UPDATE, DELETE, TRUNCATE ON ALL TABLES IN SCHEMA \"public\" FROM \"r\""
        ));
        assert!(ro.contains("GRANT SELECT ON ALL TABLES IN SCHEMA \"public\" TO \"r\""));
        assert!(!ro.contains("GRANT SELECT, INSERT"));
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
