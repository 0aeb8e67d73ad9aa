//! PgBouncer's admin console: the database `pgbouncer` on its Unix socket, as
//! [`ADMIN_USER`] (SCRAM against the plain-text password in the auth file). The console
//! speaks only the simple query protocol, so everything here is `simple_query`, and its
//! answers are text: [`Table`] keeps them by column name, as PgBouncer versions add columns.
//!
//! [`ADMIN_USER`]: crate::config::ADMIN_USER

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio_postgres::{NoTls, SimpleQueryMessage};

use crate::config::{ADMIN_DBNAME, ADMIN_USER};

/// How long connecting to the console may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// A failure talking to the admin console.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The console refused or did not answer the login.
    #[error("failed to log into PgBouncer's admin console")]
    Connect(#[source] tokio_postgres::Error),
    /// A command failed (PgBouncer's message), or the connection broke.
    #[error("failed to run {command} on PgBouncer's admin console")]
    Command {
        command: String,
        #[source]
        source: tokio_postgres::Error,
    },
    /// The command did not answer in time.
    #[error("{command} on PgBouncer's admin console did not finish within {after:?}")]
    Timeout { command: String, after: Duration },
    /// An answer lacks a column every supported PgBouncer has.
    #[error("failed to read {command}: no column {column}")]
    MissingColumn {
        command: &'static str,
        column: &'static str,
    },
    /// A numeric column holds something else.
    #[error("failed to read {command}: column {column} is {value:?}, not a number")]
    NotANumber {
        command: &'static str,
        column: String,
        value: String,
    },
}

impl Error {
    /// PgBouncer's own error message, if the console answered with one.
    pub fn message(&self) -> Option<&str> {
        match self {
            Error::Command { source, .. } | Error::Connect(source) => {
                source.as_db_error().map(|e| e.message())
            }
            _ => None,
        }
    }
}

/// Where and as whom to log into the console.
#[derive(Clone)]
pub struct Login {
    pub socket_dir: PathBuf,
    pub port: u16,
    pub password: String,
}

impl std::fmt::Debug for Login {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Login")
            .field("socket_dir", &self.socket_dir)
            .field("port", &self.port)
            .finish_non_exhaustive()
    }
}

/// One session on the admin console.
pub struct Console {
    client: tokio_postgres::Client,
    connection: JoinHandle<()>,
}

impl Drop for Console {
    fn drop(&mut self) {
        self.connection.abort();
    }
}

impl Console {
    /// Logs in.
    ///
    /// # Errors
    /// [`Error::Connect`] when PgBouncer does not answer on its socket (not started yet) or
    /// refuses the login.
    pub async fn connect(login: &Login) -> Result<Self, Error> {
        let (client, connection) = tokio_postgres::Config::new()
            .host_path(&login.socket_dir)
            .port(login.port)
            .user(ADMIN_USER)
            .password(&login.password)
            .dbname(ADMIN_DBNAME)
            .connect_timeout(CONNECT_TIMEOUT)
            .connect(NoTls)
            .await
            .map_err(Error::Connect)?;
        let connection = tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "admin console session ended");
            }
        });
        Ok(Console { client, connection })
    }

    /// Whether the session broke (a new one is needed).
    pub fn is_closed(&self) -> bool {
        self.client.is_closed()
    }

    /// Runs a command (`PAUSE`, `RESUME`, `RELOAD`) within `bound`.
    ///
    /// # Errors
    /// [`Error::Command`] with PgBouncer's message, [`Error::Timeout`]. After a timeout the
    /// session still waits for the answer: drop it.
    pub async fn command(&self, command: &str, bound: Duration) -> Result<(), Error> {
        self.query(command, bound).await.map(drop)
    }

    /// Runs a `SHOW` command within `bound`.
    ///
    /// # Errors
    /// As [`Console::command`].
    pub async fn show(&self, command: &str, bound: Duration) -> Result<Table, Error> {
        self.query(command, bound).await.map(Table::from_messages)
    }

    async fn query(
        &self,
        command: &str,
        bound: Duration,
    ) -> Result<Vec<SimpleQueryMessage>, Error> {
        match tokio::time::timeout(bound, self.client.simple_query(command)).await {
            Ok(Ok(messages)) => Ok(messages),
            Ok(Err(source)) => Err(Error::Command {
                command: command.to_string(),
                source,
            }),
            Err(_) => Err(Error::Timeout {
                command: command.to_string(),
                after: bound,
            }),
        }
    }
}

/// A console answer: column names and text values.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Table {
    pub columns: Vec<String>,
    pub rows: Vec<Vec<Option<String>>>,
}

impl Table {
    /// The rows of a simple query's answer (the first result's columns).
    pub fn from_messages(messages: Vec<SimpleQueryMessage>) -> Self {
        let mut table = Table::default();
        for message in messages {
            match message {
                SimpleQueryMessage::RowDescription(columns) if table.columns.is_empty() => {
                    table.columns = columns.iter().map(|c| c.name().to_string()).collect();
                }
                SimpleQueryMessage::Row(row) => {
                    if table.columns.is_empty() {
                        table.columns =
                            row.columns().iter().map(|c| c.name().to_string()).collect();
                    }
                    table.rows.push(
                        (0..row.len())
                            .map(|i| row.get(i).map(String::from))
                            .collect(),
                    );
                }
                _ => {}
            }
        }
        table
    }

    /// A table from literal rows (tests, fixtures).
    pub fn new(columns: &[&str], rows: &[&[&str]]) -> Self {
        Table {
            columns: columns.iter().map(|c| c.to_string()).collect(),
            rows: rows
                .iter()
                .map(|r| r.iter().map(|v| Some(v.to_string())).collect())
                .collect(),
        }
    }

    fn index(&self, command: &'static str, column: &'static str) -> Result<usize, Error> {
        self.columns
            .iter()
            .position(|c| c == column)
            .ok_or(Error::MissingColumn { command, column })
    }

    /// Each row as column name → value.
    fn records(&self) -> impl Iterator<Item = BTreeMap<&str, &str>> {
        self.rows.iter().map(|row| {
            self.columns
                .iter()
                .zip(row)
                .filter_map(|(c, v)| Some((c.as_str(), v.as_deref()?)))
                .collect()
        })
    }
}

fn number(
    command: &'static str,
    record: &BTreeMap<&str, &str>,
    column: &str,
) -> Result<f64, Error> {
    let Some(value) = record.get(column) else {
        return Ok(0.0);
    };
    value.trim().parse().map_err(|_| Error::NotANumber {
        command,
        column: column.to_string(),
        value: value.to_string(),
    })
}

/// One row of `SHOW POOLS`: a (database, user) pair's clients and server connections.
#[derive(Clone, Debug, PartialEq)]
pub struct Pool {
    pub database: String,
    pub user: String,
    pub cl_active: f64,
    pub cl_waiting: f64,
    pub sv_active: f64,
    pub sv_idle: f64,
    pub sv_used: f64,
    /// How long the oldest waiting client has waited, in seconds (`maxwait` + `maxwait_us`).
    pub max_wait_seconds: f64,
}

/// The rows of `SHOW POOLS`.
///
/// # Errors
/// [`Error::MissingColumn`] without `database` or `user`, [`Error::NotANumber`]. A missing
/// numeric column reads as 0.
pub fn pools(table: &Table) -> Result<Vec<Pool>, Error> {
    const SHOW: &str = "SHOW POOLS";
    table.index(SHOW, "database")?;
    table.index(SHOW, "user")?;
    table
        .records()
        .map(|r| {
            Ok(Pool {
                database: r.get("database").copied().unwrap_or_default().to_string(),
                user: r.get("user").copied().unwrap_or_default().to_string(),
                cl_active: number(SHOW, &r, "cl_active")?,
                cl_waiting: number(SHOW, &r, "cl_waiting")?,
                sv_active: number(SHOW, &r, "sv_active")?,
                sv_idle: number(SHOW, &r, "sv_idle")?,
                sv_used: number(SHOW, &r, "sv_used")?,
                max_wait_seconds: number(SHOW, &r, "maxwait")?
                    + number(SHOW, &r, "maxwait_us")? / 1e6,
            })
        })
        .collect()
}

/// One row of `SHOW STATS`: a database's totals since PgBouncer started.
#[derive(Clone, Debug, PartialEq)]
pub struct Stats {
    pub database: String,
    pub transactions: f64,
    pub queries: f64,
    /// Time clients waited for a server, in seconds (`total_wait_time` is microseconds).
    pub wait_seconds: f64,
}

/// The rows of `SHOW STATS`.
///
/// # Errors
/// As [`pools`].
pub fn stats(table: &Table) -> Result<Vec<Stats>, Error> {
    const SHOW: &str = "SHOW STATS";
    table.index(SHOW, "database")?;
    table
        .records()
        .map(|r| {
            Ok(Stats {
                database: r.get("database").copied().unwrap_or_default().to_string(),
                transactions: number(SHOW, &r, "total_xact_count")?,
                queries: number(SHOW, &r, "total_query_count")?,
                wait_seconds: number(SHOW, &r, "total_wait_time")? / 1e6,
            })
        })
        .collect()
}

/// The socket PgBouncer listens on in `dir` for `port`.
pub fn socket_path(dir: &Path, port: u16) -> PathBuf {
    dir.join(format!(".s.PGSQL.{port}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `SHOW POOLS` of PgBouncer 1.24, columns in its order.
    fn show_pools() -> Table {
        Table::new(
            &[
                "database",
                "user",
                "cl_active",
                "cl_waiting",
                "cl_active_cancel_req",
                "cl_waiting_cancel_req",
                "sv_active",
                "sv_active_cancel",
                "sv_being_canceled",
                "sv_idle",
                "sv_used",
                "sv_tested",
                "sv_login",
                "maxwait",
                "maxwait_us",
                "pool_mode",
                "load_balance_hosts",
            ],
            &[
                &[
                    "app",
                    "alice",
                    "3",
                    "2",
                    "0",
                    "0",
                    "3",
                    "0",
                    "0",
                    "1",
                    "4",
                    "0",
                    "0",
                    "1",
                    "500000",
                    "transaction",
                    "",
                ],
                &[
                    "pgbouncer",
                    "pgbouncer",
                    "1",
                    "0",
                    "0",
                    "0",
                    "0",
                    "0",
                    "0",
                    "0",
                    "0",
                    "0",
                    "0",
                    "0",
                    "0",
                    "statement",
                    "",
                ],
            ],
        )
    }

    #[test]
    fn show_pools_reads_by_column_name() {
        let pools = pools(&show_pools()).unwrap();
        assert_eq!(
            pools[0],
            Pool {
                database: "app".into(),
                user: "alice".into(),
                cl_active: 3.0,
                cl_waiting: 2.0,
                sv_active: 3.0,
                sv_idle: 1.0,
                sv_used: 4.0,
                max_wait_seconds: 1.5,
            }
        );
        assert_eq!(pools[1].database, "pgbouncer");
    }

    #[test]
    fn columns_in_another_order_or_unknown_ones_read_the_same() {
        let table = Table::new(
            &[
                "future_column",
                "maxwait",
                "user",
                "sv_idle",
                "database",
                "cl_active",
            ],
            &[&["x", "2", "bob", "7", "db", "1"]],
        );
        let pools = pools(&table).unwrap();
        assert_eq!(pools[0].user, "bob");
        assert_eq!(pools[0].database, "db");
        assert_eq!(pools[0].sv_idle, 7.0);
        assert_eq!(pools[0].cl_active, 1.0);
        assert_eq!(
            pools[0].max_wait_seconds, 2.0,
            "no maxwait_us: whole seconds"
        );
        assert_eq!(pools[0].sv_active, 0.0, "missing: 0");
    }

    #[test]
    fn a_table_without_its_key_columns_or_with_text_for_a_number_is_an_error() {
        let no_user = Table::new(&["database", "cl_active"], &[&["db", "1"]]);
        assert!(matches!(
            pools(&no_user),
            Err(Error::MissingColumn { column: "user", .. })
        ));
        let text = Table::new(&["database", "user", "cl_active"], &[&["db", "u", "many"]]);
        assert!(matches!(pools(&text), Err(Error::NotANumber { .. })));
    }

    #[test]
    fn show_stats_totals_in_seconds() {
        let table = Table::new(
            &[
                "database",
                "total_server_assignment_count",
                "total_xact_count",
                "total_query_count",
                "total_received",
                "total_sent",
                "total_xact_time",
                "total_query_time",
                "total_wait_time",
                "avg_xact_count",
            ],
            &[&["app", "9", "10", "25", "1", "2", "3", "4", "2500000", "0"]],
        );
        assert_eq!(
            stats(&table).unwrap(),
            [Stats {
                database: "app".into(),
                transactions: 10.0,
                queries: 25.0,
                wait_seconds: 2.5,
            }]
        );
    }
}
