//! The database-operator SIGKILLed at random moments while Databases and DatabaseRoles are
//! created and deleted (mixed `Retain`/`Delete`, all on one shared server), then the server's
//! catalog compared with what the policies promise.
//!
//! Fault: SIGKILL of the operator process (no drain, no Lease release), restarted at once.
//! Invariant: at the end 0 leaked (policy `Delete` but still on the server), 0 wrongly dropped
//! (`Retain` but gone), 0 stuck (objects that never finished deleting). Figures: cycles, kills.
//!
//! `STEWARD_CHAOS_CYCLES` sets the number of create/delete cycles (default 100, in 4 lanes: the
//! short run `cargo xtask test` makes; `STEWARD_CHAOS_CYCLES=1000` for a soak).

#![allow(clippy::unwrap_used)] // tests fail loudly

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use database_operator::crd::{
    Database, DatabaseRole, DatabaseRoleSpec, DatabaseSpec, DeletionPolicy, ExternalServer,
    LocalRef, Privileges,
};
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, DeleteParams, PostParams};
use kube::{Client, CustomResourceExt};
use serde_json::json;
use steward_testenv::eventually;
use steward_testenv::postgres::Postgres;

const LANES: usize = 4;

fn cycles() -> usize {
    std::env::var("STEWARD_CHAOS_CYCLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100)
}

/// A cheap deterministic generator (no seed to keep: the run prints what it did).
fn coin(i: usize, salt: usize) -> bool {
    (i.wrapping_mul(2_654_435_761) ^ salt.wrapping_mul(40_503)) % 7 < 3
}

/// What one cycle created and which policies it chose.
struct Cycle {
    database: String,
    owner: String,
    role: String,
    database_policy: DeletionPolicy,
    role_policy: DeletionPolicy,
    /// Whether the role was seen Ready (so the database and both roles existed on the
    /// server); an object deleted before it is created on the server has nothing to retain.
    created: bool,
}

async fn run_cycle(client: &Client, ns: &str, pg: &Postgres, i: usize) -> Result<Cycle, String> {
    let database_policy = if coin(i, 1) {
        DeletionPolicy::Retain
    } else {
        DeletionPolicy::Delete
    };
    let role_policy = if coin(i, 2) {
        DeletionPolicy::Retain
    } else {
        DeletionPolicy::Delete
    };
    let cycle = Cycle {
        database: format!("chaos_db_{i}"),
        owner: format!("chaos_owner_{i}"),
        role: format!("chaos_user_{i}"),
        database_policy,
        role_policy,
        created: !coin(i, 3),
    };
    let dbs: Api<Database> = Api::namespaced(client.clone(), ns);
    let roles: Api<DatabaseRole> = Api::namespaced(client.clone(), ns);
    let db = Database::new(
        &format!("db-{i}"),
        DatabaseSpec {
            deletion_policy: database_policy,
            ..DatabaseSpec::on(
                ExternalServer::plain("127.0.0.1", pg.port(), "admin"),
                &cycle.database,
                &cycle.owner,
            )
        },
    );
    let role = DatabaseRole::new(
        &format!("role-{i}"),
        DatabaseRoleSpec {
            database_ref: LocalRef {
                name: format!("db-{i}"),
            },
            role_name: cycle.role.clone(),
            privileges: Privileges::ReadWrite,
            password_rotation: None,
            deletion_policy: role_policy,
            adopt: false,
        },
    );
    dbs.create(&PostParams::default(), &db)
        .await
        .map_err(|e| e.to_string())?;
    roles
        .create(&PostParams::default(), &role)
        .await
        .map_err(|e| e.to_string())?;
    // Ready, or not yet: a kill may come at any moment, deleting early is part of the test.
    let ready = |name: String| {
        let roles = roles.clone();
        async move {
            let r = roles.get(&name).await.map_err(|e| e.to_string())?;
            let ok = r.status.is_some_and(|s| {
                s.conditions
                    .iter()
                    .any(|c| c.type_ == "Ready" && c.status == "True")
            });
            if ok {
                Ok(())
            } else {
                Err("not Ready".to_string())
            }
        }
    };
    if cycle.created {
        eventually(&format!("role-{i} Ready"), Duration::from_secs(120), || {
            ready(format!("role-{i}"))
        })
        .await
        .map_err(|e| e.to_string())?;
    }
    roles
        .delete(&format!("role-{i}"), &DeleteParams::default())
        .await
        .map_err(|e| e.to_string())?;
    dbs.delete(&format!("db-{i}"), &DeleteParams::default())
        .await
        .map_err(|e| e.to_string())?;
    Ok(cycle)
}

/// What both tests need: the operator binary, the control plane with the CRDs, a PostgreSQL
/// server, and a namespace holding its admin Secret `admin`.
struct World {
    binary: std::path::PathBuf,
    cp: &'static steward_testenv::ControlPlane,
    pg: Postgres,
    client: Client,
    ns: String,
}

async fn world(prefix: &str) -> World {
    let binary = steward_testenv::harness::cargo_build()
        .expect("database-operator binary")
        .join("database-operator");
    let cp = steward_testenv::shared().await.expect("control plane");
    for crd in [Database::crd(), DatabaseRole::crd()] {
        cp.apply_crd(&crd).await.expect("CRD");
    }
    let pg = Postgres::start().await.expect("PostgreSQL");
    let client = cp.client().unwrap();
    let ns = cp.namespace(prefix).await.unwrap();
    let admin_secret: Secret = serde_json::from_value(json!({
        "metadata": {"name": "admin"},
        "stringData": {"username": pg.superuser(), "password": pg.password()}
    }))
    .unwrap();
    Api::<Secret>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &admin_secret)
        .await
        .unwrap();
    World {
        binary,
        cp,
        pg,
        client,
        ns,
    }
}

/// The operator as its own process, SIGKILLed and restarted by [`Chaos::kill`]. Every
/// incarnation appends its log (info) to `log`, which a failure quotes.
struct Operator {
    binary: std::path::PathBuf,
    kubeconfig: std::path::PathBuf,
    ns: String,
    log: std::path::PathBuf,
    child: tokio::process::Child,
}

impl Operator {
    fn spawn(
        binary: &std::path::Path,
        kubeconfig: &std::path::Path,
        ns: &str,
        log: &std::path::Path,
    ) -> tokio::process::Child {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .expect("the operator's log file");
        tokio::process::Command::new(binary)
            .args([
                "--kubeconfig",
                &kubeconfig.display().to_string(),
                "--leader-elect=false",
                "--watch-namespace",
                ns,
                "--metrics-bind-address=0",
                "--health-probe-bind-address=0",
                "--resync-interval=2s",
                "--log-level=info",
            ])
            .stdout(log.try_clone().expect("the operator's log file"))
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .expect("start the database-operator")
    }

    async fn kill_and_restart(&mut self) {
        let _ = self.child.start_kill();
        let _ = self.child.wait().await;
        self.child = Self::spawn(&self.binary, &self.kubeconfig, &self.ns, &self.log);
    }
}

async fn exists(client: &tokio_postgres::Client, query: &str, name: &str) -> bool {
    client
        .query_one(query, &[&name])
        .await
        .unwrap()
        .get::<_, bool>(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_sigkills_leak_nothing_drop_nothing_wrongly_and_leave_nothing_stuck() {
    let World {
        binary,
        cp,
        pg,
        client,
        ns,
    } = world("chaos").await;

    let log = std::env::temp_dir().join(format!("database-chaos-{ns}.log"));
    let operator = Arc::new(tokio::sync::Mutex::new(Operator {
        child: Operator::spawn(&binary, cp.kubeconfig_path(), &ns, &log),
        log: log.clone(),
        binary,
        kubeconfig: cp.kubeconfig_path().to_path_buf(),
        ns: ns.clone(),
    }));
    let stop = Arc::new(AtomicBool::new(false));
    let kills = Arc::new(AtomicUsize::new(0));
    let killer = {
        let (operator, stop, kills) = (operator.clone(), stop.clone(), kills.clone());
        tokio::spawn(async move {
            let mut n = 0usize;
            while !stop.load(Ordering::SeqCst) {
                // 0.3–2.4 s between kills.
                let wait = 300 + (n.wrapping_mul(7919) % 2100) as u64;
                tokio::time::sleep(Duration::from_millis(wait)).await;
                operator.lock().await.kill_and_restart().await;
                kills.fetch_add(1, Ordering::SeqCst);
                n += 1;
            }
        })
    };

    let total = cycles();
    let started = Instant::now();
    let next = Arc::new(AtomicUsize::new(0));
    let lanes = (0..LANES).map(|_| {
        let (client, ns, next, pg) = (client.clone(), ns.clone(), next.clone(), &pg);
        async move {
            let mut done = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                if i >= total {
                    break;
                }
                done.push(run_cycle(&client, &ns, pg, i).await.unwrap());
            }
            done
        }
    });
    let cycles_run: Vec<Cycle> = futures::future::join_all(lanes)
        .await
        .into_iter()
        .flatten()
        .collect();
    stop.store(true, Ordering::SeqCst);
    killer.await.unwrap();
    let kills = kills.load(Ordering::SeqCst);

    // Every object finishes deleting (the operator keeps running, no more kills).
    let dbs: Api<Database> = Api::namespaced(client.clone(), &ns);
    let roles: Api<DatabaseRole> = Api::namespaced(client.clone(), &ns);
    let stuck = eventually(
        "every Database and DatabaseRole deleted",
        Duration::from_secs(300),
        || async {
            let d = dbs
                .list(&Default::default())
                .await
                .map_err(|e| e.to_string())?
                .items
                .len();
            let r = roles
                .list(&Default::default())
                .await
                .map_err(|e| e.to_string())?
                .items
                .len();
            if d + r == 0 {
                Ok(())
            } else {
                Err(format!("{d} Databases and {r} DatabaseRoles left"))
            }
        },
    )
    .await;

    let (admin, conn) = tokio_postgres::connect(
        &pg.conn_str("postgres", pg.superuser(), pg.password()),
        tokio_postgres::NoTls,
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    const DB: &str = "SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)";
    const ROLE: &str = "SELECT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = $1)";
    let (mut leaked, mut wrongly_dropped) = (Vec::new(), Vec::new());
    for c in &cycles_run {
        let keep_db = c.database_policy == DeletionPolicy::Retain;
        let keep_role = c.role_policy == DeletionPolicy::Retain;
        for (what, present, keep) in [
            (
                format!("database {}", c.database),
                exists(&admin, DB, &c.database).await,
                keep_db,
            ),
            (
                format!("role {}", c.owner),
                exists(&admin, ROLE, &c.owner).await,
                keep_db,
            ),
            (
                format!("role {}", c.role),
                exists(&admin, ROLE, &c.role).await,
                keep_role,
            ),
        ] {
            // Deleted before it was Ready, under Retain: whether anything was created is a
            // race, and either outcome keeps the promise (Retain keeps what exists).
            if keep && !c.created {
                continue;
            }
            match (keep, present) {
                (false, true) => leaked.push(what),
                (true, false) => wrongly_dropped.push(what),
                _ => {}
            }
        }
    }
    println!(
        "CHAOS: {} create/delete cycles ({LANES} lanes) with {kills} SIGKILLs in {:.0?}: {} leaked, {} wrongly dropped, {} stuck",
        cycles_run.len(),
        started.elapsed(),
        leaked.len(),
        wrongly_dropped.len(),
        stuck
            .as_ref()
            .map_or_else(|e| e.to_string(), |_| "0".into()),
    );
    if !leaked.is_empty() || !wrongly_dropped.is_empty() {
        // What the operator's incarnations logged about the cycles concerned.
        let cycles: Vec<String> = leaked
            .iter()
            .chain(&wrongly_dropped)
            .filter_map(|w| w.rsplit('_').next())
            .map(|i| format!("-{i}"))
            .collect();
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let lines: Vec<&str> = text
            .lines()
            .filter(|l| {
                l.contains("started")
                    || cycles
                        .iter()
                        .any(|c| l.contains(&format!("db{c}")) || l.contains(&format!("role{c}")))
            })
            .collect();
        println!(
            "the operator's log ({}) on those cycles and its starts:\n{}",
            log.display(),
            lines.join("\n")
        );
    }
    assert!(stuck.is_ok(), "stuck: {stuck:?}");
    assert!(leaked.is_empty(), "leaked: {leaked:?}");
    assert!(
        wrongly_dropped.is_empty(),
        "wrongly dropped: {wrongly_dropped:?}"
    );
    assert!(kills > 0, "the operator was killed during the run");
}

/// The Lease holder of `name` in `ns` and when it was acquired (Unix seconds).
async fn holder(client: &Client, ns: &str, name: &str) -> Option<(String, f64)> {
    let lease = Api::<k8s_openapi::api::coordination::v1::Lease>::namespaced(client.clone(), ns)
        .get_opt(name)
        .await
        .ok()??;
    let spec = lease.spec?;
    let acquired = spec
        .acquire_time
        .map(|t| t.0.as_millisecond() as f64 / 1000.0)?;
    Some((spec.holder_identity?, acquired))
}

/// Writes in PostgreSQL's statement log (`%n [%a] ` prefix) sent by `application` after
/// `after` (Unix seconds): the statement texts.
fn writes_after(log: &str, application: &str, after: f64) -> (usize, Vec<String>) {
    let tag = format!("[{application}] ");
    let mut all = 0;
    let mut late = Vec::new();
    for line in log.lines() {
        let Some((time, rest)) = line.split_once(' ') else {
            continue;
        };
        let Some(statement) = rest
            .strip_prefix(&tag)
            .and_then(|r| r.strip_prefix("LOG:  statement: "))
        else {
            continue;
        };
        let write = !statement.trim_start().to_uppercase().starts_with("SELECT");
        if !write {
            continue;
        }
        all += 1;
        if time.parse::<f64>().is_ok_and(|t| t > after) {
            late.push(statement.to_string());
        }
    }
    (all, late)
}

/// Two replicas with 4 s / 3 s / 1 s leases; the leader is paused (SIGSTOP) right after every
/// Database was changed, so it is mid-work; the standby takes over and converges; the old
/// leader wakes. PostgreSQL's own statement log (each statement tagged with the sending
/// replica's identity) shows no write from the paused replica after the takeover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_leader_sends_no_sql_after_another_replica_takes_over() {
    let World {
        binary,
        cp,
        pg,
        client,
        ns,
    } = world("fence").await;
    let replica = || {
        tokio::process::Command::new(&binary)
            .args([
                "--kubeconfig",
                &cp.kubeconfig_path().display().to_string(),
                "--leader-election-namespace",
                &ns,
                "--leader-election-lease-duration=4s",
                "--leader-election-renew-deadline=3s",
                "--leader-election-retry-period=1s",
                "--watch-namespace",
                &ns,
                "--metrics-bind-address=0",
                "--health-probe-bind-address=0",
                "--resync-interval=1s",
                "--log-level=warn",
            ])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("start a replica")
    };
    let _a = replica();
    let pid_a = _a.id().unwrap();
    let (leader, _) = eventually(
        "the first replica leads",
        Duration::from_secs(60),
        || async {
            holder(&client, &ns, database_operator::NAME)
                .await
                .ok_or_else(|| "no Lease yet".to_string())
        },
    )
    .await
    .unwrap();
    let _b = replica();
    let dbs: Api<Database> = Api::namespaced(client.clone(), &ns);
    for i in 0..5 {
        let db = Database::new(
            &format!("fenced-{i}"),
            DatabaseSpec {
                deletion_policy: DeletionPolicy::Delete,
                ..DatabaseSpec::on(
                    ExternalServer::plain("127.0.0.1", pg.port(), "admin"),
                    &format!("fenced_{i}"),
                    &format!("fenced_owner_{i}"),
                )
            },
        );
        dbs.create(&PostParams::default(), &db).await.unwrap();
    }
    let converged = |schemas: usize| {
        let dbs = dbs.clone();
        async move {
            let list = dbs
                .list(&Default::default())
                .await
                .map_err(|e| e.to_string())?;
            let done = list
                .items
                .iter()
                .filter(|d| {
                    d.spec.schemas.len() == schemas
                        && d.status.as_ref().is_some_and(|s| {
                            s.observed_generation == d.metadata.generation
                                && s.conditions
                                    .iter()
                                    .any(|c| c.type_ == "Ready" && c.status == "True")
                        })
                })
                .count();
            if done == 5 {
                Ok(())
            } else {
                Err(format!("{done}/5 converged"))
            }
        }
    };
    eventually("5 Databases Ready", Duration::from_secs(120), || {
        converged(0)
    })
    .await
    .unwrap();

    // Work for the leader, then pause it in the middle of it.
    for i in 0..5 {
        dbs.patch(
            &format!("fenced-{i}"),
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"spec": {"schemas": [{"name": "late"}]}})),
        )
        .await
        .unwrap();
    }
    let stop = std::process::Command::new("kill")
        .args(["-STOP", &pid_a.to_string()])
        .status()
        .unwrap();
    assert!(stop.success());
    let (standby, taken_at) = eventually(
        "the standby takes over",
        Duration::from_secs(60),
        || async {
            match holder(&client, &ns, database_operator::NAME).await {
                Some((h, t)) if h != leader => Ok((h, t)),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await
    .unwrap();
    eventually(
        "the standby converges the change",
        Duration::from_secs(120),
        || converged(1),
    )
    .await
    .unwrap();
    // Wake the old leader and let it run long enough to renew, fail, and step down (it
    // retries every second; nothing it does is visible to wait on).
    let cont = std::process::Command::new("kill")
        .args(["-CONT", &pid_a.to_string()])
        .status()
        .unwrap();
    assert!(cont.success());
    tokio::time::sleep(Duration::from_secs(5)).await;

    let log = pg.log_text();
    let old = database_operator::pg::application_name(&leader);
    let new = database_operator::pg::application_name(&standby);
    let (old_writes, late) = writes_after(&log, &old, taken_at);
    let (new_writes, _) = writes_after(&log, &new, 0.0);
    println!(
        "FENCE: the paused leader sent {old_writes} writes in all, {} after the takeover; the new leader {new_writes}",
        late.len()
    );
    assert!(
        old_writes > 0,
        "the first leader's statements are in the log as {old:?}"
    );
    assert!(
        new_writes > 0,
        "the new leader's statements are in the log as {new:?}"
    );
    assert!(
        late.is_empty(),
        "written after the takeover by the paused leader: {late:?}"
    );
}
