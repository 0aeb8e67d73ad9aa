//! PostgresCluster backups on the real node, against a real S3 server (S3Proxy): base backups
//! and WAL archiving, point-in-time restore checked row by row, a primary killed mid-backup
//! and mid-archiving. Major upgrades are in `postgres_upgrade`; the failover tests in
//! `postgres_cluster`. The three binaries share [`postgres::Cluster`] and take turns on the
//! machine's one real node (each within the per-binary time limit).

#![allow(clippy::unwrap_used)] // tests fail loudly

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kube::ResourceExt;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use serde_json::json;
use steward_testenv::eventually;

#[path = "support/postgres.rs"]
mod postgres;
#[path = "support/real_node.rs"]
mod support;
use postgres::*;
use support::{WAIT, connect, logs};

/// Continuous backup against a real S3 server (S3Proxy on the node's bridge address):
/// WAL is archived and reported, a `PostgresBackup` streams a base backup, a new cluster
/// restores it and replays the archive up to a point in time (rows committed before it are
/// there, the row committed after is not, the superuser password is the new cluster's),
/// retention removes the oldest backup from the store and the API, and a backup of a cluster
/// without `spec.backup` fails saying why.
#[tokio::test]
async fn postgres_cluster_backs_up_to_object_storage_and_restores_to_a_point_in_time() {
    use database_operator::crd::PostgresBackup;
    use steward_pg_instance::contract::BackupPhase;

    let _turn = NODE.lock().await;
    let mut cluster = Cluster::new("rn-pgb", 1).await;
    let (s3, object_store, store) = object_store(&cluster, "pg").await;
    let path = format!("{}/pg", cluster.ns);
    cluster
        .create(json!({"backup": {"objectStore": object_store, "keep": 2}}))
        .await;

    // Archiving works from the start (the new primary switches WAL files at once).
    let archived = archiving(&cluster, &s3).await;
    assert!(archived.last_archived_wal.is_some(), "{archived:?}");

    let db = connect(&cluster.cluster_ip("pg-rw").await, &cluster.password)
        .await
        .unwrap();
    db.batch_execute("create table proof (v text); insert into proof values ('before-backup')")
        .await
        .unwrap();
    create_backup(&cluster, "first", "pg").await;
    let first = completed_backup(&cluster, "first").await;
    assert!(first.size.unwrap_or(0) > 0, "{first:?}");
    assert!(
        first.begin_lsn.is_some() && first.timeline == Some(1),
        "{first:?}"
    );
    assert_eq!(
        first.location.as_deref(),
        Some(format!("s3://steward-backups/{path}/base/first/").as_str())
    );

    // Rows after the backup: one before the recovery target, one after it.
    db.batch_execute("insert into proof values ('wanted')")
        .await
        .unwrap();
    let target: String = server_clock(&db).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    db.batch_execute("insert into proof values ('too-late')")
        .await
        .unwrap();
    archive_now(&cluster, &db).await;

    // A new cluster from the backup, up to the target.
    let (copy, took) = restore(
        &cluster,
        "restored",
        json!({"objectStore": object_store, "targetTime": target}),
    )
    .await;
    eprintln!("restored to {target} in {took:.1?}");
    let rows: Vec<String> = copy
        .query("select v from proof order by v", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(rows, ["before-backup", "wanted"], "restored to {target}");
    copy.batch_execute("insert into proof values ('restored accepts writes')")
        .await
        .unwrap();

    // Credentials that do not exist: the cluster says so before any pod waits for them.
    let mut missing = object_store.clone();
    missing["credentialsSecret"] = json!("no-such-secret");
    let nocreds = cluster.manifest("nocreds", 1, json!({"backup": {"objectStore": missing}}));
    steward_testenv::manifests::apply(&cluster.client, &nocreds, None, "real-node-test", false)
        .await
        .unwrap();
    let refused = eventually("nocreds says its Secret is missing", WAIT, || {
        let clusters = cluster.clusters();
        async move {
            let status = status_of(&clusters, "nocreds").await?;
            status
                .conditions
                .iter()
                .find(|c| c.type_ == "Ready" && c.reason == "MissingReference")
                .map(|c| c.message.clone())
                .ok_or_else(|| format!("{:?}", status.conditions))
        }
    })
    .await
    .unwrap();
    assert_eq!(
        refused,
        "spec.backup.objectStore.credentialsSecret: Secret no-such-secret does not exist"
    );
    let sets: Api<k8s_openapi::api::apps::v1::StatefulSet> =
        Api::namespaced(cluster.client.clone(), &cluster.ns);
    assert!(
        sets.get_opt("nocreds").await.unwrap().is_none(),
        "no pod is started without its credentials"
    );

    // A backup of a cluster with nowhere to put it fails and says why.
    create_backup(&cluster, "nowhere", "restored").await;
    let backups: Api<PostgresBackup> = Api::namespaced(cluster.client.clone(), &cluster.ns);
    let failed = eventually("PostgresBackup nowhere failed", WAIT, || {
        let backups = backups.clone();
        async move {
            let status = backups
                .get("nowhere")
                .await
                .map_err(|e| e.to_string())?
                .status
                .unwrap_or_default();
            if status.phase == Some(BackupPhase::Failed) {
                Ok(status)
            } else {
                Err(format!("{status:?}"))
            }
        }
    })
    .await
    .unwrap();
    assert!(
        failed
            .message
            .as_deref()
            .unwrap_or("")
            .contains("has no spec.backup"),
        "{failed:?}"
    );

    // Retention (keep 2): a third backup removes the first from the store and the API.
    create_backup(&cluster, "second", "pg").await;
    completed_backup(&cluster, "second").await;
    create_backup(&cluster, "third", "pg").await;
    completed_backup(&cluster, "third").await;
    let in_store: Vec<String> = store
        .base_backups()
        .await
        .unwrap()
        .into_iter()
        .map(|b| b.name)
        .collect();
    if in_store != ["second", "third"] {
        panic!(
            "retention kept {in_store:?}, not [second, third]\n{}\nS3 server:\n{}",
            cluster.logs().await,
            std::fs::read_to_string(s3.log()).unwrap_or_default()
        );
    }
    eventually("PostgresBackup first deleted", WAIT, || {
        let backups = backups.clone();
        async move {
            match backups.get_opt("first").await.map_err(|e| e.to_string())? {
                None => Ok(()),
                Some(_) => Err("still there".to_string()),
            }
        }
    })
    .await
    .unwrap();
    eventually("status.backup names the third backup", WAIT, || {
        let clusters = cluster.clusters();
        async move {
            let status = status_of(&clusters, "pg").await?.backup.unwrap_or_default();
            if status.last_base_backup.as_deref() == Some("third") {
                Ok(())
            } else {
                Err(format!("{status:?}"))
            }
        }
    })
    .await
    .unwrap();

    // A schedule (every minute) makes a PostgresBackup owned by the cluster, which completes.
    cluster
        .clusters()
        .patch(
            "pg",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"backup": {"schedule": "* * * * *"}}})),
        )
        .await
        .unwrap();
    let scheduled = eventually(
        "a scheduled PostgresBackup",
        Duration::from_secs(100),
        || {
            let backups = backups.clone();
            async move {
                let list = backups
                    .list(&Default::default())
                    .await
                    .map_err(|e| e.to_string())?;
                list.items
                    .into_iter()
                    .find(|b| {
                        b.name_any().starts_with("pg-20")
                            && b.owner_references()
                                .iter()
                                .any(|o| o.kind == "PostgresCluster")
                    })
                    .map(|b| b.name_any())
                    .ok_or_else(|| "none yet".to_string())
            }
        },
    )
    .await
    .unwrap();
    completed_backup(&cluster, &scheduled).await;
    cluster.stop_operator().await;
}

/// The ids in `acks` on `db`, sorted.
async fn ack_ids(db: &tokio_postgres::Client) -> Vec<i64> {
    db.query("select id from acks order by id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// Seconds between two RFC 3339 timestamps.
fn seconds_between(from: &str, to: &str) -> f64 {
    let parse = |t: &str| t.parse::<k8s_openapi::jiff::Timestamp>().unwrap();
    (parse(to) - parse(from))
        .total(k8s_openapi::jiff::Unit::Second)
        .unwrap()
}

/// Rows of the generated table the backup-under-writes test backs up: 500 000 (about 52 MB)
/// in the test command; `STEWARD_BACKUP_ROWS=2500000` (about 261 MB) for the figures in docs/postgres.md.
fn generated_rows() -> u64 {
    std::env::var("STEWARD_BACKUP_ROWS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(500_000)
}

/// A base backup of a database of about 250 MB taken while a client inserts a row every
/// 50 ms, the client paused a moment to read the server's clock (T), then writing on:
/// restored to T, a new cluster holds exactly the rows acknowledged before T (compared id by
/// id; none after); restored to the end of the archive, every acknowledged row. Prints the
/// backup's throughput and the restore's time for that size (the figures in docs/postgres.md).
#[tokio::test]
async fn postgres_cluster_backs_up_under_writes_and_restores_exactly_the_acknowledged_rows() {
    let _turn = NODE.lock().await;
    let mut cluster = Cluster::new("rn-pgw", 1).await;
    let (s3, object_store, _store) = object_store(&cluster, "pg").await;
    cluster
        .create(json!({"backup": {"objectStore": object_store}}))
        .await;
    archiving(&cluster, &s3).await;
    let rw = cluster.cluster_ip("pg-rw").await;
    let db = connect(&rw, &cluster.password).await.unwrap();
    let generated = Instant::now();
    db.batch_execute(&format!(
        "create table acks (id bigint primary key); \
         create table bulk as select g as id, md5(g::text) || md5((g + 1)::text) as v \
           from generate_series(1, {}) g; \
         checkpoint",
        generated_rows()
    ))
    .await
    .unwrap();
    let (db_bytes, bulk_rows): (i64, i64) = {
        let row = db
            .query_one(
                "select pg_database_size('postgres'), (select count(*) from bulk)",
                &[],
            )
            .await
            .unwrap();
        (row.get(0), row.get(1))
    };
    let mb = |bytes: f64| bytes / 1_000_000.0;
    eprintln!(
        "generated {:.0} MB ({bulk_rows} rows) in {:.1?}",
        mb(db_bytes as f64),
        generated.elapsed()
    );
    // The WAL of the generated rows is archived before the clock starts.
    archive_now(&cluster, &db).await;

    let acks = Arc::new(Mutex::new(Acks::default()));
    let stop = tokio_util::sync::CancellationToken::new();
    let gate = Arc::new(tokio::sync::Mutex::new(()));
    let writing = tokio::spawn(gated_writer(
        rw.clone(),
        cluster.password.clone(),
        acks.clone(),
        stop.clone(),
        gate.clone(),
    ));
    let acked = |n: usize| {
        let acks = acks.clone();
        async move {
            let have = acks.lock().unwrap().rows.len();
            if have >= n {
                Ok(have)
            } else {
                Err(format!("{have} of {n} acknowledged writes"))
            }
        }
    };
    eventually("writes before the backup", WAIT, || acked(10))
        .await
        .unwrap();
    create_backup(&cluster, "under-writes", "pg").await;
    let backup = completed_backup(&cluster, "under-writes").await;
    let during = acks.lock().unwrap().rows.len();
    let seconds = seconds_between(
        backup.started_at.as_deref().unwrap(),
        backup.completed_at.as_deref().unwrap(),
    );
    let compressed = backup.size.unwrap_or(0) as f64;
    eprintln!(
        "base backup of a {:.0} MB database under writes: {seconds:.1} s, {:.1} MB/s ({:.0} MB compressed in the store); {during} rows acknowledged by then",
        mb(db_bytes as f64),
        mb(db_bytes as f64) / seconds,
        mb(compressed)
    );
    eventually("writes after the backup", WAIT, || acked(during + 40))
        .await
        .unwrap();

    // T: read while no insert is in flight, so no commit is near it.
    let paused = gate.lock().await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let target: String = server_clock(&db).await;
    let (before_target, unsure_before): (Vec<i64>, Vec<i64>) = {
        let a = acks.lock().unwrap();
        (a.rows.iter().map(|r| r.0).collect(), a.unsure.clone())
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    drop(paused);
    let at_target = before_target.len();
    eventually("writes after T", WAIT, || acked(at_target + 40))
        .await
        .unwrap();
    stop.cancel();
    writing.await.unwrap();
    let (all, unsure): (Vec<i64>, Vec<i64>) = {
        let a = acks.lock().unwrap();
        (a.rows.iter().map(|r| r.0).collect(), a.unsure.clone())
    };
    // Everything acknowledged is in an archived WAL file.
    archive_now(&cluster, &db).await;

    // The end of the archive: every acknowledged row (and no row never attempted).
    let (latest, restore_took) =
        restore(&cluster, "latest", json!({"objectStore": object_store})).await;
    let restored = ack_ids(&latest).await;
    let missing: Vec<i64> = all
        .iter()
        .filter(|id| restored.binary_search(id).is_err())
        .copied()
        .collect();
    assert!(
        missing.is_empty(),
        "acknowledged rows missing from the restore to the latest: {missing:?}"
    );
    let unknown: Vec<i64> = restored
        .iter()
        .filter(|id| !all.contains(id) && !unsure.contains(id))
        .copied()
        .collect();
    assert!(unknown.is_empty(), "rows never written: {unknown:?}");
    let bulk: i64 = latest
        .query_one("select count(*) from bulk", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(bulk, bulk_rows);
    eprintln!(
        "restored a {:.0} MB database (backup + archive to the end: {} acknowledged rows, all there) in {restore_took:.1?} from creation to Ready",
        mb(db_bytes as f64),
        all.len()
    );
    drop(latest);
    cluster
        .clusters()
        .delete("latest", &DeleteParams::default())
        .await
        .unwrap();

    // T: exactly the rows acknowledged before it.
    let to_target = json!({"objectStore": object_store, "targetTime": target});
    let (at_t, took) = restore(&cluster, "to-t", to_target).await;
    let restored = ack_ids(&at_t).await;
    let unsure_ok = |id: &i64| unsure_before.contains(id);
    let expected: Vec<i64> = before_target.clone();
    let extra: Vec<i64> = restored
        .iter()
        .filter(|id| expected.binary_search(id).is_err() && !unsure_ok(id))
        .copied()
        .collect();
    let missing: Vec<i64> = expected
        .iter()
        .filter(|id| restored.binary_search(id).is_err())
        .copied()
        .collect();
    assert!(
        extra.is_empty() && missing.is_empty(),
        "restored to {target}: rows after T {extra:?}, rows acknowledged before T missing {missing:?}"
    );
    eprintln!(
        "restored to T = {target} in {took:.1?}: exactly the {} rows acknowledged before T ({} acknowledged after T absent; {} unsure writes)",
        expected.len(),
        all.len() - expected.len(),
        unsure.len()
    );
    cluster.stop_operator().await;
}

/// Host pids of every process of `pod`: its instance manager and all its descendants (the
/// watchdog, PostgreSQL and its children; found by parent, since PostgreSQL's process titles
/// overwrite the environment that [`Cluster::processes`] looks for).
fn pod_processes(cluster: &Cluster, pod: &str) -> Vec<u32> {
    let (manager, _) = cluster.processes(pod);
    let parents: Vec<(u32, u32)> = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_string_lossy().parse::<u32>().ok())
        .filter_map(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            let ppid = stat
                .rsplit(')')
                .next()?
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()?;
            Some((pid, ppid))
        })
        .collect();
    let mut found = vec![manager];
    let mut i = 0;
    while i < found.len() {
        let parent = found[i];
        found.extend(
            parents
                .iter()
                .filter(|(_, pp)| *pp == parent)
                .map(|(p, _)| *p),
        );
        i += 1;
    }
    found
}

/// Kills the primary `old` the hard way, like a node lost mid-flight: every process of its pod
/// is stopped at once (SIGSTOP: its manager cannot renew the Lease, PostgreSQL can neither
/// archive nor answer), another instance takes over and accepts writes through the `-rw`
/// Service (a row `-1` in table `marks`), then `old`'s instance manager (PID 1 of its container) is killed and the
/// processes let go, so the kills land; the container starts again as a former primary.
/// Returns the new primary.
async fn kill_primary(cluster: &Cluster, old: &str) -> String {
    // Twice: a process forked while the first signals went out is stopped too.
    let mut stopped = Vec::new();
    for _ in 0..2 {
        for pid in pod_processes(cluster, old) {
            let _ = std::process::Command::new("kill")
                .args(["-STOP", &pid.to_string()])
                .status();
            stopped.push(pid);
        }
    }
    let (manager, _) = cluster.processes(old);
    let rw = cluster.cluster_ip("pg-rw").await;
    let password = cluster.password.clone();
    let old_ip = cluster
        .pods()
        .get(old)
        .await
        .unwrap()
        .status
        .unwrap()
        .pod_ip
        .unwrap();
    let taken = eventually(
        &format!("another primary than {old} writes"),
        Duration::from_secs(120),
        || {
            let (rw, password, old_ip) = (rw.clone(), password.clone(), old_ip.clone());
            async move {
                let conn = format!(
                    "host={rw} port=5432 user=postgres password={password} dbname=postgres connect_timeout=2"
                );
                // A stopped server completes the TCP handshake and then never answers.
                let attempt = async {
                    let (db, connection) = tokio_postgres::connect(&conn, tokio_postgres::NoTls)
                        .await
                        .map_err(|e| e.to_string())?;
                    tokio::spawn(connection);
                    db.query_one(
                        "insert into marks values (-1) returning host(inet_server_addr())",
                        &[],
                    )
                    .await
                    .map_err(|e| e.to_string())
                };
                let row = tokio::time::timeout(Duration::from_secs(3), attempt)
                    .await
                    .map_err(|_| "no answer within 3 s".to_string())??;
                let server: String = row.get(0);
                if server == old_ip {
                    Err("still the old primary".to_string())
                } else {
                    Ok(server)
                }
            }
        },
    )
    .await;
    signal(manager, "KILL");
    for pid in stopped {
        let _ = std::process::Command::new("kill")
            .args(["-CONT", &pid.to_string()])
            .status();
    }
    if let Err(e) = taken {
        panic!("{e}\n{}", cluster.logs().await);
    }
    let (new, _) = cluster.primary().await;
    new
}

/// The status of PostgresBackup `name` once it is `Failed`.
async fn failed_backup(cluster: &Cluster, name: &str) -> steward_pg_instance::contract::BackupRun {
    match ended_backup(cluster, name).await {
        Err(failed) => failed,
        Ok(completed) => panic!("{name} completed, it should have failed: {completed:?}"),
    }
}

/// A PostgresCluster of 2 instances loses its primary twice, the hard way ([`kill_primary`]):
/// once while a `PostgresBackup` streams, once while its WAL archiver is 5 segments behind
/// (held back with SIGSTOP, as a slow object store would). The interrupted backup is `Failed`
/// saying why, the next backup completes on the new timeline; the archive has every WAL
/// segment a recovery from the first backup reads, across both timeline switches (listed from
/// the store, checked with the newest timeline's history); and a cluster restored to a time
/// after the last rows (from the backup taken after the first kill) replays the segments the
/// second killed primary had not archived, and has every row.
#[tokio::test]
async fn postgres_cluster_survives_its_primary_killed_mid_backup_and_mid_archiving_without_a_wal_gap()
 {
    use steward_pg_instance::archive;
    let _turn = NODE.lock().await;
    let mut cluster = Cluster::new("rn-pgk", 2).await;
    let (s3, object_store, store) = object_store(&cluster, "pg").await;
    // A small wal_keep_size: the primary soon removes WAL a lagging replica needs (step 3).
    cluster
        .create(json!({
            "backup": {"objectStore": object_store},
            "parameters": {"wal_keep_size": "32MB"},
        }))
        .await;
    archiving(&cluster, &s3).await;
    let rw = cluster.cluster_ip("pg-rw").await;
    let db = connect(&rw, &cluster.password).await.unwrap();
    db.batch_execute(
        "create table marks (id int); \
         create table bulk as select g as id, md5(g::text) || md5((g + 1)::text) as v \
           from generate_series(1, 2000000) g",
    )
    .await
    .unwrap();
    archive_now(&cluster, &db).await;
    drop(db);
    create_backup(&cluster, "first", "pg").await;
    let first = completed_backup(&cluster, "first").await;
    let start_wal = archive::wal_file_name(
        first.timeline.unwrap(),
        first.begin_lsn.as_deref().unwrap().parse().unwrap(),
    );

    // 1. Killed while a base backup streams.
    let (old, old_ip) = cluster.primary().await;
    let on_old = connect(&old_ip, &cluster.password).await.unwrap();
    create_backup(&cluster, "interrupted", "pg").await;
    let streaming = eventually("the base backup streams the data files", WAIT, || {
        let on_old = &on_old;
        async move {
            let phase: Option<String> = on_old
                .query_opt("select phase from pg_stat_progress_basebackup", &[])
                .await
                .map_err(|e| e.to_string())?
                .map(|r| r.get(0));
            match phase.as_deref() {
                Some("streaming database files") => Ok(()),
                other => Err(format!("phase {other:?}")),
            }
        }
    })
    .await;
    if let Err(e) = streaming {
        panic!("{e}\n{}", cluster.logs().await);
    }
    drop(on_old);
    let new = kill_primary(&cluster, &old).await;
    let interrupted = failed_backup(&cluster, "interrupted").await;
    let why = interrupted.message.clone().unwrap_or_default();
    assert!(
        why.contains("during the backup") || why.contains("pg_basebackup"),
        "the reason: {interrupted:?}"
    );
    eprintln!("{old} killed during a base backup; {new} took over; the backup failed: {why}");
    cluster.wait_ready(Duration::from_secs(240)).await;
    create_backup(&cluster, "after-backup-kill", "pg").await;
    let second = completed_backup(&cluster, "after-backup-kill").await;
    assert!(second.timeline.unwrap() >= 2, "{second:?}");

    // 2. Killed with 5 WAL segments of rows not archived yet.
    let (old, old_ip) = cluster.primary().await;
    let (_, postmaster) = cluster.processes(&old);
    let archiver = pod_processes(&cluster, &old)
        .into_iter()
        .find(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains("archiver"))
        })
        .unwrap_or_else(|| panic!("no archiver under {old}'s postmaster {postmaster}"));
    signal(archiver, "STOP");
    let on_old = connect(&old_ip, &cluster.password).await.unwrap();
    for i in 1..=5 {
        on_old
            .batch_execute(&format!(
                "insert into marks select {i} from generate_series(1, 1000); select pg_switch_wal()"
            ))
            .await
            .unwrap();
    }
    let target: String = server_clock(&on_old).await;
    // The replica has every row (asynchronous replication must not lose them on top).
    let caught_up = eventually("the replica replayed the marks", WAIT, || {
        let on_old = &on_old;
        async move {
            let behind: bool = on_old
                .query_one(
                    "select coalesce(bool_or(replay_lsn < pg_current_wal_lsn()), true) from pg_stat_replication",
                    &[],
                )
                .await
                .map_err(|e| e.to_string())?
                .get(0);
            if behind { Err("behind".to_string()) } else { Ok(()) }
        }
    })
    .await;
    if let Err(e) = caught_up {
        panic!("{e}\n{}", cluster.logs().await);
    }
    let (current, archived): (String, Option<String>) = {
        let row = on_old
            .query_one(
                "select pg_walfile_name(pg_current_wal_lsn()), last_archived_wal from pg_stat_archiver",
                &[],
            )
            .await
            .unwrap();
        (row.get(0), row.get(1))
    };
    drop(on_old);
    let new = kill_primary(&cluster, &old).await;
    eprintln!(
        "{old} killed with its archiver at {archived:?} and WAL at {current}; {new} took over"
    );
    cluster.wait_ready(Duration::from_secs(240)).await;
    // Back as a replica, the killed primary archived what it had not (no one else would: the
    // new primary streamed those segments, and a replica's PostgreSQL does not archive).
    let rejoined = logs(&cluster.pods(), &old).await;
    let leftover = rejoined
        .lines()
        .find(|l| l.contains("archived the WAL this instance had not archived"))
        .unwrap_or_else(|| panic!("{old} did not archive its leftover WAL:\n{rejoined}"));
    eprintln!("{old} after its restart: {leftover}");
    // It rejoined by pg_rewind, reading back from the archive its own WAL that pg_rewind's
    // crash recovery had checkpointed away; before, the rewind failed on the missing segment
    // and the instance was cloned afresh (a copy of the whole database).
    assert!(
        rejoined.contains("pg_rewind finished") && !rejoined.contains("cloning the primary afresh"),
        "{old} rejoined by pg_rewind, not by a new copy:\n{rejoined}"
    );
    let db = connect(&rw, &cluster.password).await.unwrap();
    archive_now(&cluster, &db).await;
    create_backup(&cluster, "after-archive-kill", "pg").await;
    let third = completed_backup(&cluster, "after-archive-kill").await;
    assert!(third.timeline.unwrap() >= 3, "{third:?}");

    // No gap from the first backup's start to the newest archived segment.
    // WAL is kept per PostgreSQL system: the one the archive names, which every backup is of.
    let system = store
        .system()
        .await
        .unwrap()
        .expect("the archive names the system archiving to it");
    let of_system = store.base_backups().await.unwrap();
    assert!(
        of_system
            .iter()
            .all(|b| b.system_identifier.as_deref() == Some(system.as_str())),
        "every base backup is of system {system}: {of_system:?}"
    );
    let archived = store.wal_files(&system).await.unwrap();
    let newest = archived
        .iter()
        .filter_map(|n| archive::parse_segment(n))
        .map(|(t, _)| t)
        .max()
        .unwrap();
    let history_file = tempfile::NamedTempFile::new().unwrap();
    assert!(
        archive::fetch_wal(
            &store,
            &system,
            &format!("{newest:08X}.history"),
            history_file.path()
        )
        .await
        .unwrap(),
        "timeline {newest}'s history is archived: {archived:?}"
    );
    let history = archive::parse_history(&std::fs::read_to_string(history_file.path()).unwrap());
    let gaps = archive::wal_gaps(&archived, &start_wal, &history);
    assert!(
        gaps.is_empty(),
        "WAL segments missing from the archive from {start_wal} on (history {history:?}): {gaps:?}\narchived: {archived:?}\n{}",
        cluster.logs().await
    );
    eprintln!(
        "the archive is continuous from {start_wal} to timeline {newest} ({} files, history {history:?})",
        archived.len()
    );

    // A recovery to T reads the segments the killed primary had not archived.
    let to_target = json!({"objectStore": object_store, "targetTime": target});
    let (copy, took) = restore(&cluster, "replayed", to_target).await;
    let marks: Vec<(i32, i64)> = copy
        .query(
            "select id, count(*) from marks where id > 0 group by id order by id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        marks,
        (1..=5).map(|i| (i, 1000)).collect::<Vec<_>>(),
        "restored to {target}"
    );
    eprintln!(
        "restored to {target} (from the backup after the first kill, through the segments the second killed primary had not archived) in {took:.1?}"
    );

    // 3. A replica further behind than the primary keeps WAL catches up from the archive.
    a_replica_behind_the_primarys_wal_catches_up_from_the_archive(&cluster, &rw).await;
    cluster.stop_operator().await;
}

/// A replica whose WAL receiver hung while the primary wrote far more than `wal_keep_size`
/// (32 MB) and checkpointed: the primary no longer has the WAL it needs, the archive does.
/// The replica replays it from there (its `restore_command`) and streams again — no copy of
/// the whole database. Before (issue #37, item 5) a replica had no `restore_command`: it
/// could not catch up at all, and since then it was cloned afresh.
async fn a_replica_behind_the_primarys_wal_catches_up_from_the_archive(
    cluster: &Cluster,
    rw: &str,
) {
    let (primary, _) = cluster.primary().await;
    let replica = if primary == "pg-0" { "pg-1" } else { "pg-0" };
    let stopped = Instant::now();
    // Once the archive has the segments, checkpoints remove them from the primary (it keeps
    // WAL it has not archived yet).
    let (_, resumed) = leave_behind(cluster, rw, replica, |db| async move {
        archive_now(cluster, &db).await;
        db.batch_execute("checkpoint; select pg_switch_wal(); checkpoint")
            .await
            .unwrap();
    })
    .await;
    reads_after_the_gap(cluster).await;
    // What the replica said since its WAL receiver stopped.
    let since = kube::api::LogParams {
        since_seconds: Some(i64::try_from(stopped.elapsed().as_secs()).unwrap_or(i64::MAX) + 1),
        ..Default::default()
    };
    let log = cluster.pods().logs(replica, &since).await.unwrap();
    assert!(
        log.contains("has already been removed")
            && log.contains("from archive")
            && !log.contains("cloning the primary afresh"),
        "{replica} fell behind the primary's WAL and caught up from the archive, not by a new copy; since its WAL receiver stopped ({:?} ago):\n{log}\nits whole log:\n{}",
        stopped.elapsed(),
        logs(&cluster.pods(), replica).await
    );
    eprintln!(
        "{replica}, behind by more than wal_keep_size, replayed the archive and reads the row written after the gap {:.1?} after its WAL receiver resumed",
        resumed.elapsed()
    );
}
