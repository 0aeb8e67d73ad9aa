//! Reading the catalog into the state structs the [`crate::sql`] plans take (bind parameters
//! only).

use tokio_postgres::Client;

use crate::ownership::Observed;
use crate::pg::PgError;
use crate::sql::{self, DatabaseServerState, HeldGrants, InDatabaseState, RoleState};

fn stmt_err(what: &str) -> impl FnOnce(tokio_postgres::Error) -> PgError + '_ {
    move |source| PgError::Statement {
        what: what.to_string(),
        source,
    }
}

/// The session user's superuser flag and the server's major version.
///
/// # Errors
/// [`PgError::Statement`].
pub async fn session(client: &Client) -> Result<(bool, i32), PgError> {
    let row = client
        .query_one(sql::QUERY_SESSION, &[])
        .await
        .map_err(stmt_err("read the session user"))?;
    Ok((row.get(0), row.get(1)))
}

/// The role `name`, `None` if it does not exist.
///
/// # Errors
/// [`PgError::Statement`].
pub async fn role(client: &Client, name: &str) -> Result<Option<RoleState>, PgError> {
    let Some(row) = client
        .query_opt(sql::QUERY_ROLE, &[&name])
        .await
        .map_err(stmt_err("read pg_roles"))?
    else {
        return Ok(None);
    };
    let stored_password = match client.query_opt(sql::QUERY_ROLE_PASSWORD, &[&name]).await {
        Ok(Some(row)) => Some(row.get::<_, Option<String>>(0)),
        Ok(None) => Some(None),
        // 42501 insufficient_privilege: not a superuser; the password is then always set.
        Err(e) if e.code().is_some_and(|c| c.code() == "42501") => None,
        Err(e) => return Err(stmt_err("read pg_authid")(e)),
    };
    Ok(Some(RoleState {
        superuser: row.get(0),
        can_login: row.get(1),
        stored_password,
    }))
}

/// Whether the session user has `role`'s privileges.
///
/// # Errors
/// [`PgError::Statement`].
pub async fn has_role(client: &Client, role: &str) -> Result<bool, PgError> {
    let row = client
        .query_one(sql::QUERY_IS_MEMBER, &[&role])
        .await
        .map_err(stmt_err("check role membership"))?;
    Ok(row.get(0))
}

/// Whether `member` is a direct member of `group`.
///
/// # Errors
/// [`PgError::Statement`].
pub async fn is_direct_member(client: &Client, member: &str, group: &str) -> Result<bool, PgError> {
    let row = client
        .query_one(sql::QUERY_DIRECT_MEMBER, &[&member, &group])
        .await
        .map_err(stmt_err("check role membership"))?;
    Ok(row.get(0))
}

/// The owner of database `db`, `None` if it does not exist.
///
/// # Errors
/// [`PgError::Statement`].
pub async fn database_owner(client: &Client, db: &str) -> Result<Option<String>, PgError> {
    Ok(client
        .query_opt(sql::QUERY_DATABASE_OWNER, &[&db])
        .await
        .map_err(stmt_err("read pg_database"))?
        .map(|r| r.get(0)))
}

/// Server-level state of database `db` owned (desirably) by `owner`.
///
/// # Errors
/// [`PgError::Statement`].
pub async fn database_server(
    client: &Client,
    db: &str,
    owner: &str,
    admin_is_superuser: bool,
) -> Result<DatabaseServerState, PgError> {
    let current_owner = database_owner(client, db).await?;
    let public_connect = match current_owner {
        Some(_) => client
            .query_one(sql::QUERY_PUBLIC_CONNECT, &[&db])
            .await
            .map_err(stmt_err("read the database ACL"))?
            .get(0),
        None => false,
    };
    let admin_has_owner_role = admin_is_superuser || has_role(client, owner).await?;
    Ok(DatabaseServerState {
        owner: current_owner,
        public_connect,
        admin_is_superuser,
        admin_has_owner_role,
    })
}

/// Schemas and extensions of the database `client` is connected to.
///
/// # Errors
/// [`PgError::Statement`].
pub async fn in_database(client: &Client) -> Result<InDatabaseState, PgError> {
    let schemas = client
        .query(sql::QUERY_SCHEMAS, &[])
        .await
        .map_err(stmt_err("read pg_namespace"))?;
    let extensions = client
        .query(sql::QUERY_EXTENSIONS, &[])
        .await
        .map_err(stmt_err("read pg_extension"))?;
    Ok(InDatabaseState {
        schemas: schemas
            .iter()
            .map(|r| (r.get::<_, String>(0), r.get::<_, String>(1)))
            .collect(),
        extensions: extensions.iter().map(|r| r.get::<_, String>(0)).collect(),
    })
}

/// What `role` holds, by name, inside the database `client` is connected to (`db`): CONNECT,
/// and per schema of `schemas` that exists its USAGE, its privileges on the schema's tables
/// and sequences, and the defaults `owner` gives it there.
///
/// # Errors
/// [`PgError::Statement`].
pub async fn grants(
    client: &Client,
    db: &str,
    role: &str,
    owner: &str,
    schemas: &[String],
) -> Result<HeldGrants, PgError> {
    let connect = client
        .query_one(sql::QUERY_ROLE_CONNECT, &[&role, &db])
        .await
        .map_err(stmt_err("read the database ACL"))?
        .get(0);
    let mut held = HeldGrants {
        connect,
        schemas: Default::default(),
    };
    for row in client
        .query(sql::QUERY_SCHEMA_GRANTS, &[&role, &owner, &schemas])
        .await
        .map_err(stmt_err("read the schema ACLs"))?
    {
        let s = held.schemas.entry(row.get(0)).or_default();
        s.usage = row.get(1);
        s.default_tables = row.get::<_, Vec<String>>(2).into_iter().collect();
        s.default_sequences = row.get::<_, Vec<String>>(3).into_iter().collect();
    }
    for row in client
        .query(sql::QUERY_OBJECT_GRANTS, &[&role, &schemas])
        .await
        .map_err(stmt_err("read the table and sequence ACLs"))?
    {
        let Some(s) = held.schemas.get_mut(&row.get::<_, String>(0)) else {
            continue;
        };
        let objects = if row.get(1) {
            &mut s.sequences
        } else {
            &mut s.tables
        };
        objects.objects = row.get(3);
        objects.holding.insert(row.get(2), row.get(4));
    }
    Ok(held)
}

/// The databases `role` owns.
///
/// # Errors
/// [`PgError::Statement`].
pub async fn owned_databases(client: &Client, role: &str) -> Result<Vec<String>, PgError> {
    let rows = client
        .query(sql::QUERY_OWNED_DATABASES, &[&role])
        .await
        .map_err(stmt_err("read pg_database"))?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// Terminates every other session on database `db`; returns how many.
///
/// # Errors
/// [`PgError::Statement`].
pub async fn terminate_connections(client: &Client, db: &str) -> Result<usize, PgError> {
    Ok(client
        .query(sql::TERMINATE_CONNECTIONS, &[&db])
        .await
        .map_err(stmt_err("terminate the database's connections"))?
        .len())
}

/// Ends what other instances of this operator may still have in flight before a cleanup
/// decides from the catalog: a SIGKILLed replica's last statement keeps running on the server
/// and can commit *after* a new replica saw nothing to drop (a role created after its cleanup
/// finished would leak), and a statement still unread in an idle session's socket can start
/// after any check. Terminates all those sessions and waits (up to [`STALE_SESSIONS_WAIT`])
/// until they are gone, so whatever they did is either visible or never happens.
///
/// # Errors
/// [`PgError::Statement`], or [`PgError::StaleSessions`] when some are still there after the
/// wait (the cleanup must not decide from the catalog yet).
pub async fn end_stale_sessions(client: &Client, application_name: &str) -> Result<(), PgError> {
    client
        .query(sql::TERMINATE_STALE_SESSIONS, &[&application_name])
        .await
        .map_err(stmt_err("terminate other instances' sessions"))?;
    let started = std::time::Instant::now();
    loop {
        let left: i64 = client
            .query_one(sql::COUNT_STALE_SESSIONS, &[&application_name])
            .await
            .map_err(stmt_err("count other instances' sessions"))?
            .get(0);
        if left == 0 {
            return Ok(());
        }
        if started.elapsed() >= STALE_SESSIONS_WAIT {
            return Err(PgError::StaleSessions {
                left,
                after: STALE_SESSIONS_WAIT,
            });
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// How long [`end_stale_sessions`] waits for terminated sessions to end.
pub const STALE_SESSIONS_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// What the catalog shows about the ownership of role `name` (see [`crate::ownership`]).
///
/// # Errors
/// [`PgError::Statement`].
pub async fn role_ownership(client: &Client, name: &str) -> Result<Observed, PgError> {
    let row = client
        .query_opt(sql::QUERY_ROLE_OWNERSHIP, &[&name])
        .await
        .map_err(stmt_err("read the role's owner marker"))?;
    Ok(row.map_or_else(Observed::default, |row| Observed {
        exists: true,
        comment: row.get(0),
        privileged: row.get(1),
        owner_marked_for_me: false,
    }))
}

/// What the catalog shows about the ownership of database `name` (see [`crate::ownership`]).
///
/// # Errors
/// [`PgError::Statement`].
pub async fn database_ownership(client: &Client, name: &str) -> Result<Observed, PgError> {
    let row = client
        .query_opt(sql::QUERY_DATABASE_OWNERSHIP, &[&name])
        .await
        .map_err(stmt_err("read the database's owner marker"))?;
    Ok(row.map_or_else(Observed::default, |row| Observed {
        exists: true,
        comment: row.get(0),
        ..Observed::default()
    }))
}
