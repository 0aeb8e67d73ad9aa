//! Scenario 8: the database-operator scaled out, `--shards 3` on three replicas
//! (`database_operator::sharding`): `n` Databases and `n` DatabaseRoles on external servers.
//!
//! The Databases are spread over several PostgreSQL servers (each its own process and port, so
//! its own shard key, `external:<host>:<port>`), a DatabaseRole follows its Database. Measured: the
//! convergence of every Database and DatabaseRole (created → all Ready) and each replica's
//! resident memory. Checked: every statement about a shard's objects came from one replica,
//! the holder of that shard's Lease (PostgreSQL logs each statement with the session's
//! `application_name`, `database-operator <identity>`; every name the scenario gives
//! carries its object's number, so a statement or its parameters say whose it is).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use database_operator::crd::ExternalServer;
use database_operator::sharding::server_key;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::Client;
use kube::api::{Api, DeleteParams, DynamicObject, PostParams};
use serde::Serialize;
use serde_json::json;
use steward_core::shard::shard_of;
use steward_testenv::postgres::Postgres;

use super::idle::{create_all, namespace, ready, resource, wait_all};
use super::procs::{Launch, Replica};
use super::sharded::{SHARDS, balanced, holder};

const NAMESPACE: &str = "bench-dbshard";
const ID: &str = "bench-dbshard";
/// The prefix of every name in PostgreSQL the scenario gives (databases, owners, schemas,
/// roles), followed by the object's number.
const PREFIX: &str = "dbs_";

/// What scenario 8 measured.
#[derive(Clone, Debug, Default, Serialize)]
pub struct DbSharded {
    pub databases: usize,
    pub roles: usize,
    /// Distinct external servers (addresses) the objects are spread over.
    pub servers: usize,
    pub shards: u32,
    pub replicas: usize,
    /// Created → every Database and DatabaseRole Ready (seconds).
    pub convergence_secs: f64,
    /// Each replica's resident memory after convergence (bytes).
    pub rss_bytes: Vec<u64>,
    /// Per shard: its servers, objects, Lease holder and the replicas whose sessions ran
    /// statements about its objects.
    pub per_shard: Vec<Shard>,
}

/// One shard of scenario 8.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Shard {
    pub shard: u32,
    pub servers: usize,
    pub databases: usize,
    pub holder: Option<String>,
    pub writers: BTreeSet<String>,
}

impl DbSharded {
    /// Whether every shard's statements came from its Lease holder alone.
    pub fn one_writer_per_shard(&self) -> bool {
        self.per_shard
            .iter()
            .all(|s| s.writers.len() <= 1 && s.writers.iter().all(|w| Some(w) == s.holder.as_ref()))
    }
}

/// The admin Secret of server `k`.
fn admin_secret(k: usize) -> String {
    format!("admin-{k}")
}

/// The numbers of the scenario's objects a PostgreSQL log line names (`dbs_7`,
/// `dbs_owner_7`, `dbs_app_7`, `dbs_reader_7` → 7).
fn numbers(line: &str) -> BTreeSet<usize> {
    let mut out = BTreeSet::new();
    for (i, _) in line.match_indices(PREFIX) {
        let rest = &line[i + PREFIX.len()..];
        let rest = ["owner_", "app_", "reader_"]
            .iter()
            .find_map(|p| rest.strip_prefix(p))
            .unwrap_or(rest);
        let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
        if let Ok(n) = digits.parse() {
            out.insert(n);
        }
    }
    out
}

/// The replica (identity) whose session logged `line`, if it is the database-operator's.
fn session(line: &str) -> Option<&str> {
    let rest = line.split_once("[database-operator ")?.1;
    Some(rest.split_once(']')?.0)
}

/// Runs scenario 8 with `n` Databases and as many DatabaseRoles.
pub(super) async fn measure(
    client: &Client,
    binary: &Path,
    log_dir: &Path,
    kubeconfig: &Path,
    n: usize,
) -> Result<DbSharded> {
    let servers = (n / 25).clamp(3, 12);
    let pgs = futures::future::try_join_all((0..servers).map(|_| Postgres::start()))
        .await
        .context("starting PostgreSQL (the Databases' servers)")?;
    namespace(client, NAMESPACE).await?;
    // An admin Secret per server.
    for (k, pg) in pgs.iter().enumerate() {
        let admin: Secret = serde_json::from_value(json!({
            "metadata": {"name": admin_secret(k)},
            "stringData": {"username": pg.superuser(), "password": pg.password()}
        }))?;
        Api::<Secret>::namespaced(client.clone(), NAMESPACE)
            .create(&PostParams::default(), &admin)
            .await?;
    }

    let launch = Launch {
        binary: binary.to_path_buf(),
        args: vec![
            "--leader-elect=true".into(),
            "--leader-election-namespace=default".into(),
            format!("--leader-election-id={ID}"),
            format!("--shards={SHARDS}"),
            format!("--watch-namespace={NAMESPACE}"),
            "--log-level=warn".into(),
        ],
        log_dir: log_dir.to_path_buf(),
        label: "db-sharded".into(),
    };
    let mut replicas = Vec::new();
    for index in 0..SHARDS as usize {
        let mut r = Replica::spawn(&launch, kubeconfig, index)?;
        r.wait_ready(Duration::from_secs(120)).await?;
        replicas.push(r);
    }
    let leases: Api<Lease> = Api::namespaced(client.clone(), "default");
    balanced(&leases, ID, Duration::from_secs(120)).await?;

    let group = "database.steward.dev";
    let api = |kind: &str, plural: &str| -> Api<DynamicObject> {
        Api::namespaced_with(client.clone(), NAMESPACE, &resource(group, kind, plural))
    };
    let (databases, roles) = (
        api("Database", "databases"),
        api("DatabaseRole", "databaseroles"),
    );
    let meta = |kind: &str, name: String| json!({"apiVersion": format!("{group}/v1alpha1"), "kind": kind, "metadata": {"name": name}});
    let server = |i: usize| {
        let k = i % servers;
        ExternalServer::plain(pgs[k].host(), pgs[k].port(), &admin_secret(k))
    };
    let t0 = Instant::now();
    create_all(
        &databases,
        (0..n)
            .map(|i| {
                let mut o = meta("Database", format!("db-{i}"));
                o["spec"] = json!({"external": serde_json::to_value(server(i))?, "name": format!("{PREFIX}{i}"),
                    "owner": format!("{PREFIX}owner_{i}"), "schemas": [{"name": format!("{PREFIX}app_{i}")}],
                    "deletionPolicy": "Delete", "backupBeforeDelete": false});
                Ok(o)
            })
            .collect::<Result<_>>()?,
    )
    .await?;
    create_all(
        &roles,
        (0..n)
            .map(|i| {
                let mut o = meta("DatabaseRole", format!("reader-{i}"));
                o["spec"] = json!({"databaseRef": {"name": format!("db-{i}")},
                    "roleName": format!("{PREFIX}reader_{i}"), "privileges": "readOnly", "deletionPolicy": "Delete"});
                o
            })
            .collect(),
    )
    .await?;
    let converge = Duration::from_secs(120 + n as u64);
    wait_all("Databases Ready", &databases, n, converge, ready).await?;
    wait_all("DatabaseRoles Ready", &roles, n, converge, ready).await?;
    let mut m = DbSharded {
        databases: n,
        roles: n,
        servers,
        shards: SHARDS,
        replicas: replicas.len(),
        convergence_secs: t0.elapsed().as_secs_f64(),
        ..Default::default()
    };
    for r in &replicas {
        m.rss_bytes.push(r.memory()?.0);
    }

    // Whose sessions ran statements about each shard's objects.
    // An object's shard is its server's: one key per server.
    let server_shards: Vec<u32> = (0..servers)
        .map(|k| shard_of(&server_key(&server(k)), SHARDS))
        .collect();
    let shard_of_object = |i: usize| server_shards[i % servers];
    let mut writers: BTreeMap<u32, BTreeSet<String>> = BTreeMap::new();
    let logs: Vec<String> = pgs.iter().map(Postgres::log_text).collect();
    for line in logs.iter().flat_map(|l| l.lines()) {
        let Some(identity) = session(line) else {
            continue;
        };
        for i in numbers(line).into_iter().filter(|i| *i < n) {
            writers
                .entry(shard_of_object(i))
                .or_default()
                .insert(identity.to_string());
        }
    }
    for shard in 0..SHARDS {
        let of_shard: Vec<usize> = (0..n).filter(|i| shard_of_object(*i) == shard).collect();
        let keys: BTreeSet<usize> = of_shard.iter().map(|i| i % servers).collect();
        m.per_shard.push(Shard {
            shard,
            servers: keys.len(),
            databases: of_shard.len(),
            holder: holder(&leases, ID, shard).await.map(|h| h.0),
            writers: writers.remove(&shard).unwrap_or_default(),
        });
    }

    // Clean up: the operator drops the databases and roles (deletionPolicy Delete).
    let dp = DeleteParams::default();
    for api in [&roles, &databases] {
        api.delete_collection(&dp, &Default::default()).await?;
    }
    let deadline = Instant::now() + converge;
    // A failed list (a connection the API server closed) is retried until the deadline.
    while !databases
        .list(&Default::default())
        .await
        .is_ok_and(|l| l.items.is_empty())
    {
        if Instant::now() > deadline {
            bail!("the Databases were not deleted within {converge:?}");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    for r in replicas {
        r.stop().await?;
    }
    Api::<Namespace>::all(client.clone())
        .delete(NAMESPACE, &dp)
        .await
        .ok();
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::{DbSharded, Shard, numbers, session};

    #[test]
    fn a_second_writer_or_a_writer_without_the_lease_is_caught() {
        let shard = |holder: &str, writers: &[&str]| Shard {
            holder: Some(holder.to_string()),
            writers: writers.iter().map(|w| (*w).to_string()).collect(),
            ..Default::default()
        };
        let of = |shards: Vec<Shard>| DbSharded {
            per_shard: shards,
            ..Default::default()
        };
        assert!(of(vec![shard("a", &["a"]), shard("b", &[])]).one_writer_per_shard());
        assert!(!of(vec![shard("a", &["a", "b"])]).one_writer_per_shard());
        assert!(!of(vec![shard("a", &["b"])]).one_writer_per_shard());
    }

    #[test]
    fn a_log_line_names_its_objects_and_its_session() {
        let line = r#"1765000000.123 [database-operator db-sharded-1] LOG:  statement: GRANT USAGE ON SCHEMA "dbs_app_7" TO "dbs_reader_7""#;
        assert_eq!(numbers(line).into_iter().collect::<Vec<_>>(), [7]);
        assert_eq!(session(line), Some("db-sharded-1"));
        assert_eq!(
            numbers("CREATE DATABASE \"dbs_12\" OWNER \"dbs_owner_3\"")
                .into_iter()
                .collect::<Vec<_>>(),
            [3, 12]
        );
        assert!(numbers("SELECT 1").is_empty());
        assert_eq!(
            session("1765000000.1 [psql] LOG:  statement: SELECT 1"),
            None
        );
    }
}
